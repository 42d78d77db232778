"""The recovery file ``minisparse recover`` writes: what it must hold, checked as it is read.

One safetensors file holds the 2:4 masks of the pruned base (one bit a weight, "mask/<weight
name>"), the LoRA adapters (A [rank, in] and B [out, rank] of every projection) and JSON
metadata (the fine-tune config, the settings, the fingerprint of the model it was trained on).
Nothing in it is guessed: a mask or adapter tensor that is missing, extra, or of another dtype
or shape is one ``ValueError`` naming the first, with the way to remake the file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import Tensor

from ..core.model import Transformer
from ..relufy.finetune import FinetuneConfig
from ..relufy.lora import LORA_TARGETS

__all__ = ["FIX", "check_adapters", "check_masks", "masked_weights", "misfit", "read_adapters"]

FIX = "make them with `minisparse recover`"


def masked_weights(model: Transformer) -> dict[str, Tensor]:
    """The weight of every block projection a mask covers (LoRA's targets) by its mask key,
    "mask/<weight name>"."""
    return {
        f"mask/{name}": p
        for name, p in model.named_parameters()
        if name.rsplit(".", 2)[-2] in LORA_TARGETS and name.endswith(".weight")
    }


def misfit(found: dict[str, Tensor], expected: dict[str, Tensor]) -> tuple[str, str, int] | None:
    """The first problem of ``found`` against ``expected`` (name -> a tensor of the needed
    dtype and shape): ("extra", name, 0) for a name ``expected`` lacks, ("shape", name, 0) for
    another dtype or shape (in ``expected``'s order), ("missing", name, count) for names
    ``found`` lacks; None when every tensor is there as needed."""
    extra = next((name for name in found if name not in expected), None)
    if extra is not None:
        return "extra", extra, 0
    for name, need in expected.items():
        t = found.get(name)
        if t is not None and (t.dtype != need.dtype or t.shape != need.shape):
            return "shape", name, 0
    missing = [name for name in expected if name not in found]
    return ("missing", missing[0], len(missing)) if missing else None


def check_masks(base: Transformer, masks: dict[str, Tensor]) -> None:
    """One ValueError naming the first mask ``base`` cannot take: one for a weight it does not
    have (another architecture, a layer it lacks), one of another size, or a projection of
    ``base`` that has no mask."""
    expected = {
        k: torch.empty(math.ceil(p.numel() / 8), dtype=torch.uint8, device="meta")
        for k, p in masked_weights(base).items()
    }
    problem = misfit(masks, expected)
    if problem is None:
        return
    kind, key, count = problem
    found = masks[key] if key in masks else None
    raise ValueError(
        {
            "extra": f"the file holds {key}, a mask for a weight this model does not have "
            "(another architecture, or a layer it lacks)",
            "shape": f"{key} holds {getattr(found, 'dtype', None)} "
            f"{list(getattr(found, 'shape', []))}, not the {expected.get(key, found).numel()} "
            "bytes of bits its weight needs (another architecture?)",
            "missing": f"the file has no mask for {key} ({count} missing in all): it was made "
            "for another model or is damaged",
        }[kind]
        + f"; {FIX} --fresh for this model."
    )


def check_adapters(model: Transformer, adapters: dict[str, Tensor], rank: int) -> None:
    """One ValueError naming the first adapter tensor that ``model`` (with its LoRA layers)
    lacks, that ``adapters`` lack, or whose shape is not the layer's A [rank, in] or
    B [out, rank]: nothing is guessed or left at its initial value."""
    expected = {n: p for n, p in model.named_parameters() if n.endswith((".A", ".B"))}
    problem = misfit(adapters, {n: p.detach() for n, p in expected.items()})
    if problem is None:
        return
    kind, name, count = problem
    got, need = adapters.get(name), expected.get(name)
    raise ValueError(
        {
            "extra": f"the adapters hold {name}, a tensor this model does not have (another "
            "architecture?)",
            "shape": f"adapter {name} is {getattr(got, 'dtype', None)} "
            f"{list(getattr(got, 'shape', []))}, but this model at rank {rank} (the file's "
            f"metadata) needs {getattr(need, 'dtype', None)} {list(getattr(need, 'shape', []))}"
            ": another rank or another model",
            "missing": f"the adapters lack {name} ({count} of {len(expected)} tensors missing): "
            "the file is damaged",
        }[kind]
        + f"; {FIX} --fresh for this model."
    )


def read_adapters(path: Path) -> tuple[dict[str, str], dict[str, Tensor]]:
    """(metadata, tensors) of an adapters file, or one ValueError that says how to remake it."""
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        FinetuneConfig(**json.loads(meta["config"]))
        json.loads(meta["settings"])
        tensors = load_file(str(path))
    except (SafetensorError, OSError, KeyError, ValueError, TypeError) as err:
        raise ValueError(
            f"{path} is not readable adapters ({err!r}); delete it and {FIX}."
        ) from err
    if not tensors or "fingerprint" not in meta:
        raise ValueError(f"{path} holds no adapters; {FIX} --fresh.")
    return meta, tensors

"""Resuming a fine-tuning run: its trainable tensors, optimiser state and history in one file.

``finetune_`` (``minisparse.relufy.finetune``) writes a checkpoint every ``checkpoint_every``
steps; a run started again with the same settings (``config``, a dataclass, stored as JSON) and
directory continues from it, and one with other settings is refused with the settings that
differ. The file is safetensors, written atomically: a run killed while writing leaves the
previous checkpoint intact.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from ..files.cache import save_tensors_atomic

__all__ = ["load_checkpoint", "save_checkpoint"]


def save_checkpoint(
    path: Path,
    step: int,
    params: dict[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
    config: Any,
    history: list[dict[str, float]],
) -> None:
    """Write ``params``, their optimiser state, ``config`` and ``history`` (after ``step``)."""
    tensors = {f"param/{n}": p.detach().contiguous() for n, p in params.items()}
    for n, p in params.items():
        for key, value in optimizer.state.get(p, {}).items():
            tensors[f"opt/{key}/{n}"] = torch.as_tensor(value).detach().contiguous()
    meta = {
        "step": str(step),
        "config": json.dumps(dataclasses.asdict(config)),
        "history": json.dumps(history),
    }
    save_tensors_atomic(tensors, path, meta)


def load_checkpoint(
    path: Path,
    params: dict[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
    config: Any,
) -> tuple[int, list[dict[str, float]]]:
    """Restore parameters and optimiser state; return (next step, history)."""
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    saved = json.loads(meta["config"])
    if saved != dataclasses.asdict(config):
        changed = sorted(k for k in saved if saved[k] != dataclasses.asdict(config).get(k))
        raise ValueError(
            f"The checkpoint {path} was made with other settings ({', '.join(changed)} differ); "
            "use the same settings to resume, or another checkpoint directory (or resume=False)."
        )
    tensors = load_file(str(path))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[f"param/{n}"])
            state = {
                key.split("/")[1]: t
                for key, t in tensors.items()
                if key.endswith(f"/{n}") and key.startswith("opt/")
            }
            if state:
                optimizer.state[p] = state
    return int(meta["step"]), json.loads(meta["history"])

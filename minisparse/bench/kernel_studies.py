"""Three studies beside chapter 07's kernel benchmark: how many copies of an FFN its timing
rotates through (``weight_copies``), the row gather from naive to fast (``gather_progression``),
and how dense a batch's union of active neurons is (``union_density``)."""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.workloads import random_active_sets
from ..measure.timing import interleaved_medians

__all__ = ["gather_progression", "union_density", "weight_copies"]


def weight_copies(ffn_bytes: int, working_set_mb: float) -> int:
    """How many copies of an FFN of ``ffn_bytes`` exceed ``working_set_mb`` (at least one)."""
    if working_set_mb < 0:
        raise ValueError(f"working_set_mb must be at least 0 (0: one copy), got {working_set_mb}.")
    return max(1, math.ceil(working_set_mb * 2**20 / ffn_bytes))


def gather_progression(
    dim: int = 4096,
    ffn: int = 11008,
    sparsities: tuple[float, ...] = (0.5, 0.9),
    repeats: int = 10,
    warmup: int = 2,
    seed: int = 0,
) -> dict[float, dict[str, float]]:
    """Row-sparse GEMV on the CPU, naive to fast: time / dense time for each step.

    Steps: ``index_select`` + matmul (copies the rows), the fused C loop, + software prefetch,
    + huge pages. Dense is ``F.linear`` on the ordinary (4 KiB page) weights. Needs the C fast
    path.
    """
    from ..kernels import cpu

    if not cpu.fast_path_available():
        raise RuntimeError("The CPU fast path is not compiled; install gcc or clang (or set CC).")
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(ffn, dim, generator=gen)
    W_huge = cpu.hugepage_copy(W)
    x = torch.randn(dim, generator=gen)
    out: dict[float, dict[str, float]] = {}
    for s in sparsities:
        sets = itertools.cycle(random_active_sets(ffn, s, 8, seed + 1))
        fns = {
            "dense": lambda: F.linear(x, W),
            "index_select + matmul": lambda sets=sets: W.index_select(0, next(sets)) @ x,
            "fused loop": lambda sets=sets: cpu.gather_rows_dot(W, x, next(sets), False),
            "+ prefetch": lambda sets=sets: cpu.gather_rows_dot(W, x, next(sets), True),
            "+ huge pages": lambda sets=sets: cpu.gather_rows_dot(W_huge, x, next(sets), True),
        }
        t = interleaved_medians(fns, repeats, warmup)
        out[s] = {name: t[name] / t["dense"] for name in fns if name != "dense"}
    return out


def union_density(masks: Tensor, batch: int) -> float:
    """Mean fraction of neurons active in at least one of ``batch`` consecutive tokens.

    masks: [tokens, ffn] booleans (True = active). Tokens are grouped in order, as a batch of
    decode streams or a prompt chunk would be.
    """
    n = masks.shape[0] // batch * batch
    if n == 0:
        raise ValueError(f"Need at least {batch} tokens of masks, got {masks.shape[0]}.")
    groups = masks[:n].reshape(-1, batch, masks.shape[1])
    return groups.any(1).float().mean().item()

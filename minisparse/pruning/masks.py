"""Which weights stay: a boolean mask from scores, per output row or per group of m inputs.

* ``row_mask(scores, s)``: in every output row, the k = round(s · in) lowest-scoring weights
  are pruned (False), the others kept (True). Comparing within a row keeps every output
  neuron equally dense, which is what Wanda found to work best for LLMs.
* ``nm_mask(scores, n, m)``: N:M semi-structured sparsity. Along each row the inputs come in
  consecutive groups of m; in every group the n highest-scoring weights are kept. 2:4 is the
  pattern NVIDIA's sparse tensor cores run at twice the dense rate (Mishra et al. 2021); a
  2:4 row stores its kept values and, per value, its 2-bit position within the group.

Ties (equal scores) are broken towards the lower column index, so the masks are deterministic.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["PATTERNS", "check_pattern", "check_sparsity", "nm_mask", "pattern_nm", "row_mask"]

#: The patterns ``prune`` accepts: unstructured, or n kept of every m consecutive inputs.
PATTERNS = ("unstructured", "2:4", "4:8")


def check_sparsity(sparsity: object) -> float:
    """A share of weights to prune in [0, 1), else one ValueError that says so."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)):
        raise ValueError(f"sparsity must be a number in [0, 1), e.g. 0.5; got {sparsity!r}.")
    if not 0 <= sparsity < 1:
        raise ValueError(
            f"sparsity must be in [0, 1) (the share of weights set to zero; 1 would remove "
            f"every weight), e.g. 0.5; got {sparsity}."
        )
    return float(sparsity)


def pattern_nm(pattern: str) -> tuple[int, int] | None:
    """(n, m) of an "n:m" pattern, None for "unstructured"; a ValueError for anything else."""
    if pattern == "unstructured":
        return None
    parts = pattern.split(":") if isinstance(pattern, str) else []
    if len(parts) == 2 and all(p.isascii() and p.isdigit() for p in parts):  # not "²"
        n, m = int(parts[0]), int(parts[1])
        if 0 < n < m:
            return n, m
    raise ValueError(
        f"pattern must be 'unstructured' or 'n:m' with 0 < n < m (e.g. {', '.join(PATTERNS)}); "
        f"got {pattern!r}."
    )


def check_pattern(
    pattern: str, in_features: int, name: str = "the layer"
) -> tuple[int, int] | None:
    """``pattern_nm`` plus the check that m divides the inputs of ``name``."""
    nm = pattern_nm(pattern)
    if nm is not None and in_features % nm[1]:
        raise ValueError(
            f"pattern {pattern} groups {nm[1]} consecutive inputs, but {name} has "
            f"{in_features} inputs, not a multiple of {nm[1]}; use 'unstructured' for it or a "
            f"pattern whose group divides {in_features}."
        )
    return nm


def _lowest_first(scores: Tensor) -> Tensor:
    """Indices that sort each row by score, lowest first, ties by column (a stable sort)."""
    return torch.sort(scores, dim=-1, stable=True).indices


def row_mask(scores: Tensor, sparsity: float) -> Tensor:
    """True where a weight is kept: per row, all but the round(s · in) lowest scores."""
    sparsity = check_sparsity(sparsity)
    cols = scores.shape[-1]
    k = round(sparsity * cols)
    mask = torch.ones_like(scores, dtype=torch.bool)
    if k:
        mask.scatter_(-1, _lowest_first(scores)[..., :k], False)
    return mask


def nm_mask(scores: Tensor, n: int, m: int) -> Tensor:
    """True where a weight is kept: the n highest scores of every m consecutive inputs."""
    if not 0 < n < m:
        raise ValueError(f"an n:m pattern needs 0 < n < m; got {n}:{m}.")
    cols = scores.shape[-1]
    check_pattern(f"{n}:{m}", cols, "scores")
    groups = scores.reshape(*scores.shape[:-1], cols // m, m)
    mask = torch.ones_like(groups, dtype=torch.bool)
    mask.scatter_(-1, _lowest_first(groups)[..., : m - n], False)
    return mask.reshape(scores.shape)

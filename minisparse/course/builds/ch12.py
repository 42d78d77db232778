"""Chapter 12's builds: Wanda's per-row pruning mask, the N:M mask, and NF4 quantization.

``wanda_mask(w, x_norm, sparsity)`` gets a projection's weight W [out, in] and the L2 norm of
each input feature over the calibration tokens, ‖X_j‖₂ [in]; the score of a weight is
S_ij = |W_ij| · ‖X_j‖₂ and, within every output row, the k = round(s · in) lowest scores are
pruned (Sun et al. 2024). Graded against ``pruning.masks.row_mask(pruning.scores.wanda_score)``
on odd shapes, sparsity 0, an input that never fires (‖X_j‖ = 0: its whole column goes first),
outlier inputs (where Wanda and plain magnitude disagree) and rows of ties; where scores tie any
choice is right, so a mask passes when it prunes exactly k per row and no pruned score lies
above a kept one.

``nm_mask(scores, n, m)`` keeps the n highest scores of every m consecutive inputs of each row
(2:4, 4:8, and odd ones such as 1:3); graded the same way, group by group.

``nf4_quantize(w, block_size)`` quantizes each block of ``block_size`` consecutive weights of a
row to QLoRA's 16 NormalFloat levels (``quant.nf4.NF4_LEVELS``, Dettmers et al. 2023): the
block's absmax a = max |w| scales it to [-1, 1], and each weight gets the code of the level
nearest to w / a. It returns (codes [rows, cols] in 0..15, absmax [rows, cols / block_size]),
graded against ``quant.nf4.nf4_quantize`` by the weights they decode to (level[code] · absmax).

The plugs: ``pruning_with(wanda=..., nm=...)`` gives ``pruning.prune`` the learner's mask
functions, so the pruned models whose perplexity the chapter prints are chosen by them, and
``nf4_with(impl)`` is the quantizer of the NF4 layers the chapter measures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ...pruning.masks import nm_mask, pattern_nm, row_mask
from ...pruning.scores import wanda_score
from ...quant.nf4 import NF4_LEVELS, nf4_quantize
from ..grading import Exercise, close, keeps_top, register

__all__ = ["nf4_decoded", "pruning_with", "wanda_reference"]

Cases = list[tuple[Any, ...]]


# --------------------------------------------------------------------------------------------
# Wanda
# --------------------------------------------------------------------------------------------


def wanda_reference(w: Tensor, x_norm: Tensor, sparsity: float) -> Tensor:
    """The library's Wanda mask: per row, all but the round(s · in) lowest |W| · ‖X‖ scores."""
    return row_mask(wanda_score(w, x_norm), sparsity)


def _norms(gen: torch.Generator, cols: int, dead: int | None) -> Tensor:
    """‖X_j‖ over a few hundred tokens, a few outlier features ten times larger."""
    x = torch.randn(200, cols, generator=gen)
    x = x * (1 + 9 * (torch.rand(cols, generator=gen) > 0.8))
    norms = x.norm(dim=0)
    if dead is not None:
        norms[dead] = 0
    return norms


def _wanda_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    for rows, cols, sparsity, dead in (
        (1, 1, 0.0, None),
        (3, 8, 0.5, None),
        (5, 13, 0.3, 4),  # round(3.9) = 4 pruned per row; an input that never fires
        (4, 20, 0.7, 0),
        (7, 33, 0.15, None),  # round(4.95) = 5
        (2, 6, 0.25, None),  # round(1.5) = 2: half to even
        (6, 64, 0.9, 10),
    ):
        w = torch.randn(rows, cols, generator=gen)
        out.append((w, _norms(gen, cols, dead), sparsity))
    w = torch.randn(4, 10, generator=gen)
    w[1] = 0.5  # a row of ties before the norms; equal norms make them ties again
    out.append((w, torch.ones(10), 0.4))
    return out


def _wanda_accepts(args: tuple[Any, ...], got: Any, expected: Any) -> bool:
    w, x_norm, sparsity = args
    cols = w.shape[-1]
    return keeps_top(wanda_score(w.double(), x_norm.double()), got, cols - round(sparsity * cols))


register(
    "wanda_mask",
    Exercise(
        "12",
        "wanda_mask(w [out, in], x_norm [in], sparsity) -> bool [out, in]: True for the weights "
        "Wanda keeps: score |w_ij| * x_norm_j (x_norm_j = L2 norm of input j over the "
        "calibration tokens); in every row prune the round(sparsity * in) lowest scores",
        wanda_reference,
        _wanda_cases,
        close,  # replaced by ``accepts``: any choice is right where scores tie
        "score = w.abs() * x_norm (broadcast along rows: one norm per input column); compare "
        "within each output row (dim=-1), not across the whole matrix; sparsity is the share "
        "pruned: k = round(sparsity * in) per row, then mask.scatter_(-1, "
        "scores.argsort(-1)[:, :k], False) on a mask of True",
        accepts=_wanda_accepts,
        core=True,
    ),
)


# --------------------------------------------------------------------------------------------
# N:M
# --------------------------------------------------------------------------------------------


def _nm_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    shapes = ((1, 1, 2, 4), (3, 4, 2, 4), (5, 3, 4, 8), (4, 7, 1, 3), (2, 2, 3, 4))
    for rows, groups, n, m in shapes:
        out.append((torch.randn(rows, groups * m, generator=gen).abs(), n, m))
    scores = torch.rand(3, 16, generator=gen)
    scores[0, :8] = 1.0  # ties within two groups
    out.append((scores, 2, 4))
    return out


def _nm_accepts(args: tuple[Any, ...], got: Any, expected: Any) -> bool:
    scores, n, m = args
    if not isinstance(got, Tensor) or got.shape != scores.shape:
        return False
    rows, cols = scores.shape
    return keeps_top(scores.double().reshape(rows, cols // m, m), got.reshape(rows, -1, m), n)


register(
    "nm_mask",
    Exercise(
        "12",
        "nm_mask(scores [out, in], n, m) -> bool [out, in]: the N:M pattern; the inputs of every "
        "row come in consecutive groups of m (columns 0..m-1, m..2m-1, ...); True for the n "
        "highest scores of each group",
        nm_mask,
        _nm_cases,
        close,  # replaced by ``accepts``
        "view scores as [out, in // m, m] (consecutive columns per group, not columns j, "
        "j + in/m, ...), keep the top n along the last axis with topk, and reshape the mask "
        "back to [out, in]",
        accepts=_nm_accepts,
        core=True,
    ),
)


# --------------------------------------------------------------------------------------------
# NF4
# --------------------------------------------------------------------------------------------


def nf4_decoded(result: Any, block_size: int) -> Tensor:
    """The weights ``(codes, absmax)`` decode to: NF4_LEVELS[code] · absmax of its block."""
    codes, absmax = result
    codes, absmax = torch.as_tensor(codes).long(), torch.as_tensor(absmax).double()
    if codes.min() < 0 or codes.max() > 15:
        raise ValueError("NF4 codes are 0..15, one of the 16 levels")
    scale = absmax.repeat_interleave(block_size, dim=-1)
    return NF4_LEVELS.double()[codes] * scale


def _nf4_cases(gen: torch.Generator) -> Cases:
    out: Cases = []
    for rows, cols, block in ((1, 4, 4), (3, 64, 64), (5, 96, 32), (2, 48, 16), (4, 30, 10)):
        w = torch.randn(rows, cols, generator=gen) * 0.05
        out.append((w, block))
    w = torch.randn(3, 32, generator=gen)
    w[0, :16] = 0  # a block of zeros: absmax 0, every weight is exactly 0
    w[1, 5] = -4.0  # the block's absmax is a negative weight
    out.append((w, 16))
    return out


def _nf4_same_weights(block: int) -> Callable[[Any, Any], bool]:
    def same(got: Any, expected: Any) -> bool:
        try:
            return close(nf4_decoded(got, block), nf4_decoded(expected, block), 1e-6)
        except (TypeError, ValueError, RuntimeError):
            return False

    return same


def _nf4_accepts(args: tuple[Any, ...], got: Any, expected: Any) -> bool:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return False
    return _nf4_same_weights(args[1])(got, expected)


register(
    "nf4_quantize",
    Exercise(
        "12",
        "nf4_quantize(w [rows, cols], block_size) -> (codes [rows, cols] in 0..15, absmax "
        "[rows, cols / block_size]): per block of block_size consecutive weights of a row, "
        "a = max |w|, and each weight's code is the index of the NF4 level (NF4_LEVELS, 16 "
        "values in [-1, 1]) nearest to w / a",
        nf4_quantize,
        _nf4_cases,
        close,  # replaced by ``accepts``: compared by the weights the codes decode to
        "reshape w to [rows, cols // block_size, block_size]; a = max of |w| over the last axis "
        "(the absolute value: a negative weight can be the largest); divide (a block of zeros "
        "has a = 0: use a tiny a there) and take argmin over the 16 levels of "
        "|w / a - level|, not a uniform 4-bit grid",
        accepts=_nf4_accepts,
        core=True,
    ),
)


# --------------------------------------------------------------------------------------------
# Plugs
# --------------------------------------------------------------------------------------------


def pruning_with(
    wanda: Callable[[Tensor, Tensor, float], Tensor] | None = None,
    nm: Callable[[Tensor, int, int], Tensor] | None = None,
) -> Callable[[Tensor, Tensor, float, str], Tensor]:
    """A ``select_fn`` for ``pruning.prune``: (weight, x_norm, sparsity, pattern) -> keep mask.

    Unstructured patterns run ``wanda`` (the learner's ``wanda_mask``), N:M patterns score by
    |W| · ‖X‖ and run ``nm`` (the learner's ``nm_mask``); either left out is the library's.
    """
    wanda = wanda or wanda_reference
    nm = nm or nm_mask

    def select(weight: Tensor, x_norm: Tensor, sparsity: float, pattern: str) -> Tensor:
        found = pattern_nm(pattern)
        if found is None:
            return wanda(weight, x_norm, sparsity)
        return nm(wanda_score(weight, x_norm), *found)

    return select

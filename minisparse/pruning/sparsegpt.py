"""SparseGPT: prune a weight matrix column by column, correcting the columns not yet pruned.

Frantar & Alistarh, "SparseGPT: Massive Language Models Can Be Accurately Pruned in One-Shot"
(ICML 2023).

Pruning is quantization to a grid with one point, zero. As for GPTQ (chapter 09,
``minisparse.quant.gptq``), the error of a row w of W [out, in] on calibration inputs X is

    E(ŵ) = ‖X (w − ŵ)ᵀ‖² = (w − ŵ) H (w − ŵ)ᵀ,        H = XᵀX,

and when column i is set to zero (δ_i = w_i), the columns F not yet visited absorb it best by
the optimal brain surgeon (OBS) update

    w_F  ←  w_F − δ_i / [H_F⁻¹]_ii · [H_F⁻¹]_{i,F}.

The rows [H_F⁻¹]_{i, i:} are the rows of the upper Cholesky factor U of H⁻¹ (H⁻¹ = UᵀU)
scaled by U_ii, so the loop is GPTQ's: err = δ_i / U_ii, w_{i:} −= err · U_{i,i:}, with
H + λI (λ = ``damp`` · mean diag H; inputs that are never nonzero get H_jj = 1 and weight 0)
and lazy blocks of ``blocksize`` columns. What differs is the choice of *which* weights become
zero:

* **unstructured** (adaptive mask selection): when a block of columns starts, each row prunes
  the weights of the block with the lowest saliency w_j² / U_jj² (the OBS error of removing
  w_j alone), a share ``sparsity`` of the block's columns. The mask is chosen on the weights
  *after* the corrections from earlier blocks, so it adapts to them; the per-block counts
  round(s · end) − round(s · start) add up to round(s · in) per row, the share ``row_mask``
  prunes.
* **n:m**: when a group of m columns starts, each row keeps the n weights of the group with the
  highest saliency, again after the corrections from the groups before it.

The paper prunes OPT-175B and BLOOM-176B to 50 % with a small perplexity increase, where
magnitude pruning collapses; the Wanda paper measures LLaMA-7B on WikiText at 50 %
unstructured: dense 5.68, magnitude 17.29, Wanda 7.26, SparseGPT 7.22.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core.checks import check_count
from ..quant.gptq import inverse_hessian_factor
from .masks import check_pattern, check_sparsity, nm_mask, row_mask

__all__ = ["check_settings", "check_target", "saliency", "sparsegpt_prune"]


def check_target(
    sparsity: object, pattern: str, in_features: int, name: str = "the layer"
) -> tuple[int, int] | None:
    """Check a pruning target: ``sparsity`` in [0, 1), a ``pattern`` whose group divides
    ``in_features``, and for n:m patterns the share they prune, 1 − n/m. Returns (n, m) or None.
    """
    share = check_sparsity(sparsity)
    nm = check_pattern(pattern, in_features, name)
    if nm is not None and not math.isclose(share, 1 - nm[0] / nm[1]):
        n, m = nm
        raise ValueError(
            f"pattern {pattern} prunes {m - n} of every {m} weights, a share of {1 - n / m:g}; "
            f"pass sparsity={1 - n / m:g} with it, or pattern='unstructured' for {share:g}."
        )
    return nm


def check_settings(blocksize: object, damp: object) -> int:
    """SparseGPT's own settings: a whole ``blocksize`` >= 1 and a finite ``damp`` >= 0."""
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not 0 <= damp < math.inf:
        raise ValueError(f"damp must be a finite number >= 0 (e.g. 0.01), got {damp!r}.")
    return check_count(blocksize, "blocksize", fix="e.g. 128")


def saliency(w_t: Tensor, u_diag: Tensor) -> Tensor:
    """w_j² / U_jj² [rows, cols] from transposed weights ``w_t`` [cols, rows] and U's diagonal."""
    return (w_t / u_diag[:, None]).pow(2).t()


def _block_keep(w_t: Tensor, u_diag: Tensor, pruned: int) -> Tensor:
    """Keep mask [cols, rows] of one block: per row, all but the ``pruned`` lowest saliencies."""
    cols = w_t.shape[0]
    if pruned >= cols:
        return torch.zeros_like(w_t, dtype=torch.bool)
    return row_mask(saliency(w_t, u_diag), pruned / cols).t()


def sparsegpt_prune(
    weight: Tensor,
    hessian: Tensor,
    sparsity: float,
    pattern: str = "unstructured",
    blocksize: int = 128,
    damp: float = 0.01,
) -> Tensor:
    """SparseGPT's pruned copy of ``weight`` [rows, cols] (exact zeros where pruned), given the
    Hessian ``hessian`` [cols, cols] = XᵀX of its inputs.

    The loop runs on Wᵀ in float32 (float64 when ``weight`` is float64, for exact comparisons);
    the result has ``weight``'s dtype. For an n:m pattern, ``sparsity`` must be 1 − n/m and the
    block size is rounded up to a multiple of m.
    """
    cols = weight.shape[1]
    nm = check_target(sparsity, pattern, cols, "the weight")
    if hessian.shape != (cols, cols):
        raise ValueError(
            f"hessian must be [{cols}, {cols}] for a weight with {cols} columns, got "
            f"{list(hessian.shape)}; compute it from the inputs x as hessian(x) = xᵀx."
        )
    blocksize = check_settings(blocksize, damp)
    if nm is not None:
        blocksize = -(-blocksize // nm[1]) * nm[1]

    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    w_t = weight.detach().t().to(dtype).clone(memory_format=torch.contiguous_format)
    h = hessian.detach().to(dtype).clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w_t[dead] = 0.0
    u = inverse_hessian_factor(h, damp)
    d = u.diagonal()

    out = torch.empty_like(w_t)
    for start in range(0, cols, blocksize):
        end = min(start + blocksize, cols)
        block = w_t[start:end]  # a view: the corrections land in w_t
        errors = torch.empty_like(block)
        if nm is None:
            pruned = round(sparsity * end) - round(sparsity * start)
            keep = _block_keep(block, d[start:end], pruned)
        else:  # chosen group by group, after the corrections from the groups before
            keep = torch.empty_like(block, dtype=torch.bool)
        for j in range(end - start):
            col = start + j
            if nm is not None and j % nm[1] == 0:
                group = slice(j, j + nm[1])
                keep[group] = nm_mask(saliency(block[group], d[col : col + nm[1]]), *nm).t()
            out[col] = block[j] * keep[j]
            errors[j] = (block[j] - out[col]) / d[col]
            block[j:].addr_(u[col, col:end], errors[j], alpha=-1)
        w_t[end:].sub_(u[start:end, end:].t() @ errors)
    return out.t().contiguous().to(weight.dtype)

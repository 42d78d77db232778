"""Chapter 09's builds: GPTQ's column loop with error feedback, and AWQ's scale search.

Both use the asymmetric b-bit grid of the chapter, per row or per group of g consecutive
columns: s = (max − min) / (2^b − 1), m = min, q = clamp(round((w − m) / s), 0, 2^b − 1),
ŵ = s q + m (a group whose range is 0 gets a tiny positive s, so it is stored exactly).

**GPTQ** (``gptq_quantize``; Frantar et al. 2023). From calibration inputs X [n, cols]:
H = XᵀX; a column that never sees a nonzero input (H_jj = 0) gets H_jj = 1 and weight 0; the
damping λ = damp · mean(diag H) is added to the diagonal; U is the upper Cholesky factor of
H⁻¹ (H⁻¹ = UᵀU). Then, column by column, i = 0 .. cols − 1, for all rows at once: at the first
column of a group its (s, m) are taken from the group's columns *as corrected so far*;
column i is rounded, its error e = (w_i − ŵ_i) / U_ii is pushed onto the columns not yet
quantized, w_j −= e U_ij for j > i. The library applies the same updates lazily in blocks
of 128 columns (``quant.gptq.gptq_quantize``); in exact arithmetic the result is the same.

The check builds fresh W and X in float64 (outlier input channels, an input that is always
zero, a row of zeros, fewer tokens than columns so that only the damping makes H invertible,
rows whose length is not a multiple of g) and compares ŵ with the library's to 1e-6: plain
rounding, error feedback confined to the group, the Cholesky factor of H instead of H⁻¹, no
damping, and group ranges taken from the uncorrected weights all fail.

**AWQ** (``awq_search``; Lin et al. 2024). For α in {0, 1/N, .., (N−1)/N}: s = mean_rows|x|^α
(at least 1e-4), normalised by sqrt(max s · min s); the weights are scaled, rounded and scaled
back, Ŵ = Q(W diag(s)) diag(s)⁻¹, and the output error is ‖X Wᵀ − X Ŵᵀ‖² / (n · rows). The
search returns the s of the smallest error (the last one on a tie) and the N errors. It is
graded against ``quant.smoothing.awq_search`` in float64 (outlier channels, an input channel
that is always zero, one α only, odd group sizes).

The plugs: ``gptq_with(impl)`` and ``awq_search_with(impl)`` give ``quantize_model`` the
learner's functions (``gptq_fn=`` and ``awq_search_fn=``, options of the two methods), so the
models whose perplexity the chapter prints are quantized by them. With GQA, o_proj's input
channels come in groups that share one scale (the query heads that read one value head):
that group's search stays the library's, which reduces the statistics per shared channel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...quant import gptq as library_gptq
from ...quant import smoothing
from ...quant.calibration import LinearGroup
from ...quant.tensor import QuantizedTensor, QuantSpec, code_dtype
from ..grading import Exercise, close, register

__all__ = ["awq_search_with", "dequantize", "gptq_with"]

Cases = list[tuple[Any, ...]]


def _spec(bits: int, group_size: int | None) -> QuantSpec:
    return QuantSpec(bits, group_size, symmetric=False)


def _check_grid(spec: QuantSpec, name: str) -> None:
    if spec.symmetric or spec.per_tensor:
        raise ValueError(
            f"The course's {name} uses the asymmetric grid per row or group: quantize with "
            "bits below 8 (asymmetric by default) and without a per-tensor scale."
        )


def dequantize(codes: Any, bits: int, group_size: int | None) -> Tensor:
    """ŵ = s q + m [rows, cols] from ``(q [rows, cols], s [rows, groups], m [rows, groups])``."""
    q, scale, offset = codes
    q = torch.as_tensor(q)
    groups = 1 if group_size is None else -(-q.shape[1] // group_size)
    want = (q.shape[0], groups)
    for name, t in (("scale", scale), ("offset", offset)):
        if tuple(torch.as_tensor(t).shape) != want:
            raise ValueError(
                f"{name} must be [rows, groups] = {list(want)}, one per row and group; got "
                f"{list(torch.as_tensor(t).shape)}"
            )
    qt = QuantizedTensor(
        q.double(),
        torch.as_tensor(scale).double(),
        torch.as_tensor(offset).double(),
        _spec(bits, group_size),
    )
    return qt.dequantize()


# --------------------------------------------------------------------------------------------
# GPTQ
# --------------------------------------------------------------------------------------------


def _inputs(gen: torch.Generator, n: int, cols: int, dead: int | None = None) -> Tensor:
    """Calibration inputs [n, cols] with a few outlier channels (and one dead channel)."""
    x = torch.randn(n, cols, generator=gen, dtype=torch.float64)
    x = x * (1 + 9 * (torch.rand(cols, generator=gen, dtype=torch.float64) > 0.85))
    if dead is not None:
        x[:, dead] = 0
    return x


def _gptq_cases(gen: torch.Generator) -> Cases:
    """(w [rows, cols], x [n, cols], bits, group_size, damp) per case."""
    out: Cases = []
    for rows, cols, n, bits, group, dead in (
        (3, 8, 40, 4, None, None),  # full rank: damping still changes the answer
        (5, 20, 64, 3, 8, 5),  # a short last group, a dead input channel
        (4, 16, 9, 4, 16, None),  # fewer tokens than columns: only the damping inverts H
        (1, 7, 30, 2, 3, 0),
        (6, 12, 50, 8, None, None),
        (7, 24, 48, 4, 5, None),
    ):
        w = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
        if rows > 4:
            w[2] = 0  # a row of zeros: every group's range is 0
        out.append((w, _inputs(gen, n, cols, dead), bits, group, 0.01))
    w = torch.randn(5, 10, generator=gen, dtype=torch.float64)
    out.append((w, _inputs(gen, 6, 10), 4, 4, 0.1))
    return out


def _library_gptq(
    w: Tensor, x: Tensor, bits: int, group_size: int | None, damp: float
) -> tuple[Tensor, Tensor, Tensor]:
    qt = library_gptq.gptq_quantize(w, library_gptq.hessian(x), _spec(bits, group_size), damp)
    assert qt.offset is not None
    return qt.q, qt.scale, qt.offset


@dataclass(frozen=True)
class _Weights:
    """The weights ŵ the codes stand for; shown by their last column, where the corrections
    of all earlier columns have added up."""

    w: Tensor

    def __repr__(self) -> str:
        last = [round(v, 4) for v in self.w[:, -1].tolist()[:5]]
        return f"w_hat {list(self.w.shape)}, last column {last}"


def _run_gptq(impl: Callable[..., Any], args: tuple[Any, ...]) -> _Weights:
    return _Weights(dequantize(impl(*args), args[2], args[3]))


def _within_1e6(got: Any, expected: Any) -> bool:
    return close(got.w, expected.w, 1e-6)


register(
    "gptq_quantize",
    Exercise(
        "09",
        "gptq_quantize(w [rows, cols], x [n, cols], bits, group_size, damp) -> (q [rows, cols], "
        "scale [rows, groups], offset [rows, groups]): GPTQ on the asymmetric grid. H = x^T x; "
        "a column with H_jj = 0 gets H_jj = 1 and weight 0; add damp * mean(diag H) to the "
        "diagonal; U = the upper Cholesky factor of H^-1. For each column i: at a group's first "
        "column take its scale and offset from the group's columns as corrected so far, round "
        "column i, and push e = (w_i - w_hat_i) / U_ii onto the later columns: w_j -= e U_ij",
        _library_gptq,
        _gptq_cases,
        _within_1e6,
        "U = torch.linalg.cholesky(torch.linalg.inv(H + λI), upper=True) (λ after the dead "
        "columns' 1s); the error of column i corrects every column j > i of the row, also "
        "beyond the group, with U[i, j] (row i of U, not of H's own factor); a group's range "
        "is measured when its first column comes up, after the corrections so far",
        run=_run_gptq,
        core=True,
    ),
)


def gptq_with(impl: Callable[..., Any]) -> Callable[..., QuantizedTensor]:
    """``quantize_model``'s ``gptq_fn`` that runs ``impl`` (the learner's ``gptq_quantize``)."""

    def quantize(w: Tensor, x: Tensor, spec: QuantSpec, damp: float) -> QuantizedTensor:
        _check_grid(spec, "gptq_quantize")
        x = x.reshape(-1, x.shape[-1]).to(w.dtype)
        q, scale, offset = impl(w.detach(), x, spec.bits, spec.group_size, damp)
        q = torch.as_tensor(q).round().to(code_dtype(spec))
        scale, offset = torch.as_tensor(scale).to(w.dtype), torch.as_tensor(offset).to(w.dtype)
        return QuantizedTensor(q, scale, offset, spec)

    return quantize


# --------------------------------------------------------------------------------------------
# AWQ
# --------------------------------------------------------------------------------------------


def _awq_cases(gen: torch.Generator) -> Cases:
    """(x [n, in], w [rows, in], bits, group_size, n_grid) per case."""
    out: Cases = []
    for n, cols, rows, bits, group, grid, dead in (
        (32, 16, 6, 4, 8, 10, None),
        (20, 24, 5, 3, 7, 6, 3),  # a group size that does not divide the row; a dead channel
        (16, 12, 4, 4, None, 5, None),
        (8, 10, 3, 4, 4, 1, None),  # one α only: round to nearest
        (40, 33, 9, 2, 16, 20, 0),
    ):
        x = _inputs(gen, n, cols, dead)
        out.append(
            (x, torch.randn(rows, cols, generator=gen, dtype=torch.float64), bits, group, grid)
        )
    return out


def _library_awq(
    x: Tensor, w: Tensor, bits: int, group_size: int | None, n_grid: int
) -> tuple[Tensor, Tensor]:
    group = LinearGroup("linears", ("linear",), "prev")
    search = smoothing.awq_search(x, [w], group, _spec(bits, group_size), n_grid)
    return search.scales, torch.tensor(search.losses)


def _same_search(got: Any, expected: Any) -> bool:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return False
    return close(got[0], expected[0], 1e-6) and close(got[1], expected[1], 1e-6)


register(
    "awq_search",
    Exercise(
        "09",
        "awq_search(x [n, in], w [rows, in], bits, group_size, n_grid) -> (s [in], losses "
        "[n_grid]): AWQ's grid search. For alpha = i / n_grid, i = 0 .. n_grid - 1: s = "
        "mean over rows of |x| to the power alpha, at least 1e-4, divided by sqrt(max s * "
        "min s); w_hat = Q(w * s) / s on the asymmetric grid; loss = mean of (x (w - w_hat)^T)^2 "
        "over the n x rows outputs. Returns the s of the smallest loss (the last one on a tie) "
        "and every loss",
        _library_awq,
        _awq_cases,
        _same_search,
        "s = x.abs().mean(0) ** alpha, then .clamp_min(1e-4), then s / (s.max() * s.min()).sqrt(); "
        "scale the columns of w by s before rounding and divide them by s after; the loss is "
        "measured on the outputs x @ w.T, not on the weights",
        core=True,
    ),
)


def awq_search_with(impl: Callable[..., Any]) -> Callable[..., smoothing.ScaleSearch]:
    """``quantize_model``'s ``awq_search_fn`` that runs ``impl`` (the learner's ``awq_search``)
    on every group whose input channels each have a scale of their own; o_proj under GQA, whose
    channels share scales by head, stays with the library's search."""

    def search(
        x: Tensor, weights: Sequence[Tensor], group: LinearGroup, spec: QuantSpec, n_grid: int
    ) -> smoothing.ScaleSearch:
        _check_grid(spec, "awq_search")
        if group.repeat != 1:
            return smoothing.awq_search(x, weights, group, spec, n_grid)
        w = torch.cat([wi.detach() for wi in weights])
        x = x.reshape(-1, x.shape[-1]).to(w.dtype)
        s, losses = impl(x, w, spec.bits, spec.group_size, n_grid)
        alphas = [i / n_grid for i in range(n_grid)]
        scales = torch.as_tensor(s).to(w.dtype)
        return smoothing.ScaleSearch(scales, alphas, [float(v) for v in losses])

    return search

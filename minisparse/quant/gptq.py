"""GPTQ: quantize a weight matrix column by column, correcting the columns not yet quantized.

Frantar, Ashkboos, Hoefler & Alistarh, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers" (ICLR 2023), after Optimal Brain Quantization (Frantar &
Alistarh, 2022).

A linear layer's output error on calibration inputs X [n, in] is, for each output row w of W,

    E(ŵ) = || X (w - ŵ)^T ||^2 = (w - ŵ) H (w - ŵ)^T,        H = X^T X,

the same H for every row. Quantizing column i of w moves it by δ_i = w_i - q(w_i). If the
remaining columns F (not yet quantized) may still change, the best way to absorb δ_i is

    w_F  <-  w_F - δ_i / [H_F^-1]_ii · [H_F^-1]_{i,F},

and the inverse Hessian of the remaining columns follows by one step of Gaussian elimination.
GPTQ runs this in a fixed column order for all rows at once, with three tricks:

1. **Cholesky.** The rows [H^-1]_{i, i:} needed at step i, after eliminating columns < i, are
   the rows of the upper Cholesky factor U of H^-1 (H^-1 = U^T U), scaled by U_ii. So the
   update is err = δ_i / U_ii, w_{i:} -= err · U_{i, i:}, with U computed once.
2. **Dampening.** H + λ I with λ = 1 % of mean(diag H) keeps the factorisation stable; columns
   that never see a nonzero input (H_ii = 0) are set to zero.
3. **Lazy batches.** Updates inside a block of 128 columns are applied at once to the block;
   the columns after the block receive the block's accumulated error in one matrix product.

With groups, each group's scale and offset are taken from the group's columns at the moment
its first column is quantized, i.e. after the corrections from earlier columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .calibration import LinearGroup, QuantConfig, QuantMethod, register_quant_method
from .options import GPTQOptions
from .tensor import QuantizedTensor, QuantSpec, code_dtype, quant_params, round_to_grid


def hessian(x: Tensor) -> Tensor:
    """H = X^T X [in, in] of calibration rows ``x`` [n, in] (float32; float64 if ``x`` is)."""
    x = x.reshape(-1, x.shape[-1])
    x = x if x.dtype == torch.float64 else x.float()
    return x.T @ x


def inverse_hessian_factor(h: Tensor, damp: float = 0.01) -> Tensor:
    """Upper Cholesky factor U of (H + λ I)^-1, λ = ``damp`` · mean(diag H)."""
    h = h.clone()
    diag = torch.arange(h.shape[0], device=h.device)
    h[diag, diag] += damp * h.diagonal().mean().clamp_min(1e-8)
    h_inv = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(h_inv, upper=True)


def initial_params(w_t: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor | None]:
    """Per-row scale and offset [rows] of W from the transposed ``w_t`` [cols, rows]."""
    groups = w_t.reshape(1, 1, -1) if spec.per_tensor else w_t.t()[:, None, :]
    scale, offset = quant_params(groups, spec)
    rows = w_t.shape[1]
    return scale.reshape(-1).expand(rows), None if offset is None else offset.reshape(-1).expand(
        rows
    )


def gptq_quantize(
    w: Tensor, h: Tensor, spec: QuantSpec, damp: float = 0.01, block_size: int = 128
) -> QuantizedTensor:
    """GPTQ codes for ``w`` [rows, cols] given the Hessian ``h`` [cols, cols] of its inputs.

    The loop runs on W^T, so that column i of W is a contiguous row of memory. It runs in
    float32, or in float64 when ``w`` is float64 (for exact comparisons).
    """
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    w_t = w.detach().t().to(dtype).clone(memory_format=torch.contiguous_format)  # [cols, rows]
    cols, rows = w_t.shape
    h = h.to(dtype).clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w_t[dead] = 0.0
    u = inverse_hessian_factor(h, damp)

    grouped = spec.group_size is not None
    group = spec.group_length(cols)
    if grouped:  # every group inside one lazy block, so its parameters see all corrections
        block_size = -(-max(block_size, group) // group) * group
    scale, offset = initial_params(w_t, spec)
    scales, offsets = [scale], [offset]
    codes = torch.empty_like(w_t)
    for start in range(0, cols, block_size):
        end = min(start + block_size, cols)
        block = w_t[start:end]  # a view: the corrections land in w_t
        errors = torch.empty_like(block)
        for j in range(end - start):
            col = start + j
            if grouped and col % group == 0:  # this group's range, after earlier corrections
                scale, offset = initial_params(block[j : j + group], spec)
                scales.append(scale)
                offsets.append(offset)
            codes[col] = round_to_grid(block[j], scale, offset, spec)
            w_hat = codes[col] * scale + (0 if offset is None else offset)
            errors[j] = (block[j] - w_hat) / u[col, col]
            block[j:].addr_(u[col, col:end], errors[j], alpha=-1)
        w_t[end:].sub_(u[start:end, end:].t() @ errors)

    if grouped:
        scales, offsets = scales[1:], offsets[1:]
    keep = 1 if spec.per_tensor else rows
    scale_out = torch.stack(scales, dim=1)[:keep]
    offset_out = None if spec.symmetric else torch.stack(offsets, dim=1)[:keep]
    return QuantizedTensor(codes.t().to(code_dtype(spec)), scale_out, offset_out, spec)


def output_error(x: Tensor, w: Tensor, w_hat: Tensor) -> float:
    """|| X W^T - X Ŵ^T ||_F^2: the layer-output error GPTQ minimises."""
    x = x.reshape(-1, x.shape[-1]).float()
    return float((x @ (w.float() - w_hat.float()).T).pow(2).sum())


def quantize_matrix(w: Tensor, x: Tensor, h: Tensor | None, config: QuantConfig) -> QuantizedTensor:
    """GPTQ of one matrix: ``gptq_quantize`` on the Hessian ``h`` of the inputs ``x``, or the
    options' own ``gptq_fn`` on ``x`` when one is set."""
    options = config.options
    if options.gptq_fn is not None:
        return options.gptq_fn(w, x, config.weight_spec, options.gptq_damp)
    assert h is not None
    return gptq_quantize(w, h, config.weight_spec, options.gptq_damp, options.gptq_block)


def gptq_layer(
    layer: nn.Module, groups: Sequence[LinearGroup], inputs: dict[str, Tensor], config: QuantConfig
) -> dict[str, QuantizedTensor]:
    """GPTQ for every linear layer of a decoder layer.

    The layers of a group read the same input, so they share one Hessian, and since GPTQ treats
    the rows of W independently, their rows are stacked and quantized in one pass (per tensor,
    where each layer has its own scale, they go one by one).
    """
    out = {}
    for group in groups:
        x = inputs[group.name]
        h = hessian(x) if config.options.gptq_fn is None else None
        weights = [layer.get_submodule(name).weight.detach() for name in group.linears]
        if config.weight_spec.per_tensor:
            for name, w in zip(group.linears, weights, strict=True):
                out[name] = quantize_matrix(w, x, h, config)
            continue
        qt = quantize_matrix(torch.cat(weights), x, h, config)
        start = 0
        for name, w in zip(group.linears, weights, strict=True):
            out[name] = qt.rows(start, start + w.shape[0])
            start += w.shape[0]
    return out


register_quant_method(
    QuantMethod(
        "gptq",
        "weight-only: round column by column, correcting the rest (OBS)",
        GPTQOptions,
        gptq_layer,
    )
)

__all__ = [
    "gptq_layer",
    "gptq_quantize",
    "hessian",
    "inverse_hessian_factor",
    "output_error",
    "quantize_matrix",
]

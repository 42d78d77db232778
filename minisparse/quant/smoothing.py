"""Equivalent per-channel scaling: SmoothQuant (W8A8) and AWQ (low-bit weights).

For any positive vector s over the input channels of a linear layer,

    y = x W^T = (x diag(s)^-1) (W diag(s))^T,

so dividing input channel j by s_j and multiplying weight column j by s_j changes nothing in
exact arithmetic. It changes what quantization sees: a large s_j shrinks channel j of the
activations and stretches column j of the weights. The division is free when it can be *folded*
into the module that produced x, channel by channel (``fold_scales``):

    attn_norm -> q, k, v      RMSNorm weight g_j / s_j
    v_proj    -> o_proj       rows of W_v / s_j (with GQA one value channel feeds several
                              query heads, so s is shared by those heads' channels)
    mlp_norm  -> gate, up     RMSNorm weight g_j / s_j
    up_proj   -> down_proj    rows of W_up / s_j, since down's input is act(gate x) * (up x)

**SmoothQuant** (Xiao et al., "SmoothQuant: Accurate and Efficient Post-Training Quantization
for Large Language Models", ICML 2023) makes activations easy to quantize per token by moving
their outlier channels into the weights:

    s_j = max|x_j|^α / max|W_:,j|^(1-α),       α = 0.5 balances the two ranges,

after which both x/s and W s are quantized to int8 (weights per output channel, activations
per token).

**AWQ** (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration", MLSys 2024) quantizes weights only, and uses the scaling to protect the ~1 % of
weights that meet large activations: scaling column j up by s_j > 1 divides its relative
rounding error by about s_j. It searches

    s = mean|x|^α (normalised),   α in {0, 1/n, ..., (n-1)/n},
    α* = argmin || x W^T - (x / s) Q(W diag(s))^T ||^2       on the calibration tokens,

and then, per output row and group, a clip ratio r in {1, 0.95, ..., 0.55} of the weight range
that minimises the same error for that group's partial products (not for q and k, whose errors
meet inside the attention scores).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..core.model import RMSNorm, Transformer
from .calibration import (
    LinearGroup,
    QuantConfig,
    QuantMethod,
    block_groups,
    calibrate_layers,
    register_quant_method,
)
from .layers import set_weight
from .options import AWQOptions, SmoothQuantOptions
from .tensor import (
    QuantizedTensor,
    QuantSpec,
    fake_quantize,
    fake_quantize_groups,
    grouped,
    quantize_tensor,
)

CLIP_RATIOS = tuple(1.0 - i / 20 for i in range(10))  # AWQ: shrink the range by up to 45 %


# --------------------------------------------------------------------------------------------
# Folding
# --------------------------------------------------------------------------------------------


def to_prev_channels(group: LinearGroup, v: Tensor, reduce: str = "max") -> Tensor:
    """A per-input-channel vector [in] of the group as one per channel of ``prev``.

    Without GQA they are the same channels. With GQA, o_proj's input holds ``repeat`` query
    heads per value head: the channels that share a value channel are reduced (max or mean).
    """
    if group.repeat == 1:
        return v
    heads = v.reshape(-1, group.repeat, group.head_dim)
    return heads.amax(1).reshape(-1) if reduce == "max" else heads.mean(1).reshape(-1)


def to_input_channels(group: LinearGroup, s: Tensor) -> Tensor:
    """Scales over ``prev``'s channels, repeated over the group's input channels."""
    if group.repeat == 1:
        return s
    heads = s.reshape(-1, 1, group.head_dim).expand(-1, group.repeat, group.head_dim)
    return heads.reshape(-1)


def check_foldable(parent: nn.Module, group: LinearGroup) -> None:
    """A scale folds through ``prev`` only when nothing but a product sits in between."""
    for slot in group.between:
        try:
            module = parent.get_submodule(slot)
        except AttributeError:
            continue  # a model without that slot
        if not isinstance(module, nn.Identity):
            raise ValueError(
                f"{slot} holds {module}, and per-channel scales cannot be folded through it; "
                "quantize the model first and add thresholds or activations afterwards "
                "(minisparse.sparsity.remove_thresholds takes thresholds out)."
            )


@torch.no_grad()
def fold_scales(parent: nn.Module, group: LinearGroup, s: Tensor) -> None:
    """Divide ``prev``'s output channel j by s_j and multiply the group's input column j by it.

    ``s`` has one entry per output channel of ``prev`` (``to_input_channels`` spreads it over
    the group's inputs). The layer computes the same function afterwards (up to rounding).
    """
    check_foldable(parent, group)
    prev = parent.get_submodule(group.prev)
    if isinstance(prev, RMSNorm):
        prev.weight.div_(s.to(prev.weight.dtype))
    elif isinstance(prev, nn.Linear):
        set_weight(prev, prev.weight / s.to(prev.weight.dtype)[:, None])
        if prev.bias is not None:
            prev.bias.div_(s.to(prev.bias.dtype))
    else:
        raise TypeError(
            f"Cannot fold scales into {type(prev).__name__}; expected RMSNorm or Linear."
        )
    cols = to_input_channels(group, s)
    for name in group.linears:
        linear = parent.get_submodule(name)
        set_weight(linear, linear.weight * cols.to(linear.weight.dtype)[None, :])


def group_weights(parent: nn.Module, group: LinearGroup) -> list[Tensor]:
    return [parent.get_submodule(name).weight.detach() for name in group.linears]


# --------------------------------------------------------------------------------------------
# SmoothQuant
# --------------------------------------------------------------------------------------------


def smoothquant_scales(
    x: Tensor, weights: Sequence[Tensor], group: LinearGroup, alpha: float = 0.5
) -> Tensor:
    """s_j = max|x_j|^α / max|W_:,j|^(1-α) over ``prev``'s channels (1 where either max is 0)."""
    x_max = to_prev_channels(group, x.abs().amax(0))
    w_max = to_prev_channels(group, torch.cat(list(weights)).abs().amax(0))
    s = x_max.pow(alpha) / w_max.pow(1 - alpha)
    ok = (x_max > 0) & (w_max > 0)
    return torch.where(ok, s, torch.ones_like(s)).clamp_min(1e-5)


def smoothquant_layer(
    layer: nn.Module, groups: Sequence[LinearGroup], inputs: dict[str, Tensor], config: QuantConfig
) -> dict[str, QuantizedTensor]:
    """Smooth every group of a layer (α = ``config.options.alpha``), then round to int8."""
    for group in groups:
        weights = group_weights(layer, group)
        fold_scales(
            layer,
            group,
            smoothquant_scales(inputs[group.name], weights, group, config.options.alpha),
        )
    return round_layer(layer, groups, config.weight_spec)


def round_layer(
    layer: nn.Module, groups: Sequence[LinearGroup], spec: QuantSpec
) -> dict[str, QuantizedTensor]:
    weights = {
        name: layer.get_submodule(name).weight.detach().float()
        for g in groups
        for name in g.linears
    }
    return {name: quantize_tensor(w, spec) for name, w in weights.items()}


# --------------------------------------------------------------------------------------------
# AWQ
# --------------------------------------------------------------------------------------------


def output_error(diff: Tensor, h: Tensor, n: int) -> Tensor:
    """Mean over n rows of x and the rows of ``diff`` of (x · diff_r)^2, from H = X^T X.

    ||X D^T||^2 = sum_r d_r H d_r^T: every calibration token counts, at a cost that does not grow
    with their number. ``diff`` [..., in] against ``h`` [in, in], or grouped [rows, groups, g]
    against per-group blocks [groups, g, g]: then the error per (row, group) [rows, groups].
    """
    if diff.dim() == 3:
        per_group = torch.bmm(diff.transpose(0, 1), h).transpose(0, 1)  # [rows, groups, g]
        return (per_group * diff).sum(-1) / n
    return ((diff @ h) * diff).sum() / (n * diff.shape[0])


@dataclass
class ScaleSearch:
    """AWQ's grid search for one group: the chosen scales and the output error per α."""

    scales: Tensor
    alphas: list[float]
    losses: list[float]

    @property
    def best_alpha(self) -> float:
        return self.alphas[min(range(len(self.losses)), key=self.losses.__getitem__)]


def awq_search(
    x: Tensor, weights: Sequence[Tensor], group: LinearGroup, spec: QuantSpec, n_grid: int = 20
) -> ScaleSearch:
    """s = mean|x|^α / sqrt(max · min) for the α in the grid with the smallest output error.

    The error is the mean of (x · (w - ŵ))^2 over all rows of ``x`` and of the weights,
    computed from H = X^T X (``output_error``). It runs in float32, or in float64 when ``x`` is
    float64 (for exact comparisons).
    """
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    x = x.reshape(-1, x.shape[-1]).to(dtype)
    h = x.T @ x
    w = torch.cat(list(weights)).to(dtype)
    x_mean = to_prev_channels(group, x.abs().mean(0), reduce="mean")
    alphas = [i / n_grid for i in range(n_grid)]
    losses: list[float] = []
    best = x_mean
    for alpha in alphas:
        s = x_mean.pow(alpha).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        cols = to_input_channels(group, s)[None, :]
        w_hat = torch.cat([fake_quantize(wi.to(dtype) * cols, spec) / cols for wi in weights])
        losses.append(float(output_error(w - w_hat, h, x.shape[0])))
        if losses[-1] <= min(losses):
            best = s
    return ScaleSearch(scales=best, alphas=alphas, losses=losses)


def awq_clip(
    w: Tensor, x: Tensor, spec: QuantSpec, ratios: Sequence[float] = CLIP_RATIOS
) -> Tensor:
    """Per (row, group), the range ratio r that minimises the group's output error on ``x``.

    err(r) = mean over rows of x of (x_g · (w_g - Q_r(w_g)))^2, with x_g the group's columns,
    from the group's block of H = X^T X. Returns ratios [rows, groups] for
    ``quantize_tensor(w, spec, clip=...)``.
    """
    if spec.per_tensor:
        return torch.ones(1, 1, dtype=w.dtype, device=w.device)
    wg = grouped(w.float(), spec)  # [rows, groups, g]
    x = x.reshape(-1, x.shape[-1]).float()
    pad = wg.shape[1] * wg.shape[2] - w.shape[1]
    xp = torch.cat([x, x.new_zeros(x.shape[0], pad)], dim=1) if pad else x
    xg = xp.reshape(x.shape[0], wg.shape[1], wg.shape[2])  # zero padding: no partial product
    h = torch.einsum("ngk,ngl->gkl", xg, xg)  # [groups, g, g]
    best_err = torch.full(wg.shape[:2], float("inf"), device=w.device)
    best_ratio = torch.ones(wg.shape[:2], device=w.device)
    for r in ratios:
        err = output_error(wg - fake_quantize_groups(wg, spec, clip=r), h, x.shape[0])
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, torch.full_like(best_ratio, r), best_ratio)
    return best_ratio


def awq_scales(
    layer: nn.Module, groups: Sequence[LinearGroup], inputs: dict[str, Tensor], config: QuantConfig
) -> dict[str, Tensor]:
    """AWQ's scale for each group of a layer, searched on the layer as it is (none applied)."""
    spec = config.weight_spec
    search = config.options.awq_search_fn or awq_search
    return {
        group.name: search(
            inputs[group.name],
            group_weights(layer, group),
            group,
            spec,
            config.options.awq_grid,
        ).scales
        for group in groups
    }


def awq_layer(
    layer: nn.Module, groups: Sequence[LinearGroup], inputs: dict[str, Tensor], config: QuantConfig
) -> dict[str, QuantizedTensor]:
    """Search all of a layer's scales, fold them, search clip ratios, round (AWQ's order)."""
    spec = config.weight_spec
    scales = awq_scales(layer, groups, inputs, config)
    for group in groups:
        fold_scales(layer, group, scales[group.name])
    out = {}
    for group in groups:
        x = inputs[group.name].float()
        x = x / to_input_channels(group, scales[group.name]).float()  # what the layer sees now
        for name in group.linears:
            w = layer.get_submodule(name).weight.detach().float()
            clip_this = config.options.awq_clip and not name.endswith(("q_proj", "k_proj"))
            clip = awq_clip(w, x, spec) if clip_this else 1.0
            out[name] = quantize_tensor(w, spec, clip=clip)
    return out


# --------------------------------------------------------------------------------------------
# Smoothing alone (no rounding): the equivalence the tests and the notebook check
# --------------------------------------------------------------------------------------------


def smooth_model(
    model: Transformer,
    calib_batches: Tensor,
    method: str = "smoothquant",
    progress: bool = True,
    **options: object,
) -> Transformer:
    """A copy of ``model`` with SmoothQuant's or AWQ's scales folded in and nothing rounded.

    It computes the same function as ``model`` (up to float rounding): only where the
    quantizer would later see the values has changed. ``options`` are ``QuantConfig`` fields
    (``alpha``; ``bits``, ``group_size``, ``awq_grid`` for AWQ's search).
    """
    import copy

    if method not in ("smoothquant", "awq"):
        raise ValueError(f"smooth_model folds 'smoothquant' or 'awq' scales, got {method!r}.")
    config = QuantConfig.build(method, **options)
    new = copy.deepcopy(model).eval()

    def fold_only(
        layer: nn.Module, groups: Sequence[LinearGroup], inputs: dict[str, Tensor]
    ) -> dict:
        if method == "awq":
            scales = awq_scales(layer, groups, inputs, config)
        else:
            weights = {g.name: group_weights(layer, g) for g in groups}
            scales = {
                g.name: smoothquant_scales(inputs[g.name], weights[g.name], g, config.options.alpha)
                for g in groups
            }
        for group in groups:
            fold_scales(layer, group, scales[group.name])
        return {}

    with torch.no_grad():
        calibrate_layers(new, calib_batches.to(new.device), fold_only, config, progress)
    return new


register_quant_method(
    QuantMethod(
        "smoothquant",
        "W8A8: move activation outliers into the weights, then round both",
        SmoothQuantOptions,
        smoothquant_layer,
        act_bits=8,
    )
)
register_quant_method(
    QuantMethod(
        "awq", "weight-only: scale salient input channels up before rounding", AWQOptions, awq_layer
    )
)

__all__ = [
    "CLIP_RATIOS",
    "ScaleSearch",
    "awq_clip",
    "awq_layer",
    "awq_scales",
    "awq_search",
    "block_groups",
    "fold_scales",
    "smooth_model",
    "smoothquant_layer",
    "smoothquant_scales",
    "to_input_channels",
    "to_prev_channels",
]

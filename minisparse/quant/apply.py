"""Quantization: fewer bits per weight, fewer bytes per token.

At batch 1 a decode step streams every weight once (chapter 00), so its time is about
bytes / bandwidth. Storing weights in 8 bits instead of 32 divides those bytes by 4, in 4 bits
by 8 — if the model still works, and if a kernel reads the low-bit weights directly.

**Uniform quantization** (``minisparse.quant.tensor``) stores a group of numbers as b-bit
integer codes q and one scale s (and, for the asymmetric form, one offset m), x̂ = s q + m, with
s = max|x| / (2^(b-1) - 1) (symmetric) or (max x - min x) / (2^b - 1) (asymmetric). Rounding to
the nearest grid point errs by at most s / 2, so the error is set by the range of the group, and
one large value (an outlier) coarsens the grid of all the others. A group is a whole tensor, an
output channel (a row of W [out, in]), or g consecutive inputs of a row (``QuantSpec``).

**Activations** are quantized on the fly, per token (one scale per row of x) or per tensor.
Weight-and-activation quantization (W8A8) lets an int8 x int8 matmul do the work, but LLM
activations have a few channels with values 10-100x larger than the rest (Dettmers et al.,
2022), and they wreck the per-token grid. Three methods fix what plain round-to-nearest (RTN)
gets wrong; they live in their own modules and ``quantize_model`` runs them:

* **SmoothQuant** (Xiao et al., ICML 2023; ``quant.smoothing``): divide activation channel
  j by s_j = max|x_j|^α / max|W_:,j|^(1-α) and multiply weight column j by s_j. The product is
  unchanged, and the outliers migrate into the weights, which are easier to quantize.
* **AWQ** (Lin et al., MLSys 2024; ``quant.smoothing``): the same equivalent scaling, used
  for weight-only quantization: scaling up the columns that meet large activations protects the
  salient weights. s = mean|x|^α, with α picked by a grid search on the layer's output error,
  then a search of the clip ratio per group.
* **GPTQ** (Frantar et al., ICLR 2023; ``minisparse.quant.gptq``): quantize W column by column and
  push each column's rounding error onto the columns not yet quantized, weighted by the inverse
  Hessian of the layer's squared output error, H = X^T X.

The scaling and the Hessian come from calibration text, layer by layer: each layer is measured
on the outputs of the layers before it *after* their quantization, as GPTQ and AWQ do
(``minisparse.quant.calibration``).

**Execution.** ``quantize_model`` returns a model with fake-quantized weights (the dequantized
x̂ stored in float32, the reference for quality) or, with ``packed=True``, real low-bit layers
(``Int8Linear``, ``Int4Linear``; ``minisparse.quant.layers``) that keep only the codes and
scales and call torch's CPU kernels ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu``.

**Layout.** The modules build on each other in one direction: ``tensor`` (the codes and
scales of one tensor) < ``layers`` (linear layers on the codes) < ``calibration``
(settings, groups of layers, the layer-by-layer loop) < ``gptq`` and ``smoothing`` (the
methods) < this module (a whole model). The names of the lower modules are importable from here
too, so ``minisparse.quant`` is the one place to import quantization from.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..core.model import Linear, Transformer
from .calibration import (
    QUANT_METHODS,
    LayerHandler,
    LinearGroup,
    QuantConfig,
    block_groups,
    calibrate_layers,
    check_packable,
    group_inputs,
    install,
)
from .layers import (
    INT4_KERNEL_BLOCKS,
    ActQuantLinear,
    Int4Linear,
    Int8Linear,
    PackedLinear,
    int4_kernel_block,
    packed_linear,
    set_weight,
    target_device,
)
from .tensor import (
    QuantizedTensor,
    QuantSpec,
    check_bits,
    check_finite,
    code_dtype,
    dequantize_tensor,
    fake_quantize,
    fake_quantize_groups,
    grouped,
    quant_params,
    quantize_tensor,
    round_to_grid,
    ungrouped,
)

# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------


def untie_lm_head_(model: Transformer) -> Transformer:
    """Give ``model`` an LM head of its own, a copy of the tied embedding; in place, returns it.

    The embedding table keeps its values for the lookup; the config no longer ties them (so
    ``tie_weights`` cannot put the table back into the head).
    """
    if model.lm_head.weight is model.embed.weight:
        old = model.lm_head
        head = Linear(old.in_features, old.out_features, bias=False, device=old.weight.device)
        head.weight = nn.Parameter(old.weight.detach().clone(), requires_grad=False)
        set_weight(head, old.weight.detach())
        head.streaming = getattr(old, "streaming", False)
        model.lm_head = head
    model.config = dataclasses.replace(model.config, tie_embeddings=False)
    return model


untie_lm_head = untie_lm_head_  # the name before the in-place convention


def check_calibration(tokens: Tensor | None, method: str) -> Tensor:
    if tokens is None:
        raise ValueError(
            f"method {method!r} needs calibration text: pass calib_batches=token_batches("
            "tokenizer, corpus(split='calib'), 256, 8) (from minisparse.io.data)."
        )
    if tokens.dim() != 2 or tokens.dtype != torch.long:
        raise ValueError(
            f"calib_batches must be token ids [batch, seq] (torch.long), got "
            f"{tuple(tokens.shape)} {tokens.dtype}; use minisparse.io.data.token_batches."
        )
    return tokens


def quantize_model(
    model: Transformer,
    method: str = "rtn",
    bits: int = 8,
    group_size: int | None = None,
    calib_batches: Tensor | None = None,
    *,
    progress: bool = True,
    **options: object,
) -> Transformer:
    """A quantized copy of ``model`` (the input is left untouched).

    ``method``: ``"rtn"`` (round to nearest), ``"smoothquant"`` (W8A8 after smoothing),
    ``"awq"`` or ``"gptq"``; the last three need ``calib_batches`` [batch, seq] token ids.
    ``bits`` and ``group_size`` (None: one scale per output channel) set the weights' grid.
    Every linear layer of the decoder is quantized by ``method``; the LM head, the largest
    single matrix, is rounded to nearest in every method (the three papers leave it in 16 bits,
    and its 49k rows would dominate AWQ's search), or kept with ``lm_head=False``. A head tied
    to the embedding is untied first: the embedding table keeps its values for the lookup.
    Further ``options`` are the fields of ``QuantConfig``: ``symmetric``, ``act_bits`` (8 for
    W8A8, per-token; SmoothQuant's default), ``act_per_tensor``, ``packed`` (real int8/int4
    kernels instead of fake-quantized float32 weights), and the method's own settings
    (``QUANT_METHODS[method].options``: ``alpha`` for SmoothQuant; ``awq_grid``, ``awq_clip``
    for AWQ; ``gptq_damp``, ``gptq_block`` for GPTQ). The copy carries its ``quant_config``.
    Weights holding NaN or inf are refused (a ValueError naming the layer): one would turn its
    whole row or group NaN.
    """
    config = QuantConfig.build(method, bits=bits, group_size=group_size, **options)
    tokens = check_calibration(calib_batches, method) if config.calibrated else None
    check_finite_weights(model)
    new = copy.deepcopy(model).eval()
    if config.lm_head:
        untie_lm_head_(new)
    with torch.no_grad():
        if tokens is None:
            quantize_rtn(new, config, progress)
        else:
            quantize_calibrated(new, config, tokens.to(new.device), progress)
    new.quant_config = config
    return new


def check_finite_weights(model: nn.Module) -> None:
    """Refuse a model whose linear or embedding weights hold NaN or inf, naming the first."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            check_finite(module.weight.detach(), f"{name}.weight")


def quantize_rtn(model: Transformer, config: QuantConfig, progress: bool) -> None:
    """Round every linear layer's weight to the nearest grid point, independently."""
    spec = config.weight_spec
    for layer in tqdm(model.layers, desc=config.label(), disable=not progress):
        for group in block_groups(model):
            for name in group.linears:
                weight = layer.get_submodule(name).weight.detach().float()
                install(layer, name, quantize_tensor(weight, spec), config)
    if config.lm_head:
        quantize_head(model, config)


def quantize_calibrated(
    model: Transformer, config: QuantConfig, tokens: Tensor, progress: bool
) -> None:
    """SmoothQuant, AWQ or GPTQ on the decoder layers, then the LM head rounded to nearest."""
    method = QUANT_METHODS[config.method].layer
    assert method is not None
    calibrate_layers(model, tokens, lambda *args: method(*args, config), config, progress)
    if config.lm_head:
        quantize_head(model, config)


def quantize_head(model: Transformer, config: QuantConfig) -> None:
    """Round the LM head to nearest (every method does: see ``quantize_model``)."""
    weight = model.lm_head.weight.detach().float()
    install(model, "lm_head", quantize_tensor(weight, config.weight_spec), config)


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


def streamed_bytes(model: nn.Module) -> int:
    """Bytes a batch-1 decode step reads: every weight, code, scale and norm once.

    An embedding table that is not also the LM head is left out: the lookup reads one row; so
    is a second layout of the same weights (``duplicate_buffers``, e.g. ``Int4Linear.blocks``).
    """
    head = getattr(model, "lm_head", None)
    head_weight = getattr(head, "weight", None)
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding) and module.weight is not head_weight:
            seen.add(module.weight.data_ptr())
            continue
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        skipped = module._non_persistent_buffers_set | set(getattr(module, "duplicate_buffers", ()))
        persistent = {id(b) for n, b in module.named_buffers(recurse=False) if n not in skipped}
        for t in tensors:
            if isinstance(t, nn.Parameter) or id(t) in persistent:
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
    return total


__all__ = [
    "INT4_KERNEL_BLOCKS",
    "QUANT_METHODS",
    "ActQuantLinear",
    "Int4Linear",
    "Int8Linear",
    "LayerHandler",
    "LinearGroup",
    "PackedLinear",
    "QuantConfig",
    "QuantSpec",
    "QuantizedTensor",
    "block_groups",
    "calibrate_layers",
    "check_bits",
    "check_finite",
    "check_packable",
    "code_dtype",
    "dequantize_tensor",
    "fake_quantize",
    "fake_quantize_groups",
    "group_inputs",
    "grouped",
    "install",
    "int4_kernel_block",
    "packed_linear",
    "quant_params",
    "quantize_model",
    "quantize_tensor",
    "round_to_grid",
    "set_weight",
    "streamed_bytes",
    "target_device",
    "ungrouped",
    "untie_lm_head_",
]

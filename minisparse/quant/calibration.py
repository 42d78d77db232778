"""Calibrated quantization, layer by layer: its settings, its unit, and its driver loop.

SmoothQuant, AWQ and GPTQ (``minisparse.smoothing``, ``minisparse.gptq``) choose a layer's
codes from the inputs that layer sees on calibration text. Three pieces they share live here:

* ``QuantConfig``: every setting of a quantization (method, bits, groups, activations, packed
  kernels, each method's knobs), checked once when it is built.
* ``LinearGroup``: the linear layers that read the same input (q, k, v; gate, up; o; down), the
  unit of calibration. Their input is captured once, and the module that produced it (``prev``)
  is where SmoothQuant and AWQ fold their per-channel scales.
* ``calibrate_layers``: the loop. Each decoder layer is measured on the outputs of the layers
  before it *after* their quantization (as GPTQ and AWQ do), handed to a method's layer
  function, and its new weights installed (``install``: fake-quantized float32, activation
  quantization, or packed int8/int4 layers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..core.hooks import capture_inputs
from ..core.model import Transformer
from ..core.rope import rope_cos_sin
from .layers import ActQuantLinear, packed_linear, set_weight
from .tensor import QuantizedTensor, QuantSpec, check_bits

METHODS = ("rtn", "smoothquant", "awq", "gptq")

# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantConfig:
    """Everything ``quantize_model`` does (it builds one from its arguments and checks it)."""

    method: str = "rtn"
    bits: int = 8
    group_size: int | None = None
    symmetric: bool | None = None  # None: symmetric at 8 bits, asymmetric below
    act_bits: int | None = None  # W8A8: 8 (per-token, dynamic); None: weight-only
    act_per_tensor: bool = False
    lm_head: bool = True
    packed: bool = False
    alpha: float = 0.5  # SmoothQuant migration strength
    awq_grid: int = 20  # AWQ: alpha in {0, 1/n, ..., (n-1)/n}
    awq_clip: bool = True
    gptq_damp: float = 0.01  # GPTQ: lambda = damp * mean(diag H)
    gptq_block: int = 128

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"Unknown method {self.method!r}; use one of {METHODS}.")
        if self.method == "smoothquant" and self.act_bits is None:
            object.__setattr__(self, "act_bits", 8)
        if self.symmetric is None:
            object.__setattr__(self, "symmetric", self.bits == 8)
        QuantSpec(self.bits, self.group_size, bool(self.symmetric))  # checks bits, group_size
        if self.act_bits is not None:
            check_bits(self.act_bits, "act_bits")
        if self.packed:
            check_packable(self)
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1] (SmoothQuant uses 0.5), got {self.alpha}.")
        if self.awq_grid < 1 or self.gptq_block < 1:
            raise ValueError("awq_grid and gptq_block must be at least 1.")
        if self.gptq_damp <= 0:
            raise ValueError(f"gptq_damp must be > 0 (GPTQ uses 0.01), got {self.gptq_damp}.")

    @property
    def weight_spec(self) -> QuantSpec:
        return QuantSpec(bits=self.bits, group_size=self.group_size, symmetric=bool(self.symmetric))

    @property
    def act_spec(self) -> QuantSpec | None:
        if self.act_bits is None:
            return None
        return QuantSpec(bits=self.act_bits, symmetric=True, per_tensor=self.act_per_tensor)

    @property
    def calibrated(self) -> bool:
        return self.method != "rtn"

    def label(self) -> str:
        """A short name such as 'W4 g128 awq' or 'W8A8 smoothquant'."""
        w = f"W{self.bits}" + (f"A{self.act_bits}" if self.act_bits else "")
        g = "" if self.group_size is None else f" g{self.group_size}"
        return f"{w}{g} {self.method}"


def check_packable(config: QuantConfig) -> None:
    if config.bits not in (4, 8):
        raise ValueError(
            f"packed=True runs the int8 or int4 CPU kernels: use bits=8 or bits=4 (got "
            f"{config.bits}), or packed=False to fake-quantize at {config.bits} bits."
        )
    if config.act_bits is not None:
        raise ValueError(
            "packed=True is weight-only: drop act_bits, or use packed=False (fake quantization) "
            "for weight-and-activation quantization."
        )
    if config.bits == 8 and (config.group_size is not None or not config.symmetric):
        raise ValueError(
            "The int8 kernel takes one symmetric scale per output channel: use group_size=None "
            "and symmetric=True with bits=8, or bits=4 for grouped weights."
        )


# --------------------------------------------------------------------------------------------
# Which linear layers read the same input (the unit of calibration)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearGroup:
    """Linear layers that read the same input, and the module whose output that input is.

    ``prev`` names the module that produces the input channel by channel, where per-channel
    scales can be folded: an RMSNorm (its weight) or a linear layer (its output rows). ``repeat``
    > 1 when each channel of ``prev`` feeds ``repeat`` input channels of the group (GQA: one
    value head serves several query heads, so o_proj's input repeats v_proj's channels per head).
    ``between`` names an optional activation slot between ``prev`` and the group, which must be
    an identity for a scale to fold through it.
    """

    name: str
    linears: tuple[str, ...]
    prev: str
    repeat: int = 1
    head_dim: int = 1
    between: tuple[str, ...] = ()


def block_groups(model: Transformer) -> list[LinearGroup]:
    """The four groups of a decoder layer, in the order AWQ visits them."""
    c = model.config
    return [
        LinearGroup(
            "qkv", ("attn.q_proj", "attn.k_proj", "attn.v_proj"), "attn_norm",
            between=("attn_in_act",),
        ),
        LinearGroup(
            "o", ("attn.o_proj",), "attn.v_proj", repeat=c.n_heads // c.n_kv_heads,
            head_dim=c.head_dim,
        ),
        LinearGroup(
            "gate_up", ("mlp.gate_proj", "mlp.up_proj"), "mlp_norm", between=("mlp_in_act",),
        ),
        LinearGroup("down", ("mlp.down_proj",), "mlp.up_proj", between=("mlp.down_in_act",)),
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Layer by layer
# --------------------------------------------------------------------------------------------


def install(parent: nn.Module, name: str, qt: QuantizedTensor, config: QuantConfig) -> nn.Module:
    """Put the quantized weight ``qt`` in place of the linear layer ``parent.<name>``."""
    linear = parent.get_submodule(name)
    if config.packed:
        parent.set_submodule(name, packed_linear(qt, linear.bias))
    else:
        set_weight(linear, qt.dequantize())
        if config.act_spec is not None:
            parent.set_submodule(name, ActQuantLinear(linear, config.act_spec))
    return parent.get_submodule(name)


def group_inputs(
    parent: nn.Module, groups: list[LinearGroup], run: Callable[[], object]
) -> dict[str, Tensor]:
    """Each group's input rows [tokens, in] while ``run()`` runs ``parent`` (forward pre-hooks)."""
    first = {g.name: parent.get_submodule(g.linears[0]) for g in groups}
    with capture_inputs(first) as store:
        run()
    return {name: torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]) for name, xs in store.items()}


#: Quantizes one decoder layer: (layer, its groups, each group's input rows) -> codes by name.
LayerHandler = Callable[
    [nn.Module, list[LinearGroup], dict[str, Tensor]], dict[str, QuantizedTensor]
]


def calibrate_layers(
    model: Transformer,
    tokens: Tensor,
    handle_layer: LayerHandler,
    config: QuantConfig,
    progress: bool = True,
) -> None:
    """Run ``handle_layer`` on every layer in turn, on the hidden states of the layers before it.

    Layer l sees the calibration tokens as transformed by layers 0..l-1 *after* their
    quantization, so it can correct for their errors (GPTQ and AWQ do the same). The hidden
    states of all calibration tokens are kept at one layer boundary only.
    """
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    x = model.embed(tokens)
    cos, sin = rope_cos_sin(model.inv_freq, positions, x.dtype)
    cos, sin = cos * model.rope_scale, sin * model.rope_scale
    groups = block_groups(model)
    for layer in tqdm(model.layers, desc=config.label(), disable=not progress):
        inputs = group_inputs(layer, groups, lambda: layer(x, cos, sin, positions, None))  # noqa: B023
        for name, qt in handle_layer(layer, groups, inputs).items():
            install(layer, name, qt, config)
        x = layer(x, cos, sin, positions, None)


__all__ = [
    "METHODS",
    "LayerHandler",
    "LinearGroup",
    "QuantConfig",
    "block_groups",
    "calibrate_layers",
    "check_packable",
    "group_inputs",
    "install",
]

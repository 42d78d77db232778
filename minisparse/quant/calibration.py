"""Calibrated quantization, layer by layer: its settings, its unit, and its driver loop.

SmoothQuant, AWQ and GPTQ (``minisparse.quant.smoothing``, ``minisparse.quant.gptq``) choose a
layer's codes from the inputs that layer sees on calibration text. The pieces they share live
here:

* ``QUANT_METHODS``: the methods by name (``register_quant_method``; RTN here, SmoothQuant and
  AWQ in ``smoothing``, GPTQ in ``gptq``), each with its own settings dataclass;
* ``QuantConfig``: every setting of a quantization (method, bits, groups, activations, packed
  kernels) and the method's own options, checked once when it is built.
* ``LinearGroup``: the linear layers that read the same input (q, k, v; gate, up; o; down), the
  unit of calibration. Their input is captured once, and the module that produced it (``prev``)
  is where SmoothQuant and AWQ fold their per-channel scales.
* ``calibrate_layers``: the loop. Each decoder layer is measured on the outputs of the layers
  before it *after* their quantization (as GPTQ and AWQ do), handed to a method's layer
  function, and its new weights installed (``install``: fake-quantized float32, activation
  quantization, or packed int8/int4 layers). The loop itself, without the installing, is
  ``sequential_layers``; weight pruning (``minisparse.pruning``) runs it too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..core.hooks import capture_inputs
from ..core.model import Transformer
from ..core.registry import Registry
from ..core.rope import rope_cos_sin
from .layers import ActQuantLinear, packed_linear, set_weight
from .tensor import QuantizedTensor, QuantSpec, check_bits, check_finite

#: What to do about NaN or inf calibration inputs (``sequential_layers`` refuses them).
FIX_INPUTS = (
    "measurements taken from them would be NaN. A weight of an earlier layer holds NaN or inf, "
    "or the values overflow: reload the model, or check its weights with torch.isfinite."
)

#: A method's layer function: (decoder layer, its groups, their captured inputs, config) ->
#: per group name, what ``install`` puts in place (quantized weights, and scales to fold).
LayerFn = Callable[..., dict]


@dataclass(frozen=True)
class NoOptions:
    """A method without settings of its own (round to nearest)."""


@dataclass(frozen=True)
class QuantMethod:
    """One quantization method: its own settings (``options``, a frozen dataclass whose defaults
    are the paper's), its layer function (None: no calibration, every weight rounded on its
    own) and the activation bits it implies (SmoothQuant quantizes activations too)."""

    name: str
    summary: str
    options: type = NoOptions
    layer: LayerFn | None = None
    act_bits: int | None = None

    @property
    def calibrated(self) -> bool:
        return self.layer is not None


QUANT_METHODS: Registry[QuantMethod] = Registry("method")
register_quant_method = QUANT_METHODS.register
quant_method = QUANT_METHODS.find


register_quant_method(QuantMethod("rtn", "round each weight to the nearest grid point"))

# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantConfig:
    """Everything ``quantize_model`` does (it builds one from its arguments and checks it).

    The fields here are every method's; ``options`` holds the method's own settings (an
    instance of its ``QuantMethod.options``, the paper's defaults when not given).
    """

    method: str = "rtn"
    bits: int = 8
    group_size: int | None = None
    symmetric: bool | None = None  # None: symmetric at 8 bits, asymmetric below
    act_bits: int | None = None  # W8A8: 8 (per-token, dynamic); None: weight-only
    act_per_tensor: bool = False
    lm_head: bool = True
    packed: bool = False
    options: Any = None

    def __post_init__(self) -> None:
        method = quant_method(self.method)
        if self.options is None:
            object.__setattr__(self, "options", method.options())
        if not isinstance(self.options, method.options):
            raise ValueError(
                f"options for {self.method} are a {method.options.__name__}, got "
                f"{type(self.options).__name__}."
            )
        if method.act_bits is not None and self.act_bits is None:
            object.__setattr__(self, "act_bits", method.act_bits)
        if self.symmetric is None:
            object.__setattr__(self, "symmetric", self.bits == 8)
        QuantSpec(self.bits, self.group_size, bool(self.symmetric))  # checks bits, group_size
        if self.act_bits is not None:
            check_bits(self.act_bits, "act_bits")
        if self.packed:
            check_packable(self)

    @classmethod
    def build(cls, method: str = "rtn", **settings: Any) -> QuantConfig:
        """A config from flat settings: the common fields, and the method's own options by
        name (``alpha`` for SmoothQuant, ``awq_grid`` for AWQ, ``gptq_damp`` for GPTQ, ...)."""
        kind = quant_method(method)
        common = {f.name for f in fields(cls)} - {"method", "options"}
        own = {f.name for f in fields(kind.options)}
        unknown = set(settings) - common - own
        if unknown:
            others = {
                name: m.name
                for m in QUANT_METHODS.values()
                for name in (f.name for f in fields(m.options))
            }
            named = [
                f"{n} (an option of {others[n]})" if n in others else n for n in sorted(unknown)
            ]
            raise TypeError(
                f"Unknown options for {method}: {named}; it takes {sorted(common | own)}."
            )
        options = kind.options(**{k: v for k, v in settings.items() if k in own})
        return cls(method, options=options, **{k: v for k, v in settings.items() if k in common})

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
        return quant_method(self.method).calibrated

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


#: Changes one decoder layer in place, given its groups and each group's input rows.
LayerVisitor = Callable[[nn.Module, list[LinearGroup], dict[str, Tensor]], None]


def sequential_layers(
    model: Transformer,
    tokens: Tensor,
    visit: LayerVisitor,
    desc: str = "layers",
    progress: bool = True,
) -> None:
    """Run ``visit`` on every layer in turn, on the hidden states of the layers before it.

    Layer l sees the calibration tokens as transformed by layers 0..l-1 *after* ``visit``
    changed them, so it can correct for their errors (GPTQ, AWQ, SparseGPT and Wanda do the
    same). The hidden states of all calibration tokens are kept at one layer boundary only.
    A NaN or inf in a layer's inputs is refused (a ValueError naming the layer) before
    ``visit`` chooses anything from them.
    """
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    x = model.embed(tokens)
    cos, sin = rope_cos_sin(model.inv_freq, positions, x.dtype)
    cos, sin = cos * model.rope_scale, sin * model.rope_scale
    groups = block_groups(model)
    for i, layer in enumerate(tqdm(model.layers, desc=desc, disable=not progress)):
        inputs = group_inputs(layer, groups, lambda: layer(x, cos, sin, positions, None))  # noqa: B023
        for group in groups:
            check_finite(
                inputs[group.name], f"the input of layers.{i}.{group.linears[0]}", FIX_INPUTS
            )
        visit(layer, groups, inputs)
        x = layer(x, cos, sin, positions, None)


def calibrate_layers(
    model: Transformer,
    tokens: Tensor,
    handle_layer: LayerHandler,
    config: QuantConfig,
    progress: bool = True,
) -> None:
    """``sequential_layers`` installing what ``handle_layer`` returns: each layer is quantized
    on the outputs of the layers before it after their quantization."""

    def visit(layer: nn.Module, groups: list[LinearGroup], inputs: dict[str, Tensor]) -> None:
        for name, qt in handle_layer(layer, groups, inputs).items():
            install(layer, name, qt, config)

    sequential_layers(model, tokens, visit, config.label(), progress)


__all__ = [
    "QUANT_METHODS",
    "LayerFn",
    "LayerHandler",
    "LayerVisitor",
    "LinearGroup",
    "NoOptions",
    "QuantConfig",
    "QuantMethod",
    "block_groups",
    "calibrate_layers",
    "check_packable",
    "group_inputs",
    "install",
    "quant_method",
    "register_quant_method",
    "sequential_layers",
]

"""How a ``SparseMLP`` keeps its weights: float32 matrices, or chapter 09's int8 codes.

**float32** (``float_buffers``): W_gate and W_up [ffn, dim] as they are, and the down
projection transposed, W_down_t = W_down^T [ffn, dim], so that each neuron's down weights are
one contiguous row. The state dict is the dense MLP's (``down_proj.weight`` [dim, ffn]).

**int8** (``int8_buffers``). Chapter 09's ``Int8Linear`` stores a weight W [out, in] as int8
codes q and one scale per output channel, W[o, k] = s[o] q[o, k]. For the three projections of
a gated MLP that gives

    gate, up:  W_gate[j] = s_gate[j] q_gate[j]        (a scale per neuron j: per row)
    down:      W_down[c, j] = s_down[c] q_down[c, j]   (a scale per model channel c)

``SparseMLP`` keeps gate and up as they are (row sparsity reads the rows of the active neurons)
and down transposed, q_down_t = q_down^T [ffn, dim], so that neuron j's down codes are one
contiguous row; its scale stays one per output channel and factors out of the sum over the
active neurons:

    y[c] = sum_{j in A} h_j s_down[c] q_down_t[j, c] = s_down[c] sum_{j in A} h_j q_down_t[j, c].

The kernels are ``minisparse.kernels.cpu_int8``. The state dict is in ``Int8Linear``'s names,
so a sparse int8 model reads and writes the checkpoints of the int8 model. ``int8_mlp``
quantizes a float MLP the way ``minisparse.quant.quantize_model(bits=8, packed=True)`` does
(round to nearest, symmetric, one scale per output channel), so that the int8 model and the
sparse int8 model share their codes; ``dequantized_mlp`` is the float32 MLP of the same weights
(the reference).

``sparse_buffers``, ``checkpoint_state`` and ``checkpoint_targets`` pick the layout.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from ..core.model import MLP
from ..quant.layers import Int8Linear

__all__ = [
    "INT8_BUFFERS",
    "PROJECTIONS",
    "checkpoint_state",
    "checkpoint_targets",
    "dequantized_mlp",
    "float_buffers",
    "int8_buffers",
    "int8_mlp",
    "int8_targets",
    "is_int8_mlp",
    "sparse_buffers",
]

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
#: The buffers of a sparse int8 MLP: codes of gate, up (rows: neurons) and down transposed, and
#: float32 scales per neuron (gate, up) and per model channel (down).
INT8_BUFFERS = ("Q_gate", "s_gate", "Q_up", "s_up", "Q_down_t", "s_down")


def is_int8_mlp(mlp: nn.Module) -> bool:
    """True when gate, up and down are all ``Int8Linear``; an error for a mix of both kinds."""
    kinds = [isinstance(getattr(mlp, name), Int8Linear) for name in PROJECTIONS]
    if any(kinds) and not all(kinds):
        raise ValueError(
            "A sparse MLP needs gate_proj, up_proj and down_proj all float or all int8 "
            "(Int8Linear); quantize the whole MLP (minisparse.sparse.weights.int8_mlp)."
        )
    return all(kinds)


def int8_mlp(mlp: MLP) -> MLP:
    """A copy of ``mlp`` whose three projections are ``Int8Linear``: round to nearest, one
    symmetric scale per output channel, as ``quantize_model(bits=8, packed=True)`` rounds."""
    if is_int8_mlp(mlp):
        return copy.deepcopy(mlp)
    skip = {id(getattr(mlp, name)): None for name in PROJECTIONS}  # not copied: replaced below
    new = copy.deepcopy(mlp, memo=skip)
    for name in PROJECTIONS:
        setattr(new, name, Int8Linear.from_linear(getattr(mlp, name)))
    return new


def dequantized_mlp(mlp: MLP) -> MLP:
    """A float32 copy of an int8 ``mlp`` whose weights are the dequantized s q (the reference
    a sparse int8 MLP is compared against)."""
    new = copy.deepcopy(mlp)
    for name in PROJECTIONS:
        layer = getattr(mlp, name)
        linear = nn.Linear(layer.in_features, layer.out_features, bias=False)
        linear.weight.data = layer.dequantized().to(layer.q.device)
        setattr(new, name, linear)
    return new


def float_buffers(mlp: MLP) -> dict[str, Tensor]:
    """W_gate, W_up [ffn, dim] and W_down_t [ffn, dim] (down_proj's weight transposed)."""
    return {
        "W_gate": mlp.gate_proj.weight.detach(),
        "W_up": mlp.up_proj.weight.detach(),
        "W_down_t": mlp.down_proj.weight.detach().T.contiguous(),
    }


def sparse_buffers(mlp: MLP) -> dict[str, Tensor]:
    """The buffers of a sparse MLP made from ``mlp``: int8 for ``Int8Linear`` projections."""
    return int8_buffers(mlp) if is_int8_mlp(mlp) else float_buffers(mlp)


def checkpoint_state(module: nn.Module) -> dict[str, Tensor]:
    """A sparse MLP's weights in the names and layouts of the MLP it was made from (for int8,
    ``Int8Linear``'s: down_proj.q is [dim, ffn], scales in bfloat16)."""
    state = {k: v.contiguous() for k, v in checkpoint_targets(module).items()}
    if "Q_gate" in module._buffers:
        state = {k: v.to(torch.bfloat16) if k.endswith(".scale") else v for k, v in state.items()}
    return state


def checkpoint_targets(module: nn.Module) -> dict[str, Tensor]:
    """Where each key of ``checkpoint_state`` is loaded to (views into the buffers)."""
    if "Q_gate" in module._buffers:
        return int8_targets(module)
    b = module._buffers
    return {
        "gate_proj.weight": b["W_gate"],
        "up_proj.weight": b["W_up"],
        "down_proj.weight": b["W_down_t"].T,  # a view: copying into it fills W_down_t
    }


def int8_buffers(mlp: MLP) -> dict[str, Tensor]:
    """The codes and float32 scales of an int8 MLP in the sparse layout (``INT8_BUFFERS``).

    ``Int8Linear`` keeps its scales in bfloat16 for torch's kernel; widened to float32 they are
    the same numbers, so the sparse model computes with exactly the int8 model's weights.
    """
    gate, up, down = (getattr(mlp, name) for name in PROJECTIONS)
    return {
        "Q_gate": gate.q.detach(),
        "s_gate": gate.scale.detach().float(),
        "Q_up": up.q.detach(),
        "s_up": up.scale.detach().float(),
        "Q_down_t": down.q.detach().T.contiguous(),
        "s_down": down.scale.detach().float(),
    }


def int8_targets(module: nn.Module) -> dict[str, Tensor]:
    """Where each int8 key of ``checkpoint_state`` is loaded to: the buffers, down's codes as a
    transposed view (copying into it fills Q_down_t); a bfloat16 scale is widened by the copy."""
    b = module._buffers
    return {
        "gate_proj.q": b["Q_gate"],
        "gate_proj.scale": b["s_gate"],
        "up_proj.q": b["Q_up"],
        "up_proj.scale": b["s_up"],
        "down_proj.q": b["Q_down_t"].T,
        "down_proj.scale": b["s_down"],
    }

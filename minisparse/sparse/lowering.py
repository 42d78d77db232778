"""How the compiled decode step runs a ``SparseMLP`` (chapter 07): its C lowering.

Registered by exact type with ``minisparse.runtime.lowering``: the sparse MLP half becomes a
``SparseMlpLayer``, in threshold mode (active = |act(W_gate x)| > t, the gate read densely) or
in selector mode (a predictor registered for the MLP's ``select``, chapter 06, chooses the
rows; ``selector_of``). Its weights are float32 rows, or int8 codes with float32 scales (per
neuron for gate and up, per output channel for the transposed down projection). Anything else
(a hooked module, another activation, a selector the C step does not know, a ``gather``
function of its own) stays in torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.model import RMSNorm
from ..kernels.abi import FORMAT_CODES, Mat, Slot, SparseMlpLayer
from ..runtime.lowering import activation_of, lowers, plain_f32, ptr, selector_of
from .mlp import SparseMLP

__all__ = ["sparse_mlp_layer", "sparse_weights"]


def sparse_weights(mlp: SparseMLP) -> list[Mat] | None:
    """The C views of a SparseMLP's gate, up and down_t, or None when the buffers are not in a
    layout the C step reads."""
    if not mlp.int8:
        weights = (mlp.W_gate, mlp.W_up, mlp.W_down_t)
        if not plain_f32(*weights):
            return None
        return [Mat(w.data_ptr(), None, 0, FORMAT_CODES["f32"]) for w in weights]
    codes, scales = (mlp.Q_gate, mlp.Q_up, mlp.Q_down_t), (mlp.s_gate, mlp.s_up, mlp.s_down)
    if not all(
        q.device.type == "cpu" and q.dtype == torch.int8 and q.is_contiguous() for q in codes
    ) or not plain_f32(*scales):
        return None
    i8 = FORMAT_CODES["i8"]
    return [Mat(q.data_ptr(), s.data_ptr(), 0, i8) for q, s in zip(codes, scales, strict=True)]


@lowers("mlp", SparseMLP)
def sparse_mlp_layer(
    mlp: SparseMLP, norm: RMSNorm, slot: Slot, keep: list[Tensor]
) -> SparseMlpLayer | None:
    act = activation_of(mlp.act)
    weights = sparse_weights(mlp)
    if act is None or act[1] >= 0 or weights is None or mlp.gather is not None:
        return None  # a gather function of its own runs in torch
    ffn, dim = (mlp.Q_down_t if mlp.int8 else mlp.W_down_t).shape
    head = (dim, ffn)
    if mlp.threshold is not None:
        return SparseMlpLayer(
            *head, 0, norm.eps, ptr(norm.weight), *weights,
            act[0], slot, mlp.threshold, None, None, None, None, 0, 0.0,
        )  # fmt: skip
    fields = selector_of(mlp.select)
    if fields is None:
        return None
    rank, pu, pu_bias, pv, pv_bias, relu, cutoff = fields
    return SparseMlpLayer(
        *head, rank, norm.eps, ptr(norm.weight), *weights,
        act[0], slot, 0.0, pu, pu_bias, pv, pv_bias, relu, cutoff,
    )  # fmt: skip

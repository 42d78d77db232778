"""Torch references for the sparse kernels: the definitions every fast version is tested against.

Three products cover a sparse gated FFN  y = W_down (act(W_gate x) * (W_up x)):

* row-sparse GEMV (``gather_gemv``): only the rows ``idx`` of W are read,
      y_j = sum_k W[idx_j, k] x_k                        for j = 0 .. len(idx) - 1
  used for the gate and up projections, whose rows are the FFN's neurons;
* column-sparse GEMV (``scatter_gemv``): only the input channels that are active are read,
      y_n = sum_{k in A} W_t[k, n] x_k,   A = {k : |x_k| > t}  or  A = idx
  used for the down projection (whose inputs are the neurons) and, with a threshold on the
  hidden state, for any projection (the TEAL design);
* the fused FFN over the active neurons A:
      y = sum_{j in A} act(W_gate[j] . x) (W_up[j] . x) W_down_t[j, :]
  which equals the dense FFN with the inactive neurons' activations set to zero.

Every reference accumulates in float32 (float64 when given float64) and returns the input's
dtype. A batch x of shape [B, K] uses one active set for all rows (the union of the rows' sets):
that is what a batched sparse kernel reads, and why sparsity pays less as the batch grows.

The sums run over the *entries* of ``idx``: a repeated index counts once per occurrence (as
``W[idx]`` does in torch), and NaN or inf in the selected rows and columns propagate as in any
torch matmul. The references check their inputs like the kernels (``validate``), so they fail
with the same messages.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .validate import ACTIVATIONS as ACTIVATIONS  # the activation names, re-exported
from .validate import (
    check_activation,
    check_ffn,
    check_gather,
    check_indices,
    check_scatter,
    check_tensor,
    check_threshold,
)

__all__ = [
    "accumulation_dtype",
    "apply_activation",
    "gather_gemv_ref",
    "input_mask",
    "scatter_gemv_ref",
    "sparse_ffn_ref",
]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float type accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def apply_activation(h: Tensor, act: str) -> Tensor:
    """act(h) for the activation names the kernels know: silu, relu, gelu (exact, erf form)."""
    check_activation(act)
    if act == "silu":
        return F.silu(h)
    if act == "relu":
        return F.relu(h)
    if act == "gelu":
        return F.gelu(h)
    raise AssertionError(act)  # unreachable: check_activation knows ACTIVATIONS


def gather_gemv_ref(W: Tensor, x: Tensor, idx: Tensor) -> Tensor:
    """Row-sparse GEMV: x @ W[idx].T, shape [len(idx)] (or [B, len(idx)] for x [B, K])."""
    check_gather(W, x, idx)
    acc = accumulation_dtype(x.dtype)
    return (x.to(acc) @ W[idx.long()].to(acc).T).to(x.dtype)


def input_mask(x: Tensor, threshold: float | None = None, idx: Tensor | None = None) -> Tensor:
    """Boolean mask of the active input channels, same shape as x.

    With a threshold each row keeps its own channels with |x| > threshold; with idx every row
    keeps the channels idx.
    """
    check_tensor("x", x)
    check_threshold(threshold, idx)
    if idx is not None:
        check_indices(idx, x.shape[-1], "input channel")
        mask = torch.zeros(x.shape[-1], dtype=torch.bool, device=x.device)
        mask[idx.long()] = True
        return mask.expand_as(x)
    return x.abs() > threshold


def scatter_gemv_ref(
    W_t: Tensor, x: Tensor, threshold: float | None = None, idx: Tensor | None = None
) -> Tensor:
    """Column-sparse GEMV: (x * mask) @ W_t, W_t = W^T of shape [K, N]; returns [N] or [B, N].

    With idx the sum runs over its entries, x[..., idx] @ W_t[idx] (a repeated channel counts
    once per occurrence); with a threshold each row sums over its own channels with
    |x| > threshold, x[b, A_b] @ W_t[A_b]: the other rows of W_t are not part of the sum at all
    (a NaN there does not reach y, as it would through 0 * NaN in a masked dense product).
    """
    check_scatter(W_t, x, threshold, idx)
    acc = accumulation_dtype(x.dtype)
    if idx is not None:
        rows = idx.long()
        return (x[..., rows].to(acc) @ W_t[rows].to(acc)).to(x.dtype)
    N = W_t.shape[1]
    xb = x if x.dim() == 2 else x[None]
    mask = input_mask(xb, threshold)
    y = torch.zeros(xb.shape[0], N, dtype=acc, device=x.device)
    for b in range(xb.shape[0]):
        y[b] = xb[b, mask[b]].to(acc) @ W_t[mask[b]].to(acc)
    return y.reshape(*x.shape[:-1], N).to(x.dtype)


def sparse_ffn_ref(
    x: Tensor, W_gate: Tensor, W_up: Tensor, W_down_t: Tensor, idx: Tensor, act: str = "silu"
) -> Tensor:
    """Gated FFN over the neurons idx: act(x W_gate[idx]^T) * (x W_up[idx]^T) @ W_down_t[idx]."""
    check_ffn(x, W_gate, W_up, W_down_t, idx, act)
    acc = accumulation_dtype(x.dtype)
    rows = idx.long()
    xa = x.to(acc)
    h = apply_activation(xa @ W_gate[rows].to(acc).T, act) * (xa @ W_up[rows].to(acc).T)
    return (h @ W_down_t[rows].to(acc)).to(x.dtype)

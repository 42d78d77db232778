"""The sparse gated FFN in Triton: unfused (three kernels) and fused (one kernel).

For the active neurons A = idx of a gated FFN,

    h_j = act(W_gate[j] . x) * (W_up[j] . x)          j in A        (row-sparse, gate and up)
    y   = sum_{j in A} h_j W_down_t[j, :]                             (column-sparse, down)

which equals the dense FFN with the other neurons' activations set to zero. All three weight
matrices are stored [ffn, dim] with neuron j's weights contiguous: gate and up as
``nn.Linear.weight``, down as ``down_proj.weight.T`` (W_down_t). Neuron j is then three
contiguous rows, one per matrix (PowerInfer bundles them the same way).

* ``sparse_ffn_unfused``: gather_gemv for gate and up, the activation in torch, then
  scatter_gemv for down. The intermediate h makes a round trip through memory and the
  work takes several launches; at batch 1 each launch costs microseconds, a visible share of a
  small layer.
* ``sparse_ffn``: one kernel. Each program owns BLOCK_N active neurons: it computes their gate
  and up dot products over the model dim, forms h in registers, then multiplies h by the
  neurons' down rows and adds the [dim] partial result into y with an atomic add (programs
  own disjoint neurons but share all outputs). Accumulation is float32, in a float32 buffer,
  cast to x's dtype at the end. Atomic adds make the summation order vary between runs, so
  results agree with the reference to rounding, not bit for bit.

With a batch x [B, dim] all rows share idx (the union of their active neurons).

References: DejaVu (Liu et al., 2023) fuses the sparse MLP the same way; PowerInfer (Song et
al., 2023) bundles a neuron's gate, up and down weights.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .column_sparse import scatter_gemv
from .interpreter import check_launchable, launch
from .reference import ACTIVATIONS, apply_activation
from .row_sparse import gather_gemv
from .validate import check_ffn

__all__ = ["BLOCK_D", "BLOCK_N", "sparse_ffn", "sparse_ffn_unfused"]

# Tuned on an H200 (fp16 CUDA graph replays): 64 neurons per program quarter the atomic adds
# of 16 and were fastest among BLOCK_N 16/32/64 x BLOCK_D 64/128/256.
BLOCK_N = 64
BLOCK_D = 128


@triton.jit
def _activation(g, ACT: tl.constexpr):
    if ACT == 0:  # silu
        return g / (1.0 + tl.exp(-g))
    elif ACT == 1:  # relu
        return tl.maximum(g, 0.0)
    else:  # gelu, exact (erf) form
        return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))


@triton.jit
def _fused_ffn_kernel(
    x,
    W_gate,
    W_up,
    W_down_t,
    idx,
    y,
    n,
    D,
    stride_w,
    stride_xb,
    stride_yb,
    ACT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)  # which block of active neurons
    b = tl.program_id(1)  # which batch row
    js = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    jmask = js < n
    r = tl.load(idx + js, mask=jmask, other=0).to(tl.int64)
    # gate and up: row-sparse dot products over the model dim
    g_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    u_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        dmask = ds < D
        xv = tl.load(x + b * stride_xb + ds, mask=dmask, other=0.0).to(tl.float32)
        offs = r[:, None] * stride_w + ds[None, :]
        m2 = jmask[:, None] & dmask[None, :]
        g_acc += tl.load(W_gate + offs, mask=m2, other=0.0).to(tl.float32) * xv[None, :]
        u_acc += tl.load(W_up + offs, mask=m2, other=0.0).to(tl.float32) * xv[None, :]
    h = _activation(tl.sum(g_acc, axis=1), ACT) * tl.sum(u_acc, axis=1)
    h = tl.where(jmask, h, 0.0)
    # down: these neurons' rows of W_down_t, weighted by h, added into every output
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        dmask = ds < D
        w = tl.load(
            W_down_t + r[:, None] * stride_w + ds[None, :],
            mask=jmask[:, None] & dmask[None, :],
            other=0.0,
        ).to(tl.float32)
        part = tl.sum(w * h[:, None], axis=0)
        tl.atomic_add(y + b * stride_yb + ds, part, mask=dmask)


def sparse_ffn_unfused(
    x: Tensor, W_gate: Tensor, W_up: Tensor, W_down_t: Tensor, idx: Tensor, act: str = "silu"
) -> Tensor:
    """Sparse FFN from the two GEMV kernels: three launches, h through memory."""
    check_ffn(x, W_gate, W_up, W_down_t, idx, act)
    h_active = (
        apply_activation(gather_gemv(W_gate, x, idx).float(), act)
        * gather_gemv(W_up, x, idx).float()
    )
    h = torch.zeros(*x.shape[:-1], W_gate.shape[0], dtype=torch.float32, device=x.device)
    h[..., idx.long()] = h_active
    return scatter_gemv(W_down_t, h, idx=idx).to(x.dtype)


def sparse_ffn(
    x: Tensor, W_gate: Tensor, W_up: Tensor, W_down_t: Tensor, idx: Tensor, act: str = "silu"
) -> Tensor:
    """Fused sparse gated FFN over the neurons idx, one kernel launch.

    Math: y[b] = sum_{j in idx} act(W_gate[j] . x[b]) (W_up[j] . x[b]) W_down_t[j, :],
    float32 accumulation (atomic adds into a float32 buffer).
    Layout: W_gate, W_up [F, D] (``nn.Linear.weight``) and W_down_t [F, D]
    (``down_proj.weight.T.contiguous()``): neuron j is row j of each; x [D] or [B, D];
    idx [n] integer neurons in [0, F), any order (a repeated neuron is added once per entry);
    act in ("silu", "relu", "gelu").
    Returns [D] or [B, D] in x's dtype; an empty idx gives zeros.
    """
    check_ffn(x, W_gate, W_up, W_down_t, idx, act)
    check_launchable(x, W_gate, W_up, W_down_t, idx)
    W_gate, W_up, W_down_t = W_gate.contiguous(), W_up.contiguous(), W_down_t.contiguous()
    x2 = (x.reshape(1, -1) if x.dim() == 1 else x).contiguous()
    D = W_gate.shape[1]
    y = torch.zeros(x2.shape[0], D, dtype=torch.float32, device=x.device)
    n = idx.numel()
    if n and y.numel():
        grid = (triton.cdiv(n, BLOCK_N), x2.shape[0])
        launch(
            _fused_ffn_kernel,
            grid,
            x2,
            W_gate,
            W_up,
            W_down_t,
            idx.contiguous(),
            y,
            n,
            D,
            W_gate.stride(0),
            x2.stride(0),
            y.stride(0),
            ACT=ACTIVATIONS.index(act),
            BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D,
        )
    y = y.to(x.dtype)
    return y[0] if x.dim() == 1 else y

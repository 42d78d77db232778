"""Sparse GEMVs over int8 weights on the CPU: activation sparsity times weight quantization.

Chapter 07 reads only the active rows of float32 weights; chapter 09 reads every weight in 8
bits. Both save bytes of a memory-bound GEMV, and they multiply: a fraction s of the rows
skipped, each row a quarter of its float32 bytes, leaves (1 - s) / 4 of the dense float32 bytes.

The weights are chapter 09's int8 weight-only format (``minisparse.quant.layers.Int8Linear``):
codes q [out, in] int8 and one symmetric float32 scale per output channel, W[o, k] = s[o] q[o, k].
Two products, both accumulated in float32:

* row sparsity (gate and up, whose rows are the neurons):
      y[b, i] = s[idx[i]] * sum_k q[idx[i], k] x[b, k]
  the scale belongs to the row, so it multiplies the finished dot product;
* column sparsity (down, stored transposed as q_t [ffn, dim], neuron j's down weights
  contiguous, the layout of ``W_down_t``): down_proj's scale is per *output* channel c, so
      y[b, c] = sum_i h[b, i] s[c] q_t[idx[i], c] = s[c] * sum_i h[b, i] q_t[idx[i], c]
  and it factors out of the sum: one multiplication per output, after the scatter.

``sparse_ffn_i8`` runs the gated FFN over the neurons idx with both, fused in one C call:
y = s_down * sum_{j in idx} act(s_gate[j] q_gate[j] . x) (s_up[j] q_up[j] . x) q_down_t[j].

The loops (``cpu_int8.c``, beside this file) are those of the float32 fast path with the codes
widened to floats in registers; they are compiled on first use like it
(``cpu_build.load_source_library``) and take their thread count from
``torch.get_num_threads()``. Without a compiler, off the CPU, for
other activation dtypes, and for more than ``LOOP_MAX_BATCH`` tokens (a long prompt, where a
matrix product over the dequantized rows is faster: on the course's CPU the loops win up to
about 100 tokens), torch computes the same: the selected rows are dequantized, x̂ = s q, and
multiplied in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import Tensor

from ..deprecated import old_name
from .abi import ACT_CODES
from .cpu import _raise_for, _threads
from .cpu_build import load_source_library
from .reference import accumulation_dtype, apply_activation
from .validate import (
    check_activation,
    check_float32_cpu,
    check_indices,
    check_same_device,
    check_tensor,
    check_threshold,
    check_vector,
)

__all__ = [
    "LOOP_MAX_BATCH",
    "check_codes",
    "check_scale",
    "declare_int8_loops",
    "gather_gemv_i8",
    "gather_rows_dot_i8",
    "int8_fast_path_available",
    "int8_library",
    "scatter_gemv_i8",
    "scatter_rows_sum_i8",
    "sparse_ffn_i8",
]

LOOP_MAX_BATCH = 64  # more tokens than this: dequantized rows and a matrix product


def declare_int8_loops(lib: ctypes.CDLL) -> None:
    """Argument and result types of the C functions of ``cpu_int8.c``."""
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    gemv = [ptr, i64, i64, ptr, ptr, i64, i64, ptr, i64, ptr, c_int, c_int]
    for fn in (lib.gather_gemv_i8, lib.scatter_gemv_i8):
        fn.argtypes, fn.restype = gemv, c_int
    ffn = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, ptr, i64, ptr, i64, c_int, ptr, c_int, c_int]
    lib.sparse_ffn_i8.argtypes, lib.sparse_ffn_i8.restype = ffn, c_int


@functools.lru_cache(maxsize=1)
def int8_library() -> ctypes.CDLL | None:
    """The compiled int8 loops, or None without a C compiler (after the one warning)."""
    return load_source_library("kernels/cpu_int8.c", declare_int8_loops)


def int8_fast_path_available() -> bool:
    """True when the compiled int8 loops loaded."""
    return int8_library() is not None


# ---- checks ---------------------------------------------------------------------------------


def check_codes(name: str, q: Tensor) -> None:
    """q is a 2-D int8 tensor of codes."""
    check_tensor(name, q)
    if q.dim() != 2 or q.dtype != torch.int8:
        raise ValueError(
            f"{name} must be 2-D int8 codes [rows, cols], got {q.dtype} of shape "
            f"{tuple(q.shape)}; quantize with minisparse.quant.quantize_tensor(W, "
            "QuantSpec(bits=8))."
        )


def check_scale(name: str, scale: Tensor, size: int, what: str) -> None:
    """scale is a 1-D float tensor of ``size`` values (one per ``what``)."""
    check_tensor(name, scale)
    if scale.dim() != 1 or scale.numel() != size or not scale.is_floating_point():
        raise ValueError(
            f"{name} must be a 1-D float tensor of {size} scales (one per {what}), got "
            f"{scale.dtype} of shape {tuple(scale.shape)}; use scale.flatten().float()."
        )


def _check_rows(
    q: Tensor, scale: Tensor, x: Tensor, idx: Tensor, names: tuple[str, str] = ("q", "scale")
) -> None:
    check_codes(names[0], q)
    check_scale(names[1], scale, q.shape[0], "row")
    check_vector(x, q.shape[1], f"{names[0]}'s {q.shape[1]} columns")
    check_indices(idx, q.shape[0], "row")
    check_same_device(q, scale, x, idx)


def _check_columns(q_t: Tensor, scale: Tensor, v: Tensor, idx: Tensor) -> None:
    check_codes("q_t", q_t)
    check_scale("scale", scale, q_t.shape[1], "output column of q_t")
    check_tensor("idx", idx)
    check_vector(v, idx.numel(), "the entries of idx (one value per active row)", name="v")
    check_indices(idx, q_t.shape[0], "q_t row")
    check_same_device(q_t, scale, v, idx)


# ---- the C loops, and torch where they do not apply ------------------------------------------


def _as_batch(x: Tensor) -> Tensor:
    return (x.reshape(1, -1) if x.dim() == 1 else x).contiguous()


def _unbatch(y: Tensor, x: Tensor) -> Tensor:
    return y[0] if x.dim() == 1 else y


def _use_loops(x: Tensor, *weights: Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and _as_batch(x).shape[0] <= LOOP_MAX_BATCH
        and all(w.device.type == "cpu" for w in weights)
        and int8_library() is not None
    )


def _codes(q: Tensor) -> Tensor:
    """q itself when its rows are contiguous, else a contiguous copy."""
    return q if q.stride(1) == 1 else q.contiguous()


def _scales(scale: Tensor) -> Tensor:
    return scale.to(torch.float32).contiguous()


def _dequantized_rows(q: Tensor, scale: Tensor, rows: Tensor, dtype: torch.dtype) -> Tensor:
    """s[rows, None] * q[rows]: the float rows of the weight (gate, up)."""
    return q.index_select(0, rows).to(dtype) * scale.index_select(0, rows).to(dtype)[:, None]


def _gather(q: Tensor, scale: Tensor, x: Tensor, idx: Tensor, prefetch: bool) -> Tensor:
    """y [B, n] on checked float32 CPU inputs through the C loop."""
    lib = int8_library()
    q, scale, xb, idx = _codes(q), _scales(scale), _as_batch(x), idx.to(torch.int64).contiguous()
    y = torch.empty(xb.shape[0], idx.numel(), dtype=torch.float32)
    if idx.numel() and xb.shape[0]:
        status = lib.gather_gemv_i8(
            q.data_ptr(), q.shape[0], q.stride(0), scale.data_ptr(), xb.data_ptr(),
            xb.shape[0], xb.shape[1], idx.data_ptr(), idx.numel(), y.data_ptr(),
            int(prefetch), _threads(),
        )  # fmt: skip
        _raise_for(status, "the int8 row gather", 0)
    return y


def _scatter(q_t: Tensor, scale: Tensor, v: Tensor, idx: Tensor, prefetch: bool) -> Tensor:
    """y [B, N] on checked float32 CPU inputs through the C loop."""
    lib = int8_library()
    q_t, scale, vb = _codes(q_t), _scales(scale), _as_batch(v)
    idx = idx.to(torch.int64).contiguous()
    y = torch.zeros(vb.shape[0], q_t.shape[1], dtype=torch.float32)
    if idx.numel() and y.numel():
        status = lib.scatter_gemv_i8(
            q_t.data_ptr(), q_t.shape[0], q_t.stride(0), scale.data_ptr(), vb.data_ptr(),
            vb.shape[0], idx.numel(), idx.data_ptr(), q_t.shape[1], y.data_ptr(),
            int(prefetch), _threads(),
        )  # fmt: skip
        _raise_for(status, "the int8 row scatter", y.numel() * 4 * _threads())
    return y


def _require_loop(q: Tensor, name: str, fallback: str) -> None:
    if q.device.type != "cpu" or int8_library() is None:
        raise RuntimeError(
            f"{name} runs the compiled loop on CPU tensors, which is not available here; use "
            f"{fallback} (it falls back to torch)."
        )


def gather_rows_dot_i8(
    q: Tensor, scale: Tensor, x: Tensor, idx: Tensor, prefetch: bool = True
) -> Tensor:
    """y[b, i] = scale[idx[i]] * (q[idx[i]] . x[b]): the compiled int8 row-gather loop itself.

    q [N, K] int8 codes, scale [N] (one per row), x [K] or [B, K] float32 on the CPU, idx [n]
    rows in [0, N) (any order, repeats allowed); returns [B, n] float32. Needs the compiled
    library (``int8_fast_path_available()``); ``gather_gemv_i8`` works everywhere.
    """
    _check_rows(q, scale, x, idx)
    check_float32_cpu(x=x)
    _require_loop(q, "gather_rows_dot_i8", "gather_gemv_i8")
    return _gather(q, scale, x, idx, prefetch)


def scatter_rows_sum_i8(
    q_t: Tensor, scale: Tensor, v: Tensor, idx: Tensor, prefetch: bool = True
) -> Tensor:
    """y[b, c] = scale[c] * sum_i v[b, i] q_t[idx[i], c]: the compiled int8 row-scatter loop.

    q_t [K, N] int8 codes (W transposed), scale [N] (one per output column), v [n] or [B, n]
    float32 (one value per entry of idx), idx [n] rows in [0, K); returns [B, N] float32.
    Needs the compiled library; ``scatter_gemv_i8`` works everywhere.
    """
    _check_columns(q_t, scale, v, idx)
    check_float32_cpu(v=v)
    _require_loop(q_t, "scatter_rows_sum_i8", "scatter_gemv_i8")
    return _scatter(q_t, scale, v, idx, prefetch)


def gather_gemv_i8(q: Tensor, scale: Tensor, x: Tensor, idx: Tensor) -> Tensor:
    """Row-sparse GEMV over int8 rows: y = x @ (scale[idx, None] * q[idx]).T, [n] or [B, n].

    The C loop for float32 CPU inputs of at most ``LOOP_MAX_BATCH`` tokens, torch otherwise.
    """
    _check_rows(q, scale, x, idx)
    if _use_loops(x, q, scale):
        return _unbatch(_gather(q, scale, x, idx, True), x)
    acc = accumulation_dtype(x.dtype)
    w = _dequantized_rows(q, scale, idx.long(), acc)
    return (x.to(acc) @ w.T).to(x.dtype)


def scatter_gemv_i8(
    q_t: Tensor,
    scale: Tensor,
    x: Tensor,
    threshold: float | None = None,
    idx: Tensor | None = None,
) -> Tensor:
    """Column-sparse GEMV over int8 rows of W transposed: y = scale * ((x * mask) @ q_t).

    q_t [K, N] int8 codes, scale [N] (one per output column), x [K] or [B, K]; exactly one of
    threshold (|x| > threshold, each row its own channels) / idx (the active channels).
    """
    check_codes("q_t", q_t)
    check_scale("scale", scale, q_t.shape[1], "output column of q_t")
    check_vector(x, q_t.shape[0], f"q_t's {q_t.shape[0]} rows (q_t is W transposed, [in, out])")
    check_threshold(threshold, idx)
    xb = _as_batch(x)
    if idx is not None:
        check_indices(idx, q_t.shape[0], "input channel")
        check_same_device(q_t, scale, x, idx)
        idx = idx.to(device=x.device, dtype=torch.int64)
        values = xb[:, idx]
    else:
        check_same_device(q_t, scale, x)
        keep = xb.abs() > threshold
        idx = keep.any(0).nonzero().flatten()
        values = torch.where(keep, xb, torch.zeros_like(xb))[:, idx]
    if _use_loops(x, q_t, scale):
        return _unbatch(_scatter(q_t, scale, values, idx, True), x)
    acc = accumulation_dtype(x.dtype)
    y = (values.to(acc) @ q_t.index_select(0, idx).to(acc)) * scale.to(acc)
    return _unbatch(y.to(x.dtype), x)


def sparse_ffn_i8(
    x: Tensor,
    q_gate: Tensor,
    s_gate: Tensor,
    q_up: Tensor,
    s_up: Tensor,
    q_down_t: Tensor,
    s_down: Tensor,
    idx: Tensor,
    act: str = "silu",
) -> Tensor:
    """Sparse gated FFN over int8 weights and the neurons idx, fused in one C call.

    y = s_down * sum_{j in idx} act(s_gate[j] q_gate[j] . x) (s_up[j] q_up[j] . x) q_down_t[j]

    q_gate, q_up [ffn, dim] with per-neuron scales s_gate, s_up [ffn]; q_down_t [ffn, dim]
    (down_proj's codes transposed) with down_proj's per-output scales s_down [dim]; x [dim] or
    [B, dim]. Returns [dim] or [B, dim].
    """
    check_codes("q_gate", q_gate)
    check_scale("s_gate", s_gate, q_gate.shape[0], "neuron")
    _check_rows(q_up, s_up, x, idx, names=("q_up", "s_up"))
    check_codes("q_down_t", q_down_t)
    if not q_gate.shape == q_up.shape == q_down_t.shape:
        raise ValueError(
            "q_gate, q_up and q_down_t must all be [ffn, dim] (q_down_t is down_proj's codes "
            f"transposed), got {tuple(q_gate.shape)}, {tuple(q_up.shape)}, "
            f"{tuple(q_down_t.shape)}."
        )
    check_scale("s_down", s_down, q_down_t.shape[1], "output channel of down_proj")
    check_activation(act)
    check_same_device(x, q_gate, s_gate, q_up, s_up, q_down_t, s_down, idx)
    if not _use_loops(x, q_gate, q_up, q_down_t):
        acc = accumulation_dtype(x.dtype)
        rows, xa = idx.long(), _as_batch(x).to(acc)
        gate = xa @ _dequantized_rows(q_gate, s_gate, rows, acc).T
        h = apply_activation(gate, act) * (xa @ _dequantized_rows(q_up, s_up, rows, acc).T)
        y = (h @ q_down_t.index_select(0, rows).to(acc)) * s_down.to(acc)
        return _unbatch(y.to(x.dtype), x)
    lib = int8_library()
    xb, idx = _as_batch(x), idx.to(torch.int64).contiguous()
    q_gate, q_up, q_down_t = (q_gate.contiguous(), q_up.contiguous(), q_down_t.contiguous())
    scales = [_scales(s) for s in (s_gate, s_up, s_down)]
    ffn, dim = q_gate.shape
    y = torch.zeros(xb.shape[0], dim, dtype=torch.float32)
    if idx.numel() and y.numel():
        status = lib.sparse_ffn_i8(
            q_gate.data_ptr(), scales[0].data_ptr(), q_up.data_ptr(), scales[1].data_ptr(),
            q_down_t.data_ptr(), scales[2].data_ptr(), ffn, dim, xb.data_ptr(), xb.shape[0],
            idx.data_ptr(), idx.numel(), ACT_CODES[act], y.data_ptr(), 1, _threads(),
        )  # fmt: skip
        _raise_for(status, "the int8 sparse FFN", y.numel() * 4 * _threads())
    return _unbatch(y, x)


def __getattr__(name: str) -> Any:
    """Old names of this module, for one release (``minisparse.deprecated``)."""
    return old_name(__name__, name)

"""The CPU fast path: sparse GEMVs that run at the memory-bandwidth limit on a CPU.

Same three functions, same signatures and results as the Triton kernels (``gather_gemv``,
``scatter_gemv``, ``sparse_ffn``). At batch 1 a GEMV streams its weights once, so a
kernel that skips a fraction s of them can at best take (1 - s) of the dense time. Getting
there on a CPU takes three things, each one measured in the chapter's benchmark:

1. **No copy.** ``W.index_select(0, idx) @ x`` first copies the active rows to a new tensor
   (read n K, write n K, read n K again): several times slower than the fused loop below, and
   often slower than dense.
2. **Software prefetch.** A gathered row is a short, isolated burst that the hardware
   prefetcher cannot follow from one active row to the next; the loop asks for row i + 1 while
   it multiplies row i, so the next burst is already in flight.
3. **Huge pages.** Random rows touch a new 4 KiB page every 4 KiB, and each page costs a TLB
   miss and a page walk that a dense stream amortises. Weights placed in 2 MiB transparent
   huge pages (``hugepage_copy``; Linux, ``madvise(MADV_HUGEPAGE)``) remove most of them.

The loops are a few lines of C (``cpu.c`` beside this file: the prefetch, and the
column-sparse loop's sums in groups of eight), compiled on first use with the system C compiler
into minisparse's cache and loaded with ctypes (``minisparse.kernels.cpu_build``; its names can
be imported from here too). The parallel loops take their thread count from
``torch.get_num_threads()`` at every call, so ``torch.set_num_threads`` (and the CLI's
``--threads``) apply to them too. Without a compiler every function still works, through torch
(``index_select`` + matmul), and says once how to get the fast path. The fast loops take
float32; other dtypes use the torch path.

Every public function checks its arguments first (``validate``); the C loops check the indices
again before they read a weight and report allocation failures, so no input can make them read
or write outside the tensors (``ValueError`` or ``MemoryError`` instead).

Layouts are those of the Triton kernels: ``W`` [N, K] row-major for row sparsity, ``W_t`` [K, N]
(W transposed, contiguous) for column sparsity, so the sparse dimension is always the outer one.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..deprecated import old_name
from .abi import BAD_INDEX, NO_MEMORY
from .cpu_build import (
    BASE_FLAGS,
    FLAG_LADDER,
    Compiler,
    cache_dir,
    cpu_identity,
    find_compiler,
    library_key,
    load_library,
    load_source_library,
    resolve_compiler,
)
from .reference import apply_activation, gather_gemv_ref
from .validate import (
    check_ffn,
    check_float32_cpu,
    check_gather,
    check_indices,
    check_matrix,
    check_same_device,
    check_scatter,
    check_tensor,
    check_threshold,
    check_vector,
)

HUGE_PAGE = 2 * 2**20
MADV_HUGEPAGE = 14

C_SOURCE = (Path(__file__).parent / "cpu.c").read_text()  # the loops, as written


def fast_path_available() -> bool:
    """True when the compiled kernels loaded."""
    return load_library() is not None


def fast_path_threads() -> int:
    """Threads the compiled loops use for a large call now: ``torch.get_num_threads()`` when
    they were built with OpenMP, else 1; 0 without the compiled library."""
    lib = load_library()
    return 0 if lib is None else lib.team_size(_threads())


def _threads() -> int:
    """The thread count torch uses now (``torch.set_num_threads``, the CLI's ``--threads``)."""
    return max(1, torch.get_num_threads())


def _raise_for(status: int, what: str, nbytes: int) -> None:
    """Turn a C return code into the Python exception it stands for."""
    if status == BAD_INDEX:
        raise ValueError(f"idx holds values outside the rows of {what}; drop them.")
    if status == NO_MEMORY:
        raise MemoryError(
            f"minisparse's {what} loop could not allocate {nbytes} bytes of per-thread sums; "
            "free memory or use fewer threads (torch.set_num_threads)."
        )
    if status:
        raise RuntimeError(f"minisparse's C loop failed with code {status}.")


def hugepage_copy(t: Tensor) -> Tensor:
    """A contiguous copy of t whose memory is 2 MiB aligned and advised as huge pages.

    On Linux with transparent huge pages in ``madvise`` or ``always`` mode the kernel backs the
    copy with 2 MiB pages, so a random row gather costs far fewer TLB misses. Elsewhere it is a
    plain aligned copy, which is harmless.
    """
    check_tensor("t", t)
    if t.device.type != "cpu":
        return t.contiguous()
    nbytes = t.numel() * t.element_size()
    pad = HUGE_PAGE // t.element_size()
    buf = torch.empty(t.numel() + pad, dtype=t.dtype)
    offset = (-buf.data_ptr() % HUGE_PAGE) // t.element_size()
    out = buf[offset : offset + t.numel()].view(t.shape)
    if sys.platform.startswith("linux") and nbytes >= HUGE_PAGE:
        libc = ctypes.CDLL(None, use_errno=True)
        length = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
        length = min(length, (buf.numel() - offset) * t.element_size() // HUGE_PAGE * HUGE_PAGE)
        libc.madvise(ctypes.c_void_p(out.data_ptr()), ctypes.c_size_t(length), MADV_HUGEPAGE)
    out.copy_(t)
    return out


def _use_fast(*tensors: Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and (
        load_library() is not None
    )


def _as_batch(x: Tensor) -> Tensor:
    return (x.reshape(1, -1) if x.dim() == 1 else x).contiguous()


def _row_major(W: Tensor) -> Tensor:
    """W itself when its rows are contiguous (any row stride), else a contiguous copy."""
    return W if W.stride(1) == 1 else W.contiguous()


def _gather(W: Tensor, x: Tensor, idx: Tensor, prefetch: bool) -> Tensor:
    """gather_rows_dot on checked float32 CPU inputs: the C loop, or torch without it."""
    lib = load_library()
    W, xb, idx = _row_major(W), _as_batch(x), idx.to(torch.int64).contiguous()
    if lib is None:
        return xb @ W.index_select(0, idx).T
    y = torch.empty(xb.shape[0], idx.numel(), dtype=torch.float32)
    if idx.numel() and xb.shape[0]:
        status = lib.gather_gemv_f32(
            W.data_ptr(),
            W.shape[0],
            W.stride(0),
            xb.data_ptr(),
            xb.shape[0],
            xb.shape[1],
            idx.data_ptr(),
            idx.numel(),
            y.data_ptr(),
            int(prefetch),
            _threads(),
        )
        _raise_for(status, "the row gather", 0)
    return y


def _scatter(W_t: Tensor, v: Tensor, idx: Tensor, prefetch: bool) -> Tensor:
    """scatter_rows_sum on checked float32 CPU inputs: the C loop, or torch without it."""
    lib = load_library()
    W_t, vb, idx = _row_major(W_t), _as_batch(v), idx.to(torch.int64).contiguous()
    if lib is None:
        return vb @ W_t.index_select(0, idx)
    y = torch.zeros(vb.shape[0], W_t.shape[1], dtype=torch.float32)
    if idx.numel() and y.numel():
        status = lib.scatter_gemv_f32(
            W_t.data_ptr(),
            W_t.shape[0],
            W_t.stride(0),
            vb.data_ptr(),
            vb.shape[0],
            idx.numel(),
            idx.data_ptr(),
            W_t.shape[1],
            y.data_ptr(),
            int(prefetch),
            _threads(),
        )
        _raise_for(status, "the row scatter", y.numel() * 4 * _threads())
    return y


def gather_rows_dot(W: Tensor, x: Tensor, idx: Tensor, prefetch: bool = True) -> Tensor:
    """y[b, i] = W[idx[i]] . x[b]: the compiled row-gather loop itself (chapter 07 times it).

    W [N, K] and x [K] or [B, K] float32 on the CPU, idx [n] integer rows in [0, N) (any order,
    repeats allowed); returns [B, n] float32 (B = 1 for a vector x). ``prefetch`` switches the
    software prefetch of the next row. Without the compiled library, torch computes the same.
    """
    check_gather(W, x, idx)
    check_float32_cpu(W=W, x=x)
    return _gather(W, x, idx, prefetch)


def scatter_rows_sum(W_t: Tensor, v: Tensor, idx: Tensor, prefetch: bool = True) -> Tensor:
    """y[b] = sum_i v[b, i] W_t[idx[i]]: the compiled row-scatter loop itself.

    W_t [K, N] float32 on the CPU, v [n] or [B, n] float32 (one value per entry of idx), idx [n]
    integer rows in [0, K) (any order; a repeated row is added once per entry); returns [B, N].
    """
    check_matrix("W_t", W_t)
    check_tensor("idx", idx)
    check_vector(v, idx.numel(), "the entries of idx (one value per active row)", name="v")
    check_indices(idx, W_t.shape[0], "W_t row")
    check_same_device(W_t, v, idx)
    check_float32_cpu(W_t=W_t, v=v)
    return _scatter(W_t, v, idx, prefetch)


@functools.lru_cache(maxsize=64)
def _all_rows(n: int) -> Tensor:
    return torch.arange(n, dtype=torch.int64)


def dense_gemv(W_t: Tensor, x: Tensor) -> Tensor:
    """Dense GEMV y = x @ W_t with the streaming loop: the column-sparse kernel at s = 0.

    W_t [K, N] (W transposed, contiguous), x [K] or [B, K], float32 on the CPU; returns [N] or
    [B, N]. The loop reads W_t's rows in memory order with software prefetch, which on the
    course's CPU streams weights faster than the BLAS GEMV does at batch 1 (chapter 07
    measures both); ``minisparse.core.model.Linear`` uses it for single-token decoding. Without the
    compiled library (``fast_path_available()``) torch computes the same.
    """
    check_matrix("W_t", W_t)
    check_vector(x, W_t.shape[0], f"W_t's {W_t.shape[0]} rows (W_t is W transposed, [in, out])")
    check_float32_cpu(W_t=W_t, x=x)
    return _unbatch(_scatter(W_t, x, _all_rows(W_t.shape[0]), True), x)


def _unbatch(y: Tensor, x: Tensor) -> Tensor:
    return y[0] if x.dim() == 1 else y


def gather_gemv(W: Tensor, x: Tensor, idx: Tensor) -> Tensor:
    """Row-sparse GEMV on the CPU: y = x @ W[idx].T, shape [n] or [B, n].

    W [N, K] row-major, x [K] or [B, K], idx [n] integer rows (the union for a batch; any
    order, repeats allowed).
    """
    check_gather(W, x, idx)
    if not _use_fast(W, x):
        return gather_gemv_ref(W, x, idx)
    return _unbatch(_gather(W, x, idx, True), x)


def active_inputs(
    x: Tensor, threshold: float | None = None, idx: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The active channel indices (the union over a batch) and x's values there, [B, n].

    With a threshold a row's entries with |x| <= threshold are zeroed (NaN counts as inactive),
    so each row keeps only its own channels even though the union is read.
    """
    check_tensor("x", x)
    check_threshold(threshold, idx)
    xb = _as_batch(x)
    if idx is not None:
        check_indices(idx, xb.shape[-1], "input channel")
        idx = idx.to(device=xb.device, dtype=torch.int64)
        return idx, xb[:, idx]
    keep = xb.abs() > threshold
    idx = keep.any(0).nonzero().flatten()
    return idx, torch.where(keep, xb, torch.zeros_like(xb))[:, idx]


def scatter_gemv(
    W_t: Tensor, x: Tensor, threshold: float | None = None, idx: Tensor | None = None
) -> Tensor:
    """Column-sparse GEMV on the CPU: y = (x * mask) @ W_t, reading only the active rows of W_t.

    W_t [K, N] (W transposed, contiguous), x [K] or [B, K]; exactly one of threshold / idx.
    """
    check_scatter(W_t, x, threshold, idx)
    active, values = active_inputs(x, threshold, idx)
    if _use_fast(W_t, x):
        y = _scatter(W_t, values, active, True)
    else:
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = (values.to(acc) @ W_t.index_select(0, active).to(acc)).to(x.dtype)
    return _unbatch(y, x)


def sparse_ffn(
    x: Tensor, W_gate: Tensor, W_up: Tensor, W_down_t: Tensor, idx: Tensor, act: str = "silu"
) -> Tensor:
    """Sparse gated FFN on the CPU over the neurons idx.

    y = sum_{j in idx} act(W_gate[j] . x) (W_up[j] . x) W_down_t[j, :]: two row gathers, the
    activation on the n active values, one row scatter. Layouts as in ``minisparse.kernels``.
    """
    check_ffn(x, W_gate, W_up, W_down_t, idx, act)
    if not _use_fast(x, W_gate, W_up, W_down_t):
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        rows = idx.long()
        xa = _as_batch(x).to(acc)
        h = apply_activation(xa @ W_gate[rows].to(acc).T, act) * (xa @ W_up[rows].to(acc).T)
        return _unbatch((h @ W_down_t[rows].to(acc)).to(x.dtype), x)
    h = apply_activation(_gather(W_gate, x, idx, True), act) * _gather(W_up, x, idx, True)
    return _unbatch(_scatter(W_down_t, h, idx, True), x)


__all__ = [
    "BAD_INDEX",
    "BASE_FLAGS",
    "C_SOURCE",
    "FLAG_LADDER",
    "HUGE_PAGE",
    "MADV_HUGEPAGE",
    "NO_MEMORY",
    "Compiler",
    "active_inputs",
    "cache_dir",
    "cpu_identity",
    "dense_gemv",
    "fast_path_available",
    "fast_path_threads",
    "find_compiler",
    "gather_gemv",
    "gather_rows_dot",
    "hugepage_copy",
    "library_key",
    "load_library",
    "load_source_library",
    "resolve_compiler",
    "scatter_gemv",
    "scatter_rows_sum",
    "sparse_ffn",
]


def __getattr__(name: str) -> Any:
    """Old names of this module, for one release (``minisparse.deprecated``)."""
    return old_name(__name__, name)

"""Triton sparse kernels and their torch references (installed as ``minisparse.kernels``).

* ``gather_gemv(W, x, idx)``: row-sparse GEMV, only the rows idx of W (gate, up).
* ``scatter_gemv(W_t, x, threshold=None, idx=None)``: column-sparse GEMV on W stored
  transposed, active inputs from an in-kernel threshold (TEAL) or an index list (down).
* ``sparse_ffn(x, W_gate, W_up, W_down_t, idx, act)``: the fused sparse gated FFN.

The same three functions exist in ``minisparse.kernels.cpu`` (a C fast path for CPUs) and as
definitions in ``minisparse.kernels.reference``; ``minisparse.kernels.cpu_int8`` has them over
int8 weights (chapter 09's codes and per-channel scales) on the CPU.

Importing this package imports neither triton nor changes any setting of the process: the
Triton kernel modules (``row_sparse``, ``column_sparse``, ``fused_ffn``) are imported on the
first call of a kernel (or first access to the module). Given CPU tensors, a kernel runs in the
Triton interpreter for that launch only (``interpreter.launch``), so the kernels run (slowly,
exactly) on a CPU without ``TRITON_INTERPRET`` being set for the whole process.
``INTERPRETING`` says whether that is the default here (no CUDA device, or the user's
``TRITON_INTERPRET=1``); ``HAVE_TRITON`` whether triton is installed.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from torch import Tensor

from ..deprecated import old_name
from .interpreter import interpreting, triton_available
from .reference import gather_gemv_ref, scatter_gemv_ref, sparse_ffn_ref

TRITON_MODULES = ("row_sparse", "column_sparse", "fused_ffn")


def triton_module(name: str) -> ModuleType:
    """One of the Triton kernel modules, imported on first use (a clear error without triton)."""
    if not triton_available():
        raise ImportError(
            "The Triton kernels need the triton package (Linux: pip install triton); on this "
            "machine use the CPU fast path in minisparse.kernels.cpu, which has the same functions."
        )
    return importlib.import_module(f"{__name__}.{name}")


def gather_gemv(W: Tensor, x: Tensor, idx: Tensor) -> Tensor:
    """Row-sparse GEMV in Triton, y = x @ W[idx].T (``row_sparse.gather_gemv``)."""
    return triton_module("row_sparse").gather_gemv(W, x, idx)


def gather_gemv_naive(W: Tensor, x: Tensor, idx: Tensor) -> Tensor:
    """Row-sparse GEMV, one program per row (``row_sparse.gather_gemv_naive``)."""
    return triton_module("row_sparse").gather_gemv_naive(W, x, idx)


def scatter_gemv(
    W_t: Tensor, x: Tensor, threshold: float | None = None, idx: Tensor | None = None
) -> Tensor:
    """Column-sparse GEMV in Triton, y = (x * mask) @ W_t (``column_sparse.scatter_gemv``)."""
    return triton_module("column_sparse").scatter_gemv(W_t, x, threshold=threshold, idx=idx)


def sparse_ffn(
    x: Tensor, W_gate: Tensor, W_up: Tensor, W_down_t: Tensor, idx: Tensor, act: str = "silu"
) -> Tensor:
    """Fused sparse gated FFN in Triton over the neurons idx (``fused_ffn.sparse_ffn``)."""
    return triton_module("fused_ffn").sparse_ffn(x, W_gate, W_up, W_down_t, idx, act)


def sparse_ffn_unfused(
    x: Tensor, W_gate: Tensor, W_up: Tensor, W_down_t: Tensor, idx: Tensor, act: str = "silu"
) -> Tensor:
    """Sparse gated FFN from the two GEMV kernels (``fused_ffn.sparse_ffn_unfused``)."""
    return triton_module("fused_ffn").sparse_ffn_unfused(x, W_gate, W_up, W_down_t, idx, act)


def __getattr__(name: str) -> Any:
    """``INTERPRETING`` and ``HAVE_TRITON`` read now; the kernel modules imported on access."""
    if name == "INTERPRETING":
        return interpreting()
    if name == "HAVE_TRITON":
        return triton_available()
    if name in TRITON_MODULES:
        return triton_module(name)
    return old_name(__name__, name)  # an old name, for one release (minisparse.deprecated)


__all__ = [
    "HAVE_TRITON",
    "INTERPRETING",
    "gather_gemv",
    "gather_gemv_naive",
    "gather_gemv_ref",
    "interpreting",
    "scatter_gemv",
    "scatter_gemv_ref",
    "sparse_ffn",
    "sparse_ffn_ref",
    "sparse_ffn_unfused",
]

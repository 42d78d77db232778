"""Triton sparse kernels and their torch references (installed as ``minisparse.kernels``).

* ``gather_gemv(W, x, idx)``: row-sparse GEMV, only the rows idx of W (gate, up).
* ``sparse_input_gemv(W_t, x, threshold=None, idx=None)``: column-sparse GEMV on W stored
  transposed, active inputs from an in-kernel threshold (TEAL) or an index list (down).
* ``sparse_ffn(x, W_gate, W_up, W_down_t, idx, act)``: the fused sparse gated FFN.

The same three functions exist in ``minisparse.kernels.cpu`` (a C fast path for CPUs) and as
definitions in ``minisparse.kernels.reference``. Without a CUDA device the Triton interpreter is
switched on here, before any kernel is defined, so the kernels run (slowly, exactly) on CPU
tensors.
"""

# The interpreter module comes first: it sets TRITON_INTERPRET before any kernel is defined.
# isort: off
from .interpreter import INTERPRETING, interpreting
from .reference import gather_gemv_ref, sparse_ffn_ref, sparse_input_gemv_ref

try:
    import triton  # noqa: F401  (Linux only; the CPU path and the references need no Triton)
except ImportError:
    HAVE_TRITON = False
else:
    HAVE_TRITON = True

if HAVE_TRITON:
    from .column_sparse import sparse_input_gemv
    from .fused_ffn import sparse_ffn, sparse_ffn_unfused
    from .row_sparse import gather_gemv, gather_gemv_naive
else:

    def _needs_triton(*args: object, **kwargs: object) -> None:
        raise ImportError(
            "The Triton kernels need the triton package (Linux: pip install triton); on this "
            "machine use the CPU fast path in minisparse.kernels.cpu, which has the same functions."
        )

    sparse_input_gemv = sparse_ffn = sparse_ffn_unfused = _needs_triton
    gather_gemv = gather_gemv_naive = _needs_triton
# isort: on

__all__ = [
    "HAVE_TRITON",
    "INTERPRETING",
    "gather_gemv",
    "gather_gemv_naive",
    "gather_gemv_ref",
    "interpreting",
    "sparse_ffn",
    "sparse_ffn_ref",
    "sparse_ffn_unfused",
    "sparse_input_gemv",
    "sparse_input_gemv_ref",
]

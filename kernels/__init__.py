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
from .column_sparse import sparse_input_gemv
from .fused_ffn import sparse_ffn, sparse_ffn_unfused
from .reference import gather_gemv_ref, sparse_ffn_ref, sparse_input_gemv_ref
from .row_sparse import gather_gemv, gather_gemv_naive
# isort: on

__all__ = [
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

"""The compiled decode step: ``step.c`` beside this file, built once per machine and declared.

``decode_library`` compiles ``step.c`` the way every C file of the package is compiled
(``minisparse.kernels.cpu_build``: the machine's chosen instruction set, a cache key over the
source, its headers and the compiler) and tells ctypes the argument and result types of its
functions; ``minisparse.runtime.Decoder`` calls them with the structs of
``minisparse.kernels.abi``.
"""

from __future__ import annotations

import ctypes
import functools

from ..kernels.abi import Mat
from ..kernels.cpu_build import load_source_library

__all__ = ["SOURCE", "declare_step_library", "decode_library"]

SOURCE = "runtime/step.c"  # the C file, relative to the package


def declare_step_library(lib: ctypes.CDLL) -> None:
    """Argument and result types of ``step.c``'s functions (ctypes trusts them)."""
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.attn_scratch.argtypes, lib.attn_scratch.restype = [i64] * 5 + [c_int], i64
    lib.mlp_scratch.argtypes, lib.mlp_scratch.restype = [i64, i64, c_int], i64
    lib.sparse_mlp_scratch.argtypes = [i64, i64, i64, c_int]
    lib.sparse_mlp_scratch.restype = i64
    lib.attn_step.argtypes, lib.attn_step.restype = [p, p, i64, i64, p, c_int], c_int
    lib.mlp_step.argtypes, lib.mlp_step.restype = [p, p, i64, p, c_int], c_int
    lib.sparse_mlp_step.argtypes, lib.sparse_mlp_step.restype = [p, p, i64, p, c_int], i64
    lib.lm_head_step.argtypes = [p, i64, p, ctypes.c_float, ctypes.POINTER(Mat), i64, i64, p, p]
    lib.lm_head_step.argtypes.append(c_int)
    lib.lm_head_step.restype = c_int


@functools.lru_cache(maxsize=1)
def decode_library() -> ctypes.CDLL | None:
    """The compiled decode step, or None without a C compiler (one warning, from ``cpu``)."""
    return load_source_library(SOURCE, declare_step_library)

"""The interface between the C files and Python, declared once: constants and structs.

``abi.h`` holds the C side. Every C library of the package includes it and exports
``abi_layout``, which reports, as its compiler sees them, the size of each struct and the
offset of each of its fields, then the constants; ``layout`` below lists the same numbers as
ctypes computes them, and ``tests/test_kernels_setup.py`` checks that the two agree. A field
added on one side only fails that test instead of reading the wrong bytes.

The structs are what the compiled decode step reads (``minisparse.runtime``): a matrix is a
pointer with its element type (float32; int8 codes with float32 scales; 4-bit blocks of 32
weights with their own scale and zero; or 2:4 kept values with their packed positions), an
activation slot is a ReLU flag and a threshold, and a block half is the pointers of its norm,
projections and biases.
"""

from __future__ import annotations

import ctypes

__all__ = [
    "ACT_CODES",
    "BAD_INDEX",
    "FORMAT_CODES",
    "GROUP",
    "MAX_TOKENS",
    "NO_MEMORY",
    "OK",
    "STRUCTS",
    "AttnLayer",
    "Mat",
    "MlpLayer",
    "Slot",
    "SparseMlpLayer",
    "c_layout",
    "layout",
]

MAX_TOKENS = 8  # the most tokens one decode call takes (a verification pass, gamma + 1)
GROUP = 8  # rows summed in registers before they are added to the output
OK, BAD_INDEX, NO_MEMORY = 0, 1, 2  # return codes of the sparse loops
ACT_CODES = {"silu": 0, "relu": 1, "gelu": 2}  # MLP activations
#: Mat.format: one code per way a matrix stores its rows (abi.h's FMT_*, in that order): float32,
#: int8 codes with row scales, 4-bit blocks times float32 activations ("q4") or times
#: activations rounded to int8 per 32 ("q4_a8"), 2:4 sparse rows of float32 or int8 values.
FORMAT_CODES = {"f32": 0, "i8": 1, "q4": 2, "q4_a8": 3, "nm_f32": 4, "nm_i8": 5}

_i64, _i32, _flt, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p


class Mat(ctypes.Structure):
    """A weight matrix for C in the format ``format`` (``FORMAT_CODES``): float32 data (scale
    NULL), int8 codes and float32 row scales, an ``Int4Linear``'s 4-bit blocks (``q4``, or
    ``q4_a8`` to round the activations to int8 per 32); ``in_stride`` > 0: a float32
    transpose, one row per input, rows ``in_stride`` floats apart (bundled with the other
    projections of the same input), read only at non-zero inputs. The 2:4 formats
    (``NMLinear``): ``data`` the kept values [out, in / 2] (float32, or int8 codes with
    ``scale``), ``nm_pos`` their 2-bit positions, 4 to a byte [out, ceil(in / 8)]."""

    _fields_ = [
        ("data", _ptr),
        ("scale", _ptr),
        ("in_stride", _i64),
        ("format", _i64),
        ("nm_pos", _ptr),
    ]


class Slot(ctypes.Structure):
    """What a projection's input goes through: a ReLU (``relu`` = 1) and/or a magnitude
    threshold (|v| <= threshold -> 0; negative: none)."""

    _fields_ = [("relu", _i32), ("threshold", _flt)]


class AttnLayer(ctypes.Structure):
    _fields_ = [
        *[(n, _i64) for n in ("dim", "n_heads", "n_kv_heads", "head_dim", "max_seq")],
        ("eps", _flt),
        ("rope_scale", _flt),
        *[(n, _ptr) for n in ("norm", "inv_freq")],
        *[(n, Mat) for n in ("wq", "wk", "wv", "wo")],
        *[(n, _ptr) for n in ("bq", "bk", "bv", "bo", "k_cache", "v_cache")],
        ("input", Slot),
    ]


class MlpLayer(ctypes.Structure):
    _fields_ = [
        ("dim", _i64),
        ("ffn", _i64),
        ("eps", _flt),
        ("norm", _ptr),
        *[(n, Mat) for n in ("wg", "wu", "wd")],
        *[(n, _ptr) for n in ("bg", "bu", "bd")],
        ("act", _i32),
        ("act_threshold", _flt),
        ("input", Slot),
        ("down_in", Slot),
    ]


class SparseMlpLayer(ctypes.Structure):
    _fields_ = [
        ("dim", _i64),
        ("ffn", _i64),
        ("rank", _i64),
        ("eps", _flt),
        ("norm", _ptr),
        *[(n, Mat) for n in ("wg", "wu", "wd_t")],  # wd_t's int8 scales: one per output
        ("act", _i32),
        ("input", Slot),
        ("threshold", _flt),
        *[(n, _ptr) for n in ("pu", "pu_bias", "pv", "pv_bias")],
        ("predictor_relu", _i32),
        ("cutoff", _flt),
    ]


STRUCTS = (Mat, Slot, AttnLayer, MlpLayer, SparseMlpLayer)


def layout() -> list[int]:
    """What ``abi_layout`` must report: per struct its size and its fields' offsets, then the
    constants, as ctypes lays them out."""
    numbers: list[int] = []
    for struct in STRUCTS:
        numbers.append(ctypes.sizeof(struct))
        numbers += [getattr(struct, name).offset for name, _ in struct._fields_]
    numbers += [MAX_TOKENS, GROUP, OK, BAD_INDEX, NO_MEMORY, *ACT_CODES.values()]
    numbers += list(FORMAT_CODES.values())
    return numbers


def c_layout(lib: ctypes.CDLL) -> list[int]:
    """The same numbers as the compiled library ``lib`` reports them."""
    fn = lib.abi_layout
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int64
    buf = (ctypes.c_int64 * 256)()
    count = fn(buf, 256)
    return list(buf[: min(count, 256)])

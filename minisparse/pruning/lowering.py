"""How the compiled decode step runs an ``NMLinear``: its C lowering (2:4 only).

Registered by exact type with ``minisparse.runtime.lowering``: a 2:4 ``NMLinear`` becomes a
``Mat`` whose ``data`` points at its kept values [out, in / 2] (float32, or int8 codes with the
float32 row scales in ``scale``) and ``nm_pos`` at its packed positions [out, ⌈in / 8⌉], 2 bits
a value. The C step (``minisparse/kernels/matvec.h``) expands each group's 2 kept values into
its 4 input lanes in registers, for one token and for up to ``MAX_TOKENS`` tokens, so a step
reads about half the bytes of the dense layer. Other patterns (4:8, ...), other devices and
non-contiguous buffers stay in torch (``to_mat`` returns None and the half runs as torch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels.abi import FORMAT_CODES, Mat
from ..runtime.lowering import lowers, plain_f32
from .nm_linear import NMLinear

__all__ = ["nm_mat"]


@lowers("linear", NMLinear)
def nm_mat(lin: NMLinear, keep: list[Tensor]) -> Mat | None:
    """The C view of a 2:4 ``NMLinear``, or None when the compiled step cannot read it."""
    values, positions = lin.values, lin.positions
    if (lin.n, lin.m) != (2, 4) or not plain_f32(lin.bias, lin.scale):
        return None
    code = torch.int8 if lin.scale is not None else torch.float32
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in (values, positions)):
        return None
    if values.dtype != code or positions.dtype != torch.uint8:
        return None
    scale = None if lin.scale is None else lin.scale.data_ptr()
    fmt = FORMAT_CODES["nm_f32" if scale is None else "nm_i8"]
    return Mat(values.data_ptr(), scale, 0, fmt, positions.data_ptr())

"""Where the Triton kernels run: a CUDA GPU, or the Triton interpreter on CPU tensors.

Triton compiles ``@triton.jit`` functions for a GPU. Its interpreter (``TRITON_INTERPRET=1``)
runs the same kernels with NumPy on CPU tensors, one program instance after another: slow, but
exact enough to test every kernel on a laptop. Triton reads the variable when a kernel is
*defined*, so this module sets it before ``minisparse.kernels`` defines any kernel, even when
triton itself was imported earlier. Speed is only ever measured on a GPU.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import Tensor


def configure() -> bool:
    """Turn the interpreter on when no CUDA device is present; return whether it is on.

    An explicit ``TRITON_INTERPRET`` set by the user is respected either way.
    """
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        if "triton.language" in sys.modules:
            _reinterpret_triton_language()
    return interpreting()


def _reinterpret_triton_language() -> None:
    """Make triton's own jit'd helpers (``tl.zeros``, ``tl.sum``, ...) interpretable.

    When triton was imported before the interpreter was switched on, its standard library
    helpers were built as GPU ``JITFunction`` objects, which refuse to run inside an
    interpreted kernel. Wrap each one, once, as an ``InterpretedFunction``, in every
    ``triton.language`` module that holds it.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict[int, InterpretedFunction] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("triton.language"):
            continue
        for attr, obj in list(vars(module).items()):
            if isinstance(obj, JITFunction):
                if id(obj) not in wrapped:
                    wrapped[id(obj)] = InterpretedFunction(obj.fn)
                setattr(module, attr, wrapped[id(obj)])


def interpreting() -> bool:
    """True when Triton kernels defined now run in the interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def check_launchable(*tensors: Tensor) -> None:
    """Kernels need CUDA tensors, or CPU tensors with the interpreter on."""
    on_cpu = any(t.device.type != "cuda" for t in tensors)
    if on_cpu and not INTERPRETING:
        raise RuntimeError(
            "Triton kernels need CUDA tensors; these are on the CPU and the Triton interpreter "
            "is off. Move the tensors to a GPU with .cuda(), use the CPU fast path "
            "(minisparse.kernels.cpu), or set TRITON_INTERPRET=1 before importing "
            "minisparse.kernels to run the kernels (slowly) on the CPU."
        )


INTERPRETING = configure()

"""Where the Triton kernels run: a CUDA GPU, or the Triton interpreter on CPU tensors.

Triton compiles ``@triton.jit`` functions for a GPU. Its interpreter runs the same kernels with
NumPy on CPU tensors, one program instance after another: slow, but exact enough to test every
kernel on a laptop. Speed is only ever measured on a GPU.

Triton's own switch is the environment variable ``TRITON_INTERPRET=1``, read when a kernel is
*defined*: it turns every Triton kernel of the process into an interpreted one, the user's own
included. minisparse never sets it. Each launch decides instead (``launch``):

* every tensor on CUDA: the compiled kernel, as usual;
* a tensor on the CPU: the same Python function, run by Triton's ``InterpretedFunction``
  (unless the user set ``TRITON_INTERPRET`` to a false value: then a clear error).

Inside an interpreted kernel, calls to other jit'd functions (``tl.sum`` of triton's standard
library, our own ``@triton.jit`` helpers) must be interpreted too. ``interpreted_scope`` makes
them so for the duration of one launch and puts everything back afterwards: the same kind of
scoped patching triton's interpreter itself does to triton.language while it runs a grid. A
lock keeps our launches from overlapping. Nothing here imports triton until a kernel is
launched.

Kernels written elsewhere (a reader's own, launched as ``kernel[grid](...)``) get the same
treatment inside ``with interpreted_launches():``: a launch given CPU tensors runs interpreted,
a launch on CUDA tensors compiles as usual, and afterwards every kernel is as it was.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "check_launchable",
    "interpreted",
    "interpreted_launches",
    "interpreted_scope",
    "interpreting",
    "launch",
    "triton_available",
    "user_setting",
]

_TRUE = ("1", "true", "yes", "on")
_LOCK = threading.RLock()
_TWINS: dict[Any, Any] = {}  # python function -> its InterpretedFunction


def user_setting() -> bool | None:
    """The user's ``TRITON_INTERPRET``: True, False, or None when it is not set."""
    value = os.environ.get("TRITON_INTERPRET", "").strip().lower()
    if not value:
        return None
    return value in _TRUE


def interpreting() -> bool:
    """True when the Triton kernels run in the interpreter here by default.

    That is when the user asked for it (``TRITON_INTERPRET=1``) or, unless they forbade it,
    when no CUDA device is present (the kernels then take CPU tensors). Reads, never sets.
    """
    setting = user_setting()
    return setting if setting is not None else not torch.cuda.is_available()


def triton_available() -> bool:
    """True when the triton package can be imported (found without importing it)."""
    if "triton" in sys.modules:
        return sys.modules["triton"] is not None
    return importlib.util.find_spec("triton") is not None


def check_launchable(*tensors: Tensor) -> None:
    """Kernels take CUDA tensors, or CPU tensors (interpreted) unless TRITON_INTERPRET=0."""
    kinds = {t.device.type for t in tensors}
    if not kinds <= {"cuda", "cpu"}:
        raise ValueError(
            f"The Triton kernels take CUDA or CPU tensors, got {sorted(kinds)}; move the tensors "
            "with .cuda() or .cpu()."
        )
    if "cpu" in kinds and user_setting() is False:
        raise RuntimeError(
            "Triton kernels need CUDA tensors, or CPU tensors run in the Triton interpreter; "
            "these are on the CPU and TRITON_INTERPRET is set to a false value. Move the tensors "
            "to a GPU with .cuda(), use the CPU fast path (minisparse.kernels.cpu), or unset "
            "TRITON_INTERPRET (or set TRITON_INTERPRET=1) to run the kernels slowly on the CPU."
        )


def _is_interpreted(kernel: Any) -> bool:
    """True for a kernel triton already built interpreted (TRITON_INTERPRET=1 at definition)."""
    return type(kernel).__name__ == "InterpretedFunction"


def interpreted(kernel: Any) -> Any:
    """The interpreted twin of a ``@triton.jit`` function (built once, then reused)."""
    if _is_interpreted(kernel):
        return kernel
    from triton.runtime.interpreter import InterpretedFunction

    if kernel.fn not in _TWINS:
        _TWINS[kernel.fn] = InterpretedFunction(kernel.fn)
    return _TWINS[kernel.fn]


@contextlib.contextmanager
def interpreted_scope(kernel_globals: dict[str, Any]) -> Iterator[None]:
    """For one interpreted launch: jit'd helpers callable, then everything as it was.

    A compiled ``JITFunction`` refuses to be called from Python; an interpreted kernel calls
    its helpers (``tl.sum``, our ``_activation``) exactly that way. For the launch, calling a
    ``JITFunction`` runs its interpreted twin instead (a class attribute, restored on exit;
    compiled launches never call it). The interpreter runs rewritten copies of these functions
    that expect its own names among their module's globals: they are added for the launch and
    removed afterwards, so no module keeps them.
    """
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    added: dict[int, tuple[dict[str, Any], set[str]]] = {}

    def provide(namespace: dict[str, Any]) -> None:
        if id(namespace) not in added:
            added[id(namespace)] = (namespace, set(namespace))
            for name, obj in vars(interpreter).items():
                namespace.setdefault(name, obj)

    def call_interpreted(self: Any, *args: Any, **kwargs: Any) -> Any:
        provide(self.fn.__globals__)
        return interpreted(self)(*args, **kwargs)

    own_call = JITFunction.__dict__.get("__call__")
    provide(kernel_globals)
    JITFunction.__call__ = call_interpreted
    try:
        yield
    finally:
        if own_call is None:
            del JITFunction.__call__
        else:
            JITFunction.__call__ = own_call
        for namespace, before in added.values():
            for name in set(namespace) - before:
                del namespace[name]


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, compiled on CUDA tensors, interpreted otherwise."""
    tensors = [a for a in args if isinstance(a, Tensor)]
    on_cpu = any(t.device.type != "cuda" for t in tensors)
    if not on_cpu and not _is_interpreted(kernel):
        kernel[grid](*args, **kwargs)
        return
    check_launchable(*tensors)
    with _LOCK, interpreted_scope(kernel.fn.__globals__):
        interpreted(kernel)[grid](*args, **kwargs)


@contextlib.contextmanager
def interpreted_launches() -> Iterator[None]:
    """Within the block, any ``@triton.jit`` kernel's CPU launches run in the interpreter.

    ``kernel[grid](*args)`` then runs like ``launch``: compiled when every tensor argument is on
    CUDA, interpreted otherwise. For kernels defined outside minisparse (a reader's own), which
    would otherwise need ``TRITON_INTERPRET=1`` before their definition to take CPU tensors. A
    kernel defined under that setting is interpreted already and is not affected. Restores
    triton on exit.
    """
    from triton.runtime.jit import JITFunction, KernelInterface

    own = JITFunction.__dict__.get("__getitem__")
    compiled = own or KernelInterface.__getitem__

    def getitem(self: Any, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)]
            if all(t.device.type == "cuda" for t in tensors):
                return compiled(self, grid)(*args, **kwargs)
            check_launchable(*tensors)
            with _LOCK, interpreted_scope(self.fn.__globals__):
                return interpreted(self)[grid](*args, **kwargs)

        return run

    JITFunction.__getitem__ = getitem
    try:
        yield
    finally:
        if own is None:
            del JITFunction.__getitem__
        else:
            JITFunction.__getitem__ = own

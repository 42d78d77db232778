"""Old names that keep working for one release, each with a ``DeprecationWarning`` naming the
new one. This is the one list of them; ``CHANGELOG.md`` says what each user must change.

Two kinds of old name, both written as dotted paths:

* **a module that moved** (``minisparse.io.cache`` is ``minisparse.files.cache``): importing
  the old path gives the new module itself (the same object, so monkeypatching either name
  patches both), through a finder on ``sys.meta_path`` that ``import minisparse`` installs;
* **a name inside a module** that was renamed or moved to another module
  (``minisparse.kernels.sparse_input_gemv`` is ``minisparse.kernels.scatter_gemv``): reading
  it from the old module gives the new object. The old module answers through its
  ``__getattr__``, which asks ``old_name`` here (one line in the module; a test checks that
  every module named below has it).

Nothing here imports the rest of the library until an old name is used: this module sits on
the lowest floor and reaches the new names by string.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["REMOVED_IN", "RENAMED_MODULES", "RENAMED_NAMES", "install", "old_name"]

PACKAGE = "minisparse"

#: The release in which every old name below stops working.
REMOVED_IN = "0.3.0"

#: old module path -> its new path, both under ``minisparse.`` (0.2.0)
RENAMED_MODULES = {
    "io.cache": "files.cache",
    # generate's module was split: the loop is runtime.generate, the rest core.sampling
    "core.generate": "core.sampling",
}

#: old ``module.name`` -> the new ``module.name``, both under ``minisparse.``, read on first
#: use (0.2.0)
RENAMED_NAMES = {
    "kernels.sparse_input_gemv": "kernels.scatter_gemv",
    "kernels.sparse_input_gemv_ref": "kernels.reference.scatter_gemv_ref",
    "kernels.cpu.sparse_input_gemv": "kernels.cpu.scatter_gemv",
    "kernels.cpu_int8.sparse_input_gemv_i8": "kernels.cpu_int8.scatter_gemv_i8",
    "sparse.calibrate_thresholds": "sparsity.thresholds.cats_thresholds",
    "quant.METHODS": "quant.calibration.QUANT_METHODS",
    "core.sampling.generate": "runtime.generate.generate",
    "io.export.save_placement": "offload.placement.save_placement",
    "io.export.load_placement": "offload.placement.load_placement",
    "pruning.prune.UNPLAIN_FIX": "core.plain.UNPLAIN_FIX",
}


def _resolve(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(f"{PACKAGE}.{module}"), name)


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} is {new} now: use the new name ({old} goes in {REMOVED_IN}).",
        DeprecationWarning,
        stacklevel=3,
    )


def old_name(module: str, name: str) -> Any:
    """The object an old ``module.name`` stands for, with a warning; AttributeError for a name
    that never existed (the module's ``__getattr__`` calls this last)."""
    new = RENAMED_NAMES.get(f"{module.removeprefix(PACKAGE + '.')}.{name}")
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    _warn(f"{module}.{name}", f"{PACKAGE}.{new}")
    return _resolve(new)


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module has run already


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object, target: object = None):
        new = RENAMED_MODULES.get(fullname.removeprefix(PACKAGE + "."))
        if new is None or not fullname.startswith(PACKAGE + "."):
            return None
        _warn(fullname, f"{PACKAGE}.{new}")
        return importlib.machinery.ModuleSpec(fullname, _Alias(f"{PACKAGE}.{new}"))


def install() -> None:
    """Put the finder of old module paths on ``sys.meta_path`` once (``import minisparse``
    does)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())

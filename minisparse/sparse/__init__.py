"""Sparse MLPs (chapter 07): modules that compute only the active neurons, with the masked dense
reference.

The package's face: every public name of its modules, importable from here."""

from typing import Any

from ..deprecated import old_name
from . import lowering as lowering  # registers how the compiled step runs a SparseMLP
from . import mlp, swap, traffic
from .mlp import *  # noqa: F403
from .swap import *  # noqa: F403
from .traffic import *  # noqa: F403

__all__ = [*mlp.__all__, *swap.__all__, *traffic.__all__]


def __getattr__(name: str) -> Any:
    """Old names of this module, for one release (``minisparse.deprecated``)."""
    return old_name(__name__, name)

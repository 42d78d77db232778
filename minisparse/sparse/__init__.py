"""Sparse MLPs (chapter 07): modules that compute only the active neurons, with the masked dense
reference.

The package's face: every public name of its modules, importable from here."""

from . import lowering as lowering  # registers how the compiled step runs a SparseMLP
from . import mlp, swap
from .mlp import *  # noqa: F403
from .swap import *  # noqa: F403

__all__ = [*mlp.__all__, *swap.__all__]

"""Weight pruning (chapter 12): static sparsity in the weights, set against the dynamic
activation sparsity of chapters 03-08.

The package's face: every public name of its modules, importable from here."""

from . import masks, scores
from .masks import *  # noqa: F403
from .scores import *  # noqa: F403

__all__ = [*masks.__all__, *scores.__all__]

"""Weight pruning (chapter 12): static sparsity in the weights, set against the dynamic
activation sparsity of chapters 03-08.

The package's face: every public name of its modules, importable from here."""

from . import lowering as lowering  # registers NMLinear with the compiled decode step
from . import masks, nm_linear, scores, sparsegpt, sweep
from . import prune as _prune  # the module; `prune` below is its function
from .masks import *  # noqa: F403
from .nm_linear import *  # noqa: F403
from .prune import *  # noqa: F403
from .scores import *  # noqa: F403
from .sparsegpt import *  # noqa: F403
from .sweep import *  # noqa: F403

__all__ = [
    *masks.__all__,
    *scores.__all__,
    *nm_linear.__all__,
    *sparsegpt.__all__,
    *_prune.__all__,
    *sweep.__all__,
]

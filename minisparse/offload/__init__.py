"""Hot/cold offload (chapter 08): place neurons on a fast device, run the split, and model its
speed.

The package's face: every public name of its modules, importable from here."""

from . import placement
from .placement import *  # noqa: F403

__all__ = placement.__all__

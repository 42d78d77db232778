"""The KV cache (chapter 02): the contiguous cache and its memory, eviction (attention sinks,
H2O) and paging.

The package's face: every public name of its modules, importable from here."""

from . import contiguous
from .contiguous import *  # noqa: F403

__all__ = contiguous.__all__

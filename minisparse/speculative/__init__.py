"""Speculative decoding (chapter 10): drafts, verification, sampling and the speed-up theory.

The package's face: every public name of its modules, importable from here."""

from . import loop, registry
from .loop import *  # noqa: F403
from .registry import *  # noqa: F403

__all__ = [*loop.__all__, *registry.__all__]

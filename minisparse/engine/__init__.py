"""The engine (chapter 11): the course's techniques composed from one config.

The package's face: every public name of its modules, importable from here."""

from . import compose
from .compose import *  # noqa: F403

__all__ = compose.__all__

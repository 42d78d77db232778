"""Quantization (chapter 09): tensors, weight-only layers, and the methods RTN, SmoothQuant, AWQ
and GPTQ.

The package's face: every public name of its modules, importable from here."""

from typing import Any

from ..deprecated import old_name
from . import apply, formats, options
from . import gptq as gptq  # registers GPTQ
from . import smoothing as smoothing  # registers SmoothQuant and AWQ
from .apply import *  # noqa: F403
from .formats import *  # noqa: F403
from .options import *  # noqa: F403

__all__ = [*apply.__all__, *formats.__all__, *options.__all__]


def __getattr__(name: str) -> Any:
    """Old names of this module, for one release (``minisparse.deprecated``)."""
    return old_name(__name__, name)

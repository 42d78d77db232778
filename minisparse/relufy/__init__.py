"""ReLUfication (chapter 04): swap the activation for ReLU and recover quality by fine-tuning (full
or LoRA).

The package's face: every public name of its modules, importable from here."""

from . import method as method  # registers the sparsity method relu (chapter 04)
from . import recipe
from .recipe import *  # noqa: F403

__all__ = recipe.__all__

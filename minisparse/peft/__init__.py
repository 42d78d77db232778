"""Parameter-efficient fine-tuning (chapter 12): QLoRA on an NF4 base, Houlsby adapters, and
the recovery of a 2:4-pruned model with them.

The package's face: every public name of its modules, importable from here."""

from . import adapters, qlora, recovery_file
from . import recover as _recover  # the module; `recover` below is its function
from .adapters import *  # noqa: F403
from .qlora import *  # noqa: F403
from .recover import *  # noqa: F403
from .recovery_file import *  # noqa: F403

__all__ = [*adapters.__all__, *qlora.__all__, *_recover.__all__, *recovery_file.__all__]

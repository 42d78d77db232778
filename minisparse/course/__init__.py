"""The course around the library: graded exercises and core builds (``grading``, ``exercises``,
the cases in ``sets_early``/``sets_late`` and the chapters' builds in ``builds``), ``use``, which
plugs the learner's passing code into the rest of a chapter (``plug``), the tour and the
preparation of the long results (``prepare``)."""

from . import exercises  # noqa: F401  (registers every exercise and build)
from .grading import check
from .plug import Impl, use

__all__ = ["Impl", "check", "use"]

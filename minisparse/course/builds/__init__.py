"""Each chapter's core builds: the heart of the chapter, written by the learner.

One module per chapter registers its builds (``grading.register`` with ``core=True``): the
library's version as the reference, fresh random cases with the edge cases a first attempt
misses, and, for a class or a loop, a ``run`` that drives it through a script of operations.
What the chapter plugs the learner's code into lives beside it (e.g. ``attention_with``).
"""

from . import ch00, ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09, ch10, ch11, ch12  # noqa: F401

__all__: list[str] = []

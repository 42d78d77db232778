"""Chapter 07's core builds (registered with ``grading.register(..., core=True)``)."""

from __future__ import annotations

__all__: list[str] = []

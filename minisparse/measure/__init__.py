"""How the course measures: the machine's facts (``machine``), one timing harness (``timing``),
float32 error bounds (``tolerance``) and plots (``plots``)."""

__all__: list[str] = []

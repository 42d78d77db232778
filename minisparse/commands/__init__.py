"""The commands of ``minisparse`` that stand on the whole library, one module each (``export``);
``minisparse.cli`` is their table."""

__all__: list[str] = []

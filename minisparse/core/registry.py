"""A registry: the entries of one axis of the course by name (sparsity methods, weight formats,
quantization methods, drafts).

The engine, the benches and the command line list an axis from its registry, so adding an
entry is one ``register`` call next to the entry's own code. An entry is anything with a
``name``; a name is registered once.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

__all__ = ["Named", "Registry"]


class Named(Protocol):
    name: str


T = TypeVar("T", bound=Named)


class Registry(dict[str, T], Generic[T]):
    """Entries by name, in registration order; ``what`` names them in errors."""

    def __init__(self, what: str, reserved: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.what, self.reserved = what, reserved

    def register(self, entry: T) -> T:
        """Add ``entry`` (a name registered twice, or a reserved one, is an error)."""
        if entry.name in self or entry.name in self.reserved:
            raise ValueError(f"A {self.what} named {entry.name!r} is registered already.")
        self[entry.name] = entry
        return entry

    def find(self, name: str) -> T:
        """The entry ``name``, or one ValueError that lists the registered ones."""
        if name not in self:
            raise ValueError(f"Unknown {self.what} {name!r}; use one of {tuple(self)}.")
        return self[name]

"""Files on disk, the lowest floor of the library: ``cache`` (the cache folder, atomic writes
that never leave half a file, the lock that lets one process build what others wait for)."""

__all__: list[str] = []

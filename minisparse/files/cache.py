"""minisparse's cache directory and the atomic writes that fill it.

Everything the library computes once and reuses lives under one folder: the dequantized
weights of a model, its tokenizer, compiled CPU kernels, fine-tuned ReLU models, predictors.
``MINISPARSE_CACHE`` moves it (tests point it at a temporary folder); otherwise it is
``$XDG_CACHE_HOME/minisparse`` or ``~/.cache/minisparse``.

Every file is written under a temporary name in the same folder and renamed into place
(``os.replace`` is atomic on one file system), so an interrupted write, or two processes
writing at once, never leave half a file under the final name. A write that fails (a full
disk, a file-size limit) raises ``OSError`` whatever library did the writing, and removes its
temporary; a process killed while writing leaves one, which ``sweep_temporaries`` removes
once it is an hour old, the next time a cache folder is built. Every temporary name ends in
``.tmp``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

__all__ = [
    "STALE_SECONDS",
    "atomic_write_text",
    "cache_dir",
    "exclusive_lock",
    "save_tensors_atomic",
    "sweep_temporaries",
    "write_dir_atomic",
    "write_file_atomic",
]


def cache_dir() -> Path:
    """Root of minisparse's cache: $MINISPARSE_CACHE, else $XDG_CACHE_HOME/minisparse."""
    env = os.environ.get("MINISPARSE_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "minisparse"


def save_tensors_atomic(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]
) -> None:
    """safetensors file written to a temporary name, then renamed: never half a file at ``path``."""
    write_file_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def atomic_write_text(path: Path, text: str) -> None:
    """A text file written to a temporary name, then renamed: never half a file at ``path``."""
    write_file_atomic(path, lambda tmp: tmp.write_text(text))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _share(path: Path) -> None:
    """Give a file (0666) or folder (0777, with its contents) the modes the umask allows, as a
    plain write would: temporaries are created private, an export is not."""
    mask = _umask()
    if path.is_dir():
        for sub in [path, *path.rglob("*")]:
            os.chmod(sub, (0o777 if sub.is_dir() else 0o666) & ~mask)
    else:
        os.chmod(path, 0o666 & ~mask)


def write_dir_atomic(directory: Path, write: Callable[[Path], None], shared: bool = False) -> None:
    """Fill a temporary folder with ``write(folder)``, then put it in ``directory``'s place.

    A folder already there is first renamed aside and removed only once the new one is in
    place; if that rename fails it is put back. A failure while writing leaves it untouched,
    and only a crash between the two renames leaves it beside its place, whole, in a ``*.tmp``
    folder. ``shared``: the result gets the modes the umask allows (an export), not the
    temporary folder's private ones (the cache).
    """
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, suffix=".tmp"))
    old = None
    try:
        try:
            write(tmp)
        except SafetensorError as err:
            raise OSError(f"could not write {directory.name}: {err}") from err
        if shared:
            _share(tmp)
        if directory.exists():
            old = Path(tempfile.mkdtemp(dir=directory.parent, suffix=".tmp"))
            os.replace(directory, old / directory.name)
        try:
            os.replace(tmp, directory)
        except BaseException:
            if old is not None and not directory.exists():
                os.replace(old / directory.name, directory)  # the old folder goes back
                shutil.rmtree(old, ignore_errors=True)
                old = None
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def write_file_atomic(path: Path, write: Callable[[Path], None], shared: bool = False) -> None:
    """``write(tmp)`` writes a file at the temporary path it is given, which is then renamed
    to ``path``: an interrupted or failed write leaves the file that was there, untouched.
    ``shared``: the file gets the modes the umask allows, not the temporary's 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        try:
            write(Path(tmp))
        except SafetensorError as err:
            raise OSError(f"could not write {path.name}: {err}") from err
        if shared:
            _share(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on the file ``path`` (made if missing) for the ``with``
    block; yields whether it is held. Where none can be taken (no POSIX ``flock``, an
    unwritable folder) the block runs without it."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")  # closed by the with below
    except (ImportError, OSError):
        yield False
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


STALE_SECONDS = 3600  # a temporary untouched this long belongs to no running writer


def sweep_temporaries(folder: Path, older_than: float = STALE_SECONDS) -> list[Path]:
    """Remove what killed writers left in ``folder``: entries named ``*.tmp`` (ours) or
    ``.tmp*`` (other libraries' temporaries) not modified for ``older_than`` seconds, so that
    a writer at work (even one that holds no lock) keeps its temporary. Returns what was
    removed."""
    removed = []
    now = time.time()
    for entry in [*folder.glob("*.tmp"), *folder.glob(".tmp*")]:
        try:
            if now - entry.lstat().st_mtime < older_than:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        except OSError:
            continue
        removed.append(entry)
    return removed

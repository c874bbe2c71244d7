"""Files that are whole or absent: written beside the target, then renamed over it.

A crash mid-write must not leave half a checkpoint, trace or results file,
nor destroy the previous one. The data goes to a temporary file in the same
directory, is fsynced and renamed over the target (atomic on POSIX), then the
directory is fsynced so the rename itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Iterator

__all__ = ["require_folder", "replace_atomically", "write_text"]


def require_folder(path: str | os.PathLike, what: str = "write") -> str:
    """The folder ``path`` goes in; a clear error naming ``what`` failed when it does not exist."""
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    if not os.path.isdir(folder):
        raise ValueError(f"cannot {what} {os.fspath(path)}: the directory {folder} does not exist; create it first")
    return folder


@contextlib.contextmanager
def replace_atomically(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """A file object whose contents replace ``path`` only when the block ends without an error."""
    path = os.fspath(path)
    folder = require_folder(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        os.chmod(tmp, _mode_for(path))  # mkstemp makes 0600: keep the old file's mode, or the umask's default
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # some platforms cannot fsync a directory
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _mode_for(path: str) -> int:
    try:
        return os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a reader sees the old file or the new one, never half of it."""
    with replace_atomically(path, "w") as f:
        f.write(text)

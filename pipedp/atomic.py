"""Files that are whole or absent: written beside the target, then renamed over it.

A crash mid-write must not leave half a checkpoint, trace or results file,
nor destroy the previous one. The data goes to a temporary file in the same
directory, is fsynced and renamed over the target (atomic on POSIX), then the
directory is fsynced so the rename itself survives a power loss.

Writing goes where ``open(path, "w")`` would, and nowhere else: a target this
user may not write (a checkpoint made read-only to keep it) is refused with a
PermissionError, as ``torch.save`` would refuse it, although a rename could
replace it. A writer killed mid-write leaves its temporary file; the names
carry host and process id, so the next write to the same target removes the
files of writers that are gone and keeps those of writers still running.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import stat
import tempfile
import time
from typing import IO, Iterator

__all__ = ["require_folder", "replace_atomically", "write_text"]

_TAG = "pipedp"  # in every temporary name: only such files are ever removed
STALE_S = 24 * 3600  # a temporary file untouched this long is a dead writer's, whatever its host


def require_folder(path: str | os.PathLike, what: str = "write") -> str:
    """The folder ``path`` goes in; a clear error naming ``what`` failed when it is missing or out of reach."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        raise ValueError(f"cannot {what} {path}: the directory {folder} does not exist; create it first") from None
    except PermissionError:
        blocked = _first_closed(folder)
        raise PermissionError(
            f"cannot {what} {path}: permission denied on {blocked}, which this user may not enter, so the directory "
            f"{folder} cannot be reached. Allow it (chmod u+x {blocked}) or choose another folder") from None
    except NotADirectoryError:
        raise ValueError(f"cannot {what} {path}: a part of {folder} is a file, not a directory") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"cannot {what} {path}: {folder} is a file, not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(
            f"cannot {what} {path}: permission denied: this user may not create files in {folder}. Allow it "
            f"(chmod u+wx {folder}) or choose another folder")
    return folder


def _first_closed(folder: str) -> str:
    """The outermost directory on the way to ``folder`` that this user may not enter (``folder`` if none)."""
    parts = folder.split(os.sep)
    for i in range(2, len(parts) + 1):
        prefix = os.sep.join(parts[:i]) or os.sep
        if not os.access(prefix, os.X_OK):
            return prefix
    return folder


@contextlib.contextmanager
def replace_atomically(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """A file object whose contents replace ``path`` only when the block ends without an error."""
    path = os.fspath(path)
    folder = require_folder(path)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise PermissionError(
            f"{path} is read-only (mode {stat.S_IMODE(os.stat(path).st_mode):o}): pipedp does not replace a file "
            f"this user may not write, as torch.save would not. Make it writable (chmod u+w {path}) or write to "
            f"another path")
    base = os.path.basename(path)
    _remove_stale(folder, base)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{base}.{_TAG}-{_host()}-{os.getpid()}-", suffix=".tmp")
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


def _host() -> str:
    """This machine, in 8 hex digits (a folder may be shared by several machines)."""
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's live process
        return True
    return True


def _remove_stale(folder: str, base: str) -> None:
    """Remove the temporary files of earlier writes to ``base`` whose writer is gone (killed mid-write).

    Only names this module makes are touched: a writer on this host whose
    process no longer exists, or any writer's file untouched for a day.
    """
    prefix, host = f".{base}.{_TAG}-", _host()
    with contextlib.suppress(OSError), os.scandir(folder) as entries:
        for entry in entries:
            if not (entry.name.startswith(prefix) and entry.name.endswith(".tmp")):
                continue
            writer_host, pid, _ = (entry.name[len(prefix):-4].split("-", 2) + ["", ""])[:3]
            with contextlib.suppress(OSError, ValueError):
                dead = writer_host == host and not _alive(int(pid))
                if dead or time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_S:
                    os.unlink(entry.path)


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

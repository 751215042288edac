"""One owner per directory: an OS-level lock held for the life of a run or a training job.

A run directory (``python -m selfspec.evaluate``) or an artefact directory (``python -m
selfspec.train``) is written by one process at a time. Two evaluations into one directory would
both append every row; two training jobs into one artefact directory would both report success
while one result is lost. :func:`hold` takes an exclusive ``flock`` and keeps it until the block
ends; a second process is refused at once (:class:`DirectoryBusy`), naming the holder's pid and
command. The kernel drops the lock when its holder exits, however it exits (a crash, ``kill -9``),
so a lock is never left stale.

* a run directory is locked on the directory itself: nothing is written to take the lock, so a
  refused run leaves the directory exactly as it was;
* an artefact directory is replaced by a rename when its artefact is saved, so its lock is a
  sibling file ``.<name>.lock`` (next to the job's checkpoint ``.<name>.ckpt``).

The holder is read from ``/proc/locks`` (Linux); elsewhere the message says "another process".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)

__all__ = ["DirectoryBusy", "artefact_lock", "hold", "holder"]


class DirectoryBusy(RuntimeError):
    """The directory is in use by another process (the message names it)."""


def artefact_lock(path: str | Path) -> Path:
    """The lock file of artefact directory ``path``: ``.<name>.lock`` beside it."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


@contextlib.contextmanager
def hold(target: str | Path, what: str, wait: str | None = None) -> Iterator[None]:
    """Own ``target`` (an existing directory, or a lock file created if missing) while the block
    runs; raise :class:`DirectoryBusy` at once when another process owns it. ``what`` names the
    directory in the message (``"run directory outputs/eval/..."``). ``wait``: instead of refusing,
    log this line with the holder and wait for it (a kernel build another process is making)."""
    target = Path(target)
    if target.is_dir():
        fd = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if wait is None:
                raise DirectoryBusy(f"{what} is in use by {holder(target)}; wait for it to finish, or write to "
                                    "another directory") from None
            log.warning("%s: waiting for %s", wait, holder(target))
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:  # a file system without flock (some network mounts)
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF, errno.EINVAL):
                raise
            log.warning("cannot lock %s here (%s): nothing stops a second process from writing to it at the "
                        "same time", what, os.strerror(err.errno))
        yield
    finally:
        os.close(fd)  # releases the lock


def holder(target: str | Path) -> str:
    """``pid N (command)`` of the process holding a ``flock`` on ``target``, from ``/proc/locks``;
    ``another process`` when it cannot be told."""
    try:
        st = os.stat(target)
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return "another process"
    want = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in lines:
        parts = line.split()
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
            continue
        pid, where = parts[4], parts[5].split(":")
        try:
            found = (int(where[0], 16), int(where[1], 16), int(where[2]))
        except (IndexError, ValueError):
            continue
        if found == want:
            return f"pid {pid} ({_command(pid)})"
    return "another process"


def _command(pid: str) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "command unknown"
    text = " ".join(raw.replace(b"\0", b" ").decode(errors="replace").split())
    return (text[:200] + " ...") if len(text) > 200 else text or "command unknown"

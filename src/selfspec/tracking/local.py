"""Local results files: written whatever the experiment tracker does.

``results.jsonl`` is appended one JSON line per finished record and flushed to disk at once, so
an interrupted run keeps every finished example and a re-run into the same directory can skip
them. Summaries are written atomically (temporary file + rename).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator


def to_jsonable(obj: Any) -> Any:
    """Plain JSON values for configs, tensors, numpy scalars; NaN/inf become ``None``."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(obj):
            return to_jsonable(OmegaConf.to_container(obj, resolve=True))
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # torch / numpy
        return to_jsonable(obj.tolist())
    if hasattr(obj, "item"):
        return to_jsonable(obj.item())
    return str(obj)


def not_plain(info: os.stat_result) -> str | None:
    """Why a file with this ``lstat`` / ``fstat`` is not one selfspec reads or appends ("is a FIFO",
    "has 2 hard links (...)"), or None for a regular file with one link."""
    mode = info.st_mode
    if stat.S_ISREG(mode):
        return None if info.st_nlink == 1 else \
            f"has {info.st_nlink} hard links (it shares its lines with another file)"
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return f"is {name}"
    return "is not a regular file"


class ResultsFileError(ValueError):
    """A results file that cannot be read as the framework wrote it (the message names the lines)."""


class ResultsFile:
    """An append-only JSON-lines file; each :meth:`append` is on disk when it returns.

    Only a file the framework wrote is appended to (the caller checks its record first, see
    :func:`selfspec.evaluation.runner.evaluate`): the path must be a regular file with one link,
    so a symlink, a FIFO (reading one waited forever), a directory, or a hard link that shares
    another run's file is refused by name (:meth:`_open`), and the only repair is dropping a torn
    last line (a crash mid-write). Any other invalid line is an error that names it, never skipped
    silently."""

    def __init__(self, path: str | Path, keys: tuple[str, ...] = ()) -> None:
        """``keys``: what every row must hold (a line without them is invalid)."""
        self.path = Path(path)
        self.keys = keys
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = None

    def append(self, row: dict[str, Any]) -> None:
        if self._fh is None:
            self._repair_tail()
            self._fh = os.fdopen(self._open(os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")
        with disk_space(self.path):
            self._fh.write(json.dumps(to_jsonable(row), ensure_ascii=False) + "\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def rows(self) -> list[dict[str, Any]]:
        return list(self)

    def check(self) -> None:
        """Raise :class:`ResultsFileError` unless every complete line is a JSON object (a torn last
        line, with no newline, is a crash mid-write and is allowed)."""
        for _ in self:
            pass

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Complete rows; a torn last line (a crash mid-write) is ignored, any other invalid line
        raises :class:`ResultsFileError`."""
        if not os.path.lexists(self.path):
            return
        bad: list[int] = []
        rows: list[dict[str, Any]] = []
        with os.fdopen(self._open(os.O_RDONLY), encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                if not line.endswith("\n"):
                    break
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    row = None
                if isinstance(row, dict) and all(k in row for k in self.keys):
                    rows.append(row)
                else:
                    bad.append(number)
        if bad:
            shown = ", ".join(map(str, bad[:10])) + (" ..." if len(bad) > 10 else "")
            raise ResultsFileError(
                f"{self.path}: line(s) {shown} are not rows selfspec wrote (a JSON object with "
                f"{', '.join(self.keys) or 'fields'}); the file was changed outside selfspec. Delete those lines "
                "to redo what they held, or write into a new directory")
        yield from rows

    def _repair_tail(self) -> None:
        """Drop a torn last line so appends start on a fresh line."""
        if not os.path.lexists(self.path):
            return
        with os.fdopen(self._open(os.O_RDWR), "rb+") as f:
            data = f.read()
            if data.endswith(b"\n"):
                return
            f.truncate(data.rfind(b"\n") + 1)

    def _open(self, flags: int) -> int:
        """A descriptor of the results file opened with ``flags``, once it is known to be a regular
        file with one link; else :class:`ResultsFileError` naming what it is. Opened without
        following a symlink and without blocking (a FIFO's open waits for a writer otherwise)."""
        try:
            fd = os.open(self.path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as err:
            what = ((os.path.lexists(self.path) and not_plain(os.lstat(self.path)))
                    or f"cannot be opened ({err.strerror or err})")
        else:
            what = not_plain(os.fstat(fd))
            if what is None:
                os.set_blocking(fd, True)
                return fd
            os.close(fd)
        raise ResultsFileError(f"{self.path} {what}; selfspec reads and appends only the regular files it "
                               "wrote: move it away, or write into a new directory")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> "ResultsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_writable(directory: str | Path, what: str) -> None:
    """Raise :class:`PermissionError` naming ``what`` unless a file can be created in ``directory``
    (an unnamed temporary file: nothing is left behind)."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as err:
        raise PermissionError(f"cannot write to {directory} ({err.strerror or err}): choose a writable "
                              f"directory for {what}") from None


def check_directory(path: str | Path, key: str) -> None:
    """Refuse, naming ``key``, a directory that cannot be made or written (issue 39: an existing file
    there, or a read-only parent, gave a raw FileExistsError or OSError naming no key, after a lock
    file had been created): ``path`` must be a directory or not exist yet, and the nearest existing
    directory on its way must take a new file. Nothing is created."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{key}={path} is an existing file, not a directory: choose a directory")
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise NotADirectoryError(f"{key}={path} lies under the file {ancestor}: choose a directory")
    check_writable(ancestor, key)


class RunLogHandler(logging.Handler):
    """Hydra's job log file (``conf/hydra/job_logging/selfspec.yaml``), opened only when the job
    owns its directory (:func:`open_run_log`): until then records are held in memory, so a run that
    is refused writes nothing into a directory (an earlier run's or a read-only one)."""

    #: records held before the file opens (a job that logs more before it starts keeps the last ones)
    HELD = 10_000

    def __init__(self, filename: str, mode: str = "a", encoding: str = "utf-8") -> None:
        super().__init__()
        self.filename, self.mode, self.encoding = str(filename), mode, encoding
        self.stream = None
        self.held: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.stream is None:
            self.held = self.held[-self.HELD + 1:] + [record]
            return
        try:
            self.stream.write(self.format(record) + "\n")
            self.stream.flush()
        except Exception:  # noqa: BLE001 — logging must not break the job
            self.handleError(record)

    def open(self) -> None:
        """Open the file and write the records held so far."""
        if self.stream is not None:
            return
        self.stream = open(self.filename, self.mode, encoding=self.encoding)
        held, self.held = self.held, []
        for record in held:
            self.emit(record)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        super().close()


def open_run_log(directory: str | Path) -> None:
    """Open the job log files of :class:`RunLogHandler` s that write into ``directory`` (no-op
    outside a Hydra job)."""
    directory = Path(directory).resolve()
    for handler in logging.getLogger().handlers:
        if isinstance(handler, RunLogHandler) and Path(handler.filename).resolve().parent == directory:
            handler.open()


@contextlib.contextmanager
def disk_space(path: str | Path) -> Iterator[None]:
    """Name ``path`` in a full disk's error (issue 39: a raw ``OSError [Errno 28]`` named no file).
    What was written before stays: a run resumes where it stopped once there is space."""
    try:
        yield
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise OSError(err.errno, f"no space left on the device writing {path} ({os.strerror(err.errno)}): free "
                                 "some space and run the same command again (a run resumes where it stopped)",
                      str(path)) from None


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` atomically (temporary file in the same directory + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with disk_space(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON atomically (:func:`write_text`)."""
    return write_text(path, json.dumps(to_jsonable(obj), indent=2, ensure_ascii=False) + "\n")

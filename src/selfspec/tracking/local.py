"""Local results files: written whatever the experiment tracker does.

``results.jsonl`` is appended one JSON line per finished record and flushed to disk at once, so
an interrupted run keeps every finished example and a re-run into the same directory can skip
them. Summaries are written atomically (:func:`selfspec.store.files.write_text`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from selfspec.store.files import disk_space, not_plain, strict_json, to_jsonable


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
        self._fd: int | None = None

    def append(self, row: dict[str, Any]) -> None:
        """Write ``row`` as one line, straight to the file (no buffer holds it back: issue 52, after a
        full disk's error, closing the file tried the buffered line again and failed a second time)."""
        if self._fd is None:
            self._repair_tail()
            self._fd = self._open(os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        line = (json.dumps(to_jsonable(row), ensure_ascii=False) + "\n").encode("utf-8")
        with disk_space(self.path):
            written = 0
            while written < len(line):  # a short write goes on where it stopped
                written += os.write(self._fd, line[written:])
            os.fsync(self._fd)

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
                    row = strict_json(line)  # NaN or Infinity: not a line selfspec wrote
                except ValueError:
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
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "ResultsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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

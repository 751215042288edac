"""Local results files: written whatever the experiment tracker does.

``results.jsonl`` is appended one JSON line per finished record and flushed to disk at once, so
an interrupted run keeps every finished example and a re-run into the same directory can skip
them. Summaries are written atomically (temporary file + rename).
"""

from __future__ import annotations

import json
import math
import os
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


class ResultsFile:
    """An append-only JSON-lines file; each :meth:`append` is on disk when it returns."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = None

    def append(self, row: dict[str, Any]) -> None:
        if self._fh is None:
            self._repair_tail()
            self._fh = open(self.path, "a", encoding="utf-8")
        self._fh.write(json.dumps(to_jsonable(row), ensure_ascii=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def rows(self) -> list[dict[str, Any]]:
        return list(self)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Complete rows; a torn last line (a crash mid-write) is ignored."""
        if not self.path.exists():
            return
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    break
                if line.strip():
                    try:
                        yield json.loads(line)
                    except json.JSONDecodeError:
                        continue

    def _repair_tail(self) -> None:
        """Drop a torn last line so appends start on a fresh line."""
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with open(self.path, "rb+") as f:
            data = f.read()
            if data.endswith(b"\n"):
                return
            f.truncate(data.rfind(b"\n") + 1)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> "ResultsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` atomically (temporary file in the same directory + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
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

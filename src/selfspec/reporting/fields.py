"""Reading fields of run records: a dotted key of a nested config, the method under test.

A leaf module: the layouts (:mod:`selfspec.reporting.layouts`) and the record reader
(:mod:`selfspec.reporting.records`) both read run configs and summaries through it.
"""

from __future__ import annotations

from typing import Any


def dotted(d: Any, key: str, default: Any = None) -> Any:
    """``d["a"]["b"]`` for ``key="a.b"``; ``default`` where a part is missing (a key a run's config
    does not set, e.g. ``report.variant``, which the report shows as absent)."""
    for part in key.split("."):
        if not isinstance(d, dict) or part not in d:
            return default
        d = d[part]
    return d


def label_under_test(summary: dict[str, Any]) -> str:
    """The label of the run's method under test: the summary's ``method`` (every run format read
    has it, :data:`selfspec.reporting.records.RUN_FORMATS`)."""
    return summary["method"]

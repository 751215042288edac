"""Metrics shipped as offline-loadable ``evaluate`` modules, plus their plain functions.

``evaluate.load("rouge")`` fetches its script from the hub; these modules live inside the
package and load by path, so they work with ``HF_HUB_OFFLINE=1``::

    from selfspec import metrics
    metrics.load("rouge").compute(predictions=preds, references=refs)
    evaluate.load(str(metrics.module_path("rouge")))   # the same, through evaluate
"""

from __future__ import annotations

from pathlib import Path

from selfspec.metrics.functions import (extract_number, gsm8k_accuracy, humaneval_pass_at_k,
                                        pass_at_k, rouge, same_number)

__all__ = ["METRICS", "extract_number", "gsm8k_accuracy", "humaneval_pass_at_k", "load",
           "module_path", "pass_at_k", "rouge", "same_number"]

METRICS = ("rouge", "humaneval", "gsm8k")


def module_path(name: str) -> Path:
    """Folder of the evaluate module for metric ``name`` (``rouge``, ``humaneval``, ``gsm8k``)."""
    if name not in METRICS:
        raise KeyError(f"unknown metric {name!r}; known metrics: {', '.join(METRICS)}")
    return Path(__file__).parent / f"selfspec_{name}"


def load(name: str, **kwargs):
    """``evaluate.load`` of the shipped module for metric ``name`` (works offline)."""
    import evaluate

    return evaluate.load(str(module_path(name)), **kwargs)

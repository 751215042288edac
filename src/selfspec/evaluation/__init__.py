"""Evaluation: warm-up, interleaved timing, consistency against the baseline, aggregation.

``evaluate(cfg, out_dir)`` runs conf/evaluate.yaml's methods and writes ``results.jsonl`` and
``summary.json``; :func:`summarize` turns result rows into per-method figures.
"""

from selfspec.evaluation.aggregate import consistency, summarize
from selfspec.evaluation.runner import (RESULTS, SUMMARY, MethodRun, ResumeMismatch, evaluate, load_method_config,
                                        method_configs, method_label, prepare)

__all__ = ["RESULTS", "SUMMARY", "MethodRun", "ResumeMismatch", "consistency", "evaluate",
           "load_method_config", "method_configs", "method_label", "prepare", "summarize"]

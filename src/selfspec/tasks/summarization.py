"""Shared shape of the summarisation tasks (XSum, CNN/DM), as in Draft & Verify.

Prompt (docs/design.md §6): ``shots`` exemplars ``Article: …\\nSummary: …\\n`` then
``Article: {x}\\nSummary:``; generations are cut at ``\\nArticle:``; ROUGE F1 with stemming.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from selfspec.tasks.base import Example, Task

SUMMARISATION_DEFAULTS: dict[str, Any] = {
    "n_examples": 1000, "shots": 1, "max_prompt_tokens": 4096, "stop": ["\nArticle:"]}


def summarisation_prompt(document: str, exemplars: Sequence[tuple[str, str]]) -> str:
    """The k-shot prompt; exemplar summaries are put on one line."""
    shots = "".join(f"Article: {d}\nSummary: {' '.join(s.split())}\n" for d, s in exemplars)
    return f"{shots}Article: {document}\nSummary:"


class SummarisationTask(Task):
    """A task whose records have a document field and a summary field."""

    document_field: ClassVar[str]
    summary_field: ClassVar[str]
    defaults = SUMMARISATION_DEFAULTS

    def make_example(self, record: dict[str, Any], index: int,
                     exemplars: list[dict[str, Any]]) -> Example:
        shots = [(r[self.document_field], r[self.summary_field]) for r in exemplars]
        return Example(
            id=str(record.get("id", index)),
            prompt=summarisation_prompt(record[self.document_field], shots),
            reference=record[self.summary_field],
            meta={"task": self.name, "source": self.cfg.source, "shots": len(shots)},
        )

    def postprocess(self, text: str) -> str:
        return super().postprocess(text).strip()

    def score(self, predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
        """Mean ROUGE-1/2/L F1 (stemming on)."""
        from selfspec import metrics

        return metrics.rouge(predictions, references)

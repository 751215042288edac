"""Shared shape of the summarisation tasks (XSum, CNN/DM), as in Draft & Verify.

Paper prompt (docs/design/reproduction.md §6): ``shots`` exemplars ``Article: …\\nSummary: …\\n`` then
``Article: {x}\\nSummary:``; generations are cut at ``\\nArticle:``; ROUGE F1 with stemming.

Chat prompt (the default for instruct models; a deviation, docs/design/reproduction.md §6): one user turn
holding the article and then the task's instruction (:attr:`SummarisationTask.instruction`); the
assistant's reply is the summary. It is 0-shot by default: SmolLM2-135M-Instruct copies a 1-shot
exemplar (the XSum pool's first shuffled record, a football results table) into its summaries even
as an earlier turn; ``task.shots=k`` adds k exemplars, each an earlier user/assistant exchange of
the same shape. The instruction follows the article so that ``max_prompt_tokens`` (which keeps the
last tokens) clips an exemplar or the article's start, never the instruction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from selfspec.tasks.task import Example, Task

SUMMARISATION_DEFAULTS: dict[str, Any] = {"n_examples": 1000, "max_prompt_tokens": 4096}


def summarisation_prompt(document: str, exemplars: Sequence[tuple[str, str]]) -> str:
    """The k-shot prompt; exemplar summaries are put on one line."""
    shots = "".join(f"Article: {d}\nSummary: {' '.join(s.split())}\n" for d, s in exemplars)
    return f"{shots}Article: {document}\nSummary:"


def summarisation_turns(document: str, exemplars: Sequence[tuple[str, str]],
                        instruction: str) -> list[dict[str, str]]:
    """The chat format's turns: per exemplar a user turn (article, instruction) and the
    assistant's summary on one line, then the user turn of the article to summarise."""
    def ask(d: str) -> dict[str, str]:
        return {"role": "user", "content": f"Article: {d.strip()}\n\n{instruction}"}

    turns: list[dict[str, str]] = []
    for d, s in exemplars:
        turns += [ask(d), {"role": "assistant", "content": " ".join(s.split())}]
    return turns + [ask(document)]


class SummarisationTask(Task):
    """A task whose records have a document field and a summary field."""

    document_field: ClassVar[str]
    summary_field: ClassVar[str]
    #: the chat format's request, after the article
    instruction: ClassVar[str]
    defaults = SUMMARISATION_DEFAULTS
    paper_shots = 1
    chat_shots = 0
    paper_stop = ["\nArticle:"]

    def make_example(self, record: dict[str, Any], index: int,
                     exemplars: list[dict[str, Any]]) -> Example:
        shots = [(r[self.document_field], r[self.summary_field]) for r in exemplars]
        return Example(
            id=self.example_id(record, index),
            prompt=summarisation_prompt(record[self.document_field], shots),
            reference=record[self.summary_field],
            meta={"task": self.name, "source": self.cfg.source, "shots": len(shots)},
        )

    def chat_messages(self, record: dict[str, Any], exemplars: list[dict[str, Any]],
                      example: Example) -> list[dict[str, str]]:
        shots = [(r[self.document_field], r[self.summary_field]) for r in exemplars]
        return summarisation_turns(record[self.document_field], shots, self.instruction)

    def postprocess(self, text: str) -> str:
        return super().postprocess(text).strip()

    def score(self, predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
        """Mean ROUGE-1/2/L F1 (stemming on)."""
        from selfspec import metrics

        return metrics.rouge(predictions, references)

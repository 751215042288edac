"""GSM8K (Cobbe et al. 2021): grade-school maths word problems, scored on the final number.

Prompt: ``shots`` exemplars ``Question: …\\nAnswer: <solution ending in #### N>\\n\\n`` then
``Question: {q}\\nAnswer:``; the answer is the number after ``####``, else after "the answer
is", else the last number (:func:`selfspec.metrics.extract_number`).

Chat format (the default for instruct models; a deviation, docs/design/reproduction.md §6): each question is a
user turn asking for the reasoning and a last line ``#### <number>``, each exemplar an earlier
exchange whose reply is its solution; the reply is scored with the same number extraction.

Offline stand-in (labelled ``source: gsm-symbolic`` in each example's meta): problems drawn
from the GSM-Symbolic templates (Mirzadeh et al. 2024; 100 templates built from GSM8K test
problems) shipped in the ``reasoning-gym`` wheel (asset ``gsm-symbolic``). The package itself
is never imported (heavy dependencies): its two generator files are plain functions of a
``random.Random``, compiled here in isolation with their one package import
(``format_number``, ``is_integer``) replaced by the equivalents below. Sampling follows
reasoning-gym's ``GSMSymbolicDataset`` (template ``Random(seed).choices(tasks_ok)``, example
``i`` from ``Random(seed + i)``) with seed :data:`GSM_SYMBOLIC_SEED`, so example ``i`` is
reasoning-gym's example ``i`` without its answer-format suffix.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from random import Random
from typing import Any

from selfspec.metrics import extract_number
from selfspec.store.assets import asset_path
from selfspec.tasks.task import Example, Task, TaskDataError

GSM_SYMBOLIC_SEED = 42
GSM_SYMBOLIC_SIZE = 1319  # the size of the GSM8K test split
STDLIB_IMPORTS = {"math", "fractions", "random", "typing"}


class GSM8K(Task):
    name = "gsm8k"
    title = "GSM8K"
    score_column = ("accuracy", "Acc.")
    hub_id = "openai/gsm8k"
    asset = "gsm-symbolic"
    hub_config = "main"
    required = {"question": str, "answer": str}
    defaults = {"n_examples": 1000}
    paper_stop = ["\nQuestion:"]

    def offline_records(self) -> list[dict[str, Any]]:
        return gsm_symbolic_records(asset_path(self.asset), GSM_SYMBOLIC_SIZE)

    def make_example(self, record: dict[str, Any], index: int,
                     exemplars: list[dict[str, Any]]) -> Example:
        shots = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in exemplars)
        return Example(
            id=self.example_id(record, index),
            prompt=f"{shots}Question: {record['question']}\nAnswer:",
            reference=extract_number(record["answer"]),
            meta={"task": self.name, "shots": len(exemplars), "solution": record["answer"],
                  "source": record.get("source", self.cfg.source)},
        )

    def chat_messages(self, record: dict[str, Any], exemplars: list[dict[str, Any]],
                      example: Example) -> list[dict[str, str]]:
        turns: list[dict[str, str]] = []
        for r in exemplars:
            turns += [{"role": "user", "content": chat_question(r["question"])},
                      {"role": "assistant", "content": r["answer"]}]
        return turns + [{"role": "user", "content": chat_question(record["question"])}]

    def record_problem(self, record: dict[str, Any]) -> str | None:
        if extract_number(record["answer"]) is None:
            return "field 'answer' holds no final number (GSM8K solutions end in '#### <number>')"
        return None

    def postprocess(self, text: str) -> str:
        return super().postprocess(text).strip()

    def score(self, predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
        """Accuracy of the extracted final number."""
        from selfspec import metrics

        return metrics.gsm8k_accuracy(predictions, references)


def chat_question(question: str) -> str:
    """The chat format's request for one problem."""
    return (f"{question.strip()}\n\nSolve this step by step, then give the final answer on its own line "
            "as \"#### <number>\".")


def gsm_symbolic_records(folder: Path, size: int,
                         seed: int = GSM_SYMBOLIC_SEED) -> list[dict[str, Any]]:
    """``size`` GSM-Symbolic problems as GSM8K records (``question``, ``answer`` = solution)."""
    generators = load_generators(folder)
    tasks_ok = _tasks_ok(folder / "gsm_symbolic.py")
    records = []
    for i, template in enumerate(Random(seed).choices(tasks_ok, k=size)):
        problem = generators[template](Random(seed + i), 1.0)
        records.append({"id": f"gsm-symbolic-{i}", "question": problem["question"],
                        "answer": problem["metadata"]["answer_cot"], "source": "gsm-symbolic",
                        "template": template})
    return records


def load_generators(folder: Path) -> dict[int, Callable[[Random, float], dict[str, Any]]]:
    """The ``generate_<n>`` functions of ``generators_*.py``, without importing reasoning-gym."""
    generators = {}
    for file in sorted(folder.glob("generators_*.py")):
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        body = []
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == "reasoning_gym.utils":
                continue
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module] if isinstance(node, ast.ImportFrom) else [])
            if any(m.split(".")[0] not in STDLIB_IMPORTS for m in modules):
                raise TaskDataError(f"{file}, line {node.lineno}: unexpected import "
                                    f"{modules}; the GSM-Symbolic asset changed")
            body.append(node)
        tree.body = body
        namespace: dict[str, Any] = {"format_number": format_number, "is_integer": is_integer}
        exec(compile(tree, str(file), "exec"), namespace)  # pinned, sha256-checked asset
        generators.update({int(k.removeprefix("generate_")): v for k, v in namespace.items()
                           if k.startswith("generate_")})
    if not generators:
        raise TaskDataError(f"{folder}: no generators_*.py with generate_<n> functions")
    return generators


def _tasks_ok(file: Path) -> list[int]:
    """The templates reasoning-gym marks as working (its ``tasks_ok`` list)."""
    for node in ast.parse(file.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "tasks_ok"
                                                for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise TaskDataError(f"{file}: no tasks_ok list")


def format_number(num: int | float, max_decimals: int = 2, round_if_needed: bool = False) -> str:
    """reasoning_gym.utils.format_number: an int as is, else at most ``max_decimals``."""
    if isinstance(num, int) or float(num).is_integer():
        return str(int(num))
    result = f"{num:.{max_decimals}f}".rstrip("0").rstrip(".")
    if not round_if_needed and not math.isclose(float(result), num, rel_tol=1e-9):
        raise ValueError(f"Number {num} requires more than {max_decimals} decimals")
    return result


def is_integer(obj: Any) -> bool:
    """reasoning_gym.utils.is_integer."""
    if isinstance(obj, (int, float)):
        return isinstance(obj, int) or obj.is_integer()
    if isinstance(obj, Fraction):
        return obj.denominator == 1
    return False

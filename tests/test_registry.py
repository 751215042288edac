"""Issue 40: what a method or a task says about itself lives with it. A method's class carries its
title, the registry (``METHOD_MODULES``) its place in tables; a task's class its title and its score
column, the task registry its place. Nothing else keyed by their names defines them."""

from __future__ import annotations

from selfspec.decoding import METHOD_MODULES, decoder_class, method_rank, method_title
from selfspec.reporting.layouts import PAPER_TASKS, TASK_SCORE, TASK_TITLE, task_order
from selfspec.tasks import TASKS


def test_every_method_has_its_title_and_place_from_the_registry():
    for i, name in enumerate(METHOD_MODULES):
        cls = decoder_class(name)
        assert cls.name == name and cls.title, name
        assert method_title(name) == cls.title and method_rank(name) == i
    assert method_title("Medusa") == "Medusa"  # a paper's own row keeps its name, after every method
    assert method_rank("Medusa") == len(METHOD_MODULES)
    assert [method_title(n) for n in ("vanilla", "draft_verify", "del", "hf_generate")] == [
        "Vanilla", "Draft & Verify", "DEL", "HF generate"]


def test_every_task_has_its_title_and_score_from_its_class():
    assert list(TASKS) == ["xsum", "cnndm", "humaneval", "gsm8k", "mtbench"]  # the papers' order
    assert TASK_TITLE == {**{n: c.title for n, c in TASKS.items()}, **PAPER_TASKS}
    assert TASK_SCORE == {n: c.score_column for n, c in TASKS.items() if c.score_column}
    assert TASK_SCORE["gsm8k"] == ("accuracy", "Acc.") and "mtbench" not in TASK_SCORE
    assert [task_order(t) for t in ("xsum", "mtbench", "alpaca", "unknown")] == [0, 4, 5, 6]

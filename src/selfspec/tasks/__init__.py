"""Evaluation tasks: XSum, CNN/DM, HumanEval, GSM8K, MT-Bench (and ShareGPT for training).

    from selfspec.tasks import build_task, render
    task = build_task({"name": "xsum", "n_examples": 8})     # or build_task(cfg.task)
    for ex in task.examples():
        text = render(ex, tokenizer, task.cfg.use_chat_template)
        ...
    task.score([task.postprocess(g) for g in generations], [ex.reference for ex in task])
"""

from selfspec.tasks.sharegpt import iter_sharegpt
from selfspec.tasks.task import (TASKS, Example, Task, TaskConfig, TaskDataError, build_task,
                                 cut_at, get_task, model_chat, read_jsonl, read_records, render)

__all__ = ["TASKS", "Example", "Task", "TaskConfig", "TaskDataError", "build_task", "cut_at",
           "get_task", "iter_sharegpt", "model_chat", "read_jsonl", "read_records", "render"]

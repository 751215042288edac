"""Training jobs (``python -m selfspec.train job=<name>``): heads, prompts, skips, ppd_tree.

Each job module has ``prepare(cfg)`` — every config value checked and the job's data read, all
that can fail without a model — ``artefact_dir(cfg, opts)`` and ``run(cfg, opts, loaded)``;
:func:`selfspec.train.run_job` prepares before anything loads, so a typo never costs a model load.
"""

from __future__ import annotations

from typing import Any

from selfspec import checks
from selfspec.training.bars import bar  # noqa: F401 (the job modules' import, until they import it from bars)


def check_run(cfg) -> None:
    """The keys every job shares: conf/train.yaml's own, the model config and the logger."""
    from selfspec.models.loading import check_model_config
    from selfspec.tracking import check_logger

    checks.integer("seed", cfg.seed)
    checks.optional(checks.text, "artefact_dir", cfg.get("artefact_dir"),
                    why="null = outputs/artefacts/<kind>/<model>[-<task>]")
    check_model_config(cfg.model)
    check_logger(cfg.get("logger"))
    progress(cfg)


def progress(cfg) -> bool:
    """``progress`` (conf/train.yaml): whether the job shows tqdm bars (stderr, with an ETA)."""
    return checks.flag("progress", cfg.get("progress", True))


def job_keys(job, options: dict[str, Any]) -> None:
    """Refuse keys of a job config that the job does not read (its ``options``, the training
    loop's :class:`~selfspec.training.loop.TrainConfig` fields, ``name``)."""
    from dataclasses import fields

    from selfspec.training.loop import TrainConfig

    checks.known_keys("job", job, [*options, *(f.name for f in fields(TrainConfig)), "name"],
                      f"job {job.name} (conf/job/{job.name}.yaml)")


def task_names(key: str, value: Any) -> list[str]:
    """A list of task config names (conf/task/)."""
    from selfspec.config import group_options

    names = value if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig" else None
    if names is None:
        raise checks.refuse(key, value, "must be a list of task names, e.g. [xsum, cnndm]")
    return [checks.choice(f"{key}[{i}]", str(n), group_options("task"), why="a task of conf/task/")
            for i, n in enumerate(names)]

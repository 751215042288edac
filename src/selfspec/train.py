"""``python -m selfspec.train job=<name>``: train one artefact (heads, prompts, skips, ppd_tree, draft_vocab).

Each job is a module in :mod:`selfspec.training` declaring ``JOB``, a
:class:`~selfspec.training.driver.Job` (its artefact kind, ``prepare``, default directory, inputs
and objective); :func:`run_job` hands it to the one driver, :func:`selfspec.training.driver.run`
(prepare → lock → load → track → objective → save → report).
"""

from __future__ import annotations

import importlib
import logging

import hydra
from omegaconf import DictConfig

from selfspec.config import conf_dir
from selfspec.training import driver

log = logging.getLogger(__name__)

#: job name (conf/job/<name>.yaml) -> the module whose ``JOB`` it runs
JOBS = {
    "heads": "selfspec.training.head_distillation",
    "prompts": "selfspec.training.prompt_tuning",
    "skips": "selfspec.training.skips",
    "ppd_tree": "selfspec.training.ppd_tree",
    "draft_vocab": "selfspec.training.draft_vocab",
}


def job_named(name: str) -> driver.Job:
    """The :class:`~selfspec.training.driver.Job` of the job ``name`` (``conf/job/<name>.yaml``)."""
    if name not in JOBS:
        raise ValueError(f"unknown job {name!r}; choose one of {', '.join(sorted(JOBS))} (conf/job/)")
    return importlib.import_module(JOBS[name]).JOB


def job_of(cfg: DictConfig) -> driver.Job:
    """The :class:`~selfspec.training.driver.Job` of ``cfg.job.name``."""
    return job_named(str(cfg.job.name))


def prepare_job(cfg: DictConfig) -> dict:
    """Check the job's config and read its data, without loading the model."""
    return driver.prepare(job_of(cfg), cfg)


def run_job(cfg: DictConfig, loaded=None) -> dict:
    """Run the job; ``loaded``: a model already loaded from ``cfg.model`` (the demo shares one)."""
    return driver.run(job_of(cfg), cfg, loaded)


@hydra.main(config_path=str(conf_dir()), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    summary = run_job(cfg)
    log.info("job %s finished: %s", cfg.job.name, summary)


if __name__ == "__main__":
    import sys

    from selfspec.config import check_command_line

    check_command_line(sys.argv[1:], "train")
    main()

"""``python -m selfspec.train job=<name>``: train one artefact (heads, prompts, skips, ppd_tree, draft_vocab).

Each job is a module in :mod:`selfspec.training` declaring ``JOB``, a
:class:`~selfspec.training.driver.Job` (its artefact kind, ``prepare``, default directory, inputs
and objective); :func:`run_job` hands it to the one driver, :func:`selfspec.training.driver.run`
(prepare → lock → load → track → objective → save → report).
"""

from __future__ import annotations

import logging

import hydra
from omegaconf import DictConfig

from selfspec.config import conf_dir
from selfspec.config.registry import Registry
from selfspec.training import driver

log = logging.getLogger(__name__)

#: job name (conf/job/<name>.yaml) -> the ``JOB`` it runs (imported on first use; the one registry
#: style, :mod:`selfspec.config.registry`); its order is the memory table's and the order a fresh
#: model's jobs run in: a job after those whose artefacts it reads (the PPD tree after the prompts)
JOBS = Registry("job", {
    "heads": "selfspec.training.head_distillation:JOB",
    "prompts": "selfspec.training.prompt_tuning:JOB",
    "skips": "selfspec.training.skips:JOB",
    "ppd_tree": "selfspec.training.ppd_tree:JOB",
    "draft_vocab": "selfspec.training.draft_vocab:JOB",
}, lambda name, known: ValueError(f"unknown job {name!r}; choose one of {', '.join(known)} (conf/job/)"))


def job_named(name: str) -> driver.Job:
    """The :class:`~selfspec.training.driver.Job` of the job ``name`` (``conf/job/<name>.yaml``)."""
    return JOBS.lookup(name)


def job_of(cfg: DictConfig) -> driver.Job:
    """The :class:`~selfspec.training.driver.Job` of ``cfg.job.name``."""
    return job_named(str(cfg.job.name))


def prepare_job(cfg: DictConfig) -> dict:
    """Check the job's config and read its data, without loading the model."""
    return driver.prepare(job_of(cfg), cfg)[0]


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
    from selfspec.store.files import check_run_dir_argument

    check_run_dir_argument(sys.argv[1:])
    check_command_line(sys.argv[1:], "train")
    main()

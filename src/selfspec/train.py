"""``python -m selfspec.train job=<name>``: train one artefact (heads, prompts, skips, ppd_tree, draft_vocab).

Each job is a module in :mod:`selfspec.training` with ``prepare(cfg)`` (every config value
checked and the job's data read, without the model), ``artefact_dir(cfg, opts)`` (where it saves)
and ``run(cfg, opts, loaded) -> dict`` (its summary; ``loaded`` is a model the caller loaded from
``cfg.model``, else the job loads it). :func:`run_job` prepares, then owns the artefact directory
for the whole job (:mod:`selfspec.locks`: a second job into it is refused at once), then runs.
"""

from __future__ import annotations

import importlib
import logging

import hydra
from omegaconf import DictConfig

from selfspec.config import conf_dir

log = logging.getLogger(__name__)

#: job name -> module with ``run(cfg)``
JOBS = {
    "heads": "selfspec.training.heads",
    "prompts": "selfspec.training.prompts",
    "skips": "selfspec.training.skips",
    "ppd_tree": "selfspec.training.tree",
    "draft_vocab": "selfspec.training.draft_vocab",
}


def job_module(cfg: DictConfig):
    """The module of ``cfg.job.name``."""
    name = str(cfg.job.name)
    if name not in JOBS:
        raise ValueError(f"unknown job {name!r}; choose one of {', '.join(sorted(JOBS))} (conf/job/)")
    return importlib.import_module(JOBS[name])


def prepare_job(cfg: DictConfig):
    """Check the job's config and read its data, without loading the model."""
    return job_module(cfg).prepare(cfg)


def run_job(cfg: DictConfig, loaded=None) -> dict:
    """Run the job; ``loaded``: a model already loaded from ``cfg.model`` (the demo shares one)."""
    from selfspec.locks import artefact_lock, hold
    from selfspec.tracking import check_writable, hydra_output_dir, open_run_log

    module = job_module(cfg)
    opts = module.prepare(cfg)  # config and data checked before anything is locked or loaded
    out = module.artefact_dir(cfg, opts)
    with hold(artefact_lock(out), f"artefact directory {out}"):
        check_writable(out.parent, "the artefact (artefact_dir=...)")
        run_dir = hydra_output_dir()
        if run_dir is not None:
            open_run_log(run_dir)
        return module.run(cfg, opts, loaded)


@hydra.main(config_path=str(conf_dir()), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    summary = run_job(cfg)
    log.info("job %s finished: %s", cfg.job.name, summary)


if __name__ == "__main__":
    main()

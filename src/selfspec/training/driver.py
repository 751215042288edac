"""The training job driver: one skeleton behind every ``python -m selfspec.train job=<name>``.

A job module declares a :class:`Job`: what only it knows — the artefact kind it writes, how it
checks its config and reads its data (``prepare``), where its artefact goes by default, the
artefacts it reads, and its ``objective`` (training, a search or statistics):
``objective(Context) -> Result``. :func:`run` does the rest, the same for every job:

1. **prepare**: the keys every job shares (:func:`check_run`), then ``job.prepare(cfg)`` — every
   config value checked and the job's data read — so a typo never costs a model load; then the
   job's estimated peak memory against the device's (:func:`selfspec.measure.peak.check_fits`: a job
   that cannot fit is refused before its model loads; ``memory_check=false`` skips it);
2. **lock**: the artefact directory is owned for the whole job (:mod:`selfspec.store.locks`: a second
   job into it is refused at once), its parent checked writable, the Hydra job log opened;
3. **load**: the model of ``cfg.model`` (or the one the caller loaded from it: the demo shares one);
4. **track**: a tracker run (``job.tracker_job``), with the artefacts it reads declared (lineage);
5. **objective**: the job's own work, returning a :class:`Result`;
6. **save**: ``Result.tensors`` and ``meta.json`` (:func:`selfspec.store.artefacts.save_artefact`, the
   job config as ``train_config``), ``Result.files`` copied in, ``Result.checkpoint`` removed;
7. **report**: tracker tables, summary and the artefact (output lineage), one log line, and the
   summary returned: ``{"artefact": <path>, **Result.summary}``.
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from omegaconf import OmegaConf

from selfspec.config import checks
from selfspec.measure.peak import MemoryModel

log = logging.getLogger(__name__)


def no_inputs(opts: dict) -> list[tuple[Path, str]]:
    """A job that reads no artefact."""
    return []


def unpriced(cfg) -> str | None:
    """A job that prices nothing with the run's cost profile."""
    return None


@dataclass(frozen=True)
class Job:
    """One training job: only its own objective and data."""

    #: the artefact kind it writes (``meta.json``'s ``kind``; the tracker's artefact type)
    kind: str
    #: the tracker run's job type (``train-heads``, ``skips``, ...)
    tracker_job: str
    #: ``prepare(cfg) -> opts``: every ``job.*`` key checked and the data read, without a model
    prepare: Callable[[Any], dict]
    #: ``default_dir(cfg, opts) -> Path``: where the artefact goes when ``artefact_dir`` is null
    default_dir: Callable[[Any, dict], Path]
    #: ``objective(ctx) -> Result``: the job's own work on the loaded model
    objective: Callable[["Context"], "Result"]
    #: what the job says about its peak memory (its terms, fitted factors, fallbacks), checked
    #: against the device's before the model loads (:func:`selfspec.measure.peak.check_fits`)
    memory: MemoryModel
    #: ``inputs(opts) -> [(path, kind)]``: the artefacts it reads (input lineage)
    inputs: Callable[[dict], list[tuple[Path, str]]] = no_inputs
    #: ``job.*`` keys a rerun may change over a finished artefact because the job continues from it
    #: (the skip search: more ``iterations`` extend its trace); see :func:`check_finished`
    extendable: tuple[str, ...] = ()
    #: ``prices(cfg) -> setting | None``: the job's setting that prices passes with the run's cost
    #: profile (:attr:`Context.profile`), named when ``profile=null`` is refused, before the job's own
    #: keys are checked (:func:`prepare`)
    prices: Callable[[Any], str | None] = unpriced


@dataclass(frozen=True)
class Context:
    """What an objective works with."""

    cfg: Any  # the composed conf/train.yaml
    opts: dict  # ``job.prepare(cfg)``
    loaded: Any  # the LoadedModel of ``cfg.model``
    out: Path  # the artefact directory (owned by this job)
    tracker: Any  # the tracker run (selfspec.tracking)
    progress: bool  # ``progress``: show tqdm bars
    scratch: Path  # an empty directory for files to place into the artefact (removed after the job)
    #: ``profile`` as :func:`check_run` resolved it (None, ``auto`` or a profile file): once per run
    profile_spec: str | None = None

    @property
    def seed(self) -> int:
        return int(self.cfg.seed)

    @functools.cached_property
    def profile(self):
        """The run's cost profile (``profile``: this machine's for ``auto``, found or measured once,
        :func:`selfspec.evaluation.profiling.run_profile`): what a job that prices passes reads (the
        skip search's cost model, the PPD tree job's ``L_fp(n)``, the draft vocabulary's head costs).
        A job that needs it (:attr:`Job.prices`) refuses ``profile=null`` before the model loads."""
        from selfspec.evaluation.profiling import run_profile

        profile = run_profile(self.profile_spec, self.loaded.model)
        if profile is None:
            raise ValueError(f"job={self.cfg.job.name} prices its passes with a cost profile: set profile=auto")
        return profile

    @property
    def ckpt_dir(self) -> Path:
        """A training loop's checkpoints: ``.<artefact name>.ckpt`` beside the artefact."""
        return self.out.with_name(f".{self.out.name}.ckpt")


@dataclass
class Result:
    """What an objective gives the driver to save and report."""

    tensors: dict[str, torch.Tensor]  # the artefact's tensors.safetensors
    metrics: dict[str, Any]  # meta.json's ``metrics``
    summary: dict[str, Any]  # returned after ``artefact`` and the tracker run's summary
    meta: dict[str, Any] = field(default_factory=dict)  # meta.json's own fields of this kind
    task: str | None = None  # meta.json's ``task``
    tables: dict[str, list[dict]] = field(default_factory=dict)  # tracker tables by name
    files: dict[str, Path] = field(default_factory=dict)  # name in the artefact directory -> file to copy
    checkpoint: Path | None = None  # a training checkpoint directory, removed once the artefact is saved


# --- prepare ---------------------------------------------------------------------------------
def shows_progress(cfg) -> bool:
    """``progress`` (conf/train.yaml): whether the job shows tqdm bars (stderr, with an ETA)."""
    return checks.flag("progress", cfg.progress)


def check_run(cfg) -> str | None:
    """The keys every job shares: conf/train.yaml's own (and no other top-level key), the model config
    and the logger; returns ``profile`` resolved (:func:`selfspec.evaluation.profiling.profile_spec`),
    once per run."""
    from selfspec.config import check_primary_keys
    from selfspec.evaluation.profiling import profile_spec
    from selfspec.models.loading import check_model_config
    from selfspec.tracking import check_logger

    check_primary_keys(cfg, "train")
    checks.seed("seed", cfg.seed)
    spec = profile_spec(cfg)  # a profile that is not there stops every job, whether it prices passes or not
    checks.optional(checks.text, "artefact_dir", cfg.artefact_dir,
                    why="null = outputs/artefacts/<kind>/<model>[-<task>]")
    check_model_config(cfg.model)
    checks.flag("memory_check", cfg.memory_check)
    check_logger(cfg.logger)
    shows_progress(cfg)
    return spec


def job_keys(job, keys: Iterable[str]) -> None:
    """Refuse keys of a job config that the job does not read (``keys``, and ``name``)."""
    checks.known_keys("job", job, [*keys, "name"], f"job {job.name} (conf/job/{job.name}.yaml)")


#: a timing key a job no longer reads, refused with what replaced it: the run's cost profile
TIMED_BY_PROFILE = "profile (the job prices its passes with this machine's cost profile, measured once)"


def task_names(key: str, value: Any) -> list[str]:
    """A list of task config names (conf/task/)."""
    from selfspec.config import group_options

    names = value if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig" else None
    if names is None:
        raise checks.refuse(key, value, "must be a list of task names, e.g. [xsum, cnndm]")
    return [checks.choice(f"{key}[{i}]", str(n), group_options("task"), why="a task of conf/task/")
            for i, n in enumerate(names)]


def prepare(job: Job, cfg) -> tuple[dict, str | None]:
    """Check the shared keys and the job's config, and read its data, without loading the model;
    returns the job's options and the run's ``profile`` resolved. ``profile=null`` is refused for a
    job that prices its passes with it (:attr:`Job.prices`), naming the job's setting."""
    spec = check_run(cfg)
    what = job.prices(cfg)
    if what is not None and spec is None:
        raise checks.refuse("profile", None, "auto, a profile file or a shipped profile's name",
                            f"{what} prices its passes with this machine's cost profile")
    return job.prepare(cfg), spec


def artefact_dir(job: Job, cfg, opts: dict) -> Path:
    """``artefact_dir``, else the job's default location."""
    return Path(cfg.artefact_dir) if cfg.artefact_dir else job.default_dir(cfg, opts)


# --- run -------------------------------------------------------------------------------------
def run(job: Job, cfg, loaded=None) -> dict:
    """Prepare, lock, load, track, run the objective, save, report; the job's summary."""
    from selfspec.measure.peak import check_fits
    from selfspec.models.loading import model_for
    from selfspec.store.files import check_directory, check_writable
    from selfspec.store.locks import artefact_lock, hold
    from selfspec.tracking import hydra_output_dir, open_run_log, start_run

    opts, profile_spec = prepare(job, cfg)  # config and data checked before anything is locked or loaded
    if loaded is None:  # its estimated peak checked against the device's memory before the model loads
        check_fits(str(cfg.job.name), job.memory, cfg)
    out = artefact_dir(job, cfg, opts)
    check_directory(out, "artefact_dir")  # before its lock file is made beside it
    with hold(artefact_lock(out), f"artefact directory {out}"):
        check_writable(out.parent, "the artefact (artefact_dir=...)")
        check_finished(out, job, cfg)
        run_dir = hydra_output_dir()
        if run_dir is not None:
            open_run_log(run_dir)
        loaded = model_for(cfg.model, loaded)
        tracker = start_run(cfg, job_type=job.tracker_job)
        for path, kind in job.inputs(opts):
            tracker.use_artifact(path, kind=kind)
        with tempfile.TemporaryDirectory(prefix="selfspec-job-") as scratch:
            ctx = Context(cfg, opts, loaded, out, tracker, shows_progress(cfg), Path(scratch), profile_spec)
            result = job.objective(ctx)
            path = save(job, ctx, result)
        summary = {"artefact": str(path), **result.summary}
        for name, rows in result.tables.items():
            tracker.table(name, rows)
        tracker.summary(summary)
        tracker.log_artifact(path, kind=job.kind)
        tracker.finish()
        log.info("%s artefact -> %s", job.kind, path)
        return summary


def check_finished(out: Path, job: Job, cfg) -> None:
    """Refuse to replace a finished artefact trained with other settings (issue 39: a rerun with
    another ``job.lr`` replaced it without a word), naming each change as a resumed run's refusal
    does (:func:`selfspec.training.loop.check_resume`): the model and every job setting but those that
    only change the logging (:data:`~selfspec.training.loop.RESUMABLE`) and those the job continues
    from (:attr:`Job.extendable`). The same settings train it again."""
    from selfspec.store.artefacts import ArtefactError, read_meta
    from selfspec.store.files import to_jsonable
    from selfspec.training.loop import RESUMABLE, changed_settings

    if not (out / "meta.json").exists():
        return
    meta = read_meta(out)
    now = to_jsonable(OmegaConf.to_container(cfg.job, resolve=True))
    changed = changed_settings(meta.get("train_config") or {}, now, RESUMABLE + job.extendable, "job.")
    if meta.get("model") != str(cfg.model.name):
        changed.insert(0, f"model: {meta.get('model')!r} -> {str(cfg.model.name)!r}")
    if changed:
        raise ArtefactError(f"artefact_dir={out} holds a finished {meta.get('kind', job.kind)} artefact trained with "
                            f"other settings ({'; '.join(changed)}): write to another artefact_dir, or delete {out} "
                            "to replace it")


def save(job: Job, ctx: Context, result: Result) -> Path:
    """Write the artefact (atomically), copy the result's files into it, remove its checkpoint."""
    from selfspec.models.kernels import paths
    from selfspec.store.artefacts import save_artefact

    path = save_artefact(ctx.out, job.kind, result.tensors, ctx.loaded, task=result.task,
                         train_config=ctx.cfg.job, metrics=result.metrics, extra=result.meta,
                         kernel_paths=paths())
    for name, source in result.files.items():
        shutil.copy2(source, path / name)
    if result.checkpoint is not None:
        from selfspec.training.loop import clear_checkpoint

        clear_checkpoint(result.checkpoint)
    return path

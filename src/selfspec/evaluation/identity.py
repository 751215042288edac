"""A run directory's record: what its results depend on, the refusal of a rerun that differs, and lineage.

Each finished generation is appended to ``results.jsonl`` at once (an interrupted run keeps it; a re-run
into the same directory skips it: :func:`progress`). A re-run whose model, task, sampling, budget,
methods or number of samples differ (:func:`run_identity`, recorded in ``run_config.json``), or whose
model, data or artefact files hold other bytes (their digests: the identity's ``inputs``,
:func:`check_artefacts`), is refused (:class:`ResumeMismatch`) before anything in the directory
changes; ``run_config.json`` (and Hydra's ``.hydra/``) are written only once a run really starts
(:func:`begin`). The artefacts the methods read are the run's input lineage (:func:`artefact_digests`,
declared to the tracker by :func:`declare_lineage`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from selfspec.evaluation.aggregate import generation_key
from selfspec.evaluation.plan import MethodRun, RunPlan
from selfspec.store.artefacts import artefact_digest
from selfspec.store.files import to_jsonable, write_json
from selfspec.tracking import ResultsFile, Tracker, open_run_log, save_hydra_files

log = logging.getLogger(__name__)

RESULTS = "results.jsonl"
SUMMARY = "summary.json"
RUN_CONFIG = "run_config.json"
#: what every line of results.jsonl holds (:class:`~selfspec.tracking.ResultsFile` refuses other lines)
ROW_KEYS = ("id", "method", "tokens", "seconds")
#: config keys whose change makes earlier rows of a run directory incomparable
_RESUME_KEYS = ("model", "task", "sampling", "max_new_tokens", "baseline", "methods", "n_samples", "batch_size")
#: a resume key's value in a run record of the format before this one, which predates the key
_RESUME_DEFAULTS = {"batch_size": 1}


class ResumeMismatch(ValueError):
    """The run directory holds results of a different configuration."""


def run_identity(cfg: DictConfig, plan: RunPlan) -> dict[str, Any]:
    """What a run directory's results depend on (``run_config.json``): a rerun into it must match
    (:func:`check_resume`); ``n_examples`` is left out, so a run may grow or shrink its selection.
    A sampled run's ``sampling`` also names how tokens are drawn (:data:`~selfspec.decoding.sampling.DRAW`).
    ``inputs`` holds the content digests of the files read, by path: the model's
    (:func:`~selfspec.models.loading.source_digests`), the task's data
    (:meth:`~selfspec.tasks.Task.data_digests`) and, where a method reads another model (a separate draft
    model: :meth:`~selfspec.decoding.base.Decoder.models_read`), that model's, by config name."""
    from selfspec.config import model_config
    from selfspec.decoding import decoder_class
    from selfspec.decoding.sampling import DRAW
    from selfspec.models.loading import source_digests

    inputs = {"model": source_digests(cfg.model), "data": plan.task.data_digests()}
    others = sorted({name for label, options in plan.method_options.items()
                     for name in decoder_class(str(plan.method_cfgs[label].name)).models_read(options)})
    if others:
        inputs["models"] = {name: source_digests(model_config(name)) for name in others}
    # a sampled run's tokens depend on how a seed becomes tokens too (a run drawn by torch.multinomial,
    # before this record held the draw, is not resumed by one drawn otherwise)
    sampling = OmegaConf.to_container(cfg.sampling, resolve=True) | ({} if plan.sampling.greedy else {"draw": DRAW})
    return to_jsonable({"model": cfg.model, "task": OmegaConf.to_container(cfg.task, resolve=True)
                        | {"n_examples": None}, "sampling": sampling, "max_new_tokens": plan.budget,
                        "baseline": next(iter(plan.method_cfgs)), "methods": plan.method_cfgs,
                        "n_samples": plan.n_samples, "batch_size": plan.batch_size, "inputs": inputs})


def check_resume(out_dir: Path, identity: dict[str, Any]) -> None:
    """Refuse a run directory this run may not write to. Reads only: a refused rerun leaves the
    directory exactly as it was.

    The files the runner writes must be regular files with one link (:func:`~selfspec.store.files.not_plain`):
    appending through a symlink or a hard link would change a file the framework did not write, and
    reading a FIFO waits forever. A non-empty ``results.jsonl`` is resumed only
    with the framework's own record of the run that wrote it (``run_config.json``), and only when
    that record matches ``identity`` on :data:`_RESUME_KEYS`."""
    import json
    import os

    from selfspec.store.files import not_plain

    for name in (RESULTS, RUN_CONFIG, SUMMARY):
        path = out_dir / name
        why = os.path.lexists(path) and not_plain(os.lstat(path))
        if why:
            raise ResumeMismatch(f"{path} {why}; selfspec writes only files it created there: "
                                 "evaluate into a new run directory (hydra.run.dir=...)")
    results, record = out_dir / RESULTS, out_dir / RUN_CONFIG
    if not results.exists() or results.stat().st_size == 0:
        return
    if not record.exists():
        raise ResumeMismatch(
            f"{results} was not written by a selfspec run (no {RUN_CONFIG} records one); selfspec resumes only "
            "its own results: evaluate into a new run directory (hydra.run.dir=...)")
    try:
        before = json.loads(record.read_text())
    except (OSError, ValueError) as err:
        raise ResumeMismatch(f"{record} is unreadable ({err}); evaluate into a new run directory "
                             "(hydra.run.dir=...)") from None
    if not isinstance(before, dict):
        raise ResumeMismatch(f"{record} is not a selfspec run record; evaluate into a new run directory "
                             "(hydra.run.dir=...)")
    changed = [k for k in _RESUME_KEYS if before.get(k, _RESUME_DEFAULTS.get(k)) != identity.get(k)]
    if changed:
        raise ResumeMismatch(
            f"{out_dir} holds results of a different configuration (changed: {', '.join(changed)}); "
            "evaluate into a new run directory (hydra.run.dir=...)")
    _check_inputs(out_dir, before.get("inputs"), identity["inputs"], record)
    ResultsFile(results, ROW_KEYS).check()


def _check_inputs(out_dir: Path, before: dict[str, dict[str, str]] | None, now: dict[str, dict[str, str]],
                  record: Path) -> None:
    """Refuse to resume over files whose bytes changed since the run's first examples (``inputs``:
    ``{"model"|"data": {path: digest}}``, :func:`run_identity`), naming the file and both digests (issue 68: a
    GGUF replaced at its path, or an edited data file, was mixed into the resumed run). A record from
    before inputs were recorded is resumed, and said in the log."""
    if before is None:
        log.info("%s predates input digests in run records: its model and data files cannot be compared with "
                 "these", record)
        return
    for kind, files in now.items():
        was = before.get(kind) or {}
        for path in sorted(set(was) | set(files)):
            old, new = was.get(path), files.get(path)
            if old == new:
                continue
            what = (f"changed since its first examples (sha256 {old[:16]} then, {new[:16]} now)" if old and new
                    else "is new" if new else "is gone")
            raise ResumeMismatch(
                f"{out_dir} holds results decoded with other {kind} files: {kind} file {path} {what}; evaluate "
                "into a new run directory (hydra.run.dir=...), or restore the file the run began with")


def check_artefacts(out_dir: Path, artefacts: dict[str, dict[str, str]]) -> None:
    """Refuse to resume results written with other artefacts than these (``{method: {path: digest}}``,
    :func:`~selfspec.store.artefacts.artefact_digest`): a skip set searched again, or heads trained
    again, at the same path would otherwise mix two artefacts' results under one method's name.
    Reads only, after the decoders are built (they resolve the artefacts) and before anything is
    written. A record from before artefacts were recorded is resumed, and said in the log."""
    import json

    results, record = out_dir / RESULTS, out_dir / RUN_CONFIG
    if not results.exists() or results.stat().st_size == 0 or not record.exists():
        return
    before = json.loads(record.read_text()).get("artefacts")
    if before is None:
        log.info("%s predates artefact digests in run records: its artefacts cannot be compared with these", record)
        return
    for method, paths in artefacts.items():
        for path, digest in paths.items():
            was = (before.get(method) or {}).get(path)
            if was != digest:
                raise ResumeMismatch(
                    f"{out_dir} holds results {method} decoded with {'another' if was else 'no'} artefact at {path} "
                    f"(digest {was or 'none'}, now {digest}: trained or searched again since); evaluate into a new "
                    "run directory (hydra.run.dir=...)")


def begin(out_dir: Path, identity: dict[str, Any], cfg: DictConfig) -> None:
    """Record the run in its directory once it really starts (model loaded, decoders built):
    ``run_config.json``, what a rerun must match, and inside ``@hydra.main`` Hydra's ``.hydra/``
    (conf/evaluate.yaml leaves it to this) and the job's log file (:func:`~selfspec.tracking.open_run_log`).
    A run that fails or is refused before leaves none of them."""
    write_json(out_dir / RUN_CONFIG, identity)
    save_hydra_files(out_dir, cfg)
    open_run_log(out_dir)


def _artefact_paths(run: MethodRun) -> list[Path]:
    """Artefact directories a method reads: config values naming one, and ``decoder.artefacts``."""
    found: list[Path] = []
    values = list(OmegaConf.to_container(run.cfg, resolve=True).values())
    extra = getattr(run.decoder, "artefacts", None)
    if isinstance(extra, dict):
        values += list(extra.values())
    for v in values:
        p = getattr(v, "path", v)
        if isinstance(p, (str, Path)) and str(p) and Path(p).is_dir() and (Path(p) / "meta.json").exists():
            found.append(Path(p).resolve())
    return sorted(set(found))


def artefact_digests(runs: list[MethodRun]) -> dict[str, dict[str, str]]:
    """Per method, the artefact directories it reads and their content digests
    (:func:`~selfspec.store.artefacts.artefact_digest`): ``{method: {path: digest}}``."""
    return {r.name: {str(p): artefact_digest(p) for p in _artefact_paths(r)} for r in runs}


def declare_lineage(tracker: Tracker, artefacts: dict[str, dict[str, str]]) -> None:
    """Every artefact the run reads, declared to the tracker as its input (lineage)."""
    for paths in artefacts.values():
        for p in paths:
            tracker.use_artifact(p)


def progress(results: ResultsFile, ids: set, examples, runs: list[MethodRun], n_samples: int) -> tuple[set, list]:
    """The generations the results file already holds, as ``(id, sample, method)``, and the
    examples with one still to do. Rows of examples outside this run's selection ``ids`` (a rerun
    with a smaller ``n_examples``) stay in the file but take no part."""
    done = {(*generation_key(r), r["method"]) for r in results if str(r["id"]) in ids}
    todo = [ex for ex in examples if any((ex.id, i, r.name) not in done for i in range(n_samples) for r in runs)]
    return done, todo


def resume_record(out_dir: Path, runs: list[MethodRun], n_examples: int, n_todo: int, n_done: int,
             n_samples: int) -> dict[str, Any]:
    """A resumed run's record (``summary.json``: ``resumed``) and its warning: the generations an earlier
    process finished (``n_done`` of every method's ``n_examples`` × ``n_samples``; issue 68: "0 of 6 examples
    were finished" was said with rows of 4 kept) and the examples every method finished, and per method the
    state it carries from one example to the next (:meth:`~selfspec.decoding.base.Decoder.carried`), which
    starts afresh in this process (issue 52: a resumed SWIFT run restarted its layer search without a word)."""
    before = n_examples - n_todo
    restarted = {r.name: r.decoder.carried() for r in runs if r.decoder.carried()}
    total = n_examples * n_samples * len(runs)
    log.info("resuming %s: %d of %d generations already in its results (%d of %d examples finished by every "
             "method)", out_dir, n_done, total, before, n_examples)
    if restarted:
        log.warning("resuming: %d of %d generations were finished by an earlier process; the state these methods "
                    "carry from one example to the next starts afresh here, so the examples after differ from an "
                    "uninterrupted run's: %s", n_done, total,
                    "; ".join(f"{name} ({', '.join(what)})" for name, what in restarted.items()))
    return {"examples_before": before, "generations_before": n_done, "restarted": restarted}


__all__ = ["RESULTS", "ROW_KEYS", "RUN_CONFIG", "SUMMARY", "ResumeMismatch", "artefact_digests", "begin",
           "check_artefacts", "check_resume", "declare_lineage", "progress", "resume_record", "run_identity"]

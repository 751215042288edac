"""The evaluation runner: the chosen methods on the same examples, warm-up first, interleaved.

docs/design.md §2.6 and §3 (Spec-Bench's conventions): one process, one runtime, batch size 1;
``warmup`` generations per method before anything is timed; then per example the baseline, the
method under test and the comparison methods run back to back (interleaved, so slow drifts of the
machine hit every method alike), after one untimed prompt step of the example by the baseline (so
the first of them does not pay for a prompt the others find warm: :func:`_settle`). Each finished generation is appended to ``results.jsonl`` at
once (an interrupted run keeps it; a re-run into the same directory skips it), and
``summary.json`` is rewritten from all rows at the end. A re-run whose model, task, sampling,
budget, methods or number of samples differ, or whose model, data or artefact files hold other bytes
(their digests: :func:`_identity`'s ``inputs``, :func:`_check_artefacts`), is refused (:class:`ResumeMismatch`)
before anything in the directory changes; ``run_config.json`` (and Hydra's ``.hydra/``) are written only once
a run really starts.

Bad input stops before the model loads: every config value (run options, sampling, task, each
method's options, the model config, the logger) is checked, whether the task can be scored here
(HumanEval: whether bubblewrap can isolate its programs, ``task.isolation``), and the task's
examples are read and checked first (:func:`prepare`), so a typo never costs a model load.

``n_samples`` > 1 (sampling only) generates each example that many times per method, sample ``i``
seeded ``sampling.seed + i`` for every method (recorded in each row with its ``sample`` index);
speedup and τ pool all samples, the task's metric scores each example's samples together
(HumanEval: pass@1 and pass@10), and a task with its own samples format (HumanEval's
``task_id``/``completion``) gets ``samples-<method>.jsonl`` per method.

    summary = evaluate(cfg, out_dir)       # cfg: conf/evaluate.yaml composed
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from selfspec.config import check_primary_keys, checks, load_method_config
from selfspec.config.options import Options
from selfspec.decoding import Decoder, Sampling, build_decoder, check_method, decoder_class
from selfspec.evaluation.aggregate import (batch_contention, common_rows, contention, generation_key, spoiled_generations,
                                         summarize)
from selfspec.evaluation.profiling import profile_spec, run_profile
from selfspec.measure.peak import (EVAL_CONTEXT, MemoryModel, Shape, Term, check_fits, layer_bytes, scores_bytes,
                                   shape_of)
from selfspec.measure.profile import machine, model_shape
from selfspec.models.capture import BUCKETS, MAX_GRAPHS
from selfspec.store.artefacts import artefact_digest
from selfspec.store.files import check_directory, check_writable, to_jsonable, write_json
from selfspec.store.locks import hold
from selfspec.tracking import ResultsFile, Tracker, open_run_log, save_hydra_files, start_run

log = logging.getLogger(__name__)

RESULTS = "results.jsonl"
SUMMARY = "summary.json"
#: the format of the run records this selfspec writes (summary.json's ``format``); which formats are
#: read: :data:`selfspec.reporting.records.RUN_FORMATS` (docs/design.md, "Formats read")
RUN_FORMAT = 2
RUN_CONFIG = "run_config.json"
#: what every line of results.jsonl holds (:class:`~selfspec.tracking.ResultsFile` refuses other lines)
ROW_KEYS = ("id", "method", "tokens", "seconds")
#: config keys whose change makes earlier rows of a run directory incomparable
_RESUME_KEYS = ("model", "task", "sampling", "max_new_tokens", "baseline", "methods", "n_samples", "batch_size")
#: a resume key's value in a run record of the format before this one, which predates the key
_RESUME_DEFAULTS = {"batch_size": 1}


# --- memory (selfspec.measure.peak) ----------------------------------------------------------------
def memory_terms(s: Shape, cfg, b: int, context: int, prompt: int | None) -> list[list[Term]]:
    """The caches of ``batch_size`` sequences as long as the longest (``context``: prompt and new tokens)
    and their prompts' prefills (``prompt`` rows each; the whole context when not given): a batch keeps a
    cache per sequence, and in bfloat16 its prefills may run as one pass (issue 68: without the batch
    factor, B caches passed the check and failed after the load); and the quantised copies of the weights
    the methods' drafts read (``draft_weights``: every linear and the LM head, held beside the target's)."""
    prompt = context if prompt is None else min(prompt, context)
    batch = int(cfg.batch_size)
    also = " or batch_size" if batch > 1 else ""
    copies = [Term(f"the {fmt} copy of the weights", draft_copy_bytes(s, fmt), "method.draft_weights")
              for fmt in sorted({str(m.draft_weights) for m in method_configs(cfg).values()
                                 if m.get("draft_weights") is not None})]
    return [[
        Term("cache", context * s.kv_per_token * b * batch,
             ("max_new_tokens" if context - prompt > prompt else "the task's prompts (or max_new_tokens)") + also),
        Term("prefill", (layer_bytes(s, prompt, b) + scores_bytes(s, prompt, prompt, b) + s.vocab * 4) * batch,
             "the task's prompts" + also),
        *copies,
    ]]


def draft_copy_bytes(s: Shape, fmt: str) -> int:
    """Bytes of a quantised copy (:mod:`selfspec.models.quantised`) of a model of shape ``s``: every
    decoder layer's linears and the LM head (the embedding and the norms stay the target's)."""
    from selfspec.models.quantised import packed_bytes

    layer_weights = s.params - s.vocab * s.hidden * (1 if s.tied else 2) - s.hidden
    return packed_bytes(fmt, 1, s.hidden) * (layer_weights // s.hidden + s.vocab)


#: an evaluation's memory (fitted by ``scripts/measure_memory.py --fit``, docs/memory_measured.json)
MEMORY = MemoryModel(memory_terms, s=1.0, runtime=497863884.8)
#: an evaluation's job name: its entry point's and primary config's (``python -m selfspec.evaluate``,
#: conf/evaluate.yaml), in memory estimates (:mod:`selfspec.memory`) and its tracker run
JOB = "evaluate"


class ResumeMismatch(ValueError):
    """The run directory holds results of a different configuration."""


@dataclass
class MethodRun:
    """One method of the run: its label (config file name), resolved config and built decoder."""

    name: str
    cfg: DictConfig
    decoder: Decoder



def method_label(cfg: DictConfig) -> str:
    """The run's label of ``cfg.method``: its config file name (``method=<label>``).

    Variants share a decoder (``draft_verify_static`` has ``name: draft_verify``), so results are
    labelled by config file. Read from Hydra's choices inside ``@hydra.main``, else ``cfg.method.name``.
    """
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        choice = HydraConfig.get().runtime.choices.get("method")
        if choice:
            return str(choice)
    return str(cfg.method.name)


def method_configs(cfg: DictConfig, label: str | None = None) -> dict[str, DictConfig]:
    """Label -> resolved config of the baseline, the method under test and ``compare``, in run order.

    ``baseline`` and ``compare`` name files of ``conf/method/``; their interpolations resolve
    against the run's config, as if composed as ``method=<name>``. A label given twice runs once.
    """
    label = label or method_label(cfg)
    compare = cfg.get("compare") or []
    names = [str(cfg.baseline), label] + [str(c) for c in ([compare] if isinstance(compare, str) else compare)]
    out: dict[str, DictConfig] = {}
    for name in names:
        if name in out:
            continue
        m = cfg.method if name == label else load_method_config(name)
        root = OmegaConf.to_container(cfg, resolve=False)
        root["method"] = OmegaConf.to_container(m, resolve=False)
        out[name] = OmegaConf.create(OmegaConf.to_container(OmegaConf.create(root), resolve=True))["method"]
    return out


def _budget(cfg: DictConfig, task) -> int:
    n = cfg.get("max_new_tokens")
    if n is None:
        return task.cfg.max_new_tokens
    return checks.integer("max_new_tokens", n, 1, why="null = the task's max_new_tokens")


def _task(cfg: DictConfig):
    from selfspec.tasks import build_task, model_chat

    chat = model_chat(cfg)
    n = cfg.get("n_examples")
    if n is None:
        return build_task(cfg.task, model_chat=chat)
    return build_task(cfg.task, model_chat=chat,
                      n_examples=checks.integer("n_examples", n, 1, why="null = the task's n_examples"))


def _n_samples(cfg: DictConfig, sampling: Sampling) -> int:
    """``n_samples``: generations per example and method; more than one only under sampling."""
    n = checks.integer("n_samples", cfg.n_samples, 1, why="generations per example and method")
    if n > 1 and sampling.greedy:
        raise checks.refuse("n_samples", n, "must be 1 under greedy decoding (sampling.temperature=0), whose "
                            "samples are all identical", why="set sampling.temperature > 0 to draw several samples")
    return n


def sample_sampling(sampling: Sampling, index: int) -> Sampling:
    """The sampling settings of sample ``index``: seed ``sampling.seed + index``, the same for every method."""
    return replace(sampling, seed=sampling.seed + index)


def _check_run_options(cfg: DictConfig) -> str | None:
    """The keys of conf/evaluate.yaml read outside the groups (``n_examples`` and
    ``max_new_tokens`` are checked where they are read), after a top-level key it does not have; returns
    ``profile`` resolved (:func:`~selfspec.evaluation.profiling.profile_spec`), once per run."""
    check_primary_keys(cfg, "evaluate")
    checks.seed("seed", cfg.seed)
    checks.integer("warmup", cfg.warmup, 0, why="untimed generations per method")
    checks.integer("warmup_max_new_tokens", cfg.warmup_max_new_tokens, 1)
    checks.flag("progress", cfg.progress)
    checks.flag("memory_check", cfg.memory_check)
    checks.number("contention", cfg.contention, 1.0, low_open=True,
                  why="the baseline's measured / predicted time that flags a run as measured under load")
    checks.number("contention_spike", cfg.contention_spike, 1.0, low_open=True,
                  why="a generation's measured / predicted time, over its method's median and its example's least, "
                      "that flags it as spoiled")
    profile = profile_spec(cfg)
    _threads_spec(cfg, profile)
    _batch_size(cfg)
    return profile


def _batch_size(cfg: DictConfig) -> int:
    """``batch_size``: sequences decoded at once (:mod:`selfspec.evaluation.batches`). More than one is
    refused before the model loads where a batch cannot run: passes at static shapes (``model.capture``
    resolving to static or graphs: a batch runs dynamic passes) and ``threads=adaptive`` (it switches
    torch's threads between one sequence's steps, which a batch shares)."""
    from selfspec.models import capture
    from selfspec.models.loading import resolve_device

    size = checks.integer("batch_size", cfg.batch_size, 1, why="sequences decoded at once")
    if size > 1:
        mode = capture.resolve(str(cfg.model.capture), resolve_device(str(cfg.model.device)))
        if mode != "off":
            raise checks.refuse("batch_size", size, f"1 with model.capture resolving to {mode}",
                                "a batch runs dynamic passes: set model.capture=off, or batch_size=1")
        if str(cfg.threads) == "adaptive":
            raise checks.refuse("batch_size", size, "1 with threads=adaptive",
                                "adaptive threads switch torch's threads between one sequence's steps, which a "
                                "batch shares: set threads=fixed, or batch_size=1")
    return size


def _check_batched_methods(profile: str | None, method_cfgs: dict[str, DictConfig], options: dict[str, Options],
                           size: int) -> None:
    """Under ``batch_size > 1``, a method that cannot decode a batch (transformers' assisted generation,
    one sequence at a time) is refused, naming it, rather than run one sequence at a time behind the
    user's back; so is a speculation gate timed on the wall clock (``never_slower`` with
    ``profile=null``: a sequence's step shares its passes with the batch's other sequences)."""
    if size == 1:
        return
    for name, m in method_cfgs.items():
        if not decoder_class(str(m.name)).batches:
            raise checks.ConfigError(f"batch_size={size} with method {name}: it decodes one sequence at a time "
                                     "(transformers' assisted generation); leave it out or set batch_size=1")
        if profile is None and getattr(options[name], "never_slower", False):
            raise checks.ConfigError(f"batch_size={size} with method {name}'s never_slower=true and profile=null: "
                                     "its gate would time steps that share their passes with the batch's other "
                                     "sequences; set profile=auto, method.never_slower=false, or batch_size=1")


def _threads_spec(cfg: DictConfig, profile: str | None) -> str:
    """``threads``: auto, adaptive or fixed; ``adaptive`` where it cannot run is refused before the
    model loads (:func:`selfspec.decoding.threads.why_not_adaptive`), with the profile it needs
    judged from ``profile`` (the resolved key: a profile file is read once the model is loaded)."""
    from selfspec.decoding.threads import THREADS, why_not_adaptive

    value = checks.choice("threads", cfg.threads, THREADS, why="CPU threads per decoding step")
    if value == "adaptive":
        from selfspec.models.loading import resolve_device

        why = why_not_adaptive(resolve_device(str(cfg.model.device)), profile or None)
        if why:
            raise checks.refuse("threads", value, "auto or fixed here", why)
    return value


def _threads(cfg: DictConfig, device: torch.device, profile) -> str:
    """What ``threads`` resolves to for this run: adaptive or fixed (``auto``: adaptive where it
    can run)."""
    from selfspec.decoding.threads import why_not_adaptive

    value = str(cfg.threads)
    if value == "auto":
        return "fixed" if int(cfg.batch_size) > 1 or why_not_adaptive(device, profile) else "adaptive"
    return value


@contextlib.contextmanager
def _in_method_config(name: str, under_test: str) -> Iterator[None]:
    """A config error inside, of a baseline / compare method, names its config file."""
    try:
        yield
    except checks.ConfigError as err:
        if name == under_test:
            raise
        raise checks.ConfigError(f"{err} (in conf/method/{name}.yaml, run as baseline or compare)") from None


def check_methods(method_cfgs: dict[str, DictConfig], under_test: str) -> dict[str, Options]:
    """Every method config's checked options (:func:`~selfspec.decoding.check_method`), by label,
    without a model (the run builds its decoders from them: each method is checked once per run); an
    error in a baseline / compare method names its config file."""
    options = {}
    for name, m in method_cfgs.items():
        with _in_method_config(name, under_test):
            options[name] = check_method(m)
    return options


def _check_for_model(cfg: DictConfig, method_cfgs: dict[str, DictConfig], options: dict[str, Options],
                     under_test: str, budget: int) -> None:
    """Each method's keys bounded by the model's layer count, read from its config without loading
    it (:func:`~selfspec.measure.peak.shape_of`), and what the token budget leaves without effect
    (:meth:`~selfspec.decoding.base.Decoder.check_run`)."""
    from selfspec.models.loading import resolve_device

    layers = shape_of(cfg.model).layers
    for name, m in method_cfgs.items():
        with _in_method_config(name, under_test):
            decoder_class(str(m.name)).check_run(options[name], layers, budget)
            weights = getattr(options[name], "draft_weights", None)
            if weights is not None and (str(cfg.model.linear_kernel) == "torch"
                                        or resolve_device(str(cfg.model.device)).type != "cpu"):
                raise checks.refuse("method.draft_weights", weights, "null with model.linear_kernel=torch or on a GPU",
                                    "a quantised copy of the weights runs on the runtime's CPU kernels "
                                    "(models/csrc/quant_linear.cpp): model.linear_kernel=auto or skinny on a CPU")


def _check_priced_choices(profile: str | None, method_cfgs: dict[str, DictConfig],
                          options: dict[str, Options]) -> None:
    """A choice a method prices with the run's cost profile (its class's
    :meth:`~selfspec.decoding.base.Decoder.needs_profile`: a context drafter's ``draft_schedule:
    priced``, DEL's ``cost_model: measured``) is refused with ``profile=null`` before the model
    loads, naming the method and the key."""
    if profile is not None:
        return
    for name, m in method_cfgs.items():
        need = decoder_class(str(m.name)).needs_profile(options[name])
        if need is not None:
            raise checks.ConfigError(f"profile=null with method {name}'s {need[0]}: {need[1]}")


@dataclass
class RunPlan:
    """What :func:`prepare` checked and read before the model loads."""

    sampling: Sampling
    task: Any
    examples: list
    budget: int
    under_test: str
    method_cfgs: dict[str, DictConfig]
    n_samples: int
    #: each method's options as :func:`check_methods` checked them, by label
    method_options: dict[str, Options]
    #: ``profile`` resolved (None, ``auto`` or a profile file), once per run
    profile: str | None = None
    #: sequences decoded at once (``batch_size``)
    batch_size: int = 1


def prepare(cfg: DictConfig, label: str | None = None) -> RunPlan:
    """Check every config value and read the task's examples — all that can fail without a model."""
    from selfspec.models.loading import check_model_config
    from selfspec.tracking import check_logger, run_tags

    profile = _check_run_options(cfg)
    sampling = Sampling.from_config(cfg.sampling)
    n_samples = _n_samples(cfg, sampling)
    task = _task(cfg)
    budget = _budget(cfg, task)
    under_test = label or method_label(cfg)
    method_cfgs = method_configs(cfg, under_test)
    method_options = check_methods(method_cfgs, under_test)
    _check_priced_choices(profile, method_cfgs, method_options)
    batch_size = int(cfg.batch_size)
    _check_batched_methods(profile, method_cfgs, method_options, batch_size)
    check_model_config(cfg.model)
    _check_for_model(cfg, method_cfgs, method_options, under_test, budget)
    check_logger(cfg.get("logger"), run_tags(cfg, "evaluate", under_test))
    task.check_scoring()  # after the config values: it asks the machine (HumanEval: bubblewrap)
    examples = task.examples()
    if batch_size > len(examples):  # issue 68: 1e9 slots forked up front grew memory without bound
        raise checks.refuse("batch_size", batch_size, f"at most the {len(examples)} examples selected (n_examples "
                            "and the task's pool)", "a batch decodes one sequence per example at a time")
    return RunPlan(sampling, task, examples, budget, under_test, method_cfgs, n_samples, method_options, profile,
                   batch_size)


def _check_resume(out_dir: Path, identity: dict[str, Any]) -> None:
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
    ``{"model"|"data": {path: digest}}``, :func:`_identity`), naming the file and both digests (issue 68: a
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


def _check_artefacts(out_dir: Path, artefacts: dict[str, dict[str, str]]) -> None:
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


def _begin(out_dir: Path, identity: dict[str, Any], cfg: DictConfig) -> None:
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


def _row(ex, run: MethodRun, gen, tokenizer, task, prompt_len: int, sample: int,
         sampling: Sampling) -> dict[str, Any]:
    """The results line of one generation; ``seed`` is null under greedy decoding (no randomness)."""
    text = tokenizer.decode(gen.tokens, skip_special_tokens=True)
    drafted = sum(gen.drafted_per_step)
    accepted = gen.accepted_drafts
    return {
        "id": ex.id,
        "method": run.name,
        "sample": sample,
        "seed": None if sampling.greedy else sampling.seed,
        "decoder": str(run.cfg.name),
        "lossless": run.decoder.lossless_under(sampling),  # PPD sampling: typical acceptance is not
        "prompt_tokens": prompt_len,
        "tokens": gen.tokens,
        "text": text,
        "prediction": task.postprocess(text),
        "new_tokens": gen.new_tokens,
        "seconds": gen.seconds,
        "tokens_per_s": gen.new_tokens / gen.seconds if gen.seconds else None,
        "steps": gen.steps,
        "tau": gen.tau,
        "drafted": drafted,
        "accepted_drafts": accepted,
        "acceptance_rate": gen.acceptance_rate,
        "stop_reason": gen.stop_reason,
        "stats": gen.stats,
        # the shape of every step (decoding.base.StepTrace, defaults left out): hardware-independent
        # under greedy decoding, so a run can be re-costed later; null for the HF peers (no steps of ours)
        "trace": [t.row() for t in gen.trace] if gen.trace else None,
        # measured seconds per cost component (selfspec.models.ledger); null for the HF peers
        "ledger": gen.ledger or None,
    }


def evaluate(cfg: DictConfig, out_dir: str | Path, loaded=None, tracker: Tracker | None = None,
             label: str | None = None) -> dict[str, Any]:
    """Run the evaluation ``cfg`` describes into ``out_dir``; return the summary (also in summary.json).

    ``loaded``: an already loaded model for ``cfg.model`` (tests, benchmarks); ``tracker``: an
    open tracker (default: :func:`~selfspec.tracking.start_run` on ``cfg.logger``, finished here);
    ``label``: the method under test's config name when ``cfg`` was composed outside ``@hydra.main``
    (default: :func:`method_label`).
    """
    plan = prepare(cfg, label)  # everything that can fail without the model, before it loads
    if loaded is None:  # its estimated peak against the device's memory, before the model loads
        prompt = getattr(plan.task.cfg, "max_prompt_tokens", None) or EVAL_CONTEXT
        check_fits(JOB, MEMORY, cfg, prompt + plan.budget, prompt)
    out_dir = Path(out_dir)
    check_directory(out_dir, "hydra.run.dir")
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        with hold(out_dir, f"run directory {out_dir}"):  # one owner at a time (selfspec.store.locks)
            return _run(cfg, plan, out_dir, loaded, tracker)
    except BaseException:
        if created and not any(out_dir.iterdir()):  # refused or failed before it wrote anything
            out_dir.rmdir()
        raise


def _run(cfg: DictConfig, plan: RunPlan, out_dir: Path, loaded, tracker: Tracker | None) -> dict[str, Any]:
    """:func:`evaluate` once the run owns ``out_dir``."""
    from selfspec.models import kernels
    from selfspec.store.runinfo import run_info

    sampling, task, examples, budget = plan.sampling, plan.task, plan.examples, plan.budget
    under_test, method_cfgs, n_samples = plan.under_test, plan.method_cfgs, plan.n_samples
    torch.manual_seed(int(cfg.seed))
    names = list(method_cfgs)
    baseline = names[0]
    identity = _identity(cfg, plan)
    _check_resume(out_dir, identity)
    check_writable(out_dir, "the run directory (hydra.run.dir=...)")

    from selfspec.models.loading import hub_revision, model_for

    loaded = model_for(cfg.model, loaded)
    commit = hub_revision(loaded)  # a hub repo's files are known once downloaded: its commit
    if commit:
        identity["inputs"]["model"] |= commit
        _check_resume(out_dir, identity)
    profile = run_profile(plan.profile, loaded.model)  # a profile of another model shape stops here
    tok = loaded.tokenizer
    threads = _threads(cfg, loaded.model.device, profile)
    runs = _decoders(plan, loaded, profile, threads)
    artefacts = {r.name: {str(p): artefact_digest(p) for p in _artefact_paths(r)} for r in runs}
    _check_artefacts(out_dir, artefacts)
    identity["artefacts"] = artefacts

    prompts = {ex.id: task.encode(ex, tok) for ex in examples}
    _check_room(plan, runs, prompts, loaded.model)
    _begin(out_dir, identity, cfg)
    results = ResultsFile(out_dir / RESULTS, ROW_KEYS)
    ids = set(prompts)
    done, todo = _progress(results, ids, examples, runs, n_samples)
    resumed = _resumed(out_dir, runs, len(examples), len(todo), len(done), n_samples) if done else None

    own_tracker = tracker is None
    tracker = tracker or start_run(cfg, JOB, dir=out_dir, method_label=under_test)
    info = run_info(seed=int(cfg.seed), device=str(loaded.model.device), dtype=str(loaded.model.dtype).replace("torch.", ""),
                    linear_kernel=loaded.model.linear_kernel, capture=loaded.model.capture,
                    kernel_paths=kernels.paths())
    for paths in artefacts.values():
        for p in paths:
            tracker.use_artifact(p)
    try:
        if todo:
            _reserve(loaded.model, runs, [prompts[ex.id] for ex in todo], budget)
            _warmup(runs, [prompts[ex.id] for ex in examples], int(cfg.warmup),
                    min(int(cfg.warmup_max_new_tokens), budget), sampling)
        if plan.batch_size > 1:
            _loop_batched(plan, runs, todo, prompts, done, tok, results, out_dir, bool(cfg.progress))
        else:
            _loop(plan, runs, todo, prompts, done, tok, results, tracker, baseline, bool(cfg.progress))
    finally:
        results.close()

    rows = [r for r in results.rows() if str(r["id"]) in ids]
    summary = (_summary(cfg, plan, out_dir, loaded, runs, rows, profile, threads, info, artefacts, identity["inputs"])
               | {"resumed": resumed})
    write_json(out_dir / SUMMARY, summary)
    _track_summary(tracker, summary, rows, names, under_test, info)
    if own_tracker:
        tracker.finish()
    _log_summary(summary["methods"], baseline)
    return summary


def _check_draft_weights(plan: RunPlan, model, profile) -> None:
    """A method whose drafts read a quantised copy (``draft_weights``) is refused, naming it, where the
    loaded model cannot run one (:func:`~selfspec.models.quantised.problem`) or the run's profile has no
    prices of its passes (a profile measured before quantised drafts): before anything is decoded."""
    from selfspec.models.quantised import problem

    for name, options in plan.method_options.items():
        weights = getattr(options, "draft_weights", None)
        if weights is None:
            continue
        with _in_method_config(name, plan.under_test):
            why = problem(model)
            if why is not None:
                raise checks.refuse("method.draft_weights", weights, "null for this model", why)
            if profile is not None and weights not in profile.formats:
                raise checks.ConfigError(
                    f"method.draft_weights={weights}: profile {profile.name} ({profile.path or 'in memory'}) has no prices "
                    f"of passes over {weights} weights (measured before quantised drafts): measure it again "
                    "(profile=auto, or make profile), or set profile=null")


def _decoders(plan: RunPlan, loaded, profile, threads: str) -> list[MethodRun]:
    """Every method's decoder, built before the loop: a missing artefact fails here, with the
    method's message."""
    _check_draft_weights(plan, loaded.model, profile)
    common = dict(eos_token_ids=loaded.eos_token_ids, stop_strings=plan.task.stop, tokenizer=loaded.tokenizer)
    return [MethodRun(name, m, build_decoder(m, loaded.model, profile=profile, threads=threads,
                                             options=plan.method_options[name], **common))
            for name, m in plan.method_cfgs.items()]


def _check_room(plan: RunPlan, runs: list[MethodRun], prompts: dict[str, list[int]], model) -> None:
    """Refuse, before anything is written, a method whose generations need more cache positions than
    the model holds: the longest prompt, the budget and what a step writes past the tokens (its
    drafts, its tree). Issue 52: SWIFT's max_draft=1000 failed at the first generation with advice
    naming max_new_tokens, after vanilla's row was written, so the corrected rerun was refused."""
    longest = max(map(len, prompts.values()))
    for run in runs:
        room = run.decoder.room
        need = longest + plan.budget + room + 1
        if need <= model.max_context:
            continue
        k = getattr(plan.method_options[run.name], "max_draft", None)
        drafts = f"method.max_draft={k}" if k is not None else "its drafts and tree"
        lower = ["max_new_tokens", "task.max_prompt_tokens"]
        if k is not None:
            lower.insert(0 if room > plan.budget else 2, "method.max_draft")
        raise checks.ConfigError(
            f"method {run.name}: a step may write {room} cache positions past the tokens ({drafts}), and with the "
            f"longest prompt ({longest} tokens) and max_new_tokens={plan.budget} a generation needs {need}, more than "
            f"the {model.max_context} model {model.name} holds: lower {', '.join(lower[:-1])} or {lower[-1]}")


def _resumed(out_dir: Path, runs: list[MethodRun], n_examples: int, n_todo: int, n_done: int,
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


def _progress(results: ResultsFile, ids: set, examples, runs: list[MethodRun], n_samples: int) -> tuple[set, list]:
    """The generations the results file already holds, as ``(id, sample, method)``, and the
    examples with one still to do. Rows of examples outside this run's selection ``ids`` (a rerun
    with a smaller ``n_examples``) stay in the file but take no part."""
    done = {(*generation_key(r), r["method"]) for r in results if str(r["id"]) in ids}
    todo = [ex for ex in examples if any((ex.id, i, r.name) not in done for i in range(n_samples) for r in runs)]
    return done, todo


def _identity(cfg: DictConfig, plan: RunPlan) -> dict[str, Any]:
    """What a run directory's results depend on (``run_config.json``): a rerun into it must match
    (:func:`_check_resume`); ``n_examples`` is left out, so a run may grow or shrink its selection.
    ``inputs`` holds the content digests of the files read, by path: the model's
    (:func:`~selfspec.models.loading.source_digests`) and the task's data
    (:meth:`~selfspec.tasks.Task.data_digests`)."""
    from selfspec.models.loading import source_digests

    inputs = {"model": source_digests(cfg.model), "data": plan.task.data_digests()}
    return to_jsonable({"model": cfg.model, "task": OmegaConf.to_container(cfg.task, resolve=True)
                        | {"n_examples": None}, "sampling": cfg.sampling, "max_new_tokens": plan.budget,
                        "baseline": next(iter(plan.method_cfgs)), "methods": plan.method_cfgs,
                        "n_samples": plan.n_samples, "batch_size": plan.batch_size, "inputs": inputs})


def _track_summary(tracker: Tracker, summary: dict[str, Any], rows: list[dict], names: list[str], under_test: str,
                   info: dict[str, Any]) -> None:
    """The run's summary and its examples' rows (the methods of this run) in the tracker."""
    tracker.summary({"format": summary["format"], "method": under_test, "methods": summary["methods"],
                     "method_configs": summary["method_configs"], "run_info": info})
    tracker.table("examples", [{k: v for k, v in r.items() if k != "stats"} | {"stats": str(r.get("stats"))}
                               for r in rows if r.get("method") in names])


def _summary(cfg: DictConfig, plan: RunPlan, out_dir: Path, loaded, runs, rows, profile, threads, info,
             artefacts, inputs) -> dict[str, Any]:
    """summary.json of a finished run: every method's figures over ``rows`` (:func:`summarize`), the
    samples files written beside it, and what produced it (model, config, machine, profile, contention)."""
    sampling, task, budget, examples = plan.sampling, plan.task, plan.budget, plan.examples
    names = [r.name for r in runs]
    baseline = names[0]
    refs = {ex.id: ex.reference for ex in examples}
    per_method = summarize(rows, names, baseline, score=task.score_samples, references=refs, greedy=sampling.greedy,
                           profile=profile)
    finished = common_rows(rows, names, baseline)
    samples_files = _write_samples(out_dir, task, finished)
    here = machine(loaded.model.device)
    batches = _batches(out_dir, finished, baseline, profile) if plan.batch_size > 1 else None
    if batches is None:
        under_load = contention(finished[baseline], profile, float(cfg.contention), here,
                                 spoiled=spoiled_generations(finished, profile, here, float(cfg.contention_spike)))
    else:
        under_load = batch_contention(batches.get(baseline), profile, float(cfg.contention), here)
    return {
        "format": RUN_FORMAT,
        "model": loaded.name,
        "task": task.name,
        "method": plan.under_test,
        "baseline": baseline,
        "methods": per_method,
        "greedy": sampling.greedy,
        "n_samples": plan.n_samples,
        "sample_seeds": None if sampling.greedy else [sample_sampling(sampling, i).seed for i in range(plan.n_samples)],
        "samples_files": samples_files,
        "max_new_tokens": budget,
        "n_examples": len(examples),
        "run_info": info,
        "model_shape": model_shape(loaded.model),
        "profile": profile.summary() if profile is not None else None,
        "contention": under_load,
        "threads": {"policy": threads, "configured": torch.get_num_threads()},
        "batch_size": plan.batch_size,
        "batches": batches,
        "capture": _capture_summary(loaded.model, finished),
        "method_configs": {r.name: OmegaConf.to_container(r.cfg, resolve=True) for r in runs},
        "artefacts": {method: sorted(paths) for method, paths in artefacts.items()},
        "artefact_digests": artefacts,
        "inputs": inputs,
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def _capture_summary(model, rows: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What the static-shape (captured) passes took in this process (``capture=static|graphs``):
    passes routed by kind, the decoding passes that went eager (``missed``, by kind and width:
    under ``capture=graphs`` they ran without a graph), and the static passes built, dropped by the
    LRU, dropped with a replaced cache (``forgotten``) and run once
    (:meth:`~selfspec.models.capture.StepRunner.counts`); per method, the passes built inside its
    timed generations (``captured_while_timed``, of the ``rows`` the summary reports: under
    ``graphs`` each a capture the method's seconds include). Logged as a warning when any was
    missed, when any was built while timed, or, under ``graphs``, when the LRU dropped graphs (each
    one that comes back is captured again)."""
    steps = model.steps
    if steps is None:
        return {"mode": model.capture}
    if steps.missed:
        log.warning("capture=%s: %d decoding passes took the eager path (by kind and rows: %s); the largest "
                    "static shape is %d rows", model.capture, steps.missed, dict(steps.missed_kinds), BUCKETS[-1])
    if model.capture == "graphs" and steps.evicted:
        log.warning("capture=graphs: the LRU dropped %d of the %d graphs captured (it keeps %d); one asked for "
                    "again is captured again", steps.evicted, steps.built, MAX_GRAPHS)
    timed = {name: sum(r.get("captured_while_timed") or 0 for r in rs) for name, rs in rows.items()}
    if any(timed.values()):
        log.warning("capture=%s: static passes were built inside timed generations (%s): their seconds include "
                    "the build%s", model.capture, ", ".join(f"{n} {k}" for n, k in timed.items() if k),
                    " (a CUDA graph capture each)" if model.capture == "graphs" else "")
    return {"mode": model.capture, **steps.counts(), "captured_while_timed": timed}


def _reserve(model, runs: list[MethodRun], prompts: list[list[int]], budget: int) -> None:
    """Size the model's pooled cache (``capture=static|graphs``) for the longest generation of the run,
    before the warm-up: a pool sized by the warm-up's short generations grew at the first timed
    example (and again at each longer prompt), dropping every pass built on it, so under ``graphs``
    every method captured its graphs again inside timed examples (issue 50)."""
    lengths = [run.decoder.cache_length(len(p), budget) for run in runs if run.decoder.own_loop for p in prompts]
    if lengths:
        model.reserve(min(max(lengths), model.max_context))


def _warmup(runs: list[MethodRun], prompts: list[list[int]], n: int, budget: int, sampling: Sampling) -> None:
    """``n`` untimed generations per method (Spec-Bench: 3), cycling through the prompts. They warm
    the machine, not the methods: each decoder's policy state carried across examples (its
    threshold, speculation gate: :mod:`selfspec.decoding.carried`) is put back afterwards, so the first measured
    example starts where a fresh decoder does (Draft & Verify's evaluation has no warm-up)."""
    if n <= 0 or not prompts:
        return
    with contextlib.ExitStack() as kept:
        for run in runs:
            kept.enter_context(run.decoder.kept_state())
        for i in range(n):
            for run in runs:
                run.decoder.generate(prompts[i % len(prompts)], budget, sampling)


def _write_samples(out_dir: Path, task, rows: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """Per method, ``samples-<method>.jsonl`` in the task's own samples format (HumanEval's
    ``task_id``/``completion``), of the generations the summary scores; none for other tasks."""
    import json

    written: dict[str, str] = {}
    for name, rs in rows.items():
        lines = [task.sample_record(str(r["id"]), r["prediction"]) for r in rs]
        if not lines or any(line is None for line in lines):
            continue
        path = out_dir / f"samples-{name}.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        written[name] = path.name
    return written


def _settle(run: MethodRun, ids: list[int]) -> None:
    """One untimed step of an example's prompt (its prefill and one token, greedy) by the baseline,
    before that example's timed generations, its carried state put back: the first method timed on
    a prompt would otherwise pay what the later ones find done (on 2 CPU cores in bf16, vanilla's
    prompt step took 3-14% longer than the same step of the methods after it, most after an HF
    peer's generation; docs/2026-12-01-bfloat16-on-the-cpu.md), lending every method that much of
    the prompt's time against vanilla."""
    with run.decoder.kept_state():
        run.decoder.generate(ids, 1, Sampling())


def _loop(plan: RunPlan, runs, todo, prompts, done, tok, results, tracker, baseline: str, progress: bool) -> None:
    """Per example, per sample, every method back to back; each row appended as it finishes."""
    from tqdm.auto import tqdm

    budget, sampling, task, under_test = plan.budget, plan.sampling, plan.task, plan.under_test
    steps = runs[0].decoder.model.steps if runs else None
    totals = {r.name: [0, 0.0] for r in runs}  # new tokens, seconds (this session)
    bar = tqdm(todo, desc=f"{task.name} {under_test}", unit="ex", disable=not progress, dynamic_ncols=True)
    for step, ex in enumerate(bar):
        ids = prompts[ex.id]
        _settle(runs[0], ids)
        for i in range(plan.n_samples):
            s = sample_sampling(sampling, i)
            for run in runs:
                if (ex.id, i, run.name) in done:
                    continue
                gen, built = run.decoder.generate_timed(ids, budget, s)
                row = _row(ex, run, gen, tok, task, len(ids), i, s)
                # static passes built (under graphs: captured) inside the generation timed, after it
                # was run again for building some (Decoder.generate_timed): 0 unless every attempt built
                row["captured_while_timed"] = built if steps is not None and run.decoder.own_loop else None
                results.append(row)
                totals[run.name][0] += gen.new_tokens
                totals[run.name][1] += gen.seconds
        rates = {name: (t / s if s else 0.0) for name, (t, s) in totals.items()}
        bar.set_postfix({f"{n} tok/s": f"{rates[n]:.1f}" for n in dict.fromkeys([baseline, under_test])})
        tracker.log({f"{n}/tokens_per_s": v for n, v in rates.items()}, step=step)
    bar.close()


def _loop_batched(plan: RunPlan, runs, todo, prompts, done, tok, results, out_dir: Path, progress: bool) -> None:
    """``batch_size > 1``: the examples in waves, each method decoding a wave as one continuous batch
    (:mod:`selfspec.evaluation.batches`), each example of a wave settled first (:func:`_settle`); each
    row appended as its sequence finishes, each batch a line of batches.jsonl."""
    from tqdm.auto import tqdm

    from selfspec.evaluation.batches import WAVE, decode_waves, open_batches

    task = plan.task
    batches = open_batches(out_dir)
    bar = tqdm(total=len(todo), desc=f"{task.name} {plan.under_test} (batches of {plan.batch_size})", unit="ex",
               disable=not progress, dynamic_ncols=True)

    def row_of(ex, run, gen, sample, sampling) -> dict[str, Any]:
        return _row(ex, run, gen, tok, task, len(prompts[ex.id]), sample, sampling) | {"captured_while_timed": None}

    try:
        decode_waves(runs, todo, prompts, done, plan.batch_size, plan.n_samples, plan.budget,
                     lambda i: sample_sampling(plan.sampling, i), row_of, results.append, batches.append,
                     on_wave=lambda w: bar.update(min(len(todo) - bar.n, WAVE * plan.batch_size)),
                     settle=lambda ex: _settle(runs[0], prompts[ex.id]))
    finally:
        bar.close()
        batches.close()


def _batches(out_dir: Path, rows: dict[str, list[dict[str, Any]]], baseline: str, profile) -> dict[str, Any]:
    """Throughput, latency and the predicted batch seconds per method
    (:func:`~selfspec.evaluation.batches.batch_summary`)."""
    from selfspec.evaluation.batches import batch_summary, open_batches

    return batch_summary(open_batches(out_dir).rows(), rows, baseline, profile)


def _log_summary(per_method: dict[str, dict[str, Any]], baseline: str) -> None:
    for name, m in per_method.items():
        log.info("%-18s %6.2f tok/s  speedup %s  tau %s  consistency %s", name, m["tokens_per_s"] or 0.0,
                 _fmt(m["speedup"]), _fmt(m["tau"]), _fmt(m["consistency"]))


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


__all__ = ["MethodRun", "RunPlan", "ResumeMismatch", "check_methods", "evaluate", "load_method_config",
           "method_configs", "method_label", "prepare", "RESULTS", "SUMMARY"]

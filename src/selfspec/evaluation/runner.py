"""The evaluation runner: the entry that composes the evaluation's three rooms into one run.

* :mod:`selfspec.evaluation.plan`: every config check and what the run reads before the model loads
  (:func:`prepare`: a frozen :class:`~selfspec.evaluation.plan.RunPlan`), then each method's decoder;
* :mod:`selfspec.evaluation.identity`: the run directory's record (``run_config.json``), the inputs'
  digests, the refusal of a rerun that differs (:class:`ResumeMismatch`), what an interrupted run
  already holds, and the artefacts' lineage;
* :mod:`selfspec.evaluation.loop`: warm-up, the interleaved loop (or the batched one) with its
  per-example sink, and ``summary.json``.

Bad input stops before the model loads (:func:`prepare`), and before the model loads its estimated peak
memory is checked against the device's (:data:`MEMORY`); a run refused for its directory
(:func:`~selfspec.evaluation.identity.check_resume`) leaves it as it was.

    summary = evaluate(cfg, out_dir)       # cfg: conf/evaluate.yaml composed
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from selfspec.config import load_method_config
from selfspec.evaluation.identity import (RESULTS, ROW_KEYS, RUN_CONFIG, SUMMARY, ResumeMismatch, artefact_digests,
                                          begin, check_artefacts, check_resume, declare_lineage, progress,
                                          resume_record, run_identity)
from selfspec.evaluation.loop import RUN_FORMAT, Sink, decode, log_summary, run_summary, track_summary
from selfspec.evaluation.plan import (Built, MethodRun, RunPlan, build_runs, check_methods, check_room,
                                      method_configs, method_label, prepare, resolve_threads)
from selfspec.evaluation.profiling import run_profile
from selfspec.measure.peak import (EVAL_CONTEXT, MemoryModel, Shape, Term, check_fits, layer_bytes, scores_bytes,
                                   shape_of)
from selfspec.store.files import check_directory, check_writable, write_json
from selfspec.store.locks import hold
from selfspec.tracking import ResultsFile, Tracker, start_run


def memory_terms(s: Shape, cfg, b: int, context: int, prompt: int | None) -> list[list[Term]]:
    """The caches of ``batch_size`` sequences as long as the longest (``context``: prompt and new tokens)
    and their prompts' prefills (``prompt`` rows each; the whole context when not given): a batch keeps a
    cache per sequence, and in bfloat16 its prefills may run as one pass (issue 68: without the batch
    factor, B caches passed the check and failed after the load); and the quantised copies of the weights
    the methods' drafts read (``draft_weights``: every linear and the LM head, held beside the target's)."""
    from selfspec.decoding import decoder_class
    from selfspec.decoding.llamacpp import LlamaCpp

    prompt = context if prompt is None else min(prompt, context)
    batch = int(cfg.batch_size)
    also = " or batch_size" if batch > 1 else ""
    methods = method_configs(cfg).values()
    copies = [Term(f"the {fmt} copy of the weights", draft_copy_bytes(s, fmt), "method.draft_weights")
              for fmt in sorted({str(m.draft_weights) for m in methods if m.get("draft_weights") is not None})]
    llama = [m for m in methods if issubclass(decoder_class(str(m.name)), LlamaCpp)]
    copies += [Term(f"llama.cpp's {fmt} weights and cache", llama_cpp_bytes(s, fmt, cfg, context), "method.weights",
                    activation=False) for fmt in sorted({str(m.weights) for m in llama})]
    copies += [Term(f"llama.cpp's draft model {name}, its weights and cache", llama_cpp_draft_bytes(name, cfg, context),
                    "method.draft", activation=False) for name in sorted({str(m.draft) for m in llama if "draft" in m})]
    return [[
        Term("cache", context * s.kv_per_token * b * batch,
             ("max_new_tokens" if context - prompt > prompt else "the task's prompts (or max_new_tokens)") + also),
        Term("prefill", (layer_bytes(s, prompt, b) + scores_bytes(s, prompt, prompt, b) + s.vocab * 4) * batch,
             "the task's prompts" + also),
        *copies,
    ]]


def draft_copy_bytes(s: Shape, fmt: str) -> int:
    """Bytes of a quantised copy (:mod:`selfspec.models.quantised`) of a model of shape ``s``: every
    decoder layer's linears and the LM head (the embedding and the norms stay the target's; the head in its own
    format where the copy's is another, :func:`~selfspec.models.quantised.head_format`)."""
    from selfspec.models.quantised import head_format, packed_bytes

    layer_weights = s.params - s.vocab * s.hidden * (1 if s.tied else 2) - s.hidden
    return (packed_bytes(fmt, 1, s.hidden) * (layer_weights // s.hidden)
            + packed_bytes(head_format(fmt), 1, s.hidden) * s.vocab)


def llama_cpp_bytes(s: Shape, weights: str, cfg, context: int) -> int:
    """What llama.cpp holds for ``method=llama_cpp`` (:mod:`selfspec.decoding.llamacpp`) on a model of shape
    ``s``: its weights (the file it maps, in the format ``weights`` names: for ``source``, the model's
    own GGUF file's size) and its KV cache of the run's dtype, as long as ``context`` (rounded up to the
    power of two its context is made with)."""
    from selfspec.decoding.llamacpp import context_length, resolved_weights, weights_bytes

    dtype = torch.bfloat16 if str(cfg.model.get("dtype")) == "bfloat16" else torch.float32
    fmt = resolved_weights(weights, dtype)
    source = None
    if fmt == "source":
        from selfspec.models.loading import local_gguf, model_source

        try:
            source = local_gguf(model_source(cfg.model)).stat().st_size
        except (OSError, ValueError):
            source = None
    return weights_bytes(fmt, s.params, source) + context_length(context) * s.kv_per_token * (2 if dtype == torch.bfloat16 else 4)


def llama_cpp_draft_bytes(name: str, cfg, context: int) -> int:
    """What llama.cpp holds for ``llama_cpp_speculative``'s draft model ``name`` (a model config): its GGUF file
    as shipped (mapped; 1.1 bytes a parameter where the file is not fetched yet) and its KV cache of the run's
    dtype, as long as the target's context."""
    from selfspec.config import model_config
    from selfspec.decoding.llamacpp import context_length, draft_file

    draft = model_config(name)
    shape = shape_of(draft)
    try:
        weights = draft_file(name).stat().st_size
    except (OSError, ValueError):
        weights = int(shape.params * 1.1)
    per = 2 if str(cfg.model.get("dtype")) == "bfloat16" else 4
    return weights + context_length(context) * shape.kv_per_token * per


#: an evaluation's memory (fitted by ``scripts/measure_memory.py --fit``, docs/memory_measured.json)
MEMORY = MemoryModel(memory_terms, s=1.0, runtime=497863884.8)
#: an evaluation's job name: its entry point's and primary config's (``python -m selfspec.evaluate``,
#: conf/evaluate.yaml), in memory estimates (:mod:`selfspec.memory`) and its tracker run
JOB = "evaluate"


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
    torch.manual_seed(plan.seed)
    identity = run_identity(cfg, plan)
    built = _build(cfg, plan, out_dir, identity, loaded)
    begin(out_dir, identity, cfg)
    results = ResultsFile(out_dir / RESULTS, ROW_KEYS)
    ids = set(built.prompts)
    done, todo = progress(results, ids, plan.examples, built.runs, plan.n_samples)
    resumed = (resume_record(out_dir, built.runs, len(plan.examples), len(todo), len(done), plan.n_samples)
               if done else None)

    own_tracker = tracker is None
    tracker = tracker or start_run(cfg, JOB, dir=out_dir, method_label=plan.under_test)
    info = _run_info(plan, built.loaded.model)
    declare_lineage(tracker, identity["artefacts"])
    try:
        decode(plan, built, todo, Sink(plan, built, done, results), tracker, out_dir)
    finally:
        results.close()

    rows = [r for r in results.rows() if str(r["id"]) in ids]
    summary = run_summary(cfg, plan, built, out_dir, rows, info, identity) | {"resumed": resumed}
    write_json(out_dir / SUMMARY, summary)
    track_summary(tracker, summary, rows, list(plan.method_cfgs), plan.under_test, info)
    if own_tracker:
        tracker.finish()
    log_summary(summary["methods"], plan.baseline)
    return summary


def _build(cfg: DictConfig, plan: RunPlan, out_dir: Path, identity: dict[str, Any], loaded) -> Built:
    """The model (loaded here unless given), the run's profile, every method's decoder and the examples'
    prompts; the run directory checked against ``identity`` before the load, and again with what only the
    load tells (a hub repo's commit, the artefacts' digests: both recorded in ``identity``). Writes nothing."""
    check_resume(out_dir, identity)
    check_writable(out_dir, "the run directory (hydra.run.dir=...)")

    from selfspec.models.loading import hub_revision, model_for

    loaded = model_for(cfg.model, loaded)
    commit = hub_revision(loaded)  # a hub repo's files are known once downloaded: its commit
    if commit:
        identity["inputs"]["model"] |= commit
        check_resume(out_dir, identity)
    profile = run_profile(plan.profile, loaded.model)  # a profile of another model shape stops here
    threads = resolve_threads(plan, loaded.model.device, profile)
    runs = build_runs(plan, loaded, profile, threads)
    artefacts = artefact_digests(runs)
    check_artefacts(out_dir, artefacts)
    identity["artefacts"] = artefacts
    prompts = {ex.id: plan.task.encode(ex, loaded.tokenizer) for ex in plan.examples}
    check_room(plan, runs, prompts, loaded.model)
    return Built(loaded, profile, threads, runs, prompts)


def _run_info(plan: RunPlan, model) -> dict[str, Any]:
    """What ran the evaluation (:func:`~selfspec.store.runinfo.run_info`): versions, machine, the model's
    device, dtype, kernels and capture mode."""
    from selfspec.models import kernels
    from selfspec.store.runinfo import run_info

    return run_info(seed=plan.seed, device=str(model.device), dtype=str(model.dtype).replace("torch.", ""),
                    linear_kernel=model.linear_kernel, capture=model.capture, kernel_paths=kernels.paths())


__all__ = ["JOB", "MEMORY", "MethodRun", "RESULTS", "ROW_KEYS", "RUN_CONFIG", "RUN_FORMAT", "RunPlan", "ResumeMismatch",
           "SUMMARY", "check_methods", "evaluate", "load_method_config", "method_configs", "method_label", "prepare"]

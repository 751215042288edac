"""The evaluation's loop and its summary: the chosen methods on the same examples, warm-up first, interleaved.

docs/design.md §2.6 and §3 (Spec-Bench's conventions): one process, one runtime, batch size 1;
``warmup`` generations per method before anything is timed; then per example the baseline, the
method under test and the comparison methods run back to back (interleaved, so slow drifts of the
machine hit every method alike), after one untimed prompt step of the example by the baseline (so
the first of them does not pay for a prompt the others find warm: :func:`_settle`). ``batch_size`` > 1
decodes the examples in waves instead (:mod:`selfspec.evaluation.batches`). Both loops hand every
generation to one per-example sink (:class:`Sink`), which turns it into its row of ``results.jsonl``,
appended as it finishes; ``summary.json`` is made from all rows at the end (:func:`run_summary`).

``n_samples`` > 1 pools all samples in speedup and τ, the task's metric scores each example's samples
together (HumanEval: pass@1 and pass@10), and a task with its own samples format (HumanEval's
``task_id``/``completion``) gets ``samples-<method>.jsonl`` per method.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Iterator

import torch
from omegaconf import DictConfig, OmegaConf

from selfspec.decoding import Sampling
from selfspec.decoding.sampling import DRAW
from selfspec.evaluation.aggregate import batch_contention, common_rows, contention, spoiled_generations, summarize
from selfspec.evaluation.batches import WAVE, batch_summary, decode_waves, open_batches
from selfspec.evaluation.plan import Built, MethodRun, RunPlan, sample_sampling
from selfspec.measure.profile import machine, model_shape
from selfspec.models.capture import BUCKETS, MAX_GRAPHS
from selfspec.store.files import write_text
from selfspec.tracking import ResultsFile, Tracker

log = logging.getLogger(__name__)

#: the format of the run records this selfspec writes (summary.json's ``format``); which formats are
#: read: :data:`selfspec.reporting.records.RUN_FORMATS` (docs/design.md, "Formats read")
RUN_FORMAT = 2


class Sink:
    """Where both loops take each example's prompt from and hand each generation to: the generations
    already done (skipped), the untimed settling step of an example (:func:`_settle`), each generation's
    row (:func:`_row`) and ``results.jsonl``; batched, also ``batches.jsonl`` and the progress of the
    waves (the sink :func:`~selfspec.evaluation.batches.decode_waves` takes)."""

    def __init__(self, plan: RunPlan, built: Built, done: set, results: ResultsFile) -> None:
        self.plan, self.built, self.done, self.results = plan, built, done, results
        self.batches: ResultsFile | None = None
        self.bar = None

    @contextlib.contextmanager
    def waves(self, out_dir: Path, n_todo: int) -> Iterator[Sink]:
        """Batched: ``batches.jsonl`` and the progress bar over the ``n_todo`` examples, open while the waves
        are decoded."""
        from tqdm.auto import tqdm

        plan = self.plan
        self.batches = open_batches(out_dir)
        self.bar = tqdm(total=n_todo, desc=f"{plan.task.name} {plan.under_test} (batches of {plan.batch_size})",
                        unit="ex", disable=not plan.progress, dynamic_ncols=True)
        try:
            yield self
        finally:
            self.bar.close()
            self.batches.close()

    def pending(self, ex, sample: int, run: MethodRun) -> bool:
        """Whether ``run`` has still to generate sample ``sample`` of ``ex``."""
        return (ex.id, sample, run.name) not in self.done

    def prompt(self, ex) -> list[int]:
        return self.built.prompts[ex.id]

    def sampling(self, sample: int) -> Sampling:
        return sample_sampling(self.plan.sampling, sample)

    def settle(self, ex) -> None:
        _settle(self.built.runs[0], self.prompt(ex))

    def row(self, ex, run: MethodRun, gen, sample: int, sampling: Sampling,
            captured: int | None = None) -> dict[str, Any]:
        """The results line of a generation; ``captured``: the static passes built inside it, when timed."""
        return _row(ex, run, gen, self.built.loaded.tokenizer, self.plan.task, len(self.prompt(ex)), sample,
                    sampling) | {"captured_while_timed": captured}

    def keep(self, row: dict[str, Any]) -> None:
        self.results.append(row)

    def batch(self, line: dict[str, Any]) -> None:
        self.batches.append(line)

    def wave_done(self, wave: int) -> None:
        self.bar.update(min(self.bar.total - self.bar.n, WAVE * self.plan.batch_size))


def decode(plan: RunPlan, built: Built, todo: list, sink: Sink, tracker: Tracker, out_dir: Path) -> None:
    """The examples ``todo``: the cache reserved and the methods warmed up first, then per example, or
    in batches (``batch_size > 1``)."""
    if todo:
        _reserve(built.loaded.model, built.runs, [built.prompts[ex.id] for ex in todo], plan.budget)
        _warmup(built.runs, [built.prompts[ex.id] for ex in plan.examples], plan.warmup, plan.warmup_tokens,
                plan.sampling)
    if plan.batch_size > 1:
        _loop_batched(plan, built, todo, sink, out_dir)
    else:
        _loop(plan, built, todo, sink, tracker)


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


def _reserve(model, runs: list[MethodRun], prompts: list[list[int]], budget: int) -> None:
    """Size the model's pooled cache (``capture=static|graphs``) for the longest generation of the run,
    before the warm-up: a pool sized by the warm-up's short generations grew at the first timed
    example (and again at each longer prompt), dropping every pass built on it, so under ``graphs``
    every method captured its graphs again inside timed examples (issue 50). A peer with a runtime of
    its own (:meth:`~selfspec.decoding.base.Decoder.reserve`) is sized alike."""
    lengths = [run.decoder.cache_length(len(p), budget) for run in runs if run.decoder.own_loop for p in prompts]
    if lengths:
        model.reserve(min(max(lengths), model.max_context))
    for run in runs:  # a peer with a runtime of its own sizes that (llama.cpp's context)
        if not run.decoder.own_loop and prompts:
            run.decoder.reserve(max(len(p) for p in prompts) + budget + 1)


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


def _settle(run: MethodRun, ids: list[int]) -> None:
    """One untimed step of an example's prompt (its prefill and one token, greedy) by the baseline,
    before that example's timed generations, its carried state put back: the first method timed on
    a prompt would otherwise pay what the later ones find done (on 2 CPU cores in bf16, vanilla's
    prompt step took 3-14% longer than the same step of the methods after it, most after an HF
    peer's generation; docs/2026-12-01-bfloat16-on-the-cpu.md), lending every method that much of
    the prompt's time against vanilla."""
    with run.decoder.kept_state():
        run.decoder.generate(ids, 1, Sampling())


def _loop(plan: RunPlan, built: Built, todo: list, sink: Sink, tracker: Tracker) -> None:
    """Per example, per sample, every method back to back; each row appended as it finishes."""
    from tqdm.auto import tqdm

    runs = built.runs
    steps = runs[0].decoder.model.steps if runs else None
    totals = {r.name: [0, 0.0] for r in runs}  # new tokens, seconds (this session)
    bar = tqdm(todo, desc=f"{plan.task.name} {plan.under_test}", unit="ex", disable=not plan.progress,
               dynamic_ncols=True)
    for step, ex in enumerate(bar):
        sink.settle(ex)
        for i in range(plan.n_samples):
            s = sink.sampling(i)
            for run in runs:
                if not sink.pending(ex, i, run):
                    continue
                gen, built_passes = run.decoder.generate_timed(sink.prompt(ex), plan.budget, s)
                # static passes built (under graphs: captured) inside the generation timed, after it
                # was run again for building some (Decoder.generate_timed): 0 unless every attempt built
                sink.keep(sink.row(ex, run, gen, i, s, built_passes if steps is not None and run.decoder.own_loop
                                   else None))
                totals[run.name][0] += gen.new_tokens
                totals[run.name][1] += gen.seconds
        rates = {name: (t / s if s else 0.0) for name, (t, s) in totals.items()}
        bar.set_postfix({f"{n} tok/s": f"{rates[n]:.1f}" for n in dict.fromkeys([plan.baseline, plan.under_test])})
        tracker.log({f"{n}/tokens_per_s": v for n, v in rates.items()}, step=step)
    bar.close()


def _loop_batched(plan: RunPlan, built: Built, todo: list, sink: Sink, out_dir: Path) -> None:
    """``batch_size > 1``: the examples in waves, each method decoding a wave as one continuous batch
    (:mod:`selfspec.evaluation.batches`), each example of a wave settled first (:func:`_settle`); each
    row appended as its sequence finishes, each batch a line of batches.jsonl."""
    with sink.waves(out_dir, len(todo)):
        decode_waves(built.runs, todo, plan.batch_size, plan.n_samples, plan.budget, sink)


def run_summary(cfg: DictConfig, plan: RunPlan, built: Built, out_dir: Path, rows: list[dict[str, Any]],
                info: dict[str, Any], identity: dict[str, Any]) -> dict[str, Any]:
    """summary.json of a finished run: every method's figures over ``rows`` (:func:`summarize`), the
    samples files written beside it, and what produced it (model, config, machine, profile, contention,
    the run's ``identity``'s artefacts and inputs)."""
    sampling, task, budget, examples = plan.sampling, plan.task, plan.budget, plan.examples
    loaded, runs, profile = built.loaded, built.runs, built.profile
    artefacts = identity["artefacts"]
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
        under_load = contention(finished[baseline], profile, plan.contention, here,
                                spoiled=spoiled_generations(finished, profile, here, plan.contention_spike))
    else:
        under_load = batch_contention(batches.get(baseline), profile, plan.contention, here)
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
        "sample_draw": None if sampling.greedy else DRAW,
        "samples_files": samples_files,
        "max_new_tokens": budget,
        "n_examples": len(examples),
        "run_info": info,
        "model_shape": model_shape(loaded.model),
        "profile": profile.summary() if profile is not None else None,
        "contention": under_load,
        "threads": {"policy": built.threads, "configured": torch.get_num_threads()},
        "batch_size": plan.batch_size,
        "batches": batches,
        "capture": _capture_summary(loaded.model, finished),
        "method_configs": {r.name: OmegaConf.to_container(r.cfg, resolve=True) for r in runs},
        "artefacts": {method: sorted(paths) for method, paths in artefacts.items()},
        "artefact_digests": artefacts,
        "inputs": identity["inputs"],
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


def _write_samples(out_dir: Path, task, rows: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """Per method, ``samples-<method>.jsonl`` in the task's own samples format (HumanEval's
    ``task_id``/``completion``), of the generations the summary scores; none for other tasks."""
    import json

    written: dict[str, str] = {}
    for name, rs in rows.items():
        lines = [task.sample_record(str(r["id"]), r["prediction"]) for r in rs]
        if not lines or any(line is None for line in lines):
            continue
        path = write_text(out_dir / f"samples-{name}.jsonl", "".join(json.dumps(line) + "\n" for line in lines))
        written[name] = path.name
    return written


def _batches(out_dir: Path, rows: dict[str, list[dict[str, Any]]], baseline: str, profile) -> dict[str, Any]:
    """Throughput, latency and the predicted batch seconds per method
    (:func:`~selfspec.evaluation.batches.batch_summary`)."""
    return batch_summary(open_batches(out_dir).rows(), rows, baseline, profile)


def track_summary(tracker: Tracker, summary: dict[str, Any], rows: list[dict], names: list[str], under_test: str,
                  info: dict[str, Any]) -> None:
    """The run's summary and its examples' rows (the methods of this run) in the tracker."""
    tracker.summary({"format": summary["format"], "method": under_test, "methods": summary["methods"],
                     "method_configs": summary["method_configs"], "run_info": info})
    tracker.table("examples", [{k: v for k, v in r.items() if k != "stats"} | {"stats": str(r.get("stats"))}
                               for r in rows if r.get("method") in names])


def log_summary(per_method: dict[str, dict[str, Any]], baseline: str) -> None:
    for name, m in per_method.items():
        log.info("%-18s %6.2f tok/s  speedup %s  tau %s  consistency %s", name, m["tokens_per_s"] or 0.0,
                 _fmt(m["speedup"]), _fmt(m["tau"]), _fmt(m["consistency"]))


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


__all__ = ["RUN_FORMAT", "Sink", "decode", "log_summary", "run_summary", "track_summary"]

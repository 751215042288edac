"""The evaluation in batches (``batch_size`` > 1, issue 54): every method decodes several examples at once.

The examples still to do are taken in **waves** of ``2 · batch_size``. Per wave and sample, each method
decodes the wave as one continuous batch (:class:`selfspec.models.batch.Batch`: at most ``batch_size``
sequences at once, the next example joining in the slot of one that finishes), the methods one after
another, so a slow drift of the machine hits them alike, as the interleaving per example does at
``batch_size=1``. Each slot is a fork of the method's decoder (:meth:`~selfspec.decoding.base.Decoder.fork`):
it carries its own policy state (a draft-stop threshold, a gate, SWIFT's layer search) over the examples
it decodes, so every choice a method makes per sequence (DEL's exit layer, PPD's tree, the n-gram match,
the gate's decision) is made by that sequence's slot, from its own history. Its history is not the
batch-1 run's (the examples before it in the run), so under sampling a method that carries state
(:meth:`~selfspec.decoding.base.Decoder.carried`) decodes other sequences than at batch 1, of the same
distribution; greedy, and for a method that carries none, they are the batch-1 ones. ``hf_generate`` decodes each
wave as one left-padded batch of transformers' ``generate``; the other HF peers (assisted generation)
decode one sequence at a time and are refused.

Every generation is a row of ``results.jsonl`` as at ``batch_size=1`` (``batch``: the size and wave); its
``seconds`` are the sequence's latency, from its first step to its last, waits for the other sequences
included. Each (wave, sample, method) is a line of ``batches.jsonl``: the batch's wall seconds, its
sequences, tokens and steps, and every pass it ran as a ledger op (a walk's rows are all its sequences'
rows; :attr:`~selfspec.models.batch.Batch.ops`). A batch's rows are appended when the batch ends, just
before its line: an interrupted batch leaves none, so a resumed run decodes it again whole (issue 68: a
finished sequence's row kept without its batch's line left the summary covering some sequences only).
The summary's ``batches`` reports per method the throughput (new tokens per second of batch wall time),
the mean latency, the speedup over the baseline's throughput, and the batch seconds a profile predicts:
every pass priced at its rows (a pass of B·k rows) plus the profile's host time per sequence step; each
method's ``sequences`` (in its batches) and ``rows`` (the generations reported), and no speedup where
they differ.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Protocol

from selfspec.measure.speedup import per_token, speedup
from selfspec.models.batch import Batch
from selfspec.tracking import ResultsFile

log = logging.getLogger(__name__)

BATCHES = "batches.jsonl"
#: what every line of batches.jsonl holds
BATCH_KEYS = ("wave", "method", "seconds")
#: examples per wave, in batches
WAVE = 2

__all__ = ["BATCHES", "BATCH_KEYS", "WaveSink", "batch_summary", "decode_waves", "waves"]


def waves(examples: list, size: int) -> list[list]:
    """The examples in waves of ``WAVE · size``."""
    n = WAVE * size
    return [examples[i:i + n] for i in range(0, len(examples), n)]


class WaveSink(Protocol):
    """What :func:`decode_waves` reads of the run and hands each generation to (the evaluation's
    :class:`~selfspec.evaluation.loop.Sink`)."""

    def pending(self, ex, sample: int, run) -> bool: ...  # whether ``run`` still owes sample ``sample`` of ``ex``
    def prompt(self, ex) -> list[int]: ...
    def sampling(self, sample: int) -> Any: ...  # sample ``sample``'s sampling settings
    def settle(self, ex) -> None: ...  # an untimed step of ``ex``'s prompt
    def row(self, ex, run, gen, sample: int, sampling) -> dict: ...  # a generation's results line
    def keep(self, row: dict) -> None: ...
    def batch(self, line: dict) -> None: ...  # a batch's line of batches.jsonl
    def wave_done(self, wave: int) -> None: ...


def decode_waves(runs, todo: list, size: int, n_samples: int, budget: int, sink: WaveSink) -> None:
    """Decode ``todo`` in waves (module docstring): per wave, sample and method, one batch of the examples
    ``sink.pending``; each generation's row built by ``sink.row(example, run, generation, sample, sampling)``
    as it finishes and handed to ``sink.keep`` when its batch ends, then the batch's line to ``sink.batch``.
    ``sink.settle(example)`` runs, untimed, for each example of a wave with work left before the wave's
    first batch (the runner's prompt step of the baseline, as before each example at ``batch_size=1``). A
    method's decoder is forked once per slot a batch can fill: ``size``, or fewer examples."""
    forks = min(size, len(todo))
    slots = {run.name: [run.decoder.fork() for _ in range(forks)] for run in runs if run.decoder.own_loop}
    for w, wave in enumerate(waves(todo, size)):
        for ex in wave:
            if any(sink.pending(ex, i, run) for i in range(n_samples) for run in runs):
                sink.settle(ex)
        for i in range(n_samples):
            s = sink.sampling(i)
            for run in runs:
                examples = [ex for ex in wave if sink.pending(ex, i, run)]
                if not examples:
                    continue

                kept: list[dict] = []

                def finished(j: int, gen, examples=examples, run=run, s=s, i=i, kept=kept) -> None:
                    kept.append(sink.row(examples[j], run, gen, i, s) | {"batch": {"size": size, "wave": w}})

                t0 = time.perf_counter()
                if run.decoder.own_loop:
                    batch = Batch(run.decoder.model, forks)
                    mine = slots[run.name]
                    gens = batch.run([lambda slot, p=sink.prompt(ex): mine[slot].generate(p, budget, s, joins=batch)
                                      for ex in examples], done=finished)
                    ran = {"rounds": batch.rounds, "passes": {str(k): v for k, v in sorted(batch.passes.items())},
                           "ops": [op.row() for op in batch.ops]}
                else:  # transformers' batched generate (hf_generate), a wave of at most `size` at a time
                    gens = []
                    for k in range(0, len(examples), size):
                        part = examples[k:k + size]
                        prompts = [sink.prompt(ex) for ex in part]
                        for j, gen in enumerate(run.decoder.generate_batch(prompts, budget, s)):
                            finished(k + j, gen)
                            gens.append(gen)
                    ran = {}
                seconds = time.perf_counter() - t0
                for row in kept:
                    sink.keep(row)
                sink.batch({"wave": w, "sample": i, "method": run.name, "size": size, "sequences": len(examples),
                            "seconds": seconds, "new_tokens": sum(g.new_tokens for g in gens),
                            "steps": sum(g.steps for g in gens), **ran})
        sink.wave_done(w)


def batch_summary(lines: list[dict], rows: dict[str, list[dict]], baseline: str, profile=None) -> dict[str, Any]:
    """Per method, over its batches: ``size``, ``sequences`` (in its batches), ``rows`` (its generations in
    ``rows``, the ones the summary reports) and ``complete`` (the two agree), ``tokens_per_s`` (new tokens /
    batch wall seconds: the throughput), ``latency_s`` (mean seconds of a sequence, of ``rows``), ``speedup``
    (its throughput over the baseline's; null unless both are complete: throughputs over other sequences
    do not compare), and with a ``profile`` ``predicted_seconds`` (every pass of its batches priced, plus
    the profile's host time per sequence step), ``measured_over_predicted`` and ``predicted_speedup``."""
    out: dict[str, Any] = {}
    for name in dict.fromkeys(line["method"] for line in lines):
        mine = [line for line in lines if line["method"] == name]
        seconds = sum(line["seconds"] for line in mine)
        tokens = sum(line["new_tokens"] for line in mine)
        sequences = sum(line["sequences"] for line in mine)
        r: dict[str, Any] = {"size": mine[0]["size"], "batches": len(mine), "sequences": sequences,
                             "rows": len(rows.get(name, [])), "complete": sequences == len(rows.get(name, [])),
                             "new_tokens": tokens,
                             "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else None,
                             "latency_s": statistics.mean(x["seconds"] for x in rows.get(name, [])) if rows.get(name)
                             else None}
        if profile is not None and all("ops" in line for line in mine):
            predicted = sum(sum(profile.op(op) for op in line["ops"]) + profile.host * line["steps"] for line in mine)
            r["predicted_seconds"] = predicted
            r["measured_over_predicted"] = seconds / predicted if predicted else None
        out[name] = r
    base = out.get(baseline) or {}
    for name, r in out.items():
        if not (r["complete"] and base.get("complete")):
            log.warning("batches of %s cover %d sequences, its rows %d (the baseline %s: %s of %s): no batch speedup "
                        "is taken", name, r["sequences"], r["rows"], baseline, base.get("sequences"), base.get("rows"))
            r["speedup"] = None
            continue
        r["speedup"] = speedup(per_token(base.get("seconds"), base.get("new_tokens")),
                               per_token(r["seconds"], r["new_tokens"]))
        if "predicted_seconds" in base and "predicted_seconds" in r:
            r["predicted_speedup"] = speedup(per_token(base["predicted_seconds"], base["new_tokens"]),
                                             per_token(r["predicted_seconds"], r["new_tokens"]))
    return out


def open_batches(out_dir) -> ResultsFile:
    """The run directory's ``batches.jsonl``."""
    return ResultsFile(out_dir / BATCHES, BATCH_KEYS)

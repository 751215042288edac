"""``job=draft_vocab``: a truncated draft vocabulary (beyond the papers).

After FR-Spec (arXiv 2502.14856) and VocabTrim (arXiv 2506.22694): a draft token pays the whole
LM head (SmolLM2-135M: 49,152 rows, several decoder layers' worth) although the model produces a
small part of its vocabulary. The job

* generates the model's own **greedy continuations** of task prompts (``job.data=task``) or of
  several tasks' prompts (``mixed``) — the same data and cache as ``job=heads``
  (:func:`selfspec.training.continuations.build_data`), from the end of each task's pool;
* **counts** the generated tokens of the training continuations and ranks the vocabulary by count
  (ties: lower token id first; tokens never seen follow in id order);
* prices the **head cost** at each candidate size with the run's cost profile (its head table by
  vocabulary rows, in units of one decoder layer at the context the draft pass sees,
  :data:`CONTEXT`) and measures the held-out **coverage** (share of the held-out continuations'
  tokens inside the kept set) and the **context coverage** (inside the kept set or earlier in their own
  sequence: what a method drafts from with ``draft_vocab_context``, its default);
* keeps ``job.size`` tokens when given (exactly), else the candidate maximising
  ``context_coverage(s) / (draft_layers + head_layers(s))``: a draft token outside the draft head's
  rows is always rejected, so coverage bounds the acceptance a draft can keep, and one draft pass costs
  its layers plus the head.

Output: a ``draft_vocab`` artefact (``ids`` in rank order and their ``counts``) whose ``meta.json``
records the size and how it was chosen (every candidate's coverage and cost), the data it was
counted on, the tokens counted and the held-out coverage. Methods read it through
``method.draft_vocab`` (:mod:`selfspec.models.heads`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from selfspec.config import checks
from selfspec.measure.peak import MemoryModel, Shape, Term, generation_bytes
from selfspec.models.heads import draft_vocab_tensors
from selfspec.training.continuations import build_data, data_tag, data_tasks, generation_options
from selfspec.training.driver import TIMED_BY_PROFILE, Job, Result, job_keys

log = logging.getLogger(__name__)

OBJECTIVE = "context_coverage / (draft_layers + head_layers)"
#: cached tokens at which a decoder layer is priced (the unit of the head's cost; DEL prices its
#: exit heads at the same context)
CONTEXT = 512


# --- counting and selection (no model) ------------------------------------------------------------
def generated(seqs) -> list[list[int]]:
    """The generated tokens of each sequence (after its prompt)."""
    return [list(s.ids[s.start + 1 :]) for s in seqs]


def count_tokens(token_lists, vocab_size: int) -> torch.Tensor:
    """``[V]`` int64 counts of the tokens in ``token_lists``."""
    flat = [t for toks in token_lists for t in toks]
    return torch.bincount(torch.tensor(flat, dtype=torch.long), minlength=vocab_size)[:vocab_size] if flat else \
        torch.zeros(vocab_size, dtype=torch.long)


def rank(counts: torch.Tensor) -> torch.Tensor:
    """Token ids by count, most frequent first; equal counts in id order."""
    return torch.sort(-counts, stable=True).indices


def coverage(kept, token_lists) -> float | None:
    """Share of the tokens of ``token_lists`` that lie in ``kept`` (None when there are none)."""
    keep = set(int(t) for t in kept)
    flat = [t for toks in token_lists for t in toks]
    return sum(t in keep for t in flat) / len(flat) if flat else None


def context_coverage(kept, seqs) -> float | None:
    """Share of the generated tokens of ``seqs`` (:class:`~selfspec.training.continuations.Sequence`) that lie
    in ``kept`` or earlier in their own sequence (its prompt, or generated before them): what a draft head
    holds whose generation's context joins its kept set (``method.draft_vocab_context``); None when there are
    none."""
    keep = set(int(t) for t in kept)
    hit = n = 0
    for s in seqs:
        seen = set(s.ids[: s.start + 1])
        for t in s.ids[s.start + 1 :]:
            hit += t in keep or t in seen
            n += 1
            seen.add(t)
    return hit / n if n else None


def choose_size(candidates: list[dict], draft_layers: float, measure: str = "context_coverage") -> dict:
    """The candidate (``{"size", measure, "head_layers"}``) maximising :data:`OBJECTIVE` with ``measure`` as
    its coverage (default the coverage with each generation's context, as the methods draft by default);
    equal objectives: the smaller size. Each candidate gets its ``objective``."""
    for c in candidates:
        c["objective"] = (c[measure] or 0.0) / (draft_layers + c["head_layers"])
    return max(candidates, key=lambda c: (c["objective"], -c["size"]))


# --- the job -----------------------------------------------------------------------------------------
def prepare(cfg) -> dict:
    """Every key of conf/job/draft_vocab.yaml checked and the prompt tasks read, without the model."""
    job, key = cfg.job, "job.{}".format
    checks.renamed("job", job, {"cost_repeats": TIMED_BY_PROFILE})
    sizes = checks.integers(key("sizes"), job.sizes, 1, distinct=True)
    opts = {
        "size": checks.optional(checks.integer, key("size"), job.size, 1,
                                why="tokens kept; null = chosen from the priced head costs"),
        "sizes": sizes,
        "draft_layers": checks.optional(checks.number, key("draft_layers"), job.draft_layers, 0,
                                        low_open=True, why="null = a quarter of the model's layers"),
        **generation_options(job),
    }
    if opts["size"] is None and not sizes:
        raise checks.refuse(key("sizes"), job.sizes, "needs at least one candidate size when job.size is null")
    job_keys(job, opts)
    opts["tasks"] = data_tasks(cfg, opts["data"], opts["mixed_tasks"])
    return opts


def measure_candidates(profile, model, ranked: torch.Tensor, sizes: list[int], held_seqs) -> tuple:
    """Held-out coverage (of the kept set alone, and with each generation's context) and priced head cost
    (seconds, decoder layers) of each size, the full vocabulary included, from the run's cost profile;
    returns ``(candidates, layer_seconds, full_head_seconds)``."""
    held = generated(held_seqs)
    out = [{"size": s, "coverage": coverage(ranked[:s].tolist(), held),
            "context_coverage": context_coverage(ranked[:s].tolist(), held_seqs), "head_seconds": profile.head(1, s),
            "head_layers": profile.head_layers(s, CONTEXT)} for s in sorted(set(sizes))]
    return out, profile.layer_cost(1, CONTEXT), profile.head(1, model.vocab_size)


def default_dir(cfg, opts: dict) -> Path:
    """``draft_vocab/<model>-<task|mixed>``."""
    from selfspec.store.artefacts import default_artefact_dir

    return default_artefact_dir("draft_vocab", str(cfg.model.name), data_tag(opts))


def candidate_sizes(opts: dict, v: int) -> tuple[list[int], str]:
    """The sizes to measure (the full vocabulary ``v`` always among them) and how the kept one is
    chosen: ``given`` (``job.size``) or ``auto`` (the objective over ``job.sizes``)."""
    if opts["size"] is not None:
        return [opts["size"], v], "given"
    dropped = [s for s in opts["sizes"] if s >= v]
    if dropped:
        log.info("draft vocab: candidate sizes %s are not below the vocabulary (%d): the full head stands for them",
                 dropped, v)
    return [s for s in opts["sizes"] if s < v] + [v], "auto"


def objective(ctx) -> Result:
    """Count the model's own continuations' tokens and keep the draft vocabulary :func:`prepare` asked for."""
    opts, loaded = ctx.opts, ctx.loaded
    model = loaded.model
    v = model.vocab_size
    if opts["size"] is not None and opts["size"] > v:
        raise checks.refuse("job.size", opts["size"], f"must be in [1, {v}] ({loaded.name}'s vocabulary)")
    t0 = time.perf_counter()
    train_seqs, held_seqs, tag, info = build_data(opts, loaded, ctx.progress)
    data_seconds = time.perf_counter() - t0
    train_tokens, held_tokens = generated(train_seqs), generated(held_seqs)
    counts = count_tokens(train_tokens, v)
    ranked = rank(counts)
    draft_layers = opts["draft_layers"] or max(1.0, model.num_layers / 4)
    sizes, choice = candidate_sizes(opts, v)
    candidates, layer_s, full_s = measure_candidates(ctx.profile, model, ranked, sizes, held_seqs)
    best = choose_size(candidates, draft_layers)
    chosen = next(c for c in candidates if c["size"] == opts["size"]) if choice == "given" else best
    size = chosen["size"]
    kept = ranked[:size]
    selection = {"choice": choice, "objective": OBJECTIVE, "draft_layers": draft_layers, "layer_seconds": layer_s,
                 "full_head_seconds": full_s, "full_head_layers": full_s / layer_s if layer_s > 0 else None,
                 "candidates": candidates, "best_by_objective": best["size"],
                 "reason": (f"size {size} given (job.size); the objective would pick {best['size']}"
                            if choice == "given" else
                            f"size {size} maximises {OBJECTIVE} = {chosen['objective']:.4f} over {[c['size'] for c in candidates]}")}
    figures = {
        "size": size,
        "coverage": chosen["coverage"],
        "context_coverage": chosen["context_coverage"],
        "train_coverage": coverage(kept.tolist(), train_tokens),
        "tokens_counted": int(counts.sum()),
        "heldout_tokens": sum(len(t) for t in held_tokens),
        "distinct_tokens": int((counts > 0).sum()),
        "head_layers": chosen["head_layers"],
    }
    metrics = {**figures, "data_seconds": data_seconds, "train_sequences": len(train_seqs),
               "heldout_sequences": len(held_seqs)}
    log.info("draft vocab: %d of %d tokens kept (%s), held-out coverage %s, head %.2f layers (full %.2f); %s",
             size, v, choice, chosen["coverage"], chosen["head_layers"], selection["full_head_layers"] or 0.0,
             selection["reason"])
    return Result(tensors=draft_vocab_tensors(kept, counts[kept]), task=tag, metrics=metrics,
                  meta={"data": info, "selection": selection, **figures}, summary={**figures, "choice": choice},
                  tables={"draft_vocab_candidates": candidates})


# --- memory (selfspec.measure.peak) ----------------------------------------------------------------
def _job_terms(s: Shape, j, b: int) -> list[list[Term]]:
    new = int(j.gen_tokens) + 1
    prompt = int(j.max_prompt_tokens or 4096)
    sizes = [int(x) for x in j.sizes if int(x) < s.vocab] + ([int(j.size)] if j.size is not None else [])
    return [
        [Term("generation", generation_bytes(s, int(j.gen_batch), prompt, new, b), "job.gen_batch / job.max_prompt_tokens")],
        [Term("truncated head", max(sizes, default=0) * s.hidden * b + s.vocab * 4, "job.sizes / job.size")],
    ]


def memory_terms(shape: Shape, cfg, b: int, context: int, prompt: int | None) -> list[list[Term]]:
    """This job's memory terms beside the weights, by phase (:class:`~selfspec.measure.peak.MemoryModel`)."""
    return _job_terms(shape, cfg.job, b)


#: fitted by ``scripts/measure_memory.py --fit`` (docs/memory_measured.json); docs/usage.md, "Memory per job and model size"
MEMORY = MemoryModel(memory_terms, s=1.0, runtime=502267904.0,
                     fallbacks=((), ("job.gen_batch=2",)))

JOB = Job(memory=MEMORY, kind="draft_vocab", tracker_job="draft-vocab", prepare=prepare, default_dir=default_dir,
          objective=objective, prices=lambda cfg: "job=draft_vocab (each candidate's head cost)")

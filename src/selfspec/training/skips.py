"""Skip-set search for Draft & Verify (Zhang et al., arXiv 2309.08168, §3.3).

``python -m selfspec.train job=skips model=<name> task=<name>`` (``make search-skips``) finds the
attention and MLP sublayers to skip while drafting. The search space has one binary choice per
sublayer, ``z in {0,1}^{2L}`` for an ``L``-layer model (attention dimensions first, then MLP,
as in the authors' code; values in [0, 1], > 0.5 = skip). Three searches (``job.search``):

``bo``        the paper: Bayesian optimisation (``bayesian-optimization``, Gaussian process,
              ``random_state`` = seed) of the **measured** mean time per verified token of
              greedy self-speculative decoding on a development set (§3.3 "Objective
              Function"; paper: 8 prompts, 1-shot, 32 new tokens, 1,000 iterations). Noisy on a
              shared machine and slow: every candidate is decoded and timed.
``bo_model``  the same BO on a deterministic **cost model**: the candidate's drafts are scored
              by teacher forcing (one batched forward over every dev position, see
              :class:`CostModel`), its decoding is simulated with the real draft-exit rule, and
              time is predicted from the run's cost profile. With ``job.drafts=decoded``
              (:class:`DecodedCostModel`) the candidate instead decodes the dev prompts, greedy, in
              the real loop, and its trace is priced with the profile: the acceptance is the real
              one (teacher forcing scores every draft as a step's first), at a decode per candidate.
``greedy``    a deterministic layer-importance pass on the cost model: rank sublayers by the
              agreement they cost per unit of time they save, take the best prefix of that
              ranking, then (``job.refine``) one pass of single-sublayer toggles (at most 6L evaluations).

Every evaluation is one row of ``trace.jsonl`` (iteration, sublayers skipped, objective,
predicted/measured speedup, acceptance rate) in ``<artefact>.search-<search>/``, also logged to
the tracker. A rerun **resumes**: the search is replayed from the trace (evaluations already
in it are read, not recomputed; BO is seeded, so it proposes the same points) and continues.
The result is a ``skip_set`` artefact (``attn`` / ``mlp`` int8 masks of length L) with the
trace and the Figure-4 plot (speedup against number of skipped sublayers) copied into it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import OmegaConf

from selfspec.config import checks
from selfspec.decoding.draft_verify import DecodingOptions, DraftVerify, SkipSetDrafter, skip_set_tensors
from selfspec.decoding.vanilla import Vanilla
from selfspec.measure.peak import MemoryModel, Shape, Term, layer_bytes, scores_bytes
from selfspec.measure.speedup import speedup
from selfspec.models.layered import LayeredModel, Pass, Rows, SkipSet
from selfspec.models.ledger import HeadOp, LayerOp
from selfspec.training.bars import bar
from selfspec.training.driver import TIMED_BY_PROFILE, Job, Result, job_keys, task_names

log = logging.getLogger(__name__)

SEARCHES = ("bo", "bo_model", "greedy")
#: how the cost model's searches get a candidate's drafts (``job.drafts``)
DRAFTS = ("forced", "decoded")


# --- config and development set (before the model loads) -------------------------------------
def prepare(cfg) -> dict:
    """Every key of conf/job/skips.yaml checked and the development tasks' data read — all that can
    fail without the model (the driver calls it first)."""
    jc, key = cfg.job, "job.{}".format
    checks.renamed("job", jc, {"calibration_repeats": TIMED_BY_PROFILE})
    search = checks.choice(key("search"), jc.search, SEARCHES)
    tasks = checks.optional(task_names, key("tasks"), jc.tasks)
    n_prompts = checks.integer(key("n_prompts"), jc.n_prompts, max(1, len(tasks or ())),
                               why="dev prompts, split over job.tasks: at least one per task")
    opts = {
        "search": search,
        "drafts": checks.choice(key("drafts"), jc.drafts, DRAFTS),
        "iterations": checks.integer(key("iterations"), jc.iterations, 0),
        "init_points": checks.integer(key("init_points"), jc.init_points, 0),
        "gp_alpha": checks.number(key("gp_alpha"), jc.gp_alpha, 0, low_open=True, why="the GP's noise term"),
        "acq_n_random": checks.integer(key("acq_n_random"), jc.acq_n_random, 1),
        "acq_n_smart": checks.integer(key("acq_n_smart"), jc.acq_n_smart, 0),
        "warm_start": checks.listed(warm_start_set, key("warm_start"), jc.warm_start or []),
        "probe_fractions": checks.listed(checks.probability, key("probe_fractions"), jc.probe_fractions or [],
                                         low_open=True, why="fraction of the middle sublayers to skip"),
        "tasks": tasks,
        "n_prompts": n_prompts,
        "max_new_tokens": checks.integer(key("max_new_tokens"), jc.max_new_tokens, 1 if search == "bo" else 3,
                                         why="tokens per dev prompt; the cost model needs >= 3"),
        "max_prompt_tokens": checks.optional(checks.integer, key("max_prompt_tokens"), jc.max_prompt_tokens, 1),
        "decoding": decoding_options(jc),
        "repeats": checks.integer(key("repeats"), jc.repeats, 1),
        "patience": checks.integer(key("patience"), jc.patience, 0, why="0 = try every prefix length"),
        "refine": checks.flag(key("refine"), jc.refine),
        "plot": checks.flag(key("plot"), jc.plot),
    }
    job_keys(jc, opts)
    if search != "greedy" and not (opts["iterations"] + opts["init_points"] + len(opts["warm_start"])
                                   + len(opts["probe_fractions"])):
        raise checks.refuse(key("iterations"), opts["iterations"], "the search would evaluate nothing: raise "
                            "job.iterations or give job.warm_start / job.probe_fractions")
    opts["dev_tasks"] = dev_tasks(cfg, opts)
    return opts


def warm_start_set(key: str, value) -> SkipSet:
    """One ``job.warm_start`` entry, ``{attn: [...], mlp: [...]}`` (layer indices)."""
    if not hasattr(value, "items"):
        raise checks.refuse(key, value, "must be {attn: [layers], mlp: [layers]}")
    checks.known_keys(key, value, ("attn", "mlp"), "a warm-start skip set")
    return SkipSet.of(attn=checks.integers(f"{key}.attn", value.get("attn") or []),
                      mlp=checks.integers(f"{key}.mlp", value.get("mlp") or []))


def dev_tasks(cfg, opts: dict) -> list:
    """The development tasks (``job.tasks``, or the composed task), with ``job.n_prompts`` split
    evenly over them, as ``(task, k)``; each task's pool is read and checked now."""
    from selfspec.config import conf_dir
    from selfspec.tasks import build_task, model_chat

    names = opts["tasks"]
    task_cfgs = [OmegaConf.load(conf_dir() / "task" / f"{n}.yaml") for n in names] if names else [cfg.task]
    n = opts["n_prompts"]
    out = []
    for j, tcfg in enumerate(task_cfgs):
        task = build_task(tcfg, model_chat=model_chat(cfg), n_examples=None,
                          max_prompt_tokens=opts["max_prompt_tokens"])
        task.examples()  # read and check the pool now
        out.append((task, n // len(task_cfgs) + (1 if j < n % len(task_cfgs) else 0)))
    return out


def dev_prompts(tasks, tokenizer) -> tuple[list[list[int]], list[str]]:
    """Token ids of the dev prompts of :func:`dev_tasks` and their task names.

    Prompts are the *last* examples of each task's shuffled pool, so they differ from the first
    ``n_examples`` an evaluation uses whenever the pool holds more than both.
    """
    prompts, names = [], []
    for task, k in tasks:
        for ex in task.examples()[-k:]:
            prompts.append(task.encode(ex, tokenizer))
            names.append(task.name)
    return prompts, names


# --- timing helpers -------------------------------------------------------------------------
def decoding_options(jc) -> DecodingOptions:
    """``conf/method/draft_verify.yaml`` as composed (its draft-stop rule's defaults with it) with
    ``job.decoding`` overrides, checked once: the settings every candidate decodes with. ``draft_ngram``
    (the lookup drafting for the drafter) is refused: it changes what a draft costs, not what it is, and
    the search's cost models price one pass per draft."""
    from selfspec.config import load_method_config

    keys = DecodingOptions.keys()
    overrides = jc.get("decoding") or {}
    checks.known_keys("job.decoding", overrides, keys, "the Draft & Verify decoding settings")
    if overrides.get("draft_ngram") is not None:
        raise checks.refuse("job.decoding.draft_ngram", overrides.get("draft_ngram"), "null",
                            "a skip set is searched for the drafts themselves; the lookup drafting for the drafter "
                            "is a decoding setting of the method that reads the skip set (method/draft_ngram=cascade)")
    merged = OmegaConf.merge(OmegaConf.to_container(load_method_config("draft_verify")), overrides)
    return DecodingOptions.read({k: merged[k] for k in keys}, prefix="job.decoding")


def _decode_time(decoder, prompts, n_new, profile=None) -> tuple[float, int, int, int]:
    """(decode seconds without prefill, decoded tokens, drafted, accepted drafts) over the prompts;
    the prompt's pass is the generation's ledger's ``prefill`` (:mod:`selfspec.models.ledger`). With a
    ``profile``, the seconds are each generation's trace priced with it instead of timed."""
    secs, toks, drafted, accepted = 0.0, 0, 0, 0
    for ids in prompts:
        g, _ = decoder.generate_timed(ids, n_new)  # a new skip set's passes built (captured) untimed
        if profile is None:
            secs += g.seconds - g.ledger["prefill"]
        else:
            parts = profile.predict([t.row() for t in g.trace])
            secs += sum(parts.values()) - parts["prefill"]
        toks += g.new_tokens - 1
        drafted += sum(g.drafted_per_step)
        accepted += g.accepted_drafts
    return secs, toks, drafted, accepted


#: vanilla's decode time after a timed search over before it beyond which the search is said to
#: have been timed under changing load (:meth:`TimedObjective.remeasure_baseline`)
BASELINE_DRIFT = 1.25


class TimedObjective:
    """§3.3's objective: measured mean time per verified token (prefill excluded), greedy."""

    kind = "measured"

    def __init__(self, model: LayeredModel, prompts, n_new: int, decoding: DecodingOptions, repeats: int = 1):
        self.model, self.prompts, self.n_new = model, prompts, n_new
        self.decoding, self.repeats = decoding, max(1, int(repeats))
        Vanilla(model).generate(prompts[0], min(8, n_new))  # warm-up
        self.vanilla_spt = self.baseline()

    def baseline(self) -> float:
        van = Vanilla(self.model)
        runs = [_decode_time(van, self.prompts, self.n_new) for _ in range(max(2, self.repeats))]
        return statistics.median(s / t for s, t, _, _ in runs)

    def remeasure_baseline(self, first: float | None = None) -> float:
        """Time vanilla again after the search and take it as the baseline from here on; returns the
        new time over ``first`` (the search's first baseline: its trace's, when it was resumed; default
        this objective's). Candidates are only comparable if the machine's load did not change while
        they were timed: a drift past :data:`BASELINE_DRIFT` either way is said in the log (a search
        begun under load, loaded midway, or resumed on a machine loaded otherwise ranks its candidates
        by the load, not the skip set)."""
        first = self.vanilla_spt if first is None else first
        self.vanilla_spt = self.baseline()
        drift = self.vanilla_spt / first
        if not 1 / BASELINE_DRIFT <= drift <= BASELINE_DRIFT:
            log.warning("vanilla's decode time moved from %.1f to %.1f ms per token during the timed skip search "
                        "(%.2fx): the machine's load changed, so the candidates' times are not comparable; search "
                        "again on a quiet machine, deleting its trace if it was resumed (or job.search=bo_model, "
                        "which prices candidates instead)", first * 1e3, self.vanilla_spt * 1e3, drift)
        return drift

    def __call__(self, skip: SkipSet) -> dict[str, Any]:
        dec = DraftVerify(self.model, skip, self.decoding)
        runs = []
        for _ in range(self.repeats):
            dec.drafter.reset_draft_stop()
            runs.append(_decode_time(dec, self.prompts, self.n_new))
        secs, toks, drafted, accepted = sorted(runs, key=lambda r: r[0] / r[1])[len(runs) // 2]
        spt = secs / toks
        return {
            "objective": spt,
            "speedup": speedup(self.vanilla_spt, spt),
            "acceptance_rate": accepted / drafted if drafted else None,
            "tau": (toks + 0.0) / max(1, toks - accepted) if toks else None,
        }


# --- the deterministic cost model ----------------------------------------------------------
class CostModel:
    """Predicted time per verified token of a skip set, without decoding it.

    Set-up (once): greedy vanilla continuations ``c_1..c_T`` of the dev prompts; the full
    model's K/V of every ``prompt + c_1..c_{T-1}`` in one layer cache (blocks side by side, a
    block-diagonal mask). Costs are the run's cost profile's prices at the first prompt's context,
    as a recorded step is priced: a draft pass is one row through the sublayers the skip set keeps
    and the head, a verification of ``n`` tokens one pass of ``n`` rows (:meth:`draft_cost`,
    :meth:`verify_cost`, :meth:`sublayer_cost`).

    Per candidate: ONE forward over all ``n_prompts x (T-1)`` pending tokens with the skipped
    sublayers — query ``c_j`` attends to the full model's K/V of its prefix and to its own draft
    K/V — gives the draft's top-1 token and confidence at every position, i.e. exactly the
    first draft of every step. Decoding is then simulated with the real draft-exit rule
    (its ``draft_stop``): drafts continue while confident, are accepted while
    they match ``c``. Approximations: drafts after the first in a step see exact rather than
    drafted K/V of their predecessors, and confidences after a mismatch are teacher-forced.
    """

    kind = "predicted"

    def __init__(self, model: LayeredModel, prompts, n_new: int, decoding: DecodingOptions, profile=None):
        if n_new < 3:
            raise ValueError("job.max_new_tokens must be >= 3 for the cost model (drafts need room)")
        if profile is None:
            raise ValueError("the skip search's cost model prices candidates with a cost profile: set profile=auto")
        self.model, self.decoding, self.n_new = model, decoding, n_new
        self.profile, self.context = profile, len(prompts[0])
        van = Vanilla(model)
        self.targets: list[list[int]] = []
        blocks, q_tok, q_pos, q_allow = [], [], [], []
        offset = 0
        for ids in prompts:
            cont = van.generate(ids, n_new).tokens  # no EOS: exactly n_new tokens
            self.targets.append(cont)
            seq = list(ids) + cont[:-1]
            blocks.append((offset, seq))
            p = len(ids)
            for j in range(1, n_new):  # pending c_j at position p + j - 1 predicts c_{j+1}
                q_tok.append(cont[j - 1])
                q_pos.append(p + j - 1)
                q_allow.append((offset, offset + p + j - 1))
            offset += len(seq)
        self.base = offset
        nq = len(q_tok)
        self.cache = model.new_cache(self.base + nq)
        with torch.inference_mode():
            for off, seq in blocks:  # full K/V of each block, written at its offset
                n = len(seq)
                allow = torch.zeros(n, off + n, dtype=torch.bool, device=model.device)
                allow[:, off:] = torch.ones(n, n, dtype=torch.bool, device=model.device).tril()
                model.forward(torch.tensor([seq], device=model.device), self.cache,
                              Pass(rows=Rows.packed(model.positions(0, n), model.prepare_mask(allow))))
        allow = torch.zeros(nq, self.base + nq, dtype=torch.bool, device=model.device)
        for q, (a, b) in enumerate(q_allow):
            allow[q, a:b] = True
            allow[q, self.base + q] = True
        self.q_ids = torch.tensor([q_tok], device=model.device)
        self.q_pos = torch.tensor([q_pos], device=model.device)
        self.q_mask = model.prepare_mask(allow)
        self.q_target = torch.tensor([c for cont in self.targets for c in cont[1:]], device=model.device)
        self.vanilla_spt = self.verify_cost(1)

    # -- costs (the profile's prices) ------------------------------------------------------
    def draft_cost(self, skip: SkipSet) -> float:
        """One draft: a row through the sublayers ``skip`` keeps, the head and the host."""
        L = self.model.num_layers
        return self.profile.price([LayerOp("draft", 1, L - len(skip.attn), L - len(skip.mlp), self.context),
                                   HeadOp("draft", 1, self.model.vocab_size)])

    def verify_cost(self, n: int) -> float:
        """The verification of ``n - 1`` drafts: a pass of ``n`` rows (one row: vanilla's step)."""
        return self.profile.pass_cost(n, self.context)

    def sublayer_cost(self, kind: str) -> float:
        """What skipping one ``attn`` or ``mlp`` sublayer saves a draft."""
        return self.profile.attention_cost(1, self.context) if kind == "attn" else self.profile.mlp_cost(1)

    # -- drafts --------------------------------------------------------------------------
    def draft_agreement(self, skip: SkipSet) -> tuple[torch.Tensor, torch.Tensor]:
        """(match, confidence) of the first draft at every dev position (teacher forcing)."""
        model = self.model
        with torch.inference_mode():
            h = model.forward(self.q_ids, self.cache, Pass(skip=skip, rows=Rows.packed(self.q_pos, self.q_mask)))
            self.cache.truncate(self.base)
            conf, tok = model.logits(h[0]).softmax(-1).max(-1)
        return (tok == self.q_target).cpu(), conf.cpu()

    def __call__(self, skip: SkipSet) -> dict[str, Any]:
        match, conf = self.draft_agreement(skip)
        match, conf = match.tolist(), conf.tolist()
        sim = SkipSetDrafter(self.model, skip, self.decoding)  # the drafter alone: its draft-stop rule
        c_draft = self.draft_cost(skip)
        T, per = self.n_new, self.n_new - 1
        cost, drafted_all, accepted_all, steps = 0.0, 0, 0, 0
        for b in range(len(self.targets)):
            m, cf = match[b * per:(b + 1) * per], conf[b * per:(b + 1) * per]
            sim.draft_stop.start_example()
            t = 1  # committed tokens (c_1 from prefill); query t-1 is pending c_t
            while t < T:
                k_max = sim.draft_room(sim.max_draft, T - t)
                drafted = accepted = 0
                ok = True
                for d in range(k_max):
                    q = t - 1 + d
                    drafted += 1
                    ok = ok and m[q]
                    accepted += ok
                    if cf[q] < sim.threshold:  # the draft-stop rule (0 when drafting always runs to K)
                        break
                cost += drafted * c_draft + self.verify_cost(drafted + 1)
                if drafted:
                    sim.draft_stop.update(drafted, accepted, hit_max=drafted == sim.max_draft)
                drafted_all, accepted_all, steps = drafted_all + drafted, accepted_all + accepted, steps + 1
                t += accepted + 1
        spt = cost / (len(self.targets) * per)
        return {
            "objective": spt,
            "speedup": speedup(self.vanilla_spt, spt),
            "acceptance_rate": accepted_all / drafted_all if drafted_all else None,
            "tau": len(self.targets) * per / steps,
            "agreement": sum(match) / len(match),
        }


class DecodedCostModel(CostModel):
    """:class:`CostModel` whose candidates decode (``job.drafts=decoded``): each candidate's Draft & Verify
    decodes the dev prompts, greedy, ``n_new`` tokens each, in the real loop (its drafts see the K/V their
    predecessors' draft passes wrote, as they do when it runs), and its step trace is priced with the
    profile, the prompt's step left out (:meth:`~selfspec.measure.profile.Profile.predict`): deterministic
    on any load, with the real acceptance, at a decode per candidate. Vanilla's decodes of the same prompts
    are priced the same way. The greedy search's ranking still scores each sublayer's first drafts by
    teacher forcing (:meth:`CostModel.draft_agreement`); each prefix and toggle it evaluates decodes."""

    def __init__(self, model: LayeredModel, prompts, n_new: int, decoding: DecodingOptions, profile=None):
        super().__init__(model, prompts, n_new, decoding, profile)
        self.prompts = prompts
        seconds, tokens, _, _ = _decode_time(Vanilla(model), prompts, n_new, profile)
        self.vanilla_spt = seconds / max(tokens, 1)

    def __call__(self, skip: SkipSet) -> dict[str, Any]:
        seconds, tokens, drafted, accepted = _decode_time(DraftVerify(self.model, skip, self.decoding), self.prompts,
                                                          self.n_new, self.profile)
        spt = seconds / max(tokens, 1)
        return {
            "objective": spt,
            "speedup": speedup(self.vanilla_spt, spt),
            "acceptance_rate": accepted / drafted if drafted else None,
            "tau": tokens / max(1, tokens - accepted) if tokens else None,
        }


# --- the trace ------------------------------------------------------------------------------
class Trace:
    """``trace.jsonl``: a header row, then one row per evaluation; replayed on resume."""

    def __init__(self, path: Path, header: dict[str, Any], on_row: Callable[[dict], None], bar):
        """``on_row(row)``: called with each new evaluation's row; ``bar``: a tqdm bar advanced
        once per evaluation, replayed ones included."""
        from selfspec.tracking import ResultsFile

        self.file = ResultsFile(path)
        rows = self.file.rows()
        if rows and rows[0].get("header", {}).get("key") != header["key"]:
            raise ValueError(
                f"{path} was written by a search with other settings ({rows[0].get('header', {}).get('settings')}); "
                "delete it to start over, or set artefact_dir=<another path>"
            )
        if not rows:
            self.file.append({"header": header})
            rows = [{"header": header}]
        self.header = rows[0]["header"]
        self.rows = rows[1:]
        self.replayed = len(self.rows)
        self.cursor = 0
        self.memo = {r["key"]: r for r in self.rows}
        self.on_row, self.bar = on_row, bar

    def _advance(self, row: dict[str, Any]) -> None:
        self.bar.update(1)
        self.bar.set_postfix(speedup=f"{row['speedup']:.3f}", refresh=False)

    def evaluate(self, skip: SkipSet, objective, stage: str, extra: dict | None = None) -> dict[str, Any]:
        key = _key(skip)
        if self.cursor < len(self.rows):  # replay
            row = self.rows[self.cursor]
            if row["key"] != key:
                raise ValueError(
                    f"resuming {self.file.path}: iteration {self.cursor} evaluated {row['key']} but the "
                    f"search now proposes {key}; the settings changed — delete the trace to start over"
                )
            self.cursor += 1
            self._advance(row)
            return row
        t0 = time.perf_counter()
        cached = key in self.memo
        result = dict(self.memo[key]) if cached else objective(skip)
        for k in ("iteration", "stage", "seconds", "cached"):
            result.pop(k, None)
        row = {
            "iteration": self.cursor, "stage": stage, "key": key,
            "attn": sorted(skip.attn), "mlp": sorted(skip.mlp),
            "n_attn": len(skip.attn), "n_mlp": len(skip.mlp), "n_skipped": len(skip),
            **result, **(extra or {}), "cached": cached,
            "seconds": time.perf_counter() - t0,
        }
        self.file.append(row)
        self.rows.append(row)
        self.memo.setdefault(key, row)
        self.cursor += 1
        self.on_row(row)
        self._advance(row)
        return row


def _key(skip: SkipSet) -> str:
    return "a" + ",".join(map(str, sorted(skip.attn))) + "|m" + ",".join(map(str, sorted(skip.mlp)))


# --- searches -------------------------------------------------------------------------------
def _names(L: int) -> list[str]:
    w = len(str(L - 1))
    return [f"attn_{i:0{w}d}" for i in range(L)] + [f"mlp_{i:0{w}d}" for i in range(L)]


def _to_skip(x: dict[str, float], L: int) -> SkipSet:
    names = _names(L)
    return SkipSet.of(attn=[i for i in range(L) if x[names[i]] > 0.5],
                      mlp=[i for i in range(L) if x[names[L + i]] > 0.5])


def _to_x(skip: SkipSet, L: int) -> dict[str, float]:
    names = _names(L)
    return {**{names[i]: float(i in skip.attn) for i in range(L)},
            **{names[L + i]: float(i in skip.mlp) for i in range(L)}}


def probe_sets(L: int, opts: dict) -> list[SkipSet]:
    """Warm-start points (``job.warm_start``), then "skip the middle fraction" sets.

    The authors probe known-good sets first; for a new model the middle layers are the usual
    candidates (attention fraction f, MLP fraction f / 2).
    """
    out = list(opts["warm_start"])
    for f in opts["probe_fractions"]:
        def middle(frac):
            n = int(round(frac * L))
            lo = (L - n) // 2
            return range(lo, lo + n)
        out.append(SkipSet.of(attn=middle(float(f)), mlp=middle(float(f) / 2)))
    for s in out:
        bad = sorted(i for i in s.attn | s.mlp if not 0 <= i < L)
        if bad:
            raise ValueError(f"job.warm_start names layer(s) {bad}; the model has {L} layers")
    return out


def search_bo(objective, trace: Trace, L: int, opts: dict, seed: int) -> None:
    """§3.3: GP-based BO over ``[0, 1]^{2L}`` (> 0.5 = skip), probes first, then suggestions."""
    from bayes_opt import BayesianOptimization

    names = _names(L)
    opt = BayesianOptimization(f=None, pbounds={n: (0.0, 1.0) for n in names}, random_state=seed,
                               verbose=0, allow_duplicate_points=True)
    opt.set_gp_params(alpha=opts["gp_alpha"])

    def run(x, stage):
        row = trace.evaluate(_to_skip(x, L), objective, stage)
        opt.register(params=x, target=-1000.0 * row["objective"])  # maximise -ms per token

    for skip in probe_sets(L, opts):
        run(_to_x(skip, L), "probe")
    import numpy as np

    rng = np.random.RandomState(seed)
    for _ in range(opts["init_points"]):
        run(dict(zip(names, rng.uniform(0, 1, len(names)).tolist())), "random")
    n_random, n_smart = opts["acq_n_random"], opts["acq_n_smart"]
    for _ in range(opts["iterations"]):
        # the acquisition's own optimiser: n_random samples + n_smart L-BFGS-B restarts. Its cost
        # grows with 2L and the trace (~11 s per suggestion at 60 dims with the defaults on one
        # CPU core, ~2.7 s with 2000/2), so it is configurable (job.acq_n_random/acq_n_smart).
        if len(opt.space) == 0:
            params = opt.random_sample(1)[0]
        else:
            x = opt.acquisition_function.suggest(gp=opt._gp, target_space=opt.space, n_random=n_random,
                                                 n_smart=n_smart, random_state=opt._random_state)
            params = opt.space.array_to_params(x)
        run({k: float(v) for k, v in params.items()}, "bo")


def search_greedy(objective: CostModel, trace: Trace, L: int, opts: dict) -> None:
    """Layer-importance pass: rank single-sublayer skips by agreement lost per time saved,
    take the best prefix of the ranking, then toggle each sublayer once (first improvement)."""
    units = [("attn", i) for i in range(L)] + [("mlp", i) for i in range(L)]

    def skip_of(us):
        return SkipSet.of(attn=[i for k, i in us if k == "attn"], mlp=[i for k, i in us if k == "mlp"])

    score = {}
    for u in units:
        row = trace.evaluate(skip_of([u]), objective, "importance")
        score[u] = (1.0 - row["agreement"]) / max(objective.sublayer_cost(u[0]), 1e-9)
    ranking = sorted(units, key=lambda u: (score[u], u))
    best_n, best = 0, objective.vanilla_spt
    patience = opts["patience"]
    for n in range(1, len(units)):
        row = trace.evaluate(skip_of(ranking[:n]), objective, "prefix")
        if row["objective"] < best:
            best_n, best = n, row["objective"]
        elif patience and n - best_n >= patience:
            break  # no better prefix for `patience` lengths
    chosen = set(ranking[:best_n])
    for u in ranking if opts["refine"] else ():  # one refinement pass
        trial = chosen ^ {u}
        row = trace.evaluate(skip_of(sorted(trial)), objective, "toggle")
        if row["objective"] < best:
            chosen, best = trial, row["objective"]


# --- plot -----------------------------------------------------------------------------------
def plot_trace(rows: list[dict], path: Path, title: str):
    """Figure 4: speedup against the number of skipped sublayers, one point per evaluation; the
    written :class:`~selfspec.store.figure.Plot` (caption drawn under the axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from selfspec.store.figure import save_standalone

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["n_skipped"] for r in rows]
    ys = [r["speedup"] for r in rows]
    sc = ax.scatter(xs, ys, c=[r["iteration"] for r in rows], cmap="viridis", s=14)
    fig.colorbar(sc, ax=ax, label="search iteration (candidate number)")
    best = max(rows, key=lambda r: r["speedup"])
    ax.scatter([best["n_skipped"]], [best["speedup"]], marker="*", s=160, c="red",
               label=f"best: {best['n_attn']} attn + {best['n_mlp']} MLP, {best['speedup']:.2f}x")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("skipped sublayers (count: attention + MLP)")
    ax.set_ylabel("speedup vs vanilla (×)")
    ax.set_title(title)
    ax.legend(loc="lower left", fontsize=8)
    return save_standalone(fig, path, (
        "Each dot is one evaluated skip set (colour: when the search tried it); the star is the best. "
        "Skipping more sublayers makes drafts cheaper but less often accepted: the speedup peaks in between. "
        "Points above the dashed line (1.0x) beat vanilla decoding."))


# --- the job --------------------------------------------------------------------------------
def task_label(cfg, opts: dict) -> str:
    """The tasks the skip set is searched on: ``job.tasks`` joined with ``+``, else the task's name."""
    return "+".join(opts["tasks"]) if opts["tasks"] else str(cfg.task.name)


def default_dir(cfg, opts: dict) -> Path:
    """``skip_set/<model>`` (``job.tasks``) or ``skip_set/<model>-<task>``."""
    from selfspec.store.artefacts import default_artefact_dir

    return default_artefact_dir("skip_set", str(cfg.model.name), None if opts["tasks"] else task_label(cfg, opts))


def search_settings(ctx, prompts: list[list[int]]) -> dict[str, Any]:
    """What the search's result depends on, in the trace's header: a trace written with other
    settings is refused (their digest is the header's ``key``)."""
    opts, loaded, jc = ctx.opts, ctx.loaded, ctx.cfg.job
    return {
        "search": opts["search"], "model": loaded.name, "fingerprint": loaded.fingerprint,
        "weights": loaded.weights_digest, "tasks": task_label(ctx.cfg, opts),
        "prompts": hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16],
        # draft_ngram is always null here (decoding_options): left out, so traces written before the key resume
        "max_new_tokens": opts["max_new_tokens"],
        "decoding": {k: v for k, v in opts["decoding"].config().items() if k != "draft_ngram"}, "seed": ctx.seed,
        "gp_alpha": opts["gp_alpha"], "init_points": opts["init_points"], "probe_fractions": opts["probe_fractions"],
        "warm_start": OmegaConf.to_container(jc.warm_start) if jc.warm_start else [],
        # the cost model's searches price candidates with the run's profile: another profile, another search
        "costs": None if opts["search"] == "bo" else ctx.profile.name,
        "drafts": None if opts["search"] == "bo" else opts["drafts"],
    }


def report_row(kind: str, tracker, row: dict[str, Any]) -> None:
    """Log a new evaluation of the trace and send it to the tracker."""
    log.info("iter %d %s: %d attn + %d mlp skipped, %s %.4f ms/token, speedup %.3f, AR %s",
             row["iteration"], row["stage"], row["n_attn"], row["n_mlp"], kind,
             1000 * row["objective"], row["speedup"], row["acceptance_rate"])
    tracker.log({k: row[k] for k in ("n_attn", "n_mlp", "n_skipped", "objective", "speedup",
                                      "acceptance_rate", "tau", "seconds") if row.get(k) is not None},
                step=row["iteration"])


def search(ctx) -> Result:
    """Search the skip set :func:`prepare` checked, on the development prompts; the best set
    found, with one measured check of it, the trace and the plot."""
    opts, loaded = ctx.opts, ctx.loaded
    kind, decoding, n_new = opts["search"], opts["decoding"], opts["max_new_tokens"]
    torch.manual_seed(ctx.seed)
    model, L = loaded.model, loaded.model.num_layers
    work = ctx.out.with_name(f"{ctx.out.name}.search-{kind}")
    prompts, sources = dev_prompts(opts["dev_tasks"], loaded.tokenizer)
    settings = search_settings(ctx, prompts)
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
    trace_path = work / "trace.jsonl"
    t_start = time.perf_counter()
    with torch.inference_mode():
        if kind == "bo":
            objective = TimedObjective(model, prompts, n_new, decoding, opts["repeats"])
        else:
            objective = (DecodedCostModel if opts["drafts"] == "decoded" else CostModel)(
                model, prompts, n_new, decoding, ctx.profile)
    t_setup = time.perf_counter() - t_start
    header = {"key": key, "settings": settings, "vanilla_seconds_per_token": objective.vanilla_spt}
    # BO's length is known (probes + random points + iterations); greedy's depends on the ranking
    total = None if kind == "greedy" else len(probe_sets(L, opts)) + opts["init_points"] + opts["iterations"]
    with bar(total=total, enabled=ctx.progress, desc=f"skip search ({kind})", unit="eval") as evals:
        trace = Trace(trace_path, header, partial(report_row, objective.kind, ctx.tracker), evals)
        if trace.replayed:
            log.info("resuming %s: %d evaluations in the trace", trace_path, trace.replayed)
        with torch.inference_mode():
            if kind == "greedy":
                search_greedy(objective, trace, L, opts)
            else:
                search_bo(objective, trace, L, opts, ctx.seed)
    rows = trace.rows
    best = min(rows, key=lambda r: r["objective"])
    skip = SkipSet.of(best["attn"], best["mlp"])
    # one measured check of the result (also for the cost-model searches), on the same dev set
    with torch.inference_mode():
        timed = objective if kind == "bo" else TimedObjective(model, prompts, n_new, decoding, 1)
        # against the trace's first baseline: a resumed search's candidates span both processes
        drift = timed.remeasure_baseline(trace.header["vanilla_seconds_per_token"]) if kind == "bo" else None
        check = timed(skip)
    metrics = {
        "search": kind,
        "evaluations": len(rows),
        "search_seconds": sum(r["seconds"] for r in rows) + t_setup,
        "n_attn": len(skip.attn), "n_mlp": len(skip.mlp),
        "objective_kind": objective.kind,
        f"{objective.kind}_speedup": best["speedup"],
        "measured_speedup_dev": check["speedup"],
        "measured_acceptance_rate_dev": check["acceptance_rate"],
        "vanilla_seconds_per_token": timed.vanilla_spt,
        "dev_prompts": len(prompts), "dev_tasks": sorted(set(sources)),
    } | ({"vanilla_drift": drift} if drift is not None else {})
    files = {"trace.jsonl": trace_path}
    if opts["plot"]:
        files["plot.png"] = plot_trace(rows, work / "plot.png",
                                       f"{loaded.name} skip-set search ({kind}, {objective.kind})").path
    log.info("skip set: %s", metrics)
    return Result(tensors=skip_set_tensors(skip, L), meta={"attn": sorted(skip.attn), "mlp": sorted(skip.mlp)},
                  task=task_label(ctx.cfg, opts), metrics=metrics, summary=metrics,
                  tables={"skip_search_trace": [{k: v for k, v in r.items() if k not in ("attn", "mlp")} for r in rows]},
                  files=files)


# --- memory (selfspec.measure.peak) ----------------------------------------------------------------
def _job_terms(s: Shape, j, b: int) -> list[list[Term]]:
    n, new = int(j.n_prompts), int(j.max_new_tokens)
    block = int(j.max_prompt_tokens or 4096) + new
    queries = n * (new - 1)
    keys = n * block + queries
    return [[
        Term("cache", keys * s.kv_per_token * b, "job.n_prompts / job.max_prompt_tokens"),
        Term("dev pass", layer_bytes(s, block, b) + scores_bytes(s, block, keys, b) + block * keys * b,
             "job.n_prompts / job.max_prompt_tokens"),
        Term("draft agreement", queries * s.vocab * 2 * b + scores_bytes(s, queries, keys, b), "job.n_prompts / job.max_new_tokens"),
    ]]


def memory_terms(shape: Shape, cfg, b: int, context: int, prompt: int | None) -> list[list[Term]]:
    """This job's memory terms beside the weights, by phase (:class:`~selfspec.measure.peak.MemoryModel`)."""
    return _job_terms(shape, cfg.job, b)


#: fitted by ``scripts/measure_memory.py --fit`` (docs/memory_measured.json); docs/usage.md, "Memory per job and model size"
MEMORY = MemoryModel(memory_terms, s=1.0, runtime=588985139.2,
                     fallbacks=((), ("job.n_prompts=4", "job.max_prompt_tokens=256")))

def prices(cfg) -> str | None:
    """The cost model's searches price candidates with the run's profile; ``bo`` times them (an
    unknown ``job.search`` is refused by :func:`prepare`)."""
    search = cfg.job.get("search")
    return f"job.search={search}" if search in SEARCHES and search != "bo" else None


JOB = Job(memory=MEMORY, kind="skip_set", tracker_job="skips", prepare=prepare, default_dir=default_dir, objective=search,
          extendable=("iterations",), prices=prices)  # a rerun with more iterations continues the search's trace

"""Measuring a machine's cost profile (:mod:`selfspec.measure.profile` holds what a profile is, reads
it and prices a trace with it): every table timed on the loaded model, and the host work of a plain
step and of drafting steps, measured by running the decoders themselves. It lives beside the
evaluation, which uses both the runtime (``models/``) and the decoders (``decoding/``), so that
``models/`` imports nothing above it.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import torch

from selfspec.measure.profile import (CONTEXTS, FORMAT, HOST_TREE_NODES, HOST_WORK, MEASUREMENT, PREFILL_ROWS,
                                     QUANT_ROWS, ROWS, VOCAB_FRACTIONS, WARP_ROWS, WARP_SETTINGS, Profile, machine,
                                     machine_name, model_shape)
from selfspec.models.capture import BUCKETS
from selfspec.models.ledger import as_op

__all__ = ["ProfileDeadline", "machine_profile", "measure_profile", "profile_rows", "untrained_ppd"]


class ProfileDeadline(TimeoutError):
    """:func:`measure_profile` passed its ``deadline`` before it finished."""

log = logging.getLogger(__name__)


#: timed repeats per table entry (medians) unless a caller asks for others
REPEATS = 5
#: seconds evaluate's ``profile=auto`` gives the measurement of a profile it has to make (issue 70: at
#: 1.5B parameters every point of the full plan takes about half an hour on 2 cores): past what the
#: full plan is estimated to take, a thinner plan (:data:`THINNER`) is measured, and says so
BUDGET = 300.0
#: the share of a budget a plan's estimate may take (the estimate leaves out the host work's own
#: overheads and the probes: the 1.5B profile took 4.3 min against an estimate of 3.0)
TARGET = 0.8


@dataclass(frozen=True)
class ProfilePlan:
    """What a profile measures: ``rows`` at every context of ``contexts``, ``prefill_rows`` at context
    0, ``quant_rows`` over the quantised copies, each entry the median of ``repeats`` timed runs;
    ``mlp`` ``every`` (the MLP table the median over contexts of full less attention-only passes) or
    ``once`` (full passes at one context only, the one the ``pass`` table is measured at, and at
    context 0 for prefill rows: an MLP's cost does not depend on the context); the host work on
    generations of ``host_new`` tokens after ``host_prompt``, PPD's with trees of ``tree_nodes``."""

    rows: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    contexts: tuple[int, ...]
    quant_rows: tuple[int, ...] = QUANT_ROWS
    repeats: int = REPEATS
    mlp: str = "every"
    host_prompt: int = 256
    host_new: int = 48
    tree_nodes: tuple[int, ...] = HOST_TREE_NODES

    def widths(self) -> dict[int, list[int]]:
        """Per context, the row counts whose attention-only passes are timed there."""
        return {c: sorted({*self.rows, *(self.prefill_rows if c == 0 else ())}) for c in self.contexts}

    def full_at(self) -> dict[int, set[int]] | None:
        """Per context, the row counts whose full passes are timed there too (None: every one, ``mlp``
        ``every``): planned ``once``, at the ``pass`` table's context and the prefill rows at context 0."""
        if self.mlp == "every":
            return None
        at = _pass_context(self.contexts)
        return {c: {n for n in rows if c == at or (c == 0 and n in self.prefill_rows)}
                for c, rows in self.widths().items()}

    def describe(self) -> str:
        return (f"rows {','.join(map(str, self.rows))} at contexts {','.join(map(str, self.contexts))}, prefill "
                f"{','.join(map(str, self.prefill_rows)) or 'none'}, medians of {self.repeats}, MLP at "
                f"{'every context' if self.mlp == 'every' else 'one context'}, quantised copies at rows "
                f"{','.join(map(str, self.quant_rows))}, host work over {self.host_new} tokens with PPD trees of "
                f"{','.join(map(str, self.tree_nodes))} nodes")


def _ends_and_powers(rows: tuple[int, ...], keep: int) -> tuple[int, ...]:
    """At most ``keep`` of ``rows``: the first, the last and powers of two between, evenly thinned."""
    rows = tuple(sorted(rows))
    if len(rows) <= keep:
        return rows
    powers = [n for n in rows[1:-1] if n & (n - 1) == 0] or list(rows[1:-1])
    step = max(1, -(-len(powers) // max(keep - 2, 1)))
    return tuple(sorted({rows[0], *powers[::step][: keep - 2], rows[-1]}))


#: the plans a budget steps down through, each thinner than the last (applied to the plan asked for)
THINNER = (
    lambda p: replace(p, repeats=min(p.repeats, 3)),
    lambda p: replace(p, mlp="once"),
    lambda p: replace(p, rows=_ends_and_powers(p.rows, 8), prefill_rows=_ends_and_powers(p.prefill_rows, 2),
                      host_prompt=128, host_new=24, tree_nodes=p.tree_nodes[len(p.tree_nodes) // 2:][:1]),
    lambda p: replace(p, rows=_ends_and_powers(p.rows, 5), quant_rows=_ends_and_powers(p.quant_rows, 3),
                      contexts=tuple(c for c in p.contexts if c in (0, max(p.contexts)) or c == _pass_context(p.contexts)),
                      host_prompt=64, host_new=16),
)


def _pass_context(contexts) -> int:
    """The context the ``pass`` table (and, planned ``once``, the MLP) is measured at: the nearest 512."""
    return min(contexts, key=lambda c: abs(c - 512))


class _Costs:
    """A plan's time, estimated from a few probe passes on the loaded model (one row and the widest,
    with and without the MLPs, and the head) as costs linear in rows."""

    def __init__(self, model, context: int, widest: int) -> None:
        from selfspec.measure.costs import context_cache, time_call, time_forward
        from selfspec.models.layered import SkipSet
        from selfspec.models.passes import Pass
        from selfspec.models.quantised import FORMATS, problem

        cache = context_cache(model, context, widest)
        attn_only = Pass(skip=SkipSet.of(mlp=range(model.num_layers)))
        fit = {}
        for name, p in (("full", Pass()), ("attention", attn_only)):
            one, wide = (time_forward(model, cache, context, n, p=p, repeats=1, logits_rows=0) for n in (1, widest))
            slope = max(wide - one, 0.0) / max(widest - 1, 1)
            fit[name] = (one - slope, slope)
        x = torch.randn(1, widest, model.hidden_size, dtype=model.dtype, device=model.device)
        self.head_row = time_call(lambda: model.head(x, model.lm_head_weight), model.device, 1) / widest
        self.fit = fit
        self.copies = 0 if problem(model) is not None else len(FORMATS)  # the quantised tables measured

    def passes(self, n: int, kind: str = "full") -> float:
        a, b = self.fit[kind]
        return max(a + b * n, 0.0)

    def plan(self, p: ProfilePlan) -> float:
        """Seconds of measuring ``p`` (tables and host work), roughly."""
        runs, full_at = p.repeats + 1, p.full_at()
        s = runs * sum(self.passes(n, "attention") + (self.passes(n) if full_at is None or n in full_at[c] else 0.0)
                       for c, rows in p.widths().items() for n in rows)
        s += runs * sum(2 * self.passes(n) + 2 * n * self.head_row for n in p.rows)  # the pass table, the trees
        s += runs * self.copies * len(p.contexts) * sum(0.5 * (self.passes(n) + self.passes(n, "attention"))
                                                        for n in p.quant_rows)  # a copy reads a quarter to half the bytes
        s += (1 + self.copies) * sum(self.passes(c) for c in p.contexts) + 2 * self.passes(min(max(p.contexts), 512))
        # (each context's cache filled once per table set, and the walk's and the trees' caches)
        s += runs * 1.4 * sum(self.head_row * n for n in (*p.rows, *p.prefill_rows[:1], *p.quant_rows))
        generations = 1 + p.repeats // 2  # of each: vanilla, a draft, the n-gram lookup, PPD's per tree size
        # a random tree accepts about a token a step: a step per token, of about 4 rows a node (module
        # docstring of selfspec.measure.profile: trees of 4, 12, 24 nodes make passes of ~20, ~60, ~100 rows)
        per_token = 3 * self.passes(1) + sum(self.passes(4 * n + 4) for n in p.tree_nodes)
        s += generations * ((3 + len(p.tree_nodes)) * self.passes(p.host_prompt) + p.host_new * per_token)
        return s + 2 * max(3, p.repeats) * self.passes(1)


def plan_profile(model, asked: ProfilePlan, budget: float | None, log=None) -> tuple[ProfilePlan, float | None]:
    """The plan measured: ``asked`` where no ``budget`` (seconds) is given or its estimate fits; else
    the first of :data:`THINNER`'s steps that fits, or the thinnest, said either way through ``log``.
    Returns the plan and its estimated seconds (None without a budget)."""
    if budget is None:
        return asked, None
    costs = _Costs(model, _pass_context(asked.contexts), max(asked.rows))
    plan, estimate = asked, costs.plan(asked)
    full, aim = estimate, TARGET * budget  # an estimate leaves things out: aim below the budget
    for thinner in THINNER:
        if estimate <= aim:
            break
        plan = thinner(plan)
        estimate = costs.plan(plan)
    if plan != asked and log:
        log(f"every point of the profile would take about {full / 60:.0f} min here, beyond its budget of "
            f"{budget / 60:.0f} min: measuring fewer ({plan.describe()}), about {estimate / 60:.1f} min"
            + ("" if estimate <= aim else ", the thinnest plan there is")
            + f"; `make profile MODEL={model.name}` measures every point")
    return plan, estimate


def measure_profile(model, *, rows: Iterable[int] | None = None, prefill_rows: Iterable[int] = PREFILL_ROWS,
                    contexts: Iterable[int] = CONTEXTS, repeats: int = REPEATS, log=None, deadline: float | None = None,
                    budget: float | None = None) -> Profile:
    """Measure this machine's profile of ``model`` (module docstring). About a minute for
    SmolLM2-135M on 2 CPU cores; seconds for a tiny model. ``rows``: by default
    :data:`~selfspec.measure.profile.ROWS`, and the largest bucket's where the model captures CUDA
    graphs (it replays decoding passes that wide: the searches' branch passes, PPD's largest trees).
    ``deadline`` (a ``time.perf_counter()`` instant): past it, :class:`ProfileDeadline` is raised at the
    next measured table (``make gpu-check`` bounds each section's time). ``budget`` (seconds): where
    the plan asked for is estimated to take longer, fewer points are measured (:func:`plan_profile`),
    and the profile records the plan it measured (``plan``). ``log`` receives each stage with the
    time so far and the estimate."""
    started = time.time()
    steps = _Steps(log, deadline, started)
    rows = tuple(rows) if rows is not None else profile_rows(model.capture)
    limit = model.max_context - max(max(rows), 1) - 2
    asked = ProfilePlan(rows=tuple(sorted(set(rows))), prefill_rows=tuple(r for r in prefill_rows if r < model.max_context - 2),
                        contexts=tuple(sorted({min(int(c), limit) for c in contexts if c >= 0})), repeats=repeats)
    from selfspec.measure.costs import OthersBusy

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # before the probes' own load
    others = OthersBusy()
    plan, steps.estimate = plan_profile(model, asked, budget, log)
    data = _measure_tables(model, plan, steps) | {
        "format": FORMAT, "name": "", "machine": machine(model.device), "load_average": load,
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "repeats": plan.repeats,
        "seconds_to_measure": None, "host": 0.0, "measurement": MEASUREMENT,
        "model": {"name": model.name, "shape": model_shape(model), "linear_kernel": model.linear_kernel,
                  "capture": model.capture}} | ({"plan": asdict(plan) | {"budget": budget}} if plan != asked else {})
    # the dtype named where it is not float32, as the shipped profiles are named: a bf16 profile under a
    # float32 profile's name would price runs mislabelled
    dtype = data["model"]["shape"].get("dtype", "float32")
    data["name"] = f"{machine_name(data['machine'])}__{model.name}" + ("" if dtype == "float32" else f"__{dtype}")
    profile = Profile(data)
    _measure_host_work(model, profile, plan, steps)
    data["seconds_to_measure"] = round(time.time() - started, 1)
    data["others_busy"] = others.share()
    return profile


class _Steps:
    """A profile's stages: each checked against the ``deadline`` before it starts and told to ``log``
    with the minutes so far and, where a plan was estimated, of about how many."""

    #: seconds between two lines of the same stage
    EVERY = 60.0

    def __init__(self, log, deadline: float | None, started: float) -> None:
        self.log, self.deadline, self.started, self.estimate = log, deadline, started, None
        self.said = started

    def before(self, what: str) -> None:
        """Raise :class:`ProfileDeadline` if the deadline passed before ``what``; say it where the
        stage has been silent for :attr:`EVERY` seconds."""
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise ProfileDeadline(f"the profile's time limit passed before {what} was measured")
        if time.time() - self.said >= self.EVERY:
            self.done(f"measuring {what}")

    def done(self, what: str) -> None:
        self.said = time.time()
        if self.log:
            so_far = (self.said - self.started) / 60
            self.log(f"{what} ({so_far:.1f} min" + (f" of about {self.estimate / 60:.1f})" if self.estimate else ")"))


def _measure_tables(model, plan: ProfilePlan, steps: _Steps) -> dict[str, Any]:
    """The profile's cost tables (module docstring of :mod:`selfspec.measure.profile`) as ``plan`` says."""
    from selfspec.measure.costs import time_forward

    pass_context = _pass_context(plan.contexts)
    whole: dict[int, dict[int, float]] = {}

    def whole_pass(cache, context: int, n: int) -> None:  # the L_fp(n) curve, kept for reading
        steps.before(f"the pass of {n} rows at context {context}")
        if n in plan.rows and context == pass_context:
            whole.setdefault(context, {})[n] = time_forward(model, cache, context, n, repeats=plan.repeats, cold=True)

    spans: dict[str, int] = {}  # a static pass attends over its whole cache: the slots each context's spanned
    steps.before("a walk's own cost")
    walk = _measure_walk(model, pass_context, plan.repeats) if model.device.type == "cpu" else 0.0
    attention, mlp = _sublayers(model, plan.widths(), plan.repeats, steps.done, also=whole_pass, spans=spans,
                                walk=walk, full_at=plan.full_at())
    steps.before("the eager tables")
    eager = _measure_eager(model, list(plan.rows), list(plan.contexts), plan.repeats, steps.done) \
        if model.capture == "graphs" else None
    steps.before("the quantised copies")
    quantised = _measure_quantised(model, plan, walk, steps)
    steps.before("the heads")
    head = _measure_heads(model, list(plan.rows) + list(plan.prefill_rows[:1]), plan.repeats)
    linear = _measure_linear(model, list(plan.rows), plan.repeats)
    steps.done("the heads and an exit head's transform")
    steps.before("the tree passes")
    tree = _measure_tree(model, list(plan.rows), min(plan.contexts[-1], 512), plan.repeats)
    warps = _measure_warps(model, plan.repeats)
    steps.done("the tree passes and the sampling warps")
    return {
        "attention": attention,
        "mlp": mlp,
        "head": {str(v): {str(n): t for n, t in row.items()} for v, row in head.items()},
        "linear": {str(n): t for n, t in linear.items()},
        "tree": {str(n): t for n, t in tree.items()},
        "pass": {str(c): {str(n): t for n, t in row.items()} for c, row in whole.items()},
        "warp": {str(k): {str(v): {str(n): t for n, t in row.items()} for v, row in table.items()}
                 for k, table in warps.items()},
        "walk": walk,
    } | ({"eager": eager} if eager else {}) | ({"spans": spans} if model.steps is not None else {}) \
      | ({"quantised": quantised} if quantised else {})


def _measure_host_work(model, profile: Profile, plan: ProfilePlan, steps: _Steps) -> None:
    """``host``, ``host_steps`` and ``host_draft`` (module docstring of :mod:`selfspec.measure.profile`),
    measured on generations as ``plan`` says, into ``profile`` and its data."""
    steps.before("the host work")
    data = profile.data
    prompt = list(range(10, 10 + max(1, min(plan.host_prompt, model.max_context // 4))))
    new = max(2, min(plan.host_new, model.max_context - len(prompt) - 2))
    data["host"] = profile.host = _measure_plain_host(model, profile, prompt, new, plan.repeats)
    data["host_steps"] = _measure_host_steps(model, profile, prompt, new, plan.repeats, plan.tree_nodes, steps.before)
    profile.host_steps = dict(data["host_steps"])
    steps.before("the host work of a chain's drafts")
    data["host_draft"] = profile.host_draft = _measure_host_draft(model, profile, prompt, new, plan.repeats)
    steps.done(f"host work of drafting steps: {data['host_steps']}")


def profile_rows(capture: str) -> tuple[int, ...]:
    """The rows a profile measures at every context by default: :data:`~selfspec.measure.profile.ROWS`,
    up to the largest bucket where the model captures CUDA graphs (``capture``: the model's resolved
    mode), so that every pass it replays is priced at a measured width."""
    return tuple(sorted({*ROWS, *((BUCKETS[-1],) if capture == "graphs" else ())}))


def _measure_eager(model, rows: list[int], contexts: list[int], repeats: int, log=None) -> dict:
    """A capturing model's attention and MLP sublayers run eagerly (the static-pass runner off), at
    the decoding contexts: what a pass no bucket holds costs."""
    eager = dict(zip(("attention", "mlp"), _sublayers(model.with_passes(None), {c: rows for c in contexts if c > 0},
                                                        repeats)))
    if log:
        log("eager attention and MLP sublayers (the static-pass runner off)")
    return eager


def _measure_plain_host(model, profile: Profile, prompt: list[int], new: int, repeats: int) -> float:
    """The host time of a plain step: vanilla's measured greedy steps less what their ops cost (a
    sampled step's warp is an op of its own); the median over ``repeats // 2`` generations."""
    from selfspec.decoding import Sampling
    from selfspec.decoding.vanilla import Vanilla

    decoder = Vanilla(model)
    decoder.generate(prompt, new, Sampling())  # warm-up
    hosts = []
    for _ in range(max(1, repeats // 2)):
        g = decoder.generate(prompt, new, Sampling())
        steps = [t.row() for t in g.trace[1:]]
        model_time = sum(profile.op(op) for s in steps for op in s["ops"])
        hosts.append(max(0.0, (g.ledger["plain"] + g.ledger["host"] - model_time) / len(steps)))
    return statistics.median(hosts)


def _sublayers(model, widths: dict[int, list[int]], repeats: int, log=None, also=None, spans: dict | None = None,
               walk: float = 0.0, weights: str | None = None, full_at: dict[int, Iterable[int]] | None = None
               ) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """The ``attention`` and ``mlp`` tables (module docstring of :mod:`selfspec.measure.profile`):
    per context, whole passes of each row count in ``widths[context]`` with and without the MLPs,
    less one walk's own cost (``walk``), divided by the layer count (the MLP: the median over
    contexts of the difference). ``also(cache, context, rows)`` times anything else on the same
    cache; ``spans`` receives each context's cache slots; ``weights``: the passes read that quantised
    copy of the weights (the ``quantised`` tables); ``full_at``: per context, the row counts whose
    full passes are timed there (default every one: :class:`ProfilePlan`'s ``mlp``)."""
    from selfspec.measure.costs import context_cache, time_forward
    from selfspec.models.layered import SkipSet
    from selfspec.models.passes import Pass

    L = model.num_layers
    every, no_mlp = Pass(weights=weights), Pass(skip=SkipSet.of(mlp=range(L)), weights=weights)
    attention: dict[str, dict[str, float]] = {}
    mlp: dict[int, list[float]] = {}
    for context, rows in widths.items():
        cache = context_cache(model, context, max(rows))
        if spans is not None:
            spans[str(context)] = cache.max_length
        attention[str(context)] = {}
        for n in rows:
            attn = time_forward(model, cache, context, n, p=no_mlp, repeats=repeats, logits_rows=0, cold=True)
            attention[str(context)][str(n)] = max(attn - walk, 0.0) / L
            if full_at is None or n in full_at[context]:
                full = time_forward(model, cache, context, n, p=every, repeats=repeats, logits_rows=0, cold=True)
                mlp.setdefault(n, []).append(max(full - attn, 0.0) / L)
            if also is not None:
                also(cache, context, n)
        if log:
            log(f"context {context}: attention and MLP sublayers for {len(rows)} row counts")
    return attention, {str(n): statistics.median(v) for n, v in mlp.items()}


def _measure_walk(model, context: int, repeats: int) -> float:
    """``walk`` (module docstring of :mod:`selfspec.measure.profile`): what one more walk of the
    layers costs beyond its sublayers, on one row after ``context`` positions: every layer walked one
    at a time against all of them in one walk, the difference over the walks added (the call into
    the runtime, its rotary rows, the ledger's record; AdaDecode walked a layer at a time, and each
    walk cost 0.07-0.12 ms more than its layer on 2 CPU cores). Never below zero."""
    from selfspec.measure.costs import context_cache, evict_caches, synchronizer
    from selfspec.models.passes import Pass

    L = model.num_layers
    if L < 2:
        return 0.0
    cache = context_cache(model, context, 1)
    h = model.embed(torch.zeros(1, 1, dtype=torch.long, device=model.device))
    rope = model.rope(model.positions(context, 1), h)
    sync = synchronizer(model.device)

    def one() -> None:
        model.forward(h, cache, Pass(range(L)), start=context, rope=rope)

    def each() -> None:
        x = h
        for j in range(L):
            x = model.forward(x, cache, Pass(range(j, j + 1)), start=context, rope=rope)

    times: dict[str, list[float]] = {"one": [], "each": []}
    with torch.inference_mode():
        for r in range(max(3, repeats) + 1):
            for name, run in (("one", one), ("each", each)) if r % 2 else (("each", each), ("one", one)):
                cache.truncate(context)
                evict_caches(model.device)
                sync()
                t0 = time.perf_counter()
                run()
                sync()
                if r:  # the first turn warms up
                    times[name].append(time.perf_counter() - t0)
    cache.truncate(context)
    extra = statistics.median(times["each"]) - statistics.median(times["one"])
    return max(extra / (L - 1), 0.0)


def _host_beyond_ops(decoder, profile: "Profile", tokens: list[int], new: int, repeats: int, source: str,
                     per_draft: bool = False) -> list[float]:
    """Per generation of ``decoder`` after ``tokens`` (``repeats // 2`` of them, after a warm-up: under
    graphs, the captures), the seconds of its host work (the components outside the passes' own:
    :data:`~selfspec.measure.profile.HOST_WORK`) beyond the model work priced inside it (a draft's walk and
    head), per step whose drafts came from ``source``, or per token those steps drafted (``per_draft``).
    Empty where it drafted nothing."""
    from selfspec.decoding import Sampling

    decoder.generate(tokens, new, Sampling())
    out = []
    for _ in range(max(1, repeats // 2)):
        g = decoder.generate(tokens, new, Sampling())
        steps = [t.row() for t in g.trace[1:]]
        drafting = [st for st in steps if st["source"] == source]
        units = sum(st.get("drafted", 0) for st in drafting) if per_draft else len(drafting)
        if not units:
            return []
        seconds = sum(g.ledger[k] for k in HOST_WORK)
        priced = sum(profile.op(op) for st in steps for op in map(as_op, st["ops"]) if op.component in HOST_WORK)
        out.append(max(0.0, (seconds - priced) / units))
    return out


def _repeating(prompt: list[int]) -> list[int]:
    """A prompt as long as ``prompt`` that repeats its first eighth (a context drafts from itself)."""
    segment = prompt[: max(4, len(prompt) // 8)]
    return (segment * (len(prompt) // len(segment) + 1))[: len(prompt)]


def _measure_host_steps(model, profile: "Profile", prompt: list[int], new: int, repeats: int,
                        tree_nodes: Iterable[int] = HOST_TREE_NODES, before=None) -> dict[str, Any]:
    """``host_steps`` (module docstring): per drafting step, the seconds beyond its priced ops and
    ``host``: the median over generations of PPD with random prompt tokens and random trees of
    ``tree_nodes`` candidates (:data:`HOST_TREE_NODES` unless a plan thins them), and of the n-gram
    lookup on a prompt that repeats itself
    (so it drafts). ``before(what)`` is told each generation set before it runs (a profile's stages)."""
    from selfspec.config import method_config
    from selfspec.decoding import build_decoder

    tree: list[float] = []
    for nodes in tree_nodes:
        if before is not None:
            before(f"PPD's host work with trees of {nodes} nodes")
        tree += _host_beyond_ops(untrained_ppd(model, nodes), profile, prompt, new, repeats, "tree")
    out: dict[str, Any] = {"tree": statistics.median(tree)} if tree else {}
    ngram = build_decoder(method_config("ngram", never_slower=False, draft_schedule="adaptive"), model)
    context = _host_beyond_ops(ngram, profile, _repeating(prompt), new, repeats, "context")
    if context:
        out["context"] = statistics.median(context)
    return out


def _measure_host_draft(model, profile: "Profile", prompt: list[int], new: int, repeats: int) -> float:
    """``host_draft`` (module docstring of :mod:`selfspec.measure.profile`): per token a chain drafts with
    the model, the seconds of its step's draft and host work beyond their priced ops and the profile's
    ``host``. Measured on chains of 4 drafts on a prompt that repeats itself, the median over
    ``repeats // 2`` generations: drafts over the int8 copy where the model runs one (a third of a step
    each, so what the drafter adds stands out of the timing's noise: 1.2 ms a draft on SmolLM2, 2 Zen 5
    cores), else through the skip-set drafter with every layer but the last MLP (a draft of about a step,
    whose noise is the step's: the same drafts measured 9.5-12.3 ms against 9.9 priced)."""
    from selfspec.config import method_config
    from selfspec.decoding import build_decoder
    from selfspec.models.quantised import problem

    if problem(model) is None:
        config = method_config("quant_draft", never_slower=False, max_draft=4)
    else:
        config = method_config("draft_verify", never_slower=False, draft_stop=None, max_draft=4, skip_attn=[],
                               skip_mlp=[model.num_layers - 1])
    per_draft = _host_beyond_ops(build_decoder(config, model), profile, _repeating(prompt), new, repeats, "self",
                                 per_draft=True)
    return statistics.median(per_draft) if per_draft else 0.0


def profile_spec(cfg) -> str | None:
    """A run's or a training job's ``profile``: ``auto``, None, or the file of a named / given profile
    (which must exist and be readable: a malformed one, a damaged shipped one too, is refused naming
    its file and the remedy, issue 68); checked before the model loads."""
    from selfspec.config import checks
    from selfspec.measure.profile import Profile, resolve

    spec = checks.optional(checks.text, "profile", cfg.profile)
    if spec in (None, "auto"):
        return spec
    try:
        path = resolve(spec)
        if not path.is_file():
            raise FileNotFoundError(f"no profile file at {path}")
        Profile.load(path)
    except (OSError, ValueError) as err:
        raise checks.refuse("profile", spec, "auto, null, a profile file or a shipped profile's name", str(err)) from None
    return str(path)


def run_profile(spec: str | None, model) -> Profile | None:
    """The cost profile a resolved ``profile`` (:func:`profile_spec`) names, checked against the
    loaded model's shape: ``auto`` is :func:`machine_profile` (this machine's, found or measured
    once); None for ``profile=null``."""
    if spec is None:
        return None
    profile = machine_profile(model) if spec == "auto" else Profile.load(spec)
    profile.check_shape(model_shape(model), f"model {model.name}")
    return profile


#: others' share of the CPUs (:class:`~selfspec.measure.costs.OthersBusy`) above which a profile
#: measured for the cache is spoiled: a quarter, half a core of a 2-core machine
SPOILED_SHARE = 0.25


def machine_profile(model) -> Profile:
    """This machine's cost profile of ``model`` (evaluate's ``profile=auto``): the one kept in the
    asset cache (:func:`~selfspec.measure.profile.default_path`) if it describes this machine
    (:meth:`~selfspec.measure.profile.Profile.describes`: its kernels' paths too), else a shipped one of the same CPU,
    threads and libraries, else measured once (:func:`measure_profile`) and kept there."""
    from selfspec.measure.profile import default_path, machine, matching_shipped

    path = default_path(model, model.device)
    here = machine(model.device)
    profile = _cached_profile(path)
    # the cache's key names the machine and libraries, not every path the kernels take (the bfloat16 units,
    # the library of a prefill): one kept before such a path changed prices another runtime. A CPU's thread
    # count is in the key; a GPU's profile does not depend on its host's
    differ = {} if profile is None else {k: v for k, v in profile.differences(here).items() if k != "threads"}
    if profile is not None and not differ:
        return profile
    if profile is not None:
        log.warning("the cached cost profile %s describes another machine than this process's (%s: "
                    "cached, here): not used", path, differ)
    profile = matching_shipped(model)
    if profile is not None:
        log.info("cost profile: the shipped %s (this CPU, threads and libraries); `make profile` measures "
                 "this machine's own", profile.name)
        return profile
    log.info("measuring this machine's cost profile of %s (once, within about %.0f min; kept at %s)", model.name,
             BUDGET / 60, path)
    profile = measure_profile(model, budget=BUDGET, log=lambda line: log.info("cost profile of %s: %s", model.name, line))
    busy = profile.data.get("others_busy")
    if busy is not None and busy > SPOILED_SHARE:
        # every later run here would be priced with it (trees, skip sets, gates, predictions)
        log.warning("the cost profile of %s was measured while other processes took %.0f%% of the CPUs: its "
                    "figures are spoiled, so it prices this run only and is not kept at %s; measure it on a "
                    "quiet machine (make profile MODEL=...), or the next run measures it again",
                    model.name, 100 * busy, path)
        return profile
    profile.save(path)
    return profile


def _cached_profile(path: Path):
    """This machine's cached profile at ``path``, or None when there is none or it is of an older
    format (measured again then: a cache holds nothing a user wrote)."""
    if not path.is_file():
        return None
    try:
        return Profile.load(path)
    except (ValueError, KeyError) as err:
        log.warning("the cached profile %s is unreadable or of another format than %d (%s): measuring it again",
                    path, FORMAT, err)
        return None


def untrained_ppd(model, nodes: int):
    """PPD with nothing trained (``make gpu-check``'s capture section, ``host_steps``): 3 random
    prompt tokens of 2 tokens each, and random trees of ``nodes`` candidates (top-10 ranks), with
    conf/method/ppd.yaml's acceptance settings and no n-gram chain."""
    import random

    from selfspec.config import method_config
    from selfspec.decoding import check_method
    from selfspec.decoding.ppd import PPD
    from selfspec.decoding.tree import random_trees
    from selfspec.models.prompts import PromptTokens

    options = check_method(method_config("ppd"))
    g = torch.Generator().manual_seed(0)
    prompts = PromptTokens((torch.randn(3, 2, model.hidden_size, generator=g) * 0.5).to(model.device, model.dtype))
    return PPD(model, prompts, random_trees(3, nodes, 10, random.Random(nodes)), ngram=None,
               posterior_threshold=options.posterior_threshold, posterior_alpha=options.posterior_alpha,
               state_zero=options.state_zero)


def _measure_heads(model, rows: list[int], repeats: int, weights: str | None = None) -> dict[int, dict[int, float]]:
    """LM-head products by rows, for the full vocabulary and truncated ones (``weights``: of that
    quantised copy's head)."""
    from selfspec.measure.costs import time_call

    weight = model.lm_head_weight if weights is None else model.weight_set(weights).head
    out: dict[int, dict[int, float]] = {}
    for fraction in VOCAB_FRACTIONS:
        v = max(1, int(weight.shape[0] * fraction))
        w = weight[:v].contiguous() if v < weight.shape[0] else weight
        out[v] = {}
        for n in rows:
            x = torch.randn(1, n, model.hidden_size, dtype=model.dtype, device=model.device)
            out[v][n] = time_call(lambda: model.head(x, w).float(), model.device, repeats, cold=True)
    return out


def _measure_quantised(model, plan: ProfilePlan, walk: float, steps: _Steps) -> dict[str, dict] | None:
    """The ``quantised`` tables: per format of :data:`~selfspec.models.quantised.FORMATS`, the attention
    and MLP sublayers and the head over that copy of the weights, at the plan's ``quant_rows``
    (:data:`QUANT_ROWS`) and contexts (None where the runtime cannot run a quantised copy: its
    linears are not the CPU kernels)."""
    from selfspec.models.quantised import FORMATS, problem

    if problem(model) is not None:
        return None
    out = {}
    for fmt in FORMATS:
        attention, mlp = _sublayers(model, {c: list(plan.quant_rows) for c in plan.contexts}, plan.repeats, walk=walk,
                                    weights=fmt, also=lambda cache, c, n: steps.before(f"{fmt} passes at context {c}"))
        head = _measure_heads(model, list(plan.quant_rows), plan.repeats, fmt)
        out[fmt] = {"attention": attention, "mlp": mlp,
                    "head": {str(v): {str(n): t for n, t in row.items()} for v, row in head.items()}}
        steps.done(f"passes over the {fmt} copy of the weights")
    return out


def _measure_warps(model, repeats: int) -> dict[int, dict[int, dict[int, float]]]:
    """Sampled selection's warps (:data:`WARP_SETTINGS`) by nucleus, vocabulary and rows, on
    logits shaped like the model's (a peaked distribution, as a language model's usually is)."""
    from selfspec.decoding import Sampling
    from selfspec.decoding.sampling import warp
    from selfspec.measure.costs import time_call

    generator = torch.Generator(device=model.device).manual_seed(0)
    out: dict[int, dict[int, dict[int, float]]] = {}
    for nucleus, setting in WARP_SETTINGS.items():
        s = Sampling(**setting)
        out[nucleus] = {}
        for fraction in VOCAB_FRACTIONS:
            v = max(1, int(model.vocab_size * fraction))
            out[nucleus][v] = {}
            for n in WARP_ROWS:
                logits = 4 * torch.randn(n, v, generator=generator, device=model.device)
                out[nucleus][v][n] = time_call(lambda: warp(logits, s), model.device, repeats)
    return out


def _measure_linear(model, rows: list[int], repeats: int) -> dict[int, float]:
    """An exit head's ``d × d`` transform by rows."""
    from selfspec.measure.costs import time_call

    d = model.hidden_size
    lin = torch.nn.Linear(d, d, bias=False, dtype=model.dtype, device=model.device)
    out = {}
    for n in rows:
        x = torch.randn(1, n, d, dtype=model.dtype, device=model.device)
        out[n] = time_call(lambda: lin(x), model.device, repeats, cold=True)
    return out


def _measure_tree(model, sizes: list[int], context: int, repeats: int) -> dict[int, float]:
    """Whole tree passes (the rows' positions and ancestor mask given, the head on every node) by size."""
    from selfspec.measure.costs import context_cache, time_forward
    from selfspec.models.passes import Pass, Rows

    cache = context_cache(model, context, max(sizes))
    out = {}
    for n in sizes:
        tree = Rows.tree(torch.arange(n, device=model.device), torch.ones(n, n, dtype=torch.bool, device=model.device).tril())
        h = model.embed(torch.zeros(1, n, dtype=torch.long, device=model.device))
        out[n] = time_forward(model, cache, context, p=Pass(rows=tree), h=h, repeats=repeats, cold=True)
    return out

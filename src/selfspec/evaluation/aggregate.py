"""Aggregation of per-example result rows into per-method figures (docs/design/contracts.md §2.6, §3).

Every figure is computed over the generations that **every** method finished, so the baseline and
the methods are compared on the same examples. A generation is one ``(id, sample)`` pair: with
``n_samples`` > 1 (sampling) each example is generated once per sample index, every method's i-th
sample with the same seed, and the figures below pool all samples:

``tokens_per_s``        total new tokens / total seconds
``seconds_per_token``   total seconds / total new tokens
``speedup``             baseline seconds per token / method seconds per token
``decode_speedup``      the same after the prompt's step: seconds less the ledger's ``prefill``
                        over new tokens less those the first step committed (None without a
                        ledger: the HF peers). Under greedy decoding every method commits the same
                        tokens and it only leaves the prompt out; under sampling each method's
                        samples end (at EOS) at other lengths, so the prompt's cost is spread over
                        other token counts and ``speedup`` mixes that in, while this compares the
                        decoding steps alone
``tau``                 mean accepted tokens per step, bonus token included (vanilla = 1.0):
                        total new tokens / total steps (Spec-Bench's τ)
``acceptance_rate``     accepted draft tokens / drafted tokens (LayerSkip); None if nothing drafted
``consistency``         fraction of examples whose tokens equal the baseline's exactly (greedy
                        decoding only; None under sampling)
``prefix_agreement``    mean over examples of (common prefix with the baseline / longer length):
                        token-level agreement up to the first divergence
``ledger``              where the time goes (:mod:`selfspec.models.ledger`), per component in
                        *vanilla steps per committed token*: the component's seconds per
                        committed token over the baseline's seconds per committed token.
                        ``measured`` adds up to 1 / ``speedup``; ``predicted`` (the traces costed
                        with a machine profile, :mod:`selfspec.measure.profile`) adds up to
                        1 / ``predicted_speedup``
                        ``unmodelled``: measured minus predicted per component (at least 0.005),
                        largest first: where a prediction misses, the part the profile leaves out
``predicted_speedup``   the baseline's predicted seconds per token / the method's (None without a
                        profile, or for a method without a trace: the HF peers)
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

from selfspec.measure.speedup import per_token, speedup


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens of ``a`` and ``b`` are equal."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def consistency(tokens: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict[str, float]:
    """Exact-match rate and mean prefix agreement of ``tokens`` against ``reference``."""
    if not tokens:
        return {"consistency": None, "prefix_agreement": None}
    exact = sum(list(a) == list(b) for a, b in zip(tokens, reference))
    agree = [common_prefix(a, b) / max(len(a), len(b), 1) for a, b in zip(tokens, reference)]
    return {"consistency": exact / len(tokens), "prefix_agreement": sum(agree) / len(agree)}


def _mean_stats(rows: Iterable[dict[str, Any]]) -> dict[str, float]:
    sums: dict[str, float] = defaultdict(float)
    n = 0
    for r in rows:
        n += 1
        for k, v in (r.get("stats") or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                sums[k] += v
    return {k: v / n for k, v in sums.items()} if n else {}


def generation_key(row: dict[str, Any]) -> tuple[str, int]:
    """A result row's generation: ``(example id, sample index)``; rows without ``sample`` are sample 0."""
    return str(row["id"]), int(row.get("sample", 0))


def common_rows(rows: Iterable[dict[str, Any]], methods: Sequence[str],
                baseline: str) -> dict[str, list[dict[str, Any]]]:
    """Per method, its rows of the generations every method finished, grouped by example (in the
    baseline's order) and by sample index within an example; the same order for every method."""
    by_method: dict[str, dict[tuple[str, int], dict[str, Any]]] = {m: {} for m in methods}
    for r in rows:
        if r.get("method") in by_method:
            by_method[r["method"]][generation_key(r)] = r
    base = by_method.get(baseline, {})
    first: dict[str, int] = {}  # each example's first position among the baseline's rows
    for n, (i, _) in enumerate(base):
        first.setdefault(i, n)
    keys = sorted((k for k in base if all(k in by_method[m] for m in methods)), key=lambda k: (first[k[0]], k[1]))
    return {m: [by_method[m][k] for k in keys] for m in methods}


def summarize(
    rows: Iterable[dict[str, Any]],
    methods: Sequence[str],
    baseline: str,
    score: Callable[[list[str], list[Any]], dict[str, float]] | None = None,
    references: dict[str, Any] | None = None,
    greedy: bool = True,
    profile=None,
) -> dict[str, dict[str, Any]]:
    """Per-method summary of result rows (``method``, ``id``, ``sample``, ``tokens``, ``seconds`` ...);
    a row without ``sample`` is sample 0.

    ``score(samples, references)`` is the task metric (:meth:`~selfspec.tasks.task.Task.score_samples`),
    applied to each method's post-processed predictions (``prediction``) on the common
    generations: per example the list of its samples' predictions, in sample order. Its dict is
    the entry's ``metrics`` as it is (HumanEval's includes ``isolation``, how the programs ran).
    ``profile``: a :class:`~selfspec.measure.profile.Profile` to predict each method's time with.
    ``greedy=False`` (a sampling run): ``consistency`` and ``prefix_agreement`` are None, since
    lossless sampling keeps vanilla's output distribution, not its tokens.
    """
    common = common_rows(rows, methods, baseline)
    keys = [generation_key(r) for r in common.get(baseline, [])]
    ids = list(dict.fromkeys(i for i, _ in keys))
    base = common.get(baseline, [])
    base_tokens = sum(r["new_tokens"] for r in base)
    base_spt = per_token(sum(r["seconds"] for r in base), base_tokens)
    base_dspt = _decode_seconds_per_token(base)
    base_predicted = _predicted(base, profile)
    base_pspt = per_token(sum(base_predicted.values()), base_tokens) if base_predicted else None
    out: dict[str, dict[str, Any]] = {}
    for m in methods:
        rs = common[m]
        tokens = sum(r["new_tokens"] for r in rs)
        seconds = sum(r["seconds"] for r in rs)
        steps = sum(r["steps"] for r in rs)
        drafted = sum(r.get("drafted", 0) for r in rs)
        spt = per_token(seconds, tokens)
        entry: dict[str, Any] = {
            "n_examples": len(ids),
            "n_generations": len(rs),
            "new_tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds else None,
            "seconds_per_token": spt,
            "speedup": speedup(base_spt, spt),
            "decode_speedup": speedup(base_dspt, _decode_seconds_per_token(rs)),
            "tau": tokens / steps if steps else None,
            "acceptance_rate": sum(r.get("accepted_drafts", 0) for r in rs) / drafted if drafted else None,
            "lossless": all(r.get("lossless") for r in rs) if rs else None,
        }
        entry.update(consistency([r["tokens"] for r in rs], [r["tokens"] for r in base]) if greedy
                     else {"consistency": None, "prefix_agreement": None})
        if score is not None and references is not None and rs:
            samples: dict[str, list[str]] = {i: [] for i in ids}
            for k, r in zip(keys, rs):
                samples[k[0]].append(r["prediction"])
            entry["metrics"] = score(list(samples.values()), [references[i] for i in ids])
        entry.update(_ledger(rs, tokens, base_spt, profile, base_pspt))
        entry["stats"] = _mean_stats(rs)
        out[m] = entry
    return out


def _decode_seconds_per_token(rows: list[dict[str, Any]]) -> float | None:
    """Seconds per token after the prompt's step (module docstring: ``decode_speedup``), or None
    when a row has no ledger or trace."""
    if not rows or any(not r.get("ledger") or not r.get("trace") for r in rows):
        return None
    seconds = sum(r["seconds"] - r["ledger"].get("prefill", 0.0) for r in rows)
    tokens = sum(r["new_tokens"] - r["trace"][0].get("committed", 0) for r in rows)
    return per_token(seconds, tokens)


def _sum_components(dicts: Iterable[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for d in dicts:
        for k, v in d.items():
            out[k] += v
    return dict(out)


def _predicted(rows: list[dict[str, Any]], profile) -> dict[str, float] | None:
    """Predicted seconds per component of ``rows`` with ``profile`` (None without a profile or
    when a row has no trace)."""
    if profile is None or not rows or any(not r.get("trace") for r in rows):
        return None
    return _sum_components(profile.predict(r["trace"], sampled=r.get("seed") is not None) for r in rows)


def _ledger(rs: list[dict[str, Any]], tokens: int, base_spt: float | None, profile,
            base_pspt: float | None) -> dict[str, Any]:
    """A method's ``ledger`` and ``predicted_speedup`` (module docstring)."""
    if not rs or not tokens or not base_spt or any(not r.get("ledger") for r in rs):
        return {"ledger": None, "predicted_speedup": None}
    measured = {k: v / tokens / base_spt for k, v in _sum_components(r["ledger"] for r in rs).items()}
    ledger = {"unit": "vanilla steps per committed token", "measured": measured, "predicted": None}
    why = None if profile is None else profile.why_unpriced(step for r in rs for step in r.get("trace") or ())
    if why:  # a GPU profile that cannot price what ran: withheld, not extrapolated or priced as captured
        ledger["unpriced"] = why
        return {"ledger": ledger, "predicted_speedup": None}
    predicted = _predicted(rs, profile)
    predicted_speedup = None
    if predicted is not None and base_pspt:
        ledger["predicted"] = {k: v / tokens / base_pspt for k, v in predicted.items()}
        predicted_speedup = speedup(base_pspt, per_token(sum(predicted.values()), tokens))
        # what the profile does not model: measured minus predicted, per component, largest first
        gap = {k: measured.get(k, 0.0) - ledger["predicted"].get(k, 0.0) for k in measured}
        ledger["unmodelled"] = dict(sorted(((k, v) for k, v in gap.items() if abs(v) >= 0.005),
                                           key=lambda kv: -abs(kv[1])))
    return {"ledger": ledger, "predicted_speedup": predicted_speedup}


#: the least baseline time a contention check judges: shorter runs (a tiny model's milliseconds)
#: are within a shared machine's timer noise either way
CONTENTION_MIN_SECONDS = 2.0


#: the least seconds of one generation the per-generation check judges
GENERATION_MIN_SECONDS = 1.0
#: the least generations of a method the per-generation check needs for its median
GENERATION_MIN_COUNT = 3
#: ledger components with host work no profile prices (a skip search's programme, SWIFT's Bayesian
#: proposal: seconds at some steps only), left out of the per-generation load check on both sides
UNPRICED_COMPONENTS = ("search",)


def contention(base: list[dict[str, Any]], profile, threshold: float, here: dict[str, Any],
               min_seconds: float = CONTENTION_MIN_SECONDS, spoiled: list[dict[str, Any]] | None = None
               ) -> dict[str, Any] | None:
    """Whether the run was measured under load: the baseline's measured seconds over what the
    profile predicts for its traces (``ratio``), flagged above ``threshold``, or when any
    generation was spoiled by a burst of other load (``spoiled``, :func:`spoiled_generations`). Only
    a profile of this machine (``here``: :func:`selfspec.measure.profile.machine`) can tell, and only
    on at least ``min_seconds`` of the baseline's generations; None otherwise."""
    if profile is None or not profile.describes(here):
        return None
    predicted = _predicted(base, profile)
    seconds = sum(r["seconds"] for r in base)
    if not predicted or seconds < min_seconds:
        return None
    ratio = seconds / sum(predicted.values())
    return {"ratio": ratio, "threshold": threshold, "spoiled": spoiled or [],
            "flagged": ratio > threshold or bool(spoiled)}


def batch_contention(batch: dict[str, Any] | None, profile, threshold: float, here: dict[str, Any],
                     min_seconds: float = CONTENTION_MIN_SECONDS) -> dict[str, Any] | None:
    """:func:`contention` for a batched run (``batch_size`` > 1): the baseline's batches' wall seconds
    over what the profile predicts for their passes (``batch``: the baseline's entry of
    :func:`~selfspec.evaluation.batches.batch_summary`, its ``measured_over_predicted``), flagged above
    ``threshold``. A sequence's own seconds span its whole batch, the other sequences' passes
    included, so the per-generation ratios of :func:`contention` and :func:`spoiled_generations`
    would count the batch itself as load (every batched run was flagged, at 1.85–10× for B = 2–16
    on a quiet machine); a burst inside a batch is not told apart from the batch's own time. None
    where the profile cannot tell or the batches took under ``min_seconds``."""
    if (profile is None or not profile.describes(here) or not batch or batch.get("measured_over_predicted") is None
            or batch["seconds"] < min_seconds):
        return None
    ratio = batch["measured_over_predicted"]
    return {"ratio": ratio, "threshold": threshold, "spoiled": [], "flagged": ratio > threshold, "batched": True}


def spoiled_generations(finished: dict[str, list[dict[str, Any]]], profile, here: dict[str, Any], spike: float,
                        min_seconds: float = GENERATION_MIN_SECONDS) -> list[dict[str, Any]] | None:
    """The generations a burst of other load slowed. Each generation of a method with traces (not the
    HF peers) has a ratio, measured over predicted seconds; it is divided by its method's median
    ratio (what the profile does not model about the method cancels) and, with at least three such
    methods, by the least of those over its example's generations (what it does not model about the
    example, e.g. its prompt, slows each of them and cancels). What is left above ``spike`` is listed,
    with that excess. A short burst (a test run, a tool starting) spoils a generation or two,
    interleaved per example, and moves a whole run's ratio too little for :func:`contention`'s
    threshold; one that outlasts most of an example's generations still leaves the one it missed as
    that example's measure (an example's median would count such a burst as the example's own). Generations under
    ``min_seconds`` are within the timers' noise and not judged; the time of
    :data:`UNPRICED_COMPONENTS` is left out of both sides (it comes at some steps only, so the method's
    median does not cancel it). None where the profile cannot tell (another machine's, none)."""
    if profile is None or not profile.describes(here):
        return None
    ratios: dict[str, dict[tuple, tuple[dict[str, Any], float]]] = {}
    for method, rows in finished.items():
        judged = {}
        for r in rows:
            if not r.get("trace") or r["seconds"] < min_seconds:
                continue
            by_component = profile.predict(r["trace"], sampled=r.get("seed") is not None)
            predicted = sum(v for k, v in by_component.items() if k not in UNPRICED_COMPONENTS)
            seconds = r["seconds"] - sum((r.get("ledger") or {}).get(k, 0.0) for k in UNPRICED_COMPONENTS)
            if predicted > 0:
                judged[generation_key(r)] = (r, seconds / predicted)
        if len(judged) >= GENERATION_MIN_COUNT:
            ratios[method] = judged
    relative = {m: {k: x / statistics.median(v for _, v in judged.values()) for k, (_, x) in judged.items()}
                for m, judged in ratios.items()}
    example: dict[tuple, float] = {}
    if len(relative) >= 3:
        keys = {k for rel in relative.values() for k in rel}
        example = {k: min(rel[k] for rel in relative.values() if k in rel) for k in keys}
    out = []
    for method, rel in relative.items():
        for k, x in rel.items():
            excess = x / example.get(k, 1.0)
            if excess > spike:
                r = ratios[method][k][0]
                out.append({"method": method, "id": r["id"], "sample": r.get("sample", 0), "excess": excess})
    return out

"""PNG plots of records and training artefacts (matplotlib, Agg backend; no display needed).

``speedup``        speedup per method, grouped by task (one figure per table and model)
``ledger``         where the time goes: per method, its cost ledger in vanilla steps per committed token,
                   measured beside predicted (one figure per table, model and task)
``gamma``          acceptance rate (and speedup) against the confidence threshold γ: AdaDecode's
                   ``method.threshold``, the static ``method.draft_stop.threshold`` of Draft & Verify,
                   early exit and DEL (AdaDecode §4 robustness to γ; D&V Table 4)
``exit_layers``    how often each exit layer emitted a token (decoder stats ``exit_layer_<l>``)
``bo_trace``       the skip-set search: objective per iteration and best so far (D&V Figure 4)
``heads_training`` intermediate-head training loss per step (AdaDecode heads artefact)
``tree_latency``   forward latency and accepted length against tree size (PPD Figure 8)

Each function returns the written :class:`~selfspec.store.figure.Plot` (the PNG, a caption
saying what to see in it, the axis labels), or None when there is nothing to plot. Every axis
label names its quantity and unit.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from selfspec.reporting import breakdown  # noqa: E402
from selfspec.reporting.layouts import TASK_TITLE, task_order  # noqa: E402
from selfspec.reporting.breakdown import LOADED  # noqa: E402
from selfspec.reporting.records import Record  # noqa: E402
from selfspec.reporting.tables import method_rank, method_title, setting_title  # noqa: E402
from selfspec.store.figure import Plot, legend_columns, save_figure  # noqa: E402

log = logging.getLogger(__name__)

_EXIT_KEY = re.compile(r"^exit_layer_(\d+)$")
SPEEDUP_LABEL = "speedup vs vanilla (×)"
#: a skip-set search objective (artefacts.OBJECTIVES): its axis label and which way is better
BO_OBJECTIVES = {
    "speedup": (SPEEDUP_LABEL, "max"),
    "tokens_per_s": ("throughput (tokens/s)", "max"),
    "objective": ("time per verified token (s)", "min"),
    "target": ("BO target (−ms per token)", "max"),
    "score": ("BO score (higher is better, —)", "max"),
}


#: the hatch of a bar measured under load
_LOADED_HATCH = "//"
#: most bars per task in one panel of the speedup chart; past it, one panel per decoder family
PANEL_SERIES = 8
#: columns of panels when the chart is split
PANEL_COLUMNS = 2


def _family(r: Record) -> str:
    """The panel a record's bars go to: its decoder (a method's variants together); vanilla and
    the transformers peers share one."""
    decoder = str(r.decoder or r.method)
    return "vanilla and peers" if decoder == "vanilla" or decoder.startswith("hf_") else decoder


def settings(recs: list[Record]) -> list[str]:
    """The series of a chart of ``recs``: each setting's title in the tables' row order (a sampling
    record is its own series, ``AdaDecode, T=0.2``, beside the same method's greedy one)."""
    return sorted({setting_title(r) for r in recs},
                  key=lambda lab: method_rank(next(r for r in recs if setting_title(r) == lab)) + (lab,))


def family_panels(recs: list[Record], series: list[str], title: str) -> list[tuple[str, list[str]]]:
    """``[(panel title, series), ...]``: one panel titled ``title`` holding every series, or, past
    :data:`PANEL_SERIES` series, one panel per decoder family (:func:`_family`) in series order."""
    if len(series) <= PANEL_SERIES:
        return [(title, series)]
    family = {setting_title(r): _family(r) for r in recs}
    return [(f, [m for m in series if family[m] == f]) for f in dict.fromkeys(family[m] for m in series)]


def speedup_plot(records: list[Record], path: Path, title: str) -> Plot | None:
    """Grouped bars: one group per task, one bar per method (the baseline's 1.0 as a line). With
    more than :data:`PANEL_SERIES` methods, one panel per decoder family, so each panel holds a
    handful of series (the demo's ~25 made one unreadable legend). A bar measured under load (its
    run's contention check flagged it) is hatched, its number and its task say ``(loaded)``."""
    recs = [r for r in records if isinstance(r.metric("speedup"), (int, float))]
    if not recs:
        return None
    tasks = sorted({r.task for r in recs}, key=task_order)
    methods = settings(recs)
    value = {(r.task, setting_title(r)): r.metric("speedup") for r in recs}
    loaded = {(r.task, setting_title(r)) for r in recs if r.loaded}
    loaded_tasks = {t for t, _ in loaded}
    panels = family_panels(recs, methods, title)
    ncols = min(len(panels), PANEL_COLUMNS)
    nrows = -(-len(panels) // ncols)
    most = max(len(ms) for _, ms in panels)
    panel_width = max(5.0, 1.6 * len(tasks) + 0.3 * most)
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel_width * ncols, 3.6 * nrows), squeeze=False, sharey=True)
    for ax, (name, ms) in zip(axes.flat, panels):
        width = 0.8 / max(len(ms), 1)
        for j, m in enumerate(ms):
            xs = [i + (j - (len(ms) - 1) / 2) * width for i in range(len(tasks))]
            ys = [value.get((t, m), 0.0) for t in tasks]
            bars = ax.bar(xs, ys, width, label=m)
            for x, y, t, bar in zip(xs, ys, tasks, bars):
                if (t, m) in loaded:
                    bar.set_hatch(_LOADED_HATCH)
                if y:
                    ax.annotate(f"{y:.2f}", (x, y), ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(tasks)), [TASK_TITLE.get(t, t) + (f"\n{LOADED}" if t in loaded_tasks else "")
                                          for t in tasks])
        ax.set_xlabel("task")
        ax.set_ylabel(SPEEDUP_LABEL)
        ax.set_title(name, fontsize=10)
        handles = ax.get_legend_handles_labels()[0]
        if any(m in ms for _, m in loaded):
            handles.append(Patch(facecolor="white", edgecolor="black", hatch=_LOADED_HATCH,
                                 label=f"measured under load {LOADED}"))
        # beside the bars, never over them; in columns when many series would make it taller than the axes
        ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                  ncol=legend_columns(len(handles)))
    for ax in axes.flat[len(panels):]:
        ax.remove()
    if len(panels) > 1:
        fig.suptitle(title, fontsize=11)
    return save_figure(fig, path, (
        f"{title.replace(chr(10), ', ')}: each method's speedup over vanilla on the same examples, per task"
        + (", one panel per decoder family" if len(panels) > 1 else "") + ". "
        "Bars above the dashed line (1.0×) are faster than vanilla, below it slower; the number on a bar "
        "is its speedup."
        + (f" Hatched bars, and the tasks marked {LOADED}, were measured under load (the run's contention "
           "check flagged it): not clean figures." if loaded else "")))


#: inches of figure height per method of the ledger chart, and per panel (its title, the axis)
_LEDGER_ROW, _LEDGER_PANEL = 0.42, 0.9


def ledger_figure(records: list[Record], title: str):
    """``(figure, caption)`` of where the time goes for the records of one task and model, or None
    when none has a ledger (HF peers never do: they are left out).

    One horizontal bar per method: its measured cost per committed token in vanilla steps, stacked
    by ledger component (:data:`~selfspec.reporting.breakdown.COLOUR`, the same in every chart), with
    the predicted cost as a thin hatched bar under it where the ledger has one; a dashed line at 1.0
    (vanilla). A bar's length is ``1 / speedup``: shorter than the line is faster than vanilla. Past
    :data:`PANEL_SERIES` methods, one panel per decoder family (:func:`family_panels`), stacked with
    a shared axis. Runs measured under load say so in the number after the bar and in the title."""
    recs = [r for r in records if r.ledger and isinstance(r.ledger.get("measured"), dict)]
    if not recs:
        return None
    series = settings(recs)
    by_title = {setting_title(r): r for r in recs}
    panels = family_panels(recs, series, title)
    loaded = any(r.loaded for r in recs)
    if loaded:
        title = f"{title} — measured under load {LOADED}"
    height = sum(_LEDGER_ROW * len(ms) + _LEDGER_PANEL for _, ms in panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(8.5, height), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [len(ms) + 2 for _, ms in panels]})
    widest, used = 1.0, set()
    for ax, (name, ms) in zip(axes[:, 0], panels):
        for y, m in enumerate(ms):
            widest = max(widest, _ledger_bars(ax, by_title[m], y, used))
        ax.axvline(1.0, color="black", lw=1.0, ls="--")
        ax.set_yticks(range(len(ms)), ms, fontsize=8)
        ax.set_ylim(len(ms) - 0.4, -0.6)  # the first method on top
        ax.set_ylabel("method (setting)", fontsize=8)
        ax.set_xlabel("cost per token (vanilla steps)", fontsize=9)
        ax.xaxis.set_tick_params(labelbottom=True)  # each panel reads alone
        if len(panels) > 1:
            ax.set_title(name, fontsize=10)
    axes[0, 0].set_xlim(0.0, 1.25 * widest)
    profiles = sorted({str((r.profile or {}).get("name")) for r in recs
                       if r.profile and isinstance(r.ledger.get("predicted"), dict)})
    handles = _ledger_legend(recs, used, profiles)
    axes[0, 0].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if len(panels) > 1:
        fig.suptitle(title, fontsize=11)
    else:
        axes[0, 0].set_title(title, fontsize=10)
    caption = (
        f"{title.replace(chr(10), ', ')}: where each method's time goes, in vanilla steps per committed token "
        "(the cost ledger: each component's seconds per committed token ÷ vanilla's, in the same run), stacked "
        "by component" + (", one panel per decoder family" if len(panels) > 1 else "") + ". The thick bar is "
        "measured; the thin hatched bar under it is predicted from the step trace with the machine profile"
        + (f" {', '.join(profiles)}" if profiles else "") + ". A bar shorter than the dashed line (1.0, vanilla) "
        "is faster than vanilla: speedup = 1 ÷ its length, the number after it. Methods without a ledger (the "
        "transformers peers) are left out."
        + (f" Marked {LOADED}: measured under load (the run's contention check flagged it), not clean figures."
           if loaded else ""))
    return fig, caption


def _ledger_bars(ax, r: Record, y: int, used: set[str]) -> float:
    """One method's bars at row ``y`` of :func:`ledger_figure`: the measured cost per token stacked by
    component, and the predicted one thin and hatched under it where the ledger has one, each with its
    speedup after it; the components drawn are added to ``used``. Returns the longer bar's length."""
    sides = [("measured", y - 0.1, 0.5, {})]
    if isinstance(r.ledger.get("predicted"), dict):
        sides.append(("predicted", y + 0.3, 0.2, {"hatch": "////", "alpha": 0.7}))
    widest = 0.0
    for side, at, thick, style in sides:
        left = 0.0
        for k, v in breakdown.parts(r.ledger[side]).items():
            if v > 0:
                ax.barh(at, v, thick, left=left, color=breakdown.colour(k), edgecolor="#333", lw=0.3, **style)
                used.add(k)
                left += v
        widest = max(widest, left)
        speed = f"{1 / left:.2f}×" if left > 0 else "–"
        note = f" {LOADED}" if side == "measured" and r.loaded else " predicted" if side == "predicted" else ""
        ax.annotate(f" {speed}{note}", (left, at), va="center", ha="left", fontsize=7)
    return widest


def _ledger_legend(recs: list[Record], used: set[str], profiles: list[str]) -> list:
    """:func:`ledger_figure`'s legend: the components drawn (in the ledger's order), the predicted
    bar (with the profiles that priced it) where there is one, and vanilla's line."""
    handles = [Patch(facecolor=breakdown.colour(k), edgecolor="#333", lw=0.3, label=breakdown.label(k))
               for k in [*breakdown.COMPONENTS, *sorted(used - set(breakdown.COMPONENTS))] if k in used]
    if any(isinstance(r.ledger.get("predicted"), dict) for r in recs):
        on = f", {', '.join(profiles)}" if profiles else ""
        handles.append(Patch(facecolor="white", edgecolor="#333", hatch="////", label=f"predicted (thin{on})"))
    handles.append(Line2D([], [], color="black", lw=1.0, ls="--", label="vanilla (1.0)"))
    return handles


def ledger_plot(records: list[Record], path: Path, title: str) -> Plot | None:
    """:func:`ledger_figure`, written to ``path``."""
    made = ledger_figure(records, title)
    return save_figure(made[0], path, made[1]) if made else None


def threshold_of(r: Record) -> float | None:
    """The confidence threshold γ the record's method config fixes, if it fixes one: AdaDecode's
    ``threshold``, the static ``draft_stop`` threshold of Draft & Verify, early exit and DEL."""
    cfg = r.method_config
    if r.family == "adadecode":
        return cfg.get("threshold")
    stop = cfg.get("draft_stop")
    if isinstance(stop, dict) and stop.get("rule") == "static":
        return stop.get("threshold")
    return None


def gamma_series(records: list[Record]) -> dict[tuple[str, str], list[tuple[float, Any, Any]]]:
    """``{(method title, task): [(γ, acceptance rate, speedup), ...]}`` sorted by γ, for each method
    label run at two or more fixed thresholds."""
    series: dict[tuple[str, str], list[tuple[float, Any, Any]]] = defaultdict(list)
    for r in records:
        g = threshold_of(r)
        if isinstance(g, (int, float)):
            series[(method_title(r), r.task)].append((float(g), r.metric("acceptance_rate"), r.metric("speedup")))
    return {k: sorted(v) for k, v in series.items() if len({g for g, _, _ in v}) >= 2}


def gamma_plot(records: list[Record], path: Path) -> Plot | None:
    """Acceptance rate (solid) and speedup (dashed, right axis) against γ, per method and task."""
    series = gamma_series(records)
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax2 = ax.twinx()
    for (title, task), pts in sorted(series.items()):
        label = f"{title}, {TASK_TITLE.get(task, task)}"
        line, = ax.plot([g for g, a, _ in pts], [a if a is not None else float("nan") for _, a, _ in pts],
                        marker="o", label=label)
        ax2.plot([g for g, _, _ in pts], [s if s is not None else float("nan") for _, _, s in pts],
                 marker="x", ls="--", color=line.get_color())
    ax.set_xlabel("threshold γ (draft-token probability)")
    ax.set_ylabel("acceptance rate (accepted ÷ drafted; —)")
    ax2.set_ylabel(f"{SPEEDUP_LABEL[:-1]}; - -)")
    ax.set_title("Acceptance and speedup against the threshold γ", fontsize=10)
    ax.legend(fontsize=7)
    return save_figure(fig, path, (
        "Runs at fixed confidence thresholds γ: acceptance rate (solid, left axis) and speedup over vanilla "
        "(dashed, right axis). A higher γ drafts fewer tokens that are accepted more often; the best γ is "
        "where the dashed line peaks, and a flat line means the method is robust to γ."))


def exit_layer_counts(stats: dict[str, Any]) -> dict[int, float]:
    return {int(m.group(1)): float(v) for k, v in stats.items()
            if (m := _EXIT_KEY.match(k)) and isinstance(v, (int, float))}


def exit_layers_plot(records: list[Record], path: Path) -> Plot | None:
    """Share of early-emitted tokens per exit layer, one bar series per (method, task)."""
    hists = {}
    for r in records:
        counts = exit_layer_counts(r.stats)
        if counts and sum(counts.values()) > 0:
            hists[(setting_title(r), r.task, r.model)] = counts
    if not hists:
        return None
    layers = sorted({layer for c in hists.values() for layer in c})
    width = 0.8 / len(hists)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.5 * len(layers) + 3), 3.6))
    for j, ((label, task, model), counts) in enumerate(sorted(hists.items())):
        total = sum(counts.values())
        xs = [i + (j - (len(hists) - 1) / 2) * width for i in range(len(layers))]
        ax.bar(xs, [counts.get(layer, 0.0) / total for layer in layers], width,
               label=f"{label}, {TASK_TITLE.get(task, task)} ({model})")
    ax.set_xticks(range(len(layers)), [str(layer) for layer in layers])
    ax.set_xlabel("exit layer (0-based index of the layer whose head emitted the token)")
    ax.set_ylabel("share of early tokens (fraction)")
    ax.set_title("Exit-layer histogram", fontsize=10)
    ax.legend(fontsize=7)
    return save_figure(fig, path, (
        "Where tokens left the model early: the share of early-emitted tokens per exit layer, for each "
        "method and task. Mass at shallow layers means cheap drafts; mass at deep layers means the "
        "intermediate heads are rarely confident early."))


def trace_plot(traces: dict[str, list[dict[str, Any]]], path: Path, *, x: str, y: str, xlabel: str, ylabel: str,
               title: str, caption: str, best: str | None = "max") -> Plot | None:
    """Line plot of ``y`` against ``x`` for each named trace (``best``: also the running max/min)."""
    traces = {k: [p for p in v if isinstance(p.get(y), (int, float))] for k, v in traces.items()}
    traces = {k: v for k, v in traces.items() if v}
    if not traces:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, pts in sorted(traces.items()):
        xs = [p.get(x, i) for i, p in enumerate(pts)]
        ys = [p[y] for p in pts]
        line, = ax.plot(xs, ys, marker=".", lw=0.8, label=name)
        if best:
            run, out = None, []
            for v in ys:
                run = v if run is None else (max(run, v) if best == "max" else min(run, v))
                out.append(run)
            ax.plot(xs, out, color=line.get_color(), lw=1.6, label=f"{name} (best so far)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return save_figure(fig, path, caption)


def bo_trace_plot(traces: dict[str, list[dict[str, Any]]], objective: str, path: Path) -> Plot | None:
    """The skip-set searches' objective per evaluated candidate, and the best so far (D&V Figure 4)."""
    ylabel, best = BO_OBJECTIVES.get(objective, (f"{objective} (as logged)", "max"))
    return trace_plot(traces, path, x="iteration", y=objective, xlabel="search iteration (candidate skip set)",
                      ylabel=ylabel, title="Draft & Verify skip-set search (BO trace)", best=best, caption=(
                          "Draft & Verify's skip-set search: each evaluated candidate (thin line, dots) and "
                          "the best found so far (thick line). The search has converged where the thick "
                          "line flattens; its last value is the skip set's measured result."))


def heads_training_plot(histories: dict[str, list[dict[str, Any]]], path: Path) -> Plot | None:
    """AdaDecode heads: the training loss per logged step."""
    return trace_plot(histories, path, x="step", y="loss", xlabel="training step (optimiser updates)",
                      ylabel="loss: Σ KL(p* ‖ p_l) over heads (nats)", title="AdaDecode heads: training loss",
                      best=None, caption=(
                          "AdaDecode intermediate heads: the distillation loss (KL from the final layer's "
                          "distribution to each head's, summed over heads) per training step. It should "
                          "fall and flatten; a loss still falling at the end means more steps would help."))


def tree_latency_plot(curves: dict[str, list[dict[str, Any]]], path: Path) -> Plot | None:
    """Latency per forward pass against tree size (left), accept length if recorded (right)."""
    curves = {k: sorted((p for p in v if isinstance(p.get("latency"), (int, float))), key=lambda p: p["size"])
              for k, v in curves.items()}
    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax2 = None
    for name, pts in sorted(curves.items()):
        line, = ax.plot([p["size"] for p in pts], [1000 * p["latency"] for p in pts], marker="o", label=name)
        acc = [(p["size"], p["accept_length"]) for p in pts if isinstance(p.get("accept_length"), (int, float))]
        if acc:
            ax2 = ax2 or ax.twinx()
            ax2.plot(*zip(*acc), ls="--", marker="x", color=line.get_color())
            ax2.set_ylabel("expected accept length τ (tokens per step; - -)")
    ax.set_xlabel("tree size (tokens per forward pass)")
    ax.set_ylabel("forward latency (ms; —)")
    ax.set_title("PPD: latency against tree size", fontsize=10)
    ax.legend(fontsize=7)
    return save_figure(fig, path, (
        "PPD's hardware-aware tree: forward latency measured on this machine (solid, left axis) and the "
        "expected tokens per step τ (dashed, right axis) against tree size. The builder keeps the size that "
        "maximises τ ÷ latency; where latency grows faster than τ, size 1 (plain decoding) wins."))


def batch_plot(measured: dict[str, dict[int, float]], projected: dict[str, dict[str, dict[int, float]]], path: Path,
               title: str) -> Plot | None:
    """Speedup over vanilla at the same batch size against the batch size: one line per method, measured
    here (solid) and projected onto each GPU profile (one panel per profile: the same traces priced
    there). ``measured``: ``{method: {batch size: speedup}}``; ``projected``: ``{profile: {method:
    {batch size: speedup}}}`` (issue 54)."""
    panels = [("measured here", measured), *((f"projected: {p}", m) for p, m in projected.items())]
    panels = [(name, {m: s for m, s in series.items() if s}) for name, series in panels]
    panels = [(name, series) for name, series in panels if series]
    if not panels:
        return None
    sizes = sorted({b for _, series in panels for s in series.values() for b in s})
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.8), squeeze=False, sharey=True)
    for ax, (name, series) in zip(axes.flat, panels):
        for method, points in series.items():
            xs = sorted(points)
            ax.plot(xs, [points[b] for b in xs], marker="o", label=method)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size (sequences decoded at once)")
        ax.set_ylabel(SPEEDUP_LABEL)
        ax.set_title(name, fontsize=9)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    axes.flat[-1].legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                         ncol=legend_columns(len(handles)))
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path, (
        f"{title}: each method's throughput over vanilla's at the same batch size (sequences decoded at "
        "once), against the batch size; measured here, and projected onto each GPU profile from the same "
        "runs' passes. Above the dashed line (1.0×) a method decodes more tokens per second than vanilla at "
        "that batch size. Where a line falls with the batch size, its verification passes of B·(k + 1) rows "
        "cost more than the weight reads they share."))

"""PNG plots of records and training artefacts (matplotlib, Agg backend; no display needed).

``speedup``        speedup per method, grouped by task (one figure per table and model)
``gamma``          acceptance rate (and speedup) against the confidence threshold γ: AdaDecode's
                   ``method.threshold``, the static ``method.draft_stop.threshold`` of Draft & Verify,
                   early exit and DEL (AdaDecode §4 robustness to γ; D&V Table 4)
``exit_layers``    how often each exit layer emitted a token (decoder stats ``exit_layer_<l>``)
``bo_trace``       the skip-set search: objective per iteration and best so far (D&V Figure 4)
``heads_training`` intermediate-head training loss per step (AdaDecode heads artefact)
``tree_latency``   forward latency and accepted length against tree size (PPD Figure 8)

Each function returns the written :class:`~selfspec.reporting.figure.Plot` (the PNG, a caption
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

from selfspec.reporting.figure import Plot, legend_columns, save_figure  # noqa: E402
from selfspec.reporting.layouts import TASK_TITLE  # noqa: E402
from selfspec.reporting.records import Record  # noqa: E402
from selfspec.reporting.tables import method_rank, method_title, setting_title  # noqa: E402

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


#: most bars per task in one panel of the speedup chart; past it, one panel per decoder family
PANEL_SERIES = 8
#: columns of panels when the chart is split
PANEL_COLUMNS = 2


def _family(r: Record) -> str:
    """The panel a record's bars go to: its decoder (a method's variants together); vanilla and
    the transformers peers share one."""
    decoder = str(r.decoder or r.method)
    return "vanilla and peers" if decoder == "vanilla" or decoder.startswith("hf_") else decoder


def speedup_plot(records: list[Record], path: Path, title: str) -> Plot | None:
    """Grouped bars: one group per task, one bar per method (the baseline's 1.0 as a line). With
    more than :data:`PANEL_SERIES` methods, one panel per decoder family, so each panel holds a
    handful of series (the demo's ~25 made one unreadable legend)."""
    recs = [r for r in records if isinstance(r.metric("speedup"), (int, float))]
    if not recs:
        return None
    tasks = sorted({r.task for r in recs}, key=lambda t: list(TASK_TITLE).index(t) if t in TASK_TITLE else 99)
    # a sampling record is its own bar (``AdaDecode, T=0.2``), beside the same method's greedy one
    methods = sorted({setting_title(r) for r in recs},
                     key=lambda lab: method_rank(next(r for r in recs if setting_title(r) == lab)) + (lab,))
    value = {(r.task, setting_title(r)): r.metric("speedup") for r in recs}
    if len(methods) <= PANEL_SERIES:
        panels = [(title, methods)]
    else:
        family = {setting_title(r): _family(r) for r in recs}
        panels = [(f, [m for m in methods if family[m] == f]) for f in dict.fromkeys(family[m] for m in methods)]
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
            ax.bar(xs, ys, width, label=m)
            for x, y in zip(xs, ys):
                if y:
                    ax.annotate(f"{y:.2f}", (x, y), ha="center", va="bottom", fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xticks(range(len(tasks)), [TASK_TITLE.get(t, t) for t in tasks])
        ax.set_xlabel("task")
        ax.set_ylabel(SPEEDUP_LABEL)
        ax.set_title(name, fontsize=10)
        # beside the bars, never over them; in columns when many series would make it taller than the axes
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), ncol=legend_columns(len(ms)))
    for ax in axes.flat[len(panels):]:
        ax.remove()
    if len(panels) > 1:
        fig.suptitle(title, fontsize=11)
    return save_figure(fig, path, (
        f"{title.replace(chr(10), ', ')}: each method's speedup over vanilla on the same examples, per task"
        + (", one panel per decoder family" if len(panels) > 1 else "") + ". "
        "Bars above the dashed line (1.0×) are faster than vanilla, below it slower; the number on a bar "
        "is its speedup."))


def threshold_of(r: Record) -> float | None:
    """The confidence threshold γ the record's method config fixes, if it fixes one: AdaDecode's
    ``threshold`` (``gamma`` in records written before it was renamed), the static ``draft_stop``
    threshold of Draft & Verify, early exit and DEL (Draft & Verify's ``gamma0`` under ``draft_exit:
    static`` in records written before its keys became ``draft_stop``)."""
    cfg = r.method_config
    if r.family == "adadecode":
        return cfg.get("threshold", cfg.get("gamma"))
    if r.family == "draft_verify" and cfg.get("draft_exit") == "static":
        return cfg.get("gamma0")
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

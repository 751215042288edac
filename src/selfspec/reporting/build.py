"""Build the whole report: tables (Markdown, LaTeX), plots (PNG) and ``index.html``.

    result = build_report(inputs=["outputs/eval", "outputs/multirun"], out_dir="outputs/report")
    result.index        # outputs/report/index.html
    result.headline     # ["adadecode_main · smollm2-135m · AdaDecode: XSum 1.12×, ..."]
    result.answers      # per task: the fastest lossless method, its speedup, consistency, quality

Records are grouped by the ``report.table`` id their run's config carries (an experiment preset
sets it; plain runs fall in the ``runs`` table). Output layout::

    out_dir/tables/<table>.md, <table>.tex
    out_dir/plots/speedup_<table>_<model>.png, gamma.png, exit_layers.png, bo_trace.png, ...
    out_dir/plots/ledger_<table>_<model>_<task>.png   where the time goes, per task (cost ledgers)
    out_dir/index.html, report.md (the answer per task, then all tables)

A run whose contention check flagged it (``summary["contention"]["flagged"]``) was measured under
load: its speedups carry ``(loaded)`` in every table, answer, headline and chart, and the page warns
at the top, above its table and in its task's section.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from selfspec.reporting import artefact_figures as art, plots
from selfspec.reporting.answer import Answer, answers, to_markdown as to_answer_markdown
from selfspec.reporting.html import TaskSection, write_index
from selfspec.reporting.layouts import DEFAULT, LAYOUTS, TASK_TITLE, get_layout, task_order
from selfspec.reporting.breakdown import LOADED
from selfspec.reporting.paper import paper_records
from selfspec.reporting.records import LeftOut, Record, collect_runs, find_runs, newest_per_setting
from selfspec.reporting.tables import (Table, build_table, loaded_warnings, method_rank, method_title,
                                       method_variant_title, to_latex, to_markdown)
from selfspec.store.figure import Plot
from selfspec.store.files import read_json, write_text

log = logging.getLogger(__name__)

FORMATS = ("md", "tex")


@dataclass
class ReportResult:
    out_dir: Path
    index: Path | None
    tables: dict[str, Table] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    #: the PNGs with their captions and axis labels (the per-task ledger charts included)
    plots: list[Plot] = field(default_factory=list)
    #: per (table, model, task) with a cost ledger or measured under load: its chart and warnings
    sections: list[TaskSection] = field(default_factory=list)
    headline: list[str] = field(default_factory=list)
    #: per (model, task, decoding): the fastest lossless method (what the page leads with)
    answers: list[Answer] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    #: the runs (or some of their records) left out of the tables, and why: named in the log and on the page
    left_out: list[LeftOut] = field(default_factory=list)


def group_by_table(records: Iterable[Record]) -> dict[str, list[Record]]:
    groups: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        groups[r.table or DEFAULT.id].append(r)
    return groups


def headline(tables: dict[str, list[Record]]) -> list[str]:
    """One line per (table, model, method under test): its speedup on each task; where several runs
    of one setting are listed (``newest_only=false``), each run's, newest first, as the table's rows."""
    lines = []
    for table_id, recs in tables.items():
        layout = get_layout(table_id)
        metric = layout.headline
        per: dict[tuple, dict[str, list[Record]]] = defaultdict(lambda: defaultdict(list))
        for r in sorted(recs, key=lambda r: -r.provenance.get("mtime", 0.0)):
            if r.method == "vanilla" or not isinstance(r.metric(metric), (int, float)):
                continue
            name = method_title(r)
            if r.variant:
                name += f" [{r.variant}]"
            if r.decoding != "greedy":  # the temperature, and the batch size when it is not 1
                name += f" ({r.decoding})"
            per[(r.model, method_rank(r), name)][r.task].append(r)
        unit = "×" if metric == "speedup" else ""
        for (model, _, name), by_task in sorted(per.items(), key=lambda kv: (str(kv[0][0]), kv[0][1], kv[0][2])):
            cells = []
            for task, runs in sorted(by_task.items(), key=lambda kv: str(kv[0])):
                values = " / ".join(f"{r.metric(metric):.2f}{unit}" + (f" {LOADED}" if r.loaded else "") for r in runs)
                more = f" ({len(runs)} runs, newest first)" if len(runs) > 1 else ""
                cells.append(f"{TASK_TITLE.get(task, task)} {values}{more}")
            lines.append(f"{table_id} · {model} · {name}: {', '.join(cells)}")
    return lines


def build_report(
    inputs: Iterable[str | Path],
    out_dir: str | Path = "outputs/report",
    artefacts_dir: str | Path | None = "outputs/artefacts",
    tables: Iterable[str] | None = None,
    *,
    paper: bool = True,
    formats: Iterable[str] = FORMATS,
    make_plots: bool = True,
    newest_only: bool = True,
    extra_records: Iterable[Record] = (),
) -> ReportResult:
    """Regenerate every table, plot and the HTML page from the result files under ``inputs``."""
    inputs = [Path(p) for p in inputs]
    out_dir = Path(out_dir)
    formats = list(formats)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"report formats {unknown}: choose from {list(FORMATS)}")
    runs, records, by_table, left_out = _records_by_table(inputs, tables, newest_only, extra_records)
    result = ReportResult(out_dir=out_dir, index=None, records=records, left_out=left_out)
    rendered, all_md = _write_tables(result, by_table, formats, paper)
    result.answers = answers(r for recs in by_table.values() for r in recs)
    if all_md:
        write_text(out_dir / "report.md", "\n".join([to_answer_markdown(result.answers), *all_md]))
        result.files.append(out_dir / "report.md")

    result.sections = task_sections(by_table, out_dir / "plots" if make_plots else None)
    if make_plots:
        result.plots = _plots(by_table, records, out_dir / "plots", artefacts_dir)
    from selfspec.reporting.dashboard import write_markdown

    result.files.append(write_markdown(out_dir / "dashboard.md"))  # the W&B panel layout
    result.headline = headline(by_table)
    result.index = write_index(out_dir, rendered, result.plots, result.answers,
                               {"n_runs": len(runs), "inputs": inputs, "left_out": left_out}, runtime_reports(inputs), result.sections,
                               loaded_warnings([r for recs in by_table.values() for r in recs]))
    result.plots += [s.plot for s in result.sections if s.plot is not None]
    return result


def _records_by_table(inputs: list[Path], tables: Iterable[str] | None, newest_only: bool,
                      extra_records: Iterable[Record]) -> tuple[list, list[Record], dict[str, list[Record]], list[LeftOut]]:
    """The runs under ``inputs``, their records (the newest per setting when ``newest_only``), the
    records per table (``tables``: only those, an unknown id refused by name) and what is left out
    (runs that cannot be read; with ``newest_only``, older runs of a setting), each logged."""
    wanted = list(tables) if tables is not None else None
    for t in wanted or []:
        get_layout(t)  # an unknown id stops here, naming the known ones
    runs = find_runs(inputs)
    records, left_out = collect_runs(runs)
    records += list(extra_records)
    if not records:
        log.warning("nothing to report: no readable evaluation summary (summary.json) under %s%s; run "
                    "`python -m selfspec.evaluate ...` first, or point inputs=[...] at its run directories",
                    ", ".join(map(str, inputs)), f" ({len(runs)} found, none usable)" if runs else "")
    if newest_only:
        records, older = newest_per_setting(records)
        for why in older:
            log.info("left out %s", why)
        left_out += older
    by_table = group_by_table(records)
    if wanted is not None:
        by_table = {t: by_table[t] for t in wanted if t in by_table}
        missing = [t for t in wanted if t not in by_table]
        if missing:
            log.warning("no results for table(s) %s under %s", ", ".join(missing), ", ".join(map(str, inputs)))
    return runs, records, by_table, left_out


def _write_tables(result: ReportResult, by_table: dict[str, list[Record]], formats: list[str],
                  paper: bool) -> tuple[list, list[str]]:
    """Build each table (in the layouts' order, with the papers' rows when ``paper``) and write it
    in ``formats`` under ``result.out_dir / "tables"``; the (table, files) pairs and the markdown."""
    out_dir = result.out_dir
    (out_dir / "tables").mkdir(parents=True, exist_ok=True)
    order = list(LAYOUTS) + [DEFAULT.id]
    rendered, all_md = [], []
    for table_id in sorted(by_table, key=lambda t: order.index(t) if t in order else len(order)):
        layout = get_layout(table_id)
        refs = paper_records(table_id) if paper and table_id in LAYOUTS else []
        table = build_table(layout, by_table[table_id], refs)
        result.tables[table_id] = table
        files = {}
        md = to_markdown(table)
        all_md.append(md)
        writers = {"md": lambda: md, "tex": lambda: to_latex(table)}
        for fmt in formats:
            path = out_dir / "tables" / f"{table_id}.{fmt}"
            write_text(path, writers[fmt]())
            result.files.append(path)
            files[fmt] = path.relative_to(out_dir).as_posix()
        rendered.append((table, files))
    return rendered, all_md


def task_sections(by_table: dict[str, list[Record]], plot_dir: Path | None) -> list[TaskSection]:
    """"Where the time goes", per (table, model, task) whose records hold a cost ledger or were
    measured under load: the ledger chart (``plot_dir``: None, no charts) and the runs' warnings."""
    out = []
    for table_id, recs in by_table.items():
        for model in sorted({str(r.model) for r in recs}):
            mine = [r for r in recs if str(r.model) == model]
            for task in sorted({r.task for r in mine}, key=task_order):
                here = [r for r in mine if r.task == task]
                if not any(r.ledger or r.loaded for r in here):
                    continue
                title = f"{TASK_TITLE.get(task, task)} on {model}" + (f" ({table_id})" if len(by_table) > 1 else "")
                plot = plots.ledger_plot(here, plot_dir / f"ledger_{table_id}_{model}_{task}.png",
                                         f"Where the time goes: {title}") if plot_dir is not None else None
                anchor = re.sub(r"[^\w.-]+", "-", f"time-{table_id}-{model}-{task}")
                out.append(TaskSection(title, anchor, loaded_warnings(here), plot))
    return out


def runtime_reports(inputs: Iterable[Path]) -> list[dict[str, Any]]:
    """The runtime benchmarks (``runtime.json``, written by ``scripts/bench_runtime.py --out``
    and the demo) found under ``inputs``, newest first."""
    found = []
    for root in inputs:
        paths = [root] if root.is_file() else sorted(root.rglob("runtime.json")) if root.is_dir() else []
        for path in paths:
            if path.name == "runtime.json":
                try:
                    found.append((path.stat().st_mtime, read_json(path) | {"path": str(path)}))
                except (OSError, ValueError) as err:
                    log.warning("skipping unreadable runtime benchmark %s: %s", path, err)
    return [r for _, r in sorted(found, key=lambda t: -t[0])]


def _plots(by_table: dict[str, list[Record]], records: list[Record], plot_dir: Path,
           artefacts_dir: str | Path | None) -> list[Plot]:
    made: list[Plot | None] = []
    for table_id, recs in by_table.items():
        layout = get_layout(table_id)
        if layout.headline != "speedup":
            continue
        for model in sorted({r.model for r in recs if r.model}):
            made.append(plots.speedup_plot([r for r in recs if r.model == model],
                                           plot_dir / f"speedup_{table_id}_{model}.png",
                                           f"{layout.title}\n{model}"))
    made += _batch_plots(records, plot_dir)
    made.append(plots.gamma_plot(records, plot_dir / "gamma.png"))
    made.append(plots.exit_layers_plot(records, plot_dir / "exit_layers.png"))
    if artefacts_dir is not None:
        found = art.find_artefacts(artefacts_dir)
        traces, objective = art.bo_traces(found)
        if traces:
            made.append(plots.bo_trace_plot(traces, objective, plot_dir / "bo_trace.png"))
        made.append(plots.heads_training_plot(art.heads_histories(found), plot_dir / "heads_training.png"))
        made.append(plots.tree_latency_plot(art.tree_curves(found), plot_dir / "tree_latency.png"))
    return [p for p in made if p is not None]


def _batch_plots(records: list[Record], plot_dir: Path) -> list[Plot | None]:
    """Speedup against batch size (:func:`~selfspec.reporting.plots.batch_plot`), one chart per model,
    task and temperature whose runs swept ``batch_size`` (issue 54): measured, and projected onto each
    profile the runs were projected on."""
    groups: dict[tuple, list[Record]] = {}
    for r in records:
        if r.origin != "paper" and r.method != "vanilla":
            groups.setdefault((r.model, r.task, r.field("temperature")), []).append(r)
    made = []
    for (model, task, temperature), recs in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        if len({r.batch_size for r in recs}) < 2:
            continue
        measured: dict[str, dict[int, float]] = {}
        projected: dict[str, dict[str, dict[int, float]]] = {}
        for r in recs:
            title = method_variant_title(r)
            if isinstance(r.metric("speedup"), (int, float)):
                measured.setdefault(title, {})[r.batch_size] = float(r.metric("speedup"))
            for profile, p in r.projections.items():
                if isinstance(p.get("predicted_speedup"), (int, float)):
                    projected.setdefault(profile, {}).setdefault(title, {})[r.batch_size] = p["predicted_speedup"]
        made.append(plots.batch_plot(measured, projected, plot_dir / f"batch_{model}_{task}_{temperature}.png",
                                     f"{model} · {TASK_TITLE.get(task or '', task)}, {temperature}"))
    return made


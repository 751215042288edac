"""Reporting: the papers' tables (Markdown, LaTeX), plots (PNG) and a static HTML page from result files.

``python -m selfspec.report`` (``make tables``) reads evaluation run directories
(``summary.json``: :mod:`selfspec.evaluation`), training artefacts (``outputs/artefacts``) and,
when a W&B key is configured, W&B runs; groups the records by the ``report.table`` id their
experiment preset set (``conf/experiment/``); and writes ``outputs/report/``:

    tables/<table>.md, tables/<table>.tex   one per paper table (layouts.py), rows with sources
    plots/*.png                              speedup, γ, exit layers, BO trace, heads, tree latency,
                                             where the time goes per task (the cost ledgers)
    index.html, report.md                    the answer per task first, then every table and plot

Modules: :mod:`~selfspec.reporting.records` (reading runs), :mod:`~selfspec.reporting.layouts`
(one layout per paper table), :mod:`~selfspec.reporting.paper` (the papers' figures,
``paper_figures.yaml``), :mod:`~selfspec.reporting.tables`, :mod:`~selfspec.reporting.plots`,
:mod:`~selfspec.store.figure` (a PNG with its caption and axis labels; in ``store/``, where the
training jobs write their own plots too),
:mod:`~selfspec.reporting.answer` (per task, the fastest lossless method),
:mod:`~selfspec.reporting.breakdown` (the cost ledger's components, its sentence, runs measured under load),
:mod:`~selfspec.reporting.artefact_figures`, :mod:`~selfspec.reporting.html`,
:mod:`~selfspec.reporting.wandb_source`, :mod:`~selfspec.reporting.dashboard` (the W&B panel
layout) and :mod:`~selfspec.reporting.build` (all of it).
"""

from selfspec.reporting.build import ReportResult, build_report
from selfspec.reporting.layouts import LAYOUTS, Layout, get_layout
from selfspec.reporting.records import Record, collect, find_runs, read_run

__all__ = ["LAYOUTS", "Layout", "Record", "ReportResult", "build_report", "collect", "find_runs",
           "get_layout", "read_run"]

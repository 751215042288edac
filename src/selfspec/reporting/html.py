"""A static ``index.html``: every table and plot on one page, readable without W&B.

The page leads with the answer (per task, the fastest lossless method, its speedup, consistency
and quality: :mod:`~selfspec.reporting.answer`), then the paper-layout tables, rendered from the
same :class:`~selfspec.reporting.tables.Table` objects as the Markdown and LaTeX files, then where
the time goes per task (the cost ledgers: :class:`TaskSection`), the runtime benchmarks and the
plots, each a ``<figure>`` with a caption saying what to see in it. Runs measured under load are
warned about at the top, above their table and in their task's section (``<div class='warning'>``).
Files are linked relative to the page, so the report directory can be copied or served as it is.
"""

from __future__ import annotations

import html
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfspec.reporting import answer as ans
from selfspec.reporting.tables import MISSING, PROJECTIONS_TITLE, TASK_TITLE, Table, source_line
from selfspec.store.figure import Plot
from selfspec.store.files import write_text

_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0 1em;font-size:.85em}
th,td{border:1px solid #ccc;padding:.25em .5em;text-align:right}th{background:#f4f4f4}
td:first-child,th:first-child{text-align:left}td.src{white-space:nowrap}
tr.block td{background:#fafafa;font-style:italic;text-align:left}
.notes{font-size:.8em;color:#555}.scroll{overflow-x:auto}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(460px,1fr));gap:1em}
figure{margin:0;border:1px solid #eee;padding:.4em}figure img{display:block;max-width:100%;height:auto}
figure.wide{grid-column:1/-1}
.warning{background:#fff4e5;border:1px solid #e8a33d;border-left:6px solid #d9822b;padding:.4em 1em;margin:.6em 0}
figcaption{font-size:.8em;color:#444;margin-top:.3em}
.answer{background:#f6fbff;border:1px solid #cde;padding:.3em 1em .6em}.answer td,.answer th{text-align:left}
.answer td:nth-child(5){font-weight:bold}
code{background:#f4f4f4;padding:0 .2em}
"""

#: a plot wider than this (width ÷ height) takes a whole row of the plot grid
WIDE = 2.0


@dataclass(frozen=True)
class TaskSection:
    """Where the time goes for one (table, model, task): its heading, its anchor on the page, the
    warnings of its runs measured under load, and its cost-ledger chart (None: no chart)."""

    title: str
    anchor: str
    warnings: list[str]
    plot: Plot | None


def warnings_html(warnings: list[str]) -> str:
    """A warning box per run measured under load (empty when there is none)."""
    return "".join(f"<div class='warning' role='alert'>{html.escape(w)}</div>" for w in warnings)


def left_out_html(left_out: list[Any]) -> str:
    """The runs (or some of their records) the tables leave out, each with why, under the page's
    inputs (empty when none is)."""
    if not left_out:
        return ""
    items = "".join(f"<li>{html.escape(str(x))}</li>" for x in left_out)
    return f"<p class='notes' id='left-out'>Left out of the tables:</p><ul class='notes'>{items}</ul>"


def section_html(section: TaskSection, out_dir: Path) -> str:
    """One task's heading, its warnings, then its ledger chart across the page."""
    parts = [f"<h3 id='{html.escape(section.anchor)}'>{html.escape(section.title)}</h3>",
             warnings_html(section.warnings)]
    if section.plot is not None:
        parts.append(figure_html(section.plot, out_dir))
    return "\n".join(parts)


#: a table with more cell columns than this is shown as one table per column group (task): the
#: demo's all-methods table had ~40 columns and scrolled sideways
MAX_COLUMNS = 12


def column_groups(table: Table) -> list[tuple[str, slice, int | None]]:
    """The column groups of ``table`` to show as separate tables (a title, the slice of each row's
    cells and the group's index), or one group holding every column (index None) when the table
    fits the page."""
    width = sum(len(cells) for cells in table.group_cells)
    if width <= MAX_COLUMNS or len(table.groups) < 2:
        return [("", slice(0, width), None)]
    out, start = [], 0
    for i, (group, cells) in enumerate(zip(table.groups, table.group_cells)):
        out.append((TASK_TITLE.get(group, str(group)), slice(start, start + len(cells)), i))
        start += len(cells)
    return out


def table_html(table: Table, heading: str = "h3", sources: bool = True) -> str:
    """``table`` as HTML, one table per column group when it is too wide for the page
    (:func:`column_groups`); a group's table leaves out the rows with nothing in it (a sampling
    setting its task never ran). ``sources``: list the runs behind the rows (the projection table
    shares its table's)."""
    e = html.escape
    out = []
    for title, cols, group in column_groups(table):
        head = [table.header[0], *table.header[1:][cols], "src"]
        if title:
            out.append(f"<{heading}>{e(title)}</{heading}>")
        out += ["<table>", "<tr>" + "".join(f"<th>{e(h)}</th>" for h in head) + "</tr>"]
        for block in table.blocks:
            rows = [r for r in block.rows if group is None or any(c != MISSING for c in r.cells[cols])]
            if not rows:
                continue
            out.append(f'<tr class="block"><td colspan="{len(head)}">{e(block.title)}</td></tr>')
            for row in rows:
                mine = row.group_sources[group] if group is not None and row.group_sources else row.sources
                src = " ".join(f'<a href="#src-{table.layout.id}-{i}">[{i}]</a>' for i in mine)
                out.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in [row.label, *row.cells[cols]])
                           + f"<td class='src'>{src}</td></tr>")
        out.append("</table>")
    notes = [f"<li>{e(n)}</li>" for n in table.notes]
    notes += [f'<li id="src-{table.layout.id}-{i}">[{i}] {e(source_line(p))}</li>'
              for i, p in enumerate(table.sources, 1)] if sources else []
    if notes:
        out.append('<ul class="notes">' + "".join(notes) + "</ul>")
    return "\n".join(out)


def projections_html(table: Table) -> str:
    """A table's projections (:attr:`~selfspec.reporting.tables.Table.projections`) under their own
    heading, after the table (empty when none)."""
    if table.projections is None:
        return ""
    return (f"<h3>{html.escape(table.layout.title)}: {PROJECTIONS_TITLE}</h3>"
            f"<div class='scroll'>{table_html(table.projections, 'h4', sources=False)}</div>")


def runtime_html(r: dict[str, Any]) -> str:
    """One runtime benchmark (:mod:`selfspec.evaluation.runtime`) as a v(k) table and a list."""
    e = html.escape
    ks = list(next(iter(r["v"].values())))
    out = [f"<p class='notes'>{e(r['model'])} on {e(r['device'])} {e(r['dtype'])}, linear kernel "
           f"{e(str(r.get('linear_kernel')))}, capture {e(str(r.get('capture', 'off')))}, "
           f"{e(str(r.get('threads')))} threads; load average "
           f"{e(str(r.get('load')))} ({e(r.get('path', ''))}).</p>",
           "<table><tr><th>context</th>" + "".join(f"<th>v({k})</th>" for k in ks) + "<th>t(1) ms</th></tr>"]
    for c, row in r["v"].items():
        t1 = r["curve"]["seconds"][str(c)]["1"] * 1e3
        out.append(f"<tr><td>{e(str(c))}</td>" + "".join(f"<td>{row[k]:.2f}</td>" for k in ks)
                   + f"<td>{t1:.1f}</td></tr>")
    out.append("</table><ul class='notes'>"
               f"<li>v(k) = time of a forward of k new tokens (LM head on each) ÷ one token: a speculative "
               f"method must commit more than v(k) tokens per verification pass of k to beat plain decoding.</li>"
               f"<li>prefill: {r['prefill_tokens_per_s']:.0f} tokens/s; decoding at context {r['context']}: vanilla "
               f"{r['vanilla_tokens_per_s']:.2f} tokens/s, transformers generate {r['generate_tokens_per_s']:.2f} "
               f"tokens/s (ratio {r['vanilla_over_generate']:.3f})</li>"
               f"<li>LM head: {100 * r['head_share_of_step']:.1f}% of a decoding step</li>"
               f"<li>memory: {r['achieved_bytes_per_s'] / 1e9:.2f} GB/s achieved by vanilla decoding, "
               f"{100 * r['bandwidth_fraction']:.1f}% of the {r['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s at which this "
               f"machine reads a buffer of the same size, in the same process</li>{_peer_items(r)}</ul>")
    return "\n".join(out)


def _peer_items(r: dict) -> str:
    """The runtime report's decoding peers (vanilla, generate, llama.cpp when installed) as list items."""
    e = html.escape
    items = []
    for name, p in (r.get("peers") or {}).items():
        agree = "" if name == "vanilla" else (f", {p['agreement']}/{r.get('new_tokens')} tokens equal to vanilla's"
                                              + ("" if p["same_tokens"] else " (they differ)"))
        items.append(f"<li>{e(name)}: {p['decode_tokens_per_s']:.2f} tokens/s decoding, "
                     f"{p['prefill_tokens_per_s']:.0f} tokens/s prefill (to the first token), "
                     f"{100 * p['bandwidth_fraction']:.1f}% of the read roof{e(agree)}</li>")
    skipped = (r.get("llama_cpp") or {}).get("skipped")
    if skipped:
        items.append(f"<li>{e(skipped)}</li>")
    return "".join(items)


def answer_html(items: list[ans.Answer]) -> str:
    """The answer box: per task, the fastest lossless method and its figures."""
    e = html.escape
    if not items:
        return ("<div class='answer'><p>No method under test has a measured speedup yet: run "
                "<code>python -m selfspec.evaluate method=... task=...</code>.</p></div>")
    rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in ans.cells(a)) + "</tr>" for a in items)
    return ("<div class='answer scroll'><table><tr>" + "".join(f"<th>{e(h)}</th>" for h in ans.HEADER)
            + f"</tr>{rows}</table><p class='notes'>Speedup = vanilla seconds per token ÷ the method's, on the "
            "same examples in the same run; lossy runs (†) are left out here and shown in the tables below. "
            "Quality: the task's metric for the method and for vanilla on the same examples.</p></div>")


def figure_html(plot: Plot, out_dir: Path) -> str:
    """One plot as a ``<figure>`` linking the PNG, with its caption; a wide plot spans the row."""
    e = html.escape
    rel = e(plot.path.relative_to(out_dir).as_posix())
    wide = " class='wide'" if plot.aspect > WIDE else ""
    return (f"<figure{wide}><a href='{rel}'><img src='{rel}' alt='{e(plot.path.stem)}'></a>"
            f"<figcaption>{e(plot.caption)}</figcaption></figure>")


def write_index(out_dir: Path, tables: list[tuple[Table, dict[str, str]]], plots: list[Plot],
                answers: list[ans.Answer], info: dict[str, Any], runtime: list[dict[str, Any]] = (),
                sections: list[TaskSection] = (), warnings: list[str] = ()) -> Path:
    """``out_dir/index.html``: the warnings (runs measured under load), the answer, each table (links
    to its .md/.tex), where the time goes per task, runtime, the plots."""
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>selfspec report</title>"
             f"<link rel='icon' href='data:,'><style>{_STYLE}</style></head><body>",
             "<h1>selfspec report</h1>", warnings_html(list(warnings)),
             f"<p class='notes'>Generated {e(time.strftime('%Y-%m-%d %H:%M:%S'))} by <code>python -m "
             f"selfspec.report</code> from {e(str(info.get('n_runs', 0)))} run directories "
             f"({e(', '.join(map(str, info.get('inputs', []))))}).</p>", left_out_html(info.get("left_out", [])),
             "<h2 id='answer'>Fastest lossless method per task</h2>", answer_html(answers)]
    if not tables:
        parts.append("<p>No results found. Run <code>make sweep EXPERIMENT=...</code> or "
                     "<code>python -m selfspec.evaluate ...</code> first.</p>")
    for table, files in tables:
        links = " · ".join(f"<a href='{e(rel)}'>{e(kind)}</a>" for kind, rel in files.items())
        parts.append(f"<h2 id='{e(table.layout.id)}'>{e(table.layout.title)}</h2>")
        if table.layout.paper:
            parts.append(f"<p class='notes'>Layout of {e(table.layout.paper)}. {links}</p>")
        parts.append(warnings_html(table.warnings))
        parts.append(f"<div class='scroll'>{table_html(table)}</div>")
        parts.append(projections_html(table))
    if sections:
        parts.append("<h2 id='time'>Where the time goes, per task</h2><p class='notes'>Each method's cost "
                     "per committed token in vanilla steps, from its cost ledger: measured in the run, and "
                     "predicted from the step trace with a machine profile. The transformers peers have no "
                     "ledger.</p>")
        parts.extend(section_html(s, out_dir) for s in sections)
    if runtime:
        parts.append("<h2 id='runtime'>The runtime on this machine</h2>")
        parts.extend(f"<div class='scroll'>{runtime_html(r)}</div>" for r in runtime)
    if plots:
        parts.append("<h2 id='plots'>Plots</h2><div class='plots'>")
        parts.extend(figure_html(p, out_dir) for p in plots)
        parts.append("</div>")
    parts.append("<p class='notes'>W&amp;B: the panel layout for a dashboard is in "
                 "<a href='dashboard.md'>dashboard.md</a> (<code>python scripts/wandb_dashboard.py</code> saves it).</p>")
    parts.append("<p class='notes'>speedup = vanilla seconds per token ÷ method seconds per token on the "
                 "same examples (same process, interleaved, after warm-up); τ = tokens committed per step, "
                 "bonus token included (vanilla = 1.00); AR = accepted drafts ÷ drafted tokens; "
                 "consistency = share of examples whose greedy tokens equal vanilla's; a sampling row of a "
                 "lossless method is labelled lossless (distribution): speculative sampling keeps vanilla's "
                 "output distribution, not its tokens, so its consistency is n/a.</p></body></html>")
    return write_text(out_dir / "index.html", "\n".join(parts))

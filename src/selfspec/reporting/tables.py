"""Paper-style tables (Markdown and LaTeX) from records.

A :class:`Table` is built once from the records of one ``report.table`` id and rendered twice.
Measured rows come in one block per model; each row carries a source mark ``[n]`` whose note
gives the run directory, commit, hardware and library versions. Where the paper's model is the
run's model, the paper's figure for the same method and setting sits in a ``paper`` column next to
the measured cells; the paper's other models follow as a separate reference block.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

from selfspec.decoding import method_rank as rank_of, method_title as title_of
from selfspec.reporting.layouts import CELL_TITLE, Layout, TASK_SCORE, TASK_TITLE
from selfspec.reporting.breakdown import LOADED, contention_warning, in_words
from selfspec.reporting.records import Record

#: row order by decoder family: the reference first, selfspec's methods (the papers', then those
#: beyond the papers), then the transformers peers
MISSING = "–"
#: the consistency cell of a sampling row: token-level consistency does not apply there
NOT_APPLICABLE = "n/a"
#: the label of a lossless method's sampling row (speculative sampling keeps the distribution)
DISTRIBUTION = "lossless (distribution)"
#: figures that compare tokens with vanilla's, meaningful under greedy decoding only
TOKEN_FIGURES = ("consistency", "prefix_agreement")
#: the cells that show a measured speedup (marked :data:`~selfspec.reporting.breakdown.LOADED` when the
#: run was measured under load); the predicted and projected speedups follow the first of them
SPEEDUP_CELLS = ("tps_speedup", "speedup")
#: the cell kind of a speedup projected onto a machine profile: ``projected:<profile name>``
PROJECTED = "projected:"
#: the mark of a projection that is not the target machine's own (its note says why)
UNGATED = "‡"
#: the note of a table where several records share a row label (:func:`_group_rows`)
SAME_LABEL = ("rows of one label: several runs fill that row's cells, one row each, newest first (newest_only=false "
              "lists every run of a setting); each row's src names its run")
#: the title of a table's projections (:attr:`Table.projections`)
PROJECTIONS_TITLE = "projected on machine profiles"


def method_rank(record: Record) -> tuple[int, str, str]:
    """Row order: by decoder family (the method registry's order, :func:`selfspec.decoding.method_rank`),
    then by label."""
    return (rank_of(record.family), record.family, record.method)


def method_title(record: Record) -> str:
    """The family's title, with the label when the label is a variant of it:
    ``Draft & Verify``, ``Draft & Verify (draft_verify_static)``."""
    title = title_of(record.family)
    return title if record.method == record.family else f"{title} ({record.method})"


def method_variant_title(record: Record) -> str:
    """:func:`method_title` with the variant: ``Draft & Verify (draft_verify_static), γ=0.2``."""
    title = method_title(record)
    return f"{title}, {record.variant}" if record.variant else title


def setting_title(record: Record) -> str:
    """:func:`method_variant_title` with how a record decodes unless greedy one at a time:
    ``AdaDecode, T=0.2``, ``SWIFT, greedy, batch 8``."""
    title = method_variant_title(record)
    return title if record.decoding == "greedy" else f"{title}, {record.decoding}"


def is_baseline(record: Record) -> bool:
    return record.method == "vanilla" or record.family == "vanilla"


def losslessness_mark(record: Record) -> str:
    """What a row's label says about losslessness: `` †`` (lossy: PPD's typical acceptance),
    `` · lossless (distribution)`` (a lossless method's sampling row; not the baseline's own), else
    nothing (greedy rows: their consistency column measures it; the papers' rows: not measured here)."""
    if record.origin == "paper":
        return ""
    kind = record.losslessness
    if kind == "lossy":
        return " †"
    if kind == "distribution" and not is_baseline(record):
        return f" · {DISTRIBUTION}"
    return ""


def _num(value: Any, fmt: str) -> str:
    if value is None or isinstance(value, bool):
        return MISSING
    if isinstance(value, (int, float)):
        return format(value, fmt)
    return str(value)


def _times(value: Any, loaded: bool = False) -> str:
    """A speedup cell: ``1.57×``, ``1.57× (loaded)`` when measured under load, ``–`` when missing."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return MISSING
    return f"{value:.2f}× {LOADED}" if loaded else f"{value:.2f}×"


def cell_title(cell: str, task: str | None) -> str:
    if cell.startswith(PROJECTED):
        return profile_title(cell[len(PROJECTED):])
    if cell == "score":
        return TASK_SCORE.get(task or "", (None, "score"))[1]
    return CELL_TITLE.get(cell, cell)


def profile_title(name: str) -> str:
    """A projection's column title: its profile's machine and dtype (the model's shape is the run's
    own), e.g. ``cuda-nvidia-h100-80gb-hbm3, bfloat16`` for ``cuda-nvidia-h100-80gb-hbm3__smollm2-135m__bfloat16``;
    a float32 trace's note stays (``… (float32 trace)``)."""
    base, _, trace = name.partition(" (")
    parts = base.split("__")
    title = ", ".join([parts[0], *parts[2:]]) if len(parts) > 1 else base
    return f"{title} ({trace}" if trace else title


def projected_cell(p: dict[str, Any]) -> str:
    """A projection's cell (:mod:`selfspec.project`): the predicted speedup; ``gated 1.02×`` beside
    it where the gate was re-decided on the profile; :data:`UNGATED` where it replays the gate's
    choices made on the machine the run ran on, or where the profile cannot price the run."""
    if p.get("unpriced"):
        return f"not priced{UNGATED}"
    out = _times(p.get("predicted_speedup"))
    if isinstance(p.get("regated_speedup"), (int, float)):
        out += f" (gated {p['regated_speedup']:.2f}×)"
    elif str(p.get("gate", "")).startswith("replayed"):
        out += UNGATED
    return out


def format_cell(cell: str, record: Record | None) -> str:
    """One cell of ``record`` (``–`` where the figure is missing)."""
    if record is None:
        return MISSING
    m = record.metrics
    if cell in TOKEN_FIGURES and record.sampling and record.origin != "paper":
        return NOT_APPLICABLE
    if cell == "tps_speedup":
        tps, speedup = m.get("tokens_per_s"), m.get("speedup")
        if tps is None and speedup is None:
            return MISSING
        sp = f"({speedup:.2f}×)" if isinstance(speedup, (int, float)) else ""
        sp += f" {LOADED}" if record.loaded else ""
        return f"{_num(tps, '.2f')} {sp}".strip() if tps is not None else sp.strip()
    if cell == "speedup":
        return _times(m.get("speedup"), record.loaded)
    if cell == "predicted_speedup":
        return _times(m.get("predicted_speedup"))
    if cell.startswith(PROJECTED):
        return projected_cell(record.projections.get(cell[len(PROJECTED):]) or {})
    if cell == "ms_per_token":
        return _num(m.get("ms_per_token"), ".1f")
    if cell == "tau":
        return _num(m.get("tau"), ".2f")
    if cell == "score":
        key = TASK_SCORE.get(record.task or "", (None, None))[0]
        return _num(m.get(key), ".3f") if key else MISSING
    return _num(m.get(cell), ".3f")


@dataclass
class Row:
    label: str
    cells: list[str]
    #: indices into Table.sources (1-based) of the runs behind the row's cells; empty for paper rows
    sources: list[int] = field(default_factory=list)
    #: the same per column group (the runs behind that group's cells; empty: not kept per group)
    group_sources: list[list[int]] = field(default_factory=list)

    @property
    def mark(self) -> str:
        return f"[{','.join(map(str, self.sources))}]" if self.sources else ""


@dataclass
class Block:
    title: str
    rows: list[Row]


@dataclass
class Table:
    layout: Layout
    groups: list[str | None]
    #: per group, the cell kinds shown (plus "paper" where the paper matches)
    group_cells: list[list[str]]
    blocks: list[Block]
    sources: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: what the reader must know before reading a figure: runs measured under load
    warnings: list[str] = field(default_factory=list)
    #: its rows' speedups projected onto machine profiles (:mod:`selfspec.project`), as a table of their
    #: own (the same row labels and column groups, a column per profile; rows with no projection left
    #: out), so that the measured table stays narrow; None where no record is projected
    projections: "Table | None" = None

    @property
    def header(self) -> list[str]:
        head = ["Method"]
        for group, cells in zip(self.groups, self.group_cells):
            prefix = f"{TASK_TITLE.get(group, group)} " if group is not None and len(self.groups) > 1 else ""
            head += [f"{prefix}{cell_title(c, group) if c != 'paper' else 'paper'}" for c in cells]
        return head


def row_label(record: Record, layout: Layout) -> str:
    parts = []
    for f in layout.rows:
        if f == "method":
            parts.append(method_title(record))
        elif f == "temperature":
            parts.append(record.field("temperature"))
        else:
            value = record.field(f)
            if value not in (None, ""):
                parts.append(str(value))
    if record.batch_size != 1:  # a sweep over batch_size: one row per size, each against its vanilla
        parts.append(f"batch {record.batch_size}")
    label = ", ".join(parts) or method_title(record)
    return label + losslessness_mark(record)


def _row_key(record: Record, layout: Layout) -> tuple:
    key = []
    for f in layout.rows:
        if f == "method":
            key.append(method_rank(record))
        elif f == "temperature":
            t = record.temperature
            key.append((0, float(t)) if isinstance(t, (int, float)) else (1, str(t)))
        else:
            v = record.field(f)
            key.append((v is not None, str(v or "")))
    return (*key, record.batch_size)


def _column(record: Record, layout: Layout) -> Any:
    """The column group ``record``'s cells go to (None: the layout has one group)."""
    return record.field(layout.columns) if layout.columns else None


def group_kinds(layout: Layout, records: list[Record]) -> list[str]:
    """The cells of one column group: the layout's, with ``predicted_speedup`` (where a record has a
    predicted speedup) right after the first measured speedup cell, or at the end where the layout
    shows no speedup. Projections are a table of their own (:func:`projection_kinds`)."""
    extra = ["predicted_speedup"] if any(isinstance(r.metric("predicted_speedup"), (int, float))
                                         for r in records) else []
    cells = list(layout.cells)
    at = next((i + 1 for i, c in enumerate(cells) if c in SPEEDUP_CELLS), len(cells))
    return cells[:at] + extra + cells[at:]


def projection_kinds(records: list[Record]) -> list[str]:
    """The cells of one column group of the projection table: ``projected:<profile>`` per profile a
    record is projected on."""
    return [PROJECTED + name for name in sorted({name for r in records for name in r.projections})]


def _groups(records: list[Record], layout: Layout) -> list[str | None]:
    if layout.columns is None:
        return [None]
    present = {r.field(layout.columns) for r in records}
    ordered = [c for c in layout.column_order if c in present]
    return ordered + sorted(str(c) for c in present - set(ordered) if c is not None)


def _paper_cell(layout: Layout) -> str:
    """The cell the ``paper`` column repeats: the layout's first tokens/s or speedup-like cell."""
    for c in layout.cells:
        if c in ("tps_speedup", "speedup"):
            return c
    return layout.cells[0]


def _setting_key(r: Record, layout: Layout) -> tuple:
    """What must agree for a paper figure to sit next to a measured one: the row fields and task."""
    return tuple(r.field(f) for f in layout.rows if f != "model") + (r.task,)


def build_table(layout: Layout, measured: list[Record], paper: list[Record] | None = None) -> Table:
    """The table of ``layout`` from measured records and the paper's (``paper=None``: none), with its
    projections as a table of their own (:attr:`Table.projections`)."""
    paper = paper or []
    groups = _groups(measured or paper, layout)
    models = sorted({r.model for r in measured if r.model is not None})
    matching = [p for p in paper if p.model is not None and p.model in models]
    reference = [p for p in paper if p not in matching]
    paper_by_setting = {(p.model,) + _setting_key(p, layout): p for p in matching}
    paper_groups = {p.field(layout.columns) if layout.columns else None for p in matching}
    in_group = {g: [r for r in measured + reference if _column(r, layout) == g] for g in groups}
    group_cells = [group_kinds(layout, in_group[g]) + (["paper"] if g in paper_groups and matching else [])
                   for g in groups]
    table = Table(layout=layout, groups=groups, group_cells=group_cells, blocks=[])
    _fill(table, models, measured, reference, paper_by_setting)
    table.notes += _notes(measured, matching, reference)
    if any(len({row.label for row in b.rows}) < len(b.rows) for b in table.blocks):
        table.notes.append(SAME_LABEL)
    table.notes += list(layout.notes)
    table.warnings = loaded_warnings(measured)
    projected = [(g, projection_kinds(in_group[g])) for g in groups]
    projected = [(g, kinds) for g, kinds in projected if kinds]
    if projected:
        table.projections = Table(layout=layout, groups=[g for g, _ in projected],
                                  group_cells=[kinds for _, kinds in projected], blocks=[],
                                  sources=table.sources)  # one numbering of the runs for both
        _fill(table.projections, models, measured, reference, {}, projected_only=True)
        table.projections.notes += _projection_notes(measured, reference)
    return table


def _fill(table: Table, models: list[str], measured: list[Record], reference: list[Record],
          paper_by_setting: dict[tuple, Record], projected_only: bool = False) -> None:
    """``table``'s blocks: one per measured model, then one per paper model of the reference rows;
    ``projected_only`` (the projection table): a row without any projection is left out."""
    layout, pcell = table.layout, _paper_cell(table.layout)
    for model in models:
        by_row, labels = _group_rows([r for r in measured if r.model == model], layout)
        rows = []
        for key, per_group in by_row.items():
            cells: list[str] = []
            by_group: list[list[int]] = []
            for group, kinds in zip(table.groups, table.group_cells):
                rec = per_group.get(group)
                for kind in kinds:
                    if kind == "paper":
                        ref = paper_by_setting.get((model,) + _setting_key(rec, layout)) if rec else None
                        cells.append(format_cell(pcell, ref))
                    else:
                        cells.append(format_cell(kind, rec))
                by_group.append([table_source(table, rec)] if rec is not None and (
                    not projected_only or any(k[len(PROJECTED):] in rec.projections for k in kinds)) else [])
            if projected_only and not any(by_group):
                continue
            rows.append(Row(labels[key], cells, sorted({i for s in by_group for i in s}), by_group))
        table.blocks.append(Block(f"{model} (measured)", rows))

    for paper_model in sorted({p.paper_model for p in reference if p.paper_model}):
        recs = [p for p in reference if p.paper_model == paper_model]
        by_row, labels = _group_rows(recs, layout)
        rows = []
        for key, per_group in by_row.items():
            cells = []
            for group, kinds in zip(table.groups, table.group_cells):
                rec = per_group.get(group)
                cells += [format_cell(k, rec) if k != "paper" else "" for k in kinds]
            if projected_only and all(c == MISSING for c in cells):
                continue
            rows.append(Row(labels[key], cells, [], [[] for _ in table.groups]))
        if rows or not projected_only:
            sources = sorted({p.provenance["source"] for p in recs})
            table.blocks.append(Block(f"paper ({paper_model}), reference only: {'; '.join(sources)}", rows))


def _notes(measured: list[Record], matching: list[Record], reference: list[Record]) -> list[str]:
    """What a table's marks mean, for the marks it holds: the papers' sources, sampling rows, lossy
    rows, the paper rows' projections and what a projection could not price."""
    notes: list[str] = []
    if matching:
        notes.append("paper: " + "; ".join(sorted({p.provenance['source'] for p in matching})))
    if any(losslessness_mark(r).endswith(DISTRIBUTION) for r in measured):
        notes.append(f"{DISTRIBUTION}: a sampling row; speculative (rejection) sampling keeps vanilla's "
                     "output distribution, so token-level consistency does not apply (n/a)")
    if any(r.metrics.get("lossless") is False for r in measured):
        notes.append("† lossy: typical acceptance under sampling (PPD); not identical in distribution")
    if any(r.projections for r in measured + reference):
        notes.append("projected speedups (the step traces priced on other machines' profiles): the table below")
    return notes


def _projection_notes(measured: list[Record], reference: list[Record]) -> list[str]:
    """What the projection table's marks mean: the paper rows' traces, a gate replayed as it ran,
    what a profile could not price."""
    notes: list[str] = ["projected speedup = vanilla's predicted seconds per token ÷ the method's, both priced "
                        "on the profile from the run's step traces (python -m selfspec.project)"]
    projections = [p for r in measured + reference for p in r.projections.values()]
    if any(r.projections for r in reference):
        notes.append("projected (paper rows): the step the paper's τ or acceptance rate implies, priced on "
                     "the shipped profile of its model's shape (random weights of the shape, measured by "
                     "scripts/gpu_check.py's profile section): " + "; ".join(
                         sorted({f"{r.paper_model}: {p['paper_trace']}" for r in reference
                                 for p in r.projections.values()})))
    if any(str(p.get("gate", "")).startswith("replayed") for p in projections):
        notes.append(f"{UNGATED} projected as it ran: the speculation gate's choices were made on the machine "
                     "that ran it, not re-decided on the profile (project a never_slower=false run for that)")
    if any(p.get("unpriced") for p in projections):
        reasons = sorted({p["unpriced"] for p in projections if p.get("unpriced")})
        notes.append(f"not priced{UNGATED}: " + "; ".join(reasons))
    return notes


def loaded_warnings(records: list[Record]) -> list[str]:
    """One warning per run among ``records`` measured under load (its contention check flagged it),
    naming the model, task and decoding."""
    out: dict[str, str] = {}
    for r in records:
        where = f"{r.model} · {TASK_TITLE.get(r.task or '', r.task)}, {r.decoding}"
        warning = contention_warning(r.contention, where)
        if warning:
            out.setdefault(str(r.provenance.get("source")), warning)
    return list(out.values())


def _group_rows(records, layout) -> tuple[dict[tuple, dict[Any, Record]], dict[tuple, str]]:
    """Records -> ``{row key: {column group: record}}`` in row order, and each row's label. Where
    several records fall in one cell (runs of one setting under ``newest_only=false``, or records the
    layout's row fields do not tell apart), each takes a row of its own, newest first, right below
    the first: no record is dropped (issue 68)."""
    by_row: dict[tuple, dict[Any, Record]] = {}
    labels: dict[tuple, str] = {}
    for r in sorted(records, key=lambda r: (_row_key(r, layout), -r.provenance.get("mtime", 0.0))):
        column, n = _column(r, layout), 0
        while column in by_row.get((*_row_key(r, layout), n), {}):
            n += 1
        key = (*_row_key(r, layout), n)
        labels.setdefault(key, row_label(r, layout))
        by_row.setdefault(key, {})[column] = r
    return by_row, labels


def table_source(table: Table, record: Record) -> int:
    """The 1-based index of ``record``'s provenance in ``table.sources`` (added when new)."""
    prov = record.provenance
    for i, s in enumerate(table.sources):
        if s.get("source") == prov.get("source"):
            return i + 1
    table.sources.append(prov)
    return len(table.sources)


def source_line(prov: dict[str, Any]) -> str:
    parts = [str(prov.get("source"))]
    for key in ("commit", "hardware", "versions"):
        if prov.get(key):
            parts.append(f"{key} {prov[key]}" if key == "commit" else str(prov[key]))
    return " — ".join(parts)


# --- rendering -----------------------------------------------------------------------------------
def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def to_markdown(table: Table) -> str:
    layout = table.layout
    lines = [f"### {layout.title}", ""]
    lines += [f"> **Warning:** {_md_escape(w)}\n" for w in table.warnings]
    if layout.paper:
        lines += [f"Layout of {layout.paper}. speedup = vanilla s/token ÷ method s/token on the same "
                  "examples; τ = tokens per step incl. the bonus token.", ""]
    lines += _md_blocks(table)
    for note in table.notes:
        lines.append(f"- {_md_escape(note)}")
    for i, prov in enumerate(table.sources, 1):
        lines.append(f"- [{i}] {_md_escape(source_line(prov))}")
    if table.projections is not None:
        lines += ["", f"#### {layout.title}: {PROJECTIONS_TITLE}", "", *_md_blocks(table.projections)]
        lines += [f"- {_md_escape(note)}" for note in table.projections.notes]
    return "\n".join(lines).rstrip() + "\n"


def _md_blocks(table: Table) -> list[str]:
    """A table's blocks in Markdown, each under its title."""
    lines = []
    header = table.header + ["src"]
    for block in table.blocks:
        lines.append(f"**{_md_escape(block.title)}**")
        lines.append("")
        lines.append("| " + " | ".join(_md_escape(h) for h in header) + " |")
        lines.append("|" + "|".join(["---"] + ["---:"] * (len(header) - 2) + [":-:"]) + "|")
        for row in block.rows:
            lines.append("| " + " | ".join(_md_escape(c) for c in [row.label, *row.cells, row.mark]) + " |")
        lines.append("")
    return lines


_TEX_SPECIAL = {"&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
                "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "\\": r"\textbackslash{}",
                "×": r"$\times$", "τ": r"$\tau$", "γ": r"$\gamma$", "†": r"$^\dagger$", "–": "--",
                "—": "---", "≥": r"$\geq$"}


def tex_escape(text: str) -> str:
    return "".join(_TEX_SPECIAL.get(ch, ch) for ch in str(text))


def to_latex(table: Table) -> str:
    """``table`` as a LaTeX ``table`` environment, then its projections as another one."""
    out = _latex_table(table, table.layout.title, f"tab:{table.layout.id}")
    if table.projections is not None:
        out += _latex_table(table.projections, f"{table.layout.title}: {PROJECTIONS_TITLE}",
                            f"tab:{table.layout.id}-projected", sources=False)
    return out


def _latex_table(table: Table, title: str, label: str, sources: bool = True) -> str:
    layout = table.layout
    ncols = 1 + sum(len(c) for c in table.group_cells)
    lines = [r"\begin{table}[t]", r"\centering", r"\small",
             r"\begin{tabular}{l" + "".join("r" * len(c) for c in table.group_cells) + "}", r"\toprule"]
    if any(g is not None for g in table.groups) and len(table.groups) > 1:
        head, rules, col = [""], [], 2
        for group, cells in zip(table.groups, table.group_cells):
            head.append(rf"\multicolumn{{{len(cells)}}}{{c}}{{{tex_escape(TASK_TITLE.get(group, group))}}}")
            rules.append(rf"\cmidrule(lr){{{col}-{col + len(cells) - 1}}}")
            col += len(cells)
        lines.append(" & ".join(head) + r" \\")
        lines.append(" ".join(rules))
        sub = ["Method"] + [cell_title(c, g) if c != "paper" else "paper"
                            for g, cells in zip(table.groups, table.group_cells) for c in cells]
    else:
        sub = table.header
    lines.append(" & ".join(tex_escape(h) for h in sub) + r" \\")
    lines.append(r"\midrule")
    for block in table.blocks:
        lines.append(rf"\multicolumn{{{ncols}}}{{l}}{{\textit{{{tex_escape(block.title)}}}}} \\")
        for row in block.rows:
            label = tex_escape(row.label) + (f"$^{{{row.mark}}}$" if row.sources else "")
            lines.append(" & ".join([label, *(tex_escape(c) for c in row.cells)]) + r" \\")
        lines.append(r"\midrule" if block is not table.blocks[-1] else r"\bottomrule")
    if not table.blocks:
        lines.append(r"\bottomrule")
    lines.append(r"\end{tabular}")
    caption = tex_escape(title) + (f" (layout of {tex_escape(layout.paper)})" if layout.paper else "")
    lines.append(rf"\caption{{{caption}}}")
    lines.append(rf"\label{{{label}}}")
    notes = [r"\textbf{Warning:} " + tex_escape(w) for w in table.warnings] + [tex_escape(n) for n in table.notes]
    notes += [f"[{i}] " + tex_escape(source_line(p)) for i, p in enumerate(table.sources, 1)] if sources else []
    if notes:
        lines.append(r"\par\footnotesize " + r" \\ ".join(notes))
    lines.append(r"\end{table}")
    return "\n".join(lines) + "\n"


#: the line above :func:`ledger_lines` where they are printed (the demo's closing summary)
LINES_HEADING = ("Where the time goes (cost ledgers; speedup = τ tokens per step ÷ a step's cost in vanilla "
                 "steps, split by component):")


def ledger_lines(records: Iterable[Any]) -> list[str]:
    """The demo's closing lines: per run setting (model, task, decoding) a heading, then one
    :func:`in_words` sentence per method with a ledger (indented), in the tables' row order."""
    from selfspec.reporting.layouts import task_order

    groups: dict[tuple, list[Any]] = defaultdict(list)
    for r in records:
        if r.ledger:
            groups[(str(r.model), task_order(r.task), str(r.task), r.field("temperature"))].append(r)
    lines = []
    for (model, _, task, decoding), recs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][3] != "greedy", kv[0][3])):
        lines.append(f"{model} · {TASK_TITLE.get(task, task)}, {decoding}:")
        lines += [f"  {in_words(method_variant_title(r), r.metric('tau'), r.ledger, r.metric('predicted_speedup'), r.loaded)}"
                  for r in sorted(recs, key=method_rank)]
    return lines

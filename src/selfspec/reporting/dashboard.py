"""The W&B dashboard: a panel layout that shows the comparison at a glance.

:data:`SECTIONS` is the layout, as data: what the evaluation and training runs log (the runner's
``tracker.summary({"methods": {...}})`` flattens to ``methods/<method>/<figure>``; training jobs log
``train/loss``, the skip search ``skip_search_trace``, the tree build ``tree/*``). It is

* written as Markdown next to the report (``outputs/report/dashboard.md``) so a user can build the
  panels by hand in any workspace, and
* saved as a W&B workspace by ``python scripts/wandb_dashboard.py --entity E --project P`` when the
  ``wandb-workspaces`` package is installed and a W&B key is configured.

Runs are grouped by ``logger.group`` (the Hydra sweep name by default) and tagged
``model:<m>``, ``method:<label>``, ``task:<t>``, ``job:<type>`` (:func:`selfspec.tracking.start_run`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from selfspec.config import group_options
from selfspec.store.files import write_text

#: methods whose figures the panels show: every config label of conf/method/ (selfspec's
#: methods, their variants and the transformers peers), as results and summaries key them
METHODS = tuple(group_options("method"))


@dataclass(frozen=True)
class Panel:
    """One panel: ``kind`` bar | line | scalar; ``metrics`` the y values; ``x`` for line plots."""

    kind: str
    title: str
    metrics: tuple[str, ...]
    x: str | None = None
    groupby: str | None = None


@dataclass(frozen=True)
class Section:
    name: str
    filter: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def _per_method(figure: str) -> tuple[str, ...]:
    return tuple(f"methods/{m}/{figure}" for m in METHODS)


SECTIONS: tuple[Section, ...] = (
    Section("Speedup against vanilla (evaluation runs)", "job:evaluate", (
        Panel("bar", "speedup per method, by task", _per_method("speedup"), groupby="task.name"),
        Panel("bar", "tokens/s per method, by task", _per_method("tokens_per_s"), groupby="task.name"),
        Panel("bar", "τ: tokens per step (incl. bonus)", _per_method("tau"), groupby="task.name"),
        Panel("bar", "acceptance rate", _per_method("acceptance_rate"), groupby="task.name"),
        Panel("bar", "consistency with vanilla (greedy)", _per_method("consistency"), groupby="method_label"),
    )),
    Section("Task quality (same examples)", "job:evaluate", (
        Panel("bar", "ROUGE-2 (XSum, CNN/DM)", _per_method("metrics/rouge2"), groupby="method_label"),
        Panel("bar", "pass@1 (HumanEval)", _per_method("metrics/pass@1"), groupby="method_label"),
        Panel("bar", "accuracy (GSM8K)", _per_method("metrics/accuracy"), groupby="method_label"),
    )),
    Section("Training artefacts", "job:train-*, job:skips, job:ppd-tree", (
        Panel("line", "AdaDecode heads: KL loss", ("train/loss",), x="Step"),
        Panel("line", "PPD prompt tokens: KL loss", ("train/loss",), x="Step"),
        Panel("line", "skip-set search: speedup and s/token per candidate (BO trace)", ("speedup", "objective"), x="Step"),
        Panel("line", "PPD tree: latency and τ against size", ("tree/latency_ms", "tree/tau"), x="Step"),
    )),
)


def to_markdown(sections: tuple[Section, ...] = SECTIONS) -> str:
    lines = ["# W&B dashboard layout", "",
             "Group runs by `logger.group` (the sweep); filter with the run tags below. "
             "`python scripts/wandb_dashboard.py --entity E --project P` saves this as a workspace "
             "(needs `pip install wandb-workspaces` and a W&B key).", ""]
    for s in sections:
        lines += [f"## {s.name}", "", f"Runs: tag `{s.filter}`", "",
                  "| panel | kind | metrics | x / group by |", "|---|---|---|---|"]
        for p in s.panels:
            shown = ", ".join(f"`{m}`" for m in p.metrics[:4]) + (" …" if len(p.metrics) > 4 else "")
            lines.append(f"| {p.title} | {p.kind} | {shown} | {p.x or p.groupby or ''} |")
        lines.append("")
    return "\n".join(lines)


def write_markdown(path: str | Path) -> Path:
    return write_text(path, to_markdown())


def build_workspace(entity: str, project: str, name: str = "selfspec: methods at a glance"):
    """A ``wandb_workspaces`` Workspace of :data:`SECTIONS` (call ``.save()`` to publish it)."""
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError as err:
        raise ImportError("saving the W&B workspace needs `pip install wandb-workspaces`; the layout is "
                          "also in outputs/report/dashboard.md to build by hand") from err

    def panel(p: Panel):
        if p.kind == "bar":
            return wr.BarPlot(title=p.title, metrics=list(p.metrics), groupby=p.groupby)
        if p.kind == "line":
            return wr.LinePlot(title=p.title, x=p.x or "Step", y=list(p.metrics))
        return wr.ScalarChart(title=p.title, metric=p.metrics[0], groupby_aggfunc="mean")

    return ws.Workspace(name=name, entity=entity, project=project, sections=[
        ws.Section(name=s.name, panels=[panel(p) for p in s.panels], is_open=True) for s in SECTIONS])

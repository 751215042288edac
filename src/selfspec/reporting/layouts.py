"""Table layouts, one per paper table: the ``report.table`` id an experiment preset sets.

A layout says which record fields make a row (method, variant, temperature), which field makes
the column groups (the task, in the paper's order) and which cells each group shows. Cells:

``tps_speedup``      tokens/s with the speedup in parentheses: ``38.09 (1.14×)`` (AdaDecode Table 1)
``speedup``          ``1.57×`` (speedup = vanilla s/token ÷ method s/token, same examples); a run
                     measured under load (its contention check flagged it) shows ``1.57× (loaded)``
``predicted_speedup``  the speedup the cost ledger predicts from the step trace and a machine profile;
                     added after the speedup cell wherever a record has one (``tables.group_kinds``);
                     the projections a summary holds are a table of their own (``Table.projections``)
``ms_per_token``     latency per token in ms (Draft & Verify Tables 1–2)
``tau``              mean tokens committed per step, bonus token included (vanilla = 1.00)
``acceptance_rate``  accepted drafts / drafted tokens (Draft & Verify Tables 3–4 "AR")
``consistency``      share of examples whose greedy tokens equal vanilla's (AdaDecode ablation); ``n/a``
                     in a sampling row, labelled "lossless (distribution)" (speculative sampling keeps
                     vanilla's output distribution, not its tokens)
``score``            the task's quality metric: ROUGE-2 (XSum, CNN/DM), pass@k (HumanEval),
                     accuracy (GSM8K); MT-Bench has none here (LLM judge)
any other name       that metric as recorded (e.g. ``top1@2`` for PPD's top-1 accuracy at token distance 2,
                     read from the prompts artefact the run used)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from selfspec.reporting.fields import dotted as _cfg, label_under_test
from selfspec.tasks import TASKS


def adadecode_ablation_variant(cfg: dict[str, Any], summary: dict[str, Any]) -> str | None:
    """The AdaDecode ablation row (§4.3) a method config is: conf/method/adadecode_*.yaml."""
    if _cfg(cfg, "method.name") == "adadecode_noverify":
        return "w/o verification"
    if _cfg(cfg, "method.exit_layers") == "middle":
        return "fixed layer"
    kind = _cfg(cfg, "method.head_kind")
    if kind == "lm_head":
        return "original LM head"
    if kind == "full":
        return "full-parameterised head"
    if _cfg(cfg, "method.heads_task") == "mixed":
        return "mixed-domain head"
    return "full"


def fixed_k_variant(cfg: dict[str, Any], summary: dict[str, Any]) -> str | None:
    """Draft & Verify Table 3: K drafts per step, no draft exit."""
    return f"K={_cfg(cfg, 'method.max_draft')}"


def draft_exit_variant(cfg: dict[str, Any], summary: dict[str, Any]) -> str | None:
    """Draft & Verify Table 4: a static threshold γ, or the adaptive rule from its initial γ0
    (``method.draft_stop``)."""
    stop = _cfg(cfg, "method.draft_stop") or {}
    rule, gamma0 = stop.get("rule"), stop.get("threshold")
    if rule == "adaptive":
        return f"adaptive (γ0={gamma0:g})" if isinstance(gamma0, (int, float)) else "adaptive"
    return f"γ={gamma0:g}" if isinstance(gamma0, (int, float)) else str(gamma0)


def prompts_variant(cfg: dict[str, Any], summary: dict[str, Any]) -> str | None:
    """PPD Table 2 rows: the prompt tokens' count m, EPTs per token and training steps."""
    from selfspec.reporting.artefact_figures import read_meta

    for path in (summary.get("artefacts") or {}).get(label_under_test(summary), []) or []:
        from pathlib import Path

        meta = read_meta(Path(path)) or {}
        if meta.get("kind") == "prompts":
            tc = meta.get("train_config") or {}
            return f"m={tc.get('m')}, EPT={tc.get('n_ept')}, {tc.get('steps')} steps"
    return None

def draft_vocab_variant(cfg: dict[str, Any], summary: dict[str, Any]) -> str | None:
    """The draft head of a self-drafting method (beyond the papers): the full LM head, or the
    truncated vocabulary ``method.draft_vocab`` names (its size, as the run recorded it)."""
    if _cfg(cfg, "method.draft_vocab") in (None, ""):
        return "full head"
    entry = ((summary.get("methods") or {}).get(label_under_test(summary)) or {})
    size = (entry.get("stats") or {}).get("draft_vocab_size")
    return f"truncated head ({size:.0f} tokens)" if isinstance(size, (int, float)) else "truncated head"


#: quality metric per task, as the papers report it
#: tasks the papers report that selfspec does not run (their rows come from paper_figures.yaml)
PAPER_TASKS = {"alpaca": "Alpaca"}
#: each task's title, in the papers' order: the task classes' own (:data:`selfspec.tasks.TASKS`), then
#: :data:`PAPER_TASKS`
TASK_TITLE = {**{name: cls.title for name, cls in TASKS.items()}, **PAPER_TASKS}
#: task -> (the score's key, its column title): the task classes' ``score_column``
TASK_SCORE = {name: cls.score_column for name, cls in TASKS.items() if cls.score_column}


def task_order(task: str | None) -> int:
    """A task's place in the papers' order (:data:`TASK_TITLE`); unknown tasks last."""
    return list(TASK_TITLE).index(task) if task in TASK_TITLE else len(TASK_TITLE)


CELL_TITLE = {
    "tps_speedup": "tok/s (speedup)",
    "speedup": "Speedup",
    "predicted_speedup": "Predicted speedup",
    "ms_per_token": "ms/token",
    "tau": "τ",
    "acceptance_rate": "AR",
    "consistency": "Consistency",
    "tokens_per_s": "tok/s",
    "draft_vocab_coverage": "Coverage",
    "draft_vocab_size": "|V| draft",
}


@dataclass(frozen=True)
class Layout:
    """How one paper table is laid out; ``paper`` names the table the layout follows."""

    id: str
    title: str
    paper: str
    rows: tuple[str, ...] = ("method",)
    #: record field whose values become column groups (None: one group)
    columns: str | None = "task"
    column_order: tuple[str, ...] = ()
    cells: tuple[str, ...] = ("tps_speedup", "tau", "consistency", "score")
    #: record metric used for the "speedup per method" plot and the headline
    headline: str = "speedup"
    #: the row's variant from a run's (config, summary); None: generic (method config + overrides)
    variant: Callable[[dict[str, Any], dict[str, Any]], str | None] | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)


LAYOUTS: dict[str, Layout] = {
    layout.id: layout
    for layout in (
        Layout(
            id="main",
            title="Every method and peer against vanilla on every task",
            paper="",
            # greedy rows and, where sampling runs exist, each method's sampling row (its temperature)
            rows=("method", "temperature"),
            column_order=("xsum", "cnndm", "humaneval", "gsm8k", "mtbench"),
            cells=("tps_speedup", "tau", "acceptance_rate", "consistency", "score"),
        ),
        Layout(
            id="adadecode_main",
            title="AdaDecode main results: throughput per method and task",
            paper="AdaDecode (ICML 2025) Table 1",
            column_order=("xsum", "humaneval", "gsm8k"),
            cells=("tps_speedup", "tau", "consistency", "score"),
        ),
        Layout(
            id="adadecode_ablation",
            title="AdaDecode ablation: verification, adaptive layers, head parameterisation",
            paper="AdaDecode (ICML 2025) ablation table",
            rows=("variant",),
            column_order=("humaneval",),
            cells=("consistency", "speedup", "tau"),
            variant=adadecode_ablation_variant,
        ),
        Layout(
            id="dv_text",
            title="Draft & Verify: text generation (greedy and sampling)",
            paper="Draft & Verify Table 1",
            rows=("method", "temperature"),
            column_order=("cnndm", "xsum"),
            cells=("score", "ms_per_token", "speedup", "tau"),
        ),
        Layout(
            id="dv_code",
            title="Draft & Verify: code generation (pass@1 greedy, pass@10 sampling)",
            paper="Draft & Verify Table 2",
            rows=("method", "temperature"),
            column_order=("humaneval",),
            cells=("pass@1", "pass@10", "ms_per_token", "speedup", "tau"),
        ),
        Layout(
            id="dv_fixed_k",
            title="Draft & Verify: a fixed number K of draft tokens (no draft exit)",
            paper="Draft & Verify Table 3",
            rows=("method", "variant"),
            variant=fixed_k_variant,
            column_order=("cnndm",),
            cells=("acceptance_rate", "speedup", "tau"),
        ),
        Layout(
            id="dv_static",
            title="Draft & Verify: static draft-exit threshold γ (K = 12) vs adaptive",
            paper="Draft & Verify Table 4",
            rows=("method", "variant"),
            variant=draft_exit_variant,
            column_order=("cnndm",),
            cells=("acceptance_rate", "speedup", "tau"),
        ),
        Layout(
            id="ppd_speedup",
            title="PPD: speedup across MT-Bench, HumanEval and GSM8K",
            paper="PPD Table 1 and Figure 5",
            rows=("method", "temperature"),
            column_order=("mtbench", "humaneval", "gsm8k"),
            cells=("tps_speedup", "tau", "score"),
        ),
        Layout(
            id="ppd_accuracy",
            title="PPD: prediction accuracy by token distance (@i) and top-k",
            paper="PPD Table 2 (App. B.1)",
            rows=("method", "variant"),
            columns=None,
            variant=prompts_variant,
            cells=("top1@1", "top5@1", "top1@2", "top5@2", "top1@3", "top5@3", "tau", "speedup"),
            headline="top1@1",
        ),
        Layout(
            id="del_main",
            title="DEL: dynamic exit layer vs fixed early-exit self-speculation",
            paper="DEL (COLM 2025) Tables 1–2 / OpenReview rebuttal",
            column_order=("cnndm", "xsum", "humaneval", "gsm8k"),
            cells=("tps_speedup", "tau", "acceptance_rate", "score"),
        ),
        Layout(
            id="swift_main",
            title="SWIFT: on-the-fly self-speculative decoding",
            paper="SWIFT (ICLR 2025) main results",
            column_order=("cnndm", "gsm8k", "humaneval"),
            cells=("tps_speedup", "tau", "acceptance_rate", "consistency", "score"),
            notes=("SWIFT reports 1.3–1.6× on Llama-2-13B/70B and CodeLlama (abstract); its per-table figures are not in "
                   "the papers selfspec reads. AdaDecode's Table 1 measured SWIFT on CodeLlama-13B (adadecode_main). "
                   "The paper's GSM8K is 5-shot; the preset runs every task with one shots value.",),
        ),
        Layout(
            id="knapspec_main",
            title="KnapSpec and CLaSp: skip sets searched while decoding",
            paper="KnapSpec (ICML 2026) main comparison, with CLaSp (ACL 2025) as its baseline",
            column_order=("cnndm", "xsum", "gsm8k", "humaneval", "mtbench"),
            cells=("tps_speedup", "tau", "acceptance_rate", "consistency", "score"),
            notes=("The paper measures long inputs (PG19, GovReport, BookSum) and long generations (AIME, GPQA, "
                   "MMLU-Pro), which selfspec does not run; these are selfspec's tasks. KnapSpec reports up to "
                   "1.47× over autoregressive decoding on Qwen3 and Llama-3.x (abstract), CLaSp 1.3–1.7× on Llama-3 "
                   "(abstract); their per-table figures are not in the papers selfspec reads.",),
        ),
        Layout(
            id="draft_vocab",
            title="Truncated-vocabulary draft heads (beyond the papers): coverage, acceptance, speedup",
            paper="beyond the papers (after FR-Spec arXiv 2502.14856, VocabTrim arXiv 2506.22694)",
            rows=("method", "variant"),
            variant=draft_vocab_variant,
            column_order=("xsum", "humaneval", "gsm8k"),
            cells=("draft_vocab_coverage", "acceptance_rate", "speedup", "tau", "consistency"),
        ),
    )
}

#: layout for results whose run config names no ``report.table`` (plain evaluate runs)
DEFAULT = Layout(
    id="runs",
    title="Evaluation runs without a preset",
    paper="",
    rows=("method", "temperature"),
    cells=("tps_speedup", "tau", "acceptance_rate", "consistency", "score"),
)


def get_layout(table_id: str | None) -> Layout:
    """The layout of ``table_id``; None gives :data:`DEFAULT`; an unknown id names the known ones."""
    if table_id is None or table_id == DEFAULT.id:
        return DEFAULT
    try:
        return LAYOUTS[table_id]
    except KeyError:
        raise ValueError(
            f"unknown report.table {table_id!r}; known tables: {', '.join(sorted(LAYOUTS))} "
            "(src/selfspec/reporting/layouts.py)"
        ) from None

"""The report side of the cost ledger (issue 23; the format: each method's ``ledger`` and
``predicted_speedup``, the run's ``profile``, ``contention`` and ``projections``), on synthetic
summaries: where the time goes per task, predicted and projected speedups in the tables, runs
measured under load marked everywhere, and the demo's closing sentence per method."""

from __future__ import annotations

import json
import re

import pytest
from test_report import assert_plots_explained, entry, write_run

from selfspec.reporting import build_report, read_run
from selfspec.reporting.breakdown import COLOUR, LOADED, in_words
from selfspec.reporting.plots import PANEL_SERIES, ledger_figure
from selfspec.reporting.records import Record
from selfspec.reporting.tables import ledger_lines

TAU = 1.21
#: AdaDecode's measured cost of one step, in vanilla steps, per component (sum 1.68)
PER_STEP = {"heads": 0.31, "draft": 0.25, "verify": 1.00, "host": 0.12}
ADA = {"unit": "vanilla steps per committed token", "measured": {k: v / TAU for k, v in PER_STEP.items()},
       "predicted": {"heads": 0.2, "verify": 1.0 / TAU, "host": 0.05, "prefill": 0.0}}
PROFILE = {"name": "laptop-cpu", "path": "profiles/laptop-cpu.json", "device": "cpu", "hardware": "x86_64"}


def ledger(measured: dict, predicted: dict | None = None) -> dict:
    return {"unit": "vanilla steps per committed token", "measured": measured, "predicted": predicted}


def with_ledger(e: dict, led: dict | None, predicted_speedup=None) -> dict:
    return {**e, "ledger": led, "predicted_speedup": predicted_speedup}


def methods() -> dict:
    """vanilla, AdaDecode and Draft & Verify with ledgers; the HF peer without (as the runtime writes it)."""
    return {
        "vanilla": with_ledger(entry(20.0, 1.0), ledger({"prefill": 0.04, "plain": 0.92, "host": 0.04},
                                                        {"prefill": 0.04, "plain": 0.96}), 1.0),
        "adadecode": with_ledger(entry(14.4, TAU / 1.68, tau=TAU), ADA, 1 / (0.2 + 1.0 / TAU + 0.05)),
        "draft_verify": with_ledger(entry(26.0, 1.3, tau=1.9), ledger({"draft": 0.3, "verify": 0.45}), None),
        "hf_generate": with_ledger(entry(18.0, 0.9), None),
    }


@pytest.fixture
def ledger_runs(tmp_path):
    return write_ledger_runs(tmp_path / "runs")


def write_ledger_runs(root):
    """Two task runs of the ``main`` table under ``root``: XSum clean, with a profile and a projection
    onto a second profile; HumanEval flagged by its contention check (measured under load)."""
    projected = {"gpu-h100": {"adadecode": {"predicted_speedup": 1.8, "ledger": {"verify": 0.4, "heads": 0.15}},
                              "vanilla": {"predicted_speedup": 1.0, "ledger": {"plain": 1.0}}}}
    write_run(root / "0_xsum", table="main", task="xsum", method="adadecode", methods=methods(), model="m",
              extra={"profile": PROFILE, "contention": {"ratio": 1.02, "threshold": 1.25, "flagged": False},
                     "projections": projected})
    write_run(root / "1_humaneval", table="main", task="humaneval", method="adadecode", methods=methods(), model="m",
              extra={"profile": PROFILE, "contention": {"ratio": 1.61, "threshold": 1.25, "flagged": True}})
    return root


def test_in_words_gives_the_step_as_tau_over_its_cost():
    """``speedup = 1/c = τ / (τ·c)``: the step's cost split by component, largest first, zeros left out."""
    assert in_words("AdaDecode", TAU, ADA) == (
        "AdaDecode 0.72× = τ 1.21 / 1.68 steps (verification 1.00, exit heads 0.31, drafting 0.25, bookkeeping 0.12)")
    assert in_words("AdaDecode", TAU, ADA, 0.8, loaded=True) == (
        f"AdaDecode 0.72× {LOADED} = τ 1.21 / 1.68 steps (verification 1.00, exit heads 0.31, drafting 0.25, "
        "bookkeeping 0.12); predicted 0.80×")
    # a component left out counts 0; without τ the sentence is per token
    assert in_words("Vanilla", None, ledger({"plain": 0.9, "host": 0.1, "tree": 0.0})) == (
        "Vanilla 1.00× = 1 / 1.00 steps per token (plain steps 0.90, bookkeeping 0.10)")


def test_records_carry_the_ledger_profile_projections_and_contention(ledger_runs, tmp_path):
    recs = {r.method: r for r in read_run(ledger_runs / "0_xsum")}
    ada = recs["adadecode"]
    assert ada.ledger == ADA and ada.metrics["predicted_speedup"] == pytest.approx(1 / (0.2 + 1.0 / TAU + 0.05))
    assert ada.profile == PROFILE and ada.projections == {"gpu-h100": {"predicted_speedup": 1.8,
                                                                       "ledger": {"verify": 0.4, "heads": 0.15}}}
    assert recs["hf_generate"].ledger is None and recs["hf_generate"].projections == {}
    assert not ada.loaded and all(r.loaded for r in read_run(ledger_runs / "1_humaneval"))
    # a ledger that is no object of numbers is named, and the run skipped
    bad = json.loads((ledger_runs / "0_xsum" / "summary.json").read_text())
    bad["methods"]["adadecode"]["ledger"]["measured"]["verify"] = "slow"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "summary.json").write_text(json.dumps(bad))
    assert read_run(tmp_path / "bad") == []


def test_tables_show_predicted_speedups_beside_the_measured_and_projections_apart(ledger_runs, tmp_path):
    """The predicted speedup sits beside the measured one; the projections onto other machines'
    profiles are a table of their own (issue 53: a column per profile pushed a task's table off a
    1300 px screen), with the same rows and only those projected."""
    result = build_report([ledger_runs], tmp_path / "report", artefacts_dir=None, make_plots=False)
    table = result.tables["main"]
    assert table.group_cells[0][:3] == ["tps_speedup", "predicted_speedup", "tau"]
    assert table.group_cells[1][:3] == ["tps_speedup", "predicted_speedup", "tau"]
    assert not [c for cells in table.group_cells for c in cells if c.startswith("projected:")]
    projected = table.projections
    assert projected.groups == ["xsum"] and projected.group_cells == [["projected:gpu-h100"]]  # no projection on HumanEval
    assert projected.sources is table.sources
    assert [r.label for b in projected.blocks for r in b.rows] == ["Vanilla, greedy", "AdaDecode, greedy"]  # rows
    # without a projection (Draft & Verify, the HF peer) are left out
    md = (tmp_path / "report" / "tables" / "main.md").read_text()
    assert "| Method | XSum tok/s (speedup) | XSum Predicted speedup | XSum τ |" in md
    assert "| AdaDecode, greedy | 14.40 (0.72×) | 0.93× | 1.21 |" in md
    assert "| HF generate, greedy | 18.00 (0.90×) | – |" in md
    assert "projected on machine profiles" in md and "| Method | gpu-h100 | src |" in md
    assert "| AdaDecode, greedy | 1.80× | [1] |" in md
    page = (tmp_path / "report" / "index.html").read_text()
    assert "projected on machine profiles</h3>" in page
    # the loaded run's measured speedups are marked; its predicted ones are not measurements
    assert "| 14.40 (0.72×) (loaded) | 0.93× | 1.21 |" in md
    assert md.count("> **Warning:** Measured under load — m · HumanEval, greedy: vanilla's model passes took "
                    "1.61× their predicted time (threshold 1.25×)") == 1
    assert r"\textbf{Warning:} Measured under load" in (tmp_path / "report" / "tables" / "main.tex").read_text()


def test_where_the_time_goes_chart(ledger_runs, tmp_path):
    """One stacked bar per method with a ledger (not the HF peer), a thin hatched predicted bar where
    the ledger predicts, the 1.0 line of vanilla, the components' fixed colours and labels."""
    recs = [r for r in read_run(ledger_runs / "0_xsum")]
    fig, caption = ledger_figure(recs, "Where the time goes: XSum on m")
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["Vanilla", "Draft & Verify", "AdaDecode"]
    assert any(list(line.get_xdata()) == [1.0, 1.0] for line in ax.get_lines())  # the vanilla line
    bars = [p for p in ax.patches]
    measured = [p for p in bars if not p.get_hatch()]
    predicted = [p for p in bars if p.get_hatch()]
    # one measured bar per method (its nonzero components side by side on one row)
    assert len({round(p.get_y(), 3) for p in measured}) == 3 and len({round(p.get_y(), 3) for p in predicted}) == 2
    ada_row = [p for p in measured if abs(p.get_y() + p.get_height() / 2 - 1.9) < 1e-6]
    assert sum(p.get_width() for p in ada_row) == pytest.approx(1.68 / TAU)
    assert {p.get_facecolor()[:3] for p in ada_row} == {tuple(int(COLOUR[k][i:i + 2], 16) / 255 for i in (1, 3, 5))
                                                        for k in PER_STEP}
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["prefill", "plain steps", "drafting", "exit heads", "verification", "bookkeeping",
                      "predicted (thin, laptop-cpu)", "vanilla (1.0)"]
    assert "HF" not in " ".join(legend) and "left out" in caption
    import matplotlib.pyplot as plt

    plt.close(fig)

    result = build_report([ledger_runs], tmp_path / "report", artefacts_dir=None)
    names = {p.path.name for p in result.plots}
    assert {"ledger_main_m_xsum.png", "ledger_main_m_humaneval.png"} <= names
    assert all(p.path.exists() for p in result.plots)
    assert_plots_explained(result)
    index = result.index.read_text()
    assert index.index("<h2 id='time'>Where the time goes, per task</h2>") < index.index("<h2 id='plots'>")


def test_a_ledger_chart_of_many_methods_has_one_panel_per_decoder_family():
    """~25 methods: one panel per decoder family (the speedup chart's grouping), every method once."""
    labels = {"vanilla": None, "ngram": None, "ngram_long": "ngram", "early_exit": None, "early_exit_x": "early_exit",
              **{f"draft_verify{s}": "draft_verify" for s in ("", "_static", "_fixed_k", "_paper", "_a", "_b")},
              **{f"adadecode{s}": "adadecode" for s in ("", "_fixed", "_lmhead", "_mixed", "_full", "_x")},
              **{f"del{s}": "del" for s in ("", "_heads", "_paper", "_a")},
              **{f"ppd{s}": "ppd" for s in ("", "_ngram", "_a", "_b", "_c")}}
    recs = [Record(table="main", model="m", task="xsum", method=m, decoder=d, metrics={"speedup": 1.0, "tau": 1.5},
                   ledger=ledger({"verify": 0.5 + i / 50, "draft": 0.2}, {"verify": 0.5, "draft": 0.1}))
            for i, (m, d) in enumerate(labels.items())]
    recs.append(Record(table="main", model="m", task="xsum", method="hf_generate", metrics={"speedup": 0.9}))
    assert len(labels) >= 25 > PANEL_SERIES
    fig, caption = ledger_figure(recs, "Where the time goes")
    shown = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels()]
    # vanilla, D&V, AdaDecode, PPD, early exit, DEL, n-gram
    assert len(fig.axes) == 7 and len(shown) == len(labels) == len(set(shown))
    assert all(any(list(line.get_xdata()) == [1.0, 1.0] for line in ax.get_lines()) for ax in fig.axes)
    assert "one panel per decoder family" in caption
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_runs_measured_under_load_are_marked_everywhere(ledger_runs, tmp_path):
    result = build_report([ledger_runs], tmp_path / "report", artefacts_dir=None)
    index = result.index.read_text()
    warning = re.compile(r"<div class='warning' role='alert'>Measured under load — m · HumanEval, greedy: [^<]*</div>")
    assert len(warning.findall(index)) == 3  # at the top, above the table, in HumanEval's section
    section = index[index.index("<h3 id='time-main-m-humaneval'>"):]
    assert warning.match(section.split("\n")[1]) and "ledger_main_m_humaneval.png" in section
    xsum = index[index.index("<h3 id='time-main-m-xsum'>"):index.index("<h3 id='time-main-m-humaneval'>")]
    assert "warning" not in xsum
    by_task = {a.task: a for a in result.answers}
    assert by_task["humaneval"].loaded and LOADED in by_task["humaneval"].verdict
    assert not by_task["xsum"].loaded and LOADED not in by_task["xsum"].verdict
    line = next(h for h in result.headline if "AdaDecode" in h)
    assert f"HumanEval 0.72× {LOADED}," in line and line.endswith("XSum 0.72×")
    charts = {p.path.name: p for p in result.plots}
    assert "hatched bars, and the tasks marked (loaded), were measured under load" in charts["speedup_main_m.png"].caption.lower()
    assert f"{LOADED}" in charts["ledger_main_m_humaneval.png"].caption
    assert LOADED not in charts["ledger_main_m_xsum.png"].caption


def test_ledger_lines_for_the_demo(ledger_runs):
    recs = read_run(ledger_runs / "0_xsum") + read_run(ledger_runs / "1_humaneval")
    lines = ledger_lines(recs)
    assert lines[0] == "m · XSum, greedy:" and lines[4] == "m · HumanEval, greedy:"
    assert lines[1].startswith("  Vanilla 1.00× = τ 1.00 / 1.00 steps (plain steps 0.92, prefill 0.04, bookkeeping 0.04)")
    assert lines[3] == ("  AdaDecode 0.72× = τ 1.21 / 1.68 steps (verification 1.00, exit heads 0.31, drafting 0.25, "
                        "bookkeeping 0.12); predicted 0.93×")
    assert lines[7].startswith(f"  AdaDecode 0.72× {LOADED} = ") and len(lines) == 8  # no line for the HF peer

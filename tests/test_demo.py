"""The demo's pipeline, reduced (tiny-random, --small, one task): train, evaluate, report — and the
tables regenerate from the result files it wrote."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def demo_module(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import demo

    yield demo
    sys.modules.pop("demo", None)


def test_demo_small_pipeline_regenerates_tables(demo_module, tmp_path, monkeypatch, capsys):
    from selfspec.config import compose
    from selfspec.report import run_report

    out = tmp_path / "outputs"
    # the demo points every default artefact path at --out and logs to W&B offline; restore after
    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(out))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    assert demo_module.main(["--model", "tiny-random", "--small", "--out", str(out), "--tasks", "xsum",
                             "--logger", "wandb"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()

    for kind, name in (("heads", "tiny-random-mixed"), ("skip_set", "tiny-random"), ("prompts", "tiny-random"),
                       ("ppd_tree", "tiny-random")):
        assert (out / "artefacts" / kind / name / "meta.json").exists(), kind
    (run_dir,) = (out / "demo").iterdir()
    (eval_dir,) = (run_dir / "eval").iterdir()
    summary = json.loads((eval_dir / "summary.json").read_text())
    assert set(summary["methods"]) == {"vanilla", "adadecode", "draft_verify", "ppd", "hf_generate",
                                       "hf_prompt_lookup"}
    assert summary["config"]["report"]["table"] == "main"
    assert list(eval_dir.glob("wandb/offline-run-*")), "W&B offline run missing"

    # the last lines: where the report is, then the headline speedups
    report_dir = run_dir / "report"
    assert any(line.startswith(f"Report: {report_dir / 'index.html'}") for line in printed)
    head = printed.index("Headline speedups (vs vanilla, same examples):")
    assert all(line.startswith("  tiny-random · ") for line in printed[head + 1:]) and printed[head + 1:]
    table = (report_dir / "tables" / "main.md").read_text()
    vanilla = summary["methods"]["vanilla"]
    assert f"| Vanilla | {vanilla['tokens_per_s']:.2f} (1.00×) |" in table
    ada = summary["methods"]["adadecode"]
    assert f"| AdaDecode | {ada['tokens_per_s']:.2f} ({ada['speedup']:.2f}×) |" in table
    assert (report_dir / "plots" / "speedup_main_tiny-random.png").exists()
    runtime = json.loads((run_dir / "runtime" / "runtime.json").read_text())
    assert runtime["model"] == "tiny-random" and runtime["v"]["64"]["1"] == 1.0
    index = (report_dir / "index.html").read_text()
    assert "The runtime on this machine" in index and "transformers generate" in index

    # regenerate from the result files alone: the same tables
    shutil.rmtree(report_dir / "tables")
    cfg = compose([f"inputs=[{run_dir / 'eval'}]", f"output_dir={report_dir}", f"artefacts_dir={out / 'artefacts'}",
                   "wandb.enabled=false"], config_name="report")
    again = run_report(cfg)
    assert (report_dir / "tables" / "main.md").read_text() == table
    assert {p.path.name for p in again.plots} >= {"speedup_main_tiny-random.png", "tree_latency.png"}

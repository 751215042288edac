"""The demo's pipeline, reduced (tiny-random, --small): train, evaluate, report — and the tables
regenerate from the result files it wrote. The run is the session's ``demo_run`` (conftest.py)."""

from __future__ import annotations

import json

from selfspec.config import compose
from selfspec.report import run_report


def test_demo_small_pipeline_regenerates_tables(demo_run, tmp_path):
    out, run_dir, printed = demo_run.out, demo_run.run_dir, demo_run.printed
    for kind, name in (("heads", "tiny-random-mixed"), ("skip_set", "tiny-random"), ("prompts", "tiny-random"),
                       ("ppd_tree", "tiny-random")):
        assert (out / "artefacts" / kind / name / "meta.json").exists(), kind
    evals = sorted((run_dir / "eval").iterdir())
    assert [d.name for d in evals] == [f"{i}_{t}_tiny-random_adadecode" for i, t in
                                       enumerate(("xsum", "cnndm", "humaneval", "gsm8k", "mtbench"))] + [
        "5_xsum_tiny-random_adadecode_T0.2", "6_humaneval_tiny-random_adadecode_T0.6"]
    eval_dir = evals[0]
    summary = json.loads((eval_dir / "summary.json").read_text())
    # every method of the four papers (DEL on the demo's heads), n-gram drafts and the peers that run
    # on tiny-random (hf_early_exit needs more than 8 layers)
    assert set(summary["methods"]) == {"vanilla", "adadecode", "draft_verify", "ppd", "del_heads", "ngram",
                                       "hf_generate", "hf_prompt_lookup"}
    assert summary["config"]["report"]["table"] == "main"
    assert all(list(d.glob("wandb/offline-run-*")) for d in evals), "W&B offline run missing"

    # the last lines: where the report is, then the headline speedups
    report_dir = run_dir / "report"
    assert any(line.startswith(f"Report: {report_dir / 'index.html'}") for line in printed)
    head = printed.index("Headline speedups (vs vanilla, same examples):")
    assert all(line.startswith("  tiny-random · ") for line in printed[head + 1:]) and printed[head + 1:]
    # before them, per run and method with a cost ledger, its speedup in words (none without ledgers)
    from selfspec.reporting.records import collect, latest_only
    from selfspec.reporting.tables import LINES_HEADING, ledger_lines

    spent = ledger_lines(latest_only(collect([run_dir / "eval"])))
    if spent:
        at = printed.index(LINES_HEADING) + 1
        assert printed[at:at + len(spent)] == [f"  {line}" for line in spent]
    else:
        assert LINES_HEADING not in printed
    table = (report_dir / "tables" / "main.md").read_text()
    vanilla = summary["methods"]["vanilla"]
    assert f"| Vanilla, greedy | {vanilla['tokens_per_s']:.2f} (1.00×) |" in table
    ada = summary["methods"]["adadecode"]
    assert f"| AdaDecode, greedy | {ada['tokens_per_s']:.2f} ({ada['speedup']:.2f}×) |" in table
    # the sampling runs, at the paper's temperature and top-p: the lossless methods' rows say
    # "lossless (distribution)" and show no consistency figure; PPD's typical acceptance is lossy (†)
    sampled = json.loads((evals[6] / "summary.json").read_text())
    assert sampled["config"]["sampling"] | {"seed": 0} == {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "seed": 0}
    assert set(sampled["methods"]) == {"vanilla", "adadecode", "draft_verify", "ppd", "del_heads", "ngram"}
    for label, title in (("adadecode", "AdaDecode"), ("draft_verify", "Draft & Verify"), ("del_heads", "DEL (del_heads)"),
                         ("ngram", "N-gram lookup (beyond the papers)")):
        m = sampled["methods"][label]
        assert m["consistency"] is None and m["lossless"] is True
        assert f"| {title}, T=0.6 · lossless (distribution) | " in table
    assert sampled["methods"]["ppd"]["lossless"] is False and "| PPD, T=0.6 † |" in table
    assert "| PPD, T=0.6 † · lossless" not in table
    assert (report_dir / "plots" / "speedup_main_tiny-random.png").exists()
    # every step's wall time and the machine's load, printed at the end
    timings = next(line for line in printed if line.startswith("=== timings: "))
    for step in ("load model", "train heads", "train skips", "evaluate xsum", "evaluate humaneval T=0.6",
                 "runtime benchmark", "report"):
        assert f"{step} " in timings, step
    cpu = next(line for line in printed if line.startswith("=== CPU seconds (this process, all threads): "))
    assert "train heads " in cpu and "evaluate xsum T=0.2 " in cpu and "; total " in cpu
    assert any(line.startswith("=== load average (1, 5, 15 min; ") for line in printed)
    runtime = json.loads((run_dir / "runtime" / "runtime.json").read_text())
    assert runtime["model"] == "tiny-random" and runtime["v"]["64"]["1"] == 1.0
    index = (report_dir / "index.html").read_text()
    assert "The runtime on this machine" in index and "transformers generate" in index

    # regenerate from the result files alone: the same tables
    again_dir = tmp_path / "again"
    cfg = compose([f"inputs=[{run_dir / 'eval'}]", f"output_dir={again_dir}", f"artefacts_dir={out / 'artefacts'}",
                   "wandb.enabled=false"], config_name="report")
    again = run_report(cfg)
    assert (again_dir / "tables" / "main.md").read_text() == table
    assert {p.path.name for p in again.plots} >= {"speedup_main_tiny-random.png", "tree_latency.png"}


def test_answer_per_task_matches_the_demo_runs(demo_run):
    """The page's answer for each task and decoding: the fastest lossless method of that run, with
    its speedup, consistency (none under sampling) and quality metric as the runner wrote them."""
    from selfspec.reporting.answer import answers
    from selfspec.reporting.layouts import TASK_SCORE
    from selfspec.reporting.records import collect
    from selfspec.reporting.tables import method_title

    records = collect([demo_run.run_dir / "eval"])
    by_task = {(a.task, a.decoding): a for a in answers(records)}
    assert set(by_task) == {(t, "greedy") for t in ("xsum", "cnndm", "humaneval", "gsm8k", "mtbench")} | {
        ("xsum", "T=0.2"), ("humaneval", "T=0.6")}
    for run in (demo_run.run_dir / "eval").iterdir():
        summary = json.loads((run / "summary.json").read_text())
        methods = summary["methods"]
        label = max((m for m in methods if m != "vanilla" and methods[m]["lossless"] is not False),
                    key=lambda m: methods[m]["speedup"])
        temperature = summary["config"]["sampling"]["temperature"]
        got = by_task[(summary["task"], "greedy" if summary["greedy"] else f"T={temperature:g}")]
        record = next(r for r in records if r.provenance["source"] == str(run) and r.method == label)
        assert got.method == method_title(record) and got.source == str(run)
        assert got.speedup == methods[label]["speedup"]
        assert got.consistency == methods[label]["consistency"]
        assert (got.consistency is None) is (not summary["greedy"])
        assert got.tokens_per_s == methods[label]["tokens_per_s"]
        key = TASK_SCORE.get(summary["task"], (None,))[0]
        if key:
            assert got.score == methods[label]["metrics"][key]
            assert got.baseline_score == methods["vanilla"]["metrics"][key]
        else:
            assert got.score is None and got.score_name is None


def test_skip_search_is_the_cost_model_bo_and_loads_the_model_once(demo_run):
    """The demo's skip set comes from BO on the cost model (no timing per candidate), and the model
    is loaded once for every step."""
    meta = json.loads((demo_run.out / "artefacts" / "skip_set" / "tiny-random" / "meta.json").read_text())
    assert meta["metrics"]["search"] == "bo_model" and meta["metrics"]["objective_kind"] != "measured"
    assert sum("=== load model: " in line for line in demo_run.printed) == 1


def test_demo_sampling_settings_are_the_papers():
    """The demo's sampling runs use Draft & Verify's settings, as its presets hold them."""
    import sys
    from pathlib import Path

    from omegaconf import OmegaConf

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "scripts"))
    try:
        import demo
    finally:
        sys.path.remove(str(root / "scripts"))
        sys.modules.pop("demo", None)
    text = OmegaConf.load(root / "conf" / "experiment" / "dv_text.yaml").hydra.sweeper.params
    code = OmegaConf.load(root / "conf" / "experiment" / "dv_code.yaml").sampling
    t_text = max(float(t) for t in str(text["sampling.temperature"]).split(","))
    assert demo.SAMPLING["xsum"] == demo.SAMPLING["cnndm"] == (t_text, float(text["sampling.top_p"]))
    assert demo.SAMPLING["humaneval"] == (code.temperature, code.top_p)


def test_the_demo_runs_bfloat16_where_the_cpu_multiplies_it_on_its_units():
    """``--dtype auto``: bfloat16 where the CPU kernels' bfloat16 path is a dot-product one (AMX or
    AVX-512-BF16), else the model config's dtype, each with the reason printed; an explicit dtype
    is kept as given."""
    import sys
    from pathlib import Path

    from selfspec.models import kernels

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "scripts"))
    try:
        import demo
    finally:
        sys.path.remove(str(root / "scripts"))
    dtype, why = demo.choose_dtype("auto", "smollm2-135m")
    path = (kernels.paths() or {}).get("bfloat16")
    if path in ("amx", "avx512_bf16"):
        assert dtype == "bfloat16" and path in why and "--dtype float32" in why
    else:
        assert dtype == "float32" and "bfloat16 linears would widen" in why
    assert demo.choose_dtype("float32", "smollm2-135m") == ("float32", "as --dtype asked")
    assert demo.choose_dtype("bfloat16", "tiny-random")[0] == "bfloat16"

"""Reporting: records from run directories, paper layouts (Markdown, LaTeX), plots, index.html, W&B."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

from selfspec.config import compose
from selfspec.evaluation import evaluate
from selfspec.models.heads import IntermediateHeads, save_heads
from selfspec.reporting import build_report, collect, get_layout, read_run
from selfspec.reporting.answer import answers
from selfspec.reporting.artefact_figures import bo_traces, find_artefacts, tree_curves
from selfspec.reporting.layouts import LAYOUTS
from selfspec.reporting.paper import paper_records
from selfspec.reporting.plots import gamma_series
from selfspec.reporting.records import Record, latest_only
from selfspec.reporting.tables import build_table, tex_escape, to_latex, to_markdown
from selfspec.reporting.wandb_source import unflatten, wandb_records

RUN_INFO = {"git_commit": "abc1234", "versions": {"torch": "2.13.0", "transformers": "5.23.0", "selfspec": "0.1.0"},
            "hardware": {"cpu": "x86_64", "cpu_threads": 2, "gpu": None}, "device": "cpu"}


def entry(tps: float, speedup: float, tau: float = 1.0, ar=None, consistency=1.0, metrics=None, stats=None):
    return {"n_examples": 2, "new_tokens": 100, "seconds": 100 / tps, "tokens_per_s": tps,
            "seconds_per_token": 1 / tps, "speedup": speedup, "tau": tau, "acceptance_rate": ar,
            "lossless": True, "consistency": consistency, "prefix_agreement": consistency,
            "metrics": metrics or {}, "stats": stats or {}}


def write_run(path: Path, *, table: str | None, task: str, method: str, methods: dict, model="smollm2-135m",
              method_cfg: dict | None = None, temperature=0.0, artefacts=None, extra: dict | None = None) -> Path:
    """A summary-only run directory of run format 1 (no ``format`` field) with chosen figures (label =
    decoder name; no variants): for the tables' formatting. Label identity is tested on real runner
    output (``real_runs``). ``extra``: more top-level summary fields (``contention``, ``profile``,
    ``projections``, ``format``)."""
    path.mkdir(parents=True)
    cfg = {"model": {"name": model}, "task": {"name": task}, "method": {"name": method, **(method_cfg or {})},
           "baseline": "vanilla", "sampling": {"temperature": temperature}}
    if table:
        cfg["report"] = {"table": table}
    summary = {"model": model, "task": task, "method": method, "baseline": "vanilla", "methods": methods,
               "method_configs": {method: cfg["method"]}, "run_info": RUN_INFO, "artefacts": artefacts or {},
               "config": cfg, **(extra or {})}
    (path / "summary.json").write_text(json.dumps(summary))
    return path

class _Figures(HTMLParser):
    """Every ``<img>`` of a page with the caption of the ``<figure>`` holding it (None: no figure)."""

    def __init__(self):
        super().__init__()
        self.images: list[list] = []  # [src, caption]
        self._figure: list | None = None
        self._in_caption = False

    def handle_starttag(self, tag, attrs):
        if tag == "figure":
            self._figure = []
        elif tag == "img":
            self.images.append([dict(attrs)["src"], None])
            if self._figure is not None:
                self._figure.append(self.images[-1])
        elif tag == "figcaption":
            self._in_caption = True

    def handle_endtag(self, tag):
        if tag == "figure":
            self._figure = None
        elif tag == "figcaption":
            self._in_caption = False

    def handle_data(self, data):
        if self._in_caption and self._figure:
            for image in self._figure:
                image[1] = (image[1] or "") + data


#: an axis label names a quantity and its unit in parentheses: "forward latency (ms; —)"
UNIT = re.compile(r"\S.*\(.+\)")


def assert_plots_explained(result) -> None:
    """Every plot the report embeds sits in a <figure> with its caption, and labels its axes with units."""
    parser = _Figures()
    parser.feed(result.index.read_text())
    by_src = {p.path.relative_to(result.out_dir).as_posix(): p for p in result.plots}
    assert sorted(src for src, _ in parser.images) == sorted(by_src)
    for src, caption in parser.images:
        assert caption and caption.strip() == by_src[src].caption and len(caption) > 60, src
    for plot in result.plots:
        assert plot.labels[0][0], f"{plot.path.name}: no x label"
        for x, y in plot.labels:
            assert UNIT.match(y), f"{plot.path.name}: y label {y!r} names no unit"
            assert not x or x == "task" or UNIT.match(x), f"{plot.path.name}: x label {x!r} names no unit"


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "multirun"
    for i, (task, score) in enumerate((("xsum", {"rouge2": 0.11}), ("humaneval", {"pass@1": 0.25}),
                                        ("gsm8k", {"accuracy": 0.5}))):
        write_run(root / f"{i}_{task}", table="adadecode_main", task=task, method="adadecode",
                  methods={"vanilla": entry(20.0, 1.0, metrics=score),
                           "adadecode": entry(26.0, 1.3, tau=1.8, ar=0.9, metrics=score,
                                              stats={"exit_layer_7": 3.0, "exit_layer_15": 1.0}),
                           "hf_generate": entry(18.0, 0.9, metrics=score)})
    return root


#: a few tokens of one example (of the preset's task): real runner output in seconds
SMALL = ["model=tiny-random", "n_examples=1", "max_new_tokens=4", "warmup=0", "progress=false"]
SKIPS = ["method.skip_attn=[1]", "method.skip_mlp=[2]"]


def real_run(loaded, out: Path, experiment: str, label: str, *overrides: str) -> Path:
    """A run directory written by the evaluation runner, as ``experiment=<e> method=<label>`` runs."""
    evaluate(compose(SMALL + [f"experiment={experiment}", f"method={label}", *overrides]), out, loaded=loaded,
             label=label)
    return out


@pytest.fixture(scope="module")
def real_runs(tiny, tmp_path_factory):
    """Method variants as the presets sweep them: labels whose decoder is another config's."""
    root = tmp_path_factory.mktemp("real")
    heads = save_heads(root / "heads", IntermediateHeads.identity(tiny.model, [1, 2]), tiny, task="xsum")
    runs = root / "runs"
    for k in (2, 4):
        real_run(tiny, runs / f"k{k}", "dv_fixed_k", "draft_verify_fixed_k", f"method.max_draft={k}", *SKIPS)
    for g in (0.2, 0.6):
        real_run(tiny, runs / f"static_{g}", "dv_static", "draft_verify_static", f"method.draft_stop.threshold={g}", *SKIPS)
    real_run(tiny, runs / "adaptive", "dv_static", "draft_verify", *SKIPS)
    for label in ("adadecode", "adadecode_fixed"):
        real_run(tiny, runs / label, "adadecode_ablation", label, "task=xsum", f"method.heads_dir={heads}")
    return runs


def test_records_from_a_run_directory(runs):
    records = read_run(runs / "0_xsum")
    assert {r.method for r in records} == {"vanilla", "adadecode", "hf_generate"}
    ada = next(r for r in records if r.method == "adadecode")
    assert ada.table == "adadecode_main" and ada.task == "xsum" and ada.model == "smollm2-135m"
    assert ada.metrics["speedup"] == 1.3 and ada.metrics["rouge2"] == 0.11
    assert ada.metrics["ms_per_token"] == pytest.approx(1000 / 26)
    assert ada.provenance["commit"] == "abc1234" and "torch 2.13.0" in ada.provenance["versions"]
    assert ada.provenance["source"] == str(runs / "0_xsum")
    assert read_run(runs / "missing") == []


def test_run_formats_read_and_refused(real_runs, tmp_path, caplog):
    """docs/design/assets-and-formats.md §9: a run of format 2 (this selfspec's: summary.json's ``format``)
    and of format 1 (no ``format`` field; its Draft & Verify adaptive rule recorded with its
    threshold alone) read to the same records; a run older than format 1 (no ``method_configs``,
    ``method``, ``run_info`` or ``config``) or of a newer format is left out with one warning line,
    and ``project`` refuses it by name."""
    from selfspec.evaluation.runner import RUN_FORMAT
    from selfspec.project import _summary

    real = json.loads((real_runs / "adaptive" / "summary.json").read_text())
    assert real["format"] == RUN_FORMAT == 2 and read_run(real_runs / "adaptive")
    methods = {"vanilla": entry(20.0, 1.0), "draft_verify": entry(30.0, 1.5)}
    stop = {"draft_stop": {"rule": "adaptive", "threshold": 0.4}}
    one = write_run(tmp_path / "one", table="dv_static", task="xsum", method="draft_verify", methods=methods,
                    method_cfg=stop)
    two = write_run(tmp_path / "two", table="dv_static", task="xsum", method="draft_verify", methods=methods,
                    method_cfg=stop, extra={"format": 2})
    for path in (one, two):
        dv = next(r for r in read_run(path) if r.method == "draft_verify")
        assert dv.variant == "adaptive (γ0=0.4)" and dv.metrics["speedup"] == 1.5 and dv.decoder == "draft_verify"
    for field in ("method_configs", "method", "run_info", "config"):
        summary = json.loads((one / "summary.json").read_text())
        del summary[field]
        older = tmp_path / f"older_{field}"
        older.mkdir()
        (older / "summary.json").write_text(json.dumps(summary))
        caplog.clear()
        assert read_run(older) == []
        assert f"field '{field}' is missing: a run older than format 1" in caplog.text
        with pytest.raises(ValueError, match=f"field '{field}' is missing"):
            _summary(older)
    newer = write_run(tmp_path / "newer", table=None, task="xsum", method="draft_verify", methods=methods,
                      extra={"format": 3})
    caplog.clear()
    assert read_run(newer) == [] and "this selfspec reads run formats 1, 2" in caplog.text


def test_build_report_writes_tables_plots_and_index(runs, tmp_path):
    out = tmp_path / "report"
    result = build_report([runs], out, artefacts_dir=None)
    assert set(result.tables) == {"adadecode_main"}
    md = (out / "tables" / "adadecode_main.md").read_text()
    # the paper's layout: tokens/s with the speedup in parentheses, per task, with the source
    assert "| AdaDecode | 26.00 (1.30×) | 1.80 | 1.000 | 0.110 | 26.00 (1.30×) | 1.80 | 1.000 | 0.250 |" in md
    assert "abc1234" in md and "x86_64" in md and "transformers 5.23.0" in md
    # the paper's figures for other models: a reference block, never a like-for-like column
    assert "paper (Llama3.1-8B-Inst), reference only" in md and "38.09 (1.14×)" in md
    tex = (out / "tables" / "adadecode_main.tex").read_text()
    assert r"\begin{tabular}" in tex and r"\multicolumn{4}{c}{XSum}" in tex and r"26.00 (1.30$\times$)" in tex
    names = {p.path.name for p in result.plots}
    assert {"speedup_adadecode_main_smollm2-135m.png", "exit_layers.png"} <= names
    assert all(p.path.read_bytes()[:4] == b"\x89PNG" for p in result.plots)
    assert_plots_explained(result)
    index = result.index.read_text()
    assert "AdaDecode main results" in index and "plots/exit_layers.png" in index
    # the page leads with the answer, then the paper-layout tables, then the plots
    assert index.index("Fastest lossless method per task") < index.index("AdaDecode main results") < index.index(
        "<h2 id='plots'>")
    assert "| XSum | greedy | smollm2-135m | AdaDecode | 1.30× faster than vanilla | 26.00 (vanilla 20.00) | 1.000 | " \
           "ROUGE-2 0.110 (vanilla 0.110) | 2 |" in (out / "report.md").read_text()
    assert any(line.startswith("adadecode_main · smollm2-135m · AdaDecode: ") and "XSum 1.30×" in line
               for line in result.headline)


def test_method_variants_keep_their_label_and_variant(real_runs, tmp_path):
    """Records are keyed by the config label (``method=<label>``), as the runner keys its rows;
    the decoder name only says which family a label belongs to."""
    records = collect([real_runs])
    static = [r for r in records if r.method == "draft_verify_static"]
    assert sorted(r.variant for r in static) == ["γ=0.2", "γ=0.6"]
    assert {r.decoder for r in static} == {"draft_verify"} and {r.method_config["draft_stop"]["threshold"] for r in static} == {0.2, 0.6}
    out = tmp_path / "report"
    result = build_report([real_runs], out, artefacts_dir=None)
    assert set(result.tables) == {"dv_fixed_k", "dv_static", "adadecode_ablation"}
    table = {t: (out / "tables" / f"{t}.md").read_text() for t in result.tables}
    for row in ("Draft & Verify (draft_verify_static), γ=0.2", "Draft & Verify (draft_verify_static), γ=0.6",
                "Draft & Verify, adaptive (γ0=0.6)"):
        assert f"| {row} |" in table["dv_static"], row
    for k in (2, 4):
        assert f"| Draft & Verify (draft_verify_fixed_k), K={k} |" in table["dv_fixed_k"]
    # the paper's Table 3 row is the same label's, shown as reference (another model)
    assert "| Draft & Verify (draft_verify_fixed_k), K=2 | 0.924 | 1.37× |" in table["dv_fixed_k"]
    assert "| full |" in table["adadecode_ablation"] and "| fixed layer |" in table["adadecode_ablation"]
    assert any("Draft & Verify (draft_verify_static) [γ=0.2]" in line for line in result.headline)
    # the threshold plot: Draft & Verify's static points, by label
    series = gamma_series(result.records)
    assert [g for g, _, _ in series[("Draft & Verify (draft_verify_static)", "cnndm")]] == [0.2, 0.6]
    assert "gamma.png" in {p.path.name for p in result.plots}
    assert_plots_explained(result)


def test_paper_column_when_the_model_matches(tmp_path):
    root = tmp_path / "runs"
    write_run(root / "a", table="adadecode_main", task="humaneval", method="adadecode", model="llama3.1-8b-instruct",
              methods={"vanilla": entry(30.0, 1.0), "adadecode": entry(45.0, 1.5)})
    table = build_table(get_layout("adadecode_main"), read_run(root / "a"), paper_records("adadecode_main"))
    assert table.group_cells[0][-1] == "paper"
    measured = table.blocks[0]
    ada = next(r for r in measured.rows if r.label == "AdaDecode")
    assert ada.cells[-1] == "49.21 (1.51×)"  # Table 1, Llama3.1-8B-Inst, HumanEval
    assert not any("Llama3.1-8B-Inst" in b.title for b in table.blocks)  # matched, so no reference block


def test_paper_figures_are_consistent():
    from selfspec.config import group_options

    models = set(group_options("model"))
    for r in paper_records():
        assert r.table in LAYOUTS, r.table
        assert r.model is None or r.model in models, r.model
        assert r.provenance["source"]
    ppd = {(r.paper_model, r.method): r for r in paper_records("ppd_speedup")}
    assert ppd[("Vicuna-7B", "ppd")].metrics["speedup"] == pytest.approx(88.0 / 39.2)  # derived
    assert "derived" in ppd[("Vicuna-7B", "ppd")].provenance["source"]


def test_newest_run_wins_and_unknown_table_is_named(tiny, real_runs, runs, tmp_path):
    import os

    copy = real_run(tiny, tmp_path / "rerun", "dv_fixed_k", "draft_verify_fixed_k", "method.max_draft=2", *SKIPS)
    os.utime(copy / "summary.json", (4e9, 4e9))
    recs = latest_only(collect([real_runs, copy]))
    k2 = [r for r in recs if r.method == "draft_verify_fixed_k" and r.variant == "K=2"]
    assert len(k2) == 1 and k2[0].provenance["source"] == str(copy)
    assert len([r for r in recs if r.method == "draft_verify_fixed_k"]) == 2  # K=2 and K=4
    with pytest.raises(ValueError, match="unknown report.table 'nope'.*adadecode_main"):
        get_layout("nope")
    with pytest.raises(ValueError, match="unknown report.table"):
        build_report([runs], tmp_path / "r", tables=["nope"])


def test_every_run_left_out_is_named_and_the_answer_comes_from_a_run_the_page_lists(tmp_path, caplog):
    """Issue 68: of two runs of one setting the report kept the newer without a word, and with
    ``newest_only=false`` its table showed one run while the answer above it (1.35×) came from the
    other, which the page did not list. Now a run left out (an older run of the same setting, a
    summary that cannot be read) is named with why, in the log and on the page beside the inputs;
    ``newest_only=false`` gives each run of a setting its own row; the answer, the headline and the
    table agree."""
    import html
    import os

    root = tmp_path / "runs"
    for name, speedup, mtime in (("old", 1.35, 1e9), ("new", 1.19, 2e9)):
        run = write_run(root / name, table=None, task="xsum", method="ngram",
                        methods={"vanilla": entry(20.0, 1.0), "ngram": entry(20 * speedup, speedup)})
        os.utime(run / "summary.json", (mtime, mtime))
    (root / "broken").mkdir()
    (root / "broken" / "summary.json").write_text("{")
    old, broken = str(root / "old"), str(root / "broken" / "summary.json")

    with caplog.at_level("INFO"):
        newest = build_report([root], tmp_path / "newest", None, make_plots=False)
    page = newest.index.read_text()
    for path in (old, broken):
        assert path in caplog.text and html.escape(path) in page, path
    assert "newest_only=true" in caplog.text and "newest_only=true" in page
    assert [a.speedup for a in newest.answers] == [1.19]
    assert newest.headline == ["runs · smollm2-135m · N-gram lookup (beyond the papers): XSum 1.19×"]
    assert {r.provenance["source"] for r in newest.records} == {str(root / "new")}
    assert sorted(x.source for x in newest.left_out) == sorted([broken, old])

    every = build_report([root], tmp_path / "every", None, newest_only=False, make_plots=False)
    md = (every.out_dir / "tables" / "runs.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| N-gram lookup")]
    assert len(rows) == 2 and "(1.19×)" in rows[0] and "(1.35×)" in rows[1]  # newest first, each its src
    assert old in md and str(root / "new") in md
    assert [x.source for x in every.left_out] == [broken]  # every run of the setting is listed
    assert [a.speedup for a in every.answers] == [1.35]  # the fastest run the page lists
    assert every.headline == ["runs · smollm2-135m · N-gram lookup (beyond the papers): XSum 1.19× / 1.35× "
                              "(2 runs, newest first)"]


def test_latex_escaping_and_lossy_marker():
    assert tex_escape("D&V_1 50% ×") == r"D\&V\_1 50\% $\times$"
    rec = Record(table="ppd_speedup", model="m", task="mtbench", method="ppd", temperature=0.7,
                 metrics={"tokens_per_s": 10.0, "speedup": 2.0, "tau": 2.5, "lossless": False},
                 provenance={"source": "run"})
    table = build_table(get_layout("ppd_speedup"), [rec])
    assert table.blocks[0].rows[0].label == "PPD, T=0.7 †"
    assert "lossy" in to_markdown(table) and r"$^\dagger$" in to_latex(table)


def test_artefact_traces(tmp_path):
    bo = tmp_path / "skip_set" / "m"
    bo.mkdir(parents=True)
    (bo / "meta.json").write_text(json.dumps({"kind": "skip_set", "model": "m"}))
    rows = [{"header": {"key": "x"}}] + [{"iteration": i, "speedup": 1 + i / 10} for i in range(3)]
    (bo / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tree = tmp_path / "ppd_tree" / "m"
    tree.mkdir(parents=True)
    (tree / "meta.json").write_text(json.dumps({"kind": "ppd_tree", "model": "m", "curve": [
        {"size": 1, "tau": 1.0, "latency_s": 0.01}, {"size": 4, "tau": 1.6, "latency_s": 0.012}]}))
    (tmp_path / ".hidden.ckpt").mkdir()
    (tmp_path / ".hidden.ckpt" / "meta.json").write_text(json.dumps({"kind": "heads"}))
    found = find_artefacts(tmp_path)
    assert sorted(a.kind for a in found) == ["ppd_tree", "skip_set"]
    traces, objective = bo_traces(found)
    assert objective == "speedup" and len(traces["m"]) == 3
    assert tree_curves(found)["m"][1] == {"size": 4, "latency": 0.012, "accept_length": 1.6}
    heads = tmp_path / "heads" / "m-xsum"
    heads.mkdir(parents=True)
    (heads / "meta.json").write_text(json.dumps({"kind": "heads", "model": "m"}))
    (heads / "history.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1 / (s + 1)}) + "\n" for s in range(3)))
    result = build_report([tmp_path / "none"], tmp_path / "report", artefacts_dir=tmp_path)
    assert {p.path.name for p in result.plots} == {"bo_trace.png", "heads_training.png", "tree_latency.png"}
    assert_plots_explained(result)
    assert "No results found" in result.index.read_text()


def test_wandb_records_from_flattened_summaries():
    summary = {"methods/vanilla/speedup": 1.0, "methods/vanilla/tokens_per_s": 20.0,
               "methods/ppd/speedup": 1.7, "methods/ppd/tokens_per_s": 34.0, "run_info/git_commit": "abc", "_step": 3,
               "format": 2, "method": "ppd", "method_configs/ppd/name": "ppd"}
    assert unflatten({"a/b": 1, "a/c": 2, "d": 3}) == {"a": {"b": 1, "c": 2}, "d": 3}
    run = SimpleNamespace(summary=summary, id="r1", url="https://wandb.ai/x/selfspec/runs/r1",
                          created_at="2026-01-01T00:00:00Z",
                          config={"model": {"name": "m"}, "task": {"name": "mtbench"}, "method": {"name": "ppd"},
                                  "report": {"table": "ppd_speedup"}, "sampling": {"temperature": 0.0}})
    seen = {}

    one = SimpleNamespace(**{**vars(run), "id": "r0", "summary": {k: v for k, v in summary.items() if k != "format"}})
    older = SimpleNamespace(**{**vars(run), "id": "old", "summary": {k: v for k, v in summary.items()
                                                                     if not k.startswith("method_configs")}})

    class Api:  # runs of format 2 and 1 are read; an older one (no method_configs) is left out
        def runs(self, path, filters):
            seen.update(path=path, filters=filters)
            return [run, one, older]

    recs = wandb_records("selfspec", "me", {"jobType": "evaluate"}, api=Api())
    assert seen == {"path": "me/selfspec", "filters": {"jobType": "evaluate"}}
    assert len(recs) == 4 and {r.provenance["source"] for r in recs} == {run.url}
    ppd = next(r for r in recs if r.method == "ppd")
    assert ppd.origin == "wandb" and ppd.table == "ppd_speedup" and ppd.metrics["speedup"] == 1.7
    assert ppd.provenance["source"] == run.url and ppd.provenance["commit"] == "abc"


def test_report_entry_point_config(real_runs, runs, tmp_path):
    from selfspec.report import run_report

    cfg = compose([f"inputs=[{real_runs}]", f"output_dir={tmp_path / 'out'}", "artefacts_dir=null",
                   "tables=[dv_fixed_k]", "formats=[md]", "plots=false", "wandb.enabled=false"],
                  config_name="report")
    result = run_report(cfg)
    assert list(result.tables) == ["dv_fixed_k"] and not result.plots
    assert sorted(p.name for p in (tmp_path / "out" / "tables").iterdir()) == ["dv_fixed_k.md"]
    with pytest.raises(ValueError, match="wandb.enabled"):
        run_report(compose([f"inputs=[{runs}]", "wandb.enabled=maybe"], config_name="report"))


def test_dashboard_layout(tmp_path):
    from selfspec.reporting.dashboard import SECTIONS, to_markdown

    md = to_markdown()
    assert "methods/adadecode/speedup" in md and "task.name" in md
    assert all(s.panels for s in SECTIONS)
    sys_path = Path(__file__).resolve().parents[1] / "scripts"
    import runpy

    out = tmp_path / "dash.md"
    with pytest.raises(SystemExit) as exit_:
        import sys as _sys

        argv, _sys.argv = _sys.argv, ["wandb_dashboard.py", "--markdown", str(out)]
        try:
            runpy.run_path(str(sys_path / "wandb_dashboard.py"), run_name="__main__")
        finally:
            _sys.argv = argv
    assert exit_.value.code == 0 and out.read_text() == md


def test_answer_per_task_from_real_runner_output(real_runs):
    """The fastest lossless method per task is the one with the highest speedup among the runs'
    own summaries, with that run's consistency and quality metric next to vanilla's."""
    records = collect([real_runs])
    (cnndm,) = [a for a in answers(records) if a.task == "cnndm"]
    runs = {p.parent: json.loads(p.read_text()) for p in real_runs.rglob("summary.json")}
    tested = [(run, label, m) for run, s in runs.items() if s["task"] == "cnndm" for label, m in s["methods"].items()
              if label != "vanilla"]
    run, label, best = max(tested, key=lambda t: t[2]["speedup"])
    title = {"draft_verify": "Draft & Verify, adaptive"}.get(label, f"Draft & Verify ({label}), ")  # + variant
    assert cnndm.source == str(run) and cnndm.method.startswith(title)
    assert cnndm.speedup == best["speedup"] and cnndm.consistency == best["consistency"]
    assert cnndm.tokens_per_s == best["tokens_per_s"]
    assert cnndm.baseline_tokens_per_s == runs[run]["methods"]["vanilla"]["tokens_per_s"]
    assert cnndm.score_name == "ROUGE-2" and cnndm.score == best["metrics"]["rouge2"]
    assert cnndm.baseline_score == runs[run]["methods"]["vanilla"]["metrics"]["rouge2"]
    assert cnndm.compared == len({label for _, label, _ in tested})


def test_answer_leaves_out_lossy_runs_and_says_when_none_is_faster():
    def rec(method, speedup, lossless=True, source="run"):
        return Record(table="runs", model="m", task="gsm8k", method=method, provenance={"source": source},
                      metrics={"speedup": speedup, "tokens_per_s": 10 * speedup, "lossless": lossless,
                               "consistency": 1.0, "accuracy": 0.5})

    (a,) = answers([rec("vanilla", 1.0), rec("ppd", 3.0, lossless=False), rec("adadecode", 0.9)])
    assert a.method == "AdaDecode" and a.verdict == "none faster than vanilla (best 0.90×)"
    assert (a.score_name, a.score, a.baseline_score, a.baseline_tokens_per_s) == ("Acc.", 0.5, 0.5, 10.0)
    assert answers([rec("vanilla", 1.0), rec("ppd", 3.0, lossless=False)]) == []


def test_training_plots_label_axes_and_caption(tmp_path):
    """The skip search's Figure 4 and the PPD tree's curves: units on every axis, a caption drawn in."""
    from selfspec.training.ppd_tree import plot_curves
    from selfspec.training.skips import plot_trace

    rows = [{"iteration": i, "n_skipped": i + 1, "speedup": 0.8 + i / 10, "n_attn": i, "n_mlp": 1} for i in range(4)]
    plots = [plot_trace(rows, tmp_path / "skips.png", "m skip-set search"),
             plot_curves(tmp_path / "tree.png", [1, 2, 4], [1.0, 1.4, 1.6], [0.01, 0.012, 0.02], [1.0, 1.17, 0.8], 2)]
    for plot in plots:
        assert plot.path.read_bytes()[:4] == b"\x89PNG" and len(plot.caption) > 60
        assert all(UNIT.match(y) for _, y in plot.labels), plot.labels
        assert all(UNIT.match(x) for x, _ in plot.labels if x), plot.labels


@pytest.fixture(scope="module")
def sampling_runs(tiny, tmp_path_factory):
    """Real runner output for the main table, greedy and sampling (T=0.2, top-p 0.85: Draft & Verify's
    text setting): Draft & Verify with HF generate, and PPD (typical acceptance under sampling)."""
    import torch

    from selfspec.decoding.tree import SparseTree
    from selfspec.models.prompts import PromptTokens, save_prompts
    from selfspec.store.artefacts import save_artefact

    root = tmp_path_factory.mktemp("sampling")
    g = torch.Generator().manual_seed(0)
    save_prompts(root / "prompts", PromptTokens(torch.randn(2, 1, tiny.model.hidden_size, generator=g) * 0.5), tiny)
    trees = {0: SparseTree((), (2,)), 1: SparseTree(((0,), (1,)), (1, 2, 0)), 2: SparseTree(((0,), (0, 0)), (0, 1, 2))}
    save_artefact(root / "tree", "ppd_tree", {"tau": torch.ones(1)}, tiny,
                  extra={"trees": {str(k): t.to_dict() for k, t in trees.items()}}, kernel_paths=None)
    ppd = [f"method.prompts={root / 'prompts'}", f"method.tree={root / 'tree'}"]
    runs = root / "runs"
    for decoding, sampling in (("greedy", []), ("T0.2", ["sampling.temperature=0.2", "sampling.top_p=0.85"])):
        for label, extra in (("draft_verify", ["compare=[hf_generate]", *SKIPS]), ("ppd", ppd)):
            evaluate(compose(SMALL + ["task=xsum", "max_new_tokens=6", "+report.table=main", f"method={label}",
                                      *extra, *sampling]), runs / f"{decoding}_{label}", loaded=tiny, label=label)
    return runs


def test_sampling_rows_are_lossless_in_distribution(sampling_runs, tmp_path):
    """A sampling run's lossless methods get a row labelled "lossless (distribution)" with speedup, τ
    and acceptance but no consistency figure (n/a: token-level consistency does not apply); PPD's
    typical acceptance stays lossy (†); greedy rows keep their measured consistency."""
    summary = {d.name: json.loads((d / "summary.json").read_text()) for d in sampling_runs.iterdir()}
    dv, ppd = summary["T0.2_draft_verify"]["methods"], summary["T0.2_ppd"]["methods"]
    assert dv["draft_verify"]["lossless"] is True and ppd["ppd"]["lossless"] is False
    assert all(m["consistency"] is None and m["prefix_agreement"] is None for m in [*dv.values(), *ppd.values()])
    assert summary["greedy_draft_verify"]["methods"]["draft_verify"]["consistency"] == 1.0

    result = build_report([sampling_runs], tmp_path / "report", artefacts_dir=None)
    md = (tmp_path / "report" / "tables" / "main.md").read_text()

    def row(label: str, m: dict, consistency: str) -> str:
        ar = "–" if m["acceptance_rate"] is None else f"{m['acceptance_rate']:.3f}"
        predicted = "–" if m["predicted_speedup"] is None else f"{m['predicted_speedup']:.2f}×"
        return (f"| {label} | {m['tokens_per_s']:.2f} ({m['speedup']:.2f}×) | {predicted} | {m['tau']:.2f} | {ar} "
                f"| {consistency} "
                f"| {m['metrics']['rouge2']:.3f} |")

    assert row("Draft & Verify, T=0.2 · lossless (distribution)", dv["draft_verify"], "n/a") in md
    assert row("HF generate, T=0.2 · lossless (distribution)", dv["hf_generate"], "n/a") in md
    assert row("PPD, T=0.2 †", ppd["ppd"], "n/a") in md
    greedy = summary["greedy_draft_verify"]["methods"]["draft_verify"]
    assert row("Draft & Verify, greedy", greedy, "1.000") in md
    assert "| Vanilla, T=0.2 |" in md  # the reference itself is not labelled
    assert "lossless (distribution): a sampling row" in md and "† lossy" in md
    assert md.count("lossless (distribution)") == 3  # the two rows and the note: never PPD's or vanilla's
    plot = next(p for p in result.plots if p.path.name == "speedup_main_tiny-random.png")
    assert plot.path.exists()

    by_decoding = {a.decoding: a for a in result.answers}
    assert set(by_decoding) == {"greedy", "T=0.2"}
    sampled = by_decoding["T=0.2"]
    assert sampled.method in ("Draft & Verify", "HF generate") and sampled.consistency is None
    assert "| n/a (lossless in distribution) |" in (tmp_path / "report" / "report.md").read_text()
    assert by_decoding["greedy"].consistency == 1.0


def test_a_wide_legend_and_long_labels_are_not_clipped(tmp_path):
    """The demo's speedup chart has ~25 series: its legend, beside the bars, ran past the figure's
    edge and was cut off, as was a long axis label. The written image holds every legend, title and
    axis label whole: each one's extent, as drawn, lies inside the PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image
    import matplotlib.pyplot as plt

    from selfspec.store.figure import DPI, legend_columns, save_figure

    fig, ax = plt.subplots(figsize=(5.0, 3.6))
    for j in range(25):
        ax.bar([j], [1.0 + j / 10], label=f"a long method label number {j}, greedy")
    ax.set_ylabel("speedup over vanilla on the same examples (×), a long label")
    ax.set_xlabel("task")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), ncol=legend_columns(25))
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    drawn = fig.get_tightbbox(renderer)  # inches: what is drawn, legend included
    parts = [ax.get_legend(), ax.xaxis.label, ax.yaxis.label]
    extents = [p.get_window_extent(renderer) for p in parts]
    width, height = fig.get_size_inches()
    assert max(e.x1 for e in extents) > width * fig.dpi  # the legend leaves the figure: the old clipping
    plot = save_figure(fig, tmp_path / "wide.png", "a caption")
    rows, cols = matplotlib.image.imread(plot.path).shape[:2]
    assert cols >= round(drawn.width * DPI) and rows >= round(drawn.height * DPI)  # everything drawn is in
    assert cols > width * DPI and plot.aspect == pytest.approx(cols / rows)


def test_a_wide_table_is_shown_one_task_at_a_time():
    """The demo's all-methods table had ~40 columns and scrolled sideways: past
    ``html.MAX_COLUMNS`` cell columns the page shows one table per task, each with every row
    label and only that task's cells; a narrow table stays whole."""
    from selfspec.reporting.html import MAX_COLUMNS, table_html
    from selfspec.reporting.tables import Block, Row, Table

    kinds = ["speed", "tau", "acceptance", "consistency", "quality"]
    tasks = ["xsum", "cnndm", "humaneval", "gsm8k", "mtbench"]
    cells = lambda n: [f"c{i}" for i in range(n)]  # noqa: E731
    wide = Table(layout=get_layout("runs"), groups=tasks, group_cells=[kinds] * 5,
                 blocks=[Block("greedy", [Row("Vanilla", cells(25)), Row("AdaDecode", cells(25))])])
    page = table_html(wide)
    assert 25 > MAX_COLUMNS and page.count("<table>") == 5
    assert [t for t in ("XSum", "CNN/DM", "HumanEval", "GSM8K", "MT-Bench") if f"<h3>{t}</h3>" in page] == \
        ["XSum", "CNN/DM", "HumanEval", "GSM8K", "MT-Bench"]
    first = page.split("<table>")[1]
    assert first.count("<td>Vanilla</td>") == 1 and "<td>c4</td>" in first and "<td>c5</td>" not in first
    assert max(t.count("<th>") for t in page.split("<table>")[1:]) == 1 + len(kinds) + 1  # label, cells, src
    narrow = Table(layout=get_layout("runs"), groups=tasks[:2], group_cells=[kinds] * 2,
                   blocks=[Block("greedy", [Row("Vanilla", cells(10))])])
    assert table_html(narrow).count("<table>") == 1 and "<h3>" not in table_html(narrow)


def test_a_speedup_chart_of_many_methods_has_one_panel_per_decoder_family(tmp_path):
    """~25 series in one chart made one unreadable legend: past ``PANEL_SERIES`` methods the chart has
    one panel per decoder family (a method's variants together; vanilla and the peers together),
    each with its units and legend; a few methods stay one panel."""
    from selfspec.reporting.plots import PANEL_SERIES, speedup_plot

    labels = {"vanilla": None, "hf_generate": None, "hf_prompt_lookup": None, "ngram": None,
              **{f"draft_verify{s}": "draft_verify" for s in ("", "_static", "_fixed_k", "_paper")},
              **{f"adadecode{s}": "adadecode" for s in ("", "_fixed", "_lmhead", "_mixed", "_full")},
              **{f"del{s}": "del" for s in ("", "_heads", "_paper")}}
    recs = [Record(table="runs", model="m", task=t, method=m, decoder=d, metrics={"speedup": 1.0 + i / 20})
            for t in ("xsum", "gsm8k") for i, (m, d) in enumerate(labels.items())]
    plot = speedup_plot(recs, tmp_path / "many.png", "speedup, m")
    assert len(labels) > PANEL_SERIES and len(plot.labels) == 5  # peers, ngram, Draft & Verify, AdaDecode, DEL
    assert all(y == "speedup vs vanilla (×)" and x == "task" for x, y in plot.labels)
    assert "one panel per decoder family" in plot.caption
    few = speedup_plot([r for r in recs if r.decoder is None][:8], tmp_path / "few.png", "speedup, m")
    assert len(few.labels) == 1 and "panel" not in few.caption


def test_a_sweep_over_batch_size_keeps_a_row_per_size_and_plots_speedup_against_it(tmp_path):
    """Issue 54: ``batch_size=1,4,16`` runs of one method are three settings, not re-runs of one: each
    keeps its row (labelled with its size, against the vanilla of its own run), the answer is given per
    batch size, and one chart plots each method's speedup against the batch size, measured and as
    projected onto a profile."""
    root = tmp_path / "multirun"
    for b, (dv, sw) in {1: (1.2, 1.1), 4: (1.0, 1.15), 16: (0.8, 0.9)}.items():
        proj = {"h100": {"draft_verify": {"predicted_speedup": 1.5 - 0.02 * b}}}
        write_run(root / f"b{b}", table=None, task="xsum", method="draft_verify",
                  methods={"vanilla": entry(20.0, 1.0), "draft_verify": entry(20 * dv, dv),
                           "swift": entry(20 * sw, sw)},
                  extra={"projections": proj})
        summary = json.loads((root / f"b{b}" / "summary.json").read_text())
        summary["config"]["batch_size"] = b
        (root / f"b{b}" / "summary.json").write_text(json.dumps(summary))
    records = latest_only(collect([root]))
    assert sorted(r.batch_size for r in records if r.method == "draft_verify") == [1, 4, 16]
    result = build_report([root], tmp_path / "report", None)
    md = result.out_dir.joinpath("report.md").read_text()
    assert re.search(r"\| Draft & Verify[^|]*, batch 4[^|]*\|", md) and re.search(r"\| Draft & Verify[^|,]*\|", md)
    decodings = {(a.decoding, a.method.split(",")[0]) for a in result.answers}
    assert {d for d, _ in decodings} == {"greedy", "greedy, batch 4", "greedy, batch 16"}
    assert ("greedy, batch 4", "SWIFT") in decodings and ("greedy", "Draft & Verify") in decodings
    (plot,) = [p for p in result.plots if p.path.name.startswith("batch_")]
    assert plot.path.exists() and "batch size" in plot.caption
    assert_plots_explained(result)


def test_a_summary_with_a_batch_size_that_is_not_a_positive_integer_is_skipped(tmp_path, caplog):
    run = write_run(tmp_path / "r", table=None, task="xsum", method="ngram",
                    methods={"vanilla": entry(20.0, 1.0), "ngram": entry(30.0, 1.5)})
    summary = json.loads((run / "summary.json").read_text())
    summary["config"]["batch_size"] = 0
    (run / "summary.json").write_text(json.dumps(summary))
    with caplog.at_level("WARNING"):
        assert read_run(run) == []
    assert "field 'config.batch_size' is 0, not a positive integer" in caplog.text


def test_reading_and_naming_import_no_model_code():
    """Found 2026-12-02: every ``make tables``, ``make project``, the W&B dashboard script and an
    entry point's refusal of bad input paid ~5 s of importing transformers' models before doing
    anything (the families imported them to name their rotary and attention functions). Now they
    are imported when a model's adapter is built: a fresh interpreter that imports the report, the
    entry points and names every method imports no transformers model module."""
    import subprocess
    import sys

    code = ("import sys, selfspec.reporting, selfspec.report, selfspec.project, selfspec.evaluate, selfspec.train\n"
            "from selfspec.decoding import METHODS, method_title\n"
            "[method_title(m) for m in METHODS]\n"
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout

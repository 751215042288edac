"""scripts/gpu_check.py --dry-run: the GPU check's code on tiny-random on the CPU writes one JSON whose
figures are measured, not placeholders."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from selfspec.decoding import METHODS as REGISTERED
from selfspec.train import JOBS

ROOT = Path(__file__).resolve().parents[1]

#: the methods section's: every method of the registry that runs selfspec's own loop
METHODS = [name for name in REGISTERED if REGISTERED[name].own_loop and name != "vanilla"]


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_gpu_check_dry_run_writes_measured_figures(tmp_path):
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and positive(report["seconds"])
    assert report["settings"]["captures"] == ["static", "off"]
    assert report["run_info"]["git_commit"] and report["run_info"]["versions"]["torch"]
    assert "cpu_threads" in report["run_info"]["hardware"] and len(report["load_average"]) == 2
    tiny = report["models"]["tiny-random"]
    assert tiny["model"]["dtype"] == "bfloat16" and tiny["model"]["capture"] == "static"
    assert tiny["model"]["params"] == 6_439_488
    runtime = tiny["runtime"]
    assert positive(runtime["vanilla_tokens_per_s"]) and positive(runtime["prefill_tokens_per_s"])
    assert all(positive(v) for row in runtime["v"].values() for v in row.values())
    profile = tiny["profile"]
    assert profile["attention"] and profile["mlp"] and profile["head"] and positive(profile["seconds_to_measure"])
    assert Path(tiny["profile_path"]).is_file()
    for job in JOBS:
        t = tiny["training"][job]
        assert positive(t["peak_bytes"]) and positive(t["estimate_bytes"]) and positive(t["seconds"]), job
        assert t["estimate_error"] == pytest.approx(t["estimate_bytes"] / t["peak_bytes"] - 1)
        assert t["estimate_parts"]["weights"] == 6_439_488 * 2  # bf16
        assert (Path(t["artefact"]) / "meta.json").is_file(), job
        assert positive(t["resident_bytes"]), job
    assert positive(tiny["training"]["heads"]["seconds_per_step"]) and tiny["training"]["heads"]["steps"] == 2
    for method in (*METHODS, "vanilla"):
        rows = tiny["methods"][method]
        for capture in ("static", "off"):
            assert positive(rows[capture]["s_per_token"]), (method, capture)
        assert positive(rows["eager_over_captured"])
    for method in METHODS:  # greedy, lossless on the CPU in bf16 (the row-wise kernels): vanilla's tokens
        if REGISTERED[method].lossless:
            assert tiny["methods"][method]["static"]["consistency"] == 1.0, method
    passes = tiny["passes"]  # the static mode's runner took trees, kept states and partial layers, missed none
    assert set(passes) == {"static"} and passes["static"]["missed"] == 0
    assert {"chain", "tree", "chain/partial", "chain+keep/partial"} <= set(passes["static"]["kinds"])
    # in order of value: the profile and the ledger (priced with it), then every method built without
    # training, captured (static here) and eager, the ledger at a second shape, then the rest
    assert list(tiny["sections"]) == ["profile", "ledger", "capture", "ledger_long", "runtime", "training", "methods"]
    assert tiny["errors"] == {}
    for key, shape in (("ledger", (64, 12)), ("ledger_long", (24, 24))):
        ledger = tiny[key]  # every method's measured seconds beside the profile's prediction from its trace
        assert ledger["profile"] == profile["name"] and not ledger["skipped"]
        assert (ledger["prompt_tokens"], ledger["new_tokens"]) == shape
        assert set(ledger["methods"]) == {"vanilla", "draft_verify", "adadecode", "del", "early_exit", "ngram",
                                          "ppd_24_nodes", "swift", "clasp", "knapspec"}
        for name, r in ledger["methods"].items():
            assert positive(r["measured_over_predicted"]) and r["unpriced_passes"] == 0, name
            assert r["predicted"] == pytest.approx(sum(r["predicted_ledger"].values())), name
            assert r["captured_while_timed"] == 0, name  # each run timed apart from the passes it built
    assert profile["spans"] and set(profile["spans"]) == {"0", "32", "256"}  # static passes: their slots priced
    # the dry run composed the real check's models too: the 8B shape, SmolLM2's random shape, Gemma 3's
    assert report["composed"] == {k: "ok" for k in ("tiny-random", "tiny-gemma3", "llama3-8b-random", "smollm2-135m",
                                                     "smollm2-135m-random", "gemma3-270m-random",
                                                     "qwen2.5-coder-1.5b-random")}
    # the H100 estimate of the real check, printed first: the default budget reaches both ledgers
    first = [(r["section"], r["model"]) for r in report["estimate"] if r["within_budget"]]
    assert first[:4] == [("profile", "llama3-8b-random"), ("ledger", "llama3-8b-random"),
                         ("profile", "smollm2-135m"), ("ledger", "smollm2-135m")]
    assert "estimate on an H100 (budget: 300 s)" in proc.stdout
    assert report["models"]["tiny-random"]["key"] == "tiny-random"
    # a shape profiled for projections only (on a GPU: Gemma 3 270M's), after every section of the others
    gemma = report["models"]["tiny-gemma3"]
    assert list(gemma["sections"]) == ["profile"] and gemma["model"]["name"] == "tiny-gemma3"
    assert gemma["profile"]["model"]["shape"]["model_type"] == "gemma3_text" and Path(gemma["profile_path"]).is_file()
    assert all(positive(v) for v in tiny["sections"].values()) and report["budget_seconds"] is None
    capture = tiny["capture"]
    assert capture["mode"] == "static" and not capture["skipped"] and "left_out" not in capture
    assert set(capture["methods"]) == {"vanilla", "draft_verify", "adadecode", "del", "early_exit", "ngram",
                                       "ppd_24_nodes", "swift", "clasp", "knapspec"}
    for name, r in capture["methods"].items():
        assert r["same_tokens_captured_and_eager"] and r["same_sampled_tokens_captured_and_eager"], name
        assert r["consistency"] == {"captured": 1.0, "eager": 1.0}, name
        assert r["passes"]["missed"] == 0 and r["passes"]["routed"] > 0, name
        assert 0 <= r["passes"]["built_while_timed"] <= r["passes"]["built"], name
        assert r["passes"]["evicted"] == 0, name
        assert positive(r["s_per_token"]["captured"]) and positive(r["s_per_token"]["eager"]), name
    # a fixed skip set's passes were built by the ledger, which ran first on the same pooled cache and
    # shapes: the capture section replays them; a search builds those of each skip set it chooses
    # (their capture is in the captured time on a GPU)
    assert capture["methods"]["draft_verify"]["passes"]["built_while_timed"] == 0
    assert capture["methods"]["ppd_24_nodes"]["tree_pass_rows"]["max"] > 64  # the paper's tree sizes


def test_gpu_check_starts_no_section_past_its_budget(tmp_path, monkeypatch):
    """A check whose budget is spent names every section it left out, and writes what it has."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path / "outputs"))  # main sets it: restored afterwards
    import gpu_check

    out = tmp_path / "check.json"
    assert gpu_check.main(["--dry-run", "--budget", "0.001", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["budget_seconds"] == 0.001
    assert report["models"]["tiny-random"]["sections"] == {s: "not run: the budget was spent"
                                                           for s in gpu_check.SECTIONS}
    assert report["models"]["tiny-gemma3"]["sections"] == {"profile": "not run: the budget was spent"}
    for bad in ("0", "-5", "nan", "inf"):
        with pytest.raises(SystemExit, match="--budget must be a positive number of seconds"):
            gpu_check.main(["--dry-run", "--budget", bad, "--out", str(out)])


def test_gpu_check_refuses_an_out_it_cannot_write_before_running(tmp_path, monkeypatch):
    """Issue 52: a read-only --out gave a raw traceback, and an existing directory crashed after the
    first section had run. Both are refused first, naming --out."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path / "outputs"))
    import gpu_check

    ran = []
    monkeypatch.setattr(gpu_check, "run_section", lambda *a: ran.append(a))
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(SystemExit, match="--out .*dir.json: is a directory"):
        gpu_check.main(["--dry-run", "--out", str(tmp_path / "dir.json")])
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("this user writes into read-only directories (root without CAP_DAC_OVERRIDE dropped)")
        with pytest.raises(SystemExit, match="--out"):
            gpu_check.main(["--dry-run", "--out", str(locked / "check.json")])
    finally:
        locked.chmod(0o700)
    with pytest.raises(SystemExit, match="ending in .json"):
        gpu_check.main(["--dry-run", "--out", str(tmp_path / "check.txt")])
    assert not ran


def test_gpu_check_refuses_the_out_of_an_earlier_check(tmp_path, monkeypatch):
    """A second check into the first one's --out trained its artefacts again, and every evaluation of
    the methods section then refused to resume the first check's runs (ResumeMismatch: decoded with
    the artefacts just replaced), while the first JSON was overwritten (seen rerunning the dry run).
    docs/gpu.md names its --out, and issue 50 asks for a second run where a machine's time allows one."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path / "outputs"))
    import gpu_check

    ran = []
    monkeypatch.setattr(gpu_check, "run_section", lambda *a: ran.append(a))
    (tmp_path / "done.json").write_text("{}")
    with pytest.raises(SystemExit, match="an earlier check wrote it; give a new path .*done-2.json"):
        gpu_check.main(["--dry-run", "--out", str(tmp_path / "done.json")])
    assert (tmp_path / "done.json").read_text() == "{}"
    (tmp_path / "cut" / "evaluate").mkdir(parents=True)  # a check stopped before its first JSON
    with pytest.raises(SystemExit, match="an earlier check wrote .*cut; give a new path"):
        gpu_check.main(["--dry-run", "--out", str(tmp_path / "cut.json")])
    assert not ran and not (tmp_path / "cut.json").exists()


def test_a_failing_method_or_section_is_recorded_and_the_check_goes_on(tmp_path, monkeypatch):
    """One exception (an out-of-memory on a GPU) ended the whole check, and a section's figures were
    saved only at its end. Now the method's or section's traceback goes into the JSON, written after
    every method, and the next method and section run."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path / "outputs"))
    import gpu_check

    real = gpu_check.capture_decoders

    def broken(model, p, profile=None):
        makers = real(model, p, profile)

        def oom(m):
            raise MemoryError("CUDA out of memory (simulated)")
        return {"vanilla": makers["vanilla"], "early_exit": oom, "ngram": makers["ngram"]}

    def runtime_fails(loaded, p):
        raise RuntimeError("the runtime benchmark broke (simulated)")

    saved = []
    monkeypatch.setattr(gpu_check, "capture_decoders", broken)
    monkeypatch.setattr(gpu_check, "runtime_section", runtime_fails)
    out = tmp_path / "check.json"
    from selfspec.store import files

    real_write = files.write_json  # the check saves its JSON through it (atomic, figures finite)
    monkeypatch.setattr(files, "write_json", lambda path, obj: saved.append(1) or real_write(path, obj))
    assert gpu_check.main(["--dry-run", "--sections", "profile,ledger,runtime", "--out", str(out)]) == 0
    tiny = json.loads(out.read_text())["models"]["tiny-random"]
    failed = tiny["ledger"]["methods"]["early_exit"]
    assert failed["error"] == "MemoryError: CUDA out of memory (simulated)" and "Traceback" in failed["traceback"]
    assert {"vanilla", "ngram"} <= set(tiny["ledger"]["methods"]) and positive(tiny["sections"]["ledger"])
    assert tiny["errors"]["runtime"]["error"].startswith("RuntimeError: the runtime benchmark broke")
    assert tiny["sections"]["runtime"] == "failed (errors.runtime)"
    assert len(saved) >= 3 + 3  # after every method of the ledger, every section, the estimate


def test_gpu_check_without_a_tokenizer_leaves_out_the_text_sections(tmp_path, monkeypatch):
    """A GPU machine without SmolLM2's GGUF file: the random models whose tokenizer it lends run on
    their own vocabularies, and the sections that decode task text say why they did not run."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path / "outputs"))
    import gpu_check

    dry = gpu_check.plan(True)
    dry["models"] = {"tiny-random": [*dry["models"]["tiny-random"], "+model.tokenizer=smollm2-135m"]}
    monkeypatch.setattr(gpu_check, "plan", lambda dry_run: dry)
    monkeypatch.setattr(gpu_check, "model_present",
                        lambda name: "AssetMissingError: not fetched" if name == "smollm2-135m" else None)
    loaded = []
    monkeypatch.setattr(gpu_check, "run_section", lambda section, result, model, *a: loaded.append(
        (section, result["model"]["overrides"])) or model)
    monkeypatch.setattr(gpu_check, "load_entry", lambda name, overrides, p: ({"model": {"overrides": overrides}}, "m"))
    out = tmp_path / "check.json"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    sections = json.loads(out.read_text())["models"]["tiny-random"]["sections"]
    why = ("not run: no tokenizer (+model.tokenizer=smollm2-135m cannot load: AssetMissingError: not fetched)")
    assert {s: sections[s] for s in gpu_check.TEXT_SECTIONS} == {s: why for s in gpu_check.TEXT_SECTIONS}
    # then the shape profiled for projections only (tiny-gemma3 here), which decodes no text
    assert [s for s, _ in loaded] == [s for s in gpu_check.SECTIONS if s not in gpu_check.TEXT_SECTIONS] + ["profile"]
    assert all("+model.tokenizer=smollm2-135m" not in o for _, o in loaded)

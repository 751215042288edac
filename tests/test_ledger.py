"""The cost ledger (models/ledger.py), machine profiles (models/profile.py), the predicted speedup
in summary.json and projections onto another machine's profile (selfspec.project)."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from conftest import THIN_PLAN
from test_trace import _decoder

from selfspec.config import compose
from selfspec.decoding import Sampling
from selfspec.evaluation import RESULTS, SUMMARY, evaluate, summarize
from selfspec.evaluation.aggregate import contention
from selfspec.evaluation.profiling import measure_profile
from selfspec.measure.profile import FORMAT, Profile, ProfileMismatch, model_shape
from selfspec.models.ledger import COMPONENTS, HeadOp, LayerOp, LinearOp, WarpOp, as_op
from selfspec.project import project_run
from selfspec.tracking import ResultsFile

METHODS = ["vanilla", "draft_verify", "early_exit", "early_exit_draft", "del", "ngram", "adadecode", "ppd"]
SHAPE = {"model_type": "llama", "num_layers": 4, "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 1000, "dtype": "float32"}


def synthetic_profile(**changes) -> Profile:
    """A profile whose every op's price is known by hand (milliseconds): attention by rows at
    contexts 0 and 100, MLP and the head by rows, the head at two vocabulary sizes."""
    data = {
        "format": FORMAT, "name": "synthetic",
        "model": {"name": "tiny", "shape": dict(SHAPE), "linear_kernel": "skinny", "capture": "off"},
        "machine": {"device": "cpu", "hardware": "Synthetic CPU", "threads": 2, "versions": {}},
        "attention": {"0": {"1": 1e-3, "2": 2e-3, "4": 4e-3}, "100": {"1": 2e-3, "2": 3e-3, "4": 5e-3}},
        "mlp": {"1": 2e-3, "2": 3e-3, "4": 5e-3},
        "head": {"1000": {"1": 4e-3, "4": 10e-3}, "250": {"1": 1e-3, "4": 2.5e-3}},
        "linear": {"1": 0.5e-3, "4": 1e-3},
        "warp": {"1": {"1000": {"1": 1e-3, "4": 3e-3}, "250": {"1": 0.25e-3}}, "0": {"1000": {"1": 0.1e-3}}},
        "tree": {}, "pass": {}, "host": 0.25e-3,
    }
    data.update(changes)
    return Profile(data)


@pytest.mark.parametrize("change,message", [
    ({"format": FORMAT - 1}, rf"format {FORMAT - 1}, this selfspec reads format {FORMAT}"),  # docs/design/assets-and-formats.md §9
    ({"mlp": None}, r"mlp is missing or empty"),
    ({"mlp": {"1": float("nan"), "2": 3e-3}}, r"mlp\[1\] is nan, not a finite number of seconds >= 0"),
    ({"linear": {"1": -1e-3}}, r"linear\[1\] is -0\.001, not a finite"),
    ({"head": {"1000": {"1": "fast"}}}, r"head\[1000\]\[1\] is 'fast'"),
    ({"attention": {"x": {"1": 1e-3}}}, r"attention has the key 'x', not a number"),
    ({"host": float("inf")}, r"host is inf"),
    ({"model": {"name": "tiny"}}, r"it does not name the model shape it was measured for"),
    ({"machine": None}, r"it lacks its name, model or machine"),
    ({"attention": {"0": {"1": 0.0}}, "mlp": {"1": 0.0}, "head": {"1000": {"1": 0.0}}, "linear": {"1": 0.0},
      "host": 0.0}, r"it prices a plain step at 0\.0 s"),
])
def test_a_malformed_profile_is_refused_by_name_when_read(tmp_path, change, message):
    """Issue 39's probe: profiles were trusted blindly: a missing table or a wrong type gave a raw
    KeyError / AttributeError / IndexError naming no file, NaN or negative costs were accepted and
    their predictions recorded, an all-zero profile crashed a run midway (ZeroDivisionError in the
    n-gram lookup's priced schedule). Now reading one refuses it, naming the file and the entry."""
    data = synthetic_profile().data | change
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"profile {path}: {message}.*measure it again"):
        Profile.load(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=f"profile {path}: format 'list'"):
        Profile.load(path)


def test_synthetic_trace_gives_the_exact_prediction():
    p = synthetic_profile()
    trace = [
        {"source": "prefill", "ops": [["prefill", "L", 4, 4, 4, 0], ["prefill", "H", 1, 1000]]},
        {"source": "self", "ops": [["draft", "L", 1, 2, 1, 50], ["heads", "X", 1, 64, 64],
                                   ["heads", "H", 1, 250], ["verify", "L", 2, 4, 4, 100],
                                   ["verify", "H", 2, 1000]]},
        {"source": "plain", "gated": True, "ops": [["plain", "L", 1, 4, 4, 200], ["plain", "H", 1, 1000]]},
    ]
    got = p.predict(trace)
    ms = 1e-3
    expected = {
        "prefill": 4 * 4 * ms + 4 * 5 * ms + 4 * ms + 0.25 * ms,  # the step's overhead follows its last pass
        "draft": 2 * 1.5 * ms + 1 * 2 * ms,                       # attention at context 50: halfway
        "heads": 0.5 * ms + 1 * ms,
        "verify": 4 * 3 * ms + 4 * 3 * ms + 6 * ms + 0.25 * ms,   # head at 2 rows: between 1 and 4 rows
        "plain": 4 * (2 * ms + 1 * ms) + 4 * 2 * ms + 4 * ms + 0.25 * ms,  # context 200: the 0 -> 100 slope on
        "host": 0.0,
        "tree": 0.0,
    }
    assert got.keys() == set(COMPONENTS)
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=1e-12), k
    # a sampling run's steps carry their warps: one row at the full vocabulary and top-p (1 ms),
    # two rows (between 1 and 4 rows: 5/3 ms), the draft head's truncated vocabulary (0.25 ms)
    # and one row without top-p (0.1 ms); a sampled trace without them is refused
    warps = [["prefill", "W", 1, 1000, 1], ["heads", "W", 1, 250, 1], ["verify", "W", 2, 1000, 1],
             ["plain", "W", 1, 1000, 0]]
    sampled_trace = copy.deepcopy(trace)
    for step, w in zip(sampled_trace, ([warps[0]], warps[1:3], [warps[3]])):
        step["ops"] += w
    sampled = p.predict(sampled_trace, sampled=True)
    assert sampled["heads"] == pytest.approx(got["heads"] + 0.25 * ms, rel=1e-12)
    assert sampled["verify"] == pytest.approx(got["verify"] + 5 / 3 * ms, rel=1e-12)
    assert sum(sampled.values()) == pytest.approx(sum(got.values()) + (1 + 0.25 + 5 / 3 + 0.1) * ms, rel=1e-12)
    with pytest.raises(ValueError, match="no warp op"):
        p.predict(trace, sampled=True)
    # a head of fewer rows than the smallest measured (a draft vocabulary's context rows) in proportion to
    # them: 50 of 250 rows, a fifth of 1 ms; 2 states, a fifth of the 250-row head's 1.5 ms between 1 and 4 states
    assert p.op(["heads", "H", 1, 50]) == pytest.approx(0.2 * ms, rel=1e-12)
    assert p.op(["heads", "H", 2, 50]) == pytest.approx(0.2 * 1.5 * ms, rel=1e-12)
    assert p.op(["heads", "H", 1, 0]) == 0.0


def test_every_shipped_profile_is_of_this_format_and_prices_every_op():
    """A profile shipped in an older format would be refused at every run on its machine."""
    from selfspec.measure.profile import shipped

    assert shipped()
    for name, path in shipped().items():
        p = Profile.load(path)
        assert p.name == name
        vocab = p.shape["vocab_size"]
        ops = [["plain", "L", 1, p.shape["num_layers"], p.shape["num_layers"], 512], ["plain", "H", 1, vocab],
               ["heads", "X", 1, p.shape["hidden_size"], p.shape["hidden_size"]], ["plain", "W", 1, vocab, 1],
               ["plain", "W", 3, vocab // 4, 0]]
        assert all(p.op(op) > 0 for op in ops), name
        # a top-p warp sorts the vocabulary: dearer than temperature alone
        assert p.op(ops[3]) > p.op(["plain", "W", 1, vocab, 0])


def test_a_trace_without_ops_is_refused():
    with pytest.raises(ValueError, match="no ops"):
        synthetic_profile().predict([{"source": "plain"}])


def test_a_profile_of_another_model_shape_is_refused_by_name(tiny):
    p = synthetic_profile()
    with pytest.raises(ProfileMismatch, match=r"vocab_size: profile 1000, model tiny-random 49152"):
        p.check_shape(model_shape(tiny.model), "model tiny-random")
    with pytest.raises(ValueError, match="format"):
        synthetic_profile(format=FORMAT + 1)


def test_a_ledger_op_is_a_typed_record_stored_as_the_compact_list():
    ops = [LayerOp("verify", 4, 30, 30, 100), LayerOp("tree", 60, 30, 30, 100, eager=True), HeadOp("draft", 1, 49152),
           LinearOp("heads", 1, 576, 576), WarpOp("plain", 2, 49152, True),
           LayerOp("plain", 1, 30, 30, 100, weights="int8", shared=12), HeadOp("plain", 1, 49152, shared=12)]
    rows = [op.row() for op in ops]
    assert rows == [["verify", "L", 4, 30, 30, 100], ["tree", "L", 60, 30, 30, 100, 1], ["draft", "H", 1, 49152],
                    ["heads", "X", 1, 576, 576], ["plain", "W", 2, 49152, 1],
                    ["plain", "L:int8", 1, 30, 30, 100, 0, 0, 0, 12], ["plain", "H", 1, 49152, 12]]
    assert [as_op(r) for r in json.loads(json.dumps(rows))] == ops
    with pytest.raises(ValueError, match="unknown ledger op"):
        as_op(["verify", "Q", 1])


def test_an_op_run_in_a_batchs_pass_costs_its_rows_share_of_that_pass(tiny, tiny_profile):
    """A walk or head product that ran with other sequences' rows (``shared``: the pass's rows) is priced
    as the pass at all its rows times its own rows' share, so a pass's shares add up to the pass."""
    from selfspec.measure.profile import Profile

    vocab = tiny.model.vocab_size
    p = Profile({**tiny_profile.data, "head": {str(vocab): tiny_profile.data["mlp"]}})  # heads that cost something
    for op in (LayerOp("verify", 3, 4, 4, 200), HeadOp("verify", 3, vocab)):
        whole = p.op(op._replace(rows=12))
        assert p.op(op._replace(shared=12)) == pytest.approx(whole * 3 / 12)
        assert 0 < p.op(op._replace(shared=12)) < p.op(op)  # cheaper than the same rows alone
        shares = [op._replace(rows=n, shared=12) for n in (3, 1, 8)]
        assert sum(map(p.op, shares)) == pytest.approx(whole)
    assert p.op(LayerOp("plain", 1, 4, 4, 200, shared=1)) == p.op(LayerOp("plain", 1, 4, 4, 200))


@pytest.mark.parametrize("name", METHODS)
def test_the_ledger_adds_up_to_the_measured_time(tiny, prompt_ids, name):
    g = _decoder(name, tiny).generate(prompt_ids + prompt_ids, 24, Sampling())
    assert set(g.ledger) == set(COMPONENTS)
    assert sum(g.ledger.values()) == pytest.approx(g.seconds, rel=1e-9, abs=1e-9)
    assert all(v >= 0 for v in g.ledger.values())
    ops = [op for step in g.trace for op in step.ops]
    assert ops and {op.component for op in ops} <= set(COMPONENTS) - {"host"}
    # every component that ran model work took time, and the prompt is the first step's work
    for c in {op.component for op in ops}:
        assert g.ledger[c] > 0, c
    assert g.trace[0].ops[0][:2] in (("prefill", len(prompt_ids) * 2), ("draft", len(prompt_ids) * 2))
    if name == "vanilla":
        assert {op.component for op in ops} == {"prefill", "plain"} and g.ledger["draft"] == g.ledger["verify"] == 0
    if name in ("early_exit", "del", "adadecode"):
        assert any(op.component == "heads" for op in ops)
    if name == "ppd":
        assert g.ledger["tree"] > 0 and any(op.component == "verify" and op.rows > 1 for op in ops)


def test_the_ledger_charges_each_layer_walk_its_sublayers(tiny, prompt_ids):
    """Draft & Verify's drafts run the layers less its skip set; the verification every layer."""
    g = _decoder("draft_verify", tiny).generate(prompt_ids, 8, Sampling())
    layers = tiny.model.num_layers
    for step in g.trace[1:]:
        for op in step.ops:
            if op.kind == "L" and op.component == "draft":
                assert (op.rows, op.attention, op.mlp) == (1, layers - 1, layers - 1)  # skip_attn [1], skip_mlp [2]
            if op.kind == "L" and op.component == "verify":
                assert op.rows == step.width and (op.attention, op.mlp) == (layers, layers)


def test_measured_profile_of_the_tiny_model(tiny):
    p = measure_profile(tiny.model, rows=(1, 2, 4), prefill_rows=(16,), contexts=(0, 32), repeats=1)
    assert p.shape == model_shape(tiny.model) and p.data["machine"]["device"] == "cpu"
    assert set(p.attention) == {0, 32} and set(p.attention[0]) == {1, 2, 4, 16}
    assert all(t > 0 for row in p.attention.values() for t in row.values())
    assert p.head(1, tiny.model.vocab_size) > 0 and p.host >= 0 and p.plain_step(32) > 0
    assert "tree" in p.host_steps and all(v >= 0 for v in p.host_steps.values())  # PPD's host work (issue 38)
    assert "eager" not in p.data  # a CPU runs no graphs: its tables price eager passes already
    again = Profile(json.loads(json.dumps(p.data)))
    assert again.plain_step(32) == pytest.approx(p.plain_step(32))


def test_a_profile_over_its_budget_measures_fewer_points_prices_every_row_and_says_so(tiny):
    """Issue 70: at 1.5B parameters the full profile took longer than a 15-minute run (killed before it
    decoded a token, no progress shown). Over its budget a profile measures a thinner plan, records
    it, logs its stages with the time so far, and still prices every row count and context it kept."""
    from selfspec.evaluation.profiling import ProfilePlan, _ends_and_powers

    lines = []
    asked = dict(rows=(1, 2, 3, 4, 8, 16), prefill_rows=(16, 32), contexts=(0, 8, 16, 32), repeats=4)
    full = measure_profile(tiny.model, **asked, budget=1e6, log=lines.append)
    assert "plan" not in full.data and full.data["repeats"] == 4 and set(full.attention) == {0, 8, 16, 32}
    assert not any("beyond its budget" in line for line in lines) and any(" min" in line for line in lines)
    lines.clear()
    thin = measure_profile(tiny.model, **asked, budget=1e-9, log=lines.append)
    plan = ProfilePlan(**{k: v for k, v in thin.data["plan"].items() if k != "budget"})
    assert thin.data["plan"]["budget"] == 1e-9 and thin.data["repeats"] == plan.repeats == 3
    assert plan.mlp == "once" and len(plan.tree_nodes) == 1 and len(plan.rows) < len(asked["rows"]) and plan.rows[0] == 1 and plan.rows[-1] == 16
    assert any("beyond its budget" in line and "the thinnest plan" in line for line in lines), lines
    assert set(thin.attention) == set(plan.contexts) and 8 not in plan.contexts
    assert all(set(thin.attention[c]) >= set(plan.rows) for c in plan.contexts)
    assert {int(n) for n in thin.data["mlp"]} == {*plan.rows, *plan.prefill_rows}  # an MLP for every row count
    assert thin.plain_step(32) > 0 and thin.head(1, tiny.model.vocab_size) > 0
    # a row count and a context the plan left out are priced between their measured neighbours
    lo, hi = sorted((thin.attention_cost(2, 16), thin.attention_cost(4, 16)))
    assert 3 not in plan.rows and lo <= thin.attention_cost(3, 16) <= hi
    lo, hi = sorted((thin.attention_cost(4, 0), thin.attention_cost(4, 16)))
    assert lo <= thin.attention_cost(4, 8) <= hi
    lo, hi = sorted((thin.mlp_cost(2), thin.mlp_cost(4)))
    assert lo <= thin.mlp_cost(3) <= hi
    assert thin.summary()["plan"] == thin.data["plan"] and "plan" not in full.summary()  # a run says how it was priced
    assert set(full.data) - {"plan"} == set(thin.data) - {"plan"}  # the same tables, thinned
    assert _ends_and_powers((1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128), 5) == (1, 2, 8, 32, 128)


def test_a_measured_profile_names_its_dtype_where_it_is_not_float32():
    """A bfloat16 profile was named like the float32 one of its machine and model
    (``cpu-amd-epyc-avx512-bf16-2t__smollm2-135m``), so a run priced with it said float32."""
    from omegaconf import OmegaConf

    from selfspec.config import model_config
    from selfspec.models.loading import load_model

    for dtype, tail in (("float32", "__tiny-random"), ("bfloat16", "__tiny-random__bfloat16")):
        model = load_model(OmegaConf.merge(model_config("tiny-random"), {"dtype": dtype})).model
        p = measure_profile(model, rows=(1,), prefill_rows=(8,), contexts=(0,), repeats=1)
        assert p.shape["dtype"] == dtype and p.name.endswith(tail), p.name


def test_machine_names_tell_amd_generations_apart_and_keep_intels_and_old_records():
    """Issue 72: a Zen 4 and a Zen 5 VM are both "AMD EPYC" with AVX-512-BF16, so their profiles had one
    name. An AMD CPU whose family is recorded says its generation (family 25 without AVX-512: Zen 3,
    with it: Zen 4; 26: Zen 5; another: its number, not a guess); Intel's name, and that of a machine
    recorded before the family was (an old profile's), stay as they were."""
    from selfspec.measure.profile import machine_name

    epyc = {"device": "cpu", "hardware": "AMD EPYC", "threads": 2,
            "kernel_paths": {"float32": "avx512", "bfloat16": "avx512_bf16"}}
    zen3 = {"device": "cpu", "hardware": "AMD EPYC 7B13", "threads": 2,
            "kernel_paths": {"float32": "avx2", "bfloat16": "widen"}}
    xeon = {"device": "cpu", "hardware": "Intel(R) Xeon(R) Processor", "threads": 2,
            "kernel_paths": {"float32": "avx512", "bfloat16": "amx"}}
    cases = [
        (zen3 | {"cpu_family": 25, "cpu_model": 1, "cpu_avx512": False}, "cpu-amd-epyc-7b13-zen3-2t"),
        (epyc | {"cpu_family": 25, "cpu_model": 17, "cpu_avx512": True}, "cpu-amd-epyc-zen4-avx512-bf16-2t"),
        (epyc | {"cpu_family": 26, "cpu_model": 2, "cpu_avx512": True}, "cpu-amd-epyc-zen5-avx512-bf16-2t"),
        (epyc | {"cpu_family": 27, "cpu_model": 0, "cpu_avx512": True}, "cpu-amd-epyc-f27-avx512-bf16-2t"),
        (epyc | {"cpu_family": 25}, "cpu-amd-epyc-f25-avx512-bf16-2t"),  # AVX-512 unknown: no guess
        (xeon | {"cpu_family": 6, "cpu_model": 143, "cpu_avx512": True}, "cpu-intel-xeon-amx-2t"),
        (epyc, "cpu-amd-epyc-avx512-bf16-2t"),  # the shipped Zen 4 profiles' record
        ({"device": "cuda", "hardware": "NVIDIA H100 80GB HBM3", "threads": 2}, "cuda-nvidia-h100-80gb-hbm3"),
    ]
    assert [machine_name(info) for info, _ in cases] == [name for _, name in cases]


def _cpu_family() -> int | None:
    """The family /proc/cpuinfo gives this CPU, or None where it gives none (not Linux, an ARM CPU)."""
    from pathlib import Path

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split(":", 1)[1]) for line in lines if line.startswith("cpu family")), None)


def test_the_running_machine_records_its_cpu_family_and_is_looked_up_by_it(tiny):
    """Issue 72: this machine's profile record carries its CPU's family and model, and the cache it
    keeps its profiles in is keyed by the name they give (with an AMD CPU's generation)."""
    from selfspec.measure import profile as profiles

    family = _cpu_family()
    if family is None:
        pytest.skip("/proc/cpuinfo gives no CPU family here")
    info = profiles.machine(torch.device("cpu"))
    assert info["cpu_family"] == family and isinstance(info["cpu_model"], int)
    assert isinstance(info["cpu_avx512"], bool)
    name = profiles.machine_name(info)
    assert profiles.default_path(tiny.model, torch.device("cpu")).name.startswith(f"{name}__")
    if "AMD" in info["hardware"]:
        assert name != profiles.machine_name({k: v for k, v in info.items() if not k.startswith("cpu_")})


def test_a_profile_recorded_without_the_cpu_family_is_not_taken_for_this_machine(tiny, tiny_profile, tmp_path,
                                                                                 monkeypatch):
    """Issue 72: a shipped profile whose machine record has no CPU family (every one measured before
    it was recorded: ``cpu-amd-epyc-avx512-bf16-2t`` was a Zen 4) is not taken by ``profile=auto``
    for this machine, which may be another generation of the same name, nor judges its contention;
    one recorded with this machine's family is."""
    from selfspec.measure import profile as profiles

    if _cpu_family() is None:
        pytest.skip("/proc/cpuinfo gives no CPU family here")
    model = tiny.model
    here = profiles.machine(model.device)
    shipped = tmp_path / "profiles"
    monkeypatch.setattr(profiles, "SHIPPED", shipped)
    data = copy.deepcopy(tiny_profile.data)
    data["model"] |= {"linear_kernel": model.linear_kernel, "capture": model.capture}
    old = Profile(data | {"name": "old", "machine": {k: v for k, v in here.items() if not k.startswith("cpu_")}})
    old.save(shipped / "old.json")
    assert not old.describes(here) and profiles.matching_shipped(model) is None
    Profile(data | {"name": "new", "machine": here}).save(shipped / "new.json")
    assert profiles.matching_shipped(model).name == "new"


def test_others_busy_counts_other_processes_not_this_one():
    """The share of the CPUs other processes took (/proc/stat less this process's own time): a
    process spinning on every CPU beside a sleep counts; this process spinning does not."""
    import os
    import subprocess
    import sys
    import time

    from selfspec.measure.costs import OthersBusy

    if OthersBusy._now() is None:
        pytest.skip("no /proc/stat here")

    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.3)  # the interpreters started
        busy = OthersBusy()
        time.sleep(1.0)
        assert busy.share() > 0.6
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    # this process busy on every CPU: were its own time counted, the share would be about 1
    own = OthersBusy()
    a = torch.randn(256, 256)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        a = torch.tanh(a @ a)
    assert own.share() < 0.75


def test_a_malformed_shipped_profile_stops_only_the_runs_that_need_it(tiny, tiny_profile, tmp_path, monkeypatch,
                                                                       caplog):
    """Issue 68: one malformed shipped profile (any model's) stopped every ``profile=auto`` run that had
    no cached profile, and the report's paper notes, which read every shipped profile's model. Now the
    scans skip it with a warning naming the file and the remedy, and take the good one; a run that
    names it is refused before its model loads, naming the file and the remedy."""
    from types import SimpleNamespace

    from selfspec.config.checks import ConfigError
    from selfspec.evaluation import profiling
    from selfspec.measure import profile as profiles

    model = tiny.model
    shipped = tmp_path / "profiles"
    data = copy.deepcopy(tiny_profile.data) | {"name": "this-machine__tiny-random", "machine": profiles.machine(model.device)}
    data["model"] |= {"linear_kernel": model.linear_kernel, "capture": model.capture}
    Profile(data).save(shipped / "this-machine__tiny-random.json")
    broken = shipped / "another-machine__smollm2-135m.json"  # scanned first
    broken.write_text('{"format": 3, "name": ')
    monkeypatch.setattr(profiles, "SHIPPED", shipped)
    monkeypatch.setattr(profiles, "default_path", lambda model, device: tmp_path / "cache" / "none.json")
    remedy = r"ships with selfspec.*reinstall selfspec.*make profile"
    with caplog.at_level("WARNING"):
        assert profiling.machine_profile(model).name == "this-machine__tiny-random"
    assert str(broken) in caplog.text and re.search(remedy, caplog.text)
    profiles.shipped_models.cache_clear()
    try:
        assert profiles.shipped_models() == {"this-machine__tiny-random": model.name}
    finally:
        profiles.shipped_models.cache_clear()
    with pytest.raises(ConfigError, match=rf"profile=another-machine__smollm2-135m .*{broken} is not valid JSON.*{remedy}"):
        profiling.profile_spec(SimpleNamespace(profile="another-machine__smollm2-135m"))


def test_a_profile_measured_under_load_prices_the_run_but_is_not_kept(tiny, tmp_path, monkeypatch, caplog):
    """evaluate's profile=auto measures this machine's profile once and keeps it for every later
    run: one measured while other processes took the CPUs is used by the run that measured it, with
    a warning, and not kept (the next run measures again); a quiet one is kept."""
    from selfspec.evaluation import profiling
    from selfspec.measure import costs

    path = tmp_path / "profile.json"
    monkeypatch.setattr("selfspec.measure.profile.default_path", lambda model, device: path)
    monkeypatch.setattr("selfspec.measure.profile.matching_shipped", lambda model: None)
    small = profiling.measure_profile
    monkeypatch.setattr(profiling, "measure_profile", lambda model, **kw: small(
        model, rows=(1, 2), prefill_rows=(), contexts=(0,), repeats=1, **kw))
    monkeypatch.setattr(costs.OthersBusy, "share", lambda self: 0.6)
    with caplog.at_level("WARNING"):
        spoiled = profiling.machine_profile(tiny.model)
    assert spoiled.data["others_busy"] == 0.6 and not path.exists()
    assert "60% of the CPUs" in caplog.text and "not kept" in caplog.text
    monkeypatch.setattr(costs.OthersBusy, "share", lambda self: 0.02)
    quiet = profiling.machine_profile(tiny.model)
    assert path.exists() and Profile.load(path).data["others_busy"] == 0.02 and quiet.data["others_busy"] == 0.02


def test_a_profile_measured_with_graphs_measures_every_width_it_replays():
    """A capturing model replays decoding passes up to the largest bucket (the searches' branch
    passes, PPD's largest trees): its profile measures that width, so a projection onto it prices
    them at a measured price rather than withholding them; a CPU's stops at 128 rows (past them its
    costs are near proportional, and the extrapolation holds)."""
    from selfspec.evaluation.profiling import profile_rows
    from selfspec.measure.profile import ROWS
    from selfspec.models.capture import BUCKETS

    assert profile_rows("off") == profile_rows("static") == ROWS and ROWS[-1] == 128
    assert profile_rows("graphs") == (*ROWS, BUCKETS[-1]) and BUCKETS[-1] == 256


def _run(tiny, tmp_path, *extra):
    return evaluate(compose(["model=tiny-random", "n_examples=2", "max_new_tokens=12", "warmup=1", "progress=false",
                             "method=ngram", "compare=[hf_generate]", *extra]), tmp_path, loaded=tiny)


def test_summary_has_the_ledger_and_the_predicted_speedup(tiny, tmp_path):
    s = _run(tiny, tmp_path)
    assert s["profile"]["device"] == "cpu" and s["model_shape"] == model_shape(tiny.model)
    assert s["contention"] is None  # milliseconds of a tiny model: within the timers' noise, not judged
    # threads=auto: the thread policy runs where it can (a CPU with two threads and a profile)
    assert s["threads"] == {"policy": "adaptive" if torch.get_num_threads() > 1 else "fixed",
                            "configured": torch.get_num_threads()}
    for name in ("vanilla", "ngram"):
        e = s["methods"][name]
        measured, predicted = e["ledger"]["measured"], e["ledger"]["predicted"]
        assert sum(measured.values()) == pytest.approx(1 / e["speedup"])
        assert sum(predicted.values()) == pytest.approx(1 / e["predicted_speedup"])
    assert s["methods"]["vanilla"]["predicted_speedup"] == pytest.approx(1.0)
    assert s["methods"]["hf_generate"]["ledger"] is None and s["methods"]["hf_generate"]["predicted_speedup"] is None
    rows = ResultsFile(tmp_path / RESULTS).rows()
    assert all(r["ledger"] for r in rows if r["method"] != "hf_generate")


def test_no_profile_leaves_the_prediction_out(tiny, tmp_path):
    s = _run(tiny, tmp_path, "profile=null", "method.draft_schedule=adaptive")  # priced needs the profile
    assert s["profile"] is None and s["contention"] is None
    assert s["threads"]["policy"] == "fixed"  # auto: no profile to price the steps with
    assert s["methods"]["ngram"]["predicted_speedup"] is None and s["methods"]["ngram"]["ledger"]["predicted"] is None


def test_a_missing_profile_file_stops_before_the_model_loads(tmp_path):
    from selfspec.config import checks

    with pytest.raises(checks.ConfigError, match="profile="):
        evaluate(compose(["model=tiny-random", f"profile={tmp_path / 'nope.json'}"]), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_profile_of_another_shape_stops_the_run(tiny, tmp_path):
    path = tmp_path / "other.json"
    synthetic_profile().save(path)
    with pytest.raises(ProfileMismatch, match="vocab_size"):
        _run(tiny, tmp_path / "run", f"profile={path}")
    assert not (tmp_path / "run").exists()


def test_contention_is_flagged_from_the_baselines_step_times(tiny, tmp_path):
    s = _run(tiny, tmp_path)
    rows = ResultsFile(tmp_path / RESULTS).rows()
    base = [r for r in rows if r["method"] == "vanilla"]
    profile = Profile.load(s["profile"]["path"])
    here = profile.machine
    # each generation at its predicted time, a quiet machine's (the profile may have been measured
    # while the machine was busier than during the run: a ratio of 0.08 was seen under load)
    for r in base:
        r["seconds"] = sum(profile.predict(r["trace"], sampled=False).values())
    quiet = contention(base, profile, 1.25, here, min_seconds=0)
    assert quiet["ratio"] == pytest.approx(1.0) and quiet["flagged"] is False
    slow = copy.deepcopy(base)
    for r in slow:  # the same steps at 3x the time: another process took the cores
        r["seconds"] *= 3
    loaded = contention(slow, profile, 1.25, here, min_seconds=0)
    assert loaded["ratio"] == pytest.approx(3 * quiet["ratio"]) and loaded["flagged"] is True
    assert contention(base, profile, quiet["ratio"] + 0.01, here, min_seconds=0)["flagged"] is False
    # another machine's profile cannot tell, nor can a run shorter than the least judged time
    assert contention(base, profile, 1.25, here | {"hardware": "Another CPU"}, min_seconds=0) is None
    short = sum(r["seconds"] for r in base)  # what the profile predicts of the run (a busy machine's profile: more)
    assert contention(base, profile, 1.25, here, min_seconds=short * 1.01) is None
    assert contention(base, profile, 1.25, here, min_seconds=short * 0.99) is not None


def test_a_batched_run_is_judged_by_its_batches_not_by_its_sequences(tiny, tmp_path, monkeypatch):
    """Found measuring issue 54 (SmolLM2, XSum, a quiet machine): every batched run was flagged as
    measured under load, at 1.85x, 2.6x, 5.6x and 10x for B = 2, 4, 8, 16. A sequence's seconds span
    its whole batch, the other sequences' passes included, and were set against its own trace's
    price. A batched run is judged by its batches' wall seconds against the price of their passes."""
    from selfspec.evaluation import aggregate, loop

    judged = []

    def batch_contention(*args, **kw):  # the run is milliseconds long: judge it anyway
        judged.append(aggregate.batch_contention(*args, **{**kw, "min_seconds": 0}))
        return judged[-1]

    monkeypatch.setattr(loop, "batch_contention", batch_contention)
    monkeypatch.setattr(loop, "contention", lambda *a, **k: pytest.fail("a batched run judged per sequence"))
    s = _run(tiny, tmp_path, "batch_size=3", "n_examples=4", "compare=[]", "method.never_slower=false")
    base = s["batches"]["vanilla"]
    assert judged and s["contention"] == judged[-1]
    assert s["contention"]["ratio"] == pytest.approx(base["seconds"] / base["predicted_seconds"])
    assert s["contention"]["batched"] is True and s["contention"]["spoiled"] == []
    assert s["contention"]["flagged"] is (s["contention"]["ratio"] > s["contention"]["threshold"])
    profile = Profile.load(s["profile"]["path"])
    quiet = dict(base, seconds=base["predicted_seconds"], measured_over_predicted=1.0)
    assert aggregate.batch_contention(quiet, profile, 1.5, profile.machine, min_seconds=0)["flagged"] is False
    loaded = dict(base, measured_over_predicted=3.0)
    assert aggregate.batch_contention(loaded, profile, 1.5, profile.machine, min_seconds=0)["flagged"] is True
    assert aggregate.batch_contention(loaded, profile, 1.5, profile.machine | {"hardware": "Another CPU"},
                                      min_seconds=0) is None


def test_a_burst_of_load_in_one_generation_is_caught_per_generation(tiny, tmp_path):
    """A burst that slows one generation moves the whole run's ratio too little for the threshold; the
    per-generation check lists it (against its method's median ratio) and flags the run."""
    from selfspec.evaluation.aggregate import spoiled_generations
    from selfspec.reporting.breakdown import contention_warning

    _run(tiny, tmp_path, "n_examples=5")
    rows = ResultsFile(tmp_path / RESULTS).rows()
    profile = Profile.load(json.loads((tmp_path / "summary.json").read_text())["profile"]["path"])
    here = profile.machine
    finished = {m: [r for r in rows if r["method"] == m] for m in ("vanilla", "ngram", "hf_generate")}
    assert len(finished["vanilla"]) == 5
    # scale every generation to its predicted time (a quiet machine's), then slow one of vanilla's
    for method in ("vanilla", "ngram"):
        for r in finished[method]:
            r["seconds"] = 1.1 * sum(profile.predict(r["trace"], sampled=False).values())
    assert spoiled_generations(finished, profile, here, 1.2, min_seconds=0) == []
    slow = finished["vanilla"][2]
    slow["seconds"] *= 1.5
    spoiled = spoiled_generations(finished, profile, here, 1.2, min_seconds=0)
    assert [(g["method"], g["id"]) for g in spoiled] == [("vanilla", slow["id"])]
    assert spoiled[0]["excess"] == pytest.approx(1.5)
    assert spoiled_generations(finished, profile, here, 1.6, min_seconds=0) == []
    # a skip search's unpriced host work (a Bayesian proposal) in one generation is the method's, not load
    searching = copy.deepcopy(finished)
    searching["vanilla"][2]["seconds"] /= 1.5
    searched = searching["ngram"][3]
    searched["ledger"] = {**searched["ledger"], "search": 2.0}
    searched["seconds"] += 2.0
    assert spoiled_generations(searching, profile, here, 1.2, min_seconds=0) == []
    # the HF peers have no trace and are not judged; another machine's profile cannot tell
    assert spoiled_generations(finished, profile, here | {"hardware": "Another CPU"}, 1.2) is None
    # with three methods an example every method found slow is the example's (its prompt), not a burst
    slow["seconds"] /= 1.5
    finished["copy"] = copy.deepcopy(finished["ngram"])
    for method in ("vanilla", "ngram", "copy"):
        finished[method][1]["seconds"] *= 1.5
    assert spoiled_generations(finished, profile, here, 1.2, min_seconds=0) == []
    finished["copy"][3]["seconds"] *= 1.5
    burst = spoiled_generations(finished, profile, here, 1.2, min_seconds=0)
    assert [(g["method"], g["id"]) for g in burst] == [("copy", finished["copy"][3]["id"])]
    assert burst[0]["excess"] == pytest.approx(1.5)
    # a burst that outlasts all but one of an example's generations (vanilla ran before it) is a burst
    finished["ngram"][3]["seconds"] *= 1.5
    longer = spoiled_generations(finished, profile, here, 1.2, min_seconds=0)
    assert sorted((g["method"], g["id"]) for g in longer) == [("copy", finished["copy"][3]["id"]),
                                                              ("ngram", finished["ngram"][3]["id"])]
    assert all(g["excess"] == pytest.approx(1.5) for g in longer)
    finished["ngram"][3]["seconds"] /= 1.5
    result = contention(finished["vanilla"], profile, 1.5, here, min_seconds=0, spoiled=spoiled)
    assert result["ratio"] < 1.5 and result["flagged"] is True and result["spoiled"] == spoiled
    warning = contention_warning(result, "XSum")
    assert "1 generation took more than" in warning and f"vanilla on {slow['id']}, 1.50×" in warning


def test_projection_onto_another_profile(tiny, tmp_path):
    s = _run(tiny, tmp_path)
    here = Profile.load(s["profile"]["path"])
    other = copy.deepcopy(here.data)
    other["name"], other["machine"]["hardware"] = "faster-head", "Another CPU"
    other["head"] = {v: {n: t / 10 for n, t in row.items()} for v, row in other["head"].items()}
    p = Profile(other)
    projected = project_run(tmp_path, p)
    on_disk = json.loads((tmp_path / SUMMARY).read_text())
    assert on_disk["projections"]["faster-head"]["vanilla"]["predicted_speedup"] == pytest.approx(1.0)
    assert projected["ngram"]["predicted_speedup"] == on_disk["projections"]["faster-head"]["ngram"]["predicted_speedup"]
    # the same traces, costed again: on its own profile the run's prediction comes back
    assert project_run(tmp_path, here)["ngram"]["predicted_speedup"] == pytest.approx(
        s["methods"]["ngram"]["predicted_speedup"])
    # and a profile of another model shape is refused, leaving the summary as it was
    before = (tmp_path / SUMMARY).read_bytes()
    with pytest.raises(ProfileMismatch, match="vocab_size"):
        project_run(tmp_path, synthetic_profile())
    assert (tmp_path / SUMMARY).read_bytes() == before


def test_summarize_without_profile_keeps_measured_ledger():
    rows = [{"id": "a", "method": m, "tokens": [1, 2], "new_tokens": 2, "seconds": sec, "steps": 2,
             "ledger": {"plain": sec * 0.9, "host": sec * 0.1}, "trace": [{"source": "plain"}]}
            for m, sec in (("vanilla", 2.0), ("x", 1.0))]
    out = summarize(rows, ["vanilla", "x"], "vanilla")
    assert out["x"]["speedup"] == 2.0
    assert out["x"]["ledger"]["measured"] == pytest.approx({"plain": 0.45, "host": 0.05})
    assert out["x"]["predicted_speedup"] is None


def test_decode_speedup_leaves_the_prompts_step_out():
    """Two sampled generations that ended at other lengths: vanilla 1 s of prefill and 40 more
    tokens at 0.1 s; the method the same prefill and 10 more tokens at 0.05 s. Its speedup mixes
    in the prompt's cost over fewer tokens (0.61x); its decoding steps are 2x vanilla's."""
    def row(method, tail, step):
        tokens = 1 + tail
        return {"id": "a", "method": method, "tokens": list(range(tokens)), "new_tokens": tokens,
                "seconds": 1.0 + tail * step, "steps": tokens, "ledger": {"prefill": 1.0, "plain": tail * step},
                "trace": [{"source": "prefill", "committed": 1}] + [{"source": "plain", "committed": 1}] * tail}

    rows = [row("vanilla", 40, 0.1), row("x", 10, 0.05), {**row("peer", 40, 0.05), "ledger": None}]
    out = summarize(rows, ["vanilla", "x", "peer"], "vanilla", greedy=False)
    assert out["x"]["speedup"] == pytest.approx((5.0 / 41) / (1.5 / 11))
    assert out["x"]["decode_speedup"] == pytest.approx(2.0)
    assert out["vanilla"]["decode_speedup"] == pytest.approx(1.0) and out["peer"]["decode_speedup"] is None


def test_a_sampled_run_prices_its_warps_and_an_older_trace_without_them_is_refused(tiny, tmp_path):
    s = _run(tiny, tmp_path, "sampling.temperature=0.7", "sampling.top_p=0.9")
    rows = ResultsFile(tmp_path / RESULTS).rows()
    for r in rows:
        if r["method"] != "hf_generate":  # every step sampled its token: each carries a warp
            assert all(any(op[1] == "W" and op[4] == 1 for op in step["ops"]) for step in r["trace"]), r["method"]
    assert s["methods"]["ngram"]["predicted_speedup"] is not None
    # the same run as an older selfspec recorded it, without warp ops: refused, naming the run
    lines = (tmp_path / RESULTS).read_text().splitlines()
    old = []
    for line in lines:
        row = json.loads(line)
        for step in row.get("trace") or []:
            step["ops"] = [op for op in step["ops"] if op[1] != "W"]
        old.append(json.dumps(row))
    (tmp_path / RESULTS).write_text("\n".join(old) + "\n")
    before = (tmp_path / SUMMARY).read_bytes()
    with pytest.raises(ValueError, match=f"run {tmp_path}: a sampled step of the trace has no warp op"):
        project_run(tmp_path, Profile.load(s["profile"]["path"]))
    assert (tmp_path / SUMMARY).read_bytes() == before


def test_a_run_projects_onto_a_profile_of_its_architecture_in_another_dtype(tiny, tmp_path):
    """Issue 38: the SmolLM2 runs here are float32 and the GPU profiles users want bfloat16; the trace
    is the algorithm's, so the projection is made and its name says it crossed dtypes. Another
    architecture is still refused by name."""
    from omegaconf import OmegaConf

    from selfspec.project import run_projection

    s = _run(tiny, tmp_path / "run")
    here = Profile.load(s["profile"]["path"])
    bf16 = copy.deepcopy(here.data)
    bf16["name"] = "gpu__tiny-random__bfloat16"
    bf16["model"]["shape"]["dtype"] = "bfloat16"
    folder = tmp_path / "profiles"
    Profile(bf16).save(folder / "bf16.json")
    synthetic_profile().save(folder / "other-shape.json")
    out = run_projection(OmegaConf.create({"inputs": [str(tmp_path / "run")], "profile": str(folder)}))
    name = "gpu__tiny-random__bfloat16 (float32 trace)"
    assert list(out[str(tmp_path / "run")]) == [name]
    recorded = json.loads((tmp_path / "run" / SUMMARY).read_text())["projections"][name]
    assert recorded["_profile"]["dtype"] == "bfloat16" and recorded["_profile"]["trace_dtype"] == "float32"
    # the same prices in another dtype: the same prediction as on the run's own profile
    assert recorded["ngram"]["predicted_speedup"] == pytest.approx(s["methods"]["ngram"]["predicted_speedup"])
    with pytest.raises(ProfileMismatch, match="vocab_size"):
        project_run(tmp_path / "run", synthetic_profile())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,why", [("fifo", "is a FIFO"), ("nan", "NaN is not a finite number")])
def test_projecting_reads_only_a_regular_summary_of_finite_numbers(tmp_path, kind, why):
    """Issue 52's probe: a summary.json that is a FIFO hung ``project`` for good; NaN in one was
    taken as a figure. Both are refused naming the file."""
    import os

    from omegaconf import OmegaConf

    from selfspec.project import run_projection

    if kind == "fifo":
        os.mkfifo(tmp_path / SUMMARY)
    else:
        (tmp_path / SUMMARY).write_text('{"baseline": "vanilla", "methods": {"vanilla": {"speedup": NaN}}}')
    synthetic_profile().save(tmp_path / "profiles" / "synthetic.json")
    with pytest.raises(ValueError, match=f"{tmp_path / SUMMARY} cannot be read as a run summary .*{why}"):
        run_projection(OmegaConf.create({"inputs": [str(tmp_path)], "profile": str(tmp_path / "profiles")}))


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"methods": 3}'])
def test_projecting_a_malformed_summary_names_the_file(tmp_path, text):
    """Issue 39's probe: project on a malformed summary.json gave a raw JSONDecodeError or
    AttributeError naming no file."""
    from omegaconf import OmegaConf

    from selfspec.project import run_projection

    (tmp_path / SUMMARY).write_text(text)
    synthetic_profile().save(tmp_path / "profiles" / "synthetic.json")
    with pytest.raises(ValueError, match=f"{tmp_path / SUMMARY} (cannot be read as|is not) a (selfspec )?run summary"):
        run_projection(OmegaConf.create({"inputs": [str(tmp_path)], "profile": str(tmp_path / "profiles")}))
    with pytest.raises(ValueError, match=f"{tmp_path / SUMMARY}"):
        project_run(tmp_path, synthetic_profile())


def test_paper_rows_with_tau_name_the_profile_their_projection_needs():
    from selfspec.reporting.paper import paper_records

    ppd = {r.paper_model: r for r in paper_records("ppd_speedup") if r.method == "ppd"}
    # the H100 profiles of the papers' shapes (../shared/gpu/2026-11-26, random weights) are shipped
    assert ("profile of its model shape shipped: cuda-nvidia-h100-80gb-hbm3__vicuna-7b__bfloat16"
            in ppd["Vicuna-7B"].provenance["source"])
    dv = paper_records("dv_static")[0]
    assert "cuda-nvidia-h100-80gb-hbm3__llama2-13b__bfloat16" in dv.provenance["source"]
    # a paper model with no profile of its shape names the command that measures one
    missing = [r for r in paper_records("ppd_speedup") if r.method == "ppd" and "none shipped" in r.provenance["source"]]
    assert all(f"make profile MODEL={r.model}" in r.provenance["source"] for r in missing if r.model)
    # rows with neither tau nor an acceptance rate, and the papers' vanilla rows, need none
    assert all("projection" not in r.provenance["source"] for r in paper_records("adadecode_main"))
    assert all("projection" not in r.provenance["source"] for r in paper_records("ppd_speedup") if r.method == "vanilla")


def test_projection_onto_a_folder_of_profiles_takes_those_of_the_runs_shape(tiny, tmp_path):
    from omegaconf import OmegaConf

    from selfspec.project import run_projection

    s = _run(tiny, tmp_path / "run")
    folder = tmp_path / "profiles"
    here = Profile.load(s["profile"]["path"])
    other = copy.deepcopy(here.data)
    other["name"] = "another-machine__tiny-random"
    Profile(other).save(folder / "another.json")
    synthetic_profile().save(folder / "other-shape.json")  # another model's: not taken
    out = run_projection(OmegaConf.create({"inputs": [str(tmp_path / "run")], "profile": str(folder)}))
    assert list(out[str(tmp_path / "run")]) == ["another-machine__tiny-random"]
    assert "another-machine__tiny-random" in json.loads((tmp_path / "run" / SUMMARY).read_text())["projections"]


def test_an_older_cached_profile_is_measured_again(tiny, tmp_path, monkeypatch):
    import selfspec.measure.profile as profiles

    path = tmp_path / "cache" / "profiles" / "tiny.json"
    monkeypatch.setattr(profiles, "default_path", lambda model, device: path)
    monkeypatch.setattr("selfspec.measure.costs.OthersBusy.share", lambda self: 0.0)  # kept whatever else runs
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"format": FORMAT - 1, "name": "old"}))
    s = _run(tiny, tmp_path / "run")
    assert s["profile"]["path"] == str(path) and Profile.load(path).data["format"] == FORMAT


def test_a_cached_profile_of_other_kernel_paths_is_measured_again(tiny, tmp_path, monkeypatch, caplog):
    """The cache's file name names the libraries, not the kernels' paths: a profile kept before the
    prefill's library changed (oneDNN for MKL) priced every later run with the old prefill's costs
    (and a batched run's contention check then found no profile of this machine)."""
    import selfspec.measure.profile as profiles
    from selfspec.evaluation import profiling

    path = tmp_path / "cache" / "tiny.json"
    monkeypatch.setattr(profiles, "default_path", lambda model, device: path)
    monkeypatch.setattr(profiles, "matching_shipped", lambda model: None)
    monkeypatch.setattr("selfspec.measure.costs.OthersBusy.share", lambda self: 0.0)
    small = profiling.measure_profile
    monkeypatch.setattr(profiling, "measure_profile", lambda model, **kw: small(
        model, rows=(1, 2), prefill_rows=(), contexts=(0,), repeats=1, **kw))
    here = profiles.machine(tiny.model.device)
    first = profiling.machine_profile(tiny.model)
    assert first.describes(here) and profiling.machine_profile(tiny.model).data["measured"] == first.data["measured"]
    stale = Profile.load(path)
    stale.data["machine"]["kernel_paths"] = {**(here.get("kernel_paths") or {}), "float32_wide": "another library"}
    stale.data["measured"] = "2000-01-01T00:00:00Z"
    stale.save(path)
    with caplog.at_level("WARNING"):
        again = profiling.machine_profile(tiny.model)
    assert "describes another machine" in caplog.text and "another library" in caplog.text and again.describes(here)
    assert Profile.load(path).describes(here) and again.data["measured"] != "2000-01-01T00:00:00Z"


def test_eager_passes_are_priced_apart_and_withheld_without_eager_prices():
    """Issue 38: a GPU profile is measured with CUDA graphs, so its tables price captured passes; a
    decoding pass that ran eagerly (PPD's trees wider than every bucket: 22,973 kernel launches in
    30 steps on an H200) cost 3x what such a profile predicted. The ledger flags eager walks; a
    profile with eager tables prices them from those; a format-3 GPU profile with none withholds
    the prediction, saying how many passes it cannot price, rather than pricing them as captured."""
    from selfspec.evaluation.aggregate import _ledger

    captured = {"model": {"name": "tiny", "shape": dict(SHAPE), "linear_kernel": "torch", "capture": "graphs"}}
    trace = [{"source": "prefill", "ops": [["prefill", "L", 4, 4, 4, 0]]},
             {"source": "plain", "ops": [["plain", "L", 1, 4, 4, 100]]},
             {"source": "tree", "tree_size": 60, "ops": [["verify", "L", 2, 4, 4, 100, 1]]},  # flagged eager
             {"source": "tree", "tree_size": 60, "ops": [["verify", "L", 257, 4, 4, 100]]}]  # a CPU trace: too wide
    p = synthetic_profile(**captured)
    assert [p.eager(as_op(s["ops"][0])) for s in trace] == [False, False, True, True]
    assert p.unpriced(trace) == 2 and synthetic_profile().unpriced(trace) == 0  # a CPU profile: the same pass
    rows = [{"ledger": {"verify": 1.0}, "trace": trace, "seconds": 1.0}]
    withheld = _ledger(rows, 10, 0.01, p, 0.01)
    assert withheld["predicted_speedup"] is None
    assert withheld["ledger"]["unpriced"].startswith("2 eager decoding passes: profile synthetic was measured with CUDA graphs")
    eager = {"attention": {"100": {"1": 20e-3, "2": 30e-3}}, "mlp": {"1": 10e-3, "2": 10e-3}}
    q = synthetic_profile(**captured, eager=eager)
    assert q.unpriced(trace) == 0
    assert q.op(trace[1]["ops"][0]) == pytest.approx(4 * 2e-3 + 4 * 2e-3)  # captured: the main tables
    assert q.op(trace[2]["ops"][0]) == pytest.approx(4 * 30e-3 + 4 * 10e-3)  # eager: the eager tables
    assert _ledger(rows, 10, 0.01, q, 0.01)["predicted_speedup"] > 0


def test_a_drafting_steps_host_work_is_priced_by_its_source():
    """Issue 38: PPD's tree and candidate handling is host work the passes do not include (1-1.5 ms
    a step on an H100). ``host_steps`` prices it per tree step and the n-gram lookup per step;
    plain and self-drafted steps add nothing to ``host``."""
    p = synthetic_profile(host_steps={"tree": 2e-3, "context": 0.5e-3})
    steps = [{"source": "tree", "tree_size": 20, "ops": [["verify", "L", 1, 4, 4, 100]]},
             {"source": "context", "ops": [["verify", "L", 1, 4, 4, 100]]},
             {"source": "self", "ops": [["verify", "L", 1, 4, 4, 100]]}]
    plain = synthetic_profile().predict(steps)
    out = p.predict(steps)
    assert out["host"] - plain["host"] == pytest.approx(2e-3 + 0.5e-3)
    assert out["verify"] == pytest.approx(plain["verify"])
    with pytest.raises(ValueError, match="host_steps.tree is -1"):
        synthetic_profile(host_steps={"tree": -1})


def test_a_capturing_model_flags_its_eager_decoding_passes_in_the_ledger():
    from selfspec.config import model_config
    from selfspec.models import capture
    from selfspec.models.ledger import Ledger
    from selfspec.models.loading import load_model

    static = load_model(model_config("tiny-random")).model.with_passes(capture.StepRunner("static"))
    cache = static.new_cache(600)
    ids = torch.zeros(1, 300, dtype=torch.long)
    ledger = Ledger(torch.device("cpu"))
    with torch.inference_mode():
        static.forward(ids[:, :270], cache, start=0, ledger=ledger)  # a prefill: eager on every machine, not flagged
        static.forward(ids[:, :20], cache, ledger=ledger)  # routed
        static.forward(ids[:, :257], cache, ledger=ledger)  # wider than every bucket: eager
    ops = ledger.take_ops()
    assert [(op.rows, op.eager) for op in ops if op.kind == "L"] == [(270, False), (20, False), (257, True)]


def test_a_projection_re_decides_the_gate_of_an_always_speculating_run(tiny, tmp_path):
    """Issue 38: a gated run's trace holds the choices its gate made here; projected as it is, it
    replays them (labelled so). A greedy run that always speculated holds the algorithm's steps, so
    the projection re-decides the gate on the target profile too: where speculation costs more per
    token than a plain step there, the gate takes plain steps and the speedup comes back to about 1;
    where it is cheap, the gate speculates and the regated speedup is the always-speculating one."""
    from selfspec.decoding.gate import SpeculationGate, replay

    gated = _run(tiny, tmp_path / "gated")
    here = Profile.load(gated["profile"]["path"])
    replayed = project_run(tmp_path / "gated", here)["ngram"]
    assert replayed["gate"].startswith("replayed: the choices its gate made on ") and "regated_speedup" not in replayed
    _run(tiny, tmp_path / "always", "method.never_slower=false")
    always = project_run(tmp_path / "always", here)
    assert always["ngram"]["gate"] == "re-decided on the profile"
    assert always["ngram"]["regated_speedup"] > 0 and "gate" not in always["vanilla"]
    # the replay itself, on a trace of known prices (synthetic_profile: a plain step costs 4 + 4 + 4 + 0.25 ms)
    spec = {"source": "self", "drafted": 3, "committed": 2, "ops": [["verify", "L", 4, 4, 4, 100], ["verify", "H", 4, 1000]]}
    trace = [{"source": "prefill", "width": 100, "committed": 1, "ops": [["prefill", "L", 100, 4, 4, 0]]}] + [spec] * 40
    dear, cheap = synthetic_profile(), synthetic_profile(attention={"0": {"1": 1e-3}, "100": {"1": 2e-3, "4": 2e-3}},
                                                         mlp={"1": 2e-3, "4": 2e-3}, head={"1000": {"1": 4e-3, "4": 4e-3}})
    for profile, speculating in ((dear, False), (cheap, True)):
        out = replay(trace, SpeculationGate(profile=profile))
        assert sum(s["committed"] for s in out[1:]) == 80
        spec_steps = sum(s["source"] == "self" for s in out[1:])
        assert (spec_steps > 30) == speculating, spec_steps  # cheap: all 40 (bar a probe); dear: probes only


def test_the_papers_figures_are_priced_on_the_profile_of_their_shape():
    """Issue 38: where a paper prints τ or an acceptance rate with its speedup, the step those figures
    imply is priced on the shipped profile of its shape, beside the paper's speedup. Draft & Verify
    Table 3 (LLaMA-2-13B, K=2, α 0.924, 24/10 sublayers skipped): two one-row draft passes and a
    three-row verification commit (1 - α³) / (1 - α) tokens. PPD Table 1's trees (105 and 60 rows)
    are one verification pass each, priced within the 128 rows the shipped H100 profiles measured at a
    decoding context (those measured before, to 32 rows, withheld them: tests of Profile.why_unpriced)."""
    from selfspec.measure.profile import resolve
    from selfspec.reporting.paper import paper_records

    name = "cuda-nvidia-h100-80gb-hbm3__llama2-13b__bfloat16"
    p = Profile.load(resolve(name))
    dv = next(r for r in paper_records("dv_fixed_k") if r.variant == "K=2")
    ops = [["draft", "L", 1, 16, 30, 1024], ["draft", "L", 1, 16, 30, 1025], ["draft", "H", 1, 32000],
           ["draft", "H", 1, 32000], ["verify", "L", 3, 40, 40, 1024], ["verify", "H", 3, 32000]]
    tokens = (1 - 0.924 ** 3) / (1 - 0.924)
    assert dv.projections[name]["predicted_speedup"] == pytest.approx(tokens * p.plain_step(1024) / p.price(ops))
    assert "the paper measured on an A100, the profile on NVIDIA H100" in dv.projections[name]["paper_trace"]
    ppd = {r.paper_model: r for r in paper_records("ppd_speedup") if r.method == "ppd"}
    seven = Profile.load(resolve("cuda-nvidia-h100-80gb-hbm3__vicuna-7b__bfloat16"))
    tree = [["verify", "L", 105, 32, 32, 512], ["verify", "H", 105, 32000]]
    assert ppd["Vicuna-7B"].projections[seven.name]["predicted_speedup"] == pytest.approx(
        2.54 * seven.plain_step(512) / seven.price(tree))
    assert name in ppd["Vicuna-13B"].projections  # Vicuna-13B has Llama-2-13B's shape
    narrow = json.loads(json.dumps(seven.data))  # a profile measured to 32 rows at decoding contexts
    for context, rows in narrow["attention"].items():
        if context != "0":
            narrow["attention"][context] = {r: t for r, t in rows.items() if int(r) <= 32}
    assert Profile(narrow).why_unpriced([{"ops": tree}]).startswith("passes of 105 rows")


def test_profile_auto_keeps_a_profile_per_shape_of_a_model_name(tmp_path, monkeypatch):
    """Issue 39's probe: profile=auto cached a profile by the model's name, so a random model reshaped
    under the same name (model.random.intermediate_size=...) was refused with advice to measure a
    profile, which is what auto does. The cache is keyed by the shape too."""
    from selfspec.evaluation import profiling
    from selfspec.store.assets import cache_dir

    cache = tmp_path / "cache"  # the assets, with a profile cache of its own
    cache.mkdir()
    for entry in cache_dir().iterdir():
        if entry.name != "profiles":
            (cache / entry.name).symlink_to(entry)
    monkeypatch.setenv("SELFSPEC_CACHE", str(cache))
    monkeypatch.setattr("selfspec.measure.costs.OthersBusy.share", lambda self: 0.0)  # kept whatever else runs
    small = profiling.measure_profile  # a thin plan: what is kept where is under test, not the figures
    monkeypatch.setattr(profiling, "measure_profile", lambda model, **kw: small(model, **THIN_PLAN, **kw))
    common = ["model=tiny-random", "n_examples=1", "max_new_tokens=4", "warmup=0", "progress=false",
              "method=vanilla", "logger=none"]
    a = evaluate(compose(common), tmp_path / "a")
    b = evaluate(compose(common + ["model.random.intermediate_size=64"]), tmp_path / "b")
    assert a["profile"]["path"] != b["profile"]["path"]
    assert Profile.load(b["profile"]["path"]).shape["intermediate_size"] == 64
    # the same shape under another name (a GGUF file given a name of its own) is priced as it is, not
    # measured again: the README's model.gguf_path example measured SmolLM2's profile once more
    c = evaluate(compose(common + ["model.name=my-model"]), tmp_path / "c")
    assert c["profile"]["path"] == a["profile"]["path"]


def test_each_layer_walk_is_charged_its_own_call():
    """``walk`` is charged once per layer walk (each its own call into the runtime), besides its
    sublayers: a pass walked in two calls costs one ``walk`` more than the same layers in one, and a
    full pass's price holds one; a profile without the key charges none."""
    plain = synthetic_profile()
    walked = synthetic_profile(walk=0.2e-3)
    one = ["plain", "L", 1, 4, 4, 0]
    halves = [["plain", "L", 1, 2, 2, 0]] * 2
    assert walked.op(one) == pytest.approx(plain.op(one) + 0.2e-3)
    assert sum(walked.op(op) for op in halves) == pytest.approx(walked.op(one) + 0.2e-3)
    assert walked.pass_cost(1, 0) == pytest.approx(plain.pass_cost(1, 0) + 0.2e-3)
    with pytest.raises(ValueError, match=r"walk is -0\.001, not a finite number"):
        synthetic_profile(walk=-1e-3)


def test_a_measured_profile_prices_a_walk_call(tiny):
    """The profile measures ``walk`` on a CPU (every layer walked alone against one walk of all of
    them): a finite number of seconds, at least zero, well under a full step."""
    from selfspec.evaluation.profiling import measure_profile

    p = measure_profile(tiny.model, rows=(1, 2), prefill_rows=(8,), contexts=(0, 32), repeats=2)
    assert 0.0 <= p.walk < p.plain_step() and "walk" in p.data

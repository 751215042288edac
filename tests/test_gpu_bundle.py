"""scripts/gpu_bundle.py and scripts/gpu_device.sh: what a lent GPU machine gets beside the checkout,
and how it is put together there (docs/gpu.md, "A lent machine")."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bundle_module(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gpu_bundle

    return gpu_bundle


@pytest.mark.slow
def test_the_bundle_joins_on_the_machine_into_the_pinned_assets(bundle_module, tmp_path, monkeypatch):
    """Each call's part fits its 64 MiB with the checkout; on the machine the two parts of SmolLM2's
    GGUF join into the pinned file and XSum arrives whole; a second call on a fresh machine (part 1
    gone) and a damaged part both leave the GGUF out instead of handing the check a wrong one."""
    from selfspec.store.assets import ASSETS, asset_path, check

    monkeypatch.setattr(bundle_module, "wheels", lambda dest, python: [])  # no PyPI in tests
    out = tmp_path / "gpu"
    manifest = bundle_module.bundle(out, True, "3.12")
    assert all(mib + manifest["mib"]["checkout"] <= 64 for name, mib in manifest["mib"].items() if name != "checkout")
    records = json.loads((out / "call2" / "sharegpt.json").read_text())
    assert len(records) == bundle_module.SHAREGPT_RECORDS and all(r["conversations"] for r in records)

    stage = tmp_path / "stage"  # what call 1 leaves on the machine
    stage.mkdir()
    for part in (out / "call1").iterdir():
        part.rename(stage / part.name)
    cache = tmp_path / "cache"
    assert bundle_module.join(out / "call2", stage, cache).endswith("joined, sha256 as pinned")
    assert check("smollm2-gguf", cache) is None and check("xsum", cache) is None
    name = asset_path("smollm2-gguf").name
    assert hashlib.sha256((cache / "smollm2-gguf" / name).read_bytes()).hexdigest() == ASSETS["smollm2-gguf"].files[name]

    fresh = tmp_path / "fresh"
    assert "is not here" in bundle_module.join(out / "call2", tmp_path / "gone", fresh)
    assert not (fresh / "smollm2-gguf").exists() and check("xsum", fresh) is None
    part2 = out / "call2" / f"{name}.part2"
    data = bytearray(part2.read_bytes())
    data[-1] ^= 1
    part2.write_bytes(bytes(data))
    assert bundle_module.join(out / "call2", stage, tmp_path / "damaged").endswith("not its pinned " + ASSETS["smollm2-gguf"].files[name] + ": left out")
    assert not (tmp_path / "damaged" / "smollm2-gguf").exists()


def test_the_device_script_parses_and_names_its_modes():
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_device.sh")]).returncode == 0
    usage = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_device.sh")], capture_output=True, text=True)
    assert usage.returncode == 2 and "stage | check" in usage.stderr


def test_every_package_the_bundle_carries_is_installed_here(bundle_module):
    """Each travels at this environment's version (the one the tests ran), so each must be here."""
    import importlib.metadata

    assert all(importlib.metadata.version(name) for name in bundle_module.PACKAGES)


def test_gpu_check_gives_its_sharegpt_file_to_the_prompts_and_tree_jobs(tmp_path, monkeypatch):
    """The lent machine has no ShareGPT asset (120 MiB): --sharegpt hands both jobs that read it a
    small file, and both compose and check with it; a missing file is refused before anything runs."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path / "outputs"))
    import gpu_check

    from selfspec.config import compose
    from selfspec.training import prompt_tuning

    with pytest.raises(SystemExit, match="--sharegpt .*missing.json: no such file"):
        gpu_check.main(["--dry-run", "--sharegpt", str(tmp_path / "missing.json"), "--out", str(tmp_path / "a.json")])
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": f"hi {i}"},
                                                                 {"from": "gpt", "value": "hello"}]}
                                for i in range(12)]))
    plans = []
    monkeypatch.setattr(gpu_check, "run_section", lambda section, result, loaded, p, *a: plans.append(p) or loaded)
    monkeypatch.setattr(gpu_check, "load_entry", lambda name, overrides, p: ({"model": {"overrides": overrides}}, "m"))
    assert gpu_check.main(["--dry-run", "--sections", "training", "--sharegpt", str(data),
                           "--out", str(tmp_path / "b.json")]) == 0
    job_data = plans[0]["job_data"]
    assert set(job_data) == {"prompts", "ppd_tree"} and all(f"job.data={data}" in o for o in job_data.values())
    cfg = compose(["model=tiny-random", "job=prompts", *job_data["prompts"]], config_name="train")
    assert prompt_tuning.prepare(cfg)["path"] == data
    cfg = compose(["model=tiny-random", "job=ppd_tree", *job_data["ppd_tree"]], config_name="train")
    assert prompt_tuning.sharegpt_path(cfg.job) == data
    # the tree validates on conversations after those the prompts job trained on and held out, and the
    # carried ones reach: 5 read by the prompts job, 2 by the tree, of the bundle's 64
    from gpu_bundle import SHAREGPT_RECORDS
    from measure_memory import BASE

    prompts = dict(o.split("=", 1) for o in BASE["prompts"])
    read = int(prompts["job.n_conversations"]) + int(prompts["job.held_out"])
    tree_prompts = int(dict(o.split("=", 1) for o in BASE["ppd_tree"])["job.n_prompts"])
    assert cfg.job.skip_conversations == read and read + tree_prompts <= SHAREGPT_RECORDS


def test_the_bundle_empties_only_an_earlier_bundle_and_the_device_script_checks_its_budget(bundle_module, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit, match="holds something else than an earlier bundle; not emptied"):
        bundle_module.bundle(tmp_path / "mine", False, "3.12")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_device.sh"), "check", "--dry-run"],
                         capture_output=True, text=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)})
    assert bad.returncode == 2 and "check BUDGET: whole seconds from 1 to 540" in bad.stderr
    assert "got '--dry-run'" in bad.stderr


def test_an_interrupted_bundle_is_emptied_by_the_next_run(bundle_module, tmp_path, monkeypatch):
    """Finding: a bundle stopped before its manifest (the last file) left a folder the next run refused as
    "something else than an earlier bundle", to be emptied by hand. The bundle marks its folder first now;
    a folder with that mark is emptied, one without it and without a manifest is still refused."""
    out = tmp_path / "bundle"

    class Stop(Exception):
        pass

    def stop(dest, python):
        raise Stop

    monkeypatch.setattr(bundle_module, "wheels", stop)
    with pytest.raises(Stop):  # the first run, stopped at its wheels (an interrupt, a full disk)
        bundle_module.bundle(out, False, "3.12")
    (out / "call2" / "cache").mkdir(parents=True)
    (out / "call2" / "cache" / "half-copied").write_text("x")
    assert not (out / "call2" / "manifest.json").exists()
    with pytest.raises(Stop):
        bundle_module.bundle(out, False, "3.12")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [bundle_module.STARTED]


def _device(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """scripts/gpu_device.sh run in ``tmp_path``, a checkout with no bundle carried into it."""
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_device.sh"), *args], capture_output=True, text=True,
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)}, timeout=60)


@pytest.mark.parametrize("budget", ["0", "541", "99999999999999999999", "0480", "-5", "4.5"])
def test_the_device_script_refuses_a_budget_its_call_cannot_hold_before_anything_runs(tmp_path, budget):
    """Issue 68's probe: ``check 0`` passed the script's own check, and 99999999999999999999 wrapped
    around in bash's arithmetic. A budget is whole seconds from 1 to 540: a device call runs at most
    600 s and the check gets its budget plus 60 s. Refused before pip or anything else runs."""
    bad = _device(tmp_path, "check", budget)
    assert bad.returncode == 2 and bad.stderr.strip() == (
        f"check BUDGET: whole seconds from 1 to 540 (a device call runs at most 600 s, the check its budget plus "
        f"60 s), got '{budget}'")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_device_script_without_a_bundle_names_the_commands_that_make_and_stage_it(tmp_path):
    """Issue 68's probe: ``check`` on a checkout the bundle was not carried into failed with pip's
    words (no wheel matched the glob); ``stage`` with cp's. Now each names what to run first."""
    check = _device(tmp_path, "check", "480")
    assert check.returncode == 2 and check.stderr.strip() == (
        "check: no bundle here (.gpu/call2/manifest.json): make it with `python scripts/gpu_bundle.py`, run "
        "`bash scripts/gpu_device.sh stage` with carry=['.gpu/call1'], then this check with carry=['.gpu/call2'] "
        "(docs/gpu.md)")
    stage = _device(tmp_path, "stage")
    assert stage.returncode == 2 and stage.stderr.strip() == (
        "stage: no part of the GGUF here (.gpu/call1/*.part1): make the bundle with `python scripts/gpu_bundle.py` "
        "and run this call with carry=['.gpu/call1'] (docs/gpu.md)")


def test_join_without_a_bundle_names_the_missing_file_and_what_makes_it(bundle_module, tmp_path):
    """Issue 68's probe: ``gpu_bundle.py --join`` with no bundle at its path gave a raw
    FileNotFoundError traceback; now one line names the file and the command that makes it."""
    with pytest.raises(SystemExit) as caught:
        bundle_module.main(["--join", str(tmp_path / "call2"), str(tmp_path / "stage"), str(tmp_path / "cache")])
    assert str(caught.value) == (f"gpu_bundle --join: {tmp_path / 'call2' / 'manifest.json'} is not there: make the "
                                 "bundle with `python scripts/gpu_bundle.py` and carry its .gpu/call2 with the call")
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("python", ["foo", "3", "3.9", "python3.12", "/usr/bin/python3", "3.12.1", ""])
def test_the_bundle_refuses_a_python_it_cannot_fetch_wheels_for(bundle_module, monkeypatch, capsys, python):
    """Issue 68's probe: ``--python foo`` was silently ignored: pip refused ``--python-version foo``
    for every package, and each wheel was then built for this interpreter instead. ``--python`` is
    the lent machine's CPython as MAJOR.MINOR (pip's ``--python-version``), 3.10 or newer
    (selfspec's requires-python); anything else is refused before the bundle is touched."""
    monkeypatch.setattr(bundle_module, "bundle", lambda *a: pytest.fail("the bundle was made"))
    with pytest.raises(SystemExit) as caught:
        bundle_module.main(["--python", python])
    assert caught.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"argument --python: the lent machine's CPython as MAJOR.MINOR, 3.10 or newer (3.12), got {python!r}")
    made = []
    monkeypatch.setattr(bundle_module, "bundle", lambda out, gguf, python: made.append(python) or {"mib": {}})
    assert bundle_module.main(["--python", "3.13"]) == 0 and made == ["3.13"]

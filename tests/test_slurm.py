"""``hydra/launcher=submitit_slurm`` against a real Slurm controller: a single-node cluster started on
this machine for the module (tests/slurm_cluster.py; ``make slurm`` installs Debian's slurm-wlm,
munge, slurmdbd and mariadb-server as root).

a 2 x 2 sweep (task x method) on tiny-random goes out as one job array, and one job is cancelled
midway (``scancel``); the launcher sees the cancel through submitit (sacct). Resubmitted into the same
sweep directory, the finished jobs generate nothing, the cancelled one resumes where it stopped, every
job of the second array completes on the node with its summary, and the report builds its tables from
the jobs' run directories. (One test: a sweep that only completes was a second test of its own, which
cost two more minutes and checked nothing the resubmission does not.)

Without those packages (or not as root) the tests skip with the reason; under CI=true they fail.
Each step is logged to ``outputs/slurm/test_slurm.log`` (job ids, states, rows), the daemons' logs
are copied next to it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_cluster import PACKAGES, SlurmCluster, SlurmError, missing

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

ROOT = Path(__file__).resolve().parents[1]
LOG_DIR = ROOT / "outputs" / "slurm"
LOG = LOG_DIR / "test_slurm.log"
TASKS, METHODS = ("xsum", "gsm8k"), ("vanilla", "ngram")


def note(line: str) -> None:
    """One line of the test's log (and of pytest's captured output)."""
    line = f"[{time.strftime('%H:%M:%S')}] {line}"
    print(line)
    with LOG.open("a") as f:
        f.write(line + "\n")


def require(ok: bool, reason: str) -> None:
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run the Slurm tests (`make slurm` installs {PACKAGES} as root)")
    pytest.skip(f"{reason}: run `make slurm` (as root: apt-get install {PACKAGES})")


@pytest.fixture(scope="module")
def slurm():
    require(not missing(), "Slurm is not installed: missing " + ", ".join(missing()))
    require(os.geteuid() == 0, "the test cluster runs its daemons as root")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    LOG.write_text("")
    cluster = SlurmCluster(log=note)
    try:
        cluster.start()
    except SlurmError as e:
        shutil.rmtree(cluster.root, ignore_errors=True)
        require(False, f"the Slurm daemons did not start: {e}")
    try:
        yield cluster
    finally:
        cluster.stop()
        for f in (cluster.root / "log").glob("*"):
            shutil.copy(f, LOG_DIR / f.name)
        shutil.rmtree(cluster.root, ignore_errors=True)


@pytest.fixture(scope="module")
def job_cache():
    """``SELFSPEC_CACHE`` for the jobs: the machine's cache (assets, profiles, the CPU kernels' build
    folder). The jobs once built the kernels in a cache of their own, so as not to wait on a shared
    folder another checkout might be rebuilding; since each environment has its own build folder
    (issue 52), that wait cannot happen, and the first two jobs spent about 35 s of the test building
    kernels this environment had built already."""
    from selfspec.store.assets import cache_dir

    return cache_dir()


@pytest.fixture(scope="module")
def job_profile(job_cache, tmp_path_factory) -> Path:
    """The jobs' cost profile, measured once before the sweep at their one thread (``make profile``,
    as docs/usage.md's cluster section asks of jobs sharing a CPU node): with ``profile=auto`` each
    job measured its own, two jobs running at once on the node spoiled each other's, so none was
    kept, and all eight jobs measured one (about 16 s each on a Zen 3)."""
    out = tmp_path_factory.mktemp("profile") / "tiny-random-1t.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"), SELFSPEC_CACHE=str(job_cache))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_runtime.py"), "--model", "tiny-random",
                           "--profile-only", "--threads", "1", "--repeats", "1", "--profile-out", str(out), "--",
                           "model.linear_kernel=torch"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and out.is_file(), (done.stdout + done.stderr)[-3000:]
    note(f"the jobs' cost profile: {out}")
    return out


def sweep_args(sweep: Path, n: int, profile: Path) -> list[str]:
    """The sweep: 2 tasks x 2 methods on tiny-random, n examples each, on the test node's
    resources (1 CPU, no GPU, 4 GB per job instead of the launcher's 8 CPUs, 1 GPU, 64 GB), priced
    with ``profile``. One warm-up generation per method, so that the first timed one does not include
    the kernels' build."""
    return ["-m", "model=tiny-random", "model.linear_kernel=torch", f"n_examples={n}", "max_new_tokens=96",
            f"profile={profile}",
            "warmup=1", "progress=false", f"task={','.join(TASKS)}", f"method={','.join(METHODS)}",
            "hydra/launcher=submitit_slurm", "hydra.launcher.partition=debug", "hydra.launcher.cpus_per_task=1",
            "hydra.launcher.gpus_per_node=null", "hydra.launcher.mem_gb=4", "hydra.launcher.timeout_min=30",
            f"hydra.sweep.dir={sweep}"]


def launcher(cluster: SlurmCluster, cache: Path, args: list[str], cwd: Path, **kw):
    """``python -m selfspec.evaluate <args>`` with the cluster's SLURM_CONF (which its jobs inherit
    through sbatch, with PYTHONPATH: the jobs import this checkout, and SELFSPEC_CACHE)."""
    env = dict(cluster.env, OMP_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", PYTHONPATH=str(ROOT / "src"), SELFSPEC_CACHE=str(cache))
    return [sys.executable, "-m", "selfspec.evaluate", *args], dict(cwd=cwd, env=env, **kw)


def run_dirs(sweep: Path) -> dict[int, Path]:
    """job number -> run directory (``<num>_<task>_<model>_<method>``)."""
    return {int(p.name.split("_")[0]): p for p in sweep.iterdir() if p.is_dir() and p.name[0].isdigit()}


def array_ids(sweep: Path) -> list[str]:
    """The job arrays submitit submitted into this sweep, oldest first (``.submitit/<array>_<task>``)."""
    ids = {m.group(1) for p in (sweep / ".submitit").iterdir() if (m := re.fullmatch(r"(\d+)_\d+", p.name))}
    return sorted(ids, key=int)


def rows(run: Path) -> list[str]:
    """Complete lines of the run's results.jsonl (a torn last line left out)."""
    path = run / "results.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    return text[: text.rfind("\n") + 1].splitlines()


def n_methods(run: Path) -> int:
    return 1 if run.name.endswith("_vanilla") else 2  # baseline vanilla (+ the method under test)


def finished_examples(lines: list[str], methods: int) -> int:
    keys = [json.loads(x) for x in lines]
    per_id: dict[str, int] = {}
    for r in keys:
        per_id[r["id"]] = per_id.get(r["id"], 0) + 1
    return sum(c == methods for c in per_id.values())


def job_log(sweep: Path, array: str, num: int) -> str:
    """What job ``<array>_<num>`` printed (submitit's stdout file, the run's log lines included)."""
    return (sweep / ".submitit" / f"{array}_{num}" / f"{array}_{num}_0_log.out").read_text()


def log_states(cluster: SlurmCluster, array: str, what: str) -> dict[str, dict[str, str]]:
    jobs = cluster.sacct(array)
    note(f"{what}: sacct -j {array}:")
    for jid, j in jobs.items():
        note(f"    {jid:>8} (job {j['JobIDRaw']:>3})  {j['State']:<16} exit {j['ExitCode']:<5} {j['Start']} -> {j['End']} "
             f"({j['Elapsed']}) on {j['NodeList']}")
    return jobs


def build_report(sweep: Path, out: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), WANDB_MODE="offline")
    done = subprocess.run([sys.executable, "-m", "selfspec.report", f"inputs=[{sweep}]", f"output_dir={out}",
                           "artefacts_dir=null", "wandb.enabled=false", "plots=false"],
                          cwd=sweep.parent, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (out / "tables" / "runs.md").read_text()
    for name in ("GSM8K", "XSum", "Vanilla", "N-gram lookup"):
        assert name in table, table
    note(f"report: {out / 'tables' / 'runs.md'}\n" + "\n".join(
        line for line in table.splitlines() if line.startswith("| ")))
    return table


@pytest.mark.timeout(3600)
def test_a_cancelled_job_resumes_when_the_sweep_is_resubmitted(slurm, job_cache, job_profile, tmp_path):
    # enough examples that the job cannot finish in the KillWait seconds between scancel's SIGTERM
    # (which submitit's jobs ignore) and the SIGKILL: with 12, a quiet machine decoding tiny-random at
    # ~900 tok/s finished the remaining ones in time and the "cancelled" job held every row. At 160
    # new tokens the cancelled job went on for 5 examples after scancel (2026-12-02); at 96, about 8
    # (the job is cancelled with at most n // 3 = 13 finished): 96 tokens, not 160, cost 40% less
    n = 40
    sweep = tmp_path / "sweep"
    cmd, kw = launcher(slurm, job_cache, sweep_args(sweep, n, job_profile), tmp_path)
    note("sweep (first submission): " + " ".join(cmd[1:]))
    out = tmp_path / "launcher-1.log"
    with out.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
    try:
        # midway: a job of the slower method (two methods per example) with at least one example
        # finished and well short of all of them (the job runs on for a few seconds after scancel:
        # submitit's jobs ignore SIGTERM, SIGKILL follows after slurm.conf's KillWait)
        deadline = time.monotonic() + 900
        victim = None
        while victim is None:
            assert proc.poll() is None, f"the launcher ended before a job could be cancelled:\n{out.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no job was seen midway"
            if (sweep / ".submitit").exists() and array_ids(sweep):
                for num, run in sorted(run_dirs(sweep).items()):
                    if n_methods(run) == 2 and 1 <= finished_examples(rows(run), 2) <= n // 3:
                        victim = num
                        break
            time.sleep(0.2)
        (array,) = array_ids(sweep)
        job = f"{array}_{victim}"
        run = run_dirs(sweep)[victim]
        at_cancel = len(rows(run))
        slurm.cmd("scancel", job)
        note(f"scancel {job} ({run.name}) at {at_cancel} of {n * n_methods(run)} rows")
        proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    launcher_out = out.read_text()
    said = re.search(r"UncompletedJobError: (Job \S+).*\n(has not produced any output \(state: [^)]*\))", launcher_out)
    assert proc.returncode != 0 and said, launcher_out[-3000:]  # submitit saw the job's end through sacct
    note(f"first launcher exited {proc.returncode}: UncompletedJobError: {said.group(1)} ... {said.group(2)}")
    assert said.group(1) == f"Job {job}" and "CANCELLED" in said.group(2)
    jobs = slurm.wait_ended(array, 4)
    log_states(slurm, array, "first submission")
    assert jobs[job]["State"].startswith("CANCELLED")
    assert all(j["State"] == "COMPLETED" for jid, j in jobs.items() if jid != job)

    dirs = run_dirs(sweep)
    before = {num: rows(d) for num, d in dirs.items()}
    cancelled_done = finished_examples(before[victim], n_methods(run))
    note(f"after the cancel: {run.name} holds {len(before[victim])} rows ({cancelled_done} of {n} examples), "
         + ("no summary" if not (run / "summary.json").exists() else "a summary"))
    assert 1 <= cancelled_done < n and not (run / "summary.json").exists()
    for num, d in dirs.items():
        if num != victim:
            assert len(before[num]) == n * n_methods(d)

    note("sweep resubmitted (same sweep dir, same overrides)")
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, **kw)
    assert done.returncode == 0, done.stderr[-4000:]
    again = [a for a in array_ids(sweep) if a != array]
    assert len(again) == 1
    second = again[0]
    slurm.wait_ended(second, 4)
    jobs = log_states(slurm, second, f"second submission (returned after {time.monotonic() - t0:.0f} s)")
    assert sorted(jobs) == [f"{second}_{i}" for i in range(4)]
    assert {j["State"] for j in jobs.values()} == {"COMPLETED"} and {j["NodeList"] for j in jobs.values()} == {slurm.node}
    dirs = run_dirs(sweep)
    assert sorted(dirs) == [0, 1, 2, 3]
    assert {d.name.split("_", 1)[1] for d in dirs.values()} == {f"{t}_tiny-random_{m}" for t in TASKS for m in METHODS}

    for num, d in sorted(dirs.items()):
        after, printed = rows(d), job_log(sweep, second, num)
        total = n * n_methods(d)
        resumed = re.search(r"resuming .*: \d+ of \d+ generations already in its results \((\d+) of (\d+) examples "
                            r"finished by every method\)", printed)
        assert resumed, printed[-3000:]
        keys = [(r["id"], r["sample"], r["method"]) for r in map(json.loads, after)]
        assert len(keys) == len(set(keys)) == total  # each (example, sample, method) once
        summary = json.loads((d / "summary.json").read_text())
        assert summary["n_examples"] == n and f"results in {d}" in printed
        note(f"job {second}_{num}: {d.name}: {len(after)} rows, "
             + ", ".join(f"{m} {s['tokens_per_s']:.0f} tok/s" for m, s in summary["methods"].items()))
        if num == victim:
            assert after[: len(before[num])] == before[num]  # the rows before the cancel are kept
            assert int(resumed.group(1)) == cancelled_done
            note(f"job {second}_{num} ({d.name}) resumed: {resumed.group(0)}; rows {len(before[num])} -> {len(after)}")
        else:
            assert after == before[num] and int(resumed.group(1)) == n  # finished: nothing generated
            note(f"job {second}_{num} ({d.name}) skipped: {resumed.group(0)}; rows {len(before[num])} -> {len(after)}")
    build_report(sweep, tmp_path / "report")

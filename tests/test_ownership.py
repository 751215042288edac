"""Issue 20: nothing lost, nothing forged. Run and artefact directories have one owner at a time,
a run resumes only its own records, nothing the framework did not write is changed, and damaged
artefacts and summaries are refused by name. Each test keeps the probe's reproduction in its
docstring and fails on the code before the issue."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from selfspec.config import compose
from selfspec.evaluation import RESULTS, ResumeMismatch, evaluate
from selfspec.evaluation.runner import RUN_CONFIG
from selfspec.store.artefacts import ArtefactError, read_meta
from selfspec.store.files import check_writable
from selfspec.store.locks import DirectoryBusy
from selfspec.tracking import ResultsFile, ResultsFileError

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model=tiny-random", "n_examples=2", "max_new_tokens=8", "warmup=0", "progress=false"]


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def holder(tmp_path):
    """Another process holding a directory's lock (selfspec.store.locks.hold) until the test ends."""
    procs = []

    def start(target: Path) -> subprocess.Popen:
        code = (f"import sys, time\nfrom selfspec.store.locks import hold\nwith hold({str(target)!r}, 'x'):\n"
                "    print('held', flush=True)\n    time.sleep(600)\n")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_a_second_evaluation_into_a_busy_run_directory_is_refused_at_once(tiny, tmp_path, holder):
    """Reproduction: the same ``python -m selfspec.evaluate ... hydra.run.dir=D`` started twice
    concurrently; both finished with rc 0 and results.jsonl held every (example, method) row twice.
    Now the second is refused before anything is read or written, naming the holder's pid and
    command; after the holder is gone the directory is free again."""
    run = tmp_path / "run"
    evaluate(compose(SMALL), run, loaded=tiny)
    before = _snapshot(run)
    proc = holder(run)
    with pytest.raises(DirectoryBusy, match=rf"run directory {run} is in use by pid {proc.pid} \(.*python.*\)"):
        evaluate(compose(SMALL), run, loaded=tiny)
    assert _snapshot(run) == before
    proc.kill()
    proc.wait()
    evaluate(compose(SMALL), run, loaded=tiny)  # resumes: every row is there, none twice
    rows = [json.loads(line) for line in (run / RESULTS).read_text().splitlines()]
    assert len(rows) == len({(r["id"], r["method"]) for r in rows}) == 2


def test_a_second_training_job_into_a_busy_artefact_directory_is_refused_before_the_model_loads(tmp_path, holder,
                                                                                               monkeypatch):
    """Reproduction: two training runs with different ``job.lr`` into one artefact directory both
    reported success and one result was silently lost. Now the second is refused at once (before
    its model loads), naming the holder."""
    from selfspec.models import loading
    from selfspec.store.locks import artefact_lock
    from selfspec.train import run_job

    out = tmp_path / "heads"
    proc = holder(artefact_lock(out))
    monkeypatch.setattr(loading, "load_model", lambda cfg: pytest.fail("the model loaded"))
    cfg = compose(["job=heads", "model=tiny-random", "job.lr=0.5", f"artefact_dir={out}"], "train")
    with pytest.raises(DirectoryBusy, match=rf"artefact directory {out} is in use by pid {proc.pid}"):
        run_job(cfg)
    assert not out.exists()


def _foreign_rows(path: Path, n_new: int, ids=("xsum-0", "xsum-1")) -> None:
    rows = [{"id": i, "method": m, "sample": 0, "tokens": [1] * n_new, "new_tokens": n_new, "seconds": 0.01,
             "steps": n_new, "prediction": "x", "lossless": True} for i in ids for m in ("vanilla",)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("ids", [("xsum-0", "xsum-1"), ("other-7", "other-8")])
def test_a_results_file_the_framework_did_not_record_is_refused_and_left_as_it_is(tiny, tmp_path, ids):
    """Reproduction: a results.jsonl with rows of another configuration (16 new tokens each) and no
    run_config.json was "resumed": summary.json recorded max_new_tokens=8 with another run's
    rows and tokens/s, rc 0; with rows of other example ids the run failed with a raw KeyError
    after writing run_config.json. Now both are refused and nothing in the directory changes."""
    run = tmp_path / "run"
    run.mkdir()
    _foreign_rows(run / RESULTS, 16, ids)
    before = _snapshot(run)
    with pytest.raises(ResumeMismatch, match=r"results.jsonl was not written by a selfspec run \(no run_config.json"):
        evaluate(compose(SMALL), run, loaded=tiny)
    assert _snapshot(run) == before


def test_invalid_lines_of_an_own_results_file_are_reported_not_skipped(tiny, tmp_path):
    """Reproduction: invalid lines of results.jsonl were skipped silently (their examples silently
    rerun, the file keeping the damage). Now the run is refused naming the lines; a torn last line
    (a crash mid-write) is still repaired."""
    run = tmp_path / "run"
    evaluate(compose(SMALL), run, loaded=tiny)
    lines = (run / RESULTS).read_text().splitlines(keepends=True)
    (run / RESULTS).write_text(lines[0] + "not json\n" + '{"id": "x"}\n' + lines[1][:10])
    before = _snapshot(run)
    with pytest.raises(ResultsFileError, match=r"line\(s\) 2, 3 are not rows selfspec wrote"):
        evaluate(compose(SMALL), run, loaded=tiny)
    assert _snapshot(run) == before
    (run / RESULTS).write_text(lines[0] + lines[1][:10])  # only a torn tail: repaired, resumed
    evaluate(compose(SMALL), run, loaded=tiny)
    again = [json.loads(line) for line in (run / RESULTS).read_text().splitlines()]
    assert [(r["id"], r["tokens"]) for r in again] == [(r["id"], r["tokens"]) for r in map(json.loads, lines)]


def test_nothing_outside_the_run_is_truncated_or_appended_through_a_symlink(tiny, tmp_path):
    """Reproduction: the tail repair removed a foreign file's last line when it had no newline;
    with results.jsonl a symlink, it truncated and appended to the symlink's target. Now a foreign
    file is refused (above) and a symlink is refused; neither file changes."""
    target = tmp_path / "elsewhere.jsonl"
    target.write_text('{"a": 1}\n{"half": ')
    run = tmp_path / "run"
    run.mkdir()
    (run / RESULTS).symlink_to(target)
    with pytest.raises(ResumeMismatch, match="is a symlink"):
        evaluate(compose(SMALL), run, loaded=tiny)
    assert target.read_text() == '{"a": 1}\n{"half": '
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / RESULTS).write_text('{"a": 1}\n{"half": ')
    with pytest.raises(ResumeMismatch, match="not written by a selfspec run"):
        evaluate(compose(SMALL), foreign, loaded=tiny)
    assert (foreign / RESULTS).read_text() == '{"a": 1}\n{"half": '


@pytest.mark.parametrize("kind", ["fifo", "directory", "hard link"])
def test_only_a_regular_file_with_one_link_is_read_or_appended(tiny, tmp_path, kind):
    """Issue 39's probe: a FIFO where results.jsonl should be hung the run for good (in
    ResultsFile.__iter__), a directory gave a raw IsADirectoryError, and a hard link to another
    run's file was appended to (4 -> 6 lines). Each is refused by name before the model runs, the
    other file untouched; ResultsFile alone refuses them too, without blocking."""
    done = tmp_path / "done"
    evaluate(compose(SMALL), done, loaded=tiny)
    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_CONFIG).write_bytes((done / RUN_CONFIG).read_bytes())
    results = run / RESULTS
    if kind == "fifo":
        os.mkfifo(results)
    elif kind == "directory":
        results.mkdir()
    else:
        os.link(done / RESULTS, results)
    before = (done / RESULTS).read_bytes()
    what = {"fifo": "is a FIFO", "directory": "is a directory",
            "hard link": r"has 2 hard links \(it shares its lines with another file\)"}[kind]
    with pytest.raises(ResumeMismatch, match=f"{RESULTS} {what}; selfspec writes only files it created"):
        evaluate(compose(SMALL), run, loaded=tiny)
    with pytest.raises(ResultsFileError, match=f"{RESULTS} {what}; selfspec reads and appends only"):
        ResultsFile(results).rows()
    with pytest.raises(ResultsFileError, match=what):
        ResultsFile(results).append({"id": "x"})
    assert (done / RESULTS).read_bytes() == before


def test_rows_of_examples_outside_the_selection_stay_out_of_the_summary(tiny, tmp_path):
    """A rerun of the framework's own run with fewer examples (n_examples is not part of a run's
    identity) resumes; the rows of the examples it no longer selects stay in the file but not in
    its summary (before: a raw KeyError from the task's references)."""
    run = tmp_path / "run"
    evaluate(compose(SMALL + ["n_examples=3"]), run, loaded=tiny)
    s = evaluate(compose(SMALL), run, loaded=tiny)
    assert s["methods"]["vanilla"]["n_examples"] == 2 == s["n_examples"]
    assert len((run / RESULTS).read_text().splitlines()) == 3


def test_a_read_only_run_directory_is_refused_with_its_name():
    """Reproduction: a read-only run directory reported ``Unable to configure handler 'file'``
    (Hydra's log file). Now the log file opens only once the run owns its directory
    (conf/hydra/job_logging/selfspec.yaml), and the directory is checked by name before the model
    loads. Root may write anywhere, so as root the check runs as nobody: in a forked child that
    drops to nobody's user and groups, with selfspec already imported, so a checkout nobody cannot
    read (one cloned into a 0700 directory, as ``.ci/run`` does) is no obstacle."""
    with read_only_dir() as ro:
        base = ro.parent

        def check():
            assert os.access(ro, os.R_OK | os.X_OK), "the directory must be reachable: only writing is denied"
            check_writable(ro, "the run directory (hydra.run.dir=...)")

        message = as_another_user(check)
        assert message == (f"PermissionError: cannot write to {ro} (Permission denied): choose a writable "
                           "directory for the run directory (hydra.run.dir=...)")
        check_writable(base, "x")  # a writable one passes, leaving nothing behind
        assert sorted(p.name for p in base.iterdir()) == ["ro"]


@contextlib.contextmanager
def read_only_dir():
    """A directory ``ro`` that another user may enter and read but not write, in a world-traversable
    temporary directory (pytest's tmp_path lies in a 0700 directory of root's); removed after."""
    base = Path(tempfile.mkdtemp(prefix="selfspec-ro-"))
    try:
        base.chmod(0o755)
        ro = base / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        yield ro
    finally:
        shutil.rmtree(base)


def as_another_user(call) -> str | None:
    """Run ``call`` in a forked child as a user without root's rights (nobody, when the tests run
    as root; else the same user) and return the exception it raised as ``"Type: message"`` (None:
    it raised none). The child shares the parent's loaded modules, so it reads nothing from the
    checkout."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, and leave without running the parent's cleanup
        os.close(read)
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                assert os.geteuid() == 65534
            call()
            report = b""
        except BaseException as err:  # noqa: BLE001 - everything goes back to the parent
            report = f"{type(err).__name__}: {err}".encode()
        os.write(write, report)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        report = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return report.decode() or None


def test_a_refused_rerun_through_the_entry_point_leaves_the_directory_untouched(tmp_path):
    """The refusal through ``python -m selfspec.evaluate``: Hydra's job log (evaluate.log) is not
    written into a directory the run does not own."""
    run = tmp_path / "run"
    run.mkdir()
    _foreign_rows(run / RESULTS, 16)
    before = _snapshot(run)
    out = subprocess.run([sys.executable, "-m", "selfspec.evaluate", *SMALL, f"hydra.run.dir={run}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "not written by a selfspec run" in out.stderr + out.stdout
    assert _snapshot(run) == before


# --- artefacts --------------------------------------------------------------------------------
@pytest.fixture
def heads_artefact(tiny, tmp_path):
    from selfspec.models.heads import IntermediateHeads, save_heads

    heads = IntermediateHeads(tiny.model, [0, 1, 2])
    return save_heads(tmp_path / "heads", heads, tiny, metrics={"kl": float("nan")})


def test_a_truncated_artefact_is_refused_naming_it_and_how_to_rebuild(tiny, heads_artefact):
    """Reproduction: a heads artefact with truncated safetensors gave a raw ``SafetensorError``
    that did not name the artefact."""
    from selfspec.models.heads import load_heads

    tensors = heads_artefact / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:200])
    with pytest.raises(ArtefactError, match=rf"heads artefact {heads_artefact}: tensors.safetensors cannot be read "
                                            r".*rebuild it with `python -m selfspec.train job=heads"):
        load_heads(heads_artefact, tiny)


def test_head_tensors_are_tied_to_their_layers(tiny, heads_artefact):
    """Reproduction: a heads artefact whose meta.json layers were permuted (``[2, 1, 0]``) was
    accepted. Tensors are named by layer; meta.json must list exactly those layers, increasing."""
    from selfspec.models.heads import load_heads

    meta = json.loads((heads_artefact / "meta.json").read_text())
    for layers, why in (([2, 1, 0], "not distinct and increasing"), ([0, 1, 3], r"tensors .* are not the layers")):
        (heads_artefact / "meta.json").write_text(json.dumps({**meta, "layers": layers}))
        with pytest.raises(ArtefactError, match=why):
            load_heads(heads_artefact, tiny)


def test_artefact_metadata_is_strict_json(tiny, heads_artefact):
    """Reproduction: a metric of NaN was written to meta.json as ``NaN``, which is not JSON for other
    readers. Now it is written as null, and a meta.json holding NaN is refused by name."""
    text = (heads_artefact / "meta.json").read_text()
    assert "NaN" not in text and json.loads(text)["metrics"]["kl"] is None
    (heads_artefact / "meta.json").write_text(text.replace('"kl": null', '"kl": NaN'))
    with pytest.raises(ArtefactError, match=r"meta.json is not valid JSON \(NaN is not a finite number\)"):
        read_meta(heads_artefact)


# --- the report -------------------------------------------------------------------------------
@pytest.mark.parametrize("summary, field", [
    ([], "the top level is list, not an object"),
    ({"methods": {"vanilla": {"tokens_per_s": "fast", "speedup": 1.0}}},
     "field 'methods.vanilla.tokens_per_s' is 'fast', not a number"),
    ({"methods": {"vanilla": {"lossless": "yes"}}}, "field 'methods.vanilla.lossless' is 'yes', not true or false"),
    # issue 39's probe: one malformed spoiled record aborted the whole report (KeyError: 'excess')
    ({"methods": {"vanilla": {"speedup": 1.0}}, "contention": {"ratio": 1.0, "threshold": 1.5, "flagged": True,
                                                             "spoiled": [{"method": "vanilla", "id": "a"}]}},
     "field 'contention.spoiled[0]' lacks a number 'excess'"),
    ({"methods": {"vanilla": {"speedup": 1.0}}, "contention": {"ratio": "high", "flagged": True}},
     "field 'contention.ratio' is 'high', not a number"),
])
def test_malformed_summaries_are_skipped_with_one_line_naming_file_and_field(tmp_path, caplog, summary, field):
    """Reproduction: a summary.json holding ``[]`` raised a raw AttributeError; ``tokens_per_s:
    "fast"`` was shown as ``fast (1.00×)``; a directory with no usable summary gave "0 tables"
    silently. Now each is skipped with a line naming the file and the field, and an empty report
    says it found nothing."""
    from selfspec.reporting.build import build_report

    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(summary))
    with caplog.at_level("WARNING"):
        result = build_report([tmp_path / "runs"], tmp_path / "report", None, make_plots=False)
    assert not result.records and not result.tables
    assert f"skipping {run / 'summary.json'}: {field}" in caplog.text
    assert "nothing to report: no readable evaluation summary (summary.json) under" in caplog.text


def _report(tmp_path, caplog):
    from selfspec.reporting.build import build_report

    with caplog.at_level("WARNING"):
        return build_report([tmp_path / "runs"], tmp_path / "report", None, make_plots=False)


def _summary_of(method: str = "vanilla", speedup: float = 1.0, **config) -> dict:
    cfg = {"model": {"name": "m"}, "task": {"name": "xsum"}, "method": {"name": method}, "baseline": "vanilla",
           "sampling": {"temperature": 0.0}, **config}
    return {"format": 2, "model": "m", "task": "xsum", "method": method, "baseline": "vanilla", "config": cfg,
            "method_configs": {"vanilla": {"name": "vanilla"}, method: cfg["method"]}, "run_info": {},
            "methods": {"vanilla": {"speedup": 1.0, "tokens_per_s": 10.0},
                        method: {"speedup": speedup, "tokens_per_s": 10.0 * speedup}}}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "character device", "too large"])
def test_report_reads_only_regular_summaries_of_bounded_size(tmp_path, caplog, monkeypatch, kind):
    """Issue 52's probe: a summary.json that is a FIFO hung ``report`` for good, and one linked to
    /dev/zero grew memory until the host ran out (only ``evaluate`` checked its files). Now every
    file the report reads is a regular file of at most store.files.READ_LIMIT bytes; another is
    skipped with a line naming it (here /dev/null stands for /dev/zero: both are character devices,
    and reading /dev/null cannot exhaust memory when the check is missing)."""
    from selfspec.store import files

    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    path = run / "summary.json"
    if kind == "fifo":
        os.mkfifo(path)
        why = "is a FIFO"
    elif kind == "character device":
        path.symlink_to("/dev/null")
        why = "is a character device"
    else:
        path.write_text(json.dumps(_summary_of()))
        monkeypatch.setattr(files, "READ_LIMIT", 64)
        why = f"holds {path.stat().st_size} bytes, more than the 64 selfspec reads"
    result = _report(tmp_path, caplog)
    assert not result.records
    assert f"skipping {path}: {path} {why}" in caplog.text


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_summary_holding_a_number_that_is_not_finite_is_skipped(tmp_path, caplog, value):
    """Issue 52's probe: NaN or Infinity in a summary.json was reported as a result ("inf× faster
    than vanilla"). selfspec writes null where a figure is not finite, so such a summary is not one
    it wrote: skipped with a line naming the file and the value."""
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(_summary_of("ngram", speedup=2.0)).replace('"speedup": 2.0',
                                                                                          f'"speedup": {value}'))
    result = _report(tmp_path, caplog)
    assert not result.records
    assert f"skipping {run / 'summary.json'}: {value} is not a finite number" in caplog.text


def test_a_foreign_summary_cannot_pull_the_environment_into_the_report(tmp_path, caplog, monkeypatch):
    """Issue 52's probe: a summary's config was resolved with OmegaConf's resolvers, oc.env among them,
    so ``"${oc.env:PROBE_SECRET}"`` in its report.variant put the reporting user's variable into
    index.html, report.md and the log. Now only interpolations between the config's own keys are
    resolved; a resolver call (``${name:...}``), also one reached through them, stays as it is written."""
    monkeypatch.setenv("PROBE_SECRET", "s3cr3t-value")
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    summary = _summary_of("ngram", speedup=2.0, report={"table": "dv_text", "variant": "${oc.env:PROBE_SECRET}"})
    summary["config"]["other"] = {"secret": "${oc.env:PROBE_SECRET}", "k": 4}
    summary["config"]["method"]["label"] = "K=${other.k} ${other.secret} \\${x}"
    (run / "summary.json").write_text(json.dumps(summary))
    result = _report(tmp_path, caplog)
    (record,) = [r for r in result.records if r.method == "ngram"]
    assert record.variant == "${oc.env:PROBE_SECRET}"
    assert record.config["method"]["label"] == "K=4 ${oc.env:PROBE_SECRET} ${x}"
    written = [p.read_text() for p in result.out_dir.rglob("*") if p.is_file() and p.suffix in (".html", ".md")]
    assert written and not any("s3cr3t-value" in text for text in written)
    assert "s3cr3t-value" not in caplog.text


@pytest.mark.parametrize("name,text,why", [
    ("overrides.yaml", "[unclosed", "is not YAML"),
    ("overrides.yaml", "a: 1\n", "is not a list of overrides"),
    ("hydra.yaml", "{oops", "is not YAML"),
])
def test_a_malformed_hydra_record_skips_its_run_only(tmp_path, caplog, name, text, why):
    """Issue 52's probe: one malformed .hydra/overrides.yaml aborted the whole report (it was read
    outside the path that skips one unreadable run). Now that run is skipped with a line naming the
    file, and the others are reported."""
    for run in ("bad", "good"):
        (tmp_path / "runs" / run).mkdir(parents=True)
        (tmp_path / "runs" / run / "summary.json").write_text(json.dumps(_summary_of("ngram", speedup=2.0)))
    hydra = tmp_path / "runs" / "bad" / ".hydra"
    hydra.mkdir()
    (hydra / name).write_text(text)
    result = _report(tmp_path, caplog)
    assert {r.provenance["source"] for r in result.records} == {str(tmp_path / "runs" / "good")}
    assert f"skipping {tmp_path / 'runs' / 'bad'}: {hydra / name} {why}" in caplog.text


def test_a_directory_that_cannot_be_made_is_refused_by_key_before_anything_is_written(tmp_path):
    """Issue 39's probe: a run or artefact directory at an existing file, or under a read-only
    parent, gave a raw FileExistsError / OSError naming no key; the artefact's lock file was created
    before the writability check. Now the directory is checked first, by key, and nothing is left."""
    from selfspec.store.files import check_directory

    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(FileExistsError, match=f"artefact_dir={afile} is an existing file, not a directory"):
        check_directory(afile, "artefact_dir")
    with pytest.raises(NotADirectoryError, match=f"hydra.run.dir={afile / 'run'} lies under the file {afile}"):
        check_directory(afile / "run", "hydra.run.dir")
    check_directory(tmp_path / "new" / "deeper", "artefact_dir")  # makes nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    with read_only_dir() as ro:
        message = as_another_user(lambda: check_directory(ro / "A" / "B", "artefact_dir"))
        assert message == (f"PermissionError: cannot write to {ro} (Permission denied): choose a writable "
                           "directory for artefact_dir")


def test_training_into_a_file_is_refused_before_the_lock_or_the_model(tmp_path, monkeypatch):
    from selfspec.models import loading
    from selfspec.train import run_job

    monkeypatch.setattr(loading, "load_model", lambda cfg: (_ for _ in ()).throw(AssertionError("loaded")))
    afile = tmp_path / "A"
    afile.write_text("mine")
    cfg = compose(["job=heads", "model=tiny-random", "logger=none", "progress=false", f"artefact_dir={afile}"],
                  "train")
    with pytest.raises(FileExistsError, match=f"artefact_dir={afile} is an existing file"):
        run_job(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["A"] and afile.read_text() == "mine"  # no lock file


def test_evaluating_into_a_file_is_refused_before_the_model(tmp_path, monkeypatch):
    from selfspec.evaluation import evaluate
    from selfspec.models import loading

    monkeypatch.setattr(loading, "load_model", lambda cfg: (_ for _ in ()).throw(AssertionError("loaded")))
    afile = tmp_path / "run"
    afile.write_text("mine")
    cfg = compose(["model=tiny-random", "task=xsum", "n_examples=1", "logger=none", "progress=false"])
    with pytest.raises(FileExistsError, match=f"hydra.run.dir={afile} is an existing file"):
        evaluate(cfg, afile)
    with pytest.raises(NotADirectoryError, match=f"hydra.run.dir={afile / 'x'} lies under the file"):
        evaluate(cfg, afile / "x")


def test_the_command_line_refuses_a_run_directory_at_a_file_before_hydra_makes_it(tmp_path):
    """``hydra.run.dir=<a file>``: Hydra makes the run directory before any selfspec code runs, and
    failed with a raw FileExistsError; the command line is checked first."""
    afile = tmp_path / "run"
    afile.write_text("mine")
    proc = subprocess.run([sys.executable, "-m", "selfspec.evaluate", "model=tiny-random", "task=xsum",
                           "logger=none", f"hydra.run.dir={afile}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (f"FileExistsError: hydra.run.dir={afile} is an existing file, "
                                                    "not a directory: choose a directory")
    assert afile.read_text() == "mine"


@pytest.mark.parametrize("error,said,remedy", [
    ("ENOSPC", "no space left on the device writing", "free some space"),
    ("EFBIG", "the file-size limit stopped writing", r"raise the limit \(ulimit -f\)"),
])
def test_a_full_disk_names_the_file_and_loses_nothing(tmp_path, monkeypatch, error, said, remedy):
    """Issue 39's probe: a full disk gave a raw ``OSError [Errno 28]`` naming no file (nothing was
    lost, and the run resumed). Each write now names its file; what was there stays. Issue 68's:
    under ``ulimit -f`` a write ended in a raw ``OSError [Errno 27] File too large`` naming no file;
    the limit is now said the same way, with ``ulimit -f`` to raise."""
    import errno

    from selfspec.store.files import write_json

    results = ResultsFile(tmp_path / "results.jsonl")
    results.append({"id": "a"})
    write_json(tmp_path / "summary.json", {"n": 1})

    def full(*args, **kwargs):
        raise OSError(getattr(errno, error), os.strerror(getattr(errno, error)))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=f"{said} {tmp_path / 'results.jsonl'} .*: {remedy} and "
                                      r"run the same command again \(a run resumes where it stopped\)"):
        results.append({"id": "b"})
    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match=f"{said} {tmp_path / 'summary.json'}"):
        write_json(tmp_path / "summary.json", {"n": 2})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"n": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl", "summary.json"]  # no temporary left


def test_a_full_disk_is_said_once(monkeypatch):
    """Issue 52's probe: on a full disk the results file was named, but the last line printed was a
    second raw OSError from closing it (the runner closes it in its ``finally``): the row stayed in
    the file object's buffer, and closing wrote it again. Now a row goes to the file in one write,
    nothing is held back, and closing after a failed append has nothing left to write. (/dev/full,
    whose every write fails with ENOSPC, stands for the full disk.)"""
    import selfspec.tracking.local as local

    monkeypatch.setattr(local, "not_plain", lambda info: None)  # /dev/full is a character device
    results = ResultsFile("/dev/full", ("id",))
    monkeypatch.setattr(results, "_repair_tail", lambda: None)  # /dev/full reads as endless zeros
    with pytest.raises(OSError, match=r"no space left on the device writing /dev/full"):
        results.append({"id": "a"})
    results.close()


@pytest.mark.parametrize("built", [True, False])
def test_a_read_only_warm_kernel_cache_is_used_without_its_build_lock(built):
    """Issue 39's probe: a read-only warm cache could not be used at all, even with
    model.linear_kernel=torch (the row-wise attention kernel takes the build lock, which a reader
    cannot create). Now the library built there is loaded as it is; with none, the kernel is
    unavailable with a message that names the folder (the callers fall back to torch's ops)."""
    import torch

    import selfspec.store.assets  # noqa: F401  the child as another user may not read the checkout
    import selfspec.store.locks  # noqa: F401
    import torch.utils.cpp_extension  # noqa: F401
    from selfspec.models import kernels

    base = Path(tempfile.mkdtemp(prefix="selfspec-ro-cache-"))
    try:
        base.chmod(0o755)
        folder = base / "kernels" / kernels.build_name()
        folder.mkdir(parents=True)
        if built:
            (folder / "selfspec_skinny.so").write_bytes(b"a build")
        for d in (folder, folder.parent, base):
            d.chmod(0o555)
        loaded: list[str] = []

        def use():
            os.environ["SELFSPEC_CACHE"] = str(base)
            kernels.load.cache_clear()
            torch.ops.load_library = loaded.append  # the child's own copy: nothing is loaded for real
            kernels.load()
            assert loaded == [str(folder / "selfspec_skinny.so")], loaded

        message = as_another_user(use)
        if built:
            assert message is None
        else:
            assert message == (f"KernelUnavailable: the kernel cache {folder} cannot be written (Permission denied) "
                               "and holds no build of these sources: build it once where it can be written (make "
                               "install), or set SELFSPEC_CACHE to a writable directory")
    finally:
        for d in (base, base / "kernels", base / "kernels" / kernels.build_name()):
            if d.exists():
                d.chmod(0o755)
        shutil.rmtree(base)


#: the only places that write a file in place, and why a torn write there cannot be read as whole
IN_PLACE = {
    ("src/selfspec/metrics/sandbox.py", "Path(workdir, 'program.py')"): "the sandbox's own fresh folder, removed after the run",
    ("src/selfspec/models/kernels.py", "copy"): "the kernels' staged sources, under the build lock, rewritten when their bytes differ",
    ("src/selfspec/store/assets.py", "staged / MARKER"): "a staging folder renamed into place whole",
    ("src/selfspec/store/artefacts.py", "tmp / META"): "a staging folder renamed into place whole",
    ("src/selfspec/measure/peak.py", "Path('/proc/self/clear_refs')"): "not a file: the kernel's switch",
    ("scripts/gpu_bundle.py", "out / STARTED"): "the bundle's fresh folder, the first file in it",
    ("scripts/gpu_bundle.py", "call2 / 'sharegpt.json'"): "the bundle's fresh folder; its manifest, written last, marks it whole",
    ("scripts/gpu_bundle.py", "out / 'call1' / f'{path.name}.part1'"): "the bundle's fresh folder (as above)",
    ("scripts/gpu_bundle.py", "call2 / f'{path.name}.part2'"): "the bundle's fresh folder (as above)",
}


def test_every_file_is_written_atomically_or_named_with_its_reason():
    """Finding: five scripts wrote their JSON with a bare ``write_text(json.dumps(...))`` (a non-finite
    figure became ``Infinity``, which the readers refuse, and an interrupted write left half a file), and
    the report's pages, the HumanEval samples and the heads' sequence cache were written in place too.
    Every write of src/ and scripts/ now goes through :mod:`selfspec.store.files` (``write_text``,
    ``write_json``: a temporary file of its own, renamed; non-finite figures null) but those of
    :data:`IN_PLACE`, each with the reason a torn write cannot be read as whole."""
    import ast

    found, seen = [], set()
    for path in [*(ROOT / "src").rglob("*.py"), *(ROOT / "scripts").glob("*.py")]:
        rel = path.relative_to(ROOT).as_posix()
        if rel == "src/selfspec/store/files.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            f = node.func
            if f.attr in ("write_text", "write_bytes") or (f.attr == "dump" and ast.unparse(f.value) == "json"):
                key = (rel, ast.unparse(f.value))
                if key in IN_PLACE:
                    seen.add(key)
                else:
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:100]}")
    assert not found, "written in place (use selfspec.store.files.write_text/write_json):\n" + "\n".join(found)
    assert seen == set(IN_PLACE), f"IN_PLACE names writes that are gone: {set(IN_PLACE) - seen}"


def test_a_json_figure_that_is_not_finite_is_written_as_null(tmp_path):
    from selfspec.store.files import write_json

    path = write_json(tmp_path / "figures.json", {"ratio": float("inf"), "nan": float("nan"), "ok": [1.5, -float("inf")]})
    assert json.loads(path.read_text()) == {"ratio": None, "nan": None, "ok": [1.5, None]}
    assert [p.name for p in tmp_path.iterdir()] == ["figures.json"]  # no temporary file left


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_what_is_written_atomically_has_a_plain_writes_permissions(tiny, tmp_path, umask):
    """Finding: ``write_text`` took its temporary file from ``tempfile.mkstemp`` (0o600) and an artefact its
    folder from ``mkdtemp`` (0o700), so every summary, report page, artefact and checkpoint was unreadable
    to the rest of a team sharing ``outputs/`` whatever their umask said. Now each has the permissions a
    plain write or ``mkdir`` would give under the umask."""
    import torch

    from selfspec.store.artefacts import save_artefact
    from selfspec.store.files import write_json
    from selfspec.training.loop import _save_checkpoint

    old = os.umask(umask)
    try:
        page = write_json(tmp_path / "summary.json", {"a": 1})
        art = save_artefact(tmp_path / "heads", "heads", {"w": torch.zeros(2)}, tiny, kernel_paths={})
        _save_checkpoint(tmp_path / "ckpt", {"step": 1})
        plain_file, plain_dir = tmp_path / "plain.txt", tmp_path / "plain"
        plain_file.write_text("x")
        plain_dir.mkdir()
    finally:
        os.umask(old)
    mode = lambda p: p.stat().st_mode & 0o777  # noqa: E731
    assert mode(plain_file) == 0o666 & ~umask and mode(plain_dir) == 0o777 & ~umask
    assert {mode(p) for p in (page, art / "meta.json", art / "tensors.safetensors", tmp_path / "ckpt" / "checkpoint.pt")
            } == {mode(plain_file)}
    assert mode(art) == mode(plain_dir)

"""W&B, read back: the offline runs the demo wrote hold the resolved config, the summary metrics,
the per-example table and the artefact lineage, and the dashboard's panels point at keys they write.

The runs are read from wandb's own files: the ``run-<id>.wandb`` transaction log (LevelDB's log
format, as wandb's datastore writes it: 32 KiB blocks of records with a 7-byte header, after a
7-byte file header ``:W&B``, magic ``0xBEE1``, version 0), each record decoded with wandb's
protobuf ``wandb.proto.wandb_internal_pb2.Record``; tables from the run's ``files/`` folder.
wandb 0.31 ships no Python reader for these logs (``wandb sync --view`` is gone), hence the reader here.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

from selfspec.tracking import artifact_name

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4
TASKS = ("xsum", "cnndm", "humaneval", "gsm8k", "mtbench")
#: the demo's training jobs (run directories under train/) and the artefact kind each logs
TRAINING = {"heads": "heads", "skips": "skip_set", "prompts": "prompts", "ppd_tree": "ppd_tree"}


def records(path: Path) -> Iterator[Any]:
    """Every record of a ``.wandb`` transaction log, checksums checked."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:HEADER]) == (b":W&B", 0xBEE1, 0), f"{path}: not a W&B log"
    pos, parts = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0:  # zeroed: the end of what was written
            break
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad checksum at {pos}"
        parts = chunk if kind in (FULL, FIRST) else parts + chunk
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def _put(target: dict, item) -> None:
    """One config/summary/history item (``key`` or ``nested_key``, ``value_json``) into ``target``."""
    *parents, last = list(item.nested_key) or [item.key]
    for name in parents:
        target = target.setdefault(name, {})
    target[last] = json.loads(item.value_json)


@dataclass
class OfflineRun:
    """An offline run as wandb wrote it: the run record, config, summary, history rows, artefacts."""

    dir: Path
    run: Any = None
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    artifacts: list[Any] = field(default_factory=list)

    def table(self, name: str) -> dict:
        """A logged ``wandb.Table`` (``{"columns", "data"}``), from the run's files."""
        (ref,) = [row[name] for row in self.history if name in row]
        assert ref["_type"] == "table-file"
        return json.loads((self.dir / "files" / ref["path"]).read_text())

    @property
    def history_keys(self) -> set[str]:
        return {k for row in self.history for k in row if not k.startswith("_")}


def read_offline_run(job_dir: Path) -> OfflineRun:
    """The one offline run W&B wrote under ``job_dir/wandb/``."""
    (run_dir,) = (job_dir / "wandb").glob("offline-run-*")
    run = OfflineRun(run_dir)
    for record in records(next(run_dir.glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run = record.run
            for item in record.run.config.update:
                _put(run.config, item)
        elif kind == "config":
            for item in record.config.update:
                _put(run.config, item)
        elif kind == "summary":
            for item in record.summary.update:
                _put(run.summary, item)
        elif kind == "history":
            row: dict = {}
            for item in record.history.item:
                _put(row, item)
            run.history.append(row)
        elif kind == "artifact":
            run.artifacts.append(record.artifact)
    assert run.run is not None, f"{run_dir}: no run record"
    return run


@pytest.fixture(scope="module")
def wandb_runs(demo_run):
    """``{"eval": {(task, temperature): (run dir, OfflineRun)}, "train": {job: OfflineRun}}`` of the
    demo (greedy runs of every task and the sampling runs of the tasks it samples)."""
    evals = {}
    for job_dir in sorted((demo_run.run_dir / "eval").iterdir()):
        summary = json.loads((job_dir / "summary.json").read_text())
        key = (summary["task"], summary["config"]["sampling"]["temperature"])
        assert key not in evals, f"two evaluation runs of {key}"
        evals[key] = (job_dir, read_offline_run(job_dir))
    train = {job: read_offline_run(demo_run.run_dir / "train" / job) for job in TRAINING}
    return {"eval": evals, "train": train}


def test_evaluation_runs_hold_config_summary_and_examples(wandb_runs):
    assert {task for task, _ in wandb_runs["eval"]} == set(TASKS)
    for (task, _), (job_dir, run) in wandb_runs["eval"].items():
        summary = json.loads((job_dir / "summary.json").read_text())
        assert run.run.job_type == "evaluate" and run.run.run_group.startswith("demo-")
        assert {"model:tiny-random", "method:adadecode", f"task:{task}", "job:evaluate"} <= set(run.run.tags)
        # the resolved config, as the runner used it, and the method's config label
        for key, value in summary["config"].items():
            assert run.config[key] == value, f"{task}: config {key}"
        assert run.config["method_label"] == "adadecode" and run.config["task"]["name"] == task
        # the summary: every figure of every method, flattened as methods/<label>/<figure>
        for label, figures in summary["methods"].items():
            for name in ("tokens_per_s", "speedup", "tau", "acceptance_rate", "consistency", "lossless"):
                assert run.summary[f"methods/{label}/{name}"] == figures[name], f"{task} {label} {name}"
            for name, value in figures["metrics"].items():
                assert run.summary[f"methods/{label}/metrics/{name}"] == value
        assert run.summary["method"] == "adadecode"
        # the per-example table: one row per example and method, as results.jsonl
        table = run.table("examples")
        rows = [json.loads(line) for line in (job_dir / "results.jsonl").read_text().splitlines()]
        got = [dict(zip(table["columns"], row)) for row in table["data"]]
        assert sorted((r["id"], r["method"], r["new_tokens"]) for r in got) == \
            sorted((r["id"], r["method"], r["new_tokens"]) for r in rows)
        assert {r["method"] for r in got} == set(summary["methods"])


def _digests(path: Path) -> dict[str, str]:
    """W&B manifest digests (base64 of the MD5) of the files under an artefact directory."""
    return {p.relative_to(path).as_posix(): base64.b64encode(hashlib.md5(p.read_bytes()).digest()).decode()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _logged(run: OfflineRun, kind: str):
    (art,) = [a for a in run.artifacts if a.type == kind]
    return art


def test_lineage_training_run_artefact_evaluation_run(wandb_runs):
    """Each training job logs its artefact; the evaluation runs record using exactly that artefact
    (offline runs cannot declare W&B inputs: ``used_artefacts`` in their config names the directory,
    whose W&B artefact name and file digests are the logged artefact's)."""
    evals = [run for _, run in wandb_runs["eval"].values()]
    for job, kind in TRAINING.items():
        art = _logged(wandb_runs["train"][job], kind)
        manifest = {c.path: c.digest for c in art.manifest.contents}
        users = [run for run in evals if any(
            artifact_name(p, kind) == art.name and _digests(Path(p)) == manifest
            for p in run.config.get("used_artefacts", []))]
        assert users == evals, f"{job}: artefact {art.name} not used by every evaluation run"
    # the PPD tree was built from the prompt tokens the prompts job logged
    prompts = _logged(wandb_runs["train"]["prompts"], "prompts")
    tree_inputs = wandb_runs["train"]["ppd_tree"].config["used_artefacts"]
    assert [p for p in tree_inputs if artifact_name(p, "prompts") == prompts.name]


def test_dashboard_panels_point_at_logged_keys(wandb_runs):
    """Every panel of the saved layout reads keys the runs really write: per-method figures as
    ``methods/<label>/<figure>`` for every label run, training curves in the runs its section's tag
    filter selects; group-by keys are config keys."""
    from selfspec.reporting.dashboard import METHODS, SECTIONS

    evals = [run for _, run in wandb_runs["eval"].values()]
    logged = set().union(*(run.summary for run in evals))
    labels = {key.split("/")[1] for key in logged if key.startswith("methods/")}
    assert labels <= set(METHODS), f"labels run but not in the dashboard: {labels - set(METHODS)}"
    for section in SECTIONS:
        tags = section.filter.split(", ")
        runs = [run for run in [*evals, *wandb_runs["train"].values()]
                if any(fnmatch.fnmatch(t, pattern) for t in run.run.tags for pattern in tags)]
        assert runs, f"section {section.name!r}: its filter {section.filter!r} selects no run"
        for panel in section.panels:
            per_method = [m for m in panel.metrics if m.startswith("methods/")]
            figures = {m.split("/", 2)[2] for m in per_method}
            assert set(per_method) == {f"methods/{label}/{f}" for label in METHODS for f in figures}, panel.title
            for figure in figures:
                missing = [label for label in labels if f"methods/{label}/{figure}" not in logged]
                assert not missing, f"{panel.title}: no run writes methods/<label>/{figure} for {missing}"
            for key in set(panel.metrics) - set(per_method):
                assert any(key in run.history_keys or key in run.summary for run in runs), \
                    f"{panel.title}: no run selected by {section.filter!r} logs {key!r}"
            if panel.groupby:
                *parents, last = panel.groupby.split(".")
                for run in runs:
                    node = run.config
                    for name in parents:
                        node = node[name]
                    assert last in node, f"{panel.title}: group-by key {panel.groupby} not in {run.dir}"

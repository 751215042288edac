"""Tracking: no-op logger, W&B offline files, mode selection, local results file."""

import json

import pytest
from omegaconf import OmegaConf

from selfspec.store.files import write_json
from selfspec.tracking import ResultsFile, Tracker, artifact_name, start_run, wandb_mode


def _cfg(**logger):
    base = {"name": "wandb", "project": "selfspec-test", "entity": None, "mode": "offline",
            "group": None, "tags": ["t"], "log_artifacts": True}
    return OmegaConf.create({"logger": base | logger, "model": {"name": "tiny-random"},
                             "method": {"name": "vanilla"}, "task": {"name": "xsum"}})


def test_logger_none_is_a_noop(tmp_path):
    t = start_run(OmegaConf.create({"logger": {"name": "none"}}), "evaluate", dir=tmp_path)
    assert type(t) is Tracker and not t.enabled
    t.log({"a": 1}); t.summary({"b": 2}); t.table("x", [{"c": 3}])
    t.log_artifact(tmp_path, "heads"); t.use_artifact(tmp_path); t.finish()
    assert list(tmp_path.iterdir()) == []


def test_unknown_logger_and_mode_fail_early():
    with pytest.raises(ValueError, match="logger=wandb or logger=none"):
        start_run(OmegaConf.create({"logger": {"name": "mlflow"}}), "evaluate")
    with pytest.raises(ValueError, match="logger.mode"):
        wandb_mode("sometimes")


def test_wandb_run_is_labelled_by_method_config(tmp_path, monkeypatch):
    """A variant sharing a decoder (name: draft_verify) is tagged and grouped by its label."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg()
    cfg.method.name = "draft_verify"
    t = start_run(cfg, "evaluate", dir=tmp_path / "run", method_label="draft_verify_static")
    assert "method:draft_verify_static" in t.run.tags and "method:draft_verify" not in t.run.tags
    assert dict(t.run.config)["method_label"] == "draft_verify_static"
    t.finish()
    from selfspec.reporting.dashboard import METHODS, SECTIONS

    assert "draft_verify_static" in METHODS and "adadecode_fixed" in METHODS
    assert not [p.groupby for s in SECTIONS for p in s.panels if p.groupby == "method.name"]


def test_mode_auto_is_offline_without_key(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode("auto") == "offline"
    assert wandb_mode("disabled") == "disabled"


def test_wandb_offline_run_writes_files(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    art = tmp_path / "heads" / "tiny-random-xsum"
    art.mkdir(parents=True)
    (art / "meta.json").write_text(json.dumps({"kind": "heads", "model": "tiny-random"}))
    t = start_run(_cfg(), "evaluate", dir=tmp_path / "run")
    assert t.enabled and t.run.settings.mode == "offline"
    assert {"model:tiny-random", "method:vanilla", "task:xsum", "job:evaluate", "t"} <= set(t.run.tags)
    t.log({"tokens_per_s": 3.0}, step=0)
    t.summary({"vanilla": {"tokens_per_s": 3.0}})
    t.table("examples", [{"id": "a", "tokens": [1, 2], "seconds": 0.1}])
    t.use_artifact(art)
    t.log_artifact(art, "heads")
    assert dict(t.run.config)["used_artefacts"] == [str(art.resolve())]
    t.finish()
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    assert list(runs[0].glob("files/media/table/examples_*.table.json"))


def test_artifact_name_is_shared_by_producer_and_consumer(tmp_path):
    assert artifact_name(tmp_path / "smollm2-135m-xsum", "heads") == "heads-smollm2-135m-xsum"
    assert artifact_name(tmp_path / "a b", "skips") == "skips-a_b"


def test_results_file_appends_and_survives_torn_line(tmp_path):
    path = tmp_path / "results.jsonl"
    with ResultsFile(path) as f:
        f.append({"id": "a", "x": float("nan")})
        assert [r["id"] for r in ResultsFile(path)] == ["a"]  # on disk before close
    with open(path, "a") as fh:
        fh.write('{"id": "b", "x"')  # a crash mid-write
    assert [r["id"] for r in ResultsFile(path)] == ["a"]
    with ResultsFile(path) as f:
        f.append({"id": "c"})
    rows = ResultsFile(path).rows()
    assert [r["id"] for r in rows] == ["a", "c"] and rows[0]["x"] is None
    write_json(tmp_path / "s.json", {"k": OmegaConf.create({"v": 1})})
    assert json.loads((tmp_path / "s.json").read_text()) == {"k": {"v": 1}}

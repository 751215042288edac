"""The shared training loop: it learns, checkpoints atomically and resumes exactly."""

import pytest
import torch

from selfspec.training.loop import CheckpointMismatch, TrainConfig, load_checkpoint, train

W_TRUE = torch.tensor([[2.0, -1.0, 0.5]])


def batch_fn(i):
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(16, 3, generator=g)
    return x, x @ W_TRUE.T


def loss_fn(module, batch):
    x, y = batch
    loss = torch.nn.functional.mse_loss(module(x), y)
    return loss, {"mse": float(loss)}


def make():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1, bias=False)


CFG = dict(steps=12, lr=0.1, schedule="cosine", warmup_steps=2, grad_accum=2, max_grad_norm=1.0, weight_decay=0.0,
           mixed_precision="auto", ckpt_every=4, eval_every=6, log_every=3, seed=0)


def test_learns_and_logs_eval(tmp_path):
    m = make()
    out = train(m, loss_fn, batch_fn, TrainConfig(**CFG), tmp_path / "ck",
                eval_fn=lambda mod: {"mse": float(loss_fn(mod, batch_fn(10**6))[0])})
    assert out["history"][-1]["loss"] < out["history"][0]["loss"] / 4
    assert [e["step"] for e in out["eval"]] == [0, 6, 12]
    assert load_checkpoint(tmp_path / "ck")["step"] == 12


def test_resume_after_interruption_equals_uninterrupted(tmp_path):
    ref = make()
    train(ref, loss_fn, batch_fn, TrainConfig(**CFG), tmp_path / "a")

    calls = {"n": 0}

    def crashing(module, batch):
        calls["n"] += 1
        if calls["n"] > 2 * 9:  # dies during step 10 (after the checkpoint at step 8)
            raise KeyboardInterrupt
        return loss_fn(module, batch)

    m = make()
    with pytest.raises(KeyboardInterrupt):
        train(m, crashing, batch_fn, TrainConfig(**CFG), tmp_path / "b")
    assert load_checkpoint(tmp_path / "b")["step"] == 8
    resumed = make()
    out = train(resumed, loss_fn, batch_fn, TrainConfig(**CFG), tmp_path / "b")
    assert out["step"] == 12 and len(out["history"]) == 12
    torch.testing.assert_close(resumed.weight, ref.weight)


def test_resume_refuses_changed_settings(tmp_path):
    """Resuming with other settings stops and names each change; only RESUMABLE keys may change."""
    ckpt = tmp_path / "ck"
    train(make(), loss_fn, batch_fn, TrainConfig(**CFG), ckpt, settings={"data": "a", "width": 3})
    with pytest.raises(CheckpointMismatch, match=r"data: 'a' -> 'b'; lr: 0\.1 -> 0\.05; width: 3 -> '<unset>'\)"):
        train(make(), loss_fn, batch_fn, TrainConfig(**{**CFG, "lr": 0.05}), ckpt, settings={"data": "b"})
    again = TrainConfig(**{**CFG, "ckpt_every": 5, "eval_every": 0, "log_every": 1})
    out = train(make(), loss_fn, batch_fn, again, ckpt, settings={"data": "a", "width": 3})
    assert out["step"] == 12 and load_checkpoint(ckpt)["config"]["lr"] == 0.1


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="schedule"):
        TrainConfig(**{**CFG, "schedule": "exp"})
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(**{**CFG, "steps": 0})


def test_settings_come_from_the_job_config_only():
    """TrainConfig has no defaults of its own: the job yaml sets every key; one it lacks is named."""
    from omegaconf import OmegaConf

    from selfspec.config import conf_dir

    for name in ("heads", "prompts"):
        job = OmegaConf.load(conf_dir() / "job" / f"{name}.yaml")
        assert TrainConfig.from_config(job, seed=3).seed == 3
    job = {"name": "heads", **{k: v for k, v in CFG.items() if k not in ("seed", "lr", "warmup_steps")}}
    with pytest.raises(ValueError, match=r"job\.lr is missing: conf/job/heads\.yaml must set lr, warmup_steps"):
        TrainConfig.from_config(job, seed=0)


def test_progress_bar_on_stderr_only_when_asked(tmp_path, capsys):
    """``progress=True``: a tqdm bar on stderr (steps done of all, the last loss, an ETA), stdout
    untouched; off by default."""
    train(make(), loss_fn, batch_fn, TrainConfig(**CFG), tmp_path / "quiet")
    assert capsys.readouterr().err == ""
    train(make(), loss_fn, batch_fn, TrainConfig(**{**CFG, "steps": 8}), tmp_path / "ck", progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "train: 100%" in err and "8/8" in err and "loss=" in err and "<00:00" in err


def test_a_setting_added_since_at_its_null_default_is_no_change():
    """A tree artefact built before ppd_tree had ``data`` (null: the offline asset, as before) is the
    same job; a rerun into it was refused as "trained with other settings" (data: '<unset>' -> None).
    A value given, or one taken away, still is a change."""
    from selfspec.training.loop import changed_settings

    assert changed_settings({"a": 1}, {"a": 1, "data": None}) == []
    assert changed_settings({"a": 1, "data": None}, {"a": 1}) == []
    assert changed_settings({"a": 1}, {"a": 1, "data": "x.json"}) == ["data: '<unset>' -> 'x.json'"]
    assert changed_settings({"a": 1, "data": "x.json"}, {"a": 1}) == ["data: 'x.json' -> '<unset>'"]
    assert changed_settings({"a": 1}, {"a": 2}) == ["a: 1 -> 2"]

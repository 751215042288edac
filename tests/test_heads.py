"""Intermediate heads: identity initialisation, artefact round trip, training reduces the held-out
KL, resume continues exactly, and the job end to end (data generation -> artefact -> decoder)."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from conftest import method_config
from selfspec.config import compose, conf_dir, model_config
from selfspec.models.heads import IntermediateHeads, KINDS, default_layers, load_heads, save_heads
from selfspec.models.loading import load_model
from selfspec.store.artefacts import ArtefactError
from selfspec.training import head_distillation as job_heads, loop
from selfspec.training.continuations import Sequence
from selfspec.training.loop import CheckpointMismatch, TrainConfig, train


def test_default_layers_evenly_spaced():
    assert default_layers(32) == [7, 15, 23]  # hidden states after layers 8/16/24 (the paper)
    assert default_layers(30) == [7, 14, 22]
    assert default_layers(4, 1) == [1]
    with pytest.raises(ValueError, match="n_heads"):
        default_layers(4, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_untrained_heads_equal_final_norm_and_head(tiny, kind):
    m = tiny.model
    heads = IntermediateHeads.identity(m, [0, 2], kind)
    h = torch.randn(1, 5, m.hidden_size)
    torch.testing.assert_close(heads.logits(2, h), m.logits(h))
    params = sum(p.numel() for p in heads.parameters())
    assert params == {"linear": 2 * m.hidden_size ** 2, "full": 2 * m.hidden_size * m.vocab_size, "lm_head": 0}[kind]
    assert not any(k.startswith("model") for k in heads.state_dict())  # base model is not part of it


def test_bad_layers_and_kind(tiny):
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        IntermediateHeads(tiny.model, [3])  # the last layer is the final head itself
    with pytest.raises(ValueError, match="kind"):
        IntermediateHeads(tiny.model, [1], "mlp")


def test_artefact_round_trip_and_mismatch(tiny, tmp_path):
    heads = IntermediateHeads.identity(tiny.model, [1, 2])
    with torch.no_grad():
        heads.heads["1"].weight.add_(0.1)
    path = save_heads(tmp_path / "h", heads, tiny, task="xsum", metrics={"kl": 1.0})
    back = load_heads(path, tiny)
    assert back.layers == [1, 2] and back.kind == "linear" and back.meta["task"] == "xsum"
    h = torch.randn(2, tiny.model.hidden_size)
    torch.testing.assert_close(back.logits(1, h), heads.logits(1, h))
    other = load_model(OmegaConf.merge(model_config("tiny-random"), {"random": {"num_hidden_layers": 6}}))
    with pytest.raises(ArtefactError, match="num_layers|fingerprint"):
        load_heads(path, other)


def _job(**kw):
    return OmegaConf.merge(OmegaConf.load(conf_dir() / "job" / "heads.yaml"), kw)


def _synthetic(n, length=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Sequence(torch.randint(0, 2000, (length,), generator=g).tolist(), 8) for _ in range(n)]


def _train(tiny, ckpt, steps, job):
    heads = job_heads.make_heads(tiny.model, job)
    loss_fn, batch_fn, eval_fn = job_heads.trainer(heads, _synthetic(6), _synthetic(2, seed=1), job, 0)
    cfg = TrainConfig.from_config(OmegaConf.merge(job, {"steps": steps, "warmup_steps": 0, "eval_every": 0,
                                                        "log_every": 100}), seed=0)
    return heads, train(heads, loss_fn, batch_fn, cfg, ckpt, eval_fn=eval_fn)


def test_training_reduces_heldout_kl(tiny, tmp_path):
    job = _job(layers=[1, 2], lr=3e-3, schedule="constant", ckpt_every=0, max_positions=None)
    heads, result = _train(tiny, tmp_path / "ck", 12, job)
    first, last = result["eval"][0], result["eval"][-1]
    # the random model's distributions are nearly flat, so KLs are small; 12 steps cut them ~7%
    assert last["eval/kl"] < 0.97 * first["eval/kl"], (first["eval/kl"], last["eval/kl"])
    assert result["history"][-1]["loss"] < result["history"][0]["loss"]
    assert all(0 <= last[f"eval/top1/{l}"] <= 1 for l in heads.layers)


def _die_after_checkpoint(monkeypatch):
    """The run is killed right after its first checkpoint is on disk; returns the undo."""
    real = loop._save_checkpoint

    def save_then_die(path, payload):
        real(path, payload)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "_save_checkpoint", save_then_die)
    return lambda: monkeypatch.setattr(loop, "_save_checkpoint", real)


def test_resume_continues_from_checkpoint(tiny, tmp_path, monkeypatch):
    job = _job(layers=[1, 2], lr=1e-2, schedule="constant", ckpt_every=3, max_positions=32)
    straight, _ = _train(tiny, tmp_path / "a", 6, job)
    undo = _die_after_checkpoint(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        _train(tiny, tmp_path / "b", 6, job)  # interrupted after the step-3 checkpoint
    undo()
    resumed, result = _train(tiny, tmp_path / "b", 6, job)
    assert [h["step"] for h in result["history"]] == list(range(1, 7))
    for l in straight.layers:
        torch.testing.assert_close(resumed.heads[str(l)].weight, straight.heads[str(l)].weight)


def test_job_end_to_end(tiny, tmp_path, monkeypatch):
    """Self-distillation data (greedy continuations), training, artefact, and AdaDecode loading it."""
    from selfspec.decoding import build_decoder
    from selfspec.train import run_job

    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path))
    cfg = compose(["job=heads", "model=tiny-random", "task=gsm8k", "job.n_prompts=3", "job.n_heldout=1",
                   "job.gen_tokens=6", "job.steps=2", "job.eval_every=0", "job.max_prompt_tokens=48",
                   "job.layers=[1,2]"], "train")
    summary = run_job(cfg)
    path = tmp_path / "artefacts" / "heads" / "tiny-random-gsm8k"
    assert summary["artefact"] == str(path) and (path / "meta.json").exists()
    assert not (path.parent / ".tiny-random-gsm8k.ckpt").exists()  # checkpoint cleared
    assert summary["train_sequences"] == 3 and "top1/1" in summary
    ada = OmegaConf.merge(compose(["method=adadecode", "task=gsm8k"]).method, {"threshold": 0.0})
    dec = build_decoder(ada, tiny.model, tokenizer=tiny.tokenizer)
    assert dec.heads.layers == [1, 2]
    ids = tiny.tokenizer("Question: 2+2?\nAnswer:")["input_ids"]
    ref = build_decoder(method_config("vanilla"), tiny.model).generate(ids, 12).tokens
    assert dec.generate(ids, 12).tokens == ref


def test_resumed_job_refuses_changed_settings(tiny, tmp_path, monkeypatch):
    """An interrupted heads job rerun with another ``job.lr`` stops, naming the change, instead of
    silently keeping the checkpoint's optimizer (lr 1e-3) while recording 0.05 in meta.json."""
    from selfspec.train import run_job

    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path))
    args = ["job=heads", "model=tiny-random", "task=gsm8k", "job.n_prompts=2", "job.n_heldout=1", "job.gen_tokens=4",
            "job.steps=4", "job.ckpt_every=2", "job.eval_every=0", "job.max_prompt_tokens=32", "job.layers=[1,2]",
            "job.lr=1e-3"]
    path = tmp_path / "artefacts" / "heads" / "tiny-random-gsm8k"
    undo = _die_after_checkpoint(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        run_job(compose(args, "train"))
    undo()
    with pytest.raises(CheckpointMismatch, match=r"lr: 0\.001 -> 0\.05; steps: 4 -> 6\). To resume it, restore"):
        run_job(compose(args + ["job.lr=0.05", "job.steps=6"], "train"))
    assert not path.exists()
    summary = run_job(compose(args + ["job.log_every=1"], "train"))  # how often it logs may change
    assert summary["steps"] == 4 and json.loads((path / "meta.json").read_text())["train_config"]["lr"] == 1e-3


def test_chunked_kl_gives_the_same_loss_and_gradients(tiny):
    """``job.kl_chunk``: the KL over chunks of positions, each formed again in backward, equals the
    whole KL and its gradients (up to summation order)."""
    m = tiny.model
    heads = job_heads.make_heads(m, _job(layers=[1, 2]))
    with torch.no_grad():
        for lin in heads.heads.values():
            lin.weight.add_(0.05 * torch.randn(lin.weight.shape, generator=torch.Generator().manual_seed(0)))
    g = torch.Generator().manual_seed(1)
    hidden = {l: torch.randn(37, m.hidden_size, generator=g) for l in heads.layers}
    final = torch.randn(37, m.hidden_size, generator=g)

    def run(chunk):
        heads.zero_grad()
        kls = job_heads.head_kl(heads, hidden, final)[0] if chunk is None else \
            job_heads.chunked_head_kl(heads, hidden, final, chunk)
        sum(kls.values()).backward()
        return {l: v.detach() for l, v in kls.items()}, [p.grad.clone() for p in heads.parameters()]

    kls, grads = run(None)
    for chunk in (1, 8, 37, 64):
        kls_c, grads_c = run(chunk)
        for l in heads.layers:
            torch.testing.assert_close(kls_c[l], kls[l])
        for a, b in zip(grads_c, grads):
            torch.testing.assert_close(a, b)


def test_the_training_loss_takes_the_chunked_kl(tiny, monkeypatch):
    calls = []
    real = job_heads.chunked_head_kl
    monkeypatch.setattr(job_heads, "chunked_head_kl", lambda *a: calls.append(a[-1]) or real(*a))
    job = _job(layers=[1, 2], max_positions=None, kl_chunk=5)
    heads = job_heads.make_heads(tiny.model, job)
    loss_fn, batch_fn, _ = job_heads.trainer(heads, _synthetic(4), _synthetic(2, seed=1), job, 0)
    loss, logs = loss_fn(heads, batch_fn(0))
    assert calls == [5] and torch.isfinite(loss) and set(logs) == {"kl/1", "kl/2"}


def test_a_finished_artefact_is_not_replaced_by_a_run_with_other_settings(tiny, tmp_path, monkeypatch):
    """Issue 39's probe: ``job.steps=2 artefact_dir=A`` then ``job.steps=2 job.lr=0.05 artefact_dir=A``
    replaced the finished artefact without a word. Like a resumed run, a finished one is kept when
    the settings differ, and the message names each change; the same settings train it again."""
    from selfspec.store.artefacts import ArtefactError
    from selfspec.train import run_job

    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path))
    path = tmp_path / "A"
    args = ["job=heads", "model=tiny-random", "task=gsm8k", "job.n_prompts=2", "job.n_heldout=1", "job.gen_tokens=4",
            "job.steps=2", "job.eval_every=0", "job.max_prompt_tokens=32", "job.layers=[1,2]", f"artefact_dir={path}",
            "logger=none", "progress=false"]
    run_job(compose(args, "train"))
    before = (path / "meta.json").read_bytes()
    with pytest.raises(ArtefactError, match=rf"artefact_dir={path} holds a finished heads artefact trained with other "
                                            r"settings \(job\.lr: 0\.001 -> 0\.05\)"):
        run_job(compose(args + ["job.lr=0.05"], "train"))
    assert (path / "meta.json").read_bytes() == before
    run_job(compose(args + ["job.log_every=1"], "train"))  # what only changes the logging may
    assert json.loads((path / "meta.json").read_text())["train_config"]["log_every"] == 1

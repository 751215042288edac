"""Shared fixtures: the tiny random model (fast logic tests) and the embedded SmolLM2 (slow)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny():
    """tiny-random: 4 Llama layers, hidden 64, SmolLM2's tokenizer."""
    from selfspec.config import model_config
    from selfspec.models.loading import load_model

    return load_model(model_config("tiny-random"))


@pytest.fixture(scope="session")
def smol():
    """The embedded default SmolLM2-135M-Instruct (float32, CPU)."""
    from selfspec.config import model_config
    from selfspec.models.loading import load_model

    return load_model(model_config("smollm2-135m"))


@pytest.fixture
def prompt_ids(tiny):
    return tiny.tokenizer("Article: The quick brown fox jumps over the lazy dog.\nSummary:")["input_ids"]


def method_config(name: str, **overrides):
    """``conf/method/<name>.yaml`` as composed (every key set there, nowhere else) with ``overrides``
    on top, as a plain (non-struct) config so that a test may also add a key the method refuses."""
    from omegaconf import OmegaConf

    from selfspec.config import load_method_config

    # resolved as the method group of a config without a task: ${oc.select:task.name,null} -> null
    alone = OmegaConf.create({"method": OmegaConf.to_container(load_method_config(name))})
    return OmegaConf.create({**OmegaConf.to_container(alone, resolve=True)["method"], **overrides})


def decoding_keys(name: str, keys) -> dict:
    """The checked ``keys`` of ``conf/method/<name>.yaml``, for a decoder built directly."""
    from selfspec.decoding import check_method

    options = check_method(method_config(name))
    return {k: options[k] for k in keys}


#: PPD's decoding keys as conf/method/ppd.yaml sets them (no context drafts)
PPD_KEYS = {**decoding_keys("ppd", ("posterior_threshold", "posterior_alpha", "state_zero")), "ngram": None}
#: Draft & Verify's decoding keys as conf/method/draft_verify.yaml sets them
DV_KEYS = decoding_keys("draft_verify", ("max_draft", "draft_stop", "last_token", "eos_draft"))


def flip_last_byte(path) -> None:
    """Change the last byte of ``path`` in place, keeping its size and restoring its modification
    time (a damaged file that a size and time check would not notice)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def hf_greedy(loaded, ids, n):
    """Reference: transformers' own greedy generate, exactly n new tokens (no EOS stop)."""
    out = loaded.model.hf.generate(
        torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(ids):].tolist()


def rolled_back_steps(dec, ids, steps: int = 8, budget: int = 60) -> int:
    """Prefill ``ids`` and drive ``dec.step`` by hand; after each step every layer must hold exactly
    the full model's K/V of the committed tokens but the pending one (drafts' scratch K/V and
    rejected positions rolled back). Returns how many drafts were rejected."""
    from selfspec.decoding import Sampling
    from selfspec.decoding.base import DecodeState

    model = dec.model
    state = DecodeState(list(ids), len(ids), model.new_cache(200), Sampling(), None)
    rejected = 0
    with torch.inference_mode():
        dec.begin(state)
        dec._commit(state, [dec.prefill(state, torch.tensor([ids]))], budget)
        for _ in range(steps):
            new = dec.step(state, budget)
            rejected += state.drafted - (len(new) - 1)
            dec._commit(state, new, budget)
            ref = model.new_cache(200)
            model.forward(torch.tensor([state.tokens[:-1]]), ref, start=0)
            for i in range(model.num_layers):
                assert state.cache.length(i) == state.n_cached
                torch.testing.assert_close(state.cache.layer_kv(i), ref.layer_kv(i), atol=1e-5, rtol=1e-4)
    return rejected


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """The demo's whole pipeline once per session, reduced: tiny-random, ``--small``, every task, W&B
    offline. ``out``: its outputs root (artefacts, runs); ``run_dir``: ``out/demo/<time>`` (train,
    eval, runtime, report); ``printed``: its stdout lines."""
    import contextlib
    import io
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    root = tmp_path_factory.mktemp("demo")
    out = root / "outputs"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        # the demo points every default artefact path at --out and logs to W&B offline; restored after
        mp.setenv("SELFSPEC_OUTPUTS", str(out))
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.chdir(root)
        mp.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
        import demo

        try:
            with contextlib.redirect_stdout(printed):
                code = demo.main(["--model", "tiny-random", "--small", "--out", str(out), "--logger", "wandb"])
        finally:
            sys.modules.pop("demo", None)
    assert code == 0, printed.getvalue()
    (run_dir,) = (out / "demo").iterdir()
    return SimpleNamespace(out=out, run_dir=run_dir, printed=printed.getvalue().strip().splitlines())

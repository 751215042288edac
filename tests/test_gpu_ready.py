"""The CUDA path's defects a reading found (issue 50), each shown on the CPU's ``capture=static`` path,
which runs the passes a GPU captures: graphs rebuilt inside timed examples, a pooled cache reallocated on
every call near the context's end, K/V copied to every query head, weights held twice, static passes
priced by the rows asked for instead of the bucket and buffer they run at, a tree path moved layer by
layer, bf16 rotary frequencies, and captures inside other timed measurements."""

from __future__ import annotations

import pytest
import torch

from conftest import DV_OPTIONS
from selfspec.decoding.draft_verify import DraftVerify
from selfspec.decoding.vanilla import Vanilla
from selfspec.models import capture
from selfspec.models.layered import SkipSet


@pytest.fixture(scope="module")
def static():
    """tiny-random with its passes at static shapes (the weights of the session's tiny model)."""
    from selfspec.config import model_config
    from selfspec.models.loading import load_model

    return load_model(model_config("tiny-random")).model.with_passes(capture.StepRunner("static"))


# --- 1. graphs rebuilt inside timed examples ---------------------------------------------------
def test_an_evaluation_reserves_its_longest_generation_before_the_warm_up(tmp_path):
    """The warm-up's generations are short (warmup_max_new_tokens), the timed ones long and of
    several prompt lengths: the pooled cache was sized by the warm-up, grew at the first timed example
    and dropped every pass built on it, so each method built (on a GPU: captured) its passes again
    while timed. Now the run reserves its longest generation first: nothing is dropped, nothing built
    while timed, and every row and the summary say so."""
    import json

    from selfspec.config import compose
    from selfspec.evaluation import evaluate

    cfg = compose(["model=tiny-random", "model.capture=static", "n_examples=3", "max_new_tokens=40", "warmup=1",
                   "warmup_max_new_tokens=4", "progress=false", "method=draft_verify_static", "profile=null",
                   "method.skip_attn=[1]", "method.skip_mlp=[2]",
                   "method.never_slower=false"])
    summary = evaluate(cfg, tmp_path)
    c = summary["capture"]
    assert c["forgotten"] == 0, c  # the pool never grew after the warm-up
    assert set(c["captured_while_timed"]) == {"vanilla", "draft_verify"}
    assert not any(c["captured_while_timed"].values()), c
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert len({r["prompt_tokens"] for r in rows}) > 1  # prompts of several lengths
    assert all(r["captured_while_timed"] == 0 for r in rows)


def test_a_generation_that_built_passes_is_timed_again_from_the_same_state(static, prompt_ids):
    """``Decoder.generate_timed``: a generation whose seconds include building its static passes (a
    capture on a GPU) runs again from the carried state it started from (Draft & Verify's threshold),
    so the timed one builds nothing and decodes the same tokens with the same state after."""
    skip = SkipSet.of(attn=[1], mlp=[2])
    fresh = DraftVerify(static, skip, DV_OPTIONS)
    want = fresh.generate(prompt_ids, 30)
    static.steps.forget(static.reserve(len(prompt_ids) + 64))  # its passes dropped: the next run builds them
    dec = DraftVerify(static, skip, DV_OPTIONS)
    built = static.steps.built
    gen, during = dec.generate_timed(prompt_ids, 30)
    assert static.steps.built > built and during == 0
    assert gen.tokens == want.tokens and gen.trace[-1].row() == want.trace[-1].row()
    assert dec.drafter.snapshot() == fresh.drafter.snapshot()  # one generation's state, not two


# --- 2. the pooled cache near the context's end -------------------------------------------------
def test_the_pool_is_reused_near_the_models_context(prompt_ids):
    """Within 256 positions of the context's end the pool, capped at the context, was shorter than
    ``max_length + padding`` forever: it was reallocated (and every graph dropped) on every call."""
    from selfspec.config import compose
    from selfspec.models.loading import load_model

    m = load_model(compose(["model=tiny-random", "model.capture=static",
                            "model.random.max_position_embeddings=300"]).model).model
    first = m.new_cache(200, reuse=True)
    assert first.max_length == 300
    Vanilla(m).generate(prompt_ids, 20)
    assert m.new_cache(250, reuse=True) is first and m.steps.forgotten == 0


# --- 5. K/V copied to every query head --------------------------------------------------------
def test_masked_grouped_attention_reads_the_kv_as_stored(monkeypatch):
    """A static pass always has a mask (over its padded buffer); transformers' SDPA wrapper then
    repeats K/V to every query head (``repeat_kv``), layer by layer. Off the CPU the runtime stacks
    each KV group's query heads instead: the same attention, and no copy of the buffer."""
    from transformers.integrations import sdpa_attention

    from selfspec.models.kernels import attention, grouped_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 16, generator=g) for h, n in ((8, 5), (2, 40), (2, 40)))
    allowed = torch.rand(5, 40, generator=g) > 0.3
    allowed[:, 0] = True
    module = type("Attn", (), {"num_key_value_groups": 4, "is_causal": True})()
    for mask in (allowed.view(1, 1, 5, 40), torch.where(allowed, 0.0, torch.finfo(torch.float32).min).view(1, 1, 5, 40)):
        want = sdpa_attention.sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)[0]
        torch.testing.assert_close(grouped_attention(q, k, v, mask, 0.25), want)

    def copied(*args, **kwargs):
        raise AssertionError("the keys and values were repeated to every query head")

    monkeypatch.setattr(sdpa_attention, "repeat_kv", copied)
    meta = [t.to("meta") for t in (q, k, v, allowed.view(1, 1, 5, 40))]  # the route a GPU pass takes
    out = attention(sdpa_attention.sdpa_attention_forward, module, *meta, 0.25)
    assert out.shape == (1, 5, 8, 16)


# --- 6. weights held twice ---------------------------------------------------------------------
def test_a_twin_with_other_passes_shares_every_weight(tiny):
    """``make gpu-check`` compared captured and eager passes on a second LayeredModel built over the
    same HF modules, which fused their projections again (+9 GB on the 8B shape). A twin with other
    passes holds the same tensors."""
    m = tiny.model
    twin = m.with_passes(capture.StepRunner("static"))
    assert twin.steps is not m.steps and twin.capture == "static" and m.capture == "off"
    for (a, _, _), (b, _, _) in zip(m._qkv + m._gate_up, twin._qkv + twin._gate_up):
        assert a.data_ptr() == b.data_ptr()
    assert twin.hf is m.hf and twin.lm_head_weight.data_ptr() == m.lm_head_weight.data_ptr()


# --- 7. priced by rows, run at bucket and buffer -------------------------------------------------
def test_a_static_pass_records_its_bucket_and_the_slots_it_attends_over(static):
    from selfspec.models.ledger import Ledger, as_op

    cache = static.new_cache(100)
    ledger = Ledger(static.device)
    with torch.inference_mode():
        static.forward(torch.zeros(1, 20, dtype=torch.long), cache, start=0, ledger=ledger)
        static.forward(torch.zeros(1, 5, dtype=torch.long), cache, ledger=ledger)
    prefill, step = ledger.take_ops()
    assert (step.rows, step.context, step.padded, step.span) == (5, 20, 8, cache.max_length)
    assert (prefill.rows, prefill.padded) == (20, 32)
    assert as_op(step.row()) == step and as_op(["verify", "L", 5, 4, 4, 20]).padded == 0


def test_a_profile_of_static_passes_prices_a_walk_at_its_bucket_and_slots(tiny):
    """A 5-row static pass runs the 8-row bucket over the whole pooled buffer: a profile measured with
    static passes prices it there, not at 5 rows interpolated at its context."""
    from conftest import cpu_like_profile
    from selfspec.measure.profile import Profile
    from selfspec.models.ledger import LayerOp

    data = cpu_like_profile(tiny.model).data
    data["attention"] = {"0": {"1": 1.0, "4": 4.0, "8": 8.0}, "512": {"1": 2.0, "4": 5.0, "8": 9.0}}
    dynamic = Profile(data)
    static = Profile(data | {"model": data["model"] | {"capture": "static"}, "spans": {"0": 300, "512": 812}})
    walk = LayerOp("verify", 5, 1, 0, 0)
    assert dynamic.op(walk) == pytest.approx(5.0)  # between 4 and 8 rows
    assert static.op(walk) == pytest.approx(8.0)  # the bucket: a trace recorded without static passes
    assert static.op(walk._replace(padded=8, span=812)) == pytest.approx(9.0)  # its buffer's price, not context 0's
    assert static.op(walk._replace(padded=8, span=556)) == pytest.approx(8.5)


def test_a_profile_measured_with_static_passes_records_their_slots(static):
    from selfspec.evaluation.profiling import measure_profile

    p = measure_profile(static, rows=(1, 2), prefill_rows=(), contexts=(0, 16), repeats=1)
    assert p.static and set(p.spans) == {0, 16} and p.spans[16] > 16


def test_the_profile_stops_at_its_deadline(tiny):
    import time

    from selfspec.evaluation.profiling import ProfileDeadline, measure_profile

    with pytest.raises(ProfileDeadline, match="time limit"):
        measure_profile(tiny.model, rows=(1,), prefill_rows=(), contexts=(0,), repeats=1,
                        deadline=time.perf_counter())


# --- 8. the accepted tree path --------------------------------------------------------------
def test_accepting_a_tree_path_moves_every_layer_in_one_operation(tiny):
    """PPD's and SWIFT's accepted path (``LayerCache.gather``) cost an index and a copy per layer
    for keys and values, every step, even when the path sat where it belongs. Now one operation moves
    every layer, and a path in place moves nothing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.selects = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.selects += func is torch.ops.aten.index_select.default
            return func(*args, **(kwargs or {}))

    cache = tiny.model.new_cache(40)
    g = torch.Generator().manual_seed(0)
    cache.buffers.copy_(torch.randn(cache.buffers.shape, generator=g))
    for i in range(cache.num_layers):
        cache.lengths[i] = 30
    want = [(k[:, :, [20, 22, 25]].clone(), v[:, :, [20, 22, 25]].clone()) for k, v in zip(cache.keys, cache.values)]
    with Count() as count:
        cache.gather(20, [20, 21])  # in place: nothing moves
    assert count.selects == 0 and cache.lengths == [22] * cache.num_layers
    with Count() as count:
        cache.gather(20, [20, 22, 25])
    assert count.selects == 1 and cache.lengths == [23] * cache.num_layers
    for (k, v), (wk, wv) in zip((cache.layer_kv(i) for i in range(cache.num_layers)), want):
        assert torch.equal(k[:, :, 20:], wk) and torch.equal(v[:, :, 20:], wv)


# --- 9. rotary frequencies in bf16 ---------------------------------------------------------------
def test_a_bf16_model_keeps_the_rotary_frequencies_from_pretrained_keeps(tmp_path):
    """``Module.to(dtype=bfloat16)`` cast the rotary frequency tables too; ``from_pretrained(dtype=
    bfloat16)``, the reference bf16 model, keeps them float32, and the angles of later positions
    differ. selfspec's bf16 model now has the reference's tables and rotary embeddings."""
    from transformers import AutoModelForCausalLM

    from selfspec.config import compose
    from selfspec.models.loading import load_model

    fp32 = load_model(compose(["model=tiny-random"]).model).model
    fp32.hf.save_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    bf16 = load_model(compose(["model=tiny-random", "model.dtype=bfloat16"]).model).model
    mine = dict(bf16.hf.named_buffers())
    for name, buf in ref.named_buffers():
        assert mine[name].dtype == buf.dtype and torch.equal(mine[name], buf), name
    assert set(dict(bf16.hf.state_dict())) == set(dict(ref.state_dict()))  # persistence unchanged
    positions = torch.arange(1500, 1600).unsqueeze(0)
    x = torch.zeros(1, 100, bf16.hidden_size, dtype=torch.bfloat16)
    for a, b in zip(bf16.rope(positions, x), ref.model.rotary_emb(x, positions)):
        assert torch.equal(a, b)


# --- 11. installing for a GPU -------------------------------------------------------------------
def test_make_passes_torch_spec_word_by_word_and_sets_up_again_when_it_changes(tmp_path):
    """``make TORCH_SPEC='torch --index-url ...'`` quoted the spec as one requirement (no index for an
    older driver's CUDA), and the venv's stamp ignored TORCH_SPEC, so a CPU venv stayed CPU."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    log = tmp_path / "log"
    py = tmp_path / "py"  # stands in for the venv's python: records each call's words
    py.write_text(f'#!/bin/sh\nfor w in "$@"; do printf "<%s>" "$w"; done >> {log}\necho >> {log}\n')
    py.chmod(0o755)

    def install(spec: str) -> list[str]:
        log.write_text("")
        subprocess.run(["make", "-s", "-C", str(root), f"VENV={tmp_path / 'venv'}", f"PY={py}", "PYTHON=true",
                        f"TORCH_SPEC={spec}", str(tmp_path / "venv" / ".installed")],
                       check=True, capture_output=True, text=True, env={**os.environ, "MAKEFLAGS": ""})
        return [line for line in log.read_text().splitlines() if "<torch" in line]

    cuda = "torch --index-url https://download.pytorch.org/whl/cu121"
    assert install(cuda) == ["<-m><pip><install><-q><torch><--index-url><https://download.pytorch.org/whl/cu121>"]
    assert install(cuda) == []  # the same spec: nothing to set up again
    assert install("torch==2.13.0") == ["<-m><pip><install><-q><torch==2.13.0>"]

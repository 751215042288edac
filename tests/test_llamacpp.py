"""llama.cpp as a peer method (``method=llama_cpp``, :mod:`selfspec.decoding.llamacpp`): its weights files
made once by llama.cpp's own quantiser, its generations cut as the layered loop cuts them, and its rows in
an evaluation beside vanilla's. The refusals that need no llama.cpp (a sampled run, a batch, an unknown
format) are in tests/test_bad_input.py; the memory term is checked here without it."""

import importlib.util

import pytest
import torch

from selfspec.config import compose
from selfspec.decoding.vanilla import Vanilla

needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed (the optional extra: make llamacpp)")


def _prompt(tiny, n=24, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, tiny.model.vocab_size, (n,), generator=g).tolist()


@needs_llama_cpp
def test_q8_0_weights_come_from_llama_cpps_quantiser_once(tiny, tmp_path, monkeypatch):
    """``weights=q8_0``: the loaded weights written as GGUF, then quantised by llama.cpp into a file whose
    matrices are Q8_0 (those llama.cpp can block), made once and named by the model; it decodes."""
    from gguf import GGUFReader

    from selfspec.decoding.llamacpp import LlamaCpp

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    dec = LlamaCpp(tiny.model, "q8_0", tokenizer=tiny.tokenizer, threads=1)
    try:
        assert dec.weights == "q8_0" and dec.path.name.endswith(".q8_0.gguf") and tiny.model.weights_digest in dec.path.name
        types = {t.name: t.tensor_type.name for t in GGUFReader(dec.path).tensors}
        blocked = [n for n in types if n.endswith(".weight") and "norm" not in n]
        assert blocked and any(types[n] == "Q8_0" for n in blocked), types
        assert not [p for p in dec.path.parent.iterdir() if p.name.startswith(".")]  # no temporary file left
        made = dec.path.stat().st_mtime_ns
        out = dec.generate(_prompt(tiny), 10)
        assert out.new_tokens == 10 and out.stop_reason == "length" and out.accepted_per_step == [1] * 10
    finally:
        dec.close()
    again = LlamaCpp(tiny.model, "q8_0", tokenizer=tiny.tokenizer, threads=1)
    assert again.path == dec.path and again.path.stat().st_mtime_ns == made
    again.close()


@needs_llama_cpp
def test_a_generation_is_cut_at_eos_and_the_budget_as_the_layered_loop_cuts_it(tiny, tmp_path, monkeypatch):
    """``weights=auto`` in float32 decodes vanilla's tokens; with the fourth of them as EOS it stops there,
    as vanilla does; a longer generation than its context makes a larger context, untimed."""
    from selfspec.decoding.llamacpp import MIN_CONTEXT, LlamaCpp

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    prompt = _prompt(tiny)
    want = Vanilla(tiny.model).generate(prompt, 12).tokens
    dec = LlamaCpp(tiny.model, tokenizer=tiny.tokenizer, threads=1)
    try:
        assert dec.weights == "f32" and dec.path.name.endswith(".f32.gguf")
        assert dec.generate(prompt, 12).tokens == want and dec.n_ctx == MIN_CONTEXT
        eos = want[3]
        cut = LlamaCpp(tiny.model, tokenizer=tiny.tokenizer, threads=1, eos_token_ids=[eos])
        try:
            out = cut.generate(prompt, 12)
            assert out.tokens == Vanilla(tiny.model, eos_token_ids=[eos]).generate(prompt, 12).tokens
            assert out.stop_reason == "eos" and out.tokens[-1] == eos and len(out.tokens) == want.index(eos) + 1
        finally:
            cut.close()
        dec.reserve(MIN_CONTEXT + 1)
        assert dec.n_ctx == 2 * MIN_CONTEXT and dec.generate(prompt, 12).tokens == want
        with pytest.raises(ValueError, match="greedily only"):
            from selfspec.decoding.sampling import Sampling

            dec.generate(prompt, 4, Sampling(temperature=0.7))
    finally:
        dec.close()


@needs_llama_cpp
def test_source_weights_need_a_model_read_from_a_gguf_file(tiny, tmp_path, monkeypatch):
    from selfspec.decoding.llamacpp import LlamaCpp

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="method.weights=source: tiny-random was not read from a GGUF file"):
        LlamaCpp(tiny.model, "source", tokenizer=tiny.tokenizer, threads=1)


@needs_llama_cpp
def test_an_evaluation_runs_llama_cpp_beside_vanilla(tiny, tmp_path):
    """``compare=[llama_cpp]``: its rows interleaved with vanilla's, the same tokens on tiny-random in float32,
    no lossless promise (its consistency is measured), and its speedup from its own seconds."""
    from selfspec.evaluation import RESULTS, evaluate
    from selfspec.tracking import ResultsFile

    cfg = compose(["model=tiny-random", "n_examples=2", "max_new_tokens=8", "warmup=1", "progress=false",
                   "compare=[llama_cpp]"])
    s = evaluate(cfg, tmp_path / "run", loaded=tiny)
    rows = ResultsFile(tmp_path / "run" / RESULTS).rows()
    assert [r["method"] for r in rows] == ["vanilla", "llama_cpp"] * 2
    for a, b in (rows[:2], rows[2:]):
        assert a["tokens"] == b["tokens"] and b["lossless"] is False and b["seconds"] > 0
    m = s["methods"]["llama_cpp"]
    assert m["consistency"] == 1.0 and m["tau"] == 1.0 and m["speedup"] > 0


def test_the_memory_estimate_counts_llama_cpps_weights_and_cache():
    """An evaluation with llama.cpp counts the file it maps (q8_0: 34 bytes per 32 values) and its KV cache
    (the run's dtype, its context a power of two), named by the key that asks for it."""
    from selfspec.evaluation.runner import memory_terms
    from selfspec.measure.peak import SIZES

    s = SIZES["1B"]
    cfg = compose(["model=tiny-random", "method=llama_cpp", "method.weights=q8_0"])
    terms = {t.name: t for t in memory_terms(s, cfg, 4, 600, 500)[0]}
    term = terms["llama.cpp's q8_0 weights and cache"]
    assert term.setting == "method.weights" and not term.activation
    assert term.bytes == int(s.params * 34 / 32) + 1024 * s.kv_per_token * 4
    assert not any("llama.cpp" in n for n in (t.name for t in memory_terms(s, compose(["model=tiny-random"]), 4, 600,
                                                                             500)[0]))


@needs_llama_cpp
@pytest.mark.parametrize("draft", ["f32", "q8_0"])
def test_speculative_decoding_with_a_draft_model_gives_the_targets_greedy_tokens(tiny, tmp_path, monkeypatch, draft):
    """``llama_cpp_speculative``: a draft model's tokens verified by the F32 target in one batch give the
    target's greedy tokens (vanilla's, on tiny-random in float32) at every budget; a draft that is the target
    itself is accepted whole (max_draft + 1 tokens a step), its Q8_0 copy drafts that are sometimes rejected."""
    from selfspec.decoding import llamacpp
    from selfspec.decoding.llamacpp import LlamaCpp, LlamaCppSpeculative

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    drafting = LlamaCpp(tiny.model, draft, tokenizer=tiny.tokenizer, threads=1)  # makes the draft's file
    drafting.close()
    monkeypatch.setattr(llamacpp, "draft_file", lambda name: drafting.path)
    dec = LlamaCppSpeculative(tiny.model, tokenizer=tiny.tokenizer, threads=1, draft="itself", max_draft=3,
                              draft_p_min=0.0)
    try:
        for seed, budget in ((3, 20), (4, 7), (5, 1)):
            prompt = _prompt(tiny, seed=seed)
            out = dec.generate(prompt, budget)
            assert out.tokens == Vanilla(tiny.model).generate(prompt, budget).tokens
            if draft == "f32" and budget == 20:
                assert out.accepted_per_step[1:4] == [4, 4, 4] and out.drafted_per_step[1:4] == [3, 3, 3]
        assert sum(out.drafted_per_step) == 0  # one token of budget: nothing drafted
    finally:
        dec.close()


def test_the_memory_estimate_counts_the_draft_models_file_and_cache():
    """``llama_cpp_speculative``: its draft model's file and KV cache besides the target's weights, named by
    ``method.draft``; a run reading a draft model holds its files' digests (a replaced draft is no resume)."""
    from selfspec.evaluation.runner import memory_terms
    from selfspec.measure.peak import SIZES

    cfg = compose(["model=tiny-random", "method=llama_cpp_speculative", "method.draft=tiny-random"])
    terms = {t.name: t for t in memory_terms(SIZES["1B"], cfg, 1, 600, 500)[0]}
    assert terms["llama.cpp's draft model tiny-random, its weights and cache"].setting == "method.draft"
    assert "llama.cpp's auto weights and cache" in terms
    from selfspec.evaluation.identity import run_identity
    from selfspec.evaluation.plan import prepare
    from selfspec.models.loading import source_digests

    cfg = compose(["model=tiny-random", "method=llama_cpp_speculative", "method.draft=smollm2-135m", "n_examples=1"])
    inputs = run_identity(cfg, prepare(cfg))["inputs"]
    assert inputs["models"] == {"smollm2-135m": source_digests(compose(["model=smollm2-135m"]).model)}
    assert inputs["models"]["smollm2-135m"]  # the draft's GGUF asset, by its pinned digest

"""AdaDecode: output equals vanilla for every threshold, the deferred layer caches equal a full
recomputation after any sequence of deferrals and rollbacks, and rejection sampling keeps the
target distribution."""

import pytest
import torch
from omegaconf import OmegaConf

from conftest import method_config
from selfspec.config import model_config
from selfspec.decoding import Sampling, build_decoder
from selfspec.decoding.adadecode import AdaDecode, AdaDecodeNoVerify
from selfspec.decoding.base import DecodeState
from selfspec.decoding.sampling import warp
from selfspec.models.heads import IntermediateHeads
from selfspec.models.layered import Pass
from selfspec.models.loading import load_model

HEAD_LAYERS = [1, 2, 4]


def peaked_model():
    """A 6-layer tiny-random model made predictable: sharp logits (LM head x30) and deeper layers
    that change the residual stream little (output projections x0.3), so intermediate heads agree
    with the final layer often but not always — both acceptance and rejection paths run."""
    loaded = load_model(OmegaConf.merge(model_config("tiny-random"), {"random": {"num_hidden_layers": 6}}))
    m = loaded.model
    with torch.no_grad():
        m.lm_head_weight.mul_(30)
        for i in range(1, m.num_layers):
            m.hf.model.layers[i].self_attn.o_proj.weight.mul_(0.3)
            m.hf.model.layers[i].mlp.down_proj.weight.mul_(0.3)
    return loaded


@pytest.fixture(scope="module")
def peaked():
    return peaked_model()


def random_heads(model, noise=0.02, seed=0):
    """Trained-like heads: T_i = I + noise (random, so they sometimes disagree with the final layer)."""
    g = torch.Generator().manual_seed(seed)
    heads = IntermediateHeads.identity(model, HEAD_LAYERS)
    with torch.no_grad():
        for lin in heads.heads.values():
            lin.weight.add_(torch.randn(lin.weight.shape, generator=g) * noise)
    return heads


@pytest.fixture(scope="module")
def ids(peaked):
    return peaked.tokenizer("Article: The quick brown fox jumps over the lazy dog.\nSummary:")["input_ids"]


@pytest.fixture(scope="module")
def reference(peaked, ids):
    return build_decoder(method_config("vanilla"), peaked.model).generate(ids, 40).tokens


@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.6, 0.9, 1.1])
def test_greedy_equals_vanilla_for_every_threshold(peaked, ids, reference, threshold):
    g = AdaDecode(peaked.model, random_heads(peaked.model), threshold=threshold, max_early=16, exit_layers=None, early_eos=False).generate(ids, 40)
    assert g.tokens == reference
    s = g.stats
    if threshold == 0.0:  # every token exits at the first head until max_early / the budget stops it
        assert s["early_predictions"] >= len(reference) - s["full_passes"]
        assert set(k for k in s if k.startswith("exit_layer_")) == {"exit_layer_1"}
    if threshold == 0.3:  # accepted and rejected early predictions both occur
        assert s["accepted_early"] > 0 and s["rejected"] > 0 and g.tau > 1
    if threshold == 1.1:  # no head is ever that confident: plain full passes
        assert s["early_predictions"] == 0 and g.tau == 1.0
    assert s["tokens_per_full_pass"] == pytest.approx(g.tau)
    assert sum(s[k] for k in s if k.startswith("exit_layer_")) == s["early_predictions"]


@pytest.mark.parametrize("kw", [{"max_early": 1}, {"max_early": 0}, {"exit_layers": [2]}, {"exit_layers": [4]}])
def test_ablations_equal_vanilla(peaked, ids, reference, kw):
    g = AdaDecode(peaked.model, random_heads(peaked.model), **{"threshold": 0.3, "max_early": 16, "exit_layers": None, "early_eos": False, **kw}).generate(ids, 40)
    assert g.tokens == reference
    if kw.get("max_early") == 0:
        assert g.stats["early_predictions"] == 0
    if "exit_layers" in kw:
        assert {k for k in g.stats if k.startswith("exit_layer_")} <= {f"exit_layer_{kw['exit_layers'][0]}"}


def test_original_lm_head_and_eos(peaked, ids, reference):
    cfg = method_config("adadecode", **{"head_kind": "lm_head", "layers": HEAD_LAYERS, "threshold": 0.3})
    g = build_decoder(cfg, peaked.model, tokenizer=peaked.tokenizer).generate(ids, 40)
    assert g.tokens == reference and g.stats["early_predictions"] > 0
    eos = reference[12]
    dec = AdaDecode(peaked.model, random_heads(peaked.model), threshold=0.0, max_early=16, exit_layers=None, early_eos=False, eos_token_ids=[eos])
    g = dec.generate(ids, 40)
    assert g.tokens == reference[: reference.index(eos) + 1] and g.stop_reason == "eos"


def test_no_verify_ablation_is_lossy_and_flagged(peaked, ids, reference):
    assert AdaDecodeNoVerify.lossless is False and AdaDecode.lossless is True
    same = AdaDecodeNoVerify(peaked.model, random_heads(peaked.model), threshold=1.1, max_early=16, exit_layers=None,
                             early_eos=False).generate(ids, 40)
    assert same.tokens == reference
    lossy = AdaDecodeNoVerify(peaked.model, random_heads(peaked.model), threshold=0.0, max_early=16, exit_layers=None,
                              early_eos=False).generate(ids, 40)
    assert len(lossy.tokens) == 40 and lossy.tokens != reference and lossy.stats["rejected"] == 0


def _recomputed_kv(model, tokens, n):
    cache = model.new_cache(len(tokens) + 1)
    model.forward(torch.tensor([tokens[:n]]), cache, start=0)
    return cache


@pytest.mark.parametrize("threshold", [0.0, 0.3])
def test_layer_caches_equal_full_recomputation(peaked, ids, threshold):
    """Drive the step pass by pass: after every deferral, every layer's cache holds exactly the
    keys/values a full recomputation gives for its own length (deeper layers lag); after each
    verification / rollback every layer holds all committed tokens but the pending one."""
    m = peaked.model
    dec = AdaDecode(m, random_heads(m), threshold=threshold, max_early=6, exit_layers=None, early_eos=False)
    state = DecodeState(list(ids), len(ids), m.new_cache(len(ids) + 64), Sampling(), None)
    with torch.inference_mode():
        state.tokens.append(dec.prefill(state, torch.tensor([ids])))
        deferrals = rollbacks = 0
        for _ in range(12):
            ss = dec.new_step(state, budget=16)
            token = state.pending
            while (logits := dec.advance(state, ss, token)) is None:
                token = ss.draft.tokens[-1]
                deferrals += 1
                lengths = state.cache.lengths
                assert all(a >= b for a, b in zip(lengths, lengths[1:])), lengths
                assert lengths[0] == ss.base + len(ss.draft.tokens) and lengths[-1] == ss.base
                _check_cache(m, state.cache, state.tokens + ss.draft.tokens)
            new = dec.verify_step(state, ss, logits)
            rollbacks += len(new) - 1 < len(ss.draft.tokens)
            state.tokens.extend(new)
            assert state.cache.lengths == [state.n_cached] * m.num_layers
            _check_cache(m, state.cache, state.tokens)
    assert deferrals > 0 and (threshold != 0.0 or rollbacks > 0)


def _check_cache(m, cache, tokens):
    ref = _recomputed_kv(m, tokens, max(cache.lengths))
    for i in range(m.num_layers):
        k, v = cache.layer_kv(i)
        rk, rv = ref.layer_kv(i)
        n = cache.length(i)
        torch.testing.assert_close(k, rk[:, :, :n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, rv[:, :, :n], atol=1e-4, rtol=1e-4)


def test_rejection_sampling_preserves_target_distribution(peaked, ids):
    """One step with an early prediction from a head that disagrees with the final layer
    (γ = 0: always predicted early). The first emitted token must follow the target p*
    (top-k 3 sampling). Bound: total variation < 0.08 over 800 draws of 3 outcomes (an
    unbiased sampler has TV ~ 0.02, std ~ 0.015); emitting the head's q instead is off by TV(p*, q) > 0.3."""
    m = peaked.model
    heads = random_heads(m, noise=0.3, seed=1)
    dec = AdaDecode(m, heads, threshold=0.0, max_early=16, exit_layers=None, early_eos=False)
    s = Sampling(temperature=1.0, top_k=3)
    gen = torch.Generator().manual_seed(0)
    state = DecodeState(list(ids), len(ids), m.new_cache(len(ids) + 8), s, gen)
    with torch.inference_mode():
        state.tokens.append(dec.prefill(state, torch.tensor([ids])))
        base = state.n_cached
        h = m.forward(torch.tensor([state.tokens]), m.new_cache(len(state.tokens) + 1), start=0)[:, -1]
        hidden1 = m.forward(torch.tensor([state.tokens]), m.new_cache(len(state.tokens) + 1), Pass(range(2)),
                            start=0)[:, -1]
        p = warp(m.logits(h)[0], s)
        q = warp(heads.logits(1, hidden1)[0], s)
        assert 0.5 * (p - q).abs().sum() > 0.3
        counts = torch.zeros_like(p)
        n = 800
        for _ in range(n):
            out = dec.step(state, budget=2)
            state.cache.truncate(base)
            counts[out[0]] += 1
    tv = 0.5 * (counts / n - p).abs().sum()
    assert tv < 0.08, f"total variation {tv:.4f}"


def test_config_errors(peaked, tmp_path):
    m = peaked.model
    with pytest.raises(ValueError, match="exit_layers"):
        AdaDecode(m, random_heads(m), threshold=0.85, max_early=16, exit_layers=[3], early_eos=False)
    with pytest.raises(ValueError, match=r"method\.threshold=-0\.5 is not allowed"):
        build_decoder(method_config("adadecode", **{"head_kind": "lm_head", "threshold": -0.5}), m)
    cfg = method_config("adadecode", **{"heads_dir": None, "heads_task": "nonexistent-task"})
    with pytest.raises(FileNotFoundError, match="make train-heads"):
        build_decoder(cfg, m, tokenizer=peaked.tokenizer)
    cfg = method_config("adadecode", **{"head_kind": "lm_head", "exit_layers": "middle"})
    dec = build_decoder(cfg, m, tokenizer=peaked.tokenizer)
    assert dec.exit_layers == {dec.heads.layers[1]}


def test_a_pass_walks_its_layers_once_per_segment_between_exit_heads(peaked, ids):
    """A token's pass walks from one event to the next (an exit head read, owed positions joining),
    not a layer at a time: each walk costs its own call (the profile's ``walk``), 0.07-0.12 ms of a
    ~8 ms step on 2 CPU cores for each of SmolLM2's 30 layers. With the heads never confident
    (threshold above 1) a plain pass is one walk per head read and one to the last layer (one walk
    in all where the budget leaves no room for an early token)."""
    from selfspec.models.ledger import as_op

    g = AdaDecode(peaked.model, random_heads(peaked.model), threshold=1.1, max_early=16, exit_layers=None,
                  early_eos=False).generate(ids, 12)
    walks = [[op for op in map(as_op, t.row()["ops"]) if op.kind == "L"] for t in g.trace[1:]]
    assert walks and all(len(w) in (1, len(HEAD_LAYERS) + 1) for w in walks) and len(walks[0]) > 1
    assert all(sum(op.attention for op in w) == peaked.model.num_layers for w in walks)

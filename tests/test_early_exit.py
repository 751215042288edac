"""Early-exit self-speculation: greedy equals vanilla, exit-query reuse is exact, sampling is lossless."""

import pytest
import torch
from omegaconf import OmegaConf

from conftest import adaptive_rule, draft_stop, first_two_tokens_tv, method_config
from selfspec.config import model_config
from selfspec.decoding import DecodeState, Sampling, build_decoder
from selfspec.decoding.draft_exit import AdaptiveThreshold
from selfspec.decoding.early_exit import EarlyExit
from selfspec.models.loading import load_model


def agreeing_model(layers=6, damp=0.05):
    """tiny-random with ``layers`` layers whose layers >= 1 barely change the residual, so early
    exits often agree with the final layer (drafts get accepted and every path is exercised)."""
    loaded = load_model(OmegaConf.merge(model_config("tiny-random"), {"random": {"num_hidden_layers": layers}}))
    with torch.no_grad():
        for layer in loaded.model.hf.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(damp)
            layer.mlp.down_proj.weight.mul_(damp)
    return loaded


@pytest.fixture(scope="module")
def agree():
    return agreeing_model()


def ee(loaded, exit_layer, max_draft, draft_stop=None, **kw):
    """Early exit as the paper runs it, without the speculation gate unless ``never_slower`` is
    given (tests/test_gate.py tests the gate): every step drafts."""
    cfg = method_config("early_exit", **{"exit_layer": exit_layer, "max_draft": max_draft,
           "exit_head": kw.pop("exit_head", "lm_head"),
           "heads": kw.pop("heads", None), "draft_stop": draft_stop,
           "never_slower": kw.pop("never_slower", False),
           **{key: kw.pop(key) for key in ("prefill", "ngram") if key in kw}})
    return build_decoder(OmegaConf.create(cfg), loaded.model, **kw)


def vanilla(loaded, ids, n, sampling=None):
    return build_decoder(method_config("vanilla"), loaded.model).generate(ids, n, sampling).tokens


def test_greedy_equals_vanilla_every_exit_and_gamma(agree, tiny, prompt_ids):
    for loaded in (agree, tiny):
        ref = vanilla(loaded, prompt_ids, 24)
        for ell in range(loaded.model.num_layers - 1):
            for gamma in (1, 3, 6):
                g = ee(loaded, ell, gamma).generate(prompt_ids, 24)
                assert g.tokens == ref, (loaded.name, ell, gamma)
                assert sum(g.drafted_per_step) > 0
    # the agreeing model accepts drafts, so accepted and rejected paths are both exercised
    g = ee(agree, 1, 4).generate(prompt_ids, 40)
    assert 0.2 < g.acceptance_rate < 1.0 and g.tau > 1.5


@pytest.mark.parametrize("stop", [draft_stop("static", threshold=0.3), draft_stop("adaptive")])
def test_draft_stop_rules_keep_vanilla_output(agree, prompt_ids, stop):
    ref = vanilla(agree, prompt_ids, 40)
    d = ee(agree, 1, 12, stop)
    g = d.generate(prompt_ids, 40)
    assert g.tokens == ref
    assert max(g.drafted_per_step) < 12 or stop["rule"] == "adaptive"


def test_the_draft_below_the_threshold_is_still_verified(tiny, prompt_ids):
    """The draft-stop rule every chain method shares (Draft & Verify §3.4): on the random model no
    draft reaches confidence 0.99, so every round drafts exactly one token, which is verified."""
    g = ee(tiny, 1, 4, {"rule": "static", "threshold": 0.99}).generate(prompt_ids, 16)
    assert g.tokens == vanilla(tiny, prompt_ids, 16)
    assert max(g.drafted_per_step) == 1 and g.stats["draft_stops"] == sum(g.drafted_per_step) > 0


def test_budget_eos_and_stop_strings(agree, prompt_ids):
    ref = vanilla(agree, prompt_ids, 30)
    for n in (1, 2, 5, 13):
        assert ee(agree, 1, 6).generate(prompt_ids, n).tokens == ref[:n]
    eos = ref[9]
    g = ee(agree, 1, 6, eos_token_ids=[eos]).generate(prompt_ids, 30)
    assert g.tokens == ref[: ref.index(eos) + 1] and g.stop_reason == "eos"


def test_draft_prefill_equals_vanilla(agree, prompt_ids):
    """``prefill: draft`` (LayerSkip's code): the first round drafts from the prompt's layer-ℓ
    state and verifies the prompt and its drafts in one pass; greedy output is vanilla's for every
    exit layer and budget (one token: no draft, the prompt through both halves), and the rounds'
    statistics count the first round."""
    ref = vanilla(agree, prompt_ids, 20)
    for ell in range(agree.model.num_layers - 1):
        g = ee(agree, ell, 4, prefill="draft").generate(prompt_ids, 20)
        assert g.tokens == ref and g.trace[0].drafted == 4, ell
        rounds = g.steps - g.stats.get("plain_steps_gated", 0)
        assert g.stats["exit_layer_mean"] == ell and g.stats["draft_len_mean"] == sum(g.drafted_per_step) / rounds
    for n in (1, 2, 3):
        assert ee(agree, 1, 4, prefill="draft").generate(prompt_ids, n).tokens == ref[:n]
    one = prompt_ids[:1]  # a one-token prompt is x_0 itself
    assert ee(agree, 1, 4, prefill="draft").generate(one, 12).tokens == vanilla(agree, one, 12)
    ngram = {"max_ngram": 3, "min_ngram": 1, "max_draft": 4, "draft_schedule": "constant"}
    assert ee(agree, 1, 4, prefill="draft", ngram=ngram).generate(prompt_ids + prompt_ids, 20).tokens == \
        vanilla(agree, prompt_ids + prompt_ids, 20)
    with pytest.raises(ValueError, match=r"method\.prefill"):
        ee(agree, 1, 4, prefill="half")


def _steps(dec, loaded, ids, n_steps, sampling=Sampling()):
    prompt = torch.tensor([ids])
    cache = loaded.model.new_cache(len(ids) + 64)
    state = DecodeState(list(ids), len(ids), cache, sampling, torch.Generator().manual_seed(0))
    dec.begin(state)
    with torch.inference_mode():
        state.tokens.append(dec.prefill(state, prompt))
        for _ in range(n_steps):
            state.tokens.extend(dec.step(state, 64))
    return state


def test_exit_query_reuse_gives_the_recomputed_cache(agree, prompt_ids):
    """After each round every layer holds exactly the K/V a full pass over the committed tokens gives."""
    m = agree.model
    for ell, gamma in ((0, 3), (2, 5), (4, 2)):
        state = _steps(ee(agree, ell, gamma), agree, prompt_ids, 6)
        ref = m.new_cache(state.cache.max_length)
        with torch.inference_mode():
            m.forward(torch.tensor([state.tokens[:-1]]), ref, start=0)
        for i in range(m.num_layers):
            assert state.cache.length(i) == state.n_cached
            for a, b in zip(state.cache.layer_kv(i), ref.layer_kv(i)):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture
def disagreeing(agree):
    """The agreeing model with its upper layers 6× stronger (damping 0.3): drafts differ from the target."""
    scale = lambda f: [w.mul_(f) for layer in agree.model.hf.model.layers[1:]  # noqa: E731
                       for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)]
    with torch.no_grad():
        scale(6.0)
    yield agree
    with torch.no_grad():
        scale(1 / 6.0)


def test_sampling_preserves_target_distribution(disagreeing, prompt_ids):
    """Pairs of the first two tokens after the prompt under top-k sampling vs the exact target
    distribution p(a)·p(b|a): total variation below 0.12 (an unbiased sampler: ~0.055 with 400
    draws over 9 pairs; the draft's distribution at layer 0 is 0.45 away on the first token alone)."""
    tv = first_two_tokens_tv(ee(disagreeing, 0, 3), prompt_ids, Sampling(temperature=0.05, top_k=3, seed=0))
    assert tv < 0.12, f"total variation {tv:.4f}"


def test_adaptive_threshold_follows_draft_and_verify_rule():
    t = adaptive_rule(threshold=0.6, target=0.9, epsilon=0.01, beta1=0.5, beta2=0.9)
    t.update(drafted=4, accepted=2, hit_max=False)  # AR = 0.5 <= 0.9: up
    assert t.ar == 0.5 and t.value == pytest.approx(0.9 * 0.6 + 0.1 * 0.61)
    v = t.value
    t.update(drafted=2, accepted=2, hit_max=True)  # AR = 0.75: still up
    assert t.ar == pytest.approx(0.75) and t.value == pytest.approx(0.9 * v + 0.1 * (v + 0.01))
    for _ in range(5):
        t.update(drafted=2, accepted=2, hit_max=False)
    assert t.ar > 0.9 and t.value < v + 0.01  # lowered once AR exceeds the target
    w = t.value
    t.update(drafted=3, accepted=3, hit_max=True)  # never lowered when drafting hit the maximum
    assert t.value == w


def test_trained_heads_as_exit_heads(agree, tiny, prompt_ids, tmp_path):
    from selfspec.models.heads import IntermediateHeads, save_heads

    heads = IntermediateHeads(agree.model, [1, 3], "linear")
    with torch.no_grad():
        heads.heads["1"].weight.add_(0.01 * torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))
    save_heads(tmp_path / "h", heads, agree)
    ref = vanilla(agree, prompt_ids, 30)
    d = ee(agree, 1, 4, exit_head="heads", heads=str(tmp_path / "h"))
    assert d.drafter.heads.kind == "linear" and d.generate(prompt_ids, 30).tokens == ref
    with pytest.raises(ValueError, match="no exit head"):
        ee(agree, 2, 4, exit_head="heads", heads=str(tmp_path / "h"))
    with pytest.raises(ValueError, match="trained for model"):  # heads of another model
        ee(tiny, 1, 4, exit_head="heads", heads=str(tmp_path / "h"))
    with pytest.raises(ValueError, match=r"method.heads=.*missing is not allowed: no artefact there"):
        ee(agree, 1, 4, exit_head="heads", heads=str(tmp_path / "missing"))


def test_bad_config_stops_early(tiny):
    with pytest.raises(ValueError, match="exit_layer"):
        ee(tiny, 3, 4)  # the last layer is the final head itself
    with pytest.raises(ValueError, match="max_draft"):
        ee(tiny, 1, 0)
    with pytest.raises(ValueError, match="exit_head"):
        ee(tiny, 1, 2, exit_head="nope")
    with pytest.raises(ValueError, match="draft_stop.rule"):
        ee(tiny, 1, 2, {"rule": "magic"})


def compose_method(name):
    from selfspec.config import compose

    return compose([f"+method={name}", "model=tiny-random"], "train").method


@pytest.mark.parametrize("name", ["early_exit", "early_exit_dv_threshold"])
def test_method_configs_build(tiny, name):
    cfg = compose_method(name)
    cfg.exit_layer = 1
    d = build_decoder(cfg, tiny.model)
    assert isinstance(d, EarlyExit) and d.drafter.max_draft == cfg.max_draft
    assert (name == "early_exit_dv_threshold") == isinstance(d.drafter.draft_stop, AdaptiveThreshold)

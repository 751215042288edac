"""Drafts from the context first (issue 12, ``method.ngram``) inside every self-drafting method:
Draft & Verify, early exit, DEL and AdaDecode copy the tokens that followed the longest matching
n-gram when the context matches and self-draft otherwise; the output stays vanilla's."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from conftest import cpu_like_profile, method_config, rolled_back_steps

from selfspec.config.checks import ConfigError
from selfspec.decoding import Sampling, build_decoder, check_method
from selfspec.decoding.ngram import ContextDrafter

NGRAM = {"max_ngram": 3, "min_ngram": 2, "max_draft": 6, "draft_schedule": "adaptive"}
#: one config per self-drafting method, on the tiny model without artefacts; always speculating
METHODS = {
    "draft_verify": method_config("draft_verify", **{"skip_attn": [1, 2], "skip_mlp": [2]}),
    "early_exit": method_config("early_exit", **{"exit_layer": 1, "max_draft": 4, "exit_head": "lm_head"}),
    "del": method_config("del", **{"exit_head": "lm_head", "max_draft": 4, "draft_stop": None}),
    "adadecode": method_config("adadecode", **{"head_kind": "lm_head", "layers": [1, 2], "threshold": 0.0}),
}


def decoder(loaded, method: str, ngram=NGRAM, **kw):
    cfg = dict(METHODS[method], ngram=ngram)
    if method != "adadecode":
        cfg["never_slower"] = False
    if method == "del":  # its TPL is priced by a profile (cost_model: measured)
        kw.setdefault("profile", cpu_like_profile(loaded.model))
    return build_decoder(OmegaConf.create(cfg), loaded.model, **kw)


def vanilla_tokens(loaded, ids, n, sampling=None):
    return build_decoder(method_config("vanilla"), loaded.model).generate(ids, n, sampling).tokens


@pytest.fixture(scope="module")
def looping(tiny):
    """A prompt whose continuation repeats text it holds (the random model's greedy loop, three
    times): the lookup matches at most steps, yet not at all of them."""
    base = tiny.tokenizer("a b c d")["input_ids"]
    return base + vanilla_tokens(tiny, base, 12) * 3


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_equals_vanilla_and_both_draft_sources_run(tiny, looping, prompt_ids, method):
    for ids in (looping, prompt_ids):
        ref = vanilla_tokens(tiny, ids, 40)
        g = decoder(tiny, method).generate(ids, 40)
        assert g.tokens == ref, (method, ids is looping)
        assert sum(g.accepted_per_step) == len(g.tokens) and len(g.drafted_per_step) == g.steps
    looped = decoder(tiny, method).generate(looping, 40)
    assert looped.stats["ngram_steps"] > 0 and looped.stats["ngram_accepted"] > 0
    # the step trace says which steps drafted from the context: the methods count their own rounds
    # from it (DecodeState.steps_from), not from another feature's statistic (issue 40)
    assert looped.stats["ngram_steps"] == sum(t.source == "context" for t in looped.trace)
    # the method's own drafts run where the context does not match: more drafting steps than context ones
    drafting = sum(1 for d in looped.drafted_per_step if d)
    assert drafting > looped.stats["ngram_steps"], looped.stats
    # without the sub-config the method never drafts from the context
    assert "ngram_steps" not in decoder(tiny, method, ngram=None).generate(looping, 40).stats


@pytest.mark.parametrize("method", ["draft_verify", "early_exit", "adadecode"])
def test_cache_after_context_and_self_drafts_equals_recomputation(tiny, looping, method):
    rolled_back_steps(decoder(tiny, method), looping, steps=10)


def test_context_drafts_do_not_move_the_method_policy(tiny, looping):
    """Draft & Verify's adaptive threshold learns from its own drafts only: its update runs once
    per self-drafted step, never after a step whose drafts came from the context."""
    dec = decoder(tiny, "draft_verify")
    updates = []
    real = dec.drafter.draft_stop.update
    dec.drafter.draft_stop.update = lambda *a: updates.append(a) or real(*a)
    g = dec.generate(looping, 40)
    assert g.stats["ngram_steps"] > 0
    assert len(updates) == g.stats["verifications"] - g.stats["ngram_steps"] > 0


@pytest.mark.parametrize("method", ["draft_verify", "early_exit"])
def test_sampling_is_seeded_and_drafts_from_the_context(tiny, looping, method):
    s = Sampling(temperature=0.1, top_k=3, seed=3)
    a = decoder(tiny, method).generate(looping, 30, s)
    b = decoder(tiny, method).generate(looping, 30, s)
    assert a.tokens == b.tokens and a.stats["ngram_steps"] > 0


def test_ngram_sub_config_is_checked_before_loading():
    dv = OmegaConf.create(dict(METHODS["draft_verify"]))
    assert check_method(dv).ngram is None
    full = {"max_ngram": 3, "min_ngram": 1, "max_draft": 4, "draft_schedule": "adaptive"}
    assert check_method(OmegaConf.merge(dv, {"ngram": full})).ngram.config() == full
    with pytest.raises(ConfigError, match=r"method\.ngram\.draft_schedule=sometimes .*adaptive, constant"):
        check_method(OmegaConf.merge(dv, {"ngram": {**full, "draft_schedule": "sometimes"}}))
    with pytest.raises(ConfigError, match=r"method\.ngram\.max_ngrams is not a key"):
        check_method(OmegaConf.merge(dv, {"ngram": {**full, "max_ngrams": 4}}))
    with pytest.raises(ConfigError, match=r"lacks method\.ngram\.draft_schedule"):
        check_method(OmegaConf.merge(dv, {"ngram": {"max_ngram": 3, "min_ngram": 1, "max_draft": 4}}))
    # PPD's context chain has a fixed length; the n-gram method's keys are its own
    with pytest.raises(ConfigError, match=r"method\.ngram\.draft_schedule is not a key"):
        check_method(method_config("ppd", **{"ngram": {"draft_schedule": "constant"}}))
    with pytest.raises(ConfigError, match=r"method\.ngram"):
        check_method(method_config("ngram", **{"ngram": {"max_draft": 4}}))


def test_presets_compose_and_build_a_context_drafter(tiny):
    from selfspec.config import compose

    for name in ("draft_verify_ngram", "early_exit_ngram", "del_heads_ngram", "adadecode_ngram"):
        cfg = compose([f"method={name}", "model=tiny-random", "task=xsum"]).method
        assert check_method(cfg).ngram.min_ngram == 2, name
    dec = build_decoder(OmegaConf.create(dict(METHODS["early_exit"], ngram=NGRAM)), tiny.model)
    assert isinstance(dec.context, ContextDrafter) and dec.room >= NGRAM["max_draft"] + 1
    with torch.inference_mode():
        assert dec.generate(tiny.tokenizer("a b a b a b")["input_ids"], 3).new_tokens == 3

"""N-gram lookup decoding: the matcher by hand, lossless against vanilla, target distribution, config."""

import pytest
import torch
from omegaconf import OmegaConf

from conftest import cpu_like_profile, method_config, method_options, rolled_back_steps

from selfspec.config import compose, model_config
from selfspec.config.checks import ConfigError
from selfspec.decoding import Sampling, build_decoder, check_method
from selfspec.decoding.base import DecodeState
from selfspec.decoding.ngram import AcceptanceTable, NgramIndex, NgramLookup
from selfspec.decoding.sampling import warp
from selfspec.models.loading import load_model

REPEAT = "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog"


def ngram(loaded, eos=(), **kw):
    """``method=ngram`` as configured (its ``priced`` schedule priced with a CPU-like profile)."""
    return build_decoder(method_config("ngram", **kw), loaded.model, eos_token_ids=eos,
                         profile=cpu_like_profile(loaded.model))


def vanilla_tokens(loaded, ids, n, eos=()):
    return build_decoder(method_config("vanilla"), loaded.model, eos_token_ids=eos).generate(ids, n).tokens


# --- the matcher -------------------------------------------------------------------------------
def test_matcher_longest_suffix_first_then_shorter():
    #        0  1  2  3  4  5  6  7  8  9  10
    seq = [1, 2, 9, 4, 8, 2, 9, 6, 1, 2, 9]
    # 3-gram (1, 2, 9) ends at 3 earlier -> copy from 3; (2, 9) alone would copy from 7
    assert NgramIndex(1, 3).lookup(seq, 3) == ([4, 8, 2], 3)
    assert NgramIndex(1, 2).lookup(seq, 3) == ([6, 1, 2], 2)
    assert NgramIndex(1, 3).match(seq) == (3, 3)


def test_matcher_takes_the_most_recent_occurrence():
    seq = [5, 1, 7, 1, 8, 1]  # (1) ended at 2 and at 4: the later one (followed by 8) wins
    assert NgramIndex(1, 1).lookup(seq, 1) == ([8], 1)
    # past the end the copy continues from its own drafts: 8, 1, then 8 again
    assert NgramIndex(1, 1).lookup(seq, 3) == ([8, 1, 8], 1)


def test_matcher_copies_periodic_repeats_beyond_the_sequence():
    assert NgramIndex(1, 2).lookup([5, 5, 5], 4) == ([5, 5, 5, 5], 2)
    seq = [1, 2, 3, 4, 1, 2]
    assert NgramIndex(1, 3).lookup(seq, 4) == ([3, 4, 1, 2], 2)
    assert NgramIndex(1, 3).lookup(seq, 6) == ([3, 4, 1, 2, 3, 4], 2)


def test_matcher_no_match_and_limits():
    assert NgramIndex(1, 3).lookup([1, 2, 3], 5) == ([], 0)
    assert NgramIndex(2, 3).lookup([1, 2, 1], 5) == ([], 0)  # only a 1-gram matches, below min_n
    assert NgramIndex(1, 3).lookup([7], 5) == ([], 0)
    assert NgramIndex(1, 3).lookup([4, 4], 0) == ([], 1)  # a match, but no room to draft
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(3, 2)


def test_matcher_grows_incrementally_like_a_fresh_index():
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    grown = NgramIndex(1, 3)
    for end in range(1, len(seq) + 1):
        assert grown.lookup(seq[:end], 4) == NgramIndex(1, 3).lookup(seq[:end], 4), end


# --- decoding: lossless and the controller ---------------------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"draft_schedule": "constant", "max_draft": 3},
                                {"min_ngram": 2, "max_ngram": 4, "max_draft": 12}, {"max_ngram": 1, "max_draft": 1}])
def test_greedy_equals_vanilla_with_and_without_repetition(tiny, prompt_ids, kw):
    repeat_ids = tiny.tokenizer(REPEAT)["input_ids"]
    for ids, repeats in ((repeat_ids, True), (prompt_ids, False)):
        ref = vanilla_tokens(tiny, ids, 40)
        g = ngram(tiny, **kw).generate(ids, 40)
        assert g.tokens == ref, (kw, repeats)
        assert sum(g.accepted_per_step) == len(g.tokens) and len(g.drafted_per_step) == g.steps
        if repeats:
            assert sum(g.drafted_per_step) > 0 and g.stats["verifications"] > 0


def test_copies_are_accepted_where_the_output_repeats(tiny):
    """The random model's greedy output falls into a loop (period 3 here): the copy of the loop is
    accepted whole (7 tokens in one step), and the other steps stay plain."""
    base = tiny.tokenizer("a b c d")["input_ids"]
    ids = base + vanilla_tokens(tiny, base, 12) * 3
    g = ngram(tiny, max_draft=6, draft_schedule="adaptive").generate(ids, 24)
    assert g.tokens == vanilla_tokens(tiny, ids, 24)
    assert g.tau > 1.3 and max(g.accepted_per_step) == 7 and g.stats["plain_steps"] > 0


def test_no_match_is_a_plain_step(tiny):
    """Distinct prompt tokens and min_ngram = 3: the first step finds nothing and drafts nothing."""
    ids = list(range(1000, 1030))
    dec = ngram(tiny, min_ngram=3)
    state = DecodeState(list(ids), len(ids), tiny.model.new_cache(64), Sampling(), None)
    with torch.inference_mode():
        dec.begin(state)
        dec._commit(state, [dec.prefill(state, torch.tensor([ids]))], 8)
        new = dec.step(state, 8)
    assert state.drafted == 0 and len(new) == 1 and state.stats == {"plain_steps": 1}
    assert state.cache.length(0) == state.n_cached + 1
    assert [*state.tokens[len(ids):], *new] == vanilla_tokens(tiny, ids, 2)


def test_eos_and_budget_cut_like_vanilla(tiny):
    ids = tiny.tokenizer(REPEAT)["input_ids"]
    free = vanilla_tokens(tiny, ids, 25)
    eos = free[9]
    g = ngram(tiny, eos=[eos]).generate(ids, 25)
    assert g.tokens == vanilla_tokens(tiny, ids, 25, eos=[eos]) and g.stop_reason == "eos"
    for n in (1, 2, 7):
        assert ngram(tiny).generate(ids, n).tokens == free[:n]


def test_cache_after_rollback_equals_recomputation(tiny):
    ids = tiny.tokenizer(REPEAT)["input_ids"]
    dec = ngram(tiny, draft_schedule="constant", max_draft=5)
    real = NgramIndex.match
    # where nothing matches, draft the pending token repeated (mostly rejected: rollbacks): a
    # 1-gram "match" ending at the last position copies it, then its own copies
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NgramIndex, "match", lambda self, tokens, indexed=None: real(self, tokens) if real(self, tokens)[0]
                   else (1, len(tokens) - 1))
        rejected = rolled_back_steps(dec, ids)
    assert rejected > 0  # the rollback path was exercised


def test_adaptive_draft_length_follows_acceptance(tiny):
    dec = NgramLookup(tiny.model, method_options("ngram", max_ngram=3, min_ngram=1, max_draft=6, draft_schedule="adaptive"))
    ex = dec.context.new_example(None)
    assert ex.draft_len == 6
    dec.context.adapt(ex, accepted=1, drafted=6)
    dec.context.adapt(ex, accepted=0, drafted=5)
    assert ex.draft_len == 4
    dec.context.adapt(ex, accepted=4, drafted=4)
    assert ex.draft_len == 6
    dec.context.adapt(ex, accepted=6, drafted=6)
    assert ex.draft_len == 6  # capped at max_draft
    for _ in range(10):
        dec.context.adapt(ex, accepted=0, drafted=1)
    assert ex.draft_len == 1  # never below one draft
    const = NgramLookup(tiny.model, method_options("ngram", max_ngram=3, min_ngram=1, max_draft=6,
                                                   draft_schedule="constant"))
    ex = const.context.new_example(None)
    const.context.adapt(ex, accepted=0, drafted=6)
    assert ex.draft_len == 6


def test_acceptance_table_counts_the_verified_positions():
    """A chain's drafts after the first rejection are never verified: 2 of 5 accepted counts
    positions 0-2 as verified, 0-1 as accepted; all of 3 accepted counts 0-2 both ways."""
    t = AcceptanceTable(max_ngram=3, max_draft=5)
    t.memory = float("inf")  # no forgetting: whole counts
    t.record(2, drafted=5, accepted=2)
    t.record(2, drafted=3, accepted=3)
    assert t.verified[2] == [2, 2, 2, 0, 0] and t.accepted[2] == [2, 2, 1, 0, 0]
    assert t.verified[1] == [0] * 5  # per match length
    # α(2, 0) = (2 + 2 · 1/2) / 4; α(2, 1) = (2 + 2 · 0.75) / 4; α(2, 2) = (1 + 2 · 0.875) / 4; the
    # positions never verified take the one before's
    assert t.acceptances(2, 5) == [0.75, 0.875, 0.6875, 0.6875, 0.6875]
    assert t.acceptances(2, 3)[2] == 0.6875 and t.acceptances(1, 2) == [0.5, 0.5]


def test_priced_length_maximises_expected_tokens_per_cost():
    """Known acceptance and pass costs give the length by hand: E(k) / cost(k + 1), k = 0 when no
    draft beats a plain step's 1 / cost(1)."""
    cost = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 2.0}.__getitem__
    t = AcceptanceTable(max_ngram=3, max_draft=4)
    # 8 of 8 accepted at every position: α = 0.9, 0.98, 0.996, 0.9992; E = 1, 1.9, 2.862, 3.8506,
    # 4.8475 over costs 1, 1.1, 1.2, 1.3, 2.0: rates 1, 1.727, 2.385, 2.962, 2.424
    t.verified[3], t.accepted[3] = [8] * 4, [8] * 4
    assert t.best_length(3, 4, cost) == 3
    assert t.best_length(3, 2, cost) == 2             # cut by the room left
    # α(1, 0) = (0 + 1) / 12: E(1) = 1.083 / 1.1 < 1 / 1: a plain step
    t.verified[1][0], t.accepted[1][0] = 10, 0
    assert t.best_length(1, 4, cost) == 0
    t.record(1, drafted=1, accepted=0)  # older drafts weigh less: 10 of them weigh 10 (1 - 1/32)
    assert t.verified[1][0] == pytest.approx(10 * (1 - 1 / 32) + 1)
    # untried positions: α = 1/2, rates 1.5 / 1.1 = 1.364, 1.75 / 1.2 = 1.458, 1.875 / 1.3 = 1.442
    assert t.best_length(2, 4, cost) == 2
    # on a machine where width is free, the longest draft pays
    assert t.best_length(3, 4, lambda rows: 1.0) == 4


def test_priced_length_grows_while_copies_are_accepted_and_stops_when_rejected():
    """From the prior (two drafts) the length grows while every draft is accepted, up to
    max_draft on the CPU-like costs; after rejections at the first position it drafts nothing."""
    cost = {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 1.475, 6: 1.65, 7: 1.825, 8: 2.0, 9: 2.175}.__getitem__
    t = AcceptanceTable(max_ngram=3, max_draft=8)
    lengths = []
    for _ in range(12):
        lengths.append(t.best_length(3, 8, cost))
        t.record(3, lengths[-1], lengths[-1])
    assert lengths[0] == 2 and lengths == sorted(lengths) and lengths[-1] == 8, lengths
    rejected = 0
    while (k := t.best_length(3, 8, cost)) and rejected < 100:
        t.record(3, k, 0)
        rejected += 1
    # the memory forgets the accepted copies: a one-token draft pays down to α(3, 0) = 0.1, which
    # the decaying counts reach after ~50 rejections (each wasting a tenth of a step)
    assert k == 0 and rejected < 64, rejected


@pytest.mark.parametrize("max_draft", [1, 6])
def test_priced_schedule_is_lossless(tiny, prompt_ids, max_draft):
    base = tiny.tokenizer("a b c d")["input_ids"]
    for ids in (base + vanilla_tokens(tiny, base, 12) * 3, prompt_ids):
        dec = ngram(tiny, max_draft=max_draft, never_slower=False)
        assert dec.context.draft_schedule == "priced"
        g = dec.generate(ids, 40)
        assert g.tokens == vanilla_tokens(tiny, ids, 40)
        assert sum(g.accepted_per_step) == len(g.tokens)
    assert sum(g.drafted_per_step) > 0 and max(g.drafted_per_step) <= max_draft


def test_priced_acceptance_carries_over_examples_but_not_the_warmup(tiny):
    base = tiny.tokenizer("a b c d")["input_ids"]
    ids = base + vanilla_tokens(tiny, base, 12) * 3
    dec = ngram(tiny)
    with dec.kept_state():
        dec.generate(ids, 16)
    assert sum(map(sum, dec.context.acceptance.verified)) == 0  # the warm-up left nothing behind
    dec.generate(ids, 16)
    seen = sum(map(sum, dec.context.acceptance.verified))
    assert seen > 0
    dec.generate(ids, 16)
    assert sum(map(sum, dec.context.acceptance.verified)) > seen  # the next example goes on counting


def test_priced_schedule_without_a_profile_is_refused(tiny):
    """Built directly without a profile (an evaluation with profile=null is refused before the
    model loads: tests/test_bad_input.py)."""
    with pytest.raises(ValueError, match=r"draft_schedule=priced .* the run has none: set profile=auto"):
        build_decoder(method_config("ngram"), tiny.model)


# --- sampling --------------------------------------------------------------------------------------
def test_sampling_with_point_mass_drafts_matches_target_distribution():
    """First token emitted by a step (the accepted draft or a residual resample) ~ p.

    As the Draft & Verify test: a 512-token-vocabulary random model, top_k = 6, N = 1,600 steps; an
    unbiased sampler's total variation from p is ~0.023 (sd ~0.009), the bound is 0.055. The draft
    token d is chosen with 0.25 <= p(d) <= 0.75, so both the accept and the residual path run
    often, and a sampler that resampled from p instead of the residual (P(d) = p(d)(2 - p(d))) or
    always kept the draft is at least 0.18 away.
    """
    cfg = OmegaConf.merge(model_config("tiny-random"),
                          {"tokenizer": None, "random": {"vocab_size": 512, "num_hidden_layers": 4, "seed": 2}})
    model = load_model(cfg).model
    s = Sampling(temperature=0.05, top_k=6, seed=0)
    base = list(range(40, 70))
    # the pending token 45 occurred once before, followed by the draft d (written at index 6);
    # d: the token whose p(d) in that context is nearest 0.5
    with torch.inference_mode():
        contexts = torch.tensor([[*base[:6], d, *base[7:], 45] for d in range(512)])
        p_all = warp(model.logits(model.forward(contexts, None, start=0)[:, -1]), s)
        d = int((p_all.diagonal() - 0.5).abs().argmin())
        ids = contexts[d].tolist()
        p = warp(model.logits(model.forward(torch.tensor([ids]), None, start=0)[:, -1])[0], s)
        assert 0.25 <= p[d] <= 0.75, f"p(d) = {p[d]:.3f}"
        dec = NgramLookup(model, method_options("ngram", max_ngram=2, min_ngram=1, max_draft=2,
                                                draft_schedule="adaptive"))
        gen = torch.Generator().manual_seed(0)
        state = DecodeState(list(ids), len(ids), model.new_cache(64), s, gen)
        model.forward(torch.tensor([ids[:-1]]), state.cache, start=0)
        base_len = state.n_cached
        dec.begin(state)
        assert state.context.index.lookup(ids, 2)[0][0] == d
        counts = torch.zeros_like(p)
        accepted = 0
        n = 1600
        for _ in range(n):
            new = dec.step(state, budget=3)
            assert state.drafted >= 1
            accepted += len(new) > 1
            counts[new[0]] += 1
            state.cache.truncate(base_len)
    tv = 0.5 * (counts / n - p).abs().sum()
    assert 0.15 * n < accepted < 0.85 * n  # both paths exercised
    assert tv < 0.055, f"total variation {tv:.4f} (p(d) = {p[d]:.3f})"


def test_sampling_is_seeded_and_drafts(tiny):
    """Sharp sampling (T = 0.1, top-k 3) on the looping output of the random model: drafts run."""
    base = tiny.tokenizer("a b c d")["input_ids"]
    ids = base + vanilla_tokens(tiny, base, 12) * 3
    s = Sampling(temperature=0.1, top_k=3, seed=5)
    a = ngram(tiny).generate(ids, 24, s)
    b = ngram(tiny).generate(ids, 24, s)
    assert a.tokens == b.tokens and len(a.tokens) == 24 and sum(a.drafted_per_step) > 0


# --- configuration ---------------------------------------------------------------------------------
def test_method_config_composes_and_is_checked():
    cfg = compose(["model=tiny-random", "method=ngram"])
    assert check_method(cfg.method).values() == {"max_ngram": 3, "min_ngram": 1, "max_draft": 8, "draft_schedule": "priced",
                                        "never_slower": True}


@pytest.mark.parametrize("kw,message", [
    ({"max_ngram": 0}, r"method\.max_ngram=0 is not allowed: must be >= 1"),
    ({"min_ngram": 3, "max_ngram": 2}, r"method\.min_ngram=3 is not allowed: must be in \[1, 2\]"),
    ({"min_ngram": 0}, r"method\.min_ngram=0 is not allowed"),
    ({"max_draft": 0}, r"method\.max_draft=0 is not allowed: must be >= 1"),
    ({"max_draft": 2.5}, r"method\.max_draft=2\.5 is not allowed: must be an integer"),
    ({"draft_schedule": "sometimes"}, r"method\.draft_schedule=sometimes is not allowed: must be one of adaptive"),
    ({"ngram_size": 2}, r"ngram_size"),
])
def test_bad_config_is_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        check_method(method_config("ngram", **kw))


def test_config_lacking_a_key_is_refused_by_name():
    """The lookup's values are written once, in the YAML: a config without one names it."""
    with pytest.raises(ConfigError, match=r"lacks method\.max_draft.*conf/method/ngram\.yaml"):
        check_method(OmegaConf.create({"name": "ngram", "max_ngram": 3, "min_ngram": 1, "draft_schedule": "constant"}))


def test_drafts_accepted_past_a_stop_string_count_as_accepted(tiny):
    """The acceptance rate counts the drafts the verification accepted, also those past the point
    where a stop string then ends the output (they were accepted, only not kept). Counted after the
    cut, a short answer's last drafts looked rejected: Gemma 3's GSM8K answers (6-20 tokens, ended by
    ``\\nQuestion:``) showed 0.63. Reference: the same decoding without the stop string, whose steps
    up to the cut are the same steps, uncut."""
    base = tiny.tokenizer("a b c d")["input_ids"]
    ids = base + vanilla_tokens(tiny, base, 12) * 3
    free = ngram(tiny, max_draft=6, draft_schedule="adaptive").generate(ids, 24)
    decode, tokens = tiny.tokenizer.decode, free.tokens
    starts = [sum(free.accepted_per_step[:i]) for i in range(free.steps)]
    for i in range(1, free.steps - 1):  # a stop string whose first occurrence ends on step i's first token
        p = starts[i]
        stop = decode(tokens[: p + 1])  # the output repeats with period 3: a shorter string occurs earlier
        if free.drafted_per_step[i] and free.accepted_per_step[i] >= 3 and stop not in decode(tokens[:p]):
            break
    else:
        pytest.fail(f"no step of {free.accepted_per_step} can be cut by a stop string")
    cut = build_decoder(method_config("ngram", max_draft=6, draft_schedule="adaptive"), tiny.model,
                        profile=cpu_like_profile(tiny.model), stop_strings=[stop],
                        tokenizer=tiny.tokenizer).generate(ids, 24)
    assert cut.stop_reason == "stop" and cut.tokens == tokens[: p + 1] and cut.steps == i + 1
    assert cut.accepted_per_step == free.accepted_per_step[:i] + [1]  # what was kept
    assert cut.verified_per_step == free.accepted_per_step[: i + 1]  # what the verification gave
    kept_only = sum(max(a - 1, 0) for a, d in zip(cut.accepted_per_step, cut.drafted_per_step) if d)
    assert cut.accepted_drafts == sum(max(a - 1, 0) for a, d in zip(free.accepted_per_step[: i + 1],
                                                                     free.drafted_per_step[: i + 1]) if d)
    assert cut.accepted_drafts > kept_only and cut.acceptance_rate > kept_only / sum(cut.drafted_per_step)

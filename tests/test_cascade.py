"""The n-gram lookup drafting for a method's own drafter (``method.draft_ngram``; a vertical cascade of
drafters, ML-SpecQD's second level): the lookup's guesses ride as extra rows of a draft pass and the
drafter keeps those it would have drafted itself. The drafts are the drafter's own, token for token under
greedy decoding and in distribution under sampling; only the number of draft passes changes."""

from __future__ import annotations

import pytest
import torch

from conftest import first_two_tokens_tv, method_config
from selfspec.decoding import DecodeState, Sampling, build_decoder, check_method
from selfspec.decoding.chain import Draft
from selfspec.decoding.draft_verify import DraftVerify
from selfspec.decoding.ngram import ContextDrafter
from selfspec.decoding.sampling import warp

CONSTANT = {"max_ngram": 3, "min_ngram": 1, "max_draft": 5, "draft_schedule": "constant"}
#: drafters the lookup drafts for (label: method, keys): the quantised self-draft, Draft & Verify's skip set,
#: KnapSpec's and CLaSp's searched ones, and the self-draft after the context drafter's first level
DRAFTERS = {
    "quant_draft": ("quant_draft", {"max_draft": 6}),
    "draft_verify": ("draft_verify", {"skip_attn": [1], "skip_mlp": [2], "max_draft": 6, "draft_stop": None}),
    "knapspec": ("knapspec", {"interval": 4, "search_at": 2, "window": 2, "draft_weights": "int8", "draft_stop": None}),
    "clasp": ("clasp", {"interval": 4, "skip_layers": 1, "draft_stop": None}),
    "quant_draft_ngram": ("quant_draft_ngram", {"max_draft": 6}),
    # Draft & Verify's adaptive draft stop (its default): a stop may cut a pass's kept guesses off
    "draft_verify_adaptive": ("draft_verify", {"skip_attn": [1], "skip_mlp": [2], "max_draft": 6}),
}


def _state(sampling: Sampling) -> DecodeState:
    gen = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
    return DecodeState(tokens=[1], prompt_len=1, cache=None, sampling=sampling, generator=gen)


def _draft_passes(g) -> int:
    return sum(op[0] == "draft" and op[1].startswith("L") for t in g.trace for op in t.row().get("ops", []))


@pytest.fixture(scope="module")
def measured(tiny):
    """This machine's profile of the tiny model with its quantised tables (small and quick)."""
    from selfspec.evaluation.profiling import measure_profile

    return measure_profile(tiny.model, rows=(1, 2), prefill_rows=(), contexts=(0, 16), repeats=1)


@pytest.fixture(scope="module")
def looping(tiny):
    """A prompt whose continuation repeats text it holds (the random model's greedy loop, three times)."""
    base = tiny.tokenizer("a b c d")["input_ids"]
    return base + build_decoder(method_config("vanilla"), tiny.model).generate(base, 12).tokens * 3


def test_greedy_keeps_the_guesses_the_drafter_would_have_drafted_then_its_own_token():
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate([2, 4, 0, 1]):
        logits[row, best] = 5.0
    draft = Draft()
    assert draft.extend([2, 4, 3], logits, _state(Sampling())) == (2, True)
    assert draft.tokens == [2, 4, 0] and draft.probs == [] and draft.confidences == [None] * 3
    draft = Draft([7], [], [None])  # after a draft of one token: appended after it
    assert draft.extend([5, 4], logits[:3], _state(Sampling())) == (0, True) and draft.tokens == [7, 2]


def test_the_draft_stop_rule_and_eos_end_a_checked_draft_as_they_end_a_drafted_one():
    logits = torch.zeros(3, 6)
    logits[0, 2], logits[1, 4], logits[2, 0] = 9.0, 0.5, 9.0  # row 1 is unsure
    draft = Draft()
    assert draft.extend([2, 4], logits, _state(Sampling()), threshold=0.5) == (2, False)
    assert draft.tokens == [2, 4] and draft.stopped and draft.confidences[1] < 0.5 < draft.confidences[0]
    draft = Draft()
    assert draft.extend([2, 4], logits, _state(Sampling()), eos=frozenset({2})) == (1, False)  # 4 is cut off
    assert draft.tokens == [2] and not draft.stopped


def test_a_checked_token_is_drawn_from_the_drafters_distribution_and_carries_it_as_q():
    """Sampling: the first appended token over 4,000 draws against the drafter's warped row 0, the second
    (after the guess, the likeliest token, was kept: ~2,000 draws) against row 1; an unbiased sampler's total
    variation is ~0.02."""
    torch.manual_seed(0)
    logits = torch.randn(2, 5) * 1.5
    sampling = Sampling(temperature=0.8, seed=3)
    p = warp(logits, sampling)
    state = _state(sampling)
    guess = int(p[0].argmax())
    first, second, n = torch.zeros(5), torch.zeros(5), 4000
    for _ in range(n):
        draft = Draft()
        kept, _ = draft.extend([guess], logits, state)
        first[draft.tokens[0]] += 1
        assert torch.equal(draft.probs[0], p[0]) and len(draft.probs) == len(draft.tokens) == kept + 1
        if kept:
            second[draft.tokens[1]] += 1
            assert torch.equal(draft.probs[1], p[1])
    assert 0.5 * (first / n - p[0]).abs().sum() < 0.04
    assert abs(first[guess] / n - p[0, guess]) < 0.03  # the guess is kept as often as the drafter would draw it
    assert 0.5 * (second / second.sum() - p[1]).abs().sum() < 0.06


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_the_same_drafts_in_fewer_passes(tiny, measured, looping, name):
    """Greedy: vanilla's tokens, and every step drafts and accepts what the drafter alone drafts and accepts,
    with fewer draft passes where the lookup's guesses were kept."""
    profile = measured
    name, cfg = DRAFTERS[name]
    cfg = dict(cfg, never_slower=False)
    alone = build_decoder(method_config(name, **cfg), tiny.model, profile=profile).generate(looping, 40)
    both = build_decoder(method_config(name, draft_ngram=CONSTANT, **cfg), tiny.model, profile=profile).generate(
        looping, 40)
    vanilla = build_decoder(method_config("vanilla"), tiny.model).generate(looping, 40).tokens
    assert alone.tokens == both.tokens == vanilla
    assert both.drafted_per_step == alone.drafted_per_step and both.accepted_per_step == alone.accepted_per_step
    assert both.stats["draft_ngram_accepted"] > 0
    # the kept guesses are on the step trace: their host work is not priced per draft (Profile.host_step)
    assert sum(t.guessed for t in both.trace) == both.stats["draft_ngram_accepted"]
    if "skip_searches" in alone.stats:  # KnapSpec's and CLaSp's searches ran, and chose skip sets
        assert both.stats["skip_searches"] == alone.stats["skip_searches"] > 0
    if not both.stats.get("draft_stops"):  # each kept guess is a pass saved
        assert _draft_passes(both) == _draft_passes(alone) - both.stats["draft_ngram_accepted"]
    else:
        assert both.stats["draft_stops"] == alone.stats["draft_stops"]
        assert _draft_passes(both) <= _draft_passes(alone)


def test_the_priced_schedule_guesses_where_the_profile_says_it_pays(tiny, measured, looping, monkeypatch):
    vanilla = build_decoder(method_config("vanilla"), tiny.model).generate(looping, 40).tokens

    def run():
        dec = build_decoder(method_config("quant_draft_cascade", never_slower=False, max_draft=6), tiny.model,
                            profile=measured)
        return dec, dec.generate(looping, 40)

    dec, g = run()
    assert g.tokens == vanilla and g.stats["draft_ngram_steps"] > 0
    assert "drafter.lookup.acceptance" in dec.carried()  # its counts carry over between examples
    # a pass that costs what its rows do never pays for a guess that is not certain: none is sent
    monkeypatch.setattr(ContextDrafter, "pass_cost", lambda self, rows, context, **draft: float(rows))
    dec, g = run()
    assert g.tokens == vanilla and "draft_ngram_steps" not in g.stats
    # a pass whose rows are free takes guesses wherever the lookup matches
    monkeypatch.setattr(ContextDrafter, "pass_cost", lambda self, rows, context, **draft: 1.0)
    dec, g = run()
    assert g.tokens == vanilla and g.stats["draft_ngram_steps"] > 0


def test_a_drafters_pass_is_priced_as_the_ops_it_records(tiny, measured):
    """Profile.draft_pass_cost: the walk over the copy (less a skip set's sublayers) and the head it records,
    and one call's host work; the target's pass and a copy's differ."""
    from selfspec.models.ledger import HeadOp, LayerOp
    from selfspec.models.passes import SkipSet

    m = tiny.model
    skip = SkipSet.of(attn=[1], mlp=[1, 2])
    ops = [LayerOp("draft", 3, m.num_layers - 1, m.num_layers - 2, 16, weights="int8"),
           HeadOp("draft", 3, m.vocab_size, "int8")]
    want = sum(measured.op(op) for op in ops) + measured.host_draft
    assert measured.draft_pass_cost(3, 16, weights="int8", skip=skip) == pytest.approx(want)
    assert measured.draft_pass_cost(3, 16, weights="int8") != measured.draft_pass_cost(3, 16)
    assert measured.host_step("self", 5, 2) == pytest.approx(measured.host_steps.get("self", 0.0)
                                                                 + 3 * measured.host_draft)


@pytest.mark.parametrize("batch", [1, 2])
def test_sampling_with_the_cascade_keeps_the_target_distribution(peaked_llama, batch):
    """The first two tokens of 400 draws against p(a)·p(b|a) under top-k 3, with the lookup guessing at
    every draft position it can (the prompt ends with an n-gram it holds), alone and in batches of two
    (each sequence its own fork of the decoder)."""
    ids, sampling = [5, 17, 99, 3, 42, 7, 5, 17], Sampling(temperature=1.0, top_k=3, seed=0)
    dec = build_decoder(method_config("quant_draft_cascade", never_slower=False, max_draft=4,
                                      draft_ngram=CONSTANT), peaked_llama)
    # the lookup guesses under sampling too; whether a guess is kept is each draw's luck here (the random
    # model's drafts take 1-2% of guesses: 16 of 1,637 guessing steps over 300 seeds, 29 of 1,625 with
    # another draw of the same distributions), so the keeping is tested where its rate is known:
    # test_a_checked_token_is_drawn_from_the_drafters_distribution_and_carries_it_as_q
    for s in range(4):
        assert dec.generate(ids, 48, Sampling(temperature=1.0, top_k=3, seed=s)).stats["draft_ngram_steps"] > 0
    assert first_two_tokens_tv(dec, ids, sampling, batch=batch) < 0.12


def test_a_guess_the_drafter_cannot_draw_is_never_kept(monkeypatch):
    """Speculative sampling keeps a point-mass guess x with probability q(x) exactly: never where q(x) = 0,
    even at a uniform draw of 0 (u in [0, 1): the rule rejects at u·1 >= q(x))."""
    import selfspec.decoding.sampling as sampling_module

    monkeypatch.setattr(sampling_module.torch, "rand", lambda *a, **k: torch.zeros(*(a or k["size"])))
    logits = torch.tensor([[0.0, 2.0, float("-inf")], [0.0, 0.0, 0.0]])
    draft = Draft()
    kept, _ = draft.extend([2], logits, _state(Sampling(temperature=1.0, seed=0)))
    assert kept == 0 and draft.tokens[0] != 2


def test_a_priced_cascade_needs_a_profile():
    options = check_method(method_config("quant_draft_cascade"))
    assert DraftVerify.needs_profile(options)[0] == "draft_ngram.draft_schedule=priced"
    assert DraftVerify.needs_profile(check_method(method_config("quant_draft_cascade", draft_ngram=CONSTANT))) is None


def test_the_paper_configurations_draft_alone():
    for name in ("draft_verify_paper", "knapspec_paper", "clasp_paper"):
        assert check_method(method_config(name)).draft_ngram is None

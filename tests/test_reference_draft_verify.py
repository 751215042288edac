"""Draft & Verify against the authors' loop, step for step (docs/design/fidelity.md §8).

The reference (``tests/reference/draft_verify.py``) re-implements the authors' decoding loop on
transformers' own model. ``method=draft_verify_paper`` must reproduce it exactly on the same prompt
ids and skip set: the same output and the same step trace (tests/reference/traces.py): at every
step the drafted, accepted and committed counts, K, and the controller after it, the threshold θ and
the acceptance-rate average AR, with θ carried from prompt to prompt in order (their evaluation's
only carry-over). ``method=draft_verify`` differs from it by its
documented deviations only: the reference, with exactly those switched on by name, reproduces it.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from reference import draft_verify as reference
from reference.traces import first_difference, totals
from selfspec.config import compose
from selfspec.decoding import build_decoder

#: selfspec's deviation (a name the reference knows) -> the ``method`` key and value that make it;
#: ``draft_verify_paper`` sets the other value of each (the authors' loop)
DEVIATIONS = {
    "ar_first_rate": ("draft_stop.ar_start", "first_rate"),
    "ar_carried": ("draft_stop.ar_per_example", False),
    "plain_last_token": ("last_token", "plain"),
    "stop_at_eos_draft": ("eos_draft", "stop"),
}

#: tiny settings: (skip attention, skip MLP, K, θ0); together they exercise every branch
#: (:func:`test_the_tiny_data_exercises_the_authors_loop`)
TINY_SETTINGS = [((3,), (), 4, 0.8), ((4,), (), 6, 0.4)]
#: budgets of the four tiny prompts: in each setting an example has one token of budget left
TINY_BUDGETS = [40, 22, 47, 29]
#: the tiny model's "EOS": a token its greedy continuations produce, so it is drafted mid-chain
TINY_EOS = 27


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def peaked(peaked_llama):
    return peaked_llama


def tiny_prompts() -> list[list[int]]:
    return [list(range(10 + 7 * p, 30 + 7 * p)) for p in range(len(TINY_BUDGETS))]


def method(label: str, attn, mlp, k: int, theta0: float, **keys):
    """``method=<label>`` composed, with the skip set, K, θ0 and ``keys`` (dotted) set."""
    cfg = compose(["model=tiny-random", f"method={label}"]).method
    cfg.merge_with({"skip_attn": list(attn), "skip_mlp": list(mlp), "max_draft": k, "never_slower": False})
    OmegaConf.update(cfg, "draft_stop.threshold", theta0)
    for key, value in keys.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def authors(model, prompts, budgets, attn, mlp, k, theta0, eos, deviations=frozenset()):
    """The reference over the prompts in order, θ (and, under ``ar_carried``, AR) carried."""
    results, theta, ar = [], theta0, None
    for ids, n in zip(prompts, budgets):
        r = reference.generate(model.hf, ids, n, attn, mlp, k, theta, eos_token_id=eos, early_stop=True,
                               deviations=deviations, ar=ar)
        theta, ar = r.threshold, r.ar
        results.append(r)
    return results


def selfspec(model, cfg, prompts, budgets, eos):
    """One decoder over the prompts in order (its threshold carries over)."""
    dec = build_decoder(cfg, model, eos_token_ids=[eos])
    return [dec.generate(ids, n) for ids, n in zip(prompts, budgets)], dec


def assert_same(theirs, ours):
    """Per prompt: the same output and step trace; θ after the call bit for bit (its updates are
    arithmetic on counts, so no tolerance is needed)."""
    for i, (r, g) in enumerate(zip(theirs, ours)):
        assert g.tokens == r.tokens, f"prompt {i}: output"
        assert first_difference(g.trace, r.rounds) is None, (f"prompt {i}", first_difference(g.trace, r.rounds))
        assert g.stats["threshold"] == r.threshold, f"prompt {i}: θ"


def all_totals(results) -> tuple[int, int, int]:
    """Steps (the prefills included), drafted and accepted tokens over the prompts."""
    return tuple(map(sum, zip(*(totals(r.rounds) for r in results))))


def verifications(results) -> list:
    return [x for r in results for x in r.rounds if x.source == "self"]


@pytest.fixture(scope="module")
def tiny_authors(peaked):
    """The reference's results per tiny setting (computed once)."""
    return {s: authors(peaked, tiny_prompts(), TINY_BUDGETS, *s, TINY_EOS) for s in TINY_SETTINGS}


@pytest.mark.parametrize("setting", TINY_SETTINGS, ids=["K4-th0.8", "K6-th0.4"])
def test_paper_config_is_the_authors_loop(peaked, tiny_authors, setting):
    theirs = tiny_authors[setting]
    ours, dec = selfspec(peaked, method("draft_verify_paper", *setting), tiny_prompts(), TINY_BUDGETS, TINY_EOS)
    assert_same(theirs, ours)
    # every step after prefill verified a draft, the last token of a budget included
    assert all(s.drafted for g in ours for s in g.trace[1:])
    assert dec.drafter.threshold == theirs[-1].threshold


def test_the_tiny_data_exercises_the_authors_loop(tiny_authors):
    """The behaviours selfspec's default deviates from, and every branch of the update, occur."""
    held = []
    for setting, results in tiny_authors.items():
        rs = verifications(results)
        theta = [x.controller["threshold"] for x in rs]
        assert any(x.left == 1 for x in rs), (setting, "a draft with one token of budget left")
        assert any(TINY_EOS in x.drafts[:-1] for x in rs), (setting, "drafting past an EOS draft")
        assert any(TINY_EOS in r.tokens for r in results), (setting, "an example ended by EOS")
        assert {1, -1} <= {(b > a) - (b < a) for a, b in zip(theta, theta[1:])}, (setting, "θ rose and fell")
        held += [x for x in rs if x.drafted == setting[2] and x.controller["ar"] >= 0.9]
    assert held, "θ held: AR at the target α = 0.9, but K drafts"


@pytest.mark.parametrize("deviation", sorted(DEVIATIONS))
def test_each_deviation_is_the_only_difference(peaked, tiny_authors, deviation):
    """The paper config with one key set to the default's value is the authors' loop with exactly
    that deviation, and on this data the deviation changes the statistics."""
    setting = TINY_SETTINGS[1]
    key, value = DEVIATIONS[deviation]
    theirs = authors(peaked, tiny_prompts(), TINY_BUDGETS, *setting, TINY_EOS, frozenset({deviation}))
    ours, _ = selfspec(peaked, method("draft_verify_paper", *setting, **{key: value}), tiny_prompts(),
                       TINY_BUDGETS, TINY_EOS)
    assert_same(theirs, ours)
    assert [r.rounds for r in theirs] != [r.rounds for r in tiny_authors[setting]]


def test_default_config_differs_by_its_named_deviations_only(peaked, tiny_authors):
    """``method=draft_verify`` (its speculation gate off, §7) is the authors' loop with all four."""
    for setting in TINY_SETTINGS:
        theirs = authors(peaked, tiny_prompts(), TINY_BUDGETS, *setting, TINY_EOS, frozenset(DEVIATIONS))
        ours, _ = selfspec(peaked, method("draft_verify", *setting), tiny_prompts(), TINY_BUDGETS, TINY_EOS)
        assert_same(theirs, ours)
        assert all_totals(theirs) != all_totals(tiny_authors[setting])


#: SmolLM2-135M (30 layers): a plausible skip set (upper-middle attention, two MLPs), not a searched one
SMOL_SKIP = (tuple(range(12, 26, 2)), (20, 24))
SMOL_QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn.",
                  "Explain photosynthesis in one sentence.", "List three prime numbers.",
                  "How do I boil an egg?", "Who wrote Hamlet?"]


@pytest.mark.slow
@pytest.mark.parametrize("k,theta0", [(8, 0.8), (12, 0.6)])
def test_paper_config_is_the_authors_loop_on_smollm2(smol, k, theta0):
    """Six chat-template prompts × 40 tokens in order, θ carried, EOS = the end of the turn (about
    120 verifications: 64 tokens gave 175, and 50 s a setting, most of it the reference's forwards)."""
    tok = smol.tokenizer
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True))["input_ids"] for q in SMOL_QUESTIONS]
    budgets = [40] * len(prompts)
    cfg = method("draft_verify_paper", *SMOL_SKIP, k, theta0)
    theirs = authors(smol.model, prompts, budgets, *SMOL_SKIP, k, theta0, tok.eos_token_id)
    ours, _ = selfspec(smol.model, cfg, prompts, budgets, tok.eos_token_id)
    assert_same(theirs, ours)
    assert len(verifications(theirs)) > 100

"""SWIFT (issue 41): the authors' loop step for step, losslessness, the tree's sampling rule and the
optimisation's state.

The reference (``tests/reference/swift.py``) re-implements the authors' greedy ``swift_forward``
and ``swift_optimization`` on transformers' own model; ``method=swift_paper`` must reproduce it
exactly over four prompts in order, the optimisation's state carried from one to the next as the
authors' evaluation carries it: the same outputs and step traces (drafted tree nodes, accepted and
committed tokens, the chain's length, and at every optimisation iteration the proposal's kind, its
matchness, the best so far, the set in use and whether the optimisation goes on). The matchness
window is shortened from 51 tokens so that short generations optimise.
"""

from __future__ import annotations

import pytest
import torch

from conftest import first_two_tokens_tv, method_config
from reference import swift as reference
from reference.traces import first_difference
from selfspec.config import compose
from selfspec.config.checks import ConfigError
from selfspec.decoding import Sampling, build_decoder, check_method
from selfspec.decoding.sampling import multi_candidate_verify
from selfspec.decoding.swift import initial_skip, tree_width
from selfspec.decoding.tree import chain_tree
from selfspec.decoding.vanilla import Vanilla

pytestmark = pytest.mark.usefixtures("one_thread")  # the reference runs transformers' modules op by op

PROMPTS = [list(range(10 + 7 * p, 30 + 7 * p)) for p in range(4)]
BUDGETS = [40, 22, 47, 29]
EOS = 27
#: (matchness window, Bayesian interval, tolerance, iterations): the second stops the optimisation early
SETTINGS = [{"context_window": 8, "bayes_interval": 5, "max_tolerance_iter": 30, "max_opt_iter": 1000},
            {"context_window": 4, "bayes_interval": 3, "max_tolerance_iter": 4, "max_opt_iter": 12}]


@pytest.fixture(scope="module")
def peaked(peaked_llama):
    return peaked_llama


def paper(**keys):
    cfg = compose(["model=tiny-random", "method=swift_paper"]).method
    cfg.merge_with(keys)
    return cfg


@pytest.fixture(scope="module")
def authors(peaked):
    out = []
    for keys in SETTINGS:
        search = reference.new_search(peaked.hf)
        out.append([reference.generate(peaked.hf, search, ids, n, EOS, **keys) for ids, n in zip(PROMPTS, BUDGETS)])
    return out


def iterations(rounds) -> list[dict]:
    return [r.controller["search"] for r in rounds if r.controller and "search" in r.controller]


@pytest.mark.parametrize("setting", [0, 1], ids=["window8", "stops-early"])
def test_paper_config_is_the_authors_loop(peaked, authors, setting):
    dec = build_decoder(paper(**SETTINGS[setting]), peaked, eos_token_ids=[EOS])
    for i, (ids, n, theirs) in enumerate(zip(PROMPTS, BUDGETS, authors[setting])):
        ours = dec.generate(ids, n)
        assert ours.tokens == theirs.tokens, f"prompt {i}: output"
        assert first_difference(ours.trace, theirs.rounds) is None, (i, first_difference(ours.trace, theirs.rounds))


def test_the_tiny_data_exercises_the_authors_loop(authors):
    """Random and Bayesian proposals, improvements that change the set, an optimisation stopped by
    its tolerance, trees of several shapes, an example ended by EOS."""
    first, second = ([it for r in results for it in iterations(r.rounds)] for results in authors)
    assert {it["proposal"] for it in first} == {"random", "bayes"}
    sets = {(tuple(it["skip_attn"]), tuple(it["skip_mlp"])) for it in first}
    assert len(sets) >= 2, "an improvement changed the set"
    assert second[-1]["active"] is False and len(second) < len(first), "the tolerance stopped the optimisation"
    sizes = {x.drafted for results in authors for r in results for x in r.rounds[1:]}
    assert len(sizes) >= 4
    assert any(x.accepted for results in authors for r in results for x in r.rounds[1:])
    assert any(EOS in r.tokens for r in authors[0])


def test_defaults_are_lossless_and_the_state_carries_over(peaked):
    """The shipped config (the speculation gate on) equals vanilla; the optimisation's state carries
    over the examples (``search_state: stream``) or restarts at each (``example``), and a resumed run
    names it (``drafter.search``) only where it carries."""
    vanilla = Vanilla(peaked, eos_token_ids=[EOS])
    dec = build_decoder(method_config("swift", context_window=8), peaked, eos_token_ids=[EOS])
    for ids, n in zip(PROMPTS, BUDGETS):
        assert dec.generate(ids, n).tokens == vanilla.generate(ids, n).tokens
    for state in ("stream", "example"):  # no gate here: its own carried measurements would differ too
        dec = build_decoder(paper(context_window=8, search_state=state), peaked, eos_token_ids=[EOS])
        # the search is its drafter's, a part of the decoder (a static draft-stop rule carries nothing)
        assert dec.drafter in dec.parts and dec.carried() == (["drafter.search"] if state == "stream" else [])
        runs = [dec.generate(PROMPTS[0], 40) for _ in range(2)]
        same = [t.row() for t in runs[0].trace] == [t.row() for t in runs[1].trace]
        assert same is (state == "example"), state
    with dec.kept_state():  # the warm-up leaves the carried search as it found it
        before = dec.drafter.search.iteration
        dec.search_state = "stream"
        dec.generate(PROMPTS[1], 30)
    assert dec.drafter.search.iteration == before


def test_multi_candidate_verification_keeps_the_target_distribution():
    """The token a depth emits (an accepted sibling, or a draw from the distribution left after every
    rejection) is distributed as p: 3 siblings drawn without replacement from q over 6 tokens,
    N = 20,000 draws; an unbiased sampler's total variation from p is ~0.01; the bound 0.025 fails
    a sampler that keeps the first sibling (its tokens follow q: TV(p, q) is checked > 0.2) or one
    that forgets to renormalise q after a rejection (checked here to be off by more)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    q = torch.tensor([0.05, 0.1, 0.15, 0.2, 0.25, 0.25])
    assert 0.5 * (p - q).abs().sum() > 0.2

    def emitted(verify) -> torch.Tensor:
        counts = torch.zeros(6)
        for _ in range(20000):
            siblings = torch.multinomial(q, 3, replacement=False, generator=gen).tolist()
            j, left = verify(p, siblings, q, gen)
            counts[siblings[j] if j is not None else int(torch.multinomial(left, 1, generator=gen))] += 1
        return counts / counts.sum()

    def stale_q(p, siblings, q, gen):  # the wrong rule: q never renormalised
        for j, x in enumerate(siblings):
            if bool(torch.rand((), generator=gen) * q[x] <= p[x]):
                return j, p
            p = (p - q).clamp_min(0)
            p = p / p.sum()
        return None, p

    assert 0.5 * (emitted(multi_candidate_verify) - p).abs().sum() < 0.025
    assert 0.5 * (emitted(stale_q) - p).abs().sum() > 0.03


def test_sampling_steps_keep_the_target_distribution(peaked):
    """End to end: the first two tokens of SWIFT steps from the last prompt token, with a draft
    model far from the target, against p(a)·p(b|a) under top-k 3 sampling: total variation below
    0.12 over 400 draws (an unbiased sampler: ~0.05)."""
    dec = build_decoder(paper(skip_attn=[1, 2, 3, 4], skip_mlp=[1, 2, 3], optimize=False), peaked)
    assert first_two_tokens_tv(dec, PROMPTS[0], Sampling(temperature=1.0, top_k=3, seed=0)) < 0.12


def test_sampling_is_seeded(peaked):
    dec = build_decoder(paper(context_window=8, search_state="example"), peaked)
    s = Sampling(temperature=0.8, top_p=0.9, seed=4)
    a, b = (dec.generate(PROMPTS[0], 40, s) for _ in range(2))
    assert a.tokens == b.tokens and a.stats["swift_iterations"] > 0


def test_the_tree_and_the_starting_set():
    tree = chain_tree([3, 1, 2])
    assert tree.nodes == ((0,), (1,), (2,), (0, 0), (0, 0, 0), (0, 0, 1))
    assert [tree_width(c, True) for c in (0.99, 0.9, 0.6, 0.2)] == [3, 5, 8, 10]
    assert [tree_width(c, False) for c in (0.99, 0.9, 0.6, 0.2)] == [1, 3, 5, 10]
    assert initial_skip(6).attn == {1, 3} and initial_skip(7).mlp == {1, 3, 5}


def test_the_search_is_charged_to_its_own_component(peaked):
    g = build_decoder(paper(context_window=8), peaked).generate(PROMPTS[0], 40)
    assert g.ledger["search"] > 0 and g.ledger["tree"] > 0
    assert any(op.component == "search" and op.kind == "L" for t in g.trace for op in t.ops)


def test_bad_settings_are_refused(tiny):
    with pytest.raises(ConfigError, match="method.search_state"):
        check_method(method_config("swift", search_state="task"))
    with pytest.raises(ConfigError, match="method.skip_ratio"):
        check_method(method_config("swift", skip_ratio=1.5))
    with pytest.raises(ValueError, match="never skips the first or the last layer"):
        build_decoder(method_config("swift", skip_attn=[0]), tiny.model)


@pytest.mark.slow
def test_the_embedded_model_equals_vanilla(smol):
    """SmolLM2: SWIFT (matchness over 17 tokens, so it optimises within 96) equals vanilla. (A Bayesian
    proposal over SmolLM2's 56 sublayers took ~6 s here, so the test keeps the authors' one in 25.)"""
    ids = smol.tokenizer("Summarize: The quick brown fox jumps over the lazy dog. The dog sleeps.")["input_ids"]
    ref = Vanilla(smol.model).generate(ids, 96).tokens
    g = build_decoder(method_config("swift_paper", context_window=16), smol.model).generate(ids, 96)
    assert g.tokens == ref and g.stats["swift_iterations"] > 5

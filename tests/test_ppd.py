"""PPD decoding: greedy output equals vanilla; the cache keeps exactly the accepted path."""

import random

import pytest
import torch

from conftest import PPD_KEYS, method_config
from selfspec.decoding import build_decoder, check_method
from selfspec.decoding.part_options import LookupOptions
from selfspec.decoding.ppd import PPD, typical_accept
from selfspec.decoding.sampling import Sampling
from selfspec.decoding.tree import SparseTree, random_trees
from selfspec.decoding.vanilla import Vanilla
from selfspec.models.prompts import PromptTokens

N_NEW = 24


def _prompts(model, m, n_ept, seed):
    g = torch.Generator().manual_seed(seed)
    return PromptTokens(torch.randn(m, n_ept, model.hidden_size, generator=g) * 0.5)


class Oracle(PPD):
    """PPD whose guesses are overwritten, at random ranks, with the vanilla continuation, so
    long paths are accepted (random prompt tokens on a random model rarely guess right)."""

    def setup(self, ref, prompt_len, seed):
        self.ref, self.prompt_len, self.rng = ref, prompt_len, random.Random(seed)

    def _plant(self, cands, n_tokens):
        if cands is None:
            return
        done = n_tokens - self.prompt_len  # generated so far; the next guess is ref[done]
        for d in range(cands.shape[0]):
            if done + d < len(self.ref) and self.rng.random() < 0.8:
                cands[d, self.rng.randrange(self.top_k)] = self.ref[done + d]

    def prefill(self, state, prompt):
        first = super().prefill(state, prompt)
        self._plant(state.example.cands, len(state.tokens) + 1)
        return first

    def step(self, state, budget):
        out = super().step(state, budget)
        self._plant(state.example.cands, len(state.tokens) + len(out))
        return out

    def finish(self, state):
        self.last_state = state


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n_ept", [1, 2])
def test_greedy_equals_vanilla_random_prompts_and_trees(tiny, prompt_ids, seed, n_ept):
    m = tiny.model
    ref = Vanilla(m).generate(prompt_ids, N_NEW)
    trees = random_trees(3, 6, 3, random.Random(seed))
    dec = PPD(m, _prompts(m, 3, n_ept, seed), trees, **PPD_KEYS)
    out = dec.generate(prompt_ids, N_NEW)
    assert out.tokens == ref.tokens
    assert out.stats["lossless"] is True


@pytest.mark.parametrize("seed", range(4))
def test_long_accepted_paths_equal_vanilla_and_cache_holds_the_path(tiny, prompt_ids, seed):
    m = tiny.model
    ref = Vanilla(m).generate(prompt_ids, N_NEW).tokens
    trees = random_trees(3, 8, 3, random.Random(10 + seed))
    dec = Oracle(m, _prompts(m, 3, 2, seed), trees, **PPD_KEYS)
    dec.setup(ref, len(prompt_ids), seed)
    out = dec.generate(prompt_ids, N_NEW)
    assert out.tokens == ref
    assert out.tau > 1.3, "the oracle should make PPD accept candidates"
    # gather kept exactly the accepted path: the cache equals a fresh pass over the accepted
    # tokens (the last step may accept past the budget, so compare with a longer vanilla run)
    state = dec.last_state
    n = state.cache.length(0)
    assert n >= len(state.tokens) - 1
    longer = list(prompt_ids) + Vanilla(m).generate(prompt_ids, N_NEW + 8).tokens
    fresh = m.new_cache(n + 1)
    m.forward(torch.tensor([longer[:n]]), fresh, start=0)
    for i in range(m.num_layers):
        assert state.cache.length(i) == n
        torch.testing.assert_close(state.cache.layer_kv(i)[0], fresh.layer_kv(i)[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state.cache.layer_kv(i)[1], fresh.layer_kv(i)[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("root_prompts", [0, 2])
def test_a_tree_without_candidates_skips_the_prompt_tokens_pass(tiny, prompt_ids, monkeypatch, root_prompts):
    """Where state m's tree has no candidates (a hardware-aware tree of size 1) the prefill is
    vanilla's single pass: the prompt tokens' guesses would never be read. A root that carries
    prompt tokens still runs them in the steps. The output stays vanilla's."""
    m = tiny.model
    ref = Vanilla(m).generate(prompt_ids, N_NEW).tokens
    dec = PPD(m, _prompts(m, 3, 1, 0), {k: SparseTree((), (root_prompts,)) for k in range(4)}, **PPD_KEYS)
    passes = []
    forward = m.forward
    monkeypatch.setattr(m, "forward", lambda *a, **kw: passes.append(kw.get("tree")) or forward(*a, **kw))
    out = dec.generate(prompt_ids, N_NEW)
    assert out.tokens == ref
    assert len(passes) == len(out.accepted_per_step)  # one pass per step, the prefill's included
    assert passes[0] is None and {t.width for t in out.trace[1:]} == {1 + root_prompts}


def test_sampling_uses_typical_acceptance_and_says_it_is_lossy(tiny, prompt_ids):
    m = tiny.model
    dec = PPD(m, _prompts(m, 2, 1, 0), random_trees(2, 4, 2, random.Random(0)), **PPD_KEYS)
    out = dec.generate(prompt_ids, 16, Sampling(temperature=0.8, seed=1))
    again = dec.generate(prompt_ids, 16, Sampling(temperature=0.8, seed=1))
    assert out.tokens == again.tokens and len(out.tokens) == 16
    assert out.stats["lossless"] is False and out.stats["acceptance"] == "typical"
    assert PPD.lossless_sampling is False


def test_typical_accept_rule():
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.98, 0.01, 0.01]])
    # row 0: H = ln 2, alpha*exp(-H) = 0.15 < 0.09? no -> bound = 0.09; row 1: bound ~ min(0.09, 0.3*e^-0.112)
    acc = typical_accept(probs, torch.tensor([1, 1]), threshold=0.09, alpha=0.3)
    assert acc.tolist() == [True, False]


def test_from_config_loads_artefacts_and_names_missing_ones(tiny, prompt_ids, tmp_path):
    from selfspec.models.prompts import save_prompts
    from selfspec.store.artefacts import save_artefact

    m = tiny.model
    save_prompts(tmp_path / "p", _prompts(m, 2, 1, 0), tiny)
    trees = {0: SparseTree((), (2,)), 1: SparseTree(((0,), (1,)), (1, 2, 0)),
             2: SparseTree(((0,), (0, 0)), (0, 1, 2))}
    save_artefact(tmp_path / "t", "ppd_tree", {"tau": torch.ones(1)}, tiny,
                  extra={"trees": {str(k): t.to_dict() for k, t in trees.items()}}, kernel_paths=None)
    cfg = method_config("ppd", **{"prompts": str(tmp_path / "p"), "tree": str(tmp_path / "t"),
                            "posterior_threshold": 0.09, "posterior_alpha": 0.3, "tree_size": None,
                            "state_zero": True})
    dec = build_decoder(cfg, m)
    assert dec.generate(prompt_ids, 8).tokens == Vanilla(m).generate(prompt_ids, 8).tokens
    cfg.tree = str(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"method\.tree=.*missing is not allowed: no artefact there.*job=ppd_tree"):
        build_decoder(cfg, m)


@pytest.mark.parametrize("seed", range(3))
def test_context_drafts_join_the_tree_and_keep_vanilla_output(tiny, seed):
    """``ngram``: a context draft (the n-gram lookup's) joins the tree as a chain off the root; a
    repetitive prompt makes the chain match, and the output stays vanilla's token for token."""
    m = tiny.model
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(3, m.vocab_size, (7,), generator=g).tolist()
    prompt = [1, *(motif * 4)]
    ref = Vanilla(m).generate(prompt, N_NEW)
    trees = random_trees(3, 6, 3, random.Random(seed))
    plain = PPD(m, _prompts(m, 3, 2, seed), trees, **PPD_KEYS).generate(prompt, N_NEW)
    lookup = LookupOptions(max_ngram=3, min_ngram=1, max_draft=5)
    dec = PPD(m, _prompts(m, 3, 2, seed), trees, **{**PPD_KEYS, "ngram": lookup})
    out = dec.generate(prompt, N_NEW)
    assert out.tokens == ref.tokens == plain.tokens
    assert out.stats["ngram_steps"] > 0
    # the chain is what lifts τ: with the lookup off the same random prompts accept less
    assert out.stats["ngram_accepted"] > 0 and out.tau > plain.tau
    # one layout per (state, chain length), built once
    assert all(lay.n_nodes == 1 + trees[k].num_candidates + c for (k, c), lay in dec._with_chain.items())
    sampled = dec.generate(prompt, N_NEW, Sampling(temperature=0.7, seed=seed))  # typical acceptance
    assert len(sampled.tokens) == N_NEW and sampled.stats["lossless"] is False


def test_ngram_sub_config_is_checked_before_loading():
    from selfspec.config.checks import ConfigError

    keys = {"max_ngram": 3, "min_ngram": 1, "max_draft": 4}  # every key: the lookup has no Python defaults
    assert check_method(method_config("ppd", ngram=keys)).ngram.config() == keys
    assert check_method(method_config("ppd")).ngram is None
    with pytest.raises(ConfigError, match=r"method\.ngram\.max_draf is not a key"):
        check_method(method_config("ppd", ngram={**keys, "max_draf": 4}))
    with pytest.raises(ConfigError, match=r"method\.ngram\.min_ngram=5 is not allowed"):
        check_method(method_config("ppd", ngram={**keys, "min_ngram": 5}))
    with pytest.raises(ConfigError, match=r"method\.ngram\.max_draft"):
        check_method(method_config("ppd", ngram={"max_ngram": 3, "min_ngram": 1}))  # a missing key is named
    with pytest.raises(ConfigError, match=r"method\.ngram=4 is not allowed"):
        check_method(method_config("ppd", ngram=4))

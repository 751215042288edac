"""Tree attention mask, tree position ids and tree forward passes equal brute-force constructions."""

import random

import pytest
import torch

from conftest import method_config
from selfspec.decoding.tree import (SparseTree, TreeError, check_trees, layout,
                                    prompt_chain_mask, random_tree)
from selfspec.models.passes import Pass, Rows


def _labels(tree, n_ept):
    """Brute force: each input as its label sequence from the root (input order of layout)."""
    seqs = [tuple(("c", r) for r in p) for p in tree.paths]
    for v, path in enumerate(tree.paths):
        for p in range(1, tree.prompts[v] + 1):
            for e in range(n_ept):
                seqs.append(seqs[v] + tuple(("p", q, e) for q in range(1, p + 1)))
    return seqs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n_ept", [1, 3])
def test_mask_and_positions_match_brute_force(seed, n_ept):
    tree = random_tree(7, 3, 3, 3, random.Random(seed))
    lay = layout(tree, n_ept)
    seqs = _labels(tree, n_ept)
    assert lay.size == len(seqs) == tree.size(n_ept)
    for a, sa in enumerate(seqs):
        assert int(lay.offsets[a]) == len(sa)
        for b, sb in enumerate(seqs):
            # a sees b iff b's sequence is a prefix of a's (EPT groups never mix)
            assert bool(lay.mask[a, b]) == (sa[: len(sb)] == sb), (a, b, sa, sb)


def test_prompt_chain_mask_is_tree_of_root():
    mask = prompt_chain_mask(4, 2, 2)
    # causal prefix; prompt slots (p1e0, p1e1, p2e0, p2e1) see the whole prefix and their EPT chain
    assert torch.equal(mask[:4, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert not mask[:4, 4:].any() and mask[4:, :4].all()
    expect = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask[4:, 4:], expect)


def test_tree_forward_equals_sequential_forward(tiny):
    """Every tree input's logits equal a plain causal pass over prefix + its own path."""
    m = tiny.model
    torch.manual_seed(0)
    n_ept, mp = 2, 2
    prompts = torch.randn(mp, n_ept, m.hidden_size) * 0.5
    tree = random_tree(5, 2, 2, mp, random.Random(3))
    lay = layout(tree, n_ept)
    prefix = list(range(300, 309))
    cands = torch.tensor([[11, 12], [21, 22]])
    node_tok = [prefix[-1]] + [int(cands[len(p) - 1, p[-1]]) for p in tree.nodes]
    cache = m.new_cache(64)
    m.forward(torch.tensor([prefix[:-1]]), cache, start=0)
    n = len(prefix) - 1
    h = torch.cat([m.embed(torch.tensor([node_tok])), prompts[lay.prompt_p, lay.prompt_e].unsqueeze(0)], 1)
    out = m.logits(m.forward(h, cache, Pass(rows=Rows.tree(lay.offsets, lay.mask)), start=n))[0]
    for a, seq in enumerate(_labels(tree, n_ept)):
        emb = [m.embed(torch.tensor([prefix]))[0]]
        for depth, lab in enumerate(seq):
            if lab[0] == "c":
                emb.append(m.embed(cands[depth, lab[1]].view(1, 1))[0])
            else:
                emb.append(prompts[lab[1] - 1, lab[2]].view(1, -1))
        ref = m.logits(m.forward(torch.cat(emb).unsqueeze(0), None, start=0))[0, -1]
        torch.testing.assert_close(out[a], ref, atol=1e-4, rtol=1e-4)


def test_malformed_trees_fail_clearly():
    with pytest.raises(TreeError, match="no parent"):
        SparseTree(((0, 1),), (1, 0))
    with pytest.raises(TreeError, match="prompts has"):
        SparseTree(((0,),), (1,))
    with pytest.raises(TreeError, match="depth"):
        check_trees({0: SparseTree((), (1,)), 1: SparseTree(((0,), (0, 0)), (1, 1, 0))}, 1)
    with pytest.raises(TreeError, match="lacks states"):
        check_trees({1: SparseTree(((0,),), (1, 1))}, 1)


# --- the dynamic sparse tree builder (PPD §4) ------------------------------------------------------
from selfspec.decoding.tree_builder import (amortized_tokens, best_trees_for_size, build_trees,  # noqa: E402
                                            expected_candidates, optimal_candidates, transitions)


def _rank_model(m, K, seed):
    g = torch.Generator().manual_seed(seed)
    raw = torch.rand(m, K + 1, generator=g)
    p = (raw / raw.sum(-1, keepdim=True))[:, :K]  # last column: the true token is outside the top-K
    return p.double().tolist()


def _enumerate(tree, p):
    """Brute force: every outcome (rank of the true token at each depth, or a miss) with its
    probability; follow the tree; return E[accepted candidates] and P(next state)."""
    K, depth = len(p[0]), max(tree.depth, 1)
    nodes = set(tree.paths)
    expect, states = 0.0, {}
    for outcome in itertools.product(range(K + 1), repeat=depth):
        prob = 1.0
        for d, r in enumerate(outcome):
            prob *= p[d][r] if r < K else 1.0 - sum(p[d])
        path = ()
        for r in outcome:
            if path + (r,) not in nodes:
                break
            path += (r,)
        expect += prob * len(path)
        s = tree.prompts[tree.paths.index(path)]
        states[s] = states.get(s, 0.0) + prob
    return expect, states


import itertools  # noqa: E402


@pytest.mark.parametrize("seed", range(5))
def test_expected_acceptance_and_transitions_equal_enumeration(seed):
    m, K = 3, 3
    p = _rank_model(m, K, seed)
    for s in range(4):
        tree = random_tree(6, 3, K, m, random.Random(seed * 10 + s))
        expect, states = _enumerate(tree, p)
        assert expected_candidates(tree.nodes, p) == pytest.approx(expect, abs=1e-12)
        P = transitions({0: tree}, p, m)
        for j in range(m + 1):
            assert float(P[0, j]) == pytest.approx(states.get(j, 0.0), abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_candidate_tree_is_optimal_against_all_subtrees(seed):
    K, depth = 3, 2
    p = _rank_model(depth, K, seed)
    p = [sorted(row, reverse=True) for row in p]  # ranks are ordered by the guesser's confidence
    universe = [(a,) for a in range(K)] + [(a, b) for a in range(K) for b in range(K)]
    for n_c in range(1, 6):
        best = max(expected_candidates(c, p) for c in itertools.combinations(universe, n_c)
                   if all(len(v) == 1 or v[:-1] in c for v in c))
        assert expected_candidates(optimal_candidates(n_c, depth, p), p) == pytest.approx(best, abs=1e-12)


def test_amortized_tokens_equal_simulation_and_sizes_are_respected():
    m, K = 2, 3
    p = _rank_model(m, K, 7)
    trees = build_trees(4, 3, m, p)
    for k, t in trees.items():
        assert t.depth <= k and t.num_candidates <= 4 and t.num_prompts <= 3
    check_trees(trees, m)
    # R(T) = π·f, with π the stationary law of the enumerated transitions
    r = amortized_tokens(trees, p, m)
    rng, state, total, steps = random.Random(0), m, 0, 60000
    for _ in range(steps):
        t = trees[state]
        path = ()
        for d in range(t.depth):
            u, acc, nxt = rng.random(), 0.0, None
            for rank in range(K):
                acc += p[d][rank]
                if u < acc:
                    nxt = rank
                    break
            if nxt is None or path + (nxt,) not in t.paths:
                break
            path += (nxt,)
        total += len(path)
        state = t.prompts[t.paths.index(path)]
    assert total / steps == pytest.approx(r, rel=0.03)
    best = best_trees_for_size(8, m, 1, p)
    assert best is not None and all(t.size() <= 8 for t in best[1].values())


def test_paper_states_keep_the_root_full_and_every_candidate_one_prompt_token():
    """``state_zero: false`` (PPD Definition 4.1, Prop. 4.3's i > 1; the authors' builder and buffers): the
    root carries all m prompt tokens and each candidate at least one, so state 0 is never reached."""
    from selfspec.decoding.tree import paper_states

    tree = SparseTree(((0,), (1,), (0, 0)), (1, 0, 3, 5))
    assert paper_states(tree, 3).prompts == (3, 1, 3, 3) and paper_states(tree, 3).nodes == tree.nodes
    m, K = 3, 3
    p = _rank_model(m, K, 3)
    free = build_trees(6, 6, m, p)
    assert any(c == 0 for t in free.values() for c in t.prompts) or any(t.prompts[0] < m for t in free.values())
    paper = build_trees(6, 9, m, p, state_zero=False)
    for k, t in paper.items():
        assert t.prompts[0] == m and min(t.prompts[1:], default=1) >= 1 and t.num_prompts <= max(9, m)
        assert paper_states(t, m) == t
    assert all(float(x) == 0.0 for x in transitions(paper, p, m)[:, 0])
    best = best_trees_for_size(14, m, 1, p, state_zero=False)
    assert best is not None and all(t.size() <= 14 and paper_states(t, m) == t for t in best[1].values())
    assert best_trees_for_size(m, m, 1, p, state_zero=False) is None  # the root's own m prompt tokens do not fit


def test_ppd_tree_job_writes_trees_the_decoder_uses(tiny, prompt_ids, tmp_path):

    from selfspec.config import compose
    from selfspec.decoding import build_decoder
    from selfspec.decoding.vanilla import Vanilla
    from selfspec.models.prompts import PromptTokens, save_prompts
    from selfspec.train import run_job

    save_prompts(tmp_path / "p", PromptTokens.init_from_tokens(tiny.model, 2, 1), tiny)
    # priced with a fixed profile: this machine's measured one may price a 3-row pass of the tiny model
    # below a 1-row pass (its passes take 1-3 ms and CI's VM is noisy: a clean clone's run on a Zen 3
    # failed so); test_draft_vocab checks that profile=auto is this machine's
    from conftest import cpu_like_profile

    profile = cpu_like_profile(tiny.model)
    profile.save(tmp_path / "profile.json")
    cfg = compose(["job=ppd_tree", "model=tiny-random", f"job.prompts={tmp_path / 'p'}", "job.n_prompts=2",
                   "job.max_new_tokens=10", "job.sizes=[1,3,5]", "job.plot=false",
                   f"profile={tmp_path / 'profile.json'}", f"artefact_dir={tmp_path / 't'}"], config_name="train")
    out = run_job(cfg)
    assert out["chosen_size"] in (1, 3, 5) and out["best_ppd_size"] in (3, 5)
    # L_fp(n) is priced with the run's cost profile (issue 40: one cost model): vanilla's step
    # is one row's pass; a tree's, its rows through every layer, the head on its nodes and the tree's host work
    import json

    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    context = int(cfg.job.latency_context)
    assert meta["metrics"]["vanilla_latency_s"] == profile.plain_step(context)
    curve = {r["size"]: r for r in meta["curve"]}
    assert curve[1]["latency_s"] == profile.plain_step(context)
    assert all(r["latency_s"] > profile.plain_step(context) for n, r in curve.items() if n > 1)
    cfg = method_config("ppd", **{"prompts": str(tmp_path / "p"), "tree": str(tmp_path / "t"),
                            "posterior_threshold": 0.09, "posterior_alpha": 0.3, "tree_size": None, "state_zero": True})
    ref = Vanilla(tiny.model).generate(prompt_ids, 10).tokens
    dec = build_decoder(cfg, tiny.model)
    assert max(lay.size for lay in dec.layouts.values()) <= out["chosen_size"]
    assert dec.generate(prompt_ids, 10).tokens == ref
    cfg.tree_size = 5  # rebuilt from the artefact's statistics
    dec = build_decoder(cfg, tiny.model)
    assert max(lay.size for lay in dec.layouts.values()) == 5
    assert dec.generate(prompt_ids, 10).tokens == ref


def test_ppd_tree_job_validates_on_the_local_sharegpt_file_it_is_given(tiny, tmp_path, monkeypatch):
    """job.data (as job=prompts has it): a user who trained the prompt tokens on a local ShareGPT file
    builds the tree from later conversations of the same file, the offline asset not read (before,
    the tree job read only the asset, and refused to run without it)."""
    import json

    import selfspec.store.assets as assets
    import selfspec.tasks.sharegpt as sharegpt
    from selfspec.config import compose
    from selfspec.models.prompts import PromptTokens, save_prompts
    from selfspec.train import run_job

    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"Question {i}: what follows {i}?"},
                                                {"from": "gpt", "value": f"{i + 1}."}]} for i in range(4)]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(records))
    read = []
    original = sharegpt.iter_sharegpt
    monkeypatch.setattr(sharegpt, "iter_sharegpt", lambda path=None: read.append(path) or original(path))
    monkeypatch.setattr(assets, "asset_path", lambda name, *a: pytest.fail(f"the offline asset {name} was read"))
    monkeypatch.setattr(sharegpt, "asset_path", assets.asset_path)
    save_prompts(tmp_path / "p", PromptTokens.init_from_tokens(tiny.model, 2, 1), tiny)
    common = ["job=ppd_tree", "model=tiny-random", f"job.prompts={tmp_path / 'p'}", f"job.data={data}",
              "job.n_prompts=2", "job.max_new_tokens=6", "job.sizes=[1,3]", "job.plot=false"]
    out = run_job(compose([*common, "job.skip_conversations=2", f"artefact_dir={tmp_path / 't'}"],
                          config_name="train"), tiny)
    assert out["chosen_size"] in (1, 3) and read and all(path == data for path in read)
    (tmp_path / "empty.json").write_text("[]")  # not ShareGPT: refused before the model is used
    with pytest.raises(ValueError, match=r"empty.json holds no complete ShareGPT conversation; check job.data"):
        run_job(compose([*common[:3], f"job.data={tmp_path / 'empty.json'}", *common[4:],
                         f"artefact_dir={tmp_path / 't3'}"], config_name="train"), tiny)
    with pytest.raises(ValueError, match=r"holds no conversation with a first user turn after "
                                         r"job.skip_conversations=4: lower it"):
        run_job(compose([*common, "job.skip_conversations=4", f"artefact_dir={tmp_path / 't2'}"],
                        config_name="train"), tiny)

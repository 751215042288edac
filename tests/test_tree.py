"""Tree attention mask, tree position ids and tree forward passes equal brute-force constructions."""

import random

import pytest
import torch

from selfspec.decoding.tree import (SparseTree, TreeError, check_trees, full_mask, layout,
                                    prompt_chain_mask, random_tree)


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
    out = m.logits(m.forward(None, cache, start=n, mask=m.prepare_mask(full_mask(lay, n)),
                             positions=(n + lay.offsets).unsqueeze(0), h=h))[0]
    for a, seq in enumerate(_labels(tree, n_ept)):
        emb = [m.embed(torch.tensor([prefix]))[0]]
        for depth, lab in enumerate(seq):
            if lab[0] == "c":
                emb.append(m.embed(cands[depth, lab[1]].view(1, 1))[0])
            else:
                emb.append(prompts[lab[1] - 1, lab[2]].view(1, -1))
        ref = m.logits(m.forward(None, None, start=0, h=torch.cat(emb).unsqueeze(0)))[0, -1]
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

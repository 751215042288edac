"""Vanilla decoding equals transformers' generate; sampling follows the target distribution."""

import pytest
import torch

from conftest import hf_greedy, method_config
from selfspec.decoding import Sampling, build_decoder
from selfspec.decoding.sampling import argmax, draw, draw_distinct, speculative_verify, warp


def vanilla(loaded, **kw):
    return build_decoder(method_config("vanilla"), loaded.model, **kw)


@pytest.mark.parametrize("text", ["Hello", "def add(a, b):\n", "Article: A storm hit the coast.\nSummary:"])
def test_greedy_equals_generate(tiny, text):
    ids = tiny.tokenizer(text)["input_ids"]
    g = vanilla(tiny).generate(ids, 24)
    assert g.tokens == hf_greedy(tiny, ids, 24)
    assert g.tau == 1.0 and g.steps == 24 and g.stop_reason == "length"


def test_eos_and_stop_strings_cut_output(tiny, prompt_ids):
    free = vanilla(tiny).generate(prompt_ids, 20).tokens
    eos = free[5]
    g = vanilla(tiny, eos_token_ids=[eos]).generate(prompt_ids, 20)
    assert g.tokens == free[: free.index(eos) + 1] and g.stop_reason == "eos"
    stop = tiny.tokenizer.decode(free[7:9])
    g = vanilla(tiny, stop_strings=[stop], tokenizer=tiny.tokenizer).generate(prompt_ids, 20)
    assert g.stop_reason == "stop" and stop in tiny.tokenizer.decode(g.tokens)
    assert stop not in tiny.tokenizer.decode(g.tokens[:-1])


def test_sampling_is_seeded(tiny, prompt_ids):
    s = Sampling(temperature=1.0, top_p=0.9, seed=3)
    a = vanilla(tiny).generate(prompt_ids, 12, s).tokens
    b = vanilla(tiny).generate(prompt_ids, 12, s).tokens
    c = vanilla(tiny).generate(prompt_ids, 12, Sampling(temperature=1.0, top_p=0.9, seed=4)).tokens
    assert a == b and a != c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_is_torch_argmax_on_ties_and_nans(dtype):
    """The greedy token (``argmax``, taken as torch.max's indices for speed) is torch.argmax's: the first
    of tied maxima (rounded logits tie often, bfloat16's most), the first NaN where a row has one, rows
    of a few vocabularies, one row and eight."""
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 8):
        for vocab in (7, 49_152, 100_003):
            x = (torch.randn(rows, vocab, generator=gen) * 3).round().clamp(max=2).to(dtype)  # few values: ties
            x[:, vocab - 2] = x[:, 1] = 2.0  # every row's maximum at least twice
            x[0, vocab // 2] = float("nan")
            x[0, vocab // 3] = float("nan")
            x[-1, :] = 1.0
            for t in (x, x[0]):
                assert torch.equal(argmax(t), t.argmax(-1))
    assert int(argmax(torch.tensor([0.0, float("nan"), 5.0, float("nan")]))) == 1


def test_draw_follows_the_distribution_and_never_draws_a_token_of_probability_zero():
    """Inverse-transform draws over 6 outcomes (two of probability 0, a row not summing to 1): total
    variation < 0.01 over 100,000 draws (an unbiased sampler's is ~0.002; drawing by the unnormalised
    or the reversed running sum is off by >= 0.1); rows drawn together are the rows drawn one by one
    from the same generator; a subnormal total, where ``u * total`` rounds up to the total, still
    draws its one token (without the clamp the index fell past the vocabulary)."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.0, 0.4, 0.1, 0.0, 0.25, 0.5])  # sums to 1.25
    n = 100_000
    counts = torch.bincount(draw(p.expand(n, 6), g), minlength=6).double()
    assert counts[0] == counts[3] == 0
    tv = 0.5 * (counts / n - p / p.sum()).abs().sum()
    assert tv < 0.01, f"total variation {tv:.4f}"
    rows = torch.rand(5, 1000, generator=g)
    together = draw(rows, torch.Generator().manual_seed(7))
    alone = torch.Generator().manual_seed(7)
    assert together.tolist() == [int(draw(r, alone)) for r in rows]
    tiny_total = torch.tensor([0.0, 5e-324, 0.0], dtype=torch.float64)
    assert set(draw(tiny_total.expand(200, 3), g).tolist()) == {1}


def test_draw_is_the_same_whatever_the_thread_count():
    """SmolLM2-sized rows (49,152 entries) draw the same tokens on 1 and 2 threads: the running sum
    is serial along a row."""
    rows = torch.rand(4, 49_152, generator=torch.Generator().manual_seed(1)) ** 8
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = draw(rows, torch.Generator().manual_seed(3))
        torch.set_num_threads(2)
        two = draw(rows, torch.Generator().manual_seed(3))
    finally:
        torch.set_num_threads(threads)
    assert one.tolist() == two.tolist()


def test_draw_distinct_samples_without_replacement():
    """Ordered pairs of distinct tokens from p = (0.5, 0.3, 0.2, 0): P(a, b) = p_a p_b / (1 - p_a);
    total variation < 0.03 over 20,000 draws (an unbiased sampler's is ~0.006; pairs drawn
    independently, with replacement, put 0.38 of the mass on repeats)."""
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    n = 20_000
    counts = torch.zeros(4, 4, dtype=torch.float64)
    for _ in range(n):
        a, b = draw_distinct(p, 2, g).tolist()
        counts[a, b] += 1
    want = p[:, None] * p[None, :] / (1 - p[:, None])
    want.fill_diagonal_(0)
    tv = 0.5 * (counts / n - want.double()).abs().sum()
    assert tv < 0.03, f"total variation {tv:.4f}"


def test_warp_matches_transformers_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 3
    s = Sampling(temperature=0.7, top_k=20, top_p=0.8)
    x = logits.clone()
    for w in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)):
        x = w(None, x)
    torch.testing.assert_close(warp(logits, s), x.softmax(-1))


def test_top_p_mask_is_the_transformers_warpers_bit_for_bit():
    """The sorted-values shortcut of top_p_drop against TopPLogitsWarper's own mask: SmolLM2's
    vocabulary size and small ones, several rows, -inf from top-k, many ties (the boundary tie is
    taken through torch.sort's order, as the warper does), and p from tiny to nearly 1."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from selfspec.decoding.sampling import top_p_drop

    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        V = (50, 1000, 49152)[trial % 3]
        x = torch.randn(1 + trial % 3, V, generator=g) * (0.5 + 5 * torch.rand(1, generator=g).item())
        if trial % 4 == 0:
            x = (x * 2).round() / 2  # many ties
        if trial % 5 == 0:
            x = TopKLogitsWarper(int(torch.randint(1, V, (1,), generator=g)))(None, x)
        p = float(torch.rand(1, generator=g)) * 0.99 + 0.005
        expected = TopPLogitsWarper(p)(None, x.clone()) == float("-inf")
        assert torch.equal(top_p_drop(x, p) | (x == float("-inf")), expected), (trial, V, p)
    # a tie across the boundary: four equal logits, half the mass kept; the warper's torch.sort decides which
    x = torch.zeros(1, 4)
    assert torch.equal(top_p_drop(x, 0.5), TopPLogitsWarper(0.5)(None, x.clone()) == float("-inf"))


def test_speculative_verify_preserves_target_distribution():
    """Empirical distribution of the first emitted token vs p: total variation < 0.02.

    With 40,000 draws over 6 outcomes the TV distance of an unbiased sampler is ~0.006
    (std); a sampler that returned q, or p without the residual, is off by >= 0.15.
    """
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.4, 0.1, 0.25, 0.15, 0.05])
    q = torch.tensor([0.3, 0.1, 0.3, 0.1, 0.1, 0.1])
    counts = torch.zeros(6)
    n = 40_000
    drafts = torch.multinomial(q, n, replacement=True, generator=g)
    for d in drafts.tolist():
        acc, nxt = speculative_verify(torch.tensor([d]), q.unsqueeze(0), torch.stack([p, p]), g)
        counts[d if acc else nxt] += 1
    tv = 0.5 * (counts / n - p).abs().sum()
    assert tv < 0.02, f"total variation {tv:.4f}"


def test_lazy_chain_verification_equals_warping_every_row_first():
    """verify_chain warps the target rows one at a time up to the first rejection; it must make
    the textbook rule's decisions from the same draws (same n, token and generator state), and
    charge the ledger only the rows it warped."""
    from selfspec.decoding.sampling import verify_chain
    from selfspec.models.ledger import Ledger

    torch.manual_seed(0)
    V = 300
    settings = [Sampling(temperature=0.7, top_p=0.9), Sampling(temperature=1.0), Sampling(temperature=0.5, top_k=20)]
    seen = set()
    for case in range(240):
        s = settings[case % 3]
        k = case % 6
        target = torch.randn(k + 1, V) * 3
        # drafts from a distribution near the target's, so that both accepts and rejects happen
        q = warp(target[:k] + torch.randn(k, V) * (case % 4), s)
        g_draft = torch.Generator().manual_seed(case)
        draft = torch.multinomial(q, 1, generator=g_draft)[:, 0] if k else torch.zeros(0, dtype=torch.long)
        g1, g2 = torch.Generator().manual_seed(1000 + case), torch.Generator().manual_seed(1000 + case)
        ledger = Ledger(torch.device("cpu"))
        lazy = verify_chain(draft, q if k else None, target, s, g1, ledger)
        eager = speculative_verify(draft, q if k else target[:0], warp(target, s), g2)
        assert lazy == eager, case
        assert torch.equal(g1.get_state(), g2.get_state()), case
        assert sum(op.rows for op in ledger.ops if op.kind == "W") == lazy[0] + 1
        assert all(op.vocab == V and op.nucleus == (s.top_p < 1) for op in ledger.ops)
        seen.add((k > 0, lazy[0] < k))
    assert seen == {(False, False), (True, True), (True, False)}  # no drafts, a rejection, all accepted
    with pytest.raises(ValueError, match="without the distributions"):
        verify_chain(torch.tensor([3]), None, torch.randn(2, V), settings[0], torch.Generator())


@pytest.mark.slow
def test_smollm2_greedy_equals_generate(smol):
    text = smol.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}], tokenize=False, add_generation_prompt=True)
    ids = smol.tokenizer(text)["input_ids"]
    g = vanilla(smol).generate(ids, 32)
    assert g.tokens == hf_greedy(smol, ids, 32)


@pytest.mark.slow
@pytest.mark.parametrize("task_name", ["xsum", "cnndm", "humaneval", "gsm8k", "mtbench"])
def test_smollm2_greedy_equals_generate_on_every_task(smol, task_name):
    """Issue 2: vanilla equals generate on SmolLM2 for a real prompt of every task."""
    from selfspec.tasks import build_task

    task = build_task({"name": task_name, "n_examples": 1, "max_prompt_tokens": 384})
    ids = task.encode(task.examples()[0], smol.tokenizer)
    g = vanilla(smol).generate(ids, 12)
    assert g.tokens == hf_greedy(smol, ids, 12)

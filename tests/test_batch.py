"""Batches (issue 54): several prompts decoded at once, each sequence accepting its own number of tokens,
each equal to its single-prompt output. Every method, greedy and sampled, mixed prompt lengths, sequences
that end early, and batches of 2 to 16 with prompts joining as others leave (selfspec.models.batch)."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import PPD_KEYS, cpu_like_profile, method_config
from selfspec.decoding import Sampling, build_decoder
from selfspec.decoding.vanilla import Vanilla
from selfspec.models.batch import Batch, BatchUnavailable
from test_families import N_NEW, PROMPT, tiny_family

#: every method, built directly (tests/test_capture.py's EVERY_METHOD, vanilla first)
METHODS = [
    {"name": "vanilla"},
    {"name": "draft_verify", "skip_attn": [1, 2], "skip_mlp": [2], "max_draft": 4, "never_slower": False},
    {"name": "early_exit", "exit_layer": 1, "max_draft": 3, "never_slower": False},
    {"name": "del", "max_draft": 4, "cost_model": "parameters", "never_slower": False},
    {"name": "adadecode", "head_kind": "lm_head", "layers": [1, 2], "threshold": 0.3},
    {"name": "ngram", "never_slower": False},
    {"name": "ppd"},
    {"name": "swift", "context_window": 4, "bayes_interval": 3, "max_draft": 4, "never_slower": False},
    {"name": "knapspec", "interval": 4, "search_at": 2, "window": 2, "never_slower": False},
    {"name": "clasp", "interval": 4, "never_slower": False},
]


def make(model, method: dict):
    from selfspec.decoding.ppd import PPD
    from selfspec.decoding.tree import random_trees
    from selfspec.models.prompts import PromptTokens

    name = method["name"]
    if name == "vanilla":
        return Vanilla(model)
    if name == "ppd":
        g = torch.Generator().manual_seed(0)
        prompts = PromptTokens(torch.randn(3, 2, model.hidden_size, generator=g) * 0.5)
        return PPD(model, prompts, random_trees(3, 6, 3, random.Random(0)), **PPD_KEYS)
    return build_decoder(method_config(name, **{k: v for k, v in method.items() if k != "name"}), model,
                         profile=cpu_like_profile(model))


def prompts(n: int) -> list[list[int]]:
    """``n`` prompts of mixed lengths (6 to 30 tokens), each repeating a part of itself (drafts get accepted)."""
    rng = random.Random(n)
    out = []
    for i in range(n):
        head = [rng.randrange(256) for _ in range(3 + i % 5)]
        out.append((head + PROMPT)[: 6 + (i * 7) % 25] + head)
    return out


def alone_and_batched(model, method: dict, ps: list[list[int]], size: int, sampling: Sampling, n_new=N_NEW,
                      eos=()):
    """Each prompt decoded alone by a fork of one decoder, and all of them as a batch of ``size`` (each
    slot a fork), every fork starting from the same state."""
    decoder = make(model, method)
    if eos:
        decoder.eos_token_ids = frozenset(eos)
    alone = [decoder.fork().generate(p, n_new, sampling) for p in ps]
    slots = [decoder.fork() for _ in range(size)]
    batch = Batch(model, size)
    batched = batch.run([lambda slot, p=p: slots[slot].generate(p, n_new, sampling) for p in ps])
    return alone, batched, batch


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m["name"])
def test_every_sequence_of_a_batch_decodes_what_it_decodes_alone(family, method):
    """Greedy and sampled, 6 prompts of 6 to 30 tokens in one batch: each sequence's tokens and step
    trace are its single-prompt run's (greedy: vanilla's tokens too), and the batch ran passes of
    several sequences' rows."""
    model = tiny_family(family)
    ps = prompts(6)
    want = [Vanilla(model).generate(p, N_NEW).tokens for p in ps]
    for sampling in (Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=3)):
        alone, batched, batch = alone_and_batched(model, method, ps, len(ps), sampling)
        for a, b in zip(alone, batched):
            assert b.tokens == a.tokens
            assert [t.row() | {"ops": None} for t in b.trace] == [t.row() | {"ops": None} for t in a.trace]
        if sampling.greedy:
            assert [g.tokens for g in batched] == want
        assert max(batch.passes) > 1 and max(batch.rows) > max(len(p) for p in ps[:1])


@pytest.mark.parametrize("size", [2, 3, 16])
@pytest.mark.parametrize("method", [METHODS[1], METHODS[5], METHODS[6], METHODS[7]], ids=lambda m: m["name"])
def test_prompts_join_as_sequences_leave(size, method):
    """Continuous batching: 16 prompts through batches of 2, 3 and 16 slots; some sequences stop at an
    early EOS. Every sequence is vanilla's, cut where vanilla's is."""
    model = tiny_family("llama")
    ps = prompts(16)
    ref = [Vanilla(model).generate(p, N_NEW).tokens for p in ps]
    eos = ref[0][6]  # an early token of the first sequence ends it (and any other that meets it)
    cut = [r[: r.index(eos) + 1] if eos in r else r for r in ref]
    alone, batched, batch = alone_and_batched(model, method, ps, size, Sampling(), eos=[eos])
    assert [g.tokens for g in batched] == cut == [g.tokens for g in alone]
    assert sum(g.stop_reason == "eos" for g in batched) >= 1
    assert max(batch.passes) == size  # every slot in one pass at some step


def test_a_batch_refuses_a_model_whose_passes_take_static_shapes():
    from selfspec.models import capture

    model = tiny_family("llama").with_passes(capture.StepRunner("static"))
    with pytest.raises(BatchUnavailable, match="model.capture=off for batch_size > 1"):
        Batch(model, 2)


def test_batched_rows_are_bit_identical_to_their_own_pass():
    """The primitive under every batch: ``run_batched`` over passes of 1 to 20 rows at several cache
    lengths, float32 past 32 rows in all (the linears in blocks), equals each pass run alone."""
    from selfspec.models.batch import Rows

    model = tiny_family("llama")
    g = torch.Generator().manual_seed(0)
    shapes = [(1, 10), (4, 3), (20, 17), (9, 0), (1, 30)]  # (rows, cached positions)
    caches, items, alone = [], [], []
    with torch.inference_mode():
        for rows, past in shapes:
            ids = torch.randint(0, 256, (1, past + rows), generator=g)
            pair = []
            for _ in range(2):
                cache = model.new_cache(64)
                if past:
                    model.forward(ids[:, :past], cache, start=0)
                pair.append(cache)
            h = model.embed(ids[:, past:])
            rope = model.rope(model.positions(past, rows), h)
            mask = model.causal_mask(rows, past)
            alone.append(model.walk(h, range(4), pair[0], rope, mask))
            items.append(Rows(h, pair[1], rope, mask, None))
            caches.append(pair)
        together = model.run_batched(items, range(4), None)
    for a, b, (c1, c2) in zip(alone, together, caches):
        assert torch.equal(a, b)
        for i in range(4):
            assert all(torch.equal(x, y) for x, y in zip(c1.layer_kv(i), c2.layer_kv(i)))

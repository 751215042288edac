"""Weights and caches in huge pages (:mod:`selfspec.models.arena`): the same values at new
addresses, so every output is bit-identical, and transformers' own modules read the same memory."""

from __future__ import annotations

import pytest
import torch

from selfspec.models import arena

pytestmark = pytest.mark.skipif(not arena.available(), reason="huge pages need Linux's madvise")


def test_place_lays_tensors_out_in_order_on_page_boundaries():
    views = arena.place([(3, 5), (7,), (2, 4, 8)], torch.float32)
    assert [tuple(v.shape) for v in views] == [(3, 5), (7,), (2, 4, 8)]
    assert all(v.is_contiguous() and v.dtype == torch.float32 and v.data_ptr() % arena.ALIGN == 0 for v in views)
    assert views[0].data_ptr() % arena.HUGE_PAGE == 0
    starts = [v.data_ptr() for v in views]
    assert starts == sorted(starts) and all(b - a >= 4096 for a, b in zip(starts, starts[1:]))
    for i, v in enumerate(views):  # zeroed, and no two overlap
        assert not v.any()
        v.fill_(i + 1)
    assert [int(v.flatten()[0]) for v in views] == [1, 2, 3] and all((v == i + 1).all() for i, v in enumerate(views))


def test_huge_page_bytes_reads_the_mapping_of_a_tensor():
    (view,) = arena.place([(arena.HUGE_PAGE // 2,)], torch.float32)  # 4 MiB
    view.fill_(1.0)
    got = arena.huge_page_bytes(view)
    assert got is not None and 0 <= got <= 2 * arena.HUGE_PAGE + arena.HUGE_PAGE
    if arena.thp_mode() in ("always", "madvise"):
        assert got >= arena.HUGE_PAGE  # the kernel may decline under memory pressure, but not here


def test_placed_weights_give_the_unplaced_models_outputs_bit_for_bit(monkeypatch):
    """A model whose linears sit in the huge-page block computes what the same weights in torch's
    allocation compute, in the runtime and in transformers' own forward; every module reads the
    block (q/k/v and gate/up as rows of the fused matrices) and a tied head stays tied."""
    from selfspec.config import model_config
    from selfspec.models.loading import load_model

    placed = load_model(model_config("tiny-random")).model
    monkeypatch.setattr(arena, "available", lambda: False)
    plain = load_model(model_config("tiny-random")).model
    assert placed.weights_placed and not plain.weights_placed
    for a, b in zip(placed.hf.state_dict().values(), plain.hf.state_dict().values()):
        assert torch.equal(a, b)
    fam = placed.family
    block = (fam.qkv(0)[0].weight.data_ptr(), fam.lm_head.weight.data_ptr())
    for i in range(placed.num_layers):
        qkv, gate_up = placed._qkv[i][0], placed._gate_up[i][0]
        assert fam.qkv(i)[0].weight.data_ptr() == qkv.data_ptr()
        assert fam.gate_up(i)[1].weight.data_ptr() == gate_up.data_ptr() + gate_up[0].numel() * gate_up.shape[0] // 2 * 4
        for w in (qkv, gate_up, fam.out_proj(i).weight, fam.down_proj(i).weight):
            assert block[0] <= w.data_ptr() < block[1] and w.data_ptr() % arena.ALIGN == 0
    assert placed.tied_embeddings == plain.tied_embeddings
    ids = torch.randint(0, placed.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        outs = []
        for model in (placed, plain):
            cache = model.new_cache(40)
            prefill = model.logits(model.forward(ids[:, :20], cache))
            steps = [model.logits(model.forward(ids[:, j:j + 1], cache)) for j in range(20, 24)]
            chain = model.logits(model.forward(ids[:, 24:30], cache))
            outs.append([prefill, *steps, chain, model.hf(ids).logits])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_a_cpu_cache_of_a_huge_page_or_more_is_one_zeroed_block():
    from selfspec.models.cache import LayerCache

    big = LayerCache(4, 2, 64, 2048, torch.float32, "cpu")  # 8 MiB
    small = LayerCache(4, 2, 64, 16, torch.float32, "cpu")
    first = big.keys[0].data_ptr()
    assert first % arena.HUGE_PAGE == 0
    assert all(first <= t.data_ptr() < first + 8 * 2048 * 2 * 64 * 4 for t in big.keys + big.values)
    assert not any(t.any() for t in big.keys + big.values)
    assert len({t.data_ptr() for t in big.keys + big.values}) == 8
    assert all(tuple(t.shape) == (1, 2, 2048, 64) for t in big.keys + big.values)
    assert tuple(small.keys[0].shape) == (1, 2, 16, 64) and not small.keys[0].any()

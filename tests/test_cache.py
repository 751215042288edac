"""The layer cache: truncate, gather and independent lengths equal a full recomputation."""

import pytest
import torch

from selfspec.models.cache import CacheOverflowError
from selfspec.models.layered import Pass, Rows, SkipSet


def _full(model, ids):
    cache = model.new_cache(len(ids) + 4)
    h = model.forward(torch.tensor([ids]), cache, start=0)
    return cache, model.logits(h)


def test_truncate_then_recompute_equals_fresh(tiny):
    m = tiny.model
    ids = list(range(100, 120))
    cache, ref = _full(m, ids)
    cache.truncate(12)
    assert cache.lengths == [12] * m.num_layers
    h = m.forward(torch.tensor([ids[12:]]), cache)
    fresh, _ = _full(m, ids)
    for i in range(m.num_layers):
        k, v = cache.layer_kv(i)
        k2, v2 = fresh.layer_kv(i)
        torch.testing.assert_close(k, k2)
        torch.testing.assert_close(v, v2)
    torch.testing.assert_close(m.logits(h), ref[:, 12:])


def test_gather_keeps_chosen_slots_as_recomputation(tiny):
    m = tiny.model
    prefix, a, b = list(range(200, 210)), [7, 8, 9], [11, 12]
    # write prefix, then a distractor branch b, then the path a, all after the prefix
    cache = m.new_cache(32)
    m.forward(torch.tensor([prefix]), cache, start=0)
    m.forward(torch.tensor([b]), cache, start=len(prefix))  # slots 10,11 at positions 10,11
    # path a at positions 10..12 in slots 12..14, attending to the prefix and itself only
    allowed = torch.zeros(3, 15, dtype=torch.bool)
    allowed[:, :10] = True
    for j in range(3):
        allowed[j, 12 : 13 + j] = True
    m.forward(torch.tensor([a]), cache, Pass(rows=Rows.packed(torch.tensor([[10, 11, 12]]), m.prepare_mask(allowed))))
    cache.gather(10, [12, 13, 14])
    ref, _ = _full(m, prefix + a)
    for i in range(m.num_layers):
        torch.testing.assert_close(cache.layer_kv(i)[0], ref.layer_kv(i)[0])
        torch.testing.assert_close(cache.layer_kv(i)[1], ref.layer_kv(i)[1])


def test_independent_layer_lengths(tiny):
    m = tiny.model
    ids = list(range(300, 310))
    cache = m.new_cache(16)
    # all layers see 6 tokens; the lower half of the layers sees 4 more, then the upper catches up
    h = m.forward(torch.tensor([ids[:6]]), cache, start=0)
    half = m.num_layers // 2
    mid = m.forward(torch.tensor([ids[6:]]), cache, Pass(range(half)))
    assert cache.lengths == [10] * half + [6] * (m.num_layers - half)
    top = m.forward(mid, cache, Pass(range(half, m.num_layers)))
    ref, logits = _full(m, ids)
    torch.testing.assert_close(m.logits(top), logits[:, 6:])
    assert cache.lengths == [10] * m.num_layers


def test_skip_set_leaves_layers_untouched(tiny):
    m = tiny.model
    cache = m.new_cache(8)
    m.forward(torch.tensor([[5, 6]]), cache, Pass(skip=SkipSet.of(attn=[1], mlp=[2])), start=0)
    assert cache.lengths[1] == 0 and cache.lengths[0] == 2


def test_overflow_names_the_fix(tiny):
    cache = tiny.model.new_cache(3)
    with pytest.raises(CacheOverflowError, match="max_length"):
        tiny.model.forward(torch.tensor([[1, 2, 3, 4]]), cache, start=0)

"""The passes of the layer-skip searches that choose a skip set while decoding (CLaSp §3.2-3.3, KnapSpec):
the full model's states after every sublayer of a verification, and a block run over many candidate
states at once. Both are built here as :class:`~selfspec.models.passes.Pass` records that the runtime
runs (:meth:`~selfspec.models.layered.LayeredModel.forward`), a capturing model at static shapes.
"""

from __future__ import annotations

import torch

from selfspec.models.capture import BUCKETS
from selfspec.models.layered import Joins, LayeredModel, Pass, Rows, SkipSet
from selfspec.models.ledger import Ledger

__all__ = ["BLOCKS", "branch_groups", "branch_pass", "sublayer_states"]

#: the blocks a branch pass runs: a layer's attention sublayer, its MLP sublayer, or both
BLOCKS = ("attn", "mlp", "layer")


def sublayer_states(model: LayeredModel, ids: torch.Tensor, cache, start: int, ledger: Ledger | None = None,
                    rows: int = 1, joins: Joins | None = None) -> list[torch.Tensor]:
    """A full pass of ``ids`` ``[1, n]`` after ``start`` cached positions, writing the cache as a plain
    pass does, that keeps the state of every row after every sublayer: ``2L + 1`` states ``[n, d]``, the
    embedding first, then after layer ``i``'s attention (``2i + 1``) and after its MLP (``2i + 2``); the
    last is the input of the final norm. KnapSpec compares its candidates with these. Each sublayer is a
    pass of its own (one layer, the other sublayer left out), so the operators and their order are a
    plain pass's, and a capturing model runs each at a static shape: the attention one writes the
    layer's K/V, the MLP one touches no cache. ``rows``: the widest such pass the caller makes
    (KnapSpec: ``max_draft + 1``); each runs at a static shape of at least that many rows
    (:attr:`Pass.at_least`), so each sublayer takes one graph whatever the draft's length. ``joins``: the
    generation's batch, which each sublayer's pass joins (:data:`~selfspec.models.layered.Joins`: it may
    yield to the batch's other sequences)."""
    h = model.embed(ids)
    rope = model.rope(model.positions(start, h.shape[1]), h)
    states = [h[0]]
    for i in range(model.num_layers):
        for skip in (SkipSet.of(mlp=[i]), SkipSet.of(attn=[i])):
            h = model.forward(h, cache, Pass(range(i, i + 1), skip, at_least=rows), start=start, rope=rope,
                              ledger=ledger, joins=joins)
            states.append(h[0])
    return states


def branch_groups(branches: int, rows: int, most: int = BUCKETS[-1]) -> list[tuple[int, int]]:
    """``(first, count)`` of each group of a branch pass (:func:`branch_pass`) of ``branches`` branches of
    ``rows`` rows that a capturing model runs as one static pass: the fewest groups of whole branches
    that ``most`` rows hold (the largest bucket, :data:`selfspec.models.capture.BUCKETS`), their sizes
    within one branch of each other, so that they fall in the same bucket (one graph per layer and
    block, not one per remainder's size). KnapSpec's branch passes reach 1,000 rows and more (its DP's
    states, a window of ~10 tokens each): in groups they are captured passes, where one pass ran
    eagerly."""
    per = max(1, most // max(rows, 1))
    groups = -(-branches // per)
    if groups <= 0:
        return []
    size, extra = divmod(branches, groups)
    counts = [size + (g < extra) for g in range(groups)]
    return [(sum(counts[:g]), n) for g, n in enumerate(counts)]


def branch_pass(model: LayeredModel, x: torch.Tensor, layer: int, block: str, cache, context: int,
                ledger: Ledger | None = None) -> torch.Tensor:
    """One ``block`` (:data:`BLOCKS`) of decoder layer ``layer`` over ``B`` candidate states of the same
    ``T`` tokens at once, ``x`` ``[B, T, d]``: the batched pass of the layer-skip searches (CLaSp §3.3's
    "sequence parallel" evaluation, KnapSpec's branch-parallel one). The branches are laid out as one
    scratch pass (:meth:`~selfspec.models.passes.Rows.scratch`) of ``B·T`` rows; branch ``b``'s row
    ``t`` sits at position ``context + t``, sees the cache's first ``context`` positions and rows
    ``0..t`` of its own branch, and nothing is kept in the cache. Returns ``[B, T, d]``.

    A capturing model runs the branches in groups of at most the largest bucket's rows
    (:func:`branch_groups`), each a static scratch pass (the branches see nothing of each other, so a
    group's rows are the whole pass's); only a branch wider than a bucket runs eagerly. Elsewhere the
    ``B·T`` rows are one eager pass, recorded in ``ledger`` as the walks of the groups a capturing
    model runs, so a projection onto a GPU profile prices what the GPU would run. It is handed no
    batch: inside a batch of generations (:mod:`selfspec.models.batch`) it runs alone, within its
    generation, and is not one of the batch's passes (nor does it yield to the other sequences)."""
    if block not in BLOCKS:
        raise ValueError(f"branch_pass: block must be one of {', '.join(BLOCKS)}, got {block!r}")
    b, t, d = x.shape
    groups = branch_groups(b, t)
    if model.steps is not None and len(groups) > 1:
        return torch.cat([branch_pass(model, x[i:i + n], layer, block, cache, context, ledger) for i, n in groups])
    dev = model.device
    offsets = torch.arange(t, device=dev).repeat(b)
    branch = torch.arange(b, device=dev).repeat_interleave(t)
    own = (branch.unsqueeze(1) == branch.unsqueeze(0)) & (offsets.unsqueeze(1) >= offsets.unsqueeze(0))
    skip = {"attn": SkipSet.of(mlp=[layer]), "mlp": SkipSet.of(attn=[layer]), "layer": None}[block]
    several = model.steps is None and len(groups) > 1  # recorded as the groups a capturing model runs
    out = model.forward(x.reshape(1, b * t, d), cache, Pass(range(layer, layer + 1), skip,
                                                            Rows.scratch(context, offsets, own)),
                        ledger=None if several else ledger)
    if several and ledger is not None:
        for _, n in groups:
            ledger.layers(n * t, int(block != "mlp"), int(block != "attn"), int(context))
    return out.view(b, t, d)

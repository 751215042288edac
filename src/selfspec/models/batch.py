"""Several generations decoding at once on one model: each its own decoding loop, their passes run together.

Self-speculative methods are written for one sequence: a step drafts, verifies and accepts as many
tokens as that sequence's draft earns, and its cache keeps that sequence's own length. A batch here
keeps all of that per sequence and shares only what batching is for, the weights' reads: every
generation runs its method's own loop (:meth:`~selfspec.decoding.base.Decoder.generate`, unchanged)
in a greenlet of its own, handed the batch (``generate(..., joins=batch)``), and when it asks the model
for a layer walk (:meth:`~selfspec.models.layered.LayeredModel.run_layers`, through ``forward``) or a
head product (:meth:`~selfspec.models.layered.LayeredModel.head`, ``logits``) with the batch
(``joins=state.joins``: :data:`~selfspec.models.layered.Joins`, the name that says a call may yield),
the call is parked (:meth:`Batch.parked_walk`, :meth:`Batch.parked_head`). The model holds no batch:
a call not handed one runs alone, at once. Once every live generation
is parked or done, the parked calls that can run together (walks of the same layers with the same
sublayers skipped; products with the same head) run as one pass of all their rows
(:meth:`~selfspec.models.layered.LayeredModel.run_batched`), and each generation resumes with its
own rows. So a batch of B sequences, each drafting k tokens, verifies them in one pass of B·(k + 1)
rows whose weights are read once, while each sequence keeps its own cache length, draft length,
tree, skip set, exit layer and accepted count: ragged by construction, and nothing is realigned.

**Lossless per sequence.** Each row of a batched pass is computed as its own pass computes it: the
linears take the rows in blocks whose arithmetic does not depend on the other rows (the skinny CPU
kernel, up to :data:`~selfspec.models.kernels.MAX_ROWS` float32 rows a block, any number in
bfloat16), and the attention runs each pass's rows over that sequence's keys as the pass alone
would. A float32 pass of more than ``MAX_ROWS`` rows (a prefill, a large PPD tree) computes its
linears with a library's GEMM (:func:`~selfspec.models.kernels.wide_linear`, oneDNN's, or torch's), which does
not promise rows independent of the block, so it runs alone, as it does outside a
batch. Every sequence of a batch therefore decodes the tokens it decodes alone, bit for bit
(tests/test_batch.py), under sampling too (each generation has its own seeded generator).

**Leaving and joining.** :meth:`Batch.run` keeps at most ``size`` generations live; one that
finishes (EOS, its budget, a stop string) leaves at once, and the next waiting prompt joins in its
slot: continuous batching. A sequence's K/V live in its own cache, so none moves when another
rejects drafts, leaves or joins.

What does not batch: passes of a model whose passes take static shapes (``capture`` static or
graphs; the runner refuses ``batch_size > 1`` there), the HF peers (transformers' ``generate`` has
its own batching: :mod:`selfspec.decoding.peers`), and the layer-skip searches' branch passes (they
run alone, inside their generation: :func:`selfspec.decoding.branches.branch_pass` hands the runtime no
batch).
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from selfspec.models import kernels

__all__ = ["Batch", "BatchUnavailable", "Walk"]


class BatchUnavailable(ValueError):
    """The model cannot decode a batch (its passes take static shapes)."""


@dataclass
class Walk:
    """One pass's rows in a batched walk: its hidden states ``[1, n, d]``, where its K/V go, its rotary
    tables, mask and kept states (:meth:`~selfspec.models.layered.LayeredModel.run_layers`' arguments)."""

    h: torch.Tensor
    kv: Any
    rope: Any
    mask: torch.Tensor | None
    keep: dict | None


@dataclass
class _Parked:
    """A call a generation made and waits on: a layer walk (``walk``) or a head product (``x``), and the
    ledger component its generation charges it to."""

    key: tuple
    component: str
    walk: Walk | None = None
    layers: Any = None
    skip: Any = None
    x: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    weights: str | None = None
    #: where the generation's ledger recorded the call: (ledger, op index), None unrecorded
    recorded: tuple | None = None


def _rows(call: _Parked) -> int:
    """The rows of a parked walk or head product."""
    if call.walk is not None:
        return int(call.walk.h.shape[1])
    return call.x.numel() // call.x.shape[-1]


@contextlib.contextmanager
def _unwound(live: dict):
    """On an exception (a generation's error, an interrupt), end every generation still live inside the
    block, each unwinding its own context managers there (its ``inference_mode`` among them): a
    greenlet left suspended is ended later by the garbage collector, and its exits then set the
    thread's grad mode back to what it was inside the batch, leaving inference mode on for the rest of
    the process (found: a training job after an interrupted batched evaluation in the same process had
    no gradients)."""
    try:
        yield
    except BaseException:
        for g in list(live):
            if not g.dead:
                g.throw()  # GreenletExit: the generation's ``with`` blocks exit, innermost first
        raise


class Batch:
    """Runs generations together on ``model`` (module docstring), at most ``size`` at once.

    Counts what it ran: :attr:`passes` (batched walks and head products, by how many generations
    each held), :attr:`rows` (the rows of each batched walk) and :attr:`rounds` (the times every live
    generation was parked or done); and records each walk and head product it ran as a ledger op
    (:attr:`ops`, :mod:`selfspec.models.ledger`): a walk's rows are all its generations' rows, its
    context their row-weighted mean, so a profile prices a pass of B·k rows as it ran."""

    def __init__(self, model, size: int) -> None:
        if model.steps is not None:
            raise BatchUnavailable(f"a batch runs dynamic passes, and the model's passes take static shapes "
                                   f"(model.capture={model.capture}); use model.capture=off for batch_size > 1")
        if int(size) < 1:
            raise ValueError(f"a batch holds at least one generation, got size {size}")
        self.model, self.size = model, int(size)
        self._main = None
        #: walks and head products run, by the number of generations each held
        self.passes: collections.Counter[int] = collections.Counter()
        #: rows of each batched walk run
        self.rows: list[int] = []
        #: scheduling rounds: every live generation parked (or done), their calls run
        self.rounds = 0
        #: the walks and head products run, as ledger ops (:class:`~selfspec.models.ledger.LayerOp`, ``HeadOp``)
        self.ops: list = []

    # --- the generations' side: parking a call (the runtime's, for a call handed the batch) ----------
    def _parks(self) -> bool:
        """Whether the caller is one of the batch's generations (:meth:`run`): a call handed the batch
        from outside them (no batch running, or the batch's own greenlet) runs alone."""
        from greenlet import getcurrent

        return self._main is not None and getcurrent() is not self._main

    def parked_walk(self, model, h, layers, kv, rope, mask, skip, keep, component: str = "host",
                    weights: str | None = None, recorded: tuple | None = None) -> torch.Tensor:
        """A generation's layer walk (:meth:`~selfspec.models.layered.LayeredModel.run_layers` handed
        the batch): parked until the batch runs it with the others of its kind (the same layers,
        skipped sublayers and weights), then its states. The call yields: the other generations run
        until every live one is parked or done. ``recorded``: where the generation's ledger recorded
        the walk, ``(ledger, op index)``; a walk run with others' rows is marked there as a share of
        that pass (:meth:`~selfspec.models.ledger.Ledger.shared`)."""
        if not self._parks():
            return model.walk(h, layers, kv, rope, mask, skip, keep, weights)
        key = ("layers", tuple(layers), skip, weights)
        return self._main.switch(_Parked(key, component, Walk(h, kv, rope, mask, keep), layers, skip,
                                         weights=weights, recorded=recorded))

    def parked_head(self, model, x, weight, component: str = "host", recorded: tuple | None = None
                    ) -> torch.Tensor:
        """A generation's head product (:meth:`~selfspec.models.layered.LayeredModel.head` handed the
        batch), parked likewise: the call yields (``recorded``: as :meth:`parked_walk`'s)."""
        if not self._parks():
            return model.linear(x, weight)
        key = ("head", weight.data_ptr(), tuple(weight.shape))
        return self._main.switch(_Parked(key, component, x=x, weight=weight, recorded=recorded))

    # --- the batch's side ----------------------------------------------------------------------
    def run(self, jobs: Sequence[Callable[[int], Any]], done: Callable[[int, Any], None] | None = None) -> list:
        """Run every job (a function of the batch slot it runs in, ``0 ≤ slot < size``: one generation,
        e.g. ``lambda slot: decoders[slot].generate(..., joins=batch)``: a job hands the batch to its
        generation, whose passes join it only so), at most :attr:`size` at once; one that finishes
        leaves, and the next job joins in its slot. Returns the jobs' results in order;
        ``done(index, result)`` is called as each finishes. An exception in a job stops the batch and
        is raised here."""
        from greenlet import getcurrent, greenlet

        results: list = [None] * len(jobs)
        waiting = collections.deque(enumerate(jobs))
        live: dict[Any, int] = {}  # greenlet -> its job's index
        slots: dict[Any, int] = {}  # greenlet -> its slot
        free = list(range(self.size))
        parked: dict[Any, _Parked] = {}

        def advance(g, value) -> None:  # a new generation gets its slot, a parked one its call's result
            out = g.switch(value)
            if g.dead:
                i = live.pop(g)
                free.append(slots.pop(g))
                free.sort()
                results[i] = out
                if done is not None:
                    done(i, out)
            else:
                parked[g] = out

        self._main = getcurrent()
        try:
            with torch.inference_mode(), _unwound(live):
                while waiting or live:
                    while waiting and free:
                        i, job = waiting.popleft()
                        g = greenlet(job)
                        live[g], slots[g] = i, free.pop(0)
                        advance(g, slots[g])
                    if not parked:
                        continue
                    self.rounds += 1
                    groups: dict[tuple, list] = {}
                    for g in sorted(parked, key=slots.__getitem__):  # in slot order: deterministic
                        groups.setdefault(parked[g].key, []).append(g)
                    for key, members in groups.items():
                        calls = [parked.pop(g) for g in members]
                        outs = self._run(key[0], calls)
                        for g, out in zip(members, outs):
                            advance(g, out)
        finally:
            self._main = None
        return results

    def _run(self, kind: str, calls: list[_Parked]) -> list[torch.Tensor]:
        """Run parked calls of one kind and key: together where each row's arithmetic stays its own
        call's (:meth:`_joins`), the others alone, as outside a batch; each walk or product run is
        recorded in :attr:`ops`."""
        model = self.model
        together = [c for c in calls if self._joins(c)]
        outs: dict[int, torch.Tensor] = {}
        if len(together) > 1:
            rows = sum(map(_rows, together))
            if kind == "layers":
                states = model.run_batched([c.walk for c in together], together[0].layers, together[0].skip,
                                           together[0].weights)
                self.rows.append(rows)
            else:
                flat = [c.x.reshape(1, -1, c.x.shape[-1]) for c in together]
                out = model.linear(torch.cat(flat, dim=1), together[0].weight, rows_apart=True)
                states = [o.view(*c.x.shape[:-1], -1) for o, c in
                          zip(out.split([f.shape[1] for f in flat], dim=1), together)]
            outs = {id(c): s for c, s in zip(together, states)}
            self.passes[len(together)] += 1
            self._record(kind, together)
            for c in together:  # each generation's ledger prices its rows as their share of this pass
                if c.recorded is not None:
                    c.recorded[0].shared(c.recorded[1], rows)
        for c in calls:
            if id(c) not in outs:
                self.passes[1] += 1
                self._record(kind, [c])
                outs[id(c)] = (model.walk(c.walk.h, c.layers, c.walk.kv, c.walk.rope, c.walk.mask, c.skip, c.walk.keep,
                                          c.weights) if kind == "layers" else model.linear(c.x, c.weight))
        return [outs[id(c)] for c in calls]

    def _record(self, kind: str, calls: list[_Parked]) -> None:
        """The ledger op of a walk or head product run for ``calls``, before it runs (the caches' lengths
        are the contexts its rows attend to): charged to the component most of them charge it to."""
        from selfspec.models.quantised import weights_format
        from selfspec.models.ledger import HeadOp, LayerOp

        component = collections.Counter(c.component for c in calls).most_common(1)[0][0]
        if kind == "head":
            rows = sum(map(_rows, calls))
            self.ops.append(HeadOp(component, rows, int(calls[0].weight.shape[0]),
                                   weights_format(calls[0].weight) or "", shared=rows if len(calls) > 1 else 0))
            return
        layers, skip = list(calls[0].layers), calls[0].skip
        if not layers:
            return
        attention = sum(skip is None or i not in skip.attn for i in layers)
        mlp = sum(skip is None or i not in skip.mlp for i in layers)
        sizes = [_rows(c) for c in calls]
        contexts = [c.walk.kv.length(layers[0]) if hasattr(c.walk.kv, "length") else 0 for c in calls]
        context = round(sum(n * t for n, t in zip(sizes, contexts)) / sum(sizes))
        self.ops.append(LayerOp(component, sum(sizes), attention, mlp, context, weights=calls[0].weights or "",
                                shared=sum(sizes) if len(calls) > 1 else 0))  # joined: priced as it ran

    def _joins(self, call: _Parked) -> bool:
        """Whether a parked call's rows can share a pass with others and stay what they are alone: the
        runtime's skinny kernel (row-independent), no gradient, and in float32 at most
        :data:`~selfspec.models.kernels.MAX_ROWS` rows (more take a library's GEMM alone)."""
        model = self.model
        x = call.walk.h if call.walk is not None else call.x
        if model.linear_kernel != "skinny" or torch.is_grad_enabled() or x.dtype != model.dtype:
            return False
        rows = x.numel() // x.shape[-1]
        return x.dtype == torch.bfloat16 or rows <= kernels.MAX_ROWS

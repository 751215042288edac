"""The cost ledger of one generation: what model work each step did, and where its time went.

PPD §4 splits a method's speedup into a hardware-independent part, the acceptance length τ, and a
hardware-dependent part, the forward latency ``L_fp(n)``: ``speedup(n) = τ(n) / L_fp(n)``. The
ledger does that for every method and every part of a step:

* **ops** — the model work of a step, recorded by :class:`~selfspec.models.layered.LayeredModel`
  itself as it runs, so no method can leave any out: layer walks (rows, attention and MLP
  sublayers run, the context they attend to), LM-head products (rows, vocabulary rows) and the
  exit heads' own transforms (rows). Each op carries the *component* it was run for. Under
  greedy decoding the ops depend on the algorithm only, not on the machine, so a recorded run can
  be re-costed with another machine's profile (:mod:`selfspec.measure.profile`).
* **phase times** — the wall time of the generation split by component, from timers at phase
  switches only (a few per step: perf_counter on a CPU, CUDA events on a GPU), so the timers cost
  next to nothing. Time outside every labelled phase is ``host``: the loop's bookkeeping, draft
  acceptance, cache roll-back. The components add up to the generation's measured seconds.

Components (:data:`COMPONENTS`): ``prefill`` (the prompt's step), ``plain`` (a step with no
drafts: vanilla's, or one the speculation gate made plain), ``draft`` (the drafter's own work:
skip-set or early-exit layers, a draft head, a context lookup), ``heads`` (intermediate exit
heads: early exit, DEL, AdaDecode), ``verify`` (the verification pass and its scoring), ``tree``
(PPD's choice and layout of the candidate tree), ``search`` (a skip set searched while decoding:
KnapSpec's and CLaSp's batched candidate passes) and ``host`` (the rest).

An op is a small typed record (:class:`LayerOp`, :class:`HeadOp`, :class:`LinearOp`,
:class:`WarpOp`), read by its field names. A step trace stores it as a short list, for a compact
trace (:meth:`~LayerOp.row`; :func:`as_op` reads one back): ``[component, "L", rows, attention
sublayers, MLP sublayers, context]`` (with a seventh entry, 1, when a model that captures its passes
ran this walk eagerly: a decoding pass no bucket holds, :mod:`selfspec.models.capture`; a static
pass adds, after a seventh entry of 0, its bucket's rows and the cache slots it attends over),
``[component, "H", rows, vocabulary rows]`` (a walk or head product over a quantised copy of the
weights, a draft's, says its format in the kind: ``"L:int8"``, ``"H:int4"``; one that ran in a
batch's pass with other sequences' rows ends with that pass's rows, after ``0, 0, 0`` in a walk:
:attr:`LayerOp.shared`), ``[component, "X", rows, in features, out features]``
or, under sampling, ``[component, "W", rows, vocabulary, nucleus]``: logit rows warped into the
target distribution (:func:`selfspec.decoding.sampling.warp`; ``nucleus`` 1 when top-p sorts the
vocabulary). Greedy selection (an argmax) is no op: it is part of a step's host time.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple, Union

if TYPE_CHECKING:
    import torch

__all__ = ["COMPONENTS", "LABELS", "HeadOp", "LayerOp", "Ledger", "LinearOp", "Op", "WarpOp", "as_op", "phase"]

#: the components of a step's cost, in the order charts stack them
COMPONENTS = ("prefill", "plain", "draft", "heads", "verify", "tree", "search", "host")
#: what a reader calls each component
LABELS = {"prefill": "prefill", "plain": "plain steps", "draft": "drafting", "heads": "exit heads",
          "verify": "verification", "tree": "tree building", "search": "skip search", "host": "bookkeeping"}


class LayerOp(NamedTuple):
    """A layer walk: ``rows`` new rows through ``attention`` and ``mlp`` sublayers, attending to
    ``context`` cached positions; ``eager``: a model that captures its passes ran it eagerly.
    A static-shape (captured) pass also records what it ran (:mod:`selfspec.models.capture`):
    ``padded``, the rows of its bucket (a 5-row pass runs 8), and ``span``, the cache slots its
    attention spans (the whole buffer, masked); 0 where the walk ran dynamically, at its own rows
    and context. ``weights``: the format of the quantised copy its linears read (a draft's:
    ``int8``, ``int4``), "" for the target's own; stored in the kind (``"L:int8"``)."""

    component: str
    rows: int
    attention: int
    mlp: int
    context: int
    eager: bool = False
    padded: int = 0
    span: int = 0
    weights: str = ""
    #: the rows of the batched pass these rows ran in, theirs among them (:mod:`selfspec.models.batch`);
    #: 0: the walk ran alone. A profile prices the op as its rows' share of that pass
    shared: int = 0
    kind = "L"

    def row(self) -> list:
        head = [self.component, _kind("L", self.weights), self.rows, self.attention, self.mlp, self.context]
        if self.shared:
            return head + [int(self.eager), self.padded, self.span, self.shared]
        if self.padded:
            return head + [int(self.eager), self.padded, self.span]
        return head + ([1] if self.eager else [])


class HeadOp(NamedTuple):
    """An LM-head product: ``rows`` states against ``vocab`` rows of the head (``weights``: of a quantised
    copy's head, as :class:`LayerOp`)."""

    component: str
    rows: int
    vocab: int
    weights: str = ""
    #: the rows of the batched product these rows ran in (as :attr:`LayerOp.shared`); 0: alone
    shared: int = 0
    kind = "H"

    def row(self) -> list:
        return [self.component, _kind("H", self.weights), self.rows, self.vocab] + ([self.shared] if self.shared else [])


class LinearOp(NamedTuple):
    """A small head transform (an exit head's ``d_in × d_out`` map before the LM head)."""

    component: str
    rows: int
    d_in: int
    d_out: int
    kind = "X"

    def row(self) -> list:
        return [self.component, "X", self.rows, self.d_in, self.d_out]


class WarpOp(NamedTuple):
    """Sampled selection: ``rows`` logit rows of ``vocab`` entries warped (``nucleus``: top-p sorts)."""

    component: str
    rows: int
    vocab: int
    nucleus: bool
    kind = "W"

    def row(self) -> list:
        return [self.component, "W", self.rows, self.vocab, int(self.nucleus)]


def _kind(kind: str, weights: str) -> str:
    """A walk's or head product's stored kind: ``L`` / ``H``, with the quantised weights' format after a
    colon (``L:int8``) where the op read a quantised copy."""
    return f"{kind}:{weights}" if weights else kind


Op = Union[LayerOp, HeadOp, LinearOp, WarpOp]
_RECORDS = (LayerOp, HeadOp, LinearOp, WarpOp)
_KINDS = {cls.kind: cls for cls in _RECORDS}


def as_op(op: "Op | list") -> Op:
    """The record of ``op``: itself, or a step trace's stored list (module docstring)."""
    if isinstance(op, _RECORDS):
        return op
    try:
        kind, _, weights = op[1].partition(":")
        cls = _KINDS[kind]
        if weights and cls not in (LayerOp, HeadOp):
            raise KeyError(weights)
    except (KeyError, IndexError, TypeError, AttributeError):
        raise ValueError(f"unknown ledger op {op!r}") from None
    if cls is LayerOp:
        return LayerOp(op[0], *op[2:6], eager=len(op) > 6 and bool(op[6]), padded=op[7] if len(op) > 8 else 0,
                       span=op[8] if len(op) > 8 else 0, weights=weights, shared=op[9] if len(op) > 9 else 0)
    if cls is HeadOp:
        return HeadOp(op[0], op[2], op[3], weights, op[4] if len(op) > 4 else 0)
    if cls is WarpOp:
        return WarpOp(op[0], op[2], op[3], bool(op[4]))
    return cls(op[0], *op[2:])


class Ledger:
    """The ledger of one generation (module docstring). :meth:`start` at the generation's first
    instant and :meth:`stop` at its last; the model records ops while it is its ``ledger``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:  # imported here, so that what only reads the component names imports no torch
            import torch

            self._event = torch.cuda.Event
        #: the component now charged (``host`` outside every phase)
        self.current = "host"
        #: ops of the step in progress (:meth:`take_ops` hands them to the step's trace)
        self.ops: list[Op] = []
        #: phase switches: (component from here on, perf_counter seconds or a CUDA event)
        self._marks: list[tuple[str, object]] = []
        self.seconds: dict[str, float] = {}

    # --- time ------------------------------------------------------------------------------
    def _now(self):
        if self.cuda:
            event = self._event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks = [(self.current, self._now())]

    def switch(self, component: str) -> str:
        """Charge the time from here on to ``component``; returns the one charged until now."""
        before = self.current
        if component != before:
            self.current = component
            self._marks.append((component, self._now()))
        return before

    def stop(self) -> dict[str, float]:
        """Close the last phase; :attr:`seconds` per component (they add up to the time from
        :meth:`start` to here). On a GPU this waits for the device once."""
        self._marks.append(("", self._now()))
        if self.cuda:
            self._marks[-1][1].synchronize()
        seconds = dict.fromkeys(COMPONENTS, 0.0)
        for (component, t0), (_, t1) in zip(self._marks, self._marks[1:]):
            seconds[component] += t0.elapsed_time(t1) / 1e3 if self.cuda else t1 - t0
        self.seconds = seconds
        return seconds

    def mark(self) -> tuple[int, int]:
        """A point to :meth:`relabel` from (the phase open here is split here)."""
        self._marks.append((self.current, self._now()))
        return len(self.ops), len(self._marks) - 1

    def relabel(self, since: tuple[int, int], old: str, component: str) -> None:
        """Charge the ops and the time of ``old`` since ``since`` (a :meth:`mark`) to ``component``
        after all (AdaDecode: a token's pass is a draft until it reaches the last layer, where it is
        the verification pass); other components' ops and time inside stay theirs."""
        ops, marks = since
        for i in range(ops, len(self.ops)):
            if self.ops[i].component == old:
                self.ops[i] = self.ops[i]._replace(component=component)
        for j in range(marks, len(self._marks)):
            if self._marks[j][0] == old:
                self._marks[j] = (component, self._marks[j][1])
        if self.current == old:
            self.current = component

    # --- ops -------------------------------------------------------------------------------
    def layers(self, rows: int, attention: int, mlp: int, context: int, eager: bool = False, padded: int = 0,
               span: int = 0, weights: str = "", merge: bool = True) -> None:
        """A layer walk of ``rows`` new rows: ``attention`` and ``mlp`` sublayers run, attending to
        ``context`` cached positions (consecutive walks of the same shape merge, unless ``merge`` is
        False: a walk that may run in a batch's pass, :meth:`shared`). ``eager``: the
        model captures its passes, and this one ran eagerly (a profile prices the two apart);
        ``padded`` and ``span``: a static pass's bucket and the cache slots it attends over;
        ``weights``: a quantised copy's format, "" for the target's weights."""
        last = self.ops[-1] if self.ops else None
        if (merge and type(last) is LayerOp and last.component == self.current and last.rows == rows
                and last.context == context and last.eager == eager and last.padded == padded and last.span == span
                and last.weights == weights and not last.shared):
            self.ops[-1] = last._replace(attention=last.attention + attention, mlp=last.mlp + mlp)
        else:
            self.ops.append(LayerOp(self.current, rows, attention, mlp, context, eager, padded, span, weights))

    def shared(self, index: int, rows: int) -> None:
        """The walk or head product recorded at ``index`` ran in a batch's pass of ``rows`` rows, its own
        among them (:class:`~selfspec.models.batch.Batch`): a profile prices it as its rows' share of that
        pass (:attr:`LayerOp.shared`)."""
        self.ops[index] = self.ops[index]._replace(shared=int(rows))

    def head(self, rows: int, vocab: int, weights: str | None = None) -> None:
        """An LM-head product: ``rows`` states against ``vocab`` rows of the head (``weights``: a
        quantised copy's format, None for the target's head)."""
        self.ops.append(HeadOp(self.current, rows, vocab, weights or ""))

    def linear(self, rows: int, d_in: int, d_out: int) -> None:
        """A small head transform (an exit head's ``d × d`` map before the LM head)."""
        self.ops.append(LinearOp(self.current, rows, d_in, d_out))

    def warp(self, rows: int, vocab: int, nucleus: bool) -> None:
        """Sampled token selection: ``rows`` logit rows of ``vocab`` entries warped (temperature,
        top-k, top-p when ``nucleus``); consecutive warps of the same kind merge."""
        last = self.ops[-1] if self.ops else None
        if (type(last) is WarpOp and last.component == self.current and last.vocab == vocab
                and last.nucleus == bool(nucleus)):
            self.ops[-1] = last._replace(rows=last.rows + rows)
        else:
            self.ops.append(WarpOp(self.current, rows, vocab, bool(nucleus)))

    def take_ops(self) -> list[Op]:
        ops, self.ops = self.ops, []
        return ops


def phase(ledger: "Ledger | None", component: str):
    """``with phase(state.ledger, "draft") as p: ...`` charges the time and the model's ops inside to
    ``component``; ``p.relabel(other)`` charges what ran inside so far to ``other`` after all
    (nothing is recorded without a ledger: a decoder used outside :meth:`Decoder.generate`)."""
    if ledger is None:
        return _NO_PHASE
    return _Phase(ledger, component)


class _Phase:
    __slots__ = ("ledger", "component", "before", "since")

    def __init__(self, ledger: Ledger, component: str) -> None:
        self.ledger, self.component = ledger, component

    def __enter__(self) -> "_Phase":
        ledger = self.ledger
        self.before = ledger.switch(self.component)
        switched = self.before != self.component
        self.since = (len(ledger.ops), len(ledger._marks) - 1) if switched else ledger.mark()
        return self

    def relabel(self, component: str) -> None:
        self.ledger.relabel(self.since, self.component, component)
        self.component = component

    def __exit__(self, *exc) -> None:
        self.ledger.switch(self.before)


class _NoPhase:
    def __enter__(self) -> "_NoPhase":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def relabel(self, component: str) -> None:
        pass


_NO_PHASE = _NoPhase()

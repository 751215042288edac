"""Capturable decoding steps: static shapes per k bucket, replayed as CUDA graphs on a GPU.

A decoding step (k = 1) and a verification pass (k drafted tokens + 1) run the same few hundred
small kernels every time; on a GPU, launching them from Python costs more than the kernels
themselves at small k. This module gives those passes **static shapes** so they can be captured
once and replayed:

* k is padded up to a **bucket** (:data:`BUCKETS`); the padding rows compute garbage that nothing
  reads (each real row attends only to itself and earlier positions, and the cache lengths only
  cover the real rows);
* keys and values are written with ``index_copy_`` at ``start + arange(bucket)`` (a device tensor,
  not a Python slice), and attention runs over the whole preallocated buffer with a causal mask
  computed on the device from the same tensor, so no shape depends on the cache length;
* the only inputs are the token ids (or hidden states) and ``start``, copied into static buffers.

Model config key ``capture`` (:data:`MODES`):

``auto``    ``graphs`` on CUDA, ``off`` elsewhere
``graphs``  static shapes, each (layers, skip set, bucket, input kind, cache) captured once as a
            CUDA graph and replayed (CUDA only)
``static``  the same static-shape pass run eagerly: what ``graphs`` captures, testable on a CPU
``off``     the dynamic eager pass (slices of the cache, a mask only where needed)

The passes that go through here are :class:`~selfspec.models.passes.Pass` records, keyed by
:meth:`~selfspec.models.passes.Pass.key` (layer range, skip set, where the rows sit, states kept),
the bucket and the input kind:

* **chains**: k new tokens after the cache, causal (a decoding step, a verification pass, a draft
  pass of Draft & Verify's skip set);
* **partial-layer passes**: any layer range, optionally keeping the last rows' states after some
  layers (early exit's and DEL's lower and remaining layers with their exit-query cache,
  AdaDecode's per-layer passes of owed positions);
* **trees** (PPD): the rows' position offsets and their ancestor mask are inputs too; the tree's
  mask is padded to the bucket (a padding row sees the prefix and itself), and the full mask is
  built on the device from ``start``, so tree size × k buckets share one shape;
* **scratch passes** (the layer-skip searches: CLaSp's and KnapSpec's branch passes, SWIFT's
  matchness; :meth:`~selfspec.models.passes.Rows.scratch`): a tree whose rows sit after the cache's
  first ``context`` positions and see only those, with their K/V written past the cache's positions
  and its lengths left as they were, one layer at a time
  (:meth:`~selfspec.models.layered.LayeredModel._scratch`: a search's new skip set replays the
  graphs of the layer parts it shares with the sets before). A pass whose attention sublayers are
  all skipped (KnapSpec's MLP sublayer states) touches no cache.

A pass qualifies (:meth:`StepRunner.run` says when) inside ``torch.inference_mode()``, with every
layer run at the same cache length, at most the largest bucket's rows and room in the cache for
the padding. The buckets reach 256 rows so that PPD's trees at the paper's sizes (tree lengths
60-120: a tree of 16 nodes with 3 prompt tokens is a pass of 63 rows), and the largest the
``ppd_tree`` job builds (48 candidates: passes of up to ~200 rows with two tokens per prompt
token), replay as graphs too; with 32 rows as the largest, such passes ran eagerly at 0.21-0.33x
vanilla on an H100/H200. Anything
else — a long prefill, a training pass — takes the dynamic path; the outputs are the same either
way (docs/design/runtime.md §4), only the speed differs. A decoding pass (one after the prompt: the cache
already holds positions) that takes the dynamic path, whatever its size, is counted in
:attr:`StepRunner.missed`, by kind. The LM head and the exit
heads (full or truncated) stay outside: each is one matrix product on ``[rows, d]``, a static shape
already.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

import torch

from selfspec.models.cache import LayerCache

MODES = ("auto", "graphs", "static", "off")
#: padded sizes of k; a pass of k new tokens runs at the smallest bucket >= k (PPD's paper trees:
#: up to 120 rows; the ppd_tree job's largest, 48 candidates: ~200)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: captured graphs kept (least recently used dropped first): AdaDecode's per-layer passes alone
#: take layers × buckets of them
MAX_GRAPHS = 384


class CaptureUnavailable(RuntimeError):
    """``capture=graphs`` was asked for where CUDA graphs cannot run."""


def resolve(mode: str, device: torch.device) -> str:
    """The capture mode a model config's ``capture`` names, on ``device``."""
    if mode not in MODES:
        raise ValueError(f"model.capture={mode!r} is not one of {', '.join(MODES)}")
    if mode == "auto":
        return "graphs" if device.type == "cuda" else "off"
    if mode == "graphs" and device.type != "cuda":
        raise CaptureUnavailable(
            f"model.capture=graphs needs a CUDA device, but the model is on {device}; use "
            "model.capture=static to run the same static-shape pass eagerly, or auto")
    return mode


def bucket(n: int) -> int | None:
    """The smallest bucket holding ``n`` rows, or None beyond the largest."""
    for b in BUCKETS:
        if n <= b:
            return b
    return None


class _Writes:
    """The K/V writes of a static pass (:class:`selfspec.models.layered.KV`): at ``index`` (a device
    tensor) in the cache's buffers; attention sees the whole buffer, and the mask hides what is
    not yet valid. A chain writes each row at the slot of its position, so every slot's position
    is its index (``slots``); a tree's rows sit at their depth's position, so a windowed layer of a
    tree pass reads the cache's recorded positions. A windowed layer's positions go to the cache
    either way."""

    def __init__(self, cache: LayerCache, index: torch.Tensor, slots: torch.Tensor, tree: bool = False) -> None:
        self.cache, self.index, self.slots, self.tree = cache, index, slots, tree

    def write(self, layer_idx: int, key_states, value_states, positions=None):
        keys, values = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        keys.index_copy_(2, self.index, key_states)
        values.index_copy_(2, self.index, value_states)
        if positions is not None:
            self.cache.position_buffer(key_states.device)[layer_idx].index_copy_(0, self.index, positions)
        return keys, values

    def key_positions(self, layer_idx: int) -> torch.Tensor:
        return self.cache.positions[layer_idx] if self.tree else self.slots


class _Pass:
    """One static pass: its input buffers and, under ``graphs``, its graph and output buffer.

    ``tree``: the rows' position offsets and ancestor mask are inputs (PPD) rather than the chain's
    ``arange``/causal ones. ``keep``: the layers after which the rows' states are copied into
    static buffers (``kept``), handed to the caller's views after the pass."""

    def __init__(self, model: Any, max_length: int, layers: range, skip, size: int, from_ids: bool,
                 tree: bool = False, keep: tuple[int, ...] = (), weights: str | None = None) -> None:
        dev = model.device
        self.model, self.layers, self.skip, self.size, self.keep = model, layers, skip, size, keep
        self.weights = weights  # the pass's weights (Pass.weights: None, the target's, or a quantised copy's)
        self.ids = torch.zeros(1, size, dtype=torch.long, device=dev) if from_ids else None
        self.h = None if from_ids else torch.zeros(1, size, model.hidden_size, dtype=model.dtype, device=dev)
        self.start = torch.zeros(1, dtype=torch.long, device=dev)
        #: where the rows' positions start and the prefix they see ends: ``start``, except for a
        #: scratch pass (the searches' branches), whose rows are written past the cache's positions
        #: but sit after its first ``base``
        self.base = torch.zeros(1, dtype=torch.long, device=dev)
        self.rows = torch.arange(size, device=dev)
        self.offsets = self.rows.clone()  # a chain's stay; a tree's are loaded per pass
        self.max_length = max_length
        self.slots = torch.arange(max_length, device=dev)
        #: a tree's ancestor mask ``[size, size]`` (padding rows: themselves only); None for a chain
        self.tree = torch.eye(size, dtype=torch.bool, device=dev) if tree else None
        self.kept = torch.zeros(len(keep), size, model.hidden_size, dtype=model.dtype, device=dev) if keep else None
        self.cache: "LayerCache | None" = None  # the cache a graph was captured on
        self.uses = 0  # times run (a graph captured for one use cost more than running it eagerly)
        self.out: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def load(self, ids, h, start: int, n: int, tree=None, base: int | None = None) -> None:
        """Copy the real inputs into the static buffers (rows past ``n`` keep stale, valid values)."""
        if self.ids is not None:
            self.ids[:, :n].copy_(ids)
        else:
            self.h[:, :n].copy_(h)
        self.start.fill_(start)
        self.base.fill_(start if base is None else base)
        if tree is not None:
            offsets, allowed = tree
            self.offsets[:n].copy_(offsets)
            self.offsets[n:] = self.rows[n:]
            self.tree.fill_(False)
            self.tree[:n, :n].copy_(allowed)
            self.tree[n:, n:].fill_diagonal_(True)

    def mask(self, positions: torch.Tensor) -> torch.Tensor:
        """The boolean ``[size, max_length]`` mask over the whole buffer, built on the device: a
        chain's rows see every slot up to their own; a tree's rows see the prefix and their
        ancestors (their slots are ``start + row``)."""
        if self.tree is None:
            return self.slots.unsqueeze(0) <= positions.unsqueeze(1)
        rel = self.slots - self.start  # a slot's row in the tree, or outside it
        inside = (rel >= 0) & (rel < self.size)
        ancestors = self.tree.index_select(1, rel.clamp(0, self.size - 1))  # [size, max_length]
        return (self.slots < self.base).unsqueeze(0) | (inside.unsqueeze(0) & ancestors)

    def body(self, cache: LayerCache) -> torch.Tensor:
        m = self.model
        positions = self.base + self.offsets  # [size]
        mask = m.prepare_mask(self.mask(positions))
        writes = _Writes(cache, self.start + self.rows, self.slots, tree=self.tree is not None)
        # no ledger here: the caller (LayeredModel.forward) records the pass once, captured or not
        h = m.embed(self.ids) if self.ids is not None else self.h
        keep = {layer: self.kept[j] for j, layer in enumerate(self.keep)} if self.keep else None
        return m.run_layers(h, self.layers, writes, m.rope(positions.unsqueeze(0), h), mask, self.skip, keep,
                            weights=self.weights)

    def capture(self, cache: LayerCache, pool) -> None:
        """Record :meth:`body` on ``cache`` as a CUDA graph, after two warm-up runs on a side stream
        (they run on the loaded inputs, so what they write into the cache is what the pass writes)."""
        device = self.model.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.body(cache)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = self.body(cache)
        self.cache = cache

    def __call__(self, cache: LayerCache, n: int, keep: dict | None = None) -> torch.Tensor:
        self.uses += 1
        if self.graph is None:
            out = self.body(cache)[:, :n]
        else:
            self.graph.replay()
            out = self.out[:, :n].clone()  # the next replay overwrites the output buffer
        for j, layer in enumerate(self.keep):
            dest = keep[layer]
            dest.copy_(self.kept[j, n - dest.shape[0]: n])
        return out


def _kind(model: Any, layers, rows_kind: str, kept) -> str:
    """A pass's kind: chain, tree or scratch (rows written past the cache's positions: the searches'
    passes), ``+keep`` (states kept), ``/partial`` (a layer range short of the model)."""
    partial = not isinstance(layers, range) or len(layers) != model.num_layers
    return rows_kind + ("+keep" if kept else "") + ("/partial" if partial else "")


class StepRunner:
    """Routes a model's eligible passes through static-shape (and, under ``graphs``, captured) passes.

    Under ``static`` a pass is keyed by its shape and reused for any cache of the same size; under
    ``graphs`` a captured pass also belongs to one cache (its buffers' addresses are in the graph),
    so decoders draw their cache from :meth:`~selfspec.models.layered.LayeredModel.new_cache` with
    ``reuse=True`` and capture once per model rather than once per example.
    """

    #: cache positions past a pass that its padding rows may write
    padding = BUCKETS[-1]

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._passes: OrderedDict[tuple, _Pass] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if mode == "graphs" else None
        #: passes that went through here / graphs captured (run records and tests read them)
        self.routed = 0
        self.captured = 0
        #: static passes built (under ``graphs``: captured), and those the LRU dropped
        #: (:data:`MAX_GRAPHS`); a key that keeps coming back after being dropped is built again
        self.built = 0
        self.evicted = 0
        self._dropped_once = 0  # dropped passes that had run once
        #: decoding passes (after the prompt) that took the dynamic path, whatever their size (wider
        #: than the largest bucket, no room in the cache for the padding, layers at different cache
        #: lengths): none in any decoder at the papers' sizes (tests/test_capture.py)
        self.missed = 0
        #: routed passes by kind: chain or tree, ``+keep``, ``/partial`` (a layer range short of the model)
        self.kinds: Counter[str] = Counter()
        #: routed and missed passes by the same kinds, with their widths: ``"tree 117"``, ``"tree 257"``
        self.routed_rows: Counter[str] = Counter()
        self.missed_kinds: Counter[str] = Counter()
        #: the last pass's bucket rows and the cache slots its attention spanned (the whole buffer):
        #: what it cost, which the ledger records beside the rows asked for
        self.last: tuple[int, int] | None = None
        #: passes dropped because their cache was replaced (the pooled cache grew:
        #: :meth:`~selfspec.models.layered.LayeredModel.reserve`); each one asked for again is built again
        self.forgotten = 0

    def run(self, model: Any, p, x: torch.Tensor, cache: LayerCache, start: int, keep: dict | None = None):
        """The hidden states ``[1, n, d]`` of ``model``'s pass ``p`` (a
        :class:`~selfspec.models.passes.Pass` of a :class:`~selfspec.models.layered.LayeredModel`) over
        ``x`` (token ids or hidden states), or None when it must take the dynamic path.

        A chain's or a tree's rows sit after ``start`` (the tree's offsets and ancestor mask are
        inputs of the pass, PPD's tree); ``keep``: ``{layer: out}`` as
        :meth:`~selfspec.models.layered.LayeredModel.run_layers` takes it. A scratch pass (the
        layer-skip searches', module docstring): the rows sit after the cache's first ``context``
        positions and see only those and the rows ``allowed`` marks; their K/V are written at
        ``start`` on (the cache's length: scratch past its positions), and the cache's lengths stay as
        they were. The pass runs at the smallest bucket of at least its rows and ``p.at_least``: passes
        of varying widths that a caller repeats (KnapSpec's sublayer states, 2L one-layer passes of a
        verification of 1 to ``max_draft + 1`` rows) then take one graph each instead of one per bucket
        (a GPU's pass of few rows costs about the same in a larger bucket: it reads the weights either
        way)."""
        rows = p.rows
        scratch, tree = rows.kind == "scratch", (rows.offsets, rows.allowed) if rows.kind != "chain" else None
        layers, skip = p.layer_range(model.num_layers), p.skip
        if cache is None or not torch.is_inference_mode_enabled() or not len(layers) or rows.kind == "packed":
            return None
        from_ids = not x.is_floating_point()
        n = x.shape[1]
        size = bucket(max(n, p.at_least))
        kept = tuple(sorted(keep)) if keep else ()
        # a pass whose attention sublayers are all skipped (an MLP walk: KnapSpec's sublayer states, the
        # searches' MLP branches) neither reads nor writes the cache, whatever its lengths
        attends = (skip is None or any(i not in skip.attn for i in layers)) and not scratch
        if (size is None or not isinstance(layers, range) or layers.step != 1 or start + size > cache.max_length
                or (attends and any(cache.lengths[i] != start for i in layers)) or any(i not in layers for i in kept)
                or (scratch and any(cache.lengths[i] > start for i in layers))):
            if start > 0:  # a decoding pass; a prefill (start 0: an empty cache) longer than a bucket is expected
                self.missed += 1
                self.missed_kinds[f"{_kind(model, layers, rows.kind, kept)} {n}"] += 1
            return None
        owner = id(cache) if self.mode == "graphs" else cache.max_length
        key = (id(model), owner, *p.key(model.num_layers, kept), size, from_ids)
        static = self._passes.get(key)
        base = rows.context if scratch else None
        ids, h = (x, None) if from_ids else (None, x)
        if static is None or (static.cache is not None and static.cache is not cache):
            static = _Pass(model, cache.max_length, layers, skip, size, from_ids=from_ids, tree=tree is not None,
                           keep=kept, weights=p.weights)
            static.load(ids, h, start, n, tree, base)
            if self.mode == "graphs":
                static.capture(cache, self._pool)
                self.captured += 1
            self._passes[key] = static
            self.built += 1
            while len(self._passes) > MAX_GRAPHS:
                self._drop(self._passes.popitem(last=False)[1])
        else:
            static.load(ids, h, start, n, tree, base)
        self._passes.move_to_end(key)
        out = static(cache, n, keep)
        self.last = (size, cache.max_length)
        for i in layers if attends else ():
            cache.lengths[i] = start + n
        self.routed += 1
        kind = _kind(model, layers, rows.kind, kept)
        self.kinds[kind] += 1
        self.routed_rows[f"{kind} {n}"] += 1
        return out

    @property
    def used_once(self) -> int:
        """Static passes built that ran once (dropped since, or not run again yet): under ``graphs``
        each cost a capture (two warm-up runs and the recording) for a single replay."""
        return self._dropped_once + sum(p.uses == 1 for p in self._passes.values())

    def counts(self) -> dict[str, Any]:
        """What went through here (run records and ``make gpu-check`` read it)."""
        return {"routed": self.routed, "captured": self.captured, "built": self.built, "evicted": self.evicted,
                "forgotten": self.forgotten, "used_once": self.used_once, "kinds": dict(self.kinds), "missed": self.missed,
                "missed_kinds": dict(self.missed_kinds)}

    def _drop(self, p: _Pass, evicted: bool = True) -> None:
        self.evicted += evicted
        self.forgotten += not evicted
        self._dropped_once += p.uses == 1

    def clear(self) -> None:
        """Drop every pass (counted in :attr:`forgotten`) and, under ``graphs``, release their memory
        pool: a measurement of memory that follows (``make gpu-check``'s training section) then holds
        no graph."""
        for p in self._passes.values():
            self._drop(p, evicted=False)
        self._passes.clear()
        if self.mode == "graphs":
            self._pool = torch.cuda.graph_pool_handle()

    def forget(self, cache: LayerCache) -> None:
        """Drop the passes built on ``cache`` (it is about to be replaced): under ``graphs`` the
        graphs captured on it, under ``static`` the passes keyed by its size (counted in
        :attr:`forgotten`)."""
        owned = (lambda p: p.cache is cache) if self.mode == "graphs" else (lambda p: p.max_length == cache.max_length)
        for key in [k for k, p in self._passes.items() if owned(p)]:
            self._drop(self._passes.pop(key), evicted=False)
        if self.mode == "graphs" and not self._passes:
            # a memory pool whose graphs are all gone is released: capture into a new one
            self._pool = torch.cuda.graph_pool_handle()

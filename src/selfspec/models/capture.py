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

Only whole-sequence passes go through here (:meth:`StepRunner.run` says when): inside
``torch.inference_mode()``, no explicit mask or positions (tree passes keep their own), every
layer run at the same cache length, k at most the largest bucket and room in the cache for the
padding. Anything else — a long prefill, a tree — takes the dynamic path; the outputs are the
same either way (docs/design.md §4), only the speed differs.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from selfspec.models.cache import LayerCache

MODES = ("auto", "graphs", "static", "off")
#: padded sizes of k; a pass of k new tokens runs at the smallest bucket >= k
BUCKETS = (1, 2, 4, 8, 16, 32)
#: captured graphs kept (least recently used dropped first)
MAX_GRAPHS = 96


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
    not yet valid. A static pass writes each row at the slot of its position, so every slot's
    position is its index (``slots``); a windowed layer's positions go to the cache too."""

    def __init__(self, cache: LayerCache, index: torch.Tensor, slots: torch.Tensor) -> None:
        self.cache, self.index, self.slots = cache, index, slots

    def write(self, layer_idx: int, key_states, value_states, positions=None):
        keys, values = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        keys.index_copy_(2, self.index, key_states)
        values.index_copy_(2, self.index, value_states)
        if positions is not None:
            self.cache.position_buffer(key_states.device)[layer_idx].index_copy_(0, self.index, positions)
        return keys, values

    def key_positions(self, layer_idx: int) -> torch.Tensor:
        return self.slots


class _Pass:
    """One static pass: its input buffers and, under ``graphs``, its graph and output buffer."""

    def __init__(self, model: Any, max_length: int, layers: range, skip, size: int, from_ids: bool) -> None:
        dev = model.device
        self.model, self.layers, self.skip, self.size = model, layers, skip, size
        self.ids = torch.zeros(1, size, dtype=torch.long, device=dev) if from_ids else None
        self.h = None if from_ids else torch.zeros(1, size, model.hidden_size, dtype=model.dtype, device=dev)
        self.start = torch.zeros(1, dtype=torch.long, device=dev)
        self.offsets = torch.arange(size, device=dev)
        self.slots = torch.arange(max_length, device=dev)
        self.cache: "LayerCache | None" = None  # the cache a graph was captured on
        self.out: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None

    def load(self, ids, h, start: int, n: int) -> None:
        """Copy the real inputs into the static buffers (rows past ``n`` keep stale, valid values)."""
        if self.ids is not None:
            self.ids[:, :n].copy_(ids)
        else:
            self.h[:, :n].copy_(h)
        self.start.fill_(start)

    def body(self, cache: LayerCache) -> torch.Tensor:
        m = self.model
        positions = self.start + self.offsets  # [size]
        mask = m.prepare_mask(self.slots.unsqueeze(0) <= positions.unsqueeze(1))
        h = m.embed(self.ids) if self.ids is not None else self.h
        return m.run_layers(h, self.layers, _Writes(cache, positions, self.slots), m.rope(positions.unsqueeze(0), h), mask,
                            self.skip)

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

    def __call__(self, cache: LayerCache, n: int) -> torch.Tensor:
        if self.graph is None:
            return self.body(cache)[:, :n]
        self.graph.replay()
        return self.out[:, :n].clone()  # the next replay overwrites the output buffer


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

    def run(self, model: Any, ids, h, cache: LayerCache, start: int, layers: range, skip):
        """The hidden states ``[1, n, d]`` of ``model``'s pass (a
        :class:`~selfspec.models.layered.LayeredModel`), or None when it must take the dynamic path."""
        if cache is None or not torch.is_inference_mode_enabled() or not len(layers):
            return None
        n = (ids if h is None else h).shape[1]
        size = bucket(n)
        if size is None or start + size > cache.max_length:
            return None
        if any(cache.lengths[i] != start for i in layers):
            return None
        owner = id(cache) if self.mode == "graphs" else cache.max_length
        key = (id(model), owner, layers.start, layers.stop, skip, size, h is None)
        p = self._passes.get(key)
        if p is None or (p.cache is not None and p.cache is not cache):
            p = _Pass(model, cache.max_length, layers, skip, size, from_ids=h is None)
            p.load(ids, h, start, n)
            if self.mode == "graphs":
                p.capture(cache, self._pool)
                self.captured += 1
            self._passes[key] = p
            while len(self._passes) > MAX_GRAPHS:
                self._passes.popitem(last=False)
        else:
            p.load(ids, h, start, n)
        self._passes.move_to_end(key)
        out = p(cache, n)
        for i in layers:
            cache.lengths[i] = start + n
        self.routed += 1
        return out

    def forget(self, cache: LayerCache) -> None:
        """Drop the graphs captured on ``cache`` (it is about to be replaced)."""
        for key in [k for k, p in self._passes.items() if p.cache is cache]:
            del self._passes[key]
        if self.mode == "graphs" and not self._passes:
            # a memory pool whose graphs are all gone is released: capture into a new one
            self._pool = torch.cuda.graph_pool_handle()

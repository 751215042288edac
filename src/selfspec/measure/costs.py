"""The cost model of the machine: what a forward of k new tokens costs here, measured once.

Every speedup a speculative method can reach is its tokens per verification pass divided by
what drafting plus that pass cost, so the methods' hardware-aware parts need the same curve:
PPD's tree builder (the forward latency ``L_fp(n)`` of PPD §4), Draft & Verify's skip-search
cost model (per-sublayer and verification costs, §3.3), the runtime benchmark
(``scripts/bench_runtime.py``) and the machine profiles (:mod:`selfspec.measure.profile`). They
all time through :func:`time_forward`, the one timing loop for forwards outside decoding, and
:func:`time_call` for an op outside a pass (decoding itself is timed by the decoder loop).

Figures are ratios taken in one process (``v(k) = t(k) / t(1)`` at the same context), so they
stay meaningful on a shared machine; absolute times are medians of repeats after one untimed
warm-up run.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from selfspec.models.kernels import argmax
from selfspec.models.layered import LayeredModel, Pass
from selfspec.models.passes import PASS

__all__ = ["CostCurve", "OthersBusy", "context_cache", "evict_caches", "last_level_cache_bytes", "measure_bandwidth", "measure_curve",
           "synchronizer", "time_call", "time_forward", "weight_bytes"]


@functools.lru_cache(maxsize=1)
def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (Linux sysfs: the highest-level cache of CPU 0), or 64 MiB where
    it cannot be read."""
    best = (0, 64 << 20)
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        digits = size[:-1] if size[-1:].isalpha() else size
        if digits.isdigit() and level > best[0]:
            best = (level, int(digits) * scale)
    return best[1]


@functools.lru_cache(maxsize=1)
def _eviction_buffer() -> torch.Tensor:
    """The buffer :func:`evict_caches` sweeps: twice the last-level cache, allocated once."""
    return torch.zeros(2 * last_level_cache_bytes() // 4)


def evict_caches(device: torch.device) -> None:
    """Push this CPU's caches out (read and write a buffer of twice the last-level cache), so that
    the next timed run starts as a decoding step does: the weights it reads not left in the cache
    by the run before (a repeated LM-head product of SmolLM2 in bfloat16, 57 MB, ran at 0.9 ms with
    half of it cached, and at 1.5 ms between a step's layers). A no-op on other devices."""
    if device.type != "cpu":
        return
    _eviction_buffer().add_(1.0)


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def context_cache(model: LayeredModel, context: int, extra: int, seed: int = 0):
    """A layer cache holding ``context`` random tokens (room for ``extra`` more), for timing."""
    cache = model.new_cache(context + extra + 1)
    if context:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.vocab_size, (1, context), generator=g).to(model.device)
        with torch.inference_mode():
            model.forward(ids, cache, start=0)
    return cache


def time_forward(model: LayeredModel, cache, context: int, n: int | None = None, *, p: Pass = PASS, repeats: int = 5,
                 reduce: str = "median", h: torch.Tensor | None = None, logits_rows: int | None = None,
                 head: Callable[[torch.Tensor], torch.Tensor] | None = None, cold: bool = False) -> float:
    """Seconds of one forward of ``n`` new tokens after ``context`` cached positions.

    The pass is ``p`` (:class:`~selfspec.models.passes.Pass`: its layers, skipped sublayers, where its
    rows sit and the weights it reads; default every layer, a chain over the target's weights), then
    the final norm + LM head on ``logits_rows`` rows (default all ``n``: a verification pass scores
    every token; 0 = no head; ``head``: another head on the final states, e.g. a truncated draft
    vocabulary's :meth:`~selfspec.models.heads.DraftVocab.model_logits`), then one host sync on the
    result, as a decoding step has. ``h``: the rows' hidden states (a tree pass's, PPD's) instead of
    token ids. The cache is rolled back to ``context`` before every run. ``reduce``: ``median``
    (default) or ``min`` of ``repeats`` timed runs. ``cold``: the CPU's caches are pushed out before
    every run (:func:`evict_caches`, untimed), as a cost profile measures: a pass repeated back to back
    finds part of its weights still cached.
    """
    if h is None and n is None:
        raise ValueError("time_forward needs n (new tokens) or h (their hidden states)")
    n = int(h.shape[1]) if h is not None else int(n)
    rows = n if logits_rows is None else int(logits_rows)
    ids = None if h is not None else torch.zeros(1, n, dtype=torch.long, device=model.device)
    sync = synchronizer(model.device)
    times = []
    with torch.inference_mode():
        for _ in range(max(1, repeats) + 1):
            cache.truncate(context)
            if cold:
                evict_caches(model.device)
            sync()
            t0 = time.perf_counter()
            out = model.forward(ids if h is None else h, cache, p, start=context)
            if rows:
                argmax((head or model.logits)(out[:, :rows])).tolist()
            else:
                out.sum().item()
            sync()
            times.append(time.perf_counter() - t0)
        cache.truncate(context)
    timed = times[1:]
    if reduce == "min":  # contention on a shared machine only ever adds time
        return min(timed)
    if reduce != "median":
        raise ValueError(f"reduce must be median or min, got {reduce!r}")
    return statistics.median(timed)


class OthersBusy:
    """How much of this machine's CPUs other processes (and, in a VM, the hypervisor's steal) took
    between its making and :meth:`share`: the machine's busy time (Linux ``/proc/stat``, all its CPUs)
    less this process's own CPU time, over the wall time times the CPUs. Timings measured while it is high are
    spoiled (two niced background processes make a 2-thread step 3-4x slower); a load average
    cannot tell, as it counts this process and the jobs that ran just before it. None where
    ``/proc/stat`` cannot be read."""

    def __init__(self) -> None:
        self._start = self._now()

    @staticmethod
    def _now() -> tuple[float, float, float] | None:
        import os

        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
        busy = sum(fields[:8]) - fields[3] - fields[4]
        own = os.times()
        return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), own.user + own.system

    def share(self) -> float | None:
        """Others' share of all CPUs since this object was made (0 = none, 1 = all of them)."""
        import os

        end = self._now()
        if self._start is None or end is None:
            return None
        wall = end[0] - self._start[0]
        if wall <= 0:
            return None
        others = (end[1] - self._start[1]) - (end[2] - self._start[2])
        return max(0.0, others) / (wall * (os.cpu_count() or 1))


def time_call(fn: Callable[[], object], device: torch.device, repeats: int = 5, cold: bool = False) -> float:
    """Median seconds of ``fn()`` (device synchronised around each call) over ``repeats`` timed
    calls after one untimed warm-up, under inference mode: an op outside a whole pass (a head
    product, an exit head's transform). ``cold``: as :func:`time_forward`'s."""
    sync = synchronizer(device)
    times = []
    with torch.inference_mode():
        for _ in range(max(1, repeats) + 1):
            if cold:
                evict_caches(device)
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def weight_bytes(model: LayeredModel) -> int:
    """Bytes of weights one decoding step reads: every parameter once (a tied head counted once)."""
    seen: set[int] = set()
    total = 0
    for p in model.hf.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    # the embedding reads one row per token, not the table, unless it is the (tied) LM head
    if not model.tied_embeddings:
        total -= model.embedding_bytes
    return total


def measure_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of reading a buffer of ``nbytes`` once (a float32 sum over it), repeated: how fast
    this machine reads a working set of that size, with whatever share of it its caches keep
    between two reads. A decoding step reads its weights and KV cache (``nbytes`` of them) once
    per token, so no decoder exceeds this roof; a large copy's bandwidth was no roof where the
    last-level cache holds much of the weights (an Intel Xeon with a 300 MB L3: llama.cpp at
    99-108% of a 256 MiB copy's bandwidth on 562 MB of weights)."""
    src = torch.ones(max(1, nbytes // 4), device=device)
    sync = synchronizer(device)
    times = []
    for _ in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        src.sum()
        sync()
        times.append(time.perf_counter() - t0)
    return src.numel() * 4 / statistics.median(times[1:])


@dataclass
class CostCurve:
    """Measured forward costs of one model on this machine.

    ``seconds[context][k]``: median seconds of a forward of ``k`` new tokens (all layers, head
    on every token) after ``context`` cached tokens; ``layer`` / ``head``: one decoder layer and
    the final norm + LM head for one token at the first context.
    """

    model: str
    device: str
    dtype: str
    linear_kernel: str
    seconds: dict[int, dict[int, float]]
    layer: float
    head: float
    meta: dict = field(default_factory=dict)

    def v(self, k: int, context: int | None = None) -> float:
        """``t(k) / t(1)`` at ``context`` (default: the first measured): a k-token verification
        pass in units of one decoding step (linear between measured k)."""
        row = self.seconds[context if context is not None else next(iter(self.seconds))]
        return self.time(k, row) / row[1]

    @staticmethod
    def time(k: int, row: dict[int, float]) -> float:
        ks = sorted(row)
        if k in row:
            return row[k]
        if k > ks[-1]:
            a, b = ks[-2], ks[-1]
        else:
            b = next(x for x in ks if x > k)
            a = max(x for x in ks if x < b)
        return row[a] + (row[b] - row[a]) * (k - a) / (b - a)

    @property
    def head_in_layers(self) -> float | None:
        """The LM head's cost in decoder layers (DEL's TPL unit); None where a layer's cost is not
        resolved (the head timed alone took at least a whole step: a small model's head on a noisy
        machine), not infinity, which JSON cannot hold."""
        return self.head / self.layer if self.layer > 0 else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["seconds"] = {str(c): {str(k): t for k, t in row.items()} for c, row in self.seconds.items()}
        return d


def measure_curve(model: LayeredModel, ks=(1, 2, 4, 8, 16, 32), contexts=(512,), repeats: int = 7) -> CostCurve:
    """Measure a :class:`CostCurve` (interleaving k within each repeat round, so drifts of a
    shared machine hit every k alike)."""
    seconds: dict[int, dict[int, float]] = {}
    layer = head = 0.0
    for context in contexts:
        cache = context_cache(model, context, max(ks))
        samples: dict[int, list[float]] = {k: [] for k in ks}
        for _ in range(repeats):
            for k in ks:
                samples[k].append(time_forward(model, cache, context, k, repeats=1))
        seconds[context] = {k: statistics.median(v) for k, v in samples.items()}
        if not layer:
            # the head timed on its own (embedding + final norm + LM head, no layer): a difference
            # of two medians would drown a small head in a shared machine's noise
            head = time_forward(model, cache, context, 1, p=Pass(range(0)), repeats=repeats, logits_rows=1)
            layer = max(seconds[context][1] - head, 0.0) / model.num_layers
    return CostCurve(model.name, str(model.device), str(model.dtype).replace("torch.", ""), model.linear_kernel,
                     seconds, layer, head)

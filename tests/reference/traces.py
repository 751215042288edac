"""Comparing selfspec's step trace (``Generation.trace``) with a reference loop's rounds.

Integers (where the drafts came from, drafted, accepted, committed, exit layer, draft limit, a
controller's chosen layer and length) must be equal. Floats a controller carries are compared
with a tolerance, for two reasons: selfspec's runtime computes with its own CPU kernels (skinny
linears, row-wise attention, fused norm) and the reference with transformers' stock modules, so
confidences (top probabilities, float32) agree to ~1e-7 relative, not bit for bit; and decayed
statistics summed per round (selfspec) or per observation (the reference) in float64 agree to
~1e-16. A difference that changes a decision (a threshold crossed, a different argmax) shows up
in the integers. K/V caches after the last step are compared within ``KV_TOL`` for the first
reason (float32 sums in another order: SmolLM2's keys differ by up to ~2e-5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

#: relative / absolute tolerance for float32 confidences and what is derived from them
CONF_REL, CONF_ABS = 1e-4, 1e-7
#: absolute tolerance for agreement rates (ratios of float64 decayed counts of the same matches)
ALPHA_ABS = 1e-12
#: absolute and relative tolerance for the K/V a cache holds after the last step
KV_TOL = 1e-4



@dataclass
class Round:
    """What one round (or the prefill) of a reference loop did: the fields selfspec's step trace
    (``StepTrace``) carries and :func:`first_difference` compares."""

    source: str
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    exit_layer: int | None = None
    draft_limit: int | None = None
    controller: dict[str, Any] | None = None


def rows(trace) -> list[tuple]:
    """``(source, drafted, accepted, committed, exit_layer, draft_limit)`` per step or round."""
    return [(t.source, t.drafted, t.accepted, t.committed, t.exit_layer, t.draft_limit) for t in trace]


def _count(t, key: str) -> int:
    return t.get(key, 0) if isinstance(t, dict) else getattr(t, key)


def totals(trace) -> tuple[int, int, int]:
    """``(steps, drafted, accepted)`` of a trace: step objects, or a reference's dict rows (a missing
    count is 0)."""
    return len(trace), sum(_count(t, "drafted") for t in trace), sum(_count(t, "accepted") for t in trace)


def check_kv(cache, reference_cache, same_length: bool = True) -> None:
    """Every layer of selfspec's ``LayerCache`` holds the K/V of the reference's ``DynamicCache``
    (within ``KV_TOL``); ``same_length=False`` lets selfspec's hold more rows after them (rows a
    step wrote past what it committed, overwritten by the next one)."""
    for i, layer in enumerate(reference_cache.layers):
        n = layer.keys.shape[-2]
        assert cache.length(i) == n if same_length else cache.length(i) >= n, (i, cache.length(i), n)
        k, v = cache.layer_kv(i)
        torch.testing.assert_close(k[:, :, :n], layer.keys, atol=KV_TOL, rtol=KV_TOL)
        torch.testing.assert_close(v[:, :, :n], layer.values, atol=KV_TOL, rtol=KV_TOL)


def _close(a, b, key: str) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, (int, str)) and isinstance(b, (int, str)):  # bools are ints
        return a == b
    if key == "alpha":
        return abs(a - b) <= ALPHA_ABS
    return math.isclose(a, b, rel_tol=CONF_REL, abs_tol=CONF_ABS)


def controller_differences(a: dict | None, b: dict | None) -> list[str]:
    """Keys whose values differ beyond the tolerances (module docstring)."""
    if a is None or b is None:
        return [] if a is b else ["controller"]
    out = sorted(set(a) ^ set(b))
    for key in sorted(set(a) & set(b)):
        x, y = a[key], b[key]
        if isinstance(x, dict):  # a part's own state (a search's choice): compared key by key
            same = isinstance(y, dict) and not controller_differences(x, y)
        elif isinstance(x, list):
            same = len(x) == len(y) and all(_close(u, v, key) for u, v in zip(x, y))
        else:
            same = _close(x, y, key)
        if not same:
            out.append(key)
    return out


def first_difference(trace, rounds) -> str | None:
    """Where selfspec's trace and the reference's rounds first differ (None: step for step equal)."""
    if len(trace) != len(rounds):
        return f"{len(trace)} steps against the reference's {len(rounds)}"
    for j, (t, r) in enumerate(zip(trace, rounds)):
        if rows([t]) != rows([r]):
            return f"step {j}: {rows([t])[0]} against the reference's {rows([r])[0]}"
        keys = controller_differences(t.controller, r.controller)
        if keys:
            return f"step {j}: controller {keys}: {t.controller} against the reference's {r.controller}"
    return None

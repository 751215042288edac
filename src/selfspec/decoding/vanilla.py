"""Vanilla autoregressive decoding: the reference every method is measured against.

One full forward pass per token on the same layered runtime and layer cache the methods use,
so speedups compare methods, not runtimes (docs/design.md §3: Spec-Bench's baseline-cache confound).
"""

from __future__ import annotations

from selfspec.decoding.base import DecodeState, Decoder


class Vanilla(Decoder):
    name = "vanilla"
    title = "Vanilla"
    lossless = True

    def step(self, state: DecodeState, budget: int) -> list[int]:
        return self.plain_step(state)

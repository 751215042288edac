"""Vanilla autoregressive decoding: the reference every method is measured against.

One full forward pass per token on the same layered runtime and layer cache the methods use,
so speedups compare methods, not runtimes (docs/design.md §3: Spec-Bench's baseline-cache confound).
"""

from __future__ import annotations

from selfspec.decoding.base import DecodeState, Decoder, register
from selfspec.decoding.sampling import select


@register
class Vanilla(Decoder):
    name = "vanilla"
    lossless = True

    def step(self, state: DecodeState, budget: int) -> list[int]:
        h = self.model.forward(state.pending_ids(self.model.device), state.cache)
        return [int(select(self.model.logits(h[:, -1]), state.sampling, state.generator)[0])]

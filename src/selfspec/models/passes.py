"""A pass of the layered runtime, as a value: the record a method builds and the runtime runs.

A decoder asks its model for passes of a few shapes: a decoding step or a verification (new rows
after the cache, causal), a draft through some layers with sublayers skipped (Draft & Verify §3.1),
the lower or upper layers keeping some rows' states (early exit, DEL), a candidate tree (PPD §3.2,
SWIFT §3.3), rows that sit after a prefix of the cache and leave the cache as it was (the layer-skip
searches' candidate passes: CLaSp §3.3, KnapSpec, SWIFT's matchness), and rows at explicit
positions under an explicit mask (the skip search's and prompt training's packed sequences).
:class:`Pass` says which: its layers, the sublayers it skips, where its rows sit (:class:`Rows`) and
the smallest static shape it runs in, and which weights its linears read (the target's, or a quantised
copy of them: a draft's, :mod:`selfspec.models.quantised`). :meth:`selfspec.models.layered.LayeredModel.forward` runs it;
the static-pass runner keys and captures it by :meth:`Pass.key` (:mod:`selfspec.models.capture`).
A method with a new shape of pass builds the record in its own module; the runtime gains no entry
point for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["PASS", "Pass", "Rows", "SkipSet"]


@dataclass(frozen=True)
class SkipSet:
    """Sublayers to skip while drafting (Draft & Verify §3.1): attention and MLP layer indices."""

    attn: frozenset[int] = frozenset()
    mlp: frozenset[int] = frozenset()

    @classmethod
    def of(cls, attn=(), mlp=()) -> "SkipSet":
        return cls(frozenset(int(i) for i in attn), frozenset(int(i) for i in mlp))

    def __len__(self) -> int:
        return len(self.attn) + len(self.mlp)


#: where a pass's rows sit (:class:`Rows`)
KINDS = ("chain", "tree", "scratch", "packed")


@dataclass(frozen=True, eq=False)
class Rows:
    """Where a pass's rows sit and which rows and cached positions each one sees.

    ``chain``    after the cache (its length at the pass's ``start``), each row seeing the cache and the
                 rows before it: a decoding step, a verification, a draft;
    ``tree``     after the cache at ``start + offsets``, each row seeing the cache and the rows
                 ``allowed`` marks (``[n, n]``): a candidate tree, whose accepted path the decoder
                 gathers afterwards (:meth:`~selfspec.models.cache.LayerCache.gather`);
    ``scratch``  after the cache's first ``context`` positions at ``context + offsets``, each row seeing
                 those and the rows ``allowed`` marks; its keys and values are not kept (the cache's
                 lengths are those it had): the searches' candidate passes;
    ``packed``   at explicit ``positions`` (``[1, n]``) under an explicit ``mask`` (the attention
                 function's, over the cache's keys and the rows'): several sequences packed in one
                 cache, always a dynamic pass."""

    kind: str = "chain"
    offsets: torch.Tensor | None = None
    allowed: torch.Tensor | None = None
    context: int | None = None
    positions: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Rows.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @classmethod
    def tree(cls, offsets: torch.Tensor, allowed: torch.Tensor) -> "Rows":
        return cls("tree", offsets, allowed)

    @classmethod
    def scratch(cls, context: int, offsets: torch.Tensor, allowed: torch.Tensor) -> "Rows":
        return cls("scratch", offsets, allowed, int(context))

    @classmethod
    def packed(cls, positions: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> "Rows":
        return cls("packed", positions=positions, mask=mask)


CHAIN = Rows()


@dataclass(frozen=True)
class Pass:
    """One pass of the runtime (module docstring): ``layers`` (None: every layer) with ``skip``'s
    sublayers left out, over rows placed as ``rows`` says; ``at_least``: the fewest rows of the static
    shape it runs in on a model whose passes take static shapes (passes of varying widths that a
    method repeats, such as KnapSpec's sublayer states, then share one shape); ``weights``: None, the
    target's own weights, or a quantised copy's format (``int8``, ``int4``: a draft that reads a
    fraction of the bytes, :data:`selfspec.models.quantised.FORMATS`)."""

    layers: range | None = None
    skip: SkipSet | None = None
    rows: Rows = field(default=CHAIN)
    at_least: int = 1
    weights: str | None = None

    def __post_init__(self) -> None:
        from selfspec.models.quantised import FORMATS

        if self.weights is not None and self.weights not in FORMATS:
            raise ValueError(f"Pass.weights must be None (the target's) or one of {', '.join(FORMATS)}, "
                             f"got {self.weights!r}")

    def layer_range(self, num_layers: int) -> range:
        return range(num_layers) if self.layers is None else self.layers

    def key(self, num_layers: int, kept: tuple[int, ...]) -> tuple:
        """What a static pass of this record is keyed by, besides its bucket, cache and input: the layer
        range, the sublayers skipped, where its rows sit, the layers whose states it keeps, the weights."""
        layers = self.layer_range(num_layers)
        return layers.start, layers.stop, self.skip, self.rows.kind, kept, self.weights


#: the plain pass: every layer, rows after the cache
PASS = Pass()

"""Policy state that carries over from one example to the next (docs/design.md §2.3).

A part whose learnt state carries over is a :class:`Carries` and names its own attributes that do:
the speculation gate's measurements and the thread policy's (all of their state), a drafter's
draft-stop rule (Draft & Verify's adaptive threshold), the context drafter's acceptance table
(its ``priced`` schedule), SWIFT's layer search. :meth:`selfspec.decoding.base.Decoder.kept_state`
snapshots the parts a decoder holds and puts them back (the evaluation's warm-up). Everything else
on a decoder is fixed by its config, and what belongs to one example lives on ``DecodeState``.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar


class Carries:
    """A part holding policy state that carries over between examples."""

    #: this part's attributes that carry over (None: all of its state)
    carries: ClassVar[tuple[str, ...] | None] = None

    def snapshot(self) -> dict[str, Any]:
        """A copy of the state that carries over."""
        names = list(vars(self)) if self.carries is None else self.carries
        return {name: copy.deepcopy(getattr(self, name)) for name in names}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Put back a :meth:`snapshot` (a copy of it, so it can be put back again); a part whose
        whole state carries loses what it gained since (state it creates as it runs)."""
        if self.carries is None:
            vars(self).clear()
        for name, value in snapshot.items():
            setattr(self, name, copy.deepcopy(value))

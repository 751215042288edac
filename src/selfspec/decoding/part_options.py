"""The keys of the parts a decoder is built with, beside any method's own (:mod:`selfspec.config.options`).

* :class:`Gated`: ``never_slower``, the speculation gate (:mod:`selfspec.decoding.gate`), for every
  method whose step can give way to a plain step;
* :class:`ContextFirst`: ``ngram``, drafts from the context first
  (:class:`selfspec.decoding.ngram.ContextDrafter`), for every method that drafts a chain itself;
* :class:`QuantisedDraft`: ``draft_weights``, the weights a method's own drafts read (the target's, or a
  quantised copy of them), for every method that drafts with the model itself through a pass;
* :class:`LookupOptions`: the n-gram lookup's own keys, read by ``method=ngram`` and inside an
  ``ngram`` sub-config (PPD's too).

A method's options class derives from the parts it takes; :func:`selfspec.decoding.build_decoder`
builds the parts from these keys and hands the method the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from selfspec.config import checks
from selfspec.config.options import Options, Ref, key, nullable
from selfspec.models.quantised import FORMATS

#: ``draft_schedule`` values of the context drafter (:mod:`selfspec.decoding.ngram`)
SCHEDULES = ("adaptive", "constant", "priced")
#: where the lookup's keys are written
LOOKUP_YAML = "conf/method/ngram/chain.yaml (method/ngram=chain; PPD's: conf/method/ppd_ngram.yaml)"
#: where the keys of the lookup drafting for a method's drafter are written
CASCADE_YAML = "conf/method/draft_ngram/cascade.yaml (method/draft_ngram=cascade)"


@dataclasses.dataclass(frozen=True)
class LookupOptions(Options):
    """The n-gram lookup's keys, in a method config or an ``ngram`` sub-config."""

    max_ngram: int = key(checks.integer, 1, why="longest n-gram matched")
    min_ngram: int = key(checks.integer, 1, Ref("max_ngram"), why="shortest n-gram matched, at most {prefix}.max_ngram")
    max_draft: int = key(checks.integer, 1, why="most draft tokens per step")


def draft_schedule(name: str, value: Any) -> str:
    """``draft_schedule``: ``adaptive`` | ``constant`` | ``priced`` (:mod:`selfspec.decoding.ngram`)."""
    return checks.choice(name, value, SCHEDULES,
                         why="adaptive: draft length follows acceptance; constant: max_draft; priced: the length "
                             "whose expected tokens per pass cost are highest on this machine's cost profile")


@dataclasses.dataclass(frozen=True)
class ScheduledLookup(LookupOptions):
    """The lookup's keys and its ``draft_schedule`` (a context chain; PPD's has a fixed length)."""

    draft_schedule: str = key(draft_schedule)


def context_drafts(name: str, value: Any, schedule: bool = False, yaml: str = LOOKUP_YAML) -> LookupOptions | None:
    """A method's ``ngram`` sub-config (drafts from the context first, beyond the papers): null =
    off, else the record of :class:`LookupOptions`' keys, and ``draft_schedule`` where the method
    drafts a chain (``schedule``: a :class:`ScheduledLookup`). A missing or unknown key is refused
    by name, pointing at ``yaml``; the keys are checked here once, and the drafter reads the record.
    The ``draft_ngram`` sub-config (the lookup drafting for the method's drafter) is read the same way."""
    if value is None:
        return None
    reader = ScheduledLookup if schedule else LookupOptions
    if not hasattr(value, "get") or not hasattr(value, "keys"):
        raise checks.refuse(name, value, f"give null (off) or a mapping of {', '.join(reader.keys())}",
                            why="n-gram drafts from the prompt and the generated text")
    checks.known_keys(name, value, reader.keys(), f"an {name.rsplit('.', 1)[-1]} sub-config")
    checks.required_keys(name, value, reader.keys(), yaml)
    return reader.read(value, name)


@dataclasses.dataclass(frozen=True)
class Gated(Options):
    """``never_slower``: plain steps where speculation does not pay (the gate)."""

    never_slower: bool = key(checks.flag, why="plain steps where speculation does not pay on this machine")


@dataclasses.dataclass(frozen=True)
class ContextFirst(Options):
    """``ngram``: drafts from the context first (null = off)."""

    ngram: ScheduledLookup | None = key(context_drafts, schedule=True)


#: the part option classes, whose keys :func:`selfspec.decoding.build_decoder` takes for the parts
PARTS = (Gated, ContextFirst)


@dataclasses.dataclass(frozen=True)
class QuantisedDraft(Options):
    """``draft_weights``: the weights the drafts read: null, the target's own, or a quantised copy of
    them (``int8``, ``int4``, ``q4_1``: :mod:`selfspec.models.quantised`; the verification reads the target's)."""

    draft_weights: str | None = key(nullable(checks.choice), FORMATS,
                                    why="the weights the drafts read: null = the target's, or a quantised copy")

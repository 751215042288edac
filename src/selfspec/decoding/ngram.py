"""Model-free drafts: n-gram lookup over the prompt and the generated text (beyond the papers).

None of the four papers this framework reproduces drafts without a model; this method is an
addition (issue 12, "Model-free drafts"). The idea is prompt lookup decoding (Saxena 2023; the
``prompt_lookup_num_tokens`` option of ``transformers``, run here as the peer ``hf_prompt_lookup``)
and llama.cpp's n-gram drafting, where text that already occurred — in the prompt (an article
being summarised, code being edited) or earlier in the output — is a free guess of what comes
next. FR-Spec and the other "cheap drafter" work motivate the same trade: a draft that costs
nothing need not be good to pay, only verified. The code here is selfspec's own.

One step:

1. **Lookup** (:class:`NgramIndex`). For ``n = max_ngram`` down to ``min_ngram``, take the last
   ``n`` committed tokens (the pending token included) and look for their most recent earlier
   occurrence in the sequence (prompt + generated). The first ``n`` that matches wins (longest
   match first). The draft is the ``k`` tokens that followed that occurrence; when the copy runs
   past the end of the sequence it continues from its own drafts, so a period-``p`` repeat
   (``a b a b``) drafts ``k`` tokens, not ``p``. The index holds the most recent end position of
   every n-gram and grows with the committed tokens: a lookup costs ``O(max_ngram)`` dictionary
   probes plus indexing the tokens committed since the last one.
2. **Verify** the chain ``[pending, d1..dk]`` in one full forward pass with the shared chain
   step (:func:`selfspec.decoding.chain.settle`, i.e.
   :func:`~selfspec.decoding.sampling.verify_chain`). Greedy: exact match, so the output is
   vanilla's token for token. Sampling: the drafts are deterministic given the context, so the
   draft distribution is a point mass ``q = one_hot(d_i)``; speculative sampling then accepts
   ``d_i`` with probability ``min(1, p(d_i) / 1) = p(d_i)`` and otherwise resamples from
   ``normalize(max(0, p - q))`` = ``p`` with ``d_i`` removed, so every emitted token is
   distributed exactly as the target ``p``.
3. **No match** — nothing is drafted and the step is one plain decoding step (a single-token
   forward pass and the target's own token): the cost of vanilla plus a few dictionary probes.

**Draft length controller** (``draft_schedule``). ``constant``: always ``max_draft`` tokens.
``adaptive``: the draft length ``k`` starts at ``max_draft`` for every example; after a
verification in which every draft was accepted ``k`` grows by 2, after one with a rejection it
shrinks by 1, within ``[1, max_draft]`` (the additive schedule of transformers' assisted
generation, as an idea). Steps without a match leave ``k`` unchanged.

``priced`` (the default of ``method=ngram``): each step chooses ``k`` in ``[0, max_draft]`` from
what a draft of that length is expected to commit and what its verification costs on this
machine, the trade PPD §4 states as speedup = τ / L_fp. How far a copy is right depends on how
long the matched suffix was: a 3-gram match is copied correctly far more often than a 1-gram one.
:class:`AcceptanceTable` keeps, per match length ``n`` and draft position ``i``, how often position
``i`` was verified (the drafts before it were accepted) and accepted; the conditional acceptance
is ``α(n, i) = (accepted + 2 α(n, i - 1)) / (verified + 2)`` with ``α(n, -1) = 1/2``: a position
seen rarely takes the one before it as its prior, since a copy that held for ``i`` tokens tends to
hold on, so a length not tried yet is tried once the shorter ones are seen to pay.
A draft of ``k`` tokens then commits ``E(k) = 1 + Σ_{j≤k} Π_{i≤j} α(n, i)`` tokens in expectation
and costs a pass of ``k + 1`` rows at the current context, priced with the run's cost profile
(:meth:`selfspec.measure.profile.Profile.pass_cost`); the step drafts the ``k`` of the highest
``E(k) / cost(k + 1)``, and ``k = 0`` (a plain step) where no draft beats one plain step's
``1 / cost(1)``. Both the costs and the counts are deterministic, so a seeded run makes the same
choices on any load, greedy or sampled. The table carries over between examples
(:mod:`selfspec.decoding.carried`) and remembers about the last 32 drafts of each match length
(:attr:`AcceptanceTable.memory`). On 2 CPU cores a pass of 2 rows costs ~1.1 steps and one of 8 ~2, so a
1-gram match drafts little or nothing while a long match drafts several tokens; on a GPU, where
width is nearly free, the same rule drafts ``max_draft``. It needs the profile: a run without one
(``profile=null``) refuses it by name.

Statistics (``stats``): ``verifications`` (steps that drafted), ``plain_steps`` (no match, or a
``priced`` step that found no draft worth its pass),
``match_len`` (mean n of the matches) and ``draft_len`` (the controller's ``k`` at the end), and
the context drafter's ``ngram_steps`` / ``ngram_accepted``.

**As a first choice inside other methods.** The lookup, the verification and the controller are
one drafter, :class:`ContextDrafter`. ``method=ngram`` is a chain method with that drafter and no
other; Draft & Verify, early exit, DEL and AdaDecode take it through their ``ngram`` sub-config
(:class:`~selfspec.decoding.part_options.ContextFirst`) and try it before self-drafting
(:func:`selfspec.decoding.chain.context_step`); PPD adds its drafts to the tree instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from selfspec.decoding.base import DecodeState, PRICED_NEEDS_PROFILE
from selfspec.decoding.chain import ChainDecoder, Draft, Drafter, Plan
from selfspec.decoding.part_options import Gated, ScheduledLookup


class NgramIndex:
    """Most recent occurrence of every n-gram (``min_n <= n <= max_n``) of a growing sequence.

    ``lookup(tokens, k)`` indexes what was appended to ``tokens`` since the last call (the
    sequence may only grow: a new example needs a new index), then drafts as the module
    docstring describes. An n-gram is indexed by its end position ``e`` (exclusive) only once a
    token follows it (``e < len(tokens)``), so the current suffix never matches itself.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._next_end = 1  # n-grams ending before this position are indexed

    def extend(self, tokens: Sequence[int], size: int | None = None) -> None:
        """Index the n-grams of ``tokens`` (its first ``size``; default all) that end before its last token."""
        end = len(tokens) if size is None else size
        for e in range(self._next_end, end):
            for n, last in self._last.items():
                if e >= n:
                    last[tuple(tokens[e - n:e])] = e
        self._next_end = max(self._next_end, end)

    def match(self, tokens: Sequence[int], indexed: int | None = None) -> tuple[int, int]:
        """``(n, e)``: the longest suffix n-gram of ``tokens`` seen before and the end of its most
        recent earlier occurrence; ``(0, -1)`` when none matches. ``indexed``: only the first that many
        of ``tokens`` are indexed (the committed ones; the rest, a draft's own tokens, may end the
        matched suffix but are never indexed, since they may be rejected); default all."""
        self.extend(tokens, indexed)
        size = len(tokens)
        for n in range(min(self.max_n, size), self.min_n - 1, -1):
            e = self._last[n].get(tuple(tokens[size - n:]))
            if e is not None:
                return n, e
        return 0, -1

    def lookup(self, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` draft tokens after the longest matching suffix, and that suffix's length n
        (``([], 0)`` when nothing matches or ``k < 1``)."""
        n, e = self.match(tokens)
        return (self.copy(tokens, e, k) if n else []), n

    @staticmethod
    def copy(tokens: Sequence[int], e: int, k: int) -> list[int]:
        """The ``k`` tokens from position ``e`` on (a match's end); past the end of ``tokens`` the
        copy continues from its own drafts."""
        size = len(tokens)
        drafts: list[int] = []
        for j in range(e, e + max(k, 0)):
            drafts.append(tokens[j] if j < size else drafts[j - size])
        return drafts


@dataclass
class NgramExample:
    """Per-example state (``DecodeState.context``): the index of the sequence, the controller's
    draft length ``k``, the summed match lengths (for ``match_len``) and the match length of the
    draft in flight (for :class:`AcceptanceTable`)."""

    index: NgramIndex
    draft_len: int
    match_lens: int = 0
    last_match: int = 0


class AcceptanceTable:
    """The ``priced`` schedule's counts (module docstring): per match length ``n`` and draft
    position ``i`` (0-based here), how often position ``i`` was verified and how often accepted.
    Greedy or sampled, a chain's drafts after the first rejected one are not verified, so a draft
    of ``k`` with ``a`` accepted counts positions ``0..min(a, k - 1)`` as verified and ``0..a - 1``
    as accepted."""

    #: how many recent drafts of a match length the counts remember: each draft first scales that
    #: length's counts by ``1 - 1 / memory``, so a change of text (a new example, a task without
    #: copies) shows within a few dozen drafts
    memory: float = 32.0

    def __init__(self, max_ngram: int, max_draft: int) -> None:
        self.verified = [[0.0] * max_draft for _ in range(max_ngram + 1)]
        self.accepted = [[0.0] * max_draft for _ in range(max_ngram + 1)]

    def acceptances(self, n: int, k: int) -> list[float]:
        """α(n, 0..k-1): the chance that draft position ``i`` is accepted when the ones before it
        were, each position's prior the one before it (module docstring)."""
        out, prior = [], 0.5
        for i in range(k):
            prior = (self.accepted[n][i] + 2 * prior) / (self.verified[n][i] + 2)
            out.append(prior)
        return out

    def record(self, n: int, drafted: int, accepted: int) -> None:
        keep = 1.0 - 1.0 / self.memory
        self.verified[n] = [v * keep for v in self.verified[n]]
        self.accepted[n] = [a * keep for a in self.accepted[n]]
        for i in range(min(accepted + 1, drafted)):
            self.verified[n][i] += 1
            self.accepted[n][i] += i < accepted

    def best_length(self, n: int, k_max: int, cost) -> int:
        """The draft length in ``[0, k_max]`` with the most expected committed tokens per second,
        ``cost(rows)`` being a verification pass's seconds (ties go to the shorter draft)."""
        best, best_rate = 0, 1.0 / cost(1)
        expected, reach = 1.0, 1.0
        for k, alpha in enumerate(self.acceptances(n, k_max), start=1):
            reach *= alpha
            expected += reach
            rate = expected / cost(k + 1)
            if rate > best_rate:
                best, best_rate = k, rate
        return best


class ContextDrafter(Drafter):
    """Drafts from the context: steps 1 and 3 of the module docstring and the draft-length
    controller, as a :class:`~selfspec.decoding.chain.Drafter` whose per-example state
    (:class:`NgramExample`) lives on ``DecodeState.context``.

    It is the whole of ``method=ngram`` and, through a method's ``ngram`` sub-config, the first
    choice of every self-drafting method (:func:`~selfspec.decoding.chain.context_step`): a step
    whose context matches verifies the copied tokens with one full pass (the default
    :meth:`~selfspec.decoding.chain.Drafter.score`) instead of self-drafting. Statistics:
    ``ngram_steps`` (steps that drafted from the context) and ``ngram_accepted`` (their accepted
    drafts), the names PPD's context drafts use."""

    #: the ``priced`` schedule's acceptance per match length carries over between examples
    carries = ("acceptance",)

    def __init__(self, model, lookup: ScheduledLookup, profile=None, label: str = "ngram") -> None:
        """``lookup``: the checked keys (:func:`~selfspec.decoding.part_options.context_drafts`, or
        ``method=ngram``'s own options); ``profile``: the run's cost profile, which the ``priced``
        schedule needs; ``label``: the statistics' prefix (``draft_ngram`` where the lookup drafts for a
        drafter, :meth:`selfspec.decoding.chain.Draft.extend`)."""
        if lookup.draft_schedule == "priced" and profile is None:
            raise ValueError(PRICED_NEEDS_PROFILE)
        self.model = model
        #: the prefix of the statistics' names (``<label>_steps``, ``<label>_accepted``)
        self.label = label
        self.max_ngram, self.min_ngram = lookup.max_ngram, lookup.min_ngram
        self.max_draft = lookup.max_draft
        self.draft_schedule = lookup.draft_schedule
        self.profile = profile
        #: the ``priced`` schedule's counts, carried over between examples (None for the others)
        self.acceptance = AcceptanceTable(self.max_ngram, self.max_draft) if self.draft_schedule == "priced" else None
        self._costs: dict[tuple, float] = {}

    def pass_cost(self, rows: int, context: int, **draft) -> float:
        """A pass of ``rows`` at ``context`` on the profile (context in steps of 64): the target's
        verification, or with ``draft`` (:meth:`~selfspec.measure.profile.Profile.draft_pass_cost`'s keys)
        the drafter's pass the guesses ride in where the lookup drafts for a drafter."""
        key = (rows, context // 64, *sorted(draft.items()))
        if key not in self._costs:
            at = key[1] * 64 + 32
            self._costs[key] = self.profile.draft_pass_cost(rows, at, **draft) if draft else self.profile.pass_cost(rows, at)
        return self._costs[key]

    def new_example(self, state: DecodeState | None) -> NgramExample:
        return NgramExample(NgramIndex(self.min_ngram, self.max_ngram), self.max_draft)

    def plan(self, state: DecodeState) -> Plan:
        return Plan(state.context.draft_len)

    def guess(self, ex: NgramExample, tokens: Sequence[int], k_max: int, cost, indexed: int | None = None) -> list[int]:
        """Step 1 (lookup) for the example ``ex`` over ``tokens`` (``indexed``: how many of them are
        committed, :meth:`NgramIndex.match`): at most ``k_max`` tokens, ``draft_len`` of them (``adaptive``) or the
        ``priced`` schedule's length for the match's n, ``cost(rows)`` being the seconds of the pass that
        checks ``rows - 1`` guesses (a verification; a drafter's own pass where the lookup drafts for it)."""
        k_max = min(k_max, self.max_draft)
        n_gram, end = ex.index.match(tokens, indexed)  # once per step: the priced length depends on n
        if n_gram and self.acceptance is not None:
            k_max = self.acceptance.best_length(n_gram, k_max, cost)
        elif self.draft_schedule == "adaptive":
            k_max = min(k_max, ex.draft_len)
        out = NgramIndex.copy(tokens, end, k_max) if n_gram else []
        ex.match_lens += n_gram if out else 0
        ex.last_match = n_gram
        return out

    def propose(self, state: DecodeState, plan: Plan, k_max: int) -> Draft:
        """Step 1 (:meth:`guess`) before the target's verification; under sampling the draft
        distribution is a point mass on each draft."""
        context = state.n_cached
        tokens = self.guess(state.context, state.tokens, k_max, lambda rows: self.pass_cost(rows, context))
        probs = []
        if tokens and not state.sampling.greedy:
            probs = list(torch.nn.functional.one_hot(torch.tensor(tokens, device=self.model.device),
                                                     self.model.vocab_size).float())
        return Draft(tokens, probs, [None] * len(tokens))

    def update(self, state: DecodeState, draft: Draft, accepted: int, committed: list[int]) -> None:
        self.learn(state, state.context, len(draft), accepted)

    def learn(self, state: DecodeState, ex: NgramExample, drafted: int, accepted: int) -> None:
        """The schedule's update after ``accepted`` of ``drafted`` guesses of ``ex`` were accepted, and the
        counts (``<label>_steps``, ``<label>_accepted``). Where the lookup drafts for a drafter, ``accepted``
        counts the guesses that entered the draft (:meth:`~selfspec.decoding.chain.Draft.extend`): a guess the
        drafter agreed with after a draft-stop cut saves no pass, and the ``priced`` schedule weighs what saves."""
        if self.acceptance is not None:
            self.acceptance.record(ex.last_match, drafted, accepted)
        self.adapt(ex, accepted, drafted)
        state.count(f"{self.label}_steps")
        state.count(f"{self.label}_accepted", accepted)

    def adapt(self, ex: NgramExample, accepted: int, drafted: int) -> None:
        """The draft-length controller (module docstring): +2 after a fully accepted draft, -1
        after a rejection, within [1, max_draft]; ``constant`` keeps ``max_draft``, and so does
        ``priced``, whose length each step chooses (:meth:`propose`)."""
        if self.draft_schedule in ("constant", "priced"):
            return
        step = 2 if accepted == drafted else -1
        ex.draft_len = max(1, min(self.max_draft, ex.draft_len + step))


class NoDrafts(Drafter):
    """``method=ngram``'s own drafter: none. The context drafter goes first; a step it leaves is one
    plain step (step 3: no match), counted as ``plain_steps``."""

    def __init__(self, model) -> None:
        self.model = model

    def plan(self, state: DecodeState) -> Plan:
        return Plan(0)

    def update(self, state: DecodeState, draft: Draft, accepted: int, committed: list[int]) -> None:
        state.count("plain_steps")


class NgramLookup(ChainDecoder):
    """Self-speculative decoding with model-free n-gram drafts (module docstring): a chain method
    whose only draft source is the context (:class:`ContextDrafter`); a step without a match
    drafts nothing and is one plain step."""

    name = "ngram"
    title = "N-gram lookup (beyond the papers)"
    lossless = True
    context_first = False  # its keys are the lookup's own; there is no self-drafter to go after

    @dataclass(frozen=True)
    class Options(ScheduledLookup, Gated):
        """Keys (conf/method/ngram.yaml): the lookup's and its ``draft_schedule``
        (:class:`~selfspec.decoding.part_options.ScheduledLookup`), and ``never_slower``."""

    @classmethod
    def needs_profile(cls, options: Options) -> tuple[str, str] | None:
        """``draft_schedule: priced`` prices each draft's length with the run's profile."""
        return ("draft_schedule=priced", PRICED_NEEDS_PROFILE) if options.draft_schedule == "priced" else None

    @classmethod
    def from_config(cls, model, options: Options, **common) -> "NgramLookup":
        return cls(model, options, **common)

    def __init__(self, model, options: Options, **common) -> None:
        super().__init__(model, **common)
        self.context = ContextDrafter(model, options, profile=self.profile)
        self.drafter = NoDrafts(model)
        self.lookahead = self.context.max_draft  # verification writes k + 1 positions past the committed ones

    def finish(self, state: DecodeState) -> None:
        ex = state.context
        verifications = state.steps_from("context")  # the steps that drafted (the others drafted nothing)
        state.stats.setdefault("plain_steps", 0)
        state.stats.setdefault("verifications", 0)
        state.stats["match_len"] = ex.match_lens / verifications if verifications else 0.0
        state.stats["draft_len"] = ex.draft_len

"""The drafter interface and the one chain step every chain method shares (issue 12).

A *chain method* drafts ``d1..dk`` after the pending token, scores ``[pending, d1..dk]`` with the
full model, commits the longest accepted prefix and the target's own next token, rolls the cache
back and lets the drafter learn from what was accepted. Draft & Verify, n-gram lookup, early
exit and DEL differ only in how they draft and, for early exit / DEL, in how the target scores
the chain (the upper layers over kept exit-layer states). The split follows the idea of
``transformers``' ``CandidateGenerator`` (propose candidates; update the strategy from the number
of matches):

* :class:`Drafter` — a **proposer** and its **scorer**, a part a decoder is composed of:
  :meth:`~Drafter.new_example` (per-example state, held on ``DecodeState.example``),
  :meth:`~Drafter.plan` (the step's :class:`Plan`, which the draft carries),
  :meth:`~Drafter.propose` (a :class:`Draft`),
  :meth:`~Drafter.score` (target logits of the chain; default one full forward pass) and
  :meth:`~Drafter.update` (the policy update, e.g. Draft & Verify's adaptive threshold, DEL's
  shadow-token statistics, the n-gram draft-length controller). Draft & Verify's skip-set drafter
  (:class:`~selfspec.decoding.draft_verify.SkipSetDrafter`), KnapSpec's and CLaSp's searched one,
  early exit's and DEL's exit-head drafters and the context drafter
  (:class:`~selfspec.decoding.ngram.ContextDrafter`) are each one;
* :func:`chain_step` — one step of one drafter: plan, propose, score, :func:`settle`;
* :func:`settle` — verify, roll back, update, count: written once, used by :func:`chain_step`
  and by AdaDecode (whose passes interleave drafting and scoring, so it is no plain chain);
* :class:`ChainDecoder` — a :class:`~selfspec.decoding.base.Decoder` composed of its drafters,
  whose step is the **first of** them that drafts (:attr:`ChainDecoder.proposers`): the context
  drafter when the method has one (drafts from the context first, beyond the papers: the tokens
  that followed the longest matching n-gram of the prompt and the generated text, verified when
  there is a match), then the method's own drafter, which always takes the step (a plain one when
  it drafts nothing);
* :func:`context_step` — the context drafter's step alone, for a decoder that is no chain
  (AdaDecode).

A method that only drafts differently is one :class:`Drafter` and one YAML: the decoder class
around it declares the YAML's keys (its ``Options``) and builds the drafter (``from_config``).

**Draft-stop rule** (one for every method; Draft & Verify §3.4): :meth:`Draft.add` takes the
drafter's logits for the next position, picks the draft token (argmax, or a sample of the warped
distribution under sampling, whose row is kept as ``q`` for speculative sampling) and its
*confidence*, the top probability of the drafter's unwarped distribution (the same under greedy
decoding and sampling). Drafting stops after a token whose confidence is below the threshold —
that token **is still verified** — and after an EOS draft (nothing after it can be committed;
Draft & Verify's ``eos_draft: continue`` drafts past it, as its authors' code does).

Policy state (a draft-stop rule such as :class:`~selfspec.decoding.draft_exit.AdaptiveThreshold`)
lives on the drafter and carries over between examples (:mod:`selfspec.decoding.carried`; Draft & Verify's
evaluation carries its threshold from one example to the next, docs/design.md §6); the rule is told
when an example starts (:meth:`~selfspec.decoding.draft_exit.DraftStop.start_example`), so what
it keeps per example starts again. Everything else that belongs to one example lives in the object
:meth:`Drafter.new_example` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from selfspec.decoding.base import DecodeState, Decoder
from selfspec.decoding.carried import Carries
from selfspec.decoding.draft_exit import DraftStop
from selfspec.decoding.sampling import argmax, draw, greedy_verify, select, speculative_verify, verify_chain, warp
from selfspec.models.layered import LayeredModel
from selfspec.models.ledger import phase


@dataclass(frozen=True)
class Plan:
    """What a step of a drafter will do, decided once at its start (:meth:`Drafter.plan`): at
    most ``max_draft`` drafts (before the token budget cuts them). A drafter whose step has more
    settings returns a subclass (DEL's exit layer and threshold:
    :class:`~selfspec.decoding.early_exit.RoundPlan`)."""

    max_draft: int


@dataclass
class Draft:
    """Draft tokens of one step and what verification and the drafter's update read."""

    tokens: list[int] = field(default_factory=list)
    #: ``q`` rows (``[V]`` each) the drafts were sampled from; empty under greedy decoding
    probs: list[torch.Tensor] = field(default_factory=list)
    #: top probability of the drafter's distribution at each draft (None where not computed)
    confidences: list[float | None] = field(default_factory=list)
    #: drafting ended on a draft below the draft-stop threshold (that draft is verified)
    stopped: bool = False
    #: the step's plan (:meth:`Drafter.plan`; None for a draft made outside a chain step: AdaDecode's)
    plan: Plan | None = None

    @property
    def limit(self) -> int:
        """Most drafts the drafter meant to propose (its plan's, before the budget; 0 without one)."""
        return self.plan.max_draft if self.plan is not None else 0

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, logits: torch.Tensor, state: DecodeState, threshold: float = 0.0,
            eos: frozenset[int] = frozenset()) -> bool:
        """Append the draft the drafter's ``logits`` ``[V]`` give (module docstring); return
        whether drafting goes on (False after a draft below ``threshold`` or an EOS draft)."""
        token, conf, q = pick(logits, state, confidence=threshold > 0)
        self.append(token, conf, q)
        if conf is not None and conf < threshold:
            self.stopped = True
            return False
        return token not in eos

    def extend(self, guesses: list[int], logits: torch.Tensor, state: DecodeState, threshold: float = 0.0,
               eos: frozenset[int] = frozenset()) -> tuple[int, bool]:
        """Append what the drafter's own ``logits`` ``[m + 1, V]`` make of ``m`` guessed tokens, a cheaper
        proposer drafting for the drafter (the n-gram lookup, ``draft_ngram``): row ``i`` is the drafter's
        distribution after guess ``i - 1`` (row 0: after the draft so far). The guesses are checked by the
        rule the target checks drafts with, each guess a point mass: greedy, those up to the first that
        is not the drafter's argmax, then its argmax there; sampling, speculative sampling against the
        drafter's warped rows, then the resampled or the bonus token. Each appended token is so
        distributed as the drafter's own draw at its position (under greedy decoding it is that
        argmax), its warped row is its ``q``, and the draft is one :meth:`add` could have made token by
        token: a vertical cascade of drafters (Chen et al., Cascade Speculative Drafting, arXiv 2312.11462
        §3.2; ML-SpecQD, arXiv 2503.13565 §3.3) changes what a draft costs, not what it is. The draft-stop
        rule and EOS then end the draft at an appended token as :meth:`add` does. Returns (the guesses
        accepted into the draft, those a stop cut off not counted; whether drafting goes on)."""
        guess = torch.tensor(guesses, dtype=torch.long, device=logits.device)
        q = None
        if state.sampling.greedy:
            n, nxt = greedy_verify(guess, logits)
        else:
            q = warp(logits, state.sampling, state.ledger)
            n, nxt = speculative_verify(guess, torch.nn.functional.one_hot(guess, q.shape[-1]).to(q.dtype), q,
                                        state.generator)
        conf = (logits[: n + 1].float().softmax(-1).amax(-1).tolist() if threshold > 0 else [None] * (n + 1))
        for i, token in enumerate([*guesses[:n], nxt]):
            self.append(token, conf[i], None if q is None else q[i])
            if conf[i] is not None and conf[i] < threshold:
                self.stopped = True
                return min(n, i + 1), False
            if token in eos:
                return min(n, i + 1), False
        return n, True

    def append(self, token: int, conf: float | None = None, q: torch.Tensor | None = None) -> None:
        self.tokens.append(token)
        self.confidences.append(conf)
        if q is not None:
            self.probs.append(q)

    def q(self) -> torch.Tensor | None:
        """``[k, V]`` draft distributions for speculative sampling (None under greedy decoding)."""
        return torch.stack(self.probs) if self.probs else None

    def tensor(self, device) -> torch.Tensor:
        return torch.tensor(self.tokens, dtype=torch.long, device=device)


def pick(logits: torch.Tensor, state: DecodeState, confidence: bool = True) -> tuple[int, float | None,
                                                                                    torch.Tensor | None]:
    """``(token, confidence, q)`` for drafter logits ``[V]``: the argmax (greedy) or a sample of
    the warped distribution ``q``; the confidence is the unwarped top probability. One host sync.
    ``confidence=False`` (no draft-stop threshold to compare it with) skips it under greedy decoding:
    the argmax alone, without a softmax of the vocabulary (Gemma 3's 262,144 entries took ~0.3 ms a
    draft)."""
    if state.sampling.greedy and not confidence:
        return int(argmax(logits)), None, None
    probs = logits.float().softmax(-1)
    if state.sampling.greedy:
        p_max, tok = probs.max(-1)
        q = None
    else:
        q = warp(logits, state.sampling, state.ledger)
        tok = draw(q, state.generator)
        p_max = probs.max()
    conf, tok = torch.stack([p_max, tok.to(p_max.dtype)]).tolist()
    return int(tok), conf, q


class Drafter(Carries):
    """A proposer and its scorer, a part of a :class:`ChainDecoder` (module docstring), over
    :attr:`model`. ``draft_stop`` is its draft-stop rule (policy state carried between examples,
    :mod:`selfspec.decoding.carried`; never stopping by default)."""

    carries = ("draft_stop",)

    draft_stop: DraftStop = DraftStop()
    model: LayeredModel
    #: a cheaper proposer that drafts for this drafter (:meth:`Draft.extend`; the n-gram lookup of a
    #: method's ``draft_ngram`` sub-config, :class:`~selfspec.decoding.ngram.ContextDrafter`), its per-example
    #: state on ``DecodeState.lookup``; None: none
    lookup: "Drafter | None" = None

    def draft_room(self, limit: int, budget: int) -> int:
        """Most drafts a step may propose with ``budget`` tokens left: ``limit``, cut so that the
        accepted drafts and the bonus token fit the budget (0 with one token left: a plain step).
        The loop cuts what a step commits to the budget, so a drafter may draft beyond it."""
        return min(limit, budget - 1)

    def new_example(self, state: DecodeState) -> Any:
        """Per-example drafter state, created before prefill (``state.example``); default None."""
        return None

    def plan(self, state: DecodeState) -> Plan:
        """The next step's :class:`Plan` (most drafts before the token budget cuts them), made
        once at its start and carried by its draft (``draft.plan``) to :meth:`score`,
        :meth:`update` and :meth:`controller`, not kept on the drafter or the example."""
        raise NotImplementedError

    def propose(self, state: DecodeState, plan: Plan, k_max: int) -> Draft:
        """Draft up to ``k_max`` (>= 1) tokens after the pending one, as ``plan`` says."""
        raise NotImplementedError

    def score(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        """Target logits ``[k + 1, V]`` of ``[pending, d1..dk]`` (row ``j`` predicts the token after
        position ``j``), with every layer's cache holding at least ``n_cached + k + 1`` exact
        positions. Default: truncate every layer to the committed tokens (drafting may have
        written scratch K/V past them) and run the chain through the full model in one pass, keeping the
        layer states :meth:`kept` asks for."""
        model = self.model
        state.cache.truncate(state.n_cached)
        ids = torch.tensor([[state.pending, *draft.tokens]], device=model.device)
        h = model.forward(ids, state.cache, start=state.n_cached, keep=self.kept(state, len(draft) + 1),
                          ledger=state.ledger, joins=state.joins)
        return model.logits(h, state.ledger, state.joins)[0]

    def kept(self, state: DecodeState, rows: int) -> dict[int, torch.Tensor] | None:
        """Where the default :meth:`score` writes the verified rows' states of some layers (layer -> a
        ``[rows, d]`` view), for a drafter that learns from them (DEL's shadow tokens); default none."""
        return None

    def update(self, state: DecodeState, draft: Draft, accepted: int, committed: list[int]) -> None:
        """Learn from a verification: ``accepted`` of ``len(draft)`` drafts, ``committed`` the
        tokens the step commits. Default: the draft-stop rule's update (drafting "hit the
        maximum" when it drafted ``draft.limit`` tokens, Draft & Verify's code)."""
        if len(draft):
            self.draft_stop.update(len(draft), accepted, len(draft) == draft.limit)

    def controller(self, state: DecodeState, draft: Draft) -> dict[str, Any] | None:
        """The drafter's policy state after the update that verified ``draft``, for the step trace
        (default: the draft-stop rule's, :meth:`~selfspec.decoding.draft_exit.DraftStop.state`)."""
        return self.draft_stop.state()


def settle(state: DecodeState, draft: Draft, logits: torch.Tensor, drafter: Drafter,
           verify: bool = True, source: str = "self") -> list[int]:
    """Verify ``draft`` against the target ``logits`` ``[k + 1, V]``, roll the cache back, let the
    drafter learn and count; returns the tokens to commit ``[*d[:n], next]``.

    Verification is :func:`~selfspec.decoding.sampling.verify_chain` (greedy: exact match, so the
    output is vanilla's; sampling: speculative sampling with the drafts' ``q``); ``verify=False``
    (AdaDecode's lossy ablation) accepts every draft. The cache then keeps ``n_cached + n + 1``
    positions (the pending token and the accepted drafts; gpt-fast's scheme). Statistics:
    ``state.drafted``, ``verifications`` (steps that drafted) and ``draft_stops`` (steps whose
    drafting the draft-stop rule ended; the key appears at the first such step); the step's trace
    (``source`` of the drafts, accepted, verification width, draft limit, the drafter's
    :meth:`~Drafter.controller` after its update).
    """
    k = len(draft)
    if verify:
        n, nxt = verify_chain(draft.tensor(logits.device), draft.q(), logits, state.sampling, state.generator,
                              state.ledger)
    else:
        n, nxt = k, int(select(logits[-1], state.sampling, state.generator, state.ledger))
    state.cache.truncate(state.n_cached + n + 1)
    state.drafted = k
    if k:
        state.count("verifications")
    if draft.stopped:
        state.count("draft_stops")
    committed = [*draft.tokens[:n], nxt]
    drafter.update(state, draft, n, committed)
    step = state.trace_step
    step.source = source if k else "plain"
    step.accepted, step.width, step.draft_limit = n, k + 1, draft.limit or None
    step.controller = drafter.controller(state, draft)
    return committed


def chain_step(state: DecodeState, drafter: Drafter, budget: int, source: str = "self",
               optional: bool = False) -> list[int] | None:
    """One step of ``drafter``: its :meth:`~Drafter.plan`, its drafts within the budget's room, its
    score and :func:`settle`. ``optional``: a step that drafts nothing is not taken (None: the next
    proposer goes); otherwise it is a plain step, scored by the drafter."""
    plan = drafter.plan(state)
    k_max = drafter.draft_room(plan.max_draft, budget)
    if optional and k_max < 1:
        return None
    with phase(state.ledger, "draft"):
        draft = drafter.propose(state, plan, k_max) if k_max > 0 else Draft()
    if optional and not len(draft):
        return None
    draft.plan = plan
    with phase(state.ledger, "verify" if len(draft) else "plain"):
        logits = drafter.score(state, draft)
    return settle(state, draft, logits, drafter, source=source)


def context_step(decoder: Decoder, state: DecodeState, budget: int) -> list[int] | None:
    """One step with drafts from the context (module docstring), or None when the decoder has no
    context drafter, the budget leaves no room for a draft or nothing matches (the method then
    drafts itself). The context drafter scores with one full pass and learns from the outcome
    itself; the method's own policy (threshold, statistics) sees only its own drafts."""
    if decoder.context is None:
        return None
    return chain_step(state, decoder.context, budget, source="context", optional=True)


class ChainDecoder(Decoder):
    """A decoder composed of its drafters, whose step is the first of them that drafts (module
    docstring). A subclass builds its own :attr:`drafter` at construction, and takes the parts
    its :attr:`~Decoder.Options` derive from (``never_slower``, ``ngram``)."""

    #: the method's own proposer and scorer
    drafter: Drafter

    @property
    def parts(self) -> tuple[Any, ...]:
        """The decoder's parts, its own drafter and the lookup drafting for it (None where none)."""
        return (*super().parts, self.drafter, self.drafter.lookup)

    @property
    def proposers(self) -> tuple[tuple[Drafter, str], ...]:
        """The drafters a step tries in order, each with the source its steps are traced as: the
        context drafter when the method has one, then its own."""
        own = (self.drafter, "self")
        return (own,) if self.context is None else ((self.context, "context"), own)

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        self.drafter.draft_stop.start_example()
        state.example = self.drafter.new_example(state)
        if self.drafter.lookup is not None:
            state.lookup = self.drafter.lookup.new_example(state)

    def step(self, state: DecodeState, budget: int) -> list[int]:
        """The first of :attr:`proposers` that drafts takes the step; the last always does. (With a
        speculation gate the loop may take a plain step instead; the drafter's per-example state
        holds nothing across rounds that a plain step would leave stale: each round drafts from
        the pending token.)"""
        *first, (last, source) = self.proposers
        for drafter, name in first:
            new = chain_step(state, drafter, budget, name, optional=True)
            if new is not None:
                return new
        return chain_step(state, last, budget, source)

    def self_step(self, state: DecodeState, budget: int) -> list[int]:
        """The step of the method's own drafter alone (no context drafts first)."""
        return chain_step(state, self.drafter, budget)

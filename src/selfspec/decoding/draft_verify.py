"""Draft & Verify: self-speculative decoding with skipped sublayers (Zhang et al., arXiv 2309.08168).

One step (Draft & Verify §3.2, Algorithm 2 / Appendix K Algorithms 3-4), a drafter of the shared
chain step (:mod:`selfspec.decoding.chain`):

1. **Draft** (:meth:`SkipSetDrafter.propose`) up to ``K`` tokens with the model itself, skipping
   the attention and MLP sublayers of the *skip set* (§3.3). Drafting shares the layer cache: the
   drafted tokens' keys/values are written past the committed tokens (scratch) at every layer
   whose attention runs.
2. **Draft exit** (§3.4): stop as soon as the draft distribution's top probability falls below
   the threshold γ (that token is still verified — the rule every method shares,
   :class:`~selfspec.decoding.chain.Draft`). The ``draft_stop`` sub-config every method shares
   (:mod:`selfspec.decoding.draft_exit`) names the rule: ``{rule: adaptive, threshold: γ0, target:
   α, epsilon, beta1, beta2, ar_start, ar_per_example}`` (Eq. 2-4, updated after every
   verification from the EMA of the acceptance rate; the default), ``{rule: static, threshold}``
   (Table 4) or null (always K drafts, Table 3). ``eos_draft``: drafting also stops after an EOS
   draft (``stop``: nothing after it could be committed) or goes on past it (``continue``: the
   authors' code).
3. **Verify** ``[pending, d1..dk]`` in one full forward pass, after truncating every layer back
   to the committed tokens (the scratch K/V came from approximate hidden states), then keep
   ``n_cached + accepted + 1`` positions (gpt-fast's scheme): the chain step's default
   :meth:`~selfspec.decoding.chain.Drafter.score` and :func:`~selfspec.decoding.chain.settle`.
   Greedy: exact match, so the output equals vanilla token for token. Sampling: speculative
   sampling (Appendix K), which preserves the target distribution.

``last_token``: with one token of budget left a step is a plain one (``plain``), or it still
drafts one token and verifies it, which feeds the threshold's update (``draft``: the authors' code,
where the loop drafts before it looks at the budget); the loop commits one token either way.

Statistics follow :mod:`selfspec.decoding.base`: ``tau`` counts the bonus token; the
acceptance rate is accepted drafts / drafted tokens. ``stats`` adds ``threshold`` (γ
after the example), ``verifications`` and ``draft_stops`` (steps ended by the threshold).

Carried across examples (:mod:`selfspec.decoding.carried`): the draft-stop rule. Its threshold θ always carries
over, as the authors' evaluation passes each example's final threshold to the next one; the
acceptance-rate average carries over with it unless ``draft_stop.ar_per_example`` (the authors'
code keeps it for one call). :meth:`SkipSetDrafter.reset_draft_stop` restores γ0 and a fresh
average. ``method=draft_verify_paper`` is the authors' loop step for step (docs/design.md §8).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from selfspec.config import checks
from selfspec.config.options import Options, key, nullable
from selfspec.decoding.base import PRICED_NEEDS_PROFILE, DecodeState
from selfspec.decoding.chain import ChainDecoder, Draft, Drafter, Plan
from selfspec.decoding.draft_exit import DraftStop, StopOptions, draft_stop_option, new_rule
from selfspec.decoding.part_options import (CASCADE_YAML, ContextFirst, Gated, QuantisedDraft, ScheduledLookup,
                                            context_drafts)
from selfspec.models.heads import DraftVocabOptions, build_draft_vocab, draft_logits
from selfspec.models.layered import LayeredModel, Pass, SkipSet
from selfspec.store.artefacts import artefact_option

#: ``last_token`` values: with one token of budget left, a plain step or one draft verified anyway
LAST_TOKEN = ("plain", "draft")
#: ``eos_draft`` values: drafting stops after an EOS draft, or goes on past it
EOS_DRAFT = ("stop", "continue")
#: keys of the paper's names, refused with the ``draft_stop`` key that replaced each
RENAMED = {"gamma0": "draft_stop.threshold", "alpha": "draft_stop.target", "epsilon": "draft_stop.epsilon",
           "beta1": "draft_stop.beta1", "beta2": "draft_stop.beta2"}


@dataclass(frozen=True)
class DecodingOptions(QuantisedDraft):
    """The decoding settings of a method drafting with skipped sublayers, besides where its skip
    set comes from (Draft & Verify's searched set; KnapSpec's and CLaSp's, searched while
    decoding): ``max_draft`` K >= 1; ``draft_stop``, the shared sub-config of
    :mod:`selfspec.decoding.draft_exit`; ``last_token`` and ``eos_draft`` (module docstring);
    ``draft_weights`` (:class:`~selfspec.decoding.part_options.QuantisedDraft`). The paper's key names (``draft_exit``, ``gamma0``, ``alpha``, ...) are refused, naming their
    ``draft_stop`` keys."""

    renamed = {**RENAMED, "draft_exit": "{prefix}.draft_stop ({rule: adaptive}, {rule: static, threshold: p}, or "
               "null: always max_draft drafts)"}

    max_draft: int = key(checks.integer, 1, why="K, the most draft tokens per step")
    draft_stop: StopOptions | None = key(draft_stop_option)
    last_token: str = key(checks.choice, LAST_TOKEN, why="one token of budget left: a plain step, or draft and verify "
                          "one token anyway (the authors' code)")
    eos_draft: str = key(checks.choice, EOS_DRAFT, why="after an EOS draft: stop drafting, or go on (the authors' code)")
    draft_ngram: ScheduledLookup | None = key(context_drafts, schedule=True, yaml=CASCADE_YAML)


@dataclass(frozen=True)
class DraftVerifyOptions(DecodingOptions, DraftVocabOptions, Gated, ContextFirst):
    """Keys (conf/method/draft_verify*.yaml): the skip set (``skip_attn`` / ``skip_mlp`` layer
    lists, else the ``skip_set`` artefact, else the default one for ``task``), the decoding
    settings (:class:`DecodingOptions`), the draft vocabulary's keys and the parts'."""

    skip_set: Path | None = key(artefact_option, "skip_set")
    skip_attn: list[int] | None = key(nullable(checks.integers))
    skip_mlp: list[int] | None = key(nullable(checks.integers))
    task: str | None = key(nullable(checks.text))


def skip_set_tensors(skip: SkipSet, num_layers: int) -> dict[str, torch.Tensor]:
    """The artefact form of a skip set: ``attn`` and ``mlp`` int8 masks of length L (1 = skip)."""
    attn = torch.zeros(num_layers, dtype=torch.int8)
    mlp = torch.zeros(num_layers, dtype=torch.int8)
    attn[sorted(skip.attn)] = 1
    mlp[sorted(skip.mlp)] = 1
    return {"attn": attn, "mlp": mlp}


def skip_set_from_tensors(tensors: dict[str, torch.Tensor], num_layers: int, where: str) -> SkipSet:
    for kind in ("attn", "mlp"):
        if kind not in tensors or tensors[kind].numel() != num_layers:
            raise ValueError(f"{where}: skip set needs '{kind}' masks of length {num_layers} (one per layer)")
    return SkipSet.of(
        attn=torch.nonzero(tensors["attn"]).flatten().tolist(),
        mlp=torch.nonzero(tensors["mlp"]).flatten().tolist(),
    )


def check_skip_set(skip: SkipSet, num_layers: int) -> SkipSet:
    bad = sorted(i for i in skip.attn | skip.mlp if not 0 <= i < num_layers)
    if bad:
        raise ValueError(
            f"skip set names layer(s) {bad} but the model has {num_layers} layers (0..{num_layers - 1}); "
            "fix method.skip_attn / method.skip_mlp or search a skip set for this model"
        )
    return skip


def load_skip_set(path: str | Path, model: LayeredModel, tokenizer=None) -> SkipSet:
    """Read a ``skip_set`` artefact, checking it was searched for ``model``.

    The model's fingerprint (config + vocabulary), layer count and hidden size are checked.
    """
    from selfspec.store.artefacts import load_artefact

    art = load_artefact(path, "skip_set", model)
    return skip_set_from_tensors(art.tensors, model.num_layers, str(path))


def resolve_skip_set(cfg, model: LayeredModel, tokenizer=None) -> SkipSet:
    """The skip set a method config names: inline lists, an artefact path, or the default artefact.

    ``skip_attn`` / ``skip_mlp`` (lists of layer indices) win when either is given; else
    ``skip_set`` (a path) is loaded; else ``default_artefact_dir("skip_set", model, task)``,
    falling back to the task-mix artefact ``.../<model>``.
    """
    attn, mlp = cfg.get("skip_attn"), cfg.get("skip_mlp")
    if attn is not None or mlp is not None:
        return check_skip_set(SkipSet.of(attn or (), mlp or ()), model.num_layers)
    return check_skip_set(load_skip_set(skip_set_path(cfg, model), model, tokenizer), model.num_layers)


def skip_set_path(cfg, model: LayeredModel) -> Path | None:
    """The skip-set artefact a config reads (None for inline ``skip_attn`` / ``skip_mlp`` lists)."""
    from selfspec.store.artefacts import default_artefact_dir

    if cfg.get("skip_attn") is not None or cfg.get("skip_mlp") is not None:
        return None
    path = cfg.get("skip_set")
    if path is None:
        task = cfg.get("task")
        candidates = [default_artefact_dir("skip_set", model.name, task)] if task else []
        candidates.append(default_artefact_dir("skip_set", model.name))
        path = next((p for p in candidates if (p / "meta.json").exists()), None)
        if path is None:
            raise FileNotFoundError(
                f"no skip set for model {model.name!r} (looked in {', '.join(map(str, candidates))}); "
                f"search one with `make search-skips MODEL={model.name}` (python -m selfspec.train job=skips), "
                "or set method.skip_set=<path> or method.skip_attn=[...] method.skip_mlp=[...]"
            )
    return Path(path)


class SkipSetDrafter(Drafter):
    """Draft & Verify's drafter (module docstring, steps 1-2): the model itself with the sublayers
    of a skip set left out, until ``max_draft`` drafts, the draft-stop rule's threshold or (with
    ``eos_draft: stop``) an EOS draft; scored by the default full pass. ``decoding``: the checked
    decoding settings (:class:`DecodingOptions`); ``draft_vocab``: the draft head's truncated
    vocabulary (None = the full head); ``eos``: the tokens that end a generation."""

    def __init__(self, model: LayeredModel, skip_set: SkipSet, decoding: DecodingOptions, *, draft_vocab=None,
                 eos: frozenset[int] = frozenset(), profile=None) -> None:
        """``profile``: the run's cost profile (None without one), which prices the lookup's guesses
        where ``draft_ngram`` is set with ``draft_schedule: priced``."""
        from selfspec.decoding.ngram import ContextDrafter

        self.model = model
        self.skip_set = check_skip_set(skip_set, model.num_layers)
        self.decoding = decoding
        self.max_draft = decoding.max_draft
        self.draft_vocab = draft_vocab
        self.eos = frozenset(eos)
        self.profile = profile
        self.reset_draft_stop()
        if decoding.draft_ngram is not None:
            self.lookup = ContextDrafter(model, decoding.draft_ngram, profile=profile, label="draft_ngram")

    # --- draft stop (§3.4; the rules live in selfspec.decoding.draft_exit) -------------------
    def reset_draft_stop(self) -> None:
        """A fresh draft-stop rule: the threshold back at its start (γ0), the acceptance-rate EMA's too."""
        self.draft_stop: DraftStop = new_rule(self.decoding.draft_stop)

    @property
    def threshold(self) -> float:
        """The current draft-stop threshold (0 when drafting always runs to K)."""
        return self.draft_stop.threshold()

    # --- the proposer ------------------------------------------------------------------------
    def plan(self, state: DecodeState) -> Plan:
        return Plan(self.max_draft)

    def draft_room(self, limit: int, budget: int) -> int:
        """The chain step's room for drafts; with ``last_token: draft`` at least one draft, even
        with one token of budget left (the authors' loop tests the budget after each draft)."""
        room = super().draft_room(limit, budget)
        return max(room, 1) if self.decoding.last_token == "draft" else room

    def draft_logits(self, h: torch.Tensor, ledger=None, joins=None, vocab=None) -> torch.Tensor:
        """The draft distribution's logits ``[rows, V]``: the model's own head (of the draft's weights) on
        every row of the skip-set pass's states ``h`` ``[1, rows, d]``, truncated to the generation's draft
        vocabulary ``vocab`` (``DecodeState.vocab``; None: the full head) when ``draft_vocab`` is set
        (:func:`selfspec.models.heads.draft_logits`); recorded in ``ledger`` when given; ``joins``: the
        generation's batch (the head product may yield to its other sequences)."""
        return draft_logits(self.model, h[0], vocab, ledger, self.decoding.draft_weights, joins)

    def skips(self, state: DecodeState) -> SkipSet:
        """The skip set the step drafts with: the searched one, fixed (KnapSpec and CLaSp choose
        theirs while decoding, :mod:`selfspec.decoding.knapspec`)."""
        return self.skip_set

    def propose(self, state: DecodeState, plan: Plan, k_max: int) -> Draft:
        """§3.2-3.4: draft with the skip set until K, the threshold or, with ``eos_draft: stop``, an
        EOS draft (the skip-set pass writes scratch K/V past the committed tokens; :meth:`score`
        drops them). With a :attr:`lookup` (``draft_ngram``), a pass may take the lookup's guesses of the
        next tokens as rows after the last draft and keep those the drafter itself would have drafted
        (:meth:`~selfspec.decoding.chain.Draft.extend`): the same draft, in fewer passes of more rows."""
        model = self.model
        draft = Draft()
        ids = torch.empty((1, 1), dtype=torch.long, device=model.device)
        eos = self.eos if self.decoding.eos_draft == "stop" else frozenset()
        skip = self.skips(state)
        token, p = state.pending, Pass(skip=skip, weights=self.decoding.draft_weights)
        while len(draft) < k_max:
            j = len(draft)
            guesses = self.guesses(state, draft, k_max - j - 1, skip)
            rows = ids.fill_(token) if not guesses else torch.tensor([[token, *guesses]], device=model.device)
            h = model.forward(rows, state.cache, p, start=state.n_cached + j, ledger=state.ledger, joins=state.joins)
            logits = self.draft_logits(h, state.ledger, state.joins, state.vocab)
            if guesses:
                kept, more = draft.extend(guesses, logits, state, self.threshold, eos)
                self.lookup.learn(state, state.lookup, len(guesses), kept)
                state.trace_step.guessed += kept
                if more and kept < len(guesses):  # the rejected guesses' K/V, past the draft, go
                    state.cache.truncate(state.n_cached + len(draft))
            else:
                more = draft.add(logits[0], state, self.threshold, eos)
            if not more:
                break
            token = draft.tokens[-1]
        return draft

    def guesses(self, state: DecodeState, draft: Draft, room: int, skip: SkipSet) -> list[int]:
        """The :attr:`lookup`'s guesses of the tokens after ``draft`` (at most ``room``; none without a
        lookup): an n-gram of the committed tokens and the draft that occurred before, and what followed it,
        as many as its schedule says (``priced``: weighed against this drafter's pass of that many rows)."""
        if self.lookup is None or room < 1:
            return []
        context = state.n_cached + len(draft)
        vocab = state.vocab.size if state.vocab is not None else None
        return self.lookup.guess(state.lookup, [*state.tokens, *draft.tokens], room,
                                 lambda rows: self.lookup.pass_cost(rows, context, weights=self.decoding.draft_weights
                                                                    or "", skip=skip, vocab=vocab),
                                 indexed=len(state.tokens))


class DraftVerify(ChainDecoder):
    """Self-speculative decoding with a skip set and an adaptive draft-exit threshold: a chain of
    :class:`SkipSetDrafter`."""

    name = "draft_verify"
    title = "Draft & Verify"
    lossless = True
    Options = DraftVerifyOptions

    def __init__(self, model: LayeredModel, skip_set: SkipSet, decoding: DecodingOptions, **common) -> None:
        """``decoding``: the checked decoding settings (:class:`DecodingOptions`, the method's options)."""
        super().__init__(model, **common)
        self.drafter = self.new_drafter(skip_set, decoding)
        self.lookahead = self.drafter.max_draft  # drafted K/V are written past the committed tokens

    def new_drafter(self, skip_set: SkipSet, decoding: DecodingOptions) -> SkipSetDrafter:
        """The method's drafter (KnapSpec and CLaSp: one whose skip set is searched)."""
        return SkipSetDrafter(self.model, skip_set, decoding, draft_vocab=self.draft_vocab, eos=self.eos_token_ids,
                              profile=self.profile)

    @classmethod
    def needs_profile(cls, options: DraftVerifyOptions) -> tuple[str, str] | None:
        """``draft_ngram.draft_schedule: priced`` prices the lookup's guesses with the run's profile (and
        drafts from the context first may, :meth:`Decoder.needs_profile`)."""
        if options.draft_ngram is not None and options.draft_ngram.draft_schedule == "priced":
            return "draft_ngram.draft_schedule=priced", PRICED_NEEDS_PROFILE
        return super().needs_profile(options)

    @classmethod
    def check_run(cls, options: DraftVerifyOptions, layers: int, budget: int | None = None) -> None:
        """Inline ``skip_attn`` / ``skip_mlp`` name layers of the model (an artefact's skip set is
        checked against the model when it is read)."""
        for name in ("skip_attn", "skip_mlp"):
            value = getattr(options, name)
            if value is not None:
                checks.listed(checks.integer, f"method.{name}", value, 0, layers - 1,
                              why=f"layer indices; the model has {layers} layers")

    @classmethod
    def from_config(cls, model: LayeredModel, options: DraftVerifyOptions, **common) -> "DraftVerify":
        where = options.values()
        skip = resolve_skip_set(where, model, common.get("tokenizer"))
        return cls(model, skip, options, draft_vocab=build_draft_vocab(model, options),
                   reads={"skip_set": skip_set_path(where, model)}, **common)

    def finish(self, state: DecodeState) -> None:
        state.stats.setdefault("draft_stops", 0)
        state.stats["threshold"] = self.drafter.threshold

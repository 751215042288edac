"""AdaDecode: adaptive layer parallelism with early predictions, deferral and verification.

Follows AdaDecode (ICML 2025, arXiv 2506.03700):

* §3.1 — lightweight heads ``E_l = E* · T_l`` at intermediate layers
  (:class:`selfspec.models.heads.IntermediateHeads`).
* §3.2 **adaptive layer parallelism** — a token runs layer by layer; at a layer with a head,
  if the head's top probability exceeds ``threshold`` (the paper's γ) the next token is
  *predicted early* and its pass starts at once. The skipped deeper layers of the early token are **deferred**: when a
  later pass reaches a layer, every position still owed that layer joins it, so each layer is
  one batched call over all owed positions (the layer cache of each layer grows at its own
  length; positions owed a layer are always a contiguous tail, so the queue ``P`` of the paper
  is a stack of hidden-state segments, one per depth).
* §3.3 **verification and rollback** — when a pass reaches the final layer, the final
  distributions of all owed positions exist at once; the early predictions are verified with
  the shared chain step's :func:`~selfspec.decoding.chain.settle` (greedy: exact match; sampling:
  the modified rejection sampling :func:`~selfspec.decoding.sampling.speculative_verify`: accept
  with ``min(1, p*/p_l)``, else resample from ``normalize(max(0, p* − p_l))``). On a rejection
  every layer's cache is cut back to the rejected position (O(1)) and decoding continues from
  the corrected token.

**Why AdaDecode is no plain chain** (:class:`~selfspec.decoding.chain.ChainDecoder`): a chain
drafter proposes all drafts, then the target scores them in one pass. AdaDecode's drafts come out
*of* the target's own passes — a token's pass stops at the first confident head, the next token's
pass starts, and the deferred deep layers of earlier tokens run batched inside later passes — so
proposing and scoring interleave and cannot be split into ``propose`` / ``score``. What it shares
with every chain method: the early prediction and its confidence
(:func:`~selfspec.decoding.chain.pick`: the head's unwarped top probability, a sample of the
warped distribution under sampling), the :class:`~selfspec.decoding.chain.Draft` it collects,
and verification, rollback and the step statistics (:func:`~selfspec.decoding.chain.settle`,
which calls :meth:`AdaDecode.update` for AdaDecode's own counts). Its threshold is no draft-stop
rule either: a prediction at or below it is not drafted at all (the pass goes deeper), so the
``draft_stop`` sub-config does not apply.

Mapping onto the shared loop: one :meth:`AdaDecode.step` = the early-exit passes up to and
including one full pass; it returns only *verified* tokens (accepted early predictions and the
final layer's own next token), so EOS / stop strings / budget are applied exactly. Unverified
early tokens are method state inside the step. After the step every layer holds all committed
tokens but the pending one (the full pass completes every deferred layer), so the shared
cache invariant holds between steps; within a step deeper layers lag.

Statistics (``Generation.stats``): ``exit_layer_<l>`` early predictions made at head ``l``
(``full_passes`` counts the passes reaching the final layer, prefill included);
``early_predictions``, ``rejected`` (the first failing prediction of a step), ``discarded``
(predictions after it, never verified); ``early_prediction_rate`` = accepted early tokens /
generated tokens; ``rejection_rate`` = rejected / verified predictions (the paper's Fig. of
rejection rate); ``tokens_per_full_pass`` = generated tokens / full passes (equals ``tau``).

``adadecode_noverify`` (§4.3 ablation "w/o verification", lossy) commits early predictions
unchecked; its consistency ratio against vanilla is what the ablation reports.

**Beyond the paper** (``adadecode``'s defaults; ``adadecode_paper`` turns both off, and
tests/test_reference_adadecode.py checks it step for step against the paper's
Algorithm 1): ``max_early`` bounds the unverified early predictions of one step (the paper
names no bound; a rejection then wastes at most that many passes), and without ``early_eos`` an
end-of-sequence token is never predicted early (the pass goes deeper instead: nothing after an
EOS can be committed, so the passes the next tokens would start are wasted). Both leave the
output unchanged and change only how the steps are cut. There is no ``draft_weights``: the deferred deep layers run on
from each early token's lower-layer states, which must therefore be the target's; AdaDecode's heads draft
over a quantised copy as early exit's or DEL's exit heads (``exit_head: heads``, ``draft_weights``:
:mod:`selfspec.decoding.early_exit`). Every step also stops predicting early
at the token budget (the shared loop's budget; the paper's algorithm has none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from selfspec.config import checks
from selfspec.config.options import key, nullable
from selfspec.decoding.base import DecodeState, Decoder
from selfspec.decoding.chain import Draft, context_step, pick, settle
from selfspec.decoding.part_options import ContextFirst, Gated
from selfspec.models.heads import KINDS as HEAD_KINDS
from selfspec.models.heads import (DraftVocabOptions, IntermediateHeads, build_draft_vocab, default_layers, find_heads,
                                   load_heads)
from selfspec.store.artefacts import artefact_option
from selfspec.models.layered import Pass, Rope
from selfspec.models.ledger import phase


def exit_layers_option(name: str, value) -> list[int] | str | None:
    """``exit_layers``: null (every head), a list of head layers, or ``middle``."""
    if value == "middle":
        return value
    return checks.optional(checks.integers, name, value, distinct=True, why="null = every head, or middle")


@dataclass(frozen=True)
class AdaDecodeOptions(DraftVocabOptions, Gated, ContextFirst):
    """Keys (conf/method/adadecode*.yaml): ``threshold`` (the paper's γ: exit when a head's top
    probability exceeds it, so in [0, 1); the old key ``gamma`` is refused, naming it),
    ``max_early`` (>= 1, or null = no bound), ``early_eos`` (true / false), ``exit_layers``
    (:func:`exit_layers_option`), ``head_kind`` (``linear`` / ``full``: load the trained artefact
    of that kind; ``lm_head``: untrained final norm + head, the "w/ original LM head" ablation),
    ``heads_dir`` (null = the default artefact directory, see
    :func:`selfspec.models.heads.find_heads`), ``heads_task`` (the data the heads were trained on:
    a task name or ``mixed``), ``layers`` (``lm_head`` only; null = three evenly spaced), the
    draft vocabulary's keys and the parts' (``never_slower``, ``ngram``)."""

    renamed = {"gamma": "threshold"}

    head_kind: str = key(checks.choice, HEAD_KINDS)
    exit_layers: list[int] | str | None = key(exit_layers_option)
    threshold: float = key(checks.probability, high_open=True,
                           why="exit threshold on a head's top probability: at 1 or more no token ever exits")
    max_early: int | None = key(nullable(checks.integer), 1,
                                why="unverified early tokens per full pass (null = no bound, the paper); 0 would "
                                    "never exit")
    early_eos: bool = key(checks.flag, why="true = an end-of-sequence token may be predicted early (the paper)")
    heads_dir: Path | None = key(artefact_option, "heads")
    heads_task: str | None = key(nullable(checks.text))
    layers: list[int] | None = key(nullable(checks.integers), distinct=True)

    def validate(self, prefix: str) -> None:
        if self.layers is not None and self.head_kind != "lm_head":
            raise checks.refuse(f"{prefix}.layers", self.layers, f"set only with head_kind=lm_head; {self.head_kind} "
                                "heads sit at the layers of their artefact (choose among them with exit_layers)")


@dataclass
class _Segment:
    """Hidden states of consecutive positions that have run ``depth`` layers (owed the rest)."""

    depth: int
    h: torch.Tensor  # [1, n, d]


@dataclass
class _StepState:
    """What one step carries between its passes: the unverified early tokens and the queue."""

    base: int  # position of the pending token (= committed tokens in every layer's cache)
    cap: int  # most early tokens this step may predict
    rope: Rope  # rotary (cos, sin) for positions base .. base + max_early
    draft: Draft = field(default_factory=Draft)
    exit_layers: list[int] = field(default_factory=list)
    stack: list[_Segment] = field(default_factory=list)


class AdaDecode(Decoder):
    """AdaDecode decoding (see module docstring). ``heads``: the intermediate heads; ``threshold``:
    exit threshold on the head's top probability (the paper's γ); ``max_early``: most unverified
    early tokens per step (bounds the work a rejection can waste; None = no bound, the paper);
    ``exit_layers``: heads used for exits (default all); ``early_eos``: whether an early prediction
    may be an end-of-sequence token (the paper)."""

    name = "adadecode"
    title = "AdaDecode"
    lossless = True
    verify = True
    Options = AdaDecodeOptions

    def __init__(
        self,
        model,
        heads: IntermediateHeads,
        threshold: float,
        max_early: int | None,
        exit_layers,
        early_eos: bool,
        **common,
    ) -> None:
        super().__init__(model, reads={"heads": heads.path}, **common)
        layers = list(heads.layers) if exit_layers is None else [int(i) for i in exit_layers]
        missing = [i for i in layers if i not in heads.layers]
        if missing:
            raise ValueError(
                f"adadecode exit_layers {layers}: layers {missing} have no head (the head set has {heads.layers}); "
                "choose from those or retrain the heads"
            )
        self.heads = heads
        self.threshold = float(threshold)
        self.max_early = None if max_early is None else int(max_early)
        self.exit_layers = frozenset(layers)
        self.early_eos = bool(early_eos)

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def check_run(cls, options: AdaDecodeOptions, layers: int, budget: int | None = None) -> None:
        """``layers`` and ``exit_layers``, where they list layers, name layers below the last."""
        for name in ("layers", "exit_layers"):
            value = getattr(options, name)
            if isinstance(value, list):
                checks.listed(checks.integer, f"method.{name}", value, 0, layers - 2,
                              why=f"head layers; the model has {layers}, the last is the final head itself")

    @classmethod
    def from_config(cls, model, options: AdaDecodeOptions, **common) -> "AdaDecode":
        """Load (or build) the heads ``options`` name and check them against the model."""
        kind = options.head_kind
        vocab = build_draft_vocab(model, options)
        if kind == "lm_head":
            layers = options.layers or default_layers(model.num_layers)
            heads = IntermediateHeads.identity(model, layers, kind="lm_head", vocab=vocab)
        else:
            path = find_heads(model.name, options.heads_dir, options.heads_task, kind)
            heads = load_heads(path, model, vocab)
            if heads.kind != kind:
                raise ValueError(f"heads artefact {path} holds {heads.kind!r} heads but method.head_kind={kind!r}")
        exit_layers = options.exit_layers
        if exit_layers == "middle":
            exit_layers = [heads.layers[len(heads.layers) // 2]]
        return cls(model, heads, threshold=options.threshold, max_early=options.max_early,
                   exit_layers=exit_layers, early_eos=options.early_eos, draft_vocab=heads.vocab, **common)

    # --- decoding --------------------------------------------------------------------------
    def new_step(self, state: DecodeState, budget: int) -> _StepState:
        base = state.n_cached
        cap = max(0, budget - 1 if self.max_early is None else min(budget - 1, self.max_early))
        rope = self.model.rope(self.model.positions(base, cap + 1))
        return _StepState(base, cap, rope)

    def step(self, state: DecodeState, budget: int) -> list[int]:
        new = context_step(self, state, budget)  # drafts from the context first (``ngram``)
        if new is not None:
            return new
        ss = self.new_step(state, budget)
        token = state.pending
        while True:
            # a token's pass drafts until it reaches the last layer; that pass is the verification
            with phase(state.ledger, "draft") as p:
                logits = self.advance(state, ss, token)
                if logits is not None:
                    p.relabel("verify" if len(ss.draft) else "plain")
            if logits is None:  # early prediction: start the next token's pass
                token = ss.draft.tokens[-1]
                continue
            return self.verify_step(state, ss, logits)

    def verify_step(self, state: DecodeState, ss: _StepState, logits: torch.Tensor) -> list[int]:
        """§3.3: verify the early tokens against the final logits ``[k + 1, V]`` and roll back
        (the shared :func:`~selfspec.decoding.chain.settle`); returns the verified tokens."""
        assert logits.shape[0] == len(ss.draft) + 1, "every owed position must reach the final layer"
        state.example = ss  # the step's state, read by update()
        return settle(state, ss.draft, logits, self, verify=self.verify)

    def advance(self, state: DecodeState, ss: _StepState, token: int) -> torch.Tensor | None:
        """One pass of ``token`` (at position ``base + len(drafts)``) through the layers.

        Deferred positions join at the layer they owe. Returns the final logits of every owed
        position ``[k + 1, V]`` if the pass reaches the end, or None after an early prediction
        (appended to ``ss.draft``).
        """
        m, cache = self.model, state.cache
        pos = ss.base + len(ss.draft)
        allow_exit = len(ss.draft) < ss.cap
        h = m.embed(torch.tensor([[token]], device=m.device))
        j, last = 0, m.num_layers - 1
        while j <= last:
            if ss.stack and ss.stack[-1].depth == j:  # owed positions join this layer
                joined = []
                while ss.stack and ss.stack[-1].depth == j:
                    joined.append(ss.stack.pop().h)
                h = torch.cat(joined[::-1] + [h], dim=1)
            # one walk up to the next layer where something happens: an exit head is read after it, or
            # owed positions join after it (a walk per layer cost ~0.1 ms of calls each on 2 CPU cores)
            stop = last
            if allow_exit:
                stop = min([stop] + [e for e in self.exit_layers if e >= j])
            if ss.stack and ss.stack[-1].depth > j:
                stop = min(stop, ss.stack[-1].depth - 1)
            n = h.shape[1]
            start = pos + 1 - n
            h = m.forward(h, cache, Pass(range(j, stop + 1)), start=start,
                          rope=ss.rope.rows(start - ss.base, pos + 1 - ss.base), ledger=state.ledger, joins=state.joins)
            if allow_exit and stop in self.exit_layers:
                if self._early(state, ss, stop, h[:, -1]):
                    ss.stack.append(_Segment(stop + 1, h))
                    ss.exit_layers.append(stop)
                    return None
            j = stop + 1
        return m.logits(h[0], state.ledger, state.joins)

    def draft_logits(self, layer: int, h: torch.Tensor, ledger=None, joins=None, vocab=None) -> torch.Tensor:
        """The head's logits at ``layer`` for the last position's state ``h``, over the generation's draft
        vocabulary ``vocab`` (``DecodeState.vocab``; None: the heads' own); recorded in ``ledger`` when given;
        ``joins``: the generation's batch, whose other sequences the head product may yield to."""
        return self.heads.logits(layer, h, ledger, joins, vocab=vocab)[0]

    def _early(self, state: DecodeState, ss: _StepState, layer: int, h_last: torch.Tensor) -> bool:
        """§3.2: predict early (append to ``ss.draft``) if the head's top probability exceeds the
        threshold and, unless ``early_eos``, the token is not EOS."""
        token, conf, q = pick(self.draft_logits(layer, h_last, state.ledger, state.joins, state.vocab), state)
        if conf <= self.threshold or (not self.early_eos and token in self.eos_token_ids):
            return False
        ss.draft.append(token, conf, q)
        return True

    def update(self, state: DecodeState, draft: Draft, accepted: int, committed: list[int]) -> None:
        """AdaDecode's counts after :func:`~selfspec.decoding.chain.settle` verified the step."""
        k = len(draft)
        state.trace_step.exits = tuple(state.example.exit_layers)
        for layer in state.example.exit_layers:
            state.count(f"exit_layer_{layer}")
        state.count("full_passes")
        state.count("early_predictions", k)
        state.count("accepted_early", accepted)
        if accepted < k:
            state.count("rejected")
            state.count("discarded", k - accepted - 1)

    def controller(self, state: DecodeState, draft: Draft) -> None:
        """AdaDecode's threshold is fixed: no controller state for the step trace."""
        return None

    def speculated(self, state: DecodeState) -> bool:
        """An AdaDecode step checks exit heads even when none fires: its cost is speculation's."""
        return True

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        for stat in ("full_passes", "early_predictions", "accepted_early", "rejected", "discarded"):
            state.stats[stat] = 0
        state.stats["full_passes"] = 1  # prefill

    def finish(self, state: DecodeState) -> None:
        s = state.stats
        generated = len(state.tokens) - state.prompt_len
        # a context draft's verification and a step the gate made plain are full passes too
        s["full_passes"] += state.steps_from("context") + state.gated_steps()
        verified = s["accepted_early"] + s["rejected"]
        s["early_prediction_rate"] = s["accepted_early"] / generated if generated else 0.0
        s["rejection_rate"] = s["rejected"] / verified if verified else 0.0
        s["tokens_per_full_pass"] = generated / s["full_passes"]


class AdaDecodeNoVerify(AdaDecode):
    """Ablation "w/o verification" (AdaDecode §4.3): early predictions are committed unchecked.

    Lossy: its output may differ from vanilla; report the consistency ratio."""

    name = "adadecode_noverify"
    title = "AdaDecode w/o verification"
    lossless = False
    verify = False

"""Early-exit self-speculative decoding (LayerSkip) and its DEL controller (COLM 2025).

Both are drafters of the shared chain step (:mod:`selfspec.decoding.chain`): this module writes
how they draft and score, the chain step verifies, rolls back and updates.

**Early exit** (``method=early_exit``; LayerSkip self-speculation, DEL §2-3). Exit layer ``ℓ``
(0-based, the convention of :mod:`selfspec.models.heads`: the head at ``ℓ`` reads the hidden state
*after* layer ``ℓ``; LayerSkip's ``E`` is ``ℓ + 1``). One round:

1. **draft** (:meth:`ExitDrafter.propose`) — the pending token ``x_0`` and then each draft ``d_i``
   runs layers ``0..ℓ`` alone (their K/V go into the shared layer cache) and the exit head turns
   the layer-``ℓ`` state into the next draft; at most ``max_draft`` drafts (the papers' speculation
   length γ), fewer when the draft-stop rule fires (the draft below the threshold is still
   verified, Draft & Verify §3.4) or a draft is EOS;
2. **exit-query cache** (:meth:`ExitDrafter.score`) — the layer-``ℓ`` states of ``x_0 … x_k`` are
   kept, so verification runs only layers ``ℓ+1..L-1`` for them; layers ``0..ℓ`` keep the draft
   K/V, which are exact (they *are* the full model's first layers). The last draft ``d_k`` has
   not been through layers ``0..ℓ`` when it is drafted: scoring runs them for it first;
3. **verify** — ``[x_0, d_1 … d_k]`` through the upper layers in one pass, then the shared
   :func:`~selfspec.decoding.chain.settle` (greedy: identical to vanilla; sampling: speculative
   sampling, the target distribution);
4. **rollback** — every layer is truncated after the accepted tokens (O(1)).

The first step (``prefill``): ``full`` — the prompt runs every layer and commits one token, as
every method's prefill does; ``draft`` — LayerSkip's code: the prompt runs layers ``0..ℓ`` only
and the first round drafts from its last state (the prompt is that round's ``x_0``, its
layer-``ℓ`` states join the exit-query cache, verification runs the upper layers over the prompt
and the drafts in one pass), so the first generated token is a draft too and one step fewer is
taken (``early_exit_paper``; docs/design.md, "Fidelity to the authors' code").

Exit heads (``exit_head``): ``lm_head`` — the model's own final norm + LM head, as LayerSkip
checkpoints (``model=layerskip-llama3-8b``) expect; ``heads`` — the AdaDecode heads trained by
``job=heads`` (:func:`selfspec.models.heads.load_heads`), so models without LayerSkip training draft
well too. Draft-stop rules (``draft_stop``): none (fixed ``(ℓ, γ)``, LayerSkip's baseline), a
static confidence threshold, or Draft & Verify's adaptive threshold (Draft & Verify §3.3), the
"DV" baseline of DEL's Table 1.

**DEL** (``method=del``; DEL §4). After each verification, *shadow tokens*: every candidate
exit layer's head is applied to the hidden states of the verified positions (layers ``≤ ℓ``
come from drafting, layers ``> ℓ`` from verification, so nothing is recomputed) and compared
with the committed tokens. Exponentially decayed (``ω``) statistics per layer give the
acceptance rate ``α_ℓ`` and the mean confidence of matched / mismatched shadow tokens.
Before each round the controller picks ``(ℓ, γ) = argmax TPL`` (DEL §4.1, tokens per layer;
``γ`` ranges over ``min_draft..max_draft``) and, under ``draft_stop: {rule: dynamic}``, stops
drafting when a draft's confidence falls below the per-layer dynamic threshold
``(mean conf matched + mean conf mismatched) / 2`` (DEL §4.2; the paper's ``τ_ℓ``). The
statistics are per example (:class:`EarlyExitExample`, created by ``begin``). TPL's denominator
(``cost_model``): ``layers`` — DEL's count, ``γ·(ℓ+1) + L - ℓ - 1`` (:func:`layer_count`,
``del_paper``); ``parameters`` — also the last draft's lower pass and the heads
(:func:`round_cost`); ``measured`` — that, priced by the run's cost profile
(:class:`~selfspec.measure.profile.Profile`: ``v(γ+1)`` and the exit head in layers; ``del``), so the
controller's choices are those of the profile, step for step, whatever the machine's load. The step trace's ``controller`` holds
the round's plan and the per-layer statistics after it (:meth:`DELDrafter.controller`).

**Exits over a quantised copy** (``draft_weights``: ``int8`` or ``int4``, beyond the papers; ML-SpecQD,
arXiv 2503.13565 §3, drafts over a quantised copy of the target): the drafts run layers ``0..ℓ`` and the
exit head over the copy of the weights (:mod:`selfspec.models.quantised`; a trained linear head's ``d×d``
product stays as trained, the LM head it feeds is the copy's; a ``full`` head is its own weight and stays
as trained). Their layer-``ℓ`` states and lower K/V are then the copy's, not the target's, so step 2's
exit-query cache does not hold: verification runs every layer over ``x_0, d_1 … d_k`` (the chain's
full-pass verification, which rewrites the drafted K/V at the target's precision) and keeps the
candidate layers' states from that pass for DEL's shadow tokens, which are scored with the drafts' own
head. TPL's round cost is then :func:`round_cost`'s quantised form. ``prefill: draft`` (its first round
continues from the prompt's layer-``ℓ`` states) and DEL's layer count (``cost_model: layers``, which counts
the target's layers) are refused with a copy, naming the key.

Statistics: ``exit_layer_mean`` and ``draft_len_mean`` (drafts per round), ``draft_stops``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from selfspec.config import checks
from selfspec.config.options import Ref, key, nullable
from selfspec.decoding.base import DecodeState
from selfspec.decoding.chain import ChainDecoder, Draft, Drafter, Plan
from selfspec.decoding.draft_exit import DraftStop, DynamicThreshold, StopOptions, draft_stop_option, new_rule
from selfspec.decoding.part_options import ContextFirst, Gated, QuantisedDraft
from selfspec.decoding.sampling import argmax, select
from selfspec.models.heads import DraftVocabOptions, build_draft_vocab
from selfspec.models.layered import LayeredModel, Pass
from selfspec.models.ledger import HeadOp, LinearOp, phase
from selfspec.models.quantised import head_format
from selfspec.store.artefacts import artefact_option

EXIT_HEADS = ("lm_head", "heads")
#: where DEL's TPL takes its costs (:class:`DEL`)
COST_MODELS = ("layers", "measured", "parameters")
#: the first step: ``full`` (selfspec's prefill) or ``draft`` (LayerSkip's code: drafts from the prompt)
PREFILLS = ("full", "draft")


# --- exit heads ------------------------------------------------------------------------------
def build_exit_heads(model: LayeredModel, exit_head: str, heads_path, layers, data: str | None = None,
                     vocab=None, last: bool = False):
    """The :class:`~selfspec.models.heads.IntermediateHeads` a method config asks for (scoring the draft
    vocabulary ``vocab``'s rows where one is given; ``last``: the last layer may be an exit, over a
    quantised copy, :func:`top_exit`).

    ``lm_head``: parameter-free heads (final norm + LM head) at ``layers``; ``heads``: the
    trained artefact at ``heads_path`` (null = the one ``job=heads`` wrote for this model and the
    task ``data``, else its mixed-domain heads: :func:`selfspec.models.heads.find_heads`), checked
    against the model's fingerprint.
    """
    from selfspec.models.heads import IntermediateHeads, find_heads, load_heads

    if exit_head == "lm_head":  # over a quantised copy the last layer is an exit too (its final head is the copy's)
        return IntermediateHeads(model, layers, "lm_head", vocab=vocab, last=last)
    return load_heads(find_heads(model.name, heads_path, data), model, vocab)


def exit_heads(model: LayeredModel, options: "ExitHeadOptions", layers):
    """:func:`build_exit_heads` for a method's options, with its draft vocabulary (``method.draft_vocab``)."""
    return build_exit_heads(model, options.exit_head, options.heads, layers, options.heads_task,
                            build_draft_vocab(model, options), last=options.draft_weights is not None)


@dataclass(frozen=True)
class ExitHeadOptions(DraftVocabOptions, Gated, ContextFirst, QuantisedDraft):
    """The keys early exit and DEL share: ``exit_head``, ``heads`` (a heads artefact,
    ``exit_head=heads`` only), ``heads_task``, ``draft_weights`` (the drafts' lower layers and head over a
    quantised copy, module docstring), the draft vocabulary's and the parts'."""

    exit_head: str = key(checks.choice, EXIT_HEADS)
    heads: Path | None = key(artefact_option, "heads")
    heads_task: str | None = key(nullable(checks.text))

    def validate(self, prefix: str) -> None:
        if self.heads is not None and self.exit_head != "heads":
            raise checks.refuse(f"{prefix}.heads", self.heads, "set only with exit_head=heads")


@dataclass(frozen=True)
class EarlyExitOptions(ExitHeadOptions):
    """Keys (conf/method/early_exit*.yaml): ``exit_layer`` ℓ (>= 0; below the last layer, checked
    with the model), ``max_draft`` (drafts per round, >= 1; the papers' speculation length γ),
    the exit head's (:class:`ExitHeadOptions`), ``draft_stop``
    (:func:`~selfspec.decoding.draft_exit.draft_stop_option`) and ``prefill`` (``full`` or
    ``draft``, module docstring). The old key ``gamma`` is refused, naming ``max_draft``."""

    renamed = {"gamma": "max_draft"}

    exit_layer: int = key(checks.integer, 0, why="0-based exit layer ℓ")
    max_draft: int = key(checks.integer, 1, why="speculation length γ: most drafts per round")
    draft_stop: StopOptions | None = key(draft_stop_option)
    prefill: str = key(checks.choice, PREFILLS, why="full: a full pass commits the first token; draft: the first "
                       "round drafts from the prompt (LayerSkip's code)")

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        if self.prefill == "draft" and self.draft_weights is not None:
            raise checks.refuse(f"{prefix}.prefill", self.prefill, f"set full with {prefix}.draft_weights="
                                f"{self.draft_weights}", "prefill=draft verifies from the prompt's layer-ℓ states, "
                                "which a quantised copy's lower layers do not give exactly")


@dataclass(frozen=True)
class DELOptions(ExitHeadOptions):
    """Keys (conf/method/del*.yaml): the exit head's (:class:`ExitHeadOptions`),
    ``candidate_layers`` (``exit_head=lm_head`` only; null = all but the last), ``max_draft`` >= 1
    and ``min_draft`` in [0, max_draft] (the speculation lengths γ TPL chooses from), ``omega`` in
    (0, 1), ``draft_stop`` (:func:`~selfspec.decoding.draft_exit.draft_stop_option` with DEL's
    own rule ``{rule: dynamic}``, §4.2), ``prefill_shadow`` >= 1, ``shadow_rows`` (>= 1 or null),
    ``cost_model`` (``layers``: DEL's count, :func:`layer_count`; ``measured`` or ``parameters``:
    :func:`round_cost`) and ``head_cost`` (>= 0 or null; null under ``layers``). The old keys
    ``max_gamma``, ``min_gamma`` and ``dynamic_threshold`` are refused, naming the new."""

    renamed = {"max_gamma": "max_draft", "min_gamma": "min_draft",
               "dynamic_threshold": "{prefix}.draft_stop={rule: dynamic} (or null: never stop)"}

    candidate_layers: list[int] | None = key(nullable(checks.integers), distinct=True)
    max_draft: int = key(checks.integer, 1, why="largest speculation length")
    min_draft: int = key(checks.integer, 0, Ref("max_draft"),
                         why="smallest speculation length, at most max_draft={max_draft}")
    omega: float = key(checks.number, 0, 1, low_open=True, high_open=True, why="decay of the shadow-token statistics")
    draft_stop: StopOptions | None = key(draft_stop_option, dynamic=True)
    prefill_shadow: int = key(checks.integer, 1, why="prompt positions seeding the statistics")
    shadow_rows: int | None = key(nullable(checks.integer), 1, why="null = every verified position")
    cost_model: str = key(checks.choice, COST_MODELS, why="where TPL's costs come from")
    head_cost: float | None = key(nullable(checks.number), 0, why="null = from the cost model")

    def validate(self, prefix: str) -> None:
        super().validate(prefix)
        if self.candidate_layers is not None and self.exit_head == "heads":
            raise checks.refuse(f"{prefix}.candidate_layers", self.candidate_layers, "set only with exit_head=lm_head; "
                                "with trained heads the candidates are the layers that have a head (set "
                                "candidate_layers: null)")
        if self.draft_weights is not None and self.cost_model == "layers":
            raise checks.refuse(f"{prefix}.cost_model", self.cost_model, f"set measured or parameters with "
                                f"{prefix}.draft_weights={self.draft_weights}", "DEL's layer count prices every "
                                "draft layer as a layer of the target's weights")
        if self.head_cost is not None and self.cost_model == "layers":
            raise checks.refuse(f"{prefix}.head_cost", self.head_cost, "set only with cost_model=measured or "
                                "parameters; DEL's layer count (cost_model=layers) has no head term (set head_cost: "
                                "null)")


#: what ``cost_model: measured`` needs and the run lacks (refused before the model loads: evaluate's checks)
MEASURED_NEEDS_PROFILE = ("cost_model=measured prices TPL's costs with this machine's cost profile, and the run has "
                          "none: set profile=auto (evaluate finds or measures it) or a profile file, or give the "
                          "method cost_model=parameters (or layers)")


def top_exit(num_layers: int, weights: str | None) -> int:
    """The deepest exit layer: below the last, whose head is the final head itself; over a quantised copy
    (``weights``) the last too, whose exit is the copy's own final head (the full-depth draft of
    :mod:`selfspec.decoding.quant_draft`, here with DEL's exit and length chosen per round)."""
    return num_layers - (1 if weights is not None else 2)


def head_cost_in_layers(model: LayeredModel, heads, profile=None, context: int = 512, weights: str | None = None
                        ) -> float:
    """Cost of one exit-head application in units of one decoder layer (of the target's weights).

    DEL's TPL counts layers (memory-bound decoding loads each layer's weights once per pass);
    on a small model an LM head is several layers' worth (SmolLM2-135M: ~8), so it is counted.
    With ``profile`` (:class:`~selfspec.measure.profile.Profile`): the head's price on one row (a
    truncated draft vocabulary's at its size) over one layer's at ``context``, and a trained linear
    head's ``d×d`` product priced too; without: parameters read, the head's rows (a truncated draft
    head's) against a layer's, and ``d×d`` for a linear head. ``weights``: the head reads that quantised
    copy's LM head (an exit over a copy, module docstring; a ``full`` head is its own weight): its price,
    or its bytes' share of the target's.
    """
    vocab = heads.vocab  # a truncated draft head: its rows
    rows = vocab.size if vocab is not None else model.vocab_size
    own = heads.kind == "full"  # a trained head of its own, not a copy's
    if profile is not None:
        d, layer = model.hidden_size, profile.layer_cost(1, context)
        linear = profile.op(LinearOp("heads", 1, d, d)) / layer if heads.kind == "linear" else 0.0
        if weights is None or own:
            return profile.head_layers(rows, context) + linear
        return profile.op(HeadOp("heads", 1, rows, weights)) / layer + linear
    layer = model.layer_numel()
    cost = (rows * model.hidden_size if vocab is not None else model.lm_head_weight.numel()) / layer
    if weights is not None and not own:
        cost *= bytes_share(model, head_format(weights))  # the copy's head, in its own format
    if heads.kind == "linear":
        cost += model.hidden_size**2 / layer
    return cost


def bytes_share(model: LayeredModel, weights: str) -> float:
    """The bytes a quantised copy (format ``weights``) reads per weight, over the target's."""
    from selfspec.models.quantised import packed_bytes

    d = model.hidden_size
    return packed_bytes(weights, 1, d) / (d * model.dtype.itemsize)


def copy_rates(model: LayeredModel, heads, weights: str, profile=None, context: int = 512) -> tuple[float, float]:
    """``(layer, head)``: one draft layer and one exit head over the quantised copy ``weights``, in units
    of one target layer on one token at ``context`` (:func:`round_cost`'s ``copy``): priced by ``profile``
    where given, else by the bytes each reads (:func:`bytes_share`)."""
    head = head_cost_in_layers(model, heads, profile, context, weights)
    if profile is None:
        return bytes_share(model, weights), head
    quantised = profile.attention_cost(1, context, weights=weights) + profile.mlp_cost(1, weights)
    return quantised / profile.layer_cost(1, context), head


# --- the decoder -------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoundPlan(Plan):
    """One round's settings: most drafts, exit layer ``ℓ``, draft-stop threshold (0: never stop)."""

    exit_layer: int
    threshold: float


@dataclass
class EarlyExitExample:
    """Per-example state (:meth:`ExitDrafter.new_example`): the exit-query cache ``hq`` (layer-``ℓ``
    states of ``x_0 … x_k``), the kept candidate-layer states ``hs`` of the verified positions
    (DEL's shadow tokens) and DEL's :class:`ShadowStats`."""

    hq: torch.Tensor
    hs: torch.Tensor
    shadow: "ShadowStats | None" = None
    #: ``prefill: draft``, first round only: the prompt, the input of its lower pass (``x_0`` is its last token)
    opening: list[int] | None = None
    #: ``prefill: draft``, first round only: layer-``ℓ`` states of the prompt before ``x_0``
    prefix: torch.Tensor | None = None
    #: DEL with a speculation gate, until the first round plans: the prompt's last positions'
    #: candidate-layer and final states that seed :attr:`shadow` (:meth:`DEL.prefill`)
    seed: tuple[torch.Tensor, torch.Tensor] | None = None


class ExitDrafter(Drafter):
    """Early exit's drafter (module docstring, steps 1-3): layers ``0..ℓ`` and the exit head of
    layer ``ℓ`` draft, up to ``max_draft`` drafts, the draft-stop rule's threshold or an EOS draft
    (``eos``); the scorer runs layers ``ℓ+1..L-1`` over the kept exit-query states. ``keep_layers``:
    layers whose states are kept for shadow tokens (DEL's candidates; none for fixed early exit).
    ``weights``: the drafts read that quantised copy, and the scorer runs every layer (module docstring)."""

    def __init__(self, model: LayeredModel, heads, exit_layer: int, max_draft: int, draft_stop: DraftStop | None,
                 keep_layers: list[int] = (), *, eos: Iterable[int] = (), weights: str | None = None) -> None:
        self.model = model
        self.heads = heads
        #: the weights the drafts read: None the target's, or a quantised copy's format
        self.weights = weights
        self.max_draft = int(max_draft)
        self.draft_stop = draft_stop or DraftStop()
        self.eos = frozenset(eos)
        self.exit_layer = self._check_exit(exit_layer)
        #: layers whose hidden states are kept for shadow tokens (DEL; none for fixed early exit)
        self.slot = {layer: j for j, layer in enumerate(keep_layers)}

    def _check_exit(self, layer: int) -> int:
        layer = int(layer)
        if layer not in self.heads.layers:
            raise ValueError(
                f"method.exit_layer={layer} has no exit head: choose one of {self.heads.layers} "
                f"({self.heads.kind} heads; for exit_head=lm_head any layer in [0, {top_exit(self.model.num_layers, self.weights)}])"
            )
        return layer

    def new_example(self, state: DecodeState | None) -> EarlyExitExample:
        m = self.model
        new = lambda rows: torch.empty(rows, self.max_draft + 1, m.hidden_size, dtype=m.dtype,  # noqa: E731
                                       device=m.device)
        return EarlyExitExample(hq=new(1), hs=new(len(self.slot)))

    def plan(self, state: DecodeState) -> RoundPlan:
        """The next round's :class:`RoundPlan`."""
        return RoundPlan(max_draft=self.max_draft, exit_layer=self.exit_layer,
                         threshold=self.draft_stop.threshold(self.exit_layer))

    def observe(self, state: DecodeState, draft: Draft, committed: list[int]) -> None:
        """After verifying ``draft``: ``committed`` are the tokens the verified rows produced."""

    def _layers(self, h, layers: range, state: DecodeState, start: int, row: int, weights: str | None = None
                ) -> torch.Tensor:
        """Run ``layers`` on ``h`` (positions ``start…``) over ``weights`` (None: the target's); keep
        candidate-layer states at ``row…`` (the target's only: a copy's states are no shadow token's)."""
        m, hs = self.model, state.example.hs
        n = h.shape[1]
        keep = {} if weights else {i: hs[self.slot[i], row : row + n] for i in layers if i in self.slot}  # views
        return m.forward(h, state.cache, Pass(layers, weights=weights), start=start, keep=keep, ledger=state.ledger,
                         joins=state.joins)

    def _lower(self, state: DecodeState, tokens: list[int], i: int, exit_layer: int) -> torch.Tensor:
        """Step 1/2: ``x_i`` through layers ``0..ℓ`` (exact K/V; ℓ = ``exit_layer``), its state kept
        in the exit-query cache. ``tokens`` is ``[x_i]``, or for ``x_0`` of ``prefill: draft``'s
        first round the prompt (one pass; the states before ``x_0`` are kept as the round's prefix).
        Over a quantised copy (``weights``) the states are the copy's, and nothing is kept."""
        m, ex = self.model, state.example
        n = len(tokens)
        ids = torch.tensor([tokens], device=m.device)
        h = self._layers(m.embed(ids), range(0, exit_layer + 1), state, state.n_cached + i - n + 1, i, self.weights)
        if self.weights is None:
            ex.hq[:, i] = h[:, -1]
            if n > 1:
                ex.prefix = h[:, :-1]
        return h

    def kept(self, state: DecodeState, rows: int) -> dict[int, torch.Tensor]:
        """A verification over every layer (over a quantised copy) keeps the candidate layers' states of
        its rows for the shadow tokens (:meth:`score`)."""
        return {i: state.example.hs[j, :rows] for i, j in self.slot.items()}

    def _x0(self, state: DecodeState) -> list[int]:
        """The input of the round's first lower pass: the pending token ``[x_0]`` (the prompt in
        ``prefill: draft``'s first round)."""
        return state.example.opening or [state.pending]

    def draft_logits(self, layer: int, h: torch.Tensor, ledger=None, joins=None, vocab=None) -> torch.Tensor:
        """The exit head's logits for the layer-``ℓ`` state ``h``, over the generation's draft vocabulary
        ``vocab`` (``DecodeState.vocab``; None: the heads' own); recorded in ``ledger`` when given; ``joins``:
        the generation's batch, whose other sequences the head product may yield to."""
        return self.heads.logits(layer, h, ledger, joins, self.weights, vocab)

    def propose(self, state: DecodeState, plan: RoundPlan, k_max: int) -> Draft:
        """Step 1: draft from the exit head until ``k_max``, the draft-stop threshold or EOS."""
        draft = Draft()
        tokens = self._x0(state)
        for i in range(k_max):
            h = self._lower(state, tokens, i, plan.exit_layer)
            logits = self.draft_logits(plan.exit_layer, h[0, -1], state.ledger, state.joins, state.vocab)
            if not draft.add(logits, state, plan.threshold, self.eos):
                break
            tokens = draft.tokens[-1:]
        return draft

    def score(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        """Steps 2-3: the last draft (``x_0`` when nothing was drafted) through layers ``0..ℓ``,
        then layers ``ℓ+1..L-1`` on the exit-query states of ``x_0, d_1 … d_k`` in one pass (after
        the prompt's, in ``prefill: draft``'s first round). Over a quantised copy: every layer over
        ``x_0, d_1 … d_k``, from their embeddings, after the copy's K/V are dropped."""
        m, k, ex, ell = self.model, len(draft), state.example, draft.plan.exit_layer
        if self.weights is not None:  # the chain's full-pass verification, keeping the candidates' states
            return super().score(state, draft)
        self._lower(state, draft.tokens[-1:] if k else self._x0(state), k, ell)
        upper = range(ell + 1, m.num_layers)
        h, start = ex.hq[:, : k + 1], state.n_cached
        if ex.prefix is not None:
            h, start = torch.cat([ex.prefix, h], dim=1), start - ex.prefix.shape[1]
        ex.opening = ex.prefix = None  # later rounds start from the pending token
        h = self._layers(h, upper, state, start, 0)
        return m.logits(h[0, -(k + 1):], state.ledger, state.joins)

    def update(self, state: DecodeState, draft: Draft, accepted: int, committed: list[int]) -> None:
        state.trace_step.exit_layer = draft.plan.exit_layer
        state.count("exit_layer_sum", draft.plan.exit_layer)
        state.count("draft_len_sum", len(draft))
        super().update(state, draft, accepted, committed)
        self.observe(state, draft, committed)


class EarlyExit(ChainDecoder):
    """Early-exit self-speculation with a fixed ``(ℓ, max_draft)`` and an optional draft-stop rule:
    a chain of :class:`ExitDrafter`."""

    name = "early_exit"
    title = "Early exit (LayerSkip)"
    lossless = True
    Options = EarlyExitOptions

    def __init__(self, model: LayeredModel, drafter: ExitDrafter, *, prefill: str, **common) -> None:
        super().__init__(model, reads={"heads": drafter.heads.path}, **common)
        if prefill not in PREFILLS or (prefill == "draft" and (drafter.slot or drafter.weights)):
            raise ValueError(f"prefill={prefill!r}: early exit takes one of {PREFILLS}; DEL and drafts over a "
                             "quantised copy only full")
        #: ``full`` or ``draft`` (module docstring)
        self.prefill_kind = prefill
        self.drafter = drafter
        self.lookahead = drafter.max_draft + 1

    @classmethod
    def check_run(cls, options: EarlyExitOptions, layers: int, budget: int | None = None) -> None:
        """``exit_layer`` below the last layer (the last too over a quantised copy)."""
        checks.integer("method.exit_layer", options.exit_layer, 0, top_exit(layers, options.draft_weights),
                       why=f"0-based exit layer ℓ; the model has {layers} layers, the last is the final head itself "
                           "(an exit only over a quantised copy, draft_weights)")

    @classmethod
    def from_config(cls, model: LayeredModel, options: EarlyExitOptions, **common) -> "EarlyExit":
        exit_layer = options.exit_layer
        heads = exit_heads(model, options, [exit_layer])
        drafter = ExitDrafter(model, heads, exit_layer, options.max_draft, new_rule(options.draft_stop),
                              eos=common.get("eos_token_ids", ()), weights=options.draft_weights)
        return cls(model, drafter, prefill=options.prefill, draft_vocab=heads.vocab, **common)

    # --- per-example statistics and the first step -------------------------------------------
    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        state.stats.setdefault("exit_layer_sum", 0)
        state.stats.setdefault("draft_len_sum", 0)

    def finish(self, state: DecodeState) -> None:
        # rounds that drafted from the exit head (not a full prefill, context drafts or gated plain steps)
        rounds = len(state.trace) - (self.prefill_kind == "full") - state.steps_from("context")
        rounds = max(rounds - state.gated_steps(), 1)
        state.stats["exit_layer_mean"] = state.stats.pop("exit_layer_sum") / rounds
        state.stats["draft_len_mean"] = state.stats.pop("draft_len_sum") / rounds
        state.stats.setdefault("draft_stops", 0)

    def first_step(self, state: DecodeState, prompt: torch.Tensor, budget: int) -> list[int]:
        """``prefill: draft`` (LayerSkip's code): the first round drafts from the prompt, which is
        its ``x_0`` (module docstring); traced as ``prefill`` over the prompt and the drafts.
        ``full``: the shared prefill."""
        if self.prefill_kind == "full":
            return super().first_step(state, prompt, budget)
        state.example.opening = prompt[0].tolist()
        committed = self.self_step(state, budget)
        step = state.trace_step
        step.source, step.width = "prefill", prompt.shape[1] + state.drafted
        return committed


# --- DEL -----------------------------------------------------------------------------------------
class ShadowStats:
    """Exponentially decayed per-layer statistics of shadow tokens (DEL §4.1-4.2).

    Each observation (one verified position) decays all sums by ``ω`` and adds its values;
    estimates are ratios of decayed sums, so they are unbiased from the first observation on:
    ``α_ℓ`` (agreement of layer ``ℓ``'s shadow token with the committed token) and the mean
    confidence of matched and of mismatched shadow tokens. Matches and mismatches are summed
    apart: a mismatch long ago decays towards 0 but stays seen (float64 holds ``ω^n`` down to
    ``n`` ≈ 14,000 observations at ω = 0.95; ``weight - match`` would cancel to noise after a few
    hundred matches in a row).
    """

    def __init__(self, n_layers: int, omega: float) -> None:
        self.omega = omega
        z = lambda: torch.zeros(n_layers, dtype=torch.float64)  # noqa: E731
        self.weight, self.match, self.miss = z(), z(), z()  # decayed observations, matches, mismatches (per layer)
        self.conf_match, self.conf_miss = z(), z()

    @property
    def empty(self) -> bool:
        return bool(self.weight.max() == 0)

    def update(self, match: torch.Tensor, conf: torch.Tensor) -> None:
        """``match`` (bool) and ``conf`` ``[C, n]``: n observations in order, per layer."""
        n = match.shape[1]
        w = self.omega ** torch.arange(n - 1, -1, -1, dtype=torch.float64)  # newest weighs 1
        decay = self.omega**n
        mf, cf = match.double().cpu(), conf.double().cpu()  # the controller's statistics live on the host
        self.weight = decay * self.weight + w.sum()
        self.match = decay * self.match + (mf * w).sum(1)
        self.miss = decay * self.miss + ((1 - mf) * w).sum(1)
        self.conf_match = decay * self.conf_match + (cf * mf * w).sum(1)
        self.conf_miss = decay * self.conf_miss + (cf * (1 - mf) * w).sum(1)

    def alpha(self) -> torch.Tensor:
        return self.match / self.weight.clamp_min(1e-12)

    def mean_conf(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per layer: mean confidence of matched and of mismatched shadow tokens, and whether
        each kind was seen."""
        seen_match, seen_miss = self.match > 0, self.miss > 0
        return (self.conf_match / torch.where(seen_match, self.match, 1.0),
                self.conf_miss / torch.where(seen_miss, self.miss, 1.0), seen_match, seen_miss)

    def state(self) -> dict[str, list]:
        """The statistics for a step trace: per candidate layer ``alpha`` and the mean confidences
        ``conf_match`` / ``conf_miss`` (None where that kind was not seen)."""
        matched, missed, seen_match, seen_miss = self.mean_conf()
        pick = lambda v, seen: [float(x) if ok else None for x, ok in zip(v, seen.tolist())]  # noqa: E731
        return {"alpha": self.alpha().tolist(), "conf_match": pick(matched, seen_match),
                "conf_miss": pick(missed, seen_miss)}

    def threshold(self) -> torch.Tensor:
        """Per-layer stop threshold ``(mean conf matched + mean conf mismatched) / 2`` (DEL §4.2's
        τ_ℓ; not called tau here, where τ is tokens per step); 0 (no stop) until both are seen."""
        matched, missed, seen_match, seen_miss = self.mean_conf()
        cut = (matched + missed) / 2
        return torch.where(seen_match & seen_miss, cut, torch.zeros_like(cut))


def expected_tokens(alpha: torch.Tensor, gammas: torch.Tensor) -> torch.Tensor:
    """``[C, G]``: tokens one round commits with ``γ`` drafts, ``Σ_{i=0}^{γ} α^i`` (bonus token
    included; i.i.d. acceptance, Leviathan et al. 2023 eq. 1)."""
    top = int(gammas.max())
    powers = alpha.double().unsqueeze(1) ** torch.arange(0, top + 1, dtype=torch.float64)
    return powers.cumsum(1)[:, gammas]


def round_cost(layers: torch.Tensor, gammas: torch.Tensor, num_layers: int, head_cost: float,
               verify: torch.Tensor | None = None, copy: tuple[float, float] | None = None) -> torch.Tensor:
    """``[C, G]``: layers loaded by one round at exit ``ℓ`` with ``γ`` drafts.

    ``(γ+1)·(ℓ+1) + (L-ℓ-1) + (γ+1)·h``: ``γ`` draft passes and the last draft's pass through
    layers ``0..ℓ``, one verification pass through the rest, ``γ`` exit heads and the final
    head. DEL §4.1 writes ``γ(ℓ+1) + L-ℓ-1``; the extra terms are the last draft's lower layers
    (verification needs them for the bonus token) and the heads (several layers' worth on small
    models). With ``γ = 0`` this is one plain decoding step, ``L + h``.

    ``verify`` (``[G]``, default all 1) is the measured cost of scoring ``γ+1`` tokens in one
    pass in units of one token's, ``v(γ+1)`` of the run's cost profile: the verification pass
    (the layers above ``ℓ`` and the final head) is then charged ``(L-ℓ-1+h)·v(γ+1)``. DEL's
    count assumes a memory-bound machine where ``v ≈ 1``; on a CPU it is not (docs/design.md §4).

    ``copy`` (``(q, h_q)``: a draft layer's and an exit head's cost over a quantised copy, in target
    layers, :func:`copy_rates`): the drafts read the copy, and verification runs every layer (module
    docstring): ``γ·(ℓ+1)·q + γ·h_q + (L + h)·v(γ+1)``, again ``L + h`` at ``γ = 0``.
    """
    g = gammas.double().unsqueeze(0)
    ell = layers.double().unsqueeze(1)
    v = torch.ones_like(g) if verify is None else verify.double().view(1, -1)
    if copy is not None:
        q, head_q = copy
        return g * (ell + 1) * q + g * head_q + (num_layers + head_cost) * v
    return (g + 1) * (ell + 1) + g * head_cost + (num_layers - ell - 1 + head_cost) * v


def layer_count(layers: torch.Tensor, gammas: torch.Tensor, num_layers: int) -> torch.Tensor:
    """``[C, G]``: DEL §4.1's denominator as the authors' code counts it, ``γ·(ℓ+1) + L - ℓ - 1``
    layers loaded (``γ`` draft passes through layers ``0..ℓ``, one verification pass through the
    rest; ``cost_model: layers``). :func:`round_cost` adds what it leaves out."""
    g = gammas.double().unsqueeze(0)
    ell = layers.double().unsqueeze(1)
    return g * (ell + 1) + (num_layers - ell - 1)


def tpl_argmax(alpha: torch.Tensor, layers: torch.Tensor, gammas: torch.Tensor,
               cost: torch.Tensor) -> tuple[int, int, float]:
    """DEL §4.1: ``(ℓ, γ)`` maximising tokens per layer ``TPL = E[tokens] / cost`` over the
    candidate layers and speculation lengths (``cost`` ``[C, G]``: :func:`layer_count` or
    :func:`round_cost`); the first maximum (layers, then lengths, increasing) on ties. Returns
    ``(layer, gamma, tpl)``."""
    tpl = expected_tokens(alpha, gammas) / cost
    flat = int(tpl.argmax())
    c, g = divmod(flat, int(gammas.numel()))
    return int(layers[c]), int(gammas[g]), float(tpl.view(-1)[flat])


class DELDrafter(ExitDrafter):
    """DEL's drafter: :class:`ExitDrafter` whose round plan (exit layer ℓ, speculation length γ,
    stop threshold) maximises tokens per layer from the shadow-token statistics (DEL §4,
    Algorithm 1), priced by ``cost_model`` (``measured``: the run's ``profile``)."""

    def __init__(self, model: LayeredModel, heads, max_draft: int, min_draft: int, omega: float,
                 draft_stop: DraftStop | None, shadow_rows: int | None, head_cost: float | None, cost_model: str,
                 *, profile=None, eos: Iterable[int] = (), weights: str | None = None) -> None:
        self.gammas = torch.arange(int(min_draft), int(max_draft) + 1)  # the speculation lengths γ
        self.candidates = list(heads.layers)
        super().__init__(model, heads, self.candidates[len(self.candidates) // 2], max_draft,
                         DynamicThreshold() if draft_stop is None else draft_stop, self.candidates, eos=eos,
                         weights=weights)
        self.omega = float(omega)
        self.shadow_rows = shadow_rows
        #: ``layers``: DEL's count as the authors' code has it (:func:`layer_count`); ``measured``:
        #: TPL's costs priced by the run's cost profile; ``parameters``: the full count of
        #: :func:`round_cost` with heads from parameter counts and v(k) = 1
        self.cost_model = cost_model
        self.verify = None
        self._layer_ids = torch.tensor(self.candidates)
        if cost_model == "layers" and head_cost is not None:
            raise ValueError("head_cost is not part of DEL's layer count (cost_model=layers): set it null")
        if cost_model == "layers" and weights is not None:
            raise ValueError("DEL's layer count (cost_model=layers) prices drafts over the target's weights: with "
                             f"draft_weights={weights} set cost_model=measured or parameters")
        context = max(1, min(512, model.max_context - int(max_draft) - 3))
        if cost_model == "measured":
            if profile is None:
                raise ValueError(MEASURED_NEEDS_PROFILE)
            # v(γ+1) and the heads at a decoding context the model holds (512 where it can)
            one = profile.pass_cost(1, context)
            self.verify = torch.tensor([profile.pass_cost(int(g) + 1, context) / one for g in self.gammas],
                                       dtype=torch.float64)
            priced = head_cost_in_layers(model, heads, profile, context)
            self.head_cost = priced if head_cost is None else float(head_cost)
        elif cost_model == "parameters":
            self.head_cost = head_cost_in_layers(model, heads) if head_cost is None else float(head_cost)
        else:
            self.head_cost = 0.0
        #: a draft layer's and an exit head's cost over the quantised copy (:func:`copy_rates`), None without one
        self.copy = None if weights is None else copy_rates(model, heads, weights,
                                                            profile if cost_model == "measured" else None, context)
        #: ``[C, G]``: TPL's denominator per candidate layer and speculation length
        self.cost = (layer_count(self._layer_ids, self.gammas, model.num_layers) if cost_model == "layers" else
                     round_cost(self._layer_ids, self.gammas, model.num_layers, self.head_cost, self.verify,
                                self.copy))

    def new_example(self, state: DecodeState | None) -> EarlyExitExample:
        ex = super().new_example(state)
        ex.shadow = ShadowStats(len(self.candidates), self.omega)
        return ex

    def shadow_stats(self, state: DecodeState) -> "ShadowStats":
        """The example's shadow statistics, seeded first from the prompt's kept states where the
        seed still waits (:meth:`prefill`). Every reader of the statistics comes after a plan, which
        reads them through here: a round's :meth:`observe` and :meth:`controller`; context drafts
        and gated plain steps read none."""
        ex = state.example
        if ex.seed is not None:
            kept, final = ex.seed
            ex.seed = None
            with phase(state.ledger, "heads"):
                self._shadow(state, kept, argmax(self.model.logits(final, state.ledger, state.joins)))
        return ex.shadow

    def _shadow(self, state: DecodeState, hs: torch.Tensor, committed: torch.Tensor) -> None:
        """Shadow tokens of ``hs [C, n, d]`` vs ``committed [n]``; update the statistics."""
        w = self.weights  # the drafts' own head scores the shadow tokens
        if self.heads.kind == "lm_head":  # one batched head for all layers
            logits = self.heads.logits(self.candidates[0], hs, state.ledger, state.joins, w, state.vocab)
        else:
            logits = torch.stack([self.heads.logits(layer, hs[j], state.ledger, state.joins, w, state.vocab)
                                  for j, layer in enumerate(self.candidates)])
        conf, tok = logits.softmax(-1).max(-1)
        state.example.shadow.update(tok == committed.view(1, -1), conf)

    def observe(self, state: DecodeState, draft: Draft, committed: list[int]) -> None:
        n = len(committed)  # verified rows 0..n-1 produced the committed tokens
        rows = n if self.shadow_rows is None else min(n, self.shadow_rows)
        target = torch.tensor(committed[:rows], device=self.model.device)
        self._shadow(state, state.example.hs[:, :rows], target)

    def controller(self, state: DecodeState, draft: Draft) -> dict:
        """The step's plan (DEL §4.1-4.2: exit layer ℓ, speculation length γ, stop threshold) and
        the shadow statistics after its update (:meth:`ShadowStats.state`, per candidate layer);
        the prefill's trace carries the seeded statistics alone where no gate defers them."""
        plan = draft.plan
        return {"exit_layer": plan.exit_layer, "max_draft": plan.max_draft, "threshold": plan.threshold,
                **state.example.shadow.state()}

    def plan(self, state: DecodeState) -> RoundPlan:
        """DEL §4.1-4.2: ``(ℓ, γ) = argmax TPL`` and, under ``{rule: dynamic}``, the stop threshold
        of layer ``ℓ`` from the shadow statistics (another rule: that rule's threshold)."""
        shadow = self.shadow_stats(state)
        ell, gamma, _ = tpl_argmax(shadow.alpha(), self._layer_ids, self.gammas, self.cost)
        if isinstance(self.draft_stop, DynamicThreshold):
            threshold = float(shadow.threshold()[self.candidates.index(ell)])
        else:
            threshold = self.draft_stop.threshold(ell)
        return RoundPlan(max_draft=gamma, exit_layer=ell, threshold=threshold)


class DEL(EarlyExit):
    """DEL: context-aware dynamic exit layer and speculation length (DEL §4, Algorithm 1): a chain
    of :class:`DELDrafter`, whose prefill seeds the shadow statistics from the prompt's last
    ``prefill_shadow`` positions."""

    name = "del"
    title = "DEL"
    Options = DELOptions

    def __init__(self, model: LayeredModel, drafter: DELDrafter, prefill_shadow: int, **common) -> None:
        super().__init__(model, drafter, prefill="full", **common)
        self.prefill_shadow = int(prefill_shadow)

    @classmethod
    def needs_profile(cls, options: DELOptions) -> tuple[str, str] | None:
        """``cost_model: measured`` prices TPL with the run's profile (and drafts from the context first
        may, :meth:`Decoder.needs_profile`)."""
        if options.cost_model == "measured":
            return "cost_model=measured", MEASURED_NEEDS_PROFILE
        return super().needs_profile(options)

    @classmethod
    def check_run(cls, options: DELOptions, layers: int, budget: int | None = None) -> None:
        """``candidate_layers``, where given, below the last layer (the last too over a quantised copy)."""
        if options.candidate_layers is not None:
            checks.listed(checks.integer, "method.candidate_layers", options.candidate_layers, 0,
                          top_exit(layers, options.draft_weights),
                          why=f"exit layers; the model has {layers}, the last is the final head itself (an exit "
                              "only over a quantised copy, draft_weights)")

    @classmethod
    def from_config(cls, model: LayeredModel, options: DELOptions, **common) -> "DEL":
        layers = options.candidate_layers
        if layers is None:
            layers = range(top_exit(model.num_layers, options.draft_weights) + 1)
        heads = exit_heads(model, options, list(layers))
        drafter = DELDrafter(model, heads, options.max_draft, options.min_draft, options.omega,
                             new_rule(options.draft_stop), options.shadow_rows,
                             options.head_cost, options.cost_model, profile=common.get("profile"),
                             eos=common.get("eos_token_ids", ()), weights=options.draft_weights)
        return cls(model, drafter, options.prefill_shadow, draft_vocab=heads.vocab, **common)

    def prefill(self, state: DecodeState, prompt: torch.Tensor) -> int:
        """Full pass over the prompt; shadow tokens of its last positions seed the statistics.

        The prompt's own tokens are not the model's, so the shadow tokens there are compared
        with the final layer's argmax (the token the model itself would commit greedily). The
        first token comes from the last position's logits alone, as vanilla's prefill takes it.
        With a speculation gate the seed waits, kept as hidden states, until the first round
        plans (:meth:`DELDrafter.shadow_stats`): an example whose steps the gate makes plain never pays for
        ``prefill_shadow`` rows of every candidate's exit head and of the LM head, and an
        example that drafts gets the same statistics, since nothing updates them before its
        first plan. Without a gate the prefill seeds them, as DEL's code does, and its trace
        carries them.
        """
        m = self.model
        n = prompt.shape[1]
        rows = min(self.prefill_shadow, n)
        slot = self.drafter.slot
        kept = torch.empty(len(slot), rows, m.hidden_size, dtype=m.dtype, device=m.device)  # the candidate layers' last rows, in layer order
        h = m.forward(prompt, state.cache, start=0, keep={i: kept[j] for i, j in slot.items()},
                      ledger=state.ledger, joins=state.joins)
        state.example.seed = (kept, h[0, n - rows :].clone())
        if self.gate is None:
            state.trace_step.controller = self.drafter.shadow_stats(state).state()
        return int(select(m.logits(h[:, n - 1], state.ledger, state.joins)[0], state.sampling, state.generator,
                          state.ledger))

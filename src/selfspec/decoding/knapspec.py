"""KnapSpec and CLaSp: skip sets chosen while decoding, from the context at hand (issue 41).

Both draft as Draft & Verify does (:class:`~selfspec.decoding.draft_verify.DraftVerify`: the
target with sublayers skipped, a confidence draft stop, one full verification pass, speculative
sampling under sampling), but with no search ahead of time: every ``interval`` steps they compare
candidate draft models with the full model on the tokens just verified, and draft with the best
until the next search. Nothing is trained.

**KnapSpec** (Cha et al., ICML 2026, arXiv 2602.20217, §3-4; ``selection: knapspec``). The items are
the attention and MLP sublayers ("blocks") of every layer but the first and the last. Skipping
one saves its *weight*: the cheaper kind weighs 1, the dearer ``round(t_dear / t_cheap)``, at
most 5, from this machine's cost profile (:meth:`~selfspec.measure.profile.Profile.attention_cost`
at the current context and :meth:`~selfspec.measure.profile.Profile.mlp_cost`: attention weighs
more as the context grows); the budget is half the total weight. A dynamic programme over blocks
keeps, per saved weight ``j``, the candidate hidden states of a *window* of recent tokens whose
summed cosine similarity to the full model's states at that block is highest (§3.2: a proxy for
acceptance), pruning states whose mean similarity is below ``similarity_floor``. Each block runs
all surviving candidates in one batched pass with a branch-parallel mask
(:func:`~selfspec.decoding.branches.branch_pass`). Each surviving end state gives a
skip set and its agreement α (its top-1 against the full model's over the window), and the set
maximising tokens per time ``E[tokens](α, d) / cost(d)`` over draft lengths ``d < 18`` wins (§4;
the draft length itself is not used: drafting stops at ``max_draft`` or the confidence stop).
The window is the accepted rows of the ``window`` verification steps up to the search.

**CLaSp** (Chen et al., ACL 2025, arXiv 2505.24196, §3; ``selection: clasp``): the same programme
restricted to whole layers, ``skip_layers`` of them skipped, each of weight 1, on one token (the
last accepted one); ``g(i, j)`` is the state after the first ``i`` layers with ``j`` skipped,
``g(i, 0)`` the full model's, and ``g(i, j)`` keeps executing layer ``i`` on ``g(i−1, j)`` only when
that is strictly more similar to the full model's state than skipping it (``g(i−1, j−1)``): ties
skip. CLaSp has no official code; its two public re-implementations break ties differently, and
selfspec pins KnapSpec's (kaist-flexml-lab/knapspec). No α or TPT selection.

Both follow the authors' code (knapspec's ``knapspec_generator.py`` / ``clasp_generator.py``) in
its schedule: the first steps draft with no skip set (the full model) until the first search; a
search runs after step ``s`` (counting steps after the prefill from 1) when ``s ≡ search_at (mod
interval)``, on the states of the ``window`` steps ending there (KnapSpec: steps 2-6 of every 64;
CLaSp: step 1 of every 64); the skip set starts empty again at every example. Where the
authors' selection differs from its paper, selfspec follows the code: KnapSpec's final choice
never takes the first surviving end state (the least weight saved) unless it is the only one;
when every state is pruned the skip set is emptied (the full model drafts).

Beyond the authors: a step the speculation gate (``never_slower``) makes plain, or a gated plain
step inside a window, breaks the window's run of consecutive tokens, so the window starts again
at the next step; the ``*_paper`` configs never gate. Verification under sampling is selfspec's
lossless chain rule (speculative sampling with the drafts' ``q``), where the authors sample the
target token and accept on equality (also lossless, accepting less often).

The search is charged to the ledger's ``search`` component (:mod:`selfspec.models.ledger`): its
batched block passes are recorded as walks, and the report shows what the online optimisation
costs. The verification passes of the window's steps keep the full model's states (KnapSpec's
after every sublayer, :func:`~selfspec.decoding.branches.sublayer_states`; CLaSp's after every
layer, the plain pass's ``keep``) and stay ``verify``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.config import checks
from selfspec.config.options import Ref, key, nullable
from selfspec.decoding.base import DecodeState
from selfspec.decoding.branches import branch_pass, sublayer_states
from selfspec.decoding.chain import Draft
from selfspec.decoding.draft_verify import DecodingOptions, DraftVerify, SkipSetDrafter
from selfspec.decoding.part_options import Gated
from selfspec.decoding.sampling import argmax
from selfspec.models.heads import DraftVocabOptions, build_draft_vocab
from selfspec.models.layered import LayeredModel, SkipSet
from selfspec.models.ledger import phase

#: how the skip set is chosen: KnapSpec's knapsack over sublayers, CLaSp's layer programme
SELECTIONS = ("knapspec", "clasp")
#: heaviest weight a sublayer kind gets (KnapSpec's code)
MAX_WEIGHT = 5
#: draft lengths the TPT selection considers (``d < 18``, KnapSpec's code)
TPT_LENGTHS = 18
#: the profile is what weighs the sublayers (KnapSpec §4)
KNAPSPEC_NEEDS_PROFILE = ("KnapSpec weighs attention against MLP sublayers with the run's cost profile; "
                          "set profile=auto (or a profile path), or method.selection=clasp")


def cosine(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Summed cosine similarity over the rows of ``x`` ``[..., T, d]`` to ``y`` ``[T, d]``, in float32
    (the authors compute it in the model's dtype: on a bfloat16 model a near tie may go otherwise)."""
    x, y = torch.nn.functional.normalize(x.float(), dim=-1), torch.nn.functional.normalize(y.float(), dim=-1)
    return (x * y).sum(-1).sum(-1)


def sublayer_weights(t_attn: float, t_mlp: float) -> tuple[int, int]:
    """KnapSpec's integer weights ``(attention, MLP)`` from their costs: the cheaper 1, the dearer
    ``round(ratio)`` (Python's rounding, as the authors'), at most :data:`MAX_WEIGHT`."""
    def heavy(dear: float, cheap: float) -> int:
        return MAX_WEIGHT if cheap <= 0 else min(int(round(dear / cheap)), MAX_WEIGHT)

    return (heavy(t_attn, t_mlp), 1) if t_attn > t_mlp else (1, heavy(t_mlp, t_attn))


def expected_tokens(alpha: float, d: int) -> float:
    """Tokens a step of ``d`` drafts commits at agreement ``α`` (the bonus included): ``Σ α^i, i ≤ d``."""
    return d + 1.0 if alpha == 1.0 else (alpha ** (d + 1) - 1.0) / (alpha - 1.0)


@dataclass
class Chosen:
    """What a search chose: the skip set and, for the trace, its candidates and the tokens compared."""

    skip: SkipSet
    tokens: int
    candidates: int = 1
    #: KnapSpec: the chosen set's agreement α and the (attention, MLP) weights the search used
    alpha: float | None = None
    weights: tuple[int, int] | None = None

    def row(self) -> dict:
        extra = {} if self.weights is None else {"alpha": self.alpha, "weights": list(self.weights)}
        return {"skip_attn": sorted(self.skip.attn), "skip_mlp": sorted(self.skip.mlp), "tokens": self.tokens,
                "candidates": self.candidates, **extra}


def clasp_search(model: LayeredModel, xs: list[torch.Tensor], cache, context: int, skip_layers: int,
                 ledger=None) -> Chosen:
    """CLaSp §3.2's programme (module docstring): ``xs`` the full model's states ``[T, d]`` after
    each layer (the embedding first, ``L + 1``), their tokens at positions ``context…``; returns the
    ``skip_layers`` layers to skip. Each layer's candidates run as one batched pass."""
    n_layers = model.num_layers
    m = skip_layers
    g: list[list[torch.Tensor | None]] = [[None] * (m + 1) for _ in range(n_layers + 1)]
    skipped = [[False] * (m + 1) for _ in range(n_layers + 1)]
    g[0][0] = xs[0]
    for i in range(1, n_layers + 1):
        g[i][0] = xs[i]
        ell = min(i - 1, m)
        if ell > 0:
            execute = torch.stack([g[i - 1][j] for j in range(1, ell + 1)])
            keep = torch.stack([g[i - 1][j] for j in range(ell)])
            ran = branch_pass(model, execute, i - 1, "layer", cache, context, ledger)
            better = (cosine(ran, xs[i]) > cosine(keep, xs[i])).tolist()
            for j in range(1, ell + 1):
                if better[j - 1]:
                    g[i][j] = ran[j - 1]
                else:
                    g[i][j], skipped[i][j] = keep[j - 1], True
        if i <= m:
            g[i][i], skipped[i][i] = g[i - 1][i - 1], True
    layers, i, j = [], n_layers, m
    while i > 0 and j > 0:
        if skipped[i][j]:
            layers.append(i - 1)
            j -= 1
        i -= 1
    return Chosen(SkipSet.of(layers, layers), int(xs[0].shape[0]))


def knapspec_search(model: LayeredModel, xs: list[torch.Tensor], cache, context: int,
                    weights: tuple[int, int], costs: tuple[float, float], floor: float, ledger=None,
                    joins=None) -> Chosen:
    """KnapSpec §3-4's programme (module docstring): ``xs`` the full model's states ``[T, d]``
    after each sublayer (``2L + 1``, :func:`~selfspec.decoding.branches.sublayer_states`),
    their tokens at positions ``context…``; ``weights`` and ``costs`` the attention and MLP
    sublayers' (:func:`sublayer_weights`, seconds); ``floor`` the mean similarity below which a
    state is pruned. The surviving end states' skip sets, then the one with the most tokens per time.
    The branch passes run alone; the head products comparing the end states join ``joins``, the
    generation's batch (they may yield to its other sequences)."""
    t = int(xs[0].shape[0])
    ends, parent = _knapsack(model, xs, cache, context, weights, floor, ledger)
    if not ends:
        return Chosen(SkipSet(), t, 0, None, weights)
    final = torch.stack(list(ends.values()))
    top = argmax(model.head(model.final_norm(final), ledger=ledger, joins=joins))
    teacher = argmax(model.head(model.final_norm(xs[-1]), ledger=ledger, joins=joins))
    alphas = ((top == teacher).sum(-1).float() / t).tolist()
    skips = [_backtrack(parent, j) for j in ends]
    pick = _most_tokens_per_time(skips, alphas, costs, model.num_layers)
    return Chosen(skips[pick], t, len(ends), alphas[pick], weights)


def _knapsack(model: LayeredModel, xs: list[torch.Tensor], cache, context: int, weights: tuple[int, int],
              floor: float, ledger=None) -> tuple[dict[int, torch.Tensor], list[dict[int, tuple[int, bool]]]]:
    """The programme over sublayers: per saved weight ``j``, the candidate states most similar to
    ``xs`` (summed cosine over the window), each block's candidates in one batched pass. Returns the
    end states by ``j`` (ascending) and every state's parent ``(j before, skipped)``."""
    n_layers, t = model.num_layers, int(xs[0].shape[0])
    blocks = 2 * n_layers
    budget = sum(weights) * n_layers // 2
    g: list[dict[int, torch.Tensor]] = [{} for _ in range(blocks + 1)]
    parent: list[dict[int, tuple[int, bool]]] = [{} for _ in range(blocks + 1)]
    g[2][0] = xs[2]  # the first layer always runs
    for i in range(3, blocks + 1):
        block = i - 1
        layer, attention = block // 2, block % 2 == 0
        prev = sorted(g[i - 1])
        if not prev:
            continue
        states = torch.stack([g[i - 1][j] for j in prev])
        ran = branch_pass(model, states, layer, "attn" if attention else "mlp", cache, context, ledger)
        best: dict[int, float] = {}
        for (j, s), state in zip(zip(prev, cosine(ran, xs[i]).tolist()), ran):
            if s / t >= floor and s > best.get(j, -float("inf")):
                best[j], g[i][j], parent[i][j] = s, state, (j, False)
        if block < blocks - 2:  # the last layer always runs
            w = weights[0] if attention else weights[1]
            for (j, s), state in zip(zip(prev, cosine(states, xs[i]).tolist()), states):
                if j + w <= budget and s / t >= floor and s > best.get(j + w, -float("inf")):
                    best[j + w], g[i][j + w], parent[i][j + w] = s, state, (j, True)
    return {j: g[blocks][j] for j in sorted(g[blocks])}, parent


def _backtrack(parent: list[dict[int, tuple[int, bool]]], j: int) -> SkipSet:
    """The sublayers skipped on the way to end state ``j`` (block ``b``: layer ``b // 2``'s attention
    when ``b`` is even, its MLP when odd)."""
    attn, mlp = [], []
    for i in range(len(parent) - 1, 2, -1):
        j, skipped = parent[i][j]
        if skipped:
            (attn if (i - 1) % 2 == 0 else mlp).append((i - 1) // 2)
    return SkipSet.of(attn, mlp)


def _most_tokens_per_time(skips: list[SkipSet], alphas: list[float], costs: tuple[float, float],
                          n_layers: int) -> int:
    """KnapSpec §4's choice: the set and draft length ``d < 18`` with the most expected tokens per
    time, ``E[tokens](α, d) / (t_attn·(n_attn·d + L) + t_mlp·(n_mlp·d + L))``; the authors' loop starts
    at the second set (the first is taken only when alone: index −1)."""
    t_attn, t_mlp = costs
    best_tpt, pick = -1.0, -1
    for c in range(1, len(skips)):
        ran_attn, ran_mlp = n_layers - len(skips[c].attn), n_layers - len(skips[c].mlp)
        for d in range(TPT_LENGTHS):
            cost = t_attn * (ran_attn * d + n_layers) + t_mlp * (ran_mlp * d + n_layers)
            tpt = expected_tokens(alphas[c], d) / cost if cost > 0 else 0.0
            if tpt > best_tpt:
                best_tpt, pick = tpt, c
    return pick


@dataclass
class Search:
    """One example's search state (``state.example``)."""

    skip: SkipSet = field(default_factory=SkipSet)
    #: the method's steps since the prefill (1 = the first)
    steps: int = 0
    #: per window step, the full model's states of its accepted rows (one per sublayer, KnapSpec; one
    #: per layer, CLaSp; the embedding first)
    window: list[list[torch.Tensor]] = field(default_factory=list)
    #: the states of the step in progress, kept by its verification
    verified: list[torch.Tensor] | None = None
    #: what the step's search chose, for its trace
    chosen: Chosen | None = None


def check_skip_layers(skip_layers: int | None, layers: int) -> None:
    """``skip_layers`` (CLaSp's M; null = a quarter of the layers) below the model's ``layers``."""
    checks.optional(checks.integer, "method.skip_layers", skip_layers, 0, layers - 1,
                    why=f"CLaSp's M, layers skipped; the model has {layers} layers")


@dataclass(frozen=True)
class KnapSpecOptions(DecodingOptions, DraftVocabOptions, Gated):
    """Keys (conf/method/knapspec*.yaml, clasp*.yaml): Draft & Verify's decoding keys
    (:class:`~selfspec.decoding.draft_verify.DecodingOptions`), the draft vocabulary's,
    ``never_slower`` and the search's: ``selection`` (:data:`SELECTIONS`),
    ``interval`` (steps between searches), ``search_at`` (the step of each interval after which the
    search runs, 1 = the first after the prefill), ``window`` (verification steps whose tokens it
    compares, ending there; at most ``search_at``), ``skip_layers`` (CLaSp's M; null = a quarter of
    the layers, the authors' 8 of 32) and ``similarity_floor`` (KnapSpec's pruning)."""

    selection: str = key(checks.choice, SELECTIONS, why="knapspec: sublayers weighed by cost; clasp: whole layers")
    interval: int = key(checks.integer, 1, why="verification steps between searches")
    search_at: int = key(checks.integer, 1, Ref("interval"),
                         why="the step of each interval after which the skip set is searched")
    window: int = key(checks.integer, 1, Ref("search_at"),
                      why="steps whose tokens the search compares, ending at search_at={search_at}")
    skip_layers: int | None = key(nullable(checks.integer), 0, why="CLaSp's M, layers skipped")
    similarity_floor: float = key(checks.number, -1.0, 1.0,
                                  why="mean cosine similarity below which KnapSpec prunes a state")


class SearchedSkipDrafter(SkipSetDrafter):
    """Draft & Verify's drafter whose skip set is searched while decoding (module docstring):
    KnapSpec's knapsack over sublayers (``selection: knapspec``, priced with ``profile``) or CLaSp's
    layer programme (``selection: clasp``), every ``interval`` steps on the states of a window of
    verification steps."""

    def __init__(self, model: LayeredModel, options: KnapSpecOptions, *, profile=None, **parts) -> None:
        """``options``: the method's checked keys (the decoding settings and the search's)."""
        super().__init__(model, SkipSet(), options, profile=profile, **parts)
        self.selection = options.selection
        self.interval, self.search_at, self.window = options.interval, options.search_at, options.window
        check_skip_layers(options.skip_layers, model.num_layers)
        self.skip_layers = model.num_layers // 4 if options.skip_layers is None else options.skip_layers
        self.similarity_floor = options.similarity_floor
        if self.selection == "knapspec" and profile is None:
            raise ValueError(KNAPSPEC_NEEDS_PROFILE)

    def new_example(self, state: DecodeState) -> Search:
        return Search()

    def skips(self, state: DecodeState) -> SkipSet:
        return state.example.skip

    def collects(self, step: int) -> bool:
        """Whether step ``step``'s verification is one of a window's (module docstring)."""
        return (self.search_at - step) % self.interval < self.window

    def score(self, state: DecodeState, draft: Draft) -> torch.Tensor:
        """The chain's verification pass; in a window step, one that keeps the full model's states:
        KnapSpec's after every sublayer (:func:`~selfspec.decoding.branches.sublayer_states`),
        CLaSp's after every layer (the plain pass keeping each layer's rows, which a capturing model
        runs static), the embedding first."""
        search = state.example
        if not self.collects(search.steps):
            return super().score(state, draft)
        model = self.model
        state.cache.truncate(state.n_cached)
        ids = torch.tensor([[state.pending, *draft.tokens]], device=model.device)
        if self.selection == "knapspec":
            search.verified = sublayer_states(model, ids, state.cache, state.n_cached, state.ledger,
                                              rows=self.max_draft + 1, joins=state.joins)
            return model.logits(search.verified[-1].unsqueeze(0), state.ledger, state.joins)[0]
        keep = {i: torch.empty(ids.shape[1], model.hidden_size, dtype=model.dtype, device=model.device)
                for i in range(model.num_layers)}
        h = model.forward(ids, state.cache, start=state.n_cached, keep=keep, ledger=state.ledger, joins=state.joins)
        search.verified = [model.embed(ids)[0], *keep.values()]
        return model.logits(h, state.ledger, state.joins)[0]

    def update(self, state: DecodeState, draft: Draft, accepted: int, committed: list[int]) -> None:
        """The draft-stop rule's update; in a window step, its accepted rows' states join the window,
        and after the search step the skip set is searched (charged to ``search``)."""
        super().update(state, draft, accepted, committed)
        search = state.example
        if search.verified is not None:
            search.window.append([s[: accepted + 1] for s in search.verified])
            search.verified = None
        if search.steps % self.interval == self.search_at % self.interval and search.window:
            with phase(state.ledger, "search"):
                search.chosen = self.search(state, search.window)
            search.skip = search.chosen.skip
            search.window = []

    def search(self, state: DecodeState, window: list[list[torch.Tensor]]) -> Chosen:
        """Run the selection on the window's states; the cache holds its tokens last."""
        blocks = [torch.cat(rows) for rows in zip(*window)]
        context = state.cache.length(0) - int(blocks[0].shape[0])
        model, ledger = self.model, state.ledger
        if self.selection == "clasp":
            last = [b[-1:] for b in blocks]  # the last accepted token, after each layer
            return clasp_search(model, last, state.cache, context + int(blocks[0].shape[0]) - 1, self.skip_layers,
                                ledger)
        n = state.cache.length(0)
        weights = self.decoding.draft_weights or ""  # a draft over a quantised copy costs that copy's price
        costs = (self.profile.attention_cost(1, n, weights=weights), self.profile.mlp_cost(1, weights))
        return knapspec_search(model, blocks, state.cache, context, sublayer_weights(*costs), costs,
                               self.similarity_floor, ledger, state.joins)

    def controller(self, state: DecodeState, draft: Draft) -> dict | None:
        """The draft-stop rule's state, how many sublayers the skip set in force after the step
        leaves out and, on a step that searched, what the search chose."""
        search = state.example
        out = {**(super().controller(state, draft) or {}), "skipped": len(search.skip)}
        if search.chosen is not None:
            out["search"] = search.chosen.row()
            search.chosen = None
        return out


class KnapSpec(DraftVerify):
    """Layer skipping with the skip set searched while decoding (module docstring): a chain of
    :class:`SearchedSkipDrafter`."""

    name = "knapspec"
    title = "KnapSpec"
    lossless = True
    #: the window's tokens must be consecutive: no context drafts in between (no ``ngram`` key)
    Options = KnapSpecOptions

    def __init__(self, model: LayeredModel, options: KnapSpecOptions, **common) -> None:
        """``options``: the method's checked keys; the skip set starts empty (the full model drafts)."""
        super().__init__(model, SkipSet(), options, **common)

    def new_drafter(self, skip_set: SkipSet, decoding: KnapSpecOptions) -> SearchedSkipDrafter:
        return SearchedSkipDrafter(self.model, decoding, profile=self.profile, draft_vocab=self.draft_vocab,
                                   eos=self.eos_token_ids)

    @classmethod
    def from_config(cls, model: LayeredModel, options: KnapSpecOptions, **common) -> "KnapSpec":
        return cls(model, options, draft_vocab=build_draft_vocab(model, options), **common)

    @classmethod
    def check_run(cls, options: KnapSpecOptions, layers: int, budget: int | None = None) -> None:
        """:func:`check_skip_layers` (the skip set itself is searched)."""
        check_skip_layers(options.skip_layers, layers)

    @classmethod
    def needs_profile(cls, options: KnapSpecOptions) -> tuple[str, str] | None:
        if options.selection == "knapspec":
            return "selection=knapspec", KNAPSPEC_NEEDS_PROFILE
        return super().needs_profile(options)

    # --- the schedule ----------------------------------------------------------------------------
    def step(self, state: DecodeState, budget: int) -> list[int]:
        state.example.steps += 1
        return super().step(state, budget)

    def after_plain_step(self, state: DecodeState) -> None:
        """A gated plain step breaks the window's consecutive tokens: it starts again."""
        state.example.window.clear()

    def finish(self, state: DecodeState) -> None:
        super().finish(state)
        state.stats["skip_searches"] = sum(1 for t in state.trace if (t.controller or {}).get("search"))


class CLaSp(KnapSpec):
    """CLaSp: :class:`KnapSpec` with ``selection: clasp`` (module docstring)."""

    name = "clasp"
    title = "CLaSp"

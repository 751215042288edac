"""SWIFT: on-the-fly self-speculative decoding with a layer set optimised as it decodes (Xia et al.,
ICLR 2025, arXiv 2410.06916; code hemingkx/SWIFT).

**Draft model** (§3.1): the target with attention and MLP sublayers skipped separately, never in the
first or the last layer; it starts with both sublayers of every odd layer skipped (1, 3, …, L − 3;
the authors' initialisation), or with ``skip_attn`` / ``skip_mlp`` when given (their cached sets).

**Layer set optimisation** (§3.2, ``swift_optimization``): after a step, once more than
``context_window + 1`` tokens have been generated and while the optimisation is on, every
``opt_interval``-th step proposes one candidate set of ``int(2·(L − 2)·skip_ratio)`` sublayers, by
random search or, every ``bayes_interval``-th iteration, by Bayesian optimisation (a Gaussian
process with UCB, κ = 2.5, over one coordinate per sublayer in [0, 1]; the set is the largest
coordinates), and scores it by its *matchness*: one teacher-forced pass of the draft model over the
first ``context_window + 1`` generated tokens, after the prompt's cache, counting the positions where
its argmax is the token that followed. A candidate that scores higher than the best so far replaces
the set, else the set stays. The optimisation stops for good when the score passes ``max_score``,
after more than ``max_tolerance_iter`` iterations without improvement, or after more than
``max_opt_iter``. The authors keep this state over the prompts of a task stream
(``search_state: stream``, their default; ``example`` starts it again at every example); the random
search draws from ``np.random.RandomState(seed)``, the authors' seeded global stream.

**Drafting and verification** (§3.3): from the pending token, a top-1 chain of at most ``max_draft``
drafts with the draft model, stopping after a draft whose confidence (the unwarped probability of
the chain's token) is below the draft-stop threshold (0.8), and, as the authors' loop does, once
the drafts reach the token budget (at least one draft). The verification tree puts beside the
chain's token at each depth its draft's next-ranked tokens, as many as that depth's confidence asks
for (greedy: 3, 5, 8, 10 tokens for > 0.95, > 0.8, > 0.5, else; sampling: 1, 3, 5, 10), and the full
model verifies every node in one tree-attention pass (:func:`~selfspec.decoding.tree.chain_tree`).
Greedy: the deepest path whose tokens are the target's argmax, then the target's next token, so
the output is vanilla's. Sampling: the siblings are drawn without replacement from the warped
draft distribution and verified by recursive rejection sampling
(:func:`~selfspec.decoding.sampling.multi_candidate_verify`), which keeps the target distribution.
The authors draw the token after a fully accepted path from the *unwarped* target distribution;
selfspec draws it from the warped one (the target distribution the run asked for).

The draft model, its draft-stop rule and the optimisation are the decoder's drafter, a part of it
(:class:`LayerSetDrafter`, whose search and rule carry over between examples); the verification
around it is the tree step PPD's is too (:func:`~selfspec.decoding.tree.verify_tree`). The
optimisation is charged to the ledger's ``search`` component, the tree's layout to ``tree``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from selfspec.config import checks
from selfspec.config.options import key, nullable
from selfspec.decoding.base import DecodeState, Decoder
from selfspec.decoding.carried import Carries
from selfspec.decoding.draft_exit import DraftStop, StopOptions, draft_stop_option, new_rule
from selfspec.decoding.part_options import Gated, QuantisedDraft
from selfspec.decoding.sampling import argmax, draw_distinct, multi_candidate_verify, sample_from, warp
from selfspec.decoding.tree import TreeLayout, accepted_node, candidate_tokens, chain_tree, layout, verify_tree
from selfspec.models.heads import draft_logits
from selfspec.models.layered import LayeredModel, Pass, Rows, SkipSet
from selfspec.models.ledger import phase

log = logging.getLogger(__name__)

#: candidates per draft depth, read at the depth's top-1 confidence (``get_choices_list``)
TOPK = 10
GREEDY_WIDTHS = ((0.95, 3), (0.8, 5), (0.5, 8), (-math.inf, 10))
SAMPLING_WIDTHS = ((0.95, 1), (0.8, 3), (0.5, 5), (-math.inf, 10))
#: tree layouts a decoder keeps (:meth:`Swift.tree`)
KEPT_LAYOUTS = 256
#: ``search_state`` values: the optimisation carries over the examples of a run, or restarts at each
SEARCH_STATES = ("stream", "example")


def check_layers(layers: int, skip_attn, skip_mlp) -> None:
    """Refuse a model of fewer than 3 layers, and a starting set naming the first, the last or no
    layer of ``layers``, naming the key."""
    if layers < 3:
        raise checks.ConfigError(f"method=swift needs a model of at least 3 layers (it never skips the first or the "
                                 f"last layer); the model has {layers}: choose a deeper model (a random one's "
                                 "model.random.num_hidden_layers) or another method")
    for key_name, value in (("skip_attn", skip_attn), ("skip_mlp", skip_mlp)):
        if value is not None:
            checks.listed(checks.integer, f"method.{key_name}", value, 1, layers - 2,
                          why=f"SWIFT never skips the first or the last layer; the model has {layers} layers")


def tree_width(confidence: float, greedy: bool) -> int:
    """How many candidates a draft depth of top-1 ``confidence`` gets (module docstring)."""
    return next(k for floor, k in (GREEDY_WIDTHS if greedy else SAMPLING_WIDTHS) if confidence > floor)


def initial_skip(num_layers: int) -> SkipSet:
    """The authors' starting set: both sublayers of every odd layer but the last."""
    odd = range(1, num_layers - 1, 2)
    return SkipSet.of(odd, odd)


def set_of_point(point: dict[str, float], count: int, num_layers: int) -> SkipSet:
    """The skip set of a Bayesian optimisation point: its ``count`` largest coordinates (``x_i``,
    ``i < L − 2``: layer ``i + 1``'s attention; after: its MLP; ``layer_bayes_search``)."""
    chosen = {k for k, _ in sorted(point.items(), reverse=True, key=lambda item: item[1])[:count]}
    inner = num_layers - 2
    return SkipSet.of([i + 1 for i in range(inner) if f"x{i}" in chosen],
                      [i + 1 for i in range(inner) if f"x{inner + i}" in chosen])


def point_of_set(skip: SkipSet, num_layers: int) -> dict[str, float]:
    """A skip set as a Bayesian optimisation point (``get_next_point_to_probe``)."""
    inner = num_layers - 2
    return {**{f"x{i}": float(i + 1 in skip.attn) for i in range(inner)},
            **{f"x{inner + i}": float(i + 1 in skip.mlp) for i in range(inner)}}


@dataclass
class LayerSearch:
    """The layer set optimisation's state (§3.2): the set in use, the best matchness so far, the
    iteration counters, and the random and Bayesian proposers."""

    skip: SkipSet
    rng: np.random.RandomState
    bayes: Any
    best: float = 0.0
    iteration: int = 0
    tolerance: int = 0
    active: bool = True
    #: the latest iteration, for the step trace
    last: dict | None = field(default=None, compare=False)


@dataclass
class SwiftExample:
    """One example's state: its steps so far (the authors' ``idx``)."""

    steps: int = 0


@dataclass(frozen=True)
class SwiftOptions(Gated, QuantisedDraft):
    """Keys (conf/method/swift*.yaml): ``max_draft`` (25), ``draft_stop`` (the shared sub-config;
    static 0.8), the layer set optimisation's (module docstring; ``bayes_interval`` null = random
    search only, ``optimize: false`` = keep the starting set), the starting set (``skip_attn`` /
    ``skip_mlp``, null = every odd layer), ``never_slower`` and ``draft_weights`` (beyond the paper: the
    drafts, and the matchness the search scores them by, read that quantised copy of the weights)."""

    max_draft: int = key(checks.integer, 1, why="the longest draft chain")
    draft_stop: StopOptions | None = key(draft_stop_option)
    skip_ratio: float = key(checks.number, 0.0, 1.0, why="share of the 2(L - 2) inner sublayers a candidate set skips")
    context_window: int = key(checks.integer, 1, why="generated tokens the matchness is scored on, less one")
    opt_interval: int = key(checks.integer, 1, why="steps between optimisation iterations")
    bayes_interval: int | None = key(nullable(checks.integer), 1,
                                     why="every n-th iteration proposes by Bayesian optimisation")
    max_opt_iter: int = key(checks.integer, 0)
    max_tolerance_iter: int = key(checks.integer, 0)
    max_score: float = key(checks.number, 0.0, 1.0, why="matchness at which the optimisation stops")
    seed: int = key(checks.integer, 0, 2 ** 32 - 1, why="the random search's numpy.random.RandomState seed")
    search_state: str = key(checks.choice, SEARCH_STATES,
                            why="stream: carried over the examples (the authors'); example: restarted at each")
    optimize: bool = key(checks.flag, why="search the layer set while decoding")
    skip_attn: list[int] | None = key(nullable(checks.integers))
    skip_mlp: list[int] | None = key(nullable(checks.integers))


class LayerSetDrafter(Carries):
    """SWIFT's drafter, a part of its decoder as a chain method's drafter is of its
    (:class:`~selfspec.decoding.chain.Drafter`): the model with the sublayers of the search's set left
    out drafts a top-k chain (§3.3, :meth:`draft`) until its draft-stop rule stops it, and the set is
    optimised as it decodes (§3.2, :meth:`update`). The search and the draft-stop rule are its policy
    state, carried over between examples (:mod:`selfspec.decoding.carried`)."""

    carries = ("search", "draft_stop")

    def __init__(self, model: LayeredModel, options: SwiftOptions) -> None:
        self.model, self.options = model, options
        self.max_draft = options.max_draft
        self.draft_stop: DraftStop = new_rule(options.draft_stop)
        if options.skip_attn is None and options.skip_mlp is None:
            self.start = initial_skip(model.num_layers)
        else:
            self.start = SkipSet.of(options.skip_attn or (), options.skip_mlp or ())
        self.skip_count = int((model.num_layers - 2) * 2 * options.skip_ratio)
        self.search = self.new_search()

    def start_example(self) -> None:
        """An example starts: the draft-stop rule is told, and the search starts again under
        ``search_state: example``."""
        self.draft_stop.start_example()
        if self.options.search_state == "example":
            self.search = self.new_search()

    # --- the layer set optimisation (§3.2) -------------------------------------------------------
    def new_search(self) -> LayerSearch:
        """A fresh optimisation from the starting set."""
        bayes = None
        if self.options.bayes_interval is not None:
            from bayes_opt import BayesianOptimization
            from bayes_opt.acquisition import UpperConfidenceBound

            inner = self.model.num_layers - 2
            bayes = BayesianOptimization(f=None, pbounds={f"x{i}": (0.0, 1.0) for i in range(2 * inner)},
                                         acquisition_function=UpperConfidenceBound(kappa=2.5), random_state=1,
                                         verbose=0, allow_duplicate_points=True)
            bayes.set_gp_params(alpha=1e-2)
        return LayerSearch(self.start, np.random.RandomState(self.options.seed), bayes)

    def propose(self, search: LayerSearch) -> tuple[SkipSet, dict[str, float], str]:
        """The iteration's candidate set, its point for the Gaussian process, and how it came."""
        n_layers = self.model.num_layers
        every = self.options.bayes_interval
        if every is not None and (search.iteration + 1) % every == 0:
            point = search.bayes.suggest()
            return set_of_point(point, self.skip_count, n_layers), point, "bayes"
        inner = n_layers - 2
        chosen = set(search.rng.choice(2 * inner, self.skip_count, replace=False).tolist())
        skip = SkipSet.of([i + 1 for i in range(inner) if i in chosen],
                          [i + 1 for i in range(inner) if inner + i in chosen])
        return skip, point_of_set(skip, n_layers), "random"

    def matchness(self, state: DecodeState, generated: list[int], skip: SkipSet) -> float:
        """The share of the first ``context_window`` generated tokens after the first that the draft
        model with ``skip`` predicts, teacher-forced, reading the prompt's cache only: a scratch pass
        (:meth:`~selfspec.models.passes.Rows.scratch`: on a capturing model a static-shape one, its K/V
        past the cache's positions and its lengths kept)."""
        model, start = self.model, state.prompt_len
        ids = torch.tensor([generated[: self.options.context_window + 1]], device=model.device)
        n = ids.shape[1]
        rows = torch.arange(n, device=model.device)
        causal = Rows.scratch(start, rows, rows.unsqueeze(1) >= rows.unsqueeze(0))
        weights = self.options.draft_weights
        out = model.forward(model.embed(ids), state.cache, Pass(skip=skip, rows=causal, weights=weights),
                            ledger=state.ledger, joins=state.joins)
        predicted = argmax(draft_logits(model, out, ledger=state.ledger, weights=weights, joins=state.joins)[0])
        return (predicted[:-1] == ids[0, 1:]).sum().item() / (n - 1)

    def optimization_step(self, state: DecodeState, generated: list[int]) -> None:
        """One iteration of the layer set optimisation (module docstring; the authors'
        ``swift_optimization``), after a step."""
        search, o = self.search, self.options
        skip, point, how = self.propose(search)
        score = self.matchness(state, generated, skip)
        if search.bayes is not None:  # a set seen before is registered again (the authors'), quietly
            with contextlib.redirect_stdout(io.StringIO()):
                search.bayes.register(params=point, target=score)
        if score > search.best:
            search.best, search.tolerance, search.skip = score, 0, skip
            if score > o.max_score:
                search.active = False
        else:
            search.tolerance += 1
        search.iteration += 1
        if search.tolerance > o.max_tolerance_iter or search.iteration > o.max_opt_iter:
            search.active = False
        search.last = {"iteration": search.iteration, "proposal": how, "matchness": score, "best": search.best,
                       "skip_attn": sorted(search.skip.attn), "skip_mlp": sorted(search.skip.mlp),
                       "active": search.active}

    # --- drafting (§3.3) -----------------------------------------------------------------------
    def draft(self, state: DecodeState, budget: int
              ) -> tuple[torch.Tensor, list[float], list[torch.Tensor], list[int]]:
        """The top-1 chain from the pending token with the current set: per depth its ``TOPK``
        candidates (greedy: the top ranks; sampling: drawn without replacement from the warped
        draft distribution, whose rows are returned, as many as its support holds), the chain
        token's confidence, and how many candidates each depth has."""
        model, ledger, greedy = self.model, state.ledger, state.sampling.greedy
        weights = self.options.draft_weights
        p, threshold = Pass(skip=self.search.skip, weights=weights), self.draft_stop.threshold()
        ids = torch.empty((1, 1), dtype=torch.long, device=model.device)
        token, rows, confidences, qs, drawn = state.pending, [], [], [], []
        width = min(TOPK, model.vocab_size)
        for j in range(min(self.max_draft, max(budget, 1))):
            ids.fill_(token)
            h = model.forward(ids, state.cache, p, start=state.n_cached + j, ledger=ledger, joins=state.joins)
            logits = draft_logits(model, h[:, -1], ledger=ledger, weights=weights, joins=state.joins)[0]
            if greedy:
                top = logits.topk(width).indices
                n = width
            else:  # as many as the warped distribution's support holds (top-k, top-p)
                q = warp(logits, state.sampling, ledger)
                n = min(width, int((q > 0).sum()))
                top = draw_distinct(q, n, state.generator)
                top = torch.cat([top, top[-1:].expand(width - n)])  # padding no tree reads
                qs.append(q)
            conf, token = torch.stack([logits.softmax(-1)[top[0]], top[0].to(logits.dtype)]).tolist()
            token = int(token)
            rows.append(top)
            confidences.append(conf)
            drawn.append(n)
            if conf < threshold:
                break
        return torch.stack(rows), confidences, qs, drawn

    def update(self, state: DecodeState, chain: int, accepted: list[int]) -> None:
        """Learn from a verification of a chain of ``chain`` drafts whose tree gave ``accepted``: the
        draft-stop rule's update, then, when one is due (module docstring), an iteration of the
        layer set optimisation over the generated tokens, charged to ``search``."""
        self.draft_stop.update(chain, len(accepted), chain == self.max_draft)
        search, o, example = self.search, self.options, state.example
        if (o.optimize and search.active and example.steps % o.opt_interval == 0
                and len(state.tokens) - state.prompt_len + len(accepted) > o.context_window + 1):
            with phase(state.ledger, "search"):
                self.optimization_step(state, state.tokens[state.prompt_len:] + accepted)
        example.steps += 1

    def controller(self, chain: int) -> dict[str, Any]:
        """The step trace's controller after :meth:`update`: the chain's length, the set's size, the
        search's iteration if one ran (reported once) and the draft-stop rule's state."""
        search = self.search
        out = {"chain": chain, "skipped": len(search.skip), **({"search": search.last} if search.last else {}),
               **(self.draft_stop.state() or {})}
        search.last = None
        return out


class Swift(Decoder):
    """SWIFT (module docstring): a tree step around its drafter (:class:`LayerSetDrafter`)."""

    name = "swift"
    title = "SWIFT"
    lossless = True
    Options = SwiftOptions

    def __init__(self, model: LayeredModel, options: SwiftOptions, **common) -> None:
        """``options``: the method's checked keys (:class:`SwiftOptions`), read as ``self.options``."""
        super().__init__(model, **common)
        check_layers(model.num_layers, options.skip_attn, options.skip_mlp)
        self.options = options
        self.drafter = LayerSetDrafter(model, options)
        self.lookahead = 1 + TOPK * options.max_draft  # the drafts' scratch K/V, then the tree's rows
        self._layouts: dict[tuple[int, ...], TreeLayout] = {}

    @classmethod
    def check_run(cls, options: SwiftOptions, layers: int, budget: int | None = None) -> None:
        """The layers (:func:`check_layers`); and a ``context_window`` that ``budget`` never fills,
        which leaves the optimisation off (issue 52: it was off without a word), is said."""
        check_layers(layers, options.skip_attn, options.skip_mlp)
        if budget is not None and options.optimize and budget <= options.context_window + 1:
            log.warning("method swift: the layer set optimisation needs more than method.context_window + 1 = %d "
                        "generated tokens, and max_new_tokens=%d never gives them: it never runs, and SWIFT drafts "
                        "with its starting set (lower method.context_window or raise max_new_tokens to search; "
                        "method.optimize=false says it is meant)", options.context_window + 1, budget)

    @property
    def parts(self) -> tuple[Any, ...]:
        """The decoder's parts and its drafter."""
        return (*super().parts, self.drafter)

    def carried(self) -> list[str]:
        """As every decoder's, less the layer search where it starts again at every example anyway
        (``search_state: example``)."""
        return [n for n in super().carried()
                if not (n == "drafter.search" and self.options.search_state == "example")]

    @classmethod
    def from_config(cls, model: LayeredModel, options: SwiftOptions, **common) -> "Swift":
        return cls(model, options, **common)

    # --- a step (§3.3) -------------------------------------------------------------------------
    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        self.drafter.start_example()
        state.example = SwiftExample()

    def tree(self, widths: tuple[int, ...]) -> TreeLayout:
        """The layout of the tree of ``widths`` (kept: a few shapes recur; at most
        :data:`KEPT_LAYOUTS` of them, the oldest dropped first)."""
        lay = self._layouts.pop(widths, None) or layout(chain_tree(widths), 1, self.model.device)
        self._layouts[widths] = lay
        if len(self._layouts) > KEPT_LAYOUTS:
            del self._layouts[next(iter(self._layouts))]
        return lay

    def step(self, state: DecodeState, budget: int) -> list[int]:
        model, drafter, greedy = self.model, self.drafter, state.sampling.greedy
        with phase(state.ledger, "draft"):
            table, confidences, qs, drawn = drafter.draft(state, budget)
        with phase(state.ledger, "tree"):
            lay = self.tree(tuple(min(tree_width(c, greedy), n) for c, n in zip(confidences, drawn)))
            tokens = torch.cat([state.pending_ids(model.device)[0], candidate_tokens(lay, table)])
        _, _, path, bonus = verify_tree(model, state, lay, tokens.unsqueeze(0),
                                        lambda logits: self.verify(lay, tokens, logits, qs, state), "self")
        accepted = tokens[path].tolist()
        drafter.update(state, len(confidences), accepted)
        step = state.trace_step
        step.draft_limit = drafter.max_draft
        step.controller = drafter.controller(len(confidences))
        return accepted + [bonus]

    def verify(self, lay: TreeLayout, tokens: torch.Tensor, logits: torch.Tensor, qs: list[torch.Tensor],
               state: DecodeState) -> tuple[int, int]:
        """The accepted node and the token after it: greedy, the deepest path of target argmaxes;
        sampling, recursive rejection sampling of each depth's siblings (module docstring)."""
        s = state.sampling
        if s.greedy:
            target = argmax(logits)
            best = accepted_node(lay, target[lay.parent[1:]] == tokens[1:])
            best, bonus = torch.stack([best, target[best]]).tolist()
            return best, bonus
        ids, depths = tokens.tolist(), lay.depths.tolist()  # read once, not per node
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(lay.parent.tolist()[1:], start=1):
            children.setdefault(parent, []).append(node)
        node = 0
        while True:
            p = warp(logits[node: node + 1], s, state.ledger)[0]
            kids = children.get(node)
            if not kids:
                return node, sample_from(p, state.generator)
            j, p = multi_candidate_verify(p, [ids[k] for k in kids], qs[depths[node]], state.generator)
            if j is None:
                return node, sample_from(p, state.generator)
            node = kids[j]

    def finish(self, state: DecodeState) -> None:
        search = self.drafter.search
        state.stats.update({"swift_best_matchness": search.best, "swift_iterations": search.iteration,
                            "swift_optimising": search.active, "skipped": len(search.skip)})

"""Parallel Prompt Decoding (PPD, Chen et al.; §3 and §4 of the paper).

Every step is **one forward pass** over (PPD §3, Figure 2):

1. the root — the last committed token (the loop's *pending* token);
2. the candidate tree of the current state: candidate tokens = the top-k guesses of the
   prompt tokens attached to the node accepted in the previous step (depth ``d`` from prompt
   token ``d``);
3. prompt tokens (each with its EPTs) appended to the tree nodes, as the state's
   :class:`~selfspec.decoding.tree.SparseTree` prescribes,

with the tree attention mask and tree position ids of :mod:`selfspec.decoding.tree`. Then:

* **verification** (PPD §3, "candidate verification"): greedy = exact match of every candidate
  with the model's argmax after its parent; sampling = *typical acceptance* (Medusa): accept
  ``x`` after a parent with target distribution ``p`` iff ``p(x) > min(ε, α·exp(−H(p)))``
  (ε = ``posterior_threshold``, α = ``posterior_alpha``). **Typical acceptance is not
  lossless**: under sampling the output does not follow the target distribution, and the
  decoder says so in its statistics (``lossless: False``).
* the longest accepted path is committed, plus the bonus token from the model's logits at the
  accepted node; the cache keeps the root and that path (``LayerCache.gather``) and drops the rest;
* the accepted node's prompt tokens (EPT logits averaged) give the next candidates, and the
  number of prompt tokens it carried is the next **state** (PPD §4, dynamic sparse tree); the
  step's trace records it (``controller: {"state": k}``).

**State 0** (``state_zero``, beyond the paper). The paper's dynamic sparse tree has states
``1…m`` (Definition 4.1): the root carries all ``m`` prompt tokens and every candidate at least
one, and the authors' code lays out any tree so. selfspec's tree builder may also trade a node's
last prompt token (the root's too) for candidates; accepting such a node leads to state 0, whose
tree is the root and its prompt tokens only. ``state_zero: false`` (``ppd_paper``) lays out every
tree the paper's way (:func:`~selfspec.decoding.tree.paper_states`) and rebuilds trees for
``tree_size`` under the paper's rule.

Under greedy decoding the output equals vanilla token for token.

**Drafts from the context** (``ngram``, beyond the papers; null = off, the paper's PPD). When the
n-gram lookup of :mod:`selfspec.decoding.ngram` matches the prompt and the generated text, its
draft joins the step's tree as one more branch from the root: a chain of up to ``max_draft``
nodes whose last node carries the ``m`` prompt tokens (a fully accepted chain continues in state
``m``; a partly accepted one in state 0). The chain is verified with the tree's other candidates
in the same forward pass and by the same rule, so greedy output is still vanilla's. The tree of
each (state, chain length) is laid out once and kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from selfspec.config import checks
from selfspec.config.options import key, nullable
from selfspec.decoding.base import DecodeState, Decoder
from selfspec.decoding.ngram import NgramIndex
from selfspec.decoding.part_options import Gated, LookupOptions, context_drafts
from selfspec.decoding.sampling import argmax, select, warp
from selfspec.decoding.tree import (SparseTree, TreeLayout, accepted_node, candidate_tokens, check_trees, layout,
                                    paper_states, verify_tree)
from selfspec.models.ledger import phase
from selfspec.models.passes import Pass, Rows
from selfspec.models.prompts import PromptTokens
from selfspec.store.artefacts import artefact_option


def typical_accept(probs: torch.Tensor, tokens: torch.Tensor, threshold: float, alpha: float) -> torch.Tensor:
    """Typical acceptance (Medusa §2.3.1, used by PPD under sampling): ``probs`` ``[n, V]`` the
    target distributions of the parents, ``tokens`` ``[n]`` -> bool ``[n]``."""
    entropy = -torch.special.xlogy(probs, probs).sum(-1)
    p = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return p > torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))


@dataclass
class PPDExample:
    """Per-example state (``DecodeState.example``): the accepted node's guesses ``[m, top_k]``
    (None in state 0), the dynamic sparse tree's state (prompt tokens the node carried) and the
    context drafts' n-gram index (None when ``ngram`` is off)."""

    cands: torch.Tensor | None = None
    tree_state: int = 0
    index: NgramIndex | None = None


@dataclass(frozen=True)
class PPDOptions(Gated):
    """Keys (conf/method/ppd.yaml): the ``prompts`` and ``tree`` artefacts (null = the default
    ones for the model), typical acceptance's ``posterior_threshold`` in (0, 1] and
    ``posterior_alpha`` > 0, ``tree_size`` (>= 1, or null = the size the ppd_tree job chose),
    ``ngram`` (null, or the n-gram lookup's keys:
    :func:`~selfspec.decoding.part_options.context_drafts`), ``state_zero`` (true / false, module
    docstring) and ``never_slower``."""

    prompts: Path | None = key(artefact_option, "prompts")
    tree: Path | None = key(artefact_option, "ppd_tree")
    posterior_threshold: float = key(checks.probability, low_open=True, why="typical acceptance's ε")
    posterior_alpha: float = key(checks.number, 0, low_open=True, why="typical acceptance's α")
    tree_size: int | None = key(nullable(checks.integer), 1,
                                why="tokens per forward; null = the size the ppd_tree job chose")
    ngram: LookupOptions | None = key(context_drafts)
    state_zero: bool = key(checks.flag, why="false = the paper's states 1..m: the root carries every prompt token, "
                                            "each candidate at least one")


class PPD(Decoder):
    """PPD decoder over a dynamic sparse tree (one :class:`SparseTree` per state ``0…m``)."""

    name = "ppd"
    title = "PPD"
    #: greedy PPD is lossless (exact match); under sampling typical acceptance is NOT
    #: (:meth:`~selfspec.decoding.base.Decoder.lossless_under`), and :meth:`begin` records
    #: ``lossless: False`` in the statistics of such generations.
    lossless = True
    lossless_sampling = False
    Options = PPDOptions

    def __init__(
        self,
        model,
        prompts: PromptTokens,
        trees: dict[int, SparseTree],
        posterior_threshold: float,
        posterior_alpha: float,
        ngram: LookupOptions | None,
        state_zero: bool,
        **common,
    ) -> None:
        super().__init__(model, **common)
        if prompts.hidden_size != model.hidden_size:
            raise ValueError(f"prompt embeddings have hidden size {prompts.hidden_size}, model "
                             f"{model.name!r} has {model.hidden_size}; use prompts trained for this model")
        check_trees(trees, prompts.m)
        self.prompts = prompts
        #: whether a node may carry no prompt tokens (state 0) and the root fewer than ``m`` (module docstring)
        self.state_zero = bool(state_zero)
        self.trees = dict(trees) if state_zero else {k: paper_states(t, prompts.m) for k, t in trees.items()}
        self.threshold = float(posterior_threshold)
        self.alpha = float(posterior_alpha)
        self.layouts: dict[int, TreeLayout] = {
            k: layout(t, prompts.n_ept, model.device) for k, t in self.trees.items()
        }
        self.top_k = 1 + max(t.max_rank for t in self.trees.values())
        #: the n-gram lookup's settings (``min_ngram``, ``max_ngram``, ``max_draft``); None = off
        self.ngram = ngram
        chain = ngram.max_draft if ngram else 0
        self.lookahead = max(max(l.size for l in self.layouts.values()) + chain + prompts.m * prompts.n_ept,
                             prompts.m * prompts.n_ept)
        self._with_chain: dict[tuple[int, int], TreeLayout] = {}

    @classmethod
    def from_config(cls, model, options: PPDOptions, **common) -> "PPD":
        from selfspec.decoding.tree import load_trees
        from selfspec.models.prompts import load_prompts
        from selfspec.store.artefacts import default_artefact_dir

        prompts_path = options.prompts or default_artefact_dir("prompts", model.name)
        tree_path = options.tree or default_artefact_dir("ppd_tree", model.name)
        for what, path, job in (("prompts", prompts_path, "prompts"), ("tree", tree_path, "ppd_tree")):
            if not path.exists():
                raise FileNotFoundError(
                    f"ppd needs a {what} artefact at {path}; build it with "
                    f"`python -m selfspec.train job={job} model={model.name}` or set method.{what}=<dir>"
                )
        prompts = load_prompts(prompts_path, model=model)
        trees, meta = load_trees(tree_path, model)
        if options.tree_size is not None:  # another size than the hardware-aware choice (PPD Fig. 8c)
            from selfspec.decoding.tree_builder import trees_for_size
            from selfspec.store.artefacts import load_artefact

            stats = load_artefact(tree_path, "ppd_tree").tensors["accept_probs"]
            trees = trees_for_size(stats, options.tree_size, prompts.m, prompts.n_ept, options.state_zero)
        return cls(model, prompts, trees, options.posterior_threshold, options.posterior_alpha,
                   options.ngram, options.state_zero, reads={"prompts": prompts_path, "tree": tree_path}, **common)

    # --- hooks ----------------------------------------------------------------------------------
    def begin(self, state: DecodeState) -> None:
        index = NgramIndex(self.ngram.min_ngram, self.ngram.max_ngram) if self.ngram else None
        state.example = PPDExample(index=index)
        if index is not None:
            state.stats.update(ngram_steps=0, ngram_accepted=0)
        state.stats["lossless"] = self.lossless_under(state.sampling)
        state.stats["acceptance"] = "exact" if state.sampling.greedy else "typical"

    def prefill(self, state: DecodeState, prompt: torch.Tensor) -> int:
        """Prompt, then all ``m`` prompt tokens attached to its last token (state ``m`` next).

        The prompt runs alone, exactly as vanilla's prefill (the same pass, hence the same cached
        K/V and first token, bit for bit, in bfloat16 too); the prompt tokens follow in a second,
        short pass over it. Where state ``m``'s tree has no candidates (a hardware-aware tree of
        size 1: speculation does not pay on this machine, PPD §4.2) their guesses would never be
        read, so that pass is not run."""
        m, ex, k = self.model, state.example, self.prompts.m
        n = prompt.shape[1]
        h = m.forward(prompt, state.cache, start=0, ledger=state.ledger, joins=state.joins)
        first = int(select(m.logits(h[:, n - 1], state.ledger, state.joins), state.sampling, state.generator,
                           state.ledger)[0])
        if self.trees[k].nodes:
            lay = layout(SparseTree((), (k,)), self.prompts.n_ept, m.device)
            # the prompt tokens hang off the prompt's last token (cached at n - 1): a tree without its root
            extra = m.forward(self.prompts.chain().unsqueeze(0), state.cache,
                              Pass(rows=Rows.tree(lay.offsets[1:] - 1, lay.mask[1:, 1:])), start=n, ledger=state.ledger,
                              joins=state.joins)
            state.cache.truncate(n)
            self._next_candidates(ex, extra[0], lay.prompt_rows[0] - 1, state.ledger, state.joins)
        else:
            ex.cands, ex.tree_state = None, k
        state.trace_step.controller = {"state": ex.tree_state}
        return first

    def _next_candidates(self, ex: PPDExample, hidden: torch.Tensor, rows: torch.Tensor, ledger=None,
                         joins=None) -> None:
        """Top-k guesses of the accepted node's prompt tokens (EPT logits averaged, PPD §3.2; the head
        recorded in ``ledger`` when given, its product joining ``joins``, the generation's batch)."""
        ex.tree_state = int(rows.shape[0])
        if ex.tree_state == 0:
            ex.cands = None
            return
        logits = PromptTokens.ensemble(self.model.logits(hidden[rows.reshape(-1)], ledger, joins).view(*rows.shape, -1))
        ex.cands = logits.topk(self.top_k, dim=-1).indices

    @classmethod
    def new_gate(cls, profile=None):
        """PPD's gate: a probe lasts 4 steps (the first PPD step after plain steps starts from
        state 0, where it only computes guesses)."""
        from selfspec.decoding.gate import SpeculationGate

        return SpeculationGate(probe_steps=4, profile=profile)

    def speculated(self, state: DecodeState) -> bool:
        """A PPD step costs its tree's width even when the tree has no candidates."""
        return True

    def after_plain_step(self, state: DecodeState) -> None:
        """The next PPD step after a gated plain one starts from state 0."""
        state.example.cands, state.example.tree_state = None, 0

    def step(self, state: DecodeState, budget: int) -> list[int]:
        m, ex = self.model, state.example
        with phase(state.ledger, "tree"):  # the step's tree: context drafts, layout, candidates, inputs
            drafts = ex.index.lookup(state.tokens, min(self.ngram.max_draft, budget - 1))[0] if ex.index else []
            lay = self._layout(ex.tree_state, len(drafts))
            root = state.pending_ids(m.device)[0]
            tokens = (torch.cat([root, candidate_tokens(lay, self._guesses(ex.cands, drafts))])
                      if lay.n_nodes > 1 else root)
            h = m.embed(tokens.unsqueeze(0))
            if lay.size > lay.n_nodes:
                h = torch.cat([h, self.prompts.gather(lay.prompt_p, lay.prompt_e).unsqueeze(0)], dim=1)
        # one pass verifies the candidates and runs the prompt tokens
        h, best, path, bonus = verify_tree(m, state, lay, h, lambda logits: self._verify(lay, tokens, logits, state),
                                           "tree")
        with phase(state.ledger, "draft"):  # the next step's guesses: the prompt tokens' logits
            self._next_candidates(ex, h, lay.prompt_rows[best], state.ledger, state.joins)
        state.trace_step.controller = {"state": ex.tree_state}
        state.count("tree_tokens", lay.size)
        if drafts:
            state.count("ngram_steps")
            if best and lay.tree.paths[best][0] == self.top_k:  # a chain node: its path is context drafts
                state.count("ngram_accepted", len(path))
        return tokens[path].tolist() + [bonus]

    def _layout(self, tree_state: int, chain: int) -> TreeLayout:
        """The layout of state ``tree_state``'s tree, with a chain of ``chain`` context drafts off
        the root (module docstring). The chain's nodes are rank paths ``(R,) … (R,)*chain`` with
        ``R = top_k``: a column of the guess table past the prompt tokens' top-k
        (:meth:`_guesses`), so no chain node is a node of the tree."""
        if not chain:
            return self.layouts[tree_state]
        key = (tree_state, chain)
        if key not in self._with_chain:
            tree = self.trees[tree_state]
            marker = (self.top_k,)
            prompts_of = dict(zip(tree.paths, tree.prompts))
            prompts_of[marker * chain] = self.prompts.m
            nodes = [*tree.nodes, *(marker * d for d in range(1, chain + 1))]
            self._with_chain[key] = layout(SparseTree.with_prompts(nodes, prompts_of), self.prompts.n_ept,
                                           self.model.device)
        return self._with_chain[key]

    def _guesses(self, cands: torch.Tensor | None, drafts: list[int]) -> torch.Tensor | None:
        """The ``[depth, rank]`` guess table of this step: the prompt tokens' top-k ``cands``, plus
        the context drafts as column ``top_k`` (``drafts[d]`` is the guess at depth ``d + 1``)."""
        if not drafts:
            return cands
        rows = max(len(drafts), self.prompts.m)
        table = torch.zeros(rows, self.top_k + 1, dtype=torch.long, device=self.model.device)
        if cands is not None:
            table[: cands.shape[0], : self.top_k] = cands
        table[: len(drafts), self.top_k] = torch.tensor(drafts, device=self.model.device)
        return table

    def _verify(self, lay: TreeLayout, tokens: torch.Tensor, logits: torch.Tensor, state: DecodeState):
        """-> (accepted node with the longest path, bonus token after it). One host sync for greedy."""
        s = state.sampling
        if lay.n_nodes == 1:
            return 0, int(select(logits[0], s, state.generator, state.ledger))
        cand = tokens[1:]
        parents = lay.parent[1:]
        if s.greedy:
            target = argmax(logits)
            ok = target[parents] == cand
        else:
            # only the parents' rows are read: the leaves' are never warped (each row warps alone,
            # so its bits are the same as in a warp of every row)
            rows, of_parent = torch.unique(parents, return_inverse=True)
            probs = warp(logits[rows], s, state.ledger)
            ok = typical_accept(probs[of_parent], cand, self.threshold, self.alpha)
        # first deepest (siblings carry different tokens, except a context draft that repeats a
        # guess: both paths then hold the same verified tokens)
        best = accepted_node(lay, ok)
        if s.greedy:  # one host sync
            best, bonus = torch.stack([best, target[best]]).tolist()
            return best, bonus
        best = int(best)
        return best, int(select(logits[best], s, state.generator, state.ledger))

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
  number of prompt tokens it carried is the next **state** (PPD §4, dynamic sparse tree).

Under greedy decoding the output equals vanilla token for token.
"""

from __future__ import annotations


import torch

from selfspec import checks
from selfspec.decoding.base import DecodeState, Decoder, register
from selfspec.decoding.sampling import select, warp
from selfspec.decoding.tree import SparseTree, TreeLayout, candidate_tokens, check_trees, full_mask, layout
from selfspec.prompts import PromptTokens


def typical_accept(probs: torch.Tensor, tokens: torch.Tensor, threshold: float, alpha: float) -> torch.Tensor:
    """Typical acceptance (Medusa §2.3.1, used by PPD under sampling): ``probs`` ``[n, V]`` the
    target distributions of the parents, ``tokens`` ``[n]`` -> bool ``[n]``."""
    entropy = -torch.special.xlogy(probs, probs).sum(-1)
    p = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return p > torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))


@register
class PPD(Decoder):
    """PPD decoder over a dynamic sparse tree (one :class:`SparseTree` per state ``0…m``)."""

    name = "ppd"
    #: greedy PPD is lossless (exact match); under sampling typical acceptance is NOT, and
    #: :meth:`finish` records ``lossless: False`` in the statistics of such generations.
    lossless = True
    lossless_sampling = False

    def __init__(
        self,
        model,
        prompts: PromptTokens,
        trees: dict[int, SparseTree],
        posterior_threshold: float = 0.09,
        posterior_alpha: float = 0.3,
        **common,
    ) -> None:
        super().__init__(model, **common)
        if prompts.hidden_size != model.hidden_size:
            raise ValueError(f"prompt embeddings have hidden size {prompts.hidden_size}, model "
                             f"{model.name!r} has {model.hidden_size}; use prompts trained for this model")
        check_trees(trees, prompts.m)
        self.prompts = prompts
        self.trees = dict(trees)
        self.threshold = float(posterior_threshold)
        self.alpha = float(posterior_alpha)
        self.layouts: dict[int, TreeLayout] = {
            k: layout(t, prompts.n_ept, model.device) for k, t in self.trees.items()
        }
        self.top_k = 1 + max(t.max_rank for t in self.trees.values())
        self.lookahead = max(max(l.size for l in self.layouts.values()), prompts.m * prompts.n_ept)
        self._cands: torch.Tensor | None = None  # [m, top_k] guesses of the accepted node
        self._state = 0

    @classmethod
    def options(cls, cfg, prefix: str = "method") -> dict:
        """Keys (conf/method/ppd.yaml): the ``prompts`` and ``tree`` artefacts (null = the default
        ones for the model), typical acceptance's ``posterior_threshold`` in (0, 1] and
        ``posterior_alpha`` > 0, and ``tree_size`` (>= 1, or null = the size the ppd_tree job chose)."""
        from selfspec.artefacts import artefact_option

        key = f"{prefix}.{{}}".format
        return {
            "prompts": artefact_option(key("prompts"), cfg.get("prompts"), "prompts"),
            "tree": artefact_option(key("tree"), cfg.get("tree"), "ppd_tree"),
            "posterior_threshold": checks.probability(key("posterior_threshold"), cfg.get("posterior_threshold", 0.09),
                                                      low_open=True, why="typical acceptance's ε"),
            "posterior_alpha": checks.number(key("posterior_alpha"), cfg.get("posterior_alpha", 0.3), 0,
                                             low_open=True, why="typical acceptance's α"),
            "tree_size": checks.optional(checks.integer, key("tree_size"), cfg.get("tree_size"), 1,
                                         why="tokens per forward; null = the size the ppd_tree job chose"),
        }

    @classmethod
    def from_config(cls, model, options: dict, **common) -> "PPD":
        from selfspec.artefacts import default_artefact_dir
        from selfspec.decoding.tree import load_trees
        from selfspec.prompts import load_prompts

        prompts_path = options["prompts"] or default_artefact_dir("prompts", model.name)
        tree_path = options["tree"] or default_artefact_dir("ppd_tree", model.name)
        for what, path, job in (("prompts", prompts_path, "prompts"), ("tree", tree_path, "ppd_tree")):
            if not path.exists():
                raise FileNotFoundError(
                    f"ppd needs a {what} artefact at {path}; build it with "
                    f"`python -m selfspec.train job={job} model={model.name}` or set method.{what}=<dir>"
                )
        prompts = load_prompts(prompts_path, model=model)
        trees, meta = load_trees(tree_path, model)
        if options["tree_size"] is not None:  # another size than the hardware-aware choice (PPD Fig. 8c)
            from selfspec.artefacts import load_artefact
            from selfspec.training.tree import trees_for_size

            stats = load_artefact(tree_path, "ppd_tree").tensors["accept_probs"]
            trees = trees_for_size(stats, options["tree_size"], prompts.m, prompts.n_ept)
        dec = cls(model, prompts, trees, options["posterior_threshold"], options["posterior_alpha"], **common)
        dec.artefacts = {"prompts": prompts_path, "tree": tree_path}  # lineage for the evaluation runner
        return dec

    # --- hooks ----------------------------------------------------------------------------------
    def begin(self, state: DecodeState) -> None:
        self._cands, self._state = None, 0
        state.stats["lossless"] = bool(state.sampling.greedy)
        state.stats["acceptance"] = "exact" if state.sampling.greedy else "typical"

    def prefill(self, state: DecodeState, prompt: torch.Tensor) -> int:
        """Prompt, then all ``m`` prompt tokens attached to its last token (state ``m`` next).

        The prompt runs alone, exactly as vanilla's prefill (the same pass, hence the same cached
        K/V and first token, bit for bit, in bfloat16 too); the prompt tokens follow in a second,
        short pass over it."""
        m = self.model
        n = prompt.shape[1]
        tree = SparseTree((), (self.prompts.m,))
        lay = layout(tree, self.prompts.n_ept, m.device)
        h = m.forward(prompt, state.cache, start=0)
        extra = m.forward(None, state.cache, start=n, mask=m.prepare_mask(full_mask(lay, n - 1)[1:]),
                          positions=(n - 1 + lay.offsets[1:]).unsqueeze(0), h=self.prompts.chain().unsqueeze(0))
        h = torch.cat([h, extra], dim=1)
        state.cache.truncate(n)
        first = int(select(m.logits(h[:, n - 1]), state.sampling, state.generator)[0])
        self._next_candidates(h[0], lay.prompt_rows[0] + (n - 1))
        return first

    def _next_candidates(self, hidden: torch.Tensor, rows: torch.Tensor) -> None:
        """Top-k guesses of the accepted node's prompt tokens (EPT logits averaged, PPD §3.2)."""
        self._state = int(rows.shape[0])
        if self._state == 0:
            self._cands = None
            return
        logits = PromptTokens.ensemble(self.model.logits(hidden[rows.reshape(-1)]).view(*rows.shape, -1))
        self._cands = logits.topk(self.top_k, dim=-1).indices

    def step(self, state: DecodeState, budget: int) -> list[int]:
        m = self.model
        lay = self.layouts[self._state]
        n_cached = state.n_cached
        root = state.pending_ids(m.device)[0]
        tokens = torch.cat([root, candidate_tokens(lay, self._cands)]) if lay.n_nodes > 1 else root
        h = m.embed(tokens.unsqueeze(0))
        if lay.size > lay.n_nodes:
            h = torch.cat([h, self.prompts.gather(lay.prompt_p, lay.prompt_e).unsqueeze(0)], dim=1)
        h = m.forward(None, state.cache, start=n_cached, mask=m.prepare_mask(full_mask(lay, n_cached)),
                      positions=(n_cached + lay.offsets).unsqueeze(0), h=h)[0]
        node_logits = m.logits(h[: lay.n_nodes])
        best, bonus = self._verify(lay, tokens, node_logits, state)
        path = lay.path_rows[best]
        state.cache.gather(n_cached, [n_cached] + [n_cached + r for r in path])
        self._next_candidates(h, lay.prompt_rows[best])
        state.drafted = lay.n_nodes - 1
        state.count("tree_tokens", lay.size)
        return tokens[path].tolist() + [bonus]

    def _verify(self, lay: TreeLayout, tokens: torch.Tensor, logits: torch.Tensor, state: DecodeState):
        """-> (accepted node with the longest path, bonus token after it). One host sync for greedy."""
        s = state.sampling
        if lay.n_nodes == 1:
            return 0, int(select(logits[0], s, state.generator))
        cand = tokens[1:]
        parents = lay.parent[1:]
        if s.greedy:
            target = logits.argmax(-1)
            ok = target[parents] == cand
        else:
            probs = warp(logits, s)
            ok = typical_accept(probs[parents], cand, self.threshold, self.alpha)
        ok = torch.cat([ok.new_ones(1), ok])
        accepted = ~(lay.ancestors & ~ok.unsqueeze(0)).any(-1)  # every node on the path matched
        score = torch.where(accepted, lay.depths, lay.depths.new_full((), -1))
        if s.greedy:
            # first deepest (ties cannot happen: siblings carry different tokens); one host sync
            best = score.argmax()
            best, bonus = torch.stack([best, target[best]]).tolist()
            return best, bonus
        best = int(score.argmax())
        return best, int(select(logits[best], s, state.generator))

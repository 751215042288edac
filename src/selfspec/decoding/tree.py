"""Token trees for one-pass verification: sparse candidate trees with prompt tokens (PPD §3, §4).

A PPD step feeds, in one forward pass, the last committed token (the **root**), a sparse tree
of **candidate tokens** and, appended to tree nodes, chains of **prompt tokens** (PPD §3.1,
Figure 3); each prompt token has ``n_ept`` **ensemble prompt tokens** (EPTs, PPD §3.2).

A :class:`SparseTree` describes one state of the dynamic sparse tree (PPD Definition 4.1):

* ``nodes`` — candidate paths; a path ``(r1, …, rd)`` is the candidate at depth ``d`` whose
  token is the rank-``rd`` guess of prompt token ``d`` of the previous step (rank 0 = top-1),
  child of the node ``(r1, …, r(d-1))``; the root is the empty path ``()``;
* ``prompts`` — how many prompt tokens hang off the root and each node.

:func:`layout` turns a tree into the tensors a forward pass needs (Medusa/SpecInfer tree
attention):

* input order: root, candidate nodes (sorted by depth, then path), then prompt-token slots
  (node-major, then prompt index ``p = 1…``, then EPT ``e``);
* **tree position ids**: a node at depth ``d`` sits at ``start + d``; prompt token ``p`` of a
  node at depth ``d`` at ``start + d + p`` (it guesses the token at distance ``p`` after that node);
* **tree attention mask**: a node sees its ancestors and itself; EPT ``e`` of prompt token
  ``p`` on node ``v`` sees ``v``'s path and EPT ``e`` of prompt tokens ``1…p`` of ``v`` — the
  *ensemble attention mask* of PPD Appendix B.5.1. Nothing sees a prompt token of another node.

:func:`verify_tree` is the step every tree method shares once its tree is laid out (PPD's, SWIFT's):
the tree's pass, its verification by the method's rule, the cache kept along the accepted path and
the step's trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple

import torch

from selfspec.models.ledger import phase
from selfspec.models.passes import Pass, Rows

if TYPE_CHECKING:
    from selfspec.decoding.base import DecodeState
    from selfspec.models.layered import LayeredModel


class TreeError(ValueError):
    """A malformed sparse tree (the message names the offending node)."""


@dataclass(frozen=True)
class SparseTree:
    """One dynamic-sparse-tree state ``T_k`` (PPD Definition 4.1)."""

    nodes: tuple[tuple[int, ...], ...]
    prompts: tuple[int, ...]

    def __post_init__(self) -> None:
        nodes = tuple(sorted((tuple(int(r) for r in p) for p in self.nodes), key=lambda p: (len(p), p)))
        object.__setattr__(self, "nodes", nodes)
        object.__setattr__(self, "prompts", tuple(int(x) for x in self.prompts))
        seen = {()}
        for path in nodes:
            if not path:
                raise TreeError("sparse tree: the root () is implicit; do not list it in nodes")
            if path in seen:
                raise TreeError(f"sparse tree: node {path} is listed twice")
            if path[:-1] not in seen:
                raise TreeError(f"sparse tree: node {path} has no parent {path[:-1]} in the tree")
            if min(path) < 0:
                raise TreeError(f"sparse tree: node {path} has a negative rank")
            seen.add(path)
        if len(self.prompts) != 1 + len(nodes):
            raise TreeError(
                f"sparse tree: prompts has {len(self.prompts)} entries but the tree has "
                f"{1 + len(nodes)} nodes (root + {len(nodes)} candidates)"
            )
        if self.prompts and min(self.prompts) < 0:
            raise TreeError("sparse tree: prompt-token counts must be >= 0")

    # --- construction helpers ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict) -> "SparseTree":
        """``{"nodes": [[0], [0, 1], ...], "prompts": [m, ...]}`` (root first in prompts)."""
        return cls(tuple(tuple(p) for p in d["nodes"]), tuple(d["prompts"]))

    def to_dict(self) -> dict:
        return {"nodes": [list(p) for p in self.nodes], "prompts": list(self.prompts)}

    @classmethod
    def with_prompts(cls, nodes: Iterable[Iterable[int]], prompts_of: dict[tuple[int, ...], int]) -> "SparseTree":
        """Build from paths and a ``{path: prompt count}`` map (missing paths carry none)."""
        nodes = tuple(sorted((tuple(p) for p in nodes), key=lambda p: (len(p), p)))
        return cls(nodes, tuple(prompts_of.get(p, 0) for p in ((),) + nodes))

    # --- properties ---------------------------------------------------------------------------
    @property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Root first, then the candidate nodes in input order."""
        return ((),) + self.nodes

    @property
    def depth(self) -> int:
        """Maximum candidate depth (the state ``k`` this tree can serve needs ``k >= depth``)."""
        return max((len(p) for p in self.nodes), default=0)

    @property
    def max_rank(self) -> int:
        """Ranks used go up to this (so top-``max_rank + 1`` guesses per prompt token suffice)."""
        return max((max(p) for p in self.nodes), default=0)

    @property
    def max_prompts(self) -> int:
        return max(self.prompts)

    @property
    def num_candidates(self) -> int:
        return len(self.nodes)

    @property
    def num_prompts(self) -> int:
        return sum(self.prompts)

    def size(self, n_ept: int = 1) -> int:
        """Tokens fed in one step: root + candidates + prompt tokens × EPTs."""
        return 1 + len(self.nodes) + self.num_prompts * n_ept


@dataclass
class TreeLayout:
    """Tensors of one tree for one forward pass (see the module docstring)."""

    tree: SparseTree
    n_ept: int
    #: [N] position offsets (add ``start``)
    offsets: torch.Tensor
    #: [N, N] bool, True = may attend (the tree part; the committed prefix is always visible)
    mask: torch.Tensor
    #: [n_nodes - 1] (depth - 1, rank) of each candidate node in the ``[depth, rank]`` guess table
    cand_depth: torch.Tensor
    cand_rank: torch.Tensor
    #: [n_nodes] parent node index (root: 0)
    parent: torch.Tensor
    #: [n_nodes, n_nodes] bool: ``anc[a, b]`` = node b is an ancestor of node a or a itself
    ancestors: torch.Tensor
    #: [n_nodes] depth of each node
    depths: torch.Tensor
    #: [n_prompt_slots] (prompt index p-1, EPT e) of each prompt slot, for the embedding table
    prompt_p: torch.Tensor
    prompt_e: torch.Tensor
    #: per node: LongTensor [prompts[v], n_ept] of input rows of its prompt tokens
    prompt_rows: list[torch.Tensor] = field(default_factory=list)
    #: per node: input rows of the candidate nodes on its path (root excluded), host-side
    path_rows: list[list[int]] = field(default_factory=list)

    @property
    def n_nodes(self) -> int:
        return 1 + self.tree.num_candidates

    @property
    def size(self) -> int:
        return int(self.offsets.numel())


def layout(tree: SparseTree, n_ept: int, device: torch.device | str = "cpu") -> TreeLayout:
    """Input order, tree position ids and tree attention mask of ``tree`` (PPD §3.1, App. B.5.1)."""
    if n_ept < 1:
        raise TreeError(f"n_ept (ensemble prompt tokens per prompt token) must be >= 1, got {n_ept}")
    paths = tree.paths
    n_nodes = len(paths)
    index = {p: i for i, p in enumerate(paths)}
    parent = [0] + [index[p[:-1]] for p in paths[1:]]
    depth = [len(p) for p in paths]
    # ancestor-or-self closure by walking parent pointers (nodes are sorted by depth)
    anc = torch.zeros(n_nodes, n_nodes, dtype=torch.bool)
    anc[0, 0] = True
    for i in range(1, n_nodes):
        anc[i] = anc[parent[i]]
        anc[i, i] = True
    slots = [(v, p, e) for v in range(n_nodes) for p in range(1, tree.prompts[v] + 1) for e in range(n_ept)]
    n = n_nodes + len(slots)
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[:n_nodes, :n_nodes] = anc
    offsets = torch.tensor(depth + [depth[v] + p for v, p, _ in slots], dtype=torch.long)
    row = {s: n_nodes + j for j, s in enumerate(slots)}
    for (v, p, e), r in row.items():
        mask[r, :n_nodes] = anc[v]
        for q in range(1, p + 1):
            mask[r, row[(v, q, e)]] = True
    prompt_rows = [
        torch.tensor([[row[(v, p, e)] for e in range(n_ept)] for p in range(1, tree.prompts[v] + 1)],
                     dtype=torch.long).view(-1, n_ept).to(device)
        for v in range(n_nodes)
    ]
    path_rows = [[b for b in range(1, n_nodes) if anc[a, b]] for a in range(n_nodes)]
    return TreeLayout(
        tree=tree,
        n_ept=n_ept,
        offsets=offsets.to(device),
        mask=mask.to(device),
        cand_depth=torch.tensor([len(p) - 1 for p in paths[1:]], dtype=torch.long).to(device),
        cand_rank=torch.tensor([p[-1] for p in paths[1:]], dtype=torch.long).to(device),
        parent=torch.tensor(parent, dtype=torch.long).to(device),
        ancestors=anc.to(device),
        depths=torch.tensor(depth, dtype=torch.long).to(device),
        prompt_p=torch.tensor([p - 1 for _, p, _ in slots], dtype=torch.long).to(device),
        prompt_e=torch.tensor([e for _, _, e in slots], dtype=torch.long).to(device),
        prompt_rows=prompt_rows,
        path_rows=path_rows,
    )


def chain_tree(widths: Iterable[int]) -> SparseTree:
    """A draft chain with siblings (SWIFT §3.3): the draft's top-1 at every depth, and at depth
    ``d`` the ranks ``0 … widths[d] − 1`` of the draft's distribution there as leaves beside it,
    children of the top-1 node of depth ``d − 1``. No prompt tokens."""
    nodes = [(0,) * d + (r,) for d, k in enumerate(widths) for r in range(k)]
    return SparseTree(tuple(nodes), (0,) * (1 + len(nodes)))


def accepted_node(lay: TreeLayout, ok: torch.Tensor) -> torch.Tensor:
    """The deepest node whose whole path was accepted, ``ok`` ``[n_nodes − 1]`` saying per
    candidate whether it matched at its parent (the first deepest on ties; a 0-d tensor, the
    root when nothing matched). Greedy tree verification's walk, on the device (PPD, SWIFT)."""
    ok = torch.cat([ok.new_ones(1), ok])
    accepted = ~(lay.ancestors & ~ok.unsqueeze(0)).any(-1)  # every node on the path matched
    return torch.where(accepted, lay.depths, lay.depths.new_full((), -1)).argmax()


def candidate_tokens(lay: TreeLayout, candidates: torch.Tensor) -> torch.Tensor:
    """Tokens of the candidate nodes from ``candidates`` ``[depths, ranks]`` (top-k per prompt token)."""
    return candidates[lay.cand_depth, lay.cand_rank]


class Verified(NamedTuple):
    """What :func:`verify_tree` returns: the tree pass's states ``[size, d]`` (every row's: PPD reads its
    prompt tokens'), the accepted node, the input rows of its path (root excluded) and the token after it."""

    states: torch.Tensor
    node: int
    path: list[int]
    bonus: int


def verify_tree(model: LayeredModel, state: DecodeState, lay: TreeLayout, x: torch.Tensor,
                verify: Callable[[torch.Tensor], tuple[int, int]], source: str) -> Verified:
    """A tree step's verification, written once for the tree methods (PPD, SWIFT), as
    :func:`~selfspec.decoding.chain.settle` is for the chains: one pass of the tree's rows ``x`` (token
    ids ``[1, size]`` or states ``[1, size, d]``, in :func:`layout`'s input order) right after the
    committed tokens (a drafter's scratch K/V past them dropped first), at ``lay``'s positions under its
    tree mask; ``verify`` takes the nodes' logits ``[n_nodes, V]`` and returns the accepted node and
    the token after it (the method's rule); all three in the ledger's ``verify`` phase. The cache then
    keeps the root and the accepted path (:meth:`~selfspec.models.cache.LayerCache.gather`), and the
    step says what was drafted (every candidate node), where from (``source``), the tree's nodes, the
    pass's width (prompt-token rows included) and how many nodes were accepted."""
    n_cached, ledger = state.n_cached, state.ledger
    with phase(ledger, "verify"):
        state.cache.truncate(n_cached)
        h = model.forward(x, state.cache, Pass(rows=Rows.tree(lay.offsets, lay.mask)), start=n_cached,
                          ledger=ledger, joins=state.joins)[0]
        node, bonus = verify(model.logits(h[: lay.n_nodes], ledger, state.joins))
    path = lay.path_rows[node]
    state.cache.gather(n_cached, [n_cached] + [n_cached + r for r in path])
    state.drafted = lay.n_nodes - 1
    step = state.trace_step
    step.source, step.tree_size, step.width, step.accepted = source, lay.n_nodes, lay.size, len(path)
    return Verified(h, node, path, bonus)


def prompt_chain_mask(n_prefix: int, m: int, n_ept: int, device=None) -> torch.Tensor:
    """Mask for ``n_prefix`` causal tokens followed by ``m`` prompt tokens × ``n_ept`` EPTs
    attached to the last of them (prefill and training, PPD §3.3): ``[n, n]`` bool."""
    tree = SparseTree((), (m,))
    lay = layout(tree, n_ept)
    n = n_prefix + m * n_ept
    mask = torch.zeros(n, n, dtype=torch.bool, device=device)
    mask[:n_prefix, :n_prefix] = torch.ones(n_prefix, n_prefix, dtype=torch.bool, device=device).tril()
    mask[n_prefix:, :n_prefix] = True
    mask[n_prefix:, n_prefix:] = lay.mask[1:, 1:].to(device)
    return mask


# --- the dynamic sparse tree: one tree per state, saved as an artefact ------------------------
TREE_KIND = "ppd_tree"


def trees_from_meta(meta: dict) -> dict[int, SparseTree]:
    """``{"trees": {"<state>": {"nodes": ..., "prompts": ...}}}`` -> ``{state: SparseTree}``."""
    if "trees" not in meta:
        raise TreeError("ppd_tree artefact has no 'trees' entry in meta.json; rebuild it with job=ppd_tree")
    return {int(k): SparseTree.from_dict(v) for k, v in meta["trees"].items()}


def paper_states(tree: SparseTree, m: int) -> SparseTree:
    """``tree`` with the prompt tokens the paper's states ``1…m`` give it (PPD Definition 4.1:
    no state 0; Prop. 4.3 removes prompt tokens only while ``i > 1``): the root carries all ``m``,
    every candidate at least one and at most ``m``. The authors' code lays out every tree it is
    given this way, whatever its prompt-token counts say."""
    return SparseTree(tree.nodes, (m,) + tuple(min(max(c, 1), m) for c in tree.prompts[1:]))


def check_trees(trees: dict[int, SparseTree], m: int) -> None:
    """A dynamic sparse tree for prompt tokens ``1…m``: states ``0…m`` each present, the tree of
    state ``k`` no deeper than ``k`` (PPD Definition 4.1) and carrying at most ``m`` prompt
    tokens per node."""
    missing = [k for k in range(m + 1) if k not in trees]
    if missing:
        raise TreeError(f"dynamic sparse tree lacks states {missing} (needs 0..{m} for m={m} prompt tokens); "
                        "rebuild it with job=ppd_tree for these prompts")
    for k, t in trees.items():
        if t.depth > k:
            raise TreeError(f"tree of state {k} has candidates at depth {t.depth} > {k}: only {k} "
                            "prompt tokens' guesses exist in that state")
        if t.max_prompts > m:
            raise TreeError(f"tree of state {k} carries {t.max_prompts} prompt tokens on a node but the "
                            f"prompts artefact has only m={m}")


def load_trees(path, model=None) -> tuple[dict[int, SparseTree], dict]:
    """Load a ``ppd_tree`` artefact -> (trees by state, meta)."""
    from selfspec.store.artefacts import ArtefactError, load_artefact

    art = load_artefact(path, TREE_KIND)
    if model is not None and art.meta.get("model") != model.name:
        raise ArtefactError(f"ppd_tree artefact {path} was built for model {art.meta.get('model')!r}, not "
                            f"{model.name!r}; run python -m selfspec.train job=ppd_tree model={model.name}")
    return trees_from_meta(art.meta), art.meta


def random_tree(n_candidates: int, depth: int, top_k: int, m: int, rng) -> SparseTree:
    """A random sparse tree (PPD Figure 8a's "random" baseline; also used by tests): up to
    ``n_candidates`` nodes of depth <= ``depth``, ranks < ``top_k``, 0…``m`` prompt tokens per node.
    ``rng`` is a :class:`random.Random`."""
    nodes: list[tuple[int, ...]] = []
    frontier = [()]
    for _ in range(n_candidates):
        options = [p + (r,) for p in frontier if len(p) < depth for r in range(top_k)
                   if p + (r,) not in nodes]
        if not options:
            break
        node = rng.choice(options)
        nodes.append(node)
        frontier.append(node)
    return SparseTree.with_prompts(nodes, {p: rng.randint(0, m) for p in [()] + nodes})


def random_trees(m: int, n_candidates: int, top_k: int, rng) -> dict[int, SparseTree]:
    """One random tree per state ``0…m`` (state ``k``: depth <= ``k``)."""
    return {k: random_tree(n_candidates if k else 0, k, top_k, m, rng) for k in range(m + 1)}

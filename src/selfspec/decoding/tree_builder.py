"""PPD's dynamic sparse trees from acceptance statistics (PPD §4.1–4.2): the expected tokens of
a tree and the construction of the best trees of a size. Pure arithmetic on ``p[d][r]`` (the
probability that prompt token ``d``'s rank-``r`` guess is the model's next token), shared by the
tree-building job (:mod:`selfspec.training.ppd_tree`, which measures ``p`` and the hardware's
latency curve) and the decoder (:mod:`selfspec.decoding.ppd`, which may rebuild the trees of
another size from an artefact's statistics, PPD Fig. 8c).

* **Expected tokens** (Props 4.1, 4.2, 4.4): ``f(T_k) = Σ_{v ∈ C(T_k)} Π_{i ∈ Path(v)} p_i``; the
  state after a step is the number of prompt tokens on the accepted node, a Markov chain whose
  steady state ``π`` gives ``R(T) = Σ_k π_k f(T_k)`` accepted candidates per step (``τ = 1 + R``).
* **Construction** (§4.2) for ``n_c`` candidates and ``n_p`` prompt tokens: optimal candidate
  trees of depth ``<= k`` (best-first by path probability), every node given ``m`` prompt tokens,
  then prompt tokens removed greedily by the smallest ``ΔF = p(c)·(f(T_i) − f(T_{i−1}))``
  (Prop. 4.3) until ``n_p`` remain; for a tree size ``n`` every split ``n = 1 + n_c + n_p·n_ept``
  is tried and the best ``R`` kept. ``state_zero`` (beyond the paper): a node may lose its last
  prompt token and the root any of its own; without it, as the paper and the authors' builder, a
  candidate keeps at least one and the root all ``m``.
"""

from __future__ import annotations

import torch

from selfspec.decoding.tree import SparseTree

Path_ = tuple[int, ...]


# --- Props 4.1–4.4 -----------------------------------------------------------------------------
def path_prob(path: Path_, p) -> float:
    out = 1.0
    for d, r in enumerate(path):
        out *= float(p[d][r])
    return out


def expected_candidates(nodes, p) -> float:
    """``f(T)`` (Prop. 4.1): expected accepted candidate tokens of a candidate tree."""
    return sum(path_prob(v, p) for v in nodes)


def deepest_accepted(tree: SparseTree, p) -> list[float]:
    """P(node v is the deepest accepted node), per node in ``tree.paths`` order (root first).

    Under the rank model the true token has one rank, so siblings are mutually exclusive:
    P(v accepted, no child accepted) = P(path v) · (1 − Σ_children p[depth][rank])."""
    children: dict[Path_, float] = {}
    for c in tree.nodes:
        children[c[:-1]] = children.get(c[:-1], 0.0) + float(p[len(c) - 1][c[-1]])
    return [path_prob(v, p) * (1.0 - children.get(v, 0.0)) for v in tree.paths]


def transitions(trees: dict[int, SparseTree], p, m: int) -> torch.Tensor:
    """``P[k, j]`` = P(next state j | state k) (Prop. 4.2's ``p(s_j | s_k)``)."""
    P = torch.zeros(m + 1, m + 1, dtype=torch.float64)
    for k, t in trees.items():
        for prob, n_prompts in zip(deepest_accepted(t, p), t.prompts):
            P[k, n_prompts] += prob
    return P


def steady_state(P: torch.Tensor, iters: int = 500) -> torch.Tensor:
    pi = torch.full((P.shape[0],), 1.0 / P.shape[0], dtype=torch.float64)
    for _ in range(iters):
        pi = pi @ P
    return pi / pi.sum()


def amortized_tokens(trees: dict[int, SparseTree], p, m: int) -> float:
    """``R(T) = Σ_k π_k f(T_k)`` (Prop. 4.4): accepted candidates per step in the long run."""
    pi = steady_state(transitions(trees, p, m))
    return float(sum(pi[k] * expected_candidates(t.nodes, p) for k, t in trees.items()))


# --- construction (§4.2) --------------------------------------------------------------------------
def optimal_candidates(n_c: int, depth: int, p) -> list[Path_]:
    """The ``n_c``-node candidate tree of depth <= ``depth`` maximising ``f`` (best first by path
    probability: a child never beats its parent, so the best ``n_c`` paths form a tree)."""
    K = len(p[0])
    nodes: list[Path_] = []
    best_of = {(): 1.0}
    for _ in range(n_c):
        options = [(prob * float(p[len(v)][r]), v + (r,)) for v, prob in best_of.items()
                   if len(v) < depth for r in range(K) if v + (r,) not in best_of]
        if not options:
            break
        prob, node = max(options, key=lambda o: (o[0], [-x for x in o[1]]))
        nodes.append(node)
        best_of[node] = prob
    return nodes


def allocate_prompts(nodes: list[Path_], n_p: int, m: int, f: list[float], p, state_zero: bool = True) -> SparseTree:
    """Give every node ``m`` prompt tokens, then remove them greedily by smallest
    ``ΔF = p(c)·(f(T_i) − f(T_{i−1}))`` (Prop. 4.3) until ``n_p`` remain (or none may go:
    without ``state_zero`` a candidate keeps one and the root all ``m``, module docstring)."""
    tree = SparseTree.with_prompts(nodes, {v: m for v in [()] + list(nodes)})
    counts = list(tree.prompts)
    floor = [0] * len(counts) if state_zero else [m] + [1] * (len(counts) - 1)
    accept = deepest_accepted(tree, p)
    while sum(counts) > n_p:
        delta = [accept[v] * (f[c] - f[c - 1]) if c > floor[v] else float("inf") for v, c in enumerate(counts)]
        v = min(range(len(counts)), key=lambda i: (delta[i], -i))
        if delta[v] == float("inf"):
            break
        counts[v] -= 1
    return SparseTree(tree.nodes, tuple(counts))


def build_trees(n_c: int, n_p: int, m: int, p, state_zero: bool = True) -> dict[int, SparseTree]:
    """One tree per state ``0…m`` with at most ``n_c`` candidates and ``n_p`` prompt tokens (state 0's
    tree, the root alone, is never reached without ``state_zero``)."""
    cands = {k: optimal_candidates(n_c if k else 0, k, p) for k in range(m + 1)}
    f = [expected_candidates(cands[k], p) for k in range(m + 1)]
    return {k: allocate_prompts(cands[k], n_p, m, f, p, state_zero) for k in range(m + 1)}


def best_trees_for_size(n: int, m: int, n_ept: int, p,
                        state_zero: bool = True) -> tuple[float, dict[int, SparseTree]] | None:
    """Try every split ``n = 1 + n_c + n_p·n_ept``; keep the one with the largest ``R`` (without
    ``state_zero`` only splits whose ``n_p`` covers the root's ``m`` and one per candidate)."""
    best = None
    for n_c in range(0, n):
        rest = n - 1 - n_c
        if rest % n_ept:
            continue
        n_p = rest // n_ept
        if n_p > m * (n_c + 1) or (not state_zero and n_p < m + n_c):
            continue
        trees = build_trees(n_c, n_p, m, p, state_zero)
        r = amortized_tokens(trees, p, m)
        if best is None or r > best[0] + 1e-12:
            best = (r, trees)
    return best


def trees_for_size(accept_probs, n: int, m: int, n_ept: int, state_zero: bool = True) -> dict[int, SparseTree]:
    """Rebuild the trees of tree size ``n`` from a ``ppd_tree`` artefact's statistics (the
    construction is deterministic in them), e.g. to decode with a size other than the chosen one."""
    if n <= 1:
        return {k: SparseTree((), (0,)) for k in range(m + 1)}
    best = best_trees_for_size(n, m, n_ept, accept_probs.double().tolist(), state_zero)
    if best is None:
        raise ValueError(f"no dynamic sparse tree of size {n} for m={m}, n_ept={n_ept}; choose a larger tree_size")
    return best[1]

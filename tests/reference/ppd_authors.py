"""The PPD authors' greedy decoding loop, re-written from reading hmarkc/parallel-prompt-decoding
(``prompt/model/model.py``: ``generate_buffers``, ``start_inference``, ``generate_candidates``,
``tree_decoding``, ``evaluate_posterior``, ``update_inference_inputs``; the evaluation loop of
``application/gen_model_answer_prompt_decoding.py``) on transformers' own ``LlamaForCausalLM``
with a ``DynamicCache`` and explicit 4-D masks. Nothing here is selfspec's runtime.

What the authors' loop does (PPD §3, §4), as implemented here:

* **Trees** are given per state ``k = 1…m`` as candidate lists ``[(path, n), …]`` (their
  ``dynamic_sparse_trees_*`` files; the path's probability is not used in decoding). The loop's
  buffers attach prompt token 1 to *every* candidate, prompt tokens ``2…min(n, m)`` after it, and
  all ``m`` prompt tokens to the root, whatever the list says: there is no state 0.
* **Input rows**: the root, then every path (candidates and prompt-token slots, a prompt token
  ``p`` of node ``v`` being the path ``v + [-1, …, -p]``) sorted by (length, path). Position of a
  row = its path length; a row sees the cached prefix, the root, its ancestors and itself.
* **Prefill**: the prompt and the ``m`` prompt tokens in one causal pass; the cache is cut back
  to the prompt. The next tree is state ``m``'s.
* **Candidates**: the root is the argmax of the last accepted logits; a candidate of rank ``r``
  at depth ``d`` is the rank-``r`` token of prompt token ``d``'s logits top-10.
* **Verification**: the tree's root-to-leaf rows (``retrieve_indices``, padded to the longest
  with a dummy token 0) are matched against the argmax of their parents' logits; the first row
  with the longest matching prefix wins.
* **Update**: the root and the accepted candidates are appended; their K/V rows are copied to
  contiguous positions after the prefix; the next root comes from the accepted node's logits,
  the next candidates from its prompt tokens, and the next state is how many it carried.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

#: guesses kept per prompt token (the authors' ``TOPK``)
TOPK = 10


@dataclass
class Buffers:
    """One state's tree as the authors' ``generate_buffers`` lays it out (rows: root first)."""

    mask: torch.Tensor  # [N, N] bool, True = may attend
    positions: torch.Tensor  # [N] offsets from the root's position
    #: [N] index into [root, top-k of prompt token 1, …, of prompt token m]; < 0: into the prompt embeddings
    tree_indices: torch.Tensor
    node_rows: torch.Tensor  # [n_nodes] rows of the root and the candidates (``normal_token_indices``)
    prompt_rows: dict[int, list[int]]  # node index (0 = root) -> rows of its prompt tokens 1, 2, …
    retrieve: torch.Tensor  # [leaves, depth + 1] node indices of each root-to-leaf row (-1: padding)

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])


def buffers(candidates: list[tuple[list[int], int]], m: int) -> Buffers:
    """The buffers of one tree ``[(path, n), …]`` for ``m`` prompt tokens (``generate_buffers``)."""
    nodes = sorted(((list(p), n) for p, n in candidates), key=lambda x: (len(x[0]), x[0]))
    node_paths = [p for p, _ in nodes]
    paths = [(p, n) for p, n in nodes]
    paths += [(p + [-1], n) for p, n in nodes] + [([-1], m)]
    for i in range(2, m + 1):
        paths += [(p + [-i], n) for p, n in paths if p[-1] == -(i - 1) and i <= n]
    rows = sorted((p for p, _ in paths), key=lambda x: (len(x), x))
    row_of = {tuple(p): r + 1 for r, p in enumerate(rows)}
    size = len(rows) + 1
    mask = torch.eye(size, dtype=torch.bool)
    mask[:, 0] = True
    positions = torch.zeros(size, dtype=torch.long)
    tree_indices = torch.zeros(size, dtype=torch.long)
    for p in rows:
        r = row_of[tuple(p)]
        for c in range(1, len(p)):
            mask[r, row_of[tuple(p[:c])]] = True
        positions[r] = len(p)
        tree_indices[r] = -(m - (-p[-1]) + 1) if p[-1] < 0 else 1 + TOPK * (len(p) - 1) + p[-1]
    node_rows = torch.tensor([0] + [row_of[tuple(p)] for p in node_paths])
    prompt_rows = {}
    for v, p in enumerate([[]] + node_paths):
        prompt_rows[v] = [row_of[tuple(p + [-q for q in range(1, j + 1)])] for j in range(1, m + 1)
                          if tuple(p + [-q for q in range(1, j + 1)]) in row_of]
    leaves, covered = [], set()
    for p in reversed(node_paths):
        if tuple(p) in covered:
            continue
        leaves.append([node_paths.index(p[: c + 1]) + 1 for c in range(len(p))])
        covered.update(tuple(p[: c + 1]) for c in range(len(p)))
    depth = max((len(x) for x in leaves), default=0)
    retrieve = torch.tensor([[0] + x + [-1] * (depth - len(x)) for x in leaves] or [[0]], dtype=torch.long)
    return Buffers(mask, positions, tree_indices, node_rows, prompt_rows, retrieve)


def _gather(cache: DynamicCache, prefix: int, rows: torch.Tensor) -> None:
    """Keep ``prefix`` positions, then the tree rows ``rows`` (offsets after the prefix), contiguous."""
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys[..., :prefix, :], layer.keys[..., prefix + rows, :]], dim=-2)
        layer.values = torch.cat([layer.values[..., :prefix, :], layer.values[..., prefix + rows, :]], dim=-2)


@dataclass
class Run:
    """What :func:`generate` returns."""

    tokens: list[int]  # the new tokens, cut to the budget
    trace: list[dict]  # per step, prefill first: drafted, accepted, tree_size, width, state
    cache: DynamicCache  # K/V of every committed token but the pending one


@torch.inference_mode()
def generate(hf, prompts: torch.Tensor, trees: dict[int, list[tuple[list[int], int]]], ids: list[int],
             max_new_tokens: int, split_prefill: bool = False) -> Run:
    """Greedy PPD as the authors' loop runs it, until ``max_new_tokens`` tokens exist.

    ``prompts``: ``[m, d]`` prompt-token embeddings (one virtual token each: their inference
    supports no more); ``trees``: state -> candidate list. A trace row holds ``drafted``
    (candidates in the tree), ``accepted``, ``tree_size`` (nodes, root included), ``width`` (rows
    of the pass) and ``state`` (prompt tokens the accepted node carried). ``split_prefill`` runs
    the prompt and the prompt tokens in two passes (selfspec's prefill) instead of one.
    """
    m = prompts.shape[0]
    bufs = {k: buffers(c, m) for k, c in trees.items()}
    embed = hf.get_input_embeddings()
    cache = DynamicCache()
    n = len(ids)
    x = embed(torch.tensor([ids]))
    if split_prefill:
        logits = hf(inputs_embeds=x, past_key_values=cache, use_cache=True).logits
        tail = hf(inputs_embeds=prompts[None].to(x.dtype), past_key_values=cache, use_cache=True).logits
        logits = torch.cat([logits, tail], dim=1)[0]
    else:
        logits = hf(inputs_embeds=torch.cat([x, prompts[None].to(x.dtype)], dim=1), past_key_values=cache,
                    use_cache=True).logits[0]
    _gather(cache, n, torch.zeros(0, dtype=torch.long))  # the prompt tokens' K/V dropped
    root_logits, prompt_logits, state = logits[n - 1], logits[n:n + m], m
    tokens = list(ids)
    trace = [{"source": "prefill", "width": n, "state": state}]
    while len(tokens) + 1 - n < max_new_tokens:
        buf = bufs[state]
        cands = torch.cat([root_logits.argmax().view(1), prompt_logits.topk(TOPK, dim=-1).indices.view(-1)])
        node_tokens = cands[buf.tree_indices[buf.node_rows]]
        rows_tokens = torch.cat([node_tokens, node_tokens.new_zeros(1)])[buf.retrieve]
        table = torch.cat([embed(cands), prompts.to(embed.weight.dtype)])
        past = len(tokens)
        mask = torch.cat([torch.ones(buf.size, past, dtype=torch.bool), buf.mask], dim=1)
        out = hf(inputs_embeds=table[buf.tree_indices][None], attention_mask=mask[None, None],
                 position_ids=(past + buf.positions)[None], past_key_values=cache, use_cache=True).logits[0]
        row_logits = out[buf.node_rows][buf.retrieve]
        matched = (rows_tokens[:, 1:] == row_logits[:, :-1].argmax(-1)).int().cumprod(1).sum(1)
        accepted = int(matched.max())
        best = int(matched.argmax()) if accepted else 0
        chosen = buf.retrieve[best, : accepted + 1]
        if (chosen < 0).any():
            raise AssertionError("the authors' loop accepted a padding slot (the dummy token 0 matched the "
                                 "argmax after a leaf); their update would index out of range here")
        tokens += rows_tokens[best, : accepted + 1].tolist()
        _gather(cache, past, buf.node_rows[chosen])
        node = int(chosen[-1])
        root_logits = row_logits[best, accepted]
        prompt_logits = out[buf.prompt_rows[node]]
        state = len(buf.prompt_rows[node])
        trace.append({"source": "tree", "drafted": len(buf.node_rows) - 1, "accepted": accepted,
                      "tree_size": len(buf.node_rows), "width": buf.size, "state": state})
    tokens.append(int(root_logits.argmax()))
    return Run(tokens[n:][:max_new_tokens], trace, cache)

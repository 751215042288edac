"""AdaDecode's decoding loop (ICML 2025, arXiv 2506.03700, §3.2–3.3 and Algorithm 1), re-written
from the paper on transformers' own modules: ``model.model.layers[j]`` (``LlamaDecoderLayer``) with
a ``DynamicCache`` whose layers grow to their own lengths, explicit 4-D masks and the model's rotary
embedding. The authors' code was not public when this was written (github.com/weizhepei/AdaDecode
held a README only), so the paper's algorithm is the reference. Nothing here is selfspec's runtime.

Greedy decoding, as the paper describes it:

* the prompt is prefilled as usual; then each token runs layer by layer;
* at a layer with a head, the head's next-token distribution ``p_l = softmax(E* T_l norm(h))`` is
  read; if its top probability exceeds γ the top token is **predicted early**: the next token's pass
  starts at once and the layers the current token skipped go to the **queue** ``P`` of deferred work;
* a pass that reaches layer ``j`` takes along every queued position still owed layer ``j`` (one
  batched call per layer over all of them, in position order);
* a pass that reaches the last layer leaves no position owed anything: the final distributions of
  every position since the step began exist, and the early predictions are **verified** against
  them (greedy: exact match, left to right); the first mismatch is replaced by the final layer's
  token and every later position is dropped from every layer's cache (**rollback**); if all match,
  the final layer's token after the last one is committed too.

The paper's algorithm bounds neither the number of early predictions in a step nor which tokens may
be predicted early (an end-of-sequence token too); the loop stops once an end-of-sequence token is
committed or the token budget is reached (``stop_at_budget`` also stops predicting early at the
budget, as selfspec's loop does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache


@dataclass
class Run:
    """What :func:`generate` returns."""

    tokens: list[int]  # the new tokens
    trace: list[dict]  # per step, prefill first: drafted, accepted, exits, committed
    cache: DynamicCache  # K/V of every committed token but the pending one, per layer


def _layer(hf, j: int, h: torch.Tensor, positions: list[int], cache: DynamicCache) -> torch.Tensor:
    """Decoder layer ``j`` over rows at ``positions`` (a contiguous run after layer ``j``'s cache)."""
    past = cache.layers[j].get_seq_length()
    assert positions == list(range(past, past + len(positions))), "owed positions must continue layer j's cache"
    pos = torch.tensor([positions])
    keys = torch.arange(past + len(positions))
    mask = (keys[None, :] <= pos[0, :, None])[None, None]
    rope = hf.model.rotary_emb(h, pos)
    return hf.model.layers[j](h, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                              position_embeddings=rope)


def head_probs(hf, T: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
    """``softmax(E* · T · norm(h))`` (§3.1; ``T`` None: the LM head itself reads the layer)."""
    x = hf.model.norm(h)
    if T is not None:
        x = x @ T.T
    return hf.lm_head(x).float().softmax(-1)


@torch.inference_mode()
def generate(hf, heads: dict[int, torch.Tensor | None], gamma: float, ids: list[int], max_new_tokens: int,
             eos: frozenset[int] = frozenset(), stop_at_budget: bool = False) -> Run:
    """Greedy AdaDecode; ``heads``: layer -> ``T_l`` (the head reads the state after that layer).
    A trace row holds ``drafted`` (early predictions), ``accepted``, ``exits`` (the head layer of
    each early prediction) and ``committed``."""
    cache = DynamicCache()
    n = len(ids)
    logits = hf(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]
    tokens = list(ids) + [int(logits.argmax())]
    trace = [{"source": "prefill", "width": n, "committed": 1}]
    L = len(hf.model.layers)
    while len(tokens) - n < max_new_tokens and tokens[-1] not in eos:
        base = len(tokens) - 1  # the pending token's position
        queue: dict[int, tuple[int, torch.Tensor]] = {}  # P: position -> (next layer owed, hidden state)
        early: list[tuple[int, int]] = []  # (token, head layer)
        token, pos = tokens[-1], base
        while True:
            h, rows = hf.model.embed_tokens(torch.tensor([[token]])), [pos]
            exited = False
            for j in range(L):
                owed = sorted(p for p, (layer, _) in queue.items() if layer == j)
                if owed:
                    h = torch.cat([queue.pop(p)[1] for p in owed] + [h], dim=1)
                    rows = owed + rows
                h = _layer(hf, j, h, rows, cache)
                may_exit = not stop_at_budget or len(tokens) - n + len(early) < max_new_tokens - 1
                if j in heads and may_exit:
                    probs = head_probs(hf, heads[j], h[0, -1])
                    if float(probs.max()) > gamma:
                        early.append((int(probs.argmax()), j))
                        if len(early) > 4 * max_new_tokens:
                            raise AssertionError(f"γ = {gamma}: no pass reaches the last layer (the paper's "
                                                 "algorithm bounds nothing); use a higher γ or stop_at_budget")
                        for i, p in enumerate(rows):
                            queue[p] = (j + 1, h[:, i:i + 1])
                        token, pos, exited = early[-1][0], pos + 1, True
                        break
            if not exited:
                break
        assert rows == list(range(base, pos + 1)) and not queue, "the full pass completes every deferred layer"
        target = hf.lm_head(hf.model.norm(h[0])).argmax(-1).tolist()
        accepted = 0
        while accepted < len(early) and early[accepted][0] == target[accepted]:
            accepted += 1
        new = [t for t, _ in early[:accepted]] + [target[accepted]]
        for layer in cache.layers:  # rollback: keep the pending token and the accepted predictions
            keep = base + accepted + 1
            layer.keys, layer.values = layer.keys[..., :keep, :], layer.values[..., :keep, :]
        for j, t in enumerate(new):
            if t in eos:
                new = new[: j + 1]
                break
        new = new[: max_new_tokens - (len(tokens) - n)]
        tokens += new
        trace.append({"source": "self" if early else "plain", "drafted": len(early), "accepted": accepted,
                      "exits": tuple(layer for _, layer in early), "committed": len(new)})
    return Run(tokens[n:], trace, cache)

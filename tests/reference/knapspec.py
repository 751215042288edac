"""KnapSpec's and CLaSp's greedy decoding loops as the KnapSpec authors' code runs them, on
transformers' own model.

Written for the tests from reading kaist-flexml-lab/knapspec (``knapspec_generator.py``,
``knapspec.py``, ``clasp_generator.py``, ``clasp.py`` and the forward passes of ``utils.py``);
none of selfspec's code runs here. The model is transformers' ``LlamaForCausalLM`` with its own
``DynamicCache``; its decoder layers' modules are called one sublayer at a time, as the authors'
passes call them.

One call decodes one prompt (:func:`generate`), as one call of theirs does:

* the prompt goes through the full model, which gives the first token (step 0); the skip set is
  empty (the full model drafts) until the first search;
* step ``s`` drafts up to ``min(γ, left − 1)`` tokens with the skip set's sublayers (KnapSpec) or
  layers (CLaSp) left out, on a copy of the cache, stopping after an EOS draft or a draft whose
  top probability is below 0.7; the full model verifies ``[pending, d1..dk]`` one sublayer at a
  time; the longest matching prefix and the model's next token are committed and the cache is
  cropped to them;
* KnapSpec keeps the full model's states after every sublayer of the accepted rows at steps with
  ``1 < s mod I ≤ 1 + A`` and searches after ``s mod I = 1 + A`` (``Knapspec.optimize``); CLaSp
  keeps every layer's state of the last accepted row at ``s mod I = 1`` and searches then
  (``CLaSp.optimize``);
* the loop ends at the budget or after a step whose committed tokens hold EOS.

Each step is recorded as selfspec's step trace records it (:class:`reference.traces.Round`; the
controller: the sublayers the skip set leaves out after the step and, on a step that searched, the
chosen set, the tokens compared, the surviving candidates and, for KnapSpec, the chosen set's
agreement α).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from reference.traces import Round

CONFIDENCE = 0.7  # the authors' th_exit / threshold


@dataclass
class Result:
    tokens: list[int]
    rounds: list[Round]


def _causal(q: int, past: int, dtype) -> torch.Tensor:
    mask = torch.full((q, past + q), torch.finfo(dtype).min, dtype=dtype)
    for r in range(q):
        mask[r, : past + r + 1] = 0.0
    return mask[None, None]


def _branch_mask(branches: int, length: int, past: int, dtype) -> torch.Tensor:
    """``utils._make_branch_parallel_causal_mask``: each branch sees the context and its own rows."""
    n = branches * length
    mask = torch.full((n, past + n), torch.finfo(dtype).min, dtype=dtype)
    for b in range(branches):
        for t in range(length):
            mask[b * length + t, :past] = 0.0
            mask[b * length + t, past + b * length: past + b * length + t + 1] = 0.0
    return mask[None, None]


def _crop(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` positions (``crop_kv_cache``)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _attn(layer, x, pe, mask, cache):
    out, _ = layer.self_attn(hidden_states=layer.input_layernorm(x), position_embeddings=pe, attention_mask=mask,
                             cache=cache, use_cache=True)
    return x + out


def _mlp(layer, x):
    return x + layer.mlp(layer.post_attention_layernorm(x))


def _head(hf, h):
    return hf.lm_head(hf.model.norm(h))


def _full(hf, ids: list[int], cache: DynamicCache, start: int):
    """``forward_verify_divided_multi``: logits ``[n, V]`` and the states after every sublayer."""
    x = hf.model.embed_tokens(torch.tensor([ids]))
    pe = hf.model.rotary_emb(x, torch.arange(start, start + len(ids))[None])
    mask = _causal(len(ids), start, x.dtype)
    states = [x[0]]
    for layer in hf.model.layers:
        x = _attn(layer, x, pe, mask, cache)
        states.append(x[0])
        x = _mlp(layer, x)
        states.append(x[0])
    return _head(hf, x)[0], states


def _draft(hf, token: int, cache: DynamicCache, start: int, skip: list[int]) -> torch.Tensor:
    """``forward_draft_divided_multi``: one token with the sublayers ``skip`` marks (2L entries) left out."""
    x = hf.model.embed_tokens(torch.tensor([[token]]))
    pe = hf.model.rotary_emb(x, torch.tensor([[start]]))
    for i, layer in enumerate(hf.model.layers):
        if not skip[2 * i]:
            x = _attn(layer, x, pe, None, cache)
        if not skip[2 * i + 1]:
            x = _mlp(layer, x)
    return _head(hf, x)[0, -1]


def _apply(hf, block: int, x: torch.Tensor, cache: DynamicCache, context: int, branches: int, length: int,
           whole_layer: bool = False) -> torch.Tensor:
    """``_apply_layer_single``: sublayer ``block`` (even: attention, odd: MLP) or, ``whole_layer``,
    layer ``block``, over ``branches`` candidate states of ``length`` tokens ``x`` ``[1, B·T, d]`` at
    positions ``context…``, attending to the cache cropped to ``context`` (a copy) and their own branch."""
    layer = hf.model.layers[block if whole_layer else block // 2]
    if not whole_layer and block % 2:
        return _mlp(layer, x)
    own = copy.deepcopy(cache)
    _crop(own, context)
    pe = hf.model.rotary_emb(x, torch.arange(context, context + length).repeat(branches)[None])
    mask = _branch_mask(branches, length, context, x.dtype)
    if whole_layer:
        return layer(x, attention_mask=mask, position_embeddings=pe, cache=own, use_cache=True)
    return _attn(layer, x, pe, mask, own)


def _norm(x):
    return F.normalize(x, p=2, dim=-1)


def knapspec_optimize(hf, xs, cache, past_len, costs, sim_threshold):
    """``Knapspec.optimize``: the chosen 2L skip mask and its trace row."""
    n_layers = len(hf.model.layers)
    c1, c2, c3 = costs
    t_mlp, t_attn = c1, c2 * past_len + c3
    if t_attn > t_mlp:
        w_attn, w_mlp = min(int(round(t_attn / t_mlp)), 5), 1
    else:
        w_attn, w_mlp = 1, min(int(round(t_mlp / t_attn)), 5)
    budget = (w_attn + w_mlp) * n_layers // 2
    opt_num = xs[0].shape[1]
    context = past_len - opt_num
    g = [[None] * (budget + 1) for _ in range(2 * n_layers + 1)]
    parent = [[None] * (budget + 1) for _ in range(2 * n_layers + 1)]
    best = torch.full((2 * n_layers + 1, budget + 1), -float("inf"))
    g[2][0] = xs[2]
    best[2][0] = 0.0
    for i in range(3, 2 * n_layers + 1):
        block = i - 1
        w = w_attn if block % 2 == 0 else w_mlp
        xi = _norm(xs[i].squeeze(0))
        prev = [j for j, s in enumerate(g[i - 1]) if s is not None]
        if not prev:
            continue
        inp = torch.cat([g[i - 1][j] for j in prev], dim=1)
        nb = len(prev)
        ran = _apply(hf, block, inp, cache, context, nb, opt_num).reshape(nb, opt_num, -1)
        sims = torch.einsum("ntd,td->n", _norm(ran), xi)
        for b, j in enumerate(prev):
            if sims[b] / opt_num >= sim_threshold and sims[b] > best[i, j]:
                best[i, j], g[i][j], parent[i][j] = sims[b], ran[b: b + 1], (j, False)
        if block < 2 * n_layers - 2:
            kept = inp.reshape(nb, opt_num, -1)
            sims = torch.einsum("ntd,td->n", _norm(kept), xi)
            for b, j in enumerate(prev):
                if j + w <= budget and sims[b] / opt_num >= sim_threshold and sims[b] > best[i, j + w]:
                    best[i, j + w], g[i][j + w], parent[i][j + w] = sims[b], kept[b: b + 1], (j, True)
    valid = [j for j, s in enumerate(g[-1]) if s is not None]
    if not valid:
        return [0] * (2 * n_layers), {"skip_attn": [], "skip_mlp": [], "tokens": opt_num, "candidates": 0,
                                      "alpha": None, "weights": [w_attn, w_mlp]}
    top = torch.argmax(_head(hf, torch.cat([g[-1][j] for j in valid], dim=0)), dim=-1)
    teacher = torch.argmax(_head(hf, xs[-1]), dim=-1).squeeze(0)
    alphas = ((top == teacher.unsqueeze(0)).sum(dim=-1).float() / opt_num).tolist()
    masks = []
    for j in valid:
        mask, cur = [0] * (2 * n_layers), j
        for i in range(2 * n_layers, 2, -1):
            prev_j, skipped = parent[i][cur]
            if skipped:
                mask[i - 1] = 1
            cur = prev_j
        masks.append(mask)
    best_tpt, best_l = -1, -1
    for l in range(1, len(masks)):
        a = alphas[l]
        n_attn = sum(1 - masks[l][2 * k] for k in range(n_layers))
        n_mlp = sum(1 - masks[l][2 * k + 1] for k in range(n_layers))
        for d in range(18):
            tokens = (d + 1) if a == 1.0 else (a ** (d + 1) - 1.0) / (a - 1.0)
            time = t_attn * (n_attn * d + n_layers) + t_mlp * (n_mlp * d + n_layers)
            tpt = tokens / time if time > 0 else 0.0
            if tpt > best_tpt:
                best_tpt, best_l = tpt, l
    mask = masks[best_l]
    return mask, {"skip_attn": [k for k in range(n_layers) if mask[2 * k]],
                  "skip_mlp": [k for k in range(n_layers) if mask[2 * k + 1]], "tokens": opt_num,
                  "candidates": len(valid), "alpha": alphas[best_l], "weights": [w_attn, w_mlp]}


def clasp_optimize(hf, xs, cache, past_len, m):
    """``CLaSp.optimize``: the chosen layer mask (as a 2L sublayer mask) and its trace row."""
    n_layers = len(hf.model.layers)
    g = [[None] * (m + 1) for _ in range(n_layers + 1)]
    g[0][0] = xs[0]
    for i in range(1, n_layers + 1):
        g[i][0] = xs[i]
        ell = min(i - 1, m)
        if ell > 0:
            keep = [g[i - 1][j - 1] for j in range(1, ell + 1)]
            ran = _apply(hf, i - 1, torch.cat([g[i - 1][j] for j in range(1, ell + 1)], dim=1), cache,
                         past_len - 1, ell, 1, whole_layer=True)
            sim_no = torch.sum(_norm(ran) * _norm(xs[i]), dim=-1).squeeze(0)
            sim_sk = torch.sum(_norm(torch.cat(keep, dim=1)) * _norm(xs[i]), dim=-1).squeeze(0)
            for j in range(1, ell + 1):
                g[i][j] = ran[:, j - 1: j, :] if bool(sim_no[j - 1] > sim_sk[j - 1]) else keep[j - 1]
        if i <= m:
            g[i][i] = g[i - 1][i - 1]
    layers, i, j = [0] * n_layers, n_layers, m
    while i > 0 and j > 0:
        if g[i][j] is not None and g[i - 1][j - 1] is not None and g[i][j] is g[i - 1][j - 1]:
            layers[i - 1] = 1
            i, j = i - 1, j - 1
        else:
            i -= 1
    chosen = [k for k in range(n_layers) if layers[k]]
    return [b for k in layers for b in (k, k)], {"skip_attn": chosen, "skip_mlp": chosen, "tokens": 1,
                                                 "candidates": 1}


def _kept(tokens: list[int], left: int, eos: int | None) -> int:
    tokens = tokens[:left]
    return tokens.index(eos) + 1 if eos in tokens else len(tokens)


def generate(hf, prompt: list[int], max_new_tokens: int, selection: str = "knapspec", gamma: int = 10,
             interval: int = 64, accumulate: int = 5, skip_budget: int = 8, costs=(1.0, 0.0, 1.0),
             sim_threshold: float = 0.5, eos_token_id: int | None = None) -> Result:
    """One call of the authors' greedy loop (module docstring); ``costs`` their ``(c1, c2, c3)``:
    ``t_mlp = c1``, ``t_attn = c2 · context + c3``."""
    n_layers = len(hf.model.layers)
    cache = DynamicCache(config=hf.config)
    skip = [0] * (2 * n_layers)
    window: list[list[torch.Tensor]] = []
    with torch.no_grad():
        logits, _ = _full(hf, list(prompt), cache, 0)
        out = [int(logits[-1].argmax())]
        rounds = [Round("prefill", committed=1)]
        step = 1
        while len(out) < max_new_tokens and eos_token_id not in out:
            n_cached, left = len(prompt) + len(out) - 1, max_new_tokens - len(out)
            if selection == "knapspec":
                collect = 1 < step % interval <= 1 + accumulate
                search = step % interval == 1 + accumulate
            else:
                collect = search = step % interval == 1
            drafts: list[int] = []
            draft_cache = copy.deepcopy(cache)
            for j in range(min(gamma, left - 1)):
                p, token = _draft(hf, drafts[-1] if drafts else out[-1], draft_cache, n_cached + j, skip) \
                    .softmax(-1).max(-1)
                drafts.append(int(token))
                if drafts[-1] == eos_token_id or p.item() < CONFIDENCE:
                    break
            logits, states = _full(hf, [out[-1], *drafts], cache, n_cached)
            target = logits.argmax(-1).tolist()
            accepted = 0
            while accepted < len(drafts) and target[accepted] == drafts[accepted]:
                accepted += 1
            new = [*drafts[:accepted], target[accepted]]
            out += new
            _crop(cache, n_cached + accepted + 1)
            if collect:
                rows = slice(0, accepted + 1) if selection == "knapspec" else slice(accepted, accepted + 1)
                window.append([s[rows] for s in states])
            controller = {}
            if search:
                past_len = n_cached + accepted + 1
                if selection == "knapspec":
                    xs = [torch.cat([w[b] for w in window])[None] for b in range(2 * n_layers + 1)]
                    skip, row = knapspec_optimize(hf, xs, cache, past_len, costs, sim_threshold)
                else:
                    xs = [window[0][2 * k][None] for k in range(n_layers + 1)]
                    skip, row = clasp_optimize(hf, xs, cache, past_len, skip_budget)
                controller["search"] = row
                window = []
            controller["skipped"] = sum(skip)
            rounds.append(Round("self" if drafts else "plain", len(drafts), accepted, _kept(new, left, eos_token_id),
                                None, gamma, controller))
            step += 1
    out = out[:max_new_tokens]
    return Result(out[: out.index(eos_token_id) + 1] if eos_token_id in out else out, rounds)

"""SWIFT's greedy decoding loop and layer set optimisation as the authors' code runs them, on
transformers' own model.

Written for the tests from reading hemingkx/SWIFT (``evaluation_llama/inference_swift.py``'s
``swift_forward`` and set-up, ``model/swift/utils.py``: ``swift_draft``, ``get_choices_list``,
``generate_swift_buffers``, ``evaluate_posterior``, ``update_inference_inputs``,
``swift_optimization``, ``layer_random_search``, ``layer_bayes_search``); none of selfspec's code
runs here. The model is transformers' ``LlamaForCausalLM`` with a ``DynamicCache``; its sublayer
modules are called as the authors' draft mode calls them.

One call decodes one prompt (:func:`generate`) with a :class:`Search` that lives over the calls, as
the authors' ``statistics``, ``optimizer`` and skip sets do:

* the prompt through the full model gives the first token; its cache is kept for the matchness;
* each step drafts from the pending token on a copy of the cache with the current skip set, up to 25
  drafts, stopping after a draft whose probability is below 0.8 or once ``new + j + 2 ≥ budget``;
  the tree holds at depth ``d`` the draft's top ``k_d`` tokens (3/5/8/10 by confidence), children of
  the chain's token at depth ``d − 1``; the full model verifies ``[pending, tree]`` with tree
  attention; the longest path of argmax matches and the target's token after it are committed, their K/V moved after the committed ones;
* then, once more than ``context_window + 1`` tokens are generated, while the optimisation is on
  and ``idx mod opt_interval = 0``, one iteration: a random candidate (``RandomState.choice``, the
  stream of their ``np.random.seed(seed)``) or, every ``bayes_interval``-th, a UCB suggestion of
  ``bayes_opt`` (the installed version: theirs is 1.5's ``UtilityFunction``, the same GP-UCB), its
  matchness over the first ``context_window + 1`` generated tokens on the prompt's cache, kept if
  better, and the stopping rules.

Their loop ends once more than the budget is generated (cutting the output afterwards); this one
ends, as selfspec's loop does, once the budget is reached.
"""

from __future__ import annotations

import contextlib
import copy
import io
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from reference.traces import Round

TOPK = 10


@dataclass
class Search:
    """What the authors keep over a task stream."""

    attn: list[int]
    mlp: list[int]
    rng: np.random.RandomState
    optimizer: object
    stats: dict = field(default_factory=lambda: {"origin_score": 0, "opt_iter": 0, "tolerance_iter": 0,
                                                 "optimization": True})


def new_search(hf, seed: int = 2024) -> Search:
    from bayes_opt import BayesianOptimization
    from bayes_opt.acquisition import UpperConfidenceBound

    n = hf.config.num_hidden_layers
    optimizer = BayesianOptimization(f=None, pbounds={f"x{i}": (0, 1) for i in range((n - 2) * 2)},
                                     acquisition_function=UpperConfidenceBound(kappa=2.5), random_state=1, verbose=0,
                                     allow_duplicate_points=True)
    optimizer.set_gp_params(alpha=1e-2)
    return Search(list(range(1, n - 1, 2)), list(range(1, n - 1, 2)), np.random.RandomState(seed), optimizer)


@dataclass
class Result:
    tokens: list[int]
    rounds: list[Round]


def _run(hf, ids: list[int], cache, start: int, skip=None, tree=None):
    """Logits of ``ids`` at ``start…`` (or the tree's ``(depths, ancestors)``) through the full model,
    or through the draft model with ``skip = (attention layers, MLP layers)`` left out."""
    x = hf.model.embed_tokens(torch.tensor([ids]))
    n = len(ids)
    past = cache.get_seq_length()
    offsets = torch.arange(n) if tree is None else tree[0]
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool)) if tree is None else tree[1]
    mask = torch.full((n, past + n), torch.finfo(x.dtype).min)
    mask[:, :past] = 0.0
    mask[:, past:][allowed] = 0.0
    mask = mask[None, None]
    pe = hf.model.rotary_emb(x, (start + offsets)[None])
    for i, layer in enumerate(hf.model.layers):
        if skip is None or i not in skip[0]:
            out, _ = layer.self_attn(hidden_states=layer.input_layernorm(x), position_embeddings=pe,
                                     attention_mask=mask, cache=cache, use_cache=True)
            x = x + out
        if skip is None or i not in skip[1]:
            x = x + layer.mlp(layer.post_attention_layernorm(x))
    return hf.lm_head(hf.model.norm(x))[0]


def _draft(hf, search: Search, token: int, cache, start: int, new: int, budget: int):
    """``swift_draft``: the top-10 per depth and the chain's confidences."""
    own = copy.deepcopy(cache)
    tops, confs = [], []
    for j in range(25):
        logits = _run(hf, [token], own, start + j, skip=(search.attn, search.mlp))[-1]
        top = torch.topk(logits, TOPK).indices
        token = int(top[0])
        conf = logits.softmax(-1)[token].item()
        tops.append(top)
        confs.append(conf)
        if conf < 0.8 or new + j + 2 >= budget:
            break
    return torch.stack(tops), confs


def _choices(confs: list[float]) -> list[list[int]]:
    """``get_choices_list`` (greedy)."""
    out = []
    for idx, c in enumerate(confs):
        k = 3 if c > 0.95 else 5 if c > 0.8 else 8 if c > 0.5 else 10
        out.extend([[0] * idx + [i] for i in range(k)])
    return sorted(out, key=lambda x: (len(x), x))


def _optimise(hf, search: Search, generated: list[int], prompt_cache, prompt_len: int, skip_ratio: float,
              context_window: int, bayes_interval: int, max_opt_iter: int, max_tolerance_iter: int,
              max_score: float) -> dict:
    """``swift_optimization``: one iteration; returns what selfspec's trace records of it."""
    n = hf.config.num_hidden_layers
    st = search.stats
    count = int((n - 2) * 2 * skip_ratio)
    before = (search.attn, search.mlp)
    if (st["opt_iter"] + 1) % bayes_interval == 0:
        point = search.optimizer.suggest()
        ranked = [k for k, _ in sorted(point.items(), reverse=True, key=lambda item: item[1])[:count]]
        attn = [i + 1 for i in range(n - 2) if f"x{i}" in ranked]
        mlp = [i - (n - 2) + 1 for i in range(n - 2, (n - 2) * 2) if f"x{i}" in ranked]
        how = "bayes"
    else:
        chosen = search.rng.choice((n - 2) * 2, count, replace=False)
        attn = [i + 1 for i in range(n - 2) if i in chosen]
        mlp = [i - (n - 2) + 1 for i in range(n - 2, (n - 2) * 2) if i in chosen]
        point = {**{f"x{i}": float(i + 1 in attn) for i in range(n - 2)},
                 **{f"x{i}": float(i - (n - 2) + 1 in mlp) for i in range(n - 2, (n - 2) * 2)}}
        how = "random"
    window = generated[: context_window + 1]
    predicted = _run(hf, window, copy.deepcopy(prompt_cache), prompt_len, skip=(attn, mlp)).argmax(-1)
    score = (predicted[:-1] == torch.tensor(window[1:])).sum().item() / (len(window) - 1)
    with contextlib.redirect_stdout(io.StringIO()):
        search.optimizer.register(params=point, target=score)
    if score > st["origin_score"]:
        st["origin_score"], st["tolerance_iter"] = score, 0
        search.attn, search.mlp = attn, mlp
        if score > max_score:
            st["optimization"] = False
    else:
        search.attn, search.mlp = before
        st["tolerance_iter"] += 1
    st["opt_iter"] += 1
    if st["tolerance_iter"] > max_tolerance_iter or st["opt_iter"] > max_opt_iter:
        st["optimization"] = False
    return {"iteration": st["opt_iter"], "proposal": how, "matchness": score, "best": st["origin_score"],
            "skip_attn": sorted(search.attn), "skip_mlp": sorted(search.mlp), "active": st["optimization"]}


def generate(hf, search: Search, prompt: list[int], max_new_tokens: int, eos_token_id: int | None = None,
             skip_ratio: float = 0.45, context_window: int = 50, opt_interval: int = 1, bayes_interval: int = 25,
             max_opt_iter: int = 1000, max_tolerance_iter: int = 300, max_score: float = 0.93) -> Result:
    """One call of the authors' greedy ``swift_forward`` (module docstring)."""
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        out = [int(_run(hf, list(prompt), cache, 0)[-1].argmax())]
        prompt_cache = copy.deepcopy(cache)
        rounds = [Round("prefill", committed=1)]
        idx = 0
        while len(out) < max_new_tokens and eos_token_id not in out:
            past, new, left = cache.get_seq_length(), len(out) - 1, max_new_tokens - len(out)
            tops, confs = _draft(hf, search, out[-1], cache, past, new, max_new_tokens)
            choices = _choices(confs)
            tokens = [out[-1]] + [int(tops[len(c) - 1][c[-1]]) for c in choices]
            index = {tuple(c): j + 1 for j, c in enumerate(choices)}
            parent = [0] + [index.get(tuple(c[:-1]), 0) for c in choices]
            depth = torch.tensor([0] + [len(c) for c in choices])
            allowed = torch.zeros(len(tokens), len(tokens), dtype=torch.bool)
            for v in range(len(tokens)):
                a = v
                while True:
                    allowed[v, a] = True
                    if a == 0:
                        break
                    a = parent[a]
            target = _run(hf, tokens, cache, past, tree=(depth, allowed)).argmax(-1).tolist()
            # the candidates: every root-to-leaf path (siblings carry distinct tokens, so every longest
            # accepted path holds the same tokens, whichever of them the authors' order picks)
            leaves = [v for v in range(1, len(tokens)) if v not in parent[1:]]
            paths = []
            for leaf in leaves:
                p, a = [], leaf
                while a:
                    p.insert(0, a)
                    a = parent[a]
                paths.append(p)
            lengths = []
            for p in paths:
                n, prev = 0, 0
                for v in p:
                    if tokens[v] != target[prev]:
                        break
                    n, prev = n + 1, v
                lengths.append(n)
            best = lengths.index(max(lengths))
            accepted = paths[best][: lengths[best]]
            last = accepted[-1] if accepted else 0
            new_tokens = [tokens[v] for v in accepted] + [target[last]]
            for layer in cache.layers:  # keep the root and the accepted nodes' K/V after the committed ones
                rows = torch.tensor([past] + [past + v for v in accepted])
                layer.keys = torch.cat([layer.keys[..., :past, :], layer.keys[..., rows, :]], dim=-2)
                layer.values = torch.cat([layer.values[..., :past, :], layer.values[..., rows, :]], dim=-2)
            generated = out + [tokens[v] for v in accepted]
            out = out + new_tokens
            controller = {"chain": len(confs)}
            if (search.stats["optimization"] and idx % opt_interval == 0
                    and len(generated) > context_window + 1):
                controller["search"] = _optimise(hf, search, generated, prompt_cache, len(prompt), skip_ratio,
                                                 context_window, bayes_interval, max_opt_iter, max_tolerance_iter,
                                                 max_score)
            controller["skipped"] = len(search.attn) + len(search.mlp)
            kept = new_tokens[:left]
            committed = kept.index(eos_token_id) + 1 if eos_token_id in kept else len(kept)
            rounds.append(Round("self", len(tokens) - 1, len(accepted), committed, None, 25, controller))
            idx += 1
    out = out[:max_new_tokens]
    return Result(out[: out.index(eos_token_id) + 1] if eos_token_id in out else out, rounds)

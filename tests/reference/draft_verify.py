"""Draft & Verify's greedy decoding loop as the authors' code runs it, on transformers' own model.

Written for the tests from reading ``exact_self_speculative_generate`` (``decoding.py``), the draft
mode of ``modeling_llama.py`` and the evaluation notebooks of the authors' repository
(dilab-zju/self-speculative-decoding); none of selfspec's code runs here. The model is
transformers' ``LlamaForCausalLM`` with its own ``DynamicCache``; only the decoder layers of the
skip set are swapped, while drafting, for the authors' draft layer (:func:`self_draft`).

One call decodes one prompt (:func:`generate`), as one call of theirs does:

* the prompt goes through the full model, which gives the first token;
* each round drafts with the skip set from the pending token, on a copy of the cache, until a
  draft's top probability is below the threshold θ or the budget is reached (``step + j + 2 >=
  max_new_tokens``, tested after each draft, so at least one token is drafted even when one token
  of budget is left), and never stops at an EOS draft;
* the full model verifies ``[pending, d1..dk]`` in one pass; the longest matching prefix and the
  model's next token are committed and the cache keeps their positions;
* after every verification ``AR ← β1·AR + (1−β1)·accepted/drafted`` from ``AR = 0`` at the start of
  the call (β1 applies from the first round), ``θ̃ = θ + ε`` while ``AR < α``, else ``θ − ε``, or ``θ``
  when drafting reached K, and ``θ ← β2·θ + (1−β2)·θ̃``;
* with ``early_stop`` the loop ends after a round whose committed tokens hold EOS, and their output
  keeps that round's tokens after the EOS, cut to the budget only (:attr:`Result.authors_tokens`;
  :attr:`Result.tokens` ends at the EOS, as greedy decoding and selfspec do).

Each round is recorded as selfspec's step trace records a step (:class:`Round`, compared by
:func:`reference.traces.first_difference`): the prefill, then per round the drafts, accepted,
committed (what selfspec's loop keeps: cut to the budget and after EOS), K and θ, AR after it.

Only θ leaves the call: their notebooks pass the returned threshold to the next example, and do
no warm-up for this method.

``deviations`` switches on, by name, selfspec's documented deviations from this loop
(docs/design/fidelity.md §8), so a test can show that a configuration differs from the authors' loop by
exactly the ones it names: ``ar_first_rate`` (AR starts at the first round's rate: the paper's
text, β1 = 0 at the first round), ``ar_carried`` (AR is carried from the previous call: pass the
previous :attr:`Result.ar` as ``ar``), ``plain_last_token`` (one token of budget left: a plain step,
no draft) and ``stop_at_eos_draft`` (drafting stops after an EOS draft).
"""

from __future__ import annotations

import copy
import contextlib
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from reference import traces

#: selfspec's documented deviations from the authors' loop (module docstring)
DEVIATIONS = frozenset({"ar_first_rate", "ar_carried", "plain_last_token", "stop_at_eos_draft"})


@dataclass
class Round(traces.Round):
    """A round as :class:`reference.traces.Round` records it (``controller``: θ and AR after the
    round's update), and what it was about: ``left``, the tokens of budget before it, and its
    ``drafts``."""

    left: int = 0
    drafts: list[int] = field(default_factory=list)


@dataclass
class Result:
    """One call: the output cut after its first EOS (as selfspec and transformers report it), the
    authors' own output (``authors_tokens``: that round's tokens after EOS kept, cut to the budget),
    the rounds with the prefill first, and θ and AR after the call."""

    tokens: list[int]
    authors_tokens: list[int]
    rounds: list[Round]
    threshold: float
    ar: float | None


def _draft_layer(layer, skip_attn: bool, skip_mlp: bool, hidden_states, attention_mask=None,
                 position_ids=None, past_key_values=None, use_cache=False, position_embeddings=None, **kwargs):
    """The authors' decoder layer in draft mode: a skipped sublayer passes the residual through
    (a skipped attention writes no K/V); the others run as in transformers' layer."""
    if not skip_attn:
        out, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), attention_mask=attention_mask,
                                 position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache,
                                 position_embeddings=position_embeddings, **kwargs)
        hidden_states = hidden_states + out
    if not skip_mlp:
        hidden_states = hidden_states + layer.mlp(layer.post_attention_layernorm(hidden_states))
    return hidden_states


@contextlib.contextmanager
def self_draft(hf, skip_attn, skip_mlp):
    """Inside: ``hf`` is the draft model (their ``model.self_draft()``)."""
    swapped = []
    for i, layer in enumerate(hf.model.layers):
        if i in skip_attn or i in skip_mlp:
            layer.forward = lambda *a, _l=layer, _sa=i in skip_attn, _sm=i in skip_mlp, **k: _draft_layer(_l, _sa, _sm, *a, **k)
            swapped.append(layer)
    try:
        yield
    finally:
        for layer in swapped:
            del layer.forward


def _logits(hf, ids: list[int], cache: DynamicCache, start: int) -> torch.Tensor:
    """``[len(ids), V]`` logits of ``ids`` at positions ``start…`` after the cached ones."""
    x = torch.tensor([ids], device=hf.device)
    positions = torch.arange(start, start + len(ids), device=hf.device)[None]
    return hf(input_ids=x, past_key_values=cache, position_ids=positions, use_cache=True).logits[0]


def _kept(tokens: list[int], left: int, eos: int | None) -> int:
    """How many of a round's ``tokens`` selfspec's loop commits: cut to the ``left`` tokens of
    budget, and after an EOS token."""
    tokens = tokens[:left]
    return tokens.index(eos) + 1 if eos in tokens else len(tokens)


def generate(hf, prompt: list[int], max_new_tokens: int, skip_attn=(), skip_mlp=(), max_step_draft: int = 8,
             th_stop_draft: float = 0.8, auto_parameters=(1, 0.5, 0.9, 1e-2, 0.9), eos_token_id: int | None = None,
             early_stop: bool = False, deviations=frozenset(), ar: float | None = None) -> Result:
    """One call of the authors' greedy loop (module docstring); ``auto_parameters`` is their
    ``(update interval, β1, α, ε, β2)``; ``ar``, the previous call's AR, is read only under the
    ``ar_carried`` deviation (None: no previous call, AR starts as without it)."""
    unknown = set(deviations) - DEVIATIONS
    assert not unknown, unknown
    every, beta1, alpha, eps, beta2 = auto_parameters
    th = th_stop_draft
    if "ar_carried" not in deviations or ar is None:
        ar = None if "ar_first_rate" in deviations else 0.0
    skip_attn, skip_mlp = set(skip_attn), set(skip_mlp)
    cache = DynamicCache(config=hf.config)
    verified = 0
    with torch.no_grad():
        out = [int(_logits(hf, list(prompt), cache, 0)[-1].argmax())]
        tokens = list(out)
        rounds = [Round("prefill", committed=1, left=max_new_tokens)]
        while len(tokens) < max_new_tokens and not (early_stop and eos_token_id in out):
            step, n_cached = len(tokens), len(prompt) + len(tokens) - 1
            left, state = max_new_tokens - step, {"threshold": th, "ar": ar}
            if "plain_last_token" in deviations and left == 1:
                out = [int(_logits(hf, tokens[-1:], cache, n_cached)[-1].argmax())]
                tokens += out
                rounds.append(Round("plain", committed=_kept(out, left, eos_token_id),
                                    draft_limit=max_step_draft, controller=state, left=left))
                continue
            drafts: list[int] = []
            draft_cache = copy.deepcopy(cache)
            with self_draft(hf, skip_attn, skip_mlp):
                for j in range(max_step_draft):
                    p, token = _logits(hf, [drafts[-1] if drafts else tokens[-1]], draft_cache, n_cached + j)[-1] \
                        .softmax(-1).max(-1)
                    drafts.append(int(token))
                    if p.item() < th or step + j + 2 >= max_new_tokens:
                        break
                    if "stop_at_eos_draft" in deviations and drafts[-1] == eos_token_id:
                        break
            target = _logits(hf, [tokens[-1], *drafts], cache, n_cached).argmax(-1).tolist()
            accepted = 0
            while accepted < len(drafts) and target[accepted] == drafts[accepted]:
                accepted += 1
            out = target[: accepted + 1]
            cache.crop(-(len(drafts) - accepted))
            tokens += out
            verified += 1
            if verified % every == 0:
                ar = (accepted / len(drafts) if ar is None
                      else beta1 * ar + (1 - beta1) * accepted / len(drafts))
                if ar < alpha:
                    proposal = th + eps
                else:
                    proposal = th if len(drafts) == max_step_draft else th - eps
                th = beta2 * th + (1 - beta2) * proposal
            rounds.append(Round("self", len(drafts), accepted, _kept(out, left, eos_token_id), None, max_step_draft,
                                {"threshold": th, "ar": ar}, left, drafts))
    tokens = tokens[:max_new_tokens]
    ours = tokens[: tokens.index(eos_token_id) + 1] if eos_token_id in tokens else tokens
    return Result(ours, tokens, rounds, th, ar)

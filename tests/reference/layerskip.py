"""LayerSkip's self-speculative decoding loop (greedy), re-implemented from reading the authors'
code: ``self_speculation/self_speculation_generator.py`` (the generation loop and one round,
``single_step_speculation``) and ``self_speculation/llama_model_utils.py`` (``forward_early``,
``forward_remainder``, ``crop_past_key_values``) of facebookresearch/LayerSkip. DEL (hoenza/DEL)
is built on this loop; :mod:`reference.dynamic_exit` adds its controller through the hooks
:meth:`LayerSkip.plan`, :meth:`LayerSkip.keep` and :meth:`LayerSkip.observe`.

What the authors' loop does, and this one with it (LayerSkip counts the exit as ``E`` layers run
while drafting; selfspec's 0-based exit layer is ``ℓ = E - 1``):

* **no separate prefill**: the first round's input is the whole prompt, which runs layers
  ``0..E-1`` only; its last row gives the first draft, so the first generated token is itself a
  draft (``first_round="draft"``). ``first_round="prefill"`` instead runs the prompt through all
  layers and commits its argmax as one step first: selfspec's shared prefill, kept here so a test
  can show that this is the only difference;
* **one round**: at most ``min(γ, max_steps - generated - 1)`` drafts; each draft's input runs
  layers ``0..E-1`` (their K/V go into the cache), the final norm + LM head on the layer-``E``
  state gives the next draft (argmax); drafting stops after an EOS draft. The layer-``E``
  states of the round's inputs are kept (the exit-query cache);
* **verification**: the last draft runs layers ``0..E-1`` alone, then the kept states and its
  state run layers ``E..L-1`` in one pass; the final norm + LM head on every row, of which the
  rows from the round's last input on are compared with the drafts: the longest matching prefix
  is accepted and the target's token after it is the bonus;
* **rollback**: every layer's cache is cropped to the committed tokens but the last;
* **stop**: when ``max_steps`` tokens are generated, or an EOS token was committed (the
  authors' loop drops the EOS token and what follows; :class:`Result` keeps the EOS token, as
  selfspec and transformers' ``generate`` report it, and says where the authors' output ends).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache


@dataclass
class Plan:
    """One round's settings: exit layer ``ℓ`` (0-based; LayerSkip's ``E = ℓ + 1``), speculation
    length ``γ`` and the draft-stop threshold (0: never stop; DEL's τ_ℓ)."""

    exit_layer: int
    gamma: int
    threshold: float = 0.0


@dataclass
class Round:
    """What one round (or the prefill) did: the fields selfspec's step trace carries."""

    source: str
    drafted: int = 0
    accepted: int = 0
    committed: int = 0
    exit_layer: int | None = None
    draft_limit: int | None = None
    controller: dict[str, Any] | None = None


@dataclass
class Result:
    tokens: list[int]
    rounds: list[Round] = field(default_factory=list)
    #: the authors' output: ``tokens`` up to (without) the first EOS token
    authors_tokens: list[int] = field(default_factory=list)


class Transformer:
    """transformers' own modules of a ``LlamaForCausalLM``: embedding, decoder layers (each
    called as the model calls it, with rotary embeddings and a ``DynamicCache``), final norm and
    LM head. Masks are additive, as LayerSkip's ``_prepare_decoder_attention_mask`` builds them."""

    def __init__(self, hf) -> None:
        self.hf = hf
        self.inner = hf.model
        self.num_layers = len(self.inner.layers)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.hf.config)

    def embed(self, ids: list[int]) -> torch.Tensor:
        return self.inner.embed_tokens(torch.tensor([ids], device=self.hf.device))

    def run(self, h: torch.Tensor, layers: range, cache: DynamicCache,
            keep: dict[int, list[torch.Tensor]] | None = None) -> torch.Tensor:
        """``layers`` on ``h`` (``[1, n, d]``), appended after what the first of them has cached;
        ``keep[i]`` collects layer ``i``'s output."""
        n = h.shape[1]
        start = cache.get_seq_length(layers[0]) if len(layers) else 0
        pos = torch.arange(start, start + n, device=h.device).unsqueeze(0)
        rope = self.inner.rotary_emb(h, pos)
        mask = causal_mask(n, start, h.dtype, h.device)
        for i in layers:
            h = self.inner.layers[i](h, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                     use_cache=True, position_embeddings=rope)
            if keep is not None and i in keep:
                keep[i].append(h)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head, float32."""
        return self.hf.lm_head(self.inner.norm(h)).float()

    def crop(self, cache: DynamicCache, length: int) -> None:
        """``crop_past_key_values``: every layer keeps its first ``length`` positions."""
        for i in range(self.num_layers):
            extra = cache.get_seq_length(i) - length
            if extra > 0:
                cache.layers[i].crop(-extra)


def causal_mask(n: int, past: int, dtype, device) -> torch.Tensor:
    """``[1, 1, n, past + n]``: 0 where query ``q`` may see key ``k <= past + q``, the dtype's
    minimum elsewhere."""
    q = torch.arange(n, device=device).unsqueeze(1) + past
    k = torch.arange(past + n, device=device).unsqueeze(0)
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(k <= q, zero, torch.finfo(dtype).min).view(1, 1, n, past + n)


class LayerSkip:
    """The loop (module docstring) with a fixed ``(ℓ, γ)``; ``first_round`` ``draft`` (the
    authors') or ``prefill`` (selfspec's shared prefill step)."""

    def __init__(self, hf, exit_layer: int, gamma: int, eos_token_ids=(), first_round: str = "draft") -> None:
        if first_round not in ("draft", "prefill"):
            raise ValueError(f"first_round must be draft or prefill, got {first_round!r}")
        self.m = Transformer(hf)
        self.exit_layer, self.gamma = int(exit_layer), int(gamma)
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.first_round = first_round

    # --- hooks (a fixed exit here; DEL's controller overrides them) ---------------------------
    def plan(self) -> Plan:
        """The next round's plan."""
        return Plan(self.exit_layer, self.gamma)

    def keep(self) -> tuple[int, ...]:
        """Layers whose outputs a round keeps for :meth:`observe` (none for LayerSkip)."""
        return ()

    def observe(self, kept: dict[int, torch.Tensor], committed: list[int]) -> None:
        """After verification: ``kept[i]`` (``[1, rows, d]``) holds layer ``i``'s states of the
        verified rows whose context was right (the round's last input, then the accepted drafts),
        ``committed`` the token the final layer produced at each of them."""

    def controller(self) -> dict[str, Any] | None:
        """The controller's state after a round (none for LayerSkip)."""
        return None

    def prefill(self, prompt: list[int], cache: DynamicCache) -> int:
        """``first_round="prefill"``: the whole prompt through every layer; its argmax."""
        h = self.m.run(self.m.embed(prompt), range(self.m.num_layers), cache)
        return int(self.m.logits(h[:, -1]).argmax(-1))

    # --- the loop -----------------------------------------------------------------------------
    def generate(self, prompt: list[int], max_steps: int) -> Result:
        """``generate_token_ids`` (greedy): rounds until ``max_steps`` tokens or an EOS token."""
        prompt = [int(t) for t in prompt]
        if max_steps < 2 and self.first_round == "draft":
            # the authors' first round without drafts runs only the last prompt token through the
            # lower layers, over an empty cache: not a case the reference reproduces
            raise ValueError("the reference's draft first round needs max_steps >= 2")
        out: list[int] = []
        result = Result(out)
        cache = self.m.new_cache()
        with torch.inference_mode():
            chunk = prompt
            if self.first_round == "prefill":
                out.append(self.prefill(prompt, cache))
                result.rounds.append(Round("prefill", committed=1, controller=self.controller()))
                chunk = out[-1:]
            while len(out) < max_steps and not self.eos.intersection(out):
                plan = self.plan()
                new, record = self.round(cache, chunk, plan, min(plan.gamma, max_steps - len(out) - 1))
                record.source = "prefill" if chunk is prompt else ("self" if record.drafted else "plain")
                out.extend(new)
                self.m.crop(cache, len(prompt) + len(out) - 1)
                chunk = out[-1:]
                result.rounds.append(record)
        cut = [i for i, t in enumerate(out) if t in self.eos]
        if cut:
            del out[cut[0] + 1:]
        result.authors_tokens = out[: cut[0]] if cut else list(out)
        self._recount(result)
        return result

    @staticmethod
    def _recount(result: Result) -> None:
        """Each round's committed tokens after the cut after EOS (the rounds add up to the output)."""
        left = len(result.tokens)
        for r in result.rounds:
            r.committed = min(r.committed, left)
            left -= r.committed

    def round(self, cache: DynamicCache, chunk: list[int], plan: Plan, k_max: int) -> tuple[list[int], Round]:
        """``single_step_speculation``: draft up to ``k_max`` tokens from layer ``ℓ``, verify them
        with the upper layers over the exit-query cache, return the committed tokens."""
        m, E = self.m, plan.exit_layer + 1
        lower, upper = range(0, E), range(E, m.num_layers)
        keep = {i: [] for i in self.keep()}
        exit_query: list[torch.Tensor] = []
        drafts: list[int] = []
        ids = chunk
        for _ in range(k_max):  # forward_early
            h = m.run(m.embed(ids), lower, cache, keep)
            exit_query.append(h)
            conf, token = m.logits(h[0, -1]).softmax(-1).max(-1)
            drafts.append(int(token))
            ids = drafts[-1:]
            if float(conf) < plan.threshold or drafts[-1] in self.eos:
                break
        # forward_remainder: the round's last input alone through the lower layers, then every
        # kept exit-layer state and it through the upper layers in one pass
        h = m.run(m.embed((chunk + drafts)[-1:]), lower, cache, keep)
        h = m.run(torch.cat(exit_query + [h], dim=1), upper, cache, keep)
        target = m.logits(h)[0, len(chunk) - 1:].argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == target[accepted]:
            accepted += 1
        committed = drafts[:accepted] + [target[accepted]]
        if keep:
            rows = slice(len(chunk) - 1, len(chunk) + accepted)
            self.observe({i: torch.cat(s, dim=1)[:, rows] for i, s in keep.items()}, committed)
        return committed, Round("self", len(drafts), accepted, len(committed), plan.exit_layer,
                                plan.gamma or None, self.controller())

"""The layered model adapter: a Hugging Face causal LM driven one layer (and sublayer) at a time.

This module and :mod:`selfspec.models.loading` are the only places that know Hugging Face
internals (module names, the decoder layer's pieces, rotary embeddings). Every method drives
the model through this adapter, so baseline and methods share one runtime (docs/design.md §3,
Spec-Bench: a baseline on a different cache is a fairness confound).

The library's own modules and functions do the work — embedding, RMSNorm, the family's rotary
embedding and attention kernel, the MLP's activation, LM head — so no model family's numerics are
re-implemented. A decoder layer is split into its two residual sublayers (Draft & Verify §3.1
skips them independently)::

    h = h + attn(input_layernorm(h))          # attention sublayer
    h = h + mlp(post_attention_layernorm(h))  # MLP sublayer

Only the projections are arranged differently: each layer's q/k/v weights are rows of one
matrix, and so are gate/up (:func:`fuse_rows`; the modules keep views of it, so transformers'
own forward and the state dict are unchanged), and the sublayers above run them as one product
each. A decoding step then makes 4 linear calls per layer instead of 7 (on 2 CPU cores: 3 ms of a
52 ms step); the products are the same, element for element, under the skinny kernel. On CPU the
norms and the rotary embedding run as one operator each (:func:`~selfspec.models.kernels.rms_norm`,
:func:`~selfspec.models.kernels.rotary`, the library's arithmetic), since a step spent more time
launching their small tensor operations than computing them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from selfspec.models import capture, kernels
from selfspec.models.cache import LayerCache

#: model_type -> reason it works: decoder layers with input_layernorm / self_attn /
#: post_attention_layernorm / mlp, attention writing through ``past_key_values.update``.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


class UnsupportedModelError(ValueError):
    """The model family has a layer structure the adapter does not drive."""


def check_model_type(model_type: str | None, name: str, where: str = "") -> None:
    """Refuse a model family :class:`LayeredModel` cannot drive (read from a config.json or a GGUF
    file's ``general.architecture`` before any weights load)."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model {name!r}{f' ({where})' if where else ''} has model_type={model_type!r}; selfspec's "
            f"layered runtime supports {', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family decoder layers). "
            "Choose a model of one of these families."
        )


@dataclass(frozen=True)
class SkipSet:
    """Sublayers to skip while drafting (Draft & Verify §3.1): attention and MLP layer indices."""

    attn: frozenset[int] = frozenset()
    mlp: frozenset[int] = frozenset()

    @classmethod
    def of(cls, attn=(), mlp=()) -> "SkipSet":
        return cls(frozenset(int(i) for i in attn), frozenset(int(i) for i in mlp))

    def __len__(self) -> int:
        return len(self.attn) + len(self.mlp)


def fuse_rows(modules: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """Stack the weights (and biases) of linears that read the same input into one matrix and
    rebind each module's parameters to its rows (contiguous views), so one product computes all
    of them. Returns the fused weight, the fused bias (None when none has one) and the row counts."""
    sizes = [int(m.weight.shape[0]) for m in modules]
    weight = torch.cat([m.weight.detach() for m in modules])
    has_bias = [m.bias is not None for m in modules]
    if any(has_bias) and not all(has_bias):
        raise UnsupportedModelError("projections reading one input must all have a bias or none")
    bias = torch.cat([m.bias.detach() for m in modules]) if all(has_bias) else None
    for m, w in zip(modules, weight.split(sizes)):
        m.weight.data = w
    if bias is not None:
        for m, b in zip(modules, bias.split(sizes)):
            m.bias.data = b
    return weight, bias, sizes


class LayeredModel:
    """Adapter over a ``*ForCausalLM`` of the Llama family (Llama, Mistral, Qwen2).

    Contract (docs/design.md §2.1): :meth:`embed`, :meth:`run_layer`,
    :meth:`logits`, :attr:`num_layers`, :attr:`hidden_size`, plus :meth:`forward` for a
    whole pass and mask / rotary helpers.
    """

    def __init__(self, hf_model: torch.nn.Module, name: str = "model", linear_kernel: str = "auto",
                 capture_mode: str = "auto") -> None:
        model_type = getattr(hf_model.config, "model_type", None)
        check_model_type(model_type, name)
        window = getattr(hf_model.config, "sliding_window", None)
        if model_type == "mistral" and window:
            self.max_context = int(window)  # beyond it Mistral's attention would differ
        else:
            self.max_context = int(getattr(hf_model.config, "max_position_embeddings", 1 << 30))
        hf_model.eval()
        for p in hf_model.parameters():
            p.requires_grad_(False)
        self.hf = hf_model
        self.name = name
        #: sha of config + tokenizer (set by :func:`~selfspec.models.loading.load_model`);
        #: artefacts record it and refuse to load for another model
        self.fingerprint: str | None = None
        #: digest of the weights (set by :func:`~selfspec.models.loading.load_model`); checked likewise
        self.weights_digest: str | None = None
        self.config = hf_model.config
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = hf_model.lm_head
        self.num_layers = len(self.layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.num_kv_heads = int(self.config.num_key_value_heads)
        self.head_dim = int(
            getattr(self.config, "head_dim", None) or self.hidden_size // self.config.num_attention_heads
        )
        #: ``skinny`` or ``torch``: the kernel of the linears while this runtime computes
        #: (:mod:`selfspec.models.kernels`; the model config's ``linear_kernel`` resolved)
        self.linear_kernel = kernels.resolve(linear_kernel, self.device, self.dtype)
        kernels.install(self.linears(), self.linear_kernel)
        #: whether the CPU operators (skinny linear, fused norm and rotary) are built and chosen
        self._cpu_ops = self.linear_kernel == "skinny"
        #: per layer: (q|k|v weight, bias, row counts) and (gate|up weight, bias, row counts)
        self._qkv = [fuse_rows([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in self.layers]
        self._gate_up = [fuse_rows([l.mlp.gate_proj, l.mlp.up_proj]) for l in self.layers]
        family = sys.modules[type(self.layers[0].self_attn).__module__]
        self._apply_rotary = family.apply_rotary_pos_emb
        self._eager_attention = family.eager_attention_forward
        kernels.install_attention(self.config)
        impl = getattr(self.config, "_attn_implementation", "sdpa")
        # SDPA takes a boolean mask as is; eager attention adds the mask to the scores.
        self._additive_mask = impl not in ("sdpa", kernels.ATTENTION)
        #: ``graphs``, ``static`` or ``off``: how whole passes of few tokens run
        #: (:mod:`selfspec.models.capture`; the model config's ``capture`` resolved)
        self.capture = capture.resolve(capture_mode, self.device)
        self.steps = capture.StepRunner(self, self.capture) if self.capture != "off" else None
        self._pooled: LayerCache | None = None
        #: measured forward costs (:func:`selfspec.models.costs.model_curve`), once asked for
        self.cost_curve = None

    # --- properties ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, max_length: int, reuse: bool = False) -> LayerCache:
        """A cache of ``max_length`` positions. ``reuse=True`` (one generation at a time, as
        :meth:`~selfspec.decoding.base.Decoder.generate` uses it) hands out the model's pooled cache
        under ``capture=graphs``, emptied, so graphs captured on it are replayed across examples;
        it grows (and its graphs are dropped) when a longer one is asked for."""
        if max_length > self.max_context:
            raise ValueError(
                f"requested cache of {max_length} positions exceeds {self.name}'s context of "
                f"{self.max_context}; lower max_new_tokens or the task's max_prompt_tokens"
            )
        if reuse and self.capture == "graphs":
            pooled = self._pooled
            if pooled is None or pooled.max_length < max_length + capture.BUCKETS[-1]:
                if pooled is not None:
                    self.steps.forget(pooled)
                size = min(-(-(max_length + capture.BUCKETS[-1]) // 256) * 256, self.max_context)
                self._pooled = pooled = LayerCache(
                    self.num_layers, self.num_kv_heads, self.head_dim, size, self.dtype, self.device)
            pooled.reset()
            return pooled
        return LayerCache(
            self.num_layers, self.num_kv_heads, self.head_dim, max_length, self.dtype, self.device
        )

    def linears(self) -> list[torch.nn.Linear]:
        """The decoder layers' linear modules and the LM head."""
        mods = [m for m in self.layers.modules() if isinstance(m, torch.nn.Linear)]
        return mods + [self.lm_head]

    # --- pieces ----------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``[1, n]`` token ids -> ``[1, n, d]`` hidden states."""
        return self.embed_tokens(ids)

    def rope(self, positions: torch.Tensor, like: torch.Tensor | None = None):
        """Rotary ``(cos, sin)`` for ``[1, n]`` absolute positions (shared by all layers)."""
        ref = like if like is not None else self.lm_head.weight
        return self.rotary_emb(ref, positions)

    def positions(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, device=self.device).unsqueeze(0)

    def causal_mask(self, n_new: int, past: int) -> torch.Tensor | None:
        """Mask for ``n_new`` queries appended after ``past`` cached positions.

        SDPA's ``is_causal`` aligns the triangle top-left, wrong once keys outnumber queries,
        so queries after a cache always get an explicit mask (docs/design.md §4). None (no mask
        needed) for one query, and for a prefill into an empty cache under SDPA, whose causal
        kernel then runs as it does in transformers' own prefill.
        """
        if n_new == 1 or (past == 0 and not self._additive_mask):
            return None
        q = torch.arange(n_new, device=self.device).unsqueeze(1) + past
        k = torch.arange(past + n_new, device=self.device).unsqueeze(0)
        return self.prepare_mask(k <= q)

    def prepare_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """Boolean ``[q, kv]`` (True = may attend) -> the mask the attention kernel takes."""
        allowed = allowed.view(1, 1, *allowed.shape[-2:])
        if not self._additive_mask:
            return allowed
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)

    def attention(self, i, h, rope, cache: LayerCache | None, mask=None) -> torch.Tensor:
        """Attention sublayer of layer ``i`` with its residual; writes layer ``i``'s K/V.

        The family's attention forward with the q/k/v projections as one product: the family's
        rotary function, ``cache.update`` and the configured attention implementation."""
        layer = self.layers[i]
        attn = layer.self_attn
        weight, bias, sizes = self._qkv[i]
        cpu_ops = self._cpu_ops
        x = kernels.rms_norm(layer.input_layernorm, h, cpu_ops)
        q, k, v = kernels.linear(x, weight, bias, cpu_ops).split(sizes, dim=-1)
        shape = (*h.shape[:-1], -1, self.head_dim)
        q, k, v = q.view(shape).transpose(1, 2), k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
        q, k = kernels.rotary(self._apply_rotary, q, k, *rope, enabled=cpu_ops)
        if cache is not None:
            k, v = cache.update(k, v, i)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._eager_attention)
        # what the family passes: Qwen2 per layer, Mistral from the config (inert within max_context)
        window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(self.config, "sliding_window", None)
        out, _ = interface(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling,
                           **({"sliding_window": window} if window else {}))
        return h + attn.o_proj(out.reshape(*h.shape[:-1], -1).contiguous())

    def mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """MLP sublayer of layer ``i`` with its residual: ``down(act(gate(x)) * up(x))``, gate and up
        as one product."""
        layer = self.layers[i]
        weight, bias, sizes = self._gate_up[i]
        cpu_ops = self._cpu_ops
        gate, up = kernels.linear(kernels.rms_norm(layer.post_attention_layernorm, h, cpu_ops), weight, bias,
                                  cpu_ops).split(sizes, dim=-1)
        return h + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)

    def run_layer(
        self,
        i: int,
        h: torch.Tensor,
        rope,
        cache: LayerCache | None,
        mask: torch.Tensor | None = None,
        skip_attn: bool = False,
        skip_mlp: bool = False,
    ) -> torch.Tensor:
        """One decoder layer; a skipped sublayer leaves ``h`` (and layer ``i``'s cache) unchanged."""
        if not skip_attn:
            h = self.attention(i, h, rope, cache, mask)
        if not skip_mlp:
            h = self.mlp(i, h)
        return h

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(self.norm, h, self._cpu_ops)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head (float32 logits)."""
        with kernels.active():
            return self.lm_head(self.final_norm(h)).float()

    # --- whole passes ----------------------------------------------------------------------
    def forward(
        self,
        ids: torch.Tensor,
        cache: LayerCache | None,
        start: int | None = None,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        skip: SkipSet | None = None,
        layers: range | None = None,
        h: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``layers`` (default all) over ``ids`` (or given hidden states ``h``).

        Positions default to ``start + arange(n)`` where ``start`` defaults to the cache length
        of the first layer run; the mask defaults to causal after that many cached positions.
        Returns the last hidden states ``[1, n, d]`` (before the final norm). Under
        ``capture=static|graphs`` a pass of at most 32 tokens with default mask and positions runs
        as a static-shape (captured) pass (:mod:`selfspec.models.capture`).
        """
        layers = range(self.num_layers) if layers is None else layers
        if start is None:
            start = cache.length(layers[0]) if cache is not None and len(layers) else 0
        if self.steps is not None and mask is None and positions is None:
            with kernels.active():
                out = self.steps.run(ids, h, cache, start, layers, skip)
            if out is not None:
                return out
        if h is None:
            h = self.embed(ids)
        n = h.shape[1]
        if positions is None:
            positions = self.positions(start, n)
        if mask is None:
            mask = self.causal_mask(n, start)
        rope = self.rope(positions, h)
        with kernels.active():
            if skip is None:
                for i in layers:
                    h = self.mlp(i, self.attention(i, h, rope, cache, mask))
            else:
                for i in layers:
                    h = self.run_layer(i, h, rope, cache, mask, i in skip.attn, i in skip.mlp)
        return h

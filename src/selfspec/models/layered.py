"""The layered model: a Hugging Face causal LM driven one layer (and sublayer) at a time.

Every method drives the model through this runtime, so baseline and methods share one runtime
(docs/design.md §3, Spec-Bench: a baseline on a different cache is a fairness confound). What a
model family's modules are and where they live is its adapter's business
(:mod:`selfspec.models.families`, the transformers boundary); this module holds the layer
primitive every pass goes through and the runtime's own arithmetic choices.

The library's own modules and functions do the work — embedding, RMSNorm, the family's rotary
embedding and attention function, the MLP's activation, LM head — so no model family's numerics
are re-implemented. A decoder layer is split into its two residual sublayers (Draft & Verify §3.1
skips them independently)::

    h = h + attn(input_layernorm(h))          # attention sublayer
    h = h + mlp(post_attention_layernorm(h))  # MLP sublayer

A family may add three things, each a hook of its adapter that the Llama layout leaves unused
(Gemma 3 uses all three): a norm on each sublayer's output before the residual sum
(``attention_out_norm``, ``mlp_out_norm``); rotary embeddings of several kinds, one per layer
(``rope_kind``: :class:`Rope` carries every kind's ``(cos, sin)``); and a sliding attention window
per layer (``window``), enforced by the masks (:meth:`LayeredModel.window_mask`), so a context may
be longer than the window.

**One layer primitive.** :meth:`LayeredModel.run_layers` runs a range or subset of layers over
some rows, with a cache, positions and a mask, optionally keeping chosen layers' states. The
plain pass (:meth:`~LayeredModel.forward`), the static / captured pass
(:mod:`selfspec.models.capture`), drafting with skipped sublayers (Draft & Verify), early exit's
lower and upper layers and AdaDecode's deferred layers all run through it.

Only the projections are arranged differently: each layer's q/k/v weights are rows of one
matrix, and so are gate/up (:func:`fuse_rows`; the modules keep views of it, so transformers'
own forward and the state dict are unchanged), and the sublayers run them as one product each.
On CPU the runtime calls its own operators explicitly (:mod:`selfspec.models.kernels`: the skinny
linear, the fused norm and rotary, row-wise attention); nothing in the library is patched.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch

from selfspec.models import kernels
from selfspec.models.batch import Batch, Walk
from selfspec.models.cache import Appended, LayerCache
from selfspec.models.families import UnsupportedModelError, adapter
from selfspec.models.ledger import Ledger
from selfspec.models.passes import PASS, Pass, Rows, SkipSet
from selfspec.models.quantised import WeightSet, problem, weight_set, weights_format

#: the one-operator walk's mask of a one-row pass without one (made once, not per step)
_NO_MASK = torch.empty(0, dtype=torch.bool)

__all__ = ["KV", "Joins", "LayeredModel", "Pass", "Rope", "Rows", "SkipSet", "UnsupportedModelError", "fuse_rows"]

#: The batch a call joins, handed to :meth:`LayeredModel.forward`, :meth:`~LayeredModel.run_layers`,
#: :meth:`~LayeredModel.head` and :meth:`~LayeredModel.logits` as ``joins=`` by their caller (a decoder,
#: from its generation's :attr:`~selfspec.decoding.base.DecodeState.joins`): a call handed one **may
#: yield** (its generation's greenlet is parked, and the other sequences of the batch run, until the
#: batch runs its rows with theirs: :class:`selfspec.models.batch.Batch`); a call handed None runs alone,
#: at once. The model holds no batch: whether a pass joins one is said at the call.
Joins = Batch


class KV(Protocol):
    """Where a pass writes a layer's keys and values: ``write(i, k, v)`` stores ``[1, KV, n, D]`` for
    layer ``i`` and returns all the keys and values attention reads. :class:`LayerCache` appends at
    each layer's length; a static pass writes at fixed slots (:mod:`selfspec.models.capture`).
    A layer with a sliding window also gives the rows' ``positions`` (``[n]``) and reads back every
    key's position (``key_positions(i)``, ``[keys]``)."""

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def key_positions(self, layer: int) -> torch.Tensor: ...


class Rope(tuple):
    """The rotary ``(cos, sin)`` of one pass's positions. It unpacks as the pair of the family's
    first rotary kind (what the library's attention modules take); :meth:`of` gives each kind's
    (Gemma 3's sliding layers have their own base); ``positions`` (``[1, n]``) are what sliding
    windows bound."""

    def __new__(cls, pairs: dict, positions: torch.Tensor) -> "Rope":
        self = super().__new__(cls, next(iter(pairs.values())))
        self.pairs, self.positions = pairs, positions
        return self

    def of(self, kind) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pairs[kind]

    def rows(self, start: int, stop: int) -> "Rope":
        """The rows ``start:stop`` of the pass (AdaDecode runs the positions a layer owes)."""
        return Rope({k: (c[:, start:stop], s[:, start:stop]) for k, (c, s) in self.pairs.items()},
                    self.positions[:, start:stop])


def fuse_rows(modules: list[torch.nn.Linear], into: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """Stack the weights (and biases) of linears that read the same input into one matrix (``into``,
    when given, else a new tensor) and rebind each module's parameters to its rows (contiguous
    views), so one product computes all of them. Returns the fused weight, the fused bias (None
    when none has one) and the row counts."""
    sizes = [int(m.weight.shape[0]) for m in modules]
    weights = [m.weight.detach() for m in modules]
    weight = torch.cat(weights) if into is None else torch.cat(weights, out=into)
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
    """A causal LM of a supported family (:mod:`selfspec.models.families`) run layer by layer.

    Contract (docs/design.md §2.1): :meth:`embed`, :meth:`run_layers` (and :meth:`run_layer`),
    :meth:`logits` / :meth:`head`, :attr:`num_layers`, :attr:`hidden_size`, plus :meth:`forward`
    for a whole pass and mask / rotary helpers. ``passes``: a static-pass runner
    (:class:`selfspec.models.capture.StepRunner`) that takes eligible whole passes, or None.
    """

    def __init__(self, hf_model: torch.nn.Module, name: str = "model", linear_kernel: str = "auto",
                 attn_implementation: str = "sdpa", passes=None) -> None:
        self.family = adapter(hf_model, name, attn_implementation)
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
        #: the GGUF file the weights were read from (set by :func:`~selfspec.models.loading.load_model`);
        #: None for a checkpoint or a random model
        self.gguf_source: str | None = None
        self.config = hf_model.config
        fam = self.family
        self.max_context = fam.max_context()
        self.num_layers = len(fam.layers)
        self.hidden_size = int(self.config.hidden_size)
        self.vocab_size = int(fam.lm_head.weight.shape[0])
        self.num_kv_heads = int(self.config.num_key_value_heads)
        self.head_dim = int(
            getattr(self.config, "head_dim", None) or self.hidden_size // self.config.num_attention_heads
        )
        #: ``skinny`` or ``torch``: the kernel of the runtime's linears
        #: (:mod:`selfspec.models.kernels`; the model config's ``linear_kernel`` resolved)
        self.linear_kernel = kernels.resolve(linear_kernel, self.device, self.dtype)
        #: whether the CPU operators (skinny linear, fused norm and rotary) are built and chosen
        self._cpu_ops = self.linear_kernel == "skinny"
        if self._cpu_ops:
            for module in self._linears():
                if not module.weight.is_contiguous():
                    module.weight.data = module.weight.data.contiguous()
        #: per layer: (q|k|v weight, bias, row counts) and (gate|up weight, bias, row counts)
        places = self._weight_places() if self._cpu_ops else None
        self._qkv, self._gate_up = [], []
        for i in range(self.num_layers):
            self._qkv.append(fuse_rows(fam.qkv(i), places and places[i]["qkv"]))
            self._gate_up.append(fuse_rows(fam.gate_up(i), places and places[i]["gate_up"]))
            if places:
                for key, module in (("out", fam.out_proj(i)), ("down", fam.down_proj(i))):
                    module.weight.data = places[i][key].copy_(module.weight)
        if places:
            fam.lm_head.weight.data = places[-1]["head"].copy_(fam.lm_head.weight)
        #: whether the linears' weights sit in one huge-page block (:mod:`selfspec.models.arena`)
        self.weights_placed = bool(places)
        #: the weights of :meth:`_walk_in_cpp`, where every layer has the plain Llama layout
        self._walk = self._walk_weights()
        #: the static-pass runner (``capture`` ``static`` or ``graphs``), or None (``off``)
        self.steps = passes
        self._causal: tuple = (None, None)  # the last causal mask (:meth:`causal_mask`)
        self.capture = passes.mode if passes is not None else "off"
        self._pooled: LayerCache | None = None
        #: quantised copies of the weights, by format, made at the first pass that reads one (:meth:`weight_set`)
        self._weight_sets: dict[str, WeightSet] = {}

    # --- properties ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.family.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.family.lm_head.weight.dtype

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's ``|V|×d`` weight (drafting heads take rows of it)."""
        return self.family.lm_head.weight

    @property
    def tied_embeddings(self) -> bool:
        """Whether the LM head shares the embedding's weight (its bytes are read once per step)."""
        return self.family.embed_tokens.weight.data_ptr() == self.family.lm_head.weight.data_ptr()

    @property
    def embedding_bytes(self) -> int:
        """Bytes of the embedding table."""
        w = self.family.embed_tokens.weight
        return w.numel() * w.element_size()

    def layer_numel(self, i: int = 0) -> int:
        """Parameters of decoder layer ``i`` (cost models count in layers)."""
        return sum(p.numel() for p in self.family.layers[i].parameters())

    def new_cache(self, max_length: int, reuse: bool = False) -> LayerCache:
        """A cache of ``max_length`` positions (and, on a model whose passes take static shapes, room
        for a static pass's padding rows). ``reuse=True`` (one generation at a time, as
        :meth:`~selfspec.decoding.base.Decoder.generate` uses it) hands out the model's pooled cache
        under ``capture=static|graphs``, emptied, so the static passes built on it (under
        ``graphs``: captured) are replayed across examples; it grows, and its passes are dropped,
        only when a longer one is asked for than :meth:`reserve` made room for."""
        if max_length > self.max_context:
            raise ValueError(
                f"requested cache of {max_length} positions exceeds {self.name}'s context of "
                f"{self.max_context}; lower max_new_tokens or the task's max_prompt_tokens"
            )
        if self.steps is None:
            return LayerCache(self.num_layers, self.num_kv_heads, self.head_dim, max_length, self.dtype, self.device)
        if reuse:
            pooled = self.reserve(max_length)
            pooled.reset()
            return pooled
        return LayerCache(self.num_layers, self.num_kv_heads, self.head_dim, self._room(max_length), self.dtype,
                          self.device)

    def _room(self, max_length: int) -> int:
        """Positions of a cache for ``max_length`` on a model whose passes take static shapes: the
        padding rows of a static pass after the last position, within the model's context (a pass
        near the context's end whose padding has no room takes the dynamic path)."""
        return min(max_length + self.steps.padding, self.max_context)

    def reserve(self, max_length: int) -> LayerCache | None:
        """Make the pooled cache (``capture=static|graphs``) hold generations of up to ``max_length``
        positions, and return it (None where the passes are dynamic). The evaluation reserves the
        longest prompt and budget before its warm-up, so no example grows the pool: growing it drops
        every pass built on the old one (:meth:`~selfspec.models.capture.StepRunner.forget`), and
        under ``graphs`` each is captured again inside a timed example. The size is rounded up to 256
        positions and capped at the model's context; a request the pool already holds reuses it (at
        the cap too: one near the context's end reallocated the pool on every call)."""
        if self.steps is None:
            return None
        need = self._room(max_length)
        pooled = self._pooled
        if pooled is None or pooled.max_length < need:
            if pooled is not None:
                self.steps.forget(pooled)
            size = min(-(-need // 256) * 256, self.max_context)
            self._pooled = pooled = LayerCache(
                self.num_layers, self.num_kv_heads, self.head_dim, size, self.dtype, self.device)
        return pooled

    def with_passes(self, passes) -> "LayeredModel":
        """This model with another static-pass runner (``passes``: a
        :class:`~selfspec.models.capture.StepRunner`, or None for dynamic passes): the same weights,
        fused and placed once, not a second copy (``make gpu-check`` compares every method captured
        and eager on one set of weights)."""
        import copy

        twin = copy.copy(self)
        twin.steps, twin.capture = passes, passes.mode if passes is not None else "off"
        twin._pooled, twin._causal = None, (None, None)
        return twin

    def _weight_places(self) -> list[dict[str, torch.Tensor]] | None:
        """Where each layer's fused q|k|v, output, fused gate|up and down weights and then the LM
        head go: views, in the order a step reads them, of one block of huge pages
        (:mod:`selfspec.models.arena`), or None where the platform has none or the weights are not
        all of the model's dtype. Filled by :meth:`__init__`; the values are copies."""
        from selfspec.models import arena

        fam = self.family
        if not arena.available() or self.device.type != "cpu":
            return None
        per_layer = []
        for i in range(self.num_layers):
            mods = {"qkv": fam.qkv(i), "out": [fam.out_proj(i)], "gate_up": fam.gate_up(i), "down": [fam.down_proj(i)]}
            if any(m.weight.dtype != self.dtype for ms in mods.values() for m in ms):
                return None
            per_layer.append({key: (sum(int(m.weight.shape[0]) for m in ms), int(ms[0].weight.shape[1]))
                              for key, ms in mods.items()})
        shapes = [shape for layer in per_layer for shape in layer.values()] + [tuple(fam.lm_head.weight.shape)]
        views = iter(arena.place(shapes, self.dtype))
        places = [{key: next(views) for key in layer} for layer in per_layer]
        return places + [{"head": next(views)}]

    def weight_set(self, weights: str | None) -> WeightSet | None:
        """The weights a pass with ``Pass.weights = weights`` reads: None for the target's own, else this
        model's copy in that format (:mod:`selfspec.models.quantised`), made at the first call (seconds)
        and held once."""
        if weights is None:
            return None
        found = self._weight_sets.get(weights)
        if found is None:
            why = problem(self)
            if why is not None:
                raise ValueError(f"passes over {weights} weights cannot run: {why}")
            found = self._weight_sets[weights] = weight_set(self, weights)
        return found

    @property
    def weight_sets(self) -> dict[str, WeightSet]:
        """The quantised copies made so far, by format."""
        return dict(self._weight_sets)

    def _linears(self) -> list[torch.nn.Linear]:
        """The decoder layers' linear modules and the LM head."""
        mods = [m for m in self.family.layers.modules() if isinstance(m, torch.nn.Linear)]
        return mods + [self.family.lm_head]

    # --- pieces ----------------------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """``[1, n]`` token ids -> ``[1, n, d]`` hidden states."""
        return self.family.embed_tokens(ids)

    def rope(self, positions: torch.Tensor, like: torch.Tensor | None = None) -> Rope:
        """Rotary ``(cos, sin)`` for ``[1, n]`` absolute positions, of every kind the layers use."""
        ref = like if like is not None else self.family.lm_head.weight
        fam = self.family
        return Rope({kind: fam.rotary(ref, positions, kind) for kind in fam.rope_kinds}, positions)

    def positions(self, start: int, n: int) -> torch.Tensor:
        return torch.arange(start, start + n, device=self.device).unsqueeze(0)

    def causal_mask(self, n_new: int, past: int) -> torch.Tensor | None:
        """Mask for ``n_new`` queries appended after ``past`` cached positions.

        SDPA's ``is_causal`` aligns the triangle top-left, wrong once keys outnumber queries,
        so queries after a cache always get an explicit mask (docs/design.md §4). None (no mask
        needed) for one query, and for a prefill into an empty cache under SDPA, whose causal
        kernel then runs as it does in transformers' own prefill.
        """
        if n_new == 1 or (past == 0 and not self.family.additive_mask):
            return None
        key = (n_new, past, torch.is_inference_mode_enabled())
        if self._causal[0] != key:  # the last one is kept: a pass in layer segments asks per segment
            q = torch.arange(n_new, device=self.device).unsqueeze(1) + past
            k = torch.arange(past + n_new, device=self.device).unsqueeze(0)
            self._causal = (key, self.prepare_mask(k <= q))
        return self._causal[1]

    def prepare_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """Boolean ``[q, kv]`` (True = may attend) -> the mask the attention function takes."""
        allowed = allowed.view(1, 1, *allowed.shape[-2:])
        if not self.family.additive_mask:
            return allowed
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.dtype).min)

    def window_mask(self, mask: torch.Tensor | None, positions: torch.Tensor, key_positions: torch.Tensor,
                    window: int) -> torch.Tensor | None:
        """``mask`` (None, boolean or additive, over ``key_positions``' keys) narrowed to the keys
        less than ``window`` positions behind each query (``positions``, ``[n]``): a sliding
        window layer's mask, as transformers' ``sliding_window_overlay`` (key > query - window).

        A position is never past its slot (a pass writes its rows after the cache; a tree node
        sits at its depth), so with no more keys than ``window`` nothing is narrowed. A None mask
        is a one-token step (every key) or a prefill into an empty cache (causal)."""
        if key_positions.shape[-1] <= window:
            return mask
        behind = positions.unsqueeze(1) - key_positions.unsqueeze(0)  # [n, keys]
        near = behind < window
        if mask is None:
            return self.prepare_mask(near if positions.shape[-1] == 1 else near & (behind >= 0))
        if mask.dtype == torch.bool:
            return mask & near
        return torch.where(near, mask, torch.finfo(mask.dtype).min)

    def norm(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The family's RMSNorm ``module`` on ``x`` (the fused CPU operator follows Llama's form or,
        for Gemma, ``(1 + w)`` in float32: :func:`kernels.rms_norm`)."""
        return kernels.rms_norm(module, x, self._cpu_ops, self.family.unit_offset_norms)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               rows_apart: bool = False) -> torch.Tensor:
        """``x @ weight.T (+ bias)`` with the runtime's linear kernel (``rows_apart``: every row's
        arithmetic its own, at any row count: :func:`kernels.linear`)."""
        return kernels.linear(x, weight, bias, self._cpu_ops, rows_apart)

    def attention(self, i, h, rope, kv: KV | None, mask=None, ws: WeightSet | None = None) -> torch.Tensor:
        """Attention sublayer of layer ``i`` with its residual; writes layer ``i``'s K/V to ``kv``.

        The family's attention with the q/k/v projections as one product (:meth:`_heads`): the
        family's rotary function (of the layer's kind), the K/V write, the layer's window narrowing
        the mask, then the attention function (:meth:`_attend`), the output projection and the
        family's output norm if any (:meth:`_attention_out`). ``ws``: the quantised weights the
        projections read (:meth:`weight_set`; None: the target's)."""
        return self._attention_out(i, h, self._attend(i, *self._heads(i, h, ws=ws), rope, kv, mask), ws=ws)

    def _heads(self, i: int, h: torch.Tensor, rows_apart: bool = False, ws: WeightSet | None = None):
        """Layer ``i``'s queries, keys and values of the rows of ``h``, each ``[1, n, heads, D]``."""
        fam = self.family
        weight, bias, sizes = (self._qkv if ws is None else ws.qkv)[i]
        x = self.norm(fam.attention_norm(i), h)
        q, k, v = self.linear(x, weight, bias, rows_apart).split(sizes, dim=-1)
        shape = (*h.shape[:-1], -1, self.head_dim)
        return q.view(shape), k.view(shape), v.view(shape)

    def _attend(self, i: int, q, k, v, rope, kv: KV | None, mask) -> torch.Tensor:
        """Attention of one pass's rows (``[1, n, heads, D]`` each, :meth:`_heads`) in layer ``i``:
        the q/k norms, rotary embedding, K/V write, window and attention; ``[1, n, heads, D]``."""
        fam, cpu_ops = self.family, self._cpu_ops
        attn = fam.attention_module(i)
        if fam.normalises_qk:  # Qwen3's and Gemma 3's per-head q/k norms
            q, k = fam.qk_norm(i, q, k, self.norm)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        kind = fam.rope_kind(i)
        q, k = kernels.rotary(fam.apply_rotary, q, k, *(rope if kind is None else rope.of(kind)), enabled=cpu_ops)
        window = fam.window(i)
        if window is None:
            if kv is not None:
                k, v = kv.write(i, k, v)
        else:
            positions = rope.positions[0]
            if kv is not None:
                k, v = kv.write(i, k, v, positions)
            mask = self.window_mask(mask, positions, positions if kv is None else kv.key_positions(i), window)
        return kernels.attention(fam.attend, attn, q, k, v, mask, attn.scaling, **fam.attention_kwargs(i))

    def _attention_out(self, i: int, h: torch.Tensor, out: torch.Tensor, rows_apart: bool = False,
                       ws: WeightSet | None = None) -> torch.Tensor:
        """The output projection of layer ``i``'s attention ``out`` (``[1, n, heads, D]``), its output
        norm if any, and the residual onto ``h``."""
        fam = self.family
        o = fam.out_proj(i)
        weight, bias = (o.weight, o.bias) if ws is None else ws.out[i]
        out = self.linear(out.reshape(*h.shape[:-1], -1).contiguous(), weight, bias, rows_apart)
        post = fam.attention_out_norm(i)
        return h + (out if post is None else self.norm(post, out))

    def mlp(self, i: int, h: torch.Tensor, rows_apart: bool = False, ws: WeightSet | None = None) -> torch.Tensor:
        """MLP sublayer of layer ``i`` with its residual: ``down(act(gate(x)) * up(x))``, gate and up
        as one product, and the family's output norm if any (``ws``: as :meth:`attention`)."""
        fam = self.family
        weight, bias, sizes = (self._gate_up if ws is None else ws.gate_up)[i]
        gate, up = self.linear(self.norm(fam.mlp_norm(i), h), weight, bias, rows_apart).split(sizes, dim=-1)
        down = fam.down_proj(i)
        weight, bias = (down.weight, down.bias) if ws is None else ws.down[i]
        out = self.linear(fam.act(i)(gate) * up, weight, bias, rows_apart)
        post = fam.mlp_out_norm(i)
        return h + (out if post is None else self.norm(post, out))

    def run_layer(self, i: int, h: torch.Tensor, rope, kv: KV | None, mask: torch.Tensor | None = None,
                  skip_attn: bool = False, skip_mlp: bool = False, ws: WeightSet | None = None) -> torch.Tensor:
        """One decoder layer; a skipped sublayer leaves ``h`` (and layer ``i``'s cache) unchanged."""
        if not skip_attn:
            h = self.attention(i, h, rope, kv, mask, ws)
        if not skip_mlp:
            h = self.mlp(i, h, ws=ws)
        return h

    def _walk_weights(self) -> dict | None:
        """Per layer, the weights of a walk in one operator (``csrc/layer_walk.cpp``): the CPU
        operators are on, every layer has the plain Llama layout (no q/k or output norms, no
        window, one rotary kind, no biases but q/k/v biases in every layer or none (Qwen2's), SiLU,
        Llama's norm form, one epsilon and attention scale) and SDPA with
        the row-wise attention kernel; else None."""
        fam, n = self.family, self.num_layers
        from transformers.activations import SiLUActivation
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if not (self._cpu_ops and self.dtype in (torch.float32, torch.bfloat16) and self.head_dim % 8 == 0
                and fam.attend is sdpa_attention_forward and not fam.normalises_qk and not fam.unit_offset_norms
                and kernels._attention_kernel()):
            return None
        norm1 = [fam.attention_norm(i) for i in range(n)]
        norm2 = [fam.mlp_norm(i) for i in range(n)]
        out = [fam.out_proj(i) for i in range(n)]
        down = [fam.down_proj(i) for i in range(n)]
        eps = {float(m.variance_epsilon) for m in norm1 + norm2 if hasattr(m, "variance_epsilon")}
        scaling = {float(fam.attention_module(i).scaling) for i in range(n)}
        plain = all(fam.window(i) is None and fam.rope_kind(i) is None and fam.attention_out_norm(i) is None
                    and fam.mlp_out_norm(i) is None and isinstance(fam.act(i), SiLUActivation)
                    and self._gate_up[i][1] is None
                    and out[i].bias is None and down[i].bias is None
                    and self._gate_up[i][2][0] == self._gate_up[i][2][1] for i in range(n))
        weights = [m.weight for m in norm1 + norm2 + out + down]
        biases = [b for _, b, _ in self._qkv if b is not None]
        if (not plain or len(eps) != 1 or len(scaling) != 1 or len(biases) not in (0, n)
                or any(w.dtype != self.dtype or w.shape[-1] % 8 for w in weights)
                or any(b.dtype != self.dtype for b in biases)):
            return None
        return {"norm1": [m.weight for m in norm1], "qkv": [w for w, _, _ in self._qkv], "qkv_bias": biases,
                "out": [m.weight for m in out], "norm2": [m.weight for m in norm2],
                "gate_up": [w for w, _, _ in self._gate_up], "down": [m.weight for m in down], "eps": eps.pop(),
                "scaling": scaling.pop()}

    def _walk_in_cpp(self, walks: list, layers, skip: SkipSet | None = None, ws: WeightSet | None = None
                     ) -> torch.Tensor | None:
        """The walk of :meth:`run_layers` as one operator (``csrc/layer_walk.cpp``: the same
        operators in the same order, called from C++) over one pass or several sequences' passes
        (``walks``, each a :class:`~selfspec.models.batch.Walk`; their rows concatenated, as
        :meth:`run_batched` takes them), where it applies: a plain-Llama model
        (:meth:`_walk_weights`), no gradient, each pass at most :data:`~selfspec.models.kernels.MAX_ROWS`
        rows after a cache whose layers all hold the same positions (those whose attention runs,
        under a ``skip`` set), no mask for one row or a boolean one; kept states (``keep``, as
        :meth:`run_layers`) are copied and skipped sublayers left out by the operator. Returns the
        states after the last layer, every pass's rows in order, or None (the Python walk). ``ws``: the
        quantised weights the linears read (their walk weights, :class:`~selfspec.models.quantised.WeightSet`)."""
        walk = self._walk if ws is None else ws.walk
        if walk is None or torch.is_grad_enabled() or not len(layers):
            return None
        layers = list(layers)
        if skip is None:  # a decoding step: no per-layer lists to build
            no_attn, no_mlp, attending = [], [], layers
        else:
            no_attn = [i for i in layers if i in skip.attn]
            no_mlp = [i for i in layers if i in skip.mlp]
            attending = [i for i in layers if i not in skip.attn]
        bounds, keys, values, cos, sin, allowed, starts, kept = [0], [], [], [], [], [], [], []
        for b, w in enumerate(walks):
            n, kv = w.h.shape[1], w.kv
            if type(kv) is not LayerCache or n > kernels.MAX_ROWS or w.h.dtype != self.dtype:
                return None
            if w.mask is None:
                if n != 1:
                    return None
                mask = _NO_MASK
            elif w.mask.dtype != torch.bool or w.mask.shape[:-2].numel() != 1:
                return None
            else:
                mask = w.mask
            lengths = kv.lengths
            start = lengths[attending[0]] if attending else 0
            if (start + n > kv.max_length or any(lengths[i] != start for i in attending)
                    or mask.numel() and mask.shape[-1] != start + n):
                return None
            c, s = w.rope
            if c.dtype != self.dtype:
                return None
            for i in sorted(w.keep) if w.keep else ():  # a few layers: checked one by one, not the walk's layers
                if i not in layers or w.keep[i].dtype != self.dtype or w.keep[i].dim() != 2:
                    return None
                kept.append((i, b, w.keep[i]))
            bounds.append(bounds[-1] + n)
            keys += kv.keys
            values += kv.values
            cos.append(c)
            sin.append(s)
            allowed.append(mask)
            starts.append(start)
        kept.sort(key=lambda e: e[:2])
        h = walks[0].h if len(walks) == 1 else torch.cat([w.h for w in walks], dim=1)
        # the linears' blocks, as kernels.linear(rows_apart=True) takes them: float32 in blocks of at most
        # MAX_ROWS rows, bfloat16 all at once (its kernel's rows never depend on the block)
        block = kernels.MAX_ROWS if self.dtype == torch.float32 else max(h.shape[1], 1)
        out = torch.ops.selfspec.layer_walk(h, bounds, layers, walk["norm1"], walk["qkv"], walk["qkv_bias"], walk["out"],
                                            walk["norm2"],
                                            walk["gate_up"], walk["down"], keys, values, cos, sin, allowed, starts,
                                            self.head_dim, walk["eps"], walk["scaling"], block,
                                            [e[0] for e in kept], [e[1] for e in kept], [e[2] for e in kept],
                                            no_attn, no_mlp)
        for w, start, (a, b) in zip(walks, starts, zip(bounds, bounds[1:])):
            lengths = w.kv.lengths
            for i in attending:
                lengths[i] = start + b - a
        return out

    def run_layers(self, h: torch.Tensor, layers, kv: KV | None, rope, mask: torch.Tensor | None = None,
                   skip: SkipSet | None = None, keep: dict[int, torch.Tensor] | None = None,
                   eager: bool = False, ledger: Ledger | None = None, weights: str | None = None,
                   joins: Joins | None = None) -> torch.Tensor:
        """The layer primitive: run ``layers`` (a range or any increasing subset) over the rows of
        ``h [1, n, d]`` at the positions ``rope`` encodes, writing K/V to ``kv`` and attending under
        ``mask``; ``skip`` leaves sublayers out (Draft & Verify); ``keep`` ``{layer: out}`` copies
        the last ``len(out)`` rows of the state after each of those layers into ``out`` (early
        exit's exit-query cache, DEL's shadow tokens). Returns the states after the last layer run.
        The walk is recorded in ``ledger`` when one is given (``eager``: as a decoding pass that a
        capturing model ran eagerly). ``weights``: the linears read a quantised copy in that format
        (:meth:`weight_set`, a draft's: ``Pass.weights``), None the target's. ``joins``: the batch the
        walk joins (:data:`Joins`: the call may yield to the batch's other sequences), None alone."""
        recorded = None
        if ledger is not None:
            first = next(iter(layers), None)
            context = kv.length(first) if first is not None and hasattr(kv, "length") else 0
            before = len(ledger.ops)
            _record_walk(ledger, h.shape[1], layers, skip, context, eager, weights=weights, merge=joins is None)
            recorded = (ledger, before) if len(ledger.ops) > before else None
        if joins is not None:  # several generations decode at once: their walks run together
            return joins.parked_walk(self, h, layers, kv, rope, mask, skip, keep,
                                     ledger.current if ledger else "host", weights, recorded)
        return self.walk(h, layers, kv, rope, mask, skip, keep, weights)

    def walk(self, h: torch.Tensor, layers, kv: KV | None, rope, mask: torch.Tensor | None = None,
             skip: SkipSet | None = None, keep: dict[int, torch.Tensor] | None = None,
             weights: str | None = None) -> torch.Tensor:
        """:meth:`run_layers`'s walk itself, unrecorded and alone (the C++ walk where it applies)."""
        ws = self.weight_set(weights)
        out = self._walk_in_cpp([Walk(h, kv, rope, mask, keep)], layers, skip, ws)
        if out is not None:
            return out
        for i in layers:
            if skip is None:
                h = self.mlp(i, self.attention(i, h, rope, kv, mask, ws), ws=ws)
            else:
                h = self.run_layer(i, h, rope, kv, mask, i in skip.attn, i in skip.mlp, ws)
            if keep is not None and i in keep:
                out = keep[i]
                out.copy_(h[0, h.shape[1] - out.shape[0]:])
        return h

    def run_batched(self, passes: list, layers, skip: SkipSet | None, weights: str | None = None
                    ) -> list[torch.Tensor]:
        """:meth:`walk` over several passes at once, each a :class:`~selfspec.models.batch.Walk` (its
        hidden states, K/V, rotary tables, mask and kept states), through the same ``layers`` with the
        same ``skip``: the norms and linears take every pass's rows in one product, each row's
        arithmetic its own pass's (``rows_apart``: float32 blocks of at most
        :data:`~selfspec.models.kernels.MAX_ROWS` rows through the skinny kernel, whose rows do not
        depend on the block), and the attention runs each pass's rows over its own keys, as its own
        walk runs them. So every row equals the one its pass alone computes, bit for bit, and the
        weights are read once for all of them (:mod:`selfspec.models.batch`: several generations
        decoding at once); in one operator where every pass suits it (:meth:`_walk_in_cpp`), which
        calls each sequence's attention from C++ rather than from Python. Returns each pass's states
        after the last layer."""
        ends = list(itertools.accumulate(p.h.shape[1] for p in passes))
        bounds = list(zip([0] + ends[:-1], ends))
        ws = self.weight_set(weights)
        h = self._walk_in_cpp(passes, layers, skip, ws)
        if h is not None:
            return [h[:, a:b] for a, b in bounds]
        h = torch.cat([p.h for p in passes], dim=1)
        for i in layers:
            if skip is None or i not in skip.attn:
                q, k, v = self._heads(i, h, rows_apart=True, ws=ws)
                out = [self._attend(i, q[:, a:b], k[:, a:b], v[:, a:b], p.rope, p.kv, p.mask)
                       for p, (a, b) in zip(passes, bounds)]
                h = self._attention_out(i, h, torch.cat(out, dim=1), rows_apart=True, ws=ws)
            if skip is None or i not in skip.mlp:
                h = self.mlp(i, h, rows_apart=True, ws=ws)
            for p, (a, b) in zip(passes, bounds):
                if p.keep is not None and i in p.keep:
                    out = p.keep[i]
                    out.copy_(h[0, b - out.shape[0]:b])
        return [h[:, a:b] for a, b in bounds]

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(self.family.norm, h)

    def head(self, x: torch.Tensor, weight: torch.Tensor | None = None, ledger: Ledger | None = None,
             joins: Joins | None = None) -> torch.Tensor:
        """The LM head (or another ``|rows|×d`` head ``weight``: rows of it, or of a quantised copy's,
        :attr:`~selfspec.models.quantised.WeightSet.head`) on normalised states, in the model's dtype
        (recorded in ``ledger`` when one is given). ``joins``: the batch the product joins (:data:`Joins`:
        the call may yield), None alone."""
        weight = self.family.lm_head.weight if weight is None else weight
        if ledger is not None:
            ledger.head(x.numel() // x.shape[-1], int(weight.shape[0]), weights_format(weight))
        if joins is not None:  # several generations decode at once: their head products run together
            return joins.parked_head(self, x, weight, ledger.current if ledger else "host",
                                     (ledger, len(ledger.ops) - 1) if ledger is not None else None)
        return self.linear(x, weight)

    def logits(self, h: torch.Tensor, ledger: Ledger | None = None, joins: Joins | None = None) -> torch.Tensor:
        """Final norm + LM head (float32 logits; recorded in ``ledger`` when one is given; ``joins``: as
        :meth:`head`)."""
        return self.head(self.final_norm(h), ledger=ledger, joins=joins).float()

    # --- whole passes ----------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cache: LayerCache | None, p: Pass = PASS, *, start: int | None = None,
                keep: dict[int, torch.Tensor] | None = None, rope: Rope | None = None, checkpoint: bool = False,
                ledger: Ledger | None = None, joins: Joins | None = None) -> torch.Tensor:
        """Run the pass ``p`` (:class:`~selfspec.models.passes.Pass`: its layers, skipped sublayers and
        where its rows sit) over ``x``, token ids ``[1, n]`` or hidden states ``[1, n, d]``: every pass of
        a decoder goes through here. Returns the states after the last layer run ``[1, n, d]`` (before
        the final norm).

        ``start``: the cached positions before the rows (default: the first layer's cache length); a
        chain's rows sit at ``start + arange(n)``, causal, a tree's at ``start + offsets`` under its
        ancestor mask, a scratch pass's after its ``context`` (:meth:`_scratch`), packed rows where
        their positions say, under their mask. ``keep`` ``{layer: out}``: as :meth:`run_layers`.
        ``rope``: the rotary tables of the pass's positions, when the caller already has them.
        ``checkpoint`` (training): each layer is run again in backward instead of keeping its
        activations (gradient checkpointing), and the pass reads the cache without writing to it.
        Under ``capture=static|graphs`` a pass of at most 256 rows (packed rows excepted) runs as a
        static-shape (captured) pass (:mod:`selfspec.models.capture`). ``ledger``: the generation's
        cost ledger (:mod:`selfspec.models.ledger`), which records the pass's walk; None records
        nothing. ``joins``: the batch of generations the pass joins (:data:`Joins`: the call may yield to
        the batch's other sequences until the batch runs its rows with theirs), None alone; a static
        pass and a training pass (``checkpoint``) run alone whatever it is (a batch refuses a model
        whose passes take static shapes)."""
        layers, rows = p.layer_range(self.num_layers), p.rows
        if rows.kind == "scratch":
            if keep or checkpoint:
                raise ValueError("forward: a scratch pass keeps no states and trains nothing (keep, checkpoint)")
            return self._scratch(p, x if x.is_floating_point() else self.embed(x), cache, layers, ledger, joins)
        if start is None:
            start = cache.length(layers[0]) if cache is not None and len(layers) else 0
        if self.steps is not None and rows.kind != "packed":
            out = self.steps.run(self, p, x, cache, start, keep)
            if out is not None:
                if ledger is not None:
                    _record_walk(ledger, out.shape[1], layers, p.skip, start, ran=self.steps.last, weights=p.weights)
                return out
        h = x if x.is_floating_point() else self.embed(x)
        n = h.shape[1]
        positions = mask = None
        if rows.kind == "tree":
            positions = (start + rows.offsets).unsqueeze(0)
            prefix = torch.ones(n, start, dtype=torch.bool, device=rows.allowed.device)
            mask = self.prepare_mask(torch.cat([prefix, rows.allowed], dim=1))
        elif rows.kind == "packed":
            positions, mask = rows.positions, rows.mask
        if rope is None:
            rope = self.rope(self.positions(start, n) if positions is None else positions, h)
        if mask is None:
            mask = self.causal_mask(n, start)
        if checkpoint:
            if keep is not None:
                raise ValueError("forward: checkpoint=True keeps no states (keep=...): a training pass has none to keep")
            if p.weights is not None:
                raise ValueError("forward: checkpoint=True trains through the target's weights, not a quantised copy")
            return self._checkpointed(h, layers, cache, start, rope, mask, p.skip)
        # a decoding pass (the cache holds positions) that a capturing model (static or graphs) runs
        # here ran eagerly: a profile measured with graphs prices it apart (selfspec.measure.profile)
        eager = self.steps is not None and start > 0
        return self.run_layers(h, layers, cache, rope, mask, p.skip, keep, eager, ledger, p.weights, joins)

    def _scratch(self, p: Pass, h: torch.Tensor, cache: LayerCache, layers: range, ledger: Ledger | None,
                 joins: Joins | None = None) -> torch.Tensor:
        """A scratch pass (:meth:`Rows.scratch`): the rows of ``h`` ``[1, n, d]`` after the cache's first
        ``context`` positions, seeing those and the rows ``allowed`` marks, their K/V kept nowhere: on a
        capturing model written past the cache's positions with its lengths left as they were
        (:meth:`selfspec.models.capture.StepRunner.run`), else read beside the cache's
        (:class:`~selfspec.models.cache.Appended`). Recorded in ``ledger`` as a walk at ``context``.

        A capturing model runs it **one layer at a time**, each layer with its own part of the skip
        set, so its static passes are keyed by (layer, sublayers skipped, bucket), not by the whole
        set. A search scores a new skip set on almost every pass (SWIFT's matchness: up to 1,000 random
        candidates), and a pass keyed by the whole set would capture a graph for one replay (two
        warm-up runs and the recording, dearer than running it eagerly) and push the decoding passes'
        graphs out of the LRU; by layer, every candidate replays the same ``3L`` graphs or fewer per
        bucket. The operators and their order are the whole pass's. Where the runner does not take it
        (wider than a bucket, no room) it runs eagerly, joining ``joins`` where its caller hands it a
        batch (SWIFT's matchness passes do; the searches' branch passes are handed none and run alone)."""
        rows, skip = p.rows, p.skip
        if self.steps is not None:
            start = max(cache.length(i) for i in layers)
            out, ran = h, False
            for i in layers:
                attn, mlp = skip is not None and i in skip.attn, skip is not None and i in skip.mlp
                if attn and mlp:
                    continue  # the layer left out whole
                part = SkipSet.of([i] if attn else (), [i] if mlp else ()) if attn or mlp else None
                x = self.steps.run(self, Pass(range(i, i + 1), part, rows, p.at_least, p.weights), out, cache, start)
                if x is None:
                    if ran:  # the runner's conditions are the same for every layer of the pass
                        raise RuntimeError(f"a scratch pass: layer {i} of {layers} took the dynamic path after the "
                                           "layers before it took the static one")
                    break
                out, ran = x, True
            else:  # every layer static (or left out)
                if ledger is not None:
                    _record_walk(ledger, out.shape[1], layers, skip, rows.context, ran=self.steps.last, weights=p.weights)
                return out
        rope = mask = None
        if skip is None or any(i not in skip.attn for i in layers):  # an MLP walk needs neither
            past = torch.ones(h.shape[1], rows.context, dtype=torch.bool, device=rows.allowed.device)
            mask = self.prepare_mask(torch.cat([past, rows.allowed], dim=1))
            rope = self.rope((rows.context + rows.offsets).unsqueeze(0), h)
        return self.run_layers(h, layers, Appended(cache, rows.context), rope, mask, skip,
                               eager=self.steps is not None, ledger=ledger, weights=p.weights, joins=joins)

    def _checkpointed(self, h, layers, cache: LayerCache | None, start: int, rope, mask, skip) -> torch.Tensor:
        """:meth:`run_layers` one layer at a time under ``torch.utils.checkpoint``: backward keeps each
        layer's input only and runs the layer again, reading the cache's first ``start`` positions
        (:class:`~selfspec.models.cache.Appended`)."""
        from torch.utils.checkpoint import checkpoint

        kv = None if cache is None else Appended(cache, start)
        for i in layers:
            h = checkpoint(self.run_layers, h, range(i, i + 1), kv, rope, mask, skip, use_reentrant=False)
        return h


def _record_walk(ledger: Ledger, rows: int, layers, skip: SkipSet | None, context: int, eager: bool = False,
                 ran: tuple[int, int] | None = None, weights: str | None = None, merge: bool = True) -> None:
    """A layer walk in ``ledger``: its rows, the sublayers run and the cached positions they attend
    to; ``ran``: a static pass's bucket rows and the cache slots its attention spans
    (:attr:`selfspec.models.capture.StepRunner.last`), what it costs. A sliding layer is recorded at
    the whole context too: the profile's attention cost per context is measured over every layer,
    windows included, so it already averages the windowed layers' cheaper attention in."""
    attention = mlp = len(layers)
    if not attention:
        return
    if skip is not None:
        attention -= sum(i in skip.attn for i in layers)
        mlp -= sum(i in skip.mlp for i in layers)
    padded, span = ran if ran is not None else (0, 0)
    ledger.layers(int(rows), attention, mlp, int(context), eager, padded, span, weights or "", merge)

"""The transformers boundary: one adapter per model family the layered runtime drives.

Everything selfspec needs to know of a family's modules sits here and nowhere else: where the
embedding, decoder layers, final norm, rotary embedding and LM head live, which sublayer does
what, the family's own rotary and attention functions (imported from its modeling module by
name), and what each layer's attention needs besides q, k, v and a mask. The runtime
(:mod:`selfspec.models.layered`) reuses the library's modules, weights and functions through an
adapter; no family's numerics are written again (docs/design/contracts.md §2.1).

An adapter is small: :class:`Llama` is the layout every supported family shares (a pre-norm
attention sublayer and a pre-norm MLP sublayer, each added to the residual stream; q/k/v and
gate/up projections reading one input); :class:`Mistral` and :class:`Qwen2` differ only in the
modeling module their functions come from and in what bounds a context, :class:`Qwen3` in a norm
over each head's q and k (:meth:`Llama.qk_norm`). :class:`Gemma3` uses every hook the runtime
has: q/k norms, norms on the sublayers' outputs, ``(1 + w)`` norms, a rotary kind and a sliding
window per layer. A family with another layer structure (MoE, Gemma 2, Phi-3, ...) is refused
before any weights load (:func:`check_model_type`): supporting it means one adapter class here.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable

import torch

from selfspec.config.registry import Registry

#: what an adapter needs, said when a family is refused
ADAPTER_NEEDS = ("where the embedding, decoder layers, final norm, rotary embedding and LM head live; each "
                 "layer's norms, q/k/v, output, gate/up and down projections; the family's rotary and attention "
                 "functions; where it has them, q/k norms, norms on the sublayers' outputs, rotary kinds and "
                 "sliding windows per layer (src/selfspec/models/families.py)")


class UnsupportedModelError(ValueError):
    """The model family has a layer structure the runtime has no adapter for."""


class ModelLoadError(RuntimeError):
    """A model config could not be turned into a model; the message names the config (raised by
    :mod:`selfspec.models.loading` and :mod:`selfspec.models.gguf_file`)."""


class Llama:
    """The Llama layout (model_type ``llama``): ``hf.model.{embed_tokens, layers, norm,
    rotary_emb}`` and ``hf.lm_head``; each decoder layer is ``input_layernorm → self_attn
    (q/k/v_proj, o_proj) → residual → post_attention_layernorm → mlp (gate/up_proj, act_fn,
    down_proj) → residual``."""

    #: the family's modeling module (:attr:`modeling`): its ``apply_rotary_pos_emb`` and
    #: ``eager_attention_forward``; imported when an adapter is built, so that what only names
    #: methods or reads runs (the report, ``project``, config checks) does not import transformers' models
    modeling_module: str = "transformers.models.llama.modeling_llama"

    @property
    def modeling(self) -> ModuleType:
        return importlib.import_module(self.modeling_module)

    def __init__(self, hf: torch.nn.Module, attn_implementation: str) -> None:
        inner = hf.model
        self.config = hf.config
        self.embed_tokens, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.rotary_emb, self.lm_head = inner.rotary_emb, hf.lm_head
        self.apply_rotary: Callable = self.modeling.apply_rotary_pos_emb
        #: the attention function of ``attn_implementation``: SDPA through transformers' wrapper
        #: (the CPU kernels take over where they apply, :func:`selfspec.models.kernels.attention`),
        #: or the family's eager attention
        if attn_implementation == "sdpa":
            from transformers.integrations.sdpa_attention import sdpa_attention_forward as attend
        else:
            attend = self.modeling.eager_attention_forward
        self.attend: Callable = attend
        self.additive_mask = attn_implementation != "sdpa"  # eager adds the mask to the scores

    # --- per layer ----------------------------------------------------------------------------
    def attention_module(self, i: int) -> torch.nn.Module:
        return self.layers[i].self_attn

    def attention_norm(self, i: int) -> torch.nn.Module:
        return self.layers[i].input_layernorm

    def mlp_norm(self, i: int) -> torch.nn.Module:
        return self.layers[i].post_attention_layernorm

    def qkv(self, i: int) -> list[torch.nn.Linear]:
        a = self.layers[i].self_attn
        return [a.q_proj, a.k_proj, a.v_proj]

    def out_proj(self, i: int) -> torch.nn.Linear:
        return self.layers[i].self_attn.o_proj

    def gate_up(self, i: int) -> list[torch.nn.Linear]:
        mlp = self.layers[i].mlp
        return [mlp.gate_proj, mlp.up_proj]

    def down_proj(self, i: int) -> torch.nn.Linear:
        return self.layers[i].mlp.down_proj

    def act(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.layers[i].mlp.act_fn

    def attention_kwargs(self, i: int) -> dict:
        """What the family passes its attention function besides q, k, v, the mask and scaling."""
        return {}

    #: whether :meth:`qk_norm` does anything (the runtime skips the call where it does not)
    normalises_qk: bool = False

    def qk_norm(self, i: int, q: torch.Tensor, k: torch.Tensor, norm: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        """The family's norms over each head of q and k (``[..., heads, head_dim]``, before the
        rotary embedding); ``norm(module, x)`` is the runtime's norm. The Llama layout has none."""
        return q, k

    def attention_out_norm(self, i: int) -> torch.nn.Module | None:
        """A norm on the attention sublayer's output before the residual sum (None: none)."""
        return None

    def mlp_out_norm(self, i: int) -> torch.nn.Module | None:
        """A norm on the MLP sublayer's output before the residual sum (None: none)."""
        return None

    #: whether the family's RMSNorms scale by ``1 + w`` in float32 (Gemma's), not by ``w``
    unit_offset_norms: bool = False
    #: the rotary kinds the layers use (:meth:`rope_kind`); None: the one rotary embedding
    rope_kinds: tuple = (None,)

    def rope_kind(self, i: int):
        """Which of :attr:`rope_kinds` layer ``i`` rotates q and k with."""
        return None

    def rotary(self, ref: torch.Tensor, positions: torch.Tensor, kind) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of rotary ``kind`` at ``positions`` (``[1, n]``), in ``ref``'s dtype."""
        return self.rotary_emb(ref, positions)

    def window(self, i: int) -> int | None:
        """Layer ``i``'s sliding attention window, which the runtime's masks enforce (None: none)."""
        return None

    # --- the model ----------------------------------------------------------------------------
    def max_context(self) -> int:
        """Positions a cache may hold before the family's attention would differ from ours."""
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))


class Mistral(Llama):
    """Mistral: the Llama layout with a sliding attention window on every layer (``sliding_window``),
    which the runtime's masks enforce (:meth:`Llama.window`), so contexts may be longer."""

    modeling_module = "transformers.models.mistral.modeling_mistral"

    def window(self, i: int) -> int | None:
        return getattr(self.config, "sliding_window", None) or None


class Qwen2(Llama):
    """Qwen2: the Llama layout with biases on q/k/v (carried by the fused projection) and a
    sliding window on the layers the config makes sliding (``use_sliding_window``, from
    ``max_window_layers`` on), which the runtime's masks enforce."""

    modeling_module = "transformers.models.qwen2.modeling_qwen2"

    def window(self, i: int) -> int | None:
        return getattr(self.layers[i].self_attn, "sliding_window", None) or None


class Qwen3(Qwen2):
    """Qwen3 (dense): Qwen2's layout without q/k/v biases, with an RMSNorm over each head's q and
    k before the rotary embedding (``self_attn.q_norm``, ``k_norm``; the library's modules run
    them, the CPU kernels do not fuse them)."""

    modeling_module = "transformers.models.qwen3.modeling_qwen3"
    normalises_qk = True

    def qk_norm(self, i: int, q: torch.Tensor, k: torch.Tensor, norm: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.layers[i].self_attn
        return attn.q_norm(q), attn.k_norm(k)


class Gemma3(Llama):
    """Gemma 3, text (model_type ``gemma3_text``; transformers' ``modeling_gemma3``), after
    ``Gemma3DecoderLayer.forward``: ``input_layernorm → self_attn → post_attention_layernorm →
    residual → pre_feedforward_layernorm → mlp (GeGLU) → post_feedforward_layernorm → residual``.

    Its RMSNorms scale by ``1 + w`` in float32 (the fused CPU operator follows that form); q and k
    have per-head norms; the embedding module scales by ``sqrt(hidden)`` itself; attention scales
    by ``query_pre_attn_scalar ** -0.5`` (the module's ``scaling``). Layers are ``sliding_attention``
    or ``full_attention`` (``config.layer_types``), each kind with its own rotary base (the rotary
    module takes the kind), and a sliding layer attends to the keys less than ``sliding_window``
    positions behind (the runtime's masks, so contexts may be longer). Logit soft-capping and
    bidirectional attention, which Gemma 3 checkpoints leave off, are refused by name."""

    modeling_module = "transformers.models.gemma3.modeling_gemma3"
    normalises_qk = True
    unit_offset_norms = True

    def __init__(self, hf: torch.nn.Module, attn_implementation: str) -> None:
        super().__init__(hf, attn_implementation)
        c = self.config
        for key in ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"):
            if getattr(c, key, None):
                raise UnsupportedModelError(f"Gemma 3 with {key}={getattr(c, key)!r}: selfspec's Gemma3 adapter "
                                            f"supports Gemma 3 checkpoints as released, with {key} unset")
        self.rope_kinds = tuple(dict.fromkeys(c.layer_types))

    def mlp_norm(self, i: int) -> torch.nn.Module:
        return self.layers[i].pre_feedforward_layernorm

    def attention_out_norm(self, i: int) -> torch.nn.Module:
        return self.layers[i].post_attention_layernorm

    def mlp_out_norm(self, i: int) -> torch.nn.Module:
        return self.layers[i].post_feedforward_layernorm

    def qk_norm(self, i: int, q: torch.Tensor, k: torch.Tensor, norm: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.layers[i].self_attn
        return norm(attn.q_norm, q), norm(attn.k_norm, k)

    def rope_kind(self, i: int) -> str:
        return self.config.layer_types[i]

    def rotary(self, ref: torch.Tensor, positions: torch.Tensor, kind) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(ref, positions, kind)

    def window(self, i: int) -> int | None:
        return self.layers[i].self_attn.sliding_window


#: every adapter, by the model type it drives (a checkpoint's ``config.model_type``; the one registry
#: style, :mod:`selfspec.config.registry`)
FAMILIES = Registry("model family", {
    "llama": "selfspec.models.families:Llama",
    "mistral": "selfspec.models.families:Mistral",
    "qwen2": "selfspec.models.families:Qwen2",
    "qwen3": "selfspec.models.families:Qwen3",
    "gemma3_text": "selfspec.models.families:Gemma3",
})
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
#: a GGUF file's ``general.architecture`` where it is not the model type transformers builds from it
GGUF_ARCHITECTURES = {"gemma3": "gemma3_text"}
#: what a refusal adds for a model type close to a supported one
HINTS = {"gemma3": "gemma3 is Gemma 3 with its vision tower (Gemma3ForConditionalGeneration); selfspec drives the "
                   "text model, gemma3_text: use a text-only checkpoint (gemma-3-270m, gemma-3-1b) or a GGUF file"}


def check_model_type(model_type: str | None, name: str, where: str = "") -> None:
    """Refuse a model family without an adapter (read from a config.json or a GGUF file's
    ``general.architecture`` before any weights load), naming the supported ones and what an
    adapter needs."""
    if model_type not in FAMILIES:
        hint = f" ({HINTS[model_type]})" if model_type in HINTS else ""
        raise UnsupportedModelError(
            f"model {name!r}{f' ({where})' if where else ''} has model_type={model_type!r}{hint}; selfspec's "
            f"layered runtime supports {', '.join(SUPPORTED_MODEL_TYPES)}. Choose a model of one of these "
            f"families, or add an adapter for it: {ADAPTER_NEEDS}.")


def adapter(hf: torch.nn.Module, name: str, attn_implementation: str) -> Llama:
    """The adapter of ``hf``'s family (refused by :func:`check_model_type` when there is none)."""
    model_type = getattr(hf.config, "model_type", None)
    check_model_type(model_type, name)
    return FAMILIES[model_type](hf, attn_implementation)

"""The loaded model as a GGUF file that llama.cpp runs (the runtime benchmark's peer).

:func:`cached_gguf` writes the file once per model, from the weights the loaded model holds (not
from a file on disk), so llama.cpp, selfspec's vanilla and transformers ``generate`` compute with
the same numbers. It is kept in the selfspec cache, ``<cache>/gguf/``, named by the model's
weights digest (:func:`~selfspec.models.loading.weights_digest`), its run dtype and its
fingerprint (architecture and tokenizer, both written into the file), and written atomically. A
float32 run's file holds float32 weights; a bfloat16 run's holds its weight matrices in BF16 (the
same bytes a step reads; the norms' vectors in float32, as llama.cpp's converter writes them).

What the file holds (llama.cpp's ``llama`` architecture):

* hyperparameters: context, embedding and feed-forward lengths, block count, head counts, head
  size, rotary base, RMSNorm epsilon, vocabulary size;
* every weight in float32 under llama.cpp's tensor names (a tied LM head is left out: llama.cpp
  then reads the embedding); the query and key projections have the rows of each head reordered
  (:func:`rope_pairs_adjacent`), since llama.cpp's ``llama`` rotary embedding rotates adjacent
  pairs of a head's dimensions where transformers' rotates dimension i with i + head_size / 2;
* the tokenizer: a byte-level BPE vocabulary (``gpt2`` in GGUF terms) with its token types,
  merges, special token ids and chat template; the pre-tokenizer name is read off the tokenizer's
  own pre-tokenizer (:func:`pre_tokenizer_name`). A model without a tokenizer gets none (llama.cpp's
  ``none`` vocabulary of the model's size). The benchmark feeds token ids, so the tokenizer only
  matters to text given to llama.cpp.

Only what :class:`~selfspec.models.layered.LayeredModel` drives as a plain Llama is written:
:func:`export_problem` names anything else (another family, a scaled rotary embedding, another
activation), and the benchmark then skips the peer with that reason.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from selfspec.store import assets

log = logging.getLogger(__name__)

#: the version of what :func:`write_gguf` writes; part of the cache name, so a change rewrites
FORMAT = 1

#: transformers' per-layer parameter name -> (llama.cpp tensor, rows reordered for its rotary embedding)
LAYER_TENSORS = {
    "input_layernorm": ("ATTN_NORM", None),
    "self_attn.q_proj": ("ATTN_Q", "num_attention_heads"),
    "self_attn.k_proj": ("ATTN_K", "num_key_value_heads"),
    "self_attn.v_proj": ("ATTN_V", None),
    "self_attn.o_proj": ("ATTN_OUT", None),
    "post_attention_layernorm": ("FFN_NORM", None),
    "mlp.gate_proj": ("FFN_GATE", None),
    "mlp.up_proj": ("FFN_UP", None),
    "mlp.down_proj": ("FFN_DOWN", None),
}
#: transformers' other parameter names -> llama.cpp tensor
MODEL_TENSORS = {"model.embed_tokens": "TOKEN_EMBD", "model.norm": "OUTPUT_NORM", "lm_head": "OUTPUT"}


class ExportUnsupported(ValueError):
    """The model is not one :func:`write_gguf` can write as llama.cpp's ``llama`` architecture."""


def export_problem(hf_model: torch.nn.Module) -> str | None:
    """Why ``hf_model`` cannot be written as a llama.cpp ``llama`` GGUF file (None: it can)."""
    config = hf_model.config
    if config.model_type != "llama":
        return f"the GGUF writer covers Llama models, this one is {config.model_type!r}"
    rope = _rope(config)
    if rope.get("rope_type", "default") != "default":
        return f"rotary scaling {rope.get('rope_type')!r} is not written"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} (llama.cpp's llama runs SiLU)"
    return None


def _rope(config) -> dict[str, Any]:
    """The rotary parameters of a transformers config (``rope_parameters``, or the legacy keys)."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if "rope_theta" not in rope and getattr(config, "rope_theta", None) is not None:
        rope["rope_theta"] = config.rope_theta
    return rope


def _head_dim(config) -> int:
    """The size of one attention head."""
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


# --- the cached file --------------------------------------------------------------------------
def gguf_path(model, weights: str | None = None) -> Path:
    """Where a GGUF file of ``model`` (a loaded :class:`~selfspec.models.layered.LayeredModel`) is cached:
    the one written from its weights (``weights`` None: :func:`file_dtype`), or one in llama.cpp's format
    ``weights`` made from it or from the file the model was read from (:mod:`selfspec.decoding.llamacpp`)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", model.name)
    dtype = str(model.dtype).replace("torch.", "")
    key = f"{name}-{model.weights_digest}-{dtype}-{model.fingerprint[:8]}-v{FORMAT}"
    return assets.cache_dir() / "gguf" / f"{key}.{weights or file_dtype(model.dtype)}.gguf"


def file_dtype(dtype: torch.dtype) -> str:
    """The weights' type in the GGUF file of a model run in ``dtype``: ``bf16`` for bfloat16 (llama.cpp
    reads the same bytes selfspec does), else ``f32``."""
    return "bf16" if dtype == torch.bfloat16 else "f32"


def cached_gguf(model, tokenizer) -> Path:
    """The GGUF file of ``model`` (a loaded :class:`~selfspec.models.layered.LayeredModel`) and its
    ``tokenizer``, written on first use (:func:`write_gguf`; a few seconds for SmolLM2) into a temporary
    name beside it and renamed into place."""
    if model.weights_digest is None:
        raise ExportUnsupported("the model has no weights digest to name its GGUF file by")
    path = gguf_path(model)
    if path.is_file():
        return path
    problem = export_problem(model.hf)
    if problem:
        raise ExportUnsupported(problem)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        log.info("writing %s (%s, from the loaded weights)", path, file_dtype(model.dtype))
        write_gguf(model.hf, tokenizer, tmp, model.name, file_dtype(model.dtype))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# --- writing ----------------------------------------------------------------------------------
def write_gguf(hf_model: torch.nn.Module, tokenizer, path: Path, name: str = "model", weights: str = "f32") -> None:
    """Write ``hf_model`` (a transformers Llama) and its ``tokenizer`` (or None) to ``path`` as a GGUF
    file of llama.cpp's ``llama`` architecture (see the module docstring), its weight matrices in
    ``weights``: ``f32``, or ``bf16`` (bfloat16 rounding of what the model holds)."""
    import gguf

    problem = export_problem(hf_model)
    if problem:
        raise ExportUnsupported(problem)
    if weights not in ("f32", "bf16"):
        raise ValueError(f"weights must be f32 or bf16, got {weights!r}")
    config = hf_model.config
    vocab_size = int(hf_model.get_input_embeddings().weight.shape[0])
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    try:
        writer.add_name(name)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if weights == "bf16" else gguf.LlamaFileType.ALL_F32)
        _add_hyperparameters(writer, config, vocab_size)
        _add_vocabulary(writer, tokenizer, vocab_size)
        for tensor_name, data in _tensors(hf_model):
            if weights == "bf16" and data.dim() == 2:
                bits = data.to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
                writer.add_tensor(tensor_name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
            else:
                writer.add_tensor(tensor_name, _float32(data))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def _add_hyperparameters(writer, config, vocab_size: int) -> None:
    """The ``llama.*`` keys llama.cpp builds the model from."""
    heads, head_dim = int(config.num_attention_heads), _head_dim(config)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or heads))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(_rope(config).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(vocab_size)


def _tensors(hf_model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(llama.cpp name, tensor) of every parameter; a tied head is one parameter, the embedding, so
    it is written once. A parameter with no llama.cpp name is refused."""
    import gguf

    config = hf_model.config
    layer = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
    for name, param in hf_model.named_parameters():
        match = layer.fullmatch(name)
        if match:
            block, module, kind = int(match.group(1)), match.group(2), match.group(3)
            if module not in LAYER_TENSORS:
                raise ExportUnsupported(f"parameter {name} has no llama.cpp tensor")
            tensor, heads = LAYER_TENSORS[module]
            data = param.detach()
            if heads is not None:
                data = rope_pairs_adjacent(data, int(getattr(config, heads, None) or config.num_attention_heads))
            yield f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[tensor]].format(bid=block)}.{kind}", data
            continue
        module, _, kind = name.rpartition(".")
        if module not in MODEL_TENSORS:
            raise ExportUnsupported(f"parameter {name} has no llama.cpp tensor")
        yield f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[MODEL_TENSORS[module]]]}.{kind}", param.detach()


def _float32(tensor: torch.Tensor) -> np.ndarray:
    """A CPU float32 numpy array of ``tensor`` (a view when it already is one)."""
    return tensor.to("cpu", torch.float32).contiguous().numpy()


def rope_pairs_adjacent(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The rows of a query or key projection (weight or bias) reordered for llama.cpp's rotary
    embedding: within each head of ``d`` rows, transformers rotates row ``j`` with row ``j + d/2``,
    llama.cpp rotates rows ``2j`` and ``2j + 1``; so rows ``j`` and ``j + d/2`` become ``2j`` and
    ``2j + 1``. Attention scores are unchanged: both sides of every dot product move alike."""
    d = weight.shape[0] // heads
    starts = torch.arange(heads).unsqueeze(1) * d
    j = torch.arange(d // 2)
    order = torch.stack((starts + j, starts + j + d // 2), dim=-1).reshape(-1)
    return weight.index_select(0, order.to(weight.device))


# --- the tokenizer ----------------------------------------------------------------------------
def _add_vocabulary(writer, tokenizer, vocab_size: int) -> None:
    """The ``tokenizer.ggml.*`` keys: a byte-level BPE vocabulary, or llama.cpp's ``none`` of
    ``vocab_size`` tokens when there is no tokenizer."""
    if tokenizer is None:
        writer.add_tokenizer_model("none")
        return
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if spec["model"]["type"] != "BPE":
        raise ExportUnsupported(f"the tokenizer is {spec['model']['type']}, the GGUF writer covers byte-level BPE")
    tokens, types = vocabulary(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(spec.get("pre_tokenizer")))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("unk_token_id", writer.add_unk_token_id), ("pad_token_id", writer.add_pad_token_id)):
        if getattr(tokenizer, key, None) is not None:
            add(int(getattr(tokenizer, key)))
    writer.add_add_bos_token(bool(getattr(tokenizer, "add_bos_token", False)))
    if isinstance(getattr(tokenizer, "chat_template", None), str):
        writer.add_chat_template(tokenizer.chat_template)


def vocabulary(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """Each id's token text and GGUF token type: added special tokens are control tokens, other
    added tokens user-defined, the rest normal; ids the tokenizer does not use (a vocabulary
    padded to a round size) get a placeholder text and the unused type."""
    from gguf import TokenType

    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"<selfspec-unused-{i}>")
            types.append(TokenType.UNUSED)
            continue
        tokens.append(by_id[i])
        if i in added:
            types.append(TokenType.CONTROL if added[i].special else TokenType.USER_DEFINED)
        else:
            types.append(TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def pre_tokenizer_name(spec: dict | None) -> str:
    """llama.cpp's name for a tokenizer.json pre-tokenizer: a byte-level split with GPT-2's
    pattern is ``gpt-2``; the same after splitting digits one by one is ``smollm`` (SmolLM's hub
    tokenizer); anything else ``default`` (llama.cpp's own split: token ids are unaffected, text
    llama.cpp tokenizes may split differently)."""
    steps = (spec or {}).get("pretokenizers", [spec]) if (spec or {}).get("type") == "Sequence" else [spec]
    kinds = [(s or {}).get("type") for s in steps]
    byte_level = bool(steps) and kinds[-1] == "ByteLevel" and steps[-1].get("use_regex", True)
    if byte_level and kinds == ["ByteLevel"]:
        return "gpt-2"
    if byte_level and kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    return "default"

"""Model loading: hub id, local directory, GGUF file inside a package-shipped asset, or a seeded
random model for tests — each returned as a :class:`LoadedModel` around the layered adapter.

Config keys (``conf/model/*.yaml``):

``name``            short name used in results and artefacts
``name_or_path``    hub id or local directory (users with the hub)
``gguf_asset``      offline asset holding a GGUF file (``selfspec.assets``), with ``gguf_file``
``random``          LlamaConfig fields of a seeded random model (``tiny-random``), with ``seed``
``tokenizer``       where the tokenizer comes from when it differs (another model config name)
``dtype``           ``auto`` (bf16 on CUDA, fp32 on CPU), ``float32``, ``bfloat16``, ``float16``
``device``          ``auto``, ``cpu``, ``cuda``, ``cuda:N``
``chat``            whether prompts go through the tokenizer's chat template
``linear_kernel``   ``auto``, ``skinny``, ``torch``: the CPU linear kernel (:mod:`selfspec.models.kernels`)

A GGUF file is dequantised by transformers on first load (~20 s for SmolLM2) and the result is
kept as a plain safetensors directory in the cache, so later loads take about a second.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from selfspec.models.layered import LayeredModel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class ModelLoadError(RuntimeError):
    """A model config could not be turned into a model; the message names the config."""


@dataclass
class LoadedModel:
    """A model ready for decoding: the layered adapter, its tokenizer and identity."""

    model: LayeredModel
    tokenizer: Any
    name: str
    fingerprint: str
    chat: bool
    cfg: dict

    @property
    def eos_token_ids(self) -> list[int]:
        ids: set[int] = set()
        gen = getattr(self.model.hf, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        for e in eos if isinstance(eos, (list, tuple)) else [eos]:
            if e is not None:
                ids.add(int(e))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return sorted(ids)


def _get(cfg, key, default=None):
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def cache_dir() -> Path:
    return Path(os.environ.get("SELFSPEC_CACHE", Path.home() / ".cache" / "selfspec"))


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"model.device={device} but CUDA is not available; use model.device=cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ModelLoadError(f"model.dtype={dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def fingerprint(hf_config, tokenizer) -> str:
    """sha256 (16 hex) of the architecture config and the tokenizer vocabulary.

    Artefacts (heads, prompts, skip sets) record it; loading them for another model fails.
    """
    conf = hf_config.to_dict()
    for k in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "quantization_config",
              "use_cache", "_attn_implementation_autoset", "architectures"):
        conf.pop(k, None)
    h = hashlib.sha256(json.dumps(conf, sort_keys=True, default=str).encode())
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        h.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
    return h.hexdigest()[:16]


def load_model(cfg) -> LoadedModel:
    """Load the model a ``model`` config describes (see module docstring)."""
    name = str(_get(cfg, "name", "model"))
    device = resolve_device(str(_get(cfg, "device", "auto")))
    dtype = resolve_dtype(str(_get(cfg, "dtype", "auto")), device)
    attn = str(_get(cfg, "attn_implementation", "sdpa"))
    try:
        if _get(cfg, "random") is not None:
            hf, tok = _load_random(cfg, attn)
        elif _get(cfg, "name_or_path"):
            hf, tok = _load_pretrained(str(_get(cfg, "name_or_path")), attn, name, cfg)
        elif _get(cfg, "gguf_asset"):
            hf, tok = _load_gguf_asset(cfg, attn)
        else:
            raise ModelLoadError(
                f"model config {name!r} names no source: set model.name_or_path (hub id or local "
                "directory), model.gguf_asset, or model.random"
            )
    except ModelLoadError:
        raise
    except (OSError, ValueError) as err:
        tried = _get(cfg, "name_or_path") or _get(cfg, "gguf_asset") or "random"
        raise ModelLoadError(f"could not load model config {name!r} from {tried!r}: {err}") from err
    hf.to(device=device, dtype=dtype)
    plain = {k: v for k, v in (cfg.items() if hasattr(cfg, "items") else vars(cfg).items())}
    layered = LayeredModel(hf, name=name, linear_kernel=str(_get(cfg, "linear_kernel", "auto")))
    layered.fingerprint = fingerprint(hf.config, tok)
    return LoadedModel(layered, tok, name, layered.fingerprint, bool(_get(cfg, "chat", False)), plain)


def _load_pretrained(path: str, attn: str, name: str, cfg):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(path).expanduser()
    where = "local directory" if local.exists() else "hub id"
    if where == "local directory" and not (local / "config.json").exists():
        raise ModelLoadError(f"model config {name!r}: local directory {local} has no config.json")
    try:
        tok = AutoTokenizer.from_pretrained(path)
        hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn, dtype="auto")
    except OSError as err:
        raise ModelLoadError(
            f"model config {name!r}: could not load {path!r} as a {where} ({err.__class__.__name__}: "
            f"{str(err).splitlines()[0]}). Check model.name_or_path, your network / HF_TOKEN, or "
            "use the embedded default model=smollm2-135m."
        ) from err
    return hf, tok


def _load_gguf_asset(cfg, attn: str):
    """GGUF inside a package asset, converted once to a safetensors directory in the cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfspec.assets import asset_path

    asset = str(_get(cfg, "gguf_asset"))
    gguf = asset_path(asset)
    converted = cache_dir() / "models" / f"{asset}-{_file_digest(gguf)}"
    if not (converted / "config.json").exists():
        log.info("converting %s to safetensors in %s (once)", gguf.name, converted)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        hf.hf_quantizer = None
        if hasattr(hf.config, "quantization_config"):
            del hf.config.quantization_config
        converted.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=converted.parent, prefix=".tmp-"))
        try:
            hf.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            os.replace(tmp, converted)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(converted)
    hf = AutoModelForCausalLM.from_pretrained(converted, attn_implementation=attn, dtype=torch.float32)
    return hf, tok


def _file_digest(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.name}:{st.st_size}".encode()).hexdigest()[:10]


def _load_random(cfg, attn: str):
    """A seeded random Llama-architecture model with a real tokenizer (for fast tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = dict(_get(cfg, "random"))
    seed = int(spec.pop("seed", 0))
    tok = None
    vocab = spec.pop("vocab_size", None)
    tok_from = _get(cfg, "tokenizer")
    if tok_from:
        tok = _tokenizer_of(str(tok_from))
        vocab = vocab or len(tok)
    if vocab is None:
        raise ModelLoadError("model.random needs vocab_size or model.tokenizer")
    config = LlamaConfig(vocab_size=int(vocab), **spec)
    config._attn_implementation = attn
    if tok is not None:
        config.eos_token_id = tok.eos_token_id
        config.bos_token_id = tok.bos_token_id
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(config)
    hf.generation_config.eos_token_id = config.eos_token_id
    return hf, tok


def _tokenizer_of(model_name: str):
    """The tokenizer of another model config (e.g. tiny-random borrows SmolLM2's)."""
    from transformers import AutoTokenizer

    from selfspec.config import model_config

    other = model_config(model_name)
    if _get(other, "gguf_asset"):
        from selfspec.assets import asset_path

        gguf = asset_path(str(_get(other, "gguf_asset")))
        converted = cache_dir() / "models" / f"{_get(other, 'gguf_asset')}-{_file_digest(gguf)}"
        if not (converted / "tokenizer_config.json").exists():
            _load_gguf_asset(other, "sdpa")
        return AutoTokenizer.from_pretrained(converted)
    return AutoTokenizer.from_pretrained(str(_get(other, "name_or_path")))

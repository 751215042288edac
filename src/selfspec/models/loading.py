"""Model loading: hub id, local directory, local GGUF file, GGUF file inside a package-shipped
asset, or a seeded random model for tests — each returned as a :class:`LoadedModel` around the
layered adapter.

Config keys (``conf/model/*.yaml``; any other key is refused):

``name``                short name used in results and artefacts
``name_or_path``        hub id or local directory (users with the hub); a path ending in ``.gguf``
                        is read as ``gguf_path``
``gguf_file``           with ``name_or_path``: the GGUF file inside that hub repo or directory
``gguf_path``           a local GGUF file (``model.gguf_path=/path/to/file.gguf``)
``gguf_asset``          offline asset holding a GGUF file (``selfspec.store.assets``): the embedded default,
                        used when neither ``name_or_path`` nor ``gguf_path`` is given
``random``              a seeded random model (``tiny-random``): ``model_type`` (its family), ``seed``, the family
                        config's fields and optionally ``norm_noise`` (uniform noise of that half-width added to
                        every norm weight, whose library init — ones, or Gemma's zeros — would hide a runtime
                        that skipped a norm)
``tokenizer``           ``random`` only: the model config whose tokenizer it borrows
``dtype``               ``auto`` (bf16 on CUDA, fp32 on CPU), ``float32``, ``bfloat16``, ``float16``
``device``              ``auto``, ``cpu``, ``cuda``, ``cuda:N``
``attn_implementation`` ``sdpa`` or ``eager`` (the layered runtime passes explicit 4-D masks)
``chat``                whether prompts go through the tokenizer's chat template
``linear_kernel``       ``auto``, ``skinny``, ``torch``: the CPU linear kernel (:mod:`selfspec.models.kernels`)
``capture``             ``auto``, ``graphs``, ``static``, ``off``: static-shape decoding steps, captured as
                        CUDA graphs on a GPU (:mod:`selfspec.models.capture`)

:func:`check_model_config` checks every key without loading anything (the entry points call it
first). A GGUF file's architecture (its ``general.architecture`` metadata) and a directory's or hub
repo's ``config.json`` are checked against the families :class:`LayeredModel` drives before any
weights are read; so are a GGUF file's shape keys (present, and consistent with each other and with
its tensors), and whatever transformers still refuses in it is one :class:`ModelLoadError` naming
the file (reading, checking and dequantising a GGUF file: :mod:`selfspec.models.gguf_file`). A GGUF
file is dequantised by transformers on first load (~20 s for SmolLM2) and the
result is kept as a plain safetensors directory in the cache, so later loads take about a second.
The cache entry is named by the sha256 of the file's bytes: an offline asset's pinned hash (the
file was verified against it), another file's hash, computed once and remembered by its path,
size, times and inode (:func:`~selfspec.store.files.content_sha256`). A file with other bytes is converted again; the
same bytes under another name share the conversion.

A loaded model carries two identities that artefacts record and check: :func:`fingerprint`
(architecture config + tokenizer) and :func:`weights_digest` (the weights themselves).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from selfspec.config import checks
from selfspec.models import gguf_file
from selfspec.models.families import SUPPORTED_MODEL_TYPES, ModelLoadError, UnsupportedModelError, check_model_type
from selfspec.models.layered import LayeredModel
from selfspec.store import assets
from selfspec.store.files import new_temporary_folder, not_plain, plain_permissions

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
#: the keys every model config sets (their values are written in conf/model/*.yaml, nowhere else)
RUNTIME_KEYS = ("name", "dtype", "device", "attn_implementation", "linear_kernel", "capture", "chat")
#: the keys naming where the weights come from: each may be absent or null, one is given (model_source)
SOURCE_KEYS = ("name_or_path", "gguf_file", "gguf_path", "gguf_asset", "random", "tokenizer")
MODEL_KEYS = RUNTIME_KEYS + SOURCE_KEYS
#: attention implementations that take the explicit 4-D masks the layered runtime builds (trees, caches)
ATTENTION = ("sdpa", "eager")
#: rotary keys LlamaConfig still accepts (folded into ``rope_parameters``)
LEGACY_ROPE_KEYS = ("rope_theta", "rope_scaling")
#: values sampled per tensor by :func:`weights_digest`
DIGEST_SAMPLES = 64


@dataclass
class LoadedModel:
    """A model ready for decoding: the layered adapter, its tokenizer and identity."""

    model: LayeredModel
    tokenizer: Any
    name: str
    fingerprint: str
    chat: bool
    cfg: dict
    weights_digest: str | None = None

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


class Source(NamedTuple):
    """Where a model config's weights come from: ``kind`` is ``random``, ``pretrained`` (hub id or
    directory), ``gguf`` (a local GGUF file), ``hub_gguf`` (``file`` inside hub repo ``where``) or
    ``asset`` (an offline asset); ``key`` is the config key that named it."""

    kind: str
    where: str
    key: str
    file: str | None = None


def _get(cfg, key):
    """A source key's value (None when absent: see SOURCE_KEYS) or a runtime key's (required)."""
    return cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)


# --- checking a config without loading -----------------------------------------------------
def check_model_config(cfg) -> Source:
    """Check every key of a ``model`` config (see the module docstring) without loading anything;
    return the :class:`Source` it names. Raises :class:`~selfspec.config.checks.ConfigError`."""
    plain = dict(cfg.items()) if hasattr(cfg, "items") else dict(vars(cfg))
    checks.known_keys("model", plain, MODEL_KEYS, "a model config (conf/model/)")
    checks.required_keys("model", plain, RUNTIME_KEYS, "a model config of conf/model/ (e.g. smollm2-135m.yaml)")
    checks.text("model.name", _get(cfg, "name"))
    checks.choice("model.dtype", _get(cfg, "dtype"), ("auto", *DTYPES))
    device = _get(cfg, "device")
    try:
        resolve_device(checks.text("model.device", device))
    except RuntimeError as err:
        if isinstance(err, ModelLoadError):
            raise
        raise checks.refuse("model.device", device, "must be auto, cpu, cuda or cuda:<index>") from None
    checks.choice("model.attn_implementation", _get(cfg, "attn_implementation"), ATTENTION,
                  why="the layered runtime passes explicit 4-D attention masks")
    checks.flag("model.chat", _get(cfg, "chat"))
    from selfspec.models.kernels import KERNELS

    checks.choice("model.linear_kernel", _get(cfg, "linear_kernel"), KERNELS,
                  why="the CPU linear kernel of the layered runtime")
    from selfspec.models import capture

    mode = checks.choice("model.capture", _get(cfg, "capture"), capture.MODES,
                         why="static-shape decoding steps, captured as CUDA graphs on a GPU")
    if mode == "graphs" and resolve_device(str(device)).type != "cuda":
        raise checks.refuse("model.capture", mode, "needs a CUDA device (model.device); use static to run the "
                            "same static-shape pass eagerly on a CPU, or auto")
    return model_source(cfg)


def model_source(cfg) -> Source:
    """The one source a model config names, checked (files must exist, assets be fetched).

    ``random``, ``gguf_path`` and ``name_or_path`` exclude each other; ``gguf_asset`` (the embedded
    default) is used only when neither of the last two is given.
    """
    given = [k for k in ("random", "gguf_path", "name_or_path") if _get(cfg, k) is not None]
    if len(given) > 1:
        raise checks.ConfigError(f"model.{given[0]} and model.{given[1]} both name where the model comes "
                                 f"from; set one of them (the other to null)")
    if _get(cfg, "tokenizer") is not None and given != ["random"]:
        raise checks.refuse("model.tokenizer", _get(cfg, "tokenizer"), "set only with model.random (a "
                            "pretrained model brings its own tokenizer)")
    if _get(cfg, "gguf_file") is not None and given != ["name_or_path"]:
        raise checks.refuse("model.gguf_file", _get(cfg, "gguf_file"), "names a GGUF file inside "
                            "model.name_or_path (a hub repo or directory); for a local file set "
                            "model.gguf_path=/path/to/file.gguf")
    if given == ["random"]:
        if _get(cfg, "gguf_asset") is not None:
            raise checks.refuse("model.gguf_asset", _get(cfg, "gguf_asset"), "model.random names a random "
                                "model; set one of them (the other to null)")
        _check_random(cfg)
        return Source("random", "random", "model.random")
    if given == ["gguf_path"]:
        return _gguf_file_source(_get(cfg, "gguf_path"), "model.gguf_path")
    if given == ["name_or_path"]:
        return _named_source(checks.text("model.name_or_path", _get(cfg, "name_or_path")), _get(cfg, "gguf_file"))
    asset = _get(cfg, "gguf_asset")
    if asset is not None:
        from selfspec.store.assets import ASSETS, asset_path

        if asset not in ASSETS:
            hint = "; for a GGUF file use model.gguf_path=<file>" if str(asset).endswith(".gguf") else ""
            raise checks.refuse("model.gguf_asset", asset, f"must be an offline asset: one of "
                                f"{', '.join(ASSETS)}{hint}")
        asset_path(asset)  # not fetched: names the command that fetches it
        return Source("asset", asset, "model.gguf_asset")
    raise checks.ConfigError(
        f"model config {_get(cfg, 'name')!r} names no source: set model.name_or_path (hub id or local "
        "directory), model.gguf_path (a GGUF file), model.gguf_asset, or model.random")


def _named_source(path: str, gguf_file: str | None) -> Source:
    """``name_or_path``: a GGUF file, a directory (with ``gguf_file`` inside it) or a hub id."""
    local = Path(path).expanduser()
    if gguf_file is None:
        if path.endswith(".gguf"):
            return _gguf_file_source(path, "model.name_or_path")
        return Source("pretrained", path, "model.name_or_path")
    checks.text("model.gguf_file", gguf_file)
    if local.is_dir():
        return _gguf_file_source(str(local / gguf_file), "model.gguf_file")
    if local.exists():
        raise checks.refuse("model.name_or_path", path, "with model.gguf_file it must be a hub repo or a "
                            "directory holding that file")
    return Source("hub_gguf", path, "model.name_or_path", gguf_file)


def _gguf_file_source(value: Any, key: str) -> Source:
    """A local GGUF file: it must exist and start with the GGUF magic bytes."""
    path = Path(checks.text(key, value)).expanduser()
    if not path.is_file():  # a directory, a FIFO (issue 68: called "not a directory"), a device, ...
        if not path.exists():
            raise checks.refuse(key, value, "no such file")
        raise checks.refuse(key, value, f"must be a regular GGUF file, and it {not_plain(path.stat())}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise checks.refuse(key, value, "not a GGUF file (it does not start with the GGUF magic bytes)")
    return Source("gguf", str(path), key)


def _random_config_class(model_type: str):
    """transformers' config class of a supported family (``model.random.model_type``)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def _check_random(cfg) -> None:
    """``random``: ``model_type`` (a supported family: llama, mistral, qwen2, qwen3, gemma3_text), fields of
    that family's config class (each a real one: a typo would silently take the default), ``seed``,
    and ``vocab_size`` or a ``tokenizer`` model config to borrow."""
    from selfspec.config import group_options

    spec = _get(cfg, "random")
    if not hasattr(spec, "items"):
        raise checks.refuse("model.random", spec, "must be a mapping of model_type, seed and the family's "
                            "config fields")
    model_type = checks.choice("model.random.model_type", spec.get("model_type"), SUPPORTED_MODEL_TYPES,
                               why="the family of the random model (its transformers config class)")
    config_cls = _random_config_class(model_type)
    fields = {*inspect.signature(config_cls.__init__).parameters, *config_cls().to_dict(), *LEGACY_ROPE_KEYS}
    checks.known_keys("model.random", spec, fields - {"self"} | {"seed", "model_type", "norm_noise"},
                      f"{config_cls.__name__} (and model_type, seed, norm_noise)")
    checks.seed("model.random.seed", spec.get("seed"))
    _check_random_sizes(spec)
    checks.optional(checks.number, "model.random.norm_noise", spec.get("norm_noise"), 0,
                    why="half-width of the uniform noise added to the norm weights")
    tokenizer = _get(cfg, "tokenizer")
    if tokenizer is not None:
        checks.choice("model.tokenizer", tokenizer, group_options("model"), why="a model config of conf/model/")
    elif spec.get("vocab_size") is None:
        raise checks.ConfigError("model.random needs vocab_size or model.tokenizer=<model config name>")


#: a random model's sizes: each a positive integer where given (issue 39: -64 failed raw in transformers)
RANDOM_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")


def _check_random_sizes(spec) -> None:
    """``model.random``'s sizes: positive integers; the heads dividing the width (unless ``head_dim``
    is given) and the key-value heads dividing the heads (grouped-query attention)."""
    sizes = {k: checks.integer(f"model.random.{k}", spec.get(k), 1) for k in RANDOM_SIZES if spec.get(k) is not None}
    heads, width = sizes.get("num_attention_heads"), sizes.get("hidden_size")
    if heads and width and "head_dim" not in sizes and width % heads:
        raise checks.refuse("model.random.num_attention_heads", heads, f"must divide model.random.hidden_size={width}",
                            "each head takes an equal share of the width; or give model.random.head_dim")
    kv = sizes.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise checks.refuse("model.random.num_key_value_heads", kv, f"must divide model.random.num_attention_heads={heads}",
                            "grouped-query attention shares each key-value head among equal groups")


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError(f"model.device={device} but CUDA is not available; use model.device=cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[checks.choice("model.dtype", dtype, ("auto", *DTYPES))]


# --- identity --------------------------------------------------------------------------------
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


def weights_digest(hf_model: torch.nn.Module) -> str:
    """sha256 (16 hex) of the weights: each tensor's name, shape and :data:`DIGEST_SAMPLES` values
    spread evenly over it, rounded to bfloat16.

    Artefacts record it next to :func:`fingerprint`, so heads trained on one checkpoint (or random
    seed, or quantisation) do not load silently into another of the same architecture. It is
    computed once at load, from the weights as loaded, *before* they are cast to ``model.dtype``,
    and the samples are rounded to bfloat16: the same weights give the same digest whether the
    model runs in float32 or bfloat16 (and an fp32 checkpoint digests like its bf16 copy), while
    any other trained values change it. Cost: ~64 values per tensor (an 8B model: ~20k values).
    """
    h = hashlib.sha256()
    for name, tensor in sorted(hf_model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // DIGEST_SAMPLES)][:DIGEST_SAMPLES]
        h.update(f"{name}:{tuple(tensor.shape)}:".encode())
        h.update(sample.to("cpu", torch.float32).to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


# --- loading ---------------------------------------------------------------------------------
def load_model(cfg) -> LoadedModel:
    """Load the model a ``model`` config describes (see module docstring)."""
    source = check_model_config(cfg)
    name = str(_get(cfg, "name"))
    device = resolve_device(str(_get(cfg, "device")))
    dtype = resolve_dtype(str(_get(cfg, "dtype")), device)
    attn = str(_get(cfg, "attn_implementation"))
    try:
        if source.kind == "random":
            hf, tok = _load_random(cfg, attn, device, dtype)
        elif source.kind == "pretrained":
            hf, tok = _load_pretrained(source.where, attn, name)
        else:
            hf, tok = _load_gguf(source, attn, name)
    except (ModelLoadError, checks.ConfigError, UnsupportedModelError):
        raise
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"could not load model config {name!r} from {source.key}={source.where}: {err}") from err
    digest = weights_digest(hf)  # before the cast: the same for every run dtype
    cast(hf, device, dtype)
    plain = {k: v for k, v in (cfg.items() if hasattr(cfg, "items") else vars(cfg).items())}
    from selfspec.models import capture

    mode = capture.resolve(str(_get(cfg, "capture")), device)
    layered = LayeredModel(hf, name=name, linear_kernel=str(_get(cfg, "linear_kernel")),
                           attn_implementation=attn, passes=capture.StepRunner(mode) if mode != "off" else None)
    layered.fingerprint = fingerprint(hf.config, tok)
    layered.weights_digest = digest
    if source.kind in ("gguf", "hub_gguf", "asset"):
        layered.gguf_source = str(local_gguf(source))
    return LoadedModel(layered, tok, name, layered.fingerprint, bool(_get(cfg, "chat")), plain, digest)


def cast(hf: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Move ``hf`` to ``device`` and its weights to ``dtype`` as ``from_pretrained(dtype=...)`` loads
    them: the rotary embeddings' frequency tables (``inv_freq`` buffers, which transformers computes
    in float32 whatever the model's dtype) stay float32. ``Module.to(dtype=...)`` casts every floating
    buffer: in bfloat16 a frequency kept 8 bits, so the rotary angles of later positions drifted from
    the reference bf16 model's (and ``generate`` on the cast module could not show it)."""
    kept = {name: buf.detach().clone() for name, buf in hf.named_buffers() if name.rsplit(".", 1)[-1].endswith("inv_freq")
            and buf.dtype == torch.float32}
    hf.to(device=device, dtype=dtype)
    for name, value in kept.items():
        owner, _, attr = name.rpartition(".")
        setattr(hf.get_submodule(owner), attr, value.to(device))  # a registered buffer keeps its persistence


def _plain_config(cfg) -> dict:
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    return OmegaConf.to_container(OmegaConf.create(dict(cfg)), resolve=True)


def model_for(cfg, loaded: LoadedModel | None = None) -> LoadedModel:
    """``loaded`` when it was loaded from the model config ``cfg`` (one model shared by several
    steps, as the demo does), :func:`load_model` when ``loaded`` is None; a model loaded from
    another config is refused, naming the keys that differ."""
    if loaded is None:
        return load_model(cfg)
    want, have = _plain_config(cfg), _plain_config(loaded.cfg)
    if want != have:
        diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        raise ValueError(f"the loaded model {loaded.name!r} was loaded from another model config than "
                         f"{want.get('name')!r}: model.{', model.'.join(diff)} differ")
    return loaded


def _load_pretrained(path: str, attn: str, name: str):
    """A hub id or local directory; its config.json's model family is checked before the weights load."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    local = Path(path).expanduser()
    where = "local directory" if local.exists() else "hub id"
    if where == "local directory" and not (local / "config.json").exists():
        raise ModelLoadError(f"model config {name!r}: local directory {local} has no config.json")
    try:
        config = AutoConfig.from_pretrained(path)
        check_model_type(getattr(config, "model_type", None), name, f"{where} {path}")
        tok = AutoTokenizer.from_pretrained(path)
        hf = AutoModelForCausalLM.from_pretrained(path, config=config, attn_implementation=attn, dtype="auto")
    except OSError as err:
        raise ModelLoadError(
            f"model config {name!r}: could not load {path!r} as a {where} ({err.__class__.__name__}: "
            f"{str(err).splitlines()[0]}). Check model.name_or_path, your network / HF_TOKEN, or "
            "use the embedded default model=smollm2-135m."
        ) from err
    return hf, tok


def local_gguf(source: Source) -> Path:
    """The local GGUF file of a ``gguf``, ``hub_gguf`` (downloaded) or ``asset`` source."""
    if source.kind == "asset":
        from selfspec.store.assets import asset_path

        return asset_path(source.where)
    if source.kind == "hub_gguf":
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(source.where, source.file))
    return Path(source.where)


def source_digests(cfg) -> dict[str, str]:
    """The sha256 of every file a model config's weights and tokenizer are read from, by path, known
    before the model loads: a GGUF file's (:func:`~selfspec.store.files.content_sha256`, read once per
    version of the file), an offline asset's pins, every file of a local directory. A random model has
    none (its config and seed fix it); a hub repo's files are known once downloaded: its commit is
    :func:`hub_revision`. A run resumes only over the same digests (issue 68: a GGUF replaced at the same
    path was mixed into a resumed run)."""
    from selfspec.store.files import content_sha256

    source = model_source(cfg)
    if source.kind == "asset":
        return assets.asset_digests(source.where)
    if source.kind == "gguf":
        path = Path(source.where).resolve()
        return {str(path): content_sha256(path)}
    local = Path(source.where).expanduser()
    if source.kind == "pretrained" and local.is_dir():
        return {str(f.resolve()): content_sha256(f) for f in sorted(local.iterdir())
                if f.is_file() and not f.name.startswith(".")}
    return {}


def hub_revision(loaded: LoadedModel) -> dict[str, str]:
    """``{"hub <id>": commit}`` of a model loaded from the hub (transformers records the commit it
    resolved), else nothing: :func:`source_digests` covers local files."""
    source = model_source(loaded.cfg)
    commit = getattr(loaded.model.hf.config, "_commit_hash", None)
    if source.kind in ("pretrained", "hub_gguf") and not Path(source.where).expanduser().exists() and commit:
        return {f"hub {source.where}" + (f"/{source.file}" if source.file else ""): str(commit)}
    return {}


def _cache_name(source: Source, gguf: Path) -> str:
    """The conversion cache entry of a GGUF file: its name and the sha256 of its bytes, the pinned
    one for an offline asset (:func:`~selfspec.store.assets.asset_path` verified the file against it), the
    file's own (:func:`~selfspec.store.files.content_sha256`) otherwise. A file with one byte changed gets another entry."""
    from selfspec.store.files import content_sha256

    digest = assets.ASSETS[source.where].files[gguf.name] if source.kind == "asset" else content_sha256(gguf)
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', gguf.stem)}-{digest[:16]}"


def _converted(source: Source, name: str) -> Path:
    """The safetensors directory a GGUF source is dequantised into, once (:func:`_cache_name`).

    The file's metadata is checked first (:func:`~selfspec.models.gguf_file.check`), so an unsupported family or an
    inconsistent file is refused before anything is dequantised.
    """
    gguf = local_gguf(source)
    converted = assets.cache_dir() / "models" / _cache_name(source, gguf)
    if (converted / "config.json").exists():
        return converted
    reader = gguf_file.check(gguf, name)
    log.info("converting %s to safetensors in %s (once)", gguf.name, converted)
    with gguf_file.parsed_once(gguf, reader):
        hf, tok = gguf_file.dequantise(gguf, name)
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    converted.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temporary_folder(converted.parent, converted.name)
    try:
        hf.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        for f in tmp.rglob("*"):  # safetensors makes its files 0o600
            if f.is_file():
                plain_permissions(f)
        os.replace(tmp, converted)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return converted


def _load_gguf(source: Source, attn: str, name: str):
    """A GGUF file, through its dequantised safetensors directory (:func:`_converted`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    converted = _converted(source, name)
    tok = AutoTokenizer.from_pretrained(converted)
    hf = AutoModelForCausalLM.from_pretrained(converted, attn_implementation=attn, dtype=torch.float32)
    return hf, tok


def random_config(cfg, vocab_size: int | None = None, **extra):
    """transformers' config of the random model a ``model`` config describes (``model.random``: its
    family's config class with the given fields; ``vocab_size`` where the spec gives none, e.g. the
    borrowed tokenizer's), without building the model."""
    spec = dict(_plain_config(_get(cfg, "random")))  # plain lists too (Gemma 3's layer_types)
    for key in ("seed", "norm_noise"):
        spec.pop(key, None)
    config_cls = _random_config_class(spec.pop("model_type"))
    vocab = spec.pop("vocab_size", None) or vocab_size
    return config_cls(vocab_size=int(vocab), **spec, **extra)


def _load_random(cfg, attn: str, device: torch.device, dtype: torch.dtype):
    """A seeded random model of a supported family (``model.random.model_type``) with a real
    tokenizer (for fast tests), or one of a large model's shape for runtime benchmarks. On CUDA it
    is built on the device in its dtype (an 8B shape would take 32 GB of host memory in float32
    first), so its values come from the device's generator and differ from the same seed's on a CPU."""
    from transformers import AutoModelForCausalLM

    spec = _get(cfg, "random")
    seed, norm_noise = int(spec.get("seed")), spec.get("norm_noise")
    tok_from = _get(cfg, "tokenizer")
    tok = _tokenizer_of(str(tok_from)) if tok_from else None
    config = random_config(cfg, len(tok) if tok is not None else None, attn_implementation=attn)
    if tok is not None:
        config.eos_token_id = tok.eos_token_id
        config.bos_token_id = tok.bos_token_id
    torch.manual_seed(seed)
    if device.type == "cuda":
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                torch.cuda.manual_seed(seed)
                hf = AutoModelForCausalLM.from_config(config)
        finally:
            torch.set_default_dtype(previous)
    else:
        hf = AutoModelForCausalLM.from_config(config)
    if norm_noise:
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(torch.rand_like(p) * (2 * float(norm_noise)) - float(norm_noise))
    hf.generation_config.eos_token_id = config.eos_token_id
    return hf, tok


def _tokenizer_of(model_name: str):
    """The tokenizer of another model config (e.g. tiny-random borrows SmolLM2's)."""
    from transformers import AutoTokenizer

    from selfspec.config import model_config

    other = model_config(model_name)
    source = check_model_config(other)
    if source.kind == "pretrained":
        return AutoTokenizer.from_pretrained(source.where)
    if source.kind == "random":
        raise checks.refuse("model.tokenizer", model_name, "must name a model config with a tokenizer, not "
                            "another random model")
    return AutoTokenizer.from_pretrained(_converted(source, model_name))

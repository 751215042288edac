"""Memory per job and model size: a job's peak, estimated before the model loads, and measured.

The model (fitted on the CPU measurements of ``scripts/measure_memory.py``, ``docs/memory_measured.json``;
docs/usage.md, "Memory per job and model size")::

    peak = weights + trainable parameters × optimizer state + s_job × activations [+ runtime, CPU only]

* **weights**: parameters × bytes per parameter of ``model.dtype`` (the model is frozen in every job);
* **optimizer**: the trained parameters (AdaDecode's ``T_l``: float32; PPD's prompt embeddings: the
  model's dtype) with their gradient and AdamW's two moments: 4 copies;
* **activations**: the tensors each job's shapes make, summed from the shapes (the job's
  :class:`MemoryModel` ``terms``, one named term per tensor group, each with the setting that scales
  it; the helpers here give the common tensor groups), times one factor ``s_job`` fitted per job: how many such tensors are alive at the peak (autograd's saved tensors, allocator slack).
  For the jobs that back-propagate through the frozen model (PPD's prompt tokens) the saved tensors
  grow with the rows that carry a gradient × layers × (hidden + intermediate); for the heads' KL over
  the full vocabulary with positions × heads × vocabulary;
* **runtime** (CPU only): the process's resident memory without the model, the interpreter and
  libraries (fitted per job: a job imports its own). On CUDA, ``torch.cuda.max_memory_allocated``
  counts tensors only; the refusal adds :data:`CUDA_RESERVE` for the context and allocator slack.

:func:`check_fits` refuses a job before its model loads when the estimate exceeds the device's memory
(CUDA: the device's total memory; CPU: ``MemAvailable``), naming the estimate, its largest term and the
setting that scales it. ``python -m selfspec.memory --table`` prints the table of docs/usage.md.

What a job says about its own memory (its terms, its fitted ``s`` and CPU runtime, the settings tried
until it fits) lives with the job, as its :class:`MemoryModel`: a training job's ``JOB.memory``
(:mod:`selfspec.training`), an evaluation's :data:`selfspec.evaluation.runner.MEMORY`. This module
knows no job by name.
Two settings bound the activations without changing the result: ``job.gradient_checkpointing`` for
PPD's prompt training (backward keeps each layer's input and one layer's saved tensors at a time) and
``job.kl_chunk`` for the heads (at most that many positions' ``|V|``-wide logits alive at once).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from selfspec.config import checks

GB = 1e9
MB = 2**20
#: memory a CUDA process holds beyond its tensors (context, cuBLAS workspaces, allocator slack), an
#: allowance the refusal adds on a GPU (not measured here: no GPU was lent)
CUDA_RESERVE = 1.5 * GB
#: AdamW: the parameter, its gradient and two moments
OPTIMIZER_COPIES = 4
#: tokens of context an evaluation is estimated for (its prompts' length is known only once read)
EVAL_CONTEXT = 2048
#: the largest relative error over the 24 CPU points (SmolLM2's base points, -21%: its GGUF-converted
#: checkpoint leaves ~210 MB resident beyond its weights after the load; the varied points are within 3.4%)
ERROR = 0.214


class MemoryRefused(RuntimeError):
    """A job's estimated peak exceeds the device's memory (raised before the model loads)."""


# --- the model's shape -------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """What memory depends on in a decoder-only model of the supported (Llama-like) families."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    bias: bool = False  # q/k/v biases (Qwen2)

    @property
    def params(self) -> int:
        d, a, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = d * a + 2 * d * kv + a * d + 3 * d * self.intermediate + 2 * d + (a + 2 * kv) * self.bias
        return self.vocab * d * (1 if self.tied else 2) + self.layers * layer + d

    @property
    def kv_per_token(self) -> int:
        """Cached values per token (keys and values of every layer)."""
        return 2 * self.layers * self.kv_heads * self.head_dim

    @classmethod
    def of_hf_config(cls, c) -> "Shape":
        heads = int(c.num_attention_heads)
        return cls(layers=int(c.num_hidden_layers), hidden=int(c.hidden_size), intermediate=int(c.intermediate_size),
                   heads=heads, kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
                   head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads), vocab=int(c.vocab_size),
                   tied=bool(getattr(c, "tie_word_embeddings", False)),
                   bias=bool(getattr(c, "attention_bias", False) or c.model_type == "qwen2"))


#: public configs of the sizes the memory table covers (docs/usage.md) (Llama-3.2-1B, Llama-3-8B, Llama-2-13B, Llama-3-70B)
SIZES = {
    "1B": Shape(16, 2048, 8192, 32, 8, 64, 128256, True),
    "8B": Shape(32, 4096, 14336, 32, 8, 128, 128256, False),
    "13B": Shape(40, 5120, 13824, 40, 40, 128, 32000, False),
    "70B": Shape(80, 8192, 28672, 64, 8, 128, 128256, False),
}


def _gguf_shape(path: Path, name: str) -> Shape:
    """A GGUF file's shape from its metadata (:func:`_read_gguf_shape`), read once for one version of
    the file: gguf's reader parses every metadata field, the tokenizer's 49,152 strings included,
    which took 3–8 s for SmolLM2's file. Kept per process, and on disk
    (:func:`~selfspec.store.files.per_file_version`, ``<cache>/gguf-shapes-1/``), so a later process
    (every run of a GGUF model, and of tiny-random, whose vocabulary is its tokenizer's) does not read
    it again."""
    try:
        stat = Path(path).stat()
    except OSError:
        return _read_gguf_shape(Path(path), name)  # the reader names the file and what is wrong with it
    return _cached_gguf_shape(str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino, name)


@functools.lru_cache(maxsize=16)
def _cached_gguf_shape(path: str, size: int, mtime_ns: int, inode: int, name: str) -> Shape:
    from dataclasses import asdict, fields

    from selfspec.store.files import per_file_version

    keys = {f.name for f in fields(Shape)}
    kept = per_file_version("gguf-shapes-1", path, lambda p: asdict(_read_gguf_shape(p, name)),
                            valid=lambda value: isinstance(value, dict) and set(value) == keys)
    return Shape(**kept)


def _read_gguf_shape(path: Path, name: str) -> Shape:
    """A GGUF file's shape from its metadata (no tensor read), each field checked (issue 39: a missing
    or zero field gave a raw TypeError or ZeroDivisionError, and a lying ``feed_forward_length`` a
    1,472 GB estimate blamed on the prompts): present, a positive whole number, the heads dividing the
    width, and the parameters the metadata describes those the tensors hold (within 1%)."""
    from selfspec.models import gguf_file

    reader = gguf_file.read(path, name)
    arch = gguf_file.metadata_value(reader, "general.architecture")

    def bad(what: str) -> ValueError:
        return ValueError(f"model config {name!r}: GGUF file {path}: {what}: not a model file selfspec can size; "
                          "fetch it again (make assets) or point model.gguf_path at another file")

    def get(key: str, optional: bool = False) -> int | None:
        value = gguf_file.metadata_value(reader, f"{arch}.{key}")
        if value is None and optional:
            return None
        if value is None:
            raise bad(f"{arch}.{key} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise bad(f"{arch}.{key} is {value!r}, not a positive whole number")
        return value

    d, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", optional=True)
    if head_dim is None and d % heads:
        raise bad(f"{arch}.attention.head_count {heads} does not divide {arch}.embedding_length {d}")
    kv_heads = get("attention.head_count_kv", optional=True) or heads
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None or not tokens.data:
        raise bad("tokenizer.ggml.tokens is missing")
    shape = Shape(layers=get("block_count"), hidden=d, intermediate=get("feed_forward_length"), heads=heads,
                  kv_heads=kv_heads, head_dim=head_dim or d // heads, vocab=len(tokens.data),
                  tied=not any(t.name == "output.weight" for t in reader.tensors), bias=arch == "qwen2")
    held = sum(int(t.n_elements) for t in reader.tensors)
    if held and abs(shape.params - held) > 0.01 * held:
        raise bad(f"its metadata describes {shape.params:,} parameters, its tensors hold {held:,} "
                  f"({arch}.block_count {shape.layers}, embedding_length {d}, feed_forward_length "
                  f"{shape.intermediate}, attention.head_count {heads}, head_count_kv {kv_heads})")
    return shape


def shape_of(model_cfg) -> Shape:
    """The shape of the model a ``model`` config names, without loading its weights: a random model's
    config fields, a GGUF file's metadata, a hub repo's or directory's ``config.json``."""
    from selfspec.models import loading

    source = loading.check_model_config(model_cfg)
    name = str(model_cfg.name)
    if source.kind == "random":
        vocab = None
        if model_cfg.random.get("vocab_size") is None:
            from selfspec.config import model_config

            vocab = shape_of(model_config(str(model_cfg.tokenizer))).vocab
        return Shape.of_hf_config(loading.random_config(model_cfg, vocab))
    if source.kind == "pretrained":
        from transformers import AutoConfig

        return Shape.of_hf_config(AutoConfig.from_pretrained(source.where))
    return _gguf_shape(loading.local_gguf(source), name)


# --- the terms ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Term:
    """One part of a job's peak: ``bytes``, and the setting that scales it."""

    name: str
    bytes: float
    setting: str
    activation: bool = True  # scaled by the job's fitted factor


def layer_bytes(s: Shape, rows: float, b: int) -> float:
    """A layer's transient tensors over ``rows`` tokens without gradients: hidden states, q/k/v, the
    fused gate/up product and its activation."""
    return rows * (4 * s.hidden + 4 * s.intermediate) * b


def scores_bytes(s: Shape, rows: float, keys: float, b: int) -> float:
    """Attention scores of ``rows`` queries over ``keys`` keys (SDPA with an explicit mask may form them)."""
    return rows * s.heads * keys * b


def saved_bytes(s: Shape, rows: float, keys: float, b: int) -> float:
    """What autograd keeps for backward through every layer for ``rows`` rows: each layer's linear and
    norm inputs and the MLP's gate/up products, and the attention probabilities."""
    return s.layers * (rows * (6 * s.hidden + 3 * s.intermediate) * b + rows * s.heads * keys * 4)


def generation_bytes(s: Shape, batch: int, prompt: int, new: int, b: int) -> float:
    """Batched ``generate`` (the heads' and draft vocabulary's continuations): its KV cache, the prefill's
    transient layer tensors and scores, the last rows' float32 logits."""
    return (batch * (prompt + new) * s.kv_per_token * b + layer_bytes(s, batch * prompt, b)
            + scores_bytes(s, batch * prompt, prompt, b) + batch * s.vocab * 4)


def backward_bytes(s: Shape, rows: float, keys: float, b: int, checkpointed: bool) -> float:
    """What backward through every layer keeps: all layers' saved tensors, or with gradient
    checkpointing each layer's input and one layer's saved tensors (the layer run again)."""
    if not checkpointed:
        return saved_bytes(s, rows, keys, b)
    return s.layers * rows * s.hidden * b + saved_bytes(s, rows, keys, b) / s.layers


@dataclass(frozen=True)
class MemoryModel:
    """What a job says about its memory. ``terms(shape, cfg, dtype_bytes, context, prompt)``: its
    terms beside the weights, by phase (the phases run one after the other; the peak is the largest
    phase; ``cfg`` the composed ``train`` config, or the evaluation config). ``s`` (live copies of the
    activation terms at the peak) and ``runtime`` (bytes of the CPU process without the model:
    interpreter, libraries, data) are fitted by ``scripts/measure_memory.py --fit`` on the CPU points
    of docs/memory_measured.json (``s`` where batch x sequence was varied, 1 elsewhere).
    ``fallbacks``: settings tried in order until the estimate fits (the memory table of docs/usage.md; the first is
    the job's defaults)."""

    terms: Callable[[Shape, Any, int, int, "int | None"], list[list[Term]]]
    s: float
    runtime: float
    fallbacks: tuple[tuple[str, ...], ...] = ((),)


# --- the estimate ------------------------------------------------------------------------------
@dataclass
class Estimate:
    """A job's estimated peak (bytes) and its parts."""

    job: str
    weights: float
    runtime: float
    parts: list[Term]  # the largest phase, each term as counted (activations scaled)

    @property
    def total(self) -> float:
        return self.weights + self.runtime + sum(t.bytes for t in self.parts)

    def largest(self) -> Term:
        return max(self.parts, key=lambda t: t.bytes)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def estimate(job: str, model: MemoryModel, shape: Shape, cfg, dtype: torch.dtype, device: torch.device,
             context: int = EVAL_CONTEXT, prompt: int | None = None) -> Estimate:
    """The estimated peak of ``job`` (its :class:`MemoryModel` ``model``) for a model of ``shape`` in
    ``dtype`` on ``device`` (CPU: resident memory, the process included; CUDA: ``max_memory_allocated``)."""
    b = dtype_bytes(dtype)
    phases = [[Term(t.name, t.bytes * (model.s if t.activation else 1.0), t.setting, t.activation) for t in phase]
              for phase in model.terms(shape, cfg, b, context, prompt)]
    parts = max(phases, key=lambda p: sum(t.bytes for t in p))
    return Estimate(job, shape.params * b, model.runtime if torch.device(device).type == "cpu" else 0.0, parts)


def device_memory(device: torch.device) -> tuple[float, str]:
    """Bytes a job may use on ``device`` and what they are: a CUDA device's total memory less
    :data:`CUDA_RESERVE`; on a CPU, ``MemAvailable``."""
    device = torch.device(device)
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return total - CUDA_RESERVE, f"{device}'s {total / GB:.1f} GB less {CUDA_RESERVE / GB:.1f} GB reserved"
    m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    if m is None:
        raise RuntimeError("/proc/meminfo has no MemAvailable: the memory check needs Linux (memory_check=false)")
    return int(m.group(1)) * 1024, "the CPU's available memory (MemAvailable)"


def check_fits(job: str, model: MemoryModel, cfg, context: int = EVAL_CONTEXT,
               prompt: int | None = None) -> Estimate | None:
    """Refuse ``job`` (its :class:`MemoryModel` ``model``) before its model loads when its estimated peak exceeds the device's memory
    (``memory_check=false`` skips the check). ``context``: an evaluation's longest sequence (prompt and
    new tokens), ``prompt`` its longest prompt. Returns the estimate (None when skipped). The message
    names what would help: the setting that scales the largest part, or, where the weights alone do
    not fit, the dtype or a larger device."""
    from selfspec.models.loading import resolve_device, resolve_dtype

    if not checks.flag("memory_check", cfg.memory_check):
        return None
    device = resolve_device(str(cfg.model.device))
    dtype = resolve_dtype(str(cfg.model.dtype), device)
    est = estimate(job, model, shape_of(cfg.model), cfg, dtype, device, context, prompt)
    have, what = device_memory(device)
    if est.weights > have:
        raise MemoryRefused(
            f"job={job} with model={cfg.model.name} in {str(dtype).replace('torch.', '')}: the weights alone need "
            f"an estimated {est.weights / GB:.2f} GB, more than {what} "
            f"({have / GB:.1f} GB). Choose a smaller model, a smaller model.dtype, or a larger device; "
            "memory_check=false runs it anyway.")
    if est.total > have:
        big = est.largest()
        raise MemoryRefused(
            f"job={job} with model={cfg.model.name} in {str(dtype).replace('torch.', '')} needs an estimated "
            f"{est.total / GB:.1f} GB (weights {est.weights / GB:.1f} GB; largest other part: {big.name} "
            f"{big.bytes / GB:.1f} GB), more than {what} ({have / GB:.1f} GB). Lower {big.setting}, or model.dtype, "
            f"or run it on a larger device; the estimate's error is ±{ERROR:.0%} (selfspec.measure.peak), and "
            "memory_check=false runs it anyway.")
    return est


# --- measuring -----------------------------------------------------------------------------------
def _status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in kB (``VmRSS``, ``VmHWM``)."""
    m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    if m is None:
        raise RuntimeError(f"/proc/self/status has no {field} (peak memory on a CPU needs Linux)")
    return int(m.group(1))


class Peak:
    """The peak memory of what runs between :meth:`reset` and :meth:`read`, in bytes: on CUDA
    ``torch.cuda.max_memory_allocated`` (tensors only), on a CPU the process's peak resident set
    (``VmHWM``, reset through ``/proc/self/clear_refs``; Linux), which holds everything the process
    touched, the interpreter and libraries included."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return _status_kb("VmRSS") * 1024

    def read(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return _status_kb("VmHWM") * 1024

"""Memory per job and model size: a job's peak, estimated before the model loads, and measured.

The model (fitted on the CPU measurements of ``scripts/measure_memory.py``, ``docs/memory_measured.json``;
README "Memory per job and model size")::

    peak = weights + trainable parameters × optimizer state + s_job × activations [+ runtime, CPU only]

* **weights**: parameters × bytes per parameter of ``model.dtype`` (the model is frozen in every job);
* **optimizer**: the trained parameters (AdaDecode's ``T_l``: float32; PPD's prompt embeddings: the
  model's dtype) with their gradient and AdamW's two moments: 4 copies;
* **activations**: the tensors each job's shapes make, summed from the shapes (:func:`terms`, one
  named term per tensor group, each with the setting that scales it), times one factor ``s_job`` fitted
  per job: how many such tensors are alive at the peak (autograd's saved tensors, allocator slack).
  For the jobs that back-propagate through the frozen model (PPD's prompt tokens) the saved tensors
  grow with the rows that carry a gradient × layers × (hidden + intermediate); for the heads' KL over
  the full vocabulary with positions × heads × vocabulary;
* **runtime** (CPU only): the process's resident memory without the model, the interpreter and
  libraries (fitted per job: a job imports its own). On CUDA, ``torch.cuda.max_memory_allocated``
  counts tensors only; the refusal adds :data:`CUDA_RESERVE` for the context and allocator slack.

:func:`check_fits` refuses a job before its model loads when the estimate exceeds the device's memory
(CUDA: the device's total memory; CPU: ``MemAvailable``), naming the estimate, its largest term and the
setting that scales it. ``python -m selfspec.memory --table`` prints the README's table.
Two settings bound the activations without changing the result: ``job.gradient_checkpointing`` for
PPD's prompt training (backward keeps each layer's input and one layer's saved tensors at a time) and
``job.kl_chunk`` for the heads (at most that many positions' ``|V|``-wide logits alive at once).
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
#: a validation prompt's tokens in ``job=ppd_tree`` (ShareGPT first turns, not clipped by the job)
TREE_PROMPT = 512

#: per job: ``s`` (live copies of the activation terms at the peak) and ``runtime`` (bytes of the CPU
#: process without the model: interpreter, libraries, data), fitted by ``scripts/measure_memory.py
#: --fit`` on the CPU points of docs/memory_measured.json (``s`` fitted where batch x sequence was
#: varied, heads and prompts; 1 elsewhere)
FIT: dict[str, dict[str, float]] = {
    "heads": {"s": 0.606, "runtime": 550712115.2},
    "prompts": {"s": 0.805, "runtime": 502058188.8},
    "skips": {"s": 1.0, "runtime": 588985139.2},
    "ppd_tree": {"s": 1.0, "runtime": 486748979.2},
    "draft_vocab": {"s": 1.0, "runtime": 502267904.0},
    "evaluate": {"s": 1.0, "runtime": 497863884.8},
}
#: the largest relative error over the 24 CPU points (SmolLM2's base points, -21%: its GGUF-converted
#: checkpoint leaves ~210 MB resident beyond its weights after the load; the varied points are within 3.4%)
ERROR = 0.214
JOBS = tuple(FIT)


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


#: public configs of the sizes the README's table covers (Llama-3.2-1B, Llama-3-8B, Llama-2-13B, Llama-3-70B)
SIZES = {
    "1B": Shape(16, 2048, 8192, 32, 8, 64, 128256, True),
    "8B": Shape(32, 4096, 14336, 32, 8, 128, 128256, False),
    "13B": Shape(40, 5120, 13824, 40, 40, 128, 32000, False),
    "70B": Shape(80, 8192, 28672, 64, 8, 128, 128256, False),
}


def _gguf_shape(path: Path, name: str) -> Shape:
    """A GGUF file's shape from its metadata (no tensor read), each field checked (issue 39: a missing
    or zero field gave a raw TypeError or ZeroDivisionError, and a lying ``feed_forward_length`` a
    1,472 GB estimate blamed on the prompts): present, a positive whole number, the heads dividing the
    width, and the parameters the metadata describes those the tensors hold (within 1%)."""
    from selfspec.models.loading import _gguf_value, _read_gguf

    reader = _read_gguf(path, name)
    arch = _gguf_value(reader, "general.architecture")

    def bad(what: str) -> ValueError:
        return ValueError(f"model config {name!r}: GGUF file {path}: {what}: not a model file selfspec can size; "
                          "fetch it again (make assets) or point model.gguf_path at another file")

    def get(key: str, optional: bool = False) -> int | None:
        value = _gguf_value(reader, f"{arch}.{key}")
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
    return _gguf_shape(loading._gguf_path(source), name)


# --- the terms ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Term:
    """One part of a job's peak: ``bytes``, and the setting that scales it."""

    name: str
    bytes: float
    setting: str
    activation: bool = True  # scaled by the job's fitted factor


def _layer(s: Shape, rows: float, b: int) -> float:
    """A layer's transient tensors over ``rows`` tokens without gradients: hidden states, q/k/v, the
    fused gate/up product and its activation."""
    return rows * (4 * s.hidden + 4 * s.intermediate) * b


def _scores(s: Shape, rows: float, keys: float, b: int) -> float:
    """Attention scores of ``rows`` queries over ``keys`` keys (SDPA with an explicit mask may form them)."""
    return rows * s.heads * keys * b


def _saved(s: Shape, rows: float, keys: float, b: int) -> float:
    """What autograd keeps for backward through every layer for ``rows`` rows: each layer's linear and
    norm inputs and the MLP's gate/up products, and the attention probabilities."""
    return s.layers * (rows * (6 * s.hidden + 3 * s.intermediate) * b + rows * s.heads * keys * 4)


def _generation(s: Shape, batch: int, prompt: int, new: int, b: int) -> float:
    """Batched ``generate`` (the heads' and draft vocabulary's continuations): its KV cache, the prefill's
    transient layer tensors and scores, the last rows' float32 logits."""
    return (batch * (prompt + new) * s.kv_per_token * b + _layer(s, batch * prompt, b)
            + _scores(s, batch * prompt, prompt, b) + batch * s.vocab * 4)


def _heads_terms(s: Shape, j, b: int) -> list[list[Term]]:
    n_heads = len(j.layers) if j.layers is not None else int(j.n_heads)
    new = int(j.gen_tokens) + 1
    positions = int(j.batch_size) * new
    if j.max_positions is not None:
        positions = min(positions, int(j.max_positions))
    trained = n_heads * s.hidden * (s.hidden if j.kind == "linear" else s.vocab)
    cached = (int(j.n_prompts) if j.cache_features else int(j.batch_size)) + int(j.n_heldout)
    sequence = int(j.max_prompt_tokens or 4096) + new
    train = [
        Term("optimizer", trained * 4 * OPTIMIZER_COPIES, "job.kind / job.n_heads", activation=False),
        Term("features", cached * new * (n_heads + 1) * s.hidden * b, "job.cache_features / job.n_prompts"),
        Term("kl", n_heads * min(positions, j.get("kl_chunk") or positions) * s.vocab * (b + 24),
             "job.kl_chunk / job.max_positions"),
        Term("frozen pass", _layer(s, sequence, b) + _scores(s, sequence, sequence, b), "job.max_prompt_tokens"),
    ]
    gen = [Term("generation", _generation(s, int(j.gen_batch), sequence - new, new, b),
                "job.gen_batch / job.max_prompt_tokens")]
    return [train, gen]


def _prompts_terms(s: Shape, j, b: int) -> list[list[Term]]:
    m, e, k, ctx = int(j.m), int(j.n_ept), int(j.inserts), int(j.context_length)
    rows = k * m * e
    return [[
        Term("optimizer", m * e * s.hidden * b * OPTIMIZER_COPIES, "job.m / job.n_ept", activation=False),
        Term("cache", (ctx + rows) * s.kv_per_token * b, "job.context_length"),
        Term("frozen pass", _layer(s, ctx, b) + _scores(s, ctx, ctx, b), "job.context_length"),
        Term("logits", (k * m + rows) * s.vocab * (b + 16), "job.inserts / job.n_ept"),
        Term("backward through the model", _backward(s, rows, ctx + rows, b, bool(j.get("gradient_checkpointing"))),
             "job.gradient_checkpointing / job.inserts"),
    ]]


def _backward(s: Shape, rows: float, keys: float, b: int, checkpointed: bool) -> float:
    """What backward through every layer keeps: all layers' saved tensors, or with gradient
    checkpointing each layer's input and one layer's saved tensors (the layer run again)."""
    if not checkpointed:
        return _saved(s, rows, keys, b)
    return s.layers * rows * s.hidden * b + _saved(s, rows, keys, b) / s.layers


def _skips_terms(s: Shape, j, b: int) -> list[list[Term]]:
    n, new = int(j.n_prompts), int(j.max_new_tokens)
    block = int(j.max_prompt_tokens or 4096) + new
    queries = n * (new - 1)
    keys = n * block + queries
    return [[
        Term("cache", keys * s.kv_per_token * b, "job.n_prompts / job.max_prompt_tokens"),
        Term("dev pass", _layer(s, block, b) + _scores(s, block, keys, b) + block * keys * b,
             "job.n_prompts / job.max_prompt_tokens"),
        Term("draft agreement", queries * s.vocab * 2 * b + _scores(s, queries, keys, b), "job.n_prompts / job.max_new_tokens"),
    ]]


def _tree_terms(s: Shape, j, b: int, prompt_tokens) -> list[list[Term]]:
    m, e = int(prompt_tokens["m"]), int(prompt_tokens["n_ept"])
    new = int(j.max_new_tokens)
    seq = TREE_PROMPT + new
    rows = new * m * e
    size = max(int(x) for x in j.sizes)
    return [[
        Term("statistics", (seq + rows) * s.kv_per_token * b + _layer(s, seq, b) + _scores(s, seq, seq + rows, b)
             + (new * m + rows) * s.vocab * b, "job.max_new_tokens"),
        Term("latency", (int(j.latency_context) + size) * s.kv_per_token * b + size * s.vocab * 4,
             "job.sizes / job.latency_context"),
    ]]


def _vocab_terms(s: Shape, j, b: int) -> list[list[Term]]:
    new = int(j.gen_tokens) + 1
    prompt = int(j.max_prompt_tokens or 4096)
    sizes = [int(x) for x in j.sizes if int(x) < s.vocab] + ([int(j.size)] if j.size is not None else [])
    return [
        [Term("generation", _generation(s, int(j.gen_batch), prompt, new, b), "job.gen_batch / job.max_prompt_tokens")],
        [Term("truncated head", max(sizes, default=0) * s.hidden * b + s.vocab * 4, "job.sizes / job.size")],
    ]


def _evaluate_terms(s: Shape, cfg, b: int, context: int, prompt: int | None) -> list[list[Term]]:
    """The cache of the longest sequence (``context``: prompt and new tokens) and the prompt's prefill
    (``prompt`` rows; the whole context when not given)."""
    prompt = context if prompt is None else min(prompt, context)
    return [[
        Term("cache", context * s.kv_per_token * b,
             "max_new_tokens" if context - prompt > prompt else "the task's prompts (or max_new_tokens)"),
        Term("prefill", _layer(s, prompt, b) + _scores(s, prompt, prompt, b) + s.vocab * 4,
             "the task's prompts"),
    ]]


def terms(job: str, shape: Shape, cfg, dtype_bytes: int, context: int = EVAL_CONTEXT,
          prompt: int | None = None) -> list[list[Term]]:
    """A job's terms beside the weights, by phase (the phases run one after the other; the peak is the
    largest phase). ``cfg``: the composed ``train`` config (``evaluate``: the evaluation config)."""
    b = dtype_bytes
    if job == "heads":
        return _heads_terms(shape, cfg.job, b)
    if job == "prompts":
        return _prompts_terms(shape, cfg.job, b)
    if job == "skips":
        return _skips_terms(shape, cfg.job, b)
    if job == "ppd_tree":
        return _tree_terms(shape, cfg.job, b, _tree_prompts(cfg))
    if job == "draft_vocab":
        return _vocab_terms(shape, cfg.job, b)
    if job == "evaluate":
        return _evaluate_terms(shape, cfg, b, context, prompt)
    raise ValueError(f"no memory model of job {job!r}; one of {', '.join(JOBS)}")


def _tree_prompts(cfg) -> dict:
    """The prompt tokens' ``m`` and ``n_ept`` of the artefact a tree is built for (its ``meta.json``;
    the prompts job's config when there is none yet)."""
    import json

    path = cfg.job.get("prompts")
    meta = Path(str(path)) / "meta.json" if path else None
    if meta is not None and meta.exists():
        data = json.loads(meta.read_text())
        train = data.get("train_config") or {}
        return {"m": data.get("m", train.get("m", 3)), "n_ept": data.get("n_ept", train.get("n_ept", 1))}
    from omegaconf import OmegaConf

    from selfspec.config import conf_dir

    job = OmegaConf.load(conf_dir() / "job" / "prompts.yaml")
    return {"m": job.m, "n_ept": job.n_ept}


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


def estimate(job: str, shape: Shape, cfg, dtype: torch.dtype, device: torch.device,
             context: int = EVAL_CONTEXT, prompt: int | None = None) -> Estimate:
    """The estimated peak of ``job`` for a model of ``shape`` in ``dtype`` on ``device`` (CPU: resident
    memory, the process included; CUDA: ``max_memory_allocated``)."""
    fit = FIT[job]
    b = dtype_bytes(dtype)
    phases = [[Term(t.name, t.bytes * (fit["s"] if t.activation else 1.0), t.setting, t.activation) for t in phase]
              for phase in terms(job, shape, cfg, b, context, prompt)]
    parts = max(phases, key=lambda p: sum(t.bytes for t in p))
    return Estimate(job, shape.params * b, fit["runtime"] if torch.device(device).type == "cpu" else 0.0, parts)


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


def check_fits(job: str, cfg, context: int = EVAL_CONTEXT, prompt: int | None = None) -> Estimate | None:
    """Refuse ``job`` before its model loads when its estimated peak exceeds the device's memory
    (``memory_check=false`` skips the check). ``context``: an evaluation's longest sequence (prompt and
    new tokens), ``prompt`` its longest prompt. Returns the estimate (None when skipped). The message
    names what would help: the setting that scales the largest part, or, where the weights alone do
    not fit, the dtype or a larger device."""
    from selfspec.models.loading import resolve_device, resolve_dtype

    if not checks.flag("memory_check", cfg.memory_check):
        return None
    device = resolve_device(str(cfg.model.device))
    dtype = resolve_dtype(str(cfg.model.dtype), device)
    est = estimate(job, shape_of(cfg.model), cfg, dtype, device, context, prompt)
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
            f"or run it on a larger device; the estimate's error is ±{ERROR:.0%} (selfspec.memory), and "
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


# --- the README table ----------------------------------------------------------------------------
def job_config(job: str, overrides: list[str] = ()):
    """A job's default config (conf/job, conf/evaluate.yaml) with ``overrides``, for the table."""
    from selfspec.config import compose

    if job == "evaluate":
        return compose(["model=tiny-random", *overrides], config_name="evaluate")
    return compose(["model=tiny-random", f"job={job}", *overrides], config_name="train")


#: per job, settings tried in order until the estimate fits (the first is the job's defaults)
FALLBACKS = {
    "heads": [[], ["job.kl_chunk=16"], ["job.kl_chunk=16", "job.gen_batch=2", "job.max_prompt_tokens=512"]],
    "prompts": [[], ["job.gradient_checkpointing=true"],
                ["job.gradient_checkpointing=true", "job.inserts=8", "job.context_length=256"]],
    "skips": [[], ["job.n_prompts=4", "job.max_prompt_tokens=256"]],
    "ppd_tree": [[]],
    "draft_vocab": [[], ["job.gen_batch=2"]],
    "evaluate": [[]],
}


def table(sizes: dict[str, Shape] = SIZES, budgets=(24, 40, 80)) -> str:
    """The README table: per job and model size, the bf16 estimate on one GPU at the defaults, and per
    budget (GB) the first of :data:`FALLBACKS` that fits (or "does not fit")."""
    cuda = torch.device("cuda")
    lines = ["| job | model | estimate (defaults) | " + " | ".join(f"{g} GB" for g in budgets) + " |",
             "|---|---|---|" + "---|" * len(budgets)]
    for job in JOBS:
        cfgs = [(o, job_config(job, o)) for o in FALLBACKS[job]]
        for label, shape in sizes.items():
            ests = [(o, estimate(job, shape, c, torch.bfloat16, cuda)) for o, c in cfgs]
            cells = []
            for g in budgets:
                fit = next(((o, e) for o, e in ests if e.total + CUDA_RESERVE <= g * GB), None)
                if fit is None:
                    cells.append("does not fit")
                else:
                    cells.append(("defaults" if not fit[0] else " ".join(f"`{x}`" for x in fit[0]))
                                 + f" ({fit[1].total / GB:.1f} GB)" * bool(fit[0]))
            lines.append(f"| {job} | {label} | {ests[0][1].total / GB:.1f} GB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m selfspec.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--table", action="store_true", help="print the README's table (bf16, one GPU)")
    args = p.parse_args(argv)
    if args.table:
        print(table())
        return 0
    p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())

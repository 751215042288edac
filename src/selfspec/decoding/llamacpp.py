"""llama.cpp as a peer: the same model decoded greedily by llama.cpp (llama-cpp-python, the optional
extra: ``make llamacpp``), in the same sweep and table as selfspec's methods (``method=llama_cpp``).

It answers the question a reader of a speedup table asks next: how far is selfspec's float32-exact
output from the runtime people decode small models with on a CPU. ``weights`` picks what llama.cpp
reads (:data:`WEIGHTS`):

``auto``     the run's dtype: ``f32`` for a float32 run, ``bf16`` for bfloat16;
``f32``,     the model's values in float32 or bfloat16: for a model read from a GGUF file (the embedded
``bf16``     models, ``model.gguf_path``), llama.cpp's own requantisation of that file (its blocks
             dequantised: the values selfspec's float32 holds); for a transformers checkpoint of the
             Llama architecture, the loaded weights written as GGUF
             (:func:`selfspec.models.gguf_export.cached_gguf`);
``q8_0``,    llama.cpp's own quantiser applied to those values (``llama_model_quantize``, as its
``q4_0``,    ``llama-quantize`` tool does): its usual quantised decoding, not lossless;
``q4_k_m``
``source``   the GGUF file the model was read from, as shipped (SmolLM2's Q4_1, Qwen2.5-Coder's Q4_K_M).

Each file is made once into the asset cache (``gguf/``, written under a temporary name and renamed into
place). The KV cache holds the run's dtype (F32 or BF16) whatever the weights; llama.cpp runs on torch's
thread count. A step is one ``llama_decode`` of the last token and an argmax over the logits llama.cpp
leaves in its buffer, read in place, as vanilla's step is one forward and an argmax; each token is cut
at EOS, stop strings and the budget as the layered loop cuts it. Greedy only (a sampled run refuses it:
llama.cpp's sampler draws from its own generator, so a seeded run could not match the methods').

``llama_cpp_speculative`` (:class:`LlamaCppSpeculative`) is llama.cpp's speculative decoding with a separate
draft model, the classic two-model peer (Leviathan et al. 2023): ``draft`` names a model config (conf/model/)
whose GGUF file, as shipped, drafts for the target (``-md`` of llama.cpp's ``llama-speculative-simple``; e.g.
Qwen2.5-Coder-0.5B for the 1.5B). Its loop is that tool's greedy one (llama.cpp's ``common/speculative.cpp``,
``common_speculative_gen_draft``): the draft's context keeps the longest prefix it shares with the committed
tokens and evaluates the rest; it then drafts greedily while its top token's probability among its 10 best
(llama.cpp's top-k 10 draft sampler) is at least ``draft_p_min``, at most ``max_draft`` tokens (a draft shorter
than ``draft_min`` is dropped: a plain step); the target evaluates the pending token and the drafts in one
batch with every row's logits, accepts the drafts its argmax repeats, and its cache is cut after them. The
output is the target's own greedy tokens (llama.cpp's, as ``llama_cpp`` with the same ``weights``). The
loop runs in Python over llama-cpp-python's context API, since llama-cpp-python ships no separate-draft
speculation (its ``draft_model`` hook takes prompt-lookup drafters) and does not build llama.cpp's tools.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np
import torch

from selfspec.config import checks
from selfspec.config.options import Options, Ref, key
from selfspec.decoding.base import DecodeState, Decoder, Generation, StepTrace
from selfspec.decoding.peers import draft_model_option
from selfspec.decoding.sampling import Sampling

log = logging.getLogger(__name__)

#: what the runtime benchmark prints when the extra is absent
NOT_INSTALLED = "llama.cpp: skipped (llama-cpp-python not installed; `make llamacpp`)"
#: ``weights`` -> llama.cpp's file type name (``LLAMA_FTYPE_<name>``); ``auto`` and ``source`` resolve first
FTYPES = {"f32": "ALL_F32", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0",
          "q4_k_m": "MOSTLY_Q4_K_M"}
WEIGHTS = ("auto", *FTYPES, "source")
#: ggml's type number of BF16 (llama-cpp-python 0.3.36 exports no constant for it)
GGML_TYPE_BF16 = 30
#: the smallest context a llama.cpp context is made with; it grows by doubling (:meth:`LlamaCpp.reserve`)
MIN_CONTEXT = 512


def import_llama_cpp():
    """The ``llama_cpp`` module, or None when llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def resolved_weights(weights: str, dtype: torch.dtype) -> str:
    """``weights`` with ``auto`` read as the run's dtype (``bf16`` for bfloat16, else ``f32``)."""
    if weights != "auto":
        return weights
    return "bf16" if dtype == torch.bfloat16 else "f32"


def weights_bytes(weights: str, params: int, source_bytes: int | None = None) -> int:
    """Bytes of llama.cpp's weights of a model of ``params`` parameters (its mapped file): 4, 2, 34/32,
    18/32 or about 4.85/8 bytes a parameter (Q4_K_M mixes Q4_K and Q6_K blocks), or the source file's
    own size (``source_bytes``; ``source`` weights)."""
    per = {"f32": 4.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_k_m": 4.85 / 8}
    if weights == "source":
        return int(source_bytes or params * 4)
    return int(params * per[weights])


def context_length(length: int) -> int:
    """The positions of the llama.cpp context a generation of ``length`` positions gets: the next power
    of two from :data:`MIN_CONTEXT` (so a few sizes serve every prompt, and the memory estimate knows it)."""
    n_ctx = MIN_CONTEXT
    while n_ctx < length:
        n_ctx *= 2
    return n_ctx


def weights_file(model, tokenizer, weights: str, threads: int) -> Path:
    """The GGUF file llama.cpp reads for ``weights`` (resolved: not ``auto``), made once (module docstring):
    from the file ``model`` was read from (``model.gguf_source``) where there is one, else from the loaded
    weights written as GGUF (Llama models only: :class:`~selfspec.models.gguf_export.ExportUnsupported`
    otherwise)."""
    from selfspec.models.gguf_export import cached_gguf, gguf_path

    source = model.gguf_source
    if weights == "source":
        if source is None:
            raise ValueError(f"method.weights=source: {model.name} was not read from a GGUF file; "
                             "pick f32, bf16, q8_0, q4_0 or q4_k_m")
        return Path(source)
    if source is None:
        source = cached_gguf(model, tokenizer)
    if model.weights_digest is None:
        raise ValueError(f"{model.name} has no weights digest to name its llama.cpp file by")
    path = gguf_path(model, weights)  # the written file itself where weights is its dtype
    if not path.is_file():
        quantise_file(Path(source), path, weights, threads)
    return path


def quantise_file(source: Path, path: Path, weights: str, threads: int) -> None:
    """``source`` through llama.cpp's quantiser into ``path`` as ``weights`` (:data:`FTYPES`), requantising
    a quantised source from its dequantised values; written under a temporary name and renamed into place."""
    llama_cpp = import_llama_cpp()
    if llama_cpp is None:
        raise ImportError(NOT_INSTALLED)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_{FTYPES[weights]}")
    params.nthread = int(threads)
    params.allow_requantize = True
    try:
        log.info("llama.cpp: quantising %s into %s (%s)", source, path, weights)
        t0 = time.perf_counter()
        rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
        if rc != 0 or not tmp.is_file():
            raise RuntimeError(f"llama.cpp could not quantise {source} to {weights} (llama_model_quantize: {rc})")
        os.replace(tmp, path)
        log.info("llama.cpp: %s written in %.1f s", path.name, time.perf_counter() - t0)
    finally:
        tmp.unlink(missing_ok=True)


class LlamaCpp(Decoder):
    """Greedy decoding of the loaded model in llama.cpp, behind selfspec's ``generate``."""

    name = "llama_cpp"
    title = "llama.cpp"
    #: its own arithmetic (and, quantised, its own weights): consistency with vanilla is measured, not promised
    lossless = False
    own_loop = False
    batches = False
    samples: ClassVar[bool] = False

    @dataclass(frozen=True)
    class Options(Options):
        """Keys (conf/method/llama_cpp.yaml): ``weights``, what llama.cpp reads (:data:`WEIGHTS`)."""

        weights: str = key(checks.choice, WEIGHTS, why="auto = the run's dtype; q8_0/q4_0/q4_k_m: llama.cpp's "
                           "quantiser; source: the GGUF file the model was read from")

    def __init__(self, model, weights: str = "auto", threads: int | None = None, **common) -> None:
        super().__init__(model, **common)
        llama_cpp = import_llama_cpp()
        if llama_cpp is None:
            raise ImportError(NOT_INSTALLED)
        self.lib = llama_cpp
        self.version = getattr(llama_cpp, "__version__", "unknown")
        self.n_threads = int(threads or torch.get_num_threads())
        self.weights = resolved_weights(weights, model.dtype)
        self.path = weights_file(model, self.tokenizer, self.weights, self.n_threads)
        self.kv_type = GGML_TYPE_BF16 if model.dtype == torch.bfloat16 else llama_cpp.GGML_TYPE_F32
        self.llm = None
        self.n_ctx = 0
        self.n_vocab = 0

    @classmethod
    def from_config(cls, model, options: Options, **common) -> "LlamaCpp":
        return cls(model, options.weights, **common)

    def reserve(self, length: int) -> None:
        """A llama.cpp context of at least ``length`` positions (:func:`context_length`), made before
        anything is timed; a longer generation makes a larger one."""
        if length <= self.n_ctx:
            return
        n_ctx = context_length(length)
        if self.llm is not None:
            self.llm.close()
        self.llm = self.lib.Llama(
            model_path=str(self.path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=self.n_threads,
            n_threads_batch=self.n_threads, type_k=self.kv_type, type_v=self.kv_type, logits_all=False,
            verbose=False)
        self.n_ctx = n_ctx
        self.n_vocab = int(self.llm.n_vocab())

    def _argmax(self) -> int:
        """The greedy token: the argmax of the last evaluated position's logits, read in place."""
        logits = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                 sampling: Sampling | None = None) -> Generation:
        """Up to ``max_new_tokens`` greedy tokens after ``prompt_ids`` (evaluated as given: no BOS is
        added), cut at EOS, stop strings and the budget; timed from the prefill to the last token."""
        prompt_t, n_prompt, sampling = self.generation_inputs(prompt_ids, max_new_tokens, sampling)
        if not sampling.greedy:
            raise ValueError("method llama_cpp decodes greedily only (sampling.temperature=0)")
        prompt = prompt_t[0].tolist()
        self.reserve(n_prompt + max_new_tokens + 1)
        state = DecodeState(list(prompt), n_prompt, cache=None, sampling=sampling, generator=None)
        t0 = time.perf_counter()
        self.llm.reset()
        self.llm.eval(prompt)
        reason = self._commit(state, [self._argmax()], max_new_tokens)
        self.begin_example(prompt)
        while reason is None:
            state.trace_step = StepTrace()
            state.drafted = 0
            reason = self._commit(state, self.next_tokens(state, max_new_tokens - (len(state.tokens) - n_prompt)),
                                  max_new_tokens)
        seconds = time.perf_counter() - t0
        steps = len(state.accepted_per_step)
        return Generation(tokens=state.tokens[n_prompt:], prompt_len=n_prompt, seconds=seconds, steps=steps,
                          accepted_per_step=state.accepted_per_step, drafted_per_step=state.drafted_per_step,
                          stop_reason=reason, stats={"forward_passes": steps},
                          verified_per_step=state.verified_per_step)

    def begin_example(self, prompt: list[int]) -> None:
        """After the prompt's step, before the first decoding step (plain llama.cpp: nothing)."""

    def next_tokens(self, state: DecodeState, budget: int) -> list[int]:
        """One step after the committed ``state.tokens`` (the last of them not yet evaluated): one
        ``llama_decode`` of that token and its argmax."""
        self.llm.eval(state.tokens[-1:])
        return [self._argmax()]

    def step(self, state: DecodeState, budget: int) -> list[int]:  # pragma: no cover
        raise NotImplementedError("llama_cpp decodes through llama.cpp")

    def close(self) -> None:
        """Free llama.cpp's model and context."""
        if self.llm is not None:
            self.llm.close()
            self.llm, self.n_ctx = None, 0


def draft_file(name: str) -> Path:
    """The GGUF file of model config ``name`` (conf/model/), as shipped: a speculative peer's draft, read
    without loading the model into torch; a model whose weights are no GGUF file is refused, naming the key."""
    from selfspec.config import model_config
    from selfspec.models.loading import local_gguf, model_source

    source = model_source(model_config(name))
    if source.kind not in ("gguf", "hub_gguf", "asset"):
        raise checks.ConfigError(f"method.draft={name}: its weights are not a GGUF file ({source.key}={source.where}); "
                                 "llama.cpp drafts with a model read from one (model.gguf_path or a packaged asset)")
    return local_gguf(source)


class LlamaCppSpeculative(LlamaCpp):
    """llama.cpp's greedy speculative decoding with a separate draft model (module docstring)."""

    name = "llama_cpp_speculative"
    title = "llama.cpp, draft model"

    @dataclass(frozen=True)
    class Options(LlamaCpp.Options):
        """Keys (conf/method/llama_cpp_speculative.yaml): ``weights`` (the target's, :data:`WEIGHTS`),
        ``draft`` (the draft's model config name), ``max_draft`` (llama.cpp's ``--draft-max``), ``draft_min``
        (``--draft-min``) and ``draft_p_min`` (``--draft-p-min``)."""

        draft: str = key(draft_model_option)
        max_draft: int = key(checks.integer, 1, why="most drafts a step (llama.cpp's --draft-max)")
        draft_min: int = key(checks.integer, 0, Ref("max_draft"),
                             why="a shorter draft is dropped (llama.cpp's --draft-min), at most max_draft={max_draft}")
        draft_p_min: float = key(checks.probability, why="drafting stops at a token whose probability among the "
                                 "draft's 10 best is below it (llama.cpp's --draft-p-min)")

    @classmethod
    def models_read(cls, options: Options) -> tuple[str, ...]:
        return (options.draft,)

    @classmethod
    def check_run(cls, options: Options, layers: int, budget: int | None = None) -> None:
        """The draft's GGUF file is there (a model whose weights are no GGUF file, or an asset not fetched, is
        refused before the target loads)."""
        draft_file(options.draft)

    def __init__(self, model, weights: str = "auto", threads: int | None = None, *, draft: str,
                 max_draft: int = 16, draft_min: int = 0, draft_p_min: float = 0.75, **common) -> None:
        super().__init__(model, weights, threads, **common)
        self.draft_name = draft
        self.draft_path = draft_file(draft)
        self.max_draft, self.draft_min, self.draft_p_min = int(max_draft), int(draft_min), float(draft_p_min)
        self.dllm = None

    @classmethod
    def from_config(cls, model, options: Options, **common) -> "LlamaCppSpeculative":
        return cls(model, options.weights, draft=options.draft, max_draft=options.max_draft,
                   draft_min=options.draft_min, draft_p_min=options.draft_p_min, **common)

    def reserve(self, length: int) -> None:
        """The target's context (:meth:`LlamaCpp.reserve`) and the draft's, as long, its weights as
        shipped; a draft whose vocabulary is not the target's is refused."""
        grown = length > self.n_ctx
        super().reserve(length + self.max_draft)
        if not grown and self.dllm is not None:
            return
        if self.dllm is not None:
            self.dllm.close()
        self.dllm = self.lib.Llama(
            model_path=str(self.draft_path), n_ctx=self.n_ctx, n_batch=self.n_ctx, n_ubatch=self.n_ctx,
            n_threads=self.n_threads, n_threads_batch=self.n_threads, type_k=self.kv_type, type_v=self.kv_type,
            logits_all=False, verbose=False)
        probe = b"def add(a, b):\n    return a + b  # The quick brown fox"
        if (int(self.dllm.n_vocab()) != self.n_vocab
                or self.dllm.tokenize(probe, add_bos=False) != self.llm.tokenize(probe, add_bos=False)):
            self.dllm.close()
            self.dllm = None
            raise ValueError(f"method.draft={self.draft_name}: its vocabulary is not {self.model.name}'s "
                             f"({self.draft_path}); a draft model must share the target's tokenizer")

    @staticmethod
    def _decode(llm, tokens: list[int], every_row: bool) -> None:
        """Evaluate ``tokens`` after the first ``llm.n_tokens`` positions (the cache cut there first), with
        every row's logits (``every_row``) or the last's, as ``Llama.eval`` does one batch."""
        llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens, -1)
        llm._batch.set_batch(batch=tokens, n_past=llm.n_tokens, logits_all=every_row)
        llm._ctx.decode(llm._batch)
        llm.input_ids[llm.n_tokens : llm.n_tokens + len(tokens)] = tokens
        llm.n_tokens += len(tokens)

    def _draft_top(self) -> tuple[int, float]:
        """The draft's greedy token and its probability among its 10 best logits (llama.cpp's draft sampler)."""
        row = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.dllm.ctx, -1), shape=(self.n_vocab,))
        best = np.argpartition(row, -10)[-10:]
        top = row[best].astype(np.float64)
        return int(best[top.argmax()]), float(1.0 / np.exp(top - top.max()).sum())

    def begin_example(self, prompt: list[int]) -> None:
        """The draft's context starts empty: its first step evaluates the prompt (timed, as llama.cpp's)."""
        self.dllm.reset()

    def next_tokens(self, state: DecodeState, budget: int) -> list[int]:
        """One round of ``llama-speculative-simple`` (module docstring); ``state.drafted`` the drafts."""
        committed = state.tokens
        d, n_old = self.dllm, self.dllm.n_tokens
        ids = np.asarray(committed[: len(committed) - 1], dtype=d.input_ids.dtype)
        same = np.flatnonzero(d.input_ids[: min(n_old, len(ids))] != ids[: min(n_old, len(ids))])
        d.n_tokens = int(same[0]) if same.size else min(n_old, len(ids))  # the longest prefix it shares
        self._decode(d, committed[d.n_tokens :], every_row=False)
        drafts: list[int] = []
        room = min(self.max_draft, budget - 1)
        while len(drafts) < room:
            token, p = self._draft_top()
            if p < self.draft_p_min:
                break
            drafts.append(token)
            if len(drafts) < room:
                self._decode(d, [token], every_row=False)
        if len(drafts) < self.draft_min:
            drafts = []
        state.drafted = len(drafts)
        llm, n0 = self.llm, self.llm.n_tokens
        self._decode(llm, [committed[-1], *drafts], every_row=True)
        rows = np.ctypeslib.as_array(self.lib.llama_get_logits(llm.ctx), shape=(len(drafts) + 1, self.n_vocab))
        target = rows.argmax(axis=1)
        accepted = 0
        while accepted < len(drafts) and int(target[accepted]) == drafts[accepted]:
            accepted += 1
        llm.n_tokens = n0 + 1 + accepted  # the cache is cut after the accepted drafts at the next decode
        return [*drafts[:accepted], int(target[accepted])]

    def close(self) -> None:
        super().close()
        if self.dllm is not None:
            self.dllm.close()
            self.dllm = None


__all__ = ["FTYPES", "LlamaCpp", "LlamaCppSpeculative", "draft_file", "context_length", "NOT_INSTALLED", "WEIGHTS", "import_llama_cpp", "quantise_file", "resolved_weights",
           "weights_bytes", "weights_file"]

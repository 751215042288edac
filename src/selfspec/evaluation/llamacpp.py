"""llama.cpp as a measured peer of the runtime benchmark (the optional extra: ``make llamacpp``).

:class:`LlamaCppPeer` runs the loaded model's own weights, written once as a GGUF file
(:func:`selfspec.models.gguf_export.cached_gguf`: float32, or BF16 for a bfloat16 model), through
llama-cpp-python, greedily, with a KV cache of the model's dtype (F32 or BF16) and torch's thread count, and answers :meth:`generate` like selfspec's decoders,
so :func:`selfspec.evaluation.runtime.decode_rates` times it interleaved with vanilla and
transformers ``generate`` on the same prompt ids (evaluated as given: no BOS is added).

Each decoding step is one ``llama_decode`` of the last token and an argmax over the logits
llama.cpp leaves in its buffer (read in place), as vanilla's step is one forward and an argmax.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch

from selfspec.decoding.base import Generation
from selfspec.decoding.sampling import Sampling

#: what the benchmark prints when the extra is absent
NOT_INSTALLED = "llama.cpp: skipped (llama-cpp-python not installed; `make llamacpp`)"


def import_llama_cpp():
    """The ``llama_cpp`` module, or None when llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


class LlamaCppPeer:
    """Greedy decoding of ``loaded`` in llama.cpp, behind selfspec's ``generate`` interface.

    ``n_ctx`` is the longest prompt plus new tokens it will see; a prompt of up to ``n_ctx``
    tokens is evaluated in one batch, as selfspec's prefill is one forward."""

    name = "llama_cpp"

    def __init__(self, loaded, n_ctx: int, threads: int | None = None) -> None:
        from selfspec.models.gguf_export import cached_gguf

        llama_cpp = import_llama_cpp()
        if llama_cpp is None:
            raise ImportError(NOT_INSTALLED)
        self.lib = llama_cpp
        self.path = cached_gguf(loaded)
        self.threads = int(threads or torch.get_num_threads())
        # ggml numbers BF16 30 (llama-cpp-python 0.3.36 exports no constant for it)
        #: the weights' and the KV cache's type in llama.cpp: the loaded model's dtype
        self.weights = "bfloat16" if loaded.model.dtype == torch.bfloat16 else "float32"
        kv = getattr(llama_cpp, "GGML_TYPE_BF16", 30) if self.weights == "bfloat16" else llama_cpp.GGML_TYPE_F32
        self.llm = llama_cpp.Llama(
            model_path=str(self.path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=self.threads,
            n_threads_batch=self.threads, type_k=kv, type_v=kv, logits_all=False, verbose=False)
        self.n_vocab = int(self.llm.n_vocab())
        self.version = getattr(llama_cpp, "__version__", "unknown")

    def _argmax(self) -> int:
        """The greedy token: the argmax of the last evaluated position's logits, read in place."""
        logits = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def generate(self, prompt_ids: Sequence[int] | torch.Tensor, max_new_tokens: int,
                 sampling: Sampling | None = None) -> Generation:
        """``max_new_tokens`` greedy tokens after ``prompt_ids`` (no EOS stop: the benchmark's
        runs have a fixed length), timed from the prefill to the last token."""
        if sampling is not None and not sampling.greedy:
            raise ValueError("the llama.cpp peer decodes greedily only")
        prompt = [int(t) for t in (prompt_ids.reshape(-1).tolist() if torch.is_tensor(prompt_ids) else prompt_ids)]
        t0 = time.perf_counter()
        self.llm.reset()
        self.llm.eval(prompt)
        tokens = [self._argmax()]
        while len(tokens) < max_new_tokens:
            self.llm.eval(tokens[-1:])
            tokens.append(self._argmax())
        seconds = time.perf_counter() - t0
        n = len(tokens)
        return Generation(tokens=tokens, prompt_len=len(prompt), seconds=seconds, steps=n,
                          accepted_per_step=[1] * n, drafted_per_step=[0] * n, stop_reason="length")

    def close(self) -> None:
        """Free llama.cpp's model and context."""
        self.llm.close()

"""The runtime benchmark: how close the shared runtime is to what the machine allows.

``make bench-runtime`` (``scripts/bench_runtime.py``) prints, for one model on one device:

* ``v(k)`` = t(forward of k new tokens, head on each) / t(one token), at a few context lengths
  (:func:`selfspec.models.costs.measure_curve`): a speculative method must commit more than
  ``v(k)`` tokens per verification pass of k tokens to beat plain decoding;
* prefill tokens/s;
* vanilla's and transformers ``generate``'s decoding tokens/s on the same prompt and their ratio
  (both timed by their decoders, interleaved; the prompt's prefill taken out, :func:`decode_rates`);
* the LM head's share of a decoding step;
* achieved memory bandwidth, following gpt-fast: (weight bytes read per token, a tied head once,
  plus the KV cache bytes read) / seconds per token, as a fraction of a large copy's bandwidth
  measured in the same process.

Every figure is a ratio or a median from one process, so it can be compared across runs on a
noisy machine only as ratios; ``load`` records the 1-minute load average at the start and end.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from selfspec.models.costs import context_cache, measure_bandwidth, measure_curve, time_forward, weight_bytes

__all__ = ["format_report", "runtime_report"]


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - platforms without getloadavg
        return None


def decode_rates(loaded, context: int, new_tokens: int, repeats: int) -> dict[str, float]:
    """Median decoding tokens/s of vanilla and transformers ``generate`` on one random prompt of
    ``context`` tokens, interleaved per repeat.

    Decoding only: each repeat generates ``new_tokens`` (no EOS) and, right after, 1 token, and the
    rate is ``(new_tokens - 1) / (t(new_tokens) - t(1))``, so the prefill of the prompt and the first
    token (in both runs) cancel. With a 512-token prompt the prefill is about as long as 20 decoding
    steps, so a rate over the whole call would understate both decoders and the bandwidth."""
    from selfspec.decoding import Sampling
    from selfspec.decoding.peers import HFPeer
    from selfspec.decoding.vanilla import Vanilla

    if new_tokens < 2:
        raise ValueError(f"decoding rates need at least 2 new tokens, got {new_tokens}")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, loaded.model.vocab_size, (context,), generator=g).tolist()
    decoders = {"vanilla": Vanilla(loaded.model), "hf_generate": HFPeer(loaded.model)}
    rates: dict[str, list[float]] = {name: [] for name in decoders}
    tokens: dict[str, list[int]] = {}
    for i in range(repeats + 1):
        for name, dec in decoders.items():
            gen = dec.generate(prompt, new_tokens, Sampling())
            first = dec.generate(prompt, 1, Sampling())
            tokens[name] = gen.tokens
            if i:  # the first round warms up
                rates[name].append((gen.new_tokens - first.new_tokens) / max(gen.seconds - first.seconds, 1e-9))
    out = {name: statistics.median(r) for name, r in rates.items()}
    out["same_tokens"] = tokens["vanilla"] == tokens["hf_generate"]
    return out


def runtime_report(loaded, ks=(1, 2, 4, 8, 16, 32), contexts=(128, 512, 1024), new_tokens: int = 32,
                   repeats: int = 7) -> dict[str, Any]:
    """All figures of the runtime benchmark for ``loaded`` (a :class:`~selfspec.models.loading.LoadedModel`)."""
    model = loaded.model
    contexts = tuple(c for c in contexts if c + max(ks) + new_tokens < model.max_context)
    load_start = _load()
    t0 = time.perf_counter()
    curve = measure_curve(model, ks, contexts, repeats)
    main_ctx = 512 if 512 in contexts else contexts[-1]
    empty = context_cache(model, 0, main_ctx)
    prefill = time_forward(model, empty, 0, main_ctx, repeats=max(1, repeats // 2), logits_rows=1)
    rates = decode_rates(loaded, main_ctx, new_tokens, max(1, repeats // 2))
    bandwidth = measure_bandwidth(model.device)
    weights = weight_bytes(model)
    kv = 2 * model.num_layers * model.num_kv_heads * model.head_dim * main_ctx * model.lm_head_weight.element_size()
    per_token = 1.0 / rates["vanilla"]
    return {
        "model": loaded.name,
        "device": str(model.device),
        "dtype": str(model.dtype).replace("torch.", ""),
        "linear_kernel": model.linear_kernel,
        "capture": model.capture,
        "threads": torch.get_num_threads(),
        "curve": curve.to_dict(),
        "v": {c: {k: curve.v(k, c) for k in ks} for c in contexts},
        "context": main_ctx,
        "prefill_tokens_per_s": main_ctx / prefill,
        "vanilla_tokens_per_s": rates["vanilla"],
        "generate_tokens_per_s": rates["hf_generate"],
        "vanilla_over_generate": rates["vanilla"] / rates["hf_generate"],
        "same_tokens_as_generate": rates["same_tokens"],
        "head_share_of_step": curve.head / curve.seconds[contexts[0]][1],
        "head_in_layers": curve.head_in_layers,
        "weight_bytes": weights,
        "kv_bytes": kv,
        "bandwidth_bytes_per_s": bandwidth,
        "achieved_bytes_per_s": (weights + kv) / per_token,
        "bandwidth_fraction": (weights + kv) / per_token / bandwidth,
        "seconds": time.perf_counter() - t0,
        "load": [load_start, _load()],
    }


def format_report(r: dict[str, Any]) -> str:
    """The report as the console table ``make bench-runtime`` prints."""
    ks = list(next(iter(r["v"].values())))
    lines = [f"model {r['model']}  {r['device']} {r['dtype']}  linear kernel {r['linear_kernel']}  "
             f"capture {r.get('capture', 'off')}  "
             f"threads {r['threads']}  load {r['load'][0]} -> {r['load'][1]}",
             "v(k) = forward of k new tokens / one token (head on every token)",
             f"{'context':>8} " + "".join(f"{'k=' + str(k):>8}" for k in ks) + f"{'t(1) ms':>10}"]
    for c, row in r["v"].items():
        t1 = r["curve"]["seconds"][str(c)]["1"] * 1e3
        lines.append(f"{c:>8} " + "".join(f"{row[k]:>8.2f}" for k in ks) + f"{t1:>10.1f}")
    lines += [
        f"prefill ({r['context']} tokens): {r['prefill_tokens_per_s']:.0f} tokens/s",
        f"decode at context {r['context']} (prefill excluded): vanilla {r['vanilla_tokens_per_s']:.2f} tok/s, transformers generate "
        f"{r['generate_tokens_per_s']:.2f} tok/s, ratio {r['vanilla_over_generate']:.3f}"
        f"{'' if r['same_tokens_as_generate'] else '  (TOKENS DIFFER)'}",
        f"LM head: {100 * r['head_share_of_step']:.1f}% of a step ({r['head_in_layers']:.1f} layers)",
        f"bandwidth: {r['achieved_bytes_per_s'] / 1e9:.2f} GB/s achieved ({(r['weight_bytes'] + r['kv_bytes']) / 1e6:.0f} MB "
        f"per token) of {r['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s measured (copy): {100 * r['bandwidth_fraction']:.1f}%",
        f"({r['seconds']:.0f} s)",
    ]
    return "\n".join(lines)

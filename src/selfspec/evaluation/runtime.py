"""The runtime benchmark: how close the shared runtime is to what the machine allows.

``make bench-runtime`` (``scripts/bench_runtime.py``) prints, for one model on one device:

* ``v(k)`` = t(forward of k new tokens, head on each) / t(one token), at a few context lengths
  (:func:`selfspec.measure.costs.measure_curve`): a speculative method must commit more than
  ``v(k)`` tokens per verification pass of k tokens to beat plain decoding;
* prefill tokens/s;
* vanilla's and transformers ``generate``'s decoding tokens/s on the same prompt and their ratio
  (both timed by their decoders, interleaved; the prompt's prefill taken out, :func:`decode_rates`);
  each peer's ratio to vanilla is the median of per-repeat ratios, each from two runs a moment
  apart, in an order that alternates, so a ratio is never two moments of a noisy machine;
* llama.cpp as a third peer when llama-cpp-python is installed (the optional extra, ``make
  llamacpp``; otherwise one line says it was skipped): the loaded model's own weights written as a
  GGUF file (float32, or BF16 for a bfloat16 model), the same prompt ids, threads and differencing
  (:class:`selfspec.decoding.llamacpp.LlamaCpp`, ``weights=auto``);
  for each peer its decoding and prefill (time to the first token) tokens/s, its share of the copy
  bandwidth, and how many of its tokens agree with vanilla's;
* the LM head's share of a decoding step;
* achieved memory bandwidth, following gpt-fast: (weight bytes read per token, a tied head once,
  plus the KV cache bytes read) / seconds per token, as a fraction of the rate at which this
  machine reads a buffer of that size, measured in the same process
  (:func:`~selfspec.measure.costs.measure_bandwidth`: a roof that a working set held partly in the
  last-level cache cannot exceed, as it could a large copy's bandwidth).

Every figure is a ratio or a median from one process, so it can be compared across runs on a
noisy machine only as ratios; ``load`` records the 1-minute load average at the start and end.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from selfspec.evaluation.aggregate import common_prefix
from selfspec.measure.costs import context_cache, measure_bandwidth, measure_curve, time_forward, weight_bytes
from selfspec.models import arena

__all__ = ["format_report", "runtime_report"]


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - platforms without getloadavg
        return None


def decode_rates(loaded, context: int, new_tokens: int, repeats: int,
                 peers: dict[str, Any] | None = None) -> dict[str, Any]:
    """Median decoding tokens/s of vanilla, transformers ``generate`` and any other ``peers``
    (name -> an object with selfspec's ``generate``, e.g. :class:`~selfspec.decoding.llamacpp.LlamaCpp`)
    on one random prompt of ``context`` tokens, interleaved per repeat.

    Decoding only: each repeat generates ``new_tokens`` (no EOS) and, right after, 1 token, and the
    rate is ``(new_tokens - 1) / (t(new_tokens) - t(1))``, so the prefill of the prompt and the first
    token (in both runs) cancel. With a 512-token prompt the prefill is about as long as 20 decoding
    steps, so a rate over the whole call would understate both decoders and the bandwidth.

    Each repeat runs the decoders one after the other, in the reverse order on every other repeat,
    and ``ratio`` (name -> median over repeats of its rate over vanilla's in that repeat) and
    ``ratio_range`` (name -> the least and greatest of them) pair runs a moment apart.

    Besides the rates by name: ``prefill`` (name -> ``context`` / median t(1), the time to the first
    token), ``ratio``, ``ratio_range``, ``agreement`` (name -> how many of its first tokens equal vanilla's), ``same_tokens``
    (vanilla's and ``generate``'s tokens are equal) and ``new_tokens``."""
    from selfspec.decoding import Sampling
    from selfspec.decoding.peers import HFPeer
    from selfspec.decoding.vanilla import Vanilla

    if new_tokens < 2:
        raise ValueError(f"decoding rates need at least 2 new tokens, got {new_tokens}")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, loaded.model.vocab_size, (context,), generator=g).tolist()
    decoders = {"vanilla": Vanilla(loaded.model), "hf_generate": HFPeer(loaded.model), **(peers or {})}
    rates: dict[str, list[float]] = {name: [] for name in decoders}
    firsts: dict[str, list[float]] = {name: [] for name in decoders}
    tokens: dict[str, list[int]] = {}
    order = list(decoders)
    for i in range(repeats + 1):
        for name in order if i % 2 else order[::-1]:
            dec = decoders[name]
            gen = dec.generate(prompt, new_tokens, Sampling())
            first = dec.generate(prompt, 1, Sampling())
            tokens[name] = gen.tokens
            if i:  # the first round warms up
                rates[name].append((gen.new_tokens - first.new_tokens) / max(gen.seconds - first.seconds, 1e-9))
                firsts[name].append(first.seconds)
    out: dict[str, Any] = {name: statistics.median(r) for name, r in rates.items()}
    paired = {name: [a / b for a, b in zip(r, rates["vanilla"])] for name, r in rates.items()}
    out["ratio"] = {name: statistics.median(r) for name, r in paired.items()}
    out["ratio_range"] = {name: [min(r), max(r)] for name, r in paired.items()}
    out["prefill"] = {name: context / max(statistics.median(t), 1e-9) for name, t in firsts.items()}
    out["agreement"] = {name: common_prefix(tokens["vanilla"], toks) for name, toks in tokens.items()}
    out["same_tokens"] = tokens["vanilla"] == tokens["hf_generate"]
    out["new_tokens"] = new_tokens
    return out


def llama_cpp_peer(loaded, n_ctx: int) -> tuple[Any, str | None]:
    """The llama.cpp peer for ``loaded`` at ``n_ctx`` tokens on torch's threads, or None and the
    one line the report prints instead (not installed, a model the GGUF writer does not cover, or
    llama.cpp refusing the file, with its message: the other peers are still measured)."""
    from selfspec.decoding.llamacpp import NOT_INSTALLED, LlamaCpp, import_llama_cpp
    from selfspec.models.gguf_export import ExportUnsupported

    if import_llama_cpp() is None:
        return None, NOT_INSTALLED
    try:
        peer = LlamaCpp(loaded.model, tokenizer=loaded.tokenizer, threads=torch.get_num_threads())
        peer.reserve(n_ctx)
        return peer, None
    except ExportUnsupported as err:
        return None, f"llama.cpp: skipped ({err})"
    except (ValueError, RuntimeError) as err:
        return None, f"llama.cpp: FAILED to load the GGUF file of {loaded.name} ({type(err).__name__}: {err})"


def peer_figures(rates: dict[str, Any], name: str, moved_bytes: int, bandwidth: float) -> dict[str, Any]:
    """One peer's figures: decode and prefill tokens/s, its decode rate over vanilla's (the median
    of paired repeats, and their range), the bytes per token it moves (weights and KV cache) per
    second as a share of the read roof, and its agreement with vanilla."""
    return {
        "decode_tokens_per_s": rates[name],
        "over_vanilla": rates["ratio"][name],
        "over_vanilla_range": rates["ratio_range"][name],
        "prefill_tokens_per_s": rates["prefill"][name],
        "bandwidth_fraction": moved_bytes * rates[name] / bandwidth,
        "same_tokens": rates["agreement"][name] == rates["new_tokens"],
        "agreement": rates["agreement"][name],
    }


def runtime_report(loaded, ks=(1, 2, 4, 8, 16, 32), contexts=(128, 512, 1024), new_tokens: int = 32,
                   repeats: int = 7, llama_cpp: bool = True) -> dict[str, Any]:
    """All figures of the runtime benchmark for ``loaded`` (a :class:`~selfspec.models.loading.LoadedModel`);
    ``llama_cpp``: add llama.cpp as a peer when llama-cpp-python is installed."""
    model = loaded.model
    contexts = tuple(c for c in contexts if c + max(ks) + new_tokens < model.max_context)
    load_start = _load()
    t0 = time.perf_counter()
    curve = measure_curve(model, ks, contexts, repeats)
    main_ctx = 512 if 512 in contexts else contexts[-1]
    empty = context_cache(model, 0, main_ctx)
    prefill = time_forward(model, empty, 0, main_ctx, repeats=max(1, repeats // 2), logits_rows=1)
    peer, skipped = llama_cpp_peer(loaded, main_ctx + new_tokens + 1) if llama_cpp else (None, None)
    try:
        rates = decode_rates(loaded, main_ctx, new_tokens, max(1, repeats // 2),
                             {"llama_cpp": peer} if peer is not None else None)
    finally:
        if peer is not None:
            peer.close()
    weights = weight_bytes(model)
    kv = 2 * model.num_layers * model.num_kv_heads * model.head_dim * main_ctx * model.lm_head_weight.element_size()
    bandwidth = measure_bandwidth(model.device, weights + kv)
    per_token = 1.0 / rates["vanilla"]
    names = ["vanilla", "hf_generate"] + (["llama_cpp"] if peer is not None else [])
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
        "vanilla_over_generate": 1.0 / rates["ratio"]["hf_generate"],
        "same_tokens_as_generate": rates["same_tokens"],
        "head_share_of_step": curve.head / curve.seconds[contexts[0]][1],
        "head_in_layers": curve.head_in_layers,
        "weight_bytes": weights,
        "weights_in_huge_pages": huge_page_weight_bytes(model),
        "transparent_huge_pages": arena.thp_mode(),
        "kv_bytes": kv,
        "bandwidth_bytes_per_s": bandwidth,
        "achieved_bytes_per_s": (weights + kv) / per_token,
        "bandwidth_fraction": (weights + kv) / per_token / bandwidth,
        "peers": {name: peer_figures(rates, name, weights + kv, bandwidth) for name in names},
        "llama_cpp": ({"version": peer.version, "gguf": str(peer.path), "threads": peer.n_threads,
                       "weights": peer.weights,
                       "kv_dtype": str(loaded.model.dtype).replace("torch.", "")} if peer is not None else {"skipped": skipped}),
        "new_tokens": new_tokens,
        "seconds": time.perf_counter() - t0,
        "load": [load_start, _load()],
    }


def huge_page_weight_bytes(model) -> int | None:
    """Bytes of the block holding the model's placed weights that the kernel backs with huge pages
    (:mod:`selfspec.models.arena`), or None when the weights were not placed."""
    return arena.huge_page_bytes(model.lm_head_weight) if model.weights_placed else None


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
        f"LM head: {100 * r['head_share_of_step']:.1f}% of a step ("
        + (f"{r['head_in_layers']:.1f} layers)" if r.get("head_in_layers") is not None else
           "a layer's cost not resolved: the head alone took a whole step)"),
        f"bandwidth: {r['achieved_bytes_per_s'] / 1e9:.2f} GB/s achieved ({(r['weight_bytes'] + r['kv_bytes']) / 1e6:.0f} MB "
        f"per token) of {r['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s reading a buffer of that size here: "
        f"{100 * r['bandwidth_fraction']:.1f}%",
    ]
    huge = r.get("weights_in_huge_pages")
    lines.append("weights in huge pages: " + ("not placed (selfspec.models.arena)" if huge is None else
                                              f"{huge / 1e6:.0f} MB (transparent huge pages: {r.get('transparent_huge_pages')})"))
    lines += peer_lines(r)
    lines.append(f"({r['seconds']:.0f} s)")
    return "\n".join(lines)


def peer_lines(r: dict[str, Any]) -> list[str]:
    """The peers side by side (decode and prefill tokens/s, share of the read roof, tokens
    equal to vanilla's), and the line saying why llama.cpp is absent when it is."""
    peers = r.get("peers") or {}
    lines = []
    if peers:
        n = r["new_tokens"]
        lines += [f"peers at context {r['context']}, {r['threads']} threads, interleaved (x vanilla = median of "
                  "paired repeats [least, greatest]; prefill = time to the first token; bandwidth = share of the "
                  "read roof)",
                  f"  {'peer':<12}{'decode tok/s':>14}{'x vanilla':>24}{'prefill tok/s':>15}{'bandwidth':>11}"
                  "  tokens = vanilla's"]
        for name, p in peers.items():
            agree = "reference" if name == "vanilla" else f"{p['agreement']}/{n}" + ("" if p["same_tokens"] else " DIFFER")
            lo, hi = p.get("over_vanilla_range") or (float("nan"), float("nan"))
            ratio = f"{p.get('over_vanilla', float('nan')):.3f} [{lo:.2f}, {hi:.2f}]"
            lines.append(f"  {name:<12}{p['decode_tokens_per_s']:>14.2f}{ratio:>24}{p['prefill_tokens_per_s']:>15.0f}"
                         f"{100 * p['bandwidth_fraction']:>10.1f}%  {agree}")
    info = r.get("llama_cpp") or {}
    if info.get("skipped"):
        lines.append(info["skipped"])
    elif "version" in info:
        lines.append(f"llama.cpp: llama-cpp-python {info['version']}, {info.get('weights', 'float32')} GGUF written from the loaded weights "
                     f"({info['gguf']}), {info.get('kv_dtype', 'float32')} KV cache")
    return lines

"""One command for a GPU machine, built for one try of 15 minutes: cost profiles and the ledger of
every method first, then every method captured and eager, the runtime, training memory, evaluations.

    python scripts/gpu_check.py                  # on a GPU (make gpu-check): at most --budget seconds (300)
    python scripts/gpu_check.py --budget 600     # more of the check (the estimate printed first says what fits)
    python scripts/gpu_check.py --sections profile,ledger   # only these (in the check's order)
    python scripts/gpu_check.py --dry-run        # the same code on tiny-random on the CPU (capture=static)

A GPU for checking this project is lent for 15 minutes at a time, machine start included, and often
once. So the check:

* runs in **order of value**: the Llama-3-8B shape's cost profile and ledger (measured against
  predicted seconds of every method), then SmolLM2's, then every method captured and eager, the
  ledger at a second shape, the runtime benchmark, the training jobs' memory, the evaluations, and
  last Gemma 3 270M's shape's profile (for projecting Gemma 3's CPU traces);
* **prints an estimate** of each step's seconds on an H100 before it starts, and what ``--budget``
  reaches;
* gives every section a **time limit** (:data:`LIMITS`, never past the budget's end), checked
  between methods and inside the profile's measurement; no step starts past the budget;
* **isolates** every section, model and method: an exception or an out-of-memory is recorded with
  its traceback in the JSON, the device memory is released, and the check goes on;
* **writes the JSON after every method** (``--out``, default ``outputs/gpu_check/<time>.json``), so
  what was measured survives a check that is cut off;
* holds **one copy of each model's weights**: the eager side of the capture section and the
  evaluations in each capture mode run on twins of the loaded model that share its weights
  (:meth:`~selfspec.models.layered.LayeredModel.with_passes`).

The models: the Llama-3-8B shape with random weights, SmolLM2-135M (its weights when its GGUF
file is here, else its shape with random weights), both kept loaded (about 17 GB of GPU memory in
bf16), and Gemma 3 270M's shape (random weights; its profile only). Where SmolLM2's GGUF file is
absent, the random models have no tokenizer to borrow: they run on their own vocabularies, and
the two sections that decode task text (``training``, ``methods``) say so instead of running.

Sections (:data:`SECTIONS`):

``profile``      this machine's cost profile (:func:`selfspec.evaluation.profiling.measure_profile`, rows
                 to 256, eager tables, the slots each context's static passes spanned), saved under the
                 check's ``outputs/profiles/`` for ``python -m selfspec.project``;
``ledger``       every method of ``capture`` on the captured model: measured seconds (median of the
                 timed runs, each timed apart from graph captures: ``Decoder.generate_timed``) beside
                 those the profile predicts from its step trace, per component; a 512-token prompt and
                 64 new tokens (the target: within 10% for every method);
``capture``      every method (vanilla, Draft & Verify, early exit, DEL, AdaDecode, n-gram, PPD with a
                 small tree and trees of the paper's sizes, then SWIFT, CLaSp and KnapSpec searching
                 their skip sets) built with artefacts that need no training, always speculating, on
                 one repeated-segment prompt: captured (``graphs``; ``--dry-run``: ``static``) and
                 eager (timed once), seconds per token, tokens equal between the two (greedy and
                 sampled) and to vanilla's (the bf16 consistency on this device), the passes routed,
                 missed and built (in all, inside timed runs, dropped by the LRU);
``ledger_long``  the ledger at a second shape: a 200-token prompt and 256 new tokens;
``runtime``      the runtime benchmark (:func:`selfspec.evaluation.runtime.runtime_report`: v(k),
                 vanilla's share of the read roof);
``training``     every training job for a few steps: peak memory (the graphs of the sections before
                 released first), seconds, the memory model's estimate;
``methods``      every method of the registry evaluated against vanilla with the artefacts just trained,
                 priced with the check's profile, captured and eager, by the evaluation runner (seconds
                 per token, consistency, passes).

Plus ``settings``, ``run_info``, the load average, ``estimate`` and per model ``sections`` (each
section's seconds, or why it did not run) and ``errors``. Random weights give meaningless tokens but
real timings, memory and consistency. docs/gpu.md says how to run it on a machine with a CUDA torch.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

#: the sections, in order of value within a model (module docstring)
SECTIONS = ("profile", "ledger", "capture", "ledger_long", "runtime", "training", "methods")
#: the sections measured first for every model, before any other section of any model
FIRST = ("profile", "ledger")
#: the sections that decode task text, left out for a model with no tokenizer (random weights on a
#: machine without SmolLM2's GGUF file, whose tokenizer the random models borrow)
TEXT_SECTIONS = ("training", "methods")
#: each section's time limit in seconds (never past the budget's end)
LIMITS = {"profile": 150, "ledger": 150, "capture": 200, "ledger_long": 150, "runtime": 90, "training": 150,
          "methods": 200}
#: seconds each section took on one H100 (80 GB), by model shape: from the 2026-11-26 checks (profile
#: 37/41 s to 128 rows, ledgers 15/37 s for 6 methods, capture 124/138 s with the eager side timed
#: three times), scaled to this check's sizes (rows to 256, 12 methods, eager timed once); the load
#: of each model is included in its first step
ESTIMATE_H100 = {"llama3-8b-random": {"profile": 60, "ledger": 75, "capture": 100, "ledger_long": 90, "runtime": 35,
                                      "training": 60, "methods": 90},
                 "smollm2-135m": {"profile": 50, "ledger": 30, "capture": 80, "ledger_long": 45, "runtime": 25,
                                  "training": 30, "methods": 60},
                 "gemma3-270m-random": {"profile": 45}, "qwen2.5-coder-1.5b-random": {"profile": 50}}


#: Gemma 3 270M's shape with random weights (``model=tiny-gemma3`` grown to it: 18 layers, 5 sliding of window
#: 512 to each full one, each kind with its rotary base, a tied 262k head), bf16 on the GPU: the profile
#: that ``python -m selfspec.project`` prices Gemma 3 270M's CPU traces with (the same model shape)
GEMMA3_SHAPE = ["model.name=gemma3-270m-random", "model.tokenizer=null",
                "+model.random.vocab_size=262144", "model.random.hidden_size=640", "model.random.intermediate_size=2048",
                "model.random.num_hidden_layers=18", "model.random.head_dim=256",
                "model.random.query_pre_attn_scalar=256", "model.random.sliding_window=512",
                "model.random.layer_types=[" + ",".join((["sliding_attention"] * 5 + ["full_attention"]) * 3) + "]",
                "model.random.max_position_embeddings=32768",
                "+model.random.rope_parameters={full_attention:{rope_type:default,rope_theta:1000000.0},"
                "sliding_attention:{rope_type:default,rope_theta:10000.0}}",
                "model.dtype=auto", "model.device=auto"]

#: Qwen2.5-Coder-1.5B-Instruct's shape with random weights (``model=tiny-qwen2`` grown to it: 28 layers of width
#: 1536, GQA 12/2 heads of 128 with q/k/v biases, MLP 8960, a tied 151,936-row head), bf16 on the GPU: the
#: profile that ``python -m selfspec.project`` prices the 1.5B model's CPU traces with (issue 70)
QWEN15_SHAPE = ["model.name=qwen2.5-coder-1.5b-random", "model.tokenizer=null",
                "+model.random.vocab_size=151936", "model.random.hidden_size=1536", "model.random.intermediate_size=8960",
                "model.random.num_hidden_layers=28", "model.random.num_attention_heads=12",
                "model.random.num_key_value_heads=2", "model.random.tie_word_embeddings=true",
                "+model.random.rope_theta=1000000.0", "model.random.rms_norm_eps=1.0e-06",
                "model.random.max_position_embeddings=32768", "model.dtype=auto", "model.device=auto"]

#: SmolLM2-135M's shape with random weights (model=llama3-8b-random with these overrides), for a GPU
#: machine that has no copy of SmolLM2's weights (docs/gpu.md: how to bring the 94 MB GGUF file over)
SMOLLM2_SHAPE = ["model=llama3-8b-random", "model.name=smollm2-135m-random", "+model.tokenizer=smollm2-135m",
                 "model.random.vocab_size=49152", "model.random.hidden_size=576", "model.random.intermediate_size=1536",
                 "model.random.num_hidden_layers=30", "model.random.num_attention_heads=9",
                 "model.random.num_key_value_heads=3", "model.random.tie_word_embeddings=true",
                 "model.random.rope_theta=100000.0"]


def plan(dry_run: bool) -> dict:
    """What the check runs: models (name -> model overrides) in order of value, capture modes, sizes
    (the settings the JSON records)."""
    if dry_run:
        return {
            "models": {"tiny-random": ["model.dtype=bfloat16", "model.device=cpu"]},
            "profile_only": {"tiny-gemma3": ("tiny-gemma3", ["model.dtype=bfloat16"])},
            "captures": ["static", "off"],
            "runtime": {"ks": [1, 2, 4], "contexts": [64], "new_tokens": 8, "repeats": 2},
            "profile": {"rows": [1, 2, 4, 8], "prefill_rows": [64], "contexts": [0, 32, 256], "repeats": 2},
            "evaluate": ["task=xsum", "n_examples=1", "max_new_tokens=8", "warmup=1", "warmup_max_new_tokens=4"],
            "method_overrides": {"early_exit": ["method.exit_layer=1"]},
            "train_extra": [],
            "capture": {"prompt_segment": 16, "prompt_repeats": 4, "new_tokens": 12, "repeats": 1,
                        "ppd_nodes": [24]},
            "ledger_long": {"prompt_segment": 8, "prompt_repeats": 3, "new_tokens": 24, "repeats": 1},
        }
    return {
        # the 8B shape with random weights (SmolLM2's tokenizer for the task prompts) first: its profile and
        # ledger are the check's most valuable figures; SmolLM2 when its weights are here, else its shape
        "models": {"llama3-8b-random": ["+model.tokenizer=smollm2-135m"], "smollm2-135m": []},
        # Gemma 3 270M's and Qwen2.5-Coder-1.5B's shapes, random weights: their profiles only (~40-50 s each),
        # for projecting their CPU traces
        "profile_only": {"gemma3-270m-random": ("tiny-gemma3", GEMMA3_SHAPE),
                         "qwen2.5-coder-1.5b-random": ("tiny-qwen2", QWEN15_SHAPE)},
        "captures": ["graphs", "off"],
        "runtime": {"ks": [1, 2, 4, 8, 16, 32], "contexts": [128, 512, 1024], "new_tokens": 32, "repeats": 5},
        "profile": None,  # measure_profile's defaults
        "evaluate": ["task=xsum", "n_examples=3", "max_new_tokens=48", "warmup=1", "warmup_max_new_tokens=16"],
        "method_overrides": {},
        "train_extra": ["job.steps=5"],
        # a 512-token prompt of one random 64-token segment repeated (the n-gram lookup drafts from it);
        # PPD with 3 prompt tokens: 3 nodes (passes of ~10 rows), 16 and 24 nodes (~60 and ~120 rows)
        "capture": {"prompt_segment": 64, "prompt_repeats": 8, "new_tokens": 64, "repeats": 2,
                    "ppd_nodes": [3, 16, 24]},
        # the ledger's second shape: 200 prompt tokens (a 50-token segment 4 times), 256 new tokens
        "ledger_long": {"prompt_segment": 50, "prompt_repeats": 4, "new_tokens": 256, "repeats": 1},
    }


def model_present(name: str) -> str | None:
    """None when the model's weights can be loaded here, else why not (SmolLM2: the asset not fetched)."""
    from selfspec.config import model_config
    from selfspec.models.loading import check_model_config

    try:
        check_model_config(model_config(name))
    except Exception as err:  # noqa: BLE001 - any reason it cannot load is recorded, the check goes on
        return f"{type(err).__name__}: {err}"
    return None


def compose_models(p: dict) -> dict[str, str]:
    """Every model config the check ``p`` loads, composed and checked, and a random model's transformers
    config built from it (no weights): ``"ok"`` or the error, by model key. The dry run composes the
    real check's models too (``plan(False)``: the 8B shape, SmolLM2's shape, Gemma 3's overrides), so
    a typo in an override fails here and not on the GPU."""
    from selfspec.config import compose
    from selfspec.models.loading import check_model_config, random_config

    out = {}
    specs = {**{k: (k, o) for k, o in p["models"].items()}, "smollm2-135m-random": (SMOLLM2_SHAPE[0].split("=")[1],
                                                                                    SMOLLM2_SHAPE[1:]),
             **p["profile_only"]}
    for key, (model, overrides) in specs.items():
        try:
            cfg = compose([f"model={model}", *overrides, "model.device=cpu"]).model
            source = check_model_config(cfg)
            if source.kind == "random":  # its vocabulary: its own, or the tokenizer's it borrows (any size here)
                random_config(cfg, vocab_size=1024)
            out[key] = "ok"
        except Exception as err:  # noqa: BLE001 - recorded: the check names what does not compose
            out[key] = f"{type(err).__name__}: {err}"
    return out


def capture_decoders(model, p: dict, profile=None) -> dict:
    """name -> a function building that method's decoder on ``model`` (a LayeredModel), with
    artefacts that need no training, always speculating (``never_slower: false``). The methods that
    search their skip sets while decoding come last, searching within the check's short generations;
    KnapSpec only with a cost ``profile`` (it weighs its sublayers with one)."""
    from selfspec.config import method_config as config
    from selfspec.decoding import build_decoder
    from selfspec.decoding.vanilla import Vanilla
    from selfspec.evaluation.profiling import untrained_ppd

    L = model.num_layers

    def method(name: str, **overrides):
        return lambda m: build_decoder(config(name, never_slower=False, **overrides), m)

    def ppd(nodes: int):
        return lambda m: untrained_ppd(m, nodes)

    out = {
        "vanilla": lambda m: Vanilla(m),
        "draft_verify": method("draft_verify", skip_attn=list(range(1, L - 1, 2)), skip_mlp=list(range(1, L - 1, 2)),
                               max_draft=4),
        "early_exit": method("early_exit", exit_layer=L // 2, max_draft=3),
        "del": method("del", max_draft=4, cost_model="parameters"),
        "adadecode": lambda m: build_decoder(config("adadecode", head_kind="lm_head",
                                                    layers=sorted({L // 4, L // 2, 3 * (L - 1) // 4}), threshold=0.3), m),
        "ngram": method("ngram", draft_schedule="adaptive"),
    }
    for nodes in p["capture"]["ppd_nodes"]:
        out[f"ppd_{nodes}_nodes"] = ppd(nodes)
    window = max(4, p["capture"]["new_tokens"] // 4)
    out["swift"] = method("swift", context_window=window)
    out["clasp"] = method("clasp", interval=window)
    if profile is not None:
        out["knapspec"] = lambda m: build_decoder(config("knapspec", never_slower=False, interval=max(window, 8)), m,
                                                  profile=profile)  # its search after step 6 of each interval
    return out


class Isolated:
    """Runs the check's parts so that one failing part costs only itself: an exception (an
    out-of-memory included) is recorded as ``{"error", "traceback"}`` where the part's figures would
    go, the device's memory is released, and the check goes on. ``save`` writes the JSON."""

    def __init__(self, save) -> None:
        self.save = save

    @contextlib.contextmanager
    def part(self, record: dict, key: str, what: str):
        try:
            yield
        except Exception as err:  # noqa: BLE001 - recorded with its traceback: the check goes on
            record[key] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            print(f"  {what}: {type(err).__name__}: {str(err)[:300]}", flush=True)
            release()
        finally:
            self.save()


def release() -> None:
    """Give back what a failed (or finished) part held on the device."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _prompt(c: dict, vocab: int, seed: int = 0) -> list[int]:
    """``c["prompt_repeats"]`` copies of one random ``c["prompt_segment"]``-token segment (the n-gram
    lookup drafts from it)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (c["prompt_segment"],), generator=g).tolist() * c["prompt_repeats"]


def capture_section(loaded, p: dict, deadline: float, isolated: Isolated, profile_data: dict | None = None) -> dict:
    """Every method with its passes captured and eager (module docstring); methods past the deadline
    are named in ``skipped``. KnapSpec weighs its sublayers with the profile the check measured;
    without one it is named in ``left_out``."""
    import statistics
    from collections import Counter

    from selfspec.decoding import Sampling
    from selfspec.measure.profile import Profile

    c = p["capture"]
    captured = loaded.model
    eager = captured.with_passes(None)  # the same weights: no second copy
    prompt = _prompt(c, captured.vocab_size)
    steps = captured.steps
    out: dict = {"mode": captured.capture, "prompt_tokens": len(prompt), "new_tokens": c["new_tokens"],
                 "methods": {}, "skipped": []}
    if profile_data is None:
        out["left_out"] = {"knapspec": "no profile to weigh its sublayers with: the profile section did not run"}
    reference = None
    profile = Profile(profile_data) if profile_data is not None else None
    sampled_at = Sampling(temperature=0.8, top_p=0.9, seed=3)
    for name, make in capture_decoders(captured, p, profile).items():
        if time.perf_counter() > deadline:
            out["skipped"].append(name)
            continue
        with isolated.part(out["methods"], name, f"capture {name}"):
            before = ((steps.routed, steps.missed, dict(steps.kinds), dict(steps.missed_kinds), dict(steps.routed_rows),
                       steps.built, steps.evicted) if steps else None)
            dec = make(captured)
            dec.generate(prompt, c["new_tokens"])  # captures its graphs
            warm = steps.built if steps else 0
            runs = [dec.generate(prompt, c["new_tokens"]) for _ in range(c["repeats"])]
            timed_built = steps.built - warm if steps else 0  # captures inside the timed runs (a search's new sets)
            row = {"captured": (runs, dec.generate(prompt, c["new_tokens"], sampled_at))}
            dec = make(eager)
            row["eager"] = ([dec.generate(prompt, c["new_tokens"])], dec.generate(prompt, c["new_tokens"], sampled_at))
            if name == "vanilla":
                reference = row["eager"][0][0].tokens
            spt = {m: statistics.median(g.seconds / max(g.new_tokens, 1) for g in rs) for m, (rs, _) in row.items()}
            first = {m: rs[0] for m, (rs, _) in row.items()}
            r = {"s_per_token": spt, "tau": first["captured"].new_tokens / max(first["captured"].steps, 1),
                 "eager_over_captured": spt["eager"] / spt["captured"],
                 "same_tokens_captured_and_eager": first["captured"].tokens == first["eager"].tokens,
                 "same_sampled_tokens_captured_and_eager": row["captured"][1].tokens == row["eager"][1].tokens,
                 "consistency": {m: _agreement(g.tokens, reference) for m, g in first.items()}}
            if before is not None:
                r["passes"] = {"routed": steps.routed - before[0], "missed": steps.missed - before[1],
                               "kinds": _delta(steps.kinds, before[2]),
                               "missed_kinds": _delta(steps.missed_kinds, before[3]),
                               "built": steps.built - before[5], "built_while_timed": timed_built,
                               "evicted": steps.evicted - before[6]}
                widths = Counter(_delta(steps.routed_rows, before[4])) + Counter(r["passes"]["missed_kinds"])
                trees = {int(k.split()[1]): n for k, n in widths.items() if k.startswith("tree ")}
                if trees:
                    r["tree_pass_rows"] = {"min": min(trees), "max": max(trees), "passes": sum(trees.values())}
            out["methods"][name] = r
            print(f"  capture {name}: {spt['captured'] * 1e3:.2f} ms/token captured, "
                  f"{r['eager_over_captured']:.2f}x eager; consistency {r['consistency']['captured']:.3f}; "
                  f"missed {r.get('passes', {}).get('missed')}, captured while timed {timed_built}", flush=True)
    return out


def _agreement(tokens: list[int], reference: list[int] | None) -> float | None:
    """The share of ``reference``'s tokens that ``tokens`` repeats before the first difference."""
    if not reference:
        return None
    n = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        n += 1
    return n / len(reference)


def _delta(now: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}


def ledger_section(loaded, p: dict, profile_data: dict | None, deadline: float, isolated: Isolated,
                   shape: str = "capture") -> dict:
    """Every method of :func:`capture_decoders` on the captured model: measured seconds (median of the
    timed runs, each timed apart from the graphs it captures) against the seconds this machine's
    profile predicts from the step trace, in total and per component; ``shape``: the settings of
    ``p`` that give the prompt and the new tokens (``capture``: 512 and 64; ``ledger_long``: 200 and
    256)."""
    import statistics

    from selfspec.measure.profile import Profile

    if profile_data is None:
        return {"skipped": "no profile: the profile section did not run"}
    profile = Profile(profile_data)
    model, c = loaded.model, p[shape]
    prompt = _prompt(c, model.vocab_size, seed=1)
    out: dict = {"profile": profile.name, "prompt_tokens": len(prompt), "new_tokens": c["new_tokens"],
                 "methods": {}, "skipped": []}
    for name, make in capture_decoders(model, p, profile).items():
        if time.perf_counter() > deadline:
            out["skipped"].append(name)
            continue
        with isolated.part(out["methods"], name, f"ledger {name}"):
            dec = make(model)
            dec.generate(prompt, c["new_tokens"])  # captures
            timed = [dec.generate_timed(prompt, c["new_tokens"]) for _ in range(max(c["repeats"], 1 if shape != "capture" else 3))]
            g = sorted((g for g, _ in timed), key=lambda g: g.seconds)[len(timed) // 2]
            trace = [t.row() for t in g.trace]
            predicted, unpriced = profile.predict(trace), profile.unpriced(trace)
            out["methods"][name] = {"seconds": g.seconds, "predicted": sum(predicted.values()),
                                    "measured_over_predicted": g.seconds / sum(predicted.values()),
                                    "tau": g.new_tokens / max(g.steps, 1), "unpriced_passes": unpriced,
                                    "captured_while_timed": sum(b for _, b in timed),
                                    "measured_ledger": g.ledger, "predicted_ledger": predicted}
            print(f"  {shape if shape != 'capture' else 'ledger'} {name}: measured / predicted "
                  f"{out['methods'][name]['measured_over_predicted']:.2f}", flush=True)
    ratios = [r["measured_over_predicted"] for r in out["methods"].values() if "measured_over_predicted" in r]
    out["within_10_percent"] = sum(abs(x - 1) <= 0.1 for x in ratios)
    out["median_ratio"] = statistics.median(ratios) if ratios else None
    return out


def profile_section(loaded, p: dict, deadline: float) -> dict:
    """This machine's cost profile of the model, saved where ``python -m selfspec.project`` finds it."""
    from selfspec.evaluation.profiling import measure_profile

    profile = measure_profile(loaded.model, deadline=deadline, **(p["profile"] or {}))
    path = Path(os.environ["SELFSPEC_OUTPUTS"]) / "profiles" / f"{profile.name}.json"
    profile.save(path)
    return {"profile": profile.data, "profile_path": str(path)}


def runtime_section(loaded, p: dict) -> dict:
    """The runtime benchmark's figures (bench_runtime's function)."""
    from selfspec.evaluation.runtime import runtime_report

    r = p["runtime"]
    return {"runtime": runtime_report(loaded, tuple(r["ks"]), tuple(r["contexts"]), r["new_tokens"], r["repeats"],
                                      llama_cpp=False)}


def training_section(loaded, model: str, overrides: list[str], p: dict, deadline: float, isolated: Isolated) -> dict:
    """Every training job for a few steps on ``loaded``: peak memory, seconds, the memory model's
    estimate. The graphs the sections before captured are released first, so the peak is the job's
    (with the model's weights, which the estimate counts too); ``resident_bytes``: what the device
    held when the job started."""
    from measure_memory import BASE, COMMON
    from selfspec import memory
    from selfspec.config import compose
    from selfspec.measure import peak
    from selfspec.train import JOBS, run_job

    if loaded.model.steps is not None:
        loaded.model.steps.clear()
    release()
    meter = peak.Peak(loaded.model.device)
    shape = peak.shape_of(compose([f"model={model}", *overrides], config_name="train").model)
    out: dict = {"skipped": []}
    for job in JOBS:  # the registry's order: a job after those whose artefacts it reads
        if time.perf_counter() > deadline:
            out["skipped"].append(job)
            continue
        with isolated.part(out, job, f"training {job}"):
            cfg = compose([f"model={model}", *overrides, *COMMON, f"job={job}", *BASE[job], *p["train_extra"],
                           *p.get("job_data", {}).get(job, [])], config_name="train")
            est = memory.job_estimate(job, shape, cfg, loaded.model.dtype, loaded.model.device)
            release()
            resident = meter.current()
            meter.reset()
            t0 = time.perf_counter()
            summary = run_job(cfg, loaded)
            seconds = time.perf_counter() - t0
            measured = meter.read()
            steps = summary.get("steps")
            out[job] = {"peak_bytes": measured, "resident_bytes": resident, "estimate_bytes": est.total,
                        "estimate_error": est.total / measured - 1,
                        "estimate_parts": {"weights": est.weights, "runtime": est.runtime,
                                           **{t.name: t.bytes for t in est.parts}},
                        "seconds": seconds, "steps": steps,
                        "seconds_per_step": summary["train_seconds"] / steps if steps and "train_seconds" in summary else None,
                        "artefact": summary["artefact"]}
            print(f"  {job}: peak {measured / 2**20:.0f} MB (estimate {est.total / 2**20:.0f} MB), {seconds:.1f} s",
                  flush=True)
    return out


def methods_section(model: str, overrides: list[str], loaded, p: dict, out_dir: Path, deadline: float,
                    isolated: Isolated, profile_path: str | None) -> tuple[dict, dict]:
    """Every method of the registry (its conf/method YAML, the artefacts the training section just
    wrote, priced with the profile the check measured) against vanilla in each capture mode, on twins
    of ``loaded`` that share its weights: seconds per token, consistency and tau per method and mode
    (``bf16_consistency.evaluate_rows``); per static mode the passes its runner took, by kind, and
    those it missed. Without the check's profile, ``profile=null``: a method that prices with one is
    refused, and recorded so."""
    from dataclasses import replace

    from bf16_consistency import evaluate_rows

    from selfspec.config import compose
    from selfspec.decoding import METHODS
    from selfspec.models import capture as capture_modes

    names = [name for name in METHODS if METHODS[name].own_loop and name != "vanilla"]
    rows: dict[str, dict] = {}
    passes: dict[str, dict] = {}
    for capture in p["captures"]:
        base = [f"model={model}", *overrides, f"model.capture={capture}", "logger=none", "progress=false",
                f"profile={profile_path}" if profile_path else "profile=null", *p["evaluate"]]
        runner = capture_modes.StepRunner(capture) if capture != "off" else None
        twin = replace(loaded, model=loaded.model.with_passes(runner), cfg=dict(loaded.cfg) | {"capture": capture})
        for method in names:
            if time.perf_counter() > deadline:
                rows.setdefault(method, {})[capture] = "not run: the section's time limit passed"
                continue
            with isolated.part(rows.setdefault(method, {}), capture, f"{capture} {method}"):
                cfg = compose([*base, f"method={method}", *p["method_overrides"].get(method, [])])
                for row in evaluate_rows(cfg, out_dir / capture / method, twin, method):
                    if row["method"] == method:
                        rows[method][capture] = row
                    elif row["method"] == "vanilla":
                        rows.setdefault("vanilla", {}).setdefault(capture, row)
                print(f"  {capture} {method}: {rows[method][capture]['s_per_token'] * 1e3:.2f} ms/token, "
                      f"consistency {rows[method][capture]['consistency']}", flush=True)
        if runner is not None:  # which passes the static shapes took: every method's kinds, none missed
            passes[capture] = {k: v for k, v in runner.counts().items()
                               if k in ("routed", "captured", "missed", "kinds", "missed_kinds")}
            runner.clear()
    captured, eager = p["captures"]
    for r in rows.values():
        if isinstance(r.get(captured), dict) and isinstance(r.get(eager), dict) and "s_per_token" in r[captured] \
                and "s_per_token" in r[eager]:
            r["eager_over_captured"] = r[eager]["s_per_token"] / r[captured]["s_per_token"]
    return rows, passes


def load_entry(model: str, overrides: list[str], p: dict) -> tuple[dict, object]:
    """Load one model of the check: its record (name, shape, dtype, device, load time) and the model."""
    from selfspec.config import compose
    from selfspec.measure.peak import shape_of
    from selfspec.models.loading import load_model

    t0 = time.perf_counter()
    cfg = compose([f"model={model}", *overrides, f"model.capture={p['captures'][0]}"])
    loaded = load_model(cfg.model)
    shape = shape_of(cfg.model)
    return {"model": {"name": model, "overrides": overrides, "params": shape.params, "shape": vars(shape),
                      "dtype": str(loaded.model.dtype).replace("torch.", ""), "device": str(loaded.model.device),
                      "capture": loaded.model.capture, "load_seconds": time.perf_counter() - t0},
            "sections": {}}, loaded


def run_section(section: str, result: dict, loaded, p: dict, out_dir: Path, deadline: float, isolated: Isolated):
    """One section for one model, its figures into ``result``; returns the model as loaded after it."""
    model, overrides = result["model"]["name"], result["model"]["overrides"]
    if section == "profile":
        result.update(profile_section(loaded, p, deadline))
    elif section in ("ledger", "ledger_long"):
        result[section] = ledger_section(loaded, p, result.get("profile"), deadline, isolated,
                                         "capture" if section == "ledger" else "ledger_long")
    elif section == "capture":
        result["capture"] = capture_section(loaded, p, deadline, isolated, result.get("profile"))
    elif section == "runtime":
        result.update(runtime_section(loaded, p))
    elif section == "training":
        result["training"] = training_section(loaded, model, [*overrides, f"model.capture={p['captures'][0]}"], p,
                                              deadline, isolated)
    else:
        result["methods"], result["passes"] = methods_section(model, overrides, loaded, p,
                                                              out_dir / "evaluate" / result["key"], deadline, isolated,
                                                              result.get("profile_path"))
    return loaded


def step_order(entries: list[dict], chosen: list[str]) -> list[tuple[str, int]]:
    """``(section, entry index)`` in order of value: :data:`FIRST` for every model in the plan's order,
    then each other section for every model, then the shapes profiled for projections only."""
    main = [i for i, e in enumerate(entries) if "only" not in e]
    order = [(s, i) for i in main for s in FIRST]
    order += [(s, i) for s in SECTIONS if s not in FIRST for i in main]
    order += [(s, i) for i, e in enumerate(entries) if "only" in e for s in e["only"]]
    return [(s, i) for s, i in order if s in chosen]


def estimate(order: list[tuple[str, int]], entries: list[dict], budget: float | None) -> list[dict]:
    """Each step's estimated seconds on an H100 (:data:`ESTIMATE_H100`, by the model's name), the
    running total, and whether the budget reaches its start."""
    rows, total = [], 0.0
    for section, i in order:
        key = entries[i]["key"]
        shape = next((k for k in ESTIMATE_H100 if key.startswith(k.split("-random")[0])), None)
        seconds = (ESTIMATE_H100.get(shape) or {}).get(section)
        rows.append({"section": section, "model": key, "seconds": seconds, "starts_at": total,
                     "within_budget": budget is None or total < budget})
        total += seconds or 0.0
    return rows


def print_estimate(rows: list[dict], budget: float | None) -> None:
    print(f"estimate on an H100 (budget: {'none' if budget is None else f'{budget:.0f} s'}):", flush=True)
    for r in rows:
        secs = "?" if r["seconds"] is None else f"{r['seconds']:>4.0f} s"
        mark = "" if r["within_budget"] else "   (past the budget: left out)"
        print(f"  {r['starts_at']:>5.0f} s  {r['section']:<12} {r['model']:<22} {secs}{mark}", flush=True)


def sharegpt_overrides(path: Path) -> dict[str, list[str]]:
    """The training section's overrides for a local ShareGPT file: the prompts job trains on its first
    conversations (and holds one out), the tree validates on the ones after them."""
    from measure_memory import BASE

    given = dict(o.split("=", 1) for o in BASE["prompts"])
    read = int(given["job.n_conversations"]) + int(given["job.held_out"])
    data = f"job.data={path.absolute()}"
    return {"prompts": [data], "ppd_tree": [data, f"job.skip_conversations={read}"]}


def check_out(out: Path) -> None:
    """Refuse, before anything runs, an ``--out`` the check cannot write: an existing directory, a
    path whose folder (or the folder beside it for the check's artefacts) cannot take a new file, or
    the JSON or artefacts' folder of an earlier check. A second check into the first one's folder would
    train its artefacts again, and every evaluation would then refuse to resume the first one's runs
    (decoded with the artefacts it replaced): the methods section lost, and the earlier JSON overwritten."""
    from selfspec.store.files import check_directory

    if out.is_dir():
        raise SystemExit(f"--out {out}: is a directory; give the JSON file's path (e.g. {out / 'check.json'})")
    if out.suffix != ".json":
        raise SystemExit(f"--out {out}: give a path ending in .json (its artefacts go to {out.with_suffix('')}/)")
    work = out.with_suffix("")
    if out.exists() or (work.is_dir() and any(work.iterdir())):
        raise SystemExit(f"--out {out}: an earlier check wrote {'it' if out.exists() else work}; give a new path "
                         f"(e.g. {out.with_name(out.stem + '-2.json')}), or leave --out out for one named by the time")
    try:
        check_directory(out.parent, "--out")
        check_directory(out.with_suffix(""), "--out (its artefacts' folder)")
    except Exception as err:  # noqa: BLE001 - a ConfigError or PermissionError, said in one line
        raise SystemExit(str(err)) from None


def no_cuda_message() -> str:
    """Why no CUDA device is visible, with what would tell: torch's build and CUDA version, and the
    driver's (a CPU build of torch, or a CUDA build newer than the driver, both show as no device)."""
    import subprocess

    import torch

    driver = "no nvidia-smi here"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        driver = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip() or "nvidia-smi lists no GPU"
    return (f"scripts/gpu_check.py needs a CUDA device, and none is visible (torch {torch.__version__}, CUDA "
            f"{torch.version.cuda or 'none: a CPU build'}; driver: {driver}); install a torch built for this "
            "driver's CUDA (docs/gpu.md), or --dry-run runs the same code on tiny-random on this CPU")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny-random on the CPU, capture=static (fast)")
    ap.add_argument("--out", type=Path, default=None, help="the JSON (default outputs/gpu_check/<time>.json)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds after which nothing runs (default 300 on a GPU, none with --dry-run)")
    ap.add_argument("--sharegpt", type=Path, default=None,
                    help="a local ShareGPT JSON for the training section's prompts and tree jobs (job.data), where "
                         "the offline asset is not in the cache (a lent machine: scripts/gpu_bundle.py carries 64 "
                         "conversations of it; the jobs read 7)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"the sections to run, comma-separated (default: all of {','.join(SECTIONS)}; the "
                         "ledgers need profile)")
    args = ap.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        raise SystemExit(f"--sections {args.sections!r}: {', '.join(unknown) or 'none given'} not among "
                         f"{', '.join(SECTIONS)}")
    if {"ledger", "ledger_long"} & set(chosen) and "profile" not in chosen:
        raise SystemExit("--sections: the ledgers price the step traces on the profile the same check measures; "
                         "add profile")
    if args.sharegpt is not None and not args.sharegpt.is_file():
        raise SystemExit(f"--sharegpt {args.sharegpt}: no such file (a ShareGPT JSON: a list of conversations)")
    budget = args.budget if args.budget is not None else (None if args.dry_run else 300.0)
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise SystemExit(f"--budget must be a positive number of seconds, got {args.budget}")
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    out = (args.out or ROOT / "outputs" / "gpu_check" / f"{stamp}{'-dry-run' * args.dry_run}.json").absolute()
    check_out(out)
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from selfspec.models.kernels import paths
    from selfspec.store.files import write_json
    from selfspec.store.runinfo import run_info

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit(no_cuda_message())
    work = out.with_suffix("")  # artefacts, evaluation runs and profiles of this check
    work.mkdir(parents=True, exist_ok=True)
    os.environ["SELFSPEC_OUTPUTS"] = str(work / "outputs")
    p = plan(args.dry_run)
    if args.sharegpt is not None:
        p["job_data"] = sharegpt_overrides(args.sharegpt)
    t0 = time.perf_counter()
    end = t0 + budget if budget is not None else float("inf")
    report = {"dry_run": args.dry_run, "settings": p, "sections_chosen": chosen, "budget_seconds": budget,
              "run_info": run_info(kernel_paths=paths()), "load_average": [os.getloadavg()[0]], "models": {}, "skipped": {},
              "composed": compose_models(p) | (compose_models(plan(False)) if args.dry_run else {})}

    def save() -> None:  # what is done so far survives a failure or a machine taken back
        report["seconds"] = time.perf_counter() - t0
        write_json(out, report)  # atomic; a non-finite figure is null, an object its str()

    isolated = Isolated(save)
    entries: list[dict] = []
    for model, overrides in p["models"].items():
        why = model_present(model)
        if why is not None and model == "smollm2-135m":
            print(f"{model}: its weights are not here ({why}); its shape with random weights instead", flush=True)
            report["skipped"][model] = f"{why}; measured as {SMOLLM2_SHAPE[1].split('=')[1]} (random weights)"
            model, overrides = "llama3-8b-random", SMOLLM2_SHAPE[1:]
        elif why is not None:
            report["skipped"][model] = why
            print(f"{model}: skipped ({why})", flush=True)
            continue
        key = next((o.split("=", 1)[1] for o in overrides if o.startswith("model.name=")), model)
        entry = {"key": key, "model_name": model, "overrides": overrides, "no_text": None, "loaded": None}
        borrowed = [o for o in overrides if o.startswith("+model.tokenizer=")]
        why_no_text = borrowed and model_present(borrowed[0].split("=", 1)[1])
        if why_no_text:  # a random model then runs on its own vocabulary: no text, so no task prompts
            entry["overrides"] = [o for o in overrides if o not in borrowed]
            entry["no_text"] = f"no tokenizer ({borrowed[0]} cannot load: {why_no_text})"
            print(f"{key}: {entry['no_text']}; the sections that need text are left out", flush=True)
        entries.append(entry)
    for key, (model, overrides) in p["profile_only"].items():  # a shape for projections: its profile only
        entries.append({"key": key, "model_name": model, "overrides": overrides, "no_text": None, "loaded": None,
                        "only": ("profile",)})
    order = step_order(entries, chosen)
    last = {i: step for step in order for i in [step[1]]}  # each model's last step: its memory goes back after it
    # on an H100, what this check (the real one, for a dry run: its default budget too) runs and when
    real = (entries, budget) if not args.dry_run else (_real_entries(), 300.0)
    report["estimate"] = estimate(step_order(real[0], chosen), real[0], real[1])
    print_estimate(report["estimate"], real[1])
    save()
    for section, i in order:
        entry = entries[i]
        key = entry["key"]
        record = report["models"].setdefault(key, {"key": key, "sections": {}, "errors": {}})
        why_not = ("the budget was spent" if time.perf_counter() > end
                   else "the model did not load (errors.load)" if "load" in record["errors"]
                   else entry["no_text"] if section in TEXT_SECTIONS else None)
        if why_not:
            record["sections"][section] = f"not run: {why_not}"
            print(f"{key}: {section} left out ({why_not})", flush=True)
            save()
            continue
        if entry["loaded"] is None:
            with isolated.part(record["errors"], "load", f"{key}: load"):
                loaded_record, entry["loaded"] = load_entry(entry["model_name"], entry["overrides"], p)
                record.update(loaded_record | {"key": key, "sections": record["sections"], "errors": record["errors"]})
            if entry["loaded"] is None:
                record["sections"][section] = "not run: the model did not load (errors.load)"
                save()
                continue
        print(f"{key}: {section}", flush=True)
        started = time.perf_counter()
        with isolated.part(record["errors"], section, f"{key}: {section}"):
            run_section(section, record, entry["loaded"], p, work, min(started + LIMITS[section], end), isolated)
        record["sections"][section] = (time.perf_counter() - started if section not in record["errors"]
                                       else "failed (errors." + section + ")")
        if (section, i) == last[i]:
            entry["loaded"] = None  # before the next model loads
            release()
        save()
    report["seconds"] = time.perf_counter() - t0
    report["load_average"].append(os.getloadavg()[0])
    save()
    print(f"gpu check: {out} ({report['seconds']:.0f} s)")
    return 0


def _real_entries() -> list[dict]:
    """The models of the real check (on a GPU), for the dry run's printed estimate."""
    p = plan(False)
    return [{"key": k} for k in p["models"]] + [{"key": k, "only": ("profile",)} for k in p["profile_only"]]


if __name__ == "__main__":
    sys.exit(main())

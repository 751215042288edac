"""One command for a GPU machine, within a time budget: every method captured and eager, the cost profile, the runtime, training memory.

    python scripts/gpu_check.py                  # on a GPU (make gpu-check): at most --budget seconds (300)
    python scripts/gpu_check.py --budget 120     # the most valuable sections that fit in 2 minutes
    python scripts/gpu_check.py --sections profile,ledger   # only these (in the check's order)
    python scripts/gpu_check.py --dry-run        # the same code on tiny-random on the CPU (capture=static)

A GPU for checking this project is lent for 15 minutes at a time, machine start included, so the
check runs its sections in order of value and stops starting new ones once ``--budget`` seconds
have passed (a section started is finished; the JSON names what the budget left out). The JSON
(``--out``, default ``outputs/gpu_check/<time>.json``) is written after every section, so what was
measured survives a check that is cut off. Each section runs for every model (SmolLM2-135M when its
weights are here, else SmolLM2's shape with random weights; the Llama-3-8B shape with random
weights; both kept loaded) before the next section starts; then Gemma 3 270M's shape (random
weights) has its profile measured, for projecting Gemma 3's CPU traces (``python -m
selfspec.project``). Where SmolLM2's GGUF file is absent, the random models have no tokenizer to
borrow: they run on their own vocabularies and the two sections
that decode task text (``training``, ``methods``) say so instead of running:

1. ``profile``: this machine's cost profile (:func:`selfspec.evaluation.profiling.measure_profile`, saved
   under the check's ``outputs/profiles/`` for ``python -m selfspec.project``; 8-18 s on an H100),
   first because the next two price with it;
2. ``capture``: every method (vanilla, Draft & Verify, early exit, DEL, AdaDecode, n-gram, PPD with a
   small tree and with trees of the paper's sizes, then SWIFT, CLaSp and KnapSpec searching their
   skip sets, KnapSpec weighing its sublayers with that profile) built directly with artefacts
   that need no training (an inline skip set, the LM head as exit head, random prompt-token
   embeddings and random trees), always speculating, on one repeated-segment prompt: with the
   model's passes captured (``graphs``; ``--dry-run``: ``static``) and eager (``off``), seconds per
   token in each, tokens equal between the two (greedy and sampled) and to vanilla's (greedy: the
   bf16 consistency on this device), the pass widths, the passes the captured mode routed and
   missed, by kind, and the graphs it captured: in all, inside the timed runs (a search's new skip
   sets, whose capture the captured seconds then include) and dropped by the LRU
   (``capture.MAX_GRAPHS``);
3. ``ledger``: every method of ``capture`` again, captured, with its measured seconds beside those
   the profile just measured predicts from its step trace (eager passes and PPD's host work priced
   apart: issue 38's target is measured / predicted within 10% for every method), per component;
4. ``runtime``: the runtime benchmark's figures (:func:`selfspec.evaluation.runtime.runtime_report`);
5. ``training``: every training job for a few steps, with its peak memory, seconds and the memory
   model's estimate (:func:`selfspec.measure.peak.estimate`);
6. ``methods``: every method evaluated against vanilla with the artefacts just trained, captured and
   eager, by the evaluation runner (seconds per token, consistency, ``passes``).

Plus ``settings``, ``run_info``, the load average and ``sections`` (each section's seconds, or why it
did not run). Random weights give meaningless tokens but real timings, memory and consistency.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

#: per method: the overrides every run gets (PPD, AdaDecode, Draft & Verify read the artefacts trained in step 2).
#: These runs compare capture modes with profile=null (no cost pricing), so the n-gram lookup takes the
#: adaptive draft schedule and DEL the parameter count: their defaults, priced, need a profile
METHODS = {"draft_verify": [], "adadecode": [], "ppd": [], "del": ["method.cost_model=parameters"], "early_exit": [],
           "ngram": ["method.draft_schedule=adaptive"]}
JOB_ORDER = ("heads", "prompts", "ppd_tree", "skips", "draft_vocab")  # the tree needs the prompts


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


def plan(dry_run: bool) -> dict:
    """What the check runs: models (name -> model overrides), capture modes, sizes (the settings the JSON records)."""
    if dry_run:
        return {
            "models": {"tiny-random": ["model.dtype=bfloat16", "model.device=cpu"]},
            "profile_only": {"tiny-gemma3": ("tiny-gemma3", ["model.dtype=bfloat16"])},
            "captures": ["static", "off"],
            "runtime": {"ks": [1, 2, 4], "contexts": [64], "new_tokens": 8, "repeats": 2},
            "profile": {"rows": [1, 2, 4], "prefill_rows": [16], "contexts": [0, 32], "repeats": 2},
            "evaluate": ["task=xsum", "n_examples=1", "max_new_tokens=8", "warmup=1", "warmup_max_new_tokens=4"],
            "method_overrides": {"early_exit": ["method.exit_layer=1"]},
            "train_extra": [],
            "capture": {"prompt_segment": 16, "prompt_repeats": 4, "new_tokens": 12, "repeats": 1,
                        "ppd_nodes": [24]},
        }
    return {
        # SmolLM2 when its weights are here, else its shape with random weights; the 8B shape with random
        # weights (SmolLM2's tokenizer for the task prompts)
        "models": {"smollm2-135m": [], "llama3-8b-random": ["+model.tokenizer=smollm2-135m"]},
        # Gemma 3 270M's shape, random weights: its profile only (~40 s), for projecting its CPU traces
        "profile_only": {"gemma3-270m-random": ("tiny-gemma3", GEMMA3_SHAPE)},
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
    }


#: SmolLM2-135M's shape with random weights (model=llama3-8b-random with these overrides), for a GPU
#: machine that has no copy of SmolLM2's weights (README: how to bring the 94 MB GGUF file over)
SMOLLM2_SHAPE = ["model=llama3-8b-random", "model.name=smollm2-135m-random", "+model.tokenizer=smollm2-135m",
                 "model.random.vocab_size=49152", "model.random.hidden_size=576", "model.random.intermediate_size=1536",
                 "model.random.num_hidden_layers=30", "model.random.num_attention_heads=9",
                 "model.random.num_key_value_heads=3", "model.random.tie_word_embeddings=true",
                 "model.random.rope_theta=100000.0"]


def model_present(name: str) -> str | None:
    """None when the model's weights can be loaded here, else why not (SmolLM2: the asset not fetched)."""
    from selfspec.config import model_config
    from selfspec.models.loading import check_model_config

    try:
        check_model_config(model_config(name))
    except Exception as err:  # noqa: BLE001 - any reason it cannot load is recorded, the check goes on
        return f"{type(err).__name__}: {err}"
    return None


def capture_decoders(model, p: dict, profile=None) -> dict:
    """name -> a function building that method's decoder on ``model`` (a LayeredModel), with
    artefacts that need no training, always speculating (``never_slower: false``). The methods that
    search their skip sets while decoding come last (a budget cut leaves them out first), searching
    within the check's short generations; KnapSpec only with a cost ``profile`` (it weighs its
    sublayers with one)."""
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


def capture_section(loaded, p: dict, deadline: float, profile_data: dict | None = None) -> dict:
    """Every method with its passes captured and eager (module docstring, section 2); methods past
    the deadline are named in ``skipped``. KnapSpec weighs its sublayers with the profile the
    check measured first; without one (``--sections`` left it out) it is named in ``left_out``."""
    import statistics
    from collections import Counter

    import torch

    from selfspec.decoding import Sampling
    from selfspec.measure.profile import Profile
    from selfspec.models.layered import LayeredModel

    c = p["capture"]
    captured = loaded.model
    eager = LayeredModel(captured.hf, name=f"{captured.name}-eager", linear_kernel=captured.linear_kernel)
    g = torch.Generator().manual_seed(0)
    segment = torch.randint(0, captured.vocab_size, (c["prompt_segment"],), generator=g).tolist()
    prompt = segment * c["prompt_repeats"]
    steps = captured.steps
    out: dict = {"mode": captured.capture, "prompt_tokens": len(prompt), "new_tokens": c["new_tokens"],
                 "methods": {}, "skipped": []}
    if profile_data is None:
        out["left_out"] = {"knapspec": "no profile to weigh its sublayers with: the profile section did not run"}
    reference = None
    profile = Profile(profile_data) if profile_data is not None else None
    for name, make in capture_decoders(captured, p, profile).items():
        if time.perf_counter() > deadline:
            out["skipped"].append(name)
            continue
        before = ((steps.routed, steps.missed, dict(steps.kinds), dict(steps.missed_kinds), dict(steps.routed_rows),
                   steps.built, steps.evicted) if steps else None)
        row: dict = {}
        for mode, model in (("captured", captured), ("eager", eager)):
            dec = make(model)
            dec.generate(prompt, c["new_tokens"])  # captures its graphs (and warms the eager path)
            warm = steps.built if steps and model is captured else None
            runs = [dec.generate(prompt, c["new_tokens"]) for _ in range(c["repeats"])]
            if warm is not None:  # graphs captured inside the timed runs (a search's new skip sets): their
                timed_built = steps.built - warm  # capture is in the captured seconds per token
            sampled = dec.generate(prompt, c["new_tokens"], Sampling(temperature=0.8, top_p=0.9, seed=3))
            row[mode] = {"s_per_token": statistics.median(r.seconds / max(r.new_tokens, 1) for r in runs),
                         "tau": runs[0].new_tokens / max(runs[0].steps, 1), "tokens": runs[0].tokens,
                         "sampled_tokens": sampled.tokens}
        if name == "vanilla":
            reference = row["eager"]["tokens"]
        r = {"s_per_token": {m: row[m]["s_per_token"] for m in row}, "tau": row["captured"]["tau"],
             "eager_over_captured": row["eager"]["s_per_token"] / row["captured"]["s_per_token"],
             "same_tokens_captured_and_eager": row["captured"]["tokens"] == row["eager"]["tokens"],
             "same_sampled_tokens_captured_and_eager": row["captured"]["sampled_tokens"] == row["eager"]["sampled_tokens"],
             "consistency": {m: _agreement(row[m]["tokens"], reference) for m in row}}
        if before is not None:
            r["passes"] = {"routed": steps.routed - before[0], "missed": steps.missed - before[1],
                           "kinds": _delta(steps.kinds, before[2]), "missed_kinds": _delta(steps.missed_kinds, before[3]),
                           "built": steps.built - before[5], "built_while_timed": timed_built,
                           "evicted": steps.evicted - before[6]}
            widths = Counter(_delta(steps.routed_rows, before[4])) + Counter(r["passes"]["missed_kinds"])
            trees = {int(k.split()[1]): n for k, n in widths.items() if k.startswith("tree ")}
            if trees:
                r["tree_pass_rows"] = {"min": min(trees), "max": max(trees), "passes": sum(trees.values())}
        out["methods"][name] = r
        print(f"  capture {name}: {r['s_per_token']['captured'] * 1e3:.2f} ms/token captured, "
              f"{r['eager_over_captured']:.2f}x eager; consistency {r['consistency']['captured']:.3f}; "
              f"missed {r.get('passes', {}).get('missed')}, captured while timed "
              f"{r.get('passes', {}).get('built_while_timed')}", flush=True)
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


def ledger_section(loaded, p: dict, profile_data: dict | None, deadline: float) -> dict:
    """Every method of :func:`capture_decoders` on the captured model: measured seconds (median of
    the repeats) against the seconds this machine's profile predicts from the step trace, in total
    and per component (module docstring, section 3)."""
    import statistics

    from selfspec.measure.profile import Profile

    if profile_data is None:
        return {"skipped": "no profile: the profile section did not run"}
    profile = Profile(profile_data)
    model, c = loaded.model, p["capture"]
    segment = list(range(10, 10 + c["prompt_segment"]))
    prompt = segment * c["prompt_repeats"]
    out: dict = {"profile": profile.name, "methods": {}, "skipped": []}
    for name, make in capture_decoders(model, p, profile).items():
        if time.perf_counter() > deadline:
            out["skipped"].append(name)
            continue
        dec = make(model)
        dec.generate(prompt, c["new_tokens"])  # captures
        runs = sorted((dec.generate(prompt, c["new_tokens"]) for _ in range(max(c["repeats"], 3))),
                      key=lambda g: g.seconds)
        g = runs[len(runs) // 2]
        trace = [t.row() for t in g.trace]
        predicted, unpriced = profile.predict(trace), profile.unpriced(trace)
        out["methods"][name] = {"seconds": g.seconds, "predicted": sum(predicted.values()),
                                "measured_over_predicted": g.seconds / sum(predicted.values()),
                                "tau": g.new_tokens / max(g.steps, 1), "unpriced_passes": unpriced,
                                "measured_ledger": g.ledger, "predicted_ledger": predicted}
        r = out["methods"][name]
        print(f"  ledger {name}: measured / predicted {r['measured_over_predicted']:.2f}", flush=True)
    ratios = [r["measured_over_predicted"] for r in out["methods"].values()]
    out["within_10_percent"] = sum(abs(x - 1) <= 0.1 for x in ratios)
    out["median_ratio"] = statistics.median(ratios) if ratios else None
    return out


def profile_section(loaded, p: dict) -> dict:
    """This machine's cost profile of the model, saved where ``python -m selfspec.project`` finds it."""
    from selfspec.evaluation.profiling import measure_profile

    profile = measure_profile(loaded.model, **(p["profile"] or {}))
    path = Path(os.environ["SELFSPEC_OUTPUTS"]) / "profiles" / f"{profile.name}.json"
    profile.save(path)
    return {"profile": profile.data, "profile_path": str(path)}


def runtime_section(loaded, p: dict) -> dict:
    """The runtime benchmark's figures (bench_runtime's function)."""
    from selfspec.evaluation.runtime import runtime_report

    r = p["runtime"]
    return {"runtime": runtime_report(loaded, tuple(r["ks"]), tuple(r["contexts"]), r["new_tokens"], r["repeats"],
                                      llama_cpp=False)}


def training_section(loaded, model: str, overrides: list[str], p: dict) -> dict:
    """Every training job for a few steps on ``loaded``: peak memory, seconds, the memory model's estimate."""
    import torch

    from measure_memory import BASE, COMMON
    from selfspec import memory
    from selfspec.config import compose
    from selfspec.measure import peak
    from selfspec.train import run_job

    meter = peak.Peak(loaded.model.device)
    shape = peak.shape_of(compose([f"model={model}", *overrides], config_name="train").model)
    out = {}
    for job in JOB_ORDER:
        cfg = compose([f"model={model}", *overrides, *COMMON, f"job={job}", *BASE[job], *p["train_extra"]],
                      config_name="train")
        est = memory.job_estimate(job, shape, cfg, loaded.model.dtype, loaded.model.device)
        if loaded.model.device.type == "cuda":
            torch.cuda.empty_cache()
        meter.reset()
        t0 = time.perf_counter()
        summary = run_job(cfg, loaded)
        seconds = time.perf_counter() - t0
        measured = meter.read()
        steps = summary.get("steps")
        out[job] = {"peak_bytes": measured, "estimate_bytes": est.total, "estimate_error": est.total / measured - 1,
                    "estimate_parts": {"weights": est.weights, "runtime": est.runtime,
                                       **{t.name: t.bytes for t in est.parts}},
                    "seconds": seconds, "steps": steps,
                    "seconds_per_step": summary["train_seconds"] / steps if steps and "train_seconds" in summary else None,
                    "artefact": summary["artefact"]}
        print(f"  {job}: peak {measured / 2**20:.0f} MB (estimate {est.total / 2**20:.0f} MB), {seconds:.1f} s",
              flush=True)
    return out


def methods_section(model: str, overrides: list[str], loaded, p: dict, out_dir: Path) -> dict:
    """Every method against vanilla, with the model loaded under each capture mode: seconds per token,
    consistency and tau per method and mode (``bf16_consistency.evaluate_rows``); and per static mode
    the passes its runner took, by kind (chain, tree, kept states, partial layers) and those it missed."""
    from bf16_consistency import evaluate_rows

    from selfspec.config import compose
    from selfspec.models.loading import load_model

    rows: dict[str, dict] = {}
    passes: dict[str, dict] = {}
    for capture in p["captures"]:
        base = [f"model={model}", *overrides, f"model.capture={capture}", "logger=none", "progress=false",
                "profile=null", *p["evaluate"]]
        if loaded is None or loaded.model.capture != capture:
            loaded = None  # the previous mode's model is dropped before the next one loads
            import gc

            gc.collect()
            loaded = load_model(compose(base).model)
        steps = loaded.model.steps  # counted from here: the sections before ran their own passes on it
        before = ((steps.routed, steps.captured, steps.missed, dict(steps.kinds), dict(steps.missed_kinds))
                  if steps is not None else None)
        for method, extra in METHODS.items():
            cfg = compose([*base, f"method={method}", *extra, *p["method_overrides"].get(method, [])])
            for row in evaluate_rows(cfg, out_dir / capture / method, loaded, method):
                if row["method"] == method:
                    rows.setdefault(method, {})[capture] = row
                elif row["method"] == "vanilla":
                    rows.setdefault("vanilla", {}).setdefault(capture, row)
            print(f"  {capture} {method}: {rows[method][capture]['s_per_token'] * 1e3:.2f} ms/token, "
                  f"consistency {rows[method][capture]['consistency']}", flush=True)
        if before is not None:  # which passes the static shapes took: every method's kinds, none missed
            passes[capture] = {"routed": steps.routed - before[0], "captured": steps.captured - before[1],
                               "missed": steps.missed - before[2], "kinds": _delta(steps.kinds, before[3]),
                               "missed_kinds": _delta(steps.missed_kinds, before[4])}
    captured, eager = p["captures"]
    for r in rows.values():
        if captured in r and eager in r:
            r["eager_over_captured"] = r[eager]["s_per_token"] / r[captured]["s_per_token"]
    return rows, passes, loaded


#: the sections, in order of value (module docstring); each runs for every model before the next starts
SECTIONS = ("profile", "capture", "ledger", "runtime", "training", "methods")
#: the sections that decode task text, left out for a model with no tokenizer (random weights on a
#: machine without SmolLM2's GGUF file, whose tokenizer the random models borrow)
TEXT_SECTIONS = ("training", "methods")


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


def run_section(section: str, result: dict, loaded, p: dict, out_dir: Path, deadline: float):
    """One section for one model, its figures into ``result``; returns the model as loaded after it
    (the ``methods`` section reloads the model in each capture mode)."""
    model, overrides = result["model"]["name"], result["model"]["overrides"]
    t = time.perf_counter()
    if section == "capture":
        result["capture"] = capture_section(loaded, p, deadline, result.get("profile"))
    elif section == "profile":
        result.update(profile_section(loaded, p))
    elif section == "ledger":
        result["ledger"] = ledger_section(loaded, p, result.get("profile"), deadline)
    elif section == "runtime":
        result.update(runtime_section(loaded, p))
    elif section == "training":
        result["training"] = training_section(loaded, model, [*overrides, f"model.capture={p['captures'][0]}"], p)
    else:
        result["methods"], result["passes"], loaded = methods_section(model, overrides, loaded, p,
                                                                      out_dir / "evaluate" / result["key"])
    result["sections"][section] = time.perf_counter() - t
    return loaded


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny-random on the CPU, capture=static (fast)")
    ap.add_argument("--out", type=Path, default=None, help="the JSON (default outputs/gpu_check/<time>.json)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds after which no new section starts (default 300 on a GPU, none with --dry-run)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"the sections to run, comma-separated, in the check's order (default: all of {','.join(SECTIONS)}; "
                         "ledger needs profile)")
    args = ap.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        raise SystemExit(f"--sections {args.sections!r}: {', '.join(unknown) or 'none given'} not among "
                         f"{', '.join(SECTIONS)}")
    if "ledger" in chosen and "profile" not in chosen:
        raise SystemExit("--sections: ledger prices the step traces on the profile the same check measures; "
                         "add profile")
    budget = args.budget if args.budget is not None else (None if args.dry_run else 300.0)
    if budget is not None and budget <= 0:
        raise SystemExit(f"--budget must be a positive number of seconds, got {args.budget}")
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from selfspec.store.runinfo import run_info

    if not args.dry_run and not torch.cuda.is_available():
        raise SystemExit("scripts/gpu_check.py needs a CUDA device (none is visible); --dry-run runs the same "
                         "code on tiny-random on this CPU")
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    out = args.out or ROOT / "outputs" / "gpu_check" / f"{stamp}{'-dry-run' * args.dry_run}.json"
    work = out.with_suffix("")  # artefacts, evaluation runs and profiles of this check
    work.mkdir(parents=True, exist_ok=True)
    os.environ["SELFSPEC_OUTPUTS"] = str(work / "outputs")
    p = plan(args.dry_run)
    t0 = time.perf_counter()
    deadline = t0 + budget if budget is not None else float("inf")
    report = {"dry_run": args.dry_run, "settings": p, "sections_chosen": chosen, "budget_seconds": budget, "run_info": run_info(),
              "load_average": [os.getloadavg()[0]], "models": {}, "skipped": {}}

    def save() -> None:  # what is done so far survives a failure or a machine taken back
        report["seconds"] = time.perf_counter() - t0
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1, default=str))
        tmp.replace(out)

    entries: list[tuple[dict, object]] = []  # (record, loaded model), each model loaded once
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
        entry = {"key": key, "model_name": model, "overrides": overrides, "no_text": None}
        borrowed = [o for o in overrides if o.startswith("+model.tokenizer=")]
        why_no_text = borrowed and model_present(borrowed[0].split("=", 1)[1])
        if why_no_text:  # a random model then runs on its own vocabulary: no text, so no task prompts
            entry["overrides"] = [o for o in overrides if o not in borrowed]
            entry["no_text"] = f"no tokenizer ({borrowed[0]} cannot load: {why_no_text})"
            print(f"{key}: {entry['no_text']}; the sections that need text are left out", flush=True)
        entries.append((entry, None))
    for key, (model, overrides) in p["profile_only"].items():  # a shape for projections: its profile only
        entries.append(({"key": key, "model_name": model, "overrides": overrides, "no_text": None,
                         "only": ("profile",)}, None))
    # each section for every model before the next; the shapes profiled only for projections last
    order = [(section, i) for section in SECTIONS if section in chosen
             for i, (entry, _) in enumerate(entries) if "only" not in entry]
    order += [(section, i) for i, (entry, _) in enumerate(entries) if "only" in entry
              for section in entry["only"] if section in chosen]
    for section, i in order:
        entry, loaded = entries[i]
        key = entry["key"]
        why_not = ("the budget was spent" if time.perf_counter() > deadline
                   else entry["no_text"] if section in TEXT_SECTIONS else None)
        if why_not:
            report["models"].setdefault(key, {"sections": {}})["sections"][section] = f"not run: {why_not}"
            print(f"{key}: {section} left out ({why_not})", flush=True)
            continue
        if loaded is None:
            record, loaded = load_entry(entry["model_name"], entry["overrides"], p)
            record["key"] = key
            report["models"][key] = record | {"sections": report["models"].get(key, {}).get("sections", {})}
        print(f"{key}: {section}", flush=True)
        loaded = run_section(section, report["models"][key], loaded, p, work, deadline)
        entries[i] = (entry, loaded)
        save()
    report["seconds"] = time.perf_counter() - t0
    report["load_average"].append(os.getloadavg()[0])
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"gpu check: {out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

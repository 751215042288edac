"""One command for a GPU machine: runtime, cost profile, training memory, captured vs eager, bf16 consistency.

    python scripts/gpu_check.py                  # on a GPU (make gpu-check): SmolLM2 if fetched, the Llama-3-8B shape
    python scripts/gpu_check.py --dry-run        # the same code on tiny-random on the CPU (capture=static), about 3 min

For each model (``--dry-run``: tiny-random in bfloat16 on the CPU), one JSON (``--out``, default
``outputs/gpu_check/<time>.json``) gets

1. ``runtime``: the runtime benchmark's figures (:func:`selfspec.evaluation.runtime.runtime_report`: v(k),
   prefill, vanilla vs ``generate``, bandwidth) and ``profile``, this machine's cost profile
   (:func:`selfspec.models.profile.measure_profile`, also saved under ``outputs/profiles/``);
2. ``training``: every training job (heads, prompts, skips, ppd_tree, draft_vocab) run for a few steps on
   the loaded model (``selfspec.train.run_job``, ``scripts/measure_memory.py``'s small settings), with its
   peak memory (:class:`selfspec.memory.Peak`: ``torch.cuda.max_memory_allocated`` on a GPU, the
   resident peak on a CPU), its seconds and the memory model's estimate (:func:`selfspec.memory.estimate`);
   the artefacts land under the run's own ``SELFSPEC_OUTPUTS``;
3. ``methods``: every method (Draft & Verify, AdaDecode, PPD, DEL, early exit, n-gram) evaluated against
   vanilla with those artefacts by the evaluation runner (``scripts/bf16_consistency.py``'s
   ``evaluate_rows``), once with the model loaded with ``capture=graphs`` (``--dry-run``: ``static``) and
   once with ``capture=off``: per method seconds per token in both, their ratio, and the greedy consistency
   with vanilla (the bf16 consistency on this device); ``passes``: how many passes the captured mode's
   runner took by kind (chain, tree, kept states, partial layers) and how many it missed (none expected).

Plus ``settings`` (everything resolved), ``run_info`` (git commit, library versions, hardware) and the load
average. Random weights (the 8B shape) give meaningless tokens but real timings, memory and consistency.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

#: per method: the overrides every run gets (PPD, AdaDecode, Draft & Verify read the artefacts trained in step 2).
#: These runs compare capture modes with profile=null (no cost pricing), so the n-gram lookup takes the
#: adaptive draft schedule: its default, priced, needs a profile
METHODS = {"draft_verify": [], "adadecode": [], "ppd": [], "del": [], "early_exit": [],
           "ngram": ["method.draft_schedule=adaptive"]}
JOB_ORDER = ("heads", "prompts", "ppd_tree", "skips", "draft_vocab")  # the tree needs the prompts


def plan(dry_run: bool) -> dict:
    """What the check runs: models (name -> model overrides), capture modes, sizes (the settings the JSON records)."""
    if dry_run:
        return {
            "models": {"tiny-random": ["model.dtype=bfloat16", "model.device=cpu"]},
            "captures": ["static", "off"],
            "runtime": {"ks": [1, 2, 4], "contexts": [64], "new_tokens": 8, "repeats": 2},
            "profile": {"rows": [1, 2, 4], "prefill_rows": [16], "contexts": [0, 32], "repeats": 2},
            "evaluate": ["task=xsum", "n_examples=1", "max_new_tokens=8", "warmup=1", "warmup_max_new_tokens=4"],
            "method_overrides": {"early_exit": ["method.exit_layer=1"]},
            "train_extra": [],
        }
    return {
        # SmolLM2 when its weights are fetched; the 8B shape with random weights (SmolLM2's tokenizer for prompts)
        "models": {"smollm2-135m": [], "llama3-8b-random": ["+model.tokenizer=smollm2-135m"]},
        "captures": ["graphs", "off"],
        "runtime": {"ks": [1, 2, 4, 8, 16, 32], "contexts": [128, 512, 1024], "new_tokens": 32, "repeats": 5},
        "profile": None,  # measure_profile's defaults
        "evaluate": ["task=xsum", "n_examples=3", "max_new_tokens=48", "warmup=1", "warmup_max_new_tokens=16"],
        "method_overrides": {},
        "train_extra": ["job.steps=5"],
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


def runtime_section(loaded, p: dict) -> dict:
    """The runtime benchmark's figures and this machine's cost profile (bench_runtime's functions)."""

    from selfspec.evaluation.runtime import runtime_report
    from selfspec.models.profile import measure_profile

    r = p["runtime"]
    report = runtime_report(loaded, tuple(r["ks"]), tuple(r["contexts"]), r["new_tokens"], r["repeats"], llama_cpp=False)
    profile = measure_profile(loaded.model, **(p["profile"] or {}))
    path = Path(os.environ["SELFSPEC_OUTPUTS"]) / "profiles" / f"{profile.name}.json"
    profile.save(path)
    return {"runtime": report, "profile": profile.data, "profile_path": str(path)}


def training_section(loaded, model: str, overrides: list[str], p: dict) -> dict:
    """Every training job for a few steps on ``loaded``: peak memory, seconds, the memory model's estimate."""
    import torch

    from measure_memory import BASE, COMMON
    from selfspec import memory
    from selfspec.config import compose
    from selfspec.train import run_job

    peak = memory.Peak(loaded.model.device)
    shape = memory.shape_of(compose([f"model={model}", *overrides], config_name="train").model)
    out = {}
    for job in JOB_ORDER:
        cfg = compose([f"model={model}", *overrides, *COMMON, f"job={job}", *BASE[job], *p["train_extra"]],
                      config_name="train")
        est = memory.estimate(job, shape, cfg, loaded.model.dtype, loaded.model.device)
        if loaded.model.device.type == "cuda":
            torch.cuda.empty_cache()
        peak.reset()
        t0 = time.perf_counter()
        summary = run_job(cfg, loaded)
        seconds = time.perf_counter() - t0
        measured = peak.read()
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
        for method, extra in METHODS.items():
            cfg = compose([*base, f"method={method}", *extra, *p["method_overrides"].get(method, [])])
            for row in evaluate_rows(cfg, out_dir / capture / method, loaded, method):
                if row["method"] == method:
                    rows.setdefault(method, {})[capture] = row
                elif row["method"] == "vanilla":
                    rows.setdefault("vanilla", {}).setdefault(capture, row)
            print(f"  {capture} {method}: {rows[method][capture]['s_per_token'] * 1e3:.2f} ms/token, "
                  f"consistency {rows[method][capture]['consistency']}", flush=True)
        steps = loaded.model.steps
        if steps is not None:  # which passes the static shapes took: every method's kinds, none missed
            passes[capture] = {"routed": steps.routed, "captured": steps.captured, "missed": steps.missed,
                               "kinds": dict(steps.kinds), "missed_kinds": dict(steps.missed_kinds)}
    captured, eager = p["captures"]
    for r in rows.values():
        if captured in r and eager in r:
            r["eager_over_captured"] = r[eager]["s_per_token"] / r[captured]["s_per_token"]
    return rows, passes


def check_model(model: str, overrides: list[str], p: dict, out_dir: Path) -> dict:
    """Every section for one model."""
    from selfspec.config import compose
    from selfspec.memory import shape_of
    from selfspec.models.loading import load_model

    t0 = time.perf_counter()
    cfg = compose([f"model={model}", *overrides, f"model.capture={p['captures'][0]}"])
    loaded = load_model(cfg.model)
    shape = shape_of(cfg.model)
    result = {"model": {"name": model, "overrides": overrides, "params": shape.params, "shape": vars(shape),
                        "dtype": str(loaded.model.dtype).replace("torch.", ""), "device": str(loaded.model.device),
                        "capture": loaded.model.capture, "load_seconds": time.perf_counter() - t0}}
    print(f"{model}: runtime and cost profile", flush=True)
    result.update(runtime_section(loaded, p))
    print(f"{model}: training jobs", flush=True)
    result["training"] = training_section(loaded, model, [*overrides, f"model.capture={p['captures'][0]}"], p)
    print(f"{model}: methods, captured and eager", flush=True)
    result["methods"], result["passes"] = methods_section(model, overrides, loaded, p, out_dir / "evaluate" / model)
    result["seconds"] = time.perf_counter() - t0
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="tiny-random on the CPU, capture=static (fast)")
    ap.add_argument("--out", type=Path, default=None, help="the JSON (default outputs/gpu_check/<time>.json)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from selfspec.runinfo import run_info

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
    report = {"dry_run": args.dry_run, "settings": p, "run_info": run_info(), "load_average": [os.getloadavg()[0]],
              "models": {}, "skipped": {}}
    for model, overrides in p["models"].items():
        why = model_present(model)
        if why is not None:
            report["skipped"][model] = why
            print(f"{model}: skipped ({why})", flush=True)
            continue
        report["models"][model] = check_model(model, overrides, p, work)
        out.write_text(json.dumps(report, indent=1, default=str))  # what is done so far survives a failure
    report["seconds"] = time.perf_counter() - t0
    report["load_average"].append(os.getloadavg()[0])
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"gpu check: {out} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measure the peak memory of every training job and of evaluation, one fresh process per point.

    python scripts/measure_memory.py                       # every point of POINTS -> docs/memory_measured.json
    python scripts/measure_memory.py --only tiny-random    # the points of one shape
    python scripts/measure_memory.py --fit                 # the memory model against the measured points

Each point runs in its own process (``--child``): it composes the job's config, loads the model, and runs
the job (``selfspec.train.run_job`` or the evaluation runner) on that model, recording with
:class:`selfspec.measure.peak.Peak` the resident memory after the imports, the peak through the load, and the peak
from the loaded model to the job's end (the high-water mark reset after the load: a random model is built in
float32 first, a transient a real checkpoint does not have). The parent also records the child's whole peak
(``os.wait4``'s ``ru_maxrss``) and the load average. Every point's outputs go to a temporary
``SELFSPEC_OUTPUTS``, so the continuations the heads and draft-vocabulary jobs generate are never reused
from a cache. The settings are small (a few steps, short sequences); batch and sequence vary at SmolLM2 so
the activation terms can be fitted (:mod:`selfspec.measure.peak`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "memory_measured.json"

COMMON = ["logger=none", "progress=false"]
STEPS = ["job.steps=2", "job.eval_every=0", "job.ckpt_every=0", "job.log_every=1"]
#: job -> its base settings (small: a few steps, short sequences)
BASE = {
    "heads": [*STEPS, "job.n_prompts=4", "job.n_heldout=1", "job.gen_tokens=16", "job.gen_batch=4",
              "job.max_prompt_tokens=64", "job.batch_size=4", "job.max_positions=64"],
    "prompts": [*STEPS, "job.n_conversations=4", "job.held_out=1", "job.context_length=128", "job.inserts=4",
                "job.eval_inserts=4"],
    "skips": ["job.search=bo_model", "job.iterations=2", "job.n_prompts=2", "job.max_new_tokens=8",
              "job.max_prompt_tokens=64", "job.probe_fractions=[]", "job.plot=false",
              "job.acq_n_random=100", "job.acq_n_smart=1"],
    "ppd_tree": ["job.n_prompts=2", "job.max_new_tokens=8", "job.sizes=[1,2,4]", "job.latency_context=64",
                 "job.plot=false"],
    "draft_vocab": ["job.n_prompts=2", "job.n_heldout=1", "job.gen_tokens=8", "job.gen_batch=2",
                    "job.max_prompt_tokens=64", "job.sizes=[512]"],
    "evaluate": ["method=vanilla", "n_examples=1", "max_new_tokens=8", "warmup=0", "profile=null", "task=xsum"],
}
SHAPES = ["tiny-random", "smollm2-135m", "llama3.2-1b-random"]
#: (shape, job, extra settings): the base points of every shape, then batch x sequence varied at SmolLM2
POINTS = [(s, j, []) for s in SHAPES for j in BASE] + [
    ("smollm2-135m", "heads", ["job.gen_tokens=64", "job.max_positions=256"]),
    ("smollm2-135m", "prompts", ["job.context_length=512", "job.inserts=16", "job.n_ept=8"]),
    ("llama3.2-1b-random", "prompts", ["job.context_length=512", "job.inserts=16", "job.n_ept=4"]),
    ("smollm2-135m", "heads", ["job.gen_batch=8", "job.n_prompts=8", "job.max_prompt_tokens=256"]),
    ("smollm2-135m", "evaluate", ["max_new_tokens=64"]),
]


def overrides(shape: str, job: str, extra: list[str], prompts_dir: Path | None) -> list[str]:
    """The full override list of one point (``job=`` for a training job; ``job.prompts`` for a tree)."""
    from selfspec import memory

    head = [f"model={shape}", *COMMON, *memory.job_overrides(job)]
    tree = [f"job.prompts={prompts_dir}"] if job == "ppd_tree" else []
    return head + BASE[job] + tree + extra


def child(job: str, args: list[str]) -> dict:
    """Run one point in this process; its memory figures (bytes) and seconds. ``args[0]`` is the
    job's primary config (:func:`selfspec.memory.primary_config`, named by the parent so that this
    process imports nothing more before its figures), the rest its overrides."""
    from selfspec.measure.peak import Peak, _status_kb

    started = _status_kb("VmRSS") * 1024  # before selfspec's heavy imports
    import torch

    from selfspec.config import compose
    from selfspec.models.loading import load_model, resolve_device

    primary, *args = args
    cfg = compose(args, config_name=primary)
    peak = Peak(resolve_device(str(cfg.model.device)))
    imported = peak.current()
    t0 = time.perf_counter()
    loaded = load_model(cfg.model)
    load_peak, loaded_now = peak.read(), peak.current()
    peak.reset()
    t1 = time.perf_counter()
    if primary != "train":
        from selfspec.evaluation import evaluate

        with tempfile.TemporaryDirectory() as out:
            evaluate(cfg, out, loaded=loaded)
    else:
        from selfspec.train import run_job

        run_job(cfg, loaded)
    return {"rss_start": started, "rss_imported": imported, "load_peak": load_peak, "rss_loaded": loaded_now,
            "job_peak": peak.read(), "load_seconds": t1 - t0, "job_seconds": time.perf_counter() - t1,
            "dtype": str(loaded.model.dtype).replace("torch.", ""), "threads": torch.get_num_threads()}


def measure(shape: str, job: str, extra: list[str], outputs: Path, prompts_dir: Path | None) -> dict:
    """One point in a fresh process (``--child``), with its whole peak from ``os.wait4``."""
    from selfspec.memory import primary_config

    args = overrides(shape, job, extra, prompts_dir)
    if job in ("heads", "draft_vocab"):  # the continuations they generate: never from an earlier point's cache
        shutil.rmtree(outputs / "artefacts" / "heads_data", ignore_errors=True)
    env = {**os.environ, "SELFSPEC_OUTPUTS": str(outputs), "PYTHONPATH": str(ROOT / "src")}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as result, tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen([sys.executable, __file__, "--child", job, "--", primary_config(job), *args], stdout=result,
                                stderr=errors, text=True, env=env, cwd=str(outputs))
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (its whole peak)
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        result.seek(0)
        errors.seek(0)
        lines, err = result.read().strip().splitlines(), errors.read()
    if code != 0 or not lines:
        raise RuntimeError(f"{shape} {job} {extra} failed (exit {code}):\n{err[-3000:]}")
    figures = json.loads(lines[-1])
    return {"shape": shape, "job": job, "settings": extra, "overrides": args, **figures,
            "process_peak": usage.ru_maxrss * 1024,
            "seconds": time.perf_counter() - t0, "load_average": [load, os.getloadavg()[0]]}


def model_parts(point: dict) -> tuple[float, float]:
    """A measured point's estimate without the fitted numbers: (weights + optimizer, activation terms)."""
    import torch

    from selfspec import memory
    from selfspec.config import compose
    from selfspec.measure import peak

    job = point["job"]
    cfg = compose(point["overrides"], config_name=memory.primary_config(job))
    shape = peak.shape_of(cfg.model)
    b = peak.dtype_bytes(getattr(torch, point["dtype"]))
    context = point.get("context", peak.EVAL_CONTEXT)
    phases = memory.terms(job, shape, cfg, b, context)
    fixed = shape.params * b
    # the phase that is largest at s = 1 (the estimator takes the largest after scaling: the same order here)
    phase = max(phases, key=lambda p: sum(t.bytes for t in p))
    return fixed + sum(t.bytes for t in phase if not t.activation), sum(t.bytes for t in phase if t.activation)


#: jobs whose batch x sequence was varied (POINTS): their activation factor ``s`` is fitted; the others keep
#: s = 1 (the tensors counted from their shapes), their measured points being too small to show growth
FITTED_S = ("heads", "prompts")


def fit(points: list[dict]) -> dict:
    """Per job, ``runtime`` and ``s`` of each job's :class:`selfspec.measure.peak.MemoryModel` by least squares of the relative error
    of the CPU peak (``job_peak``) over its points (``s`` >= 0; 1 for jobs not in :data:`FITTED_S`), and
    every point's estimate."""
    import numpy as np

    out, rows = {}, []
    for job in BASE:
        pts = [p for p in points if p["job"] == job]
        if not pts:
            continue
        parts = [model_parts(p) for p in pts]
        y = np.array([p["job_peak"] for p in pts], dtype=float)
        A = np.array([[1.0, act] for _, act in parts]) / y[:, None]
        rhs = (y - np.array([fixed for fixed, _ in parts])) / y
        runtime, s = np.linalg.lstsq(A, rhs, rcond=None)[0] if job in FITTED_S else (None, 1.0)
        if runtime is None or s < 0:  # s fixed (1, or 0 where the data show no growth): the constant alone
            s = max(s, 0.0)
            rest = rhs - s * A[:, 1]
            runtime = float(np.sum(rest / y) / np.sum(1 / y**2))
        out[job] = {"s": round(float(s), 3), "runtime": round(float(runtime) / 2**20, 1) * 2**20}
        for p, (fixed, act) in zip(pts, parts):
            pred = out[job]["runtime"] + fixed + out[job]["s"] * act
            rows.append({"shape": p["shape"], "job": job, "settings": " ".join(p["settings"]),
                         "measured_mb": p["job_peak"] / 2**20, "estimate_mb": pred / 2**20,
                         "error": pred / p["job_peak"] - 1, "seconds": p["seconds"], "load": p["load_average"]})
    return {"fit": out, "points": rows, "error": max(abs(r["error"]) for r in rows)}


def markdown(result: dict) -> str:
    """The table of the measured points (docs/2026-11-27-memory.md) against the fitted estimate."""
    lines = ["| shape | job | settings (beside the base ones) | peak MB | estimate MB | error | seconds | load |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["points"]:
        lines.append(f"| {r['shape']} | {r['job']} | {r['settings'] or 'base'} | {r['measured_mb']:.0f} | "
                     f"{r['estimate_mb']:.0f} | {r['error']:+.1%} | {r['seconds']:.0f} | "
                     f"{r['load'][0]:.1f}–{r['load'][1]:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--only", nargs="*", default=None, help="shapes to measure (default: all)")
    p.add_argument("--again", action="store_true", help="measure points already in --out again (default: skip them)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--fit", action="store_true", help="fit the memory model to the measured points (--out)")
    p.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.overrides)))
        return 0
    sys.path.insert(0, str(ROOT / "src"))
    if args.fit:
        points = json.loads(args.out.read_text())["points"]
        result = fit(points)
        for r in result["points"]:
            print(f"{r['shape']:20s} {r['job']:12s} {r['settings']:60s} {r['measured_mb']:8.1f} MB "
                  f"estimate {r['estimate_mb']:8.1f} MB ({r['error']:+.1%})")
        print("FIT =", json.dumps(result["fit"]), f"ERROR = {result['error']:.3f}")
        print(markdown(result))
        return 0
    from selfspec.store.files import write_json

    done = json.loads(args.out.read_text())["points"] if args.out.exists() else []
    key = lambda shape, job, extra: (shape, job, tuple(extra))  # noqa: E731
    measured = {key(d["shape"], d["job"], d["settings"]) for d in done}
    todo = [(s, j, e) for s, j, e in POINTS if (not args.only or s in args.only)
            and (args.again or key(s, j, e) not in measured)]
    # a tree to measure needs its shape's prompts artefact: the base prompts point runs again
    todo = [pt for pt in POINTS if pt in todo or (pt[1:] == ("prompts", []) and (pt[0], "ppd_tree", []) in todo)]
    with tempfile.TemporaryDirectory(prefix="selfspec-memory-") as tmp:
        for shape, job, extra in todo:
            outputs = Path(tmp) / shape
            outputs.mkdir(exist_ok=True)
            point = measure(shape, job, extra, outputs, outputs / "artefacts" / "prompts" / shape)
            done = [d for d in done if key(d["shape"], d["job"], d["settings"]) != key(shape, job, extra)] + [point]
            print(f"{shape:20s} {job:12s} {' '.join(extra):60s} job peak {point['job_peak'] / 2**20:8.1f} MB "
                  f"load peak {point['load_peak'] / 2**20:8.1f} MB  {point['seconds']:.0f} s "
                  f"load {point['load_average'][0]:.2f}", flush=True)
            write_json(args.out, {"points": done})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tokens/s of vanilla and other methods side by side, in one process, through the evaluation runner.

    python scripts/bench.py                                   # vanilla vs transformers generate, smollm2-135m
    python scripts/bench.py --methods vanilla,draft_verify,hf_prompt_lookup --task xsum --n 5
    python scripts/bench.py --methods ngram,hf_prompt_lookup --task cnndm --n 5  # model-free drafts vs transformers'
    python scripts/bench.py --model tiny-random --n 2 -- sampling.temperature=0.7   # extra Hydra overrides
    python scripts/bench.py --task xsum,cnndm,humaneval,gsm8k,mtbench --methods ... -- model.linear_kernel=torch
                                                              # one run per task, the model loaded once
    python scripts/bench.py --methods vanilla,draft_verify,ngram,hf_generate --batch-sizes 1,2,4,8
                                                              # one run per batch size: throughput, speedup
                                                              # at each size, projected onto the GPU profiles

Same examples, warm-up first, methods interleaved per example (selfspec.evaluation.runner: no
second timing loop). Prints tokens/s, speedup against vanilla, the decode speedup (after the
prompt's step: under sampling each method's samples end at other lengths), the speedup the run's cost profile predicts from the
step traces (docs/design/contracts.md §2.8), tau (mean accepted tokens per step,
bonus included), acceptance rate and consistency with vanilla, and the run's contention check; with ``hf_generate`` in the list,
also the ratio vanilla tokens/s / generate tokens/s (selfspec's runtime should not be slower).
Results land in ``--out`` (results.jsonl, summary.json), as for ``python -m selfspec.evaluate``.

``--batch-sizes``: one run per batch size (``batch_size=B``, :mod:`selfspec.evaluation.batches`) in
``<out>/b<B>``, the model loaded once; prints each method's throughput, its speedup over vanilla at
the same batch size, the speedup the run's profile predicts and its projection onto every shipped
GPU profile of the model's shape (``python -m selfspec.project``), and writes ``batches.json`` and
``speedup_by_batch.png`` (the figure of speedup against batch size) into ``--out``.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def batch_sizes(text: str) -> list[int]:
    """``--batch-sizes``: comma-separated positive integers, each once (``1,2,4,8``). Anything else is
    refused by argparse, naming the flag (issue 68: ``abc``, ``1.5`` and ``,`` ended in a raw
    ValueError, and an empty value ran a plain benchmark as if the flag were not given)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(re.fullmatch(r"[0-9]+", p) and int(p) >= 1 for p in parts) or len(set(map(int, parts))) < len(parts):
        raise argparse.ArgumentTypeError(f"takes comma-separated positive integers, each once (1,2,4,8), got {text!r}")
    return [int(p) for p in parts]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default="vanilla,hf_generate",
                   help="comma-separated conf/method names; the baseline (vanilla) always runs")
    p.add_argument("--model", default="smollm2-135m", help="conf/model name")
    p.add_argument("--task", default="xsum", help="conf/task name, or several comma-separated: one run per "
                   "task (in <out>/<task>), the model loaded once")
    p.add_argument("--n", type=int, default=5, help="examples")
    p.add_argument("--max-new-tokens", type=int, default=128, help="token budget per example (0 = the task's)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up generations per method")
    p.add_argument("--out", type=Path, default=None, help="run directory (default outputs/bench/<model>/<time>)")
    p.add_argument("--batch-sizes", type=batch_sizes, default=None,
                   help="comma-separated batch sizes (positive integers): one run per size, throughput and "
                   "speedup at each")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides of conf/evaluate.yaml (after --)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from selfspec.config import compose
    from selfspec.evaluation import evaluate

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    baseline = "vanilla"
    others = [m for m in methods if m != baseline]
    label = others[0] if others else baseline
    tasks = [t.strip() for t in args.task.split(",") if t.strip()]
    overrides = {task: [
        f"model={args.model}", f"task={task}", f"method={label}", f"baseline={baseline}",
        "compare=[" + ",".join(others[1:]) + "]", f"n_examples={args.n}", f"warmup={args.warmup}",
        *([f"max_new_tokens={args.max_new_tokens}"] if args.max_new_tokens else []), *args.overrides,
    ] for task in tasks}
    cfgs = {task: compose(o) for task, o in overrides.items()}
    out = args.out or ROOT / "outputs" / "bench" / args.model / time.strftime("%Y-%m-%d_%H-%M-%S")
    if args.batch_sizes is not None:
        if len(tasks) > 1:
            raise SystemExit(f"--batch-sizes takes one task, got --task {args.task}")
        return by_batch_size(overrides[tasks[0]], label, args.batch_sizes, out)
    loaded = None
    if len(tasks) > 1:  # every task's run is checked before the one model load
        from selfspec.evaluation.runner import prepare
        from selfspec.models.loading import load_model

        for cfg in cfgs.values():
            check_memory(cfg, prepare(cfg, label))
        loaded = load_model(cfgs[tasks[0]].model)
    for task, cfg in cfgs.items():
        run_dir = out / task if len(tasks) > 1 else out
        summary = evaluate(cfg, run_dir, loaded, label=label)
        print(report(summary))
        print(f"\nresults: {run_dir}\n")
    return 0


def check_memory(cfg, plan) -> None:
    """The runner's memory check of ``cfg`` (:func:`selfspec.measure.peak.check_fits`, its
    ``batch_size`` included) for the run ``plan`` describes. :func:`~selfspec.evaluation.evaluate`
    makes it only when it loads the model itself; here one model serves several runs, so each run's
    config is checked before that load (issue 68: ``--batch-sizes`` ran every size unchecked)."""
    from selfspec.evaluation.runner import JOB, MEMORY
    from selfspec.measure.peak import EVAL_CONTEXT, check_fits

    prompt = getattr(plan.task.cfg, "max_prompt_tokens", None) or EVAL_CONTEXT
    check_fits(JOB, MEMORY, cfg, prompt + plan.budget, prompt)


def by_batch_size(overrides: list[str], label: str, sizes: list[int], out: Path) -> int:
    """One run per batch size (module docstring), the model loaded once; the table, JSON and figure."""
    from selfspec.config import compose
    from selfspec.evaluation import evaluate
    from selfspec.evaluation.runner import prepare
    from selfspec.measure.profile import Profile, shipped
    from selfspec.models.loading import load_model
    from selfspec.project import project_run
    from selfspec.reporting.plots import batch_plot
    from selfspec.store.files import write_json

    cfgs = {b: compose([*overrides, f"batch_size={b}"]) for b in sizes}
    cfg = cfgs[sizes[0]]
    for c in cfgs.values():  # every size checked before the model loads, its memory at its batch size too
        check_memory(c, prepare(c, label))
    loaded = load_model(cfgs[sizes[0]].model)
    gpus = [Profile.load(p) for name, p in shipped().items() if name.startswith("cuda-")]
    table: dict = {}
    for b, c in cfgs.items():
        summary = evaluate(c, out / f"b{b}", loaded, label=label)
        per = summary["batches"] if b > 1 else {m: {"tokens_per_s": r["tokens_per_s"], "speedup": r["speedup"],
                                                        "predicted_speedup": r.get("predicted_speedup"),
                                                        "latency_s": r["seconds_per_token"] and
                                                        r["seconds_per_token"] * r["new_tokens"] / max(r["n_examples"], 1)}
                                                    for m, r in summary["methods"].items()}
        for m, r in per.items():
            table.setdefault(m, {})[b] = {k: r.get(k) for k in ("tokens_per_s", "latency_s", "speedup",
                                                                 "predicted_speedup")}
            table[m][b]["consistency"] = summary["methods"][m]["consistency"]
        for profile in gpus:
            try:
                projected = project_run(out / f"b{b}", profile)
            except ValueError:  # another model shape
                continue
            for m, r in projected.items():
                key = "batch_predicted_speedup" if b > 1 else "predicted_speedup"
                table[m][b].setdefault("projected", {})[profile.name] = r.get(key)
        contention = summary.get("contention") or {}
        if contention.get("ratio") is not None:
            print(f"batch size {b}: vanilla at {contention['ratio']:.2f}x its predicted time"
                  + (" -- FLAGGED: measured under load" if contention.get("flagged") else ""), flush=True)
    print(batch_table(table, sizes))
    write_json(out / "batches.json", table)
    measured = {m: {b: r["speedup"] for b, r in rows.items() if r["speedup"]} for m, rows in table.items()
                if m != "vanilla"}
    projected: dict = {}
    for m, rows in table.items():
        for b, r in rows.items():
            for name, v in (r.get("projected") or {}).items():
                if m != "vanilla" and v:
                    projected.setdefault(name, {}).setdefault(m, {})[b] = v
    plot = batch_plot(measured, projected, out / "speedup_by_batch.png",
                      f"{cfg.model.name}, {cfg.task.name}: speedup against batch size")
    print(f"\nresults: {out} (batches.json{', ' + plot.path.name if plot else ''})")
    return 0


def batch_table(table: dict, sizes: list[int]) -> str:
    """Per method and batch size: throughput, speedup over vanilla at that size, the profile's predicted
    speedup, consistency with vanilla."""
    w = _name_width(table)
    lines = [f"{'method':<{w}}" + "".join(f"{'B=' + str(b):>34}" for b in sizes),
             f"{'':<{w}}" + "".join(f"{'tok/s':>10}{'speedup':>8}{'predicted':>10}{'cons':>6}" for _ in sizes)]
    for m, rows in table.items():
        cells = []
        for b in sizes:
            r = rows.get(b) or {}
            cells.append(f"{_f(r.get('tokens_per_s'), 1):>10}{_f(r.get('speedup'), 2):>8}"
                         f"{_f(r.get('predicted_speedup'), 2):>10}{_f(r.get('consistency'), 2):>6}")
        lines.append(f"{m:<{w}}" + "".join(cells))
    return "\n".join(lines)


def report(summary: dict) -> str:
    """The benchmark table of a run's summary (and the vanilla / generate ratio)."""
    from selfspec.measure.speedup import speedup

    per = summary["methods"]
    base = summary["baseline"]
    info = summary["run_info"]
    w = _name_width(per)
    lines = [
        f"model {summary['model']}  task {summary['task']}  examples {per[base]['n_examples']}  "
        f"max_new_tokens {summary['max_new_tokens']}  {'greedy' if summary['greedy'] else 'sampling'}  "
        f"{info.get('device')} {info.get('dtype')}  threads {info['hardware'].get('cpu_threads')}",
        f"{'method':<{w}}{'tok/s':>9}{'ms/tok':>9}{'speedup':>9}{'decode':>8}{'predicted':>10}{'tau':>7}{'accept':>8}"
        f"{'consist':>9}",
    ]
    for name, m in per.items():
        lines.append(f"{name:<{w}}{_f(m['tokens_per_s'], 2):>9}{_f(m['seconds_per_token'] and 1e3 * m['seconds_per_token'], 1):>9}"
                     f"{_f(m['speedup'], 3):>9}{_f(m.get('decode_speedup'), 3):>8}"
                     f"{_f(m.get('predicted_speedup'), 3):>10}{_f(m['tau'], 2):>7}"
                     f"{_f(m['acceptance_rate'], 3):>8}{_f(m['consistency'], 2):>9}")
    contention = summary.get("contention")
    if contention:
        spoiled = contention.get("spoiled") or []
        lines.append(f"\ncontention: vanilla took {contention['ratio']:.2f}x its predicted time"
                     + (f"; {len(spoiled)} generation(s) spoiled by a burst of load: "
                        + ", ".join(f"{g['method']} {g['id']} {g['excess']:.2f}x" for g in spoiled) if spoiled else "")
                     + (" -- FLAGGED: measured under load" if contention["flagged"] else " (not flagged)"))
    ratio = speedup(per["hf_generate"]["seconds_per_token"], per[base]["seconds_per_token"]) if "hf_generate" in per else None
    if ratio is not None:  # the baseline's speedup over transformers' generate
        verdict = "ok" if ratio >= 1.0 else "SLOWER than generate"
        lines.append(f"\n{base} / transformers generate tokens/s: {ratio:.3f}  ({verdict})")
    return "\n".join(lines)


def _name_width(names) -> int:
    """The tables' first column: as wide as the longest method's name and its gap, at least 22."""
    return max([22, *(len(name) + 2 for name in names)])


def _f(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())

"""Tokens/s of vanilla and other methods side by side, in one process, through the evaluation runner.

    python scripts/bench.py                                   # vanilla vs transformers generate, smollm2-135m
    python scripts/bench.py --methods vanilla,draft_verify,hf_prompt_lookup --task xsum --n 5
    python scripts/bench.py --methods ngram,hf_prompt_lookup --task cnndm --n 5  # model-free drafts vs transformers'
    python scripts/bench.py --model tiny-random --n 2 -- sampling.temperature=0.7   # extra Hydra overrides
    python scripts/bench.py --task xsum,cnndm,humaneval,gsm8k,mtbench --methods ... -- model.linear_kernel=torch
                                                              # one run per task, the model loaded once

Same examples, warm-up first, methods interleaved per example (selfspec.evaluation.runner: no
second timing loop). Prints tokens/s, speedup against vanilla, the decode speedup (after the
prompt's step: under sampling each method's samples end at other lengths), the speedup the run's cost profile predicts from the
step traces (docs/design.md §2.8), tau (mean accepted tokens per step,
bonus included), acceptance rate and consistency with vanilla, and the run's contention check; with ``hf_generate`` in the list,
also the ratio vanilla tokens/s / generate tokens/s (selfspec's runtime should not be slower).
Results land in ``--out`` (results.jsonl, summary.json), as for ``python -m selfspec.evaluate``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    cfgs = {task: compose([
        f"model={args.model}", f"task={task}", f"method={label}", f"baseline={baseline}",
        "compare=[" + ",".join(others[1:]) + "]", f"n_examples={args.n}", f"warmup={args.warmup}",
        *([f"max_new_tokens={args.max_new_tokens}"] if args.max_new_tokens else []), *args.overrides,
    ]) for task in tasks}
    out = args.out or ROOT / "outputs" / "bench" / args.model / time.strftime("%Y-%m-%d_%H-%M-%S")
    loaded = None
    if len(tasks) > 1:  # every task's run is checked before the one model load
        from selfspec.evaluation.runner import prepare
        from selfspec.models.loading import load_model

        for cfg in cfgs.values():
            prepare(cfg, label)
        loaded = load_model(cfgs[tasks[0]].model)
    for task, cfg in cfgs.items():
        run_dir = out / task if len(tasks) > 1 else out
        summary = evaluate(cfg, run_dir, loaded, label=label)
        print(report(summary))
        print(f"\nresults: {run_dir}\n")
    return 0


def report(summary: dict) -> str:
    """The benchmark table of a run's summary (and the vanilla / generate ratio)."""
    from selfspec.measure.speedup import speedup

    per = summary["methods"]
    base = summary["baseline"]
    info = summary["run_info"]
    lines = [
        f"model {summary['model']}  task {summary['task']}  examples {per[base]['n_examples']}  "
        f"max_new_tokens {summary['max_new_tokens']}  {'greedy' if summary['greedy'] else 'sampling'}  "
        f"{info.get('device')} {info.get('dtype')}  threads {info['hardware'].get('cpu_threads')}",
        f"{'method':<22}{'tok/s':>9}{'ms/tok':>9}{'speedup':>9}{'decode':>8}{'predicted':>10}{'tau':>7}{'accept':>8}"
        f"{'consist':>9}",
    ]
    for name, m in per.items():
        lines.append(f"{name:<22}{_f(m['tokens_per_s'], 2):>9}{_f(m['seconds_per_token'] and 1e3 * m['seconds_per_token'], 1):>9}"
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


def _f(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())

"""The prompt's prefill with each library that can multiply a float32 pass of more than ``MAX_ROWS`` rows: oneDNN's
matmul (what the runtime takes where torch has it, :func:`selfspec.models.kernels.wide_path`) and torch's
``F.linear`` (MKL's GEMM), in turns in one process, on real prompts of each task.

    python scripts/bench_prefill.py                                   # SmolLM2, three XSum and three HumanEval prompts
    python scripts/bench_prefill.py --model qwen2.5-coder-1.5b --task xsum

Each timing is the runtime's forward over a prompt's length of tokens into a fresh cache and the head on one
row, as a decoding run's first step (its cost does not depend on the tokens' values); each library in turn,
``--rounds`` times; medians per prompt. Docs:
docs/2026-12-06-prefill-on-onednn.md.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="conf/model name")
    p.add_argument("--task", default="xsum,humaneval", help="comma-separated conf/task names")
    p.add_argument("--n", type=int, default=3, help="prompts per task")
    p.add_argument("--rounds", type=int, default=2, help="timings of each prompt with each library")
    args = p.parse_args(argv)
    for name in ("n", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def prefill_seconds(model, n: int) -> float:
    """One prefill of ``n`` tokens into a fresh cache with the head on one row, timed by the cost profile's
    own timer (:func:`selfspec.measure.costs.time_forward`: a warm-up run, then the timed one)."""
    from selfspec.measure.costs import time_forward

    return time_forward(model, model.new_cache(n + 1), 0, n, repeats=1, logits_rows=1)


def main(argv=None) -> int:
    args = parse(argv)
    from selfspec.config import model_config
    from selfspec.models import kernels
    from selfspec.models.loading import load_model
    from selfspec.tasks import build_task

    loaded = load_model(model_config(args.model))
    model = loaded.model
    if model.dtype != torch.float32 or model.linear_kernel != "skinny":
        raise SystemExit(f"{args.model} runs {model.dtype} on the {model.linear_kernel} kernel here: the wide float32 "
                         "product is the runtime kernels' float32 prefill")
    libraries = {"torch": lambda: "torch", kernels.wide_path(): kernels.wide_path}
    real = kernels.wide_path
    print(f"{args.model}, {torch.get_num_threads()} threads; libraries: {', '.join(libraries)}", flush=True)
    try:
        for task_name in args.task.split(","):
            task = build_task({"name": task_name, "n_examples": args.n})
            prompts = [task.encode(example, loaded.tokenizer) for example in task.examples()]
            times = {name: [[] for _ in prompts] for name in libraries}
            for _ in range(args.rounds):
                for name, path in libraries.items():
                    kernels.wide_path = path
                    for i, ids in enumerate(prompts):
                        times[name][i].append(prefill_seconds(model, len(ids)))
            for name in libraries:
                cells = ", ".join(f"{len(ids)}: {statistics.median(t) * 1e3:.0f} ms" for ids, t in zip(prompts, times[name]))
                print(f"{task_name:<10} {name:<7} {cells}", flush=True)
    finally:
        kernels.wide_path = real
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

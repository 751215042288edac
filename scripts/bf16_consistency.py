"""Greedy consistency with vanilla in bfloat16, with and without row-wise attention, in one process.

    python scripts/bf16_consistency.py --tasks gsm8k humaneval --n 10 --out outputs/bf16

For each task, the evaluation runner (``python -m selfspec.evaluate``'s own code) runs vanilla and
the lossless methods on the same examples twice on one loaded ``model.dtype=bfloat16`` model: with
``kernels.ROWWISE_DTYPES`` empty (masked attention of a verification pass in one SDPA call, as
before) and on (each row as a one-token step calls it; docs/design/runtime.md §4). Prints consistency
(share of examples whose tokens equal vanilla's) and seconds per token per method and mode;
results land in ``<out>/<off|on>/<task>/`` (results.jsonl, summary.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Draft & Verify's skip set when no searched one is given: every other attention sublayer of the
#: upper two thirds and every fourth MLP sublayer (SmolLM2-135M, 30 layers)
SKIPS = ["method.skip_attn=[8,10,12,14,16,18,20,22,24,26]", "method.skip_mlp=[9,13,17,21,25]"]


def evaluate_rows(cfg, out: Path, loaded, label: str) -> list[dict]:
    """Run the evaluation ``cfg`` describes on ``loaded`` into ``out`` (the evaluation runner, as
    ``python -m selfspec.evaluate`` runs it); one row per method: examples, consistency with the
    baseline, seconds per token and tau (``scripts/gpu_check.py`` reads the same rows)."""
    from selfspec.evaluation import evaluate

    summary = evaluate(cfg, out, loaded=loaded, label=label)
    return [{"method": name, "n": m.get("n_examples"), "consistency": m.get("consistency"),
             "s_per_token": m.get("seconds_per_token"), "tau": m.get("tau")} for name, m in summary["methods"].items()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tasks", nargs="+", default=["gsm8k", "humaneval", "mtbench", "xsum", "cnndm"])
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--method", default="draft_verify", help="the first method (Draft & Verify, with the skip set below)")
    p.add_argument("--compare", default="adadecode_mixed,del,early_exit", help="methods run beside it")
    p.add_argument("--modes", default="off,on", help="row-wise attention off/on, in this order")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "bf16")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from selfspec.config import compose
    from selfspec.models import kernels
    from selfspec.models.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    common = [f"model={args.model}", "model.dtype=bfloat16", f"method={args.method}", *SKIPS,
              f"compare=[{args.compare}]", f"n_examples={args.n}", f"max_new_tokens={args.max_new_tokens}",
              "warmup=1", "warmup_max_new_tokens=8", "progress=false"]
    loaded = None
    table = []
    rowwise = kernels.ROWWISE_DTYPES  # the default set
    for task in args.tasks:
        cfg = compose([f"task={task}", *common], config_name="evaluate")
        loaded = loaded or load_model(cfg.model)
        for mode in args.modes.split(","):
            kernels.ROWWISE_DTYPES = rowwise if mode == "on" else frozenset()
            for row in evaluate_rows(cfg, args.out / mode / task, loaded, args.method):
                row = {"task": task, "mode": mode, **row}
                table.append(row)
                print(json.dumps(row), flush=True)
    from selfspec.store.files import write_json

    write_json(args.out / "table.json", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

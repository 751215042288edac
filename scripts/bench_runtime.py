"""The runtime at the machine's limit: v(k), prefill, vanilla vs generate (vs llama.cpp), LM head share, bandwidth.

    python scripts/bench_runtime.py                         # smollm2-135m on this machine
    python scripts/bench_runtime.py --contexts 512 --no-llama-cpp   # leave the llama.cpp peer out
    python scripts/bench_runtime.py --model tiny-random --contexts 64 --repeats 2
    python scripts/bench_runtime.py -- model.linear_kernel=torch   # model config overrides

See :mod:`selfspec.evaluation.runtime` for what each figure means. llama.cpp joins as a third
decoding peer when llama-cpp-python is installed (``make llamacpp``); otherwise one line says so.
``--out`` writes the figures as JSON (the demo's report shows them).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="conf/model name")
    p.add_argument("--ks", default="1,2,4,8,16,32", help="new-token counts k of v(k)")
    p.add_argument("--contexts", default="128,512,1024", help="context lengths")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per decoding run (vanilla vs generate)")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats (medians)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave out the llama.cpp peer (when installed)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("overrides", nargs="*", help="model config overrides, e.g. model.dtype=bfloat16 (after --)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import torch

    from selfspec.config import compose
    from selfspec.evaluation.runtime import format_report, runtime_report
    from selfspec.models.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    ks = tuple(int(k) for k in args.ks.split(","))
    contexts = tuple(int(c) for c in args.contexts.split(","))
    if 1 not in ks or min(ks) < 1:
        raise SystemExit(f"--ks must include 1 and only positive counts, got {args.ks}")
    cfg = compose([f"model={args.model}", *args.overrides])
    report = runtime_report(load_model(cfg.model), ks, contexts, args.new_tokens, args.repeats,
                            llama_cpp=not args.no_llama_cpp)
    print(format_report(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
        print(f"figures: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

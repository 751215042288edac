"""The skinny kernel's AVX-512 path against its AVX2 path (bit-identical outputs), in one process:
passes of k new tokens after a context, the two paths alternating, medians per path.

    python scripts/bench_kernel_isa.py                         # SmolLM2, 512 context, k = 1..32
    python scripts/bench_kernel_isa.py --ks 1,8 -- model.dtype=bfloat16

Needs a CPU with AVX-512F (``torch.ops.selfspec.skinny_isa``); prints one line per k: each path's
median milliseconds per pass and AVX2 / AVX-512 (above 1: the AVX-512 path is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--ks", default="1,2,4,8,16,32")
    p.add_argument("--rounds", type=int, default=15, help="alternations (each times every k once per path)")
    p.add_argument("overrides", nargs="*", help="model config overrides (after --)")
    args = p.parse_args(argv)
    import torch

    from selfspec.config import compose
    from selfspec.measure.costs import context_cache, time_forward
    from selfspec.models import kernels
    from selfspec.models.loading import load_model

    loaded = load_model(compose([f"model={args.model}", *args.overrides]).model)
    m = loaded.model
    kernels.load()
    isa = torch.ops.selfspec.skinny_isa
    if isa("auto") != "avx512":
        raise SystemExit("this CPU has no AVX-512F: there is only the AVX2 path")
    ks = [int(k) for k in args.ks.split(",")]
    cache = context_cache(m, args.context, max(ks))
    seconds = {path: {k: [] for k in ks} for path in ("avx2", "avx512")}
    load = os.getloadavg()[0]
    for r in range(args.rounds + 1):
        for path in ("avx2", "avx512") if r % 2 else ("avx512", "avx2"):
            isa(path)
            for k in ks:
                t = time_forward(m, cache, args.context, k, repeats=3)
                if r:  # the first round warms up
                    seconds[path][k].append(t)
    isa("auto")
    print(f"{loaded.name} {str(m.dtype).replace('torch.', '')}, context {args.context}, {torch.get_num_threads()} "
          f"threads, {args.rounds} rounds (load {load:.2f} -> {os.getloadavg()[0]:.2f}); ms per pass, medians")
    print(f"{'k':>4}{'AVX2':>10}{'AVX-512':>10}{'AVX2/AVX-512':>14}")
    for k in ks:
        a, b = (statistics.median(seconds[path][k]) * 1e3 for path in ("avx2", "avx512"))
        print(f"{k:>4}{a:>10.2f}{b:>10.2f}{a / b:>14.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What MKL's strict reproducibility mode costs (selfspec.numerics): a prefill and a decoding step
with and without it, each mode in its own process (MKL fixes its mode at its first call), the
processes alternating.

    python scripts/bench_cbwr.py                          # SmolLM2, 512-token prefill, 5 rounds
    python scripts/bench_cbwr.py --model tiny-random --rounds 2 --context 64

Prints, per mode, the median over rounds of each process's median prefill seconds (``--context``
tokens, head on the last row) and one-token step seconds at that context, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

#: label -> MKL_CBWR for the process (None: MKL's own default, no reproducibility mode: the process
#: makes a product before importing selfspec, which would otherwise ask for the strict mode)
MODES = {"strict (AUTO,STRICT: selfspec's default)": "AUTO,STRICT", "off (MKL's default)": None}


def measure(model: str, context: int, repeats: int) -> dict:
    """One process's figures, in the mode its environment set (none: MKL's default)."""
    import torch

    if "MKL_CBWR" not in os.environ:
        torch.ones(8, 8) @ torch.ones(8, 8)  # MKL starts before selfspec can ask for a mode

    from selfspec import numerics
    from selfspec.config import compose
    from selfspec.measure.costs import context_cache, time_forward
    from selfspec.models.loading import load_model

    loaded = load_model(compose([f"model={model}"]).model)
    m = loaded.model
    empty = context_cache(m, 0, context)
    prefill = time_forward(m, empty, 0, context, repeats=repeats, logits_rows=1)
    full = context_cache(m, context, 1)
    step = time_forward(m, full, context, 1, repeats=4 * repeats)
    return {"mode": numerics.mode(), "prefill": prefill, "step": step, "threads": torch.get_num_threads(),
            "load": os.getloadavg()[0]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5, help="processes per mode, alternating")
    p.add_argument("--repeats", type=int, default=5, help="timed prefills per process (steps: 4x)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.model, args.context, args.repeats)))
        return 0
    runs: dict[str, list[dict]] = {name: [] for name in MODES}
    for r in range(args.rounds):
        for name, value in (MODES.items() if r % 2 == 0 else reversed(MODES.items())):
            env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
            if value is not None:
                env["MKL_CBWR"] = value
            out = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--context",
                                  str(args.context), "--repeats", str(args.repeats)], env=env, check=True,
                                 capture_output=True, text=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {name: {k: statistics.median(x[k] for x in rs) for k in ("prefill", "step")} for name, rs in runs.items()}
    print(f"{args.model}, {args.context}-token prefill and a one-token step at that context, {args.rounds} "
          f"processes per mode (medians; load {[round(x['load'], 2) for rs in runs.values() for x in rs]})")
    for name, rs in runs.items():
        print(f"  {name:<42} MKL mode {rs[0]['mode']:<12} prefill {med[name]['prefill'] * 1e3:8.1f} ms  "
              f"step {med[name]['step'] * 1e3:7.2f} ms  (prefills {[round(x['prefill'] * 1e3, 1) for x in rs]})")
    strict, off = (med[name] for name in MODES)
    print(f"  strict / off: prefill {strict['prefill'] / off['prefill']:.3f}, step {strict['step'] / off['step']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

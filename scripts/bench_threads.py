"""Decoding under background load: torch's threads throughout against the thread policy.

    python scripts/bench_threads.py                                  # SmolLM2; quiet, 2 niced, 1 busy
    python scripts/bench_threads.py --methods vanilla --loads quiet,busy1 --new-tokens 32

For each background load the script starts busy processes of its own (``niced2``: two at
``nice -n 19``; ``busy1``: one at normal priority; ``busy2``: two), then generates with each method
twice per repeat, interleaved: with torch's threads throughout (``threads=fixed``) and with the
thread policy (``threads=adaptive``, :mod:`selfspec.decoding.threads`). It prints milliseconds per
token (medians over the repeats), their ratio, the share of steps the policy ran on one thread, and
each figure against the same arm's quiet one. Both arms' tokens are checked equal. The profile that
prices the steps is this machine's (``make profile``) or a shipped one of this CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

#: load name -> (busy processes, their niceness)
LOADS = {"quiet": (0, 0), "niced2": (2, 19), "busy1": (1, 0), "busy2": (2, 0)}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="conf/model name")
    p.add_argument("--methods", default="vanilla,draft_verify,adadecode_lmhead", help="comma-separated conf/method names")
    p.add_argument("--loads", default="quiet,niced2,busy1", help=f"comma-separated, of {', '.join(LOADS)}")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per generation")
    p.add_argument("--repeats", type=int, default=3, help="generations per arm and load (medians)")
    args = p.parse_args(argv)
    unknown = [x for x in args.loads.split(",") if x not in LOADS]
    if unknown:
        p.error(f"--loads: unknown {', '.join(unknown)}; choose from {', '.join(LOADS)}")
    return args


def busy(n: int, niceness: int) -> list[subprocess.Popen]:
    """``n`` processes spinning on one core each at ``niceness``."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             preexec_fn=(lambda: os.nice(niceness)) if niceness else None) for _ in range(n)]


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    from selfspec.config import load_method_config, model_config
    from selfspec.decoding import Sampling, build_decoder
    from selfspec.measure.profile import Profile, default_path, matching_shipped
    from selfspec.models.loading import load_model

    loaded = load_model(model_config(args.model))
    model = loaded.model
    path = default_path(model, model.device)
    profile = Profile.load(path) if path.is_file() else matching_shipped(model)
    if profile is None:
        raise SystemExit(f"no cost profile of {args.model} for this machine: run `make profile MODEL={args.model}` first")
    text = "Article: The quick brown fox jumps over the lazy dog. " * 20 + "\nSummary:"
    ids = loaded.tokenizer(text)["input_ids"]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    print(f"{args.model}, {torch.get_num_threads()} threads, {args.new_tokens} new tokens, profile {profile.name}; "
          f"load average before: {os.getloadavg()[0]:.2f}")
    quiet: dict[tuple[str, str], float] = {}
    print(f"{'load':8s} {'method':18s} {'fixed ms/tok':>12s} {'adaptive':>9s} {'ratio':>6s} {'1-thread':>8s} "
          f"{'fixed/quiet':>11s} {'adapt/quiet':>11s}")
    for load in args.loads.split(","):
        procs = busy(*LOADS[load])
        try:
            time.sleep(1.0)
            for label in methods:
                arms = {arm: build_decoder(load_method_config(label), model, profile=profile, threads=arm,
                                           eos_token_ids=(), tokenizer=loaded.tokenizer) for arm in ("fixed", "adaptive")}
                per_token: dict[str, list[float]] = {"fixed": [], "adaptive": []}
                one, steps, tokens = 0, 0, {}
                for arm, dec in arms.items():
                    dec.generate(ids, 16, Sampling())  # warm-up (the policy keeps what it learned)
                for _ in range(args.repeats):
                    for arm, dec in arms.items():
                        g = dec.generate(ids, args.new_tokens, Sampling())
                        per_token[arm].append(g.seconds / len(g.tokens))
                        tokens[arm] = g.tokens
                        if arm == "adaptive":
                            one += g.stats.get("steps_one_thread", 0)
                            steps += len(g.trace) - 1
                if tokens["fixed"] != tokens["adaptive"]:
                    raise SystemExit(f"{label}: the thread policy changed the tokens")
                fixed, adaptive = (statistics.median(per_token[a]) * 1e3 for a in ("fixed", "adaptive"))
                if load == "quiet":
                    quiet[label, "fixed"], quiet[label, "adaptive"] = fixed, adaptive
                against = (f"{fixed / quiet[label, 'fixed']:11.2f} {adaptive / quiet[label, 'adaptive']:11.2f}"
                           if (label, "fixed") in quiet else f"{'':11s} {'':11s}")
                print(f"{load:8s} {label:18s} {fixed:12.1f} {adaptive:9.1f} {fixed / adaptive:6.2f} "
                      f"{one / max(steps, 1):8.0%} {against}", flush=True)
        finally:
            for p in procs:
                p.kill()
                p.wait()
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

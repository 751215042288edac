"""The runtime at the machine's limit: v(k), prefill, vanilla vs generate (vs llama.cpp), LM head share, bandwidth.

    python scripts/bench_runtime.py                         # smollm2-135m on this machine
    python scripts/bench_runtime.py --contexts 512 --no-llama-cpp   # leave the llama.cpp peer out
    python scripts/bench_runtime.py --model tiny-random --contexts 64 --repeats 2
    python scripts/bench_runtime.py -- model.linear_kernel=torch   # model config overrides

See :mod:`selfspec.evaluation.runtime` for what each figure means. llama.cpp joins as a third
decoding peer when llama-cpp-python is installed (``make llamacpp``); otherwise one line says so.
``--out`` writes the figures as JSON (the demo's report shows them).

It also measures this machine's cost profile of the model (:mod:`selfspec.measure.profile`: what
every op of a step costs here, the file ``python -m selfspec.project`` re-costs runs with) and
writes it to the asset cache, where ``evaluate`` (``profile=auto``) finds it, and to
``--profile-out`` (default ``outputs/profiles/<name>.json``). ``--profile-only`` (``make profile``)
measures the profile alone.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


#: timed repeats of the runtime figures (the profile's are measure_profile's unless --repeats is given)
REPEATS = 7


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="conf/model name")
    p.add_argument("--ks", default="1,2,4,8,16,32", help="new-token counts k of v(k)")
    p.add_argument("--contexts", default="128,512,1024", help="context lengths")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per decoding run (vanilla vs generate)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed repeats, of which medians are taken: the runtime figures' (default {REPEATS}) and "
                        "the profile's (default measure_profile's REPEATS, as profile=auto measures; recorded in the profile)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave out the llama.cpp peer (when installed)")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("--profile-out", type=Path, default=None,
                   help="write the cost profile here too (default outputs/profiles/<profile name>.json)")
    p.add_argument("--profile-only", action="store_true", help="measure the cost profile only (make profile)")
    p.add_argument("--no-profile", action="store_true", help="leave the cost profile out")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the profile: where measuring every point is estimated to take longer, fewer "
                        "are measured, and the profile says which (default: every point; evaluate's profile=auto "
                        "gives 300)")
    p.add_argument("overrides", nargs="*", help="model config overrides, e.g. model.dtype=bfloat16 (after --)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import torch

    from selfspec.config import compose
    from selfspec.evaluation.runtime import format_report, runtime_report
    from selfspec.models.loading import load_model
    from selfspec.store.files import write_json

    if args.threads:
        torch.set_num_threads(args.threads)
    ks = tuple(int(k) for k in args.ks.split(","))
    contexts = tuple(int(c) for c in args.contexts.split(","))
    if args.repeats is not None and args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    if args.budget is not None and not args.budget > 0:
        raise SystemExit(f"--budget must be a positive number of seconds, got {args.budget}")
    if 1 not in ks or min(ks) < 1:
        raise SystemExit(f"--ks must include 1 and only positive counts, got {args.ks}")
    cfg = compose([f"model={args.model}", *args.overrides])
    loaded = load_model(cfg.model)
    if not args.profile_only:
        report = runtime_report(loaded, ks, contexts, args.new_tokens, args.repeats or REPEATS, llama_cpp=not args.no_llama_cpp)
        print(format_report(report))
        if args.out:
            write_json(args.out, report)  # atomic, every figure finite or null, as the report reads it
            print(f"figures: {args.out}")
    if not args.no_profile:
        write_profile(loaded.model, args.profile_out, args.repeats, args.budget)
    return 0


def write_profile(model, out: Path | None, repeats: int | None = None, budget: float | None = None) -> None:
    """Measure this machine's cost profile of ``model`` (medians of ``repeats`` timings, by default
    :func:`~selfspec.evaluation.profiling.measure_profile`'s; within ``budget`` seconds, fewer points where
    every one would take longer); keep it in the asset cache and at ``out``."""
    import os

    from selfspec.evaluation.profiling import REPEATS as REPEATS_OF_A_PROFILE, measure_profile
    from selfspec.measure.profile import default_path

    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"warning: load average {load:.2f} while measuring the profile: other processes spoil its "
              "figures; measure it on a quiet machine", file=sys.stderr)
    profile = measure_profile(model, repeats=repeats or REPEATS_OF_A_PROFILE, budget=budget,
                              log=lambda line: print(f"profile: {line}", file=sys.stderr))
    busy = profile.data.get("others_busy")
    if busy is not None and busy > 0.1:
        print(f"warning: other processes took {100 * busy:.0f}% of the CPUs while the profile was measured: "
              "its figures are spoiled; measure it again on a quiet machine", file=sys.stderr)
    cached = default_path(model, model.device)
    profile.save(cached)
    out = out or Path("outputs/profiles") / f"{profile.name}.json"
    profile.save(out)
    print(f"cost profile {profile.name}: {out} (and {cached}, where evaluate's profile=auto finds it); "
          f"plain step {profile.plain_step() * 1e3:.1f} ms, of which host {profile.host * 1e3:.2f} ms; "
          f"measured in {profile.data['seconds_to_measure']} s")


if __name__ == "__main__":
    sys.exit(main())

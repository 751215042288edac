"""The CPU kernel's paths side by side, in one process: passes of k new tokens after a context,
the paths taking turns, medians per path; and whether each path's k-row pass gives every row the
bits a one-row step gives it.

    python scripts/bench_kernel_paths.py                                   # every path this CPU has
    python scripts/bench_kernel_paths.py --paths float32:avx2,float32:avx512
    python scripts/bench_kernel_paths.py --paths bfloat16:widen,bfloat16:avx512_bf16,bfloat16:torch --ks 1,8,32
    python scripts/bench_kernel_paths.py --linears 1536x576,8960x1536 --paths float32:avx2,float32:avx512 --ks 1,2,4,6

A path is ``dtype:kernel``; ``auto`` is what a run takes on this CPU. float32: ``avx2`` or ``avx512`` (the skinny kernel's two paths,
bit-identical; ``torch.ops.selfspec.skinny_isa``), or ``torch`` (``F.linear``: MKL). bfloat16:
``widen`` (each value widened to float32, float32 FMAs), ``avx512_bf16`` (VDPBF16PS), ``amx``
(TDPBF16PS; ``torch.ops.selfspec.skinny_bf16``), or ``torch`` (``F.linear``: oneDNN; with it the
model's other operators are torch's too, as ``model.linear_kernel=torch`` runs them). Paths this
CPU lacks are named and left out.

Prints one table: per path t(k) in milliseconds, v(k) = t(k) / t(1), t(1) against the first path's,
and up to which k every row of a k-token pass gave the logits (bits) of k one-token steps.

``--linears OUTxIN,...`` times single linears of those shapes instead of a model's passes (the skinny
kernel's float32 paths only): each over enough copies of its weights (``--stream-mb``, past the last-level
cache) that they stream from memory as a model's do, the paths in turns; one table of milliseconds per shape,
path and row count. Where a crossover between the paths lies, per shape (``torch.ops.selfspec.skinny_crossover``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

FLOAT32 = ("auto", "avx2", "avx512", "torch")
BFLOAT16 = ("auto", "widen", "avx512_bf16", "amx", "torch")


def parse_paths(text: str) -> list[tuple[str, str]]:
    paths = []
    for spec in text.split(","):
        dtype, _, kernel = spec.partition(":")
        known = {"float32": FLOAT32, "bfloat16": BFLOAT16}.get(dtype)
        if known is None or kernel not in known:
            raise SystemExit(f"--paths: {spec!r} is not dtype:kernel with float32:{'|'.join(FLOAT32)} or "
                             f"bfloat16:{'|'.join(BFLOAT16)}")
        paths.append((dtype, kernel))
    return paths


def setting(dtype: str, kernel: str, mode: str | None = None) -> None:
    """Set the skinny kernel's float32 (``skinny_isa``) or bfloat16 (``skinny_bf16``) path; a
    checkout before bfloat16 paths had only ``widen``."""
    import torch

    if dtype == "float32":
        torch.ops.selfspec.skinny_isa(mode or kernel)
    elif hasattr(torch.ops.selfspec, "skinny_bf16"):
        torch.ops.selfspec.skinny_bf16(mode or kernel)
    elif (mode or kernel) not in ("widen", "auto"):  # pragma: no cover - an older checkout
        raise RuntimeError(f"this build's bfloat16 linears only widen (no {kernel} path)")


def available(dtype: str, kernel: str) -> str | None:
    """Why this CPU (or this build) cannot run the path, or None."""
    if kernel == "torch":
        return None
    try:
        setting(dtype, kernel)
    except RuntimeError as err:
        return str(err).splitlines()[0]
    finally:
        select("float32", "auto")
    return None


def select(dtype: str, kernel: str) -> None:
    setting("float32", kernel, None if dtype == "float32" and kernel != "torch" else "auto")
    setting("bfloat16", kernel, None if dtype == "bfloat16" and kernel != "torch" else "auto")


def rows_agree(model, context: int, k: int) -> bool:
    """Whether a pass of k tokens after ``context`` gives each row the logits (bits) that k
    one-token steps give."""
    import torch

    from selfspec.measure.costs import context_cache

    cache = context_cache(model, context, k)
    ids = torch.randint(0, model.vocab_size, (1, k), generator=torch.Generator().manual_seed(k))
    with torch.inference_mode():
        whole = model.logits(model.forward(ids, cache, start=context))
        cache.truncate(context)
        steps = torch.cat([model.logits(model.forward(ids[:, i:i + 1], cache, start=context + i)) for i in range(k)], 1)
    return torch.equal(whole, steps)


def usable(paths: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The paths this CPU (and build) can run; each other one is named and left out."""
    kept = []
    for dtype, kernel in paths:
        why = available(dtype, kernel)
        if why:
            print(f"left out {dtype}:{kernel}: {why}")
        else:
            kept.append((dtype, kernel))
    return kept


def in_turns(paths: list[tuple[str, str]], ks: list[int], rounds: int, timed) -> dict[tuple, float]:
    """Median seconds of ``timed(path, k)`` per ``(path, k)``: the paths take turns, their order reversed every
    other turn, each timing every k once per turn; the first turn warms up and is not counted."""
    seconds = {(path, k): [] for path in paths for k in ks}
    for r in range(rounds + 1):
        for path in (paths if r % 2 else paths[::-1]):
            select(*path)
            for k in ks:
                t = timed(path, k)
                if r:
                    seconds[(path, k)].append(t)
    return {key: statistics.median(v) for key, v in seconds.items()}


def time_linears(args) -> int:
    """``--linears``: single float32 linears, weights streamed from memory, the skinny kernel's paths in turns."""
    import torch

    from selfspec.models import kernels

    kernels.load()
    shapes = []
    for spec in args.linears.split(","):
        out, _, inp = spec.lower().partition("x")
        if not (out.isdigit() and inp.isdigit() and int(out) > 0 and int(inp) > 0 and int(inp) % 8 == 0):
            raise SystemExit(f"--linears: {spec!r} is not OUTxIN with IN a multiple of 8 (e.g. 1536x576)")
        shapes.append((int(out), int(inp)))
    paths = [path for path in parse_paths(args.paths) if path[0] == "float32" and path[1] != "torch"]
    if not paths:
        raise SystemExit("--linears times the skinny kernel's float32 paths: --paths float32:auto,float32:avx2,...")
    paths = usable(paths)
    ks = [int(k) for k in args.ks.split(",")]
    g = torch.Generator().manual_seed(0)
    load = os.getloadavg()[0]
    rows = {}
    for out, inp in shapes:
        copies = max(1, int(args.stream_mb * 1e6 / (out * inp * 4)))
        weights = [torch.randn(out, inp, generator=g) for _ in range(copies)]
        x = torch.randn(max(ks), inp, generator=g)

        def timed(path, k, weights=weights, x=x, copies=copies):
            runs = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                for w in weights:
                    torch.ops.selfspec.skinny_linear(x[:k], w)
                runs.append((time.perf_counter() - start) / copies)
            return statistics.median(runs)

        rows[(out, inp)] = {key: t * 1e3 for key, t in in_turns(paths, ks, args.rounds, timed).items()}
    select("float32", "auto")
    print(f"single float32 linears, weights streamed ({args.stream_mb:.0f} MB of copies each), {torch.get_num_threads()} "
          f"threads, {args.rounds} turns of {args.repeats} (load {load:.2f} -> {os.getloadavg()[0]:.2f}); medians, ms: "
          + " / ".join(kernel for _, kernel in paths))
    print(f"{'out x in':<14}" + "".join(f"{str(k) + ' rows':>24}" for k in ks))
    for (out, inp), med in rows.items():
        cells = [" / ".join(f"{med[(path, k)]:.3f}" for path in paths) for k in ks]
        print(f"{f'{out}x{inp}':<14}" + "".join(f"{c:>24}" for c in cells))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--ks", default="1,2,4,8,16,32,64")
    p.add_argument("--paths", default=",".join([f"float32:{k}" for k in FLOAT32] + [f"bfloat16:{k}" for k in BFLOAT16]))
    p.add_argument("--rounds", type=int, default=9, help="turns (each times every k once per path)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes per k and turn (their median is the turn's)")
    p.add_argument("--linears", default=None, help="OUTxIN,...: time single float32 linears of these shapes instead")
    p.add_argument("--stream-mb", type=float, default=256.0, help="--linears: MB of weight copies per shape")
    p.add_argument("overrides", nargs="*", help="model config overrides (after --)")
    args = p.parse_args(argv)
    import torch

    if args.linears:
        return time_linears(args)

    from selfspec.config import compose
    from selfspec.measure.costs import context_cache, time_forward
    from selfspec.models import kernels
    from selfspec.models.loading import load_model

    kernels.load()
    ks = [int(k) for k in args.ks.split(",")]
    if 1 not in ks:
        raise SystemExit("--ks must include 1 (v(k) is against it)")
    paths = usable(parse_paths(args.paths))
    models = {}
    for dtype, kernel in paths:
        key = (dtype, "torch" if kernel == "torch" else "skinny")
        if key not in models:
            overrides = [f"model={args.model}", f"model.dtype={dtype}", f"model.linear_kernel={key[1]}", *args.overrides]
            models[key] = load_model(compose(overrides).model).model
    model_of = {path: models[(path[0], "torch" if path[1] == "torch" else "skinny")] for path in paths}
    caches = {key: context_cache(m, args.context, max(ks)) for key, m in models.items()}
    cache_of = {path: caches[(path[0], "torch" if path[1] == "torch" else "skinny")] for path in paths}
    load = os.getloadavg()[0]
    seconds = in_turns(paths, ks, args.rounds,
                       lambda path, k: time_forward(model_of[path], cache_of[path], args.context, k, repeats=args.repeats))
    agree = {}  # the largest k (of ks) up to which every pass's rows equalled one-row steps
    for path in paths:
        select(*path)
        agree[path] = 1
        for k in sorted(k for k in ks if k > 1):
            if not rows_agree(model_of[path], args.context, k):
                break
            agree[path] = k
    select("float32", "auto")
    print(f"{args.model}, context {args.context}, {torch.get_num_threads()} threads, {args.rounds} turns of "
          f"{args.repeats} passes (load {load:.2f} -> {os.getloadavg()[0]:.2f}); medians")
    med = {path: {k: seconds[(path, k)] * 1e3 for k in ks} for path in paths}
    head = f"{'path':<22}{'t(1) ms':>9}{'vs first':>9}" + "".join(f"{'v(' + str(k) + ')':>8}" for k in ks if k > 1)
    print(head + "  rows equal to one-row steps")
    for path in paths:
        t1 = med[path][1]
        line = f"{path[0] + ':' + path[1]:<22}{t1:>9.2f}{t1 / med[paths[0]][1]:>9.3f}"
        line += "".join(f"{med[path][k] / t1:>8.2f}" for k in ks if k > 1)
        print(line + (f"  up to k = {agree[path]}" if agree[path] > 1 else "  no (k = 2 differs)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

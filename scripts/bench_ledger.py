"""The cost ledger's own cost: its timers and op records against the generations they time.

    python scripts/bench_ledger.py                      # SmolLM2, seven methods, 64 new tokens
    python scripts/bench_ledger.py --model tiny-random --methods vanilla,ngram --new-tokens 16

A micro-benchmark times one phase (two switches of :class:`selfspec.models.ledger.Ledger`, through
``ledger.phase``) and one op record; then each method generates once while the ledger's calls are
counted, and the line says what those calls cost against the generation's time (issue 23: at most
1%). Methods whose artefacts are missing are named and skipped (``make demo`` trains them).
"""

from __future__ import annotations

import argparse
import sys
import time

METHODS = "vanilla,ngram,draft_verify,early_exit,adadecode_lmhead,ppd,del_heads"


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="conf/model name")
    p.add_argument("--methods", default=METHODS, help="comma-separated conf/method names")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per generation")
    p.add_argument("--calls", type=int, default=200_000, help="calls per micro-benchmark")
    return p.parse_args(argv)


def per_call(f, n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        f(i)
    return (time.perf_counter() - t0) / n


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    from selfspec.config import load_method_config, model_config
    from selfspec.decoding import Sampling, build_decoder
    from selfspec.evaluation.profiling import machine_profile
    from selfspec.models.ledger import Ledger, phase
    from selfspec.models.loading import load_model

    ledger = Ledger(torch.device("cpu"))
    ledger.start()

    def one_phase(_):
        with phase(ledger, "draft"):
            pass

    switch = per_call(one_phase, args.calls) / 2  # a phase is two switches
    record = per_call(lambda i: ledger.layers(1, 1, 1, i), args.calls)  # a new op each call: the dearer case
    print(f"one phase switch {switch * 1e6:.3f} us, one op record {record * 1e6:.3f} us")

    loaded = load_model(model_config(args.model))
    text = "Article: The quick brown fox jumps over the lazy dog. " * 20 + "\nSummary:"
    ids = loaded.tokenizer(text)["input_ids"]
    profile = machine_profile(loaded.model)  # DEL's TPL is priced with it (cost_model: measured)
    counts: dict[str, int] = {}
    for name in ("switch", "layers", "head", "linear"):
        original = getattr(Ledger, name)

        def counted(self, *a, _f=original, _n=name, **k):
            counts[_n] = counts.get(_n, 0) + 1
            return _f(self, *a, **k)

        setattr(Ledger, name, counted)
    for label in [m.strip() for m in args.methods.split(",") if m.strip()]:
        try:
            dec = build_decoder(load_method_config(label), loaded.model, eos_token_ids=loaded.eos_token_ids,
                                tokenizer=loaded.tokenizer, profile=profile)
        except (FileNotFoundError, ValueError) as err:
            print(f"{label:18s} skipped: {str(err).splitlines()[0][:100]}")
            continue
        dec.generate(ids, 16, Sampling())  # warm-up
        counts.clear()
        g = dec.generate(ids, args.new_tokens, Sampling())
        records = counts.get("layers", 0) + counts.get("head", 0) + counts.get("linear", 0)
        cost = counts.get("switch", 0) * switch + records * record
        print(f"{label:18s} steps {g.steps:4d}  switches {counts.get('switch', 0):5d}  op records {records:5d}  "
              f"-> {cost * 1e3:.3f} ms of {g.seconds * 1e3:.0f} ms = {100 * cost / g.seconds:.3f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())

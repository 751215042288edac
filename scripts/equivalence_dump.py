"""Dump what every method decodes on the tiny random models, to check that a refactoring changes nothing.

For vanilla and every method configuration of ``tests/test_capture.py``'s ``EVERY_METHOD`` (the list
``tests/test_batch.py`` batches), and the parts those leave out (:data:`EXTRA`: the speculation gate,
drafts from the context first, the n-gram schedules, trained-like exit heads of each kind, a draft
vocabulary), on the tiny random Llama and Gemma 3 of ``tests/test_families.py`` and
the ``tiny-random`` model config (``tests/conftest.py``'s ``tiny``):
each of a few prompts (``tests/test_batch.py``'s ``prompts``) decoded alone on dynamic passes, alone on
static-shape passes (``capture=static``), and as a continuous batch of 3 (dynamic), greedy and sampled
with a fixed seed. Every generation's tokens, stop reason, per-step accepted and drafted counts,
statistics, step traces (with their ledger ops) and ledger components go to a JSON file, with each
batch's counters and ops and each static runner's counters. Wall-clock seconds are left out (they
are not the same twice). Every generation starts from a fresh fork of the method's decoder.

    python scripts/equivalence_dump.py --out /tmp/equiv_before.json
    ... change the code ...
    python scripts/equivalence_dump.py --out /tmp/equiv_after.json
    python scripts/equivalence_dump.py --compare /tmp/equiv_before.json /tmp/equiv_after.json

``--compare`` prints every difference (a path into the dump, the two values) and exits 1 if there are
any. Run it with ``OMP_NUM_THREADS=1``: about a minute or two on one thread.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the tiny random models: ``tests/test_families.py``'s, and the ``tiny-random`` model config
MODELS = ("llama", "gemma3_text", "tiny-random")
NGRAM = {"max_ngram": 3, "min_ngram": 2, "max_draft": 6, "draft_schedule": "adaptive"}
#: configurations beside EVERY_METHOD's: a dict is a method config (``tests/test_batch.py``'s ``make``),
#: a name one of :func:`_built`'s decoders
EXTRA = [
    {"name": "draft_verify", "skip_attn": [1, 2], "skip_mlp": [2], "max_draft": 4},  # gated (never_slower)
    {"name": "del", "max_draft": 4, "cost_model": "parameters"},  # gated
    {"name": "draft_verify", "skip_attn": [1, 2], "skip_mlp": [2], "never_slower": False, "ngram": NGRAM},
    {"name": "early_exit", "exit_layer": 1, "max_draft": 4, "exit_head": "lm_head", "never_slower": False,
     "ngram": NGRAM},
    {"name": "del", "exit_head": "lm_head", "max_draft": 4, "draft_stop": None, "never_slower": False,
     "ngram": NGRAM},
    {"name": "adadecode", "head_kind": "lm_head", "layers": [1, 2], "threshold": 0.0, "ngram": NGRAM},
    {"name": "ngram", "draft_schedule": "constant", "never_slower": False},
    {"name": "ngram", "draft_schedule": "priced", "never_slower": False},
    {"name": "swift", "context_window": 4, "bayes_interval": 3, "max_draft": 4, "search_state": "example",
     "never_slower": False},
    "adadecode-linear-heads", "adadecode-full-heads-vocab", "draft_verify-vocab",
]
PROMPTS = 6
BATCH = 3
SAMPLED_SEED = 3


def _label(method: dict) -> str:
    return "-".join([method["name"], *(f"{k}={v}" for k, v in method.items() if k != "name")])


def _generation(gen) -> dict:
    """What a generation decoded and did, without its wall-clock seconds."""
    return {"tokens": gen.tokens, "prompt_len": gen.prompt_len, "steps": gen.steps, "stop": gen.stop_reason,
            "accepted": gen.accepted_per_step, "drafted": gen.drafted_per_step,
            "stats": {k: v for k, v in sorted(gen.stats.items()) if "second" not in k},
            "trace": [t.row() for t in gen.trace], "ledger": sorted(gen.ledger)}


def _runner(steps) -> dict | None:
    if steps is None:
        return None
    return {"routed": steps.routed, "built": steps.built, "missed": steps.missed, "evicted": steps.evicted,
            "kinds": dict(sorted(steps.kinds.items())), "routed_rows": dict(sorted(steps.routed_rows.items())),
            "missed_kinds": dict(sorted(steps.missed_kinds.items()))}


def _tiny_random():
    from selfspec.config import model_config
    from selfspec.models.loading import load_model

    return load_model(model_config("tiny-random")).model


def _built(name: str, model):
    """A decoder the method configs cannot build without artefacts: AdaDecode over trained-like heads
    (identity plus noise, ``linear``; or full heads over a draft vocabulary), Draft & Verify drafting
    over a draft vocabulary (every third token and the first 40)."""
    import torch

    from selfspec.decoding.adadecode import AdaDecode
    from selfspec.decoding.draft_verify import DraftVerify
    from selfspec.models.heads import DraftVocab, IntermediateHeads
    from selfspec.models.passes import SkipSet
    from conftest import DV_OPTIONS

    vocab = DraftVocab(model, sorted(set(range(0, model.vocab_size, 3)) | set(range(40))))
    if name == "draft_verify-vocab":
        return DraftVerify(model, SkipSet.of([1, 2], [2]), DV_OPTIONS, draft_vocab=vocab)
    kind, with_vocab = ("linear", None) if name == "adadecode-linear-heads" else ("full", vocab)
    heads = IntermediateHeads.identity(model, [1, 2], kind, vocab=with_vocab)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for lin in heads.heads.values():
            lin.weight.add_(torch.randn(lin.weight.shape, generator=g) * 0.02)
    return AdaDecode(model, heads, threshold=0.3, max_early=16, exit_layers=None, early_eos=False)


def _joins(decoder, batch) -> dict:
    """How a batch's job hands its generation the batch: ``joins=batch`` where ``generate`` takes it
    (issue 71); before, the batch was on the model, set by ``Batch.run``, and ``generate`` took none."""
    import inspect

    return {"joins": batch} if "joins" in inspect.signature(decoder.generate).parameters else {}


def dump() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    import selfspec  # noqa: F401  first: MKL's reproducibility mode
    import torch

    from selfspec.decoding import Sampling
    from selfspec.models import capture
    from selfspec.models.batch import Batch
    from test_batch import METHODS, make, prompts
    from test_families import N_NEW, tiny_family

    torch.set_num_threads(1)
    ps = prompts(PROMPTS)
    samplings = {"greedy": Sampling(), "sampled": Sampling(temperature=0.8, top_p=0.9, seed=SAMPLED_SEED)}
    out: dict = {"prompts": ps, "n_new": N_NEW, "runs": {}}
    for family in MODELS:
        dynamic = _tiny_random() if family == "tiny-random" else tiny_family(family)
        for method in [*METHODS, *EXTRA]:
            build = (lambda m, method=method: make(m, method)) if isinstance(method, dict) else (
                lambda m, method=method: _built(method, m))
            label = f"{family}/{_label(method) if isinstance(method, dict) else method}"
            t0 = time.perf_counter()
            static = dynamic.with_passes(capture.StepRunner("static"))
            runs: dict = {}
            for name, sampling in samplings.items():
                for mode, model in (("dynamic", dynamic), ("static", static)):
                    decoder = build(model)
                    runs[f"{name}/{mode}/alone"] = [_generation(decoder.fork().generate(p, N_NEW, sampling)) for p in ps]
                decoder = build(dynamic)
                slots = [decoder.fork() for _ in range(BATCH)]
                batch = Batch(dynamic, BATCH)
                joins = _joins(decoder, batch)
                gens = batch.run([lambda slot, p=p: slots[slot].generate(p, N_NEW, sampling, **joins) for p in ps])
                runs[f"{name}/dynamic/batch{BATCH}"] = {
                    "generations": [_generation(g) for g in gens], "rounds": batch.rounds,
                    "passes": {str(k): v for k, v in sorted(batch.passes.items())}, "rows": batch.rows,
                    "ops": [op.row() for op in batch.ops]}
            runs["static_runner"] = _runner(static.steps)
            out["runs"][label] = runs
            print(f"{label}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return out


def generations(d: dict) -> int:
    n = 0
    for runs in d["runs"].values():
        for key, value in runs.items():
            if key != "static_runner":
                n += len(value["generations"] if isinstance(value, dict) else value)
    return n


def differences(a, b, path: str = "") -> list[str]:
    """Every place where ``a`` and ``b`` differ, as ``path: a != b``."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append(f"{path}/{k}: {'missing' if k not in a else 'present'} before, "
                           f"{'missing' if k not in b else 'present'} after")
            else:
                out += differences(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)} items"]
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += differences(x, y, f"{path}[{i}]")
        return out
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the dump here")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="compare two dumps")
    args = ap.parse_args(argv)
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        found = differences(before, after)
        for line in found:
            print(line)
        print(f"{generations(before)} generations before, {generations(after)} after: {len(found)} differences")
        return 1 if found else 0
    if args.out is None:
        ap.error("give --out FILE or --compare BEFORE AFTER")
    t0 = time.perf_counter()
    d = dump()
    from selfspec.store.files import write_json

    write_json(args.out, d)
    print(f"{generations(d)} generations in {time.perf_counter() - t0:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

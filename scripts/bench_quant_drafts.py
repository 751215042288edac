"""Quantised self-drafts (issue 69): per format, the copy's bytes against the target's, its teacher-forced greedy
agreement with the target, and what a one-row draft pass over it costs against the target's step, side by
side in one process.

    python scripts/bench_quant_drafts.py                                # SmolLM2, four HumanEval, one XSum, one GSM8K
    python scripts/bench_quant_drafts.py --model gemma3-270m --tokens 64
    python scripts/bench_quant_drafts.py -- model.dtype=bfloat16         # a bf16 target (extra model overrides)
    python scripts/bench_quant_drafts.py --paths --no-float-x           # each copy's pass on each kernel path too
    python scripts/bench_quant_drafts.py --model gemma3-270m --draft-vocab outputs/artefacts/draft_vocab/gemma3-270m-mixed \
        --vocab-sizes 4096,16384 --no-float-x                            # agreement over a draft vocabulary too

Agreement: the target's greedy continuation of each prompt (``--tokens`` new tokens), then one pass over the
prompt and that continuation through the copy; the share of positions where the copy's argmax is the target's
next token (a draft's acceptance at that position if every earlier one was accepted). Beside it, the agreement
of the same rounded weights multiplied by float activations (a second model whose linears hold the copy
dequantised): what rounding the activations per block, as the kernel's integer dot products do, costs. Cost: a draft pass of
one row after ``--context`` positions (every layer and the head, over the copy) and the target's step at the
same context, interleaved in rounds, medians; the ratio is what a draft costs in steps. ``--paths``: each copy's
pass also on every path of the quantised kernel this CPU has (``avx2``: vpmaddubsw and vpmaddwd; ``avx512_vnni``:
vpdpbusd, where the CPU has it; the two give the same bits, checked here), taking turns with the rest.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="conf/model name")
    p.add_argument("--tokens", type=int, default=96, help="greedy tokens per prompt (agreement)")
    p.add_argument("--context", type=int, default=512, help="cached positions before a timed pass")
    p.add_argument("--rounds", type=int, default=7, help="timing rounds (each: every pass, 10 times; medians)")
    p.add_argument("--no-float-x", action="store_true",
                   help="leave out the agreement with float activations (it loads a second copy of the model)")
    p.add_argument("--paths", action="store_true",
                   help="time each copy's pass on every path of the quantised kernel this CPU has (avx2, avx512_vnni)")
    p.add_argument("--draft-vocab", default=None,
                   help="a draft vocabulary artefact (job=draft_vocab): each copy's agreement over its kept tokens alone "
                   "and with each prompt's and earlier tokens (draft_vocab_context), at every --vocab-sizes prefix")
    p.add_argument("--vocab-sizes", default=None,
                   help="comma-separated sizes of the artefact's ranked tokens to keep (default: all it kept)")
    p.add_argument("overrides", nargs="*", help="model config overrides (model.dtype=bfloat16)")
    args = p.parse_args(argv)
    for name in ("tokens", "context", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def prompts(loaded) -> list[list[int]]:
    """Four HumanEval prompts, one XSum article, one GSM8K question (issue 69's mix)."""
    from selfspec.tasks import build_task

    out = []
    for name, n in (("humaneval", 4), ("xsum", 1), ("gsm8k", 1)):
        task = build_task({"name": name, "n_examples": n, "max_prompt_tokens": 384}, model_chat=loaded.chat)
        out += [task.encode(ex, loaded.tokenizer) for ex in task.examples()]
    return out


def agreement(model, ids: list[int], n: int, weights: str, kept: list[torch.Tensor] = ()) -> tuple[list[int], int]:
    """([positions where the copy's argmax is the target's greedy next token, ...], positions) over ``n``
    tokens: over the whole vocabulary, then for each kept set (a ``[V]`` mask) the argmax over it alone and
    over it with the prompt's and the earlier tokens' (a draft vocabulary without and with
    ``draft_vocab_context``)."""
    from selfspec.decoding.vanilla import Vanilla
    from selfspec.models.passes import Pass

    target = Vanilla(model).generate(ids, n).tokens
    seq = torch.tensor([ids + target[:-1]])
    with torch.inference_mode():
        h = model.forward(seq, model.new_cache(seq.shape[1] + 1), Pass(weights=weights))
        logits = model.head(model.final_norm(h[:, len(ids) - 1:]), model.weight_set(weights).head)[0].float()
    want = torch.tensor(target)
    hits = [int((logits.argmax(-1) == want).sum())]
    for mask in kept:
        held = mask | context_mask(mask.numel(), ids, target)  # [n, V]: kept ∪ the context so far
        hits += [int((logits.masked_fill(~mask, float("-inf")).argmax(-1) == want).sum()),
                 int((logits.masked_fill(~held, float("-inf")).argmax(-1) == want).sum())]
    return hits, len(target)


def context_mask(v: int, ids: list[int], target: list[int]) -> torch.Tensor:
    """``[n, v]``: row ``t`` holds the prompt's tokens and the target's before position ``t``."""
    n = len(target)
    held = torch.zeros(n, v, dtype=torch.bool)
    held[:, torch.tensor(ids)] = True
    rows, earlier = torch.ones(n, n, dtype=torch.bool).tril(-1).nonzero(as_tuple=True)
    held[rows, torch.tensor(target)[earlier]] = True
    return held


def rounded_twin(cfg, fmt: str):
    """A second model of ``cfg`` whose decoder linears and LM head hold the ``fmt`` copy's values as float
    weights (dequantised): the copy's rounding without the activations'."""
    from selfspec.models.loading import load_model
    from selfspec.models.quantised import copied_weights, dequantise, head_format, quantise

    twin = load_model(cfg).model
    weights = copied_weights(twin)
    with torch.no_grad():
        for w, f in [(w, fmt) for w in weights[:-1]] + [(weights[-1], head_format(fmt))]:
            w.copy_(dequantise(quantise(w, f), w.shape[1]).to(w.dtype))
    return twin


def float_agreement(model, twin, ids: list[int], n: int) -> tuple[int, int]:
    """:func:`agreement` of ``twin`` (:func:`rounded_twin`) over its own float weights."""
    from selfspec.decoding.vanilla import Vanilla

    target = Vanilla(model).generate(ids, n).tokens
    seq = torch.tensor([ids + target[:-1]])
    with torch.inference_mode():
        h = twin.forward(seq, twin.new_cache(seq.shape[1] + 1))
        guess = twin.logits(h[:, len(ids) - 1:])[0].argmax(-1).tolist()
    return sum(a == b for a, b in zip(guess, target)), len(target)


def quant_paths() -> list[str]:
    """The quantised kernel's paths this CPU has: ``avx2`` and, where the CPU has AVX-512-VNNI, ``avx512_vnni``."""
    torch.ops.selfspec.skinny_isa("auto")
    auto = torch.ops.selfspec.quant_path()
    return ["avx2"] + ([auto] if auto != "avx2" else [])


def timings(model, context: int, rounds: int, paths: list[str]) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Median seconds of a one-row pass and its head, over the target's weights and each copy's (with more
    than one of ``paths``, each copy's pass on each: ``fmt@path``), and each one's last logits (the paths' bits
    compared)."""
    from selfspec.models.passes import Pass
    from selfspec.models.quantised import FORMATS, copied_weights

    with torch.inference_mode():
        cache = model.new_cache(context + 2)
        model.forward(torch.randint(100, 1000, (1, context)), cache)
        x = torch.randint(100, 1000, (1, 1))
        runs = {"target": (Pass(), None)}
        for fmt in FORMATS:
            runs |= ({fmt: (Pass(weights=fmt), None)} if len(paths) < 2
                     else {f"{fmt}@{path}": (Pass(weights=fmt), path) for path in paths})
        logits: dict[str, torch.Tensor] = {}

        def one(k: str) -> None:
            p = runs[k][0]
            h = model.forward(x, cache, p, start=context)
            cache.truncate(context)
            head = None if p.weights is None else model.weight_set(p.weights).head
            logits[k] = model.head(model.final_norm(h), head)
            logits[k].argmax(-1).item()

        times: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(rounds):
            for k in runs:  # the kernel's path set once per run of passes, outside the timed ones
                torch.ops.selfspec.skinny_isa("avx2" if runs[k][1] == "avx2" else "auto")
                one(k)
                ts = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    one(k)
                    ts.append(time.perf_counter() - t0)
                times[k].append(statistics.median(ts))
        torch.ops.selfspec.skinny_isa("auto")
    return {k: statistics.median(v) for k, v in times.items()}, logits


def main(argv=None) -> int:
    args = parse(argv)
    from omegaconf import OmegaConf

    from selfspec.config import model_config
    from selfspec.models.loading import load_model
    from selfspec.models.quantised import FORMATS, copied_weights

    cfg = OmegaConf.merge(model_config(args.model), OmegaConf.from_dotlist([o.removeprefix("model.")
                                                                           for o in args.overrides]))
    loaded = load_model(cfg)
    model = loaded.model
    for fmt in FORMATS:
        t0 = time.perf_counter()
        model.weight_set(fmt)
        print(f"{fmt} copy made in {time.perf_counter() - t0:.2f} s", flush=True)
    ps = prompts(loaded)
    sizes, kept = vocab_masks(args, loaded)
    agree, weights_only, in_vocab = {}, {}, {}
    for fmt in FORMATS:
        hits = [agreement(model, p, args.tokens, fmt, kept) for p in ps]
        total = sum(n for _, n in hits)
        shares = [sum(h[i] for h, _ in hits) / total for i in range(1 + 2 * len(kept))]
        agree[fmt], in_vocab[fmt] = shares[0], shares[1:]
        if args.no_float_x:
            weights_only[fmt] = float("nan")
            continue
        twin = rounded_twin(cfg, fmt)
        hits = [float_agreement(model, twin, p, args.tokens) for p in ps]
        weights_only[fmt] = sum(h for h, _ in hits) / sum(n for _, n in hits)
        del twin
    paths = quant_paths() if args.paths else []
    if args.paths and len(paths) < 2:
        print("this CPU's quantised kernel has one path (avx2: no AVX-512-VNNI)")
    cost, logits = timings(model, args.context, args.rounds, paths)
    target_bytes = sum(w.numel() * w.element_size() for w in copied_weights(model))
    print(f"\n{args.model} ({str(model.dtype).replace('torch.', '')}, {torch.get_num_threads()} threads), "
          f"{len(ps)} prompts x {args.tokens} tokens, passes after {args.context} positions:")
    print(f"{'weights':<18}{'bytes vs target':>17}{'agreement':>11}{'float x':>9}{'pass ms':>9}{'steps':>7}")
    print(f"{'target':<18}{1.0:>17.3f}{1.0:>11.3f}{1.0:>9.3f}{cost['target'] * 1e3:>9.2f}{1.0:>7.2f}")
    for fmt in FORMATS:
        ratio = model.weight_set(fmt).nbytes / target_bytes
        for key in [f"{fmt}@{path}" for path in paths] if len(paths) > 1 else [fmt]:
            print(f"{key:<18}{ratio:>17.3f}{agree[fmt]:>11.3f}{weights_only[fmt]:>9.3f}{cost[key] * 1e3:>9.2f}"
                  f"{cost[key] / cost['target']:>7.2f}")
        if len(paths) > 1:
            same = all(torch.equal(logits[f"{fmt}@{paths[0]}"], logits[f"{fmt}@{path}"]) for path in paths[1:])
            print(f"  {fmt}: the paths' logits {'are the same bits' if same else 'DIFFER'}")
    if sizes:
        print(f"\nagreement over the draft vocabulary {args.draft_vocab} (kept tokens alone / with each generation's "
              "context):")
        print(f"{'weights':<10}" + "".join(f"{s:>18,}" for s in sizes) + f"{'full':>9}")
        for fmt in FORMATS:
            cells = "".join(f"{in_vocab[fmt][2 * i]:>11.3f} / {in_vocab[fmt][2 * i + 1]:.3f}" for i in range(len(sizes)))
            print(f"{fmt:<10}{cells}{agree[fmt]:>9.3f}")
    return 0


def vocab_masks(args, loaded) -> tuple[list[int], list[torch.Tensor]]:
    """``--draft-vocab``'s kept sets: the sizes and a ``[V]`` mask of the artefact's first ``size`` ranked
    tokens for each (none without the option)."""
    if args.draft_vocab is None:
        return [], []
    from selfspec.models.heads import load_draft_vocab
    from selfspec.store.artefacts import load_artefact

    load_draft_vocab(args.draft_vocab, loaded, "--draft-vocab")  # checked against the model
    ranked = load_artefact(args.draft_vocab, "draft_vocab", loaded, device="cpu").tensors["ids"]
    sizes = [int(s) for s in args.vocab_sizes.split(",")] if args.vocab_sizes else [int(ranked.numel())]
    if any(not 1 <= s <= ranked.numel() for s in sizes):
        raise SystemExit(f"--vocab-sizes {args.vocab_sizes}: each must be in [1, {ranked.numel()}] (the artefact's size)")
    masks = []
    for size in sizes:
        mask = torch.zeros(loaded.model.vocab_size, dtype=torch.bool)
        mask[ranked[:size]] = True
        masks.append(mask)
    return sizes, masks


if __name__ == "__main__":
    raise SystemExit(main())

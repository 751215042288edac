"""Benchmark early exit / DEL against vanilla on SmolLM2-135M (until the shared bench exists).

    .venv/bin/python scripts/bench_del.py --tasks cnndm xsum humaneval gsm8k --n 2 --tokens 64 \
        --fixed 3:2 7:3 11:4 --exit-head lm_head

Same process, same examples, methods interleaved per example, one warm-up generation first;
greedy; speedup = vanilla seconds per token / method seconds per token over the same examples
(docs/design/contracts.md §2.6). Every method's tokens are checked against vanilla's. "best fixed" is the
fixed (ℓ, γ) with the highest speedup on that task (an oracle choice, as the DEL paper's static
baselines). Prints a Markdown table and writes JSON to --out.
"""

from __future__ import annotations

import argparse

import torch
from omegaconf import OmegaConf

from selfspec.config import method_config, model_config
from selfspec.decoding import build_decoder
from selfspec.measure.speedup import per_token, speedup
from selfspec.models.loading import load_model
from selfspec.store.files import write_json
from selfspec.tasks import build_task


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", nargs="+", default=["cnndm", "xsum", "humaneval", "gsm8k"])
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--fixed", nargs="*", default=["3:2", "7:3", "11:4"], help="ℓ:γ pairs")
    ap.add_argument("--exit-head", default="lm_head", choices=["lm_head", "heads"])
    ap.add_argument("--heads", default=None, help="heads artefact dir (default outputs/artefacts/heads/<model>)")
    ap.add_argument("--del-over", nargs="*", default=[], help="overrides of conf/method/del.yaml, key=value")
    ap.add_argument("--out", default="outputs/bench_del.json")
    args = ap.parse_args()

    loaded = load_model(model_config(args.model))
    from selfspec.evaluation.profiling import machine_profile

    common = dict(eos_token_ids=loaded.eos_token_ids, profile=machine_profile(loaded.model))  # DEL prices TPL with it
    methods = {"vanilla": OmegaConf.create({"name": "vanilla"})}
    base = method_config("early_exit")
    heads_layers = None
    if args.exit_head == "heads":
        from selfspec.decoding.early_exit import build_exit_heads
        heads_layers = build_exit_heads(loaded.model, "heads", args.heads, []).layers
        print("trained heads at layers", heads_layers)
    for pair in args.fixed:
        ell, gamma = (int(x) for x in pair.split(":"))
        methods[f"fixed({ell},{gamma})"] = OmegaConf.merge(base, {"exit_layer": ell, "max_draft": gamma,
                                                                  "exit_head": args.exit_head, "heads": args.heads})
    del_cfg = OmegaConf.merge(method_config("del"), {"exit_head": args.exit_head, "heads": args.heads},
                              OmegaConf.from_dotlist(args.del_over))
    methods["del"] = del_cfg
    decoders = {k: build_decoder(v, loaded.model, **({} if k == "vanilla" else common)) if k != "vanilla"
                else build_decoder(v, loaded.model, eos_token_ids=loaded.eos_token_ids) for k, v in methods.items()}
    torch.set_grad_enabled(False)
    results = {}
    for task_name in args.tasks:
        task = build_task({"name": task_name, "n_examples": args.n, "max_prompt_tokens": args.max_prompt})
        prompts = [task.encode(ex, loaded.tokenizer) for ex in task]
        for d in decoders.values():  # warm-up
            d.generate(prompts[0][-64:], 8)
        agg = {k: {"seconds": 0.0, "tokens": 0, "steps": 0, "drafted": 0, "accepted": 0, "parity": True,
                   "exit": 0.0, "gamma": 0.0} for k in decoders}
        for ids in prompts:
            ref = None
            for name, d in decoders.items():
                g = d.generate(ids, args.tokens)
                ref = g.tokens if name == "vanilla" else ref
                a = agg[name]
                a["seconds"] += g.seconds
                a["tokens"] += g.new_tokens
                a["steps"] += g.steps
                a["drafted"] += sum(g.drafted_per_step)
                a["accepted"] += g.accepted_drafts
                a["parity"] &= g.tokens == ref
                a["exit"] += g.stats.get("exit_layer_mean", 0) / len(prompts)
                a["gamma"] += g.stats.get("draft_len_mean", 0) / len(prompts)
        van = per_token(agg["vanilla"]["seconds"], agg["vanilla"]["tokens"])
        for name, a in agg.items():
            a["tok_per_s"] = a["tokens"] / a["seconds"]
            a["speedup"] = speedup(van, per_token(a["seconds"], a["tokens"]))
            a["tau"] = a["tokens"] / a["steps"]
            a["acceptance"] = a["accepted"] / a["drafted"] if a["drafted"] else None
        results[task_name] = agg
        fixed = {k: v for k, v in agg.items() if k.startswith("fixed")}
        best = max(fixed, key=lambda k: fixed[k]["speedup"]) if fixed else None
        print(f"\n## {task_name} ({len(prompts)} examples, {args.tokens} new tokens, exit head {args.exit_head})")
        print("| method | tok/s | speedup | tau | acceptance | mean ℓ | mean drafts | parity |")
        print("|---|---|---|---|---|---|---|---|")
        for name, a in agg.items():
            tag = " (best fixed)" if name == best else ""
            acc = f"{a['acceptance']:.2f}" if a["acceptance"] is not None else "-"
            print(f"| {name}{tag} | {a['tok_per_s']:.1f} | {a['speedup']:.2f}x | {a['tau']:.2f} | {acc} | "
                  f"{a['exit']:.1f} | {a['gamma']:.1f} | {a['parity']} |")
        if best:
            print(f"DEL vs best fixed {best}: {agg['del']['speedup'] / agg[best]['speedup']:.2f}x")
    write_json(args.out, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()

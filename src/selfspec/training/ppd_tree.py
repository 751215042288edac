"""``job=ppd_tree``: build PPD's hardware-aware dynamic sparse tree (PPD §4) for one model.

1. **Acceptance statistics** on a validation set: greedy continuations of held-out ShareGPT
   prompts are generated with vanilla decoding; along them, the trained prompt tokens are
   inserted and ``p[d][r]`` = P(the model's next token at distance ``d`` is the rank-``r`` guess
   of prompt token ``d``) is counted (the paper uses Alpaca as its validation set).
2. **Expected tokens** (Props 4.1, 4.2, 4.4; :mod:`selfspec.decoding.tree_builder`): ``f(T_k) = Σ_{v ∈ C(T_k)} Π_{i ∈ Path(v)} p_i``;
   the state after a step is the number of prompt tokens on the accepted node, a Markov chain
   whose steady state ``π`` gives ``R(T) = Σ_k π_k f(T_k)`` accepted candidates per step
   (``τ = 1 + R``, bonus token included).
3. **Construction** (§4.2; :mod:`selfspec.decoding.tree_builder`) for ``n_c`` candidates and ``n_p`` prompt tokens: optimal candidate
   trees of depth ``<= k`` (best-first by path probability, as Medusa / Sequoia), every node given
   ``m`` prompt tokens, then prompt tokens removed greedily by the smallest
   ``ΔF = p(c)·(f(T_i) − f(T_{i−1}))`` (Prop. 4.3) until ``n_p`` remain; for each tree size
   ``n`` every split ``n = 1 + n_c + n_p·n_ept`` is tried and the best ``R`` kept. With
   ``state_zero`` (beyond the paper) a node may lose its last prompt token and the root any of
   its own (state 0 follows such a node); without it, as the paper (Prop. 4.3 assumes ``i > 1``)
   and the authors' builder, a candidate keeps at least one and the root all ``m``.
4. **Hardware awareness**: the forward latency ``L_fp(n)`` of each size is priced with this
   machine's cost profile (the run's ``profile``, as a recorded PPD step is priced:
   :func:`tree_latency`); the chosen size maximises ``τ(n) / L_fp(n)``. The trees are saved as a
   ``ppd_tree`` artefact with the curves (and a plot).
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import torch

from selfspec.config import checks
from selfspec.decoding.tree import SparseTree, TREE_KIND, layout
from selfspec.decoding.tree_builder import amortized_tokens, best_trees_for_size, trees_for_size
from selfspec.measure.peak import MemoryModel, Shape, Term, layer_bytes, scores_bytes
from selfspec.measure.speedup import per_token, speedup
from selfspec.models.ledger import HeadOp, LayerOp
from selfspec.training.driver import TIMED_BY_PROFILE, Job, Result, job_keys
from selfspec.training.prompt_tuning import sharegpt_options, sharegpt_source

log = logging.getLogger(__name__)

# --- statistics and latency ------------------------------------------------------------------------
def rank_statistics(model, prompts, sequences: list[tuple[list[int], int]], top_k: int) -> torch.Tensor:
    """``p[d][r]`` over greedy sequences ``(tokens, prompt_len)``: how often the model's token at
    distance ``d+1`` is the rank-``r`` guess of prompt token ``d+1`` (insertion after each
    generated position)."""
    from selfspec.training.prompt_tuning import student_teacher

    m = prompts.m
    counts = torch.zeros(m, top_k + 1, dtype=torch.float64)
    for tokens, n_prompt in sequences:
        ids = torch.tensor(tokens)
        inserts = torch.arange(n_prompt - 1, len(tokens) - m - 1)
        if inserts.numel() == 0:
            continue
        with torch.no_grad():
            student, _ = student_teacher(model, prompts, ids, inserts)
        # greedy sequences: the model's token at distance d after i is tokens[i + d + 1]
        target = ids[(inserts[:, None] + torch.arange(2, m + 2)).clamp(max=len(tokens) - 1)].to(student.device)
        order = student.topk(top_k, -1).indices
        hit = order == target.unsqueeze(-1)
        rank = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(target, top_k))
        for d in range(m):
            counts[d] += torch.bincount(rank[:, d].cpu(), minlength=top_k + 1).double()
    if counts.sum() == 0:
        raise ValueError("no validation positions for acceptance statistics; raise job.max_new_tokens")
    return (counts / counts.sum(-1, keepdim=True))[:, :top_k]


def tree_latency(profile, model, trees: dict[int, SparseTree], n_ept: int, context: int) -> float:
    """Seconds of one PPD step (tree of the deepest state) after ``context`` cached tokens, priced
    with the run's cost profile as a recorded PPD step is: one pass of the tree's rows through every
    layer, the head on its nodes, the step's host work and the tree's own (``host_steps["tree"]``):
    ``L_fp(n)`` of PPD §4 on this machine. A plain step (no tree) is one row's pass."""
    tree = trees[max(trees)]
    lay = layout(tree, n_ept, model.device)
    L, vocab = model.num_layers, model.vocab_size
    ops = [LayerOp("verify", lay.size, L, L, context), HeadOp("verify", lay.n_nodes, vocab)]
    return profile.price(ops) + profile.host_step("tree")


def validation_prompts(tokenizer, chat: bool, n: int, skip: int, path: Path | None = None) -> list[list[int]]:
    """First user turns of ShareGPT conversations ``skip…`` (after the training ones) of ``path``
    (None: the offline asset)."""
    from selfspec.tasks.sharegpt import iter_sharegpt

    out = []
    for record in itertools.islice(iter_sharegpt(path), skip, None):
        turns = [t for t in record.get("conversations", []) if str(t.get("from")).lower() in ("human", "user")]
        if not turns or not str(turns[0].get("value", "")).strip():
            continue
        text = str(turns[0]["value"])[:1500]
        if chat and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text)["input_ids"]
        out.append(list(ids)[-256:])
        if len(out) >= n:
            break
    return out


def plot_curves(path: Path, sizes, tau, latency, speedup, chosen: int):
    """Latency, τ and the theoretical speedup against tree size (PPD Figure 8); the written
    :class:`~selfspec.store.figure.Plot` (caption drawn under the axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from selfspec.store.figure import save_standalone

    fig, ax = plt.subplots(1, 3, figsize=(13, 3.6))
    ax[0].plot(sizes, [1000 * x for x in latency], "o-")
    ax[0].set(xlabel="tree size (tokens per forward)", ylabel="forward latency (ms)", title="L_fp(n), this machine")
    ax[1].plot(sizes, tau, "o-")
    ax[1].set(xlabel="tree size (tokens per forward)", ylabel="expected τ (tokens per step)",
              title="acceptance length τ(n)")
    ax[2].plot(sizes, speedup, "o-")
    ax[2].axvline(chosen, ls="--", c="gray")
    ax[2].set(xlabel="tree size (tokens per forward)", ylabel="τ(n)·L(1) / L(n) (×)",
              title=f"theoretical speedup (chosen n={chosen})")
    return save_standalone(fig, path, (
        "Left: the forward latency per tree size, priced with this machine's cost profile. Middle: the expected tokens per "
        "step τ the tree's acceptance statistics give. Right: their ratio against plain decoding; the dashed "
        "line marks the size kept (the highest ratio; size 1 = plain decoding)."))


def prepare(cfg) -> dict:
    """Every key of conf/job/ppd_tree.yaml checked, the prompts artefact found and the ShareGPT asset
    present — all that can fail without the model (the driver calls it first)."""
    from selfspec.store.artefacts import artefact_option, default_artefact_dir

    job, key = cfg.job, "job.{}".format
    checks.renamed("job", job, {"latency_repeats": TIMED_BY_PROFILE})
    sizes = sorted(set(checks.listed(checks.integer, key("sizes"), job.sizes, 1, why="tokens per forward")))
    if not any(n > 1 for n in sizes):
        raise checks.refuse(key("sizes"), job.sizes, "must hold a size > 1 (size 1 is plain decoding)")
    opts = {
        "prompts": artefact_option(key("prompts"), job.prompts, "prompts"),
        "top_k": checks.integer(key("top_k"), job.top_k, 1, why="guesses per prompt token"),
        "n_prompts": checks.integer(key("n_prompts"), job.n_prompts, 1),
        **sharegpt_options(job),
        "skip_conversations": checks.integer(key("skip_conversations"), job.skip_conversations, 0),
        "max_new_tokens": checks.integer(key("max_new_tokens"), job.max_new_tokens, 1),
        "sizes": sizes,
        "latency_context": checks.integer(key("latency_context"), job.latency_context, 1,
                                          why="cached tokens before the priced forward"),
        "plot": checks.flag(key("plot"), job.plot),
        "state_zero": checks.flag(key("state_zero"), job.get("state_zero"),
                                  why="false = the paper's states 1..m (the root keeps every prompt token, "
                                      "each candidate one)"),
    }
    job_keys(job, opts)
    if opts["prompts"] is None:
        opts["prompts"] = default_artefact_dir("prompts", str(cfg.model.name))
        if not (opts["prompts"] / "meta.json").exists():
            raise FileNotFoundError(f"no prompts artefact at {opts['prompts']}; run python -m selfspec.train "
                                    f"job=prompts model={cfg.model.name} first or set job.prompts")
    opts["path"] = sharegpt_source(job)  # the validation conversations
    return opts


def default_dir(cfg, opts: dict) -> Path:
    """``ppd_tree/<model>``."""
    from selfspec.store.artefacts import default_artefact_dir

    return default_artefact_dir(TREE_KIND, str(cfg.model.name))


def inputs(opts: dict) -> list[tuple[Path, str]]:
    """The prompts artefact the tree is built for."""
    return [(opts["prompts"], "prompts")]


def acceptance_statistics(loaded, prompts, opts: dict) -> torch.Tensor:
    """``p[d][r]`` (:func:`rank_statistics`) along greedy continuations of the validation prompts."""
    from selfspec.decoding.vanilla import Vanilla

    t0 = time.perf_counter()
    vanilla = Vanilla(loaded.model)
    seqs = []
    prompts_ids = validation_prompts(loaded.tokenizer, loaded.chat, opts["n_prompts"], opts["skip_conversations"],
                                     opts["path"])
    if not prompts_ids:
        raise ValueError(f"{opts['path'] or 'the sharegpt asset'} holds no conversation with a first user turn after "
                         f"job.skip_conversations={opts['skip_conversations']}: lower it, or give more data")
    if len(prompts_ids) < opts["n_prompts"]:
        log.warning("%s: %d validation conversations after job.skip_conversations=%d, not job.n_prompts=%d",
                    opts["path"] or "the sharegpt asset", len(prompts_ids), opts["skip_conversations"], opts["n_prompts"])
    for ids in prompts_ids:
        gen = vanilla.generate(ids, opts["max_new_tokens"])
        seqs.append((ids + gen.tokens, len(ids)))
    p = rank_statistics(loaded.model, prompts, seqs, opts["top_k"])
    log.info("acceptance statistics from %d greedy sequences (%.1fs): top-1 by distance %s", len(seqs),
             time.perf_counter() - t0, [round(float(x), 3) for x in p[:, 0]])
    return p


def size_curve(model, profile, p: torch.Tensor, m: int, n_ept: int, opts: dict, tracker) -> tuple[list[dict], dict, float]:
    """For each feasible size of ``job.sizes``: the best trees, expected τ, the priced latency and
    the theoretical speedup; returns ``(rows, trees by size, vanilla latency)``."""
    plist = p.tolist()
    context = opts["latency_context"]
    base = profile.plain_step(context)
    rows, candidates = [], {}
    state_zero = opts["state_zero"]
    for n in opts["sizes"]:
        if n > 1 and best_trees_for_size(n, m, n_ept, plist, state_zero) is None:
            continue
        trees = trees_for_size(p, n, m, n_ept, state_zero)
        r = amortized_tokens(trees, plist, m)
        lat = tree_latency(profile, model, trees, n_ept, context) if n > 1 else base
        rows.append({"size": n, "tau": 1 + r, "latency_s": lat, "speedup": speedup(base, per_token(lat, 1 + r)),
                     "candidates": max(t.num_candidates for t in trees.values()),
                     "prompt_tokens": max(t.num_prompts for t in trees.values())})
        candidates[n] = trees
        tracker.log({"tree/tau": 1 + r, "tree/latency_ms": 1000 * lat, "tree/speedup": rows[-1]["speedup"]}, step=n)
        log.info("size %3d: tau %.3f latency %.1f ms theoretical speedup %.3f", n, 1 + r, 1000 * lat,
                 rows[-1]["speedup"])
    return rows, candidates, base


def objective(ctx) -> Result:
    """Build the tree :func:`prepare` checked: statistics, the size curve, the fastest size."""
    from selfspec.models.prompts import load_prompts

    opts, loaded = ctx.opts, ctx.loaded
    model = loaded.model
    prompts_path, sizes = opts["prompts"], opts["sizes"]
    prompts = load_prompts(prompts_path, loaded)
    m, n_ept = prompts.m, prompts.n_ept
    t0 = time.perf_counter()
    p = acceptance_statistics(loaded, prompts, opts)
    rows, candidates, base = size_curve(model, ctx.profile, p, m, n_ept, opts, ctx.tracker)
    ppd_rows = [row for row in rows if row["size"] > 1]
    if not ppd_rows:
        raise ValueError(f"no feasible tree size in job.sizes={sizes}; give sizes > 1")
    best_ppd = max(ppd_rows, key=lambda row: row["speedup"])
    # size 1 (the root alone, no prompt tokens) is vanilla decoding: chosen when no tree pays off here
    chosen = max(rows, key=lambda row: row["speedup"])
    if chosen["size"] == 1:
        log.warning("no tree beats vanilla on this machine with these prompts (best: size %d, theoretical "
                    "speedup %.3f); the chosen tree is the root alone. method.tree_size=<n> forces a size.",
                    best_ppd["size"], best_ppd["speedup"])
    trees = candidates[chosen["size"]]
    metrics = {"chosen_size": chosen["size"], "expected_tau": chosen["tau"], "latency_s": chosen["latency_s"],
               "theoretical_speedup": chosen["speedup"], "vanilla_latency_s": base,
               "best_ppd_size": best_ppd["size"], "best_ppd_speedup": best_ppd["speedup"],
               "top1_by_distance": [float(x) for x in p[:, 0]], "seconds": time.perf_counter() - t0}
    files = {}
    if opts["plot"]:
        files["latency.png"] = plot_curves(ctx.scratch / "latency.png", [r["size"] for r in rows],
                                           [r["tau"] for r in rows], [r["latency_s"] for r in rows],
                                           [r["speedup"] for r in rows], chosen["size"]).path
    log.info("ppd tree: size %d, expected tau %.3f", chosen["size"], chosen["tau"])
    return Result(
        tensors={"accept_probs": p.float(), "sizes": torch.tensor([r["size"] for r in rows]),
                 "tau": torch.tensor([r["tau"] for r in rows]),
                 "latency": torch.tensor([r["latency_s"] for r in rows])},
        meta={"trees": {str(k): t.to_dict() for k, t in trees.items()}, "curve": rows,
              "prompts": str(prompts_path), "m": m, "n_ept": n_ept, "device": str(model.device),
              "state_zero": opts["state_zero"]},
        metrics=metrics, summary=metrics, tables={"latency_vs_size": rows}, files=files)


# --- memory (selfspec.measure.peak) ----------------------------------------------------------------
#: a validation prompt's tokens (ShareGPT first turns, not clipped by the job)
TREE_PROMPT = 512


def _job_terms(s: Shape, j, b: int, prompt_tokens) -> list[list[Term]]:
    m, e = int(prompt_tokens["m"]), int(prompt_tokens["n_ept"])
    new = int(j.max_new_tokens)
    seq = TREE_PROMPT + new
    rows = new * m * e
    size = max(int(x) for x in j.sizes)
    return [[
        Term("statistics", (seq + rows) * s.kv_per_token * b + layer_bytes(s, seq, b) + scores_bytes(s, seq, seq + rows, b)
             + (new * m + rows) * s.vocab * b, "job.max_new_tokens"),
        Term("latency", (int(j.latency_context) + size) * s.kv_per_token * b + size * s.vocab * 4,
             "job.sizes / job.latency_context"),
    ]]


def _tree_prompts(cfg) -> dict:
    """The prompt tokens' ``m`` and ``n_ept`` of the artefact a tree is built for (its ``meta.json``;
    the prompts job's config when there is none yet)."""
    import json

    path = cfg.job.get("prompts")
    meta = Path(str(path)) / "meta.json" if path else None
    if meta is not None and meta.exists():
        data = json.loads(meta.read_text())
        train = data.get("train_config") or {}
        return {"m": data.get("m", train.get("m", 3)), "n_ept": data.get("n_ept", train.get("n_ept", 1))}
    from omegaconf import OmegaConf

    from selfspec.config import conf_dir

    job = OmegaConf.load(conf_dir() / "job" / "prompts.yaml")
    return {"m": job.m, "n_ept": job.n_ept}


def memory_terms(shape: Shape, cfg, b: int, context: int, prompt: int | None) -> list[list[Term]]:
    """This job's memory terms beside the weights, by phase (:class:`~selfspec.measure.peak.MemoryModel`)."""
    return _job_terms(shape, cfg.job, b, _tree_prompts(cfg))


#: fitted by ``scripts/measure_memory.py --fit`` (docs/memory_measured.json); docs/usage.md, "Memory per job and model size"
MEMORY = MemoryModel(memory_terms, s=1.0, runtime=486748979.2,
                     fallbacks=((),))

JOB = Job(memory=MEMORY, kind=TREE_KIND, tracker_job="ppd-tree", prepare=prepare, default_dir=default_dir, objective=objective,
          inputs=inputs, prices=lambda cfg: "job=ppd_tree (L_fp(n) of each tree size)")

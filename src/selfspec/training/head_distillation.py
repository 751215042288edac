"""``job=heads``: train AdaDecode's intermediate heads (AdaDecode §3.1).

* Heads ``E_l = E* · T_l`` at ``job.layers`` (default three evenly spaced), ``T_l`` initialised to
  the identity (:class:`selfspec.models.heads.IntermediateHeads`); the base model is frozen, only the
  ``T_l`` train (``job.kind=full``: an own ``d×|V|`` head each, the §4.3 ablation).
* Loss (§3.1): ``Σ_l KL(p* ‖ p_l)`` between the final layer's next-token distribution and head
  ``l``'s, averaged over positions.
* Data: the paper trains on the target task's training set. Offline default: **self-
  distillation** — the model's own greedy continuations of task prompts (``job.data=task``), or
  of several tasks' prompts (``job.data=mixed``, the mixed-domain ablation), generated once with
  batched ``generate`` and cached on disk (:mod:`selfspec.training.continuations`). The loss covers the positions that predict the
  continuation (the distribution AdaDecode's heads must predict while decoding). Prompts come
  from the *end* of the task's shuffled pool, so they do not overlap the evaluated examples
  (taken from its start) unless the pool is too small — the overlap is logged.
* One frozen forward per sequence feeds all heads (hidden states of the head layers and the
  final layer); with ``job.cache_features`` they are kept in memory, so later epochs over a
  small data set cost only the heads. The training loop (:mod:`selfspec.training.loop`) gives
  mixed precision, gradient accumulation, checkpoints + resume and data parallelism.
* Output: the head-set artefact (``outputs/artefacts/heads/<model>-<data>[-full]``), training
  curves in the tracker, and per-head held-out KL and top-1 agreement with the final layer
  (plus, for each ``job.eval_gammas`` γ, the fraction of positions a head would exit at and its
  agreement there — what AdaDecode's speed and rejection rate depend on).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from selfspec.config import checks
from selfspec.measure.peak import MemoryModel, OPTIMIZER_COPIES, Shape, Term, generation_bytes, layer_bytes, scores_bytes
from selfspec.models.heads import IntermediateHeads, default_layers, heads_artefact_dir, heads_contents
from selfspec.models.passes import Pass
from selfspec.training.continuations import Sequence, build_data, data_tag, data_tasks, generation_options
from selfspec.training.driver import Job, Result, job_keys
from selfspec.training.loop import TrainConfig, final_metrics, train

log = logging.getLogger(__name__)


# --- config and data (before the model loads) --------------------------------------------------


def prepare(cfg) -> dict:
    """Every key of conf/job/heads.yaml checked and the prompt tasks' data read — all that can fail
    without the model (the driver calls it first)."""
    job, key = cfg.job, "job.{}".format
    layers = checks.optional(checks.integers, key("layers"), job.layers, distinct=True,
                             why="0-based layers; null = n_heads evenly spaced")
    if layers == []:
        raise checks.refuse(key("layers"), layers, "must name at least one layer (null = n_heads evenly spaced)")
    opts = {
        "kind": checks.choice(key("kind"), job.kind, ("linear", "full"),
                              why="lm_head heads need no training: use method.head_kind=lm_head"),
        "layers": layers,
        "n_heads": checks.integer(key("n_heads"), job.n_heads, 1),
        **generation_options(job),
        "batch_size": checks.integer(key("batch_size"), job.batch_size, 1),
        "max_positions": checks.optional(checks.integer, key("max_positions"), job.max_positions, 1,
                                         why="null = every position"),
        "kl_chunk": checks.optional(checks.integer, key("kl_chunk"), job.kl_chunk, 1,
                                    why="positions whose |V|-wide logits are formed at once; null = all"),
        "cache_features": checks.flag(key("cache_features"), job.cache_features),
        "eval_gammas": checks.listed(checks.probability, key("eval_gammas"), job.eval_gammas, high_open=True,
                                     why="exit thresholds on a head's top probability"),
    }
    job_keys(job, [*opts, *TrainConfig.keys()])
    opts["train"] = TrainConfig.from_config(job, seed=cfg.seed)
    opts["tasks"] = data_tasks(cfg, opts["data"], opts["mixed_tasks"])
    return opts


# --- features, loss, evaluation --------------------------------------------------------------
class Features:
    """Frozen-model hidden states of a sequence's predicting positions: one forward per sequence
    gives every head layer and the final layer (kept in memory when ``cache`` is set)."""

    def __init__(self, model, layers: list[int], seqs: list[Sequence], cache: bool) -> None:
        self.model, self.layers, self.seqs, self.cache = model, layers, seqs, cache
        self._memo: dict[int, dict] = {}

    def __call__(self, i: int) -> dict:
        if i in self._memo:
            return self._memo[i]
        m, s = self.model, self.seqs[i]
        out = {}
        with torch.no_grad():
            ids = torch.tensor([s.ids], device=m.device)
            h, prev = None, 0
            for l in self.layers + [m.num_layers - 1]:
                h = m.forward(ids if h is None else h, None, Pass(range(prev, l + 1)), start=0)
                out[l] = h[0, s.start :].detach()
                prev = l + 1
        feats = {"heads": {l: out[l] for l in self.layers}, "final": out[m.num_layers - 1]}
        if self.cache:
            self._memo[i] = feats
        return feats

    def batch(self, idx: list[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        f = [self(i) for i in idx]
        return ({l: torch.cat([x["heads"][l] for x in f]) for l in self.layers},
                torch.cat([x["final"] for x in f]))


def _kl_terms(heads: IntermediateHeads, final: torch.Tensor, hidden) -> tuple[torch.Tensor, torch.Tensor]:
    """``([heads], [rows, V])``: each head's KL(p* ‖ p_l) summed over the rows of ``final`` (its
    states in ``hidden``, in head order), and the final layer's log-probabilities."""
    with torch.no_grad():
        logp_star = F.log_softmax(heads.model.logits(final).float(), -1)
    p_star = logp_star.exp()
    sums = torch.stack([(p_star * (logp_star - F.log_softmax(heads.logits(l, h).float(), -1))).sum()
                        for l, h in zip(heads.layers, hidden)])
    return sums, logp_star


def head_kl(heads: IntermediateHeads, hidden: dict[int, torch.Tensor], final: torch.Tensor):
    """Per-head mean KL(p* ‖ p_l) over positions, and the final layer's log-probabilities."""
    sums, logp_star = _kl_terms(heads, final, [hidden[l] for l in heads.layers])
    return {l: sums[j] / final.shape[0] for j, l in enumerate(heads.layers)}, logp_star


def _kl_sums(heads: IntermediateHeads, final: torch.Tensor, *hidden: torch.Tensor) -> torch.Tensor:
    """One chunk's per-head KL sums (:func:`_kl_terms`), what :func:`chunked_head_kl` checkpoints."""
    return _kl_terms(heads, final, hidden)[0]


def chunked_head_kl(heads: IntermediateHeads, hidden: dict[int, torch.Tensor], final: torch.Tensor,
                    chunk: int) -> dict[int, torch.Tensor]:
    """:func:`head_kl`'s KLs with at most ``chunk`` positions' ``|V|``-wide logits alive at once: each
    chunk runs under ``torch.utils.checkpoint``, which keeps its inputs (``d``-wide states) and forms its
    logits again in backward. The same loss and gradients up to summation order; what it bounds is
    the KL over a 128k vocabulary, positions × heads × |V| floats otherwise."""
    from torch.utils.checkpoint import checkpoint

    n = final.shape[0]
    total = None
    for a in range(0, n, chunk):
        part = checkpoint(_kl_sums, heads, final[a:a + chunk], *(hidden[l][a:a + chunk] for l in heads.layers),
                          use_reentrant=False)
        total = part if total is None else total + part
    return {l: total[j] / n for j, l in enumerate(heads.layers)}


def evaluate_heads(heads: IntermediateHeads, feats: Features, gammas) -> dict[str, float]:
    """Held-out per-head KL, top-1 agreement with the final layer, and exit rate / agreement at γ."""
    sums: dict[str, float] = {}
    n = 0
    with torch.no_grad():
        for i in range(len(feats.seqs)):
            hidden, final = feats.batch([i])
            kls, logp_star = head_kl(heads, hidden, final)
            target = logp_star.argmax(-1)
            k = int(target.numel())
            n += k
            for l in heads.layers:
                probs = heads.logits(l, hidden[l]).softmax(-1)
                conf, pred = probs.max(-1)
                agree = pred == target
                add = {f"kl/{l}": float(kls[l]) * k, f"top1/{l}": float(agree.sum())}
                for g in gammas:
                    ex = conf > g
                    add[f"exit@{g}/{l}"] = float(ex.sum())
                    add[f"exit_agree@{g}/{l}"] = float((agree & ex).sum())
                for key, v in add.items():
                    sums[key] = sums.get(key, 0.0) + v
    out = {}
    for key, v in sums.items():
        if key.startswith("exit_agree@"):
            exits = sums[key.replace("exit_agree@", "exit@")]
            out[key] = v / exits if exits else float("nan")
        else:
            out[key] = v / n
    out["kl"] = sum(out[f"kl/{l}"] for l in heads.layers)
    return out


def batch_sampler(n: int, batch_size: int, seed: int):
    """``batch_fn(i)``: micro-batch ``i`` — ``(sequence indices, position-sampling seed)``, a
    deterministic function of ``i`` (exact resume)."""
    if n < 1:
        raise ValueError("no training sequences: raise job.n_prompts")

    def batch_fn(i: int) -> tuple[list[int], int]:
        rng = np.random.default_rng([seed, i])
        return rng.choice(n, size=min(batch_size, n), replace=False).tolist(), int(rng.integers(1 << 31))

    return batch_fn


def make_heads(model, job) -> IntermediateHeads:
    """Untrained heads of ``job["kind"]`` at ``job["layers"]`` (null: ``n_heads`` evenly spaced);
    ``job`` is :func:`prepare`'s options or a heads job config."""
    layers = job["layers"]
    layers = default_layers(model.num_layers, int(job["n_heads"])) if layers is None else list(layers)
    return IntermediateHeads(model, layers, str(job["kind"]))


def trainer(heads: IntermediateHeads, train_seqs, held_seqs, job, seed: int):
    """``(loss_fn, batch_fn, eval_fn)`` for :func:`selfspec.training.loop.train` (``job`` as in
    :func:`make_heads`)."""
    feats = Features(heads.model, heads.layers, train_seqs, bool(job["cache_features"]))
    held = Features(heads.model, heads.layers, held_seqs, True)
    gammas = [float(g) for g in job["eval_gammas"]]
    max_positions, kl_chunk = job["max_positions"], job.get("kl_chunk")

    def loss_fn(module, batch):
        idx, pos_seed = batch
        hidden, final = feats.batch(idx)
        if max_positions and final.shape[0] > max_positions:  # the |V|-wide logits dominate the cost
            g = torch.Generator().manual_seed(pos_seed)
            keep = torch.randperm(final.shape[0], generator=g)[:max_positions].to(final.device)
            hidden, final = {l: h[keep] for l, h in hidden.items()}, final[keep]
        if kl_chunk is not None and final.shape[0] > kl_chunk:
            kls = chunked_head_kl(module, hidden, final, kl_chunk)
        else:
            kls, _ = head_kl(module, hidden, final)
        return sum(kls.values()), {f"kl/{l}": float(v.detach()) for l, v in kls.items()}

    return loss_fn, batch_sampler(len(train_seqs), int(job["batch_size"]), seed), (
        lambda module: evaluate_heads(module, held, gammas))


# --- the job ---------------------------------------------------------------------------------


def default_dir(cfg, opts: dict) -> Path:
    """``heads/<model>-<task|mixed>[-full]``."""
    return heads_artefact_dir(str(cfg.model.name), data_tag(opts), opts["kind"])


def objective(ctx) -> Result:
    """Train the heads :func:`prepare` checked on the model's own continuations."""
    opts, loaded = ctx.opts, ctx.loaded
    heads = make_heads(loaded.model, opts)
    t0 = time.perf_counter()
    train_seqs, held_seqs, tag, info = build_data(opts, loaded, ctx.progress)
    data_seconds = time.perf_counter() - t0
    loss_fn, batch_fn, eval_fn = trainer(heads, train_seqs, held_seqs, opts, ctx.seed)
    settings = {"model": loaded.name, "data": info["tasks"], **OmegaConf.to_container(ctx.cfg.job, resolve=True)}
    result = train(heads, loss_fn, batch_fn, opts["train"], ctx.ckpt_dir, tracker=ctx.tracker, eval_fn=eval_fn,
                   settings=settings, progress=ctx.progress)
    final, initial = final_metrics(result["eval"][-1]), final_metrics(result["eval"][0])
    metrics = {**final, "initial": initial, "train_seconds": result["seconds"], "data_seconds": data_seconds,
               "steps": result["step"], "params": sum(p.numel() for p in heads.parameters()),
               "train_sequences": len(train_seqs), "heldout_sequences": len(held_seqs),
               "train_positions": sum(len(s.ids) - s.start for s in train_seqs)}
    for l in heads.layers:
        log.info("head %d: held-out top-1 agreement %.3f -> %.3f, KL %.3f -> %.3f", l, initial[f"top1/{l}"],
                 final[f"top1/{l}"], initial[f"kl/{l}"], final[f"kl/{l}"])
    tensors, fields = heads_contents(heads)
    return Result(
        tensors=tensors, meta={**fields, "data": info}, task=tag, metrics=metrics,
        summary={"layers": heads.layers, "kind": heads.kind, **{k: v for k, v in metrics.items() if k != "initial"}},
        tables={"heldout_agreement": [
            {"layer": l, "top1_initial": initial[f"top1/{l}"], "top1": final[f"top1/{l}"],
             "kl_initial": initial[f"kl/{l}"], "kl": final[f"kl/{l}"]} for l in heads.layers]},
        checkpoint=ctx.ckpt_dir)


# --- memory (selfspec.measure.peak) ----------------------------------------------------------------
def _job_terms(s: Shape, j, b: int) -> list[list[Term]]:
    n_heads = len(j.layers) if j.layers is not None else int(j.n_heads)
    new = int(j.gen_tokens) + 1
    positions = int(j.batch_size) * new
    if j.max_positions is not None:
        positions = min(positions, int(j.max_positions))
    trained = n_heads * s.hidden * (s.hidden if j.kind == "linear" else s.vocab)
    cached = (int(j.n_prompts) if j.cache_features else int(j.batch_size)) + int(j.n_heldout)
    sequence = int(j.max_prompt_tokens or 4096) + new
    train = [
        Term("optimizer", trained * 4 * OPTIMIZER_COPIES, "job.kind / job.n_heads", activation=False),
        Term("features", cached * new * (n_heads + 1) * s.hidden * b, "job.cache_features / job.n_prompts"),
        Term("kl", n_heads * min(positions, j.get("kl_chunk") or positions) * s.vocab * (b + 24),
             "job.kl_chunk / job.max_positions"),
        Term("frozen pass", layer_bytes(s, sequence, b) + scores_bytes(s, sequence, sequence, b), "job.max_prompt_tokens"),
    ]
    gen = [Term("generation", generation_bytes(s, int(j.gen_batch), sequence - new, new, b),
                "job.gen_batch / job.max_prompt_tokens")]
    return [train, gen]


def memory_terms(shape: Shape, cfg, b: int, context: int, prompt: int | None) -> list[list[Term]]:
    """This job's memory terms beside the weights, by phase (:class:`~selfspec.measure.peak.MemoryModel`)."""
    return _job_terms(shape, cfg.job, b)


#: fitted by ``scripts/measure_memory.py --fit`` (docs/memory_measured.json); docs/usage.md, "Memory per job and model size"
MEMORY = MemoryModel(memory_terms, s=0.606, runtime=550712115.2,
                     fallbacks=((), ("job.kl_chunk=16",), ("job.kl_chunk=16", "job.gen_batch=2", "job.max_prompt_tokens=512")))

JOB = Job(memory=MEMORY, kind="heads", tracker_job="train-heads", prepare=prepare, default_dir=default_dir, objective=objective)

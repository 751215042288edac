"""``job=prompts``: train PPD's prompt-token embeddings by knowledge distillation (PPD §3.3).

* Only the ``[m, n_ept, hidden]`` prompt embeddings train (:class:`selfspec.models.prompts.PromptTokens`,
  initialised from ordinary token embeddings); the base model is frozen.
* **Random insertion** (PPD §3.3): each micro-batch is one ShareGPT conversation, truncated
  randomly to ``context_length`` tokens, with ``inserts`` random insertion points ``i``; after
  each, the chain of ``m`` prompt tokens (× EPTs, ensemble attention mask, PPD App. B.5.1) sits at
  positions ``i+1…i+m`` and sees ``x[0..i]`` only.
* **Knowledge distillation** (PPD Eq. 1): prompt token ``d`` at ``i`` is trained towards the
  frozen model's distribution of the token at distance ``d``, i.e. its logits at real position
  ``i+d``: ``L = 1/m · Σ_d α^(d−1) · KL(teacher_d ‖ student_d)``, student logits = EPT average.

Teacher logits and the student's context come from **one frozen pass** over the sequence,
without gradients, that fills a layer cache; the prompt tokens of all insertion points then run
as one small batch of queries against that cache with a tree-style mask. Real tokens never
attend to prompt tokens, so the teacher is exact, and the expensive pass over the sequence keeps
no activations — cheaper than one combined forward (which would store them for backward) and
than a separate teacher pass (which would run the sequence twice).
"""

from __future__ import annotations

import logging
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from selfspec.config import checks
from selfspec.measure.peak import MemoryModel, OPTIMIZER_COPIES, Shape, Term, backward_bytes, layer_bytes, scores_bytes
from selfspec.models.passes import Pass, Rows
from selfspec.models.prompts import PromptTokens, prompts_contents
from selfspec.training.driver import Job, Result, job_keys
from selfspec.training.loop import TrainConfig, final_metrics, train

log = logging.getLogger(__name__)

SHAREGPT_HUB = ("anon8231489123/ShareGPT_Vicuna_unfiltered", "ShareGPT_V3_unfiltered_cleaned_split.json")
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "assistant": "assistant", "system": "system"}


# --- data ------------------------------------------------------------------------------------
def sharegpt_options(job) -> dict:
    """``job.data`` and ``job.hub_id`` checked (at most one; a local file that exists): where a job
    reads ShareGPT from (:func:`sharegpt_path`). The prompts job trains on it, the tree job
    (:mod:`selfspec.training.ppd_tree`) validates on later conversations of it."""
    key = "job.{}".format
    data = checks.optional(checks.text, key("data"), job.data, why="a local ShareGPT JSON file")
    hub_id = checks.optional(checks.text, key("hub_id"), job.hub_id)
    if data is not None and hub_id is not None:
        raise checks.refuse(key("hub_id"), hub_id, "set job.data (a local file) or job.hub_id, not both")
    if data is not None and not Path(data).expanduser().is_file():
        raise checks.refuse(key("data"), data, "no such file")
    return {"data": data, "hub_id": hub_id}


def sharegpt_path(job) -> Path | None:
    """``job.data`` (a local ShareGPT JSON), else ``job.hub_id`` downloaded from the hub, else
    ``None`` = the offline asset (docs/design/assets-and-formats.md §5)."""
    if job.data:
        return Path(str(job.data)).expanduser()
    if job.hub_id:
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(str(job.hub_id), SHAREGPT_HUB[1], repo_type="dataset"))
    return None


def sharegpt_source(job) -> Path | None:
    """:func:`sharegpt_path`, its first complete conversation read: a file that is not ShareGPT, or
    the offline asset not fetched (``None``), fails here, before a model loads."""
    from selfspec.tasks.sharegpt import iter_sharegpt

    path = sharegpt_path(job)
    if next(iter_sharegpt(path), None) is None:
        raise ValueError(f"{path or 'the sharegpt asset'} holds no complete ShareGPT conversation; check job.data")
    return path


def prepare(cfg) -> dict:
    """Every key of conf/job/prompts.yaml checked and the ShareGPT file found and its first record
    read — all that can fail without the model (the driver calls it first)."""
    job, key = cfg.job, "job.{}".format
    m = checks.integer(key("m"), job.m, 1, why="prompt tokens")
    opts = {
        "m": m,
        "n_ept": checks.integer(key("n_ept"), job.n_ept, 1, why="ensemble prompt tokens per prompt token"),
        "alpha": checks.probability(key("alpha"), job.alpha, low_open=True, why="KL decay per token distance"),
        **sharegpt_options(job),
        "n_conversations": checks.integer(key("n_conversations"), job.n_conversations, 1),
        "held_out": checks.integer(key("held_out"), job.held_out, 1, why="conversations for the held-out accuracy"),
        "context_length": checks.integer(key("context_length"), job.context_length, 2 * m + 2,
                                         why=f"tokens; m={m} prompt tokens need at least 2m + 2"),
        "inserts": checks.integer(key("inserts"), job.inserts, 1),
        "eval_inserts": checks.integer(key("eval_inserts"), job.eval_inserts, 1),
        "gradient_checkpointing": checks.flag(key("gradient_checkpointing"), job.gradient_checkpointing,
                                              why="recompute each layer in backward"),
    }
    job_keys(job, [*opts, *TrainConfig.keys()])
    opts["train"] = TrainConfig.from_config(job, seed=cfg.seed)
    opts["path"] = sharegpt_source(job)
    return opts


def conversation_text(record: dict, tokenizer, chat: bool) -> str | None:
    turns = [(ROLES.get(str(t.get("from", "")).lower()), str(t.get("value", "")))
             for t in record.get("conversations", [])]
    turns = [(r, v) for r, v in turns if r and v.strip()]
    if not turns:
        return None
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": r, "content": v} for r, v in turns], tokenize=False)
    return "\n\n".join(f"{r}: {v}" for r, v in turns)


def load_sequences(path, tokenizer, chat: bool, n: int, min_tokens: int, max_tokens: int) -> list[torch.Tensor]:
    """The first ``n`` usable ShareGPT conversations, tokenised and cut at ``max_tokens``
    (a random window is taken later)."""
    from selfspec.tasks.sharegpt import iter_sharegpt

    seqs = []
    for record in iter_sharegpt(path):
        text = conversation_text(record, tokenizer, chat)
        if text is None:
            continue
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: max_tokens]
        if len(ids) >= min_tokens:
            seqs.append(torch.tensor(ids, dtype=torch.long))
        if len(seqs) >= n:
            break
    if not seqs:
        raise ValueError(f"no ShareGPT conversation with >= {min_tokens} tokens in {path or 'the sharegpt asset'}; "
                         "check job.data")
    return seqs


def sample_batch(seqs: list[torch.Tensor], index: int, seed: int, context_length: int, inserts: int,
                 m: int) -> dict:
    """Micro-batch ``index`` (deterministic in it): a random window of a random conversation and
    ``inserts`` distinct insertion points with ``m`` real tokens after each (PPD §3.3)."""
    rng = random.Random(seed * 1_000_003 + index)
    ids = seqs[rng.randrange(len(seqs))]
    length = min(len(ids), context_length)
    start = rng.randrange(len(ids) - length + 1)
    length = rng.randint(min(length, 2 * m + 2), length)  # random truncation
    ids = ids[start: start + length]
    points = rng.sample(range(length - m), min(inserts, length - m))
    return {"ids": ids, "inserts": torch.tensor(sorted(points), dtype=torch.long)}


# --- the forward of training --------------------------------------------------------------------
def insertion_mask(n: int, inserts: torch.Tensor, m: int, n_ept: int) -> torch.Tensor:
    """``[k·m·n_ept, n + k·m·n_ept]`` bool: prompt slot (group g, prompt p, EPT e) sees real
    tokens ``0…inserts[g]`` and EPT ``e`` of prompts ``1…p`` of group ``g`` (ensemble mask)."""
    dev = inserts.device
    k = int(inserts.numel())
    sp = torch.arange(m, device=dev).repeat_interleave(n_ept).repeat(k)
    se = torch.arange(n_ept, device=dev).repeat(m * k)
    sg = torch.arange(k, device=dev).repeat_interleave(m * n_ept)
    real = torch.arange(n, device=dev).unsqueeze(0) <= inserts[sg].unsqueeze(1)
    same = (sg[:, None] == sg[None]) & (se[:, None] == se[None]) & (sp[None] <= sp[:, None])
    return torch.cat([real, same], dim=1)


def student_teacher(model, prompts: PromptTokens, ids: torch.Tensor, inserts: torch.Tensor,
                    checkpoint: bool = False):
    """-> (student logits ``[k, m, V]`` (EPT-averaged, with grad), teacher logits ``[k, m, V]``).
    ``checkpoint``: the student's pass keeps each layer's input only and runs the layer again in
    backward (gradient checkpointing; the same gradients)."""
    m, e = prompts.m, prompts.n_ept
    ids = ids.to(model.device)
    inserts = inserts.to(model.device)
    n, k = int(ids.numel()), int(inserts.numel())
    cache = model.new_cache(n + k * m * e)
    dist = torch.arange(1, m + 1, device=model.device)
    with torch.no_grad():
        h = model.forward(ids.view(1, -1), cache, start=0)
        teacher = model.logits(h[0, (inserts[:, None] + dist).reshape(-1)]).view(k, m, -1)
    emb = prompts.chain().repeat(k, 1).unsqueeze(0)
    positions = (inserts.repeat_interleave(m * e) + dist.repeat_interleave(e).repeat(k)).unsqueeze(0)
    mask = model.prepare_mask(insertion_mask(n, inserts, m, e))
    hs = model.forward(emb, cache, Pass(rows=Rows.packed(positions, mask)), start=n, checkpoint=checkpoint)
    student = PromptTokens.ensemble(model.logits(hs[0]).view(k, m, e, -1))
    return student, teacher


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPD Eq. 1: ``1/m Σ_d α^(d−1) KL(teacher_d ‖ student_d)`` (mean over insertion points).
    Returns (loss, per-distance KL ``[m]``)."""
    t_logp = F.log_softmax(teacher.float(), -1)
    s_logp = F.log_softmax(student.float(), -1)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean(0)  # [m]
    weights = alpha ** torch.arange(kl.numel(), device=kl.device, dtype=kl.dtype)
    return (weights * kl).mean(), kl.detach()


def topk_accuracy(student: torch.Tensor, teacher: torch.Tensor, ks=(1, 5)) -> dict[str, torch.Tensor]:
    """PPD Table 2: does the student's top-k at distance d hold the frozen model's argmax? ``{k: [m]}``."""
    target = teacher.argmax(-1, keepdim=True)
    order = student.topk(max(ks), -1).indices
    return {k: (order[..., :k] == target).any(-1).float().mean(0) for k in ks}


# --- the job -------------------------------------------------------------------------------------
def default_dir(cfg, opts: dict) -> Path:
    """``prompts/<model>``."""
    from selfspec.store.artefacts import default_artefact_dir

    return default_artefact_dir("prompts", str(cfg.model.name))


def objective(ctx) -> Result:
    """Train the prompt tokens :func:`prepare` checked by distillation on ShareGPT."""
    opts, loaded, seed = ctx.opts, ctx.loaded, ctx.seed
    m, n_ept, alpha = opts["m"], opts["n_ept"], opts["alpha"]
    model = loaded.model
    L, inserts, held_out = opts["context_length"], opts["inserts"], opts["held_out"]
    t0 = time.perf_counter()
    seqs = load_sequences(opts["path"], loaded.tokenizer, loaded.chat, opts["n_conversations"] + held_out,
                          2 * m + 2, 4 * L)
    held, train_seqs = seqs[:held_out], seqs[held_out:]
    if not train_seqs:
        raise ValueError(f"only {len(seqs)} conversations loaded, all held out; lower job.held_out")
    log.info("ShareGPT: %d train / %d held-out conversations (%.1fs)", len(train_seqs), len(held),
             time.perf_counter() - t0)
    prompts = PromptTokens.init_from_tokens(model, m, n_ept, seed=seed)
    eval_batches = [sample_batch(held, i, seed + 1, L, opts["eval_inserts"], m) for i in range(len(held))]

    def loss_fn(module, batch):
        student, teacher = student_teacher(model, module, batch["ids"], batch["inserts"],
                                           opts["gradient_checkpointing"])
        loss, kl = distillation_loss(student, teacher, alpha)
        return loss, {f"kl@{d + 1}": float(kl[d]) for d in range(m)}

    def eval_fn(module):
        hits, total = {1: torch.zeros(m), 5: torch.zeros(m)}, 0
        kls = torch.zeros(m)
        for b in eval_batches:
            student, teacher = student_teacher(model, module, b["ids"], b["inserts"])
            k = int(b["inserts"].numel())
            for key, acc in topk_accuracy(student, teacher).items():
                hits[key] += acc.cpu() * k
            kls += distillation_loss(student, teacher, alpha)[1].cpu() * k
            total += k
        out = {f"top{key}@{d + 1}": float(hits[key][d] / total) for key in hits for d in range(m)}
        out.update({f"kl@{d + 1}": float(kls[d] / total) for d in range(m)})
        return out

    result = train(prompts, loss_fn, lambda i: sample_batch(train_seqs, i, seed, L, inserts, m),
                   opts["train"], ctx.ckpt_dir, tracker=ctx.tracker, eval_fn=eval_fn,
                   settings={"model": loaded.name, **OmegaConf.to_container(ctx.cfg.job, resolve=True)},
                   progress=ctx.progress)
    metrics = {**(final_metrics(result["eval"][-1]) if result["eval"] else {}),
               "train_seconds": result["seconds"], "steps": result["step"],
               "initial": result["eval"][0] if result["eval"] else {},
               "final_loss": result["history"][-1]["loss"] if result["history"] else None,
               "params": prompts.embeddings.numel(),
               "param_fraction": prompts.embeddings.numel() / sum(p.numel() for p in model.hf.parameters()),
               "bytes": prompts.num_bytes()}
    log.info("prompts: %s", {k: v for k, v in metrics.items() if "@" in k})
    tensors, fields = prompts_contents(prompts)
    return Result(tensors=tensors, meta=fields, metrics=metrics, summary=metrics,
                  tables={"accuracy": [{"distance": d + 1, "top1": metrics.get(f"top1@{d + 1}"),
                                        "top5": metrics.get(f"top5@{d + 1}")} for d in range(m)]},
                  checkpoint=ctx.ckpt_dir)


# --- memory (selfspec.measure.peak) ----------------------------------------------------------------
def _job_terms(s: Shape, j, b: int) -> list[list[Term]]:
    m, e, k, ctx = int(j.m), int(j.n_ept), int(j.inserts), int(j.context_length)
    rows = k * m * e
    return [[
        Term("optimizer", m * e * s.hidden * b * OPTIMIZER_COPIES, "job.m / job.n_ept", activation=False),
        Term("cache", (ctx + rows) * s.kv_per_token * b, "job.context_length"),
        Term("frozen pass", layer_bytes(s, ctx, b) + scores_bytes(s, ctx, ctx, b), "job.context_length"),
        Term("logits", (k * m + rows) * s.vocab * (b + 16), "job.inserts / job.n_ept"),
        Term("backward through the model", backward_bytes(s, rows, ctx + rows, b, bool(j.get("gradient_checkpointing"))),
             "job.gradient_checkpointing / job.inserts"),
    ]]


def memory_terms(shape: Shape, cfg, b: int, context: int, prompt: int | None) -> list[list[Term]]:
    """This job's memory terms beside the weights, by phase (:class:`~selfspec.measure.peak.MemoryModel`)."""
    return _job_terms(shape, cfg.job, b)


#: fitted by ``scripts/measure_memory.py --fit`` (docs/memory_measured.json); docs/usage.md, "Memory per job and model size"
MEMORY = MemoryModel(memory_terms, s=0.805, runtime=502058188.8,
                     fallbacks=((), ("job.gradient_checkpointing=true",),
              ("job.gradient_checkpointing=true", "job.inserts=8", "job.context_length=256")))

JOB = Job(memory=MEMORY, kind="prompts", tracker_job="train-prompts", prepare=prepare, default_dir=default_dir, objective=objective)

"""The model's own greedy continuations of task prompts: the self-distillation data of the jobs
that learn what the model will generate (AdaDecode's heads, ``job=heads``; the truncated draft
vocabulary, ``job=draft_vocab``).

The paper trains AdaDecode's heads on the target task's training set; offline, the data are the
model's own greedy continuations of task prompts (``job.data=task``), or of several tasks' prompts
(``job.data=mixed``), generated once with batched ``generate`` and cached on disk. Prompts come from
the *end* of each task's shuffled pool, so they do not overlap the evaluated examples (taken from
its start) unless the pool is too small — the overlap is logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf

from selfspec.config import checks
from selfspec.store.files import write_text
from selfspec.training.bars import bar
from selfspec.training.driver import task_names

log = logging.getLogger(__name__)


@dataclass
class Sequence:
    """Prompt + greedy continuation; positions ``start..len-1`` predict the continuation."""

    ids: list[int]
    start: int


@dataclass
class DataTask:
    """A task the heads' prompts come from: its whole pool read and checked before the model loads."""

    cfg: dict
    task: Any
    n_eval: int | None  # examples an evaluation of it would use (for the overlap warning)


def generation_options(job) -> dict:
    """The keys of a job whose data are the model's own greedy continuations (:func:`build_data`):
    ``data`` (task | mixed), ``mixed_tasks``, ``n_prompts``, ``n_heldout``, ``gen_tokens``,
    ``gen_batch``, ``max_prompt_tokens``."""
    key = "job.{}".format
    data = checks.choice(key("data"), job.data, ("task", "mixed"))
    mixed = task_names(key("mixed_tasks"), job.mixed_tasks)
    if data == "mixed" and not mixed:
        raise checks.refuse(key("mixed_tasks"), mixed, "job.data=mixed needs at least one task")
    return {
        "data": data,
        "mixed_tasks": mixed,
        "n_prompts": checks.integer(key("n_prompts"), job.n_prompts, 1),
        "n_heldout": checks.integer(key("n_heldout"), job.n_heldout, 1),
        "gen_tokens": checks.integer(key("gen_tokens"), job.gen_tokens, 1),
        "gen_batch": checks.integer(key("gen_batch"), job.gen_batch, 1),
        "max_prompt_tokens": checks.optional(checks.integer, key("max_prompt_tokens"), job.max_prompt_tokens, 1),
    }


def data_tasks(cfg, data: str, mixed: list[str]) -> list[DataTask]:
    """The task(s) of ``job.data`` (the composed task, or ``job.mixed_tasks``), pools read."""
    from selfspec.config import conf_dir
    from selfspec.tasks import build_task, model_chat

    cfgs = [cfg.task] if data == "task" else [OmegaConf.load(conf_dir() / "task" / f"{n}.yaml") for n in mixed]
    out = []
    for tcfg in cfgs:
        plain = OmegaConf.to_container(tcfg, resolve=True)
        task = build_task(plain, model_chat=model_chat(cfg), n_examples=None)
        task.examples()  # read and check the whole pool now
        out.append(DataTask(plain, task, plain.get("n_examples")))
    return out


def task_prompts(data: DataTask, tokenizer, n: int, max_prompt_tokens: int | None) -> tuple[list[list[int]], int]:
    """The last ``n`` prompts of a task's pool (token ids) and how many overlap its evaluated examples."""
    pool = data.task.examples()
    chosen = pool[-n:]
    overlap = max(0, min(data.n_eval or len(pool), len(pool)) + len(chosen) - len(pool))
    out = []
    for ex in chosen:
        ids = data.task.encode(ex, tokenizer)
        if max_prompt_tokens and len(ids) > max_prompt_tokens:
            ids = ids[-max_prompt_tokens:]
        out.append(ids)
    return out, overlap


def greedy_continuations(loaded, prompts: list[list[int]], gen_tokens: int, batch: int, bar=None) -> list[Sequence]:
    """The model's own greedy continuations (batched ``generate``, left padding), cut after EOS;
    ``bar``: a progress bar advanced by each batch's prompts."""
    hf, device = loaded.model.hf, loaded.model.device
    eos = set(loaded.eos_token_ids)
    pad = loaded.tokenizer.pad_token_id
    pad = pad if pad is not None else (min(eos) if eos else 0)
    seqs = []
    for b in range(0, len(prompts), batch):
        group = prompts[b : b + batch]
        width = max(len(p) for p in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for r, p in enumerate(group):
            ids[r, width - len(p) :] = torch.tensor(p)
            mask[r, width - len(p) :] = 1
        with torch.inference_mode():
            out = hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=gen_tokens,
                              do_sample=False, pad_token_id=pad, eos_token_id=sorted(eos) or None)
        for r, p in enumerate(group):
            cont = out[r, width:].tolist()
            for j, t in enumerate(cont):
                if t in eos:
                    cont = cont[: j + 1]
                    break
            seqs.append(Sequence(p + cont, len(p) - 1))
        log.info("generated continuations %d/%d", min(b + batch, len(prompts)), len(prompts))
        if bar is not None:
            bar.update(len(group))
    return seqs


def build_data(opts: dict, loaded, progress: bool = False) -> tuple[list[Sequence], list[Sequence], str, dict]:
    """Train / held-out sequences for :func:`prepare`'s options (cached on disk), the data tag,
    and data info; ``progress``: a bar over the prompts whose continuations are generated."""
    from selfspec.store.artefacts import default_artefact_dir

    tasks = opts["tasks"]
    tag = tasks[0].task.name if opts["data"] == "task" else "mixed"
    n_train, n_held = opts["n_prompts"], opts["n_heldout"]
    key = json.dumps([loaded.fingerprint, loaded.weights_digest, [(t.cfg, t.task.prompt_format) for t in tasks], n_train, n_held,
                      opts["gen_tokens"], opts["max_prompt_tokens"]], sort_keys=True, default=str)
    cache = default_artefact_dir("heads_data", loaded.name, f"{tag}-{hashlib.sha256(key.encode()).hexdigest()[:12]}")
    file = cache / "sequences.json"
    info = {"data": tag, "tasks": [t.task.name for t in tasks]}
    if file.exists():
        raw = json.loads(file.read_text())
        log.info("heads data: cached sequences from %s", file)
    else:
        t0 = time.perf_counter()
        train_seqs, held_seqs = [], []
        k = len(tasks)
        prompts_bar = bar(total=n_train + n_held, enabled=progress, desc="heads data", unit="prompt")
        for j, data in enumerate(tasks):
            nt = n_train // k + (j < n_train % k)
            nh = n_held // k + (j < n_held % k)
            prompts, overlap = task_prompts(data, loaded.tokenizer, nt + nh, opts["max_prompt_tokens"])
            if overlap:
                log.warning("heads data: %d of task %s's prompts are also among its evaluated examples "
                            "(the pool is too small to keep them apart when all n_examples are evaluated)",
                            overlap, data.task.name)
            seqs = greedy_continuations(loaded, prompts, opts["gen_tokens"], opts["gen_batch"], prompts_bar)
            held_seqs += seqs[:nh]  # the pool's last-but-nt prompts: held out
            train_seqs += seqs[nh:]
        prompts_bar.close()
        raw = {"train": [vars(s) for s in train_seqs], "heldout": [vars(s) for s in held_seqs],
               "seconds": time.perf_counter() - t0}
        write_text(file, json.dumps(raw))  # atomic, a temporary file of its own: two jobs may write it at once
        log.info("heads data: %d + %d sequences generated in %.1fs -> %s", len(train_seqs), len(held_seqs), raw["seconds"],
                 file)
    info["generation_seconds"] = raw.get("seconds")
    return [Sequence(**s) for s in raw["train"]], [Sequence(**s) for s in raw["heldout"]], tag, info


def data_tag(opts: dict) -> str:
    """The data the heads learn from: the task's name (``job.data=task``) or ``mixed``."""
    return opts["tasks"][0].task.name if opts["data"] == "task" else "mixed"

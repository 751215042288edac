"""The one training loop behind every trained artefact (AdaDecode heads, PPD prompt tokens).

Only a small module trains (heads ``T_i``, prompt embeddings); the base model is frozen and
lives inside the caller's ``loss_fn``. The loop gives both jobs the same engineering:

* data parallelism without code changes: run under ``accelerate launch`` (or ``torchrun``);
  each process draws its own micro-batches and gradients are averaged across processes;
* mixed precision on GPU (``accelerate``'s autocast), gradient accumulation, gradient clipping;
* learning-rate schedules (cosine / linear / constant, with warm-up);
* checkpoints every ``ckpt_every`` steps, written atomically, and **resume**: a rerun with the
  same ``ckpt_dir`` continues from the last checkpoint with the same optimizer, schedule,
  history and data position. It must have the same settings (``cfg`` and the job's ``settings``):
  a changed one is refused by name (:class:`CheckpointMismatch`), since the restored optimizer
  and schedule would silently keep the old values while the artefact recorded the new ones. Only
  :data:`RESUMABLE` may change;
* periodic evaluation and logging to a :mod:`selfspec.tracking` tracker.

``batch_fn(i)`` returns micro-batch number ``i`` and must be deterministic in ``i`` (that is
what makes resume exact). Process ``r`` of ``w`` uses indices ``(step * accum + a) * w + r``.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch

from selfspec import checks

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
#: settings a resumed run may change: how often it checkpoints, evaluates and logs, none of which
#: changes the weights. ``steps`` is not among them: the learning-rate schedule (warm-up, cosine or
#: linear decay) is a function of the total, so a resumed run with another total would follow
#: neither schedule.
RESUMABLE = ("ckpt_every", "eval_every", "log_every")


class CheckpointMismatch(ValueError):
    """The checkpoint to resume was written by a run with other settings."""


SCHEDULES = ("cosine", "linear", "constant")
MIXED_PRECISION = ("auto", "no", "bf16", "fp16")


@dataclass
class TrainConfig:
    steps: int = 200
    lr: float = 1e-3
    schedule: str = "cosine"
    warmup_steps: int = 0
    grad_accum: int = 1
    max_grad_norm: float | None = 1.0
    weight_decay: float = 0.0
    mixed_precision: str = "auto"
    ckpt_every: int = 50
    eval_every: int = 50
    log_every: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        """Check every value, named as its job config key (``job.lr=0 is not allowed: ...``)."""
        key = "job.{}".format
        self.steps = checks.integer(key("steps"), self.steps, 1)
        self.lr = checks.number(key("lr"), self.lr, 0, low_open=True)
        self.schedule = checks.choice(key("schedule"), self.schedule, SCHEDULES)
        self.warmup_steps = checks.integer(key("warmup_steps"), self.warmup_steps, 0)
        self.grad_accum = checks.integer(key("grad_accum"), self.grad_accum, 1)
        self.max_grad_norm = checks.optional(checks.number, key("max_grad_norm"), self.max_grad_norm, 0,
                                             low_open=True, why="null = no clipping")
        self.weight_decay = checks.number(key("weight_decay"), self.weight_decay, 0)
        self.mixed_precision = checks.choice(key("mixed_precision"), self.mixed_precision, MIXED_PRECISION)
        self.ckpt_every = checks.integer(key("ckpt_every"), self.ckpt_every, 0, why="0 = only at the end")
        self.eval_every = checks.integer(key("eval_every"), self.eval_every, 0, why="0 = at the start and end only")
        self.log_every = checks.integer(key("log_every"), self.log_every, 1)
        self.seed = checks.integer("seed", self.seed)

    @classmethod
    def from_config(cls, cfg, seed: int = 0) -> "TrainConfig":
        """Take the known keys of a (job) config (other keys belong to the job) and the run's seed."""
        names = {f.name for f in fields(cls)} - {"seed"}
        items = cfg.items() if hasattr(cfg, "items") else vars(cfg).items()
        return cls(**{k: v for k, v in items if k in names}, seed=seed)


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if cfg.schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def _accelerator(cfg: TrainConfig):
    from accelerate import Accelerator

    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    return Accelerator(mixed_precision=mp)


def _save_checkpoint(path: Path, payload: dict[str, Any]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path, prefix=".ckpt-")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
        os.replace(tmp, path / CHECKPOINT)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def load_checkpoint(ckpt_dir: str | Path) -> dict[str, Any] | None:
    path = Path(ckpt_dir) / CHECKPOINT
    if not path.exists():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)


_UNSET = "<unset>"


def check_resume(ckpt_dir: Path, saved: dict[str, Any], settings: dict[str, Any]) -> None:
    """Refuse to resume a checkpoint whose settings differ from ``settings`` (but for
    :data:`RESUMABLE`), naming each changed key with its old and new value."""
    changed = [f"{k}: {saved.get(k, _UNSET)!r} -> {settings.get(k, _UNSET)!r}"
               for k in sorted(set(saved) | set(settings))
               if k not in RESUMABLE and saved.get(k, _UNSET) != settings.get(k, _UNSET)]
    if changed:
        raise CheckpointMismatch(
            f"{ckpt_dir / CHECKPOINT} was written by a run with other settings ({'; '.join(changed)}). "
            "To resume it, restore the old values; to train with the new ones, write the artefact to "
            f"another directory (artefact_dir=...) or delete {ckpt_dir} to start over.")


def train(
    module: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, float]]],
    batch_fn: Callable[[int], Any],
    cfg: TrainConfig,
    ckpt_dir: str | Path,
    tracker=None,
    eval_fn: Callable[[torch.nn.Module], dict[str, float]] | None = None,
    settings: dict[str, Any] | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """Train ``module``'s trainable parameters; return ``{"step", "history", "eval", "seconds"}``.

    ``loss_fn(module, batch)`` returns the loss of one micro-batch and metrics to log.
    ``eval_fn(module)`` returns held-out metrics (run every ``eval_every`` steps and at the end).
    ``settings``: what else shapes the result (model, data, the job's own keys), plain values;
    recorded in the checkpoint with ``cfg`` and checked on resume (:func:`check_resume`).
    ``progress``: a tqdm bar over the steps (stderr: steps done, ETA, the last loss).
    """
    from selfspec.training import bar
    settings = {**(settings or {}), **asdict(cfg)}
    acc = _accelerator(cfg)
    world, rank = acc.num_processes, acc.process_index
    torch.manual_seed(cfg.seed)
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the module to train has no trainable parameters")
    module.to(acc.device)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    ckpt_dir = Path(ckpt_dir)
    start, history, evals, elapsed = 0, [], [], 0.0
    state = load_checkpoint(ckpt_dir)
    if state is not None:
        check_resume(ckpt_dir, state.get("config", {}), settings)
        module.load_state_dict(state["module"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start, history, evals = state["step"], state["history"], state.get("eval", [])
        elapsed = state.get("seconds", 0.0)
        torch.set_rng_state(state["rng"])
        log.info("resumed from %s at step %d", ckpt_dir / CHECKPOINT, start)

    def checkpoint(step: int) -> None:
        if acc.is_main_process:
            _save_checkpoint(ckpt_dir, {
                "module": module.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(), "step": step, "history": history, "eval": evals,
                "rng": torch.get_rng_state(), "config": settings,
                "seconds": elapsed + time.perf_counter() - t0,
            })
        acc.wait_for_everyone()

    def evaluate(step: int) -> None:
        if eval_fn is None or not acc.is_main_process:
            return
        module.eval()
        with torch.no_grad():
            metrics = {f"eval/{k}": float(v) for k, v in eval_fn(module).items()}
        module.train()
        evals.append({"step": step, **metrics})
        if tracker is not None:
            tracker.log(metrics, step=step)
        log.info("step %d eval %s", step, metrics)

    module.train()
    t0 = time.perf_counter()
    if start == 0:
        evaluate(0)
    steps = bar(range(start, cfg.steps), enabled=progress and acc.is_main_process, total=cfg.steps,
                initial=start, desc="train", unit="step")
    for step in steps:
        totals: dict[str, float] = {}
        for a in range(cfg.grad_accum):
            batch = batch_fn((step * cfg.grad_accum + a) * world + rank)
            with acc.autocast():
                loss, metrics = loss_fn(module, batch)
            (loss / cfg.grad_accum).backward()
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach()) / cfg.grad_accum
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v) / cfg.grad_accum
        if world > 1:
            for p in params:
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG)
        if cfg.max_grad_norm:
            totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        totals["lr"] = sched.get_last_lr()[0]
        done = step + 1
        history.append({"step": done, **totals})
        steps.set_postfix(loss=f"{totals['loss']:.4g}", refresh=False)
        if tracker is not None and (done % cfg.log_every == 0 or done == cfg.steps):
            tracker.log({f"train/{k}": v for k, v in totals.items()}, step=done)
        if done % cfg.log_every == 0:
            log.info("step %d/%d %s", done, cfg.steps, {k: round(v, 5) for k, v in totals.items()})
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps:
            evaluate(done)
        if cfg.ckpt_every and done % cfg.ckpt_every == 0:
            checkpoint(done)
    steps.close()
    if not evals or evals[-1]["step"] != cfg.steps:
        evaluate(cfg.steps)
    checkpoint(cfg.steps)
    module.eval()
    return {"step": cfg.steps, "history": history, "eval": evals,
            "seconds": elapsed + time.perf_counter() - t0}


def clear_checkpoint(ckpt_dir: str | Path) -> None:
    """Remove a finished run's checkpoint directory (after its artefact is saved)."""
    shutil.rmtree(ckpt_dir, ignore_errors=True)

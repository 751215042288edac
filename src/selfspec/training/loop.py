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
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch

from selfspec.config import checks
from selfspec.store.files import new_temporary
from selfspec.training.bars import bar

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
    """The loop's settings: a training job's config keys of these names (conf/job/heads.yaml,
    conf/job/prompts.yaml hold their values; there are no defaults here) and the run's seed."""

    steps: int
    lr: float
    schedule: str
    warmup_steps: int
    grad_accum: int
    max_grad_norm: float | None
    weight_decay: float
    mixed_precision: str
    ckpt_every: int
    eval_every: int
    log_every: int
    seed: int

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
        self.seed = checks.seed("seed", self.seed)

    @classmethod
    def keys(cls) -> list[str]:
        """The job config keys the loop reads (every field but ``seed``, which is the run's)."""
        return [f.name for f in fields(cls) if f.name != "seed"]

    @classmethod
    def from_config(cls, job, seed: int) -> "TrainConfig":
        """The loop's keys of a job config (its other keys belong to the job) and the run's seed;
        a key the job config lacks is refused, naming its file (``conf/job/<name>.yaml``)."""
        missing = [k for k in cls.keys() if k not in job]
        if missing:
            raise checks.ConfigError(
                f"job.{missing[0]} is missing: conf/job/{job['name']}.yaml must set {', '.join(missing)} "
                "(the training loop's settings, selfspec.training.loop.TrainConfig)")
        return cls(**{k: job[k] for k in cls.keys()}, seed=seed)


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
    fd, tmp = new_temporary(path, CHECKPOINT)
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


def changed_settings(before: dict[str, Any], now: dict[str, Any], may_change: tuple[str, ...] = RESUMABLE,
                     prefix: str = "") -> list[str]:
    """``"<prefix><key>: <old> -> <new>"`` for each setting that differs, but for ``may_change``: what
    a refused resume or rerun names (:func:`check_resume`, the job driver's finished artefacts). A key
    on one side only whose value on the other is null is no change: a setting added since, at the
    null default that keeps the behaviour before it (ppd_tree's ``data``)."""
    def value(settings: dict[str, Any], k: str) -> Any:  # absent = null where neither side has a value
        return settings.get(k) if before.get(k) is None and now.get(k) is None else settings.get(k, _UNSET)

    return [f"{prefix}{k}: {before.get(k, _UNSET)!r} -> {now.get(k, _UNSET)!r}"
            for k in sorted(set(before) | set(now))
            if k not in may_change and value(before, k) != value(now, k)]


def check_resume(ckpt_dir: Path, saved: dict[str, Any], settings: dict[str, Any]) -> None:
    """Refuse to resume a checkpoint whose settings differ from ``settings`` (but for
    :data:`RESUMABLE`), naming each changed key with its old and new value."""
    changed = changed_settings(saved, settings)
    if changed:
        raise CheckpointMismatch(
            f"{ckpt_dir / CHECKPOINT} was written by a run with other settings ({'; '.join(changed)}). "
            "To resume it, restore the old values; to train with the new ones, write the artefact to "
            f"another directory (artefact_dir=...) or delete {ckpt_dir} to start over.")


class _Run:
    """One call of :func:`train`: the module, its optimizer and schedule, what the run has
    recorded (history, evaluations, seconds) and where it checkpoints."""

    def __init__(self, module: torch.nn.Module, cfg: TrainConfig, ckpt_dir: Path, settings: dict[str, Any],
                 tracker, eval_fn) -> None:
        self.cfg, self.ckpt_dir, self.settings = cfg, ckpt_dir, settings
        self.tracker, self.eval_fn = tracker, eval_fn
        self.acc = _accelerator(cfg)
        self.world, self.rank = self.acc.num_processes, self.acc.process_index
        torch.manual_seed(cfg.seed)
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the module to train has no trainable parameters")
        module.to(self.acc.device)
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(cfg))
        self.start, self.history, self.evals = 0, [], []
        self.elapsed = 0.0  # seconds of the runs before a resume
        self.t0 = time.perf_counter()  # restarted by begin()

    def resume(self) -> None:
        """Continue from the checkpoint in ``ckpt_dir``, if there is one written with the same settings."""
        state = load_checkpoint(self.ckpt_dir)
        if state is None:
            return
        check_resume(self.ckpt_dir, state.get("config", {}), self.settings)
        self.module.load_state_dict(state["module"])
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        self.start, self.history, self.evals = state["step"], state["history"], state.get("eval", [])
        self.elapsed = state.get("seconds", 0.0)
        torch.set_rng_state(state["rng"])
        log.info("resumed from %s at step %d", self.ckpt_dir / CHECKPOINT, self.start)

    def begin(self) -> None:
        """Start the clock of this run's steps; a fresh run is evaluated before its first step."""
        self.module.train()
        self.t0 = time.perf_counter()
        if self.start == 0:
            self.evaluate(0)

    def seconds(self) -> float:
        return self.elapsed + time.perf_counter() - self.t0

    def checkpoint(self, step: int) -> None:
        """Write everything :meth:`resume` reads (the main process; the others wait)."""
        if self.acc.is_main_process:
            _save_checkpoint(self.ckpt_dir, {
                "module": self.module.state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(), "step": step, "history": self.history, "eval": self.evals,
                "rng": torch.get_rng_state(), "config": self.settings, "seconds": self.seconds(),
            })
        self.acc.wait_for_everyone()

    def evaluate(self, step: int) -> None:
        """``eval_fn``'s held-out metrics at ``step`` (main process), recorded and logged."""
        if self.eval_fn is None or not self.acc.is_main_process:
            return
        self.module.eval()
        with torch.no_grad():
            metrics = {f"eval/{k}": float(v) for k, v in self.eval_fn(self.module).items()}
        self.module.train()
        self.evals.append({"step": step, **metrics})
        if self.tracker is not None:
            self.tracker.log(metrics, step=step)
        log.info("step %d eval %s", step, metrics)

    def step(self, step: int, loss_fn, batch_fn) -> dict[str, float]:
        """One optimizer step over ``grad_accum`` micro-batches; its mean loss and metrics, the
        gradient norm (when clipped) and the learning rate."""
        cfg, acc = self.cfg, self.acc
        totals: dict[str, float] = {}
        for a in range(cfg.grad_accum):
            batch = batch_fn((step * cfg.grad_accum + a) * self.world + self.rank)
            with acc.autocast():
                loss, metrics = loss_fn(self.module, batch)
            (loss / cfg.grad_accum).backward()
            totals["loss"] = totals.get("loss", 0.0) + float(loss.detach()) / cfg.grad_accum
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + float(v) / cfg.grad_accum
        if self.world > 1:
            for p in self.params:
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG)
        if cfg.max_grad_norm:
            totals["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        totals["lr"] = self.sched.get_last_lr()[0]
        return totals

    def record(self, done: int, totals: dict[str, float]) -> None:
        """Step ``done``'s totals into the history, the tracker (every ``log_every``) and the log."""
        cfg = self.cfg
        self.history.append({"step": done, **totals})
        if self.tracker is not None and (done % cfg.log_every == 0 or done == cfg.steps):
            self.tracker.log({f"train/{k}": v for k, v in totals.items()}, step=done)
        if done % cfg.log_every == 0:
            log.info("step %d/%d %s", done, cfg.steps, {k: round(v, 5) for k, v in totals.items()})


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
    run = _Run(module, cfg, Path(ckpt_dir), {**(settings or {}), **asdict(cfg)}, tracker, eval_fn)
    run.resume()
    run.begin()
    steps = bar(range(run.start, cfg.steps), enabled=progress and run.acc.is_main_process, total=cfg.steps,
                initial=run.start, desc="train", unit="step")
    for step in steps:
        totals = run.step(step, loss_fn, batch_fn)
        done = step + 1
        run.record(done, totals)
        steps.set_postfix(loss=f"{totals['loss']:.4g}", refresh=False)
        if cfg.eval_every and done % cfg.eval_every == 0 and done != cfg.steps:
            run.evaluate(done)
        if cfg.ckpt_every and done % cfg.ckpt_every == 0:
            run.checkpoint(done)
    steps.close()
    if not run.evals or run.evals[-1]["step"] != cfg.steps:
        run.evaluate(cfg.steps)
    run.checkpoint(cfg.steps)
    module.eval()
    return {"step": cfg.steps, "history": run.history, "eval": run.evals, "seconds": run.seconds()}


def final_metrics(entry: dict[str, Any]) -> dict[str, float]:
    """An evaluation of :func:`train`'s ``eval`` list without its ``step`` and ``eval/`` prefixes."""
    return {k.removeprefix("eval/"): v for k, v in entry.items() if k != "step"}


def clear_checkpoint(ckpt_dir: str | Path) -> None:
    """Remove a finished run's checkpoint directory (after its artefact is saved)."""
    shutil.rmtree(ckpt_dir, ignore_errors=True)

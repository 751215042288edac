"""``python -m selfspec.memory --table``: the table of each job's estimated peak memory per
model size, and the lookup of a job's memory model by its name.

The memory model itself is :mod:`selfspec.measure.peak` (docs/usage.md, "Memory per job and model size", which shows the table);
what each job says about its own memory lives with the job (:class:`~selfspec.measure.peak.MemoryModel`:
a training job's ``JOB.memory``, an evaluation's :data:`selfspec.evaluation.runner.MEMORY`). This
command gathers them from the job registry and the runner (:func:`memory_models`), for the table,
``scripts/measure_memory.py`` and ``scripts/gpu_check.py``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from selfspec.measure.peak import (CUDA_RESERVE, EVAL_CONTEXT, GB, SIZES, Estimate, MemoryModel, Shape, Term,
                                   estimate)


def memory_models() -> dict[str, MemoryModel]:
    """Every job's :class:`~selfspec.measure.peak.MemoryModel` by the job's name, in the table's order:
    each training job's own (``JOB.memory`` of the job registry, :data:`selfspec.train.JOBS`), then an
    evaluation's (:data:`selfspec.evaluation.runner.MEMORY`, named :data:`~selfspec.evaluation.runner.JOB`)."""
    from selfspec.evaluation import runner
    from selfspec.train import JOBS

    return {**{name: JOBS[name].memory for name in JOBS}, runner.JOB: runner.MEMORY}


def jobs() -> tuple[str, ...]:
    """Every job with a memory model, in the table's order (:func:`memory_models`)."""
    return tuple(memory_models())


def memory_model(job: str) -> MemoryModel:
    """The :class:`~selfspec.measure.peak.MemoryModel` of ``job`` (:func:`memory_models`)."""
    models = memory_models()
    if job not in models:
        raise ValueError(f"no memory model of job {job!r}; one of {', '.join(models)}")
    return models[job]


def primary_config(job: str) -> str:
    """The primary config ``job`` is composed from: ``train`` for a training job (selected by
    ``job=<name>``), else the job's own (an evaluation's ``conf/evaluate.yaml``)."""
    from selfspec.train import JOBS

    memory_model(job)
    return "train" if job in JOBS else job


def terms(job: str, shape: Shape, cfg, b: int, context: int = EVAL_CONTEXT,
          prompt: int | None = None) -> list[list[Term]]:
    """``job``'s terms beside the weights, by phase (its memory model's ``terms``)."""
    return memory_model(job).terms(shape, cfg, b, context, prompt)


def job_estimate(job: str, shape: Shape, cfg, dtype: torch.dtype, device: torch.device,
                 context: int = EVAL_CONTEXT, prompt: int | None = None) -> Estimate:
    """:func:`selfspec.measure.peak.estimate` of the job named ``job``."""
    return estimate(job, memory_model(job), shape, cfg, dtype, device, context, prompt)


def job_overrides(job: str) -> list[str]:
    """The overrides that select ``job`` in its :func:`primary_config` (``job=<name>`` for a training job)."""
    return [f"job={job}"] if primary_config(job) == "train" else []


def job_config(job: str, overrides: list[str] = ()):
    """A job's config with ``overrides`` (each a Hydra override), composed from its :func:`primary_config`."""
    from selfspec.config import compose

    return compose([*job_overrides(job), *overrides], config_name=primary_config(job))


def table(sizes: dict[str, Shape] = SIZES, budgets=(24, 40, 80)) -> str:
    """The table (docs/usage.md): per job and model size, the bf16 estimate on one GPU at the defaults, and per
    budget (GB) the first of the job's ``fallbacks`` that fits (or "does not fit")."""
    cuda = torch.device("cuda")
    lines = ["| job | model | estimate (defaults) | " + " | ".join(f"{g} GB" for g in budgets) + " |",
             "|---|---|---|" + "---|" * len(budgets)]
    for job in jobs():
        model = memory_model(job)
        cfgs = [(list(o), job_config(job, ["model=tiny-random", *o])) for o in model.fallbacks]
        for label, shape in sizes.items():
            ests = [(o, estimate(job, model, shape, c, torch.bfloat16, cuda)) for o, c in cfgs]
            cells = []
            for g in budgets:
                fit = next(((o, e) for o, e in ests if e.total + CUDA_RESERVE <= g * GB), None)
                if fit is None:
                    cells.append("does not fit")
                else:
                    cells.append(("defaults" if not fit[0] else " ".join(f"`{x}`" for x in fit[0]))
                                 + f" ({fit[1].total / GB:.1f} GB)" * bool(fit[0]))
            lines.append(f"| {job} | {label} | {ests[0][1].total / GB:.1f} GB | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m selfspec.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--table", action="store_true", help="print the table of docs/usage.md (bf16, one GPU)")
    args = p.parse_args(argv)
    if args.table:
        print(table())
        return 0
    p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())

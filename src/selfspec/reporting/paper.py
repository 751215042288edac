"""The papers' own figures (``paper_figures.yaml``) as :class:`~selfspec.reporting.records.Record` s.

Only numbers printed in the papers we have (``shared/papers``) are listed, each citing its table
and setting. ``method`` is the config label that reproduces the row (``draft_verify_fixed_k`` for
Draft & Verify Table 3), or the paper's name for methods selfspec has no config for. A paper row sits *alongside* a measured row only when the paper's model is the
run's model (``model`` in the data file equals the run's ``model.name``) and the setting (task,
temperature) matches; otherwise it is shown in a separate "paper (<model>)" reference block.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

from selfspec.reporting.records import Record

DATA = Path(__file__).with_name("paper_figures.yaml")
_SETTING = ("table", "source", "paper_model", "model", "method", "task", "variant", "temperature")


@functools.lru_cache(maxsize=None)
def _decoder(label: str) -> str | None:
    """The decoder a method config label configures (``conf/method/<label>.yaml``'s ``name``);
    None for the papers' own methods, which have no config."""
    from selfspec.config import group_options, load_method_config

    if label not in group_options("method"):
        return None
    return str(load_method_config(label).name)


@functools.lru_cache(maxsize=1)
def _entries() -> tuple[dict[str, Any], ...]:
    entries = yaml.safe_load(DATA.read_text())
    for i, e in enumerate(entries):
        missing = [k for k in ("table", "source", "paper_model", "method", "task") if k not in e]
        if missing:
            raise ValueError(f"{DATA} entry {i}: missing {', '.join(missing)}")
    return tuple(entries)


def paper_records(table: str | None = None) -> list[Record]:
    """The paper figures of ``table`` (all tables when None). Missing speedups are derived from
    the paper's vanilla row of the same table, model, task and temperature (marked ``derived``)."""
    entries = [e for e in _entries() if table is None or e["table"] == table]
    records = []
    for e in entries:
        metrics = {k: v for k, v in e.items() if k not in _SETTING}
        records.append(Record(
            table=e["table"], model=e.get("model"), task=e["task"], method=str(e["method"]),
            decoder=_decoder(str(e["method"])),
            variant=e.get("variant"), temperature=e.get("temperature", 0.0), metrics=metrics,
            origin="paper", paper_model=e["paper_model"],
            provenance={"source": e["source"]},
        ))
    vanilla = {(r.table, r.paper_model, r.task, r.field("temperature")): r
               for r in records if r.method == "vanilla"}
    for r in records:
        if r.metric("speedup") is None and r.metric("tokens_per_s") is not None:
            base = vanilla.get((r.table, r.paper_model, r.task, r.field("temperature")))
            if base is not None and base.metric("tokens_per_s"):
                r.metrics["speedup"] = r.metrics["tokens_per_s"] / base.metrics["tokens_per_s"]
                r.provenance["source"] += " (speedup derived from the paper's tokens/s)"
    for r in records:
        note = profile_note(r)
        if note:
            r.provenance["source"] += f"; {note}"
    return records


def profile_note(record: Record) -> str | None:
    """For a paper row that reports τ or an acceptance rate beside its speedup: which profile its
    projection needs (PPD §4: speedup = τ / L_fp; :mod:`selfspec.models.profile`). A τ alone
    does not fix the passes' widths, so the projection runs the paper's method on the profiled
    model shape (``python -m selfspec.project``); the note names the profile that is missing."""
    if record.metric("tau") is None and record.metric("acceptance_rate") is None:
        return None
    if record.method == "vanilla":
        return None
    from selfspec.models.profile import shipped_models

    model = record.model
    have = [name for name, of in shipped_models().items() if model and of == model]
    if have:
        return f"profile of its model shape shipped: {', '.join(have)} (python -m selfspec.project)"
    hint = f"make profile MODEL={model}" if model else f"a model config of {record.paper_model}, then make profile"
    return (f"projection needs a profile of {record.paper_model} on the paper's hardware, none shipped "
            f"({hint} on such a machine)")

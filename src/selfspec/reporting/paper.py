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

from selfspec.measure.speedup import per_token, speedup
from selfspec.models.ledger import HeadOp, LayerOp, Op
from selfspec.reporting.records import Record

DATA = Path(__file__).with_name("paper_figures.yaml")
_SETTING = ("table", "source", "paper_model", "model", "method", "task", "variant", "temperature", "trace")
#: the hardware the papers measured on, where it is not the profiles' (an H100)
PAPER_GPU = {"ppd_speedup": "A100", "dv_fixed_k": "A100", "dv_static": "A100", "dv_text": "A100"}


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
                r.metrics["speedup"] = speedup(per_token(1, base.metrics["tokens_per_s"]),
                                               per_token(1, r.metrics["tokens_per_s"]))
                r.provenance["source"] += " (speedup derived from the paper's tokens/s)"
    for r, e in zip(records, entries):
        note = profile_note(r)
        if note:
            r.provenance["source"] += f"; {note}"
        if e.get("trace"):
            r.projections = paper_projections(r, e["trace"])
    return records


def paper_step(trace: dict[str, Any], shape: dict[str, Any]) -> tuple[list[Op], float]:
    """The ledger ops of one step a paper's figures imply (``paper_figures.yaml``'s ``trace``) and
    the tokens it commits, for a model of ``shape``:

    * PPD (``width``, §4: speedup = τ / L_fp): one pass of the tree's rows through every layer and
      the head on each row; it commits τ tokens (the paper's accept length);
    * Draft & Verify (``drafts`` K, ``skipped`` sublayers, §3-4): K one-row draft passes through the
      layers the skip set keeps, each with the head, then a verification pass of K + 1 rows; with
      each draft accepted with the paper's acceptance rate α until the first rejection, it commits
      ``(1 - α^(K+1)) / (1 - α)`` tokens (the bonus token included)."""
    L, vocab, context = shape["num_layers"], shape["vocab_size"], int(trace["context"])
    if "width" in trace:
        w = int(trace["width"])
        return [LayerOp("verify", w, L, L, context), HeadOp("verify", w, vocab)], float(trace["tau"])
    k, (attn, mlp), alpha = int(trace["drafts"]), trace["skipped"], float(trace["acceptance_rate"])
    ops: list[Op] = [LayerOp("draft", 1, L - attn, L - mlp, context + i) for i in range(k)]
    ops += [HeadOp("draft", 1, vocab)] * k + [LayerOp("verify", k + 1, L, L, context), HeadOp("verify", k + 1, vocab)]
    return ops, (1 - alpha ** (k + 1)) / (1 - alpha)


def paper_projections(record: Record, trace: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{profile name: {"predicted_speedup", "paper_trace"}}``: the step a paper row's figures
    imply (:func:`paper_step`) priced on every shipped bfloat16 profile of its model's shape, over
    vanilla's one-row step at the same context (the profile's host time once per step each)."""
    from selfspec.measure.profile import Profile, shipped, shipped_models

    model = trace.get("shape_of") or record.model
    figures = {"tau": record.metric("tau"), "acceptance_rate": record.metric("acceptance_rate")}
    out = {}
    for name, of in shipped_models().items():
        if of != model:
            continue
        profile = Profile.load(shipped()[name])
        if profile.shape["dtype"] != "bfloat16":
            continue
        ops, tokens = paper_step({**trace, **{k: v for k, v in figures.items() if v is not None}}, profile.shape)
        gpu = PAPER_GPU.get(record.table)
        entry = {"paper_trace": ", ".join(f"{k} {v}" for k, v in {**figures, **trace}.items() if v is not None)
                 + (f"; the paper measured on an {gpu}, the profile on {profile.machine['hardware']}" if gpu else "")}
        why = profile.why_unpriced([{"ops": ops}])
        if why:
            entry["unpriced"], entry["predicted_speedup"] = why, None
        else:
            entry["predicted_speedup"] = speedup(profile.plain_step(int(trace["context"])),
                                                 per_token(profile.price(ops), tokens))
        out[name] = entry
    return out


def profile_note(record: Record) -> str | None:
    """For a paper row that reports τ or an acceptance rate beside its speedup: which profile its
    projection needs (PPD §4: speedup = τ / L_fp; :mod:`selfspec.measure.profile`). A τ alone
    does not fix the passes' widths, so the projection runs the paper's method on the profiled
    model shape (``python -m selfspec.project``); the note names the profile that is missing."""
    if record.metric("tau") is None and record.metric("acceptance_rate") is None:
        return None
    if record.method == "vanilla":
        return None
    from selfspec.measure.profile import shipped_models

    model = record.model
    have = [name for name, of in shipped_models().items() if model and of == model]
    if have:
        return f"profile of its model shape shipped: {', '.join(have)} (python -m selfspec.project)"
    hint = f"make profile MODEL={model}" if model else f"a model config of {record.paper_model}, then make profile"
    return (f"projection needs a profile of {record.paper_model} on the paper's hardware, none shipped "
            f"({hint} on such a machine)")

"""Training artefacts as report inputs: BO traces, head-training histories, tree latency curves,
PPD prompt-token accuracy by distance.

Every artefact directory holds ``meta.json`` (:mod:`selfspec.store.artefacts`: kind, model, task,
training config, metrics). Series are read from JSON-lines files next to it (the skip-set search
writes its BO trace there, one line per evaluated candidate) or from list-valued entries of
``meta.json``'s metrics. What each kind's job writes:

``skip_set``  ``trace.jsonl``: ``{"iteration", <objective>...}`` per candidate
``heads``     ``history.jsonl`` or ``metrics.history``: ``{"step", "loss", ...}`` per logged step
``ppd_tree``  ``curve`` in ``meta.json``: ``{"size", "tau", "latency_s", "speedup"}`` per tree size
``prompts``   ``metrics``: ``top1@d`` / ``top5@d`` on held-out ShareGPT (PPD Table 2)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfspec.store.files import read_json, read_text, strict_json

log = logging.getLogger(__name__)

#: objective names a BO trace may use, in order of preference
OBJECTIVES = ("speedup", "tokens_per_s", "objective", "target", "score")


@dataclass
class ArtefactInfo:
    path: Path
    kind: str
    model: str | None
    task: str | None
    meta: dict[str, Any]

    @property
    def label(self) -> str:
        return self.path.name

    @property
    def metrics(self) -> dict[str, Any]:
        return self.meta.get("metrics") or {}


def read_meta(path: Path) -> dict[str, Any] | None:
    """An artefact's ``meta.json``, None when it is not a regular file of bounded size holding
    strict JSON (:func:`~selfspec.store.files.read_json`)."""
    try:
        return read_json(path / "meta.json")
    except (OSError, ValueError):
        return None


def find_artefacts(root: str | Path) -> list[ArtefactInfo]:
    """Artefact directories (with a readable ``meta.json``) under ``root``; hidden ones (training
    checkpoints, temporary directories) are skipped."""
    root = Path(root)
    out = []
    if not root.is_dir():
        return out
    for meta_path in sorted(root.rglob("meta.json")):
        d = meta_path.parent
        if any(part.startswith(".") for part in d.relative_to(root).parts):
            continue
        meta = read_meta(d)
        if meta is None or "kind" not in meta:
            continue
        out.append(ArtefactInfo(d, str(meta["kind"]), meta.get("model"), meta.get("task"), meta))
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of an artefact's log (a regular file of bounded size), leaving out those that
    are not strict JSON; none when the file cannot be read."""
    try:
        lines = read_text(path).splitlines()
    except (OSError, ValueError):
        return []
    rows = []
    for line in lines:
        if line.strip():
            try:
                rows.append(strict_json(line))
            except ValueError:
                continue
    return rows


def series(info: ArtefactInfo, names: tuple[str, ...], metric_key: str) -> list[dict[str, Any]]:
    """The first of ``names`` (JSON-lines files in the artefact dir) that exists, else
    ``metrics[metric_key]`` when it is a list of dicts."""
    for name in names:
        if (info.path / name).exists():
            return read_jsonl(info.path / name)
    value = info.metrics.get(metric_key)
    if isinstance(value, list) and all(isinstance(v, dict) for v in value):
        return value
    return []


def bo_traces(artefacts: list[ArtefactInfo]) -> tuple[dict[str, list[dict[str, Any]]], str | None]:
    """``({artefact: points}, objective name)`` of the skip-set searches."""
    traces = {a.label: [p for p in series(a, ("trace.jsonl", "bo_trace.jsonl"), "trace") if "header" not in p]
              for a in artefacts if a.kind == "skip_set"}
    traces = {k: v for k, v in traces.items() if v}
    for name in OBJECTIVES:
        if any(isinstance(p.get(name), (int, float)) for pts in traces.values() for p in pts):
            return traces, name
    return {}, None


def heads_histories(artefacts: list[ArtefactInfo]) -> dict[str, list[dict[str, Any]]]:
    out = {a.label: series(a, ("history.jsonl",), "history") for a in artefacts if a.kind == "heads"}
    return {k: v for k, v in out.items() if v}


def tree_curves(artefacts: list[ArtefactInfo]) -> dict[str, list[dict[str, Any]]]:
    """``{artefact: [{"size", "latency" (s), "accept_length" (τ)}]}`` of the PPD tree builds."""
    out = {}
    for a in artefacts:
        curve = a.meta.get("curve") if a.kind == "ppd_tree" else None
        if isinstance(curve, list):
            out[a.label] = [{"size": p.get("size"), "latency": p.get("latency_s"), "accept_length": p.get("tau")}
                            for p in curve if isinstance(p, dict)]
    return {k: v for k, v in out.items() if v}


def draft_vocab_figures(path: str | Path) -> dict[str, float]:
    """``draft_vocab_size`` / ``draft_vocab_coverage`` of a draft vocabulary artefact (empty for
    other kinds): the truncated-head rows' size and held-out coverage."""
    meta = read_meta(Path(path)) or {}
    if meta.get("kind") != "draft_vocab":
        return {}
    return {"draft_vocab_size": meta.get("size"), "draft_vocab_coverage": meta.get("coverage")}


def prompt_accuracy(path: str | Path) -> dict[str, float]:
    """``top1@d`` / ``top5@d`` of a prompts artefact (empty when it has none)."""
    meta = read_meta(Path(path)) or {}
    if meta.get("kind") != "prompts":
        return {}
    return {k: v for k, v in (meta.get("metrics") or {}).items()
            if k.startswith("top") and "@" in k and isinstance(v, (int, float))}

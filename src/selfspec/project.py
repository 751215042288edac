"""``python -m selfspec.project inputs=[run dirs] profile=<profile or folder>`` (``make project``).

Re-costs recorded evaluation runs on another machine's cost profile of the same model shape (PPD
§4: the acceptance length is the algorithm's, the forward latency the machine's): every step's
trace (:mod:`selfspec.models.ledger`) is costed with the profile (:mod:`selfspec.measure.profile`)
and each method's projected speedup and ledger are written into the run's ``summary.json`` under
``projections.<profile name>`` (atomically, holding the run directory), where the report shows
them beside the speedup measured here. A profile of another model shape is refused by name; one of
the same architecture in another dtype is taken (a trace records what was drafted, verified and
accepted, which is the algorithm's, not the dtype's: a float32 run on this CPU projects onto a
GPU's bfloat16 profile), and the projection's name says so: ``<profile> (float32 trace)``.

A run with the speculation gate (``never_slower``) made its plain-or-speculate choices with this
machine's costs; projected as it is, it replays them (on a CPU where speculation seldom pays, a
GPU projection of such a run is mostly plain steps). Its projection says so (``gate: replayed``,
naming the machine). A greedy run of a gated method that always speculated (``never_slower=false``,
the ``*_paper`` methods) holds the algorithm's steps, so its projection also re-decides the gate
on the profile (:func:`selfspec.decoding.gate.replay`): ``regated_speedup`` beside the
always-speculating ``predicted_speedup``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from selfspec.config import checks, conf_dir
from selfspec.measure.speedup import per_token, speedup

log = logging.getLogger(__name__)


def project_run(run_dir: Path, profile) -> dict[str, dict[str, Any]]:
    """Project one run directory onto ``profile``; returns ``{method: {predicted_speedup, ledger}}``
    and records it in the run's ``summary.json``."""
    from selfspec.evaluation.aggregate import summarize
    from selfspec.evaluation.runner import RESULTS, ROW_KEYS, SUMMARY
    from selfspec.store.files import write_json
    from selfspec.store.locks import hold
    from selfspec.tracking import ResultsFile

    with hold(run_dir, f"run directory {run_dir}"):
        summary = _summary(run_dir)
        shape = summary.get("model_shape")
        if not shape:
            raise ValueError(f"{run_dir / SUMMARY} records no model shape (a run from before the cost ledger): "
                             "evaluate it again to project it")
        profile.check_shape(shape, f"run {run_dir}", any_dtype=True)
        names, baseline = list(summary["methods"]), summary["baseline"]
        rows = [r for r in ResultsFile(run_dir / RESULTS, ROW_KEYS).rows() if r.get("method") in names]
        try:
            per_method = summarize(rows, names, baseline, greedy=bool(summary.get("greedy", True)), profile=profile)
        except ValueError as err:  # a trace the profile cannot price (recorded by an older selfspec)
            raise ValueError(f"run {run_dir}: {err}") from None
        projected = {m: {"predicted_speedup": e["predicted_speedup"],
                         "ledger": (e["ledger"] or {}).get("predicted")}
                     | ({"unpriced": e["ledger"]["unpriced"]} if (e["ledger"] or {}).get("unpriced") else {})
                     for m, e in per_method.items()}
        _gates(summary, rows, projected, profile)
        _batches(run_dir, summary, rows, projected, profile)
        summary.setdefault("projections", {})[projection_name(profile, shape)] = \
            projected | {"_profile": profile.summary() | {"dtype": profile.shape["dtype"], "trace_dtype": shape["dtype"]}}
        write_json(run_dir / SUMMARY, summary)
    return projected


def _batches(run_dir: Path, summary: dict[str, Any], rows: list[dict[str, Any]], projected: dict[str, dict[str, Any]],
             profile) -> None:
    """A run in batches (``batch_size > 1``): each method's batches (``batches.jsonl``: every pass it
    ran, a batched walk at all its sequences' rows) priced on ``profile``, as ``batch_predicted_speedup``
    (its predicted throughput over the baseline's; none where a method's batches cover other sequences
    than its ``rows``, as in the run's own summary) and ``batch_predicted_seconds``."""
    from selfspec.evaluation.aggregate import common_rows
    from selfspec.evaluation.batches import batch_summary, open_batches

    if int(summary.get("batch_size") or 1) <= 1 or not (run_dir / "batches.jsonl").exists():
        return
    finished = common_rows(rows, list(summary["methods"]), summary["baseline"])
    for name, b in batch_summary(open_batches(run_dir).rows(), finished, summary["baseline"], profile).items():
        if name in projected and "predicted_seconds" in b:
            projected[name] |= {"batch_predicted_seconds": b["predicted_seconds"],
                                "batch_predicted_speedup": b.get("predicted_speedup")}


def _gates(summary: dict[str, Any], rows: list[dict[str, Any]], projected: dict[str, dict[str, Any]],
           profile) -> None:
    """Label the projections that replay this machine's gate, and re-decide the gate on ``profile``
    for greedy runs that always speculated (module docstring)."""
    from selfspec.decoding import decoder_class
    from selfspec.decoding.gate import replay

    configs = summary.get("method_configs") or {}
    base = [r for r in rows if r["method"] == summary["baseline"] and r.get("trace")]
    base_tokens = sum(r["new_tokens"] for r in base)
    base_seconds = sum(sum(profile.predict(r["trace"]).values()) for r in base)
    machine = (summary.get("run_info") or {}).get("hardware", {}).get("cpu") or "the machine it ran on"
    for method, entry in projected.items():
        cfg = configs.get(method) or {}
        try:
            cls = decoder_class(cfg.get("name", method))
        except (KeyError, ValueError):
            continue  # a peer (transformers' generate): no gate
        if not cls.gated:
            continue
        if cfg.get("never_slower"):
            entry["gate"] = f"replayed: the choices its gate made on {machine}"
            continue
        mine = [r for r in rows if r["method"] == method and r.get("trace")]
        if not summary.get("greedy", True) or not mine or not base_tokens or entry.get("unpriced"):
            continue
        gate = cls.new_gate(profile)  # one gate over the run's examples, as a decoder keeps its own
        seconds = sum(sum(profile.predict(replay(r["trace"], gate)).values()) for r in mine)
        tokens = sum(r["new_tokens"] for r in mine)
        entry["regated_speedup"] = speedup(per_token(base_seconds, base_tokens), per_token(seconds, tokens))
        entry["gate"] = "re-decided on the profile"


def projection_name(profile, shape: dict[str, Any]) -> str:
    """What a run's projection onto ``profile`` is called: the profile's name, followed by
    ``(float32 trace)`` when the run's dtype is not the profile's."""
    ran = shape.get("dtype")
    return profile.name if ran == profile.shape.get("dtype") else f"{profile.name} ({ran} trace)"


def _architecture(shape: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if shape is None else {k: v for k, v in shape.items() if k != "dtype"}


def run_projection(cfg: DictConfig) -> dict[str, dict[str, dict[str, Any]]]:
    """Project every run under ``cfg.inputs`` onto ``cfg.profile``: one profile (a file or a
    shipped name; a run of another model shape is refused), or a folder of profiles (each run onto
    every one of its model shape, in any dtype; a run with none is named and left as it is).
    ``{run dir: {profile name: projection}}``."""
    from selfspec.measure.profile import Profile, resolve
    from selfspec.reporting.records import find_runs

    spec = checks.text("profile", cfg.profile, why="a profile file, a shipped profile's name or a folder of profiles")
    inputs = [str(p) for p in (cfg.inputs or [])]
    if not inputs:
        raise checks.refuse("inputs", cfg.inputs, "must name run directories or folders holding them")
    folder = Path(spec).expanduser()
    profiles = ([Profile.load(p) for p in sorted(folder.glob("*.json"))] if folder.is_dir()
                else [Profile.load(resolve(spec))])
    if not profiles:
        raise FileNotFoundError(f"no profile (*.json) in {folder}: make profile writes one to outputs/profiles")
    runs = find_runs(inputs)
    if not runs:
        raise FileNotFoundError(f"no evaluation run (summary.json) under {', '.join(inputs)}")
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for run_dir in runs:
        shape = _summary(run_dir).get("model_shape")
        fitting = profiles if not folder.is_dir() else [p for p in profiles
                                                         if _architecture(p.shape) == _architecture(shape)]
        if not fitting:
            log.warning("%s: no profile of its model shape in %s; left as it is", run_dir, folder)
        out[str(run_dir)] = {projection_name(p, shape or {}): project_run(Path(run_dir), p) for p in fitting}
    return out


def _summary(run_dir: Path) -> dict[str, Any]:
    """A run's ``summary.json``, or a ValueError naming the file when it is not one selfspec wrote
    (before: a raw JSONDecodeError or AttributeError naming no file; issue 52: a FIFO hung, and
    NaN passed): a regular file of bounded size holding strict JSON
    (:func:`~selfspec.store.files.read_json`)."""
    from selfspec.evaluation.runner import SUMMARY
    from selfspec.store.files import read_json

    path = Path(run_dir) / SUMMARY
    try:
        summary = read_json(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path} cannot be read as a run summary ({err}): evaluate the run again") from None
    from selfspec.reporting.records import MalformedSummary, run_format

    if not isinstance(summary, dict) or not isinstance(summary.get("methods"), dict):
        raise ValueError(f"{path} is not a selfspec run summary (no methods): evaluate the run again")
    try:
        run_format(summary)
    except MalformedSummary as err:
        raise ValueError(f"{path}: {err}") from None
    return summary


@hydra.main(config_path=str(conf_dir()), config_name="project", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from selfspec.reporting.tables import UNGATED, projected_cell

    for run_dir, by_profile in run_projection(cfg).items():
        for name, projected in by_profile.items():
            log.info("%s projected on %s:", run_dir, name)
            for method, p in projected.items():
                if not method.startswith("_"):
                    log.info("  %-24s %s", method, projected_cell(p))
            if any(UNGATED in projected_cell(p) for m, p in projected.items() if not m.startswith("_")):
                log.info("  %s: the gate's choices as made on the machine that ran it, or not priced (the "
                         "projection's gate / unpriced say which)", UNGATED)


if __name__ == "__main__":
    main()

"""Result records: one per (run, method), read from evaluation run directories, W&B or the papers.

An evaluation run directory (``python -m selfspec.evaluate``) holds ``summary.json`` (per-method
figures, see :mod:`selfspec.evaluation.aggregate`), ``results.jsonl`` (one line per example, sample and
method) and Hydra's ``.hydra/`` (the composed config, the overrides and the config-group
choices). Each method in a run becomes one :class:`Record` carrying where it came from: run
directory, git commit, hardware and library versions.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from selfspec.reporting.fields import dotted as _get, label_under_test
from selfspec.reporting.breakdown import is_loaded
from selfspec.store.files import read_json

log = logging.getLogger(__name__)

SUMMARY = "summary.json"
RESULTS = "results.jsonl"


@dataclass
class Record:
    """One method's figures in one setting.

    ``method`` is the method's public identity: its config label (``method=<label>``, the
    ``method`` field of a results row, a key of the summary's ``methods``). ``decoder`` is the
    decoder family the label configures (``draft_verify_static`` -> ``draft_verify``).
    """

    table: str | None
    model: str | None
    task: str | None
    method: str
    metrics: dict[str, Any]
    variant: str | None = None
    temperature: Any = 0.0
    #: how many prompts the run decoded at once (``batch_size``; the papers' rows: 1)
    batch_size: int = 1
    #: ``run`` (a local run directory), ``wandb`` (pulled from W&B) or ``paper``
    origin: str = "run"
    #: run directory / W&B path / citation, commit, hardware, versions; ``artefacts``: inputs
    provenance: dict[str, Any] = field(default_factory=dict)
    #: mean per-example decoder statistics (exit layers, drafts, ...)
    stats: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    #: the paper's own model name (origin="paper")
    paper_model: str | None = None
    experiment: str | None = None
    #: the label's decoder (its config's ``name``); None: the label names the decoder itself
    decoder: str | None = None
    #: the label's resolved method config (summary ``method_configs[label]``); {} when unknown
    method_config: dict[str, Any] = field(default_factory=dict)
    #: the method's cost ledger (:mod:`selfspec.reporting.breakdown`); None for peers and older runs
    ledger: dict[str, Any] | None = None
    #: the run's contention check (``ratio``, ``threshold``, ``flagged``); None when not measured
    contention: dict[str, Any] | None = None
    #: the machine profile the run's predictions used (``name``, ``path``, ``device``, ``hardware``)
    profile: dict[str, Any] | None = None
    #: per profile name, this method's projection on it: ``{"predicted_speedup": f, "ledger": {...}}``
    projections: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def family(self) -> str:
        """The decoder family the label belongs to: what titles and row order go by."""
        return self.decoder or self.method

    def field(self, name: str) -> Any:
        """A row/column field by name (``method``, ``variant``, ``temperature``, ``task``, ``model``)."""
        if name == "temperature":
            return _temperature(self.temperature)
        return getattr(self, name)

    def metric(self, name: str) -> Any:
        return self.metrics.get(name)

    @property
    def decoding(self) -> str:
        """How the record decodes: its temperature's title, and the batch size when it is not 1
        (``greedy``, ``T=0.6``, ``greedy, batch 8``). Speedups compare within one decoding: a batched
        run's vanilla decoded the same batches."""
        t = self.field("temperature")
        return t if self.batch_size == 1 else f"{t}, batch {self.batch_size}"

    @property
    def sampling(self) -> bool:
        """Whether the record's decoding samples (any temperature but greedy's 0)."""
        return self.field("temperature") != "greedy"

    @property
    def losslessness(self) -> str:
        """What the method keeps of vanilla's output (docs/design/contracts.md §2.4): ``tokens`` (greedy: the
        same tokens, measured by consistency), ``distribution`` (sampling: speculative sampling keeps
        vanilla's output distribution; token-level consistency does not apply) or ``lossy`` (PPD's
        typical acceptance under sampling)."""
        if self.metrics.get("lossless") is False:
            return "lossy"
        return "distribution" if self.sampling else "tokens"

    @property
    def loaded(self) -> bool:
        """Whether the run's timings are spoiled by other load (its contention check flagged them):
        its speedups are shown marked, never as clean figures."""
        return is_loaded(self.contention)


def _temperature(t: Any) -> str:
    if isinstance(t, (int, float)):
        return "greedy" if float(t) == 0.0 else f"T={float(t):g}"
    return "greedy" if t is None else f"T={t}"


# --- configs ------------------------------------------------------------------------------------
def _load_yaml(path: Path) -> Any:
    """A ``.hydra/`` file of a run (:func:`~selfspec.store.files.read_text`: a regular file of
    bounded size), or a :class:`ValueError` naming it when it is not YAML."""
    import io

    import yaml
    from omegaconf import OmegaConf

    from selfspec.store.files import read_text

    try:
        return OmegaConf.load(io.StringIO(read_text(path)))
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not YAML ({str(err).splitlines()[0]})") from None


#: the resolvers a config read from a run may call: those that read the config itself only
SAFE_RESOLVERS = ("oc.select",)


def _calls_resolver(value: str) -> bool:
    """Whether the config value ``value`` calls a resolver outside :data:`SAFE_RESOLVERS`
    (``${oc.env:...}``, ``${hydra:...}``, ``${now:...}``, nested ones too), read with OmegaConf's
    own grammar; a value the grammar cannot read counts as one."""
    from omegaconf import grammar_parser
    from omegaconf.errors import GrammarParseError
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser

    try:
        tree = grammar_parser.parse(value)
    except GrammarParseError:
        return True
    todo = [tree]
    while todo:
        node = todo.pop()
        if (isinstance(node, OmegaConfGrammarParser.InterpolationResolverContext)
                and node.resolverName().getText() not in SAFE_RESOLVERS):
            return True
        todo.extend(node.getChildren() if hasattr(node, "getChildren") else ())
    return False


def _as_written(node: Any) -> Any:
    """A plain copy of a config in which every string that calls a resolver (:func:`_calls_resolver`)
    is escaped, so that resolving it gives back the string as written."""
    if isinstance(node, dict):
        return {k: _as_written(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_as_written(v) for v in node]
    if isinstance(node, str) and "${" in node and _calls_resolver(node):
        return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", node)
    return node


def resolve_config(cfg: Any) -> dict[str, Any]:
    """A plain dict of a config read from a run (its summary, or ``.hydra/config.yaml``), possibly
    unresolved. Only interpolations between its own keys are resolved (``K=${method.max_draft}``);
    a value that calls a resolver that reads anything but the config (:func:`_calls_resolver`), or
    leads to one through those interpolations, is kept as it is written (issue 52: a foreign
    summary's ``${oc.env:...}`` put the reporting user's environment into the report). A value
    whose interpolation cannot be resolved (a key it lacks) is kept as its raw string."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(cfg, (DictConfig, ListConfig)):
        cfg = OmegaConf.to_container(cfg, resolve=False)
    if not isinstance(cfg, (dict, list)):
        return cfg
    cfg = OmegaConf.create(_as_written(cfg))

    def walk(node: Any) -> Any:
        if isinstance(node, DictConfig):
            out = {}
            for key in node.keys():
                try:
                    out[str(key)] = walk(node[key])
                except Exception:  # noqa: BLE001 — unresolvable interpolation
                    out[str(key)] = OmegaConf.to_container(node, resolve=False).get(key)
            return out
        if isinstance(node, ListConfig):
            items = []
            for i in range(len(node)):
                try:
                    items.append(walk(node[i]))
                except Exception:  # noqa: BLE001
                    items.append(OmegaConf.to_container(node, resolve=False)[i])
            return items
        return node

    return walk(cfg)


def run_config(run_dir: Path, summary: dict[str, Any]) -> tuple[dict, list[str], dict]:
    """(resolved config, command-line overrides, config-group choices) of a run directory: the
    summary's ``config`` and Hydra's record of the command line (``.hydra/``); a :class:`ValueError`
    naming the ``.hydra/`` file that is not what Hydra writes."""
    cfg = resolve_config(summary["config"])
    hydra = run_dir / ".hydra"
    overrides: list[str] = []
    if (hydra / "overrides.yaml").exists():
        from omegaconf import ListConfig, OmegaConf

        found = _load_yaml(hydra / "overrides.yaml")
        listed = OmegaConf.to_container(found, resolve=False) if isinstance(found, ListConfig) else None
        if listed is None or not all(isinstance(o, str) for o in listed):
            raise ValueError(f"{hydra / 'overrides.yaml'} is not a list of overrides (strings)")
        overrides = listed
    choices: dict[str, Any] = {}
    if (hydra / "hydra.yaml").exists():
        from omegaconf import OmegaConf

        hydra_cfg = OmegaConf.to_container(_load_yaml(hydra / "hydra.yaml"), resolve=False)
        choices = _get(hydra_cfg, "hydra.runtime.choices", {}) or {}
        if not isinstance(choices, dict):
            raise ValueError(f"{hydra / 'hydra.yaml'}'s hydra.runtime.choices is not a mapping")
    return cfg, overrides, choices


_IGNORED_OVERRIDES = re.compile(r"^\+*(task|model|experiment|logger|hydra[./]|n_examples|report[.])")


def variant_label(cfg: dict[str, Any], overrides: list[str]) -> str | None:
    """What distinguishes this run from its siblings in the same table.

    ``report.variant`` (a preset sets it, usually as an interpolation such as
    ``K=${method.max_draft}``) wins; else the method overrides of the command line. The method
    config chosen (``method=draft_verify_static``) is the record's label, not part of its variant.
    """
    label = _get(cfg, "report.variant")
    if label not in (None, ""):
        return str(label)
    return ", ".join(o for o in overrides if o.startswith("method.")) or None


# --- summaries ----------------------------------------------------------------------------------
#: keys of a per-method summary entry (selfspec.evaluation.aggregate.summarize) that are figures
_FIGURES = ("n_examples", "new_tokens", "seconds", "tokens_per_s", "seconds_per_token", "speedup",
            "predicted_speedup", "tau", "acceptance_rate", "lossless", "consistency", "prefix_agreement")


def entry_metrics(entry: dict[str, Any]) -> dict[str, Any]:
    """Flat metrics of one method entry: the figures, the task metrics, ms per token."""
    metrics = {k: entry.get(k) for k in _FIGURES if k in entry}
    metrics.update(entry.get("metrics") or {})
    spt = entry.get("seconds_per_token")
    if spt is not None:
        metrics["ms_per_token"] = 1000.0 * spt
    return metrics


def provenance(run_dir: Path | str, summary: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    info = summary["run_info"]
    versions = info.get("versions") or {}
    hardware = info.get("hardware") or {}
    return {
        "source": str(run_dir),
        "commit": info.get("git_commit"),
        "hardware": _hardware_line(hardware, info.get("device")),
        "versions": ", ".join(f"{k} {v}" for k, v in versions.items() if k in ("torch", "transformers", "selfspec")),
        "mtime": _mtime(Path(run_dir) / SUMMARY),
        "artefacts": sorted({p for paths in (summary.get("artefacts") or {}).values() for p in paths or []}),
    }


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _hardware_line(hw: dict[str, Any], device: Any = None) -> str:
    if not hw:
        return str(device or "")
    gpu = hw.get("gpu")
    if gpu:
        return f"{gpu} ×{hw.get('gpu_count', 1)}"
    isa = f", {hw['cpu_capability']}" if hw.get("cpu_capability") else ""
    return f"CPU {hw.get('cpu', '')}{isa} ({hw.get('cpu_threads', '?')} threads)".replace("  ", " ")


def records_from_summary(summary: dict[str, Any], cfg: dict[str, Any], *, source: str, origin: str,
                         overrides: list[str] | None = None, choices: dict[str, Any] | None = None) -> list[Record]:
    """One :class:`Record` per method label of a summary, with the run's setting."""
    overrides, choices = overrides or [], choices or {}
    prov = provenance(source, summary, cfg)
    from selfspec.reporting.layouts import LAYOUTS

    layout = LAYOUTS.get(_get(cfg, "report.table"))
    if layout is not None and layout.variant is not None:
        variant = layout.variant(cfg, summary)
    else:
        variant = variant_label(cfg, overrides)
    baseline = _get(cfg, "baseline", "vanilla")
    under_test = label_under_test(summary)
    configs = summary["method_configs"]
    artefacts = summary.get("artefacts") or {}
    projections = summary.get("projections") or {}
    out = []
    for method, entry in summary["methods"].items():
        metrics = entry_metrics(entry)
        for path in artefacts.get(method) or []:
            # PPD Table 2: the prompt tokens' accuracy by distance, measured when they were trained
            # and a truncated draft head's size and coverage, counted when it was built
            from selfspec.reporting.artefact_figures import draft_vocab_figures, prompt_accuracy

            figures = {**prompt_accuracy(path), **draft_vocab_figures(path)}
            metrics.update({k: v for k, v in figures.items() if k not in metrics})
        method_cfg = configs.get(method) or {}
        out.append(Record(
            table=_get(cfg, "report.table"),
            experiment=choices.get("experiment") or _get(cfg, "report.experiment"),
            model=_get(cfg, "model.name"),
            task=_get(cfg, "task.name"),
            method=method,
            decoder=method_cfg.get("name"),
            method_config=method_cfg,
            # the variant describes the method under test; the baseline and peers are themselves
            variant=variant if method == under_test and method != baseline else None,
            temperature=_get(cfg, "sampling.temperature", 0.0),
            batch_size=_batch_size(cfg),
            metrics=metrics,
            stats=entry.get("stats") or {},
            origin=origin,
            provenance=prov,
            config=cfg,
            ledger=entry.get("ledger"),
            contention=summary.get("contention"),
            profile=summary.get("profile"),
            projections={name: by_method[method] for name, by_method in projections.items()
                         if isinstance(by_method, dict) and isinstance(by_method.get(method), dict)},
        ))
    return out


def _batch_size(cfg: dict[str, Any]) -> int:
    """A run config's ``batch_size`` (1 in a run of the format before batches, which had none)."""
    b = _get(cfg, "batch_size", 1)
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
        raise MalformedSummary(f"field 'config.batch_size' is {b!r}, not a positive integer")
    return b


class MalformedSummary(ValueError):
    """A summary.json whose shape or figures are not what an evaluation writes (names the field)."""


#: the run record formats this selfspec reads (docs/design/assets-and-formats.md §9): 2, written from issue 53
#: on (summary.json's ``format``: :data:`selfspec.evaluation.loop.RUN_FORMAT`), and 1, the summaries
#: without a ``format`` field, written from 2026-11-22 (7f0543e) to issue 53
RUN_FORMATS = (1, 2)
#: the fields a run summary of every format read holds (a tracker's summary: all but ``config`` and
#: ``baseline``, which its run's config holds)
RUN_FIELDS = ("method", "methods", "baseline", "method_configs", "run_info", "config")


def run_format(summary: dict[str, Any], fields: tuple[str, ...] = RUN_FIELDS) -> int:
    """A run summary's format (1 when it has no ``format`` field), refused with
    :class:`MalformedSummary` when this selfspec does not read it (:data:`RUN_FORMATS`: a newer
    one, or a summary older than format 1, which lacks one of ``fields``)."""
    found = summary.get("format", 1)
    if found not in RUN_FORMATS:
        raise MalformedSummary(f"field 'format' is {found!r}: this selfspec reads run formats "
                               f"{', '.join(map(str, RUN_FORMATS))} (docs/design/assets-and-formats.md §9)")
    missing = [k for k in fields if k not in summary]
    if missing:
        raise MalformedSummary(f"field '{missing[0]}' is missing: a run older than format 1 (written before "
                               "2026-11-22), which this selfspec no longer reads; evaluate it again")
    return found


#: figures of a method entry that are numbers (or null), and those that are true/false (or null)
_NUMBERS = ("n_examples", "new_tokens", "seconds", "tokens_per_s", "seconds_per_token", "speedup",
            "predicted_speedup", "tau", "acceptance_rate", "consistency", "prefix_agreement")
_FLAGS = ("lossless",)


def check_summary(summary: Any) -> None:
    """Raise :class:`MalformedSummary` naming the first field that an evaluation's summary.json
    would not hold: the top level must be an object with a ``methods`` object of method entries,
    each of whose figures is a number (or null) and ``lossless`` true, false or null; a ``ledger``
    (null or an object whose ``measured`` and ``predicted`` are null or objects of numbers) and a
    ``contention`` (null or an object)."""
    if not isinstance(summary, dict):
        raise MalformedSummary(f"the top level is {type(summary).__name__}, not an object")
    methods = summary.get("methods")
    if not isinstance(methods, dict) or not methods:
        raise MalformedSummary("field 'methods' is missing or not an object of method entries")
    for name, entry in methods.items():
        if not isinstance(entry, dict):
            raise MalformedSummary(f"field 'methods.{name}' is not an object")
        for key in _NUMBERS:
            v = entry.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise MalformedSummary(f"field 'methods.{name}.{key}' is {v!r}, not a number")
        for key in _FLAGS:
            v = entry.get(key)
            if v is not None and not isinstance(v, bool):
                raise MalformedSummary(f"field 'methods.{name}.{key}' is {v!r}, not true or false")
        for key in ("metrics", "stats", "ledger"):
            if entry.get(key) is not None and not isinstance(entry[key], dict):
                raise MalformedSummary(f"field 'methods.{name}.{key}' is not an object")
        for side in ("measured", "predicted"):
            part = (entry.get("ledger") or {}).get(side)
            if part is None:
                continue
            if not isinstance(part, dict):
                raise MalformedSummary(f"field 'methods.{name}.ledger.{side}' is not an object")
            for key, v in part.items():
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                    raise MalformedSummary(f"field 'methods.{name}.ledger.{side}.{key}' is {v!r}, not a number")
    for key in ("contention", "profile", "projections"):
        if summary.get(key) is not None and not isinstance(summary[key], dict):
            raise MalformedSummary(f"field '{key}' is not an object")
    _check_contention(summary.get("contention"))
    run_format(summary)


def _check_contention(contention: dict[str, Any] | None) -> None:
    """The contention check's record, as :func:`~selfspec.reporting.breakdown.contention_warning` reads
    it (issue 39: a spoiled generation without its ``excess`` aborted the whole report)."""
    if not contention:
        return
    for key in ("ratio", "threshold"):
        v = contention.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise MalformedSummary(f"field 'contention.{key}' is {v!r}, not a number")
    spoiled = contention.get("spoiled") or []
    if not isinstance(spoiled, list):
        raise MalformedSummary("field 'contention.spoiled' is not a list")
    for i, g in enumerate(spoiled):
        if not isinstance(g, dict):
            raise MalformedSummary(f"field 'contention.spoiled[{i}]' is not an object")
        excess = g.get("excess")
        if isinstance(excess, bool) or not isinstance(excess, (int, float)):
            raise MalformedSummary(f"field 'contention.spoiled[{i}]' lacks a number 'excess'")
        if not all(k in g for k in ("method", "id")):
            raise MalformedSummary(f"field 'contention.spoiled[{i}]' lacks its 'method' or 'id'")


@dataclass(frozen=True)
class LeftOut:
    """A run, or some of its records, that the report leaves out of its tables, and why (issue 68:
    an older run of one setting was dropped without a word). ``source``: the run directory, or the
    file that could not be read."""

    source: str
    why: str

    def __str__(self) -> str:
        return f"{self.source}: {self.why}"


def read_run(run_dir: str | Path) -> list[Record]:
    """The records of one evaluation run directory (empty when it has no summary yet, or one that
    cannot be read or is malformed: a warning line names the file and the field)."""
    records, left_out = _read_run(Path(run_dir))
    if left_out is not None:
        log.warning("skipping %s", left_out)
    return records


def _read_run(run_dir: Path) -> tuple[list[Record], LeftOut | None]:
    """:func:`read_run`'s records, and why the run is left out (None: it is not)."""
    path = run_dir / SUMMARY
    if not os.path.lexists(path):
        return [], None
    try:
        summary = read_json(path)
        check_summary(summary)
    except (OSError, ValueError) as err:
        return [], LeftOut(str(path), str(err))
    try:
        cfg, overrides, choices = run_config(run_dir, summary)
    except (OSError, ValueError) as err:  # issue 52: one malformed .hydra/ file aborted the whole report
        return [], LeftOut(str(run_dir), str(err))
    try:
        return records_from_summary(summary, cfg, source=str(run_dir), origin="run",
                                    overrides=overrides, choices=choices), None
    except MalformedSummary as err:  # a config field the records read (batch_size)
        return [], LeftOut(str(path), str(err))


def find_runs(inputs: Iterable[str | Path]) -> list[Path]:
    """Evaluation run directories (those holding ``summary.json``) under each input, sorted."""
    found: set[Path] = set()
    for root in inputs:
        root = Path(root)
        if (root / SUMMARY).exists():
            found.add(root)
        elif root.is_dir():
            found.update(p.parent for p in root.rglob(SUMMARY))
        else:
            log.info("no results under %s", root)
    return sorted(found)


def collect(inputs: Iterable[str | Path]) -> list[Record]:
    """Every record under ``inputs`` (run directories or folders that contain them)."""
    return collect_runs(find_runs(inputs))[0]


def collect_runs(runs: Iterable[Path]) -> tuple[list[Record], list[LeftOut]]:
    """The records of ``runs`` (run directories), and the runs left out (a warning line each): those
    whose summary or ``.hydra/`` files cannot be read."""
    records: list[Record] = []
    left_out: list[LeftOut] = []
    for run in runs:
        found, why = _read_run(Path(run))
        records.extend(found)
        if why is not None:
            log.warning("skipping %s", why)
            left_out.append(why)
    return records, left_out


def setting(r: Record) -> tuple:
    """What makes two records runs of one setting, of which ``newest_only`` keeps the newest: the
    table, model, task, method label, variant, temperature, batch size (and the paper's model)."""
    return (r.table, r.model, r.task, r.method, r.variant, r.field("temperature"), r.batch_size, r.paper_model)


def latest_only(records: list[Record]) -> list[Record]:
    """Keep, per setting (:func:`setting`), the record of the newest run (by its summary's
    modification time), so a re-run replaces a table row."""
    return newest_per_setting(records)[0]


def newest_per_setting(records: list[Record]) -> tuple[list[Record], list[LeftOut]]:
    """:func:`latest_only`'s records, and what it leaves out: per older run, its records that a newer
    run of the same setting replaces, naming that run."""
    best: dict[tuple, Record] = {}
    for r in records:
        key = setting(r)
        if key not in best or r.provenance.get("mtime", 0.0) >= best[key].provenance.get("mtime", 0.0):
            best[key] = r
    replaced: dict[tuple, list[str]] = {}
    for r in records:
        newer = best[setting(r)]
        if newer is not r:
            where = (str(r.provenance.get("source")), str(newer.provenance.get("source")), r.model, r.task, r.decoding)
            replaced.setdefault(where, []).append(r.method)
    left_out = [LeftOut(old, f"its {', '.join(methods)} ({model} · {task}, {decoding}): {new} is a newer run of the "
                             "same setting, shown instead (newest_only=true keeps the newest run per setting; "
                             "newest_only=false lists every run)")
                for (old, new, model, task, decoding), methods in replaced.items()]
    return list(best.values()), left_out

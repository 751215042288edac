"""Experiment tracking: Weights & Biases, or nothing — local result files are written either way.

    tracker = start_run(cfg, job_type="evaluate")        # cfg.logger: conf/logger/{wandb,none}.yaml
    tracker.log({"loss": 1.2}, step=10)
    tracker.summary({"speedup": 1.8})
    tracker.table("examples", rows)                     # list of flat dicts
    tracker.use_artifact("outputs/artefacts/heads/smollm2-135m-xsum")   # lineage: input
    tracker.log_artifact(path, kind="heads")            # lineage: output
    tracker.finish()

``logger=none`` gives a no-op :class:`Tracker`. ``logger=wandb`` with ``logger.mode=auto`` runs
online iff an API key is configured (``WANDB_API_KEY`` or ``~/.netrc``), offline otherwise (sync
later with ``wandb sync <run dir>/wandb/offline-run-*``); an explicit ``WANDB_MODE`` wins over
``auto``. Runs are grouped by ``logger.group`` (default: the Hydra sweep directory name) and
tagged with the model, method, task and job type. A run that would log online first makes sure
the W&B server answers (:func:`check_logger`, before anything expensive, at most
:data:`REACH_SECONDS`); where it does not, the run is refused with one message naming the
offline mode, never switched to it silently (before: about 100 s of W&B's retries, then a raw
``CommError`` after the model had loaded).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
from pathlib import Path
from typing import Any

from selfspec.config import checks
from selfspec.store.files import to_jsonable, write_text
from selfspec.tracking.local import ResultsFile, ResultsFileError, RunLogHandler, open_run_log

log = logging.getLogger(__name__)

__all__ = ["Tracker", "WandbTracker", "ResultsFile", "ResultsFileError", "RunLogHandler", "artifact_name",
           "open_run_log", "check_logger", "hydra_output_dir", "run_tags", "save_hydra_files", "start_run",
           "wandb_mode"]


class Tracker:
    """The tracker interface; this base class does nothing (``logger=none``)."""

    enabled = False

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Time-series metrics (training curves, running tokens/s)."""

    def summary(self, values: dict[str, Any]) -> None:
        """Final, per-run values."""

    def table(self, name: str, rows: list[dict[str, Any]]) -> None:
        """A table of flat dict rows (e.g. one row per example)."""

    def log_artifact(self, path: str | Path, kind: str, name: str | None = None) -> None:
        """Record a produced artefact directory or file (output lineage)."""

    def use_artifact(self, ref: str | Path, kind: str | None = None) -> None:
        """Record an artefact this run consumes (input lineage): a local path or a W&B name."""

    def finish(self) -> None:
        """Close the run."""

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish()


def _get(cfg, key):
    """``cfg[key]``, None when ``cfg`` is None or lacks it (a config without a logger has none)."""
    if cfg is None:
        return None
    return cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)


def artifact_name(path: str | Path, kind: str) -> str:
    """W&B artifact name of a local artefact directory: ``<kind>-<dir name>``, sanitised.

    The same name for the training run that logs it and the evaluation run that uses it gives
    W&B's lineage graph (the contents' digest picks the version).
    """
    stem = Path(path).resolve().name
    name = stem if stem.startswith(f"{kind}-") else f"{kind}-{stem}"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _artefact_kind(path: Path) -> str | None:
    meta = path / "meta.json" if path.is_dir() else None
    if meta is not None and meta.exists():
        import json

        try:
            return json.loads(meta.read_text()).get("kind")
        except (OSError, ValueError):
            return None
    return None


def _api_key_configured() -> bool:
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    try:
        from wandb.sdk.lib.wbauth import read_netrc_auth

        return bool(read_netrc_auth(host=host))
    except Exception:  # noqa: BLE001 — private API moved or a malformed netrc: treat as no key
        return False


LOGGERS = ("none", "wandb")
#: the keys of conf/logger/wandb.yaml, which sets each of them (none is read with a fallback)
WANDB_KEYS = ("name", "project", "entity", "mode", "group", "tags", "log_artifacts")
MODES = ("auto", "online", "offline", "disabled")


#: seconds the W&B server of an online run has to accept a connection before the run is refused
REACH_SECONDS = 5.0


def _unreachable_wandb() -> str | None:
    """Why the W&B server this process would log to does not answer (``WANDB_BASE_URL``, default
    W&B's cloud), or None once it accepted a TCP connection. The name lookup and the connection
    together get :data:`REACH_SECONDS` (a lookup alone can block longer than a socket timeout)."""
    from urllib.parse import urlsplit

    url = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    parts = urlsplit(url)
    result: list[str | None] = []

    def connect() -> None:
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            with socket.create_connection((parts.hostname, port), timeout=REACH_SECONDS):
                result.append(None)
        except (OSError, ValueError) as err:
            result.append(f"{url} cannot be reached ({getattr(err, 'strerror', None) or err})")

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(REACH_SECONDS + 1)
    return result[0] if result else f"{url} did not answer within {REACH_SECONDS:g} s"


def _wandb_refusal(**setting: Any) -> str | None:
    """W&B's own words when its settings (``wandb.Settings``, which ``wandb.init`` builds) refuse
    ``setting``, else None."""
    import pydantic
    import wandb
    from wandb.errors import UsageError

    try:
        wandb.Settings(**setting)
    except pydantic.ValidationError as err:
        return "; ".join(e["msg"] for e in err.errors())
    except UsageError as err:
        return str(err)
    return None


def _check_wandb_settings(logger_cfg, mode: str, tags: list[str] | None) -> None:
    """Refuse, by key, a project name, a mode or a tag that W&B refuses (issue 52: they failed raw in
    ``wandb.init``, after the model had loaded); ``tags``: the run's own (:func:`run_tags`), else the
    config's."""
    project = str(_get(logger_cfg, "project"))
    mode_key = f"WANDB_MODE={mode}" if _get(logger_cfg, "mode") == "auto" and os.environ.get("WANDB_MODE") \
        else f"logger.mode={mode}"
    configured = [str(t) for t in _get(logger_cfg, "tags") or []]
    added = [t for t in tags or [] if t not in configured]
    for key, setting in ((f"logger.project={project}", {"project": project}), (mode_key, {"mode": mode}),
                         (f"logger.tags={checks.show(configured)}", {"run_tags": tuple(configured)}),
                         (f"the run's own tags {checks.show(added)} (from model.name, the method and task.name)",
                          {"run_tags": tuple(added)})):
        why = _wandb_refusal(**setting)
        if why:
            raise checks.ConfigError(f"{key} is not allowed: W&B refuses it ({why})")


def check_logger(logger_cfg, tags: list[str] | None = None) -> str:
    """The ``logger`` config's name, with its keys checked (also as W&B checks them: ``tags``, the
    run's tags from :func:`run_tags` where known) and, for a run that logs online, the W&B server
    reached (before anything expensive runs)."""
    if logger_cfg is None:
        return "none"
    kind = _get(logger_cfg, "name")
    checks.choice("logger.name", kind, LOGGERS, why="use logger=wandb or logger=none (conf/logger/)")
    if kind == "wandb":
        checks.required_keys("logger", logger_cfg, WANDB_KEYS, "conf/logger/wandb.yaml")
        checks.known_keys("logger", logger_cfg, WANDB_KEYS, "conf/logger/wandb.yaml")
        mode = wandb_mode(_get(logger_cfg, "mode"))
        checks.flag("logger.log_artifacts", _get(logger_cfg, "log_artifacts"))
        checks.text("logger.project", _get(logger_cfg, "project"))
        _check_wandb_settings(logger_cfg, mode, tags)
        why = _unreachable_wandb() if mode == "online" else None
        if why:
            how = ("logger.mode=online" if _get(logger_cfg, "mode") == "online" else
                   "WANDB_MODE=online" if os.environ.get("WANDB_MODE") else "logger.mode=auto with a W&B API key")
            raise checks.ConfigError(
                f"logger=wandb logs online here ({how}), and the W&B server {why}: set logger.mode=offline to "
                "log to local files (`wandb sync` uploads them later), or logger=none")
    return kind


def wandb_mode(mode: str) -> str:
    """``online`` / ``offline`` / ``disabled`` for a ``logger.mode`` setting (see module docs)."""
    checks.choice("logger.mode", mode, MODES)
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE")
    if env:
        return "offline" if env == "dryrun" else env
    return "online" if _api_key_configured() else "offline"


def hydra_output_dir() -> Path | None:
    """The Hydra run directory when called inside a ``@hydra.main`` job, else None."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001
        pass
    return None


def save_hydra_files(run_dir: str | Path, cfg) -> None:
    """Inside a ``@hydra.main`` job, write Hydra's record of it to ``run_dir/.hydra/`` as Hydra does:
    the job's ``config.yaml`` (``cfg``), ``hydra.yaml`` and the command line's ``overrides.yaml``.

    For entry points whose config sets ``hydra.output_subdir: null`` (conf/evaluate.yaml): Hydra
    then writes nothing before the job runs, and the job calls this once it has accepted the run
    directory, so a refused rerun leaves the earlier run's record untouched. No-op outside Hydra.
    """
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.instance().cfg  # {"hydra": ...}
    out = Path(run_dir) / ".hydra"
    files = {"config.yaml": cfg, "hydra.yaml": hydra_cfg, "overrides.yaml": hydra_cfg.hydra.overrides.task}
    for name, node in files.items():
        write_text(out / name, OmegaConf.to_yaml(node))


def _sweep_group() -> str | None:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.initialized():
            hc = HydraConfig.get()
            if hc.mode == RunMode.MULTIRUN:
                return Path(str(hc.sweep.dir)).name
    except Exception:  # noqa: BLE001
        pass
    return None


class WandbTracker(Tracker):
    """A W&B run (online or offline) behind the :class:`Tracker` interface."""

    enabled = True

    def __init__(self, run, log_artifacts: bool = True) -> None:
        self.run = run
        self.log_artifacts = log_artifacts
        self._used: list[str] = []

    @property
    def dir(self) -> Path:
        return Path(self.run.dir)

    def log(self, metrics, step=None):
        self.run.log(to_jsonable(metrics), step=step)

    def summary(self, values):
        for k, v in _flatten(to_jsonable(values)).items():
            self.run.summary[k] = v

    def table(self, name, rows):
        import wandb

        rows = [_flatten(to_jsonable(r)) for r in rows]
        columns = sorted({k for r in rows for k in r}, key=lambda k: (k not in rows[0], k)) if rows else []
        data = [[_cell(r.get(c)) for c in columns] for r in rows]
        self.run.log({name: wandb.Table(columns=columns, data=data)})

    def log_artifact(self, path, kind, name=None):
        if not self.log_artifacts:
            return
        self.run.log_artifact(self._artifact(Path(path), kind, name))

    def use_artifact(self, ref, kind=None):
        """Online: a W&B input artifact (lineage graph). Offline runs cannot declare inputs, so
        the reference is recorded in the run config (``used_artefacts``) instead."""
        path = Path(ref)
        self._used.append(str(path.resolve()) if path.exists() else str(ref))
        self.run.config.update({"used_artefacts": self._used}, allow_val_change=True)
        if self.run.settings.mode == "offline":
            return
        try:
            if path.exists():
                self.run.use_artifact(self._artifact(path, kind or _artefact_kind(path) or "artefact", None))
            else:
                self.run.use_artifact(str(ref))
        except Exception as err:  # noqa: BLE001 — lineage is best effort; the config records it
            log.warning("could not record artefact %s as a W&B input: %s", ref, err)

    def finish(self):
        if self.run is not None:
            self.run.finish()
            self.run = None

    @staticmethod
    def _artifact(path: Path, kind: str, name: str | None):
        import wandb

        if not path.exists():
            raise FileNotFoundError(f"artefact {path} does not exist")
        art = wandb.Artifact(name or artifact_name(path, kind), type=kind)
        meta = path / "meta.json"
        if meta.exists():
            import json

            try:
                art.metadata.update({k: v for k, v in json.loads(meta.read_text()).items()
                                     if k in ("model", "fingerprint", "task", "num_layers", "metrics")})
            except (OSError, ValueError):
                pass
        if path.is_dir():
            art.add_dir(str(path))
        else:
            art.add_file(str(path))
        return art


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix.rstrip("/") or "value": d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _cell(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        import json

        return json.dumps(v)
    return v


def run_tags(cfg, job_type: str, method_label: str | None = None) -> list[str]:
    """A W&B run's tags: ``logger.tags``, then the model, method and task (``<group>:<name>``; the
    method by ``method_label`` where given) and ``job:<job_type>``."""
    tags = [str(t) for t in _get(_get(cfg, "logger"), "tags") or []]
    for group in ("model", "method", "task"):
        value = method_label if group == "method" and method_label else _get(_get(cfg, group), "name")
        if value is not None:
            tags.append(f"{group}:{value}")
    return tags + [f"job:{job_type}"]


def start_run(cfg, job_type: str, name: str | None = None, dir: str | Path | None = None,
              method_label: str | None = None) -> Tracker:
    """Open a tracker for ``cfg.logger`` (a no-op one for ``logger=none`` or no logger).

    ``dir``: where W&B writes its files (default: the Hydra run directory, else the current
    directory); the resolved ``cfg`` is the run's config. ``method_label``: the method's public
    identity, its config file name (``method=<label>``); it tags the run (``method:<label>``) and
    is logged as the config key ``method_label`` that dashboards group by. Variants sharing a
    decoder (``draft_verify_static``) stay apart.
    """
    logger_cfg = _get(cfg, "logger")
    if check_logger(logger_cfg) == "none":
        return Tracker()
    mode = wandb_mode(_get(logger_cfg, "mode"))
    if mode == "disabled":
        return Tracker()
    import wandb

    run_dir = Path(dir) if dir is not None else (hydra_output_dir() or Path.cwd())
    run_dir.mkdir(parents=True, exist_ok=True)
    tags = run_tags(cfg, job_type, method_label)
    run = wandb.init(
        project=str(_get(logger_cfg, "project")),
        entity=_get(logger_cfg, "entity"),
        group=_get(logger_cfg, "group") or _sweep_group(),
        job_type=job_type,
        name=name,
        tags=tags,
        config=to_jsonable(cfg) | ({"method_label": method_label} if method_label else {}),
        dir=str(run_dir),
        mode=mode,
        reinit="create_new",
    )
    log.info("W&B run %s (%s) in %s", run.name or run.id, mode, run_dir)
    return WandbTracker(run, log_artifacts=bool(_get(logger_cfg, "log_artifacts")))

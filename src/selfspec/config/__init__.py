"""Locating and composing the Hydra configs in ``conf/`` outside of a ``@hydra.main`` entry."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from selfspec.config import checks


def conf_dir() -> Path:
    """The ``conf/`` directory (``SELFSPEC_CONF`` overrides; default: the repository's)."""
    env = os.environ.get("SELFSPEC_CONF")
    path = Path(env) if env else Path(__file__).resolve().parents[3] / "conf"
    if not path.is_dir():
        raise FileNotFoundError(f"config directory {path} not found; set SELFSPEC_CONF to selfspec's conf/")
    return path


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def model_config(name: str) -> DictConfig:
    """``conf/model/<name>.yaml``; an unknown name lists the known ones."""
    path = conf_dir() / "model" / f"{name}.yaml"
    if not path.exists():
        raise ValueError(
            f"unknown model {name!r}: no conf/model/{name}.yaml. Known models: "
            f"{', '.join(group_options('model'))}; or pass model.name_or_path=<hub id or directory>"
        )
    return OmegaConf.load(path)


def _own_keys(path: Path) -> set[str]:
    """The top-level keys a config file sets itself (not its defaults list, not Hydra's)."""
    return {str(k) for k in OmegaConf.load(path) if k not in ("defaults", "hydra")}


@functools.lru_cache(maxsize=None)
def primary_keys(config_name: str) -> tuple[str, ...]:
    """The top-level keys a primary config (``conf/<config_name>.yaml``) composes: its own, one per
    config group its defaults list chooses, and for a group chosen ``null`` (``experiment``: presets
    of the global package) the keys its presets write (``report``)."""
    raw = OmegaConf.load(conf_dir() / f"{config_name}.yaml")
    keys = _own_keys(conf_dir() / f"{config_name}.yaml")
    for entry in raw.get("defaults") or []:
        if not OmegaConf.is_dict(entry):
            continue
        for group, choice in entry.items():
            if str(group).startswith("override "):
                continue
            if choice is not None:
                keys.add(str(group))
            else:
                keys.update(*(_own_keys(p) for p in sorted((conf_dir() / str(group)).glob("*.yaml"))))
    return tuple(sorted(keys))


def check_primary_keys(cfg, config_name: str) -> None:
    """Refuse a top-level key of ``cfg`` that ``conf/<config_name>.yaml`` does not compose, so no reader
    reads it (issue 52: ``+batch_size=4``, the form Hydra suggests after refusing ``batch_size=4``,
    ran and was recorded in the summary)."""
    checks.known_keys("", cfg, primary_keys(config_name), f"conf/{config_name}.yaml")


def compose(overrides: list[str] | None = None, config_name: str = "evaluate") -> DictConfig:
    """Compose a primary config with overrides, as the entry points would (tests, notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides or [], return_hydra_config=False)


def method_config(name: str, **overrides) -> DictConfig:
    """``conf/method/<name>.yaml`` composed and resolved on its own (no task: ``${oc.select:task.name,null}``
    is null), with ``overrides`` on top, as a plain (non-struct) config: for a decoder built directly
    with :func:`selfspec.decoding.build_decoder` (``scripts/gpu_check.py``, the tests)."""
    from omegaconf import OmegaConf

    alone = OmegaConf.create({"method": OmegaConf.to_container(load_method_config(name))})
    return OmegaConf.create({**OmegaConf.to_container(alone, resolve=True)["method"], **overrides})


def load_method_config(name: str) -> DictConfig:
    """``conf/method/<name>.yaml`` composed by Hydra (its ``defaults`` list applied), unresolved."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    known = group_options("method")
    if name not in known:
        raise ValueError(f"unknown method config {name!r} in baseline/compare; choose from "
                         f"{', '.join(known)} (conf/method/)")
    if GlobalHydra.instance().is_initialized():  # inside @hydra.main: its search path is conf/
        return hydra_compose(config_name=None, overrides=[f"+method={name}"]).method
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return hydra_compose(config_name=None, overrides=[f"+method={name}"]).method


#: the submitit launchers' sizes: each an integer at least this (conf/hydra/launcher/submitit_*.yaml)
LAUNCHER_LEAST = {"timeout_min": 1, "cpus_per_task": 1, "gpus_per_node": 0, "tasks_per_node": 1, "nodes": 1,
                  "array_parallelism": 1, "signal_delay_s": 0, "max_num_timeout": 0, "mem_gb": 1}


def check_launcher(launcher) -> None:
    """A submitit launcher's settings (issue 39: ``hydra.launcher.timeout_min=-5`` went to Slurm
    unchecked, and came back as a raw FailedJobError): each size an integer at its least, refused
    by key (:func:`check_command_line`, before any job is submitted)."""
    if not launcher or "submitit" not in str(launcher.get("_target_", "")):
        return
    for key, least in LAUNCHER_LEAST.items():
        if launcher.get(key) is not None:
            checks.integer(f"hydra.launcher.{key}", launcher.get(key), least,
                           why="a submitit launcher's size (conf/hydra/launcher/)")


def check_command_line(argv: list[str], config_name: str) -> None:
    """What an entry point's command line asks of Hydra itself, checked before Hydra acts on it, with
    one message and exit status 1: for a multirun, the launcher's settings (a Hydra callback cannot
    stop a sweep: Hydra turns its exceptions into warnings). Only the launcher's own overrides are
    composed for that, so a sweep's lists need no expanding. The run directory is the store's to
    check, and the entry point checks it first (:func:`selfspec.store.files.check_run_dir_argument`:
    config lies below the store and imports none of it)."""
    import sys

    if not {"-m", "--multirun"} & set(argv):
        return
    own = [a for a in argv if a.startswith(("hydra/launcher=", "hydra.launcher."))]
    if not own:
        return
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=own, return_hydra_config=True)
    try:
        check_launcher(cfg.hydra.get("launcher"))
    except checks.ConfigError as err:
        sys.exit(f"{type(err).__name__}: {err}")

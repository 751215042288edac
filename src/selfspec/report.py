"""``python -m selfspec.report [inputs=[...]] [tables=[...]]`` (``make tables``).

Regenerates each experiment preset's table from its result files (and from W&B when a key is
configured) as Markdown and LaTeX, the plots as PNG, and ``outputs/report/index.html`` showing
them together. See :mod:`selfspec.reporting` and ``conf/report.yaml``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from selfspec.config import checks, conf_dir

log = logging.getLogger(__name__)


def run_report(cfg: DictConfig):
    """Build the report ``cfg`` (conf/report.yaml) describes; return the ReportResult."""
    from selfspec.reporting.build import build_report
    from selfspec.reporting.wandb_source import enabled, wandb_records

    from selfspec.store.files import check_writable
    from selfspec.tracking import open_run_log

    flags = {key: checks.flag(key, cfg[key]) for key in ("paper", "plots", "newest_only")}
    out = Path(str(cfg.output_dir))
    out.mkdir(parents=True, exist_ok=True)
    check_writable(out, "the report (output_dir=...)")
    open_run_log(out)
    extra = []
    if enabled(cfg.wandb.enabled):
        filters = OmegaConf.to_container(cfg.wandb.filters, resolve=True) if cfg.wandb.filters else {}
        extra = wandb_records(str(cfg.wandb.project), cfg.wandb.entity, filters)
    tables = list(cfg.tables) if cfg.tables is not None else None
    return build_report(
        list(cfg.inputs), cfg.output_dir, cfg.artefacts_dir, tables, paper=flags["paper"], formats=list(cfg.formats),
        make_plots=flags["plots"], newest_only=flags["newest_only"], extra_records=extra,
    )


@hydra.main(config_path=str(conf_dir()), config_name="report", version_base="1.3")
def main(cfg: DictConfig) -> None:
    result = run_report(cfg)
    for line in result.headline:
        log.info("%s", line)
    log.info("%d tables, %d plots: %s", len(result.tables), len(result.plots), result.index)


if __name__ == "__main__":
    main()

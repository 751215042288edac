"""Every option of every config group composes (evaluate.yaml, train.yaml, Hydra launchers)."""

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from selfspec.config import conf_dir, group_options
from selfspec.evaluation import method_configs


def _compose(config_name, overrides, hydra=False):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose(config_name=config_name, overrides=overrides, return_hydra_config=hydra)


@pytest.mark.parametrize("group", ["model", "method", "task", "logger", "experiment"])
def test_evaluate_groups_compose(group):
    options = group_options(group)
    assert options, f"conf/{group}/ is empty"
    for option in options:
        cfg = _compose("evaluate", [f"{group}={option}"])
        OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
        if group in ("model", "task", "logger"):
            assert cfg[group].name == option, f"conf/{group}/{option}.yaml: name should be {option!r}"


def test_every_method_resolves_as_baseline_or_compare():
    """compare=[every method config]: each composes with its defaults list and resolves."""
    options = group_options("method")
    cfg = _compose("evaluate", ["compare=[" + ",".join(options) + "]"])
    configs = method_configs(cfg, label="vanilla")
    assert list(configs) == ["vanilla"] + [o for o in options if o != "vanilla"]
    for option, m in configs.items():
        assert m.name, f"conf/method/{option}.yaml sets no decoder name"


def test_train_jobs_compose():
    for option in group_options("job"):
        cfg = _compose("train", [f"job={option}"])
        OmegaConf.to_container(cfg, resolve=True)
        assert cfg.job.name == option


@pytest.mark.parametrize("launcher", ["basic", "joblib", "submitit_local", "submitit_slurm"])
def test_hydra_launchers_compose(launcher):
    cfg = _compose("evaluate", [f"hydra/launcher={launcher}"], hydra=True)
    assert cfg.hydra.launcher._target_.endswith("Launcher")
    dirs = OmegaConf.to_container(cfg.hydra, resolve=False)  # ${hydra:...} resolves in a run only
    assert dirs["sweep"]["dir"].startswith("outputs/multirun/eval") and dirs["run"]["dir"].startswith("outputs/eval/")


#: model keys the README and the refusal messages tell users to set on any model config
SETTABLE_MODEL_KEYS = ("name_or_path", "gguf_file", "gguf_path")


@pytest.mark.parametrize("model", group_options("model"))
def test_model_source_keys_are_settable_as_written(model):
    """Finding: ``model.gguf_path=/path/to/file.gguf`` (README) failed with "Key 'gguf_path' is not in
    struct" (only ``+model.gguf_path=`` worked). Every model config holds every source key, null or
    set, so ``model.<key>=...`` composes on any of them."""
    for key in SETTABLE_MODEL_KEYS:
        cfg = _compose("evaluate", [f"model={model}", f"model.{key}=/path/to/file.gguf"])
        assert cfg.model[key] == "/path/to/file.gguf", (model, key)

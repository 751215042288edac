"""Model loading and the layered adapter stop early on bad input, with a message naming the fix."""

import pytest
import torch
from omegaconf import OmegaConf

from selfspec.artefacts import ArtefactError, load_artefact, save_artefact
from selfspec.checks import ConfigError
from selfspec.config import model_config
from selfspec.models.layered import LayeredModel, UnsupportedModelError
from selfspec.models.loading import ModelLoadError, load_model


def test_unknown_model_lists_known_ones():
    with pytest.raises(ValueError, match="unknown model 'llama9'.*smollm2-135m"):
        model_config("llama9")


def test_unloadable_path_names_the_config(tmp_path):
    cfg = OmegaConf.create({"name": "mine", "name_or_path": str(tmp_path), "device": "cpu", "dtype": "float32"})
    with pytest.raises(ModelLoadError, match="'mine'.*config.json"):
        load_model(cfg)


def test_config_without_source_is_refused():
    with pytest.raises(ConfigError, match="names no source"):
        load_model(OmegaConf.create({"name": "empty", "device": "cpu"}))


def test_bad_dtype_is_named():
    with pytest.raises(ConfigError, match="model.dtype=int3 is not allowed"):
        load_model(OmegaConf.create({"name": "x", "random": {"vocab_size": 10}, "dtype": "int3", "device": "cpu"}))


def test_unsupported_family_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2'.*llama"):
        LayeredModel(gpt2, name="gpt2-tiny")


def test_artefact_of_another_model_is_refused(tiny, tmp_path):
    other = load_model(OmegaConf.merge(model_config("tiny-random"), {"random": {"num_hidden_layers": 2}}))
    assert other.fingerprint != tiny.fingerprint
    save_artefact(tmp_path / "a", "heads", {"x": torch.zeros(1)}, other)
    with pytest.raises(ArtefactError, match="trained for model 'tiny-random'.*fingerprint"):
        load_artefact(tmp_path / "a", "heads", tiny)
    with pytest.raises(ArtefactError, match="expected 'prompts'"):
        load_artefact(tmp_path / "a", "prompts", other)
    assert load_artefact(tmp_path / "a", "heads", other.model).meta["num_layers"] == 2

"""Model loading and the layered adapter stop early on bad input, with a message naming the fix."""

import pytest
import torch
from omegaconf import OmegaConf

from conftest import method_config
from selfspec.config import model_config
from selfspec.config.checks import ConfigError
from selfspec.models.families import UnsupportedModelError
from selfspec.models.layered import LayeredModel
from selfspec.models.loading import ModelLoadError, load_model
from selfspec.store.artefacts import ArtefactError, load_artefact, save_artefact


def test_unknown_model_lists_known_ones():
    with pytest.raises(ValueError, match="unknown model 'llama9'.*smollm2-135m"):
        model_config("llama9")


def test_unloadable_path_names_the_config(tmp_path):
    cfg = OmegaConf.merge(_runtime_keys(), {"name": "mine", "name_or_path": str(tmp_path)})
    with pytest.raises(ModelLoadError, match="'mine'.*config.json"):
        load_model(cfg)


def test_config_without_source_is_refused():
    with pytest.raises(ConfigError, match="names no source"):
        load_model(OmegaConf.merge(_runtime_keys(), {"name": "empty"}))


def _runtime_keys():
    """tiny-random's config without a source (every runtime key set)."""
    return OmegaConf.create({k: v for k, v in model_config("tiny-random").items()
                             if k not in ("random", "tokenizer")})


def test_config_lacking_a_key_is_refused_by_name():
    cfg = OmegaConf.create({k: v for k, v in model_config("tiny-random").items() if k != "capture"})
    with pytest.raises(ConfigError, match="lacks model.capture.*conf/model/"):
        load_model(cfg)


def test_bad_dtype_is_named():
    with pytest.raises(ConfigError, match="model.dtype=int3 is not allowed"):
        load_model(OmegaConf.merge(model_config("tiny-random"), {"dtype": "int3"}))


def test_unsupported_family_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match="model_type='gpt2'.*llama"):
        LayeredModel(gpt2, name="gpt2-tiny")


def test_artefact_of_another_model_is_refused(tiny, tmp_path):
    other = load_model(OmegaConf.merge(model_config("tiny-random"), {"random": {"num_hidden_layers": 2}}))
    assert other.fingerprint != tiny.fingerprint
    save_artefact(tmp_path / "a", "heads", {"x": torch.zeros(1)}, other, kernel_paths=None)
    with pytest.raises(ArtefactError, match="trained for model 'tiny-random'.*fingerprint"):
        load_artefact(tmp_path / "a", "heads", tiny)
    with pytest.raises(ArtefactError, match="expected 'prompts'"):
        load_artefact(tmp_path / "a", "prompts", other)
    assert load_artefact(tmp_path / "a", "heads", other.model).meta["num_layers"] == 2


@pytest.mark.slow
def test_smollm2_saved_as_a_directory_decodes_and_shares_artefacts_with_the_gguf(smol, tmp_path):
    """The embedded default saved with ``save_pretrained`` (model and tokenizer) and loaded back
    through ``model.name_or_path=<dir>``: the same fingerprint and weights digest, vanilla decodes a
    real prompt token for token like the GGUF path, and heads saved from one load into the other."""
    from selfspec.config import compose
    from selfspec.decoding import build_decoder
    from selfspec.models.heads import IntermediateHeads, load_heads, save_heads

    directory = tmp_path / "smollm2-dir"
    smol.model.hf.save_pretrained(directory)
    smol.tokenizer.save_pretrained(directory)
    cfg = compose(["model=smollm2-135m", f"model.name_or_path={directory}"]).model
    loaded = load_model(cfg)
    assert loaded.model.hf.config.name_or_path == str(directory)
    assert (loaded.fingerprint, loaded.weights_digest) == (smol.fingerprint, smol.weights_digest)
    text = smol.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a haiku about the sea."}], tokenize=False, add_generation_prompt=True)
    ids = smol.tokenizer(text)["input_ids"]
    assert loaded.tokenizer(text)["input_ids"] == ids
    vanilla = method_config("vanilla")
    tokens = [build_decoder(vanilla, m.model).generate(ids, 24).tokens for m in (smol, loaded)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 24
    for source, target in ((smol, loaded), (loaded, smol)):
        path = save_heads(tmp_path / f"heads-{source is smol}", IntermediateHeads.identity(source.model, [9, 19]),
                          source)
        assert load_heads(path, target).layers == [9, 19]

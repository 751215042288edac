"""Every supported family on the layered runtime, each from a tiny random model built offline from
transformers' own config class: vanilla equals transformers' greedy ``generate`` token for token,
and the lossless methods equal vanilla. The randomly initialised parts the families add (Qwen2's
q/k/v biases, Qwen3's q/k norms) are drawn at random, since their initial values (zero biases,
unit norms) would hide a runtime that skipped them."""

from __future__ import annotations

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from conftest import method_config
from selfspec.decoding import build_decoder
from selfspec.decoding.vanilla import Vanilla
from selfspec.models.families import FAMILIES, Llama, Qwen3, UnsupportedModelError, check_model_type
from selfspec.models.layered import LayeredModel

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
#: model_type -> (config class, model class, the family's own settings)
FAMILY_MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 64}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 24}),  # head_dim apart from hidden / heads, as Qwen3's
}
PROMPT = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3, 42, 8, 61, 200, 13]
N_NEW = 24


def tiny_family(model_type: str, **overrides) -> LayeredModel:
    config_cls, model_cls, own = FAMILY_MODELS[model_type]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**{**SHAPE, **own, **overrides}))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
                p.normal_(0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
            elif "embed_tokens" in name or "lm_head" in name:
                p.mul_(20)  # peaked distributions: drafts get accepted, so the methods' paths all run
    return LayeredModel(hf.float(), name=f"tiny-{model_type}", linear_kernel="auto")


@pytest.fixture(scope="module", params=sorted(FAMILY_MODELS))
def family(request):
    return request.param, tiny_family(request.param)


def hf_tokens(model: LayeredModel, ids, n):
    out = model.hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_every_supported_family_has_a_test_model():
    assert set(FAMILIES) == set(FAMILY_MODELS)


def test_vanilla_equals_transformers_generate(family):
    name, model = family
    assert type(model.family).model_types == (name,)
    assert Vanilla(model).generate(PROMPT, N_NEW).tokens == hf_tokens(model, PROMPT, N_NEW)


@pytest.mark.parametrize("method", [
    {"name": "draft_verify", "skip_attn": [1, 2], "skip_mlp": [2], "max_draft": 4, "never_slower": False},
    {"name": "early_exit", "exit_layer": 1, "max_draft": 3, "never_slower": False},
    {"name": "del", "max_draft": 4, "cost_model": "parameters", "never_slower": False},
    {"name": "adadecode", "head_kind": "lm_head", "layers": [1, 2], "threshold": 0.3},
    {"name": "ngram", "never_slower": False},
], ids=lambda m: m["name"])
def test_lossless_methods_equal_vanilla(family, method):
    _, model = family
    ids = PROMPT + PROMPT  # a repeat, so the n-gram lookup has matches
    ref = Vanilla(model).generate(ids, N_NEW).tokens
    name = method["name"]
    g = build_decoder(method_config(name, **{k: v for k, v in method.items() if k != "name"}), model).generate(ids, N_NEW)
    assert g.tokens == ref
    assert sum(g.drafted_per_step) > 0, f"{name} drafted nothing: the test would not see its verification"


def test_qwen3_norms_q_and_k_per_head():
    model = tiny_family("qwen3")
    assert isinstance(model.family, Qwen3) and model.family.normalises_qk and model.head_dim == 24
    assert not Llama.normalises_qk
    # the norms matter: with them left out the runtime would no longer match transformers
    attn = model.family.layers[0].self_attn
    q = torch.randn(1, 3, 4, 24)
    assert not torch.equal(model.family.qk_norm(0, q, q)[0], q)
    assert attn.q_norm.weight.shape == (24,)


def test_mistral_context_is_bounded_by_its_window():
    """The runtime's masks are causal over the whole cache: within Mistral's sliding window they
    agree with transformers'; a generation that would pass the window is refused, not wrong."""
    model = tiny_family("mistral", sliding_window=32)
    assert model.max_context == 32
    ids = PROMPT[:10]
    assert Vanilla(model).generate(ids, 16).tokens == hf_tokens(model, ids, 16)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Vanilla(model).generate(ids, 40)


def test_an_unsupported_family_is_refused_naming_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match=r"gemma3_text.*llama, mistral, qwen2, qwen3.*adapter"):
        check_model_type("gemma3_text", "gemma")


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-mistral", "tiny-qwen2"])
def test_every_training_job_runs_on_another_family(model, tmp_path, monkeypatch):
    """The five jobs on a family other than Llama (from its conf/model config, ``model.random.model_type``),
    and each method decoding with what they built equals vanilla."""
    from selfspec.config import compose, model_config
    from selfspec.models.loading import load_model
    from selfspec.train import run_job

    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path))
    loaded = load_model(model_config(model))
    assert type(loaded.model.family).model_types == (model.removeprefix("tiny-"),)
    job = lambda *args: run_job(compose([f"model={model}", "progress=false", *args], "train"))  # noqa: E731
    heads = job("job=heads", "task=gsm8k", "job.n_prompts=3", "job.n_heldout=1", "job.gen_tokens=6", "job.steps=2",
                "job.eval_every=0", "job.max_prompt_tokens=48", "job.layers=[1,2]", f"artefact_dir={tmp_path / 'h'}")
    prompts = job("job=prompts", "job.steps=2", "job.n_conversations=6", "job.held_out=2", "job.context_length=48",
                  "job.inserts=4", "job.eval_inserts=4", f"artefact_dir={tmp_path / 'p'}")
    tree = job("job=ppd_tree", f"job.prompts={tmp_path / 'p'}", "job.n_prompts=2", "job.max_new_tokens=10",
               "job.latency_repeats=1", "job.sizes=[1,3,5]", "job.plot=false", f"artefact_dir={tmp_path / 't'}")
    skips = job("job=skips", "task=xsum", "job.n_prompts=2", "job.max_new_tokens=8", "job.max_prompt_tokens=48",
                "job.iterations=2", "job.calibration_repeats=1", "job.probe_fractions=[0.5]", "job.plot=false",
                "+job.decoding.max_draft=4", f"artefact_dir={tmp_path / 's'}")
    vocab = job("job=draft_vocab", "task=gsm8k", "job.n_prompts=3", "job.n_heldout=2", "job.gen_tokens=8",
                "job.max_prompt_tokens=48", "job.cost_repeats=1", "job.size=12", f"artefact_dir={tmp_path / 'v'}")
    assert all(r["artefact"] for r in (heads, prompts, tree, skips, vocab))
    ids = loaded.tokenizer("Question: 2 + 2? Answer: 4. Question: 3 + 3? Answer:")["input_ids"]
    ref = Vanilla(loaded.model).generate(ids, 12).tokens
    for method in (method_config("adadecode", heads_dir=str(tmp_path / "h"), threshold=0.0),
                   method_config("ppd", prompts=str(tmp_path / "p"), tree=str(tmp_path / "t"), never_slower=False),
                   method_config("draft_verify", skip_set=str(tmp_path / "s"), never_slower=False),
                   method_config("del", draft_vocab=str(tmp_path / "v"), never_slower=False)):
        assert build_decoder(method, loaded.model).generate(ids, 12).tokens == ref, method.name


def test_a_random_model_of_an_unsupported_family_is_refused_before_loading():
    from omegaconf import OmegaConf

    from selfspec.checks import ConfigError
    from selfspec.config import model_config
    from selfspec.models.loading import check_model_config

    cfg = OmegaConf.merge(model_config("tiny-random"), {"random": {"model_type": "gemma3_text"}})
    with pytest.raises(ConfigError, match=r"model\.random\.model_type=gemma3_text is not allowed.*qwen3"):
        check_model_config(cfg)
    cfg = OmegaConf.merge(model_config("tiny-qwen3"), {"random": {"head_dimm": 8}})
    with pytest.raises(ConfigError, match=r"model\.random\.head_dimm is not a key of Qwen3Config"):
        check_model_config(cfg)

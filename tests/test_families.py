"""Every supported family on the layered runtime, each from a tiny random model built offline from
transformers' own config class: vanilla equals transformers' greedy ``generate`` token for token,
and the lossless methods equal vanilla. The randomly initialised parts the families add (Qwen2's
q/k/v biases, Qwen3's q/k norms, all of Gemma 3's norms) are drawn at random, since their initial
values (zero biases, unit norms, Gemma's zero ``w`` in ``1 + w``) would hide a runtime that skipped
them. Gemma 3's sliding window (8) is shorter than every generation here, so its masks are tested
on one-token steps, verification passes, trees and prefills."""

from __future__ import annotations

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from conftest import cpu_like_profile, method_config, methods_with_artefacts, thin_profile, train_every_job
from selfspec.decoding import build_decoder
from selfspec.decoding.vanilla import Vanilla
from selfspec.models import families, kernels
from selfspec.models.families import FAMILIES, Gemma3, Llama, Qwen3, UnsupportedModelError, check_model_type
from selfspec.models.layered import LayeredModel

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
#: model_type -> (config class, model class, the family's own settings)
FAMILY_MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 64}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 24}),  # head_dim apart from hidden / heads, as Qwen3's
    # Gemma 3 270M's traits, small: one KV head, head_dim apart, sliding layers (window 8) around a full one, each
    # kind with its own rotary base (untied: a tied head scaled up as below only repeats the last token)
    "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM, {
        "num_key_value_heads": 1, "head_dim": 32, "query_pre_attn_scalar": 24,
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                             "sliding_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
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
            elif name.endswith(("q_norm.weight", "k_norm.weight")) and model_type != "gemma3_text":
                p.uniform_(0.5, 1.5)
            elif model_type == "gemma3_text" and name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)  # the w of (1 + w)
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
    assert type(model.family) is FAMILIES[name]
    assert Vanilla(model).generate(PROMPT, N_NEW).tokens == hf_tokens(model, PROMPT, N_NEW)


@pytest.mark.parametrize("method", [
    {"name": "draft_verify", "skip_attn": [1, 2], "skip_mlp": [2], "max_draft": 4, "never_slower": False},
    {"name": "early_exit", "exit_layer": 1, "max_draft": 3, "never_slower": False},
    {"name": "del", "max_draft": 4, "cost_model": "parameters", "never_slower": False},
    {"name": "adadecode", "head_kind": "lm_head", "layers": [1, 2], "threshold": 0.3},
    {"name": "ngram", "never_slower": False},
    {"name": "knapspec", "interval": 4, "search_at": 2, "window": 2, "never_slower": False},
    {"name": "clasp", "interval": 4, "never_slower": False},
    {"name": "swift", "context_window": 4, "bayes_interval": 3, "max_draft": 4, "never_slower": False},
], ids=lambda m: m["name"])
def test_lossless_methods_equal_vanilla(family, method):
    _, model = family
    ids = PROMPT + PROMPT  # a repeat, so the n-gram lookup has matches
    ref = Vanilla(model).generate(ids, N_NEW).tokens
    name = method["name"]
    g = build_decoder(method_config(name, **{k: v for k, v in method.items() if k != "name"}), model,
                      profile=cpu_like_profile(model)).generate(ids, N_NEW)
    assert g.tokens == ref
    assert sum(g.drafted_per_step) > 0, f"{name} drafted nothing: the test would not see its verification"
    assert g.stats.get("skip_searches", g.stats.get("swift_iterations", 1)) > 0, \
        f"{name} searched no skip set: the test would not see the search"


def test_qwen3_norms_q_and_k_per_head():
    model = tiny_family("qwen3")
    assert isinstance(model.family, Qwen3) and model.family.normalises_qk and model.head_dim == 24
    assert not Llama.normalises_qk
    # the norms matter: with them left out the runtime would no longer match transformers
    attn = model.family.layers[0].self_attn
    q = torch.randn(1, 3, 4, 24)
    assert not torch.equal(model.family.qk_norm(0, q, q, model.norm)[0], q)
    assert attn.q_norm.weight.shape == (24,)


@pytest.mark.parametrize("model_type, window", [
    ("mistral", {"sliding_window": 8}),
    # Qwen2 slides from layer max_window_layers on, where use_sliding_window is set
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2}),
])
def test_sliding_windows_past_the_window_equal_transformers(model_type, window):
    """Mistral's and Qwen2's sliding windows are masks of the runtime (the adapter's ``window``):
    a generation well past the window equals transformers' generate, and every lossless method
    equals vanilla there; without the window the tokens differ."""
    model = tiny_family(model_type, **window)
    assert [model.family.window(i) for i in range(4)] == (
        [8] * 4 if model_type == "mistral" else [None, None, 8, 8])
    ids = PROMPT + PROMPT
    ref = hf_tokens(model, ids, N_NEW)
    assert Vanilla(model).generate(ids, N_NEW).tokens == ref
    for method in ({"name": "draft_verify", "skip_attn": [1, 2], "skip_mlp": [2], "max_draft": 4,
                    "never_slower": False}, {"name": "ngram", "never_slower": False},
                   {"name": "knapspec", "interval": 4, "search_at": 2, "window": 2, "never_slower": False},
                   {"name": "swift", "context_window": 4, "max_draft": 4, "never_slower": False}):
        cfg = method_config(method["name"], **{k: v for k, v in method.items() if k != "name"})
        assert build_decoder(cfg, model, profile=cpu_like_profile(model)).generate(ids, N_NEW).tokens == ref
    # the logits themselves, past the window: a prefill, then a 6-token pass after 20 cached positions
    seq = torch.tensor([ids + ref])
    expected = model.hf(seq).logits[0].float()
    unbounded = tiny_family(model_type)  # the same seed: the same weights, no window
    assert all(torch.equal(a, b) for a, b in zip(model.hf.state_dict().values(), unbounded.hf.state_dict().values()))
    for m, agrees in ((model, True), (unbounded, False)):
        with torch.inference_mode():
            cache = m.new_cache(64)
            first = m.logits(m.forward(seq[:, :20], cache))[0]
            second = m.logits(m.forward(seq[:, 20:26], cache))[0]
        got = torch.cat([first, second])
        assert torch.allclose(got, expected[:26], atol=1e-4) is agrees, "the window changed nothing: the test cannot tell"


def test_an_unsupported_family_is_refused_naming_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match=r"gemma2.*llama, mistral, qwen2, qwen3, gemma3_text.*adapter"):
        check_model_type("gemma2", "gemma")
    # the multimodal Gemma 3 (its config.json's model_type): the text model is what the runtime drives
    with pytest.raises(UnsupportedModelError, match=r"model_type='gemma3' \(gemma3 is Gemma 3 with its vision tower.*"
                                                    r"gemma3_text.*llama, mistral"):
        check_model_type("gemma3", "gemma-3-4b")
    # a GGUF file's architecture gemma3 is the text model (transformers builds Gemma3ForCausalLM from it)
    assert families.GGUF_ARCHITECTURES["gemma3"] in FAMILIES


def _gemma_generation_with(monkeypatch, hook, value) -> bool:
    """Whether vanilla on the tiny Gemma 3 still equals ``generate`` with the adapter's ``hook``
    replaced by ``value`` (a test of the tests: each part of the family must matter)."""
    model = tiny_family("gemma3_text")
    monkeypatch.setattr(Gemma3, hook, value)
    ids = PROMPT + PROMPT
    return Vanilla(model).generate(ids, N_NEW).tokens == hf_tokens(model, ids, N_NEW)


@pytest.mark.parametrize("hook,value", [
    ("window", lambda self, i: None),  # causal over the whole cache: passes the window
    ("window", lambda self, i: 9 if self.layers[i].self_attn.sliding_window else None),  # off by one
    ("attention_out_norm", lambda self, i: None),
    ("mlp_out_norm", lambda self, i: None),
    ("rope_kind", lambda self, i: "full_attention"),  # one rotary base for every layer
    ("qk_norm", lambda self, i, q, k, norm: (q, k)),
    ("mlp_norm", Llama.mlp_norm),  # the post-attention norm where the pre-feedforward one belongs
], ids=["no-window", "window+1", "no-attention-out-norm", "no-mlp-out-norm", "one-rope", "no-qk-norm",
        "wrong-mlp-norm"])
def test_each_gemma3_hook_matters(monkeypatch, hook, value):
    assert not _gemma_generation_with(monkeypatch, hook, value)


def test_gemma3_norms_take_the_fused_operator_in_gemmas_form(monkeypatch):
    """The runtime runs Gemma's norms (q/k norms included) through the fused CPU operator, which
    follows Gemma's form: ``x * rsqrt(mean(x²) + eps) * (1 + w)`` in float32, rounded once. It
    equals the library's ``Gemma3RMSNorm`` within the rounding of the mean's summation order (as
    the Llama-form operator equals ``LlamaRMSNorm``); Llama's form on the same weight does not."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    if kernels.resolve("auto", torch.device("cpu"), torch.float32) != "skinny":
        pytest.skip("the CPU kernels are not built here")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 1e-2)):
            for d in (32, 64, 640, 37):
                norm = Gemma3RMSNorm(d, eps=1e-6)
                norm.weight.data = torch.rand(d, generator=g) * 2 - 1
                norm = norm.to(dtype)
                x = (torch.randn(2, 7, d, generator=g) * 3).to(dtype)
                fused = torch.ops.selfspec.rms_norm(x, norm.weight, 1e-6, True)
                torch.testing.assert_close(fused, norm(x), rtol=tol, atol=tol)
                assert not torch.allclose(torch.ops.selfspec.rms_norm(x, norm.weight, 1e-6, False).float(),
                                          norm(x).float(), atol=0.1)
        model = tiny_family("gemma3_text")
        assert model.family.unit_offset_norms and model._cpu_ops
        ids = PROMPT + PROMPT
        ref = Vanilla(model).generate(ids, N_NEW).tokens

        def refuse(self, x):
            raise AssertionError("a Gemma norm took the library's module path")

        monkeypatch.setattr(Gemma3RMSNorm, "forward", refuse)
        assert Vanilla(model).generate(ids, N_NEW).tokens == ref


def test_gemma3_windows_on_the_static_pass():
    """capture=static (the pass a GPU captures) narrows the window as the dynamic pass does."""
    from selfspec.models import capture

    dyn = tiny_family("gemma3_text")
    static = dyn.with_passes(capture.StepRunner("static"))
    ids = PROMPT + PROMPT
    ref = Vanilla(dyn).generate(ids, N_NEW).tokens
    with torch.inference_mode():
        assert Vanilla(static).generate(ids, N_NEW).tokens == ref
    assert static.steps.routed >= N_NEW - 1
    dv = method_config("draft_verify", skip_attn=[1, 2], skip_mlp=[2], max_draft=4, never_slower=False)
    with torch.inference_mode():
        assert build_decoder(dv, static).generate(ids, N_NEW).tokens == ref


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-mistral", "tiny-qwen2", "tiny-gemma3"])
def test_every_training_job_runs_on_another_family(model, tmp_path, monkeypatch):
    """The five jobs on a family other than Llama (from its conf/model config, ``model.random.model_type``),
    and each method decoding with what they built equals vanilla."""
    from selfspec.config import model_config
    from selfspec.models.loading import load_model

    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path))
    loaded = load_model(model_config(model))
    assert type(loaded.model.family).__name__.lower() == model.removeprefix("tiny-")
    # the jobs price with a profile of this family measured on a thin plan: profile=auto's full one
    # took 11 of each family's 19 s (Zen 3), and measures nothing a thin one does not run
    thin_profile(loaded.model).save(tmp_path / "profile.json")
    train_every_job(model, tmp_path, profile=tmp_path / "profile.json")
    ids = loaded.tokenizer("Question: 2 + 2? Answer: 4. Question: 3 + 3? Answer:")["input_ids"]
    ref = Vanilla(loaded.model).generate(ids, 12).tokens
    for method in methods_with_artefacts(tmp_path):
        assert build_decoder(method, loaded.model, profile=cpu_like_profile(loaded.model)).generate(ids, 12).tokens == ref, \
            method.name


def test_a_random_model_of_an_unsupported_family_is_refused_before_loading():
    from omegaconf import OmegaConf

    from selfspec.config import model_config
    from selfspec.config.checks import ConfigError
    from selfspec.models.loading import check_model_config

    cfg = OmegaConf.merge(model_config("tiny-random"), {"random": {"model_type": "gemma2"}})
    with pytest.raises(ConfigError, match=r"model\.random\.model_type=gemma2 is not allowed.*qwen3, gemma3_text"):
        check_model_config(cfg)
    cfg = OmegaConf.merge(model_config("tiny-qwen3"), {"random": {"head_dimm": 8}})
    with pytest.raises(ConfigError, match=r"model\.random\.head_dimm is not a key of Qwen3Config"):
        check_model_config(cfg)


@pytest.mark.parametrize("fields,message", [
    ({"hidden_size": -64}, r"model\.random\.hidden_size=-64 is not allowed: must be >= 1"),
    ({"num_hidden_layers": 0}, r"model\.random\.num_hidden_layers=0 is not allowed: must be >= 1"),
    ({"intermediate_size": 1.5}, r"model\.random\.intermediate_size=1\.5 is not allowed: must be an integer"),
    ({"num_attention_heads": 3}, r"model\.random\.num_attention_heads=3 is not allowed: must divide model\.random\.hidden_size=64"),
    ({"num_key_value_heads": 3}, r"model\.random\.num_key_value_heads=3 is not allowed: must divide model\.random\.num_attention_heads=4"),
    ({"vocab_size": -1}, r"model\.random\.vocab_size=-1 is not allowed: must be >= 1"),
])
def test_a_random_model_with_impossible_sizes_is_refused_before_loading(fields, message):
    """Issue 39's probe: model.random.hidden_size=-64 or num_attention_heads=3 with hidden 64 failed
    raw inside transformers (or in the memory check's arithmetic). Now refused by key."""
    from omegaconf import OmegaConf

    from selfspec.config import model_config
    from selfspec.config.checks import ConfigError
    from selfspec.models.loading import check_model_config

    cfg = OmegaConf.merge(model_config("tiny-random"), {"random": fields})
    with pytest.raises(ConfigError, match=message):
        check_model_config(cfg)

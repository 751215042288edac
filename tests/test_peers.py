"""HF peer baselines: same tokens as vanilla under greedy, same stopping rules, recorded acceptance."""

import pytest
import torch

from conftest import method_config
from selfspec.decoding import Sampling, build_decoder
from selfspec.decoding.peers import HFAssisted, HFEarlyExit, HFGenerate

REPEAT = "The cat sat on the mat. The dog sat on the log. The cat sat on the mat. The dog"


def build(loaded, name: str, **cfg):
    return build_decoder(method_config(name, **cfg), loaded.model, **_common(loaded))


def _common(loaded):
    return {"eos_token_ids": loaded.eos_token_ids, "tokenizer": loaded.tokenizer}


@pytest.fixture
def repeat_ids(tiny):
    return tiny.tokenizer(REPEAT)["input_ids"]


@pytest.mark.parametrize("cfg", [
    method_config("hf_generate"),
    method_config("hf_prompt_lookup", **{"prompt_lookup_num_tokens": 4, "max_matching_ngram_size": 2}),
    method_config("hf_early_exit", **{"assistant_early_exit": 2, "num_assistant_tokens": 3,
     "num_assistant_tokens_schedule": "constant"}),
])
def test_peer_equals_vanilla_and_counts_steps(tiny, repeat_ids, cfg):
    v = build(tiny, name="vanilla").generate(repeat_ids, 24)
    peer = build(tiny, **cfg)
    g = peer.generate(repeat_ids, 24)
    assert g.tokens == v.tokens and g.stop_reason == v.stop_reason
    assert sum(g.accepted_per_step) == len(g.tokens) and len(g.drafted_per_step) == g.steps
    if cfg["name"] == "hf_generate":
        assert g.tau == 1.0 and g.acceptance_rate is None
    else:
        assert sum(g.drafted_per_step) > 0 and 0 <= g.acceptance_rate <= 1
    assert "_get_candidate_generator" not in vars(tiny.model.hf)  # the hook is removed after the call


def test_prompt_lookup_drafts_are_accepted_on_repeats(tiny):
    """A model told to continue a long repetition copies it: prompt lookup's drafts match."""
    v = build(tiny, name="vanilla").generate(tiny.tokenizer("a b c d")["input_ids"], 12)
    ids = tiny.tokenizer("a b c d")["input_ids"] + v.tokens * 3
    g = build(tiny, name="hf_prompt_lookup", prompt_lookup_num_tokens=4).generate(ids, 12)
    assert g.tokens == build(tiny, name="vanilla").generate(ids, 12).tokens
    assert g.tau > 1.0 and g.acceptance_rate > 0


@pytest.mark.parametrize("name", ["hf_generate", "hf_prompt_lookup"])
def test_peer_honours_eos_and_stop_strings(tiny, repeat_ids, name):
    free = build(tiny, name="vanilla").generate(repeat_ids, 20).tokens
    eos = free[5]
    common = {"eos_token_ids": [eos]}
    g = build_decoder(method_config(name), tiny.model, **common).generate(repeat_ids, 20)
    assert g.tokens == free[:6] and g.stop_reason == "eos"
    stop = tiny.tokenizer.decode(free[7:9])
    common = {"stop_strings": [stop], "tokenizer": tiny.tokenizer}
    g = build_decoder(method_config(name), tiny.model, **common).generate(repeat_ids, 20)
    ref = build_decoder(method_config("vanilla"), tiny.model, **common).generate(repeat_ids, 20)
    assert g.tokens == ref.tokens and g.stop_reason == ref.stop_reason == "stop"
    assert sum(g.accepted_per_step) == len(g.tokens)


def test_hf_generate_sampling_is_seeded_and_leaves_global_rng(tiny, repeat_ids):
    peer = build(tiny, name="hf_generate")
    s = Sampling(temperature=1.0, top_p=0.9, seed=3)
    state = torch.random.get_rng_state()
    a, b = peer.generate(repeat_ids, 10, s).tokens, peer.generate(repeat_ids, 10, s).tokens
    assert a == b and torch.equal(state, torch.random.get_rng_state())
    assert a != peer.generate(repeat_ids, 10, Sampling(temperature=1.0, top_p=0.9, seed=4)).tokens


def test_assisted_with_itself_as_draft_accepts_everything(tiny, repeat_ids):
    peer = build(tiny, name="hf_assisted", assistant="tiny-random", num_assistant_tokens=4,
                 num_assistant_tokens_schedule="constant")
    assert isinstance(peer, HFAssisted)
    peer.assistant_hf.generation_config.assistant_confidence_threshold = 0.0  # draft all 4
    g = peer.generate(repeat_ids, 16)
    assert g.tokens == build(tiny, name="vanilla").generate(repeat_ids, 16).tokens
    assert g.acceptance_rate == 1.0 and g.tau > 3


def test_peer_config_errors_name_the_key(tiny):
    with pytest.raises(ValueError, match="method.assistant="):
        build(tiny, name="hf_assisted")
    with pytest.raises(ValueError, match=r"assistant_early_exit=4 .*\[1, 3\]"):
        build(tiny, name="hf_early_exit", assistant_early_exit=4)
    with pytest.raises(ValueError, match="num_assistant_tokens_schedule"):
        build(tiny, name="hf_early_exit", assistant_early_exit=2, num_assistant_tokens_schedule="fast")
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        build(tiny, name="hf_prompt_lookup", prompt_lookup_num_tokens=0)
    assert HFGenerate.lossless and HFEarlyExit.lossless

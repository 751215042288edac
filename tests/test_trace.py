"""The step trace (decoding/base.py ``StepTrace``): one record per step of every method, adding up
to what the generation reports, with each method's own fields filled in."""

from __future__ import annotations

import random

import pytest
from omegaconf import OmegaConf
from conftest import PPD_KEYS, cpu_like_profile, method_config

from selfspec.decoding import Sampling, build_decoder
from selfspec.decoding.adadecode import AdaDecode
from selfspec.decoding.base import StepTrace
from selfspec.decoding.ppd import PPD
from selfspec.decoding.tree import random_trees
from selfspec.models.heads import IntermediateHeads
from selfspec.models.prompts import PromptTokens

N_NEW = 24
SOURCES = {"prefill", "plain", "self", "context", "tree"}


def _decoder(name, tiny):
    m = tiny.model
    if name == "ppd":
        import torch

        prompts = PromptTokens(torch.randn(3, 1, m.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.5)
        return PPD(m, prompts, random_trees(3, 6, 3, random.Random(0)), **PPD_KEYS)
    if name == "adadecode":
        return AdaDecode(m, IntermediateHeads(m, [1, 2], "lm_head"), threshold=0.05, max_early=16, exit_layers=None, early_eos=False)
    cfgs = {
        "vanilla": method_config("vanilla"),
        "draft_verify": method_config("draft_verify", **{"skip_attn": [1], "skip_mlp": [2], "max_draft": 4,
                         "never_slower": False}),
        "early_exit": method_config("early_exit", **{"exit_layer": 1, "max_draft": 3, "never_slower": False}),
        "early_exit_draft": method_config("early_exit", **{"exit_layer": 1, "max_draft": 3, "never_slower": False,
                             "prefill": "draft"}),
        "del": method_config("del", **{"max_draft": 4, "cost_model": "parameters", "never_slower": False}),
        "ngram": method_config("ngram", never_slower=False),
    }
    return build_decoder(OmegaConf.create(cfgs[name]), m, profile=cpu_like_profile(m))


@pytest.mark.parametrize("name", ["vanilla", "draft_verify", "early_exit", "early_exit_draft", "del", "ngram",
                                  "adadecode", "ppd"])
def test_every_step_leaves_a_trace_that_adds_up(tiny, prompt_ids, name):
    ids = prompt_ids + prompt_ids  # a repeat, so the n-gram lookup finds matches
    g = _decoder(name, tiny).generate(ids, N_NEW, Sampling())
    trace = g.trace
    assert len(trace) == g.steps and all(isinstance(t, StepTrace) for t in trace)
    if name == "early_exit_draft":  # LayerSkip's first round: the prompt and its drafts in one verification
        first = trace[0]
        assert first.source == "prefill" and first.width == len(ids) + first.drafted and first.drafted == 3
        assert first.committed == first.accepted + 1 and first.exit_layer == 1
    else:
        assert trace[0].source == "prefill" and trace[0].width == len(ids) and trace[0].committed == 1
    assert {t.source for t in trace} <= SOURCES
    assert [t.committed for t in trace] == g.accepted_per_step
    assert [t.drafted for t in trace] == g.drafted_per_step
    assert sum(t.committed for t in trace) == g.new_tokens
    for t in trace[1:]:
        assert t.accepted <= t.drafted and t.committed <= t.accepted + 1
        if t.source in ("self", "context"):
            assert t.width == t.drafted + 1 and t.drafted >= 1
    if name == "vanilla":
        assert {t.source for t in trace[1:]} == {"plain"}
    if name == "draft_verify":
        assert all(set(t.controller) == {"threshold", "ar"} for t in trace if t.source == "self")
        assert all(t.draft_limit == 4 for t in trace if t.source == "self")
    if name in ("early_exit", "early_exit_draft", "del"):
        assert all(t.exit_layer is not None for t in trace if t.source == "self")
    if name == "del":
        plan, stats = {"exit_layer", "max_draft", "threshold"}, {"alpha", "conf_match", "conf_miss"}
        assert all(plan | stats == set(t.controller) for t in trace if t.source == "self")
        assert set(trace[0].controller) == stats  # the prefill seeds the shadow statistics
        assert all(len(t.controller["alpha"]) == tiny.model.num_layers - 1 for t in trace if t.controller)
    if name == "ngram":
        assert {t.source for t in trace} <= {"prefill", "plain", "context"}
    if name == "adadecode":
        assert all(len(t.exits) == t.drafted for t in trace if t.source == "self")
    if name == "ppd":
        assert all(t.source == "tree" and t.tree_size == t.drafted + 1 and t.width >= t.tree_size for t in trace[1:])
        assert trace[0].controller == {"state": 3} and all(set(t.controller) == {"state"} for t in trace)
    assert trace[-1].row()["source"] == trace[-1].source and "gated" not in trace[-1].row()

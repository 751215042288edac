"""DEL step for step with a reference written from the authors' facts: ``method=del_paper``
against tests/reference/dynamic_exit.py (DEL's controller on the LayerSkip loop re-implemented
from facebookresearch/LayerSkip) on the same prompt ids, exit heads ``lm_head`` (the model's own
final norm + LM head at every candidate layer, no artefact). Equal outputs and equal traces: per
round drafted, accepted, committed, exit layer and γ, and the controller after each step, its
plan (ℓ, γ, stop threshold τ_ℓ) and its per-layer statistics (agreement rate α_ℓ, mean
confidence of matched and of mismatched shadow tokens); floats within the tolerances of
tests/reference/traces.py (docs/design/fidelity.md)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from reference.dynamic_exit import DEL as ReferenceDEL
from reference.traces import first_difference, totals
from selfspec.config import compose
from selfspec.decoding import build_decoder
from selfspec.decoding.early_exit import layer_count
from test_early_exit import agreeing_model, vanilla


@pytest.fixture(scope="module")
def agree():
    return agreeing_model()


def del_paper(loaded, model: str = "tiny-random", **over):
    """selfspec's decoder from ``conf/method/del_paper.yaml`` (``over``: keys changed)."""
    cfg = compose(["+method=del_paper", f"model={model}"], "train").method
    for key, value in over.items():
        cfg[key] = value
    return build_decoder(cfg, loaded.model)


@pytest.mark.parametrize("model", ["tiny", "agree"])
def test_paper_config_is_the_reference_step_for_step(request, prompt_ids, model):
    """Plan, drafts, verification and statistics agree at every step (the agreeing model moves the
    controller across layers and lengths and stops drafts on its threshold)."""
    loaded = request.getfixturevalue(model)
    g = del_paper(loaded).generate(prompt_ids, 32)
    r = ReferenceDEL(loaded.model.hf).generate(prompt_ids, 32)
    assert g.tokens == r.tokens == vanilla(loaded, prompt_ids, 32)
    assert first_difference(g.trace, r.rounds) is None, (first_difference(g.trace, r.rounds), totals(g.trace),
                                                        totals(r.rounds))
    assert set(g.trace[0].controller) == {"alpha", "conf_match", "conf_miss"}  # the prefill's seeded statistics
    if model == "agree":
        plans = {(t.exit_layer, t.draft_limit) for t in g.trace[1:]}
        assert len(plans) > 2 and sum(t.accepted for t in g.trace) > 10
        assert any(t.controller["threshold"] > 0 and t.drafted < t.draft_limit for t in g.trace[1:])


def test_layer_count_is_dels_denominator(tiny):
    """``cost_model: layers`` (del_paper): TPL's denominator is γ·(ℓ+1) + L − ℓ − 1 for every
    candidate and length, with no head term; ``head_cost`` with it is refused by name."""
    d = del_paper(tiny)
    L = tiny.model.num_layers
    expect = [[g * (ell + 1) + L - ell - 1 for g in range(1, 19)] for ell in range(L - 1)]
    assert d.drafter.cost.tolist() == expect
    assert layer_count(torch.tensor([2]), torch.tensor([0, 3]), 10).tolist() == [[7.0, 16.0]]
    with pytest.raises(ValueError, match=r"method\.head_cost.*cost_model=layers"):
        del_paper(tiny, head_cost=1.0)


def test_the_cost_model_was_the_deviation(agree, prompt_ids):
    """selfspec's fuller count (``cost_model: parameters``: the last draft's lower pass and the
    heads added) plans other rounds than the authors' count on the agreeing model; ``del`` differs
    from ``del_paper`` only in its cost model and the speculation gate."""
    r = ReferenceDEL(agree.model.hf).generate(prompt_ids, 32)
    g = del_paper(agree, cost_model="parameters").generate(prompt_ids, 32)
    assert g.tokens == r.tokens and first_difference(g.trace, r.rounds) is not None
    default = OmegaConf.to_container(compose(["+method=del", "model=tiny-random"], "train").method)
    exact = OmegaConf.to_container(compose(["+method=del_paper", "model=tiny-random"], "train").method)
    assert {k for k in default if default[k] != exact[k]} == {"cost_model", "never_slower"}
    assert (exact["cost_model"], exact["never_slower"]) == ("layers", False)


@pytest.mark.slow
def test_smollm2_paper_config_is_the_reference_step_for_step(smol):
    """SmolLM2-135M, every layer but the last a candidate (29 LM-head shadow tokens per row)."""
    ids = smol.tokenizer("Article: The council approved the new park on Tuesday.\nSummary:")["input_ids"]
    g = del_paper(smol, model="smollm2-135m").generate(ids, 20)
    r = ReferenceDEL(smol.model.hf).generate(ids, 20)
    assert g.tokens == r.tokens == vanilla(smol, ids, 20)
    assert first_difference(g.trace, r.rounds) is None, (first_difference(g.trace, r.rounds), totals(g.trace),
                                                        totals(r.rounds))

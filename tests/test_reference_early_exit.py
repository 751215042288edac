"""Early exit step for step with LayerSkip's code: ``method=early_exit_paper`` against the
reference loop re-implemented from facebookresearch/LayerSkip (tests/reference/layerskip.py) on
the same prompt ids, with the model's own final norm + LM head as exit head (``exit_head:
lm_head``, no artefact). Equal outputs and equal traces: per round drafted, accepted, committed,
exit layer and draft limit (docs/design/fidelity.md)."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from reference.layerskip import LayerSkip
from reference.traces import first_difference, rows, totals
from selfspec.config import compose
from selfspec.decoding import build_decoder
from test_early_exit import agreeing_model, vanilla


@pytest.fixture(scope="module")
def agree():
    return agreeing_model()


def both(loaded, ids, n, exit_layer, gamma, preset="early_exit_paper", first_round="draft", eos=()):
    """selfspec's generation under ``preset`` and the reference's, same prompt, exit and γ (always
    speculating: the speculation gate would follow the wall clock)."""
    cfg = compose([f"+method={preset}", "model=tiny-random"], "train").method
    cfg.exit_layer, cfg.max_draft, cfg.never_slower = exit_layer, gamma, False
    g = build_decoder(cfg, loaded.model, eos_token_ids=eos).generate(ids, n)
    r = LayerSkip(loaded.model.hf, exit_layer, gamma, eos, first_round).generate(ids, n)
    return g, r


@pytest.mark.parametrize("model,exit_layer,gamma", [("tiny", 1, 3), ("agree", 0, 5), ("agree", 2, 4)])
def test_paper_config_is_layerskip_step_for_step(request, prompt_ids, model, exit_layer, gamma):
    """The first round drafts from the prompt, as LayerSkip's loop does: same tokens, same rounds."""
    loaded = request.getfixturevalue(model)
    g, r = both(loaded, prompt_ids, 20, exit_layer, gamma)
    assert g.tokens == r.tokens == vanilla(loaded, prompt_ids, 20)
    assert first_difference(g.trace, r.rounds) is None, (first_difference(g.trace, r.rounds), totals(g.trace),
                                                        totals(r.rounds))
    assert g.trace[0].source == "prefill" and g.trace[0].drafted == gamma and g.trace[0].width == len(prompt_ids) + gamma
    if model == "agree":  # drafts are accepted, in the first round too: both paths are compared
        assert sum(t.accepted for t in g.trace) > 10 and g.trace[0].accepted > 0


def test_the_first_round_is_the_only_difference_of_the_default_config(agree, prompt_ids):
    """``early_exit`` (``prefill: full``, every method's prefill) equals the reference with a full
    prefill step first, and differs from ``early_exit_paper`` only in ``prefill`` and the gate."""
    g, r = both(agree, prompt_ids, 20, 1, 3, preset="early_exit", first_round="prefill")
    assert g.tokens == r.tokens and first_difference(g.trace, r.rounds) is None
    paper, _ = both(agree, prompt_ids, 20, 1, 3)
    assert rows(paper.trace) != rows(g.trace) and paper.steps == g.steps - 1
    default = OmegaConf.to_container(compose(["+method=early_exit", "model=tiny-random"], "train").method)
    exact = OmegaConf.to_container(compose(["+method=early_exit_paper", "model=tiny-random"], "train").method)
    assert {k for k in default if default[k] != exact[k]} == {"prefill", "never_slower"}
    assert (exact["prefill"], exact["never_slower"]) == ("draft", False)


def test_budget_cuts_the_rounds_as_layerskip_does(agree, prompt_ids):
    """At most ``min(γ, budget - 1)`` drafts per round (LayerSkip's ``num_speculations``)."""
    for n in (2, 7):
        g, r = both(agree, prompt_ids, n, 1, 6)
        assert g.tokens == r.tokens and len(g.tokens) == n and first_difference(g.trace, r.rounds) is None
        assert g.trace[0].drafted == min(6, n - 1)


def test_eos_ends_both_at_the_same_round(agree, prompt_ids):
    """An EOS draft ends drafting and a committed EOS ends generation in both loops; LayerSkip's
    output drops the EOS token, selfspec's keeps it (as transformers' ``generate`` does)."""
    ref = vanilla(agree, prompt_ids, 20)
    eos = ref[11]
    g, r = both(agree, prompt_ids, 20, 1, 4, eos=(eos,))
    assert g.stop_reason == "eos" and g.tokens == r.tokens == ref[: ref.index(eos) + 1]
    assert r.authors_tokens == g.tokens[:-1]
    assert first_difference(g.trace, r.rounds) is None


@pytest.mark.slow
def test_smollm2_paper_config_is_layerskip_step_for_step(smol):
    """SmolLM2-135M, the preset's own exit layer and γ (ℓ = 7, γ = 4), the LM head as exit head."""
    ids = smol.tokenizer("Article: The council approved the new park on Tuesday.\nSummary:")["input_ids"]
    cfg = compose(["+method=early_exit_paper"], "train").method
    g = build_decoder(cfg, smol.model).generate(ids, 24)
    r = LayerSkip(smol.model.hf, cfg.exit_layer, cfg.max_draft).generate(ids, 24)
    assert g.tokens == r.tokens == vanilla(smol, ids, 24)
    assert first_difference(g.trace, r.rounds) is None, (first_difference(g.trace, r.rounds), totals(g.trace),
                                                        totals(r.rounds))

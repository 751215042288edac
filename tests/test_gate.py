"""The speculation gate (never slower than vanilla by design): it follows measured costs."""

import pytest

from selfspec.decoding.gate import SpeculationGate


def _run(gate, steps, spec_cost, plain_cost, tokens_spec=2):
    """Drive the gate with fixed per-token costs; return how many steps speculated."""
    n_spec = 0
    for _ in range(steps):
        spec = gate.speculate()
        n_spec += spec
        tokens = tokens_spec if spec else 1
        gate.record(spec, tokens, (spec_cost if spec else plain_cost) * tokens)
    return n_spec


def test_speculation_that_does_not_pay_is_mostly_switched_off():
    gate = SpeculationGate(min_interval=8, max_interval=128)
    n_spec = _run(gate, 1000, spec_cost=1.5, plain_cost=1.0)
    assert not gate.preferred
    # the first step speculates and the second tries plain, which wins; speculation is probed 8
    # steps later, and each probe costs 1 s beyond plain's cost of its 2 tokens, so the probe
    # budget (1% of the time) makes the next wait at least 100 steps, then 128: about 10 in all
    assert n_spec <= 12, n_spec
    # the cost of probing: within 1.5% of always-plain over the run
    spent = n_spec * 2 * 1.5 + (1000 - n_spec) * 1.0
    tokens = n_spec * 2 + (1000 - n_spec)
    assert spent / tokens <= 1.015


def test_speculation_that_pays_keeps_speculating():
    gate = SpeculationGate()
    n_spec = _run(gate, 1000, spec_cost=0.6, plain_cost=1.0)
    assert gate.preferred and n_spec >= 1000 - 11  # plain probed at step 2, then at 33+ step intervals


def test_gate_notices_a_change_and_resets_its_interval():
    gate = SpeculationGate(min_interval=4, max_interval=64, smoothing=1.0)
    _run(gate, 500, spec_cost=1.5, plain_cost=1.0)
    # past max_interval: each probe costs 1 s beyond plain's, 1% of 100 plain steps (the budget)
    assert not gate.preferred and gate.interval == 100
    _run(gate, 200, spec_cost=0.5, plain_cost=1.0)  # e.g. the drafter learned, or the load went away
    assert gate.preferred


def test_cost_per_token_is_total_time_over_total_tokens():
    """Speculative steps of 1.3 s committing 1, 1, 3 tokens (0.78 s per token) against plain steps
    of 1.0 s: speculation pays, though the mean of the per-step ratios (1.01) says it does not."""
    gate = SpeculationGate()
    pattern, spec_steps = [1, 1, 3], 0
    for _ in range(600):
        spec = gate.speculate()
        tokens = pattern[spec_steps % 3] if spec else 1
        spec_steps += spec
        gate.record(spec, tokens, 1.3 if spec else 1.0)
    assert gate.cost[True] < gate.cost[False] and gate.preferred
    assert spec_steps > 0.9 * 600


def test_unmeasured_plain_arm_means_speculate_and_bad_settings_are_refused():
    gate = SpeculationGate()
    assert gate.speculate() is True
    gate.record(True, 3, 1.0)
    assert gate.preferred
    gate.record(False, 0, 1.0)  # nothing committed: no information
    assert gate.cost[False] is None
    with pytest.raises(ValueError, match="min_interval"):
        SpeculationGate(min_interval=0)
    with pytest.raises(ValueError, match="smoothing"):
        SpeculationGate(smoothing=0)


def test_a_probe_lasts_probe_steps():
    gate = SpeculationGate(min_interval=4, max_interval=4, probe_steps=3, probe_budget=0)
    arms = []
    for _ in range(20):
        spec = gate.speculate()
        arms.append(spec)
        gate.record(spec, 1, 1.0 if spec else 0.5)  # plain is cheaper
    # a speculative step, then a 3-step probe of the unmeasured plain arm that flips the choice,
    # then 3 plain steps and a 3-step speculative probe, and so on
    assert arms[:16] == [True] + [False] * 6 + [True] * 3 + [False] * 3 + [True] * 3


def test_a_probe_of_speculation_waits_for_a_step_that_speculates():
    """An n-gram drafter finds a match at every 5th step only: a probe that lands on a step without
    one took a plain step, so the probe stays open until a step really speculates. Matches pay
    (3 tokens for 1.3 s), so the gate must come back to speculation after one bad first draft."""
    gate = SpeculationGate(min_interval=8, max_interval=128)
    gate.record(True, 1, 2.0)  # a first draft of 8 tokens, all rejected: 1 token for 2 steps' cost
    spec_steps = 0
    for step in range(400):
        if gate.speculate() and step % 5 == 0:
            gate.record(True, 3, 1.3)
            spec_steps += 1
        else:
            gate.record(False, 1, 1.0)
    assert gate.preferred and spec_steps >= 70


def test_arms_priced_alike_go_to_plain_without_swapping():
    """PPD whose tree is a single node: its step costs what a plain step costs, and both grow a
    little with the context at every step. Without a margin the arm recorded last looked dearer
    and the gate swapped at every step; now ties go to plain, apart from probes."""
    gate = SpeculationGate()
    arms = []
    for step in range(300):
        spec = gate.speculate()
        arms.append(spec)
        gate.record(spec, 1, 1.0 + 1e-4 * step)
    swaps = sum(a != b for a, b in zip(arms, arms[1:]))
    assert not gate.preferred and sum(arms) <= 12 and swaps <= 24, (sum(arms), swaps)


def test_the_probe_budget_spaces_out_expensive_probes():
    """A speculative step that costs 4 plain steps for one token: its probes cost 3 s beyond
    plain's each. With the 1% budget they come every 300 steps, not every 128."""
    spent = {}
    for budget in (0.01, 0.0):
        gate = SpeculationGate(probe_budget=budget)
        n_spec = _run(gate, 3000, spec_cost=4.0, plain_cost=1.0, tokens_spec=1)
        assert not gate.preferred
        spent[budget] = (n_spec * 4.0 + (3000 - n_spec)) / 3000
    assert gate.interval == 128 and spent[0.0] > 1.025  # probes every 128 steps: ~27 of them
    assert spent[0.01] <= 1.015  # ~12: at 2, 8, then every 300 steps
    with pytest.raises(ValueError, match="probe_budget"):
        SpeculationGate(probe_budget=1.0)


def test_one_or_two_unlucky_probes_do_not_lock_speculation_out():
    """bfloat16 XSum's int8 self-draft (docs/2026-12-07-zen4.md): a step drafts 8 tokens and costs
    5.5 plain steps; it commits 8 on average, but the run's first two commit 4 and 1. Priced on
    those two, each probe cost 4-5 plain steps beyond its tokens, so the 1% budget alone would put
    the next probe 400+ steps away; the budget waits for 3 confirming probes in a row, and the gate
    comes back to speculation within the first hundred steps."""
    def run(budget_after):
        gate = SpeculationGate(budget_after=budget_after)
        commits, spec_steps, tokens = iter([4, 1] + [9, 9, 6, 9] * 200), 0, 0
        for _ in range(400):
            spec = gate.speculate()
            n = next(commits) if spec else 1
            spec_steps += spec
            tokens += n
            gate.record(spec, n, 5.5 if spec else 1.0)
        return gate, spec_steps, tokens
    gate, spec_steps, tokens = run(4)
    assert gate.preferred and spec_steps >= 300, spec_steps
    locked, locked_steps, _ = run(0)  # the budget from the first probe: one more probe in 400 steps
    assert not locked.preferred and locked_steps <= 3, locked_steps
    with pytest.raises(ValueError, match="budget_after"):
        SpeculationGate(budget_after=-1)


def test_short_chains_while_preferred_are_no_evidence_for_the_budget():
    """Speculation's first steps commit 9, 3 and 1 tokens (a mean of 4.3 at 5.5 plain steps a step:
    plain is preferred) and the first probe after the flip 2: four measured steps, but one
    confirming probe. The budget waits for three in a row, so the probes keep doubling (8, 16, 32,
    ...) and the chain's long steps bring the gate back to speculation; a budget from the first
    confirming probe put the next one 350 steps away."""
    def run(budget_after):
        gate = SpeculationGate(budget_after=budget_after)
        commits, spec_steps = iter([9, 3, 1, 2] + [9, 8, 9, 6] * 200), 0
        for _ in range(400):
            spec = gate.speculate()
            n = next(commits) if spec else 1
            spec_steps += spec
            gate.record(spec, n, 5.5 if spec else 1.0)
        return gate, spec_steps
    gate, spec_steps = run(3)
    assert gate.preferred and spec_steps >= 150, spec_steps
    gate, spec_steps = run(0)
    assert not gate.preferred and spec_steps <= 6, spec_steps


@pytest.mark.parametrize("budget_after, intervals", [(3, [8, 16, 32, 300]), (2, [8, 16, 300]), (1, [8, 300])])
def test_the_budget_stretches_the_interval_from_the_budget_after_th_confirming_probe(budget_after, intervals):
    """A speculative step of 4 s for 1 token against plain steps of 1 s: after the flip to plain at
    the second step each probe confirms it, its extra 3 s asking for 300 steps at the 1% budget. The
    interval doubles from 8 until the ``budget_after``-th confirming probe, then jumps to 300."""
    gate = SpeculationGate(budget_after=budget_after)
    seen = []
    for _ in range(700):
        spec = gate.speculate()
        gate.record(spec, 1, 4.0 if spec else 1.0)
        if not seen or gate.interval != seen[-1]:
            seen.append(gate.interval)
    assert seen == intervals


def test_a_chain_that_pays_on_average_is_not_switched_off_by_its_noise():
    """A chain of 8 drafts costing 5.5 plain steps commits 1 to 9 tokens a step (the counts of an
    always-speculating bfloat16 XSum run of the int8 self-draft), 7.7 on average: speculating
    throughout makes 1.39 tokens per plain step's cost. Weighing the newest step's tokens at 0.3, as
    the seconds are, with the probe budget from the first probe, short steps in a row switched
    speculation off for long stretches (0.89 of always speculating, over 40 seeded runs of 1,280
    tokens); at 0.1 the gate keeps 0.98 of it."""
    import random
    import statistics

    counts = [4, 9, 9, 5, 1, 9, 8, 9, 9, 9, 9, 7, 9, 9, 6, 9, 9, 4, 9, 9, 9, 9, 9, 9, 6, 9, 3, 1, 7,
              9, 7, 9, 9, 9, 9, 9, 1, 9, 9, 9, 9, 9, 9, 9, 9, 9, 3]

    def rate(**settings):
        runs = []
        for seed in range(40):
            rng, gate, seconds, tokens = random.Random(seed), SpeculationGate(**settings), 0.0, 0
            while tokens < 1280:
                spec = gate.speculate()
                n, cost = (rng.choice(counts), 5.5) if spec else (1, 1.0)
                gate.record(spec, n, cost)
                seconds, tokens = seconds + cost, tokens + n
            runs.append(tokens / seconds)
        return statistics.mean(runs)

    always = statistics.mean(counts) / 5.5
    assert rate() >= 0.97 * always
    assert rate(units_smoothing=None, budget_after=0) <= 0.93 * always  # tokens at 0.3, no wait
    with pytest.raises(ValueError, match="units_smoothing"):
        SpeculationGate(units_smoothing=0)


# --- the gate inside the decoders: outputs stay vanilla's whichever arm it takes ----------------
import random  # noqa: E402

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from conftest import PPD_KEYS, method_config  # noqa: E402
from selfspec.config.checks import ConfigError  # noqa: E402
from selfspec.decoding import build_decoder, check_method  # noqa: E402
from selfspec.decoding.sampling import Sampling  # noqa: E402

GATED = {
    # the wall-clock gate (no profile): ngram's priced schedule needs one, so the adaptive schedule
    "ngram": method_config("ngram", draft_schedule="adaptive"),
    "draft_verify": method_config("draft_verify", **{"skip_attn": [1], "skip_mlp": [0]}),
    "early_exit": method_config("early_exit", **{"exit_layer": 0, "max_draft": 3}),
    # DEL's conf/method/del.yaml as composed, but for its TPL costs: measured ones need a profile
    "del": None,
    "adadecode": method_config("adadecode", **{"head_kind": "lm_head", "layers": [1, 2], "threshold": 0.05}),
}


def _ppd(model):
    from selfspec.decoding.ppd import PPD
    from selfspec.decoding.tree import random_trees
    from selfspec.models.prompts import PromptTokens

    g = torch.Generator().manual_seed(0)
    return PPD(model, PromptTokens(torch.randn(3, 1, model.hidden_size, generator=g) * 0.5),
               random_trees(3, 6, 3, random.Random(0)), gate=PPD.new_gate(), **PPD_KEYS)


@pytest.mark.parametrize("method", [*GATED, "ppd"])
@pytest.mark.parametrize("prefer_plain", [True, False])
def test_gated_decoders_give_vanilla_output_on_either_arm(tiny, prompt_ids, method, prefer_plain):
    model = tiny.model
    if method == "ppd":
        dec = _ppd(model)
    else:
        from selfspec.config import compose

        cfg = GATED[method] and OmegaConf.create(GATED[method])
        over = ["method.cost_model=parameters"] if method == "del" else []
        dec = build_decoder(cfg or compose(["model=tiny-random", f"method={method}", *over]).method, model)
    assert isinstance(dec.gate, SpeculationGate), "never_slower is on by default"
    # the arm the gate prefers, set by hand: plain decoding "measured" far cheaper, or far dearer
    dec.gate.seconds = {True: 1.0, False: 1e-9} if prefer_plain else {True: 1e-9, False: 1.0}
    dec.gate.units = {True: 1.0, False: 1.0}
    dec.gate.measured = {True: 100, False: 100}  # long measured: the next step moves them by the smoothing
    # ... and kept so: every step "measures" that arm's cost, so the machine's timing cannot flip it
    record, cheap = dec.gate.record, not prefer_plain
    dec.gate.record = lambda speculated, tokens, seconds: record(speculated, tokens,
                                                                 1e-9 * tokens if speculated == cheap else 1.0)
    ref = build_decoder(method_config("vanilla"), model).generate(prompt_ids, 24)
    out = dec.generate(prompt_ids, 24)
    assert out.tokens == ref.tokens
    gated = out.stats.get("plain_steps_gated", 0)
    if prefer_plain:  # all but the probes (every 8+ steps) are plain
        assert gated >= out.steps - 1 - 24 // 8 * dec.gate.probe_steps - dec.gate.probe_steps
    else:  # plain only during probes
        assert gated <= 24 // 8 * dec.gate.probe_steps
    # under sampling the gate stands aside, so a seeded run reproduces whatever the timing
    sampled = dec.generate(prompt_ids, 16, Sampling(temperature=0.8, seed=3))
    again = dec.generate(prompt_ids, 16, Sampling(temperature=0.8, seed=3))
    assert sampled.tokens == again.tokens and len(sampled.tokens) == 16
    assert "plain_steps_gated" not in sampled.stats


def test_never_slower_key_is_checked():
    assert check_method(method_config("ngram", never_slower=False)).never_slower is False
    with pytest.raises(ConfigError, match=r"method\.never_slower=yes is not allowed: must be true or false"):
        check_method(method_config("ngram", never_slower="yes"))
    # a method with no plain-step fallback does not take the key
    with pytest.raises(ConfigError, match=r"method\.never_slower is not a key of method vanilla"):
        check_method(method_config("vanilla", **{"never_slower": True}))


def test_paper_configs_turn_the_gate_off(tiny):
    from selfspec.config import compose

    for label in ("draft_verify_paper", "early_exit_paper", "del_paper", "ppd_paper", "adadecode_paper"):
        options = check_method(compose(["model=tiny-random", f"method={label}"]).method)
        assert options.never_slower is False, label
    assert check_method(compose(["model=tiny-random", "method=del_paper"]).method).cost_model == "layers"
    assert check_method(compose(["model=tiny-random", "method=early_exit_paper"]).method).prefill == "draft"
    dec = build_decoder(OmegaConf.create({**GATED["ngram"], "never_slower": False}), tiny.model)
    assert dec.gate is None


@pytest.mark.parametrize("method", ["ngram", "draft_verify", "adadecode"])
def test_a_gate_priced_with_a_profile_acts_under_sampling_and_reproduces(tiny, prompt_ids, method):
    """With a cost profile the gate prices each step from its ledger ops: the same seeded run makes
    the same choices whatever the machine's load, so it acts under sampling too; greedy output
    stays vanilla's."""
    from test_ledger import synthetic_profile

    ids = prompt_ids + prompt_ids  # a repeat, so the n-gram lookup finds matches
    # the synthetic profile prices a k + 1-row verification like k + 1 plain steps' attention: on
    # the tiny random model, whose drafts are rarely accepted, speculation does not pay
    dec = build_decoder(OmegaConf.create(GATED[method]), tiny.model, profile=synthetic_profile())
    assert dec.gate.deterministic
    s = Sampling(temperature=0.8, seed=3)
    with dec.kept_state():
        first = dec.generate(ids, 32, s)
    again = dec.generate(ids, 32, s)
    assert first.tokens == again.tokens and [t.row() for t in first.trace] == [t.row() for t in again.trace]
    assert first.stats.get("plain_steps_gated", 0) > 0
    ref = build_decoder(method_config("vanilla"), tiny.model).generate(ids, 24)
    with dec.kept_state():
        assert dec.generate(ids, 24).tokens == ref.tokens

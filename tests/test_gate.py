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
    # the first 7 steps speculate, then plain wins; speculation is probed at intervals of 8, 16, 32,
    # 64, then every 128 steps: 4 + (1000 - 120 - 7) / 128 probes
    assert n_spec <= 7 + 11, n_spec
    # the cost of probing: within 3% of always-plain over the run
    spent = n_spec * 2 * 1.5 + (1000 - n_spec) * 1.0
    tokens = n_spec * 2 + (1000 - n_spec)
    assert spent / tokens <= 1.03


def test_speculation_that_pays_keeps_speculating():
    gate = SpeculationGate()
    n_spec = _run(gate, 1000, spec_cost=0.6, plain_cost=1.0)
    assert gate.preferred and n_spec >= 1000 - 11  # plain probed at 8, 16, 32, 64, then every 128


def test_gate_notices_a_change_and_resets_its_interval():
    gate = SpeculationGate(min_interval=4, max_interval=64, smoothing=1.0)
    _run(gate, 500, spec_cost=1.5, plain_cost=1.0)
    assert not gate.preferred and gate.interval == 64
    _run(gate, 200, spec_cost=0.5, plain_cost=1.0)  # e.g. the drafter learned, or the load went away
    assert gate.preferred


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

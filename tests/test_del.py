"""DEL controller: greedy equals vanilla, shadow statistics and TPL argmax against brute force."""

import itertools

import pytest
import torch
from omegaconf import OmegaConf

from selfspec.decoding import DecodeState, Sampling, build_decoder
from selfspec.decoding.early_exit import DEL, DELDrafter, ShadowStats, round_cost, tpl_argmax
from selfspec.measure.profile import Profile
from conftest import cpu_like_profile, method_config
from test_early_exit import agreeing_model, compose_method, vanilla


@pytest.fixture(scope="module")
def agree():
    return agreeing_model()


def del_decoder(loaded, profile=None, **over):
    """DEL from conf/method/del.yaml with ``over``; ``cost_model: measured`` (the default) priced by
    ``profile``, else by :func:`cpu_like_profile` (the same choices on every machine)."""
    cfg = OmegaConf.merge(method_config("del"), over)
    if cfg.cost_model == "measured" and profile is None:
        profile = cpu_like_profile(loaded.model)
    return build_decoder(cfg, loaded.model, profile=profile)


@pytest.mark.parametrize("over", [{}, {"draft_stop": None}, {"min_draft": 0, "max_draft": 6},
                                  {"draft_stop": {"rule": "static", "threshold": 0.5}},
                                  {"candidate_layers": [0, 2], "shadow_rows": 1, "head_cost": 0.0}])
def test_greedy_equals_vanilla_under_controller(agree, tiny, prompt_ids, over):
    for loaded in (agree, tiny):
        ref = vanilla(loaded, prompt_ids, 32)
        g = del_decoder(loaded, **over).generate(prompt_ids, 32)
        assert g.tokens == ref, (loaded.name, over)
    assert g.steps > 1


def test_controller_moves_exit_and_gamma(agree, prompt_ids):
    """On the agreeing model the controller drafts (accepted drafts) at changing (ℓ, γ). Costs from
    parameters and no speculation gate: what the controller decides must not depend on the
    machine's timings (a loaded machine measured other v(k) and the gate took plain steps)."""
    d = del_decoder(agree, head_cost=0.0, cost_model="parameters", never_slower=False)
    seen = set()
    plan = d.drafter.plan
    d.drafter.plan = lambda state: seen.add((plan(state).exit_layer, plan(state).max_draft)) or plan(state)
    g = d.generate(prompt_ids, 48)
    assert g.tokens == vanilla(agree, prompt_ids, 48)
    assert g.acceptance_rate > 0.3 and len(seen) > 1, seen


def test_sampling_runs_and_is_seeded(agree, prompt_ids):
    s = Sampling(temperature=0.8, top_k=20, seed=5)
    a = del_decoder(agree).generate(prompt_ids, 20, s).tokens
    assert a == del_decoder(agree).generate(prompt_ids, 20, s).tokens and len(a) == 20


def test_shadow_hidden_states_equal_recomputation(agree, prompt_ids):
    """The candidate-layer states kept from drafting (layers <= ℓ) and verification (layers > ℓ)
    equal those of a full pass over the verified positions, so shadow tokens are exact."""
    m = agree.model
    d = del_decoder(agree, head_cost=0.0)
    checked = []

    def observe(state, draft, committed):
        n = len(committed)
        start = state.n_cached  # position of x_0 (the pending token of this round)
        seq = state.tokens + committed[:-1]  # x_0 … x_{n-1}: the verified positions that were committed
        h = m.embed(torch.tensor([seq]))
        rope = m.rope(m.positions(0, len(seq)), h)
        mask = m.causal_mask(len(seq), 0)
        for i in range(m.num_layers - 1):
            h = m.mlp(i, m.attention(i, h, rope, None, mask))
            torch.testing.assert_close(state.example.hs[d.drafter.slot[i], :n], h[0, start : start + n], rtol=1e-4,
                                       atol=1e-4)
        checked.append((draft.plan.exit_layer, n))
        DELDrafter.observe(d.drafter, state, draft, committed)

    d.drafter.observe = observe
    d.generate(prompt_ids, 24)
    assert any(n > 1 for _, n in checked) and len({e for e, _ in checked}) >= 1


def test_shadow_stats_equal_brute_force_decayed_ratios():
    torch.manual_seed(0)
    omega, C = 0.9, 3
    stats = ShadowStats(C, omega)
    history = []
    for n in (1, 4, 2, 5):
        match = torch.rand(C, n) < 0.6
        conf = torch.rand(C, n)
        stats.update(match, conf)
        history += [(match[:, j], conf[:, j]) for j in range(n)]
    T = len(history)
    for c in range(C):
        w = [omega ** (T - 1 - t) for t in range(T)]
        m = [float(h[0][c]) for h in history]
        f = [float(h[1][c]) for h in history]
        alpha = sum(wi * mi for wi, mi in zip(w, m)) / sum(w)
        cm = sum(wi * mi * fi for wi, mi, fi in zip(w, m, f)) / sum(wi * mi for wi, mi in zip(w, m))
        cx = sum(wi * (1 - mi) * fi for wi, mi, fi in zip(w, m, f)) / sum(wi * (1 - mi) for wi, mi in zip(w, m))
        assert float(stats.alpha()[c]) == pytest.approx(alpha)
        assert float(stats.threshold()[c]) == pytest.approx((cm + cx) / 2)
    fresh = ShadowStats(2, omega)
    fresh.update(torch.tensor([[True], [False]]), torch.tensor([[0.9], [0.2]]))
    assert fresh.threshold().tolist() == [0.0, 0.0]  # no stop until both kinds are seen
    # a mismatch long ago still counts: 600 matches later (ω^600 ≈ 4e-14) the mean stays exact
    old = ShadowStats(1, 0.95)
    old.update(torch.tensor([[False]]), torch.tensor([[0.25]]))
    for _ in range(100):
        old.update(torch.ones(1, 6, dtype=torch.bool), torch.full((1, 6), 0.75))
    assert float(old.threshold()[0]) == pytest.approx(0.5, rel=1e-12)
    assert old.state()["conf_miss"] == [pytest.approx(0.25, rel=1e-12)]


@pytest.mark.parametrize("head_cost", [0.0, 2.5])
@pytest.mark.parametrize("measured", [False, True])
@pytest.mark.parametrize("copy", [None, (0.3, 0.7)])
def test_tpl_argmax_matches_brute_force(head_cost, measured, copy):
    """DEL's count (every pass costs its layers, v = 1) and the measured variant, where scoring
    γ+1 tokens in one pass costs v(γ+1) single-token passes (here v(k) = 1 + 0.1·(k-1)); with drafts
    over a quantised copy (``copy``: a draft layer at 0.3 of a target layer, the copy's head at 0.7),
    the drafts cost the copy's rate and verification runs every layer."""
    L = 32
    layers = [1, 3, 5, 7, 11, 15, 23]
    v = (lambda k: 1 + 0.1 * (k - 1)) if measured else (lambda k: 1.0)
    for alpha in ([0.2, 0.35, 0.5, 0.6, 0.7, 0.85, 0.97], [0.0] * 7, [0.9, 0.1, 0.1, 0.1, 0.95, 0.99, 1.0],
                  [0.5, 0.55, 0.62, 0.99, 0.99, 0.995, 0.999]):
        for gmin, gmax in ((1, 18), (0, 6)):
            best = None
            for (ell, a), g in itertools.product(zip(layers, alpha), range(gmin, gmax + 1)):
                tokens = sum(a**i for i in range(g + 1))
                if copy is None:
                    cost = g * (ell + 1 + head_cost) + (ell + 1) + (L - ell - 1 + head_cost) * v(g + 1)
                else:
                    cost = g * ((ell + 1) * copy[0] + copy[1]) + (L + head_cost) * v(g + 1)
                if best is None or tokens / cost > best[2] + 1e-12:
                    best = (ell, g, tokens / cost)
            gammas = torch.arange(gmin, gmax + 1)
            verify = torch.tensor([v(int(g) + 1) for g in gammas]) if measured else None
            cost = round_cost(torch.tensor(layers), gammas, L, head_cost, verify, copy)
            got = tpl_argmax(torch.tensor(alpha), torch.tensor(layers), gammas, cost)
            assert got[:2] == best[:2] and got[2] == pytest.approx(best[2]), (alpha, gmin, gmax)


def test_measured_costs_come_from_the_runs_profile(tiny, prompt_ids):
    """cost_model=measured prices TPL with the run's cost profile (issue 40: one cost model; before, DEL
    timed a benchmark in its constructor and ignored the profile): v(γ+1) is the profile's pass of γ+1
    rows over its pass of one, the head its price over a layer's. An expensive verification pass makes
    the controller stop drafting; parameters keeps DEL's count; no profile is refused by name."""
    from selfspec.decoding.early_exit import MEASURED_NEEDS_PROFILE

    m = tiny.model
    steep = cpu_like_profile(m)
    steep.data["mlp"] = {"1": 1e-3, "2": 3e-3, "4": 6e-3, "8": 12e-3, "16": 24e-3, "32": 48e-3}  # v(k) = 3k/2, k >= 2
    vocab = str(steep.shape["vocab_size"])
    steep.data["head"] = {vocab: {k: 2 * t for k, t in steep.data["mlp"].items()}}  # 2 layers' worth, alike in k
    steep = Profile(steep.data)
    d = del_decoder(tiny, steep, min_draft=0, max_draft=8)
    assert d.drafter.head_cost == pytest.approx(2.0)
    assert d.drafter.verify.tolist() == pytest.approx([1.0, 3.0, 4.5, 6.0, 7.5, 9.0, 10.5, 12.0, 13.5])
    state = DecodeState([], 0, None, Sampling(), None, example=d.drafter.new_example(None))
    state.example.shadow.update(torch.ones(len(d.drafter.candidates), 1, dtype=torch.bool),
                                torch.ones(len(d.drafter.candidates), 1))
    assert d.drafter.plan(state).max_draft == 0  # even perfect agreement cannot pay v(2) = 3: plain decoding
    g = d.generate(prompt_ids, 16)
    assert g.tokens == vanilla(tiny, prompt_ids, 16)
    p = del_decoder(tiny, min_draft=0, max_draft=8, cost_model="parameters")
    assert p.drafter.verify is None and p.drafter.head_cost == pytest.approx(m.lm_head_weight.numel() / m.layer_numel())
    with pytest.raises(ValueError, match="cost_model=measured prices TPL's costs with this machine's cost profile"):
        build_decoder(method_config("del"), m)
    assert "cost_model=parameters" in MEASURED_NEEDS_PROFILE


def test_config_composes_and_bad_values_stop(tiny):
    cfg = compose_method("del")
    d = build_decoder(cfg, tiny.model, profile=cpu_like_profile(tiny.model))
    assert isinstance(d, DEL) and d.drafter.candidates == [0, 1, 2] and d.drafter.verify is not None
    assert d.drafter.head_cost == 0.0  # cpu_like_profile's head costs nothing
    with pytest.raises(ValueError, match="omega"):
        del_decoder(tiny, omega=1.0)
    with pytest.raises(ValueError, match="min_draft"):
        del_decoder(tiny, min_draft=30)
    with pytest.raises(ValueError, match="candidate_layers"):
        del_decoder(tiny, exit_head="heads", candidate_layers=[1])


@pytest.mark.slow
def test_smollm2_del_and_early_exit_equal_vanilla(smol):
    ids = smol.tokenizer("Article: The council approved the new park on Tuesday.\nSummary:")["input_ids"]
    ref = vanilla(smol, ids, 12)
    from test_early_exit import ee

    assert ee(smol, 9, 3).generate(ids, 12).tokens == ref
    assert del_decoder(smol, candidate_layers=[5, 9, 14]).generate(ids, 12).tokens == ref


def test_a_gate_defers_the_prompts_shadow_tokens_to_the_first_plan(agree, prompt_ids):
    """With a speculation gate the prompt's shadow tokens wait for the first round's plan: the
    prefill runs no exit head, the plan reads the statistics the prefill seeds without a gate, and
    an example whose steps the gate makes plain never runs an exit head."""
    firsts = []

    def first_plan(d):
        def plan(state):
            pending = state.example.seed is not None
            got = DELDrafter.plan(d.drafter, state)
            if len(firsts) < 2 and not any(f[0] is d for f in firsts):
                firsts.append((d, pending, state.example.shadow.state(), got))
            return got
        d.drafter.plan = plan
        return d

    gated = first_plan(del_decoder(agree, cost_model="parameters"))
    ungated = first_plan(del_decoder(agree, cost_model="parameters", never_slower=False))
    assert gated.gate is not None and ungated.gate is None
    g, u = gated.generate(prompt_ids, 24), ungated.generate(prompt_ids, 24)
    assert g.tokens == u.tokens == vanilla(agree, prompt_ids, 24)
    (_, deferred, g_stats, g_plan), (_, seeded, u_stats, u_plan) = firsts
    assert deferred and not seeded
    assert g_stats == u_stats and g_plan == u_plan
    assert not g.trace[0].controller and set(u.trace[0].controller) == {"alpha", "conf_match", "conf_miss"}

    plain = del_decoder(agree, cost_model="parameters")
    plain.gate.speculate = lambda: False
    calls = []
    logits = plain.drafter.heads.logits
    plain.drafter.heads.logits = lambda *a: calls.append(1) or logits(*a)
    assert plain.generate(prompt_ids, 16).tokens == vanilla(agree, prompt_ids, 16) and not calls

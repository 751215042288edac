"""Draft & Verify decoding: lossless against vanilla, exact cache rollback, target distribution."""

import copy
import random

import pytest
import torch
from omegaconf import OmegaConf

from conftest import adaptive_rule, draft_stop, method_config, method_options, rolled_back_steps

from selfspec.config import compose, model_config
from selfspec.decoding import Sampling, build_decoder
from selfspec.decoding.base import DecodeState
from selfspec.decoding.carried import Carries
from selfspec.decoding.draft_verify import DraftVerify, resolve_skip_set, skip_set_tensors
from selfspec.decoding.sampling import warp
from selfspec.models.layered import Pass, SkipSet
from selfspec.models.loading import load_model


@pytest.fixture(scope="module")
def tiny8():
    """A deeper tiny-random model (8 layers, 16 sublayers) so skip sets have room."""
    cfg = OmegaConf.merge(model_config("tiny-random"), {"random": {"num_hidden_layers": 8, "seed": 1}})
    return load_model(cfg)


def vanilla_tokens(loaded, ids, n, eos=()):
    dec = build_decoder(method_config("vanilla"), loaded.model, eos_token_ids=eos)
    return dec.generate(ids, n).tokens


def dv(loaded, attn=(), mlp=(), **kw):
    """Draft & Verify as its paper runs it: no speculation gate (tests/test_gate.py tests the gate),
    so these tests see the drafting and verification they set up on every step."""
    cfg = method_config("draft_verify", **{"skip_attn": list(attn), "skip_mlp": list(mlp), "never_slower": False,
                                           **kw})
    return build_decoder(cfg, loaded.model)


def random_skip_sets(n_layers, count, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        out.append(([i for i in range(n_layers) if rng.random() < 0.5], [i for i in range(n_layers) if rng.random() < 0.5]))
    return out


def test_greedy_equals_vanilla_for_random_skip_sets(tiny8, prompt_ids):
    ref = vanilla_tokens(tiny8, prompt_ids, 40)
    for stop, k in ((draft_stop("adaptive", threshold=0.05), 12), (draft_stop("static", threshold=0.05), 5), (None, 3)):
        for attn, mlp in random_skip_sets(8, 3, seed=k):
            dec = dv(tiny8, attn, mlp, draft_stop=stop, max_draft=k)
            g = dec.generate(prompt_ids, 40)
            assert g.tokens == ref, (stop, attn, mlp)
            assert sum(g.drafted_per_step) > 0


@pytest.mark.parametrize(
    "attn,mlp",
    [((), ()), (range(8), [i for i in range(8) if i != 3]), ([i for i in range(8) if i != 5], range(8))],
    ids=["empty", "all-but-one-attn", "all-but-one-mlp"],
)
def test_greedy_equals_vanilla_extreme_skip_sets(tiny8, prompt_ids, attn, mlp):
    ref = vanilla_tokens(tiny8, prompt_ids, 30)
    g = dv(tiny8, attn, mlp, draft_stop=None, max_draft=4).generate(prompt_ids, 30)
    assert g.tokens == ref
    if not attn and not mlp:  # the draft model is the model: every draft accepted
        assert g.acceptance_rate == 1.0 and g.tau > 4


def test_eos_and_budget_cut_like_vanilla(tiny8, prompt_ids):
    free = vanilla_tokens(tiny8, prompt_ids, 25)
    eos = free[9]
    ref = vanilla_tokens(tiny8, prompt_ids, 25, eos=[eos])
    cfg = method_config("draft_verify", **{"skip_attn": [1, 2], "skip_mlp": [6], "draft_stop": None})
    g = build_decoder(cfg, tiny8.model, eos_token_ids=[eos]).generate(prompt_ids, 25)
    assert g.tokens == ref and g.stop_reason == "eos"
    for n in (1, 2, 7):
        assert dv(tiny8, [0], [1, 2]).generate(prompt_ids, n).tokens == free[:n]


def test_cache_after_rollback_equals_recomputation(tiny8, prompt_ids):
    """Drive steps by hand; after each, every layer holds exactly the full model's K/V of the
    committed tokens but the pending one (scratch drafts and rejected positions rolled back)."""
    dec = dv(tiny8, [1, 4, 6], [0, 5], draft_stop=None, max_draft=5)
    rejected = rolled_back_steps(dec, prompt_ids)
    assert rejected > 0  # the rollback path was exercised


def first_step(s: Sampling):
    """A 512-token random model (cheap steps), a one-draft Draft & Verify, the state after the prompt
    and its greedy first token, the target p of the next token and the draft's hidden state for it
    (both conditional on prompt + first, computed independently of the decoder)."""
    cfg = OmegaConf.merge(model_config("tiny-random"), {"tokenizer": None, "random": {"vocab_size": 512, "num_hidden_layers": 4, "seed": 2}})
    model = load_model(cfg).model
    prompt_ids = list(range(40, 70))
    dec = DraftVerify(model, SkipSet.of(attn=[1, 2], mlp=[2, 3]), method_options("draft_verify", max_draft=1,
                                                                                 draft_stop=None))
    prompt = torch.tensor([prompt_ids])
    state = DecodeState(list(prompt_ids), len(prompt_ids), model.new_cache(64), s, torch.Generator().manual_seed(0))
    with torch.inference_mode():
        h = model.forward(prompt, state.cache, start=0)
        first = int(model.logits(h[:, -1])[0].argmax())
        state.tokens.append(first)
        p = warp(model.logits(model.forward(torch.tensor([prompt_ids + [first]]), model.new_cache(64), start=0)[:, -1])[0], s)
        q_cache = model.new_cache(64)
        model.forward(prompt, q_cache, start=0)
        h_draft = model.forward(torch.tensor([[first]]), q_cache, Pass(skip=dec.drafter.skip_set),
                                start=state.n_cached)[:, -1]
    return dec, state, p, h_draft


def first_token_counts(dec, state, n: int) -> torch.Tensor:
    """How often each token is the first one ``n`` independent steps from ``state`` emit."""
    base = state.n_cached
    counts = torch.zeros(dec.model.vocab_size)
    for _ in range(n):
        new = dec.step(state, budget=2)
        counts[new[0]] += 1
        state.cache.truncate(base)
    return counts


def test_speculative_sampling_matches_target_distribution():
    """First token emitted by a step (a verified draft or a residual resample) ~ p.

    A 512-token-vocabulary random model keeps each step cheap. 6 outcomes (top_k=6),
    N = 1,600 steps: an unbiased sampler's total variation distance from p is ~0.023 on average
    (sd ~0.009); the bound 0.055 (mean + 3.5 sd) fails a sampler returning the draft distribution q (TV(p, q) is
    checked to be > 0.15 here, so the test can tell them apart).
    """
    s = Sampling(temperature=0.3, top_k=6, seed=0)
    dec, state, p, h_draft = first_step(s)
    with torch.inference_mode():
        q = warp(dec.model.logits(h_draft)[0], s)
        counts = first_token_counts(dec, state, 1600)
    n = 1600
    tv_pq = 0.5 * (p - q).abs().sum()
    tv = 0.5 * (counts / n - p).abs().sum()
    assert tv_pq > 0.15, f"draft too close to target for a meaningful test (TV {tv_pq:.3f})"
    assert tv < 0.055, f"total variation {tv:.4f} (TV(p, q) = {tv_pq:.3f})"


def test_sampling_is_seeded_and_lossless_path_runs(tiny8, prompt_ids):
    s = Sampling(temperature=0.8, top_p=0.9, seed=5)
    a = dv(tiny8, [2], [3]).generate(prompt_ids, 20, s)
    b = dv(tiny8, [2], [3]).generate(prompt_ids, 20, s)
    assert a.tokens == b.tokens and len(a.tokens) == 20 and sum(a.drafted_per_step) > 0


def test_adaptive_threshold_update_rule_and_carry_over(tiny8, prompt_ids):
    dec = dv(tiny8, [0, 1, 2, 3], [0, 1, 2], draft_stop=draft_stop("adaptive", threshold=0.6, target=0.9))
    rule = dec.drafter.draft_stop
    # Eq. 2-4 by hand: first stage AR = AR_1 (beta1 = 0)
    rule.update(4, 1, hit_max=False)  # AR 0.25 <= 0.9 -> raise
    assert rule.ar == 0.25 and dec.drafter.threshold == pytest.approx(0.9 * 0.6 + 0.1 * 0.61)
    g1 = dec.drafter.threshold
    rule.update(4, 4, hit_max=False)  # AR 0.625 -> raise again
    assert rule.ar == pytest.approx(0.625) and dec.drafter.threshold == pytest.approx(0.9 * g1 + 0.1 * (g1 + 0.01))
    rule.ar, g2 = 0.95, dec.drafter.threshold
    rule.update(12, 12, hit_max=True)  # above target but hit K: not lowered
    assert dec.drafter.threshold == g2
    rule.update(3, 3, hit_max=False)  # above target -> lower
    assert dec.drafter.threshold == pytest.approx(0.9 * g2 + 0.1 * (g2 - 0.01))
    # state carries over between generate calls; reset restores γ0
    dec.drafter.reset_draft_stop()
    g = dec.generate(prompt_ids, 30)
    assert g.stats["threshold"] == dec.drafter.threshold != 0.6 and g.stats["verifications"] > 0
    before = dec.drafter.threshold
    dec.generate(prompt_ids, 30)
    assert dec.drafter.threshold != before
    dec.drafter.reset_draft_stop()
    assert dec.drafter.threshold == 0.6 and dec.drafter.draft_stop.ar is None
    static = dv(tiny8, [0, 1, 2, 3], [0, 1, 2], draft_stop=draft_stop("static", threshold=0.6))
    static.generate(prompt_ids, 30)
    assert static.drafter.threshold == 0.6


def test_skip_set_artefact_round_trip_and_errors(tiny8, tmp_path):
    from selfspec.store.artefacts import save_artefact

    skip = SkipSet.of(attn=[1, 7], mlp=[0])
    save_artefact(tmp_path / "sk", "skip_set", skip_set_tensors(skip, 8), tiny8, kernel_paths=None)
    cfg = method_config("draft_verify", **{"skip_set": str(tmp_path / "sk")})
    assert resolve_skip_set(cfg, tiny8.model, tiny8.tokenizer) == skip
    dec = build_decoder(cfg, tiny8.model, tokenizer=tiny8.tokenizer)
    assert isinstance(dec, DraftVerify) and dec.drafter.skip_set == skip
    with pytest.raises(ValueError, match="layers"):
        dv(tiny8, [8], [])
    with pytest.raises(ValueError, match=r"method\.draft_stop\.rule=sometimes"):
        dv(tiny8, [1], [], draft_stop={"rule": "sometimes"})
    with pytest.raises(ValueError, match=r"method\.draft_exit was renamed: set method\.draft_stop"):
        dv(tiny8, [1], [], draft_exit="none")
    with pytest.raises(ValueError, match=r"method\.alpha was renamed: set method\.draft_stop\.target instead"):
        dv(tiny8, [1], [], alpha=0.8)
    missing = method_config("draft_verify", **{"task": "no-such-task"})
    import os
    os.environ["SELFSPEC_OUTPUTS"] = str(tmp_path / "out")
    try:
        with pytest.raises(FileNotFoundError, match="search-skips"):
            resolve_skip_set(missing, tiny8.model)
    finally:
        del os.environ["SELFSPEC_OUTPUTS"]


@pytest.mark.parametrize("method", ["draft_verify", "draft_verify_static", "draft_verify_fixed_k"])
def test_method_configs_compose(method):
    cfg = compose([f"+method={method}", "job=skips"], config_name="train")
    m = cfg.method
    assert m.name == "draft_verify" and m.task == cfg.task.name
    rule = None if m.draft_stop is None else m.draft_stop.rule
    assert rule == {"draft_verify": "adaptive", "draft_verify_static": "static", "draft_verify_fixed_k": None}[method]
    options = DraftVerify.Options.read(m)
    assert (options.draft_stop and options.draft_stop.config()) == (rule and draft_stop(rule))


def test_acceptance_average_start_and_scope():
    """``draft_stop.ar_start`` / ``ar_per_example`` (docs/design/fidelity.md §8): the paper's text starts AR at
    the first round's rate; the authors' code starts it at 0 (β1 from the first round) in every
    call, so its first update raises θ even after a fully accepted draft. θ always carries over."""
    text = adaptive_rule(threshold=0.6, target=0.9)
    text.update(drafted=4, accepted=4, hit_max=False)  # AR = 1 > α: lowered
    assert text.ar == 1.0 and text.value == 0.9 * 0.6 + (1 - 0.9) * (0.6 - 0.01)
    code = adaptive_rule(threshold=0.6, target=0.9, ar_start="zero", ar_per_example=True)
    assert code.ar == 0.0
    code.update(drafted=4, accepted=4, hit_max=False)  # AR = 0.5·0 + 0.5·1 < α: raised
    assert code.ar == 0.5 and code.value == 0.9 * 0.6 + (1 - 0.9) * (0.6 + 0.01)
    theta = code.value
    code.start_example()  # a new example: AR from 0 again, θ kept
    assert code.ar == 0.0 and code.value == theta
    text.start_example()  # carried: nothing changes
    assert text.ar == 1.0
    per_example = adaptive_rule(ar_per_example=True)
    per_example.update(drafted=2, accepted=1, hit_max=False)
    per_example.start_example()
    assert per_example.ar is None
    held = adaptive_rule(threshold=0.7, target=0.9)
    held.update(drafted=12, accepted=12, hit_max=True)  # AR above α but K drafts: θ̃ = θ (the code's arithmetic)
    assert held.value == 0.9 * 0.7 + (1 - 0.9) * 0.7


def test_authors_loop_keys_are_checked(tiny8):
    with pytest.raises(ValueError, match=r"method\.draft_stop\.ar_start=sometimes is not allowed: must be one of "
                                         r"first_rate, zero"):
        dv(tiny8, [1], [], draft_stop=draft_stop("adaptive", ar_start="sometimes"))
    with pytest.raises(ValueError, match=r"method\.draft_stop\.ar_per_example=yes is not allowed: must be true or false"):
        dv(tiny8, [1], [], draft_stop=draft_stop("adaptive", ar_per_example="yes"))
    with pytest.raises(ValueError, match=r"method\.draft_stop\.ar_start is not a key"):
        dv(tiny8, [1], [], draft_stop={"rule": "static", "threshold": 0.5, "ar_start": "zero"})
    with pytest.raises(ValueError, match=r"method\.last_token=always is not allowed: must be one of plain, draft"):
        dv(tiny8, [1], [], last_token="always")
    with pytest.raises(ValueError, match=r"method\.eos_draft=never is not allowed: must be one of stop, continue"):
        dv(tiny8, [1], [], eos_draft="never")


def test_authors_budget_and_eos_drafting_stay_lossless(tiny8, prompt_ids):
    """``last_token: draft`` drafts and verifies with one token of budget left and ``eos_draft:
    continue`` drafts past EOS; the loop still cuts the output to the budget and at EOS."""
    free = vanilla_tokens(tiny8, prompt_ids, 25)
    paper = dv(tiny8, [1, 2], [6], draft_stop=draft_stop("adaptive", threshold=0.0), max_draft=3,
               last_token="draft", eos_draft="continue", never_slower=False)
    assert paper.drafter.draft_room(3, 1) == 1 and dv(tiny8, [1, 2], [6]).drafter.draft_room(3, 1) == 0
    for n in (1, 2, 7, 25):
        g = paper.generate(prompt_ids, n)
        assert g.tokens == free[:n] and all(s.drafted for s in g.trace[1:])
    eos = free[9]
    cfg = method_config("draft_verify", **{"skip_attn": [1, 2], "skip_mlp": [6], "max_draft": 12,
                            "draft_stop": None, "last_token": "draft", "eos_draft": "continue", "never_slower": False})
    g = build_decoder(cfg, tiny8.model, eos_token_ids=[eos]).generate(prompt_ids, 25)
    assert g.tokens == vanilla_tokens(tiny8, prompt_ids, 25, eos=[eos]) and g.stop_reason == "eos"
    assert g.trace[-1].drafted > g.trace[-1].committed  # drafted past the EOS it committed


def test_paper_config_and_presets_run_the_authors_loop():
    """``draft_verify_paper`` and every Draft & Verify preset (each swept method) set the authors'
    loop: no gate, a draft with one token left, drafts past EOS, AR from 0 per example (adaptive)."""
    from selfspec.config import compose

    def options(overrides):
        return DraftVerify.Options.read(compose(["model=tiny-random", *overrides]).method).config()

    runs = [["method=draft_verify_paper"], ["experiment=dv_text"], ["experiment=dv_code"],
            ["experiment=dv_fixed_k"], ["experiment=dv_static", "method=draft_verify_static"],
            ["experiment=dv_static", "method=draft_verify_paper"]]
    for overrides in runs:
        cfg = compose(["model=tiny-random", *overrides]).method
        o = options(overrides)
        assert cfg.never_slower is False and (o["last_token"], o["eos_draft"]) == ("draft", "continue"), overrides
        stop = o["draft_stop"]
        if stop is not None and stop["rule"] == "adaptive":
            assert (stop["ar_start"], stop["ar_per_example"], stop["threshold"]) == ("zero", True, 0.6), overrides
            assert o["max_draft"] == 12
    default = options(["method=draft_verify"])
    assert (default["last_token"], default["eos_draft"]) == ("plain", "stop")
    assert (default["draft_stop"]["ar_start"], default["draft_stop"]["ar_per_example"]) == ("first_rate", False)


def test_warmup_leaves_the_carried_state_as_it_was(tiny8, prompt_ids):
    """The evaluation's warm-up (docs/design/contracts.md §2.3): each decoder's carried policy state — the
    threshold, its acceptance average and the speculation gate — is put back afterwards, so the
    measured examples decode as a fresh decoder would (greedy: the same steps)."""
    from types import SimpleNamespace

    from selfspec.evaluation.loop import _warmup

    def build(label):
        cfg = method_config("draft_verify", **{"skip_attn": [1, 2], "skip_mlp": [6],
                                "draft_stop": draft_stop("adaptive", threshold=0.05), "never_slower": label == "gated"})
        if label == "paper":
            cfg.merge_with({"draft_stop": {"ar_start": "zero", "ar_per_example": True}})
        return build_decoder(cfg, tiny8.model)

    for label in ("paper", "default", "gated"):
        dec, fresh = build(label), build(label)
        carrying = [p for p in dec.parts if isinstance(p, Carries)]
        assert carrying == ([dec.gate] if label == "gated" else []) + [dec.drafter] and dec.carries == ()
        stop, gate = copy.deepcopy(dec.drafter.draft_stop), copy.deepcopy(dec.gate)
        _warmup([SimpleNamespace(decoder=dec)], [prompt_ids], 2, 16, Sampling())
        assert dec.drafter.threshold == 0.05 and dec.drafter.draft_stop == stop and dec.gate == gate
        if label != "gated":  # the gate's choices follow the wall clock
            assert dec.generate(prompt_ids, 24).trace == fresh.generate(prompt_ids, 24).trace, label
    with_warmup = build("paper")
    with with_warmup.kept_state():
        with_warmup.generate(prompt_ids, 16)
        assert with_warmup.drafter.threshold != 0.05
    assert with_warmup.drafter.threshold == 0.05


def test_a_part_whose_whole_state_carries_is_put_back_whole():
    """A part whose whole state carries (the gate) loses, on restore, state it created as it ran."""
    from selfspec.decoding.gate import SpeculationGate

    gate = SpeculationGate()
    snapshot = gate.snapshot()
    gate.interval, gate._since_probe, gate.created_later = 99, 5, True
    gate.restore(snapshot)
    assert gate == SpeculationGate() and not hasattr(gate, "created_later")

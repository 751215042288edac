"""Batches (issue 54): several prompts decoded at once, each sequence accepting its own number of tokens,
each equal to its single-prompt output from the same carried state (issue 68: under sampling, the batch-1
run's only where the method carries nothing from one example to the next). Every method, greedy and sampled, mixed prompt lengths, sequences
that end early, and batches of 2 to 16 with prompts joining as others leave (selfspec.models.batch)."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import PPD_KEYS, cpu_like_profile, method_config
from selfspec.decoding import Sampling, build_decoder
from selfspec.decoding.vanilla import Vanilla
from selfspec.models.batch import Batch, BatchUnavailable
from test_capture import EVERY_METHOD
from test_families import N_NEW, PROMPT, tiny_family

#: every method, built directly (tests/test_capture.py's, vanilla first), with no speculation gate: in a batch the
#: gate prices a step at its share of the batch's passes, so its choices, and with them a sequence's steps, are
#: the batch's, not its batch-1 run's (``test_the_gate_prices_a_step_in_a_batch_at_its_share_of_each_pass``)
METHODS = [{"name": "vanilla"}, *({"never_slower": False, **m} if m["name"] not in ("ppd",) else m for m in EVERY_METHOD)]


def make(model, method: dict):
    from selfspec.decoding.ppd import PPD
    from selfspec.decoding.tree import random_trees
    from selfspec.models.prompts import PromptTokens

    name = method["name"]
    if name == "vanilla":
        return Vanilla(model)
    if name == "ppd":
        g = torch.Generator().manual_seed(0)
        prompts = PromptTokens(torch.randn(3, 2, model.hidden_size, generator=g) * 0.5)
        return PPD(model, prompts, random_trees(3, 6, 3, random.Random(0)), **PPD_KEYS)
    return build_decoder(method_config(name, **{k: v for k, v in method.items() if k != "name"}), model,
                         profile=cpu_like_profile(model, quantised=True))


def prompts(n: int) -> list[list[int]]:
    """``n`` prompts of mixed lengths (6 to 30 tokens), each repeating a part of itself (drafts get accepted)."""
    rng = random.Random(n)
    out = []
    for i in range(n):
        head = [rng.randrange(256) for _ in range(3 + i % 5)]
        out.append((head + PROMPT)[: 6 + (i * 7) % 25] + head)
    return out


def alone_and_batched(model, method: dict, ps: list[list[int]], size: int, sampling: Sampling, n_new=N_NEW,
                      eos=()):
    """Each prompt decoded alone by a fork of one decoder, and all of them as a batch of ``size`` (each
    slot a fork), every fork starting from the same state."""
    decoder = make(model, method)
    if eos:
        decoder.eos_token_ids = frozenset(eos)
    alone = [decoder.fork().generate(p, n_new, sampling) for p in ps]
    slots = [decoder.fork() for _ in range(size)]
    batch = Batch(model, size)
    batched = batch.run([lambda slot, p=p: slots[slot].generate(p, n_new, sampling, joins=batch) for p in ps])
    return alone, batched, batch


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("method", METHODS, ids=lambda m: m["name"] + ("-" + m["prefill"] if "prefill" in m else "")
                         + ("-" + m["draft_weights"] if "draft_weights" in m else ""))
def test_every_sequence_of_a_batch_decodes_what_it_decodes_alone(family, method):
    """Greedy and sampled, 6 prompts of 6 to 30 tokens in one batch: each sequence's tokens and step
    trace are its single-prompt run's (greedy: vanilla's tokens too), and the batch ran passes of
    several sequences' rows."""
    model = tiny_family(family)
    ps = prompts(6)
    want = [Vanilla(model).generate(p, N_NEW).tokens for p in ps]
    for sampling in (Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=3)):
        alone, batched, batch = alone_and_batched(model, method, ps, len(ps), sampling)
        for a, b in zip(alone, batched):
            assert b.tokens == a.tokens
            assert [t.row() | {"ops": None} for t in b.trace] == [t.row() | {"ops": None} for t in a.trace]
        if sampling.greedy:
            assert [g.tokens for g in batched] == want
        assert max(batch.passes) > 1 and max(batch.rows) > max(len(p) for p in ps[:1])


@pytest.mark.parametrize("method", [{"name": "quant_draft", "max_draft": 4}, {"name": "ngram"},
                                    {"name": "adadecode", "head_kind": "lm_head", "layers": [1, 2], "threshold": 0.3}],
                         ids=lambda m: m["name"])
def test_the_gate_prices_a_step_in_a_batch_at_its_share_of_each_pass(method):
    """The speculation gate in a batch (issue 69): every walk and head product a sequence ran with other
    sequences' rows is marked in its ledger with that pass's rows before the sequence resumes, so the
    gate prices each step at its share of the batch's passes (what it cost the batch, not what it would
    cost alone). Greedy, the tokens stay vanilla's."""
    model = tiny_family("llama")
    ps = prompts(6)
    want = [Vanilla(model).generate(p, N_NEW).tokens for p in ps]
    decoder = make(model, method)
    assert decoder.gate is not None and decoder.gate.deterministic
    slots = [decoder.fork() for _ in range(len(ps))]
    priced = {id(s.gate): [] for s in slots}
    for s in slots:
        record = s.gate.record
        s.gate.record = lambda arm, units, seconds, record=record, seen=priced[id(s.gate)]: (
            seen.append(seconds), record(arm, units, seconds))
    batch = Batch(model, len(ps))
    gens = batch.run([lambda slot, p=p: slots[slot].generate(p, N_NEW, joins=batch) for p in ps])
    assert [g.tokens for g in gens] == want
    passes = {op.rows for op in batch.ops if op.rows > 1}
    shared = 0
    for slot, gen in zip(slots, gens):
        steps = gen.trace[1:]  # the prompt's step is not the gate's
        assert priced[id(slot.gate)] == pytest.approx(
            [slot.gate.price(t.ops, t.source, t.drafted) for t in steps])
        for t in steps:
            for op in t.ops:
                if op.kind in ("L", "H") and op.shared:
                    assert op.shared in passes and op.shared > op.rows
                    shared += 1
    assert shared  # the sequences' steps shared passes, and were priced so


def test_the_shares_of_a_batchs_passes_add_up_to_the_passes():
    """Vanilla, four prompts of one length in a batch of four: every decoding pass holds the four
    sequences' rows at one context, so the sequences' priced steps add up to the batch's own ops."""
    model = tiny_family("llama")
    profile = cpu_like_profile(model)
    ps = [p[:12] for p in prompts(8) if len(p) >= 12][:4]
    assert len(ps) == 4
    batch = Batch(model, 4)
    decoders = [Vanilla(model) for _ in ps]
    gens = batch.run([lambda slot, p=p: decoders[slot].generate(p, N_NEW, joins=batch) for p in ps])
    steps = sum(sum(profile.op(op) for t in g.trace[1:] for op in t.ops) for g in gens)
    decode = [op for op in batch.ops if op.component == "plain"]
    assert max(op.rows for op in decode) == 4
    assert steps == pytest.approx(sum(map(profile.op, decode)))


@pytest.mark.parametrize("size", [2, 3, 16])
@pytest.mark.parametrize("method", [m for m in METHODS if m["name"] in ("draft_verify", "ngram", "ppd", "swift")],
                         ids=lambda m: m["name"])
def test_prompts_join_as_sequences_leave(size, method):
    """Continuous batching: 16 prompts through batches of 2, 3 and 16 slots; some sequences stop at an
    early EOS. Every sequence is vanilla's, cut where vanilla's is."""
    model = tiny_family("llama")
    ps = prompts(16)
    ref = [Vanilla(model).generate(p, N_NEW).tokens for p in ps]
    eos = ref[0][6]  # an early token of the first sequence ends it (and any other that meets it)
    cut = [r[: r.index(eos) + 1] if eos in r else r for r in ref]
    alone, batched, batch = alone_and_batched(model, method, ps, size, Sampling(), eos=[eos])
    assert [g.tokens for g in batched] == cut == [g.tokens for g in alone]
    assert sum(g.stop_reason == "eos" for g in batched) >= 1
    assert max(batch.passes) == size  # every slot in one pass at some step


#: README, "Batches": under sampling a batched sequence equals its batch-1 output where the method carries
#: no state from one example to the next (``Decoder.carried()`` empty): vanilla, and with ``never_slower=false``
#: these configurations
CARRY_NOTHING = [
    {"name": "vanilla"},
    {"name": "draft_verify_static", "skip_attn": [1, 2], "skip_mlp": [2], "never_slower": False},
    {"name": "early_exit", "exit_layer": 1, "max_draft": 3, "never_slower": False},
    {"name": "del", "max_draft": 4, "cost_model": "parameters", "never_slower": False},
    {"name": "adadecode", "head_kind": "lm_head", "layers": [1, 2], "threshold": 0.3, "never_slower": False},
    {"name": "ngram", "draft_schedule": "constant", "never_slower": False},
    {"name": "ngram", "draft_schedule": "adaptive", "never_slower": False},
    {"name": "ppd"},  # built with no gate (``make``)
    {"name": "swift", "context_window": 4, "bayes_interval": 3, "max_draft": 4, "search_state": "example",
     "never_slower": False},
    {"name": "knapspec", "interval": 4, "search_at": 2, "window": 2, "never_slower": False},
    {"name": "clasp", "interval": 4, "never_slower": False},
]
#: ... and not where it carries state: the speculation gate (``never_slower: true``), Draft & Verify's adaptive
#: draft-stop threshold, the n-gram lookup's priced acceptance table, SWIFT's layer search
CARRY_STATE = [
    {"name": "del", "max_draft": 4, "cost_model": "parameters"},
    {"name": "draft_verify", "skip_attn": [1, 2], "skip_mlp": [2], "max_draft": 4, "never_slower": False},
    {"name": "ngram", "draft_schedule": "priced", "never_slower": False},
    {"name": "swift", "context_window": 4, "bayes_interval": 3, "max_draft": 4, "never_slower": False},
]


def _label(method: dict) -> str:
    return "-".join([method["name"], *(str(method[k]) for k in ("draft_schedule", "search_state") if k in method)]
                    + (["gated"] if "never_slower" not in method and method["name"] not in ("vanilla", "ppd") else []))


@pytest.mark.parametrize("method", CARRY_NOTHING + CARRY_STATE, ids=_label)
def test_a_sampled_sequence_of_a_batch_is_its_batch_1_output_where_nothing_carries_over(method):
    """Issue 68 (README, "Batches"): under sampling, 6 prompts decoded by one decoder one after another
    (batch 1, as the evaluation does) and by a batch of 2 slots, each slot a fork taking the next prompt
    as one leaves. Every batched sequence is what its slot, decoding its own prompts one at a time,
    decodes; a method that carries nothing from one example to the next (``carried()`` empty) thus
    decodes the batch-1 sequences. One that carries state starts an example from what its slot learned
    from the slot's own examples, not from every example before it, so its sequences are not the
    batch-1 ones (they keep the distribution: ``test_sampled_batches_keep_the_target_distribution``).
    The speculation gate's choices also depend on the batch (it prices a step at its share of the
    batch's passes), so a gated slot's sequences are not even its own examples decoded one at a time."""
    model = tiny_family("llama")
    ps = prompts(6)
    sampling = Sampling(temperature=0.8, top_p=0.9, seed=3)
    decoder = make(model, method)
    one = decoder.fork()
    alone = [one.generate(p, N_NEW, sampling).tokens for p in ps]
    slots, took = [decoder.fork() for _ in range(2)], [[], []]

    batch = Batch(model, 2)

    def job(slot: int, j: int):
        took[slot].append(j)
        return slots[slot].generate(ps[j], N_NEW, sampling, joins=batch)

    batched = [g.tokens for g in batch.run([lambda slot, j=j: job(slot, j) for j in range(len(ps))])]
    assert all(len(mine) > 1 for mine in took)  # each slot decoded several examples
    for mine in took if decoder.gate is None else ():  # a gate's choices are the batch's (its shares of passes)
        replay = decoder.fork()
        assert [replay.generate(ps[j], N_NEW, sampling).tokens for j in mine] == [batched[j] for j in mine]
    if method in CARRY_NOTHING:
        assert decoder.carried() == [] and batched == alone
    else:
        assert decoder.carried() and batched != alone


def test_a_batch_refuses_a_model_whose_passes_take_static_shapes():
    from selfspec.models import capture

    model = tiny_family("llama").with_passes(capture.StepRunner("static"))
    with pytest.raises(BatchUnavailable, match="model.capture=off for batch_size > 1"):
        Batch(model, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("in_cpp", [True, False], ids=["one-operator", "python"])
def test_batched_rows_are_bit_identical_to_their_own_pass(in_cpp, dtype, monkeypatch):
    """The primitive under every batch: ``run_batched`` over passes of 1 to 20 rows at several cache
    lengths, float32 past 32 rows in all (the linears in blocks), with a skip set and kept states,
    equals each pass run alone (states, kept states and caches); in the one operator
    (``csrc/layer_walk.cpp``, taken for the whole batch) and in the Python walk."""
    from selfspec.models.batch import Walk
    from selfspec.models.layered import LayeredModel, SkipSet

    model = tiny_family("llama")
    if dtype != torch.float32:
        model = LayeredModel(model.hf.to(dtype), name="tiny-llama-bf16", linear_kernel="auto")
    assert model._walk is not None  # the Llama shape takes the operator
    taken = []
    original = LayeredModel._walk_in_cpp
    monkeypatch.setattr(LayeredModel, "_walk_in_cpp",
                        lambda self, walks, *a: taken.append((len(walks), out := original(self, walks, *a))) or out)
    if not in_cpp:
        model._walk = None
    g = torch.Generator().manual_seed(0)
    # (rows, cached positions); a prefill into an empty cache has no mask, which the operator does not take
    shapes = [(1, 10), (4, 3), (20, 17), (9, 1 if in_cpp else 0), (1, 30)]
    for skip in (None, SkipSet.of(attn=[1], mlp=[0, 3])):
        caches, items, alone, kept = [], [], [], []
        with torch.inference_mode():
            for rows, past in shapes:
                ids = torch.randint(0, 256, (1, past + rows), generator=g)
                pair = []
                for _ in range(2):
                    cache = model.new_cache(64)
                    if past:
                        model.forward(ids[:, :past], cache, start=0)
                    pair.append(cache)
                h = model.embed(ids[:, past:])
                rope = model.rope(model.positions(past, rows), h)
                mask = None if rows == 1 else model.causal_mask(rows, past)
                keep = [{1: torch.full((min(rows, 2), h.shape[-1]), float("nan"), dtype=dtype)} for _ in range(2)]
                alone.append(model.walk(h, range(4), pair[0], rope, mask, skip, keep[0]))
                items.append(Walk(h, pair[1], rope, mask, keep[1]))
                caches.append(pair)
                kept.append(keep)
            taken.clear()
            together = model.run_batched(items, range(4), skip)
        assert [n for n, out in taken if out is not None] == ([len(shapes)] if in_cpp else [])
        for a, b, (c1, c2), (k1, k2) in zip(alone, together, caches, kept):
            assert torch.equal(a, b) and torch.equal(k1[1], k2[1]) and not k1[1].isnan().any()
            assert c1.lengths == c2.lengths
            for i in range(4):
                assert all(torch.equal(x, y) for x, y in zip(c1.layer_kv(i), c2.layer_kv(i)))


def test_an_evaluation_in_batches_decodes_what_it_decodes_one_at_a_time(tiny, tmp_path):
    """``batch_size=3`` over 7 examples: every method's rows hold the tokens the batch-1 run decodes
    (greedy, lossless methods: vanilla's), each with its batch; batches.jsonl has one line per wave and
    method with the passes it ran; the summary reports throughput, latency, speedup and the predicted
    batch seconds. A rerun into the directory with another batch size is refused."""
    import json

    from selfspec.config import compose
    from selfspec.evaluation import evaluate
    from selfspec.evaluation.runner import ResumeMismatch

    profile = cpu_like_profile(tiny.model).save(tmp_path / "profile.json")
    common = ["model=tiny-random", "method=draft_verify", "method.skip_attn=[1]", "method.skip_mlp=[2]",
              "compare=[ngram,hf_generate]", "n_examples=7", "max_new_tokens=12", "warmup=1", "progress=false",
              f"profile={profile}"]
    one = evaluate(compose(common), tmp_path / "one", loaded=tiny)
    three = evaluate(compose([*common, "batch_size=3"]), tmp_path / "three", loaded=tiny)

    def tokens(d):
        return {(r["id"], r["method"]): r["tokens"] for r in map(json.loads, (d / "results.jsonl").read_text().splitlines())}

    a, b = tokens(tmp_path / "one"), tokens(tmp_path / "three")
    assert a.keys() == b.keys() and len(a) == 7 * 4
    assert all(b[k] == a[k] for k in a if k[1] != "hf_generate")
    rows = [json.loads(line) for line in (tmp_path / "three" / "results.jsonl").read_text().splitlines()]
    assert {r["batch"]["size"] for r in rows} == {3} and {r["batch"]["wave"] for r in rows} == {0, 1}
    lines = [json.loads(line) for line in (tmp_path / "three" / "batches.jsonl").read_text().splitlines()]
    assert [(x["wave"], x["method"], x["sequences"]) for x in lines] == [
        (w, m, n) for w, n in ((0, 6), (1, 1)) for m in ("vanilla", "draft_verify", "ngram", "hf_generate")]
    assert all(x["ops"] and x["passes"] for x in lines if x["method"] != "hf_generate")
    assert max(int(k) for k in lines[0]["passes"]) == 3  # three sequences' rows in one pass
    s = three["batches"]
    assert three["batch_size"] == 3 and one["batch_size"] == 1 and one["batches"] is None
    for name, r in s.items():
        assert r["size"] == 3 and r["sequences"] == 7 and r["tokens_per_s"] > 0 and r["latency_s"] > 0, name
    assert s["vanilla"]["speedup"] == 1.0 and s["draft_verify"]["predicted_seconds"] > 0
    assert "predicted_seconds" not in s["hf_generate"]  # no passes of ours to price
    with pytest.raises(ResumeMismatch, match="changed: batch_size"):
        evaluate(compose([*common, "batch_size=2"]), tmp_path / "three", loaded=tiny)
    # projected onto another profile, the batches' passes priced there (a GPU's: passes of B·k rows)
    from selfspec.measure.profile import Profile
    from selfspec.project import project_run

    projected = project_run(tmp_path / "three", Profile.load(profile))
    assert projected["vanilla"]["batch_predicted_speedup"] == 1.0
    assert projected["draft_verify"]["batch_predicted_seconds"] == pytest.approx(s["draft_verify"]["predicted_seconds"])
    assert "batch_predicted_speedup" not in projected["hf_generate"]


@pytest.mark.parametrize("method", ["draft_verify", "swift"])
def test_sampled_batches_keep_the_target_distribution(peaked_llama, method):
    """The distribution tests, batched: the first two tokens of 400 sequences, 8 at a time, each with its
    own seed, against p(a)·p(b|a) under top-k 3 sampling (an unbiased sampler: total variation ~0.05)."""
    from conftest import first_two_tokens_tv

    keys = {"draft_verify": dict(skip_attn=[1, 2, 3], skip_mlp=[1, 2], max_draft=4),
            "swift": dict(skip_attn=[1, 2, 3, 4], skip_mlp=[1, 2, 3], optimize=False),
            "early_exit": dict(exit_layer=2, max_draft=3)}[method]
    dec = build_decoder(method_config(method, never_slower=False, **keys), peaked_llama)
    ids = [5, 17, 99, 3, 42, 7, 5, 17]
    assert first_two_tokens_tv(dec, ids, Sampling(temperature=1.0, top_k=3, seed=0), batch=8) < 0.12


def test_an_interrupted_batch_leaves_the_grad_mode_as_it_was():
    """A batch stopped by an exception (here an interrupt as its first sequence finishes) ends its other
    generations inside the batch: left suspended, the garbage collector ended them later and their exits
    left inference mode on for the rest of the process (a training job after it had no gradients)."""
    import gc

    model = tiny_family("llama")
    ps = prompts(3)
    decoders = [Vanilla(model) for _ in range(2)]

    def interrupt(i, gen):
        raise KeyboardInterrupt

    batch = Batch(model, 2)
    with pytest.raises(KeyboardInterrupt):
        batch.run([lambda slot, p=p: decoders[slot].generate(p, N_NEW, joins=batch) for p in ps], done=interrupt)
    gc.collect()
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()

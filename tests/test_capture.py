"""Static-shape (capturable) decoding steps, tested on the CPU with ``capture=static``: the pass a
GPU captures as a CUDA graph, run eagerly. Every decoder must give the tokens it gives on the
dynamic path, and the static pass must write the cache the dynamic pass writes."""

from __future__ import annotations

import pytest
import torch

from conftest import DV_OPTIONS, cpu_like_profile
from selfspec.config.checks import ConfigError
from selfspec.decoding import Sampling
from selfspec.decoding.draft_verify import DraftVerify
from selfspec.decoding.vanilla import Vanilla
from selfspec.models import capture
from selfspec.decoding.branches import branch_groups, branch_pass, sublayer_states
from selfspec.models.layered import LayeredModel, Pass, Rows, SkipSet


@pytest.fixture(scope="module")
def pair():
    """tiny-random twice over the same weights: dynamic passes, and static-shape passes."""
    from selfspec.config import model_config
    from selfspec.models.loading import load_model

    loaded = load_model(model_config("tiny-random"))
    return loaded.model, loaded.model.with_passes(capture.StepRunner("static"))


def test_buckets_and_modes():
    assert [capture.bucket(n) for n in (1, 2, 3, 5, 8, 9, 17, 32, 33, 63, 65, 120, 128, 129, 256)] == \
        [1, 2, 4, 8, 8, 16, 32, 32, 64, 64, 128, 128, 128, 256, 256]
    assert capture.bucket(257) is None
    assert capture.resolve("auto", torch.device("cpu")) == "off"
    assert capture.resolve("static", torch.device("cpu")) == "static"
    with pytest.raises(capture.CaptureUnavailable, match="capture=graphs needs a CUDA device.*static"):
        capture.resolve("graphs", torch.device("cpu"))


def test_graphs_on_cpu_refused_before_loading():
    from selfspec.config import model_config
    from selfspec.models.loading import check_model_config

    cfg = model_config("tiny-random")
    cfg.capture = "graphs"
    with pytest.raises(ConfigError, match=r"model.capture=graphs is not allowed: needs a CUDA device"):
        check_model_config(cfg)
    cfg.capture = "always"
    with pytest.raises(ConfigError, match=r"model.capture=always is not allowed: must be one of auto, graphs, static, off"):
        check_model_config(cfg)


@pytest.mark.parametrize("k", [1, 3, 8, 13])
def test_static_pass_writes_the_cache_the_dynamic_pass_writes(pair, k):
    dyn, static = pair
    ids = torch.randint(0, dyn.vocab_size, (1, 50), generator=torch.Generator().manual_seed(k))
    caches = []
    with torch.inference_mode():
        for m in (dyn, static):
            cache = m.new_cache(64)
            m.forward(ids[:, :30], cache, start=0)  # prefill: longer than a bucket, dynamic
            h = m.forward(ids[:, 30:30 + k], cache)
            caches.append((cache, h))
        assert static.steps.routed >= 1
    (c1, h1), (c2, h2) = caches
    assert h2.shape == h1.shape == (1, k, dyn.hidden_size)
    torch.testing.assert_close(h2, h1, rtol=1e-5, atol=1e-5)
    assert c2.lengths == c1.lengths == [30 + k] * dyn.num_layers
    for i in range(dyn.num_layers):
        for a, b in zip(c1.layer_kv(i), c2.layer_kv(i)):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_passes_outside_the_static_shapes_take_the_dynamic_path(pair):
    """A prefill longer than the largest bucket takes the dynamic path and is not missed; a decoding
    pass (after cached positions) that does is counted, whatever its size, by kind and width."""
    _, static = pair
    cache = static.new_cache(300)  # room for 300 positions (+ the padding, up to the model's context)
    ids = torch.zeros(1, 300, dtype=torch.long)
    steps = static.steps
    with torch.inference_mode():
        before, missed = steps.routed, steps.missed
        static.forward(ids[:, :270], cache, start=0)  # a prefill of 270 > the largest bucket: dynamic, not missed
        assert steps.routed == before and steps.missed == missed
        static.forward(ids[:, :20], cache)  # 270 + 32 <= the cache with its padding: routed
        assert steps.routed == before + 1 and cache.lengths[0] == 290
        static.forward(ids[:, :5], cache)  # 290 + 8
        assert steps.routed == before + 2
        cache.truncate(280)
        static.forward(ids[:, :3], cache, start=cache.length(0))  # 280 + 4
        assert steps.routed == before + 3
        static.forward(ids[:, :257], cache)  # a decoding pass wider than the largest bucket: missed
        assert steps.routed == before + 3 and steps.missed == missed + 1
        assert steps.missed_kinds["chain 257"] == 1
    # outside inference mode (training) nothing is routed
    with torch.no_grad():
        static.forward(ids[:, :1], static.new_cache(8), start=0)
    assert steps.routed == before + 3


def test_decoders_give_the_same_tokens_static_and_dynamic(pair, prompt_ids):
    dyn, static = pair
    for sampling in (Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=3)):
        ref = Vanilla(dyn).generate(prompt_ids, 40, sampling).tokens
        assert Vanilla(static).generate(prompt_ids, 40, sampling).tokens == ref
        skip = SkipSet.of(attn=[1], mlp=[2])
        for m in (dyn, static):
            out = DraftVerify(m, skip, DV_OPTIONS).generate(prompt_ids, 40, sampling)
            if sampling.greedy:
                assert out.tokens == ref
        assert DraftVerify(static, skip, DV_OPTIONS).generate(prompt_ids, 40, sampling).tokens == \
            DraftVerify(dyn, skip, DV_OPTIONS).generate(prompt_ids, 40, sampling).tokens


@pytest.mark.parametrize("nodes", [16, 24, 48, 64])
def test_ppd_trees_of_the_papers_sizes_take_the_static_shapes(pair, prompt_ids, nodes):
    """Issue 38: PPD's trees at the paper's sizes (tree lengths 60-120) were wider than the largest
    bucket (32 rows), took the dynamic path, and nothing counted them (``missed`` counted passes of
    a bucket's size only), so a GPU ran them eagerly at 0.21-0.33x vanilla with "none missed". Now
    every tree pass of up to 256 rows routes: the paper's sizes and the ppd_tree job's largest (48
    candidates; 3 prompt tokens of 2 tokens each here: passes of up to 203 rows). Each wider one is
    counted in ``missed`` with its width (64 nodes: 257-287 rows), and the tokens are the dynamic
    path's, greedy (vanilla's) and sampled."""
    import random

    from conftest import PPD_KEYS
    from selfspec.decoding.ppd import PPD
    from selfspec.decoding.tree import random_trees
    from selfspec.models.prompts import PromptTokens

    dyn, static = pair
    g = torch.Generator().manual_seed(0)
    prompts = PromptTokens(torch.randn(3, 2, dyn.hidden_size, generator=g) * 0.5)
    trees = random_trees(3, nodes, 10, random.Random(nodes))
    widths = []
    real = static.steps.run

    def watch(model, p, x, cache, start, keep=None):
        if p.rows.kind == "tree":
            widths.append(x.shape[1])
        return real(model, p, x, cache, start, keep)

    static.steps.run = watch
    try:
        missed, routed = static.steps.missed, static.steps.kinds["tree"]
        ref = Vanilla(dyn).generate(prompt_ids, 24).tokens
        for sampling in (Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=3)):
            want = PPD(dyn, prompts, trees, **PPD_KEYS).generate(prompt_ids, 24, sampling)
            got = PPD(static, prompts, trees, **PPD_KEYS).generate(prompt_ids, 24, sampling)
            assert got.tokens == want.tokens
            if sampling.greedy:
                assert got.tokens == ref
    finally:
        del static.steps.run
    wide = [w for w in widths if w > capture.BUCKETS[-1]]
    assert max(widths) > 32, widths  # the paper's sizes: wider than the old largest bucket
    assert bool(wide) == (nodes == 64), widths
    assert static.steps.missed - missed == len(wide), static.steps.missed_kinds
    assert static.steps.kinds["tree"] - routed == len(widths) - len(wide)


def test_an_evaluation_records_the_passes_that_went_eager(tmp_path, caplog):
    """A run's summary says what the static shapes took and which decoding passes went eager (by
    kind and width), and warns when any did: under capture=graphs those ran without a graph."""
    from selfspec.config import compose
    from selfspec.evaluation import evaluate

    cfg = compose(["model=tiny-random", "model.capture=static", "n_examples=1", "max_new_tokens=6", "warmup=0",
                   "progress=false", "method=vanilla"])
    summary = evaluate(cfg, tmp_path)
    c = summary["capture"]
    assert c["mode"] == "static" and c["routed"] > 0 and c["kinds"]["chain"] > 0 and c["missed"] == 0
    assert "took the eager path" not in caplog.text
    from types import SimpleNamespace

    from selfspec.evaluation.loop import _capture_summary

    steps = capture.StepRunner("static")
    steps.missed, steps.missed_kinds["tree 131"] = 3, 3
    assert _capture_summary(SimpleNamespace(steps=steps, capture="static"), {})["missed_kinds"] == {"tree 131": 3}
    assert "capture=static: 3 decoding passes took the eager path (by kind and rows: {'tree 131': 3})" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_give_the_dynamic_tokens_and_capture_once(prompt_ids):
    from selfspec.config import model_config
    from selfspec.models.loading import load_model

    cfg = model_config("tiny-random")
    cfg.device, cfg.capture = "cuda", "off"
    dyn = load_model(cfg).model
    graphs = LayeredModel(dyn.hf, name="tiny-graphs", passes=capture.StepRunner("graphs"))
    assert graphs.capture == "graphs"
    skip = SkipSet.of(attn=[1], mlp=[2])
    for sampling in (Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=3)):
        for make in (Vanilla, lambda m: DraftVerify(m, skip, DV_OPTIONS)):
            ref = make(dyn).generate(prompt_ids, 40, sampling).tokens
            assert make(graphs).generate(prompt_ids, 40, sampling).tokens == ref
    captured = graphs.steps.captured
    assert captured > 0 and graphs.steps.routed > captured
    Vanilla(graphs).generate(prompt_ids, 40)  # the pooled cache: replayed, not captured again
    assert graphs.steps.captured == captured


def _static_twin(model: LayeredModel) -> LayeredModel:
    return model.with_passes(capture.StepRunner("static"))


#: every self-drafting method with the passes it adds: a chain with a skip set (Draft & Verify),
#: partial-layer passes keeping exit-query states (early exit, DEL), per-layer passes of owed
#: positions (AdaDecode), a tree (PPD), context drafts (n-gram)
EVERY_METHOD = [
    {"name": "draft_verify", "skip_attn": [1, 2], "skip_mlp": [2], "max_draft": 4, "never_slower": False},
    {"name": "early_exit", "exit_layer": 1, "max_draft": 3, "never_slower": False},
    {"name": "early_exit", "exit_layer": 1, "max_draft": 3, "never_slower": False, "prefill": "draft"},
    {"name": "del", "max_draft": 4, "cost_model": "parameters", "never_slower": False},
    {"name": "adadecode", "head_kind": "lm_head", "layers": [1, 2], "threshold": 0.3},
    {"name": "ngram", "never_slower": False},
    {"name": "ppd"},
    # searching while decoding: the drafts and verifications take the static shapes, and so do
    # KnapSpec's sublayer states, the searches' branch passes (test_the_searches_passes_take_static_shapes)
    # and SWIFT's matchness passes (scratch passes reading the prompt's cache only)
    {"name": "swift", "context_window": 4, "bayes_interval": 3, "max_draft": 4, "never_slower": False},
    {"name": "knapspec", "interval": 4, "search_at": 2, "window": 2, "never_slower": False},
    {"name": "clasp", "interval": 4, "never_slower": False},
    # drafts over a quantised copy of the weights (issue 69): on their own, and as a skip-set draft's weights
    {"name": "quant_draft", "max_draft": 4, "never_slower": False},
    {"name": "quant_draft", "draft_weights": "int4", "max_draft": 4, "never_slower": False},
    {"name": "draft_verify", "skip_attn": [1], "skip_mlp": [2], "max_draft": 4, "never_slower": False,
     "draft_weights": "int8"},
    {"name": "swift", "context_window": 4, "bayes_interval": 3, "max_draft": 4, "never_slower": False,
     "draft_weights": "int8"},
]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
@pytest.mark.parametrize("method", EVERY_METHOD, ids=lambda m: m["name"] + ("-" + m["prefill"] if "prefill" in m else "")
                         + ("-" + m["draft_weights"] if "draft_weights" in m else ""))
def test_every_method_gives_the_dynamic_tokens_with_every_pass_static(family, method):
    """Every pass of every method at most a bucket long takes the static shape (trees, partial
    layers, kept states included: ``missed`` stays 0), and the tokens are the dynamic path's, greedy
    (vanilla's too) and sampled. Gemma 3's sliding window (8) is shorter than the generation."""
    import random

    from conftest import PPD_KEYS, method_config
    from selfspec.decoding import build_decoder
    from selfspec.decoding.ppd import PPD
    from selfspec.decoding.tree import random_trees
    from selfspec.models.prompts import PromptTokens
    from test_families import N_NEW, PROMPT, tiny_family

    dyn = tiny_family(family)
    static = _static_twin(dyn)
    name = method["name"]

    def make(m):
        if name == "ppd":
            g = torch.Generator().manual_seed(0)
            prompts = PromptTokens(torch.randn(3, 2, m.hidden_size, generator=g) * 0.5)
            return PPD(m, prompts, random_trees(3, 6, 3, random.Random(0)), **PPD_KEYS)
        return build_decoder(method_config(name, **{k: v for k, v in method.items() if k != "name"}), m,
                             profile=cpu_like_profile(m))

    ids = PROMPT + PROMPT
    ref = Vanilla(dyn).generate(ids, N_NEW).tokens
    for sampling in (Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=3)):
        want = make(dyn).generate(ids, N_NEW, sampling)
        got = make(static).generate(ids, N_NEW, sampling)
        assert got.tokens == want.tokens
        if sampling.greedy:
            assert got.tokens == ref
    assert static.steps.missed == 0
    kinds = static.steps.kinds
    expected = {"draft_verify": "chain", "early_exit": "chain/partial", "del": "chain+keep/partial",
                "adadecode": "chain/partial", "ngram": "chain", "ppd": "tree", "swift": "tree", "knapspec": "chain",
                "clasp": "chain", "quant_draft": "chain"}[name]
    assert kinds[expected] > 0, kinds
    if name in ("knapspec", "clasp"):  # the searches' branch passes; KnapSpec's sublayer states, a sublayer each
        assert kinds["scratch/partial"] > 0 and (name == "clasp" or kinds["chain/partial"] > 0), kinds
    if name == "swift":  # its matchness passes, a layer at a time
        assert kinds["scratch/partial"] > 0 and kinds["scratch"] == 0, kinds


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_the_searches_passes_take_static_shapes(family):
    """KnapSpec's sublayer states (each sublayer a one-layer pass: the attention writes the layer's K/V,
    the MLP touches no cache) and the searches' branch passes (scratch passes: their K/V go past the
    cache's positions, its lengths stay, the rows see the first ``context`` positions and their own
    branch) take static shapes and give the dynamic path's states and cache (to float rounding: the
    static attention reads the whole buffer under a mask), with nothing missed and nothing recorded
    as eager. The window's own K/V, past the branches' context, are left as they were."""
    from selfspec.models.ledger import Ledger
    from test_families import PROMPT, tiny_family

    dyn = tiny_family(family)
    static = _static_twin(dyn)
    ids = torch.tensor([PROMPT + PROMPT])
    n, L = len(PROMPT), dyn.num_layers
    got = {}
    with torch.inference_mode():
        for m in (dyn, static):
            cache = m.new_cache(64)
            m.forward(ids[:, :n], cache, start=0)
            states = sublayer_states(m, ids[:, n:], cache, n)
            x = torch.stack([states[3][:4], states[5][:4]])  # two candidate states of 4 tokens
            ledger = Ledger(torch.device("cpu"))
            context = n + 2  # the branches see the prompt and 2 of the window's tokens
            out = [branch_pass(m, x, 1, block, cache, context, ledger) for block in ("mlp", "attn", "layer")]
            kv = [cache.layer_kv(i)[0][:, :, :cache.length(i)].clone() for i in range(L)]
            assert all(cache.length(i) == 2 * n for i in range(L))
            got[m] = (states, out, kv, ledger.ops)
    for a, b in zip(got[dyn][:3], got[static][:3]):
        for u, v in zip(a, b):
            torch.testing.assert_close(u, v, atol=1e-5, rtol=1e-5)
    assert static.steps.missed == 0
    assert static.steps.kinds["chain/partial"] == 2 * L and static.steps.kinds["scratch/partial"] == 3
    # the three walks merge into one op: 8 rows, 2 attention and 2 MLP sublayers, captured
    assert [(op.rows, op.attention, op.mlp, op.eager) for op in got[static][3]] == [(8, 2, 2, False)]
    # the same walks, the static ones with what they ran: the 8-row bucket over the cache's whole buffer
    assert got[dyn][3] == [op._replace(padded=0, span=0) for op in got[static][3]]
    assert [(op.padded, op.span) for op in got[static][3]] == [(8, static.new_cache(64).max_length)]


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_scratch_pass_runs_a_layer_at_a_time_so_new_skip_sets_reuse_its_passes(family):
    """SWIFT's matchness (a scratch pass of the whole model under a candidate skip set, a new set on
    almost every search iteration): the static runner takes it one layer at a time, keyed by that
    layer's part of the set, so a set whose layer parts were all seen builds (under ``graphs``:
    captures) no pass, and none is built for a single use of the whole set. The states equal the
    eager pass's (SWIFT's own, reading the cache's first ``context`` positions); the cache's lengths
    stay, and the ledger records one walk, as for the eager pass."""
    from selfspec.models.cache import Appended
    from selfspec.models.layered import SkipSet
    from selfspec.models.ledger import Ledger
    from test_families import PROMPT, tiny_family

    dyn = tiny_family(family)
    static = _static_twin(dyn)
    ids = torch.tensor([PROMPT + PROMPT])
    n, L = len(PROMPT), dyn.num_layers
    rows = ids[:, n:n + 7]
    k = rows.shape[1]
    causal = (torch.arange(k), torch.ones(k, k, dtype=torch.bool).tril())
    sets = [SkipSet.of(attn=[1], mlp=[2]), SkipSet.of(attn=[2], mlp=[1]), SkipSet.of(attn=[1, 2]),
            SkipSet.of(attn=[1, 2], mlp=[1, 2])]  # the third's parts are the first two's; the fourth leaves 1, 2 out
    steps = static.steps
    with torch.inference_mode():
        caches = {}
        for m in (dyn, static):
            caches[m] = m.new_cache(64)
            m.forward(ids, caches[m], start=0)
        for i, skip in enumerate(sets):
            cache = caches[dyn]
            h = dyn.embed(rows)
            want = dyn.run_layers(h, range(L), Appended(cache, n), dyn.rope(dyn.positions(n, k), h),
                                  dyn.causal_mask(k, n), skip)
            built = steps.built
            ledger = Ledger(torch.device("cpu"))
            got = static.forward(static.embed(rows), caches[static], Pass(range(L), skip, Rows.scratch(n, *causal)),
                                 ledger=ledger)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            new = steps.built - built
            # a pass per layer part not seen before: all 4 layers first, then layers 1 and 2 again, then none
            assert new == [L, 2, 0, 0][i], (i, new)
            assert [(op.rows, op.attention, op.mlp, op.eager) for op in ledger.ops] == [
                (k, L - len(skip.attn), L - len(skip.mlp), False)]
            assert all(caches[static].length(j) == 2 * n for j in range(L))
    assert steps.missed == 0 and steps.kinds["scratch"] == 0
    assert steps.kinds["scratch/partial"] == 4 + 4 + 4 + 2  # the fourth set runs layers 0 and 3


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_branch_pass_wider_than_a_bucket_runs_in_captured_groups(family):
    """KnapSpec's branch passes reach 1,000 rows and more (its DP's states of a window of tokens): a
    capturing model runs them in groups of whole branches of at most 256 rows, each a static scratch
    pass, instead of one eager pass. The states equal the one dynamic pass's (to float rounding), the
    cache is untouched, nothing is missed, and both record the groups' walks in the ledger (a CPU's
    trace prices what a GPU runs)."""
    from selfspec.models.ledger import Ledger
    from test_families import PROMPT, tiny_family

    dyn = tiny_family(family, max_position_embeddings=512)  # room after the prompt for a 256-row pass
    static = _static_twin(dyn)
    ids = torch.tensor([PROMPT + PROMPT])
    n = len(PROMPT)
    b, t = 40, 8  # 320 rows: two groups of 20 branches (160 rows each: one bucket, one graph)
    assert branch_groups(b, t) == [(0, 20), (20, 20)]
    assert branch_groups(70, 11) == [(0, 18), (18, 18), (36, 17), (53, 17)] and branch_groups(3, 300) == [
        (0, 1), (1, 1), (2, 1)]
    x = torch.randn(b, t, dyn.hidden_size, generator=torch.Generator().manual_seed(0)).to(dyn.dtype)
    got = {}
    with torch.inference_mode():
        for m in (dyn, static):
            cache = m.new_cache(64)
            m.forward(ids, cache, start=0)
            ledger = Ledger(torch.device("cpu"))
            out = [branch_pass(m, x, 1, block, cache, n + 3, ledger) for block in ("mlp", "attn", "layer")]
            assert all(cache.length(i) == 2 * n for i in range(m.num_layers))
            got[m] = (out, [(op.rows, op.attention, op.mlp, op.context, op.eager) for op in ledger.ops])
    for u, v in zip(got[dyn][0], got[static][0]):
        torch.testing.assert_close(u, v, atol=1e-5, rtol=1e-5)
    assert static.steps.missed == 0 and static.steps.kinds["scratch/partial"] == 3 * 2
    assert static.steps.routed_rows["scratch/partial 160"] == 6
    assert got[dyn][1] == got[static][1]
    assert {rows for rows, *_ in got[dyn][1]} == {160} and not any(op[-1] for op in got[dyn][1])


def test_sublayer_states_of_any_draft_length_share_one_graph_per_sublayer():
    """KnapSpec's window steps verify drafts of 1 to ``max_draft`` tokens with sublayer states (2L
    one-layer passes): given the widest (``rows``), a capturing model runs every one in that
    width's bucket, so drafts of other lengths build no pass, and the states equal the dynamic
    path's. Without ``rows`` each length's bucket builds its own."""
    from test_families import PROMPT, tiny_family

    dyn = tiny_family("llama")
    static = _static_twin(dyn)
    L, n = dyn.num_layers, len(PROMPT)
    steps = static.steps
    with torch.inference_mode():
        caches = {m: m.new_cache(64) for m in (dyn, static)}
        for m, cache in caches.items():
            m.forward(torch.tensor([PROMPT]), cache, start=0)
        built = []
        for k, rows in ((2, 11), (5, 11), (9, 11), (3, None), (6, None)):
            ids = torch.tensor([PROMPT[:k]])
            before = steps.built
            widest = {} if rows is None else {"rows": rows}
            want = sublayer_states(dyn, ids, caches[dyn], n, **widest)
            got = sublayer_states(static, ids, caches[static], n, **widest)
            for u, v in zip(want, got):
                torch.testing.assert_close(u, v, atol=1e-5, rtol=1e-5)
            built.append(steps.built - before)
            for cache in caches.values():
                cache.truncate(n)
    # rows=11: bucket 16 for 2, 5 and 9 tokens; then 3 tokens in bucket 4 and 6 in bucket 8
    assert built == [2 * L, 0, 0, 2 * L, 2 * L] and steps.missed == 0

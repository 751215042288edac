"""Quantised self-drafts (issue 69): the copy's formats, the kernel against an independent reference, a pass
over the copy as a value of the runtime, the methods lossless (greedy and in distribution), their drafts
reading the copy, and their prices in a cost profile."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cpu_like_profile, method_config
from selfspec.decoding import Sampling, build_decoder
from selfspec.decoding.vanilla import Vanilla
from selfspec.models import quantised
from selfspec.models.passes import Pass, SkipSet

#: a block's scale over its largest magnitude (int8, int4) or over its range (q4_1)
LEVELS = {"int8": 127, "int4": 7, "q4_1": 15}


def _rounded_x(x: torch.Tensor, two_terms: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` rounded per block of 32 as the kernel rounds it: ``(integers [M, K/32, 32], scale [M, K/32])``,
    x as rounded being their product. One term: s = amax/127, q = v / s half to even. Two terms: also the
    remainder v - s q (one rounding, as an FMA) in steps of s/128, the integers 128 q + q2 and the scale s/128."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    s = xb.abs().amax(-1, keepdim=True) / 127
    nonzero = s > 0
    q = torch.where(nonzero, torch.round(xb / torch.where(nonzero, s, 1)), 0)
    if not two_terms:
        return q.double(), s.squeeze(-1)
    rest = (xb.double() - s.double() * q.double()).float()  # exact in float64, then one rounding
    s2 = s / 128
    q2 = torch.where(nonzero, torch.round(rest / torch.where(nonzero, s2, 1)), 0)
    return 128 * q.double() + q2.double(), s2.squeeze(-1)


def _reference(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, written independently from the packed bytes: each row of ``x`` rounded per
    block of 32 (in two terms for int8 and q4_1, :func:`_rounded_x`), each block's integer dot product with the
    weight's stored integers exact, times the product of both scales (float32), plus, for q4_1, the block's
    minimum times x's block sum as rounded (float32: its scale times the exact integer sum), summed over the
    blocks in float64."""
    k = x.shape[-1]
    n, blocks = packed.shape[0], k // 32
    raw = packed.view(torch.uint8).reshape(n, -1)
    fmt = {torch.int8: "int8", torch.uint8: "int4", torch.int16: "q4_1"}[packed.dtype]
    values = k if fmt == "int8" else k // 2
    floats = raw[:, values:].contiguous().view(torch.float32).reshape(n, -1, blocks)  # scales, then minimums
    if fmt == "int8":
        qw = raw[:, :k].view(torch.int8).double().reshape(n, blocks, 32)
    else:
        # blocks in pairs, 32 bytes each (the first block's values low, the second's high); an odd last block in
        # 16 bytes (its values 0-15 low, 16-31 high)
        nib = raw[:, :values].long()
        paired = blocks - blocks % 2
        pairs = nib[:, :16 * paired].reshape(n, paired // 2, 32)
        qw = torch.stack([pairs & 15, pairs >> 4], 2).reshape(n, paired, 32)
        if blocks % 2:
            tail = nib[:, 16 * paired:]
            qw = torch.cat([qw, torch.cat([tail & 15, tail >> 4], -1).unsqueeze(1)], 1)
        qw = qw.double() - (8 if fmt == "int4" else 0)
    qx, sx = _rounded_x(x, two_terms=fmt != "int4")
    dots = torch.einsum("mbk,nbk->mnb", qx, qw)
    y = (dots * (floats[:, 0].unsqueeze(0) * sx.unsqueeze(1)).double()).sum(-1)
    if fmt == "q4_1":
        block_sums = (sx * qx.sum(-1).float()).double()  # [M, blocks]: float32 products of exact integers
        y = y + block_sums @ floats[:, 1].double().T
    return y


@pytest.mark.parametrize("fmt", quantised.FORMATS)
def test_a_copy_rounds_each_block_of_32_to_its_own_scale(fmt):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g)
    w[3, :32] = 0  # a block of zeros keeps a zero scale
    packed = quantised.quantise(w, fmt)
    assert packed.dtype == {"int8": torch.int8, "int4": torch.uint8, "q4_1": torch.int16}[fmt]
    assert packed.numel() * packed.element_size() == quantised.packed_bytes(fmt, 48, 96)
    back = quantised.dequantise(packed, 96)
    blocks = w.reshape(48, 3, 32)
    spread = blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True) if fmt == "q4_1" else blocks.abs().amax(-1, keepdim=True)
    scale = spread / LEVELS[fmt]
    err = (back - w).reshape(48, 3, 32).abs()
    assert torch.all(err <= scale / 2 + 1e-6) and torch.all(back[3, :32] == 0)
    assert quantised.weights_format(packed) == fmt and quantised.weights_format(w) is None
    with pytest.raises(ValueError, match="blocks of 32"):
        quantised.quantise(torch.randn(4, 40), fmt)


def test_a_q4_1_copy_holds_blocks_on_sixteen_even_levels_exactly():
    """The blocks a Q4_1 file holds (a float16 scale and minimum, 16 levels from the minimum to the maximum,
    dequantised as scale times level plus minimum in float32) are the copy's own, bit for bit: a draft over
    the copy of such a target reads its very weights."""
    g = torch.Generator().manual_seed(3)
    levels = torch.randint(0, 16, (40, 6, 32), generator=g)
    levels[..., 0], levels[..., 1] = 0, 15  # the file's rounding puts a block's minimum at 0 and maximum at 15
    scale = (torch.rand(40, 6, 1, generator=g) * 0.01 + 1e-4).half().float()
    low = (-torch.rand(40, 6, 1, generator=g) * 0.1).half().float()
    w = (scale * levels.float() + low).reshape(40, 192)
    assert torch.equal(quantised.dequantise(quantised.quantise(w, "q4_1"), 192), w)
    off_grid = w.clone()
    off_grid[0, 5] += 1e-3 * scale[0, 0, 0]  # one value between two levels: no longer held exactly
    assert not torch.equal(quantised.dequantise(quantised.quantise(off_grid, "q4_1"), 192), off_grid)


def test_a_q4_1_copy_holds_q4_k_blocks_whose_levels_span_fewer_steps():
    """llama.cpp's Q4_K stores a block as ``d sc q - dmin m`` (float16 ``d``, ``dmin``, 6-bit ``sc``, ``m``, as
    gguf-py dequantises it in float32), its levels ``q`` seldom reaching both 0 and 15: the copy finds the grid
    such a block lies on and holds it exactly, where the min/max fit (15 steps from minimum to maximum) would
    round it again. Blocks on no grid of at most 15 steps keep the min/max fit."""
    g = torch.Generator().manual_seed(5)
    n, blocks = 64, 8
    top = torch.randint(1, 15, (n, blocks, 1), generator=g)  # the largest level: 1 to 14 steps above the lowest
    bottom = torch.randint(0, 2, (n, blocks, 1), generator=g)
    levels = bottom + (torch.rand(n, blocks, 32, generator=g) * (top + 1)).floor().clamp(max=top)
    levels[..., 0], levels[..., 1] = bottom[..., 0], (bottom + top)[..., 0]
    d = (torch.rand(n, blocks, 1, generator=g) * 1e-3 + 1e-5).half().float()
    dmin = (torch.rand(n, blocks, 1, generator=g) * 1e-3).half().float()
    sc, m = (torch.randint(1, 64, (n, blocks, 1), generator=g).float() for _ in range(2))
    w = ((d * sc) * levels.float() - dmin * m).reshape(n, blocks * 32)
    held = quantised.dequantise(quantised.quantise(w, "q4_1"), blocks * 32)
    assert torch.equal(held, w)
    # the min/max fit alone (scale = range / 15) holds few of these blocks: the grid search is what holds them
    wb = w.reshape(n, blocks, 32)
    assert (_min_max_fit(wb) == wb).all(-1).float().mean() < 0.5
    # random blocks lie on no such grid: their fit is the min/max one, as before
    r = torch.randn(16, 96, generator=g)
    expect = _min_max_fit(r.reshape(16, 3, 32)).reshape(16, 96)
    assert torch.equal(quantised.dequantise(quantised.quantise(r, "q4_1"), 96), expect)


def _min_max_fit(blocks: torch.Tensor) -> torch.Tensor:
    """Blocks ``[..., 32]`` on 15 even steps from each one's minimum to its maximum (the min/max fit)."""
    low = blocks.amin(-1, keepdim=True)
    step = (blocks.amax(-1, keepdim=True) - low) / 15
    return ((blocks - low) / step).round().clamp(0, 15) * step + low


@pytest.mark.parametrize("fmt", quantised.FORMATS)
@pytest.mark.parametrize("k,n", [(64, 48), (96, 33), (576, 97), (1536, 64)])
def test_the_kernel_is_the_integer_dot_product_of_rows_rounded_per_block(fmt, k, n):
    """Against the reference, and every row as its own one-row call computes it, bit for bit, on one
    thread or two and call after call: a draft is deterministic, and a batch's rows are their own. The
    reference's one-term rounding of x is far from the kernel's two for int8 and q4_1 (so the test tells them apart)."""
    from selfspec.models import kernels

    kernels.load()
    g = torch.Generator().manual_seed(k + n)
    packed = quantised.quantise(torch.randn(n, k, generator=g) * 0.05, fmt)
    x = torch.randn(9, k, generator=g)
    x[2, 32:64] = 0
    y = torch.ops.selfspec.quant_linear(x, packed)
    ref = _reference(x, packed)
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    if fmt != "int4":  # x in two terms: the reference with one would be off by far more than the tolerance
        one_term = quantised.dequantise(packed, k).double() @ (lambda q, s: (q * s.unsqueeze(-1).double()).reshape(9, k))(
            *_rounded_x(x, two_terms=False)).T
        assert not torch.allclose(y.double(), one_term.T, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(torch.cat([torch.ops.selfspec.quant_linear(x[i:i + 1], packed) for i in range(9)]), y)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.ops.selfspec.quant_linear(x, packed), y)
    finally:
        torch.set_num_threads(threads)
    # a bfloat16 target's draft: bf16 in and out, read and written by the kernel itself, the bits of the float32
    # call on the same values rounded to bfloat16 (round to nearest even, as torch converts)
    half = torch.ops.selfspec.quant_linear(x.bfloat16(), packed)
    assert half.dtype == torch.bfloat16 and torch.allclose(half.float(), y, rtol=0.05, atol=0.05 * y.abs().max().item())
    assert torch.equal(half, torch.ops.selfspec.quant_linear(x.bfloat16().float(), packed).bfloat16())
    with pytest.raises(RuntimeError, match="does not hold"):
        torch.ops.selfspec.quant_linear(x[:, :32], packed)


@pytest.mark.parametrize("fmt", quantised.FORMATS)
def test_the_kernels_vnni_path_gives_its_avx2_paths_bits(fmt):
    """Where the CPU has AVX-512-VNNI the kernel takes vpdpbusd for each block's integer sums; the AVX2 path
    (``skinny_isa("avx2")`` forces it) sums the same integers in two instructions. A draft is then the same
    on every CPU: both paths, bit for bit, at every row count of a pass and on shapes with a remainder of
    weight rows."""
    from selfspec.models import kernels

    kernels.load()
    ops = torch.ops.selfspec
    if ops.quant_path() != "avx512_vnni":
        pytest.skip(f"this CPU's quantised kernel takes the {ops.quant_path()} path only (no AVX-512-VNNI)")
    g = torch.Generator().manual_seed(7)
    try:
        for k, n in [(576, 1538), (1536, 97)]:
            packed = quantised.quantise(torch.randn(n, k, generator=g) * 0.05, fmt)
            for m in (1, 3, 8):
                x = torch.randn(m, k, generator=g) * 3
                vnni = ops.quant_linear(x, packed)
                ops.skinny_isa("avx2")
                assert ops.quant_path() == "avx2"
                assert torch.equal(ops.quant_linear(x, packed), vnni), (k, n, m)
                ops.skinny_isa("auto")
    finally:
        ops.skinny_isa("auto")


def test_the_draft_benchmark_times_and_compares_the_kernels_paths():
    """``scripts/bench_quant_drafts.py --paths``: each copy's pass on each path this CPU has, the paths' logits
    compared bit for bit (one path, said so, where the CPU lacks AVX-512-VNNI)."""
    from selfspec.models import kernels

    kernels.load()
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_quant_drafts.py"
    proc = subprocess.run([sys.executable, str(script), "--model", "tiny-random", "--tokens", "4", "--rounds", "1",
                           "--context", "16", "--no-float-x", "--paths"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("weights")) + 1:]
    rows = [line.split()[0] for line in table if line.strip() and not line.startswith(" ")]
    if torch.ops.selfspec.quant_path() == "avx512_vnni":
        assert rows == ["target"] + [f"{f}@{p}" for f in quantised.FORMATS for p in ("avx2", "avx512_vnni")], proc.stdout
        assert proc.stdout.count("the paths' logits are the same bits") == len(quantised.FORMATS), proc.stdout
    else:
        assert rows == ["target", *quantised.FORMATS] and "has one path" in proc.stdout, proc.stdout


def test_a_pass_over_the_copy_is_a_value_and_leaves_the_target_as_it_was(tiny, monkeypatch):
    """``Pass(weights="int8")`` reads the copy (other states than the target's pass), the one-operator walk
    and the Python walk give it the same bits, and making the copy changes no weight of the target."""
    m = tiny.model
    before = {k: v.clone() for k, v in m.hf.state_dict().items()}
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    with torch.inference_mode():
        target = m.forward(ids, m.new_cache(16))
        draft = m.forward(ids, m.new_cache(16), Pass(weights="int8"))
        monkeypatch.setattr(type(m), "_walk_in_cpp", lambda self, *a, **k: None)
        python = m.forward(ids, m.new_cache(16), Pass(weights="int8"))
    assert not torch.equal(draft, target) and torch.allclose(draft, target, atol=0.1)
    assert torch.equal(python, draft)
    assert all(torch.equal(before[k], v) for k, v in m.hf.state_dict().items())
    fam = m.family
    target = [w for w, _, _ in m._qkv + m._gate_up] + [fam.lm_head.weight] + [
        fam.out_proj(i).weight for i in range(m.num_layers)] + [fam.down_proj(i).weight for i in range(m.num_layers)]
    assert "int8" in m.weight_sets  # (a profile measured earlier on this shared model made int4 too)
    assert m.weight_sets["int8"].nbytes == sum(w.numel() for w in target) * 9 // 8  # 8 bits and a scale per 32
    with pytest.raises(ValueError, match="Pass.weights must be None"):
        Pass(weights="int3")


@pytest.mark.parametrize("fmt", quantised.FORMATS)
def test_the_copy_is_laid_out_as_the_targets_weights_are(tiny, fmt):
    """Where the target's weights sit in one huge-page block (:mod:`selfspec.models.arena`), so does the copy:
    one block, in the order a pass reads it (per layer q|k|v, output, gate|up, down; then the head), each
    weight packed exactly as :func:`~selfspec.models.quantised.quantise` packs it alone."""
    from selfspec.models.quantised import quantise

    m = tiny.model
    if not m.weights_placed:
        pytest.skip("this platform places no weights in huge pages (not Linux)")
    ws = m.weight_set(fmt)
    order = [t for i in range(m.num_layers) for t in (ws.qkv[i][0], ws.out[i][0], ws.gate_up[i][0], ws.down[i][0])]
    order.append(ws.head)
    starts = [t.data_ptr() for t in order]
    assert starts == sorted(starts) and starts[-1] - starts[0] < ws.nbytes + 4096 * len(order)
    assert all(t.is_contiguous() for t in order)
    assert torch.equal(ws.gate_up[1][0], quantise(m._gate_up[1][0], fmt))
    assert torch.equal(ws.head, quantise(m.family.lm_head.weight, quantised.head_format(fmt)))


#: methods drafting over a quantised copy: on its own, and as the weights of every skip-set draft
QUANTISED = [
    {"name": "quant_draft"},
    {"name": "quant_draft", "draft_weights": "int4", "max_draft": 3},
    {"name": "quant_draft_int4"},  # with Draft & Verify's adaptive draft exit
    {"name": "quant_draft_q4_1"},
    {"name": "quant_draft_ngram_int4"},  # the n-gram lookup first, the copy's drafts elsewhere
    {"name": "quant_draft_ngram_q4_1"},
    {"name": "clasp", "interval": 4, "draft_weights": "q4_1"},
    {"name": "draft_verify", "skip_attn": [1], "skip_mlp": [2], "draft_weights": "int8"},
    {"name": "knapspec", "interval": 4, "search_at": 2, "window": 2, "draft_weights": "int8"},
    {"name": "clasp", "interval": 4, "draft_weights": "int4"},
    {"name": "swift", "context_window": 4, "bayes_interval": 3, "max_draft": 4, "draft_weights": "int8"},
    {"name": "early_exit", "exit_layer": 1, "max_draft": 3, "draft_weights": "int8"},
    {"name": "del", "max_draft": 4, "draft_weights": "int4"},
    {"name": "del", "max_draft": 4, "draft_weights": "int8", "cost_model": "parameters"},
]


def _label(m: dict) -> str:
    return "-".join(str(v) for k, v in m.items() if k in ("name", "draft_weights", "max_draft"))


@pytest.fixture(scope="module")
def measured(tiny):
    """This machine's profile of the tiny model, measured with its quantised tables (small and quick)."""
    from selfspec.evaluation.profiling import measure_profile

    return measure_profile(tiny.model, rows=(1, 2), prefill_rows=(), contexts=(0, 16), repeats=1)


@pytest.mark.parametrize("method", QUANTISED, ids=_label)
def test_quantised_drafts_decode_vanillas_tokens(tiny, measured, method):
    """Greedy: vanilla's tokens, every draft op over the copy and every verification over the target (KnapSpec
    weighs its knapsack with the copy's prices)."""
    m = tiny.model
    dec = build_decoder(method_config(method["name"], never_slower=False,
                                      **{k: v for k, v in method.items() if k != "name"}), m, profile=measured)
    ids = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3]
    want = Vanilla(m).generate(ids, 24).tokens
    got = dec.generate(ids, 24)
    assert got.tokens == want
    fmt = method.get("draft_weights", next((f for f in ("int4", "q4_1") if method["name"].endswith(f)), "int8"))
    drafts = [op for t in got.trace for op in t.row().get("ops", []) if op[0] == "draft" and op[1][0] in "LH"]
    head = quantised.head_format(fmt)  # the copy's head: its own format where it is another (q4_1's int8)
    assert drafts and all(op[1].endswith(":" + (head if op[1][0] == "H" else fmt)) for op in drafts)  # the copy
    verifies = [op for t in got.trace for op in t.row().get("ops", []) if op[0] == "verify"]
    assert verifies and all(":" not in op[1] for op in verifies)  # the verification the target's weights


def test_a_quantised_drafts_logits_are_not_the_targets(tiny):
    """The guard against a draft that silently reads the target's weights (an agreement of 1.000 would hide
    it): the same state's draft logits differ from the target's, by the rounding only."""
    from selfspec.models.heads import draft_logits

    m = tiny.model
    h = torch.randn(1, 1, m.hidden_size)
    with torch.inference_mode():
        target, draft = draft_logits(m, h), draft_logits(m, h, weights="int8")
    assert not torch.equal(target, draft) and torch.allclose(target, draft, atol=0.05)


@pytest.mark.parametrize("fmt", quantised.FORMATS)
def test_sampling_with_a_quantised_draft_keeps_the_target_distribution(peaked_llama, fmt):
    """Speculative sampling with the draft's own distribution as q: the first two tokens of 400 draws
    against p(a)·p(b|a) under top-k 3 (an unbiased sampler: total variation ~0.05)."""
    from conftest import first_two_tokens_tv

    dec = build_decoder(method_config("quant_draft", never_slower=False, draft_weights=fmt, max_draft=4), peaked_llama)
    assert first_two_tokens_tv(dec, [5, 17, 99, 3, 42, 7, 5, 17], Sampling(temperature=1.0, top_k=3, seed=0)) < 0.12


def test_sampled_exits_over_a_quantised_copy_keep_the_target_distribution(peaked_llama):
    """Early exit's drafts over an int4 copy's lower layers and head, sampled with the copy's distribution
    as q and verified over every layer of the target: the first two tokens against p(a)·p(b|a), as above."""
    from conftest import first_two_tokens_tv

    dec = build_decoder(method_config("early_exit", never_slower=False, draft_weights="int4", max_draft=3,
                                      exit_layer=1), peaked_llama)
    assert first_two_tokens_tv(dec, [5, 17, 99, 3, 42, 7, 5, 17], Sampling(temperature=1.0, top_k=3, seed=0)) < 0.12


def test_swifts_sampled_steps_over_a_quantised_copy_keep_the_target_distribution(peaked_llama):
    """SWIFT's tree of sampled candidates drawn from the copy's warped distribution (its q) with a skip
    set besides: the first two tokens against p(a)·p(b|a), as above."""
    from conftest import first_two_tokens_tv

    dec = build_decoder(method_config("swift", never_slower=False, draft_weights="int4", max_draft=4, optimize=False,
                                      skip_attn=[1], skip_mlp=[1]), peaked_llama)
    assert first_two_tokens_tv(dec, [5, 17, 99, 3, 42, 7, 5, 17], Sampling(temperature=1.0, top_k=3, seed=0)) < 0.12


def test_a_profile_prices_quantised_passes_from_their_own_tables(tiny, measured):
    """A measured profile holds each format's attention, MLP and head tables; a walk or head op over a copy
    is priced from them; a profile without them refuses such an op, naming the format and the remedy."""
    from selfspec.measure.profile import Profile
    from selfspec.models.ledger import HeadOp, LayerOp

    profile = Profile(measured.data)  # what its file holds, read back
    assert set(profile.formats) == set(quantised.FORMATS)
    walk = LayerOp("draft", 1, 4, 4, 16, weights="int8")
    assert profile.op(walk) == pytest.approx(profile.walk + 4 * profile.attention_cost(1, 16, weights="int8")
                                             + 4 * profile.mlp_cost(1, "int8"))
    assert profile.op(HeadOp("draft", 1, tiny.model.vocab_size, "int4")) > 0
    assert profile.op(walk.row()) == profile.op(walk)  # a trace's stored form: "L:int8"
    with pytest.raises(ValueError, match="no prices of passes over int8 weights.*measure it again"):
        cpu_like_profile(tiny.model).op(walk)


def test_an_evaluation_refuses_a_quantised_draft_its_profile_cannot_price(tiny, tmp_path):
    from selfspec.config import compose
    from selfspec.config.checks import ConfigError
    from selfspec.evaluation import evaluate

    path = cpu_like_profile(tiny.model).save(tmp_path / "old.json")
    cfg = compose(["model=tiny-random", "method=quant_draft", f"profile={path}", "n_examples=1", "max_new_tokens=4",
                   "warmup=0", "progress=false"])
    with pytest.raises(ConfigError, match="draft_weights=int8: profile .* no prices of passes over int8"):
        evaluate(cfg, tmp_path / "run", loaded=tiny)
    assert not (tmp_path / "run" / "results.jsonl").exists()
    with pytest.raises(ConfigError, match=r"method\.draft_weights=int8 is not allowed: null with model\.linear_kernel"):
        evaluate(compose(["model=tiny-random", "method=quant_draft", "model.linear_kernel=torch", "n_examples=1"]),
                 tmp_path / "run2")
    with pytest.raises(ConfigError, match=r"method\.draft_weights=null is not allowed: int8, int4 or q4_1"):
        evaluate(compose(["model=tiny-random", "method=quant_draft", "method.draft_weights=null", "n_examples=1"]),
                 tmp_path / "run3")


def test_the_memory_estimate_counts_the_copies_the_methods_read():
    from selfspec import memory
    from selfspec.config import compose
    from selfspec.measure import peak

    def total(*extra):
        cfg = compose(["model=tiny-random", "task=xsum", *extra])
        return memory.job_estimate("evaluate", peak.SIZES["8B"], cfg, torch.bfloat16, torch.device("cpu"), 1024, 512)

    plain, int8 = total(), total("method=quant_draft")
    both = total("method=quant_draft", "compare=[quant_draft_int4]")
    copy = {t.name: t.bytes for t in int8.parts}["the int8 copy of the weights"]
    s = peak.SIZES["8B"]  # untied: the head is copied, the embedding table is not
    assert copy == pytest.approx((s.params - s.vocab * s.hidden) * 1.125, rel=0.01)
    assert int8.total - plain.total == pytest.approx(copy)
    assert {t.name for t in both.parts} >= {"the int8 copy of the weights", "the int4 copy of the weights"}


@pytest.mark.slow
def test_smollm2s_quantised_drafts_decode_vanillas_tokens_and_agree_with_it(smol):
    """On the embedded model: greedy output equal to vanilla's, and the int8 draft accepted far more often
    than a layer-skip draft (the figure issue 69 measured: 0.99 teacher-forced)."""
    from selfspec.tasks import build_task

    task = build_task({"name": "humaneval", "n_examples": 1}, model_chat=smol.chat)
    ids = task.encode(task.examples()[0], smol.tokenizer)
    want = Vanilla(smol.model, eos_token_ids=smol.eos_token_ids).generate(ids, 48).tokens
    for name, floor in (("quant_draft", 0.9), ("quant_draft_int4", 0.5), ("quant_draft_q4_1", 0.97)):
        dec = build_decoder(method_config(name, never_slower=False), smol.model, eos_token_ids=smol.eos_token_ids)
        got = dec.generate(ids, 48)
        assert got.tokens == want and got.acceptance_rate > floor, (name, got.acceptance_rate)


@pytest.mark.slow
def test_smollm2s_q4_1_copy_holds_the_files_own_weights(smol):
    """The embedded SmolLM2 is a Q4_1 GGUF file: its q4_1 copy holds every decoder linear exactly (the
    target's float32 weights, bit for bit) and its head (the file's Q8_0 token embedding) in int8, also exactly."""
    m = smol.model
    ws = m.weight_set("q4_1")
    fam = m.family
    pairs = ([(p, w) for (p, _, _), (w, _, _) in zip(ws.qkv + ws.gate_up, m._qkv + m._gate_up)]
             + [(ws.out[i][0], fam.out_proj(i).weight) for i in range(m.num_layers)]
             + [(ws.down[i][0], fam.down_proj(i).weight) for i in range(m.num_layers)]
             + [(ws.head, fam.lm_head.weight)])
    assert ws.head.dtype == torch.int8
    for packed, w in pairs:
        assert torch.equal(quantised.dequantise(packed, w.shape[1]), w.float())


@pytest.mark.parametrize("kind", ["lm_head", "linear"])
def test_an_exit_head_over_a_copy_reads_the_copys_head(tiny, kind):
    """An exit head over a quantised copy (early exit's and DEL's ``draft_weights``): its LM head product
    is the copy's (logits not the target's, close to them; an ``lm_head`` exit is exactly the copy's final
    head), and the ledger prices it at the copy's rate."""
    from selfspec.models.heads import IntermediateHeads, draft_logits
    from selfspec.models.ledger import Ledger

    m = tiny.model
    heads = IntermediateHeads.identity(m, [1], kind=kind)
    h = torch.randn(1, m.hidden_size)
    ledger = Ledger(m.device)
    with torch.inference_mode():
        target, copy = heads.logits(1, h), heads.logits(1, h, ledger, weights="int8")
        assert not torch.equal(target, copy) and torch.allclose(target, copy, atol=0.05)
        if kind == "lm_head":
            assert torch.equal(copy, draft_logits(m, h, weights="int8"))
    assert [op.weights for op in ledger.ops if op.kind == "H"] == ["int8"]


def test_an_exit_over_a_copy_is_priced_at_the_copys_rate(tiny, measured):
    """DEL's TPL over a quantised copy: a draft layer and the exit head cost what the profile's quantised
    tables say (less than the target's), and without a profile what their bytes say."""
    from selfspec.decoding.early_exit import bytes_share, copy_rates, head_cost_in_layers
    from selfspec.models.heads import IntermediateHeads

    m = tiny.model
    heads = IntermediateHeads.identity(m, [1], kind="lm_head")
    layer, head = copy_rates(m, heads, "int8", measured, 16)
    one = measured.layer_cost(1, 16)
    assert layer == pytest.approx((measured.attention_cost(1, 16, weights="int8") + measured.mlp_cost(1, "int8")) / one)
    assert head == pytest.approx(measured.head(1, m.vocab_size, "int8") / one)
    assert copy_rates(m, heads, "int4") == (pytest.approx(bytes_share(m, "int4")),
                                             pytest.approx(head_cost_in_layers(m, heads) * bytes_share(m, "int4")))
    assert bytes_share(m, "int8") == pytest.approx(36 / 128)  # 32 bytes and a 4-byte scale per 32 float32 values
    # q4_1's layers read its own 24 bytes per 32 values, its head (int8) int8's 36
    assert copy_rates(m, heads, "q4_1") == (pytest.approx(24 / 128),
                                             pytest.approx(head_cost_in_layers(m, heads) * 36 / 128))


def test_an_exit_at_the_last_layer_of_a_copy_drafts_what_the_quantised_self_draft_drafts(tiny, measured):
    """Over a quantised copy the last layer is an exit (its head is the copy's final head): early exit there
    drafts the full-depth copy's tokens, step for step what ``quant_draft`` drafts and accepts, and DEL's
    candidates reach it; without a copy that layer is refused, naming the key."""
    from selfspec.config.checks import ConfigError
    from selfspec.decoding.early_exit import EarlyExit

    m = tiny.model
    last = m.num_layers - 1
    ids = [5, 17, 99, 3, 42, 7, 5, 17, 99, 3]
    exit_ = build_decoder(method_config("early_exit", never_slower=False, exit_layer=last, max_draft=4,
                                        draft_weights="int8"), m).generate(ids, 24)
    full = build_decoder(method_config("quant_draft", never_slower=False, max_draft=4), m).generate(ids, 24)
    assert exit_.tokens == full.tokens == Vanilla(m).generate(ids, 24).tokens
    assert exit_.accepted_per_step == full.accepted_per_step and exit_.drafted_per_step == full.drafted_per_step
    dec = build_decoder(method_config("del", never_slower=False, draft_weights="int8"), m, profile=measured)
    assert dec.drafter.candidates == list(range(m.num_layers))
    with pytest.raises(ConfigError, match=rf"method\.exit_layer={last} is not allowed"):
        EarlyExit.check_run(EarlyExit.Options.read(method_config("early_exit", exit_layer=last)), m.num_layers)

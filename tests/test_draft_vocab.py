"""Truncated-vocabulary draft heads (beyond the papers; FR-Spec / VocabTrim): the job's artefact,
the size choice, model checks, losslessness of every self-drafting method with it, and speculative
sampling with a draft distribution that is zero outside the kept tokens."""

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import cpu_like_profile, method_config
from selfspec.config import compose
from selfspec.config.checks import ConfigError
from selfspec.decoding import Sampling, build_decoder, check_method
from selfspec.decoding.sampling import warp
from selfspec.models.heads import DraftVocab, IntermediateHeads, load_draft_vocab, save_draft_vocab
from selfspec.store.artefacts import ArtefactError
from selfspec.training.continuations import Sequence
from selfspec.training.draft_vocab import choose_size, context_coverage, count_tokens, coverage, generated, rank
from test_draft_verify import first_step, first_token_counts
from test_early_exit import agreeing_model, vanilla


# --- counting, coverage, size choice -------------------------------------------------------------
def test_counting_ranking_and_coverage_by_hand():
    train = [Sequence([9, 9, 5, 5, 5, 2], 1), Sequence([7, 5, 2, 3], 0)]  # generated: [5,5,5,2] and [5,2,3]
    toks = generated(train)
    assert toks == [[5, 5, 5, 2], [5, 2, 3]]
    counts = count_tokens(toks, 10)
    assert counts.tolist() == [0, 0, 2, 1, 0, 4, 0, 0, 0, 0]
    ranked = rank(counts)
    assert ranked[:3].tolist() == [5, 2, 3]  # 4 > 2 > 1
    assert ranked[3:6].tolist() == [0, 1, 4]  # unseen tokens follow in id order
    held = [[5, 2, 8, 5], [3, 9]]  # 6 tokens: 5, 2, 5 in the top 2; 3 also in the top 3
    assert coverage(ranked[:2].tolist(), held) == pytest.approx(3 / 6)
    assert coverage(ranked[:3].tolist(), held) == pytest.approx(4 / 6)
    assert coverage([1], []) is None
    # with each sequence's context: [5,5,5,2] after [9,9]: 5 kept, the next two 5s seen, 2 new; [5,2,3] after [7]
    seqs = [Sequence([9, 9, 5, 5, 5, 2], 1), Sequence([7, 5, 2, 3], 0)]
    assert context_coverage([], seqs) == pytest.approx(2 / 7)  # the second and third 5 of the first sequence
    assert context_coverage([2], seqs) == pytest.approx(4 / 7)
    assert context_coverage([9], [Sequence([9, 9, 9], 1)]) == 1.0 and context_coverage([1], []) is None


def test_size_choice_follows_the_stated_objective():
    """coverage / (draft_layers + head_layers): with 8 draft layers, 0.90 / (8 + 0.5) = 0.1059 beats
    0.97 / (8 + 1.2) = 0.1054, the full head 1.0 / (8 + 8) = 0.0625 and 0.60 / 8.1 = 0.074."""
    curve = [{"size": 512, "coverage": 0.60, "head_layers": 0.1}, {"size": 4096, "coverage": 0.90, "head_layers": 0.5},
             {"size": 16384, "coverage": 0.97, "head_layers": 1.2}, {"size": 49152, "coverage": 1.0, "head_layers": 8.0}]
    assert choose_size([dict(c) for c in curve], 8, "coverage")["size"] == 4096
    # by default, the coverage with each generation's context: 0.95 / 8.1 = 0.117 beats 0.98 / 8.5 = 0.115
    ctx = [dict(c, context_coverage=v) for c, v in zip(curve, (0.95, 0.98, 0.99, 1.0))]
    assert choose_size(ctx, 8)["size"] == 512
    curve = [dict(c, context_coverage=c["coverage"]) for c in curve]
    # a cheap full head (a large model, where the head is a fraction of a layer): the full vocabulary wins
    cheap = [dict(c, head_layers=c["head_layers"] / 100) for c in curve]
    assert choose_size(cheap, 8)["size"] == 49152
    # equal objectives: the smaller size
    tie = [{"size": 10, "context_coverage": 0.5, "head_layers": 0.0},
           {"size": 20, "context_coverage": 0.5, "head_layers": 0.0}]
    assert choose_size(tie, 1)["size"] == 10


# --- the job ------------------------------------------------------------------------------------------
JOB = ["job=draft_vocab", "model=tiny-random", "task=gsm8k", "job.n_prompts=3", "job.n_heldout=2", "job.gen_tokens=8",
       "job.max_prompt_tokens=48", "progress=false"]


@pytest.fixture(scope="module")
def job_artefact(tmp_path_factory):
    from selfspec.train import run_job

    out = tmp_path_factory.mktemp("outputs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SELFSPEC_OUTPUTS", str(out))
        summary = run_job(compose(JOB + ["job.size=12"], "train"))
    return out, summary


def test_job_writes_artefact_with_meta(job_artefact, tiny):
    out, summary = job_artefact
    path = out / "artefacts" / "draft_vocab" / "tiny-random-gsm8k"
    assert summary["artefact"] == str(path)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["kind"] == "draft_vocab" and meta["fingerprint"] == tiny.fingerprint
    assert meta["size"] == 12 and meta["selection"]["choice"] == "given" and meta["task"] == "gsm8k"
    # the figures recomputed from the cached continuations the job counted
    raw = json.loads(next((out / "artefacts" / "heads_data").glob("tiny-random-gsm8k-*/sequences.json")).read_text())
    train = generated([Sequence(**s) for s in raw["train"]])
    held = generated([Sequence(**s) for s in raw["heldout"]])
    assert meta["tokens_counted"] == sum(map(len, train)) == 3 * 8
    assert meta["heldout_tokens"] == sum(map(len, held))
    from safetensors.torch import load_file

    ids = load_file(str(path / "tensors.safetensors"))["ids"]
    assert ids.tolist() == rank(count_tokens(train, tiny.model.vocab_size))[:12].tolist()
    assert meta["coverage"] == pytest.approx(coverage(ids.tolist(), held))
    held_seqs = [Sequence(**s) for s in raw["heldout"]]
    assert meta["context_coverage"] == pytest.approx(context_coverage(ids.tolist(), held_seqs))
    assert meta["context_coverage"] >= meta["coverage"]
    sizes = [c["size"] for c in meta["selection"]["candidates"]]
    assert sizes == [12, tiny.model.vocab_size]  # the given size, and the full head for reference
    assert all(c["head_seconds"] > 0 for c in meta["selection"]["candidates"])
    # the head costs are this machine's cost profile's (issue 40: one cost model), in its layers
    from selfspec.evaluation.profiling import machine_profile
    from selfspec.training.draft_vocab import CONTEXT

    profile = machine_profile(tiny.model)
    for c in meta["selection"]["candidates"]:
        assert c["head_seconds"] == profile.head(1, c["size"])
        assert c["head_layers"] == pytest.approx(profile.head(1, c["size"]) / profile.layer_cost(1, CONTEXT))


def test_job_auto_size_is_a_candidate_and_given_size_is_honoured(tmp_path, monkeypatch):
    from selfspec.train import run_job

    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path))
    s = run_job(compose(JOB + ["job.sizes=[16,256]", "job.draft_layers=1"], "train"))
    meta = json.loads((tmp_path / "artefacts" / "draft_vocab" / "tiny-random-gsm8k" / "meta.json").read_text())
    cands = meta["selection"]["candidates"]
    assert [c["size"] for c in cands] == [16, 256, 49152]
    assert s["size"] == max(cands, key=lambda c: (c["objective"], -c["size"]))["size"] == meta["size"]
    other = f"artefact_dir={tmp_path / 'other'}"  # the finished artefact above is kept from other settings
    with pytest.raises(ConfigError, match=r"job\.size=60000"):
        run_job(compose(JOB + ["job.size=60000", other], "train"))
    with pytest.raises(ConfigError, match=r"job\.sizes"):
        run_job(compose(JOB + ["job.sizes=[0,8]", other], "train"))


# --- the head ---------------------------------------------------------------------------------------
def test_truncated_logits_are_the_kept_rows_and_minus_inf_elsewhere(tiny):
    m = tiny.model
    ids = [3, 17, 200, 4000]
    vocab = DraftVocab(m, ids)
    h = torch.randn(2, 5, m.hidden_size)
    full, trunc = m.logits(h), vocab.model_logits(h)
    assert trunc.shape == full.shape
    torch.testing.assert_close(trunc[..., ids], full[..., ids], atol=1e-5, rtol=1e-5)
    mask = torch.ones(m.vocab_size, dtype=torch.bool)
    mask[ids] = False
    assert torch.isneginf(trunc[..., mask]).all()
    heads = IntermediateHeads(m, [1], "lm_head", vocab=vocab)
    q = heads.logits(1, h).softmax(-1)  # the truncated softmax: a distribution over the kept tokens
    torch.testing.assert_close(q[..., ids].sum(-1), torch.ones(2, 5))
    with pytest.raises(ValueError, match="distinct token ids"):
        DraftVocab(m, [1, 1])


class _Tokens:
    """A generation's state as a :class:`ContextVocab` reads it: its tokens."""

    def __init__(self, tokens):
        self.tokens = list(tokens)


@pytest.mark.parametrize("weights", [None, "int8"])
def test_a_generations_own_tokens_join_its_draft_vocabulary(tiny, weights):
    """With ``draft_vocab_context`` the prompt's and then each committed token's rows are scored too (of the
    draft's own head: the int8 copy's where it drafts over it), and nothing else; a vocabulary without it
    scores the kept rows alone."""
    m = tiny.model
    kept = [3, 17, 200, 4000]
    head = None if weights is None else m.weight_set(weights).head
    full_head = m.head if head is None else (lambda x, *a: m.head(x, head))
    h = torch.randn(3, m.hidden_size)
    full = full_head(m.final_norm(h)).float()
    plain = DraftVocab(m, kept)
    assert plain.for_example(_Tokens([5])) is plain
    state = _Tokens([9, 17, 5, 9])
    vocab = DraftVocab(m, kept, context=True).for_example(state)

    def scored(ids):
        out = vocab.model_logits(h, weight=head)
        assert torch.isfinite(out[:, ids]).all() and torch.isneginf(out).sum() == 3 * (m.vocab_size - len(ids))
        torch.testing.assert_close(out[:, ids], full[:, ids], atol=1e-5, rtol=1e-5)

    scored(kept + [5, 9])
    assert vocab.size == 6 and vocab.stats()["draft_vocab_context_rows"] == 2
    state.tokens += [4000, 31, 5, 77]  # committed: 31 and 77 join, 4000 and 5 were held
    scored(kept + [5, 9, 31, 77])
    assert vocab.ids.tolist() == [5, 9, 31, 77] and vocab.size == 8


# --- config and model checks ---------------------------------------------------------------------------
def test_the_draft_benchmark_measures_agreement_over_a_draft_vocabulary(job_artefact):
    """``scripts/bench_quant_drafts.py --draft-vocab``: each copy's agreement over the kept tokens alone and with
    each generation's context, at each size asked for; a size past the artefact's is refused."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_quant_drafts.py"
    base = [sys.executable, str(script), "--model", "tiny-random", "--tokens", "6", "--rounds", "1", "--context", "16",
            "--no-float-x", "--draft-vocab", job_artefact[1]["artefact"]]
    proc = subprocess.run(base + ["--vocab-sizes", "4,12"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("agreement over the draft vocabulary"))
    assert lines[at + 1].split() == ["weights", "4", "12", "full"], proc.stdout
    for line, fmt in zip(lines[at + 2: at + 4], ("int8", "int4")):
        cells = line.split()
        assert cells[0] == fmt and cells[2] == cells[5] == "/", line
        assert all(0.0 <= float(cells[i]) <= 1.0 for i in (1, 3, 4, 6, 7)), line
    bad = subprocess.run(base + ["--vocab-sizes", "13"], capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "--vocab-sizes 13: each must be in [1, 12]" in bad.stderr, bad.stderr[-500:]


def test_bad_and_mismatched_artefacts_are_refused(job_artefact, tmp_path):
    out, summary = job_artefact
    path = summary["artefact"]
    with pytest.raises(ConfigError, match=r"method\.draft_vocab=.*no artefact there"):
        check_method(method_config("early_exit", **{"exit_layer": 1, "max_draft": 2, "draft_vocab": str(tmp_path)}))
    heads_dir = tmp_path / "heads"
    heads_dir.mkdir()
    (heads_dir / "meta.json").write_text(json.dumps({"kind": "heads"}))
    with pytest.raises(ConfigError, match=r"method\.draft_vocab=.*'heads' artefact"):
        check_method(method_config("draft_verify", **{"skip_attn": [1], "draft_vocab": str(heads_dir)}))
    other = agreeing_model(layers=6)  # another model: its fingerprint differs
    cfg = method_config("del", **{"max_draft": 3, "draft_vocab": path})
    with pytest.raises(ArtefactError, match=r"method\.draft_vocab=.*fingerprint"):
        build_decoder(cfg, other.model)
    with pytest.raises(ArtefactError, match=r"method\.draft_vocab="):
        load_draft_vocab(path, other)


def test_auto_finds_the_jobs_artefact(job_artefact, tiny, monkeypatch, prompt_ids):
    out, summary = job_artefact
    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(out))
    method = OmegaConf.merge(compose(["method=draft_verify", "task=gsm8k"]).method,
                             {"skip_attn": [1], "skip_mlp": [2], "draft_vocab": "auto"})
    dec = build_decoder(method, tiny.model)
    assert dec.draft_vocab.size == 12 and str(dec.artefacts["draft_vocab"]) == summary["artefact"]
    g = dec.generate(prompt_ids, 16)
    assert g.tokens == vanilla(tiny, prompt_ids, 16)
    assert g.stats["draft_vocab_size"] == 12 and g.stats["draft_vocab_coverage"] is not None
    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(out / "none"))
    with pytest.raises(FileNotFoundError, match=r"method\.draft_vocab=auto.*make draft-vocab"):
        build_decoder(method, tiny.model)


# --- losslessness -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def agree():
    return agreeing_model()


@pytest.fixture(scope="module")
def agree_vocab(agree, tmp_path_factory, prompt_ids_module):
    """Half of the tokens vanilla generates (so some drafts are accepted, others cannot be) and 100 others."""
    ref = vanilla(agree, prompt_ids_module, 40)
    seen = list(dict.fromkeys(ref))
    ids = torch.tensor(seen[::2] + [t for t in range(1000, 1200) if t not in seen][:100])
    path = tmp_path_factory.mktemp("vocab") / "agree"
    save_draft_vocab(path, ids, torch.ones_like(ids), agree, task="test", coverage=0.5, size=int(ids.numel()))
    return str(path)


@pytest.fixture(scope="module")
def prompt_ids_module(tiny):
    return tiny.tokenizer("Article: The quick brown fox jumps over the lazy dog.\nSummary:")["input_ids"]


@pytest.mark.parametrize("method", [
    method_config("draft_verify", **{"skip_attn": [2, 3], "skip_mlp": [4], "draft_stop": None, "max_draft": 4}),
    method_config("draft_verify", **{"skip_attn": [2], "skip_mlp": [3]}),  # adaptive threshold: truncated-softmax confidence
    method_config("early_exit", **{"exit_layer": 1, "max_draft": 4}),
    method_config("early_exit", **{"exit_layer": 0, "max_draft": 6, "draft_stop": {"rule": "static", "threshold": 0.01}}),
    method_config("del", **{"max_draft": 6}),
    method_config("adadecode", **{"head_kind": "lm_head", "layers": [1, 3], "threshold": 0.0}),
    method_config("quant_draft", **{"max_draft": 4, "never_slower": False}),
])
def test_greedy_with_truncated_head_equals_vanilla(agree, agree_vocab, prompt_ids_module, method):
    """Lossless with the kept set and its generation's context (the default) and with the kept set alone; the
    context's rows let more drafts be accepted (the vocabulary keeps half of what vanilla generates)."""
    ref = vanilla(agree, prompt_ids_module, 40)
    accepted = {}
    for context in (True, False):
        dec = build_decoder(OmegaConf.create({**method, "draft_vocab": agree_vocab, "draft_vocab_context": context}),
                            agree.model, profile=cpu_like_profile(agree.model))  # DEL's TPL prices the truncated head
        assert dec.draft_vocab is not None and dec.draft_vocab.size < agree.model.vocab_size
        g = dec.generate(prompt_ids_module, 40)
        assert g.tokens == ref, method
        assert sum(g.drafted_per_step) > 0 and g.stats["draft_vocab_size"] == dec.draft_vocab.size
        assert (g.stats.get("draft_vocab_context_rows", 0) > 0) == context
        accepted[context] = sum(g.accepted_per_step)
    assert accepted[True] >= accepted[False], accepted


def test_a_sequence_drafts_with_its_own_context_in_a_batch_as_alone(monkeypatch):
    """Each sequence's vocabulary grows by its own tokens only: in a batch its drafts, tokens and steps are
    its run's alone (greedy and sampled), and each scored rows of its own context."""
    from selfspec.decoding import quant_draft
    from test_batch import alone_and_batched, prompts
    from test_families import tiny_family

    model = tiny_family("llama")
    vocab = DraftVocab(model, torch.arange(0, model.vocab_size, 3)[:40], context=True)
    monkeypatch.setattr(quant_draft, "build_draft_vocab", lambda model, options: vocab)
    method = {"name": "quant_draft", "max_draft": 4, "never_slower": False}
    ps = prompts(4)
    for sampling in (Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=3)):
        alone, batched, batch = alone_and_batched(model, method, ps, len(ps), sampling)
        for a, b in zip(alone, batched):
            assert b.tokens == a.tokens and b.drafted_per_step == a.drafted_per_step
            assert b.accepted_per_step == a.accepted_per_step
            assert b.stats["draft_vocab_context_rows"] == a.stats["draft_vocab_context_rows"] > 0
        assert max(batch.passes) > 1
        assert len({g.stats["draft_vocab_context_rows"] for g in batched}) > 1  # each its own context


def test_speculative_sampling_with_truncated_draft_matches_target():
    """As test_draft_verify's distribution test, with a draft vocabulary that keeps q's top token
    but drops two tokens p gives mass to: q is zero there, so only the residual max(0, p - q) can
    emit them. N = 1,600 steps; TV below 0.055 (an unbiased sampler: ~0.023); emitting q is
    checked to be > 0.15 away."""
    s = Sampling(temperature=0.3, top_k=6, seed=0)
    dec, state, p, hq = first_step(s)
    model = dec.model
    with torch.inference_mode():
        q_full = warp(model.logits(hq)[0], s)
        support = p.nonzero().view(-1).tolist()
        dropped = sorted(support, key=lambda t: -float(p[t]))[1:3]  # two of p's tokens, not its top one
        kept = [t for t in range(512) if t not in dropped and (t == int(q_full.argmax()) or t % 3 == 0 or t in support)]
        vocab = DraftVocab(model, kept)
        dec.draft_vocab = state.vocab = vocab
        q = warp(vocab.model_logits(hq)[0], s)
        assert float(q[dropped].sum()) == 0.0 and float(p[dropped].sum()) > 0.05
        n = 1600
        scored = []
        vocab.logits = lambda *a, f=vocab.logits: scored.append(1) or f(*a)  # every draft is this vocabulary's
        counts = first_token_counts(dec, state, n)
    assert len(scored) == n
    tv_pq = 0.5 * (p - q).abs().sum()
    tv = 0.5 * (counts / n - p).abs().sum()
    assert tv_pq > 0.15, f"draft too close to target for a meaningful test (TV {tv_pq:.3f})"
    assert tv < 0.055, f"total variation {tv:.4f} (TV(p, q) = {tv_pq:.3f})"


# --- report ---------------------------------------------------------------------------------------------
def test_report_row_shows_the_truncated_head_and_its_coverage(job_artefact):
    from selfspec.reporting.records import records_from_summary
    from selfspec.reporting.tables import format_cell

    out, summary = job_artefact
    meta = json.loads((Path(summary["artefact"]) / "meta.json").read_text())
    cfg = {"report": {"table": "draft_vocab"}, "model": {"name": "tiny-random"}, "task": {"name": "gsm8k"},
           "method": {"name": "del", "draft_vocab": "auto"}, "sampling": {"temperature": 0.0}}
    entries = {"vanilla": {"speedup": 1.0, "tau": 1.0},
               "del": {"speedup": 1.2, "tau": 1.5, "acceptance_rate": 0.5, "stats": {"draft_vocab_size": 12.0}}}
    run = {"method": "del", "methods": entries, "method_configs": {"del": cfg["method"]}, "run_info": {},
           "artefacts": {"del": [summary["artefact"]]}}
    row = next(r for r in records_from_summary(run, cfg, source="run", origin="run") if r.method == "del")
    assert row.variant == "truncated head (12 tokens)"
    assert format_cell("draft_vocab_coverage", row) == f"{meta['coverage']:.3f}"
    assert format_cell("acceptance_rate", row) == "0.500"
    full = dict(cfg, method={"name": "del", "draft_vocab": None})
    row = next(r for r in records_from_summary({**run, "artefacts": {}}, full, source="run", origin="run")
               if r.method == "del")
    assert row.variant == "full head" and format_cell("draft_vocab_coverage", row) == "–"

"""AdaDecode step for step against the paper's Algorithm 1 (issue 21; :mod:`reference.adadecode_paper`).

The authors' code was not public (github.com/weizhepei/AdaDecode held a README only), so the
reference is the paper's algorithm, re-written on transformers' own decoder layers. The
``adadecode_paper`` configuration (conf/method/adadecode_paper.yaml) and the reference decode the
same prompt ids with the same heads artefact (``T_l = I + noise``, untrained, saved as a selfspec
artefact). Outputs and every step's trace must be equal: early predictions (drafted), accepted
ones, the head layer of each early prediction (exits) and the tokens committed.

All compared quantities are discrete. An exit is a float comparison (the head's top probability
against γ) that the two computations make on last-bit-different numbers (selfspec's own CPU
operators and deferred layers batched in its own order, transformers' stock ones here); with these
heads no probability lies that close to γ. The K/V cache after the last step is compared with a
tolerance for the same reason (tests/reference/traces.py).

Named deviations, each checked to be the only difference:

* the token budget: selfspec's loop stops predicting early at the budget, the paper's algorithm
  has none (its last step may predict past the budget; those tokens are dropped). The reference
  with ``stop_at_budget`` equals ``adadecode_paper`` in every step; without it in every step
  but the last.
* ``max_early`` (``adadecode``: 16; the paper: no bound) and ``early_eos`` (``adadecode``: false;
  the paper predicts an end-of-sequence token early like any other): ``adadecode`` equals the
  reference wherever neither bites and takes other steps (same output) where one does.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from selfspec.config import load_method_config
from selfspec.decoding import check_method
from selfspec.decoding.adadecode import AdaDecode
from selfspec.decoding.vanilla import Vanilla
from selfspec.models.heads import IntermediateHeads, save_heads

from reference import adadecode_paper
from reference.traces import check_kv, totals
from test_adadecode import HEAD_LAYERS, peaked_model

PROMPT = "Article: The quick brown fox jumps over the lazy dog.\nSummary:"
N_NEW = 40


@pytest.fixture(scope="module")
def peaked():
    """tests/test_adadecode.py's sharpened 6-layer tiny-random (intermediate heads agree with the
    final layer often but not always)."""
    return peaked_model()


def heads_artefact(loaded, path, layers, noise: float = 0.02, seed: int = 0):
    """Untrained heads ``T_l = I + noise`` saved as an artefact; returns its directory and ``{l: T_l}``."""
    g = torch.Generator().manual_seed(seed)
    heads = IntermediateHeads.identity(loaded.model, layers)
    with torch.no_grad():
        for lin in heads.heads.values():
            lin.weight.add_(torch.randn(lin.weight.shape, generator=g) * noise)
    save_heads(path, heads, loaded)
    return path, {l: heads.heads[str(l)].weight.detach().clone() for l in heads.layers}


class Keep(AdaDecode):
    """The configured decoder, keeping its last state (for the K/V check)."""

    def finish(self, state):
        super().finish(state)
        self.last = state


def run(name: str, loaded, heads_dir, ids, eos=(), n_new: int = N_NEW, **keys):
    """``conf/method/<name>.yaml`` on the test's heads, built from its checked options as
    :func:`~selfspec.decoding.build_decoder` does (no context drafts in these configs)."""
    cfg = OmegaConf.merge(load_method_config(name), {"heads_dir": str(heads_dir), "heads_task": None, **keys})
    options = check_method(cfg)
    assert options.ngram is None
    dec = Keep.from_config(loaded.model, options, eos_token_ids=eos)
    return dec, dec.generate(ids, n_new)


def steps(gen) -> list[dict]:
    """selfspec's trace in the reference's terms."""
    rows = [{"source": "prefill", "width": gen.trace[0].width, "committed": gen.trace[0].committed}]
    for t in gen.trace[1:]:
        rows.append({"source": t.source, "drafted": t.drafted, "accepted": t.accepted, "exits": t.exits,
                     "committed": t.committed})
    return rows


def reference(loaded, T, gamma, ids, eos=(), n_new: int = N_NEW, stop_at_budget: bool = False):
    """The paper's loop on the same model and heads."""
    return adadecode_paper.generate(loaded.model.hf, T, gamma, ids, n_new, frozenset(eos), stop_at_budget)


@pytest.mark.parametrize("gamma", [0.3, 0.6, 0.9])
def test_adadecode_paper_equals_algorithm_1_step_for_step(peaked, tmp_path, gamma):
    ids = peaked.tokenizer(PROMPT)["input_ids"]
    heads_dir, T = heads_artefact(peaked, tmp_path / "heads", HEAD_LAYERS)
    dec, out = run("adadecode_paper", peaked, heads_dir, ids, threshold=gamma)
    ref = reference(peaked, T, gamma, ids)
    assert out.tokens == ref.tokens == Vanilla(peaked.model).generate(ids, N_NEW).tokens
    assert steps(out)[:-1] == ref.trace[:-1]  # the last step: the budget (module docstring)
    at_budget = reference(peaked, T, gamma, ids, stop_at_budget=True)
    assert at_budget.tokens == ref.tokens and steps(out) == at_budget.trace
    check_kv(dec.last.cache, at_budget.cache)
    trace = ref.trace
    _, drafted, accepted = totals(trace)
    if gamma < 0.9:
        assert 0 < accepted < drafted, "both accepted and rejected early predictions should occur"
        assert len({e for r in trace[1:] for e in r["exits"]}) >= 2, "exits at several heads"


def test_max_early_is_the_default_configs_difference(peaked, tmp_path):
    """``adadecode``'s ``max_early`` (16) cuts steps the paper's algorithm runs on; with it off the
    default configuration equals the reference too (no end-of-sequence token here)."""
    ids = peaked.tokenizer(PROMPT)["input_ids"]
    heads_dir, T = heads_artefact(peaked, tmp_path / "heads", HEAD_LAYERS)
    ref = reference(peaked, T, 0.0, ids, stop_at_budget=True)  # γ = 0: every pass exits early
    _, default = run("adadecode", peaked, heads_dir, ids, threshold=0.0)
    _, unbounded = run("adadecode", peaked, heads_dir, ids, threshold=0.0, max_early=None)
    assert default.tokens == unbounded.tokens == ref.tokens
    assert steps(unbounded) == ref.trace
    assert max(r["drafted"] for r in ref.trace[1:]) > 16 and steps(default) != ref.trace


def accepted_early(ref: adadecode_paper.Run) -> list[int]:
    """Indices (into the new tokens) of the committed early predictions: each step commits its
    accepted early tokens first (up to an end-of-sequence token or the budget), then the final
    layer's own token."""
    out, at = [], 1  # the prefill commits token 0
    for row in ref.trace[1:]:
        out += range(at, at + min(row["accepted"], row["committed"]))
        at += row["committed"]
    return out


def test_early_eos_is_the_default_configs_other_difference(peaked, tmp_path):
    """With an end-of-sequence token that the paper's algorithm predicts early, ``adadecode_paper``
    does the same; ``adadecode`` never predicts it early (its pass goes deeper)."""
    ids = peaked.tokenizer(PROMPT)["input_ids"]
    heads_dir, T = heads_artefact(peaked, tmp_path / "heads", HEAD_LAYERS)
    plain = reference(peaked, T, 0.3, ids, stop_at_budget=True)
    first = [i for i in accepted_early(plain) if plain.tokens[i] not in plain.tokens[:i]]
    eos = [plain.tokens[first[0]]]  # its first occurrence was an accepted early prediction
    ref = reference(peaked, T, 0.3, ids, eos, stop_at_budget=True)
    _, paper = run("adadecode_paper", peaked, heads_dir, ids, eos, threshold=0.3)
    _, default = run("adadecode", peaked, heads_dir, ids, eos, threshold=0.3, max_early=None)
    assert paper.tokens == default.tokens == ref.tokens == plain.tokens[: first[0] + 1]
    assert paper.stop_reason == default.stop_reason == "eos"
    assert steps(paper) == ref.trace and first[0] in accepted_early(ref)
    assert steps(default) != ref.trace and first[0] not in accepted_early_of(default)


def accepted_early_of(gen) -> list[int]:
    """:func:`accepted_early` of a selfspec generation."""
    return accepted_early(adadecode_paper.Run(gen.tokens, steps(gen), None))


@pytest.mark.slow
def test_adadecode_paper_equals_algorithm_1_on_smollm2(smol, tmp_path):
    """The embedded SmolLM2-135M with near-identity heads at three of its 30 layers."""
    ids = smol.tokenizer("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")["input_ids"]
    heads_dir, T = heads_artefact(smol, tmp_path / "heads", [22, 25, 28], noise=0.002)
    dec, out = run("adadecode_paper", smol, heads_dir, ids, threshold=0.7, n_new=24)
    ref = reference(smol, T, 0.7, ids, n_new=24, stop_at_budget=True)
    assert out.tokens == ref.tokens == Vanilla(smol.model).generate(ids, 24).tokens
    assert steps(out) == ref.trace
    check_kv(dec.last.cache, ref.cache)
    _, drafted, accepted = totals(ref.trace)
    assert 0 < accepted < drafted, "early predictions should be both accepted and rejected"

"""Gemma 3 270M, the second real model (``model=gemma3-270m``: the offline GGUF asset, Q4_K_M),
end to end on the layered runtime: vanilla equals transformers' greedy ``generate`` token for
token, on a prompt longer than the 512-token sliding window too; every training job builds its
artefact on it in a few steps, and every lossless method decoding with them equals vanilla.
``make test`` fetches the asset (``make assets-all``)."""

from __future__ import annotations

import pytest

from conftest import cpu_like_profile, hf_greedy, method_config, methods_with_artefacts, train_every_job
from selfspec.decoding import build_decoder
from selfspec.decoding.vanilla import Vanilla

pytestmark = pytest.mark.slow

N_NEW = 16


@pytest.fixture(scope="module")
def gemma():
    from selfspec.config import model_config
    from selfspec.models.loading import load_model

    return load_model(model_config("gemma3-270m"))


def test_the_gguf_is_gemma3_270m_base(gemma):
    m = gemma.model
    assert type(m.family).__name__ == "Gemma3" and m.num_layers == 18 and m.hidden_size == 640
    assert m.vocab_size == 262144 and m.tied_embeddings and m.num_kv_heads == 1 and m.head_dim == 256
    assert [m.family.window(i) for i in range(18)] == ([512] * 5 + [None]) * 3
    assert gemma.tokenizer.chat_template is None and not gemma.chat  # a base model: the papers' prompts


def test_vanilla_equals_generate_within_and_past_the_window(gemma):
    tok, m = gemma.tokenizer, gemma.model
    long = "Article: " + " ".join(f"Item {i} of the list is a {w}." for i, w in
                                  enumerate(["cat", "dog", "tree", "river", "stone", "cloud"] * 16)) + "\nSummary:"
    for text in ("Question: What is the capital of France?\nAnswer:", long):
        ids = tok(text)["input_ids"]
        assert Vanilla(m).generate(ids, N_NEW).tokens == hf_greedy(gemma, ids, N_NEW), len(ids)
    assert len(ids) > 512  # the long prompt is past the sliding window


def test_every_job_and_method_on_gemma3(gemma, tmp_path, monkeypatch):
    """The five jobs in a few steps each, then each method with its artefact (and the methods
    that need none) equals vanilla on two prompts. The jobs price with a synthetic profile of
    Gemma's shape: measuring this machine's takes about 2 minutes here (262k-row head), and the
    measured path is tested on the tiny families (test_families)."""
    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path))
    train_every_job("gemma3-270m", tmp_path, gemma, profile=cpu_like_profile(gemma.model).save(tmp_path / "profile.json"),
                    heads={"job.n_prompts": 2, "job.gen_tokens": 4, "job.layers": "[8,12]"},
                    prompts={"job.n_conversations": 4, "job.held_out": 1, "job.context_length": 32, "job.inserts": 2,
                             "job.eval_inserts": 2},
                    ppd_tree={"job.n_prompts": 1, "job.max_new_tokens": 6, "job.sizes": "[1,3]"},
                    skips={"job.n_prompts": 1, "job.max_new_tokens": 6},
                    draft_vocab={"job.n_prompts": 2, "job.n_heldout": 1, "job.gen_tokens": 6, "job.size": 4096})
    methods = [*methods_with_artefacts(tmp_path), method_config("early_exit", exit_layer=8, max_draft=3,
                                                                 never_slower=False),
               method_config("ngram", never_slower=False)]
    m = gemma.model
    for text in ("Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:",
                 "Summarize: The council met on Monday. The council voted to repair the bridge.\nSummary:"):
        ids = gemma.tokenizer(text)["input_ids"]
        ref = Vanilla(m).generate(ids, N_NEW).tokens
        for method in methods:
            assert build_decoder(method, m, profile=cpu_like_profile(m)).generate(ids, N_NEW).tokens == ref, \
                (method.name, text)


def test_the_q4_1_copy_holds_the_files_q4_k_tensors_exactly(gemma):
    """Gemma 3's file is Q4_K_M: its Q4_K tensors' blocks (scale ``d sc``, minimum ``dmin m`` per 32 values) are
    held exactly by the q4_1 copy, and only they (its Q5_0, Q6_K and Q8_0 tensors hold more than 16 levels a
    block); the file's tensor types, read by gguf-py, are the reference."""
    import torch
    from gguf import GGUFReader

    from selfspec.store import assets
    from selfspec.models.quantised import copied_weights, dequantise, quantise

    path = assets.asset_path("gemma3-270m-gguf")  # the GGUF file itself
    q4_k = sorted(int(t.n_elements) for t in GGUFReader(path).tensors if t.tensor_type.name == "Q4_K")
    linears = copied_weights(gemma.model)[:-1]  # the head is int8, the file's token embedding Q8_0
    held = sorted(w.numel() for w in linears if torch.equal(dequantise(quantise(w, "q4_1"), w.shape[1]), w.float()))
    assert len(q4_k) == 27 and held == q4_k

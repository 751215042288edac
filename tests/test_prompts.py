"""PPD prompt tokens: the training forward equals a brute-force pass, the KD loss, the job."""

import pytest
import torch
import torch.nn.functional as F

from selfspec.decoding.tree import prompt_chain_mask
from selfspec.models.passes import Pass, Rows
from selfspec.models.prompts import PromptTokens, load_prompts, save_prompts
from selfspec.store.artefacts import ArtefactError
from selfspec.training.prompt_tuning import distillation_loss, sample_batch, student_teacher, topk_accuracy


def test_student_and_teacher_equal_brute_force_passes(tiny):
    m = tiny.model
    torch.manual_seed(0)
    prompts = PromptTokens(torch.randn(3, 2, m.hidden_size) * 0.5)
    ids = torch.randint(0, 1000, (20,))
    inserts = torch.tensor([0, 5, 16])
    student, teacher = student_teacher(m, prompts, ids, inserts)
    full = m.logits(m.forward(ids.view(1, -1), None, start=0))[0]
    for g, i in enumerate(inserts.tolist()):
        torch.testing.assert_close(teacher[g], full[i + 1: i + 4])
        # prompt chain after x[0..i] with the ensemble mask, EPT logits averaged
        h = torch.cat([m.embed(ids[: i + 1].view(1, -1)), prompts.chain().unsqueeze(0)], 1)
        mask = prompt_chain_mask(i + 1, 3, 2)
        pos = torch.cat([torch.arange(i + 1), i + torch.tensor([1, 1, 2, 2, 3, 3])]).unsqueeze(0)
        out = m.logits(m.forward(h, None, Pass(rows=Rows.packed(pos, m.prepare_mask(mask))), start=0))[0, i + 1:]
        torch.testing.assert_close(student[g], out.view(3, 2, -1).mean(1), atol=1e-4, rtol=1e-4)


def test_prompt_gradients_flow_through_attention(tiny, monkeypatch):
    """The runtime's row-wise attention kernel has no backward: a training pass of up to 32 prompt
    rows took it, and torch warned that it back-propagated through an operator without an autograd
    kernel (the prompt embeddings' gradient lost its attention part). With a gradient wanted,
    attention takes the library's path: the gradient equals the one of a pass too wide for the
    kernel (rows beyond ``MAX_ROWS``)."""
    from selfspec.models import kernels

    m = tiny.model
    ids, inserts = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(1)), torch.tensor([3, 11])

    def grad() -> torch.Tensor:
        prompts = PromptTokens(torch.randn(3, 1, m.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.5)
        student, teacher = student_teacher(m, prompts, ids, inserts)
        distillation_loss(student, teacher, 0.8)[0].backward()
        return prompts.embeddings.grad

    narrow = grad()
    monkeypatch.setattr(kernels, "MAX_ROWS", 0)
    torch.testing.assert_close(narrow, grad())


def test_distillation_loss_is_weighted_kl():
    torch.manual_seed(0)
    s, t = torch.randn(4, 3, 11), torch.randn(4, 3, 11)
    loss, kl = distillation_loss(s, t, 0.8)
    ref = [F.kl_div(F.log_softmax(s[:, d], -1), F.log_softmax(t[:, d], -1), log_target=True,
                    reduction="batchmean") for d in range(3)]
    torch.testing.assert_close(kl, torch.stack(ref))
    torch.testing.assert_close(loss, sum(0.8 ** d * ref[d] for d in range(3)) / 3)
    assert float(distillation_loss(t, t, 0.8)[0]) == pytest.approx(0.0, abs=1e-6)
    acc = topk_accuracy(t, t)
    assert acc[1].tolist() == [1.0, 1.0, 1.0]


def test_batches_are_deterministic_and_inserts_leave_m_targets():
    seqs = [torch.arange(50), torch.arange(9)]
    for i in range(20):
        a, b = sample_batch(seqs, i, 0, 32, 8, 3), sample_batch(seqs, i, 0, 32, 8, 3)
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["inserts"], b["inserts"])
        assert len(a["ids"]) <= 32 and int(a["inserts"].max()) + 3 < len(a["ids"])


def test_save_load_roundtrip_and_mismatch(tiny, tmp_path):
    p = PromptTokens.init_from_tokens(tiny.model, 3, 2, seed=1)
    save_prompts(tmp_path / "p", p, tiny)
    q = load_prompts(tmp_path / "p", tiny)
    assert torch.equal(p.embeddings.detach(), q.embeddings) and (q.m, q.n_ept) == (3, 2)
    other = type(tiny)(tiny.model, tiny.tokenizer, "other", "0000", tiny.chat, tiny.cfg)
    with pytest.raises(ArtefactError, match="fingerprint"):
        load_prompts(tmp_path / "p", other)


def test_job_trains_and_writes_artefact(tmp_path):
    from selfspec.config import compose
    from selfspec.train import run_job

    cfg = compose(["job=prompts", "model=tiny-random", "job.steps=4", "job.n_conversations=12",
                   "job.held_out=2", "job.context_length=48", "job.inserts=6", "job.eval_inserts=6",
                   "job.ckpt_every=2", f"artefact_dir={tmp_path / 'art'}"], config_name="train")
    out = run_job(cfg)
    assert {"top1@1", "top5@3", "kl@2", "train_seconds"} <= set(out)
    from selfspec.store.artefacts import read_meta
    meta = read_meta(tmp_path / "art")
    assert meta["kind"] == "prompts" and meta["m"] == 3 and meta["n_ept"] == 1
    assert not (tmp_path / ".art.ckpt").exists()


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradient(family):
    """``job.gradient_checkpointing``: each layer runs again in backward, reading the cached context
    without writing to it (a second write would move the rows); the loss and the prompt embeddings'
    gradient are the plain pass's. Gemma 3's sliding window (8) is shorter than the context, so the
    windowed layers read the cache's positions too."""
    from test_families import tiny_family

    m = tiny_family(family)
    ids = torch.randint(0, m.vocab_size, (30,), generator=torch.Generator().manual_seed(2))
    inserts = torch.tensor([4, 13, 25])

    def run(checkpoint: bool):
        prompts = PromptTokens(torch.randn(3, 2, m.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.5)
        student, teacher = student_teacher(m, prompts, ids, inserts, checkpoint=checkpoint)
        loss = distillation_loss(student, teacher, 0.8)[0]
        loss.backward()
        return loss.detach(), prompts.embeddings.grad

    loss, grad = run(False)
    loss_c, grad_c = run(True)
    torch.testing.assert_close(loss_c, loss)
    torch.testing.assert_close(grad_c, grad)
    assert grad.abs().sum() > 0


def test_gradient_checkpointing_keeps_less_for_backward(tiny):
    """What autograd saves for backward through the layers: with checkpointing, each layer's input
    rather than every layer's tensors."""
    m = tiny.model
    n, rows = 24, 16

    def saved(checkpoint: bool) -> int:
        cache = m.new_cache(n + rows)  # a fresh one: a plain pass leaves autograd history in its buffers
        with torch.no_grad():
            m.forward(torch.randint(0, 1000, (1, n), generator=torch.Generator().manual_seed(3)), cache, start=0)
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        h = torch.randn(1, rows, m.hidden_size, generator=torch.Generator().manual_seed(0), requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = m.forward(h, cache, start=n, checkpoint=checkpoint)
        out.sum().backward()
        return total

    plain, checkpointed = saved(False), saved(True)
    assert checkpointed < 0.3 * plain

"""Token selection shared by every decoder: greedy, warped sampling and verification rules.

* :func:`warp` turns logits into the **target distribution** (temperature, then top-k, then
  top-p, the order of ``transformers``' warpers), so vanilla sampling and every lossless
  method sample from the same distribution.
* :func:`draw` — a token drawn from a distribution by inverse transform sampling (one uniform a
  draw; :data:`DRAW` names it in a sampled run's record).
* :func:`greedy_verify` — exact-match verification of drafted tokens.
* :func:`speculative_verify` — speculative sampling (Leviathan et al. 2023; Chen et al. 2023),
  the rule Draft & Verify uses under sampling (Draft & Verify, Appendix K) and AdaDecode's
  modified rejection sampling (AdaDecode §3.3): accept draft ``x`` with ``min(1, p(x)/q(x))``,
  otherwise resample from ``normalize(max(0, p - q))``. The output distribution equals ``p``.

Warping a row costs more than a CPU step's bookkeeping (top-p sorts the vocabulary: about 1.5 ms
for SmolLM2's 49,152 entries on 2 cores, against a 25–30 ms step), so under sampling every warp
is charged to the cost ledger as a ``W`` op (``ledger``: the generation's
:class:`~selfspec.models.ledger.Ledger`, or None) and priced by the machine's profile, and
:func:`verify_chain` warps the target rows one at a time, only as far as the first rejection.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial

import numpy as np
import torch

from selfspec.config import checks
from selfspec.models.kernels import argmax


@dataclass(frozen=True)
class Sampling:
    """Sampling settings (``sampling.*`` of conf/evaluate.yaml); ``temperature == 0`` means greedy
    decoding. Every value is checked here, named as its config key; none is replaced."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        put = partial(object.__setattr__, self)
        put("temperature", checks.number("sampling.temperature", self.temperature, 0, why="0 = greedy"))
        put("top_p", checks.probability("sampling.top_p", self.top_p, low_open=True,
                                        why="nucleus probability mass kept; 1 = no top-p truncation"))
        put("top_k", checks.integer("sampling.top_k", self.top_k, 0, why="0 = no top-k truncation"))
        put("seed", checks.seed("sampling.seed", self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_config(cls, cfg) -> "Sampling":
        """From a ``sampling`` config; a key left out or null takes the default above."""
        if cfg is None:
            return cls()
        names = [f.name for f in fields(cls)]
        checks.known_keys("sampling", cfg, names, "sampling")
        return cls(**{k: cfg[k] for k in names if k in cfg and cfg[k] is not None})


def warp(logits: torch.Tensor, s: Sampling, ledger=None) -> torch.Tensor:
    """``[..., V]`` logits -> float32 probabilities of the target distribution under ``s``.

    Greedy settings give the one-hot distribution of the argmax. Under sampling the rows warped
    are charged to ``ledger`` (module docstring). Rows are warped independently: a row's
    probabilities are the same bits whether it is warped alone or with others.
    """
    logits = logits.float()
    if s.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    if ledger is not None:
        vocab = logits.shape[-1]
        ledger.warp(logits.numel() // max(vocab, 1), vocab, s.top_p < 1.0)
    logits = logits / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        logits = logits.masked_fill(top_p_drop(logits, s.top_p), float("-inf"))
    return logits.softmax(-1)


def top_p_drop(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The tokens nucleus (top-p) sampling drops from ``[..., V]`` float32 logits: exactly the mask
    of ``transformers``' ``TopPLogitsWarper`` (the probabilities of the ascending sort, summed
    from the least likely, dropped while the sum is at most ``1 - top_p``; the most likely token
    always kept).

    The sum only needs the sorted *values*, which are the same whichever way they are sorted, so
    a CPU tensor is sorted by NumPy's vectorised sort (values only: 0.5 ms for SmolLM2's 49,152
    logits here, where ``torch.sort`` with its indices took 3.7 ms and scattering the mask back
    through them another 3.8 ms). The probabilities only grow along the sort, so the dropped
    tokens are a prefix of it: every logit below the first kept sorted value. Where that value is
    tied with the last dropped one, the sort's order of equal logits decides and the mask is
    taken through ``torch.sort``'s order, as the warper does.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        ordered = torch.from_numpy(np.sort(logits.numpy(), axis=-1))
    else:
        ordered = torch.sort(logits, dim=-1).values
    drop_sorted = ordered.softmax(-1).cumsum(-1) <= (1 - top_p)
    drop_sorted[..., -1:] = False  # always keep the most likely token
    n_drop = drop_sorted.sum(-1, keepdim=True)
    first_kept = ordered.gather(-1, n_drop)
    last_dropped = ordered.gather(-1, (n_drop - 1).clamp_min(0))
    if bool(((n_drop > 0) & (last_dropped == first_kept)).any()):  # a tie across the boundary
        order = torch.sort(logits, dim=-1).indices
        return drop_sorted.scatter(-1, order, drop_sorted)
    return logits < first_kept


#: how a token is drawn from a distribution (:func:`draw`); a sampled run's identity records it
#: (:func:`selfspec.evaluation.identity.run_identity`): a seed drawn another way gives other tokens
DRAW = "inverse-cdf-float64"


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``[..., V]`` probabilities (a row need not sum to 1), by inverse
    transform sampling: one uniform ``u`` per row (drawn row after row from ``generator``), and the
    first token whose running sum, in float64 and vocabulary order, exceeds ``u`` times the row's
    total. A token of probability 0 never comes: its running sum equals the one before it.

    ``torch.multinomial`` draws one exponential per vocabulary entry and takes the largest ratio
    (the exponential race): 1.0 ms a draw for SmolLM2's 49,152 entries on 2 Zen 4 cores, paid for
    every drafted token under sampling, where this takes 0.05 ms. The running sum along a row is a
    serial scan, the same bits whatever the thread count."""
    flat = probs.reshape(-1, probs.shape[-1]).double()
    running = flat.cumsum(-1)
    total = running[:, -1:]
    u = torch.rand(flat.shape[0], 1, generator=generator, device=probs.device, dtype=torch.float64)
    # u < 1, but u * total may round up to total: keep the point below it, inside the last token's span
    point = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(running, point, right=True).view(probs.shape[:-1])


def draw_distinct(probs: torch.Tensor, n: int, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` distinct tokens from ``[V]`` probabilities with at least ``n`` non-zero, drawn one after
    another (:func:`draw`), each from the distribution without the tokens before it, renormalised:
    sampling without replacement, the order :func:`multi_candidate_verify` reads them in."""
    left = probs.to(torch.float64, copy=True)  # one copy, which each draw's zeroing writes into
    tokens = []
    for _ in range(n):
        token = draw(left, generator)
        left[token] = 0
        tokens.append(token)
    return torch.stack(tokens)


def select(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None, ledger=None) -> torch.Tensor:
    """Next token(s) for ``[..., V]`` logits: argmax when greedy, else a :func:`draw` from
    :func:`warp` (charged to ``ledger``)."""
    if s.greedy:
        return argmax(logits)
    return draw(warp(logits, s, ledger), generator)


def greedy_verify(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Exact-match verification.

    ``draft``: ``[k]`` drafted tokens; ``target_logits``: ``[k + 1, V]``, row ``j`` predicting
    the token after draft ``j - 1`` (row 0 follows the last committed token). Returns
    ``(n_accepted, next_token)``: the longest matching prefix and the target's own next token
    (the bonus token) after it. One host sync.
    """
    target = argmax(target_logits)
    k = int(draft.shape[0])
    if k == 0:
        return 0, int(target[0])
    mismatch = (draft != target[:k]).int()
    # index of the first mismatch, or k if none; computed on device, read once
    n = int(torch.cat([mismatch, mismatch.new_ones(1)]).argmax())
    return n, int(target[n])


def verify_chain(
    draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    s: Sampling,
    generator: torch.Generator | None,
    ledger=None,
) -> tuple[int, int]:
    """Verify ``k`` drafted tokens against ``[k + 1, V]`` target logits under ``s``.

    Greedy: :func:`greedy_verify`. Sampling: speculative sampling (:func:`speculative_verify`)
    with the drafts' distributions ``draft_probs`` (``[k, V]``; None when nothing was drafted),
    the target rows warped one at a time and only up to the first rejection: the same uniform
    draws, decisions and bits as warping all ``k + 1`` rows first, for ``n + 1`` rows' warps
    instead of ``k + 1``. That is on a CPU, where a top-p warp costs milliseconds; elsewhere every
    row is warped at once and decided on the device, with no host sync per row. The warps are
    charged to ``ledger``. The one rule every lossless chain method (Draft & Verify, AdaDecode,
    early exit / DEL) verifies with.
    """
    if s.greedy:
        return greedy_verify(draft, target_logits)
    k = int(draft.shape[0])
    if k and draft_probs is None:
        raise ValueError(f"{k} drafted tokens came without the distributions they were sampled from")
    if target_logits.device.type != "cpu":
        # on an accelerator a warp is cheap and each row's decision would be a host sync: warp
        # every row at once and decide on the device (the same rule and draws)
        target = warp(target_logits, s, ledger)
        return speculative_verify(draft, draft_probs if k else target[:0], target, generator)
    u = torch.rand(k, generator=generator, device=draft.device) if k else None
    n, p = k, None
    for j in range(k):
        p = warp(target_logits[j : j + 1], s, ledger)[0]
        x = draft[j]
        if bool(u[j] * draft_probs[j, x] >= p[x]):  # accept iff u < p(x)/q(x): never where p(x) = 0, u = 0 too
            n = j
            break
    if n == k:
        p = warp(target_logits[k : k + 1], s, ledger)[0]
    return n, _resample(n, k, p, draft_probs, generator)


def speculative_verify(
    draft: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling over a drafted chain, with every target row warped beforehand (the
    textbook form of :func:`verify_chain`'s rule, which the tests check it against).

    ``draft``: ``[k]``; ``draft_probs``: ``[k, V]`` the distributions the drafts were sampled
    from (``q``); ``target_probs``: ``[k + 1, V]`` the target distributions (``p``). Returns
    ``(n_accepted, next_token)`` where the next token is resampled from the residual
    ``normalize(max(0, p - q))`` at the first rejection, or sampled from ``p`` after the last
    draft when all are accepted. The emitted tokens are distributed exactly as ``p``.
    """
    k = int(draft.shape[0])
    if k:
        idx = torch.arange(k, device=draft.device)
        p = target_probs[idx, draft]
        q = draft_probs[idx, draft]
        u = torch.rand(k, generator=generator, device=draft.device)
        reject = (u * q >= p).int()  # accept iff u < p/q (q > 0 for sampled drafts; u in [0, 1), so never where p = 0)
        n = int(torch.cat([reject, reject.new_ones(1)]).argmax())
    else:
        n = 0
    return n, _resample(n, k, target_probs[n], draft_probs, generator)


def multi_candidate_verify(p: torch.Tensor, candidates: list[int], q: torch.Tensor,
                           generator: torch.Generator | None) -> tuple[int | None, torch.Tensor]:
    """Recursive rejection sampling over sibling candidates (SpecInfer §4.2; SWIFT's tree, §3.3):
    ``candidates`` were drawn one after another *without replacement* from the draft distribution
    ``q`` ``[V]``, and ``p`` ``[V]`` is the target distribution at their parent. Candidate ``j`` is
    accepted with probability ``min(1, p_j(x)/q_j(x))``, where ``q_j`` is ``q`` without the
    candidates before it, renormalised (the distribution ``x`` was drawn from), and ``p_j`` the
    target left after the rejections before it: each rejection replaces it with
    ``normalize(max(0, p_j − q_j))``. Returns ``(index of the accepted candidate or None, the target
    distribution left)``: after a rejection of every candidate the next token is drawn from the
    distribution left, and the token emitted is distributed exactly as ``p``."""
    q = q.clone()
    for j, x in enumerate(candidates):
        qx = q[x]
        if qx <= 0:  # could not have been drawn: nothing to learn from it
            continue
        if bool(torch.rand((), generator=generator, device=p.device) * qx < p[x]):  # u < p/q: never where p(x) = 0
            return j, p
        residual = (p - q).clamp_min(0)
        total = residual.sum()
        p = residual / total if total > 0 else p
        q[x] = 0
        left = q.sum()
        q = q / left if left > 0 else q
    return None, p


def sample_from(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn from the distribution ``p`` ``[V]``."""
    return int(draw(p, generator))


def _resample(n: int, k: int, p: torch.Tensor, draft_probs: torch.Tensor | None,
              generator: torch.Generator | None) -> int:
    """The token after ``n`` accepted of ``k`` drafts: from the residual ``normalize(max(0, p -
    q_n))`` at a rejection, else from ``p`` (the target row ``n``)."""
    if n < k:
        residual = (p - draft_probs[n]).clamp_min(0)
        total = residual.sum()
        dist = residual / total if total > 0 else p
    else:
        dist = p
    return sample_from(dist, generator)

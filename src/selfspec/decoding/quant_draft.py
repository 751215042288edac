"""A quantised self-draft: the target's own weights, rounded to 8 or 4 bits, draft for it (beyond the four
papers; ML-SpecQD, arXiv 2503.13565 §3, casts the target's BF16 weights to MXFP4 for its draft; QuantSpec,
arXiv 2502.10424 §4, drafts with 4-bit weights of the same model).

On a CPU a decoding step costs about what it reads. A layer-skip draft (Draft & Verify) skips at most
half of a small model's layers, so it still reads half the weights, and the layers it skips are not
redundant at 135M parameters. This draft runs every layer and the LM head, each over a copy of the
weights rounded per block of 32 values (:mod:`selfspec.models.quantised`): it reads about 0.28 (``int8``)
or 0.16 (``int4``) of float32's bytes and agrees with the target on most greedy tokens. A step is Draft &
Verify's (§3.2-3.4: the chain step of :mod:`selfspec.decoding.chain`): draft up to ``max_draft`` tokens
over the quantised weights, writing their K/V past the committed tokens, until an EOS draft or, where
one is configured, the draft-stop rule's threshold (none by default: the int8 copy's drafts are accepted
0.96-0.98 of the time whatever their own confidence; ``quant_draft_int4`` takes the adaptive rule, Eq. 2-4); verify them in one pass over the
target's weights, which rewrites those K/V; accept by the chain rule (greedy: exact match; sampling:
speculative sampling with the draft's own distribution as q). The output is the target's, token for token
under greedy decoding and in distribution under sampling.

Every other drafting method takes the same copy through its ``draft_weights`` key (Draft & Verify's skip
set, KnapSpec's and CLaSp's searches over quantised layers): this method is the case with no sublayer
skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.config import checks
from selfspec.decoding.draft_verify import DecodingOptions, DraftVerify
from selfspec.decoding.part_options import ContextFirst, Gated
from selfspec.models.heads import DraftVocabOptions, build_draft_vocab
from selfspec.models.layered import LayeredModel, SkipSet


@dataclass(frozen=True)
class QuantDraftOptions(DecodingOptions, DraftVocabOptions, Gated, ContextFirst):
    """Keys (conf/method/quant_draft*.yaml): Draft & Verify's decoding keys
    (:class:`~selfspec.decoding.draft_verify.DecodingOptions`; ``draft_weights`` must name a format), the
    draft vocabulary's and the parts' (``never_slower``, ``ngram``)."""


class QuantDraft(DraftVerify):
    """Drafts over a quantised copy of every weight, no sublayer skipped; a chain of
    :class:`~selfspec.decoding.draft_verify.SkipSetDrafter` with an empty skip set."""

    name = "quant_draft"
    title = "Quantised self-draft"
    lossless = True
    Options = QuantDraftOptions

    @classmethod
    def check_run(cls, options: QuantDraftOptions, layers: int, budget: int | None = None) -> None:
        """``draft_weights`` must name a format: with the target's own weights the draft would be the
        target itself (every draft accepted, each costing a full step)."""
        if options.draft_weights is None:
            raise checks.refuse("method.draft_weights", None, "int8, int4 or q4_1",
                                "the quantised copy the drafts read; null would draft with the target itself")

    @classmethod
    def from_config(cls, model: LayeredModel, options: QuantDraftOptions, **common) -> "QuantDraft":
        return cls(model, SkipSet(), options, draft_vocab=build_draft_vocab(model, options), **common)

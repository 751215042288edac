"""selfspec ROUGE: mean ROUGE-1/2/L F1 with rouge-score, stemming on; loads offline.

    evaluate.load("<path to this folder>").compute(predictions=[...], references=[...])
"""

import datasets
import evaluate

from selfspec.metrics.functions import ROUGE_TYPES, rouge

_DESCRIPTION = "Mean ROUGE F1 (rouge-score, Porter stemming) per rouge type, no bootstrap."
_KWARGS = """
predictions: list of generated summaries. references: list of reference summaries.
rouge_types: subset of rouge1, rouge2, rougeL, rougeLsum (default rouge1, rouge2, rougeL).
use_stemmer: Porter stemming (default True).
Returns {rouge_type: mean F1}.
"""
_CITATION = "Lin, ROUGE: A Package for Automatic Evaluation of Summaries, 2004."


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class SelfspecRouge(evaluate.Metric):
    """ROUGE F1 for the summarisation tasks (XSum, CNN/DM)."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation=_CITATION, inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}))

    def _compute(self, predictions, references, rouge_types=ROUGE_TYPES, use_stemmer=True):
        return rouge(predictions, references, rouge_types, use_stemmer)

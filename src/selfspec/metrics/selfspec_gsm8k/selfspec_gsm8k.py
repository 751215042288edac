"""selfspec GSM8K accuracy: exact match of the extracted final number; loads offline.

    evaluate.load("<path to this folder>").compute(predictions=[...], references=[...])
"""

import datasets
import evaluate

from selfspec.metrics.functions import gsm8k_accuracy

_DESCRIPTION = ("GSM8K accuracy: the final number of each prediction (#### N, 'the answer "
                "is N', else the last number) equals the reference's.")
_KWARGS = """
predictions: list of generated solutions. references: list of reference solutions or numbers.
Returns {"accuracy": share of matches}.
"""
_CITATION = "Cobbe et al., Training Verifiers to Solve Math Word Problems, 2021."


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class SelfspecGsm8k(evaluate.Metric):
    """Final-answer accuracy for GSM8K and its GSM-Symbolic stand-in."""

    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation=_CITATION, inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}))

    def _compute(self, predictions, references):
        return gsm8k_accuracy(predictions, references)

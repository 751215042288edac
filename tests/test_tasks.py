"""Tasks: offline loading, prompt shapes, post-processing, data errors, configs."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from selfspec.tasks import (TASKS, Example, TaskDataError, build_task, cut_at, get_task,
                            iter_sharegpt, render)

CONF = Path(__file__).parents[1] / "conf"


@pytest.mark.parametrize("name", sorted(TASKS))
def test_each_task_loads_offline_examples(name):
    task = build_task({"name": name, "n_examples": 4})
    examples = task.examples()
    assert len(examples) == 4 and len({e.id for e in examples}) == 4
    assert all(isinstance(e, Example) and e.prompt.strip() for e in examples)
    assert build_task({"name": name, "n_examples": 4}).examples()[0].id == examples[0].id


@pytest.mark.parametrize("name", ["xsum", "cnndm"])
def test_summarisation_prompt_shape(name):
    one = build_task({"name": name, "n_examples": 2}).examples()[0]
    assert one.prompt.startswith("Article: ") and one.prompt.endswith("\nSummary:")
    assert one.prompt.count("Article: ") == 2 and one.prompt.count("\nSummary: ") == 1
    zero = build_task({"name": name, "n_examples": 2, "shots": 0}).examples()[0]
    assert zero.prompt.count("Article: ") == 1 and isinstance(zero.reference, str)


def test_summarisation_postprocess_and_score():
    task = build_task({"name": "xsum", "n_examples": 1})
    assert task.postprocess(" A short summary.\nArticle: next one") == "A short summary."
    ref = task.examples()[0].reference
    assert task.score([ref], [ref]) == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}


def test_humaneval_keeps_the_first_function():
    task = build_task({"name": "humaneval", "n_examples": 1})
    body = "    return x\n"
    for tail in ("\ndef other():\n", "\nclass A:\n", "\nif __name__ == '__main__':\n",
                 "\nprint(f(1))\n", "\n# test\n"):
        assert task.postprocess(body + tail) == body
    assert task.postprocess("    # inner comment\n    return 1\n") == "    # inner comment\n    return 1\n"
    ex = task.examples()[0]
    assert ex.prompt == ex.reference["prompt"] and ex.id.startswith("HumanEval/")


def test_humaneval_canonical_solution_passes():
    from selfspec.metrics import sandbox
    from selfspec.store.assets import asset_path
    from selfspec.tasks.task import read_jsonl

    task = build_task({"name": "humaneval", "n_examples": 2})
    solutions = {r["task_id"]: r["canonical_solution"]
                 for r in read_jsonl(asset_path("humaneval"), {"task_id": str})}
    examples = task.examples()
    got = task.score([solutions[e.id] for e in examples], [e.reference for e in examples])
    assert got == {"pass@1": 1.0, "isolation": sandbox.BUBBLEWRAP}


def test_gsm8k_offline_is_gsm_symbolic():
    task = build_task({"name": "gsm8k", "n_examples": 3, "shots": 2})
    ex = task.examples()[0]
    assert ex.meta["source"] == "gsm-symbolic" and ex.reference.lstrip("-").replace(".", "").isdigit()
    assert ex.prompt.count("Question: ") == 3 and ex.prompt.count("#### ") == 2
    assert ex.prompt.endswith("\nAnswer:")
    assert task.score([f"so #### {ex.reference}"], [ex.reference]) == {"accuracy": 1.0}
    assert task.postprocess(" 3 + 4 = 7\n#### 7\nQuestion: next") == "3 + 4 = 7\n#### 7"


def test_mtbench_prompt_is_the_first_turn():
    ex = build_task({"name": "mtbench", "n_examples": 1}).examples()[0]
    assert ex.prompt == ex.meta["turns"][0] and len(ex.meta["turns"]) == 2
    assert build_task({"name": "mtbench"}).examples() and len(build_task({"name": "mtbench"})) == 80


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"id": "a", "document": "Some text.", "summary": "Text."})


@pytest.mark.parametrize("bad,message", [
    ("{not json", r"data.jsonl, line 2: not valid JSON"),
    (json.dumps({"document": "x"}), r"data.jsonl, line 2: missing field 'summary'"),
    (json.dumps({"document": 3, "summary": "x"}),
     r"data.jsonl, line 2: field 'document' should be str, got int"),
    ("[1, 2]", r"data.jsonl, line 2: expected a JSON object, got list"),
])
def test_malformed_jsonl_names_file_line_field(tmp_path, bad, message):
    path = _write(tmp_path, [GOOD, bad, GOOD])
    task = build_task({"name": "xsum", "source": "local", "data_files": str(path), "shots": 0})
    with pytest.raises(TaskDataError, match=message):
        task.examples()


def test_local_jsonl_loads(tmp_path):
    rows = [json.dumps({"id": str(i), "document": f"Doc {i}.", "summary": f"S {i}."})
            for i in range(5)]
    task = build_task({"name": "xsum", "source": "local", "data_files": str(_write(tmp_path, rows)),
                       "shots": 1, "shuffle_seed": None, "n_examples": None})
    examples = task.examples()
    assert [e.id for e in examples] == ["1", "2", "3", "4"]
    assert examples[0].prompt == "Article: Doc 0.\nSummary: S 0.\nArticle: Doc 1.\nSummary:"


#: per task: two records in the hub data set's own schema (every column it has), the column holding
#: the input, and the example reference each record must give
HUB_SCHEMA = {
    "xsum": ([{"document": f"Storm {i} hit the coast.", "summary": f"Storm {i}.", "id": f"x{i}"} for i in range(2)],
             "document", lambda r: r["summary"]),
    "cnndm": ([{"article": f"Rain {i} fell all day.", "highlights": f"Rain {i}.", "id": f"c{i}"} for i in range(2)],
              "article", lambda r: r["highlights"]),
    "humaneval": ([{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "canonical_solution": f"    return {i}\n",
                    "test": f"def check(c):\n    assert c() == {i}\n", "entry_point": f"f{i}"} for i in range(2)],
                  "prompt", lambda r: {k: r[k] for k in ("task_id", "prompt", "test", "entry_point")}),
    "gsm8k": ([{"question": f"What is {i} + 2?", "answer": f"{i} + 2 = <<{i}+2={i + 2}>>{i + 2}\n#### {i + 2}"}
               for i in range(2)], "question", lambda r: r["answer"].rsplit("#### ", 1)[1]),
    "mtbench": ([{"prompt": [f"Write poem {i}.", "Shorter."], "prompt_id": 81 + i, "category": "writing",
                  "reference": []} for i in range(2)], "prompt", lambda r: None),  # judged by an LLM: no reference
}


@pytest.mark.parametrize("name", sorted(HUB_SCHEMA))
def test_local_jsonl_in_the_hub_schema(tmp_path, name):
    """A hub data set saved as JSON lines (its own column names) loads with source=local: each
    example's prompt holds the record's input and its reference is the record's answer."""
    records, field, reference = HUB_SCHEMA[name]
    path = _write(tmp_path, [json.dumps(r) for r in records])
    task = build_task({"name": name, "source": "local", "data_files": str(path), "shots": 0,
                       "shuffle_seed": None, "n_examples": None})
    examples = task.examples()
    assert len(examples) == len(records)
    for ex, record in zip(examples, records):
        given = record[field][0] if name == "mtbench" else record[field]  # MT-Bench: the first turn
        assert given in ex.prompt and ex.reference == reference(record)
    if name == "mtbench":
        assert [e.id for e in examples] == ["81", "82"] and examples[0].meta["turns"] == records[0]["prompt"]


def test_local_record_with_a_hub_column_and_its_field_is_refused(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt": ["Q"], "turns": ["Q"], "category": "writing"})])
    with pytest.raises(TaskDataError, match=r"line 1: fields 'prompt' and 'turns' are the same field"):
        build_task({"name": "mtbench", "source": "local", "data_files": str(path)}).examples()


@pytest.mark.parametrize("name,hub_args,row", [
    ("cnndm", ("abisee/cnn_dailymail", "3.0.0", "test"), {"id": "x", "article": "A.", "highlights": "H."}),
    ("gsm8k", ("openai/gsm8k", "main", "test"), {"question": "1+1?", "answer": "2\n#### 2"}),
    ("humaneval", ("openai/openai_humaneval", None, "test"),
     {"task_id": "HumanEval/0", "prompt": "def f():\n", "test": "", "entry_point": "f"}),
    ("mtbench", ("HuggingFaceH4/mt_bench_prompts", None, "train"),
     {"prompt": ["Q1", "Q2"], "prompt_id": 81, "category": "writing"}),
])
def test_hub_source_uses_the_hub_ids(monkeypatch, name, hub_args, row):
    import datasets

    calls = []
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda *args, split: calls.append((*args, split)) or [row, row])
    ex = build_task({"name": name, "source": "hub", "n_examples": 1, "shots": 0}).examples()[0]
    assert calls == [hub_args] and ex.prompt


def test_n_examples_larger_than_the_set_is_clipped_with_a_warning():
    with pytest.warns(UserWarning, match=r"n_examples=500 but only 149 are available"):
        assert len(build_task({"name": "cnndm", "n_examples": 500}).examples()) == 149


def test_bad_options_are_named():
    with pytest.raises(ValueError, match=r"unexpected keyword argument 'shot'.*known options"):
        build_task({"name": "xsum", "shot": 1})
    with pytest.raises(ValueError, match="source=local needs data_files"):
        build_task({"name": "xsum", "source": "local"})
    with pytest.raises(KeyError, match="unknown task 'squad'"):
        get_task("squad")


class FakeTokenizer:
    """Whitespace tokenizer with an optional chat template."""

    def __init__(self, chat: bool):
        self.chat_template = "{{ messages }}" if chat else None

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens):
        ids = [len(w) for w in text.split()]
        return {"input_ids": ([0] if add_special_tokens else []) + ids}


def test_render_and_encode():
    ex = Example(id="0", prompt="hello world", reference=None)
    assert render(ex, FakeTokenizer(chat=True)) == "<user>hello world</user><assistant>"
    assert render(ex, FakeTokenizer(chat=False)) == "hello world"
    assert render(ex, FakeTokenizer(chat=True), use_chat_template=False) == "hello world"
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        render(ex, FakeTokenizer(chat=False), use_chat_template=True)
    task = build_task({"name": "xsum", "n_examples": 1, "max_prompt_tokens": 3,
                       "use_chat_template": False})
    assert task.encode(Example("0", "a bb ccc dddd", None), FakeTokenizer(chat=True)) == [2, 3, 4]


def test_cut_at():
    assert cut_at("abc\nArticle: x", ["\nArticle:"]) == "abc"
    assert cut_at("a#b$c", ["$", "#"]) == "a" and cut_at("abc", []) == "abc"


@pytest.mark.parametrize("name", sorted(TASKS))
def test_hydra_task_configs_build(name):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name=None, overrides=[f"+task={name}", "task.n_examples=2"])
    task = build_task(cfg.task)
    assert task.name == name and len(task.examples()) == 2
    assert task.cfg.shuffle_seed == 42 and task.cfg.max_new_tokens == 512


def test_iter_sharegpt_stops_at_truncation(tmp_path):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": "hi ] {"}]}
               for i in range(3)]
    text = json.dumps(records, indent=2)
    path = tmp_path / "sg.json"
    path.write_text(text[: text.rindex('"value"')])  # cut inside the last record
    assert [r["id"] for r in iter_sharegpt(path)] == ["0", "1"]
    path.write_text(text)
    assert len(list(iter_sharegpt(path))) == 3


def test_iter_sharegpt_real_asset():
    first = next(iter(iter_sharegpt()))
    assert first["conversations"][0]["from"] == "human"


# --- prompt formats (issue 13): the paper's raw prompt, or chat turns for an instruct model --------
@pytest.mark.parametrize("name,paper_shots,paper_stop", [
    ("xsum", 1, ["\nArticle:"]), ("cnndm", 1, ["\nArticle:"]), ("gsm8k", 0, ["\nQuestion:"]),
    ("humaneval", 0, ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]), ("mtbench", 0, [])])
def test_prompt_format_auto_follows_the_model_chat_key(name, paper_shots, paper_stop):
    paper = build_task({"name": name, "n_examples": 2})
    chat = build_task({"name": name, "n_examples": 2}, model_chat=True)
    assert (paper.prompt_format, paper.shots, paper.stop) == ("paper", paper_shots, paper_stop)
    assert (chat.prompt_format, chat.shots) == ("chat", 0)
    assert chat.stop == (["\n```\n\n"] if name == "humaneval" else [])
    assert all(e.messages is None and e.meta["prompt_format"] == "paper" for e in paper.examples())
    for ex in chat.examples():
        assert ex.meta["prompt_format"] == "chat" and [m["role"] for m in ex.messages] == ["user"]
    # an explicit value wins in either format; use_chat_template=false keeps auto at the paper format
    pinned = build_task({"name": name, "n_examples": 2, "prompt_format": "paper"}, model_chat=True)
    assert pinned.prompt_format == "paper" and pinned.examples()[0].prompt == paper.examples()[0].prompt
    assert build_task({"name": name, "use_chat_template": False}, model_chat=True).prompt_format == "paper"
    both = build_task({"name": name, "n_examples": 2, "shots": 1, "stop": ["END"]}, model_chat=True)
    assert both.shots == 1 and both.stop == ["END"] and both.postprocess("a END b") == both.extract_answer("a ")


def test_chat_summary_prompt_puts_the_instruction_after_the_article():
    task = build_task({"name": "xsum", "n_examples": 1, "shots": 1}, model_chat=True)
    (shot,), ex = task.exemplars, task.examples()[0]
    user, reply, ask = ex.messages
    assert user["content"].startswith("Article: " + shot["document"].strip()[:50])
    assert user["content"].endswith("\n\nSummarize the article above in one sentence.")
    assert reply == {"role": "assistant", "content": " ".join(shot["summary"].split())}
    assert ask["content"] == f"Article: {ex.prompt.split('Article: ')[-1][:-len(chr(10) + 'Summary:')].strip()}" \
        "\n\nSummarize the article above in one sentence."
    assert render(ex, FakeTokenizer(chat=True)).endswith("one sentence.</user><assistant>")
    with pytest.raises(ValueError, match="chat prompt format"):
        render(ex, FakeTokenizer(chat=True), use_chat_template=False)
    with pytest.raises(ValueError, match=r"task xsum: task.prompt_format=auto with model.chat=true renders chat "
                                         r"turns, but the model's tokenizer has no chat template; set "
                                         r"task.prompt_format=paper"):
        task.encode(ex, FakeTokenizer(chat=False))


def test_humaneval_paper_prompt_stays_raw_for_a_chat_tokenizer():
    paper = build_task({"name": "humaneval", "n_examples": 1, "prompt_format": "paper"}, model_chat=True)
    ex = paper.examples()[0]
    assert not paper.uses_chat_template(FakeTokenizer(chat=True))
    assert paper.encode(ex, FakeTokenizer(chat=True)) == FakeTokenizer(chat=False)(ex.prompt, True)["input_ids"]
    chat = build_task({"name": "humaneval", "n_examples": 1}, model_chat=True)
    text = render(chat.examples()[0], FakeTokenizer(chat=True))
    assert "```python\n" + ex.prompt.rstrip() + "\n```" in text


REPLIES = [  # (a chat reply, what its completion must hold / must not hold)
    ("Sure!\n```python\nimport math\n\ndef {f}(*args):\n{body}\n\nprint({f}(1))\nassert False\n```\n\n"
     "Done, and print(1) explained.",
     ["import math"], ["print(", "assert False"]),
    ("```py\n@staticmethod\ndef helper():\n    return 1\ndef {f}(*args):\n{body}\n```", ["@staticmethod"], []),
    ("Here it is:\n\n```\n{body}\n```", [], ["```"]),
    ("```python\ndef {f}(*args):\n{body}\n\nresult = {f}(", [], ["result"]),  # cut by the budget
]


@pytest.mark.parametrize("reply,holds,lacks", REPLIES)
def test_humaneval_chat_reply_becomes_a_passing_completion(reply, holds, lacks):
    """The canonical solution inside a chat reply, extracted, passes the tests after the prompt."""
    from selfspec.metrics import sandbox
    from selfspec.store.assets import asset_path
    from selfspec.tasks.task import read_jsonl

    task = build_task({"name": "humaneval", "n_examples": 2}, model_chat=True)
    records = {r["task_id"]: r for r in read_jsonl(asset_path("humaneval"), {"task_id": str})}
    completions = []
    for ex in task.examples():
        record = records[ex.id]
        prompt_args = record["prompt"].split(f"def {record['entry_point']}(")[1].split(")")[0]
        body = record["canonical_solution"].rstrip("\n")
        text = reply.format(f=record["entry_point"], body=body).replace("*args", prompt_args, 1)
        completion = task.postprocess(text)
        assert all(h in completion for h in holds) and not any(x in completion for x in lacks), completion
        ast.parse(ex.prompt + completion)
        completions.append(completion)
    got = task.score(completions, [e.reference for e in task.examples()])
    assert got == {"pass@1": 1.0, "isolation": sandbox.BUBBLEWRAP}
    assert task.postprocess("No code here, sorry.") != "" and task.postprocess("") == ""

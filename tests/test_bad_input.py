"""Bad input stops early, with one message naming what to change: local data files."""

import json
from pathlib import Path

import pytest

from selfspec.tasks import TaskDataError, build_task

# --- local data files --------------------------------------------------------------------------
GOOD = {"id": "a", "document": "Some text.", "summary": "Text."}

BAD_FILES = [
    ("empty.jsonl", "", r"empty\.jsonl: the file is empty; expected JSON lines or a JSON array of objects "
                        r"with the fields document, summary"),
    ("blank.jsonl", "\n\n", r"blank\.jsonl: the file is empty"),
    ("empty.json", "[]", r"empty\.json: the JSON array holds no records"),
    ("array.json", json.dumps([GOOD, {"document": "x"}], indent=1),
     r"array\.json, record \[1\] of the JSON array: missing field 'summary'"),
    ("typed.json", json.dumps([GOOD, {"document": "x", "summary": None}]),
     r"typed\.json, record \[1\] of the JSON array: field 'summary' should be str, got NoneType"),
    ("lines.json", json.dumps(GOOD) + "\n" + json.dumps({"document": "x"}) + "\n",
     r"lines\.json, line 2: missing field 'summary'"),
    ("object.json", json.dumps(GOOD, indent=1), r"object\.json: the file is one JSON object"),
]


def _file(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("name,text,message", BAD_FILES)
def test_bad_local_file_names_file_line_and_field(tmp_path, name, text, message):
    task = build_task({"name": "xsum", "source": "local", "data_files": str(_file(tmp_path, name, text))})
    with pytest.raises(TaskDataError, match=message):
        task.examples()


def test_json_array_file_is_read_like_json_lines(tmp_path):
    rows = [{"id": str(i), "document": f"Doc {i}.", "summary": f"S {i}."} for i in range(4)]
    array = _file(tmp_path, "a.json", json.dumps(rows, indent=2))
    lines = _file(tmp_path, "b.jsonl", "\n".join(json.dumps(r) for r in rows))
    opts = {"name": "xsum", "source": "local", "shots": 1, "shuffle_seed": None, "n_examples": None}
    a = build_task({**opts, "data_files": str(array)}).examples()
    b = build_task({**opts, "data_files": str(lines)}).examples()
    assert [(e.id, e.prompt, e.reference) for e in a] == [(e.id, e.prompt, e.reference) for e in b]
    assert [e.id for e in a] == ["1", "2", "3"]
    both = build_task({**opts, "data_files": str(tmp_path / "*.json*")}).examples()  # a glob: both files
    assert len(both) == 7


@pytest.mark.parametrize("task,record,message", [
    ("gsm8k", {"question": "1+1?", "answer": "two"}, r"g\.jsonl, line 1: field 'answer' holds no final number"),
    ("mtbench", {"turns": [], "category": "writing"}, r"g\.jsonl, line 1: field 'turns' should be a non-empty list"),
])
def test_task_specific_record_problems_name_the_line(tmp_path, task, record, message):
    path = _file(tmp_path, "g.jsonl", json.dumps(record) + "\n")
    with pytest.raises(TaskDataError, match=message):
        build_task({"name": task, "source": "local", "data_files": str(path)}).examples()


@pytest.mark.parametrize("options,message", [
    ({"source": "local", "data_files": "/nonexistent/x.jsonl"}, r"task\.data_files: '/nonexistent/x\.jsonl' does not exist"),
    ({"source": "local", "data_files": "/nonexistent/*.jsonl"}, r"the pattern '/nonexistent/\*\.jsonl' matches no file"),
])
def test_missing_data_files_are_named(options, message):
    with pytest.raises(TaskDataError, match=message):
        build_task({"name": "xsum", **options}).examples()

"""Bad input stops early, with one message naming what to change, before any model loads: local
data files, impossible config values, model sources (GGUF files) and artefacts of other weights."""

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from conftest import flip_last_byte, method_config
from selfspec.config import compose, group_options, model_config
from selfspec.config.checks import ConfigError
from selfspec.decoding import build_decoder, check_method
from selfspec.evaluation import evaluate, method_configs, prepare
from selfspec.models.families import UnsupportedModelError
from selfspec.models.heads import IntermediateHeads, load_heads, save_heads
from selfspec.models.loading import ModelLoadError, load_model
from selfspec.store.artefacts import ArtefactError, META
from selfspec.tasks import TaskDataError, build_task
from selfspec.train import prepare_job, run_job

EVAL = ["model=tiny-random", "n_examples=2", "max_new_tokens=4", "warmup=0", "progress=false"]


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything loads a model: the bad input must be found before."""
    import selfspec.models.loading as loading

    def refuse(cfg):
        raise AssertionError("a model was loaded before the bad input was found")

    monkeypatch.setattr(loading, "load_model", refuse)


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


@pytest.mark.parametrize("name,text,message", BAD_FILES[:4])
def test_bad_local_file_stops_evaluate_before_the_model_loads(tmp_path, no_model_load, name, text, message):
    path = _file(tmp_path, name, text)
    with pytest.raises(TaskDataError, match=message):
        evaluate(compose(EVAL + ["task.source=local", f"task.data_files={path}"]), tmp_path / "run")


@pytest.mark.parametrize("job", ["heads", "skips"])
def test_bad_local_file_stops_training_before_the_model_loads(tmp_path, no_model_load, job):
    path = _file(tmp_path, "array.json", BAD_FILES[3][1])
    cfg = compose([f"job={job}", "model=tiny-random", "task.source=local", f"task.data_files={path}"], "train")
    with pytest.raises(TaskDataError, match=BAD_FILES[3][2]):
        run_job(cfg)


@pytest.mark.parametrize("name,data,message", [
    ("latin1.jsonl", json.dumps(GOOD).replace("Some", "Caf\u00e9").encode("latin-1"),
     r"latin1\.jsonl: not UTF-8 text \(byte 0xe9 at offset \d+\)"),
    ("corrupt.jsonl.gz", b"\x1f\x8b\x08\x00not really gzip data",
     r"corrupt\.jsonl\.gz: cannot be decompressed as gzip"),
    ("plain.jsonl.gz", json.dumps(GOOD).encode(), r"plain\.jsonl\.gz: cannot be decompressed as gzip"),
])
def test_undecodable_data_files_are_named(tmp_path, name, data, message):
    """Issue 39's probe: non-UTF-8 text and a corrupt .gz gave a raw UnicodeDecodeError /
    BadGzipFile naming no file; now one TaskDataError names it and says what it is not."""
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(TaskDataError, match=message):
        build_task({"name": "xsum", "source": "local", "data_files": str(path)}).examples()
    from selfspec.tasks.task import read_jsonl

    with pytest.raises(TaskDataError, match=message):
        read_jsonl(path, {"document": str})


def test_json_array_file_is_read_like_json_lines(tmp_path):
    rows = [{"id": str(i), "document": f"Doc {i}.", "summary": f"S {i}."} for i in range(4)]
    array = _file(tmp_path, "a.json", json.dumps(rows, indent=2))
    lines = _file(tmp_path, "b.jsonl", "\n".join(json.dumps(r) for r in rows))
    opts = {"name": "xsum", "source": "local", "shots": 1, "shuffle_seed": None, "n_examples": None}
    a = build_task({**opts, "data_files": str(array)}).examples()
    b = build_task({**opts, "data_files": str(lines)}).examples()
    assert [(e.id, e.prompt, e.reference) for e in a] == [(e.id, e.prompt, e.reference) for e in b]
    assert [e.id for e in a] == ["1", "2", "3"]
    _file(tmp_path, "c.jsonl", "\n".join(json.dumps({**r, "id": f"c{r['id']}"}) for r in rows))
    both = build_task({**opts, "data_files": str(tmp_path / "[ac].json*")}).examples()  # a glob: two files
    assert len(both) == 7
    with pytest.raises(TaskDataError, match=r"2 of the selected examples have the id '1'"):  # a and b share ids
        build_task({**opts, "data_files": str(tmp_path / "[ab].json*")}).examples()


@pytest.mark.parametrize("records,message", [
    ([GOOD, {**GOOD, "document": "Other."}, {**GOOD, "id": "b"}],
     r"task\.data_files=.*d\.jsonl: 2 of the selected examples have the id 'a' \(field 'id'\); results are kept "
     r"by example id, so give each record its own"),
    ([{**GOOD, "id": None}, {**GOOD, "id": "b"}], r"d\.jsonl, line 1: field 'id' is null: give the record its own id, "
                                                 r"or leave the field out"),
    ([{**GOOD, "id": 1}, {"document": "x", "summary": "y"}, {"document": "z", "summary": "w"}],
     r"2 of the selected examples have the id '1'"),
])
def test_examples_that_share_an_id_are_refused_before_the_model_loads(tmp_path, no_model_load, records, message):
    """Issue 52's probe: two records of id "a" and one of "b" ran as three examples, the first "a"
    never generated and the second twice (the runner keys prompts and references by id), and
    records with "id": null all became "None". Now a shared id, or a null one, is refused naming the
    file and the id (a record without an id is numbered by its place, which may meet another's id)."""
    path = _file(tmp_path, "d.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(TaskDataError, match=message):
        evaluate(compose(EVAL + ["n_examples=3", "task.source=local", f"task.data_files={path}", "task.shots=0"]),
                 tmp_path / "run")


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


# --- impossible config values ------------------------------------------------------------------
EVAL_BAD = [
    (["sampling.top_p=0"], r"sampling\.top_p=0 is not allowed: must be in \(0, 1\]"),
    (["sampling.top_p=1.5"], r"sampling\.top_p=1\.5 is not allowed"),
    (["sampling.temperature=-0.5"], r"sampling\.temperature=-0\.5 is not allowed: must be >= 0"),
    # issue 39: inf passed the number check, and JSON recorded the sampled run as temperature null
    (["sampling.temperature=inf"], r"sampling\.temperature=inf is not allowed: must be a finite number >= 0"),
    (["contention=inf"], r"contention=inf is not allowed: must be a finite number > 1\.0"),
    # issue 39: a seed beyond 64 bits failed raw in torch.manual_seed, after the model had loaded
    (["seed=18446744073709551616"], r"seed=18446744073709551616 is not allowed: must be in \[-9223372036854775808, "
                                    r"18446744073709551615\] \(a seed of torch's generators"),
    (["sampling.seed=-9223372036854775809"], r"sampling\.seed=-9223372036854775809 is not allowed"),
    (["sampling.top_k=-1"], r"sampling\.top_k=-1 is not allowed"),
    (["sampling.top_k=2.5"], r"sampling\.top_k=2\.5 is not allowed: must be an integer"),
    (["+sampling.top_q=0.5"], r"sampling\.top_q is not a key of sampling"),
    (["n_examples=0"], r"n_examples=0 is not allowed: must be >= 1"),
    (["max_new_tokens=0"], r"max_new_tokens=0 is not allowed"),
    (["warmup=-1"], r"warmup=-1 is not allowed"),
    (["warmup_max_new_tokens=0"], r"warmup_max_new_tokens=0"),
    (["progress=maybe"], r"progress=maybe is not allowed: must be true or false"),
    (["seed=0.5"], r"seed=0\.5 is not allowed: must be an integer"),
    (["n_samples=0"], r"n_samples=0 is not allowed: must be >= 1"),
    (["n_samples=2"], r"n_samples=2 is not allowed: must be 1 under greedy decoding \(sampling\.temperature=0\)"),
    (["method=adadecode", "method.threshold=1.5"], r"method\.threshold=1\.5 is not allowed: must be in \[0, 1\) "
                                                   r"\(exit threshold on a head's top probability"),
    (["method=adadecode", "method.threshold=1"], r"method\.threshold=1 is not allowed: must be in \[0, 1\)"),
    (["method=adadecode", "method.threshold=-0.1"], r"method\.threshold=-0\.1 is not allowed"),
    (["method=adadecode", "+method.gamma=0.5"], r"method\.gamma was renamed: set method\.threshold instead"),
    (["method=adadecode", "method.max_early=0"], r"method\.max_early=0 is not allowed: must be >= 1"),
    (["method=adadecode", "method.head_kind=linar"], r"method\.head_kind=linar is not allowed: must be one of "
                                                     r"linear, full, lm_head"),
    (["method=adadecode", "method.exit_layers=[1,1]"], r"method\.exit_layers=\[1, 1\] is not allowed: must not repeat"),
    (["method=adadecode", "method.exit_layers=top"], r"method\.exit_layers=top is not allowed: must be a list"),
    (["method=adadecode", "method.layers=[1,2]"], r"method\.layers=\[1, 2\] is not allowed: set only with "
                                                  r"head_kind=lm_head"),
    (["method=adadecode", "method.heads_dir=/nonexistent"], r"method\.heads_dir=/nonexistent is not allowed: no "
                                                            r"artefact there \(no meta\.json\); build one with "
                                                            r"`python -m selfspec\.train job=heads"),
    (["method=draft_verify", "method.max_draft=0"], r"method\.max_draft=0 is not allowed: must be >= 1"),
    (["method=draft_verify", "method.draft_stop.rule=sometimes"], r"method\.draft_stop\.rule=sometimes .*static, adaptive"),
    (["method=draft_verify", "method.draft_stop.threshold=1.2"],
     r"method\.draft_stop\.threshold=1\.2 is not allowed: must be in \[0, 1\]"),
    (["method=draft_verify", "method.draft_stop.target=2"], r"method\.draft_stop\.target=2 is not allowed"),
    (["method=draft_verify", "method.draft_stop.epsilon=0"], r"method\.draft_stop\.epsilon=0 is not allowed: must be in \(0, 1\]"),
    (["method=draft_verify", "method.draft_stop.beta1=1"], r"method\.draft_stop\.beta1=1 is not allowed: must be in \[0, 1\)"),
    (["method=draft_verify", "+method.draft_stop.initial=0.5"],
     r"method\.draft_stop\.initial was renamed: set method\.draft_stop\.threshold instead"),
    (["method=draft_verify", "+method.gamma0=0.5"], r"method\.gamma0 was renamed: set method\.draft_stop\.threshold instead"),
    (["method=draft_verify_static", "+method.draft_stop.target=0.9"], r"method\.draft_stop\.target is not a key"),
    (["method=draft_verify", "method.draft_stop.rule=static"],
     r"method\.draft_stop\.ar_per_example is not a key of draft_stop with rule: static \(another rule with its "
     r"defaults: method/draft_stop=<rule>\)"),
    (["method=draft_verify", "method/draft_stop=static", "method.draft_stop.threshold=1.5"],
     r"method\.draft_stop\.threshold=1\.5 is not allowed"),
    (["method=early_exit", "method.draft_stop={rule:adaptive,threshold:0.5}"],
     r"lacks method\.draft_stop\.target, .*start from conf/method/draft_stop/adaptive\.yaml"),
    (["method=draft_verify", "method.skip_attn=[-1]"], r"method\.skip_attn\[0\]=-1 is not allowed: must be >= 0"),
    (["method=early_exit", "method.max_draft=1.5"], r"method\.max_draft=1\.5 is not allowed: must be an integer"),
    (["method=early_exit", "method.max_draft=0"], r"method\.max_draft=0 is not allowed: must be >= 1"),
    (["method=early_exit", "+method.gamma=4"], r"method\.gamma was renamed: set method\.max_draft instead"),
    (["method=early_exit", "method.exit_layer=-1"], r"method\.exit_layer=-1 is not allowed"),
    (["method=early_exit", "method.exit_head=nope"], r"method\.exit_head=nope is not allowed"),
    (["method=early_exit", "method.heads=/nonexistent"], r"method\.heads=/nonexistent is not allowed"),
    (["method=early_exit", "method.draft_stop={rule:static,threshold:1.5}"],
     r"method\.draft_stop\.threshold=1\.5 is not allowed: must be in \[0, 1\]"),
    (["method=early_exit", "method.draft_stop={rule:magic}"], r"method\.draft_stop\.rule=magic is not allowed"),
    (["method=early_exit", "method.draft_stop={rule:static,thresold:0.5}"],
     r"method\.draft_stop\.thresold is not a key of draft_stop with rule: static"),
    (["method=early_exit_dv_threshold", "method.draft_stop.beta2=1.5"], r"method\.draft_stop\.beta2=1\.5"),
    (["method=del", "method.omega=1"], r"method\.omega=1 is not allowed: must be in \(0, 1\)"),
    (["method=del", "method.min_draft=30"], r"method\.min_draft=30 is not allowed: must be in \[0, 18\]"),
    (["method=del", "method.max_draft=0"], r"method\.max_draft=0 is not allowed"),
    (["method=del", "+method.max_gamma=6"], r"method\.max_gamma was renamed: set method\.max_draft instead"),
    (["method=del", "+method.dynamic_threshold=false"], r"method\.dynamic_threshold was renamed: set "
                                                        r"method\.draft_stop=\{rule: dynamic\}"),
    (["method=del", "method.draft_stop={rule:sometimes}"],
     r"method\.draft_stop\.rule=sometimes .*static, adaptive, dynamic"),
    (["method=early_exit", "method.draft_stop={rule:dynamic}"], r"method\.draft_stop\.rule=dynamic .*static, adaptive"),
    (["method=del", "method.prefill_shadow=0"], r"method\.prefill_shadow=0"),
    (["method=del", "method.shadow_rows=0"], r"method\.shadow_rows=0"),
    (["method=del", "method.head_cost=-1"], r"method\.head_cost=-1 is not allowed: must be >= 0"),
    (["method=del", "method.draft_weights=int8", "method.cost_model=layers"],
     r"method\.cost_model=layers is not allowed: set measured or parameters with method\.draft_weights=int8"),
    (["method=early_exit_paper", "method.draft_weights=int4"],
     r"method\.prefill=draft is not allowed: set full with method\.draft_weights=int4"),
    (["method=del_heads", "method.candidate_layers=[1]"], r"method\.candidate_layers=\[1\] is not allowed: set "
                                                          r"only with exit_head=lm_head"),
    (["method=ngram", "profile=null"], r"profile=null with method ngram's draft_schedule=priced: .*set profile=auto"),
    (["method=del", "profile=null"], r"profile=null with method del's cost_model=measured: .*cost_model=parameters"),
    (["method=draft_verify", "profile=null", "+method.ngram={max_ngram:3,min_ngram:1,max_draft:4,draft_schedule:priced}"],
     r"profile=null with method draft_verify's ngram\.draft_schedule=priced"),
    (["method=knapspec", "profile=null"], r"profile=null with method knapspec's selection=knapspec: .*selection=clasp"),
    (["method=knapspec", "method.window=7"], r"method\.window=7 is not allowed: must be in \[1, 6\]"),
    (["method=clasp", "method.skip_layers=-1"], r"method\.skip_layers=-1 is not allowed: must be >= 0"),
    (["method=swift", "method.search_state=task"], r"method\.search_state=task is not allowed"),
    (["method=swift", "method.bayes_interval=0"], r"method\.bayes_interval=0 is not allowed: must be >= 1"),
    (["method=ppd", "method.posterior_threshold=0"], r"method\.posterior_threshold=0 is not allowed"),
    (["method=ppd", "method.posterior_alpha=0"], r"method\.posterior_alpha=0 is not allowed: must be > 0"),
    (["method=ppd", "method.tree_size=0"], r"method\.tree_size=0 is not allowed"),
    (["method=ngram", "method.min_ngram=4"], r"method\.min_ngram=4 is not allowed: must be in \[1, 3\]"),
    (["method=ngram", "method.max_draft=0"], r"method\.max_draft=0 is not allowed: must be >= 1"),
    (["method=ngram", "method.draft_schedule=fast"], r"method\.draft_schedule=fast is not allowed"),
    (["method=hf_prompt_lookup", "method.prompt_lookup_num_tokens=0"], r"method\.prompt_lookup_num_tokens=0"),
    (["method=hf_early_exit", "method.assistant_early_exit=0"], r"method\.assistant_early_exit=0"),
    (["method=hf_early_exit", "method.num_assistant_tokens_schedule=fast"],
     r"method\.num_assistant_tokens_schedule=fast is not allowed: must be one of constant, heuristic"),
    (["method=hf_assisted"], r"method\.assistant=null is not allowed"),
    (["method=hf_assisted", "method.assistant=nope"], r"method\.assistant=nope is not allowed: must be one of .*tiny-random"),
    (["task.shots=-1"], r"task\.shots=-1 is not allowed: must be >= 0"),
    (["task.n_examples=0"], r"task\.n_examples=0 is not allowed"),
    (["task.source=web"], r"task\.source=web is not allowed: must be one of offline, hub, local"),
    (["task.use_chat_template=sometimes"], r"task\.use_chat_template=sometimes"),
    (["task.prompt_format=instruct"], r"task\.prompt_format=instruct is not allowed: must be one of auto, paper, chat"),
    (["task.prompt_format=chat", "task.use_chat_template=false"],
     r"task\.use_chat_template=false is not allowed: task\.prompt_format=chat is rendered with the chat template"),
    (["model.chat=maybe"], r"model\.chat=maybe is not allowed"),
    (["task.max_new_tokens=0"], r"task\.max_new_tokens=0"),
    (["task.data_files=x.jsonl"], r"task\.data_files=\[x\.jsonl\] is not allowed: data files are read only with "
                                  r"task\.source=local"),
    (["task.source=local"], r"task\.data_files=null is not allowed: task\.source=local needs data_files"),
    (["task.split=validation"], r"task\.split=validation is not allowed: a split is read only with task\.source=hub"),
    (["task=humaneval", "task.isolation=none"], r"task\.isolation=none is not allowed: must be one of bubblewrap, "
                                                r"rlimits-only"),
    (["model.dtype=int8"], r"model\.dtype=int8 is not allowed: must be one of auto, float32"),
    (["model.device=gpu"], r"model\.device=gpu is not allowed"),
    (["model.attn_implementation=flash_attention_2"], r"model\.attn_implementation=flash_attention_2 is not "
                                                      r"allowed: must be one of sdpa, eager"),
    (["+model.random.num_hidden_layer=2"], r"model\.random\.num_hidden_layer is not a key of LlamaConfig"),
    (["model.name_or_path=gpt2"], r"model\.random and model\.name_or_path both name where the model comes from"),
    (["model.gguf_file=x.gguf"], r"model\.gguf_file=x\.gguf is not allowed: names a GGUF file inside "
                                  r"model\.name_or_path"),
    (["logger=wandb", "logger.mode=sometimes"], r"logger\.mode=sometimes is not allowed"),
    # issue 52's probe: W&B's own refusals came raw, after the model had loaded
    (["logger=wandb", "logger.mode=offline", "logger.project=a/b"],
     r"logger\.project=a/b is not allowed: W&B refuses it \(Invalid project name 'a/b': cannot contain characters"),
    (["logger=wandb", "logger.mode=offline", f"logger.tags=[{'t' * 76}]"],
     r"logger\.tags=\[t+\] is not allowed: W&B refuses it \(.*is 76 characters\. Tags must be between 1 and 64"),
    # issue 52's probe: a top-level key nothing reads ran and was recorded (the form Hydra suggests)
    (["+batchsize=4"], r"batchsize is not a key of conf/evaluate\.yaml; its keys are .*max_new_tokens"),
    # issue 54: what a batch cannot run is refused naming batch_size, never run one sequence at a time
    (["batch_size=0"], r"batch_size=0 is not allowed: must be >= 1 \(sequences decoded at once\)"),
    (["batch_size=2", "model.capture=static"], r"batch_size=2 is not allowed: .*model\.capture resolving to static.*"
                                               r"set model\.capture=off"),
    (["batch_size=2", "threads=adaptive"], r"batch_size=2 is not allowed: .*threads=adaptive"),
    (["batch_size=2", "compare=[hf_prompt_lookup]"], r"batch_size=2 with method hf_prompt_lookup: it decodes one sequence at a "
                                                r"time"),
    (["batch_size=2", "compare=[llama_cpp]"], r"batch_size=2 with method llama_cpp: it decodes one sequence at a time "
                                          r"\(llama\.cpp\)"),
    # llama.cpp decodes greedily only: a sampled run refuses it before the model loads, never runs it greedily
    (["sampling.temperature=0.7", "compare=[llama_cpp]"], r"sampling\.temperature=0\.7 with method llama_cpp: it "
                                                       r"decodes greedily only"),
    (["method=llama_cpp", "method.weights=q5"], r"method\.weights=q5 is not allowed: must be one of auto, f32, bf16, "
                                               r"q8_0, q4_0, q4_k_m, source"),
    (["method=llama_cpp_speculative", "method.draft=tiny-random", "sampling.temperature=0.7"],
     r"sampling\.temperature=0\.7 with method llama_cpp_speculative: it decodes greedily only"),
    (["method=llama_cpp_speculative", "method.draft=tiny-random", "batch_size=2"],
     r"batch_size=2 with method llama_cpp_speculative: it decodes one sequence at a time"),
    (["method=llama_cpp_speculative", "method.draft=qwen9"], r"method\.draft=qwen9 is not allowed: must be one of"),
    (["method=llama_cpp_speculative", "method.draft=tiny-random"],
     r"method\.draft=tiny-random: its weights are not a GGUF file \(model\.random=random\); llama\.cpp drafts with a model read from one"),
    (["method=llama_cpp_speculative", "method.draft=tiny-random", "method.draft_min=17"],
     r"method\.draft_min=17 is not allowed: must be in \[0, 16\]"),
    (["batch_size=2", "method=ngram", "profile=null", "method.draft_schedule=adaptive"],
     r"batch_size=2 with method ngram's never_slower=true and profile=null"),
    # issue 52's probe: keys bounded by the layer count were refused only after the model loaded
    (["method=swift", "method.skip_attn=[99]"], r"method\.skip_attn\[0\]=99 is not allowed: must be in \[1, 2\] "
                                               r"\(SWIFT never skips the first or the last layer; the model has 4 layers\)"),
    (["method=swift", "model.random.num_hidden_layers=2"],
     r"method=swift needs a model of at least 3 layers \(it never skips the first or the last layer\); the model "
     r"has 2"),
    (["method=clasp", "method.skip_layers=99"], r"method\.skip_layers=99 is not allowed: must be in \[0, 3\] "
                                                r"\(CLaSp's M, layers skipped; the model has 4 layers\)"),
    (["method=early_exit", "method.exit_layer=7"], r"method\.exit_layer=7 is not allowed: must be in \[0, 2\] "
                                                   r"\(0-based exit layer ℓ; the model has 4 layers"),
    (["method=draft_verify", "method.skip_attn=[9]"], r"method\.skip_attn\[0\]=9 is not allowed: must be in \[0, 3\]"),
    (["method=hf_early_exit", "method.assistant_early_exit=4"],
     r"method\.assistant_early_exit=4 is not allowed: must be in \[1, 3\]"),
    (["compare=[swift]", "model.random.num_hidden_layers=2"],
     r"method=swift needs a model .* \(in conf/method/swift\.yaml, run as baseline or compare\)"),
    # issue 52's probe: numpy's RandomState takes 0 .. 2**32 - 1; -1 and 2**32 failed raw after the load
    (["method=swift", "method.seed=-1"], r"method\.seed=-1 is not allowed: must be in \[0, 4294967295\]"),
    (["method=swift", "method.seed=4294967296"], r"method\.seed=4294967296 is not allowed"),
]


@pytest.mark.parametrize("overrides,message", EVAL_BAD, ids=[" ".join(o) for o, _ in EVAL_BAD])
def test_impossible_evaluate_config_is_refused_before_the_model_loads(tmp_path, no_model_load, overrides, message):
    with pytest.raises(ConfigError, match=message):
        evaluate(compose(EVAL + overrides), tmp_path)


def test_a_missing_draft_vocabulary_is_refused_before_the_model_loads(tmp_path, no_model_load, monkeypatch):
    """``draft_vocab: auto`` with no artefact for the model and task (nor a mixed one) stops before the model loads,
    saying what to build; in a compare method, naming its config file."""
    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path / "outputs"))
    message = r"method\.draft_vocab=auto: no draft vocabulary for model 'tiny-random'.*make draft-vocab MODEL=tiny-random TASK=gsm8k"
    with pytest.raises(ConfigError, match=message):
        evaluate(compose(EVAL + ["task=gsm8k", "method=quant_draft_vocab"]), tmp_path / "run")
    with pytest.raises(ConfigError, match=message + r".*\(in conf/method/quant_draft_vocab\.yaml, run as baseline or compare\)"):
        evaluate(compose(EVAL + ["task=gsm8k", "method=quant_draft", "compare=[quant_draft_vocab]"]), tmp_path / "run2")
    assert not (tmp_path / "run").exists() and not (tmp_path / "run2").exists()


@pytest.mark.parametrize("mode,how", [("auto", r"logger\.mode=auto with a W&B API key"),
                                      ("online", r"logger\.mode=online")])
def test_an_unreachable_wandb_server_is_refused_before_the_model_loads(tmp_path, no_model_load, monkeypatch, mode, how):
    """Issue 39's probe: a W&B key and no network stalled about 100 s in W&B's retries, then failed
    with a raw CommError after the model had loaded. Now the server is tried first, within a bounded
    wait, and the run is refused with one message naming the offline mode; nothing switches modes
    silently. (The server here is a closed port on this machine: nothing leaves it.)"""
    import time

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=f"logger=wandb logs online here \\({how}\\), and the W&B server "
                                          f"http://127.0.0.1:{port} cannot be reached .*: set logger\\.mode=offline"):
        evaluate(compose(EVAL + ["logger=wandb", f"logger.mode={mode}"]), tmp_path)
    assert time.perf_counter() - t0 < 30
    assert not any(tmp_path.iterdir())


def test_a_wandb_mode_wandb_refuses_is_refused_before_the_model_loads(tmp_path, no_model_load, monkeypatch):
    """Issue 52's probe: WANDB_MODE=bogus failed raw in wandb.init, after the model had loaded."""
    monkeypatch.setenv("WANDB_MODE", "bogus")
    with pytest.raises(ConfigError, match=r"WANDB_MODE=bogus is not allowed: W&B refuses it \(.*'online', 'offline'"):
        evaluate(compose(EVAL + ["logger=wandb", "logger.mode=auto"]), tmp_path)


def test_a_swift_context_window_the_budget_never_fills_is_said_before_the_model_loads(no_model_load, caplog):
    """Issue 52's probe: a SWIFT context_window the generation never fills (the default 50 with
    max_new_tokens <= 51) turned the layer set optimisation off without a word."""
    with caplog.at_level("WARNING"):
        prepare(compose(EVAL + ["method=swift"]))
    assert ("method swift: the layer set optimisation needs more than method.context_window + 1 = 51 generated "
            "tokens, and max_new_tokens=4 never gives them: it never runs, and SWIFT drafts with its starting set") \
        in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        prepare(compose(EVAL + ["method=swift", "method.context_window=2"]))
        prepare(compose(EVAL + ["method=swift", "method.optimize=false"]))
    assert "layer set optimisation" not in caplog.text


def test_a_draft_longer_than_the_models_context_is_refused_naming_max_draft(tiny, tmp_path):
    """Issue 52's probe: SWIFT's max_draft=1000 (KnapSpec's 100000) failed at the first generation
    with advice naming max_new_tokens, after vanilla's row was written, so the corrected rerun into
    the same directory was refused. Now it is refused naming method.max_draft before anything is
    written, and the corrected run goes ahead in the same directory."""
    run = tmp_path / "run"
    for method, k in (("swift", 1000), ("clasp", 100000)):
        with pytest.raises(ConfigError, match=rf"method {method}: a step may write \d+ cache positions past the "
                                              rf"tokens \(method\.max_draft={k}\).*lower method\.max_draft"):
            evaluate(compose(EVAL + [f"method={method}", f"method.max_draft={k}", "profile=null"]), run, loaded=tiny)
        assert not run.exists()
    evaluate(compose(EVAL + ["method=swift", "method.max_draft=4", "profile=null"]), run, loaded=tiny)


def test_a_reachable_wandb_server_passes_the_check(monkeypatch):
    """The check accepts a server that takes the connection (a listening socket on this machine)."""
    from selfspec.tracking import check_logger

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.delenv("WANDB_MODE", raising=False)
        cfg = compose(EVAL + ["logger=wandb", "logger.mode=online"])
        assert check_logger(cfg.logger) == "wandb"


JOB_BAD = [
    (["job=heads", "+batch_size=4"], r"batch_size is not a key of conf/train\.yaml; its keys are "),
    (["job=heads", "job.kind=lm_head"], r"job\.kind=lm_head is not allowed: must be one of linear, full"),
    (["job=heads", "job.layers=[]"], r"job\.layers=\[\] is not allowed: must name at least one layer"),
    (["job=heads", "job.data=both"], r"job\.data=both is not allowed"),
    (["job=heads", "job.mixed_tasks=[xsum,squad]"], r"job\.mixed_tasks\[1\]=squad is not allowed"),
    (["job=heads", "job.n_prompts=0"], r"job\.n_prompts=0 is not allowed"),
    (["job=heads", "job.eval_gammas=[0.5,1.0]"], r"job\.eval_gammas\[1\]=1\.0 is not allowed: must be in \[0, 1\)"),
    (["job=heads", "job.lr=0"], r"job\.lr=0 is not allowed: must be > 0"),
    (["job=heads", "job.log_every=0"], r"job\.log_every=0 is not allowed: must be >= 1"),
    (["job=heads", "job.schedule=exp"], r"job\.schedule=exp is not allowed"),
    (["job=heads", "job.max_grad_norm=0"], r"job\.max_grad_norm=0 is not allowed"),
    (["job=heads", "seed=0.5"], r"seed=0\.5 is not allowed"),
    (["job=skips", "progress=yes"], r"progress=yes is not allowed: must be true or false"),
    (["job=heads", "model.dtype=int8"], r"model\.dtype=int8 is not allowed"),
    (["job=prompts", "job.alpha=0"], r"job\.alpha=0 is not allowed: must be in \(0, 1\]"),
    (["job=prompts", "job.held_out=0"], r"job\.held_out=0 is not allowed"),
    (["job=prompts", "job.context_length=4"], r"job\.context_length=4 is not allowed: must be >= 8"),
    (["job=prompts", "job.data=/nonexistent.json"], r"job\.data=/nonexistent\.json is not allowed: no such file"),
    (["job=skips", "job.search=random"], r"job\.search=random is not allowed: must be one of bo, bo_model, greedy"),
    (["job=skips", "job.probe_fractions=[0]"], r"job\.probe_fractions\[0\]=0 is not allowed"),
    (["job=skips", "job.tasks=[xsum,squad]"], r"job\.tasks\[1\]=squad is not allowed"),
    (["job=skips", "+job.decoding.draft_stop.threshold=2"],
     r"job\.decoding\.draft_stop\.threshold=2 is not allowed: must be in \[0, 1\]"),
    (["job=skips", "+job.decoding.gamma0=0.5"], r"job\.decoding\.gamma0 is not a key"),
    (["job=skips", "+job.decoding.max_draf=4"], r"job\.decoding\.max_draf is not a key"),
    (["job=skips", "job.search=greedy", "job.max_new_tokens=2"], r"job\.max_new_tokens=2 is not allowed: must be >= 3"),
    (["job=skips", "job.warm_start=[{attn:[-1]}]"], r"job\.warm_start\[0\]\.attn\[0\]=-1 is not allowed"),
    (["job=skips", "job.iterations=0", "job.probe_fractions=[]"], r"job\.iterations=0 is not allowed: the search "
                                                                   r"would evaluate nothing"),
    (["job=ppd_tree", "job.sizes=[1]"], r"job\.sizes=\[1\] is not allowed: must hold a size > 1"),
    (["job=ppd_tree", "+job.latency_repeats=5"], r"job\.latency_repeats was renamed: set profile \(the job prices"),
    (["job=skips", "+job.calibration_repeats=5"], r"job\.calibration_repeats was renamed: set profile"),
    (["job=draft_vocab", "+job.cost_repeats=7"], r"job\.cost_repeats was renamed: set profile"),
    (["job=ppd_tree", "profile=null"], r"profile=null is not allowed: auto, a profile file .*job=ppd_tree"),
    (["job=skips", "job.search=greedy", "profile=null"], r"profile=null is not allowed: .*job\.search=greedy prices"),
    (["job=draft_vocab", "profile=null"], r"profile=null is not allowed: .*job=draft_vocab"),
    (["job=skips", "profile=nonexistent-profile"], r"profile=nonexistent-profile is not allowed"),
    (["job=ppd_tree", "job.prompts=/nonexistent"], r"job\.prompts=/nonexistent is not allowed: no artefact there"),
    (["job=ppd_tree", "job.data=/nonexistent.json"], r"job\.data=/nonexistent\.json is not allowed: no such file"),
    (["job=ppd_tree", "job.data=/etc/hostname", "job.hub_id=a/b"], r"job\.hub_id=a/b is not allowed: set job\.data"),
]


@pytest.mark.parametrize("overrides,message", JOB_BAD, ids=[" ".join(o) for o, _ in JOB_BAD])
def test_impossible_job_config_is_refused_before_the_model_loads(no_model_load, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_job(compose(["model=tiny-random"] + overrides, "train"))


def test_every_shipped_method_config_passes():
    """Each conf/method file reads every key it sets; the separate-draft peers alone need a value from the
    user (their draft model)."""
    cfg = compose(["compare=[" + ",".join(group_options("method")) + "]"])
    for name, m in method_configs(cfg, label="vanilla").items():
        if name in ("hf_assisted", "llama_cpp_speculative"):
            key = "assistant" if name == "hf_assisted" else "draft"
            with pytest.raises(ConfigError, match=rf"method\.{key}=null is not allowed: set method\.{key}=<model"):
                check_method(m)
        else:
            check_method(m)


def test_every_shipped_task_and_experiment_passes(no_model_load):
    for task in group_options("task"):
        assert prepare(compose([f"task={task}", "model=tiny-random", "n_examples=2"])).examples
    for experiment in group_options("experiment"):
        prepare(compose([f"experiment={experiment}", "model=tiny-random", "n_examples=2"]))


def test_every_shipped_job_config_passes(tiny, tmp_path, monkeypatch):
    from selfspec.models.prompts import PromptTokens, save_prompts
    from selfspec.store.artefacts import default_artefact_dir

    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path))  # ppd_tree needs a prompts artefact
    save_prompts(default_artefact_dir("prompts", "tiny-random"), PromptTokens.init_from_tokens(tiny.model, 2, 1), tiny)
    for job in group_options("job"):
        prepare_job(compose([f"job={job}", "model=tiny-random"], "train"))


# --- model sources: local GGUF files -------------------------------------------------------------
def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte alphabet: a byte-level BPE vocabulary of 256 single-character tokens."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:] + [256 + n for n in range(256 - len(bs))]
    bs += [b for b in range(256) if b not in bs]
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_gguf(path: Path, arch: str = "llama", d: int = 16, layers: int = 2, seed: int = 0,
               meta: dict | None = None) -> Path:
    """A tiny GGUF file as llama.cpp names its tensors: random F32 weights, a byte-level tokenizer.

    ``meta`` replaces metadata values by the name of their ``GGUFWriter.add_*`` method
    (``{"head_count": 3}``), or leaves one out (``{"block_count": None}``); the tensors stay."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = _bytes_to_unicode() + ["he"]
    vocab, heads, ff = len(tokens), 2, 32
    w = gguf.GGUFWriter(str(path), arch)
    values = {"block_count": layers, "context_length": 128, "embedding_length": d, "feed_forward_length": ff,
              "head_count": heads, "head_count_kv": 1, "layer_norm_rms_eps": 1e-5, "rope_freq_base": 10000.0,
              "vocab_size": vocab, "tokenizer_model": "gpt2", "tokenizer_pre": "default", "token_list": tokens,
              "token_types": [1] * vocab, "token_merges": ["h e"], "bos_token_id": 0, "eos_token_id": 1}
    for key, value in {**values, **(meta or {})}.items():
        if value is not None:
            getattr(w, f"add_{key}")(value)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)

    kv = d // heads
    w.add_tensor("token_embd.weight", rand(vocab, d))
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    w.add_tensor("output.weight", rand(vocab, d))
    for i in range(layers):
        for name, shape in (("attn_q", (d, d)), ("attn_k", (kv, d)), ("attn_v", (kv, d)), ("attn_output", (d, d)),
                            ("ffn_gate", (ff, d)), ("ffn_up", (ff, d)), ("ffn_down", (d, ff))):
            w.add_tensor(f"blk.{i}.{name}.weight", rand(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _model(**keys):
    """smollm2-135m's config with its source replaced by ``keys``."""
    base = {k: v for k, v in model_config("smollm2-135m").items() if k not in ("gguf_asset",)}
    return OmegaConf.create({**base, "name": "g", "gguf_asset": None, **keys})


@pytest.fixture
def conversions(monkeypatch, tmp_path):
    """Calls that dequantise a GGUF file (``from_pretrained(..., gguf_file=...)``); the cache in tmp."""
    import transformers

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    calls = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def recorded(*args, **kwargs):
        if kwargs.get("gguf_file"):
            calls.append(kwargs["gguf_file"])
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", recorded)
    return calls


def test_local_gguf_file_loads_once_converted_from_every_spelling(tmp_path, conversions):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfspec.decoding.vanilla import Vanilla

    path = write_gguf(tmp_path / "tiny.gguf")
    loaded = load_model(_model(gguf_path=str(path)))
    assert conversions == ["tiny.gguf"]  # dequantised once ...
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    ids = tok("hello there")["input_ids"]
    want = ref.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert Vanilla(loaded.model).generate(ids, 8).tokens == want
    for spelling in ({"name_or_path": str(path)}, {"name_or_path": str(tmp_path), "gguf_file": "tiny.gguf"}):
        again = load_model(_model(**spelling))
        assert (again.fingerprint, again.weights_digest) == (loaded.fingerprint, loaded.weights_digest)
    assert conversions == ["tiny.gguf", "tiny.gguf"]  # ... then read from the cache (+1: the reference)


def test_a_gguf_files_metadata_is_parsed_once_per_conversion(tmp_path, conversions, monkeypatch):
    """transformers builds a new reader of the file for its tokenizer, its config and its weights,
    and the check before them one more: four parses of every token string (Gemma 3's 262,144 took
    about 20 s each). Now one, shared; another file opened meanwhile gets its own reader."""
    import gguf

    path, other = write_gguf(tmp_path / "tiny.gguf"), write_gguf(tmp_path / "other.gguf", seed=1)
    parsed, real = [], gguf.GGUFReader.__init__

    def counted(self, file, *args, **kwargs):
        parsed.append(Path(file).name)
        real(self, file, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted)
    from selfspec.models import gguf_file

    dequantise = gguf_file.dequantise

    def with_another_file(gguf_path, name):
        assert gguf.GGUFReader(other).fields is not gguf.GGUFReader(gguf_path).fields
        return dequantise(gguf_path, name)

    monkeypatch.setattr(gguf_file, "dequantise", with_another_file)
    load_model(_model(gguf_path=str(path)))
    assert conversions == ["tiny.gguf"] and parsed == ["tiny.gguf", "other.gguf"]
    assert isinstance(gguf.GGUFReader, type)  # restored after the conversion


def test_unsupported_gguf_architecture_is_refused_before_dequantising(tmp_path, conversions):
    path = write_gguf(tmp_path / "other.gguf", arch="gpt2")
    for keys in ({"gguf_path": str(path)}, {"name_or_path": str(path)}):
        with pytest.raises(UnsupportedModelError, match=r"GGUF file .*other\.gguf\) has model_type='gpt2'.*llama"):
            load_model(_model(**keys))
    assert conversions == [] and not (tmp_path / "cache" / "models").exists()


@pytest.mark.parametrize("keys,message", [
    ({"gguf_path": "/nonexistent/m.gguf"}, r"model\.gguf_path=/nonexistent/m\.gguf is not allowed: no such file"),
    ({"name_or_path": "/nonexistent/m.gguf"}, r"model\.name_or_path=/nonexistent/m\.gguf is not allowed: no such file"),
    ({"gguf_asset": "/models/m.gguf"}, r"model\.gguf_asset=/models/m\.gguf is not allowed: must be an offline asset: "
                                       r"one of smollm2-gguf.*use model\.gguf_path=<file>"),
    ({"gguf_file": "m.gguf"}, r"model\.gguf_file=m\.gguf is not allowed: names a GGUF file inside model\.name_or_path"),
    ({"gguf_path": "a.gguf", "name_or_path": "b"}, r"model\.gguf_path and model\.name_or_path both name"),
    ({"gguf_asset": "smollm2-gguf", "hub_id": "x/y"}, r"model\.hub_id is not a key of a model config"),
    ({"name_or_path": "x/y", "tokenizer": "smollm2-135m"}, r"model\.tokenizer=smollm2-135m is not allowed: set only "
                                                           r"with model\.random"),
])
def test_bad_model_sources_are_named(keys, message):
    with pytest.raises(ConfigError, match=message):
        load_model(_model(**keys))


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = _file(tmp_path, "notes.gguf", "plain text")
    with pytest.raises(ConfigError, match=r"notes\.gguf is not allowed: not a GGUF file"):
        load_model(_model(gguf_path=str(path)))


@pytest.mark.parametrize("part", ["tensors", "metadata"])
def test_a_truncated_gguf_file_is_refused_naming_its_size_and_what_it_lacks(tmp_path, conversions, part):
    """Issue 68's probe: a GGUF file cut short (an interrupted download) was refused with numpy's
    internals ("cannot reshape array of size 294 ...", "When changing to a larger dtype, its size must
    be a divisor ..."). Now the memory check's shape read and the load both say the file is shorter
    than its tensors (or its metadata) need, with the sizes, and to download it again."""
    from selfspec.measure.peak import shape_of

    data = write_gguf(tmp_path / "full.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:len(data) // 2 if part == "tensors" else 500])
    size = path.stat().st_size
    need = (rf"shorter than its tensors need \({size} bytes, the tensors end at {len(data)}\)" if part == "tensors"
            else rf"shorter than its metadata needs \({size} bytes, the metadata runs past the end\)")
    message = rf"^model config 'g': GGUF file {re.escape(str(path))} is {need}: download it again$"
    with pytest.raises(ModelLoadError, match=message):
        shape_of(_model(gguf_path=str(path)))
    with pytest.raises(ModelLoadError, match=message):
        load_model(_model(gguf_path=str(path)))
    assert conversions == [] and not (tmp_path / "cache" / "models").exists()


def test_a_fifo_as_gguf_path_is_called_not_a_regular_file(tmp_path):
    """Issue 68's probe: a named pipe given as ``model.gguf_path`` was refused as "not a directory";
    now the message says what it is."""
    import os

    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=rf"model\.gguf_path={re.escape(str(fifo))} is not allowed: must be a "
                                          r"regular GGUF file, and it is a FIFO$"):
        load_model(_model(gguf_path=str(fifo)))
    with pytest.raises(ConfigError, match=r"is not allowed: must be a regular GGUF file, and it is a directory$"):
        load_model(_model(gguf_path=str(tmp_path)))


def test_gguf_file_with_one_byte_changed_is_converted_again(tmp_path, conversions):
    """Finding: a GGUF file's conversion was cached under its path, size and modification time, so
    other bytes could be read as the earlier file's model. Reproduction: load a tiny GGUF file, flip
    the last byte of its last tensor in place (size kept, mtime restored) and load it again: before,
    the second load read the first conversion; now the cache entry is named by the file's sha256, so
    the changed file gets its own. The same bytes under another path share the conversion."""
    from selfspec.store.assets import sha256_of

    path = write_gguf(tmp_path / "tiny.gguf")
    first = sha256_of(path)
    load_model(_model(gguf_path=str(path)))
    flip_last_byte(path)
    load_model(_model(gguf_path=str(path)))
    assert conversions == ["tiny.gguf", "tiny.gguf"]
    entries = sorted(p.name for p in (tmp_path / "cache" / "models").iterdir())
    assert entries == sorted([f"tiny-{first[:16]}", f"tiny-{sha256_of(path)[:16]}"])
    copy = tmp_path / "elsewhere" / "tiny.gguf"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    load_model(_model(gguf_path=str(copy)))
    assert len(conversions) == 2


def test_damaged_asset_gguf_is_refused_before_dequantising(tmp_path, request):
    """Finding: the package's GGUF asset was only size-checked, so a copy with one byte flipped was
    dequantised and its conversion cached under the genuine asset's name. Reproduction: copy the
    asset into a fresh cache, flip its last byte (size kept, mtime restored), load the embedded
    default: before, it was dequantised; now it is refused by name before anything is read, and the
    genuine file's conversion is named by its pinned sha256."""
    from selfspec.models.loading import Source, _cache_name
    from selfspec.store.assets import ASSETS, AssetDamagedError, asset_path

    source = asset_path("smollm2-gguf")  # the shared cache's, before the test's cache replaces it
    conversions = request.getfixturevalue("conversions")
    pinned = ASSETS["smollm2-gguf"].files[source.name]
    assert _cache_name(Source("asset", "smollm2-gguf", "model.gguf_asset"), source) == \
        f"SmolLM2-135M-Instruct.Q4_1-{pinned[:16]}"
    shutil.copytree(source.parent, tmp_path / "cache" / "smollm2-gguf")  # a copy: the shared cache stays intact
    flip_last_byte(tmp_path / "cache" / "smollm2-gguf" / source.name)
    with pytest.raises(AssetDamagedError, match=r"offline asset 'smollm2-gguf' .* damaged .*SmolLM2-135M-Instruct"
                                                r"\.Q4_1\.gguf has sha256 .*--only smollm2-gguf"):
        load_model(model_config("smollm2-135m"))
    assert conversions == [] and not (tmp_path / "cache" / "models").exists()


@pytest.mark.parametrize("meta,problem", [
    ({"head_count": 3}, r"has inconsistent metadata: llama\.embedding_length=16 is not a multiple of "
                        r"llama\.attention\.head_count=3"),
    ({"head_count_kv": 3}, r"llama\.attention\.head_count=2 is not a multiple of llama\.attention\.head_count_kv=3"),
    ({"block_count": None}, r"has inconsistent metadata: missing key llama\.block_count"),
    ({"layer_norm_rms_eps": None}, r"missing key llama\.attention\.layer_norm_rms_epsilon"),
    ({"token_list": None}, r"missing key tokenizer\.ggml\.tokens"),
    ({"block_count": 3}, r"llama\.block_count=3 but the file holds tensors of 2 blocks \(blk\.0 to blk\.1\)"),
    ({"feed_forward_length": 48}, r"tensor model\.layers\.0\.mlp\.down_proj\.weight has shape \(16, 32\) in the "
                                  r"file, \(16, 48\) by its metadata"),
    ({"tokenizer_model": "nonsense"}, r"transformers cannot build a model from it .*: ValueError: Cannot build a "
                                      r"tokenizer from a GGUF file stating tokenizer 'nonsense'"),
])
def test_inconsistent_gguf_metadata_is_one_error_naming_the_file(tmp_path, conversions, meta, problem):
    """Finding: a GGUF file whose metadata is inconsistent gave a raw transformers validation error
    without the file's name (or, for a missing block count or norm epsilon, silently a model of
    transformers' defaults with random layers). Reproduction: write a tiny GGUF file with one
    metadata value changed or left out and load it: before, e.g. ``StrictDataclassClassValidationError:
    Class validation error for validator 'validate_architecture'`` or no error; now one line naming
    the model config, the file and the problem, and nothing is cached."""
    path = write_gguf(tmp_path / "bad.gguf", meta=meta)
    with pytest.raises(ModelLoadError) as caught:
        load_model(_model(gguf_path=str(path)))
    message = str(caught.value)
    assert "\n" not in message and re.search(rf"^model config 'g': GGUF file {re.escape(str(path))}.*{problem}", message)
    assert not (tmp_path / "cache" / "models").exists()


@pytest.mark.slow
def test_smollm2_gguf_path_decodes_like_the_embedded_default(smol, tmp_path, monkeypatch):
    from selfspec.decoding.vanilla import Vanilla
    from selfspec.store.assets import asset_path

    path = asset_path("smollm2-gguf")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))  # its own conversion, not the default's
    mine = load_model(OmegaConf.merge(model_config("smollm2-135m"), {"gguf_path": str(path)}))
    assert (mine.fingerprint, mine.weights_digest) == (smol.fingerprint, smol.weights_digest)
    ids = smol.tokenizer("Article: The quick brown fox jumps over the lazy dog.\nSummary:")["input_ids"]
    assert Vanilla(mine.model).generate(ids, 16).tokens == Vanilla(smol.model).generate(ids, 16).tokens


# --- artefacts record the weights --------------------------------------------------------------
def test_artefact_of_other_weights_is_refused(tiny, tmp_path):
    seed1 = load_model(OmegaConf.merge(model_config("tiny-random"), {"random": {"seed": 1}}))
    assert seed1.fingerprint == tiny.fingerprint and seed1.weights_digest != tiny.weights_digest
    path = save_heads(tmp_path / "h", IntermediateHeads.identity(tiny.model, [1, 2]), tiny)
    message = (rf"heads artefact {re.escape(str(path))} was trained for model 'tiny-random' with other weights "
               rf"\(weights={tiny.weights_digest}\) than the loaded model 'tiny-random' \(weights={seed1.weights_digest}\)")
    with pytest.raises(ArtefactError, match=message):
        load_heads(path, seed1)
    cfg = method_config("adadecode", heads_dir=str(path))
    with pytest.raises(ArtefactError, match="other weights"):
        build_decoder(cfg, seed1.model)
    assert load_heads(path, tiny).layers == [1, 2]  # the same seed loads
    bf16 = load_model(OmegaConf.merge(model_config("tiny-random"), {"dtype": "bfloat16"}))
    assert bf16.weights_digest == tiny.weights_digest  # the same weights in another dtype
    assert load_heads(path, bf16).layers == [1, 2]


def test_artefact_formats_read_and_refused(tiny, tmp_path):
    """docs/design/assets-and-formats.md §9: an artefact of format 2 (this selfspec's) and of format 1 (no
    ``format`` field, with a weights digest) load; one older than format 1 (no weights digest) or of a
    newer format is refused, naming the job that rebuilds it."""
    from selfspec.store.artefacts import ARTEFACT_FORMAT

    path = save_heads(tmp_path / "h", IntermediateHeads.identity(tiny.model, [1]), tiny)
    meta = json.loads((path / META).read_text())
    assert meta["format"] == ARTEFACT_FORMAT == 2 and load_heads(path, tiny).layers == [1]
    for changed, message in (({"format": None}, None),  # format 1: no format field
                             ({"format": None, "weights": None}, r"has no weights digest: it is older than format 1"),
                             ({"format": 3}, r"is of format 3; this selfspec reads formats 1, 2")):
        written = {k: v for k, v in {**meta, **changed}.items() if v is not None}
        (path / META).write_text(json.dumps(written))
        if message is None:
            assert load_heads(path, tiny).layers == [1]
        else:
            with pytest.raises(ArtefactError, match=message + r".*rebuild it with `python -m selfspec.train job=heads"):
                load_heads(path, tiny)


@pytest.mark.parametrize("override,message", [
    ("hydra.launcher.timeout_min=-5", r"hydra\.launcher\.timeout_min=-5 is not allowed: must be >= 1"),
    ("hydra.launcher.cpus_per_task=0", r"hydra\.launcher\.cpus_per_task=0 is not allowed: must be >= 1"),
])
def test_a_launchers_impossible_settings_are_refused_before_a_job_is_submitted(tmp_path, override, message):
    """Issue 39's probe: ``hydra.launcher.timeout_min=-5`` went to Slurm unchecked and came back as
    a raw FailedJobError. The launcher's sizes are checked when the multirun starts, by key; no job
    is submitted (the local submitit launcher here: the same settings as Slurm's)."""
    proc = subprocess.run([sys.executable, "-m", "selfspec.evaluate", "-m", "hydra/launcher=submitit_local",
                           override, "model=tiny-random", "task=xsum", "logger=none",
                           f"hydra.sweep.dir={tmp_path / 'sweep'}"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and re.search(message, proc.stderr), proc.stderr[-2000:]
    assert not (tmp_path / "sweep" / ".submitit").exists()


# --- scripts/bench.py ----------------------------------------------------------------------------
@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench

    return bench


def test_bench_tables_keep_their_columns_for_a_method_name_longer_than_the_first_column(bench):
    """``quant_draft_ngram_cascade`` (25 characters) pushed its row's figures out of their columns in
    both of bench's tables: the first column is as wide as the longest name now."""
    row = {"n_examples": 1, "tokens_per_s": 50.56, "seconds_per_token": 0.0198, "speedup": 1.656, "decode_speedup": 2.0,
           "predicted_speedup": 1.58, "tau": 4.62, "acceptance_rate": 0.585, "consistency": 1.0}
    names = ("vanilla", "quant_draft_ngram_cascade")
    summary = {"methods": {m: row for m in names}, "baseline": "vanilla", "model": "m", "task": "t",
               "max_new_tokens": 8, "greedy": True, "run_info": {"device": "cpu", "dtype": "float32", "hardware": {}}}
    for text in (bench.report(summary), bench.batch_table({m: {1: row} for m in names}, [1])):
        lines = [x for x in text.splitlines()[1:] if x.strip()]
        assert len({len(x) for x in lines}) == 1, text  # every row as wide as the header: no column moved
        assert all(x.startswith(names) or x.startswith(("method", " ")) for x in lines), text


@pytest.mark.parametrize("value", ["abc", "1.5", ",", "", "2,", "0", "-1", "2,2"])
def test_bench_batch_sizes_other_than_positive_integers_are_refused_naming_the_flag(bench, capsys, value):
    """Issue 68's probe: ``--batch-sizes abc``, ``1.5`` and ``,`` ended in a raw ValueError, and
    ``''`` ran a plain benchmark as if the flag were not given. Now argparse refuses each, naming
    the flag and what it takes, before anything is composed."""
    with pytest.raises(SystemExit) as caught:
        bench.parse(["--batch-sizes", value])
    assert caught.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"argument --batch-sizes: takes comma-separated positive integers, each once "
                     rf"\(1,2,4,8\), got {re.escape(repr(value))}$", err), err
    assert bench.parse(["--batch-sizes", " 1, 2,8"]).batch_sizes == [1, 2, 8]


def test_bench_batch_sizes_check_the_memory_of_every_size_before_the_model_loads(bench, no_model_load, monkeypatch,
                                                                                tmp_path):
    """Issue 68's probe: ``bench.py --batch-sizes`` loaded the model once and handed it to each run,
    so the runner's memory check (made only when it loads the model itself) never ran. Now every
    size's config, its ``batch_size`` included, is checked before the one load."""
    import selfspec.measure.peak as peak

    checked = []

    def check_fits(job, model, cfg, context=peak.EVAL_CONTEXT, prompt=None):
        checked.append(int(cfg.batch_size))
        if cfg.batch_size > 2:
            raise peak.MemoryRefused(f"batch_size={cfg.batch_size} does not fit (simulated)")

    monkeypatch.setattr(peak, "check_fits", check_fits)
    with pytest.raises(peak.MemoryRefused, match=r"batch_size=4 does not fit"):
        bench.main(["--model", "tiny-random", "--n", "4", "--warmup", "0", "--methods", "vanilla", "--batch-sizes",
                    "1,2,4", "--out", str(tmp_path / "bench"), "--", "logger=none", "progress=false"])
    assert checked == [1, 2, 4]

"""Bad input stops early, with one message naming what to change: local data files, impossible
config values, model sources (GGUF files)."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from selfspec.checks import ConfigError
from selfspec.config import compose, group_options, model_config
from selfspec.decoding import check_method
from selfspec.evaluation import method_configs
from selfspec.models.layered import UnsupportedModelError
from selfspec.models.loading import load_model
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


# --- impossible config values ------------------------------------------------------------------
def test_every_shipped_method_config_passes():
    """Each conf/method file reads every key it sets; hf_assisted alone needs a value from the user."""
    cfg = compose(["compare=[" + ",".join(group_options("method")) + "]"])
    for name, m in method_configs(cfg, label="vanilla").items():
        if name == "hf_assisted":
            with pytest.raises(ConfigError, match=r"method\.assistant=null"):
                check_method(m)
        else:
            check_method(m)


# --- model sources: local GGUF files -------------------------------------------------------------
def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte alphabet: a byte-level BPE vocabulary of 256 single-character tokens."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:] + [256 + n for n in range(256 - len(bs))]
    bs += [b for b in range(256) if b not in bs]
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_gguf(path: Path, arch: str = "llama", d: int = 16, layers: int = 2, seed: int = 0) -> Path:
    """A tiny GGUF file as llama.cpp names its tensors: random F32 weights, a byte-level tokenizer."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens = _bytes_to_unicode() + ["he"]
    vocab, heads, ff = len(tokens), 2, 32
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(128)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab)
    w.add_token_merges(["h e"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

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
    return OmegaConf.create({"name": "g", "dtype": "float32", "device": "cpu", **keys})


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
        assert again.fingerprint == loaded.fingerprint
    assert conversions == ["tiny.gguf", "tiny.gguf"]  # ... then read from the cache (+1: the reference)


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


@pytest.mark.slow
def test_smollm2_gguf_path_decodes_like_the_embedded_default(smol, tmp_path, monkeypatch):
    from selfspec.assets import asset_path
    from selfspec.decoding.vanilla import Vanilla

    path = asset_path("smollm2-gguf")
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))  # its own conversion, not the default's
    mine = load_model(OmegaConf.merge(model_config("smollm2-135m"), {"gguf_path": str(path)}))
    assert mine.fingerprint == smol.fingerprint
    ids = smol.tokenizer("Article: The quick brown fox jumps over the lazy dog.\nSummary:")["input_ids"]
    assert Vanilla(mine.model).generate(ids, 16).tokens == Vanilla(smol.model).generate(ids, 16).tokens

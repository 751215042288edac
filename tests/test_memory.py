"""The memory model (selfspec.measure.peak; the table of selfspec.memory): shapes, the estimate against
the measured CPU points, the refusal before the model loads, and the README's table."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from selfspec import memory
from selfspec.config import compose, model_config
from selfspec.measure import peak

ROOT = Path(__file__).resolve().parents[1]
MEASURED = json.loads((ROOT / "docs" / "memory_measured.json").read_text())["points"]


def test_shapes_count_the_public_parameter_counts():
    # Llama-3.2-1B: 1,235,814,400 parameters (tied); Llama-3-8B: 8,030,261,248; SmolLM2-135M: 134,515,008
    assert peak.shape_of(model_config("llama3.2-1b-random")).params == 1_235_814_400
    assert peak.shape_of(model_config("llama3-8b-random")).params == 8_030_261_248
    assert peak.SIZES["1B"].params == 1_235_814_400 and peak.SIZES["8B"].params == 8_030_261_248
    assert peak.shape_of(model_config("smollm2-135m")).params == 134_515_008


@pytest.mark.parametrize("point", MEASURED, ids=lambda p: f"{p['shape']}-{p['job']}-{'_'.join(p['settings'])}")
def test_estimate_within_the_stated_error_of_every_measured_point(point):
    cfg = compose(point["overrides"], config_name=memory.primary_config(point["job"]))
    est = memory.job_estimate(point["job"], peak.shape_of(cfg.model), cfg, getattr(torch, point["dtype"]),
                          torch.device("cpu"))
    assert abs(est.total / point["job_peak"] - 1) <= peak.ERROR + 1e-9


def test_the_stated_error_is_the_largest_over_the_points():
    errors = []
    for point in MEASURED:
        cfg = compose(point["overrides"], config_name=memory.primary_config(point["job"]))
        est = memory.job_estimate(point["job"], peak.shape_of(cfg.model), cfg, getattr(torch, point["dtype"]),
                              torch.device("cpu"))
        errors.append(abs(est.total / point["job_peak"] - 1))
    assert max(errors) == pytest.approx(peak.ERROR, abs=0.005)


def test_a_gguf_files_shape_is_read_once_per_version_of_the_file(tmp_path, monkeypatch):
    """Found timing the tests (2026-11-29): every check of the embedded default's memory read SmolLM2's
    GGUF metadata again (gguf's reader parses the tokenizer's 49,152 strings: 3-8 s), so each test of
    settings refused before the load took about 5 s. A file's shape is now read once per process for
    each version of the file (its path, size, modification time and inode). Found again (2026-12-02):
    each new process read it again, 3-5 s before any model loaded, tiny-random's included (its
    vocabulary is SmolLM2's tokenizer's): each of the README's commands paid it. The shape is now
    kept on disk too, per version of the file; a record of another version, or not one selfspec
    wrote, is not taken."""
    import json
    import os
    import shutil

    from selfspec.models import gguf_file, loading
    from selfspec.store.assets import asset_path

    gguf = asset_path("smollm2-gguf")  # before the cache moves: the asset stays where it was fetched
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    reads = []
    real = gguf_file.read
    parsed = real(gguf, "smollm2-135m")  # parsed once (3-5 s): each read below is counted, the files are alike
    monkeypatch.setattr(gguf_file, "read",
                        lambda path, name: reads.append(path) or (parsed if Path(path).is_file() else real(path, name)))
    peak._cached_gguf_shape.cache_clear()
    first = peak._gguf_shape(gguf, "smollm2-135m")
    assert peak._gguf_shape(gguf, "smollm2-135m") == first and len(reads) == 1
    peak._cached_gguf_shape.cache_clear()  # as a new process
    assert peak._gguf_shape(gguf, "smollm2-135m") == first and len(reads) == 1  # from the disk
    (record,) = (tmp_path / "cache" / "gguf-shapes-1").glob("*.json")
    kept = json.loads(record.read_text())
    kept["value"]["layers"] += 1
    kept["stamp"]["size"] += 1  # a record of another version of the file: not taken
    record.write_text(json.dumps(kept))
    peak._cached_gguf_shape.cache_clear()
    assert peak._gguf_shape(gguf, "smollm2-135m") == first and len(reads) == 2
    record.write_text("{not json")  # not one selfspec wrote
    peak._cached_gguf_shape.cache_clear()
    assert peak._gguf_shape(gguf, "smollm2-135m") == first and len(reads) == 3
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(gguf, copy)
    assert peak._gguf_shape(copy, "copy") == first and len(reads) == 4
    assert peak._gguf_shape(copy, "copy") == first and len(reads) == 4
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # another version of the file
    peak._cached_gguf_shape.cache_clear()
    assert peak._gguf_shape(copy, "copy") == first and len(reads) == 5
    copy.unlink()
    with pytest.raises(loading.ModelLoadError, match="copy.gguf"):
        peak._gguf_shape(copy, "copy")
    peak._cached_gguf_shape.cache_clear()


def test_activation_terms_grow_with_batch_and_sequence():
    shape = peak.SIZES["8B"]
    small = compose(["model=tiny-random", "job=prompts", "job.inserts=4"], config_name="train")
    large = compose(["model=tiny-random", "job=prompts", "job.inserts=64"], config_name="train")
    cuda = torch.device("cuda")
    a = memory.job_estimate("prompts", shape, small, torch.bfloat16, cuda)
    b = memory.job_estimate("prompts", shape, large, torch.bfloat16, cuda)
    assert b.total > a.total and a.weights == b.weights == shape.params * 2 and a.runtime == 0.0


def test_a_job_that_cannot_fit_is_refused_before_the_model_loads(monkeypatch, tmp_path):
    from selfspec.models import loading
    from selfspec.train import run_job

    monkeypatch.setenv("SELFSPEC_OUTPUTS", str(tmp_path))
    monkeypatch.setattr(peak, "device_memory", lambda device: (100 * 2**20, "a fake 100 MB device"))

    def no_load(cfg):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(loading, "load_model", no_load)
    cfg = compose(["model=tiny-random", "job=heads", "logger=none", "progress=false"], config_name="train")
    with pytest.raises(peak.MemoryRefused) as err:
        run_job(cfg)
    message = str(err.value)
    est = memory.job_estimate("heads", peak.shape_of(cfg.model), cfg, torch.float32, torch.device("cpu"))
    assert f"{est.total / 1e9:.1f} GB" in message and "a fake 100 MB device" in message
    assert re.search(r"Lower job\.\w+", message) and est.largest().setting in message
    assert "memory_check=false" in message
    # memory_check=false skips the check (the model would then load)
    off = compose(["model=tiny-random", "job=heads", "memory_check=false"], config_name="train")
    assert peak.check_fits("heads", memory.memory_model("heads"), off) is None


def test_a_job_that_fits_passes():
    cfg = compose(["model=tiny-random", "job=heads"], config_name="train")
    est = peak.check_fits("heads", memory.memory_model("heads"), cfg)
    assert est is not None and est.total < peak.device_memory(torch.device("cpu"))[0]


def test_documented_table_is_the_generated_one():
    usage = (ROOT / "docs" / "usage.md").read_text()
    assert memory.table() in usage


def test_checkpointing_and_chunking_shrink_their_terms():
    """The two settings that bound activations without changing the result lower the term they name."""
    shape = peak.SIZES["8B"]

    def term(job, name, *overrides):
        cfg = compose(["model=tiny-random", f"job={job}", *overrides], config_name="train")
        return next(t.bytes for phase in memory.terms(job, shape, cfg, 2) for t in phase if t.name == name)

    plain = term("prompts", "backward through the model", "job.n_ept=100")
    ckpt = term("prompts", "backward through the model", "job.n_ept=100", "job.gradient_checkpointing=true")
    assert ckpt < plain / 5
    assert term("heads", "kl", "job.kl_chunk=16") == pytest.approx(term("heads", "kl") * 16 / 128)


def test_an_evaluation_that_cannot_fit_is_refused_before_the_model_loads(monkeypatch, tmp_path):
    from selfspec.evaluation import runner
    from selfspec.models import loading

    monkeypatch.setattr(peak, "device_memory", lambda device: (100 * 2**20, "a fake 100 MB device"))
    monkeypatch.setattr(loading, "load_model", lambda cfg: (_ for _ in ()).throw(AssertionError("loaded")))
    cfg = compose(["model=tiny-random", "task=xsum", "n_examples=1", "logger=none", "progress=false"])
    with pytest.raises(peak.MemoryRefused, match=r"job=evaluate .*a fake 100 MB device.*memory_check=false"):
        runner.evaluate(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


def _gguf(path, drop=(), **meta):
    """A small Llama GGUF file (metadata and zero tensors of a 2-layer, 64-wide model), with
    metadata fields left out (``drop``) or replaced (``meta``)."""
    import numpy as np
    from gguf import GGUFWriter

    fields = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
              "attention.head_count_kv": 2, "context_length": 256} | meta
    w = GGUFWriter(str(path), "llama")
    for key, value in fields.items():
        if key not in drop:
            w.add_uint32(f"llama.{key}", value)
    w.add_token_list([f"t{i}".encode() for i in range(100)])
    d, f, kv = 64, 128, 32
    shapes = {"token_embd.weight": (100, d), "output_norm.weight": (d,)}
    for i in range(2):
        shapes |= {f"blk.{i}.attn_q.weight": (d, d), f"blk.{i}.attn_k.weight": (kv, d),
                   f"blk.{i}.attn_v.weight": (kv, d), f"blk.{i}.attn_output.weight": (d, d),
                   f"blk.{i}.ffn_gate.weight": (f, d), f"blk.{i}.ffn_up.weight": (f, d),
                   f"blk.{i}.ffn_down.weight": (d, f), f"blk.{i}.attn_norm.weight": (d,),
                   f"blk.{i}.ffn_norm.weight": (d,)}
    for name, shape in shapes.items():
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_files_shape_is_read_from_its_metadata(tmp_path):
    cfg = compose(["model=smollm2-135m", f"model.gguf_path={_gguf(tmp_path / 'ok.gguf')}"]).model
    assert peak.shape_of(cfg) == peak.Shape(2, 64, 128, 4, 2, 16, 100, True)


@pytest.mark.parametrize("drop,meta,message", [
    (("feed_forward_length",), {}, r"llama\.feed_forward_length is missing"),
    ((), {"attention.head_count": 0}, r"llama\.attention\.head_count is 0, not a positive whole number"),
    (("block_count",), {}, r"llama\.block_count is missing"),
    ((), {"attention.head_count": 3}, r"llama\.attention\.head_count 3 does not divide llama\.embedding_length 64"),
    ((), {"feed_forward_length": 1_000_000}, r"its metadata describes .* parameters, its tensors hold 80,448"),
])
def test_a_gguf_file_with_bad_metadata_is_refused_by_name_before_the_model_loads(tmp_path, drop, meta, message):
    """Issue 39's probe: the memory check read GGUF metadata before checking it: missing or zero
    fields gave raw TypeError / KeyError / ZeroDivisionError, and a lying feed_forward_length got
    "needs 1472.5 GB, lower the task's prompts". Now one message names the file and the field."""
    path = _gguf(tmp_path / "bad.gguf", drop, **meta)
    cfg = compose(["model=smollm2-135m", f"model.gguf_path={path}"]).model
    with pytest.raises(ValueError, match=f"GGUF file {path}: {message}"):
        peak.shape_of(cfg)


def test_weights_that_cannot_fit_are_not_blamed_on_the_prompts(monkeypatch):
    """Issue 39: a model whose weights alone exceed the device was told to lower the task's prompts,
    and a huge max_new_tokens was too; each now names what would help."""
    monkeypatch.setattr(peak, "device_memory", lambda device: (2 * 2**20, "a fake 2 MB device"))
    cfg = compose(["model=tiny-random", "task=xsum"])
    with pytest.raises(peak.MemoryRefused, match=r"the weights alone .* more than a fake 2 MB device.*model\.dtype"):
        peak.check_fits("evaluate", memory.memory_model("evaluate"), cfg, 100, prompt=64)
    monkeypatch.setattr(peak, "device_memory", lambda device: (60 * 2**20, "a fake 60 MB device"))
    with pytest.raises(peak.MemoryRefused, match=r"Lower max_new_tokens"):
        peak.check_fits("evaluate", memory.memory_model("evaluate"), cfg, 64 + 1_000_000, prompt=64)

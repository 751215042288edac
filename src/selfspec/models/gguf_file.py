"""Reading a GGUF file: its metadata, its tensor table, its checks, and its dequantisation into a
transformers model. The one module that reads GGUF: model loading (:mod:`selfspec.models.loading`:
a GGUF source is checked here, then dequantised here and cached as safetensors there) and the shape
record (:func:`selfspec.measure.peak.shape_of`: a model's sizes from its file's metadata) read
through it. :mod:`selfspec.models.gguf_export` writes GGUF files (gguf's ``GGUFWriter``) and reads
none.

What is read: the header and metadata (:func:`read`, :func:`metadata_value`, :func:`architecture`)
and the tensor table (``reader.tensors``: names, shapes, types and offsets; no tensor's data is read
until transformers dequantises it, :func:`dequantise`). What is checked before anything is
dequantised: the file's length against what its header describes (:class:`CutShort`), its family
(:func:`check`) and its shape keys against each other and its tensors (:func:`metadata_problem`).
A file that fails is one :class:`~selfspec.models.families.ModelLoadError` naming it.
"""

from __future__ import annotations

import contextlib
import functools
import re
from pathlib import Path

import torch

from selfspec.models.families import GGUF_ARCHITECTURES, ModelLoadError, check_model_type


def metadata_value(reader, key: str):
    """A scalar or string metadata value of a GGUF file (None when absent or an array)."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None or not field.data or field.types[0] == GGUFValueType.ARRAY:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode("utf-8") if field.types[0] == GGUFValueType.STRING else value[0].item()


def architecture(path: Path) -> str | None:
    """A GGUF file's ``general.architecture`` (metadata only: no tensor is read)."""
    return metadata_value(reader_class()(path), "general.architecture")


@functools.lru_cache(maxsize=2)
def reader_class(checked: bool = False) -> type:
    """``gguf.GGUFReader`` reading through a plain ``numpy.ndarray`` view of its memory map instead
    of the ``numpy.memmap`` object: the same mapped pages, nothing copied, the tensors views of them
    as before. The reader parses the metadata in millions of small reads (a length, then a string,
    per token of the vocabulary), and each went through ``memmap``'s Python-level ``__getitem__``
    and ``__array_finalize__``: Gemma 3 270M's metadata took 11.4 s to parse, 4.0 s through the view
    (quiet Zen 4).

    A file shorter than its tensors need (an interrupted download) raises :class:`CutShort` with
    both sizes before gguf's reader views a tensor past the end (numpy's "cannot reshape array of
    size ..."). ``checked``: every read is checked against the file's size too, which finds metadata
    that runs past the end (numpy's "When changing to a larger dtype ..."); :func:`read` reads
    that way only after a plain read failed, the checks costing every small read."""
    import math

    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class PlainViewReader(GGUFReader):
        @property
        def data(self):
            return self._view

        @data.setter
        def data(self, mapped):  # the reader's memory map; the view keeps it alive (its base)
            self._view = mapped.view(np.ndarray)

        def _build_tensors(self, start_offs, fields):
            end = 0
            for field in fields:  # a tensor entry's parts: name length, name, number of dims, dims, type, offset
                dims, ggml_type, offset = field.parts[3], field.parts[4][0], field.parts[5][0]
                block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))]
                end = max(end, start_offs + int(offset) + math.prod(int(d) for d in dims) * type_bytes // block)
            if end > self._view.size:
                raise CutShort(f"is shorter than its tensors need ({self._view.size} bytes, the tensors end at {end})")
            super()._build_tensors(start_offs, fields)

    class CheckedReader(PlainViewReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            if offset + int(count) * np.dtype(dtype).itemsize > self._view.size:
                raise CutShort(f"is shorter than its metadata needs ({self._view.size} bytes, the metadata runs "
                                "past the end)")
            return super()._get(offset, dtype, count, override_order)

    return CheckedReader if checked else PlainViewReader


class CutShort(ValueError):
    """A GGUF file ends before what its header describes (:func:`reader_class`)."""


def read(gguf: Path, name: str):
    """A GGUF file's reader (metadata and tensor index; no tensor is read; :func:`reader_class`), or
    a :class:`ModelLoadError` naming the file: one cut short (issue 68) says so, with its size, and
    to download it again."""
    try:
        return reader_class()(gguf)
    except MemoryError:
        raise
    except Exception as err:
        problem = err if isinstance(err, CutShort) else cut_short(gguf)
        if problem is not None:
            raise ModelLoadError(f"model config {name!r}: GGUF file {gguf} {problem}: download it again") from err
        raise ModelLoadError(f"model config {name!r}: GGUF file {gguf} cannot be read: {one_line(err)}") from err


def cut_short(gguf: Path) -> CutShort | None:
    """After a failed read of ``gguf``: whether its metadata runs past its end (read again, each read
    checked: :func:`reader_class`); None when the read fails otherwise."""
    try:
        reader_class(checked=True)(gguf)
    except CutShort as err:
        return err
    except Exception:
        return None
    return None


def one_line(err: BaseException) -> str:
    """An exception as one line: its last non-empty line, with its type when that line has none."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    return line if re.match(r"^\w+(Error|Exception): ", line) else f"{type(err).__name__}: {line}"


def metadata_problem(reader, arch: str) -> str | None:
    """What in a GGUF file's metadata transformers cannot build the model from (None: nothing found):
    a missing key llama.cpp requires of these families (transformers would take a default, such as
    32 blocks or another norm epsilon, and build another model), a head count that does not divide
    the hidden size (or a KV head count the head count), a block count other than the number of
    ``blk.N`` tensor blocks."""
    keys = {k: f"{arch}.{k}" for k in ("block_count", "context_length", "embedding_length", "feed_forward_length",
                                       "attention.head_count", "attention.head_count_kv",
                                       "attention.layer_norm_rms_epsilon")}
    missing = [key for k, key in keys.items() if k != "attention.head_count_kv" and metadata_value(reader, key) is None]
    missing += [k for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if k not in reader.fields]
    if missing:
        return f"missing key{'s' * (len(missing) > 1)} {', '.join(missing)}"
    blocks, hidden, heads = (int(metadata_value(reader, keys[k])) for k in ("block_count", "embedding_length",
                                                                         "attention.head_count"))
    kv = metadata_value(reader, keys["attention.head_count_kv"])
    if heads <= 0 or hidden % heads:
        return f"{keys['embedding_length']}={hidden} is not a multiple of {keys['attention.head_count']}={heads}"
    if kv is not None and (int(kv) <= 0 or heads % int(kv)):
        return f"{keys['attention.head_count']}={heads} is not a multiple of {keys['attention.head_count_kv']}={kv}"
    found = {int(m.group(1)) for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))}
    if found != set(range(blocks)):
        return (f"{keys['block_count']}={blocks} but the file holds tensors of {len(found)} blocks"
                + (f" (blk.{min(found)} to blk.{max(found)})" if found else ""))
    return None


def check(gguf: Path, name: str):
    """Before anything is dequantised: the file's model family is one
    :class:`~selfspec.models.layered.LayeredModel` drives, and its metadata describes a model its
    tensors hold (:func:`metadata_problem`). Returns the file's reader."""
    reader = read(gguf, name)
    arch = metadata_value(reader, "general.architecture")
    check_model_type(GGUF_ARCHITECTURES.get(arch, arch), name, f"GGUF file {gguf}")
    problem = metadata_problem(reader, arch)
    if problem:
        raise ModelLoadError(f"model config {name!r}: GGUF file {gguf} has inconsistent metadata: {problem}")
    return reader


@contextlib.contextmanager
def parsed_once(gguf: Path, reader):
    """Within the block, ``gguf.GGUFReader`` of this file is ``reader``, the one already parsed.

    transformers builds a new reader each time it reads a GGUF file (its tokenizer, its config, its
    weights: three per conversion), and a reader parses the whole metadata, every token string of
    the vocabulary one by one: Gemma 3's 262,144 took about 20 s each on a 2-core machine, most of
    the conversion. The reader only reads the file (a read-only memory map), so one serves all.
    Other files, and other arguments, get a reader of their own."""
    import gguf as gguf_package

    real, target = gguf_package.GGUFReader, gguf.resolve()

    def reader_of(path, *args, **kwargs):
        if not args and not kwargs and Path(path).resolve() == target:
            return reader
        return real(path, *args, **kwargs)

    gguf_package.GGUFReader = reader_of
    try:
        yield
    finally:
        gguf_package.GGUFReader = real


def dequantise(gguf: Path, name: str):
    """transformers' tokenizer and float32 model of a GGUF file. Anything transformers refuses, a
    weight the model its metadata describes needs and the file does not hold, or one of another
    shape (transformers would initialise either at random) is one :class:`ModelLoadError` naming
    the file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = f"model config {name!r}: GGUF file {gguf}"
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        hf, info = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                        ignore_mismatched_sizes=True, output_loading_info=True)
    except MemoryError:
        raise
    except Exception as err:
        raise ModelLoadError(f"{where}: transformers cannot build a model from it (its metadata or tensors are "
                             f"inconsistent): {one_line(err)}") from err
    mismatched = sorted(info.get("mismatched_keys") or [])
    if mismatched:
        key, in_file, wanted = mismatched[0]
        raise ModelLoadError(f"{where} has inconsistent metadata: tensor {key} has shape {tuple(in_file)} in the "
                             f"file, {tuple(wanted)} by its metadata ({len(mismatched)} such tensor(s))")
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ModelLoadError(f"{where} lacks {len(missing)} weight(s) its metadata calls for (e.g. {missing[0]}); "
                             "transformers would initialise them at random")
    return hf, tok

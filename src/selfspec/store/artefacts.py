"""Trained artefacts — heads, prompt embeddings, skip sets, trees — as safetensors + ``meta.json``.

docs/design/contracts.md §2.5: ``meta.json`` records its format (:data:`ARTEFACT_FORMAT`), the kind, the model name,
the model fingerprint (config + tokenizer), the model's weights digest
(:func:`selfspec.models.loading.weights_digest`), layer count, hidden size, task, training config
and training metrics. :func:`load_artefact` checks the format (:data:`ARTEFACT_FORMATS`,
docs/design/assets-and-formats.md §9), kind, fingerprint and weights and fails with a message naming the mismatch. Writes
are atomic: a temporary directory is filled and renamed into place, so a crash never leaves a
half-written artefact.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from selfspec.store.files import disk_space, new_temporary_folder, plain_permissions, read_json, to_jsonable

META = "meta.json"
TENSORS = "tensors.safetensors"
#: the format of the artefacts this selfspec writes (meta.json's ``format``)
ARTEFACT_FORMAT = 2
#: the artefact formats read (docs/design/assets-and-formats.md §9): 2, written from issue 53 on, and 1, a
#: meta.json without a ``format`` field, with a weights digest (written from 2026-11-22, 82b9eff, on)
ARTEFACT_FORMATS = (1, 2)
#: artefact kind -> the training job that writes it (``python -m selfspec.train job=<job>``), for the
#: remedy a refusal names. Each job says the kind it writes itself (``JOB.kind``, found through the job
#: registry, :data:`selfspec.train.JOBS`), but the jobs lie floors above the store (tests/test_imports.py),
#: so the store cannot ask them: tests/test_registry.py checks this table against the registry, both ways
WRITTEN_BY = {"heads": "heads", "prompts": "prompts", "skip_set": "skips", "ppd_tree": "ppd_tree",
              "draft_vocab": "draft_vocab"}


class ArtefactError(ValueError):
    """A missing, malformed or mismatched artefact."""


@dataclass
class Artefact:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    path: Path


def _plain(obj):
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(obj):
            return OmegaConf.to_container(obj, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    return obj


def save_artefact(
    path: str | Path,
    kind: str,
    tensors: dict[str, torch.Tensor],
    loaded_model,
    *,
    task: str | None = None,
    train_config: Any = None,
    metrics: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    kernel_paths: dict[str, str] | None,
) -> Path:
    """Write ``path/`` atomically with ``tensors.safetensors`` and ``meta.json``.

    ``loaded_model`` is a :class:`~selfspec.models.loading.LoadedModel` (its name, fingerprint and
    weights digest go into the metadata); ``kernel_paths``, the caller's
    :func:`selfspec.models.kernels.paths`, goes into its run record (:func:`~selfspec.store.runinfo.run_info`).
    """
    from selfspec.store.runinfo import run_info

    path = Path(path)
    model = loaded_model.model
    meta = {
        "format": ARTEFACT_FORMAT,
        "kind": kind,
        "model": loaded_model.name,
        "fingerprint": loaded_model.fingerprint,
        "weights": loaded_model.weights_digest,
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "vocab_size": model.vocab_size,
        "task": task,
        "train_config": _plain(train_config),
        "metrics": metrics or {},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "run": run_info(kernel_paths=kernel_paths),
    }
    meta.update(extra or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_temporary_folder(path.parent, path.name)
    try:
        with disk_space(path):  # a full disk names the artefact; the one already there stays
            save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp / TENSORS))
            plain_permissions(tmp / TENSORS)  # safetensors makes it 0o600
            # strict JSON for every reader: NaN and infinities become null
            (tmp / META).write_text(json.dumps(to_jsonable(meta), indent=2, allow_nan=False))
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def read_meta(path: str | Path) -> dict[str, Any]:
    """An artefact's ``meta.json``: a strict JSON object (``NaN`` or ``Infinity`` are refused) in a
    regular file of bounded size (:func:`~selfspec.store.files.read_json`)."""
    path = Path(path)
    if not (path / META).exists():
        raise ArtefactError(f"{path} is not a selfspec artefact (no {META}); train one first or fix the path")
    try:
        meta = read_json(path / META)
    except (OSError, ValueError) as err:
        raise ArtefactError(f"{path / META} is not valid JSON ({err}); {rebuild_hint(path)}") from None
    if not isinstance(meta, dict):
        raise ArtefactError(f"{path / META} is not a JSON object; {rebuild_hint(path)}")
    return meta


def artefact_digest(path: str | Path) -> str:
    """16 hex digits naming what an artefact directory holds: its files' names and bytes (the same
    directory trained again is another artefact, whatever its path). A run records the digest of
    every artefact its methods read, and resumes only with the same ones."""
    import hashlib

    h = hashlib.sha256()
    for file in sorted(p for p in Path(path).iterdir() if p.is_file() and not p.name.startswith(".")):
        h.update(file.name.encode() + b"\0")
        with file.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def rebuild_hint(path: Path, kind: str | None = None) -> str:
    """How to write the artefact at ``path`` afresh: the training job of its kind."""
    return (f"rebuild it with `python -m selfspec.train job={_job(kind)} model=<model> artefact_dir={path}` "
            "or point the method at another artefact")


def _job(kind: str | None) -> str:
    """The training job that writes ``kind`` (:data:`WRITTEN_BY`), for a message."""
    return (WRITTEN_BY.get(kind) if isinstance(kind, str) else None) or "<job>"


def artefact_option(key: str, value: Any, kind: str) -> Path | None:
    """A config value naming an artefact directory of ``kind`` (``null``: the method's default
    location), checked without a model: the directory must hold a ``kind`` artefact."""
    from selfspec.config import checks

    if value is None:
        return None
    path = Path(checks.text(key, value)).expanduser()
    if not (path / META).exists():
        raise checks.refuse(key, value, f"no artefact there (no {META}); build one with `python -m "
                            f"selfspec.train job={_job(kind)} model=<model>` or fix the path")
    found = read_meta(path).get("kind")
    if found != kind:
        raise checks.refuse(key, value, f"it holds a {found!r} artefact, not {kind!r}")
    return path


def load_artefact(path: str | Path, kind: str, model=None, device=None) -> Artefact:
    """Load an artefact of ``kind``; with ``model`` (a LoadedModel or LayeredModel), check it was
    trained for that model: fingerprint and weights digest (when the model has them), layer
    count, hidden size."""
    path = Path(path)
    meta = read_meta(path)
    if meta.get("kind") != kind:
        raise ArtefactError(f"{path} holds a {meta.get('kind')!r} artefact, expected {kind!r}")
    check_format(meta, path)
    if model is not None:
        check_model(meta, path, model)
    try:
        tensors = load_file(str(path / TENSORS), device=str(device or "cpu"))
    except Exception as err:  # noqa: BLE001 — safetensors raises its own error type for a damaged file
        raise ArtefactError(f"{kind} artefact {path}: {TENSORS} cannot be read ({type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else 'truncated or damaged'}); "
                            f"{rebuild_hint(path, kind)}") from None
    return Artefact(tensors, meta, path)


def check_format(meta: dict[str, Any], path: Path) -> int:
    """The artefact's format (1 when meta.json has no ``format`` field), refused when this selfspec
    does not read it: a newer one, or an artefact older than format 1 (no weights digest)."""
    found = meta.get("format", 1)
    if found not in ARTEFACT_FORMATS:
        raise ArtefactError(f"{meta.get('kind')} artefact {path} is of format {found!r}; this selfspec reads formats "
                            f"{', '.join(map(str, ARTEFACT_FORMATS))} (docs/design/assets-and-formats.md §9); "
                            f"{rebuild_hint(path, meta.get('kind'))}")
    if meta.get("weights") is None:
        raise ArtefactError(f"{meta.get('kind')} artefact {path} has no weights digest: it is older than format 1 "
                            f"(written before 2026-11-22), which this selfspec no longer reads; "
                            f"{rebuild_hint(path, meta.get('kind'))}")
    return found


def check_model(meta: dict[str, Any], path: Path, model) -> None:
    """Raise :class:`ArtefactError` naming the first of fingerprint, weights digest, layer count and
    hidden size in which the artefact's model differs from ``model``."""
    layered = getattr(model, "model", model)
    kind = meta.get("kind")
    pairs = [("num_layers", layered.num_layers), ("hidden_size", layered.hidden_size)]
    if getattr(model, "fingerprint", None) is not None:
        pairs.insert(0, ("fingerprint", model.fingerprint))
    for key, have in pairs:
        if meta.get(key) != have:
            raise ArtefactError(
                f"{kind} artefact {path} was trained for model {meta.get('model')!r} "
                f"({key}={meta.get(key)}) but the loaded model {layered.name!r} has {key}={have}; "
                f"train one for this model or point the method at the right artefact"
            )
    have = getattr(model, "weights_digest", None)
    if have is not None and meta["weights"] != have:
        raise ArtefactError(
            f"{kind} artefact {path} was trained for model {meta.get('model')!r} with other weights "
            f"(weights={meta['weights']}) than the loaded model {layered.name!r} (weights={have}): same "
            "architecture and tokenizer, but another checkpoint, seed or quantisation; train one for "
            "these weights or point the method at the right artefact"
        )


def default_artefact_dir(kind: str, model_name: str, task: str | None = None) -> Path:
    """``outputs/artefacts/<kind>/<model>[-<task>]`` under the project (or ``SELFSPEC_OUTPUTS``)."""
    root = Path(os.environ.get("SELFSPEC_OUTPUTS", Path(__file__).resolve().parents[3] / "outputs"))
    return root / "artefacts" / kind / (f"{model_name}-{task}" if task else model_name)

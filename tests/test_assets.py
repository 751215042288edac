"""Asset registry and fetcher: no network (a fake archive and a patched download)."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import zipfile
from pathlib import Path

import pytest

from selfspec import assets
from selfspec.assets import Asset, AssetError, AssetMissingError

pytestmark = pytest.mark.filterwarnings("error")


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
        sha256=assets.sha256_of(archive), members=("fake/data/file.txt",), description="test"))
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


def test_tar_folder_member(tmp_path, monkeypatch):
    archive = _tar(tmp_path / "pkg-1.0.tar.gz", {"pkg-1.0/pkg/gen/a.py": b"a", "pkg-1.0/pkg/gen/b.py":
                                                 b"bb", "pkg-1.0/pkg/other.py": b"c"})
    monkeypatch.setitem(assets.ASSETS, "tarred", Asset(
        name="tarred", requirement="pkg==1.0", filename=archive.name,
        sha256=assets.sha256_of(archive), members=("pkg-1.0/pkg/gen/",), description="test"))
    monkeypatch.setattr(assets, "download", lambda a, d: archive)
    path = assets.fetch("tarred", tmp_path / "cache")
    assert path.name == "gen" and sorted(p.name for p in path.iterdir()) == ["a.py", "b.py"]


def test_download_falls_back_to_the_simple_index(tmp_path, monkeypatch):
    class Failed:
        returncode, stderr = 1, "ERROR: direct URL dependency"

    monkeypatch.setattr(assets.subprocess, "run", lambda *a, **k: Failed())

    def from_index(asset, dest):
        (dest / asset.filename).write_bytes(b"x")
        return dest / asset.filename

    monkeypatch.setattr(assets, "_download_from_index", from_index)
    assert assets.download(assets.ASSETS["cnndm"], tmp_path).name == "bigbench-1.0.0.tar.gz"

    def unreachable(asset, dest):
        raise OSError("no route")

    monkeypatch.setattr(assets, "_download_from_index", unreachable)
    with pytest.raises(AssetError, match=r"'cnndm'.*direct URL dependency.*no route"):
        assets.download(assets.ASSETS["cnndm"], tmp_path / "again")


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    assert assets.cache_dir() == tmp_path


def test_real_assets_are_fetched():
    """`make assets` runs before the tests; every registered asset is in the cache."""
    for name in assets.ASSETS:
        assert assets.asset_path(name).exists(), name


def test_cli_lists_assets(tmp_path):
    import subprocess
    import sys

    script = Path(__file__).parents[1] / "scripts" / "fetch_assets.py"
    out = subprocess.run([sys.executable, str(script), "--list", "--cache", str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    assert "smollm2-gguf" in out and "missing" in out

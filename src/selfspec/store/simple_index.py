"""Find and stream one distribution file through the package indexes pip is configured with.

Used by :mod:`selfspec.store.assets` when ``pip download`` itself cannot fetch a file (an sdist that
declares a direct-URL dependency, as bigbench's did, which pip refuses even with ``--no-deps`` because
it builds the sdist's metadata). The indexes are pip's own: ``index-url`` then every ``extra-index-url``, read
from pip's configuration and ``PIP_INDEX_URL`` / ``PIP_EXTRA_INDEX_URL`` (``pip config list``), so
a mirror or a local ``file://`` index works as it does for pip. Both forms of the simple repository
API are understood: the HTML page (PEP 503) and the JSON listing (PEP 691); which one came back is
decided from the body, since some servers label one as the other.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

__all__ = ["DEFAULT_INDEX", "configured_indexes", "find_file", "listing", "normalise", "stream"]

DEFAULT_INDEX = "https://pypi.org/simple"
_ACCEPT = ("application/vnd.pypi.simple.v1+json, "
           "application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1")
# pip's precedence: environment, then the command's own section, then [global]
_SECTIONS = (":env:", "download", "global")


def normalise(project: str) -> str:
    """A project name as simple indexes spell it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", project).lower()


def _pip_config() -> dict[str, str]:
    """``pip config list`` as ``{"section.key": value}`` (environment variables as ``:env:.key``)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                          capture_output=True, text=True)
    out: dict[str, str] = {}
    for line in proc.stdout.splitlines() if proc.returncode == 0 else []:
        key, sep, value = line.partition("=")
        if sep:
            try:
                out[key.strip()] = str(ast.literal_eval(value.strip()))
            except (ValueError, SyntaxError):
                out[key.strip()] = value.strip().strip("'\"")
    return out


def configured_indexes(config: dict[str, str] | None = None) -> list[str]:
    """pip's index URLs in the order pip consults them: ``index-url``, then ``extra-index-url``s.

    ``config`` is ``pip config list`` parsed (default: asked of this interpreter's pip).
    ``no-index`` empties the list, as it does for pip.
    """
    config = _pip_config() if config is None else config

    def first(key: str) -> str | None:
        for section in _SECTIONS:
            if f"{section}.{key}" in config:
                return config[f"{section}.{key}"]
        return None

    if (first("no-index") or "").lower() in ("1", "true", "yes", "on"):
        return []
    urls = [first("index-url") or DEFAULT_INDEX] + (first("extra-index-url") or "").split()
    return list(dict.fromkeys(u.rstrip("/") for u in urls if u))


class _Anchors(HTMLParser):
    """The ``<a href>`` targets and texts of a PEP 503 page."""

    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href, self._text = dict(attrs).get("href"), []

    def handle_data(self, data):
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def _read(url: str, timeout: float) -> bytes:
    """The body at ``url``; a ``file://`` directory is read as its ``index.html``, as pip does."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        path = Path(urllib.request.url2pathname(parsed.path))
        return (path / "index.html" if path.is_dir() else path).read_bytes()
    request = urllib.request.Request(url, headers={"Accept": _ACCEPT})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def listing(index: str, project: str, timeout: float = 60.0) -> dict[str, str]:
    """``{filename: absolute url}`` of ``project``'s files on simple index ``index`` (HTML or JSON)."""
    page = f"{index.rstrip('/')}/{normalise(project)}/"
    body = _read(page, timeout)
    text = body.decode("utf-8", errors="replace").lstrip()
    if text.startswith("{"):
        files = json.loads(text).get("files", [])
        pairs = [(f["url"], f["filename"]) for f in files if "url" in f and "filename" in f]
    else:
        parser = _Anchors()
        parser.feed(text)
        pairs = parser.links
    out: dict[str, str] = {}
    for href, name in pairs:
        url = urllib.parse.urljoin(page, href)
        name = name or Path(urllib.parse.urlparse(url).path).name
        out.setdefault(name, url)
    return out


def stream(url: str, target: Path, timeout: float = 60.0) -> Path:
    """Copy ``url`` (the fragment dropped) to ``target`` in 1 MiB blocks."""
    url = urllib.parse.urldefrag(url).url
    with urllib.request.urlopen(url, timeout=timeout) as response, open(target, "wb") as out:
        shutil.copyfileobj(response, out, length=1 << 20)
    return target


def find_file(project: str, filename: str, indexes: list[str] | None = None,
              timeout: float = 60.0) -> str:
    """The URL of ``filename`` on the first of ``indexes`` (default: pip's) that lists it.

    Raises ``FileNotFoundError`` saying which indexes were asked and what each answered.
    """
    indexes = configured_indexes() if indexes is None else indexes
    tried: list[str] = []
    for index in indexes:
        try:
            files = listing(index, project, timeout)
        except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts, bad JSON
            tried.append(f"{index} ({type(exc).__name__}: {exc})")
            continue
        if filename in files:
            return files[filename]
        tried.append(f"{index} (not listed)")
    raise FileNotFoundError(f"{filename} not found on pip's indexes: {'; '.join(tried) or 'none configured'}")

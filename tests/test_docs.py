"""The repository's own documents: every document the code cites is in the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: a cited document: an upper-case page name (``README.md``, ``CHANGES`` + ``.md``) or a page under docs/
CITED = re.compile(r"(?<![\w/.-])((?:docs/[\w./-]+|[A-Z][A-Z_]+)\.md)\b")


def _sources():
    for folder in ("src", "scripts", "conf", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".yaml", ".yml", ".txt") and path.is_file():
                yield path
    yield ROOT / "Makefile"
    yield ROOT / "README.md"


def test_every_cited_document_is_in_the_repository():
    """A citation such as ``docs/design.md §2.3`` must point at a file a user has."""
    missing = []
    for path in _sources():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for cited in CITED.findall(line):
                if not (ROOT / cited).is_file():
                    missing.append(f"{path.relative_to(ROOT)}:{n} cites {cited}")
    assert not missing, "\n".join(missing)


def test_design_sections_cited_exist():
    """``docs/design.md §N`` / ``§N.M`` citations name sections the page has."""
    text = (ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (\d+)\.", text, re.M))
    contracts = {f"2.{n}" for n in re.findall(r"^(\d+)\. \*\*", text.split("## 3.")[0].split("## 2.")[1], re.M)}
    bad = []
    for path in _sources():
        for ref in re.findall(r"docs/design\.md §(\d+(?:\.\d+)?)", path.read_text(errors="replace")):
            if ref not in sections | contracts:
                bad.append(f"{path.relative_to(ROOT)}: §{ref}")
    assert not bad, bad

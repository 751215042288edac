"""The repository's own documents: every document the code cites is in the repository; README.md is a
front page, every page's links resolve, and each results page is dated and names its commands."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: a cited document: an upper-case page name (``README.md``, ``CHANGES`` + ``.md``) or a page under docs/
CITED = re.compile(r"(?<![\w/.-])((?:docs/[\w./-]+|[A-Z][A-Z_]+)\.md)\b")
#: pages cited before they land: the GPU check's page (docs/gpu.md), written with the GPU check's
#: change (issue 53's lead); take its entry out when it is in the repository
PENDING: set[str] = set()
#: README.md is a front page: what selfspec is, two set-up commands, one table, the workflows, links
README_LINES = 300
#: a results page: ``docs/<date>-<what>.md``
DATED = re.compile(r"^(\d{4}-\d{2}-\d{2})-[\w-]+\.md$")


def _sources():
    for folder in ("src", "scripts", "conf", "tests"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".yaml", ".yml", ".txt") and path.is_file():
                yield path
    yield ROOT / "Makefile"
    yield from _pages()


def _pages():
    yield ROOT / "README.md"
    yield from sorted((ROOT / "docs").glob("*.md"))
    yield from sorted((ROOT / "docs" / "design").glob("*.md"))


def test_every_cited_document_is_in_the_repository():
    """A citation such as ``docs/design/contracts.md §2.3`` must point at a file a user has."""
    missing = []
    for path in _sources():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for cited in CITED.findall(line):
                if not (ROOT / cited).is_file() and cited not in PENDING:
                    missing.append(f"{path.relative_to(ROOT)}:{n} cites {cited}")
    assert not missing, "\n".join(missing)
    assert not [p for p in PENDING if (ROOT / p).is_file()], "a pending page landed: take it out of PENDING"


def _design_sections() -> dict[str, set[str]]:
    """The sections of the design notes, by page: each page of ``docs/design/`` has its ``## N.``
    sections, its ``### N.M`` subsections and, on the page of §2, the core contracts (``1. **...**``:
    §2.1, §2.2, ...); the index, ``docs/design.md``, every section its table lists and the contracts."""
    pages = {}
    for page in sorted((ROOT / "docs" / "design").glob("*.md")):
        text = page.read_text()
        found = set(re.findall(r"^## (\d+)\.", text, re.M)) | set(re.findall(r"^### (\d+\.\d+) ", text, re.M))
        if "2" in found:
            contracts = text.split("\n## 2.")[1].split("\n## ")[0]
            found |= {f"2.{n}" for n in re.findall(r"^(\d+)\. \*\*", contracts, re.M)}
        pages[f"docs/design/{page.name}"] = found
    index = (ROOT / "docs" / "design.md").read_text()
    listed = set(re.findall(r"^\| (\d+) \| \[", index, re.M)) | set(re.findall(r"^- §(\d+\.\d+) ", index, re.M))
    pages["docs/design.md"] = listed
    return pages


def test_design_sections_cited_exist():
    """``docs/design.md §N`` (the index) and ``docs/design/<page>.md §N`` / ``§N.M`` citations name
    sections the index lists or the page has; the index lists every page's sections, each linked to
    its page, and every section is on one page."""
    pages = _design_sections()
    index = pages.pop("docs/design.md")
    on_pages = [s for found in pages.values() for s in found if "." not in s]
    assert len(on_pages) == len(set(on_pages)), "a section on two pages"
    assert {s for s in index if "." not in s} == set(on_pages), "the index lists other sections than the pages hold"
    assert {s for s in index if "." in s} == {s for found in pages.values() for s in found if s.startswith("2.")}
    for line in (ROOT / "docs" / "design.md").read_text().splitlines():
        if m := re.match(r"^\| (\d+) \| \[[^]]+\]\(design/([\w-]+\.md)#", line):
            assert m[1] in pages[f"docs/design/{m[2]}"], f"the index puts §{m[1]} on {m[2]}, which lacks it"
    pages["docs/design.md"] = index
    bad = []
    for path in _sources():
        for page, ref in re.findall(r"(docs/design(?:\.md|/[\w-]+\.md)) §(\d+(?:\.\d+)?)",
                                    path.read_text(errors="replace")):
            if ref not in pages.get(page, set()):
                bad.append(f"{path.relative_to(ROOT)}: {page} §{ref}")
    assert not bad, bad


def _anchor(heading: str) -> str:
    """A Markdown heading's anchor, as GitHub makes it."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_of_every_page_resolves():
    """Each relative link of README.md and docs/*.md names a file that is there, and its ``#anchor``
    a heading of that file."""
    bad = []
    for page in _pages():
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if str(file.relative_to(ROOT)) in PENDING:
                continue
            if not file.is_file():
                bad.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif anchor and anchor not in {_anchor(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)}:
                bad.append(f"{page.relative_to(ROOT)}: {target}: no such heading")
    assert not bad, "\n".join(bad)


def test_readme_is_a_front_page_and_results_pages_are_dated():
    """Issue 53: the README had grown to 1,167 lines of results and diaries. It fits a few screens
    now; what was measured lives on pages named by their date, which say it in their title and name
    the commands that measured it."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_LINES
    assert readme.count("```bash") >= 2 and "make demo" in readme and "make test" in readme
    dated = [p for p in (ROOT / "docs").glob("*.md") if DATED.match(p.name)]
    assert len(dated) >= 3
    for page in dated:
        text = page.read_text()
        assert DATED.match(page.name)[1] in text.splitlines()[0], f"{page.name}: its title does not say its date"
        assert re.search(r"`(python|make) [^`]+`", text), f"{page.name}: names no command"
        assert page.name in readme or any(page.name in p.read_text() for p in (ROOT / "docs").glob("*.md")
                                          if p != page), f"{page.name}: no page links to it"


def _cells(line: str) -> int:
    """The cells of a Markdown table row (``|`` inside backticks or escaped does not split)."""
    text = re.sub(r"`[^`]*`", "x", line.strip()).replace("\\|", "x")
    return len(text.strip("|").split("|"))


def test_every_table_renders_with_its_headers_cells():
    """Issue 71: the README's first table had 4 header cells and rows of 5 (a column inserted into the wrong
    table), so a Markdown renderer dropped the ``method=`` names and showed stray figures. Every row of every
    table on the front page and the docs pages has its header's cell count."""
    for page in _pages():
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.fullmatch(r"\|( *:?-+:? *\|)+", line.strip()) and i > 0:
                width = _cells(lines[i - 1])
                assert _cells(line) == width, f"{page.name}:{i + 1}: the separator has {_cells(line)} cells, the header {width}"
                for j in range(i + 1, len(lines)):
                    if not lines[j].lstrip().startswith("|"):
                        break
                    assert _cells(lines[j]) == width, f"{page.name}:{j + 1}: {_cells(lines[j])} cells, the header {width}"


def _worked_example() -> tuple[str, str]:
    """The YAML and the Python of docs/extending.md's worked example, as a reader copies them."""
    import textwrap

    text = (ROOT / "docs" / "extending.md").read_text()
    section = text[text.index("**Worked example"):]
    (yaml,) = re.findall(r"^ *```yaml\n(.*?)^ *```$", section, re.M | re.S)[:1]
    (python,) = re.findall(r"^ *```python\n(.*?)^ *```$", section, re.M | re.S)[:1]
    return textwrap.dedent(yaml), textwrap.dedent(python)


def test_the_worked_example_decodes_like_vanilla(tiny, tmp_path, monkeypatch):
    """Issue 71: docs/extending.md's worked example showed an API the runtime no longer had
    (``run_layers``). Its code and YAML run here as written: the method is registered, checked and
    built as any method is (``build_decoder``, with the gate), and decodes vanilla's tokens under greedy
    decoding on the tiny random model, its drafts accepted in part."""
    import shutil
    import sys

    import torch

    from selfspec.config import method_config
    from selfspec.decoding import METHODS, build_decoder

    yaml, python = _worked_example()
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    (conf / "method" / "shallow_draft.yaml").write_text(yaml)
    monkeypatch.setenv("SELFSPEC_CONF", str(conf))
    (tmp_path / "worked_example_shallow_draft.py").write_text(python)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "worked_example_shallow_draft", raising=False)
    monkeypatch.setitem(METHODS._entries, "shallow_draft", "worked_example_shallow_draft:ShallowDraft")

    ids = tiny.tokenizer("The capital of France is", return_tensors="pt").input_ids[0].tolist()
    with torch.inference_mode():
        want = build_decoder(method_config("vanilla"), tiny.model).generate(ids, 24).tokens
        for gated in (True, False):
            dec = build_decoder(method_config("shallow_draft", never_slower=gated), tiny.model)
            out = dec.generate(ids, 24)
            assert out.tokens == want
    assert out.stats["verifications"] > 0  # ungated, it drafted

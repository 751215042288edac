"""The report as people see it: the demo's ``report/index.html`` served over HTTP on loopback and
opened in headless Chromium (Debian's ``chromium`` and ``chromium-driver``: ``make browser``),
driven by Selenium. Every image loads, every table renders, every local link resolves, the
console stays clean; a full-page screenshot is kept under ``outputs/browser/``."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import threading
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "outputs" / "browser" / "report.png"
#: headless, and nothing reaches out of the machine
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1280,1000")


def require(ok: bool, reason: str) -> None:
    """Skip without ``what`` here, but fail under CI (``CI=true``), where ``make test`` installs it."""
    if ok:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason}; CI must run the browser test (`make browser` installs chromium, chromium-driver)")
    pytest.skip(f"{reason}: run `make browser` (as root: apt-get install chromium chromium-driver)")


class _Logged(SimpleHTTPRequestHandler):
    """Serves the report directory; each request's path and status go to ``server.requests``."""

    def log_request(self, code="-", size="-"):
        self.server.requests.append((self.path, int(code)))

    def log_message(self, format, *args):  # noqa: A002 — http.server's signature
        pass


@pytest.fixture(scope="module")
def served(demo_run):
    """``(base URL, [(path, status), ...])`` of the demo's report directory on 127.0.0.1."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Logged, directory=str(demo_run.run_dir / "report")))
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", server.requests
    server.shutdown()
    thread.join()


@pytest.fixture(scope="session")  # session, as demo_run: set up first, so a skip costs no demo run
def browser():
    """Headless Chromium under chromedriver, with its console log kept."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    require(bool(chromium and driver), "chromium or chromedriver is not installed")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        require(False, "selenium is not installed (pip install -e '.[dev]')")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="selfspec-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(options=options, service=Service(driver))
    yield chrome
    chrome.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _page_state(chrome) -> dict:
    return chrome.execute_script("""
        const box = e => e.getBoundingClientRect();
        return {
          headings: [...document.querySelectorAll('h2')].map(h => h.innerText),
          images: [...document.images].map(i => ({src: i.getAttribute('src'), complete: i.complete,
              natural: i.naturalWidth, shown: box(i).width,
              caption: (i.closest('figure')?.querySelector('figcaption')?.innerText || '')})),
          tables: [...document.querySelectorAll('table')].map(t => ({rows: t.rows.length,
              cells: t.rows.length ? t.rows[t.rows.length - 1].cells.length : 0, height: box(t).height,
              text: t.innerText.trim().length})),
          links: [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href')),
          ids: [...document.querySelectorAll('[id]')].map(e => e.id),
          width: document.documentElement.scrollWidth, viewport: window.innerWidth,
          height: document.documentElement.scrollHeight};""")


def _screenshot(chrome, height: int) -> Path:
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    chrome.set_window_size(1280, height + 120)
    chrome.save_screenshot(str(SCREENSHOT))
    return SCREENSHOT


def test_report_in_a_browser(browser, served, capsys):
    base, requests = served
    browser.get(urljoin(base, "index.html"))
    browser.execute_async_script("""const done = arguments[arguments.length - 1];
        Promise.all([...document.images].map(i => i.decode().catch(() => null))).then(() => done());""")
    page = _page_state(browser)

    # the answer first, then the tables, then the plots
    assert page["headings"][0] == "Fastest lossless method per task" and page["headings"][-1] == "Plots"
    assert page["images"], "no plot on the page"
    for img in page["images"]:
        assert img["complete"] and img["natural"] > 0 and img["shown"] > 0, f"image did not load: {img}"
        assert len(img["caption"]) > 60, f"{img['src']}: no caption"
    # answer (a header, one greedy row per task and one sampling row per task the demo also samples:
    # demo.py's default --sampling xsum humaneval), the main table, the runtime benchmark
    assert len(page["tables"]) >= 3 and page["tables"][0]["rows"] == 1 + 5 + 2
    for table in page["tables"]:
        assert table["rows"] >= 2 and table["cells"] >= 2 and table["height"] > 0 and table["text"] > 0, table
    assert page["width"] <= page["viewport"], "the page scrolls sideways (wide tables must scroll in their box)"

    # every local link resolves: in-page anchors name an element, files are served
    for href in page["links"]:
        if href.startswith("#"):
            assert href[1:] in page["ids"], f"anchor {href} names no element"
        elif not urlparse(href).scheme:
            with urllib.request.urlopen(urljoin(base, href)) as response:
                assert response.status == 200, href
    errors = [(path, status) for path, status in requests if status >= 400]
    assert not errors, f"requests that failed: {errors}"
    assert {path for path, _ in requests} >= {"/index.html", *(f"/{i['src']}" for i in page["images"])}
    console = [entry for entry in browser.get_log("browser") if entry["level"] in ("SEVERE", "ERROR")]
    assert not console, f"console errors: {console}"

    shot = _screenshot(browser, page["height"])
    assert shot.read_bytes()[:4] == b"\x89PNG"
    with capsys.disabled():
        print(f"\nreport screenshot: {shot}")

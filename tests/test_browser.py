"""The report as people see it: the demo's ``report/index.html`` served over HTTP on loopback and
opened in headless Chromium (Debian's ``chromium`` and ``chromium-driver``: ``make browser``),
driven by Selenium. Every image loads, every table renders, every local link resolves, the
console stays clean; a full-page screenshot is kept under ``outputs/browser/``. No figure is cut:
nothing drawn reaches a PNG's edge (a legend, title or axis label written past the figure's edge
would), no image is stretched past its natural size or its box, no text block overflows, the page
does not scroll sideways. A report of synthetic cost ledgers shows where the time goes per task and
its warning for a run measured under load."""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def serve(directory: Path):
    """``(base URL, [(path, status), ...])`` of ``directory`` served on 127.0.0.1 while open."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Logged, directory=str(directory)))
    server.requests = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", server.requests
    finally:
        server.shutdown()
        thread.join()


@pytest.fixture(scope="module")
def served(demo_run):
    """``(base URL, [(path, status), ...])`` of the demo's report directory on 127.0.0.1."""
    with serve(demo_run.run_dir / "report") as base_requests:
        yield base_requests


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


#: pixels at a PNG's edge that must hold nothing drawn; the writer pads what is drawn by 0.05 inch
#: (5 pixels at its 110 dpi), so a figure cut at its edge shows ink here and a whole one does not
EDGE = 2
#: a channel below this is ink, not the white background (anti-aliased text included)
INK = 235


def _figure_state(chrome) -> list[dict]:
    """Per ``<img>`` of a ``<figure>``: its natural and shown size, its box and its figure's content
    box, and how many pixels in the :data:`EDGE`-pixel band round the PNG are ink."""
    return chrome.execute_script("""
        const [EDGE, INK] = arguments;
        return [...document.querySelectorAll('figure img')].map(img => {
          const fig = img.closest('figure'), box = img.getBoundingClientRect(), f = fig.getBoundingClientRect();
          const style = getComputedStyle(fig), pad = p => parseFloat(style[p]) || 0;
          const w = img.naturalWidth, h = img.naturalHeight;
          const canvas = document.createElement('canvas');
          canvas.width = w; canvas.height = h;
          const ctx = canvas.getContext('2d');
          ctx.drawImage(img, 0, 0);
          const data = ctx.getImageData(0, 0, w, h).data;
          const ink = {top: 0, bottom: 0, left: 0, right: 0};
          for (let y = 0; y < h; y++) for (let x = 0; x < w; x++) {
            if (x >= EDGE && x < w - EDGE && y >= EDGE && y < h - EDGE) { x = w - EDGE - 1; continue; }
            const i = 4 * (y * w + x);
            if (Math.min(data[i], data[i + 1], data[i + 2]) < INK && data[i + 3] > 0) {
              if (y < EDGE) ink.top++; else if (y >= h - EDGE) ink.bottom++;
              else if (x < EDGE) ink.left++; else ink.right++;
            }
          }
          return {src: img.getAttribute('src'), natural: w, shown: box.width, left: box.left, right: box.right,
                  inner_left: f.left + pad('borderLeftWidth') + pad('paddingLeft'),
                  inner_right: f.right - pad('borderRightWidth') - pad('paddingRight'), ink};
        });""", EDGE, INK)


def _cut_text(chrome) -> list[str]:
    """Text blocks whose content is wider than their box (cut or spilling over)."""
    return chrome.execute_script("""
        return [...document.querySelectorAll('h1,h2,h3,p,li,figcaption,.warning')]
          .filter(e => e.scrollWidth > e.clientWidth + 1).map(e => e.tagName + ': ' + e.innerText.slice(0, 60));""")


def assert_figures_whole(chrome) -> None:
    """Nothing of any figure is cut, stretched or spilling, and no text block overflows its box."""
    figures = _figure_state(chrome)
    assert figures, "no figure on the page"
    for f in figures:
        assert not any(f["ink"].values()), f"{f['src']}: something drawn is cut at the image's edge: {f['ink']}"
        assert f["shown"] <= f["natural"] + 0.5, f"{f['src']}: stretched past its natural size: {f}"
        assert f["inner_left"] - 0.5 <= f["left"] and f["right"] <= f["inner_right"] + 0.5, \
            f"{f['src']}: wider than its figure's box: {f}"
    assert not _cut_text(chrome), f"text wider than its box: {_cut_text(chrome)}"
    width, viewport = chrome.execute_script(
        "return [document.documentElement.scrollWidth, window.innerWidth];")
    assert width <= viewport, "the page scrolls sideways"


def _open(chrome, url: str) -> None:
    """Load ``url`` and wait until every image is decoded."""
    chrome.get(url)
    chrome.execute_async_script("""const done = arguments[arguments.length - 1];
        Promise.all([...document.images].map(i => i.decode().catch(() => null))).then(() => done());""")


def _screenshot(chrome, height: int) -> Path:
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    chrome.set_window_size(1280, height + 120)
    chrome.save_screenshot(str(SCREENSHOT))
    return SCREENSHOT


def test_report_in_a_browser(browser, served, capsys):
    base, requests = served
    _open(browser, urljoin(base, "index.html"))
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
    assert_figures_whole(browser)

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


def test_where_the_time_goes_in_a_browser(browser, tmp_path):
    """Synthetic cost ledgers (tests/test_report_ledger.py): each task's section shows its chart
    whole; the run measured under load has its warning in view, in its own section and no other."""
    from test_report_ledger import write_ledger_runs

    from selfspec.reporting import build_report

    result = build_report([write_ledger_runs(tmp_path / "runs")], tmp_path / "report", artefacts_dir=None)
    with serve(result.out_dir) as (base, requests):
        _open(browser, urljoin(base, "index.html"))
        assert_figures_whole(browser)
        state = browser.execute_script("""
            const shown = e => e.getBoundingClientRect().height > 0 && getComputedStyle(e).display !== 'none';
            const section = id => { const out = []; let e = document.getElementById(id).nextElementSibling;
              while (e && e.tagName !== 'H3' && e.tagName !== 'H2') { out.push(e); e = e.nextElementSibling; }
              return out; };
            const describe = els => ({warnings: els.filter(e => e.matches('.warning') && shown(e)).map(e => e.innerText),
                                      images: els.flatMap(e => [...e.querySelectorAll('img')]).map(i => i.getAttribute('src'))});
            return {xsum: describe(section('time-main-m-xsum')), humaneval: describe(section('time-main-m-humaneval')),
                    top: shown(document.querySelector('h1 + .warning'))};""")
    assert state["top"]
    assert state["xsum"] == {"warnings": [], "images": ["plots/ledger_main_m_xsum.png"]}
    assert state["humaneval"]["images"] == ["plots/ledger_main_m_humaneval.png"]
    (warning,) = state["humaneval"]["warnings"]
    assert warning.startswith("Measured under load — m · HumanEval, greedy") and "(loaded)" in warning
    assert not [(path, status) for path, status in requests if status >= 400]


#: the widths the report is read at (issue 53: a task's table ran off the right edge at 1300 px)
SCREEN = 1300
#: the shipped profiles' names a run of the demo's model is projected on (six columns per task before)
PROFILES = ("cpu-amd-epyc-2t__smollm2-135m (bfloat16 trace)", "cpu-intel-xeon-2t__smollm2-135m (bfloat16 trace)",
            "cuda-nvidia-h100-80gb-hbm3__smollm2-135m__bfloat16", "cuda-nvidia-h100-80gb-hbm3__smollm2-135m__float32",
            "cuda-nvidia-h200__smollm2-135m__bfloat16", "cuda-nvidia-h200__smollm2-135m__bfloat16 (float32 trace)")


def write_demo_shaped_runs(root: Path) -> Path:
    """The demo's ``main`` table, synthetic: vanilla, its methods and peers greedy on five tasks, the
    methods sampled on XSum (T=0.2) and HumanEval (T=0.6) only, every run projected on six profiles."""
    from test_report import entry, write_run

    methods = ("vanilla", "adadecode", "draft_verify", "ppd", "del_heads", "early_exit", "ngram", "hf_generate",
               "hf_prompt_lookup", "hf_assisted")
    sampled = ("vanilla", "adadecode", "draft_verify", "ppd", "del_heads", "ngram")
    runs = [(task, 0.0, methods) for task in ("xsum", "cnndm", "humaneval", "gsm8k", "mtbench")]
    runs += [("xsum", 0.2, sampled), ("humaneval", 0.6, sampled)]
    for i, (task, temperature, names) in enumerate(runs):
        figures = {m: entry(20.0 + j, 1.0 + j / 10, tau=1.0 + j / 5, ar=0.5, metrics={"rouge2": 0.1, "pass@1": 0.2})
                   | {"predicted_speedup": 1.0 + j / 9} for j, m in enumerate(names)}
        projected = {p: {m: {"predicted_speedup": 1.0 + j / 7, "regated_speedup": 1.0 + j / 8} for j, m in
                         enumerate(names) if not m.startswith("hf_")} for p in PROFILES}
        write_run(root / f"{i}_{task}_{temperature}", table="main", task=task, method="adadecode",
                  methods=figures, temperature=temperature, extra={"projections": projected})
    return root


def test_a_task_table_reads_without_scrolling_sideways_at_1300_px(browser, tmp_path):
    """The demo's table opened at 1300 px (issue 53): each task's table (and its projections, a table
    of their own) fits its box, and holds no row for a sampling setting its task never ran."""
    from selfspec.reporting import build_report

    result = build_report([write_demo_shaped_runs(tmp_path / "runs")], tmp_path / "report", artefacts_dir=None,
                          make_plots=False)
    assert result.tables["main"].projections is not None
    browser.set_window_size(SCREEN, 1000)
    try:
        with serve(result.out_dir) as (base, _):
            _open(browser, urljoin(base, "index.html"))
            tables = browser.execute_script("""
                return [...document.querySelectorAll('.scroll table')].map(t => {
                  let h = t.previousElementSibling; while (h && !/^H[234]$/.test(h.tagName)) h = h.previousElementSibling;
                  return {title: h ? h.innerText : '', width: t.getBoundingClientRect().width,
                          box: t.closest('.scroll').clientWidth,
                          rows: [...t.rows].slice(1).filter(r => !r.classList.contains('block'))
                                 .map(r => [...r.cells].map(c => c.innerText))};});""")
            width, viewport = browser.execute_script("return [document.documentElement.scrollWidth, window.innerWidth];")
    finally:
        browser.set_window_size(1280, 1000)
    assert width <= viewport
    task_tables = [t for t in tables if t["title"] in ("XSum", "CNN/DM", "HumanEval", "GSM8K", "MT-Bench")]
    assert len(task_tables) == 2 * 5, [t["title"] for t in tables]  # measured and projected, per task
    for t in tables:
        assert t["width"] <= t["box"] + 0.5, f"{t['title']}: {t['width']:.0f} px in a {t['box']} px box"
    for t in task_tables:
        for row in t["rows"]:
            assert any(c not in ("–", "") for c in row[1:-1]), f"{t['title']}: an empty row {row[0]!r}"
    labels = {t["title"]: {r[0] for r in t["rows"]} for t in task_tables[:5]}
    assert any("T=0.2" in label for label in labels["XSum"]) and not any("T=0.6" in label for label in labels["XSum"])
    assert not any("T=" in label for label in labels["GSM8K"])

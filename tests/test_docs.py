"""The documentation: every example runs, the site builds warning-free, its links and
assets resolve, and it loads in a real (headless Chromium) browser without errors.

The build is the README's command (``python -m sphinx -W --keep-going -n -b html docs
...``) run once per session into a temporary directory; sphinx-gallery re-executes every
example during it. Screenshots of the pages opened in the browser are written to
``artifacts/`` at the repository root (git-ignored) for a human to look at.
"""

from __future__ import annotations

import functools
import html.parser
import os
import re
import runpy
import shutil
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import layernorm

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES = sorted((DOCS / "examples").glob("plot_*.py"))
ARTIFACTS = ROOT / "artifacts"
DOCS_PACKAGES = ("sphinx", "sphinx_gallery", "numpydoc", "pydata_sphinx_theme", "matplotlib")

#: The pages opened in the browser: the landing page, one executed example with a
#: figure, and the API reference.
BROWSER_PAGES = ("index.html", "auto_examples/plot_02_axes.html", "api.html")

#: Public names that the API page must document (everything exported but the version).
PUBLIC_NAMES = sorted(set(layernorm.__all__) - {"__version__"})


# --------------------------------------------------------------------------- examples


def test_examples_found():
    names = [p.name for p in EXAMPLES]
    assert len(names) >= 12, names
    assert "plot_12_performance.py" in names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, monkeypatch, capsys):
    """Each gallery script runs as a plain script (Agg backend) and prints something."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    # Under sphinx-gallery plt.show() is where figures are collected; here it is a no-op
    # (Agg's show() would warn, and warnings are errors in this suite).
    monkeypatch.setattr(plt, "show", lambda *args, **kwargs: None)
    monkeypatch.chdir(path.parent)
    monkeypatch.setattr(sys, "argv", [str(path)])
    plt.close("all")
    try:
        runpy.run_path(str(path), run_name="__main__")
        figures = plt.get_fignums()
    finally:
        plt.close("all")
    out = capsys.readouterr().out
    assert out.strip(), f"{path.name} printed nothing; examples show real numbers"
    if "plt.show()" in path.read_text(encoding="utf-8"):
        assert figures, f"{path.name} calls plt.show() but drew no figure"


# --------------------------------------------------------------------------- the build


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """Build the site once, warnings as errors, nitpicky references; its html dir."""
    for name in DOCS_PACKAGES:
        pytest.importorskip(name)
    out = tmp_path_factory.mktemp("docs")
    html_dir = out / "html"
    cmd = [
        sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
        "-d", str(out / "doctrees"), str(DOCS), str(html_dir),
    ]
    env = {**os.environ, "MPLBACKEND": "Agg"}
    env.pop("LAYERNORM_DOCS_INTERSPHINX", None)  # CI has no network: never fetch
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    if proc.returncode != 0:
        pytest.fail(
            f"docs build failed (exit {proc.returncode}):\n--- stderr ---\n"
            f"{proc.stderr[-10000:]}\n--- stdout ---\n{proc.stdout[-3000:]}",
            pytrace=False,
        )
    return html_dir


class _PageParser(html.parser.HTMLParser):
    """Collects the ids, links and asset URLs of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.assets: list[str] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key):
                self.ids.add(a[key])
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])
        elif tag in ("script", "img") and a.get("src"):
            self.assets.append(a["src"])
        elif tag == "link" and a.get("href") and a.get("rel") in (
            "stylesheet", "preload", "icon", "shortcut icon", "modulepreload",
        ):
            self.assets.append(a["href"])

    def handle_data(self, data):
        self.text.append(data)


@functools.cache
def _parse(path: Path) -> _PageParser:
    parser = _PageParser()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def _is_external(url: str) -> bool:
    return bool(urllib.parse.urlsplit(url).scheme) or url.startswith("//")


def _target(page: Path, url: str) -> tuple[Path, str]:
    parts = urllib.parse.urlsplit(url)
    target = page if not parts.path else (page.parent / urllib.parse.unquote(parts.path))
    target = target.resolve()
    if target.is_dir():
        target = target / "index.html"
    return target, urllib.parse.unquote(parts.fragment)


def test_docs_build_has_every_page(site):
    for page in ("index", "getting_started", "user_guide", "api", "benchmarks",
                 "changelog", "auto_examples/index"):
        assert (site / f"{page}.html").is_file(), page


def test_every_example_executed_without_warnings(site):
    for path in EXAMPLES:
        page = site / "auto_examples" / f"{path.stem}.html"
        assert page.is_file(), page
        text = page.read_text(encoding="utf-8")
        # sphinx-gallery puts each cell's captured stdout in a "script-out" block.
        assert "sphx-glr-script-out" in text, f"{page.name} shows no executed output"
        for bad in ("Traceback", "Warning:", "UserWarning", "RuntimeWarning",
                    "DeprecationWarning"):
            assert bad not in text, f"{page.name} output contains {bad!r}"


def test_figures_rendered(site):
    for stem in ("plot_02_axes", "plot_08_backward", "plot_09_residual_blocks"):
        pngs = list((site / "_images").glob(f"sphx_glr_{stem}_*.png"))
        assert pngs, f"no figure for {stem}"
        assert all(p.stat().st_size > 5000 for p in pngs), pngs


def test_performance_page_states_how_quiet_each_measurement_was(site):
    """The live measurement and the committed reference each get a box with their
    conditions: a warning listing the reasons when noisy, a note otherwise."""
    text = (site / "auto_examples" / "plot_12_performance.html").read_text(encoding="utf-8")
    for what in ("The live measurement of this build", "The committed reference measurement"):
        match = re.search(r'<div class="admonition (warning|note)"><p class="admonition-title">'
                          + what + r" was (noisy|quiet)</p><p>Conditions: ([^<]*)</p>", text)
        assert match, f"no verdict box for {what!r}"
        kind, verdict, conditions = match.groups()
        assert (kind, verdict) in (("warning", "noisy"), ("note", "quiet")), match.group(0)
        assert "rounds p90/median" in conditions, conditions
    assert "sphx_glr_plot_12_performance_001.png" in text


def test_api_page_documents_every_public_name(site):
    api = _parse(site / "api.html")
    for name in PUBLIC_NAMES:
        assert f"layernorm.{name}" in api.ids, f"layernorm.{name} is not on the API page"
    text = " ".join(api.text)
    for section in ("Parameters", "Returns", "Examples"):
        assert section in text
    # The backreferences: the API page lists the examples that use layer_norm.
    assert any("auto_examples/plot_01_first_example.html" in link for link in api.links)


def test_internal_links_and_assets_resolve(site):
    """Every relative link points at an existing page and anchor; every asset exists
    locally (a page that needs the network to render is broken offline)."""
    # _static/ holds the theme's template fragments (webpack-macros.html), not pages.
    pages = sorted(p for p in site.rglob("*.html") if "_static" not in p.parts)
    assert len(pages) >= 20
    broken, external_assets = [], []
    for page in pages:
        parsed = _parse(page)
        for url in parsed.links:
            if _is_external(url) or (url.startswith("#") and len(url) == 1):
                continue
            target, fragment = _target(page, url)
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: {url} (no such file)")
            elif fragment and target.suffix == ".html" and fragment not in _parse(target).ids:
                broken.append(f"{page.relative_to(site)}: {url} (no such anchor)")
        for url in parsed.assets:
            if _is_external(url):
                external_assets.append(f"{page.relative_to(site)}: {url}")
                continue
            target, _ = _target(page, url)
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: asset {url} (no such file)")
    assert not external_assets, "assets loaded from the network:\n" + "\n".join(
        external_assets[:20])
    assert not broken, f"{len(broken)} broken internal links:\n" + "\n".join(broken[:30])


# --------------------------------------------------------------------------- the browser

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--hide-scrollbars", "--enable-logging=stderr", "--v=0",
)

#: Chromium logs every console message at the same level, so errors cannot be told from
#: chatter by level: every message fails the test except the theme's status lines
#: ("[PST]: Changed to light mode", "Got invalid theme mode: . Resetting to auto." when
#: no mode is stored yet), unless they mention a failure.
BENIGN_CONSOLE = re.compile(r'"(\[PST\]: |Got invalid theme mode: \w*\. Resetting)')
FAILURE_WORDS = re.compile(r"(?i)error|fail|warn|not found|missing|uncaught")


def _console_problems(log: str) -> list[str]:
    problems = []
    for line in log.splitlines():
        if ":CONSOLE" not in line:
            continue
        message = line.split("] ", 1)[-1].split(", source:", 1)[0]
        if BENIGN_CONSOLE.match(message) and not FAILURE_WORDS.search(message):
            continue
        problems.append(line)
    return problems


class _Server:
    """The built site over HTTP on 127.0.0.1 (a free port), recording every request."""

    def __init__(self, root: Path) -> None:
        self.requests: list[tuple[str, int]] = []
        requests, lock = self.requests, threading.Lock()

        class Handler(SimpleHTTPRequestHandler):
            def log_request(self, code="-", size="-"):
                with lock:
                    requests.append((self.path, int(code)))

            def log_message(self, format, *args):
                pass

        handler = functools.partial(Handler, directory=str(root))
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> _Server:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as err:
        err.close()
        return err.code


def _png_is_not_blank(path: Path) -> bool:
    from matplotlib import image

    pixels = image.imread(str(path))
    return pixels.ndim == 3 and float(pixels[..., :3].std()) > 0.01


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (CI installs it)")
def test_site_in_headless_chromium(site, tmp_path):
    ARTIFACTS.mkdir(exist_ok=True)
    with _Server(site) as server:
        for page in BROWSER_PAGES:
            url = server.base + page
            # Every asset the page names is served (checked over HTTP, not on disk).
            for asset in _parse(site / page).assets:
                asset_url = urllib.parse.urljoin(url, asset)
                assert _status(asset_url) == 200, f"{page}: {asset_url}"

            shot = ARTIFACTS / f"docs-{Path(page).stem}.png"
            shot.unlink(missing_ok=True)
            del server.requests[:]
            proc = subprocess.run(
                [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / Path(page).stem}",
                 "--window-size=1280,1000", "--virtual-time-budget=5000",
                 f"--screenshot={shot}", url],
                capture_output=True, text=True, timeout=180, check=False,
            )
            log = proc.stderr
            assert proc.returncode == 0, f"chromium failed on {page}:\n{log[-4000:]}"

            console = _console_problems(log)
            assert not console, f"console messages on {page}:\n" + "\n".join(console)
            for marker in ("Uncaught", "Failed to load resource", "net::ERR_"):
                assert marker not in log, f"{marker!r} while loading {page}:\n{log[-4000:]}"

            requested = list(server.requests)
            failed = [(p, c) for p, c in requested if c >= 400 and p != "/favicon.ico"]
            assert not failed, f"the browser got errors loading {page}: {failed}"
            paths = [p for p, _ in requested]
            assert f"/{page}" in paths, requested
            assert any(p.endswith(".css") or ".css?" in p for p in paths), requested
            assert any(p.endswith(".js") or ".js?" in p for p in paths), requested

            assert shot.is_file(), f"no screenshot of {page}"
            assert _png_is_not_blank(shot), f"the screenshot of {page} is blank"


def test_readme_names_the_docs_build_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.search(r"python -m sphinx -W --keep-going\b.*-b html docs docs/_build/html",
                     readme), "the README must give the docs build command"


def test_committed_performance_reference_is_a_quiet_measurement_of_its_grid():
    """The reference the performance page plots beside its live run was measured with
    the documented command on a quiet machine: the bench's own verdict (recomputed from
    the stored records) finds nothing noisy, and it holds the page's grid, from DRAM and
    from cache."""
    import json

    from layernorm.bench import noise

    reference = json.loads((DOCS / "_data" / "bench_reference.json").read_text())
    verdict = noise.assess(reference)
    assert not verdict.noisy, verdict.reasons
    assert not reference["verdict"]["noisy"], reference["verdict"]["reasons"]
    assert reference["machine"]["cpu"]["model"] and reference["date"]
    shapes = {tuple(r["shape"]) for r in reference["results"] if r["regime"] == "memory"}
    assert shapes == {(16384, 64), (2048, 512), (256, 4096), (32, 32768)}
    assert {r["regime"] for r in reference["results"]} == {"cache", "memory"}

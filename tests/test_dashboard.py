"""The asv dashboard renders our benchmarks: publish a quick run, serve the HTML on
localhost and load it in headless Chromium, then read the DOM the page's JavaScript
built (the benchmark list and a graph drawn by flot).

The published page loads jQuery, flot and Bootstrap from CDNs. Tests run offline, so
the page is pointed at local copies from Debian's ``libjs-jquery``, ``libjs-jquery-flot``
and ``libjs-bootstrap`` packages, plus no-op stand-ins for three helpers the graph
pages do not need (table sorting, bar ordering, and the md5 used only to remember
ignored regressions). Skipped when Chromium or those files are missing (Debian:
``apt-get install chromium libjs-jquery libjs-jquery-flot libjs-bootstrap``).
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("asv")

from .test_asv import asv, git_usable, quick_run

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
SUBSET = (
    r"Forward\.time_forward\('layer_norm', 'float32', '4096x768', 'numba'\)",
    r"ForwardBandwidth\.track_gbps\('layer_norm', 'float32', '4096x768', 'out'\)",
)


JS = Path("/usr/share/javascript")
#: CDN script of the published page -> local file (under /usr/share/javascript) or stand-in.
VENDOR = {
    "jquery-3.3.1.min.js": JS / "jquery" / "jquery.min.js",
    "jquery.flot.min.js": JS / "jquery-flot" / "jquery.flot.js",
    "jquery.flot.time.min.js": JS / "jquery-flot" / "jquery.flot.time.js",
    "jquery.flot.selection.min.js": JS / "jquery-flot" / "jquery.flot.selection.js",
    "jquery.flot.categories.min.js": JS / "jquery-flot" / "jquery.flot.categories.js",
    "bootstrap.min.js": JS / "bootstrap" / "js" / "bootstrap.min.js",
    "jquery.flot.orderBars.js": "/* bar ordering: not used by line graphs */",
    "stupidtable.min.js": "jQuery.fn.stupidtable = function () { return this; };",
    "md5.min.js": "window.md5 = function (s) { return String(s); };",
}
CDN_SCRIPT = re.compile(r'<script src="https://[^"]*/([^/"]+)"[^>]*></script>')


def vendor_missing() -> list[str]:
    return [str(p) for p in VENDOR.values() if isinstance(p, Path) and not p.exists()]


def localize_scripts(html: Path) -> None:
    """Point the published index.html at local copies of its CDN scripts."""
    vendor = html / "vendor"
    vendor.mkdir(exist_ok=True)
    page = html / "index.html"
    text = page.read_text(encoding="utf-8")
    names = CDN_SCRIPT.findall(text)
    unknown = sorted(set(names) - set(VENDOR))
    assert not unknown, f"asv's page loads scripts this test does not know: {unknown}"
    for name in names:
        source = VENDOR[name]
        if isinstance(source, Path):
            shutil.copyfile(source, vendor / name)
        else:
            (vendor / name).write_text(source, encoding="utf-8")
    text = CDN_SCRIPT.sub(lambda m: f'<script src="vendor/{m.group(1)}"></script>', text)
    page.write_text(text, encoding="utf-8")


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_browser() is None, reason="no Chromium installed"),
    pytest.mark.skipif(not git_usable(), reason="asv needs the git checkout"),
    pytest.mark.skipif(bool(vendor_missing()),
                       reason=f"needs local jQuery/flot/Bootstrap: {vendor_missing()}"),
]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory) -> Iterator[str]:
    """Publish a quick run and serve it; yields the base URL."""
    tmp = tmp_path_factory.mktemp("dashboard")
    conf, env, _ = quick_run(tmp, SUBSET, save=True)
    asv(conf, env, "publish")
    html = tmp / "html"
    assert (html / "index.html").exists()
    localize_scripts(html)
    handler = functools.partial(_QuietHandler, directory=str(html))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def dump_dom(url: str) -> str:
    """The DOM after the page's scripts ran, from headless Chromium."""
    profile = tempfile.mkdtemp(prefix="layernorm-chromium-")
    try:
        cmd = [
            find_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
            "--virtual-time-budget=20000", "--dump-dom", url,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False,
                              env=dict(os.environ, HOME=profile))
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def test_published_files_name_our_benchmarks(dashboard):
    # asv publish writes one graph file per benchmark (the page fetches them).
    import urllib.request

    with urllib.request.urlopen(dashboard + "index.json", timeout=10) as resp:
        index = resp.read().decode()
    assert "bench_forward.Forward.time_forward" in index
    assert "bench_forward.ForwardBandwidth.track_gbps" in index


def test_dashboard_lists_our_benchmarks(dashboard):
    dom = dump_dom(dashboard + "index.html")
    # The list is built by the page's JavaScript from index.json: a static page
    # (or a page whose scripts failed) would not contain these names.
    assert "time_forward" in dom
    assert "track_gbps" in dom
    assert "ForwardBandwidth" in dom


def test_dashboard_draws_a_graph(dashboard):
    name = "bench_forward.ForwardBandwidth.track_gbps"
    dom = dump_dom(f"{dashboard}index.html#{name}")
    # flot inserted its canvases, and asv labelled the y axis with our benchmark's
    # unit (track_gbps.unit) and the x axis with the commits it plots.
    assert 'class="flot-base"' in dom
    assert re.search(r'class="y1Label axisLabels"[^>]*>GB/s<', dom), dom[-3000:]
    assert re.search(r'class="x1Label axisLabels"[^>]*>commits<', dom)
    assert "track_gbps" in dom


def test_chromium_flags_do_not_need_a_display():
    # The browser itself runs headless here (no X server): a trivial page round-trips.
    tmp = Path(tempfile.mkdtemp(prefix="layernorm-page-"))
    try:
        page = tmp / "page.html"
        page.write_text("<html><body><script>document.body.id = 'ran-' + (6 * 7);"
                        "</script></body></html>")
        dom = dump_dom(page.as_uri())
        assert 'id="ran-42"' in dom
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

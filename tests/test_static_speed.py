"""A first visit is light: the static files as `make run` (and production) serve them are
hashed, compressed and cached for good, and plotly.js is a partial bundle of the trace
types our charts draw, no longer the 4.8 MB full one sent uncompressed with max-age=0."""

import re
from pathlib import Path

import brotli
import pytest
import requests
from browsing import free_port
from conftest import Processes
from waiting import until

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / "static/vendor/plotly.min.js"
YEAR = 365 * 24 * 3600


def _make_run_static_env() -> dict[str, str]:
    """The static settings `make run` exports, read from .ci/dev-run.sh itself."""
    text = (ROOT / ".ci/dev-run.sh").read_text()
    env = {}
    for name in ("SUANLI_STATIC_MANIFEST", "SUANLI_STATIC_FINDERS"):
        found = re.search(rf'{name}="\$\{{{name}:-(\w+)\}}"', text)
        assert found, f".ci/dev-run.sh exports no {name}"
        env[name] = found.group(1)
    return env


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """collectstatic into a folder of this module's own, then the web process (as the
    Procfile runs it) with `make run`'s static settings, DEBUG off."""
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("static")
    procs = Processes(tmp_path_factory.mktemp("web"))
    env = {**_make_run_static_env(), "DEBUG": "0", "SUANLI_STATIC_ROOT": str(root)}
    collected = subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--no-input", "-v0"],
        cwd=ROOT,
        env={**procs.env, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert collected.returncode == 0, collected.stderr[-3000:]
    port = free_port()
    procs.start("web", env={**env, "PORT": str(port)})
    url = f"http://127.0.0.1:{port}"

    def answers():
        try:
            return requests.get(f"{url}/login/", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    try:
        until(answers, timeout=30, what="the web process listens")
        yield url, root
    finally:
        procs.stop_all()


@pytest.mark.procs  # the web process of its own
def test_make_run_sends_hashed_plotly_compressed_and_cached_for_a_year(served):
    url, root = served
    import json

    manifest = json.loads((root / "staticfiles.json").read_text())["paths"]
    plotly = manifest["vendor/plotly.min.js"]
    assert re.fullmatch(r"vendor/plotly\.min\.[0-9a-f]{12}\.js", plotly), plotly
    # The pages name the hashed files.
    page = requests.get(f"{url}/login/", timeout=10).text
    assert f"/static/{manifest['css/app.css']}" in page

    sent = {}
    for accepts, encoding in (("br, gzip", "br"), ("gzip", "gzip")):
        response = requests.get(
            f"{url}/static/{plotly}", headers={"Accept-Encoding": accepts}, stream=True, timeout=10
        )
        assert response.status_code == 200
        assert response.headers["Content-Encoding"] == encoding
        cache = response.headers["Cache-Control"]
        assert "immutable" in cache, cache
        assert int(re.search(r"max-age=(\d+)", cache).group(1)) >= YEAR, cache
        sent[encoding] = response.raw.read()
    assert brotli.decompress(sent["br"]) == BUNDLE.read_bytes()
    # What goes over the wire: a fraction of the 4.8 MB sent before.
    assert len(sent["br"]) < 500_000 and len(sent["gzip"]) < 600_000, {
        k: len(v) for k, v in sent.items()
    }


def _trace_types_drawn() -> set[str]:
    """Every plotly trace type our pages draw: `type: "..."` in the scripts and templates,
    `go.<Trace>(` in the Python that builds figures."""
    import plotly.graph_objects as go
    from plotly.basedatatypes import BaseTraceType

    known = {
        name.lower()
        for name in dir(go)
        if isinstance(getattr(go, name), type) and issubclass(getattr(go, name), BaseTraceType)
    }
    used = set()
    sources = [*ROOT.glob("static/js/*.js"), *ROOT.glob("templates/**/*.html")]
    for path in sources:
        used |= set(re.findall(r"""\btype:\s*["'](\w+)["']""", path.read_text()))
    for path in [*ROOT.glob("console/*.py"), *ROOT.glob("monitoring/*.py")]:
        used |= {t.lower() for t in re.findall(r"\bgo\.(\w+)\(", path.read_text())}
    return (used & known) | {"scatter"}


@pytest.mark.browser
def test_plotly_bundle_is_partial_with_every_trace_type_our_charts_draw(browser):
    from plotly.offline import get_plotlyjs_version

    text = BUNDLE.read_text()
    # Made for the figures the Python package writes (.ci/plotly-bundle.sh builds it).
    assert f"plotly.js v{get_plotlyjs_version()}" in text.splitlines()[0]
    assert len(text) < 2_000_000  # the full bundle is 4.8 MB
    drawn = _trace_types_drawn()
    assert {"scatter", "bar", "heatmap", "parcoords"} <= drawn, drawn
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_content("<html><body></body></html>")
        page.add_script_tag(content=text)
        bundled = set(page.evaluate("Object.keys(Plotly.PlotSchema.get().traces)"))
    finally:
        context.close()
    assert drawn <= bundled, drawn - bundled
    assert "scatter3d" not in bundled and "choropleth" not in bundled  # partial

"""What the web process (Procfile `web`: uvicorn console.asgi:application) loads: its
ASGI application, the URLconf and every view behind it, the websocket consumers, the
middleware and the template tag libraries. The SSH gateway's asyncssh is not among them:
only the `gateway` process (jobs/access/ssh.py) imports it.

Each check runs in a fresh Python, so what the test run itself imported counts for nothing."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WEB = r"""
import os, sys
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")
import console.asgi  # django.setup(), the middleware, the http and websocket routers
from django.template.backends.django import get_installed_libraries
from django.urls import URLPattern, URLResolver, get_resolver
import importlib
from console.routing import websocket_urlpatterns

def walk(patterns):
    for entry in patterns:
        if isinstance(entry, URLResolver):
            walk(entry.url_patterns)  # an include() imports its module here
        elif isinstance(entry, URLPattern):
            entry.callback  # a dotted-path view is imported here
            entry.lookup_str

walk(get_resolver().url_patterns)
walk(websocket_urlpatterns)
for library in get_installed_libraries().values():
    importlib.import_module(library)
assert console.asgi.application is not None
print("\n".join(sorted(sys.modules)))
"""


def _loaded(code: str) -> set[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.setdefault("SECRET_KEY", "web-imports-only-0123456789abcdef0123456789")
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return set(done.stdout.split())


def test_the_web_process_does_not_import_asyncssh():
    loaded = _loaded(WEB)
    assert "asyncssh" not in loaded, sorted(m for m in loaded if m.startswith("jobs.access"))
    # It did load what it serves: the pages, the terminal and the workspace apps' proxy.
    assert {"console.urls", "console.terminal", "console.proxy", "console.logins"} <= loaded
    assert {"jobs.access.streams", "jobs.access.sessions"} <= loaded
    assert "jobs.access.ssh" not in loaded


def test_the_gateway_process_does_import_it():
    """The other side: the command that runs the gateway has asyncssh (so the check above
    is not passing only because nothing could load it)."""
    code = (
        "import os, sys\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'console.settings')\n"
        "import django; django.setup()\n"
        "import jobs.management.commands.suanli_gateway\n"
        "print('\\n'.join(sorted(sys.modules)))\n"
    )
    assert {"asyncssh", "jobs.access.ssh"} <= _loaded(code)

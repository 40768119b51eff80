"""SSH keys attached to and detached from a cluster at any time (issue 40).

What a researcher counts on: a key attached to a running cluster logs in through the gateway
with the real OpenSSH client at once, with no restart; a detached one is refused at its next
login in the researcher's own language (their console preference), saying what to do; a
connection already open with it gets no new channel and is ended by the gateway's
heartbeat. A key may be a default: ticked on the new-cluster form, attached by the API when
a request names no keys. The API lists, adds, removes, attaches and detaches keys.

What an attacker tries: bob guesses the ids of alice's keys and clusters, on the pages and
through the API; every one is 404, and nothing of alice's changes."""

import asyncio
import json
import os
import subprocess

import asyncssh
import pytest
from browsing import login
from django.test import Client
from django.urls import reverse
from playwright.sync_api import expect
from test_gateway import _connect, alice_key, make_key, start_gateway, workspace_cluster

from console import preferences
from console.forms import ClusterForm
from console.models import ApiToken
from jobs.access import sessions
from jobs.clusters import services
from jobs.models import Cluster, ClusterEvent, SshKey
from jobs.nodes import workspaces

__all__ = ["alice_key", "start_gateway", "workspace_cluster"]  # fixtures of test_gateway

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
UTF8 = {**os.environ, "LC_ALL": "C.UTF-8"}  # OpenSSH escapes a banner's non-ASCII otherwise


def _ssh(gw, key, login, *args):
    done = subprocess.run(
        gw.ssh_command(key, login, *args), stdin=subprocess.DEVNULL, capture_output=True,
        timeout=60, env=UTF8,
    )  # fmt: skip
    return done.returncode, done.stdout.decode(), done.stderr.decode()


# -- the gateway, with the real OpenSSH client ------------------------------------------------


@pytest.mark.django_db(transaction=True)  # the gateway process reads what the test writes
def test_a_key_attached_to_a_running_cluster_logs_in_at_once_and_detached_is_refused_in_chinese(
    start_gateway, workspace_cluster, alice, alice_key, settings
):
    """Long because it follows one key through its life on one running cluster: refused
    while not attached, in at once when attached, cut off when detached, in 中文 throughout."""
    preferences.save(alice, language="zh-hans")
    gw = start_gateway(SUANLI_PUBLIC_URL="https://console.example")
    cluster = workspace_cluster(name="keys-later", ssh_keys=())
    name = workspaces.login_name(cluster.pk, 0)
    page = f"https://console.example/clusters/{cluster.pk}/"

    rc, _, err = _ssh(gw, alice_key, name, "true")
    assert rc == 255
    assert f"Suanli：密钥 {alice_key.fingerprint} 不能以 {name} 登录：它没有绑定到此集群" in err, (
        err
    )
    assert f"请在集群页面 {page} 绑定它" in err, err

    assert services.ssh_key_attach(cluster=cluster, key=alice_key.row)
    rc, out, err = _ssh(gw, alice_key, name, "echo", "in")
    assert (rc, out) == (0, "in\n"), err
    attached = ClusterEvent.objects.get(cluster=cluster, kind="key-attached")
    assert alice_key.fingerprint in attached.message

    async def open_then_detach():
        async with _connect(gw, name, alice_key) as conn:
            assert (await conn.run("echo open")).stdout == "open\n"
            await asyncio.to_thread(_detach, cluster.pk, alice_key.row.pk)
            with pytest.raises(asyncssh.ChannelOpenError) as refused:
                await conn.run("echo again")
            await asyncio.wait_for(conn.wait_closed(), 20)
            return refused.value.reason

    reason = asyncio.run(open_then_detach())
    assert f"Suanli：密钥 {alice_key.fingerprint} 不能再以 {name} 登录" in reason, reason
    assert page in reason, reason

    rc, _, err = _ssh(gw, alice_key, name, "true")
    assert rc == 255
    assert f"不能以 {name} 登录：它没有绑定到此集群" in err, err
    assert ClusterEvent.objects.filter(cluster=cluster, kind="key-detached").count() == 1

    # A key on no account here is told to add it first, in the language of the console.
    stranger = make_key(gw.host_key.parent.parent / "nobody", "id_ed25519")
    rc, _, err = _ssh(gw, stranger, name, "true")
    assert "it is on no account here" in err and "/keys/" in err, err


def _detach(cluster_id: int, key_id: int) -> None:
    """On a thread of its own (the event loop's may not use the database)."""
    from django.db import connection

    try:
        services.ssh_key_detach(
            cluster=Cluster.objects.get(pk=cluster_id), key=SshKey.objects.get(pk=key_id)
        )
    finally:
        connection.close()


@pytest.mark.django_db(transaction=True)  # the gateway process reads what the test writes
def test_an_open_connection_whose_key_is_detached_is_ended_by_the_heartbeat(
    start_gateway, workspace_cluster, alice_key
):
    """Without opening a channel: the gateway's heartbeat ends it (HEARTBEAT_S)."""
    gw = start_gateway()
    cluster = workspace_cluster(name="cut-off")
    name = workspaces.login_name(cluster.pk, 0)

    async def held_open():
        async with _connect(gw, name, alice_key) as conn:
            process = await conn.create_process("cat")
            await asyncio.to_thread(_detach, cluster.pk, alice_key.row.pk)
            await asyncio.wait_for(conn.wait_closed(), sessions.HEARTBEAT_S + 30)
            return process.exit_status

    asyncio.run(held_open())
    log = gw.log.read_text()
    assert f"{name}: ended: Suanli: the key {alice_key.fingerprint} may not log in" in log, log


# -- the pages ----------------------------------------------------------------------------------


def test_a_default_key_comes_ticked_on_the_new_cluster_form(client, alice, bob, catalog):
    laptop = services.ssh_key_add(owner=alice, name="laptop", public_key=_public("laptop"))
    desk = services.ssh_key_add(owner=alice, name="desk", public_key=_public("desk"))
    services.ssh_key_add(owner=bob, name="bobs", public_key=_public("bobs"), is_default=True)
    client.force_login(alice)
    response = client.post(reverse("ssh_key_default", args=[desk.pk]), {"is_default": "1"})
    assert response.status_code == 302
    assert ClusterForm(owner=alice).fields["ssh_keys"].initial == [desk.pk]
    page = client.get(reverse("cluster_new")).content.decode()
    ticked = _checkbox(page, desk.pk)
    assert "checked" in ticked, ticked
    assert "checked" not in _checkbox(page, laptop.pk)

    # bob may not make alice's key a default, nor untick it.
    client.force_login(bob)
    response = client.post(reverse("ssh_key_default", args=[desk.pk]), {"is_default": "0"})
    assert response.status_code == 404
    assert SshKey.objects.get(pk=desk.pk).is_default


def _checkbox(page: str, key_id: int) -> str:
    at = page.index(f'name="ssh_keys" value="{key_id}"')
    return page[page.rindex("<input", 0, at) : page.index(">", at) + 1]


def _public(comment: str) -> str:
    return _PUBLIC.setdefault(comment, _keygen(comment))


_PUBLIC: dict[str, str] = {}


def _keygen(comment: str) -> str:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        return make_key(Path(folder), comment).public


def test_bob_guessing_ids_attaches_and_detaches_nothing_of_alices_on_the_pages(
    client, alice, bob, make_paper_host, make_cluster
):
    make_paper_host()
    theirs = make_cluster(alice, "alices")
    mine = make_cluster(bob, "bobs")
    alice_key = services.ssh_key_add(owner=alice, name="laptop", public_key=_public("laptop"))
    bob_key = services.ssh_key_add(owner=bob, name="bobs", public_key=_public("bobs"))
    services.ssh_key_attach(cluster=theirs, key=alice_key)
    client.force_login(bob)
    tries = [
        (reverse("cluster_key_attach", args=[theirs.pk]), {"key": bob_key.pk}),
        (reverse("cluster_key_attach", args=[mine.pk]), {"key": alice_key.pk}),
        (reverse("cluster_key_attach", args=[mine.pk]), {"key": "1 OR 1=1"}),
        (reverse("cluster_key_detach", args=[theirs.pk, alice_key.pk]), {}),
        (reverse("cluster_key_detach", args=[mine.pk, alice_key.pk]), {}),
        (reverse("ssh_key_delete", args=[alice_key.pk]), {}),
    ]
    for url, data in tries:
        assert client.post(url, data).status_code == 404, url
    assert list(theirs.ssh_keys.all()) == [alice_key]
    assert not mine.ssh_keys.exists()

    # Alice's own: attached from the cluster page, detached, and the timeline says so.
    client.force_login(alice)
    response = client.post(reverse("cluster_key_detach", args=[theirs.pk, alice_key.pk]))
    assert response.status_code == 302 and not theirs.ssh_keys.exists()
    response = client.post(reverse("cluster_key_attach", args=[theirs.pk]), {"key": alice_key.pk})
    assert response.status_code == 302 and theirs.ssh_keys.get() == alice_key
    kinds = list(theirs.events.filter(kind__startswith="key-").values_list("kind", flat=True))
    assert sorted(kinds) == ["key-attached", "key-attached", "key-detached"]

    # Removing the key detaches it everywhere (its timeline says so).
    client.post(reverse("ssh_key_delete", args=[alice_key.pk]))
    assert not theirs.ssh_keys.exists()
    assert theirs.events.filter(kind="key-detached").count() == 2


# -- the API -------------------------------------------------------------------------------------


def _api(user):
    _, token = ApiToken.issue(user=user, name="script")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def call(method, path, body=None):
        kwargs = {"content_type": "application/json"}
        if body is not None:
            kwargs["data"] = json.dumps(body)
        response = getattr(client, method.lower())(f"/api/v1/{path}", **kwargs)
        return response.status_code, (response.json() if response.content else None)

    return call


def test_the_api_lists_adds_removes_attaches_and_detaches_keys_and_bob_gets_404(
    alice, bob, make_paper_host, make_cluster, priced
):
    """Long because it is a script's whole session with keys, then bob's guesses at each."""
    make_paper_host()
    api = _api(alice)
    status, body = api("POST", "ssh-keys", {"public_key": _public("laptop"), "is_default": True})
    assert status == 201, body
    laptop = body
    assert (laptop["name"], laptop["is_default"]) == ("laptop", True)
    assert laptop["fingerprint"].startswith("SHA256:")
    status, body = api("POST", "ssh-keys", {"public_key": _public("laptop")})
    assert status == 400 and body["fields"]["public_key"] == ["You have added this key already."]
    status, body = api("POST", "ssh-keys", {"name": "desk", "public_key": "ssh-ed25519 AAAA"})
    assert status == 400 and "public_key" in body["fields"], body
    status, body = api("POST", "ssh-keys", {"name": "desk"})
    assert status == 400 and body["fields"]["public_key"] == ["This field is required."], body
    status, desk = api("POST", "ssh-keys", {"name": "desk", "public_key": _public("desk")})
    assert status == 201, desk
    status, body = api("GET", "ssh-keys")
    assert [k["name"] for k in body["ssh_keys"]] == ["laptop", "desk"]

    # A cluster requested with no keys named gets the defaults; [] gets none.
    shape = {"gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
             "image": "suanli/busybox:latest", "volumes": [], "release_policy": "never"}  # fmt: skip
    status, cluster = api("POST", "clusters", {**shape, "name": "defaults"})
    assert status == 201, cluster
    status, keys = api("GET", f"clusters/{cluster['id']}/ssh-keys")
    assert [k["id"] for k in keys["ssh_keys"]] == [laptop["id"]]
    status, bare = api("POST", "clusters", {**shape, "name": "bare", "ssh_keys": []})
    assert status == 201 and api("GET", f"clusters/{bare['id']}/ssh-keys")[1]["ssh_keys"] == []

    status, keys = api("POST", f"clusters/{cluster['id']}/ssh-keys", {"key": desk["id"]})
    assert status == 200 and [k["id"] for k in keys["ssh_keys"]] == [laptop["id"], desk["id"]]
    status, keys = api("DELETE", f"clusters/{cluster['id']}/ssh-keys/{laptop['id']}")
    assert status == 200 and [k["id"] for k in keys["ssh_keys"]] == [desk["id"]]
    status, changed = api("PATCH", f"ssh-keys/{laptop['id']}", {"is_default": False})
    assert status == 200 and changed["is_default"] is False

    # Bob guesses alice's ids: every one is 404, and nothing of hers changes.
    bob_api = _api(bob)
    status, bobs = bob_api("POST", "ssh-keys", {"public_key": _public("bobs")})
    status, his = bob_api("POST", "clusters", {**shape, "name": "his", "ssh_keys": []})
    assert status == 201, his
    for method, path, body in [
        ("DELETE", f"ssh-keys/{desk['id']}", None),
        ("PATCH", f"ssh-keys/{desk['id']}", {"is_default": True}),
        ("GET", f"clusters/{cluster['id']}/ssh-keys", None),
        ("POST", f"clusters/{cluster['id']}/ssh-keys", {"key": bobs["id"]}),
        ("POST", f"clusters/{his['id']}/ssh-keys", {"key": desk["id"]}),
        ("DELETE", f"clusters/{cluster['id']}/ssh-keys/{desk['id']}", None),
        ("DELETE", f"clusters/{his['id']}/ssh-keys/{desk['id']}", None),
    ]:
        status, body = bob_api(method, path, body)
        assert (status, body["error"]) == (404, "Not found."), (method, path, body)
    assert [k["id"] for k in bob_api("GET", "ssh-keys")[1]["ssh_keys"]] == [bobs["id"]]
    assert api("GET", f"clusters/{cluster['id']}/ssh-keys")[1]["ssh_keys"][0]["id"] == desk["id"]
    assert api("GET", f"clusters/{his['id']}/ssh-keys")[0] == 404

    status, _ = api("DELETE", f"ssh-keys/{desk['id']}")
    assert status == 204
    assert api("GET", f"clusters/{cluster['id']}/ssh-keys")[1]["ssh_keys"] == []
    assert [k["id"] for k in api("GET", "ssh-keys")[1]["ssh_keys"]] == [laptop["id"]]


def test_the_schema_names_the_key_endpoints_with_their_required_fields(client):
    schema = client.get("/api/v1/schema").json()
    for path, methods in {
        "/api/v1/ssh-keys": {"get", "post"},
        "/api/v1/ssh-keys/{key_id}": {"patch", "delete"},
        "/api/v1/clusters/{cluster_id}/ssh-keys": {"get", "post"},
        "/api/v1/clusters/{cluster_id}/ssh-keys/{key_id}": {"delete"},
    }.items():
        assert methods <= set(schema["paths"][path]), path
    shapes = schema["components"]["schemas"]
    assert shapes["NewSshKey"]["required"] == ["public_key"]
    assert shapes["AttachKey"]["required"] == ["key"]
    assert set(shapes["SshKeyOut"]["required"]) >= {"id", "fingerprint", "is_default"}


# -- in Chromium, in 中文 ------------------------------------------------------------------------


@pytest.fixture
def zh_page(browser):
    context = browser.new_context(
        viewport={"width": 1366, "height": 900}, locale="zh-CN", timezone_id="Asia/Shanghai"
    )
    page = context.new_page()
    yield page
    context.close()


def _shots(page, name, part="body"):
    """The page at 1366 px as it is, then loaded again at 390 px (as a phone would: the
    charts are laid out for the width they load at), then back; `part` (what this issue
    changed) fits in the window at each width."""
    for width in (1366, 390):
        if width != 1366:
            page.set_viewport_size({"width": width, "height": 900})
            page.reload()
        page.screenshot(path=os.path.join(SHOTS, f"keys-{name}-zh-{width}.png"), full_page=True)
        if part != "body":  # and the part itself, to look at closely
            page.locator(part).screenshot(
                path=os.path.join(SHOTS, f"keys-{name}-zh-{width}-part.png")
            )
        sticks_out = page.evaluate(
            """([sel, w]) => [...document.querySelectorAll(sel + ', ' + sel + ' *')]
                .filter((e) => e.getBoundingClientRect().right > w + 1)
                .map((e) => e.tagName + ' ' + e.textContent.slice(0, 40))""",
            [part, width],
        )
        assert not sticks_out, f"{name} at {width}px: {sticks_out}"
    page.set_viewport_size({"width": 1366, "height": 900})
    page.reload()


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)  # the live server and the gateway read the test's rows
def test_a_researcher_attaches_a_key_on_the_cluster_page_and_logs_in_then_detaches_it(
    zh_page, live_server, start_gateway, workspace_cluster, alice, alice_key
):
    """Long because it is the whole path in the browser and the terminal, with a picture of
    each page changed, in 中文 at 1366 and 390 px."""
    page = zh_page
    gw = start_gateway()
    cluster = workspace_cluster(name="keys-later", ssh_keys=())
    name = workspaces.login_name(cluster.pk, 0)
    login(page, live_server, "alice", "alice-pass-123")
    preferences.save(alice, language="zh-hans")

    page.goto(f"{live_server.url}/clusters/{cluster.pk}/")
    card = page.get_by_test_id("cluster-keys")
    expect(page.get_by_test_id("no-ssh-keys")).to_contain_text("下方绑定")
    _shots(page, "cluster-none", "#cluster-login .card.login")
    card.get_by_test_id("attach-key").select_option(str(alice_key.row.pk))
    card.get_by_test_id("attach").click()
    expect(page.locator(".msg-success")).to_contain_text("已绑定到集群 keys-later")
    expect(card.locator("ul.keylist")).to_contain_text(alice_key.fingerprint)
    expect(page.get_by_test_id("no-ssh-keys")).to_have_count(0)
    _shots(page, "cluster-attached", "#cluster-login .card.login")

    rc, out, err = _ssh(gw, alice_key, name, "echo", "in")
    assert (rc, out) == (0, "in\n"), err

    card.get_by_test_id(f"detach-{alice_key.row.pk}").click()
    expect(page.locator(".msg-success")).to_contain_text("已从集群 keys-later 解绑")
    rc, _, err = _ssh(gw, alice_key, name, "true")
    assert rc == 255 and f"不能以 {name} 登录：它没有绑定到此集群" in err, err
    expect(page.locator("body")).to_contain_text("解绑密钥")  # the timeline's line

    # The keys page: make it a default; the new-cluster form comes with it ticked.
    page.goto(f"{live_server.url}/keys/")
    page.get_by_test_id(f"default-{alice_key.row.pk}").get_by_role("button").click()
    expect(page.locator(".msg-success")).to_contain_text("现在会为每个新集群默认勾选")
    _shots(page, "keys")
    page.goto(f"{live_server.url}/clusters/new/")
    expect(page.locator(f"input[name=ssh_keys][value='{alice_key.row.pk}']")).to_be_checked()

"""A team's members reach the team's clusters through the live channels (the SSH gateway,
the web terminal and the console's live sockets, the workspace apps' proxy) and a member
removed from the team loses them at once (jobs/access/admission.py, jobs/access/ssh.py,
console/revoked.py, console/terminal.py, console/proxy.py): the real gateway from the
Procfile driven by the real OpenSSH client, the real engines, the channel layer on the
real Redis."""

import asyncio
import subprocess
import threading
import time

import asyncssh
import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from test_app_origin_attacks import SERVE, _cookie_of, _get, _host, _ticket
from test_gateway import _connect, make_key, start_gateway
from test_terminal import _closed_with, _hung_up, _logins, _read_until, _workspace
from test_workspace_apps import WS_SERVER, _in_workspace, _run, _with_workspace, _write
from test_workspace_apps import _socket as _app_socket
from waiting import until

from console import proxy
from console.asgi import application
from jobs import tasks
from jobs.access import webapps
from jobs.base import outage
from jobs.clusters import services
from jobs.models import ClusterEvent, TeamMember
from jobs.nodes import workspaces
from jobs.teams import services as teams
from jobs.tenancy.actors import Actor

pytestmark = pytest.mark.django_db(transaction=True)

__all__ = ["start_gateway"]  # a fixture of test_gateway
ORIGIN = (b"origin", b"http://localhost")


@pytest.fixture(autouse=True)
def _proxy_db_closed():
    yield
    proxy.close_db_connections()


def _person(login):
    return get_user_model().objects.create_user(login, password=f"{login}-pass-123")


@pytest.fixture
def lab(alice, running_cluster):
    """Alice's lab (alice owner, mo member, vi viewer) and its running cluster with a
    workspace, made by alice, mo and vi added to it."""
    team = teams.team_create(person=alice, name="张老师课题组")
    owner = Actor.for_team(alice, team.pk)
    people = {}
    for login, role in (("mo", TeamMember.Role.MEMBER), ("vi", TeamMember.Role.VIEWER)):
        people[login] = _person(login)
        invite, _token = teams.invite_create(actor=owner, role=role, login=login)
        teams.invite_accept(person=people[login], invite=invite)
    cluster = _with_workspace(
        running_cluster, owner=team.principal, name="lab-gpu", created_by=alice
    )
    cluster.members.add(people["mo"], people["vi"])
    return team, owner, cluster, people


def _remove(owner, team, person):
    """The owner removes `person` (on a scenario's thread: its connection closed after)."""
    try:
        teams.member_remove(actor=owner, member=TeamMember.objects.get(team=team, person=person))
    finally:
        if threading.current_thread() is not threading.main_thread():
            outage.close_db_connections()


def _acting_client(person, team) -> Client:
    """A logged-in browser of `person` acting for `team` (the switcher's POST)."""
    client = Client()
    client.force_login(person)
    assert client.post(reverse("act_for"), {"team": team.pk}).status_code == 302
    return client


def _own_key(person, folder, name):
    key = make_key(folder, name)
    key.row = services.ssh_key_add(owner=person, name=name, public_key=key.public)
    return key


def test_a_member_logs_in_with_their_own_key_and_removal_ends_the_session_at_once(
    start_gateway, lab, bob, tmp_path
):
    team, owner, cluster, people = lab
    mo_key = _own_key(people["mo"], tmp_path / "mo", "id_mo")
    vi_key = _own_key(people["vi"], tmp_path / "vi", "id_vi")
    bob_key = _own_key(bob, tmp_path / "bob", "id_bob")
    # Each attaches their own key (SSH keys stay personal); vi attached theirs while a
    # member, then the owner made them a viewer: the key stays, the login does not.
    services.ssh_key_attach(cluster=cluster, key=mo_key.row)
    vi_member = TeamMember.objects.get(team=team, person=people["vi"])
    teams.member_set_role(actor=owner, member=vi_member, role=TeamMember.Role.MEMBER)
    services.ssh_key_attach(cluster=cluster, key=vi_key.row)
    teams.member_set_role(actor=owner, member=vi_member, role=TeamMember.Role.VIEWER)
    assert cluster.ssh_keys.filter(pk=vi_key.row.pk).exists()
    gw = start_gateway()
    login = workspaces.login_name(cluster.pk, 0)

    done = gw.ssh(mo_key, login, "echo hello from $(id -u)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().startswith("hello from "), done.stdout
    event = ClusterEvent.objects.filter(cluster=cluster, kind="ssh").last()
    assert event.message == f"ssh login to node 0 by mo with key {mo_key.fingerprint}"

    viewer = gw.ssh(vi_key, login, "true")
    assert viewer.returncode == 255
    assert "your role in 张老师课题组 is viewer, which reads only" in viewer.stderr.decode()

    def refusal(key, name):
        done = gw.ssh(key, name, "true")
        assert done.returncode == 255
        return done.stderr.decode()

    stranger = refusal(bob_key, login)
    missing = refusal(bob_key, "c999999-0")
    assert "lab-gpu" not in stranger
    assert stranger == missing.replace("c999999-0", login).replace(
        "/clusters/999999/", f"/clusters/{cluster.pk}/"
    ), "a team's cluster reads to a stranger as one that does not exist"

    # An open session of the member (a shell's command that would run ten minutes).
    session = subprocess.Popen(
        gw.ssh_command(mo_key, login, "sleep 600"),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        until(
            lambda: any("sleep 600" in p for p in _logins(_workspace(cluster))),
            timeout=30, what="the member's command runs in the workspace",
        )  # fmt: skip
        _remove(owner, team, people["mo"])
        _out, err = session.communicate(timeout=20)  # ended by the revocation, not at 600 s
    finally:
        if session.poll() is None:
            session.kill()
    assert session.returncode != 0
    assert "your access to this cluster ended" in err.decode(), err
    until(
        lambda: not any("sleep 600" in p for p in _logins(_workspace(cluster))),
        timeout=20, what="what the session ran is hung up",
    )  # fmt: skip
    # The next login is refused as a stranger's (their key was detached with them).
    after = refusal(mo_key, login)
    assert after.replace(mo_key.fingerprint, "K") == stranger.replace(bob_key.fingerprint, "K")


def _socket(path, client: Client | None):
    from channels.testing import WebsocketCommunicator

    headers = [ORIGIN]
    if client is not None:
        headers.append((b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()))
    return WebsocketCommunicator(application, path, headers=headers)


def test_a_removed_members_terminal_and_live_charts_close_at_once(lab, bob):
    team, owner, cluster, people = lab
    member = _acting_client(people["mo"], team)
    viewer = _acting_client(people["vi"], team)
    stranger = Client()
    stranger.force_login(bob)
    terminal = f"/ws/clusters/{cluster.pk}/nodes/0/terminal/"
    charts = f"/ws/clusters/{cluster.pk}/metrics/"
    workspace = _workspace(cluster)

    async def scenario():
        found = {}
        # A stranger's socket is refused as for a cluster that does not exist.
        other = _socket(terminal, stranger)
        found["stranger"] = await other.connect(timeout=20)
        # A viewer sees the cluster but gets no shell, in words.
        read_only = _socket(terminal, viewer)
        assert (await read_only.connect(timeout=20))[0]
        found["viewer"] = await _closed_with(read_only, b"reads only", 4403)
        # The member's terminal and live charts, open when the owner removes them.
        shell, chart = _socket(terminal, member), _socket(charts, member)
        assert (await shell.connect(timeout=20))[0]
        assert (await chart.connect(timeout=20))[0]
        await _read_until(shell, b"$")
        await shell.send_to(bytes_data=b"sleep 600\n")
        await asyncio.sleep(1)
        found["running"] = await asyncio.to_thread(_logins, workspace)
        started = time.monotonic()
        await asyncio.to_thread(_remove, owner, team, people["mo"])
        found["shell"] = await _closed_with(shell, b"your access to this cluster ended", 4403)
        found["chart"] = await chart.receive_output(timeout=10)
        found["took"] = time.monotonic() - started
        await _hung_up(workspace)
        # The next socket acts for themselves again: the team's cluster is not there.
        again = _socket(terminal, member)
        found["again"] = await again.connect(timeout=20)
        return found

    found = _run(scenario)
    assert found["stranger"] == (False, 4404)
    assert "张老师课题组" in found["viewer"].decode()
    assert any("sleep 600" in line for line in found["running"]), found["running"]
    assert found["chart"] == {"type": "websocket.close", "code": 4403}
    assert found["took"] < 20  # well before any heartbeat-based check would
    assert found["again"] == (False, 4404)


def test_a_removed_members_app_cookie_opens_the_teams_app_no_more(lab, bob):
    team, owner, cluster, people = lab
    _write(cluster, "/tmp/site/index.html", "<h1>the lab's service</h1>")
    _in_workspace(cluster, *SERVE, detach=True)
    webapps.start(cluster=cluster, index=0, kind="service", port="6006")
    member = _acting_client(people["mo"], team)
    viewer = _acting_client(people["vi"], team)
    stranger = Client()
    stranger.force_login(bob)
    app_open = reverse("app_open", args=[cluster.pk, 0, "service"])
    assert stranger.get(app_open).status_code == 404
    assert viewer.get(app_open).status_code == 403
    enter, _ticket_value = _ticket(member, cluster, "service")
    service = _host(cluster, "service")

    async def scenario():
        found = {}
        cookie = _cookie_of(await _get(enter, host=service))
        found["before"] = await _get("/", host=service, cookie=cookie)
        await asyncio.to_thread(_remove, owner, team, people["mo"])
        found["after"] = await _get("/", host=service, cookie=cookie)
        return found

    until(lambda: webapps.answering(cluster, 0, list(cluster.apps.all()))["service"],
          timeout=30, what="the service answers")  # fmt: skip
    found = _run(scenario)
    assert found["before"]["status"] == 200, found["before"]
    assert b"the lab's service" in found["before"]["body"]
    assert found["after"]["status"] == 404
    assert b"the lab's service" not in found["after"]["body"]


def test_a_removed_members_open_app_websocket_closes_at_once(lab):
    team, owner, cluster, people = lab
    _write(cluster, "/tmp/ws.sh", WS_SERVER)
    _in_workspace(
        cluster, "env", "REQ=/tmp/ws-request", "IN=/tmp/ws-in",
        "nc", "-ll", "-p", "6008", "-e", "/tmp/ws.sh", detach=True,
    )  # fmt: skip
    webapps.start(cluster=cluster, index=0, kind="service", port="6008")
    member = _acting_client(people["mo"], team)
    enter, _ticket_value = _ticket(member, cluster, "service")
    host = _host(cluster, "service")

    async def scenario():
        cookie = _cookie_of(await _get(enter, host=host))
        kernel = _app_socket(host, "/kernels/k1/channels", cookie=cookie)
        opened = await kernel.connect(timeout=15)
        hello = await kernel.receive_from(timeout=10)
        await asyncio.to_thread(_remove, owner, team, people["mo"])
        closed = await kernel.receive_output(timeout=10)
        again = _app_socket(host, "/kernels/k1/channels", cookie=cookie)
        return opened, hello, closed, await again.connect(timeout=15)

    opened, hello, closed, again = _run(scenario)
    assert opened[0] is True and hello == "hello from the workspace"
    assert closed == {"type": "websocket.close", "code": 4403}
    assert again == (False, 4404), "the member's cookie opens the team's app no more"


def test_a_membership_gone_without_its_message_opens_no_channel_and_ends(
    start_gateway, lab, tmp_path
):
    """The revocation's message is best-effort (Redis may be away): every channel open
    reads the membership itself. Here the row goes without any message (as if it was
    lost), the key stays attached: the next channel is refused in words and the
    connection ends."""
    team, _owner, cluster, people = lab
    mo_key = _own_key(people["mo"], tmp_path / "mo", "id_mo")
    services.ssh_key_attach(cluster=cluster, key=mo_key.row)
    gw = start_gateway()
    login = workspaces.login_name(cluster.pk, 0)

    def gone():  # on a thread of its own (the event loop's may not use the database)
        try:
            TeamMember.objects.filter(team=team, person=people["mo"]).delete()
        finally:
            outage.close_db_connections()

    async def session():
        async with _connect(gw, login, mo_key) as conn:
            assert (await conn.run("echo in")).stdout == "in\n"
            await asyncio.to_thread(gone)
            with pytest.raises(asyncssh.ChannelOpenError) as refused:
                await conn.run("echo again")
            await asyncio.wait_for(conn.wait_closed(), 10)
            return refused.value.reason

    reason = asyncio.run(session())
    assert f"{login}: your access to this cluster ended" in reason, reason


def test_removal_with_restart_ends_what_the_member_left_running_and_keeps_the_files(lab):
    """A shell's `setsid`/`nohup` outlives its SSH session: the member removed with
    "restart" (the page's default) has the workspaces of every team cluster they could log
    in to restarted, so that nothing they started runs on; every file stays."""
    team, owner, cluster, people = lab
    notes = f"{workspaces.home(cluster)}/notes.txt"
    _write(cluster, notes, "kept")
    left = _in_workspace(cluster, "/bin/sh", "-c", "setsid sleep 7777 >/dev/null 2>&1 &")
    assert left.exit_code == 0, left.output
    assert b"sleep 7777" in _in_workspace(cluster, "ps", "-eo", "args").output
    member = TeamMember.objects.get(team=team, person=people["mo"])
    done = teams.member_remove(actor=owner, member=member, restart=True)
    assert done["restarted"] == [cluster.pk]
    assert tasks.cluster_workspaces_restart(cluster.pk)  # what the queued task runs
    assert b"sleep 7777" not in _in_workspace(cluster, "ps", "-eo", "args").output
    assert _in_workspace(cluster, "cat", notes).output == b"kept"
    said = ClusterEvent.objects.filter(cluster=cluster, kind="restarted").get().message
    assert "mo left the team" in said and "files kept" in said

"""The SSH gateway (jobs/access/ssh.py), driven by the real OpenSSH client against the Procfile's
`gateway` process and the real engines: a researcher's notebook of what works, then an
attacker's of what must not (another researcher's key, a key not attached, a cluster
that is over, a node that is not there, a link out of the storage, forwarding anywhere
but the workspace's own loopback)."""

import asyncio
import hashlib
import os
import re
import signal
import socket
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import asyncssh
import docker
import pytest
from browsing import free_port
from django.core.exceptions import ValidationError
from forms_data import cluster_form
from test_fault_services import PostgresServer, RedisServer
from waiting import until

from console.forms import CUSTOM_IMAGE, ClusterForm
from jobs import tasks
from jobs.access import hostkey, sessions, sftp, ssh
from jobs.base import validators
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.files.storage import VolumeSpec
from jobs.models import ClusterEvent
from jobs.nodes import runtime, workspaces
from jobs.runs import dispatch

pytestmark = pytest.mark.django_db

VOLUMES = (VolumeSpec("work", "/workspace"), VolumeSpec("data", "/data"))


@dataclass
class Key:
    path: Path
    public: str

    @property
    def fingerprint(self) -> str:
        done = subprocess.run(
            ["ssh-keygen", "-lf", str(self.path) + ".pub"], capture_output=True, text=True
        )
        return done.stdout.split()[1]


def make_key(folder: Path, name: str) -> Key:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(path)], check=True
    )
    return Key(path, (folder / f"{name}.pub").read_text().strip())


@dataclass
class Gateway:
    port: int
    host_key: Path
    log: Path
    pid: int

    def options(self, key: Key) -> list[str]:
        return [
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o", "LogLevel=INFO",
            "-i", str(key.path),
        ]  # fmt: skip

    def ssh_command(self, key: Key, login: str, *args, options=()) -> list[str]:
        return ["ssh", *self.options(key), "-p", str(self.port), *options,
                f"{login}@127.0.0.1", *args]  # fmt: skip

    def ssh(self, key: Key, login: str, *args, input=None, options=(), timeout=60):
        return subprocess.run(
            self.ssh_command(key, login, *args, options=options),
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
        )

    def sftp(self, key: Key, login: str, batch: str, timeout=60):
        return subprocess.run(
            ["sftp", *self.options(key), "-P", str(self.port), "-b", "-", f"{login}@127.0.0.1"],
            input=batch.encode(),
            capture_output=True,
            timeout=timeout,
        )

    def scp(self, key: Key, *paths, timeout=60):
        return subprocess.run(
            ["scp", *self.options(key), "-P", str(self.port), *map(str, paths)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
        )


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            return s.recv(64).startswith(b"SSH-2.0-Suanli")
    except OSError:
        return False


@pytest.fixture
def start_gateway(processes, storage_root, tmp_path):
    """`gateway` as the Procfile runs it, on a free port, with the test's storage."""

    def start(**env) -> Gateway:
        port = free_port()
        host_key = tmp_path / "gateway" / "ssh_host_ed25519_key"
        proc = processes.start(
            "gateway",
            env={
                "SUANLI_SSH_PORT": str(port),
                "SUANLI_SSH_HOST_KEY": str(host_key),
                "SUANLI_STORAGE_ROOT": str(storage_root),
                **{k: str(v) for k, v in env.items()},
            },
        )
        until(lambda: _answers(port), timeout=30, what="the gateway answers")
        log = tmp_path / f"gateway-{len(processes.procs) - 1}.log"
        return Gateway(port, host_key, log, proc.pid)

    return start


@pytest.fixture
def alice_key(alice, tmp_path):
    key = make_key(tmp_path / "alice", "id_ed25519")
    key.row = services.ssh_key_add(owner=alice, name="laptop", public_key=key.public)
    return key


@pytest.fixture
def workspace_cluster(running_cluster, alice_key):
    """Alice's running 1-node cluster with her key attached and its workspace up."""

    def make(**extra):
        extra.setdefault("volumes", VOLUMES)
        extra.setdefault("ssh_keys", (alice_key.row,))
        cluster = running_cluster(1, **extra)
        assert tasks.cluster_network_ensure(cluster.pk)
        return cluster

    return make


def _in_workspace(cluster, *cmd, detach=False):
    container = workspaces.running(cluster, 0)
    return container.exec_run(list(cmd), user=container.attrs["Config"]["User"], detach=detach)


# -- what a researcher does -----------------------------------------------------------------


def test_an_interactive_shell_with_a_tty_runs_as_the_tenant(
    start_gateway, workspace_cluster, alice, alice_key, settings
):
    gw = start_gateway()
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    done = gw.ssh(alice_key, login, input=b"id -u\nexit\n", options=["-tt"])
    out = done.stdout.decode(errors="replace")
    assert done.returncode == 0, (out, done.stderr)
    uid = runtime.tenant_uid(alice.pk)
    assert re.search(rf"^{uid}\r?$", out, re.M), (out, done.stderr)
    # Every login is on the cluster's timeline with its key.
    event = ClusterEvent.objects.filter(cluster=cluster, kind="ssh").last()
    assert event.message == f"ssh login to node 0 with key {alice_key.fingerprint}"

    # The host key was made once, 0600, and is what the console page shows.
    assert stat.S_IMODE(gw.host_key.stat().st_mode) == 0o600
    settings.SUANLI_SSH_HOST_KEY = gw.host_key
    scan = subprocess.run(
        ["ssh-keyscan", "-t", "ed25519", "-p", str(gw.port), "127.0.0.1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    listed = subprocess.run(
        ["ssh-keygen", "-lf", "-"], input=scan.stdout, capture_output=True, text=True
    )
    assert hostkey.host_key_fingerprint() == listed.stdout.split()[1]
    assert sessions.ssh_port() == settings.SUANLI_SSH_PORT
    public = gw.host_key.with_name(gw.host_key.name + ".pub")
    assert stat.S_IMODE(public.stat().st_mode) == 0o644, "the console reads its .pub"


def test_the_window_size_follows_the_client(start_gateway, workspace_cluster, alice_key):
    gw = start_gateway()
    cluster = workspace_cluster()

    async def session():
        async with asyncssh.connect(
            "127.0.0.1", gw.port, username=workspaces.login_name(cluster.pk, 0),
            client_keys=[str(alice_key.path)], known_hosts=None,
        ) as conn:  # fmt: skip
            process = await conn.create_process(term_type="xterm", term_size=(100, 30))
            seen = ""
            for asked, (cols, rows) in enumerate(((100, 30), (132, 43)), start=1):
                process.change_terminal_size(cols, rows)
                await asyncio.sleep(0.5)  # the resize goes its own way to the engine
                process.stdin.write("echo size=$(stty size)=\n")
                while len(re.findall(r"size=\d+ \d+=", seen)) < asked:
                    seen += await asyncio.wait_for(process.stdout.read(1024), 10)
            process.stdin.write("exit\n")
            await asyncio.wait_for(process.wait(), 10)
            return re.findall(r"size=(\d+ \d+)=", seen)

    assert asyncio.run(session()) == ["30 100", "43 132"]


def test_a_command_keeps_its_exit_status_streams_and_input(
    start_gateway, workspace_cluster, alice_key
):
    gw = start_gateway()
    login = workspaces.login_name(workspace_cluster().pk, 0)
    assert gw.ssh(alice_key, login, "exit 7").returncode == 7
    done = gw.ssh(alice_key, login, "echo out; echo err >&2; pwd")
    assert done.returncode == 0
    assert done.stdout.decode().split() == ["out", "/workspace"]
    assert b"err" in done.stderr and b"out" not in done.stderr
    # stdin reaches the command and its end too (cat ends).
    payload = os.urandom(300_000)
    done = gw.ssh(alice_key, login, "cat", input=payload)
    assert done.returncode == 0
    assert hashlib.sha256(done.stdout).hexdigest() == hashlib.sha256(payload).hexdigest()


def test_scp_copies_into_a_volume_and_back_unchanged_and_a_job_sees_it(
    start_gateway, workspace_cluster, alice_key, alice, storage_root, settle_until, tmp_path
):
    gw = start_gateway()
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    original = tmp_path / "weights.bin"
    original.write_bytes(os.urandom(2_000_000))
    done = gw.scp(alice_key, original, f"{login}@127.0.0.1:/workspace/weights.bin")
    assert done.returncode == 0, done.stderr
    stored = storage_root / f"u{alice.pk}" / "work" / "weights.bin"
    assert stored.read_bytes() == original.read_bytes()
    assert stored.stat().st_uid == runtime.tenant_uid(alice.pk), "written as the tenant"
    # A relative path lands in the login's home (the first volume), as in the workspace.
    back = tmp_path / "back.bin"
    done = gw.scp(alice_key, f"{login}@127.0.0.1:weights.bin", back)
    assert done.returncode == 0, done.stderr
    assert back.read_bytes() == original.read_bytes()

    digest = hashlib.sha256(original.read_bytes()).hexdigest()
    job = services.job_submit(
        cluster=cluster, spec=JobSpec(name="reads", command="sha256sum /workspace/weights.bin")
    )
    dispatch.dispatch(cluster.pk)
    job = settle_until(job)
    assert job.state == "succeeded", job.state_reason
    assert digest in job.replicas.get().log


def test_sftp_lists_the_volumes_from_a_hardened_container_that_goes_with_the_session(
    start_gateway, workspace_cluster, alice_key, alice
):
    gw = start_gateway()
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    assert _in_workspace(cluster, "sh", "-c", "echo hi > /data/note").exit_code == 0
    done = gw.sftp(alice_key, login, "pwd\nls /\nls /data\n")
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr
    assert "Remote working directory: /workspace" in out
    listing = out.split("sftp> ls /\n")[1].split("sftp>")[0].split()
    assert {"/workspace", "/data"} <= set(listing), out
    assert "/data/note" in out

    # While a session is open its container is there, hardened; then it is gone.
    node = cluster.node_set.select_related("host").get(released_at__isnull=True)
    client = docker.DockerClient(base_url=node.host.engine_url, timeout=10)

    def sftp_containers(**kw):  # one may go between the engine's list and its inspect
        return client.containers.list(filters={"label": sftp.LABEL}, ignore_removed=True, **kw)

    until(lambda: not sftp_containers(all=True), what="the first session's container removed")
    proc = subprocess.Popen(
        ["sftp", *gw.options(alice_key), "-P", str(gw.port), f"{login}@127.0.0.1"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        (container,) = until(sftp_containers, what="the sftp container")
        host_config = container.attrs["HostConfig"]
        uid = runtime.tenant_uid(alice.pk)
        assert container.attrs["Config"]["User"] == f"{uid}:{uid}"
        assert host_config["NetworkMode"] == "none" and host_config["ReadonlyRootfs"]
        assert host_config["CapDrop"] == ["ALL"] and not host_config["Privileged"]
        assert host_config["SecurityOpt"] == ["no-new-privileges"]
        # What it says is the files downloaded: never in the engine's log.
        assert host_config["LogConfig"]["Type"] == "none"
        assert 0 < host_config["PidsLimit"] <= 64 and host_config["Memory"] > 0
        mounts = {m["Destination"]: m for m in container.attrs["Mounts"]}
        assert set(mounts) == {"/workspace", "/data", "/etc"}
        assert mounts["/etc"]["Type"] == "volume"
        assert all(mounts[t]["Type"] == "bind" for t in ("/workspace", "/data"))
    finally:
        proc.communicate(b"bye\n", timeout=30)
    until(lambda: not sftp_containers(all=True), what="the sftp container removed")


def test_local_forwarding_reaches_a_port_of_the_workspace(
    start_gateway, workspace_cluster, alice_key
):
    gw = start_gateway()
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    listen = "(echo hello-from-the-workspace; sleep 5) | nc -l -p 7000 > /workspace/got"
    _in_workspace(cluster, "sh", "-c", listen, detach=True)
    local = free_port()
    tunnel = subprocess.Popen(
        gw.ssh_command(alice_key, login, options=["-N", "-L", f"{local}:localhost:7000"]),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:

        def exchange():
            try:
                with socket.create_connection(("127.0.0.1", local), timeout=5) as s:
                    s.sendall(b"ping-from-the-laptop\n")
                    got = b""
                    while not got.endswith(b"\n") and (chunk := s.recv(1024)):
                        got += chunk
                    return got
            except OSError:
                return b""

        assert until(exchange, timeout=30, what="the tunnel") == b"hello-from-the-workspace\n"
        until(
            lambda: (
                _in_workspace(cluster, "cat", "/workspace/got").output == b"ping-from-the-laptop\n"
            ),
            what="the workspace got the laptop's line",
        )
    finally:
        _end(tunnel)


def _end(tunnel: subprocess.Popen) -> tuple[bytes, bytes]:
    """Stop an `ssh -N` tunnel and read what it printed; on a loaded machine ssh may not act
    on SIGTERM within the wait (its words came already), so it is killed then."""
    tunnel.terminate()
    try:
        return tunnel.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        tunnel.kill()
        return tunnel.communicate(timeout=10)


# -- what must not work ---------------------------------------------------------------------


def test_refusals_are_in_words_and_tell_a_stranger_nothing(
    start_gateway, workspace_cluster, running_cluster, alice, alice_key, bob, tmp_path
):
    gw = start_gateway()
    cluster = workspace_cluster(name="secret-project")
    login = workspaces.login_name(cluster.pk, 0)
    not_attached = make_key(tmp_path / "alice", "id_other")
    services.ssh_key_add(owner=alice, name="other", public_key=not_attached.public)
    bob_key = make_key(tmp_path / "bob", "id_ed25519")
    bob_row = services.ssh_key_add(owner=bob, name="bob", public_key=bob_key.public)
    # Bob has a running cluster of his own with his key: it opens nothing of alice's.
    running_cluster(1, owner=bob, name="bobs", ssh_keys=(bob_row,))

    def refused(key, name, *words):
        done = gw.ssh(key, name, "true")
        err = done.stderr.decode()
        assert done.returncode == 255, err
        for word in words:
            assert word in err, err
        assert "secret-project" not in err
        return err

    stranger = refused(bob_key, login, f"the key {bob_key.fingerprint} may not log in as {login}")
    unattached = refused(not_attached, login, f"the key {not_attached.fingerprint} may not log in")
    missing = refused(alice_key, "c999999-0", "may not log in as c999999-0")
    assert stranger.replace(bob_key.fingerprint, "K") == missing.replace(
        alice_key.fingerprint, "K"
    ).replace("c999999-0", login).replace(  # the page to attach it on: from the name typed
        "/clusters/999999/", f"/clusters/{cluster.pk}/"
    ), "a cluster that exists reads as one that does not"
    assert "SSH keys page" in unattached
    refused(alice_key, "root", "'root' is not a login here", "c42-0")

    # The key's holder is told about the cluster itself.
    err = gw.ssh(alice_key, workspaces.login_name(cluster.pk, 3), "true").stderr.decode()
    assert f"cluster {cluster.name} has no node 3" in err
    assert not ClusterEvent.objects.filter(cluster=cluster, kind="ssh").exists()

    # An account an operator turned off logs in no more, and is told as a stranger is.
    alice.is_active = False
    alice.save(update_fields=["is_active"])
    refused(alice_key, login, f"the key {alice_key.fingerprint} may not log in as {login}")
    alice.is_active = True
    alice.save(update_fields=["is_active"])

    services.cluster_release(cluster=cluster)
    err = gw.ssh(alice_key, login, "true").stderr.decode()
    assert f"cluster {cluster.name} is released, not running" in err


def test_a_cluster_without_workspaces_or_pending_says_so(
    start_gateway, running_cluster, make_cluster, alice, alice_key
):
    gw = start_gateway()
    batch = running_cluster(1, workspace=False, ssh_keys=(alice_key.row,), name="batch")
    err = gw.ssh(alice_key, workspaces.login_name(batch.pk, 0), "true").stderr.decode()
    assert "created without workspaces" in err
    waiting = make_cluster(alice, "waits", ssh_keys=(alice_key.row,))  # never placed here
    err = gw.ssh(alice_key, workspaces.login_name(waiting.pk, 0), "true").stderr.decode()
    assert "is pending, not running" in err


def test_a_link_to_etc_made_in_the_workspace_shows_nothing_of_the_host(
    start_gateway, workspace_cluster, alice_key, alice, tmp_path
):
    gw = start_gateway()
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    made = gw.ssh(alice_key, login, "ln -s /etc /workspace/etc && ln -s / /workspace/root")
    assert made.returncode == 0, made.stderr
    got = tmp_path / "passwd"
    done = gw.sftp(alice_key, login, f"get /workspace/etc/passwd {got}\nls /workspace/root/\n")
    assert done.returncode == 0, done.stderr
    uid = runtime.tenant_uid(alice.pk)
    assert got.read_text() == f"tenant:x:{uid}:{uid}:tenant:/workspace:/sbin/nologin\n"
    assert got.read_text() != Path("/etc/passwd").read_text()
    listing = done.stdout.decode().split("ls /workspace/root/\n")[1].split()
    assert not {"/workspace/root/home", "/workspace/root/var", "/workspace/root/bin"} & set(
        listing
    ), listing
    # Nothing of the host's: no shadow, no other tenant's storage, no engine socket.
    for path in ("/workspace/etc/shadow", "/workspace/root/var/run/docker.sock",
                 "/workspace/root/home"):  # fmt: skip
        done = gw.sftp(alice_key, login, f"ls {path}\n")
        assert done.returncode != 0 and b"not found" in done.stderr, (path, done.stderr)


def test_forwarding_goes_nowhere_but_the_workspaces_loopback(
    start_gateway, workspace_cluster, alice_key
):
    gw = start_gateway()
    login = workspaces.login_name(workspace_cluster().pk, 0)
    local = free_port()
    tunnel = subprocess.Popen(
        gw.ssh_command(alice_key, login, options=["-N", "-L", f"{local}:172.29.0.1:5432"]),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        until(lambda: _connects(local), what="the tunnel's local end")
        with socket.create_connection(("127.0.0.1", local), timeout=5) as s:
            assert s.recv(100) == b"", "closed at once"
    finally:
        _, err = _end(tunnel)
    assert b"administratively prohibited" in err and b"only to localhost" in err, err
    # No remote forwarding, no agent forwarding.
    done = gw.ssh(
        alice_key, login, "echo ${SSH_AUTH_SOCK:-none}",
        options=["-A", "-R", "9999:localhost:22", "-o", "ExitOnForwardFailure=yes"],
    )  # fmt: skip
    assert done.returncode == 255 and b"remote port forwarding failed" in done.stderr
    done = gw.ssh(alice_key, login, "echo ${SSH_AUTH_SOCK:-none}", options=["-A"])
    assert done.stdout == b"none\n"


def _connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_sessions_are_bounded_per_researcher_and_idle_ones_end(
    start_gateway, workspace_cluster, alice_key
):
    gw = start_gateway(SUANLI_SSH_MAX_SESSIONS=1, SUANLI_SSH_IDLE_S=4)
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    started = time.monotonic()
    first = subprocess.Popen(
        gw.ssh_command(alice_key, login, "sleep 300"),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    until(lambda: ClusterEvent.objects.filter(cluster=cluster, kind="ssh").exists(),
          what="the first login")  # fmt: skip
    done = gw.ssh(alice_key, login, "true")
    assert done.returncode == 255
    assert b"you have 1 SSH sessions open" in done.stderr, done.stderr

    # Nothing came or went for 4 s: the first ends, and what it ran with it.
    _, err = first.communicate(timeout=30)
    assert time.monotonic() - started < 20
    assert b"idle for 4 s" in err, err
    until(lambda: b"sleep 300" not in _in_workspace(cluster, "ps").output,
          what="the session's process hung up")  # fmt: skip
    # Its place is free again.
    assert gw.ssh(alice_key, login, "true").returncode == 0


def test_the_gateway_hangs_up_what_a_dropped_session_left(
    start_gateway, workspace_cluster, alice_key
):
    gw = start_gateway()
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    proc = subprocess.Popen(
        gw.ssh_command(alice_key, login, "sleep 301; echo never"),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    until(lambda: b"sleep 301" in _in_workspace(cluster, "ps").output, what="it runs")
    proc.send_signal(signal.SIGKILL)  # the laptop's lid closes
    proc.communicate(timeout=10)
    until(lambda: b"sleep 301" not in _in_workspace(cluster, "ps").output,
          what="the process hung up")  # fmt: skip


@pytest.mark.alone  # stops PostgreSQL and Redis under every other test
def test_the_gateway_lives_through_redis_and_postgresql_restarts(
    start_gateway, workspace_cluster, alice_key, request
):
    from django.db import connection

    gw = start_gateway()
    login = workspaces.login_name(workspace_cluster().pk, 0)
    redis, postgres = RedisServer(request), PostgresServer(request)
    try:
        redis.shutdown()
        # Sessions are not counted meanwhile: the login is let in all the same.
        assert gw.ssh(alice_key, login, "echo in").stdout == b"in\n"
        redis.start()
        assert gw.ssh(alice_key, login, "echo in").stdout == b"in\n"

        postgres.stop()
        done = gw.ssh(alice_key, login, "true")
        assert done.returncode == 255 and b"its database does not answer" in done.stderr
        done = gw.ssh(alice_key, login, "true")
        assert b"its database does not answer" in done.stderr
        postgres.start()
        until(lambda: gw.ssh(alice_key, login, "echo in").stdout == b"in\n", timeout=30,
              what="logins again")  # fmt: skip
    finally:
        redis.start()
        postgres.start()
        connection.close()  # the test's own connection died with the server
    text = gw.log.read_text()
    assert text.count("Redis (gateway) is unreachable") == 1, text
    assert text.count("PostgreSQL (gateway) is unreachable") == 1, text
    assert "Traceback" not in text, text


def _connect(gw: Gateway, login: str, key: Key):
    return asyncssh.connect(
        "127.0.0.1", gw.port, username=login, client_keys=[str(key.path)], known_hosts=None
    )


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_one_connection_opens_a_bounded_number_of_channels_and_sftp_counts_as_sessions(
    start_gateway, workspace_cluster, alice_key
):
    gw = start_gateway(SUANLI_SSH_MAX_CHANNELS=3, SUANLI_SSH_MAX_SESSIONS=2)
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    node = cluster.node_set.select_related("host").get(released_at__isnull=True)
    engine = docker.DockerClient(base_url=node.host.engine_url, timeout=10)

    def sftp_containers() -> int:
        return len(engine.api.containers(filters={"label": sftp.LABEL}))

    async def session():
        async with _connect(gw, login, alice_key) as conn:  # one connection, as ControlMaster
            held = [await conn.create_process("sleep 60") for _ in range(3)]
            with pytest.raises(asyncssh.ChannelOpenError) as refused:
                await conn.create_process("true")
            assert "this connection has 3 channels open" in refused.value.reason
            held[0].close()
            await held[0].wait_closed()
            assert (await conn.run("echo again")).stdout == "again\n", "a place is free again"
            for process in held[1:]:
                process.close()
                await process.wait_closed()

            # The connection is one session of two; its first sftp goes with it, a second
            # is the other session, a third has none left.
            first = await conn.start_sftp_client()
            second = await conn.start_sftp_client()
            await asyncio.to_thread(until, lambda: sftp_containers() == 2, what="two sftp")
            third = await conn.create_process(subsystem="sftp", encoding=None)
            err = await asyncio.wait_for(third.stderr.read(), 30)
            assert b"you have 2 SSH sessions open" in err, err
            assert sftp_containers() == 2
            second.exit()
            await second.wait_closed()
            await asyncio.sleep(1)  # its session's release reaches Redis
            fourth = await conn.start_sftp_client()
            assert await fourth.exists("/workspace"), "its session is free again"
            first.exit()
            fourth.exit()

    asyncio.run(session())
    until(lambda: sftp_containers() == 0, what="the sftp containers removed")


def test_a_client_that_stops_reading_holds_the_command_not_the_gateways_memory(
    start_gateway, workspace_cluster, alice_key
):
    gw = start_gateway()
    login = workspaces.login_name(workspace_cluster().pk, 0)
    size = 200_000_000

    class Counted(asyncssh.SSHClientSession):
        got = 0

        def data_received(self, data, datatype):
            self.got += len(data)

    async def session():
        async with _connect(gw, login, alice_key) as conn:
            assert (await conn.run("echo warm")).exit_status == 0
            before = _rss(gw.pid)
            # A window of 2 GiB: the client's to pick; then it stops reading its socket.
            chan, counted = await conn.create_session(
                Counted, f"head -c {size} /dev/zero", encoding=None, window=2**31
            )
            conn._transport.pause_reading()  # asyncssh has no public way to stop reading
            await asyncio.sleep(5)
            grown = _rss(gw.pid) - before
            conn._transport.resume_reading()
            await asyncio.wait_for(chan.wait_closed(), 120)
            return grown, counted.got, chan.get_exit_status()

    grown, got, status = asyncio.run(session())
    assert (got, status) == (size, 0), "all of it came once the client read again"
    assert grown < 48 * 2**20, f"the gateway grew by {grown / 2**20:.0f} MiB while nobody read"


def test_a_released_clusters_open_connection_gets_no_new_channel_and_ends(
    start_gateway, workspace_cluster, alice_key
):
    gw = start_gateway()
    cluster = workspace_cluster(name="soon-over")
    login = workspaces.login_name(cluster.pk, 0)

    def release():  # on a thread of its own (the event loop's may not use the database)
        from django.db import connection

        try:
            services.cluster_release(cluster=cluster)
        finally:
            connection.close()

    async def session():
        async with _connect(gw, login, alice_key) as conn:
            assert (await conn.run("echo in")).stdout == "in\n"
            await asyncio.to_thread(release)
            with pytest.raises(asyncssh.ChannelOpenError) as refused:
                await conn.run("echo again")
            await asyncio.wait_for(conn.wait_closed(), 10)
            return refused.value.reason

    reason = asyncio.run(session())
    assert f"{login}: cluster soon-over is released, not running" in reason, reason


def test_an_unsigned_key_query_tells_nothing_and_a_connection_tries_few_keys(
    start_gateway, running_cluster, bob, tmp_path
):
    gw = start_gateway()
    bob_key = make_key(tmp_path / "bob", "id_ed25519")
    row = services.ssh_key_add(owner=bob, name="bob", public_key=bob_key.public)
    bobs = workspaces.login_name(running_cluster(1, owner=bob, name="bobs", ssh_keys=(row,)).pk)
    # A stranger holds bob's public key only (from a repository, a server's authorized_keys).
    stranger = tmp_path / "stranger" / "id_ed25519.pub"  # ssh -i takes it, for the query
    stranger.parent.mkdir()
    stranger.write_text(bob_key.public + "\n")

    def answer(login: str) -> list[str]:
        done = subprocess.run(
            ["ssh", "-o", "LogLevel=DEBUG1", *gw.options(Key(stranger, bob_key.public)),
             "-p", str(gw.port), f"{login}@127.0.0.1", "true"],
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 255, done.stderr
        assert "Offering public key" in done.stderr, done.stderr
        return [line for line in done.stderr.splitlines() if "accepts key" in line]

    on_bobs, on_none = answer(bobs), answer("c999999-0")
    assert len(on_bobs) == 1, "the same yes for every key"
    assert on_bobs == on_none, "bob's cluster reads as one that does not exist"

    # Seven keys: the seventh is not tried, the connection ends in words.
    keys = [make_key(tmp_path / "many", f"id_{n}") for n in range(7)]
    options = [arg for key in keys for arg in ("-i", str(key.path))]
    done = subprocess.run(
        ["ssh", *gw.options(keys[0]), *options, "-p", str(gw.port), f"{bobs}@127.0.0.1", "true"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 255
    assert "6 keys tried, the most one connection may try" in done.stderr, done.stderr
    assert done.stderr.count("may not log in as") == 6, done.stderr


def test_window_sizes_and_the_clients_environment_are_bounded(
    start_gateway, workspace_cluster, alice_key
):
    gw = start_gateway()
    login = workspaces.login_name(workspace_cluster().pk, 0)
    env = {f"LC_X{n}": "v" for n in range(20)}
    env.update(LANG="x" * 300, FOO="bar", LD_PRELOAD="/workspace/evil.so")

    async def session():
        async with _connect(gw, login, alice_key) as conn:
            process = await conn.create_process(term_type="xterm", term_size=(5000, 0), env=env)
            seen = ""

            async def ask(line: str, pattern: str) -> str:
                nonlocal seen
                process.stdin.write(line + "\n")
                while not (found := re.search(pattern, seen)):
                    seen += await asyncio.wait_for(process.stdout.read(1024), 10)
                seen = seen[found.end() :]
                return found.group(1)

            # The prompt first: a shell setting up its terminal may drop what came before.
            seen += await asyncio.wait_for(process.stdout.read(1024), 30)
            first = await ask("echo size=$(stty size)=", r"size=(\d+ \d+)=")
            for n in range(300):  # a flood of resizes: the last one wins
                process.change_terminal_size(40 + n % 50, 10 + n % 20)
            process.change_terminal_size(123, 45)
            await asyncio.sleep(1)
            last = await ask("echo size=$(stty size)=", r"size=(\d+ \d+)=")
            names = await ask("echo names=$(env | grep -c '^LC_X')=", r"names=(\d+)=")
            others = await ask(
                "echo others=${LANG:-none}${FOO:-}${LD_PRELOAD:-}=", r"others=(\w*)="
            )
            process.stdin.write("exit\n")
            await asyncio.wait_for(process.wait(), 10)
            return first, last, names, others

    assert asyncio.run(session()) == ("24 1000", "45 123", "8", "none")


def test_the_console_reads_the_host_key_and_never_makes_it(settings, tmp_path):
    key = tmp_path / "gateway" / "ssh_host_ed25519_key"
    settings.SUANLI_SSH_HOST_KEY = key
    assert hostkey.host_key_fingerprint() == hostkey.NO_HOST_KEY
    assert not key.parent.exists(), "nothing made"
    made = ssh.host_key().get_fingerprint("sha256")  # the gateway's own start
    assert made.startswith("SHA256:") and key.exists()
    public = hostkey.public_path(key)
    saved = public.read_bytes()
    public.unlink()  # a console that may read the private key only (no .pub yet)
    assert hostkey.host_key_fingerprint() == made
    public.write_bytes(saved)
    key.unlink()  # a console that may read the .pub only
    assert hostkey.host_key_fingerprint() == made


def test_a_cluster_may_not_run_the_sftp_image_and_sftp_runs_only_the_operators(
    alice, catalog, storage_root, settings, engine_urls
):
    assert settings.SUANLI_SFTP_IMAGE == "suanli/sftp:latest"
    for reference in ("suanli/sftp:latest", "suanli/sftp:mine", "docker.io/suanli/sftp",
                      f"index.docker.io/suanli/sftp@sha256:{'0' * 64}"):  # fmt: skip
        with pytest.raises(ValidationError, match="Suanli's own file transfer"):
            validators.validate_image_reference(reference)
    validators.validate_image_reference("suanli/sftp-tools:1")  # another repository
    form = ClusterForm(
        cluster_form(image=CUSTOM_IMAGE, custom_image="suanli/sftp:mine"), owner=alice
    )
    assert not form.is_valid()
    assert "Suanli's own file transfer" in " ".join(form.errors["custom_image"])

    # On the engine: the operator's image, made there, is used; one pulled is not.
    found = docker.APIClient(base_url=engine_urls[0]).inspect_image("suanli/sftp:latest")
    assert sftp.sftp_image_problem(found) is None
    pulled = {**found, "RepoDigests": [f"suanli/sftp@sha256:{'1' * 64}"]}
    assert "pulled from a registry" in sftp.sftp_image_problem(pulled)


def test_thirty_failed_logins_lock_the_address_on_every_gateway_until_the_cool_off(
    start_gateway, workspace_cluster, alice_key, tmp_path, settings
):
    """An attacker's notebook: guessing keys from one address, as fast as ssh goes."""
    from axes.models import AccessAttempt

    gw = start_gateway(AXES_COOLOFF_SECONDS=12)
    other = start_gateway(AXES_COOLOFF_SECONDS=12)  # a second gateway process
    login = workspaces.login_name(workspace_cluster().pk, 0)
    limit = settings.AXES_FAILURE_LIMIT
    # An agent offering five other keys before the right one logs in, as often as it likes:
    # a connection that logs in counts nothing, however many keys it offered.
    agent = [make_key(tmp_path / "agent", f"id_{n}") for n in range(5)] + [alice_key]
    offered = [arg for key in agent for arg in ("-i", str(key.path))]
    for _ in range(limit + 1):
        done = subprocess.run(
            ["ssh", *gw.options(agent[0]), *offered, "-p", str(gw.port), f"{login}@127.0.0.1",
             "echo in"],
            stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
        )  # fmt: skip
        assert done.stdout == b"in\n", done.stderr

    guesser = make_key(tmp_path / "guesser", "id_ed25519")
    started = time.monotonic()
    answers = [gw.ssh(guesser, login, "true").stderr.decode() for _ in range(30)]
    took = time.monotonic() - started
    assert all("may not log in as" in err for err in answers[:limit]), answers[:limit]
    for err in answers[limit:]:
        assert "too many failed log-ins from your address" in err, err
        assert "may not log in" not in err, "a locked address gets no key looked at"
    print(f"30 guesses in {took:.2f} s")

    # The right key from that address is refused too, in words, on every gateway process.
    for each in (gw, other):
        done = each.ssh(alice_key, login, "echo in")
        assert done.returncode == 255 and done.stdout == b""
        assert b"too many failed log-ins from your address" in done.stderr, done.stderr
    attempt = AccessAttempt.objects.get(ip_address="127.0.0.1")
    assert attempt.failures_since_start == limit, "a refused connection counts nothing"
    assert attempt.path_info == "/ssh/" and attempt.user_agent.startswith("SSH-2.0-OpenSSH")
    assert "locked out after" in gw.log.read_text()

    # Once the cool-off has passed since the last failure, the right key logs in again.
    until(lambda: other.ssh(alice_key, login, "echo in").stdout == b"in\n", timeout=60,
          what="a login after the cool-off")  # fmt: skip

"""A gateway killed under open sessions (kill -9: nothing of it runs to hang up): the
next gateway on its place hangs up what they left running in the workspaces, as a dropped
SSH connection does (SIGHUP), while what was started to outlive it (nohup, setsid as tmux
does) and the sessions of a live gateway replica run on. Real OpenSSH clients, the
Procfile's `gateway` processes, the real engines and Redis (jobs/access/leftovers.py)."""

# ruff: noqa: F811 (the fixtures of test_gateway.py, imported, are the test's arguments)
import os
import signal
import subprocess
import time

import django_rq
import pytest
from browsing import free_port
from test_gateway import (  # noqa: F401 (fixtures)
    VOLUMES,
    Gateway,
    _answers,
    _in_workspace,
    alice_key,
    make_key,
    workspace_cluster,
)
from waiting import until

from jobs import tasks
from jobs.access import leftovers
from jobs.clusters import services
from jobs.nodes import workspaces

pytestmark = pytest.mark.django_db

# busybox (the test image) has no nohup: POSIX's, SIGHUP ignored and the command run.
NOHUP = 'printf \'#!/bin/sh\\ntrap "" HUP\\nexec "$@"\\n\' > /workspace/nohup; chmod +x /workspace/nohup'


def _ps(cluster) -> set[str]:
    """The workspace's processes, each its command line."""
    lines = _in_workspace(cluster, "ps", "-o", "args").output.decode().splitlines()
    return {line.strip() for line in lines}


def test_a_killed_gateways_sessions_hang_up_when_it_starts_again(
    processes,
    storage_root,
    tmp_path,
    workspace_cluster,
    alice_key,
    bob,
    running_cluster,
):
    host_key = tmp_path / "gateway" / "ssh_host_ed25519_key"

    def start(port: int) -> Gateway:
        proc = processes.start(
            "gateway",
            env={"SUANLI_SSH_PORT": str(port), "SUANLI_SSH_HOST_KEY": str(host_key),
                 "SUANLI_STORAGE_ROOT": str(storage_root)},
        )  # fmt: skip
        until(lambda: _answers(port), timeout=30, what="the gateway answers")
        return Gateway(
            port, host_key, tmp_path / f"gateway-{len(processes.procs) - 1}.log", proc.pid
        )

    def session(gw: Gateway, key, login: str, command: str) -> subprocess.Popen:
        return subprocess.Popen(
            gw.ssh_command(key, login, command),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip

    gw, replica = start(free_port()), start(free_port())
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    assert gw.ssh(alice_key, login, NOHUP).returncode == 0
    # Bob, on the other gateway, in his own workspace.
    bob_key = make_key(tmp_path / "bob", "bob")
    bob_key.row = services.ssh_key_add(owner=bob, name="laptop", public_key=bob_key.public)
    bobs = running_cluster(1, owner=bob, name="bobs", volumes=VOLUMES, ssh_keys=(bob_key.row,))
    assert tasks.cluster_network_ensure(bobs.pk)
    bob_login = workspaces.login_name(bobs.pk, 0)

    dropped = [
        session(gw, alice_key, login, "sleep 1000"),
        session(gw, alice_key, login,
                "/workspace/nohup sleep 1001 >/dev/null 2>&1 & "
                "setsid sleep 1005 >/dev/null 2>&1 </dev/null & sleep 1002"),
    ]  # fmt: skip
    live = [
        session(replica, alice_key, login, "sleep 1003"),
        session(replica, bob_key, bob_login, "sleep 1004"),
    ]
    until(lambda: all(f"sleep {n}" in _ps(cluster) for n in (1000, 1001, 1002, 1003, 1005)),
          what="alice's commands run")  # fmt: skip
    until(lambda: "sleep 1004" in _ps(bobs), what="bob's command runs")

    os.kill(gw.pid, signal.SIGKILL)  # nothing of it runs to hang up its sessions
    for proc in dropped:
        proc.communicate(timeout=30)  # the clients see the connection drop
    assert "sleep 1000" in _ps(cluster), "left running until a gateway starts there again"

    again = start(gw.port)
    until(lambda: not {"sleep 1000", "sleep 1002"} & _ps(cluster),
          timeout=30, what="the dropped sessions' commands hung up")  # fmt: skip
    ps = _ps(cluster)
    assert "sleep 1001" in ps, "nohup's lives on"
    assert "sleep 1005" in ps, "a session of its own (setsid, tmux) lives on"
    assert "sleep 1003" in ps, "the live replica's session is untouched"
    assert "sleep 1004" in _ps(bobs)
    assert all(proc.poll() is None for proc in live), "the replica's sessions are still open"
    # The workspace itself runs on (its own main process untouched): logins work again.
    assert again.ssh(alice_key, login, "echo in").stdout == b"in\n"
    assert "hung up what gateway" in again.log.read_text()
    for proc in live:
        proc.kill()
        proc.communicate(timeout=10)


def test_another_replicas_records_go_only_once_its_beat_stood_still():
    redis = django_rq.get_connection("default")
    me, other, old = "a" * 12, "b" * 12, "c" * 12
    redis.delete(leftovers.INSTANCES)
    leftovers.beat(me, "here:0.0.0.0:2222", [])
    leftovers.beat(other, "elsewhere:0.0.0.0:2222", [])
    leftovers.beat(old, "here:0.0.0.0:2222", [])  # this slot's predecessor: dead at once
    watched: dict = {}
    leftovers.sweep(me, "here:0.0.0.0:2222", watched)
    assert set(redis.hkeys(leftovers.INSTANCES)) == {me.encode(), other.encode()}

    # Its beat stands still, but not yet DEAD_S in this one's sight: kept.
    leftovers.sweep(me, "here:0.0.0.0:2222", watched)
    assert other.encode() in redis.hkeys(leftovers.INSTANCES)
    # As if this one had watched it stand still DEAD_S (and looked every heartbeat).
    watched[other] = (watched[other][0], time.monotonic() - leftovers.DEAD_S - 1)
    leftovers.sweep(me, "here:0.0.0.0:2222", watched)
    assert set(redis.hkeys(leftovers.INSTANCES)) == {me.encode()}

    # After a gap in its own looking (Redis away), a still beat counts from then only.
    leftovers.beat(other, "elsewhere:0.0.0.0:2222", [])
    leftovers.sweep(me, "here:0.0.0.0:2222", watched)
    watched[other] = (watched[other][0], time.monotonic() - leftovers.DEAD_S - 1)
    watched[""] = (None, time.monotonic() - 3 * leftovers.HEARTBEAT_S)
    leftovers.sweep(me, "here:0.0.0.0:2222", watched)
    assert other.encode() in redis.hkeys(leftovers.INSTANCES)
    redis.delete(leftovers.INSTANCES)

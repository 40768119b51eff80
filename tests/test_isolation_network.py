"""An attacker's notebook: what a researcher's container can reach on the network.

Every probe runs inside a real container of a real job on the test engines, each engine a
host of its own (a network namespace with its own address, the two forming a swarm). A
service of the host listens on every address of the host it runs on (its own eth0, the
cluster bridge's gateway), the "control plane" listens on the hosts' network, and a
researcher listens in her container. Each listener answers with a secret; a probe that
prints the secret has reached it. Before the probes, the test shows from outside that each
listener is there, so a probe that reads nothing proves the firewall, not a typo.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import docker
import pytest

from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import Job
from jobs.nodes import network
from jobs.runs import dispatch, stopping

pytestmark = pytest.mark.django_db

HOST_PORT = 18001  # a host service on each engine host, bound to 0.0.0.0
CONTROL_PORT = 18002  # the "control plane" on the hosts' network
SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(64)
while True:
    c, _ = s.accept()
    try: c.sendall(sys.argv[3].encode() + b"\n")
    finally: c.close()
"""


def _env_list(name):
    value = [v for v in os.environ.get(name, "").split(",") if v]
    if not value:
        pytest.fail(f"{name} is not set: run the suite with `make test` (.ci/services.sh)")
    return value


def _reachable(addr: str, port: int, netns: str | None = None) -> str:
    if netns is None:
        with socket.create_connection((addr, port), timeout=3) as s:
            return s.recv(100).decode()
    out = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c",
         "import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])), 3); "
         "print(s.recv(100).decode().strip())", addr, str(port)],
        capture_output=True, text=True, timeout=10, check=True,
    )  # fmt: skip
    return out.stdout


@pytest.fixture
def host_services():
    """Listeners: one per engine host (all its addresses), one on the hosts' network."""
    netns = _env_list("SUANLI_TEST_ENGINE_NETNS")
    addrs = _env_list("SUANLI_TEST_ENGINE_ADDRS")
    gateway = _env_list("SUANLI_TEST_HOSTS_GATEWAY")[0]
    procs = [
        subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-c",
                SERVER,
                "0.0.0.0",  # noqa: S104 (a host service listening everywhere: the point)
                str(HOST_PORT),
                f"HOST-SECRET-{i}",
            ],
        )  # fmt: skip
        for i, ns in enumerate(netns)
    ]
    procs.append(
        subprocess.Popen(
            [sys.executable, "-c", SERVER, gateway, str(CONTROL_PORT), "CONTROL-SECRET"]
        )
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                # Each is there: the engine hosts reach each other's service and the control
                # plane, and this machine reaches the control plane.
                assert "HOST-SECRET-1" in _reachable(addrs[1], HOST_PORT, netns[0])
                assert "HOST-SECRET-0" in _reachable(addrs[0], HOST_PORT, netns[1])
                assert "CONTROL-SECRET" in _reachable(gateway, CONTROL_PORT)
                break
            except (OSError, subprocess.CalledProcessError, AssertionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield {"addrs": addrs, "gateway": gateway, "netns": netns}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _probe_command(targets: list[tuple[str, int]]) -> str:
    lines = [f"echo PROBE {a}:{p}; nc -w 1 {a} {p} </dev/null 2>&1; true" for a, p in targets]
    return "; ".join(lines)


def _targets(services_, cluster) -> list[tuple[str, int]]:
    """The host's and the control plane's ports as a container can name them."""
    targets = [
        ("127.0.0.1", 6399),  # Redis, PostgreSQL and the console on the host's loopback
        ("127.0.0.1", 5432),
        (services_["gateway"], 6399),
        (services_["gateway"], 5432),
        (services_["gateway"], 8000),
        (services_["gateway"], CONTROL_PORT),
    ]
    for addr in services_["addrs"]:
        targets.append((addr, HOST_PORT))  # every engine host's own address
    for node in cluster.node_set.select_related("host"):
        client = docker.DockerClient(base_url=node.host.engine_url, timeout=10)
        try:
            for net in client.networks.list(filters={"label": f"{network.LABEL}={cluster.pk}"}):
                for config in net.attrs.get("IPAM", {}).get("Config") or []:
                    if config.get("Gateway"):  # the bridge's address on the host
                        targets.append((config["Gateway"], HOST_PORT))
            gw = (
                client.networks.get("docker_gwbridge")
                if len({n.host_id for n in cluster.node_set.all()}) > 1
                else None
            )
            if gw is not None:
                for config in gw.attrs.get("IPAM", {}).get("Config") or []:
                    targets.append((config["Gateway"], HOST_PORT))
        finally:
            client.close()
    return targets


def _run(cluster, command, settle_until, *, timeout=90):
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="probe", command=command))
    dispatch.dispatch(cluster.pk)
    job = settle_until(job, timeout=timeout)
    return job, {r.rank: r.log for r in job.replicas.all()}


def _assert_nothing_reached(log: str) -> None:
    assert "PROBE" in log, log
    for secret in ("HOST-SECRET", "CONTROL-SECRET", "PONG", "NOAUTH", "redis", "PostgreSQL"):
        assert secret not in log, f"a container reached a host service:\n{log}"


def test_redis_wants_its_password():
    """Where Redis is reachable at all (this machine), it answers nothing without it."""
    import redis
    from django.conf import settings

    url = settings.REDIS_URL
    assert "@" in url, "make test gives Redis a password"
    anonymous = redis.Redis.from_url("redis://" + url.split("@", 1)[1])
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()


def test_one_node_cluster_reaches_no_host_service(running_cluster, settle_until, host_services):
    cluster = running_cluster(1)
    targets = _targets(host_services, cluster)
    job, logs = _run(cluster, _probe_command(targets), settle_until)
    assert job.state == Job.State.SUCCEEDED, job.state_reason
    _assert_nothing_reached(logs[0])
    assert logs[0].count("PROBE") == len(targets)


def test_two_node_cluster_reaches_its_peer_and_no_host_service(
    running_cluster, settle_until, host_services
):
    cluster = running_cluster(2, gpus=2)
    assert len({n.host_id for n in cluster.node_set.all()}) == 2, "one node per engine host"
    targets = _targets(host_services, cluster)
    command = (
        'if [ "$RANK" = 0 ]; then echo PEER-OK | nc -l -p $MASTER_PORT -w 20; '
        "else for i in $(seq 1 50); do nc -w 2 $MASTER_ADDR $MASTER_PORT </dev/null && break; "
        "sleep 0.2; done; " + _probe_command(targets) + "; fi"
    )
    job, logs = _run(cluster, command, settle_until)
    assert job.state == Job.State.SUCCEEDED, job.state_reason
    assert "PEER-OK" in logs[1], "rank 1 reached rank 0 over the cluster's overlay"
    _assert_nothing_reached(logs[1])


def _listen(cluster, secret):
    """A job that listens on port 7000 of its container; returns it and its address."""
    job = services.job_submit(
        cluster=cluster,
        spec=JobSpec(name="listen", command=f"while true; do echo {secret} | nc -l -p 7000; done"),
    )
    dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    replica = job.replicas.select_related("host").get()
    client = docker.DockerClient(base_url=replica.host.engine_url, timeout=10)
    try:
        nets = client.containers.get(replica.container_name).attrs["NetworkSettings"]["Networks"]
    finally:
        client.close()
    return job, [n["IPAddress"] for n in nets.values() if n.get("IPAddress")]


def test_no_cluster_reaches_another_clusters_container(running_cluster, settle_until, alice, bob):
    """bob, and alice's own second cluster, try alice's listening port by its address;
    her cluster's own member gets through."""
    mine = running_cluster(1, name="mine")
    listener, addrs = _listen(mine, "ALICE-SECRET")
    assert addrs, "the listener has an address on its cluster network"
    # Her own peer (rank 1 of a second job would need the first to end): a container on
    # the same cluster network shows the port is open.
    replica0 = listener.replicas.select_related("host").get()
    client = docker.DockerClient(base_url=replica0.host.engine_url, timeout=10)
    try:
        peer = client.containers.run(
            "suanli/busybox:latest", ["sh", "-c", f"nc -w 2 {addrs[0]} 7000 </dev/null"],
            network=network.name_for(mine.pk, network.driver_for(
                mine.node_set.values_list("host_id", flat=True))),
            remove=True, user="65534:65534",
        )  # fmt: skip
    finally:
        client.close()
    assert b"ALICE-SECRET" in peer, "a member of her cluster reaches the port"

    probe = "; ".join(f"echo PROBE {a}; nc -w 2 {a} 7000 </dev/null 2>&1; true" for a in addrs)
    theirs = running_cluster(1, owner=bob, name="bobs")  # best fit: beside alice's
    other = running_cluster(1, name="other")
    same_host = {n.host_id for n in theirs.node_set.all()} & {
        n.host_id for n in mine.node_set.all()
    }
    assert same_host, "bob's container runs on a host of alice's cluster"
    for cluster in (other, theirs):
        job, logs = _run(cluster, probe, settle_until)
        assert job.state == Job.State.SUCCEEDED, job.state_reason
        assert "PROBE" in logs[0] and "ALICE-SECRET" not in logs[0], logs[0]
    services.job_cancel(job=listener, by="alice")
    stopping.stop(listener.pk)
    settle_until(listener)


def test_a_workspace_reaches_no_host_service_and_no_other_researchers_workspace(
    running_cluster, host_services, alice, bob
):
    """bob's shell in his workspace (what the gateway and the terminal give him) probes the
    hosts' services and alice's workspace, which listens; her own second node gets in."""
    from jobs import tasks
    from jobs.nodes import workspaces

    mine = running_cluster(2, gpus=1, name="alices")
    tasks.cluster_network_ensure(mine.pk)
    hers = workspaces.running(mine, 0)
    user = hers.attrs["Config"]["User"]
    hers.exec_run(
        ["sh", "-c", "while true; do echo ALICE-SECRET | nc -l -p 7000; done"],
        user=user, detach=True,
    )  # fmt: skip
    addrs = [n["IPAddress"] for n in hers.attrs["NetworkSettings"]["Networks"].values()]
    peer = workspaces.running(mine, 1)
    reached = ""
    for _ in range(50):  # her other node, over the overlay: the port is open
        reached = peer.exec_run(["nc", "-w", "2", addrs[0], "7000"], user=user).output.decode()
        if "ALICE-SECRET" in reached:
            break
        time.sleep(0.2)
    assert "ALICE-SECRET" in reached

    theirs = running_cluster(1, owner=bob, name="bobs")
    tasks.cluster_network_ensure(theirs.pk)
    his = workspaces.running(theirs, 0)
    targets = _targets(host_services, theirs) + [(a, 7000) for a in addrs if a]
    out = his.exec_run(
        ["sh", "-c", _probe_command(targets)], user=his.attrs["Config"]["User"]
    ).output.decode()
    assert out.count("PROBE") == len(targets)
    _assert_nothing_reached(out)
    assert "ALICE-SECRET" not in out, "another researcher's workspace is out of reach"

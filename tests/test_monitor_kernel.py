"""The monitor's kernel path: a local engine's containers read from their cgroups and
network namespaces, with the engine-stats path's meaning."""

import asyncio
import time

import docker
import pytest

from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.nodes import network
from jobs.runs import dispatch
from monitoring import collector
from monitoring.engine_stats import EngineStats
from monitoring.models import Sample
from monitoring.monitor import Monitor

pytestmark = pytest.mark.django_db(transaction=True)

MIB = 1024 * 1024


def _submit(cluster, command, name="j"):
    job = services.job_submit(cluster=cluster, spec=JobSpec(name=name, command=command))
    dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    assert job.state == "running", job.state_reason
    return job


async def _engine_then_kernel(url: str, container_id: str, pid: int):
    """One engine reading, then at once the kernel's: (engine counters, kernel counters)."""
    engine = EngineStats(url)
    try:
        stats = await engine.stats(container_id)
    finally:
        engine.close()
    return (
        collector.counters(stats, container_id=container_id, local=True),
        collector.kernel_counters(container_id, pid),
    )


def test_kernel_counters_agree_with_the_engines_and_count_what_is_sent(running_cluster):
    # No workspace: the replica has the node's core to itself.
    cluster = running_cluster(1, workspace=False, name="kernel")
    node = cluster.node_set.select_related("host").get()
    url = node.host.engine_url
    client = docker.DockerClient(base_url=url, timeout=10)
    peer = client.containers.run(
        # stdin that never ends: busybox nc closes the connection at its stdin's EOF
        "suanli/busybox:latest", ["sh", "-c", "sleep 3600 | nc -l -p 9000 >/dev/null"],
        network=network.ensure(cluster.pk), name=f"ksink-{cluster.pk}", detach=True,
        user="65534:65534",
    )  # fmt: skip
    try:
        job = _submit(
            cluster,
            "(while :; do :; done) & (while :; do dd if=/dev/zero bs=64k count=32 2>/dev/null; "
            f"sleep 0.2; done) | nc ksink-{cluster.pk} 9000",
            "busy-sender",
        )
        container_id = job.replicas.get().container_id
        pid = client.api.inspect_container(container_id)["State"]["Pid"]
        assert pid > 0
        time.sleep(1)
        e0, k0 = asyncio.run(_engine_then_kernel(url, container_id, pid))
        time.sleep(3)
        e1, k1 = asyncio.run(_engine_then_kernel(url, container_id, pid))
        peer.reload()
        peer_pid = peer.attrs["State"]["Pid"]
        assert collector.kernel_counters(peer.id, peer_pid) is not None
    finally:
        peer.remove(force=True)
        client.close()
    assert None not in (e0, k0, e1, k1)
    # Each kernel reading comes just after the engine's: the same counters, a little later.
    assert e0.cpu_ns <= k0.cpu_ns <= e1.cpu_ns <= k1.cpu_ns
    assert e0.tx <= k0.tx <= e1.tx <= k1.tx
    assert e0.rx <= k0.rx <= e1.rx <= k1.rx
    engine_cpu = (e1.cpu_ns - e0.cpu_ns) / (e1.read_at - e0.read_at) / 1e7  # percent
    kernel_cpu = (k1.cpu_ns - k0.cpu_ns) / (k1.read_at - k0.read_at) / 1e7
    assert engine_cpu > 50, engine_cpu
    assert abs(kernel_cpu - engine_cpu) <= 0.1 * engine_cpu + 5, (kernel_cpu, engine_cpu)
    assert abs(k1.mem_bytes - e1.mem_bytes) <= max(0.2 * e1.mem_bytes, 2 * MIB), (k1, e1)
    # What it sends to its peer grows its transmit counter: megabytes a second.
    assert (k1.tx - k0.tx) / (k1.read_at - k0.read_at) > 1_000_000, (k0, k1)
    assert k1.rx > k0.rx  # the peer's acknowledgements
    # Its process and cgroup gone: no reading.
    assert collector.kernel_counters(peer.id, peer_pid) is None


def test_a_two_node_jobs_samples_show_the_bytes_its_replicas_send_each_other(running_cluster):
    cluster = running_cluster(2, gpus=2)  # one node on each engine, over the swarm overlay
    assert len({n.host_id for n in cluster.node_set.all()}) == 2
    stream = "while dd if=/dev/zero bs=64k count=16 2>/dev/null; do sleep 0.2; done"
    job = _submit(
        cluster,
        f'if [ "$RANK" = 0 ]; then ({stream}) | nc -l -p $MASTER_PORT >/dev/null; '
        f"else for i in $(seq 1 100); do ({stream}) | nc $MASTER_ADDR $MASTER_PORT >/dev/null "
        "&& break; sleep 0.2; done; fi",
        "exchange",
    )
    monitor = Monitor(publish=False, kernel=True)
    try:
        asyncio.run(monitor.run(ticks=8))
    finally:
        monitor.close()
    replicas = {r.container_id for r in job.replicas.all()}
    assert replicas <= set(monitor.pids), "both replicas were read from the kernel"
    for node in (0, 1):
        samples = Sample.objects.filter(job=job, node_index=node)
        assert samples.count() >= 4, node
        # Each sends ~5 MB/s to the other: both directions show on both nodes.
        assert max(s.net_tx_bps for s in samples) > 500_000, (node, list(samples.values()))
        assert max(s.net_rx_bps for s in samples) > 500_000, (node, list(samples.values()))

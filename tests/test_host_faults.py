"""A host's failure is the operator's problem, never the researcher's: the real engines
of the test command are killed, restarted and robbed of their bridges under running work.
"""

import os
import re
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from unittest import mock

import docker
import pytest
from django.utils import timezone
from node_start import ran
from waiting import until as _until

from billing import accrual
from billing import services as billing
from billing.models import LedgerEntry
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.hosts import proofs
from jobs.hosts import services as host_services
from jobs.models import ClusterEvent, Host, Job, JobEvent, Node, Replica
from jobs.nodes import engine, network, runtime
from jobs.placement import capacity, scheduler
from jobs.runs import dispatch, repair, stopping

pytestmark = pytest.mark.django_db

REPO = Path(__file__).resolve().parent.parent


def _engines() -> list[str]:
    return [u for u in os.environ.get("SUANLI_TEST_ENGINES", "").split(",") if u]


def _netns(host: Host) -> str:
    names = [n for n in os.environ.get("SUANLI_TEST_ENGINE_NETNS", "").split(",") if n]
    return names[_engines().index(host.engine_url)]


def _client(host: Host) -> docker.DockerClient:
    return docker.DockerClient(base_url=host.engine_url, timeout=20)


def _kill_dockerd(host: Host) -> None:
    """kill -9 of the engine's dockerd, as a crash would (its pid file is beside its socket)."""
    sock = Path(host.engine_url.removeprefix("unix://"))
    pid = int((sock.parent / sock.name.removesuffix(".sock") / "docker.pid").read_text())
    os.kill(pid, 9)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            _client(host).ping()
        except Exception:
            return
        time.sleep(0.1)
    raise AssertionError("dockerd still answers after kill -9")


def _bring_back(host: Host) -> None:
    engine = Path(host.engine_url).name.removeprefix("docker-").removesuffix(".sock")
    subprocess.run(
        ["bash", str(REPO / ".ci" / "services.sh"), "restart-engine", engine],
        check=True,
        capture_output=True,
        timeout=120,
    )


@pytest.fixture
def engines_back():
    """Whatever a test killed is running again afterwards, for the tests that follow."""
    killed: list[Host] = []
    yield killed
    for host in killed:
        _bring_back(host)


@pytest.fixture
def funded(alice):
    from decimal import Decimal

    billing.post_entry(
        account=billing.account_for(alice), kind="topup", amount=Decimal("1000"),
        key="test-topup", memo="test",
    )  # fmt: skip


def _reconciled_until(job, states, timeout=40):
    def settled():
        repair.reconcile()
        job.refresh_from_db()
        return job.state in states

    _until(settled, timeout, what=f"job in {states} (is {job.state}: {job.state_reason})")
    return job


def _labelled(host: Host, job: Job) -> list:
    return _client(host).containers.list(all=True, filters={"label": f"suanli.job={job.pk}"})


def test_a_dead_engine_costs_the_researcher_nothing_and_the_node_moves(
    running_cluster, make_host, rate_card, settings, funded, engines_back
):
    settings.SUANLI_HOST_DOWN_MOVE_S = 0  # the operator's patience, shortened for the test
    rate_card({"a100-80gb": "3.60"})
    cluster = running_cluster(2, gpus=2)  # one node on each engine (2 GPUs each)
    nodes = {n.host.name: n for n in cluster.node_set.select_related("host")}
    assert len(nodes) == 2
    # Engine b dies (a, the swarm's manager, carries on).
    lost, kept = nodes["gpu-b-01"], nodes["gpu-a-01"]
    survivor, victim, rank = kept.host, lost.host, lost.index
    job = services.job_submit(
        cluster=cluster, spec=JobSpec(name="long", command="exec sleep 300", retries=1)
    )
    dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING, job.state_reason
    accrual.accrue()

    _kill_dockerd(victim)
    engines_back.append(victim)
    victim = host_services.host_check(host_id=victim.pk)
    assert victim.state == Host.State.DOWN
    down_at = Node.objects.get(pk=lost.pk).lost_at
    assert down_at is not None and not Node.objects.get(pk=kept.pk).lost_at
    assert ClusterEvent.objects.filter(cluster=cluster, kind="host-down").exists()

    # Its replica is lost to the host: the other stops, and the job waits (no retry used).
    job = _reconciled_until(job, [Job.State.QUEUED])
    assert job.host_restarts == 1 and job.attempt == 1
    assert "lost to " + victim.name in job.state_reason, job.state_reason
    assert "exited with code" not in job.state_reason
    assert job.replicas.get(rank=rank).host_fault

    # No room elsewhere (the survivor is full): the cluster waits and says why.
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert f"node {rank} on {victim.name} (down): to be moved" in cluster.state_reason
    assert dispatch.dispatch(cluster.pk) is None

    # A billing second passes with the node waiting (the ledger counts whole seconds), then
    # room appears (a new host on engine a): the node moves there, the job runs again.
    a_second_on = down_at.replace(microsecond=0) + timedelta(seconds=1)
    _until(lambda: timezone.now() >= a_second_on, what="a billing second with the node waiting")
    spare = make_host("gpu-a-02", engine=0, zone="zone-a", gpus=2, check="reuse")
    report = scheduler.place_pending()
    assert report.moved == 1
    moved = ClusterEvent.objects.filter(cluster=cluster, kind="moved").get()
    assert f"node {rank} moved from {victim.name} (down since" in moved.message
    assert f"to {spare.name} GPU 0,1" in moved.message
    live = {n.index: n for n in cluster.node_set.filter(released_at__isnull=True)}
    assert live[rank].host_id == spare.pk and live[kept.index].pk == kept.pk
    moved_at = live[rank].placed_at
    dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING and job.attempt == 2, job.state_reason
    assert {r.host_id for r in job.replicas.filter(attempt=2)} == {survivor.pk, spare.pk}

    # Money: between "seen down" and "placed again" only node 0's 2 GPUs are charged.
    accrual.accrue()
    usage = LedgerEntry.objects.filter(cluster=cluster, kind="usage").order_by("period_from")
    gap = [
        e
        for e in usage
        if e.period_from < moved_at.replace(microsecond=0)
        and e.period_to > down_at.replace(microsecond=0)
    ]
    assert gap and all(e.units == 2 for e in gap), [(e.period_from, e.units) for e in gap]
    assert all(e.units == 4 for e in usage if e.period_to <= down_at.replace(microsecond=0))

    # The engine comes back: the container its restart killed is removed, nothing doubled.
    _bring_back(victim)
    assert host_services.host_check(host_id=victim.pk).state == Host.State.ACTIVE
    repair.reconcile()
    assert _labelled(victim, job) == []
    running = [c.name for c in _labelled(survivor, job)]
    assert sorted(running) == sorted(r.container_name for r in job.replicas.filter(attempt=2))
    services.job_cancel(job=job, by="alice")
    stopping.stop(job.pk)  # what the queued stop task does (no worker here)
    _reconciled_until(job, [Job.State.CANCELLED])


def test_a_host_back_while_its_node_waited_to_move_leaves_no_stale_reason(
    running_cluster, settings, engines_back, client, alice
):
    settings.SUANLI_HOST_DOWN_MOVE_S = 0  # the operator's patience, shortened for the test
    cluster = running_cluster(2, gpus=2)  # one node on each engine, both full
    lost = cluster.node_set.select_related("host").get(host__name="gpu-b-01")
    victim, rank = lost.host, lost.index
    job = services.job_submit(
        cluster=cluster, spec=JobSpec(name="long", command="exec sleep 300", retries=1)
    )
    dispatch.dispatch(cluster.pk)
    _kill_dockerd(victim)
    engines_back.append(victim)
    assert host_services.host_check(host_id=victim.pk).state == Host.State.DOWN
    job = _reconciled_until(job, [Job.State.QUEUED])
    scheduler.place_pending()  # no room elsewhere: the node waits, and the cluster says so
    cluster.refresh_from_db()
    assert f"node {rank} on {victim.name} (down): to be moved" in cluster.state_reason

    # The host comes back before any room appeared: the node is placed there again.
    _bring_back(victim)
    engines_back.remove(victim)
    assert host_services.host_check(host_id=victim.pk).state == Host.State.ACTIVE

    def running_again():  # a restarted swarm worker may take a while to attach again
        repair.reconcile()
        dispatch.dispatch(cluster.pk)
        job.refresh_from_db()
        return job.state == Job.State.RUNNING

    _until(running_again, 60, what=f"the job running again ({job.state}: {job.state_reason})")
    on = job.replicas.filter(attempt=job.attempt).select_related("host")
    assert {r.host.name for r in on} == {"gpu-a-01", "gpu-b-01"}
    # It runs on both nodes, and says nothing of a move any more.
    cluster.refresh_from_db()
    assert cluster.state_reason == "" and cluster.state_reason_text is None
    client.force_login(alice)
    page = client.get(f"/clusters/{cluster.pk}/").content.decode()
    assert "host gpu-b-01 is back" in page  # its timeline keeps the wait and the return
    status = client.get(f"/clusters/{cluster.pk}/status/").content.decode()
    line = re.search(r'<div class="statusline">(.*?)</div>', status, re.S).group(1)
    assert "running" in line and "to be moved" not in line, line
    services.job_cancel(job=job, by="alice")
    stopping.stop(job.pk)  # what the queued stop task does (no worker here)
    _reconciled_until(job, [Job.State.CANCELLED])


def test_an_engine_restart_is_not_the_jobs_failure(running_cluster, processes, engines_back):
    processes.start("watch")
    # Two whole-host clusters: the one on engine b is the one whose engine restarts.
    clusters = [running_cluster(1, gpus=2, name=f"whole-{i}") for i in (1, 2)]
    cluster = next(c for c in clusters if c.node_set.get().host.name == "gpu-b-01")
    host = cluster.node_set.get().host
    job = services.job_submit(
        cluster=cluster, spec=JobSpec(name="restarted", command="exec sleep 300", retries=0)
    )
    dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING, job.state_reason
    _until(
        lambda: any(
            f"watch {host.name}: following" in log.read_text()
            for log in processes.tmp_path.glob("watch-*.log")
        ),
        timeout=15,
        what="the watch following the engine",
    )

    # dockerd goes and comes back before any host check: its restart kills the container.
    _kill_dockerd(host)
    engines_back.append(host)
    _bring_back(host)
    job = _until(
        lambda: Job.objects.filter(pk=job.pk, state=Job.State.QUEUED).first(),
        timeout=30,
        what="the job back in its queue",
    )
    replica = job.replicas.get(attempt=1)
    assert replica.host_fault and replica.exit_code not in (None, 0)
    assert job.host_restarts == 1 and "no retry used" in job.state_reason
    lost = JobEvent.objects.get(job=job, kind="host-lost").message
    assert f"stopped by its host {host.name}" in lost and "not the job's failure" in lost
    # With no retries at all it runs again: the attempt was the host's, not the job's.
    dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING and job.attempt == 2, job.state_reason
    services.job_cancel(job=job, by="alice")
    stopping.stop(job.pk)  # what the queued stop task does (no worker here)
    _reconciled_until(job, [Job.State.CANCELLED])


def _gateway(client: docker.DockerClient) -> str:
    config = client.networks.get("bridge").attrs["IPAM"]["Config"][0]
    return config.get("Gateway") or config["Subnet"].rsplit(".", 1)[0] + ".1"


def test_an_engine_that_lost_its_bridges_is_degraded_and_the_job_moves(
    running_cluster, client, alice
):
    cluster = running_cluster(1)
    bad = cluster.node_set.get().host
    ns = _netns(bad)
    engine_client = _client(bad)
    gateway = _gateway(engine_client)
    net = network.ensure(cluster.pk)
    try:
        for link in ("docker0", network.bridge_interface(cluster.pk), proofs.CANARY_BRIDGE):
            subprocess.run(["ip", "-n", ns, "link", "del", link], check=True)
        job = services.job_submit(
            cluster=cluster, spec=JobSpec(name="moves", command="echo ran", retries=0)
        )
        dispatch.dispatch(cluster.pk)  # the start fails for a reason of the engine
        bad.refresh_from_db()
        assert bad.state == Host.State.DEGRADED
        assert "could not find bridge" in bad.last_error
        job.refresh_from_db()
        assert job.state == Job.State.QUEUED and job.host_restarts == 1, job.state_reason
        assert job.state_reason.startswith(f"the host {bad.name} could not start containers")

        # The check's canary (on a bridge like a cluster's) says the same, in its words.
        bad = host_services.host_check(host_id=bad.pk)
        assert bad.state == Host.State.DEGRADED
        assert f"could not find bridge {proofs.CANARY_BRIDGE}" in bad.last_error
        assert bad.pk not in capacity.Fleet.load().hosts, "placement avoids it"

        # Placement moves the node at once; the job runs on the other host.
        assert scheduler.place_pending().moved == 1
        node = cluster.node_set.get(released_at__isnull=True)
        assert node.host_id != bad.pk
        dispatch.dispatch(cluster.pk)
        job = _reconciled_until(job, Job.ENDED)
        assert job.state == Job.State.SUCCEEDED and job.attempt == 2, job.state_reason
        assert job.replicas.get(attempt=2).host_id == node.host_id

        # The researcher reads a plain sentence, not Docker's.
        client.force_login(alice)
        page = client.get(f"/jobs/{job.pk}/").content.decode()
        assert "could not start containers; your job is being moved" in page
        assert "could not find bridge" not in page and "veth" not in page
    finally:
        # Repair the engine as an operator would, and check it back to active.
        subprocess.run(["ip", "-n", ns, "link", "add", "docker0", "type", "bridge"], check=False)
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{gateway}/24", "dev", "docker0"])
        subprocess.run(["ip", "-n", ns, "link", "set", "docker0", "up"], check=True)
        for name, bridge in (
            (net, network.bridge_interface(cluster.pk)),
            (proofs.CANARY_NETWORK, proofs.CANARY_BRIDGE),  # the next check makes it again
        ):
            try:
                engine_client.networks.get(name).remove()
            except docker.errors.DockerException:
                subprocess.run(["ip", "-n", ns, "link", "add", bridge, "type", "bridge"])
                engine_client.networks.get(name).remove()
    network.forget(cluster.pk)
    assert host_services.host_check(host_id=bad.pk).state == Host.State.ACTIVE


def test_the_reconciler_adopts_a_started_container_of_a_dead_worker(running_cluster):
    cluster = running_cluster(1)
    job = services.job_submit(
        cluster=cluster, spec=JobSpec(name="orphan", command="sleep 2; echo adopted; exit 3")
    )
    # The worker started the container and died before it could record it.
    with mock.patch.object(dispatch, "start_replicas"):
        dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    replica = job.replicas.select_related("node", "host").get()
    spec = runtime.container_spec(
        job=job, node=replica.node, nodes=1, attempt=job.attempt, nvidia=False,
        network_name=network.ensure(cluster.pk),
    )  # fmt: skip
    container = dispatch._launch(job, [replica], replica, spec)
    assert not isinstance(container, Exception), container

    report = repair.reconcile()  # at once: not after the 60 s a start may take
    assert report["adopted"] == 1
    replica.refresh_from_db()
    job.refresh_from_db()
    assert replica.state == Replica.State.RUNNING and replica.container_id == container.id
    assert job.state == Job.State.RUNNING

    # It ends while nobody watches; finalised later, it keeps the container's own end.
    _until(
        lambda: container.reload() or container.status == "exited",
        30,
        "the adopted container to end",
        every=0.2,
    )
    ended = engine.container_time(container.attrs["State"]["FinishedAt"])
    time.sleep(1.5)
    job = _reconciled_until(job, Job.ENDED)
    replica.refresh_from_db()
    assert job.state == Job.State.FAILED and replica.exit_code == 3
    assert "adopted" in replica.log
    assert abs(replica.finished_at - ended) < timedelta(milliseconds=5)
    assert job.finished_at == replica.finished_at


def test_a_host_back_before_its_nodes_moved_charges_them_again_from_then(
    running_cluster, rate_card, funded
):
    rate_card({"a100-80gb": "3.60"})
    cluster = running_cluster(1)
    ran(cluster)  # its workspace started as it was placed (billing starts there)
    node = cluster.node_set.select_related("host").get()
    accrual.accrue()
    host_services.host_unhealthy(
        host=node.host, state=Host.State.DOWN, message="connection refused"
    )
    lost_at = Node.objects.get(pk=node.pk).lost_at
    time.sleep(2.2)
    accrual.accrue()  # nothing for the down seconds
    host = host_services.host_check(host_id=node.host_id)  # the engine answers: it is back
    assert host.state == Host.State.ACTIVE and host.outage_to is not None
    again = cluster.node_set.get(released_at__isnull=True)
    assert again.pk != node.pk and again.host_id == node.host_id
    assert again.gpu_indices == node.gpu_indices and again.slots.count() == 1
    assert ClusterEvent.objects.filter(cluster=cluster, kind="host-back").exists()
    ran(cluster)  # its workspace seen running again (workspaces.ensure, the reconciler's)
    accrual.accrue()
    usage = list(LedgerEntry.objects.filter(cluster=cluster, kind="usage"))
    gap_from, gap_to = lost_at.replace(microsecond=0), again.placed_at.replace(microsecond=0)
    assert gap_to - gap_from >= timedelta(seconds=2)
    assert not [e for e in usage if e.period_from < gap_to and e.period_to > gap_from]


@pytest.mark.parametrize(
    "text, engines",
    [
        # The engine's own trouble: the host is degraded and the work moves.
        (
            "failed to create endpoint x on network suanli-c4: adding interface veth1 to bridge "
            "slc4 failed: could not find bridge slc4: route ip+net: no such network interface",
            True,
        ),
        (
            "error creating overlay mount to /var/lib/docker/overlay2/x/merged: no space left on "
            "device",
            True,
        ),
        ("unknown or invalid runtime name: nvidia", True),
        # The job's own, although the runtime reports it: the job fails (and uses a retry).
        (
            "failed to create shim task: OCI runtime create failed: runc create failed: unable to "
            'start container process: exec: "python": executable file not found in $PATH',
            False,
        ),
        (
            "failed to create shim task: OCI runtime create failed: runc create failed: unable to "
            'start container process: exec: "/bin/sh": stat /bin/sh: no such file or directory',
            False,
        ),
        ("pull access denied for nosuch/image, repository does not exist", False),
    ],
)
def test_engine_faults_are_told_from_the_jobs_own(text, engines):
    from jobs.nodes import engine as eng

    refusal = docker.errors.APIError("500 Server Error", explanation=text)
    assert eng.engine_fault(refusal) is engines
    assert eng.engine_fault(ConnectionError("Connection refused")) is True

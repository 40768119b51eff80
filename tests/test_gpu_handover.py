"""A GPU is handed to the next tenant only once the last one's containers are gone, on the
real engines: a release or a stop ends the charge at its second, but the GPU slots stay
held (placement skips them) until the host's engine confirms that nothing of the ended
nodes runs on those GPUs any more (jobs/nodes/workspaces.py, `free_gpus`).

Each test is what an attacker next in line would try: bob asks for exactly the GPUs that
alice's cluster had, while alice's container (a workspace, or a job's replica) still runs
on them; he must not get them before the engine says it is gone (or stopped, for a stop).
"""

import time
from datetime import timedelta

import docker
import pytest
from django.db import connection
from django.db.models import Max
from django.urls import reverse
from django.utils import timezone

from billing import accrual
from billing import services as billing
from billing.models import LedgerEntry
from jobs import tasks
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import Cluster, GpuSlot, Node
from jobs.nodes import workspaces
from jobs.placement import scheduler
from jobs.runs import dispatch, exits, repair, stopping
from tests.waiting import until

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _names_of_our_own():
    """Container names carry the cluster's id; runs beside this one on the same engines
    (other test databases) count their ids from 1 too, so ours start far from theirs
    (and from the test before, whose containers its teardown may still be removing)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT setval(pg_get_serial_sequence('jobs_cluster', 'id'), %s)",
            [1_000_000_000 + time.time_ns() // 10**6 % 10**9],
        )


@pytest.fixture
def host(make_host):
    """One host of 2 GPUs on engine b: alice's cluster takes all of it."""
    return make_host("gpu-b-01", engine=1, zone="zone-a", gpus=2, check="reuse")


def _engine(host) -> docker.DockerClient:
    return docker.DockerClient(base_url=host.engine_url, timeout=10)


def _containers(host, cluster: Cluster, **filters) -> list:
    return _engine(host).containers.list(
        all=True, filters={"label": [f"suanli.cluster={cluster.pk}"], **filters}
    )


def _whole_host(make_cluster, owner, name, **extra) -> Cluster:
    cluster = make_cluster(
        owner, name, nodes=1, gpus=2, release_policy="never", volumes=(), **extra
    )
    scheduler.place_pending()
    cluster.refresh_from_db()
    return cluster


def _alices_running_workspace(make_cluster, alice, host) -> Cluster:
    cluster = _whole_host(make_cluster, alice, "alices")
    assert cluster.state == "running", cluster.state_reason
    assert tasks.cluster_network_ensure(cluster.pk)
    (workspace,) = _containers(host, cluster)
    assert workspace.status == "running"
    assert workspaces.gpus_of(workspace) == {0, 1}, "the workspace was given both GPUs"
    return cluster


def _bob_waits_for_them(make_cluster, bob, host) -> Cluster:
    """Bob asks for the same 2 GPUs; the engine still runs alice's container on them."""
    other = _whole_host(make_cluster, bob, "bobs")
    assert other.state == "pending", "placed on GPUs another tenant's container still holds"
    assert f"GPUs being freed on {host.name}: 2" in other.state_reason, other.state_reason
    assert GpuSlot.objects.filter(host=host, node__cluster__owner=bob).count() == 0
    return other


def test_a_released_clusters_gpus_go_to_the_next_tenant_only_once_its_containers_are_removed(
    host, make_cluster, alice, bob, operator, client
):
    cluster = _alices_running_workspace(make_cluster, alice, host)
    services.cluster_release(cluster=cluster)  # the removal task has not run yet
    cluster.refresh_from_db()
    assert cluster.state == "released"
    assert GpuSlot.objects.filter(host=host, node__cluster=cluster).count() == 2, "held"
    other = _bob_waits_for_them(make_cluster, bob, host)

    # The engine is asked, and says the workspace still runs: nothing is given back.
    assert exits.free_gpus() == 0
    assert [c.status for c in _containers(host, cluster)] == ["running"]
    client.force_login(operator)
    page = client.get(reverse("ops_hosts")).content.decode()
    assert '<div class="small muted" data-testid="gpus-freeing"' in page
    assert "2 being freed" in page, "the operator sees why the host's GPUs are not free"
    scheduler.place_pending()
    other.refresh_from_db()
    assert other.state == "pending"

    # The removal task removes the workspace; the engine confirms; the GPUs are bob's.
    until(lambda: tasks.cluster_network_remove(cluster.pk), what="alice's workspace removed")
    assert _containers(host, cluster) == []
    assert not GpuSlot.objects.filter(node__cluster=cluster).exists()
    scheduler.place_pending()
    other.refresh_from_db()
    assert other.state == "running", other.state_reason
    assert sorted(Node.objects.get(cluster=other).gpu_indices) == [0, 1]
    services.cluster_release(cluster=other)
    until(lambda: tasks.cluster_network_remove(other.pk), what="bob's workspace removed")


def test_a_stopped_clusters_gpus_go_to_the_next_tenant_only_once_its_workspaces_stopped(
    host, make_cluster, alice, bob
):
    cluster = _alices_running_workspace(make_cluster, alice, host)
    services.cluster_stop(cluster=cluster, by="alice")
    cluster.refresh_from_db()
    assert cluster.state == "stopped"
    assert GpuSlot.objects.filter(host=host, node__cluster=cluster).count() == 2, "held"
    other = _bob_waits_for_them(make_cluster, bob, host)
    assert workspaces.free_gpus() == 0, "the engine says alice's workspace still runs"

    # The stop task stops (never removes) the workspace; stopped is all a stop asks.
    assert tasks.cluster_workspaces_stop(cluster.pk)
    (kept,) = _containers(host, cluster)
    assert kept.status == "exited", "kept, with its files"
    assert not GpuSlot.objects.filter(node__cluster=cluster).exists()
    scheduler.place_pending()
    other.refresh_from_db()
    assert other.state == "running", other.state_reason
    services.cluster_release(cluster=other)
    services.cluster_release(cluster=cluster)
    until(lambda: tasks.cluster_network_remove(other.pk), what="bob's workspace removed")
    until(lambda: tasks.cluster_network_remove(cluster.pk), what="alice's workspace removed")


def test_a_cluster_started_right_after_its_stop_takes_its_own_held_gpus_back(
    host, make_cluster, alice
):
    """Its own workspace still running on them is no other tenant's: no need to wait."""
    cluster = _alices_running_workspace(make_cluster, alice, host)
    (before,) = _containers(host, cluster)
    services.cluster_stop(cluster=cluster, by="alice")
    assert services.start_blocked(Cluster.objects.get(pk=cluster.pk)) == ""
    services.cluster_start(cluster=cluster, by="alice")  # the stop task has not run yet
    cluster.refresh_from_db()
    assert cluster.state == "running"
    node = Node.objects.get(cluster=cluster, released_at__isnull=True)
    assert sorted(node.gpu_indices) == [0, 1]
    assert GpuSlot.objects.filter(node=node).count() == 2
    assert not GpuSlot.objects.filter(node__cluster=cluster, node__released_at__isnull=False)
    assert tasks.cluster_network_ensure(cluster.pk)
    (after,) = _containers(host, cluster)
    assert after.id == before.id and after.status == "running", "the same workspace"
    services.cluster_release(cluster=cluster)
    until(lambda: tasks.cluster_network_remove(cluster.pk), what="alice's workspace removed")


def test_a_released_jobs_replica_holds_its_gpus_until_it_has_ended(host, make_cluster, alice, bob):
    """A jobs-only cluster: no workspace, a replica that runs alice's code on the GPUs; the
    reconciler is the one that finds it ended (the watcher's safety net)."""
    cluster = _whole_host(make_cluster, alice, "batch", workspace=False)
    job = services.job_submit(
        cluster=cluster, spec=JobSpec(name="train", command="trap '' TERM; sleep 600")
    )
    dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    assert job.state == "running", job.state_reason
    (replica,) = _containers(host, cluster)
    assert workspaces.gpus_of(replica) == {0, 1}

    services.cluster_release(cluster=cluster)
    other = _bob_waits_for_them(make_cluster, bob, host)
    stopping.stop(job.pk)  # SIGTERM, which it ignores: it runs until the SIGKILL
    repair.reconcile()
    assert GpuSlot.objects.filter(node__cluster=cluster).count() == 2, "its replica still runs"
    scheduler.place_pending()
    other.refresh_from_db()
    assert other.state == "pending"

    stopping.kill(job.pk)
    until(
        lambda: (
            (repair.reconcile() or True)
            and not GpuSlot.objects.filter(node__cluster=cluster).exists()
        ),
        what="alice's GPUs given back once her replica ended",
    )
    assert _containers(host, cluster) == []
    scheduler.place_pending()
    other.refresh_from_db()
    assert other.state == "running", other.state_reason
    services.cluster_release(cluster=other)
    until(lambda: tasks.cluster_network_remove(other.pk), what="bob's workspace removed")


def test_billing_of_a_released_cluster_ends_at_its_release_second_while_its_gpus_are_held(
    host, make_cluster, alice, priced
):
    cluster = _alices_running_workspace(make_cluster, alice, host)
    # Placed and run a minute ago (not in the second of its release: that bills nothing).
    a_minute_ago = timezone.now() - timedelta(minutes=1)
    Node.objects.filter(cluster=cluster).update(placed_at=a_minute_ago, started_at=a_minute_ago)
    Cluster.objects.filter(pk=cluster.pk).update(running_since=a_minute_ago)
    services.cluster_release(cluster=cluster)
    cluster.refresh_from_db()
    released = billing.floor_s(cluster.released_at)
    assert GpuSlot.objects.filter(node__cluster=cluster).count() == 2, "still held"
    # Accrual a minute later, the GPUs still held (the removal task has not run).
    accrual.accrue(now=cluster.released_at + timedelta(seconds=60))
    usage = LedgerEntry.objects.filter(cluster=cluster, kind="usage", period_to__isnull=False)
    assert usage.exists()
    assert usage.aggregate(end=Max("period_to"))["end"] == released
    placed = billing.floor_s(Node.objects.get(cluster=cluster).placed_at)
    assert (
        sum((e.period_to - e.period_from).total_seconds() for e in usage)
        == (released - placed).total_seconds()
    ), "every second from placement to the release, once"
    until(lambda: tasks.cluster_network_remove(cluster.pk), what="alice's workspace removed")
    assert not GpuSlot.objects.filter(node__cluster=cluster).exists()

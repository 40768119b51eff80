"""Gang placement onto the real registered hosts, on real PostgreSQL."""

import json
import threading
from collections import Counter

import pytest
from django.db import connection, connections

from jobs import tasks
from jobs.clusters import services
from jobs.hosts import services as host_services
from jobs.models import Cluster, GpuSlot, Node
from jobs.placement import scheduler
from jobs.runs import exits

pytestmark = pytest.mark.django_db


def _place():
    return scheduler.place_pending()


def _release(cluster):
    """A release, then its removal task as the worker runs it: the GPUs come back once the
    engine confirms the cluster's containers are gone (none were made here)."""
    services.cluster_release(cluster=cluster)
    assert tasks.cluster_network_remove(cluster.pk)


def _hosts_of(cluster):
    return [
        n.host.name for n in cluster.node_set.filter(released_at__isnull=True).order_by("index")
    ]


def test_gang_placement_places_all_nodes_or_none(make_host, make_cluster, alice):
    make_host("gpu-a-01", engine=0, gpus=8, check="reuse")
    make_host("gpu-a-02", engine=1, gpus=8, check="reuse")
    big = make_cluster(alice, "three-nodes", nodes=3, gpus=8)
    two = make_cluster(alice, "two-nodes", nodes=2, gpus=8)
    report = _place()
    big.refresh_from_db()
    two.refresh_from_db()
    assert big.state == Cluster.State.PENDING and not big.node_set.exists(), "never half-placed"
    assert "room for 2 of 3 nodes now (16 GPUs free)" in big.state_reason
    # The head reserves the hosts it could use: the 2-node cluster may not take them.
    assert two.state == Cluster.State.PENDING
    assert "behind three-nodes" in two.state_reason
    assert report.placed == []


def test_nodes_get_whole_gpus_from_one_host_and_best_fit_packs(make_host, make_cluster, alice):
    make_host("gpu-a-01", engine=0, gpus=8, check="reuse")
    make_host("gpu-a-02", engine=1, gpus=4, check="reuse")
    small = make_cluster(alice, "small", nodes=1, gpus=4)
    _place()
    assert _hosts_of(small) == ["gpu-a-02"], "best fit: the 4-GPU request fills the 4-GPU host"
    whole = make_cluster(alice, "whole", nodes=1, gpus=8)
    _place()
    whole.refresh_from_db()
    assert whole.state == Cluster.State.RUNNING and _hosts_of(whole) == ["gpu-a-01"]
    node = whole.node_set.get()
    assert sorted(node.gpu_indices) == list(range(8))
    assert GpuSlot.objects.filter(node__isnull=True).count() == 0


def test_zone_rdma_and_model_constraints(make_host, make_cluster, alice):
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=8, check="reuse")
    make_host("gpu-b-01", engine=1, zone="zone-b", gpus=8, rdma=True, check="reuse")
    make_host("t4-a-01", engine=0, zone="zone-a", model="t4-16gb", gpus=4, check="reuse")
    in_b = make_cluster(alice, "in-b", zone="zone-b", gpus=2)
    rdma = make_cluster(alice, "rdma", network=Cluster.Network.RDMA, gpus=2)
    t4 = make_cluster(alice, "t4", model="t4-16gb", gpus=4)
    _place()
    assert _hosts_of(in_b) == ["gpu-b-01"]
    assert _hosts_of(rdma) == ["gpu-b-01"]
    assert _hosts_of(t4) == ["t4-a-01"]
    rdma_two_zones = make_cluster(
        alice, "rdma-spread", nodes=2, network=Cluster.Network.RDMA, gpus=8
    )
    _place()
    rdma_two_zones.refresh_from_db()
    assert (
        rdma_two_zones.state == Cluster.State.PENDING and "with RDMA" in rdma_two_zones.state_reason
    )


def test_standard_cluster_prefers_one_zone_but_spreads_when_it_must(make_host, make_cluster, alice):
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=8, check="reuse")
    make_host("gpu-b-01", engine=1, zone="zone-b", gpus=8, check="reuse")
    make_host("gpu-b-02", engine=1, zone="zone-b", gpus=8, check="reuse")
    together = make_cluster(alice, "together", nodes=2, gpus=8)
    _place()
    assert sorted(_hosts_of(together)) == ["gpu-b-01", "gpu-b-02"]
    _release(together)
    make_host("gpu-c-01", engine=0, zone="zone-c", gpus=8, check="reuse")
    spread = make_cluster(alice, "spread", nodes=4, gpus=8)
    _place()
    assert len(set(_hosts_of(spread))) == 4


def test_cpu_only_clusters_take_vcpus_not_gpus(make_host, make_cluster, alice):
    host = make_host("gpu-a-01", engine=0, gpus=8, check="reuse")
    debug = make_cluster(alice, "debug", cpu="cpu-2c-4g", nodes=1)
    _place()
    debug.refresh_from_db()
    assert debug.state == Cluster.State.RUNNING
    node = debug.node_set.get()
    assert node.host == host and node.vcpus == 2 and node.gpu_indices == []
    assert GpuSlot.objects.filter(node__isnull=False).count() == 0
    too_big = make_cluster(alice, "too-big", cpu="cpu-2c-4g", nodes=500)
    _place()
    too_big.refresh_from_db()
    assert too_big.state == Cluster.State.PENDING and "vCPUs free" in too_big.state_reason


def test_draining_and_down_hosts_take_no_new_placements(
    make_host, make_cluster, alice, engine_urls
):
    a = make_host("gpu-a-01", engine=0, gpus=8, check="reuse")
    running = make_cluster(alice, "running", gpus=8)
    _place()
    make_host("gpu-dead", engine="unix:///run/suanli-no-such-engine.sock", gpus=8)
    host_services.host_set_draining(host=a, draining=True)
    waiting = make_cluster(alice, "waiting", gpus=1)
    _place()
    waiting.refresh_from_db()
    running.refresh_from_db()
    assert running.state == Cluster.State.RUNNING, "running nodes stay on a draining host"
    assert waiting.state == Cluster.State.PENDING
    assert (
        "no active host in any zone is large enough for a node of 1 x 1 A100 80 GB"
        in waiting.state_reason
    )
    _release(running)
    host_services.host_set_draining(host=a, draining=False)
    _place()
    waiting.refresh_from_db()
    assert waiting.state == Cluster.State.RUNNING and _hosts_of(waiting) == ["gpu-a-01"]


def test_head_of_queue_is_not_starved_by_a_stream_of_small_requests(
    make_host, make_cluster, alice, bob
):
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=8, check="reuse")
    make_host("gpu-b-01", engine=1, zone="zone-b", gpus=4, check="reuse")
    hog = make_cluster(bob, "hog", gpus=4, zone="zone-a")
    _place()
    head = make_cluster(alice, "head", gpus=8, zone="zone-a")
    stream = [make_cluster(bob, f"small-{i}", gpus=2) for i in range(3)]
    _place()
    # The small requests fit in zone-a's 4 free GPUs, but those are the head's: only
    # zone-b (which the head cannot use) backfills.
    assert {_hosts_of(c)[0] for c in stream if _hosts_of(c)} == {"gpu-b-01"}
    assert sum(1 for c in stream if _hosts_of(c)) == 2
    _release(hog)
    _place()
    head.refresh_from_db()
    assert head.state == Cluster.State.RUNNING and _hosts_of(head) == ["gpu-a-01"]


def test_release_gives_gpus_back_once_the_engine_confirms_and_places_the_next(
    make_host, make_cluster, alice, bob
):
    make_host("gpu-a-01", engine=0, gpus=8, check="reuse")
    first = make_cluster(alice, "first", gpus=8)
    _place()
    second = make_cluster(bob, "second", gpus=8)
    _place()
    second.refresh_from_db()
    assert second.state == Cluster.State.PENDING
    released = services.cluster_release(cluster=first)
    assert released.state == Cluster.State.RELEASED and released.released_at is not None
    assert GpuSlot.objects.filter(node__isnull=True).count() == 0, "held until confirmed"
    assert [e.kind for e in released.events.all()] == [
        "pending",
        "running",
        "releasing",
        "released",
    ]
    assert services.cluster_release(cluster=first).released_at == released.released_at, "idempotent"
    _place()
    second.refresh_from_db()
    assert second.state == Cluster.State.PENDING
    assert "GPUs being freed on gpu-a-01: 8" in second.state_reason, second.state_reason
    assert tasks.cluster_network_remove(first.pk)  # the engine has none of its containers
    assert GpuSlot.objects.filter(node__isnull=True).count() == 8
    _place()
    second.refresh_from_db()
    assert second.state == Cluster.State.RUNNING


def test_resize_adds_and_removes_nodes(make_host, make_cluster, alice):
    make_host("gpu-a-01", engine=0, gpus=8, check="reuse")
    make_host("gpu-a-02", engine=1, gpus=8, check="reuse")
    c = make_cluster(alice, "grow", nodes=1, gpus=8)
    _place()
    services.cluster_resize(cluster=c, nodes=2)
    assert sorted(_hosts_of(c)) == ["gpu-a-01", "gpu-a-02"]
    with pytest.raises(Exception, match="No room for 1 x 8 A100 80 GB"):
        services.cluster_resize(cluster=c, nodes=3)
    services.cluster_resize(cluster=c, nodes=1)
    c.refresh_from_db()
    assert c.nodes == 1 and len(_hosts_of(c)) == 1
    assert GpuSlot.objects.filter(node__isnull=False).count() == 16, "held until confirmed"
    assert exits.free_gpus(cluster_id=c.pk) == 8  # the engine has no container of it
    assert GpuSlot.objects.filter(node__isnull=False).count() == 8
    assert [e.kind for e in c.events.all()][-2:] == ["resized", "resized"]


def test_idle_policy_releases_and_never_policy_keeps(make_host, make_cluster, alice):
    from datetime import timedelta

    from django.utils import timezone

    make_host("gpu-a-01", engine=0, gpus=8, check="reuse")
    idle = make_cluster(alice, "idle", release_policy=Cluster.ReleasePolicy.IDLE, idle_minutes=30)
    keep = make_cluster(alice, "keep", release_policy=Cluster.ReleasePolicy.NEVER)
    _place()
    later = timezone.now() + timedelta(minutes=29)
    assert services.clusters_release_idle(now=later) == []
    later = timezone.now() + timedelta(minutes=31)
    assert services.clusters_release_idle(now=later) == [idle.pk]
    idle.refresh_from_db()
    keep.refresh_from_db()
    assert idle.state == Cluster.State.RELEASED
    assert idle.state_reason == "released automatically after 30 idle minutes"
    assert keep.state == Cluster.State.RUNNING


def test_placement_runs_as_an_rq_task_after_create(make_host, make_cluster, alice):
    import django_rq
    from rq import SimpleWorker

    make_host("gpu-a-01", engine=0, gpus=8, check="reuse")
    c = make_cluster(alice, "via-rq", gpus=2)
    queue = django_rq.get_queue("default")
    assert queue.count == 1, "create enqueued one placement pass (after commit)"
    SimpleWorker([queue], connection=queue.connection, serializer=queue.serializer).work(burst=True)
    c.refresh_from_db()
    assert c.state == Cluster.State.RUNNING


@pytest.mark.django_db(transaction=True)  # four threads, four connections
def test_concurrent_schedulers_never_double_book(make_host, make_cluster, alice):
    assert connection.vendor == "postgresql", "row locks are proven on PostgreSQL: run `make test`"
    for i in range(6):
        make_host(f"gpu-{i:02}", engine=i % 2, zone=f"zone-{'ab'[i % 2]}", gpus=8, check="reuse")
    shapes = [(1, 1), (1, 2), (2, 4), (1, 8), (2, 2), (3, 1), (1, 3), (4, 2)]
    clusters = [
        make_cluster(alice, f"c{i}", nodes=n, gpus=g) for i, (n, g) in enumerate(shapes * 5)
    ]
    errors = []

    def worker():
        try:
            for _ in range(3):
                scheduler.place_pending()
        except Exception as exc:  # surfaced below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    held = Counter(GpuSlot.objects.filter(node__isnull=False).values_list("id", flat=True))
    assert all(n == 1 for n in held.values())
    running = 0
    for c in Cluster.objects.filter(pk__in=[c.pk for c in clusters]):
        nodes = list(Node.objects.filter(cluster=c, released_at__isnull=True))
        if c.state == Cluster.State.RUNNING:
            running += 1
            assert len(nodes) == c.nodes
            for node in nodes:
                assert node.slots.count() == c.gpus_per_node == len(node.gpu_indices)
                assert set(node.slots.values_list("host_id", flat=True)) == {node.host_id}
        else:
            assert c.state == Cluster.State.PENDING and nodes == [], "half-placed"
    assert running >= 10
    total = sum(
        c.nodes * c.gpus_per_node for c in Cluster.objects.filter(state=Cluster.State.RUNNING)
    )
    assert total == GpuSlot.objects.filter(node__isnull=False).count() <= 48


def test_hosts_outside_a_swarm_take_multi_node_clusters_only_whole(make_host, make_cluster, alice):
    """A host that left the swarm cannot share an overlay network: a cluster spanning it and
    another host waits (and says why), one that fits on it alone is placed there, and a
    cluster cannot grow onto it from a swarm member."""
    from jobs.models import Host

    make_host("gpu-a-01", engine=0, gpus=8, check="reuse")
    outside = make_host("gpu-b-01", engine=1, gpus=8, check="reuse")
    Host.objects.filter(pk=outside.pk).update(swarm_state="inactive", swarm_cluster="")
    grow = make_cluster(alice, "grow", nodes=1, gpus=8)
    _place()
    assert _hosts_of(grow) == ["gpu-a-01"]
    with pytest.raises(Exception, match="cannot share a network"):
        services.cluster_resize(cluster=grow, nodes=2)

    _release(grow)
    spanning = make_cluster(alice, "spanning", nodes=2, gpus=8)
    _place()
    spanning.refresh_from_db()
    assert spanning.state == Cluster.State.PENDING
    assert "must share one network" in spanning.state_reason
    _release(spanning)
    Host.objects.filter(name="gpu-a-01").update(state=Host.State.DRAINING)
    whole = make_cluster(alice, "whole", nodes=2, gpus=4)
    _place()
    whole.refresh_from_db()
    assert whole.state == Cluster.State.RUNNING
    assert len(set(_hosts_of(whole))) == 1, "both nodes on one host"


def test_on_demand_requests_are_placed_before_earlier_spot_ones(make_host, make_cluster, alice):
    """One host's worth of GPUs, a spot request first and an on-demand one after it: the
    on-demand one is placed, the spot one waits behind it."""
    make_host("gpu-a-01", engine=0, gpus=8, check="reuse")
    spot = make_cluster(alice, "spot", nodes=1, gpus=8, spot=True)
    on_demand = make_cluster(alice, "on-demand", nodes=1, gpus=8)
    report = _place()
    spot.refresh_from_db()
    assert report.placed == [on_demand.pk]
    assert _hosts_of(on_demand) == ["gpu-a-01"]
    assert spot.state == Cluster.State.PENDING and not spot.node_set.exists()


def test_room_counts_only_hosts_large_enough_for_a_node_and_not_held_for_the_head(
    make_host, make_cluster, alice
):
    """A waiting request's reason counts the nodes that would fit and the GPUs free on the
    hosts it could use: not a host too small for one of its nodes, and, for those behind
    the head of the line, not the hosts the head holds."""
    make_host("gpu-a-01", engine=0, gpus=8, check="reuse")
    make_host("gpu-a-02", engine=1, gpus=4, check="reuse")
    head = make_cluster(alice, "head", nodes=2, gpus=8)
    behind = make_cluster(alice, "behind", nodes=2, gpus=2)
    _place()
    head.refresh_from_db()
    behind.refresh_from_db()
    assert "room for 1 of 2 nodes now (8 GPUs free)" in head.state_reason
    # The head holds gpu-a-01; what is left for the next request is the 4-GPU host.
    assert behind.state == Cluster.State.RUNNING
    assert _hosts_of(behind) == ["gpu-a-02", "gpu-a-02"]


def test_a_pass_queues_each_placed_clusters_network_and_tells_only_listening_owners(
    make_host, make_cluster, alice, bob
):
    """Placed in one pass: each cluster's network is queued (its own RQ job, by its id) once
    the placement commits, and a "cluster.running" webhook event is recorded for the owner
    who has a channel that wants it, none for the one without."""
    import django_rq

    from jobs.events import webhooks
    from jobs.models import WebhookEndpoint, WebhookEvent

    make_host("gpu-a-01", engine=0, gpus=8, check="reuse")
    make_host("gpu-a-02", engine=1, gpus=8, check="reuse")
    WebhookEndpoint.objects.create(
        owner=alice, url="https://example.com/hook", events=["cluster.running"],
        secret=webhooks.new_secret(),
    )  # fmt: skip
    mine = [make_cluster(alice, f"a{i}", nodes=1, gpus=4) for i in range(2)]
    theirs = [make_cluster(bob, f"b{i}", nodes=1, gpus=4) for i in range(2)]
    report = _place()
    assert sorted(report.placed) == sorted(c.pk for c in mine + theirs)
    queue = django_rq.get_queue("docker")
    for cluster in mine + theirs:
        job = queue.fetch_job(f"net-{cluster.pk}")
        assert job is not None and job.func_name == "jobs.tasks.cluster_network_ensure"
        assert list(job.args) == [cluster.pk]
    events = WebhookEvent.objects.filter(type="cluster.running")
    assert sorted(e.owner_id for e in events) == [alice.pk, alice.pk]
    assert {json.loads(e.body)["data"]["cluster"]["id"] for e in events} == {c.pk for c in mine}
    assert all(json.loads(e.body)["data"]["cluster"]["state"] == "running" for e in events)


@pytest.mark.django_db(transaction=True)  # a second connection holds a slot
def test_a_gang_is_placed_whole_or_not_at_all_when_another_scheduler_holds_a_slot(
    make_host, make_cluster, alice
):
    """Another scheduler's transaction holds one GPU slot of the second host (its row lock)
    while a pass writes a 2-node cluster planned across both hosts: the pass skips the
    locked slot, finds the second host short, and writes nothing of the cluster (no node,
    no slot on the first host); the next pass, once the lock is gone, places it whole."""
    assert connection.vendor == "postgresql", "row locks are proven on PostgreSQL: run `make test`"
    from django.db import transaction

    make_host("gpu-a-01", engine=0, gpus=8, check="reuse")
    second = make_host("gpu-a-02", engine=1, gpus=8, check="reuse")
    gang = make_cluster(alice, "gang", nodes=2, gpus=8)
    held, release, errors = threading.Event(), threading.Event(), []

    def other_scheduler():
        try:
            with transaction.atomic():
                slot = GpuSlot.objects.select_for_update().filter(host=second).first()
                assert slot is not None
                held.set()
                release.wait(30)
        except Exception as exc:  # surfaced below
            errors.append(exc)
            held.set()
        finally:
            connections.close_all()

    thread = threading.Thread(target=other_scheduler)
    thread.start()
    try:
        assert held.wait(30)
        report = _place()
    finally:
        release.set()
        thread.join()
    assert not errors, errors
    gang.refresh_from_db()
    assert report.placed == [] and report.conflicts == 1
    assert gang.state == Cluster.State.PENDING
    assert not Node.objects.filter(cluster=gang).exists()
    assert not GpuSlot.objects.filter(node__isnull=False).exists(), "nothing half-held"
    report = _place()
    gang.refresh_from_db()
    assert report.placed == [gang.pk] and gang.state == Cluster.State.RUNNING
    assert _hosts_of(gang) == ["gpu-a-01", "gpu-a-02"]
    assert GpuSlot.objects.filter(node__cluster=gang).count() == 16

"""A shutdown rule stops within its owner's most stopped clusters (SUANLI_MAX_STOPPED_CLUSTERS),
as her own stop does (issue 41's attack review): a tenant once made many small clusters with
a stop time a minute away, each stopped past the limit, their workspaces kept on the hosts'
disks for days. At the limit the cluster keeps running, its timeline says why, once, and the
rule is cleared. Paper hosts (a stop that needs no engine)."""

# ruff: noqa: F811 (the fixtures of test_shutdown.py, imported, are the tests' arguments)

from datetime import timedelta

import pytest
from test_shutdown import T0, _samples, _tick, _timeline, placed  # noqa: F401

from jobs.models import Cluster, ClusterEvent

pytestmark = pytest.mark.django_db

AT_LIMIT = (
    "not stopped as its shutdown rule asked: you already keep 1 stopped clusters, the most "
    "allowed; release one, then stop this one yourself (the rule is cleared)"
)


def test_scheduled_stops_keep_to_the_most_stopped_clusters(placed, bob, settings):
    settings.SUANLI_MAX_STOPPED_CLUSTERS = 1
    clusters = [placed(f"c{i}", gpus=1, stop_at=T0 + timedelta(minutes=1)) for i in range(3)]
    theirs = placed("b1", gpus=1, owner=bob, stop_at=T0 + timedelta(minutes=1))
    stopped = _tick(T0 + timedelta(minutes=2))["scheduled"]
    assert len(stopped) == 2 and theirs.pk in stopped  # one of hers, and bob's own
    for cluster in clusters:
        cluster.refresh_from_db()
        assert cluster.stop_at is None  # applied once, either way
    kept = [c for c in clusters if c.state == Cluster.State.STOPPED]
    running = [c for c in clusters if c.state == Cluster.State.RUNNING]
    assert len(kept) == 1 and len(running) == 2
    for cluster in running:
        assert _timeline(cluster, "en").count(AT_LIMIT) == 1
    # Nothing is tried again the next minute: no second entry, still running.
    assert _tick(T0 + timedelta(minutes=3)) == {"scheduled": [], "idle": []}
    assert ClusterEvent.objects.filter(cluster__in=running, kind="shutdown").count() == 2
    assert Cluster.objects.filter(owner=clusters[0].owner, state="stopped").count() == 1


def test_an_idle_stop_keeps_to_the_most_stopped_clusters(placed, settings):
    settings.SUANLI_MAX_STOPPED_CLUSTERS = 1
    first = placed("c1", gpus=1, stop_at=T0 + timedelta(minutes=1))
    idle = placed("c2", gpus=1, stop_idle_minutes=10, stop_idle_below=5)
    _samples(idle, T0, 20, [0.0])
    assert _tick(T0 + timedelta(minutes=2))["scheduled"] == [first.pk]
    assert _tick(T0 + timedelta(minutes=10, seconds=5))["idle"] == []
    idle.refresh_from_db()
    assert idle.state == "running"
    assert (idle.stop_idle_minutes, idle.stop_idle_below) == (None, None)  # cleared: said once
    assert _timeline(idle, "en").count(AT_LIMIT) == 1
    assert _tick(T0 + timedelta(minutes=11, seconds=5))["idle"] == []
    assert _timeline(idle, "en").count(AT_LIMIT) == 1

"""The pools' cron round (console.pools.tick) over several pools at once: each pool gets
what its own round would give it (its money figures, the dispatch of its free clusters,
its sample, a cluster added or released with its reason), whether the round is one of
the quiet ones taken together or a pool's own."""

from datetime import timedelta
from decimal import Decimal

import django_rq
import pytest
from conftest import TEST_IMAGE
from django.utils import timezone

from billing import selectors as billing
from console import pools as console_pools
from jobs.clusters.services import ClusterSpec
from jobs.models import Cluster, Image, Job, Pool, PoolSample, TeamMember
from jobs.pools import autoscaler
from jobs.teams import services as teams
from jobs.tenancy.actors import Actor

Role = TeamMember.Role

pytestmark = pytest.mark.django_db


@pytest.fixture
def make_pool(catalog, priced, alice, storage_root):
    image = Image.objects.get(reference=TEST_IMAGE)

    def make(
        name, *, running=0, busy=0, waiting=0, idle_for=timedelta(0), owner=None, by=None,
        **fields,
    ):  # fmt: skip
        """A pool (alice's unless `owner`) with `running` running clusters (`busy` of them
        running a job, the jobs `waiting` queued on the first), idle since `idle_for` ago."""
        shape = ClusterSpec(
            name="", nodes=1, gpu_model=catalog["a100-80gb"], gpus_per_node=1, image=image
        )
        spec = autoscaler.PoolSpec(name=name, cluster=shape, **fields)
        pool = autoscaler.pool_create(owner=owner or alice, spec=spec, created_by=by)
        now = timezone.now()
        clusters = [
            Cluster.objects.create(
                owner=alice, name=f"{name}-{k + 1}", gpu_model=shape.gpu_model, nodes=1,
                gpus_per_node=1, image=image, image_reference=image.reference, pool=pool,
                state=Cluster.State.RUNNING, running_since=now - idle_for,
                last_active_at=now - idle_for, release_policy=Cluster.ReleasePolicy.NEVER,
            )
            for k in range(running)
        ]  # fmt: skip
        for k in range(busy):
            Job.objects.create(cluster=clusters[k], owner=alice, name=f"run{k}", command="true",
                               pool=pool, state=Job.State.RUNNING, attempt=1, started_at=now)  # fmt: skip
        for k in range(waiting):
            Job.objects.create(cluster=clusters[0], owner=alice, name=f"wait{k}", command="true",
                               pool=pool)  # fmt: skip
        return pool

    return make


def _queued(cluster) -> bool:
    job = django_rq.get_queue("docker").fetch_job(f"dispatch-{cluster.pk}")
    return job is not None and job.get_status() == "queued"


def test_one_round_gives_each_pool_what_its_own_round_would(make_pool, alice):
    django_rq.get_queue("docker").empty()
    # Two jobs wait while two of its three clusters are free: only dispatches to ask.
    waits = make_pool("waits", running=3, busy=1, waiting=2, max_clusters=3, idle_minutes=600)
    # Below its minimum: a cluster is added.
    short = make_pool("short", min_clusters=1, max_clusters=2)
    # Idle past its idle minutes, above its minimum of 0: released.
    idle = make_pool("idle", running=1, idle_for=timedelta(minutes=30), idle_minutes=10)
    # Idle past its idle minutes too, but at its minimum of 1: kept, nothing to say.
    kept = make_pool(
        "kept", running=1, idle_for=timedelta(minutes=30), idle_minutes=10, min_clusters=1,
        max_clusters=2,
    )  # fmt: skip
    # Closed, its cluster idle this very moment: released too.
    closed = make_pool("closed", running=1, max_clusters=2)
    Pool.objects.filter(pk=closed.pk).update(state=Pool.State.CLOSED)
    # Nothing to do: no cluster, no job, no minimum.
    still = make_pool("still", max_clusters=2)
    Pool.objects.update(rate_per_hour=None, spent=Decimal("-1"), balance=None)

    assert console_pools.tick() == 6

    for pool in (waits, short, idle, kept, closed, still):
        pool.refresh_from_db()
        assert pool.rate_per_hour == billing.pool_rate(pool) > 0
        assert pool.spent == 0 and pool.balance == billing.balance_of(alice) == Decimal("1000")
    # The waiting jobs' pool: its running clusters are asked to dispatch (the free ones take
    # the jobs), and its figures are on its chart.
    assert all(_queued(c) for c in waits.clusters.all())
    sample = waits.samples.get()
    assert (sample.waiting, sample.running, sample.clusters, sample.ready) == (2, 1, 3, 3)
    assert not waits.events.exclude(kind="created").exists()
    # The others decided, each with its reason on its timeline.
    grew = short.events.get(kind="grow")
    assert "below the minimum of 1" in grew.message
    assert short.clusters.filter(state__in=autoscaler.LIVE).count() == 1
    assert "idle for 10 minutes" in idle.events.get(kind="shrink").message
    assert not idle.clusters.filter(state__in=autoscaler.LIVE).exists()
    assert kept.clusters.filter(state=Cluster.State.RUNNING).count() == 1
    assert not kept.events.exclude(kind="created").exists()
    assert kept.samples.get().clusters == 1
    assert "the pool is closed" in closed.events.get(kind="shrink").message
    assert not closed.clusters.filter(state__in=autoscaler.LIVE).exists()
    assert still.samples.get().clusters == 0
    assert not still.events.exclude(kind="created").exists()

    # The next round, moments later: the same figures, no second sample, the dispatches
    # still queued once.
    samples = PoolSample.objects.count()
    console_pools.tick()
    assert PoolSample.objects.count() == samples
    queued = django_rq.get_queue("docker").job_ids
    assert sorted(queued) == sorted(set(queued))
    assert {f"dispatch-{c.pk}" for c in waits.clusters.all()} <= set(queued)


def test_a_team_pool_is_held_by_its_makers_gpu_cap_in_the_same_round(make_pool, alice, bob, fund):
    """A pool made by a team member is refreshed (the member's caps) and scaled on its
    own, beside the pools taken together: its maker's GPU cap holds it back."""
    team = teams.team_create(person=alice, name="lab")
    owner = Actor.for_team(alice, team.pk)
    invite, _token = teams.invite_create(actor=owner, role=Role.MEMBER, login="bob")
    teams.invite_accept(person=bob, invite=invite)
    fund(team.principal, "100")
    teams.member_set_caps(
        actor=owner, member=team.memberships.get(person=bob), monthly_cap=None, gpu_cap=0
    )
    pool = make_pool("lab", owner=team.principal, by=bob, min_clusters=1, max_clusters=2)
    own = make_pool("own", min_clusters=1, max_clusters=1)

    console_pools.tick()

    pool.refresh_from_db()
    assert pool.gpu_room == 0 and pool.balance == Decimal("100")
    assert not pool.clusters.exists()
    assert "the GPU cap of bob (its maker)" in pool.events.get(kind="held").message
    assert own.clusters.count() == 1  # alice's own: no cap

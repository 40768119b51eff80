"""Pools on the real engines (issue 26): a queue and identical clusters that grow while
jobs wait, up to the maximum and within the budget, and are released once idle; each
decision on the pool's timeline with its reason and figures."""

from datetime import timedelta
from decimal import Decimal

import pytest
from conftest import TEST_IMAGE
from django.core.exceptions import ValidationError
from django.utils import timezone

from console import pools as console_pools
from jobs.clusters import services
from jobs.clusters.services import ClusterSpec, JobSpec
from jobs.events import lifecycle
from jobs.models import Cluster, Image, Job, Pool
from jobs.placement import scheduler
from jobs.pools import autoscaler
from jobs.runs import dispatch, repair

pytestmark = pytest.mark.django_db


@pytest.fixture
def hosts(make_host):
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2, check="reuse")
    make_host("gpu-b-01", engine=1, zone="zone-a", gpus=2, check="reuse")


@pytest.fixture
def make_pool(catalog, priced, alice, hosts, storage_root):
    def make(owner=None, **fields):
        shape = ClusterSpec(
            name="",
            nodes=1,
            gpu_model=catalog["a100-80gb"],
            gpus_per_node=1,
            image=Image.objects.get(reference=TEST_IMAGE),
            spot=fields.pop("spot", False),
        )
        spec = autoscaler.PoolSpec(name=fields.pop("name", "train"), cluster=shape, **fields)
        pool = autoscaler.pool_create(owner=owner or alice, spec=spec)
        return console_pools.refresh(pool)

    return make


def submit(pool, name, command="sleep 2"):
    return console_pools.submit(pool=pool, spec=JobSpec(name=name, command=command))


def live(pool):
    return list(pool.clusters.filter(state__in=autoscaler.LIVE).order_by("id"))


def drive(pool, until, timeout=60):
    """What the processes would do: place, dispatch free clusters, settle, scale."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        scheduler.place_pending()
        for cluster in live(pool):
            dispatch.dispatch(cluster.pk)
        repair.reconcile()
        autoscaler.pool_scale(pool.pk)
        if until():
            return
        time.sleep(0.3)
    raise AssertionError(
        (
            "not reached in time",
            [(c.pk, c.state, c.state_reason) for c in Cluster.objects.filter(pool=pool)],
            [(j.pk, j.state, j.attempt, j.cluster_id, j.state_reason) for j in pool.jobs.all()],
            list(pool.events.values_list("kind", "message")),
        )
    )


def test_three_jobs_grow_a_pool_to_its_maximum_and_idle_clusters_go(make_pool):
    pool = make_pool(min_clusters=0, max_clusters=2, idle_minutes=1)
    assert live(pool) == []
    jobs = [submit(pool, f"j{i}") for i in range(3)]
    autoscaler.pool_scale(pool.pk)
    assert len(live(pool)) == 2  # and no more: the third job waits
    events = list(pool.events.values_list("kind", "message", "figures"))
    grew = [e for e in events if e[0] == "grow"]
    assert grew[0][1] == "1 waiting, 0 starting, 0 free, 0 finishing: +1"
    # The issue's own example: 3 jobs waiting, 1 cluster starting: +1 (and 1 held back).
    assert grew[1][1] == "3 waiting, 1 starting, 0 free, 0 finishing: +1"
    assert grew[1][2]["waiting"] == 3 and grew[1][2]["clusters"] == 1
    held = [e for e in events if e[0] == "held"]
    assert "maximum of 2 clusters is reached" in held[-1][1], events

    drive(pool, lambda: Job.objects.filter(pool=pool, state="running").count() == 2)
    waiting = Job.objects.get(pool=pool, state="queued")
    assert waiting.pk == jobs[2].pk  # first come, first served
    drive(pool, lambda: Job.objects.filter(pool=pool, state="succeeded").count() == 3)
    # All three ran on the pool's two clusters, and no third was ever made.
    assert Cluster.objects.filter(pool=pool).count() == 2
    assert {j.cluster_id for j in Job.objects.filter(pool=pool)} == {c.pk for c in live(pool)}

    # Idle, but not yet for the pool's minutes: kept. Then released, both (min 0).
    autoscaler.pool_scale(pool.pk)
    assert len(live(pool)) == 2
    autoscaler.pool_scale(pool.pk, now=timezone.now() + timedelta(minutes=1, seconds=5))
    assert live(pool) == []
    shrunk = list(pool.events.filter(kind="shrink").values_list("message", flat=True))
    assert len(shrunk) == 2
    assert "idle for 1 minutes, 2 clusters, minimum 0: -1" in shrunk[0]
    released = Cluster.objects.filter(pool=pool).first()
    assert released.state == "released" and "released by pool train" in released.state_reason


def test_a_budget_below_two_clusters_keeps_the_pool_at_one(make_pool):
    pool = make_pool(max_clusters=2)
    rate = pool.rate_per_hour
    assert rate == Decimal("7.8000")  # one A100 on demand, from the rate card
    Pool.objects.filter(pk=pool.pk).update(budget_per_hour=rate * Decimal("1.5"))
    pool.refresh_from_db()
    submit(pool, "a", "sleep 30")
    submit(pool, "b", "sleep 30")
    autoscaler.pool_scale(pool.pk)
    assert len(live(pool)) == 1
    held = pool.events.filter(kind="held").last()
    assert held.message == (
        "2 waiting, 1 starting, 0 free, 0 finishing: 1 more wanted, held back: a budget of "
        "11.70 per hour pays for 1 at 7.80 per hour each"
    )
    assert held.figures["rate_per_hour"] == "7.80" and held.figures["budget_per_hour"] == "11.70"
    autoscaler.pool_scale(pool.pk)  # the same reason again: one line, not one per round
    assert pool.events.filter(kind="held").count() == 1
    for job in Job.objects.filter(pool=pool):
        job.refresh_from_db()
    autoscaler.pool_close(pool=pool)
    autoscaler.pool_scale(pool.pk)
    assert Job.objects.filter(pool=pool, state="cancelled").count() == 2


def test_a_spent_total_budget_adds_no_cluster_and_says_so(make_pool):
    pool = make_pool(max_clusters=2, budget_total=Decimal("1"))
    Pool.objects.filter(pk=pool.pk).update(spent=Decimal("1.20"))
    with pytest.raises(ValidationError) as caught:
        autoscaler.pool_submit(pool=pool, spec=JobSpec(name="x", command="true"))
    assert "its total budget of 1.00 is spent (1.20)" in caught.value.messages[0]
    assert live(pool) == []


def test_a_closed_pool_takes_no_job(make_pool):
    pool = make_pool()
    autoscaler.pool_close(pool=pool)
    with pytest.raises(ValidationError, match="closed"):
        submit(pool, "late")


def test_a_spot_pool_requeues_a_preempted_job_onto_its_free_cluster(
    make_pool, processes, storage_root, settings
):
    """Spot pools re-queue preempted jobs as spot clusters do: the job's cluster goes back to
    the placement queue, and the pool's other cluster, free, takes the job at once."""
    settings.SUANLI_SPOT_MIN_RUN_S = 0
    settings.SUANLI_PREEMPT_SCRIPT_S = 2
    settings.SUANLI_PREEMPT_GRACE_S = 2
    env = {
        "SUANLI_SPOT_MIN_RUN_S": "0",
        "SUANLI_RECLAIM_AFTER_S": "0",
        "SUANLI_PREEMPT_SCRIPT_S": "2",
        "SUANLI_PREEMPT_GRACE_S": "2",
        "SUANLI_STORAGE_ROOT": str(storage_root),
    }
    processes.start("worker", "--worker-class", "console.rqworker.SimpleWorker", env=env)
    pool = make_pool(min_clusters=2, max_clusters=2, spot=True)
    drive(pool, lambda: len([c for c in live(pool) if c.state == "running"]) == 2)
    job = submit(pool, "long", "echo attempt $SUANLI_ATTEMPT; sleep 60")
    drive(pool, lambda: Job.objects.get(pk=job.pk).state == "running")
    job.refresh_from_db()
    first = job.cluster
    other = next(c for c in live(pool) if c.pk != first.pk)
    assert lifecycle.cluster_preempt(cluster=first, reason="capacity reclaimed")
    drive(
        pool,
        lambda: Job.objects.filter(pk=job.pk, attempt=2, state="running").exists(),
        timeout=60,
    )
    job.refresh_from_db()
    assert job.cluster_id == other.pk and job.preemptions == 1
    kinds = list(job.events.values_list("kind", flat=True))
    assert "preempted" in kinds and "moved" in kinds and "resuming" in kinds
    first.refresh_from_db()
    assert first.state in ("pending", "running")  # back in the placement queue, not lost
    services.job_cancel(job=job, by="test")
    autoscaler.pool_close(pool=pool)


def test_operators_see_pools_and_their_decisions_in_the_admin(make_pool, operator, client):
    pool = make_pool(max_clusters=2)
    submit(pool, "a", "sleep 30")
    autoscaler.pool_scale(pool.pk)
    client.force_login(operator)
    listing = client.get("/admin/jobs/pool/").content.decode()
    assert "train" in listing and "alice" in listing
    page = client.get(f"/admin/jobs/pool/{pool.pk}/change/").content.decode()
    assert "1 waiting, 0 starting, 0 free, 0 finishing: +1" in page
    assert client.get("/admin/jobs/sweep/").status_code == 200
    assert client.get(f"/admin/jobs/pool/{pool.pk}/delete/").status_code == 403  # look only
    autoscaler.pool_close(pool=pool)

"""GPUs held idle are not free: a node of a cluster without workspaces (a batch or pool
cluster; its first job starts it) that holds its GPUs `SUANLI_START_GRACE_S` without a job
is charged from its placement; one whose first job comes within the grace is charged from
that job. A workspace node is charged only from its start. On paper hosts (the db tier):
accrual reads placement and start seconds only."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.conf import settings
from django.utils import timezone

from billing import accrual
from billing import services as billing
from billing.models import LedgerEntry, Meter
from jobs.clusters import services
from jobs.models import Node
from jobs.placement import scheduler

pytestmark = pytest.mark.django_db

GRACE = timedelta(seconds=settings.SUANLI_START_GRACE_S)


@pytest.fixture
def cluster_of(make_paper_host, make_cluster, alice, rate_card, fund):
    rate_card({"a100-80gb": "3.60"}, effective_from=timezone.now() - timedelta(hours=1))
    fund(alice, "100")
    make_paper_host("gpu-paper-01", gpus=8)

    def make(name, **extra):
        cluster = make_cluster(alice, name, gpus=2, release_policy="never", volumes=(), **extra)
        scheduler.place_pending()
        cluster.refresh_from_db()
        assert cluster.state == "running", cluster.state_reason
        node = cluster.node_set.get()
        assert node.started_at is None
        return cluster, billing.floor_s(node.placed_at)

    return make


def _seconds(cluster) -> int:
    return sum(e.seconds for e in LedgerEntry.objects.filter(cluster=cluster, kind="usage"))


def test_a_cluster_without_workspaces_held_idle_past_the_grace_is_charged_from_placement(
    cluster_of, alice
):
    cluster, placed = cluster_of("idle-batch", workspace=False)

    accrual.accrue(now=placed + GRACE - timedelta(seconds=60))
    assert not Meter.objects.filter(cluster=cluster).exists(), "within the grace: nothing"
    assert billing.account_for(alice).balance == Decimal("100")

    accrual.accrue(now=placed + GRACE + timedelta(seconds=60))
    usage = LedgerEntry.objects.filter(cluster=cluster, kind="usage")
    assert min(e.period_from for e in usage) == placed
    assert _seconds(cluster) == GRACE.total_seconds() + 60
    assert billing.account_for(alice).balance < Decimal("100")


def test_its_first_job_within_the_grace_starts_its_billing(cluster_of):
    cluster, placed = cluster_of("quick-batch", workspace=False)
    job_at = placed + timedelta(seconds=120)
    Node.objects.filter(cluster=cluster).update(started_at=job_at)  # its first replica ran

    accrual.accrue(now=placed + GRACE + timedelta(seconds=60))
    usage = LedgerEntry.objects.filter(cluster=cluster, kind="usage")
    assert min(e.period_from for e in usage) == job_at
    assert _seconds(cluster) == (GRACE + timedelta(seconds=60) - timedelta(seconds=120)).seconds


def test_released_within_the_grace_without_a_job_costs_nothing(cluster_of):
    cluster, placed = cluster_of("short-batch", workspace=False)
    Node.objects.filter(cluster=cluster).update(released_at=placed + timedelta(seconds=30))
    services.cluster_release(cluster=cluster)
    accrual.accrue(now=placed + GRACE * 3)
    assert not Meter.objects.filter(cluster=cluster).exists()
    assert not LedgerEntry.objects.filter(cluster=cluster).exists()


def test_released_past_the_grace_without_a_job_pays_for_its_holding(cluster_of):
    cluster, placed = cluster_of("held-batch", workspace=False)
    end = placed + GRACE + timedelta(seconds=300)
    Node.objects.filter(cluster=cluster).update(released_at=end)
    accrual.accrue(now=end + timedelta(hours=1))
    assert _seconds(cluster) == (end - placed).total_seconds()
    assert (
        min(e.period_from for e in LedgerEntry.objects.filter(cluster=cluster, kind="usage"))
        == placed
    )


def test_a_workspace_node_that_never_started_is_not_charged_past_the_grace(cluster_of):
    cluster, placed = cluster_of("slow-pull")  # workspace=True: its pull is ours
    accrual.accrue(now=placed + GRACE + timedelta(seconds=60))
    assert not Meter.objects.filter(cluster=cluster).exists()
    assert not LedgerEntry.objects.filter(cluster=cluster).exists()


def test_a_workspace_is_failed_past_its_deadline_only_while_its_pull_does_not_move(cluster_of):
    """`stalled`: a slow pull that still moves is waited for past the 30 minutes; one whose
    progress has not moved for 5 minutes, or none running, is not."""
    from jobs.nodes import workspaces

    cluster, placed = cluster_of("big-image")
    node = cluster.node_set.select_related("host").get()
    assert not workspaces.stalled(cluster, node), "within the deadline"
    now = timezone.now()
    node.placed_at = now - timedelta(seconds=settings.SUANLI_START_DEADLINE_S + 60)
    assert workspaces.stalled(cluster, node), "no pull running"

    def pulling(moved):
        cluster.image_pulls = {
            node.host.name: {"state": "pulling", "done": 5, "total": 9, "moved_at": moved}
        }
        cluster.save(update_fields=["image_pulls"])

    pulling((now - timedelta(seconds=60)).isoformat())
    assert not workspaces.stalled(cluster, node), "a pull that moved a minute ago"
    pulling((now - timedelta(seconds=360)).isoformat())
    assert workspaces.stalled(cluster, node), "a pull that has not moved for 6 minutes"


def _job_at(cluster, at):
    """A job of the cluster submitted at `at` (its replica placed, its image pulling)."""
    from jobs.models import Job

    job = services.job_submit(cluster=cluster, spec=services.JobSpec(name="j", command="true"))
    Job.objects.filter(pk=job.pk).update(created_at=at)
    return job


def test_a_job_submitted_in_the_grace_whose_image_still_pulls_costs_nothing(cluster_of, alice):
    """Pull time is free: a cluster whose first job came within the grace is not holding
    its GPUs idle while that job's image pulls, however long."""
    cluster, placed = cluster_of("pulling-batch", workspace=False)
    _job_at(cluster, placed + timedelta(seconds=60))
    accrual.accrue(now=placed + timedelta(minutes=15))
    assert not Meter.objects.filter(cluster=cluster).exists()
    assert billing.account_for(alice).balance == Decimal("100")

    started = placed + timedelta(minutes=16)  # its replica runs at last: billed from there
    Node.objects.filter(cluster=cluster).update(started_at=started)
    accrual.accrue(now=placed + timedelta(minutes=20))
    usage = LedgerEntry.objects.filter(cluster=cluster, kind="usage")
    assert min(e.period_from for e in usage) == started
    assert _seconds(cluster) == 240


def test_a_cluster_that_fails_as_never_ran_is_charged_nothing(cluster_of, alice):
    from jobs.base.text import Text
    from jobs.events import lifecycle

    cluster, placed = cluster_of("never-ran-batch", workspace=False)
    _job_at(cluster, placed + timedelta(seconds=60))
    end = placed + timedelta(minutes=15)
    Node.objects.filter(cluster=cluster).update(released_at=end)
    lifecycle.cluster_release(
        cluster=cluster, reason=Text("could not start (nothing was charged): %(reason)s",
                                     reason="no such image"), failed=True,
    )  # fmt: skip
    cluster.refresh_from_db()
    assert cluster.state == "failed"
    accrual.accrue(now=end + timedelta(hours=1))
    assert not LedgerEntry.objects.filter(cluster=cluster).exists()
    assert billing.account_for(alice).balance == Decimal("100")


def test_held_idle_past_the_grace_then_failed_as_never_ran_is_charged_nothing(cluster_of):
    """Even with no job in the grace: a cluster that never ran and failed is not charged
    ("could not start (nothing was charged)")."""
    from jobs.base.text import Text
    from jobs.events import lifecycle

    cluster, placed = cluster_of("late-job-batch", workspace=False)
    end = placed + timedelta(minutes=15)
    Node.objects.filter(cluster=cluster).update(released_at=end)
    lifecycle.cluster_release(
        cluster=cluster, reason=Text("could not start (nothing was charged): %(reason)s",
                                     reason="no such image"), failed=True,
    )  # fmt: skip
    accrual.accrue(now=end + timedelta(hours=1))
    assert not LedgerEntry.objects.filter(cluster=cluster).exists()

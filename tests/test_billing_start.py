"""Nothing is billed that never ran: a node is charged from the second its workspace (in a
cluster without workspaces, its first job's replica) starts, not from its placement; a
cluster whose image cannot be pulled fails with the engine's words, its GPUs back, and
is charged nothing. On the real scheduler, engines, registry and the worker's tasks."""

import os
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
from browsing import login
from django.conf import settings
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone
from playwright.sync_api import expect
from waiting import until

from billing import accrual
from billing import services as billing
from billing.models import LedgerEntry, Meter
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import Cluster, GpuSlot, Job, Node
from jobs.nodes import registry
from jobs.placement import scheduler
from jobs.runs import dispatch

pytestmark = pytest.mark.django_db


@pytest.fixture
def placed(make_host, make_cluster, alice, rate_card, fund):
    """A priced, funded cluster of 1 GPU placed on engine a (its workspace not started:
    the worker's tasks have not run)."""
    rate_card({"a100-80gb": "3.60"}, effective_from=timezone.now() - timedelta(hours=1))
    fund(alice, "100")
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2, check="reuse")

    def make(name, *, image=None, **extra):
        cluster = make_cluster(alice, name, gpus=1, release_policy="never", volumes=(), **extra)
        if image is not None:
            # The catalog's image as the cluster asked for it; on no host, not pullable.
            Cluster.objects.filter(pk=cluster.pk).update(image_reference=image)
        scheduler.place_pending()
        cluster.refresh_from_db()
        assert cluster.state == "running", cluster.state_reason
        return cluster

    return make


def _missing_in_registry() -> str:
    return f"{registry.host()}/library/never-pushed-{uuid.uuid4().hex[:8]}:1.0"


@pytest.mark.parametrize(
    "image, words",
    [
        (_missing_in_registry, "404"),  # our registry has no such image
        (lambda: "localhost:1/none:x", "localhost:1"),  # a registry the hosts may not pull from
    ],
    ids=["not-in-registry", "not-pullable"],
)
def test_a_cluster_whose_image_cannot_be_pulled_fails_with_the_reason_and_costs_nothing(
    placed, client, alice, work_queue, image, words
):
    missing = image()
    cluster = placed("never-ran", image=missing)
    client.force_login(alice)
    page = client.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
    assert 'data-testid="not-started"' in page, "running is not claimed before it runs"
    assert "You are charged from the second it runs" in page

    work_queue()  # the worker: the workspace's start (the pull fails), then the clean-up

    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.FAILED, cluster.state_reason
    assert cluster.state_reason.startswith("could not start (nothing was charged): ")
    assert missing in cluster.state_reason and words in cluster.state_reason
    failed = cluster.events.get(kind="failed")
    assert failed.message == cluster.state_reason
    assert not Node.objects.filter(cluster=cluster, started_at__isnull=False).exists()

    # The page says so, in the reader's language.
    page = client.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
    assert "could not start (nothing was charged)" in page and missing in page
    assert 'data-testid="not-started"' not in page
    zh = client.get(
        reverse("cluster_detail", args=[cluster.pk]), HTTP_ACCEPT_LANGUAGE="zh-CN"
    ).content.decode()
    assert "无法启动（未收取任何费用）" in zh and f"无法将镜像 {missing} 拉取到 gpu-a-01" in zh
    assert "could not start" not in zh

    # No charge, now or ever; the GPU back for others.
    accrual.accrue(now=timezone.now() + timedelta(minutes=5))
    assert not LedgerEntry.objects.filter(cluster=cluster).exists()
    assert not Meter.objects.filter(cluster=cluster).exists()
    assert billing.account_for(alice).balance == Decimal("100")
    until(
        lambda: not GpuSlot.objects.filter(node__cluster=cluster).exists(),
        what="its GPU given back",
    )


def test_a_workspace_that_starts_late_is_billed_from_its_start_only(
    placed, client, alice, work_queue
):
    cluster = placed("late")
    node = cluster.node_set.get()
    # A billing second passes before the worker starts its workspace (a pull takes
    # minutes; a second shows it as well).
    later = node.placed_at.replace(microsecond=0) + timedelta(seconds=2)
    until(lambda: timezone.now() >= later, what="two billing seconds before the start")
    accrual.accrue()
    assert not LedgerEntry.objects.filter(cluster=cluster).exists(), "placed, not running"

    work_queue()  # its workspace starts now
    node.refresh_from_db()
    assert node.started_at is not None and node.workspace_container
    started = billing.floor_s(node.started_at)
    assert started >= later
    client.force_login(alice)
    page = client.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
    assert 'data-testid="not-started"' not in page

    accrual.accrue(now=started + timedelta(seconds=60))
    usage = LedgerEntry.objects.filter(cluster=cluster, kind="usage").order_by("period_from")
    assert usage.first().period_from == started
    assert sum(e.seconds for e in usage) == 60
    assert Meter.objects.get(cluster=cluster).billed_until == started + timedelta(seconds=60)
    services.cluster_release(cluster=cluster)
    work_queue()


def test_a_cluster_without_workspaces_is_billed_from_its_first_jobs_start(
    placed, alice, work_queue
):
    cluster = placed("jobs-only", workspace=False)
    work_queue()  # its network; no workspace
    node = cluster.node_set.get()
    assert node.started_at is None and not node.workspace_container
    later = node.placed_at.replace(microsecond=0) + timedelta(seconds=2)
    until(lambda: timezone.now() >= later, what="two billing seconds before its first job")
    accrual.accrue()
    assert not LedgerEntry.objects.filter(cluster=cluster).exists(), "no job ran yet"

    job = services.job_submit(cluster=cluster, spec=JobSpec(name="j", command="exec sleep 60"))
    dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING, job.state_reason
    node.refresh_from_db()
    replica = job.replicas.get()
    assert node.started_at is not None and node.started_at >= replica.started_at - timedelta(
        seconds=1
    )
    started = billing.floor_s(node.started_at)
    assert started >= later
    accrual.accrue(now=started + timedelta(seconds=30))
    usage = LedgerEntry.objects.filter(cluster=cluster, kind="usage")
    assert min(e.period_from for e in usage) == started
    assert sum(e.seconds for e in usage) == 30
    services.cluster_release(cluster=cluster)
    work_queue()


def test_a_running_cluster_whose_added_node_starts_does_not_read_as_starting(
    placed, client, alice, work_queue
):
    """After a resize (or a re-placement) one node is new and starting: the cluster runs and
    is charged, so it is not "starting" nor "not charged before"; that node's row says it."""
    cluster = placed("grown", nodes=2)
    first, second = cluster.node_set.order_by("index")
    Node.objects.filter(pk=first.pk).update(started_at=timezone.now())
    client.force_login(alice)
    url = reverse("cluster_detail", args=[cluster.pk])
    page = client.get(url).content.decode()
    assert 'data-testid="not-started"' not in page
    assert "You are charged from the second it runs" not in page
    assert 'badge-running big" data-testid="cluster-state"' in page
    row = page.split(f'data-node="{second.index}"', 1)[1].split("</tr>", 1)[0]
    assert "starting" in row
    zh = client.get(url, HTTP_ACCEPT_LANGUAGE="zh-CN").content.decode()
    assert "启动中" not in zh.split('id="nodes"', 1)[0]

    Node.objects.filter(cluster=cluster).update(started_at=None)  # none ran: starting
    page = client.get(url).content.decode()
    assert 'data-testid="not-started"' in page and "badge-starting big" in page
    services.cluster_release(cluster=cluster)
    work_queue()


@override_settings(SUANLI_START_GRACE_S=900)
def test_a_cluster_without_workspaces_says_its_node_waits_for_its_first_job(
    placed, client, alice, work_queue
):
    cluster = placed("jobs-only-page", workspace=False)
    client.force_login(alice)
    page = client.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
    row = page.split('data-node="0"', 1)[1].split("</tr>", 1)[0]
    assert "waiting for its first job" in row and "starting" not in row
    assert "held its GPUs 15 minutes without one" in page, "the grace the platform uses"
    services.cluster_release(cluster=cluster)
    work_queue()


def _shoot(browser, live_server, cluster, state: str, name: str) -> None:
    """The cluster page in Chinese at 1366 and 390 px: its state badge reads `state`, and
    nothing sticks out sideways; a picture of each (SUANLI_SCREENSHOTS)."""
    for width in (1366, 390):
        context = browser.new_context(
            viewport={"width": width, "height": 900}, locale="zh-CN", timezone_id="Asia/Shanghai"
        )
        page = context.new_page()
        login(page, live_server, "alice", "alice-pass-123")
        page.goto(f"{live_server.url}/clusters/{cluster.pk}/")
        expect(page.get_by_test_id("cluster-state")).to_have_text(state)
        wide = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert wide <= 0, f"{wide}px wider than the window"
        shots = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
        page.screenshot(path=os.path.join(shots, f"{name}-zh-hans-{width}.png"), full_page=True)
        context.close()


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)  # the live server's thread reads the cluster
def test_the_chinese_cluster_page_says_starting_then_why_it_failed(
    placed, browser, live_server, work_queue
):
    missing = _missing_in_registry()
    cluster = placed("zh-never-ran", image=missing)
    _shoot(browser, live_server, cluster, "启动中", "cluster-starting")
    work_queue()
    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.FAILED
    _shoot(browser, live_server, cluster, "失败", "cluster-failed-image")


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)  # the live server's thread reads the cluster
def test_the_chinese_page_of_a_cluster_without_jobs_says_when_it_is_charged(
    placed, browser, live_server, work_queue
):
    cluster = placed("zh-jobs-only", workspace=False)
    _shoot(browser, live_server, cluster, "运行中", "cluster-jobs-only-waiting")
    services.cluster_release(cluster=cluster)
    work_queue()


def test_a_workspace_that_cannot_start_for_30_minutes_fails_and_costs_nothing(
    placed, alice, work_queue
):
    """A pull that keeps failing with words a retry might mend (here: a registry this
    machine cannot reach; in life Docker Hub's rate limit, a full disk) is tried again,
    holding the GPUs; past SUANLI_START_DEADLINE_S from its placement, with no pull moving,
    the cluster fails (nothing charged) instead of holding them for ever."""
    from jobs.nodes import workspaces

    # A registry an operator allows where nothing listens (port 9, discard): the engine's
    # "connection refused" is transient, at once (a name that resolves nowhere waits 40 s on
    # DNS here; Docker Hub would say "repository does not exist" of a name never pushed:
    # final, not this case).
    image = f"127.0.0.1:9/never-pushed-{uuid.uuid4().hex[:8]}:1"
    cluster = placed("stuck", image=image)
    with override_settings(SUANLI_PULL_ALLOW_REGISTRIES=["127.0.0.1:9"]):
        work_queue()  # its workspace's start: the pull fails, to be tried again
    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.RUNNING, cluster.state_reason  # within the deadline
    pull = cluster.image_pulls["gpu-a-01"]  # the page says how its pull went
    assert pull["state"] == "failed" and "127.0.0.1:9" in pull["message"], pull

    deadline = timedelta(seconds=settings.SUANLI_START_DEADLINE_S)
    Node.objects.filter(cluster=cluster).update(
        placed_at=timezone.now() - deadline - timedelta(seconds=60)
    )
    with override_settings(SUANLI_PULL_ALLOW_REGISTRIES=["127.0.0.1:9"]):
        failed = workspaces.ensure(cluster.pk)  # the reconciler's next try
    assert failed
    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.FAILED, cluster.state_reason
    assert cluster.state_reason.startswith(
        "could not start within 30 minutes (nothing was charged): "
    ), cluster.state_reason
    assert "gpu-a-01" in cluster.state_reason
    accrual.accrue(now=timezone.now() + timedelta(hours=1))
    assert not LedgerEntry.objects.filter(cluster=cluster).exists()
    assert billing.account_for(alice).balance == Decimal("100")
    work_queue()
    until(
        lambda: not GpuSlot.objects.filter(node__cluster=cluster).exists(),
        what="its GPU given back",
    )

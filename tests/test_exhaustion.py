"""Zero balance stops, it does not release (issue 41), on the real engines: an exhausted
account's clusters are stopped with their workspaces kept (a file in the root filesystem
included), billed to the second they stopped and not a cent past one period; the
researcher is told once; a top-up starts them again with the file there; the stopped
period's release comes only after the retention period, warned a day before.

The clock is moved with time_machine (tick=False for the accrual ticks, so that each tick
and the stop it makes fall on a known second)."""

import json
import os
from datetime import timedelta
from decimal import Decimal

import pytest
import time_machine
from django.db.models import Sum
from django.test import Client
from django.urls import reverse
from django.utils import timezone, translation

from billing import accrual
from billing import services as billing
from billing.models import Account, LedgerEntry
from console.models import ApiToken
from jobs import tasks
from jobs.base.text import show
from jobs.clusters import services
from jobs.events import lifecycle, webhooks
from jobs.models import (
    Cluster,
    GpuSlot,
    Image,
    Node,
    Pool,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
)
from jobs.placement import scheduler
from jobs.pools import autoscaler
from tests.browsing import login
from tests.conftest import TEST_IMAGE
from tests.test_stop_start import _client, _last_node, _sh, _workspace
from tests.test_webhooks import Receiver

pytestmark = pytest.mark.django_db

RATE = "36.00"  # per GPU-hour: 0.01 per GPU-second


def _hook(owner, events):
    return WebhookEndpoint.objects.create(
        owner=owner, url="https://hooks.example.com/x", events=events,
        secret="whsec_" + "a" * 32,
    )  # fmt: skip


def _running(running_cluster, rate_card, fund, owner, balance, **extra):
    """A priced 1-GPU cluster with its workspace running and the second billing starts."""
    rate_card({"a100-80gb": RATE}, effective_from=timezone.now() - timedelta(hours=1))
    fund(owner, balance)
    cluster = running_cluster(1, gpus=1, owner=owner, **extra)
    tasks.cluster_network_ensure(cluster.pk)  # its workspace runs: billed from here
    node = _last_node(cluster)
    assert node.started_at is not None
    return cluster, billing.floor_s(node.started_at)


def _tick(at):
    with time_machine.travel(at, tick=False):
        return accrual.accrue()


def test_running_out_stops_keeps_a_file_in_the_root_filesystem_and_a_top_up_starts_it_again(
    running_cluster, rate_card, fund, alice, bob
):
    _hook(alice, ["balance.exhausted"])
    # Exactly 30 GPU-seconds of balance: the third 10 s tick empties it to 0.00.
    cluster, start = _running(running_cluster, rate_card, fund, alice, "0.30")
    ws = _workspace(cluster)
    host = _last_node(cluster).host
    assert _sh(ws, "echo kept > /tmp/notes.txt")[0] == 0  # not a volume: the root filesystem

    for t in (10, 20):
        assert _tick(start + timedelta(seconds=t)).exhausted == []
    report = _tick(start + timedelta(seconds=30))
    account = Account.objects.get(user=alice)
    assert report.exhausted == [account.pk]
    cluster.refresh_from_db()
    assert cluster.state == "stopped" and cluster.state_reason == accrual.EXHAUSTED
    assert cluster.stopped_at == start + timedelta(seconds=30)
    # The ledger at the edge: every covered second charged, not one more.
    assert account.balance == Decimal("0.00")
    lines = LedgerEntry.objects.filter(cluster=cluster)
    assert lines.aggregate(s=Sum("amount"))["s"] == Decimal("-0.30")
    assert lines.latest("period_to").period_to == start + timedelta(seconds=30)
    for t in (40, 100):  # later ticks: no second twice, the kept workspace not charged past 0
        assert _tick(start + timedelta(seconds=t)).exhausted == []
    assert Account.objects.get(user=alice).balance == Decimal("0.00")
    assert LedgerEntry.objects.filter(cluster=cluster).count() == lines.count()

    # Stopped as its owner's stop does: the container stopped, not removed; GPUs back.
    assert tasks.cluster_workspaces_stop(cluster.pk)
    ws.reload()
    assert ws.status == "exited", "stopped, not removed: its root filesystem is kept"
    assert not GpuSlot.objects.filter(host=host, node__isnull=False).exists(), "GPUs back"
    assert Node.objects.filter(cluster=cluster, kept_until__isnull=True).exists()

    # Told once, in words naming the cluster and the date its files are kept until.
    told = WebhookEvent.objects.get(type="balance.exhausted")
    keep_until = cluster.stopped_at + timedelta(days=15)
    with translation.override("en"):
        words = show(told.summary)
    assert cluster.name in words and "every file is kept" in words
    assert keep_until.strftime("%Y-%m-%d") in words
    with translation.override("zh-hans"):
        assert cluster.name in show(told.summary)
    data = json.loads(told.body)["data"]
    assert data["balance"] == "0.0000" and data["currency"]
    assert data["clusters"] == [
        {"id": cluster.pk, "name": cluster.name, "state": "stopped",
         "release_at": keep_until.isoformat()},
    ]  # fmt: skip
    assert data["url"].endswith(reverse("billing"))
    accrual.stop_exhausted([account.pk])  # the same exhaustion again: no second message
    assert WebhookEvent.objects.filter(type="balance.exhausted").count() == 1

    with time_machine.travel(start + timedelta(seconds=200), tick=True):
        # Its page and the API say when it is released; another researcher sees nothing.
        owner = Client()
        owner.force_login(alice)
        page = owner.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
        assert "Released in <strong>15 days</strong>" in page  # to the hour: 14 d 23 h 57 min
        assert "Stopped: balance exhausted" in page
        _, token = ApiToken.issue(user=alice, name="script")
        shown = (
            Client(HTTP_AUTHORIZATION=f"Bearer {token}")
            .get(f"/api/v1/clusters/{cluster.pk}")
            .json()
        )
        assert shown["state"] == "stopped" and shown["release_at"].startswith(
            keep_until.isoformat()[:19]
        )
        other = Client()
        other.force_login(bob)
        assert other.get(reverse("cluster_detail", args=[cluster.pk])).status_code == 404
        assert other.post(reverse("cluster_start", args=[cluster.pk])).status_code == 404
        _, bobs = ApiToken.issue(user=bob, name="script")
        assert (
            Client(HTTP_AUTHORIZATION=f"Bearer {bobs}")
            .get(f"/api/v1/clusters/{cluster.pk}")
            .status_code
            == 404
        )

        # No money, no start: the refusal says what to do.
        response = owner.post(
            reverse("cluster_start", args=[cluster.pk]), {"mode": "gpu"}, follow=True
        )
        assert "top up on the billing page" in response.content.decode()
        cluster.refresh_from_db()
        assert cluster.state == "stopped"

        # A top-up: started again, the file where it was; the next exhaustion is told again.
        fund(alice, "100")
        assert Account.objects.get(user=alice).exhausted_notified_at is None
        response = owner.post(reverse("cluster_start", args=[cluster.pk]), {"mode": "gpu"})
        assert response.status_code == 302
        cluster.refresh_from_db()
        assert cluster.state == "running", cluster.state_reason
        tasks.cluster_network_ensure(cluster.pk)
        again = _workspace(cluster)
        assert again.id == ws.id, "the same container, started again"
        assert _sh(again, "cat /tmp/notes.txt") == (0, "kept")
    services.cluster_release(cluster=cluster)
    assert tasks.cluster_network_remove(cluster.pk)


@pytest.fixture
def receiver(settings):
    """A real HTTP receiver on loopback (tests/test_webhooks.py's), allowed by the setting."""
    settings.SUANLI_WEBHOOK_ALLOW_NETS = ["127.0.0.0/8"]
    r = Receiver()
    yield r
    r.close()


def test_an_exhausted_cluster_is_kept_the_retention_period_warned_a_day_before_then_released(
    running_cluster, rate_card, fund, alice, bob, settings, client, receiver
):
    """Long because it follows one cluster through the whole retention period: stopped,
    kept and not charged, warned a day before, released at its end, and each message
    delivered to the owner's channel and read on its delivery log."""
    assert settings.SUANLI_STOPPED_RELEASE_S == 15 * 86400, "the default: 15 days"
    endpoint = WebhookEndpoint.objects.create(
        owner=alice, url=receiver.url, secret=webhooks.new_secret(),
        events=["balance.exhausted", "cluster.release_soon", "cluster.released"],
    )  # fmt: skip
    cluster, start = _running(running_cluster, rate_card, fund, alice, "0.05")
    ws = _workspace(cluster)
    assert _sh(ws, "echo kept > /tmp/notes.txt")[0] == 0
    _tick(start + timedelta(seconds=10))  # 0.10 due, 0.05 there: one period negative
    cluster.refresh_from_db()
    assert cluster.state == "stopped" and cluster.state_reason == accrual.EXHAUSTED
    assert tasks.cluster_workspaces_stop(cluster.pk)
    stopped = cluster.stopped_at
    assert Account.objects.get(user=alice).balance == Decimal("-0.05")

    def release_round(after):
        return services.clusters_release_stopped(now=stopped + after)

    # Two weeks on: kept, its file with it, and not charged (ticks on the way included).
    _tick(stopped + timedelta(days=7))
    assert release_round(timedelta(days=14, seconds=-1)) == {"released": [], "warned": []}
    assert Account.objects.get(user=alice).balance == Decimal("-0.05")
    # A day before: warned once, on its timeline and to the researcher.
    assert release_round(timedelta(days=14)) == {"released": [], "warned": [cluster.pk]}
    assert release_round(timedelta(days=14, hours=12))["warned"] == []
    cluster.refresh_from_db()
    assert cluster.release_warned_at == stopped + timedelta(days=14)
    assert cluster.events.filter(kind="release-soon").count() == 1
    soon = json.loads(WebhookEvent.objects.get(type="cluster.release_soon").body)
    assert soon["data"]["cluster"]["release_at"].startswith(
        (stopped + timedelta(days=15)).isoformat()[:19]
    )
    with time_machine.travel(stopped + timedelta(days=14, hours=12), tick=False):
        client.force_login(alice)
        listing = client.get(reverse("cluster_list")).content.decode()
        assert "released in 12 h unless started" in listing
        page = client.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
        assert "Released in <strong>12 h</strong>" in page
    ws.reload()
    assert ws.status == "exited", "still kept a second before the period ends"
    assert release_round(timedelta(days=15, seconds=-1))["released"] == []
    # Released at the end of the retention period, its workspace with it.
    assert release_round(timedelta(days=15))["released"] == [cluster.pk]
    cluster.refresh_from_db()
    assert cluster.state == "released" and "15 days stopped" in cluster.state_reason
    assert WebhookEvent.objects.filter(type="cluster.released").exists()
    assert tasks.cluster_network_remove(cluster.pk)
    assert not _client(_last_node(cluster)).containers.list(
        all=True, filters={"label": f"suanli.cluster={cluster.pk}"}
    )
    assert Account.objects.get(user=alice).balance == Decimal("-0.05"), "never more than one period"

    # The worker sends each message to the owner's channel once; the delivery log says
    # them in words.
    with time_machine.travel(stopped + timedelta(days=15, minutes=1), tick=True):
        for delivery in WebhookDelivery.objects.filter(endpoint=endpoint).order_by("pk"):
            assert webhooks.deliver(delivery.pk) == "delivered"
    sent = [json.loads(r["body"])["type"] for r in receiver.requests]
    assert sent == ["balance.exhausted", "cluster.release_soon", "cluster.released"]
    deliveries = WebhookDelivery.objects.filter(endpoint=endpoint)
    assert {(d.state, d.attempts, d.last_status) for d in deliveries} == {("succeeded", 1, 200)}
    assert WebhookAttempt.objects.filter(delivery__endpoint=endpoint, status_code=200).count() == 3
    client.force_login(alice)
    log = client.get(reverse("webhook_detail", args=[endpoint.pk]), HTTP_ACCEPT_LANGUAGE="en")
    words = " ".join(log.content.decode().split())
    assert f"Cluster {cluster.name}, stopped, is released with its files at" in words
    assert "start it or copy what you need before then" in words
    assert f"Cluster {cluster.name} ended: released automatically after 15 days stopped" in words
    assert f"Your balance ran out (-0.05 CNY). Stopped: {cluster.name}." in words
    log = client.get(reverse("webhook_detail", args=[endpoint.pk]), HTTP_ACCEPT_LANGUAGE="zh-CN")
    words = " ".join(log.content.decode().split())
    assert f"已关机的集群 {cluster.name} 将于" in words and "连同其文件一起释放" in words
    assert "关机 15 天后自动释放" in words
    client.force_login(bob)  # another researcher's channel: not found
    assert client.get(reverse("webhook_detail", args=[endpoint.pk])).status_code == 404


def test_an_exhausted_pool_releases_its_job_clusters_and_adds_none_until_a_top_up(
    running_cluster, rate_card, fund, alice, catalog
):
    """A pool's clusters are for jobs only (no workspace to keep; its jobs' files are on
    volumes): released, and the pool holds back instead of adding clusters, in words."""
    rate_card({"a100-80gb": RATE}, effective_from=timezone.now() - timedelta(hours=1))
    fund(alice, "0.05")
    cluster = running_cluster(1, gpus=1, workspace=False)
    node = _last_node(cluster)
    start = billing.floor_s(node.placed_at)
    Node.objects.filter(pk=node.pk).update(started_at=start)  # as when its first job ran
    shape = services.ClusterSpec(
        name="", nodes=1, gpu_model=catalog["a100-80gb"], gpus_per_node=1,
        image=Image.objects.get(reference=TEST_IMAGE),
    )  # fmt: skip
    pool = autoscaler.pool_create(
        owner=alice, spec=autoscaler.PoolSpec(name="train", cluster=shape, min_clusters=1),
        rate_per_hour=Decimal(RATE),
    )  # fmt: skip
    Pool.objects.filter(pk=pool.pk).update(balance=Decimal("0.05"))  # the console's last refresh
    Cluster.objects.filter(pk=cluster.pk).update(pool=pool)
    _tick(start + timedelta(seconds=10))
    cluster.refresh_from_db()
    assert cluster.state in ("releasing", "released") and cluster.state_reason == accrual.EXHAUSTED
    pool.refresh_from_db()
    assert pool.balance == Decimal("-0.05"), "the autoscaler sees the balance at once"
    autoscaler.pool_scale(pool.pk)  # below its minimum of 1, but no money
    assert not pool.clusters.filter(state__in=autoscaler.LIVE).exists()
    held = pool.events.filter(kind="held").latest("at")
    assert "top up" in held.message
    assert tasks.cluster_network_remove(cluster.pk)


SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)  # the live server's thread reads committed rows
def test_screenshots_of_the_countdown_of_a_cluster_stopped_for_balance(
    browser, live_server, make_paper_host, make_cluster, rate_card, fund, alice
):
    make_paper_host()
    rate_card({"a100-80gb": RATE}, effective_from=timezone.now() - timedelta(hours=1))
    fund(alice, "0.60")
    cluster = make_cluster(alice, "train-llm", nodes=1, gpus=1)
    scheduler.place_pending()
    Node.objects.filter(cluster=cluster).update(started_at=timezone.now() - timedelta(seconds=60))
    accrual.accrue()
    cluster.refresh_from_db()
    assert cluster.state == "stopped" and cluster.state_reason == accrual.EXHAUSTED
    # Stopped 20 h 50 min ago: 14 days 3 h (and some minutes) left.
    Cluster.objects.filter(pk=cluster.pk).update(
        stopped_at=cluster.stopped_at - timedelta(hours=20, minutes=50)
    )
    expected = {"zh-hans": "14 天 3 小时", "en": "14 days 3 h"}
    for language, locale in (("zh-hans", "zh-CN"), ("en", "en-US")):
        for width in (1366, 390):
            context = browser.new_context(viewport={"width": width, "height": 900}, locale=locale)
            page = context.new_page()
            login(page, live_server, "alice", "alice-pass-123")
            page.goto(f"{live_server.url}{reverse('cluster_detail', args=[cluster.pk])}")
            countdown = page.get_by_test_id("release-countdown").inner_text()
            assert expected[language] in countdown, countdown
            page.screenshot(
                path=os.path.join(SHOTS, f"exhausted-cluster-{language}-{width}.png"),
                full_page=True,
            )
            overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, f"{width}: {overflow}px wider than the window"
            page.goto(f"{live_server.url}{reverse('cluster_list')}")
            assert expected[language] in page.get_by_test_id("release-in").inner_text()
            page.screenshot(
                path=os.path.join(SHOTS, f"exhausted-list-{language}-{width}.png"), full_page=True
            )
            context.close()


def test_spot_waiting_and_preempting_clusters_at_exhaustion(
    make_paper_host, make_cluster, rate_card, fund, alice, settings
):
    """Spot clusters follow the same rule (a running one is stopped, files kept, even past
    the most stopped clusters a researcher may keep); a cluster that never ran and one being
    preempted keep no file of their own: released, never placed and charged again."""
    settings.SUANLI_MAX_STOPPED_CLUSTERS = 0  # her own stops would be refused: this one is not
    _hook(alice, ["balance.exhausted"])
    make_paper_host(gpus=4)
    rate_card({"a100-80gb": RATE}, effective_from=timezone.now() - timedelta(hours=1))
    fund(alice, "0.05")
    spot = make_cluster(alice, "spot", gpus=1, spot=True)
    going = make_cluster(alice, "going", gpus=1, spot=True)
    scheduler.place_pending()
    never = make_cluster(alice, "never", gpus=4)  # no room: waits to be placed
    scheduler.place_pending()
    Node.objects.filter(cluster__in=[spot, going]).update(
        started_at=timezone.now() - timedelta(seconds=60)
    )
    assert lifecycle.cluster_preempt(cluster=going, reason="capacity reclaimed")
    accrual.accrue()
    for c in (spot, going, never):
        c.refresh_from_db()
    assert spot.state == "stopped" and spot.state_reason == accrual.EXHAUSTED
    assert Node.objects.filter(cluster=spot, kept_until__isnull=True).exists()
    assert going.state in ("releasing", "released") and going.state_reason == accrual.EXHAUSTED
    assert never.state in ("releasing", "released") and never.state_reason == accrual.EXHAUSTED
    assert not LedgerEntry.objects.filter(cluster=never).exists(), "never ran, never charged"
    told = WebhookEvent.objects.get(type="balance.exhausted")
    with translation.override("en"):
        words = show(told.summary)
    assert "Stopped: spot." in words and "Released" in words
    assert "going" in words and "never" in words

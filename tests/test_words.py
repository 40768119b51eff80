"""Words that are right (issue 40): a job too short to judge says so, with its seconds; a
running job's cancel asks first; an app's message shows in its tile; a node without GPUs
names none on the timeline or the bill; the charts' times are the reader's, with a sensible
axis when there is nothing to draw; the Chinese pages hold none of the English or doubled
words a newcomer met.

Pages of rows written here (paper hosts, no container) through Django's test client, and
Chromium (Playwright) for what only a browser shows: the chart's axes and the confirmation.
"""

import os
import re
import zoneinfo
from datetime import UTC, datetime, timedelta

import pytest
import time_machine
from browsing import login
from django.urls import reverse
from django.utils import timezone

from billing import accrual
from console import preferences
from jobs.clusters import services
from jobs.models import Cluster, Job, Node, OwnImage, Replica
from monitoring.models import Sample

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 12, 1, 8, 0, 0, tzinfo=UTC)


def _cluster(owner, host, catalog, *, name="words", state=Cluster.State.RUNNING, **extra):
    cluster = Cluster.objects.create(
        owner=owner, name=name, gpu_model=catalog["a100-80gb"], nodes=1, gpus_per_node=1,
        image_reference="suanli-test:busybox", state=state, running_since=T0, **extra,
    )  # fmt: skip
    Node.objects.create(
        cluster=cluster, index=0, host=host, placed_at=T0, started_at=T0, gpu_indices=[0]
    )
    return cluster


def _job(cluster, seconds, *, state=Job.State.SUCCEEDED, gpu=True):
    ended = state in (Job.State.SUCCEEDED, Job.State.FAILED, Job.State.CANCELLED)
    job = Job.objects.create(
        cluster=cluster, owner=cluster.owner, name="short", command="python train.py", attempt=1,
        state=state, started_at=T0, finished_at=T0 + timedelta(seconds=seconds) if ended else None,
    )  # fmt: skip
    host = cluster.node_set.get(index=0).host
    Sample.objects.bulk_create(
        Sample(
            at=T0 + timedelta(seconds=s),
            cluster=cluster,
            job=job,
            host=host,
            node_index=0,
            gpu_util=[100.0] if gpu else [],
            gpu_mem_mib=[1000.0] if gpu else [],
            gpu_source="derived",
            cpu_pct=50.0,
            mem_bytes=1000,
            net_rx_bps=0.0,
            net_tx_bps=0.0,
            disk_read_bps=0.0,
            disk_write_bps=0.0,
            read_iops=0.0,
            write_iops=0.0,
        )  # fmt: skip
        for s in range(seconds)
    )
    return job


def test_a_13_second_job_is_too_short_to_judge_not_always_busy(client, alice, paper_host, catalog):
    job = _job(_cluster(alice, paper_host, catalog), 13)
    client.force_login(alice)
    page = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    assert "Too short to judge: 13 s of samples" in page
    assert "kept busy" not in page
    preferences.save(alice, language="zh-hans")
    page = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    verdict = re.search(r'data-testid="diagnosis-verdict">([^<]*)<', page)[1]
    assert "13" in verdict and "繁忙" not in verdict


def test_a_long_busy_job_still_says_no_bottleneck_and_a_job_without_gpus_names_none(
    client, alice, paper_host, catalog
):
    busy = _job(_cluster(alice, paper_host, catalog), 60)
    client.force_login(alice)
    page = client.get(reverse("job_detail", args=[busy.pk])).content.decode()
    assert "No bottleneck found in this run&#x27;s samples" in page
    no_gpu = _job(_cluster(alice, paper_host, catalog, name="cpu"), 60, gpu=False)
    page = client.get(reverse("job_detail", args=[no_gpu.pk])).content.decode()
    assert "No GPU samples in this run" in page and "kept busy" not in page


def test_a_running_jobs_cancel_button_asks_first(client, alice, paper_host, catalog):
    job = _job(_cluster(alice, paper_host, catalog), 5, state=Job.State.RUNNING)
    client.force_login(alice)
    page = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    form = re.search(r'<form method="post" action="[^"]*/cancel/"[^>]*>', page)[0]
    assert 'data-confirm="Cancel short? Its processes are stopped now' in form


def test_the_charts_times_carry_the_readers_offset(client, alice, bob, paper_host, catalog):
    job = _job(_cluster(alice, paper_host, catalog), 13)
    preferences.save(alice, time_zone="Asia/Shanghai")
    client.force_login(alice)
    data = client.get(reverse("job_metrics", args=[job.pk])).json()
    first = data["samples"][0]
    assert first["at"] == "2026-12-01T16:00:00+08:00"  # 08:00 UTC, read in Shanghai
    assert first["t"] == int(T0.timestamp())
    page = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    assert 'data-tz="Asia/Shanghai"' in page and '"at": "2026-12-01T16:00:00+08:00"' in page
    preferences.save(alice, time_zone="Europe/Berlin")
    data = client.get(reverse("job_metrics", args=[job.pk])).json()
    assert data["samples"][0]["at"] == "2026-12-01T09:00:00+01:00"
    client.force_login(bob)
    assert client.get(reverse("job_metrics", args=[job.pk])).status_code == 404


def test_a_node_without_gpus_names_no_gpu_on_the_timeline_or_the_bill(
    client, alice, paper_host, catalog, rate_card, fund
):
    rate_card({"a100-80gb": "3.60"}, effective_from=T0 - timedelta(minutes=1))
    fund(alice, "10")
    with time_machine.travel(T0, tick=False):
        cluster = _cluster(alice, paper_host, catalog)
        Node.objects.filter(cluster=cluster).update(gpu_indices=[3])
    with time_machine.travel(T0 + timedelta(seconds=60), tick=False):
        services.cluster_stop(cluster=cluster)
    with time_machine.travel(T0 + timedelta(seconds=120), tick=False):
        services.cluster_start(cluster=cluster, mode="no_gpu")
    # Its workspace runs (what the worker records): billed from here.
    Node.objects.filter(cluster=cluster, no_gpu=True).update(started_at=T0 + timedelta(seconds=120))
    accrual.accrue(now=T0 + timedelta(seconds=720))
    started = cluster.events.filter(kind="running").order_by("at", "id").last()
    assert "started without GPUs" in started.message, started.message
    assert "GPU 3" not in started.message, started.message
    client.force_login(alice)
    preferences.save(alice, language="zh-hans")
    with time_machine.travel(T0 + timedelta(seconds=800), tick=False):
        page = client.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
        bill = client.get(reverse("billing"), {"month": "2026-12"}).content.decode()
    timeline = page[page.index('<ol class="timeline">') :]
    timeline = timeline[: timeline.index("</ol>")]
    started = [li for li in timeline.split("<li>") if "无卡模式开机" in li]
    assert started and "GPU" not in started[0], started  # the new node has none
    head = bill[bill.index('id="ledger"') :]
    head = head[: head.index("</thead>")]
    assert "GPU" not in head, head  # the column counts nodes on a no-GPU line
    rows = re.findall(r'<tr data-testid="bill-line" data-kind="usage">(.*?)</tr>', bill, re.S)
    no_gpu = [r for r in rows if "无卡" in r or "no-GPU" in r]
    assert no_gpu and all("A100" not in r for r in no_gpu)


def test_an_image_saved_from_a_workspace_reads_in_the_readers_language(
    client, alice, paper_host, catalog
):
    OwnImage.objects.create(
        owner=alice, name="mine", tag="v1", reference="r/u1/mine:v1", digest="sha256:" + "a" * 64,
        size_bytes=1, source=OwnImage.Source.SAVE, source_note="saved from train-1 node 0",
        created_at=timezone.now(), updated_at=timezone.now(),
    )  # fmt: skip
    preferences.save(alice, language="zh-hans")
    client.force_login(alice)
    page = client.get(reverse("image_list")).content.decode()
    assert "saved from train-1 node 0" not in page
    assert "train-1" in page


BAD = ("网络网络", "Rank", "saved from", "node 0", "1 GPUs", "kept busy")


def _text(html: str) -> str:
    """What a reader sees of a page: no scripts, no tags, no attributes."""
    html = re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.S)
    return re.sub(r"<[^>]+>", " ", html)


def test_the_chinese_pages_hold_none_of_the_english_or_doubled_words(
    client, alice, paper_host, catalog
):
    cluster = _cluster(alice, paper_host, catalog, name="zh-words")
    job = _job(cluster, 13)
    Replica.objects.create(
        job=job, rank=0, node=cluster.node_set.get(), host=paper_host,
        container_name="suanli-words-r0", state="exited", exit_code=0,
    )  # fmt: skip
    OwnImage.objects.create(
        owner=alice, name="mine", tag="v1", reference="r/u1/mine:v1", digest="sha256:" + "b" * 64,
        size_bytes=1, source=OwnImage.Source.SAVE, source_note="saved from zh-words node 0",
    )  # fmt: skip
    preferences.save(alice, language="zh-hans")
    client.force_login(alice)
    for name, args in (
        ("job_detail", [job.pk]),
        ("cluster_detail", [cluster.pk]),
        ("image_list", []),
        ("billing", []),
    ):
        text = _text(client.get(reverse(name, args=args)).content.decode())
        found = [bad for bad in BAD if bad in text]
        assert not found, (name, found)


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)  # the live server reads the rows from its own thread
def test_in_chinese_the_charts_keep_the_readers_zone_and_the_cancel_asks(
    browser, live_server, alice, paper_host, catalog, priced
):
    """The browser says UTC, the researcher chose Asia/Shanghai: the empty chart of a job
    waiting for samples spans the last minute of Shanghai's clock (not the year 2000) and 0
    to 1 (not -1 to 6); the cancel asks, and a "no" keeps the job. Screenshots of the pages
    changed, in Chinese, at 1366 and 390 px."""
    cluster = _cluster(alice, paper_host, catalog)
    Cluster.objects.filter(pk=cluster.pk).update(running_since=timezone.now())
    running = _job(cluster, 0, state=Job.State.RUNNING)
    short = _job(_cluster(alice, paper_host, catalog, name="short-run"), 13)
    preferences.save(alice, language="zh-hans", time_zone="Asia/Shanghai")
    shots = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
    for width in (1366, 390):
        context = browser.new_context(
            viewport={"width": width, "height": 844}, locale="zh-CN", timezone_id="UTC"
        )
        page = context.new_page()
        login(page, live_server, "alice", "alice-pass-123")
        page.goto(live_server.url + reverse("job_detail", args=[running.pk]))
        page.wait_for_function("document.getElementById('chart-cpu')?.layout !== undefined")
        axes = page.evaluate(
            "() => { const l = document.getElementById('chart-cpu').layout;"
            " return [l.xaxis.range, l.yaxis.range]; }"
        )
        shanghai = (
            timezone.now().astimezone(zoneinfo.ZoneInfo("Asia/Shanghai")).strftime("%Y-%m-%d %H:")
        )
        (start, end), y = axes
        assert str(end).startswith(shanghai[:13]), (axes, shanghai)  # Shanghai's hour, not UTC's
        assert not str(start).startswith("2000") and list(y) == [0, 1], axes
        asked: list[str] = []

        def say_no(dialog, asked=asked):
            asked.append(dialog.message)
            dialog.dismiss()

        page.once("dialog", say_no)
        page.get_by_test_id("cancel-job").click()
        assert asked and "short" in asked[0], asked  # the job's name, in the question
        assert Job.objects.get(pk=running.pk).state == Job.State.RUNNING, "a no keeps it"
        page.screenshot(path=f"{shots}/words_job_running_{width}.png", full_page=True)
        page.goto(live_server.url + reverse("job_detail", args=[short.pk]))
        expect_text = page.get_by_test_id("diagnosis-verdict").inner_text()
        assert "13" in expect_text, expect_text
        page.screenshot(path=f"{shots}/words_job_short_{width}.png", full_page=True)
        for name, args in (("cluster_detail", [cluster.pk]), ("billing", []), ("image_list", [])):
            page.goto(live_server.url + reverse(name, args=args))
            page.wait_for_load_state("networkidle")
            page.screenshot(path=f"{shots}/words_{name}_{width}.png", full_page=True)
        context.close()

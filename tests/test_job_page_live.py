"""The job page follows its job: a finished job's charts hold its own samples, a page opened
while the job waits starts its live charts (and its state, attempt and timeline) when the
job starts, without a reload; charts break their lines where no samples came."""

import asyncio
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
from browsing import free_port as _free_port
from django.test import Client
from django.urls import reverse
from playwright.sync_api import expect

from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import Host, Replica
from jobs.placement import scheduler
from jobs.runs import dispatch
from monitoring.models import Sample
from monitoring.monitor import Monitor

pytestmark = pytest.mark.django_db

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
BUSY_4S = 'timeout 4 sh -c "while :; do :; done"; true'
# The GPU chart's points with a value (a null is a break in the line, not a point).
POINTS = (
    "() => document.getElementById('chart-gpu').data"
    ".reduce((n, t) => n + t.y.filter((y) => y !== null).length, 0)"
)


def _submit(cluster, command, name):
    job = services.job_submit(cluster=cluster, spec=JobSpec(name=name, command=command))
    dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    assert job.state == "running", job.state_reason
    return job


def _monitor(ticks: int) -> None:
    """The monitor's ticks, on a thread of their own (Playwright's loop runs in this one)."""

    def run():
        monitor = Monitor(publish=False)
        try:
            asyncio.run(monitor.run(ticks=ticks))
        finally:
            monitor.close()

    with ThreadPoolExecutor(1) as pool:
        pool.submit(run).result()


def _login_as_alice(page, url):
    page.goto(f"{url}/login/")
    page.fill("#id_username", "alice")
    page.fill("#id_password", "alice-pass-123")
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}/")


@pytest.mark.browser
def test_a_finished_jobs_charts_hold_its_own_samples_and_break_between_jobs(
    running_cluster, settle_until, page, live_server, alice
):
    cluster = running_cluster(1, name="charted")
    first = _submit(cluster, BUSY_4S, "first")
    _monitor(6)
    settle_until(first)
    time.sleep(7)  # nothing runs: a gap on the cluster's charts
    second = _submit(cluster, BUSY_4S, "second")
    _monitor(6)
    settle_until(second)
    assert Sample.objects.filter(job=first).exists() and Sample.objects.filter(job=second).exists()
    replica = Replica.objects.get(job=first)
    start = replica.started_at.replace(microsecond=0).timestamp() * 1000
    end = first.finished_at.timestamp() * 1000

    _login_as_alice(page, live_server.url)
    page.goto(f"{live_server.url}{reverse('job_detail', args=[first.pk])}")
    page.wait_for_function(f"({POINTS})() > 0", timeout=15_000)
    xs = page.evaluate(
        # The axis holds the reader's wall time (alice reads in UTC): back to epoch ms.
        "() => document.getElementById('chart-gpu').data.flatMap((t) => t.x.map("
        "(x) => +new Date(String(x).replace(' ', 'T') + 'Z')))"
    )
    assert xs and start <= min(xs) and max(xs) <= end, (start, xs, end)
    assert page.evaluate("() => document.getElementById('chart-cpu').data[0].x.length") > 0
    expect(page.locator("#metrics-empty")).to_be_hidden()
    expect(page.locator("#metrics-note")).to_have_text("stored history, one point a second")
    page.screenshot(path=f"{SHOTS}/job_finished_charts.png", full_page=True)

    # The cluster's page: both jobs, and no line drawn across the idle seconds between them.
    page.goto(f"{live_server.url}{reverse('cluster_detail', args=[cluster.pk])}")
    page.wait_for_function(f"({POINTS})() > 0", timeout=15_000)
    trace = page.evaluate(
        "() => { const t = document.getElementById('chart-gpu').data[0];"
        " return {x: t.x.map((x) => +new Date(String(x).replace(' ', 'T') + 'Z')), y: t.y,"
        " connectgaps: t.connectgaps}; }"
    )
    assert trace["connectgaps"] is False
    breaks = [i for i, y in enumerate(trace["y"]) if y is None]
    assert len(breaks) == 1, trace["y"]
    gap_at = trace["x"][breaks[0]]  # just after the first job's last sample
    assert start < gap_at <= Replica.objects.get(job=second).started_at.timestamp() * 1000
    page.screenshot(path=f"{SHOTS}/cluster_charts_gap.png", full_page=True)


@pytest.mark.browser
def test_pages_opened_while_waiting_start_their_charts_when_the_job_runs(
    running_cluster, make_cluster, make_host, processes, alice, browser
):
    """Procfile's web and monitor processes; the cluster is placed after the page opened."""
    port = _free_port()
    processes.start("web", env={"PORT": str(port)})
    processes.start("monitor")
    # Its host drains: the cluster waits in the queue (a size its host can hold).
    host = make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2, check="reuse")
    Host.objects.filter(pk=host.pk).update(state=Host.State.DRAINING)
    cluster = make_cluster(alice, "later")
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "pending", cluster.state
    job = services.job_submit(
        cluster=cluster,
        spec=JobSpec(
            name="waits", command='while :; do timeout 2 sh -c "while :; do :; done"; sleep 1; done'
        ),
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(50):  # the web process takes a moment to listen
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    context = browser.new_context(viewport={"width": 1366, "height": 1000})
    try:
        page = context.new_page()
        _login_as_alice(page, url)
        page.goto(f"{url}{reverse('job_detail', args=[job.pk])}")
        expect(page.get_by_test_id("job-state")).to_have_text("queued")
        expect(page.locator("#job-attempt")).to_have_text("attempt 0")
        expect(page.locator("#job-metrics")).to_be_hidden()
        page.screenshot(path=f"{SHOTS}/job_waiting.png", full_page=True)
        on_cluster = context.new_page()  # the cluster's page, open beside it
        on_cluster.goto(f"{url}{reverse('cluster_detail', args=[cluster.pk])}")
        expect(on_cluster.get_by_test_id("cluster-state")).to_have_text("pending")
        expect(on_cluster.locator("#cluster-metrics")).to_be_hidden()
        expect(on_cluster.locator("#cluster-resize")).to_contain_text("Only a running cluster")
        for p in (page, on_cluster):
            p.evaluate("() => { window.notReloaded = true; }")

        Host.objects.filter(pk=host.pk).update(state=Host.State.ACTIVE)
        scheduler.place_pending()
        cluster.refresh_from_db()
        assert cluster.state == "running", cluster.state_reason
        dispatch.dispatch(cluster.pk)

        expect(page.get_by_test_id("job-state")).to_have_text("running", timeout=15_000)
        expect(page.locator("#job-attempt")).to_have_text("attempt 1", timeout=5_000)
        expect(page.locator("#job-timeline")).to_contain_text("running", timeout=5_000)
        expect(page.locator("#job-replicas")).to_contain_text("gpu-a-01")
        expect(page.locator("#job-metrics")).to_be_visible()
        page.wait_for_function(f"({POINTS})() >= 3", timeout=30_000)
        expect(page.locator("#metrics-note")).to_have_text(
            "live, one point a second, last 10 minutes"
        )
        assert page.evaluate("() => window.notReloaded") is True
        page.screenshot(path=f"{SHOTS}/job_started_live.png", full_page=True)

        expect(on_cluster.get_by_test_id("cluster-state")).to_have_text("running")
        expect(on_cluster.locator("#nodes")).to_contain_text("gpu-a-01")
        expect(on_cluster.locator("#cluster-jobs")).to_contain_text("running")
        expect(on_cluster.locator("#cluster-resize button")).to_have_text("Resize")
        expect(on_cluster.locator("#cluster-metrics")).to_be_visible()
        on_cluster.wait_for_function(f"({POINTS})() >= 3", timeout=20_000)
        assert on_cluster.evaluate("() => window.notReloaded") is True
        on_cluster.screenshot(path=f"{SHOTS}/cluster_started_live.png", full_page=True)
    finally:
        context.close()


def test_the_job_status_part_is_the_owners(make_cluster, paper_host, alice, bob, operator):
    cluster = make_cluster(alice, "quiet")
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="j", command="true"))
    status = reverse("job_status", args=[job.pk])
    owner = Client()
    owner.force_login(alice)
    answer = owner.get(status, headers={"HX-Request": "true"})
    assert answer.status_code == 200 and "HX-Refresh" not in answer
    body = answer.content.decode()
    assert 'data-testid="job-state"' in body and ">queued<" in body
    assert 'id="job-attempt" hx-swap-oob="true"' in body and 'id="job-timeline"' in body
    stranger = Client()
    stranger.force_login(bob)
    assert stranger.get(status).status_code == 404
    assert stranger.get(reverse("job_status", args=[job.pk + 1000])).status_code == 404
    staff = Client()
    staff.force_login(operator)
    assert staff.get(status).status_code == 200
    assert Client().get(status).status_code == 302  # to the login page

    services.job_cancel(job=job, by="alice")  # never started: ends at once
    job.refresh_from_db()
    assert job.is_ended, job.state
    answer = owner.get(status, headers={"HX-Request": "true"})
    assert answer["HX-Refresh"] == "true"  # ended: the whole page, with its stored charts
    assert "hx-get" not in answer.content.decode()


@pytest.mark.django_db(transaction=True)  # the monitor reads through its executor's connections
def test_a_jobs_stored_samples_are_its_own(running_cluster, settle_until, alice, client):
    """Samples of the cluster outside the job's time range, or of another job, are not on
    its page; the page's samples carry their job."""
    import json
    import re

    cluster = running_cluster(1, name="own")
    job = _submit(cluster, BUSY_4S, "mine")
    _monitor(5)
    settle_until(job)
    replica = Replica.objects.get(job=job)
    ours = Sample.objects.filter(job=job).count()
    assert ours > 0
    template = Sample.objects.filter(job=job).first()
    for at in (replica.started_at - timedelta(minutes=5), job.finished_at + timedelta(minutes=5)):
        template.pk = None
        template.at = at
        template.save()  # the same job's id, outside its time range: not its own
    client.force_login(alice)
    page = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    history = json.loads(
        re.search(
            r'<script id="metrics-history" type="application/json">(.*?)</script>', page, re.S
        )[1]
    )
    assert len(history) == ours
    assert {s["job"] for s in history} == {job.pk}
    start, end = replica.started_at.replace(microsecond=0), job.finished_at
    assert all(start.timestamp() <= s["t"] <= end.timestamp() for s in history)


def test_the_cluster_status_part_brings_its_actions_when_the_state_changed(
    make_cluster, paper_host, alice, bob
):
    cluster = make_cluster(alice, "moving")
    status = reverse("cluster_status", args=[cluster.pk])
    owner = Client()
    owner.force_login(alice)
    same = owner.get(f"{status}?shown=pending", headers={"HX-Request": "true"})
    body = same.content.decode()
    assert 'id="cluster-jobs" hx-swap-oob="true"' in body  # the jobs, always
    assert 'id="cluster-resize"' not in body  # unchanged state: the form is left alone
    assert "?shown=pending" in body and "HX-Refresh" not in same
    changed = owner.get(f"{status}?shown=running", headers={"HX-Request": "true"}).content
    assert b'id="cluster-actions" hx-swap-oob="true"' in changed
    assert b'id="cluster-resize" hx-swap-oob="true"' in changed
    stranger = Client()
    stranger.force_login(bob)
    assert stranger.get(f"{status}?shown=pending").status_code == 404


def test_after_the_raw_seconds_are_gone_a_job_keeps_the_minutes_of_its_own_range(
    make_cluster, paper_host, alice
):
    from datetime import UTC, datetime

    from jobs.models import Job
    from monitoring import selectors
    from monitoring.models import Rollup

    cluster = make_cluster(alice, "rolled")
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="old", command="true"))
    t0 = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)
    Job.objects.filter(pk=job.pk).update(
        state=Job.State.SUCCEEDED,
        started_at=t0 + timedelta(seconds=90),
        finished_at=t0 + timedelta(seconds=200),
    )
    job.refresh_from_db()
    Rollup.objects.bulk_create(
        Rollup(
            at=t0 + timedelta(minutes=m), cluster=cluster, host=paper_host, node_index=0,
            samples=60, gpu_util=[50.0], gpu_mem_mib=[1.0], gpu_source="derived",
            cpu_pct=50.0, mem_bytes=1, net_rx_bps=0, net_tx_bps=0, disk_read_bps=0,
            disk_write_bps=0, read_iops=0, write_iops=0,
            # A minute is tagged with its last job: the one after it, for the last.
            job=job if m < 3 else None,
        )
        for m in range(5)
    )  # fmt: skip
    resolution, rows = selectors.job_rows(job)
    assert resolution == "minute"
    assert [r["at"] for r in rows] == [t0 + timedelta(minutes=m) for m in (1, 2, 3)]

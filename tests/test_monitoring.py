"""The monitor against the real Docker engines: what a replica really does shows."""

import asyncio
import os
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path

import docker
import pytest
from asgiref.sync import async_to_sync
from browsing import free_port as _free_port
from channels.testing import WebsocketCommunicator
from django.urls import reverse

from console.asgi import application
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import Node
from jobs.nodes import network
from jobs.runs import dispatch, stopping
from monitoring import dcgm, selectors, tasks
from monitoring.models import Rollup, Sample
from monitoring.monitor import Monitor

pytestmark = pytest.mark.django_db


def _submit(cluster, command, name="j"):
    job = services.job_submit(cluster=cluster, spec=JobSpec(name=name, command=command))
    dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    assert job.state == "running", job.state_reason
    return job


def _monitor(ticks: int, *, publish=False) -> Monitor:
    monitor = Monitor(publish=publish)
    try:
        asyncio.run(monitor.run(ticks=ticks))
    finally:
        monitor.close()
    return monitor


@pytest.mark.django_db(transaction=True)  # the monitor reads through its executor's connections
def test_busy_3s_sleep_2s_is_a_data_loading_bottleneck_near_5s(
    running_cluster, settle_until, client, alice, bob
):
    # No workspace: the replica has the node's whole core, so a busy phase reads ~100 %.
    cluster = running_cluster(1, workspace=False)
    job = _submit(
        cluster, 'while :; do timeout 3 sh -c "while :; do :; done"; sleep 2; done', "loader"
    )
    _monitor(36)
    samples = Sample.objects.filter(job=job).order_by("at")
    assert samples.count() >= 25
    utils = [s.gpu_util[0] for s in samples]
    assert max(utils) > 80 and min(utils) < 20, utils  # the derived GPU follows the real CPU
    findings = selectors.diagnosis(job)
    kinds = {f.kind: f for f in findings}
    assert "dataloader" in kinds, findings
    assert abs(kinds["dataloader"].period_s - 5.0) <= 1.0, kinds["dataloader"]
    assert "num_workers" in kinds["dataloader"].text

    # The finished job's page shows the finding in words and its stored charts.
    services.job_cancel(job=job, by="alice")
    stopping.stop(job.pk)  # what the queued stop task runs
    settle_until(job, states=("cancelled",))
    client.force_login(alice)
    page = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    assert "data-loading bottleneck" in page and "num_workers" in page
    assert 'id="metrics-history"' in page and '"gpu": [' in page
    assert "stored history, one point a second" in page
    client.force_login(bob)
    assert client.get(reverse("job_detail", args=[job.pk])).status_code == 404


@pytest.mark.django_db(transaction=True)  # the monitor reads through its executor's connections
def test_writes_and_network_traffic_show_as_rates(running_cluster):
    writer = _submit(
        running_cluster(1, name="writer"),
        "while :; do dd if=/dev/zero of=/tmp/f bs=1M count=8 conv=fsync 2>/dev/null; sleep 0.3; done",
        "writer",
    )
    # The sender's peer: a container on its cluster's own network (the host itself is
    # out of a tenant's reach) that swallows one long stream.
    sending = running_cluster(1, name="sender")
    node = sending.node_set.select_related("host").get()
    client = docker.DockerClient(base_url=node.host.engine_url, timeout=10)
    peer = client.containers.run(
        # stdin that never ends: busybox nc closes the connection at its stdin's EOF
        "suanli/busybox:latest", ["sh", "-c", "sleep 3600 | nc -l -p 9000 >/dev/null"],
        network=network.ensure(sending.pk), name=f"sink-{sending.pk}", detach=True,
        user="65534:65534",
    )  # fmt: skip
    try:
        sender = _submit(
            sending,
            "(while :; do dd if=/dev/zero bs=64k count=64 2>/dev/null; sleep 0.3; done) | "
            f"nc sink-{sending.pk} 9000",
            "sender",
        )
        _monitor(6)
        # The engine's own count of what reached the peer: the bytes really left.
        stats = peer.stats(stream=False)
    finally:
        peer.remove(force=True)
        client.close()
    received = sum(n["rx_bytes"] for n in stats.get("networks", {}).values())
    wrote = Sample.objects.filter(job=writer)
    assert wrote.count() >= 3
    assert max(s.disk_write_bps for s in wrote) > 1_000_000
    assert max(s.write_iops for s in wrote) > 0
    sent = Sample.objects.filter(job=sender)
    assert received > 1_000_000
    assert max(s.net_tx_bps for s in sent) > 500_000
    assert max(s.disk_write_bps for s in sent) < max(s.disk_write_bps for s in wrote)


@pytest.mark.django_db(transaction=True)  # the monitor, the consumer: their own connections
def test_live_samples_reach_the_owner_and_not_another_researcher(running_cluster, alice, bob):
    cluster = running_cluster(1)
    _submit(cluster, "while :; do :; done")

    async def scenario():
        mine = WebsocketCommunicator(
            application,
            f"/ws/clusters/{cluster.pk}/metrics/",
            headers=[(b"origin", b"http://localhost")],
        )
        mine.scope["user"] = alice
        connected, _ = await mine.connect()
        assert connected
        theirs = WebsocketCommunicator(
            application,
            f"/ws/clusters/{cluster.pk}/metrics/",
            headers=[(b"origin", b"http://localhost")],
        )
        theirs.scope["user"] = bob
        refused, code = await theirs.connect()
        assert not refused and code == 4404
        monitor = Monitor(publish=True)
        try:
            await monitor.run(ticks=3)
        finally:
            monitor.close()
        message = await mine.receive_json_from(timeout=5)
        assert message["samples"][0]["node"] == 0
        assert message["samples"][0]["cpu_pct"] > 50
        await mine.disconnect()

    async_to_sync(scenario)()


def test_the_dcgm_exporter_parser_reads_a_real_scrape():
    text = (Path(__file__).parent / "data" / "dcgm-exporter-a100x2.prom").read_text()
    gpus = dcgm.parse(text)
    assert sorted(gpus) == [0, 1]
    assert gpus[0].util == 97 and gpus[1].util == 41
    assert gpus[0].fb_used_mib == 72147 and gpus[1].fb_used_mib == 31046
    assert gpus[1].uuid == "GPU-8c4e2b19-d3a7-4f60-b15e-6e2d9f0a7c33"


def test_the_dcgm_parser_skips_what_is_not_a_reading():
    text = (
        "# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).\n"
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",modelName="A \\"quoted\\", name"} 55 1733212800000\n'
        'DCGM_FI_DEV_GPU_UTIL{UUID="no-index"} 99\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="1"} NaN\n'
        "garbage line\n"
    )
    gpus = dcgm.parse(text)
    assert list(gpus) == [0] and gpus[0].util == 55


def _sample(cluster, node, at, **values):
    host = Node.objects.get(cluster=cluster, index=node).host
    base = dict(
        gpu_util=[50.0],
        gpu_mem_mib=[1000.0],
        gpu_source="derived",
        cpu_pct=50.0,
        mem_bytes=1000,
        net_rx_bps=0.0,
        net_tx_bps=0.0,
        disk_read_bps=0.0,
        disk_write_bps=0.0,
        read_iops=0.0,
        write_iops=0.0,
    )
    base.update(values)
    return Sample(at=at, cluster=cluster, host=host, node_index=node, **base)


def test_finished_minutes_roll_up_once_and_old_samples_are_pruned(running_cluster, settings):
    cluster = running_cluster(1)
    t0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
    Sample.objects.bulk_create(
        [
            _sample(cluster, 0, t0 + timedelta(seconds=s), gpu_util=[float(s % 2) * 100])
            for s in range(120)
        ]
        + [_sample(cluster, 0, t0 + timedelta(seconds=130), gpu_util=[10.0])]  # a minute still open
    )
    made = tasks.rollup(now=t0 + timedelta(seconds=150))
    assert made == 2
    assert tasks.rollup(now=t0 + timedelta(seconds=150)) == 0  # replayed: nothing new
    first = Rollup.objects.get(at=t0)
    assert first.samples == 60 and first.gpu_util == [50.0] and first.cpu_pct == 50.0
    settings.SUANLI_METRICS_RAW_HOURS = 24
    settings.SUANLI_METRICS_ROLLUP_DAYS = 30
    raw, minutes = tasks.prune(now=t0 + timedelta(hours=24, seconds=61))
    assert raw == 61 and Sample.objects.count() == 60  # the first minute's seconds are gone
    assert minutes == 0 and Rollup.objects.count() == 2
    _, minutes = tasks.prune(now=t0 + timedelta(days=31))
    assert minutes == 2


def test_the_fleet_page_is_for_operators(running_cluster, client, alice, operator):
    cluster = running_cluster(1)
    now = datetime.now(UTC).replace(microsecond=0)
    Sample.objects.bulk_create([_sample(cluster, 0, now - timedelta(seconds=1), gpu_util=[3.0])])
    client.force_login(alice)
    assert client.get(reverse("ops_fleet_data")).status_code == 302  # to the admin login
    client.force_login(operator)
    data = client.get(reverse("ops_fleet_data")).json()
    host = next(h for h in data["hosts"] if h["held"])
    assert [g["util"] for g in host["gpus"] if g["held"]] == [3.0]
    assert all(g["util"] is None and not g["held"] for g in host["gpus"] if g["cluster"] == "")
    assert data["rented_gpus"] == 1 and data["idle_rented_gpus"] == 1  # 3 % is idle
    assert b"rented GPUs idle" in client.get(reverse("ops_fleet")).content


@pytest.mark.browser
def test_the_live_chart_gains_points_and_the_socket_is_the_owners(
    running_cluster, processes, alice, bob
):
    """The Procfile's web and monitor processes: a real websocket client, then Chromium."""
    import json
    import time

    from django.test import Client
    from playwright.sync_api import expect, sync_playwright
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    port = _free_port()
    processes.start("web", env={"PORT": str(port)})
    processes.start("monitor")
    cluster = running_cluster(1, name="watched")
    job = _submit(
        cluster, 'while :; do timeout 2 sh -c "while :; do :; done"; sleep 1; done', "busy"
    )
    url = f"http://127.0.0.1:{port}"
    ws_url = f"ws://127.0.0.1:{port}/ws/clusters/{cluster.pk}/metrics/"

    def cookie(user):
        c = Client()
        c.force_login(user)
        return f"sessionid={c.cookies['sessionid'].value}"

    for _ in range(50):  # the web process takes a moment to listen
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    with connect(ws_url, origin=url, additional_headers={"Cookie": cookie(alice)}) as ws:
        message = json.loads(ws.recv(timeout=15))
        assert message["samples"][0]["job"] == job.pk
    with pytest.raises(Exception) as refused:  # another researcher: closed before any sample
        with connect(ws_url, origin=url, additional_headers={"Cookie": cookie(bob)}) as ws:
            ws.recv(timeout=5)
    assert not isinstance(refused.value, TimeoutError)
    with pytest.raises(InvalidStatus):  # a foreign origin is refused at the handshake
        connect(ws_url, origin="http://evil.example", additional_headers={"Cookie": cookie(alice)})

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=os.environ.get("SUANLI_CHROMIUM", "/usr/bin/chromium"),
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        page = browser.new_page(viewport={"width": 1366, "height": 1000})
        page.goto(f"{url}/login/")
        page.fill("#id_username", "alice")
        page.fill("#id_password", "alice-pass-123")
        page.click("button[type=submit]")
        page.wait_for_url(f"{url}/")
        page.goto(f"{url}{reverse('job_detail', args=[job.pk])}")
        points = (
            "() => document.getElementById('chart-gpu').data.reduce((n, t) => n + t.x.length, 0)"
        )
        page.wait_for_function(f"({points})() > 0", timeout=20_000)
        before = page.evaluate(points)
        page.wait_for_function(f"({points})() >= {before + 3}", timeout=20_000)
        expect(page.locator("#metrics-note")).to_contain_text("live")
        expect(page.locator("#chart-gpu")).to_contain_text("70 % target")
        page.screenshot(
            path=os.environ.get("SUANLI_SCREENSHOTS", "/tmp") + "/job_metrics.png", full_page=True
        )
        browser.close()

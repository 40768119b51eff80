"""Stop and start (关机 / 开机), no-GPU mode (无卡模式) and the stopped period's release, on
the real engines: a stop keeps each workspace's own filesystem on its host, gives the GPUs
back and stops their charge; a start comes back on the same hosts (jobs/clusters/services.py)."""

import json
import os
import re
from datetime import timedelta

import docker
import pytest
from django.core.exceptions import ValidationError
from django.db import transaction
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from playwright.sync_api import expect

from billing import accrual
from billing import services as billing
from billing.models import LedgerEntry
from jobs import tasks
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import Cluster, GpuSlot, Job, Node, WebhookEndpoint, WebhookEvent
from jobs.nodes import workspaces
from jobs.placement import fleet, scheduler, slots
from tests.browsing import login
from tests.conftest import TEST_IMAGE

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")

pytestmark = pytest.mark.django_db


def _client(node: Node) -> docker.DockerClient:
    return docker.DockerClient(base_url=node.host.engine_url, timeout=10)


def _last_node(cluster: Cluster, index: int = 0) -> Node:
    return (
        Node.objects.filter(cluster=cluster, index=index)
        .select_related("host")
        .order_by("-pk")
        .first()
    )


def _workspace(cluster: Cluster, index: int = 0):
    node = _last_node(cluster, index)
    return _client(node).containers.get(workspaces.container_name(cluster.pk, index))


def _sh(container, script: str) -> tuple[int, str]:
    code, out = container.exec_run(
        ["/bin/sh", "-c", script], user=container.attrs["Config"]["User"]
    )
    return code, out.decode().strip()


def _gpu_seconds(cluster: Cluster) -> int:
    """The GPU-seconds charged to `cluster`: its GPU usage entries, seconds x GPUs."""
    return sum(
        e.units * int((e.period_to - e.period_from).total_seconds())
        for e in LedgerEntry.objects.filter(cluster=cluster, kind="usage", gpu_model__isnull=False)
    )


def test_a_file_outside_the_volumes_survives_stop_and_start_and_the_gpus_serve_others_meanwhile(
    running_cluster, make_cluster, bob, alice, priced, client
):
    cluster = running_cluster(1, gpus=2)  # a whole host's GPUs
    host = _last_node(cluster).host
    tasks.cluster_network_ensure(cluster.pk)
    before = _workspace(cluster)
    assert _sh(before, "echo kept > /tmp/notes.txt && mkdir -p /tmp/p && echo 1 > /tmp/p/a")[0] == 0
    queued = services.job_submit(cluster=cluster, spec=JobSpec(name="later", command="sleep 60"))
    accrual.accrue()

    services.cluster_stop(cluster=cluster, by="alice")
    cluster.refresh_from_db()
    stopped_at = cluster.stopped_at
    assert cluster.state == "stopped" and stopped_at is not None
    queued.refresh_from_db()
    assert queued.state == Job.State.CANCELLED, "jobs are cancelled as on release"
    # Held until the engine confirms its workspace stopped (no process of it on them).
    assert GpuSlot.objects.filter(host=host, node__cluster=cluster).count() == 2
    assert tasks.cluster_workspaces_stop(cluster.pk)
    assert not GpuSlot.objects.filter(host=host, node__isnull=False).exists(), "GPUs back"
    before.reload()
    assert before.status == "exited", "stopped, not removed"
    assert cluster.events.filter(kind="stopped").exists()

    # Meanwhile the GPUs are another researcher's: bob's 2 x 2 takes both hosts.
    other = make_cluster(bob, "bobs", nodes=2, gpus=2, release_policy="never")
    scheduler.place_pending()
    other.refresh_from_db()
    assert other.state == "running", other.state_reason
    with pytest.raises(services.StartBlocked, match=f"{host.name}.*in use by other clusters"):
        services.cluster_start(cluster=cluster)
    client.force_login(alice)
    page = client.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
    assert "in use by other clusters" in page
    assert "Wait in line for its GPUs" in page and "Start without GPUs" in page
    assert 'data-testid="release-countdown"' in page

    services.cluster_start(cluster=cluster, mode="wait", by="alice")
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "pending" and host.name in cluster.state_reason, cluster.state_reason
    # Changed her mind: out of the line (stopped again, files kept), then in line again.
    client.post(reverse("cluster_stop", args=[cluster.pk]))
    cluster.refresh_from_db()
    assert cluster.state == "stopped" and cluster.stopped_at == stopped_at
    services.cluster_start(cluster=cluster, mode="wait", by="alice")
    scheduler.place_pending()
    services.cluster_release(cluster=other)
    assert tasks.cluster_network_remove(other.pk)  # its GPUs back once the engine confirms
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    node = _last_node(cluster)
    assert node.host_id == host.pk and node.released_at is None
    assert sorted(node.gpu_indices) == [0, 1]
    assert cluster.stopped_at is None

    tasks.cluster_network_ensure(cluster.pk)
    after = _workspace(cluster)
    assert after.id == before.id, "the same container, started again"
    assert after.status == "running"
    assert _sh(after, "cat /tmp/notes.txt /tmp/p/a") == (0, "kept\n1")

    node.refresh_from_db()
    started = node.started_at  # its workspace's start again: billed from there
    until = billing.floor_s(started + timedelta(seconds=5))
    accrual.accrue(now=until)
    # In billing's whole seconds: 2 GPUs from the first start to the stop, and again from
    # the start on; none while stopped. (A stop and a start within one second leave one
    # entry across them, of the seconds that ran: so the seconds are counted, not entries.)
    first = Node.objects.filter(cluster=cluster).order_by("pk").first().started_at
    ran = (billing.floor_s(stopped_at) - billing.floor_s(first)) + (
        until - billing.floor_s(started)
    )
    assert _gpu_seconds(cluster) == 2 * int(ran.total_seconds()), "no GPU charge while stopped"
    services.cluster_release(cluster=cluster)
    assert tasks.cluster_network_remove(cluster.pk)


def test_start_without_gpus_has_no_gpus_small_limits_its_price_and_no_jobs(
    running_cluster, alice, priced, client, settings
):
    settings.SUANLI_WORKSPACE_MAX_LAYERS = 2  # the second save is flattened
    cluster = running_cluster(1, gpus=2)
    host = _last_node(cluster).host
    tasks.cluster_network_ensure(cluster.pk)
    first = _workspace(cluster)
    assert _sh(first, "echo mine > /tmp/notes.txt")[0] == 0
    services.cluster_stop(cluster=cluster)
    assert tasks.cluster_workspaces_stop(cluster.pk)

    services.cluster_start(cluster=cluster, mode="no_gpu")
    cluster.refresh_from_db()
    assert cluster.state == "running" and cluster.no_gpu
    node = _last_node(cluster)
    assert node.no_gpu and node.gpu_indices == [] and node.host_id == host.pk
    assert not GpuSlot.objects.filter(host=host, node__isnull=False).exists()
    tasks.cluster_network_ensure(cluster.pk)
    ws = _workspace(cluster)
    assert ws.id != first.id, "made again for no GPUs, from its own filesystem"
    host_config = ws.attrs["HostConfig"]
    assert not host_config.get("DeviceRequests")
    assert host_config["NanoCpus"] == 10**9 and host_config["Memory"] == 4096 * 2**20
    env = dict(line.split("=", 1) for line in ws.attrs["Config"]["Env"])
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert host_config["CapDrop"] == ["ALL"] and ws.attrs["Config"]["User"] != "0"
    assert _sh(ws, "cat /tmp/notes.txt") == (0, "mine")
    with pytest.raises(ValidationError, match="without GPUs"):
        services.job_submit(cluster=cluster, spec=JobSpec(name="x", command="true"))
    # Its host coming back after a blip places it again as it was: without GPUs.
    with transaction.atomic():
        back = slots.replace_node(node, host_id=host.pk, now=timezone.now(), same_slots=True)
    assert back.no_gpu and back.gpu_indices == []
    tasks.cluster_network_ensure(cluster.pk)  # its workspace found running: billed again
    assert Node.objects.get(pk=back.pk).started_at is not None
    # No jobs to measure idleness by: the idle policy leaves it alone.
    Cluster.objects.filter(pk=cluster.pk).update(release_policy="idle", idle_minutes=1)
    assert services.clusters_release_idle(now=timezone.now() + timedelta(hours=1)) == []
    client.force_login(alice)
    page = client.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
    assert 'data-testid="no-gpu"' in page

    accrual.accrue(now=node.placed_at + timedelta(seconds=30))
    lines = LedgerEntry.objects.filter(
        cluster=cluster, period_from__gte=billing.floor_s(node.placed_at)
    )
    assert lines.exists() and all(e.memo == "no-GPU mode" and e.gpu_model_id is None for e in lines)

    # Back to GPUs: stop, start; the same files.
    services.cluster_stop(cluster=cluster)
    assert tasks.cluster_workspaces_stop(cluster.pk)
    services.cluster_start(cluster=cluster)
    tasks.cluster_network_ensure(cluster.pk)
    back = _workspace(cluster)
    env = dict(line.split("=", 1) for line in back.attrs["Config"]["Env"])
    assert env["CUDA_VISIBLE_DEVICES"] in ("0,1", "1,0")
    assert _sh(back, "cat /tmp/notes.txt") == (0, "mine")
    saved = _client(node).images.get(workspaces.keep_image(cluster.pk, 0))
    assert len(saved.history()) == 1, "flattened past the layer bound, files kept"
    assert back.attrs["Config"]["Entrypoint"] == workspaces.KEEP_UP
    assert _sh(back, "id -u")[1] == back.attrs["Config"]["User"].split(":")[0]

    # A save of no live or kept node (a release whose host was down) is swept.
    engine = _client(node)
    engine.images.get(TEST_IMAGE).tag("suanli-keep/c99999-n0", "latest")
    workspaces.sweep(node.host, engine)
    assert not engine.images.list(name="suanli-keep/c99999-n0")
    assert engine.images.list(name=f"suanli-keep/c{cluster.pk}-n0"), "its own save stays"

    services.cluster_release(cluster=cluster)
    assert tasks.cluster_network_remove(cluster.pk)
    assert not engine.containers.list(all=True, filters={"name": f"suanli-ws-c{cluster.pk}-"})
    assert not engine.images.list(name=f"suanli-keep/c{cluster.pk}-n*"), "saved layers removed"


def test_a_stopped_cluster_is_warned_then_released_with_its_workspaces(
    running_cluster, alice, settings
):
    settings.SUANLI_STOPPED_RELEASE_S = 3
    WebhookEndpoint.objects.create(
        owner=alice,
        url="https://hooks.example.com/x",
        events=["cluster.stopped", "cluster.release_soon", "cluster.released"],
        secret="whsec_" + "a" * 32,
    )
    cluster = running_cluster(1, gpus=1)
    tasks.cluster_network_ensure(cluster.pk)
    services.cluster_stop(cluster=cluster)
    assert tasks.cluster_workspaces_stop(cluster.pk)
    cluster.refresh_from_db()
    at = cluster.stopped_at

    assert services.clusters_release_stopped(now=at + timedelta(seconds=1)) == {
        "released": [],
        "warned": [cluster.pk],
    }
    assert services.clusters_release_stopped(now=at + timedelta(seconds=2))["warned"] == []
    assert cluster.events.filter(kind="release-soon").count() == 1
    soon = json.loads(WebhookEvent.objects.get(type="cluster.release_soon").body)
    assert soon["data"]["cluster"]["release_at"].startswith(
        (at + timedelta(seconds=3)).isoformat()[:19]
    )
    assert WebhookEvent.objects.filter(type="cluster.stopped").exists()

    assert services.clusters_release_stopped(now=at + timedelta(seconds=4))["released"] == [
        cluster.pk
    ]
    cluster.refresh_from_db()
    assert cluster.state == "released" and "days stopped" in cluster.state_reason
    assert WebhookEvent.objects.filter(type="cluster.released").exists()
    assert tasks.cluster_network_remove(cluster.pk)
    assert not _client(_last_node(cluster)).containers.list(
        all=True, filters={"label": f"suanli.cluster={cluster.pk}"}
    )
    assert (
        not Node.objects.filter(cluster=cluster, kept_until__isnull=True)
        .exclude(stopped_at__isnull=True)
        .exists()
    )


def test_stopped_workspaces_are_kept_by_the_reconciler_and_refused_to_logins(running_cluster, bob):
    cluster = running_cluster(1, gpus=1)
    tasks.cluster_network_ensure(cluster.pk)
    services.cluster_stop(cluster=cluster)
    assert tasks.cluster_workspaces_stop(cluster.pk)
    ws = _workspace(cluster)
    host = _last_node(cluster).host
    assert fleet.hosts_with_occupancy().get(pk=host.pk).kept_count == 1, "ops see it"
    ws.start()  # as if a racing task had started it: the sweep stops it again, keeps it
    node = _last_node(cluster)
    workspaces.sweep(node.host, _client(node))
    ws.reload()
    assert ws.status == "exited"
    cluster.refresh_from_db()
    with pytest.raises(workspaces.WorkspaceError, match="stopped: start it"):
        workspaces.live_node(cluster, 0)
    with pytest.raises(ValidationError, match="Only a running cluster can be stopped"):
        services.cluster_stop(cluster=cluster)  # already stopped: a plain refusal
    # A job still stopping (its replicas in their grace period) holds the start back: its
    # end would otherwise release the cluster under the after-last-job policy.
    job = Job.objects.create(
        cluster=cluster, owner=cluster.owner, name="stopping", command="sleep 60",
        state=Job.State.RUNNING, cancel_requested=True,
    )  # fmt: skip
    with pytest.raises(ValidationError, match="still stopping"):
        services.cluster_start(cluster=cluster)
    Job.objects.filter(pk=job.pk).update(state=Job.State.CANCELLED)
    services.cluster_release(cluster=cluster)
    assert tasks.cluster_network_remove(cluster.pk)


def test_the_page_and_the_api_stop_and_start_for_the_owner_only(
    running_cluster, alice, bob, client
):
    cluster = running_cluster(1, gpus=1)
    tasks.cluster_network_ensure(cluster.pk)
    client.force_login(bob)
    assert client.post(reverse("cluster_stop", args=[cluster.pk])).status_code == 404
    client.force_login(alice)
    page = client.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
    assert 'data-testid="stop"' in page and "jobs are cancelled" in page
    response = client.post(reverse("cluster_stop", args=[cluster.pk]), follow=True)
    assert "stopped" in response.content.decode()
    cluster.refresh_from_db()
    assert cluster.state == "stopped"
    client.force_login(bob)
    assert client.post(reverse("cluster_start", args=[cluster.pk])).status_code == 404
    client.force_login(alice)
    response = client.post(reverse("cluster_start", args=[cluster.pk]), {"mode": "gpu"})
    assert response.status_code == 302
    cluster.refresh_from_db()
    assert cluster.state == "running" and not cluster.no_gpu
    services.cluster_release(cluster=cluster)
    assert tasks.cluster_network_remove(cluster.pk)


@pytest.mark.browser
def test_a_blocked_start_offers_both_choices_in_chromium(
    running_cluster, make_cluster, alice, bob, priced, live_server, browser
):
    cluster = running_cluster(1, gpus=2)
    tasks.cluster_network_ensure(cluster.pk)
    services.cluster_stop(cluster=cluster)
    assert tasks.cluster_workspaces_stop(cluster.pk)
    make_cluster(bob, "bobs", nodes=2, gpus=2, release_policy="never")
    scheduler.place_pending()
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    try:
        page = context.new_page()
        login(page, live_server, "alice", "alice-pass-123")
        page.goto(f"{live_server.url}{reverse('cluster_detail', args=[cluster.pk])}")
        expect(page.get_by_test_id("cluster-state")).to_have_text("stopped")
        blocked = page.get_by_test_id("start-blocked")
        expect(blocked).to_contain_text("in use by other clusters")
        expect(page.get_by_test_id("release-countdown")).to_contain_text("unless started again")
        expect(page.get_by_test_id("start")).to_have_count(0)  # not offered while blocked
        page.screenshot(path=f"{SHOTS}/cluster_stopped_blocked.png", full_page=True)
        blocked.get_by_role("button", name="Start without GPUs").click()
        # placed again without GPUs: "starting" until its workspace runs (no worker here)
        expect(page.get_by_test_id("cluster-state")).to_have_text(re.compile("starting|running"))
        expect(page.get_by_test_id("no-gpu")).to_contain_text("without GPUs")
        page.screenshot(path=f"{SHOTS}/cluster_no_gpu.png", full_page=True)
    finally:
        context.close()
    services.cluster_release(cluster=cluster)
    assert tasks.cluster_network_remove(cluster.pk)


def test_another_researcher_can_neither_stop_start_nor_run_a_saved_workspace(
    running_cluster, make_cluster, alice, bob, priced
):
    from console.models import ApiToken

    cluster = running_cluster(1, gpus=1)
    _, bobs = ApiToken.issue(user=bob, name="bob")
    api = Client(HTTP_AUTHORIZATION=f"Bearer {bobs}")
    for verb in ("stop", "start"):
        response = api.post(f"/api/v1/clusters/{cluster.pk}/{verb}", "{}", "application/json")
        assert response.status_code == 404 and response.json()["error"] == "Not found."
    cluster.refresh_from_db()
    assert cluster.state == "running"
    # The image a stop saves a workspace's files into is never a cluster's image.
    for reference in (f"suanli-keep/c{cluster.pk}-n0", f"docker.io/suanli-keep/c{cluster.pk}-n0"):
        body = {"name": "thief", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
                "image": reference, "volumes": []}  # fmt: skip
        response = api.post("/api/v1/clusters", json.dumps(body), "application/json")
        assert response.status_code == 400, response.json()
        assert "saved by Suanli" in json.dumps(response.json())
    # Nor by an image ID prefix, which the engine resolves to any image on the host.
    for reference in ("2", "249a", "sha256:249aa2", "DEADBEEF"):
        body = {"name": "thief", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
                "image": reference, "volumes": []}  # fmt: skip
        response = api.post("/api/v1/clusters", json.dumps(body), "application/json")
        assert response.status_code == 400, (reference, response.json())
        assert not Cluster.objects.filter(name="thief").exists()
    services.cluster_release(cluster=cluster)


def test_bounds_on_stopped_clusters_and_on_workspaces_without_gpus(running_cluster, settings):
    settings.SUANLI_MAX_STOPPED_CLUSTERS = 1
    settings.SUANLI_NO_GPU_PER_HOST = 0
    first = running_cluster(1, gpus=1, name="first")
    second = running_cluster(1, gpus=1, name="second")
    services.cluster_stop(cluster=first)
    with pytest.raises(ValidationError, match="keep 1 stopped clusters already"):
        services.cluster_stop(cluster=second)
    second.refresh_from_db()
    assert second.state == "running", "refused whole"
    with pytest.raises(ValidationError, match="workspaces without GPUs already, the most"):
        services.cluster_start(cluster=first, mode="no_gpu")
    settings.SUANLI_NO_GPU_PER_HOST = 1
    services.cluster_start(cluster=first, mode="no_gpu")
    first.refresh_from_db()
    assert first.state == "running" and first.no_gpu
    for cluster in (first, second):
        services.cluster_release(cluster=cluster)

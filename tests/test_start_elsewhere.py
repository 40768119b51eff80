"""Researchers' files across hosts, and a stopped instance that starts on another host when
its own has no free GPUs (issue 38), on the real engines a and b, each a machine of its own
with the fleet's distributed filesystem (MooseFS) mounted at the storage root:

* a file written under /workspace (a storage volume) on host a is read on host b, by a
  workspace of another cluster and by the other rank of a 2-node job;
* a stop pushes each workspace's root filesystem to the registry; a start that finds the
  host full starts on the other host with its files and its system disk, and says why;
* the saves are the owner's alone, and gone from the registry and the hosts at release.
"""

import json

import docker
import pytest
from django.test import Client
from django.urls import reverse

from jobs import tasks
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.files.storage import VolumeSpec
from jobs.hosts import services as host_services
from jobs.models import Cluster, Host, Node
from jobs.nodes import registry, workspaces
from jobs.placement import scheduler
from jobs.runs import dispatch

pytestmark = pytest.mark.django_db

WORK = (VolumeSpec("work", "/workspace"),)


def _node(cluster: Cluster, index: int = 0) -> Node:
    return (
        Node.objects.filter(cluster=cluster, index=index)
        .select_related("host")
        .order_by("-pk")
        .first()
    )


def _engine(host: Host) -> docker.DockerClient:
    return docker.DockerClient(base_url=host.engine_url, timeout=30)


def _sh(container, script: str) -> tuple[int, str]:
    code, out = container.exec_run(
        ["/bin/sh", "-c", script], user=container.attrs["Config"]["User"]
    )
    return code, out.decode().strip()


def _workspace(cluster: Cluster, index: int = 0):
    node = _node(cluster, index)
    return _engine(node.host).containers.get(workspaces.container_name(cluster.pk, index))


def _workspaces_on(host: Host, cluster: Cluster) -> list:
    return _engine(host).containers.list(
        all=True, filters={"label": [workspaces.LABEL, f"suanli.cluster={cluster.pk}"]}
    )


def _save_tags(cluster: Cluster, index: int = 0) -> list[str]:
    path, _tag = registry.split(workspaces.save_reference(cluster.owner_id, cluster.pk, index))
    return registry.tags(path)


def _only_on(make_cluster, host: Host, owner, name: str) -> Cluster:
    """Another researcher's cluster of one node with both GPUs of `host` (the other host
    drained while it is placed)."""
    others = list(Host.objects.exclude(pk=host.pk))
    for other in others:
        host_services.host_set_draining(host=other, draining=True)
    try:
        cluster = make_cluster(owner, name, nodes=1, gpus=2, release_policy="never")
        scheduler.place_pending()
    finally:
        for other in others:
            host_services.host_set_draining(host=other, draining=False)
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    assert _node(cluster).host_id == host.pk
    return cluster


def _stopped_with_files(running_cluster) -> tuple[Cluster, Host]:
    """Alice's 1 x 2 cluster with a file in its system disk and one in /workspace, stopped,
    its root filesystem saved to the registry. Returns it and the host that keeps it."""
    cluster = running_cluster(1, gpus=2, volumes=WORK)
    host = _node(cluster).host
    tasks.cluster_network_ensure(cluster.pk)
    ws = _workspace(cluster)
    wrote = _sh(ws, "echo system-disk > /tmp/keep.txt && echo volume > /workspace/data.txt")
    assert wrote[0] == 0, wrote

    services.cluster_stop(cluster=cluster, by="alice")
    assert tasks.cluster_workspaces_stop(cluster.pk)
    assert tasks.cluster_workspaces_save(cluster.pk)
    kept = _node(cluster)
    repository = workspaces.save_reference(cluster.owner_id, cluster.pk, 0).rsplit(":", 1)[0]
    assert kept.saved_image.startswith(f"{repository}@sha256:"), kept.saved_image
    assert f"/u{cluster.owner_id}/" in repository, "in its owner's namespace of the registry"
    assert _save_tags(cluster) == ["latest"]
    # The host keeps the stopped workspace and no copy of the save.
    assert [c.status for c in _workspaces_on(host, cluster)] == ["exited"]
    assert not _engine(host).images.list(name=kept.saved_image.partition("@")[0])
    return cluster, host


def _files_came_along(cluster: Cluster, host: Host) -> Host:
    """The started cluster's workspace runs on another host than `host`, with both files;
    nothing of it is left on `host`. Returns the host it runs on."""
    made = tasks.cluster_network_ensure(cluster.pk)
    assert "; workspace" not in made, made
    node = _node(cluster)
    assert node.host_id != host.pk and node.released_at is None
    ws = _workspace(cluster)
    assert ws.status == "running"
    assert _sh(ws, "cat /tmp/keep.txt /workspace/data.txt") == (0, "system-disk\nvolume")
    assert ws.attrs["Config"]["Entrypoint"] == workspaces.KEEP_UP
    assert ws.attrs["HostConfig"]["CapDrop"] == ["ALL"]
    assert _sh(ws, "id -u")[1] == ws.attrs["Config"]["User"].split(":")[0] != "0"
    events = [e.message for e in cluster.events.order_by("at", "pk")]
    assert any(f"onto {node.host.name}" in m for m in events), events  # pulled, with progress
    node.refresh_from_db()
    assert node.saved_image == "", "its files live in its workspace now"
    assert _save_tags(cluster) == [], "the save it was made from is deleted"
    assert _workspaces_on(host, cluster) == [], "the old workspace left the full host"
    return node.host


def test_a_stopped_cluster_whose_host_is_full_starts_on_the_other_with_its_files(
    running_cluster, make_cluster, alice, bob, client
):
    cluster, host_a = _stopped_with_files(running_cluster)
    bobs = _only_on(make_cluster, host_a, bob, "bobs")  # another researcher takes host a's GPUs
    host_b = Host.objects.exclude(pk=host_a.pk).get()

    # Not blocked: the page offers a plain start, for the other host takes it.
    assert services.start_blocked(cluster) == ""
    client.force_login(alice)
    page = client.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
    assert 'data-testid="start"' in page and 'data-testid="start-blocked"' not in page
    response = client.post(reverse("cluster_start", args=[cluster.pk]), {"mode": "gpu"})
    assert response.status_code == 302

    cluster.refresh_from_db()
    assert cluster.state == "running" and not cluster.no_gpu, cluster.state_reason
    node = _node(cluster)
    assert node.host_id == host_b.pk and sorted(node.gpu_indices) == [0, 1]
    started = cluster.events.filter(kind="running").latest("at").message
    assert started == (
        f"started by alice: node 0 on {host_b.name} GPU 0,1 ({host_a.name} had no free GPUs); "
        "your files and system disk came along"
    ), started
    assert _files_came_along(cluster, host_a) == host_b
    page = client.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
    assert "your files and system disk came along" in page

    # Stopped again on b and released: its save goes from the registry, nothing is left
    # of it on either host.
    services.cluster_stop(cluster=cluster)
    assert tasks.cluster_workspaces_stop(cluster.pk)
    assert tasks.cluster_workspaces_save(cluster.pk)
    assert _save_tags(cluster) == ["latest"]
    services.cluster_release(cluster=cluster)
    assert tasks.cluster_network_remove(cluster.pk)
    assert _save_tags(cluster) == []
    for host in (host_a, host_b):
        engine = _engine(host)
        assert _workspaces_on(host, cluster) == []
        assert not engine.images.list(name=f"{workspaces.KEEP_REPOSITORY}/c{cluster.pk}-n*")
        assert not engine.images.list(name=f"{registry.server()}/u{alice.pk}/*/c{cluster.pk}-n*")
    services.cluster_release(cluster=bobs)
    assert tasks.cluster_network_remove(bobs.pk)


def test_waiting_in_line_it_starts_on_whichever_host_frees_first(
    running_cluster, make_cluster, bob
):
    cluster, host_a = _stopped_with_files(running_cluster)
    host_b = Host.objects.exclude(pk=host_a.pk).get()
    on_a = _only_on(make_cluster, host_a, bob, "bob-a")
    on_b = _only_on(make_cluster, host_b, bob, "bob-b")
    with pytest.raises(services.StartBlocked, match=f"{host_a.name}.*in use by other clusters"):
        services.cluster_start(cluster=cluster)
    services.cluster_start(cluster=cluster, mode="wait", by="alice")
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "pending"
    assert cluster.state_reason == (
        f"waiting for 2 GPUs on {host_a.name}, which keeps its workspaces (0 free), nor room "
        "for it on another host"
    ), cluster.state_reason

    services.cluster_release(cluster=on_b)  # host b frees first
    assert tasks.cluster_network_remove(on_b.pk)
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    placed = cluster.events.filter(kind="running").latest("at").message
    assert placed == (
        f"placed: node 0 on {host_b.name} GPU 0,1 ({host_a.name} had no free GPUs); "
        "your files and system disk came along"
    ), placed
    assert _files_came_along(cluster, host_a) == host_b
    for done in (cluster, on_a):
        services.cluster_release(cluster=done)
        assert tasks.cluster_network_remove(done.pk)
    assert _save_tags(cluster) == []


def test_a_save_is_its_owners_alone(running_cluster, alice, bob, priced):
    from console.models import ApiToken

    cluster, _host = _stopped_with_files(running_cluster)
    saved = _node(cluster).saved_image
    _, token = ApiToken.issue(user=bob, name="bob")
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    # Neither by its tag nor by its digest may another researcher run it as an image.
    for reference in (saved, saved.partition("@")[0] + ":latest"):
        body = {"name": "thief", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
                "image": reference, "volumes": []}  # fmt: skip
        response = api.post("/api/v1/clusters", json.dumps(body), "application/json")
        assert response.status_code == 400, (reference, response.json())
        said = response.json()["fields"]["image"][0]
        assert "among your images" in said or "usable by its owner only" in said, said
    assert not Cluster.objects.filter(name="thief").exists()
    services.cluster_release(cluster=cluster)
    assert tasks.cluster_network_remove(cluster.pk)
    assert _save_tags(cluster) == []


def test_a_file_written_on_one_host_is_read_on_the_other(running_cluster, alice, bob):
    # Two clusters of alice's, one on each host (each takes a whole host's GPUs).
    first = running_cluster(1, gpus=2, volumes=WORK, name="first")
    second = running_cluster(1, gpus=2, volumes=WORK, name="second")
    assert _node(first).host_id != _node(second).host_id
    for cluster in (first, second):
        tasks.cluster_network_ensure(cluster.pk)
    code, _ = _sh(_workspace(first), f"echo from-{_node(first).host.name} > /workspace/note")
    assert code == 0
    assert _sh(_workspace(second), "cat /workspace/note") == (0, f"from-{_node(first).host.name}")
    assert _sh(_workspace(second), "echo back > /workspace/reply")[0] == 0
    assert _sh(_workspace(first), "cat /workspace/reply") == (0, "back")
    for cluster in (first, second):
        services.cluster_release(cluster=cluster)
        assert tasks.cluster_network_remove(cluster.pk)

    # Bob's workspace on either host sees his own (empty) storage, not alice's files.
    bobs = running_cluster(1, gpus=2, owner=bob, volumes=WORK, name="bobs")
    tasks.cluster_network_ensure(bobs.pk)
    assert _sh(_workspace(bobs), "ls -A /workspace") == (0, "")
    services.cluster_release(cluster=bobs)
    assert tasks.cluster_network_remove(bobs.pk)


def test_the_ranks_of_a_two_node_job_share_one_workspace_folder(running_cluster, settle_until):
    cluster = running_cluster(2, gpus=2, volumes=WORK)
    hosts = {n.host_id for n in cluster.node_set.all()}
    assert len(hosts) == 2, "one node on each host"
    # Each rank writes its file, then waits for the other's (from its own host).
    command = (
        'echo "written by rank $RANK" > /workspace/rank$RANK; other=$((1 - RANK)); '
        "for i in $(seq 1 150); do [ -s /workspace/rank$other ] && break; sleep 0.2; done; "
        'echo "rank $RANK read: $(cat /workspace/rank$other)"'
    )
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="share", command=command))
    dispatch.dispatch(cluster.pk)
    job = settle_until(job, timeout=60)
    assert job.state == "succeeded", job.state_reason
    logs = {r.rank: r.log for r in job.replicas.all()}
    assert "rank 0 read: written by rank 1" in logs[0], logs
    assert "rank 1 read: written by rank 0" in logs[1], logs
    # And each node's workspace sees both.
    tasks.cluster_network_ensure(cluster.pk)
    for index in (0, 1):
        assert _sh(_workspace(cluster, index), "cat /workspace/rank0 /workspace/rank1") == (
            0,
            "written by rank 0\nwritten by rank 1",
        )
    services.cluster_release(cluster=cluster)
    assert tasks.cluster_network_remove(cluster.pk)

"""The system disk (issue 37, hole 3): a workspace's and a replica's own root filesystem
(files outside their volumes) has a size limit, so that no tenant fills a host's disk.

An attacker's notebook, from inside real containers, with a second researcher:

- alice's workspace, on an instance type whose system disk is 1 GB, writes 1.5 GB into
  its root filesystem: the write fails with the kernel's own reason, and the engine's
  data root grows by at most the limit; bob's workspace on the same host still writes.
  The engine's storage driver enforces it (btrfs with quotas: the test engines' data
  roots, .ci/services.sh; SUANLI_TEST_ROOTFS_ENGINE names another such engine).
- on an engine whose driver cannot (overlay2 on ext4), the monitor measures each
  container's writable layer (SizeRw) and acts: a line at 90 %, once; at the limit the
  container is paused with the reason on the cluster's timeline.
"""

import asyncio
import os

import docker
import pytest
from conftest import TEST_IMAGE
from django.urls import reverse
from waiting import until

from jobs import tasks
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import ClusterEvent, GpuModel, Host, InstanceType, JobEvent
from jobs.nodes import runtime, workspaces
from jobs.placement import scheduler
from jobs.runs import dispatch
from monitoring import rootdisk
from monitoring.monitor import Monitor

pytestmark = pytest.mark.django_db

MiB = 2**20


def _engine(default: str):
    """SUANLI_TEST_ROOTFS_ENGINE (a private engine on btrfs) or `default`; what a failed
    test left there is removed after it."""
    url = os.environ.get("SUANLI_TEST_ROOTFS_ENGINE") or default
    yield url
    client = docker.DockerClient(base_url=url, timeout=30)
    for container in client.containers.list(all=True, filters={"label": workspaces.LABEL}):
        container.remove(force=True)
    for image in client.images.list(name=f"{workspaces.KEEP_REPOSITORY}/*"):
        client.images.remove(image.id, force=True)
    client.networks.prune(filters={"label": "suanli.cluster"})
    client.close()


@pytest.fixture
def sizing_engine(engine_urls):
    """An engine whose storage driver sizes root filesystems: the first test engine (on
    btrfs, .ci/services.sh)."""
    yield from _engine(engine_urls[0])


@pytest.fixture
def measuring_engine(engine_urls):
    """An engine the test treats as one whose driver cannot size them (the host's flag)."""
    yield from _engine(engine_urls[1])


def _workspace(cluster):
    node = cluster.node_set.get(released_at__isnull=True)
    node.refresh_from_db()
    client = docker.DockerClient(base_url=node.host.engine_url, timeout=60)
    return client, client.containers.get(node.workspace_container)


def _sh(container, script: str) -> tuple[int, str]:
    code, out = container.exec_run(
        ["/bin/sh", "-c", script], user=container.attrs["Config"]["User"]
    )
    return code, out.decode(errors="replace").strip()


def _used_bytes(path: str) -> int:
    fs = os.statvfs(path)
    return (fs.f_blocks - fs.f_bfree) * fs.f_frsize


def _debug_cluster(make_cluster, owner, name: str, *, root_disk_gb: int):
    """A one-node CPU cluster whose instance type's system disk the operator set."""
    InstanceType.objects.update_or_create(
        name="cpu-1c-1g", defaults={"vcpus": 1, "memory_gb": 1, "root_disk_gb": root_disk_gb}
    )
    cluster = make_cluster(owner, name, cpu="cpu-1c-1g", release_policy="never", volumes=())
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    assert cluster.root_disk_gb == root_disk_gb
    made = tasks.cluster_network_ensure(cluster.pk)  # its network and workspace
    assert "workspace" not in made, made
    return cluster


def test_a_workspace_cannot_write_past_its_system_disk_and_the_host_disk_grows_by_at_most_it(
    make_host, make_cluster, sizing_engine, alice, bob
):
    host = make_host("cpu-sized-01", engine=sizing_engine, model=None, gpus=0)
    assert host.state == "active", host.last_error
    assert host.root_disk_enforced, f"{host.storage_driver} does not size root filesystems here"
    mine = _debug_cluster(make_cluster, alice, "fill", root_disk_gb=1)
    client, container = _workspace(mine)
    assert container.attrs["HostConfig"]["StorageOpt"] == {"size": "1G"}
    data_root = client.info()["DockerRootDir"]
    before = _used_bytes(data_root)

    # The attacker's dd: 1.5 GB into the root filesystem (not a volume).
    code, out = _sh(container, "dd if=/dev/zero of=/tmp/big bs=1M count=1500 2>&1")
    assert code != 0, f"1.5 GB went into a 1 GB system disk: {out}"
    assert "quota exceeded" in out.lower() or "no space left" in out.lower(), out
    grew = _used_bytes(data_root) - before
    (listed,) = client.api.containers(all=True, size=True, filters={"id": container.id})
    size_rw = listed["SizeRw"]
    assert size_rw <= 1024 * MiB, f"the writable layer holds {size_rw / MiB:.0f} MiB"
    assert grew <= 1024 * MiB + 128 * MiB, f"the host's disk grew by {grew / MiB:.0f} MiB"

    # The host's disk is not full for the next researcher on it.
    theirs = _debug_cluster(make_cluster, bob, "next", root_disk_gb=1)
    _, other = _workspace(theirs)
    assert _sh(other, "dd if=/dev/zero of=/tmp/data bs=1M count=50 2>&1 && echo written")[
        1
    ].endswith("written")
    # Freeing space lets alice write again: it is her limit, not a broken filesystem.
    assert _sh(container, "rm /tmp/big && echo hi > /tmp/small && cat /tmp/small")[1] == "hi"
    for cluster in (mine, theirs):
        services.cluster_release(cluster=cluster)
        assert workspaces.remove(cluster.pk)
        tasks.cluster_network_remove(cluster.pk)


def _sparse(container, path: str, mib: int) -> None:
    """A file of `mib` MiB that takes no blocks: the engine's SizeRw counts its apparent
    size, so the measured path is tested without writing a gigabyte."""
    code, out = _sh(container, f"dd if=/dev/zero of={path} bs=1 count=0 seek={mib}M 2>&1")
    assert code == 0, out


def _monitor_round() -> dict:
    monitor = Monitor(publish=False)
    try:
        asyncio.run(monitor.run(ticks=1))
        return monitor.disk_round.result(timeout=120)
    finally:
        monitor.close()


@pytest.mark.django_db(transaction=True)  # the monitor reads through its executor's connections
def test_where_the_engine_cannot_enforce_it_the_monitor_warns_at_90_and_pauses_at_the_limit(
    make_host, make_cluster, measuring_engine, alice, bob
):
    host = make_host("cpu-measured-01", engine=measuring_engine, model=None, gpus=0)
    # A host whose storage driver cannot size root filesystems (overlay2 on ext4).
    Host.objects.filter(pk=host.pk).update(root_disk_enforced=False)
    mine = _debug_cluster(make_cluster, alice, "grow", root_disk_gb=1)
    theirs = _debug_cluster(make_cluster, bob, "calm", root_disk_gb=1)
    client, container = _workspace(mine)
    _, other = _workspace(theirs)
    assert not container.attrs["HostConfig"].get("StorageOpt"), "nothing to enforce it here"
    _sparse(other, "/tmp/data", 100)

    _sparse(container, "/tmp/big", 950)  # 93 % of 1 GiB
    assert rootdisk.check_host(host) == {container.name: "warned"}
    assert rootdisk.check_host(host) == {}, "the warning is said once"
    (near,) = ClusterEvent.objects.filter(cluster=mine, kind=rootdisk.KIND_NEAR)
    assert "node 0's workspace holds 0.9 GB of its 1 GB" in near.message, near.message

    _sparse(container, "/tmp/big", 1100)
    # The monitor process's own round (every SUANLI_ROOT_DISK_CHECK_S, on its own thread).
    assert _monitor_round() == {container.name: "paused"}
    container.reload()
    assert container.attrs["State"]["Paused"], "writes stop at the limit"
    (full,) = ClusterEvent.objects.filter(cluster=mine, kind=rootdisk.KIND_FULL)
    assert "reached its 1 GB limit: it is paused" in full.message, full.message
    # The reconciler leaves it paused; bob's workspace on the same host runs on untouched.
    workspaces.sweep(host, client)
    container.reload()
    other.reload()
    assert container.status == "paused" and other.status == "running"
    assert not ClusterEvent.objects.filter(cluster=theirs, kind__startswith="system-disk")
    # The way out the timeline names: stop and start the cluster, then free space.
    services.cluster_stop(cluster=mine)
    assert workspaces.stop(mine.pk)
    services.cluster_start(cluster=mine)
    scheduler.place_pending()
    tasks.cluster_network_ensure(mine.pk)
    client, container = _workspace(mine)
    assert container.status == "running"
    # Still over its limit, but just started: the owner has the grace to free space.
    assert rootdisk.check_host(host) == {}, "a workspace paused again before it can be cleaned"
    assert _sh(container, "rm /tmp/big && echo freed")[1] == "freed"
    assert rootdisk.check_host(host) == {}
    for cluster in (mine, theirs):
        services.cluster_release(cluster=cluster)
        assert workspaces.remove(cluster.pk)
        tasks.cluster_network_remove(cluster.pk)


@pytest.mark.django_db(transaction=False)
def test_the_form_and_the_cluster_page_say_how_big_the_system_disk_is(
    client, catalog, paper_host, make_cluster, alice
):
    GpuModel.objects.filter(slug="a100-80gb").update(root_disk_gb=100)
    client.force_login(alice)
    form = client.get(reverse("cluster_new")).content.decode()
    assert "System disk: 30 GB (files outside your volumes); except A100 80 GB 100 GB" in form
    cluster = make_cluster(alice, "sized")
    page = client.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
    assert "System disk: 100 GB (files outside your volumes)" in page


def test_a_replica_past_its_system_disk_is_stopped_and_its_job_says_why(
    make_host, make_cluster, measuring_engine, alice, settle_until
):
    host = make_host("cpu-measured-02", engine=measuring_engine, model=None, gpus=0)
    Host.objects.filter(pk=host.pk).update(root_disk_enforced=False)
    cluster = _debug_cluster(make_cluster, alice, "batch", root_disk_gb=1)
    fill = "dd if=/dev/zero of=/tmp/big bs=1 count=0 seek=1100M && exec sleep 300"
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="fill", command=fill))
    dispatch.dispatch(cluster.pk)
    name = until(
        lambda: next(iter(rootdisk.check_host(host).items()), None), what="the replica measured"
    )
    assert name == (runtime.container_name(job, 0, 1), "stopped")
    job = settle_until(job)
    assert job.state == "failed"
    (said,) = JobEvent.objects.filter(job=job, kind=rootdisk.KIND_FULL)
    assert "replica 0 (attempt 1) reached its 1 GB limit: it was stopped" in said.message
    services.cluster_release(cluster=cluster)
    assert workspaces.remove(cluster.pk)
    tasks.cluster_network_remove(cluster.pk)


def test_an_images_volume_and_its_output_stay_off_the_hosts_disk(
    make_host, make_cluster, sizing_engine, alice
):
    """Two ways round the system disk: a VOLUME the image declares (the engine would make
    an anonymous volume for it on the host's disk, unmeasured, kept after the container)
    and what the container prints (kept by the engine on the host's disk). The VOLUME is a
    bounded tmpfs that goes with the container; the output is a few rotated files."""
    client = docker.DockerClient(base_url=sizing_engine, timeout=60)
    base = client.containers.create(TEST_IMAGE, command=["true"])
    reference = "suanli-test/with-volume:v1"
    base.commit(repository="suanli-test/with-volume", tag="v1", changes=["VOLUME /fill"])
    base.remove()
    volumes_before = {v.name for v in client.volumes.list()}
    make_host("cpu-vol-01", engine=sizing_engine, model=None, gpus=0)
    InstanceType.objects.update_or_create(name="cpu-1c-1g", defaults={"vcpus": 1, "memory_gb": 1})
    cluster = make_cluster(
        alice, "vol", cpu="cpu-1c-1g", release_policy="never", volumes=(), image_reference=reference
    )
    scheduler.place_pending()
    assert "workspace" not in tasks.cluster_network_ensure(cluster.pk)
    _, container = _workspace(cluster)
    mounts = {m["Destination"]: m for m in container.attrs["Mounts"]}
    assert mounts["/fill"]["Type"] == "tmpfs", mounts
    assert {v.name for v in client.volumes.list()} == volumes_before, "an anonymous volume"
    # The attacker's dd into the image's VOLUME stops at the tmpfs's size, in its memory.
    code, out = _sh(container, "dd if=/dev/zero of=/fill/big bs=1M count=1500 2>&1")
    assert code != 0 and "no space left" in out.lower(), out
    log_config = container.attrs["HostConfig"]["LogConfig"]
    assert log_config["Type"] == "json-file" and log_config["Config"]["max-file"] == "3"
    assert log_config["Config"]["max-size"].endswith("m"), log_config
    services.cluster_release(cluster=cluster)
    assert workspaces.remove(cluster.pk)
    tasks.cluster_network_remove(cluster.pk)
    assert {v.name for v in client.volumes.list()} == volumes_before
    client.images.remove(reference, force=True)
    client.close()

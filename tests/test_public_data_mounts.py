"""/pub on the real engines, as a tenant with a shell attacks it (jobs/files/pub.py).

Olga publishes; Alice's cluster asks for /pub. From inside her containers (her uid, no
capability, no new privileges) she reads what is published on either host, and tries to
write it, to remount it read-write (also from a user namespace of her own, and as the
container's root), and to have the engine make a folder in it for her image. Nothing of
hers lands in the operator's folder. A cluster that does not ask has no /pub at all."""

import docker
import pytest

from jobs import tasks
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.files import pub
from jobs.files.storage import VolumeSpec
from jobs.nodes import workspaces
from jobs.runs import dispatch

pytestmark = pytest.mark.django_db

ATTACK = (
    "cat /pub/imagenet-mini/hello.txt; "
    "echo x > /pub/imagenet-mini/mine; echo write=$?; "
    "mkdir /pub/planted; echo mkdir=$?; "
    "mount -o remount,rw /pub; echo remount=$?; "
    "unshare -rm sh -c 'mount -o remount,rw /pub && echo REMOUNTED; touch /pub/userns'; "
    "echo userns=$?; "
    "grep ' /pub ' /proc/mounts"
)


def _published(name: str, files: dict[str, str]):
    dataset = pub.dataset_create(name=name)
    for path, text in files.items():
        (pub.drafts_root() / name / path).write_text(text)
    return pub.dataset_publish(dataset=dataset)


def _sh(container, script: str, user: str | None = None) -> tuple[int, str]:
    code, out = container.exec_run(
        ["/bin/sh", "-c", script], user=user or container.attrs["Config"]["User"]
    )
    return code, out.decode(errors="replace")


def _nothing_of_hers_in_pub() -> None:
    assert sorted(p.name for p in pub.live_root().iterdir()) == ["imagenet-mini"]
    assert sorted(p.name for p in (pub.live_root() / "imagenet-mini").iterdir()) == ["hello.txt"]


def test_a_cluster_that_asks_reads_pub_on_every_node_and_cannot_write_or_remount_it(
    running_cluster, settle_until, storage_root, engine_urls
):
    _published("imagenet-mini", {"hello.txt": "hello from the operator"})
    cluster = running_cluster(2, pub=True, volumes=(VolumeSpec("workspace", "/workspace"),))
    tasks.cluster_network_ensure(cluster.pk)
    for index in (0, 1):  # one node on each host: the same files on both
        workspace = workspaces.running(cluster, index)
        (mount,) = [m for m in workspace.attrs["Mounts"] if m["Destination"] == "/pub"]
        assert mount["RW"] is False and mount["Source"] == str(pub.live_root().resolve())
        code, out = _sh(workspace, ATTACK)
        print(f"node {index}: {out}")
        assert "hello from the operator" in out, out
        assert "Read-only file system" in out and "write=1" in out and "mkdir=1" in out, out
        assert "remount=0" not in out and "REMOUNTED" not in out, out
        assert "userns=0" not in out, out
        (line,) = [row for row in out.splitlines() if " /pub " in row]
        assert " ro," in line or line.split()[3].startswith("ro"), line
        # The container's own root has no capability either.
        code, out = _sh(workspace, "mount -o remount,rw /pub; echo remount=$?", user="0")
        assert "remount=0" not in out, out
    _nothing_of_hers_in_pub()

    # The jobs' replicas get it too.
    job = services.job_submit(
        cluster=cluster,
        spec=JobSpec(name="reads", command="cat /pub/imagenet-mini/hello.txt; touch /pub/x"),
    )
    dispatch.dispatch(cluster.pk)
    job = settle_until(job)
    for replica in job.replicas.all():
        assert "hello from the operator" in replica.log and "Read-only file system" in replica.log
    _nothing_of_hers_in_pub()

    # Published or unpublished while it runs: seen at once (one folder, renamed in and out).
    _published("late", {"a.txt": "late"})
    workspace = workspaces.running(cluster, 1)
    assert _sh(workspace, "ls /pub")[1].split() == ["imagenet-mini", "late"]
    pub.dataset_unpublish(dataset=pub.published().get(name="late"))
    assert _sh(workspace, "ls /pub")[1].split() == ["imagenet-mini"]
    services.cluster_release(cluster=cluster)
    tasks.cluster_network_remove(cluster.pk)


def test_a_cluster_that_does_not_ask_has_no_pub(running_cluster, storage_root):
    _published("imagenet-mini", {"hello.txt": "hello from the operator"})
    cluster = running_cluster(1, volumes=(VolumeSpec("workspace", "/workspace"),))
    assert not cluster.pub
    tasks.cluster_network_ensure(cluster.pk)
    workspace = workspaces.running(cluster, 0)
    assert [m["Destination"] for m in workspace.attrs["Mounts"]] == ["/workspace"]
    code, out = _sh(workspace, "ls /pub")
    assert code != 0 and "No such file or directory" in out, out
    services.cluster_release(cluster=cluster)
    tasks.cluster_network_remove(cluster.pk)


def test_an_image_whose_volume_lies_in_pub_is_refused_before_the_engine_makes_it(
    running_cluster, settle_until, storage_root, engine_urls
):
    """The engine would make the VOLUME's mount point inside /pub: in the operator's folder."""
    _published("imagenet-mini", {"hello.txt": "hello from the operator"})
    reference = "suanli-test/pub-volume:v1"
    for url in engine_urls[:2]:
        client = docker.DockerClient(base_url=url, timeout=60)
        base = client.containers.create("suanli/busybox:latest", command=["true"])
        base.commit(repository="suanli-test/pub-volume", tag="v1", changes=["VOLUME /pub/evil"])
        base.remove()
        client.close()
    try:
        cluster = running_cluster(1, pub=True, workspace=False, image_reference=reference)
        job = services.job_submit(cluster=cluster, spec=JobSpec(name="evil", command="true"))
        dispatch.dispatch(cluster.pk)
        job = settle_until(job)
        assert job.state == "failed"
        assert "The image declares VOLUME /pub/evil inside /pub" in job.state_reason
        _nothing_of_hers_in_pub()
    finally:
        for url in engine_urls[:2]:
            client = docker.DockerClient(base_url=url, timeout=60)
            client.images.remove(reference, force=True)
            client.close()

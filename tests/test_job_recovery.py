"""What a crash, a lost message or a hostile container leaves behind is repaired, and a
running job is never stopped by anything but its owner, its limits or its failure."""

import os
import time
from datetime import timedelta
from unittest import mock

import docker
import pytest
from django.urls import reverse
from django.utils import timezone

from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.files.storage import VolumeSpec
from jobs.models import Cluster, Job, Replica
from jobs.nodes import network, runtime
from jobs.runs import dispatch, exits, repair, stopping

pytestmark = pytest.mark.django_db


def _submit(cluster, command, name="j", **extra):
    job = services.job_submit(cluster=cluster, spec=JobSpec(name=name, command=command, **extra))
    dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    return job


def _containers(job):
    out = []
    for replica in Replica.objects.filter(job=job).select_related("host"):
        client = docker.DockerClient(base_url=replica.host.engine_url, timeout=10)
        out += client.containers.list(all=True, filters={"label": f"suanli.job={job.pk}"})
        client.close()
    return out


def test_a_volume_replaced_by_a_symlink_is_refused_at_start(
    running_cluster, settle_until, alice, storage_root
):
    # Two nodes: the first replica's refusal must not leave the second waiting for ever.
    cluster = running_cluster(
        2, gpus=2, volumes=(VolumeSpec(source="data", target="/workspace/ckpt"),)
    )
    root = storage_root / f"u{alice.pk}"
    assert oct(os.stat(root).st_mode & 0o777) == "0o711"
    # What a container of this tenant could do to its root in the layout before (its root
    # is the console's now, tests/test_storage.py): swap the folder for a link to /etc.
    os.rmdir(root / "data")
    os.symlink("/etc", root / "data")
    job = _submit(cluster, "cat /workspace/ckpt/shadow")
    job = settle_until(job)
    assert job.state == Job.State.FAILED
    assert "'data' in your storage is a symbolic link" in job.state_reason
    assert {r.state for r in job.replicas.all()} == {Replica.State.LOST}
    assert _containers(job) == []


def test_new_cluster_refuses_a_storage_folder_that_is_a_symlink(alice, make_cluster, storage_root):
    root = storage_root / f"u{alice.pk}"
    (root / "real").mkdir(parents=True)
    os.symlink(root / "real", root / "alias")  # inside the root, but a link all the same
    with pytest.raises(Exception, match="symbolic link"):
        make_cluster(alice, "linked", volumes=(VolumeSpec(source="alias", target="/workspace/x"),))
    assert os.listdir(root / "real") == []


def test_an_idle_policy_never_releases_a_cluster_with_a_running_job(running_cluster, settle_until):
    cluster = running_cluster(1, release_policy="idle", idle_minutes=1)
    job = _submit(cluster, "exec sleep 60")
    assert job.state == Job.State.RUNNING
    later = timezone.now() + timedelta(hours=2)
    assert services.clusters_release_idle(now=later) == []
    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.RUNNING
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING and not job.cancel_requested
    services.job_cancel(job=job, by="alice")
    stopping.stop(job.pk)
    settle_until(job)
    assert services.clusters_release_idle(now=later) == [cluster.pk]
    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.RELEASED
    assert "1 idle minutes" in cluster.state_reason


def test_a_job_whose_settle_was_lost_is_settled_by_the_reconciler(running_cluster, settle_until):
    cluster = running_cluster(1)
    job = _submit(cluster, "echo done")
    replica = job.replicas.get()
    for _ in range(50):
        if _containers(job)[0].status == "exited":
            break
        time.sleep(0.1)
    # The process dies right after committing the replica's exit, before settling the job:
    with mock.patch.object(exits, "settle"):
        exits.replica_exited(replica.pk)
    replica.refresh_from_db()
    job.refresh_from_db()
    assert replica.state == Replica.State.EXITED and job.state == Job.State.RUNNING
    report = repair.reconcile()
    assert report["settled"] == 1
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED


def test_a_container_created_but_never_started_is_started_by_a_worker(
    running_cluster, settle_until, work_queue
):
    cluster = running_cluster(1)
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="half", command="echo late"))
    with mock.patch.object(dispatch, "start_replicas"):
        dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    replica = job.replicas.select_related("node__host").get()
    # The worker died between `create` and `start`: the container exists, created.
    spec = runtime.container_spec(
        job=job, node=replica.node, nodes=1, attempt=job.attempt, nvidia=False,
        network_name=network.ensure(cluster.pk),
    )  # fmt: skip
    client = docker.DockerClient(base_url=replica.host.engine_url, timeout=10)
    client.containers.create(spec.image, name=spec.name, **spec.kwargs)
    assert repair.reconcile(stuck_after_s=0)["removed"] == 0, "it is not a leftover"
    work_queue("docker")
    assert settle_until(job).state == Job.State.SUCCEEDED
    assert "late" in job.replicas.get().log
    client.close()


def test_a_lost_sigkill_is_sent_by_the_reconciler(running_cluster, settle_until, settings):
    cluster = running_cluster(1)
    # A command that ignores SIGTERM: only SIGKILL ends it.
    job = _submit(cluster, "trap '' TERM; while true; do sleep 1; done")
    assert job.state == Job.State.RUNNING
    services.job_cancel(job=job, by="alice")
    stopping.stop(job.pk)  # SIGTERM now; the delayed SIGKILL sits in a scheduler nobody runs
    assert repair.reconcile()["killed"] == 0, "within the grace period nothing is killed"
    Job.objects.filter(pk=job.pk).update(
        stop_requested_at=timezone.now() - timedelta(seconds=settings.SUANLI_STOP_GRACE_S + 10)
    )
    assert repair.reconcile()["killed"] == 1
    job = settle_until(job)
    assert job.state == Job.State.CANCELLED
    assert job.replicas.get().exit_code == 137


def test_a_start_after_cancel_creates_no_container(running_cluster, settle_until):
    cluster = running_cluster(2, gpus=2)
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="late", command="sleep 30"))
    with mock.patch.object(dispatch, "start_replicas"):
        dispatch.dispatch(cluster.pk)
    services.job_cancel(job=job, by="alice")
    dispatch.start_replicas(job.pk)  # the start task arrives after the cancel
    job = settle_until(job)
    assert job.state == Job.State.CANCELLED
    assert _containers(job) == []


def test_log_download_filename_is_safe_for_any_job_name(
    client, alice, running_cluster, settle_until
):
    cluster = running_cluster(1)
    job = _submit(cluster, "echo hi", name='evil\r\nSet-Cookie: x=1"; ..')
    settle_until(job)
    client.force_login(alice)
    response = client.get(reverse("job_log", args=[job.pk]))
    assert response.status_code == 200
    disposition = response["Content-Disposition"]
    assert "\r" not in disposition and "\n" not in disposition
    assert disposition == f'attachment; filename="job-{job.pk}-evil-Set-Cookie-x-1.log"'
    assert "hi" in response.content.decode()

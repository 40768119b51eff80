"""Jobs run on the two real Docker engines, in hardened containers."""

import threading
import time

import django_rq
import docker
import pytest
from django.urls import reverse

from jobs import tasks
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import Cluster, Job, Replica
from jobs.nodes import runtime
from jobs.runs import dispatch, repair, stopping

pytestmark = pytest.mark.django_db


def _submit(cluster, command, **extra):
    job = services.job_submit(
        cluster=cluster, spec=JobSpec(name=extra.pop("name", "j"), command=command, **extra)
    )
    dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    return job


def _client(replica):
    return docker.DockerClient(base_url=replica.host.engine_url, timeout=10)


def test_one_node_job_prints_and_succeeds_with_its_log_stored(running_cluster, settle_until):
    cluster = running_cluster(1)
    job = _submit(cluster, "echo hello from $RANK of $WORLD_SIZE; echo to-stderr >&2")
    assert job.state == Job.State.RUNNING
    job = settle_until(job)
    assert job.state == Job.State.SUCCEEDED and job.exit_code == 0
    replica = job.replicas.get()
    assert "hello from 0 of 1" in replica.log and "to-stderr" in replica.log
    with pytest.raises(docker.errors.NotFound):
        _client(replica).containers.get(replica.container_name)  # gone, the log stays


def test_exit_code_3_fails_the_job_with_code_3(running_cluster, settle_until):
    job = settle_until(_submit(running_cluster(1), "echo bad; exit 3"))
    assert job.state == Job.State.FAILED and job.exit_code == 3
    assert job.state_reason == "rank 0 exited with code 3"


def test_running_replica_is_hardened(running_cluster, settle_until, alice, storage_root):
    from jobs.files.storage import VolumeSpec

    cluster = running_cluster(1, volumes=(VolumeSpec(source="data", target="/workspace/data"),))
    job = _submit(cluster, "sleep 30")
    replica = job.replicas.get()
    info = _client(replica).api.inspect_container(replica.container_name)
    host_config = info["HostConfig"]
    uid = runtime.tenant_uid(alice.pk)
    assert info["Config"]["User"] == f"{uid}:{uid}"
    assert host_config["CapDrop"] == ["ALL"] and not host_config.get("CapAdd")
    assert host_config["SecurityOpt"] == ["no-new-privileges"]
    assert host_config["Privileged"] is False
    host = replica.host
    cpus, memory = runtime.node_limits(cluster, host)
    assert host_config["PidsLimit"] == 4096
    assert memory == host.memory_bytes // 2, "1 of the host's 2 GPUs"
    # The node's workspace holds its share (25 %); the job's replica the rest.
    share = runtime.replica_share(cluster)
    assert cluster.workspace and share == 0.75
    assert host_config["Memory"] == int(memory * share)
    assert host_config["NanoCpus"] == int(cpus * share * 1e9) > 0
    assert host_config["NetworkMode"] == f"suanli-c{cluster.pk}", "its own network, never host"
    assert host_config["PidMode"] == "" and host_config["IpcMode"] in ("private", "shareable", "")
    assert host_config["UsernsMode"] == "" and host_config["UTSMode"] == ""
    assert [(m["Destination"], m["Source"]) for m in info["Mounts"]] == [
        ("/workspace/data", str((storage_root / f"u{alice.pk}" / "data").resolve()))
    ]
    labels = info["Config"]["Labels"]
    assert labels["suanli.job"] == str(job.pk) and labels["suanli.owner"] == str(alice.pk)
    assert labels["suanli.replica"] == "0" and labels["suanli.cluster"] == str(cluster.pk)
    env = dict(e.split("=", 1) for e in info["Config"]["Env"])
    assert env["NCCL_IB_DISABLE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "0"
    services.job_cancel(job=job, by="alice")
    stopping.stop(job.pk)
    assert settle_until(job).state == Job.State.CANCELLED


def test_cancel_while_running_sends_sigterm_and_shows_cancelled(running_cluster, settle_until):
    job = _submit(
        running_cluster(1), "trap 'echo got TERM; exit 143' TERM; while true; do sleep 1; done"
    )
    time.sleep(1)
    services.job_cancel(job=job, by="alice")
    stopping.stop(job.pk)  # what the queued stop task runs
    job = settle_until(job)
    assert job.state == Job.State.CANCELLED and job.state_reason == "cancelled by alice"
    assert "got TERM" in job.replicas.get().log
    # Its replicas exited: their code is the job's, on the page and in the API alike.
    assert job.exit_code == job.replicas.get().exit_code == 143
    with pytest.raises(Exception, match="nothing to cancel"):
        services.job_cancel(job=job, by="alice")


def test_a_job_cancelled_before_it_ran_has_no_exit_code(client, alice, make_cluster):
    from console.models import ApiToken

    job = services.job_submit(
        cluster=make_cluster(alice, "waits"), spec=JobSpec(name="j", command="true")
    )
    services.job_cancel(job=job, by="alice")
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLED and job.exit_code is None
    _, token = ApiToken.issue(user=alice, name="t")
    answer = client.get(f"/api/v1/jobs/{job.pk}", HTTP_AUTHORIZATION=f"Bearer {token}").json()
    assert answer["exit_code"] is None
    client.force_login(alice)
    page = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    assert 'data-testid="exit-code">—<' in page


def test_queued_jobs_run_one_at_a_time_in_order(running_cluster, settle_until):
    cluster = running_cluster(1)
    first = _submit(cluster, "sleep 2", name="first")
    second = _submit(cluster, "echo second", name="second")
    assert second.state == Job.State.QUEUED
    settle_until(first)
    dispatch.dispatch(cluster.pk)
    assert settle_until(second).state == Job.State.SUCCEEDED
    assert second.replicas.get().started_at >= first.replicas.get().finished_at


@pytest.mark.django_db(transaction=True)  # the others start in threads of their own
def test_a_dispatch_task_starts_other_clusters_ready_jobs_beside_its_own_once_each(
    running_cluster, settle_until
):
    """A burst of submits queues one dispatch task per cluster: the first to run starts
    the other clusters' waiting jobs beside its own, and their own tasks then find them
    started. Each job starts once, in one container."""
    clusters = [running_cluster(1, name="burst-a"), running_cluster(1, name="burst-b")]
    jobs = [
        services.job_submit(cluster=c, spec=JobSpec(name="j", command="sleep 1")) for c in clusters
    ]
    assert tasks.cluster_dispatch(clusters[0].pk) == jobs[0].pk
    assert tasks.cluster_dispatch(clusters[1].pk) is None  # its own task: started already
    for job in jobs:
        job.refresh_from_db()
        assert job.running_since is not None and job.attempt == 1, job.state_reason
        assert settle_until(job).state == Job.State.SUCCEEDED
        assert job.replicas.count() == 1


@pytest.mark.django_db(transaction=True)  # the others start in threads of their own
def test_a_dispatch_task_leaves_another_clusters_pull_to_a_start_task_of_its_own(
    running_cluster, settle_until, work_queue
):
    """Another tenant's job whose image is not on its host does not hold the batch (nor
    the task past its timeout) behind a pull: its start goes on in a task of its own,
    which pulls it (here it cannot: the job fails, saying so)."""
    mine, theirs = running_cluster(1, name="mine"), running_cluster(1, name="theirs")
    work_queue()  # placement's tasks (networks, workspaces), before the image goes
    Cluster.objects.filter(pk=theirs.pk).update(image_reference="suanli/no-such-image:1")
    own = services.job_submit(cluster=mine, spec=JobSpec(name="j", command="true"))
    other = services.job_submit(cluster=theirs, spec=JobSpec(name="j", command="true"))
    assert tasks.cluster_dispatch(mine.pk) == own.pk
    other.refresh_from_db()
    assert other.state == Job.State.STARTING and other.attempt == 1
    assert not other.events.filter(kind="pulling").exists(), "not pulled in the batch"
    work_queue()
    other = settle_until(other)
    assert other.state == Job.State.FAILED and other.attempt == 1, other.state_reason
    assert other.events.filter(kind="pulling").count() == 1
    assert settle_until(own).state == Job.State.SUCCEEDED


@pytest.mark.django_db(transaction=True)  # the starts run in threads of their own
def test_a_burst_dispatch_holds_one_database_connection_per_start_in_flight(
    make_host, running_cluster, settle_until
):
    """PostgreSQL's connections are shared by the web, cron and billing: a dispatch task
    starting a burst (BATCH starts side by side, one of them a 16-node job whose every
    replica pulls, writing its timeline) holds at most one connection per start in
    flight, not one more per replica."""
    from django.db import connection, connections
    from django.db.backends.signals import connection_created

    if connection.vendor != "postgresql":
        pytest.skip("counts PostgreSQL's connections")
    for i in range(8):  # 16 hosts: one per node of a 16-node cluster, and room for others
        make_host(f"gpu-a-{i + 1:02}", engine=0, gpus=2, check="reuse")
        make_host(f"gpu-b-{i + 1:02}", engine=1, gpus=2, check="reuse")
    make_host.__dict__["made"] = True
    pulling = running_cluster(16, name="pulls")
    Cluster.objects.filter(pk=pulling.pk).update(image_reference="suanli/no-such-image:1")
    others = [running_cluster(1, name=f"burst-{i}") for i in range(10)]
    own = services.job_submit(cluster=pulling, spec=JobSpec(name="j", command="true"))
    jobs = [services.job_submit(cluster=c, spec=JobSpec(name="j", command="true")) for c in others]

    monitor = connections.create_connection("default")  # counts; not one of the dispatch's
    monitor.inc_thread_sharing()
    counting, seen = threading.Lock(), []

    def count(sender, connection, **kwargs):
        if connection is monitor:
            return
        with counting, monitor.cursor() as cursor:  # the most there are: right after one opens
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            seen.append(cursor.fetchone()[0])

    with monitor.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        before = cursor.fetchone()[0]  # this test's own (the test client's, any other's)
    connection_created.connect(count)
    try:
        tasks.cluster_dispatch(pulling.pk)
    finally:
        connection_created.disconnect(count)
        monitor.dec_thread_sharing()
        monitor.close()
    own.refresh_from_db()
    events = " ".join(e.message for e in own.events.all())
    assert events.count("pulling suanli/no-such-image:1") == 16, "every replica tried a pull"
    assert own.state == Job.State.FAILED
    # One per start in flight (a closed one may linger a moment in pg_stat_activity).
    assert seen and max(seen) - before <= dispatch.BATCH + 2, (before, seen)
    for job in jobs:
        assert settle_until(job).state == Job.State.SUCCEEDED, job.state_reason
        assert job.attempt == 1 and job.replicas.count() == 1


def test_two_node_job_across_both_engines_connects_rank1_to_rank0(running_cluster, settle_until):
    cluster = running_cluster(2, gpus=2)
    hosts = {n.host.engine_url for n in cluster.node_set.all()}
    assert len(hosts) == 2, "one node on each engine"
    command = (
        'env | grep -E "^(MASTER_ADDR|MASTER_PORT|WORLD_SIZE|RANK|NODE_RANK|NNODES|NPROC_PER_NODE|LOCAL_WORLD_SIZE)=" | sort; '
        'if [ "$RANK" = 0 ]; then echo "hello rank0" | nc -l -p $MASTER_PORT -w 20 > /tmp/got; cat /tmp/got; '
        'else for i in $(seq 1 50); do echo "hi from rank1" | nc -w 2 $MASTER_ADDR $MASTER_PORT && break; sleep 0.2; done; fi'
    )
    job = settle_until(_submit(cluster, command), timeout=60)
    assert job.state == Job.State.SUCCEEDED, job.state_reason
    logs = {r.rank: r.log for r in job.replicas.all()}
    port = runtime.master_port(job)
    for rank in (0, 1):
        assert f"RANK={rank}" in logs[rank] and f"NODE_RANK={rank}" in logs[rank]
        assert "WORLD_SIZE=2" in logs[rank] and "NNODES=2" in logs[rank]
        master = runtime.container_name(job, 0, job.attempt)
        assert f"MASTER_ADDR={master}" in logs[rank] and f"MASTER_PORT={port}" in logs[rank]
        assert "NPROC_PER_NODE=2" in logs[rank] and "LOCAL_WORLD_SIZE=2" in logs[rank]
    assert "hi from rank1" in logs[0], "rank 1 reached rank 0 on MASTER_ADDR:MASTER_PORT"


def test_a_failing_replica_stops_its_peer_and_fails_the_job_with_its_code(
    running_cluster, settle_until
):
    cluster = running_cluster(2, gpus=2)
    job = _submit(cluster, 'if [ "$RANK" = 1 ]; then sleep 1; exit 7; fi; exec sleep 60')
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        repair.reconcile()
        job.refresh_from_db()
        if "stopping the other replicas" in job.state_reason:
            break
        time.sleep(0.3)
    stopping.kill(job.pk)  # the scheduled SIGKILL, were the grace period over
    job = settle_until(job)
    assert job.state == Job.State.FAILED and job.exit_code == 7
    assert job.state_reason == "rank 1 exited with code 7"
    assert job.replicas.get(rank=0).state == Replica.State.EXITED


def test_retries_start_a_new_attempt(running_cluster, settle_until):
    cluster = running_cluster(1)
    job = _submit(cluster, 'echo attempt $SUANLI_ATTEMPT; [ "$SUANLI_ATTEMPT" = 2 ]', retries=1)
    settle_until(job, states=("queued", "succeeded", "failed"))
    dispatch.dispatch(cluster.pk)
    job = settle_until(job)
    assert job.state == Job.State.SUCCEEDED and job.attempt == 2
    assert [e.kind for e in job.events.all()].count("retrying") == 1


def test_missing_image_fails_the_job_with_the_engines_message(running_cluster, settle_until):
    cluster = running_cluster(1)
    Cluster.objects.filter(pk=cluster.pk).update(image_reference="suanli/no-such-image:1")
    job = _submit(cluster, "true")
    job = settle_until(job)
    assert job.state == Job.State.FAILED
    assert "pulling suanli/no-such-image:1" in " ".join(e.message for e in job.events.all())
    prefix = f"could not start: rank 0 on {job.replicas.get().host.name}: "
    assert job.state_reason.startswith(prefix) and len(job.state_reason) > len(prefix) + 5


def test_auto_release_after_the_last_job(running_cluster, settle_until):
    cluster = running_cluster(1, release_policy="after_last_job")
    job = settle_until(_submit(cluster, "true", name="train"))
    assert job.state == Job.State.SUCCEEDED
    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.RELEASED
    assert cluster.state_reason == "released automatically after job train finished"


def test_jobs_on_a_released_cluster_are_refused(running_cluster):
    cluster = running_cluster(1)
    services.cluster_release(cluster=cluster)
    with pytest.raises(Exception, match="jobs run only on a pending or running cluster"):
        services.job_submit(cluster=cluster, spec=JobSpec(name="late", command="true"))


def test_reconciler_removes_leftovers_and_marks_lost_replicas(
    running_cluster, settle_until, engine_urls
):
    cluster = running_cluster(1)
    job = _submit(cluster, "sleep 60")
    replica = job.replicas.get()
    client = _client(replica)
    client.containers.get(replica.container_name).remove(force=True)  # vanished behind our back
    report = repair.reconcile()
    assert report["lost"] == 1
    job = settle_until(job)
    assert job.state == Job.State.FAILED and "was lost" in job.state_reason
    stray = client.containers.run(
        "suanli/busybox:latest",
        "sleep 60",
        detach=True,
        labels={"suanli.job": "999999"},
        name="suanli-stray",
    )
    assert repair.reconcile()["removed"] == 1
    with pytest.raises(docker.errors.NotFound):
        client.containers.get(stray.id)


def test_another_researcher_gets_404_for_job_pages(client, running_cluster, bob):
    job = _submit(running_cluster(1), "sleep 5")
    client.force_login(bob)
    assert client.get(reverse("job_detail", args=[job.pk])).status_code == 404
    assert client.get(reverse("job_log", args=[job.pk])).status_code == 404
    assert client.post(reverse("job_cancel", args=[job.pk])).status_code == 404
    job.refresh_from_db()
    assert not job.cancel_requested


def _job_form(**fields):
    data = {
        "name": "train",
        "command": "echo hi",
        "launcher": "plain",
        "env": "",
        "workdir": "/workspace",
        "checkpoint_dir": "/workspace/checkpoints",
        "max_runtime_min": "",
        "retries": "0",
    }
    data.update(fields)
    return data


@pytest.mark.parametrize(
    "fields, field, words",
    [
        ({"env": "1BAD=x"}, "env", "is not a variable name"),
        ({"env": "NOEQUALS"}, "env", "write KEY=VALUE"),
        ({"env": "RANK=3"}, "env", "RANK is set by Suanli itself"),
        ({"env": "NCCL_DEBUG=INFO"}, "env", "NCCL_DEBUG is set by Suanli itself"),
        ({"env": "A=1\nA=2"}, "env", "A is set twice"),
        ({"command": "x" * 20000}, "command", "at most 16,384"),
        ({"command": ""}, "command", "required"),
        ({"checkpoint_dir": "checkpoints"}, "checkpoint_dir", "is relative"),
        ({"retries": "99"}, "retries", "less than or equal to 10"),
        ({"max_preemptions": "101"}, "max_preemptions", "less than or equal to 100"),
        ({"preemption_script": "x" * 20000}, "preemption_script", "at most 16,384"),
    ],
)
def test_job_form_bad_input(client, alice, running_cluster, fields, field, words):
    cluster = running_cluster(1)
    client.force_login(alice)
    response = client.post(reverse("job_new", args=[cluster.pk]), _job_form(**fields))
    assert response.status_code == 200
    assert words in " ".join(response.context["form"].errors.get(field, [])), response.context[
        "form"
    ].errors
    assert not Job.objects.exists()


def test_job_form_submits_with_env_and_page_shows_it_queued(client, alice, running_cluster):
    cluster = running_cluster(1)
    client.force_login(alice)
    response = client.post(
        reverse("job_new", args=[cluster.pk]), _job_form(env="LR=3e-4\nWANDB_MODE=offline")
    )
    assert response.status_code == 302
    job = Job.objects.get()
    assert job.env == {"LR": "3e-4", "WANDB_MODE": "offline"}
    assert "queued" in client.get(response.url).content.decode()


def test_job_on_a_released_cluster_is_refused_on_the_form(client, alice, running_cluster):
    cluster = running_cluster(1)
    services.cluster_release(cluster=cluster)
    client.force_login(alice)
    response = client.post(reverse("job_new", args=[cluster.pk]), _job_form())
    assert "jobs run only on a pending or running cluster" in response.content.decode()
    assert not Job.objects.exists()


def test_cancel_on_a_finished_job_says_so(client, alice, running_cluster, settle_until):
    job = settle_until(_submit(running_cluster(1), "true"))
    client.force_login(alice)
    body = client.post(reverse("job_cancel", args=[job.pk]), follow=True).content.decode()
    assert "there is nothing to cancel" in body
    assert client.get(reverse("job_log", args=[job.pk])).status_code == 200


def test_log_download_is_rank_labelled_after_the_container_is_gone(
    client, alice, running_cluster, settle_until
):
    job = settle_until(_submit(running_cluster(2, gpus=2), "echo I am $RANK"), timeout=40)
    client.force_login(alice)
    response = client.get(reverse("job_log", args=[job.pk]))
    body = response.content.decode()
    assert "[rank 0] I am 0" in body and "[rank 1] I am 1" in body
    assert response["Content-Disposition"].startswith("attachment;")


def test_a_job_past_its_maximum_runtime_is_stopped(running_cluster, settle_until):
    from datetime import timedelta

    from django.utils import timezone

    job = _submit(running_cluster(1), "exec sleep 60", max_runtime_s=60)
    Job.objects.filter(pk=job.pk).update(running_since=timezone.now() - timedelta(seconds=61))
    assert repair.reconcile()["timed_out"] == 1
    job = settle_until(job)
    assert job.state == Job.State.CANCELLED
    assert job.state_reason == "stopped: ran past its maximum runtime of 1 min"


def test_a_down_engine_loses_its_replicas_and_the_job_waits_without_using_a_retry(
    running_cluster,
):
    job = _submit(running_cluster(1), "exec sleep 60")
    replica = job.replicas.get()
    from jobs.models import Host

    Host.objects.filter(pk=replica.host_id).update(
        state=Host.State.DOWN
    )  # as a failed check leaves it
    assert repair.reconcile()["lost"] == 1
    job.refresh_from_db()
    assert job.state == Job.State.QUEUED and job.host_restarts == 1, job.state_reason
    assert job.state_reason.startswith("rank 0 lost to gpu-")
    assert "no retry used" in job.state_reason
    assert job.replicas.get().host_fault
    assert dispatch.dispatch(job.cluster_id) is None, "not while its node's host is down"
    job.refresh_from_db()
    assert "node 0 is on gpu-" in job.state_reason and "(down)" in job.state_reason
    Host.objects.filter(pk=replica.host_id).update(state=Host.State.ACTIVE)
    repair.reconcile()  # the engine is back: the orphaned container is removed
    with pytest.raises(docker.errors.NotFound):
        _client(replica).containers.get(replica.container_name)
    services.job_cancel(job=job, by="alice")


def test_a_start_interrupted_by_a_dead_worker_is_finished_by_the_reconciler(
    running_cluster, settle_until, work_queue
):
    cluster = running_cluster(1)
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="half", command="echo resumed"))
    # What a worker killed between claiming the job and creating its container leaves (the
    # kill -9 test cannot hit that instant reliably, so the crash point is cut here):
    from unittest import mock

    with mock.patch.object(dispatch, "start_replicas"):
        dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    assert job.state == Job.State.STARTING and job.replicas.get().state == Replica.State.CREATING
    assert repair.reconcile(stuck_after_s=0)["restarted"] == 1  # queued on a worker, once
    assert repair.reconcile(stuck_after_s=0)["restarted"] == 1
    queued = django_rq.get_queue("docker").job_ids
    assert [i for i in queued if i.startswith("start-")] == [f"start-{job.pk}"]
    work_queue("docker")
    assert settle_until(job).state == Job.State.SUCCEEDED
    assert "resumed" in job.replicas.get().log


def test_resize_is_refused_while_a_job_runs(running_cluster, settle_until):
    cluster = running_cluster(1)
    job = _submit(cluster, "exec sleep 60")
    with pytest.raises(Exception, match="resize when no job runs"):
        services.cluster_resize(cluster=cluster, nodes=2)
    services.job_cancel(job=job, by="alice")
    stopping.stop(job.pk)
    settle_until(job)
    assert services.cluster_resize(cluster=cluster, nodes=2).nodes == 2


def test_nothing_typed_becomes_a_docker_argument(client, alice, running_cluster, storage_root):
    cluster = running_cluster(1)
    client.force_login(alice)
    response = client.post(
        reverse("job_new", args=[cluster.pk]),
        _job_form(
            command="sleep 30 --privileged --cap-add=SYS_ADMIN -v /:/host",
            env="OPTS=--privileged --device=/dev/mem --pid=host\nVOLS=-v /var/run/docker.sock:/sock",
            workdir="/workspace --privileged",
        ),
    )
    assert "may not contain spaces" in " ".join(response.context["form"].errors.get("workdir", []))
    response = client.post(
        reverse("job_new", args=[cluster.pk]),
        _job_form(
            command="sleep 30 --privileged --cap-add=SYS_ADMIN -v /:/host",
            env="OPTS=--privileged --device=/dev/mem --pid=host\nVOLS=-v /var/run/docker.sock:/sock",
        ),
    )
    assert response.status_code == 302
    job = Job.objects.get()
    dispatch.dispatch(cluster.pk)
    replica = job.replicas.get()
    info = _client(replica).api.inspect_container(replica.container_name)
    host_config = info["HostConfig"]
    assert host_config["Privileged"] is False and not host_config.get("CapAdd")
    assert not host_config.get("Devices") and host_config["PidMode"] == ""
    assert all(m["Source"].startswith(str(storage_root)) for m in info["Mounts"])
    assert not any("docker.sock" in m["Source"] for m in info["Mounts"])
    # What was typed arrives as data: the shell's argument and environment values.
    assert info["Config"]["Cmd"][-1] == "sleep 30 --privileged --cap-add=SYS_ADMIN -v /:/host"
    assert "OPTS=--privileged --device=/dev/mem --pid=host" in info["Config"]["Env"]
    services.job_cancel(job=job, by="alice")
    stopping.kill(job.pk)


def test_a_cpu_instance_gets_the_cpus_and_memory_of_its_type(running_cluster, settle_until):
    """cpu-2c-4g: 2 CPUs and 4 GiB in the engine's own record, not the engine's defaults
    (all of it for the job on a cluster without a workspace, which would hold its share)."""
    cluster = running_cluster(1, cpu="cpu-2c-4g", workspace=False)
    job = _submit(cluster, "sleep 30")
    replica = job.replicas.get()
    host_config = _client(replica).api.inspect_container(replica.container_name)["HostConfig"]
    assert host_config["NanoCpus"] == 2 * 10**9
    assert host_config["Memory"] == 4 * 2**30
    services.job_cancel(job=job, by="alice")
    stopping.stop(job.pk)
    assert settle_until(job).state == Job.State.CANCELLED

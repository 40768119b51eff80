"""Workspaces: one hardened container per live node of a running cluster, from placement to
release, on the node's own host, beside the jobs (jobs/nodes/workspaces.py)."""

import asyncio

import docker
import pytest
from django.utils import timezone
from waiting import until

from jobs import tasks
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.files.storage import VolumeSpec
from jobs.models import Cluster, ClusterEvent
from jobs.nodes import runtime, workspaces
from jobs.runs import dispatch, repair
from monitoring.models import Sample
from monitoring.monitor import Monitor

pytestmark = pytest.mark.django_db


def _monitor(ticks: int) -> None:
    monitor = Monitor(publish=False)
    try:
        asyncio.run(monitor.run(ticks=ticks))
    finally:
        monitor.close()


def _workspaces(engine_urls, cluster_id) -> dict[str, list]:
    """Engine URL -> the cluster's workspace containers there."""
    found = {}
    for url in engine_urls:
        client = docker.DockerClient(base_url=url, timeout=10)
        found[url] = client.containers.list(
            all=True, filters={"label": [workspaces.LABEL, f"suanli.cluster={cluster_id}"]}
        )
    return found


def _run(container, *cmd) -> tuple[int, str]:
    code, out = container.exec_run(list(cmd), **{"user": container.attrs["Config"]["User"]})
    return code, out.decode().strip()


def test_a_two_node_cluster_has_a_hardened_workspace_per_node_and_release_removes_them(
    running_cluster, engine_urls, alice
):
    cluster = running_cluster(2, gpus=2, volumes=(VolumeSpec("work", "/workspace"),))
    nodes = list(cluster.node_set.filter(released_at__isnull=True).select_related("host"))
    assert {n.host.engine_url for n in nodes} == set(engine_urls[:2]), "one node per host"
    assert tasks.cluster_network_ensure(cluster.pk).endswith("-x"), "made with the overlay"
    on = _workspaces(engine_urls[:2], cluster.pk)
    for node in nodes:
        (container,) = on[node.host.engine_url]
        node.refresh_from_db()
        assert container.id == node.workspace_container
        assert container.name == f"suanli-ws-c{cluster.pk}-n{node.index}"
        assert container.status == "running"
        config, host_config = container.attrs["Config"], container.attrs["HostConfig"]
        uid = runtime.tenant_uid(alice.pk)
        assert config["User"] == f"{uid}:{uid}"
        assert host_config["CapDrop"] == ["ALL"] and not host_config["Privileged"]
        assert host_config["SecurityOpt"] == ["no-new-privileges"] and host_config["Init"]
        assert host_config["PidsLimit"] > 0 and host_config["Memory"] > 0
        assert config["Entrypoint"] == workspaces.KEEP_UP, "not the image's ENTRYPOINT"
        assert container.labels["suanli.node"] == str(node.pk)
        assert host_config["NetworkMode"] == f"suanli-c{cluster.pk}-x"
        assert [m["Destination"] for m in container.attrs["Mounts"]] == ["/workspace"]
        assert _run(container, "id", "-u") == (0, str(uid))
        env = dict(line.split("=", 1) for line in config["Env"])
        assert env["HOME"] == "/workspace" and env["NODE_RANK"] == str(node.index)
    # The nodes reach each other by their workspaces' names on the cluster's network.
    first, second = on[nodes[0].host.engine_url][0], on[nodes[1].host.engine_url][0]
    second.exec_run(["nc", "-l", "-p", "7000"], user=second.attrs["Config"]["User"], detach=True)
    reach = f"echo hi | nc -w 5 suanli-ws-c{cluster.pk}-n1 7000"
    until(lambda: _run(first, "sh", "-c", reach)[0] == 0, what="node 0 reaches node 1")

    services.cluster_release(cluster=cluster)
    assert tasks.cluster_network_remove(cluster.pk)
    assert _workspaces(engine_urls[:2], cluster.pk) == {url: [] for url in engine_urls[:2]}
    assert not cluster.node_set.exclude(workspace_container="").exists()


def test_a_job_runs_beside_the_workspace_and_sees_its_files(running_cluster, settle_until):
    cluster = running_cluster(1, volumes=(VolumeSpec("work", "/workspace"),))
    tasks.cluster_network_ensure(cluster.pk)
    workspace = workspaces.running(cluster, 0)
    assert _run(workspace, "sh", "-c", "echo from-the-workspace > /workspace/note")[0] == 0
    job = services.job_submit(
        cluster=cluster, spec=JobSpec(name="reads", command="cat /workspace/note")
    )
    dispatch.dispatch(cluster.pk)
    job = settle_until(job)
    assert job.state == "succeeded", job.state_reason
    assert "from-the-workspace" in job.replicas.get().log
    workspace = workspaces.running(cluster, 0)
    assert workspace.status == "running", "the job did not touch it"
    # Together they hold the node's share of the host, no more: 25 % and 75 % by default.
    long = services.job_submit(cluster=cluster, spec=JobSpec(name="long", command="sleep 60"))
    dispatch.dispatch(cluster.pk)
    replica = long.replicas.get()
    node = cluster.node_set.select_related("host").get()
    cpus, memory = runtime.node_limits(cluster, node.host)
    client = docker.DockerClient(base_url=node.host.engine_url, timeout=10)
    inspected = client.api.inspect_container(replica.container_name)["HostConfig"]
    assert workspace.attrs["HostConfig"]["Memory"] == int(memory * 0.25)
    assert inspected["Memory"] == int(memory * 0.75)
    assert workspace.attrs["HostConfig"]["NanoCpus"] + inspected["NanoCpus"] == int(cpus * 1e9)


def test_a_batch_cluster_has_no_workspace(running_cluster, engine_urls):
    cluster = running_cluster(1, workspace=False)
    tasks.cluster_network_ensure(cluster.pk)
    assert _workspaces(engine_urls[:1], cluster.pk) == {engine_urls[0]: []}
    with pytest.raises(workspaces.WorkspaceError, match="without workspaces"):
        workspaces.running(cluster, 0)


def test_the_reconciler_restarts_a_stopped_workspace_and_a_resize_removes_a_nodes(
    running_cluster, engine_urls
):
    cluster = running_cluster(2, gpus=2)
    tasks.cluster_network_ensure(cluster.pk)
    node0 = workspaces.running(cluster, 0)
    _run(node0, "kill", "1")  # the researcher stops their own workspace from inside
    until(lambda: node0.reload() or node0.status == "exited", what="the workspace stopped")
    with pytest.raises(workspaces.WorkspaceError, match="exited"):
        workspaces.running(cluster, 0)
    repair.reconcile()
    assert workspaces.running(cluster, 0).id == node0.id, "the same container, files kept"

    cluster = services.cluster_resize(cluster=Cluster.objects.get(pk=cluster.pk), nodes=1)
    tasks.cluster_network_ensure(cluster.pk)
    left = _workspaces(engine_urls[:2], cluster.pk)
    assert [c.name for cs in left.values() for c in cs] == [f"suanli-ws-c{cluster.pk}-n0"]
    with pytest.raises(workspaces.WorkspaceError, match="has no node 1"):
        workspaces.running(cluster, 1)
    assert ClusterEvent.objects.filter(cluster=cluster, kind="resized").exists()


def test_login_names_are_short_and_exact():
    assert workspaces.login_name(42, 1) == "c42-1"
    assert workspaces.parse_login("c42-1") == (42, 1)
    assert workspaces.parse_login("c42") == (42, 0)
    for bad in ("c0-1", "c42-", "42-1", "c42-1-2", "c42;id", "C42-1", "c42-1\n", ""):
        assert workspaces.parse_login(bad) is None, bad


@pytest.mark.django_db(transaction=True)  # the monitor reads through its executor's connections
def test_the_monitor_samples_the_workspace_and_a_job_beside_it_as_one_node(running_cluster):
    cluster = running_cluster(1)
    tasks.cluster_network_ensure(cluster.pk)
    workspace = workspaces.running(cluster, 0)
    busy = ["sh", "-c", "timeout 30 sh -c 'while :; do :; done'"]
    workspace.exec_run(busy, user=workspace.attrs["Config"]["User"], detach=True)
    _monitor(4)
    interactive = Sample.objects.filter(cluster=cluster)
    assert interactive.exists() and not interactive.exclude(job=None).exists()
    busy_pct = workspace.attrs["HostConfig"]["NanoCpus"] / 1e7  # its CPU limit, in %
    assert max(s.cpu_pct for s in interactive) > 0.6 * busy_pct, "interactive work shows"

    job = services.job_submit(cluster=cluster, spec=JobSpec(name="j", command="sleep 30"))
    dispatch.dispatch(cluster.pk)
    Sample.objects.all().delete()
    _monitor(4)
    rows = list(Sample.objects.filter(cluster=cluster).values_list("at", "node_index", "job_id"))
    assert rows and all(job_id == job.pk for _, _, job_id in rows), "the row names the job"
    assert len(rows) == len({(at, node) for at, node, _ in rows}), "one row per node a second"
    assert max(s.cpu_pct for s in Sample.objects.filter(cluster=cluster)) > 0.6 * busy_pct


def test_the_api_turns_the_workspace_off_for_batch_use(alice, priced, paper_host):
    from django.test import Client

    from console.models import ApiToken

    _, token = ApiToken.issue(user=alice, name="t")
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    body = {"gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
            "image": "suanli/busybox:latest"}  # fmt: skip
    made = api.post("/api/v1/clusters", {**body, "name": "inter"}, content_type="application/json")
    assert made.status_code == 201 and made.json()["workspace"] is True
    batch = api.post(
        "/api/v1/clusters", {**body, "name": "batch", "workspace": False},
        content_type="application/json",
    )  # fmt: skip
    assert batch.status_code == 201 and batch.json()["workspace"] is False
    assert not Cluster.objects.get(name="batch").workspace
    wrong = api.post(
        "/api/v1/clusters", {**body, "name": "x", "workspace": "no"},
        content_type="application/json",
    )  # fmt: skip
    assert wrong.status_code == 400 and wrong.json()["fields"] == {
        "workspace": ["Give true or false."]
    }


@pytest.mark.django_db(transaction=True)
def test_a_workspace_start_locks_its_node_only_so_a_stop_holding_the_cluster_does_not_deadlock(
    make_cluster, alice, paper_host
):
    """A stop locks its cluster, then its nodes; a workspace's start locks its node. Had
    the start's lock taken the cluster's row too (as Django's exists() does with OF), the
    two would wait on each other (a deadlock seen in CI's stop-and-start test)."""
    import psycopg
    from django.db import connection, transaction

    from jobs.models import Node
    from jobs.placement import scheduler

    cluster = make_cluster(alice, "held")
    scheduler.place_pending()
    node = Node.objects.get(cluster=cluster, released_at__isnull=True)
    s = connection.settings_dict
    stop = psycopg.connect(
        host=s["HOST"], port=s["PORT"], user=s["USER"], password=s["PASSWORD"], dbname=s["NAME"]
    )
    try:
        # The stop's first step, in a transaction of its own: its cluster's row, locked.
        stop.execute("SELECT id FROM jobs_cluster WHERE id = %s FOR UPDATE", (cluster.pk,))
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SET LOCAL lock_timeout = '3s'")
            assert workspaces._lock_if_live(node)  # no wait on the cluster's row
            # ...and the node's own row is held: the stop's next step waits for it.
            stop.execute("SET lock_timeout = '200ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                stop.execute("SELECT id FROM jobs_node WHERE id = %s FOR UPDATE", (node.pk,))
        stop.rollback()
        Node.objects.filter(pk=node.pk).update(released_at=timezone.now())
        with transaction.atomic():
            assert not workspaces._lock_if_live(node)  # released: no start
    finally:
        stop.close()

"""bench/job_start: submit -> all replicas running, for 1-node and 2-node jobs on the two
test engines, beside a bare `docker run -d` of the same image on the same engine, in the
same run. The "warm worker" is this process calling the dispatch task's body directly
(what an idle RQ worker does on dequeue), so the RQ hop itself is not in the figure.

The cluster's network is made at placement (the task placement queues), not at job start:
a second case, `cluster_network`, times that per cluster, for a single-host bridge and a
two-host swarm overlay, beside `docker network create` of a bridge on the same engine.
The same task then starts a workspace on each node, on that network: timed apart
(`workspaces_median_s`), so that the network's figure stays the network's.
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402

django.setup()

import docker  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402

from bench.common import register_host  # noqa: E402
from jobs import tasks  # noqa: E402
from jobs.clusters import services
from jobs.models import GpuModel, GpuSlot, Image, Job  # noqa: E402
from jobs.nodes import network, workspaces
from jobs.placement import scheduler
from jobs.placement.catalog import seed_catalog  # noqa: E402
from jobs.runs import dispatch, exits, stopping

RUNS = int(os.environ.get("BENCH_RUNS", 15))
ENGINES = [u for u in os.environ["SUANLI_TEST_ENGINES"].split(",") if u]
IMAGE = os.environ.get("SUANLI_TEST_IMAGE", "suanli/busybox:latest")
HOSTS = [f"bench-{i}" for i in range(len(ENGINES))]


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))]


def bare_docker_run(urls: list[str], net_driver: str | None = None) -> list[float]:
    """`docker run -d` of the image, one container per engine in `urls` one after the
    other (as the runner starts replicas), on the engines' default bridge or on a network
    of `net_driver` made beforehand (what a cluster's replicas are on)."""
    clients = [docker.DockerClient(base_url=url, timeout=30) for url in urls]
    for c in clients:  # what an interrupted run left
        for old in c.containers.list(all=True, filters={"name": "bench-bare-"}):
            old.remove(force=True)
    for old in clients[0].networks.list(names=["bench-bare-net"]):
        old.remove()
    net = None
    if net_driver == "bridge":
        net = clients[0].networks.create("bench-bare-net", driver="bridge")
    elif net_driver == "overlay":
        net = clients[0].networks.create("bench-bare-net", driver="overlay", attachable=True)
    times = []
    for i in range(RUNS):
        t0 = time.perf_counter()
        made = [
            c.containers.run(IMAGE, "sleep 30", detach=True, name=f"bench-bare-{i}-{n}",
                             network=net.name if net else None)
            for n, c in enumerate(clients)
        ]  # fmt: skip
        times.append(time.perf_counter() - t0)
        for c in made:
            c.remove(force=True)
    if net is not None:
        net.remove()
    return times


def setup():
    seed_catalog()
    model = GpuModel.objects.get(slug="a100-80gb")
    for name, url in zip(HOSTS, ENGINES, strict=False):
        register_host(name, url, gpus=8)
    owner, _ = get_user_model().objects.get_or_create(username="bench-jobs")
    for cluster in owner.clusters.exclude(state="released"):  # an earlier, interrupted run
        teardown(cluster)
    # GPUs of released clusters that another bench (or an interrupted run) left held on
    # these hosts: what the worker's task after a release does, so both cases fit.
    left = GpuSlot.objects.filter(host__name__in=HOSTS, node__released_at__isnull=False)
    for cluster_id in set(left.values_list("node__cluster_id", flat=True)):
        tasks.cluster_network_remove(cluster_id)
    return owner, model, Image.objects.get(reference=IMAGE)


def job_start(owner, model, image, nodes: int) -> list[float]:
    spec = services.ClusterSpec(
        name=f"bench-{nodes}",
        nodes=nodes,
        gpu_model=model,
        gpus_per_node=8 if nodes > 1 else 1,
        image=image,
        release_policy="never",
    )
    cluster = services.cluster_create(owner=owner, spec=spec)
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    tasks.cluster_network_ensure(cluster.pk)  # what a worker does right after placement
    times = []
    for i in range(RUNS):
        t0 = time.perf_counter()
        job = services.job_submit(
            cluster=cluster, spec=services.JobSpec(name=f"b{i}", command="exec sleep 30")
        )
        dispatch.dispatch(cluster.pk)
        job.refresh_from_db()
        times.append(time.perf_counter() - t0)
        assert job.state == Job.State.RUNNING, job.state_reason
        services.job_cancel(job=job, by="bench")
        stopping.kill(job.pk)
        for replica in job.replicas.all():
            exits.replica_exited(replica.pk)
        job.refresh_from_db()
    teardown(cluster)
    return times


def bare_network_create(url: str) -> list[float]:
    client = docker.DockerClient(base_url=url, timeout=30)
    times = []
    for i in range(RUNS):
        t0 = time.perf_counter()
        net = client.networks.create(f"bench-bare-net-{i}", driver="bridge")
        times.append(time.perf_counter() - t0)
        net.remove()
    return times


def teardown(cluster) -> None:
    """Release the cluster and remove what it left on the engines as a worker does after a
    release (its workspaces, then its network), and say so if anything stayed."""
    services.cluster_release(cluster=cluster)
    deadline = time.monotonic() + 60
    # As the worker's task (tasks.cluster_network_remove), again while a container that
    # was on the network is still being removed.
    while True:
        gone = workspaces.remove(cluster.pk)
        exits.free_gpus(cluster_id=cluster.pk)
        if network.remove(cluster.pk) and gone:
            return
        assert time.monotonic() < deadline, f"cluster {cluster.pk}: workspaces or network left"
        time.sleep(0.5)


def network_setup(owner, model, image, nodes: int) -> tuple[str, list[float], list[float]]:
    """Seconds from placement to the cluster's network existing, per cluster; then what
    the placement's task adds after it (a workspace on each node, started on that
    network), timed apart."""
    times, with_workspaces, driver = [], [], ""
    for i in range(RUNS):
        spec = services.ClusterSpec(
            name=f"bench-net-{nodes}-{i}", nodes=nodes, gpu_model=model,
            gpus_per_node=8 if nodes > 1 else 1, image=image, release_policy="never",
        )  # fmt: skip
        cluster = services.cluster_create(owner=owner, spec=spec)
        scheduler.place_pending()
        hosts = list(cluster.node_set.values_list("host_id", flat=True))
        driver = network.driver_for(hosts)
        name = network.name_for(cluster.pk, driver)
        t0 = time.perf_counter()
        assert network.ensure(cluster.pk) == name
        t1 = time.perf_counter()
        assert tasks.cluster_network_ensure(cluster.pk) == name  # no workspace failed
        t2 = time.perf_counter()
        times.append(t1 - t0)
        with_workspaces.append(t2 - t1)
        teardown(cluster)
    return driver, times, with_workspaces


def main():
    owner, model, image = setup()
    bare = bare_docker_run(ENGINES[:1])
    for nodes in (1, 2):
        times = job_start(owner, model, image, nodes)
        driver = "bridge" if nodes == 1 else "overlay"
        same = bare_docker_run(ENGINES[:nodes], driver)
        ratio = statistics.median(times) / statistics.median(bare)
        print(json.dumps({
            "bench": "job_start", "nodes": nodes, "runs": RUNS, "network": driver,
            "median_s": round(statistics.median(times), 3), "p95_s": round(pct(times, 0.95), 3),
            "bare_docker_run_median_s": round(statistics.median(bare), 3),
            "bare_docker_run_p95_s": round(pct(bare, 0.95), 3),
            "ratio": round(ratio, 2),
            # The same containers started bare on a network of the same kind, one per node.
            "bare_same_network_median_s": round(statistics.median(same), 3),
            "ratio_same_network": round(statistics.median(times) / statistics.median(same), 2),
        }), flush=True)  # fmt: skip
    bare_net = bare_network_create(ENGINES[0])
    for nodes in (1, 2):
        driver, times, with_workspaces = network_setup(owner, model, image, nodes)
        print(json.dumps({
            "bench": "cluster_network", "driver": driver, "nodes": nodes, "clusters": RUNS,
            "setup_median_s": round(statistics.median(times), 3),
            "setup_p95_s": round(pct(times, 0.95), 3),
            "bare_bridge_create_median_s": round(statistics.median(bare_net), 3),
            "ratio": round(statistics.median(times) / statistics.median(bare_net), 2),
            # Then the rest of the placement's task: a workspace started on each node.
            "workspaces_median_s": round(statistics.median(with_workspaces), 3),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

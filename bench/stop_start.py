"""bench/stop_start: stop and start of a 1-node cluster (its workspace stopped and kept,
then started again on the same host with every file), beside `docker stop` / `docker
start` of the same workspace container on the same engine, in the same run.

"Stop" is the service (jobs cancelled, GPUs back, the cluster stopped) and the task a
worker runs right after it (the workspace stopped); "start" is the service (the same GPUs
taken again on the same host) and the task after placement (network and workspace). The
RQ hop is not in the figures: this process calls the tasks' bodies directly, as an idle
worker does on dequeue.
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
from jobs.models import Cluster, GpuModel, Image  # noqa: E402
from jobs.nodes import workspaces
from jobs.placement.catalog import seed_catalog  # noqa: E402

RUNS = int(os.environ.get("BENCH_RUNS", 15))
ENGINE = [u for u in os.environ["SUANLI_TEST_ENGINES"].split(",") if u][0]
IMAGE = os.environ.get("SUANLI_TEST_IMAGE", "suanli/busybox:latest")


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))]


def main():
    seed_catalog()
    register_host("bench-0", ENGINE, gpus=8)
    owner, _ = get_user_model().objects.get_or_create(username="bench-stop")
    for old in owner.clusters.exclude(state="released"):  # an earlier, interrupted run
        services.cluster_release(cluster=old)
        tasks.cluster_network_remove(old.pk)
    spec = services.ClusterSpec(
        name="bench-stop", nodes=1, gpu_model=GpuModel.objects.get(slug="a100-80gb"),
        gpus_per_node=1, image=Image.objects.get(reference=IMAGE), release_policy="never",
    )  # fmt: skip
    cluster = services.cluster_create(owner=owner, spec=spec)
    tasks.place_pending()
    assert tasks.cluster_network_ensure(cluster.pk), "placed and made"
    container = docker.DockerClient(base_url=ENGINE, timeout=30).containers.get(
        workspaces.container_name(cluster.pk, 0)
    )
    first_id = container.id
    stops, starts = [], []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        services.cluster_stop(cluster=cluster, by="bench")
        assert tasks.cluster_workspaces_stop(cluster.pk)
        stops.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        services.cluster_start(cluster=cluster, by="bench")
        tasks.cluster_network_ensure(cluster.pk)
        starts.append(time.perf_counter() - t0)
        container.reload()
        assert container.status == "running" and container.id == first_id, "the same one"
    assert Cluster.objects.get(pk=cluster.pk).state == "running"
    bare_stops, bare_starts = [], []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        container.stop(timeout=10)
        bare_stops.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        container.start()
        bare_starts.append(time.perf_counter() - t0)
    services.cluster_release(cluster=cluster)
    tasks.cluster_network_remove(cluster.pk)
    for what, ours, bare in (("stop", stops, bare_stops), ("start", starts, bare_starts)):
        print(json.dumps({
            "bench": "cluster_stop_start", "op": what, "nodes": 1, "runs": RUNS,
            "median_s": round(statistics.median(ours), 3), "p95_s": round(pct(ours, 0.95), 3),
            f"docker_{what}_median_s": round(statistics.median(bare), 3),
            f"docker_{what}_p95_s": round(pct(bare, 0.95), 3),
            "ratio": round(statistics.median(ours) / statistics.median(bare), 2),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

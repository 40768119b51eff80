"""bench/job_start: submit -> all replicas running, for 1-node and 2-node jobs on the two
test engines, beside a bare `docker run -d` of the same image on the same engine, in the
same run. The "warm worker" is this process calling the dispatch task's body directly
(what an idle RQ worker does on dequeue), so the RQ hop itself is not in the figure.
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
from jobs import runner, scheduler, services  # noqa: E402
from jobs.catalog import seed_catalog  # noqa: E402
from jobs.models import GpuModel, Image, Job  # noqa: E402

RUNS = int(os.environ.get("BENCH_RUNS", 15))
ENGINES = [u for u in os.environ["SUANLI_TEST_ENGINES"].split(",") if u]
IMAGE = os.environ.get("SUANLI_TEST_IMAGE", "suanli/busybox:latest")


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))]


def bare_docker_run(url: str) -> list[float]:
    client = docker.DockerClient(base_url=url, timeout=30)
    times = []
    for i in range(RUNS):
        t0 = time.perf_counter()
        c = client.containers.run(IMAGE, "sleep 30", detach=True, name=f"bench-bare-{i}")
        times.append(time.perf_counter() - t0)
        c.remove(force=True)
    return times


def setup():
    seed_catalog()
    model = GpuModel.objects.get(slug="a100-80gb")
    for i, url in enumerate(ENGINES):
        register_host(f"bench-{i}", url, gpus=8)
    owner, _ = get_user_model().objects.get_or_create(username="bench-jobs")
    for cluster in owner.clusters.exclude(state="released"):  # an earlier, interrupted run
        services.cluster_release(cluster=cluster)
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
    times = []
    for i in range(RUNS):
        t0 = time.perf_counter()
        job = services.job_submit(
            cluster=cluster, spec=services.JobSpec(name=f"b{i}", command="exec sleep 30")
        )
        runner.dispatch(cluster.pk)
        job.refresh_from_db()
        times.append(time.perf_counter() - t0)
        assert job.state == Job.State.RUNNING, job.state_reason
        services.job_cancel(job=job, by="bench")
        runner.kill(job.pk)
        for replica in job.replicas.all():
            runner.replica_exited(replica.pk)
        job.refresh_from_db()
    services.cluster_release(cluster=cluster)
    return times


def main():
    owner, model, image = setup()
    bare = bare_docker_run(ENGINES[0])
    for nodes in (1, 2):
        times = job_start(owner, model, image, nodes)
        ratio = statistics.median(times) / statistics.median(bare)
        print(json.dumps({
            "bench": "job_start", "nodes": nodes, "runs": RUNS,
            "median_s": round(statistics.median(times), 3), "p95_s": round(pct(times, 0.95), 3),
            "bare_docker_run_median_s": round(statistics.median(bare), 3),
            "bare_docker_run_p95_s": round(pct(bare, 0.95), 3),
            "ratio": round(ratio, 2),
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

"""bench/jobs_burst: 100 jobs submitted at once to 100 one-node clusters, started by two
real RQ workers (the Procfile's worker line) on the two test engines. Prints the time from
the first submit until every job has started (its containers ran: `running_since`, whether
or not it still runs then), and jobs started per second, beside 100 bare `docker run -d` of
the image all in parallel on the same engines, in the same run (`bare_docker_run_s`,
`bare_jobs_per_s`, `ratio` = ours / bare). Fails when a job did not start, and at once when a
cluster was not placed.

The clusters are placed before the clock starts, and the network and workspace tasks
placement queues for them are dropped: each job's start makes its cluster's network (as a
start that beats placement's task does), and no workspace is made (bench/job_start.py's
`cluster_network` times those).

BENCH_JOBS (100), BENCH_WORKERS (2); BENCH_BREAKDOWN=1 adds where the time went instead of
a timing: engine calls per job start (through a counting proxy in front of the engines,
which adds a hop) and the RQ tasks the workers ran (how many, how long, queued how long)."""

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402

django.setup()

import django_rq  # noqa: E402
import docker  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.db.models import Max  # noqa: E402
from django.utils import timezone  # noqa: E402
from rq.serializers import JSONSerializer  # noqa: E402

from bench.common import EngineCalls, register_host  # noqa: E402
from jobs import tasks  # noqa: E402
from jobs.clusters import services
from jobs.models import Cluster, GpuModel, GpuSlot, Image, Job, Replica  # noqa: E402
from jobs.placement import scheduler  # noqa: E402
from jobs.placement.catalog import seed_catalog  # noqa: E402

JOBS = int(os.environ.get("BENCH_JOBS", 100))
WORKERS = int(os.environ.get("BENCH_WORKERS", 2))
BREAKDOWN = os.environ.get("BENCH_BREAKDOWN") == "1"
ENGINES = [u for u in os.environ["SUANLI_TEST_ENGINES"].split(",") if u]
IMAGE = os.environ.get("SUANLI_TEST_IMAGE", "suanli/busybox:latest")


def procfile_worker() -> str:
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.startswith("worker:"):
            return line.split(":", 1)[1].strip()
    raise SystemExit("no worker in the Procfile")


def main():
    seed_catalog()
    model = GpuModel.objects.get(slug="a100-80gb")
    owner, _ = get_user_model().objects.get_or_create(username="bench-burst")
    clean_up(owner)
    # Several host rows per engine: 100 one-GPU nodes need 100 slots, as many on each
    # engine (a bridge network each: a test engine's address pool holds 64).
    per_engine = -(-JOBS // len(ENGINES))
    counter = EngineCalls(tempfile.mkdtemp(prefix="burst-")) if BREAKDOWN else None
    urls = [counter.url(u) for u in ENGINES] if counter else ENGINES
    for e, url in enumerate(urls):
        for i in range(-(-per_engine // 16)):
            register_host(f"burst-{e}-{i}", url, gpus=min(16, per_engine - 16 * i))
    image = Image.objects.get(reference=IMAGE)
    clusters = [
        services.cluster_create(
            owner=owner,
            spec=services.ClusterSpec(
                name=f"burst-{i}",
                nodes=1,
                gpu_model=model,
                gpus_per_node=1,
                image=image,
                release_policy="never",
            ),
        )
        for i in range(JOBS)
    ]
    scheduler.place_pending()
    if unplaced := [c for c in Cluster.objects.filter(pk__in=[c.pk for c in clusters])
                    if c.state != Cluster.State.RUNNING]:  # fmt: skip
        clean_up(owner)
        sys.exit(
            f"bench/jobs_burst: {len(unplaced)} clusters not placed: {unplaced[0].state_reason}"
        )
    for name in ("docker", "default"):  # placement's tasks, and what clean_up left to retry
        queue = django_rq.get_queue(name)
        queue.empty()
        for job_id in queue.scheduled_job_registry.get_job_ids():
            queue.scheduled_job_registry.remove(job_id, delete_job=True)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "LOG_LEVEL": "WARNING",
    }
    workers = [
        subprocess.Popen(
            ["/bin/sh", "-c", f"exec {procfile_worker()} --verbosity 0"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its work horses too are killed if it must be
        )
        for _ in range(WORKERS)
    ]
    try:
        time.sleep(3)  # workers warm: imported and listening
        if counter:
            counter.take()
        since = timezone.now()
        t0 = time.perf_counter()
        jobs = [
            services.job_submit(
                cluster=c, spec=services.JobSpec(name="burst", command="exec sleep 60")
            )
            for c in clusters
        ]
        submitted = time.perf_counter() - t0
        ids = [j.pk for j in jobs]
        # Until every job has started or ended without starting (a failed start says why).
        started = Job.objects.filter(pk__in=ids, running_since__isnull=False)
        not_started = Job.objects.filter(pk__in=ids, running_since__isnull=True)
        while not_started.exclude(state__in=Job.ENDED).exists():
            if time.perf_counter() - t0 > 300:
                break
            time.sleep(0.1)
        last = started.aggregate(last=Max("running_since"))["last"]
        total = (last - since).total_seconds() if last else time.perf_counter() - t0
        n_started = started.count()
        why = list(not_started.values_list("state", "state_reason")[:3])
        breakdown = _breakdown(counter, n_started) if counter else {}
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            try:
                w.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(w.pid, signal.SIGKILL)  # a horse stuck on an engine call
                w.wait()
    per_engine = Counter(
        int(name.split("-")[1])
        for name in Replica.objects.filter(job_id__in=ids).values_list("host__name", flat=True)
    )
    clean_up(owner)
    bare = bare_docker_run_parallel(
        [ENGINES[e] for e, n in sorted(per_engine.items()) for _ in range(n)]
    )
    print(json.dumps({
        "bench": "jobs_burst", "jobs": JOBS, "workers": WORKERS, "started": n_started,
        "submit_s": round(submitted, 3), "all_started_s": round(total, 3),
        "jobs_per_s": round(n_started / total, 1),
        "bare_docker_run_s": round(bare, 3), "bare_jobs_per_s": round(len(ids) / bare, 1),
        "ratio": round(total / bare, 2), **breakdown,
    }), flush=True)  # fmt: skip
    if n_started < JOBS:
        sys.exit(f"bench/jobs_burst: {JOBS - n_started} of {JOBS} jobs did not start: {why}")


def bare_docker_run_parallel(urls: list[str]) -> float:
    """Seconds for `docker run -d` of the image (`sleep 60`), one per entry of `urls` (an
    engine each), all in parallel: what the engines themselves take for the burst's
    containers, on their default bridge, without a cluster's network or hardening."""
    clients = {
        url: docker.DockerClient(base_url=url, timeout=120, max_pool_size=len(urls))
        for url in set(urls)
    }
    names = [f"burst-bare-{i}" for i in range(len(urls))]
    for client in clients.values():  # what an interrupted run left
        for old in client.containers.list(all=True, filters={"name": "burst-bare-"}):
            old.remove(force=True)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        made = list(pool.map(
            lambda url, name: clients[url].containers.run(IMAGE, ["sleep", "60"], name=name, detach=True),
            urls, names,
        ))  # fmt: skip
    took = time.perf_counter() - t0
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda c: c.remove(force=True), made))
    return took


def clean_up(owner) -> None:
    """What this run (or one cut short) left: its clusters released, its jobs' containers
    removed (by the ids it recorded: the engines are shared with other suites), their
    workspaces and networks removed as a worker does after a release, and their GPUs back.
    The engines cannot confirm those GPUs free when another suite's container on them has
    the same emulated GPU index: these hosts are this bench's own, so they are freed here."""
    clients = {url: docker.DockerClient(base_url=url, timeout=60) for url in ENGINES}
    for replica in (
        Replica.objects.filter(job__owner=owner).exclude(container_id="").select_related("host")
    ):
        url = ENGINES[int(replica.host.name.split("-")[1])]
        try:
            clients[url].api.remove_container(replica.container_id, force=True, v=True)
        except docker.errors.APIError as exc:
            if exc.status_code not in (404, 409):  # 409: being removed already
                raise
    Replica.objects.filter(job__owner=owner).exclude(container_id="").update(container_id="")
    Job.objects.filter(owner=owner).exclude(state__in=Job.ENDED).update(state=Job.State.CANCELLED)
    for cluster in owner.clusters.exclude(state=Cluster.State.RELEASED):
        services.cluster_release(cluster=cluster)
    for cluster_id in set(
        GpuSlot.objects.filter(node__cluster__owner=owner).values_list(
            "node__cluster_id", flat=True
        )
    ):
        tasks.cluster_network_remove(cluster_id)  # what a worker does after a release
    GpuSlot.objects.filter(host__name__startswith="burst-", node__released_at__isnull=False).update(
        node=None
    )


def _breakdown(counter: EngineCalls, started: int) -> dict:
    calls = counter.take()
    tasks_ = {}
    for name in ("docker", "default"):
        queue = django_rq.get_queue(name)
        for registry in (queue.finished_job_registry, queue.failed_job_registry):
            for job in queue.job_class.fetch_many(
                registry.get_job_ids(), queue.connection, serializer=JSONSerializer
            ):
                if job is None or not job.started_at or not job.ended_at:
                    continue
                t = tasks_.setdefault(job.func_name.rsplit(".", 1)[-1], {"run": [], "wait": []})
                t["run"].append((job.ended_at - job.started_at).total_seconds())
                t["wait"].append((job.started_at - job.enqueued_at).total_seconds())
    return {
        "engine_calls_per_job": round(sum(calls.values()) / max(started, 1), 2),
        "engine_calls": calls,
        "tasks": {
            name: {"n": len(t["run"]), "run_median_s": round(statistics.median(t["run"]), 3),
                   "run_total_s": round(sum(t["run"]), 2),
                   "wait_max_s": round(max(t["wait"]), 2)}
            for name, t in tasks_.items()
        },
    }  # fmt: skip


if __name__ == "__main__":
    main()

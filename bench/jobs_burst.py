"""bench/jobs_burst: 100 jobs submitted at once to 100 one-node clusters, started by two
real RQ workers (the Procfile's worker line) on the two test engines. Prints the time from
the first submit until every job has started (its containers ran: `running_since`, whether
or not it still runs then), and jobs started per second. Fails when a job did not start."""

import json
import os
import subprocess
import sys
import time
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

from bench.common import register_host  # noqa: E402
from jobs import tasks  # noqa: E402
from jobs.clusters import services
from jobs.models import GpuModel, Image, Job  # noqa: E402
from jobs.placement import scheduler  # noqa: E402
from jobs.placement.catalog import seed_catalog  # noqa: E402

JOBS = int(os.environ.get("BENCH_JOBS", 100))
WORKERS = int(os.environ.get("BENCH_WORKERS", 2))
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
    for cluster in owner.clusters.exclude(state="released"):
        services.cluster_release(cluster=cluster)
    # Several host rows per engine: 100 one-GPU nodes need 100 slots.
    per_engine = (JOBS + 15) // 16 // len(ENGINES) + 1
    for e, url in enumerate(ENGINES):
        for i in range(per_engine):
            register_host(f"burst-{e}-{i}", url, gpus=16)
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
    django_rq.get_queue("docker").empty()
    django_rq.get_queue("default").empty()
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
        )
        for _ in range(WORKERS)
    ]
    time.sleep(3)  # workers warm: imported and listening
    since = timezone.now()
    t0 = time.perf_counter()
    jobs = [
        services.job_submit(cluster=c, spec=services.JobSpec(name="burst", command="exec sleep 60"))
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
    for w in workers:
        w.terminate()
    for w in workers:
        w.wait(timeout=20)
    for url in ENGINES:
        client = docker.DockerClient(base_url=url, timeout=60)
        for c in client.containers.list(all=True, filters={"label": "suanli.job"}):
            c.remove(force=True)
    Job.objects.filter(pk__in=ids).update(state=Job.State.CANCELLED)
    for c in clusters:
        services.cluster_release(cluster=c)
        tasks.cluster_network_remove(c.pk)  # what a worker does after a release
    print(json.dumps({
        "bench": "jobs_burst", "jobs": JOBS, "workers": WORKERS, "started": n_started,
        "submit_s": round(submitted, 3), "all_started_s": round(total, 3),
        "jobs_per_s": round(n_started / total, 1),
    }), flush=True)  # fmt: skip
    if n_started < JOBS:
        sys.exit(f"bench/jobs_burst: {JOBS - n_started} of {JOBS} jobs did not start: {why}")


if __name__ == "__main__":
    main()

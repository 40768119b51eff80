"""bench/placement: gang placement throughput on PostgreSQL.

10,000 mixed requests (1-8 GPUs x 1-4 nodes) over fleets of 100, 1,000 and 5,000 hosts of
8 GPUs. Requests arrive in waves sized to the fleet; each wave is placed by real
`place_pending` passes (timed), then released (not timed) so the next wave has room.
Prints one JSON line per fleet size.
"""

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.db import connection  # noqa: E402
from django.utils import timezone  # noqa: E402

from jobs.models import Cluster, GpuModel, GpuSlot, Host, Image, Node  # noqa: E402
from jobs.placement import capacity, scheduler  # noqa: E402
from jobs.placement.catalog import seed_catalog  # noqa: E402

REQUESTS = int(os.environ.get("BENCH_REQUESTS", 10_000))
FLEETS = [int(n) for n in os.environ.get("BENCH_HOSTS", "100,1000,5000").split(",")]


def reset():
    with connection.cursor() as cur:
        cur.execute(
            "TRUNCATE jobs_clusterevent, jobs_volume, jobs_cluster_ssh_keys, jobs_gpuslot, jobs_node, "
            "jobs_cluster, jobs_host RESTART IDENTITY CASCADE"
        )


def make_fleet(n: int, model: GpuModel) -> None:
    now = timezone.now()
    hosts = Host.objects.bulk_create(
        [
            Host(
                name=f"h{i:05}",
                engine_url=f"unix:///run/bench-{i}.sock",
                address="127.0.0.1",
                zone=f"zone-{'abcd'[i % 4]}",
                gpu_model=model,
                gpu_count=8,
                state=Host.State.ACTIVE,
                swarm_state="active",  # one swarm: multi-node clusters may span hosts
                swarm_cluster="bench",
                cpu_count=64,
                last_seen=now,
            )
            for i in range(n)
        ],
        batch_size=2000,
    )
    GpuSlot.objects.bulk_create(
        [GpuSlot(host=h, index=g) for h in hosts for g in range(8)], batch_size=5000
    )


def timed_scheduler():
    """Time each placement: its own planning, plus its share of the batch that wrote it."""
    per_placement: list[float] = []
    plan, commit = capacity.Fleet.plan, scheduler._commit_batch
    planned: dict[int, float] = {}

    def timed_plan(self, cluster):
        t0 = time.perf_counter()
        try:
            return plan(self, cluster)
        finally:
            planned[cluster.pk] = time.perf_counter() - t0

    def timed_commit(batch, fleet, report):
        before = len(report.placed)
        t0 = time.perf_counter()
        commit(batch, fleet, report)
        share = (time.perf_counter() - t0) / max(1, len(report.placed) - before)
        per_placement.extend(planned.pop(pk, 0.0) + share for pk in report.placed[before:])

    capacity.Fleet.plan, scheduler._commit_batch = timed_plan, timed_commit
    return per_placement


def run(n_hosts: int, owner, model: GpuModel, image: Image, per_placement: list[float]) -> dict:
    reset()
    make_fleet(n_hosts, model)
    rng = random.Random(42)
    requests = [(rng.randint(1, 4), rng.randint(1, 8)) for _ in range(REQUESTS)]
    # A wave is about what fits in the fleet (mean request: 2.5 nodes x 4.5 GPUs).
    wave = max(10, int(n_hosts * 8 / 11.25 * 0.8))
    per_placement.clear()
    placed = 0
    unplaced = 0
    pass_seconds = 0.0
    passes = 0
    for start in range(0, REQUESTS, wave):
        now = timezone.now()
        batch = [
            Cluster(
                owner=owner, name=f"b{start + i}", gpu_model=model, nodes=nodes, gpus_per_node=gpus,
                image=image, image_reference=image.reference, created_at=now, queued_at=now,
                last_active_at=now,
            )
            for i, (nodes, gpus) in enumerate(requests[start : start + wave])
        ]  # fmt: skip
        Cluster.objects.bulk_create(batch, batch_size=2000)
        t0 = time.perf_counter()
        report = scheduler.place_pending()
        pass_seconds += time.perf_counter() - t0
        passes += 1
        placed += len(report.placed)
        unplaced += report.waiting
        # Give everything back (not timed) for the next wave.
        GpuSlot.objects.filter(node__isnull=False).update(node=None)
        Node.objects.filter(released_at__isnull=True).update(released_at=now)
        Cluster.objects.filter(state__in=["pending", "running"]).update(
            state="released", released_at=now
        )
    return {
        "bench": "placement",
        "hosts": n_hosts,
        "gpus": n_hosts * 8,
        "requests": REQUESTS,
        "placed": placed,
        "waited_in_queue": unplaced,
        "passes": passes,
        "seconds": round(pass_seconds, 3),
        "placements_per_s": round(placed / pass_seconds, 1),
        "median_ms_per_placement": round(statistics.median(per_placement) * 1000, 3),
        "p95_ms_per_placement": round(
            sorted(per_placement)[int(len(per_placement) * 0.95)] * 1000, 3
        ),
        "database": connection.vendor,
    }


def main():
    if connection.vendor != "postgresql":
        sys.exit("bench/placement runs on PostgreSQL: use `make bench`.")
    seed_catalog()
    owner, _ = get_user_model().objects.get_or_create(username="bench")
    model = GpuModel.objects.get(slug="a100-80gb")
    image = Image.objects.get(reference="suanli/busybox:latest")
    per_placement = timed_scheduler()
    for n in FLEETS:
        print(json.dumps(run(n, owner, model, image, per_placement)), flush=True)
    reset()


if __name__ == "__main__":
    main()

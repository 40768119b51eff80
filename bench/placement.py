"""bench/placement: gang placement throughput on PostgreSQL.

10,000 mixed requests (1-8 GPUs x 1-4 nodes) over fleets of 100, 1,000 and 5,000 hosts of
8 GPUs. Requests arrive in waves sized to the fleet; each wave is placed by real
`place_pending` passes (timed), then released (not timed) so the next wave has room.
Prints one JSON line per fleet size.

`placement_teams`: the same requests on a fleet of BENCH_TEAMS_HOSTS (1,000) hosts, placed
twice in the same run: by one researcher (no teams: first come, first served) and spread
over 50 teams under fair share (shares 1-5, ten of them with a GPU limit of a tenth of the
fleet), each pass reading the teams' recent usage from the nodes of the earlier waves. One
JSON line with both rates and their ratio (no teams / teams; the issue asks at most 1.2).
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

from jobs.models import Cluster, GpuModel, GpuSlot, Host, Image, Node, Team  # noqa: E402
from jobs.placement import capacity, scheduler  # noqa: E402
from jobs.placement.catalog import seed_catalog  # noqa: E402

REQUESTS = int(os.environ.get("BENCH_REQUESTS", 10_000))
FLEETS = [int(n) for n in os.environ.get("BENCH_HOSTS", "100,1000,5000").split(",") if n]
TEAMS_HOSTS = int(os.environ.get("BENCH_TEAMS_HOSTS", 1000))
TEAMS = 50


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

    def timed_commit(batch, fleet, report, **kw):
        before = len(report.placed)
        t0 = time.perf_counter()
        commit(batch, fleet, report, **kw)
        share = (time.perf_counter() - t0) / max(1, len(report.placed) - before)
        per_placement.extend(planned.pop(pk, 0.0) + share for pk in report.placed[before:])

    capacity.Fleet.plan, scheduler._commit_batch = timed_plan, timed_commit
    return per_placement


def run(n_hosts: int, owner, model: GpuModel, image: Image, per_placement: list[float]) -> dict:
    measured = place_waves(n_hosts, [owner], model, image, per_placement)
    return {
        "bench": "placement",
        "hosts": n_hosts,
        "gpus": n_hosts * 8,
        "requests": REQUESTS,
        **measured,
        "median_ms_per_placement": round(statistics.median(per_placement) * 1000, 3),
        "p95_ms_per_placement": round(
            sorted(per_placement)[int(len(per_placement) * 0.95)] * 1000, 3
        ),
        "database": connection.vendor,
    }


def place_waves(n_hosts: int, owners: list, model: GpuModel, image: Image, per_placement) -> dict:
    """The requests on a fresh fleet of `n_hosts`, wave by wave, each request's owner drawn
    from `owners`: the placement passes timed, the releases between waves not."""
    reset()
    make_fleet(n_hosts, model)
    rng = random.Random(42)
    requests = [(rng.randint(1, 4), rng.randint(1, 8)) for _ in range(REQUESTS)]
    whose = [owners[rng.randrange(len(owners))] for _ in range(REQUESTS)]
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
                owner=whose[start + i], name=f"b{start + i}", gpu_model=model, nodes=nodes,
                gpus_per_node=gpus, image=image, image_reference=image.reference, created_at=now,
                queued_at=now, last_active_at=now,
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
        "placed": placed,
        "waited_in_queue": unplaced,
        "passes": passes,
        "seconds": round(pass_seconds, 3),
        "placements_per_s": round(placed / pass_seconds, 1),
    }


def teams(n_hosts: int) -> list:
    """50 teams' accounts (their principals): shares 1-5, every fifth with a GPU limit of a
    tenth of the fleet."""
    User = get_user_model()
    principals = []
    for i in range(TEAMS):
        principal, _ = User.objects.get_or_create(username=f"bench.team.{i:02}")
        Team.objects.update_or_create(
            principal=principal,
            defaults={"name": f"lab {i:02}", "share": 1 + i % 5,
                      "gpu_limit": n_hosts * 8 // 10 if i % 5 == 0 else None},
        )  # fmt: skip
        principals.append(principal)
    return principals


def run_teams(owner, model: GpuModel, image: Image, per_placement: list[float]) -> dict:
    """The same requests without teams and with 50 under fair share, in this run."""
    alone = place_waves(TEAMS_HOSTS, [owner], model, image, per_placement)
    shared = place_waves(TEAMS_HOSTS, teams(TEAMS_HOSTS), model, image, per_placement)
    return {
        "bench": "placement_teams",
        "hosts": TEAMS_HOSTS,
        "requests": REQUESTS,
        "teams": TEAMS,
        "placed_no_teams": alone["placed"],
        "placed_teams": shared["placed"],
        "waited_teams": shared["waited_in_queue"],
        "placements_per_s_no_teams": alone["placements_per_s"],
        "placements_per_s_teams": shared["placements_per_s"],
        "ratio": round(alone["placements_per_s"] / shared["placements_per_s"], 3),
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
    print(json.dumps(run_teams(owner, model, image, per_placement)), flush=True)
    reset()


if __name__ == "__main__":
    main()

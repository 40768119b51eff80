"""bench/pools: one cron round of the pools (console.pools.tick: billing's figures onto
each pool, then its autoscaler round, then the sweeps' safety net) on PostgreSQL.

Fleets of 10, 100 and 500 pools, each with 3 running clusters (one busy, two free) and 2
jobs waiting, at its maximum: every round counts, checks the budget, writes nothing new
but a sample now and then. Prints one JSON line per size: the round's seconds and
queries, per pool, against the round's interval (SUANLI_POOL_INTERVAL), which a round
must stay well under.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.db import connection, reset_queries  # noqa: E402
from django.utils import timezone  # noqa: E402

from billing.catalog import seed_rate_card  # noqa: E402
from console import pools as console_pools  # noqa: E402
from jobs.models import Cluster, GpuModel, Image, Job, Pool  # noqa: E402
from jobs.placement.catalog import seed_catalog  # noqa: E402

SIZES = [int(n) for n in os.environ.get("BENCH_POOLS", "10,100,500").split(",")]
ROUNDS = 5


def reset():
    with connection.cursor() as cur:
        cur.execute(
            "TRUNCATE jobs_poolsample, jobs_poolevent, jobs_trial, jobs_sweep, jobs_jobevent, "
            "jobs_job, jobs_clusterevent, jobs_volume, jobs_node, jobs_cluster, jobs_pool "
            "RESTART IDENTITY CASCADE"
        )


def fleet(n: int, owner, model: GpuModel, image: Image) -> None:
    now = timezone.now()
    made = Pool.objects.bulk_create(
        [
            Pool(owner=owner, name=f"p{i}", gpu_model=model, nodes=1, gpus_per_node=1,
                 image=image, image_reference=image.reference, min_clusters=0,
                 max_clusters=3, idle_minutes=600)
            for i in range(n)
        ]
    )  # fmt: skip
    clusters = Cluster.objects.bulk_create(
        [
            Cluster(owner=owner, name=f"{p.name}-{k}", gpu_model=model, gpus_per_node=1,
                    nodes=1, image=image, image_reference=image.reference, pool=p,
                    state=Cluster.State.RUNNING, running_since=now, release_policy="never")
            for p in made
            for k in range(3)
        ]
    )  # fmt: skip
    jobs = []
    for i, p in enumerate(made):
        busy = clusters[3 * i]
        jobs.append(Job(cluster=busy, owner=owner, name="run", command="true", pool=p,
                        state=Job.State.RUNNING, attempt=1, started_at=now))  # fmt: skip
        jobs += [
            Job(cluster=busy, owner=owner, name=f"wait{k}", command="true", pool=p)
            for k in range(2)
        ]
    Job.objects.bulk_create(jobs)


def main() -> None:
    seed_catalog()
    seed_rate_card()
    owner, _ = get_user_model().objects.get_or_create(username="bench-pools")
    model = GpuModel.objects.get(slug="a100-80gb")
    image = Image.objects.filter(active=True).first()
    settings.DEBUG = True  # count the queries
    for n in SIZES:
        reset()
        fleet(n, owner, model, image)
        console_pools.tick()  # the first round writes each pool's figures and events
        times, queries = [], []
        for _ in range(ROUNDS):
            reset_queries()
            started = time.perf_counter()
            console_pools.tick()
            times.append(time.perf_counter() - started)
            queries.append(len(connection.queries))
        best = min(times)
        print(
            json.dumps(
                {
                    "bench": "pool_round",
                    "pools": n,
                    "clusters": 3 * n,
                    "round_s": round(best, 4),
                    "per_pool_ms": round(best / n * 1000, 2),
                    "queries": min(queries),
                    "queries_per_pool": round(min(queries) / n, 1),
                    "interval_s": settings.SUANLI_POOL_INTERVAL,
                    "share_of_interval": round(best / settings.SUANLI_POOL_INTERVAL, 3),
                }
            ),
            flush=True,
        )
    reset()


if __name__ == "__main__":
    main()

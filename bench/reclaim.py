"""bench/reclaim: the placement pass that preempts spot capacity for an on-demand request.

A fleet of 1,000 hosts x 8 GPUs is full of 1-GPU spot clusters (8,000 of them, placed in
a random order over the hosts). One on-demand request (1 node x 8 GPUs, then 2 x 8) comes
in, having waited its SUANLI_RECLAIM_AFTER_S in line: the timed pass must find the fewest,
youngest spot clusters that make it fit and send them their notices, and the next pass
places it on what they give back (it fails when either did not happen). Compared, in the same run: the pass that places the same request on an
empty fleet of the same size. Prints one JSON line per request shape.
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.db import connection  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench.placement import make_fleet, reset  # noqa: E402
from jobs.models import Cluster, GpuModel, GpuSlot, Image, Node  # noqa: E402
from jobs.placement import capacity, scheduler  # noqa: E402
from jobs.placement.catalog import seed_catalog  # noqa: E402

HOSTS = int(os.environ.get("BENCH_RECLAIM_HOSTS", 1000))


def _cluster(owner, model, image, name, *, nodes, gpus, spot, at):
    return Cluster(
        owner=owner, name=name, gpu_model=model, nodes=nodes, gpus_per_node=gpus, image=image,
        image_reference=image.reference, spot=spot, created_at=at, queued_at=at, last_active_at=at,
    )  # fmt: skip


def fill_with_spot(owner, model, image) -> None:
    """Every GPU held by a 1-GPU spot cluster; placement ages spread over an hour."""
    start = timezone.now() - timedelta(hours=1)
    spots = Cluster.objects.bulk_create(
        [
            _cluster(owner, model, image, f"s{i}", nodes=1, gpus=1, spot=True, at=start)
            for i in range(HOSTS * 8)
        ],
        batch_size=2000,
    )
    scheduler.place_pending()
    # Ages that do not follow the hosts: the youngest are scattered over the fleet.
    for offset, cluster in enumerate(sorted(spots, key=lambda c: (c.pk * 7919) % len(spots))):
        cluster.running_since = start + timedelta(milliseconds=offset * 400)
    Cluster.objects.bulk_update(spots, ["running_since"], batch_size=2000)


def one_pass(owner, model, image, *, nodes, gpus) -> tuple[float, capacity.PassReport]:
    # A request reclaims only once it has waited SUANLI_RECLAIM_AFTER_S in line: this one
    # has, so the timed pass is the one that preempts (not one that only says it waits).
    waited = timezone.now() - timedelta(seconds=settings.SUANLI_RECLAIM_AFTER_S + 1)
    Cluster.objects.bulk_create(
        [_cluster(owner, model, image, "on-demand", nodes=nodes, gpus=gpus, spot=False,
                  at=waited)]
    )  # fmt: skip
    t0 = time.perf_counter()
    report = scheduler.place_pending()
    return time.perf_counter() - t0, report


def main():
    if connection.vendor != "postgresql":
        sys.exit("bench/reclaim runs on PostgreSQL: use `make bench`.")
    seed_catalog()
    owner, _ = get_user_model().objects.get_or_create(username="bench")
    model = GpuModel.objects.get(slug="a100-80gb")
    image = Image.objects.get(reference="suanli/busybox:latest")
    failed = []
    for nodes, gpus in ((1, 8), (2, 8)):
        reset()
        make_fleet(HOSTS, model)
        one_pass(owner, model, image, nodes=nodes, gpus=gpus)  # warm-up (cold caches)
        reset()
        make_fleet(HOSTS, model)
        empty_s, _ = one_pass(owner, model, image, nodes=nodes, gpus=gpus)
        reset()
        make_fleet(HOSTS, model)
        fill_with_spot(owner, model, image)
        reclaim_s, report = one_pass(owner, model, image, nodes=nodes, gpus=gpus)
        hosts = Node.objects.filter(cluster_id__in=report.preempted).values("host").distinct()
        # The victims' GPUs come back once their engines confirm their containers are gone
        # (workspaces.free_gpus); this fleet has no engines, so that is written directly.
        GpuSlot.objects.filter(node__released_at__isnull=False).update(node=None)
        scheduler.place_pending()  # the next pass places the request on what came back
        placed = Cluster.objects.filter(name="on-demand", state="running").exists()
        print(
            json.dumps(
                {
                    "bench": "reclaim",
                    "hosts": HOSTS,
                    "spot_clusters": HOSTS * 8,
                    "request": f"{nodes} x {gpus} GPUs on-demand",
                    "preempted": len(report.preempted),
                    "hosts_touched": hosts.count(),
                    "placed_next_pass": placed,
                    "pass_s": round(reclaim_s, 3),
                    "empty_fleet_pass_s": round(empty_s, 4),
                    "ratio": round(reclaim_s / empty_s, 1),
                    "database": connection.vendor,
                }
            ),
            flush=True,
        )
        if not report.preempted or not placed:
            # Then the pass above measured no reclaim at all: a figure that says nothing.
            failed.append(f"{nodes} x {gpus}: {len(report.preempted)} preempted, placed: {placed}")
    reset()
    Node.objects.all().delete()
    if failed:
        sys.exit(f"bench/reclaim measured no reclaim: {'; '.join(failed)}")


if __name__ == "__main__":
    main()

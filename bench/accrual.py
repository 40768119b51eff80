"""bench/accrual: one accrual tick over 10,000 running clusters on PostgreSQL, beside one
plain bulk INSERT of as many ledger rows in the same run.

Set-up (not timed): 1,250 hosts of 8 GPUs, 10,000 one-node clusters in state running
(1-8 GPUs each, bulk-created with their nodes, placed an hour before T), a rate card with
a price for the GPU model, and 1,000 funded accounts (10 clusters each). A first
`accrue(now=T)` opens the meters and bills the first hour (warm-up, not timed).

Timed, alternately, REPEATS times each, each on its own and with a fresh
`time.perf_counter()` around the call only:
- tick: one `billing.accrual.accrue(now=T + 10 s x k)`, the whole of it (opening meters,
  loading the rate book, locking and charging every meter in batches, one transaction a
  batch, each batch's entries folded into the bill's hour lines and daily usage): 10,000
  usage entries, 10,000 hour lines and 1,000 days rewritten;
- bulk_insert: one `LedgerEntry.objects.bulk_create` of 10,000 comparable usage rows
  (same columns, unique keys `bench:<tag>:<i>`, batch_size 2000) in one transaction: the
  plain bulk INSERT the issue names;
- copy: the same rows through the tick's own writer (`jobs.base.sql.insert_rows`, one COPY),
  the floor under a tick, so `ratio_to_copy` says what accrual adds to writing its rows.

Prints one JSON line with the medians, ratio = tick_s / bulk_insert_s and ratio_to_copy.
"""

import json
import os
import random
import statistics
import sys
import time
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.db.models import Sum  # noqa: E402
from django.utils import timezone  # noqa: E402

from billing import accrual  # noqa: E402
from billing import services as billing  # noqa: E402
from billing.accrual import ENTRY_FIELDS  # noqa: E402
from billing.models import (  # noqa: E402
    Account,
    BillLine,
    LedgerEntry,
    Price,
    RateCard,
    UsageDay,
)
from jobs.base.sql import insert_rows  # noqa: E402
from jobs.models import Cluster, GpuModel, GpuSlot, Host, Image, Node  # noqa: E402
from jobs.placement.catalog import seed_catalog  # noqa: E402

CLUSTERS = int(os.environ.get("BENCH_CLUSTERS", 10_000))
USERS = int(os.environ.get("BENCH_USERS", 1_000))
REPEATS = int(os.environ.get("BENCH_REPEATS", 5))
TICK_S = 10
PER_HOUR = Decimal("3.6000")
TOPUP = Decimal("1000000")
FKS = {"account", "cluster", "gpu_model"}


def reset():
    with connection.cursor() as cur:
        cur.execute(
            "TRUNCATE billing_ledgerentry, billing_meter, billing_account, billing_price, "
            "billing_ratecard, jobs_clusterevent, jobs_volume, jobs_cluster_ssh_keys, "
            "jobs_gpuslot, jobs_node, jobs_cluster, jobs_host RESTART IDENTITY CASCADE"
        )


def make_users() -> list[int]:
    User = get_user_model()
    names = [f"bench-acc-{i:05}" for i in range(USERS)]
    User.objects.bulk_create(
        [User(username=n) for n in names], ignore_conflicts=True, batch_size=2000
    )
    return list(User.objects.filter(username__in=names).order_by("pk").values_list("pk", flat=True))


def make_accounts(users: list[int], when) -> None:
    accounts = Account.objects.bulk_create(
        [Account(user_id=u, balance=TOPUP) for u in users], batch_size=2000
    )
    LedgerEntry.objects.bulk_create(
        [
            LedgerEntry(
                account=a, kind=LedgerEntry.Kind.TOPUP, amount=TOPUP, balance_after=TOPUP,
                key=f"bench-topup:{a.pk}", memo="bench", created_at=when,
            )
            for a in accounts
        ],
        batch_size=2000,
    )  # fmt: skip


def make_fleet(model: GpuModel, image: Image, users: list[int], placed_at) -> None:
    n_hosts = (CLUSTERS + 7) // 8
    hosts = Host.objects.bulk_create(
        [
            Host(
                name=f"acc{i:05}", engine_url=f"unix:///run/bench-{i}.sock", address="127.0.0.1",
                zone=f"zone-{'abcd'[i % 4]}", gpu_model=model, gpu_count=8,
                state=Host.State.ACTIVE, cpu_count=64, last_seen=placed_at,
            )
            for i in range(n_hosts)
        ],
        batch_size=2000,
    )  # fmt: skip
    GpuSlot.objects.bulk_create(
        [GpuSlot(host=h, index=g) for h in hosts for g in range(8)], batch_size=5000
    )
    rng = random.Random(42)
    clusters = Cluster.objects.bulk_create(
        [
            Cluster(
                owner_id=users[i % len(users)], name=f"acc{i}", gpu_model=model, nodes=1,
                gpus_per_node=rng.randint(1, 8), image=image, image_reference=image.reference,
                state=Cluster.State.RUNNING, created_at=placed_at, queued_at=placed_at,
                running_since=placed_at, last_active_at=placed_at,
                release_policy=Cluster.ReleasePolicy.NEVER,
            )
            for i in range(CLUSTERS)
        ],
        batch_size=2000,
    )  # fmt: skip
    # One node a cluster; the host and GPU indices only need to look real.
    Node.objects.bulk_create(
        [
            Node(
                cluster=c, index=0, host=hosts[i % n_hosts],
                gpu_indices=list(range(c.gpus_per_node)), placed_at=placed_at,
                started_at=placed_at,
            )
            for i, c in enumerate(clusters)
        ],
        batch_size=2000,
    )  # fmt: skip


def make_rate_card(model: GpuModel, when) -> None:
    card = RateCard.objects.create(effective_from=when, note="bench")
    Price.objects.create(card=card, gpu_model=model, per_hour=PER_HOUR)


def usage_rows(tag: str, accounts: list[int], cluster_ids: list[int], model_id: int, start):
    """Rows like the tick's: the columns of `billing.accrual.ENTRY_FIELDS`, in order."""
    end = start + timedelta(seconds=TICK_S)
    return [
        (
            accounts[i % len(accounts)], LedgerEntry.Kind.USAGE.value, Decimal("-0.0100"),
            Decimal("999000.0000"), f"bench:{tag}:{i}", cid, start, end, 1, PER_HOUR,
            model_id, "", end, None,
        )
        for i, cid in enumerate(cluster_ids)
    ]  # fmt: skip


def bulk_insert(rows) -> float:
    """The plain bulk INSERT: Django's bulk_create (multi-row INSERTs of 2,000)."""
    objs = [
        LedgerEntry(
            **{f"{n}_id" if n in FKS else n: v for n, v in zip(ENTRY_FIELDS, r, strict=True)}
        )
        for r in rows
    ]
    t0 = time.perf_counter()
    with transaction.atomic():
        LedgerEntry.objects.bulk_create(objs, batch_size=2000)
    return time.perf_counter() - t0


def copy_insert(rows) -> float:
    """The same rows through the tick's own writer (one COPY): the floor under a tick."""
    t0 = time.perf_counter()
    with transaction.atomic():
        insert_rows(LedgerEntry, ENTRY_FIELDS, rows)
    return time.perf_counter() - t0


def main():
    if connection.vendor != "postgresql":
        sys.exit("bench/accrual runs on PostgreSQL: use `make bench`.")
    reset()
    seed_catalog()
    model = GpuModel.objects.get(slug="a100-80gb")
    image = Image.objects.get(reference="suanli/busybox:latest")
    t = billing.floor_s(timezone.now())
    users = make_users()
    make_accounts(users, t - timedelta(hours=2))
    make_rate_card(model, t - timedelta(hours=2))
    make_fleet(model, image, users, t - timedelta(hours=1))
    accrual.accrue(now=t)  # opens the meters and bills the first hour: warm-up
    accounts = list(Account.objects.order_by("pk").values_list("pk", flat=True))
    cluster_ids = list(Cluster.objects.order_by("pk").values_list("pk", flat=True))
    ticks, inserts, copies, entries = [], [], [], []
    for k in range(1, REPEATS + 1):
        t0 = time.perf_counter()
        report = accrual.accrue(now=t + timedelta(seconds=TICK_S * k))
        ticks.append(time.perf_counter() - t0)
        entries.append(report.entries)
        inserts.append(bulk_insert(usage_rows(f"i{k}", accounts, cluster_ids, model.pk, t)))
        copies.append(copy_insert(usage_rows(f"c{k}", accounts, cluster_ids, model.pk, t)))
    assert all(n == CLUSTERS for n in entries), entries
    # The ledger still sums to the balances (a cheap guard that the tick did its job).
    ledger = LedgerEntry.objects.exclude(key__startswith="bench:").aggregate(s=Sum("amount"))["s"]
    balances = Account.objects.aggregate(s=Sum("balance"))["s"]
    assert ledger == balances, (ledger, balances)
    # And the bill's hour lines and daily usage hold what the tick charged (its rollups).
    usage = LedgerEntry.objects.filter(kind=LedgerEntry.Kind.USAGE).exclude(
        key__startswith="bench:"
    )
    charged = usage.aggregate(s=Sum("amount"))["s"]
    lines = BillLine.objects.filter(kind=LedgerEntry.Kind.USAGE).aggregate(s=Sum("amount"))["s"]
    days = UsageDay.objects.aggregate(s=Sum("amount"))["s"]
    assert charged == lines == -days, (charged, lines, days)
    tick_s, insert_s = statistics.median(ticks), statistics.median(inserts)
    copy_s = statistics.median(copies)
    print(
        json.dumps(
            {
                "bench": "accrual",
                "clusters": CLUSTERS,
                "accounts": len(accounts),
                "repeats": REPEATS,
                "tick_s": round(tick_s, 3),
                "bulk_insert_s": round(insert_s, 3),
                "ratio": round(tick_s / insert_s, 2),
                "copy_s": round(copy_s, 3),
                "ratio_to_copy": round(tick_s / copy_s, 2),
                "entries": statistics.median(entries),
                "tick_runs_s": [round(x, 3) for x in ticks],
                "bulk_insert_runs_s": [round(x, 3) for x in inserts],
                "copy_runs_s": [round(x, 3) for x in copies],
                "database": connection.vendor,
            }
        ),
        flush=True,
    )
    reset()


if __name__ == "__main__":
    main()

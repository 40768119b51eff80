"""The bill's lines and the daily usage, kept as the ledger is written.

Accrual writes a usage piece per cluster every tick (about 8,640 a day for a running
cluster); people read hours and days. `add_usage` folds a batch of pieces into their
`BillLine` (cluster, or the account's storage; UTC hour, units, rate) and `UsageDay` (account, UTC day charged, resource)
in the caller's transaction, so a line always equals the pieces under it, to the last
digit. The callers hold the row locks of the accounts concerned (accrual and `post_entry`
both do), which makes read-then-write here safe without an upsert. On PostgreSQL the
accrual tick folds its entries with `fold_entries` instead: one statement per batch, an
upsert of the same lines and days from the rows just written (the tests hold it to
`rebuild`, which folds with `add_usage`).

`rebuild` recomputes both from the ledger: for the migration that introduces them, for
the pages benchmark's bulk-seeded ledger, and as the tests' oracle.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime
from decimal import Decimal

from django.db import connection, transaction
from django.db.models import Q
from django.utils.translation import gettext_noop

from billing.models import STORAGE_RESOURCE, Account, BillLine, LedgerEntry, UsageDay
from billing.pricing import GPU, NO_GPU, STOPPED, STORAGE, kind_of_key
from jobs.base.sql import insert_rows, update_rows
from jobs.models import Cluster, GpuModel, InstanceType

USAGE = LedgerEntry.Kind.USAGE.value

LINE_FIELDS = (
    "account", "kind", "at", "amount", "cluster", "hour", "units", "rate", "gpu_model",
    "seconds", "pieces", "period_from", "period_to", "charged_at", "entry", "memo", "member",
)  # fmt: skip
DAY_FIELDS = ("account", "day", "resource", "amount", "seconds")


@dataclass
class Piece:
    """What a usage entry says, as accrual holds it (before it has an id)."""

    account_id: int
    amount: Decimal  # signed: usage is negative
    cluster_id: int | None  # None: the account's storage
    period_from: datetime | None
    period_to: datetime | None
    units: int
    rate: Decimal | None
    gpu_model_id: int | None
    memo: str
    charged_at: datetime
    resource: str
    member_id: int | None = None  # a team's usage: whose budget it counts against

    @property
    def seconds(self) -> int | None:
        if self.period_from is None or self.period_to is None:
            return None
        return int((self.period_to - self.period_from).total_seconds())

    @property
    def hour(self) -> datetime | None:
        if self.period_from is None:
            return None
        return self.period_from.astimezone(UTC).replace(minute=0, second=0, microsecond=0)

    @property
    def day(self) -> date:
        """The UTC day it was charged: the day the balance went down by it."""
        return self.charged_at.astimezone(UTC).date()


def hour_of(when: datetime) -> datetime:
    return when.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def resource_names(*, gpu_model_ids: Iterable, instance_type_ids: Iterable) -> dict:
    """{("gpu", id): name, ("cpu", id): name} for the ids given (two small queries)."""
    out: dict = {}
    gpus = {i for i in gpu_model_ids if i}
    cpus = {i for i in instance_type_ids if i}
    if gpus:
        out |= {
            ("gpu", pk): n
            for pk, n in GpuModel.objects.filter(pk__in=gpus).values_list("pk", "name")
        }
    if cpus:
        out |= {
            ("cpu", pk): n
            for pk, n in InstanceType.objects.filter(pk__in=cpus).values_list("pk", "name")
        }
    return out


# The resource of the kinds of time priced per node, whatever the cluster's GPUs: one name
# each, so that the daily chart and the operators' revenue show one series for each (their
# price does not depend on the GPU model either).
# Stored in English (bill lines, daily usage, the CSV); marked so that a page can show them
# translated.
KIND_RESOURCE = {
    NO_GPU: gettext_noop("no-GPU mode"),
    STOPPED: gettext_noop("stopped (kept workspaces)"),
    STORAGE: STORAGE_RESOURCE,
}


def resource_of(names: dict, gpu_model_id, instance_type_id, *, kind: str = GPU) -> str:
    if kind in KIND_RESOURCE:
        return KIND_RESOURCE[kind]
    if gpu_model_id:
        return names.get(("gpu", gpu_model_id), "")
    if instance_type_id:
        return names.get(("cpu", instance_type_id), "")
    return ""


def add_usage(pieces: list[Piece], *, minimum_entries: dict[int, int] | None = None) -> None:
    """Fold usage pieces into their hour lines and days. A piece without a period (the
    minimum charge) is a line of its own, linked to its entry: `minimum_entries` maps its
    cluster id to the entry's id."""
    if not pieces:
        return
    _add_lines(pieces, minimum_entries or {})
    _add_days(pieces)


def fold_entries(keys: list[str]) -> None:
    """PostgreSQL: fold clusters' usage entries just written in the caller's transaction
    (by their keys) into their hour lines and days, in one statement that reads them
    back where they lie: the hour lines and the minimum charge's own line as `_add_lines`
    makes them, the days as `_add_days` does (`resource_of`: the kinds' names from the
    key's tail, else the cluster's GPU model or CPU-only instance type), each an
    INSERT ... ON CONFLICT DO UPDATE on the table's unique index. No row goes through
    Python: at 10,000 clusters a tick this is what keeps the rollups cheap (`add_usage`,
    which reads each line before it writes it, remains for SQLite, storage and `rebuild`)."""
    if not keys:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            _FOLD,
            {
                "keys": list(keys), "usage": USAGE,
                "no_gpu": NO_GPU, "no_gpu_name": KIND_RESOURCE[NO_GPU],
                "stopped": STOPPED, "stopped_name": KIND_RESOURCE[STOPPED],
            },
        )  # fmt: skip


# One statement: the entries (`entry`, read once), their lines (hour lines summed per
# cluster, UTC hour, units, rate, memo and member; a minimum charge a line of its own,
# linked to its entry) and their days. Each line and day is one row of its INSERT (a
# conflict can meet a row once), added to what the row already holds.
_FOLD = f"""
WITH entry AS (
    SELECT id, account_id, amount, cluster_id, period_from, period_to, units, rate,
        gpu_model_id, memo, created_at, member_id, split_part(key, ':', -1) AS tail,
        extract(epoch FROM period_to - period_from)::integer AS seconds
    FROM {LedgerEntry._meta.db_table}
    WHERE key = ANY(%(keys)s::text[])  -- by the key's own index alone: nothing else to scan
), lines AS (
    INSERT INTO {BillLine._meta.db_table} AS line (
        account_id, kind, at, amount, cluster_id, hour, units, rate, gpu_model_id, seconds,
        pieces, period_from, period_to, charged_at, entry_id, memo, member_id
    )
    SELECT account_id, %(usage)s, min(period_from), sum(amount), cluster_id, hour, units,
        rate, min(gpu_model_id), sum(seconds), count(*), min(period_from), max(period_to),
        max(created_at), NULL, memo, member_id
    FROM (
        SELECT *, date_trunc('hour', period_from, 'UTC') AS hour FROM entry
        WHERE period_from IS NOT NULL
    ) AS piece
    GROUP BY account_id, cluster_id, hour, units, rate, memo, member_id
    UNION ALL
    SELECT account_id, %(usage)s, created_at, amount, cluster_id, NULL, units, rate,
        gpu_model_id, NULL, 1, NULL, NULL, created_at, id, memo, member_id
    FROM entry WHERE period_from IS NULL
    ON CONFLICT (cluster_id, hour, units, rate, memo, member_id)
        WHERE cluster_id IS NOT NULL AND hour IS NOT NULL
    DO UPDATE SET
        amount = line.amount + excluded.amount,
        seconds = line.seconds + excluded.seconds,
        pieces = line.pieces + excluded.pieces,
        period_from = least(line.period_from, excluded.period_from),
        period_to = greatest(line.period_to, excluded.period_to),
        charged_at = greatest(line.charged_at, excluded.charged_at)
)
INSERT INTO {UsageDay._meta.db_table} AS usage_day (account_id, day, resource, amount, seconds)
SELECT entry.account_id, (entry.created_at AT TIME ZONE 'UTC')::date,
    CASE entry.tail
        WHEN %(no_gpu)s THEN %(no_gpu_name)s
        WHEN %(stopped)s THEN %(stopped_name)s
        ELSE CASE
            WHEN cluster.gpu_model_id IS NOT NULL THEN coalesce(gpu.name, '')
            WHEN cluster.instance_type_id IS NOT NULL THEN coalesce(instance.name, '')
            ELSE ''
        END
    END,
    -sum(entry.amount), sum(entry.units::bigint * coalesce(entry.seconds, 0))
FROM entry
JOIN {Cluster._meta.db_table} AS cluster ON cluster.id = entry.cluster_id
LEFT JOIN {GpuModel._meta.db_table} AS gpu ON gpu.id = cluster.gpu_model_id
LEFT JOIN {InstanceType._meta.db_table} AS instance ON instance.id = cluster.instance_type_id
GROUP BY 1, 2, 3
ON CONFLICT (account_id, day, resource) DO UPDATE SET
    amount = usage_day.amount + excluded.amount, seconds = usage_day.seconds + excluded.seconds
"""  # noqa: S608 (table names from the models; values bound)


def _add_lines(pieces: list[Piece], minimum_entries: dict[int, int]) -> None:
    sums: dict[tuple, list] = {}
    fresh: list[tuple] = []
    for p in pieces:
        if p.hour is None:
            fresh.append(
                (
                    p.account_id, USAGE, p.charged_at, p.amount, p.cluster_id, None, p.units,
                    p.rate, p.gpu_model_id, None, 1, None, None, p.charged_at,
                    minimum_entries.get(p.cluster_id), p.memo, p.member_id,
                )
            )  # fmt: skip
            continue
        # The account tells storage lines apart (no cluster); a cluster's is its owner's.
        key = (p.account_id, p.cluster_id, p.hour, p.units, p.rate, p.memo, p.member_id)
        line = sums.get(key)
        if line is None:
            sums[key] = [p, p.amount, p.seconds, 1, p.period_from, p.period_to, p.charged_at]
        else:
            line[1] += p.amount
            line[2] += p.seconds
            line[3] += 1
            line[4] = min(line[4], p.period_from)
            line[5] = max(line[5], p.period_to)
            line[6] = max(line[6], p.charged_at)
    if sums:
        existing = _existing_lines(sums)
        updates = []
        for key, (p, amount, seconds, count, first, last, charged) in sums.items():
            old = existing.get(key)
            if old is None:
                # `at` (its place in time) is when its first piece began, not its hour's
                # top: a start at 10:50 follows a top-up at 10:40 (pieces come in order).
                fresh.append(
                    (
                        p.account_id, USAGE, first, amount, p.cluster_id, p.hour, p.units,
                        p.rate, p.gpu_model_id, seconds, count, first, last, charged, None, p.memo,
                        p.member_id,
                    )
                )  # fmt: skip
            else:
                updates.append(
                    (
                        old[0], old[6] + amount, old[7] + seconds, old[8] + count,
                        min(old[9], first), max(old[10], last), max(old[11], charged),
                    )
                )  # fmt: skip
        update_rows(
            BillLine, "id",
            ["amount", "seconds", "pieces", "period_from", "period_to", "charged_at"], updates,
        )  # fmt: skip
    insert_rows(BillLine, LINE_FIELDS, fresh)


def _existing_lines(sums: dict[tuple, list]) -> dict[tuple, tuple]:
    """The usage lines already written for the keys of `sums` (account, cluster, hour,
    units, rate, memo, member), by that key."""
    clusters = {k[1] for k in sums if k[1] is not None}
    storage = {k[0] for k in sums if k[1] is None}
    whose = Q(cluster_id__in=clusters)
    if storage:
        whose |= Q(cluster__isnull=True, account_id__in=storage)
    return {
        (row[12], row[1], row[2], row[3], row[4], row[5], row[13]): row
        for row in BillLine.objects.filter(
            whose,
            hour__in={k[2] for k in sums},
            kind=USAGE,
        )
        .order_by()
        .values_list(
            "pk",
            "cluster_id",
            "hour",
            "units",
            "rate",
            "memo",
            "amount",
            "seconds",
            "pieces",
            "period_from",
            "period_to",
            "charged_at",
            "account_id",
            "member_id",
        )  # fmt: skip
    }


def _add_days(pieces: list[Piece]) -> None:
    sums: dict[tuple, list] = {}
    for p in pieces:
        key = (p.account_id, p.day, p.resource)
        unit_seconds = p.units * (p.seconds or 0)
        if key in sums:
            sums[key][0] -= p.amount
            sums[key][1] += unit_seconds
        else:
            sums[key] = [-p.amount, unit_seconds]
    existing = {
        (account, day, resource): (pk, amount, seconds)
        for pk, account, day, resource, amount, seconds in UsageDay.objects.filter(
            account_id__in={k[0] for k in sums}, day__in={k[1] for k in sums}
        )
        .order_by()
        .values_list("pk", "account_id", "day", "resource", "amount", "seconds")
    }
    updates, fresh = [], []
    for key, (amount, seconds) in sums.items():
        old = existing.get(key)
        if old is None:
            fresh.append((*key, amount, seconds))
        else:
            updates.append((old[0], old[1] + amount, old[2] + seconds))
    update_rows(UsageDay, "id", ["amount", "seconds"], updates)
    insert_rows(UsageDay, DAY_FIELDS, fresh)


def add_entry(entry: LedgerEntry) -> BillLine:
    """A line for an entry that is not usage (a top-up, refund, adjustment or credit)."""
    return BillLine.objects.create(
        account_id=entry.account_id, kind=entry.kind, at=entry.created_at, amount=entry.amount,
        cluster_id=entry.cluster_id, charged_at=entry.created_at, entry=entry, memo=entry.memo,
    )  # fmt: skip


# -- recomputing from the ledger ------------------------------------------------------------


def rebuild(*, account_ids: Iterable[int] | None = None, chunk: int = 50_000) -> int:
    """Delete the lines and days of these accounts (all when None) and fold their ledger
    again, streaming it in the order it was written. Returns the entries read."""
    with transaction.atomic():
        accounts = Account.objects.select_for_update().order_by("pk")
        if account_ids is not None:
            accounts = accounts.filter(pk__in=list(account_ids))
        ids = list(accounts.values_list("pk", flat=True))
        BillLine.objects.filter(account_id__in=ids).delete()
        UsageDay.objects.filter(account_id__in=ids).delete()
        clusters = dict(
            Cluster.objects.filter(owner__account__in=ids).values_list("pk", "instance_type_id")
        )
        names = resource_names(
            gpu_model_ids=GpuModel.objects.values_list("pk", flat=True),
            instance_type_ids=InstanceType.objects.values_list("pk", flat=True),
        )
        read = 0
        batch: list[Piece] = []
        minimum: dict[int, int] = {}
        others: list[tuple] = []
        entries = (
            LedgerEntry.objects.filter(account_id__in=ids)
            .order_by("created_at", "id")
            .values_list(
                "pk",
                "key",
                "account_id",
                "kind",
                "amount",
                "cluster_id",
                "period_from",
                "period_to",
                "units",
                "rate",
                "gpu_model_id",
                "memo",
                "created_at",
                "member_id",
            )  # fmt: skip
        )
        for pk, key, account, kind, amount, cluster, *period_to_written, member in entries.iterator(
            chunk_size=5000
        ):
            # (start, end, units, rate, gpu, memo, at): Piece's fields after cluster
            start, _, _, _, gpu, memo, at = period_to_written
            read += 1
            if kind != USAGE:
                others.append(
                    (account, kind, at, amount, cluster, None, 0, None, None, None, 1, None,
                     None, at, pk, memo, None)
                )  # fmt: skip
                continue
            if start is None:
                minimum[cluster] = pk
            resource = resource_of(names, gpu, clusters.get(cluster), kind=kind_of_key(key))
            batch.append(Piece(account, amount, cluster, *period_to_written, resource, member))
            if len(batch) >= chunk:
                add_usage(batch, minimum_entries=minimum)
                batch, minimum = [], {}
        add_usage(batch, minimum_entries=minimum)
        insert_rows(BillLine, LINE_FIELDS, others)
    return read

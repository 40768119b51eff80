"""Writes to money: ledger entries (each under its account's row lock, with a unique
idempotency key) and the accrual tick that turns clusters' held capacity into usage.

Billing observes the jobs app's tables (clusters and their nodes' placed/released
seconds); the jobs app never calls billing. The one call the other way is the stop for an
exhausted balance, which releases clusters through `jobs.services.cluster_release`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Min
from django.utils import timezone

from billing import rollups, selectors
from billing.models import Account, LedgerEntry, Meter
from billing.pricing import RateBook, to_money
from jobs import services as fleet
from jobs import webhooks
from jobs.models import Cluster, Node
from jobs.sql import insert_rows, update_rows

log = logging.getLogger(__name__)

EXHAUSTED = "stopped: balance exhausted"
OPERATOR_KINDS = (
    LedgerEntry.Kind.TOPUP,
    LedgerEntry.Kind.REFUND,
    LedgerEntry.Kind.ADJUSTMENT,
    LedgerEntry.Kind.CREDIT,
)


def floor_s(when: datetime) -> datetime:
    return when.replace(microsecond=0)


def epoch(when: datetime) -> int:
    return int(when.timestamp())


def account_for(user) -> Account:
    account, _ = Account.objects.get_or_create(user=user)
    return account


def accounts_ensure() -> int:
    """An account (balance 0) for every user that has none yet: users made by sign-up, by
    an operator in the admin or by `createsuperuser` can all be topped up at once. Two
    queries; safe to run concurrently (a row made meanwhile is skipped). Returns how many
    users had none (a concurrent call may have made some of them)."""
    missing = get_user_model().objects.filter(account__isnull=True).values_list("pk", flat=True)
    made = Account.objects.bulk_create(
        [Account(user_id=pk) for pk in missing], ignore_conflicts=True
    )
    return len(made)


# -- operator entries ----------------------------------------------------------------------


@transaction.atomic
def post_entry(
    *, account: Account, kind: str, amount: Decimal, key: str, by=None, memo: str = ""
) -> LedgerEntry:
    """Top-up, refund, adjustment or credit. Replaying the same key returns the first
    entry and changes nothing."""
    if kind not in OPERATOR_KINDS:
        raise ValidationError(f"{kind} entries are written by the accrual, not by hand.")
    amount = Decimal(amount)
    if amount.as_tuple().exponent < -4:
        raise ValidationError("Amounts have at most 4 decimal places.")
    if kind in (LedgerEntry.Kind.TOPUP, LedgerEntry.Kind.REFUND, LedgerEntry.Kind.CREDIT) and (
        amount <= 0
    ):
        raise ValidationError(f"A {kind} adds money: give a positive amount.")
    if amount == 0:
        raise ValidationError("An adjustment of 0 changes nothing.")
    if not memo.strip():
        raise ValidationError("Say why (the reason is kept with the entry).")
    account = Account.objects.select_for_update().get(pk=account.pk)
    existing = LedgerEntry.objects.filter(key=key).first()
    if existing is not None:
        return existing
    account.balance += amount
    entry = LedgerEntry.objects.create(
        account=account,
        kind=kind,
        amount=amount,
        balance_after=account.balance,
        key=key,
        memo=memo[:300],
        created_by=by,
    )
    rollups.add_entry(entry)
    fields = ["balance", "low_notified_at"]
    account.low_notified_at = None  # money in: a new low is worth telling again
    if account.balance > 0 and account.exhausted_at is not None:
        account.exhausted_at = None
        fields.append("exhausted_at")
    account.save(update_fields=fields)
    return entry


# -- accrual ---------------------------------------------------------------------------------


@dataclass
class AccrualReport:
    now: datetime
    clusters: int = 0
    entries: int = 0
    charged: Decimal = Decimal("0")
    settled: int = 0
    exhausted: list[int] = field(default_factory=list)


def open_meters(now: datetime) -> int:
    """A meter for every cluster that has held capacity and has none yet; it starts at the
    second its first node was placed."""
    fresh = list(
        Cluster.objects.filter(meter__isnull=True, node_set__isnull=False)
        .values("pk", "owner_id")
        .annotate(first=Min("node_set__placed_at"))
    )
    if not fresh:
        return 0
    owners = {row["owner_id"] for row in fresh}
    Account.objects.bulk_create(
        [Account(user_id=o) for o in owners], ignore_conflicts=True, batch_size=2000
    )
    accounts = dict(Account.objects.filter(user_id__in=owners).values_list("user_id", "pk"))
    Meter.objects.bulk_create(
        [
            Meter(
                cluster_id=row["pk"],
                account_id=accounts[row["owner_id"]],
                billed_until=floor_s(row["first"]),
            )
            for row in fresh
        ],
        ignore_conflicts=True,  # another tick made it meanwhile: same start either way
        batch_size=2000,
    )
    return len(fresh)


def accrue(*, now: datetime | None = None, batch: int = 2000) -> AccrualReport:
    """Charge every open meter from where it was billed up to `now` (whole seconds), and
    settle released clusters up to their release second. Safe to run twice, or twice at
    once: each meter is read under its row lock and moves forward only."""
    now = floor_s(now or timezone.now())
    report = AccrualReport(now=now)
    open_meters(now)
    book = RateBook.load()
    ids = list(
        Meter.objects.filter(settled=False)
        .order_by("account_id", "cluster_id")
        .values_list("cluster_id", flat=True)
    )
    for start in range(0, len(ids), batch):
        _accrue_batch(ids[start : start + batch], now, book, report)
    if report.exhausted:
        stop_exhausted(report.exhausted, report)
    return report


def _nodes_of(units: dict[int, int]) -> dict[int, list[tuple[datetime, datetime | None, int]]]:
    """cluster id -> its nodes' (placed, released, units) for the clusters in `units`
    (cluster id -> units a node holds: its GPUs, or 1 for a CPU-only instance). A
    preempted node's billing ends at its preemption notice, not when its GPUs came back;
    a node on a host that went down, at the second the host was seen down (it is placed
    again, as a new node, when the host is back or it moves)."""
    out: dict[int, list] = {}
    rows = Node.objects.filter(cluster_id__in=list(units)).values_list(
        "cluster_id", "placed_at", "preempted_at", "lost_at", "released_at"
    )
    for cluster_id, placed, *ends in rows:
        released = min((t for t in ends if t is not None), default=None)
        out.setdefault(cluster_id, []).append(
            (floor_s(placed), floor_s(released) if released else None, units[cluster_id])
        )
    return out


@dataclass
class _Segment:
    start: datetime
    end: datetime
    units: int
    rate: Decimal | None


def segments(*, nodes, since: datetime, until: datetime, book: RateBook, cluster) -> list[_Segment]:
    """Split (since, until] wherever the number of units held or the price changes."""
    points = {since, until}
    for placed, released, _ in nodes:
        for t in (placed, released):
            if t is not None and since < t < until:
                points.add(t)
    points.update(book.changes_between(since, until))
    ordered = sorted(points)
    out: list[_Segment] = []
    for a, b in zip(ordered, ordered[1:], strict=False):
        units = sum(
            u
            for placed, released, u in nodes
            if placed <= a and (released is None or released >= b)
        )
        card = book.at(a)
        rate = (
            card.rate(
                gpu_model_id=cluster.gpu_model_id,
                instance_type_id=cluster.instance_type_id,
                spot=cluster.spot,
            )
            if card
            else None
        )
        if out and out[-1].units == units and out[-1].rate == rate and out[-1].end == a:
            out[-1].end = b
        else:
            out.append(_Segment(a, b, units, rate))
    return [s for s in out if s.units]


@dataclass
class _Meter:
    """One open meter and the cluster facts accrual needs, read under the meter's lock
    (plain values: 10,000 of these cost a fraction of as many model instances)."""

    cluster_id: int
    account_id: int
    billed_until: datetime
    exact: Decimal
    charged: Decimal
    state: str
    gpu_model_id: int | None
    instance_type_id: int | None
    spot: bool
    nodes: int
    gpus_per_node: int
    settled: bool = False

    FIELDS = (
        "cluster_id", "account_id", "billed_until", "exact", "charged", "cluster__state",
        "cluster__gpu_model_id", "cluster__instance_type_id", "cluster__spot",
        "cluster__nodes", "cluster__gpus_per_node",
    )  # fmt: skip


@dataclass
class _Account:
    pk: int
    balance: Decimal
    exhausted_at: datetime | None
    charged: bool = False


# The columns accrual writes, in the order of the tuples `_entry` makes.
ENTRY_FIELDS = (
    "account", "kind", "amount", "balance_after", "key", "cluster", "period_from",
    "period_to", "units", "rate", "gpu_model", "memo", "created_at",
)  # fmt: skip


def _accrue_batch(cluster_ids: list[int], now: datetime, book: RateBook, report) -> None:
    entries: list[tuple] = []
    with transaction.atomic():
        meters = [
            _Meter(*row)
            for row in Meter.objects.select_for_update(of=("self",))
            .filter(cluster_id__in=cluster_ids, settled=False)
            .order_by("cluster_id")
            .values_list(*_Meter.FIELDS)
        ]
        if not meters:
            return
        nodes = _nodes_of({m.cluster_id: m.gpus_per_node or 1 for m in meters})
        accounts = {
            row[0]: _Account(*row)
            for row in Account.objects.select_for_update()
            .filter(pk__in={m.account_id for m in meters})
            .order_by("pk")
            .values_list("pk", "balance", "exhausted_at")
        }
        written = timezone.now()
        for meter in meters:
            held = nodes.get(meter.cluster_id, [])
            ended = meter.state in (Cluster.State.RELEASED, Cluster.State.FAILED) and all(
                released is not None for _, released, _ in held
            )
            last = max((r for _, r, _ in held if r is not None), default=None)
            until = min(now, last) if ended and last is not None else now
            account = accounts[meter.account_id]
            if until > meter.billed_until:
                for seg in segments(
                    nodes=held, since=meter.billed_until, until=until, book=book, cluster=meter
                ):
                    seconds = int((seg.end - seg.start).total_seconds())
                    rate = seg.rate if seg.rate is not None else Decimal("0")
                    entries.append(
                        _entry(
                            meter,
                            account,
                            rate=rate,
                            units=seg.units,
                            seconds=seconds,
                            key=f"usage:{meter.cluster_id}:{epoch(seg.start)}:{epoch(seg.end)}",
                            period=(seg.start, seg.end),
                            written=written,
                            memo=""
                            if seg.rate is not None
                            else "no price on the rate card: not charged",
                        )  # fmt: skip
                    )
                meter.billed_until = until
            if ended and meter.billed_until >= (last or meter.billed_until):
                minimum = _minimum_charge(meter, account, held, book, written)
                if minimum is not None:
                    entries.append(minimum)
                meter.settled = True
                report.settled += 1
        # A key charged before cannot recur (the meters moved past it in the same
        # transaction); were it to, the unique constraint rolls the whole batch back.
        insert_rows(LedgerEntry, ENTRY_FIELDS, entries)
        _roll_up(entries, meters)
        update_rows(
            Meter,
            "cluster",
            ["billed_until", "exact", "charged", "settled"],
            [(m.cluster_id, m.billed_until, m.exact, m.charged, m.settled) for m in meters],
        )
        changed = [a for a in accounts.values() if a.charged]
        for account in changed:
            if account.balance <= 0:
                account.exhausted_at = account.exhausted_at or now
                report.exhausted.append(account.pk)
        update_rows(
            Account, "id", ["balance", "exhausted_at"],
            [(a.pk, a.balance, a.exhausted_at) for a in changed],
        )  # fmt: skip
    report.clusters += len(meters)
    report.entries += len(entries)
    report.charged += sum((-e[2] for e in entries), Decimal("0"))


def _roll_up(entries: list[tuple], meters: list[_Meter]) -> None:
    """The bill's hour lines and daily usage for the pieces just written (same transaction)."""
    if not entries:
        return
    by_cluster = {m.cluster_id: m for m in meters}
    names = rollups.resource_names(
        gpu_model_ids={m.gpu_model_id for m in meters},
        instance_type_ids={m.instance_type_id for m in meters},
    )
    minimum = [e[4] for e in entries if e[6] is None]
    minimum_ids = dict(
        LedgerEntry.objects.filter(key__in=minimum).values_list("cluster_id", "pk")
    ) if minimum else {}  # fmt: skip
    pieces = []
    for account, _kind, amount, _after, _key, cluster, *period_to_written in entries:
        meter = by_cluster[cluster]
        resource = rollups.resource_of(names, meter.gpu_model_id, meter.instance_type_id)
        # (start, end, units, rate, gpu, memo, at): the order of Piece's fields after cluster
        pieces.append(rollups.Piece(account, amount, cluster, *period_to_written, resource))
    rollups.add_usage(pieces, minimum_entries=minimum_ids)


def _entry(meter: _Meter, account: _Account, *, rate, units, seconds, key, period, written, memo):
    """Charge `units x seconds` at `rate` per unit-hour: add it to the meter's exact cost,
    charge the newly rounded total minus what was charged before, and return the row."""
    meter.exact += units * seconds * rate
    total = to_money(meter.exact)
    amount = total - meter.charged
    meter.charged = total
    account.balance -= amount
    account.charged = True
    return (
        account.pk, LedgerEntry.Kind.USAGE.value, -amount, account.balance, key,
        meter.cluster_id, period[0], period[1], units, rate, meter.gpu_model_id, memo, written,
    )  # fmt: skip


def _minimum_charge(meter: _Meter, account: _Account, held, book: RateBook, written):
    if not held:
        return None
    start = min(p for p, _, _ in held)
    card = book.at(start)
    if card is None or not card.min_charge_s:
        return None
    seconds = int((meter.billed_until - start).total_seconds())
    short = card.min_charge_s - seconds
    if short <= 0:
        return None
    rate = card.rate(
        gpu_model_id=meter.gpu_model_id, instance_type_id=meter.instance_type_id, spot=meter.spot
    )
    if not rate:
        return None
    return _entry(
        meter, account, rate=rate, units=max(meter.nodes, 1) * (meter.gpus_per_node or 1),
        seconds=short, key=f"minimum:{meter.cluster_id}", period=(None, None), written=written,
        memo=f"minimum charge: {card.min_charge_s} s, {seconds} s used",
    )  # fmt: skip


# -- running out -----------------------------------------------------------------------------


def stop_exhausted(account_ids: list[int], report: AccrualReport | None = None) -> list[int]:
    """Release every pending or running cluster of these accounts, then bill them up to
    the second they stopped (in this same tick, so the overdraft stays within one period)."""
    stopped = []
    for cluster in Cluster.objects.filter(
        owner__account__pk__in=account_ids,
        state__in=[Cluster.State.PENDING, Cluster.State.RUNNING, Cluster.State.PREEMPTING],
    ):
        fleet.cluster_release(cluster=cluster, reason=EXHAUSTED)
        stopped.append(cluster.pk)
    if stopped:
        later = floor_s(timezone.now())
        book = RateBook.load()
        _accrue_batch(stopped, later, book, report or AccrualReport(now=later))
    log.warning("accounts %s exhausted: stopped clusters %s", account_ids, stopped)
    return stopped


def enough_balance(account: Account, per_hour: Decimal) -> bool:
    minutes = settings.SUANLI_MIN_BALANCE_MINUTES
    return account.balance >= per_hour * minutes / 60


def notify_low_balances() -> int:
    """`balance.low` once per low spell: accounts with running clusters and under
    `SUANLI_LOW_BALANCE_HOURS` of balance left at the current burn."""
    sent = 0
    owners = Cluster.objects.filter(state=Cluster.State.RUNNING).values_list("owner_id", flat=True)
    for account in Account.objects.filter(
        user_id__in=set(owners), low_notified_at__isnull=True
    ).select_related("user"):
        standing = selectors.standing(account.user)
        if not standing.low:
            continue
        with transaction.atomic():
            if not Account.objects.filter(pk=account.pk, low_notified_at__isnull=True).update(
                low_notified_at=timezone.now()
            ):
                continue
            webhooks.emit(
                owner_id=account.user_id,
                event_type="balance.low",
                data={
                    "balance": str(standing.balance), "currency": standing.currency,
                    "burn_per_hour": str(standing.burn_per_hour), "hours_left": (
                        str(round(standing.hours_left, 2)) if standing.hours_left is not None else None
                    ),
                    "url": webhooks._link("billing"),
                },
            )  # fmt: skip
            sent += 1
    return sent

"""Reads of money that pages and other code reuse."""

from __future__ import annotations

import calendar
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.conf import settings
from django.db.models import (
    Count,
    DurationField,
    ExpressionWrapper,
    F,
    Max,
    Min,
    Q,
    QuerySet,
    Sum,
)
from django.db.models.functions import Trunc, TruncDate
from django.utils import timezone

from billing import formatting
from billing.models import UNIT, Account, LedgerEntry, Meter
from billing.pricing import Quote, RateBook, per_hour_of, quote
from jobs.models import Cluster, Node

ZERO = Decimal("0")


@dataclass(frozen=True)
class Standing:
    """Where a researcher stands: balance, what they burn now, how long that lasts."""

    currency: str
    balance: Decimal
    burn_per_hour: Decimal
    hours_left: Decimal | None  # None: nothing burns

    @property
    def low(self) -> bool:
        if self.balance <= 0 and self.burn_per_hour > 0:
            return True
        return self.hours_left is not None and self.hours_left < settings.SUANLI_LOW_BALANCE_HOURS

    @property
    def time_left_text(self) -> str:
        if self.hours_left is None:
            return "nothing running"
        minutes = int(self.hours_left * 60)
        if minutes <= 0:
            return "none"
        if minutes < 120:
            return f"{minutes} min"
        hours = minutes // 60
        return f"{hours} h" if hours < 72 else f"{hours // 24} days"


def balance_of(user) -> Decimal:
    return Account.objects.filter(user=user).values_list(
        "balance", flat=True
    ).first() or ZERO.quantize(UNIT)


def burn_per_hour(user, *, book: RateBook | None = None, now=None) -> Decimal:
    """What the user's clusters cost per hour right now, at the prices in force now."""
    book = book or RateBook.load()
    now = now or timezone.now()
    card = book.at(now)
    if card is None:
        return ZERO
    total = ZERO
    rows = (
        Node.objects.filter(
            cluster__owner=user,
            cluster__state__in=Cluster.HOLDS_CAPACITY,
            released_at__isnull=True,
        )
        .values_list(
            "cluster__gpu_model_id",
            "cluster__instance_type_id",
            "cluster__spot",
            "cluster__gpus_per_node",
        )
        .order_by()
    )
    for gpu_model_id, instance_type_id, spot, gpus in rows:
        rate = card.rate(gpu_model_id=gpu_model_id, instance_type_id=instance_type_id, spot=spot)
        if rate is not None:
            total += rate * (gpus or 1)
    return total.quantize(UNIT, rounding=ROUND_HALF_UP)


def standing(user) -> Standing:
    book = RateBook.load()
    balance = balance_of(user)
    burn = burn_per_hour(user, book=book)
    hours = None
    if burn > 0:
        hours = max(balance, ZERO) / burn
    return Standing(book.currency, balance, burn, hours)


def quote_for(*, gpu_model_id=None, instance_type_id=None, units: int = 1) -> Quote:
    return quote(
        RateBook.load(),
        gpu_model_id=gpu_model_id,
        instance_type_id=instance_type_id,
        units=units,
        now=timezone.now(),
    )


def price_table(now=None) -> dict:
    """Per unit-hour prices in force now, for the cluster form's live estimate:
    {"gpu": {id: [on_demand, spot]}, "cpu": {...}, "currency": "CNY"}."""
    book = RateBook.load()
    card = book.at(now or timezone.now())
    out: dict = {"gpu": {}, "cpu": {}, "currency": book.currency}
    if card is None:
        return out
    for kind, table in (("gpu", card.gpu), ("cpu", card.cpu)):
        for pk in table:
            ids = {"gpu_model_id": pk, "instance_type_id": None}
            if kind == "cpu":
                ids = {"gpu_model_id": None, "instance_type_id": pk}
            demand = card.rate(**ids, spot=False)
            spot = card.rate(**ids, spot=True)
            out[kind][pk] = [str(per_hour_of(demand, 1)), str(per_hour_of(spot, 1))]
    return out


# -- the ledger --------------------------------------------------------------------------


def entries_of(
    user,
    *,
    kind: str = "",
    cluster_id: int | None = None,
    start: datetime | None = None,
    end: datetime | None = None,
    hour: datetime | None = None,
) -> QuerySet[LedgerEntry]:
    """The ledger as written (every accrual piece), newest first: the bill's detail.
    `start`/`end` bound when an entry was charged; `hour`, the start of its period."""
    qs = LedgerEntry.objects.filter(account__user=user).select_related("cluster", "gpu_model")
    if kind:
        qs = qs.filter(kind=kind)
    if cluster_id:
        qs = qs.filter(cluster_id=cluster_id)
    if start is not None:
        qs = qs.filter(created_at__gte=start)
    if end is not None:
        qs = qs.filter(created_at__lt=end)
    if hour is not None:
        qs = qs.filter(period_from__gte=hour, period_from__lt=hour + timedelta(hours=1))
    return qs.order_by("-created_at", "-id")


def cost_per_cluster(user) -> list[dict]:
    rows = list(
        LedgerEntry.objects.filter(account__user=user, kind=LedgerEntry.Kind.USAGE)
        .values("cluster_id", "cluster__name", "cluster__state")
        .annotate(cost=-Sum("amount"))
        .order_by("-cost")
    )
    for row in rows:
        row["cost"] = formatting.amount(row["cost"])
    return rows


def _days(days: int, today: date) -> list[date]:
    return [today - timedelta(days=i) for i in range(days - 1, -1, -1)]


def daily_cost(user, *, days: int = 30, today: date | None = None) -> list[tuple[date, Decimal]]:
    """Usage per UTC day (the day it was charged), zero-filled."""
    today = today or timezone.now().astimezone(UTC).date()
    since = datetime.combine(today - timedelta(days=days - 1), datetime.min.time(), tzinfo=UTC)
    rows = dict(
        LedgerEntry.objects.filter(
            account__user=user, kind=LedgerEntry.Kind.USAGE, created_at__gte=since
        )
        .annotate(day=TruncDate("created_at", tzinfo=UTC))
        .values("day")
        .annotate(cost=-Sum("amount"))
        .values_list("day", "cost")
    )
    return [(d, formatting.amount(rows.get(d, ZERO))) for d in _days(days, today)]


def month_bounds(year: int, month: int) -> tuple[datetime, datetime]:
    start = datetime(year, month, 1, tzinfo=UTC)
    days = calendar.monthrange(year, month)[1]
    return start, start + timedelta(days=days)


def statement(user, year: int, month: int) -> QuerySet[LedgerEntry]:
    start, end = month_bounds(year, month)
    return (
        LedgerEntry.objects.filter(account__user=user, created_at__gte=start, created_at__lt=end)
        .select_related("cluster", "gpu_model", "created_by")
        .order_by("created_at", "id")
    )


# -- the bill: one line per cluster and hour ---------------------------------------------


@dataclass(frozen=True)
class BillLine:
    """A line of the bill. Usage is summed per cluster, UTC hour (of the pieces' start),
    units and rate, so an hour reads as one line with its exact seconds; the pieces the
    accrual wrote (one per tick) stay in the ledger for the detail view. Every other entry
    (top-up, refund, adjustment, credit) is a line of its own."""

    kind: str
    at: datetime  # when it was charged (usage: its last piece)
    amount: Decimal
    cluster_id: int | None = None
    cluster_name: str = ""
    resource: str = ""  # the GPU model, or the CPU-only instance type
    period_from: datetime | None = None
    period_to: datetime | None = None
    seconds: int | None = None
    units: int = 0
    rate: Decimal | None = None
    pieces: int = 1
    hour: datetime | None = None  # the usage line's hour: its pieces in the detail view
    balance_after: Decimal | None = None  # of a single entry only
    memo: str = ""
    key: str = ""

    @property
    def is_usage(self) -> bool:
        return self.kind == LedgerEntry.Kind.USAGE

    @property
    def hour_key(self) -> str:
        """The detail view's `hour` parameter for this line ("2026-12-03T10", UTC)."""
        return self.hour.astimezone(UTC).strftime("%Y-%m-%dT%H") if self.hour else ""

    def get_kind_display(self) -> str:
        return LedgerEntry.Kind(self.kind).label


def _seconds(duration) -> int | None:
    return None if duration is None else int(duration.total_seconds())


def usage_lines(
    user, *, start: datetime, end: datetime, cluster_id: int | None = None
) -> list[BillLine]:
    """Usage charged in [start, end), summed in the database per cluster and hour."""
    qs = LedgerEntry.objects.filter(
        account__user=user,
        created_at__gte=start,
        created_at__lt=end,
        kind=LedgerEntry.Kind.USAGE,
    )
    if cluster_id:
        qs = qs.filter(cluster_id=cluster_id)
    held = ExpressionWrapper(F("period_to") - F("period_from"), output_field=DurationField())
    rows = (
        qs.annotate(hour=Trunc("period_from", "hour", tzinfo=UTC))
        .values(
            "cluster_id",
            "cluster__name",
            "gpu_model__name",
            "cluster__instance_type__name",
            "hour",
            "units",
            "rate",
            "memo",
        )  # fmt: skip
        .annotate(
            first=Min("period_from"),
            last=Max("period_to"),
            held=Sum(held),
            total=Sum("amount"),
            pieces=Count("id"),
            at=Max("created_at"),
        )
        .order_by()  # the model's ordering would join the GROUP BY
    )
    return [
        BillLine(
            kind=LedgerEntry.Kind.USAGE,
            at=row["at"],
            amount=formatting.amount(row["total"]),
            cluster_id=row["cluster_id"],
            cluster_name=row["cluster__name"] or "",
            resource=row["gpu_model__name"] or row["cluster__instance_type__name"] or "",
            period_from=row["first"],
            period_to=row["last"],
            seconds=_seconds(row["held"]),
            units=row["units"],
            rate=formatting.rate(row["rate"]),
            pieces=row["pieces"],
            hour=row["hour"],
            memo=row["memo"],
        )
        for row in rows
    ]


def other_lines(
    user, *, start: datetime, end: datetime, cluster_id: int | None = None
) -> list[BillLine]:
    qs = (
        LedgerEntry.objects.filter(account__user=user, created_at__gte=start, created_at__lt=end)
        .exclude(kind=LedgerEntry.Kind.USAGE)
        .select_related("cluster")
        .order_by()
    )
    if cluster_id:
        qs = qs.filter(cluster_id=cluster_id)
    return [
        BillLine(
            kind=e.kind,
            at=e.created_at,
            amount=formatting.amount(e.amount),
            cluster_id=e.cluster_id,
            cluster_name=e.cluster.name if e.cluster else "",
            balance_after=formatting.amount(e.balance_after),
            memo=e.memo,
            key=e.key,
        )
        for e in qs
    ]


def bill(
    user, year: int, month: int, *, kind: str = "", cluster_id: int | None = None
) -> list[BillLine]:
    """One month's lines (by the second they were charged), oldest first."""
    start, end = month_bounds(year, month)
    lines: list[BillLine] = []
    if kind in ("", LedgerEntry.Kind.USAGE):
        lines += usage_lines(user, start=start, end=end, cluster_id=cluster_id)
    if kind != LedgerEntry.Kind.USAGE:
        lines += [
            line
            for line in other_lines(user, start=start, end=end, cluster_id=cluster_id)
            if not kind or line.kind == kind
        ]
    return sorted(lines, key=lambda line: (line.at, line.period_from or line.at, line.kind))


@dataclass(frozen=True)
class ClusterCost:
    """What a cluster costs: per hour at its size, charged so far, and once it is settled
    its final cost and the seconds it was billed for."""

    currency: str
    per_hour: Decimal | None  # None: no price on the rate card
    charged: Decimal
    billed_until: datetime | None
    settled: bool
    seconds: int | None  # billed seconds, once settled
    live: bool  # may still change: worth polling
    minimum: bool = False  # the final cost includes the rate card's minimum charge

    @property
    def started(self) -> bool:
        return self.billed_until is not None


def cluster_cost(cluster: Cluster) -> ClusterCost:
    book = RateBook.load()
    meter = Meter.objects.filter(cluster=cluster).first()
    card = book.at(meter.billed_until if meter and meter.settled else timezone.now())
    per_hour = None
    if card is not None:
        rate = card.rate(
            gpu_model_id=cluster.gpu_model_id,
            instance_type_id=cluster.instance_type_id,
            spot=cluster.spot,
        )
        if rate is not None:
            per_hour = per_hour_of(rate, max(cluster.nodes, 1) * (cluster.gpus_per_node or 1))
    seconds = None
    if meter is not None and meter.settled:
        held = ExpressionWrapper(F("period_to") - F("period_from"), output_field=DurationField())
        seconds = (
            _seconds(
                LedgerEntry.objects.filter(cluster=cluster, kind=LedgerEntry.Kind.USAGE)
                .order_by()
                .aggregate(held=Sum(held))["held"]
            )
            or 0
        )
    return ClusterCost(
        currency=card.currency if card else book.currency,
        per_hour=per_hour,
        charged=formatting.amount(meter.charged if meter else ZERO),
        billed_until=meter.billed_until if meter else None,
        settled=bool(meter and meter.settled),
        seconds=seconds,
        minimum=seconds is not None
        and LedgerEntry.objects.filter(key=f"minimum:{cluster.pk}").exists(),
        live=not (meter and meter.settled)
        and (
            meter is not None or cluster.state not in (Cluster.State.RELEASED, Cluster.State.FAILED)
        ),
    )


# -- the operator's view -----------------------------------------------------------------


def revenue(*, days: int = 30, today: date | None = None) -> dict:
    """Usage revenue per UTC day and per GPU model (CPU-only types under their own name)."""
    today = today or timezone.now().astimezone(UTC).date()
    since = datetime.combine(today - timedelta(days=days - 1), datetime.min.time(), tzinfo=UTC)
    rows = (
        LedgerEntry.objects.filter(kind=LedgerEntry.Kind.USAGE, created_at__gte=since)
        .annotate(day=TruncDate("created_at", tzinfo=UTC))
        .values("day", "gpu_model__name", "cluster__instance_type__name")
        .annotate(amount=-Sum("amount"))
        .order_by("day")
    )
    per_model: dict[str, dict[date, Decimal]] = {}
    for row in rows:
        name = row["gpu_model__name"] or row["cluster__instance_type__name"] or "other"
        by_day = per_model.setdefault(name, {})
        by_day[row["day"]] = by_day.get(row["day"], ZERO) + formatting.amount(row["amount"])
    axis = _days(days, today)
    series = {
        name: [by_day.get(d, ZERO.quantize(UNIT)) for d in axis]
        for name, by_day in sorted(per_model.items())
    }
    totals = [sum((s[i] for s in series.values()), ZERO.quantize(UNIT)) for i in range(len(axis))]
    return {"days": axis, "series": series, "totals": totals}


def accounts_overview() -> QuerySet[Account]:
    return (
        Account.objects.select_related("user")
        .annotate(
            spent=-Sum("entries__amount", filter=Q(entries__kind=LedgerEntry.Kind.USAGE)),
            paid=Sum("entries__amount", filter=Q(entries__kind=LedgerEntry.Kind.TOPUP)),
        )
        .order_by("balance")
    )

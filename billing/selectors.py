"""Reads of money that pages and other code reuse."""

from __future__ import annotations

import calendar
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.conf import settings
from django.db.models import Q, QuerySet, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from billing.models import UNIT, Account, LedgerEntry
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


def entries_of(user, *, kind: str = "", cluster_id: int | None = None) -> QuerySet[LedgerEntry]:
    qs = LedgerEntry.objects.filter(account__user=user).select_related("cluster", "gpu_model")
    if kind:
        qs = qs.filter(kind=kind)
    if cluster_id:
        qs = qs.filter(cluster_id=cluster_id)
    return qs.order_by("-created_at", "-id")


def cost_per_cluster(user) -> list[dict]:
    return list(
        LedgerEntry.objects.filter(account__user=user, kind=LedgerEntry.Kind.USAGE)
        .values("cluster_id", "cluster__name", "cluster__state")
        .annotate(cost=-Sum("amount"))
        .order_by("-cost")
    )


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
    return [(d, rows.get(d, ZERO)) for d in _days(days, today)]


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
        per_model.setdefault(name, {})[row["day"]] = row["amount"]
    axis = _days(days, today)
    series = {
        name: [by_day.get(d, ZERO) for d in axis] for name, by_day in sorted(per_model.items())
    }
    totals = [sum((s[i] for s in series.values()), ZERO) for i in range(len(axis))]
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

"""Reads of money that pages and other code reuse."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.conf import settings
from django.db import connection
from django.db.models import DecimalField, OuterRef, Q, QuerySet, Subquery, Sum
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import pgettext

from billing import formatting
from billing.models import MONEY, UNIT, Account, BillLine, LedgerEntry, Meter, UsageDay
from billing.pricing import GPU, NO_GPU, STOPPED, Quote, RateBook, charged_at, per_hour_of, quote
from jobs.base import text
from jobs.files import storage
from jobs.models import Cluster, Node

ZERO = Decimal("0")


CRITICAL_HOURS = Decimal("0.5")  # balance.critical, and the banner's alarm: under 30 minutes


def warn_hours_default() -> Decimal:
    """The operator's low-balance threshold (SUANLI_LOW_BALANCE_HOURS), for researchers
    who never chose their own."""
    return Decimal(str(settings.SUANLI_LOW_BALANCE_HOURS))


@dataclass(frozen=True)
class Standing:
    """Where a researcher stands: balance, what they burn now, how long that lasts, and
    below how many hours left they are warned (their own choice or the operator's)."""

    currency: str
    balance: Decimal
    burn_per_hour: Decimal
    hours_left: Decimal | None  # None: nothing burns
    warn_hours: Decimal = Decimal("2")
    stopped_for_balance: bool = False  # its clusters were stopped at exhaustion

    @property
    def used_up(self) -> bool:
        """Nothing left: clusters are being stopped (or were, at exhaustion)."""
        return self.balance <= 0 and (self.burn_per_hour > 0 or self.stopped_for_balance)

    @property
    def low(self) -> bool:
        """Under the researcher's threshold at the current burn (or used up): the banner
        shows, `balance.low` is sent."""
        if self.used_up:
            return True
        return self.hours_left is not None and self.hours_left < self.warn_hours

    @property
    def critical(self) -> bool:
        """Under 30 minutes left at the current burn: `balance.critical`."""
        if self.balance <= 0 and self.burn_per_hour > 0:
            return True
        return self.hours_left is not None and self.hours_left < CRITICAL_HOURS

    @property
    def seconds_left(self) -> int | None:
        if self.hours_left is None:
            return None
        return int((self.hours_left * 3600).to_integral_value(ROUND_HALF_UP))

    @property
    def time_left_text(self) -> str:
        """ "1 h 20 min" in the language of the request that reads it; "nothing running"
        when nothing burns."""
        if self.hours_left is None:
            return _("nothing running")
        return text.duration(self.seconds_left)


_NO_BALANCE = ZERO.quantize(UNIT)  # one without an account (or at 0): `balance_of`, `balances_of`


def balance_of(user) -> Decimal:
    return (
        Account.objects.filter(user=user).values_list("balance", flat=True).first() or _NO_BALANCE
    )


def burn_per_hour(
    user, *, book: RateBook | None = None, now=None, balance: Decimal | None = None
) -> Decimal:
    """What the user's clusters cost per hour right now, at the prices in force now and at
    their balance (`balance`, else the account's): each node that holds capacity at its
    cluster's price (a node without GPUs at the no-GPU price), each stopped node's kept
    workspace at the stopped price, and the storage bought above the free part at the
    storage price; only what the accrual charges at that balance (`pricing.charged_at`:
    kept workspaces not at or below 0)."""
    book = book or RateBook.load()
    now = now or timezone.now()
    card = book.at(now)
    if card is None:
        return ZERO
    if balance is None:
        balance = balance_of(user)
    kept_charged = charged_at(STOPPED, balance)
    total = card.storage * storage.extra_gb(user.pk, at=now)
    holding = Q(cluster__state__in=Cluster.HOLDS_CAPACITY, released_at__isnull=True)
    # Kept until its cluster starts again or is released, whatever the cluster's state now:
    # the accrual charges every open kept interval.
    kept = Q(stopped_at__isnull=False, kept_until__isnull=True)
    rows = (
        Node.objects.filter(cluster__owner=user)
        .filter(holding | kept)
        .values_list(
            "no_gpu",
            "kept_until",
            "stopped_at",
            "cluster__gpu_model_id",
            "cluster__instance_type_id",
            "cluster__spot",
            "cluster__gpus_per_node",
        )
        .order_by()
    )
    for no_gpu, kept_until, stopped_at, gpu_model_id, instance_type_id, spot, gpus in rows:
        if stopped_at is not None and kept_until is None:
            total += card.stopped if kept_charged else ZERO
        elif no_gpu:
            total += card.no_gpu
        else:
            rate = card.rate(
                gpu_model_id=gpu_model_id, instance_type_id=instance_type_id, spot=spot
            )
            if rate is not None:
                total += rate * (gpus or 1)
    return total.quantize(UNIT, rounding=ROUND_HALF_UP)


def standing(user, *, account: Account | None = None) -> Standing:
    """`user`'s standing now; with `account` (theirs, as changed in memory under its lock),
    at that account's balance."""
    book = RateBook.load()
    if account is not None:
        row = (account.balance, account.low_balance_hours, account.exhausted_at)
    else:
        row = (
            Account.objects.filter(user=user)
            .values_list("balance", "low_balance_hours", "exhausted_at")
            .first()
        )
    balance, warn, exhausted_at = row or (ZERO.quantize(UNIT), None, None)
    burn = burn_per_hour(user, book=book, balance=balance)
    hours = None
    if burn > 0:
        hours = max(balance, ZERO) / burn
    warn = warn if warn is not None else warn_hours_default()
    return Standing(book.currency, balance, burn, hours, warn, exhausted_at is not None)


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
    {"gpu": {id: [on_demand, spot]}, "cpu": {...}, "currency": "CNY", "no_gpu": "0.1000",
    "stopped": "0.0000"} (the last two per node-hour; None without a card in force)."""
    book = RateBook.load()
    card = book.at(now or timezone.now())
    out: dict = {"gpu": {}, "cpu": {}, "currency": book.currency, "no_gpu": None, "stopped": None}
    if card is None:
        return out
    out["no_gpu"] = str(per_hour_of(card.no_gpu, 1))
    out["stopped"] = str(per_hour_of(card.stopped, 1))
    for kind, table in (("gpu", card.gpu), ("cpu", card.cpu)):
        for pk in table:
            ids = {"gpu_model_id": pk, "instance_type_id": None}
            if kind == "cpu":
                ids = {"gpu_model_id": None, "instance_type_id": pk}
            demand = card.rate(**ids, spot=False)
            spot = card.rate(**ids, spot=True)
            out[kind][pk] = [str(per_hour_of(demand, 1)), str(per_hour_of(spot, 1))]
    return out


@dataclass(frozen=True)
class StopPrices:
    """What a stopped GPU cluster costs, per node-hour, at the card in force: started
    without GPUs (its workspaces only), and kept while stopped (0: free)."""

    currency: str
    no_gpu: Decimal | None  # None: no card in force
    stopped: Decimal | None

    @property
    def stopped_free(self) -> bool:
        return not self.stopped


def stop_prices(now=None, *, book: RateBook | None = None) -> StopPrices:
    """For the cluster page: "Start without GPUs: 0.1000 CNY per node-hour"."""
    book = book or RateBook.load()
    card = book.at(now or timezone.now())
    if card is None:
        return StopPrices(book.currency, None, None)
    return StopPrices(card.currency, per_hour_of(card.no_gpu, 1), per_hour_of(card.stopped, 1))


# -- the ledger --------------------------------------------------------------------------


def account_id_of(user) -> int | None:
    """The user's account id: every list below filters on it, so that PostgreSQL walks the
    account's own index rows instead of joining through users."""
    return Account.objects.filter(user=user).values_list("pk", flat=True).first()


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
    `start`/`end` bound when an entry was charged; `hour`, the start of its period (one
    cluster-hour's pieces, by the cluster's index)."""
    qs = LedgerEntry.objects.filter(account_id=account_id_of(user)).select_related(
        "cluster", "gpu_model", "member"
    )
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


@dataclass(frozen=True)
class ClusterTotals:
    rows: list[dict]  # the costliest clusters: cluster_id, name, state, cost
    more: int  # how many other clusters have cost something


def cost_per_cluster(user, *, limit: int = 10) -> ClusterTotals:
    """The costliest clusters ever, from their meters (a meter holds what the ledger
    charged its cluster, exactly): one row per cluster, no sum over the ledger."""
    meters = Meter.objects.filter(account_id=account_id_of(user), charged__gt=0)
    rows = list(
        meters.order_by("-charged", "-cluster_id").values(
            "cluster_id", "cluster__name", "cluster__state", "charged"
        )[:limit]
    )
    for row in rows:
        row["cost"] = formatting.amount(row.pop("charged"))
    more = meters.count() - len(rows) if len(rows) == limit else 0
    return ClusterTotals(rows, more)


def _days(days: int, today: date) -> list[date]:
    return [today - timedelta(days=i) for i in range(days - 1, -1, -1)]


def daily_cost(user, *, days: int = 30, today: date | None = None) -> list[tuple[date, Decimal]]:
    """Usage per UTC day (the day it was charged), zero-filled, from the daily rollup."""
    today = today or timezone.now().astimezone(UTC).date()
    rows = dict(
        UsageDay.objects.filter(
            account_id=account_id_of(user), day__gte=today - timedelta(days=days - 1)
        )
        .values("day")
        .annotate(cost=Sum("amount"))
        .order_by()
        .values_list("day", "cost")
    )
    return [(d, formatting.amount(rows.get(d, ZERO))) for d in _days(days, today)]


def month_bounds(year: int, month: int, zone=UTC) -> tuple[datetime, datetime]:
    """The month's first and next month's first instant in `zone` (the reader's, on the
    pages and statements: a Shanghai reader's December is 12-01 00:00+08:00 up to 01-01
    00:00+08:00; UTC for the API)."""
    start = datetime(year, month, 1, tzinfo=zone)
    end = datetime(year + 1, 1, 1, tzinfo=zone) if month == 12 else start.replace(month=month + 1)
    return start, end


def statement(user, year: int, month: int, zone=UTC) -> QuerySet[LedgerEntry]:
    """One month (in `zone`) of the ledger as written (the audit CSV), oldest first, by the
    account's index."""
    start, end = month_bounds(year, month, zone)
    return (
        LedgerEntry.objects.filter(
            account_id=account_id_of(user), created_at__gte=start, created_at__lt=end
        )
        .select_related("cluster", "gpu_model", "created_by", "member")
        .order_by("created_at", "id")
    )


def first_month(user, zone=UTC) -> tuple[int, int] | None:
    first = (
        BillLine.objects.filter(account_id=account_id_of(user))
        .order_by("at", "id")
        .values_list("at", flat=True)
        .first()
    )
    if first is None:
        return None
    first = first.astimezone(zone)
    return first.year, first.month


# -- the bill: one line per cluster and hour ---------------------------------------------


def bill(
    user,
    year: int,
    month: int,
    *,
    kind: str = "",
    cluster_id: int | None = None,
    zone=UTC,
) -> QuerySet[BillLine]:
    """One month's lines (the month in `zone`), newest first (usage by when its first piece
    began, other entries by when they were posted). Served by an index whatever the filter:
    (account, at), (account, kind, at) or (cluster, at)."""
    start, end = month_bounds(year, month, zone)
    qs = BillLine.objects.filter(account_id=account_id_of(user), at__gte=start, at__lt=end)
    if kind:
        qs = qs.filter(kind=kind)
    if cluster_id:
        qs = qs.filter(cluster_id=cluster_id)
    return qs.select_related("cluster__instance_type", "gpu_model", "entry", "member").order_by(
        "-at", "-id"
    )


# -- the balance after each line ---------------------------------------------------------
#
# A bill line is a sum (an hour of one cluster's pieces, charged all through the hour and
# interleaved with other clusters'), so no ledger row holds "the balance after" it. The
# bill's balance column is the account's balance walked back line by line in the bill's
# own order (`at`, then id): the newest line's is the balance now, each older one's is the
# next one's less the next one's amount. Exact Decimal arithmetic, so the column always adds
# up and a month's last line shows the balance its statement ends on. Each figure comes
# from one statement (the balance and the sums read in one snapshot).


def _balance_and_sums_after(account_id: int, since: datetime, marks: list[tuple]) -> tuple:
    """(the balance now, [sum of the account's lines after (at, id) for each mark]), read in
    one statement by the account's (account, at) index from `since` on."""
    sums = ", ".join(
        "COALESCE(SUM(CASE WHEN l.at > %s OR (l.at = %s AND l.id > %s) THEN l.amount END), 0)"
        for _mark in marks
    )
    params: list = [account_id]
    for at, pk in marks:
        params += [at, at, pk]
    # Only placeholders are joined in: every value travels as a parameter.
    sql = (
        'SELECT (SELECT a.balance FROM "billing_account" a WHERE a.id = %s)'  # noqa: S608
        + (", " + sums if sums else "")
        + ' FROM "billing_billline" l WHERE l.account_id = %s AND l.at >= %s'
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, account_id, since])
        row = cursor.fetchone()
    return (row[0] if row[0] is not None else ZERO), list(row[1:])


def balances_after(user, lines: list[BillLine]) -> list[BillLine]:
    """Set each line's `balance_after` (a page of lines, any filter, newest first): the
    account's balance right after it in the whole bill's order."""
    account_id = account_id_of(user)
    if account_id is None or not lines:
        return lines
    oldest = min(lines, key=lambda line: (line.at, line.pk))
    balance, sums = _balance_and_sums_after(
        account_id, oldest.at, [(line.at, line.pk) for line in lines]
    )
    for line, later in zip(lines, sums, strict=True):
        line.balance_after = balance - later
    return lines


def opening_balance(user, start: datetime) -> Decimal:
    """The balance before the first line at or after `start` (a statement's first row's
    balance less its amount): the balance now less every line since."""
    account_id = account_id_of(user)
    if account_id is None:
        return ZERO.quantize(UNIT)
    balance, (since,) = _balance_and_sums_after(account_id, start, [(start, 0)])
    return balance - since


def with_running_balance(lines, opening: Decimal):
    """Lines oldest first (an iterator: a statement streamed), each given the balance after
    it, from the balance before the first."""
    balance = opening
    for line in lines:
        balance += line.amount
        line.balance_after = balance
        yield line


def bill_line_of(user, line_id: int) -> BillLine | None:
    """One of the user's own bill lines; None for another account's or none at all."""
    return (
        BillLine.objects.filter(pk=line_id, account_id=account_id_of(user))
        .select_related("cluster__instance_type", "gpu_model", "entry", "member")
        .first()
    )


def pieces_of(line: BillLine) -> QuerySet[LedgerEntry]:
    """The ledger entries a line sums, newest first: a usage hour's pieces (its cluster, or
    the account's storage; its hour, size, rate and memo), or the one entry of any other."""
    if line.hour is None:
        return LedgerEntry.objects.filter(pk=line.entry_id).select_related("cluster")
    qs = LedgerEntry.objects.filter(
        account_id=line.account_id,
        kind=LedgerEntry.Kind.USAGE,
        period_from__gte=line.hour,
        period_from__lt=line.hour + timedelta(hours=1),
        units=line.units,
        rate=line.rate,
        memo=line.memo,
        member_id=line.member_id,  # an hour handed on within it: a line per member
    )
    if line.cluster_id:
        qs = qs.filter(cluster_id=line.cluster_id)
    else:
        qs = qs.filter(cluster__isnull=True)
    return qs.select_related("cluster", "member").order_by("-created_at", "-id")


@dataclass(frozen=True)
class Keyset:
    """One page of a list ordered newest first by (at, id), found from a cursor rather
    than an offset: page 1,000 costs what page 1 costs."""

    items: list
    newer: str  # cursors for the neighbouring pages ("" at either end)
    older: str

    @property
    def object_list(self) -> list:
        return self.items


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MICROSECOND = timedelta(microseconds=1)


def _cursor(direction: str, item, field: str) -> str:
    return f"{direction}:{(getattr(item, field) - EPOCH) // MICROSECOND}:{item.pk}"


def keyset(qs: QuerySet, cursor: str = "", *, size: int = 50, field: str = "at") -> Keyset:
    """`cursor` is "older:<µs>:<id>" (the page after an item) or "newer:<µs>:<id>" (the
    page before it); anything else is the first page."""
    direction, at, pk = "", None, 0
    try:
        direction, micros, pk_text = cursor.split(":")
        at = EPOCH + int(micros) * MICROSECOND
        pk = int(pk_text)
    except (ValueError, OverflowError):
        direction = ""
    if direction == "older":
        rows = list(
            qs.filter(**{f"{field}__lte": at}).exclude(**{field: at, "pk__gte": pk})[: size + 1]
        )
        more, items = len(rows) > size, rows[:size]
        return Keyset(
            items,
            newer=_cursor("newer", items[0], field) if items else "",
            older=_cursor("older", items[-1], field) if more else "",
        )
    if direction == "newer":
        rows = list(
            qs.filter(**{f"{field}__gte": at})
            .exclude(**{field: at, "pk__lte": pk})
            .reverse()[: size + 1]
        )
        more, items = len(rows) > size, rows[:size][::-1]
        return Keyset(
            items,
            newer=_cursor("newer", items[0], field) if more else "",
            older=_cursor("older", items[-1], field) if items else "",
        )
    rows = list(qs[: size + 1])
    items = rows[:size]
    return Keyset(
        items, newer="", older=_cursor("older", items[-1], field) if len(rows) > size else ""
    )


@dataclass(frozen=True)
class ClusterCost:
    """What a cluster costs: per hour at its size in its mode now, charged so far, and once
    it is settled its final cost and the seconds it was billed for."""

    currency: str
    per_hour: Decimal | None  # None: no price on the rate card
    charged: Decimal
    billed_until: datetime | None
    settled: bool
    seconds: int | None  # billed seconds (every kind of time on the bill), once settled
    live: bool  # may still change: worth polling
    minimum: bool = False  # the final cost includes the rate card's minimum charge
    # "gpu" (its GPUs or CPU-only instances), "no-gpu" (started without GPUs: per node) or
    # "stopped" (its kept workspaces: per node, often free): what `per_hour` is the price of.
    mode: str = GPU
    no_gpu_per_node: Decimal | None = None  # per node-hour at the card in force
    stopped_per_node: Decimal | None = None

    @property
    def started(self) -> bool:
        return self.billed_until is not None


def cluster_cost(cluster: Cluster) -> ClusterCost:
    book = RateBook.load()
    meter = Meter.objects.filter(cluster=cluster).first()
    card = book.at(meter.billed_until if meter and meter.settled else timezone.now())
    nodes = max(cluster.nodes, 1)
    mode = GPU
    if cluster.state == Cluster.State.STOPPED:
        mode = STOPPED
    elif cluster.no_gpu:
        mode = NO_GPU
    per_hour = None
    if card is not None:
        rate = card.rate_of(
            mode,
            gpu_model_id=cluster.gpu_model_id,
            instance_type_id=cluster.instance_type_id,
            spot=cluster.spot,
        )
        if rate is not None:
            units = nodes if mode != GPU else nodes * (cluster.gpus_per_node or 1)
            per_hour = per_hour_of(rate, units)
    seconds = None
    if meter is not None and meter.settled:
        seconds = (
            BillLine.objects.filter(cluster=cluster, kind=LedgerEntry.Kind.USAGE)
            .order_by()
            .aggregate(held=Sum("seconds"))["held"]
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
        mode=mode,
        no_gpu_per_node=per_hour_of(card.no_gpu, 1) if card else None,
        stopped_per_node=per_hour_of(card.stopped, 1) if card else None,
    )


# -- the operator's view -----------------------------------------------------------------


def revenue(*, days: int = 30, today: date | None = None) -> dict:
    """Usage revenue per UTC day and per GPU model (CPU-only types under their own name),
    from the daily rollup."""
    today = today or timezone.now().astimezone(UTC).date()
    rows = (
        UsageDay.objects.filter(day__gte=today - timedelta(days=days - 1))
        .values("day", "resource")
        .annotate(amount=Sum("amount"))
        .order_by()
    )
    per_model: dict[str, dict[date, Decimal]] = {}
    other = pgettext("revenue of no named resource", "other")
    for row in rows:
        by_day = per_model.setdefault(row["resource"] or other, {})
        by_day[row["day"]] = formatting.amount(row["amount"])
    axis = _days(days, today)
    series = {
        name: [by_day.get(d, ZERO.quantize(UNIT)) for d in axis]
        for name, by_day in sorted(per_model.items())
    }
    totals = [sum((s[i] for s in series.values()), ZERO.quantize(UNIT)) for i in range(len(axis))]
    return {"days": axis, "series": series, "totals": totals}


def accounts_overview(*, days: int = 30, today: date | None = None) -> QuerySet[Account]:
    """Accounts, lowest balance first, with what each spent in the last `days` (from the
    daily rollup: bounded in time whatever the ledger's length)."""
    today = today or timezone.now().astimezone(UTC).date()
    spent = (
        UsageDay.objects.filter(account=OuterRef("pk"), day__gte=today - timedelta(days=days - 1))
        .order_by()
        .values("account")
        .annotate(total=Sum("amount"))
        .values("total")
    )
    return (
        Account.objects.select_related("user")
        .annotate(spent=Subquery(spent, output_field=DecimalField(**MONEY)))
        .order_by("balance", "pk")
    )


# -- pools (jobs/pools/autoscaler.py) --------------------------------------------------------------------


def charged_for_pool(pool_id: int) -> Decimal:
    """What the pool's clusters have been charged so far (their meters, exactly)."""
    return charged_for_pools([pool_id])[pool_id]


def charged_for_pools(pool_ids) -> dict[int, Decimal]:
    """`charged_for_pool` of many pools in one query (a cron round's): pool id -> charged."""
    ids = list(pool_ids)
    found = dict(
        Meter.objects.filter(cluster__pool_id__in=ids)
        .order_by()
        .values("cluster__pool_id")
        .annotate(s=Sum("charged"))
        .values_list("cluster__pool_id", "s")
    )
    return {pk: found.get(pk) or ZERO for pk in ids}


def balances_of(user_ids) -> dict[int, Decimal]:
    """`balance_of` of many people in one query: user id -> balance."""
    ids = list(user_ids)
    found = dict(Account.objects.filter(user_id__in=ids).values_list("user_id", "balance"))
    return {pk: found.get(pk) or _NO_BALANCE for pk in ids}


def pool_rate(pool, *, book: RateBook | None = None) -> Decimal | None:
    """One of the pool's clusters, per hour now (spot or on demand); None: no price.
    `book`: the rate cards, loaded once for a round over many pools."""
    units = pool.nodes if pool.is_cpu_only else pool.nodes * max(pool.gpus_per_node, 1)
    q = quote(
        book or RateBook.load(),
        gpu_model_id=pool.gpu_model_id,
        instance_type_id=pool.instance_type_id,
        units=units,
        now=timezone.now(),
    )
    return q.spot if pool.spot else q.on_demand


def rate_book() -> RateBook:
    """The rate cards, for a round over many pools (`pool_rate(book=...)`)."""
    return RateBook.load()

"""Random timelines (hypothesis) and concurrent accrual workers, on real PostgreSQL: no
second is billed twice or missed, charges are exact, every account's entries add up to
its balance, and the bill's rollups (hour lines, usage days) equal the pieces under them
to the last digit, as written and as rebuilt from the ledger."""

import itertools
import threading
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

import pytest
import time_machine
from django.db import connection, transaction
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from node_start import ran

from billing import accrual, rollups
from billing.models import Account, BillLine, LedgerEntry, RateCard, UsageDay
from jobs.clusters import services as cluster_services
from jobs.models import Host
from jobs.placement import scheduler
from jobs.runs import exits

pytestmark = pytest.mark.django_db

BASE = datetime(2026, 6, 1, tzinfo=UTC)
_examples = itertools.count()


class Crash(Exception):
    pass


def _place(make_cluster, owner, name, gpus, when):
    with time_machine.travel(when, tick=False):
        Host.objects.update(state=Host.State.ACTIVE)
        cluster = make_cluster(owner, name, gpus=gpus)
        scheduler.place_pending()
        ran(cluster)  # its workspace started as it was placed (billing starts there)
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    return cluster


def _expected(cluster) -> Decimal:
    """Second by second, from the nodes' own timestamps and the cards' prices."""
    cards = list(RateCard.objects.prefetch_related("prices").order_by("effective_from"))
    total = Decimal("0")
    for node in cluster.node_set.all():
        start = int(node.placed_at.replace(microsecond=0).timestamp())
        end = int(node.released_at.replace(microsecond=0).timestamp())
        for second in range(start, end):
            when = datetime.fromtimestamp(second, tz=UTC)
            card = [c for c in cards if c.effective_from.replace(microsecond=0) <= when][-1]
            price = card.prices.get(gpu_model=cluster.gpu_model).per_hour
            total += price * cluster.gpus_per_node
    return (total / 3600).quantize(Decimal("0.0001"), rounding=ROUND_HALF_UP)


def _check_periods(cluster, *, complete: bool):
    usage = list(
        LedgerEntry.objects.filter(cluster=cluster, kind="usage", period_from__isnull=False)
        .order_by("period_from")
        .values_list("period_from", "period_to")
    )
    for (_, a_end), (b_start, _) in itertools.pairwise(usage):
        assert a_end <= b_start, "a second billed twice"
    if complete:
        first = min(n.placed_at for n in cluster.node_set.all()).replace(microsecond=0)
        last = max(n.released_at for n in cluster.node_set.all()).replace(microsecond=0)
        assert usage[0][0] == first and usage[-1][1] == last
        for (_, a_end), (b_start, _) in itertools.pairwise(usage):
            assert a_end == b_start, "a second left unbilled"


def _check_accounts():
    for account in Account.objects.all():
        running = Decimal("0")
        for entry in account.entries.order_by("id"):
            running += entry.amount
            assert entry.balance_after == running
        assert running == account.balance
    _check_rollups()


def _pieces_by_hour() -> dict:
    """The usage pieces summed per (cluster, UTC hour of their start, units, rate), by
    PostgreSQL from the ledger itself: the oracle for the hour lines."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT cluster_id, date_trunc('hour', period_from AT TIME ZONE 'UTC'), units, rate,"
            " sum(amount), sum(extract(epoch FROM period_to - period_from))::bigint, count(*)"
            " FROM billing_ledgerentry WHERE kind = 'usage' AND period_from IS NOT NULL"
            " GROUP BY 1, 2, 3, 4"
        )
        return {(c, h.replace(tzinfo=UTC), u, r): (a, s, n) for c, h, u, r, a, s, n in cursor}


def _check_rollups():
    lines = {
        (line.cluster_id, line.hour, line.units, line.rate): (
            line.amount,
            line.seconds,
            line.pieces,
        )
        for line in BillLine.objects.filter(hour__isnull=False)
    }
    assert lines == _pieces_by_hour()
    # Every entry is under exactly one line: per account the lines add up to the balance.
    for account in Account.objects.all():
        assert sum(line.amount for line in account.bill_lines.all()) == account.balance
    # Days: what each UTC day's usage charged, per account.
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT account_id, (created_at AT TIME ZONE 'UTC')::date, -sum(amount)"
            " FROM billing_ledgerentry WHERE kind = 'usage' GROUP BY 1, 2"
        )
        charged = {(a, d): amount for a, d, amount in cursor}
    days: dict = {}
    for day in UsageDay.objects.all():
        days[day.account_id, day.day] = days.get((day.account_id, day.day), 0) + day.amount
    assert days == charged

    # Written as they went, they are what a fold of the whole ledger makes of it.
    def snapshot():
        return (
            sorted(BillLine.objects.values_list(
                "account_id", "kind", "at", "amount", "cluster_id", "hour", "units", "rate",
                "seconds", "pieces", "period_from", "period_to", "entry_id", "memo")),
            sorted(UsageDay.objects.values_list("account_id", "day", "resource", "amount", "seconds")),
        )  # fmt: skip

    written = snapshot()
    rollups.rebuild()
    assert snapshot() == written


timeline = st.fixed_dictionaries(
    {
        "gpus": st.integers(1, 4),
        "life": st.integers(1, 900),
        "price": st.decimals("0.01", "20", places=2),
        "change": st.one_of(
            st.none(), st.tuples(st.integers(1, 900), st.decimals("0", "20", places=2))
        ),
        "resize": st.one_of(st.none(), st.integers(1, 900)),
        "ticks": st.lists(st.integers(0, 1000), max_size=8),
        "crashes": st.lists(st.integers(0, 1000), max_size=3),
    }
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(t=timeline)
def test_random_timelines_bill_every_second_once_and_exactly(
    t, alice, make_host, make_cluster, rate_card, fund
):
    if not Host.objects.exists():
        make_host("gpu-a-01", engine=0, gpus=8, check=False)
        fund(alice, "1000000")
    # 23:55 UTC: a timeline of more than 300 s crosses an hour and a day.
    base = BASE + timedelta(days=next(_examples), hours=23, minutes=55)
    RateCard.objects.all().delete()
    rate_card({"a100-80gb": t["price"]}, effective_from=base - timedelta(seconds=60))
    if t["change"]:
        rate_card(
            {"a100-80gb": t["change"][1]}, effective_from=base + timedelta(seconds=t["change"][0])
        )
    cluster = _place(make_cluster, alice, f"t{base:%m%d}", t["gpus"], base)
    events = [(s, "tick") for s in t["ticks"]] + [(s, "crash") for s in t["crashes"]]
    if t["resize"] is not None and t["resize"] < t["life"]:
        events.append((t["resize"], "resize"))
    events.append((t["life"], "release"))
    for second, what in sorted(events, key=lambda e: (e[0], e[1] != "release")):
        now = base + timedelta(seconds=second)
        with time_machine.travel(now, tick=False):
            if what == "tick":
                accrual.accrue(now=now)
            elif what == "crash":
                try:
                    with transaction.atomic():
                        accrual.accrue(now=now)
                        raise Crash  # the worker dies before its commit
                except Crash:
                    pass
                accrual.accrue(now=now)  # the retry
            elif what == "resize":
                cluster.refresh_from_db()
                if cluster.state == "running":
                    cluster_services.cluster_resize(cluster=cluster, nodes=2)
                    ran(cluster)  # the new node's workspace started as it was placed
            elif what == "release":
                cluster_services.cluster_release(cluster=cluster)
                # Its GPUs back for the next example once the engine confirms (none made).
                exits.free_gpus(cluster_id=cluster.pk)
        _check_periods(cluster, complete=False)
    for late in (t["life"] + 1, t["life"] + 1, t["life"] + 5):  # settle, replayed
        accrual.accrue(now=base + timedelta(seconds=late))
    cluster.refresh_from_db()
    assert cluster.meter.settled
    _check_periods(cluster, complete=True)
    charged = -sum(e.amount for e in LedgerEntry.objects.filter(cluster=cluster))
    assert charged == _expected(cluster)
    _check_accounts()


@pytest.mark.django_db(transaction=True)  # threads, their own connections
def test_concurrent_accrual_workers_lose_no_update(alice, make_host, make_cluster, rate_card, fund):
    make_host("gpu-a-01", engine=0, gpus=8, check=False)
    rate_card({"a100-80gb": "3.33"}, effective_from=BASE - timedelta(seconds=60))
    fund(alice, "1000")
    clusters = [_place(make_cluster, alice, f"c{i}", i + 1, BASE) for i in range(3)]
    errors = []

    def worker(offset: int):
        try:
            for k in range(12):
                accrual.accrue(now=BASE + timedelta(seconds=10 * k + offset))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=worker, args=(offset,)) for offset in (0, 0, 3, 7)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    with time_machine.travel(BASE + timedelta(seconds=200), tick=False):
        for cluster in clusters:
            cluster_services.cluster_release(cluster=cluster)
    accrual.accrue(now=BASE + timedelta(seconds=300))
    keys = list(LedgerEntry.objects.values_list("key", flat=True))
    assert len(keys) == len(set(keys))
    for cluster in clusters:
        cluster.refresh_from_db()
        _check_periods(cluster, complete=True)
        charged = -sum(e.amount for e in LedgerEntry.objects.filter(cluster=cluster))
        assert charged == _expected(cluster)
    _check_accounts()
    account = Account.objects.get(user=alice)
    # 200 s x (1 + 2 + 3) GPUs x 3.33 / 3600, each cluster rounded once
    assert account.balance == Decimal("1000") - sum(
        (Decimal(200 * g) * Decimal("3.33") / 3600).quantize(Decimal("0.0001"), ROUND_HALF_UP)
        for g in (1, 2, 3)
    )

"""The storage bill on real PostgreSQL: what a researcher bought above the free part,
charged per GB-hour for every second it was held, one ledger line per hour (split only at
the second the size or the price changed), exact to the smallest unit, once.

Sizes are changed through the real service (`billing.storage.quota_set`, which also
writes the MooseFS quota of the tenant's root on the test fleet) at known seconds; the
hourly bill is the real `billing.storage.accrue`, as the cron runs it.
"""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.db.models import Sum
from django.urls import reverse

from billing import accrual, rollups
from billing import storage as bought
from billing.models import Account, BillLine, LedgerEntry, StorageMeter, UsageDay
from jobs.files import storage

pytestmark = pytest.mark.django_db

RATE = "0.000713"  # per GB-hour: 10 GB-hours are 0.00713, which the ledger rounds
H0 = datetime(2026, 12, 1, 8, 0, 0, tzinfo=UTC)  # a whole hour


def at(minutes: float) -> datetime:
    return H0 + timedelta(minutes=minutes)


def set_size(user, gb, minutes):
    with time_machine.travel(at(minutes), tick=False):
        return bought.quota_set(owner=user, extra_gb=gb)


def storage_entries(user):
    return LedgerEntry.objects.filter(account__user=user, key__startswith="storage:").order_by(
        "period_from"
    )


@pytest.fixture
def priced_storage(rate_card, fund, alice, storage_root):
    rate_card({}, effective_from=H0 - timedelta(days=1), storage_per_gb_hour=Decimal(RATE))
    fund(alice, "100")


def test_bought_storage_is_billed_per_hour_and_the_bill_is_the_sum_of_its_pieces(
    client, alice, priced_storage
):
    # 30 GB from 08:40, 10 GB from 09:30; billed up to 11:00 at 11:45.
    set_size(alice, 30, 40)
    set_size(alice, 10, 90)
    report = bought.accrue(now=at(225))
    assert report.until == at(180)
    account = Account.objects.get(user=alice)
    rows = [
        (e.period_from, e.period_to, e.units, str(e.rate.normalize()), e.amount)
        for e in storage_entries(alice)
    ]
    # The exact cost is 0.000713 x (30x1200 + 30x1800 + 10x1800 + 10x3600) / 3600 = 0.02852;
    # each line is the rounded running total minus what was charged before.
    assert rows == [
        (at(40), at(60), 30, RATE, Decimal("-0.0071")),
        (at(60), at(90), 30, RATE, Decimal("-0.0107")),
        (at(90), at(120), 10, RATE, Decimal("-0.0036")),
        (at(120), at(180), 10, RATE, Decimal("-0.0071")),
    ]
    total = storage_entries(alice).aggregate(s=Sum("amount"))["s"]
    assert total == Decimal("-0.0285")  # 0.02852 rounded once
    meter = StorageMeter.objects.get(account=account)
    assert (meter.charged, meter.billed_until) == (Decimal("0.0285"), at(180))
    assert account.balance == Decimal("100") + total
    assert {e.key for e in storage_entries(alice)} == {
        f"storage:{account.pk}:{int(a.timestamp())}:{int(b.timestamp())}" for a, b, *_rest in rows
    }
    # The bill: one line per hour, two in the hour the size changed; lines, days and the
    # ledger add up to the same, and folding the ledger again gives the same lines.
    lines = BillLine.objects.filter(account=account, cluster__isnull=True, kind="usage")
    got = sorted((line.hour, line.units, line.seconds, line.amount) for line in lines)
    assert got == [
        (at(0), 30, 1200, Decimal("-0.0071")),
        (at(60), 10, 1800, Decimal("-0.0036")),
        (at(60), 30, 1800, Decimal("-0.0107")),
        (at(120), 10, 3600, Decimal("-0.0071")),
    ]
    assert lines.aggregate(s=Sum("amount"))["s"] == total
    days = UsageDay.objects.filter(account=account, resource="storage (GB)")
    assert days.aggregate(s=Sum("amount"))["s"] == -total
    assert days.aggregate(s=Sum("seconds"))["s"] == 30 * 3000 + 10 * 5400  # GB-seconds
    rollups.rebuild(account_ids=[account.pk])
    rebuilt = BillLine.objects.filter(account=account, cluster__isnull=True, kind="usage")
    assert sorted((x.hour, x.units, x.seconds, x.amount) for x in rebuilt) == got
    # What she reads: the storage lines on her bill, in GB, with their rate.
    client.force_login(alice)
    with time_machine.travel(at(226), tick=False):
        page = client.get(reverse("billing"), {"month": "2026-12"})
    body = page.content.decode()
    assert body.count('data-testid="bill-line-storage"') == 4
    assert "storage (GB)" in body and ">30 GB<" in body and ">-0.0107<" in body


def test_running_the_hour_again_charges_nothing_and_the_next_hour_once(alice, priced_storage):
    set_size(alice, 50, 10)
    first = bought.accrue(now=at(61))
    assert first.entries == 1
    for minutes in (61, 62, 119.99):
        assert bought.accrue(now=at(minutes)).entries == 0
    assert storage_entries(alice).count() == 1
    assert bought.accrue(now=at(120)).entries == 1
    assert bought.accrue(now=at(120)).entries == 0
    amounts = [e.amount for e in storage_entries(alice)]
    # 50 GB for 50 minutes, then 50 GB for an hour: 0.0297083... and 0.03565, rounded once
    # in all: 0.06535833 -> 0.0654.
    assert sum(amounts) == Decimal("-0.0654")
    assert amounts == [Decimal("-0.0297"), Decimal("-0.0357")]
    assert StorageMeter.objects.get(account__user=alice).charged == Decimal("0.0654")


def test_a_new_price_in_the_hour_splits_it_at_its_second(alice, rate_card, priced_storage):
    set_size(alice, 100, 0)
    rate_card({}, effective_from=at(15), storage_per_gb_hour=Decimal("0.0012"))
    bought.accrue(now=at(60))
    rows = [(e.period_from, e.period_to, e.rate, e.amount) for e in storage_entries(alice)]
    # 100 GB x 15 min x 0.000713 = 0.017825 -> 0.0178; + 100 x 45 min x 0.0012 = 0.09 ->
    # 0.107825 -> 0.1078.
    assert rows == [
        (at(0), at(15), Decimal(RATE), Decimal("-0.0178")),
        (at(15), at(60), Decimal("0.0012"), Decimal("-0.0900")),
    ]


def test_the_free_part_and_a_free_price_cost_nothing(alice, bob, rate_card, fund, storage_root):
    rate_card({}, effective_from=H0 - timedelta(days=1), storage_per_gb_hour=Decimal("0"))
    fund(bob, "10")
    set_size(bob, 5, 0)  # bought, but storage is free on this card
    bought.accrue(now=at(290))
    assert not LedgerEntry.objects.filter(key__startswith="storage:").exists()
    assert not StorageMeter.objects.filter(account__user=alice).exists(), "she bought nothing"
    assert StorageMeter.objects.get(account__user=bob).billed_until == at(240)


def test_a_size_bought_in_an_hour_already_billed_starts_after_it(alice, priced_storage):
    """A change is never dated inside an hour the bill has written (a worker's clock ahead
    of the web's): it takes effect where the bill stands."""
    set_size(alice, 10, 0)
    bought.accrue(now=at(125))  # billed to 10:00
    grant = set_size(alice, 20, 110)  # a web server whose clock says 09:50
    assert grant.since == at(120)
    bought.accrue(now=at(185))
    assert [(e.units, e.period_from) for e in storage_entries(alice)] == [
        (10, at(0)),
        (10, at(60)),
        (20, at(120)),
    ]


def test_the_burn_rate_counts_the_storage_bought(alice, priced_storage):
    from billing import selectors

    set_size(alice, 40, 0)
    with time_machine.travel(at(1), tick=False):
        # 40 x 0.000713 = 0.02852 per hour
        assert selectors.burn_per_hour(alice) == Decimal("0.0285")
    assert storage.extra_gb(alice.pk, at=at(1)) == 40


@pytest.mark.django_db(transaction=True)  # two threads, two connections
def test_two_bills_run_at_once_charge_each_hour_once(alice, bob, fund, priced_storage):
    """Two cron runs that overlap (two workers): the meters' row locks let one bill each
    hour and the other find nothing left to do."""
    import threading

    from django.db import connection

    fund(bob, "100")
    set_size(alice, 10, 0)
    set_size(bob, 20, 30)
    reports, errors = [], []
    start = threading.Barrier(2)

    def run():
        try:
            start.wait()
            reports.append(bought.accrue(now=at(600)))
        except Exception as exc:  # shown below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sum(r.entries for r in reports) == 10 + 10  # alice 10 hours, bob 9.5 in 10 lines
    for user, gb, hours in ((alice, 10, 10), (bob, 20, Decimal("9.5"))):
        entries = storage_entries(user)
        assert entries.count() == 10
        exact = gb * hours * Decimal(RATE)
        assert -entries.aggregate(s=Sum("amount"))["s"] == exact.quantize(Decimal("0.0001"))
        assert Account.objects.get(user=user).balance == Decimal("100") - exact.quantize(
            Decimal("0.0001")
        )


def test_storage_that_empties_the_balance_stops_her_clusters(
    alice, rate_card, fund, storage_root, paper_host, make_cluster
):
    from jobs.placement import scheduler

    rate_card({}, effective_from=H0 - timedelta(days=1), storage_per_gb_hour=Decimal(RATE))
    fund(alice, "0.05")
    set_size(alice, 100, 0)  # 0.0713 an hour
    cluster = make_cluster(alice, "c1")
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running"
    report = bought.accrue(now=at(60))
    account = Account.objects.get(user=alice)
    assert report.exhausted == [account.pk]
    assert account.balance == Decimal("0.05") - Decimal("0.0713")
    assert account.exhausted_at is not None
    cluster.refresh_from_db()
    assert cluster.state == "stopped", cluster.state  # its files kept (issue 41)
    assert cluster.state_reason == accrual.EXHAUSTED
    assert storage.extra_gb(alice.pk) == 100, "her files keep their room"

"""Money on real PostgreSQL: per-second charges, exact to the smallest unit, once."""

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.db.models import Sum
from node_start import ran

from billing import accrual
from billing import services as billing
from billing.models import Account, LedgerEntry, Meter
from jobs.clusters import services as cluster_services
from jobs.placement import scheduler

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 12, 1, 8, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.fixture
def placed(make_host, make_cluster):
    """A cluster placed at a known second on the real scheduler."""

    def make(owner, name="c1", *, when=0, nodes=1, gpus=2, **extra):
        with time_machine.travel(at(when), tick=False):
            if not make_host.__dict__.get("made"):
                make_host("gpu-a-01", engine=0, gpus=8, check=False)
                make_host.__dict__["made"] = True
            from jobs.models import Host

            Host.objects.update(state=Host.State.ACTIVE)
            cluster = make_cluster(owner, name, nodes=nodes, gpus=gpus, **extra)
            scheduler.place_pending()
        ran(cluster)  # its workspace started as it was placed (billing starts there)
        cluster.refresh_from_db()
        assert cluster.state == "running", cluster.state_reason
        return cluster

    return make


def release(cluster, when):
    with time_machine.travel(at(when), tick=False):
        cluster_services.cluster_release(cluster=cluster)


def usage_of(cluster) -> Decimal:
    total = LedgerEntry.objects.filter(cluster=cluster).aggregate(s=Sum("amount"))["s"]
    return -(total or Decimal("0"))


@pytest.mark.parametrize(
    "ticks", [[], [1], [10, 20, 30], [7, 1800, 3599, 3600], list(range(13, 3601, 97))]
)
def test_two_gpus_for_3601_seconds_at_3_60_cost_exactly_7_2020(
    alice, rate_card, fund, placed, ticks
):
    rate_card({"a100-80gb": "3.60"}, effective_from=at(-60))
    fund(alice, "100")
    cluster = placed(alice, gpus=2)
    for t in ticks:
        accrual.accrue(now=at(t))
    release(cluster, 3601)
    accrual.accrue(now=at(3700))
    assert usage_of(cluster) == Decimal("7.2020")
    assert Meter.objects.get(cluster=cluster).settled
    account = Account.objects.get(user=alice)
    assert account.balance == Decimal("92.7980")
    assert sum(e.amount for e in account.entries.all()) == account.balance


def test_replaying_an_accrual_changes_nothing(alice, rate_card, fund, placed):
    rate_card({"a100-80gb": "2.50"}, effective_from=at(-60))
    fund(alice, "50")
    cluster = placed(alice, gpus=1)
    accrual.accrue(now=at(100))
    before = list(LedgerEntry.objects.values_list("key", "amount", "balance_after"))
    for _ in range(3):
        accrual.accrue(now=at(100))
        accrual.accrue(now=at(50))  # a late, older tick moves nothing back
    assert list(LedgerEntry.objects.values_list("key", "amount", "balance_after")) == before
    entry = LedgerEntry.objects.get(cluster=cluster)
    assert entry.key == f"usage:{cluster.pk}:{int(at(0).timestamp())}:{int(at(100).timestamp())}"
    assert entry.units == 1 and entry.seconds == 100 and entry.rate == Decimal("2.50")
    assert entry.amount == Decimal("-0.0694")  # 100 s x 2.50 / 3600 = 0.069444...


def test_a_price_change_mid_run_bills_each_second_at_its_price(alice, rate_card, fund, placed):
    rate_card({"a100-80gb": "3.60"}, effective_from=at(-60))
    rate_card({"a100-80gb": "7.20"}, effective_from=at(1800))
    fund(alice, "100")
    cluster = placed(alice, gpus=1)
    accrual.accrue(now=at(1000))
    release(cluster, 3600)
    accrual.accrue(now=at(3601))
    lines = list(
        LedgerEntry.objects.filter(cluster=cluster)
        .order_by("period_from")
        .values_list("period_from", "period_to", "rate")
    )
    assert lines == [
        (at(0), at(1000), Decimal("3.60")),
        (at(1000), at(1800), Decimal("3.60")),
        (at(1800), at(3600), Decimal("7.20")),
    ]
    assert usage_of(cluster) == Decimal("1.8000") + Decimal("3.6000")


def test_spot_clusters_pay_the_spot_rate(alice, rate_card, fund, placed):
    rate_card({"a100-80gb": "4.00"}, effective_from=at(-60), spot_discount_pct=Decimal("60"))
    fund(alice, "100")
    cluster = placed(alice, gpus=1, spot=True)
    release(cluster, 3600)
    accrual.accrue(now=at(3601))
    assert usage_of(cluster) == Decimal("1.6000")
    assert LedgerEntry.objects.get(cluster=cluster).rate == Decimal("1.6")


def test_running_out_stops_the_clusters_and_bounds_the_overdraft(
    alice, bob, rate_card, fund, placed
):
    rate_card({"a100-80gb": "36.00"}, effective_from=at(-60))  # 0.01 per GPU-second
    fund(alice, "1.05")  # 52.5 s of 2 GPUs
    fund(bob, "100")
    mine = placed(alice, "mine", gpus=2)
    theirs = placed(bob, "theirs", gpus=1)
    period = 10
    t = 0
    while Account.objects.get(user=alice).balance > 0:
        t += period
        with time_machine.travel(at(t), tick=False):
            accrual.accrue(now=at(t))
        assert t < 200
    mine.refresh_from_db()
    theirs.refresh_from_db()
    # Stopped, not released: its workspaces are kept with every file (issue 41).
    assert mine.state == "stopped" and mine.state_reason == accrual.EXHAUSTED
    assert theirs.state == "running", "another account is not touched"
    account = Account.objects.get(user=alice)
    one_period = Decimal("0.01") * 2 * period
    assert Decimal("0") > account.balance >= -one_period
    assert account.balance == Decimal("1.05") - usage_of(mine) == Decimal("-0.15")
    # charged up to the second it stopped, and no second after
    assert LedgerEntry.objects.filter(cluster=mine).latest("period_to").period_to == at(t)
    # A later tick charges nothing more: no second twice, its kept time not past 0.
    with time_machine.travel(at(t + 3600), tick=False):
        accrual.accrue(now=at(t + 3600))
    assert Account.objects.get(user=alice).balance == Decimal("-0.15")


def test_operator_entries_are_idempotent_and_need_a_reason(alice, operator):
    account = billing.account_for(alice)
    first = billing.post_entry(
        account=account,
        kind="topup",
        amount=Decimal("20"),
        key="op:1",
        by=operator,
        memo="invoice 7",
    )
    again = billing.post_entry(
        account=account,
        kind="topup",
        amount=Decimal("20"),
        key="op:1",
        by=operator,
        memo="invoice 7",
    )
    assert again.pk == first.pk
    account.refresh_from_db()
    assert account.balance == Decimal("20") and first.created_by == operator
    with pytest.raises(Exception, match="Say why"):
        billing.post_entry(account=account, kind="refund", amount=Decimal("1"), key="op:2")
    with pytest.raises(Exception, match="positive"):
        billing.post_entry(
            account=account, kind="topup", amount=Decimal("-5"), key="op:3", memo="x"
        )
    billing.post_entry(
        account=account,
        kind="adjustment",
        amount=Decimal("-2.5"),
        key="op:4",
        memo="goodwill reversed",
    )
    account.refresh_from_db()
    assert account.balance == Decimal("17.5")
    with pytest.raises(Exception, match="immutable"):
        first.amount = Decimal("1000")
        first.save()

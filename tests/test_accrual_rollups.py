"""The bill's hour lines and daily usage as the accrual tick writes them (on PostgreSQL one
statement folds each batch's entries where they lie, `billing.rollups.fold_entries`): a
tick across midnight, every tick run twice, a short rental's minimum charge; each time
what a fold of the whole ledger again makes of it (`rollups.rebuild`), and the bill adds
up to the balance.

On a host registered without an engine (`paper_host`): no container runs.
"""

from datetime import UTC, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.utils import timezone
from node_start import ran

from billing import accrual, rollups
from billing.models import Account, BillLine, LedgerEntry, UsageDay
from jobs.clusters import services as cluster_services
from jobs.placement import scheduler

pytestmark = pytest.mark.django_db


def _snapshot():
    lines = BillLine.objects.values_list(
        "account_id", "kind", "at", "amount", "cluster_id", "hour", "units", "rate",
        "gpu_model_id", "seconds", "pieces", "period_from", "period_to", "charged_at",
        "entry_id", "memo", "member_id",
    )  # fmt: skip
    days = UsageDay.objects.values_list("account_id", "day", "resource", "amount", "seconds")
    return sorted(lines, key=str), sorted(days, key=str)


def test_a_tick_across_midnight_run_twice_and_a_minimum(
    alice, rate_card, fund, paper_host, make_cluster
):
    midnight = timezone.now().astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    start = midnight - timedelta(minutes=1)  # 23:59:00 yesterday (UTC)
    rate_card({"a100-80gb": "3.6000"}, effective_from=start - timedelta(hours=1), min_charge_s=300)
    fund(alice, "100")
    with time_machine.travel(start, tick=False):
        cluster = make_cluster(alice, "late", gpus=2)
        scheduler.place_pending()
        ran(cluster)
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason

    def tick(at):
        with time_machine.travel(at, tick=False):
            accrual.accrue(now=at)
            written = _snapshot(), LedgerEntry.objects.count()
            again = accrual.accrue(now=at)  # the same tick again: nothing more
            assert again.entries == 0
            assert (_snapshot(), LedgerEntry.objects.count()) == written

    # 23:59:10, 23:59:50, then one tick of 40 s across midnight (charged today), 00:00:40.
    for at in (10, 50, 90, 100):
        tick(start + timedelta(seconds=at))
    with time_machine.travel(start + timedelta(seconds=130), tick=False):
        cluster_services.cluster_release(cluster=cluster)
    tick(start + timedelta(seconds=140))  # settled: 130 s used of the 300 s minimum

    # A piece is its period's start hour's: the tick across midnight is yesterday's 23:00.
    lines = {
        (line.hour, line.entry_id is not None): line
        for line in BillLine.objects.filter(cluster=cluster)
    }
    late, early = midnight - timedelta(hours=1), midnight
    assert set(lines) == {(late, False), (early, False), (None, True)}
    assert (lines[late, False].pieces, lines[late, False].seconds) == (3, 90)
    assert lines[late, False].amount == Decimal("-0.1800")  # 2 GPUs x 90 s at 3.60 an hour
    assert lines[late, False].period_to == midnight + timedelta(seconds=30)
    assert (lines[early, False].pieces, lines[early, False].seconds) == (2, 40)
    assert lines[early, False].amount == Decimal("-0.0800")
    minimum = lines[None, True]
    assert minimum.amount == Decimal("-0.3400")  # the 170 s short of 300, at 2 GPUs
    assert minimum.entry.key == f"minimum:{cluster.pk}"

    # Days are the UTC day each piece was charged: yesterday 50 s, today 40 s + 40 s + minimum.
    days = {d.day: d for d in UsageDay.objects.all()}
    assert set(days) == {late.date(), early.date()}
    assert (days[late.date()].amount, days[late.date()].seconds) == (Decimal("0.1000"), 100)
    assert (days[early.date()].amount, days[early.date()].seconds) == (Decimal("0.5000"), 160)
    assert days[early.date()].resource == cluster.gpu_model.name

    account = Account.objects.get(user=alice)
    assert sum(line.amount for line in account.bill_lines.all()) == account.balance
    written = _snapshot()
    rollups.rebuild()
    assert _snapshot() == written

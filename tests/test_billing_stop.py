"""A stopped cluster's money (issue 21), on real PostgreSQL: GPU time until the stop, its
kept workspaces at the rate card's stopped price (free by default: then not a line), its
no-GPU mode at the no-GPU price per node, a start with GPUs again, and the meter settled
only once the kept time is closed too.

The nodes are rows written here with fixed seconds, as the jobs app leaves them: a stop
ends the live nodes (released_at = stopped_at) and keeps their workspaces (kept_until
empty); a start closes the kept time at the second the new nodes are placed; a release
closes both. Accrual runs several times across each interval, as cron does.
"""

from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

import pytest
import time_machine
from django.db.models import Sum
from django.urls import reverse
from django.utils import timezone

from billing import accrual, rollups, selectors
from billing.models import Account, BillLine, LedgerEntry, Meter, RateCard, UsageDay
from billing.pricing import RateBook, quote
from jobs.models import Cluster, Node

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 12, 1, 8, 0, 0, tzinfo=UTC)
RATE = "3.60"  # per GPU-hour: 0.001 per GPU-second


def at(seconds: int) -> datetime:
    return T0 + timedelta(seconds=seconds)


def ts(seconds: int) -> int:
    return int(at(seconds).timestamp())


@pytest.fixture
def gpu_cluster(alice, catalog, paper_host):
    """A running cluster of `nodes` x `gpus` A100s, its nodes placed at second 0."""

    def make(name="c1", *, nodes=2, gpus=2, spot=False, owner=None):
        cluster = Cluster.objects.create(
            owner=owner or alice, name=name, gpu_model=catalog["a100-80gb"], nodes=nodes,
            gpus_per_node=gpus, spot=spot, image_reference="suanli-test:busybox",
            state=Cluster.State.RUNNING, running_since=at(0),
        )  # fmt: skip
        _place(cluster, 0, host=paper_host)
        return cluster

    return make


def _place(cluster, t, *, host=None, no_gpu=False):
    host = host or Node.objects.filter(cluster=cluster).first().host
    per_node = 0 if no_gpu else cluster.gpus_per_node
    for i in range(cluster.nodes):
        Node.objects.create(
            cluster=cluster, index=i, host=host, placed_at=at(t), started_at=at(t), no_gpu=no_gpu,
            gpu_indices=list(range(i * per_node, (i + 1) * per_node)),
        )  # fmt: skip


def stop(cluster, t):
    """As jobs' cluster_stop leaves the rows: the live nodes end, their workspaces kept."""
    Node.objects.filter(cluster=cluster, released_at__isnull=True).update(
        released_at=at(t), stopped_at=at(t)
    )
    Cluster.objects.filter(pk=cluster.pk).update(
        state=Cluster.State.STOPPED, stopped_at=at(t), no_gpu=False
    )


def start(cluster, t, *, no_gpu=False):
    """Started again on the hosts that keep its workspaces: kept time ends as nodes begin."""
    Node.objects.filter(cluster=cluster, stopped_at__isnull=False, kept_until__isnull=True).update(
        kept_until=at(t)
    )
    _place(cluster, t, no_gpu=no_gpu)
    Cluster.objects.filter(pk=cluster.pk).update(
        state=Cluster.State.RUNNING, stopped_at=None, no_gpu=no_gpu
    )


def release(cluster, t, *, close_kept=True):
    Node.objects.filter(cluster=cluster, released_at__isnull=True).update(released_at=at(t))
    if close_kept:
        Node.objects.filter(
            cluster=cluster, stopped_at__isnull=False, kept_until__isnull=True
        ).update(kept_until=at(t))
    Cluster.objects.filter(pk=cluster.pk).update(state=Cluster.State.RELEASED, released_at=at(t))


def entries(cluster, suffix=None):
    qs = LedgerEntry.objects.filter(cluster=cluster, kind="usage").order_by("period_from", "key")
    if suffix == "gpu":
        return [e for e in qs if e.key[-1].isdigit()]
    if suffix:
        return [e for e in qs if e.key.endswith(f":{suffix}")]
    return list(qs)


def charged(rows) -> Decimal:
    return -sum((e.amount for e in rows), Decimal("0"))


def once(exact: Decimal) -> Decimal:
    """The exact cost (unit-seconds x rate per hour) rounded once, half-up."""
    return (exact / 3600).quantize(Decimal("0.0001"), rounding=ROUND_HALF_UP)


def burn(user, t) -> Decimal:
    return selectors.burn_per_hour(user, now=at(t))


def check_ledger(account: Account):
    """Every entry's balance_after runs from the first; the rollups add up to the balance."""
    running = Decimal("0")
    for entry in account.entries.order_by("id"):
        running += entry.amount
        assert entry.balance_after == running
    assert running == account.balance
    assert sum(line.amount for line in account.bill_lines.all()) == account.balance


def check_rebuild():
    """The bill lines and usage days as written equal those folded again from the ledger
    (the kind of each piece read back from its key)."""

    def snapshot():
        lines = sorted(
            BillLine.objects.values_list(
                "cluster_id", "hour", "units", "rate", "memo", "amount", "seconds", "pieces",
                "gpu_model_id",
            ),
            key=str,
        )  # fmt: skip
        days = sorted(UsageDay.objects.values_list("account_id", "day", "resource", "amount"))
        return lines, days

    before = snapshot()
    rollups.rebuild()
    assert snapshot() == before


def test_gpu_time_until_a_stop_and_nothing_for_free_kept_workspaces(
    alice, rate_card, fund, gpu_cluster
):
    rate_card({"a100-80gb": RATE}, effective_from=at(-60))  # stopped_per_hour: 0 (the default)
    fund(alice, "100")
    cluster = gpu_cluster(nodes=2, gpus=2)
    accrual.accrue(now=at(100))
    accrual.accrue(now=at(1000))
    assert burn(alice, 1000) == Decimal("14.4000")  # 4 GPUs x 3.60
    stop(cluster, 1800)
    for t in (1500, 2000, 2000, 5000, 9000):
        accrual.accrue(now=at(t))
    # GPU time keeps its keys of old: usage:<cluster>:<from>:<to>, nothing after the stop.
    assert [e.key for e in entries(cluster)] == [
        f"usage:{cluster.pk}:{ts(0)}:{ts(100)}",
        f"usage:{cluster.pk}:{ts(100)}:{ts(1000)}",
        f"usage:{cluster.pk}:{ts(1000)}:{ts(1500)}",
        f"usage:{cluster.pk}:{ts(1500)}:{ts(1800)}",
    ]
    assert charged(entries(cluster)) == Decimal("7.2000")  # 4 GPUs x 1,800 s x 0.001
    assert all(e.units == 4 and e.memo == "" and e.gpu_model_id for e in entries(cluster))
    meter = Meter.objects.get(cluster=cluster)
    assert meter.billed_until == at(9000) and not meter.settled, "kept: still metered"
    assert burn(alice, 9000) == Decimal("0")
    cost = selectors.cluster_cost(Cluster.objects.get(pk=cluster.pk))
    assert cost.mode == "stopped" and cost.per_hour == Decimal("0") and cost.live
    # Released from stopped: the kept time closes and the meter settles, still no line.
    release(cluster, 9500)
    accrual.accrue(now=at(9600))
    meter.refresh_from_db()
    assert meter.settled and meter.billed_until == at(9500)
    assert charged(entries(cluster)) == Decimal("7.2000") and not entries(cluster, "stopped")
    check_ledger(Account.objects.get(user=alice))


def test_kept_workspaces_are_charged_when_the_card_prices_them(alice, rate_card, fund, gpu_cluster):
    rate_card({"a100-80gb": RATE}, effective_from=at(-60), stopped_per_hour=Decimal("0.05"))
    fund(alice, "100")
    cluster = gpu_cluster(nodes=2, gpus=2)
    accrual.accrue(now=at(300))
    stop(cluster, 600)
    accrual.accrue(now=at(600))
    assert burn(alice, 600) == Decimal("0.1000")  # 2 nodes x 0.05
    accrual.accrue(now=at(2000))
    before = list(LedgerEntry.objects.order_by("id").values_list("key", "amount"))
    accrual.accrue(now=at(2000))  # the same tick again
    accrual.accrue(now=at(1000))  # a late, older one
    assert list(LedgerEntry.objects.order_by("id").values_list("key", "amount")) == before
    accrual.accrue(now=at(4200))
    kept = entries(cluster, "stopped")
    assert [e.key for e in kept] == [
        f"usage:{cluster.pk}:{ts(600)}:{ts(2000)}:stopped",
        f"usage:{cluster.pk}:{ts(2000)}:{ts(4200)}:stopped",
    ]
    assert all(
        e.units == 2 and e.rate == Decimal("0.05") and e.gpu_model_id is None
        and e.memo == "stopped: workspaces kept"
        for e in kept
    )  # fmt: skip
    assert charged(kept) == Decimal("0.1000")  # 2 nodes x 3,600 s x 0.05 / 3600
    assert charged(entries(cluster, "gpu")) == Decimal("2.4000")  # 4 GPUs x 600 s
    keys = [e.key for e in entries(cluster)]
    assert len(keys) == len(set(keys))
    # The bill: kept time on lines of its own, never merged into the GPU lines.
    lines = BillLine.objects.filter(cluster=cluster, kind="usage")
    assert {(line.memo, line.units) for line in lines} == {
        ("", 4),
        ("stopped: workspaces kept", 2),
    }
    stopped_lines = [line for line in lines if line.memo]
    assert sum(line.seconds for line in stopped_lines) == 3600
    assert all(line.gpu_model_id is None for line in stopped_lines)
    days = dict(UsageDay.objects.values_list("resource", "amount"))
    assert days == {"A100 80 GB": Decimal("2.4000"), "stopped (kept workspaces)": Decimal("0.1")}
    cost = selectors.cluster_cost(Cluster.objects.get(pk=cluster.pk))
    assert cost.mode == "stopped" and cost.per_hour == Decimal("0.1000")
    assert cost.charged == Decimal("2.5000")
    check_ledger(Account.objects.get(user=alice))


def test_no_gpu_mode_is_billed_per_node_at_its_price_without_gpu_lines(
    alice, rate_card, fund, gpu_cluster
):
    # The default no-GPU price, 0.10 per node-hour, and no spot discount on it.
    rate_card({"a100-80gb": RATE}, effective_from=at(-60), spot_discount_pct=Decimal("60"))
    fund(alice, "100")
    cluster = gpu_cluster(nodes=2, gpus=2, spot=True)
    accrual.accrue(now=at(400))
    stop(cluster, 600)
    accrual.accrue(now=at(900))
    start(cluster, 1200, no_gpu=True)
    accrual.accrue(now=at(1200))
    assert burn(alice, 1300) == Decimal("0.2000")  # 2 nodes x 0.10, spot or not
    cost = selectors.cluster_cost(Cluster.objects.get(pk=cluster.pk))
    assert cost.mode == "no-gpu" and cost.per_hour == Decimal("0.2000")
    for t in (2000, 3000, 4800):
        accrual.accrue(now=at(t))
    no_gpu = entries(cluster, "no-gpu")
    assert [(e.period_from, e.period_to) for e in no_gpu] == [
        (at(1200), at(2000)),
        (at(2000), at(3000)),
        (at(3000), at(4800)),
    ]
    assert all(
        e.units == 2 and e.rate == Decimal("0.1") and e.gpu_model_id is None
        and e.memo == "no-GPU mode" and e.key.startswith(f"usage:{cluster.pk}:")
        for e in no_gpu
    )  # fmt: skip
    assert charged(no_gpu) == Decimal("0.2000")  # 2 nodes x 3,600 s x 0.10 / 3600
    gpu = entries(cluster, "gpu")
    assert max(e.period_to for e in gpu) == at(600), "no GPU line after the stop"
    assert charged(gpu) == Decimal("0.9600")  # 4 GPUs x 600 s x 3.60 x 40 %
    assert not entries(cluster, "stopped"), "kept time is free on this card"
    days = dict(UsageDay.objects.values_list("resource", "amount"))
    assert days == {"A100 80 GB": Decimal("0.96"), "no-GPU mode": Decimal("0.2")}
    check_ledger(Account.objects.get(user=alice))
    check_rebuild()


def test_no_gpu_mode_at_a_price_of_zero_still_shows_on_the_bill(
    alice, rate_card, fund, gpu_cluster
):
    rate_card({"a100-80gb": RATE}, effective_from=at(-60), no_gpu_per_hour=Decimal("0"))
    fund(alice, "10")
    cluster = gpu_cluster(nodes=1, gpus=1)
    stop(cluster, 60)
    start(cluster, 120, no_gpu=True)
    accrual.accrue(now=at(720))
    (line,) = entries(cluster, "no-gpu")
    assert line.amount == 0 and line.units == 1 and line.seconds == 600
    assert line.memo == "no-GPU mode"
    assert burn(alice, 720) == Decimal("0")


def test_a_start_with_gpus_again_bills_each_kind_in_turn_and_settles_after_release(
    alice, rate_card, fund, gpu_cluster
):
    rate_card({"a100-80gb": RATE}, effective_from=at(-60), stopped_per_hour=Decimal("0.05"))
    fund(alice, "100")
    cluster = gpu_cluster(nodes=2, gpus=2)
    for t in (250, 600):
        accrual.accrue(now=at(t))
    stop(cluster, 600)
    accrual.accrue(now=at(900))
    start(cluster, 1200)
    assert burn(alice, 1200) == Decimal("14.4000")
    for t in (1210, 1800):
        accrual.accrue(now=at(t))
    release(cluster, 2400)
    for t in (2410, 2420):
        accrual.accrue(now=at(t))
    spans = [(e.period_from, e.period_to, e.key.rsplit(":", 1)[-1]) for e in entries(cluster)]
    gpu = [(a, b) for a, b, k in spans if k.isdigit()]
    assert gpu == [(at(0), at(250)), (at(250), at(600)), (at(1200), at(1210)),
                   (at(1210), at(1800)), (at(1800), at(2400))]  # fmt: skip
    assert [(a, b) for a, b, k in spans if k == "stopped"] == [
        (at(600), at(900)),
        (at(900), at(1200)),
    ]
    meter = Meter.objects.get(cluster=cluster)
    assert meter.settled and meter.billed_until == at(2400)
    # 4 GPUs x 1,800 s x 0.001 + 2 nodes x 600 s x 0.05 / 3600
    assert meter.charged == charged(entries(cluster)) == Decimal("7.2000") + Decimal("0.0167")
    assert burn(alice, 2500) == Decimal("0")
    check_ledger(Account.objects.get(user=alice))


def test_a_released_cluster_settles_only_once_its_kept_time_is_closed(
    alice, rate_card, fund, gpu_cluster
):
    rate_card({"a100-80gb": RATE}, effective_from=at(-60), stopped_per_hour=Decimal("0.36"))
    fund(alice, "100")
    cluster = gpu_cluster(nodes=1, gpus=1)
    stop(cluster, 100)
    # Released, but its workspace is still being removed: kept time goes on.
    release(cluster, 1000, close_kept=False)
    accrual.accrue(now=at(2000))
    meter = Meter.objects.get(cluster=cluster)
    assert not meter.settled and meter.billed_until == at(2000)
    Node.objects.filter(cluster=cluster).update(kept_until=at(2500))
    accrual.accrue(now=at(3000))
    accrual.accrue(now=at(4000))
    meter.refresh_from_db()
    assert meter.settled and meter.billed_until == at(2500)
    assert max(e.period_to for e in entries(cluster)) == at(2500)
    # 100 GPU-seconds x 0.001 + 2,400 node-seconds x 0.0001
    assert charged(entries(cluster)) == Decimal("0.1000") + Decimal("0.2400")


def test_one_rounding_across_every_kind_of_time(alice, rate_card, fund, gpu_cluster):
    """Awkward prices, a tick every 7 s: the pieces are rounded one by one, yet their sum
    is the exact cost of all three kinds together, rounded once."""
    gpu_rate, no_gpu_rate, stopped_rate = Decimal("3.6920"), Decimal("0.1234"), Decimal("0.0777")
    rate_card(
        {"a100-80gb": str(gpu_rate)}, effective_from=at(-60),
        no_gpu_per_hour=no_gpu_rate, stopped_per_hour=stopped_rate,
    )  # fmt: skip
    fund(alice, "100")
    cluster = gpu_cluster(nodes=3, gpus=2)
    plan = {301: lambda: stop(cluster, 301), 650: lambda: start(cluster, 650, no_gpu=True),
            911: lambda: stop(cluster, 911), 1203: lambda: start(cluster, 1203),
            1500: lambda: release(cluster, 1500)}  # fmt: skip
    for t in range(7, 1600, 7):
        for when in [w for w in plan if w <= t]:
            plan.pop(when)()
        accrual.accrue(now=at(t))
    exact = (
        6 * (301 + (1500 - 1203)) * gpu_rate  # 3 nodes x 2 GPUs
        + 3 * (911 - 650) * no_gpu_rate
        + 3 * ((650 - 301) + (1203 - 911)) * stopped_rate
    )
    meter = Meter.objects.get(cluster=cluster)
    assert meter.settled and meter.exact == exact
    assert charged(entries(cluster)) == meter.charged == once(exact)
    pieces = entries(cluster)
    assert len(pieces) > 200 and len({e.key for e in pieces}) == len(pieces)
    by_kind = {k: charged(entries(cluster, k)) for k in ("gpu", "no-gpu", "stopped")}
    assert all(v > 0 for v in by_kind.values())
    check_ledger(Account.objects.get(user=alice))
    check_rebuild()


def test_the_minimum_charge_counts_gpu_time_only(alice, rate_card, fund, gpu_cluster):
    rate_card(
        {"a100-80gb": RATE}, effective_from=at(-60), min_charge_s=600,
        stopped_per_hour=Decimal("0.36"),
    )  # fmt: skip
    fund(alice, "100")
    cluster = gpu_cluster(nodes=1, gpus=2)
    stop(cluster, 60)  # a minute on GPUs, then kept for two hours
    start(cluster, 3660, no_gpu=True)
    release(cluster, 7260)
    accrual.accrue(now=at(8000))
    minimum = LedgerEntry.objects.get(key=f"minimum:{cluster.pk}")
    assert minimum.memo == "minimum charge: 600 s, 60 s used"
    assert minimum.amount == Decimal("-1.0800")  # 540 s x 2 GPUs x 0.001
    assert minimum.gpu_model_id == cluster.gpu_model_id
    assert Meter.objects.get(cluster=cluster).settled
    check_ledger(Account.objects.get(user=alice))


def test_burn_per_hour_in_each_mode(alice, bob, rate_card, fund, gpu_cluster):
    rate_card({"a100-80gb": RATE}, effective_from=at(-60), stopped_per_hour=Decimal("0.02"))
    fund(alice, "100")
    running = gpu_cluster("running", nodes=1, gpus=2)
    no_gpu = gpu_cluster("no-gpu", nodes=3, gpus=2)
    kept = gpu_cluster("kept", nodes=2, gpus=4)
    gpu_cluster("theirs", nodes=1, gpus=8, owner=bob)
    stop(no_gpu, 100)
    start(no_gpu, 200, no_gpu=True)
    stop(kept, 100)
    # 2 GPUs x 3.60 + 3 nodes x 0.10 + 2 kept nodes x 0.02
    assert burn(alice, 300) == Decimal("7.2000") + Decimal("0.3000") + Decimal("0.0400")
    # At a balance at or below 0 the kept workspaces are not charged (accrual's rule,
    # pricing.charged_at): the burn leaves them out.
    used_up = selectors.burn_per_hour(alice, now=at(300), balance=Decimal("0"))
    assert used_up == Decimal("7.2000") + Decimal("0.3000")
    release(running, 400)
    release(kept, 400)
    assert burn(alice, 500) == Decimal("0.3000")
    with time_machine.travel(at(500), tick=False):
        assert selectors.standing(alice).burn_per_hour == Decimal("0.3000")


def test_prices_of_a_stop_for_the_cluster_page(client, alice, rate_card, gpu_cluster, catalog):
    rate_card({"a100-80gb": RATE}, effective_from=at(-60))
    rate_card(
        {"a100-80gb": RATE}, effective_from=at(60), no_gpu_per_hour=Decimal("0.25"),
        stopped_per_hour=Decimal("0.01"),
    )  # fmt: skip
    first, later = selectors.stop_prices(at(0)), selectors.stop_prices(at(61))
    assert (first.currency, first.no_gpu, first.stopped) == ("CNY", Decimal("0.1"), Decimal("0"))
    assert first.stopped_free and not later.stopped_free
    assert (later.no_gpu, later.stopped) == (Decimal("0.25"), Decimal("0.01"))
    table = selectors.price_table(at(0))
    assert (table["no_gpu"], table["stopped"]) == ("0.1000", "0.0000")
    q = quote(RateBook.load(), gpu_model_id=catalog["a100-80gb"].pk, instance_type_id=None,
              units=4, now=at(61))  # fmt: skip
    assert q.on_demand == Decimal("14.4000") and q.no_gpu_per_node == Decimal("0.2500")
    assert q.stopped_per_node == Decimal("0.0100")
    # The cluster page's cost block says what a stop and a start without GPUs cost.
    cluster = gpu_cluster(nodes=2, gpus=1)
    with time_machine.travel(at(30), tick=False):
        client.force_login(alice)
        body = client.get(reverse("cluster_cost", args=[cluster.pk])).content.decode()
        assert "A stop keeps its workspaces free." in body
        assert "Start without GPUs: ¥0.1000 per node-hour." in body
        stop(cluster, 20)
        body = client.get(reverse("cluster_cost", args=[cluster.pk])).content.decode()
        assert 'data-testid="cluster-rate">0.0000<' in body
        assert "2 nodes stopped, workspaces kept: free" in body
        assert 'data-testid="cluster-stop-prices"' not in body  # the status block says them


def test_the_bill_page_shows_no_gpu_lines_per_node(client, alice, rate_card, fund, gpu_cluster):
    rate_card({"a100-80gb": RATE}, effective_from=at(-60))
    fund(alice, "10")
    cluster = gpu_cluster(nodes=2, gpus=1)
    stop(cluster, 60)
    start(cluster, 120, no_gpu=True)
    accrual.accrue(now=at(720))
    client.force_login(alice)
    with time_machine.travel(at(800), tick=False):
        body = client.get(reverse("billing"), {"month": "2026-12"}).content.decode()
    assert "2 × node" in body and "no-GPU mode" in body and "2 × A100 80 GB" in body


def test_an_exhausted_balance_leaves_a_stopped_cluster_whose_kept_time_is_free(
    alice, rate_card, fund, gpu_cluster
):
    rate_card({"a100-80gb": "36.00"}, effective_from=at(-60))  # 0.01 per GPU-second
    fund(alice, "1.00")
    kept = gpu_cluster("kept", nodes=1, gpus=1)
    stop(kept, 0)
    waiting = gpu_cluster("waiting", nodes=1, gpus=1)
    stop(waiting, 0)
    Cluster.objects.filter(pk=waiting.pk).update(state=Cluster.State.PENDING)  # in line
    running = gpu_cluster("running", nodes=1, gpus=1)
    for t in range(10, 200, 10):
        with time_machine.travel(at(t), tick=False):
            accrual.accrue(now=at(t))
        if Account.objects.get(user=alice).exhausted_at:
            break
    running.refresh_from_db()
    kept.refresh_from_db()
    # Stopped, not released (issue 41): its workspace kept, files and all.
    assert running.state == Cluster.State.STOPPED and running.state_reason == accrual.EXHAUSTED
    assert Node.objects.filter(cluster=running, kept_until__isnull=True).exists()
    assert kept.state == Cluster.State.STOPPED, "free to keep: kept, its files with it"
    assert Node.objects.filter(cluster=kept, kept_until__isnull=True).exists()
    waiting.refresh_from_db()
    assert waiting.state == Cluster.State.STOPPED, "out of the line, stopped again, files kept"
    assert waiting.events.filter(kind="stopped", message__contains="no longer waiting").exists()
    assert Node.objects.filter(cluster=waiting, kept_until__isnull=True).exists()


def test_an_exhausted_balance_keeps_a_stopped_cluster_whose_kept_time_costs(
    alice, rate_card, fund, gpu_cluster
):
    """Priced kept workspaces are kept through the retention period all the same (issue
    41): not released on exhaustion, and not charged while the balance is at or below 0,
    so the ledger goes one accrual period negative at most; a top-up charges them again."""
    rate_card({"a100-80gb": "36.00"}, effective_from=at(-60), stopped_per_hour=Decimal("36.00"))
    fund(alice, "0.50")
    cluster = gpu_cluster("kept", nodes=1, gpus=1)
    stop(cluster, 10)  # 0.10 of GPU time, then 0.01 a second kept
    for t in range(20, 200, 10):
        with time_machine.travel(at(t), tick=False):
            accrual.accrue(now=at(t))
        if Account.objects.get(user=alice).exhausted_at:
            break
    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.STOPPED, "kept, its files with it"
    assert Node.objects.filter(cluster=cluster, kept_until__isnull=True).exists()
    meter = Meter.objects.get(cluster=cluster)
    assert not meter.settled and meter.billed_until == at(t)
    account = Account.objects.get(user=alice)
    assert Decimal("0") >= account.balance >= Decimal("-0.10")  # one 10 s period at most
    low = account.balance
    # A day of ticks later: not a cent more (the retention period keeps it free of charge).
    for later in (t + 10, t + 3600, t + 86400):
        with time_machine.travel(at(later), tick=False):
            accrual.accrue(now=at(later))
    assert Account.objects.get(user=alice).balance == low
    assert Meter.objects.get(cluster=cluster).billed_until == at(t + 86400)
    # Money in: kept time is charged again from then on.
    fund(alice, "10")
    with time_machine.travel(at(t + 86400 + 100), tick=False):
        accrual.accrue(now=at(t + 86400 + 100))
    account = Account.objects.get(user=alice)
    assert account.balance == low + Decimal("10") - Decimal("1.00")  # 100 s at 0.01
    total = LedgerEntry.objects.filter(cluster=cluster).aggregate(s=Sum("amount"))["s"]
    assert account.balance == Decimal("10.50") + total
    check_ledger(account)


def test_the_rate_card_admin_versions_the_stop_prices(client, operator, rate_card, catalog):
    card = rate_card({"a100-80gb": RATE}, effective_from=at(-60))
    client.force_login(operator)
    # In force: history, shown read-only with its stop prices.
    page = client.get(reverse("admin:billing_ratecard_change", args=[card.pk])).content.decode()
    assert "no-gpu mode, per node-hour" in page.lower() and "stopped, per node-hour" in page.lower()
    assert 'name="no_gpu_per_hour"' not in page
    # A version yet to come is edited like the other prices.
    later = rate_card({"a100-80gb": RATE}, effective_from=timezone.now() + timedelta(days=30))
    page = client.get(reverse("admin:billing_ratecard_change", args=[later.pk])).content.decode()
    assert 'name="no_gpu_per_hour"' in page and 'name="stopped_per_hour"' in page
    later.delete()
    listing = client.get(reverse("admin:billing_ratecard_changelist")).content.decode().lower()
    assert "no-gpu mode, per node-hour" in listing and "stopped, per node-hour" in listing
    response = client.post(
        reverse("admin:billing_ratecard_change", args=[card.pk]),
        {
            "_saveasnew": "Save as new",
            "effective_from_0": "2026-12-01", "effective_from_1": "09:00:00",
            "currency": "CNY", "spot_discount_pct": "60.00", "min_charge_s": "0",
            "no_gpu_per_hour": "0.2000", "stopped_per_hour": "0.0300", "note": "stop prices",
            "storage_per_gb_hour": "0.0003",
            "prices-TOTAL_FORMS": "1", "prices-INITIAL_FORMS": "0",
            "prices-MIN_NUM_FORMS": "0", "prices-MAX_NUM_FORMS": "1000",
            "prices-0-gpu_model": str(catalog["a100-80gb"].pk), "prices-0-per_hour": RATE,
        },
    )  # fmt: skip
    assert response.status_code == 302, response.content.decode()[:2000]
    new = RateCard.objects.exclude(pk=card.pk).get()
    assert (new.no_gpu_per_hour, new.stopped_per_hour) == (Decimal("0.2"), Decimal("0.03"))
    card.refresh_from_db()
    assert (card.no_gpu_per_hour, card.stopped_per_hour) == (Decimal("0.1"), Decimal("0"))

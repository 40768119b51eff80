"""A bill a person can read: one line per cluster and hour with its exact seconds, GPUs and
rate, amounts to 4 places, balances to 2; the accrual's 10-second pieces one click away (a
detail view and a detail CSV); the cluster page's price, live cost and final cost; the
operators' revenue chart on a numeric axis.

The ledger is written by the real accrual (`billing.accrual.accrue`, ticked every 10 s as
the cron does) on a host registered without an engine (`paper_host`): no container runs.
"""

import csv
import io
import os
import time
from datetime import UTC, timedelta
from decimal import Decimal
from zoneinfo import ZoneInfo

import pytest
import time_machine
from browsing import login as _login
from django.urls import reverse
from django.utils import timezone
from node_start import ran
from playwright.sync_api import expect

from billing import accrual, formatting
from billing.models import Account, Meter
from jobs.clusters import services as cluster_services
from jobs.placement import scheduler

pytestmark = pytest.mark.django_db

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
RATE = "3.6920"  # per GPU-hour: 450 s of one GPU is 0.4615


def _t0():
    """Yesterday at HH:40:00 UTC: the first cluster's first hour is 20 minutes long."""
    hour = (timezone.now().astimezone(UTC) - timedelta(days=1)).replace(
        minute=0, second=0, microsecond=0
    )
    return hour + timedelta(minutes=40)


def _place(owner, make_cluster, name, gpus, when):
    with time_machine.travel(when, tick=False):
        cluster = make_cluster(owner, name, gpus=gpus)
        scheduler.place_pending()
        ran(cluster)  # its workspace started as it was placed (billing starts there)
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    return cluster


@pytest.fixture
def hours(alice, rate_card, fund, paper_host, make_cluster):
    """`hourly` (1 GPU) runs 87.5 minutes from HH:40: 1200 s, 3600 s and 450 s in three
    hours; `pair` (2 GPUs) joins 30 minutes in: 3000 s and 450 s. Both stop together."""
    t0 = _t0()
    rate_card({"a100-80gb": RATE}, effective_from=t0 - timedelta(hours=1))
    fund(alice, "100")
    hourly = _place(alice, make_cluster, "hourly", 1, t0)
    pair = None
    for t in range(10, 5251, 10):
        if t == 1800:
            pair = _place(alice, make_cluster, "pair", 2, t0 + timedelta(seconds=t))
        accrual.accrue(now=t0 + timedelta(seconds=t))
    with time_machine.travel(t0 + timedelta(seconds=5250), tick=False):
        cluster_services.cluster_release(cluster=hourly)
        cluster_services.cluster_release(cluster=pair)
    accrual.accrue(now=t0 + timedelta(seconds=5260))
    assert Meter.objects.filter(settled=True).count() == 2
    return {"t0": t0, "hourly": hourly, "pair": pair}


def _csv(response) -> list[dict]:
    assert response.status_code == 200 and response["Content-Type"].startswith("text/csv")
    body = response.getvalue().decode("utf-8")
    assert body.startswith("\ufeff")  # Excel on Windows reads it as UTF-8
    return list(csv.DictReader(io.StringIO(body.removeprefix("\ufeff"))))


def test_one_line_per_cluster_and_hour_with_seconds_gpus_and_rate(client, alice, hours):
    hourly, pair = hours["hourly"], hours["pair"]
    client.force_login(alice)
    response = client.get(reverse("billing"))
    lines = [line for line in response.context["page"].object_list if line.is_usage]
    got = sorted(
        (line.cluster_name, line.period_from, line.seconds, line.units, str(formatting.rate(line.rate)),
         str(line.amount), line.pieces)
        for line in lines
    )  # fmt: skip
    t0 = hours["t0"]
    h1, h2 = t0 + timedelta(seconds=1200), t0 + timedelta(seconds=4800)
    # hourly: 1 GPU at 3.6920; cumulative cost rounded once per piece, so the lines add
    # up to 5250 s x 3.6920 / 3600 = 5.3842 exactly.
    assert got == sorted(
        [
            ("hourly", t0, 1200, 1, RATE, "-1.2307", 120),
            ("hourly", h1, 3600, 1, RATE, "-3.6920", 360),
            ("hourly", h2, 450, 1, RATE, "-0.4615", 45),
            ("pair", t0 + timedelta(seconds=1800), 3000, 2, RATE, "-6.1533", 300),
            ("pair", h2, 450, 2, RATE, "-0.9230", 45),
        ]
    )
    body = response.content.decode()
    assert body.count('data-testid="bill-line"') == 6  # five hours of usage and a top-up
    assert ">-0.4615<" in body and "0.46150" not in body
    assert 'data-testid="cluster-cost">5.3842<' in body
    assert 'data-testid="cluster-cost">7.0763<' in body
    assert 'data-testid="balance">87.54<' in body  # 100 - 5.3842 - 7.0763 = 87.5395
    # The last hour of `hourly`, piece by piece.
    last = next(line for line in lines if line.cluster_id == hourly.pk and line.seconds == 450)
    detail = client.get(
        reverse("billing_detail"), {"cluster": hourly.pk, "hour": last.hour_key, "kind": "usage"}
    )
    assert len(detail.context["page"].object_list) == 45 and not detail.context["page"].older
    assert f"hour={last.hour_key}" in body
    assert {e.seconds for e in detail.context["page"].object_list} == {10}
    assert pair.pk in {line.cluster_id for line in lines}


def test_the_monthly_csv_is_the_bill_and_the_detail_csv_every_piece(client, alice, hours):
    client.force_login(alice)
    now = timezone.now()
    rows = _csv(client.get(reverse("billing_statement", args=[now.year, now.month])))
    # In time order: the hours of usage (yesterday's, travelled back to), then the top-up
    # (posted now); the balance after each line walks to the balance now.
    assert [r["kind"] for r in rows] == ["usage"] * 5 + ["topup"]
    assert rows[-1]["amount"] == "100.0000" and rows[-1]["balance after"] == "87.5395"
    hourly = [r for r in rows if r["cluster"] == "hourly"]
    t0 = hours["t0"]
    assert [
        (r["from"], r["seconds"], r["units"], r["rate per unit-hour"], r["amount"])
        for r in hourly
    ] == [
        (t0.strftime("%Y-%m-%d %H:%M:%S+00:00"), "1200", "1", RATE, "-1.2307"),
        ((t0 + timedelta(seconds=1200)).strftime("%Y-%m-%d %H:%M:%S+00:00"), "3600", "1", RATE,
         "-3.6920"),
        ((t0 + timedelta(seconds=4800)).strftime("%Y-%m-%d %H:%M:%S+00:00"), "450", "1", RATE,
         "-0.4615"),
    ]  # fmt: skip
    assert all(r["currency"] == "CNY" and r["resource"] == "A100 80 GB" for r in rows[:-1])
    assert sum(Decimal(r["amount"]) for r in rows) == Decimal("87.5395")
    assert sum(int(r["pieces"]) for r in rows[:-1]) == 525 + 345

    detail = _csv(client.get(reverse("billing_statement_detail", args=[now.year, now.month])))
    assert len(detail) == 1 + 525 + 345
    assert {r["seconds"] for r in detail if r["kind"] == "usage"} == {"10"}
    assert sum(Decimal(r["amount"]) for r in detail) == Decimal(detail[-1]["balance after"])
    assert Decimal(detail[-1]["balance after"]) == Decimal("87.5395")
    assert Account.objects.get(user=alice).balance == Decimal("87.5395")


def test_another_tenant_gets_none_of_the_bill(client, bob, hours):
    client.force_login(bob)
    now = timezone.now()
    assert len(_csv(client.get(reverse("billing_statement", args=[now.year, now.month])))) == 0
    rows = _csv(client.get(reverse("billing_statement_detail", args=[now.year, now.month])))
    assert rows == []
    hourly = hours["hourly"]
    assert client.get(reverse("billing_detail"), {"cluster": hourly.pk}).status_code == 404
    assert client.get(reverse("cluster_cost", args=[hourly.pk])).status_code == 404


@pytest.mark.browser
def test_the_billing_page_reads_like_a_bill_in_chromium(page, live_server, alice, hours):
    _login(page, live_server, "alice", "alice-pass-123")
    expect(page.get_by_test_id("dashboard-balance")).to_have_text("87.54")
    page.goto(f"{live_server.url}/billing/")
    expect(page.get_by_test_id("bill-line")).to_have_count(6)
    amounts = page.get_by_test_id("bill-amount").all_inner_texts()
    assert "-0.4615" in amounts and "-0.9230" in amounts and "100.0000" in amounts
    assert all(len(a.split(".")[1]) == 4 for a in amounts), amounts
    expect(page.get_by_test_id("balance")).to_have_text("87.54")
    expect(page.locator("#cluster-costs")).to_contain_text("5.3842")
    page.screenshot(path=f"{SHOTS}/bill.png", full_page=True)
    # The hourly line of 450 s opens its 45 pieces.
    row = page.get_by_test_id("bill-line").filter(has_text="hourly").first
    expect(row.get_by_test_id("bill-seconds")).to_have_text("450")
    row.get_by_test_id("bill-line-detail").click()
    expect(page.get_by_test_id("ledger-entry")).to_have_count(45)
    expect(page.locator("#ledger-detail")).to_contain_text("-0.0103")
    page.screenshot(path=f"{SHOTS}/bill_detail.png", full_page=True)
    # The released cluster's page: its price, final cost and seconds.
    page.goto(f"{live_server.url}/clusters/{hours['hourly'].pk}/")
    expect(page.get_by_test_id("cluster-rate")).to_have_text(RATE)
    expect(page.get_by_test_id("cluster-final-cost")).to_have_text("5.3842")
    expect(page.get_by_test_id("cluster-billed-seconds")).to_have_text("5250")
    page.screenshot(path=f"{SHOTS}/cluster_final_cost.png", full_page=True)


def test_the_chinese_cost_block_names_its_zone_in_the_bills_words(
    client, alice, rate_card, fund, paper_host, make_cluster
):
    """ "billed to 22:21:10 UTC+08:00", as the bill's tables say it: not "CST" (English, and
    China or Central time)."""
    from console import preferences

    rate_card({"a100-80gb": RATE}, effective_from=timezone.now() - timedelta(hours=1))
    fund(alice, "100")
    cluster = make_cluster(alice, "zone-cost", gpus=1)
    scheduler.place_pending()
    ran(cluster)
    time.sleep(1.2)
    accrual.accrue()
    until = Meter.objects.get(cluster=cluster).billed_until
    preferences.save(alice, language="zh-hans", time_zone="Asia/Shanghai")
    client.force_login(alice)
    block = client.get(reverse("cluster_cost", args=[cluster.pk])).content.decode()
    shanghai = until.astimezone(ZoneInfo("Asia/Shanghai")).strftime("%H:%M:%S")
    assert f"{shanghai} UTC+08:00" in block
    assert "CST" not in block


@pytest.mark.browser
def test_the_cluster_page_shows_its_rate_and_live_cost_then_its_final_cost(
    page, live_server, alice, rate_card, fund, paper_host, make_cluster
):
    rate_card({"a100-80gb": RATE}, effective_from=timezone.now() - timedelta(hours=1))
    fund(alice, "100")
    cluster = make_cluster(alice, "live-cost", gpus=2)
    scheduler.place_pending()
    ran(cluster)  # no engine on the paper host: its workspace started as it was placed
    time.sleep(1.2)
    accrual.accrue()  # what the cron's accrual does every 10 s
    meter = Meter.objects.get(cluster=cluster)
    assert meter.charged > 0
    _login(page, live_server, "alice", "alice-pass-123")
    expect(page.get_by_test_id("dashboard-balance")).to_have_text(
        str((Decimal("100") - meter.charged).quantize(Decimal("0.01"), rounding="ROUND_HALF_UP"))
    )
    page.goto(f"{live_server.url}/clusters/{cluster.pk}/")
    expect(page.get_by_test_id("cluster-rate")).to_have_text("7.3840")  # 2 x 3.6920
    expect(page.get_by_test_id("cluster-cost-so-far")).to_have_text(str(meter.charged))
    page.screenshot(path=f"{SHOTS}/cluster_live_cost.png", full_page=True)
    time.sleep(1.2)
    accrual.accrue()
    meter.refresh_from_db()
    # No reload: the cost block polls while the cluster holds its GPUs.
    expect(page.get_by_test_id("cluster-cost-so-far")).to_have_text(
        str(meter.charged), timeout=15_000
    )
    page.on("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Release").click()
    expect(page.get_by_test_id("cluster-state")).to_have_text("released")
    accrual.accrue()  # settles the cluster up to its release second
    meter.refresh_from_db()
    assert meter.settled
    expect(page.get_by_test_id("cluster-final-cost")).to_have_text(
        str(meter.charged), timeout=15_000
    )
    billed = meter.billed_until - cluster.node_set.get().placed_at.replace(microsecond=0)
    expect(page.get_by_test_id("cluster-billed-seconds")).to_have_text(
        str(int(billed.total_seconds()))
    )
    page.screenshot(path=f"{SHOTS}/cluster_released_cost.png", full_page=True)


@pytest.mark.browser
def test_the_revenue_chart_is_on_a_numeric_axis(
    page, live_server, operator, alice, rate_card, fund, paper_host, make_cluster
):
    """A small day (0.0305) and a large one (3.6551): the large bar is the taller one."""
    today = timezone.now().astimezone(UTC).replace(hour=10, minute=0, second=0, microsecond=0)
    day1, day2 = today - timedelta(days=2), today - timedelta(days=1)
    rate_card({"a100-80gb": "3.6551"}, effective_from=day1 - timedelta(hours=1))
    fund(alice, "100")
    cluster = _place(alice, make_cluster, "revenue", 1, day1)
    with time_machine.travel(day1 + timedelta(seconds=30), tick=False):
        accrual.accrue(now=day1 + timedelta(seconds=30))  # 0.0305, charged on day 1
    with time_machine.travel(day1 + timedelta(seconds=3630), tick=False):
        cluster_services.cluster_release(cluster=cluster)
    with time_machine.travel(day2, tick=False):
        accrual.accrue(now=day2)  # the rest of the hour, 3.6551, charged on day 2
    _login(page, live_server, "olga", "olga-pass-123")
    page.goto(f"{live_server.url}/ops/billing/")
    expect(page.locator("#revenue-chart .main-svg").first).to_be_visible()
    types = page.evaluate(
        "() => document.getElementById('revenue-chart').data.flatMap(t => t.y.map(v => typeof v))"
    )
    assert set(types) == {"number"}, types
    ys = page.evaluate("() => document.getElementById('revenue-chart').data[0].y")
    assert sorted(y for y in ys if y) == [0.0305, 3.6551]
    axis = page.evaluate(
        "() => { const a = document.getElementById('revenue-chart')._fullLayout.yaxis;"
        " return [a.type, a.range[0], a.range[1]]; }"
    )
    assert axis[0] == "linear" and axis[1] <= 0 and axis[2] >= 3.6551, axis
    # The bars as drawn: the day of 3.6551 is about 120 times as tall as the day of 0.0305.
    heights = page.evaluate(
        "() => Array.from(document.querySelectorAll('#revenue-chart .bars .point path'))"
        ".map(p => p.getBBox().height)"
    )
    drawn = sorted(h for h in heights if h > 0)
    assert len(drawn) == 2 and drawn[1] > 50 * drawn[0], heights
    expect(page.get_by_test_id("revenue-total")).to_have_text("3.69")
    expect(page.locator("#accounts")).to_contain_text("3.69")  # alice's spent, to the cent
    page.screenshot(path=f"{SHOTS}/ops_revenue.png", full_page=True)


def test_every_figure_reads_with_its_places():
    from django.template import Context, Template

    from billing import formatting

    # What SQLite hands back for a SUM, and PostgreSQL for arithmetic on numerics.
    assert formatting.text(formatting.amount(Decimal("0.461500000000000"))) == "0.4615"
    assert formatting.text(formatting.total(Decimal("1.03350000000000"))) == "1.03"
    assert formatting.text(formatting.amount(Decimal("3.6864000000000000")), "CNY") == "¥3.6864"
    assert formatting.text(formatting.amount(Decimal("-0.46150")), "CNY") == "-¥0.4615"
    assert formatting.text(formatting.total(Decimal("12.5")), "CHF") == "12.50 CHF"
    assert formatting.text(formatting.total(Decimal("-0.004"))) == "0.00"  # no "-0.00"
    assert formatting.text(formatting.rate(Decimal("7.80000000"))) == "7.8000"
    assert formatting.text(formatting.rate(Decimal("1.08018750"))) == "1.0801875"  # exact
    assert formatting.text(None) == "—"
    html = Template(
        "{% load money %}{{ a|amount }} {{ b|total:'CNY' }} {{ c|rate }} {{ d|amount }}"
    ).render(Context({"a": Decimal("-0.46150"), "b": Decimal("99.995"), "c": "3.12", "d": None}))
    assert html == "-0.4615 ¥100.00 3.1200 —"

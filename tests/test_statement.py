"""The statement and the bill read the same everywhere (issue 40): the monthly CSV starts
with a UTF-8 byte-order mark (Excel on Windows then reads the Chinese memos), writes its
times in the reader's time zone with their offset, and lists the lines in time order with
the balance after each; the billing page shows the same balance after every line, usage
hours included, whatever it is narrowed to.

The ledger is written by the real services: top-ups and an adjustment by
`billing.services.post_entry`, usage by the real accrual ticked every 10 s on a host
registered without an engine (`paper_host`).
"""

import csv
import io
import os
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from zoneinfo import ZoneInfo

import pytest
import time_machine
from browsing import login as _login
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from playwright.sync_api import expect

from billing import accrual
from billing import services as billing
from billing.models import Account
from console import preferences
from console.models import ApiToken
from jobs.clusters import services as cluster_services
from jobs.models import Node
from jobs.placement import scheduler

pytestmark = pytest.mark.django_db

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
RATE = "3.6920"
SHANGHAI = ZoneInfo("Asia/Shanghai")


def _t0() -> datetime:
    """The first of the month three days ago, 02:40 UTC (10:40 in Beijing, the same day):
    every entry below lies in that month and in the past."""
    then = timezone.now().astimezone(UTC) - timedelta(days=3)
    return then.replace(day=1, hour=2, minute=40, second=0, microsecond=0)


def _post(user, kind, amount, memo, when):
    with time_machine.travel(when, tick=False):
        return billing.post_entry(
            account=billing.account_for(user), kind=kind, amount=Decimal(amount),
            key=f"statement:{user.username}:{kind}:{when.isoformat()}", memo=memo,
        )  # fmt: skip


@pytest.fixture
def month(alice, bob, rate_card, paper_host, make_cluster):
    """Alice: a top-up at 02:40, a cluster of 1 GPU from 02:50 to 04:20 (three hour lines,
    the middle one whole), an adjustment at 03:30 inside the middle hour, a second top-up at
    04:30. Bob: a top-up of his own."""
    t0 = _t0()
    rate_card({"a100-80gb": RATE}, effective_from=t0 - timedelta(hours=1))
    _post(alice, "topup", "100", "充值：发票 2026-117", t0)
    _post(bob, "topup", "7", "bob's own", t0)
    start = t0 + timedelta(minutes=10)
    with time_machine.travel(start, tick=False):
        cluster = make_cluster(alice, "训练", gpus=1)
        scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    # A host with no engine never reports its workspace started: say it did, at placement.
    Node.objects.filter(cluster=cluster, started_at__isnull=True).update(started_at=start)
    for t in range(10, 5401, 10):
        now = start + timedelta(seconds=t)
        if t == 2400:
            _post(alice, "adjustment", "-1.25", "调整：多收的存储费", now)
        accrual.accrue(now=now)
    with time_machine.travel(start + timedelta(seconds=5400), tick=False):
        cluster_services.cluster_release(cluster=cluster)
    accrual.accrue(now=start + timedelta(seconds=5410))
    _post(alice, "topup", "20", "第二次充值", t0 + timedelta(minutes=110))
    return {"t0": t0, "cluster": cluster}


def _statement(client, year, month_) -> tuple[bytes, list[dict]]:
    response = client.get(reverse("billing_statement", args=[year, month_]))
    assert response.status_code == 200
    raw = b"".join(response.streaming_content)
    return raw, list(csv.DictReader(io.StringIO(raw.decode("utf-8-sig"))))


def test_the_statement_starts_with_a_bom_reads_the_readers_zone_and_adds_up(client, alice, month):
    preferences.save(alice, language="zh-hans", time_zone="Asia/Shanghai")
    client.force_login(alice)
    t0 = month["t0"]
    raw, rows = _statement(client, t0.year, t0.month)
    # Excel on Windows opens a CSV as UTF-8 only when it starts with the byte-order mark.
    assert raw.startswith(b"\xef\xbb\xbf")
    memos = [r["memo"] for r in rows if r["kind"] != "usage"]
    assert memos == ["充值：发票 2026-117", "调整：多收的存储费", "第二次充值"]
    # The top-up posted at 02:40 UTC reads 10:40 Beijing time, with its offset.
    first = rows[0]
    assert first["kind"] == "topup"
    assert first["time"] == t0.astimezone(SHANGHAI).strftime("%Y-%m-%d %H:%M:%S+08:00")
    assert first["time"].endswith(" 10:40:00+08:00")
    usage = [r for r in rows if r["kind"] == "usage"]
    assert [r["from"][11:] for r in usage] == ["10:50:00+08:00", "11:00:00+08:00", "12:00:00+08:00"]
    assert [r["seconds"] for r in usage] == ["600", "3600", "1200"]
    assert all(r["cluster"] == "训练" for r in usage)
    # In time order: each line's time is at or after the one before.
    times = [datetime.fromisoformat(r["time"]) for r in rows]
    assert times == sorted(times) and all(t.utcoffset() == timedelta(hours=8) for t in times)
    assert [r["kind"] for r in rows] == [
        "topup", "usage", "usage", "adjustment", "usage", "topup"
    ]  # fmt: skip
    # The balance after each line is the one before plus its amount, to the last digit,
    # and the last is the balance now.
    balance = Decimal("0")
    for row in rows:
        balance += Decimal(row["amount"])
        assert Decimal(row["balance after"]) == balance, row
    assert balance == Account.objects.get(user=alice).balance
    assert Decimal(rows[-1]["balance after"]) == Account.objects.get(user=alice).balance
    # 5400 s of one GPU at 3.6920 an hour is 5.5380; minus 1.25; plus 120.
    assert balance == Decimal("113.2120")
    assert "bob" not in raw.decode("utf-8-sig")
    # The detail CSV (every piece) has the mark and the zone too.
    detail = client.get(reverse("billing_statement_detail", args=[t0.year, t0.month]))
    body = b"".join(detail.streaming_content)
    assert body.startswith(b"\xef\xbb\xbf")
    pieces = list(csv.DictReader(io.StringIO(body.decode("utf-8-sig"))))
    assert pieces[0]["time"].endswith(" 10:40:00+08:00")


def test_a_reader_in_utc_gets_utc(client, alice, month):
    client.force_login(alice)  # English, no zone chosen: UTC
    t0 = month["t0"]
    _raw, rows = _statement(client, t0.year, t0.month)
    assert rows[0]["time"] == t0.strftime("%Y-%m-%d %H:%M:%S+00:00")


def test_the_statements_month_is_the_readers_month(client, alice):
    """A top-up at 2026-12-31 20:00 UTC is 2027-01-01 04:00 in Shanghai: January's for a
    Shanghai reader (statement and page), December's for a reader in UTC."""
    when = datetime(2026, 12, 31, 20, 0, tzinfo=UTC)
    _post(alice, "topup", "5", "跨年充值", when)
    client.force_login(alice)  # no zone chosen: UTC

    def memos(year, month_):
        return [r["memo"] for r in _statement(client, year, month_)[1]]

    def on_page(month_):
        page = client.get(reverse("billing"), {"month": month_}).content.decode()
        return "跨年充值" in page

    assert memos(2026, 12) == ["跨年充值"] and memos(2027, 1) == []
    assert on_page("2026-12") and not on_page("2027-01")

    preferences.save(alice, language="zh-hans", time_zone="Asia/Shanghai")
    assert memos(2026, 12) == [] and memos(2027, 1) == ["跨年充值"]
    assert _statement(client, 2027, 1)[1][0]["time"] == "2027-01-01 04:00:00+08:00"
    assert on_page("2027-01") and not on_page("2026-12")


BILL_ROW = re.compile(
    r'data-testid="bill-amount">(-?[\d.]+)<.*?data-testid="bill-balance">(-?[\d.]+)<', re.S
)


def _page_lines(client, **query) -> list[tuple[Decimal, Decimal]]:
    body = client.get(reverse("billing"), query).content.decode()
    return [(Decimal(a), Decimal(b)) for a, b in BILL_ROW.findall(body)]


def test_the_billing_page_shows_the_balance_after_every_line(client, alice, bob, month):
    preferences.save(alice, language="zh-hans", time_zone="Asia/Shanghai")
    client.force_login(alice)
    t0 = month["t0"]
    lines = _page_lines(client, month=f"{t0.year}-{t0.month:02}")
    assert len(lines) == 6  # usage lines carry a balance too
    now = Account.objects.get(user=alice).balance
    assert lines[0][1] == now  # newest first: the newest line's balance is the balance now
    for (amount, after), (_older_amount, older_after) in zip(lines, lines[1:], strict=False):
        assert older_after == after - amount
    assert lines[-1][1] == lines[-1][0]  # the first line of the account: from 0
    # Narrowed to usage, each line keeps the balance it has in the whole bill.
    usage = _page_lines(client, month=f"{t0.year}-{t0.month:02}", kind="usage")
    assert len(usage) == 3 and set(usage) <= set(lines)
    # The page's times are Beijing time too.
    body = client.get(reverse("billing"), {"month": f"{t0.year}-{t0.month:02}"}).content.decode()
    assert t0.astimezone(SHANGHAI).strftime("%Y-%m-%d 10:40:00") in body
    # Bob's page has his top-up and its balance, nothing of Alice's.
    client.force_login(bob)
    assert _page_lines(client, month=f"{t0.year}-{t0.month:02}") == [
        (Decimal("7.0000"), Decimal("7.0000"))
    ]


@pytest.mark.browser
def test_the_billing_page_in_chinese_at_desk_and_phone_widths(browser, live_server, alice, month):
    preferences.save(alice, language="zh-hans", time_zone="Asia/Shanghai")
    t0 = month["t0"]
    for width, height in ((1366, 900), (390, 844)):
        context = browser.new_context(
            viewport={"width": width, "height": height}, locale="zh-CN",
            timezone_id="Asia/Shanghai",
        )  # fmt: skip
        page = context.new_page()
        _login(page, live_server, "alice", "alice-pass-123")
        page.goto(f"{live_server.url}/billing/?month={t0.year}-{t0.month:02}")
        expect(page.get_by_test_id("bill-line")).to_have_count(6)
        balances = page.get_by_test_id("bill-balance").all_inner_texts()
        assert balances[0] == "113.2120" and all(balances), balances
        expect(page.locator("#ledger thead")).to_contain_text("UTC+08:00")
        expect(page.locator("#ledger")).to_contain_text(
            t0.astimezone(SHANGHAI).strftime("%Y-%m-%d 10:40:00")
        )
        # The daily chart's date axis in Chinese: "12月1日", not "12月 1, 2026".
        ticks = page.locator("#daily-chart .xtick text")
        expect(ticks.first).to_be_attached()
        days = " ".join(ticks.all_text_contents())
        assert re.search(r"\d+月\d+日", days) and ", " not in days, days
        wide = page.evaluate("document.documentElement.scrollWidth")
        assert wide <= width, wide
        page.screenshot(path=f"{SHOTS}/billing_zh_{width}.png", full_page=True)
        context.close()


def _api(user):
    _, token = ApiToken.issue(user=user, name="script")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def get(path, **query):
        response = client.get(f"/api/v1/{path}", query)
        return response.status_code, response.json()

    return get


def test_the_api_gives_the_bill_lines_paged_with_their_pieces(alice, bob, month):
    t0, cluster = month["t0"], month["cluster"]
    get = _api(alice)
    status, bill = get("bill", month=f"{t0.year}-{t0.month:02}")
    assert status == 200, bill
    assert (bill["month"], bill["currency"], bill["count"], bill["page"], bill["pages"]) == (
        f"{t0.year}-{t0.month:02}",
        "CNY",
        6,
        1,
        1,
    )
    lines = bill["lines"]
    assert [line["kind"] for line in lines] == [
        "topup", "usage", "adjustment", "usage", "usage", "topup"
    ]  # fmt: skip
    assert lines[0]["balance_after"] == "113.2120" and lines[-1]["balance_after"] == "100.0000"
    for newer, older in zip(lines, lines[1:], strict=False):
        assert Decimal(older["balance_after"]) == Decimal(newer["balance_after"]) - Decimal(
            newer["amount"]
        )
    hour = next(line for line in lines if line["seconds"] == 3600)
    assert (hour["cluster"], hour["cluster_name"], hour["resource"]) == (
        cluster.pk,
        "训练",
        "A100 80 GB",
    )
    assert (hour["amount"], hour["rate"], hour["units"], hour["pieces"]) == (
        "-3.6920",
        RATE,
        1,
        360,
    )
    assert hour["period_from"].endswith("Z") and hour["at"] == hour["hour"]
    # The hour's 360 pieces, 50 a page; together they are the line, to the last digit.
    got, total = [], None
    for page in range(1, 9):
        status, pieces = get(f"bill/{hour['id']}/pieces", page=page)
        assert status == 200 and pieces["line"]["id"] == hour["id"]
        got += pieces["pieces"]
        total = pieces["count"]
    assert total == 360 and len(got) == 360 and pieces["pages"] == 8
    assert sum(Decimal(p["amount"]) for p in got) == Decimal("-3.6920")
    assert {p["kind"] for p in got} == {"usage"} and {p["cluster"] for p in got} == {cluster.pk}
    # A top-up's one piece is itself.
    status, one = get(f"bill/{lines[0]['id']}/pieces")
    assert status == 200 and [p["memo"] for p in one["pieces"]] == ["第二次充值"]
    # Narrowed to a kind; paged past the end is an empty page.
    assert [
        x["kind"] for x in get("bill", month=f"{t0.year}-{t0.month:02}", kind="usage")[1]["lines"]
    ] == ["usage"] * 3
    assert get("bill", month=f"{t0.year}-{t0.month:02}", page=2)[1]["lines"] == []
    assert get("bill", month="2026-13")[0] == 400
    # Bob sees his own line only; Alice's lines, their pieces and her cluster are 404 to him.
    bob_get = _api(bob)
    status, his = bob_get("bill", month=f"{t0.year}-{t0.month:02}")
    assert status == 200 and [(x["kind"], x["memo"]) for x in his["lines"]] == [
        ("topup", "bob's own")
    ]
    assert bob_get(f"bill/{hour['id']}/pieces")[0] == 404
    assert bob_get("bill", cluster=cluster.pk)[0] == 404
    # The schema names both, money as strings and times as date-time.
    schema = Client().get("/api/v1/schema").json()
    assert "/api/v1/bill" in schema["paths"] and "/api/v1/bill/{line_id}/pieces" in schema["paths"]
    line = schema["components"]["schemas"]["BillLineOut"]
    assert line["properties"]["amount"]["type"] == "string"
    assert {"id", "kind", "at", "amount", "balance_after", "pieces"} <= set(line["required"])

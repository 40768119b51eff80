"""The bill at scale (issue 17): statements that add up month by month, pages walked by
cursor, and every query the billing and clusters pages run served by an index.

A cluster runs from 31 January 23:40 to 1 February 00:25 UTC under the real accrual
(ticked every 10 s, as cron does): January's statement holds its first 20 minutes to the
last digit of the pieces charged for them, February's the other 25. Alice tops up 120
times (60 of them in one instant) and walks her bill 50 lines at a time. The plans come
from PostgreSQL's own EXPLAIN, with sequential scans, bitmap scans and sorts priced out of
reach so that any query the indexes cannot serve shows as one.
"""

import csv
import io
import re
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from node_start import ran

from billing import accrual
from billing import services as billing
from billing.models import LedgerEntry
from jobs.clusters import services as cluster_services
from jobs.placement import scheduler

pytestmark = pytest.mark.django_db

RATE = "3.6920"  # per GPU-hour
T0 = datetime(2026, 1, 31, 23, 40, tzinfo=UTC)
RUN_S = 2700  # 45 minutes: 1,200 s in January, 1,500 s in February


def _statement(client, year: int, month: int) -> list[dict]:
    response = client.get(reverse("billing_statement", args=[year, month]))
    assert response.status_code == 200
    body = b"".join(response.streaming_content).decode("utf-8-sig")
    return list(csv.DictReader(io.StringIO(body)))


@pytest.fixture
def across_months(alice, rate_card, fund, paper_host, make_cluster):
    rate_card({"a100-80gb": RATE}, effective_from=T0 - timedelta(days=1))
    with time_machine.travel(T0 - timedelta(hours=1), tick=False):
        fund(alice, "50")
    with time_machine.travel(T0, tick=False):
        cluster = make_cluster(alice, "monthend", gpus=2)
        scheduler.place_pending()
        ran(cluster)  # its workspace started as it was placed (billing starts there)
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    for t in range(10, RUN_S + 1, 10):
        accrual.accrue(now=T0 + timedelta(seconds=t))
    with time_machine.travel(T0 + timedelta(seconds=RUN_S), tick=False):
        cluster_services.cluster_release(cluster=cluster)
    accrual.accrue(now=T0 + timedelta(seconds=RUN_S + 10))
    return cluster


def _pieces_by_month(cluster) -> dict[tuple[int, int], tuple[Decimal, int]]:
    """PostgreSQL's own sum of the usage pieces, by the month their period starts in."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT date_trunc('month', period_from AT TIME ZONE 'UTC'), sum(amount),
                   sum(extract(epoch FROM period_to - period_from))::int
            FROM billing_ledgerentry WHERE cluster_id = %s AND kind = 'usage'
            GROUP BY 1
            """,
            [cluster.pk],
        )
        return {(m.year, m.month): (amount, seconds) for m, amount, seconds in cursor.fetchall()}


def test_each_months_statement_holds_exactly_the_usage_of_its_hours(client, alice, across_months):
    client.force_login(alice)
    truth = _pieces_by_month(across_months)
    # 2 GPUs at 3.6920 an hour: 1,200 s is 2.4613(3), 1,500 s is 3.0766(7); the pieces are
    # rounded one by one, and the statement must carry their sum, not a recomputed one.
    assert {k: v[1] for k, v in truth.items()} == {(2026, 1): 1200, (2026, 2): 1500}
    for (year, month), (amount, seconds) in truth.items():
        rows = _statement(client, year, month)
        usage = [r for r in rows if r["kind"] == "usage"]
        assert usage, f"no usage in {year}-{month:02}"
        assert {r["cluster"] for r in usage} == {"monthend"}
        assert sum(Decimal(r["amount"]) for r in usage) == amount
        assert sum(int(r["seconds"]) for r in usage) == seconds
        for row in usage:  # every line's hour lies in its statement's month
            start = datetime.fromisoformat(row["from"])
            assert (start.year, start.month) == (year, month), row
            assert row["units"] == "2" and Decimal(row["rate per unit-hour"]) == Decimal(RATE)
    january = _statement(client, 2026, 1)
    assert [r["kind"] for r in january].count("topup") == 1
    assert [r["kind"] for r in _statement(client, 2026, 2)].count("topup") == 0
    # The hour lines of the two months and the top-up account for the whole balance.
    total = sum(a for a, _ in truth.values())
    alice_balance = billing.account_for(alice).balance
    assert alice_balance == Decimal("50") + total
    # Seconds billed equal the seconds run: nothing lost at midnight, nothing twice.
    assert sum(s for _, s in truth.values()) == RUN_S


@pytest.fixture
def topups(alice):
    """120 top-ups, newest memo "#119": 60 posted one by one, then 60 in one instant (the
    same `at` to the microsecond, so the pages must break ties by id)."""
    account = billing.account_for(alice)
    for i in range(120):
        if i == 60:
            frozen = time_machine.travel(datetime.now(UTC) + timedelta(seconds=1), tick=False)
            frozen.start()
        billing.post_entry(
            account=account, kind="topup", amount=Decimal("1"), key=f"walk:{i}",
            memo=f"top-up #{i:03}",
        )  # fmt: skip
    frozen.stop()
    assert LedgerEntry.objects.filter(account=account, key__startswith="walk:").count() == 120


def _page(client, query: str = "") -> tuple[list[int], str, str]:
    response = client.get(reverse("billing") + query)
    assert response.status_code == 200
    body = response.content.decode()
    numbers = [int(n) for n in re.findall(r"top-up #(\d{3})<", body)]

    def link(testid):
        found = re.search(rf'href="\?([^"]*)" data-testid="{testid}"', body)
        return "?" + found.group(1).replace("&amp;", "&") if found else ""

    return numbers, link("newer"), link("older")


def test_the_bill_walks_by_cursor_without_gaps_or_repeats(client, alice, topups):
    client.force_login(alice)
    first, newer, older = _page(client)
    assert first == list(range(119, 69, -1)) and not newer and older
    second, back, older2 = _page(client, older)
    assert second == list(range(69, 19, -1)) and back and older2
    third, _, end = _page(client, older2)
    assert third == list(range(19, -1, -1)) and not end
    # "Newer" from the second page is the first page again, exactly.
    assert _page(client, back)[0] == first
    # A cursor someone typed or truncated is the first page, not an error.
    for junk in ("older", "older:abc:1", "older:1:", "newer:99999999999999999999999:1", "x:1:2"):
        assert _page(client, f"?cursor={junk}")[0] == first, junk


BIG = ("billing_billline", "billing_ledgerentry", "billing_usageday", "billing_meter")
BIG += ("jobs_cluster", "jobs_job", "jobs_node")


def _may_sort(sql: str) -> bool:
    """The costliest clusters sort the account's meters (one row per cluster, found by the
    account's index): an index on `charged` would make every accrual tick's meter update
    rewrite it, for a sort of a few thousand rows at most."""
    return sql.startswith('SELECT "billing_meter"')


def _plans(queries) -> list[tuple[str, str]]:
    """EXPLAIN each captured read of a table that grows with history, with every plan the
    indexes cannot serve (scan the whole table, sort the rows) priced out of reach."""
    plans = []
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE " + ", ".join(BIG))  # the planner sees the rows there are
        cursor.execute("SET enable_seqscan = off; SET enable_bitmapscan = off")
        try:
            for query in queries:
                sql = query["sql"]
                if not sql.startswith("SELECT") or not any(f'"{t}"' in sql for t in BIG):
                    continue
                cursor.execute(f"SET enable_sort = {'on' if _may_sort(sql) else 'off'}")
                cursor.execute("EXPLAIN " + sql)
                plans.append((sql, "\n".join(row[0] for row in cursor.fetchall())))
        finally:
            cursor.execute("RESET enable_seqscan; RESET enable_bitmapscan; RESET enable_sort")
    return plans


def _read_pages(client, url: str) -> list[dict]:
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
        if hasattr(response, "streaming_content"):
            b"".join(response.streaming_content)
    assert response.status_code == 200, url
    return ctx.captured_queries


def _clone(cursor, table: str, by: str, pk: int, n: int, **overrides: str) -> None:
    """Copy one row n times in one statement (`g` counts 1..n in the overrides' SQL)."""
    columns = [
        c.name for c in connection.introspection.get_table_description(cursor, table)
        if c.name != "id"
    ]  # fmt: skip
    names = ", ".join(f'"{c}"' for c in columns)
    values = ", ".join(overrides.get(c, f't."{c}"') for c in columns)
    # The test's own table and column names, never input.
    sql = f'INSERT INTO "{table}" ({names}) SELECT {values} FROM "{table}" t, '  # noqa: S608
    cursor.execute(sql + f'generate_series(1, {n}) g WHERE t."{by}" = %s', [pk])


@pytest.fixture
def bobs_year(bob, across_months):
    """Bob has a long history beside Alice: 2,000 ended clusters with their nodes and
    meters, 20,000 ledger pieces, 5,000 bill lines and 300 days of usage, copied from
    Alice's real rows. With them the planner has a choice to get wrong."""
    account = billing.account_for(bob).pk
    alice_account = billing.account_for(across_months.owner).pk
    clusters = 2000
    with connection.cursor() as cursor:
        _clone(
            cursor, "jobs_cluster", "id", across_months.pk, clusters, owner_id=str(bob.pk),
            name="'hist-' || g", state="'released'",
            created_at="t.created_at - g * interval '1 hour'",
        )  # fmt: skip
        cursor.execute("SELECT min(id), max(id) FROM jobs_cluster WHERE owner_id = %s", [bob.pk])
        first, last = cursor.fetchone()
        assert last - first + 1 == clusters
        some = f"{first} + g %% {clusters}"
        node = across_months.node_set.values_list("pk", flat=True).first()
        _clone(cursor, "jobs_node", "id", node, clusters, cluster_id=f"{first} + g - 1")
        _clone(
            cursor, "billing_meter", "cluster_id", across_months.pk, clusters,
            cluster_id=f"{first} + g - 1", account_id=str(account),
        )  # fmt: skip
        piece = LedgerEntry.objects.filter(cluster=across_months, kind="usage").first().pk
        _clone(
            cursor, "billing_ledgerentry", "id", piece, 20_000, account_id=str(account),
            key="'hist:' || g", cluster_id=some,
            created_at="t.created_at - g * interval '10 seconds'",
            period_from="t.period_from - g * interval '10 seconds'",
            period_to="t.period_to - g * interval '10 seconds'",
        )  # fmt: skip
        cursor.execute(
            "SELECT min(id) FROM billing_billline WHERE cluster_id = %s", [across_months.pk]
        )
        _clone(
            cursor, "billing_billline", "id", cursor.fetchone()[0], 5000,
            account_id=str(account), cluster_id=some, entry_id="NULL",
            hour="t.hour - g * interval '1 hour'", at="t.at - g * interval '1 hour'",
        )  # fmt: skip
        cursor.execute(
            "SELECT min(id) FROM billing_usageday WHERE account_id = %s", [alice_account]
        )
        _clone(
            cursor, "billing_usageday", "id", cursor.fetchone()[0], 300,
            account_id=str(account), day="t.day - g",
        )  # fmt: skip


def test_the_billing_and_cluster_pages_read_only_by_index(
    client, alice, across_months, topups, bobs_year
):
    client.force_login(alice)
    bill = reverse("billing")
    _, _, older = _page(client)
    urls = [
        bill,
        bill + older,
        bill + "?kind=usage&month=2026-01",
        bill + f"?cluster={across_months.pk}&month=2026-02",
        reverse("billing_detail") + f"?cluster={across_months.pk}",
        reverse("billing_statement", args=[2026, 1]),
        reverse("billing_statement_detail", args=[2026, 2]),
        reverse("cluster_list"),
        reverse("cluster_list") + "?page=2",
    ]
    queries = [q for url in urls for q in _read_pages(client, url)]
    plans = _plans(queries)
    with connection.cursor() as cursor:
        cursor.execute("SELECT indexrelid::regclass::text FROM pg_index WHERE indpred IS NOT NULL")
        partial = {name for (name,) in cursor.fetchall()}
    assert len(plans) >= len(urls)
    for sql, plan in plans:
        if not _may_sort(sql):
            assert "Sort" not in plan.replace("Sort Key", ""), f"{sql}\n{plan}"
        for node in _nodes(plan):
            assert "Seq Scan" not in node, f"{sql}\n{plan}"
            # An index walked end to end with a filter is a table scan by another name;
            # a partial index holds only the rows it names (live nodes, say), not history.
            head = node.split("\n")[0]
            if any(f" on {t} " in head for t in BIG) and not any(
                f" using {name} on " in head for name in partial
            ):
                assert "Index Cond" in node, f"{sql}\n{plan}"


def _nodes(plan: str) -> list[str]:
    """The plan's nodes, each with the lines that describe it."""
    nodes: list[list[str]] = [[]]
    for line in plan.splitlines():
        if line.lstrip().startswith("->"):
            nodes.append([])
        nodes[-1].append(line)
    return ["\n".join(n) for n in nodes if n]


def test_the_admin_ledger_lists_a_long_ledger_without_counting_it(client, operator, bobs_year):
    """Unfiltered, the operator's ledger list takes its size from PostgreSQL's statistics
    (no COUNT(*) over every row); narrowed to a kind or an account, it counts exactly."""
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE billing_ledgerentry")
    total = LedgerEntry.objects.count()
    assert total > 20_000
    client.force_login(operator)
    url = reverse("admin:billing_ledgerentry_changelist")
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    assert response.status_code == 200
    counts = [q["sql"] for q in ctx.captured_queries if "COUNT(*)" in q["sql"]]
    assert not [sql for sql in counts if "billing_ledgerentry" in sql and "WHERE" not in sql]
    body = response.content.decode()
    pages = max(int(n) for n in re.findall(r"[?&]p=(\d+)", body))
    assert abs(pages + 1 - total / 100) < total / 100 * 0.2  # an estimate, close to it
    narrowed = client.get(url + "?kind__exact=topup")
    assert narrowed.status_code == 200
    topups = LedgerEntry.objects.filter(kind="topup").count()
    assert f"{topups} ledger entr" in narrowed.content.decode()

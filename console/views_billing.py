"""Billing pages: the researcher's balance, ledger, costs and statements; the operator's
revenue and accounts. Amounts stay Decimal all the way into the chart JSON (as strings,
which plotly.js reads as numbers)."""

from __future__ import annotations

import csv
import json
from datetime import UTC, datetime

import plotly.graph_objects as go
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404, HttpResponse
from django.shortcuts import render
from django.utils import timezone

from billing import selectors as money
from billing.models import LedgerEntry
from billing.pricing import RateBook
from jobs import selectors as fleet

CHART_LAYOUT = {
    "margin": {"l": 50, "r": 10, "t": 10, "b": 40},
    "height": 260,
    "paper_bgcolor": "rgba(0,0,0,0)",
    "plot_bgcolor": "rgba(0,0,0,0)",
    "font": {"family": "system-ui, sans-serif", "size": 12},
    "yaxis": {"rangemode": "tozero", "gridcolor": "#e5e7eb"},
    "bargap": 0.25,
}


def _chart(traces: list, *, currency: str, stacked: bool = False) -> str:
    fig = go.Figure(data=traces)
    fig.update_layout(**CHART_LAYOUT, yaxis_title=currency, barmode="stack" if stacked else None)
    return fig.to_json()


def _months(user) -> list[tuple[int, int]]:
    first = LedgerEntry.objects.filter(account__user=user).order_by("created_at").first()
    now = timezone.now().astimezone(UTC)
    if first is None:
        return [(now.year, now.month)]
    start = first.created_at.astimezone(UTC)
    months, y, m = [], now.year, now.month
    while (y, m) >= (start.year, start.month) and len(months) < 36:
        months.append((y, m))
        y, m = (y, m - 1) if m > 1 else (y - 1, 12)
    return months


@login_required
def billing(request):
    user = request.user
    kind = request.GET.get("kind", "")
    if kind not in LedgerEntry.Kind.values:
        kind = ""
    cluster_id = request.GET.get("cluster") or None
    cluster = None
    if cluster_id:
        try:
            cluster = fleet.cluster_for_user(user, int(cluster_id))  # another tenant's: 404
        except ValueError:
            raise Http404("No such cluster.") from None
    entries = money.entries_of(user, kind=kind, cluster_id=cluster.pk if cluster else None)
    page = Paginator(entries, 50).get_page(request.GET.get("page"))
    standing = money.standing(user)
    daily = money.daily_cost(user, days=30)
    chart = _chart(
        [
            go.Bar(
                x=[d.isoformat() for d, _ in daily],
                y=[str(v) for _, v in daily],
                marker_color="#4f46e5",
                name="cost",
                hovertemplate="%{x}: %{y} " + standing.currency + "<extra></extra>",
            )
        ],
        currency=standing.currency,
    )
    filters = request.GET.copy()
    filters.pop("page", None)
    return render(
        request,
        "console/billing.html",
        {
            "standing": standing,
            "page": page,
            "kind": kind,
            "kinds": LedgerEntry.Kind.choices,
            "cluster": cluster,
            "clusters": fleet.clusters_for(user).values("pk", "name")[:200],
            "costs": money.cost_per_cluster(user),
            "chart_json": chart,
            "months": _months(user),
            "filter_query": filters.urlencode(),
        },
    )


@login_required
def billing_statement(request, year: int, month: int):
    """One month of the ledger as CSV, every line explained."""
    if not 1 <= month <= 12 or not 2000 <= year <= 2200:
        raise Http404("No such month.")
    currency = money.standing(request.user).currency
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = (
        f'attachment; filename="suanli-statement-{year:04}-{month:02}.csv"'
    )
    writer = csv.writer(response)
    writer.writerow(
        [
            "time (UTC)", "kind", "amount", "currency", "balance after", "cluster",
            "from (UTC)", "to (UTC)", "seconds", "units", "rate per unit-hour", "memo", "key",
        ]
    )  # fmt: skip

    def iso(dt: datetime | None) -> str:
        return dt.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if dt else ""

    for e in money.statement(request.user, year, month).iterator():
        writer.writerow(
            [
                iso(e.created_at), e.kind, e.amount, currency, e.balance_after,
                e.cluster.name if e.cluster else "", iso(e.period_from), iso(e.period_to),
                e.seconds if e.seconds is not None else "", e.units or "",
                e.rate if e.rate is not None else "", _csv_safe(e.memo), e.key,
            ]
        )  # fmt: skip
    return response


def _csv_safe(text: str) -> str:
    # A memo typed by an operator must not become a formula in a spreadsheet.
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


@staff_member_required
def ops_billing(request):
    data = money.revenue(days=30)
    days = [d.isoformat() for d in data["days"]]
    currency = RateBook.load().currency
    traces = [
        go.Bar(x=days, y=[str(v) for v in values], name=name)
        for name, values in data["series"].items()
    ]
    return render(
        request,
        "console/ops_billing.html",
        {
            "chart_json": _chart(traces, currency=currency, stacked=True),
            "totals": list(zip(data["days"], data["totals"], strict=True)),
            "total": sum(data["totals"]),
            "per_model": {name: sum(values) for name, values in data["series"].items()},
            "accounts": money.accounts_overview(),
            "currency": currency,
        },
    )


def cluster_form_prices(form) -> str:
    """Per unit-hour prices keyed by the form's resource values, for the live estimate."""
    table = money.price_table()
    out = {}
    for slug, model in form.gpu_models.items():
        if model.pk in table["gpu"]:
            out[f"gpu:{slug}"] = table["gpu"][model.pk]
    for name, itype in form.instance_types.items():
        if itype.pk in table["cpu"]:
            out[f"cpu:{name}"] = table["cpu"][itype.pk]
    return json.dumps({"currency": table["currency"], "prices": out})

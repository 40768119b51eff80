"""Billing pages: the researcher's balance, bill, ledger detail, costs and statements; the
operator's revenue and accounts. Amounts stay Decimal all the way into the chart JSON,
where Plotly's encoder writes them as JSON numbers (a string would make a category axis,
sorted as text). How every figure reads: billing.formatting and `{% load money %}`."""

from __future__ import annotations

import csv
import itertools
import json
import re
import uuid
from datetime import UTC, datetime
from decimal import Decimal

import plotly.graph_objects as go
from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.db.models import Q
from django.http import Http404, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from billing import caps, formatting
from billing import selectors as money
from billing import services as ledger
from billing import storage as bought
from billing.models import Account, BillLine, LedgerEntry
from billing.pricing import RateBook
from console import projection_panel
from console.powers import operator_required
from jobs.models import Cluster, TeamMember
from jobs.placement import fleet

Role = TeamMember.Role

CHART_LAYOUT = {
    "margin": {"l": 50, "r": 10, "t": 10, "b": 40},
    "height": 260,
    "paper_bgcolor": "rgba(0,0,0,0)",
    "plot_bgcolor": "rgba(0,0,0,0)",
    "font": {"family": "system-ui, sans-serif", "size": 12},
    "yaxis": {
        "type": "linear",
        "rangemode": "tozero",
        "gridcolor": "#e5e7eb",
        "tickformat": ",.4~f",
    },
    "bargap": 0.25,
}


def _chart(traces: list, *, currency: str, stacked: bool = False) -> str:
    fig = go.Figure(data=traces)
    fig.update_layout(
        **CHART_LAYOUT,
        yaxis_title=formatting.SIGNS.get(currency, currency),
        barmode="stack" if stacked else None,
    )
    return fig.to_json()


def _months(user) -> list[tuple[int, int]]:
    """Months with a bill, newest first (up to 36): from the first line's month to now, in
    the reader's zone."""
    now = timezone.localtime()
    first = money.first_month(user, timezone.get_current_timezone()) or (now.year, now.month)
    months, y, m = [], now.year, now.month
    while (y, m) >= first and len(months) < 36:
        months.append((y, m))
        y, m = (y, m - 1) if m > 1 else (y - 1, 12)
    return months


def _filters(request) -> tuple[str, Cluster | None]:
    """The kind and cluster a page is narrowed to; another tenant's cluster is a 404."""
    kind = request.GET.get("kind", "")
    if kind not in LedgerEntry.Kind.values:
        kind = ""
    cluster = None
    if cluster_id := request.GET.get("cluster"):
        try:
            cluster = fleet.cluster_for_user(request.actor, int(cluster_id))
        except ValueError:
            raise Http404("No such cluster.") from None
    return kind, cluster


def _check_month(year: int, month: int) -> None:
    if not 1 <= month <= 12 or not 2000 <= year <= 2200:
        raise Http404("No such month.")


def _month_param(request) -> tuple[int, int]:
    """`?month=2026-12`, or this month (in the reader's zone)."""
    now = timezone.localtime()
    value = request.GET.get("month", "")
    if not value:
        return now.year, now.month
    try:
        year, month = (int(part) for part in value.split("-", 1))
    except ValueError:
        raise Http404("No such month.") from None
    _check_month(year, month)
    return year, month


def _zone() -> str:
    """The reader's zone as the tables' headings name it: "UTC+08:00" (an abbreviation such
    as "CST" means China or Central time, and is English on a Chinese page)."""
    return formatting.zone()


def _query(request) -> str:
    filters = request.GET.copy()
    filters.pop("cursor", None)
    return filters.urlencode()


def _payer(request, *, role=Role.OWNER):
    """Whose money a page shows: the person's own, or, acting for a team, the team's, to
    its owner alone (a page of everybody's spending: 403, in words, below)."""
    actor = request.actor
    if actor.for_a_team:
        actor.require(role)
    return actor.principal


@login_required
def billing(request):
    """Balance, costs, and the month's bill: one line per cluster and hour. Acting for a
    team: its owner sees this with the team's spending per member, cluster and day; the
    others their own spending and what is left of their cap (`_team_member_billing`)."""
    actor = request.actor
    if actor.for_a_team and not actor.at_least(Role.OWNER):
        return _team_member_billing(request, actor)
    user = actor.principal
    kind, cluster = _filters(request)
    year, month = _month_param(request)
    lines = money.bill(
        user,
        year,
        month,
        kind=kind,
        cluster_id=cluster.pk if cluster else None,
        zone=timezone.get_current_timezone(),
    )
    page = money.keyset(lines, request.GET.get("cursor", ""))
    money.balances_after(user, page.items)
    standing = money.standing(user)
    daily = money.daily_cost(user, days=30)
    chart = _chart(
        [
            go.Bar(
                x=[d.isoformat() for d, _cost in daily],
                y=[v for _day, v in daily],  # Decimal: a JSON number
                marker_color="#4f46e5",
                name=_("cost"),
                hovertemplate="%{x}: %{y:.4f} " + standing.currency + "<extra></extra>",
            )
        ],
        currency=standing.currency,
    )
    return render(
        request,
        "console/billing.html",
        {
            "standing": standing,
            "page": page,
            "lines_count": lines.count() if page.items else 0,
            "kind": kind,
            "kinds": LedgerEntry.Kind.choices,
            "cluster": cluster,
            "clusters": fleet.clusters_for(request.actor).values("pk", "name")[:200],
            "costs": money.cost_per_cluster(user),
            "chart_json": chart,
            "months": _months(user),
            "month": (year, month),
            "filter_query": _query(request),
            "zone": _zone(),
            "team_money": _team_money(request, actor) if actor.for_a_team else None,
            "accuracy": projection_panel.accuracy_panel(user),
        },
    )


@login_required
def billing_detail(request):
    """The ledger as the accrual wrote it (a piece per tick), for audit: narrowed to a
    bill line's cluster and hour, or to a month, a kind, a cluster."""
    user = _payer(request)
    kind, cluster = _filters(request)
    hour = None
    if value := request.GET.get("hour"):
        try:
            hour = datetime.strptime(value, "%Y-%m-%dT%H").replace(tzinfo=UTC)
        except ValueError:
            raise Http404("No such hour.") from None
    start = end = None
    month = None
    if request.GET.get("month"):
        month = _month_param(request)
        start, end = money.month_bounds(*month, timezone.get_current_timezone())
    entries = money.entries_of(
        user,
        kind=kind,
        cluster_id=cluster.pk if cluster else None,
        start=start,
        end=end,
        hour=hour,
    )
    page = money.keyset(entries, request.GET.get("cursor", ""), field="created_at")
    return render(
        request,
        "console/billing_detail.html",
        {
            "currency": money.standing(user).currency,
            "page": page,
            "kind": kind,
            "cluster": cluster,
            "hour": hour,
            "month": month,
            "months": _months(user),
            "filter_query": _query(request),
            "zone": _zone(),
        },
    )


def _stamp(zone):
    """A statement's times in the reader's zone, each with its offset
    ("2026-12-06 22:21:10+08:00"). The zone is taken while the view runs: the rows are
    written after the request's zone is gone."""

    def stamp(dt: datetime | None) -> str:
        return dt.astimezone(zone).isoformat(sep=" ", timespec="seconds") if dt else ""

    return stamp


class _Echo:
    """A file-like object for csv.writer that hands each row back instead of keeping it."""

    def write(self, value: str) -> str:
        return value


BOM = "\ufeff"


def _csv_stream(name: str, header: list[str], rows) -> StreamingHttpResponse:
    """A CSV download written as it is read: the first byte leaves at once and memory stays
    flat however long the month. It starts with a UTF-8 byte-order mark, by which Excel
    on Windows knows the file is UTF-8 (else the Chinese in memos and names is garbled)."""
    writer = csv.writer(_Echo())
    response = StreamingHttpResponse(
        itertools.chain([BOM + writer.writerow(header)], (writer.writerow(row) for row in rows)),
        content_type="text/csv; charset=utf-8",
    )
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    return response


def _csv_value(value) -> str:
    return "" if value is None else str(value)


# Times ("time", "from", "to") are in the reader's zone, each with its UTC offset. "member":
# a team's usage, the login whose budget it counts against (empty: one researcher's own
# account, the team's storage, any entry not usage).
STATEMENT_HEADER = [
    "time", "kind", "amount", "currency", "balance after", "cluster", "member", "resource",
    "from", "to", "seconds", "units", "rate per unit-hour", "pieces", "memo", "key",
]  # fmt: skip
LEDGER_HEADER = [
    "time", "kind", "amount", "currency", "balance after", "cluster", "member",
    "from", "to", "seconds", "units", "rate per unit-hour", "memo", "key",
]  # fmt: skip


def _login(user) -> str:
    return user.username if user is not None else ""


@login_required
def billing_statement(request, year: int, month: int):
    """One month's bill as CSV, streamed from the bill lines in time order (usage by the
    start of its hour, every other entry when it was posted), each with the balance after
    it: usage per cluster and hour with its exact seconds, units and rate; every other entry
    on a line of its own. The month is the reader's (in their zone), as the page's."""
    _check_month(year, month)
    user = _payer(request)
    currency = money.standing(user).currency
    zone = timezone.get_current_timezone()
    _iso = _stamp(zone)
    opening = money.opening_balance(user, money.month_bounds(year, month, zone)[0])
    lines = money.with_running_balance(
        money.bill(user, year, month, zone=zone).order_by("at", "id").iterator(chunk_size=2000),
        opening,
    )
    rows = (
        [
            _iso(line.at),
            line.kind,
            formatting.amount(line.amount),
            currency,
            _csv_value(formatting.amount(line.balance_after)),
            line.cluster_name,
            _login(line.member),
            line.resource,
            _iso(line.period_from),
            _iso(line.period_to),
            _csv_value(line.seconds),
            line.units or "",
            _csv_value(formatting.rate(line.rate)),
            line.pieces if line.is_usage else "",
            _csv_safe(line.memo),
            line.key,
        ]  # fmt: skip
        for line in lines
    )
    return _csv_stream(f"suanli-statement-{year:04}-{month:02}.csv", STATEMENT_HEADER, rows)


@login_required
def billing_statement_detail(request, year: int, month: int):
    """One month of the ledger as written, a row per entry (every accrual piece), streamed."""
    _check_month(year, month)
    user = _payer(request)
    currency = money.standing(user).currency
    zone = timezone.get_current_timezone()
    _iso = _stamp(zone)
    entries = money.statement(user, year, month, zone).iterator(chunk_size=5000)
    rows = (
        [
            _iso(e.created_at),
            e.kind,
            formatting.amount(e.amount),
            currency,
            formatting.amount(e.balance_after),
            e.cluster.name if e.cluster else "",
            _login(e.member),
            _iso(e.period_from),
            _iso(e.period_to),
            _csv_value(e.seconds),
            e.units or "",
            _csv_value(formatting.rate(e.rate)),
            _csv_safe(e.memo),
            e.key,
        ]  # fmt: skip
        for e in entries
    )
    return _csv_stream(f"suanli-ledger-{year:04}-{month:02}.csv", LEDGER_HEADER, rows)


@login_required
def cluster_cost(request, cluster_id: int):
    """The cluster page's cost block; polled while the cluster holds capacity."""
    cluster = fleet.cluster_for_user(request.actor, cluster_id)
    return render(
        request,
        "billing/_cluster_cost.html",
        {"cluster": cluster, "cost": money.cluster_cost(cluster)},
    )


def _csv_safe(text: str) -> str:
    # A memo typed by an operator must not become a formula in a spreadsheet.
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


# Revenue by day and every account's balance: what the admin's ledger and accounts show.
@operator_required("billing.view_ledgerentry", "billing.view_account")
def ops_billing(request):
    data = money.revenue(days=30)
    accounts = Paginator(money.accounts_overview(), 50).get_page(request.GET.get("page"))
    accounts.object_list = list(accounts.object_list)
    held, storage_error = bought.held_by(a.user_id for a in accounts)
    unbounded, unbounded_error = bought.unbounded()
    for account in accounts:
        account.storage = held[account.user_id]
    days = [d.isoformat() for d in data["days"]]
    currency = RateBook.load().currency
    traces = [
        go.Bar(
            x=days,
            y=values,  # Decimals: JSON numbers, so the axis is numeric
            name=name,
            hovertemplate="%{x} " + name + ": %{y:.4f} " + currency + "<extra></extra>",
        )
        for name, values in data["series"].items()
    ]
    return render(
        request,
        "console/ops_billing.html",
        {
            "chart_json": _chart(traces, currency=currency, stacked=True),
            "unbounded": unbounded,
            "unbounded_error": unbounded_error,
            "totals": list(zip(data["days"], data["totals"], strict=True)),
            "total": sum(data["totals"], Decimal("0")),
            "per_model": {
                name: sum(values, Decimal("0")) for name, values in data["series"].items()
            },
            "accounts": accounts,
            "storage_error": storage_error,
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


# -- the operator's top-up page ------------------------------------------------------------

POST_ENTRIES = "billing.post_ledgerentry"
TOPUP_KINDS = (LedgerEntry.Kind.TOPUP, LedgerEntry.Kind.REFUND, LedgerEntry.Kind.ADJUSTMENT)
MOST = Decimal("1000000.00")  # one entry, either way: a typo of three zeros is refused
TOKEN = re.compile(r"^[0-9a-f]{32}$")


class OnceForm(forms.Form):
    """A money form sent once: its hidden token (made when the page was drawn) is the
    idempotency key of the entry it writes, so a double click or a retry moves money once."""

    token = forms.CharField(widget=forms.HiddenInput)

    def clean_token(self) -> str:
        token = self.cleaned_data["token"]
        if not TOKEN.match(token):
            raise ValidationError(_("The form has expired: open the page again."))
        return token


class TopUpForm(OnceForm):
    """A top-up, refund or adjustment of one account. `token` is the form's one-time
    idempotency key: the same form sent twice posts once."""

    kind = forms.ChoiceField(
        label=gettext_lazy("Kind"),
        choices=[(k.value, k.label) for k in TOPUP_KINDS],
    )
    amount = forms.DecimalField(
        label=gettext_lazy("Amount"),
        max_digits=9,
        decimal_places=2,
        help_text=gettext_lazy(
            "To the cent. Top-ups and refunds add money; an adjustment may be negative "
            "(it takes money off)."
        ),
        error_messages={
            "invalid": gettext_lazy("Give an amount such as 100 or 12.50."),
            "max_decimal_places": gettext_lazy("Give the amount to the cent at most."),
            "max_digits": gettext_lazy("Give an amount up to 1,000,000.00."),
            "max_whole_digits": gettext_lazy("Give an amount up to 1,000,000.00."),
        },
    )
    memo = forms.CharField(
        label=gettext_lazy("Reason"),
        max_length=300,
        help_text=gettext_lazy(
            "Kept with the entry and shown on the researcher's bill, e.g. invoice 2026-117."
        ),
        error_messages={"required": gettext_lazy("Say why: the reason is kept with the entry.")},
    )

    def clean_memo(self) -> str:
        memo = self.cleaned_data["memo"].strip()
        if not memo:
            raise ValidationError(_("Say why: the reason is kept with the entry."))
        return memo

    def clean(self):
        data = super().clean()
        kind, amount = data.get("kind"), data.get("amount")
        if kind is None or amount is None:
            return data
        if abs(amount) > MOST:
            self.add_error(
                "amount",
                _("One entry moves at most %(most)s; post several for more.")
                % {"most": f"{MOST:,}"},
            )
        elif kind == LedgerEntry.Kind.ADJUSTMENT and amount == 0:
            self.add_error("amount", _("An adjustment of 0 changes nothing."))
        elif kind != LedgerEntry.Kind.ADJUSTMENT and amount <= 0:
            self.add_error(
                "amount",
                _("A top-up or a refund adds money: give a positive amount. To take money "
                  "off, post an adjustment with a negative amount."),
            )  # fmt: skip
        return data


def _may_post(user) -> bool:
    return bool(user.is_staff and user.has_perm(POST_ENTRIES))


def _find_accounts(query: str):
    """Accounts whose researcher's name, full name or e-mail holds `query` (any case)."""
    words = Q(user__username__icontains=query) | Q(user__email__icontains=query)
    words |= Q(user__first_name__icontains=query) | Q(user__last_name__icontains=query)
    words |= Q(user__team__name__icontains=query)  # a team's account, by the team's name
    found = Account.objects.select_related("user__team").filter(words)
    return found.order_by("user__username")[:20]


def _recent_lines(account: Account, n: int = 20) -> list[BillLine]:
    lines = list(
        BillLine.objects.filter(account=account)
        .select_related("cluster__instance_type", "gpu_model", "entry")
        .order_by("-at", "-id")[:n]
    )
    return money.balances_after(account.user, lines)


@login_required
def ops_topup(request):
    """Find an account by name or e-mail, see its balance and newest lines, and post a
    top-up, refund or adjustment with its reason. Staff holding billing.post_ledgerentry
    only: anyone else signed in gets 403 (staff status alone grants nothing)."""
    if not _may_post(request.user):
        raise PermissionDenied(_("Posting ledger entries needs billing.post_ledgerentry."))
    ledger.accounts_ensure()  # users made in the admin or by createsuperuser can be found
    query = request.GET.get("q", "").strip()[:100]
    account = None
    if request.method == "POST" or request.GET.get("account"):
        raw = request.POST.get("account") or request.GET.get("account", "")
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):  # "²".isdigit()
            raise Http404("No such account.")
        account = get_object_or_404(Account.objects.select_related("user__team"), pk=int(raw))
    form = TopUpForm(initial={"token": uuid.uuid4().hex, "kind": LedgerEntry.Kind.TOPUP})
    status = 200
    if request.method == "POST":
        form = TopUpForm(request.POST)
        if form.is_valid():
            posted = _post(request, account, form.cleaned_data)
            if posted:
                return redirect(reverse("ops_topup") + f"?account={account.pk}")
        status = 400
    currency = RateBook.load().currency
    return render(
        request,
        "console/ops_topup.html",
        {
            "query": query,
            "found": _find_accounts(query) if query else None,
            "account": account,
            "lines": _recent_lines(account) if account else [],
            "form": form,
            "currency": currency,
            "zone": _zone(),
        },
        status=status,
    )


def _post(request, account: Account, data: dict) -> bool:
    key = f"op:{data['token']}"
    replay = LedgerEntry.objects.filter(key=key).exists()
    try:
        entry = ledger.post_entry(
            account=account, kind=data["kind"], amount=data["amount"], key=key,
            by=request.user, memo=data["memo"],
        )  # fmt: skip
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return False
    if replay:
        messages.info(request, _("This form was already sent: it was posted once, not again."))
    else:
        messages.success(
            request,
            _("%(kind)s of %(amount)s for %(who)s: balance now %(balance)s.")
            % {
                "kind": entry.get_kind_display(),
                "amount": formatting.total(entry.amount),
                "who": account.holder,
                "balance": formatting.total(entry.balance_after),
            },
        )
    return True


# -- a team's money ----------------------------------------------------------------------------


class TransferForm(OnceForm):
    """Money from the person's own balance into the team they act for. `token` is the
    form's one-time idempotency key: the same form sent twice moves the money once."""

    amount = forms.DecimalField(
        label=gettext_lazy("Amount"), max_digits=9, decimal_places=2, min_value=Decimal("0.01"),
        error_messages={
            "invalid": gettext_lazy("Give an amount such as 100 or 12.50."),
            "min_value": gettext_lazy("Give an amount above 0, such as 100 or 12.50."),
            "max_decimal_places": gettext_lazy("Give the amount to the cent at most."),
            "max_digits": gettext_lazy("Give an amount up to 1,000,000.00."),
            "max_whole_digits": gettext_lazy("Give an amount up to 1,000,000.00."),
        },
    )  # fmt: skip


def _transfer_form() -> TransferForm:
    return TransferForm(initial={"token": uuid.uuid4().hex})


def _team_money(request, actor, form: TransferForm | None = None) -> dict:
    """The team's figures this month (the operator's calendar month) for its billing page:
    per member (spent, cap, what is left, GPUs held), per cluster and per day; for its
    owner all of them, for anyone else their own. The transfer form and the person's own
    balance go with them."""
    principal = actor.principal
    account_id = money.account_id_of(principal)
    mine = None if actor.at_least(Role.OWNER) else actor.person.pk
    return {
        "team": actor.team,
        # The operator's calendar month, named in the operator's zone (the reader's may differ).
        "month": caps.month_start().astimezone(caps.operator_zone()).date(),
        "zone": caps.zone_label(),
        "members": caps.member_rows(actor.team, account_id, only=mine),
        "clusters": caps.per_cluster(account_id, member_id=mine),
        "days": caps.per_day(account_id, member_id=mine),
        "sees_balance": actor.at_least(Role.ADMIN),
        "own_balance": money.balance_of(actor.person),
        "form": form or _transfer_form(),
    }


def _team_member_billing(request, actor, *, form: TransferForm | None = None, status: int = 200):
    """An admin's, member's or viewer's billing page in a team: their own spending this
    month and what is left of their cap (admins also the team's balance), and the form
    that gives the team money of their own."""
    standing = money.standing(actor.principal)
    return render(
        request,
        "console/billing_team.html",
        {
            "standing": standing,
            "team_money": _team_money(request, actor, form),
            # How good the projections of their own jobs were (on the clusters they made).
            "accuracy": projection_panel.accuracy_panel(actor.principal, member_id=actor.person.pk),
        },
        status=status,
    )


@login_required
def billing_transfer(request):
    """POST: move money from the person's own balance into the team they act for (any
    member, viewers too). A form sent twice moves it once."""
    if request.method != "POST":
        return redirect("billing")
    actor = request.actor
    if not actor.for_a_team:
        raise Http404("Act for a team to give it money.")
    form = TransferForm(request.POST)
    if form.is_valid():
        key = form.cleaned_data["token"]
        replay = LedgerEntry.objects.filter(key=ledger.transfer_key(key)[0]).exists()
        try:
            out, _in = ledger.transfer_to_team(
                person=actor.person, team=actor.team, amount=form.cleaned_data["amount"], key=key
            )
        except ValidationError as exc:
            form.add_error("amount", exc)
        else:
            if replay:
                messages.info(request, _("This form was already sent: the money moved once."))
            else:
                messages.success(
                    request,
                    _("%(amount)s moved into %(team)s. Your own balance is now %(balance)s.")
                    % {
                        "amount": formatting.total(-out.amount),
                        "team": actor.team.name,
                        "balance": formatting.total(out.balance_after),
                    },  # fmt: skip
                )
            return redirect("billing")
    if actor.at_least(Role.OWNER):
        messages.error(request, " ".join(e for errs in form.errors.values() for e in errs))
        return redirect("billing")
    return _team_member_billing(request, actor, form=form, status=400)

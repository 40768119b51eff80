"""A team member's caps (docs/user/teams.md, "Money"): what they may spend in a calendar
month and how many GPUs their clusters may hold at once, both set by the team's owner
(`TeamMember.monthly_cap`, `gpu_cap`). The one rule, read by every place that rents
(console.forms.check_funds and start_refusal: cluster create, start, resize; pools,
sweeps and jobs through them; billing.storage.quota_set) and by the accrual's stop at the
cap (`billing.accrual.stop_capped`).

A member's spending is the team's usage charged to them (`BillLine.member`, written with
the ledger by the accrual from `Cluster.created_by`): their clusters' GPU, no-GPU and
kept-workspace time, pool clusters included (their pool's maker's). The team's storage is
the team's, no member's. The month is the operator's calendar month
(settings.TIME_ZONE).

Layer: billing (reads jobs' models; console calls it).
"""

from __future__ import annotations

import zoneinfo
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal

from django.conf import settings
from django.db.models import F, Q, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone
from django.utils.translation import gettext as _

from billing import formatting
from billing.models import BillLine, LedgerEntry
from billing.pricing import RateBook
from billing.selectors import account_id_of, month_bounds
from jobs.models import Cluster, Team, TeamMember

ZERO = Decimal("0")
# Clusters that hold GPUs, or will without anyone asking again: waiting to be placed (a
# stopped one waiting to start again too), running, being preempted.
HOLDING = (Cluster.State.PENDING, Cluster.State.RUNNING, Cluster.State.PREEMPTING)


def operator_zone():
    return zoneinfo.ZoneInfo(settings.TIME_ZONE)


def zone_label() -> str:
    """The operator's zone as the pages name it: "UTC+08:00", "UTC"."""
    with timezone.override(operator_zone()):
        return formatting.zone()


def month_start(now: datetime | None = None) -> datetime:
    """The first instant of this calendar month in the operator's zone."""
    local = (now or timezone.now()).astimezone(operator_zone())
    return month_bounds(local.year, local.month, operator_zone())[0]


def month_usage(*, now: datetime | None = None):
    """This month's usage lines (negative amounts), unordered: the one place a member's
    month spending is read from (their caps, the accrual's stop, the team's billing page),
    narrowed by the caller; served by the index (account, member, at)."""
    return BillLine.objects.filter(at__gte=month_start(now), kind=LedgerEntry.Kind.USAGE).order_by()


def spent(account_id: int | None, member_id: int, *, now: datetime | None = None) -> Decimal:
    """What the team's account was charged for `member_id` this month (positive)."""
    if account_id is None:
        return ZERO
    total = (
        month_usage(now=now)
        .filter(account_id=account_id, member_id=member_id)
        .aggregate(s=Sum("amount"))["s"]
    )
    return -(total or ZERO)


def spent_by_member(account_id: int | None, *, now: datetime | None = None) -> dict[int, Decimal]:
    """member id -> what they were charged this month (positive), for one team's account."""
    if account_id is None:
        return {}
    rows = (
        month_usage(now=now)
        .filter(account_id=account_id, member__isnull=False)
        .values("member_id")
        .annotate(s=Sum("amount"))
    )
    return {row["member_id"]: -row["s"] for row in rows}


def holding(principal_id: int):
    """The team's clusters that hold GPUs (or will without anyone asking again): the one
    place GPUs held are counted from (a member's GPU cap, a pool's room, the billing page)."""
    return Cluster.objects.filter(
        owner_id=principal_id, state__in=HOLDING, no_gpu=False, gpu_model__isnull=False
    ).order_by()


def gpus_held(principal_id: int, person_id: int, *, besides: int | None = None) -> int:
    """GPUs held (or about to be) by the clusters `person_id` made in the team, but
    `besides` (a cluster being started or resized: its new size is the ask)."""
    clusters = holding(principal_id).filter(created_by_id=person_id)
    if besides is not None:
        clusters = clusters.exclude(pk=besides)
    return sum(n * g for n, g in clusters.values_list("nodes", "gpus_per_node"))


def gpu_room(principal_id: int, person_id: int | None) -> int | None:
    """The GPUs `person_id`'s GPU cap in the team of `principal_id` still leaves (never
    below 0); None: no cap (or not a team member). A team pool's clusters are its maker's,
    so its autoscaler adds none past this (console.pools.refresh)."""
    member = membership(principal_id, person_id)
    if member is None or member.gpu_cap is None:
        return None
    return max(member.gpu_cap - gpus_held(principal_id, member.person_id), 0)


@dataclass(frozen=True)
class Caps:
    """One member's caps and where they stand this month."""

    member: TeamMember
    spent: Decimal
    currency: str

    @property
    def monthly(self) -> Decimal | None:
        return self.member.monthly_cap

    @property
    def left(self) -> Decimal | None:
        """What is left of the monthly cap (never below 0); None: no cap."""
        if self.monthly is None:
            return None
        return max(self.monthly - self.spent, ZERO)

    def money(self, value: Decimal) -> str:
        return formatting.total_text(value, self.currency)


def own_account(principal_id: int, person_id: int | None) -> bool:
    """Whether `person_id` (None: nobody's) acts on their own account, not in a team of
    `principal_id`: no member's caps apply (`membership` is None, read without a query)."""
    return person_id is None or person_id == principal_id


def membership(principal_id: int, person_id: int | None) -> TeamMember | None:
    """`person_id`'s membership in the team whose principal is `principal_id` (None for a
    researcher's own account, or someone no longer in the team)."""
    if own_account(principal_id, person_id):
        return None
    return (
        TeamMember.objects.filter(team__principal_id=principal_id, person_id=person_id)
        .select_related("team", "person")
        .first()
    )


def caps_of(member: TeamMember, *, now: datetime | None = None) -> Caps:
    account_id = account_id_of(member.team.principal_id)
    return Caps(member, spent(account_id, member.person_id, now=now), RateBook.load().currency)


def cap_refusal(
    *, principal, person, per_hour: Decimal, gpus: int = 0, besides=None, by=None
) -> str:
    """Why `person`'s caps in the team of `principal` refuse a request ("" when they do
    not): the monthly cap is passed when this month's spending plus the request's first
    SUANLI_MIN_BALANCE_MINUTES at `per_hour` (the balance check's look-ahead) exceeds it;
    the GPU cap when the GPUs held plus `gpus` exceed it. `besides`: the cluster being
    started or resized (its GPUs are the ask, not held). `by`: who asks (default
    `person`); when it is someone else (a teammate starting a cluster another made, whose
    budget it is charged to), the words name whose caps they are."""
    member = membership(principal.pk, getattr(person, "pk", None))
    if member is None or (member.monthly_cap is None and member.gpu_cap is None):
        return ""
    theirs = by is not None and by.pk != member.person_id
    words = {"team": member.team.name, "login": member.person.username}
    if member.gpu_cap is not None and gpus > 0:
        held = gpus_held(principal.pk, member.person_id, besides=besides)
        if held + gpus > member.gpu_cap:
            return _gpu_words(theirs) % {
                **words, "held": held, "cap": member.gpu_cap, "asked": gpus,
            }  # fmt: skip
    if member.monthly_cap is None:
        return ""
    caps = caps_of(member)
    minutes = settings.SUANLI_MIN_BALANCE_MINUTES
    ahead = per_hour * minutes / 60
    if caps.spent + ahead <= member.monthly_cap:
        return ""
    return _budget_words(theirs) % {
        **words, "spent": caps.money(caps.spent), "cap": caps.money(member.monthly_cap),
        "needed": formatting.text(formatting.amount(ahead), caps.currency), "minutes": minutes,
    }  # fmt: skip


def _gpu_words(theirs: bool) -> str:
    if theirs:
        return _(
            "Past %(login)s's GPU cap in %(team)s: GPUs held %(held)s / cap %(cap)s, and this "
            "asks for %(asked)s. Ask the team's owner to raise their cap."
        )
    return _(
        "Past your GPU cap in %(team)s: GPUs held %(held)s / cap %(cap)s, and this "
        "asks for %(asked)s. Ask the team's owner to raise your cap."
    )


def _budget_words(theirs: bool) -> str:
    if theirs:
        return _(
            "Past %(login)s's monthly budget in %(team)s: spent this month %(spent)s / cap "
            "%(cap)s, and this needs %(needed)s for its first %(minutes)s minutes. Ask the "
            "team's owner to raise their budget."
        )
    return _(
        "Past your monthly budget in %(team)s: spent this month %(spent)s / cap %(cap)s, "
        "and this needs %(needed)s for its first %(minutes)s minutes. Ask the team's owner "
        "to raise your budget."
    )


def money_left(principal_id: int, person_id: int | None) -> Decimal | None:
    """What is left of `person_id`'s monthly cap in the team of `principal_id` (never below
    0); None: no cap (or not a team member)."""
    member = membership(principal_id, person_id)
    if member is None or member.monthly_cap is None:
        return None
    return caps_of(member).left


def pool_refusal(pool, *, by=None) -> str:
    """Why the caps of the pool's maker (whose budget its clusters are charged to) refuse
    one more cluster of it: a sweep on it, or a job that needs a cluster added. `by`: who
    submits (the words name the maker's caps when it is someone else)."""
    return cap_refusal(
        principal=pool.owner, person=pool.created_by, per_hour=pool.rate_per_hour or ZERO,
        gpus=pool.total_gpus, by=by,
    )  # fmt: skip


def submitter_refusal(pool, person) -> str:
    """Why `person`'s own caps refuse the work they submit to a team's pool (a job, a
    sweep): its clusters are charged to the pool's maker's budget, yet the submitter must be
    within their own monthly budget, else a member whose budget is spent (or capped at 0)
    would run on a teammate's pool and dodge their cap. The look-ahead is one of the pool's
    clusters at its price; no GPUs are asked (the pool's clusters hold its maker's)."""
    return cap_refusal(
        principal=pool.owner, person=person, per_hour=pool.rate_per_hour or ZERO, gpus=0
    )


def capped_members(account_ids, *, now: datetime | None = None) -> list[tuple[TeamMember, Decimal]]:
    """The members of these (team) accounts whose spending this month reached their
    monthly cap, with what they spent: the accrual stops their clusters."""
    members = list(
        TeamMember.objects.filter(
            team__principal__account__in=list(account_ids), monthly_cap__isnull=False
        ).select_related("team", "person")
    )
    if not members:
        return []
    pairs = Q()
    for m in members:
        pairs |= Q(account__user_id=m.team.principal_id, member_id=m.person_id)
    sums = {
        (row["account__user_id"], row["member_id"]): -row["s"]
        for row in month_usage(now=now)
        .filter(pairs)
        .values("account__user_id", "member_id")
        .annotate(s=Sum("amount"))
    }
    out = []
    for m in members:
        used = sums.get((m.team.principal_id, m.person_id), ZERO)
        if used >= m.monthly_cap:
            out.append((m, used))
    return out


# -- the team's billing page ----------------------------------------------------------------


@dataclass(frozen=True)
class MemberRow:
    member: TeamMember
    spent: Decimal
    gpus: int  # held now by the clusters they made in the team

    @property
    def left(self) -> Decimal | None:
        cap = self.member.monthly_cap
        return None if cap is None else max(cap - self.spent, ZERO)

    @property
    def over(self) -> bool:
        cap = self.member.monthly_cap
        return cap is not None and self.spent >= cap


def member_rows(team: Team, account_id: int | None, *, only: int | None = None) -> list[MemberRow]:
    """Each member (or `only` that person) with what they spent this month and the GPUs
    their clusters hold: three queries whatever the team's size."""
    spent_of = spent_by_member(account_id)
    held = dict(
        holding(team.principal_id)
        .values("created_by_id")
        .annotate(gpus=Sum(F("nodes") * F("gpus_per_node")))
        .values_list("created_by_id", "gpus")
    )
    members = team.memberships.select_related("person").order_by("person__username")
    if only is not None:
        members = members.filter(person_id=only)
    return [
        MemberRow(m, spent_of.get(m.person_id, ZERO), held.get(m.person_id) or 0) for m in members
    ]


def _month_lines(account_id: int | None, member_id: int | None):
    lines = month_usage().filter(account_id=account_id)
    if member_id is not None:
        lines = lines.filter(member_id=member_id)
    return lines


def per_cluster(account_id: int | None, *, member_id: int | None = None, most: int = 50) -> list:
    """This month's usage per cluster and member (storage: no cluster, no member), the
    costliest first: dicts of cluster_id, cluster__name, member__username, cost."""
    rows = (
        _month_lines(account_id, member_id)
        .values("cluster_id", "cluster__name", "member__username")
        .annotate(cost=Sum("amount"))
        .order_by("cost", "cluster_id")[:most]
    )
    return [{**row, "cost": formatting.amount(-row["cost"])} for row in rows]


def per_day(account_id: int | None, *, member_id: int | None = None) -> list[dict]:
    """This month's usage per day (in the operator's zone, as the month) and member,
    newest day first: dicts of day, total and members [(login, cost)]."""
    rows = (
        _month_lines(account_id, member_id)
        .annotate(day=TruncDate("at", tzinfo=operator_zone()))
        .values("day", "member__username")
        .annotate(cost=Sum("amount"))
    )
    days: dict = {}
    for row in rows:
        day = days.setdefault(row["day"], {"day": row["day"], "total": ZERO, "members": []})
        cost = -row["cost"]
        day["total"] += cost
        day["members"].append((row["member__username"] or "", formatting.amount(cost)))
    out = sorted(days.values(), key=lambda d: d["day"], reverse=True)
    for day in out:
        day["total"] = formatting.amount(day["total"])
        day["members"].sort()
    return out

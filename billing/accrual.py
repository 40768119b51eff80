"""The accrual tick: every few seconds (console/cron.py, `billing.tasks.accrue`), each open
meter charges its cluster's held capacity from where it was billed up to now, by the second
(GPU time, no-GPU time, kept workspaces; a minimum charge per placement), in batches of
clusters under their accounts' row locks; released clusters are settled up to their release
second. An account that runs out has its charging clusters stopped, their files kept
(`stop_exhausted`), and billed up to that second in the same tick; kept workspaces are not
charged while the balance is at or below 0 (the retention period keeps them).

Billing observes the jobs app's tables (clusters and their nodes' started/released seconds,
whether a node ran without GPUs, how long a stopped node's workspace was kept); the one
call the other way is the stop for an exhausted balance, through
`jobs.clusters.services.cluster_stop` (and its `balance.exhausted` event). The ledger verbs (an operator's entry, an account)
are in `billing.services`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from typing import NamedTuple

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Case, Exists, F, OuterRef, Q, Value, When
from django.utils import timezone
from django.utils.translation import gettext_noop

from billing import budgets, caps, formatting, rollups
from billing.models import Account, LedgerEntry, Meter
from billing.pricing import (
    GPU,
    KINDS,
    NO_GPU,
    STOPPED,
    RateBook,
    charged_at,
    kind_of_key,
    to_money,
)
from billing.services import epoch, floor_s
from jobs.base.sql import AnyOf, insert_rows, update_rows
from jobs.base.text import Moment, Text
from jobs.clusters import services as cluster_services
from jobs.events import webhooks
from jobs.models import Cluster, Job, Node, Pool, TeamMember

try:  # PostgreSQL's driver: absent where only SQLite is used
    from psycopg import adapters as psycopg_adapters
    from psycopg.postgres import types as psycopg_types
    from psycopg.pq import Format as PqFormat
except ImportError:  # pragma: no cover
    psycopg_adapters = psycopg_types = PqFormat = None

log = logging.getLogger(__name__)

# Stored as the stopped (or released) clusters' reason (English; translated where shown).
EXHAUSTED = gettext_noop("stopped: balance exhausted")
CAPPED = gettext_noop("stopped: %(who)s reached their monthly budget")

# The ends of a node's billing, whichever comes first.
_ENDS = ("preempted_at", "lost_at", "released_at")


def billing_start(
    workspace: bool,
    started: datetime | None,
    placed: datetime,
    ends,
    now: datetime,
    *,
    waited: bool = False,
    failed: bool = False,
) -> datetime | None:
    """The second a node's billing starts, or None (not yet, or never): the second it
    started running; but a node of a cluster without workspaces (its first job starts it)
    that held its GPUs `SUANLI_START_GRACE_S` without starting, up to now or to its end,
    is charged from its placement, so that GPUs held idle are never free. A workspace
    node is charged only from its start (its pull is ours: one that never starts fails,
    `jobs.runs.repair`).

    `waited`: a job of its cluster was submitted before placement + grace (and, for a
    node not started, has not ended): its replica's pull is not idle holding, so the node
    is charged from its start only, however long the pull took. `failed`: its cluster
    failed without any node of it ever running (`workspaces.fail_never_ran`, "nothing was
    charged"): never charged."""
    if failed:
        return None
    grace = timedelta(seconds=settings.SUANLI_START_GRACE_S)
    if started is not None and (workspace or waited or started < placed + grace):
        return started
    if workspace or waited:
        return None
    end = min((t for t in ends if t is not None), default=now)
    return placed if end >= placed + grace else started


def _start_flags(grace: timedelta) -> dict:
    """Per node row, what `billing_start` needs besides its own seconds: `submitted`
    (a job of its cluster was submitted before its placement + grace), `waiting` (one such
    job has not ended) and `failed` (its cluster failed with no node of it ever run)."""
    early = Job.objects.filter(
        cluster_id=OuterRef("cluster_id"), created_at__lt=OuterRef("placed_at") + grace
    )
    ran = Node.objects.filter(cluster_id=OuterRef("cluster_id"), started_at__isnull=False)
    # Each subquery only where `_start_of` reads it (a node seen started at or past its
    # grace; a node not started), so that the tick's node read of thousands of running
    # nodes, started within their grace, probes no job.
    late = Q(started_at__isnull=False, started_at__gte=F("placed_at") + grace)
    return {
        "submitted": Case(When(late, then=Exists(early)), default=Value(False)),
        "waiting": Case(
            When(started_at__isnull=True, then=Exists(early.filter(finished_at__isnull=True))),
            default=Value(False),
        ),
        "failed": Q(cluster__state=Cluster.State.FAILED) & ~Exists(ran),
    }


def _start_of(row, now: datetime) -> datetime | None:
    """`billing_start` of a row (workspace, started, placed, submitted, waiting, failed,
    *ends) read with `_start_flags`."""
    workspace, started, placed, submitted, waiting, failed, *ends = row
    waited = submitted if started is not None else waiting
    return billing_start(workspace, started, placed, ends, now, waited=waited, failed=failed)


@dataclass
class AccrualReport:
    now: datetime
    clusters: int = 0
    entries: int = 0
    charged: Decimal = Decimal("0")
    settled: int = 0
    exhausted: list[int] = field(default_factory=list)
    charged_accounts: set[int] = field(default_factory=set)  # a member's cap is judged


def open_meters(now: datetime) -> int:
    """A meter for every cluster that has run and has none yet; it starts at the second
    its first node started running (`Node.started_at`: its workspace, or its first job
    replica), or, for a node of a cluster without workspaces held `SUANLI_START_GRACE_S`
    without a job, at its placement (`billing_start`; a job submitted within the grace
    holds it at its start, however long that job's image pulls). A cluster whose nodes
    were placed but never ran (its image could not be pulled, its workspace not started)
    has no meter: nothing is charged for it."""
    grace = timedelta(seconds=settings.SUANLI_START_GRACE_S)
    held_past = Q(cluster__workspace=False, started_at=None, placed_at__lte=now - grace)
    for end in _ENDS:  # each end, if any, past placement + grace (else never charged)
        held_past &= Q(**{f"{end}__isnull": True}) | Q(**{f"{end}__gte": F("placed_at") + grace})
    rows = (
        Node.objects.filter(Q(started_at__isnull=False) | held_past, cluster__meter__isnull=True)
        .annotate(**_start_flags(grace))
        .values_list(
            "cluster_id", "cluster__owner_id", "cluster__workspace", "started_at", "placed_at",
            "submitted", "waiting", "failed", *_ENDS,
        )
    )  # fmt: skip
    firsts: dict[int, tuple[int, datetime]] = {}
    for cluster_id, owner_id, *row in rows:
        start = _start_of(row, now)
        if start is not None and (cluster_id not in firsts or start < firsts[cluster_id][1]):
            firsts[cluster_id] = (owner_id, start)
    fresh = [{"pk": pk, "owner_id": o, "first": t} for pk, (o, t) in firsts.items()]
    if not fresh:
        return 0
    owners = {row["owner_id"] for row in fresh}
    Account.objects.bulk_create(
        [Account(user_id=o) for o in owners], ignore_conflicts=True, batch_size=2000
    )
    accounts = dict(Account.objects.filter(user_id__in=owners).values_list("user_id", "pk"))
    Meter.objects.bulk_create(
        [
            Meter(
                cluster_id=row["pk"],
                account_id=accounts[row["owner_id"]],
                billed_until=floor_s(row["first"]),
            )
            for row in fresh
        ],
        ignore_conflicts=True,  # another tick made it meanwhile: same start either way
        batch_size=2000,
    )
    return len(fresh)


def accrue(*, now: datetime | None = None, batch: int = 2000) -> AccrualReport:
    """Charge every open meter from where it was billed up to `now` (whole seconds), and
    settle released clusters up to their release second. Safe to run twice, or twice at
    once: each meter is read under its row lock and moves forward only."""
    now = floor_s(now or timezone.now())
    report = AccrualReport(now=now)
    open_meters(now)
    book = RateBook.load()
    ids = list(
        Meter.objects.filter(settled=False)
        .order_by("account_id", "cluster_id")
        .values_list("cluster_id", flat=True)
    )
    for start in range(0, len(ids), batch):
        _accrue_batch(ids[start : start + batch], now, book, report)
    if report.exhausted:
        stop_exhausted(report.exhausted, report)
    if report.charged_accounts:
        stop_capped(report.charged_accounts, report)
    stop_budgeted(report)
    return report


def stop_budgeted(report: AccrualReport) -> list[int]:
    """The budgets' watch (billing/budgets.py) after the tick's charges: jobs, clusters and
    sweeps that reached their budget are stopped; the clusters stopped are billed up to the
    second they stopped in this same tick, as `stop_capped`'s are."""
    stopped = budgets.enforce(now=report.now)["clusters"]
    if stopped:
        later = floor_s(timezone.now())
        _accrue_batch(stopped, later, RateBook.load(), report)
    return stopped


class Interval(NamedTuple):
    """A stretch of one node's time of one kind: from `start` to `end` (None: open)."""

    start: datetime
    end: datetime | None
    units: int  # GPUs (or 1 CPU-only instance) for GPU time; 1 (the node) for the others
    kind: str  # pricing.GPU, NO_GPU or STOPPED


def _nodes_of(units: dict[int, int], now: datetime) -> dict[int, list[Interval]]:
    """cluster id -> its nodes' intervals for the clusters in `units` (cluster id -> units a
    node holds: its GPUs, or 1 for a CPU-only instance).

    A node is GPU time (no-GPU time when it was started without GPUs: one unit, the node)
    from the second it started running (`Node.started_at`, not its placement: the time
    its image took to pull is not charged; but see `billing_start` for a cluster without
    workspaces held idle) to its end; a node that never ran is no time at all, nor is its stop (it kept no workspace). A preempted node's billing ends at
    its preemption notice, not when its GPUs came back; a node on a host that went down,
    at the second the host was seen down (it is placed again, as a new node, when the
    host is back or it moves; billed again once its workspace runs there). A node that
    ended with a stop of its cluster adds its kept workspace: stopped time, one unit,
    from the stop until it stopped being kept (open while kept)."""
    out: dict[int, list[Interval]] = {}
    grace = timedelta(seconds=settings.SUANLI_START_GRACE_S)
    rows = (
        Node.objects.filter(AnyOf(F("cluster_id"), list(units)))
        .order_by()  # any order (not Node's: a sort by its cluster's creation)
        .annotate(**_start_flags(grace))
        .values_list(
            "cluster_id", "no_gpu", "stopped_at", "kept_until", "cluster__workspace",
            "started_at", "placed_at", *_ENDS, "submitted", "waiting", "failed",
        )
    )  # fmt: skip
    for (
        cluster_id,
        no_gpu,
        stopped,
        kept_until,
        workspace,
        start,
        placed,
        *ends,
        s,
        w,
        f,
    ) in _tuples(rows):
        held = out.setdefault(cluster_id, [])
        started = _start_of((workspace, start, placed, s, w, f, *ends), now)
        if started is None:
            continue  # never ran (nor held idle past the grace): never charged
        released = min((t for t in ends if t is not None), default=None)
        if released is not None and released < started:
            released = started  # ended (a notice, a lost host) before its start was seen
        held.append(
            Interval(
                floor_s(started),
                floor_s(released) if released else None,
                1 if no_gpu else units[cluster_id],
                NO_GPU if no_gpu else GPU,
            )
        )
        if stopped is not None:
            held.append(
                Interval(floor_s(stopped), floor_s(kept_until) if kept_until else None, 1, STOPPED)
            )
    return out


# psycopg's own loader of timestamptz (in C where psycopg-binary is installed).
_TIMESTAMPTZ = psycopg_adapters.get_loader(
    psycopg_types["timestamptz"].oid, PqFormat.TEXT
) if psycopg_adapters else None  # fmt: skip


def _tuples(queryset) -> list[tuple]:
    """The rows of a `values_list` queryset (its fields first, then its annotations: the
    order Django selects them) as plain tuples. On PostgreSQL its timestamps are read by
    psycopg's own loader: the same aware datetimes in UTC (the session's time zone, which
    Django sets) as Django's loader gives, which wraps psycopg's pure-Python one (a few
    microseconds a value: 30,000 of them a tick over 10,000 clusters)."""
    if connection.vendor != "postgresql" or _TIMESTAMPTZ is None:
        return list(queryset)
    sql, params = queryset.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.cursor.adapters.register_loader("timestamptz", _TIMESTAMPTZ)
        cursor.execute(sql, params)
        return cursor.fetchall()


@dataclass
class _Segment:
    start: datetime
    end: datetime
    units: int
    rate: Decimal | None
    kind: str = GPU


def segments(
    *, nodes: list[Interval], since: datetime, until: datetime, book: RateBook, cluster
) -> list[_Segment]:
    """Split (since, until] per kind of time, and within a kind wherever the number of units
    held or the price changes. Each kind is split by its own intervals only, so a cluster
    that only ever held GPUs gets the very segments (and ledger keys) it always got."""
    out: list[_Segment] = []
    for kind in KINDS:
        of_kind = [n for n in nodes if n.kind == kind]
        if of_kind:
            out += _segments_of(kind, of_kind, since, until, book, cluster)
    out.sort(key=lambda s: (s.start, KINDS.index(s.kind)))
    return out


def _segments_of(kind, nodes, since, until, book: RateBook, cluster) -> list[_Segment]:
    points = {since, until}
    for placed, released, _units, _kind in nodes:
        for t in (placed, released):
            if t is not None and since < t < until:
                points.add(t)
    points.update(book.changes_between(since, until))
    ordered = sorted(points)
    out: list[_Segment] = []
    for a, b in zip(ordered, ordered[1:], strict=False):
        units = sum(
            u
            for placed, released, u, _kind in nodes
            if placed <= a and (released is None or released >= b)
        )
        card = book.at(a)
        rate = (
            card.rate_of(
                kind,
                gpu_model_id=cluster.gpu_model_id,
                instance_type_id=cluster.instance_type_id,
                spot=cluster.spot,
            )
            if card
            else None
        )
        if out and out[-1].units == units and out[-1].rate == rate and out[-1].end == a:
            out[-1].end = b
        else:
            out.append(_Segment(a, b, units, rate, kind))
    return [s for s in out if s.units]


@dataclass
class _Meter:
    """One open meter and the cluster facts accrual needs, read under the meter's lock
    (plain values: 10,000 of these cost a fraction of as many model instances)."""

    cluster_id: int
    account_id: int
    billed_until: datetime
    exact: Decimal
    charged: Decimal
    state: str
    gpu_model_id: int | None
    instance_type_id: int | None
    spot: bool
    nodes: int
    gpus_per_node: int
    owner_id: int
    created_by_id: int | None
    settled: bool = False

    FIELDS = (
        "cluster_id", "account_id", "billed_until", "exact", "charged", "cluster__state",
        "cluster__gpu_model_id", "cluster__instance_type_id", "cluster__spot",
        "cluster__nodes", "cluster__gpus_per_node", "cluster__owner_id", "cluster__created_by_id",
    )  # fmt: skip

    @property
    def member_id(self) -> int | None:
        """Whose budget its charges count against: a team cluster's maker (someone other
        than its owner, the team's principal); None for a researcher's own cluster."""
        made_by = self.created_by_id
        return made_by if made_by is not None and made_by != self.owner_id else None


@dataclass
class _Account:
    pk: int
    balance: Decimal
    exhausted_at: datetime | None
    charged: bool = False


# The columns accrual writes, in the order of the tuples `_entry` makes.
ENTRY_FIELDS = (
    "account", "kind", "amount", "balance_after", "key", "cluster", "period_from",
    "period_to", "units", "rate", "gpu_model", "memo", "created_at", "member",
)  # fmt: skip


def _accrue_batch(cluster_ids: list[int], now: datetime, book: RateBook, report) -> None:
    entries: list[tuple] = []
    with transaction.atomic():
        meters = [
            _Meter(*row)
            for row in _tuples(
                Meter.objects.select_for_update(of=("self",))
                .filter(AnyOf(F("cluster_id"), cluster_ids), settled=False)
                .order_by("cluster_id")
                .values_list(*_Meter.FIELDS)
            )
        ]
        if not meters:
            return
        nodes = _nodes_of({m.cluster_id: m.gpus_per_node or 1 for m in meters}, now)
        accounts = {
            row[0]: _Account(*row)
            for row in Account.objects.select_for_update()
            .filter(pk__in={m.account_id for m in meters})
            .order_by("pk")
            .values_list("pk", "balance", "exhausted_at")
        }
        written = timezone.now()
        for meter in meters:
            held = nodes.get(meter.cluster_id, [])
            # Settled only once every interval is closed, kept workspaces included: a
            # released cluster's kept time runs until its workspaces are gone.
            ended = meter.state in (Cluster.State.RELEASED, Cluster.State.FAILED) and all(
                i.end is not None for i in held
            )
            last = max((i.end for i in held if i.end is not None), default=None)
            until = min(now, last) if ended and last is not None else now
            account = accounts[meter.account_id]
            if until > meter.billed_until:
                for seg in segments(
                    nodes=held, since=meter.billed_until, until=until, book=book, cluster=meter
                ):
                    if not charged_at(seg.kind, account.balance):
                        continue  # kept through the retention period, not charged past 0
                    entry = _usage(meter, account, seg, written)
                    if entry is not None:
                        entries.append(entry)
                meter.billed_until = until
            if ended and meter.billed_until >= (last or meter.billed_until):
                minimum = _minimum_charge(meter, account, held, book, written)
                if minimum is not None:
                    entries.append(minimum)
                meter.settled = True
                report.settled += 1
        # A key charged before cannot recur (the meters moved past it in the same
        # transaction); were it to, the unique constraint rolls the whole batch back.
        insert_rows(LedgerEntry, ENTRY_FIELDS, entries)
        _roll_up(entries, meters)
        update_rows(
            Meter,
            "cluster",
            ["billed_until", "exact", "charged", "settled"],
            [(m.cluster_id, m.billed_until, m.exact, m.charged, m.settled) for m in meters],
        )
        changed = [a for a in accounts.values() if a.charged]
        report.charged_accounts.update(a.pk for a in changed)
        for account in changed:
            if account.balance <= 0:
                account.exhausted_at = account.exhausted_at or now
                report.exhausted.append(account.pk)
        update_rows(
            Account, "id", ["balance", "exhausted_at"],
            [(a.pk, a.balance, a.exhausted_at) for a in changed],
        )  # fmt: skip
    report.clusters += len(meters)
    report.entries += len(entries)
    report.charged += sum((-e[2] for e in entries), Decimal("0"))


# The memo of each kind's entries: it tells the lines apart on the bill (a bill line is
# one cluster-hour at one size, rate and memo) and says what the time was.
# Stored in English (the ledger, the bill and the CSV keep them); marked so that a page can
# show them translated.
MEMO = {NO_GPU: gettext_noop("no-GPU mode"), STOPPED: gettext_noop("stopped: workspaces kept")}
UNPRICED = gettext_noop("no price on the rate card: not charged")


def _usage(meter: _Meter, account: _Account, seg: _Segment, written) -> tuple | None:
    """The entry of one segment. GPU time keeps its key of old; the other kinds' keys end
    in their kind, so that no key can clash across kinds in one period.

    Free kept workspaces (a stopped price of 0) write nothing: a stopped cluster may be
    kept for weeks, and a bill of zero lines for it says nothing. No-GPU time at 0 is
    written as zero lines, as a GPU price of 0 is: the cluster ran (its workspaces held
    CPU and memory on the hosts), and the bill shows when and for how many nodes."""
    if seg.kind == STOPPED and not seg.rate:
        return None
    key = f"usage:{meter.cluster_id}:{epoch(seg.start)}:{epoch(seg.end)}"
    if seg.kind == GPU:
        memo = "" if seg.rate is not None else UNPRICED
    else:
        key, memo = f"{key}:{seg.kind}", MEMO[seg.kind]
    return _entry(
        meter, account, rate=seg.rate if seg.rate is not None else Decimal("0"),
        units=seg.units, seconds=int((seg.end - seg.start).total_seconds()), key=key,
        period=(seg.start, seg.end), written=written, memo=memo,
        gpu_model_id=meter.gpu_model_id if seg.kind == GPU else None,
    )  # fmt: skip


def _roll_up(entries: list[tuple], meters: list[_Meter]) -> None:
    """The bill's hour lines and daily usage for the pieces just written (same transaction):
    on PostgreSQL one statement folds them where they lie (`rollups.fold_entries`)."""
    if not entries:
        return
    if connection.vendor == "postgresql":
        rollups.fold_entries([e[4] for e in entries])
        return
    by_cluster = {m.cluster_id: m for m in meters}
    names = rollups.resource_names(
        gpu_model_ids={m.gpu_model_id for m in meters},
        instance_type_ids={m.instance_type_id for m in meters},
    )
    minimum = [e[4] for e in entries if e[6] is None]
    minimum_ids = dict(
        LedgerEntry.objects.filter(key__in=minimum).values_list("cluster_id", "pk")
    ) if minimum else {}  # fmt: skip
    pieces = []
    for account, _kind, amount, _after, key, cluster, *period_to_written, member in entries:
        meter = by_cluster[cluster]
        resource = rollups.resource_of(
            names, meter.gpu_model_id, meter.instance_type_id, kind=kind_of_key(key)
        )
        # (start, end, units, rate, gpu, memo, at): the order of Piece's fields after cluster
        pieces.append(rollups.Piece(account, amount, cluster, *period_to_written, resource, member))
    rollups.add_usage(pieces, minimum_entries=minimum_ids)


def _entry(
    meter: _Meter, account: _Account, *, rate, units, seconds, key, period, written, memo,
    gpu_model_id,
):  # fmt: skip
    """Charge `units x seconds` at `rate` per unit-hour: add it to the meter's exact cost
    (one for all kinds of time), charge the newly rounded total minus what was charged
    before, and return the row."""
    meter.exact += units * seconds * rate
    total = to_money(meter.exact)
    amount = total - meter.charged
    meter.charged = total
    account.balance -= amount
    account.charged = True
    return (
        account.pk, LedgerEntry.Kind.USAGE.value, -amount, account.balance, key,
        meter.cluster_id, period[0], period[1], units, rate, gpu_model_id, memo, written,
        meter.member_id,
    )  # fmt: skip


def _minimum_charge(meter: _Meter, account: _Account, held, book: RateBook, written):
    """The card's minimum for a short rental of GPUs (or CPU-only instances): it pays for
    placing the cluster's size on the fleet, so only the seconds it held them count, and at
    their price. No-GPU time and kept workspaces are charged per second at their own
    prices; they neither make a GPU rental long enough nor owe a GPU minimum themselves.
    The seconds used are those the cluster held GPUs (the union of its GPU intervals), what
    its GPU lines on the bill add up to."""
    gpu = sorted((i.start, i.end or meter.billed_until) for i in held if i.kind == GPU)
    if not gpu:
        return None
    start = gpu[0][0]
    card = book.at(start)
    if card is None or not card.min_charge_s:
        return None
    seconds, reach = 0, start
    for placed, released in gpu:
        a, b = max(placed, reach), min(released, meter.billed_until)
        if b > a:
            seconds += int((b - a).total_seconds())
            reach = b
    short = card.min_charge_s - seconds
    if short <= 0:
        return None
    rate = card.rate(
        gpu_model_id=meter.gpu_model_id, instance_type_id=meter.instance_type_id, spot=meter.spot
    )
    if not rate:
        return None
    return _entry(
        meter, account, rate=rate, units=max(meter.nodes, 1) * (meter.gpus_per_node or 1),
        seconds=short, key=f"minimum:{meter.cluster_id}", period=(None, None), written=written,
        memo=f"minimum charge: {card.min_charge_s} s, {seconds} s used",
        gpu_model_id=meter.gpu_model_id,
    )  # fmt: skip


# -- running out -----------------------------------------------------------------------------


def stop_exhausted(account_ids: list[int], report: AccrualReport | None = None) -> list[int]:
    """Stop every cluster of these accounts that would go on charging, then bill them up to
    the second they stopped (in this same tick, so the overdraft stays within one period).
    Returns the clusters stopped or released.

    Zero balance stops, it does not release: nothing of a researcher's is lost for money
    before the retention period (SUANLI_STOPPED_RELEASE_DAYS) is over. Per cluster:

    * running with workspaces (no-GPU mode too, spot or not): stopped as its owner's stop
      does (`cluster_stop`, past the most stopped clusters a researcher may keep), its
      GPUs freed, its workspaces kept with every file, root filesystem included; reason
      EXHAUSTED. A top-up lets its owner start it again; if nobody does, the stopped-period
      release ends it after the retention period, with its warning a day before;
    * waiting in line to start again: back to stopped, its files kept (`cluster_stop_waiting`);
    * anything else live keeps no file of its own and is released (cancelled): one for jobs
      only (a pool's clusters among them: their jobs' files are on volumes, which stay),
      one waiting to be placed that never ran (or a spot cluster preempted back into the
      queue, whose workspaces its preemption already ended), and a spot cluster being
      preempted (not charged from its notice; its workspaces go with the preemption). None
      of them cost anything from here, and none is placed and charged again after the
      balance ran out. The owner's pools get the balance at once, so that the autoscaler
      holds back ("top up") instead of adding clusters before the console's next refresh.

    Clusters already stopped stay stopped, priced or not: while the balance is at or
    below 0 their kept workspaces are not charged (`_accrue_batch`), so the ledger goes at
    most one accrual period negative and the files are kept through the retention period.

    Each account's stops and its `balance.exhausted` event are one transaction; the event
    is emitted once per exhaustion (`Account.exhausted_notified_at`, cleared by a top-up)."""
    book = RateBook.load()
    now = report.now if report else floor_s(timezone.now())
    ended: list[int] = []
    for pk in sorted(set(account_ids)):
        with transaction.atomic():
            account = Account.objects.select_related("user").get(pk=pk)
            # Its pools first: the autoscaler locks a pool, then its clusters (same order).
            Pool.objects.filter(owner_id=account.user_id).update(balance=account.balance)
            kept, released = _stop_clusters_of(account.user_id)
            ended += [c.pk for c in kept + released]
            _tell_exhausted(account, kept, released, book.currency, now)
    if ended:
        later = floor_s(timezone.now())
        _accrue_batch(ended, later, book, report or AccrualReport(now=later))
    log.warning("accounts %s exhausted: stopped or released clusters %s", account_ids, ended)
    return ended


def _stop_clusters_of(
    owner_id: int, *, reason: Text | None = None, created_by_id: int | None = None
) -> tuple[list[Cluster], list[Cluster]]:
    """`stop_exhausted`'s rule for one owner's live clusters (those `created_by_id` made in
    it, for a member at their cap): (kept, released)."""
    reason = reason or Text(EXHAUSTED)
    kept, released = [], []
    live = [Cluster.State.PENDING, Cluster.State.RUNNING, Cluster.State.PREEMPTING]
    clusters = Cluster.objects.filter(owner_id=owner_id, state__in=live)
    if created_by_id is not None:
        clusters = clusters.filter(created_by_id=created_by_id)
    for cluster in clusters.order_by("pk"):
        if cluster.state == Cluster.State.PENDING and cluster.stopped_at is not None:
            if cluster_services.cluster_stop_waiting(cluster=cluster, reason=reason):
                kept.append(cluster)  # out of the line, stopped again, files kept
            continue
        if cluster.state == Cluster.State.RUNNING and cluster.workspace:
            try:
                cluster_services.cluster_stop(cluster=cluster, reason=reason, limited=False)
            except ValidationError:  # no longer running (its owner stopped it meanwhile)
                continue
            kept.append(cluster)
            continue
        cluster_services.cluster_release(cluster=cluster, reason=reason)
        released.append(cluster)
    for cluster in kept:
        cluster.refresh_from_db(fields=["state", "stopped_at"])
    return kept, released


def _tell_exhausted(account: Account, kept, released, currency: str, now: datetime) -> None:
    """`balance.exhausted`, once per exhaustion: a conditional update of the account's
    marker, in the transaction of the stops it reports."""
    if not Account.objects.filter(pk=account.pk, exhausted_notified_at__isnull=True).update(
        exhausted_notified_at=now
    ):
        return
    release = {c.pk: c.release_at for c in kept if c.release_at is not None}
    balance = account.balance
    args = {"balance": f"{balance:.2f} {currency}"}
    names = ", ".join(c.name for c in kept)
    gone = ", ".join(c.name for c in released)
    if kept and release:
        args |= {"clusters": names, "until": Moment(min(release.values()))}
        if released:
            summary = Text(EXHAUSTED_KEPT_AND_RELEASED, released=gone, **args)
        else:
            summary = Text(EXHAUSTED_KEPT, **args)
    elif released:
        summary = Text(EXHAUSTED_RELEASED, released=gone, **args)
    else:
        summary = Text(EXHAUSTED_NOTHING, **args)
    webhooks.emit(
        owner_id=account.user_id,
        event_type="balance.exhausted",
        summary=summary,
        data={
            "balance": str(balance),
            "currency": currency,
            "clusters": [
                {
                    "id": c.pk,
                    "name": c.name,
                    "state": c.state,
                    "release_at": release[c.pk].isoformat() if c.pk in release else None,
                }
                for c in kept + released
            ],  # fmt: skip
            "url": webhooks.console_link("billing"),
        },
    )


# The words of `balance.exhausted` (English kept; each channel shows them in its reader's
# language).
EXHAUSTED_KEPT = gettext_noop(
    "Your balance ran out (%(balance)s). Stopped: %(clusters)s. Their GPUs are freed and "
    "every file is kept until at least %(until)s; top up and start them again before then, "
    "or they are released with their files."
)
EXHAUSTED_KEPT_AND_RELEASED = gettext_noop(
    "Your balance ran out (%(balance)s). Stopped: %(clusters)s. Their GPUs are freed and "
    "every file is kept until at least %(until)s; top up and start them again before then, "
    "or they are released with their files. Released, as they keep no files of their own "
    "(your volumes stay): %(released)s."
)
EXHAUSTED_RELEASED = gettext_noop(
    "Your balance ran out (%(balance)s). Released, as they keep no files of their own (your "
    "volumes stay): %(released)s. Top up to run clusters again."
)
EXHAUSTED_NOTHING = gettext_noop(
    "Your balance ran out (%(balance)s). Nothing was running; your stopped clusters keep "
    "their files until their release dates. Top up to start them again."
)


# -- a member at their monthly cap -----------------------------------------------------------


def stop_capped(account_ids, report: AccrualReport | None = None) -> list[int]:
    """Stop the clusters of every team member whose spending this month reached their
    monthly cap (`TeamMember.monthly_cap`; billing.caps), as an exhausted balance stops an
    account's (`_stop_clusters_of`: running ones stopped with every file kept, ones for jobs
    only, pools' among them, released), then bill them up to the second they stopped in
    this same tick, so that no second is charged twice or missed. Their pools get what is
    left of the cap as their balance at once (the autoscaler holds back; console.pools
    writes it on each round too). Told once per month and cap (`TeamMember.capped_at`,
    cleared when the owner sets the caps again): `team.member_capped` on the team's
    channels, in the transaction of the stops. Returns the clusters stopped or released."""
    now = report.now if report else floor_s(timezone.now())
    ended: list[int] = []
    for member, used in caps.capped_members(account_ids, now=now):
        with transaction.atomic():
            Pool.objects.filter(
                owner_id=member.team.principal_id, created_by_id=member.person_id
            ).update(balance=Decimal("0"))
            kept, released = _stop_clusters_of(
                member.team.principal_id, created_by_id=member.person_id,
                reason=Text(CAPPED, who=member.person.get_username()),
            )  # fmt: skip
            ended += [c.pk for c in kept + released]
            _tell_capped(member, used, kept + released, now)
    if ended:
        later = floor_s(timezone.now())
        _accrue_batch(ended, later, RateBook.load(), report or AccrualReport(now=later))
        log.warning("members at their cap: stopped or released clusters %s", ended)
    return ended


def _tell_capped(member: TeamMember, used: Decimal, clusters: list[Cluster], now) -> None:
    """`team.member_capped`, once per month and cap: a conditional update of the member's
    marker (unset, or set in an earlier month)."""
    fresh = Q(capped_at__isnull=True) | Q(capped_at__lt=caps.month_start(now))
    if not TeamMember.objects.filter(fresh, pk=member.pk).update(capped_at=now):
        return
    currency = RateBook.load().currency
    args = {
        "who": member.person.get_username(), "team": member.team.name,
        "spent": formatting.total_text(used, currency),
        "cap": formatting.total_text(member.monthly_cap, currency),
    }  # fmt: skip
    if clusters:
        summary = Text(CAPPED_STOPPED, clusters=", ".join(c.name for c in clusters), **args)
    else:
        summary = Text(CAPPED_NOTHING, **args)
    webhooks.emit(
        owner_id=member.team.principal_id,
        event_type="team.member_capped",
        summary=summary,
        data={
            "team": {"id": member.team_id, "name": member.team.name},
            "member": member.person.get_username(),
            "spent": str(used), "monthly_cap": str(member.monthly_cap), "currency": currency,
            "clusters": [{"id": c.pk, "name": c.name, "state": c.state} for c in clusters],
            "url": webhooks.console_link("billing"),
        },
    )  # fmt: skip


# The words of `team.member_capped` (English kept; each channel shows them in its reader's
# language).
CAPPED_STOPPED = gettext_noop(
    "%(who)s reached their monthly budget in %(team)s (spent %(spent)s / cap %(cap)s). "
    "Stopped, every file kept: %(clusters)s. The team's owner may raise the budget; it "
    "starts again next month."
)
CAPPED_NOTHING = gettext_noop(
    "%(who)s reached their monthly budget in %(team)s (spent %(spent)s / cap %(cap)s). "
    "Nothing of theirs was running. The team's owner may raise the budget; it starts again "
    "next month."
)

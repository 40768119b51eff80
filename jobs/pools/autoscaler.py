"""Pools: a queue and a set of identical clusters that grows while jobs wait and shrinks
when its clusters idle (issue 26).

A job submitted to a pool is queued on one of its clusters (a free running one first, else
the one with the shortest queue; a new one when the pool has none and may have one) and
runs on whichever of the pool's clusters is free first: `runs.dispatch.dispatch` of a free pool
cluster takes the pool's oldest waiting job, moving it from the cluster it waited on.

`pool_scale` is the autoscaler, one round per pool: it counts the jobs that wait against
the clusters that will take them (free, starting, finishing a stopped job), adds clusters
up to `max_clusters` while the budget allows, releases clusters idle for `idle_minutes`
down to `min_clusters`, and writes each decision, its reason and the figures it used on
the pool's timeline. It is level-triggered: cron runs it every few seconds, and a submit
or a job's end asks for a round. The money figures it uses (one cluster's price per hour,
what the pool has spent), and for a team's pool what its maker's caps leave (money, GPUs),
are written on the pool row by the console from billing (`console.pools.refresh`), since
jobs does not read billing.

Layer: pools, under sweeps; uses clusters (services), events (lifecycle, timeline), files
(storage), models and base (queue, text)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from jobs.base.queue import enqueue_unique
from jobs.base.text import Text, show
from jobs.clusters import services
from jobs.events import lifecycle
from jobs.events.timeline import pool_event, text_of
from jobs.files.storage import VolumeSpec
from jobs.models import Cluster, Job, Pool, PoolEvent, PoolSample

LIVE = (Cluster.State.PENDING, Cluster.State.RUNNING, Cluster.State.PREEMPTING)
SAMPLE_EVERY_S = 30  # a sample at least this often, and on every change


def request_scale(pool_id: int) -> None:
    """A round of the autoscaler for this pool once this transaction commits."""
    transaction.on_commit(
        lambda: enqueue_unique(
            "default", "jobs.tasks.pool_scale", pool_id, job_id=f"pool-scale-{pool_id}",
            again_if_running=True, result_ttl=60,
        )
    )  # fmt: skip


# -- creating, closing ------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolSpec:
    name: str
    cluster: services.ClusterSpec  # the shape of every cluster (its name is the pool's)
    min_clusters: int = 0
    max_clusters: int = 1
    idle_minutes: int = 10
    budget_per_hour: Decimal | None = None
    budget_total: Decimal | None = None


@transaction.atomic
def pool_create(
    *, owner, spec: PoolSpec, rate_per_hour: Decimal | None = None, created_by=None
) -> Pool:
    """`owner` is whom its clusters are rented for (a researcher, or a team's principal);
    `created_by` the person who made it (default: the owner), its clusters' maker too."""
    c = spec.cluster
    if spec.max_clusters < 1 or spec.min_clusters > spec.max_clusters:
        raise ValidationError(
            _("A pool needs 0 <= minimum <= maximum clusters, and a maximum of 1 or more.")
        )
    if Pool.objects.filter(owner=owner, name=spec.name, state=Pool.State.ACTIVE).exists():
        raise ValidationError(_("You already have a pool named %(name)s.") % {"name": spec.name})
    pool = Pool.objects.create(
        owner=owner,
        created_by=created_by or owner,
        name=spec.name,
        gpu_model=c.gpu_model,
        instance_type=c.instance_type,
        nodes=c.nodes,
        gpus_per_node=0 if c.instance_type else c.gpus_per_node,
        image=c.image,
        own_image=c.own_image,
        image_reference=c.image_reference or (c.image.reference if c.image else ""),
        network=c.network,
        zone=c.zone,
        spot=c.spot,
        volumes=[
            {"source": v.source, "target": v.target, "read_only": v.read_only} for v in c.volumes
        ],
        pub=c.pub,
        min_clusters=spec.min_clusters,
        max_clusters=spec.max_clusters,
        idle_minutes=spec.idle_minutes,
        budget_per_hour=spec.budget_per_hour,
        budget_total=spec.budget_total,
        rate_per_hour=rate_per_hour,
    )
    pool_event(
        pool,
        "created",
        Text(
            gettext_noop("%(shape)s, %(min)s to %(max)s clusters, released after %(idle)s idle minutes"),
            shape=pool.shape, min=pool.min_clusters, max=pool.max_clusters, idle=pool.idle_minutes,
        ),
    )  # fmt: skip
    request_scale(pool.pk)
    return pool


@transaction.atomic
def pool_close(*, pool: Pool) -> Pool:
    """No more jobs: its waiting jobs are cancelled, running ones end as they will, and its
    clusters are released as they turn idle (at once when idle now)."""
    pool = Pool.objects.select_for_update().get(pk=pool.pk)
    if pool.state == Pool.State.CLOSED:
        return pool
    pool.state = Pool.State.CLOSED
    pool.closed_at = timezone.now()
    pool.save(update_fields=["state", "closed_at"])
    reason = Text(gettext_noop("pool %(pool)s closed"), pool=pool.name)
    for job in Job.objects.filter(pool=pool, state__in=Job.WAITING):
        services.job_cancel(job=job, by=reason)
    pool_event(
        pool, "closed", Text(gettext_noop("closed: no new jobs; clusters released when idle"))
    )
    request_scale(pool.pk)
    return pool


def cluster_spec(pool: Pool, name: str) -> services.ClusterSpec:
    return services.ClusterSpec(
        name=name,
        nodes=pool.nodes,
        gpu_model=pool.gpu_model,
        gpus_per_node=pool.gpus_per_node,
        instance_type=pool.instance_type,
        image=pool.image,
        image_reference=pool.image_reference,
        own_image=pool.own_image,
        network=pool.network,
        zone=pool.zone,
        spot=pool.spot,
        volumes=tuple(VolumeSpec(**v) for v in pool.volumes),
        pub=pool.pub,
        workspace=False,
        release_policy=Cluster.ReleasePolicy.NEVER,  # the pool releases its idle clusters
        pool=pool,
    )


# -- submitting -------------------------------------------------------------------------------


@transaction.atomic
def pool_submit(*, pool: Pool, spec: services.JobSpec) -> Job:
    """Queue a job on the pool: it runs on the first of its clusters to be free."""
    pool = Pool.objects.select_for_update().get(pk=pool.pk)
    if pool.state != Pool.State.ACTIVE:
        raise ValidationError(
            _("Pool %(pool)s is closed: it takes no more jobs.") % {"pool": pool.name}
        )
    target = _queue_for(pool)
    if target is None:
        # No cluster at all: one round now, counting this job, so that it has one.
        scale(pool, extra_waiting=1)
        target = _queue_for(pool)
    if target is None:
        last = pool.events.filter(kind="held").order_by("-at", "-id").first()
        why = show(last.text) if last and last.text else _("the pool may not add a cluster now")
        raise ValidationError(
            _("Pool %(pool)s has no cluster and cannot add one: %(why)s.")
            % {"pool": pool.name, "why": why}
        )
    job = services.job_submit(cluster=target, spec=spec, pool=pool)
    request_scale(pool.pk)
    return job


def _queue_for(pool: Pool) -> Cluster | None:
    """Where a new job waits: a free running cluster, else the shortest queue."""
    best, best_key = None, None
    for cluster in pool.clusters.filter(state__in=LIVE, no_gpu=False).order_by("created_at", "id"):
        busy = cluster.jobs.filter(state__in=[*Job.WAITING, *Job.ACTIVE]).count()
        key = (cluster.state != Cluster.State.RUNNING or busy > 0, busy)
        if best_key is None or key < best_key:
            best, best_key = cluster, key
    return best


def funds_short(pool: Pool) -> Text | None:
    """Why the owner's balance pays for no further cluster (the minutes of balance that
    creating a cluster by hand needs); None when it does, or when there is no price."""
    if pool.balance is None or pool.rate_per_hour is None:
        return None
    minutes = settings.SUANLI_MIN_BALANCE_MINUTES
    needed = pool.rate_per_hour * minutes / 60
    if pool.balance >= needed:
        return None
    return Text(
        gettext_noop(
            "the balance of %(balance)s does not cover %(minutes)s minutes of another "
            "cluster (%(needed)s): top up"
        ),
        balance=_money(pool.balance), minutes=minutes, needed=_money(needed),
    )  # fmt: skip


def blocked(pool: Pool) -> Text | None:
    """Why a job submitted now would be refused (no cluster, and none may be added); None
    when it would be taken. For a sweep, which waits instead of asking for a trial."""
    if pool.state != Pool.State.ACTIVE:
        return Text(gettext_noop("pool %(pool)s is closed"), pool=pool.name)
    if pool.clusters.filter(state__in=LIVE, no_gpu=False).exists():
        return None
    if pool.max_clusters < 1:
        return Text(gettext_noop("the pool's maximum of %(max)s clusters is reached"), max=0)
    short = funds_short(pool)
    if short is not None:
        return short
    if pool.budget_total is not None and pool.spent >= pool.budget_total:
        return Text(
            gettext_noop("its total budget of %(budget)s is spent (%(spent)s)"),
            budget=_money(pool.budget_total), spent=_money(pool.spent),
        )  # fmt: skip
    if gpu_room_of(pool) == 0:
        return gpu_cap_words(pool)
    if pool.budget_per_hour is not None and (
        pool.rate_per_hour is None or pool.budget_per_hour < pool.rate_per_hour
    ):
        return Text(
            gettext_noop("a budget of %(budget)s per hour pays for %(n)s at %(rate)s per hour each"),
            budget=_money(pool.budget_per_hour), n=0, rate=_money(pool.rate_per_hour),
        )  # fmt: skip
    return None


def gpu_room_of(pool: Pool) -> int | None:
    """How many more of the pool's clusters its maker's GPU cap leaves room for (written
    on the row by the console, `Pool.gpu_room`); None: no cap."""
    if pool.gpu_room is None or not pool.total_gpus:
        return None
    return pool.gpu_room // pool.total_gpus


def gpu_cap_words(pool: Pool) -> Text:
    """Why the GPU cap of the pool's maker holds it back, with the figures."""
    return Text(
        gettext_noop(
            "the GPU cap of %(who)s (its maker) leaves room for %(gpus)s more GPUs: %(n)s "
            "clusters of %(each)s"
        ),
        who=pool.created_by.get_username(), gpus=pool.gpu_room, n=gpu_room_of(pool),
        each=pool.total_gpus,
    )  # fmt: skip


# -- the autoscaler ---------------------------------------------------------------------------


@dataclass
class Figures:
    waiting: int
    running: int
    clusters: int
    starting: int
    free: int
    finishing: int

    @property
    def ready(self) -> int:
        return self.clusters - self.starting


# What `_count` reads of the active jobs (`figures_of`, `quiet_rounds`)
ACTIVE_FIELDS = ("cluster_id", "cancel_requested", "stop_requested_at")
# The order a round goes through a pool's live clusters in (`scale`, `quiet_rounds`)
CLUSTER_ORDER = ("created_at", "id")
LATEST_FIRST = ("-at", "-id")  # a pool's last sample (`_sample`, `quiet_rounds`)


def figures_of(pool: Pool, clusters: list[Cluster]) -> Figures:
    ids = [c.pk for c in clusters]
    active = list(
        Job.objects.filter(cluster_id__in=ids, state__in=Job.ACTIVE).values(*ACTIVE_FIELDS)
    )
    waiting = Job.objects.filter(pool=pool, state__in=Job.WAITING).count()
    return _count(clusters, active, waiting)


def _count(clusters: list[Cluster], active: list[dict], waiting: int) -> Figures:
    """The figures of a pool from its live clusters, their active jobs (`cluster_id`,
    `cancel_requested`, `stop_requested_at`) and how many of its jobs wait."""
    busy = {a["cluster_id"] for a in active}
    finishing = {a["cluster_id"] for a in active if a["cancel_requested"] or a["stop_requested_at"]}
    running = [c for c in clusters if c.state == Cluster.State.RUNNING]
    return Figures(
        waiting=waiting,
        running=len(active),
        clusters=len(clusters),
        starting=len([c for c in clusters if c.state != Cluster.State.RUNNING]),
        free=len([c for c in running if c.pk not in busy]),
        finishing=len(finishing),
    )


def _money(value: Decimal | None) -> str:
    return "" if value is None else f"{value:.2f}"


def pool_scale(pool_id: int, *, now=None) -> str:
    """One round for one pool: returns what it did, in words (for the task's result)."""
    with transaction.atomic():
        pool = Pool.objects.select_for_update().filter(pk=pool_id).first()
        if pool is None:
            return "gone"
        return scale(pool, now=now)


def scale(pool: Pool, *, extra_waiting: int = 0, now=None) -> str:
    """The round itself, with the pool's row locked by the caller."""
    now = now or timezone.now()
    clusters = list(pool.clusters.filter(state__in=LIVE).order_by(*CLUSTER_ORDER))
    f = figures_of(pool, clusters)
    f.waiting += extra_waiting
    numbers = {
        "waiting": f.waiting, "running": f.running, "clusters": f.clusters,
        "starting": f.starting, "free": f.free, "finishing": f.finishing,
        "min": pool.min_clusters, "max": pool.max_clusters,
        "rate_per_hour": _money(pool.rate_per_hour),
        "budget_per_hour": _money(pool.budget_per_hour),
        "budget_total": _money(pool.budget_total), "spent": _money(pool.spent),
        "balance": _money(pool.balance), "gpu_room": pool.gpu_room,
    }  # fmt: skip
    done = []
    spent_out = _spent_out(pool)
    if pool.state == Pool.State.ACTIVE:
        added = _grow(pool, clusters, f, numbers, spent_out)
        if added:
            done.append(f"+{added}")
            f.clusters += added
            f.starting += added
    released = _shrink(pool, clusters, f, now, numbers, spent_out)
    if released:
        done.append(f"-{released}")
        f.clusters -= released
    for cluster_id in _to_dispatch(clusters, f):
        lifecycle.request_dispatch(cluster_id)
    if done:  # counted again only when this round changed the clusters
        f = figures_of(pool, list(pool.clusters.filter(state__in=LIVE)))
    _sample(pool, f, now)
    return " ".join(done) or "="


def _spent_out(pool: Pool) -> bool:
    """Its total budget is spent: it adds no cluster, keeps none and releases idle ones at once."""
    return pool.budget_total is not None and pool.spent >= pool.budget_total


def _to_dispatch(clusters: list[Cluster], f: Figures) -> list[int]:
    """The clusters whose dispatch a round asks: while jobs wait and a cluster is free, the
    running ones (a free cluster takes the oldest waiting job; dispatch is idempotent and
    cheap)."""
    if not (f.waiting and f.free):
        return []
    return [c.pk for c in clusters if c.state == Cluster.State.RUNNING]


def _wanted(pool: Pool, f: Figures) -> tuple[int, int]:
    """How many more clusters an active pool wants: `need`, for its waiting jobs, and
    `below_min`, to reach its minimum (`_grow` adds the larger, where positive). Who will
    take the waiting jobs: free clusters, clusters still starting, and clusters whose job
    is being stopped (a pruned trial: its cluster is free in a moment)."""
    return f.waiting - f.free - f.starting - f.finishing, pool.min_clusters - f.clusters


def _grow(pool: Pool, clusters: list[Cluster], f: Figures, numbers: dict, spent_out: bool) -> int:
    need, below_min = _wanted(pool, f)
    want = max(need, below_min)
    if want <= 0:
        return 0
    room = pool.max_clusters - f.clusters
    limits = []  # why fewer than wanted, in words
    allowed = want
    if room < allowed:
        allowed = max(room, 0)
        limits.append(
            Text(
                gettext_noop("the pool's maximum of %(max)s clusters is reached"),
                max=pool.max_clusters,
            )
        )
    short = funds_short(pool)
    if short is not None:
        allowed = 0
        limits.append(short)
    allowed = _within_caps_and_budgets(pool, f, allowed, spent_out, limits)
    allowed = min(allowed, want)
    situation = Text(
        gettext_noop("%(waiting)s waiting, %(starting)s starting, %(free)s free, %(finishing)s finishing"),
        waiting=f.waiting, starting=f.starting, free=f.free, finishing=f.finishing,
    )  # fmt: skip
    if need <= 0 and below_min > 0:
        situation = Text(
            gettext_noop("%(clusters)s clusters, below the minimum of %(min)s"),
            clusters=f.clusters, min=pool.min_clusters,
        )  # fmt: skip
    if allowed > 0:
        _add_clusters(pool, allowed, clusters)
        if pool.gpu_room is not None:  # until the console writes it again: its own adds
            pool.gpu_room = max(pool.gpu_room - allowed * pool.total_gpus, 0)
            Pool.objects.filter(pk=pool.pk).update(gpu_room=pool.gpu_room)
        pool_event(
            pool, "grow", Text(gettext_noop("%(situation)s: +%(n)s"), situation=situation, n=allowed),
            numbers,
        )  # fmt: skip
    if allowed < want and limits:
        held = Text(
            gettext_noop("%(situation)s: %(n)s more wanted, held back: %(why)s"),
            situation=situation, n=want - allowed, why=_join(limits),
        )  # fmt: skip
        last = pool.events.order_by("-at", "-id").first()
        # Once per change of reason: a pool held back for an hour has one line, not 700.
        if last is None or last.kind != "held" or last.text != text_of(PoolEvent, held):
            pool_event(pool, "held", held, numbers)
    return allowed


def _within_caps_and_budgets(
    pool: Pool, f: Figures, allowed: int, spent_out: bool, limits: list[Text]
) -> int:
    """`allowed` cut to what the maker's GPU cap and the pool's budgets leave, each cut's
    reason added to `limits`."""
    gpu_room = gpu_room_of(pool)
    if gpu_room is not None and allowed > gpu_room:
        allowed = gpu_room
        limits.append(gpu_cap_words(pool))
    if spent_out:
        allowed = 0
        limits.append(
            Text(
                gettext_noop("its total budget of %(budget)s is spent (%(spent)s)"),
                budget=_money(pool.budget_total), spent=_money(pool.spent),
            )
        )  # fmt: skip
    elif pool.budget_per_hour is not None:
        if pool.rate_per_hour is None:
            allowed = 0
            limits.append(Text(gettext_noop("its shape has no price to check the budget against")))
        else:
            affordable = (
                int(pool.budget_per_hour // pool.rate_per_hour)
                if pool.rate_per_hour > 0
                else math.inf
            )
            if f.clusters + allowed > affordable:
                allowed = max(int(affordable) - f.clusters, 0) if allowed else 0
                limits.append(
                    Text(
                        gettext_noop(
                            "a budget of %(budget)s per hour pays for %(n)s at %(rate)s per hour each"
                        ),
                        budget=_money(pool.budget_per_hour), n=int(affordable),
                        rate=_money(pool.rate_per_hour),
                    )
                )  # fmt: skip
    return allowed


def _add_clusters(pool: Pool, n: int, clusters: list[Cluster]) -> None:
    """`n` clusters of the pool's shape, made (for caps and spending) by the pool's maker."""
    for _i in range(n):
        made = services.cluster_create(
            owner=pool.owner, spec=cluster_spec(pool, _name(pool)), created_by=pool.created_by
        )
        clusters.append(made)


def _join(parts: list[Text]) -> Text:
    if len(parts) == 1:
        return parts[0]
    return Text(gettext_noop("%(a)s; %(b)s"), a=parts[0], b=_join(parts[1:]))


def _name(pool: Pool) -> str:
    """`<pool>-<n>`, the next number not taken by one of the owner's live clusters."""
    n = Cluster.objects.filter(pool=pool).count() + 1
    taken = set(
        Cluster.objects.filter(owner_id=pool.owner_id, state__in=LIVE).values_list(
            "name", flat=True
        )
    )
    while f"{pool.name[:52]}-{n}" in taken:
        n += 1
    return f"{pool.name[:52]}-{n}"


def _jobless(cluster: Cluster) -> bool:
    return not cluster.jobs.filter(state__in=[*Job.WAITING, *Job.ACTIVE]).exists()


@dataclass
class _Release:
    """What a round's release of clusters goes by (`_shrink`, and `_quiet` for the rounds
    taken together)."""

    ends: bool  # the pool is closed or spent out: none kept, idle ones go at once
    keep: int  # it releases none below this many live clusters
    idle_since: datetime  # idle since before this: may go
    # More clusters coming than jobs waiting for them: a starting cluster without a job
    # (its job ran on a cluster that was free first) goes at once, before it is placed
    # and charged for idling.
    surplus: int


def _release_terms(pool: Pool, f: Figures, now, spent_out: bool) -> _Release:
    ends = pool.state != Pool.State.ACTIVE or spent_out
    return _Release(
        ends=ends,
        keep=0 if ends else pool.min_clusters,
        idle_since=now if ends else now - timedelta(minutes=pool.idle_minutes),
        surplus=f.free + f.starting + f.finishing - f.waiting,
    )


UNNEEDED, IDLE = "unneeded", "idle"


def _release_candidate(c: Cluster, f: Figures, terms: _Release, surplus: int) -> str | None:
    """Why the round may release `c`, provided it holds no job (`_jobless`, a query, asked
    by the caller): UNNEEDED (starting while `surplus`, what is left of `terms.surplus`, is
    above 0), IDLE, or None: it stays."""
    if c.state == Cluster.State.PREEMPTING:
        return None
    if c.state == Cluster.State.PENDING and c.running_since is None and surplus > 0:
        return UNNEEDED
    if c.last_active_at <= terms.idle_since:
        if c.state == Cluster.State.RUNNING and f.waiting and not terms.ends:
            return None  # it takes a waiting job on this round's dispatch
        return IDLE
    return None


def _shrink(
    pool: Pool, clusters: list[Cluster], f: Figures, now, numbers: dict, spent_out: bool
) -> int:
    closed = pool.state != Pool.State.ACTIVE
    terms = _release_terms(pool, f, now, spent_out)
    keep, idle_since, surplus = terms.keep, terms.idle_since, terms.surplus
    live = [c for c in clusters if c.state in LIVE]
    candidates = []
    for c in live:
        why = _release_candidate(c, f, terms, surplus)
        if why is not None and _jobless(c):
            candidates.append((c, why == UNNEEDED))
            if why == UNNEEDED:
                surplus -= 1
    # Starting ones first, then the longest idle.
    candidates.sort(key=lambda item: (not item[1], item[0].last_active_at))
    n = 0
    for cluster, unneeded in candidates:
        if len(live) - n <= keep:
            break
        if closed:
            why = Text(gettext_noop("the pool is closed"))
        elif spent_out:
            why = Text(
                gettext_noop("the pool's total budget of %(budget)s is spent"),
                budget=_money(pool.budget_total),
            )
        elif unneeded:
            why = Text(gettext_noop("not needed: its job ran on a cluster that was free first"))
        else:
            why = Text(
                gettext_noop("idle for %(minutes)s minutes, %(clusters)s clusters, minimum %(min)s"),
                minutes=pool.idle_minutes, clusters=len(live) - n, min=pool.min_clusters,
            )  # fmt: skip
        with transaction.atomic():
            # Again under the cluster's lock: a dispatch may have moved a job onto it since
            # it was read (lock order: pool, cluster, job).
            locked = Cluster.objects.select_for_update().get(pk=cluster.pk)
            if (
                locked.state not in LIVE
                or locked.state == Cluster.State.PREEMPTING
                or not _jobless(locked)
                or (not unneeded and locked.last_active_at > idle_since)
                or (unneeded and locked.running_since is not None)
            ):
                continue
            lifecycle.cluster_release(
                cluster=locked,
                reason=Text(
                    gettext_noop("released by pool %(pool)s: %(why)s"), pool=pool.name, why=why
                ),
            )
        pool_event(
            pool, "shrink",
            Text(gettext_noop("%(cluster)s %(why)s: -1"), cluster=cluster.name, why=why),
            numbers,
        )  # fmt: skip
        n += 1
    return n


def _sample(pool: Pool, f: Figures, now) -> None:
    sample = _new_sample(pool, f, now, pool.samples.order_by(*LATEST_FIRST).first())
    if sample is not None:
        sample.save()


def _new_sample(pool: Pool, f: Figures, now, last: PoolSample | None) -> PoolSample | None:
    """The sample this round writes after `last`: on a change, or SAMPLE_EVERY_S after it."""
    values = {"waiting": f.waiting, "running": f.running, "clusters": f.clusters, "ready": f.ready}
    if (
        last is not None
        and all(getattr(last, k) == v for k, v in values.items())
        and (now - last.at).total_seconds() < SAMPLE_EVERY_S
    ):
        return None
    return PoolSample(pool=pool, at=now, **values)


# -- many pools at once (the cron round) -----------------------------------------------------


def quiet_rounds(pool_ids, *, now=None) -> list[int]:
    """The rounds of many pools (cron), together where a round decides nothing: every pool
    that waits for no cluster to be added and has none to release (see `_quiet`) gets what
    `scale` would do for it, its dispatches asked and its sample written, in one
    transaction under the pools' row locks, counted with a few queries for all. Returns
    the pools that need a round of their own (`pool_scale`): those with a decision to
    take, and those whose row another transaction holds (their round waits for it)."""
    now = now or timezone.now()
    ids = list(pool_ids)
    with transaction.atomic():
        pools = list(
            Pool.objects.select_for_update(skip_locked=True).filter(pk__in=ids).order_by("pk")
        )
        locked = {p.pk for p in pools}
        alone = [pk for pk in ids if pk not in locked]
        clusters: dict[int, list[Cluster]] = {pk: [] for pk in locked}
        for c in Cluster.objects.filter(pool_id__in=locked, state__in=LIVE).order_by(
            *CLUSTER_ORDER
        ):
            clusters[c.pool_id].append(c)
        active: dict[int, list[dict]] = {}
        for a in Job.objects.filter(
            cluster__pool_id__in=locked, cluster__state__in=LIVE, state__in=Job.ACTIVE
        ).values("cluster__pool_id", *ACTIVE_FIELDS):
            active.setdefault(a["cluster__pool_id"], []).append(a)
        waiting = dict(
            Job.objects.filter(pool_id__in=locked, state__in=Job.WAITING)
            .order_by()
            .values("pool_id")
            .annotate(n=Count("id"))
            .values_list("pool_id", "n")
        )
        last = {
            sample.pool_id: sample
            for sample in PoolSample.objects.filter(pool_id__in=locked)
            .order_by("pool_id", *LATEST_FIRST)
            .distinct("pool_id")
        }
        dispatch: list[int] = []
        samples: list[PoolSample] = []
        for pool in pools:
            live = clusters[pool.pk]
            f = _count(live, active.get(pool.pk, []), waiting.get(pool.pk, 0))
            if not _quiet(pool, live, f, now):
                alone.append(pool.pk)
                continue
            dispatch += _to_dispatch(live, f)  # as `scale`
            sample = _new_sample(pool, f, now, last.get(pool.pk))
            if sample is not None:
                samples.append(sample)
        PoolSample.objects.bulk_create(samples)
        lifecycle.request_dispatches(dispatch)
    return alone


def _quiet(pool: Pool, clusters: list[Cluster], f: Figures, now) -> bool:
    """Whether `scale` would neither add a cluster (nor say why it holds back) nor release
    one: then its round only asks dispatches and writes a sample. Where a cluster may be
    released (whether it is jobless is read under its own lock), not quiet."""
    spent_out = _spent_out(pool)
    if pool.state == Pool.State.ACTIVE and max(_wanted(pool, f)) > 0:
        return False  # _grow adds, or says why it holds back
    terms = _release_terms(pool, f, now, spent_out)
    # _shrink's first candidate, if it holds no job (it releases none at `keep` or below)
    return len(clusters) <= terms.keep or not any(
        _release_candidate(c, f, terms, terms.surplus) for c in clusters
    )


def prune_samples() -> int:
    cutoff = timezone.now() - timedelta(days=settings.SUANLI_POOL_SAMPLE_DAYS)
    return PoolSample.objects.filter(at__lt=cutoff).delete()[0]

"""The pool pages (issue 26): a researcher's pools, a new pool, and a pool's page with its
queue, its clusters, a chart of the queue against the clusters, its timeline of the
autoscaler's decisions, a form to submit a job and a button to close it.

Writes go through jobs/pools/autoscaler.py (create, close) and console/pools.py (submit, with the
money figures fresh); reads are here. A pool is its owner's (a researcher's, or a team's:
every member sees it, members and above submit to it and make pools, its maker or an admin
closes it); anyone else gets 404 on every URL of it (`pool_for_user`, used by the API too)."""

from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.db.models import Count, Q
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from django.views.decorators.http import require_POST

from billing import selectors as money
from console import pools as console_pools
from console import projection_panel
from console.forms import ZONE_SPREAD_NOTE, JobForm, PoolForm, attach_errors
from console.views_billing import cluster_form_prices
from jobs.models import Job, Pool
from jobs.pools import autoscaler
from jobs.tenancy.actors import Actor, Role

ENDED_SHOWN = 20  # ended jobs on the pool page
EVENTS_SHOWN = 100  # the newest timeline lines on the pool page
SAMPLE_HOURS = 24  # the chart's span
SAMPLES_MOST = 5000

# The figures a timeline line was decided on, in the order and words the page shows.
FIGURE_LABELS = {
    "waiting": gettext_lazy("waiting"),
    "running": gettext_lazy("running"),
    "clusters": gettext_lazy("clusters"),
    "starting": gettext_lazy("starting"),
    "free": gettext_lazy("free"),
    "finishing": gettext_lazy("finishing"),
    "min": gettext_lazy("minimum"),
    "max": gettext_lazy("maximum"),
    "rate_per_hour": gettext_lazy("per cluster-hour"),
    "budget_per_hour": gettext_lazy("budget per hour"),
    "budget_total": gettext_lazy("total budget"),
    "spent": gettext_lazy("spent"),
    "balance": gettext_lazy("balance"),
    "gpu_room": gettext_lazy("GPUs its maker's cap leaves"),
}


def pool_for_user(user, pool_id: int) -> Pool:
    """The one place that decides who may see a pool: its owner (`user`, a researcher or an
    Actor: a team's pools, for every member). Others get 404."""
    return get_object_or_404(
        Pool.objects.select_related("gpu_model", "instance_type"),
        pk=pool_id, owner=Actor.of(user).principal,
    )  # fmt: skip


def pool_to_use(user, pool_id: int) -> Pool:
    """A pool the actor may submit jobs to: 404 unless it sees it, 403 for a viewer."""
    pool = pool_for_user(user, pool_id)
    Actor.of(user).require(Role.MEMBER)
    return pool


def pool_to_change(user, pool_id: int) -> Pool:
    """A pool the actor may close: its maker (a member or above) or a team's admin."""
    pool = pool_for_user(user, pool_id)
    Actor.of(user).require_change(pool)
    return pool


def pools_of(user):
    """The researcher's (an Actor's: its principal's) pools, newest first, with their live
    clusters and jobs counted."""
    return (
        Pool.objects.filter(owner=Actor.of(user).principal)
        .select_related("gpu_model", "instance_type")
        .annotate(
            live=Count("clusters", filter=Q(clusters__state__in=autoscaler.LIVE), distinct=True),
            waiting=Count("jobs", filter=Q(jobs__state__in=Job.WAITING), distinct=True),
            running=Count("jobs", filter=Q(jobs__state__in=Job.ACTIVE), distinct=True),
        )
    )


def currency() -> str:
    return money.quote_for().currency


def figures_shown(figures: dict) -> list[tuple[str, object]]:
    return [
        (str(label), figures[key])
        for key, label in FIGURE_LABELS.items()
        if figures.get(key) not in (None, "")
    ]


def queue_of(pool: Pool) -> dict:
    """The pool's jobs: waiting (with their place in the pool's line), running, and the
    newest ended ones."""
    jobs = pool.jobs.select_related("cluster")
    waiting = list(jobs.filter(state__in=Job.WAITING).order_by("queued_at", "id"))
    for position, job in enumerate(waiting, start=1):
        job.position = position
    return {
        "waiting": waiting,
        "running": list(jobs.filter(state__in=Job.ACTIVE).order_by("started_at", "id")),
        "ended": list(
            jobs.exclude(state__in=[*Job.WAITING, *Job.ACTIVE]).order_by("-finished_at", "-id")[
                :ENDED_SHOWN
            ]
        ),
    }


def samples_of(pool: Pool) -> dict:
    """The chart's series: the last day of the pool's samples, at most SAMPLES_MOST."""
    since = timezone.now() - timedelta(hours=SAMPLE_HOURS)
    rows = list(
        pool.samples.filter(at__gte=since)
        .order_by("-at", "-id")
        .values_list("at", "waiting", "running", "clusters", "ready")[:SAMPLES_MOST]
    )
    rows.reverse()
    return {
        # In the reader's zone, with its offset: the chart's axis shows these wall times.
        "at": [timezone.localtime(r[0]).isoformat() for r in rows],
        "waiting": [r[1] for r in rows],
        "running": [r[2] for r in rows],
        "clusters": [r[3] for r in rows],
        "ready": [r[4] for r in rows],
        "now": timezone.localtime().isoformat(),
    }


def _live_context(pool: Pool) -> dict:
    """The parts of the pool page that change: figures, queue, clusters, timeline."""
    clusters = list(
        pool.clusters.filter(state__in=autoscaler.LIVE)
        .select_related("gpu_model", "instance_type")
        .order_by("created_at", "id")
    )
    events = list(pool.events.order_by("-at", "-id")[:EVENTS_SHOWN])
    events.reverse()
    for event in events:
        event.figures_shown = figures_shown(event.figures)
    ended_clusters = pool.clusters.exclude(state__in=autoscaler.LIVE).count()
    return {
        "pool": pool,
        "currency": currency(),
        "figures": autoscaler.figures_of(pool, clusters),
        "clusters": clusters,
        "ended_clusters": ended_clusters,
        "events": events,
        "polling": pool.state == Pool.State.ACTIVE or bool(clusters),
        "projection": projection_panel.pool_panel(pool),
        **queue_of(pool),
    }


def _detail(request, pool: Pool, job_form: JobForm | None = None, status: int = 200):
    context = {
        **_live_context(pool),
        "job_form": job_form or JobForm(),
        "samples": samples_of(pool),
    }
    return render(request, "console/pool_detail.html", context, status=status)


@login_required
def pool_list(request):
    return render(
        request,
        "console/pool_list.html",
        {"pools": pools_of(request.actor), "currency": currency()},
    )


@login_required
def pool_new(request):
    actor = request.actor
    actor.require(Role.MEMBER)
    form = PoolForm(request.POST or None, owner=actor)
    if request.method == "POST" and form.is_valid():
        try:
            pool = autoscaler.pool_create(
                owner=actor.principal, spec=form.spec(), rate_per_hour=form.rate_per_hour,
                created_by=actor.person,
            )  # fmt: skip
        except ValidationError as exc:
            attach_errors(form, exc)
        else:
            messages.success(
                request,
                _(
                    "Pool %(name)s created: %(shape)s, %(min)s to %(max)s clusters. Submit "
                    "jobs to it; it adds clusters while they wait."
                )
                % {
                    "name": pool.name,
                    "shape": pool.shape,
                    "min": pool.min_clusters,
                    "max": pool.max_clusters,
                },
            )
            return redirect("pool_detail", pool_id=pool.pk)
    return render(
        request,
        "console/pool_new.html",
        {
            "form": form,
            "zone_note": ZONE_SPREAD_NOTE,
            "prices_json": cluster_form_prices(form),
            "standing": money.standing(actor.principal),
            "min_minutes": settings.SUANLI_MIN_BALANCE_MINUTES,
        },
    )


@login_required
def pool_detail(request, pool_id: int):
    # The money figures on the row are the cron round's (every SUANLI_POOL_INTERVAL):
    # a page, or its poll, writes nothing.
    pool = pool_for_user(request.actor, pool_id)
    return _detail(request, pool)


@login_required
def pool_status(request, pool_id: int):
    """The live parts of the pool page, polled with htmx every few seconds."""
    pool = pool_for_user(request.actor, pool_id)
    return render(request, "console/_pool_live.html", _live_context(pool))


@login_required
def pool_samples(request, pool_id: int):
    """The chart's series as JSON (the page draws them and asks again every few seconds)."""
    pool = pool_for_user(request.actor, pool_id)
    return JsonResponse(samples_of(pool))


@login_required
@require_POST
def pool_job_new(request, pool_id: int):
    pool = pool_to_use(request.actor, pool_id)
    form = JobForm(request.POST)
    if form.is_valid():
        try:
            job = console_pools.submit(pool=pool, spec=form.spec(), by=request.actor.person)
        except ValidationError as exc:
            attach_errors(form, exc)
        else:
            messages.success(
                request,
                _("Job %(job)s queued on pool %(pool)s.") % {"job": job.name, "pool": pool.name},
            )
            return redirect("pool_detail", pool_id=pool.pk)
    return _detail(request, pool, job_form=form, status=400)


@login_required
@require_POST
def pool_close(request, pool_id: int):
    pool = pool_to_change(request.actor, pool_id)
    if pool.state == Pool.State.CLOSED:
        messages.warning(request, _("Pool %(name)s is already closed.") % {"name": pool.name})
    else:
        autoscaler.pool_close(pool=pool)
        messages.success(
            request,
            _(
                "Pool %(name)s closed: its waiting jobs are cancelled, running ones finish, and "
                "its clusters are released as they turn idle."
            )
            % {"name": pool.name},
        )
    return redirect("pool_detail", pool_id=pool.pk)

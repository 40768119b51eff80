import re
from datetime import timedelta

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import login
from django.contrib.auth.decorators import login_required
from django.contrib.auth.forms import UserCreationForm
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.db import connection, transaction
from django.db.models import Prefetch
from django.http import Http404, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop
from django.views.decorators.http import require_POST

from billing import selectors as money
from billing import services as billing
from billing import storage as bought_storage
from console import projection_panel
from console.forms import (
    ZONE_SPREAD_NOTE,
    ClusterForm,
    JobForm,
    ResizeForm,
    SaveImageForm,
    ShutdownForm,
    SshKeyForm,
    start_refusal,
)
from console.logins import ssh_logins
from console.powers import operator_required
from console.views_billing import cluster_form_prices
from jobs.base.text import Text
from jobs.clusters import services as cluster_services
from jobs.files import storage
from jobs.hosts import joins
from jobs.hosts import services as host_services
from jobs.images import builds
from jobs.models import Cluster, Host, Image, InstanceType, Job, Node, SshKey, WebhookEndpoint
from jobs.placement import fleet
from jobs.tenancy.actors import Role
from monitoring import keyavg, profiles
from monitoring import selectors as metrics
from monitoring.diagnosis import verdict


@login_required
def dashboard(request):
    availability = fleet.fleet_availability()
    return render(
        request,
        "console/dashboard.html",
        {
            "availability": availability,
            "free_total": sum(row.free for row in availability),
            "gpu_total": sum(row.total for row in availability),
            "any_emulated": any(row.emulated_hosts for row in availability),
            "instance_types": InstanceType.objects.all(),
            "images": Image.objects.filter(active=True),
            "disabled_endpoints": WebhookEndpoint.objects.filter(
                owner=request.actor.principal, enabled=False
            ).exclude(disabled_reason=""),
            "my_active": fleet.clusters_for(request.actor)
            .filter(
                state__in=[Cluster.State.PENDING, Cluster.State.RUNNING, Cluster.State.PREEMPTING]
            )
            .count(),
        },
    )


def signup(request):
    if not settings.SUANLI_SIGNUP_ENABLED:
        raise Http404(
            _("Sign-up is switched off on this console; ask your operator for an account.")
        )
    if request.user.is_authenticated:
        return redirect("dashboard")
    form = UserCreationForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        with transaction.atomic():
            user = form.save()
            billing.account_for(user)  # an operator can top up the new user at once
        # Named: axes' throttling backend comes first and logs nobody in (settings).
        login(request, user, backend="console.auth.PeopleBackend")
        messages.success(request, _("Welcome to Suanli, %(name)s.") % {"name": user.username})
        return redirect("dashboard")
    return render(request, "registration/signup.html", {"form": form})


@operator_required("jobs.view_host")
def ops_hosts(request):
    return render(
        request,
        "console/ops_hosts.html",
        {"hosts": fleet.hosts_with_occupancy(), "joins": joins.recent()},
    )


@operator_required("jobs.change_host")
@require_POST
def ops_host_check(request, host_id: int):
    host = get_object_or_404(Host, pk=host_id)
    host = host_services.host_check(host_id=host.pk)
    if host.state == Host.State.DOWN:
        messages.error(
            request,
            _("Host %(host)s did not answer: %(error)s")
            % {"host": host.name, "error": host.last_error_shown},
        )
    elif host.state == Host.State.DEGRADED:  # the reasons, as the admin's check says them
        messages.error(
            request,
            _("Host %(name)s answers but is degraded: %(error)s")
            % {"name": host.name, "error": host.last_error_shown},
        )
    else:
        messages.success(
            request,
            _("Host %(host)s answered: Docker %(version)s, %(state)s.")
            % {
                "host": host.name,
                "version": host.docker_version,
                "state": host.get_state_display(),
            },
        )
    return redirect("ops_hosts")


def healthz(request):
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"ok": True})


# -- clusters -------------------------------------------------------------------------------


@login_required
def cluster_list(request):
    """Every cluster not ended (pending, running, releasing, preempting) with where its live
    nodes run, then the ended ones a page at a time, newest first. Both queries are served
    by partial indexes on (owner, created_at) (jobs.Cluster Meta), so a year of history
    costs one page of it."""
    ended_states = [Cluster.State.RELEASED, Cluster.State.FAILED]
    mine = fleet.clusters_for(request.actor)
    live_nodes = Node.objects.filter(released_at__isnull=True).select_related("host")
    active = (
        mine.exclude(state__in=ended_states)
        .order_by("-created_at")
        .prefetch_related(Prefetch("node_set", live_nodes.order_by("index"), to_attr="live_nodes"))
    )
    history = mine.filter(state__in=ended_states).order_by("-created_at", "-id")
    page = Paginator(history, 25).get_page(request.GET.get("page"))
    return render(
        request,
        "console/cluster_list.html",
        {
            "active": active,
            "ended": page,
            "ended_pages": page.paginator.get_elided_page_range(page.number, on_each_side=2),
        },
    )


@login_required
def cluster_new(request):
    """A new cluster, rented for whom the person acts (a team's: its members and above),
    owned by that principal and made by the person."""
    actor = request.actor
    actor.require(Role.MEMBER)
    form = ClusterForm(request.POST or None, owner=actor)
    if request.method == "POST" and form.is_valid():
        cluster = cluster_services.cluster_create(
            owner=actor.principal, spec=form.spec(), created_by=actor.person
        )
        messages.success(
            request,
            _("Cluster %(name)s requested: %(shape)s. It runs as soon as it is placed.")
            % {"name": cluster.name, "shape": cluster.shape},
        )
        return redirect("cluster_detail", cluster_id=cluster.pk)
    return render(
        request,
        "console/cluster_new.html",
        {
            "form": form,
            "zone_note": ZONE_SPREAD_NOTE,
            "prices_json": cluster_form_prices(form),
            "standing": money.standing(actor.principal),
            "min_minutes": settings.SUANLI_MIN_BALANCE_MINUTES,
            "storage": bought_storage.summary(actor.principal),
        },
    )


def _cluster_status_context(cluster: Cluster) -> dict:
    stopped = cluster.state == Cluster.State.STOPPED
    return {
        "start_blocked": cluster_services.start_blocked(cluster) if stopped else "",
        "release_at": cluster.release_at,
        "stop_prices": money.stop_prices() if stopped or cluster.no_gpu else None,
        "cluster": cluster,
        "nodes": fleet.live_nodes(cluster),
        "events": cluster.events.all(),
        **_queue_context(cluster),
        "resize_form": ResizeForm(initial={"nodes": cluster.nodes}, cluster=cluster),
        "jobs": cluster.jobs.all()[:50],
        "pulls": fleet.image_pulls(cluster),
        # Running, but no node has run yet (its workspaces starting, their image pulled
        # first; a cluster without workspaces: no job ran yet): not charged until one does.
        # A node added by a resize or a re-placement starts on its own: its row says so, the
        # cluster (running, charged) does not read as starting.
        "not_started": cluster.state == Cluster.State.RUNNING
        and _none_started(fleet.live_nodes(cluster)),
        "grace_minutes": getattr(settings, "SUANLI_START_GRACE_S", 600) // 60,
    }


def _queue_context(cluster: Cluster) -> dict:
    """Where a pending cluster stands in line (`position`) and why (`standing`: its
    account's fair share, `fleet.queue`)."""
    standing = fleet.queue_standing(cluster)
    return {"position": standing.position if standing else None, "standing": standing}


def _none_started(nodes) -> bool:
    """Whether the cluster has nodes and none of them has run yet."""
    nodes = list(nodes)
    return bool(nodes) and all(n.started_at is None for n in nodes)


def _save_image_context(cluster: Cluster) -> dict:
    """The "Save as image" card: the nodes whose workspace can be saved now."""
    nodes = fleet.saveable_nodes(cluster) if builds.enabled() else []
    return {"save_nodes": nodes, "save_form": SaveImageForm()}


def _cluster_context(cluster: Cluster, person) -> dict:
    return {
        **_cluster_status_context(cluster),
        "volumes": cluster.volumes.all(),
        **_keys_context(cluster, person),
        **_metrics_context(cluster),
        **_save_image_context(cluster),
    }


def _keys_context(cluster: Cluster, person) -> dict:
    """The keys attached to the cluster (a team's: its people's), and the person's others
    (to attach): SSH keys are always a person's own, whoever they act for."""
    attached = list(cluster.ssh_keys.select_related("owner").order_by("pk"))
    others = SshKey.objects.filter(owner=person).exclude(pk__in=[k.pk for k in attached])
    return {"ssh_keys": attached, "other_keys": list(others)}


def _metrics_context(cluster: Cluster, job: Job | None = None) -> dict:
    """What the utilisation charts need: stored samples to start from (a job's: its own),
    and the live websocket while the cluster (or the job) runs."""
    live = cluster.state == Cluster.State.RUNNING and (job is None or not job.is_ended)
    step = 0  # seconds a stored chart's point pair stands for, when decimated
    if job is None:
        resolution, history = "second", metrics.cluster_recent(cluster)
    elif live:
        since = timezone.now() - timedelta(seconds=600)
        resolution, recent = metrics.job_rows(job, since=since)
        history = metrics.as_series(recent)
    else:
        resolution, rows, step = metrics.job_chart(job)
        history = metrics.as_series(rows)
    ws = f"/ws/clusters/{cluster.pk}/metrics/"
    over = job.is_ended if job else cluster.state in (Cluster.State.RELEASED, Cluster.State.FAILED)
    return {
        "metrics_history": history,
        "metrics_resolution": resolution,
        "metrics_step": step,
        "metrics_ws": ws if live and (job is None or job.started_at) else "",
        # Where a page that waits for its job (or cluster) to run connects once it does.
        "metrics_ws_later": "" if over else ws,
        "metrics_job": job.pk if job else "",
        "emulated": cluster.node_set.filter(host__emulated_gpu=True).exists(),
    }


@login_required
def cluster_detail(request, cluster_id: int):
    cluster = fleet.cluster_for_user(request.actor, cluster_id)
    context = _cluster_context(cluster, request.user)
    context["cost"] = money.cluster_cost(cluster)  # billing/_cluster_cost.html polls itself
    context["logins"] = ssh_logins(cluster, request)
    context["shutdown_form"] = ShutdownForm(cluster=cluster)  # console/views_shutdown.py
    return render(request, "console/cluster_detail.html", context)


@login_required
def cluster_status(request, cluster_id: int):
    """The parts of the cluster page that change (state, nodes, timeline, jobs; its actions
    when the state differs from the one the page shows, `shown`); polled with htmx until
    the cluster is released. The page starts its charts when this says it ran."""
    cluster = fleet.cluster_for_user(request.actor, cluster_id)
    changed = request.GET.get("shown") != cluster.state
    context = {**_cluster_status_context(cluster), "oob": True, "state_changed": changed}
    if changed:  # the login card comes (or goes) with the state, like the actions
        context.update(
            logins=ssh_logins(cluster, request),
            **_keys_context(cluster, request.user),
            volumes=cluster.volumes.all(),
            **_save_image_context(cluster),
        )
    response = render(request, "console/_cluster_status.html", context)
    ended = cluster.state in (Cluster.State.RELEASED, Cluster.State.FAILED)
    if request.headers.get("HX-Request") and ended and changed:
        response["HX-Refresh"] = "true"  # released: redraw the whole page (final cost too)
    return response


@login_required
@require_POST
def cluster_release(request, cluster_id: int):
    cluster = fleet.cluster_to_change(request.actor, cluster_id)
    if cluster.state in (Cluster.State.RELEASED, Cluster.State.FAILED):
        messages.warning(
            request,
            _("Cluster %(name)s is already %(state)s.")
            % {"name": cluster.name, "state": cluster.get_state_display()},
        )
    else:
        cluster_services.cluster_release(
            cluster=cluster,
            reason=Text(gettext_noop("released by %(who)s"), who=request.user.username),
        )
        messages.success(
            request,
            _("Cluster %(name)s released; its GPUs are free again.") % {"name": cluster.name},
        )
    return redirect("cluster_detail", cluster_id=cluster.pk)


@login_required
@require_POST
def cluster_stop(request, cluster_id: int):
    cluster = fleet.cluster_to_use(request.actor, cluster_id)
    if cluster.state == Cluster.State.PENDING and cluster.stopped_at is not None:
        cluster_services.cluster_stop_waiting(
            cluster=cluster,
            reason=Text(gettext_noop("stopped waiting by %(who)s"), who=request.user.username),
        )
        messages.success(
            request, _("Cluster %(name)s no longer waits; it is stopped.") % {"name": cluster.name}
        )
        return redirect("cluster_detail", cluster_id=cluster.pk)
    try:
        cluster_services.cluster_stop(cluster=cluster, by=request.user.username)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        messages.success(
            request,
            _(
                "Cluster %(name)s stopped: its GPUs are free and not charged; its "
                "workspaces keep every file until you start it."
            )
            % {"name": cluster.name},
        )
    return redirect("cluster_detail", cluster_id=cluster.pk)


@login_required
@require_POST
def cluster_start(request, cluster_id: int):
    cluster = fleet.cluster_to_use(request.actor, cluster_id)
    mode = request.POST.get("mode", "gpu")
    short = (
        start_refusal(cluster, mode, actor=request.actor)
        if mode in ("gpu", "wait", "no_gpu")
        else ""
    )
    if short:
        messages.error(request, short)
        return redirect("cluster_detail", cluster_id=cluster.pk)
    try:
        cluster = cluster_services.cluster_start(
            cluster=cluster, mode=mode, by=request.user.username
        )
    except cluster_services.StartBlocked as exc:
        messages.warning(request, " ".join(exc.messages))
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    else:
        done = {
            "gpu": _("Cluster %(name)s is starting on its hosts with its GPUs."),
            "wait": _("Cluster %(name)s waits in line for its GPUs; it starts when they free."),
            "no_gpu": _(
                "Cluster %(name)s is starting without GPUs: files, ssh and the terminal work; "
                "jobs do not."
            ),
        }
        messages.success(request, done[mode] % {"name": cluster.name})
    return redirect("cluster_detail", cluster_id=cluster.pk)


@login_required
@require_POST
def cluster_resize(request, cluster_id: int):
    cluster = fleet.cluster_to_change(request.actor, cluster_id)
    form = ResizeForm(request.POST, cluster=cluster)
    if form.is_valid():
        try:
            cluster = cluster_services.cluster_resize(
                cluster=cluster, nodes=form.cleaned_data["nodes"]
            )
        except ValidationError as exc:
            messages.error(request, " ".join(exc.messages))
        else:
            messages.success(
                request,
                _("Cluster %(name)s now has %(nodes)s node(s).")
                % {"name": cluster.name, "nodes": cluster.nodes},
            )
    else:
        messages.error(request, " ".join(e for errs in form.errors.values() for e in errs))
    return redirect("cluster_detail", cluster_id=cluster.pk)


@login_required
def node_terminal(request, cluster_id: int, index: int):
    """A shell in the node's workspace, in the browser (console/terminal.py). Its owner's
    only; the socket says why when there is no workspace to reach."""
    cluster = fleet.cluster_to_use(request.actor, cluster_id)
    login = next((x for x in ssh_logins(cluster, request) if x.node == index), None)
    return render(
        request,
        "console/terminal.html",
        {"cluster": cluster, "index": index, "login": login,
         "ws": f"/ws/clusters/{cluster.pk}/nodes/{index}/terminal/"},
    )  # fmt: skip


# -- SSH keys -------------------------------------------------------------------------------


@login_required
def ssh_keys(request):
    form = SshKeyForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            key = cluster_services.ssh_key_add(
                owner=request.user,
                name=form.cleaned_data["name"],
                public_key=form.cleaned_data["public_key"],
                is_default=form.cleaned_data["is_default"],
            )
        except ValidationError as exc:
            form.add_error("public_key", exc.messages[0])
        else:
            messages.success(
                request,
                _("Key %(name)s added (%(fingerprint)s).")
                % {"name": key.name, "fingerprint": key.fingerprint},
            )
            return redirect("ssh_keys")
    keys = SshKey.objects.filter(owner=request.user)
    return render(request, "console/ssh_keys.html", {"form": form, "keys": keys})


@login_required
@require_POST
def ssh_key_delete(request, key_id: int):
    key = get_object_or_404(SshKey, pk=key_id, owner=request.user)
    cluster_services.ssh_key_delete(key=key)
    messages.success(
        request,
        _("Key %(name)s removed: it logs in to none of your clusters any more.")
        % {"name": key.name},
    )
    return redirect("ssh_keys")


@login_required
@require_POST
def ssh_key_default(request, key_id: int):
    """Tick or untick the key for every new cluster ("default for new clusters")."""
    key = get_object_or_404(SshKey, pk=key_id, owner=request.user)
    is_default = request.POST.get("is_default") == "1"
    cluster_services.ssh_key_set_default(key=key, is_default=is_default)
    message = (
        _("Key %(name)s is now ticked for every new cluster.")
        if is_default
        else _("Key %(name)s is no longer ticked for new clusters.")
    )
    messages.success(request, message % {"name": key.name})
    return redirect("ssh_keys")


def _own_key(user, raw) -> SshKey:
    """One of the user's own keys by its id as posted; anything else (another's key, no
    such key, not a number) is 404 alike."""
    try:
        return SshKey.objects.get(pk=int(raw), owner=user)
    except (TypeError, ValueError, SshKey.DoesNotExist):
        raise Http404("No such key.") from None


@login_required
@require_POST
def cluster_key_attach(request, cluster_id: int):
    """Attach one of the person's own keys (whoever they act for) to a cluster they may
    use: it logs in from the next login on, no restart."""
    cluster = fleet.cluster_to_use(request.actor, cluster_id)
    key = _own_key(request.user, request.POST.get("key"))
    try:
        cluster_services.ssh_key_attach(cluster=cluster, key=key)
    except ValidationError as exc:
        messages.error(request, exc.messages[0])
    else:
        messages.success(
            request,
            _("Key %(key)s attached to cluster %(cluster)s: it logs in from now on.")
            % {"key": key.name, "cluster": cluster.name},
        )
    return redirect(reverse("cluster_detail", args=[cluster.pk]) + "#cluster-login")


@login_required
@require_POST
def cluster_key_detach(request, cluster_id: int, key_id: int):
    """Detach a key: its next login is refused, its open connections end. The person's
    own key from a cluster they may use; another person's from a team cluster, an admin
    or the owner of the team only."""
    cluster = fleet.cluster_for_user(request.actor, cluster_id)
    key = fleet.key_to_detach(request.actor, cluster, key_id)
    if cluster_services.ssh_key_detach(cluster=cluster, key=key):
        messages.success(
            request,
            _("Key %(key)s detached from cluster %(cluster)s: it logs in no more.")
            % {"key": key.name, "cluster": cluster.name},
        )
    return redirect(reverse("cluster_detail", args=[cluster.pk]) + "#cluster-login")


# -- operator pages ---------------------------------------------------------------------------


@operator_required("jobs.view_cluster")
def ops_queue(request):
    now = timezone.now()
    pending = fleet.queue(now=now)  # in line, each with its position, account and why
    return render(
        request,
        "console/ops_queue.html",
        {
            "pending": pending,
            "half_life": settings.SUANLI_FAIRSHARE_HALF_LIFE_H,
            "max_wait": settings.SUANLI_FAIRSHARE_MAX_WAIT_H,
        },
    )


@operator_required("jobs.drain_host")
@require_POST
def ops_host_drain(request, host_id: int):
    host = get_object_or_404(Host, pk=host_id)
    draining = request.POST.get("draining") == "1"
    host = host_services.host_set_draining(host=host, draining=draining)
    if draining:
        messages.success(
            request,
            _("Host %(host)s is draining: no new placements; running nodes stay.")
            % {"host": host.name},
        )
    else:
        messages.success(request, _("Host %(host)s takes new work again.") % {"host": host.name})
    return redirect("ops_hosts")


@operator_required("jobs.reclaim_spot")
@require_POST
def ops_host_reclaim(request, host_id: int):
    """Take a host's spot capacity back: every running spot cluster with a node on it gets
    its preemption notice (all of its nodes, wherever they are)."""
    host = get_object_or_404(Host, pk=host_id)
    preempted = host_services.host_reclaim_spot(host=host, by=request.user.username)
    if preempted:
        names = ", ".join(c.name for c in preempted)
        messages.success(
            request,
            _(
                "Reclaiming spot capacity on %(host)s: preempting %(names)s. Their jobs get the "
                "notice and run their preemption scripts; the clusters wait in the queue again "
                "and may be placed here again unless the host is drained or the GPUs taken."
            )
            % {"host": host.name, "names": names},
        )
    else:
        messages.info(
            request,
            _("No running spot cluster on %(host)s: nothing to reclaim.") % {"host": host.name},
        )
    return redirect("ops_hosts")


# -- jobs ----------------------------------------------------------------------------------


@login_required
def job_new(request, cluster_id: int):
    cluster = fleet.cluster_to_use(request.actor, cluster_id)
    form = JobForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            job = cluster_services.job_submit(cluster=cluster, spec=form.spec())
        except ValidationError as exc:
            form.add_error(None, " ".join(exc.messages))
        else:
            messages.success(
                request,
                _("Job %(job)s queued on %(cluster)s.")
                % {"job": job.name, "cluster": cluster.name},
            )
            return redirect("job_detail", job_id=job.pk)
    volumes = list(cluster.volumes.all())
    checkpoint_dir = str(form["checkpoint_dir"].value() or "")
    profile_base, profile_kept = storage.profile_base(volumes, checkpoint_dir)
    return render(
        request,
        "console/job_new.html",
        {
            "form": form,
            "cluster": cluster,
            "volumes": volumes,
            "checkpoint_dir": checkpoint_dir,
            "checkpoint_volume": storage.covering_volume(volumes, checkpoint_dir),
            "preempt_script_s": settings.SUANLI_PREEMPT_SCRIPT_S,
            "profile_base": profile_base,
            "profile_kept": profile_kept,
        },
    )


def _job_status_context(job: Job, actor) -> dict:
    return {
        "job": job,
        "replicas": job.replicas.filter(attempt=job.attempt).select_related("host"),
        "events": job.events.all(),
        "position": fleet.queue_position_of_job(job),
        "cluster": job.cluster,
        # The budget's line for the owner's people only, as the budget card: an operator
        # reading another researcher's job sees its pace and cost, not what it may spend.
        "panel": projection_panel.job_panel(job, own=job.owner_id == actor.principal.pk),
    }


@login_required
def job_detail(request, job_id: int):
    job = fleet.job_for_user(request.actor, job_id)
    charts = _metrics_context(job.cluster, job)
    log_lines = fleet.job_log_lines(job) if job.is_ended else []
    return render(
        request,
        "console/job_detail.html",
        {
            **_job_status_context(job, request.actor),
            "log_lines": log_lines,
            # A replica's log is a node's: under torchrun it holds several ranks' prints.
            "key_averages_by_node": job.launcher == Job.Launcher.TORCHRUN,
            "key_averages": _last_per_rank(
                keyavg.parse_tables((rank, text) for _ts, rank, text in log_lines)
            ),
            "findings": metrics.diagnosis(job) if job.started_at else [],
            "profile_findings": profiles.diagnosis(job) if job.started_at else [],
            # What the card says when nothing was found: too short to judge, or no GPU.
            "diagnosis_verdict": verdict(
                charts["metrics_history"],
                step_s=charts["metrics_step"],
                period_s=60 if charts["metrics_resolution"] == "minute" else 1,
            ),
            **charts,
        },
    )


def _last_per_rank(tables: list, ranks: int = 64) -> list:
    """The last key_averages table each rank printed (the one its profile ended with), for
    at most `ranks` ranks: what the page shows, whatever the log repeats."""
    last = {table.rank: table for table in tables}
    return [last[rank] for rank in sorted(last)[:ranks]]


@login_required
def job_status(request, job_id: int):
    """The parts of the job page that change (state, attempt, replicas, timeline); polled
    with htmx until the job ends. The page starts its charts when this says it started."""
    job = fleet.job_for_user(request.actor, job_id)
    response = render(
        request,
        "console/_job_status.html",
        {**_job_status_context(job, request.actor), "oob": True},
    )
    if request.headers.get("HX-Request") and job.is_ended:
        response["HX-Refresh"] = "true"  # ended: redraw the whole page (stored charts, log)
    return response


@login_required
def job_log(request, job_id: int):
    """The whole stored log as text, rank-labelled; readable after the containers are gone."""
    job = fleet.job_for_user(request.actor, job_id)
    body = "".join(f"{ts} [rank {rank}] {text}\n" for ts, rank, text in fleet.job_log_lines(job))
    response = HttpResponse(body, content_type="text/plain; charset=utf-8")
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", job.name[:40]).strip("-.") or "job"
    response["Content-Disposition"] = f'attachment; filename="job-{job.pk}-{safe}.log"'
    return response


@login_required
@require_POST
def job_cancel(request, job_id: int):
    job = fleet.job_to_cancel(request.actor, job_id)
    try:
        cluster_services.job_cancel(job=job, by=request.user.username)
    except ValidationError as exc:
        messages.warning(request, " ".join(exc.messages))
    else:
        messages.success(
            request,
            _("Cancelling %(job)s: its replicas get SIGTERM, then SIGKILL.") % {"job": job.name},
        )
    return redirect("job_detail", job_id=job.pk)

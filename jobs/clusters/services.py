"""The console's verbs on clusters and jobs: clusters created (from a checked spec,
jobs/clusters/spec.py), resized, stopped, started and released; jobs submitted and cancelled;
SSH keys. Keyword-only, atomic where they span rows. The host verbs are jobs/hosts/services.py.

Layer: clusters, under pools, tasks, admin and management. Uses spec (what a request may ask),
placement (capacity for a resize, slots, restart for a start), access (webapps: a stop
forgets its apps), nodes (runtime, workspaces),
events (lifecycle, timeline), files (storage, pub), models and base; never runs (a job is
started or stopped by task name, through lifecycle). The verbs that packages below it share
live in `jobs.events.lifecycle` and are re-exported here, so callers keep
`services.cluster_release(...)`.
"""

import logging
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count
from django.http import Http404
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop, ngettext

from jobs.access import webapps
from jobs.base import validators
from jobs.base.queue import enqueue_by_name, enqueue_unique
from jobs.base.text import Moment, Text, join, show
from jobs.clusters.spec import ClusterSpec
from jobs.events.lifecycle import cancel_jobs_of, free_nodes, request_dispatch, request_stop

# The lifecycle's verbs, used through `services.` by the console, billing and the admin.
from jobs.events.lifecycle import cluster_preempt as cluster_preempt
from jobs.events.lifecycle import cluster_release as cluster_release
from jobs.events.lifecycle import request_placement as request_placement
from jobs.events.timeline import cluster_event, job_event, reason_fields, set_reason
from jobs.files import pub, storage
from jobs.files.storage import VolumeSpec as VolumeSpec  # callers' name for a volume
from jobs.models import (
    Cluster,
    GpuSlot,
    Host,
    Job,
    Node,
    Pool,
    SshKey,
    Team,
    Volume,
)
from jobs.nodes import runtime, workspaces
from jobs.placement import capacity, restart, slots
from jobs.tenancy.actors import Actor


@transaction.atomic
def cluster_create(*, owner, spec: ClusterSpec, created_by=None) -> Cluster:
    """`owner` is whom it is rented for (a researcher, or a team's principal); `created_by`
    the person who asked (default: the owner). A team member who makes one is added to it."""
    if spec.pub and (why := pub.volumes_refusal(spec.volumes)):
        raise ValidationError(why)
    now = timezone.now()
    created_by = created_by or owner
    cluster = Cluster.objects.create(
        owner=owner,
        created_by=created_by,
        name=spec.name,
        gpu_model=spec.gpu_model,
        gpus_per_node=0 if spec.instance_type else spec.gpus_per_node,
        instance_type=spec.instance_type,
        nodes=spec.nodes,
        image=spec.image,
        image_reference=spec.image_reference or (spec.image.reference if spec.image else ""),
        own_image=spec.own_image,
        network=spec.network,
        zone=spec.zone,
        spot=spec.spot,
        pub=spec.pub,
        workspace=spec.workspace,
        release_policy=spec.release_policy,
        idle_minutes=spec.idle_minutes
        if spec.release_policy == Cluster.ReleasePolicy.IDLE
        else None,
        state=Cluster.State.PENDING,
        **reason_fields(Cluster, Text(gettext_noop("waiting for the scheduler"))),
        created_at=now,
        queued_at=now,
        last_active_at=now,
        pool=spec.pool,
        stop_at=spec.stop_at,
        stop_idle_minutes=spec.stop_idle_minutes,
        stop_idle_below=spec.stop_idle_below,
        budget=spec.budget,
    )
    Volume.objects.bulk_create(
        [
            Volume(cluster=cluster, source=v.source, target=v.target, read_only=v.read_only)
            for v in spec.volumes
        ]
    )
    if created_by.pk != owner.pk:
        cluster.members.add(created_by)
    if spec.ssh_keys:
        cluster.ssh_keys.set(spec.ssh_keys)
    storage.ensure_folders(
        storage.tenant_root(owner.pk),
        list(spec.volumes),
        uid=runtime.tenant_uid(owner.pk),
        quota=True,
    )
    cluster_event(
        cluster, "pending", Text(gettext_noop("requested %(shape)s"), shape=cluster.shape), at=now
    )
    request_placement()
    return cluster


@transaction.atomic
def cluster_resize(*, cluster: Cluster, nodes: int) -> Cluster:
    """Add or remove nodes of a running cluster. Added nodes are placed now or not at all."""
    cluster, live = _resizable(cluster, nodes)
    now = timezone.now()
    if nodes < len(live):
        message = _shrink(live, nodes, now)
    else:
        message = _grow(cluster, live, nodes, now)
    cluster.nodes = nodes
    cluster.last_active_at = now
    cluster.save(update_fields=["nodes", "last_active_at"])
    cluster_event(cluster, "resized", message, at=now)
    # The network may change (one host to several) and new nodes need their workspaces.
    enqueue_by_name("jobs.tasks.cluster_network_ensure", cluster.pk, job_id=f"net-{cluster.pk}")
    return cluster


def _resizable(cluster: Cluster, nodes: int) -> tuple[Cluster, list[Node]]:
    """The cluster locked and read again, refused unless it runs with its GPUs, no job of
    it is active and `nodes` is another count within the most; with its live nodes."""
    cluster = (
        Cluster.objects.select_for_update(of=("self",))
        .select_related("gpu_model", "instance_type")
        .get(pk=cluster.pk)
    )
    if cluster.state != Cluster.State.RUNNING:
        raise ValidationError(
            _("Only a running cluster can be resized; this one is %(state)s.")
            % {"state": cluster.get_state_display()}
        )
    if cluster.no_gpu:
        raise ValidationError(
            _(
                "A cluster running without GPUs cannot be resized: stop it and start it with "
                "GPUs first."
            )
        )
    active = cluster.jobs.filter(state__in=Job.ACTIVE).first()
    if active is not None:
        raise ValidationError(
            _("Job %(job)s is %(state)s: resize when no job runs (cancel it or wait).")
            % {"job": active.name, "state": active.get_state_display()}
        )
    if not 1 <= nodes <= settings.SUANLI_MAX_NODES:
        raise ValidationError(
            _("A cluster has 1 to %(max)s nodes.") % {"max": settings.SUANLI_MAX_NODES}
        )
    live = list(cluster.node_set.filter(released_at__isnull=True).order_by("index"))
    if nodes == len(live):
        raise ValidationError(
            ngettext(
                "The cluster already has %(n)s node.", "The cluster already has %(n)s nodes.", nodes
            )
            % {"n": nodes}
        )
    return cluster, live


def _shrink(live: list[Node], nodes: int, now) -> Text:
    """The nodes past `nodes` released; the timeline's words for it."""
    free_nodes(live[nodes:], now)
    request_placement()
    return Text(
        gettext_noop("%(before)s -> %(nodes)s nodes: released %(released)s"),
        before=len(live),
        nodes=nodes,
        released=join([Text(gettext_noop("node %(index)s"), index=n.index) for n in live[nodes:]]),
    )


def _grow(cluster: Cluster, live: list[Node], nodes: int, now) -> Text:
    """The added nodes placed now, on hosts that share a network with the cluster's, or
    ValidationError saying why not; the timeline's words for it."""
    before = len(live)
    fleet = capacity.Fleet.load()
    extra = Cluster(
        pk=cluster.pk,
        gpu_model=cluster.gpu_model,
        instance_type=cluster.instance_type,
        gpus_per_node=cluster.gpus_per_node,
        nodes=nodes - before,
        network=cluster.network,
        # RDMA clusters stay in their zone; others prefer it but may not need to.
        zone=cluster.zone or (live[0].host.zone if cluster.network == Cluster.Network.RDMA else ""),
    )
    hosts = fleet.plan(extra)
    if hosts is None:
        why = show(capacity.shortage(extra, fleet).as_json())
        raise ValidationError(
            _("No room for %(what)s.") % {"what": why.removeprefix("waiting for ")}
        )
    if not fleet.one_network([n.host_id for n in live] + hosts):
        raise ValidationError(
            _(
                "The room for the new nodes is on hosts that cannot share a network with "
                "this cluster's (they are not in one Docker swarm); release it and create "
                "one of %(nodes)s nodes instead."
            )
            % {"nodes": nodes}
        )
    try:
        added = slots.place_nodes(cluster=cluster, hosts=hosts, first_index=before, now=now)
    except capacity.Conflict:
        raise ValidationError(
            _("The capacity was just taken by another request; try again.")
        ) from None
    return Text(
        gettext_noop("%(before)s -> %(nodes)s nodes: %(placed)s"),
        before=before,
        nodes=nodes,
        placed=slots.placed_text(added),
    )


# -- stop and start (关机 / 开机) ------------------------------------------------------------


class StartBlocked(ValidationError):
    """A stopped cluster's GPUs on the hosts that keep its workspaces are taken: the
    researcher may wait in line for them or start without GPUs."""


ITS_OWNER = Text(gettext_noop("its owner"))


def cluster_stop(
    *, cluster: Cluster, by: str | Text = ITS_OWNER, reason: Text | None = None,
    limited: bool = True,
) -> Cluster:  # fmt: skip
    """Stop a running cluster: its jobs are cancelled (as on release), its GPUs go back to
    the pool and are not charged from this second, and its workspaces are stopped but kept
    on their hosts (every file of theirs stays) until it is started or released.

    `reason` replaces "stopped by <by>" as its state reason (e.g. billing's "stopped:
    balance exhausted"); `limited=False` stops it even past its owner's most stopped
    clusters: billing's stop at an exhausted balance alone (it must not cost the researcher
    files, and her running quota bounds it); a shutdown rule's stop is limited."""
    with transaction.atomic():
        cluster = Cluster.objects.select_for_update(of=("self",)).get(pk=cluster.pk)
        _check_stoppable(cluster, limited=limited)
        now = timezone.now()
        reason = reason or Text(gettext_noop("stopped by %(by)s"), by=by)
        cancel_jobs_of(cluster, reason)
        live = list(cluster.node_set.filter(released_at__isnull=True))
        free_nodes(live, now)
        Node.objects.filter(pk__in=[n.pk for n in live]).update(stopped_at=now)
        cluster.state = Cluster.State.STOPPED
        said = set_reason(cluster, reason)
        cluster.stopped_at = now
        cluster.release_warned_at = None
        cluster.running_since = None
        cluster.save(
            update_fields=[
                "state",
                *said,
                "stopped_at",
                "release_warned_at",
                "running_since",
            ]
        )
        webapps.forget(cluster.pk)  # the apps stop with the workspaces
        gpus = _returned(cluster)
        cluster_event(
            cluster,
            "stopped",
            Text(
                gettext_noop(
                    "%(reason)s: %(gpus)s, not charged for them from now; workspaces kept on "
                    "%(hosts)s"
                ),
                reason=reason,
                gpus=gpus,
                hosts=", ".join(sorted({n.host.name for n in live})),
            ),
            at=now,
        )
        request_placement()
        transaction.on_commit(
            lambda: enqueue_by_name(
                "jobs.tasks.cluster_workspaces_stop", cluster.pk, job_id=f"ws-stop-{cluster.pk}"
            )
        )
    return cluster


TOO_MANY_STOPPED = "too_many_stopped"  # the code of the refusal past the most stopped clusters


def _check_stoppable(cluster: Cluster, *, limited: bool = True) -> None:
    """Refuse, in words, a stop that cannot be: not running, no workspaces to keep, or
    (`limited`) one stopped cluster too many for its owner."""
    if cluster.state != Cluster.State.RUNNING:
        raise ValidationError(
            _("Only a running cluster can be stopped; %(name)s is %(state)s.")
            % {"name": cluster.name, "state": cluster.get_state_display()}
        )
    if not cluster.workspace:
        raise ValidationError(
            _(
                "%(name)s has no workspaces (it was created for jobs only), so a stop "
                "would keep nothing: release it instead."
            )
            % {"name": cluster.name}
        )
    if not limited:
        return
    kept = (
        Cluster.objects.filter(owner_id=cluster.owner_id, stopped_at__isnull=False)
        .filter(state__in=[Cluster.State.STOPPED, Cluster.State.PENDING])
        .count()
    )
    if kept >= settings.SUANLI_MAX_STOPPED_CLUSTERS:
        raise ValidationError(  # its code and count: the shutdown tick says it in its words
            _(
                "You keep %(kept)s stopped clusters already, the most one researcher may "
                "(their workspaces take disk on the hosts): release one, then stop this one."
            ),
            code=TOO_MANY_STOPPED,
            params={"kept": kept},
        )


def _returned(cluster: Cluster) -> Text:
    """What a stop gives back, for its timeline event: its GPUs, or its capacity."""
    return (
        Text(
            gettext_noop("%(n)s GPU returned")
            if cluster.total_gpus == 1
            else gettext_noop("%(n)s GPUs returned"),
            n=cluster.total_gpus,
        )
        if cluster.total_gpus and not cluster.no_gpu
        else Text(gettext_noop("capacity returned"))
    )


def _kept(cluster: Cluster) -> list[Node]:
    return list(
        cluster.node_set.filter(stopped_at__isnull=False, kept_until__isnull=True)
        .select_related("host")
        .order_by("index")
    )


START_MODES = ("gpu", "wait", "no_gpu")


def cluster_start(*, cluster: Cluster, mode: str = "gpu", by: str | Text = ITS_OWNER) -> Cluster:
    """Start a stopped cluster on the hosts that keep its workspaces, in one of the
    `START_MODES` (the page's and the API's word for it):

    * "gpu": `cluster_start_with_gpus`;
    * "wait": `cluster_start_in_line`;
    * "no_gpu": `cluster_start_without_gpus`.
    """
    flows = {
        "gpu": cluster_start_with_gpus,
        "wait": cluster_start_in_line,
        "no_gpu": cluster_start_without_gpus,
    }
    if mode not in flows:
        raise ValidationError(
            _("Unknown start mode %(mode)s: gpu, wait or no_gpu.") % {"mode": repr(mode)}
        )
    return flows[mode](cluster=cluster, by=by)


def _startable(cluster: Cluster, *, waiting_too: bool = False) -> tuple[Cluster, list[Node]]:
    """The first steps of every start, inside its transaction: the cluster locked and read
    again; refused unless it is stopped (or, `waiting_too`, waiting in line after a stop),
    while a job of it still stops, or when it keeps no workspace; the filesystem's quota
    again from what the owner bought (MooseFS), once per start. Returns it and its kept
    nodes."""
    cluster = (
        Cluster.objects.select_for_update(of=("self",))
        .select_related("gpu_model", "instance_type")
        .get(pk=cluster.pk)
    )
    waiting = cluster.state == Cluster.State.PENDING and cluster.stopped_at is not None
    if not (cluster.state == Cluster.State.STOPPED or (waiting and waiting_too)):
        raise ValidationError(
            _(
                "Only a stopped cluster can be started; %(name)s is waiting in line for "
                "its GPUs already."
            )
            % {"name": cluster.name}
            if waiting
            else _("Only a stopped cluster can be started; %(name)s is %(state)s.")
            % {"name": cluster.name, "state": cluster.get_state_display()}
        )
    stopping = cluster.jobs.filter(state__in=Job.ACTIVE).first()
    if stopping is not None:
        raise ValidationError(
            _(
                "Job %(job)s is still stopping (SIGTERM, then SIGKILL after %(grace)s s): "
                "start the cluster once it has ended."
            )
            % {"job": stopping.name, "grace": settings.SUANLI_STOP_GRACE_S}
        )
    kept = _kept(cluster)
    if not kept:
        raise ValidationError(
            _("%(name)s keeps no workspaces; release it.") % {"name": cluster.name}
        )
    storage.quota_apply(cluster.owner_id)
    return cluster, kept


@transaction.atomic
def cluster_start_without_gpus(*, cluster: Cluster, by: str | Text = ITS_OWNER) -> Cluster:
    """Start a stopped (or waiting) GPU cluster at once without GPUs: its workspaces alone,
    a small CPU and memory share, billed per node-hour at the no-GPU price; no jobs."""
    cluster, kept = _startable(cluster, waiting_too=True)
    now = timezone.now()
    if cluster.is_cpu_only:
        raise ValidationError(_("A CPU-only cluster has no GPUs to leave out: start it as it is."))
    full = _no_gpu_room(cluster, kept)
    if full:
        raise ValidationError(full)
    unhealthy = [n.host.name for n in kept if n.host.state in Host.UNHEALTHY]
    if unhealthy:
        raise ValidationError(
            _(
                "Host %(host)s, which keeps its workspace, is %(state)s: start it when "
                "the host is back."
            )
            % {
                "host": unhealthy[0],
                "state": Host.objects.get(name=unhealthy[0]).get_state_display(),
            }
        )
    fresh = Node.objects.bulk_create(
        [
            Node(cluster=cluster, index=n.index, host_id=n.host_id, gpu_indices=[],
                 vcpus=0, no_gpu=True, placed_at=now)
            for n in kept
        ]
    )  # fmt: skip
    started = Text(
        gettext_noop("started without GPUs by %(by)s: %(nodes)s"),
        by=by,
        # The new nodes (no GPU), not the kept ones: the timeline names no GPU they lack.
        nodes=slots.nodes_text(fresh, {n.host_id: n.host.name for n in kept}),
    )
    _started(cluster, kept, now, no_gpu=True, message=started)
    return cluster


@transaction.atomic
def cluster_start_in_line(*, cluster: Cluster, by: str | Text = ITS_OWNER) -> Cluster:
    """Put a stopped cluster in line for its GPUs on the hosts that keep its workspaces
    (pending; placement starts it there when they free)."""
    cluster, kept = _startable(cluster)
    now = timezone.now()
    why = Text(gettext_noop("waiting for its GPUs on the hosts that keep its workspaces"))
    Cluster.objects.filter(pk=cluster.pk).update(
        state=Cluster.State.PENDING, queued_at=now, no_gpu=False,
        **reason_fields(Cluster, why),
    )  # fmt: skip
    cluster_event(
        cluster,
        "waiting",
        Text(
            gettext_noop("%(by)s chose to wait in line for its GPUs on %(hosts)s"),
            by=by,
            hosts=", ".join(sorted({n.host.name for n in kept})),
        ),
        at=now,
    )
    request_placement()
    cluster.refresh_from_db()
    return cluster


@transaction.atomic
def cluster_start_with_gpus(*, cluster: Cluster, by: str | Text = ITS_OWNER) -> Cluster:
    """Start a stopped cluster with its GPUs now, or StartBlocked (words for the page) when
    they are taken. Where the hosts that keep its workspaces have no room (or take no work)
    and its workspaces' root filesystems are saved in the registry (workspaces.save), it
    starts on other hosts with its GPU model, its workspaces made there from the saves
    (its volumes are on every host)."""
    cluster, kept = _startable(cluster)
    now = timezone.now()
    hosts = _start_hosts(cluster, kept)
    # GPUs its own stop still holds (its workspaces not confirmed stopped yet) are its
    # own processes': it takes them back as they are, no other tenant comes between.
    # Only the kept nodes' own, where they stay: a node a resize or a move left may
    # still run elsewhere.
    staying = [n for n, host_id in zip(kept, hosts, strict=True) if n.host_id == host_id]
    _own_held(cluster).filter(node__in=staying).update(node=None)
    try:
        nodes = slots.place_nodes(
            cluster=cluster, hosts=hosts, first_index=0, now=now,
            prefer=[n.gpu_indices if n in staying else [] for n in kept],
        )  # fmt: skip
    except capacity.Conflict:
        raise StartBlocked(
            _("Its capacity there was just taken by another request: wait in line for it.")
            if cluster.is_cpu_only
            else _(
                "Its capacity there was just taken by another request: wait in line for it "
                "or start without GPUs."
            ),
            code="gpus_taken",
        ) from None
    restart.carry_saves(kept, nodes)
    _started(cluster, kept, now, no_gpu=False, message=_started_words(kept, nodes, hosts, by))
    return cluster


def _start_hosts(cluster: Cluster, kept: list[Node]) -> list[int]:
    """The host of each kept node for a start with GPUs: its own where they have room;
    else, from the saves of its workspaces, others with its GPU model; else StartBlocked."""
    hosts = [n.host_id for n in kept]
    blocked = _why_blocked(cluster, kept)
    if not blocked:
        return hosts
    # Its hosts have no room: another with its GPU model takes it where its workspaces'
    # root filesystems are saved (its volumes are on every host).
    hosts = restart.plan_elsewhere(cluster, capacity.Fleet.load(), kept)
    if hosts is None:
        raise StartBlocked(_saving(cluster, kept, blocked), code="gpus_taken")
    return hosts


def _started_words(kept: list[Node], nodes: list[Node], hosts: list[int], by) -> Text:
    """The timeline's words for a start with GPUs: where its nodes run, and whether its
    files and system disk came along to other hosts."""
    names = dict(Host.objects.filter(id__in=set(hosts)).values_list("id", "name"))
    elsewhere = restart.started_elsewhere(kept, nodes, names)
    if elsewhere is not None:
        return Text(
            gettext_noop("started by %(by)s: %(nodes)s; your files and system disk came along"),
            by=by,
            nodes=elsewhere,
        )
    return Text(
        gettext_noop("started by %(by)s: %(nodes)s"),
        by=by,
        nodes=slots.nodes_text(nodes, names),
    )


def _saving(cluster: Cluster, kept: list[Node], blocked: str) -> str:
    """The words of a blocked start, with what a start on another host waits for where it
    would fit elsewhere but its workspaces' root filesystems are not saved yet (the save
    is queued again: its first try may have failed)."""
    if not settings.SUANLI_REGISTRY or restart.movable(kept):
        return blocked
    if restart.plan_elsewhere(cluster, capacity.Fleet.load(), kept, saved=False) is None:
        return blocked
    enqueue_unique(
        "builds",  # the builder's, as after a stop (tasks.cluster_workspaces_stop)
        "jobs.tasks.cluster_workspaces_save",
        cluster.pk,
        job_id=f"ws-save-{cluster.pk}",
        job_timeout=workspaces.save_timeout(cluster.pk),
    )
    stopped = cluster.events.filter(kind="stopped").order_by("-at", "-pk").first()
    refused = cluster.events.filter(kind=workspaces.NOT_SAVED)
    if stopped is not None:
        refused = refused.filter(at__gte=stopped.at)
    if refused.exists():  # tried again all the same: images may have been deleted since
        return " ".join(
            [
                blocked,
                _(
                    "Another host has room for it, but its system disk was not saved: your "
                    "image quota is full (see its timeline). Delete images you no longer "
                    "need, then try again in a few minutes."
                ),
            ]
        )
    return " ".join(
        [
            blocked,
            _(
                "Another host has room for it: its system disk is being saved to start it "
                "there; try again in a few minutes."
            ),
        ]
    )


@transaction.atomic
def cluster_stop_waiting(*, cluster: Cluster, reason: str | Text) -> bool:
    """A stopped cluster waiting in line to start again goes back to stopped (its files
    kept): e.g. its owner's balance ran out. False when it was not waiting (any more)."""
    cluster = Cluster.objects.select_for_update().get(pk=cluster.pk)
    if cluster.state != Cluster.State.PENDING or cluster.stopped_at is None:
        return False
    cancel_jobs_of(
        cluster,
        Text(gettext_noop("cancelled: the cluster stopped waiting (%(reason)s)"), reason=reason),
    )
    Cluster.objects.filter(pk=cluster.pk).update(
        state=Cluster.State.STOPPED, **reason_fields(Cluster, reason)
    )
    cluster_event(
        cluster,
        "stopped",
        Text(gettext_noop("no longer waiting to start: %(reason)s"), reason=reason),
    )
    return True


def _no_gpu_room(cluster: Cluster, kept: list[Node]) -> str:
    """Why the kept hosts take no more workspaces without GPUs ("" when they do): each
    takes SUANLI_NO_GPU_PER_HOST of them, beside the GPU nodes' shares of the host. Their
    rows are locked (in id order) so that two starts cannot both take the last place."""
    hosts = sorted({n.host_id for n in kept})
    list(Host.objects.select_for_update().filter(pk__in=hosts).order_by("id").values("id"))
    running = dict(
        Node.objects.filter(host_id__in=hosts, no_gpu=True, released_at__isnull=True)
        .exclude(cluster=cluster)
        .values_list("host_id")
        .annotate(n=Count("id"))
    )
    for node in kept:
        wanted = sum(1 for n in kept if n.host_id == node.host_id)
        if running.get(node.host_id, 0) + wanted > settings.SUANLI_NO_GPU_PER_HOST:
            return _(
                "Host %(host)s, which keeps the workspace of node %(index)s, runs %(running)s "
                "workspaces without GPUs already, the most it takes: wait in line for its GPUs, "
                "or start without GPUs a little later."
            ) % {
                "host": node.host.name,
                "index": node.index,
                "running": running.get(node.host_id, 0),
            }
    return ""


def start_blocked(cluster: Cluster) -> str:
    """Why a stopped cluster cannot start with its GPUs now ("" when it can): for its page,
    which then offers to wait in line or to start without GPUs. Reads only."""
    if cluster.state != Cluster.State.STOPPED:
        return ""
    kept = _kept(cluster)
    blocked = _why_blocked(cluster, kept)
    if not blocked or restart.plan_elsewhere(cluster, capacity.Fleet.load(), kept):
        return ""  # room on its hosts, or on another that its saves start it on
    return blocked


def _own_held(cluster: Cluster):
    """The GPU slots the cluster's own ended nodes still hold (lifecycle.free_nodes)."""
    return GpuSlot.objects.filter(node__cluster=cluster, node__released_at__isnull=False)


def _why_blocked(cluster: Cluster, kept: list[Node]) -> str:
    """Words for the page when the kept hosts cannot give the cluster its GPUs now."""
    own = dict(_own_held(cluster).values_list("host_id").annotate(n=Count("id")))
    need: dict[int, int] = {}
    for node in kept:
        need[node.host_id] = need.get(node.host_id, 0) + (
            cluster.gpus_per_node or (cluster.instance_type.vcpus if cluster.is_cpu_only else 0)
        )
    fleet = capacity.Fleet.load(host_ids=need)  # its hosts only: the page asks every poll
    for node in kept:
        cap = fleet.hosts.get(node.host_id)
        if cap is None:
            return _(
                "Host %(host)s, which keeps the workspace of node %(index)s, is %(state)s: it "
                "takes no work now. Wait in line for it, or release the cluster."
            ) % {
                "host": node.host.name,
                "index": node.index,
                "state": node.host.get_state_display(),
            }
        total = cap.cpu_total if cluster.is_cpu_only else cap.gpu_total
        changed = not cluster.is_cpu_only and cap.gpu_model_id != cluster.gpu_model_id
        args = {"host": node.host.name, "index": node.index, "need": need[node.host_id]}
        if changed or total < need[node.host_id]:
            if cluster.is_cpu_only:
                return (
                    _(
                        "Host %(host)s, which keeps the workspace of node %(index)s, no longer has "
                        "%(need)s vCPUs (its operator changed it), so waiting would not help: "
                        "release the cluster."
                    )
                    % args
                )
            return _(
                "Host %(host)s, which keeps the workspace of node %(index)s, no longer has "
                "%(need)s GPUs of %(model)s (its operator changed it), so waiting would not "
                "help: start without GPUs to copy your files out, or release the cluster."
            ) % {**args, "model": cluster.gpu_model}
        free = cap.cpu_free if cluster.is_cpu_only else cap.free + own.get(node.host_id, 0)
        if free < need[node.host_id]:
            args["free"] = max(free, 0)
            if cluster.is_cpu_only:
                return (
                    _(
                        "The vCPUs of host %(host)s, which keeps the workspace of node %(index)s, "
                        "are in use by other clusters: %(need)s needed, %(free)s free. Wait in "
                        "line for them."
                    )
                    % args
                )
            return (
                _(
                    "The GPUs of host %(host)s, which keeps the workspace of node %(index)s, are "
                    "in use by other clusters: %(need)s needed, %(free)s free. Wait in line for "
                    "them, or start without GPUs to reach your files now."
                )
                % args
            )
    return ""


def _started(cluster: Cluster, kept: list[Node], now, *, no_gpu: bool, message: Text) -> None:
    """A stopped (or waiting) cluster runs again on its kept hosts: the kept time ends, its
    workspaces are started (or made again with their files), its timeline says so."""
    # Those a start elsewhere moved are not kept already (restart.carry_saves).
    Node.objects.filter(pk__in=[n.pk for n in kept], kept_until__isnull=True).update(
        kept_until=now, workspace_container=""
    )
    Cluster.objects.filter(pk=cluster.pk).update(
        state=Cluster.State.RUNNING, **reason_fields(Cluster, ""), stopped_at=None,
        release_warned_at=None, running_since=now, last_active_at=now, no_gpu=no_gpu,
    )  # fmt: skip
    # A scheduled stop whose time passed while it was stopped is stale (shutdown.py).
    Cluster.objects.filter(pk=cluster.pk, stop_at__lte=now).update(stop_at=None)
    cluster.refresh_from_db()
    cluster_event(cluster, "running", message, at=now)
    enqueue_by_name("jobs.tasks.cluster_network_ensure", cluster.pk, job_id=f"net-{cluster.pk}")


log = logging.getLogger(__name__)

ORPHANS_HELD = Text(
    gettext_noop(
        "the console: your processes held files deleted but still open, which no quota "
        "counts, while such files filled more than the filesystem allows"
    )
)


def clusters_stop_for_orphans() -> dict:
    """The bound on space no quota counts (jobs/files/storage.py orphans): over the threshold,
    each running cluster of a researcher whose processes hold a deleted-but-open file is
    stopped (its files kept, the processes and so their open files ended), or released
    when it keeps no workspace. Below it, nothing happens: a program's own temporary
    files (opened, unlinked, used) are everyday and small."""
    if not storage.enforced():
        return {"over": False, "stopped": []}
    try:
        found = storage.orphans()
    except storage.QuotaError as exc:
        log.error("storage: deleted-but-open space unknown: %s", exc.messages[0])
        return {"over": None, "stopped": []}
    if not found.over:
        return {"over": False, "stopped": []}
    stopped = []
    running = Cluster.objects.filter(owner_id__in=list(found.by_owner), state=Cluster.State.RUNNING)
    for cluster in running:
        try:
            if cluster.workspace:
                cluster_stop(cluster=cluster, by=ORPHANS_HELD)
            else:
                with transaction.atomic():
                    cluster_release(cluster=cluster, reason=ORPHANS_HELD)
        except ValidationError as exc:  # e.g. at its most stopped clusters: released
            log.warning("cluster %s not stopped for open deleted files: %s", cluster.pk, exc)
            with transaction.atomic():
                cluster_release(cluster=cluster, reason=ORPHANS_HELD)
        stopped.append(cluster.pk)
    log.error(
        "storage: %s GB deleted but still open (over SUANLI_STORAGE_SUSTAINED_MAX_GB=%s): "
        "stopped clusters %s of researchers %s",
        found.sustained_gb, settings.SUANLI_STORAGE_SUSTAINED_MAX_GB, stopped,
        sorted(found.by_owner),
    )  # fmt: skip
    return {"over": True, "stopped": stopped}


def clusters_release_stopped(*, now=None) -> dict[str, list[int]]:
    """Stopped clusters (and those waiting in line to start again) past
    SUANLI_STOPPED_RELEASE_S are released, their workspaces with them; those within a day
    of it are warned once (a timeline entry and the `cluster.release_soon` webhook)."""
    now = now or timezone.now()
    keep = Cluster.kept_stopped()
    warn = now + min(timedelta(days=1), keep)
    out: dict[str, list[int]] = {"released": [], "warned": []}
    stopped = Cluster.objects.filter(
        state__in=[Cluster.State.STOPPED, Cluster.State.PENDING], stopped_at__isnull=False
    )
    for cluster_id in list(stopped.filter(stopped_at__lte=now - keep).values_list("pk", flat=True)):
        with transaction.atomic():
            cluster = Cluster.objects.select_for_update().get(pk=cluster_id)
            if cluster.release_at is None or cluster.release_at > now:
                continue
            days = keep.total_seconds() / 86400
            cluster_release(
                cluster=cluster,
                reason=Text(
                    gettext_noop("released automatically after %(days)s days stopped"),
                    days=f"{days:g}",
                ),
            )
            out["released"].append(cluster_id)
    due = stopped.filter(stopped_at__lte=warn - keep, release_warned_at__isnull=True)
    for cluster in due:
        with transaction.atomic():
            if not Cluster.objects.filter(
                pk=cluster.pk, release_warned_at__isnull=True, stopped_at__isnull=False
            ).update(release_warned_at=now):
                continue
            at = cluster.stopped_at + keep
            cluster_event(
                cluster,
                "release-soon",
                Text(
                    gettext_noop(
                        "stopped since %(since)s: released with its workspaces at %(at)s "
                        "unless started before"
                    ),
                    since=Moment(cluster.stopped_at),
                    at=Moment(at),
                ),
                at=now,
            )
            out["warned"].append(cluster.pk)
    return out


def clusters_release_idle(*, now=None) -> list[int]:
    """Release running clusters whose idle policy has run out. A cluster with a queued or
    active job is never idle, however long that job runs; each candidate is checked again
    under its row lock, so a job submitted meanwhile keeps it."""
    now = now or timezone.now()
    released = []
    candidates = (
        Cluster.objects.filter(
            state=Cluster.State.RUNNING,
            release_policy=Cluster.ReleasePolicy.IDLE,
            idle_minutes__isnull=False,
            no_gpu=False,  # no jobs to measure idleness by: its owner edits files in it
        )
        .exclude(jobs__state__in=[*Job.WAITING, *Job.ACTIVE])
        .values_list("pk", flat=True)
    )
    for cluster_id in list(candidates):
        with transaction.atomic():
            cluster = Cluster.objects.select_for_update().filter(pk=cluster_id).first()
            if (
                cluster is None
                or cluster.state != Cluster.State.RUNNING
                or cluster.last_active_at + timedelta(minutes=cluster.idle_minutes) > now
                or cluster.jobs.filter(state__in=[*Job.WAITING, *Job.ACTIVE]).exists()
            ):
                continue
            cluster_release(
                cluster=cluster,
                reason=Text(
                    gettext_noop("released automatically after %(minutes)s idle minutes"),
                    minutes=cluster.idle_minutes,
                ),
            )
            released.append(cluster.pk)
    return released


def _release_after_last_job(cluster_id: int, job_name: str) -> None:
    """A preempted job cancelled while its cluster waits to be placed again was its last:
    the after-last-job policy releases the cluster (it would otherwise be placed again, and
    charged, for nothing)."""
    with transaction.atomic():
        cluster = Cluster.objects.select_for_update().filter(pk=cluster_id).first()
        if (
            cluster is None
            or cluster.release_policy != Cluster.ReleasePolicy.AFTER_LAST_JOB
            or cluster.state not in (Cluster.State.PENDING, Cluster.State.PREEMPTING)
            or cluster.jobs.filter(state__in=[*Job.WAITING, *Job.ACTIVE]).exists()
        ):
            return
        cluster_release(
            cluster=cluster,
            reason=Text(
                gettext_noop("released automatically after job %(job)s was cancelled"), job=job_name
            ),
        )


# -- spot preemption --------------------------------------------------------------------------


# -- SSH keys -------------------------------------------------------------------------------


# The gateway reads a cluster's keys at every login and every channel it opens
# (jobs/access/admission.py): a key attached to a running cluster logs in at once, a
# detached or removed one is refused at the next login, and a connection already open with
# it gets no new channel and is ended at the gateway's next heartbeat. Nothing is written
# into the containers, so no restart is needed either way.

CLUSTER_OVER = (Cluster.State.RELEASING, Cluster.State.RELEASED, Cluster.State.FAILED)


@transaction.atomic
def ssh_key_add(*, owner, name: str, public_key: str, is_default: bool = False) -> SshKey:
    parsed = validators.parse_ssh_public_key(public_key)
    if SshKey.objects.filter(owner=owner, fingerprint=parsed["fingerprint"]).exists():
        raise ValidationError({"public_key": _("You have added this key already.")})
    return SshKey.objects.create(
        owner=owner,
        name=name or parsed["comment"] or parsed["key_type"],
        public_key=parsed["public_key"],
        key_type=parsed["key_type"],
        bits=parsed["bits"],
        fingerprint=parsed["fingerprint"],
        is_default=is_default,
    )


def ssh_key_set_default(*, key: SshKey, is_default: bool) -> None:
    """Whether the key is ticked for every new cluster its owner requests."""
    SshKey.objects.filter(pk=key.pk).update(is_default=is_default)
    key.is_default = is_default


def ssh_keys_default(owner) -> list[SshKey]:
    """The owner's keys ticked for every new cluster."""
    return list(SshKey.objects.filter(owner=owner, is_default=True))


def _key_words(key: SshKey) -> str:
    return f"{key.name} ({key.fingerprint})"


def _may_hold_key(cluster: Cluster, key: SshKey) -> bool:
    """The owner's own key, or a key of a person who may use the team's cluster now."""
    if key.owner_id == cluster.owner_id:
        return True
    team = Team.objects.filter(principal_id=cluster.owner_id).first()
    if team is None:
        return False
    try:
        return Actor.for_team(key.owner, team.pk).may_use(cluster)
    except Http404:
        return False


@transaction.atomic
def ssh_key_attach(*, cluster: Cluster, key: SshKey) -> bool:
    """Let the key log in to the cluster from its next login on (no restart). Only the
    cluster owner's own keys, or (a team's cluster) those of a team member who may use it;
    not to a cluster that is over. False when it was attached already (nothing written)."""
    if not _may_hold_key(cluster, key):
        raise ValidationError(_("Only your own keys can be attached to your clusters."))
    cluster = Cluster.objects.select_for_update().get(pk=cluster.pk)
    if cluster.state in CLUSTER_OVER:
        raise ValidationError(
            _("Cluster %(cluster)s is %(state)s: keys can no longer be attached to it.")
            % {"cluster": cluster.name, "state": cluster.get_state_display()}
        )
    if cluster.ssh_keys.filter(pk=key.pk).exists():
        return False
    cluster.ssh_keys.add(key)
    cluster_event(
        cluster,
        "key-attached",
        Text(
            gettext_noop("ssh key %(key)s attached: it may log in from now on"), key=_key_words(key)
        ),
    )
    return True


@transaction.atomic
def ssh_key_detach(*, cluster: Cluster, key: SshKey) -> bool:
    """The key logs in to the cluster no more: its next login is refused, and a connection
    open with it gets no new channel and ends at the gateway's next heartbeat. False when
    it was not attached."""
    if key.owner_id != cluster.owner_id:
        raise ValidationError(_("Only your own keys can be attached to your clusters."))
    cluster = Cluster.objects.select_for_update().get(pk=cluster.pk)
    if not cluster.ssh_keys.filter(pk=key.pk).exists():
        return False
    cluster.ssh_keys.remove(key)
    cluster_event(
        cluster,
        "key-detached",
        Text(gettext_noop("ssh key %(key)s detached: it logs in no more"), key=_key_words(key)),
    )
    return True


@transaction.atomic
def ssh_key_delete(*, key: SshKey) -> None:
    """Remove the key: detached from every cluster it was attached to (each one's timeline
    says so while the cluster is not over), so it logs in nowhere any more."""
    for cluster in key.clusters.exclude(state__in=CLUSTER_OVER):
        ssh_key_detach(cluster=cluster, key=key)
    key.delete()


# -- jobs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobSpec:
    name: str
    command: str
    launcher: str = Job.Launcher.PLAIN
    env: dict | None = None
    workdir: str = "/workspace"
    checkpoint_dir: str = "/workspace/checkpoints"
    max_runtime_s: int | None = None
    retries: int = 0
    preemption_script: str = ""
    max_preemptions: int = 5
    budget: Decimal | None = None  # stop at this much spent (billing/budgets.py)


@transaction.atomic
def job_submit(*, cluster: Cluster, spec: JobSpec, pool: Pool | None = None) -> Job:
    """Queue a job on a cluster; it starts when the cluster runs and earlier jobs ended.
    With `pool` (jobs.pools.autoscaler.pool_submit) it runs on whichever of the pool's clusters is
    free first."""
    cluster = Cluster.objects.select_for_update(of=("self",)).get(pk=cluster.pk)
    if cluster.state not in (
        Cluster.State.PENDING,
        Cluster.State.RUNNING,
        Cluster.State.PREEMPTING,
    ):
        raise ValidationError(
            _("Cluster %(name)s is %(state)s: jobs run only on a pending or running cluster.")
            % {"name": cluster.name, "state": cluster.get_state_display()}
        )
    if cluster.no_gpu:
        raise ValidationError(
            _(
                "Cluster %(name)s runs without GPUs (no-GPU mode), for editing code and moving "
                "data: jobs need its GPUs. Stop it and start it with GPUs to run jobs; ssh, "
                "files and the terminal work meanwhile."
            )
            % {"name": cluster.name}
        )
    now = timezone.now()
    job = Job.objects.create(
        cluster=cluster,
        owner_id=cluster.owner_id,
        name=spec.name,
        command=spec.command,
        launcher=spec.launcher,
        env=spec.env or {},
        workdir=spec.workdir,
        checkpoint_dir=spec.checkpoint_dir,
        max_runtime_s=spec.max_runtime_s,
        retries=spec.retries,
        preemption_script=spec.preemption_script,
        max_preemptions=spec.max_preemptions,
        budget=spec.budget,
        created_at=now,
        queued_at=now,
        pool=pool,
    )
    job_event(
        job,
        "queued",
        Text(gettext_noop("on %(cluster)s (%(shape)s)"), cluster=cluster.name, shape=cluster.shape),
        at=now,
    )
    request_dispatch(cluster.pk)
    return job


def _end_waiting(job: Job, reason: Text, now) -> None:
    """End a job that waits (queued, or preempted and waiting to run again) at once,
    cancelled with `reason` (inside the caller's transaction, `job` locked): the one path
    of job_cancel and job_stop_for. A preempted job may have been its cluster's last: the
    after-last-job policy then releases the cluster once this commits."""
    Job.objects.filter(pk=job.pk).update(
        state=Job.State.CANCELLED, finished_at=now, cancel_requested=True,
        **reason_fields(Job, reason),
    )  # fmt: skip
    job_event(job, "cancelled", reason, at=now)
    request_dispatch(job.cluster_id)
    if job.state == Job.State.PREEMPTED:
        cluster_id, name = job.cluster_id, job.name
        transaction.on_commit(lambda: _release_after_last_job(cluster_id, name))


def job_cancel(*, job: Job, by: str | Text) -> Job:
    """Cancel a queued job at once; a starting or running one gets SIGTERM, then SIGKILL."""
    with transaction.atomic():
        job = Job.objects.select_for_update(of=("self",)).get(pk=job.pk)
        if job.is_ended:
            raise ValidationError(
                _("Job %(job)s has ended (%(state)s); there is nothing to cancel.")
                % {"job": job.name, "state": job.get_state_display()}
            )
        reason = Text(gettext_noop("cancelled by %(by)s"), by=by)
        if job.state in Job.WAITING:
            _end_waiting(job, reason, timezone.now())
        else:
            Job.objects.filter(pk=job.pk).update(
                cancel_requested=True, **reason_fields(Job, reason)
            )
            cancelling = Text(gettext_noop("%(reason)s: SIGTERM, then SIGKILL"), reason=reason)
            job_event(job, "cancelling", cancelling)
            request_stop(job.pk)
    job.refresh_from_db()
    return job


def job_stop_for(*, job: Job, reason: Text) -> bool:
    """End a job for a reason of the console's (billing's budget stop): as a preemption
    notice does, its preemption script first (in every running replica, within
    `SUANLI_PREEMPT_SCRIPT_S`), then SIGTERM and SIGKILL after the stop's grace
    (`SUANLI_STOP_GRACE_S`); but it ends cancelled with `reason`, never to run again. A
    job still waiting is cancelled at once. False when it had ended or was being stopped
    already (nothing done: idempotent)."""
    with transaction.atomic():
        job = Job.objects.select_for_update(of=("self",)).get(pk=job.pk)
        if job.is_ended or job.cancel_requested:
            return False
        now = timezone.now()
        if job.state in Job.WAITING:
            _end_waiting(job, reason, now)
            return True
        grace = settings.SUANLI_STOP_GRACE_S
        script = (
            job.preemption_script.strip()
            and job.preempt_requested_at is None
            and job.stop_requested_at is None
        )
        fields = {"cancel_requested": True, **reason_fields(Job, reason)}
        if script:
            fields["preempt_requested_at"] = now
            words = Text(
                gettext_noop(
                    "%(reason)s: running its preemption script (limit %(limit)s s), then "
                    "SIGTERM, SIGKILL after %(grace)s s"
                ),
                reason=reason, limit=settings.SUANLI_PREEMPT_SCRIPT_S, grace=grace,
            )  # fmt: skip
        else:
            words = Text(
                gettext_noop("%(reason)s: SIGTERM, then SIGKILL after %(grace)s s"),
                reason=reason, grace=grace,
            )  # fmt: skip
        Job.objects.filter(pk=job.pk).update(**fields)
        job_event(job, "budget", words, at=now)
        if script:  # once this commits: jobs.runs.preemption.preempt, then the stop
            enqueue_by_name("jobs.tasks.job_preempt", job.pk, job_id=f"preempt-{job.pk}")
        else:
            request_stop(job.pk)
    return True

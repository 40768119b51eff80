"""Reads of the fleet that pages and other apps reuse.

Layer: placement; it writes nothing and uses models, tenancy and fairshare (the queue's order).
"""

from dataclasses import dataclass

from django.db.models import Count, OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.functions import Coalesce
from django.http import Http404
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from jobs.models import Cluster, Host, ImageBuild, Job, Node, OwnImage, SshKey
from jobs.placement import fairshare
from jobs.tenancy.actors import Actor, Role


@dataclass(frozen=True)
class Availability:
    gpu_model: str
    memory_gb: int
    zone: str
    free: int
    total: int
    hosts: int
    emulated_hosts: int


def fleet_availability() -> list[Availability]:
    """Free GPUs per GPU model and zone, counting only hosts that take new work."""
    rows = (
        Host.objects.filter(state=Host.State.ACTIVE, gpu_model__isnull=False)
        .values("gpu_model__name", "gpu_model__memory_gb", "zone")
        .annotate(
            total=Count("slots"),
            free=Count("slots", filter=Q(slots__node__isnull=True)),
            hosts=Count("id", distinct=True),
            emulated=Count("id", filter=Q(emulated_gpu=True), distinct=True),
        )
        .order_by("gpu_model__memory_gb", "gpu_model__name", "zone")
    )
    return [
        Availability(
            gpu_model=row["gpu_model__name"],
            memory_gb=row["gpu_model__memory_gb"],
            zone=row["zone"],
            free=row["free"],
            total=row["total"],
            hosts=row["hosts"],
            emulated_hosts=row["emulated"],
        )
        for row in rows
    ]


def hosts_with_occupancy() -> QuerySet[Host]:
    return Host.objects.select_related("gpu_model").annotate(
        slot_total=Count("slots", distinct=True),
        slot_held=Count("slots", filter=Q(slots__node__isnull=False), distinct=True),
        # Held by ended nodes until the engine confirms their containers are gone.
        slot_freeing=Count(
            "slots", filter=Q(slots__node__released_at__isnull=False), distinct=True
        ),
        node_count=Count("nodes", filter=Q(nodes__released_at__isnull=True), distinct=True),
        # Stopped clusters' workspaces kept here: they come back to this host on start.
        kept_count=Count(
            "nodes",
            filter=Q(nodes__stopped_at__isnull=False, nodes__kept_until__isnull=True),
            distinct=True,
        ),
        # What "reclaim spot capacity" would preempt here.
        spot_nodes=Count(
            "nodes",
            filter=Q(
                nodes__released_at__isnull=True,
                nodes__cluster__spot=True,
                nodes__cluster__state=Cluster.State.RUNNING,
            ),
            distinct=True,
        ),
    )


def gpu_capacity_by_model() -> dict[int, dict]:
    """Per GPU model: free GPUs per zone, the largest host's GPU count, and whether any
    RDMA host offers it. Active hosts only."""
    out: dict[int, dict] = {}
    rows = (
        Host.objects.filter(state=Host.State.ACTIVE, gpu_model__isnull=False)
        .values("gpu_model_id", "zone", "rdma", "gpu_count", "cpu_count", "memory_bytes")
        .annotate(free=Count("slots", filter=Q(slots__node__isnull=True)))
    )
    for row in rows:
        entry = out.setdefault(
            row["gpu_model_id"], {"zones": {}, "largest": 0, "rdma_zones": set()}
        )
        # What one GPU brings with it on the least generous host.
        host = Host(
            gpu_count=row["gpu_count"], cpu_count=row["cpu_count"], memory_bytes=row["memory_bytes"]
        )
        cpus, memory = host.gpu_share(1)
        if row["cpu_count"]:
            entry["cpus_per_gpu"] = min(entry.get("cpus_per_gpu", cpus), cpus)
        if memory:
            gb = memory / 2**30
            entry["memory_gb_per_gpu"] = min(entry.get("memory_gb_per_gpu", gb), gb)
        entry["zones"][row["zone"]] = entry["zones"].get(row["zone"], 0) + row["free"]
        entry["largest"] = max(entry["largest"], row["gpu_count"])
        if row["rdma"]:
            entry["rdma_zones"].add(row["zone"])
    return out


def active_zones() -> list[str]:
    return list(
        Host.objects.filter(state=Host.State.ACTIVE)
        .values_list("zone", flat=True)
        .distinct()
        .order_by("zone")
    )


def rdma_available() -> bool:
    return Host.objects.filter(state=Host.State.ACTIVE, rdma=True).exists()


def clusters_for(user) -> QuerySet[Cluster]:
    """The clusters `user` (a researcher, or an Actor: someone acting for a team) sees."""
    return Actor.of(user).clusters().select_related("gpu_model", "instance_type")


def cluster_for_user(user, cluster_id: int) -> Cluster:
    """The one place that decides who may see a cluster: its owner, or a team's member by
    their role (jobs/tenancy/actors.py). Others get 404."""
    try:
        return clusters_for(user).get(pk=cluster_id)
    except Cluster.DoesNotExist:
        raise Http404("No such cluster.") from None


def cluster_to_use(user, cluster_id: int) -> Cluster:
    """A cluster the actor may act on (log in, submit to, stop, start, its keys and apps):
    404 unless it sees it, 403 in words when its role only reads (a viewer)."""
    cluster = cluster_for_user(user, cluster_id)
    Actor.of(user).require_use(cluster)
    return cluster


def cluster_to_change(user, cluster_id: int) -> Cluster:
    """A cluster the actor may change (release, resize): 404 unless it sees it, 403 in
    words unless it made it or is an admin or the owner of the team."""
    cluster = cluster_for_user(user, cluster_id)
    Actor.of(user).require_change(cluster)
    return cluster


def job_to_cancel(user, job_id: int) -> Job:
    """A job the actor may cancel: one on a cluster it may use (404 unless it sees it, 403
    for a viewer), or anyone's for whoever holds `jobs.cancel_job`."""
    job = job_for_user(user, job_id, power="jobs.cancel_job")
    actor = Actor.of(user)
    if job.owner_id == actor.principal.pk and actor.sees(job.cluster):
        actor.require_use(job.cluster)
    return job


def key_to_detach(user, cluster: Cluster, key_id) -> SshKey:
    """The key the actor may detach from `cluster` (which it sees): the person's own (a
    member or above), or another person's attached there (admins and the owner). Another's
    key not attached there is 404; one the actor sees attached but may not detach, 403."""
    actor = Actor.of(user)
    key = SshKey.objects.filter(pk=key_id).first()
    if key is not None and key.owner_id == actor.person.pk:
        actor.require_use(cluster)
        return key
    if key is None or not cluster.ssh_keys.filter(pk=key.pk).exists():
        raise Http404("No such key.")
    actor.require_use(cluster)
    actor.require(Role.ADMIN)
    return key


def cluster_charts_for_user(user, cluster_id: int) -> Cluster:
    """A cluster whose live charts the user may watch: their own, or anyone's for whoever
    may read other researchers' job pages (`jobs.view_job_logs`: a job page's charts are
    its cluster's). Others, staff or not, get 404."""
    if not Actor.of(user).person.has_perm("jobs.view_job_logs"):
        return cluster_for_user(user, cluster_id)
    try:
        return Cluster.objects.get(pk=cluster_id)
    except Cluster.DoesNotExist:
        raise Http404("No such cluster.") from None


def live_nodes(cluster: Cluster) -> QuerySet[Node]:
    return (
        cluster.node_set.filter(released_at__isnull=True).select_related("host").order_by("index")
    )


def queue(*, now=None) -> list[Cluster]:
    """All pending clusters in placement order (fair share: jobs/placement/fairshare.py),
    each with its `position` (1 first), `account` (fairshare.Account: whose it is, their
    recent usage, share, factor, held GPUs and limit) and `why` (a Text: why it stands
    there). Three queries and the pending clusters'."""
    pending = (
        Cluster.objects.filter(state=Cluster.State.PENDING)
        .select_related("owner", "gpu_model", "instance_type")
        .order_by("spot", "queued_at", "id")  # as placement reads it: on-demand first
    )
    return _in_line(list(pending), now=now)


def _in_line(pending: list[Cluster], *, now=None) -> list[Cluster]:
    gpus = Host.objects.filter(state=Host.State.ACTIVE, gpu_model__isnull=False).aggregate(
        n=Sum("gpu_count")
    )["n"]
    accounts = fairshare.standing(
        pending, now=now or timezone.now(), fleet_gpus=gpus or 0, exact=True
    )
    ordered = accounts.order(pending)
    latest: dict[bool, object] = {}  # per class (spot or not): the newest request ahead so far
    for position, cluster in enumerate(ordered, start=1):
        newest = latest.get(cluster.spot)
        cluster.position = position
        cluster.account = accounts.account(cluster)
        cluster.why = accounts.why(
            cluster, younger_ahead=newest is not None and newest > cluster.queued_at
        )
        if newest is None or cluster.queued_at > newest:
            latest[cluster.spot] = cluster.queued_at
    return ordered


def queue_standing(cluster: Cluster) -> fairshare.Place | None:
    """Where a pending cluster stands in line (`fairshare.Place`: position, why, account);
    None when it is not pending (or was placed meanwhile). Kept a few seconds for the pages
    polling it (`fairshare.recall`): a poll costs two Redis reads and no query; the first
    after a placement pass (or the cluster's arrival) computes the whole queue once."""
    if cluster.state != Cluster.State.PENDING:
        return None
    number, kept = fairshare.recall(cluster.pk)
    if kept is not None:
        return kept
    pending = Cluster.objects.filter(state=Cluster.State.PENDING).only(
        "id", "owner_id", "queued_at", "spot", "nodes", "gpus_per_node"
    )
    places = {
        c.pk: fairshare.Place(position=c.position, why=c.why, account=c.account)
        for c in _in_line(list(pending))
    }
    fairshare.remember(number, places)
    return places.get(cluster.pk)


@dataclass(frozen=True)
class HostRoom:
    """One registered host as capacity: what it could ever hold, and what it has free."""

    gpu_model_id: int | None
    gpus: int
    cpus: int  # 0 while unknown (never checked)
    zone: str
    rdma: bool
    active: bool
    swarm: str  # the swarm it is a member of, "" outside one
    free_gpus: int
    free_cpus: int


def host_rooms() -> list[HostRoom]:
    """Every registered host, whatever its state (a down or draining host may come back):
    one query."""
    used_cpus = (
        Node.objects.filter(host=OuterRef("pk"), released_at__isnull=True)
        .order_by()
        .values("host")
        .annotate(n=Sum("vcpus"))
        .values("n")
    )
    rows = Host.objects.annotate(
        free=Count("slots", filter=Q(slots__node__isnull=True)),
        used=Coalesce(Subquery(used_cpus), 0),
    ).values_list(
        "gpu_model_id", "gpu_count", "cpu_count", "zone", "rdma", "state", "swarm_state",
        "swarm_cluster", "free", "used",
    )  # fmt: skip
    return [
        HostRoom(
            gpu_model_id=model,
            gpus=gpus or 0,
            cpus=cpus or 0,
            zone=zone,
            rdma=rdma,
            active=state == Host.State.ACTIVE,
            swarm=swarm if swarm_state == "active" else "",
            free_gpus=free,
            free_cpus=(cpus or 0) - used,
        )  # fmt: skip
        for model, gpus, cpus, zone, rdma, state, swarm_state, swarm, free, used in rows
    ]


@dataclass(frozen=True)
class Fit:
    """The largest cluster of one resource that the registered hosts could ever hold.

    A node's GPUs (or vCPUs) come from one host, and the nodes of a cluster share one
    network (jobs/placement/capacity.py): members of one Docker swarm, or all on one host."""

    what: str  # "GPUs of A100 80 GB" / "cpu-8c-32g"
    unit: str  # "GPUs" / "vCPUs"
    largest: int  # the most GPUs (vCPUs) of the largest usable host; 0: no usable host
    groups: tuple[tuple[int, ...], ...]  # per shared network: its hosts' GPUs (vCPUs)
    cpu_per_node: int = 0  # CPU types: the type's vCPUs (a node's size is fixed)
    name: str = ""  # the GPU model's name / the CPU type's

    def nodes_max(self, per_node: int) -> int:
        """The most nodes of `per_node` GPUs (vCPUs) that can share one network."""
        if per_node < 1 or per_node > self.largest:
            return 0
        return max((sum(size // per_node for size in group) for group in self.groups), default=0)

    def refusal(self, *, nodes: int, per_node: int) -> str | None:
        """Why `nodes` x `per_node` can never be placed, naming the largest that fits; None
        when the fleet could hold it."""
        size = self.cpu_per_node or per_node
        name = self.name or self.what
        if self.largest == 0:
            if self.cpu_per_node:
                return _("No registered host can hold a node of %(type)s.") % {"type": name}
            return _("No registered host can hold a node of GPUs of %(model)s.") % {"model": name}
        if size <= self.largest and nodes <= self.nodes_max(size):
            return None
        if self.cpu_per_node:
            if size > self.largest:
                return _(
                    "%(type)s needs %(size)s vCPUs; the largest host has %(largest)s: pick a "
                    "type of at most %(largest)s vCPUs."
                ) % {"type": name, "size": size, "largest": self.largest}
            best, too_big = self.nodes_max(size), False
        else:
            too_big = per_node > self.largest
            per_node = min(per_node, self.largest)
            best = self.nodes_max(per_node)
        single = max((max(g) // (self.cpu_per_node or per_node) for g in self.groups), default=0)
        args = {"best": best, "per_node": per_node, "model": name, "type": name}
        args["largest"] = self.largest
        if too_big or best == single:  # one host is the limit
            said = (
                ngettext(
                    "At most %(best)s node x %(type)s: the largest host has %(largest)s vCPUs.",
                    "At most %(best)s nodes x %(type)s: the largest host has %(largest)s vCPUs.",
                    best,
                )
                if self.cpu_per_node
                else ngettext(
                    "At most %(best)s node x %(per_node)s GPUs of %(model)s: the largest host "
                    "has %(largest)s GPUs.",
                    "At most %(best)s nodes x %(per_node)s GPUs of %(model)s: the largest host "
                    "has %(largest)s GPUs.",
                    best,
                )
            )
        else:  # the network is the limit
            said = (
                ngettext(
                    "At most %(best)s node x %(type)s: the hosts that can share one network (a "
                    "Docker swarm) hold %(best)s such nodes.",
                    "At most %(best)s nodes x %(type)s: the hosts that can share one network (a "
                    "Docker swarm) hold %(best)s such nodes.",
                    best,
                )
                if self.cpu_per_node
                else ngettext(
                    "At most %(best)s node x %(per_node)s GPUs of %(model)s: the hosts that can "
                    "share one network (a Docker swarm) hold %(best)s such nodes.",
                    "At most %(best)s nodes x %(per_node)s GPUs of %(model)s: the hosts that can "
                    "share one network (a Docker swarm) hold %(best)s such nodes.",
                    best,
                )
            )
        return said % args


def largest_fit(
    *, gpu_model=None, instance_type=None, network: str = Cluster.Network.STANDARD,
    zone: str = "", rooms: list[HostRoom] | None = None,
) -> Fit:  # fmt: skip
    """The largest cluster of a GPU model (or CPU type) that the registered hosts could
    ever hold, with the network and zone asked for (`rooms` when the caller read them)."""
    rooms = host_rooms() if rooms is None else rooms
    rdma = network == Cluster.Network.RDMA
    usable = [
        r
        for r in rooms
        if (not zone or r.zone == zone)
        and (not rdma or r.rdma)
        and (
            r.gpu_model_id == gpu_model.pk and r.gpus > 0
            if gpu_model is not None
            else r.cpus >= instance_type.vcpus
        )
    ]
    size = (lambda r: r.gpus) if gpu_model is not None else (lambda r: r.cpus)
    # RDMA clusters stay in one zone; standard ones may spread over zones (scheduler).
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(usable):
        key = (r.swarm, r.zone if rdma else "") if r.swarm else ("", i)
        groups.setdefault(key, []).append(size(r))
    if gpu_model is not None:
        return Fit(
            what=f"GPUs of {gpu_model.name}", unit="GPUs",
            largest=max((r.gpus for r in usable), default=0),
            groups=tuple(tuple(g) for g in groups.values()), name=gpu_model.name,
        )  # fmt: skip
    return Fit(
        what=instance_type.name, unit="vCPUs",
        largest=max((r.cpus for r in rooms if not zone or r.zone == zone), default=0),
        groups=tuple(tuple(g) for g in groups.values()), cpu_per_node=instance_type.vcpus,
        name=instance_type.name,
    )  # fmt: skip


def jobs_for(user):
    """A researcher's own jobs (an Actor's: those of the clusters it sees), newest first."""
    return Actor.of(user).jobs().order_by("-created_at", "-id")


def job_for_user(user, job_id: int, *, power: str = "jobs.view_job_logs") -> Job:
    """The job, for its owner, or for whoever holds `power` over other researchers' jobs
    (`jobs.view_job_logs` to read its page, log, charts and profile; `jobs.cancel_job` to
    cancel it). Anyone else, staff or not, gets the 404 of a job that does not exist: staff
    status alone grants nothing (docs/operator/permissions.md)."""
    jobs = Job.objects.select_related("cluster", "cluster__gpu_model", "cluster__instance_type")
    actor = Actor.of(user)
    if not actor.person.has_perm(power):
        jobs = jobs.filter(pk__in=actor.jobs().values("pk"))
    try:
        return jobs.get(pk=job_id)
    except Job.DoesNotExist:
        raise Http404("No such job.") from None


def split_log_line(line: str) -> tuple[str, str]:
    """Docker's timestamped line -> (timestamp, text)."""
    ts, _, text = line.partition(" ")
    return ts, text


def stored_log_lines(log: str) -> list[str]:
    """A stored log's lines as the engine wrote them: split at newlines only. Never
    str.splitlines(): a job printing a carriage return, a form feed or U+2028 would start a
    "line" of its own whose first word it chose, read as the engine's timestamp."""
    return [line.removesuffix("\r") for line in log.split("\n") if line]


def job_log_lines(job, attempt: int | None = None) -> list[tuple[str, int, str]]:
    """The stored log of every replica of an attempt, merged by time: (ts, rank, text)."""
    lines = []
    for replica in job.replicas.filter(attempt=attempt or job.attempt):
        for raw in stored_log_lines(replica.log):
            ts, text = split_log_line(raw)
            lines.append((ts, replica.rank, text))
    lines.sort(key=lambda item: (item[0], item[1]))
    return lines


def queue_position_of_job(job) -> int | None:
    if job.state not in Job.WAITING:
        return None
    return (
        job.cluster.jobs.filter(state__in=Job.WAITING, queued_at__lte=job.queued_at)
        .exclude(pk=job.pk)
        .filter(Q(queued_at__lt=job.queued_at) | Q(id__lt=job.id))
        .count()
        + 1
    )


# -- own images -------------------------------------------------------------------------------


def own_images_for(user) -> QuerySet[OwnImage]:
    """A researcher's own images (registry), by name and tag."""
    return OwnImage.objects.filter(owner=Actor.of(user).principal).order_by("name", "tag")


def own_image_for_user(user, image_id: int) -> OwnImage:
    """Its owner's only: anyone else (operators too: the registry is tenants' property)
    gets 404, as if it did not exist."""
    try:
        return own_images_for(user).get(pk=image_id)
    except OwnImage.DoesNotExist:
        raise Http404("No such image.") from None


def builds_for(user) -> QuerySet[ImageBuild]:
    """A researcher's builds and workspace saves, newest first."""
    return (
        ImageBuild.objects.filter(owner=Actor.of(user).principal)
        .select_related("image", "host", "cluster")
        .order_by("-created_at", "-id")
    )


def build_for_user(user, build_id: int) -> ImageBuild:
    """Its owner's only; anyone else gets 404."""
    try:
        return builds_for(user).get(pk=build_id)
    except ImageBuild.DoesNotExist:
        raise Http404("No such build.") from None


def build_progress(build: ImageBuild) -> dict:
    """What a build's page shows of it and its websocket sends: the fields of the build
    worker's `build.state` messages (jobs/images/builds.py)."""
    return {
        "state": build.state,
        "step": build.step,
        "done_bytes": build.done_bytes,
        "total_bytes": build.total_bytes,
        "error": build.error,
        "image": build.image.reference if build.image_id and build.image else "",
    }


def saveable_nodes(cluster: Cluster) -> list[Node]:
    """The nodes whose workspace can be saved as an image now: a running cluster's live
    nodes, a stopped cluster's kept workspaces; none without workspaces."""
    if not cluster.workspace:
        return []
    if cluster.state == Cluster.State.RUNNING:
        return list(live_nodes(cluster))
    if cluster.state == Cluster.State.STOPPED:
        return list(
            cluster.node_set.filter(stopped_at__isnull=False, kept_until__isnull=True)
            .select_related("host")
            .order_by("index")
        )
    return []


@dataclass(frozen=True)
class ImagePull:
    """A pull of a cluster's image onto one of its hosts that has not (yet) succeeded."""

    host: str
    state: str  # pulling | failed
    done: int
    total: int
    message: str


def image_pulls(cluster: Cluster) -> list[ImagePull]:
    """Pulls still under way or failed, by host name; none once every host has the image.
    A pull under way says nothing after the cluster ended."""
    ended = cluster.state in (Cluster.State.RELEASED, Cluster.State.FAILED)
    out = []
    for host, pull in sorted((cluster.image_pulls or {}).items()):
        if not isinstance(pull, dict):
            continue
        state = pull.get("state")
        if state == "failed" or (state == "pulling" and not ended):
            out.append(
                ImagePull(
                    host=str(host),
                    state=state,
                    done=int(pull.get("done") or 0),
                    total=int(pull.get("total") or 0),
                    message=str(pull.get("message") or ""),
                )  # fmt: skip
            )
    return out

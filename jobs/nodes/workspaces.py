"""Workspaces (docs/glossary.md): one long-lived container per live node of a running
cluster, from placement to release, that the researcher logs in to through the SSH gateway
(jobs/access/ssh.py) and the web terminal. Jobs still run as replicas of their own beside it.

A workspace is a node's container like a replica (runtime.node_container_kwargs: the
tenant's uid, no capabilities, the node's GPUs and limits, the cluster's volumes and
network, an init as PID 1) whose command only keeps it up. Its name is fixed by the
cluster and node index, so a retried or duplicated `ensure` finds it again (409), and the
node row keeps its engine id. A cluster created with `workspace` off has none.

Reads: clusters and nodes. Talks to: the engines. Called by the tasks after placement, a
move or a resize (`ensure`), after a stop (`stop`, then `save`), after release (`remove`),
and by the reconciler (`sweep`). It also gives ended nodes' GPU slots back once their
host's engine confirms that nothing of theirs runs on those GPUs any more (`free_gpus`).

A stop keeps each workspace, stopped, on its host. Where the fleet has a registry, its
root filesystem is also pushed there after the stop (`save`): a start that finds that host
full (or down, draining, degraded) then starts the node on another host with the same GPUs
(services.cluster_start, restart.plan_kept), whose workspace is made from the save
(`_restore`); the volumes need nothing, being on the fleet's distributed filesystem. Saved
at the stop rather than when a start needs it: the stop is the owner's "I am done for now"
(nothing waits on the push: the GPUs went back before it), a start is "I want it now" (a
push then would add minutes to it), and a save made at the stop outlives its host. A save
counts against its owner's image quota (the layers its cluster's image does not have, at
their size on a host's disk: `Node.saved_layers`); one that would take the owner past it
is not pushed, and the cluster's timeline says so (it can start only on its own host).

Layer: nodes, the top of it (access, runs and images use it); uses runtime, network, registry,
engine, events (timeline), models and base (text).
"""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime, timedelta

import docker
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from jobs.base.text import Text
from jobs.events import lifecycle, timeline
from jobs.models import (
    MAX_GPUS_PER_HOST,
    Cluster,
    GpuSlot,
    Host,
    Node,
    OwnImage,
    Replica,
)
from jobs.nodes import engine, network, registry, runtime

log = logging.getLogger(__name__)

LABEL = "suanli.workspace"  # value: the node's index
LABEL_NODE = "suanli.node"  # the node row's id: a workspace of an earlier node is not reused
LABEL_SFTP = "suanli.sftp"  # the gateway's sftp containers (jobs/access/sftp.py)
# What the container was made for (GPUs, limits, network): one made for other GPUs or for
# no-GPU mode is made again from its own filesystem (`_remake`), never reused as it is.
LABEL_SHAPE = "suanli.shape"
# The image a workspace's filesystem is saved to when it is made again (a start on other
# GPUs, in no-GPU mode): never a cluster's image (validators refuse the prefix), removed
# with the workspace at release.
KEEP_REPOSITORY = "suanli-keep"
# The entrypoint, not the command: an image's own ENTRYPOINT (`python`, a server) must not
# wrap what keeps the workspace up.
KEEP_UP = ["/bin/sh", "-c", "exec sleep 2147483647"]
_ERRORS = (
    docker.errors.DockerException,
    engine.EngineError,
    OSError,
    runtime.SpecError,
    registry.RegistryError,
)


class WorkspaceError(Exception):
    """No running workspace to reach; the text says why, for the researcher."""


def container_name(cluster_id: int, index: int) -> str:
    return f"suanli-ws-c{cluster_id}-n{index}"


_LOGIN = re.compile(r"c([1-9][0-9]{0,9})(?:-([0-9]{1,3}))?")


def login_name(cluster_id: int, index: int = 0) -> str:
    """The SSH user name of a node's workspace: `c42-0` (cluster 42, node 0)."""
    return f"c{cluster_id}-{index}"


def parse_login(name: str) -> tuple[int, int] | None:
    """(cluster id, node index) of `c42-1`, or of `c42` (node 0); None for anything else."""
    match = _LOGIN.fullmatch(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def home(cluster: Cluster) -> str:
    """Where a login starts: the first volume's mount point, else the container's /tmp."""
    first = cluster.volumes.order_by("pk").first()
    return first.target if first else "/tmp"  # noqa: S108 (the container's own /tmp)


def keep_image(cluster_id: int, index: int) -> str:
    return f"{KEEP_REPOSITORY}/c{cluster_id}-n{index}:latest"


def save_reference(owner_id: int, cluster_id: int, index: int) -> str:
    """Where a stopped node's root filesystem goes in the registry:
    `<registry>/u<owner>/suanli-keep/c<cluster>-n<index>:latest`. In its owner's namespace,
    which no typed reference may name (validators.names_own_image), listed by no image row
    but counted against its owner's image quota (`Node.saved_layers`, images.quota; one
    that would not fit is not pushed); deleted at release, or once a start made a
    workspace from it (its layers stay until the registry's garbage collection)."""
    return registry.reference(owner_id, f"{KEEP_REPOSITORY}/c{cluster_id}-n{index}", "latest")


def spec(cluster: Cluster, node: Node, network_name: str) -> runtime.ContainerSpec:
    name, start = container_name(cluster.pk, node.index), home(cluster)
    # In no-GPU mode the workspace is all the node has (its small share, runtime).
    share = 1.0 if node.no_gpu else settings.SUANLI_WORKSPACE_SHARE
    kwargs = runtime.node_container_kwargs(
        cluster, node, owner_id=cluster.owner_id, network_name=network_name, name=name,
        nvidia=not node.host.emulated_gpu, share=share,
    )  # fmt: skip
    shape = ",".join(map(str, node.gpu_indices)) or "none"
    shape += f"|{kwargs['nano_cpus']}|{kwargs['mem_limit']}|{network_name}"
    kwargs["environment"] = {
        **kwargs["environment"],
        "HOME": start,
        "SUANLI_CLUSTER": str(cluster.pk),
        "NODE_RANK": str(node.index),
        "SUANLI_WORKSPACE": "1",
    }
    kwargs.update(
        entrypoint=KEEP_UP,
        command=[],
        labels={
            runtime.LABEL_CLUSTER: str(cluster.pk),
            runtime.LABEL_OWNER: str(cluster.owner_id),
            LABEL: str(node.index),
            LABEL_NODE: str(node.pk),
            LABEL_SHAPE: shape,
        },
        working_dir=start,
    )
    return runtime.ContainerSpec(image=cluster.image_reference, name=name, kwargs=kwargs)


def _live_nodes(cluster_id: int) -> list[Node]:
    return list(
        Node.objects.filter(cluster_id=cluster_id, released_at__isnull=True, lost_at__isnull=True)
        .select_related("host", "cluster")
        .order_by("index")
    )


def ensure(cluster_id: int) -> dict[int, str]:
    """A running workspace on every live node of a running cluster that wants them, and
    none on its released nodes. Returns node index -> why it is not running, for those
    that failed (empty: all up). Idempotent and safe to race.

    A node's billing starts when its workspace first runs (`Node.started_at`, set in
    `_up`). A failure no retry mends (`final`: its image cannot be pulled, or a container
    of it cannot start) fails a cluster that never ran (`fail_never_ran`): nothing was charged,
    and its GPUs go back. Any other (an engine or a registry that did not answer) is
    tried again by the reconciler."""
    cluster = Cluster.objects.filter(pk=cluster_id).first()
    if cluster is None or cluster.state != Cluster.State.RUNNING or not cluster.workspace:
        return {}
    nodes = _live_nodes(cluster_id)
    if not nodes:
        return {}
    failed = {}
    try:
        network_name = network.ensure(cluster_id, nodes)
    except network.NetworkError as exc:
        return {n.index: str(exc) for n in nodes}
    for node in nodes:
        try:
            container = _up(cluster, node, network_name)
        except _ERRORS as exc:
            failed[node.index] = f"{node.host.name}: {engine.describe(exc)}"
            log.warning("workspace of %s not started: %s", node, failed[node.index])
            if final(exc) and fail_never_ran(cluster, node, exc):
                return failed
            if stalled(cluster, node) and fail_never_ran(cluster, node, exc, late=True):
                return failed
            continue
        if node.workspace_container != container.id:
            Node.objects.filter(pk=node.pk).update(workspace_container=container.id)
        if node.saved_image:
            # Made from its save: from now on its files are in this workspace.
            Node.objects.filter(pk=node.pk).update(saved_image="", saved_layers=[])
            _forget_save(node.host, node.saved_image)
    _remove_released(cluster_id, nodes)
    return failed


def _up(cluster: Cluster, node: Node, network_name: str):
    made = spec(cluster, node, network_name)
    client = engine.cached_client(node.host)
    if node.saved_image:
        _restore(client, cluster, node, made.name)
    if _saved(client, cluster.pk, node.index):
        # A remake was cut short (or raced) after its save: its files are in the save.
        made = runtime.ContainerSpec(
            image=keep_image(cluster.pk, node.index), name=made.name, kwargs=made.kwargs
        )
    elif registry.in_registry(made.image):  # a researcher's own image: pulled with progress
        own = cluster.own_image
        registry.ensure(
            node.host, made.image, cluster_id=cluster.pk, digest=own.digest if own else ""
        )
    try:
        container = client.containers.create(
            made.image,
            name=made.name,
            **runtime.with_image_volumes(client, made.image, made.kwargs),
        )
    except docker.errors.ImageNotFound:
        if made.image.startswith(KEEP_REPOSITORY + "/"):
            raise  # a save is never pulled from anywhere: only this engine has it
        registry.pull_public(client, made.image, host=node.host.name, cluster_id=cluster.pk)
        container = client.containers.create(
            made.image,
            name=made.name,
            **runtime.with_image_volumes(client, made.image, made.kwargs),
        )
    except docker.errors.APIError as exc:
        if exc.status_code != 409:
            raise
        # Made before: by a racing task, or before a stop. The name is the cluster's and
        # the node index's, so it is this researcher's node's own filesystem.
        container = client.containers.get(made.name)
        labels = made.kwargs["labels"]
        if container.labels.get(LABEL_SHAPE) != labels[LABEL_SHAPE]:
            # Made for other GPUs, limits or network (a start on other GPUs or without
            # them, a resize onto a second host): made again with its files.
            container = _remake(client, container, made, cluster.pk, node.index, node.host)
    if container.status != "running":
        # Under the node's row lock, as free_gpus checks it: a stop or release committed
        # while this was pulled or made must not be followed by a start on GPUs that
        # free_gpus may already have given to the next tenant.
        with transaction.atomic():
            if _lock_if_live(node):
                container.start()
                _started(node)
    else:
        _started(node)
    return container


def _lock_if_live(node: Node) -> bool:
    """Whether `node` still holds its GPUs (not released, its cluster running), its row
    locked (only its row) for the rest of the caller's transaction when it does."""
    # of=self: the node's row only. Locking the joined cluster row too (a node, then its
    # cluster) deadlocks with a stop (its cluster, then its nodes). Rows are read, never
    # .exists(): Django's exists() drops the OF clause and locks the cluster's row too.
    live = Node.objects.select_for_update(of=("self",)).filter(
        pk=node.pk, released_at__isnull=True, cluster__state=Cluster.State.RUNNING
    )
    return live.values_list("pk", flat=True).first() is not None


def _started(node: Node) -> None:
    """The node runs from now on (its workspace started): its billing starts here, once."""
    Node.objects.filter(pk=node.pk, started_at__isnull=True).update(started_at=timezone.now())


# A container's start that fails for its image's own reason (no /bin/sh in it, an
# entrypoint that is not there): a retry fails the same. Lower case, in the engine's words.
_IMAGE_FAULTS = (
    "executable file not found",
    "no such file or directory",
    "unable to start container process",
)


def final(exc: BaseException) -> bool:
    """Whether a workspace's (or a replica's) start failed for good: its image cannot be
    pulled (registry.unavailable: it does not exist, or may not be pulled), or the
    engine cannot start a container of it for the image's own reason. An engine that did
    not answer, or failed for reasons of its own, is not final (tried again)."""
    if engine.unreachable(exc) or engine.engine_fault(exc):
        return False
    if registry.unavailable(exc):
        return True
    text = engine.describe(exc).lower()
    return "mount" not in text and any(words in text for words in _IMAGE_FAULTS)


# The state reason of a cluster that never ran (English kept; shown in the reader's).
NEVER_RAN = gettext_noop("could not start (nothing was charged): %(reason)s")


# ...and of one whose workspace did not start within SUANLI_START_DEADLINE_S.
NEVER_RAN_LATE = gettext_noop(
    "could not start within %(minutes)s minutes (nothing was charged): %(reason)s"
)
STALLED_PULL_S = 300  # a pull whose progress has not moved this long is not waited for


def stalled(cluster: Cluster, node: Node) -> bool:
    """Whether a node that has not started is past `SUANLI_START_DEADLINE_S` from its
    placement with its image's pull not moving (none running, or its progress unchanged
    for 5 minutes): its failures are transient in name only (Docker Hub's rate limit, a
    full disk), and its GPUs are held for nothing. It is never charged (a workspace node
    is charged from its start only: billing.accrual `billing_start`), so it fails."""
    now = timezone.now()
    if node.started_at is not None or now < node.placed_at + timedelta(
        seconds=settings.SUANLI_START_DEADLINE_S
    ):
        return False
    pull = (Cluster.objects.filter(pk=cluster.pk).values_list("image_pulls", flat=True).first()
            or {}).get(node.host.name) or {}  # fmt: skip
    if pull.get("state") != "pulling" or not pull.get("moved_at"):
        return True
    return now - datetime.fromisoformat(pull["moved_at"]) >= timedelta(seconds=STALLED_PULL_S)


def fail_never_ran(cluster: Cluster, node: Node, exc: BaseException, *, late: bool = False) -> bool:
    """The cluster fails with the engine's (or registry's) words, if it never ran: no
    node of it started, ever (a cluster that ran keeps its files in its workspaces and
    saves; a failure of a later start is not worth them). Its GPUs go back as at a
    release. `late`: a failure tried again until `stalled`. True when it failed."""
    if Node.objects.filter(cluster_id=cluster.pk, started_at__isnull=False).exists():
        return False
    cause = exc.__cause__ if isinstance(exc.__cause__, registry.RegistryError) else exc
    if registry.unavailable(exc):
        why = Text(
            gettext_noop("the image %(image)s could not be pulled onto %(host)s: %(error)s"),
            image=cluster.image_reference,
            host=node.host.name,
            error=engine.describe(cause),
        )
    else:
        why = Text(
            gettext_noop("the workspace of node %(index)s could not start on %(host)s: %(error)s"),
            index=node.index,
            host=node.host.name,
            error=engine.describe(cause),
        )
    reason = (
        Text(NEVER_RAN_LATE, minutes=settings.SUANLI_START_DEADLINE_S // 60, reason=why)
        if late
        else Text(NEVER_RAN, reason=why)
    )
    done = lifecycle.cluster_release(cluster=cluster, reason=reason, failed=True)
    return done.state == Cluster.State.FAILED


def _restore(client, cluster: Cluster, node: Node, name: str) -> None:
    """A node started from its save (on another host than the one that kept it): the save
    pulled from the registry, its progress on the cluster's page, and named as this
    engine's save of the node (`keep_image`), which `_up` makes the workspace from. A
    workspace of the node left here by an earlier stay is removed (its files are older
    than the save's); one made for this very node row is kept (a retry after the make)."""
    try:
        old = client.containers.get(name)
    except docker.errors.NotFound:
        old = None
    if old is not None:
        if old.labels.get(LABEL_NODE) == str(node.pk):
            return
        old.remove(force=True, v=True)
    digest = node.saved_image.partition("@")[2]
    registry.ensure(node.host, node.saved_image, cluster_id=cluster.pk, digest=digest)
    repository, tag = keep_image(cluster.pk, node.index).rsplit(":", 1)
    client.images.get(node.saved_image).tag(repository, tag)
    _flatten_if_deep(client, keep_image(cluster.pk, node.index))


def _forget_save(host: Host, saved: str) -> None:
    """A save no kept or live node holds any more: its manifest deleted from the registry
    (its layers go at the registry's next garbage collection) and its name on `host`'s
    engine removed (the image stays while `keep_image` names it)."""
    try:
        engine.cached_client(host).images.remove(saved)
    except _ERRORS as exc:
        log.info("the pulled save %s stays on %s until the sweep: %s", saved, host.name, exc)
    if _save_in_use(saved):
        return
    repository, _, digest = saved.partition("@")
    try:
        registry.delete_manifest(registry.split(repository)[0], digest)
    except registry.RegistryError as exc:
        log.info("save %s stays in the registry until release: %s", saved, exc)


def _save_in_use(saved: str) -> bool:
    return (
        Node.objects.filter(saved_image=saved)
        .filter(Q(released_at__isnull=True) | Q(stopped_at__isnull=False, kept_until__isnull=True))
        .exists()
    )


def _saved(client, cluster_id: int, index: int):
    """The node's saved filesystem (`keep_image`) on this engine, or None."""
    try:
        return client.images.get(keep_image(cluster_id, index))
    except docker.errors.ImageNotFound:
        return None


def _remake(client, old, made: runtime.ContainerSpec, cluster_id: int, index: int, host: Host):
    """The workspace made again from its own filesystem: its writable layer is saved as an
    image of the cluster's node (`keep_image`), the new container made from that with the
    new spec, and the old one removed. The image's own ENTRYPOINT and CMD stay the
    original image's (the commit keeps the config; the spec sets the entrypoint)."""
    if old.status == "running":
        old.stop(timeout=settings.SUANLI_WORKSPACE_STOP_S)
    reference = keep_image(cluster_id, index)
    saved = _saved(client, cluster_id, index)
    if saved is None or saved.attrs.get("Container") != old.id:  # not saved from it yet
        repository, tag = reference.rsplit(":", 1)
        # A big filesystem takes long to save: no client timeout (a timed-out commit the
        # engine finishes anyway would be made again and again by the retries).
        patient = engine.client_for(host, timeout=settings.SUANLI_WORKSPACE_SAVE_S)
        try:
            patient.api.commit(old.id, repository=repository, tag=tag)
        finally:
            patient.close()
    old.remove(force=True, v=True)
    _flatten_if_deep(client, reference)
    return client.containers.create(keep_image(cluster_id, index), name=made.name, **made.kwargs)


def _flatten_if_deep(client, reference: str) -> None:
    """Each remake commits one more layer over the last; the storage driver takes about 125
    (overlay2). Past SUANLI_WORKSPACE_MAX_LAYERS the saved image is made again as one
    layer (its filesystem exported and imported, its config kept), and the chain goes."""
    image = client.images.get(reference)
    if len(image.history()) <= settings.SUANLI_WORKSPACE_MAX_LAYERS:
        return
    config = image.attrs.get("Config") or {}
    changes = [
        f"ENV {name}={json.dumps(value, ensure_ascii=False)}"
        for name, _, value in (e.partition("=") for e in config.get("Env") or [])
        if name
    ]
    for key, instruction in (("Entrypoint", "ENTRYPOINT"), ("Cmd", "CMD")):
        if config.get(key):
            changes.append(f"{instruction} {json.dumps(config[key])}")
    if config.get("WorkingDir"):
        changes.append(f"WORKDIR {config['WorkingDir']}")
    repository, tag = reference.rsplit(":", 1)
    source = client.containers.create(reference, entrypoint=["/bin/true"], network_mode="none")
    try:
        client.api.import_image_from_data(
            source.export(), repository=repository, tag=tag, changes=changes
        )
    finally:
        source.remove(force=True, v=True)
    try:
        client.images.remove(image.id)  # the old chain, untagged now
    except docker.errors.APIError as exc:
        log.info("the old chain of %s stays until release: %s", reference, exc)


def _remove_released(cluster_id: int, live_nodes: list[Node]) -> None:
    """Workspaces of the cluster's released or lost nodes whose index no live node holds on
    that host (a node moved elsewhere keeps its index)."""
    live = {(n.host_id, n.index) for n in live_nodes}
    gone = Node.objects.filter(cluster_id=cluster_id).exclude(workspace_container="")
    gone = gone.filter(Q(released_at__isnull=False) | Q(lost_at__isnull=False))
    for node in gone.select_related("host"):
        if (node.host_id, node.index) in live or node.host.state == Host.State.DOWN:
            continue
        if _remove_one(node.host, node.workspace_container):
            Node.objects.filter(pk=node.pk).update(workspace_container="")


def remove_ended(cluster_id: int) -> None:
    """The workspaces of the cluster's ended nodes (a preemption, a resize, a move), not
    those a live node of it uses on the same host and index."""
    _remove_released(cluster_id, _live_nodes(cluster_id))


def _remove_one(host: Host, container_id: str) -> bool:
    try:
        engine.cached_client(host).containers.get(container_id).remove(force=True, v=True)
    except docker.errors.NotFound:
        pass
    except _ERRORS as exc:
        log.info("workspace %s on %s not removed yet: %s", container_id[:12], host.name, exc)
        return False
    return True


def kept_nodes(cluster_id: int):
    """The nodes whose workspaces a stop of the cluster keeps on their hosts."""
    return Node.objects.filter(
        cluster_id=cluster_id, stopped_at__isnull=False, kept_until__isnull=True
    ).exclude(workspace_container="")


def _remove_sftp(client, host: Host, cluster_id: int) -> None:
    """The cluster's sftp session containers on `host` gone (a stop or a restart ends them)."""
    for container in client.containers.list(
        ignore_removed=True,
        all=True,
        filters={"label": [LABEL_SFTP, f"{runtime.LABEL_CLUSTER}={cluster_id}"]},
    ):
        _remove_one(host, container.id)


def restart(cluster_id: int) -> bool:
    """Every running workspace of the cluster restarted in place (its files, GPUs and
    address kept; every process in it ended: e.g. what a removed team member left running),
    and the cluster's sftp containers gone. True when all are done; False when an engine
    did not answer (try again)."""
    done = True
    for node in _live_nodes(cluster_id):
        if not node.workspace_container or node.stopped_at is not None:
            continue
        try:
            client = engine.cached_client(node.host)
            client.containers.get(node.workspace_container).restart(
                timeout=settings.SUANLI_WORKSPACE_STOP_S
            )
            _remove_sftp(client, node.host, cluster_id)
        except docker.errors.NotFound:
            log.warning("the workspace of %s is gone from %s", node, node.host.name)
        except _ERRORS as exc:
            log.info("workspace of %s not restarted yet: %s", node, exc)
            done = False
    return done


def stop(cluster_id: int) -> bool:
    """After a stop: every kept workspace of the cluster stopped (its filesystem stays on
    its host), and the cluster's sftp sessions' containers gone. True when all are
    stopped; False when an engine did not answer (try again; the reconciler also does)."""
    done = True
    for node in kept_nodes(cluster_id).select_related("host"):
        if node.host.state == Host.State.DOWN:
            done = False
            continue
        if not kept_nodes(cluster_id).filter(pk=node.pk).exists():
            continue  # started again meanwhile: its workspace is in use
        try:
            client = engine.cached_client(node.host)
            client.containers.get(node.workspace_container).stop(
                timeout=settings.SUANLI_WORKSPACE_STOP_S
            )
            _remove_sftp(client, node.host, cluster_id)
        except docker.errors.NotFound:
            log.warning("the kept workspace of %s is gone from %s", node, node.host.name)
        except _ERRORS as exc:
            log.info("workspace of %s not stopped yet: %s", node, exc)
            done = False
    return done


def save(cluster_id: int) -> bool:
    """After a stop, where the fleet has a registry: each kept workspace's root filesystem
    (the writable layer over its image; the volumes are storage, on every host already)
    committed on its host, pushed to the registry (`save_reference`) and named on its node
    (`Node.saved_image`, by digest), so that a start that finds the host without room can
    start it on another. The host keeps its stopped container (a start there reuses it) and
    no copy of the save. True when every kept workspace is saved; False when one is not
    (yet): still running, its host or the registry not answering (try again)."""
    if not registry.enabled():
        return True
    done = True
    for node in kept_nodes(cluster_id).filter(saved_image="").select_related("host", "cluster"):
        if node.host.state == Host.State.DOWN:
            done = False
            continue
        try:
            pushed = _push_save(node)
        except OverQuota as over:
            _say_not_saved(node, over)
            continue  # done: tried again only when a start needs it (services._saving)
        except _ERRORS as exc:
            log.info("workspace of %s not saved to the registry yet: %s", node, exc)
            done = False
            continue
        if pushed is None:
            done = False
            continue
        saved, layers = pushed
        if (
            not kept_nodes(cluster_id)
            .filter(pk=node.pk, saved_image="")
            .update(saved_image=saved, saved_layers=layers)
        ):
            _forget_save(node.host, saved)  # started or released meanwhile: of no use now
    return done


def save_timeout(cluster_id: int) -> int:
    """Seconds a task that saves the cluster's kept workspaces may take: each node's commit
    and push may take SUANLI_WORKSPACE_SAVE_S."""
    nodes = kept_nodes(cluster_id).filter(saved_image="").count()
    return settings.SUANLI_WORKSPACE_SAVE_S * max(1, nodes) + 60


class OverQuota(Exception):
    """A save that would take its owner past the image quota: not pushed."""

    def __init__(self, size: int, used: int, limit: int) -> None:
        super().__init__(f"{size} bytes would make {used} of {limit}")
        self.size, self.used, self.limit = size, used, limit


NOT_SAVED = "not-saved"


def _say_not_saved(node: Node, over: OverQuota) -> None:
    """The cluster's timeline says that a node's system disk was not saved, and why: once
    per stop (a start that needs the save tries it again, and says nothing new)."""
    cluster = node.cluster
    said = cluster.events.filter(
        kind=NOT_SAVED, message__startswith=f"the system disk of node {node.index} "
    )
    stopped = cluster.events.filter(kind="stopped").order_by("-at", "-pk").first()
    if stopped is not None:
        said = said.filter(at__gte=stopped.at)
    if said.exists():
        return
    timeline.cluster_event(
        cluster,
        NOT_SAVED,
        Text(
            gettext_noop(
                "the system disk of node %(index)s was not saved: with its %(size)s your "
                "images and saves would take %(used)s of your %(quota)s image quota, so the "
                "cluster can start only on its own host (%(host)s); delete images you no "
                "longer need to make room"
            ),
            index=node.index,
            size=registry.human(over.size),
            used=registry.human(over.used),
            quota=registry.human(over.limit),
            host=node.host.name,
        ),
    )


def saves_layers(owner_id: int, *, leaving_out: int | None = None) -> list[list]:
    """The layers ([[layer, bytes], ...] each) of a researcher's saves in the registry now:
    of kept nodes, and of nodes started from a save not made into a workspace yet. What
    the image quota counts of them (images.quota)."""
    rows = (
        Node.objects.filter(cluster__owner_id=owner_id)
        .exclude(saved_image="")
        .filter(Q(released_at__isnull=True) | Q(stopped_at__isnull=False, kept_until__isnull=True))
    )
    if leaving_out is not None:
        rows = rows.exclude(pk=leaving_out)
    by_save = dict(rows.values_list("saved_image", "saved_layers"))  # a carried save once
    return list(by_save.values())


def _own_layers(client, node: Node, reference: str) -> list[list]:
    """The layers of the committed `reference` that the node's cluster's image does not
    have (its image's on this engine; else an own image's recorded ones; else none is left
    out: nothing is counted short), each at its size on a host's disk."""
    layers = registry.real_layers(client, reference)
    cluster = node.cluster
    try:
        base = set(
            (client.api.inspect_image(cluster.image_reference).get("RootFS") or {}).get("Layers")
            or []
        )
    except docker.errors.NotFound:
        own = OwnImage.objects.filter(pk=cluster.own_image_id).first()
        base = {layer[0] for layer in (own.layers if own else [])}
    return [layer for layer in layers if layer[0] not in base]


def _check_quota(node: Node, layers: list[list]) -> None:
    owner_id = node.cluster.owner_id
    used = registry.distinct_bytes(
        [*OwnImage.objects.filter(owner_id=owner_id).values_list("layers", flat=True),
         *saves_layers(owner_id, leaving_out=node.pk), layers]
    )  # fmt: skip
    limit = int(settings.SUANLI_IMAGE_QUOTA_GB * 1e9)
    if used > limit:
        raise OverQuota(sum(int(size) for _, size, *_rest in layers), used, limit)


def _push_save(node: Node) -> tuple[str, list[list]] | None:
    """The node's stopped workspace committed and pushed: its reference by digest and its
    layers that count against the quota (`_own_layers`); None while it still runs (a stop
    still under way). OverQuota (not pushed, the commit removed) where it would take the
    owner past the image quota. An earlier save of the node's index that no node holds any
    more is deleted from the registry once this one is there."""
    client = engine.client_for(node.host, timeout=settings.SUANLI_WORKSPACE_SAVE_S)
    try:
        container = client.containers.get(node.workspace_container)
        if container.status not in ("exited", "created", "dead"):
            return None
        reference = save_reference(node.cluster.owner_id, node.cluster_id, node.index)
        repository, tag = reference.rsplit(":", 1)
        path = registry.split(reference)[0]
        before = registry.digest_of(path, tag)
        client.api.commit(container.id, repository=repository, tag=tag)
        try:
            layers = _own_layers(client, node, reference)
            _check_quota(node, layers)
            digest = registry.push(client, reference)
        finally:
            try:
                client.images.remove(reference)  # the container holds the files here
            except _ERRORS as exc:
                log.info(
                    "the save %s stays on %s until release: %s", reference, node.host.name, exc
                )
    finally:
        client.close()
    saved = f"{repository}@{digest}"
    if before and before != digest and not _save_in_use(f"{repository}@{before}"):
        registry.delete_manifest(path, before)
    return saved, layers


def _remove_saves(cluster_id: int) -> bool:
    """At release: the cluster's saves in the registry (each node index's tag, and every
    save a node of it named). True when none is left; False when the registry did not
    answer (try again)."""
    if not registry.enabled():
        return True
    nodes = Node.objects.filter(cluster_id=cluster_id, stopped_at__isnull=False)
    if not nodes.exists():
        return True  # never stopped: never saved
    owner_id = Cluster.objects.filter(pk=cluster_id).values_list("owner_id", flat=True).first()
    try:
        for index in set(nodes.values_list("index", flat=True)):
            path, tag = registry.split(save_reference(owner_id, cluster_id, index))
            registry.delete(path, tag)
        for saved in set(
            Node.objects.filter(cluster_id=cluster_id)
            .exclude(saved_image="")
            .values_list("saved_image", flat=True)
        ):
            repository, _, digest = saved.partition("@")
            registry.delete_manifest(registry.split(repository)[0], digest)
    except registry.RegistryError as exc:
        log.info("saves of cluster %s stay in the registry for now: %s", cluster_id, exc)
        return False
    return True


def remove(cluster_id: int) -> bool:
    """After release: every workspace of the cluster (and any sftp session's container of
    it), on every host that held one of its nodes. True when none is left; False when an
    engine did not answer (try again)."""
    done = True
    nodes = Node.objects.filter(cluster_id=cluster_id).select_related("host")
    for host in {n.host for n in nodes}:
        if host.state == Host.State.DOWN:
            done = False
            continue
        try:
            found = [
                container
                for label in (LABEL, LABEL_SFTP)  # and its sftp sessions' containers
                for container in engine.cached_client(host).containers.list(
                    ignore_removed=True,
                    all=True,
                    filters={"label": [label, f"{runtime.LABEL_CLUSTER}={cluster_id}"]},
                )
            ]
        except _ERRORS:
            done = False
            continue
        for container in found:
            done = _remove_one(host, container.id) and done
        done = _remove_kept_images(host, cluster_id) and done
    done = _remove_saves(cluster_id) and done
    if done:
        Node.objects.filter(cluster_id=cluster_id).update(workspace_container="")
    return done


def _remove_kept_images(host: Host, cluster_id: int) -> bool:
    try:
        client = engine.cached_client(host)
        names = [f"{KEEP_REPOSITORY}/c{cluster_id}-n*"]
        owner_id = Cluster.objects.filter(pk=cluster_id).values_list("owner_id", flat=True).first()
        if registry.enabled() and owner_id is not None:  # a save's push or pull cut short
            names.append(save_reference(owner_id, cluster_id, 0).rsplit("-n", 1)[0] + "-n*")
        for name in names:
            for image in client.images.list(name=name):
                client.images.remove(image.id, force=True)
    except docker.errors.NotFound:
        pass
    except _ERRORS as exc:
        log.info("kept images of cluster %s on %s not removed yet: %s", cluster_id, host.name, exc)
        return False
    return True


def sweep(host: Host, client: docker.DockerClient) -> int:
    """The reconciler's safety net: remove the host's workspaces whose cluster is over or
    whose node is gone; start again those of live nodes that stopped; stop those a stop
    keeps that still run. Returns how many went."""
    removed = 0
    found = client.containers.list(ignore_removed=True, all=True, filters={"label": LABEL})
    saves = client.images.list(name=f"{KEEP_REPOSITORY}/*")
    if not found and not saves:
        return 0
    live = set(
        Node.objects.filter(
            host=host, released_at__isnull=True, lost_at__isnull=True,
            cluster__state=Cluster.State.RUNNING, cluster__workspace=True,
        ).values_list("cluster_id", "index")
    )  # fmt: skip
    kept = set(kept_nodes_on(host).values_list("cluster_id", "index"))
    for container in found:
        labels = container.labels
        try:
            key = tuple(int(labels.get(k, "")) for k in (runtime.LABEL_CLUSTER, LABEL))
        except ValueError:
            key = None  # not one we made: leave it
        if key is None:
            continue
        if key in live or key in kept:
            want = "running" if key in live else "exited"
            if container.status in ("running", "restarting", "paused") and want == "exited":
                _quietly(container.stop, container.name, timeout=settings.SUANLI_WORKSPACE_STOP_S)
            elif container.status not in ("running", "paused") and want == "running":
                # Stopped from inside (`kill 1`). A paused one stays: its system disk is
                # full (monitoring.rootdisk); the owner stops and starts the cluster.
                if _quietly(container.start, container.name):
                    _started_by_label(container)
            continue
        if _remove_one(host, container.id):
            removed += 1
    for image in saves:
        # Saved filesystems of nodes that are neither live nor kept here (a release whose
        # host was down, a resize that dropped the node): the tenant's files, removed.
        for tag in image.tags:
            match = _KEPT_TAG.fullmatch(tag)
            if match and (int(match[1]), int(match[2])) not in live | kept:
                _quietly(client.images.remove, tag, image=tag, force=True)
    return removed


_KEPT_TAG = re.compile(KEEP_REPOSITORY + r"/c([0-9]+)-n([0-9]+):latest")


def kept_nodes_on(host: Host):
    """Nodes on `host` whose workspaces a stop keeps (their cluster stopped, or waiting to
    start again on this host)."""
    return Node.objects.filter(
        host=host,
        stopped_at__isnull=False,
        kept_until__isnull=True,
        cluster__state__in=[Cluster.State.STOPPED, Cluster.State.PENDING],
    )


def _quietly(call, name: str, **kwargs) -> bool:
    try:
        call(**kwargs)
    except _ERRORS as exc:
        log.warning("workspace %s: %s failed: %s", name, call.__name__, exc)
        return False
    return True


def _started_by_label(container) -> None:
    """A live node's workspace the sweep started: its node runs (billed) from now, if it
    had not run before (a start cut short after its make)."""
    node_id = container.labels.get(LABEL_NODE, "")
    if node_id.isdigit():
        Node.objects.filter(
            pk=int(node_id), released_at__isnull=True, started_at__isnull=True
        ).update(started_at=timezone.now())


def live_node(cluster: Cluster, index: int) -> Node:
    """The cluster's live node `index` whose workspace was made (its host selected), or
    WorkspaceError saying why there is none (in words a researcher acts on). Reads only
    the database."""
    if cluster.state == Cluster.State.STOPPED:
        raise WorkspaceError(
            _("cluster %(cluster)s is stopped: start it (with or without GPUs) to log in")
            % {"cluster": cluster.name}
        )
    if cluster.state != Cluster.State.RUNNING:
        raise WorkspaceError(
            _("cluster %(cluster)s is %(state)s, not running")
            % {"cluster": cluster.name, "state": cluster.get_state_display()}
        )
    if not cluster.workspace:
        raise WorkspaceError(
            _("cluster %(cluster)s was created without workspaces (jobs only)")
            % {"cluster": cluster.name}
        )
    node = (
        Node.objects.filter(
            cluster=cluster, index=index, released_at__isnull=True, lost_at__isnull=True
        )
        .select_related("host")
        .first()
    )
    if node is None:
        raise WorkspaceError(
            _("cluster %(cluster)s has no node %(index)s")
            % {"cluster": cluster.name, "index": index}
        )
    if not node.workspace_container:
        raise WorkspaceError(
            _("the workspace of node %(index)s is starting; try again shortly") % {"index": index}
        )
    return node


def running(cluster: Cluster, index: int):
    """The running workspace container of the cluster's node `index`, or WorkspaceError
    saying why there is none (in words a researcher acts on)."""
    node = live_node(cluster, index)
    try:
        container = engine.cached_client(node.host).containers.get(node.workspace_container)
    except docker.errors.NotFound:
        raise WorkspaceError(
            _("the workspace of node %(index)s is being made again") % {"index": index}
        ) from None
    except _ERRORS as exc:
        raise WorkspaceError(
            _("the host of node %(index)s does not answer: %(error)s")
            % {"index": index, "error": exc}
        ) from None
    if container.status != "running":
        raise WorkspaceError(
            _("the workspace of node %(index)s is %(status)s")
            % {"index": index, "status": container.status}
        )
    return container


def exec_kwargs(cluster: Cluster, cmd: list[str], *, tty: bool, env: dict | None = None) -> dict:
    """`exec_create` arguments of a login into a workspace: the tenant's uid, never root,
    never privileged; the command is one argv list, never a shell string we build."""
    uid, start = runtime.tenant_uid(cluster.owner_id), home(cluster)
    return {
        "cmd": cmd,
        "user": f"{uid}:{uid}",
        "workdir": start,
        "environment": {"HOME": start, **(env or {})},
        "stdin": True,
        "stdout": True,
        "stderr": True,
        "tty": tty,
        "privileged": False,
    }


# -- GPUs handed back only once the last tenant's containers are gone --------------------------

# A container in one of these states may have processes on its GPUs (and their memory).
_ALIVE = ["running", "restarting", "paused", "removing"]
_ALL_GPUS = frozenset(range(MAX_GPUS_PER_HOST))


def gpus_of(container) -> frozenset[int]:
    """The host GPUs a container of ours was given: its NVIDIA_VISIBLE_DEVICES (set on every
    host, emulated ones too; the node's value wins over a job's env) and its device
    requests. "all", or a value that is not a list of indices, counts as every GPU."""
    attrs = container.attrs
    found: set[int] = set()
    for entry in (attrs.get("Config") or {}).get("Env") or []:
        name, _, value = entry.partition("=")
        if name != "NVIDIA_VISIBLE_DEVICES" or value.strip() in ("", "void", "none"):
            continue
        try:
            found |= {int(i) for i in value.split(",")}
        except ValueError:
            return _ALL_GPUS
    for request in (attrs.get("HostConfig") or {}).get("DeviceRequests") or []:
        if request.get("Count") == -1:
            return _ALL_GPUS
        try:
            found |= {int(i) for i in request.get("DeviceIDs") or []}
        except ValueError:
            return _ALL_GPUS
    return frozenset(found)


def _busy_gpus(host: Host, clusters: set[int]) -> tuple[set[int], dict[int, set[int]]]:
    """(GPUs a live container of ours holds on the host, {cluster: GPUs its containers were
    given, whatever their state}) as the host's engine reports them now."""
    client = engine.cached_client(host)
    alive: set[int] = set()
    for container in client.containers.list(
        ignore_removed=True, all=True, filters={"label": [runtime.LABEL_CLUSTER], "status": _ALIVE}
    ):
        alive |= gpus_of(container)
    made: dict[int, set[int]] = {}
    for cluster_id in clusters:
        made[cluster_id] = set()
        for container in client.containers.list(
            ignore_removed=True,
            all=True,
            filters={"label": [f"{runtime.LABEL_CLUSTER}={cluster_id}"]},
        ):
            made[cluster_id] |= gpus_of(container)
    return alive, made


def free_gpus(*, host_ids=None, cluster_id: int | None = None) -> int:
    """Give back the GPU slots that ended nodes still hold (lifecycle.free_nodes), on the
    hosts (or of the cluster) named, once the engine of each host confirms it:

    * no container of ours with those GPUs runs (any tenant's: a leftover counts too), and
    * unless the node's workspace is kept by a stop (stopped is all a stop asks), none of
      its cluster's containers with those GPUs exists any more (a release removes them);
    * and no replica of the node is being made or runs in the database (a start that
      raced the release would make its container after the engine was asked).

    A host that does not answer, or is down, keeps its slots held (it takes no work while
    down; its first answer frees them). Returns how many slots were given back."""
    held = GpuSlot.objects.filter(node__released_at__isnull=False).exclude(
        host__state=Host.State.DOWN
    )
    if host_ids is not None:
        held = held.filter(host_id__in=list(host_ids))
    if cluster_id is not None:
        held = held.filter(node__cluster_id=cluster_id)
    nodes: dict[int, dict[int, set[int]]] = {}  # host -> node -> GPU indices
    cluster_of: dict[int, tuple[int, bool]] = {}  # node -> (cluster, kept by a stop)
    for host_id, node_id, owner_cluster, index, stopped, kept_until in held.values_list(
        "host_id", "node_id", "node__cluster_id", "index", "node__stopped_at", "node__kept_until"
    ):
        nodes.setdefault(host_id, {}).setdefault(node_id, set()).add(index)
        cluster_of[node_id] = (owner_cluster, stopped is not None and kept_until is None)
    starting = set(
        Replica.objects.filter(
            node_id__in=list(cluster_of), state__in=[Replica.State.CREATING, Replica.State.RUNNING]
        ).values_list("node_id", flat=True)
    )
    freed = 0
    for host in Host.objects.filter(pk__in=list(nodes)):
        ready = {n: gpus for n, gpus in nodes[host.pk].items() if n not in starting}
        if not ready:
            continue
        removing = {cluster_of[n][0] for n in ready if not cluster_of[n][1]}
        with transaction.atomic():
            # The nodes' rows locked while the engine is asked: a workspace start (_up)
            # waits, and then finds its node ended, instead of starting on given-back GPUs.
            list(Node.objects.select_for_update().filter(pk__in=list(ready)).values("pk"))
            try:
                alive, made = _busy_gpus(host, removing)
            except _ERRORS as exc:
                log.info("GPUs held on %s stay held: its engine did not answer: %s", host.name, exc)
                continue
            for node_id, gpus in ready.items():
                owner_cluster, kept = cluster_of[node_id]
                if gpus & alive or (not kept and gpus & made[owner_cluster]):
                    continue
                # Only while this node still holds them (a start of its own cluster may have
                # taken them over meanwhile: services.cluster_start).
                freed += GpuSlot.objects.filter(node_id=node_id, index__in=gpus).update(node=None)
    return freed


def gpus_held(cluster_id: int) -> bool:
    """Whether ended nodes of the cluster still hold GPU slots (being freed)."""
    return GpuSlot.objects.filter(
        node__cluster_id=cluster_id, node__released_at__isnull=False
    ).exists()

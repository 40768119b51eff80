"""Starting a job: claim the cluster's next job (`dispatch`), then create and start one
container per node side by side (`start_replicas`). A start that fails says why: the
job's own failure (a bad image, a spec the engine refuses) ends the attempt; an engine's
own failure marks the host and moves the job without using a retry.

Layer: runs, over preemption; uses preemption, settle, stopping, shared, nodes (engine,
network, registry, runtime), placement (capacity), files (storage), events (lifecycle,
timeline), models and base (text).
"""

from __future__ import annotations

import logging
import queue
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import docker
from django.conf import settings
from django.db import connections, transaction
from django.utils import timezone
from django.utils.translation import gettext_noop

from jobs.base import metrics
from jobs.base.text import Text, join
from jobs.events import lifecycle
from jobs.events.timeline import job_event, reason_fields
from jobs.files import storage
from jobs.models import Cluster, Host, Job, Node, Replica
from jobs.nodes import engine, network, registry, runtime, workspaces
from jobs.placement import capacity
from jobs.runs.preemption import preempt
from jobs.runs.settle import finish, settle
from jobs.runs.shared import enqueue
from jobs.runs.stopping import stop

log = logging.getLogger(__name__)


def dispatch(cluster_id: int) -> int | None:
    """Claim the cluster's oldest queued job if nothing runs on it; then start it."""
    job_id = claim(cluster_id)
    if job_id is not None:
        start_replicas(job_id)
    return job_id


# Starts one dispatch task keeps in flight at most (its own cluster's and others ready), and
# how long it goes on taking more as they finish (the tasks queued behind take over). Another
# cluster's start never waits for a pull here (`_start_one`): it is a few engine calls, each
# bounded by the engine client's timeout, so what the task took ends long before RQ's
# timeout (600 s) could kill it and leave other tenants' jobs half started.
BATCH = 8
KEEP_TAKING_S = 60


def dispatch_ready(cluster_id: int) -> int | None:
    """The dispatch task: `dispatch` of the cluster, and of other running clusters whose
    next job waits with nothing of theirs active (oldest first), BATCH starts side by
    side, one thread each, another taken as each one ends, until none waits (or
    KEEP_TAKING_S has passed). A burst of submits queues one dispatch per cluster, and a
    start waits on its engine most of its time: the first tasks to run start the burst
    several at a time, and the tasks queued behind find their job started. Each cluster
    is claimed as `dispatch` claims it, under its row lock (one that another worker holds
    is skipped), so a job starts once. Another job's failure is logged (the reconciler
    starts a job left starting again); the own job's is raised, as `dispatch` raises it.
    Returns the cluster's own job, as `dispatch` does."""
    own = claim(cluster_id)
    if connections["default"].in_atomic_block:
        # Threads' own connections could not see the caller's uncommitted rows: here.
        for job_id in ([own] if own is not None else []) + _claim_ready(
            exclude=cluster_id, most=BATCH - (own is not None)
        ):
            _start_one(job_id, own)
        return own
    deadline, failed = time.monotonic() + KEEP_TAKING_S, None
    with ThreadPoolExecutor(max_workers=BATCH) as pool:
        running = {pool.submit(_start_one, own, own, True)} if own is not None else set()
        while True:
            if time.monotonic() < deadline:
                for job_id in _claim_ready(exclude=cluster_id, most=BATCH - len(running)):
                    running.add(pool.submit(_start_one, job_id, own, True))
            if not running:
                break
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                if future.exception() is not None:
                    # The own job's start failed: the others end theirs, then it is raised.
                    deadline = 0
                    failed = future
    if failed is not None:
        failed.result()
    return own


def _claim_ready(*, exclude: int, most: int) -> list[int]:
    """Up to `most` jobs claimed on other clusters that wait for nothing but a dispatch:
    running with their GPUs, a job waiting, none active (what `dispatch_all` finds)."""
    if most <= 0:
        return []
    candidates = (
        Job.objects.filter(
            state__in=Job.WAITING, cluster__state=Cluster.State.RUNNING, cluster__no_gpu=False
        )
        .exclude(cluster_id=exclude)
        .exclude(cluster_id__in=Job.objects.filter(state__in=Job.ACTIVE).values("cluster_id"))
        .order_by("queued_at", "id")
        .values_list("cluster_id", flat=True)[: most * 4]
    )
    claimed = []
    for cluster_id in dict.fromkeys(candidates):
        job_id = claim(cluster_id, skip_locked=True)
        if job_id is not None:
            claimed.append(job_id)
            if len(claimed) == most:
                break
    return claimed


def _start_one(job_id: int, own: int | None, thread: bool = False) -> None:
    try:
        # Another cluster's job is not pulled for here: one whose image is not on a host
        # goes on in a start task of its own (`jobs.tasks.job_start`), so no start in the
        # batch waits behind a pull, nor ties this task's time to the slowest image.
        start_replicas(job_id, pull=job_id == own)
    except Exception:
        if job_id == own:
            raise
        log.exception("job %s: its start failed; the reconciler tries it again", job_id)
    finally:
        if thread:
            connections.close_all()  # this thread's own


def claim(cluster_id: int, *, skip_locked: bool = False) -> int | None:
    """The cluster's oldest queued job claimed for its next attempt, if nothing runs on
    the cluster and its nodes' hosts can start it; None otherwise. `skip_locked`: None
    at once when another transaction holds the cluster's row."""
    with transaction.atomic():
        cluster = (
            Cluster.objects.select_for_update(of=("self",), skip_locked=skip_locked)
            .filter(pk=cluster_id)
            .first()
        )
        if cluster is None or cluster.state != Cluster.State.RUNNING or cluster.no_gpu:
            return None  # no-GPU mode runs no jobs (job_submit says so)
        if cluster.jobs.filter(state__in=Job.ACTIVE).exists():
            return None  # one job at a time: the next starts when this one ends
        # A preempted job keeps its place: it was queued before anything behind it.
        job = cluster.jobs.filter(state__in=Job.WAITING).order_by("queued_at", "id").first()
        nodes = list(
            Node.objects.filter(cluster=cluster, released_at__isnull=True)
            .select_related("host")
            .order_by("index")
        )
        stranded = [n for n in nodes if n.lost_at or n.host.state in Host.UNHEALTHY]
        if cluster.pool_id and not stranded:
            job = _take_from_pool(cluster, job)
        if job is None:
            return None
        if stranded:
            _wait_for_hosts(job, stranded)
            return None
        if not _claim(job, cluster, nodes):
            return None
    return job.pk


def _wait_for_hosts(job: Job, stranded: list[Node]) -> None:
    """Not on a host that is down or cannot start containers: the job waits for the host
    to come back or for placement to move the node (`stranded.move_stranded`), and says so
    (once)."""
    where = join(
        [
            Text(
                gettext_noop("node %(index)s is on %(host)s (%(state)s)"),
                index=n.index,
                host=n.host.name,
                state=capacity.host_state(n.host.state),
            )
            for n in stranded
        ]
    )
    waiting = reason_fields(
        Job,
        Text(
            gettext_noop(
                "waiting for its cluster: %(where)s; starts when the host is back or the "
                "node has moved"
            ),
            where=where,
        ),
    )
    Job.objects.filter(pk=job.pk).exclude(state_reason=waiting["state_reason"]).update(**waiting)


def _claim(job: Job, cluster: Cluster, nodes: list[Node]) -> bool:
    """The job's next attempt, claimed by compare-and-set (a duplicate delivery finds the
    job no longer waiting or, in a pool, moved to another cluster meanwhile), with one
    replica per node to start. In the caller's transaction, the cluster's row locked."""
    attempt = job.attempt + 1
    now = timezone.now()
    volumes = list(cluster.volumes.all())
    resume = _resume_point(job, volumes) if job.attempt else ""
    if not Job.objects.filter(pk=job.pk, state=job.state, cluster_id=cluster.pk).update(
        state=Job.State.STARTING,
        attempt=attempt,
        started_at=now,
        **reason_fields(Job, ""),
        master_port=settings.SUANLI_MASTER_PORT_BASE if nodes else None,
        stop_requested_at=None,
        preempt_requested_at=None,
        resume_from=resume,
    ):
        return False
    if job.state == Job.State.PREEMPTED:
        _say_resuming(job, attempt, resume, volumes)
    Replica.objects.bulk_create(
        [
            Replica(
                job=job,
                attempt=attempt,
                rank=node.index,
                node=node,
                host_id=node.host_id,
                container_name=runtime.container_name(job, node.index, attempt),
            )
            for node in nodes
        ]
    )
    cluster.last_active_at = now
    cluster.save(update_fields=["last_active_at"])
    job_event(
        job.pk,
        "starting",
        Text(
            gettext_noop("attempt %(attempt)s on 1 node")
            if len(nodes) == 1
            else gettext_noop("attempt %(attempt)s on %(nodes)s nodes"),
            attempt=attempt,
            nodes=len(nodes),
        ),
    )
    return True


def _say_resuming(job: Job, attempt: int, resume: str, volumes) -> None:
    """A preempted job's restart, on its timeline: from which checkpoint, or why from scratch."""
    if resume:
        where = Text(gettext_noop("from %(checkpoint)s"), checkpoint=resume)
    elif storage.covering_volume(volumes, job.checkpoint_dir):
        where = Text(gettext_noop("from scratch: no checkpoint in %(dir)s"), dir=job.checkpoint_dir)
    else:
        where = Text(
            gettext_noop("from scratch: no checkpoint in %(dir)s (it is not on a volume)"),
            dir=job.checkpoint_dir,
        )
    job_event(
        job.pk,
        "resuming",
        Text(
            gettext_noop("restart %(restart)s after preemption %(preemption)s, %(where)s"),
            restart=attempt - 1,
            preemption=job.preemptions,
            where=where,
        ),
    )


def _take_from_pool(cluster: Cluster, own: Job | None) -> Job | None:
    """A free pool cluster runs the pool's oldest waiting job, wherever it waits (its own
    queue's first otherwise); the job moves here. The cluster's row is locked; the job is
    moved by compare-and-set, so a cancel or another cluster's claim wins cleanly."""
    job = (
        Job.objects.filter(pool_id=cluster.pool_id, state__in=Job.WAITING)
        .order_by("queued_at", "id")
        .first()
    )
    if job is None or (own is not None and (own.queued_at, own.pk) <= (job.queued_at, job.pk)):
        return own
    if not Job.objects.filter(pk=job.pk, state=job.state, cluster_id=job.cluster_id).update(
        cluster_id=cluster.pk
    ):
        return own
    job_event(
        job.pk,
        "moved",
        Text(
            gettext_noop("runs on %(cluster)s, the pool's first free cluster"), cluster=cluster.name
        ),
    )
    job.cluster_id = cluster.pk
    return job


def _resume_point(job: Job, volumes) -> str:
    """SUANLI_RESUME_FROM of a restart: the newest checkpoint in the job's checkpoint
    directory on the owner's storage, or "" when there is none."""
    found = storage.newest_checkpoint(
        storage.tenant_root(job.owner_id), volumes, job.checkpoint_dir, not_before=job.created_at
    )
    return found or ""


def _pull(client: docker.DockerClient, job: Job, host: Host, image: str, db=None) -> None:
    """`db`: who does its database work (`_launch`'s)."""
    db = db or _direct
    db(
        job_event,
        job.pk,
        "pulling",
        Text(gettext_noop("pulling %(image)s on %(host)s"), image=image, host=host.name),
    )
    registry.pull_public(client, image, host=host.name, cluster_id=job.cluster_id, db=db)
    db(
        job_event,
        job.pk,
        "pulled",
        Text(gettext_noop("%(image)s is on %(host)s"), image=image, host=host.name),
    )


_START_ERRORS = (
    docker.errors.DockerException,
    engine.EngineError,
    runtime.SpecError,
    network.NetworkError,
    registry.RegistryError,
    OSError,
)


def start_replicas(job_id: int, *, pull: bool = True) -> None:
    """Create and start every replica of the job's current attempt. Safe to repeat: a
    replica's container has a fixed name, so a second try finds it instead of making a
    second one. The replicas start side by side (one thread each, engine calls only), so a
    multi-node job waits for its slowest container, not for the sum of them. `pull`
    False: an image missing on a host is not pulled here; the job's start is queued as a
    task of its own (`jobs.tasks.job_start`), which pulls it."""
    job = Job.objects.select_related("cluster", "cluster__own_image").get(pk=job_id)
    if job.state != Job.State.STARTING:
        return
    replicas = list(
        Replica.objects.filter(job=job, attempt=job.attempt)
        .select_related("node__host", "host")
        .order_by("rank")
    )
    if not replicas:
        finish(
            job.pk, Job.State.FAILED, Text(gettext_noop("the cluster has no nodes")), exit_code=None
        )
        return
    todo = [r for r in replicas if r.state == Replica.State.CREATING]
    if todo and _start_abandoned(job):
        # Cancelled, or its cluster released, while we were starting: make no more.
        _drop_unstarted(job)
        stop(job.pk)
        settle(job.pk)
        return
    network_name = _network_for(job, replicas, todo)
    if network_name is None:
        return
    specs = _specs(job, replicas, todo, network_name)
    if specs is None or not _launch_all(job, replicas, todo, specs, pull=pull):
        return
    _mark_running(job, replicas)
    job.refresh_from_db()
    if job.cancel_requested:
        stop(job.pk)
    elif job.preempt_requested_at is not None and job.stop_requested_at is None:
        preempt(job.pk)  # the notice came while it was starting


def _network_for(job: Job, replicas: list[Replica], todo: list[Replica]) -> str | None:
    """The cluster's network: made at placement; made here if that task has not run yet
    (or a host lost it). None when it could not be made (the attempt has ended)."""
    try:
        return network.ensure(job.cluster_id, [r.node for r in replicas])
    except _START_ERRORS as exc:
        # An engine that does not answer, or cannot make a bridge: the host's failure.
        cause = exc.__cause__ if isinstance(exc, network.NetworkError) else exc
        on_it = [r for r in todo if r.host_id == getattr(exc, "host_id", None)]
        if cause is not None and on_it and engine.engine_fault(cause):
            _host_failed_start(job, [(r, cause) for r in on_it])
        else:
            _fail_replicas(
                job,
                todo,
                Text(gettext_noop("the cluster network could not be made: %(error)s"), error=exc),
            )
        return None


def _specs(
    job: Job, replicas: list[Replica], todo: list[Replica], network_name: str
) -> list[runtime.ContainerSpec] | None:
    """The container of each replica to start; None when one cannot be made (the attempt
    has ended)."""
    specs = []
    for replica in todo:
        try:
            specs.append(
                runtime.container_spec(
                    job=job,
                    node=replica.node,
                    nodes=len(replicas),
                    attempt=job.attempt,
                    nvidia=not replica.host.emulated_gpu,
                    network_name=network_name,
                )  # fmt: skip
            )
        except _START_ERRORS as exc:
            _fail_replicas(job, [replica], _where(replica, exc))
            return None
    return specs


def _launch_all(
    job: Job,
    replicas: list[Replica],
    todo: list[Replica],
    specs: list[runtime.ContainerSpec],
    *,
    pull: bool = True,
) -> bool:
    """Launch the replicas side by side and record each one that runs; False when one did
    not start (the host's failure or the job's, said and settled; or, `pull` False, an
    image to pull first: the start goes on in a task of its own)."""
    if len(todo) == 1:
        outcomes = [_launch(job, replicas, todo[0], specs[0], pull=pull)]
    else:
        with ThreadPoolExecutor(max_workers=min(len(todo), 16)) as pool:
            db = _DatabaseFromCaller()
            futures = [
                pool.submit(_launch, job, replicas, r, s, db=db, pull=pull)
                for r, s in zip(todo, specs, strict=True)
            ]
            db.serve(futures)
            outcomes = [f.result() for f in futures]
    failed, to_pull = [], False
    for replica, outcome in zip(todo, outcomes, strict=True):
        if isinstance(outcome, _ImageToPull):
            to_pull = True
            continue
        if isinstance(outcome, Exception):
            failed.append((replica, outcome))
            continue
        if Replica.objects.filter(pk=replica.pk, state=Replica.State.CREATING).update(
            container_id=outcome.id, state=Replica.State.RUNNING, started_at=timezone.now()
        ):
            _node_started(replica.node_id)
    if failed:
        faults = [(r, exc) for r, exc in failed if engine.engine_fault(exc)]
        if faults:
            _host_failed_start(job, faults)
        else:
            _fail_replicas(job, [r for r, _ in failed], _where(*failed[0]))
            _fail_cluster_never_ran(job, *failed[0])
        return False
    if to_pull:
        enqueue("jobs.tasks.job_start", job.pk, job_id=f"start-{job.pk}")  # as the reconciler
        return False
    return True


class _ImageToPull(Exception):
    """The replica's image is not on its host, and this start does not pull it."""


def _direct(fn, *args, **kwargs):
    return fn(*args, **kwargs)


class _DatabaseFromCaller:
    """The database work of a start's launch threads (a pull's progress and timeline
    entries, a network made again) done by the thread that launched them, on its own
    connection: launch threads make engine calls only, so a worker holds one database
    connection per start in flight (BATCH + 1 in all), not one per replica as well (a
    batch of 16-node jobs pulling their images would hold over 100, past PostgreSQL's
    default max_connections, and the web, cron and billing would be refused)."""

    def __init__(self) -> None:
        self._asked: queue.SimpleQueue = queue.SimpleQueue()

    def __call__(self, fn, *args, **kwargs):
        """In a launch thread: `fn(*args, **kwargs)` run by the caller; its result."""
        answer: Future = Future()
        self._asked.put((answer, fn, args, kwargs))
        return answer.result()

    def serve(self, futures: list[Future]) -> None:
        """In the caller: run what the launch threads ask until every one has ended."""
        for future in futures:
            future.add_done_callback(lambda _: self._asked.put(None))
        pending = set(futures)
        while pending:
            asked = self._asked.get()
            if asked is None:  # one ended
                pending = {f for f in pending if not f.done()}
                continue
            answer, fn, args, kwargs = asked
            try:
                answer.set_result(fn(*args, **kwargs))
            except Exception as exc:
                answer.set_exception(exc)


def _node_started(node_id: int) -> None:
    """A replica of the node runs: the node has run from now on, if it had not (a cluster
    without workspaces; with one, its workspace's start said so first). Billing of a
    node starts here or there (`Node.started_at`), never at its placement."""
    Node.objects.filter(pk=node_id, started_at__isnull=True).update(started_at=timezone.now())


def _fail_cluster_never_ran(job: Job, replica: Replica, exc: BaseException) -> None:
    """A cluster without workspaces whose first job could not start from the cluster's
    image, for good (workspaces.final: it cannot be pulled, or not started): it fails as
    a cluster with a workspace of that image does (nothing charged, its GPUs back). One
    that ran before keeps its place; the job alone fails."""
    cluster = job.cluster
    if (
        cluster.workspace
        or not workspaces.final(exc)
        or Node.objects.filter(cluster_id=cluster.pk, started_at__isnull=False).exists()
    ):
        return
    workspaces.fail_never_ran(cluster, replica.node, exc)


def _mark_running(job: Job, replicas: list[Replica]) -> bool:
    """STARTING -> RUNNING once every replica runs; the state, its timeline entry and its
    webhook event at once. False when another caller got there first."""
    with transaction.atomic():
        now = timezone.now()
        if Job.objects.filter(pk=job.pk, state=Job.State.STARTING).update(
            state=Job.State.RUNNING, running_since=now
        ):
            waited = (now - job.queued_at).total_seconds()
            # After the commit: a Redis that does not answer must not hold the job's row.
            transaction.on_commit(lambda: metrics.observe(metrics.JOB_START, waited))
            hosts = join(
                [
                    Text(gettext_noop("rank %(rank)s on %(host)s"), rank=r.rank, host=r.host.name)
                    for r in replicas
                ]
            )
            job_event(job.pk, "running", hosts)
            return True
    return False


def adopt(replica: Replica, container) -> None:
    """A replica still marked `creating` whose container runs (the worker that started it
    died before it could say so): it is running, from the container's own start; its job
    too once every replica runs."""
    started = engine.container_time(container.attrs.get("State", {}).get("StartedAt"))
    if not Replica.objects.filter(pk=replica.pk, state=Replica.State.CREATING).update(
        state=Replica.State.RUNNING, container_id=container.id, started_at=started or timezone.now()
    ):
        return
    Node.objects.filter(pk=replica.node_id, started_at__isnull=True).update(
        started_at=started or timezone.now()
    )
    replicas = list(
        Replica.objects.filter(job_id=replica.job_id, attempt=replica.attempt).select_related(
            "host"
        )
    )
    if all(r.state == Replica.State.RUNNING for r in replicas) and _mark_running(
        replica.job, replicas
    ):
        if Job.objects.filter(pk=replica.job_id, cancel_requested=True).exists():
            stop(replica.job_id)


def _where(replica: Replica, exc: BaseException) -> Text:
    return Text(
        gettext_noop("rank %(rank)s on %(host)s: %(error)s"),
        rank=replica.rank,
        host=replica.host.name,
        error=engine.describe(exc),
    )


def _host_failed_start(job: Job, faults: list[tuple[Replica, BaseException]]) -> None:
    """Containers the engine could not start for reasons of its own (its network, runtime
    or storage; or it stopped answering): the host is degraded (or down) for operators,
    with the engine's words; the researcher reads a plain sentence; the attempt ends
    without using a retry, and placement moves the cluster off that host."""
    for replica, exc in faults:
        error = engine.describe(exc)
        log.warning("job %s: rank %s on %s: %s", job.pk, replica.rank, replica.host.name, error)
        if engine.unreachable(exc):
            # One timeout is not a dead host: its check decides (and says so).
            enqueue(
                "jobs.tasks.host_check", replica.host_id, job_id=f"host-check-{replica.host_id}"
            )
        else:
            lifecycle.host_unhealthy(
                host=replica.host,
                state=Host.State.DEGRADED,
                message=f"cannot start containers: {error}",
            )
    Replica.objects.filter(pk__in=[r.pk for r, _ in faults]).update(
        state=Replica.State.LOST, host_fault=True, finished_at=timezone.now()
    )
    names = ", ".join(sorted({r.host.name for r, _ in faults}))
    message = Text(
        gettext_noop(
            "the host %(host)s could not start containers; your job is being moved to another "
            "host (no retry used)"
        ),
        host=names,
    )
    Job.objects.filter(pk=job.pk).update(**reason_fields(Job, message))
    job_event(job.pk, "host-failed", message)
    _drop_unstarted(job)
    stop(job.pk)
    settle(job.pk)


def _fail_replicas(job: Job, failed: list[Replica], message: str | Text) -> None:
    Replica.objects.filter(pk__in=[r.pk for r in failed]).update(
        state=Replica.State.LOST, finished_at=timezone.now()
    )
    log.warning("job %s: %s", job.pk, message)
    _fail_start(job, message)


def _launch(
    job: Job,
    replicas: list[Replica],
    replica: Replica,
    spec: runtime.ContainerSpec,
    *,
    db=_direct,
    pull: bool = True,
):
    """One replica's container, created (or found) and started: the container, or the
    exception that stopped it (_ImageToPull: not pulled, `pull` False). In a thread of
    its own, its database work done by the caller's (`db`, a _DatabaseFromCaller)."""
    try:
        client = engine.cached_client(replica.host)

        def create():
            kwargs = runtime.with_image_volumes(client, spec.image, spec.kwargs)
            return client.containers.create(spec.image, name=spec.name, **kwargs)

        if registry.in_registry(spec.image):  # a researcher's own image: pulled with progress
            own = job.cluster.own_image  # read with the job (select_related)
            digest = own.digest if own else ""
            if not registry.has_current(client, spec.image, digest):
                if not pull:
                    return _ImageToPull(spec.image)
                registry.ensure(
                    replica.host, spec.image, cluster_id=job.cluster_id, digest=digest, db=db
                )
        # Straight to `create` (no look-ups first: each is a round trip on every start);
        # what it refuses says what is missing.
        try:
            container = create()
        except docker.errors.ImageNotFound:
            if not pull:
                return _ImageToPull(spec.image)
            _pull(client, job, replica.host, spec.image, db)
            container = create()
        except docker.errors.NotFound as exc:
            if "network" not in engine.describe(exc):
                raise
            # The network this process remembered is gone: make it again, once.
            db(_remake_network, job, replicas)
            container = create()
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: made by an earlier try or a duplicate delivery
                raise
            container = client.containers.get(spec.name)
        if container.status == "created":
            _start_container(container, remake=lambda: db(_remake_network, job, replicas))
        return container
    except _START_ERRORS as exc:
        return exc
    finally:
        if db is not _direct:  # a launch thread: its own connection, had anything opened one
            connections.close_all()


def _remake_network(job: Job, replicas: list[Replica]) -> str:
    network.forget(job.cluster_id)
    return network.ensure(job.cluster_id, [r.node for r in replicas])


def _start_container(container, *, remake) -> None:
    """Start it. A swarm overlay made moments ago may not be attachable yet on this engine,
    and a network this process remembered may have been removed meanwhile ("Could not
    attach to network ... not found"): make it again (`remake`) and retry a few times."""
    for delay in (0.2, 0.5, 1.0, None):
        try:
            container.start()
            return
        except docker.errors.APIError as exc:
            text = engine.describe(exc)
            if delay is None or "network" not in text or "not found" not in text:
                raise
            remake()
            time.sleep(delay)


def _start_abandoned(job: Job) -> bool:
    fresh = Job.objects.filter(pk=job.pk).values("cancel_requested", "cluster__state").first()
    return (
        fresh is None
        or fresh["cancel_requested"]
        or (fresh["cluster__state"] != Cluster.State.RUNNING)
    )


def _drop_unstarted(job: Job) -> None:
    """Replicas of this attempt that never got a container will not get one: mark them
    lost (and remove any container a racing duplicate delivery made meanwhile), so that
    the job can settle instead of waiting for them for ever."""
    for replica in Replica.objects.filter(
        job=job, attempt=job.attempt, state=Replica.State.CREATING
    ).select_related("host"):
        try:
            engine.cached_client(replica.host).containers.get(replica.container_name).remove(
                force=True, v=True
            )
        except (docker.errors.DockerException, engine.EngineError, OSError):
            pass  # not there (the usual case), or the reconciler removes it later
        Replica.objects.filter(pk=replica.pk, state=Replica.State.CREATING).update(
            state=Replica.State.LOST, finished_at=timezone.now()
        )


# A start's own failure, kept as the job's reason until it ends (settle says it again).
COULD_NOT_START = gettext_noop("could not start: %(reason)s")


def _fail_start(job: Job, message: str | Text) -> None:
    Job.objects.filter(pk=job.pk).update(
        **reason_fields(Job, Text(COULD_NOT_START, reason=message))
    )
    job_event(job.pk, "error", message)
    _drop_unstarted(job)
    stop(job.pk)
    settle(job.pk)

"""Jobs on the engines: start one container per node, follow them to their end, stop
them, and repair what a crash left behind. Every step is idempotent: a duplicate RQ
delivery, a watcher and the reconciler racing for the same container all end the same.

No worker waits on a container: starting returns once the containers run, the `watch`
process (or the reconciler) reports each exit, and stopping sends SIGTERM then schedules
the SIGKILL.

Layer: runner (dispatch, watch and finalise, reconcile, preemption), under services. Uses
lifecycle, webhooks, runtime, network, storage, engine, models and queue; never scheduler
or services. Its own follow-ups (a start, a kill, a check) are queued by task name.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import django_rq
import docker
from django.conf import settings
from django.db import connections, models, transaction
from django.utils import timezone
from django.utils.translation import gettext_noop
from rq.registry import StartedJobRegistry

from jobs.base.queue import enqueue_later, enqueue_unique
from jobs.base.text import Moment, Text, argument, join, json_of, reason_fields, stored_reason
from jobs.events import lifecycle, webhooks
from jobs.files import storage
from jobs.models import Cluster, Host, Job, JobEvent, Node, Replica
from jobs.nodes import engine, network, registry, runtime, workspaces
from jobs.placement import scheduler

log = logging.getLogger(__name__)


def _event(job_id: int, kind: str, message: str | Text = "") -> None:
    """The job's timeline, and its webhook event, in the caller's transaction."""
    JobEvent.objects.create(
        job_id=job_id, kind=kind, message=str(message)[:500], text=json_of(message)
    )
    webhooks.job_changed(job_id, kind)


def _enqueue(
    task: str, *args, job_id: str, delay: int | None = None, again_if_running: bool = False
):
    """A task of `jobs.tasks`, by name: deduplicated by `job_id`, or after `delay` seconds."""
    if delay:
        return enqueue_later(task, *args, delay_s=delay)
    return enqueue_unique("docker", task, *args, job_id=job_id, again_if_running=again_if_running)


# -- starting -------------------------------------------------------------------------------


def dispatch(cluster_id: int) -> int | None:
    """Claim the cluster's oldest queued job if nothing runs on it; then start it."""
    with transaction.atomic():
        cluster = Cluster.objects.select_for_update(of=("self",)).filter(pk=cluster_id).first()
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
            # Not on a host that is down or cannot start containers: it waits for the host
            # to come back or for placement to move the node (`scheduler.move_stranded`).
            where = join(
                [
                    Text(
                        gettext_noop("node %(index)s is on %(host)s (%(state)s)"),
                        index=n.index,
                        host=n.host.name,
                        state=scheduler.host_state(n.host.state),
                    )
                    for n in stranded
                ]
            )
            waiting = reason_fields(
                Text(
                    gettext_noop(
                        "waiting for its cluster: %(where)s; starts when the host is back or the "
                        "node has moved"
                    ),
                    where=where,
                ),
                500,
            )
            Job.objects.filter(pk=job.pk).exclude(state_reason=waiting["state_reason"]).update(
                **waiting
            )
            return None
        attempt = job.attempt + 1
        now = timezone.now()
        port = settings.SUANLI_MASTER_PORT_BASE if nodes else None
        volumes = list(cluster.volumes.all())
        resume = _resume_point(job, volumes) if job.attempt else ""
        # Compare-and-set: a duplicate delivery finds the job no longer waiting (or, in a
        # pool, moved to another cluster meanwhile).
        if not Job.objects.filter(pk=job.pk, state=job.state, cluster_id=cluster.pk).update(
            state=Job.State.STARTING,
            attempt=attempt,
            started_at=now,
            state_reason="",
            state_reason_text=None,
            master_port=port,
            stop_requested_at=None,
            preempt_requested_at=None,
            resume_from=resume,
        ):
            return None
        if job.state == Job.State.PREEMPTED:
            if resume:
                where = Text(gettext_noop("from %(checkpoint)s"), checkpoint=resume)
            elif storage.covering_volume(volumes, job.checkpoint_dir):
                where = Text(
                    gettext_noop("from scratch: no checkpoint in %(dir)s"), dir=job.checkpoint_dir
                )
            else:
                where = Text(
                    gettext_noop("from scratch: no checkpoint in %(dir)s (it is not on a volume)"),
                    dir=job.checkpoint_dir,
                )
            _event(
                job.pk,
                "resuming",
                Text(
                    gettext_noop("restart %(restart)s after preemption %(preemption)s, %(where)s"),
                    restart=attempt - 1,
                    preemption=job.preemptions,
                    where=where,
                ),
            )
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
        _event(
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
    start_replicas(job.pk)
    return job.pk


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
    _event(
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


def _pull(client: docker.DockerClient, job: Job, host: Host, image: str) -> None:
    _event(
        job.pk,
        "pulling",
        Text(gettext_noop("pulling %(image)s on %(host)s"), image=image, host=host.name),
    )
    registry.pull_public(client, image)
    _event(
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


def start_replicas(job_id: int) -> None:
    """Create and start every replica of the job's current attempt. Safe to repeat: a
    replica's container has a fixed name, so a second try finds it instead of making a
    second one. The replicas start side by side (one thread each, engine calls only), so a
    multi-node job waits for its slowest container, not for the sum of them."""
    job = Job.objects.select_related("cluster").get(pk=job_id)
    if job.state != Job.State.STARTING:
        return
    replicas = list(
        Replica.objects.filter(job=job, attempt=job.attempt)
        .select_related("node__host", "host")
        .order_by("rank")
    )
    if not replicas:
        _finish(
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
    try:
        # Made at placement; made here if that task has not run yet (or a host lost it).
        network_name = network.ensure(job.cluster_id, [r.node for r in replicas])
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
        return
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
            return
    if len(todo) == 1:
        outcomes = [_launch(job, replicas, todo[0], specs[0])]
    else:
        with ThreadPoolExecutor(max_workers=min(len(todo), 16)) as pool:
            outcomes = list(pool.map(lambda r, s: _launch(job, replicas, r, s), todo, specs))
    failed = []
    for replica, outcome in zip(todo, outcomes, strict=True):
        if isinstance(outcome, Exception):
            failed.append((replica, outcome))
            continue
        Replica.objects.filter(pk=replica.pk, state=Replica.State.CREATING).update(
            container_id=outcome.id, state=Replica.State.RUNNING, started_at=timezone.now()
        )
    if failed:
        faults = [(r, exc) for r, exc in failed if engine.engine_fault(exc)]
        if faults:
            _host_failed_start(job, faults)
        else:
            _fail_replicas(job, [r for r, _ in failed], _where(*failed[0]))
        return
    _mark_running(job, replicas)
    job.refresh_from_db()
    if job.cancel_requested:
        stop(job.pk)
    elif job.preempt_requested_at is not None and job.stop_requested_at is None:
        preempt(job.pk)  # the notice came while it was starting


def _mark_running(job: Job, replicas: list[Replica]) -> bool:
    """STARTING -> RUNNING once every replica runs; the state, its timeline entry and its
    webhook event at once. False when another caller got there first."""
    with transaction.atomic():
        if Job.objects.filter(pk=job.pk, state=Job.State.STARTING).update(
            state=Job.State.RUNNING, running_since=timezone.now()
        ):
            hosts = join(
                [
                    Text(gettext_noop("rank %(rank)s on %(host)s"), rank=r.rank, host=r.host.name)
                    for r in replicas
                ]
            )
            _event(job.pk, "running", hosts)
            return True
    return False


def _adopt(replica: Replica, container) -> None:
    """A replica still marked `creating` whose container runs (the worker that started it
    died before it could say so): it is running, from the container's own start; its job
    too once every replica runs."""
    started = engine.container_time(container.attrs.get("State", {}).get("StartedAt"))
    if not Replica.objects.filter(pk=replica.pk, state=Replica.State.CREATING).update(
        state=Replica.State.RUNNING, container_id=container.id, started_at=started or timezone.now()
    ):
        return
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
        words = engine.describe(exc)
        log.warning("job %s: rank %s on %s: %s", job.pk, replica.rank, replica.host.name, words)
        if engine.unreachable(exc):
            # One timeout is not a dead host: its check decides (and says so).
            _enqueue(
                "jobs.tasks.host_check", replica.host_id, job_id=f"host-check-{replica.host_id}"
            )
        else:
            lifecycle.host_unhealthy(
                host=replica.host,
                state=Host.State.DEGRADED,
                words=f"cannot start containers: {words}",
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
    Job.objects.filter(pk=job.pk).update(**reason_fields(message, 500))
    _event(job.pk, "host-failed", message)
    _drop_unstarted(job)
    stop(job.pk)
    settle(job.pk)


def _fail_replicas(job: Job, failed: list[Replica], message: str | Text) -> None:
    Replica.objects.filter(pk__in=[r.pk for r in failed]).update(
        state=Replica.State.LOST, finished_at=timezone.now()
    )
    log.warning("job %s: %s", job.pk, message)
    _fail_start(job, message)


def _launch(job: Job, replicas: list[Replica], replica: Replica, spec: runtime.ContainerSpec):
    """One replica's container, created (or found) and started: the container, or the
    exception that stopped it. Runs in a thread of its own."""
    try:
        client = engine.cached_client(replica.host)

        def create():
            kwargs = runtime.with_image_volumes(client, spec.image, spec.kwargs)
            return client.containers.create(spec.image, name=spec.name, **kwargs)

        if registry.in_registry(spec.image):  # a researcher's own image: pulled with progress
            own = job.cluster.own_image
            registry.ensure(
                replica.host,
                spec.image,
                cluster_id=job.cluster_id,
                digest=own.digest if own else "",
            )
        # Straight to `create` (no look-ups first: each is a round trip on every start);
        # what it refuses says what is missing.
        try:
            container = create()
        except docker.errors.ImageNotFound:
            _pull(client, job, replica.host, spec.image)
            container = create()
        except docker.errors.NotFound as exc:
            if "network" not in engine.describe(exc):
                raise
            # The network this process remembered is gone: make it again, once.
            _remake_network(job, replicas)
            container = create()
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: made by an earlier try or a duplicate delivery
                raise
            container = client.containers.get(spec.name)
        if container.status == "created":
            _start_container(container, remake=lambda: _remake_network(job, replicas))
        return container
    except _START_ERRORS as exc:
        return exc
    finally:
        if threading.current_thread() is not threading.main_thread():
            connections.close_all()  # this thread's own, if it used the database (an event)


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
        **reason_fields(Text(COULD_NOT_START, reason=message), 500)
    )
    _event(job.pk, "error", message)
    _drop_unstarted(job)
    stop(job.pk)
    settle(job.pk)


# -- stopping ------------------------------------------------------------------------------


def stop(job_id: int) -> None:
    """SIGTERM every live replica now; SIGKILL whatever still runs after the grace period
    (a preempted job's is `SUANLI_PREEMPT_GRACE_S`)."""
    Job.objects.filter(pk=job_id, stop_requested_at__isnull=True).update(
        stop_requested_at=timezone.now()
    )
    for replica in Replica.objects.filter(
        job_id=job_id, state=Replica.State.RUNNING
    ).select_related("host"):
        _signal(replica, "SIGTERM")
    job = (
        Job.objects.filter(pk=job_id)
        .values("attempt", "preempt_requested_at", "cancel_requested")
        .first()
    )
    if job is None:
        return
    # For this attempt only: a restart (after a preemption or a retry) inside the grace
    # period must not be killed by its predecessor's SIGKILL.
    _enqueue(
        "jobs.tasks.job_kill", job_id, job["attempt"], job_id=f"kill-{job_id}",
        delay=_grace(job["preempt_requested_at"] is not None and not job["cancel_requested"]),
    )  # fmt: skip


def _grace(preempting: bool) -> int:
    return settings.SUANLI_PREEMPT_GRACE_S if preempting else settings.SUANLI_STOP_GRACE_S


# -- preemption ----------------------------------------------------------------------------


def _start_scripts(job: Job) -> None:
    """Idempotent: a replica whose script was started keeps its exec id and is not given a
    second one (a replica that started after the notice gets its script on the next look)."""
    if not job.preemption_script.strip():
        return
    reason = job.cluster.state_reason.removeprefix("preempting: ") or "spot capacity reclaimed"
    for replica in Replica.objects.filter(
        job=job, attempt=job.attempt, state=Replica.State.RUNNING, preempt_exec_id=""
    ).select_related("host"):
        try:
            api = engine.cached_client(replica.host).api
            exec_id = api.exec_create(
                replica.container_name, **runtime.preemption_exec(job, reason)
            )["Id"]
            api.exec_start(exec_id, detach=True)
        except (docker.errors.DockerException, engine.EngineError, OSError) as exc:
            # Not running any more, or the engine is gone: nothing to save there.
            _event(
                job.pk,
                "notice",
                Text(
                    gettext_noop("rank %(rank)s: preemption script not run: %(error)s"),
                    rank=replica.rank,
                    error=engine.describe(exc),
                ),
            )
            exec_id = "-"
        Replica.objects.filter(pk=replica.pk, preempt_exec_id="").update(preempt_exec_id=exec_id)


def preempt(job_id: int) -> None:
    """The notice and what follows it: run the job's preemption script in every running
    replica (`docker exec`, detached; also in replicas that started after the notice),
    then stop the replicas once every script has ended or its time limit is up; until
    then look again in a second. A script still running at the limit dies with its
    container (SIGTERM, then SIGKILL after the grace period)."""
    job = Job.objects.select_related("cluster").get(pk=job_id)
    if (
        job.preempt_requested_at is None
        or job.stop_requested_at is not None
        or job.state not in Job.ACTIVE
    ):
        return
    _start_scripts(job)
    limit = settings.SUANLI_PREEMPT_SCRIPT_S
    overdue = (timezone.now() - job.preempt_requested_at).total_seconds() >= limit
    results: list[Text] = []
    waiting = False
    for replica in Replica.objects.filter(
        job=job, attempt=job.attempt, state=Replica.State.RUNNING
    ).select_related("host"):
        if replica.preempt_exec_id in ("", "-"):
            continue  # no script (or it could not be run)
        try:
            state = engine.cached_client(replica.host).api.exec_inspect(replica.preempt_exec_id)
        except (docker.errors.DockerException, engine.EngineError, OSError):
            continue  # the container went: its exit is on its way
        if state.get("Running"):
            waiting = True
            results.append(
                Text(
                    gettext_noop(
                        "rank %(rank)s: preemption script still running after its %(limit)s s "
                        "limit; stopped with the replica"
                    ),
                    rank=replica.rank,
                    limit=limit,
                )
            )
        else:
            results.append(
                Text(
                    gettext_noop("rank %(rank)s: preemption script exited with code %(code)s"),
                    rank=replica.rank,
                    code=state.get("ExitCode"),
                )
            )
    if waiting and not overdue:
        _enqueue("jobs.tasks.job_preempt", job_id, job_id=f"preempt-{job_id}", delay=1)
        return
    with transaction.atomic():
        # Compare-and-set: a duplicate (the reconciler's net) finds the stop already made.
        if not Job.objects.filter(pk=job_id, stop_requested_at__isnull=True).update(
            stop_requested_at=timezone.now()
        ):
            return
        for line in results:
            _event(job_id, "notice", line)
        _event(
            job_id,
            "stopping",
            Text(
                gettext_noop("preemption: SIGTERM now, SIGKILL after %(grace)s s"),
                grace=settings.SUANLI_PREEMPT_GRACE_S,
            ),
        )
    stop(job_id)
    settle(job_id)  # a job with no running replica left is preempted at once


def _preempted(job: Job) -> None:
    """Every replica of a preempted attempt has ended: count it, and put the job back to
    wait for its cluster (or fail it past its preemption limit)."""
    with transaction.atomic():
        Cluster.objects.select_for_update().filter(pk=job.cluster_id).first()
        job = Job.objects.select_for_update(of=("self",)).get(pk=job.pk)
        if job.state not in Job.ACTIVE or job.preempt_requested_at is None:
            return
        if job.cancel_requested:  # cancelled while the notice ran: it ends here
            _finish(job.pk, Job.State.CANCELLED, _cancelled(job), exit_code=None)
            lifecycle.cluster_requeue_preempted(cluster_id=job.cluster_id)
            return
        count = job.preemptions + 1
        said = stored_reason(job)
        reason = argument(said, lifecycle.NOTICE)
        if reason is None:  # another reason, or plain words (a row from before their twin)
            reason = said if isinstance(said, Text) else said.removeprefix("preemption notice: ")
        reason = reason or Text(gettext_noop("preempted"))
        if count > job.max_preemptions:
            Job.objects.filter(pk=job.pk).update(preemptions=count)
            _finish(
                job.pk,
                Job.State.FAILED,
                Text(
                    gettext_noop(
                        "preempted %(count)s times, more than its limit of %(limit)s "
                        "(last: %(reason)s)"
                    ),
                    count=count,
                    limit=job.max_preemptions,
                    reason=reason,
                ),
                exit_code=None,
            )
        else:
            at = Moment(job.preempt_requested_at, "%Y-%m-%d %H:%M:%S")
            Job.objects.filter(pk=job.pk).update(
                state=Job.State.PREEMPTED,
                preemptions=count,
                **reason_fields(
                    Text(
                        gettext_noop(
                            "preempted at %(at)s: %(reason)s; resumes when its cluster is placed "
                            "again"
                        ),
                        at=at,
                        reason=reason,
                    ),
                    500,
                ),
            )
            _event(
                job.pk,
                "preempted",
                Text(
                    gettext_noop("preemption %(count)s of at most %(limit)s: %(reason)s"),
                    count=count,
                    limit=job.max_preemptions,
                    reason=reason,
                ),
            )
        lifecycle.cluster_requeue_preempted(cluster_id=job.cluster_id)


def _cancelled(job: Job) -> Text | str:
    """Why a cancelled job ended: its reason ("cancelled by ..."), else "cancelled"."""
    return stored_reason(job) or Text(gettext_noop("cancelled"))


def kill(job_id: int, attempt: int | None = None) -> None:
    replicas = Replica.objects.filter(job_id=job_id, state=Replica.State.RUNNING)
    if attempt is not None:
        replicas = replicas.filter(attempt=attempt)
    for replica in replicas.select_related("host"):
        _signal(replica, "SIGKILL")


def _signal(replica: Replica, signal: str) -> None:
    try:
        engine.cached_client(replica.host).containers.get(replica.container_name).kill(
            signal=signal
        )
    except docker.errors.NotFound:
        pass  # already gone: the reconciler records it
    except (docker.errors.APIError, engine.EngineError, OSError) as exc:
        # 409: not running any more; its exit is on its way to the watcher.
        log.info("signal %s to %s: %s", signal, replica.container_name, engine.describe(exc))


# -- ending ------------------------------------------------------------------------------


def _stored_log(container) -> str:
    try:
        raw = container.logs(stdout=True, stderr=True, timestamps=True)
    except docker.errors.DockerException:
        return ""
    text = raw.decode("utf-8", "replace")
    limit = settings.SUANLI_LOG_STORE_BYTES
    return text if len(text) <= limit else "[... earlier output dropped ...]\n" + text[-limit:]


def replica_exited(replica_id: int, *, exit_code: int | None = None) -> None:
    """Record a replica's end: exit code and log, then remove its container. Idempotent."""
    replica = Replica.objects.select_related("host").get(pk=replica_id)
    if replica.state in (Replica.State.EXITED, Replica.State.LOST):
        return
    container = None
    try:
        container = engine.cached_client(replica.host).containers.get(replica.container_name)
        if exit_code is None:
            container.reload()
            if container.status in ("running", "created", "restarting"):
                return  # not ended after all
            exit_code = container.attrs["State"]["ExitCode"]
    except docker.errors.NotFound:
        pass
    except (docker.errors.DockerException, engine.EngineError, OSError) as exc:
        log.warning("replica %s: engine unreachable while finalising: %s", replica.pk, exc)
        return  # the reconciler tries again
    text = _stored_log(container) if container is not None else ""
    state = Replica.State.EXITED if exit_code is not None else Replica.State.LOST
    # The container's own end, whoever finalises it and however late (a watcher that was
    # down, the reconciler's next pass).
    finished = (
        engine.container_time(container.attrs.get("State", {}).get("FinishedAt"))
        if container is not None
        else None
    ) or timezone.now()
    host_fault = bool(exit_code) and _ended_by_engine(replica, finished)
    with transaction.atomic():
        updated = Replica.objects.filter(
            pk=replica.pk, state__in=[Replica.State.RUNNING, Replica.State.CREATING]
        ).update(
            state=state, exit_code=exit_code, finished_at=finished, log=text, host_fault=host_fault
        )
        if updated and host_fault:
            _event(
                replica.job_id,
                "host-lost",
                Text(
                    gettext_noop(
                        "rank %(rank)s was stopped by its host %(host)s (the engine restarted "
                        "or stopped answering; exit code %(code)s): not the job's failure"
                    ),
                    rank=replica.rank,
                    host=replica.host.name,
                    code=exit_code,
                ),
            )
    if container is not None:
        try:
            container.remove(force=True, v=True)
        except docker.errors.DockerException:
            pass  # the reconciler removes leftovers
    if updated:
        settle(replica.job_id)
    if Node.objects.filter(
        pk=replica.node_id, released_at__isnull=False, slots__isnull=False
    ).exists():
        free_gpus(host_ids=[replica.host_id])  # its node ended while it ran: its GPUs go back


def free_gpus(**which) -> int:
    """Ended nodes' GPUs back once their engines confirm (workspaces.free_gpus); a
    placement pass when some came back."""
    freed = workspaces.free_gpus(**which)
    if freed:
        lifecycle.request_placement()
    return freed


# Attempts ended by hosts before a job is failed after all: a job that breaks every host it
# lands on (or a host classed wrongly) must not run for ever.
MAX_HOST_RESTARTS = 10
PROFILES_TASK = "monitoring.tasks.profiles_summarise"  # a higher app's task, queued by name
POOL_TASK = "jobs.tasks.pool_scale"  # jobs/pools/autoscaler.py, above the runner
SWEEP_TASK = "jobs.tasks.sweep_job_ended"  # jobs/pools/sweeps.py

# A container's end counts as its engine's doing when it falls in an outage of the
# engine, give or take this much (a stopping engine SIGTERMs its containers around the
# moment its API goes; a starting one kills what ran before it).
OUTAGE_SLACK = timedelta(seconds=10)


def _ended_by_engine(replica: Replica, finished) -> bool:
    """Whether a container that ended with a non-zero code was ended by its engine (a
    restart or crash of dockerd), not by the job: it ended within the engine's last outage
    as the console saw it, while nobody had asked the job to stop."""
    host = Host.objects.filter(pk=replica.host_id).values("outage_from", "outage_to").first()
    if not host or host["outage_from"] is None:
        return False
    if finished < host["outage_from"] - OUTAGE_SLACK:
        return False
    if host["outage_to"] is not None and finished > host["outage_to"] + OUTAGE_SLACK:
        return False
    return not Job.objects.filter(pk=replica.job_id, stop_requested_at__isnull=False).exists()


def replica_lost(replica_id: int, reason: str | Text, *, host_fault: bool = False) -> None:
    replica = Replica.objects.get(pk=replica_id)
    if Replica.objects.filter(
        pk=replica.pk, state__in=[Replica.State.RUNNING, Replica.State.CREATING]
    ).update(state=Replica.State.LOST, finished_at=timezone.now(), host_fault=host_fault):
        _event(
            replica.job_id,
            "lost",
            Text(gettext_noop("rank %(rank)s: %(reason)s"), rank=replica.rank, reason=reason),
        )
        settle(replica.job_id)


def settle(job_id: int) -> None:
    """Decide the job's next state from its replicas (level-triggered)."""
    with transaction.atomic():
        job = Job.objects.select_for_update(of=("self",)).select_related("cluster").get(pk=job_id)
        if job.is_ended or job.state in Job.WAITING:
            return
        replicas = list(
            Replica.objects.filter(job=job, attempt=job.attempt)
            .select_related("host")
            .order_by("finished_at", "rank")
        )
        done = [r for r in replicas if r.state in (Replica.State.EXITED, Replica.State.LOST)]
        failed = [r for r in done if r.state == Replica.State.LOST or r.exit_code != 0]
        all_done = len(done) == len(replicas)
    if job.cancel_requested:
        if all_done:
            # A cancelled job's exit code is its replicas' when they all exited (the first
            # non-zero one, else 0); none when a replica was lost or never ran.
            codes = [r.exit_code for r in done if r.state == Replica.State.EXITED]
            code = None
            if replicas and len(codes) == len(replicas) and None not in codes:
                code = next((c for c in codes if c != 0), 0)
            _finish(job.pk, Job.State.CANCELLED, _cancelled(job), exit_code=code)
        return
    if job.preempt_requested_at is not None:
        # Exit codes of a preempted attempt are the signal's, not the job's failure; but a
        # job whose replicas all ended with 0 before the SIGTERM had simply finished.
        if all_done:
            notice = job.preempt_requested_at
            if not failed and all(r.finished_at and r.finished_at < notice for r in done):
                _finish(
                    job.pk,
                    Job.State.SUCCEEDED,
                    Text(
                        gettext_noop(
                            "all replicas exited with code 0 (before the preemption notice)"
                        )
                    ),
                    exit_code=0,
                )
            else:
                _preempted(job)  # whatever ended after the notice runs again from its checkpoint
        return
    if failed:
        first = failed[0]
        lost_to_host = [r for r in failed if r.host_fault]
        if lost_to_host:
            # The host's failure, not the job's: stop the rest, then run it again.
            cause = Text(
                gettext_noop("%(ranks)s lost to %(hosts)s"),
                ranks=join(
                    [Text(gettext_noop("rank %(rank)s"), rank=r.rank) for r in lost_to_host]
                ),
                hosts=", ".join(sorted({r.host.name for r in lost_to_host})),
            )
            if not all_done:
                _stop_the_rest(job, cause)
                return
            _requeue_after_host(job, cause)
            return
        if job.state_reason.startswith("could not start"):
            cause = stored_reason(job)  # the engine's own words, e.g. a failed pull
        elif first.state == Replica.State.LOST:
            cause = Text(gettext_noop("rank %(rank)s was lost"), rank=first.rank)
        else:
            cause = Text(
                gettext_noop("rank %(rank)s exited with code %(code)s"),
                rank=first.rank,
                code=first.exit_code,
            )
        if not all_done:
            _stop_the_rest(job, cause)
            return
        used = job.attempt - job.preemptions - job.host_restarts  # failed attempts so far
        if used <= job.retries:
            _requeue(
                job,
                Text(
                    gettext_noop("%(cause)s; retry %(used)s of %(retries)s"),
                    cause=cause,
                    used=used,
                    retries=job.retries,
                ),
            )
            return
        _finish(
            job.pk,
            Job.State.FAILED,
            cause.removesuffix("; stopping the other replicas")
            if isinstance(cause, str)
            else cause,
            exit_code=first.exit_code,
            at=_last_end(done),
        )
        return
    if all_done:
        _finish(
            job.pk,
            Job.State.SUCCEEDED,
            Text(gettext_noop("all replicas exited with code 0")),
            exit_code=0,
            at=_last_end(done),
        )


def _last_end(replicas: list[Replica]):
    return max((r.finished_at for r in replicas if r.finished_at), default=None)


def _stop_the_rest(job: Job, cause: str | Text) -> None:
    """One replica ended the attempt: stop the others, once (a second settle finds the
    reason already said)."""
    reason = Text(gettext_noop("%(cause)s; stopping the other replicas"), cause=cause)
    said = reason_fields(reason, 500)
    if Job.objects.filter(pk=job.pk).exclude(state_reason=said["state_reason"]).update(**said):
        _event(job.pk, "stopping", reason)
        stop(job.pk)


def _requeue_after_host(job: Job, cause: str | Text) -> None:
    """Every replica of an attempt that a host ended has stopped: the job waits again, at
    the head of its cluster's queue, and starts from its newest checkpoint once the
    cluster has its capacity back (the host answers again, or its nodes moved)."""
    if job.host_restarts >= MAX_HOST_RESTARTS:
        _finish(
            job.pk,
            Job.State.FAILED,
            Text(
                gettext_noop(
                    "%(cause)s; its hosts failed it %(times)s times, the most a job is run "
                    "again for (tell the operator)"
                ),
                cause=cause,
                times=job.host_restarts + 1,
            ),
            exit_code=None,
        )
        return
    reason = (
        stored_reason(job)  # the start's own sentence ("the host ... could not start")
        if job.state_reason.startswith("the host ")
        else Text(
            gettext_noop(
                "%(cause)s; runs again from its last checkpoint once its cluster has its "
                "capacity back (no retry used)"
            ),
            cause=cause,
        )
    )
    with transaction.atomic():
        if Job.objects.filter(pk=job.pk, state__in=Job.ACTIVE).update(
            state=Job.State.QUEUED,
            **reason_fields(reason, 500),
            host_restarts=models.F("host_restarts") + 1,
        ):
            _event(job.pk, "requeued", reason)
            lifecycle.request_dispatch(job.cluster_id)
            lifecycle.request_placement()  # the pass that moves its nodes off a failed host
    lifecycle.cluster_requeue_preempted(cluster_id=job.cluster_id)  # no-op unless preempting


def _requeue(job: Job, reason: str | Text) -> None:
    with transaction.atomic():
        if Job.objects.filter(pk=job.pk, state__in=Job.ACTIVE).update(
            state=Job.State.QUEUED, **reason_fields(reason, 500)
        ):
            _event(job.pk, "retrying", reason)
            lifecycle.request_dispatch(job.cluster_id)
    lifecycle.cluster_requeue_preempted(cluster_id=job.cluster_id)  # no-op unless preempting


def _finish(job_id: int, state: str, reason: str | Text, *, exit_code: int | None, at=None) -> None:
    """End the job: `at` is when it really ended (its last container's end) when known."""
    now = timezone.now()
    ended = min(at, now) if at is not None else now
    with transaction.atomic():
        # Lock order everywhere: cluster, then job (cluster_release, job_submit, dispatch).
        cluster_id = Job.objects.values_list("cluster_id", flat=True).get(pk=job_id)
        Cluster.objects.select_for_update().filter(pk=cluster_id).first()
        job = Job.objects.select_related("cluster").get(pk=job_id)
        if (
            not Job.objects.filter(pk=job_id)
            .exclude(state__in=Job.ENDED)
            .update(
                state=state, exit_code=exit_code, finished_at=ended, **reason_fields(reason, 500)
            )
        ):
            return
        _event(job_id, state, reason)
        if job.pool_id:
            # The pool may shrink now; a sweep's trial makes room for the next (by name:
            # both are above the runner).
            transaction.on_commit(
                lambda: enqueue_unique(
                    "default", POOL_TASK, job.pool_id, job_id=f"pool-scale-{job.pool_id}",
                    again_if_running=True,
                )
            )  # fmt: skip
            transaction.on_commit(
                lambda: enqueue_unique(
                    "default", SWEEP_TASK, job_id, job_id=f"sweep-job-{job_id}",
                    again_if_running=True,
                )
            )  # fmt: skip
        # Its profiler traces, if it wrote any, are summarised once it has ended.
        transaction.on_commit(
            lambda: enqueue_unique(
                "profiles", PROFILES_TASK, job_id, job_id=f"profiles-{job_id}",
                again_if_running=True,
            )
        )  # fmt: skip
        cluster = job.cluster
        Cluster.objects.filter(pk=cluster.pk).update(last_active_at=now)
        more = (
            cluster.jobs.filter(state__in=[*Job.WAITING, *Job.ACTIVE]).exclude(pk=job_id).exists()
        )
        if (
            not more
            and cluster.release_policy == Cluster.ReleasePolicy.AFTER_LAST_JOB
            and cluster.state in (Cluster.State.RUNNING, Cluster.State.PREEMPTING)
        ):
            lifecycle.cluster_release(
                cluster=cluster,
                reason=Text(
                    gettext_noop("released automatically after job %(job)s finished"),
                    job=job.name,
                ),
            )
        elif cluster.state == Cluster.State.PREEMPTING:
            lifecycle.cluster_requeue_preempted(cluster_id=cluster.pk)
        else:
            lifecycle.request_dispatch(cluster.pk)


# -- repair ----------------------------------------------------------------------------


def _settle_abandoned_rq_jobs() -> int:
    """RQ jobs whose worker died stay "started" until their heartbeat lapses; move them to
    the failed registry now. Their domain state (a job left STARTING, a replica without a
    container) is repaired below from the database, not by re-running the RQ job."""
    count = 0
    for name in ("docker", "default", "webhooks"):
        queue = django_rq.get_queue(name)
        registry = StartedJobRegistry(queue=queue)
        before = registry.count
        registry.cleanup()
        count += max(0, before - registry.count)
    return count


def reconcile(*, stuck_after_s: int = 60) -> dict:
    """Compare the database with what the engines report, by label, and repair."""
    report = {"finalised": 0, "lost": 0, "removed": 0, "restarted": 0}
    now = timezone.now()
    report["abandoned_rq_jobs"] = _settle_abandoned_rq_jobs()
    live = Replica.objects.filter(
        state__in=[Replica.State.RUNNING, Replica.State.CREATING]
    ).select_related("host", "job")
    by_host: dict[int, list[Replica]] = {}
    for replica in live:
        by_host.setdefault(replica.host_id, []).append(replica)
    stuck: set[int] = set()
    for host in Host.objects.exclude(state=Host.State.DOWN):
        try:
            containers = engine.cached_client(host).containers.list(
                ignore_removed=True, all=True, filters=runtime.replica_labels_filter()
            )
        except (docker.errors.DockerException, engine.EngineError, OSError) as exc:
            log.warning("reconcile: %s unreachable: %s", host.name, exc)
            continue
        report["workspaces_removed"] = report.get("workspaces_removed", 0) + workspaces.sweep(
            host, engine.cached_client(host)
        )
        report["networks_removed"] = report.get("networks_removed", 0) + network.sweep(
            host, engine.cached_client(host)
        )
        by_name = {c.name: c for c in containers}
        for replica in by_host.get(host.pk, []):
            container = by_name.pop(replica.container_name, None)
            if (
                replica.state == Replica.State.CREATING
                and container is not None
                and (container.status == "running")
            ):
                report["adopted"] = report.get("adopted", 0) + 1
                _adopt(replica, container)
                continue
            if replica.state == Replica.State.CREATING and (
                container is None or container.status == "created"
            ):
                if (
                    replica.job.state == Job.State.STARTING
                    and (now - replica.job.started_at).total_seconds() > stuck_after_s
                ):
                    # The worker that was starting it died (before or after `create`):
                    # start again, once, on a worker (start_replicas is idempotent).
                    stuck.add(replica.job_id)
                continue
            if container is None:
                report["lost"] += 1
                replica_lost(
                    replica.pk,
                    Text(gettext_noop("its container is gone from %(host)s"), host=host.name),
                )
            elif container.status in ("exited", "dead"):
                report["finalised"] += 1
                replica_exited(replica.pk, exit_code=container.attrs["State"]["ExitCode"])
        for container in by_name.values():
            # Labelled but no live replica: a leftover (finalised, or from a lost attempt).
            # Look again: a replica created after the query above is not a leftover.
            if Replica.objects.filter(
                container_name=container.name,
                state__in=[Replica.State.RUNNING, Replica.State.CREATING],
            ).exists():
                continue
            try:
                container.remove(force=True, v=True)
                report["removed"] += 1
            except docker.errors.DockerException:
                pass
    overdue = Job.objects.filter(
        state=Job.State.RUNNING, max_runtime_s__isnull=False, cancel_requested=False
    ).only("pk", "running_since", "max_runtime_s")
    for job in overdue:
        if job.running_since and (now - job.running_since).total_seconds() > job.max_runtime_s:
            reason = Text(
                gettext_noop("stopped: ran past its maximum runtime of %(minutes)s min"),
                minutes=job.max_runtime_s // 60,
            )
            if Job.objects.filter(pk=job.pk, cancel_requested=False).update(
                cancel_requested=True, **reason_fields(reason, 500)
            ):
                _event(job.pk, "timeout", reason)
                report["timed_out"] = report.get("timed_out", 0) + 1
                stop(job.pk)
    for host in Host.objects.filter(state=Host.State.DOWN, pk__in=list(by_host)):
        for replica in by_host[host.pk]:
            report["lost"] += 1
            replica_lost(
                replica.pk,
                Text(
                    gettext_noop("host %(host)s stopped answering (not the job's failure)"),
                    host=host.name,
                ),
                host_fault=True,
            )
    report["restarted"] = len(stuck)
    for job_id in stuck:
        _enqueue("jobs.tasks.job_start", job_id, job_id=f"start-{job_id}")
    report["workspaces_made"] = _ensure_missing_workspaces(now)
    report["killed"] = _kill_overdue_stops(now)
    report["preemptions"] = _follow_preemptions()
    report["settled"] = _settle_orphans()
    # The safety net of a release or stop whose task gave up (an engine that was down):
    # GPUs still held by ended nodes go back once their engines confirm.
    report["gpus_freed"] = free_gpus()
    return report


def _ensure_missing_workspaces(now) -> int:
    """Nodes placed a while ago whose workspace was not made (an engine that refused, a
    lost task): queue the task again (never inline: an image pull must not hold up the
    reconciler's other work)."""
    clusters = set(
        Node.objects.filter(
            released_at__isnull=True, lost_at__isnull=True, workspace_container="",
            cluster__state=Cluster.State.RUNNING, cluster__workspace=True,
            placed_at__lt=now - timedelta(seconds=30),
        ).values_list("cluster_id", flat=True)
    )  # fmt: skip
    for cluster_id in clusters:
        _enqueue("jobs.tasks.cluster_network_ensure", cluster_id, job_id=f"net-{cluster_id}")
    return len(clusters)


def _kill_overdue_stops(now) -> int:
    """The SIGKILL after the grace period is a delayed RQ job; if it was lost (no
    scheduler, a Redis flush), containers of a stopped job must not outlive it, least of
    all on capacity a release already gave back."""
    count = 0
    for preempting in (False, True):
        deadline = now - timedelta(seconds=_grace(preempting) + 5)
        for replica in Replica.objects.filter(
            state=Replica.State.RUNNING,
            job__stop_requested_at__lt=deadline,
            job__preempt_requested_at__isnull=not preempting,
        ).select_related("host"):
            _signal(replica, "SIGKILL")
            count += 1
    return count


def _follow_preemptions() -> int:
    """The safety net of preemption: notices whose follow-up was lost, and preempting
    clusters whose jobs have all left (a requeue lost to a crash)."""
    count = 0
    # Only past the script's limit: before it, the notice's own follow-up is still going.
    overdue = timezone.now() - timedelta(seconds=settings.SUANLI_PREEMPT_SCRIPT_S + 5)
    for job_id in Job.objects.filter(
        state__in=Job.ACTIVE,
        preempt_requested_at__lt=overdue,
        stop_requested_at__isnull=True,
    ).values_list("pk", flat=True):
        enqueue_unique("docker", "jobs.tasks.job_preempt", job_id, job_id=f"preempt-{job_id}")
        count += 1
    for cluster_id in (
        Cluster.objects.filter(state=Cluster.State.PREEMPTING)
        .exclude(jobs__state__in=Job.ACTIVE)
        .values_list("pk", flat=True)
    ):
        lifecycle.cluster_requeue_preempted(cluster_id=cluster_id)
        count += 1
    return count


def _settle_orphans() -> int:
    """Active jobs whose replicas have all ended but whose settle never ran (the process
    died between recording the last exit and deciding the job)."""
    count = 0
    for job in Job.objects.filter(state__in=Job.ACTIVE).only("pk", "attempt"):
        replicas = Replica.objects.filter(job_id=job.pk, attempt=job.attempt)
        if (
            replicas.exists()
            and not replicas.filter(
                state__in=[Replica.State.CREATING, Replica.State.RUNNING]
            ).exists()
        ):
            settle(job.pk)
            count += 1
    return count


def live_log_since(replica: Replica, since: float | None) -> list[str]:
    """Timestamped lines of a running replica's container, from `since` (UNIX seconds)."""
    try:
        container = engine.cached_client(replica.host).containers.get(replica.container_name)
        raw = (
            container.logs(stdout=True, stderr=True, timestamps=True, since=since)
            if since
            else container.logs(stdout=True, stderr=True, timestamps=True)
        )
    except (docker.errors.DockerException, engine.EngineError, OSError):
        return []
    return raw.decode("utf-8", "replace").splitlines()


def finalise_exited(host: Host) -> int:
    """Catch up on one host: finalise live replicas whose containers already exited (what
    a watcher that was not running missed)."""
    client = engine.cached_client(host)
    count = 0
    filters = {**runtime.replica_labels_filter(), "status": "exited"}
    for container in client.containers.list(ignore_removed=True, all=True, filters=filters):
        replica = Replica.objects.filter(
            container_name=container.name, state__in=[Replica.State.RUNNING, Replica.State.CREATING]
        ).first()
        if replica is not None:
            replica_exited(replica.pk, exit_code=container.attrs["State"]["ExitCode"])
            count += 1
    return count

"""Faults of the backing services under the Procfile's processes: Redis shut down until every
loop has met the outage and started again, PostgreSQL stopped and started, while clusters
accrue and jobs run.

Every process lives on and goes on with its work without a restart by hand: work queued
after a commit while Redis was away is queued once it is back (jobs/events/outbox.py), the cron
still enqueues (accrual catches up, no second billed twice or missed), the worker and its
RQ scheduler still run delayed jobs (a cancelled job that ignores SIGTERM dies of its
delayed SIGKILL), the watch still finalises a job the moment it ends (with the container's
own finish time), the monitor and the web still answer. Each logs the outage once.

The reconciler runs once an hour here, so that none of its safety nets (the overdue
SIGKILL, the finalisation of dead replicas) can be what did the work.
"""

import itertools
import os
import re
import subprocess
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlparse

import django_rq
import docker
import pytest
import rq
from browsing import free_port as _free_port
from django.conf import settings
from django.db import connection
from waiting import until as _until

from billing.models import LedgerEntry, Meter
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import Job, OutboxTask

# PostgreSQL and Redis go away under these: nothing else may run meanwhile (.ci/test.sh).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.alone]

REPO = Path(__file__).resolve().parent.parent
GRACE_S = 3
PROCESS_ENV = {
    "SUANLI_ACCRUAL_INTERVAL": "2",
    "SUANLI_STOP_GRACE_S": str(GRACE_S),
    # The safety nets must not do the work under test.
    "SUANLI_RECONCILE_INTERVAL": "3600",
    "SUANLI_HOST_CHECK_INTERVAL": "3600",
}
# Ends with 0 when told (SIGUSR1), so that the test decides when it ends.
UNTIL_TOLD = "trap 'echo told; exit 0' USR1; while :; do sleep 0.2; done"
DEAF_TO_TERM = "trap '' TERM; echo deaf; sleep 1000"


# -- the services ------------------------------------------------------------------------


def _alone(request) -> None:
    """A test that stops PostgreSQL or Redis stops them under every test running beside it:
    it must be marked `alone` (.ci/test.sh runs those by themselves, last)."""
    if request.node.get_closest_marker("alone") is None:
        pytest.fail(f"{request.node.name} stops PostgreSQL or Redis: mark it @pytest.mark.alone")


class RedisServer:
    """The test Redis (.ci/services.sh start_redis), stopped and started with its own
    arguments; nothing else of the test services is touched. Only in a test marked `alone`."""

    def __init__(self, request):
        _alone(request)
        url = urlparse(settings.REDIS_URL)
        self.port = url.port or 6379
        self.env = {**os.environ, "REDISCLI_AUTH": url.password or ""}
        self.dir = Path(os.environ.get("RUN_DIR", REPO / ".run" / "test")) / "redis"

    def _cli(self, *args) -> str:
        result = subprocess.run(
            ["redis-cli", "--no-auth-warning", "-h", "127.0.0.1", "-p", str(self.port), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return result.stdout.strip()

    def up(self) -> bool:
        return self._cli("ping") == "PONG"

    def shutdown(self) -> None:
        self._cli("shutdown", "nosave")
        _until(lambda: not self.up(), 10, "Redis to stop")

    def start(self) -> None:
        if self.up():
            return
        subprocess.run(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--daemonize",
                "yes",
                "--dir",
                str(self.dir),
                "--pidfile",
                str(self.dir / "redis.pid"),
                "--logfile",
                str(self.dir / "redis.log"),
                "--save",
                "",
                "--appendonly",
                "no",
                "--requirepass",
                self.env["REDISCLI_AUTH"],
            ],  # fmt: skip
            check=True,
            timeout=10,
        )
        _until(self.up, 20, "Redis to answer")


class PostgresServer:
    """The system PostgreSQL cluster the test database lives on (pg_ctlcluster). Only in a
    test marked `alone`."""

    def __init__(self, request):
        _alone(request)
        port = str(connection.settings_dict.get("PORT") or 5432)
        rows = subprocess.run(
            ["pg_lsclusters", "-h"], capture_output=True, text=True, check=True
        ).stdout
        self.version, self.cluster = next(
            (row.split()[0], row.split()[1]) for row in rows.splitlines() if row.split()[2] == port
        )
        self.port = port

    def up(self) -> bool:
        return (
            subprocess.run(["pg_isready", "-q", "-h", "127.0.0.1", "-p", self.port]).returncode == 0
        )

    def _ctl(self, *args) -> None:
        subprocess.run(["pg_ctlcluster", self.version, self.cluster, *args], check=True, timeout=60)

    def stop(self) -> None:
        self._ctl("stop", "-m", "fast")

    def start(self) -> None:
        if not self.up():
            self._ctl("start")
        _until(self.up, 30, "PostgreSQL to accept connections")


@pytest.fixture
def redis_server(request):
    redis = RedisServer(request)
    yield redis
    redis.start()  # whatever happened, the next test has its Redis


@pytest.fixture
def postgres_server(request):
    postgres = PostgresServer(request)
    yield postgres
    postgres.start()
    connection.close()  # the test's own connection died with the server


# -- helpers -----------------------------------------------------------------------------


def _state(job: Job, states) -> bool:
    job.refresh_from_db()
    return job.state in states


def _billed_until(cluster):
    return Meter.objects.filter(cluster=cluster).values_list("billed_until", flat=True).first()


def _billed_past(cluster, moment: datetime) -> bool:
    until = _billed_until(cluster)
    return until is not None and until > moment


def _assert_billed_once_each_second(cluster):
    """The cluster's usage entries tile its meter's span: from the second its node first
    ran (its workspace started) up to where it is billed, with no gap and no overlap."""
    meter = Meter.objects.get(cluster=cluster)
    periods = list(
        LedgerEntry.objects.filter(cluster=cluster, kind="usage", period_to__lte=meter.billed_until)
        .order_by("period_from")
        .values_list("period_from", "period_to")
    )
    ran = min(n.started_at for n in cluster.node_set.exclude(started_at=None))
    assert periods, "nothing billed"
    assert periods[0][0] == ran.replace(microsecond=0), "the first seconds were not billed"
    assert periods[-1][1] == meter.billed_until
    for (_, a_end), (b_start, _) in itertools.pairwise(periods):
        assert a_end <= b_start, f"a second billed twice at {b_start}"
        assert a_end == b_start, f"seconds left unbilled from {a_end} to {b_start}"


def _container(job: Job):
    replica = job.replicas.get()
    client = docker.DockerClient(base_url=replica.host.engine_url, timeout=10)
    return client, client.containers.get(replica.container_name)


def _end_by_signal_and_check_finish_time(job: Job, *, within: float = 5):
    """Tell the job to end; the watch finalises it at once, with the container's own end."""
    client, container = _container(job)
    since = int(time.time()) - 2
    told = time.monotonic()
    container.kill(signal="SIGUSR1")
    _until(lambda: _state(job, Job.ENDED), within, f"the watch to finalise {job.name}")
    assert time.monotonic() - told < within
    assert job.state == Job.State.SUCCEEDED, job.state_reason
    died = [
        e
        for e in client.events(
            since=since, until=int(time.time()) + 1, decode=True,
            filters={"type": "container", "event": "die", "container": container.id},
        )
    ]  # fmt: skip
    client.close()
    assert died, "no die event"
    died_at = datetime.fromtimestamp(died[0]["timeNano"] / 1e9, tz=UTC)
    replica = job.replicas.get()
    # The container's FinishedAt (the die event's time is Docker's same moment).
    assert abs((replica.finished_at - died_at).total_seconds()) < 0.5, (
        replica.finished_at,
        died_at,
    )
    assert job.finished_at == replica.finished_at
    assert "told" in replica.log


def _start_stack(processes, *names, env=None):
    return {name: processes.start(name, env={**PROCESS_ENV, **(env or {})}) for name in names}


def _logs(processes) -> dict[str, str]:
    out = {}
    for name, _proc, log in processes.procs:
        log.flush()
        out[name] = Path(log.name).read_text(errors="replace")
    return out


def _assert_alive(procs: dict):
    dead = {name: proc.returncode for name, proc in procs.items() if proc.poll() is not None}
    assert not dead, f"processes died: {dead}"


def _once(text: str, pattern: str) -> int:
    return len(re.findall(pattern, text))


# -- the tests ---------------------------------------------------------------------------


def test_every_process_outlives_a_redis_restart(
    running_cluster, processes, priced, alice, redis_server
):
    procs = _start_stack(processes, "worker", "cron", "watch", "monitor")
    training = running_cluster(1, name="training")
    deaf = running_cluster(1, name="deaf")
    long_job = services.job_submit(cluster=training, spec=JobSpec(name="long", command=UNTIL_TOLD))
    deaf_job = services.job_submit(cluster=deaf, spec=JobSpec(name="deaf", command=DEAF_TO_TERM))
    for job in (long_job, deaf_job):
        _until(lambda job=job: _state(job, [Job.State.RUNNING]), 30, f"{job.name} to run")
    started = datetime.now(UTC)
    _until(lambda: _billed_past(training, started), 15, "accrual before the restart")

    redis_server.shutdown()
    # An outage, not a blip: it lasts until every loop has met it (each says so).
    _until(
        lambda: all(
            _once(_logs(processes)[name], rf"Redis \({what}\) is unreachable")
            for name, what in (("cron", "cron"), ("worker", "RQ scheduler"), ("worker", "worker"))
        ),
        60,
        "every loop to meet the Redis outage",
        every=0.5,
    )
    redis_server.start()
    back = datetime.now(UTC)

    # The cron enqueues again and the worker runs it: accrual catches up, each second once.
    _until(lambda: _billed_past(training, back), 30, "accrual after the restart", every=0.5)

    # The worker is back in the Redis that lost it (dashboards, `rq info`).
    assert rq.Worker.all(connection=django_rq.get_connection("default"))

    # The worker's RQ scheduler is alive again: the cancel's delayed SIGKILL comes on time.
    cancelled = time.monotonic()
    services.job_cancel(job=deaf_job, by="alice")
    _until(lambda: _state(deaf_job, Job.ENDED), GRACE_S + 5, "the delayed SIGKILL", every=0.2)
    assert time.monotonic() - cancelled >= GRACE_S, "killed before its grace period"
    assert deaf_job.state == Job.State.CANCELLED
    assert deaf_job.replicas.get().exit_code == 137  # SIGKILL: it ignored the SIGTERM

    _end_by_signal_and_check_finish_time(long_job)
    now = datetime.now(UTC)
    _until(lambda: _billed_past(deaf, now), 10, "accrual of both clusters")
    for cluster in (training, deaf):
        _assert_billed_once_each_second(cluster)

    _assert_alive(procs)
    logs = _logs(processes)
    assert _once(logs["cron"], r"Redis \(cron\) is unreachable") == 1, logs["cron"][-3000:]
    assert _once(logs["cron"], r"Redis \(cron\) answers again") == 1
    # Redis came back empty: a cron scheduler in its registry registered again.
    from rq.cron import CronScheduler

    assert CronScheduler.all(connection=django_rq.get_connection("default")), "cron registered"
    assert _once(logs["worker"], r"Redis \(RQ scheduler\) is unreachable") == 1
    assert _once(logs["worker"], r"Redis \(RQ scheduler\) answers again") == 1
    assert _once(logs["worker"], r"Redis \(worker\) is unreachable") == 1
    assert "Scheduler [PID" not in logs["worker"], "the RQ scheduler died"
    assert _once(logs["monitor"], r"Redis \(monitor\) is unreachable") <= 1
    for name in ("cron", "watch", "monitor"):
        assert "Traceback" not in logs[name], logs[name][-3000:]


def test_every_process_outlives_a_postgresql_restart(
    running_cluster, processes, priced, alice, postgres_server
):
    port = _free_port()
    procs = _start_stack(processes, "worker", "cron", "watch", "monitor")
    procs["web"] = processes.start("web", env={**PROCESS_ENV, "PORT": str(port)})
    training = running_cluster(1, name="training")
    job = services.job_submit(cluster=training, spec=JobSpec(name="long", command=UNTIL_TOLD))
    _until(lambda: _state(job, [Job.State.RUNNING]), 30, "the job to run")
    started = datetime.now(UTC)
    _until(lambda: _billed_past(training, started), 15, "accrual before the restart")
    healthz = f"http://127.0.0.1:{port}/healthz"
    _until(lambda: _get(healthz) == 200, 15, "the web to answer")

    postgres_server.stop()
    # Every loop meets the outage: the watch, which looks every 2 s, last.
    _until(
        lambda: _once(_logs(processes)["watch"], r"PostgreSQL \(watch\) is unreachable"),
        30,
        "the watch to meet the PostgreSQL outage",
        every=0.5,
    )
    postgres_server.start()
    connection.close()  # ours died with the server too
    back = datetime.now(UTC)

    # The web's kept connection is replaced before its first use, not a 500.
    assert _get(healthz) == 200
    _until(lambda: _billed_past(training, back), 30, "accrual after the restart", every=0.5)
    _end_by_signal_and_check_finish_time(job)
    _assert_billed_once_each_second(training)

    _assert_alive(procs)
    # The watch's main loop backs off up to 10 s, so it may say so after the work is done.
    _until(
        lambda: _once(_logs(processes)["watch"], r"PostgreSQL \(watch\) answers again"),
        15,
        "the watch to say PostgreSQL answers again",
    )
    logs = _logs(processes)
    assert _once(logs["watch"], r"PostgreSQL \(watch\) is unreachable") == 1, logs["watch"][-3000:]
    assert _once(logs["watch"], r"PostgreSQL \(watch\) answers again") == 1
    assert _once(logs["monitor"], r"PostgreSQL \(monitor\) is unreachable") <= 1
    for name in ("cron", "watch", "monitor"):
        assert "Traceback" not in logs[name], logs[name][-3000:]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 (our test URL)
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def test_work_queued_as_a_job_ends_while_redis_is_down_comes_when_it_is_back(
    running_cluster, processes, priced, alice, redis_server
):
    """A job that ends while Redis is down: its follow-up work (the cluster's next job, the
    profile summary) is queued once Redis answers, not at the reconciler's next round (an
    hour here)."""
    procs = _start_stack(processes, "worker", "cron", "watch")
    cluster = running_cluster(1, name="queue")
    first = services.job_submit(cluster=cluster, spec=JobSpec(name="first", command=UNTIL_TOLD))
    _until(lambda: _state(first, [Job.State.RUNNING]), 30, "the first job to run")
    second = services.job_submit(cluster=cluster, spec=JobSpec(name="second", command=UNTIL_TOLD))
    assert _state(second, [Job.State.QUEUED])  # behind the first

    redis_server.shutdown()
    _client, container = _container(first)
    container.kill(signal="SIGUSR1")
    _until(lambda: _state(first, Job.ENDED), 15, "the watch to finalise the first job")
    assert first.state == Job.State.SUCCEEDED, first.state_reason
    assert OutboxTask.objects.filter(job_id=f"dispatch-{cluster.pk}").exists()
    redis_server.start()  # empty: what was queued before is gone too

    _until(lambda: _state(second, [Job.State.RUNNING]), 60, "the second job to start")
    profiles = django_rq.get_queue("profiles")  # no profiles worker here: it waits there
    assert profiles.fetch_job(f"profiles-{first.pk}") is not None
    _until(lambda: not OutboxTask.objects.exists(), 15, "the outbox to empty")

    second.refresh_from_db()
    _client, container = _container(second)
    container.kill(signal="SIGUSR1")
    _until(lambda: _state(second, Job.ENDED), 15, "the watch to finalise the second job")
    _assert_alive(procs)
    logs = _logs(processes)
    for name in ("cron", "watch"):
        assert "Traceback" not in logs[name], logs[name][-3000:]

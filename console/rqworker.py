"""The RQ worker of the Procfile (`rqworker --worker-class console.rqworker.Worker`), made to
outlive a Redis or PostgreSQL restart on its own.

RQ's worker retries Redis only while it waits for a job; a Redis error anywhere else (the
suspension check at the top of its loop, the heartbeat after a job, the bookkeeping around
a job) ends the process. Its scheduler (`--with-scheduler`, the forked process that moves
delayed jobs such as a cancelled job's SIGKILL onto their queues) ends on the first one,
and the worker starts it again only every ten minutes. Here each of those waits for Redis
instead: the outage is logged once, retried with backoff (1, 2, 4 ... 10 s), and once
Redis answers the worker and its scheduler register again (a restarted Redis has lost
their keys and the scheduler's locks).

A task that meets a dead database connection fails and RQ records it; the next one must
not inherit that connection, so every job starts as a request does in Django, with
unusable or expired connections closed (and checked, with CONN_HEALTH_CHECKS).
"""

import resource
import time

import rq
from django.conf import settings
from django.db import close_old_connections
from rq import worker_registration
from rq.defaults import DEFAULT_LOGGING_DATE_FORMAT, DEFAULT_LOGGING_FORMAT
from rq.scheduler import RQScheduler

from jobs.base import metrics
from jobs.base.outage import REDIS_DOWN, Outage


class Scheduler(RQScheduler):
    """RQ's scheduler loop, living through Redis outages instead of dying on the first."""

    def work(self):
        self._install_signal_handlers()
        redis = Outage("Redis (RQ scheduler)", self.log)
        registered = False
        while not self._stop_requested:
            try:
                if not registered:
                    self.register_birth()
                    # A restarted Redis has no locks: take (or refresh) them now rather
                    # than after RQ's ten-minute fallback period.
                    self.acquire_locks()
                    registered = True
                elif self.should_reacquire_locks:
                    self.acquire_locks()
                self.heartbeat()
                self.enqueue_scheduled_jobs()
            except REDIS_DOWN as exc:
                registered = False
                self._sleep(redis.failed(exc))
                continue
            redis.ok()
            self._sleep(self.interval)
        try:
            self.stop()
        except REDIS_DOWN:
            pass  # Redis is away: the locks and the scheduler's key expire on their own

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self._stop_requested and (rest := deadline - time.monotonic()) > 0:
            time.sleep(min(rest, 0.5))


class _Resilient:
    """What our worker classes add to RQ's: see the module's docstring."""

    max_connection_wait_time = 10.0  # RQ's own backoff while it waits for a job (60 s)

    def work(self, *args, logging_level=None, **kwargs):
        # rqworker asks for INFO by default: a line per job, three jobs a second from cron.
        # Quiet (SUANLI_WORKER_LOG_LEVEL) unless `-v 2` asks for DEBUG.
        if logging_level in (None, "INFO"):
            logging_level = settings.SUANLI_WORKER_LOG_LEVEL
        metrics.serve(self.metrics_process())
        metrics.alive(self.metrics_process(), always=True)
        return super().work(*args, logging_level=logging_level, **kwargs)

    def metrics_process(self) -> str:
        """Which Procfile process this is, for its metrics port and beat."""
        names = set(self.queue_names())
        return "builder" if "builds" in names else "profiles" if "profiles" in names else "worker"

    def _redis_outage(self) -> Outage:
        if "_outage" not in self.__dict__:
            self._outage = Outage("Redis (worker)", self.log)
        return self._outage

    def _until_redis_answers(self, call, *args, **kwargs):
        """`call` until it gets through to Redis; the outage logged once."""
        outage = self._redis_outage()
        while True:
            try:
                result = call(*args, **kwargs)
            except REDIS_DOWN as exc:
                time.sleep(outage.failed(exc))
                continue
            if outage.ok():
                # The command channel's thread may still be waiting; it starts afresh.
                self.__dict__.pop("_pubsub_outage", None)
            return result

    def _register_again(self) -> None:
        """Put this worker back into a Redis that lost it (a restart, a flush)."""
        with self.connection.pipeline() as pipeline:
            pipeline.hset(self.key, mapping=self.serialize())
            worker_registration.register(self, pipeline)
            pipeline.expire(self.key, self.worker_ttl + 60)
            pipeline.execute()

    def _start_scheduler(
        self,
        burst=False,
        logging_level="INFO",
        date_format=DEFAULT_LOGGING_DATE_FORMAT,
        log_format=DEFAULT_LOGGING_FORMAT,
    ):
        # RQ's own, with our scheduler class.
        self.scheduler = Scheduler(
            self.queues,
            connection=self.connection,
            logging_level=logging_level if logging_level is not None else self.log.level,
            date_format=date_format,
            log_format=log_format,
            serializer=self.serializer,
        )
        self.scheduler.acquire_locks()
        if self.scheduler.acquired_locks:
            if burst:
                try:
                    self.scheduler.register_birth()
                    self.scheduler.enqueue_scheduled_jobs()
                finally:
                    self.scheduler.release_locks()
                    self.scheduler.register_death()
            else:
                self.scheduler.start()

    def heartbeat(self, timeout=None, pipeline=None):
        if pipeline is not None:  # only queued on the caller's pipeline
            return super().heartbeat(timeout, pipeline=pipeline)
        self._until_redis_answers(self._heartbeat, timeout)

    def _heartbeat(self, timeout):
        super().heartbeat(timeout)
        metrics.alive(self.metrics_process())
        if not self.connection.hexists(self.key, "birth"):
            # Redis restarted or was flushed between two heartbeats.
            self._register_again()

    def check_for_suspension(self, burst):
        return self._until_redis_answers(super().check_for_suspension, burst)

    def run_maintenance_tasks(self):
        return self._until_redis_answers(super().run_maintenance_tasks)

    def maintain_heartbeats(self, job, execution):
        # The horse goes on with its job; the heartbeats resume when Redis does.
        try:
            super().maintain_heartbeats(job, execution)
        except REDIS_DOWN as exc:
            self._redis_outage().failed(exc)

    def _pubsub_exception_handler(self, exc, pubsub, pubsub_thread):
        # RQ's logs an error every 2 s of an outage; once is enough.
        if not isinstance(exc, REDIS_DOWN):
            return super()._pubsub_exception_handler(exc, pubsub, pubsub_thread)
        if "_pubsub_outage" not in self.__dict__:
            self._pubsub_outage = Outage("Redis (worker commands)", self.log)
        time.sleep(self._pubsub_outage.failed(exc))

    def execute_job(self, job, queue):
        close_old_connections()
        try:
            super().execute_job(job, queue)
        except REDIS_DOWN as exc:
            # The job's own bookkeeping is lost with Redis (the task's work is in
            # PostgreSQL and the reconciler's); wait for Redis, then take the next one.
            self.log.warning("job %s: its bookkeeping in Redis failed (%s)", job.id, exc)
            self._until_redis_answers(self.connection.ping)
        finally:
            close_old_connections()


class Worker(_Resilient, rq.Worker):
    """A forked work horse per job, as RQ's default."""


class SimpleWorker(_Resilient, rq.SimpleWorker):
    """Jobs in the worker's own process (the tests' quick worker)."""


class ProfilesWorker(Worker):
    """The `profiles` queue's worker (Procfile): a tenant's trace is summarised in a forked
    horse whose data memory is capped (SUANLI_PROFILE_WORKER_MEMORY_MB), so a trace built
    to exhaust memory fails its own summary (stored as its error), not the machine, and
    never holds up the other queues' work."""

    def main_work_horse(self, job, queue):
        limit = settings.SUANLI_PROFILE_WORKER_MEMORY_MB * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        return super().main_work_horse(job, queue)

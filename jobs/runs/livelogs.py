"""Live job logs: one follower per running replica, whatever the number of viewers.

The `logs` process (Procfile) keeps one streaming `logs(follow=True, timestamps=True)` per
running replica, on a thread of its own. What the replicas print is numbered per job in
Redis (`jobs.base.logstore`: a bounded list, numbered in order, with each replica's last
timestamp beside it) and sent to the job's Channels group at most `FLUSH_S` later; the
log socket (console/consumers.py) sends a late viewer the kept lines first, then the
group's, by number, so nothing is missed or sent twice at the join.

A stream that ends while its replica still runs (an engine restart, a lost connection, a
quiet stream's read timeout) is opened again from its last timestamp, with backoff; a
line at or before that timestamp is dropped, so nothing is kept twice. A replica that
ends or disappears has its stream closed. A restarted process takes up each replica from
the timestamp kept in Redis. An ended job's page reads the replicas' stored logs.

Layer: runs; uses nodes (engine), placement (fleet), models and base (logstore, outage, queue)."""

import asyncio
import calendar
import contextlib
import logging
import threading
import time

import docker
import redis
from channels.layers import get_channel_layer
from django.db import close_old_connections, connection

from jobs.base import logstore, metrics
from jobs.base.outage import DB_DOWN, REDIS_DOWN, Outage, close_db_connections
from jobs.base.queue import enqueue_unique
from jobs.models import Host, Job, Replica
from jobs.nodes import engine
from jobs.placement import fleet

log = logging.getLogger("suanli.logs")

FLUSH_S = 0.1  # a line waits at most this long in the process before it is kept and sent
SCAN_S = 0.5  # how often the running replicas are looked up
GONE_GRACE_S = 3.0  # a stream outlives its replica's end this long: its last lines come
METRIC_MARKER = "SUANLI_METRIC "  # jobs/pools/sweeps.py's marker
PROGRESS_EVERY_S = 2.0  # a job's progress is read at most this often (its pace, live)
LINES_KEPT = 2000  # per job, in Redis, for a late viewer (the row keeps the whole log)
LINE_BYTES = 4096  # of one line as kept; a longer one is cut, the rest of it dropped
LINES_PER_S = 1000  # per replica, live; beyond it a note says how many were not shown live
BATCH_MAX = 2000  # lines of one job per flush
KEEP_S = 24 * 3600  # a quiet job's kept lines last this long after its last line
COUNTER_S = 30 * 24 * 3600  # its numbering goes on after a quiet day
STREAM_TIMEOUT_S = 600  # a stream silent this long is opened again (from where it was)


def group_for(job_id: int) -> str:
    return f"job-log-{int(job_id)}"


def _key(job_id: int) -> str:
    return f"suanli:job:{int(job_id)}:log"


def ts_ns(ts: str) -> int | None:
    """Docker's RFC 3339 timestamp (nanoseconds, trailing zeros trimmed) -> UNIX ns."""
    try:
        head, _, frac = ts.rstrip("Z").partition(".")
        digits = (frac + "000000000")[:9]
        seconds = calendar.timegm(time.strptime(head, "%Y-%m-%dT%H:%M:%S"))
        return seconds * 10**9 + int(digits)
    except ValueError:
        return None


def _text(raw: bytes) -> str:
    """A line as kept: UTF-8 (bad bytes replaced), no line end, at most LINE_BYTES."""
    return raw[:LINE_BYTES].decode("utf-8", "replace").rstrip("\r")


def split(payload: str) -> dict:
    """A kept line -> {"rank", "ts", "text"}."""
    rank, _, line = payload.partition("\t")
    ts, text = fleet.split_log_line(line)
    return {"rank": int(rank) if rank.isdigit() else 0, "ts": ts, "text": text}


def lines(job: Job) -> list[tuple[int, str]]:
    """The job's recent lines, numbered: from Redis while it has them, else from the
    replicas' stored logs (an ended job's, numbered from 1)."""
    try:
        kept = logstore.read(logstore.connect(), _key(job.pk))
    except redis.RedisError:
        kept = []
    if kept:
        return kept
    return [
        (i, f"{rank}\t{ts} {text}")
        for i, (ts, rank, text) in enumerate(fleet.job_log_lines(job), 1)
    ]


class _Reader:
    """One replica's stream, on a thread; opened again by the follower while it runs."""

    def __init__(self, follower: "Follower", replica: Replica, mark: int | None):
        self.follower = follower
        self.pk = replica.pk
        self.job_id = replica.job_id
        self.rank = replica.rank
        self.container = replica.container_name
        self.host = replica.host
        self.mark = mark  # the last timestamp (ns) taken
        self.stream = None
        self.thread: threading.Thread | None = None
        self.failures = 0
        self.retry_at = 0.0
        self.gone_at: float | None = None
        self.closed = False
        self.reopened = mark is not None  # skip what was kept before, once
        self.window_at, self.window_lines, self.dropped = 0.0, 0, 0

    def start(self) -> None:
        self.thread = threading.Thread(
            target=self._run, daemon=True, name=f"log-follow-{self.container}"
        )
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def close(self) -> None:
        self.closed = True
        stream = self.stream
        if stream is not None:
            with contextlib.suppress(Exception):  # already closed under us
                stream.close()

    def _run(self) -> None:
        try:
            client = self.follower.client(self.host)
            since = self.mark / 1e9 if self.mark else None
            self.reopened = self.mark is not None
            self.stream = client.api.logs(
                self.container, stdout=True, stderr=True, stream=True, follow=True,
                timestamps=True, since=since, tail="all" if since else LINES_KEPT,
            )  # fmt: skip
            self.follower.opened(self)
            partial, cut = b"", False
            for chunk in self.stream:
                if self.closed:
                    break
                *whole, rest = chunk.split(b"\n")
                for raw in whole:
                    if not cut:
                        self._take(_text(partial + raw))
                    partial, cut = b"", False
                if cut:
                    continue  # the rest of a line already cut: dropped up to its end
                partial += rest
                if len(partial) > LINE_BYTES:
                    # A line without end (a progress bar, `yes | tr -d '\n'`): kept cut,
                    # never grown without bound nor scanned again and again.
                    self._take(_text(partial) + " …")
                    partial, cut = b"", True
            if partial and not cut and not self.closed:
                self._take(_text(partial))
            self.failures = 0
        except Exception as exc:  # the engine or the connection: opened again, with backoff
            self.failures += 1
            if not self.closed:
                log.info("log of %s: %s", self.container, engine.describe(exc))
        finally:
            self.stream = None
            self.retry_at = time.monotonic() + min(2 ** min(self.failures, 5), 30)

    def _take(self, line: str) -> None:
        ts, _ = fleet.split_log_line(line)
        at = ts_ns(ts)
        if at is not None:
            if self.reopened and self.mark is not None and at <= self.mark:
                return  # kept before this stream was opened again
            self.reopened = False  # past the mark: later lines with equal times all count
            self.mark = at if self.mark is None else max(self.mark, at)
        now = time.monotonic()
        if now - self.window_at >= 1.0:
            if self.dropped:
                self.follower.add(
                    self,
                    f"{self.rank}\t{ts} [{self.dropped} lines not shown live; the log keeps them]",
                )
            self.window_at, self.window_lines, self.dropped = now, 0, 0
        self.window_lines += 1
        if self.window_lines > LINES_PER_S:
            self.dropped += 1  # one replica's flood does not hold up every other log
            return
        self.follower.add(self, f"{self.rank}\t{line}")


class Follower:
    """All running replicas' streams in one process, their lines kept and sent per job."""

    def __init__(self, *, publish: bool = True):
        self.layer = get_channel_layer() if publish else None
        self.loop = asyncio.new_event_loop()  # the sender thread's (flush)
        self.redis = logstore.connect()
        self.lock = threading.Lock()
        self.flushing = threading.Lock()
        self.pending: dict[int, list[tuple[str, int | None, str]]] = {}
        self.readers: dict[int, _Reader] = {}
        self.clients: dict[int, docker.DockerClient] = {}
        self.streams_opened = 0
        # Progress reads (jobs/runs/progress.py), at most one per job every PROGRESS_EVERY_S:
        # when it was last queued, and the jobs with marker lines kept since.
        self.progress_at: dict[int, float] = {}
        self.progress_due: set[int] = set()
        self.stopping = threading.Event()
        self.database = Outage("PostgreSQL (logs)", log)
        self.store = Outage("Redis (logs)", log)

    # -- the readers' side

    def client(self, host: Host) -> docker.DockerClient:
        with self.lock:
            client = self.clients.get(host.pk)
        if client is None:
            # Made outside the lock: an engine that does not answer holds up only its own
            # replicas' readers, never the lines of every other host.
            made = engine.client_for(host, timeout=STREAM_TIMEOUT_S)
            with self.lock:
                client = self.clients.setdefault(host.pk, made)
        return client

    def opened(self, reader: _Reader) -> None:
        with self.lock:
            self.streams_opened += 1

    def add(self, reader: _Reader, payload: str) -> None:
        with self.lock:
            self.pending.setdefault(reader.job_id, []).append(
                (str(reader.pk), reader.mark, payload)
            )

    # -- keeping and sending

    def flush(self) -> None:
        with self.flushing:  # the sender thread's, and stop()'s last: one at a time
            self._flush()

    def _flush(self) -> None:
        with self.lock:
            batch, self.pending = self.pending, {}
        for job_id, items in batch.items():
            if len(items) > BATCH_MAX:
                skipped = len(items) - BATCH_MAX
                items = items[-BATCH_MAX:]
                pk, mark, payload = items[0]
                rank, _, line = payload.partition("\t")
                note = f"{rank}\t{line.partition(' ')[0]} [{skipped} lines not shown live; the log keeps them]"
                items.insert(0, (pk, mark, note))
            marks = {pk: str(mark) for pk, mark, _ in items if mark is not None}
            texts = [payload for _, _, payload in items]
            try:
                first = logstore.append(
                    self.redis, _key(job_id), texts, keep=LINES_KEPT, ttl=KEEP_S,
                    counter_ttl=COUNTER_S, marks=marks,
                )  # fmt: skip
                self.store.ok()
            except redis.RedisError as exc:
                # Not kept, not sent (its numbers would be none); the row keeps the log.
                self.store.failed(exc)
                continue
            self._send(job_id, [[first + i, text] for i, text in enumerate(texts)])
            if any(METRIC_MARKER in text for text in texts):
                # A sweep's trial reporting its metric (jobs/pools/sweeps.py reads the kept
                # lines); any job reporting its step (progress, below).
                try:
                    enqueue_unique(
                        "default", "jobs.tasks.sweep_observe", job_id,
                        job_id=f"sweep-observe-{job_id}", again_if_running=True,
                    )  # fmt: skip
                except redis.RedisError as exc:
                    log.warning("job %s: metric lines not passed on: %s", job_id, exc)
                self.progress_due.add(job_id)
        self._progress()

    def _progress(self) -> None:
        """Queue the progress read (jobs/runs/progress.py: the job's pace) of each job with
        new marker lines, at most once every PROGRESS_EVERY_S a job: a job printing its
        step ten times a second costs a read every few seconds, not ten; the lines kept
        meanwhile are read by the next, a moment later."""
        now = time.monotonic()
        for job_id in list(self.progress_due):
            if now - self.progress_at.get(job_id, -PROGRESS_EVERY_S) < PROGRESS_EVERY_S:
                continue
            try:
                enqueue_unique(
                    "default", "jobs.tasks.job_progress", job_id,
                    job_id=f"progress-{job_id}", again_if_running=True,
                )  # fmt: skip
            except redis.RedisError as exc:
                log.warning("job %s: progress not passed on: %s", job_id, exc)
                continue  # tried again at the next flush
            self.progress_due.discard(job_id)
            self.progress_at[job_id] = now
        if len(self.progress_at) > 2 * len(self.readers) + 1000:  # ended jobs' times
            self.progress_at = {
                j: at for j, at in self.progress_at.items() if now - at < PROGRESS_EVERY_S
            }

    def _send(self, job_id: int, numbered: list) -> None:
        if self.layer is None:
            return
        try:
            # One event loop for the sender thread, kept: the channel layer keeps its
            # Redis connections per loop, so a loop per send would be a connection each.
            self.loop.run_until_complete(
                self.layer.group_send(group_for(job_id), {"type": "job.lines", "lines": numbered})
            )
        except Exception as exc:  # Redis away: the kept lines fill the gap on the socket
            log.warning("job %s: log lines not sent: %s", job_id, exc)

    def _flush_loop(self) -> None:
        while not self.stopping.is_set():
            self.stopping.wait(FLUSH_S)
            self.flush()

    # -- which replicas

    def _marks(self, job_id: int) -> dict[str, str]:
        try:
            return logstore.marks(self.redis, _key(job_id))
        except redis.RedisError:
            return {}

    def scan(self) -> None:
        close_old_connections()
        running = {
            r.pk: r
            for r in Replica.objects.filter(state=Replica.State.RUNNING).select_related("host")
        }
        now = time.monotonic()
        for pk, replica in running.items():
            reader = self.readers.get(pk)
            if reader is None:
                mark = self._marks(replica.job_id).get(str(pk))
                reader = self.readers[pk] = _Reader(self, replica, int(mark) if mark else None)
                reader.start()
            elif not reader.alive and now >= reader.retry_at:
                reader.start()  # the stream ended while the replica runs: from its mark
        for pk, reader in list(self.readers.items()):
            if pk in running:
                reader.gone_at = None
                continue
            reader.gone_at = reader.gone_at or now
            if not reader.alive:
                del self.readers[pk]
            elif now - reader.gone_at > GONE_GRACE_S:
                reader.close()

    def run(self, *, until: threading.Event | None = None) -> None:
        """Scans and flushes until `until` (or stop()) is set."""
        stop = until or self.stopping
        sender = threading.Thread(target=self._flush_loop, daemon=True, name="log-sender")
        sender.start()
        try:
            while not stop.is_set() and not self.stopping.is_set():
                try:
                    self.scan()
                    self.database.ok()
                    metrics.LOG_FOLLOWERS.set(sum(r.alive for r in self.readers.values()))
                    metrics.alive("logs")
                except DB_DOWN as exc:  # the streams go on; new replicas wait for it
                    close_db_connections()
                    stop.wait(self.database.failed(exc))
                    continue
                except REDIS_DOWN as exc:
                    stop.wait(self.store.failed(exc))
                    continue
                stop.wait(SCAN_S)
        finally:
            self.stop()
            sender.join(5)
            connection.close()  # this thread's

    def stop(self) -> None:
        self.stopping.set()
        for reader in list(self.readers.values()):
            reader.close()
        self.flush()

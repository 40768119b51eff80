"""Prometheus metrics for operators (docs/operator/metrics.md): the names, the Redis store
for what short-lived processes observe, and each long-running process's own port.

Three kinds of series, by where they live:

- fleet-wide gauges read from PostgreSQL and Redis when the web's `/metrics` is scraped
  (console/metrics.py);
- counters and histograms observed where things happen, often inside RQ work horses that
  fork per job and die: their values are kept in Redis (`inc`, `observe`, `set_gauge`,
  `beat`), one pipeline per observation, so that any web process serves them. An
  observation never raises into its caller: Redis away is logged once and the value lost
  (Prometheus takes a counter that restarts as a reset);
- what one process knows alone (the monitor's ticks, the gateway's sessions, the log
  followers): prometheus_client's own metrics in that process, served on its own port by
  `serve(process)` (settings SUANLI_METRICS_BIND, SUANLI_METRICS_PORTS, SUANLI_METRICS_TOKEN).

No label names a researcher, a team, a cluster or a job: the cardinality is bounded by the
fleet (GPU models, zones, hosts) and the Procfile.

Layer: base (beside queue and outage); uses no other part (prometheus_client and redis-py
only). Every process imports it.
"""

from __future__ import annotations

import bisect
import hmac
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from wsgiref.simple_server import make_server

import redis
from django.conf import settings
from prometheus_client import REGISTRY, Counter, Gauge, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler

from jobs.base.outage import REDIS_DOWN, Outage

log = logging.getLogger(__name__)

PREFIX = "suanli:metrics:"
COUNTERS = PREFIX + "counters"  # hash: "name{labels}" -> integer
GAUGES = PREFIX + "gauges"  # hash: "name{labels}" -> float
BEATS = PREFIX + "beats"  # hash: "process|shard" -> unix time of its last beat
HIST = PREFIX + "hist:"  # one hash per histogram: "labels|bucket index" / "labels|sum" / "|count"


# -- what the Redis store keeps ---------------------------------------------------------


@dataclass(frozen=True)
class Histogram:
    name: str
    doc: str
    buckets: tuple[float, ...]
    labels: tuple[str, ...] = ()


@dataclass(frozen=True)
class Stored:
    """A counter or gauge kept in Redis."""

    name: str
    doc: str
    kind: str  # "counter" | "gauge"
    labels: tuple[str, ...] = ()


_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_WAIT = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 12 * 3600, 24 * 3600)
_START = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)

QUEUE_WAIT = Histogram(
    "suanli_queue_wait_seconds",
    "Seconds a cluster waited in the placement queue, observed when it is placed.",
    tuple(float(b) for b in _WAIT),
    ("model",),
)
PLACEMENT_PASS = Histogram(
    "suanli_placement_pass_seconds", "Seconds one placement pass took.", _SECONDS
)
JOB_START = Histogram(
    "suanli_job_start_seconds",
    "Seconds from a job's submission to its running.",
    tuple(float(b) for b in _START),
)
HISTOGRAMS = (QUEUE_WAIT, PLACEMENT_PASS, JOB_START)

PLACEMENTS = Stored("suanli_placements_total", "Clusters placed.", "counter")
WEBHOOK_FAILURES = Stored(
    "suanli_webhook_delivery_failures_total",
    "Notification deliveries given up after their last attempt.",
    "counter",
)
ACCRUAL_TICK = Stored("suanli_accrual_tick_seconds", "Seconds the last accrual tick took.", "gauge")
ACCRUAL_LAST = Stored(
    "suanli_accrual_last_tick_timestamp_seconds",
    "Unix time at which the last accrual tick ended.",
    "gauge",
)
ACCRUAL_NOW = "suanli_accrual_billed_until"  # the last tick's `now` (for the lag); not served
STORED = (PLACEMENTS, WEBHOOK_FAILURES, ACCRUAL_TICK, ACCRUAL_LAST)


_UNSAFE = str.maketrans({c: "_" for c in ",={}|"})


def _field(name: str, labels: dict[str, str] | None) -> str:
    if not labels:
        return name
    return (
        name
        + "{"
        + ",".join(f"{k}={str(labels[k]).translate(_UNSAFE)}" for k in sorted(labels))
        + "}"
    )


def _split(field: str) -> tuple[str, dict[str, str]]:
    name, _, rest = field.partition("{")
    if not rest:
        return name, {}
    pairs = (p.partition("=") for p in rest.rstrip("}").split(","))
    return name, {k: v for k, _, v in pairs}


_lock = threading.Lock()


def _after_fork() -> None:
    """An RQ work horse is forked while another thread (the beat's) may hold the lock:
    the child starts with a free one, and no beat thread of its parent's."""
    global _lock, _beater
    _lock = threading.Lock()
    _beater = None
    _progress.clear()
    _always.clear()


os.register_at_fork(after_in_child=_after_fork)


_clients: dict[str, redis.Redis] = {}
# Per Redis URL: its outage (logged once) and when to try it again (time.monotonic()).
_outages: dict[str, Outage] = {}
_retry_at: dict[str, float] = {}


def _connection() -> redis.Redis:
    """One client per process (redis-py's pool opens afresh in a forked child), with short
    timeouts: Redis away costs an observation two seconds at most, and only the first
    after each of the outage's back-off waits (1, 2, 4 ... 60 s); the others in between
    are dropped at once."""
    url = settings.REDIS_URL
    client = _clients.get(url)
    if client is None:
        client = _clients[url] = redis.Redis.from_url(
            url, socket_connect_timeout=2, socket_timeout=5
        )
    return client


def _write(fill) -> None:
    """Run `fill(pipeline)` as one round trip; Redis away is logged once, never raised, and
    not tried again before its back-off has passed (an observation made inside a
    transaction, such as a job's start, is not held up while Redis is away). Nor is
    anything else raised: a metric must never cost its caller's work."""
    url = settings.REDIS_URL
    if _retry_at.get(url, 0.0) > time.monotonic():
        return  # Redis is away: this observation is lost
    try:
        with _connection().pipeline(transaction=False) as pipe:
            fill(pipe)
            pipe.execute()
    except REDIS_DOWN as exc:
        with _lock:
            outage = _outages.setdefault(url, Outage("Redis (metrics)", log, cap=60.0))
            _retry_at[url] = time.monotonic() + outage.failed(exc)
        return
    except Exception:  # a bug here must not fail a placement or a charge
        log.exception("metrics: an observation was lost")
        return
    if url in _outages:
        with _lock:
            outage = _outages.pop(url, None)
            _retry_at.pop(url, None)
            if outage is not None:
                outage.ok()


def forget_outages() -> None:
    """Forget every Redis outage seen (tests that pointed REDIS_URL somewhere dead)."""
    _outages.clear()
    _retry_at.clear()


def inc(metric: Stored, amount: int = 1, **labels: str) -> None:
    """Add `amount` to a counter kept in Redis."""
    if amount:
        _write(lambda pipe: pipe.hincrby(COUNTERS, _field(metric.name, labels), int(amount)))


def set_gauge(name: str, value: float, **labels: str) -> None:
    """Set a gauge kept in Redis (the last writer wins)."""
    _write(lambda pipe: pipe.hset(GAUGES, _field(name, labels), repr(float(value))))


def set_gauges(values: dict[str, float]) -> None:
    """Several unlabelled gauges in one round trip."""
    _write(lambda pipe: pipe.hset(GAUGES, mapping={k: repr(float(v)) for k, v in values.items()}))


def observe(metric: Histogram, value: float, **labels: str) -> None:
    """Count one observation of a histogram kept in Redis."""
    observe_many(metric, [value], **labels)


def observe_many(metric: Histogram, values: Iterable[float], **labels: str) -> None:
    """Count several observations (same labels) in one round trip."""
    values = list(values)
    if values:
        _write(lambda pipe: _fill_histogram(pipe, metric, values, labels))


def _fill_histogram(pipe, metric: Histogram, values: list[float], labels: dict) -> None:
    """Queue on `pipe` the writes that count `values` (same labels) into `metric`."""
    key = HIST + metric.name
    prefix = _field("", labels)
    counts: dict[int, int] = {}
    for value in values:
        i = bisect.bisect_left(metric.buckets, value)  # len(buckets): +Inf only
        counts[i] = counts.get(i, 0) + 1
    for i, n in counts.items():
        pipe.hincrby(key, f"{prefix}|{i}", n)
    pipe.hincrbyfloat(key, f"{prefix}|sum", float(sum(values)))
    pipe.hincrby(key, f"{prefix}|count", len(values))


@contextmanager
def timed(metric: Histogram, **labels: str):
    """Observe the seconds the block took (also when it raises)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        observe(metric, time.perf_counter() - start, **labels)


def placed(clusters: Iterable, now) -> None:
    """Clusters just placed (jobs.placement.scheduler): suanli_placements_total and each
    one's time in the queue (from its `queued_at`, by its GPU model's name), one round trip."""
    waits: dict[str, list[float]] = {}
    for cluster in clusters:
        model = cluster.gpu_model.name if cluster.gpu_model_id else "cpu"
        waits.setdefault(model, []).append(max(0.0, (now - cluster.queued_at).total_seconds()))
    if not waits:
        return

    def fill(pipe):
        pipe.hincrby(COUNTERS, PLACEMENTS.name, sum(len(w) for w in waits.values()))
        for model, values in waits.items():
            _fill_histogram(pipe, QUEUE_WAIT, values, {"model": model})

    _write(fill)


def beat(process: str, shard: str = "") -> None:
    """Write this process's beat now (suanli_process_heartbeat_timestamp_seconds)."""
    _write(lambda pipe: pipe.hset(BEATS, f"{process}|{shard}", repr(time.time())))


BEAT_EVERY_S = 15.0
_progress: dict[tuple[str, str], float] = {}
_beater: threading.Thread | None = None


_always: set[tuple[str, str]] = set()


def alive(process: str, shard: str = "", *, always: bool = False) -> None:
    """The process's main loop went round: in memory only (no I/O on the caller's loop); a
    daemon thread writes the beat to Redis every BEAT_EVERY_S while the loop goes round, so
    a loop that hangs stops beating although the process lives on. `always`: beat for as
    long as the process lives (an RQ worker, whose loop waits minutes for a job; RQ's own
    heartbeat tells a hung one)."""
    global _beater
    _progress[(process, shard)] = time.time()
    if always:
        _always.add((process, shard))
    if _beater is None or not _beater.is_alive():
        with _lock:
            if _beater is None or not _beater.is_alive():
                _beater = threading.Thread(target=_beat_forever, name="metrics-beat", daemon=True)
                _beater.start()


def flush_beats() -> None:
    """Write the beats noted since the last write (the beat thread's round)."""
    now = time.time()
    items = list(_progress.items()) + [(key, now) for key in _always]
    if not items:
        return
    _progress.clear()
    _write(lambda pipe: pipe.hset(BEATS, mapping={f"{p}|{s}": repr(t) for (p, s), t in items}))


def _beat_forever() -> None:
    while True:
        flush_beats()
        time.sleep(BEAT_EVERY_S)


def monitor_tick(shard: str, took: float, interval: float) -> None:
    """One monitor round ended after `took` seconds (its lag: how far it overran its
    interval, 0 when it fit)."""
    MONITOR_TICKS.labels(shard=shard).inc()
    MONITOR_LAG.labels(shard=shard).set(max(0.0, took - interval))
    alive("monitor", shard)


# -- reading the store back (the web's /metrics) -----------------------------------------


@dataclass
class HistogramValue:
    labels: dict[str, str]
    buckets: list[tuple[str, float]]  # cumulative, "+Inf" last
    sum: float
    count: float


def read_store(connection=None) -> dict:
    """Everything the store holds, in one round trip: {"counters": {field: n}, "gauges":
    {field: x}, "beats": {(process, shard): t}, "histograms": {name: [HistogramValue]}}."""
    conn = connection or _connection()
    with conn.pipeline(transaction=False) as pipe:
        pipe.hgetall(COUNTERS)
        pipe.hgetall(GAUGES)
        pipe.hgetall(BEATS)
        for h in HISTOGRAMS:
            pipe.hgetall(HIST + h.name)
        counters, gauges, beats, *hists = pipe.execute()
    out = {
        "counters": {_s(k): float(v) for k, v in counters.items()},
        "gauges": {_s(k): float(v) for k, v in gauges.items()},
        "beats": {tuple(_s(k).split("|", 1)): float(v) for k, v in beats.items()},
        "histograms": {},
    }
    for h, raw in zip(HISTOGRAMS, hists, strict=True):
        series: dict[str, dict[str, float]] = {}
        for k, v in raw.items():
            labels, _, part = _s(k).rpartition("|")
            series.setdefault(labels, {})[part] = float(v)
        values = []
        for labels, parts in sorted(series.items()):
            running = 0.0
            buckets = []
            for i, bound in enumerate(h.buckets):
                running += parts.get(str(i), 0.0)
                buckets.append((_bound(bound), running))
            running += parts.get(str(len(h.buckets)), 0.0)
            buckets.append(("+Inf", running))
            values.append(
                HistogramValue(
                    _split(labels)[1], buckets, parts.get("sum", 0.0), parts.get("count", running)
                )
            )
        out["histograms"][h.name] = values
    return out


def _s(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bound(value: float) -> str:
    return repr(float(value))


# -- each process's own series and port --------------------------------------------------

MONITOR_TICKS = Counter("suanli_monitor_ticks", "Sampling rounds the monitor finished.", ["shard"])
MONITOR_LAG = Gauge(
    "suanli_monitor_lag_seconds",
    "Seconds the monitor's last round took beyond its interval (0: it kept up).",
    ["shard"],
)
GATEWAY_SESSIONS = Gauge("suanli_gateway_sessions", "SSH connections open on this gateway.")
GATEWAY_AUTH_FAILURES = Counter(
    "suanli_gateway_auth_failures", "SSH connections that ended without logging in."
)
LOG_FOLLOWERS = Gauge("suanli_log_followers", "Replica logs this process follows now.")
PROCESS_INFO = Gauge("suanli_process_info", "1: this process serves its metrics.", ["process"])

# The Procfile's processes that serve a port of their own (SUANLI_METRICS_PORTS).
PROCESSES = ("cron", "worker", "monitor", "gateway", "logs", "watch", "builder", "profiles")

_served: dict[str, int | None] = {}  # process -> its port (None: none)
_servers: dict[str, ThreadingWSGIServer] = {}  # process -> its server, while it serves


def is_loopback(bind: str) -> bool:
    try:
        return ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return bind == "localhost"


def token_ok(header: str | None, token: str) -> bool:
    """An `Authorization: Bearer <token>` header equal to `token`, compared in constant time."""
    if not token or not header:
        return False
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


def _guarded(app, token: str):
    """The exposition app, answering 401 to a request without the token (when one is set)."""

    def guarded(environ, start_response):
        if token and not token_ok(environ.get("HTTP_AUTHORIZATION"), token):
            start_response(
                "401 Unauthorized",
                [("Content-Type", "text/plain"), ("WWW-Authenticate", 'Bearer realm="metrics"')],
            )
            return [b"a bearer token is required\n"]
        return app(environ, start_response)

    return guarded


def serve(process: str, shard: str = "") -> int | None:
    """Start `process`'s metrics server in a daemon thread: SUANLI_METRICS_BIND, the first
    free port of SUANLI_METRICS_PORTS[process] .. + SUANLI_METRICS_PORT_TRIES - 1 (a second
    worker on the same machine takes the next one). Returns the port, or None when the
    process has no port, all were taken (logged, the process goes on without) or a
    non-loopback address has no token (refused, logged). Once per process."""
    if process in _served:
        return _served[process]
    base = settings.SUANLI_METRICS_PORTS.get(process, 0)
    if not base:
        return None
    bind = settings.SUANLI_METRICS_BIND
    token = settings.SUANLI_METRICS_TOKEN
    if not token and not is_loopback(bind):
        log.error(
            "metrics: %s not served: SUANLI_METRICS_BIND=%s is not a loopback address and "
            "SUANLI_METRICS_TOKEN is not set",
            process,
            bind,
        )
        return None
    PROCESS_INFO.labels(process=process).set(1)
    app = _guarded(make_wsgi_app(REGISTRY), token)
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET

    class Server(ThreadingWSGIServer):
        address_family = family
        allow_reuse_address = False  # a port another worker holds must be refused

    for port in range(base, base + max(1, settings.SUANLI_METRICS_PORT_TRIES)):
        try:
            httpd = make_server(bind, port, app, Server, handler_class=_SilentHandler)
        except OSError:
            continue
        thread = threading.Thread(
            target=httpd.serve_forever, name=f"metrics-{process}", daemon=True
        )
        thread.start()
        _served[process] = port
        _servers[process] = httpd
        log.info("metrics: %s serves http://%s:%d/metrics", process, bind, port)
        return port
    log.warning(
        "metrics: %s not served: ports %d-%d on %s are all taken",
        process,
        base,
        base + settings.SUANLI_METRICS_PORT_TRIES - 1,
        bind,
    )
    _served[process] = None
    return None


def stop_serving(process: str) -> None:
    """Shut `process`'s metrics server down, free its port and forget it (a later `serve`
    starts afresh): for tests that serve in their own process."""
    httpd = _servers.pop(process, None)
    if httpd is not None:
        httpd.shutdown()
        httpd.server_close()
    _served.pop(process, None)
    try:
        PROCESS_INFO.remove(process)
    except KeyError:  # it never served
        pass

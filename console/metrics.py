"""The web's `GET /metrics` for operators' Prometheus (docs/operator/metrics.md).

Fleet-wide series, the same from every web process: read from PostgreSQL and Redis with a
few aggregate queries when scraped (reused for SUANLI_METRICS_CACHE_S seconds), plus the
counters and histograms that the other processes keep in Redis (jobs/base/metrics.py). No
label names a researcher, a team, a cluster or a job.

Who may read it (never a researcher: it tells the fleet's size, load and revenue):
a bearer token equal to SUANLI_METRICS_TOKEN (compared in constant time), a connection
from an address in SUANLI_METRICS_ALLOW (REMOTE_ADDR: uvicorn has put a trusted proxy's
client there already, and nobody else's X-Forwarded-For is read), or a signed-in user
holding `console.view_metrics` (staff status alone grants nothing). Anyone else: 401
without any credential, 403 with the wrong one (an API token, a session without the power).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from decimal import Decimal

import django_rq
from django.conf import settings
from django.db.models import Count, Exists, Min, OuterRef, Q, Sum
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from billing.models import Account, Meter
from billing.pricing import RateBook
from jobs.base import metrics
from jobs.base.outage import REDIS_DOWN
from jobs.models import Cluster, GpuSlot, Host, ImageBuild, Job, Node, Team

log = logging.getLogger(__name__)

POWER = "console.view_metrics"
# Prometheus's classic text format, which every Prometheus since 2.0 reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

GPU_STATES = ("free", "rented", "stopped_held", "down")
HOST_STATES = ("active", "draining", "degraded", "down")
CLUSTER_STATES = tuple(s for s in Cluster.State.values if s not in ("released", "failed"))
JOB_STATES = ("queued", "starting", "running")
BUILD_STATES = tuple(ImageBuild.ACTIVE)
# A beat older than this is of a process gone for good (scaled down, a shard removed).
BEAT_FORGET_S = 24 * 3600


def allowed(request: HttpRequest) -> bool | None:
    """True: may read; False: credentials that do not open it (403); None: none (401)."""
    header = request.META.get("HTTP_AUTHORIZATION")
    if metrics.token_ok(header, settings.SUANLI_METRICS_TOKEN):
        return True
    if _allow_listed(request.META.get("REMOTE_ADDR")):
        return True
    user = request.user
    if user.is_authenticated:
        return user.has_perm(POWER)
    return False if header else None


def _allow_listed(peer: str | None) -> bool:
    if not settings.SUANLI_METRICS_ALLOW or not peer:
        return False
    try:
        address = ipaddress.ip_address(peer)
    except ValueError:
        return False
    return any(
        address in ipaddress.ip_network(net, strict=False) for net in settings.SUANLI_METRICS_ALLOW
    )


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    verdict = allowed(request)
    if verdict is None:
        response = HttpResponse(
            "A bearer token is required.\n", status=401, content_type="text/plain"
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    if not verdict:
        return HttpResponse("Forbidden.\n", status=403, content_type="text/plain")
    response = HttpResponse(exposition(), content_type=CONTENT_TYPE)
    response["Cache-Control"] = "no-store"
    return response


_cache_lock = threading.Lock()
_cached: tuple[float, bytes] | None = None


def exposition() -> bytes:
    """The text Prometheus reads, computed at most once per SUANLI_METRICS_CACHE_S."""
    global _cached
    with _cache_lock:
        now = time.monotonic()
        if _cached is not None and now - _cached[0] < settings.SUANLI_METRICS_CACHE_S:
            return _cached[1]
        registry = CollectorRegistry(auto_describe=False)
        registry.register(FleetCollector())
        body = generate_latest(registry)
        _cached = (time.monotonic(), body)
        return body


def forget_cache() -> None:
    global _cached
    with _cache_lock:
        _cached = None


class FleetCollector:
    def collect(self):
        yield from gpus_and_hosts()
        yield from clusters_jobs_queue()
        yield from money()
        yield from builds()
        yield from from_redis()


def _gauge(name: str, doc: str, labels: list[str], values: dict[tuple, float]):
    family = GaugeMetricFamily(name, doc, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family


def gpus_and_hosts():
    """Every GPU by model, zone and state; hosts by state, each host up and degraded."""
    gpus: dict[tuple, float] = {}
    rows = (
        GpuSlot.objects.exclude(host__state=Host.State.LEFT)
        .filter(host__gpu_model__isnull=False)
        .values("host__gpu_model__name", "host__zone", "host__state")
        .annotate(
            total=Count("id"),
            rented=Count("id", filter=Q(node__isnull=False, node__released_at__isnull=True)),
            held=Count("id", filter=Q(node__released_at__isnull=False)),
        )
        .order_by()
    )
    for row in rows:
        key = (row["host__gpu_model__name"], row["host__zone"])
        for state in GPU_STATES:
            gpus.setdefault((*key, state), 0)
        if row["host__state"] == Host.State.DOWN:
            gpus[(*key, "down")] += row["total"]
            continue
        gpus[(*key, "rented")] += row["rented"]
        gpus[(*key, "stopped_held")] += row["held"]
        gpus[(*key, "free")] += row["total"] - row["rented"] - row["held"]
    yield _gauge(
        "suanli_gpus",
        "GPUs by model, zone and state: free (held by nobody; on a draining or degraded host "
        "too), rented (a live node's), stopped_held (an ended or stopped node's, until its "
        "engine confirms the containers gone), down (on a host that is down).",
        ["model", "zone", "state"],
        gpus,
    )
    hosts = {(s,): 0 for s in HOST_STATES}
    up: dict[tuple, float] = {}
    degraded: dict[tuple, float] = {}
    for name, zone, state in (
        Host.objects.values_list("name", "zone", "state").order_by()  # InFleet: not left
    ):
        hosts[(state,)] = hosts.get((state,), 0) + 1
        up[(name, zone)] = 0 if state == Host.State.DOWN else 1
        degraded[(name, zone)] = 1 if state == Host.State.DEGRADED else 0
    yield _gauge("suanli_hosts", "Hosts in the fleet by state.", ["state"], hosts)
    yield _gauge("suanli_host_up", "1 unless the host is down.", ["host", "zone"], up)
    yield _gauge("suanli_host_degraded", "1 when the host is degraded.", ["host", "zone"], degraded)


def _by_state(model, states) -> dict[tuple, float]:
    """How many rows of `model` are in each of `states` (0 for none): one GROUP BY."""
    counts = {(s,): 0 for s in states}
    rows = model.objects.filter(state__in=states).values("state").annotate(n=Count("id"))
    for row in rows.order_by():
        counts[(row["state"],)] = row["n"]
    return counts


def clusters_jobs_queue():
    clusters = _by_state(Cluster, CLUSTER_STATES)
    yield _gauge(
        "suanli_clusters", "Clusters by state (not released or failed).", ["state"], clusters
    )
    yield _gauge("suanli_jobs", "Jobs by state (not ended).", ["state"], _by_state(Job, JOB_STATES))
    length: dict[tuple, float] = {}
    oldest: dict[tuple, float] = {}
    now = timezone.now()
    for row in (
        Cluster.objects.filter(state=Cluster.State.PENDING)
        .values("gpu_model__name")
        .annotate(n=Count("id"), first=Min("queued_at"))
        .order_by()
    ):
        key = (row["gpu_model__name"] or "cpu",)
        length[key] = row["n"]
        oldest[key] = max(0.0, (now - row["first"]).total_seconds()) if row["first"] else 0.0
    yield _gauge(
        "suanli_queue_length",
        "Pending clusters waiting for placement, by GPU model (cpu: CPU-only).",
        ["model"],
        length,
    )
    yield _gauge(
        "suanli_queue_oldest_seconds",
        "Age of the oldest pending cluster, by GPU model.",
        ["model"],
        oldest,
    )


def money():
    book = RateBook.load()
    card = book.at(timezone.now())
    per_hour = Decimal("0")
    if card is not None:
        for row in (
            Node.objects.filter(released_at__isnull=True, cluster__state__in=Cluster.HOLDS_CAPACITY)
            .values(
                "no_gpu",
                "cluster__gpu_model_id",
                "cluster__instance_type_id",
                "cluster__spot",
                "cluster__gpus_per_node",
            )
            .annotate(n=Count("id"))
            .order_by()
        ):
            if row["no_gpu"]:
                per_hour += card.no_gpu * row["n"]
                continue
            rate = card.rate(
                gpu_model_id=row["cluster__gpu_model_id"],
                instance_type_id=row["cluster__instance_type_id"],
                spot=row["cluster__spot"],
            )
            if rate is not None:
                units = row["cluster__gpus_per_node"] if row["cluster__gpu_model_id"] else 1
                per_hour += rate * units * row["n"]
    yield _gauge(
        "suanli_revenue_cny_per_hour",
        f"What running clusters are charged per hour now, in the rate card's currency "
        f"({book.currency}).",
        [],
        {(): float(per_hour)},
    )
    balances = {("researcher",): 0.0, ("team",): 0.0}
    team = Team.objects.filter(principal_id=OuterRef("user_id"))
    for row in (
        Account.objects.annotate(is_team=Exists(team))
        .values("is_team")
        .annotate(total=Sum("balance"))
        .order_by()
    ):
        balances[("team" if row["is_team"] else "researcher",)] = float(row["total"] or 0)
    yield _gauge(
        "suanli_balance_cny",
        "Sum of the accounts' balances (researchers' own, teams').",
        ["kind"],
        balances,
    )


def builds():
    states = _by_state(ImageBuild, BUILD_STATES)
    yield _gauge("suanli_builds", "Image builds and workspace saves under way.", ["state"], states)


def from_redis():
    """RQ's queues and what the processes keep in Redis; nothing (logged) while it is away."""
    try:
        store = metrics.read_store()
        depth, failed = {}, {}
        for name in settings.RQ_QUEUES:
            queue = django_rq.get_queue(name)
            depth[(name,)] = queue.count
            failed[(name,)] = queue.failed_job_registry.count
    except REDIS_DOWN as exc:
        log.warning("metrics: Redis is unreachable (%s); its series are left out", exc)
        return
    yield _gauge("suanli_rq_queue_depth", "Jobs waiting in each RQ queue.", ["queue"], depth)
    yield _gauge("suanli_rq_failed", "Failed jobs kept in each RQ queue.", ["queue"], failed)
    counters = store["counters"]
    for spec in metrics.STORED:
        if spec.kind != "counter":
            continue
        family = CounterMetricFamily(spec.name.removesuffix("_total"), spec.doc)
        family.add_metric([], counters.get(spec.name, 0.0))
        yield family
    gauges = store["gauges"]
    now = time.time()
    for spec in (metrics.ACCRUAL_TICK, metrics.ACCRUAL_LAST):
        if spec.name in gauges:
            yield _gauge(spec.name, spec.doc, [], {(): gauges[spec.name]})
    billed = gauges.get(metrics.ACCRUAL_NOW)
    lag = max(0.0, now - billed) if billed is not None else _lag_from_meters(now)
    yield _gauge(
        "suanli_accrual_lag_seconds",
        "Seconds between now and the moment up to which the last accrual tick charged.",
        [],
        {(): lag},
    )
    for spec in metrics.HISTOGRAMS:
        family = HistogramMetricFamily(spec.name, spec.doc, labels=list(spec.labels))
        for value in store["histograms"].get(spec.name, []):
            family.add_metric(
                [value.labels.get(k, "") for k in spec.labels], value.buckets, value.sum
            )
        yield family
    beats = {
        (process, shard): t
        for (process, shard), t in store["beats"].items()
        if now - t < BEAT_FORGET_S
    }
    yield _gauge(
        "suanli_process_heartbeat_timestamp_seconds",
        "Unix time of each long-running process's last beat seen in Redis.",
        ["process", "shard"],
        beats,
    )


def _lag_from_meters(now: float) -> float:
    """No tick recorded yet (a new Redis): how far the oldest open meter is behind."""
    first = Meter.objects.filter(settled=False).aggregate(first=Min("billed_until"))["first"]
    return max(0.0, now - first.timestamp()) if first else 0.0

"""bench/pages: the researcher's and the operator's pages with a long history behind them,
beside the same pages of a researcher who has almost none, on PostgreSQL.

Set-up (timed as a whole, printed as the `seed` line): the tables of jobs, billing and
monitoring are emptied, then two researchers are written with COPY and bulk_create:
- large: 2,000 one-node clusters over 100 days (100 still running, the rest released or
  failed), 10 jobs each, BENCH_LEDGER (1,000,000) ten-second usage pieces spread over the
  clusters' lives with two top-ups, a meter per cluster, and one finished job with
  BENCH_SAMPLES (20,000) one-second GPU samples and a stored log;
- small: 6 clusters (1 running), 18 jobs, 600 pieces, a job of 1,000 samples;
then `billing.rollups.rebuild()` folds both ledgers into bill lines and usage days, as the
accrual would have written them. Each account's balance is its last `balance_after`.
An operator (staff, superuser) reads the operators' pages.

Timed, through django.test.Client in this process (DEBUG off, logged in with
force_login): each page once untimed, then BENCH_REPEAT (20) times, the large and the
small researcher alternately. Each page prints one JSON line with p50 and p95 per
researcher and ratio_p95 = large / small; a page that is not 200 stops the bench.
The statement CSV is streamed: `ttfb` is the time to its first chunk, `total` to its
last byte. Operator pages have large data only. Query counts are from one more request.

First visit (`first_visit` lines, one per page: the large researcher's running cluster,
finished job and a finished sweep of theirs): what a browser with an empty cache fetches
and how soon the page is ready, in Debian's Chromium through a real web process (the
Procfile's uvicorn line) on this database. Each visit is a fresh browser context (empty
cache, the researcher's session cookie); BENCH_FIRST_VISITS (5) visits a page, the
median is printed. Twice per page, each on its own web process and collectstatic:
- now: the static files as production and `make run` serve them (hashed, gzip and brotli,
  cached for good), plotly.js the partial bundle of static/vendor/;
- before (the `before_` keys): plain names, uncompressed, and the full plotly.js of the
  `plotly` package in its place, as `make run` served them until issue 40.
`bytes` is every response of the visit as sent (headers and compressed bodies, Chromium's
encodedDataLength) until the network is idle; `plotly_bytes` the plotly.js part of it;
`dcl_ms` DOMContentLoaded after the navigation started (plotly.js is a deferred script:
it is fetched and run before it), `load_ms` the load event, `ttfb_ms` and `html_ms` the
page's first and last byte, `plotly_ms` plotly.js's last byte.

BENCH_PAGES (comma-separated page names, e.g. `job,job_first_view`; `first_visit` for the
browser's visits) runs only those; every page when unset.
"""

import heapq
import json
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.core.cache import caches  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402

from billing import rollups  # noqa: E402
from billing import selectors as money  # noqa: E402
from billing.accrual import ENTRY_FIELDS  # noqa: E402
from billing.models import (  # noqa: E402
    UNIT,
    Account,
    BillLine,
    LedgerEntry,
    Meter,
    Price,
    RateCard,
    UsageDay,
)
from jobs.base.sql import insert_rows  # noqa: E402
from jobs.models import Cluster, GpuModel, Host, Image, Job, JobEvent, Node, Replica  # noqa: E402
from jobs.placement.catalog import seed_catalog  # noqa: E402
from monitoring.models import Sample  # noqa: E402

LEDGER = int(os.environ.get("BENCH_LEDGER", 1_000_000))
SAMPLES = int(os.environ.get("BENCH_SAMPLES", 20_000))
REPEAT = int(os.environ.get("BENCH_REPEAT", 20))
KEEP = os.environ.get("BENCH_KEEP", "") == "1"  # leave the data for EXPLAIN afterwards
# Only these pages (see the docstring); every page when unset.
ONLY = {p for p in os.environ.get("BENCH_PAGES", "").split(",") if p}
FIRST_VISITS = int(os.environ.get("BENCH_FIRST_VISITS", 5))
ROOT = Path(__file__).resolve().parent.parent
DAYS = 100
TICK_S = 10
PER_HOUR = Decimal("3.6000")  # per GPU-hour: a ten-second piece of one GPU is 0.0100
PIECE_UNITS = 100  # that piece in UNITs (0.0001), so money adds up as integers
CHUNK = 50_000
HOSTS = 16
LOG_LINES = 500

SAMPLE_FIELDS = (
    "at", "cluster", "job", "host", "node_index", "gpu_util", "gpu_mem_mib", "gpu_power_w",
    "gpu_source", "cpu_pct", "mem_bytes", "net_rx_bps", "net_tx_bps", "disk_read_bps", "disk_write_bps",
    "read_iops", "write_iops",
)  # fmt: skip


@dataclass
class Researcher:
    user: object
    account_id: int
    job_id: int  # the finished job with samples
    clusters: int
    jobs: int
    entries: int
    samples: int


def reset():
    with connection.cursor() as cur:
        cur.execute(
            "TRUNCATE billing_billline, billing_usageday, billing_ledgerentry, billing_meter, "
            "billing_account, billing_price, billing_ratecard, monitoring_sample, "
            "monitoring_rollup, jobs_replica, jobs_jobevent, jobs_job, jobs_clusterevent, "
            "jobs_volume, jobs_cluster_ssh_keys, jobs_gpuslot, jobs_node, jobs_cluster, "
            "jobs_host RESTART IDENTITY CASCADE"
        )


def at(ts: int) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def money_of(units: int) -> Decimal:
    return Decimal(units).scaleb(-4).quantize(UNIT)


def user(name: str, **flags):
    User = get_user_model()
    u, _ = User.objects.update_or_create(username=name, defaults=flags)
    return u


def make_hosts(model: GpuModel, when: datetime) -> list[Host]:
    return Host.objects.bulk_create(
        [
            Host(
                name=f"pages{i:02}", engine_url=f"unix:///run/bench-pages-{i}.sock",
                address="127.0.0.1", zone=f"zone-{'ab'[i % 2]}", gpu_model=model, gpu_count=8,
                state=Host.State.ACTIVE, cpu_count=64, memory_bytes=512 * 2**30, last_seen=when,
            )
            for i in range(HOSTS)
        ]
    )  # fmt: skip


def plan_clusters(n: int, running: int, pieces: int, now: int, rng: random.Random) -> list[dict]:
    """When each cluster ran and how many pieces it was billed, oldest first: the ended
    ones spread evenly over the history, the running ones billed up to `now`."""
    first = now - DAYS * 86_400
    ended = n - running
    plans = []
    for i in range(n):
        count = pieces // n + (1 if i < pieces % n else 0)
        if i < ended:
            start = first + i * (DAYS * 86_400 - 6 * 3600) // max(ended, 1) + rng.randint(0, 600)
        else:
            start = now - count * TICK_S
        start -= start % TICK_S
        plans.append(
            {
                "start": start, "end": start + count * TICK_S, "pieces": count,
                "units": rng.choice((1, 2, 4, 8)), "running": i >= ended,
                "failed": i < ended and i % 20 == 19,
            }
        )  # fmt: skip
    return plans


def make_clusters(owner, plans, model, image, hosts) -> list[Cluster]:
    clusters = Cluster.objects.bulk_create(
        [
            Cluster(
                owner=owner, name=f"{owner.username}-{i}", gpu_model=model, nodes=1,
                gpus_per_node=p["units"], image=image, image_reference=image.reference,
                state=Cluster.State.RUNNING if p["running"]
                else Cluster.State.FAILED if p["failed"] else Cluster.State.RELEASED,
                state_reason="host lost" if p["failed"] else "",
                created_at=at(p["start"] - 60), queued_at=at(p["start"] - 60),
                running_since=at(p["start"]), last_active_at=at(p["end"]),
                released_at=None if p["running"] else at(p["end"] + 5),
            )
            for i, p in enumerate(plans)
        ],
        batch_size=2000,
    )  # fmt: skip
    Node.objects.bulk_create(
        [
            Node(
                cluster=c, index=0, host=hosts[i % len(hosts)],
                gpu_indices=list(range(p["units"])), placed_at=at(p["start"]),
                started_at=at(p["start"]),
                released_at=None if p["running"] else at(p["end"] + 5),
            )
            for i, (c, p) in enumerate(zip(clusters, plans, strict=True))
        ],
        batch_size=2000,
    )  # fmt: skip
    return clusters


def make_jobs(owner, clusters, plans, per_cluster: int) -> list[Job]:
    jobs = []
    for c, p in zip(clusters, plans, strict=True):
        step = max((p["end"] - p["start"]) // per_cluster, 2)
        for j in range(per_cluster):
            begin = p["start"] + j * step
            last = j == per_cluster - 1
            live = p["running"] and last
            state = (
                Job.State.RUNNING if live
                else Job.State.FAILED if j % 7 == 6
                else Job.State.CANCELLED if j % 11 == 10
                else Job.State.SUCCEEDED
            )  # fmt: skip
            jobs.append(
                Job(
                    cluster=c, owner=owner, name=f"train-{c.pk}-{j}",
                    command="torchrun train.py --config configs/base.yaml", attempt=1,
                    state=state, exit_code=None if live else (1 if state == Job.State.FAILED else 0),
                    created_at=at(begin), queued_at=at(begin), started_at=at(begin + 1),
                    running_since=at(begin + 1), finished_at=None if live else at(begin + step - 1),
                )
            )  # fmt: skip
    return Job.objects.bulk_create(jobs, batch_size=2000)


def make_ledger(account_id: int, clusters, plans, model_id: int) -> int:
    """The usage pieces of every cluster and two top-ups, written in the order they were
    charged (as accrual would: ids follow time), each with the balance after it. Returns
    the balance in UNITs."""
    used = sum(p["pieces"] * p["units"] * PIECE_UNITS for p in plans)
    first = min(p["start"] for p in plans)
    middle = (first + max(p["end"] for p in plans)) // 2
    topups = [(first - 3600, -1, used * 7 // 10), (middle, -1, used // 2)]
    rate = PER_HOUR.quantize(Decimal("0.00000001"))
    amounts = {u: money_of(-u * PIECE_UNITS) for u in (1, 2, 4, 8)}

    def pieces_of(i: int, start: int, count: int):
        for k in range(count):
            yield start + (k + 1) * TICK_S, i, k

    stream = heapq.merge(
        topups, *(pieces_of(i, p["start"], p["pieces"]) for i, p in enumerate(plans))
    )
    balance, rows, written = 0, [], 0
    for ts, i, k in stream:
        if i < 0:
            balance += k
            rows.append(
                (
                    account_id, LedgerEntry.Kind.TOPUP.value, money_of(k), money_of(balance),
                    f"bench-topup:{account_id}:{ts}", None, None, None, 0, None, None,
                    "bank transfer", at(ts), None,
                )
            )  # fmt: skip
        else:
            units, cluster_id = plans[i]["units"], clusters[i].pk
            balance -= units * PIECE_UNITS
            end = at(ts)
            rows.append(
                (
                    account_id, LedgerEntry.Kind.USAGE.value, amounts[units], money_of(balance),
                    f"usage:{cluster_id}:{ts - TICK_S}:{ts}", cluster_id, at(ts - TICK_S), end,
                    units, rate, model_id, "", end, None,
                )
            )  # fmt: skip
        if len(rows) >= CHUNK:
            written += insert_rows(LedgerEntry, ENTRY_FIELDS, rows)
            rows = []
    written += insert_rows(LedgerEntry, ENTRY_FIELDS, rows)
    Account.objects.filter(pk=account_id).update(balance=money_of(balance))
    Meter.objects.bulk_create(
        [
            Meter(
                cluster=c, account_id=account_id, billed_until=at(p["end"]),
                exact=money_of(p["pieces"] * p["units"] * PIECE_UNITS) * 3600,
                charged=money_of(p["pieces"] * p["units"] * PIECE_UNITS),
                settled=not p["running"],
            )
            for c, p in zip(clusters, plans, strict=True)
        ],
        batch_size=2000,
    )  # fmt: skip
    return written


def make_sampled_job(job: Job, cluster: Cluster, host: Host, samples: int, rng) -> int:
    """A finished job with `samples` one-second samples of its one node, a dip now and
    then, and a stored log: the page a researcher opens after a long run."""
    start = int(job.started_at.timestamp())
    end = start + samples
    Job.objects.filter(pk=job.pk).update(
        state=Job.State.SUCCEEDED, exit_code=0, finished_at=at(end)
    )
    node = Node.objects.get(cluster=cluster, index=0)
    log = "\n".join(
        f"{at(start + i * samples // LOG_LINES).isoformat()} step {i * 100} loss {2.0 / (i + 1):.4f}"
        for i in range(LOG_LINES)
    )
    Replica.objects.create(
        job=job, attempt=1, rank=0, node=node, host=host, container_name=f"bench-pages-{job.pk}",
        state=Replica.State.EXITED, exit_code=0, log=log, started_at=at(start),
        finished_at=at(end),
    )  # fmt: skip
    JobEvent.objects.bulk_create(
        [
            JobEvent(job=job, at=at(start - 1), kind="queued", message="queued"),
            JobEvent(job=job, at=at(start), kind="running", message="running on 1 node"),
            JobEvent(job=job, at=at(end), kind="succeeded", message="exit code 0"),
        ]
    )
    gpus = cluster.gpus_per_node
    rows = []
    for s in range(samples):
        dip = s % 600 < 20  # a data-loader stall every ten minutes
        util = [float(rng.randint(2, 10) if dip else rng.randint(85, 99)) for _ in range(gpus)]
        rows.append(
            (
                at(start + s), cluster.pk, job.pk, host.pk, 0, util, [61_000.0] * gpus,
                [round(90.0 + 6.0 * u, 1) for u in util], "nvml",  # watts follow the load
                rng.uniform(300, 700), 48 * 2**30, rng.uniform(1e6, 5e7), rng.uniform(1e6, 5e7),
                rng.uniform(0, 2e8), rng.uniform(0, 1e7), rng.uniform(0, 900), rng.uniform(0, 90),
            )
        )  # fmt: skip
    return insert_rows(Sample, SAMPLE_FIELDS, rows)


def seed_researcher(
    name, *, clusters, running, jobs_per_cluster, pieces, samples, model, image, hosts, now, rng
) -> Researcher:
    owner = user(name)
    account = Account.objects.create(user=owner)
    plans = plan_clusters(clusters, running, pieces, now, rng)
    made = make_clusters(owner, plans, model, image, hosts)
    jobs = make_jobs(owner, made, plans, jobs_per_cluster)
    entries = make_ledger(account.pk, made, plans, model.pk)
    # The sampled job: the last job of an ended cluster half-way through the history.
    i = (clusters - running) // 2
    job = jobs[i * jobs_per_cluster + jobs_per_cluster - 1]
    wrote = make_sampled_job(job, made[i], hosts[i % len(hosts)], samples, rng)
    return Researcher(owner, account.pk, job.pk, clusters, len(jobs), entries, wrote)


def seed() -> tuple[Researcher, Researcher, object, dict]:
    t0 = time.perf_counter()
    reset()
    seed_catalog()
    model = GpuModel.objects.get(slug="a100-80gb")
    image = Image.objects.get(reference="suanli/busybox:latest")
    now = int(time.time()) // TICK_S * TICK_S
    card = RateCard.objects.create(effective_from=at(now - (DAYS + 1) * 86_400), note="bench")
    Price.objects.create(card=card, gpu_model=model, per_hour=PER_HOUR)
    hosts = make_hosts(model, at(now))
    rng = random.Random(42)
    common = {"model": model, "image": image, "hosts": hosts, "now": now, "rng": rng}
    large = seed_researcher(
        "bench-pages-large", clusters=2000, running=100, jobs_per_cluster=10, pieces=LEDGER,
        samples=SAMPLES, **common,
    )  # fmt: skip
    small = seed_researcher(
        "bench-pages-small", clusters=6, running=1, jobs_per_cluster=3, pieces=600,
        samples=1000, **common,
    )  # fmt: skip
    operator = user("bench-pages-ops", is_staff=True, is_superuser=True)
    t1 = time.perf_counter()
    read = rollups.rebuild()
    rebuilt = time.perf_counter() - t1
    with connection.cursor() as cur:
        cur.execute(
            "ANALYZE billing_ledgerentry, billing_billline, billing_usageday, jobs_cluster, "
            "jobs_job, monitoring_sample"
        )
    for r in (large, small):  # the balance is the last entry's balance_after
        last = LedgerEntry.objects.filter(account_id=r.account_id).order_by("-created_at", "-id")
        assert Account.objects.get(pk=r.account_id).balance == last[0].balance_after
    counts = {
        "bench": "pages",
        "case": "seed",
        "large_clusters": large.clusters,
        "large_jobs": large.jobs,
        "large_entries": large.entries,
        "large_samples": large.samples,
        "large_bill_lines": BillLine.objects.filter(account_id=large.account_id).count(),
        "large_usage_days": UsageDay.objects.filter(account_id=large.account_id).count(),
        "small_clusters": small.clusters,
        "small_entries": small.entries,
        "small_samples": small.samples,
        "small_bill_lines": BillLine.objects.filter(account_id=small.account_id).count(),
        "rebuild_entries": read,
        "rebuild_seconds": round(rebuilt, 1),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return large, small, operator, counts


# -- the pages --------------------------------------------------------------------------


def months_back(n: int) -> tuple[int, int]:
    now = datetime.now(UTC)
    y, m = divmod(now.year * 12 + now.month - 1 - n, 12)
    return y, m + 1


def deep_cursor(r: Researcher, year: int, month: int, depth: int = 20) -> str:
    """The cursor of the page `depth` pages into a month's bill (its last page when the
    month is shorter): what following "older" that many times arrives at."""
    lines = money.bill(r.user, year, month)
    n = lines.count()
    if n < 2:
        return ""
    line = lines[min(depth * 50, n - 1) - 1]
    return f"older:{(line.at - money.EPOCH) // money.MICROSECOND}:{line.pk}"


def researcher_pages(r: Researcher) -> dict[str, str]:
    this, last = months_back(0), months_back(1)
    deep = deep_cursor(r, *last)
    return {
        "billing": "/billing/",
        "billing_deep": f"/billing/?month={last[0]}-{last[1]:02}&cursor={deep}",
        "statement": f"/billing/statement/{this[0]}-{this[1]:02}.csv",
        "statement_last_month": f"/billing/statement/{last[0]}-{last[1]:02}.csv",
        "clusters": "/clusters/",
        "clusters_page40": "/clusters/?page=40",
        "job": f"/jobs/{r.job_id}/",
        # The same page with its kept chart and diagnosis dropped before each request:
        # what the first visitor of a finished job waits for.
        "job_first_view": f"/jobs/{r.job_id}/",
    }


OPERATOR_PAGES = {
    "ops_billing": "/ops/billing/",
    "admin_ledger": "/admin/billing/ledgerentry/",
    "admin_jobs": "/admin/jobs/job/",
}


def fetch(client: Client, url: str) -> dict:
    """One request: ms to the response (to the first chunk when streamed), ms to the
    last byte, and the bytes."""
    t0 = time.perf_counter()
    response = client.get(url)
    if response.status_code != 200:
        sys.exit(f"bench/pages: {url} answered {response.status_code}")
    if response.streaming:
        chunks = iter(response.streaming_content)
        size = len(next(chunks, b""))
        first = time.perf_counter() - t0
        size += sum(len(c) for c in chunks)
        response.close()
    else:
        first, size = time.perf_counter() - t0, len(response.content)
    return {"first": first * 1000, "total": (time.perf_counter() - t0) * 1000, "bytes": size}


def p95(xs: list[float]) -> float:
    return sorted(xs)[math.ceil(0.95 * len(xs)) - 1]


def queries(client: Client, url: str) -> tuple[int, float, str]:
    """Queries of one request: how many, and the slowest one's ms and first words."""
    with CaptureQueriesContext(connection) as ctx:
        fetch(client, url)
    if not ctx.captured_queries:
        return 0, 0.0, ""
    slowest = max(ctx.captured_queries, key=lambda q: float(q["time"]))
    return len(ctx.captured_queries), float(slowest["time"]) * 1000, slowest["sql"][:160]


def measure(clients: dict[str, Client], urls: dict[str, str], before=None) -> dict:
    """`before`, when given, runs (untimed) before every request."""
    runs: dict[str, list[dict]] = {who: [] for who in clients}
    for who, client in clients.items():
        fetch(client, urls[who])  # warm-up: templates, the first query plans
    for _ in range(REPEAT):
        for who, client in clients.items():
            if before:
                before()
            runs[who].append(fetch(client, urls[who]))
    out = {}
    for who, rs in runs.items():
        total = [r["total"] for r in rs]
        out[f"{who}_p50_ms"] = round(statistics.median(total), 1)
        out[f"{who}_p95_ms"] = round(p95(total), 1)
        out[f"{who}_bytes"] = rs[-1]["bytes"]
        if urls[who].endswith(".csv"):
            first = [r["first"] for r in rs]
            out[f"{who}_ttfb_p50_ms"] = round(statistics.median(first), 1)
            out[f"{who}_ttfb_p95_ms"] = round(p95(first), 1)
        if before:
            before()
        n, slow_ms, slow_sql = queries(clients[who], urls[who])
        out[f"{who}_queries"] = n
        out[f"{who}_slowest_query_ms"] = round(slow_ms, 1)
        if who == "large":
            out["large_slowest_query"] = slow_sql
    if "small" in clients:
        out["ratio_p95"] = round(out["large_p95_ms"] / out["small_p95_ms"], 2)
    return out


def logged_in(u) -> Client:
    client = Client()
    client.force_login(u)
    return client


# -- the first visit -------------------------------------------------------------------------


def seed_sweep(owner, cluster: Cluster) -> int:
    """A finished sweep of four trials on a pool of `cluster`'s shape (no cluster of its
    own: nothing is placed); returns its id."""
    from jobs.clusters.services import ClusterSpec
    from jobs.models import Pool, Sweep, Trial
    from jobs.pools import autoscaler, sweeps

    Sweep.objects.filter(owner=owner).delete()
    Pool.objects.filter(owner=owner).delete()
    shape = ClusterSpec(
        name="", nodes=1, gpu_model=cluster.gpu_model, gpus_per_node=1, image=cluster.image
    )
    pool = autoscaler.pool_create(owner=owner, spec=autoscaler.PoolSpec(name="lr", cluster=shape))
    spec = sweeps.SweepSpec(
        name="lr-search", command="python train.py",
        space=sweeps.parse_space("lr: log_uniform 1e-4 1e-1\nlayers: int 1 8\nopt: categorical adam sgd"),
        metric="val_loss", trials=4, parallel=4, min_steps=5,
    )  # fmt: skip
    sweep = sweeps.sweep_create(owner=owner, pool=pool, spec=spec)
    for n, trial in enumerate(sweep.trial_set.order_by("number")):
        curve = [[10 * k, 1.0 - n / 10 - k / 50] for k in range(1, 41)]
        Trial.objects.filter(pk=trial.pk).update(
            state=Trial.State.COMPLETE, curve=curve, last_step=400, last_value=curve[-1][1],
            best_value=curve[-1][1],
        )  # fmt: skip
    Sweep.objects.filter(pk=sweep.pk).update(state=Sweep.State.FINISHED)
    return sweep.pk


def collect(root: Path, *, manifest: bool) -> None:
    """collectstatic into `root`; before: plain names and the plotly package's full bundle."""
    env = {**os.environ, "SUANLI_STATIC_ROOT": str(root), "SUANLI_STATIC_FINDERS": "0",
           "SUANLI_STATIC_MANIFEST": "1" if manifest else "0"}  # fmt: skip
    subprocess.run(
        [sys.executable, "manage.py", "collectstatic", "--no-input", "-v0"], cwd=ROOT, env=env,
        check=True,
    )  # fmt: skip
    if not manifest:
        import plotly

        full = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
        shutil.copyfile(full, root / "vendor" / "plotly.min.js")


@contextmanager
def serving(root: Path, *, manifest: bool):
    """The web process as the Procfile runs it, on this database, serving `root`."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    line = next(
        x.split(":", 1)[1].strip() for x in (ROOT / "Procfile").read_text().splitlines()
        if x.startswith("web:")
    )  # fmt: skip
    env = {**os.environ, "PORT": str(port), "ALLOWED_HOSTS": "127.0.0.1",
           "SUANLI_STATIC_ROOT": str(root), "SUANLI_STATIC_FINDERS": "0",
           "SUANLI_STATIC_MANIFEST": "1" if manifest else "0"}  # fmt: skip
    proc = subprocess.Popen(
        ["/bin/sh", "-c", f"exec {line}"], cwd=ROOT, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/healthz", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    sys.exit("bench/pages: the web process did not answer")
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ms after the navigation started: the first byte and the last of the page, the last of
# plotly.js, DOMContentLoaded and load.
TIMES = ("ttfb_ms", "html_ms", "plotly_ms", "dcl_ms", "load_ms")


def visit(browser, url: str, session: str) -> dict:
    """One first visit: a fresh context (empty cache) with the session cookie."""
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    origin = "/".join(url.split("/", 3)[:3])  # http://127.0.0.1:port
    context.add_cookies([{"name": settings.SESSION_COOKIE_NAME, "value": session, "url": origin}])
    page = context.new_page()
    cdp = context.new_cdp_session(page)
    cdp.send("Network.enable")
    sent: dict[str, int] = {}
    names: dict[str, str] = {}
    cdp.on(
        "Network.requestWillBeSent",
        lambda e: names.__setitem__(e["requestId"], e["request"]["url"]),
    )
    cdp.on(
        "Network.loadingFinished",
        lambda e: sent.__setitem__(e["requestId"], e["encodedDataLength"]),
    )
    try:
        response = page.goto(url, wait_until="load")
        if response is None or response.status != 200:
            sys.exit(f"bench/pages: {url} answered {response and response.status}")
        page.wait_for_load_state("networkidle")
        times = page.evaluate(
            """() => {
              const n = performance.getEntriesByType('navigation')[0];
              const p = performance.getEntriesByType('resource').find((r) => r.name.includes('/plotly'));
              return {ttfb_ms: n.responseStart, html_ms: n.responseEnd,
                      plotly_ms: p ? p.responseEnd : 0, dcl_ms: n.domContentLoadedEventEnd,
                      load_ms: n.loadEventEnd};
            }"""
        )
    finally:
        context.close()
    plotly = sum(n for rid, n in sent.items() if "/plotly" in names.get(rid, ""))
    return {"bytes": sum(sent.values()), "plotly_bytes": plotly, "requests": len(sent), **times}


def first_visits(r: Researcher) -> None:
    """Prints a `first_visit` line per page: now, and before (the `before_` keys)."""
    from playwright.sync_api import sync_playwright

    cluster = Cluster.objects.filter(owner=r.user, state=Cluster.State.RUNNING).first()
    pages = {"cluster": f"/clusters/{cluster.pk}/", "job": f"/jobs/{r.job_id}/",
             "sweep": f"/sweeps/{seed_sweep(r.user, cluster)}/"}  # fmt: skip
    client = logged_in(r.user)
    session = client.cookies[settings.SESSION_COOKIE_NAME].value
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-static-") as tmp, sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=os.environ.get("SUANLI_CHROMIUM", "/usr/bin/chromium"),
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        for when, manifest in (("before", False), ("now", True)):
            root = Path(tmp) / when
            collect(root, manifest=manifest)
            with serving(root, manifest=manifest) as url:
                visit(
                    browser, url + pages["cluster"], session
                )  # warm-up: the server's first request
                for page, path in pages.items():
                    runs = [visit(browser, url + path, session) for _ in range(FIRST_VISITS)]
                    results.setdefault(page, {})[when] = {
                        "bytes": runs[-1]["bytes"], "plotly_bytes": runs[-1]["plotly_bytes"],
                        "requests": runs[-1]["requests"],
                        **{k: round(statistics.median(x[k] for x in runs)) for k in TIMES},
                    }  # fmt: skip
        browser.close()
    for page, got in results.items():
        line = {"bench": "first_visit", "page": page, "visits": FIRST_VISITS, **got["now"],
                **{f"before_{k}": v for k, v in got["before"].items()}}  # fmt: skip
        line["bytes_ratio"] = round(line["bytes"] / line["before_bytes"], 3)
        print(json.dumps(line), flush=True)


def main():
    if connection.vendor != "postgresql":
        sys.exit("bench/pages runs on PostgreSQL: use `make bench`.")
    large, small, operator, counts = seed()
    print(json.dumps(counts), flush=True)
    clients = {"large": logged_in(large.user), "small": logged_in(small.user)}
    pages = {"large": researcher_pages(large), "small": researcher_pages(small)}
    for page in pages["large"]:
        if ONLY and page not in ONLY:
            continue
        urls = {who: pages[who][page] for who in clients}
        before = caches["charts"].clear if page.endswith("_first_view") else None
        line = {
            "bench": "pages", "page": page, "repeat": REPEAT, **measure(clients, urls, before)
        }  # fmt: skip
        print(json.dumps(line), flush=True)
    staff = {"large": logged_in(operator)}
    for page, url in OPERATOR_PAGES.items():
        if ONLY and page not in ONLY:
            continue
        line = {"bench": "pages", "page": page, "repeat": REPEAT, **measure(staff, {"large": url})}
        print(json.dumps(line), flush=True)
    if not ONLY or "first_visit" in ONLY:
        first_visits(large)
    if not KEEP:
        reset()


if __name__ == "__main__":
    main()

"""What a job's runs cost, for its end event (jobs.events.webhooks asks by name,
`RUN_COST`, since jobs never imports billing).

Billing charges a cluster for holding its GPUs (billing.accrual: a Meter per cluster, usage
entries summed into BillLines per cluster-hour), not per job: the ledger cannot say what one
job cost. The estimate is the cluster's price per unit-hour (after its spot discount, at the
rate card in force each second, as accrual prices it) x its GPUs (or CPU-only instances) x
the seconds the job's attempts ran, rounded once to the smallest unit (billing.pricing's
rule). A job is the cluster's only work while it runs (one job at a time), so the estimate is
what the cluster was charged for that time, unless a node was lost or moved meanwhile.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from decimal import Decimal

from billing import formatting
from billing.pricing import RateBook, to_money
from jobs.events import webhooks
from jobs.models import Cluster, Job

MICRO = timedelta(microseconds=1)


def run_cost(cluster: Cluster, spans: list[tuple[datetime, datetime]]) -> dict | None:
    """`{"amount": "12.4000", "currency": "CNY", "shown": "¥12.40"}` for `cluster`'s GPUs
    over `spans` (each `(from, to)`), None when a second of them has no price."""
    priced = cost_of(cluster, spans)
    if priced is None:
        return None
    amount, currency = priced
    return {
        "amount": str(amount),
        "currency": currency,
        "shown": formatting.total_text(amount, currency),
    }


def units_of(cluster: Cluster) -> int:
    """What the cluster's price is per hour of: its GPUs, or its CPU-only instances."""
    return cluster.nodes if cluster.is_cpu_only else cluster.nodes * max(cluster.gpus_per_node, 1)


def cost_of(
    cluster: Cluster, spans: list[tuple[datetime, datetime]], book: RateBook | None = None
) -> tuple[Decimal, str] | None:
    """`run_cost`'s amount (rounded once, billing.pricing's rule) and currency, at the rate
    cards of `book` (loaded when not given): the spans may lie ahead (a projection's rest
    is priced at the card in force then). None when a second of them has no price."""
    book = book or RateBook.load()
    units = units_of(cluster)
    exact = Decimal(0)  # unit-seconds x rate per hour, as billing.pricing keeps it
    currency = book.currency
    for start, end in spans:
        cuts = [start, *book.changes_between(start, end), end]
        for frm, to in zip(cuts, cuts[1:], strict=False):
            card = book.at(frm)
            rate = None
            if card is not None:
                rate = card.rate(
                    gpu_model_id=cluster.gpu_model_id,
                    instance_type_id=cluster.instance_type_id,
                    spot=cluster.spot,
                )
            if rate is None:
                return None
            currency = card.currency
            exact += rate * units * Decimal((to - frm) // MICRO) / 1_000_000
    return to_money(exact), currency


def costs_so_far(
    jobs: list[Job],
    *,
    book: RateBook | None = None,
    now: datetime | None = None,
    spans: dict[int, list[tuple]] | None = None,
) -> dict[int, Decimal | None]:
    """The one "what a job has cost so far" (its attempts' runs priced, as its end event
    prices them): job id -> amount, None without a price. One Replica query for all of
    them (`spans`: `webhooks.runs_of`'s answer, when the caller has it) and one read of the
    rate cards; the jobs' clusters are read from the jobs (select_related them)."""
    book = book or RateBook.load()
    spans = webhooks.runs_of(jobs, now=now) if spans is None else spans
    out: dict[int, Decimal | None] = {}
    for job in jobs:
        ran = spans.get(job.pk, [])
        if job.cluster_id is None:  # never placed: nothing ran, nothing to price
            out[job.pk] = None if ran else Decimal(0)
            continue
        priced = cost_of(job.cluster, ran, book)
        out[job.pk] = None if priced is None else priced[0]
    return out

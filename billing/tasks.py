"""Thin RQ entry points for money."""

import time

from billing import accrual, projections, services, storage
from jobs.base import metrics


def accrue() -> dict:
    start = time.perf_counter()
    report = accrual.accrue()
    metrics.set_gauges(
        {
            metrics.ACCRUAL_TICK.name: time.perf_counter() - start,
            metrics.ACCRUAL_LAST.name: time.time(),
            metrics.ACCRUAL_NOW: report.now.timestamp(),  # charged up to: the lag's start
        }
    )
    return {
        "clusters": report.clusters,
        "entries": report.entries,
        "charged": str(report.charged),
        "settled": report.settled,
        "exhausted": report.exhausted,
    }


def notify_low_balances() -> int:
    return services.notify_low_balances()


def storage_accrue() -> dict:
    """The hourly storage bill (billing/storage.py): charges only hours that have ended."""
    report = storage.accrue()
    return {
        "until": report.until.isoformat(),
        "accounts": report.accounts,
        "entries": report.entries,
        "charged": str(report.charged),
        "exhausted": report.exhausted,
    }


def job_projection(job_id: int) -> str:
    """A job's finish and cost projected again (queued by name from jobs.runs.progress each
    time its progress is read, unique per job, and once more at its end)."""
    return projections.write(job_id)

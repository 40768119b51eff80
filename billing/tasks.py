"""Thin RQ entry points for money."""

from billing import accrual, services, storage


def accrue() -> dict:
    report = accrual.accrue()
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

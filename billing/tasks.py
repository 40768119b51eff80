"""Thin RQ entry points for money."""

from billing import services


def accrue() -> dict:
    report = services.accrue()
    return {
        "clusters": report.clusters,
        "entries": report.entries,
        "charged": str(report.charged),
        "settled": report.settled,
        "exhausted": report.exhausted,
    }


def notify_low_balances() -> int:
    return services.notify_low_balances()

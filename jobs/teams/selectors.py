"""What the operator's Teams page reads of each team's use of the fleet: the GPUs its nodes
hold now and its GPU-hours since a moment (the start of the month). From the nodes' placed
and released times, as fair share reads them (jobs/placement/fairshare.py), not billing's
ledger: GPU-hours are what the fleet gave, whatever was charged for them.

Layer: teams, reads models only. Writes nothing.
"""

from datetime import datetime
from decimal import Decimal

from django.db.models import Count, Q, QuerySet

from jobs.models import Node, Team


def teams_overview() -> QuerySet[Team]:
    """Every team by name, with its owner's membership and its member count."""
    return (
        Team.objects.select_related("principal")
        .annotate(member_count=Count("memberships"))
        .order_by("name", "pk")
    )


def fleet_use(principal_ids, *, since: datetime, now: datetime) -> dict[int, tuple[int, Decimal]]:
    """principal id -> (GPUs its live nodes hold now, GPU-hours from `since` to `now`, to a
    tenth). One query over the nodes that were live in the span, for the given accounts."""
    out: dict[int, tuple[int, Decimal]] = {}
    rows = Node.objects.filter(
        Q(released_at__isnull=True) | Q(released_at__gt=since),
        cluster__owner_id__in=list(principal_ids), placed_at__lt=now, no_gpu=False,
        cluster__gpus_per_node__gt=0,
    ).values_list("cluster__owner_id", "cluster__gpus_per_node", "placed_at", "released_at")  # fmt: skip
    for owner, gpus, placed, released in rows:
        held, hours = out.get(owner, (0, Decimal(0)))
        start, end = max(placed, since), min(released or now, now)
        seconds = max((end - start).total_seconds(), 0)
        out[owner] = (held + (gpus if released is None else 0), hours + gpus * Decimal(seconds))
    return {o: (held, (s / 3600).quantize(Decimal("0.1"))) for o, (held, s) in out.items()}

"""For tests of money that place clusters on the real scheduler without starting their
workspaces (no engine work queued is run): say that their nodes ran, as a workspace's
start does (jobs/nodes/workspaces.py `_up`). Billing starts at `Node.started_at`, never
at placement; a node that never ran is never charged (tests/test_billing_start.py)."""

from jobs.models import Node


def ran(cluster, at=None) -> int:
    """The cluster's live nodes that have not run yet ran from `at` (default: the second
    each was placed). Returns how many."""
    from django.db.models import F

    nodes = Node.objects.filter(
        cluster_id=getattr(cluster, "pk", cluster), released_at__isnull=True, started_at=None
    )
    return nodes.update(started_at=at if at is not None else F("placed_at"))

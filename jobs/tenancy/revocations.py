"""Telling every process at once that a person lost their access to a team's things (a
member removed, or who left): the SSH gateway (jobs/access) ends their sessions on the
team's clusters, the web process closes their websockets (terminals, live logs and charts)
and the app proxy stops serving them. Each of those also re-checks the membership on every
request, channel and heartbeat; this is what makes the end immediate rather than at the
next check.

Two carriers, both best-effort (a lost message leaves the per-request checks):
- Redis pub/sub on `channel(redis)`, JSON {"person": id, "principal": id}: the gateway
  subscribes. A channel is the whole server's, not a database's: its name carries the
  database number, so that consoles sharing a Redis server on their own numbers (and the
  test processes beside each other) never end each other's sessions;
- the Channels group `group_for(person)`, message {"type": "access.revoked", "principal":
  id}: every websocket consumer of the person joins it.

Layer: tenancy, on models.
"""

import json
import logging

import django_rq
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

log = logging.getLogger("suanli.teams")

CHANNEL = "suanli:access:revoked"


def channel(connection) -> str:
    """The revocations' pub/sub channel of the console whose queues are on `connection`."""
    return f"{CHANNEL}:{connection.connection_pool.connection_kwargs.get('db', 0)}"


def group_for(person_id: int) -> str:
    return f"access-{person_id}"


def announce_revoked(*, person_id: int, principal_id: int) -> None:
    """Tell every process that `person_id` may no longer reach what `principal_id` owns."""
    body = {"person": person_id, "principal": principal_id}
    try:
        queues = django_rq.get_connection("default")
        queues.publish(channel(queues), json.dumps(body))
    except Exception:  # Redis away: the per-request and heartbeat checks still hold
        log.warning("could not announce a revoked membership on Redis", exc_info=True)
    layer = get_channel_layer()
    if layer is None:
        return
    try:
        async_to_sync(layer.group_send)(
            group_for(person_id), {"type": "access.revoked", "principal": principal_id}
        )
    except Exception:
        log.warning("could not announce a revoked membership to websockets", exc_info=True)

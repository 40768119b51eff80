"""Job and cluster events to researchers' endpoints, signed per Standard Webhooks.

At least once, never lost: `emit` writes the event and one delivery per subscribed
endpoint in the caller's transaction (the one that changes the state it reports), and
enqueues the deliveries on commit; a cron sweep enqueues whatever is due and was not
(Redis lost, a worker killed). A delivery is claimed with a conditional UPDATE before it
is sent, so two workers never send the same attempt.

Headers: `webhook-id` (the event's uid, the same on every retry), `webhook-timestamp`,
`webhook-signature` (`v1,<base64 HMAC-SHA256 of id.timestamp.body>`, with the previous
secret's signature too for 24 h after a rotation). Retries: `SUANLI_WEBHOOK_RETRY_DELAYS`
(at once, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h); only 2xx is success; `410 Gone`
disables the endpoint; an endpoint failing for `SUANLI_WEBHOOK_DISABLE_AFTER_S` (5 days)
is disabled and its owner told on the dashboard.

Layer: events (the event outbox and its signed delivery), under timeline, which reports state
changes through it. Uses netguard, models and base (text); a delivery is queued by task name
("jobs.tasks.webhook_deliver") on the "webhooks" queue.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
from datetime import timedelta

import django_rq
from django.conf import settings
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from jobs.base.text import Text, fit
from jobs.events import netguard
from jobs.models import (
    Cluster,
    Job,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
)

log = logging.getLogger(__name__)

EVENT_TYPES = [value for value, _ in WebhookEndpoint.EVENTS]
TEST_EVENT = "webhook.test"
LEASE = timedelta(seconds=60)  # a claimed attempt not recorded by then is tried again
DELIVER_TASK = "jobs.tasks.webhook_deliver"  # by name: tasks sit above this module


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: str) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def _link(name: str, *args) -> str:
    return settings.SUANLI_PUBLIC_URL.rstrip("/") + reverse(name, args=args)


def _body(event_type: str, data: dict, at) -> str:
    return json.dumps(
        {"type": event_type, "timestamp": at.isoformat().replace("+00:00", "Z"), "data": data},
        separators=(",", ":"),
        sort_keys=True,
    )


# Which timeline entries go out as which webhook type, by timeline and kind: the one place
# that decides. The timeline's writer (jobs.events.timeline) writes every entry and hands it
# to `timeline_entry`; a kind not listed is not sent (a pool's entries never are).
SENT_AS: dict[str, dict[str, str]] = {
    "cluster": {
        "running": "cluster.running",
        "stopped": "cluster.stopped",
        "release-soon": "cluster.release_soon",
        "released": "cluster.released",
        "failed": "cluster.released",  # it could not run: ended, its state says failed
    },
    "job": {
        "queued": "job.queued",
        "running": "job.started",
        "succeeded": "job.succeeded",
        "failed": "job.failed",
        "cancelled": "job.cancelled",
        "preempted": "job.preempted",
    },
}


def sent_as(timeline: str, kind: str) -> str | None:
    """The webhook type an entry of this kind on this timeline ("cluster", "job") is sent
    as, None when it is not sent."""
    return SENT_AS.get(timeline, {}).get(kind)


def timeline_entry(subject: Cluster | Job, kind: str) -> WebhookEvent | None:
    """The webhook event of an entry just written on `subject`'s timeline (in the caller's
    transaction), when SENT_AS sends its kind; `subject` as it is now (its state and
    reason are sent). A stopped cluster's events say when it will be released
    (`release_at`, ISO 8601)."""
    event_type = sent_as("job" if isinstance(subject, Job) else "cluster", kind)
    if event_type is None:
        return None
    if isinstance(subject, Job):
        return emit(owner_id=subject.owner_id, event_type=event_type, data=job_data(subject))
    data = cluster_data(subject)
    if subject.stopped_at is not None and kind != "released":
        release_at = subject.stopped_at + timedelta(seconds=settings.SUANLI_STOPPED_RELEASE_S)
        data["cluster"]["release_at"] = release_at.isoformat()
    return emit(owner_id=subject.owner_id, event_type=event_type, data=data)


def emit(
    *, owner_id: int, event_type: str, data: dict, summary: Text | None = None, endpoints=None
) -> WebhookEvent | None:
    """Record an event and its deliveries in the caller's transaction; send after commit.
    Nothing is written when no enabled endpoint of the owner wants this type. `summary` says
    what happened in words (kept as msgid + arguments, shown in the reader's language by the
    channels that speak to people)."""
    if endpoints is None:
        endpoints = [
            pk
            for pk, wanted in WebhookEndpoint.objects.filter(
                owner_id=owner_id, enabled=True
            ).values_list("pk", "events")
            if event_type in (wanted or [])
        ]
    if not endpoints:
        return None
    now = timezone.now()
    event = WebhookEvent.objects.create(
        owner_id=owner_id,
        uid="msg_" + secrets.token_urlsafe(18),
        type=event_type,
        body=_body(event_type, data, now),
        summary=summary.as_json() if summary is not None else {},
        created_at=now,
    )
    deliveries = WebhookDelivery.objects.bulk_create(
        [WebhookDelivery(event=event, endpoint_id=pk, next_attempt_at=now) for pk in endpoints]
    )
    ids = [d.pk for d in deliveries]
    transaction.on_commit(lambda: [_enqueue(pk) for pk in ids])
    return event


def _enqueue(delivery_id: int, delay: timedelta | None = None) -> None:
    try:
        queue = django_rq.get_queue("webhooks")
        if delay:
            queue.enqueue_in(delay, DELIVER_TASK, delivery_id)
        else:
            queue.enqueue(DELIVER_TASK, delivery_id)
    except Exception:  # Redis away: the delivery row is pending; the sweep sends it
        log.warning("could not enqueue webhook delivery %s; the sweep will", delivery_id)


# -- what is reported ---------------------------------------------------------------------


def job_data(job: Job) -> dict:
    return {
        "job": {
            "id": job.pk, "name": job.name, "state": job.state, "state_reason": job.state_reason,
            "exit_code": job.exit_code, "attempt": job.attempt, "cluster": job.cluster_id,
            "preemptions": job.preemptions, "url": _link("job_detail", job.pk),
        },
        "cluster": {"id": job.cluster_id, "url": _link("cluster_detail", job.cluster_id)},
    }  # fmt: skip


def cluster_data(cluster: Cluster) -> dict:
    return {
        "cluster": {
            "id": cluster.pk, "name": cluster.name, "state": cluster.state,
            "state_reason": cluster.state_reason, "shape": cluster.shape,
            "url": _link("cluster_detail", cluster.pk),
        }
    }  # fmt: skip


def send_test(endpoint: WebhookEndpoint) -> WebhookEvent:
    with transaction.atomic():
        return emit(
            owner_id=endpoint.owner_id,
            event_type=TEST_EVENT,
            data={"endpoint": endpoint.pk, "message": "A test event from Suanli."},
            endpoints=[endpoint.pk],
        )


def redeliver(delivery: WebhookDelivery) -> WebhookDelivery:
    """A fresh delivery of the same event (same webhook-id) to the same endpoint."""
    with transaction.atomic():
        again = WebhookDelivery.objects.create(
            event_id=delivery.event_id, endpoint_id=delivery.endpoint_id
        )
        transaction.on_commit(lambda: _enqueue(again.pk))
    return again


def rotate(endpoint: WebhookEndpoint) -> str:
    """A new secret; the old one keeps signing (beside it) for 24 hours."""
    secret = new_secret()
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
        previous_secret=endpoint.secret,
        previous_valid_until=timezone.now() + timedelta(hours=24),
        secret=secret,
    )
    return secret


# -- delivery -----------------------------------------------------------------------------


def retry_delays() -> list[int]:
    return list(settings.SUANLI_WEBHOOK_RETRY_DELAYS)


def headers_for(endpoint: WebhookEndpoint, event: WebhookEvent, timestamp: int) -> dict:
    signatures = [sign(endpoint.secret, event.uid, timestamp, event.body)]
    if (
        endpoint.previous_secret
        and endpoint.previous_valid_until
        and (endpoint.previous_valid_until > timezone.now())
    ):
        signatures.append(sign(endpoint.previous_secret, event.uid, timestamp, event.body))
    return {
        "webhook-id": event.uid,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(signatures),
        "Content-Type": "application/json",
    }


def deliver(delivery_id: int) -> str:
    """One attempt of one delivery, if it is due and nobody else has it."""
    now = timezone.now()
    claimed = WebhookDelivery.objects.filter(
        pk=delivery_id, state=WebhookDelivery.State.PENDING, next_attempt_at__lte=now
    ).update(next_attempt_at=now + LEASE)
    if not claimed:
        return "not due"
    delivery = WebhookDelivery.objects.select_related("event", "endpoint").get(pk=delivery_id)
    endpoint, event = delivery.endpoint, delivery.event
    if not endpoint.enabled and event.type != TEST_EVENT:
        WebhookDelivery.objects.filter(pk=delivery_id).update(state=WebhookDelivery.State.DEAD)
        return "endpoint disabled"
    status, excerpt, error, latency = None, "", "", 0
    try:
        response = netguard.post(
            endpoint.url,
            event.body.encode(),
            headers_for(endpoint, event, int(now.timestamp())),
            timeout=settings.SUANLI_WEBHOOK_TIMEOUT_S,
        )
        status, excerpt, latency = response.status, response.body_excerpt, response.latency_ms
    except netguard.Refused as exc:
        error = f"refused: {exc}"
    except netguard.DeliveryFailed as exc:
        error = str(exc)
    return _record(delivery, status=status, excerpt=excerpt, error=error, latency=latency)


@transaction.atomic
def _record(delivery, *, status, excerpt, error, latency) -> str:
    now = timezone.now()
    endpoint = WebhookEndpoint.objects.select_for_update().get(pk=delivery.endpoint_id)
    WebhookAttempt.objects.create(
        delivery=delivery, at=now, status_code=status, latency_ms=latency,
        response_excerpt=fit(WebhookAttempt, "response_excerpt", excerpt),
        error=fit(WebhookAttempt, "error", error),
    )  # fmt: skip
    attempts = delivery.attempts + 1
    fields = {"attempts": attempts, "last_status": status}
    if status is not None and 200 <= status < 300:
        WebhookDelivery.objects.filter(pk=delivery.pk).update(
            state=WebhookDelivery.State.SUCCEEDED, **fields
        )
        WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
            failing_since=None, last_success_at=now
        )
        return "delivered"
    if status == 410:
        WebhookDelivery.objects.filter(pk=delivery.pk).update(
            state=WebhookDelivery.State.DEAD, **fields
        )
        _disable(endpoint, "the receiver answered 410 Gone")
        return "gone"
    failing_since = endpoint.failing_since or now
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(failing_since=failing_since)
    if (now - failing_since).total_seconds() >= settings.SUANLI_WEBHOOK_DISABLE_AFTER_S:
        WebhookDelivery.objects.filter(pk=delivery.pk).update(
            state=WebhookDelivery.State.DEAD, **fields
        )
        _disable(endpoint, f"failing since {failing_since:%Y-%m-%d %H:%M} UTC")
        return "disabled"
    delays = retry_delays()
    if attempts >= len(delays):
        WebhookDelivery.objects.filter(pk=delivery.pk).update(
            state=WebhookDelivery.State.DEAD, **fields
        )
        return "gave up"
    delay = timedelta(seconds=delays[attempts])
    WebhookDelivery.objects.filter(pk=delivery.pk).update(next_attempt_at=now + delay, **fields)
    transaction.on_commit(lambda: _enqueue(delivery.pk, delay))
    return "retry"


def _disable(endpoint: WebhookEndpoint, reason: str) -> None:
    WebhookEndpoint.objects.filter(pk=endpoint.pk).update(enabled=False, disabled_reason=reason)
    log.warning("webhook endpoint %s disabled: %s", endpoint.pk, reason)


def sweep(limit: int = 500) -> int:
    """Enqueue deliveries that are due (their enqueue was lost, or a lease ran out)."""
    due = list(
        WebhookDelivery.objects.filter(
            state=WebhookDelivery.State.PENDING, next_attempt_at__lte=timezone.now()
        ).values_list("pk", flat=True)[:limit]
    )
    for pk in due:
        _enqueue(pk)
    return len(due)

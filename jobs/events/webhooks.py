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

Channels (WebhookEndpoint.kind) share this outbox (one delivery row per event and channel,
claimed as above, its attempts on the log, the same retries and test message): `webhook` is
the signed JSON above; `email` sends the event's summary with Django's e-mail (an address other
than the account's own gets only its confirmation link until it is opened); the chat robots
`wecom`, `dingtalk` (optional signing: `timestamp` and `sign` in the query), `feishu`
(optional signing: `timestamp` and `sign` in the body), `slack` and `discord` get the summary
and a link as their incoming-webhook JSON. People's channels speak the owner's language
(console Preferences.language, else settings.LANGUAGE_CODE) and time zone.

The robots' payloads are formatted here rather than by apprise: apprise opens its own HTTP
connections (requests), so a robot's URL would be looked up again after our check (DNS
rebinding) and followed through redirects; every robot request goes out through netguard,
which connects to the very address it checked. The payloads are small and documented
(WeCom, DingTalk and Feishu group robots; Slack and Discord incoming webhooks).

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
from dataclasses import dataclass
from datetime import datetime, timedelta
from urllib.parse import quote_plus

import django_rq
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core import mail
from django.db import transaction
from django.db.models import Exists, OuterRef, Q
from django.urls import reverse
from django.utils import timezone, translation
from django.utils.module_loading import import_string
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, gettext_noop

from jobs.base.text import Duration, Moment, Text, fit, show, stored_reason
from jobs.events import netguard
from jobs.models import (
    Cluster,
    Job,
    Replica,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
)

log = logging.getLogger(__name__)

EVENT_TYPES = [value for value, _ in WebhookEndpoint.EVENTS]
TEST_EVENT = "webhook.test"
CONFIRM_EVENT = "notify.confirm"  # an e-mail channel's confirmation link, to it alone
Kind = WebhookEndpoint.Kind
ROBOTS = (Kind.WECOM, Kind.DINGTALK, Kind.FEISHU, Kind.SLACK, Kind.DISCORD)
LABELS = {
    **dict(WebhookEndpoint.EVENTS),
    TEST_EVENT: gettext_lazy("test message"),
    CONFIRM_EVENT: gettext_lazy("confirm this address"),
}
CONFIRMATIONS_PER_HOUR = 3  # confirmation links one researcher may have sent
RESENDS_PER_HOUR = 30  # test messages and redeliveries one researcher may ask for
TEXT_CHARS = 1500  # of a summary in a robot's message (WeCom takes 4096 bytes of markdown)
LEASE = timedelta(seconds=60)  # a claimed attempt not recorded by then is tried again
DELIVER_TASK = "jobs.tasks.webhook_deliver"  # by name: tasks sit above this module


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: str) -> str:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def console_link(name: str, *args) -> str:
    """The console's public address of the page `name` (a URL name): the `url` of events."""
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
        # A host problem that affects the cluster (lifecycle.host_unhealthy, a drain by the
        # operator): once per cluster for each change of the host's state, to its owner.
        "host-down": "host.problem",
        "host-degraded": "host.problem",
        "host-draining": "host.problem",
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


def timeline_entry(
    subject: Cluster | Job, kind: str, message: str | Text = "", *, endpoints=None
) -> WebhookEvent | None:
    """The webhook event of an entry just written on `subject`'s timeline (in the caller's
    transaction), when SENT_AS sends its kind; `subject` as it is now (its state and
    reason are sent), `message` the entry's words. Each event has its summary in words
    (`job_summary`, `cluster_summary`). A stopped cluster's events say when it will be
    released (`release_at`, ISO 8601); a job's end says how long it ran and what that cost
    (`job_end_data`); a host problem names the host (its display name only) and what
    happened. `endpoints`: the owner's `listeners` of it, when the caller has them."""
    event_type = sent_as("job" if isinstance(subject, Job) else "cluster", kind)
    if event_type is None:
        return None
    if isinstance(subject, Job):
        data = job_data(subject)
        if kind in Job.ENDED:
            data["job"].update(job_end_data(subject))
        summary = job_summary(subject, kind, data["job"])
        return emit(owner_id=subject.owner_id, event_type=event_type, data=data, summary=summary,
                    endpoints=endpoints)  # fmt: skip
    data = cluster_data(subject)
    release_at = subject.release_at if kind != "released" else None
    if release_at is not None:
        data["cluster"]["release_at"] = release_at.isoformat()
    if event_type == "host.problem":
        host = message.args.get("host") if isinstance(message, Text) else None
        data["host"] = {"name": str(host or ""), "state": kind.removeprefix("host-")}
        data["problem"] = str(message)
    summary = cluster_summary(subject, kind, message, release_at)
    return emit(owner_id=subject.owner_id, event_type=event_type, data=data, summary=summary,
                endpoints=endpoints)  # fmt: skip


def listeners(owner_id: int, event_type: str) -> list[int]:
    """The owner's channels an event of `event_type` would go to now: enabled, wanting it,
    and (an e-mail address) confirmed. Empty: nobody would be told."""
    return [
        pk
        for pk, wanted in WebhookEndpoint.objects.filter(owner_id=owner_id, enabled=True)
        .exclude(kind=Kind.EMAIL, confirmed_at__isnull=True)
        .values_list("pk", "events")
        if event_type in (wanted or [])
    ]


def listening(owner_ids, event_type: str) -> dict[int, list[int]]:
    """`listeners` of many owners in one query: owner id -> their channels that an event of
    `event_type` would go to now (owners with none left out)."""
    out: dict[int, list[int]] = {}
    rows = (
        WebhookEndpoint.objects.filter(owner_id__in=set(owner_ids), enabled=True)
        .exclude(kind=Kind.EMAIL, confirmed_at__isnull=True)
        .order_by("pk")
        .values_list("owner_id", "pk", "events")
    )
    for owner_id, pk, wanted in rows:
        if event_type in (wanted or []):
            out.setdefault(owner_id, []).append(pk)
    return out


def emit(
    *, owner_id: int, event_type: str, data: dict, summary: Text | None = None, endpoints=None
) -> WebhookEvent | None:
    """Record an event and its deliveries in the caller's transaction; send after commit.
    Nothing is written when no enabled endpoint of the owner wants this type. `summary` says
    what happened in words (kept as msgid + arguments, shown in the reader's language by the
    channels that speak to people)."""
    if endpoints is None:
        endpoints = listeners(owner_id, event_type)
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
            "preemptions": job.preemptions, "url": console_link("job_detail", job.pk),
        },
        "cluster": {"id": job.cluster_id, "url": console_link("cluster_detail", job.cluster_id)},
    }  # fmt: skip


def cluster_data(cluster: Cluster) -> dict:
    return {
        "cluster": {
            "id": cluster.pk, "name": cluster.name, "state": cluster.state,
            "state_reason": cluster.state_reason, "shape": cluster.shape,
            "url": console_link("cluster_detail", cluster.pk),
        }
    }  # fmt: skip


# What a job's runs cost: billing's estimate, asked by name (billing sits above jobs, which
# never imports it): `(cluster, spans)` -> {"amount": "12.4000", "currency": "CNY", "shown":
# "¥12.40"}, or None when the cluster's shape has no price. Billing charges a cluster for
# holding its GPUs, not per job: this is the cluster's price x its GPUs x the job's run time.
RUN_COST = "billing.estimates.run_cost"


def runs(job: Job, *, now: datetime | None = None) -> list[tuple]:
    """When each attempt of `job` ran, oldest first: its replicas' first start to their last
    end (the job's end, or now, for a replica not ended). Attempts that never ran a
    container are left out. Also what billing's projections (billing/projections.py) price
    as a job's cost so far."""
    return runs_of([job], now=now)[job.pk]


def runs_of(jobs, *, now: datetime | None = None) -> dict[int, list[tuple]]:
    """`runs` of many jobs in one query: job id -> its attempts' spans (a live page or a
    tick prices many jobs at once)."""
    now = now or timezone.now()
    ended = {job.pk: job.finished_at for job in jobs}
    spans: dict[int, dict[int, tuple]] = {pk: {} for pk in ended}
    if not ended:
        return {}
    rows = Replica.objects.filter(job_id__in=list(ended), started_at__isnull=False).values_list(
        "job_id", "attempt", "started_at", "finished_at"
    )
    for job_id, attempt, started, finished in rows:
        end = max(finished or ended[job_id] or now, started)
        first, last = spans[job_id].get(attempt, (started, end))
        spans[job_id][attempt] = (min(first, started), max(last, end))
    return {pk: [one[a] for a in sorted(one)] for pk, one in spans.items()}


def job_end_data(job: Job) -> dict:
    """What a job's end adds to its event: when it started (its first attempt's run) and
    ended, how long that was (`duration_s`, and `duration` in English words) and what its
    runs cost (`cost`: `amount` a decimal string, `currency`, `estimated`; None without a
    price). A job that never ran has no start or duration, and costs nothing."""
    spans = runs(job)
    ended = job.finished_at or timezone.now()
    started = spans[0][0] if spans else None
    seconds = max(int((ended - started).total_seconds()), 0) if started else None
    try:
        cost = import_string(RUN_COST)(job.cluster, spans)
    except ImportError:  # a deployment without billing: no price to say
        cost = None
    return {
        "started_at": started.isoformat() if started else None,
        "finished_at": ended.isoformat(),
        "duration_s": seconds,
        "duration": str(Duration(seconds)) if seconds is not None else None,
        "cost": None if cost is None else {
            "amount": cost["amount"], "currency": cost["currency"], "estimated": True,
            "shown": cost["shown"],
        },
    }  # fmt: skip


# A job's event in words, by its timeline's kind; a job that ended before it ran says so.
JOB_WORDS = {
    "queued": gettext_noop("Job %(job)s is queued on cluster %(cluster)s: %(url)s"),
    "running": gettext_noop("Job %(job)s started on cluster %(cluster)s: %(url)s"),
    "preempted": gettext_noop("Job %(job)s on cluster %(cluster)s: %(reason)s: %(url)s"),
    "succeeded": gettext_noop(
        "Job %(job)s on cluster %(cluster)s succeeded in %(duration)s%(cost)s: %(url)s"
    ),
    "failed": gettext_noop(
        "Job %(job)s on cluster %(cluster)s failed after %(duration)s%(cost)s: %(reason)s: %(url)s"
    ),
    "cancelled": gettext_noop(  # its reason says who cancelled it ("cancelled by alice")
        "Job %(job)s on cluster %(cluster)s ended after %(duration)s%(cost)s: %(reason)s: %(url)s"
    ),
}
NEVER_RAN_WORDS = {
    "succeeded": gettext_noop("Job %(job)s on cluster %(cluster)s succeeded: %(url)s"),
    "failed": gettext_noop(
        "Job %(job)s on cluster %(cluster)s failed before it ran: %(reason)s: %(url)s"
    ),
    "cancelled": gettext_noop(
        "Job %(job)s on cluster %(cluster)s ended before it ran: %(reason)s: %(url)s"
    ),
}


def job_summary(job: Job, kind: str, facts: dict) -> Text:
    """The sentence a person reads for a job's event: "Job train-7 on cluster lab-a
    succeeded in 1 h 2 min, cost about ¥12.40: <link>". `facts`: the event's job data."""
    ran = facts.get("duration_s") is not None
    msgid = JOB_WORDS[kind] if ran or kind not in NEVER_RAN_WORDS else NEVER_RAN_WORDS[kind]
    cost = facts.get("cost")
    return Text(
        msgid,
        job=job.name,
        cluster=job.cluster.name,
        url=facts["url"],
        reason=stored_reason(job) or Text(job.state),
        duration=Duration(facts.get("duration_s") or 0),
        cost=Text(gettext_noop(", cost about %(amount)s"), amount=cost["shown"]) if cost else "",
    )


# A cluster's event in words, by its timeline's kind (and whether it has a reason to say).
# A stop's reason is itself the verb ("stopped by alice", "stopped: balance exhausted"); a
# release's may be ("released by its owner"), so it follows "ended", never "was released".
CLUSTER_WORDS = {
    "running": gettext_noop("Cluster %(cluster)s (%(shape)s) is running: %(url)s"),
    "stopped": gettext_noop(
        "Cluster %(cluster)s %(reason)s; its files are kept until %(release_at)s: %(url)s"
    ),
    "release-soon": gettext_noop(
        "Cluster %(cluster)s, stopped, is released with its files at %(release_at)s; start it "
        "or copy what you need before then: %(url)s"
    ),
    "released": gettext_noop("Cluster %(cluster)s ended: %(reason)s: %(url)s"),
    # its reason says it never ran ("could not start (nothing was charged): ...")
    "failed": gettext_noop("Cluster %(cluster)s ended: %(reason)s: %(url)s"),
    "host": gettext_noop("A host problem affects your cluster %(cluster)s: %(reason)s: %(url)s"),
}
CLUSTER_WORDS_NO_REASON = {
    "stopped": gettext_noop(
        "Cluster %(cluster)s was stopped; its files are kept until %(release_at)s: %(url)s"
    ),
    "released": gettext_noop("Cluster %(cluster)s was released: %(url)s"),
    "failed": gettext_noop("Cluster %(cluster)s could not run: %(url)s"),
}


def cluster_summary(cluster: Cluster, kind: str, message: str | Text, release_at) -> Text:
    """The sentence a person reads for a cluster's event: "Cluster lab-a stopped: balance
    exhausted; its files are kept until 2026-12-21 10:00 CST: <link>". A host problem says
    the timeline's words (they name the host by its display name)."""
    key = "host" if kind.startswith("host-") else kind
    reason = message if key == "host" else stored_reason(cluster)
    msgid = CLUSTER_WORDS[key]
    if not reason and key in CLUSTER_WORDS_NO_REASON:
        msgid = CLUSTER_WORDS_NO_REASON[key]
    return Text(
        msgid,
        cluster=cluster.name,
        shape=cluster.shape,
        reason=reason or "",
        release_at=Moment(release_at) if release_at is not None else "",
        url=console_link("cluster_detail", cluster.pk),
    )


def send_test(endpoint: WebhookEndpoint) -> WebhookEvent:
    with transaction.atomic():
        return emit(
            owner_id=endpoint.owner_id,
            event_type=TEST_EVENT,
            data={"endpoint": endpoint.pk, "message": "A test event from Suanli.",
                  "url": console_link("webhook_detail", endpoint.pk)},
            summary=Text(gettext_noop("A test message from Suanli: this channel works.")),
            endpoints=[endpoint.pk],
        )  # fmt: skip


def _not_first() -> Exists:
    """A delivery row that is not its event's first to its channel: a redelivery."""
    return Exists(
        WebhookDelivery.objects.filter(
            event_id=OuterRef("event_id"),
            endpoint_id=OuterRef("endpoint_id"),
            pk__lt=OuterRef("pk"),
        )
    )


def may_resend(owner_id: int) -> bool:
    """Whether the owner may send another test message or redelivery: at most
    RESENDS_PER_HOUR an hour (each is a request to a receiver or a mail server of
    hers, so a loop of them would make Suanli flood it). Counted from the delivery rows
    the test button and redeliver made in the last hour."""
    since = timezone.now() - timedelta(hours=1)
    made = WebhookDelivery.objects.filter(endpoint__owner_id=owner_id, created_at__gte=since)
    made = made.filter(Q(event__type=TEST_EVENT) | _not_first())
    return made.count() < RESENDS_PER_HOUR


def may_ask_confirmation(owner_id: int) -> bool:
    """Whether the owner may have another confirmation link sent: at most
    CONFIRMATIONS_PER_HOUR an hour, so that nobody mails a stranger links in a loop."""
    since = timezone.now() - timedelta(hours=1)
    sent = WebhookEvent.objects.filter(owner_id=owner_id, type=CONFIRM_EVENT, created_at__gte=since)
    return sent.count() < CONFIRMATIONS_PER_HOUR


def ask_confirmation(endpoint: WebhookEndpoint) -> WebhookEvent:
    """A new confirmation link for an e-mail channel (the old one stops working), e-mailed to
    the address alone. The link is not in the event (its owner reads the event on the log):
    the e-mail reads it from the channel when it is sent."""
    with transaction.atomic():
        token = secrets.token_urlsafe(24)
        WebhookEndpoint.objects.filter(pk=endpoint.pk).update(
            confirm_token=token, confirmed_at=None
        )
        endpoint.confirm_token, endpoint.confirmed_at = token, None
        return emit(
            owner_id=endpoint.owner_id,
            event_type=CONFIRM_EVENT,
            data={"endpoint": endpoint.pk, "address": endpoint.url},
            summary=Text(gettext_noop("Confirmation link sent to %(address)s."),
                         address=endpoint.url),
            endpoints=[endpoint.pk],
        )  # fmt: skip


def confirm(endpoint_id: int, token: str) -> WebhookEndpoint | None:
    """Confirm an e-mail channel by its link, once; None for a wrong or used link."""
    endpoint = WebhookEndpoint.objects.filter(pk=endpoint_id, kind=Kind.EMAIL).first()
    if endpoint is None or not endpoint.confirm_token or not token:
        return None
    if not hmac.compare_digest(endpoint.confirm_token.encode(), token.encode()):
        return None
    claimed = WebhookEndpoint.objects.filter(pk=endpoint.pk, confirmed_at__isnull=True).update(
        confirmed_at=timezone.now(), confirm_token=""
    )
    return endpoint if claimed else None


def redeliver(delivery: WebhookDelivery) -> WebhookDelivery:
    """A fresh delivery of the same event (same webhook-id) to the same endpoint. Never a
    confirmation link (ask_confirmation sends a new one, within its hourly limit)."""
    if delivery.event.type == CONFIRM_EVENT:
        raise ValueError("a confirmation link is never sent again")
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


# -- what people read ---------------------------------------------------------------------


@dataclass
class Message:
    """An event in words, in the language active when it was made."""

    title: str  # "Suanli: job failed"
    text: str  # the summary, or a fallback for events without one
    url: str  # where to look ("" when the event has no link)


def owner_locale(owner_id: int) -> tuple[str, str]:
    """The language and time zone the owner reads in: their saved preferences, else the
    site's language and that language's usual zone (as console/preferences.py decides)."""
    row = (
        get_user_model()
        .objects.filter(pk=owner_id)
        .values_list("preferences__language", "preferences__time_zone")
        .first()
    )
    language, zone = row or ("", "")
    language = language or settings.LANGUAGE_CODE
    if not zone:
        zone = "Asia/Shanghai" if language.startswith("zh") else settings.TIME_ZONE
    return language, zone


def _data(event: WebhookEvent) -> dict:
    try:
        data = json.loads(event.body).get("data")
    except (ValueError, AttributeError):
        return {}
    return data if isinstance(data, dict) else {}


def _url_of(data: dict) -> str:
    for where in (data, data.get("job"), data.get("cluster")):
        if isinstance(where, dict) and isinstance(where.get("url"), str):
            return where["url"]
    return ""


def words(event: WebhookEvent) -> str:
    """What happened, in the active language: the event's summary, or for an event written
    without one (older events) its type and the job's or cluster's name."""
    if event.summary:
        return show(event.summary)
    label = str(LABELS.get(event.type, event.type))
    data = _data(event)
    for subject in ("job", "cluster"):
        name = data.get(subject, {}).get("name") if isinstance(data.get(subject), dict) else ""
        if name:
            return _("%(event)s: %(name)s") % {"event": label, "name": name}
    return label


def message(event: WebhookEvent) -> Message:
    """The event's title, words and link; no link beside words that already end with it."""
    label, text, url = str(LABELS.get(event.type, event.type)), words(event), _url_of(_data(event))
    return Message(
        title=_("Suanli: %(event)s") % {"event": label}, text=text, url="" if url in text else url
    )


def robot_request(endpoint: WebhookEndpoint, msg: Message, now_ms: int) -> tuple[str, bytes]:
    """The URL and JSON body a chat robot takes for `msg` (signed when it has a secret)."""
    url, text, opened = endpoint.url, msg.text[:TEXT_CHARS], _("Open in Suanli")
    kind = endpoint.kind
    if kind == Kind.WECOM:
        content = f"**{msg.title}**\n{text}"
        if msg.url:
            content += f"\n[{opened}]({msg.url})"
        body = {"msgtype": "markdown", "markdown": {"content": content}}
    elif kind == Kind.DINGTALK:
        content = f"#### {msg.title}\n\n{text}"
        if msg.url:
            content += f"\n\n[{opened}]({msg.url})"
        body = {"msgtype": "markdown", "markdown": {"title": msg.title, "text": content}}
        if endpoint.secret:
            sign = quote_plus(dingtalk_sign(endpoint.secret, now_ms))
            url += ("&" if "?" in url else "?") + f"timestamp={now_ms}&sign={sign}"
    elif kind == Kind.FEISHU:
        lines = [msg.title, text] + ([msg.url] if msg.url else [])
        body = {"msg_type": "text", "content": {"text": "\n".join(lines)}}
        if endpoint.secret:
            seconds = now_ms // 1000
            body = {"timestamp": str(seconds), "sign": feishu_sign(endpoint.secret, seconds),
                    **body}  # fmt: skip
    elif kind == Kind.SLACK:
        esc = _slack_escape
        lines = [f"*{esc(msg.title)}*", esc(text)] + (
            [f"<{msg.url}|{esc(opened)}>"] if msg.url else []
        )
        body = {"text": "\n".join(lines)}
    elif kind == Kind.DISCORD:
        lines = [f"**{msg.title}**", text] + ([msg.url] if msg.url else [])
        body = {"content": "\n".join(lines)[:2000], "allowed_mentions": {"parse": []}}
    else:
        raise ValueError(f"{kind} is not a chat robot")
    return url, json.dumps(body, separators=(",", ":")).encode()


def _slack_escape(words: str) -> str:
    return words.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def dingtalk_sign(secret: str, timestamp_ms: int) -> str:
    """DingTalk's robot signature: base64 HMAC-SHA256 of "timestamp\\nsecret", keyed by the
    secret (the URL carries it quoted)."""
    mac = hmac.new(secret.encode(), f"{timestamp_ms}\n{secret}".encode(), hashlib.sha256)
    return base64.b64encode(mac.digest()).decode()


def feishu_sign(secret: str, timestamp_s: int) -> str:
    """Feishu's robot signature: base64 HMAC-SHA256 keyed by "timestamp\\nsecret" of nothing."""
    mac = hmac.new(f"{timestamp_s}\n{secret}".encode(), b"", hashlib.sha256)
    return base64.b64encode(mac.digest()).decode()


def _robot_refusal(excerpt: str) -> str:
    """What a robot said when it answered 200 but took nothing (WeCom and DingTalk put
    `errcode`, Feishu `code`, in the body); "" when it took the message."""
    try:
        answer = json.loads(excerpt)
    except ValueError:
        return ""
    if not isinstance(answer, dict):
        return ""
    for code, words_of in (("errcode", "errmsg"), ("code", "msg"), ("StatusCode", "StatusMessage")):
        if answer.get(code) not in (None, 0):
            return f"the robot refused it: {answer.get(code)} {answer.get(words_of, '')}".strip()
    return ""


def _email(endpoint: WebhookEndpoint, event: WebhookEvent, msg: Message) -> tuple[str, str]:
    """Subject and body of the e-mail for `event`, in the active language."""
    manage = console_link("webhooks")
    if event.type == CONFIRM_EVENT:
        link = console_link("notify_confirm", endpoint.pk, endpoint.confirm_token)
        # No username here: a name is the asker's to choose ("www.evil-login.com" would
        # read as a link); the console's own address says who sends this.
        subject = _("Suanli: confirm notifications to this address")
        body = _(
            "A Suanli account on %(console)s asked to send its notifications to "
            "%(address)s.\n\n"
            "Open this link to confirm; until then nothing else is sent here:\n%(link)s\n\n"
            "If you did not expect this, ignore this e-mail: no notifications are sent to "
            "this address unless the link is opened."
        ) % {"console": settings.SUANLI_PUBLIC_URL.rstrip("/"), "address": endpoint.url,
             "link": link}  # fmt: skip
        return subject, body
    body = msg.text + (f"\n\n{msg.url}" if msg.url else "")
    body += "\n\n-- \n" + _("Choose which events come here: %(link)s") % {"link": manage}
    return msg.title, body


def _send(endpoint: WebhookEndpoint, event: WebhookEvent, now) -> dict:
    """One try at a channel: status, excerpt, error, latency and whether it arrived."""
    if endpoint.kind == Kind.WEBHOOK:
        url, body = endpoint.url, event.body.encode()
        headers = headers_for(endpoint, event, int(now.timestamp()))
    else:
        language, zone = owner_locale(event.owner_id)
        with translation.override(language), timezone.override(zone):
            msg = message(event)
            if endpoint.kind == Kind.EMAIL:
                subject, text = _email(endpoint, event, msg)
            else:
                url, body = robot_request(endpoint, msg, int(now.timestamp() * 1000))
                headers = {"Content-Type": "application/json"}
    if endpoint.kind == Kind.EMAIL:
        started = timezone.now()
        try:
            mail.EmailMessage(subject, text, settings.DEFAULT_FROM_EMAIL, [endpoint.url]).send()
        except (OSError, ValueError) as exc:  # smtplib: OSErrors; a bad header: ValueError
            return {"status": None, "error": f"e-mail not sent: {exc}"[:300]}
        latency = int((timezone.now() - started).total_seconds() * 1000)
        return {"status": None, "ok": True, "excerpt": "250 accepted by the mail server",
                "latency": latency}  # fmt: skip
    try:
        response = netguard.post(url, body, headers, timeout=settings.SUANLI_WEBHOOK_TIMEOUT_S)
    except netguard.Refused as exc:
        return {"status": None, "error": f"refused: {exc}"}
    except netguard.DeliveryFailed as exc:
        return {"status": None, "error": str(exc)}
    result = {"status": response.status, "excerpt": response.body_excerpt,
              "latency": response.latency_ms}  # fmt: skip
    if endpoint.kind in ROBOTS and 200 <= response.status < 300:
        refusal = _robot_refusal(response.body_excerpt)
        if refusal:
            result.update(ok=False, error=refusal)
    return result


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
    if not endpoint.enabled and event.type not in (TEST_EVENT, CONFIRM_EVENT):
        # a channel added disabled still gets its address confirmed, never an event
        WebhookDelivery.objects.filter(pk=delivery_id).update(state=WebhookDelivery.State.DEAD)
        return "endpoint disabled"
    if (
        endpoint.kind == Kind.EMAIL
        and endpoint.confirmed_at is None
        and event.type != CONFIRM_EVENT
    ):  # nothing but the confirmation goes to an address not confirmed
        WebhookAttempt.objects.create(delivery=delivery, error="the address is not confirmed yet")
        WebhookDelivery.objects.filter(pk=delivery_id).update(state=WebhookDelivery.State.DEAD)
        return "not confirmed"
    if (
        event.type == CONFIRM_EVENT
        and WebhookDelivery.objects.filter(event_id=event.pk, pk__lt=delivery.pk).exists()
    ):  # a confirmation link goes out once, by its event's first delivery
        WebhookAttempt.objects.create(delivery=delivery, error="a confirmation is sent once")
        WebhookDelivery.objects.filter(pk=delivery_id).update(state=WebhookDelivery.State.DEAD)
        return "sent once"
    return _record(delivery, **_send(endpoint, event, now))


@transaction.atomic
def _record(delivery, *, status, excerpt="", error="", latency=0, ok=None) -> str:
    """Write one attempt and what follows from it. `ok` None: a 2xx status is success."""
    now = timezone.now()
    endpoint = WebhookEndpoint.objects.select_for_update().get(pk=delivery.endpoint_id)
    WebhookAttempt.objects.create(
        delivery=delivery, at=now, status_code=status, latency_ms=latency,
        response_excerpt=fit(WebhookAttempt, "response_excerpt", excerpt),
        error=fit(WebhookAttempt, "error", error),
    )  # fmt: skip
    attempts = delivery.attempts + 1
    fields = {"attempts": attempts, "last_status": status}
    if ok is None:
        ok = status is not None and 200 <= status < 300
    if ok:
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

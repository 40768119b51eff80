"""The one writer of timeline entries and state reasons.

Every line of a cluster's, job's or pool's timeline (ClusterEvent, JobEvent, PoolEvent) and
every state reason of a cluster or job is written here, in the caller's transaction:

- the English is cut to what the model's field keeps (its `max_length`, read from the field:
  `jobs.base.text.fit`), so a 5,000-character engine error is never a database error;
- a Text is also kept as its msgid and arguments (the `text` / `state_reason_text` twin),
  shown later in the reader's language, each plain argument cut to the same length;
- whether an entry goes out as a webhook, and as which type, is decided by one table,
  `webhooks.SENT_AS`, next to `webhooks.emit`; nothing else sends a timeline's webhooks.

    cluster_event(cluster, "released", Text(gettext_noop("capacity returned")))
    Job.objects.filter(pk=job.pk).update(state=..., **reason_fields(Job, why))

Layer: events (uses webhooks, models and base).
"""

from django.utils import timezone

from jobs.base.text import Text, fit, json_of, limit_of, twin_fields
from jobs.events import webhooks
from jobs.models import Cluster, ClusterEvent, Job, JobEvent, Pool, PoolEvent


def _id(subject) -> int:
    return subject if isinstance(subject, int) else subject.pk


def text_of(event_model, message: str | Text) -> dict | None:
    """What an entry of `event_model` keeps in its `text` field for `message` (None for
    plain words): to compare with a stored entry's."""
    return json_of(message, limit_of(event_model, "message"))


def cluster_event(cluster: Cluster | int, kind: str, message: str | Text = "", at=None) -> None:
    """One line of the cluster's timeline, and its webhook event when SENT_AS sends `kind`
    (with the cluster as it is now)."""
    cluster_events([(cluster, kind, message)], at=at)


def cluster_events(entries: list[tuple[Cluster | int, str, str | Text]], at=None) -> None:
    """Several lines at once (one INSERT; a placement pass's "running" lines), each
    `(cluster, kind, message)`, with their webhook events."""
    if not entries:
        return
    at = at or timezone.now()
    ClusterEvent.objects.bulk_create(
        [
            ClusterEvent(
                cluster_id=_id(cluster),
                kind=kind,
                message=fit(ClusterEvent, "message", message),
                text=text_of(ClusterEvent, message),
                at=at,
            )
            for cluster, kind, message in entries
        ]
    )
    sent = [
        (_id(cluster), kind, message)
        for cluster, kind, message in entries
        if webhooks.sent_as("cluster", kind)
    ]
    if not sent:
        return
    # Whose channels want them, in one query a webhook type (a placement pass writes
    # hundreds of lines at once, mostly of owners with no channel): only the clusters of
    # listening owners are read again, as they are now.
    owner_of = {c.pk: c.owner_id for c, _, _ in entries if isinstance(c, Cluster)}
    unknown = {pk for pk, _, _ in sent if pk not in owner_of}
    if unknown:
        owner_of.update(Cluster.objects.filter(pk__in=unknown).values_list("pk", "owner_id"))
    owners = {owner_of[pk] for pk, _, _ in sent if pk in owner_of}
    listening = {
        event_type: webhooks.listening(owners, event_type)
        for event_type in {webhooks.sent_as("cluster", kind) for _, kind, _ in sent}
    }
    sent = [
        (pk, kind, message, endpoints)
        for pk, kind, message in sent
        if (endpoints := listening[webhooks.sent_as("cluster", kind)].get(owner_of.get(pk)))
    ]
    if not sent:
        return
    now = Cluster.objects.select_related("gpu_model", "instance_type").in_bulk(
        [pk for pk, _, _, _ in sent]
    )
    for pk, kind, message, endpoints in sent:
        webhooks.timeline_entry(now[pk], kind, message, endpoints=endpoints)


def job_event(job: Job | int, kind: str, message: str | Text = "", at=None) -> None:
    """One line of the job's timeline, and its webhook event when SENT_AS sends `kind`
    (with the job as it is now)."""
    job_id = _id(job)
    JobEvent.objects.create(
        job_id=job_id,
        kind=kind,
        message=fit(JobEvent, "message", message),
        text=text_of(JobEvent, message),
        at=at or timezone.now(),
    )
    if webhooks.sent_as("job", kind):
        webhooks.timeline_entry(Job.objects.select_related("cluster").get(pk=job_id), kind, message)


def pool_event(
    pool: Pool | int, kind: str, message: str | Text, figures: dict | None = None
) -> PoolEvent:
    """One line of the pool's timeline (a decision to add or release a cluster, and the
    figures it used). A pool's timeline sends no webhooks (SENT_AS has none)."""
    return PoolEvent.objects.create(
        pool_id=_id(pool),
        kind=kind,
        message=fit(PoolEvent, "message", message),
        text=text_of(PoolEvent, message),
        figures=figures or {},
    )


# -- state reasons ------------------------------------------------------------------------------


def reason_fields(model, message: str | Text) -> dict:
    """The fields of a Cluster's or Job's state reason: `state_reason`, its English cut to
    the model's field, and `state_reason_text`, its twin (None for plain words), e.g.
    `.update(state=..., **reason_fields(Job, why))`. An empty message clears both."""
    return twin_fields(model, "state_reason", message)


def reason_passed(model, pk: int, msgid: str) -> bool:
    """Clear a Cluster's or Job's state reason when it still says a Text of `msgid`, what
    has passed meanwhile (e.g. its nodes "to be moved" are all placed again): True when it
    did. Any other reason, written since, stays."""
    return bool(
        model.objects.filter(pk=pk, state_reason_text__m=msgid).update(**reason_fields(model, ""))
    )


def set_reason(obj: Cluster | Job, message: str | Text) -> list[str]:
    """Set an (unsaved) Cluster's or Job's state reason and its twin; the fields set, for
    `save(update_fields=...)`."""
    fields = reason_fields(obj, message)
    for name, value in fields.items():
        setattr(obj, name, value)
    return list(fields)

"""`{% load timeline %}`: a timeline event in the reader's language.

`{{ e|event_text }}`: the event's words (jobs.base.text: stored as a msgid and its arguments,
rendered now; older events without one show their English `message`).
`{{ e.kind|event_kind }}`: the short label of its kind (the CSS class keeps the slug).
`{{ cluster|reason_text }}`: a Cluster's or Job's state reason (its `state_reason_text`,
else the English `state_reason` of older rows and plain words).
`{{ cluster|release_in }}`: how long a stopped cluster is kept yet ("14 days 3 h")."""

import json

from django import template
from django.utils import timezone
from django.utils.translation import gettext_lazy

from jobs.base import text
from jobs.models import Cluster

register = template.Library()

KINDS = {
    # clusters
    "pending": gettext_lazy("pending"),
    "waiting": gettext_lazy("waiting"),
    "running": gettext_lazy("running"),
    "resized": gettext_lazy("resized"),
    "moved": gettext_lazy("moved"),
    "stopping": gettext_lazy("stopping"),
    "stopped": gettext_lazy("stopped"),
    "starting": gettext_lazy("starting"),
    "resuming": gettext_lazy("resuming"),
    "releasing": gettext_lazy("releasing"),
    "released": gettext_lazy("released"),
    "release-soon": gettext_lazy("release soon"),
    "failed": gettext_lazy("failed"),
    "preempting": gettext_lazy("preempting"),
    "preempted": gettext_lazy("preempted"),
    "pulling": gettext_lazy("pulling"),
    "pulled": gettext_lazy("pulled"),
    "pull-failed": gettext_lazy("pull failed"),
    "ssh": gettext_lazy("SSH"),
    "key-attached": gettext_lazy("key attached"),
    "key-detached": gettext_lazy("key detached"),
    "terminal": gettext_lazy("terminal"),
    "host-failed": gettext_lazy("host failed"),
    "host-lost": gettext_lazy("host lost"),
    "host-back": gettext_lazy("host back"),
    "host-active": gettext_lazy("host active"),
    "host-draining": gettext_lazy("host draining"),
    "host-degraded": gettext_lazy("host degraded"),
    "host-down": gettext_lazy("host down"),
    "handed": gettext_lazy("handed on"),
    "member-added": gettext_lazy("person added"),
    "member-removed": gettext_lazy("person removed"),
    # jobs
    "queued": gettext_lazy("queued"),
    "succeeded": gettext_lazy("succeeded"),
    "cancelling": gettext_lazy("cancelling"),
    "cancelled": gettext_lazy("cancelled"),
    "requeued": gettext_lazy("requeued"),
    "retrying": gettext_lazy("retrying"),
    "timeout": gettext_lazy("timeout"),
    "lost": gettext_lazy("lost"),
    "notice": gettext_lazy("notice"),
    "budget": gettext_lazy("budget"),  # billing/budgets.py: its early warning, its stop
    "error": gettext_lazy("error"),
    # pools
    "created": gettext_lazy("created"),
    "grow": gettext_lazy("added"),
    "held": gettext_lazy("held back"),
    "shrink": gettext_lazy("removed"),
    "closed": gettext_lazy("closed"),
}


@register.filter
def event_text(event) -> str:
    """A ClusterEvent or JobEvent's words in the active language."""
    data = getattr(event, "text", None)
    if data:
        return text.show(data)
    return getattr(event, "message", "")


@register.filter
def note_text(obj) -> str:
    """A Sweep's or Trial's note in the active language."""
    data = getattr(obj, "note_text", None)
    if data:
        return text.show(data)
    return getattr(obj, "note", "")


@register.filter
def event_kind(kind) -> str:
    """The translated short label of an event kind; an unknown kind is its slug."""
    label = KINDS.get(kind)
    return str(label) if label is not None else kind


@register.filter
def reason_text(obj) -> str:
    """A Cluster's or Job's state reason in the active language."""
    data = getattr(obj, "state_reason_text", None)
    if data:
        return text.show(data)
    return getattr(obj, "state_reason", "")


@register.filter
def said(value) -> str:
    """`{{ c.why|said }}`: a Text composed now (jobs.base.text) in the active language."""
    return text.show(value.as_json()) if isinstance(value, text.Text) else str(value or "")


@register.filter
def state_label(obj, value=None) -> str:
    """`{{ build|state_label:progress.state }}`: a state's label from the object's model's
    State choices (its own state when no value is given); an unknown value as it is."""
    value = getattr(obj, "state", "") if value is None else value
    return str(dict(type(obj).State.choices).get(value, value))


@register.filter
def state_labels(obj) -> str:
    """`data-labels="{{ job|state_labels }}"`: every state's label as JSON, for a script that
    redraws the badge (static/js/build_log.js, the job page)."""
    return json.dumps({value: str(label) for value, label in type(obj).State.choices})


@register.filter
def cluster_state(value: str) -> str:
    """`{{ row.cluster__state|cluster_state }}`: a cluster's state from a values() row."""
    return str(dict(Cluster.State.choices).get(value, value))


@register.filter
def release_in(cluster) -> str:
    """`{{ cluster|release_in }}`: how long until a stopped cluster (or one waiting in line
    to start again) is released with its workspaces (`Cluster.release_at`: "14 days 3 h",
    "14 天 3 小时"); "" when it is not stopped."""
    at = getattr(cluster, "release_at", None)
    if at is None:
        return ""
    return text.duration(max((at - timezone.now()).total_seconds(), 0))

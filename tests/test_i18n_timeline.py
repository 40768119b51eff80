"""Timeline events keep their English `message` (the API, webhooks) and are shown in the
reader's language from their stored msgid and arguments (jobs.base.text)."""

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from django.utils import timezone, translation
from django.utils.translation import gettext_noop

from console.templatetags.timeline import event_kind, event_text
from jobs.base.text import Moment, Text, load, show
from jobs.clusters import services


def test_cluster_timeline_event_renders_in_the_readers_language(alice, make_cluster):
    cluster = make_cluster(alice, "c1")
    services.cluster_release(cluster=cluster)
    requested = cluster.events.get(kind="pending")
    released = cluster.events.get(kind="released")
    assert requested.message == f"requested {cluster.shape}"
    assert requested.text == {"m": "requested %(shape)s", "a": {"shape": cluster.shape}}
    with translation.override("en"):
        assert event_text(requested) == f"requested {cluster.shape}"
        assert event_text(released) == "released by its owner"
        assert event_kind("pending") == "pending"
    with translation.override("zh-hans"):
        assert event_text(requested) == f"已申请 {cluster.shape}"
        assert event_text(released) == "由所有者释放"
        assert event_kind("pending") == "等待中"
        assert event_kind("no-such-kind") == "no-such-kind"
    # The stored English stays English in any language.
    with translation.override("zh-hans"):
        released.refresh_from_db()
        assert released.message == "released by its owner"


def test_a_time_inside_an_event_reads_in_the_readers_zone():
    """Stored as a moment, not as words: UTC in the English `message`, the reader's own
    zone (with its name) on their page."""
    stopped = datetime(2026, 12, 5, 7, 30, tzinfo=UTC)
    said = Text(
        gettext_noop(
            "stopped since %(since)s: released with its workspaces at %(at)s unless started before"
        ),
        since=Moment(stopped),
        at=Moment(stopped + timedelta(days=7)),
    )
    assert str(said) == (
        "stopped since 2026-12-05 07:30 UTC: released with its workspaces at 2026-12-12 07:30 "
        "UTC unless started before"
    )
    with translation.override("zh-hans"), timezone.override(ZoneInfo("Asia/Shanghai")):
        shown = show(said.as_json())
    assert "2026-12-05 15:30 CST" in shown and "2026-12-12 15:30 CST" in shown
    assert "已关机" in shown


def test_a_reason_said_again_keeps_its_moment():
    """A stored reason loaded back (to say it again inside another sentence) keeps its
    time a time, not the words of its JSON."""
    said = Text(
        gettext_noop("preempted at %(at)s: %(reason)s; resumes when its cluster is placed again"),
        at=Moment(datetime(2026, 12, 5, 7, 30, 5, tzinfo=UTC), "%Y-%m-%d %H:%M:%S"),
        reason="spot capacity reclaimed",
    )
    again = load(said.as_json())
    assert (
        str(again)
        == str(said)
        == (
            "preempted at 2026-12-05 07:30:05 UTC: spot capacity reclaimed; resumes when its "
            "cluster is placed again"
        )
    )

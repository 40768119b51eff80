"""Timeline events keep their English `message` (the API, webhooks) and are shown in the
reader's language from their stored msgid and arguments (jobs.text)."""

from django.utils import translation

from console.templatetags.timeline import event_kind, event_text
from jobs import services


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

"""Operators' powers are permissions, checked on every action: a staff member who may only
look (view permissions) is refused with 403 on posting money and on every action that
changes running work, and nothing changes; granting the one permission lets it through.

No Docker engine is needed: the hosts are rows (registered without a check) and the
clusters are placed on them by the real scheduler."""

from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.urls import reverse

from billing import services as billing
from billing.models import Account, LedgerEntry
from jobs.models import Cluster, Host
from jobs.placement import scheduler

pytestmark = pytest.mark.django_db

VIEW = ["jobs.view_host", "jobs.view_cluster", "billing.view_account", "billing.view_ledgerentry"]


def _grant(user, *perms):
    for perm in perms:
        app, _, codename = perm.partition(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app, codename=codename)
        )


@pytest.fixture
def viewer(db):
    """Victor: staff, may view hosts, clusters and accounts, and nothing else."""
    user = get_user_model().objects.create_user("victor", password="victor-pass-123", is_staff=True)
    _grant(user, *VIEW)
    return user


@pytest.fixture
def host(paper_host):
    return paper_host


@pytest.fixture
def spot_cluster(host, make_cluster, alice):
    cluster = make_cluster(alice, "cheap", gpus=2, spot=True)
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.RUNNING
    return cluster


def _preempted(cluster) -> bool:
    """Preempted: with no job to notify it is back in the queue at once."""
    cluster.refresh_from_db()
    return (
        cluster.state != Cluster.State.RUNNING and cluster.events.filter(kind="preempting").exists()
    )


def _entry_post(client, account):
    return client.post(
        reverse("admin:billing_account_entry", args=[account.pk]),
        {"kind": "topup", "amount": "50", "memo": "invoice 2026-117", "token": "form-1"},
    )


def test_viewing_an_account_does_not_post_money(client, viewer, alice):
    account = billing.account_for(alice)
    client.force_login(viewer)
    page = client.get(reverse("admin:billing_account_change", args=[account.pk]))
    assert page.status_code == 200
    body = page.content.decode()
    assert 'id="entry-form"' not in body and "needs the permission" in body
    assert _entry_post(client, account).status_code == 403
    assert not LedgerEntry.objects.exists()
    assert Account.objects.get(pk=account.pk).balance == Decimal("0")


def test_the_post_permission_lets_an_operator_top_up(client, viewer, alice):
    account = billing.account_for(alice)
    _grant(viewer, "billing.post_ledgerentry")
    client.force_login(viewer)
    page = client.get(reverse("admin:billing_account_change", args=[account.pk]))
    assert 'id="entry-form"' in page.content.decode()
    assert _entry_post(client, account).status_code == 302
    entry = LedgerEntry.objects.get(account=account)
    assert entry.amount == Decimal("50") and entry.created_by == viewer


def test_view_only_staff_get_403_on_the_hosts_page_actions(client, viewer, host, spot_cluster):
    client.force_login(viewer)
    page = client.get(reverse("ops_hosts")).content.decode()
    assert "gpu-paper-01" in page
    assert ">Drain<" not in page and "Reclaim spot" not in page and "Check now" not in page
    for name, data in (
        ("ops_host_drain", {"draining": "1"}),
        ("ops_host_reclaim", {}),
        ("ops_host_check", {}),
    ):
        assert client.post(reverse(name, args=[host.pk]), data).status_code == 403, name
    host.refresh_from_db()
    spot_cluster.refresh_from_db()
    assert (
        not host.drain_requested and host.state == Host.State.ACTIVE and host.last_checked is None
    )
    assert spot_cluster.state == Cluster.State.RUNNING


def test_each_hosts_page_action_needs_its_own_permission(client, viewer, host, spot_cluster):
    _grant(viewer, "jobs.drain_host")
    client.force_login(viewer)
    assert (
        client.post(reverse("ops_host_drain", args=[host.pk]), {"draining": "1"}).status_code == 302
    )
    host.refresh_from_db()
    assert host.drain_requested and host.state == Host.State.DRAINING
    assert client.post(reverse("ops_host_reclaim", args=[host.pk])).status_code == 403
    assert (
        client.post(reverse("ops_host_drain", args=[host.pk]), {"draining": "0"}).status_code == 302
    )
    host.refresh_from_db()
    assert host.state == Host.State.ACTIVE

    _grant(viewer, "jobs.reclaim_spot")
    assert "Reclaim spot" in client.get(reverse("ops_hosts")).content.decode()
    assert client.post(reverse("ops_host_reclaim", args=[host.pk])).status_code == 302
    assert _preempted(spot_cluster)


def _action(client, model, action, pk):
    return client.post(
        reverse(f"admin:jobs_{model}_changelist"),
        {"action": action, "_selected_action": [str(pk)], "index": "0"},
    )


def test_view_only_staff_get_403_on_every_admin_action(client, viewer, host, spot_cluster):
    client.force_login(viewer)
    assert client.get(reverse("admin:jobs_host_changelist")).status_code == 200
    for action in ("drain", "undrain", "reclaim_spot", "check_now"):
        assert _action(client, "host", action, host.pk).status_code == 403, action
    for action in ("preempt", "release"):
        assert _action(client, "cluster", action, spot_cluster.pk).status_code == 403, action
    host.refresh_from_db()
    spot_cluster.refresh_from_db()
    assert not host.drain_requested and host.last_checked is None
    assert spot_cluster.state == Cluster.State.RUNNING


def test_admin_actions_run_with_their_permissions(client, viewer, host, spot_cluster):
    _grant(viewer, "jobs.drain_host", "jobs.preempt_cluster")
    client.force_login(viewer)
    assert _action(client, "host", "drain", host.pk).status_code == 302
    host.refresh_from_db()
    assert host.drain_requested
    assert _action(client, "host", "reclaim_spot", host.pk).status_code == 403
    assert _action(client, "cluster", "release", spot_cluster.pk).status_code == 403
    assert _action(client, "cluster", "preempt", spot_cluster.pk).status_code == 302
    assert _preempted(spot_cluster)


def test_release_from_the_admin_needs_its_permission(client, viewer, spot_cluster):
    _grant(viewer, "jobs.release_cluster")
    client.force_login(viewer)
    assert _action(client, "cluster", "release", spot_cluster.pk).status_code == 302
    spot_cluster.refresh_from_db()
    assert spot_cluster.state in (Cluster.State.RELEASING, Cluster.State.RELEASED)


def test_superusers_hold_every_operator_permission(operator):
    for perm in (
        "billing.post_ledgerentry", "jobs.drain_host", "jobs.reclaim_spot",
        "jobs.preempt_cluster", "jobs.release_cluster",
    ):  # fmt: skip
        assert operator.has_perm(perm), perm

"""Staff status alone grants nothing (docs/operator/permissions.md): every operator power is a permission of
its own, checked the same on pages, POST actions, the API, websockets, the admin and
django-rq's queue pages. The notebook of an attacker who is staff:

- Nils is staff and holds no permission at all;
- Vera is staff and may view every model (each "Can view <model>", as the admin's
  read-only operators do), and nothing else.

Each walks every staff-only URL (taken from the URLconf, so that a new URL cannot be
forgotten: `test_every_url_is_classified` fails until it is listed here), every POST
action, every admin action, every django-rq page and action and every websocket against
Alice's job and cluster, and is refused unless the permission is held; granted the one
permission, the same request works. No Docker engine: the host is a row, the cluster is
placed on it by the real scheduler, the job is a queued row."""

import django_rq
import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse

from billing import services as billing
from billing.models import LedgerEntry
from console.admin_site import may_operate
from console.asgi import application
from console.models import ApiToken
from console.routing import websocket_urlpatterns
from jobs.models import Cluster, ImageBuild, Job, Team
from jobs.placement import scheduler
from jobs.teams import services as teams

pytestmark = pytest.mark.django_db

# Operator pages: the permissions each needs (all of them). Staff without: 403.
OPERATOR_PAGES = {
    "ops_hosts": ("GET", ["jobs.view_host"]),
    "ops_fleet": ("GET", ["jobs.view_host", "jobs.view_cluster"]),
    "ops_fleet_data": ("GET", ["jobs.view_host", "jobs.view_cluster"]),
    "ops_queue": ("GET", ["jobs.view_cluster"]),
    "ops_billing": ("GET", ["billing.view_account", "billing.view_ledgerentry"]),
    "ops_topup": ("GET", ["billing.post_ledgerentry"]),
    "ops_host_drain": ("POST", ["jobs.drain_host"]),
    "ops_host_reclaim": ("POST", ["jobs.reclaim_spot"]),
    "ops_host_check": ("POST", ["jobs.change_host"]),
    "ops_host_add": ("GET", ["jobs.add_host"]),
    "ops_host_join_revoke": ("POST", ["jobs.add_host"]),
    "ops_teams": ("GET", ["jobs.view_team"]),
    "ops_team": ("GET", ["jobs.view_team"]),
    "metrics": ("GET", ["console.view_metrics"]),  # Prometheus (tests/test_metrics.py)
}
# Another researcher's job: the owner's pages, open to whoever holds the permission;
# anyone else gets the 404 every other researcher gets (its existence is not revealed).
JOB_PAGES = {
    "job_detail": ("GET", "jobs.view_job_logs"),
    "job_status": ("GET", "jobs.view_job_logs"),
    "job_log": ("GET", "jobs.view_job_logs"),
    "job_metrics": ("GET", "jobs.view_job_logs"),
    "job_profile": ("GET", "jobs.view_job_logs"),
    "job_profile_file": ("GET", "jobs.view_job_logs"),
    "job_cancel": ("POST", "jobs.cancel_job"),
}
API_JOB_CALLS = {
    "job": ("GET", "jobs/{id}", "jobs.view_job_logs"),
    "job_log": ("GET", "jobs/{id}/log", "jobs.view_job_logs"),
    "job_profile": ("GET", "jobs/{id}/profile", "jobs.view_job_logs"),
    "job_profile_file": ("GET", "jobs/{id}/profile/1/trace.json", "jobs.view_job_logs"),
    "job_cancel": ("POST", "jobs/{id}/cancel", "jobs.cancel_job"),
}
# Everything else reads and writes the signed-in user's own objects only (each page's own
# test shows another researcher's 404); staff status changes nothing there.
OWN = {
    "dashboard", "login", "logout", "signup", "set_language", "account_settings",
    "cluster_list", "cluster_new", "cluster_detail", "cluster_status", "cluster_release",
    "cluster_resize", "cluster_stop", "cluster_start", "job_new", "pool_list", "pool_new",
    "pool_detail", "pool_status", "pool_samples", "pool_job_new", "pool_close", "sweep_list",
    "sweep_new", "sweep_detail", "sweep_live", "sweep_data", "sweep_cancel", "node_terminal",
    "app_status", "app_start", "app_stop", "node_save_image", "image_list", "image_delete",
    "image_build", "ssh_keys", "ssh_key_delete", "ssh_key_default", "cluster_key_attach",
    "cluster_key_detach", "billing", "billing_detail",
    "billing_statement", "billing_statement_detail", "cluster_cost", "webhooks",
    "webhook_detail", "webhook_test", "webhook_rotate", "webhook_delete", "webhook_redeliver",
    "api_tokens", "healthz", "app_open", "console.views_apps.app_open_old", "public_data",
    "storage", "cluster_shutdown", "cluster_shutdown_clear", "cluster_budget", "job_budget",
    "sweep_budget",
    "gpu_subscriptions", "gpu_subscription_cancel",
    # Teams: a team's pages go through the person's membership (tests/test_team_pages.py).
    "act_for", "teams", "team_join", "team_invite_answer", "team_detail", "team_rename",
    "team_invite", "team_invite_revoke", "team_member_role", "team_member_caps",
    "team_member_owner", "team_member_remove", "team_leave", "cluster_person_add",
    "cluster_person_remove",
    # A member's money into their team (tests/test_team_money.py).
    "billing_transfer",
}  # fmt: skip
# No session at all: the join scripts are public, the join endpoints answer token and
# credential holders only, whoever is signed in (tests/test_host_join.py).
JOIN = {"host_join_script", "host_firewall_script", "host_join_api", "host_join_image"}
# A notification address's confirmation link: whoever holds its one-time token, no session
# (tests/test_notifications.py: a guessed token is 404).
JOIN |= {"notify_confirm"}
API_OWN = {
    "openapi-json", "openapi-view", "api-root", "clusters", "cluster_create", "cluster",
    "cluster_release", "cluster_stop", "cluster_start", "cluster_resize", "jobs", "job_submit",
    "cluster_budget", "job_budget", "sweep_budget",
    "pool_list", "pool_create", "pool", "pool_job_submit", "pool_close", "image_list",
    "image_build_create", "image_build", "image_delete", "node_save_image", "balance", "bill",
    "balance_warning", "balance_warning_set",
    "bill_line_pieces", "ssh_keys", "ssh_key_add", "ssh_key_change", "ssh_key_delete",
    "cluster_keys", "cluster_key_attach", "cluster_key_detach",
    "sweep_list", "sweep_create", "sweep", "sweep_cancel", "cluster_shutdown",
    "cluster_shutdown_clear", "gpu_subscriptions", "gpu_subscription_add",
    "gpu_subscription_delete", "notification_channels", "notification_channel_add",
    "notification_channel", "notification_channel_change", "notification_channel_delete",
    "notification_channel_test", "notification_channel_deliveries",
    # Teams: through the caller's membership, 404 outside it (tests/test_team_api.py).
    "team_invitations_mine", "team_invitation_accept_token", "team_invitation_accept",
    "team_invitation_decline", "teams_list", "team_create", "team", "team_rename",
    "team_leave", "team_members", "team_member_role", "team_member_caps", "team_member_remove",
    "team_invites", "team_invite_create", "team_invite_revoke",
}  # fmt: skip
# The websockets, by the route's first words: the permission that opens another
# researcher's, or None where only the owner ever may.
SOCKETS = {
    "ws/jobs/": "jobs.view_job_logs",
    "ws/clusters/<int:cluster_id>/metrics/": "jobs.view_job_logs",
    "ws/images/builds/": None,
    "ws/clusters/<int:cluster_id>/nodes/": None,  # the web terminal
    "^clusters/": None,  # the workspace apps' own websockets
}
MANAGE_QUEUES = "jobs.manage_queues"


def _grant(user, *perms):
    for perm in perms:
        app, _, codename = perm.partition(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app, codename=codename)
        )
    # Django caches a user's permissions on the object: read them again.
    return get_user_model().objects.get(pk=user.pk)


@pytest.fixture
def nils(db):
    return get_user_model().objects.create_user("nils", password="nils-pass-123", is_staff=True)


def _view_permissions() -> list[Permission]:
    """Django's "Can view <model>" of every model: the admin's read-only access."""
    return [
        Permission.objects.get(content_type=ct, codename=f"view_{ct.model}")
        for ct in ContentType.objects.all()
        if Permission.objects.filter(content_type=ct, codename=f"view_{ct.model}").exists()
    ]


@pytest.fixture
def vera(db):
    user = get_user_model().objects.create_user("vera", password="vera-pass-123", is_staff=True)
    user.user_permissions.set(_view_permissions())
    user = get_user_model().objects.get(pk=user.pk)
    assert user.has_perm("jobs.view_job") and not user.has_perm("jobs.view_job_logs")
    return user


@pytest.fixture(params=["nils", "vera"])
def staff(request, nils, vera):
    return {"nils": nils, "vera": vera}[request.param]


@pytest.fixture
def cluster(paper_host, make_cluster, alice):
    cluster = make_cluster(alice, "alices", gpus=1, spot=True)
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.RUNNING
    return cluster


@pytest.fixture
def job(cluster, alice):
    return Job.objects.create(cluster=cluster, owner=alice, name="alices-run", command="true")


def _names(patterns) -> set[str]:
    out = set()
    for p in patterns:
        if isinstance(p, URLResolver):
            out |= _names(p.url_patterns)
        elif p.name:
            out.add(p.name)
    return out


def _include(prefix: str) -> URLResolver:
    return next(p for p in get_resolver().url_patterns if str(p.pattern) == prefix)


def test_every_url_is_classified():
    """A URL added later is walked by these tests only once it is listed above."""
    top = {p.name or p.lookup_str for p in get_resolver().url_patterns if isinstance(p, URLPattern)}
    listed = OWN | set(OPERATOR_PAGES) | set(JOB_PAGES) | JOIN
    assert top <= listed, (
        f"classify each new URL here (OWN, OPERATOR_PAGES or JOB_PAGES): {sorted(top - listed)}"
    )
    api_names = _names(_include("api/v1/").url_patterns)
    assert api_names <= API_OWN | set(API_JOB_CALLS), sorted(
        api_names - API_OWN - set(API_JOB_CALLS)
    )
    for route in websocket_urlpatterns:
        assert any(str(route.pattern).startswith(k) for k in SOCKETS), route.pattern


def _call(client, method, url, data=None):
    return client.post(url, data or {}) if method == "POST" else client.get(url)


def _operator_args(name, paper_host) -> list:
    if name == "ops_team":  # a team's page: one team, made once
        owner, _ = get_user_model().objects.get_or_create(username="tess")
        team = Team.objects.filter(name="Tess lab").first()
        return [(team or teams.team_create(person=owner, name="Tess lab")).pk]
    return [paper_host.pk] if name.startswith("ops_host_") and name != "ops_host_add" else []


def test_operator_pages_refuse_staff_without_their_permission(client, staff, paper_host):
    client.force_login(staff)
    for name, (method, perms) in OPERATOR_PAGES.items():
        url = reverse(name, args=_operator_args(name, paper_host))
        got = _call(client, method, url, {"draining": "1"}).status_code
        held = all(staff.has_perm(p) for p in perms)
        assert (got != 403) == held, (staff.username, name, got)
    paper_host.refresh_from_db()
    assert not paper_host.drain_requested and paper_host.last_checked is None


def test_each_operator_page_opens_with_its_permission(client, nils, paper_host):
    for name, (method, perms) in OPERATOR_PAGES.items():
        if method != "GET":
            continue  # the POST actions: tests/test_operator_permissions.py
        user = _grant(get_user_model().objects.create_user(name, is_staff=True), *perms)
        client.force_login(user)
        url = reverse(name, args=_operator_args(name, paper_host))
        assert client.get(url).status_code == 200, name


def test_another_researchers_job_is_404_to_staff_without_the_permission(client, staff, job):
    client.force_login(staff)
    for name, (method, _perm) in JOB_PAGES.items():
        args = [job.pk, 1, "trace.json"] if name == "job_profile_file" else [job.pk]
        got = _call(client, method, reverse(name, args=args)).status_code
        assert got == 404, (staff.username, name, got)
    job.refresh_from_db()
    assert job.state == Job.State.QUEUED and not job.cancel_requested


def test_view_job_logs_opens_the_job_pages_and_not_the_cancel(client, vera, job):
    vera = _grant(vera, "jobs.view_job_logs")
    client.force_login(vera)
    for name, (method, perm) in JOB_PAGES.items():
        if name == "job_profile_file":
            continue  # no trace file exists: 404 whoever asks
        got = _call(client, method, reverse(name, args=[job.pk])).status_code
        assert (got == 200) == (perm == "jobs.view_job_logs"), (name, got)
    page = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    assert reverse("job_cancel", args=[job.pk]) not in page  # no button they may not use
    job.refresh_from_db()
    assert job.state == Job.State.QUEUED


def test_cancel_job_cancels_another_researchers_job(client, vera, job):
    vera = _grant(vera, "jobs.view_job_logs", "jobs.cancel_job")
    client.force_login(vera)
    page = client.get(reverse("job_detail", args=[job.pk])).content.decode()
    assert reverse("job_cancel", args=[job.pk]) in page
    assert client.post(reverse("job_cancel", args=[job.pk])).status_code == 302
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLED and "vera" in job.events.last().message


def _api(user):
    _, token = ApiToken.issue(user=user, name="staff-script")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def call(method, path):
        url = f"/api/v1/{path}"
        if method == "GET":
            return client.get(url).status_code
        return client.post(url, data="{}", content_type="application/json").status_code

    return call


def test_the_api_holds_staff_to_the_same_permissions(staff, job):
    api = _api(staff)
    for name, (method, path, _perm) in API_JOB_CALLS.items():
        assert api(method, path.format(id=job.pk)) == 404, (staff.username, name)
    staff = _grant(staff, "jobs.view_job_logs")
    api = _api(staff)
    assert api("GET", f"jobs/{job.pk}") == 200
    assert api("GET", f"jobs/{job.pk}/log") == 200
    assert api("POST", f"jobs/{job.pk}/cancel") == 404
    job.refresh_from_db()
    assert job.state == Job.State.QUEUED
    assert _api(_grant(staff, "jobs.cancel_job"))("POST", f"jobs/{job.pk}/cancel") == 200
    job.refresh_from_db()
    assert job.state == Job.State.CANCELLED


async def _socket(path: str, user) -> tuple[bool, int | None]:
    communicator = WebsocketCommunicator(
        application, path, headers=[(b"origin", b"http://localhost")]
    )
    communicator.scope["user"] = user
    connected, code = await communicator.connect()
    await communicator.disconnect()
    return connected, code


def _socket_paths(job, cluster, build) -> dict[str, str]:
    """A path of each websocket route there is, at Alice's job, cluster and build."""
    paths = {
        "ws/jobs/": f"/ws/jobs/{job.pk}/log/",
        "ws/clusters/<int:cluster_id>/metrics/": f"/ws/clusters/{cluster.pk}/metrics/",
        "ws/images/builds/": f"/ws/images/builds/{build.pk}/log/",
        "ws/clusters/<int:cluster_id>/nodes/": f"/ws/clusters/{cluster.pk}/nodes/0/terminal/",
        "^clusters/": f"/clusters/{cluster.pk}/nodes/0/jupyter/api/kernels/k/channels",
    }
    routes = [str(r.pattern) for r in websocket_urlpatterns]
    return {k: v for k, v in paths.items() if any(r.startswith(k) for r in routes)}


@pytest.mark.django_db(transaction=True)  # the consumers read through their own connections
@pytest.mark.parametrize("followers", [True, False], ids=["fed-log", "polled-log"])
def test_every_websocket_refuses_staff_without_the_permission(
    settings, staff, job, cluster, alice, followers
):
    settings.SUANLI_LOG_FOLLOWERS = followers
    build = ImageBuild.objects.create(owner=alice, name="mine", tag="v1", dockerfile="FROM x")
    paths = _socket_paths(job, cluster, build)
    assert len(paths) == len(websocket_urlpatterns)
    for path in paths.values():
        connected, code = async_to_sync(_socket)(path, staff)
        assert not connected, (staff.username, path)
        assert code == 4404, (staff.username, path, code)  # as if it did not exist
    staff = _grant(staff, "jobs.view_job_logs")
    for key, path in paths.items():
        connected, _code = async_to_sync(_socket)(path, staff)
        assert connected == (SOCKETS[key] is not None), (path, connected)


# -- django-rq ----------------------------------------------------------------------------


def untouched():
    """The queued work that staff without the permission must not be able to delete."""


@pytest.fixture
def rq_job():
    return django_rq.get_queue("default").enqueue(f"{__name__}.untouched")


def _rq_urls(rq_job) -> list[str]:
    values = {
        "queue_index": _queue_names().index("default"),
        "job_id": rq_job.id, "result_id": "r1", "key": "w1", "scheduler_index": 0,
        "connection_index": 0, "scheduler_name": "s1", "cron_job_name": "c1", "token": "t1",
    }  # fmt: skip
    urls = []
    for p in _include("admin/rq/").url_patterns:
        names = list(getattr(p.pattern, "converters", {})) or list(p.pattern.regex.groupindex)
        urls.append(reverse(f"django_rq:{p.name}", kwargs={n: values[n] for n in names}))
    return urls


def _queue_names() -> list[str]:
    return [q["name"] for q in django_rq.settings.QUEUES_LIST]


def test_django_rq_is_closed_to_staff_without_manage_queues(client, staff, rq_job):
    client.force_login(staff)
    urls = _rq_urls(rq_job)
    assert len(urls) >= 20, urls
    for url in urls:
        for method in ("GET", "POST"):
            data = {"job_ids": [rq_job.id], "action": "delete", "_selected_action": [rq_job.id]}
            got = _call(client, method, url, data).status_code
            assert got == 403, (staff.username, method, url, got)
    queue = django_rq.get_queue("default")
    assert queue.fetch_job(rq_job.id) is not None and rq_job.id in queue.job_ids
    # django-rq's own copy of these pages inside the admin is not there to use instead.
    assert client.get("/admin/django_rq/dashboard/").status_code == (
        404 if may_operate(staff) else 302  # no power: the admin's log-in, nothing else
    )
    assert client.get(reverse("admin:index")).content.decode().count("django_rq") == 0


def test_manage_queues_lets_an_operator_delete_queued_work(client, vera, rq_job):
    vera = _grant(vera, MANAGE_QUEUES)
    client.force_login(vera)
    assert client.get(reverse("django_rq:home")).status_code == 200
    queue_index = _queue_names().index("default")
    url = reverse("django_rq:delete_job", args=[queue_index, rq_job.id])
    assert client.post(url).status_code == 302
    assert django_rq.get_queue("default").fetch_job(rq_job.id) is None


def test_superusers_may_manage_queues(client, operator):
    client.force_login(operator)
    assert client.get(reverse("django_rq:home")).status_code == 200


# -- the admin ---------------------------------------------------------------------------


def test_every_admin_action_names_its_permissions():
    """An action without `permissions` is open to whoever may view the list (Django)."""
    for model, model_admin in admin.site._registry.items():
        for func, name, _description in model_admin._get_base_actions():
            assert getattr(func, "allowed_permissions", None), (model.__name__, name)


def test_admin_actions_and_views_need_their_permissions(client, staff, paper_host, alice):
    """Every action of every model in the admin, its own views (a host's check, a ledger
    entry) and its add pages: refused without the permission. Nothing changes."""
    client.force_login(staff)
    # Staff with no power at all are not let into the admin (its log-in page); with one,
    # each view and action they lack answers 403.
    refused = 403 if may_operate(staff) else 302
    account = billing.account_for(alice)
    for model, model_admin in admin.site._registry.items():
        meta = model._meta
        changelist = reverse(f"admin:{meta.app_label}_{meta.model_name}_changelist")
        viewable = staff.has_perm(f"{meta.app_label}.view_{meta.model_name}")
        assert (client.get(changelist).status_code == 200) == viewable, changelist
        add = reverse(f"admin:{meta.app_label}_{meta.model_name}_add")
        assert client.get(add).status_code == refused, add
        for action in model_admin.actions or ():
            name = action if isinstance(action, str) else action.__name__
            got = client.post(changelist, {"action": name, "_selected_action": ["1"], "index": 0})
            assert got.status_code == refused, (staff.username, changelist, name)
    got = client.post(reverse("admin:jobs_host_check", args=[paper_host.pk]))
    assert got.status_code == refused
    entry = {"kind": "topup", "amount": "50", "memo": "m", "token": "t-1"}
    got = client.post(reverse("admin:billing_account_entry", args=[account.pk]), entry)
    assert got.status_code == refused
    paper_host.refresh_from_db()
    assert (
        paper_host.last_checked is None and not LedgerEntry.objects.filter(account=account).exists()
    )


def test_the_nav_shows_only_the_operator_pages_a_user_may_open(client, vera, nils):
    client.force_login(nils)
    page = client.get(reverse("dashboard")).content.decode()
    for name in ("ops_hosts", "ops_fleet", "ops_queue", "ops_billing", "django_rq:home"):
        assert f'href="{reverse(name)}"' not in page, name
    client.force_login(_grant(vera, MANAGE_QUEUES))
    page = client.get(reverse("dashboard")).content.decode()
    for name in ("ops_hosts", "ops_fleet", "ops_queue", "ops_billing", "django_rq:home"):
        assert f'href="{reverse(name)}"' in page, name


def test_changing_users_is_not_a_way_to_every_permission(client, vera, operator, alice):
    """Django would let whoever may change users grant themselves anything."""
    vera = _grant(vera, "auth.change_user", "auth.change_group")
    client.force_login(vera)
    own = client.get(reverse("admin:auth_user_change", args=[vera.pk]))
    assert own.status_code == 200 and 'name="is_superuser"' not in own.content.decode()
    theirs = client.get(reverse("admin:auth_user_change", args=[alice.pk])).content.decode()
    assert 'name="email"' in theirs and 'name="user_permissions"' not in theirs
    assert 'name="is_staff"' not in theirs
    got = client.post(
        reverse("admin:auth_user_password_change", args=[operator.pk]),
        {"password1": "taken-over-123", "password2": "taken-over-123", "usable_password": "true"},
    )
    assert got.status_code == 403
    operator.refresh_from_db()
    assert operator.check_password("olga-pass-123")
    # Nor an account that holds a power without staff status: its password is its powers.
    _grant(alice, "jobs.view_job_logs")
    got = client.post(
        reverse("admin:auth_user_password_change", args=[alice.pk]),
        {"password1": "taken-over-123", "password2": "taken-over-123", "usable_password": "true"},
    )
    assert got.status_code == 403
    alice.refresh_from_db()
    assert alice.check_password("alice-pass-123")
    client.force_login(operator)
    own = client.get(reverse("admin:auth_user_change", args=[vera.pk])).content.decode()
    assert 'name="is_superuser"' in own  # a superuser hands out powers


def test_staff_status_alone_opens_neither_the_admin_nor_the_operator_navigation(
    client, django_user_model
):
    """Django lets any active staff user into the admin's (empty) index; here that needs a
    power too, and the navigation's operator part and its admin link show only with one."""
    bare = django_user_model.objects.create_user("staffonly", password="pw-12345678", is_staff=True)
    client.force_login(bare)
    index = client.get(reverse("admin:index"))
    assert index.status_code == 302 and "/admin/login/" in index["Location"]
    page = client.get(reverse("dashboard")).content.decode()
    assert reverse("admin:index") not in page and 'class="navsep"' not in page
    bare.user_permissions.add(Permission.objects.get(codename="view_host"))
    bare = django_user_model.objects.get(pk=bare.pk)  # permissions are cached per object
    client.force_login(bare)
    assert client.get(reverse("admin:index")).status_code == 200
    assert reverse("admin:index") in client.get(reverse("dashboard")).content.decode()

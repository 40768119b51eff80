"""The operator's Teams pages (/ops/teams/) and the admin's teams: reading needs view_team,
changing a team's fair share or GPU limit needs manage_teams; staff status alone grants
nothing (403), and someone who is not staff is sent to the admin's log-in, as on every
operator page. The figures a team is shown with are its own: owner, members, balance, the
GPUs its placed nodes hold now and its GPU-hours this month.

No engine: the host is a row and the clusters are placed on it by the real scheduler."""

from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.utils import timezone

from billing import caps
from jobs.models import Node, Team
from jobs.placement import scheduler
from jobs.teams import selectors
from jobs.teams import services as teams
from jobs.tenancy.actors import Actor

pytestmark = pytest.mark.django_db


def staff(login, *perms):
    user = get_user_model().objects.create_user(login, password=f"{login}-pass-123", is_staff=True)
    for perm in perms:
        app, _, codename = perm.partition(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app, codename=codename)
        )
    return user


@pytest.fixture
def lab(alice, bob):
    team = teams.team_create(person=alice, name="张老师课题组")
    invite, _ = teams.invite_create(
        actor=Actor.for_team(alice, team.pk), role="member", login="bob"
    )
    teams.invite_accept(person=bob, invite=invite)
    return team


def test_staff_without_the_permission_get_403_and_others_the_admin_log_in(client, alice, lab):
    for path in ("/ops/teams/", f"/ops/teams/{lab.pk}/"):
        client.force_login(alice)  # a researcher, even a team's owner
        page = client.get(path)
        assert page.status_code == 302 and page["Location"].startswith("/admin/login/")
        client.force_login(staff(f"s{len(path)}"))  # staff, no permission
        assert client.get(path).status_code == 403
    client.force_login(staff("vera", "jobs.view_host"))  # another power: not this one
    assert client.get("/ops/teams/").status_code == 403


def test_an_operator_sees_each_team_with_its_figures(
    client, lab, make_paper_host, make_cluster, bob, fund
):  # fmt: skip
    make_paper_host(gpus=8)
    make_cluster(lab.principal, "lab-a", gpus=2, created_by=bob)
    scheduler.place_pending()
    fund(lab.principal, 250)
    other = teams.team_create(person=bob, name="Other lab")
    client.force_login(staff("vera", "jobs.view_team"))
    page = client.get("/ops/teams/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "张老师课题组" in html and "Other lab" in html and "alice" in html
    row = html[html.index(f'data-team="{lab.pk}"') :].split("</tr>")[0]
    assert 'data-testid="team-held">2<' in row and "250" in row
    assert f'href="/ops/teams/{other.pk}/"' in html
    assert 'href="/ops/teams/"' in html  # linked from the operator navigation
    detail = client.get(f"/ops/teams/{lab.pk}/").content.decode()
    assert 'data-member="alice"' in detail and 'data-member="bob"' in detail
    assert "owner" in detail and "member" in detail
    assert 'id="team-limits"' not in detail  # may look, not change


def test_changing_share_and_limit_needs_manage_teams(client, lab):
    looker = staff("vera", "jobs.view_team", "jobs.change_team")
    client.force_login(looker)
    answer = client.post(f"/ops/teams/{lab.pk}/", {"share": 5, "gpu_limit": 4})
    assert answer.status_code == 403
    assert Team.objects.get(pk=lab.pk).share == 1
    client.force_login(staff("mia", "jobs.view_team", "jobs.manage_teams"))
    assert 'id="team-limits"' in client.get(f"/ops/teams/{lab.pk}/").content.decode()
    answer = client.post(f"/ops/teams/{lab.pk}/", {"share": 1001, "gpu_limit": ""})
    assert answer.status_code == 400 and Team.objects.get(pk=lab.pk).share == 1
    answer = client.post(f"/ops/teams/{lab.pk}/", {"share": 5, "gpu_limit": 4})
    assert answer.status_code == 302
    lab.refresh_from_db()
    assert (lab.share, lab.gpu_limit, lab.name) == (5, 4, "张老师课题组")
    client.post(f"/ops/teams/{lab.pk}/", {"share": 5, "gpu_limit": ""})
    assert Team.objects.get(pk=lab.pk).gpu_limit is None


def test_the_admin_changes_teams_only_with_manage_teams(client, lab):
    change = f"/admin/jobs/team/{lab.pk}/change/"
    client.force_login(staff("vera", "jobs.view_team", "jobs.change_team"))
    assert client.get("/admin/jobs/team/").status_code == 200
    client.post(change, {"share": 9, "gpu_limit": 1})
    assert Team.objects.get(pk=lab.pk).share == 1
    assert client.post("/admin/jobs/team/add/", {}).status_code == 403
    assert client.post(f"/admin/jobs/team/{lab.pk}/delete/", {"post": "yes"}).status_code == 403
    client.force_login(staff("mia", "jobs.view_team", "jobs.manage_teams"))
    answer = client.post(change, {"share": 9, "gpu_limit": 1, **_inline_management(lab)})
    assert answer.status_code == 302, answer.content.decode()[-2000:]
    assert Team.objects.get(pk=lab.pk).share == 9
    # Members and invitations are read-only, whatever one's powers.
    client.force_login(staff("tom", "jobs.view_teammember", "jobs.change_teammember",
                             "jobs.delete_teammember", "jobs.view_teaminvite"))  # fmt: skip
    member = lab.memberships.get(person__username="bob")
    assert client.get(f"/admin/jobs/teammember/{member.pk}/change/").status_code == 200
    client.post(f"/admin/jobs/teammember/{member.pk}/delete/", {"post": "yes"})
    assert lab.memberships.filter(pk=member.pk).exists()
    assert client.get("/admin/jobs/teaminvite/").status_code == 200


def _inline_management(team) -> dict:
    """The members inline's management form, as the change page posts it."""
    prefix = "memberships"
    count = team.memberships.count()
    return {f"{prefix}-TOTAL_FORMS": count, f"{prefix}-INITIAL_FORMS": count,
            f"{prefix}-MIN_NUM_FORMS": 0, f"{prefix}-MAX_NUM_FORMS": 1000,
            **{f"{prefix}-{i}-id": m.pk for i, m in enumerate(team.memberships.order_by("pk"))},
            **{f"{prefix}-{i}-team": team.pk for i in range(count)}}  # fmt: skip


def test_gpu_hours_this_month_count_only_this_month(lab, make_paper_host, make_cluster, bob):
    make_paper_host(gpus=8)
    cluster = make_cluster(lab.principal, "lab-a", gpus=2, created_by=bob)
    scheduler.place_pending()
    now = timezone.now()
    start = caps.month_start(now)
    # Placed a day before the month began, released 3 hours into it: 2 GPUs x 3 h this month.
    Node.objects.filter(cluster=cluster).update(
        placed_at=start - timedelta(days=1), released_at=start + timedelta(hours=3)
    )
    use = selectors.fleet_use(
        [lab.principal_id], since=start, now=max(now, start + timedelta(hours=4))
    )
    assert use[lab.principal_id] == (0, Decimal("6.0"))

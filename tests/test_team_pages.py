"""The team pages (console/views_teams.py) with real accounts through the test client: making
a team, inviting by login and by link, accepting, declining, revoking, an expired or unknown
link, roles, caps, removal with each choice for the clusters, leaving, the people of a team
cluster, and the switcher with its badge. Each write refused for the role below (403, in
words) and for a non-member (404). One Chromium test takes the pages in English and Chinese
at 1280 and 390 px."""

import os
from datetime import timedelta
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.http import Http404
from django.urls import reverse
from django.utils import timezone

from jobs.models import Cluster, Team, TeamInvite, TeamMember
from jobs.placement import scheduler
from jobs.teams import services as teams
from jobs.tenancy.actors import Actor
from tests.browsing import login

Role = TeamMember.Role
pytestmark = pytest.mark.django_db
SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")


def person(name):
    return get_user_model().objects.create_user(name, password=f"{name}-pass-123")


def user(name):
    return get_user_model().objects.get(username=name)


def member(team, name) -> TeamMember:
    return TeamMember.objects.get(team=team, person__username=name)


@pytest.fixture
def lab(alice):
    """Alice's lab: alice owner, ada admin, mo member, vi viewer."""
    team = teams.team_create(person=alice, name="张老师课题组")
    owner = Actor.for_team(alice, team.pk)
    for name, role in (("ada", Role.ADMIN), ("mo", Role.MEMBER), ("vi", Role.VIEWER)):
        who = person(name)
        invite, _ = teams.invite_create(actor=owner, role=role, login=name)
        teams.invite_accept(person=who, invite=invite)
    return team


def as_(client, name):
    client.force_login(user(name))
    return client


def words(response) -> str:
    return response.content.decode()


def messages_of(client, url) -> str:
    return words(client.get(url))


# Making a team and the teams page


def test_a_researcher_makes_a_team_and_sees_it_on_their_teams_page(client, alice):
    client.force_login(alice)
    empty = client.post(reverse("teams"), {"name": "   "})
    assert empty.status_code == 200 and "Give the team a name" in words(empty)
    made = client.post(reverse("teams"), {"name": "Vision lab"})
    team = Team.objects.get(name="Vision lab")
    assert made["Location"] == reverse("team_detail", args=[team.pk])
    page = words(client.get(made["Location"]))
    assert "made; you are its owner" in page and "Your role: owner · 1 members" in page
    listing = words(client.get(reverse("teams")))
    row = listing.split('id="my-teams"', 1)[1].split("</table>", 1)[0]
    assert "Vision lab" in row and "owner" in row and "Act for it" in row


def test_an_invitation_to_a_login_is_accepted_or_declined_on_the_teams_page(client, lab, bob):
    as_(client, "alice").post(
        reverse("team_invite", args=[lab.pk]), {"login": "bob", "role": "member"}
    )
    carol = person("carol")
    client.post(reverse("team_invite", args=[lab.pk]), {"login": "carol", "role": "viewer"})
    client.force_login(bob)
    mine = words(client.get(reverse("teams")))
    assert "Invitations to you" in mine and "张老师课题组" in mine
    invite = TeamInvite.objects.get(login=bob)
    # carol cannot answer bob's invitation: it is not hers (404, nothing changes)
    client.force_login(carol)
    theirs = client.post(reverse("team_invite_answer", args=[invite.pk]), {"answer": "decline"})
    assert theirs.status_code == 404
    declined = client.post(
        reverse("team_invite_answer", args=[TeamInvite.objects.get(login=carol).pk]),
        {"answer": "decline"},
        follow=True,
    )
    assert "Invitation to 张老师课题组 declined" in words(declined)
    assert "Invitations to you" not in words(declined)
    assert not lab.memberships.filter(person=carol).exists()
    client.force_login(bob)
    joined = client.post(
        reverse("team_invite_answer", args=[invite.pk]), {"answer": "accept"}, follow=True
    )
    page = words(joined)
    assert "You joined 张老师课题组" in page and 'data-testid="offer-switch"' in page
    assert member(lab, "bob").role == Role.MEMBER


def test_a_link_is_shown_once_and_joins_whoever_logs_in_with_it(client, lab, bob):
    made = as_(client, "ada").post(
        reverse("team_invite", args=[lab.pk]), {"login": "", "role": "viewer", "days": 3}
    )
    page = words(client.get(made["Location"]))
    assert "shown once" in page
    url = page.split('data-testid="invite-url">', 1)[1].split("<", 1)[0]
    path = url.split("testserver", 1)[1]
    assert path.startswith("/teams/join/sli_")
    assert 'data-testid="invite-url"' not in words(client.get(made["Location"])), "once"
    client.logout()
    away = client.get(path)
    assert away.status_code == 302 and away["Location"] == f"/login/?next={path}"
    client.force_login(bob)
    asked = words(client.get(path))
    assert "Join 张老师课题组?" in asked and "viewer" in asked
    joined = client.post(path, follow=True)
    assert "You joined 张老师课题组" in words(joined)
    assert member(lab, "bob").role == Role.VIEWER
    spent = client.get(path)
    assert spent.status_code == 404 and "does not open" in words(spent)
    assert "张老师课题组" not in words(spent).split('data-testid="team-join"', 1)[1]


def test_an_unknown_expired_or_revoked_link_names_no_team(client, lab, bob):
    owner = Actor.for_team(user("alice"), lab.pk)
    old, old_token = teams.invite_create(actor=owner, role=Role.MEMBER)
    TeamInvite.objects.filter(pk=old.pk).update(expires_at=timezone.now() - timedelta(minutes=1))
    gone, gone_token = teams.invite_create(actor=owner, role=Role.MEMBER)
    as_(client, "alice")
    listed = words(client.get(reverse("team_detail", args=[lab.pk])))
    assert f'data-testid="open-invite-{gone.pk}"' in listed
    assert f'data-testid="open-invite-{old.pk}"' not in listed, "an expired one is not open"
    revoked = client.post(reverse("team_invite_revoke", args=[lab.pk, gone.pk]), follow=True)
    assert "Invitation revoked" in words(revoked)
    assert f'data-testid="open-invite-{gone.pk}"' not in words(revoked)
    client.force_login(bob)
    for token in (old_token, gone_token, "sli_nothing-of-ours", "x"):
        page = client.get(reverse("team_join", args=[token]))
        assert page.status_code == 404 and "does not open" in words(page)
        assert "张老师课题组" not in words(page)
        assert client.post(reverse("team_join", args=[token])).status_code == 404
    assert not lab.memberships.filter(person=bob).exists()


# Roles, caps, removal, leaving


def test_admins_change_roles_below_their_own_and_nobody_below_may(client, lab, bob):
    mo = member(lab, "mo")
    url = reverse("team_member_role", args=[lab.pk, mo.pk])
    done = as_(client, "ada").post(url, {"role": "viewer"}, follow=True)
    assert "mo is now viewer" in words(done)
    assert member(lab, "mo").role == Role.VIEWER
    refused = client.post(url, {"role": "admin"})
    assert refused.status_code == 403 and "needs owner" in words(refused)
    ada = member(lab, "ada")
    assert (
        client.post(
            reverse("team_member_role", args=[lab.pk, ada.pk]), {"role": "member"}
        ).status_code
        == 403
    )
    assert as_(client, "mo").post(url, {"role": "member"}).status_code == 403
    assert as_(client, "alice").post(url, {"role": "admin"}).status_code == 302
    assert member(lab, "mo").role == Role.ADMIN
    assert as_(client, "bob").post(url, {"role": "member"}).status_code == 404


def test_caps_are_the_owners_to_set_and_each_member_sees_their_own(client, lab, bob):
    mo, vi = member(lab, "mo"), member(lab, "vi")
    url = reverse("team_member_caps", args=[lab.pk, mo.pk])
    saved = as_(client, "alice").post(url, {"monthly_cap": "800", "gpu_cap": "2"}, follow=True)
    assert "Caps of mo saved" in words(saved)
    mo.refresh_from_db()
    assert mo.monthly_cap == Decimal("800.00") and mo.gpu_cap == 2
    client.post(
        reverse("team_member_caps", args=[lab.pk, vi.pk]), {"monthly_cap": "123", "gpu_cap": ""}
    )
    bad = client.post(url, {"monthly_cap": "-1", "gpu_cap": ""}, follow=True)
    assert member(lab, "mo").monthly_cap == Decimal("800.00") and "msg-error" in words(bad)
    assert as_(client, "ada").post(url, {"monthly_cap": "9999"}).status_code == 403
    assert as_(client, "mo").post(url, {"monthly_cap": "9999"}).status_code == 403
    assert as_(client, "bob").post(url, {"monthly_cap": "9999"}).status_code == 404
    assert member(lab, "mo").monthly_cap == Decimal("800.00")
    # mo sees their own cap, not vi's; an admin sees both.
    page = words(as_(client, "mo").get(reverse("team_detail", args=[lab.pk])))
    assert "¥800.00" in _row(page, "mo") and "¥123" not in _row(page, "vi")
    page = words(as_(client, "ada").get(reverse("team_detail", args=[lab.pk])))
    assert "¥800.00" in _row(page, "mo") and "¥123.00" in _row(page, "vi")


def _row(page: str, login: str) -> str:
    return page.split(f'data-testid="member-{login}"', 1)[1].split("</tr>", 1)[0]


def test_a_non_member_gets_404_for_every_team_page_and_write(client, lab, bob):
    client.force_login(bob)
    mo, invite = member(lab, "mo"), TeamInvite.objects.filter(team=lab).first()
    assert client.get(reverse("team_detail", args=[lab.pk])).status_code == 404
    for name, args, data in (
        ("team_rename", [lab.pk], {"name": "mine"}),
        ("team_invite", [lab.pk], {"role": "member"}),
        ("team_invite_revoke", [lab.pk, invite.pk], {}),
        ("team_member_role", [lab.pk, mo.pk], {"role": "viewer"}),
        ("team_member_caps", [lab.pk, mo.pk], {"monthly_cap": "1"}),
        ("team_member_owner", [lab.pk, mo.pk], {}),
        ("team_member_remove", [lab.pk, mo.pk], {"clusters": "hand"}),
        ("team_leave", [lab.pk], {"clusters": "hand"}),
    ):
        assert client.post(reverse(name, args=args), data).status_code == 404, name
    assert Team.objects.get(pk=lab.pk).name == "张老师课题组"
    assert member(lab, "mo").role == Role.MEMBER


def test_each_write_is_refused_with_403_for_the_role_below(client, lab):
    mo, vi, ada = member(lab, "mo"), member(lab, "vi"), member(lab, "ada")
    invite, _ = teams.invite_create(actor=Actor.for_team(user("alice"), lab.pk), role=Role.MEMBER)
    cases = (  # (who, view, args, data): each one role below what the write needs
        ("mo", "team_rename", [lab.pk], {"name": "mine"}),
        ("mo", "team_invite", [lab.pk], {"role": "member"}),
        ("vi", "team_invite", [lab.pk], {"role": "viewer"}),
        ("mo", "team_invite_revoke", [lab.pk, invite.pk], {}),
        ("ada", "team_invite", [lab.pk], {"role": "admin"}),
        ("vi", "team_member_role", [lab.pk, mo.pk], {"role": "viewer"}),
        ("mo", "team_member_remove", [lab.pk, vi.pk], {"clusters": "hand"}),
        ("ada", "team_member_remove", [lab.pk, ada.pk], {"clusters": "hand"}),
        ("ada", "team_member_caps", [lab.pk, mo.pk], {"monthly_cap": "1"}),
        ("ada", "team_member_owner", [lab.pk, mo.pk], {}),
    )
    for who, name, args, data in cases:
        refused = as_(client, who).post(reverse(name, args=args), data)
        assert refused.status_code == 403, (who, name)
        assert "Not allowed" in words(refused) and "张老师课题组" in words(refused), (who, name)
    assert Team.objects.get(pk=lab.pk).name == "张老师课题组"
    assert lab.memberships.count() == 4 and member(lab, "mo").role == Role.MEMBER
    assert TeamInvite.objects.get(pk=invite.pk).open


def test_the_owner_hands_ownership_on_and_then_may_leave(client, lab):
    ada = member(lab, "ada")
    as_(client, "alice")
    stays = client.post(reverse("team_leave", args=[lab.pk]), {"clusters": "hand"}, follow=True)
    assert "hand ownership" in words(stays) and member(lab, "alice").role == Role.OWNER
    client.post(reverse("team_member_owner", args=[lab.pk, ada.pk]))
    assert member(lab, "ada").role == Role.OWNER and member(lab, "alice").role == Role.ADMIN
    gone = client.post(reverse("team_leave", args=[lab.pk]), {"clusters": "hand"}, follow=True)
    assert "alice is out of the team" in words(gone)
    assert client.get(reverse("team_detail", args=[lab.pk])).status_code == 404


@pytest.fixture
def placed(make_cluster, paper_host):
    """A team cluster made by `name`, placed on a host with no engine (state: running)."""

    def make(team, name, cluster_name):
        cluster = make_cluster(team.principal, cluster_name, created_by=user(name))
        scheduler.place_pending()
        cluster.refresh_from_db()
        return cluster

    return make


def test_removing_a_member_hands_or_stops_their_clusters_as_chosen(client, lab, placed):
    handed = placed(lab, "mo", "mo-run")
    stopped = placed(lab, "vi", "vi-run")
    assert handed.state == stopped.state == Cluster.State.RUNNING
    as_(client, "ada")
    mo, vi = member(lab, "mo"), member(lab, "vi")
    done = client.post(
        reverse("team_member_remove", args=[lab.pk, mo.pk]), {"clusters": "hand"}, follow=True
    )
    assert "mo is out of the team: 1 clusters handed to the owner, 0 stopped" in words(done)
    handed.refresh_from_db()
    assert handed.created_by.username == "alice" and handed.state == Cluster.State.RUNNING
    done = client.post(
        reverse("team_member_remove", args=[lab.pk, vi.pk]), {"clusters": "stop"}, follow=True
    )
    assert "vi is out of the team: 0 clusters handed to the owner, 1 stopped" in words(done)
    stopped.refresh_from_db()
    assert stopped.state == Cluster.State.STOPPED
    assert lab.memberships.count() == 2


def test_a_member_leaves_with_their_clusters_stopped(client, lab, placed):
    theirs = placed(lab, "mo", "mo-run")
    as_(client, "mo").post(reverse("act_for"), {"team": lab.pk, "next": "/"})
    left = client.post(reverse("team_leave", args=[lab.pk]), {"clusters": "stop"}, follow=True)
    assert "mo is out of the team: 0 clusters handed to the owner, 1 stopped" in words(left)
    theirs.refresh_from_db()
    assert theirs.state == Cluster.State.STOPPED
    assert 'data-testid="acting-bar"' not in words(left), "acting for themselves again"
    assert not lab.memberships.filter(person__username="mo").exists()


# The people of a team cluster


def test_admins_and_the_clusters_maker_add_and_take_off_team_people(client, lab, bob, placed):
    cluster = placed(lab, "mo", "mo-run")
    add = reverse("cluster_person_add", args=[cluster.pk])
    as_(client, "mo").post(reverse("act_for"), {"team": lab.pk, "next": "/"})
    card = words(client.get(reverse("cluster_detail", args=[cluster.pk])))
    assert 'data-testid="cluster-people"' in card and 'data-testid="person-add"' in card
    added = client.post(add, {"person": user("vi").pk}, follow=True)
    assert "vi added to the cluster" in words(added)
    assert set(cluster.members.values_list("username", flat=True)) == {"mo", "vi"}
    refused = client.post(add, {"person": bob.pk}, follow=True)
    assert "Choose a member of the team" in words(refused) and "bob" not in words(refused)
    # vi (viewer, now on it) sees the cluster but may not change its people: 403
    as_(client, "vi").post(reverse("act_for"), {"team": lab.pk, "next": "/"})
    page = words(client.get(reverse("cluster_detail", args=[cluster.pk])))
    assert 'data-testid="cluster-people"' in page and 'data-testid="person-add"' not in page
    assert client.post(add, {"person": user("ada").pk}).status_code == 403
    remove_mo = reverse("cluster_person_remove", args=[cluster.pk, user("mo").pk])
    assert client.post(remove_mo).status_code == 403
    # ada (admin) takes vi off; the timeline says who did it
    as_(client, "ada").post(reverse("act_for"), {"team": lab.pk, "next": "/"})
    off = client.post(
        reverse("cluster_person_remove", args=[cluster.pk, user("vi").pk]), follow=True
    )
    assert "vi taken off the cluster" in words(off)
    lines = [e.message for e in cluster.events.order_by("at", "pk")]
    assert "mo added vi to the cluster" in lines
    assert any(line.startswith("ada took vi off the cluster") for line in lines)
    # vi no longer sees it: 404; nor does an outsider acting for themselves
    as_(client, "vi").post(reverse("act_for"), {"team": lab.pk, "next": "/"})
    assert client.post(add, {"person": user("vi").pk}).status_code == 404
    assert as_(client, "bob").post(add, {"person": bob.pk}).status_code == 404


def test_taking_a_person_off_detaches_their_ssh_keys_from_the_cluster(client, lab, placed):
    from jobs.models import SshKey

    cluster = placed(lab, "mo", "mo-run")
    key = SshKey.objects.create(
        owner=user("mo"), name="laptop", public_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIF mo",
        key_type="ssh-ed25519", bits=256, fingerprint="SHA256:mo",
    )  # fmt: skip
    cluster.ssh_keys.add(key)
    ada = Actor.for_team(user("ada"), lab.pk)
    teams.cluster_member_remove(actor=ada, cluster=cluster, person=user("mo"))
    assert not cluster.ssh_keys.filter(pk=key.pk).exists()
    assert not cluster.members.filter(username="mo").exists()
    with pytest.raises(ValidationError, match="carol is not in 张老师课题组"):
        teams.cluster_member_add(actor=ada, cluster=cluster, person=person("carol"))
    with pytest.raises(Http404):  # mo, off it and a member, no longer sees it
        teams.cluster_member_add(
            actor=Actor.for_team(user("mo"), lab.pk), cluster=cluster, person=user("mo")
        )


# The switcher


def test_the_switcher_shows_for_team_people_and_the_badge_says_whom_they_act_for(client, lab, bob):
    page = words(as_(client, "bob").get(reverse("dashboard")))
    assert 'data-testid="acting-switch"' not in page, "no team: no switcher"
    client.force_login(user("mo"))
    page = words(client.get(reverse("dashboard")))
    assert 'data-testid="acting-switch"' in page and 'data-testid="acting-bar"' not in page
    switched = client.post(reverse("act_for"), {"team": lab.pk, "next": "/clusters/"})
    assert switched["Location"] == "/clusters/"
    page = words(client.get("/clusters/"))
    bar = page.split('data-testid="acting-bar"', 1)[1].split("</div>", 1)[0]
    assert "张老师课题组" in bar and "member" in bar
    assert f'<option value="{lab.pk}" selected>' in page
    assert client.post(reverse("act_for"), {"team": "", "next": "/"}).status_code == 302
    assert 'data-testid="acting-bar"' not in words(client.get("/"))
    assert as_(client, "bob").post(reverse("act_for"), {"team": lab.pk}).status_code == 404


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)  # the live server's thread reads committed rows
def test_the_team_pages_and_the_switcher_in_chromium(
    browser, live_server, alice, make_cluster, paper_host
):
    team = teams.team_create(person=alice, name="张老师课题组")
    owner = Actor.for_team(alice, team.pk)
    for name, role in (("ada", Role.ADMIN), ("mo", Role.MEMBER)):
        who = person(name)
        invite, _ = teams.invite_create(actor=owner, role=role, login=name)
        teams.invite_accept(person=who, invite=invite)
    teams.member_set_caps(
        actor=owner, member=member(team, "mo"), monthly_cap=Decimal("800"), gpu_cap=2
    )
    _, token = teams.invite_create(actor=owner, role=Role.MEMBER)
    person("newbie")
    cluster = make_cluster(team.principal, "mo-run", created_by=user("mo"))
    scheduler.place_pending()
    other = teams.team_create(person=person("zhang"), name="Vision lab")
    teams.invite_create(
        actor=Actor.for_team(user("zhang"), other.pk), role=Role.VIEWER, login="alice"
    )
    for language, locale in (("en", "en-US"), ("zh-hans", "zh-CN")):
        for width in (1280, 390):
            context = browser.new_context(viewport={"width": width, "height": 900}, locale=locale)
            page = context.new_page()
            login(page, live_server, "alice", "alice-pass-123")
            _shoot_teams(page, live_server, team, f"{language}-{width}")
            _shoot_people(page, live_server, cluster, f"{language}-{width}")
            context.close()
            _shoot_join(browser, live_server, token, width, locale, f"{language}-{width}")


def _shoot_teams(page, live_server, team, tag):
    """/teams/, the switcher switched to the team (its badge), the team page with a member's
    actions open and a new link shown: none wider than the window."""
    page.goto(f"{live_server.url}/teams/")
    _fits(page, f"teams-{tag}")
    page.select_option("[data-testid=acting-select]", str(team.pk))
    page.wait_for_selector("[data-testid=acting-bar]")
    assert "张老师课题组" in page.inner_text("[data-testid=acting-bar]")
    page.goto(f"{live_server.url}/teams/{team.pk}/")
    page.fill("#id_login", "")
    page.click("[data-testid=invite-form] button[type=submit]")
    page.wait_for_selector("[data-testid=invite-url]")
    # Copy (static/js/copy.js) takes the link itself to the clipboard, and says it did.
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    copy = page.locator("[data-testid=invite-url] + [data-copy]")
    copy.click()
    assert page.evaluate("navigator.clipboard.readText()") == page.inner_text(
        "[data-testid=invite-url]"
    )
    assert copy.inner_text() == copy.get_attribute("data-copied")
    page.click("[data-testid=member-mo] summary")
    _fits(page, f"team-{tag}")
    page.select_option("[data-testid=acting-select]", "")
    page.wait_for_selector("[data-testid=acting-bar]", state="detached")
    assert page.url == f"{live_server.url}/teams/{team.pk}/", "back where it was switched"


def _shoot_people(page, live_server, cluster, tag):
    """The team cluster's People card, acting for the team: alice (owner) adds ada."""
    page.select_option("[data-testid=acting-select]", str(cluster.owner.team.pk))
    page.wait_for_selector("[data-testid=acting-bar]")
    page.goto(f"{live_server.url}/clusters/{cluster.pk}/")
    if page.locator("[data-testid=person-remove-ada]").count() == 0:
        page.select_option("#id_person", label="ada")
        page.click("[data-testid=person-add]")
        page.wait_for_selector("[data-testid=person-remove-ada]")
    _fits(page, f"cluster-people-{tag}")
    page.get_by_test_id("cluster-people").screenshot(
        path=os.path.join(SHOTS, f"cluster-people-card-{tag}.png")
    )


def _shoot_join(browser, live_server, token, width, locale, tag):
    """The link opened logged out: through the log-in and back to the invitation."""
    context = browser.new_context(viewport={"width": width, "height": 900}, locale=locale)
    page = context.new_page()
    page.goto(f"{live_server.url}/teams/join/{token}/")
    page.fill("#id_username", "newbie")
    page.fill("#id_password", "newbie-pass-123")
    page.click("button[type=submit]")
    page.wait_for_load_state()
    assert page.url == f"{live_server.url}/teams/join/{token}/", page.content()[-3000:]
    assert "张老师课题组" in page.inner_text("[data-testid=team-join]")
    _fits(page, f"team-join-{tag}")
    context.close()


def _fits(page, name):
    wide = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    page.screenshot(path=os.path.join(SHOTS, f"{name}.png"), full_page=True)
    assert wide <= 0, f"{name}: {wide}px wider than the window"

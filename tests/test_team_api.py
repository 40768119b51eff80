"""Teams through the token API (/api/v1/teams, console/api_teams.py): every endpoint as the
owner, and each refused for the role below it (403, in words) or for someone outside the
team (404, as a team that does not exist); tokens made acting for a team, the
X-Suanli-Team header, a removed member's token, and a team's principal that never holds a
token."""

import json

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.http import Http404
from django.test import Client

from console.models import ApiToken
from jobs.models import Cluster, TeamInvite, TeamMember
from jobs.teams import services as teams
from jobs.tenancy.actors import Actor

pytestmark = pytest.mark.django_db

Role = TeamMember.Role


def person(name):
    return get_user_model().objects.create_user(name, password=f"{name}-pass-123")


class Api:
    """One token's calls, as JSON in and out."""

    def __init__(self, user, *, team=None, header=None):
        _, token = ApiToken.issue(user=user, name="t", team=team)
        extra = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
        if header is not None:
            extra["HTTP_X_SUANLI_TEAM"] = str(header)
        self.client = Client(**extra)
        self.token = token

    def __call__(self, method, path, body=None):
        if method == "get":
            answer = self.client.get(f"/api/v1/{path}")
        else:
            answer = getattr(self.client, method)(
                f"/api/v1/{path}", json.dumps(body or {}), content_type="application/json"
            )
        return answer.status_code, (answer.json() if answer.content else None)


@pytest.fixture
def lab(alice):
    """Alice's lab: alice owner, ada admin, mo member, vi viewer."""
    team = teams.team_create(person=alice, name="张老师课题组")
    owner = Actor.for_team(alice, team.pk)
    for login, role in (("ada", Role.ADMIN), ("mo", Role.MEMBER), ("vi", Role.VIEWER)):
        who = person(login)
        invite, _ = teams.invite_create(actor=owner, role=role, login=login)
        teams.invite_accept(person=who, invite=invite)
    return team


def who(login):
    return get_user_model().objects.get(username=login)


def member_id(team, login):
    return TeamMember.objects.get(team=team, person__username=login).pk


def test_a_researcher_makes_a_team_lists_it_and_renames_it(alice, bob):
    api = Api(alice)
    status, made = api("post", "teams", {"name": "  Vision   lab "})
    assert status == 201 and made["name"] == "Vision lab" and made["role"] == "owner"
    assert made["members"] == 1
    assert api("post", "teams", {"name": " "}) == (400, {"error": "Give the team a name.",
                                                          "fields": {}})  # fmt: skip
    status, listed = api("get", "teams")
    assert status == 200 and [t["id"] for t in listed["teams"]] == [made["id"]]
    assert listed["count"] == 1 and listed["pages"] == 1
    status, shown = api("get", f"teams/{made['id']}")
    assert status == 200 and shown["share"] == 1 and shown["gpu_limit"] is None
    assert shown["monthly_cap"] is None
    status, renamed = api("patch", f"teams/{made['id']}", {"name": "Vision"})
    assert status == 200 and renamed["name"] == "Vision"
    # Bob is not in it: every path of it is 404, as a team that does not exist.
    bobs = Api(bob)
    assert bobs("get", "teams")[1]["teams"] == []
    for method, path in (("get", ""), ("patch", ""), ("get", "/members"),
                         ("get", "/invitations"), ("post", "/leave")):  # fmt: skip
        status, said = bobs(method, f"teams/{made['id']}{path}", {"name": "x"})
        assert status == 404, (method, path, said)
    assert bobs("get", "teams/999999")[0] == 404


def test_each_role_is_refused_what_the_role_above_it_may_do(alice, lab):
    owner, admin, member, viewer = (Api(who(n)) for n in ("alice", "ada", "mo", "vi"))
    t = f"teams/{lab.pk}"
    status, said = viewer("patch", t, {"name": "mine"})
    assert status == 403 and "viewer" in said["error"] and "admin" in said["error"]
    assert member("patch", t, {"name": "mine"})[0] == 403
    assert member("get", f"{t}/invitations")[0] == 403
    assert member("post", f"{t}/invitations", {"role": "viewer"})[0] == 403
    assert member("patch", f"{t}/members/{member_id(lab, 'vi')}", {"role": "member"})[0] == 403
    assert member("delete", f"{t}/members/{member_id(lab, 'vi')}")[0] == 403
    # Admins manage those below them, not other admins nor the owner; only the owner caps.
    assert admin("patch", f"{t}/members/{member_id(lab, 'vi')}", {"role": "member"})[0] == 200
    status, said = admin("post", f"{t}/invitations", {"role": "admin", "login": "nobody"})
    assert status == 403 and "owner" in said["error"]
    assert admin("put", f"{t}/members/{member_id(lab, 'mo')}/caps", {"gpu_cap": 1})[0] == 403
    assert admin("delete", f"{t}/members/{member_id(lab, 'alice')}")[0] == 403
    assert owner("patch", f"{t}/members/{member_id(lab, 'ada')}", {"role": "member"})[0] == 200
    assert owner("patch", f"{t}/members/{member_id(lab, 'ada')}", {"role": "owner"})[0] == 400
    # Every role reads the team and its members; caps are shown to admins and to oneself.
    status, rows = viewer("get", f"{t}/members")
    assert status == 200 and [r["login"] for r in rows["members"]] == ["alice", "ada", "mo", "vi"]
    assert viewer("get", t)[0] == 200


def test_the_owner_sets_caps_and_they_show_to_the_member_alone(alice, lab):
    owner, member, viewer = Api(alice), Api(who("mo")), Api(who("vi"))
    path = f"teams/{lab.pk}/members/{member_id(lab, 'mo')}/caps"
    status, row = owner("put", path, {"monthly_cap": "800.00", "gpu_cap": 2})
    assert status == 200 and row["monthly_cap"] == "800.00" and row["gpu_cap"] == 2
    status, said = owner("put", path, {"monthly_cap": "8.001"})
    assert status == 400 and "monthly_cap" in said["fields"]
    assert owner("put", path, {"monthly_cap": "-1"})[1]["error"] == "A budget cannot be negative."
    assert owner("put", path, {"gpu_cap": "two"})[0] == 400
    assert member("get", f"teams/{lab.pk}")[1]["monthly_cap"] == "800.00"
    mine = {r["login"]: r for r in member("get", f"teams/{lab.pk}/members")[1]["members"]}
    assert mine["mo"]["gpu_cap"] == 2
    theirs = {r["login"]: r for r in viewer("get", f"teams/{lab.pk}/members")[1]["members"]}
    assert theirs["mo"]["gpu_cap"] is None and theirs["mo"]["monthly_cap"] is None
    status, row = owner("put", path, {"monthly_cap": None, "gpu_cap": None})
    assert status == 200 and row["monthly_cap"] is None


def test_invitations_by_link_and_by_login_through_the_api(alice, bob, lab):
    owner, bobs = Api(alice), Api(bob)
    t = f"teams/{lab.pk}"
    status, link = owner("post", f"{t}/invitations", {"role": "member", "days": 3})
    assert status == 201 and link["token"].startswith("sli_") and link["login"] is None
    assert owner("post", f"{t}/invitations", {"days": 31})[0] == 400
    status, listed = owner("get", f"{t}/invitations")
    listed = listed["invitations"]
    assert [i["id"] for i in listed] == [link["id"]] and "token" not in listed[0]
    assert not TeamInvite.objects.filter(digest=link["token"]).exists()  # only its digest

    status, joined = bobs("post", "teams/invitations/accept", {"token": link["token"]})
    assert status == 200 and joined["id"] == lab.pk and joined["role"] == "member"
    status, said = bobs("post", "teams/invitations/accept", {"token": link["token"]})
    assert status == 400 and "used, revoked or has expired" in said["error"]

    carol, dave = person("carol"), person("dave")
    status, to_carol = owner("post", f"{t}/invitations", {"role": "viewer", "login": "carol"})
    assert status == 201 and to_carol["token"] is None and to_carol["login"] == "carol"
    assert owner("post", f"{t}/invitations", {"login": "nobody"})[0] == 400
    carols, daves = Api(carol), Api(dave)
    mine = carols("get", "teams/invitations")[1]["invitations"]
    assert [i["id"] for i in mine] == [to_carol["id"]] and mine[0]["team_name"] == lab.name
    assert daves("get", "teams/invitations")[1]["invitations"] == []
    assert daves("post", f"teams/invitations/{to_carol['id']}/accept")[0] == 404
    assert carols("post", f"teams/invitations/{to_carol['id']}/accept")[1]["role"] == "viewer"

    _, to_dave = owner("post", f"{t}/invitations", {"login": "dave"})
    assert daves("post", f"teams/invitations/{to_dave['id']}/decline")[0] == 204
    assert daves("post", f"teams/invitations/{to_dave['id']}/accept")[0] == 404

    _, revoked = owner("post", f"{t}/invitations", {"role": "member"})
    assert Api(who("mo"))("delete", f"{t}/invitations/{revoked['id']}")[0] == 403
    assert owner("delete", f"{t}/invitations/{revoked['id']}")[0] == 204
    assert owner("delete", f"{t}/invitations/{revoked['id']}")[0] == 404
    status, said = Api(person("erin"))("post", "teams/invitations/accept",
                                       {"token": revoked["token"]})  # fmt: skip
    assert status == 400


def test_removing_and_leaving_hand_or_stop_their_clusters(alice, lab, make_cluster):
    owner, mo = Api(alice), Api(who("mo"))
    made = make_cluster(owner=lab.principal, name="mo-run", created_by=who("mo"))
    made.members.add(who("mo"))
    status, parted = owner("delete", f"teams/{lab.pk}/members/{member_id(lab, 'mo')}?clusters=hand")
    assert status == 200 and parted == {"handed": [made.pk], "stopped": [], "restarted": []}
    assert Cluster.objects.get(pk=made.pk).created_by == alice
    assert mo("get", f"teams/{lab.pk}")[0] == 404
    assert owner("delete", f"teams/{lab.pk}/members/{member_id(lab, 'vi')}?clusters=burn")[0] == 400

    status, left = Api(who("vi"))("post", f"teams/{lab.pk}/leave", {"clusters": "stop"})
    assert status == 200 and left == {"handed": [], "stopped": [], "restarted": []}
    status, said = owner("post", f"teams/{lab.pk}/leave")
    assert status == 400 and "owner cannot leave" in said["error"]


def test_a_token_made_for_a_team_acts_for_it_and_no_other(alice, lab, make_cluster):
    other = teams.team_create(person=alice, name="Other lab")
    for_lab = Api(who("mo"), team=lab)
    ours = make_cluster(owner=lab.principal, name="ours", created_by=who("mo"))
    ours.members.add(who("mo"))
    mine = make_cluster(owner=who("mo"), name="mine")
    status, rows = for_lab("get", "clusters")
    assert status == 200 and [c["id"] for c in rows["clusters"]] == [ours.pk]
    assert [t["id"] for t in for_lab("get", "teams")[1]["teams"]] == [lab.pk]
    # It acts for its team only: not for another by the header, nor for its maker alone.
    status, said = Api(alice, team=lab, header=other.pk)("get", "clusters")
    assert status == 403 and "X-Suanli-Team" in said["error"]
    assert Api(alice, team=lab, header=lab.pk)("get", "clusters")[0] == 200
    assert Api(alice, team=lab)("get", f"teams/{other.pk}")[0] == 404
    status, said = for_lab("post", "teams", {"name": "side"})
    assert status == 403 and "personal token" in said["error"]
    assert for_lab("get", "teams/invitations")[0] == 403
    assert mine.pk not in [c["id"] for c in for_lab("get", "clusters")[1]["clusters"]]
    # A viewer's token for the team reads, and is refused the team's writes (403).
    assert Api(who("vi"), team=lab)("patch", f"teams/{lab.pk}", {"name": "x"})[0] == 403


def test_a_personal_token_acts_for_a_team_by_the_header_while_a_member(alice, bob, lab,
                                                                       make_cluster):  # fmt: skip
    ours = make_cluster(owner=lab.principal, name="ours", created_by=alice)
    status, rows = Api(alice, header=lab.pk)("get", "clusters")
    assert status == 200 and [c["id"] for c in rows["clusters"]] == [ours.pk]
    assert Api(alice)("get", "clusters")[1]["clusters"] == []
    for header in (lab.pk, 999999, "lab", ""):
        status, said = Api(bob, header=header)("get", "clusters")
        if header == "":
            assert status == 200  # no header: bob for himself
        else:
            assert (status, said["error"]) == (404, "No such team."), header


def test_a_removed_members_tokens_for_the_team_stop_at_once(alice, lab):
    for_lab = Api(who("mo"), team=lab)
    personal = Api(who("mo"), header=lab.pk)
    assert for_lab("get", "clusters")[0] == 200 and personal("get", "clusters")[0] == 200
    assert Api(alice)("delete", f"teams/{lab.pk}/members/{member_id(lab, 'mo')}")[0] == 200
    status, said = for_lab("get", "clusters")
    assert status == 401 and "not valid" in said["error"]
    assert personal("get", "clusters") == (404, {"error": "No such team.", "fields": {}})
    with pytest.raises(Http404):  # no longer a member
        ApiToken.issue(user=who("mo"), name="again", team=lab)
    # Invited again, the old token stays dead: removal ended it for good; a new one works.
    invite, _ = teams.invite_create(actor=Actor.for_team(alice, lab.pk), role="member", login="mo")
    teams.invite_accept(person=who("mo"), invite=invite)
    assert for_lab("get", "clusters")[0] == 401
    assert Api(who("mo"), team=lab)("get", "clusters")[0] == 200
    assert personal("get", "clusters")[0] == 200


def test_a_team_s_principal_never_holds_a_token(alice, lab):
    with pytest.raises(ValidationError, match="A team cannot hold an API token"):
        ApiToken.issue(user=lab.principal, name="sneaky")
    # One put there behind the API's back (the admin, a script) is refused all the same.
    row, token = ApiToken.issue(user=alice, name="moved")
    ApiToken.objects.filter(pk=row.pk).update(user=lab.principal)
    answer = Client(HTTP_AUTHORIZATION=f"Bearer {token}").get("/api/v1/clusters")
    assert answer.status_code == 401


def test_the_tokens_page_makes_a_token_for_whom_the_person_acts_for(alice, lab, client):
    client.force_login(alice)
    client.post("/acting/", {"team": lab.pk})
    page = client.post("/api/tokens/", {"action": "create", "name": "lab-ci"})
    assert page.status_code == 200
    row = ApiToken.objects.get(user=alice, name="lab-ci")
    assert row.team == lab
    assert "张老师课题组" in page.content.decode()
    client.post("/acting/", {"team": ""})
    client.post("/api/tokens/", {"action": "create", "name": "mine"})
    assert ApiToken.objects.get(user=alice, name="mine").team is None


def test_the_rate_limit_stays_per_person_across_teams(alice, lab, settings):
    settings.SUANLI_API_RATE_PER_MIN = 3
    personal, for_lab = Api(alice), Api(alice, team=lab)
    answers = [personal("get", "teams")[0], for_lab("get", "teams")[0],
               personal("get", "teams")[0], for_lab("get", "teams")[0]]  # fmt: skip
    assert answers == [200, 200, 200, 429]

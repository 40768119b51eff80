"""`suanli teams` and `suanli --team`, run as a researcher runs them (a process of its own,
with its own home folder) against the console's live server: a lab made, members invited by
link and by login, roles and caps set, a member's refusal, acting for the team in another
command, and a removed member who can no longer act for it. No engine: teams need none."""

import json

import pytest
from test_cli import Cli

from console.models import ApiToken
from jobs.models import Team, TeamMember

pytestmark = pytest.mark.django_db


def person(name):
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_user(name, password=f"{name}-pass-123")


def logged_in(user, url, tmp_path) -> Cli:
    _, token = ApiToken.issue(user=user, name="laptop")
    cli = Cli(tmp_path / user.username)
    cli.env.update(SUANLI_URL=url, SUANLI_TOKEN=token)
    return cli


def test_a_lab_is_run_from_the_command_line(live_server, alice, bob, tmp_path):
    url = live_server.url
    owner, student = logged_in(alice, url, tmp_path), logged_in(bob, url, tmp_path)
    made = owner.json("teams", "create", "Vision lab")
    assert made["role"] == "owner" and Team.objects.get(pk=made["id"]).name == "Vision lab"
    assert "Vision lab" in owner("teams", "list").stdout

    link = owner.json("teams", "invite", "Vision lab", "--link", "--role", "member")
    assert link["token"].startswith("sli_")
    assert owner("teams", "invite", "Vision lab", ok=False).returncode == 2  # --login or --link
    joined = student("teams", "accept", link["token"]).stdout
    assert "You joined Vision lab" in joined and "as member" in joined
    members = owner("teams", "members", "Vision lab").stdout
    assert "bob" in members and "member" in members

    done = owner("teams", "caps", "Vision lab", "bob", "--monthly", "800", "--gpus", "2")
    assert "monthly budget 800.00, GPUs 2" in done.stdout
    refused = student.json_error("teams", "caps", str(made["id"]), "bob", "--gpus", "9")
    assert refused["status"] == 403 and "member" in refused["error"]
    assert owner.json("teams", "role", "Vision lab", "bob", "viewer")["role"] == "viewer"
    shown = student.json("teams", "show", "Vision lab")
    assert shown["role"] == "viewer" and shown["monthly_cap"] == "800.00"

    # By login: carol sees it among her invitations and accepts it by its id.
    carol = logged_in(person("carol"), url, tmp_path)
    to_carol = owner.json("teams", "invite", "Vision lab", "--login", "carol", "--role", "viewer")
    assert [i["id"] for i in carol.json("teams", "invitations")["invitations"]] == [to_carol["id"]]
    assert "as viewer" in carol("teams", "accept", to_carol["id"]).stdout
    # An open link revoked: listed, then gone, and its token joins nobody.
    spare = owner.json("teams", "invite", "Vision lab", "--link")
    listed = owner.json("teams", "invitations", "Vision lab")["invitations"]
    assert [i["id"] for i in listed] == [spare["id"]]
    assert "revoked" in owner("teams", "revoke", "Vision lab", spare["id"]).stdout
    dave = logged_in(person("dave"), url, tmp_path)
    said = dave.json_error("teams", "accept", spare["token"])
    assert "used, revoked or has expired" in said["error"]
    to_dave = owner.json("teams", "invite", "Vision lab", "--login", "dave")
    assert "declined" in dave("teams", "decline", to_dave["id"]).stdout

    assert "You left Vision lab" in carol("teams", "leave", "Vision lab").stdout
    removed = owner.json("teams", "remove", "Vision lab", "bob", "--clusters", "stop")
    assert removed == {"handed": [], "stopped": [], "restarted": []}
    assert not TeamMember.objects.filter(person=bob).exists()
    gone = student.json_error("teams", "show", "Vision lab")
    assert "no team named 'Vision lab'" in gone["error"]


def test_team_acts_for_a_team_in_any_command(
    live_server, alice, bob, make_cluster, tmp_path
):  # fmt: skip
    from jobs.teams import services as teams

    lab = teams.team_create(person=alice, name="Vision lab")
    ours = make_cluster(owner=lab.principal, name="lab-run", created_by=alice)
    make_cluster(owner=alice, name="own-run")
    cli = logged_in(alice, live_server.url, tmp_path)

    def names(*args):
        return {c["name"] for c in json.loads(cli(*args, "--json").stdout)["clusters"]}

    assert names("clusters", "list") == {"own-run"}
    assert names("--team", "Vision lab", "clusters", "list") == {ours.name}
    assert names("--team", lab.pk, "clusters", "list") == {ours.name}
    cli.env["SUANLI_TEAM"] = "Vision lab"
    assert names("clusters", "list") == {ours.name}
    assert names("--team", "me", "clusters", "list") == {"own-run"}
    del cli.env["SUANLI_TEAM"]

    # Saved as the default (with the login), until `teams use` without a team.
    cli("login", "--url", live_server.url, "--token", cli.env.pop("SUANLI_TOKEN"))
    cli.env.pop("SUANLI_URL")
    assert "You act for Vision lab now" in cli("teams", "use", "Vision lab").stdout
    assert json.loads(cli.config.read_text())["team"] == str(lab.pk)
    assert names("clusters", "list") == {ours.name}
    cli("teams", "use")
    assert names("clusters", "list") == {"own-run"}

    # A team one is not in: said in words, nothing sent for it.
    done = cli("--team", "Other lab", "clusters", "list", ok=False)
    assert done.returncode == 1 and "you are in no team named 'Other lab'" in done.stderr
    outsider = logged_in(bob, live_server.url, tmp_path)
    refused = outsider.json_error("--team", lab.pk, "clusters", "list")
    assert "no team named" in refused["error"]

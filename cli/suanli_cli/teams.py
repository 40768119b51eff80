"""`suanli teams`: your teams (课题组): make one, read it and its members, invite by login or
by link, revoke, change roles and caps, remove members, leave, and join by a link's token.
The same rules as the console's Teams pages (the API's /api/v1/teams). A TEAM is its name or
its id; a MEMBER their login. `suanli --team TEAM <command>` acts for a team in any other
command; `suanli teams use TEAM` saves it as the default."""

from __future__ import annotations

import click

from suanli_cli.core import (
    Api,
    Failure,
    all_pages,
    emit_json,
    group_json,
    json_option,
    print_fields,
    read_config,
    table,
    wants_json,
    when,
    write_config,
)
from suanli_cli.main import cli

ROLES = ("admin", "member", "viewer")


@cli.group()
@json_option
@click.pass_context
def teams(ctx, as_json):
    """Your teams: members, roles, budgets, invitations."""
    group_json(ctx, as_json)


def _api() -> Api:
    return Api.from_config(acting=False)  # a team command names its team itself


def _team(api: Api, ref: str) -> dict:
    return api.team_by_ref(ref)


def _member(api: Api, team: dict, login: str) -> dict:
    for row in all_pages(api, f"teams/{team['id']}/members", "members"):
        if row["login"] == login:
            return row
    raise Failure(f"{login} is not in {team['name']}.")


def _done(as_json: bool, data, words: str) -> None:
    if wants_json(as_json):
        emit_json(data)
    else:
        click.echo(words)


@teams.command("list")
@json_option
def teams_list(as_json):
    """The teams you are in, with your role."""
    rows = all_pages(_api(), "teams", "teams")
    if wants_json(as_json):
        emit_json({"teams": rows, "count": len(rows)})
        return
    table(rows, [("id", "ID"), ("name", "NAME"), ("role", "ROLE"), ("members", "MEMBERS")])


@teams.command("create")
@click.argument("name")
@json_option
def teams_create(name, as_json):
    """Make a team; you become its owner."""
    made = _api().post("teams", "the team", {"name": name})
    _done(as_json, made, f"Team {made['id']}: {made['name']} (you are its owner).")


@teams.command("show")
@click.argument("team")
@json_option
def teams_show(team, as_json):
    """A team: your role and caps in it, its share and GPU limit."""
    api = _api()
    data = api.get(f"teams/{_team(api, team)['id']}", f"team {team}")
    if wants_json(as_json):
        emit_json(data)
        return
    print_fields(data, ["id", "name", "role", "members", "monthly_cap", "gpu_cap", "share",
                        "gpu_limit"])  # fmt: skip


@teams.command("members")
@click.argument("team")
@json_option
def teams_members(team, as_json):
    """A team's members, their roles and caps (caps: to admins and to yourself)."""
    api = _api()
    rows = all_pages(api, f"teams/{_team(api, team)['id']}/members", "members")
    if wants_json(as_json):
        emit_json({"members": rows, "count": len(rows)})
        return
    rows = [{**r, "joined_at": when(r.get("joined_at"))} for r in rows]
    table(rows, [("login", "LOGIN"), ("name", "NAME"), ("role", "ROLE"),
                 ("monthly_cap", "MONTHLY CAP"), ("gpu_cap", "GPU CAP"),
                 ("joined_at", "JOINED")])  # fmt: skip


@teams.command("invitations")
@click.argument("team", required=False)
@json_option
def teams_invitations(team, as_json):
    """Open invitations: a TEAM's (admins), or without TEAM those made to you."""
    api = _api()
    path = f"teams/{_team(api, team)['id']}/invitations" if team else "teams/invitations"
    rows = all_pages(api, path, "invitations")
    if wants_json(as_json):
        emit_json({"invitations": rows, "count": len(rows)})
        return
    rows = [{**r, "login": r.get("login") or "(by link)", "expires_at": when(r["expires_at"])}
            for r in rows]  # fmt: skip
    table(rows, [("id", "ID"), ("team_name", "TEAM"), ("role", "ROLE"), ("login", "FOR"),
                 ("created_by", "BY"), ("expires_at", "EXPIRES")])  # fmt: skip


@teams.command("invite")
@click.argument("team")
@click.option("--login", help="Invite this researcher (they accept it themselves).")
@click.option("--link", is_flag=True, help="Invite by a link's token, printed this once.")
@click.option("--role", type=click.Choice(ROLES), default="member", show_default=True)
@click.option("--days", type=int, default=None, help="How long it stays open (1-30).")
@json_option
def teams_invite(team, login, link, role, days, as_json):
    """Invite someone, by --login or by --link."""
    if bool(login) == link:
        raise click.UsageError("give --login LOGIN or --link (one of them).")
    api = _api()
    body = {"role": role, "login": login, "days": days}
    made = api.post(f"teams/{_team(api, team)['id']}/invitations", f"team {team}",
                    {k: v for k, v in body.items() if v is not None})  # fmt: skip
    if wants_json(as_json):
        emit_json(made)
        return
    click.echo(f"Invitation {made['id']} to {made['team_name']} as {made['role']}, open "
               f"until {when(made['expires_at'])}.")  # fmt: skip
    if made.get("token"):
        click.echo(f"Token (shown once; they run `suanli teams accept TOKEN`): {made['token']}")
    else:
        click.echo(f"{made['login']} accepts it with `suanli teams accept {made['id']}`.")


@teams.command("revoke")
@click.argument("team")
@click.argument("invitation_id", type=int, metavar="INVITATION")
@json_option
def teams_revoke(team, invitation_id, as_json):
    """Revoke an open invitation: its link or login can no longer join."""
    api = _api()
    api.delete(f"teams/{_team(api, team)['id']}/invitations/{invitation_id}",
               f"invitation {invitation_id}")  # fmt: skip
    _done(as_json, {"revoked": invitation_id}, f"Invitation {invitation_id} revoked.")


@teams.command("role")
@click.argument("team")
@click.argument("login", metavar="MEMBER")
@click.argument("role", type=click.Choice(ROLES))
@json_option
def teams_role(team, login, role, as_json):
    """Change a member's role (admins: member and viewer; the owner: admin too)."""
    api = _api()
    found = _team(api, team)
    member = _member(api, found, login)
    row = api.patch(f"teams/{found['id']}/members/{member['id']}", login, {"role": role})
    _done(as_json, row, f"{login} is now {row['role']} in {found['name']}.")


def _cap(value: str | None):
    """`none` clears a cap; left out, it stays as it is."""
    if value is None:
        return ...
    return None if value.strip().lower() in ("none", "") else value


@teams.command("caps")
@click.argument("team")
@click.argument("login", metavar="MEMBER")
@click.option("--monthly", metavar="AMOUNT", help='A monthly budget, e.g. 800; "none": no cap.')
@click.option("--gpus", metavar="N", help='The most GPUs they hold at once; "none": no cap.')
@json_option
def teams_caps(team, login, monthly, gpus, as_json):
    """Set a member's monthly budget and GPU cap (the owner alone)."""
    body = {"monthly_cap": _cap(monthly), "gpu_cap": _cap(gpus)}
    body = {k: v for k, v in body.items() if v is not ...}
    if not body:
        raise click.UsageError("give --monthly and/or --gpus.")
    api = _api()
    found = _team(api, team)
    member = _member(api, found, login)
    row = api.put(f"teams/{found['id']}/members/{member['id']}/caps", login, body)
    _done(as_json, row, f"{login}: monthly budget {row['monthly_cap'] or 'no cap'}, GPUs "
               f"{row['gpu_cap'] if row['gpu_cap'] is not None else 'no cap'}.")  # fmt: skip


def _parted(data: dict, who: str) -> str:
    handed = ", ".join(map(str, data.get("handed", []))) or "none"
    stopped = ", ".join(map(str, data.get("stopped", []))) or "none"
    restarted = ", ".join(map(str, data.get("restarted", []))) or "none"
    return (
        f"{who}. Clusters handed to the owner: {handed}; stopped (files kept): {stopped}; "
        f"workspaces restarted: {restarted}."
    )


CLUSTERS = click.option(
    "--clusters", type=click.Choice(("hand", "stop")), default="hand", show_default=True,
    help="Their clusters in the team: hand them to the owner, or stop them (files kept).",
)  # fmt: skip


@teams.command("remove")
@click.argument("team")
@click.argument("login", metavar="MEMBER")
@CLUSTERS
@click.option(
    "--restart/--no-restart", default=True, show_default=True,
    help="Restart the workspaces of the team clusters they could log in to (ends anything "
    "they left running; files kept).",
)  # fmt: skip
@json_option
def teams_remove(team, login, clusters, restart, as_json):
    """Remove a member at once (their tokens for the team, SSH sessions and terminals end)."""
    api = _api()
    found = _team(api, team)
    member = _member(api, found, login)
    done = api.delete(
        f"teams/{found['id']}/members/{member['id']}", login, clusters=clusters,
        restart="true" if restart else "false",
    )  # fmt: skip
    _done(as_json, done, _parted(done, f"{login} removed from {found['name']}"))


@teams.command("leave")
@click.argument("team")
@CLUSTERS
@json_option
def teams_leave(team, clusters, as_json):
    """Leave a team (the owner hands ownership on first)."""
    api = _api()
    found = _team(api, team)
    done = api.post(f"teams/{found['id']}/leave", f"team {team}", {"clusters": clusters})
    _done(as_json, done, _parted(done, f"You left {found['name']}"))


@teams.command("accept")
@click.argument("token")
@json_option
def teams_accept(token, as_json):
    """Join a team: TOKEN is a link's token (sli_...) or the id of an invitation made to
    your login (`suanli teams invitations`)."""
    api = _api()
    if token.strip().isdigit():
        joined = api.post(f"teams/invitations/{token.strip()}/accept", f"invitation {token}")
    else:
        joined = api.post("teams/invitations/accept", "the invitation", {"token": token})
    _done(
        as_json, joined, f"You joined {joined['name']} (team {joined['id']}) as {joined['role']}."
    )


@teams.command("decline")
@click.argument("invitation_id", type=int, metavar="INVITATION")
@json_option
def teams_decline(invitation_id, as_json):
    """Decline an invitation made to your login."""
    _api().post(f"teams/invitations/{invitation_id}/decline", f"invitation {invitation_id}")
    _done(as_json, {"declined": invitation_id}, f"Invitation {invitation_id} declined.")


@teams.command("use")
@click.argument("team", required=False)
@json_option
def teams_use(team, as_json):
    """Act for TEAM in every command from now on (saved with your login); without TEAM (or
    `me`), for yourself again. `--team` and SUANLI_TEAM still override it."""
    api = _api()  # logged in (saved, or SUANLI_URL and SUANLI_TOKEN)
    found = None if team in (None, "me") else _team(api, team)
    config = read_config()
    config["team"] = str(found["id"]) if found else ""
    write_config(config)
    _done(as_json, {"team": found}, f"You act for {found['name']} now." if found else
          "You act for yourself now.")  # fmt: skip

"""Teams (课题组) through the token API: /api/v1/teams and below (docs/user/api.md).

Every write goes through jobs/teams/services.py, which checks the actor's role itself; this
module only finds the team through the caller's membership (404 for a team they are not in,
as for one that does not exist) and says the services' refusals as the rest of the API does:
403 in words for what a role may see but not do, 400 in words for a rule broken.

Whom a request acts for is TokenAuth's (console/api.py): a token made acting for a team acts
for that team only, so here it reaches that team and no other, and it cannot make teams or
join them (those are the person's own, done with a personal token).
"""

from decimal import Decimal, InvalidOperation
from typing import Literal

from django.core.exceptions import ValidationError
from django.db.models import Count
from django.http import Http404
from django.utils import timezone
from ninja import Field, Router, Schema, Status
from ninja.pagination import paginate

from console.api import ERRORS, Pages, _error, api
from console.api_schema import Id, Stamp, Whole
from jobs.models import TeamInvite, TeamMember
from jobs.teams import services as teams
from jobs.tenancy.actors import Actor

Role = TeamMember.Role
router = Router(tags=["teams"])


class Refused(Exception):
    """A request this token may not make (403), in words."""


@api.exception_handler(Refused)
def _refused(request, exc):
    return _error(403, str(exc))


# -- shapes ------------------------------------------------------------------------------

_ROLES = Literal["owner", "admin", "member", "viewer"]
_GRANTS = "admin (the owner alone grants it), member or viewer"


def _cap_text(value) -> str | None:
    return None if value is None else str(value)


class TeamOut(Schema):
    """Read from the caller's membership (annotated with the team's member count)."""

    id: int
    name: str
    role: _ROLES = Field(description="your role in it: owner, admin, member or viewer")
    members: int = Field(description="how many people are in it")
    created_at: Stamp

    @staticmethod
    def resolve_id(obj):
        return obj.team_id

    @staticmethod
    def resolve_name(obj):
        return obj.team.name

    @staticmethod
    def resolve_members(obj):
        return obj.n

    @staticmethod
    def resolve_created_at(obj):
        return obj.team.created_at


class TeamDetailOut(TeamOut):
    share: int = Field(description="its weight between teams when the fleet is full (operator's)")
    gpu_limit: int | None = Field(description="the most GPUs it may hold at once (operator's)")
    monthly_cap: str | None = Field(description="your monthly budget in it; null: no cap")
    gpu_cap: int | None = Field(description="the most GPUs you may hold in it; null: no cap")

    @staticmethod
    def resolve_share(obj):
        return obj.team.share

    @staticmethod
    def resolve_gpu_limit(obj):
        return obj.team.gpu_limit

    @staticmethod
    def resolve_monthly_cap(obj):
        return _cap_text(obj.monthly_cap)


class NewTeam(Schema):
    name: str = Field(description="at most 80 characters; you become its owner")


def _shows_caps(obj: TeamMember, context) -> bool:
    """Caps are shown to admins and the owner, and to the member themself."""
    actor = context["request"].team_actor
    return actor.at_least(Role.ADMIN) or obj.person_id == actor.person.pk


class MemberOut(Schema):
    id: int = Field(description="the membership's id (members/{id})")
    login: str
    name: str
    role: _ROLES
    monthly_cap: str | None = Field(
        description="the owner's monthly budget for them; shown to admins, the owner and "
        "the member themself, else null"
    )
    gpu_cap: int | None = Field(description="the most GPUs they may hold; as monthly_cap")
    joined_at: Stamp

    @staticmethod
    def resolve_login(obj):
        return obj.person.get_username()

    @staticmethod
    def resolve_name(obj):
        return obj.person.get_full_name()

    @staticmethod
    def resolve_monthly_cap(obj, context):
        return _cap_text(obj.monthly_cap) if _shows_caps(obj, context) else None

    @staticmethod
    def resolve_gpu_cap(obj, context):
        return obj.gpu_cap if _shows_caps(obj, context) else None


class RoleChange(Schema):
    role: Literal["admin", "member", "viewer"] = Field(description=_GRANTS)


class Caps(Schema):
    monthly_cap: str | None = Field(
        None,
        description='a monthly budget, e.g. "800.00"; null: no cap of their own; left out: '
        "as it is",
    )
    gpu_cap: Whole | None = Field(
        None, description="the most GPUs at once; null: no cap; left out: as it is"
    )


class InviteOut(Schema):
    id: int
    team: int = Field(description="the team's id")
    team_name: str
    role: _ROLES
    login: str | None = Field(description="who alone may accept it; null: by link")
    created_by: str | None
    created_at: Stamp
    expires_at: Stamp

    @staticmethod
    def resolve_team(obj):
        return obj.team_id

    @staticmethod
    def resolve_team_name(obj):
        return obj.team.name

    @staticmethod
    def resolve_login(obj):
        return obj.login.get_username() if obj.login else None

    @staticmethod
    def resolve_created_by(obj):
        return obj.created_by.get_username() if obj.created_by else None


class NewInviteOut(InviteOut):
    token: str | None = Field(
        description="a link's token (sli_...), shown this once: the invitee accepts with it "
        "(POST /teams/invitations/accept); null for an invitation to a login"
    )

    @staticmethod
    def resolve_token(obj):
        return getattr(obj, "token_once", None) or None


class NewInvite(Schema):
    role: Literal["admin", "member", "viewer"] = Field(
        "member", description="member (default), admin (the owner alone grants it) or viewer"
    )
    login: str | None = Field(
        None, description="invite this researcher (they accept it themselves); left out: by link"
    )
    days: Whole | None = Field(None, description="how long it stays open, 1 to 30 days")


class InviteToken(Schema):
    token: str = Field(description="the link's token, sli_...")


class Parting(Schema):
    clusters: Literal["hand", "stop"] = Field(
        "hand",
        description="what happens to the clusters they made in the team: hand (default: "
        "to the owner) or stop (files kept)",
    )


class PartedOut(Schema):
    handed: list[int] = Field(description="clusters handed to the owner")
    stopped: list[int] = Field(description="clusters stopped, files kept")
    restarted: list[int] = Field(
        default_factory=list,
        description="clusters whose workspaces were restarted (every process ended, files kept)",
    )


# -- finding things through the caller ------------------------------------------------------


def _actor(request, team_id: int) -> Actor:
    """The caller acting for team `team_id`: 404 unless they are its member now (and, for a
    request acting for a team, unless it is that team). Kept on the request for the
    schemas (what a role is shown)."""
    acting = request.auth.actor
    if acting.team is not None:
        if acting.team.pk != team_id:
            raise Http404("No such team.")
        request.team_actor = acting
        return acting
    request.team_actor = Actor.for_team(request.auth.user, team_id)
    return request.team_actor


def _person(request, what: str):
    """The person behind the token, for what is theirs alone (making or joining a team); a
    token made for a team acts for that team only."""
    if request.auth.team_id is not None:
        raise Refused(f"This token acts for its team only: {what} with a personal token.")
    return request.auth.user


def _memberships(person):
    """The person's memberships, each with its team's member count, by team name."""
    return (
        TeamMember.objects.filter(person=person)
        .select_related("team")
        .annotate(n=Count("team__memberships"))
        .order_by("team__name", "team_id")
    )


def _member(actor: Actor, member_id: int) -> TeamMember:
    member = (
        TeamMember.objects.select_related("person", "team")
        .filter(pk=member_id, team=actor.team)
        .first()
    )
    if member is None:
        raise Http404("No such member.")
    return member


def _open_invites():
    return TeamInvite.objects.select_related("team", "login", "created_by").filter(
        accepted_at__isnull=True, revoked_at__isnull=True, expires_at__gt=timezone.now()
    )


def _money(raw: str | None) -> Decimal | None:
    if raw is None or str(raw).strip() == "":
        return None
    try:
        value = Decimal(str(raw).strip())
    except InvalidOperation:
        value = None
    if value is None or not value.is_finite() or value.as_tuple().exponent < -2:
        raise ValidationError({"monthly_cap": ['Give an amount, e.g. "800.00".']})
    if value >= Decimal("1e12"):
        raise ValidationError({"monthly_cap": ["Give at most 999999999999.99."]})
    return value.quantize(Decimal("0.01"))  # as stored: "800" reads back "800.00"


# -- invitations made to me, and joining by a link (before /{team_id}: literal paths first) --

_ERRORS = {**ERRORS, 403: ERRORS[404]}  # the API's Error shape; 403 for a role below


def _responses(ok: int, schema) -> dict:
    return {ok: schema, **_ERRORS}


@router.get("/invitations", response=_responses(200, list[InviteOut]),
            summary="Open invitations made to you")  # fmt: skip
@paginate(Pages, items="invitations")
def team_invitations_mine(request):
    """Invitations to your login that you may accept or decline, newest first."""
    person = _person(request, "read your invitations")
    return _open_invites().filter(login=person).order_by("-created_at", "-id")


@router.post("/invitations/accept", response=_responses(200, TeamOut),
             summary="Join a team by an invitation link's token")  # fmt: skip
def team_invitation_accept_token(request, payload: InviteToken):
    person = _person(request, "join a team")
    invite = teams.invite_for_token(payload.token.strip())
    if invite is None:
        raise ValidationError(
            "This invitation was used, revoked or has expired: ask for a new one."
        )
    member = teams.invite_accept(person=person, invite=invite)
    return _memberships(person).get(pk=member.pk)


def _mine(request, invite_id: int) -> tuple[object, TeamInvite]:
    person = _person(request, "answer an invitation")
    invite = _open_invites().filter(pk=invite_id, login=person).first()
    if invite is None:
        raise Http404("No such invitation.")
    return person, invite


@router.post("/invitations/{invite_id}/accept", response=_responses(200, TeamOut),
             summary="Accept an invitation made to your login")  # fmt: skip
def team_invitation_accept(request, invite_id: Id):
    person, invite = _mine(request, invite_id)
    member = teams.invite_accept(person=person, invite=invite)
    return _memberships(person).get(pk=member.pk)


@router.post("/invitations/{invite_id}/decline", response={204: None, **_ERRORS},
             summary="Decline an invitation made to your login")  # fmt: skip
def team_invitation_decline(request, invite_id: Id):
    person, invite = _mine(request, invite_id)
    teams.invite_decline(person=person, invite=invite)
    return Status(204, None)


# -- teams -------------------------------------------------------------------------------


@router.get("", response=_responses(200, list[TeamOut]), summary="Your teams")
@paginate(Pages, items="teams")
def teams_list(request):
    """The teams you are in, with your role, by name (a team's token: that team only)."""
    members = _memberships(request.auth.user)
    if request.auth.actor.team is not None:
        members = members.filter(team=request.auth.actor.team)
    return members


@router.post("", response=_responses(201, TeamOut), summary="Make a team")
def team_create(request, payload: NewTeam):
    """You become its owner; it has its own balance, clusters and storage."""
    person = _person(request, "make a team")
    team = teams.team_create(person=person, name=payload.name)
    return Status(201, _memberships(person).get(team=team))


def _detail(actor: Actor) -> TeamMember:
    return _memberships(actor.person).get(pk=actor.membership.pk)


@router.get("/{team_id}", response=_responses(200, TeamDetailOut), summary="A team")
def team(request, team_id: Id):
    return _detail(_actor(request, team_id))


@router.patch("/{team_id}", response=_responses(200, TeamDetailOut), summary="Rename a team")
def team_rename(request, team_id: Id, payload: NewTeam):
    """Admins and the owner."""
    actor = _actor(request, team_id)
    teams.team_rename(actor=actor, name=payload.name)
    return _detail(_actor(request, team_id))


@router.post("/{team_id}/leave", response=_responses(200, PartedOut), summary="Leave a team")
def team_leave(request, team_id: Id, payload: Parting = None):
    """Your clusters in it are handed to the owner or stopped; the owner cannot leave."""
    actor = _actor(request, team_id)
    clusters = payload.clusters if payload else teams.HAND
    return teams.member_leave(person=actor.person, team=actor.team, clusters=clusters)


# -- members -----------------------------------------------------------------------------


@router.get("/{team_id}/members", response=_responses(200, list[MemberOut]),
            summary="A team's members")  # fmt: skip
@paginate(Pages, items="members")
def team_members(request, team_id: Id):
    """Everyone in it, by when they joined; caps shown to admins and to oneself."""
    actor = _actor(request, team_id)
    return actor.team.memberships.select_related("person").order_by("joined_at", "id")


@router.patch("/{team_id}/members/{member_id}", response=_responses(200, MemberOut),
              summary="Change a member's role")  # fmt: skip
def team_member_role(request, team_id: Id, member_id: Id, payload: RoleChange):
    """Admins change members and viewers; the owner also admins."""
    actor = _actor(request, team_id)
    member = teams.member_set_role(actor=actor, member=_member(actor, member_id), role=payload.role)
    return member


@router.put("/{team_id}/members/{member_id}/caps", response=_responses(200, MemberOut),
            summary="Set a member's monthly budget and GPU cap")  # fmt: skip
def team_member_caps(request, team_id: Id, member_id: Id, payload: Caps):
    """The owner alone. null is no cap; a field left out stays as it is."""
    actor = _actor(request, team_id)
    member = _member(actor, member_id)
    given = payload.model_fields_set
    member = teams.member_set_caps(
        actor=actor, member=member,
        monthly_cap=_money(payload.monthly_cap) if "monthly_cap" in given else member.monthly_cap,
        gpu_cap=payload.gpu_cap if "gpu_cap" in given else member.gpu_cap,
    )  # fmt: skip
    return member


@router.delete("/{team_id}/members/{member_id}", response=_responses(200, PartedOut),
               summary="Remove a member")  # fmt: skip
def team_member_remove(
    request, team_id: Id, member_id: Id, clusters: Literal["hand", "stop"] = "hand",
    restart: bool = True,
):  # fmt: skip
    """At once: their pages, tokens for the team, SSH sessions and terminals end. Their
    clusters in the team are handed to the owner (`clusters=hand`) or stopped, files kept
    (`clusters=stop`). `restart` (default true) also restarts the workspaces of every running team
    cluster they could log in to (files kept), ending anything they left running there."""
    actor = _actor(request, team_id)
    member = _member(actor, member_id)
    return teams.member_remove(actor=actor, member=member, clusters=clusters, restart=restart)


# -- a team's invitations ----------------------------------------------------------------


@router.get("/{team_id}/invitations", response=_responses(200, list[InviteOut]),
            summary="A team's open invitations")  # fmt: skip
@paginate(Pages, items="invitations")
def team_invites(request, team_id: Id):
    """Admins and the owner."""
    actor = _actor(request, team_id)
    actor.require(Role.ADMIN)
    return _open_invites().filter(team=actor.team).order_by("-created_at", "-id")


@router.post("/{team_id}/invitations", response=_responses(201, NewInviteOut),
             summary="Invite someone")  # fmt: skip
def team_invite_create(request, team_id: Id, payload: NewInvite):
    """By login (that researcher accepts it) or, without one, by link: the link's token is
    in the answer this once."""
    actor = _actor(request, team_id)
    invite, token = teams.invite_create(
        actor=actor, role=payload.role, login=payload.login or "", days=payload.days
    )
    invite = _open_invites().get(pk=invite.pk)
    invite.token_once = token
    return Status(201, invite)


@router.delete("/{team_id}/invitations/{invite_id}", response={204: None, **_ERRORS},
               summary="Revoke an invitation")  # fmt: skip
def team_invite_revoke(request, team_id: Id, invite_id: Id):
    actor = _actor(request, team_id)
    actor.require(Role.ADMIN)
    invite = _open_invites().filter(pk=invite_id, team=actor.team).first()
    if invite is None:
        raise Http404("No such invitation.")
    teams.invite_revoke(actor=actor, invite=invite)
    return Status(204, None)

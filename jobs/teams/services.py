"""Teams (课题组): making one, inviting and accepting, roles, caps, and removal
(docs/user/teams.md). Pages (console/views_teams.py), the API and the CLI all call these; every
function checks the actor's role itself, so no caller can forget to.

Who may do what:
- anyone makes a team and becomes its owner (at most SUANLI_TEAMS_MAX owned);
- admins and the owner invite (member, viewer; the owner also admin), revoke invitations,
  change roles below their own, and remove members below their own;
- the owner alone sets budgets and GPU caps and hands ownership on;
- a member leaves on their own (not the owner).

Layer: teams (beside pools), on clusters, tenancy and models.
"""

import hashlib
import secrets
from datetime import timedelta
from decimal import Decimal

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import transaction
from django.http import Http404
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from jobs.base.queue import enqueue_by_name
from jobs.base.text import Text
from jobs.clusters import services as cluster_services
from jobs.events.timeline import cluster_event
from jobs.models import (
    Cluster,
    GpuSubscription,
    Pool,
    Sweep,
    Team,
    TeamInvite,
    TeamMember,
)
from jobs.tenancy.actors import Actor, is_team_principal
from jobs.tenancy.revocations import announce_revoked

Role = TeamMember.Role
INVITE_PREFIX = "sli_"
NAME_MAX = 80


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _clean_name(name: str) -> str:
    name = " ".join((name or "").split())
    if not name:
        raise ValidationError(_("Give the team a name."), code="name")
    if len(name) > NAME_MAX:
        raise ValidationError(
            _("A team's name is at most %(n)s characters.") % {"n": NAME_MAX}, code="name"
        )
    return name


@transaction.atomic
def team_create(*, person, name: str) -> Team:
    """A new team owned by `person`, with its own account (the principal user)."""
    name = _clean_name(name)
    if is_team_principal(person):
        raise PermissionDenied(_("A team cannot make a team."))
    get_user_model().objects.select_for_update().filter(pk=person.pk).first()
    most = settings.SUANLI_TEAMS_MAX
    if TeamMember.objects.filter(person=person, role=Role.OWNER).count() >= most:
        raise ValidationError(
            _("You own %(n)s teams, the most one person may.") % {"n": most}, code="too_many"
        )
    principal = get_user_model().objects.create_user(
        username=f"team.{secrets.token_hex(6)}", first_name=name[:150]
    )
    principal.set_unusable_password()
    principal.save(update_fields=["password"])
    team = Team.objects.create(principal=principal, name=name)
    TeamMember.objects.create(team=team, person=person, role=Role.OWNER)
    return team


@transaction.atomic
def team_rename(*, actor: Actor, name: str) -> Team:
    _team_actor(actor)
    actor.require(Role.ADMIN)
    team = actor.team
    team.name = _clean_name(name)
    team.save(update_fields=["name"])
    return team


def _team_actor(actor: Actor) -> Team:
    """The team `actor` acts for; 404 for someone acting for themselves (a caller that
    forgot Actor.for_team gets the answer of a missing team, not a crash)."""
    if actor.team is None:
        raise Http404(_("No such team."))
    return actor.team


def _may_grant(actor: Actor, role: str) -> None:
    """Admins grant member and viewer; the owner also admin. Nobody grants owner here."""
    _team_actor(actor)
    actor.require(Role.ADMIN)
    if role not in (Role.ADMIN, Role.MEMBER, Role.VIEWER):
        raise ValidationError(_("Choose admin, member or viewer."), code="role")
    if role == Role.ADMIN:
        actor.require(Role.OWNER)


def _may_manage(actor: Actor, member: TeamMember) -> None:
    """Change or remove `member`: only someone above them (the owner above admins)."""
    _team_actor(actor)
    actor.require(Role.ADMIN)
    if member.team_id != actor.team.pk:
        raise ValidationError(_("No such member."), code="missing")
    if member.role == Role.OWNER:
        raise PermissionDenied(
            _("The owner cannot be changed or removed; hand ownership on first.")
        )
    if member.role == Role.ADMIN:
        actor.require(Role.OWNER)


def invite_create(
    *, actor: Actor, role: str, login: str = "", days: int | None = None
) -> tuple[TeamInvite, str]:
    """An invitation to `login` (that person alone may accept it, from their teams page) or,
    without a login, by link: returns the invitation and its token (shown once; "" for a
    login's invitation)."""
    _may_grant(actor, role)
    days = days or settings.SUANLI_TEAM_INVITE_DAYS
    if not 1 <= days <= 30:
        raise ValidationError(_("An invitation lasts 1 to 30 days."), code="days")
    with transaction.atomic():
        team = Team.objects.select_for_update().get(pk=actor.team.pk)
        now = timezone.now()
        open_ = team.invites.filter(
            accepted_at__isnull=True, revoked_at__isnull=True, expires_at__gt=now
        )
        if open_.count() >= settings.SUANLI_TEAM_INVITES_MAX:
            raise ValidationError(
                _("%(team)s has %(n)s open invitations, the most: revoke some first.")
                % {"team": team.name, "n": settings.SUANLI_TEAM_INVITES_MAX},
                code="too_many",
            )
        if team.memberships.count() >= settings.SUANLI_TEAM_MEMBERS_MAX:
            raise ValidationError(
                _("%(team)s has %(n)s members, the most a team may.")
                % {"team": team.name, "n": settings.SUANLI_TEAM_MEMBERS_MAX},
                code="too_many",
            )
        invitee, token = None, ""
        if login.strip():
            invitee = _invitee(team, login.strip())
            if open_.filter(login=invitee).exists():
                raise ValidationError(
                    _("%(login)s already has an open invitation.") % {"login": login},
                    code="duplicate",
                )
        else:
            token = INVITE_PREFIX + secrets.token_urlsafe(24)
        invite = TeamInvite.objects.create(
            team=team, role=role, login=invitee, digest=_digest(token) if token else None,
            created_by=actor.person, created_at=now, expires_at=now + timedelta(days=days),
        )  # fmt: skip
    return invite, token


def _invitee(team: Team, login: str):
    user = get_user_model().objects.filter(username=login, is_active=True).first()
    if user is None or is_team_principal(user):
        raise ValidationError(
            _("No researcher logs in as %(login)s.") % {"login": login}, code="login"
        )
    if team.memberships.filter(person=user).exists():
        raise ValidationError(
            _("%(login)s is already in %(team)s.") % {"login": login, "team": team.name},
            code="duplicate",
        )
    return user


def invite_for_token(token: str) -> TeamInvite | None:
    """The open invitation a link's token names, or None (also for a spent or revoked one)."""
    if not token or not token.startswith(INVITE_PREFIX):
        return None
    invite = TeamInvite.objects.select_related("team").filter(digest=_digest(token)).first()
    return invite if invite is not None and invite.open else None


@transaction.atomic
def invite_accept(*, person, invite: TeamInvite) -> TeamMember:
    """`person` joins by `invite` (a link's, or one made to their login)."""
    Team.objects.select_for_update().filter(pk=invite.team_id).first()  # counts members
    invite = TeamInvite.objects.select_for_update().select_related("team").get(pk=invite.pk)
    if not invite.open:
        raise ValidationError(
            _("This invitation was used, revoked or has expired: ask for a new one."),
            code="closed",
        )
    if invite.login_id is not None and invite.login_id != person.pk:
        raise ValidationError(_("This invitation is for someone else."), code="not_yours")
    if is_team_principal(person):
        raise PermissionDenied(_("A team cannot join a team."))
    if invite.team.memberships.filter(person=person).exists():
        raise ValidationError(
            _("You are already in %(team)s.") % {"team": invite.team.name}, code="duplicate"
        )
    if invite.team.memberships.count() >= settings.SUANLI_TEAM_MEMBERS_MAX:
        raise ValidationError(
            _("%(team)s has %(n)s members, the most a team may.")
            % {"team": invite.team.name, "n": settings.SUANLI_TEAM_MEMBERS_MAX},
            code="too_many",
        )
    if not _maker_may_still_grant(invite):
        raise ValidationError(
            _("This invitation was used, revoked or has expired: ask for a new one."),
            code="closed",
        )
    member = TeamMember.objects.create(team=invite.team, person=person, role=invite.role)
    invite.accepted_at = timezone.now()
    invite.accepted_by = person
    invite.save(update_fields=["accepted_at", "accepted_by"])
    return member


def _maker_may_still_grant(invite: TeamInvite) -> bool:
    """An invitation is good only while its maker may still grant its role: made by an admin
    who was removed or demoted since, it opens nothing (their open ones are revoked then
    too: _revoke_invites_of)."""
    maker = invite.team.memberships.filter(person_id=invite.created_by_id).first()
    if maker is None:
        return False
    needed = Role.OWNER if invite.role == Role.ADMIN else Role.ADMIN
    return maker.at_least(needed)


def _revoke_invites_of(team: Team, person) -> None:
    """The open invitations `person` made for `team` end (they left, or may no longer
    invite): a link kept by a removed admin must not let them back in."""
    TeamInvite.objects.filter(
        team=team, created_by=person, accepted_at__isnull=True, revoked_at__isnull=True
    ).update(revoked_at=timezone.now())


@transaction.atomic
def invite_decline(*, person, invite: TeamInvite) -> None:
    """The invitee turns down an invitation made to their login."""
    if invite.login_id != person.pk or not invite.open:
        raise ValidationError(_("No such invitation."), code="missing")
    TeamInvite.objects.filter(pk=invite.pk).update(revoked_at=timezone.now())


@transaction.atomic
def invite_revoke(*, actor: Actor, invite: TeamInvite) -> None:
    _team_actor(actor)
    actor.require(Role.ADMIN)
    if invite.team_id != actor.team.pk:
        raise ValidationError(_("No such invitation."), code="missing")
    TeamInvite.objects.filter(pk=invite.pk, revoked_at__isnull=True).update(
        revoked_at=timezone.now()
    )


@transaction.atomic
def member_set_role(*, actor: Actor, member: TeamMember, role: str) -> TeamMember:
    _may_manage(actor, member)
    _may_grant(actor, role)
    lower = TeamMember.RANK[role] < TeamMember.RANK[member.role]
    member.role = role
    member.save(update_fields=["role"])
    if lower:
        # A demoted person's open invitations end, and what they have open (terminals,
        # app sockets) is told to close: it reconnects, if it may, with the new role.
        if role != Role.ADMIN:
            _revoke_invites_of(member.team, member.person)
        person_id, principal_id = member.person_id, member.team.principal_id
        transaction.on_commit(
            lambda: announce_revoked(person_id=person_id, principal_id=principal_id)
        )
    return member


@transaction.atomic
def member_set_caps(
    *, actor: Actor, member: TeamMember, monthly_cap: Decimal | None, gpu_cap: int | None
) -> TeamMember:
    """The owner's caps on one member's spending this month and GPUs held (None: no cap)."""
    _team_actor(actor)
    actor.require(Role.OWNER)
    if member.team_id != actor.team.pk:
        raise ValidationError(_("No such member."), code="missing")
    if monthly_cap is not None and monthly_cap < 0:
        raise ValidationError(_("A budget cannot be negative."), code="cap")
    if gpu_cap is not None and gpu_cap < 0:
        raise ValidationError(_("A GPU cap cannot be negative."), code="cap")
    member.monthly_cap = monthly_cap
    member.gpu_cap = gpu_cap
    member.capped_at = None  # re-judged at the next accrual tick against the new cap
    member.save(update_fields=["monthly_cap", "gpu_cap", "capped_at"])
    return member


@transaction.atomic
def owner_transfer(*, actor: Actor, member: TeamMember) -> None:
    """The owner hands ownership to another member, and becomes an admin."""
    _team_actor(actor)
    actor.require(Role.OWNER)
    if member.team_id != actor.team.pk or member.pk == actor.membership.pk:
        raise ValidationError(_("Choose another member of the team."), code="missing")
    TeamMember.objects.filter(pk=actor.membership.pk).update(role=Role.ADMIN)
    TeamMember.objects.filter(pk=member.pk).update(role=Role.OWNER)


HAND = "hand"
STOP = "stop"


def member_remove(
    *, actor: Actor, member: TeamMember, clusters: str = HAND, restart: bool = False
) -> dict:
    """Remove `member` from the team at once: their pages, API tokens for the team, SSH
    sessions, web terminals and app proxies end (announce_revoked after commit). Their
    clusters in the team are handed to the owner (HAND) or stopped, files kept (STOP).
    With `restart`, the workspaces of every running team cluster they could log in to are
    restarted (files kept): nothing they left running there outlives them.
    Returns {"handed": [ids], "stopped": [ids], "restarted": [ids]}."""
    _may_manage(actor, member)
    return _part(member, clusters=clusters, by=actor.person.get_username(), restart=restart)


def member_leave(*, person, team: Team, clusters: str = HAND) -> dict:
    """A member leaves on their own; the owner must hand ownership on first."""
    member = TeamMember.objects.filter(team=team, person=person).first()
    if member is None:
        raise ValidationError(_("You are not in this team."), code="missing")
    if member.role == Role.OWNER:
        raise ValidationError(
            _("The owner cannot leave: hand ownership to another member first."), code="owner"
        )
    return _part(member, clusters=clusters, by=person.get_username())


def _part(member: TeamMember, *, clusters: str, by: str, restart: bool = False) -> dict:
    """`member` leaves: their invitations, waiting GPU subscriptions end; the pools and
    sweeps they made are the owner's from now on; their clusters are handed or stopped;
    with `restart`, the workspaces of every running team cluster they could log in to are
    restarted (files kept), which ends any process they left running there (a shell's
    `nohup`/`setsid` outlives its session: only a restart ends it for sure)."""
    if clusters not in (HAND, STOP):
        raise ValidationError(_("Choose to hand their clusters to the owner or stop them."))
    team, person = member.team, member.person
    owner = team.memberships.get(role=Role.OWNER).person
    done = {"handed": [], "stopped": [], "restarted": []}
    with transaction.atomic():
        theirs = Cluster.objects.select_for_update().filter(owner=team.principal)
        made = [c for c in theirs.filter(created_by=person).exclude(state__in=_GONE)]
        reached = theirs if member.at_least(Role.ADMIN) else theirs.filter(members=person)
        reached = list(reached.filter(state=Cluster.State.RUNNING).values_list("pk", flat=True))
        for cluster in Cluster.objects.filter(owner=team.principal, members=person):
            cluster.members.remove(person)
            cluster.ssh_keys.remove(*cluster.ssh_keys.filter(owner=person))
        _revoke_invites_of(team, person)
        Pool.objects.filter(owner=team.principal, created_by=person).update(created_by=owner)
        Sweep.objects.filter(owner=team.principal, created_by=person).update(created_by=owner)
        GpuSubscription.cancel_waiting_of(person, team.principal)
        member.delete()
    who = person.get_username()
    if restart:
        done["restarted"] = _restart_reached(reached, who=who, by=by)
    for cluster in made:
        if clusters == STOP and _stopped(cluster, who=who, by=by):
            done["stopped"].append(cluster.pk)
            continue
        Cluster.objects.filter(pk=cluster.pk).update(created_by=owner)
        cluster.members.add(owner)
        cluster_event(
            cluster, "handed",
            Text(
                gettext_noop("%(who)s left the team (removed by %(by)s): handed to %(owner)s"),
                who=who, by=by, owner=owner.get_username(),
            ),
        )  # fmt: skip
        done["handed"].append(cluster.pk)
    transaction.on_commit(
        lambda: announce_revoked(person_id=person.pk, principal_id=team.principal_id)
    )
    return done


_GONE = (Cluster.State.RELEASED, Cluster.State.FAILED)


def _stopped(cluster: Cluster, *, who: str, by: str) -> bool:
    """STOP for one cluster of a member who leaves: a running one stops (files kept), one
    waiting to start again goes back to stopped, a request never placed is withdrawn; so
    that nothing of theirs is placed and charged to the team after. False when it cannot
    be stopped now (releasing): it is handed to the owner instead."""
    reason = Text(gettext_noop("stopped: %(who)s left the team"), who=who)
    if cluster.state == Cluster.State.PENDING:
        with transaction.atomic():
            if cluster.stopped_at is not None:
                return cluster_services.cluster_stop_waiting(cluster=cluster, reason=reason)
            withdrawn = Text(gettext_noop("withdrawn: %(who)s left the team"), who=who)
            cluster_services.cluster_release(cluster=cluster, reason=withdrawn)
            return True
    if cluster.state != Cluster.State.RUNNING:
        return False
    try:
        cluster_services.cluster_stop(cluster=cluster, by=by, limited=False, reason=reason)
    except ValidationError:
        return False
    return True


def _restart_reached(cluster_ids: list[int], *, who: str, by: str) -> list[int]:
    """Restart the workspaces of these running clusters (jobs.tasks.cluster_workspaces_restart,
    queued by name after commit): every process in them ends, their files stay."""
    for cluster_id in cluster_ids:
        cluster_event(
            cluster_id, "restarted",
            Text(
                gettext_noop(
                    "workspaces restarted, files kept: %(who)s left the team (by %(by)s)"
                ),
                who=who, by=by,
            ),
        )  # fmt: skip
        enqueue_by_name(
            "jobs.tasks.cluster_workspaces_restart", cluster_id,
            job_id=f"ws-restart-{cluster_id}",
        )  # fmt: skip
    return list(cluster_ids)


def _may_change_people(actor: Actor, cluster: Cluster) -> None:
    """404 when the actor cannot see `cluster`; 403 unless it is an admin of the team or
    the person who made the cluster (and still a member); refused for a cluster of no team."""
    if not actor.sees(cluster):
        raise Http404(_("No such cluster."))
    if actor.team is None:
        raise ValidationError(_("Only a team's cluster has people added to it."), code="team")
    if not actor.may_change(cluster):
        actor.require(Role.ADMIN)  # says in words which role it needs


def cluster_member_add(*, actor: Actor, cluster: Cluster, person) -> None:
    """Let a member of the team see and log in to `cluster` (with their own SSH keys)."""
    _may_change_people(actor, cluster)
    if not actor.team.memberships.filter(person=person).exists():
        raise ValidationError(
            _("%(login)s is not in %(team)s.")
            % {"login": person.get_username(), "team": actor.team.name},
            code="not_member",
        )
    with transaction.atomic():
        if cluster.members.filter(pk=person.pk).exists():
            raise ValidationError(
                _("%(login)s is already on this cluster.") % {"login": person.get_username()},
                code="duplicate",
            )
        cluster.members.add(person)
        cluster_event(
            cluster, "member-added",
            Text(
                gettext_noop("%(by)s added %(who)s to the cluster"),
                by=actor.person.get_username(), who=person.get_username(),
            ),
        )  # fmt: skip


def cluster_member_remove(*, actor: Actor, cluster: Cluster, person) -> None:
    """Take a person off `cluster`: they no longer see it (unless an admin), their SSH keys
    are detached from it, and their open sessions on the team's things are told to end."""
    _may_change_people(actor, cluster)
    with transaction.atomic():
        if not cluster.members.filter(pk=person.pk).exists():
            raise ValidationError(
                _("%(login)s is not on this cluster.") % {"login": person.get_username()},
                code="missing",
            )
        cluster.members.remove(person)
        cluster.ssh_keys.remove(*cluster.ssh_keys.filter(owner=person))
        cluster_event(
            cluster, "member-removed",
            Text(
                gettext_noop("%(by)s took %(who)s off the cluster (their SSH keys detached)"),
                by=actor.person.get_username(), who=person.get_username(),
            ),
        )  # fmt: skip
    transaction.on_commit(
        lambda: announce_revoked(person_id=person.pk, principal_id=cluster.owner_id)
    )

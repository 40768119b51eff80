"""Who acts, and for whom (docs/user/teams.md).

A person acts for themselves or for one of their teams. An `Actor` carries both: `person`
(who is logged in, whose SSH keys and name the timeline shows) and `principal` (who owns
what they make and see: the person, or the team's principal user). Every page, API call,
websocket, SSH login and app proxy asks the actor, never `owner=request.user` directly:

- what it may **see** (`clusters`, `jobs`, `sees`): the owner of an account sees all of it;
  a team's owner and admins see every team cluster; members and viewers the clusters they
  were added to. What it may not see answers 404, as what does not exist.
- what it may **do** (`require`, `may_change`): viewers read only; members rent and run, and
  change what they made or were added to; admins manage members and the team's shared
  things; the owner also pays. What it may see but not do answers 403, in words.

A membership is read at every request, so a removed member's next request, token use,
websocket message or SSH channel is refused (jobs/teams/services.member_remove also closes
what is open at once).

Layer: tenancy (beside events and files), on models.
"""

from dataclasses import dataclass

from django.core.exceptions import PermissionDenied
from django.db.models import Q, QuerySet
from django.http import Http404
from django.utils.translation import gettext as _

from jobs.models import Cluster, Job, Team, TeamMember

Role = TeamMember.Role


@dataclass(frozen=True)
class Actor:
    person: object
    principal: object
    team: Team | None = None
    role: str = Role.OWNER
    membership: TeamMember | None = None

    @classmethod
    def of(cls, who) -> "Actor":
        """`who` as an actor: an Actor as it is; a user acts for themselves."""
        if isinstance(who, Actor):
            return who
        return cls(person=who, principal=who)

    @classmethod
    def for_team(cls, person, team_id) -> "Actor":
        """`person` acting for the team `team_id`; 404 unless they are its member now."""
        try:
            member = TeamMember.objects.select_related("team", "team__principal").get(
                team_id=int(team_id), person=person
            )
        except (TeamMember.DoesNotExist, TypeError, ValueError):
            raise Http404(_("No such team.")) from None
        return cls.of_membership(member, person)

    @classmethod
    def of_membership(cls, member: TeamMember, person=None) -> "Actor":
        """The member acting for their team (`member` read with its team and principal;
        `person`: the member's user when the caller holds it already)."""
        return cls(
            person=person or member.person, principal=member.team.principal, team=member.team,
            role=member.role, membership=member,
        )  # fmt: skip

    @property
    def for_a_team(self) -> bool:
        return self.team is not None

    @property
    def label(self) -> str:
        """Whom it acts for, as the switcher says: the team's name, or the person's login."""
        return self.team.name if self.team else self.person.get_username()

    def at_least(self, role: str) -> bool:
        if self.team is None:
            return True
        return TeamMember.RANK[self.role] >= TeamMember.RANK[role]

    def require(self, role: str) -> None:
        """403, in words, unless the actor's role is `role` or above (its own account: any)."""
        if not self.at_least(role):
            raise PermissionDenied(
                _(
                    "Your role in %(team)s is %(role)s; this needs %(needed)s or above. Ask "
                    "the team's owner or an admin."
                )
                % {
                    "team": self.team.name,
                    "role": Role(self.role).label,
                    "needed": Role(role).label,
                }
            )

    @property
    def sees_all(self) -> bool:
        """Whether every cluster of the principal is visible (own account, owner, admin)."""
        return self.at_least(Role.ADMIN)

    def clusters(self) -> QuerySet[Cluster]:
        clusters = Cluster.objects.filter(owner=self.principal)
        if not self.sees_all:
            clusters = clusters.filter(members=self.person)
        return clusters

    def jobs(self) -> QuerySet[Job]:
        """The jobs of the clusters it sees, and (a team's pools being shared with all its
        people) every job of the team's pools: a member's own job on a teammate's pool."""
        jobs = Job.objects.filter(owner=self.principal)
        if not self.sees_all:
            theirs = Cluster.objects.filter(owner=self.principal, members=self.person)
            jobs = jobs.filter(Q(cluster__in=theirs) | Q(pool__isnull=False))
        return jobs

    def sees(self, cluster: Cluster) -> bool:
        if cluster.owner_id != self.principal.pk:
            return False
        return self.sees_all or cluster.members.filter(pk=self.person.pk).exists()

    def may_use(self, cluster: Cluster) -> bool:
        """Log in to it, submit to it, stop and start it: a member or above who sees it."""
        return self.at_least(Role.MEMBER) and self.sees(cluster)

    def may_change(self, thing) -> bool:
        """Change or delete a shared thing (a pool, an image, a storage folder, a cluster):
        admins and the owner any of the team's; a member what they made."""
        if getattr(thing, "owner_id", None) != self.principal.pk:
            return False
        if self.at_least(Role.ADMIN):
            return True
        made_by = getattr(thing, "created_by_id", None)
        return self.at_least(Role.MEMBER) and made_by == self.person.pk

    def require_change(self, thing) -> None:
        """404 unless `thing` is the principal's; 403, in words, unless the actor may change
        it (`may_change`): a member what they made, admins and the owner anything."""
        if getattr(thing, "owner_id", None) != self.principal.pk:
            raise Http404(_("Not found."))
        if not self.may_change(thing):
            self.require(Role.ADMIN)

    def require_use(self, cluster: Cluster) -> None:
        """404 when the actor cannot see `cluster`; 403 when it sees it but may not act."""
        if not self.sees(cluster):
            raise Http404(_("No such cluster."))
        self.require(Role.MEMBER)


def teams_of(person) -> QuerySet[TeamMember]:
    """The person's memberships, for the switcher: team and role, by team name."""
    return (
        TeamMember.objects.filter(person=person)
        .select_related("team", "team__principal")
        .order_by("team__name", "team_id")
    )


def is_team_principal(user) -> bool:
    """A team's principal: nobody logs in as it, no token is made for it."""
    return Team.objects.filter(principal_id=user.pk).exists()


def actor_on(person, cluster: Cluster) -> Actor | None:
    """`person` as they reach `cluster` from outside the console's pages (an SSH key, an
    app origin's cookie), where no acting-for choice was made: for themselves on their
    own cluster, as a member of the team that owns it (their role now) on a team's; None
    for anyone else (a stranger, a removed member)."""
    if cluster.owner_id == person.pk:
        return Actor.of(person)
    member = (
        TeamMember.objects.select_related("team", "team__principal")
        .filter(team__principal_id=cluster.owner_id, person=person)
        .first()
    )
    if member is None:
        return None
    return Actor(
        person=person, principal=member.team.principal, team=member.team, role=member.role,
        membership=member,
    )  # fmt: skip

"""Researchers' team pages (docs/user/teams.md): my teams and the invitations made to my
login (/teams/), one team's members, roles, caps and invitations (/teams/<id>/), an
invitation link (/teams/join/<token>/), and the people of a team cluster (its card on the
cluster page).

Every write is a service of jobs/teams/services.py, which checks the actor's role itself:
the pages only hide the buttons a role may not use. A refusal in words (ValidationError)
comes back as a message on the page; PermissionDenied is left to answer 403 with its words
(templates/403.html), as a role below gets when it posts directly. A team's page is found
through the person's membership (Actor.for_team): a non-member gets 404."""

from decimal import Decimal

from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth.decorators import login_required
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import ValidationError
from django.db.models import Count
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy
from django.views.decorators.http import require_POST

from billing.pricing import RateBook
from console.acting import SESSION_KEY
from jobs.models import Team, TeamInvite, TeamMember
from jobs.placement import fleet
from jobs.teams import services as teams
from jobs.tenancy.actors import Actor

Role = TeamMember.Role
LINK_ONCE = "team_invite_link_once"  # the session key of a link shown once
GRANTABLE = [(r, Role(r).label) for r in (Role.ADMIN, Role.MEMBER, Role.VIEWER)]


class TeamForm(forms.Form):
    name = forms.CharField(
        label=gettext_lazy("Team name"), max_length=teams.NAME_MAX,
        error_messages={"required": gettext_lazy("Give the team a name.")},
    )  # fmt: skip


class InviteForm(forms.Form):
    login = forms.CharField(
        label=gettext_lazy("Login"), max_length=150, required=False,
        help_text=gettext_lazy("Blank: make a link anyone holding it may use, once."),
    )  # fmt: skip
    role = forms.ChoiceField(label=gettext_lazy("Role"), choices=GRANTABLE, initial=Role.MEMBER)
    days = forms.IntegerField(
        label=gettext_lazy("Valid for (days)"), min_value=1, max_value=30, required=False
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        usual = settings.SUANLI_TEAM_INVITE_DAYS
        self.fields["days"].widget.attrs["placeholder"] = usual
        self.fields["days"].help_text = _("1 to 30; blank: %(n)s.") % {"n": usual}


class CapsForm(forms.Form):
    monthly_cap = forms.DecimalField(
        label=gettext_lazy("Monthly budget"), min_value=Decimal(0), max_digits=14,
        decimal_places=2, required=False,
    )  # fmt: skip
    gpu_cap = forms.IntegerField(label=gettext_lazy("GPU cap"), min_value=0, required=False)


def _refused(request, exc: ValidationError, to: str):
    messages.error(request, " ".join(exc.messages))
    return redirect(to)


# /teams/


@login_required
def team_list(request):
    """My teams, the invitations made to my login, and the form to make a team."""
    form = TeamForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            team = teams.team_create(person=request.user, name=form.cleaned_data["name"])
        except ValidationError as exc:
            form.add_error("name", exc)
        else:
            messages.success(
                request, _("Team %(team)s made; you are its owner.") % {"team": team.name}
            )
            return redirect("team_detail", team.pk)
    return render(request, "console/teams.html", {"form": form, **_my_teams(request.user)})


def _my_teams(person) -> dict:
    mine = (
        TeamMember.objects.filter(person=person)
        .select_related("team")
        .annotate(people=Count("team__memberships"))
        .order_by("team__name", "team_id")
    )
    invites = TeamInvite.objects.filter(
        login=person, accepted_at__isnull=True, revoked_at__isnull=True,
        expires_at__gt=timezone.now(),
    ).select_related("team", "created_by")  # fmt: skip
    return {"memberships": mine, "invites": invites}


@login_required
@require_POST
def invite_answer(request, invite_id: int):
    """Accept or decline an invitation made to my login (another's: 404)."""
    invite = get_object_or_404(TeamInvite, pk=invite_id, login=request.user)
    try:
        if request.POST.get("answer") == "accept":
            teams.invite_accept(person=request.user, invite=invite)
        else:
            teams.invite_decline(person=request.user, invite=invite)
            messages.success(
                request, _("Invitation to %(team)s declined.") % {"team": invite.team.name}
            )
            return redirect("teams")
    except ValidationError as exc:
        return _refused(request, exc, reverse("teams"))
    return _joined(request, invite.team)


def _joined(request, team: Team):
    """After accepting: the team's page, which offers to act for it."""
    messages.success(request, _("You joined %(team)s.") % {"team": team.name})
    return redirect(reverse("team_detail", args=[team.pk]) + "?joined=1")


# /teams/join/<token>/


def team_join(request, token: str):
    """An invitation link: the team and role, and a button to accept. A link that does not
    open (unknown, spent, revoked, expired) says so without naming any team."""
    if not request.user.is_authenticated:
        return redirect_to_login(request.get_full_path())
    invite = teams.invite_for_token(token)
    if invite is None:
        return render(request, "console/team_join.html", {"invite": None}, status=404)
    if request.method == "POST":
        try:
            teams.invite_accept(person=request.user, invite=invite)
        except ValidationError as exc:
            messages.error(request, " ".join(exc.messages))
        else:
            return _joined(request, invite.team)
    member = invite.team.memberships.filter(person=request.user).exists()
    return render(request, "console/team_join.html", {"invite": invite, "member": member})


# /teams/<id>/


def _actor(request, team_id: int) -> Actor:
    return Actor.for_team(request.user, team_id)  # 404 unless a member now


def _member(actor: Actor, member_id: int) -> TeamMember:
    return get_object_or_404(
        TeamMember.objects.select_related("person"), pk=member_id, team=actor.team
    )


@login_required
def team_detail(request, team_id: int):
    actor = _actor(request, team_id)
    return render(request, "console/team_detail.html", _team_context(request, actor))


def _team_context(request, actor: Actor) -> dict:
    team = actor.team
    members = list(team.memberships.select_related("person").order_by("joined_at", "pk"))
    for m in members:
        m.caps_shown = actor.at_least(Role.ADMIN) or m.person_id == actor.person.pk
        m.may_manage = actor.at_least(Role.ADMIN) and _above(actor, m)
    once = request.session.pop(LINK_ONCE, None)
    link = once if once and once.get("team") == team.pk else None
    if link:
        link["expires"] = parse_datetime(link["expires"])
    invites = team.invites.filter(
        accepted_at__isnull=True, revoked_at__isnull=True, expires_at__gt=timezone.now()
    ).select_related("login", "created_by")
    return {
        "team": team, "actor": actor, "members": members, "link": link,
        "invites": invites if actor.at_least(Role.ADMIN) else [],
        "invite_form": InviteForm(), "rename_form": TeamForm(initial={"name": team.name}),
        "grantable": GRANTABLE if actor.at_least(Role.OWNER) else GRANTABLE[1:],
        "offer_switch": request.GET.get("joined") and request.session.get(SESSION_KEY) != team.pk,
        "is_owner": actor.role == Role.OWNER,
        "currency": RateBook.load().currency,  # the caps' money, as the billing page shows it
    }  # fmt: skip


def _above(actor: Actor, member: TeamMember) -> bool:
    """Whether the actor outranks `member` (admins manage members and viewers; the owner
    admins too)."""
    return TeamMember.RANK[actor.role] > TeamMember.RANK[member.role]


def _back(team_id: int) -> str:
    return reverse("team_detail", args=[team_id])


@login_required
@require_POST
def team_rename(request, team_id: int):
    actor = _actor(request, team_id)
    form = TeamForm(request.POST)
    if not form.is_valid():
        return _refused(request, ValidationError(_("Give the team a name.")), _back(team_id))
    try:
        teams.team_rename(actor=actor, name=form.cleaned_data["name"])
    except ValidationError as exc:
        return _refused(request, exc, _back(team_id))
    messages.success(request, _("Team renamed."))
    return redirect(_back(team_id))


@login_required
@require_POST
def team_invite(request, team_id: int):
    """Invite a login, or make a link (its token shown once on the team's page)."""
    actor = _actor(request, team_id)
    form = InviteForm(request.POST)
    if not form.is_valid():
        words = [e for errors in form.errors.values() for e in errors]
        return _refused(request, ValidationError(words), _back(team_id))
    data = form.cleaned_data
    try:
        invite, token = teams.invite_create(
            actor=actor, role=data["role"], login=data["login"], days=data["days"]
        )
    except ValidationError as exc:
        return _refused(request, exc, _back(team_id))
    if token:
        url = request.build_absolute_uri(reverse("team_join", args=[token]))
        request.session[LINK_ONCE] = {
            "team": actor.team.pk, "url": url, "role": invite.get_role_display(),
            "expires": invite.expires_at.isoformat(),
        }  # fmt: skip
        messages.success(request, _("Invitation link made. Copy it now: it is shown once."))
    else:
        messages.success(
            request,
            _("%(login)s is invited; they accept on their Teams page.") % {"login": data["login"]},
        )
    return redirect(_back(team_id))


@login_required
@require_POST
def team_invite_revoke(request, team_id: int, invite_id: int):
    actor = _actor(request, team_id)
    invite = get_object_or_404(TeamInvite, pk=invite_id, team=actor.team)
    try:
        teams.invite_revoke(actor=actor, invite=invite)
    except ValidationError as exc:
        return _refused(request, exc, _back(team_id))
    messages.success(request, _("Invitation revoked."))
    return redirect(_back(team_id))


@login_required
@require_POST
def member_role(request, team_id: int, member_id: int):
    actor = _actor(request, team_id)
    member = _member(actor, member_id)
    try:
        teams.member_set_role(actor=actor, member=member, role=request.POST.get("role", ""))
    except ValidationError as exc:
        return _refused(request, exc, _back(team_id))
    messages.success(
        request,
        _("%(login)s is now %(role)s.")
        % {"login": member.person.get_username(), "role": member.get_role_display()},
    )
    return redirect(_back(team_id))


@login_required
@require_POST
def member_caps(request, team_id: int, member_id: int):
    actor = _actor(request, team_id)
    member = _member(actor, member_id)
    form = CapsForm(request.POST)
    if not form.is_valid():
        words = [e for errors in form.errors.values() for e in errors]
        return _refused(request, ValidationError(words), _back(team_id))
    try:
        teams.member_set_caps(actor=actor, member=member, **form.cleaned_data)
    except ValidationError as exc:
        return _refused(request, exc, _back(team_id))
    messages.success(
        request, _("Caps of %(login)s saved.") % {"login": member.person.get_username()}
    )
    return redirect(_back(team_id))


@login_required
@require_POST
def member_owner(request, team_id: int, member_id: int):
    actor = _actor(request, team_id)
    member = _member(actor, member_id)
    try:
        teams.owner_transfer(actor=actor, member=member)
    except ValidationError as exc:
        return _refused(request, exc, _back(team_id))
    messages.success(
        request,
        _("%(login)s owns %(team)s now; you are an admin.")
        % {"login": member.person.get_username(), "team": actor.team.name},
    )
    return redirect(_back(team_id))


def _parted(request, done: dict, who: str) -> None:
    messages.success(
        request,
        _(
            "%(login)s is out of the team: %(handed)s clusters handed to the owner, %(stopped)s stopped (files kept), %(restarted)s restarted."
        )
        % {
            "login": who,
            "handed": len(done["handed"]),
            "stopped": len(done["stopped"]),
            "restarted": len(done.get("restarted", [])),
        },  # fmt: skip
    )


@login_required
@require_POST
def member_remove(request, team_id: int, member_id: int):
    actor = _actor(request, team_id)
    member = _member(actor, member_id)
    who = member.person.get_username()
    try:
        done = teams.member_remove(
            actor=actor, member=member, clusters=request.POST.get("clusters", ""),
            restart=request.POST.get("restart") == "1",
        )  # fmt: skip
    except ValidationError as exc:
        return _refused(request, exc, _back(team_id))
    _parted(request, done, who)
    return redirect(_back(team_id))


@login_required
@require_POST
def team_leave(request, team_id: int):
    actor = _actor(request, team_id)
    try:
        done = teams.member_leave(
            person=request.user, team=actor.team, clusters=request.POST.get("clusters", "")
        )
    except ValidationError as exc:
        return _refused(request, exc, _back(team_id))
    if request.session.get(SESSION_KEY) == actor.team.pk:
        request.session.pop(SESSION_KEY, None)
    _parted(request, done, request.user.get_username())
    return redirect("teams")


# The people of a team cluster (its card on the cluster page: console/_cluster_people.html)


def _cluster_person(request, cluster_id: int, person_id):
    """The cluster (404 unless the actor sees it) and a person of the actor's team (any
    other id is refused alike, naming nobody: no login is learnt by trying ids)."""
    cluster = fleet.cluster_for_user(request.actor, cluster_id)
    team, person = request.actor.team, None
    if team is not None and str(person_id).isdigit():
        person = get_user_model().objects.filter(pk=person_id, team_memberships__team=team).first()
    if person is None:
        raise ValidationError(_("Choose a member of the team."))
    return cluster, person


@login_required
@require_POST
def cluster_person_add(request, cluster_id: int):
    back = reverse("cluster_detail", args=[cluster_id])
    try:
        cluster, person = _cluster_person(request, cluster_id, request.POST.get("person", ""))
        teams.cluster_member_add(actor=request.actor, cluster=cluster, person=person)
    except ValidationError as exc:
        return _refused(request, exc, back)
    messages.success(
        request, _("%(login)s added to the cluster.") % {"login": person.get_username()}
    )
    return redirect(back)


@login_required
@require_POST
def cluster_person_remove(request, cluster_id: int, person_id: int):
    back = reverse("cluster_detail", args=[cluster_id])
    try:
        cluster, person = _cluster_person(request, cluster_id, person_id)
        teams.cluster_member_remove(actor=request.actor, cluster=cluster, person=person)
    except ValidationError as exc:
        return _refused(request, exc, back)
    messages.success(
        request,
        _("%(login)s taken off the cluster; their SSH keys are detached from it.")
        % {"login": person.get_username()},
    )
    return redirect(back)

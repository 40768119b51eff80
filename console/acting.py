"""Whom the logged-in person acts for: themselves, or one of their teams (the switcher,
"acting for: me / 张老师课题组"). The choice is kept in the session; `ActingFor` puts the
`jobs.tenancy.actors.Actor` on every request as `request.actor`, checking the membership
each time, so that a removed member's next page acts for themselves again (and says why).
"""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest
from django.shortcuts import redirect
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.translation import gettext as _
from django.views.decorators.http import require_POST

from jobs.tenancy.actors import Actor, teams_of

SESSION_KEY = "suanli_acting_for"


def actor_of(request: HttpRequest) -> Actor:
    """The request's actor. One query reads the person's memberships, for both the actor
    and the switcher (`request.my_teams`), so that a page costs one query for teams."""
    user = request.user
    if not user.is_authenticated:
        return Actor.of(user)
    request.my_teams = list(teams_of(user))
    team_id = request.session.get(SESSION_KEY) if hasattr(request, "session") else None
    if team_id is None:
        return Actor.of(user)
    member = next((m for m in request.my_teams if m.team_id == team_id), None)
    if member is not None:
        return Actor.of_membership(member, user)
    request.session.pop(SESSION_KEY, None)
    messages.warning(
        request, _("You are no longer a member of that team: you act for yourself again.")
    )
    return Actor.of(user)


class ActingFor:
    """After authentication: `request.actor`."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        request.actor = actor_of(request)
        return self.get_response(request)


@login_required
@require_POST
def act_for(request: HttpRequest):
    """The switcher: POST team=<id> to act for a team, team="" to act for oneself."""
    team_id = (request.POST.get("team") or "").strip()
    if team_id:
        actor = Actor.for_team(request.user, team_id)  # 404 unless a member now
        request.session[SESSION_KEY] = actor.team.pk
        messages.success(request, _("You now act for %(team)s.") % {"team": actor.team.name})
    else:
        request.session.pop(SESSION_KEY, None)
        messages.success(request, _("You now act for yourself."))
    back = request.POST.get("next") or "/"
    if not url_has_allowed_host_and_scheme(back, {request.get_host()}, request.is_secure()):
        back = "/"
    return redirect(back)


def switcher(request: HttpRequest) -> dict:
    """For the navigation: whom the person acts for and the teams they may switch to."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return {}
    my_teams = getattr(request, "my_teams", None)
    if my_teams is None:
        my_teams = list(teams_of(user))
    return {"acting": getattr(request, "actor", None), "my_teams": my_teams}

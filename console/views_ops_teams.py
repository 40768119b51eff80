"""The operator's Teams pages: every team with its owner, members, balance, the GPUs it holds
now and its GPU-hours this month, and the two figures that are the operator's own (fair
share and GPU limit, jobs/placement/fairshare.py); one team's members and roles.

Reading needs `jobs.view_team`; changing share or GPU limit `jobs.manage_teams` (Team.Meta):
staff status alone grants nothing (403), as every operator page (console/powers.py).
"""

from decimal import Decimal

from django import forms
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from billing import caps
from billing.models import Account
from console.powers import operator_required
from jobs.models import Team, TeamMember
from jobs.teams import selectors

MANAGE_TEAMS = "jobs.manage_teams"


class TeamLimitsForm(forms.ModelForm):
    """Share and GPU limit, the model's own validators (share 1-1000; limit empty or more)."""

    class Meta:
        model = Team
        fields = ["share", "gpu_limit"]
        labels = {"share": gettext_lazy("Fair share"), "gpu_limit": gettext_lazy("GPU limit")}


def _with_figures(teams: list[Team]) -> list[Team]:
    """Each team with its owner, balance, GPUs held now and GPU-hours this month: three
    queries for the page, whatever its length."""
    ids = [t.principal_id for t in teams]
    now = timezone.now()
    use = selectors.fleet_use(ids, since=caps.month_start(now), now=now)
    balances = dict(Account.objects.filter(user_id__in=ids).values_list("user_id", "balance"))
    owners = dict(
        TeamMember.objects.filter(team__in=teams, role=TeamMember.Role.OWNER)
        .select_related("person")
        .values_list("team_id", "person__username")
    )
    for team in teams:
        team.owner_login = owners.get(team.pk, "")
        team.balance = balances.get(team.principal_id)
        team.held, team.gpu_hours = use.get(team.principal_id, (0, Decimal("0.0")))
    return teams


@operator_required("jobs.view_team")
def ops_teams(request):
    page = Paginator(selectors.teams_overview(), 50).get_page(request.GET.get("page"))
    page.object_list = _with_figures(list(page.object_list))
    return render(request, "console/ops_teams.html", {"teams": page, "month": caps.month_start()})


@operator_required("jobs.view_team")
def ops_team(request, team_id: int):
    team = get_object_or_404(selectors.teams_overview(), pk=team_id)
    form = TeamLimitsForm(instance=team)
    if request.method == "POST":
        if not request.user.has_perm(MANAGE_TEAMS):
            raise PermissionDenied(_("Changing a team's share or GPU limit needs manage_teams."))
        form = TeamLimitsForm(request.POST, instance=team)
        if form.is_valid():  # these two alone: a rename at the same time is kept
            Team.objects.filter(pk=team.pk).update(
                share=form.cleaned_data["share"], gpu_limit=form.cleaned_data["gpu_limit"]
            )
            messages.success(
                request,
                _("%(team)s: fair share %(share)s, GPU limit %(limit)s.")
                % {"team": team.name, "share": team.share,
                   "limit": team.gpu_limit if team.gpu_limit is not None else _("none")},
            )  # fmt: skip
            return redirect("ops_team", team_id=team.pk)
    members = team.memberships.select_related("person").order_by("joined_at", "pk")
    return render(
        request,
        "console/ops_team.html",
        {"team": _with_figures([team])[0], "members": members, "form": form,
         "may_manage": request.user.has_perm(MANAGE_TEAMS), "month": caps.month_start()},
        status=400 if form.errors else 200,
    )  # fmt: skip

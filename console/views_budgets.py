"""A job's, cluster's or sweep's budget, "stop at ¥X" (billing/budgets.py), set or cleared
on its page: the small form of templates/console/_budget_form.html posts here. Who may:
as the page's other actions check it (a job's and a cluster's: `Actor.require_use` on the
cluster, as a stop or a cancel; a sweep's: `Actor.require_change`, as its cancel).
Another researcher's is 404, as one that does not exist."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import Http404
from django.shortcuts import redirect
from django.utils.translation import gettext as _
from django.views.decorators.http import require_POST

from billing import budgets
from console.forms import BudgetForm
from console.views_sweeps import _sweep_for
from jobs.models import Cluster, Job
from jobs.placement import fleet
from jobs.tenancy.actors import Role


def job_to_budget(actor, job_id: int):
    """A job whose budget the actor may set: its owner's (a team's member who may use its
    cluster). Whoever only reads other researchers' jobs (an operator's power) gets 404."""
    job = fleet.job_for_user(actor, job_id)
    if job.owner_id != actor.principal.pk:
        raise Http404("No such job.")
    actor.require_use(job.cluster)
    return job


def require_lift(actor, subject, amount) -> None:
    """A budget is a spending control: whoever may use a cluster may set one or lower it,
    but clearing or raising one (on a cluster, or a job on it) needs who may change the
    cluster (its maker, an admin or the owner), as a resize or a release does: a member
    cannot lift the budget an admin set. 403 in words otherwise."""
    if subject.budget is None or (amount is not None and amount <= subject.budget):
        return
    cluster = subject.cluster if isinstance(subject, Job) else subject
    if isinstance(cluster, Cluster) and not actor.may_change(cluster):
        actor.require(Role.ADMIN)


def _save(request, subject, kind: str) -> None:
    form = BudgetForm(request.POST, kind=kind)
    if not form.is_valid():
        messages.error(request, " ".join(form.errors.get("budget", [])) or _("Invalid input."))
        return
    amount = form.cleaned_data["budget"]
    require_lift(request.actor, subject, amount)
    try:
        budgets.set_budget(subject, amount)
    except ValidationError as exc:  # it has ended: its budget (and its record) stay
        messages.error(request, " ".join(exc.messages))
        return
    if amount is None:
        messages.success(request, _("%(name)s has no budget now.") % {"name": subject.name})
    else:
        messages.success(
            request,
            _("%(name)s stops at its budget of %(budget)s.")
            % {"name": subject.name, "budget": budgets.shown(amount)},
        )


@login_required
@require_POST
def job_budget(request, job_id: int):
    job = job_to_budget(request.actor, job_id)
    _save(request, job, "job")
    return redirect("job_detail", job_id=job.pk)


@login_required
@require_POST
def cluster_budget(request, cluster_id: int):
    cluster = fleet.cluster_to_use(request.actor, cluster_id)
    _save(request, cluster, "cluster")
    return redirect("cluster_detail", cluster_id=cluster.pk)


@login_required
@require_POST
def sweep_budget(request, sweep_id: int):
    sweep = _sweep_for(request.actor, sweep_id)
    request.actor.require_change(sweep)
    _save(request, sweep, "sweep")
    return redirect("sweep_detail", sweep_id=sweep.pk)

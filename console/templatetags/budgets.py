"""`{% budget_box job "job" card=True %}` (and "cluster", "sweep"; `card`: a card of its own): the budget card of a page, "stop
at ¥X" (billing/budgets.py): the budget, whether it stopped the job, cluster or sweep, and
for whoever may change it (console/views_budgets.py checks it again) the small form that
sets or clears it. Nothing for a reader who may not see the owner's money (an operator on
another researcher's job)."""

from django import template
from django.urls import reverse

from billing import budgets
from console.forms import BudgetForm
from jobs.tenancy.actors import Role

register = template.Library()

ENDED = {"job": ("succeeded", "failed", "cancelled"), "cluster": ("released", "failed"),
         "sweep": ("finished", "cancelled")}  # fmt: skip


@register.inclusion_tag("console/_budget_form.html", takes_context=True)
def budget_box(context, subject, kind: str, card: bool = False) -> dict:
    request = context.get("request")
    actor = getattr(request, "actor", None)
    if actor is None or subject.owner_id != actor.principal.pk:
        return {"shown": False}
    if kind == "sweep":
        may = actor.may_change(subject)
    else:
        cluster = subject.cluster if kind == "job" else subject
        may = actor.at_least(Role.MEMBER) and actor.sees(cluster)
    ended = subject.state in ENDED[kind]
    budget = subject.budget
    if ended and budget is None:  # nothing to set, nothing it was held to
        return {"shown": False}
    return {
        "shown": True, "kind": kind, "subject": subject, "card": card,
        "budget": budgets.shown(budget) if budget is not None else None,
        "stopped_at": subject.budget_stopped_at,
        "warned_at": getattr(subject, "budget_warned_at", None),
        "may_change": may and not ended, "ended": ended,
        "form": BudgetForm(initial={"budget": budget and f"{budget:.2f}"}, kind=kind),
        "action": reverse(f"{kind}_budget", args=[subject.pk]),
        "csrf_token": context.get("csrf_token"),
    }  # fmt: skip

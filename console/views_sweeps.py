"""Sweep pages (issue 26): the list, the form, a sweep's page with its trials, its charts
and what pruning saved, and its cancel. The engine is jobs/pools/sweeps.py; this module reads
its figures (`sweeps.figures`) and shows them. Every sweep is looked up through its owner
(`_sweep_for`: a researcher's, or a team's for its every member): another researcher's is
404 on every URL. A team's members and above start sweeps and cancel theirs; its admins
and owner cancel any."""

import json
import math

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.core.paginator import Paginator
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils.translation import gettext as _
from django.views.decorators.http import require_POST

from billing import formatting, projections
from billing import selectors as money
from console import pools as console_pools
from console import projection_panel
from console.forms import attach_errors
from console.forms_sweeps import SweepForm
from jobs.models import Pool, Sweep, Trial
from jobs.pools import sweeps
from jobs.tenancy.actors import Actor, Role


def _sweep_for(user, sweep_id: int) -> Sweep:
    return get_object_or_404(
        Sweep.objects.select_related("pool"), pk=sweep_id, owner=Actor.of(user).principal
    )


def _value_text(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def params_text(params: dict, space: list[dict]) -> str:
    """In the search space's order (a JSON column may hand the keys back in another)."""
    names = [p["name"] for p in space if p["name"] in params]
    names += [name for name in params if name not in names]
    return ", ".join(f"{name}={_value_text(params[name])}" for name in names)


def savings(fig: sweeps.SweepFigures, currency: str) -> dict:
    """What the savings sentence says: `kind` is "waiting" (no trial has run to its end,
    so there is no full length to compare with), "none" (nothing was pruned) or "saved"."""
    pruned = sum(1 for f in fig.trials if f.trial.state == Trial.State.PRUNED)
    kind = "saved"
    if fig.full_steps is None:
        kind = "waiting"
    elif not pruned or fig.saved_seconds <= 0:
        kind = "none"
    return {
        "kind": kind,
        "pruned": pruned,
        "gpu": fig.unit_word == "GPU",
        "seconds": f"{fig.saved_unit_seconds:,.0f}",
        "used": f"{fig.used_unit_seconds:,.0f}",
        "share": f"{fig.saved_share * 100:.0f}",
        "money": formatting.total_text(fig.saved_cost, currency)
        if fig.saved_cost is not None
        else "",
        "trials": len(fig.trials),
        "step": fig.full_steps,
    }


def _log_ticks(low: float, high: float) -> tuple[list, list]:
    vals = list(range(math.floor(low), math.ceil(high) + 1))
    return vals, [f"1e{v}" for v in vals]


CURVES_SHOWN = 100  # the newest trials' curves (and the best's), polled every 5 s
CURVE_POINTS_SHOWN = 300


def _thin(curve: list) -> list:
    """At most CURVE_POINTS_SHOWN points of a curve, evenly spread, the last kept."""
    if len(curve) <= CURVE_POINTS_SHOWN:
        return curve
    every = -(-len(curve) // CURVE_POINTS_SHOWN)
    return curve[-1::-every][::-1]


def chart_data(sweep: Sweep, fig: sweeps.SweepFigures) -> dict:
    """The charts' data (static/js/sweep.js draws it): a curve per trial (metric against
    step), and the parallel coordinates of the trials that reported a value: an axis per
    parameter (a categorical one as indices with its choices as tick text, a log-uniform
    one as log10), then the metric's, coloured by it."""
    best_id = fig.best.pk if fig.best else None
    curves = [
        {
            "number": f.trial.number,
            "state": f.trial.state,
            "best": f.trial.pk == best_id,
            "steps": [point[0] for point in _thin(f.trial.curve)],
            "values": [point[1] for point in _thin(f.trial.curve)],
        }
        for f in fig.trials[-CURVES_SHOWN:]
    ]
    if best_id and all(not c["best"] for c in curves):
        best = next(f for f in fig.trials if f.trial.pk == best_id).trial
        curves.insert(0, {"number": best.number, "state": best.state, "best": True,
                          "steps": [p[0] for p in _thin(best.curve)],
                          "values": [p[1] for p in _thin(best.curve)]})  # fmt: skip
    scored = [f.trial for f in fig.trials if f.trial.last_value is not None]
    dimensions = []
    for p in sweep.space:
        name, kind = p["name"], p["type"]
        raw = [t.params.get(name) for t in scored]
        if kind == "categorical":
            keys = [json.dumps(c) for c in p["choices"]]
            values = [keys.index(json.dumps(v)) if json.dumps(v) in keys else None for v in raw]
            dimensions.append({
                "label": name, "kind": kind, "values": values,
                "range": [0, max(len(keys) - 1, 1)],
                "tickvals": list(range(len(keys))), "ticktext": [str(c) for c in p["choices"]],
            })  # fmt: skip
        elif kind == "log_uniform":
            low, high = math.log10(p["low"]), math.log10(p["high"])
            tickvals, ticktext = _log_ticks(low, high)
            dimensions.append({
                "label": f"{name} (log10)", "kind": kind,
                "values": [math.log10(v) if isinstance(v, int | float) and v > 0 else None for v in raw],
                "range": [low, high], "tickvals": tickvals, "ticktext": ticktext,
            })  # fmt: skip
        else:
            dimensions.append(
                {"label": name, "kind": kind, "values": raw, "range": [p["low"], p["high"]]}
            )
    metric_values = [t.last_value for t in scored]
    dimensions.append({"label": sweep.metric, "kind": "metric", "values": metric_values})
    return {
        "metric": sweep.metric,
        "direction": sweep.direction,
        "running": sweep.state == Sweep.State.RUNNING,
        "curves": curves,
        "parcoords": {
            "trials": [t.number for t in scored],
            "states": [t.state for t in scored],
            "dimensions": dimensions,
            "color": metric_values,
        },
    }


def _context(sweep: Sweep, user) -> dict:
    fig = projections.sweep_figures(sweep)  # priced as its projection and budget price it
    currency = money.standing(user).currency
    best_id = fig.best.pk if fig.best else None
    rows = [
        {
            "f": f,
            "t": f.trial,
            "best": f.trial.pk == best_id,
            "params": params_text(f.trial.params, sweep.space),
            "last": _value_text(f.trial.last_value),
            "best_value": _value_text(f.trial.best_value),
        }
        for f in fig.trials
    ]
    return {
        "sweep": sweep,
        "fig": fig,
        "rows": rows,
        "done": sum(1 for f in fig.trials if f.trial.state != Trial.State.RUNNING),
        "currency": currency,
        "savings": savings(fig, currency),
        "space": sweeps.space_text(sweep.space),
        "best_text": _value_text(fig.best.last_value) if fig.best else "",
        "projection": projection_panel.sweep_panel(sweep)
        if sweep.state == Sweep.State.RUNNING
        else None,
    }


@login_required
def sweep_list(request):
    mine = Sweep.objects.filter(owner=request.actor.principal).select_related("pool")
    page = Paginator(mine, 25).get_page(request.GET.get("page"))
    rows = []
    for sweep in page:
        fig = sweeps.figures(sweep, curves=False)
        done = sum(1 for f in fig.trials if f.trial.state != Trial.State.RUNNING)
        best = _value_text(fig.best.last_value) if fig.best else ""
        rows.append({"sweep": sweep, "fig": fig, "done": done, "best": best})
    return render(
        request,
        "console/sweep_list.html",
        {
            "rows": rows,
            "page": page,
            "pages": page.paginator.get_elided_page_range(page.number, on_each_side=2),
        },
    )


@login_required
def sweep_new(request):
    actor = request.actor
    actor.require(Role.MEMBER)
    form = SweepForm(request.POST or None, owner=actor.principal)
    if request.method == "POST" and form.is_valid():
        pool = form.cleaned_data["pool"]
        try:
            sweep = console_pools.sweep_create(
                owner=actor.principal, pool=pool, spec=form.spec(), created_by=actor.person
            )
        except ValidationError as exc:
            attach_errors(form, exc)
        else:
            messages.success(
                request,
                _("Sweep %(name)s started: %(trials)s trials on pool %(pool)s.")
                % {"name": sweep.name, "trials": sweep.trials, "pool": pool.name},
            )
            return redirect("sweep_detail", sweep_id=sweep.pk)
    return render(
        request,
        "console/sweep_new.html",
        {
            "form": form,
            "has_pools": Pool.objects.filter(
                owner=actor.principal, state=Pool.State.ACTIVE
            ).exists(),
            "marker": sweeps.MARKER,
            "params_file": sweeps.PARAMS_FILE,
            "grace_s": settings.SUANLI_STOP_GRACE_S,
        },
    )


@login_required
def sweep_detail(request, sweep_id: int):
    sweep = _sweep_for(request.actor, sweep_id)
    context = _context(sweep, request.actor.principal)
    context["charts"] = chart_data(sweep, context["fig"])
    return render(request, "console/sweep_detail.html", context)


@login_required
def sweep_live(request, sweep_id: int):
    """The parts of the sweep page that change (state, savings, trials), polled with htmx
    while the sweep runs; the page's charts follow from data.json after each swap."""
    sweep = _sweep_for(request.actor, sweep_id)
    return render(request, "console/_sweep_live.html", _context(sweep, request.actor.principal))


@login_required
def sweep_data(request, sweep_id: int):
    sweep = _sweep_for(request.actor, sweep_id)
    return JsonResponse(chart_data(sweep, sweeps.figures(sweep)))


@login_required
@require_POST
def sweep_cancel(request, sweep_id: int):
    sweep = _sweep_for(request.actor, sweep_id)
    request.actor.require_change(sweep)
    if sweep.state != Sweep.State.RUNNING:
        messages.warning(request, _("Sweep %(name)s has already ended.") % {"name": sweep.name})
    else:
        sweeps.sweep_cancel(sweep=sweep)
        messages.success(
            request,
            _("Sweep %(name)s cancelled: its running trials get SIGTERM, then SIGKILL.")
            % {"name": sweep.name},
        )
    return redirect("sweep_detail", sweep_id=sweep.pk)

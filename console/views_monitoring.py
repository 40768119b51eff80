"""Monitoring pages and data: the operators' fleet page (every host's GPUs as a live
heatmap, the hosts' network and disk rates, and the rented GPUs that sit idle), and a
job's chart series for a zoomed time range (the job page's charts fetch it)."""

from datetime import UTC

from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from django.shortcuts import render
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from jobs import selectors as fleet
from monitoring import selectors as metrics


@staff_member_required
def ops_fleet(request):
    return render(request, "console/ops_fleet.html", {"fleet": metrics.fleet()})


@staff_member_required
def ops_fleet_data(request):
    return JsonResponse(metrics.fleet())


@login_required
def job_metrics(request, job_id: int):
    """The job's samples between `from` and `to` (ISO 8601; UTC when no offset is given;
    either may be left out: the job's start, its end), in the page's series shape: every
    second of a short range, a wide one decimated as the page's overview is."""
    job = fleet.job_for_user(request.user, job_id)
    bounds = {}
    for name in ("from", "to"):
        text = request.GET.get(name, "").strip()
        if not text:
            bounds[name] = None
            continue
        try:
            value = parse_datetime(text)
        except ValueError:
            value = None
        if value is None:
            error = f"`{name}` must be an ISO 8601 time (2026-01-05T10:00:00Z), not {text[:40]!r}."
            return JsonResponse({"error": error}, status=400)
        bounds[name] = value if value.tzinfo else value.replace(tzinfo=UTC)
    since, until = bounds["from"], bounds["to"] or timezone.now()
    if since is not None and since >= until:
        return JsonResponse({"error": "`from` must be before `to`."}, status=400)
    resolution, rows, step = metrics.job_chart(job, since=since, until=until)
    return JsonResponse(
        {"resolution": resolution, "step": step, "samples": metrics.as_series(rows)}
    )

"""Monitoring pages and data: the operators' fleet page (every host's GPUs as a live
heatmap, the hosts' network and disk rates, and the rented GPUs that sit idle), a job's
chart series for a zoomed time range (the job page's charts fetch it), and the job page's
Profile section with its trace downloads."""

from datetime import UTC

from django.contrib.auth.decorators import login_required
from django.http import FileResponse, Http404, JsonResponse
from django.shortcuts import render
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from console.powers import operator_required
from jobs.placement import fleet
from monitoring import profiles
from monitoring import selectors as metrics


# The fleet: every host's GPUs and the clusters that hold them.
@operator_required("jobs.view_host", "jobs.view_cluster")
def ops_fleet(request):
    return render(request, "console/ops_fleet.html", {"fleet": metrics.fleet()})


@operator_required("jobs.view_host", "jobs.view_cluster")
def ops_fleet_data(request):
    return JsonResponse(metrics.fleet())


@login_required
def job_metrics(request, job_id: int):
    """The job's samples between `from` and `to` (ISO 8601; UTC when no offset is given;
    either may be left out: the job's start, its end), in the page's series shape: every
    second of a short range, a wide one decimated as the page's overview is."""
    job = fleet.job_for_user(request.actor, job_id)
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


@login_required
def job_profile(request, job_id: int):
    """The job page's Profile section (htmx): its trace files per attempt and rank, their
    summaries (made by the worker; queued here for a file without one), the slowest rank,
    advice and charts. Polled while the job runs or a summary is on its way."""
    job = fleet.job_for_user(request.actor, job_id)
    section = profiles.section(job)
    response = render(request, "console/_job_profile.html", {"job": job, **section})
    if job.is_ended and request.GET.get("after") == "pending" and not section["profile_pending"]:
        # The summaries it waited for are in: redraw the page, whose diagnosis uses them.
        response["HX-Refresh"] = "true"
    return response


@login_required
def job_profile_file(request, job_id: int, attempt: int, name: str):
    """One trace file, as it is on the researcher's storage (for Perfetto or TensorBoard)."""
    return trace_download(fleet.job_for_user(request.actor, job_id), attempt, name)


def trace_download(job, attempt: int, name: str) -> FileResponse:
    """A trace file of the job as an attachment (the page's and the API's download); 404
    unless `profiles.open_file` opens it, so the name is one plain component."""
    handle = profiles.open_file(job, attempt, name)
    if handle is None:
        raise Http404("no such trace")
    kind = "application/gzip" if name.endswith(".gz") else "application/json"
    return FileResponse(
        handle, as_attachment=True, filename=f"job-{job.pk}-a{attempt}-{name}", content_type=kind
    )

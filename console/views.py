from django.conf import settings
from django.contrib import messages
from django.contrib.admin.views.decorators import staff_member_required
from django.contrib.auth import login
from django.contrib.auth.decorators import login_required
from django.contrib.auth.forms import UserCreationForm
from django.db import connection
from django.http import Http404, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from jobs import selectors as fleet
from jobs import services as fleet_services
from jobs.models import Host, Image, InstanceType


@login_required
def dashboard(request):
    availability = fleet.fleet_availability()
    return render(
        request,
        "console/dashboard.html",
        {
            "availability": availability,
            "free_total": sum(row.free for row in availability),
            "gpu_total": sum(row.total for row in availability),
            "any_emulated": any(row.emulated_hosts for row in availability),
            "instance_types": InstanceType.objects.all(),
            "images": Image.objects.filter(active=True),
        },
    )


def signup(request):
    if not settings.SUANLI_SIGNUP_ENABLED:
        raise Http404("Sign-up is switched off on this console; ask your operator for an account.")
    if request.user.is_authenticated:
        return redirect("dashboard")
    form = UserCreationForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        user = form.save()
        login(request, user)
        messages.success(request, f"Welcome to Suanli, {user.username}.")
        return redirect("dashboard")
    return render(request, "registration/signup.html", {"form": form})


@staff_member_required
def ops_hosts(request):
    return render(request, "console/ops_hosts.html", {"hosts": fleet.hosts_with_occupancy()})


@staff_member_required
@require_POST
def ops_host_check(request, host_id: int):
    host = get_object_or_404(Host, pk=host_id)
    host = fleet_services.host_check(host_id=host.pk)
    if host.state == Host.State.DOWN:
        messages.error(request, f"Host {host.name} did not answer: {host.last_error}")
    else:
        messages.success(
            request, f"Host {host.name} answered: Docker {host.docker_version}, {host.state}."
        )
    return redirect("ops_hosts")


def healthz(request):
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return JsonResponse({"ok": True})

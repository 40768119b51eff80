"""Operators' fleet page: every host's GPUs as a live heatmap, the hosts' network and
disk rates, and the rented GPUs that sit idle."""

from django.contrib.admin.views.decorators import staff_member_required
from django.http import JsonResponse
from django.shortcuts import render

from monitoring import selectors as metrics


@staff_member_required
def ops_fleet(request):
    return render(request, "console/ops_fleet.html", {"fleet": metrics.fleet()})


@staff_member_required
def ops_fleet_data(request):
    return JsonResponse(metrics.fleet())

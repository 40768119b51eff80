"""A cluster's scheduled and idle shutdown (定时关机) on its page: the small form that sets
both rules (jobs/clusters/spec.py ShutdownRequest checks them, jobs/clusters/shutdown.py
keeps and applies them), and the button that clears them. The owner's only: another
researcher's cluster is 404 (`fleet.cluster_for_user`), as one that does not exist."""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import redirect, render
from django.utils.translation import gettext as _
from django.views.decorators.http import require_POST

from billing import selectors as money
from console.forms import ShutdownForm
from console.logins import ssh_logins
from console.views import _cluster_context
from jobs.clusters import shutdown
from jobs.clusters.spec import Schedule
from jobs.placement import fleet


@login_required
@require_POST
def cluster_shutdown(request, cluster_id: int):
    """Both rules as the form gives them (an empty field: no such rule); refused, the page
    again with the words on their fields, nothing saved."""
    cluster = fleet.cluster_to_use(request.actor, cluster_id)
    form = ShutdownForm(request.POST, cluster=cluster)
    if not form.is_valid():
        context = _cluster_context(cluster, request.user)
        context.update(
            cost=money.cluster_cost(cluster), logins=ssh_logins(cluster, request),
            shutdown_form=form,
        )  # fmt: skip
        return render(request, "console/cluster_detail.html", context, status=400)
    shutdown.shutdown_set(cluster=cluster, schedule=form.schedule)
    messages.success(
        request, _("The shutdown rules of %(name)s are saved.") % {"name": cluster.name}
    )
    return redirect("cluster_detail", cluster_id=cluster.pk)


@login_required
@require_POST
def cluster_shutdown_clear(request, cluster_id: int):
    cluster = fleet.cluster_to_use(request.actor, cluster_id)
    shutdown.shutdown_set(cluster=cluster, schedule=Schedule())
    messages.success(request, _("%(name)s no longer stops on its own.") % {"name": cluster.name})
    return redirect("cluster_detail", cluster_id=cluster.pk)

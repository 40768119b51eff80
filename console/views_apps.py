"""The tiles of a running cluster's page that start, stop and open the web apps of each
node's workspace (jobs/access/webapps.py): JupyterLab, TensorBoard, a service port. The apps
themselves are served by console/proxy.py, each on an origin of its own
(console/app_origin.py). The owner's only: anyone else gets 404, as for the cluster page.

    POST /clusters/<id>/nodes/<n>/apps/jupyter/start/      (no fields)
    POST /clusters/<id>/nodes/<n>/apps/tensorboard/start/  logdir (empty: the default)
    POST /clusters/<id>/nodes/<n>/apps/service/start/      port (empty: 6006)
    POST /clusters/<id>/nodes/<n>/apps/<kind>/stop/
    GET  /clusters/<id>/nodes/<n>/apps/status/             the tiles' badges (htmx)
    GET  /clusters/<id>/nodes/<n>/apps/<kind>/open/        next (a path of the app)

Each POST (with the CSRF token) answers with a redirect to the cluster page, which says
what happened (or why not, in words) in the tile of that app. `open` hands the owner over to the
app's origin with a single-use ticket (a redirect; making a ticket changes nothing of the
owner's, so a GET will do).
"""

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import Http404
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.translation import gettext as _
from django.views.decorators.http import require_GET, require_POST

from console import app_origin
from jobs.access import webapps
from jobs.models import WorkspaceApp
from jobs.placement import fleet

STARTING_S = 300  # an app that does not answer yet is "starting" this long, then "not answering"


def _tile(index: int, kind: str) -> str:
    """The message's tag: the page shows it in that tile, next to the button that made it
    (templates/console/_cluster_apps.html), not at the top of a page scrolled to the tiles."""
    return f"app-{index}-{str(kind)}"


def _back(cluster, index: int):
    return redirect(f"{reverse('cluster_detail', args=[cluster.pk])}#apps-node-{index}")


def _origin(request, cluster, index: int, kind: str) -> str:
    return app_origin.origin_for(request, app_origin.App(cluster.pk, index, kind)) + "/"


def _kind(kind: str) -> WorkspaceApp.Kind:
    if kind not in webapps.KINDS:
        raise Http404(_("No such app."))
    return WorkspaceApp.Kind(kind)


@login_required
@require_POST
def app_start(request, cluster_id: int, index: int, kind: str):
    cluster = fleet.cluster_to_use(request.actor, cluster_id)
    kind = _kind(kind)
    try:
        app = webapps.start(
            cluster=cluster,
            index=index,
            kind=kind,
            port=request.POST.get("port"),
            logdir=request.POST.get("logdir"),
        )
    except webapps.AppError as exc:
        messages.error(
            request,
            _("Node %(index)s: %(error)s") % {"index": index, "error": exc},
            extra_tags=_tile(index, kind),
        )
        return _back(cluster, index)
    if kind == WorkspaceApp.Kind.SERVICE:
        messages.success(
            request,
            _(
                "Node %(index)s: port %(port)s of the workspace is served at %(prefix)s (to you "
                "only). Your server must listen on 127.0.0.1:%(port)s or 0.0.0.0:%(port)s there."
            )
            % {"index": index, "port": app.port, "prefix": _origin(request, cluster, index, kind)},
            extra_tags=_tile(index, kind),
        )
    else:
        values = {
            "index": index, "app": kind.label, "logdir": app.logdir,
            "log": webapps.log_path(kind),
        }  # fmt: skip
        if app.logdir:
            text = _(
                "Node %(index)s: %(app)s is starting reading %(logdir)s; open it once its tile "
                "says it answers. Its output goes to %(log)s in the workspace."
            )
        else:
            text = _(
                "Node %(index)s: %(app)s is starting; open it once its tile says it answers. "
                "Its output goes to %(log)s in the workspace."
            )
        messages.success(request, text % values, extra_tags=_tile(index, kind))
    return _back(cluster, index)


@login_required
@require_POST
def app_stop(request, cluster_id: int, index: int, kind: str):
    cluster = fleet.cluster_to_use(request.actor, cluster_id)
    kind = _kind(kind)
    if webapps.stop(cluster=cluster, index=index, kind=kind):
        messages.success(
            request,
            _("Node %(index)s: %(app)s stopped.") % {"index": index, "app": kind.label},
            extra_tags=_tile(index, kind),
        )
    else:
        messages.info(
            request,
            _("Node %(index)s: %(app)s was not started.") % {"index": index, "app": kind.label},
            extra_tags=_tile(index, kind),
        )
    return _back(cluster, index)


@login_required
@require_GET
def app_status(request, cluster_id: int, index: int):
    """The badges of a node's started apps: answering, starting (for STARTING_S after a
    start), or not answering. One exec in the workspace, so the page loads it after."""
    cluster = fleet.cluster_for_user(request.actor, cluster_id)
    apps = list(cluster.apps.filter(node_index=index))
    up = webapps.answering(cluster, index, apps)
    now = timezone.now()
    badges = []
    for app in apps:
        if up.get(app.kind):
            state = "answering"
        elif app.kind != WorkspaceApp.Kind.SERVICE and (
            (now - app.started_at).total_seconds() < STARTING_S
        ):
            state = "starting"
        else:
            state = "not answering"
        badges.append({"kind": app.kind, "state": state})
    return render(
        request,
        "console/_app_status.html",
        {
            "cluster": cluster,
            "index": index,
            "badges": badges,
            "again": any(b["state"] == "starting" for b in badges),
        },
    )


@login_required
@require_GET
def app_open(request, cluster_id: int, index: int, kind: str):
    """The owner, handed over to the app's origin with a ticket (console/app_origin.py)."""
    cluster = fleet.cluster_to_use(request.actor, cluster_id)
    app = app_origin.App(cluster.pk, index, _kind(kind).value)
    ticket = app_origin.ticket_make(user=request.user, app=app)
    return redirect(app_origin.enter_url(request, app, request.GET.get("next", "/"), ticket))


@login_required
@require_GET
def app_open_old(request, cluster_id: str, index: str, kind: str, rest: str | None):
    """An app's address from before it had an origin of its own: the same path there."""
    request.GET = request.GET.copy()
    query = request.META.get("QUERY_STRING", "")
    request.GET["next"] = (rest or "/") + (f"?{query}" if query else "")
    return app_open(request, int(cluster_id), int(index), kind)

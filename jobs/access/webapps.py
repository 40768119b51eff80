"""Web apps in a node's workspace that the console proxies to the cluster's owner
(console/proxy.py): JupyterLab, TensorBoard, and a port of a server the researcher runs
there themselves. One of each kind per node (jobs.models.WorkspaceApp); each is reached
through the console's proxy at the root of an origin of its own (console/app_origin.py),
never on a port of the GPU host, never on the console's origin.

Starting one is an exec in the workspace as the tenant's uid (workspaces.exec_kwargs),
with one argv list: what the researcher typed (a log folder) is an argument, never a word
of a shell script. First a check that the image has the program (`command -v`, else
words that say which image has it), and the end of the same app started before on that
node (every process that carries its marker, SUANLI_APP=c<cluster>-n<node>-<kind>, in its
environment: its kernels and terminals too); then the program starts detached, bound to
the workspace's loopback on a port of its own (JUPYTER_PORT, TENSORBOARD_PORT), its output
in /tmp/suanli-<kind>.log of the workspace. JupyterLab gets a random token that only the
proxy sends (`Authorization: token ...`); the researcher never types it. A service port is
only recorded: the researcher's own server listens there.

Whether an app answers is read from the workspace's /proc/net/tcp (a socket listening on
its port), so that a tile can say "not answering" once its process is gone.

Rows go with the cluster's workspaces: `forget(cluster_id)` when a cluster stops
(jobs.clusters.services calls it). A release deletes the rows itself, in the release's
transaction in jobs.events.lifecycle, which is below this package and may not call it.

Layer: access, beside ssh at its top (the console's apps' proxy and the cluster services use
it); uses nodes (workspaces, engine) and models.
"""

from __future__ import annotations

import logging
import posixpath
import secrets
from dataclasses import dataclass

import docker
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from jobs.models import Cluster, WorkspaceApp
from jobs.nodes import engine, workspaces
from jobs.placement import catalog

log = logging.getLogger(__name__)

Kind = WorkspaceApp.Kind
KINDS = tuple(Kind.values)
PORTS = range(1024, 65536)  # a service port, and any port the proxy reaches
JUPYTER_PORT = 18888  # ours: away from the 8888 and 6006 a researcher's own servers take
TENSORBOARD_PORT = 16006
SERVICE_PORT = 6006  # the default a researcher's own server is asked for
LOGDIR_MAX = 255  # WorkspaceApp.logdir's length
MARKER = "SUANLI_APP"
PROGRAMS = {Kind.JUPYTER: "jupyter", Kind.TENSORBOARD: "tensorboard"}
PACKAGES = {Kind.JUPYTER: "jupyterlab", Kind.TENSORBOARD: "tensorboard"}
MISSING = {
    Kind.JUPYTER: gettext_lazy("This image has no JupyterLab (jupyter is not on its PATH)."),
    Kind.TENSORBOARD: gettext_lazy(
        "This image has no TensorBoard (tensorboard is not on its PATH)."
    ),
}
CHECKPOINT_WORDS = ("checkpoint", "ckpt")
# $1: the marker line, $2: the program ("" for none). Exit 127 when the image lacks the
# program; else every process of the marker gets SIGTERM, and SIGKILL after 5 s.
PREPARE = r"""
if [ -n "$2" ] && ! command -v "$2" >/dev/null 2>&1; then exit 127; fi
marked() {
  for p in /proc/[0-9]*; do
    tr "\0" "\n" < "$p/environ" 2>/dev/null | grep -qxF "$1" && echo "${p#/proc/}"
  done
}
pids=$(marked "$1")
[ -z "$pids" ] && exit 0
kill -TERM $pids 2>/dev/null
i=0
while [ "$i" -lt 25 ]; do
  sleep 0.2 2>/dev/null || sleep 1
  pids=$(marked "$1")
  [ -z "$pids" ] && exit 0
  i=$((i + 1))
done
kill -KILL $pids 2>/dev/null
exit 0
"""
# "$@": the program and its arguments; its output to $SUANLI_APP_LOG (or nowhere when
# the image's /tmp is not writable), its input nothing.
START = (
    '{ : >"$SUANLI_APP_LOG"; } 2>/dev/null || SUANLI_APP_LOG=/dev/null\n'
    'exec "$@" >>"$SUANLI_APP_LOG" 2>&1 </dev/null'
)
# "$@": ports. One line each: "<port> up" when a socket listens on it, else "<port> down".
LISTENING = r"""
for port in "$@"; do
  hex=$(printf '%04X' "$port")
  if grep -qE "^ *[0-9]+: [0-9A-F]+:$hex [0-9A-F]+:0000 0A " /proc/net/tcp /proc/net/tcp6 2>/dev/null
  then echo "$port up"; else echo "$port down"; fi
done
"""
_ERRORS = (docker.errors.DockerException, engine.EngineError, OSError)


class AppError(Exception):
    """An app was not started or stopped; the text says why, for the researcher."""


def marker(cluster_id: int, index: int, kind: str) -> str:
    return f"{MARKER}=c{cluster_id}-n{index}-{kind}"


def log_path(kind: str) -> str:
    return f"/tmp/suanli-{kind}.log"  # noqa: S108 (the workspace's own /tmp)


# -- what a researcher types ---------------------------------------------------------------


def clean_port(value) -> int:
    """A service port as typed: a whole number in PORTS; AppError in words otherwise."""
    text = str(value if value is not None else "").strip()
    args = {"low": PORTS.start, "high": PORTS.stop - 1, "example": SERVICE_PORT}
    if not text.isascii() or not text.isdigit() or len(text) > 5:
        raise AppError(
            _(
                "The port must be a whole number from %(low)s to %(high)s: the one your server "
                "listens on in the workspace (e.g. %(example)s). '%(value)s' is not."
            )
            % {**args, "value": _shown(text)}
        )
    port = int(text)
    if port not in PORTS:
        raise AppError(
            _(
                "The port must be a whole number from %(low)s to %(high)s: the one your server "
                "listens on in the workspace (e.g. %(example)s). %(port)s is not."
            )
            % {**args, "port": port}
        )
    return port


def clean_logdir(value) -> str:
    """TensorBoard's log folder as typed: an absolute path in the workspace, normalised,
    without `..`, control characters or a trailing slash, at most LOGDIR_MAX characters."""
    text = str(value if value is not None else "").strip()
    args = {"most": LOGDIR_MAX, "value": _shown(text), "length": len(text)}
    if not text:
        raise AppError(
            _(
                "The log folder must be an absolute path in the workspace, like /workspace/runs "
                "(no '..', no control characters, at most %(most)s characters); it is empty."
            )
            % args
        )
    if len(text) > LOGDIR_MAX:
        raise AppError(
            _(
                "The log folder must be an absolute path in the workspace, like /workspace/runs "
                "(no '..', no control characters, at most %(most)s characters); it has "
                "%(length)s."
            )
            % args
        )
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
        raise AppError(
            _(
                "The log folder must be an absolute path in the workspace, like /workspace/runs "
                "(no '..', no control characters, at most %(most)s characters); it has a "
                "control character."
            )
            % args
        )
    if not text.startswith("/"):
        raise AppError(
            _(
                "The log folder must be an absolute path in the workspace, like /workspace/runs "
                "(no '..', no control characters, at most %(most)s characters); '%(value)s' is "
                "relative."
            )
            % args
        )
    if ".." in text.split("/"):
        raise AppError(
            _(
                "The log folder must be an absolute path in the workspace, like /workspace/runs "
                "(no '..', no control characters, at most %(most)s characters); '%(value)s' has "
                "'..'."
            )
            % args
        )
    normal = posixpath.normpath(text)
    return "/" + normal.lstrip("/")  # normpath keeps a leading '//'


def default_logdir(cluster: Cluster) -> str:
    """The checkpoint volume (a volume whose target says checkpoint or ckpt: TensorBoard
    reads every run under it), else `runs` in the workspace's home."""
    for volume in cluster.volumes.all():
        if any(word in volume.target.lower() for word in CHECKPOINT_WORDS):
            return volume.target.rstrip("/") or "/"
    return posixpath.join(workspaces.home(cluster), "runs")


def _shown(text: str) -> str:
    shown = "".join(ch if ch.isprintable() else "?" for ch in text[:60])
    return shown + ("..." if len(text) > 60 else "")


# -- the workspace's side (blocking engine calls) ------------------------------------------


def _exec(container, cluster: Cluster, cmd: list[str], *, env: dict | None = None, detach=False):
    """One exec as the tenant (workspaces.exec_kwargs): never root, never privileged."""
    made = workspaces.exec_kwargs(cluster, cmd, tty=False, env=env)
    return container.exec_run(
        cmd,
        user=made["user"],
        workdir=made["workdir"],
        environment=made["environment"],
        privileged=False,
        stdin=False,
        detach=detach,
    )


def _container(cluster: Cluster, index: int):
    try:
        return workspaces.running(cluster, index)
    except workspaces.WorkspaceError as exc:
        raise AppError(
            _("Node %(index)s's workspace cannot be reached: %(error)s.")
            % {"index": index, "error": exc}
        ) from None


def _argv(cluster: Cluster, index: int, kind: str, port: int, token: str, logdir: str):
    if kind == Kind.JUPYTER:
        return [
            "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
            "--ServerApp.port_retries=0",
            "--ServerApp.base_url=/",  # the root of its own origin
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={workspaces.home(cluster)}",
            # The proxy passes the app origin's Host on (so that JupyterLab's own origin
            # check of its websockets holds); JupyterLab listens on the loopback only, and
            # its token is the proxy's.
            "--ServerApp.allow_remote_access=True",
        ]  # fmt: skip
    return [
        "tensorboard", "--logdir", logdir, "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


def start(*, cluster: Cluster, index: int, kind: str, port=None, logdir=None) -> WorkspaceApp:
    """Start (or start again) the app `kind` in node `index`'s workspace and record it;
    AppError in words when the input, the workspace or the image will not do. A service
    port is only recorded: its server is the researcher's."""
    if kind not in KINDS:
        raise AppError(_("There is no app called '%(app)s'.") % {"app": _shown(str(kind))})
    token, folder = "", ""
    if kind == Kind.SERVICE:
        port = clean_port(port) if str(port or "").strip() else SERVICE_PORT
    elif kind == Kind.TENSORBOARD:
        folder = clean_logdir(logdir) if str(logdir or "").strip() else default_logdir(cluster)
        port = TENSORBOARD_PORT
    else:
        port, token = JUPYTER_PORT, secrets.token_hex(24)
    container = _container(cluster, index)
    if kind != Kind.SERVICE:
        label, mark = Kind(kind).label, marker(cluster.pk, index, kind)
        try:
            found = _exec(container, cluster, ["/bin/sh", "-c", PREPARE, "prepare", mark,
                                               PROGRAMS[kind]])  # fmt: skip
            if found.exit_code == 127:
                raise AppError(
                    _sentences(str(MISSING[kind]), where_to_get(kind, python=has_python(cluster)))
                )
            if found.exit_code != 0:
                raise AppError(
                    _("%(app)s could not be started: the workspace said %(output)s.")
                    % {"app": label, "output": repr(_shown(found.output.decode(errors="replace")))}
                )
            env = {MARKER: mark.partition("=")[2], "SUANLI_APP_LOG": log_path(kind)}
            argv = _argv(cluster, index, kind, port, token, folder)
            _exec(container, cluster, ["/bin/sh", "-c", START, "app", *argv], env=env,
                  detach=True)  # fmt: skip
        except _ERRORS as exc:
            log.warning("%s of cluster %s node %s not started: %s", kind, cluster.pk, index,
                        engine.describe(exc))  # fmt: skip
            raise AppError(
                _(
                    "%(app)s could not be started: node %(index)s's workspace did not answer; "
                    "try again in a minute."
                )
                % {"app": label, "index": index}
            ) from None
    with transaction.atomic():
        app, _created = WorkspaceApp.objects.update_or_create(
            cluster=cluster, node_index=index, kind=kind,
            defaults={"port": port, "token": token, "logdir": folder,
                      "started_at": timezone.now()},
        )  # fmt: skip
    log.info("%s started on cluster %s node %s (port %s)", kind, cluster.pk, index, port)
    return app


def stop(*, cluster: Cluster, index: int, kind: str) -> bool:
    """End the app (its processes, for JupyterLab and TensorBoard) and forget it. False
    when none was started. The row goes even when the workspace is gone meanwhile."""
    app = WorkspaceApp.objects.filter(cluster=cluster, node_index=index, kind=kind).first()
    if app is None:
        return False
    if kind != Kind.SERVICE:
        try:
            container = workspaces.running(cluster, index)
            mark = marker(cluster.pk, index, kind)
            _exec(container, cluster, ["/bin/sh", "-c", PREPARE, "stop", mark, ""])
        except (workspaces.WorkspaceError, *_ERRORS) as exc:
            log.info("%s of cluster %s node %s not ended: %s", kind, cluster.pk, index, exc)
    WorkspaceApp.objects.filter(pk=app.pk).delete()
    return True


def forget(cluster_id: int) -> int:
    """The hook for a stop or a release of the cluster: its apps' rows go (their processes
    die with the workspaces). Returns how many went."""
    deleted, _by_model = WorkspaceApp.objects.filter(cluster_id=cluster_id).delete()
    return deleted


# -- reads ---------------------------------------------------------------------------------


def started(cluster: Cluster, index: int, kind: str) -> WorkspaceApp | None:
    return WorkspaceApp.objects.filter(cluster=cluster, node_index=index, kind=kind).first()


def answering(cluster: Cluster, index: int, apps: list[WorkspaceApp]) -> dict[str, bool]:
    """kind -> whether something listens on its port in the node's workspace (one exec);
    all False when the workspace cannot be reached."""
    if not apps:
        return {}
    ports = sorted({app.port for app in apps})
    up: set[int] = set()
    try:
        container = workspaces.running(cluster, index)
        found = _exec(container, cluster,
                      ["/bin/sh", "-c", LISTENING, "listening", *map(str, ports)])  # fmt: skip
        for line in found.output.decode(errors="replace").splitlines():
            port, _sep, state = line.partition(" ")
            # The workspace's own shell wrote this: "²" or 5,000 digits must not raise.
            if state == "up" and port.isascii() and port.isdigit() and len(port) <= 5:
                up.add(int(port))
    except (workspaces.WorkspaceError, *_ERRORS) as exc:
        log.info("apps of cluster %s node %s not probed: %s", cluster.pk, index, exc)
    return {app.kind: app.port in up for app in apps}


@dataclass(frozen=True)
class NodeApps:
    """What a node's tiles show: its started apps by kind, and the inputs' defaults."""

    cluster_id: int
    index: int
    jupyter: WorkspaceApp | None
    tensorboard: WorkspaceApp | None
    service: WorkspaceApp | None
    logdir: str  # the log folder field's value
    port: int  # the port field's value
    home: str  # where JupyterLab starts
    jupyter_note: str = ""  # the image has no JupyterLab: which has (image_note)
    tensorboard_note: str = ""

    @property
    def any_started(self) -> bool:
        return any((self.jupyter, self.tensorboard, self.service))


# Words in an image's reference or framework that say it has Python (and pip) in it.
PYTHON_WORDS = ("python", "pytorch", "torch", "tensorflow", "jax", "jupyter", "conda", "scipy")


def has_python(cluster: Cluster) -> bool:
    """Whether the cluster's image is a Python one (pip install works in it): a catalog
    image carrying a workspace app or naming a framework, or a reference that says so. A
    plain base image (busybox, debian, nvidia/cuda) is not."""
    image = cluster.image
    framework = image.framework.strip().lower() if image else ""
    if image is not None and (image.apps.strip() or framework not in ("", "none")):
        return True
    words = f"{cluster.image_reference} {image.reference if image else ''}".lower()
    return any(word in words for word in PYTHON_WORDS)


def where_to_get(kind: str, *, besides: int | None = None, python: bool = True) -> str:
    """Which image to choose for the app `kind`, naming only catalog images that can run
    here (catalog.with_app: never one no host has and none can pull), else how to get it
    in the workspace (pip, on an image with Python: `python`); in the reader's language."""
    names = [i.name for i in catalog.with_app(kind) if i.pk != besides]
    values = {"package": PACKAGES[kind], "images": ", ".join(names)}
    if names and python:
        return (
            _(
                "Create a cluster with an image that has it (%(images)s), or pip install %(package)s in the workspace."
            )
            % values
        )
    if names:
        return _("Create a cluster with an image that has it (%(images)s).") % values
    if python:
        return (
            _("No image offered here has it: pip install %(package)s in the workspace first.")
            % values
        )
    return (
        _(
            "This image has no Python to install it with: choose an image with Python, and pip install %(package)s in its workspace."
        )
        % values
    )


def image_note(cluster: Cluster, kind: str) -> str:
    """What a JupyterLab or TensorBoard tile says of the cluster's image: nothing when it
    is a catalog image that carries the app (Image.apps); else that it needs one, and
    which to choose (`where_to_get`)."""
    image = cluster.image
    if image is not None and kind in image.apps.split():
        return ""
    if image is not None:
        first = _("%(image)s has no %(app)s.") % {"image": image.name, "app": Kind(kind).label}
    else:
        first = _("%(app)s runs only where the image has it.") % {"app": Kind(kind).label}
    return _sentences(
        first, where_to_get(kind, besides=cluster.image_id, python=has_python(cluster))
    )


def _sentences(first: str, second: str) -> str:
    """Two sentences, with a space between them where the language puts one (none after
    a Chinese full stop)."""
    return first + ("" if first.endswith(("。", "！", "？")) else " ") + second


def tiles(cluster: Cluster, indexes) -> list[NodeApps]:
    """The tiles of the cluster's nodes `indexes` (five queries, whatever the count)."""
    found = {(a.node_index, a.kind): a for a in cluster.apps.all()}
    logdir, home = default_logdir(cluster), workspaces.home(cluster)
    notes = {kind: image_note(cluster, kind) for kind in PROGRAMS} if indexes else {}
    rows = []
    for index in indexes:
        tb, svc = found.get((index, Kind.TENSORBOARD)), found.get((index, Kind.SERVICE))
        rows.append(
            NodeApps(
                cluster_id=cluster.pk,
                index=index,
                jupyter=found.get((index, Kind.JUPYTER)),
                tensorboard=tb,
                service=svc,
                logdir=tb.logdir if tb else logdir,
                port=svc.port if svc else SERVICE_PORT,
                home=home,
                jupyter_note=notes.get(Kind.JUPYTER, ""),
                tensorboard_note=notes.get(Kind.TENSORBOARD, ""),
            )
        )
    return rows

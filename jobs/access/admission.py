"""Who may log in to the SSH gateway and stay logged in, as the database says (on threads
of its own: in_db), and failed log-ins per address across gateway processes and the web
log-in (django-axes). Only the gateway process (jobs/access/ssh.py) imports this.

A key may log in as c<cluster>-<node> when the cluster's owner attached that very key to
the cluster and the owner's account is on (key_attached); a login may open another
channel while its cluster runs, its node is live with the same workspace and its key is
still attached (still_admitted); the heartbeat asks the same of every connection at once
(live_workspaces). Every login goes on the cluster's timeline (record_login).

Guessing is throttled like the web log-in (console/auth.py): an SSH connection is read as
a web request by axes (axes_request), so every gateway process and the web log-in count
the same failures, axes's own rows in the database; at AXES_FAILURE_LIMIT failures within
the cool-off the address is locked (address_locked) and told so (lockout_words).

A database outage becomes a refusal in words and is logged once (jobs.base.outage).

Layer: access, over sessions; uses timeline, workspaces and models.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import asyncssh
from axes.handlers.proxy import AxesProxyHandler
from axes.helpers import get_cool_off
from django.conf import settings
from django.contrib.auth.signals import user_login_failed
from django.db import close_old_connections
from django.http import HttpRequest
from django.utils.translation import gettext_noop

from jobs.access.sessions import Login, Refused, workspace_node
from jobs.base.outage import DB_DOWN, Outage, close_db_connections
from jobs.base.text import Text
from jobs.events import timeline
from jobs.models import Cluster, Node

log = logging.getLogger("suanli.gateway")

# -- the database, on threads of its own ----------------------------------------------------

_db_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gateway-db")
_database = Outage("PostgreSQL (gateway)", log)
_DB_AWAY = (
    "Suanli cannot check this login right now (its database does not answer); "
    "try again in a minute."
)


async def in_db(fn, *args):
    """`fn(*args)` on a database thread, with that thread's dead or old connection
    replaced first; a database outage becomes a refusal in words."""

    def call():
        close_old_connections()
        try:
            result = fn(*args)
        except DB_DOWN as exc:
            close_db_connections()
            _database.failed(exc)
            raise Refused(_DB_AWAY) from None
        _database.ok()
        return result

    return await asyncio.get_running_loop().run_in_executor(_db_pool, call)


def key_attached(cluster_id: int, fingerprint: str, public_data: bytes) -> bool:
    """The key is one the cluster's owner attached to it (the same key, not only the same
    fingerprint), and the owner's account is on. False for anything else, alike: another
    researcher's key, a key attached to no cluster, a cluster that does not exist, an
    account an operator turned off."""
    cluster = (
        Cluster.objects.filter(pk=cluster_id, owner__is_active=True).only("pk", "owner_id").first()
    )
    if cluster is None:
        return False
    for text in cluster.ssh_keys.filter(
        owner_id=cluster.owner_id, fingerprint=fingerprint
    ).values_list("public_key", flat=True):
        try:
            if asyncssh.import_public_key(text).public_data == public_data:
                return True
        except (asyncssh.KeyImportError, ValueError):
            continue
    return False


def still_admitted(login: Login) -> str | None:
    """None while a login may open another channel: its cluster runs, its node is live with
    the same workspace, its key is still attached and the account on. Else why not, in
    words for the researcher."""
    name = login.name
    if not key_attached(login.cluster.pk, login.fingerprint, login.key_data):
        return f"Suanli: the key {login.fingerprint} may not log in as {name} any more."
    cluster = Cluster.objects.filter(pk=login.cluster.pk).first()
    if cluster is None:
        return f"Suanli: {name}: there is no such cluster."
    try:
        node = workspace_node(cluster, login.index, name)
    except Refused as exc:
        return str(exc)
    if node.host_id != login.host.pk or node.workspace_container != login.container_id:
        return (
            f"Suanli: {name}: the workspace of node {login.index} was made again since this "
            "connection logged in; log in again."
        )
    return None


def live_workspaces(cluster_ids: set[int]) -> set[tuple[int, int, int, str]]:
    """(cluster, node index, host, workspace) of the live nodes of those clusters that run
    and whose owner's account is on: what an admitted connection may still reach."""
    return set(
        Node.objects.filter(
            cluster_id__in=cluster_ids, cluster__state=Cluster.State.RUNNING,
            cluster__owner__is_active=True, released_at__isnull=True, lost_at__isnull=True,
        ).values_list("cluster_id", "index", "host_id", "workspace_container")
    )  # fmt: skip


def record_login(login: Login) -> None:
    timeline.cluster_event(
        login.cluster,
        "ssh",
        Text(
            gettext_noop("ssh login to node %(index)s with key %(key)s"),
            index=login.index,
            key=login.fingerprint,
        ),
    )


# -- failed log-ins per address, across gateway processes (django-axes) ----------------------

SSH_PATH = "/ssh/"  # what the admin's Access attempts show as the "path" of an SSH log-in
_LOGIN_CREDENTIALS_MAX = 150  # axes' username column


def axes_request(address: str, client_version: str) -> HttpRequest:
    """An SSH connection as axes reads a web request: the client's address, its version
    string as the user agent (shown in the admin), and SSH_PATH."""
    request = HttpRequest()
    request.META["REMOTE_ADDR"] = address
    request.META["HTTP_USER_AGENT"] = client_version[:255]
    request.path = request.path_info = request.META["PATH_INFO"] = SSH_PATH
    return request


def address_locked(request: HttpRequest) -> bool:
    """Whether the address has AXES_FAILURE_LIMIT failures within the cool-off."""
    return settings.AXES_ENABLED and AxesProxyHandler.is_locked(request, None)


def login_failed(request: HttpRequest, login_name: str) -> bool:
    """Count one failed log-in of the request's address; True when that locked it."""
    credentials = {"username": login_name[:_LOGIN_CREDENTIALS_MAX]}
    user_login_failed.send(sender=__name__, credentials=credentials, request=request)
    return bool(getattr(request, "axes_locked_out", False))


def lockout_words() -> str:
    cool_off = get_cool_off()
    minutes = max(1, -(-int(cool_off.total_seconds()) // 60)) if cool_off else 1
    return (
        "Suanli: too many failed log-ins from your address: SSH log-ins from it are refused "
        f"for now, with any key. Try again in {minutes} minute{'s' if minutes != 1 else ''}, "
        "or ask an operator to unlock your address."
    )

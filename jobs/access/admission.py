"""Who may log in to the SSH gateway and stay logged in, as the database says (on threads
of its own: in_db), and failed log-ins per address across gateway processes and the web
log-in (django-axes). Only the gateway process (jobs/access/ssh.py) imports this.

A key may log in as c<cluster>-<node> when that very key is attached to the cluster and
its holder may use it (key_attached): the owner's own key while the owner's account is
on; on a team's cluster a member's own key (SSH keys stay personal) while they are in the
team and their role may use that cluster (member or above and added to it, or an admin
or the owner; a viewer is told they read only; a stranger or a removed member reads as a
missing cluster). A login may open another channel while its cluster runs, its node is
live with the same workspace, its key is still attached and its person still may use
the cluster (still_admitted); the heartbeat asks the same of every connection at once
(live_workspaces, attached_keys), and a membership revoked ends the person's connections
to the team's clusters at once (the gateway's revocations listener). Every login goes on the cluster's timeline (record_login).

Guessing is throttled like the web log-in (console/auth.py): an SSH connection is read as
a web request by axes (axes_request), so every gateway process and the web log-in count
the same failures, axes's own rows in the database; at AXES_FAILURE_LIMIT failures within
the cool-off the address is locked (address_locked) and told so (lockout_words).

A database outage becomes a refusal in words and is logged once (jobs.base.outage).

Refusals are in the researcher's language where the console knows it (the language they
chose in the console, console.models.Preferences, read through the user's `preferences`
relation: no import of the console): a key not attached gets the words of the language
of the account that registered that key (first registered, if several did), the same
whatever the cluster named (another's, none, a stranger's), and says what to do: attach
it on the cluster's page (SUANLI_PUBLIC_URL/clusters/<id>/, built from the name typed).
What is told only to the holder of an attached key (the cluster is not running, ...) is
in the cluster owner's language (admit, still_admitted). A key unknown to the console, or
an account with no choice, reads LANGUAGE_CODE.

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
from django.contrib.auth import get_user_model
from django.contrib.auth.signals import user_login_failed
from django.db import close_old_connections
from django.http import HttpRequest
from django.utils import translation
from django.utils.translation import gettext, gettext_noop

from jobs.access import sessions
from jobs.access.sessions import Login, Refused, workspace_node
from jobs.base.outage import DB_DOWN, Outage, close_db_connections
from jobs.base.text import Text
from jobs.events import timeline
from jobs.models import Cluster, Node, SshKey, TeamMember
from jobs.tenancy.actors import actor_on

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


class ReadOnly(Refused):
    """A team's viewer proved an attached key: read only, so no login (told in words)."""


def key_attached(cluster_id: int, fingerprint: str, public_data: bytes) -> int | None:
    """The person who may log in with this very key (not only the same fingerprint)
    attached to the cluster: its owner's own key while the owner's account is on, or a
    team member's own key while they are in the team that owns the cluster and their role
    may use it (jobs.tenancy.actors.Actor.may_use: member or above, added to it, or an
    admin or the owner). SSH keys stay personal: a member logs in with their own.
    None for anything else, alike: another researcher's key, a key attached to no
    cluster, a cluster that does not exist, an account an operator turned off, a member
    removed from the team (or not added to this cluster). A viewer's attached key is
    refused in words (ReadOnly): they see the cluster, they may not act on it."""
    cluster = Cluster.objects.filter(pk=cluster_id, owner__is_active=True).first()
    if cluster is None:
        return None
    holder = _holder(cluster, fingerprint, public_data)
    if holder is None:
        return None
    if holder.pk == cluster.owner_id:
        return holder.pk
    actor = actor_on(holder, cluster)
    if actor is None or not actor.sees(cluster):
        return None
    if not actor.may_use(cluster):
        with translation.override(language_of(holder.pk)):
            raise ReadOnly(
                gettext(
                    "Suanli: your role in %(team)s is %(role)s, which reads only: it may not "
                    "log in to cluster %(cluster)s. Ask the team's owner or an admin for the member role."
                )
                % {
                    "team": actor.team.name,
                    "role": TeamMember.Role(actor.role).label,
                    "cluster": cluster.name,
                }
            )
    return holder.pk


def _holder(cluster: Cluster, fingerprint: str, public_data: bytes):
    """The active account whose key attached to `cluster` is this very key, else None."""
    rows = cluster.ssh_keys.filter(fingerprint=fingerprint, owner__is_active=True)
    for key in rows.select_related("owner"):
        try:
            if asyncssh.import_public_key(key.public_key).public_data == public_data:
                return key.owner
        except (asyncssh.KeyImportError, ValueError):
            continue
    return None


# -- the researcher's language -------------------------------------------------------------


def language_of(user_id: int | None) -> str:
    """The language the person chose in the console, else LANGUAGE_CODE."""
    chosen = ""
    if user_id is not None:
        chosen = (
            get_user_model()
            .objects.filter(pk=user_id)
            .values_list("preferences__language", flat=True)
            .first()
        )
    known = {code for code, _ in settings.LANGUAGES}
    return chosen if chosen in known else settings.LANGUAGE_CODE


def key_holder(fingerprint: str, public_data: bytes) -> int | None:
    """The active account that registered this very key first (None: nobody did)."""
    rows = SshKey.objects.filter(fingerprint=fingerprint, owner__is_active=True).order_by(
        "created_at", "pk"
    )
    for owner_id, text in rows.values_list("owner_id", "public_key"):
        try:
            if asyncssh.import_public_key(text).public_data == public_data:
                return owner_id
        except (asyncssh.KeyImportError, ValueError):
            continue
    return None


def cluster_url(cluster_id: int) -> str:
    """The cluster's page, from its number alone (the gateway imports no views)."""
    return f"{settings.SUANLI_PUBLIC_URL.rstrip('/')}/clusters/{cluster_id}/"


def not_attached_words(cluster_id: int, fingerprint: str, public_data: bytes, typed: str) -> str:
    """Why a proven key may not log in as `typed` (c<cluster_id>-<node>), and what to do, in
    its holder's language: the same words whether that cluster is another's, does not
    exist or is the holder's own."""
    holder = key_holder(fingerprint, public_data)
    args = {"key": fingerprint, "login": typed, "url": cluster_url(cluster_id),
            "keys_url": f"{settings.SUANLI_PUBLIC_URL.rstrip('/')}/keys/"}  # fmt: skip
    with translation.override(language_of(holder)):
        if holder is None:
            return (
                gettext(
                    "Suanli: the key %(key)s may not log in as %(login)s: it is on no account "
                    "here. Add it on the SSH keys page, %(keys_url)s, then attach it on the "
                    "cluster's page, %(url)s (it logs in at once, no restart)."
                )
                % args
            )
        return (
            gettext(
                "Suanli: the key %(key)s may not log in as %(login)s: it is not attached to "
                "this cluster. Attach it on the cluster's page, %(url)s (it logs in at once, no "
                "restart); keys are added on the SSH keys page, %(keys_url)s."
            )
            % args
        )


def admit(
    name: str, cluster_id: int, index: int, fingerprint: str, key_data: bytes, person_id: int
) -> Login:
    """sessions.admit for `person_id` (key_attached's), its refusals in their language."""
    with translation.override(language_of(person_id)):
        login = sessions.admit(name, cluster_id, index, fingerprint, key_data, person_id)
    login.who = get_user_model().objects.get(pk=person_id).get_username()
    return login


def still_admitted(login: Login) -> str | None:
    """None while a login may open another channel: its cluster runs, its node is live with
    the same workspace, its key is still attached, the account on and, on a team's
    cluster, its person still a member who may use it. Else why not, in words for the
    researcher, in their language."""
    with translation.override(language_of(login.person_id)):
        return _still_admitted(login)


def _still_admitted(login: Login) -> str | None:
    name = login.name
    if not member_may_use(login):
        return revoked_words(login)
    try:
        holder = key_attached(login.cluster.pk, login.fingerprint, login.key_data)
    except ReadOnly as exc:
        return str(exc)
    if holder != login.person_id:
        return gettext(
            "Suanli: the key %(key)s may not log in as %(login)s any more: it was detached "
            "from the cluster or removed. Attach it again on the cluster's page, %(url)s."
        ) % {"key": login.fingerprint, "login": name, "url": cluster_url(login.cluster.pk)}
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


def member_may_use(login: Login) -> bool:
    """On a team's cluster, whether the login's person is still a member whose role may
    use it now (always True on one's own cluster, or a cluster gone: the rest says why)."""
    cluster = Cluster.objects.filter(pk=login.cluster.pk).first()
    if cluster is None or login.person_id in (None, cluster.owner_id):
        return True
    person = get_user_model().objects.filter(pk=login.person_id, is_active=True).first()
    actor = actor_on(person, cluster) if person is not None else None
    return actor is not None and actor.may_use(cluster)


def revoked_words(login: Login) -> str:
    """Why a team member's login ended or may open no more channels: they are no longer in
    the team that owns the cluster (removed, or they left), or their role or the cluster's
    members changed so that they may not use it."""
    return gettext(
        "Suanli: %(login)s: your access to this cluster ended: you are no longer a member of "
        "the team that owns it, or your role there no longer lets you log in to it."
    ) % {"login": login.name}


def attached_keys(cluster_ids: set[int]) -> set[tuple[int, str, int]]:
    """(cluster, key fingerprint, person) of the keys attached to those clusters that may
    log in (key_attached's rule, for all of them in three queries): the owner's own, and a
    team member's own while their role may use the cluster. The heartbeat ends a
    connection whose key and person are no longer among them."""
    rows = list(
        Cluster.ssh_keys.through.objects.filter(
            cluster_id__in=cluster_ids, sshkey__owner__is_active=True
        ).values_list("cluster_id", "cluster__owner_id", "sshkey__owner_id", "sshkey__fingerprint")
    )
    owners = {owner_id for _, owner_id, _, _ in rows}
    roles = dict(
        ((principal, person), role)
        for principal, person, role in TeamMember.objects.filter(
            team__principal_id__in=owners
        ).values_list("team__principal_id", "person_id", "role")
    )
    added = set(
        Cluster.members.through.objects.filter(cluster_id__in=cluster_ids).values_list(
            "cluster_id", "user_id"
        )
    )
    may: set[tuple[int, str, int]] = set()
    for cluster_id, owner_id, person_id, fingerprint in rows:
        role = roles.get((owner_id, person_id))
        if (
            person_id == owner_id
            or role in (TeamMember.Role.OWNER, TeamMember.Role.ADMIN)
            or (role == TeamMember.Role.MEMBER and (cluster_id, person_id) in added)
        ):
            may.add((cluster_id, fingerprint, person_id))
    return may


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
    """The login on the cluster's timeline with its key; on a team's cluster also who
    logged in (the key's holder, by their login), since several people may."""
    if login.person_id in (None, login.cluster.owner_id):
        text = Text(
            gettext_noop("ssh login to node %(index)s with key %(key)s"),
            index=login.index, key=login.fingerprint,
        )  # fmt: skip
    else:
        text = Text(
            gettext_noop("ssh login to node %(index)s by %(who)s with key %(key)s"),
            index=login.index, who=login.who, key=login.fingerprint,
        )  # fmt: skip
    timeline.cluster_event(login.cluster, "ssh", text)


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

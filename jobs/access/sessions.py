"""Who is logged in to which workspace, read and counted alike by the SSH gateway
(jobs/access/ssh.py) and the web process's terminal and workspace apps' proxy
(console/terminal.py, console/proxy.py):
- a login (Login: one node's workspace, reached as the tenant) and its admission: admit
  (what the database says), workspace_up (what the engine says), Refused (why not, in
  words for the researcher);
- the sessions per researcher that `SUANLI_SSH_MAX_SESSIONS` bounds, counted in Redis
  with an expiry (SESSION_TTL_S, refreshed every HEARTBEAT_S), so that the sessions of
  every gateway process and every web terminal count together and a killed process's
  expire. While Redis is away logins are let in uncounted and the outage is logged once
  (jobs.base.outage);
- the port researchers' `ssh -p` names.

Imports no asyncssh: the web process imports this.

Layer: access, under streams, sftp, admission and ssh; uses workspaces, engine, outage and
models.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import django_rq
import docker
from django.conf import settings

from jobs.base.outage import REDIS_DOWN, Outage
from jobs.models import Cluster, Host, Node
from jobs.nodes import engine, workspaces

log = logging.getLogger("suanli.gateway")

SESSION_TTL_S = 90  # a session's count in Redis lives this long unless refreshed
HEARTBEAT_S = 30
ENGINE_ERRORS = (docker.errors.DockerException, engine.EngineError, OSError)


def ssh_port() -> int:
    """The port researchers' `ssh -p` names."""
    return int(settings.SUANLI_SSH_PORT)


# -- a login: what the database and the engine say ------------------------------------------


@dataclass
class Login:
    """What an admitted connection reaches: one node's workspace."""

    name: str
    cluster: Cluster
    index: int
    host: Host
    container_id: str
    fingerprint: str
    key_data: bytes  # the key it proved, checked again on every channel open
    exec_base: dict  # workspaces.exec_kwargs as the tenant, for every exec of the login
    # Who logged in: the key's holder (the cluster's owner, or a member of the team that
    # owns it), whose sessions are counted and whose removal from the team ends the login.
    person_id: int | None = None
    who: str = ""  # the person's login, for the timeline and the log


class Refused(Exception):
    """A login is refused; the text is the banner, for the researcher."""


def client(login: Login) -> docker.DockerClient:
    """The engine of the login's node (cached per host)."""
    return engine.cached_client(login.host)


def workspace_node(cluster: Cluster, index: int, name: str) -> Node:
    """The live node `index` of a running cluster with workspaces, whose workspace was made;
    else Refused in the words workspaces.running uses (what the engine says is asked
    apart, off the database's threads: workspace_up)."""
    try:
        node = workspaces.live_node(cluster, index)
    except workspaces.WorkspaceError as exc:
        raise Refused(f"Suanli: {name}: {exc}.") from None
    return node


def admit(
    name: str, cluster_id: int, index: int, fingerprint: str, key_data: bytes,
    person_id: int | None = None,
) -> Login:  # fmt: skip
    """What the database says of a proven holder of an attached key (`person_id`, the one
    who logs in): the node's workspace to reach, or Refused saying why not (the cluster's
    state, a missing node, a workspace not made yet). Whether the engine runs it is
    workspace_up's."""
    cluster = Cluster.objects.filter(pk=cluster_id).first()
    if cluster is None:  # deleted since its key was checked
        raise Refused(f"Suanli: {name}: there is no such cluster.")
    node = workspace_node(cluster, index, name)
    return Login(
        name=name, cluster=cluster, index=index, host=node.host,
        container_id=node.workspace_container, fingerprint=fingerprint, key_data=key_data,
        exec_base=workspaces.exec_kwargs(cluster, [], tty=False),
        person_id=cluster.owner_id if person_id is None else person_id,
    )  # fmt: skip


def workspace_up(login: Login) -> None:
    """The engine runs the login's workspace, or Refused saying so in words (the engine's
    own text, which names its addresses, goes to the log only). Blocking: the executor's."""
    index = login.index
    try:
        found = client(login).api.inspect_container(login.container_id)
    except docker.errors.NotFound:
        raise Refused(
            f"Suanli: {login.name}: the workspace of node {index} is being made again; "
            "try again shortly."
        ) from None
    except ENGINE_ERRORS as exc:
        log.warning("%s: the engine of %s did not answer: %s", login.name, login.host.name,
                    engine.describe(exc))  # fmt: skip
        raise Refused(
            f"Suanli: {login.name}: the host of node {index} does not answer; "
            "try again in a minute."
        ) from None
    status = (found.get("State") or {}).get("Status", "unknown")
    if status != "running":
        raise Refused(f"Suanli: {login.name}: the workspace of node {index} is {status}.")


# -- sessions per researcher, across gateway processes and terminals (Redis) ----------------
#
# Counted per person, the one who logged in (Login.person_id; a web terminal's user), not
# per owner of the cluster: on a team's clusters every member has SUANLI_SSH_MAX_SESSIONS
# of their own, so that one member's sessions cannot starve the rest of the lab, and a
# researcher's own clusters count as before (the owner is the person).

redis_outage = Outage("Redis (gateway)", log)


def _sessions_key(owner_id: int) -> str:
    return f"suanli:gateway:sessions:u{owner_id}"


def session_claim(owner_id: int, session_id: str, limit: int) -> bool:
    """Count one more session of the researcher, unless they have `limit` already. Each
    entry expires unless its gateway refreshes it, so a killed process's go on their own.
    While Redis is away logins are let in uncounted (the limit bounds use, it guards
    nothing), and counted once it is back (`sessions_refresh`)."""
    key, now = _sessions_key(owner_id), time.time()
    try:
        with django_rq.get_connection("default").pipeline() as pipe:
            pipe.zremrangebyscore(key, "-inf", now)
            pipe.zadd(key, {session_id: now + SESSION_TTL_S})
            pipe.zcard(key)
            pipe.expire(key, SESSION_TTL_S)
            count = pipe.execute()[2]
            if count > limit:
                pipe.zrem(key, session_id).execute()
                return False
    except REDIS_DOWN as exc:
        redis_outage.failed(exc)
        return True
    redis_outage.ok()
    return True


def sessions_refresh(live: dict[str, int]) -> None:
    """Keep the live sessions (id -> researcher) counted for another SESSION_TTL_S."""
    if not live:
        return
    expiry = time.time() + SESSION_TTL_S
    try:
        with django_rq.get_connection("default").pipeline() as pipe:
            for session_id, owner_id in live.items():
                pipe.zadd(_sessions_key(owner_id), {session_id: expiry})
                pipe.expire(_sessions_key(owner_id), SESSION_TTL_S)
            pipe.execute()
    except REDIS_DOWN as exc:
        redis_outage.failed(exc)
        return
    redis_outage.ok()


def session_release(owner_id: int, session_id: str) -> None:
    try:
        django_rq.get_connection("default").zrem(_sessions_key(owner_id), session_id)
    except REDIS_DOWN as exc:
        redis_outage.failed(exc)  # it expires on its own

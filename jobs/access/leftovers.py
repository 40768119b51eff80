"""What a killed SSH gateway left running in the workspaces, hung up by the next one.

A gateway that ends as asked (SIGTERM) hangs up its sessions' processes itself, as the
kernel does when an SSH connection drops (streams.exec_hang_up). One that is killed (or
whose machine dies) cannot: its shells and commands would run on for good. So each
gateway process is an instance (a random id) that
- marks every exec of its channels with `SUANLI_SSH=<instance>-<channel>` (streams.MARKER);
- keeps, in Redis, its slot (this machine, bind address and port: only one process
  listens there at a time), a beat refreshed every heartbeat, and the workspaces its
  logins reached (host id and container id), written at each login and again at each beat
  (so a login made while Redis was away, or a Redis that came back empty, is counted);
- at its start and every heartbeat, hangs up (SIGHUP, in their exec's session only:
  streams.HANG_UP) the processes of dead instances in the workspaces they reached: an
  instance of its own slot other than itself is dead at once (it listens there now); one
  of another slot (a replica elsewhere) once its beat has not moved for DEAD_S of this
  one's watching, so a live replica's sessions are never touched, a Redis outage neither.

Each workspace is looked up in the database (a live node's workspace container on that
host) and the hang-up runs in it as its tenant (workspaces.exec_kwargs), touching only
processes that carry the dead instance's marker: never another tenant's container, never
the workspace's own main process, never what ignores SIGHUP (nohup) or left the session
(tmux, screen, setsid). While Redis is away nothing is swept (logged once).

Layer: access, under ssh; uses streams, sessions, workspaces, engine, outage and models.
"""

from __future__ import annotations

import json
import logging
import re
import time

import django_rq

from jobs.access.sessions import ENGINE_ERRORS, HEARTBEAT_S, Login, redis_outage
from jobs.access.streams import MARKER, hang_up
from jobs.base.outage import REDIS_DOWN
from jobs.models import Node
from jobs.nodes import engine, workspaces

log = logging.getLogger("suanli.gateway")

INSTANCES = "suanli:gateway:instances"  # hash: instance -> {"slot", "beat"}
DEAD_S = 150  # another slot's instance whose beat stood still this long is dead
INSTANCE = re.compile(r"[0-9a-f]{12}")  # secrets.token_hex(6), as ssh.Gateway makes it


def _reached_key(instance: str) -> str:
    return f"suanli:gateway:reached:{instance}"


def _place(login: Login) -> str:
    return f"{login.host.pk}:{login.container_id}"


def marker(instance: str, channel: str) -> str:
    """A channel's marker, `SUANLI_SSH=<instance>-<channel>`."""
    return f"{MARKER}={instance}-{channel}"


def beat(instance: str, slot: str, logins: list[Login]) -> bool:
    """This instance is alive (its slot and a new beat), and the workspaces its live
    logins reach; False when Redis is away."""
    try:
        with django_rq.get_connection("default").pipeline() as pipe:
            pipe.hset(INSTANCES, instance, json.dumps({"slot": slot, "beat": time.time()}))
            if logins:
                pipe.sadd(_reached_key(instance), *{_place(login) for login in logins})
            pipe.execute()
    except REDIS_DOWN as exc:
        redis_outage.failed(exc)
        return False
    redis_outage.ok()
    return True


def reached(instance: str, login: Login) -> None:
    """A login of this instance reaches a workspace (before any exec of it)."""
    try:
        django_rq.get_connection("default").sadd(_reached_key(instance), _place(login))
    except REDIS_DOWN as exc:
        redis_outage.failed(exc)  # written again at the next beat


def forget(instance: str) -> None:
    """An instance that ended as asked (its channels hung up what they started)."""
    try:
        with django_rq.get_connection("default").pipeline() as pipe:
            pipe.hdel(INSTANCES, instance)
            pipe.delete(_reached_key(instance))
            pipe.execute()
    except REDIS_DOWN as exc:
        redis_outage.failed(exc)


def sweep(instance: str, slot: str, watched: dict[str, tuple]) -> int:
    """Hang up what dead instances left (see the module's text); `watched` keeps, between
    calls, each other slot's instance's last beat and since when it has not moved (and,
    under "", when this one last looked: after a gap, Redis away, it watches anew).
    Returns how many workspaces were swept. Blocking: run it on a thread."""
    try:
        found = django_rq.get_connection("default").hgetall(INSTANCES)
    except REDIS_DOWN as exc:
        redis_outage.failed(exc)
        return 0
    now = time.monotonic()
    looked = watched.get("", (None, now))[1]
    if now - looked > 2 * HEARTBEAT_S:
        watched.clear()  # it could not watch meanwhile: no beat stood still in its sight
    watched[""] = (None, now)
    dead = []
    for key, value in found.items():
        other = key.decode()
        if other == instance or not INSTANCE.fullmatch(other):
            continue
        try:
            info = json.loads(value)
        except ValueError:
            info = {}
        if info.get("slot") == slot:
            dead.append(other)
            continue
        last = watched.get(other)
        if last is None or last[0] != info.get("beat"):
            watched[other] = (info.get("beat"), now)
        elif now - last[1] >= DEAD_S:
            dead.append(other)
    for gone in set(watched) - {k.decode() for k in found} - {""}:
        del watched[gone]
    return sum(_sweep_instance(other) for other in dead)


def _sweep_instance(instance: str) -> int:
    """Hang up the processes of a dead instance in each workspace it reached; its record
    goes once every one of them was done (an engine that does not answer is tried again
    at the next sweep)."""
    redis = django_rq.get_connection("default")
    key = _reached_key(instance)
    pattern = f"^{MARKER}={instance}-"
    swept = left = 0
    for member in redis.smembers(key):
        host_id, _, container_id = member.decode().partition(":")
        node = (
            Node.objects.filter(
                host_id=int(host_id) if host_id.isdigit() else 0,
                workspace_container=container_id,
                released_at__isnull=True,
            )
            .select_related("cluster", "host")
            .first()
        )
        if node is not None and container_id:
            try:
                api = engine.cached_client(node.host).api
                hang_up(api, container_id, workspaces.exec_kwargs(node.cluster, [], tty=False),
                        pattern)  # fmt: skip
            except ENGINE_ERRORS as exc:
                log.info("gateway %s's leftovers on %s not hung up yet: %s", instance,
                         node.host.name, engine.describe(exc))  # fmt: skip
                left += 1
                continue
            swept += 1
        redis.srem(key, member)
    if not left:
        with redis.pipeline() as pipe:
            pipe.hdel(INSTANCES, instance)
            pipe.delete(key)
            pipe.execute()
    log.info("hung up what gateway %s left in %s workspace(s)", instance, swept)
    return swept

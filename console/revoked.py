"""Websockets that end when their person loses the team that owns what they show.

A team member's live log, chart, build log, web terminal or app websocket shows something
a team owns (its principal). When the member is removed or leaves, jobs.teams.services
announces it (jobs.tenancy.revocations: the Channels group `group_for(person)`, message
`{"type": "access.revoked", "principal": id}`), and every such socket of theirs closes at
once with 4403 (the terminal also hangs up its shell). Each socket's `Watch` joins that
group on a channel of its own, so that sockets without a channel layer of their own (the
terminal, the polling log, the app proxy's, which a Redis outage must leave open) get it
too; through a Redis restart it joins again with back-off (logged once), and every
HEARTBEAT_S it also reads the membership itself, so a message lost meanwhile still ends
the socket within that time.

The actor of a console socket is the page's (`scope_actor`: the session's acting-for
choice, console/acting.py); the app proxy's is whoever its cookie names, as a member of
the team that owns the cluster (jobs.tenancy.actors.actor_on).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from channels.db import database_sync_to_async
from channels.layers import get_channel_layer
from django.http import Http404

from console.acting import SESSION_KEY
from jobs.access.sessions import HEARTBEAT_S
from jobs.base.outage import DB_DOWN, REDIS_DOWN, Outage
from jobs.models import TeamMember
from jobs.tenancy import revocations
from jobs.tenancy.actors import Actor

log = logging.getLogger("suanli.web")

CLOSE_CODE = 4403  # what a socket closes with when its person lost the team


def scope_actor(scope) -> Actor:
    """The socket's actor, as the page's request.actor (sync: reads the session and the
    membership). A team no longer theirs: they act for themselves (whose sockets show
    nothing of the team's: 4404)."""
    user = scope["user"]
    session = scope.get("session")
    team_id = session.get(SESSION_KEY) if session is not None else None
    if team_id is None:
        return Actor.of(user)
    try:
        return Actor.for_team(user, team_id)
    except Http404:
        return Actor.of(user)


def still_member(person_id: int, principal_id: int) -> bool:
    return TeamMember.objects.filter(person_id=person_id, team__principal_id=principal_id).exists()


class Watch:
    """Calls `ended()` once when the actor's person loses the team that owns what the
    socket shows (`owner_id`, the object's owner). Nothing to watch when the actor acts
    for themselves, or shows what its team does not own (an operator reading another's
    log): start() does nothing then."""

    def __init__(self, actor: Actor, owner_id: int, ended: Callable[[], Awaitable[None]]):
        self.person_id, self.principal_id, self.ended = actor.person.pk, owner_id, ended
        self.active = actor.team is not None and owner_id == actor.principal.pk
        self.task: asyncio.Task | None = None
        self.channel: str | None = None

    def start(self) -> Watch:
        if self.active and self.task is None:
            self.task = asyncio.ensure_future(self._run())
        return self

    async def stop(self) -> None:
        task, self.task = self.task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._leave()

    async def _leave(self) -> None:
        channel, self.channel = self.channel, None
        layer = get_channel_layer()
        if channel is not None and layer is not None:
            with contextlib.suppress(Exception):  # Redis away: the group's entry expires
                await layer.group_discard(revocations.group_for(self.person_id), channel)

    async def _run(self) -> None:
        down = Outage(f"Redis (revocations of person {self.person_id})", log)
        listen = asyncio.ensure_future(self._listen(down))
        try:
            while not listen.done():
                await asyncio.wait({listen}, timeout=HEARTBEAT_S)
                if listen.done():
                    break
                try:
                    member = await database_sync_to_async(still_member, thread_sensitive=False)(
                        self.person_id, self.principal_id
                    )
                except DB_DOWN:
                    continue  # the next beat reads again; the message still ends it
                if not member:
                    break
        finally:
            listen.cancel()
        self.task = None
        await self._leave()
        await self.ended()

    async def _listen(self, down: Outage) -> None:
        """Return once the revocation of this principal for this person comes."""
        layer = get_channel_layer()
        group = revocations.group_for(self.person_id)
        while True:
            try:
                if self.channel is None:
                    self.channel = await layer.new_channel()
                    await layer.group_add(group, self.channel)
                    down.ok()
                message = await layer.receive(self.channel)
            except REDIS_DOWN as exc:
                self.channel = None
                await asyncio.sleep(down.failed(exc))
                continue
            if (
                message.get("type") == "access.revoked"
                and message.get("principal") == self.principal_id
            ):
                return

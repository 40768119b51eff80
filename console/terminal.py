"""The web terminal: a websocket (ws/clusters/<id>/nodes/<index>/terminal/) to a shell with a
TTY in a node's workspace, the same way in as the SSH gateway's shell (jobs/access/sessions.py: its
admission and session count; jobs/access/streams.py: its exec as the tenant's uid, its engine
stream and its hang-up). The page is
templates/console/terminal.html with static/js/terminal.js (xterm.js).

Frames: binary from the browser are keystrokes (UTF-8, or raw bytes), binary to it are the
TTY's output, untouched (xterm.js decodes UTF-8 across frames); a text frame from the
browser is a control message, `{"resize": [cols, rows]}`.

Only who may use the cluster gets a shell: its owner, or a member of the team that owns
it acting for that team whose role may use it (console/revoked.scope_actor: the page's
acting-for choice; jobs.tenancy.actors.Actor.may_use). Anyone else's socket is closed
before it is accepted (4404, as if the cluster did not exist); a team's viewer is told in
the terminal that the role reads only (4403). A member removed from the team (or who
left) has the terminal closed at once (4403, console/revoked.Watch) and what the shell
ran hung up. The origin check is the router's (console/asgi.py). A cluster that is not running, or a node without a running workspace,
gets the reason written into the terminal, then the socket closes (4000).

The engine's socket is the gateway's EngineStream's (threads of its own, TLS-safe), and
engine and database calls run on worker threads: nothing here waits on the event loop.
Output goes to the browser in order, one frame at a time; while frames pile up (a slow
browser) the stream stops reading the engine. Input is held back the same way: while more
than the stream's high-water mark waits for a shell that does not read (`sleep` in raw
mode), `receive` waits until it drains, so the server's websocket stops reading the
browser (uvicorn reads one message ahead); a single message over MAX_FRAME closes the
socket (4413) with a line saying why (terminal.js sends pastes in smaller pieces).

A terminal is one of the person's `SUANLI_SSH_MAX_SESSIONS` sessions (the person's, on a
team's cluster too: jobs/access/sessions.py), counted in Redis
with the gateway's (sessions.session_claim): one over is refused in words (4429). The count
is refreshed while the terminal is open and released when it closes. A terminal with no
input and no output for `SUANLI_SSH_IDLE_S` closes (4408) with a line saying so.

The login goes on the cluster's timeline before the shell opens. However the socket ends
(the browser goes, the shell exits, idle, a refusal, the consumer cancelled), one
clean-up runs once: the stream's threads stop, the session is released and, when the
socket closed first, what the shell left running is hung up (SIGHUP), as for an SSH
session whose connection drops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time

import docker
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.http import Http404
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from console import revoked
from jobs.access import sessions, streams
from jobs.base.text import Text
from jobs.events import timeline
from jobs.nodes import engine, workspaces
from jobs.placement import fleet

log = logging.getLogger("suanli.web")

MARKER = "SUANLI_TERMINAL"  # env of the terminal's exec: its own value, for the hang-up
MAX_SIZE = 1000  # columns or rows: more is not a screen
HIGH_WATER, LOW_WATER = 64, 16  # output frames waiting for the browser: pause, resume
MAX_FRAME = 64 * 1024  # bytes in one message from the browser: more closes the socket
_ENDED = object()
_ENGINE_ERRORS = (docker.errors.DockerException, engine.EngineError, OSError)


def _to_use(actor, cluster_id: int):
    """The cluster the actor sees (else Http404), and why they may not log in to it (a
    team's viewer), in words; "" when they may."""
    cluster = fleet.cluster_for_user(actor, cluster_id)
    return cluster, "" if actor.may_use(cluster) else _read_only(actor, cluster)


def _read_only(actor, cluster) -> str:
    return _(
        "Suanli: your role in %(team)s is %(role)s, which reads only: it may not log in to "
        "cluster %(cluster)s. Ask the team's owner or an admin for the member role."
    ) % {
        "team": actor.team.name,
        "role": actor.membership.get_role_display(),
        "cluster": cluster.name,
    }


def _console_line(text: str) -> bytes:
    """A line of the console's own (not the shell's), in yellow, on a line of its own."""
    return f"\r\n\x1b[33m{text}\x1b[0m\r\n".encode()


class TerminalConsumer(AsyncWebsocketConsumer):
    channel_layer_alias = None  # no groups: a Redis outage leaves open terminals alone

    login: sessions.Login | None = None
    stream: streams.EngineStream | None = None
    sender: asyncio.Task | None = None
    watcher: asyncio.Task | None = None
    finishing: asyncio.Future | None = None
    drained: asyncio.Event | None = None  # clear while input waits for the shell
    session_owner: int | None = None  # whose session this terminal counts as, once claimed
    exec_id = ""
    marker = ""
    closed = False
    active = 0.0  # time.monotonic() of the last input or output
    watch: revoked.Watch | None = None  # the person's membership of the cluster's team

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:  # also when cancelled (the server stops): nothing is left behind
            if self.stream is not None or self.session_owner is not None:
                self._finish()

    async def _authorised(self, cluster_id: int) -> bool:
        """Accepted, and watching the membership, when the socket's actor may use the
        cluster; else closed (4401 nobody, 4404 unseen, 4403 a viewer, in words)."""
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return False
        try:
            actor = await database_sync_to_async(revoked.scope_actor)(self.scope)
            cluster, read_only = await database_sync_to_async(_to_use)(actor, cluster_id)
        except Http404:
            await self.close(code=4404)  # another researcher's: nothing, not even a reason
            return False
        await self.accept()
        if read_only:  # a team's viewer: sees it, may not log in
            await self._say_and_close(read_only, revoked.CLOSE_CODE)
            return False
        self.watch = revoked.Watch(actor, cluster.owner_id, self._revoked).start()
        return True

    async def connect(self):
        route = self.scope["url_route"]["kwargs"]
        cluster_id, index = int(route["cluster_id"]), int(route["index"])
        if not await self._authorised(cluster_id):
            return
        user = self.scope["user"]
        name = workspaces.login_name(cluster_id, index)
        self.session_id = f"web-{secrets.token_hex(8)}"
        try:
            # Not thread-sensitive: a slow engine must not hold the shared sync thread.
            self.login = await database_sync_to_async(sessions.admit, thread_sensitive=False)(
                name, cluster_id, index, "", b"", user.pk
            )
            await asyncio.to_thread(sessions.workspace_up, self.login)  # the engine's say
            owner_id, limit = user.pk, settings.SUANLI_SSH_MAX_SESSIONS  # the person's count
            if not await asyncio.to_thread(
                sessions.session_claim, owner_id, self.session_id, limit
            ):
                await self._say_and_close(
                    _(
                        "Suanli: you have as many SSH sessions and terminals open as one "
                        "researcher may (%(limit)s). End one (exit, or close its window), then "
                        "reload this page."
                    )
                    % {"limit": limit},
                    4429,
                )
                return
            self.session_owner = owner_id
            # On the timeline before the shell opens: nothing to undo when this fails.
            await database_sync_to_async(timeline.cluster_event, thread_sensitive=False)(
                self.login.cluster,
                "terminal",
                Text(
                    gettext_noop("web terminal login to node %(index)s by %(who)s"),
                    index=index,
                    who=str(user),
                ),
            )
        except sessions.Refused as exc:
            await self._say_and_close(str(exc))
            return
        except Exception:
            log.exception("%s: opening a web terminal for %s failed", name, user)
            await self._say_and_close(
                _("Suanli: the console could not open this terminal; try again in a minute.")
            )
            return
        self.marker = f"{MARKER}={secrets.token_hex(12)}"
        self.output: asyncio.Queue = asyncio.Queue()
        self.drained = asyncio.Event()
        self.drained.set()
        self.stream = streams.EngineStream(
            asyncio.get_running_loop(), on_output=self._output, on_end=self._on_end,
            on_backlog=self._on_backlog, multiplexed=False,
        )  # fmt: skip
        env = {"TERM": "xterm-256color", MARKER: self.marker.partition("=")[2]}
        try:
            self.exec_id, hijacked = await asyncio.to_thread(
                streams.exec_open, self.login, streams.LOGIN_SHELL, tty=True, env=env
            )
            self.stream.start(hijacked)
        except _ENGINE_ERRORS as exc:
            await self._say_and_close(
                _("Suanli: the workspace of node %(index)s did not answer: %(error)s.")
                % {"index": index, "error": engine.describe(exc)}
            )
            return
        self.active = time.monotonic()
        self.sender = asyncio.create_task(self._send_output())
        self.watcher = asyncio.create_task(self._watch())

    async def _revoked(self) -> None:
        await self._say_and_close(
            _(
                "Suanli: your access to this cluster ended: you are no longer a member of the "
                "team that owns it. The terminal closes."
            ),
            revoked.CLOSE_CODE,
        )

    async def _say_and_close(self, text: str, code: int = 4000) -> None:
        """A line of the console's in the terminal, then the socket closes and all ends."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError, RuntimeError):  # the browser went meanwhile
            await self.send(bytes_data=_console_line(text))
            await self.close(code=code)
        await asyncio.shield(self._finish())

    # the engine's side (called on the loop by the stream)

    def _output(self, data: bytes, stderr: bool) -> None:
        self.active = time.monotonic()
        self.output.put_nowait(data)
        if self.output.qsize() > HIGH_WATER:
            self.stream.hold("browser", True)

    def _on_backlog(self, full: bool) -> None:
        if full:
            self.drained.clear()
        else:
            self.drained.set()

    def _on_end(self) -> None:
        self.output.put_nowait(_ENDED)
        self.drained.set()  # nothing will read what waits: stop waiting for it

    async def _send_output(self) -> None:
        try:
            while (data := await self.output.get()) is not _ENDED:
                await self.send(bytes_data=data)
                if self.output.qsize() < LOW_WATER:
                    self.stream.hold("browser", False)
            if not self.closed:  # the shell ended (exit): say so, and close
                self.closed = True
                await self.send(bytes_data=_console_line(_("The shell ended.")))
                await self.close(code=1000)
        except (OSError, RuntimeError):  # the browser went meanwhile: disconnect() follows
            pass
        self._finish()

    async def _watch(self) -> None:
        """Close the terminal once idle; keep its session counted meanwhile."""
        limit, beat = settings.SUANLI_SSH_IDLE_S, sessions.HEARTBEAT_S
        refreshed = time.monotonic()
        while True:
            now = time.monotonic()
            if now - self.active >= limit:
                log.info("%s: web terminal idle for %s s, closed", self.login.name, limit)
                await self._say_and_close(
                    _("Suanli: idle for %(limit)s s (no input, no output): the terminal closes.")
                    % {"limit": limit},
                    4408,
                )
                return
            if now - refreshed >= beat:
                refreshed = now
                try:
                    live = {self.session_id: self.session_owner}
                    await asyncio.to_thread(sessions.sessions_refresh, live)
                except Exception:  # the next beat tries again; the count expires meanwhile
                    log.exception("refreshing the session count failed")
            wake = min(self.active + limit, refreshed + beat) - time.monotonic()
            await asyncio.sleep(max(wake, 0) + 0.05)

    # the browser's side

    async def receive(self, text_data=None, bytes_data=None):
        if self.stream is None or self.closed:
            return
        size = len(bytes_data) if bytes_data is not None else len((text_data or "").encode())
        if size > MAX_FRAME:
            await self._say_and_close(
                _(
                    "Suanli: %(size)s bytes came in one message, more than the terminal takes at "
                    "once (%(max)s KiB): it closes."
                )
                % {"size": size, "max": MAX_FRAME // 1024},
                4413,
            )
            return
        self.active = time.monotonic()
        if bytes_data:
            self.stream.write(bytes_data)  # queued for the stream's writer thread
            if not self.drained.is_set():
                # The shell does not read what came: take nothing more from the browser
                # until it has (the server's socket holds the browser back meanwhile).
                await self.drained.wait()
            return
        try:
            cols, rows = json.loads(text_data or "")["resize"]
        except (ValueError, TypeError, KeyError):
            return  # not a control message we know: ignored, never typed
        if all(isinstance(n, int) and 0 < n <= MAX_SIZE for n in (cols, rows)):
            await asyncio.to_thread(streams.exec_resize, self.login, self.exec_id, cols, rows)

    async def disconnect(self, code):
        await asyncio.shield(self._finish())

    # the end, once

    def _finish(self) -> asyncio.Future:
        if self.finishing is None:
            self.finishing = asyncio.ensure_future(self._clean_up())
        return self.finishing

    async def _clean_up(self) -> None:
        self.closed = True
        if self.watch is not None:
            watch, self.watch = self.watch, None
            await watch.stop()
        if self.drained is not None:
            self.drained.set()  # a receive() waiting for the shell returns
        tasks = [task for task in (self.sender, self.watcher) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            if self.session_owner is not None:  # first: the engine may be slow
                owner_id, self.session_owner = self.session_owner, None
                await asyncio.to_thread(sessions.session_release, owner_id, self.session_id)
            if self.stream is not None:
                ended = self.stream.ended
                self.stream.close()
                if not ended and self.exec_id:  # the socket closed first: end what runs
                    await asyncio.to_thread(
                        streams.exec_hang_up, self.login, self.exec_id, self.marker
                    )
        except Exception:
            log.exception("%s: closing a web terminal failed", getattr(self.login, "name", "?"))

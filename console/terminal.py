"""The web terminal: a websocket (ws/clusters/<id>/nodes/<index>/terminal/) to a shell with a
TTY in a node's workspace, the same way in as the SSH gateway's shell (jobs/gateway.py: its
admission, its exec as the tenant's uid, its engine stream and its hang-up). The page is
templates/console/terminal.html with static/js/terminal.js (xterm.js).

Frames: binary from the browser are keystrokes (UTF-8, or raw bytes), binary to it are the
TTY's output, untouched (xterm.js decodes UTF-8 across frames); a text frame from the
browser is a control message, `{"resize": [cols, rows]}`.

Only the cluster's owner gets a shell: anyone else's socket is closed before it is
accepted (4404, as if the cluster did not exist); the origin check is the router's
(console/asgi.py). A cluster that is not running, or a node without a running workspace,
gets the reason written into the terminal, then the socket closes (4000).

The engine's socket is the gateway's EngineStream's (threads of its own, TLS-safe), and
engine and database calls run on worker threads: nothing here waits on the event loop.
Output goes to the browser in order, one frame at a time; while frames pile up (a slow
browser) the stream stops reading the engine. When the socket closes first, what the
shell left running is hung up (SIGHUP), as for an SSH session whose connection drops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets

import docker
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.http import Http404

from jobs import engine, gateway, lifecycle, workspaces
from jobs import selectors as fleet

log = logging.getLogger("suanli.web")

MARKER = "SUANLI_TERMINAL"  # env of the terminal's exec: its own value, for the hang-up
MAX_SIZE = 1000  # columns or rows: more is not a screen
HIGH_WATER, LOW_WATER = 64, 16  # output frames waiting for the browser: pause, resume
_ENDED = object()
_ENGINE_ERRORS = (docker.errors.DockerException, engine.EngineError, OSError)


def _words(text: str) -> bytes:
    """A line of the console's own (not the shell's), in yellow, on a line of its own."""
    return f"\r\n\x1b[33m{text}\x1b[0m\r\n".encode()


class TerminalConsumer(AsyncWebsocketConsumer):
    channel_layer_alias = None  # no groups: a Redis outage leaves open terminals alone

    login: gateway.Login | None = None
    stream: gateway.EngineStream | None = None
    sender: asyncio.Task | None = None
    exec_id = ""
    closed = False

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        route = self.scope["url_route"]["kwargs"]
        cluster_id, index = int(route["cluster_id"]), int(route["index"])
        try:
            await database_sync_to_async(fleet.cluster_for_user)(user, cluster_id)
        except Http404:
            await self.close(code=4404)  # another researcher's: nothing, not even a reason
            return
        await self.accept()
        name = workspaces.login_name(cluster_id, index)
        try:
            # Not thread-sensitive: a slow engine must not hold the shared sync thread.
            self.login = await database_sync_to_async(gateway.admit, thread_sensitive=False)(
                name, cluster_id, index, ""
            )
        except gateway.Refused as exc:
            await self._refuse(str(exc))
            return
        self.marker = f"{MARKER}={secrets.token_hex(12)}"
        self.output: asyncio.Queue = asyncio.Queue()
        self.stream = gateway.EngineStream(
            asyncio.get_running_loop(), on_output=self._output, on_end=self._on_end,
            on_backlog=lambda full: None, multiplexed=False,
        )  # fmt: skip
        env = {"TERM": "xterm-256color", MARKER: self.marker.partition("=")[2]}
        try:
            self.exec_id, hijacked = await asyncio.to_thread(
                gateway.exec_open, self.login, gateway.LOGIN_SHELL, tty=True, env=env
            )
        except _ENGINE_ERRORS as exc:
            await self._refuse(
                f"Suanli: the workspace of node {index} did not answer: {engine.describe(exc)}."
            )
            return
        self.stream.start(hijacked)
        self.sender = asyncio.create_task(self._send_output())
        await database_sync_to_async(lifecycle.cluster_event, thread_sensitive=False)(
            self.login.cluster, "terminal", f"web terminal login to node {index} by {user}"
        )

    async def _refuse(self, text: str) -> None:
        self.closed = True
        await self.send(bytes_data=_words(text))
        await self.close(code=4000)

    # the engine's side (called on the loop by the stream)

    def _output(self, data: bytes, stderr: bool) -> None:
        self.output.put_nowait(data)
        if self.output.qsize() > HIGH_WATER:
            self.stream.pause()

    def _on_end(self) -> None:
        self.output.put_nowait(_ENDED)

    async def _send_output(self) -> None:
        try:
            while (data := await self.output.get()) is not _ENDED:
                await self.send(bytes_data=data)
                if self.output.qsize() < LOW_WATER:
                    self.stream.resume()
            if not self.closed:  # the shell ended (exit): say so, and close
                self.closed = True
                await self.send(bytes_data=_words("The shell ended."))
                await self.close(code=1000)
        except (OSError, RuntimeError):  # the browser went meanwhile: disconnect() follows
            pass

    # the browser's side

    async def receive(self, text_data=None, bytes_data=None):
        if self.stream is None or self.closed:
            return
        if bytes_data:
            self.stream.write(bytes_data)  # queued for the stream's writer thread
            return
        try:
            cols, rows = json.loads(text_data or "")["resize"]
        except (ValueError, TypeError, KeyError):
            return  # not a control message we know: ignored, never typed
        if all(isinstance(n, int) and 0 < n <= MAX_SIZE for n in (cols, rows)):
            await asyncio.to_thread(gateway.exec_resize, self.login, self.exec_id, cols, rows)

    async def disconnect(self, code):
        if self.stream is None:
            return
        ended, self.closed = self.stream.ended, True
        self.stream.close()
        if self.sender is not None:
            self.sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.sender
        if not ended:  # the browser went first: end what the shell left running
            await asyncio.to_thread(gateway.exec_hang_up, self.login, self.exec_id, self.marker)

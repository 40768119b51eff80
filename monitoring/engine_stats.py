"""Docker's one-shot container stats, fetched by the hundred at once on asyncio.

The SDK's `stats()` is a blocking call and spends ~1.6 ms of CPU a call in `requests`; the
engine also holds each one-shot answer until its next collection tick (~1 s). So the
monitor asks for all of a host's containers at once over keep-alive HTTP/1.1 connections
(unix socket, or TCP with the host's client certificate) and parses the answers itself.
Container ids come from our database and are checked as hex before they reach a URL.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
from urllib.parse import urlsplit

CONTAINER_ID = re.compile(r"^[0-9a-f]{12,64}$")


class EngineDown(Exception):
    """The engine did not answer (refused, reset, timed out)."""


class Gone(Exception):
    """The container no longer exists on the engine."""


class EngineStats:
    """Keep-alive connections to one engine; `stats(id)` is one one-shot reading,
    `inspect(id)` the container's description."""

    def __init__(self, engine_url: str, *, tls: tuple[str, str, str] | None = None):
        parts = urlsplit(engine_url)
        self.unix = parts.path if parts.scheme == "unix" else None
        self.netloc = (parts.hostname, parts.port or (2376 if tls else 2375))
        self.ssl = None
        if tls:
            ca, cert, key = tls
            self.ssl = ssl.create_default_context(cafile=ca)
            self.ssl.load_cert_chain(cert, key)
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _open(self):
        if self.unix:
            return await asyncio.open_unix_connection(self.unix)
        return await asyncio.open_connection(*self.netloc, ssl=self.ssl)

    async def stats(self, container_id: str, *, timeout: float = 3.0) -> dict:
        return await self._json(
            container_id, f"/containers/{container_id}/stats?stream=false&one-shot=true", timeout
        )

    async def inspect(self, container_id: str, *, timeout: float = 3.0) -> dict:
        """The container's description (State.Pid, HostConfig.NetworkMode, ...)."""
        return await self._json(container_id, f"/containers/{container_id}/json", timeout)

    async def _json(self, container_id: str, path: str, timeout: float) -> dict:
        if not CONTAINER_ID.match(container_id):
            raise Gone(container_id)
        try:
            status, body = await asyncio.wait_for(self._get(path), timeout)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            raise EngineDown(str(exc) or exc.__class__.__name__) from exc
        if status == 404:
            raise Gone(container_id)
        if status != 200:
            raise EngineDown(f"HTTP {status}: {body[:200]!r}")
        return json.loads(body)

    async def _get(self, path: str) -> tuple[int, bytes]:
        reader, writer = self.idle.pop() if self.idle else await self._open()
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: docker\r\n\r\n".encode())
            await writer.drain()
            status_line = await reader.readline()
            if not status_line:
                raise ConnectionResetError("engine closed the connection")
            status = int(status_line.split()[1])
            headers = {}
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip().lower()
            if headers.get("transfer-encoding") == "chunked":
                chunks = []
                while True:
                    size = int((await reader.readline()).split(b";")[0], 16)
                    if size == 0:
                        await reader.readline()
                        break
                    chunks.append(await reader.readexactly(size))
                    await reader.readline()
                body = b"".join(chunks)
            else:
                body = await reader.readexactly(int(headers.get("content-length", "0")))
        except BaseException:
            writer.close()
            raise
        if headers.get("connection") == "close":
            writer.close()
        else:
            self.idle.append((reader, writer))
        return status, body

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()

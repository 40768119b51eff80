"""The proxy to the web apps of a node's workspace (jobs/access/webapps.py), for the cluster's
owner only, each app on an origin of its own (console/app_origin.py says where, why, and
how its owner is handed over):

    c<id>-n<n>-jupyter.<SUANLI_APPS_DOMAIN>      JupyterLab (base URL `/`)
    c<id>-n<n>-tensorboard.<SUANLI_APPS_DOMAIN>  TensorBoard
    c<id>-n<n>-service.<SUANLI_APPS_DOMAIN>      the researcher's own server

HTTP and websockets alike: console/asgi.py sends every request and websocket whose Host is
under the apps' domain here, before Django and the console's websockets, so that no
console URL (pages, /api/, /admin/, /login/, static files, /ws/) is ever served on an app
origin; and the console's origin proxies no app. Nothing listens on the GPU host for
this: each request or websocket is one exec of the gateway's relay (`nc 127.0.0.1 PORT`,
else python3, else bash; jobs/access/streams.py) in the workspace as the tenant's uid, bridged
to the event loop by the gateway's EngineStream (two threads per exec, TLS-safe, bounded
buffers both ways). The relay's target is always the workspace's loopback and the port is
the app's row's, checked again to be in webapps.PORTS: no URL, header or body chooses
where it goes.

Who gets what: the app origin's own cookie (app_origin.COOKIE, from the handover at
app_origin.ENTER, which is never forwarded) names a user and this one app; that user must
own the running cluster, or be a member of the team that owns it whose role may use it,
read again on every request and websocket (a removed member's next one is the plain 404;
an open websocket of theirs closes at once with 4403: console/revoked.Watch). Anyone else (another researcher, a browser without the cookie,
a cookie of another app) gets the plain 404, or a websocket closed with 4404 before
anything is forwarded; never a log-in redirect that would tell the cluster exists. The
owner gets a page in words (a link back to the cluster page on the console, SITE_URL)
when the workspace is not running, the app is not started, or it does not answer; a
websocket closes with 4503 or 4502 then.

What goes to the app: the request as it came, less the proxy's own cookie and the
console's (neither is the app's), its Authorization and CSRF header and the hop-by-hop
headers; plus X-Forwarded-For/-Host/-Proto, and for JupyterLab `Authorization: token ...`
(its token is the proxy's: the researcher never types it). The Host and Origin go on as
they came, so that an app's own same-origin check of its websockets holds (JupyterLab
runs with allow_remote_access for that; it listens on the loopback only). A request that
changes something (not GET, HEAD or OPTIONS) and every websocket must come from a page of
the app's own origin: its Origin header (or, for a request without one, its Referer)
names this very host, so that a page of another app (a sibling under the same domain,
another researcher's) cannot use the owner's cookie.

What comes back: the app's response, streamed, less hop-by-hop headers and
Access-Control-Allow-Credentials; its cookies lose any Domain (host-only: an app cannot
toss a cookie to its siblings), and one named like the proxy's own is dropped. A
service's redirects to its own loopback address are sent as paths of its origin.

Bounds: a request body of at most MAX_BODY bytes (a larger Content-Length is refused
before anything is forwarded, a longer stream is cut); a websocket message from the app
of at most MAX_MESSAGE bytes (those from the browser are uvicorn's --ws-max-size);
MAX_OPEN proxied requests and websockets at once per researcher in each web process.

Relays: an engine starts one exec at a time per container (some 50 ms each here), and
JupyterLab loads dozens of files at once, so a relay that carried a request without a
body is kept open for the next such request to the same app (HTTP/1.1 keep-alive, at most
POOL_PER_APP per app for POOL_IDLE_S; one the app closed meanwhile is replaced before
anything went back to the client). A request with a body goes over a relay of its own with
`Connection: close`. A relay that does not end by itself once its client went is hung up
(SIGHUP by its marker, as the gateway does), as Docker does not end an exec whose client
left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from urllib.parse import unquote_plus, urlsplit

import docker
import h11
import redis
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.contrib.messages.storage.cookie import CookieStorage
from django.http import Http404
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils.encoding import iri_to_uri
from django.utils.translation import gettext as _
from django.views.defaults import ERROR_PAGE_TEMPLATE
from websockets.client import ClientProtocol
from websockets.datastructures import Headers
from websockets.frames import Frame, Opcode
from websockets.http11 import Request, Response
from websockets.protocol import State
from websockets.uri import parse_uri

from console import app_origin, revoked
from console.preferences import ScopeLocale
from jobs.access import sessions, streams, webapps
from jobs.base import outage
from jobs.models import Cluster, WorkspaceApp
from jobs.nodes import engine, workspaces
from jobs.tenancy.actors import Actor, actor_on

log = logging.getLogger("suanli.proxy")

MARKER = "SUANLI_PROXY"  # env of each relay exec: its own value, for the hang-up
MAX_BODY = 512 * 2**20  # bytes of one request body (JupyterLab's own default bound)
MAX_MESSAGE = 64 * 2**20  # bytes of one websocket message from an app
MAX_OPEN = 100  # requests and websockets in flight per researcher, per web process
HIGH_WATER, LOW_WATER = 1 << 20, 1 << 18  # bytes from the app waiting for the client
HANDSHAKE_S = 30  # an app's answer to a websocket's opening
END_GRACE_S = 2  # a relay's own end after the response, before it is hung up
DB_THREADS = 4  # the proxy's own database threads: the owner check, its pages
POOL_PER_APP, POOL_IDLE_S = 6, 15  # relays kept open per app, and for how long (_Pool)
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
HOP_BY_HOP = {
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization",
    b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade", b"expect",
}  # fmt: skip
# Never passed on: credentials that are not the app's, the client's own forwarding claims
# (ours replace them).
NOT_FORWARDED = HOP_BY_HOP | {
    b"authorization", b"cookie", b"x-csrftoken", b"forwarded", b"x-forwarded-for",
    b"x-forwarded-host", b"x-forwarded-proto", b"x-forwarded-prefix", b"x-real-ip",
}  # fmt: skip
SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"x-frame-options", b"DENY"),
    (b"cache-control", b"no-store"),
]
NOT_FOUND = (
    ERROR_PAGE_TEMPLATE
    % {"title": "Not Found", "details": "The requested resource was not found on this server."}
).encode()
UNCHECKED = (
    ERROR_PAGE_TEMPLATE
    % {"title": "Service Unavailable", "details": "Sign-ins to apps cannot be checked now."}
).encode()
_ENGINE_ERRORS = (docker.errors.DockerException, engine.EngineError, OSError)
_ENDED = object()


def not_theirs() -> set[str]:
    """The names of the cookies that are not the app's: the proxy's own, and every one
    the console sets (none reaches an app origin; were one sent, it stays here)."""
    return app_origin.cookie_names() | {
        settings.SESSION_COOKIE_NAME,
        settings.CSRF_COOKIE_NAME,
        settings.LANGUAGE_COOKIE_NAME,
        CookieStorage.cookie_name,
    }


# -- where a request goes ------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    cluster_id: int
    index: int
    kind: str
    path: str  # the raw path as the client sent it, less the query

    @property
    def app(self) -> app_origin.App:
        return app_origin.App(self.cluster_id, self.index, self.kind)


def _host(scope) -> str:
    return dict(scope.get("headers", [])).get(b"host", b"").decode("latin-1")


def match(scope) -> Route | None:
    """The app a request's Host names (an app origin's), with its raw path."""
    app = app_origin.app_of(_host(scope))
    if app is None:
        return None
    raw = scope.get("raw_path") or scope.get("path", "").encode()
    return Route(app.cluster_id, app.index, app.kind, raw.decode("latin-1"))


def _cookie_values(scope) -> list[str]:
    """The values of the proxy's own cookie, every one sent (a sibling may toss another);
    over HTTPS only the `__Host-` one, which no other host can have set."""
    names = {app_origin.cookie_name(secure=_secure(scope))}
    values = []
    for name, value in scope.get("headers", []):
        if name != b"cookie":
            continue
        for part in value.decode("latin-1").split(";"):
            key, _sep, val = part.strip().partition("=")
            if key in names and val:
                values.append(val)
    return values


def _secure(scope) -> bool:
    return scope.get("scheme") in ("https", "wss")


def owner_of(scope, route: Route):
    """The user the app origin's cookie lets into this app, or None (database and Redis:
    run on the proxy's threads)."""
    return app_origin.session_user(_cookie_values(scope), route.app)


@dataclass
class Upstream:
    """The app a request of its owner reaches: a port of the workspace's loopback."""

    login: sessions.Login
    port: int
    token: str
    kind: str
    label: str
    back: str  # the cluster page, on the console
    actor: Actor | None = None  # who reaches it: the owner, or a member of its team


class Unavailable(Exception):
    """For the owner: why the app cannot be reached now, and where to go back to."""

    def __init__(self, status: int, words: str, back: str, code: int = 4503):
        super().__init__(words)
        self.status, self.words, self.back, self.code = status, words, back, code


def resolve(user, route: Route) -> Upstream:
    """The app, for whoever may use its cluster (database reads only, on every request and
    websocket: a member removed from the team is refused at their next one): its owner, or
    a member of the team that owns it whose role may use it (jobs.tenancy.actors.actor_on,
    Actor.may_use). Http404 for anyone else (a stranger, a removed member); a team's
    viewer is told in words that the role reads only (403); Unavailable in words when the
    workspace or the app is not there."""
    cluster = Cluster.objects.filter(pk=route.cluster_id).first()
    actor = actor_on(user, cluster) if cluster is not None else None
    if actor is None or not actor.sees(cluster):
        raise Http404("No such cluster.")
    back = settings.SITE_URL.rstrip("/") + reverse("cluster_detail", args=[cluster.pk])
    if not actor.may_use(cluster):
        raise Unavailable(
            403,
            _(
                "Suanli: your role in %(team)s is %(role)s, which reads only: it may not log "
                "in to cluster %(cluster)s. Ask the team's owner or an admin for the member role."
            )
            % {
                "team": actor.team.name,
                "role": actor.membership.get_role_display(),
                "cluster": cluster.name,
            },  # fmt: skip
            back,
            code=4403,
        )
    label, index = WorkspaceApp.Kind(route.kind).label, route.index
    try:
        node = workspaces.live_node(cluster, index)
    except workspaces.WorkspaceError as exc:
        raise Unavailable(
            503,
            _("%(app)s of node %(index)s cannot be reached: %(error)s.")
            % {"app": label, "index": index, "error": exc},
            back,
        ) from None
    app = webapps.started(cluster, index, route.kind)
    if app is None:
        raise Unavailable(
            503,
            _(
                "%(app)s is not started on node %(index)s of %(cluster)s. Start it from the "
                "cluster page."
            )
            % {"app": label, "index": index, "cluster": cluster.name},
            back,
        )
    if app.port not in webapps.PORTS:  # never a system port, whatever the row says
        raise Unavailable(
            403,
            _(
                "Port %(port)s is not one the console reaches (it reaches %(first)s to "
                "%(last)s). Start the %(app)s again from the cluster page."
            )
            % {
                "port": app.port,
                "first": webapps.PORTS.start,
                "last": webapps.PORTS.stop - 1,
                "app": label,
            },
            back,
        )
    login = sessions.Login(
        name=workspaces.login_name(cluster.pk, index), cluster=cluster, index=index,
        host=node.host, container_id=node.workspace_container, fingerprint="", key_data=b"",
        exec_base=workspaces.exec_kwargs(cluster, [], tty=False), person_id=user.pk,
    )  # fmt: skip
    return Upstream(
        login=login,
        port=app.port,
        token=app.token if route.kind == WorkspaceApp.Kind.JUPYTER else "",
        kind=route.kind,
        label=label,
        back=back,
        actor=actor,
    )


_db_pool = ThreadPoolExecutor(max_workers=DB_THREADS, thread_name_prefix="proxy-db")


async def _in_db(fn, *args):
    """`fn(*args)` on one of the proxy's database threads (old connections replaced
    around it, as channels does), never on the event loop."""
    call = database_sync_to_async(fn, thread_sensitive=False, executor=_db_pool)
    return await call(*args)


def close_db_connections() -> None:
    """Every database thread of the proxy drops its connections (a test's end)."""
    barrier = threading.Barrier(DB_THREADS)

    def close() -> None:
        outage.close_db_connections()
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=5)  # so that each call runs on a thread of its own

    wait([_db_pool.submit(close) for _ in range(DB_THREADS)])


_open: dict[int, int] = {}  # researcher -> proxied requests and websockets in flight


def _take(user_id: int) -> bool:
    """Count one more of the researcher's; False when they have MAX_OPEN already."""
    if _open.get(user_id, 0) >= MAX_OPEN:
        return False
    _open[user_id] = _open.get(user_id, 0) + 1
    return True


def _give_back(user_id: int) -> None:
    _open[user_id] -= 1
    if not _open[user_id]:
        del _open[user_id]


# -- headers -------------------------------------------------------------------------------


def _their_cookies(values: Iterable[bytes]) -> bytes:
    """The Cookie header less the cookies that are not the app's."""
    ours = {name.encode("latin-1") for name in not_theirs()}
    kept = []
    for value in values:
        for part in value.split(b";"):
            part = part.strip()
            if part and part.split(b"=", 1)[0].strip() not in ours:
                kept.append(part)
    return b"; ".join(kept)


def _connection_tokens(headers) -> set[bytes]:
    """Headers a Connection header names: hop-by-hop too."""
    named = set()
    for name, value in headers:
        if name.lower() == b"connection":
            named |= {token.strip().lower() for token in value.split(b",") if token.strip()}
    return named


def forwarded_headers(scope, upstream: Upstream) -> list[tuple[bytes, bytes]]:
    """What goes to the app with the request (see the module's docstring)."""
    headers = scope.get("headers", [])
    dropped = NOT_FORWARDED | _connection_tokens(headers)
    websocket = scope["type"] == "websocket"
    out, cookies, host = [], [], None
    for name, value in headers:
        if name == b"host":
            host = value
        if name == b"cookie":
            cookies.append(value)
        if name in dropped or (websocket and name.startswith(b"sec-websocket-")):
            continue
        out.append((name, value))
    kept = _their_cookies(cookies)
    if kept:
        out.append((b"cookie", kept))
    if upstream.token:
        out.append((b"authorization", b"token " + upstream.token.encode()))
    if host is None:
        out.append((b"host", f"127.0.0.1:{upstream.port}".encode()))
    scheme = {"ws": "http", "wss": "https"}.get(scope.get("scheme"), scope.get("scheme", "http"))
    client = (scope.get("client") or ["127.0.0.1"])[0]
    out += [
        (b"x-forwarded-for", str(client).encode("latin-1")),
        (b"x-forwarded-proto", scheme.encode()),
    ]
    if host is not None:
        out.append((b"x-forwarded-host", host))
    return out


def _their_set_cookie(value: bytes) -> bytes | None:
    """An app's cookie, host-only (its Domain dropped, so that it reaches no sibling app);
    None for one named like the proxy's own."""
    text = value.decode("latin-1")
    pair, *attributes = text.split(";")
    name = pair.split("=", 1)[0].strip()
    if name in app_origin.cookie_names() or not name:
        return None
    kept = [pair.strip()]
    for attribute in attributes:
        key = attribute.strip().partition("=")[0].strip().lower()
        if key != "domain" and attribute.strip():
            kept.append(attribute.strip())
    return "; ".join(kept).encode("latin-1")


def _their_location(value: bytes, upstream: Upstream) -> bytes:
    """A service's redirect to its own loopback address, as a path of its origin (its
    server knows nothing of the origin)."""
    parts = urlsplit(value.decode("latin-1"))
    own = {f"127.0.0.1:{upstream.port}", f"localhost:{upstream.port}"}
    if parts.scheme not in ("http", "https") or parts.netloc not in own:
        return value
    text = parts.path or "/"
    text += f"?{parts.query}" if parts.query else ""
    text += f"#{parts.fragment}" if parts.fragment else ""
    return text.encode("latin-1")


def response_headers(headers, upstream: Upstream) -> list:
    dropped = HOP_BY_HOP | {b"access-control-allow-credentials"} | _connection_tokens(headers)
    out = []
    for name, value in headers:
        name = name.lower()
        if name in dropped:
            continue
        if name == b"set-cookie":
            value = _their_set_cookie(value)
            if value is None:
                continue
        elif name == b"location" and upstream.kind == WorkspaceApp.Kind.SERVICE:
            value = _their_location(value, upstream)
        out.append((name, value))
    return out


def _same_origin(scope, *, websocket: bool = False) -> bool:
    """The request comes from a page of the app's own origin: its Origin (else, but not
    for a websocket, its Referer) names this very host."""
    headers = dict(scope.get("headers", []))
    host = headers.get(b"host", b"").decode("latin-1").lower()
    claimed = headers.get(b"origin") or (None if websocket else headers.get(b"referer"))
    if not claimed or not host:
        return False
    parts = urlsplit(claimed.decode("latin-1").lower())
    return parts.scheme in ("http", "https") and parts.netloc == host


def _target(scope) -> bytes:
    """The request target the app sees: the path and query as they came (each app is at
    the root of its origin)."""
    raw = scope.get("raw_path") or scope.get("path", "").encode()
    query = scope.get("query_string") or b""
    return raw + (b"?" + query if query else b"")


# -- the relay: one exec in the workspace, a byte pipe on the loop -------------------------


class RelayError(Exception):
    """The relay could not be started; the text is for the owner."""


class Relay:
    """`nc 127.0.0.1 PORT` (or the gateway's other relays) in the workspace, as the
    tenant. Bytes from the app queue here (the stream stops reading the engine while more
    than HIGH_WATER wait); `write` waits while the engine has not taken what was written."""

    def __init__(self, upstream: Upstream):
        self.upstream = upstream
        self.marker = f"{MARKER}={secrets.token_hex(12)}"
        self.exec_id = ""
        self.errors = b""
        self.queued = 0
        self.output: asyncio.Queue = asyncio.Queue()
        self.drained = asyncio.Event()
        self.drained.set()
        self.ended = asyncio.Event()
        self.closed = False
        self.stream = streams.EngineStream(
            asyncio.get_running_loop(), on_output=self._output, on_end=self._on_end,
            on_backlog=self._on_backlog, multiplexed=True,
        )  # fmt: skip

    async def open(self) -> None:
        login, index = self.upstream.login, self.upstream.login.index
        cmd = ["/bin/sh", "-c", streams.RELAY, "relay", str(self.upstream.port), streams.RELAY_PY]
        env = {MARKER: self.marker.partition("=")[2]}
        opening = asyncio.ensure_future(
            asyncio.to_thread(streams.exec_open, login, cmd, tty=False, env=env)
        )
        try:
            self.exec_id, hijacked = await asyncio.shield(opening)
        except asyncio.CancelledError:
            _tasks.add(opening)  # held until the engine answered, then cleaned up
            opening.add_done_callback(_tasks.discard)
            opening.add_done_callback(self._orphaned)
            raise
        except docker.errors.NotFound:
            raise RelayError(
                _("the workspace of node %(index)s is being made again") % {"index": index}
            ) from None
        except docker.errors.APIError as exc:
            if exc.status_code == 409:
                raise RelayError(
                    _("the workspace of node %(index)s is not running") % {"index": index}
                ) from None
            log.warning("%s: relay not started: %s", login.name, engine.describe(exc))
            raise RelayError(
                _("the host of node %(index)s does not answer") % {"index": index}
            ) from None
        except _ENGINE_ERRORS as exc:
            log.warning("%s: relay not started: %s", login.name, engine.describe(exc))
            raise RelayError(
                _("the host of node %(index)s does not answer") % {"index": index}
            ) from None
        self.stream.start(hijacked)
        if self.closed:
            self.stream.close()

    def _orphaned(self, opening: asyncio.Future) -> None:
        """Opened for a client that is gone (the server stopped it meanwhile)."""
        if opening.cancelled() or opening.exception() is not None:
            return
        self.exec_id, hijacked = opening.result()
        self.stream.start(hijacked)
        self.stream.close()
        _background(self._hang_up())

    # the engine's side, on the loop

    def _output(self, data: bytes, stderr: bool) -> None:
        if stderr:
            self.errors = (self.errors + data)[-500:]
            return
        self.queued += len(data)
        self.output.put_nowait(data)
        if self.queued > HIGH_WATER:
            self.stream.hold("client", True)

    def _on_backlog(self, full: bool) -> None:
        if full:
            self.drained.clear()
        else:
            self.drained.set()

    def _on_end(self) -> None:
        self.output.put_nowait(_ENDED)
        self.drained.set()
        self.ended.set()

    # the client's side

    def fresh(self) -> bool:
        """Open both ways, with nothing from the app waiting: may carry another request."""
        return not self.closed and not self.ended.is_set() and self.output.empty()

    async def read(self) -> bytes:
        """What the app sent next; b"" once the relay ended."""
        if self.closed and self.output.empty():
            return b""
        data = await self.output.get()
        if data is _ENDED:
            self.output.put_nowait(_ENDED)  # every later read sees the end too
            return b""
        self.queued -= len(data)
        if self.queued < LOW_WATER:
            self.stream.hold("client", False)
        return data

    async def write(self, data: bytes) -> None:
        if data and not self.closed:
            self.stream.write(data)
            if not self.drained.is_set():
                await self.drained.wait()

    def abort(self) -> None:
        """Stop both ways now (the client went, or sent too much); `close` cleans up."""
        if not self.closed:
            self.closed = True
            ended = self.stream.ended
            self.stream.close()
            self.output.put_nowait(_ENDED)
            self.drained.set()
            self._hang_up_later = not ended

    _hang_up_later = False

    async def close(self, grace: float = 0) -> None:
        """Let the relay end on its own for up to `grace` s (the app closed its side), then
        drop it; what it left running is hung up."""
        if grace and not self.ended.is_set() and not self.closed:
            self.stream.write_eof()  # the relay's stdin ends: it half-closes to the app
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ended.wait(), grace)
        self.abort()
        if self._hang_up_later:
            self._hang_up_later = False
            await self._hang_up()

    async def _hang_up(self) -> None:
        if self.exec_id:
            with contextlib.suppress(*_ENGINE_ERRORS):
                await asyncio.to_thread(
                    streams.exec_hang_up, self.upstream.login, self.exec_id, self.marker
                )

    def words(self) -> str:
        """Why the app did not answer, for its owner."""
        said = self.errors.decode(errors="replace")
        if "has no nc, python3 or bash" in said:
            return _(
                "the image has no nc, python3 or bash to reach port %(port)s with; the console "
                "needs one of them in the workspace"
            ) % {"port": self.upstream.port}
        return _("nothing answers on port %(port)s of node %(index)s's workspace") % {
            "port": self.upstream.port,
            "index": self.upstream.login.index,
        }


# -- HTTP ----------------------------------------------------------------------------------


async def _respond(send, status: int, body: bytes, headers=()) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/html; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                *SECURITY_HEADERS,
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _too_big() -> str:
    return _("The request's body is larger than the console passes on (%(most)s MiB).") % {
        "most": MAX_BODY // 2**20
    }


async def _page(send, status: int, words: str, back: str, title: str = "") -> None:
    """A page in words for the owner, with the way back to the cluster page."""
    body = await _in_db(
        render_to_string,
        "console/app_unavailable.html",
        {
            "title": title or _("This app cannot be reached"),
            "words": words,
            "back": back,
            "site": settings.SITE_URL.rstrip("/"),  # the page is on the app's origin
        },
    )
    await _respond(send, status, body.encode())


class _Pool:
    """Relays kept open between requests (HTTP/1.1 keep-alive to the app), per workspace
    container and port: a relay costs an exec, and an engine runs one exec at a time per
    container (some 50 ms each), while JupyterLab loads dozens of files at once. Only
    requests without a body go over a kept relay (one that went stale meanwhile is
    replaced before anything was sent back); at most POOL_PER_APP wait, POOL_IDLE_S each.
    Kept per event loop (a relay's queue and events belong to the loop that made it)."""

    def __init__(self):
        self.loops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _idle(self) -> dict[tuple, list[list]]:
        return self.loops.setdefault(asyncio.get_running_loop(), {})

    def take(self, key: tuple) -> tuple[Relay, h11.Connection] | None:
        idle = self._idle()
        waiting = idle.get(key, [])
        while waiting:
            relay, conn, timer = waiting.pop()
            timer.cancel()
            if relay.fresh():
                return relay, conn
            _background(relay.close(END_GRACE_S))
        idle.pop(key, None)
        return None

    def give(self, key: tuple, relay: Relay, conn: h11.Connection) -> None:
        waiting = self._idle().setdefault(key, [])
        if len(waiting) >= POOL_PER_APP or not relay.fresh():
            _background(relay.close(END_GRACE_S))
            return
        entry: list = [relay, conn, None]
        entry[2] = asyncio.get_running_loop().call_later(POOL_IDLE_S, self._expire, key, entry)
        waiting.append(entry)

    def _expire(self, key: tuple, entry: list) -> None:
        idle = self._idle()
        waiting = idle.get(key, [])
        if entry in waiting:
            waiting.remove(entry)
            _background(entry[0].close(END_GRACE_S))
        if not waiting:
            idle.pop(key, None)


_tasks: set[asyncio.Task] = set()


def _background(coro) -> None:
    """Run `coro` on the loop, held until it ends (the loop keeps only weak references)."""
    task = asyncio.ensure_future(coro)
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


_pool = _Pool()
KEPT, DONE, STALE = "kept", "done", "stale"  # how a request over a relay ended


class HttpProxy:
    """The ASGI app of every HTTP request to an app origin (console/asgi.py)."""

    async def __call__(self, scope, receive, send):
        route = match(scope)
        if route is None:  # the apps' domain itself, or a name that is no app's
            return await _respond(send, 404, NOT_FOUND)
        if settings.SECURE_SSL_REDIRECT and not _secure(scope):
            location = f"https://{_host(scope)}{_target(scope).decode('latin-1')}"
            return await _respond(send, 301, b"", [(b"location", location.encode("latin-1"))])
        if route.path.startswith(app_origin.RESERVED):  # the proxy's own: never the app's
            if route.path == app_origin.ENTER and scope["method"] == "GET":
                return await self._enter(scope, send, route)
            return await _respond(send, 404, NOT_FOUND)
        try:
            user = await _in_db(owner_of, scope, route)
        except redis.RedisError as exc:
            log.warning("%s: app session not checked: %s", route.app.label, exc)
            return await _respond(send, 503, UNCHECKED)
        if user is None:
            return await _respond(send, 404, NOT_FOUND)
        try:
            upstream = await _in_db(resolve, user, route)
        except Http404:
            return await _respond(send, 404, NOT_FOUND)
        except Unavailable as exc:
            return await _page(send, exc.status, exc.words, exc.back)
        method = scope["method"]
        if method == "CONNECT":
            return await _page(send, 405, _("CONNECT is not proxied."), upstream.back)
        if method not in SAFE_METHODS and not _same_origin(scope):
            return await _page(
                send, 403,
                _(
                    "This %(method)s to %(app)s did not come from a page of the app itself, so "
                    "it was not passed on."
                ) % {"method": method, "app": upstream.label},
                upstream.back,
            )  # fmt: skip
        incoming = dict(scope.get("headers", []))
        length = incoming.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY):
            return await _page(send, 413, _too_big(), upstream.back)
        if not _take(user.pk):
            return await _page(
                send, 503,
                _(
                    "You have %(most)s requests and websockets to your apps open, the most one "
                    "researcher may; close some (tabs, kernels) and reload."
                ) % {"most": MAX_OPEN},
                upstream.back,
            )  # fmt: skip
        try:
            await self._relay(scope, receive, send, route, upstream)
        finally:
            _give_back(user.pk)

    async def _relay(self, scope, receive, send, route: Route, upstream) -> None:
        """The admitted request to the app: over a kept relay where one is free (a safe
        method without a body), else over a new one."""
        incoming = dict(scope.get("headers", []))
        chunked = b"chunked" in incoming.get(b"transfer-encoding", b"").lower()
        has_body = chunked or int(incoming.get(b"content-length") or 0) > 0
        keep = scope["method"] in SAFE_METHODS and not has_body
        key = (upstream.login.host.pk, upstream.login.container_id, upstream.port)
        state = {"too_big": False, "done": False, "read_all": False}
        kept = _pool.take(key) if keep else None
        if kept is not None:
            relay, conn = kept
            outcome = await self._forward(scope, receive, send, route, upstream, relay,
                                          conn, keep=True, pooled=True, state=state)  # fmt: skip
            if outcome != STALE:
                return await self._done(key, relay, conn, outcome)
            await relay.close(END_GRACE_S)
        relay = Relay(upstream)
        try:
            await relay.open()
        except RelayError as exc:
            await relay.close()
            words = _("%(app)s cannot be reached: %(error)s.") % {
                "app": upstream.label, "error": exc,
            }  # fmt: skip
            return await _page(send, 503, words, upstream.back)
        conn = h11.Connection(our_role=h11.CLIENT)
        outcome = DONE
        try:
            outcome = await self._forward(scope, receive, send, route, upstream, relay,
                                          conn, keep=keep, pooled=False, state=state)  # fmt: skip
        finally:
            await self._done(key, relay, conn, outcome)

    @staticmethod
    async def _enter(scope, send, route: Route) -> None:
        """The handover: the console's ticket, taken once, for this app's own cookie; then
        on to `next`, a path of this app. Anything else is the plain 404."""
        query: dict[str, str] = {}
        for pair in (scope.get("query_string") or b"").decode("latin-1").split("&"):
            key, _sep, value = pair.partition("=")
            query.setdefault(unquote_plus(key), unquote_plus(value))
        try:
            session = await _in_db(app_origin.enter, query.get("ticket", ""), route.app)
        except redis.RedisError as exc:
            log.warning("%s: ticket not taken: %s", route.app.label, exc)
            return await _respond(send, 503, UNCHECKED)
        if session is None:
            return await _respond(send, 404, NOT_FOUND)
        secure = _secure(scope)
        cookie = (
            f"{app_origin.cookie_name(secure=secure)}={session}; Max-Age={app_origin.SESSION_S}"
            "; Path=/; HttpOnly; SameSite=Lax" + ("; Secure" if secure else "")
        )
        location = iri_to_uri(app_origin.safe_next(query.get("next")))
        await _respond(
            send, 302, b"",
            [(b"location", location.encode("ascii")), (b"set-cookie", cookie.encode())],
        )  # fmt: skip

    @staticmethod
    async def _done(key, relay: Relay, conn: h11.Connection, outcome: str) -> None:
        if outcome == KEPT:
            _pool.give(key, relay, conn)
        else:
            await relay.close(END_GRACE_S)

    async def _forward(
        self, scope, receive, send, route, upstream, relay, conn, *, keep, pooled, state
    ) -> str:
        """One request over the relay, its response to the client as it comes. KEPT when
        the relay may carry another; STALE when a kept relay's app had closed it (nothing
        was sent to the client: try a new one)."""
        headers = forwarded_headers(scope, upstream)
        incoming = dict(scope.get("headers", []))
        chunked = b"chunked" in incoming.get(b"transfer-encoding", b"").lower()
        has_body = chunked or int(incoming.get(b"content-length", b"0") or 0) > 0
        if chunked:  # framed again by us: one framing only
            headers = [(k, v) for k, v in headers if k != b"content-length"]
            headers.append((b"transfer-encoding", b"chunked"))
        if not keep:
            headers.append((b"connection", b"close"))
        try:
            target = _target(scope)
            head = conn.send(h11.Request(method=scope["method"], target=target, headers=headers))
        except h11.LocalProtocolError as exc:  # a header h11 will not send
            words = _("This request cannot be passed on: %(error)s.") % {"error": exc}
            await _page(send, 400, words, upstream.back)
            return DONE
        await relay.write(head)
        upload = asyncio.ensure_future(self._upload(receive, conn, relay, has_body, state))
        started, answered = False, False
        try:
            while True:
                try:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        data = await relay.read()
                        answered = answered or bool(data)
                        conn.receive_data(data)
                        continue
                except h11.RemoteProtocolError as exc:
                    if started or relay.closed:
                        log.info("%s: %s response cut: %s", upstream.login.name, route.kind, exc)
                    break
                if isinstance(event, h11.Response):
                    await send(
                        {
                            "type": "http.response.start",
                            "status": event.status_code,
                            "headers": response_headers(event.headers, upstream),
                        }
                    )
                    started = True
                elif isinstance(event, h11.Data):
                    await send({"type": "http.response.body", "body": bytes(event.data),
                                "more_body": True})  # fmt: skip
                elif isinstance(event, h11.EndOfMessage):
                    state["done"] = True  # the client's leaving now ends nothing
                    await send({"type": "http.response.body", "body": b""})
                    if keep and conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                        conn.start_next_cycle()
                        return KEPT
                    return DONE
                elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
                    break
                # an InformationalResponse (100 Continue): nothing for the client
        finally:
            upload.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await upload
        if started:
            # Cut short (the app's side ended, or the client left): not completed, so that
            # the server closes the connection rather than end a chunked body as if whole.
            return DONE
        if pooled and not answered and not relay.closed:
            return STALE
        return await self._unanswered(send, upstream, relay, state)

    @staticmethod
    async def _unanswered(send, upstream, relay: Relay, state: dict) -> str:
        """The page for a request the app gave no response to: its body was too big, or
        the app does not answer."""
        if state["too_big"]:
            await _page(send, 413, _too_big(), upstream.back)
        else:
            await _page(
                send, 502,
                _(
                    "%(app)s does not answer: %(why)s. If its process ended, start it again "
                    "from the cluster page."
                ) % {"app": upstream.label, "why": relay.words()},
                upstream.back,
            )  # fmt: skip
        return DONE

    async def _upload(self, receive, conn, relay: Relay, has_body: bool, state: dict) -> None:
        """The request's body to the app as it comes (bounded), then watch for the client
        leaving: that ends the relay, and so the response. (A request sent again over a
        new relay has no body: what was read is not read again.)"""
        size, more = 0, not state["read_all"]
        try:
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not state["done"]:
                        relay.abort()
                    return
                body, more = message.get("body", b""), message.get("more_body", False)
                size += len(body)
                if size > MAX_BODY:
                    state["too_big"] = True
                    relay.abort()
                    return
                if body and has_body:
                    await relay.write(conn.send(h11.Data(data=body)))
            state["read_all"] = True
            await relay.write(conn.send(h11.EndOfMessage()))
            while (await receive())["type"] != "http.disconnect":
                pass
            if not state["done"]:
                relay.abort()
        except h11.LocalProtocolError as exc:  # the body did not match its Content-Length
            log.info("%s: request body not passed on: %s", relay.upstream.login.name, exc)
            relay.abort()


def http_router(django_app):
    """HTTP by Host: an app origin's to the proxy only (its pages in the reader's
    language), every other to Django. No console URL is served on an app origin."""
    proxy = ScopeLocale(HttpProxy())

    async def route(scope, receive, send):
        if scope["type"] == "http" and app_origin.is_app_host(_host(scope)):
            return await proxy(scope, receive, send)
        return await django_app(scope, receive, send)

    return route


def websocket_router(console_sockets):
    """Websockets by Host: an app origin's to the app's own (AppSocket), every other to
    the console's (whose router refuses any Origin but the console's)."""
    apps = AppSocket.as_asgi()

    async def route(scope, receive, send):
        if app_origin.is_app_host(_host(scope)):
            return await apps(scope, receive, send)
        return await console_sockets(scope, receive, send)

    return route


# -- websockets ----------------------------------------------------------------------------

SENDABLE = {1000, 1001, 1002, 1003, *range(1007, 1012), *range(3000, 5000)}


class AppSocket(AsyncWebsocketConsumer):
    """A websocket of an app (JupyterLab's kernels and terminals, a service's own): opened
    to the app through a relay first, accepted with the subprotocol the app chose, then
    message for message both ways."""

    channel_layer_alias = None  # no groups: a Redis outage leaves open sockets alone

    relay: Relay | None = None
    protocol: ClientProtocol | None = None
    pump: asyncio.Task | None = None
    claimed: int | None = None  # the researcher whose open count this socket is in
    closing = False
    watch: revoked.Watch | None = None  # a team member's membership: 4403 once revoked

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:  # also when cancelled (the server stops): nothing is left behind
            await asyncio.shield(self._clean_up())

    async def connect(self):
        route = match(self.scope)
        if route is None or route.path.startswith(app_origin.RESERVED):
            await self.close(code=4404)
            return
        if not _same_origin(self.scope, websocket=True):  # a page of another origin
            await self.close(code=4403)
            return
        try:
            user = await _in_db(owner_of, self.scope, route)
        except redis.RedisError as exc:
            log.info("%s: app session not checked: %s", route.app.label, exc)
            user = None
        if user is None:
            await self.close(code=4404)
            return
        try:
            upstream = await _in_db(resolve, user, route)
        except Http404:
            await self.close(code=4404)  # another researcher's: nothing, not even a reason
            return
        except Unavailable as exc:
            await self.close(code=exc.code)
            return
        if not _take(user.pk):
            await self.close(code=4429)
            return
        self.claimed = user.pk
        self.relay = Relay(upstream)
        try:
            await self.relay.open()
        except RelayError as exc:
            log.info("%s: websocket to %s not opened: %s", upstream.login.name, route.kind, exc)
            await self.close(code=4503)
            return
        self.protocol = ClientProtocol(
            parse_uri(f"ws://127.0.0.1:{upstream.port}/"),
            subprotocols=self.scope.get("subprotocols") or None,
            max_size=MAX_MESSAGE,
        )
        offered = self.protocol.connect().headers
        headers = Headers()
        for name in ("Upgrade", "Connection", "Sec-WebSocket-Key", "Sec-WebSocket-Version",
                     "Sec-WebSocket-Protocol"):  # fmt: skip
            if name in offered:
                headers[name] = offered[name]
        for name, value in forwarded_headers(self.scope, upstream):
            headers[name.decode("latin-1")] = value.decode("latin-1")
        target = _target(self.scope).decode("latin-1")
        self.protocol.send_request(Request(target, headers))
        await self._flush()
        try:
            response, early = await asyncio.wait_for(self._handshake(), HANDSHAKE_S)
        except TimeoutError:
            response, early = None, []
        if response is None or self.protocol.handshake_exc is not None:
            said = f"HTTP {response.status_code}" if response is not None else "nothing"
            log.info("%s: %s websocket refused by the app: %s (%s)", upstream.login.name,
                     route.kind, said, self.relay.words())  # fmt: skip
            await self.close(code=4502)
            return
        await self.accept(subprotocol=self.protocol.subprotocol)
        self.pump = asyncio.ensure_future(self._from_app(early))
        self.watch = revoked.Watch(upstream.actor, upstream.login.cluster.owner_id, self._revoked)
        self.watch.start()

    async def _revoked(self) -> None:
        """The member was removed from the cluster's team: the socket closes at once."""
        if not self.closing:
            self.closing = True
            with contextlib.suppress(OSError, RuntimeError):
                await self.close(code=revoked.CLOSE_CODE)
            await asyncio.shield(self._clean_up())

    async def _handshake(self) -> tuple[Response | None, list]:
        """The app's answer to the opening, and any frames that came with it."""
        while True:
            data = await self.relay.read()
            if not data:
                self.protocol.receive_eof()
                return None, []
            self.protocol.receive_data(data)
            events = self.protocol.events_received()
            if events:
                return events[0], events[1:]

    async def _flush(self) -> None:
        for data in self.protocol.data_to_send():
            await self.relay.write(data)  # b"" (the end of our side): the relay's close

    async def _from_app(self, early: list) -> None:
        """The app's messages to the browser, in order, whole."""
        message: list[bytes] = []
        opcode = None
        code = 1011  # the app's side ended without a closing frame
        try:
            events = early
            while True:
                for frame in events:
                    if not isinstance(frame, Frame):
                        continue
                    if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
                        opcode, message = frame.opcode, [frame.data]
                    elif frame.opcode == Opcode.CONT:
                        message.append(frame.data)
                    else:
                        continue  # pings are answered by the protocol; a close ends below
                    if frame.fin:
                        data, message = b"".join(message), []
                        if opcode == Opcode.TEXT:
                            await self.send(text_data=data.decode())
                        else:
                            await self.send(bytes_data=data)
                if self.protocol.state is not State.OPEN:
                    closed = self.protocol.close_rcvd or self.protocol.close_sent
                    code = closed.code if closed is not None else 1011
                    break
                data = await self.relay.read()
                if not data:
                    self.protocol.receive_eof()
                    break
                self.protocol.receive_data(data)
                await self._flush()
                events = self.protocol.events_received()
        except UnicodeDecodeError:
            code = 1007
        except (OSError, RuntimeError):  # the browser went: disconnect() follows
            return
        if not self.closing:
            self.closing = True
            with contextlib.suppress(OSError, RuntimeError):
                await self.close(code=code if code in SENDABLE else 1000)

    async def receive(self, text_data=None, bytes_data=None):
        if self.protocol is None or self.protocol.state is not State.OPEN:
            return
        if bytes_data is not None:
            self.protocol.send_binary(bytes_data)
        else:
            self.protocol.send_text((text_data or "").encode())
        await self._flush()

    async def disconnect(self, code):
        self.closing = True
        if self.protocol is not None and self.protocol.state is State.OPEN:
            self.protocol.send_close(code if code in SENDABLE else 1000)
            with contextlib.suppress(Exception):
                await self._flush()
        await asyncio.shield(self._clean_up())

    async def _clean_up(self) -> None:
        if self.watch is not None:
            watch, self.watch = self.watch, None
            await watch.stop()
        if self.pump is not None:
            self.pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.pump
            self.pump = None
        if self.relay is not None:
            relay, self.relay = self.relay, None
            try:
                await relay.close(END_GRACE_S)
            except Exception:
                log.exception("%s: closing an app's websocket failed", relay.upstream.login.name)
        if self.claimed is not None:
            claimed, self.claimed = self.claimed, None
            _give_back(claimed)

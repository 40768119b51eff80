"""The workspace apps' own origins: where each app lives, and how its owner gets in.

Every app of a node's workspace (jobs/access/webapps.py: JupyterLab, TensorBoard, the service
port) is served by console/proxy.py on an origin of its own,

    <scheme>://c<cluster>-n<node>-<kind>.<SUANLI_APPS_DOMAIN>[:port]/

never on the console's origin: what a researcher's container serves is written by
whatever runs there (a poisoned notebook, a dependency), and a page on the console's
origin could read and change anything of its owner's (API tokens, SSH keys, clusters,
terminals). SUANLI_APPS_DOMAIN is a registrable domain apart from the console's (as
googleusercontent.com is Google's), so that the console's cookies, host-only and
`__Host-` prefixed where HTTPS is on, are neither sent to nor set by an app origin, and
an app's page is cross-site to the console (SameSite=Lax keeps the session off its
requests, CORS keeps the answers from it, the console's websockets refuse its Origin).
The scheme is the console's; the port the console's unless SUANLI_APPS_PORT names one.

Handing the owner over, since no console cookie reaches an app origin:

1. The tile links to the console's `app_open` view (logged in, the cluster's owner only;
   others get its 404). It makes a ticket, bound to (user, cluster, node, kind), signed
   (django.core.signing, TICKET_S old at most) and single-use (its nonce is a Redis key
   that the exchange deletes atomically, GETDEL), and redirects to the app origin's
   ENTER path with it and `next` (a path on that app only).
2. The app origin's ENTER (never forwarded to the app) takes the ticket once, for its own
   host only, and answers with its own cookie (host-only: no Domain; Path=/, HttpOnly,
   SameSite=Lax, Secure and `__Host-` prefixed over HTTPS) holding an opaque session id,
   then redirects to `next`.
3. Each request and websocket of that origin reads the cookie: the session (a Redis key
   named by the id's SHA-256, SESSION_S long) names its user and its one app, and holds
   the user's session auth hash (a changed password ends it); the proxy then checks that
   the user owns the running cluster or, on a team's, is a member whose role may use it
   (on every request: a cookie given to a member lets no one in once they are removed). Anything else is the plain 404. Logging out of the
   console ends every app session of that user (`user_logged_out`); a released cluster's
   apps answer no one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import secrets
from dataclasses import dataclass
from urllib.parse import urlencode, urlsplit

import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.signals import user_logged_out
from django.core import signing
from django.dispatch import receiver
from django.http.request import split_domain_port

log = logging.getLogger("suanli.apps")

ENTER = "/__suanli/enter"  # the app origin's handover path
RESERVED = "/__suanli/"  # the proxy's own paths on an app origin, never the app's
TICKET_S = 60  # how long a ticket may wait for its exchange
SESSION_S = 12 * 3600  # how long an app's own cookie lets its owner in
HOST = re.compile(
    r"c(?P<cluster_id>[1-9][0-9]{0,17})-n(?P<index>[0-9]{1,3})-(?P<kind>jupyter|tensorboard|service)"
)
COOKIE = "suanli-app"
_SALT = "suanli.app-origin.ticket"
_TICKET_KEY = "suanli:app-ticket:"
_SESSION_KEY = "suanli:app-session:"
_USER_KEY = "suanli:app-sessions:"


@dataclass(frozen=True)
class App:
    """One app of one node: what a ticket, a session and an app origin's host name."""

    cluster_id: int
    index: int
    kind: str

    @property
    def label(self) -> str:
        return f"c{self.cluster_id}-n{self.index}-{self.kind}"


# -- names ---------------------------------------------------------------------------------


def domain() -> str:
    return settings.SUANLI_APPS_DOMAIN.strip().strip(".").lower()


def app_host(cluster_id: int, index: int, kind: str) -> str:
    """`c12-n0-jupyter.apps.example.net`."""
    return f"{App(cluster_id, index, kind).label}.{domain()}"


def host_name(host: str) -> str:
    """A Host header's name, lower case, without its port or a trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):  # an IPv6 literal: never an app's
        return host.split("]", 1)[0] + "]"
    if ":" in host:
        host, port = host.rsplit(":", 1)
        if not (port.isascii() and port.isdigit()):
            return ""  # `app.example:443@elsewhere`: no host at all (a redirect reuses it)
    if not re.fullmatch(r"[a-z0-9.-]+", host):
        return ""
    return host.rstrip(".")


def is_app_host(host: str) -> bool:
    """The Host is the apps' domain or under it: the app proxy's only, never Django's."""
    name, apps = host_name(host), domain()
    return bool(apps) and (name == apps or name.endswith("." + apps))


def app_of(host: str) -> App | None:
    """The app an app origin's Host names; None for any other name."""
    name, apps = host_name(host), domain()
    if not name.endswith("." + apps):
        return None
    found = HOST.fullmatch(name[: -len(apps) - 1])
    if found is None:
        return None
    return App(int(found["cluster_id"]), int(found["index"]), found["kind"])


def origin_for(request, app: App) -> str:
    """The app's origin as the console's reader reaches it: the console's scheme, and its
    port unless SUANLI_APPS_PORT says otherwise."""
    scheme = "https" if request.is_secure() else "http"
    default = {"http": "80", "https": "443"}[scheme]
    seen = split_domain_port(request.get_host())[1]  # the port the reader's browser used
    port = str(settings.SUANLI_APPS_PORT or seen or default)
    netloc = app_host(app.cluster_id, app.index, app.kind)
    return f"{scheme}://{netloc}" + ("" if port == default else f":{port}")


def safe_next(value: str | None) -> str:
    """`next` as a path of the app itself: `/` for anything that would leave it (another
    host, a scheme, `//host`, a backslash, control characters) or enter the proxy's own."""
    text = (value or "").strip()
    if (
        not text.startswith("/")
        or text.startswith("//")
        or "\\" in text
        or any(ord(ch) < 32 or ord(ch) == 127 for ch in text)
    ):
        return "/"
    parts = urlsplit(text)
    if parts.scheme or parts.netloc or parts.path.startswith(RESERVED):
        return "/"
    return text


def enter_url(request, app: App, next_path: str, ticket: str) -> str:
    query = urlencode({"ticket": ticket, "next": safe_next(next_path)})
    return f"{origin_for(request, app)}{ENTER}?{query}"


def cookie_name(*, secure: bool) -> str:
    """Over HTTPS `__Host-` prefixed: no other host (a sibling app) can set or replace it."""
    return f"__Host-{COOKIE}" if secure else COOKIE


def cookie_names() -> set[str]:
    return {cookie_name(secure=True), cookie_name(secure=False)}


# -- Redis ---------------------------------------------------------------------------------


@functools.cache
def _redis(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)


def _conn() -> redis.Redis:
    return _redis(settings.REDIS_URL)


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


# -- tickets (the console's side makes them, the app origin takes them) --------------------


def ticket_make(*, user, app: App) -> str:
    """A signed ticket for `user` into `app`, good once within TICKET_S."""
    nonce = secrets.token_urlsafe(18)
    _conn().set(_TICKET_KEY + _digest(nonce), "1", ex=TICKET_S + 5, nx=True)
    payload = {"u": user.pk, "a": app.label, "n": nonce}
    return signing.dumps(payload, salt=_SALT, compress=True)


def ticket_take(ticket: str, app: App) -> int | None:
    """The user a ticket was made for, once: None when it is forged, older than TICKET_S,
    for another app, or taken before (its nonce deleted atomically with the read)."""
    try:
        payload = signing.loads(ticket, salt=_SALT, max_age=TICKET_S)
    except signing.BadSignature:  # SignatureExpired is one too
        return None
    if not isinstance(payload, dict) or payload.get("a") != app.label:
        return None
    nonce, user_id = payload.get("n"), payload.get("u")
    if not isinstance(nonce, str) or not isinstance(user_id, int):
        return None
    if _conn().getdel(_TICKET_KEY + _digest(nonce)) is None:
        return None
    return user_id


# -- app sessions (the app origin's own cookie) ---------------------------------------------


def _active_user(user_id: int):
    return get_user_model().objects.filter(pk=user_id, is_active=True).first()


def enter(ticket: str, app: App) -> str | None:
    """The exchange: a new app session's cookie value for the ticket's user, or None."""
    user_id = ticket_take(ticket, app)
    user = _active_user(user_id) if user_id is not None else None
    if user is None:
        return None
    session = secrets.token_urlsafe(32)
    key = _SESSION_KEY + _digest(session)
    value = json.dumps({"u": user.pk, "a": app.label, "h": user.get_session_auth_hash()})
    pipe = _conn().pipeline()
    pipe.set(key, value, ex=SESSION_S)
    pipe.sadd(_USER_KEY + str(user.pk), key)
    pipe.expire(_USER_KEY + str(user.pk), SESSION_S)
    pipe.execute()
    return session


def session_user(values: list[str], app: App):
    """The user one of the cookie's values (a sibling may have tossed in others) lets into
    `app`; None for none (no session, another app's, a changed password, a logged-out or
    inactive user)."""
    for value in values[:8]:
        if not value or len(value) > 100:
            continue
        raw = _conn().get(_SESSION_KEY + _digest(value))
        if raw is None:
            continue
        session = json.loads(raw)
        if session.get("a") != app.label:
            continue
        user = _active_user(session.get("u"))
        if user is not None and secrets.compare_digest(
            session.get("h", ""), user.get_session_auth_hash()
        ):
            return user
    return None


def sessions_end(user_id: int) -> None:
    """Every app session of the user ends (they logged out of the console)."""
    conn = _conn()
    keys = conn.smembers(_USER_KEY + str(user_id))
    if keys:
        conn.delete(*keys)
    conn.delete(_USER_KEY + str(user_id))


@receiver(user_logged_out)
def _logged_out(sender, request, user, **kwargs) -> None:
    if user is None:
        return
    try:
        sessions_end(user.pk)
    except redis.RedisError as exc:  # the log-out itself goes on; the sessions expire
        log.warning("app sessions of user %s not ended: %s", user.pk, exc)

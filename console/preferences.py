"""The language and time zone of each request.

Django's LocaleMiddleware reads the language cookie and `Accept-Language`; `UserLocale`,
after authentication, puts a signed-in person's saved choice above both, gives them their
time zone, and serves the API in English whatever the request asks (field names, codes and
messages that scripts read stay one language).

A person who never chose a time zone sees the usual one of their language: Beijing time
(Asia/Shanghai) in Chinese, `settings.TIME_ZONE` (UTC by default) in English."""

from __future__ import annotations

import zoneinfo
from functools import cache

from channels.db import database_sync_to_async
from django.conf import settings
from django.utils import timezone, translation
from django.utils.translation import trans_real

from console.models import Preferences

API_PREFIXES = ("/api/v1/",)  # the JSON API and its docs; /api/tokens/ is a page
SESSION_KEY = "_suanli_prefs"  # [language, zone]: read once per sign-in, not per request
CHINESE_ZONES = ("Asia/Shanghai", "Asia/Hong_Kong", "Asia/Taipei", "Asia/Singapore")


@cache
def zones() -> tuple[str, ...]:
    """Every zone this machine knows, by name."""
    return tuple(sorted(zoneinfo.available_timezones()))


def zone_choices(language: str) -> list[str]:
    """The zones a form offers: the language's own first (Beijing time for Chinese)."""
    first = CHINESE_ZONES + ("UTC",) if language.startswith("zh") else ("UTC",) + CHINESE_ZONES
    known = set(zones())
    first = tuple(z for z in first if z in known or z == "UTC")
    return list(first) + [z for z in zones() if z not in first]


def default_zone(language: str) -> str:
    return "Asia/Shanghai" if language.startswith("zh") else settings.TIME_ZONE


def languages() -> set[str]:
    return {code for code, _ in settings.LANGUAGES}


def of(user) -> Preferences | None:
    if not getattr(user, "is_authenticated", False):
        return None
    return Preferences.objects.filter(user=user).first()


def save(request, **fields) -> Preferences:
    prefs, _ = Preferences.objects.update_or_create(user=request.user, defaults=fields)
    remember(request.session, prefs)
    return prefs


def remember(session, prefs: Preferences | None) -> None:
    session[SESSION_KEY] = [prefs.language, prefs.time_zone] if prefs else ["", ""]


def on_login(sender, request, user, **kwargs) -> None:
    """`user_logged_in`: the person's choices into their new session (console/apps.py)."""
    if request is not None and hasattr(request, "session"):
        remember(request.session, of(user))


def _chosen(request) -> tuple[str, str]:
    session = getattr(request, "session", None)
    if session is None or not request.user.is_authenticated:
        return "", ""
    if SESSION_KEY not in session:  # a session from before preferences existed
        remember(session, of(request.user))
    language, zone = session[SESSION_KEY]
    return language, zone


class UserLocale:
    """After AuthenticationMiddleware: the person's language and zone for this request."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.path.startswith(API_PREFIXES):
            language, zone = "en", "UTC"
        else:
            chosen_language, chosen_zone = _chosen(request)
            language = chosen_language or translation.get_language() or "en"
            if language not in languages():
                language = settings.LANGUAGE_CODE
            zone = chosen_zone or default_zone(language)
        translation.activate(language)
        request.LANGUAGE_CODE = translation.get_language()
        try:
            timezone.activate(zoneinfo.ZoneInfo(zone))
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            timezone.activate(zoneinfo.ZoneInfo("UTC"))
        try:
            return self.get_response(request)
        finally:
            timezone.deactivate()


def _socket_language(scope) -> str:
    """A websocket's language (the terminal's notices): the person's choice kept in their
    session, else the cookie, else Accept-Language, as for a page."""
    session = scope.get("session")
    chosen = (session.get(SESSION_KEY) or ["", ""])[0] if session is not None else ""
    if chosen in languages():
        return chosen
    cookie = scope.get("cookies", {}).get(settings.LANGUAGE_COOKIE_NAME)
    if cookie in languages():
        return cookie
    accept = dict(scope.get("headers") or []).get(b"accept-language", b"").decode("latin-1")
    for code, _ in trans_real.parse_accept_lang_header(accept):
        if code == "*":
            break
        try:
            return translation.get_supported_language_variant(code)
        except LookupError:
            continue
    return settings.LANGUAGE_CODE


class SocketLocale:
    """ASGI middleware, inside AuthMiddlewareStack (it needs the session): the websocket's
    consumer runs in its reader's language."""

    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        language = await database_sync_to_async(_socket_language)(scope)
        with translation.override(language):
            return await self.inner(scope, receive, send)

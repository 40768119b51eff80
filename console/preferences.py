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


def save(user, **fields) -> Preferences:
    prefs, _ = Preferences.objects.update_or_create(user=user, defaults=fields)
    return prefs


def chosen(user) -> tuple[str, str]:
    """(language, zone) the person chose, "" for "not chosen". Read on every request (one
    lookup by key): a choice made in another browser, or by an operator, holds at once."""
    prefs = of(user)
    return (prefs.language, prefs.time_zone) if prefs else ("", "")


class UserLocale:
    """After AuthenticationMiddleware: the person's language and zone for this request."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        if request.path.startswith(API_PREFIXES):
            language, zone = "en", "UTC"
        else:
            chosen_language, chosen_zone = chosen(request.user)
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
            response = self.get_response(request)
            response.headers["Content-Language"] = request.LANGUAGE_CODE
            return response
        finally:  # nothing of this person's stays on the thread for the next request
            timezone.deactivate()
            translation.deactivate()


def _scope_language(scope) -> str:
    """The language of what Django's middleware never sees (websockets: the terminal's
    notices; the workspace apps' proxy pages): the person's choice, else the cookie, else
    Accept-Language, as for a page."""
    user = scope.get("user")
    choice = chosen(user)[0] if user is not None else ""
    if choice in languages():
        return choice
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


class ScopeLocale:
    """ASGI middleware, inside AuthMiddlewareStack (it needs the user and the cookies): the
    consumer (a websocket, the apps' proxy) runs in its reader's language."""

    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        language = await database_sync_to_async(_scope_language)(scope)
        with translation.override(language):
            return await self.inner(scope, receive, send)

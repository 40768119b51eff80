"""Log-in throttling (django-axes): failed passwords on /login/ and /admin/login/ and
failed API tokens count against the client's address; at `AXES_FAILURE_LIMIT` failures
within the cool-off (`AXES_COOLOFF_MINUTES`) the address is locked: even the right
password or a valid token is refused until the cool-off has passed since the last failure,
or an operator deletes its "access attempt" in the admin (Axes -> Access attempts).

Axes records password failures through Django's `user_login_failed` signal, which
`authenticate()` sends; the API sends the same signal for a token it does not know.
"""

from __future__ import annotations

import ipaddress
import json
import math

from axes.handlers.proxy import AxesProxyHandler
from axes.helpers import get_cool_off
from django.conf import settings
from django.contrib import admin
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth import REDIRECT_FIELD_NAME
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.signals import user_login_failed
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from jobs.base import addresses
from jobs.tenancy.actors import is_team_principal

# What axes records as the "username" of a failed API token: none (the token is never kept).
_TOKEN_CREDENTIALS = {"username": None}


def client_ip(request: HttpRequest) -> str | None:
    """The client's address: the connection's peer, REMOTE_ADDR. X-Forwarded-For is never
    read here: the Procfile's uvicorn has already put the client's address there when the
    peer is one of SUANLI_TRUSTED_PROXIES (the rightmost entry no trusted proxy wrote), and
    left the peer otherwise, so a client rotating that header stays one address."""
    remote = request.META.get("REMOTE_ADDR")
    try:
        ipaddress.ip_address(remote or "")
    except ValueError:
        return None
    return addresses.guesser(remote)  # an IPv6 client counted by its /64


def attempt_username(request: HttpRequest, credentials: dict | None = None) -> str | None:
    """AXES_USERNAME_CALLABLE: the typed username as axes records it, cut to its column's
    255 characters. Django's login form does not bound what it authenticates, and a longer
    name made the failure's write fail: a 500 instead of the form's error, uncounted."""
    source = credentials if credentials else getattr(request, "data", request.POST)
    name = source.get(getattr(settings, "AXES_USERNAME_FORM_FIELD", "username"))
    return name[:255] if isinstance(name, str) else name


def cool_off_s(request: HttpRequest) -> int:
    cool_off = get_cool_off(request)
    return int(cool_off.total_seconds()) if cool_off else 0


def lockout_message(request: HttpRequest) -> str:
    minutes = max(1, math.ceil(cool_off_s(request) / 60))
    return ngettext(
        "Too many failed log-ins from your address: logging in is locked for now. "
        "Try again in %(minutes)s minute or ask an operator to unlock it.",
        "Too many failed log-ins from your address: logging in is locked for now. "
        "Try again in %(minutes)s minutes or ask an operator to unlock it.",
        minutes,
    ) % {"minutes": minutes}


def _locked_form(base, request: HttpRequest, message: str):
    """The page's own login form, bound to the typed username, whose only error is the
    lock (it never authenticates: that would count one more failure)."""

    class LockedOut(base):
        def clean(self):
            raise ValidationError(message, code="locked_out")

    form = LockedOut(request, data={"username": request.POST.get("username", ""), "password": "-"})
    form.is_valid()
    return form


def lockout_response(request: HttpRequest, *args, **kwargs) -> HttpResponse:
    """AXES_LOCKOUT_CALLABLE: the login page again, with the lock as its error (429)."""
    message = lockout_message(request)
    if request.path.startswith("/api/"):
        return token_locked_response(request)
    if request.path.startswith("/hosts/join/"):
        return join_locked_response(request)
    next_url = request.POST.get(REDIRECT_FIELD_NAME) or request.GET.get(REDIRECT_FIELD_NAME, "")
    if request.path.startswith(reverse("admin:login")):
        context = {
            **admin.site.each_context(request),
            "title": _("Log in"),
            "subtitle": None,
            "app_path": request.get_full_path(),
            "username": request.user.get_username(),
            "form": _locked_form(AdminAuthenticationForm, request, message),
            REDIRECT_FIELD_NAME: next_url or reverse("admin:index"),
        }
        return render(request, "admin/login.html", context, status=429)
    context = {"form": _locked_form(AuthenticationForm, request, message), "next": next_url}
    return render(request, "registration/login.html", context, status=429)


def token_locked_response(request: HttpRequest) -> JsonResponse:
    wait = cool_off_s(request)
    response = JsonResponse(
        {
            "error": "Too many failed API tokens or log-ins from your address: it is locked "
            f"for {max(1, math.ceil(wait / 60))} minutes. Check the token you send, or ask an "
            "operator to unlock it.",
            "fields": {},
        },
        status=429,
    )
    response["Retry-After"] = str(wait)
    return response


def join_locked_response(request: HttpRequest) -> HttpResponse:
    """The lock, to join.sh (console/views_hosts.py): a flat JSON object, one key a line."""
    wait = cool_off_s(request)
    message = (
        "Too many refused join tokens, API tokens or log-ins from this address: it is locked "
        f"for {max(1, math.ceil(wait / 60))} minutes. Check the token, or ask an operator to "
        "unlock it (admin: Axes -> Access attempts)."
    )
    response = HttpResponse(
        json.dumps({"error": message}, indent=0) + "\n", status=429, content_type="application/json"
    )
    response["Retry-After"] = str(wait)
    return response


def token_locked(request: HttpRequest) -> bool:
    """Whether the client's address is locked (checked before any token is looked up)."""
    return settings.AXES_ENABLED and AxesProxyHandler.is_locked(request, _TOKEN_CREDENTIALS)


def token_failed(request: HttpRequest) -> bool:
    """Count a token that did not authenticate; True when that locked the address."""
    user_login_failed.send(sender=__name__, credentials=_TOKEN_CREDENTIALS, request=request)
    return bool(getattr(request, "axes_locked_out", False))


class PeopleBackend(ModelBackend):
    """Django's password log-in, for people only: a team's principal (the account a team
    owns things as) never logs in nor keeps a session, whatever password or flag an
    operator gives it in the admin (jobs.tenancy.actors.is_team_principal)."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is not None and is_team_principal(user):
            return None  # checked at log-in only: no session is ever made for one
        return user

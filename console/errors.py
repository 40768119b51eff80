"""What a failed request shows, and to whom.

- A body Django refuses before any view runs (over DATA_UPLOAD_MAX_MEMORY_SIZE, or more
  fields or files than it takes) is answered 413/400 with a sentence (`bad_request`,
  urls.handler400); the API answers the same in its own JSON shape (console/api.py).
- Django's error reports (the DEBUG technical page, the admins' e-mails and the logged
  reports) show settings, the request and each frame's variables. `CredentialsFilter`
  (DEFAULT_EXCEPTION_REPORTER_FILTER) masks, besides Django's own list of secret-looking
  names, the password of every URL written scheme://user:password@host: REDIS_URL, the
  Redis hosts of CACHES, CHANNEL_LAYERS and RQ_QUEUES, DATABASE_URL and whatever else
  carries one, wherever it sits.
"""

from __future__ import annotations

import re

from django.conf import settings
from django.core.exceptions import RequestDataTooBig, TooManyFieldsSent, TooManyFilesSent
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.translation import gettext as _
from django.views import defaults
from django.views.debug import SafeExceptionReporterFilter

MASK = SafeExceptionReporterFilter.cleansed_substitute

# scheme://[user]:password@ — the password is everything after the first ':' of the
# userinfo up to the last '@' before the host (a password may itself hold '@' or ':').
_CREDENTIALS = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^\s/]*(?=@)")


_QUERY_PASSWORD = re.compile(r"(?P<head>[?&](?:password|passwd|pass|token)=)[^&#\s]*", re.I)


def without_credentials(text: str) -> str:
    """`redis://:s3cret@host:6389/0` -> `redis://:********************@host:6389/0`, and
    a password given as a query value (`redis://host/0?password=s3cret`) likewise."""
    text = _CREDENTIALS.sub(lambda m: m.group("head") + MASK, text)
    return _QUERY_PASSWORD.sub(lambda m: m.group("head") + MASK, text)


def _masked(value):
    if isinstance(value, str):  # lazy strings too: masked as their text, else left as they are
        text = str(value)
        masked = without_credentials(text)
        return masked if masked != text else value
    if isinstance(value, dict):
        return {k: _masked(v) for k, v in value.items()}
    if hasattr(value, "geturl"):  # urlsplit()/urlparse() results: their netloc holds it
        return without_credentials(value.geturl())
    if type(value) in (list, tuple):
        return type(value)(_masked(v) for v in value)
    if isinstance(value, list | tuple):  # named tuples and the like: as a plain tuple
        return tuple(_masked(v) for v in value)
    return value


class CredentialsFilter(SafeExceptionReporterFilter):
    """Django's filter, and no URL's password in any setting, META entry or frame."""

    def cleanse_setting(self, key, value):
        return _masked(super().cleanse_setting(key, value))

    def get_traceback_frame_variables(self, request, tb_frame):
        return [
            (name, _masked(value) if isinstance(value, str | dict | list | tuple) else value)
            for name, value in super().get_traceback_frame_variables(request, tb_frame)
        ]


def too_big_words() -> str:
    size = settings.DATA_UPLOAD_MAX_MEMORY_SIZE / 2**20
    return _("The request body is larger than the %(size)s MB this console takes.") % {
        "size": f"{size:g}"
    }


def bad_request(request: HttpRequest, exception=None) -> HttpResponse:
    """handler400: a body Django refused before the view, said in a sentence."""
    if isinstance(exception, RequestDataTooBig):
        status, words = 413, too_big_words()
    elif isinstance(exception, TooManyFieldsSent | TooManyFilesSent):
        status, words = 400, _("The form sent more fields or files than this console takes.")
    else:
        return defaults.bad_request(request, exception)
    context = {"title": _("Request refused"), "words": words}
    return render(request, "console/request_refused.html", context, status=status)

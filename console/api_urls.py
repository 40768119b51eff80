"""The token JSON API under /api/v1/ (console/api.py, django-ninja)."""

import functools

from django.urls import include, path, re_path
from django.views.decorators.csrf import csrf_exempt

from console import api, api_teams


def _json_405(view):
    """django-ninja answers a method a path does not take in plain text; scripts get the
    API's JSON error with the methods it takes."""

    @functools.wraps(view)
    def handler(request, *args, **kwargs):
        response = view(request, *args, **kwargs)
        if response.status_code == 405 and response.get("Content-Type", "").startswith("text/"):
            allowed = response["Allow"].split(", ")
            allowed = [m for m in ("GET", "POST", "PUT", "PATCH", "DELETE") if m in allowed]
            out = api._error(405, f"Use {' or '.join(allowed)}.", Allow=", ".join(allowed))
            return out
        return response

    return handler


api.api.add_router("/teams", api_teams.router)
_patterns, _app, _namespace = api.api.urls
for _pattern in _patterns:
    if _pattern.name == "api-root":  # django-ninja's is an HTML 404; scripts get JSON
        _pattern.callback = csrf_exempt(api.not_found)
    else:
        _pattern.callback = _json_405(_pattern.callback)

urlpatterns = [
    path("", include((_patterns, _app), namespace=_namespace)),
    re_path(r"^.*$", csrf_exempt(api.not_found)),  # a JSON 404, not the HTML page, for scripts
]

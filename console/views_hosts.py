"""Adding a host with one command (*Hosts -> Add*) and the endpoints join.sh talks to.

- `ops_host_add`: an operator holding `jobs.add_host` makes a join token and reads the
  command that uses it (403 to staff without the permission, the admin's log-in to others).
  An address behind NAT that is a host's or the control plane's needs `jobs.change_host`
  too (joins.token_refusal): the form says so.
- `join_script`, `firewall_script`: the scripts, public: they hold no secret. The served
  join.sh knows the console's URL (SUANLI_JOIN_URL, else the URL the request came to).
- `join_api`, `join_image`: JSON for token and credential holders only, whatever session
  cookie comes along (no CSRF token: no cookie is read). The security model is
  jobs/hosts/joins.py's; here: an address locked by django-axes (too many refused tokens, the
  same count as API tokens and passwords) is refused before any token is looked at; each
  refusal counts; bodies are small JSON objects.

Answers are flat JSON objects of strings, one key a line, so that join.sh reads them with
sed on a host that has neither jq nor Python.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from django.conf import settings
from django.contrib import messages
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils.translation import gettext as _
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

import jobs
from console.auth import join_locked_response, token_failed, token_locked
from console.forms_hosts import JoinTokenForm
from console.powers import operator_required
from jobs.hosts import joins
from jobs.models import HostJoin

SCRIPTS = Path(jobs.__file__).resolve().parent / "hosts" / "scripts"
MAX_BODY = 64 * 1024
# What the served join.sh may be told the console's URL is (it lands in a shell script).
_URL = re.compile(r"^https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?$")
_PLACEHOLDER = 'SUANLI_CONSOLE="${SUANLI_CONSOLE:-}"'


def console_url(request: HttpRequest) -> str:
    url = (settings.SUANLI_JOIN_URL or request.build_absolute_uri("/")).rstrip("/")
    return url if _URL.match(url) else ""


@operator_required("jobs.add_host")
@never_cache
def ops_host_add(request):
    form = JoinTokenForm(request.POST or None)
    made = None
    join = None
    if request.method == "POST" and form.is_valid():
        try:
            join, token = joins.token_create(by=request.user, **form.cleaned_data)
        except ValidationError as exc:  # a taken address the maker may not claim
            form.add_error(None, exc)
    if join is not None:
        base = console_url(request) or "https://CONSOLE"
        made = {
            "join": join,
            "command": f"curl -fsSL {base}/hosts/join.sh | sudo sh -s -- {token}",
            "copied": f"sudo sh join.sh --console {base} {token}",
            "script_url": f"{base}/hosts/join.sh",
            "leave": "sudo sh join.sh leave",
        }
        form = JoinTokenForm(initial=form.cleaned_data)
    return render(
        request,
        "console/ops_host_add.html",
        {"form": form, "made": made, "joins": joins.recent(), "minutes": _token_minutes()},
    )


@operator_required("jobs.add_host")
@require_POST
def ops_host_join_revoke(request, join_id: int):
    join = get_object_or_404(HostJoin, pk=join_id)
    if joins.token_revoke(join=join):
        messages.success(request, _("The join token is revoked: nobody can use it now."))
    else:
        messages.error(
            request,
            _("That token was used already: a host that joined leaves with join.sh leave."),
        )
    return redirect("ops_hosts")


def _token_minutes() -> int:
    return max(1, settings.SUANLI_JOIN_TOKEN_S // 60)


def _script(name: str) -> str:
    return (SCRIPTS / name).read_text()


@require_GET
def join_script(request):
    text = _script("join.sh")
    url = console_url(request)
    if url:
        text = text.replace(_PLACEHOLDER, f'SUANLI_CONSOLE="${{SUANLI_CONSOLE:-{url}}}"', 1)
    return HttpResponse(text, content_type="text/x-shellscript; charset=utf-8")


@require_GET
def firewall_script(request):
    return HttpResponse(
        _script("host-firewall.sh"), content_type="text/x-shellscript; charset=utf-8"
    )


def _answer(data: dict, status: int = 200) -> HttpResponse:
    body = json.dumps({k: "" if v is None else str(v) for k, v in data.items()}, indent=0)
    response = HttpResponse(body + "\n", status=status, content_type="application/json")
    response["Cache-Control"] = "no-store"
    return response


def _body(request: HttpRequest) -> dict | None:
    if request.content_type != "application/json" or len(request.body) > MAX_BODY:
        return None
    try:
        body = json.loads(request.body)
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


def _source(request: HttpRequest) -> str | None:
    return request.META.get("REMOTE_ADDR") or None


def _begin(body: dict, source) -> dict:
    return joins.join_begin(
        token=body.get("token"),
        name=body.get("name"),
        address=body.get("address"),
        source=source,
        csr=body.get("csr"),
    )


def _register(body: dict, source) -> dict:
    host = joins.join_register(
        credential=body.get("credential"),
        source=source,
        gpu_count=body.get("gpu_count"),
        gpu_name=body.get("gpu_name"),
    )
    return {"name": host.name, "state": "checking", "engine": host.engine_url}


def _report(body: dict, source) -> dict:
    joins.join_report(
        token=body.get("token"),
        credential=body.get("credential"),
        step=body.get("failed_step"),
        error=body.get("error"),
    )
    return {"ok": "yes"}


def _status(body: dict, source) -> dict:
    return joins.host_status(credential=body.get("credential"))


def _leave(body: dict, source) -> dict:
    join, credential = joins.leave_begin(
        token=body.get("token"),
        credential=body.get("credential"),
        name=body.get("name"),
        source=source,
    )
    return {"credential": credential, "name": join.host_name, "state": "draining"}


def _leave_status(body: dict, source) -> dict:
    return joins.leave_progress(credential=body.get("credential"))


def _left(body: dict, source) -> dict:
    return {"note": joins.leave_done(credential=body.get("credential"), source=source)}


STEPS = {
    "begin": _begin,
    "register": _register,
    "report": _report,
    "status": _status,
    "leave": _leave,
    "leave-status": _leave_status,
    "left": _left,
}


def _guarded(request: HttpRequest, work) -> HttpResponse:
    if token_locked(request):
        return join_locked_response(request)
    body = _body(request)
    if body is None:
        return _answer({"error": "send one JSON object (Content-Type: application/json)"}, 400)
    try:
        return work(body)
    except joins.Refused:
        if token_failed(request):
            return join_locked_response(request)
        return _answer({"error": joins.REFUSED}, 403)
    except joins.Invalid as exc:
        return _answer({"error": str(exc)}, 400)


@csrf_exempt
@require_POST
def join_api(request):
    def work(body: dict) -> HttpResponse:
        step = STEPS.get(str(body.get("step")))
        if step is None:
            return _answer({"error": f"step is one of {', '.join(STEPS)}"}, 400)
        return _answer(step(body, _source(request)))

    return _guarded(request, work)


@csrf_exempt
@require_POST
def join_image(request):
    def work(body: dict) -> HttpResponse:
        chunks = joins.image_export(credential=body.get("credential"), image=body.get("image"))
        response = StreamingHttpResponse(chunks, content_type="application/x-tar")
        response["Cache-Control"] = "no-store"
        return response

    return _guarded(request, work)

"""The token JSON API under /api/v1/, and the page where researchers manage their tokens.

Authentication is `Authorization: Bearer <token>` only (never the session cookie, so
there is no CSRF surface); each token is rate-limited (`SUANLI_API_RATE_PER_MIN` a
minute), and failed tokens count with failed log-ins against the client's address: at
`AXES_FAILURE_LIMIT` the address gets 429 for the cool-off, valid tokens too. Input goes
through the same forms and services as the pages, and every object is looked up through
its owner: another researcher's is 404. Errors are JSON:
`{"error": "...", "fields": {"name": ["..."]}}`.
"""

from __future__ import annotations

import functools
import json
import re
import time
from datetime import datetime, timedelta

import django_rq
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.core.paginator import EmptyPage, Paginator
from django.db import transaction
from django.http import Http404, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.csrf import csrf_exempt

from billing import selectors as money
from console import auth
from console.api_schema import SCHEMA
from console.forms import CUSTOM_IMAGE, ClusterForm, JobForm, ResizeForm
from console.models import ApiToken, digest_of
from jobs import runner
from jobs import selectors as fleet
from jobs import services as fleet_services
from jobs.models import Image, Replica

PAGE = 50


def _error(status: int, message: str, fields: dict | None = None, **headers) -> JsonResponse:
    response = JsonResponse({"error": message, "fields": fields or {}}, status=status)
    for name, value in headers.items():
        response[name.replace("_", "-")] = value
    return response


def _token_user(request):
    """(token row, "") or (None, why). A token that does not authenticate counts as a
    failed log-in of the client's address (console/auth.py); a missing one does not."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None, "Send your API token as 'Authorization: Bearer <token>'."
    row = ApiToken.objects.select_related("user").filter(digest=digest_of(token.strip())).first()
    if row is None or row.revoked_at is not None or not row.user.is_active:
        auth.token_failed(request)
        return None, "This token is not valid (unknown or revoked)."
    now = timezone.now()
    # At most one write a minute per token for "last used".
    ApiToken.objects.filter(pk=row.pk).exclude(last_used_at__gt=now - timedelta(minutes=1)).update(
        last_used_at=now
    )
    return row, ""


def _over_limit(token: ApiToken) -> int | None:
    """Seconds to wait when this token used its requests for the current minute."""
    limit = getattr(settings, "SUANLI_API_RATE_PER_MIN", 120)
    window = int(time.time() // 60)
    key = f"suanli:api:rate:{token.pk}:{window}"
    try:
        redis = django_rq.get_connection("default")
        count = redis.incr(key)
        if count == 1:
            redis.expire(key, 90)
    except Exception:  # Redis away: serve rather than refuse everyone
        return None
    return 60 - int(time.time()) % 60 if count > limit else None


def endpoint(*methods: str):
    def wrap(view):
        @csrf_exempt
        @functools.wraps(view)
        def handler(request, *args, **kwargs):
            if auth.token_locked(request):
                return auth.token_locked_response(request)
            token, why = _token_user(request)
            if token is None:
                if getattr(request, "axes_locked_out", False):  # this failure locked it
                    return auth.token_locked_response(request)
                return _error(401, why, WWW_Authenticate='Bearer realm="suanli"')
            if request.method not in methods:
                return _error(405, f"Use {' or '.join(methods)}.", Allow=", ".join(methods))
            wait = _over_limit(token)
            if wait is not None:
                return _error(
                    429, "Too many requests for this token; slow down.", Retry_After=str(wait)
                )
            body = {}
            if request.method == "POST":
                try:
                    body = json.loads(request.body or b"{}")
                    json.dumps(body, ensure_ascii=False).encode(
                        "utf-8"
                    )  # lone surrogates: unstorable
                except (ValueError, UnicodeError, RecursionError):
                    return _error(400, "The body is not valid JSON (UTF-8, not nested too deep).")
                if not isinstance(body, dict):
                    return _error(400, "The body must be a JSON object.")
                if "\\u0000" in json.dumps(body):  # PostgreSQL text cannot hold NUL
                    return _error(400, "Text may not contain NUL characters.")
            try:
                return view(request, token.user, body, *args, **kwargs)
            except Http404:
                return _error(404, "Not found.")
            except ValidationError as exc:
                if hasattr(exc, "error_dict"):
                    return _error(400, "Invalid input.", exc.message_dict)
                return _error(400, " ".join(exc.messages))

        return handler

    return wrap


def _fields_error(form) -> JsonResponse:
    fields = {name: [str(e) for e in errors] for name, errors in form.errors.items()}
    general = fields.pop("__all__", [])
    return _error(400, " ".join(general) or "Invalid input.", fields)


def _page(request, queryset):
    try:
        number = max(1, int(request.GET.get("page", "1")))
    except ValueError:
        raise ValidationError("page is a whole number from 1.") from None
    paginator = Paginator(queryset, PAGE)
    try:
        page = paginator.page(number)
    except EmptyPage:
        return [], {"page": number, "pages": paginator.num_pages, "count": paginator.count}
    return list(page), {"page": number, "pages": paginator.num_pages, "count": paginator.count}


def _iso(value):
    return value.isoformat().replace("+00:00", "Z") if value else None


def cluster_json(request, c) -> dict:
    return {
        "id": c.pk, "name": c.name, "state": c.state, "state_reason": c.state_reason,
        "gpu_model": c.gpu_model.slug if c.gpu_model_id else None,
        "instance_type": c.instance_type.name if c.instance_type_id else None,
        "nodes": c.nodes, "gpus_per_node": c.gpus_per_node, "image": c.image_reference,
        "network": c.network, "zone": c.zone, "spot": c.spot, "release_policy": c.release_policy,
        "created_at": _iso(c.created_at), "running_since": _iso(c.running_since),
        "released_at": _iso(c.released_at),
        "url": request.build_absolute_uri(reverse("cluster_detail", args=[c.pk])),
    }  # fmt: skip


def job_json(request, j) -> dict:
    return {
        "id": j.pk, "name": j.name, "cluster": j.cluster_id, "state": j.state,
        "state_reason": j.state_reason, "exit_code": j.exit_code, "attempt": j.attempt,
        "launcher": j.launcher, "command": j.command, "created_at": _iso(j.created_at),
        "started_at": _iso(j.started_at), "finished_at": _iso(j.finished_at),
        "preemption_script": j.preemption_script, "max_preemptions": j.max_preemptions,
        "preemptions": j.preemptions, "resume_from": j.resume_from or None,
        "url": request.build_absolute_uri(reverse("job_detail", args=[j.pk])),
    }  # fmt: skip


def _as_text(value, sep="\n") -> str:
    if value is None:
        return ""
    if isinstance(value, list | tuple):
        return sep.join(str(v) for v in value)
    if isinstance(value, dict):
        return sep.join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _scalars(body: dict, names, *, numbers=()) -> dict:
    """The named fields of a JSON body, as a form's data. Text fields take JSON strings
    only and number fields whole numbers (or their digits as a string), so that e.g.
    `"command": 123` is refused, not run as the command `123`."""
    data, errors = {}, {}
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if name in numbers:
            if isinstance(value, bool) or not isinstance(value, int | str):
                errors[name] = ["Give a whole number."]
                continue
        elif not isinstance(value, str):
            errors[name] = ["Give a string."]
            continue
        data[name] = value
    if errors:
        raise ValidationError(errors)
    return data


def _cluster_form_data(body: dict) -> dict:
    """The API's fields as the cluster form's."""
    data = _scalars(
        body,
        (
            "name",
            "nodes",
            "gpus_per_node",
            "network",
            "zone",
            "release_policy",
            "idle_minutes",
        ),
        numbers=("nodes", "gpus_per_node", "idle_minutes"),
    )
    if body.get("instance_type"):
        data["resource"] = f"cpu:{body['instance_type']}"
    elif body.get("gpu_model"):
        data["resource"] = f"gpu:{body['gpu_model']}"
    reference = body.get("image")
    if reference:
        image = Image.objects.filter(reference=str(reference), active=True).first()
        data["image"] = str(image.pk) if image else CUSTOM_IMAGE
        if image is None:
            data["custom_image"] = str(reference)
    data.setdefault("network", "standard")
    data.setdefault("release_policy", "after_last_job")
    data["volumes"] = _as_text(body.get("volumes"))
    if body.get("spot") is True:
        data["spot"] = "on"
    if isinstance(body.get("ssh_keys"), list):
        data["ssh_keys"] = [str(k) for k in body["ssh_keys"]]
    return data


@endpoint("GET", "POST")
def clusters(request, user, body):
    if request.method == "GET":
        rows, page = _page(request, fleet.clusters_for(user))
        return JsonResponse({"clusters": [cluster_json(request, c) for c in rows], **page})
    form = ClusterForm(_cluster_form_data(body), owner=user)
    if not form.is_valid():
        return _fields_error(form)
    cluster = fleet_services.cluster_create(owner=user, spec=form.spec())
    return JsonResponse(cluster_json(request, cluster), status=201)


@endpoint("GET")
def cluster(request, user, body, cluster_id: int):
    return JsonResponse(cluster_json(request, fleet.cluster_for_user(user, cluster_id)))


@endpoint("POST")
def cluster_release(request, user, body, cluster_id: int):
    c = fleet.cluster_for_user(user, cluster_id)
    c = fleet_services.cluster_release(cluster=c, reason="released by its owner (API)")
    return JsonResponse(cluster_json(request, c))


@endpoint("POST")
def cluster_resize(request, user, body, cluster_id: int):
    """`{"nodes": N}`: the page's resize, with its balance check for more nodes."""
    c = fleet.cluster_for_user(user, cluster_id)
    form = ResizeForm(_scalars(body, ("nodes",), numbers=("nodes",)), cluster=c)
    if not form.is_valid():
        return _fields_error(form)
    c = fleet_services.cluster_resize(cluster=c, nodes=form.cleaned_data["nodes"])
    return JsonResponse(cluster_json(request, c))


def _job_form_data(body: dict) -> dict:
    data = _scalars(
        body,
        (
            "name",
            "command",
            "launcher",
            "workdir",
            "checkpoint_dir",
            "max_runtime_min",
            "retries",
            "preemption_script",
            "max_preemptions",
        ),
        numbers=("max_runtime_min", "retries", "max_preemptions"),
    )
    data.setdefault("workdir", "/workspace")
    data.setdefault("checkpoint_dir", "/workspace/checkpoints")
    data.setdefault("launcher", "plain")
    data.setdefault("retries", 0)
    data["env"] = _as_text(body.get("env"))
    return data


@endpoint("GET", "POST")
def jobs(request, user, body):
    if request.method == "GET":
        queryset = fleet.jobs_for(user)
        if request.GET.get("cluster"):
            try:
                queryset = queryset.filter(cluster_id=int(request.GET["cluster"]))
            except ValueError:
                raise ValidationError("cluster is a cluster id.") from None
        rows, page = _page(request, queryset)
        return JsonResponse({"jobs": [job_json(request, j) for j in rows], **page})
    try:
        cluster_id = int(body.get("cluster"))
    except (TypeError, ValueError):
        return _error(400, "Invalid input.", {"cluster": ["Give the id of one of your clusters."]})
    target = fleet.cluster_for_user(user, cluster_id)
    form = JobForm(_job_form_data(body))
    if not form.is_valid():
        return _fields_error(form)
    with transaction.atomic():
        job = fleet_services.job_submit(cluster=target, spec=form.spec())
    return JsonResponse(job_json(request, job), status=201)


@endpoint("GET")
def job(request, user, body, job_id: int):
    return JsonResponse(job_json(request, fleet.job_for_user(user, job_id)))


@endpoint("POST")
def job_cancel(request, user, body, job_id: int):
    j = fleet.job_for_user(user, job_id)
    with transaction.atomic():
        j = fleet_services.job_cancel(job=j, by=user.username)
    return JsonResponse(job_json(request, j))


_CURSOR = re.compile(r"(\d{1,5})((?:~\d{1,3}\.\d{1,20}\.\d{1,9}){0,64})")


def _ts_ns(ts: str) -> int | None:
    """Docker's RFC 3339 timestamp (UTC, up to 9 decimals, trailing zeros trimmed) as
    nanoseconds: comparable, unlike the strings."""
    head, _, frac = ts.rstrip("Z").partition(".")
    if not frac.isdigit() and frac:
        return None
    try:
        seconds = datetime.fromisoformat(head + "+00:00").timestamp()
    except ValueError:
        return None
    return int(seconds) * 1_000_000_000 + int((frac or "0")[:9].ljust(9, "0"))


def _parse_cursor(raw: str) -> tuple[int, dict[int, tuple[int, int]]]:
    match = _CURSOR.fullmatch(raw)
    if match is None:
        raise ValidationError("since is the cursor of an earlier answer of this endpoint.")
    positions = {}
    for part in match.group(2).split("~")[1:]:
        rank, ns, count = (int(x) for x in part.split("."))
        positions[rank] = (ns, count)
    return int(match.group(1)), positions


def _log_after(job, attempt: int, positions: dict) -> tuple[list[dict], dict]:
    """The attempt's lines after `positions` (rank -> newest timestamp sent, and how many
    lines of that timestamp): the stored log of ended replicas, the engine's live log of
    running ones. Per rank, because the nodes' clocks are not each other's."""
    out, after = [], {}
    for replica in job.replicas.filter(attempt=attempt).select_related("host").order_by("rank"):
        at, sent_at = positions.get(replica.rank, (None, 0))
        if replica.state in (Replica.State.EXITED, Replica.State.LOST):
            raw = replica.log.splitlines()
        elif replica.state == Replica.State.RUNNING:
            # Docker's `since` is inclusive and in float seconds: ask a second early, and
            # skip what was sent here.
            raw = runner.live_log_since(replica, at / 1e9 - 1 if at else None)
        else:
            raw = []
        newest, count, seen_at = at, sent_at, 0
        for line in raw:
            ts, text = fleet.split_log_line(line)
            ns = _ts_ns(ts)
            if at is not None:
                if ns is None or ns < at:
                    continue
                if ns == at:
                    seen_at += 1
                    if seen_at <= sent_at:
                        continue
            out.append((ns or 0, replica.rank, ts, text))
            if ns is not None and (newest is None or ns > newest):
                newest, count = ns, 1
            elif ns is not None and ns == newest:
                count += 1
        if newest is not None:
            after[replica.rank] = (newest, count)
    out.sort(key=lambda line: line[:2])
    return [{"ts": ts, "rank": rank, "text": text} for _, rank, ts, text in out], after


@endpoint("GET")
def job_log(request, user, body, job_id: int):
    """The current attempt's log; with `?since=<cursor>` (each answer's `cursor`) only the
    lines after that answer's, first the rest of an earlier attempt that the cursor was
    reading. `complete` once the job has ended and this is the last attempt's log."""
    j = fleet.job_for_user(user, job_id)
    attempt, positions = j.attempt, {}
    if "since" in request.GET:
        attempt, positions = _parse_cursor(request.GET["since"])
        if attempt > j.attempt:
            raise ValidationError("since is a cursor of another job.")
        if attempt < j.attempt and not j.replicas.filter(attempt=attempt).exists():
            attempt, positions = j.attempt, {}  # nothing of that attempt ever ran
    lines, after = _log_after(j, attempt, positions)
    cursor = f"{attempt}" + "".join(f"~{r}.{ns}.{n}" for r, (ns, n) in sorted(after.items()))
    if attempt < j.attempt:
        cursor = f"{attempt + 1}"  # the next answer starts the next attempt
    return JsonResponse(
        {
            "job": j.pk, "state": j.state, "attempt": attempt, "exit_code": j.exit_code,
            "complete": j.is_ended and attempt == j.attempt, "lines": lines, "cursor": cursor,
        }
    )  # fmt: skip


@endpoint("GET")
def balance(request, user, body):
    standing = money.standing(user)
    entries = money.entries_of(user)[:PAGE]
    return JsonResponse(
        {
            "currency": standing.currency,
            "balance": str(standing.balance),
            "burn_per_hour": str(standing.burn_per_hour),
            "hours_left": str(round(standing.hours_left, 2)) if standing.hours_left is not None else None,
            "entries": [
                {
                    "kind": e.kind, "amount": str(e.amount), "balance_after": str(e.balance_after),
                    "cluster": e.cluster_id, "period_from": _iso(e.period_from),
                    "period_to": _iso(e.period_to), "units": e.units,
                    "rate": str(e.rate) if e.rate is not None else None, "memo": e.memo,
                    "created_at": _iso(e.created_at),
                }
                for e in entries
            ],
        }
    )  # fmt: skip


@csrf_exempt
def not_found(request):
    return _error(404, "No such API path; see /api/v1/schema.")


def schema(request):
    return JsonResponse(SCHEMA)


@login_required
def tokens_page(request):
    token = None
    if request.method == "POST":
        if request.POST.get("action") == "revoke":
            raw = request.POST.get("token", "")
            row = get_object_or_404(
                ApiToken, pk=int(raw) if raw.isdigit() else 0, user=request.user
            )
            ApiToken.objects.filter(pk=row.pk, revoked_at__isnull=True).update(
                revoked_at=timezone.now()
            )
            messages.success(request, f"Token {row.name} revoked: it stops working at once.")
            return redirect("api_tokens")
        name = request.POST.get("name", "").strip()
        if not name or len(name) > 60:
            messages.error(request, "Name the token (at most 60 characters), e.g. ci-pipeline.")
        else:
            _, token = ApiToken.issue(user=request.user, name=name)
    return render(
        request,
        "console/api_tokens.html",
        {"tokens": ApiToken.objects.filter(user=request.user), "new_token": token},
    )

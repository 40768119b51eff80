"""The token JSON API under /api/v1/ (django-ninja), and the page where researchers manage
their tokens.

Authentication is `Authorization: Bearer <token>` only (never the session cookie, so
there is no CSRF surface); each researcher is rate-limited across all their tokens
(`SUANLI_API_RATE_PER_MIN` a minute, counted atomically in Redis) and holds at most
`SUANLI_API_TOKENS_MAX` live tokens (console/models.py), and failed tokens count with
failed log-ins against the client's address: at `AXES_FAILURE_LIMIT` the address gets
429 for the cool-off, valid tokens too. The schemas (console/api_schema.py) check types and shapes; the rules are the
forms' and services', the same as the pages'. Every object is looked up through its owner:
another researcher's is 404. Errors are JSON: `{"error": "...", "fields": {"name": ["..."]}}`,
with the fields named as the API names them. The OpenAPI document is generated from this
module at /api/v1/schema, its interactive page at /api/v1/docs.
"""

import json
import math
import re
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from functools import partial

import django_rq
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, RequestDataTooBig, ValidationError
from django.db import transaction
from django.db.models import Count, Max, Min, Q
from django.http import Http404, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.utils import timezone, translation
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop
from ninja import NinjaAPI, Query, Schema, Status
from ninja.errors import AuthenticationError, HttpError, Throttled
from ninja.errors import ValidationError as SchemaError
from ninja.openapi.docs import Swagger
from ninja.pagination import PaginationBase, paginate
from ninja.parser import Parser
from ninja.security import HttpBearer
from ninja.throttling import BaseThrottle
from pydantic import Field

from billing import budgets, projections
from billing import selectors as money
from billing import services as billing_services
from console import auth, views_budgets, views_pools, views_webhooks
from console import pools as console_pools
from console.api_schema import (
    AttachKey,
    Balance,
    BalanceWarning,
    BalanceWarningOut,
    BillFilter,
    BillOut,
    BudgetBody,
    BuildOut,
    ChannelTestOut,
    ClusterKeysOut,
    ClusterOut,
    DeliveryOut,
    Error,
    GpuSubscriptionOut,
    Id,
    ImagesOut,
    JobBody,
    JobDetailOut,
    JobOut,
    Log,
    NewBuild,
    NewCluster,
    NewGpuSubscription,
    NewJob,
    NewNotificationChannel,
    NewNotificationChannelOut,
    NewPool,
    NewSshKey,
    NewSweep,
    NodeIndex,
    NotificationChannelChange,
    NotificationChannelOut,
    PiecesFilter,
    PiecesOut,
    PoolDetailOut,
    PoolOut,
    ProfileOut,
    Resize,
    SaveImage,
    Shutdown,
    SshKeyChange,
    SshKeyOut,
    Start,
    SweepDetailOut,
    SweepOut,
)
from console.errors import too_big_words
from console.forms import (
    CUSTOM_IMAGE,
    OWN_IMAGE,
    JobForm,
    PoolForm,
    ResizeForm,
    SshKeyForm,
    check_funds,
    start_refusal,
)
from console.forms_sweeps import SweepForm, space_field_text
from console.models import ApiToken, digest_of
from console.views_monitoring import trace_download
from jobs.base.text import Text
from jobs.clusters import services as cluster_services
from jobs.clusters import shutdown
from jobs.clusters.spec import (
    SHUTDOWN_FIELDS,
    ClusterRequest,
    Offer,
    Schedule,
    ShutdownRequest,
    image_by_reference,
)
from jobs.images import builds
from jobs.models import (
    GpuSubscription,
    Image,
    Job,
    OwnImage,
    Pool,
    Replica,
    SshKey,
    Sweep,
    Trial,
    WebhookDelivery,
    WebhookEndpoint,
)
from jobs.placement import fleet
from jobs.pools import autoscaler, subscriptions, sweeps
from jobs.runs import exits
from jobs.tenancy.actors import Actor, Role, is_team_principal
from monitoring import profiles

BY_API = Text(gettext_noop("its owner (API)"))


def _actor(request) -> Actor:
    """Whom the call acts for (the token's researcher, or a team: TokenAuth)."""
    return request.auth.actor


def _by(request):
    """Who acted, as a timeline says it: its owner (API), or a team's member by login."""
    actor = _actor(request)
    return f"{actor.person.get_username()} (API)" if actor.team else BY_API


PAGE = 50


def _error(status: int, message: str, fields: dict | None = None, **headers) -> JsonResponse:
    response = JsonResponse({"error": message, "fields": fields or {}}, status=status)
    for name, value in headers.items():
        response[name.replace("_", "-")] = value
    return response


# -- the parts django-ninja is given: body parser, token auth, per-token throttle --------


class BadBody(ValueError):
    """A request body that is not one storable JSON object; its message says why."""


class JsonObject(Parser):
    def parse_body(self, request):
        try:
            body = json.loads(request.body or b"{}")
            json.dumps(body, ensure_ascii=False).encode("utf-8")  # lone surrogates: unstorable
        except (ValueError, UnicodeError, RecursionError):
            raise BadBody("The body is not valid JSON (UTF-8, not nested too deep).") from None
        if not isinstance(body, dict):
            raise BadBody("The body must be a JSON object.")
        if "\\u0000" in json.dumps(body):  # PostgreSQL text cannot hold NUL
            raise BadBody("Text may not contain NUL characters.")
        return body


class Locked(Exception):
    """The client's address is locked out for failed tokens and log-ins."""


class NoToken(AuthenticationError):
    def __init__(self, why: str):
        super().__init__(401, why)


class TokenAuth(HttpBearer):
    """The token row of `Authorization: Bearer <token>`. A token that does not
    authenticate counts as a failed log-in of the client's address (console/auth.py); a
    missing one does not. A locked address is refused before any token is looked up."""

    def __call__(self, request):
        if auth.token_locked(request):
            raise Locked
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise NoToken("Send your API token as 'Authorization: Bearer <token>'.")
        return self.authenticate(request, token.strip())

    def authenticate(self, request, token):
        row = ApiToken.objects.select_related("user").filter(digest=digest_of(token)).first()
        if row is None or row.revoked_at is not None or not row.user.is_active:
            if auth.token_failed(request):  # this failure locked the address
                raise Locked
            raise NoToken("This token is not valid (unknown or revoked).")
        row.actor = _acting_for(request, row)
        now = timezone.now()
        # At most one write a minute per token for "last used".
        ApiToken.objects.filter(pk=row.pk).exclude(
            last_used_at__gt=now - timedelta(minutes=1)
        ).update(last_used_at=now)
        return row


class NoTeam(Exception):
    """X-Suanli-Team names a team the token's owner is not in now (404, as no such team)."""


class OtherTeam(Exception):
    """A team's token asked, by X-Suanli-Team, to act for another team (403)."""


TEAM_HEADER = "X-Suanli-Team"


def _acting_for(request, row: ApiToken) -> Actor:
    """Whom a request acts for. A team's token acts for its team with its maker's role now;
    once they are no longer a member it is refused like a revoked one (not counted as a
    failed log-in), and it never acts for another team. A personal token acts for its
    owner, or with `X-Suanli-Team: <id>` for that team while they are a member. A team's
    token made before its maker's membership began (they were removed and invited again)
    stays refused: removal ends it for good. A team's principal never holds a token
    (ApiToken.issue refuses it): one found is refused."""
    asked = request.headers.get(TEAM_HEADER, "").strip()
    if row.team_id:
        try:
            actor = Actor.for_team(row.user, row.team_id)
        except Http404:
            raise NoToken("This token is not valid (unknown or revoked).") from None
        if row.created_at < actor.membership.joined_at:  # made before a removal: stays dead
            raise NoToken("This token is not valid (unknown or revoked).")
        if asked and asked != str(row.team_id):
            raise OtherTeam
        return actor
    if is_team_principal(row.user):
        raise NoToken("This token is not valid (unknown or revoked).")
    if not asked:
        return Actor.of(row.user)
    try:
        return Actor.for_team(row.user, asked)
    except Http404:
        raise NoTeam from None


class TokenRate(BaseThrottle):
    """`SUANLI_API_RATE_PER_MIN` requests per researcher and clock minute, across all
    their tokens (more tokens buy no more requests): one INCR and EXPIRE in a Redis
    transaction, so concurrent requests (any number of web processes) never both take
    the last one."""

    def allow_request(self, request) -> bool:
        limit = getattr(settings, "SUANLI_API_RATE_PER_MIN", 120)
        key = f"suanli:api:rate:user:{request.auth.user_id}:{int(time.time() // 60)}"
        try:
            pipe = django_rq.get_connection("default").pipeline(transaction=True)
            count, _ = pipe.incr(key).expire(key, 90).execute()
        except Exception:  # Redis away: serve rather than refuse everyone
            return True
        return count <= limit

    def wait(self) -> float:
        return 60 - time.time() % 60


class SuanliApi(NinjaAPI):
    def get_openapi_operation_id(self, operation) -> str:
        """The view's own name (`cluster_create`), not `console_api_cluster_create`: what a
        generated client names its functions."""
        return operation.view_func.__name__


api = SuanliApi(
    title="Suanli API",
    version="1",
    description="GPU clusters, jobs, own images and balance of the token's owner. Another "
    'researcher\'s objects are 404. Errors are `{"error": ..., "fields": {...}}`.',
    urls_namespace="api",
    openapi_url="/schema",
    docs_url="/docs",
    docs=Swagger(settings={"persistAuthorization": True}),
    auth=TokenAuth(),
    throttle=[TokenRate()],
    parser=JsonObject(),
)

# -- errors, all as {"error", "fields"} -----------------------------------------------------

_WORDS = {
    "string_type": "Give a string.",
    "int_type": "Give a whole number.",
    "int_parsing": "Enter a whole number.",  # text that is not one: the form's words
    "int_from_float": "Give a whole number.",
    "bool_type": "Give true or false.",
    "list_type": "Give a list.",
    "dict_type": "Give an object.",
    "missing": "This field is required.",
}


# One sentence for a field whose value fits none of its shapes (not one per shape).
_SHAPES = {
    "env": "Give an object of names to text or numbers, or NAME=value lines.",
    "volumes": "Give a list of strings.",
}


def _field_message(err: dict) -> str:
    """A field's validation error (pydantic's) as a sentence for the API's `fields`."""
    kind, ctx = err.get("type"), err.get("ctx") or {}
    if kind == "greater_than_equal":
        return f"Give {ctx.get('ge')} or more."
    if kind == "less_than_equal":
        return f"Give at most {ctx.get('le')}."
    if kind == "literal_error":
        return f"Give {ctx.get('expected')}."
    return _WORDS.get(kind, err.get("msg", "Invalid."))


@api.exception_handler(SchemaError)
def _schema_error(request, exc):
    fields: dict[str, list[str]] = {}
    for err in exc.errors:
        loc = [str(part) for part in err.get("loc", ())]
        if loc[:1] == ["body"] and len(loc) <= 2:
            return _error(400, "The body must be a JSON object.")
        name = loc[2] if loc[:1] == ["body"] else loc[-1] if loc else ""
        message = _SHAPES.get(name) or _field_message(err)
        if message not in fields.setdefault(name, []):
            fields[name].append(message)
    return _error(400, "Invalid input.", fields)


@api.exception_handler(HttpError)
def _http_error(request, exc):
    if isinstance(exc.__cause__, BadBody):
        return _error(400, str(exc.__cause__))
    if isinstance(exc, AuthenticationError):
        message = exc.message if isinstance(exc, NoToken) else "Send your API token."
        return _error(401, message, WWW_Authenticate='Bearer realm="suanli"')
    if isinstance(exc, Throttled):
        return _error(429, "Too many requests from your tokens this minute; slow down.")
    return _error(exc.status_code, exc.message)


@api.exception_handler(RequestDataTooBig)
def _too_big(request, exc):
    with translation.override("en"):  # the API speaks English; the words are the pages' own
        return _error(413, too_big_words())


@api.exception_handler(Locked)
def _locked(request, exc):
    return auth.token_locked_response(request)


@api.exception_handler(NoTeam)
def _no_team(request, exc):
    return _error(404, "No such team.")


@api.exception_handler(OtherTeam)
def _other_team(request, exc):
    return _error(
        403, f"This token acts for its own team only: leave {TEAM_HEADER} out, or give its id."
    )


@api.exception_handler(Http404)
def _not_found(request, exc):
    return _error(404, "Not found.")


@api.exception_handler(PermissionDenied)
def _forbidden(request, exc):
    """What the token's role in its team may see but not do (a viewer's write, ...)."""
    return _error(403, str(exc) or "Your role in this team may not do this.")


@api.exception_handler(ValidationError)
def _rule_broken(request, exc):
    """A service's rule (the same as the page's) refused the request."""
    if hasattr(exc, "error_dict"):
        return _error(400, "Invalid input.", exc.message_dict)
    return _error(400, " ".join(exc.messages))


def _fields_error(form, names: dict[str, str] | None = None) -> JsonResponse:
    """The form's errors under the API's field names (`names`: form field -> API field)."""
    return _refusals(form.errors.items(), names)


def _refusals(errors, names: dict[str, str] | None = None) -> JsonResponse:
    """(field, messages) pairs under the API's field names (`names`: field -> API field);
    "__all__" is the error itself."""
    fields: dict[str, list[str]] = {}
    for name, said in errors:
        fields.setdefault((names or {}).get(name, name), []).extend(str(e) for e in said)
    general = fields.pop("__all__", [])
    return _error(400, " ".join(general) or "Invalid input.", fields)


# 405: a method the path does not take (its Allow header says which), as console/api_urls.py
# answers it.
ERRORS = {400: Error, 401: Error, 404: Error, 405: Error, 413: Error, 429: Error}


def _responses(ok: int, schema) -> dict:
    return {ok: schema, **ERRORS}


class Pages(PaginationBase):
    """`?page=N`, 50 a page: `{"<items>": [...], "page": N, "pages": P, "count": C}`."""

    class Input(Schema):
        page: int = Field(1, ge=1, le=100_000)

    class Output(Schema):
        page: int
        pages: int
        count: int

    def __init__(self, *, items: str, **kwargs):
        super().__init__(**kwargs)
        self.items_attribute = items

    def paginate_queryset(self, queryset, pagination: Input, request, **params):
        count = queryset.count()
        start = (pagination.page - 1) * PAGE
        return {
            self.items_attribute: list(queryset[start : start + PAGE]),
            "page": pagination.page,
            "pages": max(1, math.ceil(count / PAGE)),
            "count": count,
        }


# -- clusters ---------------------------------------------------------------------------

# The cluster spec's (and form's) fields that the API names otherwise.
_CLUSTER_NAMES = {"resource": "gpu_model", "custom_image": "image"}


def _cluster_names(body: NewCluster) -> dict[str, str]:
    names = dict(_CLUSTER_NAMES)
    if body.instance_type and not body.gpu_model:
        names["resource"] = "instance_type"
    return names


def _as_text(value, sep="\n") -> str:
    if value is None:
        return ""
    if isinstance(value, list | tuple):
        return sep.join(str(v) for v in value)
    if isinstance(value, dict):
        return sep.join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _cluster_request(body: NewCluster, owner, *, person=None) -> ClusterRequest:
    """The API's fields as the cluster spec's request, checked there as given. An image is
    a reference: a catalog image's, one of the owner's own images', or any other (a custom
    image, which may not be another researcher's)."""
    resource = None
    if body.instance_type:
        resource = f"cpu:{body.instance_type}"
    elif body.gpu_model:
        resource = f"gpu:{body.gpu_model}"
    image = image_by_reference(owner, body.image) if body.image else None
    return ClusterRequest(
        owner=owner,
        name=body.name,
        resource=resource,
        nodes=body.nodes,
        gpus_per_node=body.gpus_per_node,
        image=image,
        custom_image=body.image if image == CUSTOM_IMAGE else None,
        network=body.network,
        zone=body.zone,
        spot=bool(body.spot),
        volumes=_as_text(body.volumes),
        pub=body.pub is not False,
        ssh_keys=_keys_asked(body, person or owner),
        workspace=body.workspace is not False,
        release_policy=body.release_policy,  # NewCluster defaults both to the model's
        idle_minutes=body.idle_minutes,
        stop_at=body.stop_at,
        stop_idle_minutes=body.stop_idle_minutes,
        stop_idle_below=body.stop_idle_below,
    )


def _keys_asked(body: NewCluster, owner) -> list:
    """The keys a request names; when it names none (the field left out), the owner's
    default keys, as the form ticks them. `[]` asks for none."""
    if body.ssh_keys is not None:
        return list(body.ssh_keys)
    return [k.pk for k in cluster_services.ssh_keys_default(owner)]


def _cluster_form_data(body: NewCluster, owner) -> dict:
    """The API's fields as the cluster form's. An image is a reference: a catalog image's,
    one of the owner's own images' (as if picked under "Your images"), or any other (the
    form's custom image, which refuses another researcher's)."""
    given = body.dict(exclude_none=True)
    data = {
        name: given[name]
        for name in ("name", "nodes", "gpus_per_node", "zone", "idle_minutes")
        if name in given
    }
    data["network"] = body.network
    data["release_policy"] = body.release_policy  # the model's default when not given
    if body.instance_type:
        data["resource"] = f"cpu:{body.instance_type}"
    elif body.gpu_model:
        data["resource"] = f"gpu:{body.gpu_model}"
    if body.image:
        image = Image.objects.filter(reference=body.image, active=True).first()
        own = OwnImage.objects.filter(owner=owner, reference=body.image.strip()).first()
        if image is not None:
            data["image"] = str(image.pk)
        elif own is not None:
            data["image"] = f"{OWN_IMAGE}{own.pk}"
        else:
            data["image"] = CUSTOM_IMAGE
            data["custom_image"] = body.image
    data["volumes"] = _as_text(body.volumes)
    if body.spot:
        data["spot"] = "on"
    if body.ssh_keys is not None:
        data["ssh_keys"] = [str(k) for k in body.ssh_keys]
    if body.workspace is not False:
        data["workspace"] = "on"
    if body.pub is not False:
        data["pub"] = "on"
    return data


@api.get(
    "/clusters",
    tags=["clusters"],
    response=_responses(200, list[ClusterOut]),
    summary="Your clusters",
)
@paginate(Pages, items="clusters")
def clusters(request):
    """Newest first, 50 a page."""
    return fleet.clusters_for(_actor(request))


@api.post(
    "/clusters",
    tags=["clusters"],
    response=_responses(201, ClusterOut),
    summary="Request a cluster",
)
def cluster_create(request, payload: NewCluster):
    """The same checks as the form (the cluster spec's), the balance included. The cluster
    is placed when capacity allows; poll it until `state` is `running`."""
    actor = _actor(request)
    actor.require(Role.MEMBER)
    user = actor.principal
    try:
        budget = budgets.parse(payload.budget)
    except ValidationError as exc:
        return _error(400, " ".join(exc.messages), {"budget": exc.messages})
    try:
        spec = _cluster_request(payload, user, person=actor.person).validate(
            Offer.of(user, person=actor.person), funds=partial(check_funds, actor)
        )
    except ValidationError as exc:
        return _refusals(exc.message_dict.items(), _cluster_names(payload))
    spec = replace(spec, budget=budget)
    made = cluster_services.cluster_create(owner=user, spec=spec, created_by=actor.person)
    return Status(201, made)


@api.get(
    "/clusters/{cluster_id}",
    tags=["clusters"],
    response=_responses(200, ClusterOut),
    summary="A cluster",
)
def cluster(request, cluster_id: Id):
    return fleet.cluster_for_user(_actor(request), cluster_id)


@api.post(
    "/clusters/{cluster_id}/release",
    tags=["clusters"],
    response=_responses(200, ClusterOut),
    summary="Release",
)
def cluster_release(request, cluster_id: Id):
    """Stop its jobs and its billing; the cluster's storage folders stay."""
    c = fleet.cluster_to_change(_actor(request), cluster_id)
    reason = Text(gettext_noop("released by its owner (API)"))
    if _actor(request).team:
        reason = Text(gettext_noop("released by %(who)s"), who=_by(request))
    return cluster_services.cluster_release(cluster=c, reason=reason)


@api.post(
    "/clusters/{cluster_id}/stop",
    tags=["clusters"],
    response=_responses(200, ClusterOut),
    summary="Stop (keep its files)",
)
def cluster_stop(request, cluster_id: Id):
    """Cancel its jobs, give its GPUs back (not charged from now) and stop its workspaces,
    keeping every file on their hosts until it is started or released."""
    c = fleet.cluster_to_use(_actor(request), cluster_id)
    return cluster_services.cluster_stop(cluster=c, by=_by(request))


@api.post(
    "/clusters/{cluster_id}/shutdown",
    tags=["clusters"],
    response=_responses(200, ClusterOut),
    summary="Set its scheduled or idle stop",
)
def cluster_shutdown(request, cluster_id: Id, payload: Shutdown):
    """`{"stop_at": "2026-12-06T23:00:00+08:00"}` stops it once at that time;
    `{"stop_idle_minutes": 30, "stop_idle_below": 5}` after 30 minutes with every GPU under
    5 % (by the monitor's samples: none, no stop). Its files are kept (a stop, not a
    release). A field left out stays; null clears it. The form's checks and words."""
    c = fleet.cluster_to_use(_actor(request), cluster_id)
    given = payload.dict(exclude_unset=True)
    rules = {n: given.get(n, getattr(c, n)) for n in SHUTDOWN_FIELDS}
    try:
        schedule = ShutdownRequest(cluster=c, **rules).validate()
    except ValidationError as exc:
        return _refusals(exc.message_dict.items())
    return shutdown.shutdown_set(cluster=c, schedule=schedule)


@api.delete(
    "/clusters/{cluster_id}/shutdown",
    tags=["clusters"],
    response=_responses(200, ClusterOut),
    summary="Clear its scheduled and idle stop",
)
def cluster_shutdown_clear(request, cluster_id: Id):
    c = fleet.cluster_to_use(_actor(request), cluster_id)
    return shutdown.shutdown_set(cluster=c, schedule=Schedule())


@api.post(
    "/clusters/{cluster_id}/start",
    tags=["clusters"],
    response={**_responses(200, ClusterOut), 409: Error},
    summary="Start a stopped cluster",
)
def cluster_start(request, cluster_id: Id, payload: Start = None):
    """On the hosts that keep its workspaces: `{"mode": "gpu"}` (default; 409 when its GPUs
    there are taken, saying so), `"wait"` (in line for them) or `"no_gpu"`."""
    c = fleet.cluster_to_use(_actor(request), cluster_id)
    mode = payload.mode if payload is not None else "gpu"
    short = start_refusal(c, mode, actor=_actor(request))
    if short:
        return _error(400, short)
    try:
        return cluster_services.cluster_start(cluster=c, mode=mode, by=_by(request))
    except cluster_services.StartBlocked as exc:
        return _error(
            409,
            " ".join(exc.messages)
            + ' (API: {"mode": "wait"} waits in line; {"mode": "no_gpu"} starts without GPUs.)',
        )


@api.post(
    "/clusters/{cluster_id}/resize",
    tags=["clusters"],
    response=_responses(200, ClusterOut),
    summary="Resize",
)
def cluster_resize(request, payload: Resize, cluster_id: Id):
    """`{"nodes": N}`: the page's resize, with its balance check for more nodes."""
    c = fleet.cluster_to_change(_actor(request), cluster_id)
    form = ResizeForm(payload.dict(exclude_none=True), cluster=c)
    if not form.is_valid():
        return _fields_error(form)
    return cluster_services.cluster_resize(cluster=c, nodes=form.cleaned_data["nodes"])


# -- SSH keys ----------------------------------------------------------------------------


def _key_of(user, key_id: int) -> SshKey:
    """One of the user's keys; another researcher's is 404, as one that does not exist."""
    return get_object_or_404(SshKey, pk=key_id, owner=user)


def _cluster_keys(cluster) -> dict:
    keys = cluster.ssh_keys.order_by("pk")  # a team cluster's: its people's
    return {"cluster": cluster.pk, "ssh_keys": list(keys)}


@api.get("/ssh-keys", tags=["ssh keys"], response=_responses(200, list[SshKeyOut]),
         summary="Your SSH keys")  # fmt: skip
@paginate(Pages, items="ssh_keys")
def ssh_keys(request):
    """Oldest first, 50 a page."""
    return SshKey.objects.filter(owner=_actor(request).person).order_by("created_at", "pk")


@api.post("/ssh-keys", tags=["ssh keys"], response=_responses(201, SshKeyOut),
          summary="Add an SSH key")  # fmt: skip
def ssh_key_add(request, payload: NewSshKey):
    """The page's checks: a well-formed ed25519, ecdsa or rsa (2048 bits or more) key,
    not one you added already. `is_default`: attached to every new cluster."""
    form = SshKeyForm({"name": payload.name or "", "public_key": payload.public_key})
    if not form.is_valid():
        return _fields_error(form)
    key = cluster_services.ssh_key_add(
        owner=_actor(request).person, name=form.cleaned_data["name"],
        public_key=form.cleaned_data["public_key"], is_default=bool(payload.is_default),
    )  # fmt: skip
    return Status(201, key)


@api.patch("/ssh-keys/{key_id}", tags=["ssh keys"], response=_responses(200, SshKeyOut),
           summary="Make a key a default, or not")  # fmt: skip
def ssh_key_change(request, key_id: Id, payload: SshKeyChange):
    key = _key_of(_actor(request).person, key_id)
    cluster_services.ssh_key_set_default(key=key, is_default=payload.is_default)
    return key


@api.delete("/ssh-keys/{key_id}", tags=["ssh keys"], response={204: None, **ERRORS},
            summary="Remove an SSH key")  # fmt: skip
def ssh_key_delete(request, key_id: Id):
    """Detached from every cluster: its next login is refused everywhere."""
    cluster_services.ssh_key_delete(key=_key_of(_actor(request).person, key_id))
    return Status(204, None)


@api.get("/clusters/{cluster_id}/ssh-keys", tags=["ssh keys"],
         response=_responses(200, ClusterKeysOut), summary="The keys attached to a cluster")  # fmt: skip
def cluster_keys(request, cluster_id: Id):
    return _cluster_keys(fleet.cluster_for_user(_actor(request), cluster_id))


@api.post("/clusters/{cluster_id}/ssh-keys", tags=["ssh keys"],
          response=_responses(200, ClusterKeysOut), summary="Attach an SSH key")  # fmt: skip
def cluster_key_attach(request, cluster_id: Id, payload: AttachKey):
    """`{"key": <id>}`: it logs in from its next login on, no restart (a running, pending
    or stopped cluster; not one released). Attached already: nothing changes."""
    cluster = fleet.cluster_to_use(_actor(request), cluster_id)
    key = _key_of(_actor(request).person, payload.key)
    cluster_services.ssh_key_attach(cluster=cluster, key=key)
    return _cluster_keys(cluster)


@api.delete("/clusters/{cluster_id}/ssh-keys/{key_id}", tags=["ssh keys"],
            response=_responses(200, ClusterKeysOut), summary="Detach an SSH key")  # fmt: skip
def cluster_key_detach(request, cluster_id: Id, key_id: Id):
    """Its next login is refused, and its open connections end within a minute. Not
    attached: nothing changes."""
    cluster = fleet.cluster_for_user(_actor(request), cluster_id)
    key = fleet.key_to_detach(_actor(request), cluster, key_id)
    cluster_services.ssh_key_detach(cluster=cluster, key=key)
    return _cluster_keys(cluster)


# -- jobs -------------------------------------------------------------------------------

_JOB_FIELDS = (
    "name", "command", "launcher", "workdir", "checkpoint_dir", "max_runtime_min", "retries",
    "preemption_script", "max_preemptions", "budget",
)  # fmt: skip


def _job_form_data(body: NewJob) -> dict:
    given = body.dict(exclude_none=True)
    data = {name: given[name] for name in _JOB_FIELDS if name in given}
    data.setdefault("workdir", "/workspace")
    data.setdefault("checkpoint_dir", "/workspace/checkpoints")
    data.setdefault("launcher", "plain")
    data.setdefault("retries", 0)
    data["env"] = _as_text(body.env)
    return data


class JobFilter(Schema):
    cluster: Id | None = Field(None, description="only this cluster's jobs")


@api.get("/jobs", tags=["jobs"], response=_responses(200, list[JobOut]), summary="Your jobs")
@paginate(Pages, items="jobs")
def jobs(request, filters: Query[JobFilter]):
    """Newest first, 50 a page; `?cluster=<id>` for one cluster's."""
    queryset = fleet.jobs_for(_actor(request))
    if filters.cluster:
        queryset = queryset.filter(cluster_id=filters.cluster)
    return queryset


@api.post("/jobs", tags=["jobs"], response=_responses(201, JobOut), summary="Submit a job")
def job_submit(request, payload: NewJob):
    """To one of your clusters; the same checks as the form."""
    target = fleet.cluster_to_use(_actor(request), payload.cluster)
    form = JobForm(_job_form_data(payload))
    if not form.is_valid():
        return _fields_error(form)
    with transaction.atomic():
        return Status(201, cluster_services.job_submit(cluster=target, spec=form.spec()))


@api.get("/jobs/{job_id}", tags=["jobs"], response=_responses(200, JobDetailOut), summary="A job")
def job(request, job_id: Id):
    """With its projection (finish time and final cost, from its own progress), the
    comparison with what it really took once it has ended, and its GPUs' energy."""
    return fleet.job_for_user(_actor(request), job_id)


@api.post(
    "/jobs/{job_id}/cancel", tags=["jobs"], response=_responses(200, JobOut), summary="Cancel a job"
)
def job_cancel(request, job_id: Id):
    j = fleet.job_to_cancel(_actor(request), job_id)
    with transaction.atomic():
        return cluster_services.job_cancel(job=j, by=_actor(request).person.username)


def _budget_set(subject, payload: BudgetBody, actor=None):
    """Set or clear (null) a budget: billing/budgets.py's rules and words; clearing or
    raising one needs who may change the cluster (views_budgets.require_lift)."""
    try:
        amount = budgets.parse(payload.budget)
        if actor is not None:
            views_budgets.require_lift(actor, subject, amount)
        budgets.set_budget(subject, amount)
    except ValidationError as exc:  # a bad amount (400), or it has ended (409): words
        status = 409 if getattr(exc, "code", None) == "ended" else 400
        return _error(status, " ".join(exc.messages), {"budget": exc.messages})
    return subject


@api.api_operation(
    ["PATCH", "POST"], "/jobs/{job_id}/budget", tags=["jobs"],
    response=_responses(200, JobOut), summary="Set or clear a job's budget",
)  # fmt: skip
def job_budget(request, job_id: Id, payload: BudgetBody):
    """`{"budget": "50.00"}`: stopped before its cost passes ¥50.00 (its preemption script,
    then SIGTERM and SIGKILL after the grace); `{"budget": null}`: no budget."""
    j = views_budgets.job_to_budget(_actor(request), job_id)
    return _budget_set(j, payload, _actor(request))


@api.api_operation(
    ["PATCH", "POST"], "/clusters/{cluster_id}/budget", tags=["clusters"],
    response=_responses(200, ClusterOut), summary="Set or clear a cluster's budget",
)  # fmt: skip
def cluster_budget(request, cluster_id: Id, payload: BudgetBody):
    """`{"budget": "50.00"}`: stopped, every file kept, before its charges pass ¥50.00;
    `{"budget": null}`: no budget."""
    c = fleet.cluster_to_use(_actor(request), cluster_id)
    return _budget_set(c, payload, _actor(request))


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
            raw = fleet.stored_log_lines(replica.log)
        elif replica.state == Replica.State.RUNNING:
            # Docker's `since` is inclusive and in float seconds: ask a second early, and
            # skip what was sent here.
            raw = exits.live_log_since(replica, at / 1e9 - 1 if at else None)
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


@api.get("/jobs/{job_id}/log", tags=["jobs"], response=_responses(200, Log), summary="A job's log")
def job_log(
    request,
    job_id: Id,
    since: str | None = Query(None, description="the `cursor` of an earlier answer"),
):
    """The current attempt's log; with `?since=<cursor>` (each answer's `cursor`) only the
    lines after that answer's, first the rest of an earlier attempt that the cursor was
    reading. `complete` once the job has ended and this is the last attempt's log."""
    j = fleet.job_for_user(_actor(request), job_id)
    attempt, positions = j.attempt, {}
    if since is not None:
        attempt, positions = _parse_cursor(since)
        if attempt > j.attempt:
            raise ValidationError("since is a cursor of another job.")
        if attempt < j.attempt and not j.replicas.filter(attempt=attempt).exists():
            attempt, positions = j.attempt, {}  # nothing of that attempt ever ran
    lines, after = _log_after(j, attempt, positions)
    cursor = f"{attempt}" + "".join(f"~{r}.{ns}.{n}" for r, (ns, n) in sorted(after.items()))
    if attempt < j.attempt:
        cursor = f"{attempt + 1}"  # the next answer starts the next attempt
    return {
        "job": j.pk, "state": j.state, "attempt": attempt, "exit_code": j.exit_code,
        "complete": j.is_ended and attempt == j.attempt, "lines": lines, "cursor": cursor,
    }  # fmt: skip


@api.get(
    "/jobs/{job_id}/profile",
    tags=["jobs"],
    response=_responses(200, ProfileOut),
    summary="A job's profiler traces, summarised",
)
def job_profile(request, job_id: Id):
    """The traces the job wrote to SUANLI_PROFILE_DIR, per attempt and rank, with their
    summaries (made by the worker: `pending` while some are on their way), the slowest rank
    and the advice of the job page's diagnosis."""
    j = fleet.job_for_user(_actor(request), job_id)
    profile = profiles.profile_of(j)
    return {
        "job": j.pk,
        "pending": profile.pending,
        "folders": [
            {"attempt": attempt, "path": path, "kept": kept}
            for attempt, path, kept in profile.folders
        ],
        "files": [_trace_file(j, f) for f in profile.files],
        "ranks": [_rank_out(r) for r in profile.ranks],
        "slowest": (
            {"rank": profile.slowest.rank, "cause": profile.slowest.cause}
            if profile.slowest
            else None
        ),
        "advice": [
            {"title": a.title, "text": a.text} for a in profiles.diagnosis(j, profile.ranks)
        ],
    }


@api.get(
    "/jobs/{job_id}/profile/{attempt}/{name}",
    tags=["jobs"],
    response=ERRORS,
    summary="One trace file of a job",
    url_name="job_profile_file",
)
def job_profile_file(request, job_id: Id, attempt: int, name: str):
    """The file as the job wrote it (JSON, or gzip for `.json.gz`)."""
    return trace_download(fleet.job_for_user(_actor(request), job_id), attempt, name)


def _trace_file(j: Job, f) -> dict:
    summary = f.summary or {}
    return {
        "attempt": f.attempt, "name": f.name, "rank": f.rank, "size": f.size,
        "steps": summary.get("steps") or [],
        "state": "pending" if f.pending else ("error" if f.error else "summarised"),
        "error": f.error or None, "source": summary.get("source"),
        "download": reverse("api:job_profile_file", args=[j.pk, f.attempt, f.name]),
    }  # fmt: skip


def _rank_out(r) -> dict:
    return {
        "rank": r.rank, "steps": r.steps, "step_ms": round(r.step_ms, 3),
        "split_ms": {k: round(v / 1000, 3) for k, v in r.split.items()},
        "overlap_pct": r.overlap_pct,
        "top": [
            {"name": op["name"], "kind": op["kind"], "self_ms": round(op["self_ms"], 3),
             "total_ms": round(op["total_ms"], 3), "calls": op["calls"]}
            for op in r.top
        ],
    }  # fmt: skip


# -- pools ------------------------------------------------------------------------------

_POOL_SHAPE = {
    "name", "gpu_model", "instance_type", "nodes", "gpus_per_node", "image", "network", "zone",
    "spot", "volumes", "pub",
}  # fmt: skip
POOL_EVENTS = 50


def _pool_form_data(body: NewPool, owner) -> dict:
    """The API's fields as the pool form's: the clusters' shape as the cluster API reads
    it, then the pool's own (counts, idle minutes, budgets)."""
    shape = body.dict(include=_POOL_SHAPE, exclude_none=True)
    data = _cluster_form_data(NewCluster(**shape), owner)
    defaults = {"min_clusters": 0, "max_clusters": 1, "idle_minutes": 10}
    for name, default in defaults.items():
        value = getattr(body, name)
        data[name] = default if value is None else value
    for name in ("budget_per_hour", "budget_total"):
        value = getattr(body, name)
        if value is not None:
            data[name] = str(value)
    return data


def _pool_of(user, pool_id: int):
    """The owner's pool with its counts (views_pools.pools_of); anyone else's is 404."""
    return get_object_or_404(views_pools.pools_of(user), pk=pool_id)


@api.get("/pools", tags=["pools"], response=_responses(200, list[PoolOut]), summary="Your pools")
@paginate(Pages, items="pools")
def pool_list(request):
    """Newest first, 50 a page, closed ones too."""
    return views_pools.pools_of(_actor(request))


@api.post("/pools", tags=["pools"], response=_responses(201, PoolOut), summary="Create a pool")
def pool_create(request, payload: NewPool):
    """The pool form's checks: the clusters' shape as a cluster's (the balance for one of
    them included), 0 <= min_clusters <= max_clusters, and a budget per hour that pays for
    at least one cluster (and for the minimum)."""
    actor = _actor(request)
    actor.require(Role.MEMBER)
    user = actor.principal
    form = PoolForm(_pool_form_data(payload, user), owner=actor)
    if not form.is_valid():
        return _fields_error(form, _cluster_names(payload))
    created = autoscaler.pool_create(
        owner=user, spec=form.spec(), rate_per_hour=form.rate_per_hour, created_by=actor.person
    )
    return Status(201, _pool_of(actor, created.pk))


@api.get(
    "/pools/{pool_id}", tags=["pools"], response=_responses(200, PoolDetailOut), summary="A pool"
)
def pool(request, pool_id: Id):
    """Its settings and money, the figures now, its live clusters, its waiting and running
    jobs, and the newest lines of its timeline."""
    p = console_pools.refresh(_pool_of(_actor(request), pool_id))
    clusters = list(
        p.clusters.filter(state__in=autoscaler.LIVE)
        .select_related("gpu_model", "instance_type")
        .order_by("created_at", "id")
    )
    f = autoscaler.figures_of(p, clusters)
    queue = views_pools.queue_of(p)
    p.live_clusters = clusters
    p.waiting_jobs, p.running_jobs = queue["waiting"], queue["running"]
    p.last_events = list(reversed(p.events.order_by("-at", "-id")[:POOL_EVENTS]))
    p.figures_now = {
        "waiting": f.waiting, "running": f.running, "clusters": f.clusters,
        "starting": f.starting, "ready": f.ready, "free": f.free, "finishing": f.finishing,
    }  # fmt: skip
    return p


@api.post(
    "/pools/{pool_id}/jobs",
    tags=["pools"],
    response=_responses(201, JobOut),
    summary="Submit a job",
)
def pool_job_submit(request, pool_id: Id, payload: JobBody):
    """The body of POST /jobs without `cluster`: the job waits in the pool's queue and runs
    on the first of its clusters to be free. 400 with the reason when the pool is closed
    or may not add the cluster it needs (its maximum, its budget)."""
    p = _pool_of(_actor(request), pool_id)
    _actor(request).require(Role.MEMBER)
    form = JobForm(_job_form_data(payload))
    if not form.is_valid():
        return _fields_error(form)
    return Status(201, console_pools.submit(pool=p, spec=form.spec(), by=_actor(request).person))


@api.post(
    "/pools/{pool_id}/close", tags=["pools"], response=_responses(200, PoolOut), summary="Close"
)
def pool_close(request, pool_id: Id):
    """No more jobs: its waiting jobs are cancelled, running ones finish, and its clusters
    are released as they turn idle."""
    p = _pool_of(_actor(request), pool_id)
    _actor(request).require_change(p)
    autoscaler.pool_close(pool=p)
    return _pool_of(_actor(request), p.pk)


# -- own images -------------------------------------------------------------------------


def _refused(exc: ValidationError) -> JsonResponse:
    """A refusal of jobs/images/builds.py: per field where it names one, the rest as the error."""
    if not hasattr(exc, "error_dict"):
        return _error(400, " ".join(exc.messages))
    fields = dict(exc.message_dict)
    general = fields.pop("__all__", [])
    return _error(400, " ".join(general) or "Invalid input.", fields)


@api.get("/images", tags=["images"], response=_responses(200, ImagesOut), summary="Your images")
def image_list(request):
    """Your own images (by name and tag), the clusters using each, and your quota."""
    user = _actor(request).principal
    own = list(fleet.own_images_for(user))
    for image in own:  # at most the quota's count
        image.using = list(builds.clusters_using(image).order_by("pk"))
    return {"images": own, "quota": builds.quota(user), "enabled": builds.enabled()}


@api.post(
    "/images/builds", tags=["images"], response=_responses(201, BuildOut), summary="Build an image"
)
def image_build_create(request, payload: NewBuild):
    """Queue a build of a Dockerfile (with one of your storage folders as its context);
    poll `GET /images/builds/{id}?after=<seq>` for its state and new log lines."""
    _actor(request).require(Role.MEMBER)
    try:
        build = builds.build_create(
            owner=_actor(request).principal, name=payload.name or "", tag=payload.tag or "latest",
            dockerfile=(payload.dockerfile or "").replace("\r\n", "\n"),
            context=payload.context or "", build_args=payload.build_args or {},
        )  # fmt: skip
    except ValidationError as exc:
        return _refused(exc)
    return Status(201, build)


class BuildLogFilter(Schema):
    after: int = Field(0, ge=0, le=2**62, description="only the log lines after this seq")


@api.get(
    "/images/builds/{build_id}",
    tags=["images"],
    response=_responses(200, BuildOut),
    summary="A build and its log",
)
def image_build(request, build_id: Id, filters: Query[BuildLogFilter]):
    """Its state, the step being run, the push progress, the error in words, the image
    once pushed, and its log lines numbered from 1 (`?after=<seq>`: only newer ones)."""
    build = fleet.build_for_user(_actor(request), build_id)
    build.lines = [(seq, text) for seq, text in builds.log_lines(build) if seq > filters.after]
    return build


# After /images/builds: "builds" would otherwise be taken for an image id (a 405).
@api.delete(
    "/images/{image_id}",
    tags=["images"],
    response={204: None, **ERRORS, 409: Error},
    summary="Delete an image",
)
def image_delete(request, image_id: Id):
    """From the registry and the list; 409, saying which, while a cluster that is not
    released uses it."""
    image = fleet.own_image_for_user(_actor(request), image_id)
    _actor(request).require_change(image)
    try:
        builds.delete(owner=_actor(request).principal, image=image)
    except ValidationError as exc:
        return _error(409, " ".join(exc.messages))
    return Status(204, None)


@api.post(
    "/clusters/{cluster_id}/nodes/{index}/save-image",
    tags=["images"],
    response=_responses(201, BuildOut),
    summary="Save a node's workspace as an image",
)
def node_save_image(request, cluster_id: Id, index: NodeIndex, payload: SaveImage):
    """A running or stopped cluster's node: its workspace committed and pushed as one of
    your images. Follow it as a build."""
    target = fleet.cluster_to_use(_actor(request), cluster_id)
    try:
        build = builds.save_create(
            owner=_actor(request).principal, cluster=target, node_index=index,
            name=payload.name or "", tag=payload.tag or "latest",
        )  # fmt: skip
    except ValidationError as exc:
        return _refused(exc)
    return Status(201, build)


# -- money ------------------------------------------------------------------------------


def _payer(request, role: str = Role.OWNER):
    """Whose money a call reads: the token's researcher's own, or, acting for a team, the
    team's: its balance to its admins and owner, its ledger and bill (every member's
    spending) to its owner alone (403, in words, below)."""
    actor = _actor(request)
    if actor.for_a_team:
        actor.require(role)
    return actor.principal


@api.get("/balance", tags=["money"], response=_responses(200, Balance), summary="Your balance")
def balance(request):
    """Balance, what runs now costs an hour, and the newest 50 ledger entries (acting for
    a team: its admins see its balance, its owner also the entries)."""
    user = _payer(request, Role.ADMIN)
    standing = money.standing(user)
    hours_left = standing.hours_left
    return {
        "currency": standing.currency,
        "balance": standing.balance,
        "burn_per_hour": standing.burn_per_hour,
        "hours_left": round(hours_left, 2) if hours_left is not None else None,
        "seconds_left": standing.seconds_left,
        "time_left": standing.time_left_text if hours_left is not None else None,
        "entries": list(money.entries_of(user)[:PAGE])
        if _actor(request).at_least(Role.OWNER)
        else [],
    }


def _warning_of(user) -> dict:
    own = money.Account.objects.filter(user=user).values_list("low_balance_hours", flat=True)
    hours, default = own.first(), money.warn_hours_default()
    return {
        "hours": hours, "default_hours": default,
        "in_force_hours": hours if hours is not None else default,
        "critical_minutes": int(money.CRITICAL_HOURS * 60),
    }  # fmt: skip


@api.get("/balance/warning", tags=["money"], response=_responses(200, BalanceWarningOut),
         summary="When you are warned that your balance runs low")  # fmt: skip
def balance_warning(request):
    """balance.low (and the pages' banner) when the balance lasts fewer hours than your
    threshold at the current burn; balance.critical under 30 minutes."""
    return _warning_of(_payer(request, Role.ADMIN))


@api.put("/balance/warning", tags=["money"], response=_responses(200, BalanceWarningOut),
         summary="Set when you are warned that your balance runs low")  # fmt: skip
def balance_warning_set(request, payload: BalanceWarning):
    """`{"hours": 3}`: warn when less than 3 hours are left at the current burn (0.5 to
    168); `{"hours": null}`: the operator's default again."""
    user = _payer(request)
    try:
        billing_services.set_low_balance_hours(user, payload.hours)
    except ValidationError as exc:
        return _error(400, " ".join(exc.messages), {"hours": exc.messages})
    return _warning_of(user)


def _page_of(queryset, page: int) -> tuple[list, dict]:
    count = queryset.count()
    start = (page - 1) * PAGE
    return list(queryset[start : start + PAGE]), {
        "page": page, "pages": max(1, math.ceil(count / PAGE)), "count": count,
    }  # fmt: skip


@api.get("/bill", tags=["money"], response=_responses(200, BillOut), summary="Your bill")
def bill(request, filters: Query[BillFilter]):
    """One UTC month's bill, newest first, 50 lines a page (`?page=`): usage summed per
    cluster and hour, every other entry a line of its own, each with the balance after it.
    `?kind=`, `?cluster=` narrow it; a line's pieces are at /bill/{id}/pieces."""
    user = _payer(request)
    now = timezone.now().astimezone(UTC)
    year, month = now.year, now.month
    if filters.month:
        year, month = (int(part) for part in filters.month.split("-"))
        if not 1 <= month <= 12 or not 2000 <= year <= 2200:
            words = "Give the month as YYYY-MM (a month from 2000-01 to 2200-12)."
            return _error(400, words, {"month": [words]})
    cluster_id = None
    if filters.cluster:
        cluster_id = fleet.cluster_for_user(_actor(request), filters.cluster).pk  # another's: 404
    lines, pages = _page_of(
        money.bill(user, year, month, kind=filters.kind or "", cluster_id=cluster_id),
        filters.page,
    )
    money.balances_after(user, lines)
    return {
        "currency": money.standing(user).currency, "month": f"{year:04}-{month:02}",
        "lines": lines, **pages,
    }  # fmt: skip


@api.get(
    "/bill/{line_id}/pieces",
    tags=["money"],
    response=_responses(200, PiecesOut),
    summary="The pieces of a bill line",
)
def bill_line_pieces(request, line_id: Id, filters: Query[PiecesFilter]):
    """The ledger entries one line sums (a usage hour's pieces, every few seconds), newest
    first, 50 a page; a line of another account is a 404."""
    user = _payer(request)
    line = money.bill_line_of(user, line_id)
    if line is None:
        raise Http404("No such bill line.")
    money.balances_after(user, [line])
    pieces, pages = _page_of(money.pieces_of(line), filters.page)
    return {"currency": money.standing(user).currency, "line": line, "pieces": pieces, **pages}


# -- sweeps (issue 26) ------------------------------------------------------------------

_SWEEP_DEFAULTS = {
    "name": "sweep", "workdir": "/workspace", "direction": Sweep.Direction.MINIMIZE, "trials": 20,
    "parallel": 1, "pruner": Sweep.Pruner.ASHA, "min_steps": 1,
}  # fmt: skip


def _sweeps_of(user):
    ended = ~Q(trial_set__state=Trial.State.RUNNING)
    complete = Q(trial_set__state=Trial.State.COMPLETE)
    return Sweep.objects.filter(owner=user).annotate(
        trials_done=Count("trial_set", filter=ended),
        best_min=Min("trial_set__last_value", filter=complete),
        best_max=Max("trial_set__last_value", filter=complete),
    )


def _sweep_detail(user, sweep_id: int) -> Sweep:
    """The sweep with its trials and what pruning saved (jobs/pools/sweeps.py `figures`)."""
    sweep = get_object_or_404(_sweeps_of(user).select_related("pool"), pk=sweep_id)
    fig = projections.sweep_figures(sweep)
    sweep.trial_list = [
        {
            "number": f.trial.number, "state": f.trial.state, "params": f.trial.params,
            "job": f.trial.job_id, "last_step": f.trial.last_step,
            "last_value": f.trial.last_value, "best_value": f.trial.best_value,
            "points": len(f.trial.curve), "seconds": round(f.seconds, 3), "cost": f.cost,
            "note": f.trial.note,
        }
        for f in fig.trials
    ]  # fmt: skip
    sweep.best_trial = fig.best.number if fig.best else None
    sweep.savings = {
        "unit": fig.unit_word, "units": fig.units, "full_steps": fig.full_steps,
        "pruned": sum(1 for f in fig.trials if f.trial.state == Trial.State.PRUNED),
        "used_unit_seconds": round(fig.used_unit_seconds, 3),
        "full_unit_seconds": round(fig.full_unit_seconds, 3),
        "saved_unit_seconds": round(fig.saved_unit_seconds, 3),
        "saved_share": round(fig.saved_share, 4), "used_cost": fig.used_cost,
        "saved_cost": fig.saved_cost, "currency": money.standing(user).currency,
    }  # fmt: skip
    return sweep


@api.get(
    "/sweeps", tags=["sweeps"], response=_responses(200, list[SweepOut]), summary="Your sweeps"
)
@paginate(Pages, items="sweeps")
def sweep_list(request):
    """Newest first, 50 a page."""
    return _sweeps_of(_actor(request).principal)


@api.post(
    "/sweeps", tags=["sweeps"], response=_responses(201, SweepDetailOut), summary="Start a sweep"
)
def sweep_create(request, payload: NewSweep):
    """On one of your active pools; the same checks as the form. Each trial prints
    `SUANLI_METRIC {"step": 100, "val_loss": 0.41}` lines and reads its parameters from
    `SUANLI_PARAM_<NAME>` or the JSON file at `$SUANLI_PARAMS_FILE`."""
    _actor(request).require(Role.MEMBER)
    user = _actor(request).principal
    pool = Pool.objects.filter(pk=payload.pool, owner=user).first()
    if pool is None:
        return _error(404, "No such pool.", {"pool": ["No such pool."]})
    if pool.state != Pool.State.ACTIVE:
        message = f"Pool {pool.name} is closed: it takes no more jobs."
        return _error(400, message, {"pool": [message]})
    given = payload.dict(exclude_none=True)
    data = {**_SWEEP_DEFAULTS, **{k: v for k, v in given.items() if k in SweepForm.base_fields}}
    data.update(pool=str(pool.pk), env=_as_text(payload.env), space=space_field_text(payload.space))
    form = SweepForm(data, owner=user)
    if not form.is_valid():
        fields = {name: [str(e) for e in errors] for name, errors in form.errors.items()}
        words = [e for errors in fields.values() for e in errors]
        return _error(400, " ".join(words) or "Invalid input.", fields)
    try:
        sweep = console_pools.sweep_create(
            owner=user, pool=pool, spec=form.spec(), created_by=_actor(request).person
        )
    except ValidationError as exc:
        return _error(400, " ".join(exc.messages), {"pool": exc.messages})
    return Status(201, _sweep_detail(user, sweep.pk))


@api.get(
    "/sweeps/{sweep_id}",
    tags=["sweeps"],
    response=_responses(200, SweepDetailOut),
    summary="A sweep",
)
def sweep(request, sweep_id: Id):
    """Its settings, its trials (parameters, state, last and best value, seconds, cost), its
    best trial, and what pruning saved against running every trial to the end."""
    return _sweep_detail(_actor(request).principal, sweep_id)


@api.post(
    "/sweeps/{sweep_id}/cancel",
    tags=["sweeps"],
    response=_responses(200, SweepDetailOut),
    summary="Cancel a sweep",
)
def sweep_cancel(request, sweep_id: Id):
    """Its running trials are cancelled (SIGTERM, then SIGKILL) and no new ones start; a
    sweep that has ended stays as it is."""
    s = _sweep_detail(_actor(request).principal, sweep_id)
    _actor(request).require_change(s)
    sweeps.sweep_cancel(sweep=s)
    return _sweep_detail(_actor(request).principal, sweep_id)


@api.api_operation(
    ["PATCH", "POST"], "/sweeps/{sweep_id}/budget", tags=["sweeps"],
    response=_responses(200, SweepDetailOut), summary="Set or clear a sweep's budget",
)  # fmt: skip
def sweep_budget(request, sweep_id: Id, payload: BudgetBody):
    """`{"budget": "50.00"}`: cancelled before its trials' cost passes ¥50.00, and no trial
    starts that would pass it; `{"budget": null}`: no budget."""
    s = _sweep_detail(_actor(request).principal, sweep_id)
    _actor(request).require_change(s)
    refused = _budget_set(s, payload)
    if isinstance(refused, JsonResponse):
        return refused
    return _sweep_detail(_actor(request).principal, sweep_id)


# -- GPU subscriptions ---------------------------------------------------------------------


def _subscription_of(user, subscription_id: int):
    """One of the user's subscriptions; another researcher's is 404, as one that does not
    exist."""
    try:
        return subscriptions.subscription_of(user, subscription_id)
    except GpuSubscription.DoesNotExist:
        raise Http404 from None


@api.get("/gpu-subscriptions", tags=["gpu subscriptions"],
         response=_responses(200, list[GpuSubscriptionOut]), summary="Your GPU subscriptions")  # fmt: skip
@paginate(Pages, items="gpu_subscriptions")
def gpu_subscriptions(request):
    """Newest first, 50 a page."""
    return subscriptions.subscriptions_of(_actor(request).principal)


@api.post("/gpu-subscriptions", tags=["gpu subscriptions"],
          response=_responses(201, GpuSubscriptionOut),
          summary="Be told when GPUs are free (and rent them)")  # fmt: skip
def gpu_subscription_add(request, payload: NewGpuSubscription):
    """The page's checks: a GPU model the hosts offer, a shape they could hold (in the
    zone), 1 to 720 hours, and to rent: the cluster's checks and a budget of 0 or more. It
    fires once, when the GPUs are free (`gpu.available`), or expires unnoticed."""
    actor = _actor(request)
    actor.require(Role.MEMBER)
    given = payload.dict(exclude_none=True)
    given["rent"] = bool(payload.rent)
    given["spot"] = bool(payload.spot)
    try:
        sub = subscriptions.subscribe(
            subscriptions.SubscriptionRequest(
                owner=actor.principal, created_by=actor.person, **given
            ),
            funds=partial(check_funds, actor),
        )
    except ValidationError as exc:
        return _refusals(exc.message_dict.items())
    return Status(201, subscriptions.subscription_of(actor.principal, sub.pk))


@api.delete("/gpu-subscriptions/{subscription_id}", tags=["gpu subscriptions"],
            response={204: None, **ERRORS}, summary="Cancel a GPU subscription")  # fmt: skip
def gpu_subscription_delete(request, subscription_id: Id):
    """A waiting one is cancelled (it never fires); one that fired or expired stays as it
    is."""
    sub = _subscription_of(_actor(request).principal, subscription_id)
    _actor(request).require(Role.MEMBER)
    subscriptions.cancel(sub)
    return Status(204, None)


# -- notification channels (the page "Notifications", console/views_webhooks.py) ------------

# The page's form names the address `url`.
_CHANNEL_NAMES = {"url": "address"}


def _channel_of(actor: Actor, channel_id: int) -> WebhookEndpoint:
    """One of the actor's channels; another researcher's is 404, as one that does not
    exist; a team's, below its admins, 403 (its robots' addresses are secrets)."""
    channel = get_object_or_404(WebhookEndpoint, pk=channel_id, owner=actor.principal)
    actor.require(Role.ADMIN)
    return channel


def _channel_refused(exc: ValidationError) -> JsonResponse:
    return _refusals(exc.message_dict.items(), _CHANNEL_NAMES)


@api.get("/notification-channels", tags=["notifications"],
         response=_responses(200, list[NotificationChannelOut]),
         summary="Your notification channels")  # fmt: skip
@paginate(Pages, items="notification_channels")
def notification_channels(request):
    """Webhooks, e-mail addresses and chat robots that events are sent to; newest first, 50
    a page."""
    _actor(request).require(Role.ADMIN)
    return WebhookEndpoint.objects.filter(owner=_actor(request).principal)


@api.post("/notification-channels", tags=["notifications"],
          response=_responses(201, NewNotificationChannelOut),
          summary="Add a notification channel")  # fmt: skip
def notification_channel_add(request, payload: NewNotificationChannel):
    """The page's checks and limits: a webhook or robot at an https URL on a public address,
    an e-mail address on the internet (one other than your account's is sent a confirmation
    link first, at most 3 an hour), events of the list, at most SUANLI_NOTIFY_CHANNELS_MAX
    channels. A webhook's signing secret is in this answer only."""
    _actor(request).require(Role.ADMIN)
    form = views_webhooks.EndpointForm(
        {
            "kind": payload.kind or "", "url": payload.address, "events": payload.events,
            "enabled": True if payload.enabled is None else payload.enabled,
            "secret": payload.secret or "",
        }
    )  # fmt: skip
    if not form.is_valid():
        return _fields_error(form, _CHANNEL_NAMES)
    try:
        channel, asked = views_webhooks.add_channel(_actor(request), form.cleaned_data)
    except ValidationError as exc:
        return _channel_refused(exc)
    channel.confirmation_sent = asked
    channel.secret_once = channel.secret if channel.kind == WebhookEndpoint.Kind.WEBHOOK else None
    return Status(201, channel)


@api.get("/notification-channels/{channel_id}", tags=["notifications"],
         response=_responses(200, NotificationChannelOut),
         summary="A notification channel")  # fmt: skip
def notification_channel(request, channel_id: Id):
    """Its kind, address, events, whether it is enabled, confirmed, signed, failing."""
    return _channel_of(_actor(request), channel_id)


@api.patch("/notification-channels/{channel_id}", tags=["notifications"],
           response=_responses(200, NotificationChannelOut),
           summary="Change a notification channel")  # fmt: skip
def notification_channel_change(request, channel_id: Id, payload: NotificationChannelChange):
    """Its address, events, enabled, a robot's secret; what is left out stays. Its kind is
    fixed. A new e-mail address is confirmed again; enabling a channel turned off for
    failing clears its failure."""
    channel = _channel_of(_actor(request), channel_id)
    if payload.kind is not None and payload.kind != channel.kind:
        words = f"A channel's kind is fixed ({channel.kind}): add a new channel for another."
        return _error(400, words, {"kind": [words]})
    form = views_webhooks.EndpointForm(
        {
            "url": channel.url if payload.address is None else payload.address,
            "events": channel.events if payload.events is None else payload.events,
            "enabled": channel.enabled if payload.enabled is None else payload.enabled,
            "secret": payload.secret or "",
        },
        kind=channel.kind,
    )
    if not form.is_valid():
        return _fields_error(form, _CHANNEL_NAMES)
    try:
        views_webhooks.save_channel(_actor(request), channel, form.cleaned_data)
    except ValidationError as exc:
        return _channel_refused(exc)
    return channel


@api.delete("/notification-channels/{channel_id}", tags=["notifications"],
            response={204: None, **ERRORS}, summary="Delete a notification channel")  # fmt: skip
def notification_channel_delete(request, channel_id: Id):
    """It gets nothing more; its delivery log goes with it."""
    _channel_of(_actor(request), channel_id).delete()
    return Status(204, None)


@api.post("/notification-channels/{channel_id}/test", tags=["notifications"],
          response=_responses(202, ChannelTestOut),
          summary="Send a test message")  # fmt: skip
def notification_channel_test(request, channel_id: Id):
    """The page's test button: a `webhook.test` event to the channel (at most 30 tests and
    redeliveries an hour); an e-mail address not confirmed yet is sent a new confirmation
    link instead (at most 3 an hour). Past a limit: 429."""
    channel = _channel_of(_actor(request), channel_id)
    try:
        asked = views_webhooks.send_channel_test(_actor(request), channel)
    except ValidationError as exc:
        return _error(429, " ".join(exc.messages))
    if asked:
        return Status(202, {"sent": "confirmation",
                            "message": views_webhooks.not_confirmed_words(channel)})  # fmt: skip
    return Status(202, {"sent": "test", "message": "A test event is on its way."})


@api.get("/notification-channels/{channel_id}/deliveries", tags=["notifications"],
         response=_responses(200, list[DeliveryOut]),
         summary="A notification channel's delivery log")  # fmt: skip
@paginate(Pages, items="deliveries")
def notification_channel_deliveries(request, channel_id: Id):
    """What was sent to it, newest first, 50 a page: the event, what happened in words,
    pending/delivered/failed, attempts and the last HTTP status."""
    channel = _channel_of(_actor(request), channel_id)
    return WebhookDelivery.objects.filter(endpoint=channel).select_related("event")


def not_found(request):
    return _error(404, "No such API path; see /api/v1/schema.")


def _token_id(raw: str) -> int | None:
    """A token's id as the page posts it: ASCII digits in the keys' range, else None
    ("²".isdigit() is true, and int() refuses it)."""
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        return None
    return int(raw)


def _tokens_page(request, status: int = 200, new_token: str | None = None):
    return render(
        request,
        "console/api_tokens.html",
        {
            "tokens": ApiToken.objects.filter(user=request.user).select_related("team"),
            "new_token": new_token,
        },
        status=status,
    )


@login_required
def tokens_page(request):
    token = None
    if request.method == "POST":
        if request.POST.get("action") == "revoke":
            pk = _token_id(request.POST.get("token", ""))
            if pk is None:
                messages.error(request, _("No such token: nothing was revoked."))
                return _tokens_page(request, status=400)
            row = get_object_or_404(ApiToken, pk=pk, user=request.user)
            ApiToken.objects.filter(pk=row.pk, revoked_at__isnull=True).update(
                revoked_at=timezone.now()
            )
            messages.success(request, f"Token {row.name} revoked: it stops working at once.")
            return redirect("api_tokens")
        name = request.POST.get("name", "").strip()
        if not name or len(name) > 60 or "\x00" in name:
            messages.error(request, "Name the token (at most 60 characters), e.g. ci-pipeline.")
            return _tokens_page(request, status=400)
        try:
            # Made for whom the person acts for now (a team's token acts for that team).
            _row, token = ApiToken.issue(user=request.user, name=name, team=request.actor.team)
        except ValidationError as exc:
            messages.error(request, " ".join(exc.messages))
            return _tokens_page(request, status=400)
    return _tokens_page(request, new_token=token)

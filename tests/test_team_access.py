"""Every console page, action and API endpoint of clusters, jobs, pools, sweeps, images,
storage, notification channels and GPU subscriptions, walked as each role of a team and as
outsiders (an attacker's notebook, table-driven so that it covers everything and stays
short):

- the role below the one an action needs gets 403, in words (it sees the thing);
- a member or viewer gets 404 for a team cluster they were not added to, and its jobs;
- a stranger, a removed member, the team's owner acting for herself, and the owner of
  another team get 404 for every one of the team's ids;
- the role that may, may (no 403, no 404);
- lists never mix a researcher's own things with a team's.

A new URL under one of these prefixes that is not in a table fails
`test_every_url_of_team_things_is_walked`."""

import base64
import hashlib
import json
import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from django.utils import timezone

from console.acting import SESSION_KEY
from console.models import ApiToken
from jobs.clusters import services
from jobs.clusters.services import ClusterSpec
from jobs.models import (
    GpuSubscription,
    Image,
    ImageBuild,
    Job,
    OwnImage,
    Team,
    TeamMember,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
)  # fmt: skip
from jobs.nodes import registry
from jobs.pools import autoscaler, sweeps
from jobs.teams import services as teams
from jobs.tenancy.actors import Actor
from tests.conftest import TEST_IMAGE

Role = TeamMember.Role
V, M, A, OWN = Role.VIEWER, Role.MEMBER, Role.ADMIN, Role.OWNER
ROLES = {V: "vi", M: "mo", A: "ada", OWN: "alice"}  # each role's person in the lab
pytestmark = pytest.mark.django_db

ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI{}"

# -- the tables: (method, URL name or API path, {argument: thing}, the least role) ----------
# A thing is a name in `_things`: "mine" a cluster member mo made (viewer vi added), "theirs"
# one admin ada made with mo and vi added, "hidden" one ada made that nobody was added to.

C, T, H = {"cluster_id": "mine"}, {"cluster_id": "theirs"}, {"cluster_id": "hidden"}
NODE = {**C, "index": 0}
APP = {**NODE, "kind": "jupyter"}
JOB = {"job_id": "job"}
POOL = {"pool_id": "pool"}
SWEEP = {"sweep_id": "sweep"}
HOOK = {"endpoint_id": "endpoint"}

PAGES = [
    ("GET", "cluster_list", {}, V), ("GET", "cluster_new", {}, M), ("POST", "cluster_new", {}, M),
    ("GET", "cluster_detail", C, V), ("GET", "cluster_status", C, V), ("GET", "cluster_cost", C, V),
    ("POST", "cluster_stop", C, M), ("POST", "cluster_start", C, M),
    ("POST", "cluster_budget", C, M),
    ("POST", "cluster_shutdown", C, M), ("POST", "cluster_shutdown_clear", C, M),
    ("POST", "cluster_key_attach", C, M),
    ("POST", "cluster_key_detach", {**T, "key_id": "ada_key"}, A),
    ("POST", "cluster_resize", T, A), ("POST", "cluster_release", T, A),
    ("POST", "cluster_resize", C, M), ("POST", "cluster_release", C, M),
    ("GET", "job_new", C, M), ("POST", "job_new", C, M),
    ("GET", "node_terminal", NODE, M), ("POST", "node_save_image", NODE, M),
    ("GET", "app_status", NODE, V), ("POST", "app_start", APP, M), ("POST", "app_stop", APP, M),
    ("GET", "app_open", APP, M),
    ("GET", "job_detail", JOB, V), ("GET", "job_status", JOB, V), ("GET", "job_log", JOB, V),
    ("GET", "job_metrics", JOB, V), ("GET", "job_profile", JOB, V),
    ("GET", "job_profile_file", {**JOB, "attempt": 1, "name": "trace.json"}, V),
    ("POST", "job_cancel", JOB, M), ("POST", "job_budget", JOB, M),
    ("GET", "pool_list", {}, V), ("GET", "pool_new", {}, M), ("POST", "pool_new", {}, M),
    ("GET", "pool_detail", POOL, V), ("GET", "pool_status", POOL, V),
    ("GET", "pool_samples", POOL, V), ("POST", "pool_job_new", POOL, M),
    ("POST", "pool_close", {"pool_id": "pool_mo"}, M), ("POST", "pool_close", POOL, A),
    ("GET", "sweep_list", {}, V), ("GET", "sweep_new", {}, M), ("POST", "sweep_new", {}, M),
    ("GET", "sweep_detail", SWEEP, V), ("GET", "sweep_live", SWEEP, V),
    ("GET", "sweep_data", SWEEP, V), ("POST", "sweep_cancel", {"sweep_id": "sweep_mo"}, M),
    ("POST", "sweep_cancel", SWEEP, A),
    ("POST", "sweep_budget", {"sweep_id": "sweep_mo"}, M), ("POST", "sweep_budget", SWEEP, A),
    ("GET", "image_list", {}, V), ("POST", "image_list", {}, M),
    ("GET", "image_build", {"build_id": "build"}, V),
    ("POST", "image_delete", {"image_id": "image"}, A),
    ("GET", "storage", {}, V), ("POST", "storage", {}, A),
    ("GET", "gpu_subscriptions", {}, V), ("POST", "gpu_subscriptions", {}, M),
    ("POST", "gpu_subscription_cancel", {"subscription_id": "subscription"}, M),
    ("GET", "webhooks", {}, A), ("POST", "webhooks", {}, A),
    ("GET", "webhook_detail", HOOK, A), ("POST", "webhook_detail", HOOK, A),
    ("POST", "webhook_test", HOOK, A), ("POST", "webhook_rotate", HOOK, A),
    ("POST", "webhook_redeliver", {"delivery_id": "delivery"}, A),
    ("POST", "webhook_delete", HOOK, A),
]  # fmt: skip

API = [
    ("GET", "/clusters", {}, V), ("POST", "/clusters", {}, M),
    ("GET", "/clusters/{mine}", {}, V), ("GET", "/clusters/{mine}/ssh-keys", {}, V),
    ("POST", "/clusters/{mine}/stop", {}, M), ("POST", "/clusters/{mine}/start", {}, M),
    ("PATCH", "/clusters/{mine}/budget", {"budget": "50"}, M),
    ("POST", "/clusters/{mine}/shutdown", {"stop_idle_minutes": None}, M),
    ("DELETE", "/clusters/{mine}/shutdown", {}, M),
    ("POST", "/clusters/{mine}/ssh-keys", {"key": "own_key"}, M),
    ("DELETE", "/clusters/{theirs}/ssh-keys/{ada_key}", {}, A),
    ("POST", "/clusters/{theirs}/resize", {"nodes": 1}, A),
    ("POST", "/clusters/{theirs}/release", {}, A),
    ("POST", "/clusters/{mine}/resize", {"nodes": 1}, M),
    ("POST", "/clusters/{mine}/release", {}, M),
    ("POST", "/clusters/{mine}/nodes/{index}/save-image", {"name": "saved"}, M),
    ("GET", "/jobs", {}, V), ("POST", "/jobs", {"cluster": "mine"}, M),
    ("GET", "/jobs/{job}", {}, V), ("GET", "/jobs/{job}/log", {}, V),
    ("GET", "/jobs/{job}/profile", {}, V), ("GET", "/jobs/{job}/profile/{attempt}/{name}", {}, V),
    ("POST", "/jobs/{job}/cancel", {}, M), ("PATCH", "/jobs/{job}/budget", {"budget": "50"}, M),
    ("GET", "/pools", {}, V), ("POST", "/pools", {}, M), ("GET", "/pools/{pool}", {}, V),
    ("POST", "/pools/{pool}/jobs", {}, M), ("POST", "/pools/{pool_mo}/close", {}, M),
    ("POST", "/pools/{pool}/close", {}, A),
    ("GET", "/images", {}, V), ("POST", "/images/builds", {}, M),
    ("GET", "/images/builds/{build}", {}, V), ("DELETE", "/images/{image}", {}, A),
    ("GET", "/sweeps", {}, V), ("POST", "/sweeps", {"pool": "pool"}, M),
    ("GET", "/sweeps/{sweep}", {}, V), ("POST", "/sweeps/{sweep_mo}/cancel", {}, M),
    ("POST", "/sweeps/{sweep}/cancel", {}, A),
    ("PATCH", "/sweeps/{sweep_mo}/budget", {"budget": "50"}, M),
    ("PATCH", "/sweeps/{sweep}/budget", {"budget": "50"}, A),
    ("GET", "/gpu-subscriptions", {}, V), ("POST", "/gpu-subscriptions", {}, M),
    ("DELETE", "/gpu-subscriptions/{subscription}", {}, M),
    ("GET", "/notification-channels", {}, A), ("POST", "/notification-channels", {}, A),
    ("GET", "/notification-channels/{endpoint}", {}, A),
    ("PATCH", "/notification-channels/{endpoint}", {"enabled": True}, A),
    ("POST", "/notification-channels/{endpoint}/test", {}, A),
    ("GET", "/notification-channels/{endpoint}/deliveries", {}, A),
    ("DELETE", "/notification-channels/{endpoint}", {}, A),
]  # fmt: skip

# What each API call's body holds beyond the table's (valid in shape, so that a refusal is
# the role's and not the schema's).
API_BODIES = {
    "/clusters": {"name": "lab-new", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
                  "image": TEST_IMAGE},
    "/jobs": {"name": "j2", "command": "true"},
    "/pools": {"name": "lab-pool-2", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
               "image": TEST_IMAGE},
    "/pools/{pool}/jobs": {"name": "j3", "command": "true"},
    "/images/builds": {"name": "built", "dockerfile": "FROM suanli/busybox:latest\n"},
    "/sweeps": {"command": "true", "space": "x: uniform 0 1", "metric": "loss"},
    "/gpu-subscriptions": {"gpu_model": "a100-80gb", "gpus_per_node": 1},
    "/notification-channels": {"kind": "webhook", "address": "https://hooks.example.com/n",
                               "events": ["job.succeeded"]},
}  # fmt: skip

# Removed by the least role that may: the roles above find it gone (404).
GONE = {
    ("POST", "webhook_delete"), ("DELETE", "/notification-channels/{endpoint}"),
    ("POST", "cluster_key_detach"), ("DELETE", "/clusters/{theirs}/ssh-keys/{ada_key}"),
    ("POST", "image_delete"), ("DELETE", "/images/{image}"),
}  # fmt: skip

# URLs under the walked prefixes that other tests own, and why.
ELSEWHERE = {
    "cluster_person_add": "the cluster's people card (tests of the team pages)",
    "cluster_person_remove": "the cluster's people card (tests of the team pages)",
    "notify_confirm": "an e-mailed link with its own token, no login",
}
API_ELSEWHERE = (
    "/teams",  # the team endpoints' own tests
    "/ssh-keys",  # personal: a person's keys, whoever they act for
    "/balance", "/bill",  # money: the billing tests
    "/schema", "/docs", "/",
)  # fmt: skip
WALKED = ("clusters/", "jobs/", "pools/", "sweeps/", "images/", "storage/", "webhooks/",
          "gpu-subscriptions/", "api/v1/")  # fmt: skip


# -- the world ---------------------------------------------------------------------------------


def person(login):
    return get_user_model().objects.create_user(login, password=f"{login}-pass-123")


def _own_image(owner, name) -> OwnImage:
    reference = registry.reference(owner.pk, name, "v1")
    digest = "sha256:" + hashlib.sha256(reference.encode()).hexdigest()
    return OwnImage.objects.create(
        owner=owner, name=name, tag="v1", reference=reference, digest=digest,
        size_bytes=1000, layers=[[digest, 1000]],
    )  # fmt: skip


def _pool(catalog, owner, name, made_by):
    shape = ClusterSpec(
        name="", nodes=1, gpu_model=catalog["a100-80gb"], gpus_per_node=1,
        image=Image.objects.get(reference=TEST_IMAGE),
    )  # fmt: skip
    spec = autoscaler.PoolSpec(name=name, cluster=shape)
    return autoscaler.pool_create(owner=owner, spec=spec, created_by=made_by)


def _things(catalog, make_cluster, owner, prefix, *, mo=None, vi=None, ada=None) -> dict:
    """One of each thing, owned by `owner` (a team's principal, or a researcher), named
    with `prefix`; a team's clusters made by its member mo and admin ada."""
    ada, mo = ada or owner, mo or owner
    mine = make_cluster(owner, f"{prefix}-mine", created_by=mo)
    theirs = make_cluster(owner, f"{prefix}-theirs", created_by=ada)
    hidden = make_cluster(owner, f"{prefix}-hidden", created_by=ada)
    for cluster, people in ((mine, [vi]), (theirs, [mo, vi])):
        cluster.members.add(*[p for p in people if p is not None and p != owner])
    pool = _pool(catalog, owner, f"{prefix}-pool", ada)
    spec = sweeps.SweepSpec(
        name=f"{prefix}-sweep", command="true", space=sweeps.parse_space("x: uniform 0 1"),
        metric="loss", trials=2, parallel=1,
    )  # fmt: skip
    endpoint = WebhookEndpoint.objects.create(
        owner=owner, url=f"https://hooks.example.com/{prefix}-hook", events=["job.succeeded"]
    )
    event = WebhookEvent.objects.create(owner=owner, uid=f"{prefix}-e1", type="job.succeeded",
                                        body="{}")  # fmt: skip
    ada_key = services.ssh_key_add(owner=ada, name=f"{prefix}-k", public_key=_key(ada, prefix))
    services.ssh_key_attach(cluster=theirs, key=ada_key)
    return {
        "mine": mine, "theirs": theirs, "hidden": hidden, "pool": pool,
        "pool_mo": _pool(catalog, owner, f"{prefix}-pool-mo", mo),
        "sweep": sweeps.sweep_create(owner=owner, pool=pool, spec=spec, created_by=ada),
        "sweep_mo": sweeps.sweep_create(owner=owner, pool=pool, spec=spec, created_by=mo),
        "job": Job.objects.create(cluster=mine, owner=owner, name=f"{prefix}-j", command="true"),
        "hidden_job": Job.objects.create(cluster=hidden, owner=owner, name="h", command="true"),
        "image": _own_image(owner, f"{prefix}-img"),
        "build": ImageBuild.objects.create(owner=owner, name=f"{prefix}-b", tag="v1",
                                           dockerfile="FROM x\n"),  # fmt: skip
        "endpoint": endpoint,
        "delivery": WebhookDelivery.objects.create(event=event, endpoint=endpoint),
        "subscription": GpuSubscription.objects.create(
            owner=owner, gpu_model=catalog["a100-80gb"], gpus_per_node=1,
            expires_at=timezone.now() + timedelta(hours=1),
        ),
        "ada_key": ada_key,
    }  # fmt: skip


def _key(user, salt: str = "") -> str:
    """A distinct, well-formed ed25519 key per person (32 bytes of key from the login)."""
    raw = hashlib.sha256((user.username + salt).encode()).digest()
    blob = b"\x00\x00\x00\x0bssh-ed25519\x00\x00\x00\x20" + raw
    return f"ssh-ed25519 {base64.b64encode(blob).decode()} {user.username}@laptop"


@pytest.fixture
def world(alice, bob, catalog, make_cluster, settings):
    """Alice's lab (alice owner, ada admin, mo member, vi viewer; rex was a member and was
    removed), one of each of its things, alice's own, and bob's team's."""
    settings.SUANLI_REGISTRY = ""  # builds off: a build or save asked for is refused in words
    lab = teams.team_create(person=alice, name="张老师课题组")
    owner = Actor.for_team(alice, lab.pk)
    people = {"alice": alice, "bob": bob}
    for login, role in (("ada", A), ("mo", M), ("vi", V), ("rex", M)):
        people[login] = person(login)
        invite, _ = teams.invite_create(actor=owner, role=role, login=login)
        teams.invite_accept(person=people[login], invite=invite)
    for login in ("mo", "vi", "ada", "alice", "bob", "rex"):
        services.ssh_key_add(owner=people[login], name="laptop", public_key=_key(people[login]))
    things = _things(catalog, make_cluster, lab.principal, "lab", mo=people["mo"],
                     vi=people["vi"], ada=people["ada"])  # fmt: skip
    things["mine"].members.add(people["rex"])
    _, rex_token = ApiToken.issue(user=people["rex"], name="lab", team=lab)
    rex = TeamMember.objects.get(team=lab, person=people["rex"])
    teams.member_remove(actor=owner, member=rex, clusters=teams.HAND)
    other = teams.team_create(person=bob, name="Other lab")
    return {
        "lab": lab, "people": people, "things": things,
        "solo": _things(catalog, make_cluster, alice, "solo"),
        "other": _things(catalog, make_cluster, other.principal, "other", ada=bob),
        "other_team": other, "rex_token": rex_token,
    }  # fmt: skip


def page_client(world, user, team: Team | None) -> Client:
    client = Client(raise_request_exception=False)
    client.force_login(user)
    if team is not None:
        session = client.session
        session[SESSION_KEY] = team.pk
        session.save()
    return client


def api_client(world, user, team: Team | None) -> Client:
    """A token of the person's, for the team (a removed member's: a personal one, as a
    team's token is refused once they left: test_a_removed_members_team_token_is_refused)."""
    if team is not None and not TeamMember.objects.filter(team=team, person=user).exists():
        team = None
    tokens = world.setdefault("tokens", {})  # one a person and team: 20 at most
    key = (user.pk, team.pk if team else None)
    if key not in tokens:
        tokens[key] = ApiToken.issue(user=user, name="script", team=team)[1]
    token = tokens[key]
    return Client(HTTP_AUTHORIZATION=f"Bearer {token}", raise_request_exception=False)


def _page_url(name, args, things) -> str:
    kwargs = {k: (things[v].pk if v in things else v) for k, v in args.items()}
    return reverse(name, kwargs=kwargs)


def _page_data(name, who) -> dict:
    """What a form posts: the person's own key to attach, a node count, nothing else."""
    if name == "cluster_key_attach":
        return {"key": who.ssh_keys.get(name="laptop").pk}
    if name.endswith("_budget"):
        return {"budget": "50"}
    return {"nodes": 1} if name == "cluster_resize" else {}


def _call_page(client, method, name, args, things, who):
    url = _page_url(name, args, things)
    if method == "GET":
        return client.get(url)
    return client.post(url, _page_data(name, who))


def _api_path(path, things) -> str:
    fixed = {"index": 0, "attempt": 1, "name": "trace.json"}
    return "/api/v1" + path.format(**fixed, **{k: v.pk for k, v in things.items()})


def _api_body(path, extra, things, who) -> dict:
    body = {**API_BODIES.get(path, {}), **extra}
    for field in ("cluster", "pool"):
        if isinstance(body.get(field), str):
            body[field] = things[body[field]].pk
    if body.get("key") == "own_key":
        body["key"] = who.ssh_keys.get(name="laptop").pk
    return body


def _call_api(client, method, path, extra, things, who):
    url = _api_path(path, things)
    if method == "GET":
        return client.get(url)
    body = json.dumps(_api_body(path, extra, things, who))
    return client.generic(method, url, body, content_type="application/json")


def _walk(world, call, row, *, make):
    """Each role from the viewer up: below the row's role 403 (with words), from it on
    neither 403 nor 404 (a refusal of the thing's state, a 400 or a redirect, is fine)."""
    method, target, args, least = row
    things, lab = world["things"], world["lab"]
    for role in (V, M, A, OWN):
        who = world["people"][ROLES[role]]
        answer = call(make(world, who, lab), method, target, args, things, who)
        said = f"{method} {target} as {role}: {answer.status_code}"
        if TeamMember.RANK[role] < TeamMember.RANK[least]:
            assert answer.status_code == 403, said
            assert b"this needs" in answer.content, said
        elif target.endswith(("profile_file", "{name}")):  # no such file: 404 alike
            assert answer.status_code != 403, said
        elif role == least or (method, target) not in GONE:  # the first one removed it
            assert answer.status_code not in (403, 404), said + answer.content.decode()[:300]


def _outsiders(world, call, row, *, make):
    """A thing's URL, for whoever may not see it: 404 alike."""
    method, target, args, _least = row
    people, things, lab = world["people"], world["things"], world["lab"]
    tries = [
        (people["bob"], None, things),  # a stranger
        (people["bob"], world["other_team"], things),  # another team's owner, for it
        (people["rex"], lab, things),  # removed from the lab (the browser still says it)
        (people["alice"], None, things),  # the lab's owner, acting for herself
        (people["alice"], lab, world["other"]),  # another team's ids, guessed
        (people["alice"], lab, world["solo"]),  # her own things, while acting for the lab
    ]
    named = {*[str(v) for v in args.values()], *re.findall(r"{(\w+)}", target)}
    if named & {"mine", "theirs", "job"}:  # a cluster nobody added mo and vi to
        unseen = {**things, "mine": things["hidden"], "theirs": things["hidden"],
                  "job": things["hidden_job"]}  # fmt: skip
        tries += [(people["vi"], lab, unseen), (people["mo"], lab, unseen)]
    for who, team, where in tries:
        answer = call(make(world, who, team), method, target, args, where, who)
        said = f"{method} {target} as {who} for {team}: {answer.status_code}"
        assert answer.status_code == 404, said


def _has_thing(row) -> bool:
    _method, target, args, _least = row
    return bool(args) or "{" in target


def _section(row) -> str:
    """Rows of one kind of thing share one world (walked in the table's order)."""
    _method, target, _args, _least = row
    return target.split("/")[1] if target.startswith("/") else target.split("_")[0].rstrip("s")


def _rows(table, section):
    return [row for row in table if _section(row) == section]


@pytest.mark.parametrize("section", sorted({_section(row) for row in PAGES}))
def test_each_page_answers_each_role(world, section):
    for row in _rows(PAGES, section):
        _walk(world, _call_page, row, make=page_client)
        if _has_thing(row):
            _outsiders(world, _call_page, row, make=page_client)


@pytest.mark.parametrize("section", sorted({_section(row) for row in API}))
def test_each_api_call_answers_each_role(world, section):
    for row in _rows(API, section):
        _walk(world, _call_api, row, make=api_client)
        if _has_thing(row):
            _outsiders(world, _call_api, row, make=api_client)


def test_a_removed_members_team_token_is_refused(world):
    client = Client(HTTP_AUTHORIZATION=f"Bearer {world['rex_token']}")
    for path in ("/clusters", f"/clusters/{world['things']['mine'].pk}", "/pools", "/images"):
        assert client.get("/api/v1" + path).status_code == 401


def _routes(patterns, prefix=""):
    for p in patterns:
        if isinstance(p, URLResolver):
            yield from _routes(p.url_patterns, prefix + str(p.pattern))
        elif isinstance(p, URLPattern):
            yield prefix + str(p.pattern), p.name


def test_every_url_of_team_things_is_walked():
    """A page or API path added under a walked prefix must join a table (or ELSEWHERE)."""
    pages = {name for _m, name, _a, _r in PAGES} | set(ELSEWHERE)
    api = {re.sub(r"{\w+}", "{}", path) for _m, path, _a, _r in API}
    missed = []
    for route, name in _routes(get_resolver().url_patterns):
        if not route.startswith(WALKED):
            continue
        if route.startswith("api/v1/"):
            path = "/" + route.removeprefix("api/v1/")
            path = re.sub(r"<(\w+:)?\w+>", "{}", path)
            if path.startswith(API_ELSEWHERE[:-1]) or path in API_ELSEWHERE or "^" in path:
                continue
            if path not in api:
                missed.append(route)
        elif name not in pages:
            missed.append(route)
    assert missed == []


LISTS = ["cluster_list", "pool_list", "sweep_list", "image_list", "gpu_subscriptions", "webhooks"]
API_LISTS = ["/clusters", "/jobs", "/pools", "/sweeps", "/images", "/notification-channels"]


def test_lists_never_mix_a_researchers_own_things_with_a_teams(world):
    """Alice acting for herself sees her own things and none of her lab's; acting for the
    lab, the lab's and none of her own (names: solo-... and lab-...)."""
    alice, lab = world["people"]["alice"], world["lab"]
    for team, shown, hidden in ((None, "solo-", "lab-"), (lab, "lab-", "solo-")):
        pages, api = page_client(world, alice, team), api_client(world, alice, team)
        for name in LISTS:
            text = pages.get(reverse(name)).content.decode()
            assert hidden not in text and (name == "gpu_subscriptions" or shown in text), name
        for path in API_LISTS:
            text = api.get("/api/v1" + path).content.decode()
            assert hidden not in text and shown in text, path
    member = page_client(world, world["people"]["mo"], lab).get("/clusters/").content.decode()
    assert "lab-mine" in member and "lab-theirs" in member and "lab-hidden" not in member

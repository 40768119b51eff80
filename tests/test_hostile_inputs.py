"""No input gives a 500 (issue 37). A researcher's notebook of hostile inputs: digits that
are not numbers ("²".isdigit() is true, int("²") raises), ids beyond 64 bits, bodies over
the size limit, text where numbers go, lists where text goes. Every form a researcher
posts and every API body is answered below 500, each refusal with a sentence; the named
findings are pinned as tests of their own. Hypothesis draws the rest, a bounded number of
examples a form (the whole file runs in well under a minute)."""

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import requests
from axes.models import AccessAttempt
from browsing import free_port
from django.conf import settings as django_settings
from django.core import mail
from django.test import Client
from django.urls import path
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from waiting import until

from console.models import ApiToken
from jobs.clusters import services
from jobs.clusters.services import ClusterSpec
from jobs.models import Cluster, Image, Pool, SshKey
from jobs.pools import autoscaler
from tests.conftest import TEST_IMAGE
from tests.forms_data import cluster_form

pytestmark = pytest.mark.django_db
ROOT = Path(__file__).resolve().parent.parent

ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl a@b"

# Values a researcher can type or send that have given 500s in consoles like this one.
HOSTILE_TEXT = [
    "²", "³", "٣", "①", "Ⅻ", "𝟗", "1_000", " 1 ", "+1", "-0", "0x10", "1e3", "1e400",
    "NaN", "-Infinity", "18446744073709551616", "9223372036854775808", "-9223372036854775809",
    "2147483648", "-2147483649", "9" * 60, "0." + "0" * 40 + "1", "1" * 30 + ".5",
    "", " ", "\t", "\x00", "a\x00b", "%00", "../../etc/passwd", "<script>", "'; --",
    "http://127.0.0.1:8000/", "file:///etc/passwd", "x" * 3000, "localhost:²/x:v1",
    "registry.example.com:³/team/x", "[::1]:①/x",
]  # fmt: skip
HOSTILE_JSON = [
    "\ud800", 2**64, -(2**64), 2**63, -(2**63) - 1, 2**31, -(2**31) - 1, 2**53 + 1, 10**400, -1, 0,
    1e308, -0.0, 0.5, True, False, None, [], {}, [2**64], [-1], ["²"], [None], [[1]],
    {"a": 2**64}, {"": ""}, "²", "18446744073709551616", "", "x" * 3000,
]  # fmt: skip

form_value = st.one_of(st.sampled_from(HOSTILE_TEXT), st.text(max_size=20))
json_value = st.one_of(
    st.sampled_from(HOSTILE_JSON),
    st.sampled_from(HOSTILE_TEXT),
    st.integers(),
    st.text(max_size=12),
    st.lists(st.one_of(st.integers(), st.text(max_size=5)), max_size=3),
)


def examples(count: int):
    """A bounded run for CI (SUANLI_FUZZ_SCALE scales it for a longer hunt), no
    example database written into the checkout."""
    scale = float(os.environ.get("SUANLI_FUZZ_SCALE", "1"))
    return hsettings(
        max_examples=max(1, int(count * scale)),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


@pytest.fixture
def world(catalog, priced, alice, paper_host, storage_root):
    """Alice logged in with a token, a cluster, a pool, a key and a webhook of hers: the
    objects the forms and bodies name."""
    from jobs.models import WebhookEndpoint

    cluster = services.cluster_create(
        owner=alice,
        spec=ClusterSpec(
            name="mine", nodes=1, gpu_model=catalog["a100-80gb"], gpus_per_node=1,
            image=Image.objects.get(reference=TEST_IMAGE), volumes=(), release_policy="never",
        ),
    )  # fmt: skip
    pool = autoscaler.pool_create(
        owner=alice,
        spec=autoscaler.PoolSpec(
            name="train",
            cluster=ClusterSpec(
                name="", nodes=1, gpu_model=catalog["a100-80gb"], gpus_per_node=1,
                image=Image.objects.get(reference=TEST_IMAGE),
            ),
        ),
    )  # fmt: skip
    key = services.ssh_key_add(owner=alice, name="laptop", public_key=ED25519)
    hook = WebhookEndpoint.objects.create(
        owner=alice, url="https://hooks.example.com/x", events=["job.succeeded"]
    )
    page = Client(raise_request_exception=True)
    page.force_login(alice)
    _, token = ApiToken.issue(user=alice, name="fuzz")
    return {
        "page": page, "token": token, "cluster": cluster.pk, "pool": pool.pk, "key": key.pk,
        "hook": hook.pk,
    }  # fmt: skip


def _forms(w) -> dict[str, tuple[str, dict, set[str]]]:
    """Each form a researcher posts: its URL, a filled-in post, and its multi-valued fields."""
    image = str(Image.objects.get(reference=TEST_IMAGE).pk)
    cluster = {
        **cluster_form(image=image), "ssh_keys": [str(w["key"])], "workspace": "on", "spot": "",
    }  # fmt: skip
    pool = {
        **cluster_form(image=image), "min_clusters": "0", "max_clusters": "1",
        "idle_minutes": "10", "budget_per_hour": "", "budget_total": "",
    }  # fmt: skip
    job = {
        "name": "train", "command": "true", "launcher": "plain", "env": "A=1",
        "workdir": "/workspace", "checkpoint_dir": "/workspace/checkpoints",
        "max_runtime_min": "", "retries": "0", "preemption_script": "", "max_preemptions": "5",
    }  # fmt: skip
    sweep = {
        "name": "s", "pool": str(w["pool"]), "command": "python t.py", "env": "",
        "workdir": "/workspace", "space": "lr: log_uniform 0.0001 0.1", "metric": "val_loss",
        "direction": "minimize", "trials": "2", "parallel": "1", "pruner": "asha",
        "min_steps": "1",
    }  # fmt: skip
    hook = {"url": "https://hooks.example.com/y", "events": ["job.failed"], "enabled": "on"}
    build = {"name": "img", "tag": "v1", "dockerfile": f"FROM {TEST_IMAGE}\n", "context": "",
             "build_args": ""}  # fmt: skip
    c = w["cluster"]
    return {
        "cluster": ("/clusters/new/", cluster, {"ssh_keys"}),
        "custom image": (
            "/clusters/new/",
            {**cluster, "image": "custom", "custom_image": TEST_IMAGE},
            set(),
        ),
        "job": (f"/clusters/{c}/jobs/new/", job, set()),
        "resize": (f"/clusters/{c}/resize/", {"nodes": "1"}, set()),
        "start": (f"/clusters/{c}/start/", {"mode": "gpu"}, set()),
        "pool": ("/pools/new/", pool, set()),
        "pool job": (f"/pools/{w['pool']}/jobs/new/", job, set()),
        "sweep": ("/sweeps/new/", sweep, set()),
        "keys": ("/keys/", {"name": "k", "public_key": ED25519}, set()),
        "tokens": ("/api/tokens/", {"action": "revoke", "token": "1", "name": "ci"}, set()),
        "webhooks": ("/webhooks/", hook, {"events"}),
        "webhook": (f"/webhooks/{w['hook']}/", hook, {"events"}),
        "settings": ("/settings/", {"language": "en", "time_zone": "Asia/Shanghai"}, set()),
        "language": ("/language/", {"language": "zh-hans", "next": "/"}, set()),
        "images": ("/images/", build, set()),
        "save image": (f"/clusters/{c}/nodes/0/save-image/", {"name": "img", "tag": "v1"}, set()),
    }


@st.composite
def hostile_post(draw, base: dict, multi: set[str]) -> dict:
    """The filled-in post with up to three fields replaced by hostile values (or dropped):
    the rest stays valid, so the hostile value reaches the checks after the first."""
    data = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(base)), max_size=3, unique=True)):
        if draw(st.booleans()) and draw(st.booleans()):
            data.pop(name)
        elif name in multi:
            data[name] = draw(st.lists(form_value, min_size=1, max_size=3))
        else:
            data[name] = draw(form_value)
    return data


FORM_NAMES = [
    "cluster", "custom image", "job", "resize", "start", "pool", "pool job", "sweep", "keys",
    "tokens", "webhooks", "webhook", "settings", "language", "images", "save image",
]  # fmt: skip


def test_no_form_answers_a_hostile_post_with_a_server_error(world, settings):
    settings.SUANLI_WEBHOOK_ALLOW_HOSTS = []  # no name is looked up past the refusal
    forms = _forms(world)

    @examples(20 * len(FORM_NAMES))
    @given(data=st.data())
    def post(data):
        url, base, multi = forms[data.draw(st.sampled_from(FORM_NAMES), label="form")]
        body = data.draw(hostile_post(base, multi), label="post")
        response = world["page"].post(url, body)
        assert response.status_code < 500, (url, body, response.status_code)

    post()


def test_every_field_of_every_form_takes_a_digit_that_is_no_number_and_an_id_past_64_bits(
    world,
):
    """The class of the first finding, field by field rather than by chance: "²" (isdigit()
    is true, int() refuses it) alone and where a port goes, and 2**64 (past every key), in
    each field of each form."""
    for name, (url, base, multi) in _forms(world).items():
        for field in base:
            for value in ("²", str(2**64), "localhost:²/x:v1"):
                data = {**base, field: [value] if field in multi else value}
                response = world["page"].post(url, data)
                assert response.status_code < 500, (name, field, value, response.status_code)


# -- the API ---------------------------------------------------------------------------------


def _bodies(w) -> dict[str, tuple[str, dict]]:
    c = w["cluster"]
    cluster = {
        "name": "api", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
        "image": TEST_IMAGE, "volumes": [], "release_policy": "never", "ssh_keys": [w["key"]],
        "idle_minutes": 5, "spot": False, "workspace": True,
    }  # fmt: skip
    job = {"cluster": c, "name": "j", "command": "true", "env": {"A": "1"}, "retries": 0,
           "max_runtime_min": 5, "max_preemptions": 1}  # fmt: skip
    pool = {"name": "p", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
            "image": TEST_IMAGE, "min_clusters": 0, "max_clusters": 1, "idle_minutes": 5,
            "budget_per_hour": "5", "budget_total": "50"}  # fmt: skip
    sweep = {"pool": w["pool"], "name": "s", "command": "python t.py", "metric": "val_loss",
             "space": {"lr": {"type": "log_uniform", "low": 1e-4, "high": 0.1}}, "trials": 2,
             "parallel": 1, "min_steps": 1}  # fmt: skip
    return {
        "clusters": ("clusters", cluster),
        "jobs": ("jobs", job),
        "pools": ("pools", pool),
        "pool jobs": (f"pools/{w['pool']}/jobs", {k: v for k, v in job.items() if k != "cluster"}),
        "sweeps": ("sweeps", sweep),
        "resize": (f"clusters/{c}/resize", {"nodes": 1}),
        "start": (f"clusters/{c}/start", {"mode": "gpu"}),
        "builds": (
            "images/builds",
            {
                "name": "img",
                "tag": "v1",
                "dockerfile": f"FROM {TEST_IMAGE}\n",
                "context": "",
                "build_args": {},
            },
        ),  # fmt: skip
        "save image": (f"clusters/{c}/nodes/0/save-image", {"name": "img", "tag": "v1"}),
    }


@st.composite
def hostile_body(draw, base: dict) -> dict:
    data = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(base)), min_size=1, max_size=3, unique=True)):
        data[name] = draw(json_value)
    return data


def test_no_api_call_answers_a_hostile_body_with_a_server_error(world, settings):
    settings.SUANLI_API_RATE_PER_MIN = 100000
    bodies = _bodies(world)
    api = Client(HTTP_AUTHORIZATION=f"Bearer {world['token']}", raise_request_exception=True)

    @examples(25 * len(bodies))
    @given(data=st.data())
    def call(data):
        path, base = bodies[data.draw(st.sampled_from(sorted(bodies)), label="endpoint")]
        body = data.draw(hostile_body(base), label="body")
        response = api.post(f"/api/v1/{path}", json.dumps(body), content_type="application/json")
        assert response.status_code < 500, (path, body, response.status_code)
        assert response["Content-Type"].startswith("application/json"), (path, body)
        if response.status_code >= 400:
            assert response.json()["error"].strip(), "a sentence says why"

    call()


# -- the findings, one by one ----------------------------------------------------------------


def test_revoking_a_token_named_by_a_digit_that_is_no_number_is_refused_with_a_sentence(
    alice, client
):
    row, _ = ApiToken.issue(user=alice, name="ci")
    client.force_login(alice)
    client.raise_request_exception = True
    for raw in ("²", "١", "18446744073709551616", "-1", "", "1.0"):
        response = client.post("/api/tokens/", {"action": "revoke", "token": raw})
        assert response.status_code == 400, raw
        assert "No such token" in response.content.decode(), raw
    row.refresh_from_db()
    assert row.revoked_at is None


def test_a_body_over_the_limit_is_413_in_the_apis_error_shape(alice, settings):
    _, token = ApiToken.issue(user=alice, name="ci")
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token}", raise_request_exception=True)
    body = json.dumps({"name": "x" * (10 * 2**20)})
    response = api.post("/api/v1/clusters", body, content_type="application/json")
    assert response.status_code == 413
    assert response.json() == {
        "error": "The request body is larger than the 2.5 MB this console takes.",
        "fields": {},
    }


def test_a_form_over_the_limits_is_refused_with_a_sentence(alice, client, settings):
    settings.DEBUG = False
    client.force_login(alice)
    response = client.post("/keys/", {"name": "k", "public_key": "x" * (3 * 2**20)})
    assert response.status_code == 413
    assert "larger than the 2.5 MB this console takes" in response.content.decode()
    fields = {f"f{n}": "x" for n in range(settings.DATA_UPLOAD_MAX_NUMBER_FIELDS + 1)}
    response = client.post("/keys/", fields)
    assert response.status_code == 400
    assert "more fields or files than this console takes" in response.content.decode()


def test_ssh_key_ids_beyond_the_keys_range_are_refused_with_a_sentence(world):
    api = Client(HTTP_AUTHORIZATION=f"Bearer {world['token']}")
    body = {"name": "k", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
            "image": TEST_IMAGE, "ssh_keys": [2**64]}  # fmt: skip
    response = api.post("/api/v1/clusters", json.dumps(body), content_type="application/json")
    assert response.status_code == 400
    assert response.json()["fields"]["ssh_keys"] == [
        "Select a valid choice. 18446744073709551616 is not one of the available choices."
    ]
    response = world["page"].post("/clusters/new/", {**cluster_form(), "ssh_keys": ["²", "9" * 30]})
    page = response.content.decode()
    assert response.status_code == 200 and "Select a valid choice. ² is not one" in page
    assert not Cluster.objects.filter(name="k").exists()
    assert SshKey.objects.count() == 1 and Pool.objects.count() == 1


def test_a_username_longer_than_any_is_a_failed_log_in_not_a_500(alice):
    """Django's login form authenticates a name of any length; the failure it records had
    a 255-character column, and its write failed (a 500, the failure uncounted)."""
    for url in ("/login/", "/admin/login/"):
        response = Client().post(url, {"username": "a" * 3000, "password": "wrong"})
        assert response.status_code == 200 and "correct username" in (response.content.decode()), (
            url
        )
    assert AccessAttempt.objects.get().failures_since_start == 2


# -- no error report shows a secret -----------------------------------------------------------

SECRET = f"hunter2-{uuid.uuid4().hex}"  # made here: the page shows this file's source lines


def _boom(request):
    """A view that fails with a credentialled URL in its frame, as a Redis call would."""
    redis_url = django_settings.REDIS_URL  # noqa: F841 (shown among the frame's variables)
    parts = urlsplit(redis_url)  # noqa: F841 (a named tuple: its netloc holds the password)
    raise RuntimeError("the engine went away")


urlpatterns = [path("boom/", _boom)]


@pytest.fixture
def secrets_in_settings(settings):
    url = f"redis://:{SECRET}@127.0.0.1:6389/0"
    settings.ROOT_URLCONF = __name__
    settings.REDIS_URL = url
    settings.RQ_QUEUES = {"default": {"URL": url, "DEFAULT_TIMEOUT": 600}}
    settings.SUANLI_CHANNEL_HOSTS = [{"address": url, "socket_timeout": 30}]
    settings.SUANLI_SOME_DATABASE_URL = f"postgres://suanli:{SECRET}@db:5432/suanli"
    settings.SUANLI_SOME_CACHE_URL = f"redis://cache:6379/1?password={SECRET}"
    return url


def test_the_debug_page_of_a_500_masks_every_credentialled_url(secrets_in_settings, settings):
    settings.DEBUG = True
    client = Client(raise_request_exception=False)
    response = client.get("/boom/")
    page = response.content.decode()
    assert response.status_code == 500 and "the engine went away" in page
    assert SECRET not in page
    assert "redis://:********************@127.0.0.1:6389/0" in page, "the URL stays readable"
    assert "postgres://suanli:********************@db:5432/suanli" in page


def test_the_admins_error_mail_masks_every_credentialled_url(secrets_in_settings, settings):
    settings.DEBUG = False
    settings.ADMINS = [("Ops", "ops@example.com")]
    response = Client(raise_request_exception=False).get("/boom/")
    assert response.status_code == 500 and "the engine went away" not in response.content.decode()
    (report,) = mail.outbox
    assert "RuntimeError" in report.body and "REDIS_URL" in report.body
    assert SECRET not in report.body


# -- as `make run` serves them: SQLite and the Procfile's web process --------------------------

SEED = f"""
from django.contrib.auth import get_user_model
from console.models import ApiToken
from jobs.clusters import services
from jobs.placement.catalog import seed_catalog
seed_catalog()
user = get_user_model().objects.create_user("alice", password="alice-pass-123")
services.ssh_key_add(owner=user, name="laptop", public_key={ED25519!r})
print(ApiToken.issue(user=user, name="ci")[1])
"""


@pytest.fixture
def sqlite_console(processes, tmp_path):
    """`make run`'s database (SQLite, which refuses integers past 64 bits with
    OverflowError) behind the web process as the Procfile runs it, DEBUG off."""
    url = f"sqlite:///{tmp_path / 'run.sqlite3'}"
    env = {**processes.env, "DATABASE_URL": url, "DEBUG": "0"}
    manage = [sys.executable, "manage.py"]
    subprocess.run([*manage, "migrate", "--no-input", "-v0"], cwd=ROOT, env=env, check=True)
    seeded = subprocess.run(
        [*manage, "shell", "-c", SEED], cwd=ROOT, env=env, check=True, capture_output=True,
        text=True,
    )  # fmt: skip
    port = free_port()
    processes.start("web", env={"DATABASE_URL": url, "DEBUG": "0", "PORT": str(port)})
    base = f"http://127.0.0.1:{port}"

    def answers():
        try:
            return requests.get(f"{base}/healthz", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    until(answers, timeout=30, what="the web process listens")
    return base, seeded.stdout.strip().splitlines()[-1]


def test_the_three_findings_answer_with_a_sentence_on_make_runs_stack(sqlite_console):
    base, token = sqlite_console
    api = requests.Session()
    api.headers["Authorization"] = f"Bearer {token}"
    response = api.post(f"{base}/api/v1/clusters", json={"name": "k", "ssh_keys": [2**64]})
    assert response.status_code == 400, response.text[:300]
    assert response.json()["fields"]["ssh_keys"] == [
        "Select a valid choice. 18446744073709551616 is not one of the available choices."
    ]
    response = api.post(
        f"{base}/api/v1/clusters", data=json.dumps({"name": "x" * (10 * 2**20)}),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    assert response.status_code == 413, response.text[:300]
    assert response.json()["error"].startswith("The request body is larger than the 2.5 MB")

    page = requests.Session()
    form = page.get(f"{base}/login/", timeout=10).text
    csrf = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form).group(1)
    page.post(
        f"{base}/login/", timeout=10,
        data={"username": "alice", "password": "alice-pass-123", "csrfmiddlewaretoken": csrf},
        headers={"Referer": f"{base}/login/"},
    )  # fmt: skip
    csrf = page.cookies["csrftoken"]
    headers = {"X-CSRFToken": csrf, "Referer": f"{base}/"}
    response = page.post(
        f"{base}/api/tokens/", data={"action": "revoke", "token": "²"}, headers=headers
    )
    assert response.status_code == 400 and "No such token" in response.text
    response = page.post(
        f"{base}/clusters/new/", data={"name": "k", "ssh_keys": ["18446744073709551616"]},
        headers=headers,
    )  # fmt: skip
    assert response.status_code == 200 and "Select a valid choice." in response.text

"""Pools in the console (issue 26): the form and its refusals, the pool page (queue,
clusters, chart, timeline), submitting a job through the page, the API and the command
line, closing; and another researcher, for whom none of it exists."""

import json
import os
import subprocess
import sys
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
import requests
from browsing import free_port, login
from conftest import TEST_IMAGE
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from waiting import until

from console import pools as console_pools
from console.models import ApiToken
from jobs.clusters.services import ClusterSpec, JobSpec
from jobs.models import Image, Job, Pool, PoolSample
from jobs.pools import autoscaler

pytestmark = pytest.mark.django_db
SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def hosts(make_host):
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2, check="reuse")
    make_host("gpu-b-01", engine=1, zone="zone-a", gpus=2, check="reuse")


@pytest.fixture
def form_data(catalog, hosts, storage_root):
    """The pool form as a researcher fills it in: 1 x 1 A100, 0 to 2 clusters."""
    image = Image.objects.get(reference=TEST_IMAGE)

    def data(**changes):
        return {
            "name": "train", "resource": "gpu:a100-80gb", "nodes": 1, "gpus_per_node": 1,
            "image": str(image.pk), "network": "standard", "zone": "", "volumes": "",
            "min_clusters": 0, "max_clusters": 2, "idle_minutes": 10, "budget_per_hour": "",
            "budget_total": "", **changes,
        }  # fmt: skip

    return data


@pytest.fixture
def make_pool(catalog, priced, alice, hosts, storage_root):
    def make(owner=None, **fields):
        shape = ClusterSpec(
            name="",
            nodes=1,
            gpu_model=catalog["a100-80gb"],
            gpus_per_node=1,
            image=Image.objects.get(reference=TEST_IMAGE),
        )
        spec = autoscaler.PoolSpec(name=fields.pop("name", "train"), cluster=shape, **fields)
        return console_pools.refresh(autoscaler.pool_create(owner=owner or alice, spec=spec))

    return make


@pytest.fixture
def api_of(db):
    def make(user):
        _, token = ApiToken.issue(user=user, name="script")
        client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

        def call(method, path, body=None):
            if method == "GET":
                response = client.get(f"/api/v1/{path}")
            else:
                response = client.post(
                    f"/api/v1/{path}", data=json.dumps(body or {}), content_type="application/json"
                )
            return response.status_code, response.json()

        return call

    return make


def submit(pool, name, command="sleep 30"):
    return console_pools.submit(pool=pool, spec=JobSpec(name=name, command=command))


def errors_of(response) -> dict:
    return {name: list(errs) for name, errs in response.context["form"].errors.items()}


# -- the form ---------------------------------------------------------------------------------


def test_the_form_creates_a_pool_and_the_list_shows_it(client, alice, priced, form_data):
    client.force_login(alice)
    assert "Pools" in client.get(reverse("dashboard")).content.decode()  # in the main nav
    response = client.post(reverse("pool_new"), form_data(budget_per_hour="20", volumes=""))
    pool = Pool.objects.get(owner=alice)
    assert response.status_code == 302 and response.url == reverse("pool_detail", args=[pool.pk])
    assert (pool.name, pool.shape, pool.min_clusters, pool.max_clusters) == (
        "train", "1 x 1 A100 80 GB", 0, 2,
    )  # fmt: skip
    assert pool.budget_per_hour == Decimal("20") and pool.budget_total is None
    assert pool.rate_per_hour == Decimal("7.8000")  # one A100 on demand, from the rate card
    assert pool.events.get().kind == "created"

    body = client.get(reverse("pool_list")).content.decode()
    assert f'href="{reverse("pool_detail", args=[pool.pk])}"' in body
    assert "1 x 1 A100 80 GB" in body and "0 of 2" in body
    # The same name again while the first is active: refused, said on the field.
    again = client.post(reverse("pool_new"), form_data())
    assert errors_of(again)["name"] == ["You have an active pool with this name already."]


@pytest.mark.parametrize(
    "changes, field, words",
    [
        ({"min_clusters": 3}, "min_clusters", "The minimum (3) is more than the maximum (2)."),
        ({"max_clusters": 0}, "max_clusters", "Give 1 or more: a pool of 0 clusters runs nothing."),
        ({"max_clusters": 101}, "max_clusters", "less than or equal to 100"),
        ({"idle_minutes": 0}, "idle_minutes", "greater than or equal to 1"),
        ({"budget_per_hour": "-5"}, "budget_per_hour", "A budget is more than 0"),
        ({"budget_total": "0"}, "budget_total", "A budget is more than 0"),
        ({"budget_per_hour": "abc"}, "budget_per_hour", "Enter a number."),
        (
            {"budget_per_hour": "5"},
            "budget_per_hour",
            "A budget of ¥5.00 per hour does not pay for one cluster (¥7.8000 per hour).",
        ),
        (
            {"budget_per_hour": "10", "min_clusters": 2},
            "budget_per_hour",
            "does not pay for the minimum of 2 clusters (¥7.8000 per hour each)",
        ),
        ({"nodes": 0}, "nodes", "greater than or equal to 1"),
        ({"name": "Bad Name!"}, "name", "Use lower-case letters"),
    ],
)
def test_bad_inputs_are_refused_with_words(client, alice, priced, form_data, changes, field, words):
    client.force_login(alice)
    response = client.post(reverse("pool_new"), form_data(**changes))
    assert response.status_code == 200
    errors = errors_of(response)
    assert any(words in e for e in errors.get(field, [])), errors
    assert words in response.content.decode().replace("&#x27;", "'")
    assert not Pool.objects.exists()


def test_the_api_creates_and_refuses_as_the_form_does(alice, priced, hosts, api_of):
    api = api_of(alice)
    shape = {"name": "api-pool", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
             "image": TEST_IMAGE, "volumes": []}  # fmt: skip
    status, body = api("POST", "pools", {**shape, "min_clusters": 3, "max_clusters": 2})
    assert status == 400 and body["fields"]["min_clusters"] == [
        "The minimum (3) is more than the maximum (2)."
    ]
    status, body = api("POST", "pools", {**shape, "max_clusters": 2, "budget_per_hour": "5"})
    assert status == 400 and body["fields"]["budget_per_hour"] == [
        "A budget of ¥5.00 per hour does not pay for one cluster (¥7.8000 per hour)."
    ]
    status, body = api("POST", "pools", {**shape, "budget_total": -1, "gpu_model": "nope"})
    assert status == 400 and "budget_total" in body["fields"] and "gpu_model" in body["fields"]
    assert api("POST", "pools", {**shape, "budget_total": "NaN"})[0] == 400
    assert not Pool.objects.exists()

    status, body = api(
        "POST", "pools", {**shape, "max_clusters": 3, "budget_per_hour": 16, "budget_total": "100"}
    )
    assert status == 201, body
    assert (body["max_clusters"], body["budget_per_hour"], body["rate_per_hour"]) == (
        3, "16.0000", "7.8000",
    )  # fmt: skip
    assert body["clusters_live"] == 0 and body["state"] == "active"
    status, listed = api("GET", "pools")
    assert status == 200 and [p["name"] for p in listed["pools"]] == ["api-pool"]


# -- the pool page ----------------------------------------------------------------------------


def test_the_page_shows_the_queue_the_clusters_the_timeline_and_the_chart(
    client, alice, make_pool, django_assert_max_num_queries
):
    pool = make_pool(max_clusters=2)
    jobs = [submit(pool, f"j{i}") for i in range(3)]
    autoscaler.pool_scale(pool.pk)  # a second cluster for the waiting jobs; the third is held
    client.force_login(alice)
    response = client.get(reverse("pool_detail", args=[pool.pk]))
    assert response.status_code == 200
    body = response.content.decode()
    context = response.context
    assert [j.pk for j in context["waiting"]] == [j.pk for j in jobs]
    assert [j.position for j in context["waiting"]] == [1, 2, 3]
    clusters = list(pool.clusters.order_by("id"))
    assert len(clusters) == 2 and [c.pk for c in context["clusters"]] == [c.pk for c in clusters]
    for cluster in clusters:
        assert f'href="{reverse("cluster_detail", args=[cluster.pk])}"' in body
    for job in jobs:
        assert f'href="{reverse("job_detail", args=[job.pk])}"' in body
    # The timeline: each decision in words with the figures it used, on a line of its own.
    kinds = [e.kind for e in context["events"]]
    assert kinds[0] == "created" and "grow" in kinds and "held" in kinds
    assert "3 waiting, 1 starting, 0 free, 0 finishing: +1" in body
    assert "maximum of 2 clusters is reached" in body
    held = next(e for e in context["events"] if e.kind == "held")
    assert ("waiting", 3) in held.figures_shown and ("maximum", 2) in held.figures_shown
    # The chart's figures are on the page and at samples.json.
    samples = json.loads(body.split('id="pool-samples" type="application/json">')[1].split("<")[0])
    assert samples["waiting"][-1] == 3 and samples["clusters"][-1] == 2
    data = client.get(reverse("pool_samples", args=[pool.pk])).json()
    assert data["at"] == samples["at"] and data["ready"] == samples["ready"]
    assert 'data-testid="pool-chart"' in body and "plotly.min.js" in body
    # The live part polls itself, and answers alone.
    assert f'hx-get="{reverse("pool_status", args=[pool.pk])}"' in body
    with django_assert_max_num_queries(40):
        live = client.get(reverse("pool_status", args=[pool.pk]))
    assert live.status_code == 200 and 'id="pool-live"' in live.content.decode()
    # The list counts them.
    row = client.get(reverse("pool_list")).context["pools"][0]
    assert (row.live, row.waiting, row.running) == (2, 3, 0)


def test_the_timeline_reads_in_chinese(client, alice, make_pool):
    pool = make_pool(max_clusters=1)
    submit(pool, "a")
    submit(pool, "b")
    autoscaler.pool_scale(pool.pk)
    client.force_login(alice)
    body = client.get(
        reverse("pool_detail", args=[pool.pk]), HTTP_ACCEPT_LANGUAGE="zh-hans"
    ).content.decode()
    assert '<html lang="zh-CN">' in body and "时间线" in body  # through the translations
    assert (
        'data-kind="held"' in body
    )  # each line rendered (jobs.base.text) in the reader's language


def test_a_job_submitted_on_the_page_and_by_the_api_joins_the_pool(
    client, alice, make_pool, api_of
):
    pool = make_pool(max_clusters=1)
    client.force_login(alice)
    url = reverse("pool_job_new", args=[pool.pk])
    assert client.get(url).status_code == 405  # POST only
    response = client.post(url, {"name": "page-job", "command": "echo hi", "launcher": "plain",
                                 "workdir": "/workspace", "checkpoint_dir": "/workspace/checkpoints",
                                 "retries": 0, "max_preemptions": 5})  # fmt: skip
    assert response.status_code == 302 and response.url == reverse("pool_detail", args=[pool.pk])
    job = Job.objects.get(pool=pool)
    assert job.name == "page-job" and job.cluster.pool_id == pool.pk and job.state == "queued"

    # A bad form comes back with its errors, on the pool page, and nothing is queued.
    bad = client.post(url, {"name": "x", "command": "", "launcher": "plain"})
    assert bad.status_code == 400 and "command" in bad.context["job_form"].errors
    assert Job.objects.filter(pool=pool).count() == 1

    status, body = api_of(alice)(
        "POST", f"pools/{pool.pk}/jobs", {"name": "api-job", "command": "echo hi"}
    )
    assert status == 201, body
    assert body["cluster"] == job.cluster_id and body["state"] == "queued"
    status, detail = api_of(alice)("GET", f"pools/{pool.pk}")
    assert status == 200 and [j["name"] for j in detail["waiting"]] == ["page-job", "api-job"]
    assert [c["id"] for c in detail["clusters"]] == [job.cluster_id]
    assert detail["figures"]["waiting"] == 2 and detail["events"][0]["kind"] == "created"

    # Closed: its waiting jobs are cancelled, and a new one is refused in words.
    response = client.post(reverse("pool_close", args=[pool.pk]))
    assert response.status_code == 302
    pool.refresh_from_db()
    assert pool.state == "closed"
    assert set(Job.objects.filter(pool=pool).values_list("state", flat=True)) == {"cancelled"}
    refused = client.post(url, {"name": "late", "command": "true", "launcher": "plain",
                                "workdir": "/workspace", "checkpoint_dir": "/workspace/ck",
                                "retries": 0})  # fmt: skip
    assert refused.status_code == 400
    assert "Pool train is closed: it takes no more jobs." in refused.content.decode()
    status, body = api_of(alice)("POST", f"pools/{pool.pk}/jobs", {"name": "x", "command": "true"})
    assert status == 400 and body["error"] == "Pool train is closed: it takes no more jobs."
    status, body = api_of(alice)("POST", f"pools/{pool.pk}/close")
    assert status == 200 and body["state"] == "closed"


def test_a_pool_that_may_not_add_a_cluster_says_why_on_the_form(client, alice, make_pool):
    pool = make_pool()
    # Below one cluster's price (as only an older pool or a price rise leaves it).
    Pool.objects.filter(pk=pool.pk).update(budget_per_hour=Decimal("1"))
    client.force_login(alice)
    response = client.post(reverse("pool_job_new", args=[pool.pk]), {
        "name": "x", "command": "true", "launcher": "plain", "workdir": "/workspace",
        "checkpoint_dir": "/workspace/checkpoints", "retries": 0,
    })  # fmt: skip
    assert response.status_code == 400
    assert (
        "Pool train has no cluster and cannot add one: 1 waiting, 0 starting, 0 free, 0 "
        "finishing: 1 more wanted, held back: a budget of 1.00 per hour pays for 0 at 7.80 "
        "per hour each." in response.content.decode()
    )
    assert not Job.objects.exists()


def test_another_researcher_finds_nothing(client, alice, bob, make_pool, api_of):
    pool = make_pool()
    client.force_login(bob)
    for name in ("pool_detail", "pool_status", "pool_samples"):
        assert client.get(reverse(name, args=[pool.pk])).status_code == 404, name
    for name in ("pool_job_new", "pool_close"):
        response = client.post(reverse(name, args=[pool.pk]), {"name": "x", "command": "true"})
        assert response.status_code == 404, name
    assert list(client.get(reverse("pool_list")).context["pools"]) == []
    api = api_of(bob)
    assert api("GET", f"pools/{pool.pk}")[0] == 404
    assert api("POST", f"pools/{pool.pk}/jobs", {"name": "x", "command": "true"})[0] == 404
    assert api("POST", f"pools/{pool.pk}/close")[0] == 404
    assert api("GET", "pools")[1]["pools"] == []
    pool.refresh_from_db()
    assert pool.state == "active" and not Job.objects.exists()


# -- the command line -------------------------------------------------------------------------


def test_jobs_submit_takes_a_pool_by_name_or_id(processes, alice, bob, make_pool, tmp_path):
    pool = make_pool(max_clusters=2)
    port = free_port()
    processes.start("web", env={"PORT": str(port)})
    url = f"http://127.0.0.1:{port}"

    def answers():
        try:
            return requests.get(f"{url}/api/v1/schema", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    until(answers, timeout=20, what="the web process listens")
    _, token = ApiToken.issue(user=alice, name="laptop")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "XDG_CONFIG_HOME": str(tmp_path / "config"), "SUANLI_URL": url, "SUANLI_TOKEN": token}  # fmt: skip

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "suanli_cli", *map(str, args)], cwd=ROOT, env=env,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    done = cli("jobs", "submit", "--pool", "train", "--name", "by-name", "--", "echo", "hi")
    assert done.returncode == 0, done.stderr
    assert "is queued in pool train" in done.stdout
    done = cli("--json", "jobs", "submit", "--pool", pool.pk, "--name", "by-id", "--", "true")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["name"] == "by-id"
    assert sorted(Job.objects.filter(pool=pool).values_list("name", flat=True)) == [
        "by-id", "by-name",
    ]  # fmt: skip

    both = cli("jobs", "submit", "--pool", "train", "--cluster", 1, "--", "true")
    neither = cli("jobs", "submit", "--", "true")
    for done in (both, neither):
        assert done.returncode == 2 and "either --cluster ID or --pool NAME_OR_ID" in done.stderr
    unknown = cli("jobs", "submit", "--pool", "nope", "--", "true")
    assert unknown.returncode == 1 and "no pool named 'nope'" in unknown.stderr
    assert "Traceback" not in unknown.stderr + both.stderr

    # Bob's token: alice's pool is no pool of his, by name or by id.
    _, bobs = ApiToken.issue(user=bob, name="bob")
    env["SUANLI_TOKEN"] = bobs
    assert cli("jobs", "submit", "--pool", pool.pk, "--", "true").returncode == 1
    assert Job.objects.filter(pool=pool).count() == 2


# -- in the browser ---------------------------------------------------------------------------


@pytest.mark.browser
def test_the_pool_page_in_chromium(page, live_server, alice, make_pool):
    pool = make_pool(max_clusters=3, budget_per_hour=Decimal("20"))
    for i in range(4):
        submit(pool, f"train-{i}")
    autoscaler.pool_scale(pool.pk)
    # An afternoon's figures for the chart: the queue grows, clusters follow, then drain.
    now = timezone.now()
    figures = [(0, 0, 0, 0), (3, 0, 1, 0), (3, 1, 2, 1), (2, 2, 2, 2), (4, 2, 3, 2),
               (2, 3, 3, 3), (1, 3, 3, 3), (0, 2, 3, 3), (0, 1, 2, 2), (4, 0, 2, 0)]  # fmt: skip
    PoolSample.objects.filter(pool=pool).delete()
    for i, (waiting, running, clusters, ready) in enumerate(figures):
        PoolSample.objects.create(
            pool=pool, at=now - timedelta(minutes=5 * (len(figures) - i)),
            waiting=waiting, running=running, clusters=clusters, ready=ready,
        )  # fmt: skip
    login(page, live_server, "alice", "alice-pass-123")
    page.goto(f"{live_server.url}/pools/{pool.pk}/")
    page.wait_for_selector("#pool-chart .main-svg")
    assert page.locator("#pool-waiting-jobs tbody tr").count() == 4
    assert page.locator("#pool-timeline li").count() >= 3
    page.screenshot(path=f"{SHOTS}/pool_detail.png", full_page=True)

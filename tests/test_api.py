"""The token JSON API: the same checks and object-level access as the pages."""

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from django.db import connection
from django.test import Client
from hypothesis import HealthCheck
from hypothesis import settings as hsettings
from playwright.sync_api import expect
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from console import api_urls
from console.models import ApiToken, digest_of
from jobs.models import Cluster, Job
from jobs.runs import dispatch

pytestmark = pytest.mark.django_db
SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")


def _api(token):
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def call(method, path, body=None):
        if method == "GET":
            response = client.get(f"/api/v1/{path}")
        else:
            response = client.post(
                f"/api/v1/{path}", data=json.dumps(body or {}) if not isinstance(body, str) else body,
                content_type="application/json",
            )  # fmt: skip
        return response.status_code, response.json()

    return call


@pytest.fixture
def token_of(db):
    def make(user, name="script"):
        _, token = ApiToken.issue(user=user, name=name)
        return token

    return make


def test_a_script_creates_a_cluster_runs_a_job_and_reads_its_log(
    make_host, alice, priced, token_of, settle_until
):
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2, check="reuse")
    api = _api(token_of(alice))
    status, cluster = api(
        "POST", "clusters",
        {"name": "api-run", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
         "image": "suanli/busybox:latest", "volumes": [], "release_policy": "never"},
    )  # fmt: skip
    assert status == 201, cluster
    from jobs.placement import scheduler

    scheduler.place_pending()
    status, cluster = api("GET", f"clusters/{cluster['id']}")
    assert cluster["state"] == "running"
    status, job = api(
        "POST",
        "jobs",
        {
            "cluster": cluster["id"],
            "name": "hello",
            "command": "echo hello from $RANK",
            "env": {"A": "1"},
        },
    )
    assert status == 201, job
    dispatch.dispatch(cluster["id"])
    settle_until(Job.objects.get(pk=job["id"]))
    for _ in range(20):  # poll as a script would
        status, job = api("GET", f"jobs/{job['id']}")
        if job["state"] == "succeeded":
            break
        time.sleep(0.5)
    assert job["state"] == "succeeded" and job["exit_code"] == 0, job["state_reason"]
    status, log = api("GET", f"jobs/{job['id']}/log")
    assert log["complete"] and any(line["text"] == "hello from 0" for line in log["lines"])
    status, balance = api("GET", "balance")
    assert balance["balance"] == "1000.0000" and balance["entries"][0]["kind"] == "topup"
    status, released = api("POST", f"clusters/{cluster['id']}/release")
    assert status == 200 and released["state"] == "released"


def test_a_script_follows_a_running_jobs_log_with_its_cursor(
    make_host, alice, priced, token_of, settle_until
):
    """Live lines while the job runs; `?since=<cursor>` gives only the lines after an
    earlier answer's, each once, from the engine or the stored log alike."""
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2, check="reuse")
    api = _api(token_of(alice))
    status, cluster = api(
        "POST", "clusters",
        {"name": "follow", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
         "image": "suanli/busybox:latest", "release_policy": "never"},
    )  # fmt: skip
    from jobs.placement import scheduler

    scheduler.place_pending()
    status, job = api(
        "POST",
        "jobs",
        {
            "cluster": cluster["id"],
            "name": "f",
            "command": "echo first; sleep 2; echo second; echo third",
        },
    )
    status, log = api("GET", f"jobs/{job['id']}/log")
    assert status == 200 and log["lines"] == [] and not log["complete"]
    dispatch.dispatch(cluster["id"])
    for _ in range(60):
        status, log = api("GET", f"jobs/{job['id']}/log?since={log['cursor']}")
        if log["lines"]:
            break
        time.sleep(0.2)
    assert [line["text"] for line in log["lines"]] == ["first"] and log["state"] == "running"
    status, again = api("GET", f"jobs/{job['id']}/log?since={log['cursor']}")
    assert again["lines"] == [] and again["cursor"] == log["cursor"], "nothing twice"
    settle_until(Job.objects.get(pk=job["id"]))
    status, rest = api("GET", f"jobs/{job['id']}/log?since={log['cursor']}")
    assert [line["text"] for line in rest["lines"]] == ["second", "third"]
    assert rest["complete"] and rest["exit_code"] == 0 and rest["attempt"] == 1
    status, end = api("GET", f"jobs/{job['id']}/log?since={rest['cursor']}")
    assert end["lines"] == [] and end["complete"]
    status, whole = api("GET", f"jobs/{job['id']}/log")
    assert [line["text"] for line in whole["lines"]] == ["first", "second", "third"]
    for bad in ("nonsense", "1~0.x.1", "9"):  # "9": a later attempt than the job's
        status, body = api("GET", f"jobs/{job['id']}/log?since={bad}")
        assert status == 400 and "since" in body["error"], bad


def test_tokens_are_shown_once_stored_hashed_and_revocable(client, alice, bob):
    client.force_login(alice)
    page = client.post("/api/tokens/", {"action": "create", "name": "ci"}).content.decode()
    row = ApiToken.objects.get(user=alice)
    token = page.split('<pre class="small" id="new-token">')[1].split("<")[0]
    assert row.digest == digest_of(token) and token not in str(ApiToken.objects.values().first())
    assert token not in client.get("/api/tokens/").content.decode()  # once
    api = _api(token)
    assert api("GET", "clusters")[0] == 200
    row.refresh_from_db()
    assert row.last_used_at is not None
    client.force_login(bob)
    assert client.post("/api/tokens/", {"action": "revoke", "token": row.pk}).status_code == 404
    response = client.post("/api/tokens/", {"action": "revoke", "token": "x"})
    assert response.status_code == 400 and "No such token" in response.content.decode()
    client.force_login(alice)
    client.post("/api/tokens/", {"action": "revoke", "token": row.pk})
    status, body = api("GET", "clusters")
    assert status == 401 and "revoked" in body["error"]
    assert _api("sk_suanli_wrong")("GET", "clusters")[0] == 401
    session_only = client.get("/api/v1/clusters")  # a logged-in browser is not a token
    assert session_only.status_code == 401 and session_only["WWW-Authenticate"].startswith("Bearer")


def test_another_researchers_objects_are_404(make_cluster, alice, bob, token_of, priced):
    cluster = make_cluster(alice, "mine")
    job = Job.objects.create(cluster=cluster, owner=alice, name="j", command="true")
    api = _api(token_of(bob))
    for method, path in (
        ("GET", f"clusters/{cluster.pk}"), ("POST", f"clusters/{cluster.pk}/release"),
        ("GET", f"jobs/{job.pk}"), ("POST", f"jobs/{job.pk}/cancel"), ("GET", f"jobs/{job.pk}/log"),
    ):  # fmt: skip
        assert api(method, path)[0] == 404, path
    status, body = api("POST", "jobs", {"cluster": cluster.pk, "name": "x", "command": "true"})
    assert status == 404
    assert api("GET", "clusters")[1]["clusters"] == []
    assert Cluster.objects.get(pk=cluster.pk).state == "pending"
    assert Job.objects.filter(cluster=cluster).count() == 1


def test_bad_input_gets_a_message_per_field_and_creates_nothing(alice, token_of, priced):
    api = _api(token_of(alice))
    assert api("POST", "clusters", "{not json")[0] == 400
    assert api("POST", "clusters", "[1, 2]")[1]["error"] == "The body must be a JSON object."
    status, body = api(
        "POST", "clusters", {"name": "Bad Name!", "nodes": 0, "gpu_model": "nope", "image": "x"}
    )
    # The fields as the API names them, never the form's (`resource`, `custom_image`).
    assert status == 400 and {"name", "nodes", "gpu_model"} <= set(body["fields"])
    assert not {"resource", "custom_image"} & set(body["fields"]), body["fields"]
    status, body = api("POST", "clusters", {"name": "cpu", "instance_type": "nope", "nodes": 1})
    assert status == 400 and "instance_type" in body["fields"], body
    status, body = api("POST", "jobs", {"cluster": "abc"})
    assert status == 400 and "cluster" in body["fields"]
    assert api("GET", "clusters?page=zero")[0] == 400
    # JSON types are kept: a number is not a name, true is not a node count.
    status, body = api("POST", "clusters", {"name": 123, "nodes": True, "gpu_model": "a100-80gb"})
    assert status == 400 and body["fields"] == {
        "name": ["Give a string."], "nodes": ["Give a whole number."]
    }  # fmt: skip
    assert not Cluster.objects.exists()


def test_five_tokens_of_one_researcher_share_one_budget(alice, bob, token_of, settings):
    """The rate is per researcher: more tokens buy no more requests (issue 37 made 600 a
    minute from 5 tokens); another researcher's budget is their own."""
    settings.SUANLI_API_RATE_PER_MIN = 10
    tokens = [_api(token_of(alice, f"t{n}")) for n in range(5)]
    statuses = [tokens[n % 5]("GET", "balance")[0] for n in range(15)]
    assert statuses == [200] * 10 + [429] * 5
    status, body = tokens[4]("GET", "balance")
    assert status == 429 and body["error"] == (
        "Too many requests from your tokens this minute; slow down."
    )
    assert _api(token_of(bob))("GET", "balance")[0] == 200


def test_the_twenty_first_live_token_is_refused_with_a_sentence(alice, client, settings):
    assert settings.SUANLI_API_TOKENS_MAX == 20
    client.force_login(alice)
    for n in range(20):
        response = client.post("/api/tokens/", {"action": "create", "name": f"t{n}"})
        assert response.status_code == 200 and response.context["new_token"], n
    response = client.post("/api/tokens/", {"action": "create", "name": "one-more"})
    said = "You hold 20 live tokens, the most one researcher may: revoke one you no longer use"
    assert response.status_code == 400 and said in response.content.decode()
    assert not response.context["new_token"]
    assert ApiToken.objects.filter(user=alice).count() == 20
    # A revoked token frees its place.
    client.post("/api/tokens/", {"action": "revoke", "token": ApiToken.objects.first().pk})
    response = client.post("/api/tokens/", {"action": "create", "name": "one-more"})
    assert response.status_code == 200 and response.context["new_token"]


@pytest.mark.django_db(transaction=True)  # threads, their own connections
def test_twenty_tokens_asked_for_at_once_past_the_cap_make_none_too_many(alice, settings):
    """Ten requests at once with five places left: exactly five tokens are made."""
    for n in range(15):
        ApiToken.issue(user=alice, name=f"t{n}")
    start = threading.Barrier(10)

    def one(n):
        start.wait()
        try:
            client = Client()
            client.force_login(alice)
            return client.post("/api/tokens/", {"action": "create", "name": f"x{n}"}).status_code
        finally:
            connection.close()

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(one, range(10)))
    assert sorted(answers) == [200] * 5 + [400] * 5
    assert ApiToken.objects.filter(user=alice, revoked_at__isnull=True).count() == 20


schema = schemathesis.openapi.from_wsgi("/api/v1/schema", get_wsgi_application())
CONFORMANCE = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture
def fuzz_token(alice, priced, make_host):
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2, check=False)
    _, token = ApiToken.issue(user=alice, name="fuzz")
    return token


@pytest.mark.django_db(transaction=True)  # a WSGI handler: it closes old connections
@schema.parametrize()
@hsettings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_schemathesis_finds_no_server_error_and_no_answer_off_the_schema(
    case, fuzz_token, settings
):
    """Requests made from the generated schema, valid and invalid: never a 5xx, only the
    status codes and content types the schema names, and bodies of its shapes. (Unknown
    query parameters and body fields are ignored, as HTTP APIs do, so schemathesis's
    negative-data check, which expects them refused, is not among these.)"""
    settings.SUANLI_API_RATE_PER_MIN = 100000
    response = case.call(headers={"Authorization": f"Bearer {fuzz_token}"})
    case.validate_response(response, checks=CONFORMANCE)


def _served() -> dict[str, set[str]]:
    """Every path under /api/v1/ that answers (bar the schema and its docs page), with the
    methods it takes, as its 405 for a method it does not take says."""
    client = Client()
    served = {}
    for pattern in api_urls.urlpatterns[0].url_patterns:
        route = str(pattern.pattern)
        if route in ("schema", "docs", ""):
            continue
        path = "/api/v1/" + re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", route)
        probe = client.generic("TRACE", re.sub(r"\{\w+\}", "1", path))  # no path takes it
        assert probe.status_code == 405, path
        served[path] = {m.lower() for m in probe["Allow"].split(", ")}
    return served


def test_the_schema_has_every_path_and_method_the_api_serves(client):
    document = client.get("/api/v1/schema").json()
    described = {path: set(ops) for path, ops in document["paths"].items()}
    served = _served()
    assert served == described and len(served) >= 9
    for path, ops in document["paths"].items():
        for method, op in ops.items():
            assert {"401", "429"} <= set(op["responses"]), (method, path)
            assert op["security"] == [{"TokenAuth": []}], (method, path)
            assert op["responses"]["401"]["content"]["application/json"]["schema"] == {
                "$ref": "#/components/schemas/Error"
            }


@pytest.mark.django_db(transaction=True)  # threads, their own connections
def test_tokens_are_limited_atomically_under_concurrent_requests(alice, token_of, settings):
    """20 requests at once with 5 left in the minute: exactly 5 are served."""
    settings.SUANLI_API_RATE_PER_MIN = 5
    token = token_of(alice)
    start = threading.Barrier(20)

    def one(_):
        start.wait()
        try:
            response = Client(HTTP_AUTHORIZATION=f"Bearer {token}").get("/api/v1/balance")
            return response.status_code, response.get("Retry-After")
        finally:
            connection.close()

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(one, range(20)))
    assert sorted(status for status, _ in answers) == [200] * 5 + [429] * 15
    assert all(0 < int(wait) <= 60 for status, wait in answers if status == 429)


def test_a_wrong_method_is_405_json(alice, token_of):
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token_of(alice)}")
    response = client.delete("/api/v1/clusters")
    assert response.status_code == 405 and response["Allow"] == "GET, POST"
    assert "Use GET or POST" in response.json()["error"]


def test_deeply_nested_or_unencodable_bodies_are_400(alice, token_of):
    api = _api(token_of(alice))
    assert api("POST", "clusters", "[" * 100000)[0] == 400
    status, body = api("POST", "jobs", '{"cluster": 1, "name": "x", "command": "\\ud800"}')
    assert status == 400 and "UTF-8" in body["error"]
    status, body = api("POST", "clusters", '{"name": "a", "image": "\\u0000", "nodes": 1}')
    assert status == 400 and "NUL" in body["error"]


def test_an_unknown_api_path_is_a_json_404(alice, token_of):
    for path in ("nope/", ""):
        status, body = _api(token_of(alice))("GET", path)
        assert status == 404 and "schema" in body["error"]


@pytest.mark.browser
def test_the_docs_page_runs_a_call_with_a_token_from_our_own_files(
    page, live_server, alice, token_of, priced
):
    """/api/v1/docs lists every operation, takes a token under Authorize and runs a call,
    loading nothing from anywhere but the console."""
    token = token_of(alice)
    elsewhere = []
    page.on(
        "request",
        lambda r: None if r.url.startswith((live_server.url, "data:")) else elsewhere.append(r.url),
    )
    schema = page.request.get(f"{live_server.url}/api/v1/schema").json()
    operations = sum(len(ops) for ops in schema["paths"].values())
    assert operations >= 29
    page.goto(f"{live_server.url}/api/v1/docs")
    expect(page.locator(".opblock")).to_have_count(operations)
    page.get_by_role("button", name="Authorize").first.click()
    page.locator(".modal-ux input").fill(token)
    page.locator(".modal-ux button.authorize").click()
    page.locator(".modal-ux button.btn-done").click()
    page.locator("#operations-money-balance").click()
    page.get_by_role("button", name="Try it out").click()
    page.get_by_role("button", name="Execute").click()
    live = page.locator("#operations-money-balance .live-responses-table")
    expect(live.locator("tr.response .response-col_status").first).to_have_text("200")
    expect(live.locator("tr.response pre.microlight").first).to_contain_text('"1000.0000"')
    page.screenshot(path=f"{SHOTS}/api-docs.png", full_page=False)
    assert elsewhere == [], elsewhere


def test_a_running_cluster_says_how_to_ssh_to_each_node(
    make_cluster, paper_host, alice, token_of, settings
):
    from jobs.access import hostkey, sessions
    from jobs.placement import scheduler

    cluster = make_cluster(alice, "shell", nodes=2, release_policy="never", volumes=())
    api = _api(token_of(alice))
    assert api("GET", f"clusters/{cluster.pk}")[1]["ssh"] == [], "pending: nothing to log in to"
    scheduler.place_pending()
    settings.SUANLI_SSH_HOST = "ssh.gpu.example.edu"
    status, body = api("GET", f"clusters/{cluster.pk}")
    assert status == 200 and body["state"] == "running"
    port, fingerprint = sessions.ssh_port(), hostkey.host_key_fingerprint()
    assert body["ssh"] == [
        {
            "node": n, "user": f"c{cluster.pk}-{n}", "host": "ssh.gpu.example.edu", "port": port,
            "command": f"ssh -p {port} c{cluster.pk}-{n}@ssh.gpu.example.edu",
            "host_key_fingerprint": fingerprint,
        }
        for n in (0, 1)
    ]  # fmt: skip
    settings.SUANLI_SSH_HOST = ""  # the name the console was reached by, without the port
    _, listed = api("GET", "clusters")
    assert listed["clusters"][0]["ssh"][1]["host"] == "testserver"
    Cluster.objects.filter(pk=cluster.pk).update(workspace=False)
    assert api("GET", f"clusters/{cluster.pk}")[1]["ssh"] == [], "no workspaces: no login"

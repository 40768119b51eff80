"""The OpenAPI document at /api/v1/schema tells the truth, so that a client generated from it
works: what a request must carry is `required`, an enum's description names its values (and
the model's default), timestamps are `format: date-time`, every answer the API gives is
documented (405 too); and a client made by `openapi-python-client` from the live document
runs a researcher's whole flow against the Procfile's processes."""

import importlib
import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import Client
from test_cli import console_url  # noqa: F401 (the web, worker and watch processes)

from console.models import ApiToken
from jobs.models import Cluster, Job, Pool, Sweep

pytestmark = pytest.mark.django_db

REQUIRED = "This field is required."


def _schema() -> dict:
    return Client().get("/api/v1/schema").json()


def _enum_of(prop: dict) -> list | None:
    for part in [prop, *prop.get("anyOf", [])]:
        if "enum" in part:
            return part["enum"]
    return None


def _formats(prop: dict) -> set[str]:
    return {part.get("format") for part in [prop, *prop.get("anyOf", [])]} - {None}


def test_a_request_s_required_fields_are_the_ones_the_api_refuses_without(
    alice, priced, make_paper_host
):
    """POST {} to each create: the fields refused as required are exactly the document's
    `required` (a generated client makes them arguments; today `name` was optional)."""
    make_paper_host("gpu-p-01", gpus=2)
    _, token = ApiToken.issue(user=alice, name="schema")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    schemas = _schema()["components"]["schemas"]
    creates = {"clusters": "NewCluster", "jobs": "NewJob", "pools": "NewPool",
               "sweeps": "NewSweep", "images/builds": "NewBuild"}  # fmt: skip
    for path, name in creates.items():
        answer = client.post(f"/api/v1/{path}", "{}", content_type="application/json")
        assert answer.status_code == 400, (path, answer.content)
        refused = {f for f, words in answer.json()["fields"].items() if REQUIRED in words}
        assert refused == set(schemas[name].get("required", [])), (path, answer.json())
    assert "name" in schemas["NewCluster"]["required"]


def test_enums_and_their_descriptions_are_the_models(alice):
    """Every enum is the model's choices; a description names no value the enum lacks
    (`when_idle` was the old name of `idle`); a default is the model's default."""
    document = _schema()
    schemas = document["components"]["schemas"]
    assert "when_idle" not in json.dumps(document)
    models = {
        ("NewCluster", "release_policy"): (Cluster, "release_policy"),
        ("ClusterOut", "release_policy"): (Cluster, "release_policy"),
        ("NewCluster", "network"): (Cluster, "network"),
        ("NewPool", "network"): (Cluster, "network"),
        ("ClusterOut", "state"): (Cluster, "state"),
        ("NewJob", "launcher"): (Job, "launcher"),
        ("JobOut", "state"): (Job, "state"),
        ("PoolOut", "state"): (Pool, "state"),
        ("NewSweep", "direction"): (Sweep, "direction"),
        ("NewSweep", "pruner"): (Sweep, "pruner"),
    }
    for (schema, prop), (model, field) in models.items():
        choices = [value for value, _ in model._meta.get_field(field).choices]
        assert sorted(_enum_of(schemas[schema]["properties"][prop])) == sorted(choices), prop
    release = schemas["NewCluster"]["properties"]["release_policy"]
    assert release["default"] == Cluster._meta.get_field("release_policy").default
    assert f"{release['default']} (default" in release["description"]
    for name, schema in schemas.items():
        props = schema.get("properties", {})
        for prop, value in props.items():
            enum = _enum_of(value)
            if not enum or "description" not in value:
                continue
            for word in re.findall(r"\b[a-z]+(?:_[a-z]+)+\b", value["description"]):
                assert word in enum or word in props, (name, prop, word)
            if "default" in value and value["default"] is not None:
                assert (
                    value["default"] in enum
                    and f"{value['default']} (default" in (value["description"])
                ), (name, prop)


def test_timestamps_are_date_time_and_every_answer_is_documented():
    document = _schema()
    stamps = []
    for name, schema in document["components"]["schemas"].items():
        for prop, value in schema.get("properties", {}).items():
            if prop.endswith(("_at", "_since")) or prop in ("at", "ts"):
                stamps.append((name, prop))
                assert _formats(value) == {"date-time"}, (name, prop, value)
    assert ("ClusterOut", "created_at") in stamps and ("LogLine", "ts") in stamps
    for path, ops in document["paths"].items():
        for method, op in ops.items():
            assert "405" in op["responses"], (method, path)
            assert op["operationId"].isidentifier() and not op["operationId"].startswith(
                "console_"
            ), op["operationId"]


def _generate(url: str, folder: Path, package: str):
    """`openapi-python-client generate` from the live document, imported from `folder`."""
    config = folder / "openapi-python-client.yaml"
    config.write_text("post_hooks: []\n")  # no formatter run on the generated code
    tool = Path(sys.executable).parent / "openapi-python-client"
    done = subprocess.run(
        [tool, "generate", "--url", f"{url}/api/v1/schema", "--meta", "none",
         "--output-path", folder / package, "--config", config],
        cwd=folder, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Warning" not in done.stdout + done.stderr, done.stdout + done.stderr
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(package)
    finally:
        sys.path.remove(str(folder))


def test_a_generated_client_runs_the_whole_flow(console_url, alice, bob, tmp_path):  # noqa: F811
    """Long because it is one researcher's day through a generated client: log in, a
    cluster, a job and its log, a cancelled job, a pool, another researcher's 404, release."""
    from conftest import TEST_IMAGE
    from waiting import until

    sdk = _generate(console_url, tmp_path, "suanli_api_flow")
    api = importlib.import_module("suanli_api_flow.api")
    models = importlib.import_module("suanli_api_flow.models")
    for module in pkgutil.walk_packages(api.__path__, f"{api.__name__}."):
        importlib.import_module(module.name)  # each operation is a module of its tag's package
    _, token = ApiToken.issue(user=alice, name="generated")
    client = sdk.AuthenticatedClient(
        base_url=console_url, token=token, raise_on_unexpected_status=True
    )

    balance = api.money.balance.sync(client=client)
    assert isinstance(balance, models.Balance) and balance.balance == "1000.0000"

    # A required field left out is refused by the client itself (it is an argument).
    with pytest.raises(TypeError):
        models.NewCluster(image=TEST_IMAGE)
    made = api.clusters.cluster_create.sync(
        client=client,
        body=models.NewCluster(
            name="gen", gpu_model="a100-80gb", nodes=1, gpus_per_node=1, image=TEST_IMAGE
        ),
    )
    assert isinstance(made, models.ClusterOut), made
    assert made.release_policy == models.ClusterOutReleasePolicy(
        Cluster._meta.get_field("release_policy").default
    )
    assert made.created_at.tzinfo is not None  # a datetime, parsed from `date-time`

    def running():
        shown = api.clusters.cluster.sync(client=client, cluster_id=made.id)
        return shown.state == models.ClusterOutState.RUNNING

    until(running, timeout=60, what="the cluster runs")
    listed = api.clusters.clusters.sync(client=client)
    assert [c.id for c in listed.clusters] == [made.id] and listed.count == 1

    job = api.jobs.job_submit.sync(
        client=client,
        body=models.NewJob(cluster=made.id, name="hello", command="echo hello; echo bye"),
    )
    assert isinstance(job, models.JobOut), job
    until(lambda: Job.objects.get(pk=job.id).state == "succeeded", timeout=60, what="it ran")
    shown = api.jobs.job.sync(client=client, job_id=job.id)
    assert shown.state == models.JobOutState.SUCCEEDED and shown.exit_code == 0
    assert shown.started_at <= shown.finished_at
    log = api.jobs.job_log.sync(client=client, job_id=job.id)
    assert [line.text for line in log.lines] == ["hello", "bye"] and log.complete
    assert log.lines[0].ts.year >= 2024  # the engine's nanosecond stamps parse too

    long = api.jobs.job_submit.sync(
        client=client,
        body=models.NewJob(cluster=made.id, name="long", command="sleep 300"),
    )
    until(lambda: Job.objects.get(pk=long.id).state == "running", timeout=60, what="it runs")
    stopping = api.jobs.job_cancel.sync(client=client, job_id=long.id)
    assert stopping.id == long.id
    until(lambda: Job.objects.get(pk=long.id).state == "cancelled", timeout=60, what="cancelled")
    jobs = api.jobs.jobs.sync(client=client, cluster=made.id)
    assert {j.name for j in jobs.jobs} == {"hello", "long"}

    pool = api.pools.pool_create.sync(
        client=client,
        body=models.NewPool(
            name="gen-pool", gpu_model="a100-80gb", nodes=1, gpus_per_node=1, image=TEST_IMAGE
        ),
    )
    assert isinstance(pool, models.PoolOut), pool
    closed = api.pools.pool_close.sync(client=client, pool_id=pool.id)
    assert closed.state == models.PoolOutState.CLOSED

    # Another researcher's token: the cluster is 404, as the document says (an Error).
    _, bobs = ApiToken.issue(user=bob, name="bob")
    theirs = sdk.AuthenticatedClient(base_url=console_url, token=bobs)
    answer = api.clusters.cluster.sync_detailed(client=theirs, cluster_id=made.id)
    assert answer.status_code == 404 and isinstance(answer.parsed, models.Error)
    wrong = api.clusters.cluster_release.sync_detailed(
        client=sdk.AuthenticatedClient(base_url=console_url, token="sk_suanli_wrong"),
        cluster_id=made.id,
    )
    assert wrong.status_code == 401 and isinstance(wrong.parsed, models.Error)

    released = api.clusters.cluster_release.sync(client=client, cluster_id=made.id)
    assert released.state in (models.ClusterOutState.RELEASING, models.ClusterOutState.RELEASED)

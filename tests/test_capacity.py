"""A request no set of registered hosts could ever hold is refused, on the form and in the
API, with the largest size that fits; it never waits at the head of its line for ever."""

import json

import pytest
from django.test import Client
from django.urls import reverse
from forms_data import cluster_form

from console.models import ApiToken
from jobs.hosts import services as host_services
from jobs.models import Cluster, Host
from jobs.placement import fleet, scheduler

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("priced")]


def _host(catalog, name, *, gpus=8, model="a100-80gb", state="active", cpus=None, swarm=""):
    """A registered host with no engine behind it: capacity is all these tests read."""
    host = Host(
        name=name,
        engine_url="unix:///run/suanli-no-such-engine.sock",
        address="127.0.0.1",
        zone="zone-a",
        gpu_model=catalog[model] if model else None,
        gpu_count=gpus if model else 0,
        cpu_count=cpus,
        state=state,
        swarm_state="active" if swarm else "",
        swarm_cluster=swarm,
        images=["suanli/busybox:latest"],  # the form's image, as a check would record it
    )
    return host_services.host_save(host=host)


def _form(**fields):
    return cluster_form(**{"name": "big-1", "gpus_per_node": "8", **fields})


def _errors(response, field):
    assert response.status_code == 200, "refused, not created"
    return " ".join(response.context["form"].errors.get(field, []))


def _api(user):
    _, token = ApiToken.issue(user=user, name="capacity")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def post(path, body):
        response = client.post(
            f"/api/v1/{path}", data=json.dumps(body), content_type="application/json"
        )
        return response.status_code, response.json()

    return post


def test_three_nodes_of_eight_on_one_eight_gpu_host_are_refused_with_what_fits(
    client, alice, catalog, storage_root
):
    _host(catalog, "gpu-a-01")
    client.force_login(alice)
    refused = client.post(reverse("cluster_new"), _form(nodes="3"))
    assert "At most 1 node x 8 GPUs of A100 80 GB: the largest host has 8 GPUs" in _errors(
        refused, "nodes"
    )
    refused = client.post(reverse("cluster_new"), _form(gpus_per_node="16"))
    assert "At most 1 node x 8 GPUs of A100 80 GB: the largest host has 8" in _errors(
        refused, "gpus_per_node"
    )
    assert not Cluster.objects.exists()
    # Two nodes of four share the one host (one bridge network): that fits.
    assert (
        client.post(reverse("cluster_new"), _form(nodes="2", gpus_per_node="4")).status_code == 302
    )


def test_a_down_host_counts_for_what_could_ever_fit_and_the_swarm_for_how_many_nodes(
    client, alice, catalog, storage_root
):
    _host(catalog, "gpu-a-01", swarm="swarm-1")
    _host(catalog, "gpu-a-02", swarm="swarm-1", state="down")  # may come back
    _host(catalog, "gpu-a-03", gpus=4)  # outside the swarm: a cluster all on it, or none
    fit = fleet.largest_fit(gpu_model=catalog["a100-80gb"])
    assert fit.largest == 8 and fit.nodes_max(8) == 2 and fit.nodes_max(4) == 4
    client.force_login(alice)
    refused = client.post(reverse("cluster_new"), _form(nodes="3"))
    assert (
        "At most 2 nodes x 8 GPUs of A100 80 GB: the hosts that can share one network "
        "(a Docker swarm) hold 2 such nodes"
    ) in _errors(refused, "nodes")
    assert client.post(reverse("cluster_new"), _form(nodes="2")).status_code == 302


def test_a_cpu_type_larger_than_every_host_is_labelled_and_refused(
    client, alice, catalog, storage_root
):
    _host(catalog, "cpu-a-01", model=None, cpus=2)
    client.force_login(alice)
    page = client.get(reverse("cluster_new")).content.decode()
    assert "cpu-8c-32g (8 vCPU, 32 GB) — cannot be placed: the largest host has 2 vCPUs" in page
    assert "cpu-2c-4g (2 vCPU, 4 GB)</option>" in page  # fits now: no note
    refused = client.post(reverse("cluster_new"), _form(resource="cpu:cpu-8c-32g"))
    assert "cpu-8c-32g needs 8 vCPUs; the largest host has 2: pick a type of at most 2" in (
        _errors(refused, "resource")
    )
    refused = client.post(reverse("cluster_new"), _form(resource="cpu:cpu-2c-4g", nodes="2"))
    assert "At most 1 node x cpu-2c-4g: the largest host has 2 vCPUs" in _errors(refused, "nodes")


def test_the_api_refuses_impossible_creates_and_resizes(alice, catalog, storage_root):
    _host(catalog, "gpu-a-01")
    post = _api(alice)
    body = {
        "name": "api-big", "gpu_model": "a100-80gb", "nodes": 3, "gpus_per_node": 8,
        "image": "suanli/busybox:latest", "volumes": [], "release_policy": "never",
    }  # fmt: skip
    status, answer = post("clusters", body)
    assert status == 400
    assert "At most 1 node x 8 GPUs of A100 80 GB" in answer["fields"]["nodes"][0]
    status, answer = post("clusters", {**body, "nodes": 1, "gpus_per_node": 12})
    assert status == 400 and "the largest host has 8" in answer["fields"]["gpus_per_node"][0]
    assert not Cluster.objects.exists()

    status, cluster = post("clusters", {**body, "nodes": 1, "gpus_per_node": 4})
    assert status == 201, cluster
    scheduler.place_pending()
    assert Cluster.objects.get(pk=cluster["id"]).state == Cluster.State.RUNNING
    status, answer = post(f"clusters/{cluster['id']}/resize", {"nodes": 3})
    assert status == 400
    assert "At most 2 nodes x 4 GPUs of A100 80 GB" in answer["fields"]["nodes"][0]


def test_the_capacity_is_read_in_one_query(catalog, django_assert_num_queries):
    for i in range(5):
        _host(catalog, f"gpu-a-0{i}", swarm="swarm-1" if i % 2 else "")
    with django_assert_num_queries(1):
        rooms = fleet.host_rooms()
    assert len(rooms) == 5

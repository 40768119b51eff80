"""Growing a cluster passes the same balance check as creating it: a researcher refused a
2-node cluster cannot get one by resizing a 1-node cluster, on the page or through the API.
Shrinking always passes.

The host is a row registered without a check (no Docker engine needed); the real
scheduler places the cluster and the added node on it."""

import json
from datetime import timedelta
from decimal import Decimal

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from billing import services as billing
from billing.catalog import seed_rate_card
from console.models import ApiToken
from jobs.models import Cluster, Image
from jobs.placement import scheduler

pytestmark = pytest.mark.django_db

SHORT_FOR_TWO = "growing it needs a balance for 10 minutes (¥2.6000). Your balance is ¥2.0000"


@pytest.fixture
def paper_fleet(paper_host, storage_root):
    """One 8-GPU A100 host, active; 7.80 CNY per GPU-hour (the starting rate card)."""
    seed_rate_card(effective_from=timezone.now() - timedelta(hours=1))
    return paper_host


def _form(**fields):
    data = {
        "name": "grow", "resource": "gpu:a100-80gb", "nodes": "1", "gpus_per_node": "1",
        "image": str(Image.objects.get(reference="suanli/busybox:latest").pk),
        "custom_image": "", "network": "standard", "zone": "",
        "volumes": "workspace:/workspace", "release_policy": "never", "idle_minutes": "",
    }  # fmt: skip
    data.update(fields)
    return data


def _api(user):
    _, token = ApiToken.issue(user=user, name="ci")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def resize(cluster, body):
        response = client.post(
            f"/api/v1/clusters/{cluster.pk}/resize",
            json.dumps(body),
            content_type="application/json",
        )
        return response.status_code, response.json()

    return resize


@pytest.fixture
def one_node(client, alice, paper_fleet, fund):
    """Alice has 2.00 CNY: enough for 10 minutes of one node (1.30), not of two (2.60)."""
    fund(alice, "2.00")
    client.force_login(alice)
    refused = client.post(reverse("cluster_new"), _form(nodes="2"))
    assert refused.status_code == 200
    assert "creating it needs a balance for 10 minutes (¥2.6000)" in refused.content.decode()
    assert client.post(reverse("cluster_new"), _form()).status_code == 302
    scheduler.place_pending()
    cluster = Cluster.objects.get(owner=alice, name="grow")
    assert cluster.state == Cluster.State.RUNNING and cluster.nodes == 1
    return cluster


def test_the_page_refuses_to_grow_what_it_refused_to_create(client, one_node):
    page = client.post(
        reverse("cluster_resize", args=[one_node.pk]), {"nodes": "2"}, follow=True
    ).content.decode()
    assert "With 2 nodes this cluster costs ¥15.6000/h" in page and SHORT_FOR_TWO in page
    one_node.refresh_from_db()
    assert one_node.nodes == 1 and one_node.node_set.filter(released_at__isnull=True).count() == 1


def test_the_api_refuses_it_with_a_400(alice, one_node):
    status, body = _api(alice)(one_node, {"nodes": 2})
    assert status == 400 and SHORT_FOR_TWO in " ".join(body["fields"]["nodes"])
    one_node.refresh_from_db()
    assert one_node.nodes == 1


def test_with_the_balance_it_grows_and_shrinking_needs_none(client, alice, one_node, fund):
    resize = _api(alice)
    fund(alice, "1.00")  # 3.00 covers 2.60
    status, body = resize(one_node, {"nodes": 2})
    assert status == 200 and body["nodes"] == 2
    billing.post_entry(
        account=billing.account_for(alice), kind="adjustment", amount=Decimal("-3.00"),
        key="test:drain", memo="spent elsewhere",
    )  # fmt: skip
    page = client.post(
        reverse("cluster_resize", args=[one_node.pk]), {"nodes": "1"}, follow=True
    ).content.decode()
    assert "now has 1 node(s)" in page


def test_the_api_resize_checks_its_input(alice, one_node):
    resize = _api(alice)
    assert resize(one_node, {"nodes": True})[1]["fields"] == {"nodes": ["Give a whole number."]}
    assert resize(one_node, {"nodes": "two"})[1]["fields"] == {"nodes": ["Enter a whole number."]}
    assert resize(one_node, {})[0] == 400
    assert resize(one_node, {"nodes": 0})[0] == 400


def test_another_researchers_cluster_is_404(bob, one_node):
    assert _api(bob)(one_node, {"nodes": 2})[0] == 404

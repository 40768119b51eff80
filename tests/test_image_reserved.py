"""Suanli's own images are never fetched from Docker Hub: a researcher cannot type a name of
the `suanli/` namespace or of a catalog image that hosts never pull (whoever owns that name
on Docker Hub is not us, and the pulled tag would pass for the catalog's on that host, for
the next tenant); and a catalog image that is not pullable, on a host that lacks it, fails
the cluster with where it is missing, never a public pull. On the real form, API, engines."""

import json
import uuid

import pytest
from django.test import Client

from console.forms import ClusterForm
from console.models import ApiToken
from jobs.models import Cluster, Image, Node
from tests.forms_data import cluster_form

pytestmark = pytest.mark.django_db

TYPED = [
    "docker.io/suanli/jupyter:2.13-cpu",  # the catalog's, written another way
    "index.docker.io/suanli/busybox:latest",
    "suanli/anything:1.0",  # the namespace itself
    "docker.io/suanli/busybox",  # no tag: latest
]


@pytest.fixture
def hosts(make_paper_host, priced):
    make_paper_host("gpu-paper-a", zone="zone-a", gpus=8)


@pytest.mark.parametrize("reference", TYPED)
def test_the_form_refuses_suanlis_own_names_typed(alice, hosts, reference):
    form = ClusterForm(cluster_form(image="custom", custom_image=reference), owner=alice)
    assert not form.is_valid()
    assert "never pulled from a registry" in form.errors["custom_image"][0]
    assert not Cluster.objects.exists()


def test_a_catalog_image_that_is_not_pullable_is_refused_under_any_name(alice, hosts):
    Image.objects.create(name="Team tool", reference="ghcr.io/team/tool:1", pullable=False)
    for typed in ("ghcr.io/team/tool:2", "GHCR.io/team/tool"):
        form = ClusterForm(cluster_form(image="custom", custom_image=typed), owner=alice)
        assert not form.is_valid() and "never pulled" in form.errors["custom_image"][0]
    form = ClusterForm(
        cluster_form(image="custom", custom_image="ghcr.io/team/other:1"), owner=alice
    )
    assert form.is_valid(), form.errors  # another repository is not reserved


@pytest.mark.parametrize("reference", TYPED[:3])
def test_the_api_refuses_them_too(alice, hosts, reference):
    _, token = ApiToken.issue(user=alice, name="script")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    response = client.post(
        "/api/v1/clusters",
        data=json.dumps(
            {
                "name": "t1",
                "gpu_model": "a100-80gb",
                "nodes": 1,
                "gpus_per_node": 1,
                "image": reference,
            }
        ),
        content_type="application/json",
    )
    body = response.json()
    assert response.status_code == 400, body
    assert "never pulled from a registry" in body["fields"]["image"][0]
    assert not Cluster.objects.exists()


def test_the_api_still_takes_the_catalogs_own_reference(alice, hosts):
    _, token = ApiToken.issue(user=alice, name="script")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    response = client.post(
        "/api/v1/clusters",
        data=json.dumps(
            {
                "name": "t1",
                "gpu_model": "a100-80gb",
                "nodes": 1,
                "gpus_per_node": 1,
                "image": "suanli/busybox:latest",
            }
        ),
        content_type="application/json",
    )
    assert response.status_code in (200, 201, 202), response.content


def test_a_non_pullable_catalog_image_missing_on_its_host_fails_and_is_never_pulled(
    make_host, make_cluster, alice, priced, work_queue
):
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2, check="reuse")
    missing = f"suanli/never-built-{uuid.uuid4().hex[:8]}:1"
    Image.objects.create(name=f"Never built {missing}", reference=missing, pullable=False)
    cluster = make_cluster(alice, "no-such", gpus=1, release_policy="never", volumes=())
    Cluster.objects.filter(pk=cluster.pk).update(image_reference=missing)
    from jobs.placement import scheduler

    scheduler.place_pending()
    work_queue()  # the worker: its workspace's start, then the clean-up

    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.FAILED, cluster.state_reason
    assert cluster.state_reason.startswith("could not start (nothing was charged): ")
    assert f"{missing} is not on host gpu-a-01 and is never pulled" in cluster.state_reason
    assert not Node.objects.filter(cluster=cluster, started_at__isnull=False).exists()


def _reserved_cluster(make_paper_host, make_cluster, alice, *, on_second: bool):
    """Two paper hosts of the same pool; a catalog image hosts never pull, recorded by the
    second one's check only (large enough for the cluster's node, or, `on_second=False`, of
    1 GPU: too small)."""
    from jobs.placement import scheduler
    from tests.conftest import TEST_IMAGE

    ref = f"suanli/reserved-{uuid.uuid4().hex[:8]}:1"
    image = Image.objects.create(name=f"Reserved {ref}", reference=ref, pullable=False)
    make_paper_host("gpu-paper-a", zone="zone-a", gpus=8)
    make_paper_host(
        "gpu-paper-b", zone="zone-a", gpus=8 if on_second else 1, images=[TEST_IMAGE, ref]
    )
    cluster = make_cluster(alice, "reserved", gpus=2, release_policy="never", volumes=())
    Cluster.objects.filter(pk=cluster.pk).update(image=image, image_reference=ref)
    scheduler.place_pending()
    cluster.refresh_from_db()
    return cluster, ref


def test_a_non_pullable_catalog_image_is_placed_only_on_a_host_that_has_it(
    make_paper_host, make_cluster, alice, priced
):
    cluster, _ref = _reserved_cluster(make_paper_host, make_cluster, alice, on_second=True)
    assert cluster.state == Cluster.State.RUNNING, cluster.state_reason
    assert {n.host.name for n in cluster.node_set.select_related("host")} == {"gpu-paper-b"}


def test_with_no_host_large_enough_having_it_the_cluster_waits_saying_which_image(
    make_paper_host, make_cluster, alice, priced
):
    cluster, ref = _reserved_cluster(make_paper_host, make_cluster, alice, on_second=False)
    assert cluster.state == Cluster.State.PENDING
    assert not Node.objects.filter(cluster=cluster).exists()
    assert f"has the image {ref}, which hosts never pull" in cluster.state_reason

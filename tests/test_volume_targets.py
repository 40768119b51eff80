"""A volume's container path is normalised before the system-path check: every spelling
of /etc (two or three leading slashes, `.` components, trailing slashes) is refused, on the
form and through the API, with the normalised path in the message."""

import json

import pytest
from django.test import Client

from console.forms import ClusterForm, JobForm
from console.models import ApiToken
from jobs.models import Cluster, Image

pytestmark = pytest.mark.django_db

SPELLINGS = [
    ("//etc", "/etc"),
    ("/./etc", "/etc"),
    ("/etc/", "/etc"),
    ("///etc//", "/etc"),
    ("//etc/ssh", "/etc/ssh"),
    ("/.//proc/.", "/proc"),
    ("//var//run/", "/var/run"),
    ("//", "/"),
]


def _message(normal: str) -> str:
    if normal == "/":
        return "A volume cannot cover the whole container (/)"
    return f"'{normal}' is a system path of the container; mount your data under /workspace"


def _cluster_data(volumes: str) -> dict:
    return {
        "name": "vols", "resource": "gpu:a100-80gb", "nodes": "1", "gpus_per_node": "1",
        "image": str(Image.objects.get(reference="suanli/busybox:latest").pk),
        "network": "standard", "volumes": volumes, "release_policy": "never",
    }  # fmt: skip


@pytest.mark.parametrize("target,normal", SPELLINGS)
def test_the_cluster_form_refuses_every_spelling_of_a_system_path(
    alice, catalog, storage_root, target, normal
):
    form = ClusterForm(_cluster_data(f"workspace:{target}"), owner=alice)
    assert not form.is_valid()
    assert _message(normal) in " ".join(form.errors["volumes"])


def test_other_paths_are_kept_in_their_normal_form(alice, catalog, storage_root):
    form = ClusterForm(_cluster_data("workspace://workspace//data/./\n"), owner=alice)
    form.is_valid()
    assert "volumes" not in form.errors
    assert [v.target for v in form.cleaned_data["volumes"]] == ["/workspace/data"]


@pytest.mark.parametrize("target,normal", SPELLINGS[:4])
def test_the_checkpoint_directory_is_checked_the_same_way(target, normal):
    form = JobForm({"name": "j", "command": "true", "launcher": "plain", "workdir": "/workspace",
                    "checkpoint_dir": target, "retries": "0"})  # fmt: skip
    assert not form.is_valid()
    assert _message(normal) in form.errors["checkpoint_dir"][0]


@pytest.mark.parametrize("target,normal", SPELLINGS)
def test_the_api_refuses_every_spelling_with_a_400(alice, priced, storage_root, target, normal):
    _, token = ApiToken.issue(user=alice, name="ci")
    response = Client(HTTP_AUTHORIZATION=f"Bearer {token}").post(
        "/api/v1/clusters",
        json.dumps({"name": "vols", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
                    "image": "suanli/busybox:latest", "volumes": [f"workspace:{target}"]}),
        content_type="application/json",
    )  # fmt: skip
    assert response.status_code == 400
    assert _message(normal) in " ".join(response.json()["fields"]["volumes"])
    assert not Cluster.objects.exists()


def test_a_volume_inside_a_read_only_one_is_refused_with_where_to_put_it(
    alice, catalog, storage_root
):
    """The engine would fail the container's start (it cannot make the inner mount point
    in a read-only folder): the form says so, and a writable outer volume is fine."""
    form = ClusterForm(_cluster_data("code:/workspace:ro\nout:/workspace/out"), owner=alice)
    assert not form.is_valid()
    assert (
        "Line 2: /workspace/out is inside the read-only volume /workspace, where its mount "
        "point cannot be made: mount it beside it (e.g. /out) or make /workspace writable."
    ) in form.errors["volumes"]
    fine = ClusterForm(_cluster_data("code:/workspace\nout:/workspace/out:ro"), owner=alice)
    fine.is_valid()
    assert "volumes" not in fine.errors

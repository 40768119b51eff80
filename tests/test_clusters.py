"""Researchers create, watch, resize and release clusters from the console."""

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from django.urls import reverse
from forms_data import cluster_form

from jobs import tasks
from jobs.clusters import services
from jobs.models import Cluster, ClusterEvent, GpuSlot, Volume
from jobs.placement import scheduler

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("priced")]


def _form(**fields):
    return cluster_form(**fields)


def _ssh_line(key) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        .decode()
    )


@pytest.fixture
def fleet(make_host):
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=8, check="reuse")
    make_host("gpu-b-01", engine=1, zone="zone-b", gpus=8, check="reuse")


def test_form_shows_free_gpus_per_zone_and_the_zone_note(client, alice, fleet):
    client.force_login(alice)
    body = client.get(reverse("cluster_new")).content.decode()
    assert "A100 80 GB — 16 free (zone-a 8, zone-b 8)" in body
    assert "T4 16 GB — no host now" in body
    assert "about 5 % more communication time" in body
    assert "none does now" in body, "RDMA is offered only where RDMA hosts exist"


def test_create_places_and_the_page_shows_where_each_node_runs(client, alice, fleet, storage_root):
    client.force_login(alice)
    response = client.post(
        reverse("cluster_new"),
        _form(
            nodes="2",
            gpus_per_node="8",
            volumes="datasets:/workspace/data:ro\nworkspace:/workspace",
        ),
    )
    assert response.status_code == 302
    cluster = Cluster.objects.get(name="train-1", owner=alice)
    assert cluster.state == Cluster.State.PENDING
    assert (storage_root / f"u{alice.pk}" / "datasets").is_dir()
    assert sorted(str(v) for v in Volume.objects.filter(cluster=cluster)) == [
        "datasets:/workspace/data:ro",
        "workspace:/workspace",
    ]
    scheduler.place_pending()
    page = client.get(response.url).content.decode()
    assert "running" in page
    assert "gpu-a-01" in page and "gpu-b-01" in page
    assert "GPU 0, 1, 2, 3, 4, 5, 6, 7" in page
    assert "placed: node 0 on" in page


def test_pending_cluster_shows_queue_position_and_reason(client, alice, bob, fleet, make_cluster):
    make_cluster(bob, "first", nodes=2, gpus=8)
    scheduler.place_pending()
    make_cluster(bob, "blocked", nodes=1, gpus=8, zone="zone-b")
    c = make_cluster(alice, "mine", nodes=2, gpus=8, zone="zone-b")
    scheduler.place_pending()
    client.force_login(alice)
    body = client.get(reverse("cluster_detail", args=[c.pk])).content.decode()
    assert 'data-testid="queue-position">2<' in body
    assert "waiting for 2 x 8 A100 80 GB in zone-b; room for no node now (0 GPUs free)" in body


@pytest.mark.parametrize(
    "fields, field, words",
    [
        ({"nodes": "0"}, "nodes", "greater than or equal to 1"),
        ({"nodes": "-2"}, "nodes", "greater than or equal to 1"),
        ({"nodes": "99"}, "nodes", "At most 16 nodes"),
        ({"gpus_per_node": "0"}, "gpus_per_node", "greater than or equal to 1"),
        ({"gpus_per_node": "9"}, "gpus_per_node", "x 8 GPUs of A100 80 GB: the largest host has 8"),
        ({"resource": "gpu:b200"}, "resource", "Select a valid choice"),
        ({"resource": "gpu:t4-16gb"}, "resource", "No host offers T4 16 GB"),
        ({"zone": "zone-x"}, "zone", "Select a valid choice"),
        ({"network": "rdma"}, "network", "Select a valid choice"),
        (
            {"image": "custom", "custom_image": "Not An Image!"},
            "custom_image",
            "Not a Docker image reference",
        ),
        ({"image": "custom", "custom_image": ""}, "custom_image", "Give the image reference"),
        ({"volumes": "data:./data"}, "volumes", "Write /workspace/data instead"),
        ({"volumes": "data:/etc"}, "volumes", "system path"),
        ({"volumes": "data:/"}, "volumes", "cannot cover the whole container"),
        ({"volumes": "data:/var/run/docker.sock"}, "volumes", "system path"),
        ({"volumes": "../../etc:/workspace/x"}, "volumes", "contains"),
        ({"volumes": "/etc:/workspace/x"}, "volumes", "is absolute"),
        ({"volumes": "data:/workspace/../etc"}, "volumes", "contains"),
        ({"volumes": "a:/workspace/x\nb:/workspace/x"}, "volumes", "mounted twice"),
        (
            {"volumes": "datasets/imagenet:/workspace/data:ro"},
            "volumes",
            "Mount datasets:/workspace/data:ro instead and use /workspace/data/imagenet",
        ),
        ({"volumes": ".:/workspace"}, "volumes", "not your whole storage"),
        ({"volumes": "just-a-path"}, "volumes", "write storage-path:container-path"),
        ({"release_policy": "idle"}, "idle_minutes", "After how many idle minutes"),
        ({"name": "Bad Name!"}, "name", "letters, digits"),
    ],
)
def test_bad_input_gets_a_clear_message_and_creates_nothing(
    client, alice, fleet, fields, field, words
):
    client.force_login(alice)
    response = client.post(reverse("cluster_new"), _form(**fields))
    assert response.status_code == 200
    errors = " ".join(response.context["form"].errors.get(field, []))
    assert words in errors, response.context["form"].errors
    assert not Cluster.objects.exists() and not Volume.objects.exists()


def test_relative_volume_error_says_what_to_write(client, alice, fleet):
    client.force_login(alice)
    body = client.post(reverse("cluster_new"), _form(volumes="data:./data")).content.decode()
    assert (
        "&#x27;./data&#x27; is relative: container paths must be absolute. Write /workspace/data instead."
        in body
    )


def test_symlink_escape_from_storage_is_refused(client, alice, fleet, storage_root, tmp_path):
    root = storage_root / f"u{alice.pk}"
    root.mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    (root / "sneaky").symlink_to(tmp_path / "secret")
    client.force_login(alice)
    response = client.post(reverse("cluster_new"), _form(volumes="sneaky:/workspace/x"))
    assert "'sneaky' in your storage is a symbolic link" in " ".join(
        response.context["form"].errors["volumes"]
    )
    assert not Cluster.objects.exists()


def test_rdma_is_offered_where_rdma_hosts_exist(client, alice, make_host):
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=8, check="reuse")
    make_host("ib-b-01", engine=1, zone="zone-b", gpus=8, rdma=True, check="reuse")
    client.force_login(alice)
    response = client.post(reverse("cluster_new"), _form(network="rdma", zone="zone-a"))
    assert "RDMA A100 80 GB hosts are in zone-b only" in " ".join(
        response.context["form"].errors["zone"]
    )
    response = client.post(reverse("cluster_new"), _form(network="rdma", zone="zone-b"))
    assert response.status_code == 302
    assert Cluster.objects.get().network == "rdma"


def test_cpu_only_cluster_from_the_form(client, alice, fleet):
    client.force_login(alice)
    response = client.post(
        reverse("cluster_new"), _form(resource="cpu:cpu-2c-4g", gpus_per_node="")
    )
    assert response.status_code == 302
    cluster = Cluster.objects.get()
    assert cluster.is_cpu_only and cluster.gpus_per_node == 0
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.RUNNING


def test_another_researcher_gets_404_everywhere(client, alice, bob, fleet, make_cluster):
    c = make_cluster(alice, "private", gpus=2)
    scheduler.place_pending()
    client.force_login(bob)
    for url in ("cluster_detail", "cluster_status"):
        assert client.get(reverse(url, args=[c.pk])).status_code == 404
    for url in ("cluster_release", "cluster_resize"):
        assert client.post(reverse(url, args=[c.pk]), {"nodes": "2"}).status_code == 404
    assert "private" not in client.get(reverse("cluster_list")).content.decode()
    c.refresh_from_db()
    assert c.state == Cluster.State.RUNNING and c.nodes == 1


def test_release_button_frees_gpus_and_the_timeline_says_so(client, alice, fleet, make_cluster):
    c = make_cluster(alice, "done", gpus=8)
    scheduler.place_pending()
    client.force_login(alice)
    response = client.post(reverse("cluster_release", args=[c.pk]), follow=True)
    body = response.content.decode()
    assert "Cluster done released; its GPUs are free again." in body
    # Held until the removal task's engine confirms its containers are gone (none here).
    assert GpuSlot.objects.filter(node__cluster=c).count() == 8
    assert tasks.cluster_network_remove(c.pk)
    assert GpuSlot.objects.filter(node__isnull=False).count() == 0
    assert list(ClusterEvent.objects.filter(cluster=c).values_list("kind", flat=True)) == [
        "pending", "running", "releasing", "released",
    ]  # fmt: skip
    again = client.post(reverse("cluster_release", args=[c.pk]), follow=True).content.decode()
    assert "already released" in again


def test_release_needs_post_and_csrf(alice, fleet, make_cluster):
    from django.test import Client

    c = make_cluster(alice, "csrf", gpus=1)
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(alice)
    assert strict.get(reverse("cluster_release", args=[c.pk])).status_code == 405
    assert strict.post(reverse("cluster_release", args=[c.pk])).status_code == 403
    c.refresh_from_db()
    assert c.state == Cluster.State.PENDING


def test_resize_from_the_page(client, alice, fleet, make_cluster):
    c = make_cluster(alice, "grow", gpus=8)
    scheduler.place_pending()
    client.force_login(alice)
    body = client.post(
        reverse("cluster_resize", args=[c.pk]), {"nodes": "2"}, follow=True
    ).content.decode()
    assert "now has 2 node(s)" in body
    body = client.post(
        reverse("cluster_resize", args=[c.pk]), {"nodes": "3"}, follow=True
    ).content.decode()
    # Two 8-GPU hosts: a third node could never fit, and the refusal says what would.
    assert "At most 2 nodes x 8 GPUs of A100 80 GB" in body
    body = client.post(
        reverse("cluster_resize", args=[c.pk]), {"nodes": "0"}, follow=True
    ).content.decode()
    assert "greater than or equal to 1" in body
    c.refresh_from_db()
    assert c.nodes == 2


def test_operator_queue_page_lists_pending_with_reasons(
    client, operator, alice, fleet, make_cluster
):
    make_cluster(alice, "huge", nodes=3, gpus=8)
    scheduler.place_pending()
    client.force_login(operator)
    body = client.get(reverse("ops_queue")).content.decode()
    assert "huge" in body and "room for 2 of 3 nodes now" in body
    assert "can never delay it" in body


def test_operator_drains_from_the_hosts_page_and_sees_occupancy(
    client, operator, alice, make_host, make_cluster
):
    host = make_host("gpu-a-01", engine=0, gpus=8, check="reuse")
    make_cluster(alice, "three", gpus=3)
    scheduler.place_pending()
    client.force_login(operator)
    body = client.get(reverse("ops_hosts")).content.decode()
    assert "3 of 8 held" in body
    client.post(reverse("ops_host_drain", args=[host.pk]), {"draining": "1"})
    host.refresh_from_db()
    assert host.state == "draining"
    client.post(reverse("ops_host_drain", args=[host.pk]), {"draining": "0"})
    host.refresh_from_db()
    assert host.state == "active"


def test_ssh_keys_are_parsed_fingerprinted_and_garbage_refused(client, alice, bob):
    client.force_login(alice)
    good = _ssh_line(ed25519.Ed25519PrivateKey.generate()) + " alice@laptop"
    response = client.post(reverse("ssh_keys"), {"name": "", "public_key": good}, follow=True)
    body = response.content.decode()
    assert "Key alice@laptop added (SHA256:" in body and "ssh-ed25519 (256 bits)" in body
    dup = client.post(reverse("ssh_keys"), {"name": "again", "public_key": good}).content.decode()
    assert "You have added this key already." in dup
    weak = _ssh_line(rsa.generate_private_key(public_exponent=65537, key_size=1024))  # noqa: S505 (the weak key under test)
    assert (
        "has 1024 bits; use at least 2048"
        in client.post(reverse("ssh_keys"), {"public_key": weak}).content.decode()
    )
    rsa_ok = _ssh_line(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    client.post(reverse("ssh_keys"), {"name": "rsa", "public_key": rsa_ok})
    for garbage in ("hello", "ssh-ed25519 !!!notbase64", "ssh-rsa AAAAB3NzaC1yc2E= x"):
        body = client.post(reverse("ssh_keys"), {"public_key": garbage}).content.decode()
        assert "not an OpenSSH public key" in body or "Paste one public key line" in body
    assert alice.ssh_keys.count() == 2
    key = alice.ssh_keys.first()
    client.force_login(bob)
    assert client.post(reverse("ssh_key_delete", args=[key.pk])).status_code == 404
    assert alice.ssh_keys.count() == 2


def test_cluster_can_carry_only_its_owners_keys(client, alice, bob, fleet):
    bobs = services.ssh_key_add(
        owner=bob, name="bob", public_key=_ssh_line(ed25519.Ed25519PrivateKey.generate())
    )
    mine = services.ssh_key_add(
        owner=alice, name="me", public_key=_ssh_line(ed25519.Ed25519PrivateKey.generate())
    )
    client.force_login(alice)
    response = client.post(reverse("cluster_new"), {**_form(), "ssh_keys": [str(bobs.pk)]})
    assert "Select a valid choice" in " ".join(response.context["form"].errors["ssh_keys"])
    response = client.post(reverse("cluster_new"), {**_form(), "ssh_keys": [str(mine.pk)]})
    assert response.status_code == 302
    assert list(Cluster.objects.get().ssh_keys.all()) == [mine]


def test_operator_releases_a_cluster_from_the_admin(client, operator, alice, fleet, make_cluster):
    c = make_cluster(alice, "stuck", gpus=8)
    scheduler.place_pending()
    client.force_login(operator)
    assert client.get(reverse("admin:jobs_cluster_change", args=[c.pk])).status_code == 200
    response = client.post(
        reverse("admin:jobs_cluster_changelist"),
        {"action": "release", "_selected_action": [str(c.pk)]},
    )
    assert response.status_code == 302
    c.refresh_from_db()
    assert c.state == Cluster.State.RELEASED and c.state_reason == "released by operator olga"
    assert tasks.cluster_network_remove(c.pk)  # its GPUs back once the engine confirms
    assert GpuSlot.objects.filter(node__isnull=False).count() == 0


def test_form_preselects_a_gpu_model_that_is_available(client, alice, fleet):
    client.force_login(alice)
    form = client.get(reverse("cluster_new")).context["form"]
    assert form["resource"].value() == "gpu:a100-80gb"

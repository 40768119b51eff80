"""A researcher's quota is the filesystem's, not the console's word: inside her real
workspace on a test host (its own mount namespace, MooseFS mounted in it), a write past
her quota fails with "Disk quota exceeded"; once she buys more on the storage page, the
MooseFS quota of her root is raised and the same write goes through; she cannot then lower
it below what her files take. Bob's quota is not hers to see or change."""

import os
from decimal import Decimal

import pytest
from django.urls import reverse

from jobs import tasks
from jobs.files import storage
from jobs.files.storage import VolumeSpec
from jobs.nodes import workspaces

pytestmark = pytest.mark.django_db

FREE = "0.01"  # GB: 10.7 MB, so that a 20 MB write is past it
WRITE = "dd if=/dev/zero of=/workspace/big bs=1M count=20 2>&1; echo rc=$?"


def _run(container, script: str) -> str:
    _code, out = container.exec_run(
        ["/bin/sh", "-c", script], user=container.attrs["Config"]["User"]
    )
    return out.decode()


@pytest.fixture
def small_quota(settings, rate_card, fund, alice, bob):
    assert os.environ.get("SUANLI_STORAGE_FS") == "moosefs", "run with `make test` (MooseFS)"
    settings.SUANLI_STORAGE_FS = "moosefs"
    settings.SUANLI_STORAGE_FREE_GB = FREE
    rate_card({}, storage_per_gb_hour=Decimal("0.0003"))
    fund(alice, "10")
    fund(bob, "10")


def test_a_write_past_the_quota_fails_in_her_container_until_she_buys_more(
    small_quota, running_cluster, alice, client
):
    cluster = running_cluster(1, volumes=(VolumeSpec("work", "/workspace"),))
    root = storage.tenant_root(alice.pk)
    assert storage.quota_read(root) == storage.gb_bytes(Decimal(FREE)), "set when the root was made"
    tasks.cluster_network_ensure(cluster.pk)  # makes its network and starts its workspace
    workspace = workspaces.running(cluster, 0)

    out = _run(workspace, WRITE)
    assert "Disk quota exceeded" in out and "rc=1" in out, out

    client.force_login(alice)
    response = client.post(reverse("storage"), {"extra_gb": "1"}, follow=True)
    assert 'data-testid="storage-bought">1 GB<' in response.content.decode()
    assert storage.quota_read(root) == storage.gb_bytes(Decimal(FREE) + 1)

    out = _run(workspace, WRITE)
    assert "rc=0" in out, out
    assert _run(workspace, "ls -l /workspace/big").split()[4] == str(20 * 2**20)

    # 20 MB now take more than the free part alone holds: going back to it is refused.
    response = client.post(reverse("storage"), {"extra_gb": "0"})
    assert response.status_code == 200
    assert "Your files take 0.02 GB" in response.content.decode()
    assert storage.quota_read(root) == storage.gb_bytes(Decimal(FREE) + 1)
    page = client.get(reverse("storage")).content.decode()
    assert 'data-testid="storage-used">0.02 GB<' in page
    assert 'data-testid="storage-quota">1.01 GB<' in page


@pytest.mark.engine  # MooseFS (small_quota)
def test_her_posts_never_reach_bobs_quota(small_quota, alice, bob, client, storage_root):
    from billing import storage as bought

    bought.quota_set(owner=bob, extra_gb=7)
    bobs_root = storage.tenant_root(bob.pk)
    bobs = storage.gb_bytes(Decimal(FREE) + 7)
    assert storage.quota_read(bobs_root) == bobs

    client.force_login(alice)
    # Every name a guesser would try for "whose": the form has none, the page reads none.
    for field in ("owner", "owner_id", "user", "user_id", "account", "id"):
        client.post(reverse("storage"), {"extra_gb": "0", field: str(bob.pk)})
    page = client.get(reverse("storage"), {"user": bob.pk, "owner": bob.pk}).content.decode()
    assert 'data-testid="storage-bought">0 GB<' in page, "hers, not his"
    assert client.get(f"/storage/{bob.pk}/").status_code == 404
    assert client.get(f"/storage/u{bob.pk}/").status_code == 404
    assert storage.extra_gb(bob.pk) == 7
    assert storage.quota_read(bobs_root) == bobs
    client.logout()
    assert client.get(reverse("storage")).status_code == 302  # to the log-in

"""The ways around a researcher's storage quota, closed or watched (MooseFS):

* the number of files: a hard inode quota (SUANLI_STORAGE_FILES_MAX), so her container
  cannot fill the master's memory with empty files;
* the trash: her root's trash time is 0, so a file she deletes frees its room at once
  rather than waiting, in no folder and under no quota, in the trash;
* a file deleted while still open ("sustained") is in no folder either: no quota stops it,
  so past SUANLI_STORAGE_SUSTAINED_MAX_GB in all, a guard run every minute stops the running
  clusters of whoever holds such files (their files kept), which ends the processes that
  hold them (the filesystem frees the space once their mounts let go); the hourly
  upkeep and the operators' Revenue page name the holders;
* the quota's writers: a start racing a lowering of the bought size writes the lowered
  size (one advisory lock per researcher), a container's create writes nothing, and the
  hourly upkeep writes every root's quota again from what was bought."""

import logging
import os
import threading
from decimal import Decimal
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.urls import reverse
from django.utils import timezone

from jobs import tasks
from jobs.files import storage
from jobs.files.storage import VolumeSpec
from jobs.models import StorageGrant
from jobs.nodes import runtime, workspaces

FREE = "0.01"  # GB: 10.7 MB


def _run(container, script: str) -> str:
    _code, out = container.exec_run(
        ["/bin/sh", "-c", script], user=container.attrs["Config"]["User"]
    )
    return out.decode()


def _until(check, what: str, tries: int = 600):
    """Polls `check` (0.1 s apart) until it is true; fails naming `what` if it never is."""
    import time

    for _ in range(tries):
        if found := check():
            return found
        time.sleep(0.1)
    raise AssertionError(f"never: {what}")


@pytest.fixture
def small_quota(settings, rate_card, fund, alice, bob, storage_root):
    assert os.environ.get("SUANLI_STORAGE_FS") == "moosefs", "run with `make test` (MooseFS)"
    settings.SUANLI_STORAGE_FS = "moosefs"
    settings.SUANLI_STORAGE_FREE_GB = FREE
    rate_card({}, storage_per_gb_hour=Decimal("0.0003"))
    fund(alice, "10")
    fund(bob, "10")


# -- without the filesystem -------------------------------------------------------------------


def test_the_file_count_is_what_is_under_the_root(settings, tmp_path):
    settings.SUANLI_STORAGE_FS = "local"
    settings.SUANLI_STORAGE_ROOT = tmp_path
    root = storage.tenant_root(3)
    (root / "work" / "sub").mkdir(parents=True)
    for name in ("a", "b", "sub/c"):
        (root / "work" / name).write_text("12345")
    used = storage.usage(3)
    assert (used.bytes, used.files) == (15, 5)  # work, sub, a, b, c
    assert storage._counted(6, 100) == storage.Usage(100, files=5), "mfsdirinfo counts the root"


@pytest.mark.parametrize("most", [0, -5, "many"])
def test_a_file_limit_that_is_no_number_of_files_is_refused(settings, most):
    settings.SUANLI_STORAGE_FILES_MAX = most
    with pytest.raises(ImproperlyConfigured, match="SUANLI_STORAGE_FILES_MAX"):
        storage.files_max()


def test_sustained_space_is_over_only_past_the_threshold(settings):
    settings.SUANLI_STORAGE_SUSTAINED_MAX_GB = 1
    at = storage.Orphans(storage.GB, 1, 0, {})
    assert not at.over
    assert storage.Orphans(storage.GB + 2**24, 1, 0, {}).over


# -- on MooseFS, in her container ---------------------------------------------------------------

real = pytest.mark.django_db


@real
def test_files_past_her_file_limit_fail_in_her_container(
    small_quota, settings, running_cluster, alice, client
):
    settings.SUANLI_STORAGE_FILES_MAX = 20
    cluster = running_cluster(1, volumes=(VolumeSpec("work", "/workspace"),))
    root = storage.tenant_root(alice.pk)
    assert storage.quota_read(root, "inodes") == 20, "set when the root was made"
    tasks.cluster_network_ensure(cluster.pk)
    workspace = workspaces.running(cluster, 0)

    # Her folder `work` is one of the 20: 19 empty files fit, the 20th does not.
    out = _run(
        workspace,
        "for i in $(seq 1 30); do touch /workspace/f$i 2>&1 || { echo stopped at $i; break; }; done",
    )
    assert "Disk quota exceeded" in out and "stopped at 20" in out, out
    assert "Disk quota exceeded" in _run(workspace, "mkdir /workspace/d 2>&1")

    client.force_login(alice)
    page = client.get(reverse("storage")).content.decode()
    assert 'data-testid="storage-files-used">20<' in page
    assert 'data-testid="storage-files-max">20<' in page
    assert 'data-testid="storage-files-full"' in page

    _run(workspace, "rm /workspace/f1 /workspace/f2")
    assert "rc=0" in _run(workspace, "touch /workspace/again; echo rc=$?")


@real
@pytest.mark.engine  # MooseFS (small_quota)
def test_a_deleted_file_frees_its_room_at_once_not_after_a_day_in_the_trash(
    small_quota, settings, alice
):
    root = storage.tenant_root(alice.pk)
    (work,) = storage.ensure_folders(root, [VolumeSpec("work", "/workspace")])
    work = Path(work)
    assert storage.trash_time(root) == 0, "set when the root was made"
    (work / "new").write_bytes(b"x")
    assert storage.trash_time(work / "new") == 0, "a file inherits its folder's"

    # A root of the layout before (MooseFS's default: a deleted file stays a day in the
    # trash, in no folder, so under no quota): the hourly upkeep fixes it and its files.
    storage._mfs("mfssettrashtime", "-r", "86400", str(root))
    assert storage.trash_time(work / "new") == 86400
    tasks.storage_upkeep()
    assert storage.trash_time(root) == 0
    assert storage.trash_time(work / "new") == 0


@real
def test_a_file_she_deleted_but_holds_open_is_named_to_the_operators(
    small_quota, settings, running_cluster, alice, operator, client, caplog
):
    settings.SUANLI_STORAGE_SUSTAINED_MAX_GB = 0
    cluster = running_cluster(1, volumes=(VolumeSpec("work", "/workspace"),))
    root = storage.tenant_root(alice.pk)
    tasks.cluster_network_ensure(cluster.pk)
    workspace = workspaces.running(cluster, 0)

    # The attack: open, delete, write on. The file is in no folder: her 10.7 MB quota does
    # not stop 20 MB (this is the hole the operators are told about, not one that is shut).
    workspace.exec_run(
        [
            "/bin/sh",
            "-c",
            "echo $$ > /tmp/holder; exec 3>/workspace/held; rm /workspace/held; "
            "dd if=/dev/zero bs=1M count=20 >&3 2>/dev/null; echo rc=$? > /workspace/written; "
            "exec sleep 600",
        ],
        user=workspace.attrs["Config"]["User"],
        detach=True,
    )
    _until(lambda: (root / "work" / "written").exists(), "the holder wrote")
    assert (root / "work" / "written").read_text().strip() == "rc=0"
    try:
        found = storage.orphans()
        assert found.by_owner.get(alice.pk, 0) >= 1
        assert found.sustained_bytes >= 20 * 2**20
        assert storage.usage(alice.pk).bytes < storage.gb_bytes(Decimal(FREE)), "no quota sees it"

        with caplog.at_level(logging.ERROR, logger="jobs.files.storage"):
            tasks.storage_upkeep()
        assert any(f"u{alice.pk}: " in r.getMessage() for r in caplog.records), caplog.text

        client.force_login(operator)
        page = client.get(reverse("ops_billing")).content.decode()
        assert 'data-testid="storage-unbounded"' in page
        assert "<strong>alice</strong>" in page

        # The bound: the minute's guard stops her running cluster (her files kept); its
        # workspace stopped, the holder's file is closed and its space is freed.
        assert tasks.storage_orphans_guard() == {"over": True, "stopped": [cluster.pk]}
        cluster.refresh_from_db()
        assert cluster.state == "stopped"
        assert any("deleted but still open" in e.message for e in cluster.events.all())
        workspaces.stop(cluster.pk)
        workspace.reload()
        assert workspace.status == "exited", "the process holding the file is gone"
        assert (root / "work" / "written").exists(), "her files are kept"
    finally:
        workspace.reload()
        if workspace.status == "running":
            _run(workspace, "kill $(cat /tmp/holder)")


@pytest.mark.django_db(transaction=True)  # a racing thread, its own connection
@pytest.mark.engine  # MooseFS (small_quota)
def test_a_start_racing_a_lowering_writes_the_lowered_quota(small_quota, bob):
    from billing import storage as bought

    bought.quota_set(owner=bob, extra_gb=5)
    root = storage.tenant_root(bob.pk)
    assert storage.quota_read(root) == storage.gb_bytes(Decimal(FREE) + 5)
    applied = []

    def start():  # what a cluster's start does, on a connection of its own
        try:
            applied.append(storage.quota_apply(bob.pk))
        finally:
            connection.close()

    # The lowering: the new size written, the lock held, not committed yet.
    with transaction.atomic():
        storage.quota_lock(bob.pk)
        StorageGrant.objects.create(owner=bob, since=timezone.now(), extra_gb=1)
        racer = threading.Thread(target=start)
        racer.start()

        def waiting() -> bool:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                    " AND classid = %s AND objid = %s",
                    [storage.QUOTA_LOCK, bob.pk],
                )
                return cursor.fetchone()[0] > 0

        _until(waiting, "the start waits for the lowering's lock")
    racer.join()
    assert applied == [True]
    assert storage.quota_read(root) == storage.gb_bytes(Decimal(FREE) + 1), "not the old 5 GB"


@real
@pytest.mark.engine  # MooseFS (small_quota)
def test_a_containers_create_writes_no_quota_the_hourly_upkeep_does(
    small_quota, settings, make_cluster, alice
):
    settings.SUANLI_STORAGE_FILES_MAX = 1000
    cluster = make_cluster(alice, volumes=(VolumeSpec("work", "/workspace"),))
    root = storage.tenant_root(alice.pk)
    assert storage.quota_read(root) == storage.gb_bytes(Decimal(FREE))
    assert storage.quota_read(root, "inodes") == 1000

    storage.quota_write(root, 12345678, 7)  # drifted: a write that went wrong, a hand's
    runtime.volume_mounts(cluster, alice.pk)  # each replica's and sftp session's create
    assert storage.quota_read(root) == 12345678, "a container's create writes nothing"

    report = tasks.storage_upkeep()
    assert report["applied"] == 1 and report["failed"] == []
    assert storage.quota_read(root) == storage.gb_bytes(Decimal(FREE))
    assert storage.quota_read(root, "inodes") == 1000

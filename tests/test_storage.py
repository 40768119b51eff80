"""Researchers' storage as a tenant attacks it (jobs/files/storage.py, docs/architecture.md, "The Docker contract": mounts).

Alice is the tenant: a shell in her containers, running as her uid, and whatever her
volumes mount. In the layout before this one her storage root was hers, so she could swap
a folder that a volume named for a link to `/` between the console's check and the
engine's mount (issue 14). Now her root is the console's and a volume mounts one whole
folder of it. Each test is one thing she tries; tests/test_isolation_mounts.py races it on
the real engines.
"""

import errno
import json
import os
import stat

import pytest
from django.core.exceptions import ValidationError

from jobs.files import storage
from jobs.files.storage import VolumeSpec
from jobs.models import Volume
from jobs.nodes import runtime

pytestmark = pytest.mark.django_db

AS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not AS_ROOT, reason="the layout's owners need the console as root")


@pytest.fixture
def root(storage_root, alice):
    return storage.tenant_root(alice.pk)


@pytest.fixture
def uid(alice):
    return runtime.tenant_uid(alice.pk)


def _errors(text, root):
    with pytest.raises(ValidationError) as caught:
        storage.parse_volumes(text, root=root)
    return " ".join(caught.value.messages)


def _as_tenant(uid: int, root, attempts):
    """Run `attempts(root_fd)` in a child process that has become the tenant's uid (as her
    containers are: no capabilities); returns {what: errno name or "ok"}."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)  # opened as the console, then handed over
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.write(write, json.dumps(attempts(fd)).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.close(fd)
    with os.fdopen(read) as pipe:
        out = pipe.read()
    os.waitpid(pid, 0)
    return json.loads(out)


def _try(fn):
    try:
        fn()
        return "ok"
    except OSError as exc:
        return errno.errorcode[exc.errno]


# -- the layout -------------------------------------------------------------------------


@needs_root
def test_her_root_is_the_consoles_and_the_folders_in_it_are_hers(make_cluster, alice, root, uid):
    make_cluster(alice, volumes=(VolumeSpec("datasets", "/workspace/data"),))
    found = os.lstat(root)
    assert (found.st_uid, found.st_gid, stat.S_IMODE(found.st_mode)) == (0, 0, 0o711)
    folder = os.lstat(root / "datasets")
    assert (folder.st_uid, folder.st_gid, stat.S_IMODE(folder.st_mode)) == (uid, uid, 0o700)


@needs_root
def test_as_her_uid_she_cannot_rename_remove_or_replace_a_folder_only_use_it(
    make_cluster, alice, root, uid
):
    make_cluster(alice, volumes=(VolumeSpec("datasets", "/workspace/data"),))

    def attempts(fd):
        def write_inside():
            inside = os.open("datasets", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(os.open("mine.txt", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=inside))

        return {
            "rename": _try(lambda: os.rename("datasets", "gone", src_dir_fd=fd, dst_dir_fd=fd)),
            "rmdir": _try(lambda: os.rmdir("datasets", dir_fd=fd)),
            "link": _try(lambda: os.symlink("/", "evil", dir_fd=fd)),
            "mkdir": _try(lambda: os.mkdir("planted", dir_fd=fd)),
            "chmod": _try(lambda: os.chmod(fd, 0o777)),  # noqa: S103 (her try)
            "list": _try(lambda: os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)),
            "write inside": _try(write_inside),
        }

    assert _as_tenant(uid, root, attempts) == {
        "rename": "EACCES",
        "rmdir": "EACCES",
        "link": "EACCES",
        "mkdir": "EACCES",
        "chmod": "EPERM",
        "list": "EACCES",  # 0711: not even the names of the folders
        "write inside": "ok",
    }
    assert os.path.isdir(root / "datasets") and not os.path.lexists(root / "evil")


@needs_root
def test_a_root_she_owned_in_the_layout_before_is_taken_back_her_folders_stay_hers(
    make_cluster, alice, root, uid
):
    (root / "workspace" / "ckpt").mkdir(parents=True)
    for path in (root, root / "workspace", root / "workspace" / "ckpt"):
        os.chown(path, uid, uid)
    os.chmod(root, 0o700)
    cluster = make_cluster(alice, volumes=(VolumeSpec("workspace", "/workspace"),))
    assert (os.lstat(root).st_uid, stat.S_IMODE(os.lstat(root).st_mode)) == (0, 0o711)
    assert os.lstat(root / "workspace").st_uid == uid
    assert os.lstat(root / "workspace" / "ckpt").st_uid == uid
    # An existing cluster's next start repairs it too, before it mounts anything.
    os.chown(root, uid, uid)
    [mount] = runtime.volume_mounts(cluster, alice.pk)
    assert os.lstat(root).st_uid == 0
    assert mount["Source"] == os.path.join(os.path.realpath(root), "workspace")


def test_the_engine_gets_the_path_through_the_consoles_folders_not_a_resolved_one(
    make_cluster, alice, root
):
    cluster = make_cluster(
        alice,
        volumes=(VolumeSpec("datasets", "/workspace/data", True), VolumeSpec("work", "/work")),
    )
    mounts = runtime.volume_mounts(cluster, alice.pk)
    real_storage = os.path.realpath(root.parent)
    assert [(m["Target"], m["Source"], m["ReadOnly"]) for m in mounts] == [
        ("/work", f"{real_storage}/u{alice.pk}/work", False),
        ("/workspace/data", f"{real_storage}/u{alice.pk}/datasets", True),
    ]


# -- what she types on the form ---------------------------------------------------------


def test_a_sub_folder_is_refused_on_the_form_with_the_line_to_write_instead(root):
    assert _errors("datasets/imagenet:/workspace/data:ro", root) == (
        "Line 1: 'datasets/imagenet' is a sub-folder: a volume mounts one whole storage "
        "folder, so that nothing on the way can be swapped for a link. Mount "
        "datasets:/workspace/data:ro instead and use /workspace/data/imagenet inside the "
        "container."
    )
    assert "Mount ckpt:/ckpt instead and use /ckpt/run/1" in _errors("ckpt/run/1:/ckpt", root)
    assert "is a sub-folder" in _errors("datasets/./imagenet/:/data", root)


@pytest.mark.parametrize(
    "line, words",
    [
        ("../../etc:/workspace/x", "contains '..'"),
        ("datasets/../../x:/workspace/x", "contains '..'"),
        ("..:/workspace/x", "contains '..'"),
        ("/etc:/workspace/x", "is absolute"),
        ("/:/workspace/x", "is absolute"),
        (".:/workspace", "not your whole storage"),
        ("./:/workspace", "not your whole storage"),
        (":/workspace", "Give one of your storage folders"),
        (".ssh:/workspace/x", "not a storage folder name"),
        ("-rf:/workspace/x", "not a storage folder name"),
        ("data$(id):/workspace/x", "not a storage folder name"),
        ("dätä:/workspace/x", "not a storage folder name"),
        ("d" * 65 + ":/workspace/x", "not a storage folder name"),
        ("my data:/workspace/x", "spaces or control characters"),
        ("data\x00:/workspace/x", "spaces or control characters"),
    ],
)
def test_hostile_sources_get_a_clear_message(root, line, words):
    assert words in _errors(line, root)
    assert not os.path.exists(root), "the form makes nothing"


def test_spelling_variants_of_one_folder_are_that_folder(root):
    specs = storage.parse_volumes("./datasets:/data:ro\nwork/:/work\nckpt:/ckpt:rw", root=root)
    assert [str(s) for s in specs] == ["datasets:/data:ro", "work:/work", "ckpt:/ckpt"]


def test_a_link_or_a_file_in_place_of_a_folder_is_refused_on_the_form(root, tmp_path):
    root.mkdir(parents=True)
    (root / "sneaky").symlink_to("/")
    (root / "inside").symlink_to(root / "real")  # inside the root, a link all the same
    (root / "notes").write_text("")
    assert "'sneaky' in your storage is a symbolic link" in _errors("sneaky:/data", root)
    assert "'inside' in your storage is a symbolic link" in _errors("inside:/data", root)
    assert "'notes' is a file in your storage" in _errors("notes:/data", root)


# -- what reaches the service or an existing cluster without the form --------------------


def test_a_sub_folder_handed_to_the_service_is_refused_and_creates_nothing(
    make_cluster, alice, root
):
    with pytest.raises(ValidationError, match="is a sub-folder"):
        make_cluster(alice, volumes=(VolumeSpec("datasets/imagenet", "/workspace/data"),))
    assert not os.path.exists(root / "datasets")
    assert not make_cluster.Cluster.objects.exists()


@pytest.mark.parametrize(
    "source, words",
    [
        (
            "datasets/imagenet",
            "volume datasets/imagenet:/workspace/data: 'datasets/imagenet' is a sub-folder",
        ),
        ("", "not your whole storage"),  # `.` was accepted once: the whole root
        ("../u1", "contains '..'"),
        ("/etc", "is absolute"),
    ],
)
def test_an_existing_cluster_whose_volume_is_refused_now_fails_to_start_saying_why(
    make_cluster, alice, root, source, words
):
    cluster = make_cluster(alice)
    Volume.objects.create(cluster=cluster, source=source, target="/workspace/data")
    with pytest.raises(runtime.SpecError, match=words.replace("(", r"\(")) as caught:
        runtime.volume_mounts(cluster, alice.pk)
    if source == "datasets/imagenet":
        assert "Mount datasets:/workspace/data instead" in str(caught.value)
    assert not os.path.exists(root / "datasets" / "imagenet")


def test_a_folder_swapped_for_a_link_is_refused_at_start_and_never_followed(
    make_cluster, alice, root, tmp_path
):
    cluster = make_cluster(alice, volumes=(VolumeSpec("datasets", "/workspace/data"),))
    # Only the layout before let her do this; an old link must not survive the upgrade.
    (root / "datasets").rmdir()
    (root / "datasets").symlink_to(tmp_path)
    with pytest.raises(runtime.SpecError, match="'datasets' in your storage is a symbolic link"):
        runtime.volume_mounts(cluster, alice.pk)
    assert os.path.islink(root / "datasets")


def test_a_root_that_is_a_link_is_refused_and_nothing_is_made_where_it_points(
    make_cluster, alice, root, tmp_path
):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root.parent.mkdir(parents=True)
    root.symlink_to(elsewhere)
    with pytest.raises(ValidationError, match="Your storage root is not a folder"):
        make_cluster(alice, volumes=(VolumeSpec("datasets", "/workspace/data"),))
    assert os.listdir(elsewhere) == []


def test_a_storage_root_others_can_write_is_refused_at_start(make_cluster, alice, root):
    cluster = make_cluster(alice, volumes=(VolumeSpec("datasets", "/workspace/data"),))
    os.chmod(root.parent, 0o777)  # noqa: S103 (an operator's mistake, refused)
    try:
        with pytest.raises(runtime.SpecError, match="can be changed by others than the console"):
            runtime.volume_mounts(cluster, alice.pk)
    finally:
        os.chmod(root.parent, 0o755)  # noqa: S103 (as it was)
    # Her root made writable by others: put back, it is the console's.
    os.chmod(root, 0o757)  # noqa: S103
    runtime.volume_mounts(cluster, alice.pk)
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o711


@needs_root
def test_a_root_owned_by_her_uid_that_the_console_cannot_take_back_is_refused(
    make_cluster, alice, root, uid, monkeypatch
):
    cluster = make_cluster(alice, volumes=(VolumeSpec("datasets", "/workspace/data"),))
    os.chown(root, uid, uid)
    # The console run as a user other than root cannot chown: it must refuse, not mount.
    monkeypatch.setattr(storage.os, "geteuid", lambda: 1000)
    with pytest.raises(runtime.SpecError, match="Your storage root can be changed by others"):
        runtime.volume_mounts(cluster, alice.pk)


# -- what the console reads in her folders ------------------------------------------------


def test_checkpoints_nested_inside_a_folder_are_still_found_links_in_it_are_not(
    make_cluster, alice, root
):
    make_cluster(alice, volumes=(VolumeSpec("workspace", "/workspace"),))
    run = root / "workspace" / "ckpt" / "run-1"
    (run / "step-2").mkdir(parents=True)
    (run / "step-3.tmp").mkdir()
    volumes = [VolumeSpec("workspace", "/workspace")]
    assert storage.newest_checkpoint(root, volumes, "/workspace/ckpt/run-1") == (
        "/workspace/ckpt/run-1/step-2"
    )
    # In her own folder she may plant links: the console's read does not follow them.
    (root / "workspace" / "ckpt").rename(root / "workspace" / "real")
    (root / "workspace" / "ckpt").symlink_to("/etc")
    assert storage.newest_checkpoint(root, volumes, "/workspace/ckpt") is None

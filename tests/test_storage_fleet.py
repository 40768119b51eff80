"""Every test host is a machine of its own for files too (issue 38): the researchers' storage
path is the distributed filesystem (MooseFS) on the console and on each host, and under it
each host has a disk of its own, so nothing is shared by accident.

The hosts are the two test engines, each in a network and a mount namespace of its own
(.ci/services.sh). A nested mount namespace of a host (`unshare --mount` inside it) sees what
lies under the host's MooseFS mount, its own disk, without taking the mount from the host.
"""

import os
import subprocess
import uuid
from pathlib import Path

import docker
import pytest

# The hosts of the full services and MooseFS, reached without an engine fixture.
pytestmark = pytest.mark.engine

TEST_IMAGE = os.environ.get("SUANLI_TEST_IMAGE", "suanli/busybox:latest")


def _mntns() -> list[str]:
    found = [p for p in os.environ.get("SUANLI_TEST_ENGINE_MNTNS", "").split(",") if p]
    if len(found) != 2 or os.environ.get("SUANLI_STORAGE_FS") != "moosefs":
        pytest.fail("the fleet's hosts and MooseFS are started by `make test` (.ci/services.sh)")
    return found


def _on_host(i: int, script: str, *, under_the_mount: bool = False) -> subprocess.CompletedProcess:
    """`script` in host i's mount namespace; with under_the_mount, in a child of it whose
    MooseFS mount is taken away, so the script sees the host's own disk there."""
    cmd = ["nsenter", f"--mount={_mntns()[i]}"]
    if under_the_mount:
        root = os.environ["SUANLI_STORAGE_ROOT"]
        script = f'umount -l "{root}" && {script}'
        cmd += ["unshare", "--mount", "--propagation", "private"]
    return subprocess.run(
        [*cmd, "sh", "-c", script], capture_output=True, text=True, timeout=30, check=False
    )


def test_a_file_the_console_writes_is_read_in_a_container_on_each_host_and_theirs_back(
    storage_root, engine_urls
):
    folder = storage_root / "shared"
    folder.mkdir(parents=True)
    (folder / "from-console").write_text("console\n")
    for i, url in enumerate(engine_urls):
        client = docker.DockerClient(base_url=url, timeout=30)
        try:
            out = client.containers.run(
                TEST_IMAGE, ["sh", "-c", f"cat /w/from-console; echo host{i} > /w/from-host{i}"],
                network_mode="none", remove=True, volumes={str(folder): {"bind": "/w"}},
            ).decode()  # fmt: skip
        finally:
            client.close()
        assert out == "console\n"
    assert (folder / "from-host0").read_text() == "host0\n"
    assert (folder / "from-host1").read_text() == "host1\n"
    # And each host's own view of the path (not only its containers') is the same files.
    seen = _on_host(1, f'cat "{folder}/from-host0"')
    assert seen.stdout == "host0\n", seen.stderr


def test_a_file_on_a_hosts_own_disk_at_the_storage_path_is_seen_by_no_other_host_nor_the_console(
    storage_root,
):
    root = Path(os.environ["SUANLI_STORAGE_ROOT"])
    name = f"local-only-{uuid.uuid4().hex[:8]}"
    wrote = _on_host(0, f'echo a > "{root}/{name}" && cat "{root}/{name}"', under_the_mount=True)
    try:
        assert wrote.returncode == 0 and wrote.stdout == "a\n", wrote.stderr
        # On host a's own disk it is...
        again = _on_host(0, f'cat "{root}/{name}"', under_the_mount=True)
        assert again.stdout == "a\n", again.stderr
        # ...and nowhere else: not on the filesystem host a itself mounts, not on host b
        # (above or below its mount), not on the console.
        assert not (root / name).exists()
        for i, under in ((0, False), (1, False), (1, True)):
            looked = _on_host(
                i, f'test -e "{root}/{name}" && echo there || echo absent', under_the_mount=under
            )
            assert looked.stdout == "absent\n", (i, under, looked.stderr)
    finally:
        _on_host(0, f'rm -f "{root}/{name}"', under_the_mount=True)


def test_each_host_mounts_the_distributed_filesystem_not_a_folder_of_this_machine():
    root = os.environ["SUANLI_STORAGE_ROOT"]
    master = os.environ["SUANLI_STORAGE_MASTER"]
    for i in range(len(_mntns())):
        mounts = _on_host(i, "cat /proc/self/mounts").stdout.splitlines()
        at_root = [line.split() for line in mounts if line.split()[1] == root]
        # The host's own disk first, then MooseFS from the master over it.
        assert [m[2] for m in at_root] == ["tmpfs", "fuse"], at_root
        assert at_root[-1][0] == f"mfs\\043{master}", at_root

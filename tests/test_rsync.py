"""rsync and scp through the SSH gateway (jobs/access/ssh.py, sftp.py), driven by the real
rsync and OpenSSH clients against the Procfile's `gateway` and the real engines: a
researcher's notebook (rsync into a busybox workspace, which has no rsync, and back; a
second sync sends only the change; an image with rsync runs its own; scp outside the
writable folders says where to write), then an attacker's (links out of the volumes,
`--rsync-path` tricks, many transfers on one connection)."""

import asyncio
import contextlib
import io
import os
import shlex
import subprocess
import tarfile
import time

import docker
import pytest
from django.conf import settings
from test_gateway import (
    Gateway,
    Key,
    _connect,
    _in_workspace,
    alice_key,
    start_gateway,
    workspace_cluster,
)
from waiting import until

from console import preferences
from jobs.access import sftp
from jobs.access.sessions import Login
from jobs.nodes import runtime, workspaces

pytestmark = pytest.mark.django_db
__all__ = ["alice_key", "start_gateway", "workspace_cluster"]  # fixtures of test_gateway

WRITABLE = "only to your volumes (/data, /workspace)"


def _rsync(gw: Gateway, key: Key, *args, timeout=60):
    shell = shlex.join(["ssh", *gw.options(key), "-p", str(gw.port)])
    return subprocess.run(
        ["rsync", "-e", shell, *map(str, args)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _sent(done) -> list[str]:
    """The files an `--out-format=file:%n` run sent (its directories left out)."""
    names = [line[5:] for line in done.stdout.splitlines() if line.startswith("file:")]
    return sorted(name for name in names if not name.endswith("/"))


def test_rsync_into_a_busybox_workspace_and_back_and_a_second_sync_sends_only_the_change(
    start_gateway, workspace_cluster, alice_key, alice, storage_root, tmp_path
):
    gw = start_gateway()
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    assert _in_workspace(cluster, "sh", "-c", "command -v rsync").exit_code != 0, "no rsync"
    src = tmp_path / "project"
    (src / "data").mkdir(parents=True)
    (src / "train.py").write_text("print('hello')\n")
    (src / "data" / "weights.bin").write_bytes(os.urandom(300_000))
    (src / "名字 with space.txt").write_text("unicode\n")

    done = _rsync(
        gw, alice_key, "-av", "--out-format=file:%n", f"{src}/", f"{login}@127.0.0.1:proj/"
    )
    assert done.returncode == 0, done.stderr
    assert _sent(done) == ["data/weights.bin", "train.py", "名字 with space.txt"], done.stdout
    # Read back through the workspace's own shell: in the login's home, the first volume.
    seen = gw.ssh(alice_key, login, "cat /workspace/proj/train.py; ls /workspace/proj/data")
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.decode() == "print('hello')\nweights.bin\n"
    stored = storage_root / f"u{alice.pk}" / "work" / "proj"
    assert (stored / "data" / "weights.bin").read_bytes() == (
        src / "data" / "weights.bin"
    ).read_bytes()
    assert (stored / "train.py").stat().st_uid == runtime.tenant_uid(alice.pk), "as the tenant"

    (src / "train.py").write_text("print('hello again')\n")
    again = _rsync(
        gw, alice_key, "-av", "--out-format=file:%n", f"{src}/", f"{login}@127.0.0.1:proj/"
    )
    assert again.returncode == 0, again.stderr
    assert _sent(again) == ["train.py"], again.stdout
    assert (stored / "train.py").read_text() == "print('hello again')\n"

    # And back, from a volume named by its absolute path.
    back = tmp_path / "back"
    done = _rsync(gw, alice_key, "-a", f"{login}@127.0.0.1:/workspace/proj/", f"{back}/")
    assert done.returncode == 0, done.stderr
    assert (back / "data" / "weights.bin").read_bytes() == (
        src / "data" / "weights.bin"
    ).read_bytes()
    assert (back / "名字 with space.txt").read_text() == "unicode\n"
    # Each transfer's container went with it.
    node = cluster.node_set.select_related("host").get(released_at__isnull=True)
    engine = docker.DockerClient(base_url=node.host.engine_url, timeout=10)
    until(
        lambda: not engine.containers.list(all=True, filters={"label": sftp.LABEL}),
        what="the rsync containers removed",
    )


def _with_rsync(cluster) -> None:
    """Give the workspace an rsync of its own (the host's, its libraries and loader), as an
    image that ships rsync has."""
    out = io.BytesIO()
    done = subprocess.run(["ldd", "/usr/bin/rsync"], capture_output=True, text=True, check=True)
    libs = [w for w in done.stdout.split() if w.startswith("/")]
    with tarfile.open(fileobj=out, mode="w") as tar:
        for path in ["/usr/bin/rsync", *libs]:
            info = tar.gettarinfo(os.path.realpath(path), arcname=path.lstrip("/"))
            info.uid = info.gid = 0
            with open(path, "rb") as fh:
                tar.addfile(info, fh)
    assert workspaces.running(cluster, 0).put_archive("/", out.getvalue())


def test_an_image_with_rsync_runs_its_own_in_the_workspace(
    start_gateway, workspace_cluster, alice_key, tmp_path
):
    gw = start_gateway()
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    _with_rsync(cluster)
    src = tmp_path / "src"
    src.mkdir()
    (src / "note").write_text("in the workspace's own /tmp\n")
    # /tmp is the workspace's own: our container has none, so landing there proves where it ran.
    done = _rsync(gw, alice_key, "-av", f"{src}/", f"{login}@127.0.0.1:/tmp/got/")
    assert done.returncode == 0, done.stderr
    seen = gw.ssh(alice_key, login, "cat /tmp/got/note")
    assert seen.stdout.decode() == "in the workspace's own /tmp\n", seen.stderr
    # Outside what the tenant may write there: the words name the places.
    done = _rsync(gw, alice_key, "-a", f"{src}/", f"{login}@127.0.0.1:/etc/x/")
    assert done.returncode != 0
    assert "/etc/x/ is not writable by you in the workspace" in done.stderr, done.stderr
    assert "(/data, /workspace) and /tmp" in done.stderr, done.stderr


def test_scp_outside_the_writable_folders_says_where_to_write_in_both_modes(
    start_gateway, workspace_cluster, alice_key, tmp_path
):
    gw = start_gateway()
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    f = tmp_path / "f.txt"
    f.write_text("x\n")
    for legacy in ((), ("-O",)):  # OpenSSH 9's scp speaks sftp; -O the old protocol (exec)
        for target in ("/etc/x", "/", "../../usr/x"):
            done = gw.scp(alice_key, *legacy, f, f"{login}@127.0.0.1:{target}")
            err = done.stderr.decode()
            assert done.returncode != 0, (legacy, target, err)
            assert "is not writable: scp, sftp and rsync write " + WRITABLE in err, (target, err)
            assert err.count("Suanli:") == 1, err
        # Into a volume both work, busybox or not.
        done = gw.scp(alice_key, *legacy, f, f"{login}@127.0.0.1:/data/f{len(legacy)}.txt")
        assert done.returncode == 0, done.stderr
    seen = gw.ssh(alice_key, login, "cat /data/f0.txt /data/f1.txt")
    assert seen.stdout == b"x\nx\n", seen.stderr


def test_the_words_are_in_the_researchers_language(
    start_gateway, workspace_cluster, alice_key, alice, tmp_path
):
    """Needs /tmp/h/po-rsync.po merged into locale/ (zh_Hans)."""
    preferences.save(alice, language="zh-hans")
    gw = start_gateway()
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    f = tmp_path / "f.txt"
    f.write_text("x\n")
    for legacy in ((), ("-O",)):
        done = gw.scp(alice_key, *legacy, f, f"{login}@127.0.0.1:/etc/x")
        err = done.stderr.decode()
        assert done.returncode != 0
        assert (
            "/etc/x 不可写入：scp、sftp 和 rsync 只能写入您的存储卷（/data, /workspace）" in err
        ), err


def test_an_attacker_reads_nothing_outside_the_volumes_through_rsync(
    start_gateway, workspace_cluster, alice_key, alice, bob, storage_root, tmp_path
):
    gw = start_gateway()
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    # Another researcher's files, on the same storage.
    secret = storage_root / f"u{bob.pk}" / "work" / "secret.txt"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text("bob's secret\n")
    made = gw.ssh(alice_key, login, "ln -s / /workspace/root && ln -s /etc /workspace/etc")
    assert made.returncode == 0, made.stderr
    out = tmp_path / "out"
    out.mkdir()

    # Following the links (-L): they resolve inside our container, whose root holds our
    # programs, the tenant's passwd line and her own volumes; nothing of the host's.
    done = _rsync(gw, alice_key, "-L", f"{login}@127.0.0.1:/workspace/etc/passwd", out / "p")
    assert done.returncode == 0, done.stderr
    uid = runtime.tenant_uid(alice.pk)
    assert (out / "p").read_text() == f"tenant:x:{uid}:{uid}:tenant:/workspace:/sbin/nologin\n"
    listing = _rsync(gw, alice_key, "--list-only", "-L", f"{login}@127.0.0.1:/workspace/root/")
    assert listing.returncode == 0, listing.stderr
    names = {line.split()[-1] for line in listing.stdout.splitlines()}
    assert {"workspace", "data", "usr", "etc"} <= names, names
    assert not {"home", "var", "root", "srv", "run", "opt"} & names, names
    for path in (
        "/workspace/etc/shadow",
        "/workspace/root/var/run/docker.sock",
        "/workspace/root/home",
        f"/workspace/root{storage_root}/u{bob.pk}/work/secret.txt",
        f"{storage_root}/u{bob.pk}/work/secret.txt",
        "/etc/shadow",
    ):
        done = _rsync(gw, alice_key, "-rL", f"{login}@127.0.0.1:{path}", out / "x")
        assert done.returncode != 0 and "No such file or directory" in done.stderr, (path, done)
    assert not (out / "x").exists()
    assert "bob's secret" not in "".join(p.read_text(errors="replace") for p in out.rglob("*")
                                         if p.is_file())  # fmt: skip

    # A command dressed as rsync's (--rsync-path) never runs in our container: it goes to
    # the workspace's shell like any command, where there is no rsync.
    done = _rsync(gw, alice_key, "--rsync-path=echo owned >&2; rsync", "-a",
                  f"{login}@127.0.0.1:/workspace/", out / "y")  # fmt: skip
    assert done.returncode != 0 and "owned" in done.stderr and "not found" in done.stderr, done


def _helpers_made(engine, cluster, since: float) -> list[dict]:
    """The engine's record of the transfer containers made for `cluster` since then (one
    that already went included)."""
    filters = {"type": "container", "event": "create",
               "label": [sftp.LABEL, f"{runtime.LABEL_CLUSTER}={cluster.pk}"]}  # fmt: skip
    return list(engine.api.events(since=since, until=time.time(), filters=filters, decode=True))


def test_rsyncs_daemon_behind_its_paths_never_runs_in_our_container(
    start_gateway, workspace_cluster, alice_key
):
    """rsync reads options after its paths too: `--daemon` after the `.` would run rsync's
    daemon over the channel in our container, reading the tenant's ./rsyncd.conf."""
    gw = start_gateway()
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    node = cluster.node_set.select_related("host").get(released_at__isnull=True)
    engine = docker.DockerClient(base_url=node.host.engine_url, timeout=10)
    conf = "[all]\n path = /\n read only = false\n use chroot = false\n"
    made = gw.ssh(alice_key, login, f"printf '{conf}' > /workspace/rsyncd.conf")
    assert made.returncode == 0, made.stderr
    since = time.time() - 1
    for command in ("x/rsync --server . --daemon", "x/rsync --server -v . dest/ --config=x",
                    "x/rsync --server -v . dest/ -- --daemon"):  # fmt: skip
        done = gw.ssh(alice_key, login, command)
        # The workspace's shell runs it as any command: there is no x/rsync there.
        assert done.returncode != 0 and b"not found" in done.stderr, (command, done)
        assert b"@RSYNCD" not in done.stdout, (command, done.stdout)
    assert _helpers_made(engine, cluster, since) == []


def test_the_sweep_leaves_a_container_whose_image_carries_our_label(workspace_cluster, monkeypatch):
    """A tenant's image may carry `LABEL suanli.transfer` (containers inherit their image's
    labels): its exited containers are not our leftovers."""
    cluster = workspace_cluster()
    node = cluster.node_set.select_related("host").get(released_at__isnull=True)
    engine = docker.DockerClient(base_url=node.host.engine_url, timeout=10)
    name = f"fixr-labelled-{cluster.pk}"
    workspaces.running(cluster, 0).commit(
        repository=name, tag="t", changes=[f"LABEL {sftp.LABEL_TOOL}=x {sftp.LABEL}=x"]
    )
    theirs = engine.containers.create(f"{name}:t", [], entrypoint=["true"], name=name)
    image = engine.api.inspect_image(settings.SUANLI_SFTP_IMAGE)["Id"]
    ours = engine.containers.create(image, ["/usr/bin/rsync", "--version"],
                                    labels={sftp.LABEL: "c", sftp.LABEL_TOOL: "rsync"})  # fmt: skip
    try:
        for container in (theirs, ours):
            container.start()
            container.wait(timeout=30)
        monkeypatch.setattr(sftp, "EXITED_LEFTOVER_S", -60)  # both count as left long ago
        login = Login(name="c", cluster=cluster, index=0, host=node.host, container_id="",
                      fingerprint="", key_data=b"", exec_base={})  # fmt: skip
        sftp.sftp_sweep(engine.api, login, image)
        theirs.reload()
        assert theirs.status == "exited", "the tenant's container is still there"
        with pytest.raises(docker.errors.NotFound):
            ours.reload()
    finally:
        for container in (theirs, ours):
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
        engine.images.remove(f"{name}:t")


def test_transfers_on_one_connection_count_as_sessions(start_gateway, workspace_cluster, alice_key):
    gw = start_gateway(SUANLI_SSH_MAX_SESSIONS=2)
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    node = cluster.node_set.select_related("host").get(released_at__isnull=True)
    engine = docker.DockerClient(base_url=node.host.engine_url, timeout=10)

    def helpers() -> list:
        return engine.api.containers(filters={"label": sftp.LABEL})

    async def session():
        async with _connect(gw, login, alice_key) as conn:  # one connection, as ControlMaster
            # rsync servers waiting for their client: the connection's own session, then one
            # more; a third finds none left, in words, and starts no container.
            command = "rsync --server --sender -vlogDtpre.iLsfxCIvu . /workspace/"
            held = [await conn.create_process(command, encoding=None) for _ in range(2)]
            await asyncio.to_thread(until, lambda: len(helpers()) == 2, what="two rsync")
            third = await conn.create_process(command, encoding=None)
            err = await asyncio.wait_for(third.stderr.read(), 30)
            assert b"you have 2 SSH sessions open" in err, err
            assert len(helpers()) == 2
            (container,) = [c for c in helpers() if c["Labels"][sftp.LABEL_TOOL] == "rsync"][:1]
            found = engine.api.inspect_container(container["Id"])
            host_config, config = found["HostConfig"], found["Config"]
            uid = runtime.tenant_uid(cluster.owner_id)
            assert config["User"] == f"{uid}:{uid}"
            assert config["Cmd"] == ["/usr/bin/rsync", *command.split()[1:]]
            assert host_config["NetworkMode"] == "none" and host_config["ReadonlyRootfs"]
            assert host_config["CapDrop"] == ["ALL"] and not host_config["Privileged"]
            assert host_config["SecurityOpt"] == ["no-new-privileges"]
            assert 0 < host_config["PidsLimit"] <= 64 and host_config["Memory"] > 0
            mounts = {m["Destination"] for m in found["Mounts"]}
            assert mounts == {"/workspace", "/data", "/etc"}, mounts
            for process in held:
                process.stdin.write_eof()
                process.close()
                await process.wait_closed()

    asyncio.run(session())
    until(lambda: not helpers(), what="the rsync containers removed")


def test_two_transfers_at_once_per_cluster_each_half_a_core(
    start_gateway, workspace_cluster, alice_key
):
    gw = start_gateway()
    cluster = workspace_cluster()
    login = workspaces.login_name(cluster.pk, 0)
    node = cluster.node_set.select_related("host").get(released_at__isnull=True)
    engine = docker.DockerClient(base_url=node.host.engine_url, timeout=10)

    def helpers() -> list:
        return engine.api.containers(filters={"label": sftp.LABEL})

    async def session():
        async with _connect(gw, login, alice_key) as conn:
            command = "rsync --server --sender -vlogDtpre.iLsfxCIvu . /workspace/"
            held = [await conn.create_process(command, encoding=None) for _ in range(2)]
            await asyncio.to_thread(until, lambda: len(helpers()) == 2, what="two rsync")
            third = await conn.create_process(command, encoding=None)
            err = await asyncio.wait_for(third.stderr.read(), 30)
            assert b"two copies are already running on this cluster; wait for one" in err, err
            assert len(helpers()) == 2
            for container in helpers():
                found = engine.api.inspect_container(container["Id"])
                assert found["HostConfig"]["NanoCpus"] == 5 * 10**8
            for process in held:
                process.stdin.write_eof()
                process.close()
                await process.wait_closed()

    asyncio.run(session())
    until(lambda: not engine.api.containers(all=True, filters={"label": sftp.LABEL}),
          what="the rsync containers removed")  # fmt: skip


def test_only_the_shapes_rsync_and_scp_send_run_in_our_container():
    shapes = {
        "rsync --server -vlogDtpre.iLsfxCIvu . dest/": ["dest/"],
        "rsync --server --sender -vlogDtpre.iLsfxCIvu . my\\ dir/*.py": [],
        "scp -t /etc/x": ["/etc/x"],
        "scp -v -r -p -d -t -- -x": ["-x"],
        "scp -f weights.bin": [],
        "rsync --server -v . ./-x": ["./-x"],  # how rsync sends a name starting with -
    }
    for command, written in shapes.items():
        transfer = sftp.transfer_command(command)
        assert transfer is not None and transfer.written == written, command
    for command in (
        "cat /etc/passwd; rsync --server -v . dest/",
        "sh -c 'rsync --server -v . x'",
        "rsync --server --daemon .",
        "rsync --server --config=/x --daemon .",
        "rsync --server . --daemon",
        "rsync --server -v . dest/ --config=x",
        "rsync --server --sender -v . x -- --daemon",
        "rsync --server -v . -x",
        "rsync --server -v dest/",
        "rsync -v . dest/",
        "scp -t a b",
        "scp -t -f x",
        "scp -x -t y",
        "scp -t -oProxyCommand=sh",
        "scp 'unbalanced",
        "python3 -c 'import os'",
    ):
        assert sftp.transfer_command(command) is None, command
    assert sftp.is_inside("proj/../x", "/workspace", ["/workspace"])
    assert not sftp.is_inside("../etc/x", "/workspace", ["/workspace"])
    assert not sftp.is_inside("/workspace2/x", "/", ["/workspace"])


def test_a_path_in_the_sentence_is_shown_printable(settings):
    words = sftp.not_writable_words("/etc/\x1b[2Jx", ["/workspace"], workspace=False)
    assert "\x1b" not in words and "/etc/?[2Jx is not writable" in words

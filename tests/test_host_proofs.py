"""The console verifies, it does not trust (issue 38; jobs/hosts/proofs.py): each host check proves
from a canary container on a cluster-like network that the host, the control plane and the
other hosts are out of a container's reach, that the host mounts the console's filesystem,
that its engine is in the fleet's swarm; a failed proof makes the host degraded, with what
failed, and takes it out of placement.

The real-engine tests break a test host as an operator's mistake or an attacker would (its
tenant firewall removed inside its network namespace, the researchers' filesystem unmounted
inside its mount namespace, a fake file in its place) and always put it back.
"""

import os
import stat
import subprocess
from html import unescape
from pathlib import Path

import docker
import pytest
from django.test import Client

from jobs.base.text import Text
from jobs.hosts import proofs
from jobs.hosts import services as host_services
from jobs.models import Host
from jobs.placement import capacity

REPO = Path(__file__).resolve().parent.parent
FIREWALL = REPO / "jobs" / "hosts" / "scripts" / "host-firewall.sh"


# -- the reasons, without a service ---------------------------------------------------------


def test_a_reached_target_is_named_with_its_address_port_and_service():
    reached = [
        proofs.Target("172.29.0.1", 6399, Text("Redis")),
        proofs.Target("fd00::1", 2377, Text("this host: %(service)s", service=Text("SSH"))),
    ]
    assert [str(r) for r in proofs.reach_reasons(reached)] == [
        "a container reached 172.29.0.1:6399 (Redis)",
        "a container reached [fd00::1]:2377 (this host: SSH)",
    ]


def test_the_filesystem_reason_says_which_proof_failed_and_where_to_mount(settings):
    settings.SUANLI_STORAGE_ROOT = Path("/srv/suanli")
    assert str(proofs.storage_reason(found=False)) == (
        "the researchers' filesystem on this host is not the console's (marker not found): "
        "mount it at /srv/suanli"
    )
    assert "(marker differs)" in str(proofs.storage_reason(found=True))


@pytest.mark.parametrize(
    "state, swarm, others, words",
    [
        ("inactive", "", [], None),  # the fleet is this host alone: no swarm needed
        ("active", "m1", ["m1", "m1"], None),
        ("active", "", ["m1"], None),  # a worker that names no manager yet
        ("active", "m1", ["", ""], None),  # no other member known: nothing to differ from
        ("inactive", "", ["m1"], "not in the fleet's Docker swarm (its state: inactive)"),
        ("", "", [""], "not in the fleet's Docker swarm (its state: unknown)"),
        ("pending", "", ["m1"], "(its state: pending)"),
        ("active", "m2", ["m1"], "in another Docker swarm (m2) than the fleet's (m1)"),
        ("active", "m2", ["m1", "m1", "m2"], "in another Docker swarm (m2) than the fleet's (m1)"),
        ("active", "m2", ["m1", "m2"], None),  # a tie: neither is the odd one
    ],
)
def test_the_swarm_proof(state, swarm, others, words):
    reason = proofs.swarm_reason(state, swarm, others)
    if words is None:
        assert reason is None, str(reason)
    else:
        assert reason is not None and words in str(reason), str(reason)


def test_the_canarys_output_counts_only_what_it_was_asked_to_try():
    tried = [proofs.Target("172.29.0.1", 5443, Text("the registry"))]
    seen = proofs.parse(
        "marker abc\nreached 172.29.0.1 5443\nreached 10.0.0.9 22\nreached 172.29.0.1 5443\n",
        tried,
        marker=True,
    )
    assert seen.reached == tried and seen.marker == "abc"
    assert proofs.parse("", tried, marker=True).marker == ""  # asked, none printed
    assert proofs.parse("marker abc\n", tried, marker=False).marker is None


def test_what_is_tried_comes_from_the_settings_and_the_hosts(settings):
    settings.REDIS_URL = "redis://:secret@127.0.0.1:6399/0"
    settings.SUANLI_REGISTRY = "172.29.0.1:5443"
    settings.SUANLI_STORAGE_MASTER = "172.29.0.1:19421"
    settings.SUANLI_STORAGE_FS = "moosefs"
    settings.SUANLI_WEB_BIND, settings.SUANLI_WEB_PORT = "0.0.0.0", 8000  # noqa: S104
    host = Host(name="gpu-b-01", address="172.29.0.12", engine_url="unix:///x.sock")
    peer = Host(name="gpu-c-01", address="10.1.2.3", engine_url="tcp://10.1.2.3:2400")
    found = {str(t): str(t.what) for t in proofs.targets(host, ["172.29.64.1"], peers=[peer])}
    # Services on a loopback or every address are tried at the control plane's address.
    assert found["172.29.0.1:6399"] == "Redis"
    assert found["172.29.0.1:8000"] == "the console"
    assert found["172.29.0.1:5443"] == "the registry"
    assert found["172.29.0.1:19421"] == "the MooseFS master"
    assert found["172.29.0.1:19422"] == "a MooseFS chunkserver"
    assert "127.0.0.1:6399" not in found  # the container's own loopback proves nothing
    # The host itself at its address and at the canary bridge's gateway.
    for address in ("172.29.0.12", "172.29.64.1"):
        assert found[f"{address}:2377"] == "this host: the swarm's control port"
        assert found[f"{address}:22"] == "this host: SSH"
    # Another host's engine, its TLS port included.
    assert found["10.1.2.3:2400"] == "host gpu-c-01: the engine"
    assert found["10.1.2.3:2377"] == "host gpu-c-01: the swarm's control port"


def test_the_canary_tries_addresses_as_arguments_never_as_script():
    tried = [proofs.Target("172.29.0.1", 5443, Text("the registry"))]
    argv = proofs.command(tried, marker=True)
    assert argv[:3] == ["sh", "-c", proofs.SCRIPT]
    assert argv[3:] == ["canary", proofs.MARKER_TARGET, "172.29.0.1", "5443"]


# -- on the real engines ----------------------------------------------------------------------

real = pytest.mark.django_db


def _netns(i: int) -> str:
    return [n for n in os.environ.get("SUANLI_TEST_ENGINE_NETNS", "").split(",") if n][i]


def _mntns(i: int) -> str:
    found = [p for p in os.environ.get("SUANLI_TEST_ENGINE_MNTNS", "").split(",") if p]
    if len(found) != 2 or os.environ.get("SUANLI_STORAGE_FS") != "moosefs":
        pytest.fail("the fleet's hosts and MooseFS are started by `make test` (.ci/services.sh)")
    return found[i]


def _firewall(i: int, verb: str) -> None:
    subprocess.run(
        ["nsenter", f"--net=/var/run/netns/{_netns(i)}", "sh", str(FIREWALL), verb],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip


def _remount_storage(engine: str) -> None:
    subprocess.run(
        ["bash", str(REPO / ".ci" / "services.sh"), "remount-storage", engine],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip


def _canaries(url: str) -> list:
    client = docker.DockerClient(base_url=url, timeout=20)
    try:
        return client.containers.list(all=True, filters={"label": "suanli.canary"})
    finally:
        client.close()


@real
def test_healthy_hosts_pass_every_proof_and_the_canary_leaves_nothing(
    make_host, engine_urls, settings
):
    a = make_host("gpu-a-01", engine=0, gpus=2)
    b = make_host("gpu-b-01", engine=1, gpus=2)
    for host in (a, b):
        assert host.state == Host.State.ACTIVE and host.last_error == "", host.last_error
    assert not _canaries(engine_urls[0]) and not _canaries(engine_urls[1])
    # The marker is the console's alone: root's (the console's user) 0644 in 0755 folders.
    marker = proofs.marker_path(b.pk)
    for path, mode in ((marker, 0o644), (marker.parent, 0o755), (marker.parent.parent, 0o755)):
        info = os.lstat(path)
        assert stat.S_IMODE(info.st_mode) == mode and info.st_uid == os.geteuid(), path


@real
def test_a_host_whose_firewall_is_removed_is_degraded_with_what_a_container_reached(
    make_host, operator, settings
):
    a = make_host("gpu-a-01", engine=0, gpus=2)
    b = make_host("gpu-b-01", engine=1, gpus=2)
    assert b.state == Host.State.ACTIVE, b.last_error
    registry = settings.SUANLI_REGISTRY
    try:
        _firewall(1, "remove")
        b = host_services.host_check(host_id=b.pk)
        assert b.state == Host.State.DEGRADED
        # What a tenant's container could now open: the registry, the host's own swarm
        # gossip, the other host's (the manager's) swarm.
        for reached in (
            f"{registry} (the registry)",
            f"{b.address}:7946 (this host: the swarm's gossip port)",
            f"{a.address}:2377 (host gpu-a-01: the swarm's control port)",
        ):
            assert f"a container reached {reached}" in b.last_error, b.last_error
        assert b.pk not in capacity.Fleet.load().hosts, "out of placement"
        # The operators read it where they look, in their language (kept as words).
        assert b.last_error_shown == b.last_error and b.last_error_text
        staff = Client()
        staff.force_login(operator)
        assert f"a container reached {registry}" in staff.get("/ops/hosts/").content.decode()
    finally:
        _firewall(1, "apply")
    b = host_services.host_check(host_id=b.pk)
    assert b.state == Host.State.ACTIVE and b.last_error == "", b.last_error
    assert b.last_error_text is None


@real
def test_a_host_whose_filesystem_is_unmounted_is_degraded_and_a_file_in_its_place_is_not_it(
    make_host, storage_root
):
    make_host("gpu-a-01", engine=0, gpus=2)
    b = make_host("gpu-b-01", engine=1, gpus=2)
    assert b.state == Host.State.ACTIVE, b.last_error
    root = os.environ["SUANLI_STORAGE_ROOT"]
    marker = proofs.marker_path(b.pk)
    try:
        subprocess.run(
            ["nsenter", f"--mount={_mntns(1)}", "umount", "-l", root],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        b = host_services.host_check(host_id=b.pk)
        assert b.state == Host.State.DEGRADED
        assert (
            "the researchers' filesystem on this host is not the console's (marker not found)"
            in b.last_error
        ), b.last_error
        assert b.pk not in capacity.Fleet.load().hosts, "out of placement"

        # A host that fakes the path on its own disk, with the marker it last saw, is not
        # the console's filesystem either: each check writes a new marker.
        old = proofs.read_marker(b.pk)
        fake = (
            f'mkdir -p "{marker.parent}" && printf "%s\\n" "{old}" > "{marker}" '
            f'&& chmod 0644 "{marker}"'
        )
        subprocess.run(
            ["nsenter", f"--mount={_mntns(1)}", "sh", "-c", fake],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        b = host_services.host_check(host_id=b.pk)
        assert b.state == Host.State.DEGRADED
        assert "is not the console's (marker differs)" in b.last_error, b.last_error
    finally:
        # The fake goes from the host's own disk (the top mount there, with MooseFS gone).
        clean = (
            f'awk \'$2 == "{root}"\' /proc/self/mounts | tail -n 1 | grep -q "^suanli-host-disk " '
            f'&& rm -rf "{storage_root}"; true'
        )
        subprocess.run(["nsenter", f"--mount={_mntns(1)}", "sh", "-c", clean], timeout=30)
        _remount_storage("b")
    b = host_services.host_check(host_id=b.pk)
    assert b.state == Host.State.ACTIVE and b.last_error == "", b.last_error


@real
def test_a_marker_the_console_cannot_write_proves_nothing_and_check_now_says_why(
    make_host, operator, settings, tmp_path
):
    make_host("gpu-a-01", engine=0, gpus=2)
    b = make_host("gpu-b-01", engine=1, gpus=2)
    assert b.state == Host.State.ACTIVE, b.last_error
    registry = settings.SUANLI_REGISTRY
    # The console's folder of markers is a link (a host replaced it; a full filesystem or
    # a master that is down fails the same write), and the host's firewall is gone too.
    storage = tmp_path / "storage"
    storage.mkdir()
    (storage / ".suanli").symlink_to(tmp_path)
    root, settings.SUANLI_STORAGE_ROOT = settings.SUANLI_STORAGE_ROOT, storage
    staff = Client()
    staff.force_login(operator)
    try:
        _firewall(1, "remove")
        page = staff.post(f"/ops/hosts/{b.pk}/check/", follow=True)
        b.refresh_from_db()
        assert b.state == Host.State.DEGRADED, "not proved"
        assert "the console could not write its marker: " in b.last_error, b.last_error
        assert f"{storage / '.suanli'} is not a folder" in b.last_error, b.last_error
        # The reach proofs ran all the same, without the marker.
        assert f"a container reached {registry} (the registry)" in b.last_error, b.last_error
        # Check now says it as the admin's check does: an error, with the reasons.
        message = unescape(page.content.decode()).split('class="msg msg-')[1].split("</li>")[0]
        assert message.startswith("error") and "Host gpu-b-01 answers but is degraded: " in message
        assert "the console could not write its marker" in message
        assert f"a container reached {registry} (the registry)" in message
    finally:
        _firewall(1, "apply")
    settings.SUANLI_STORAGE_ROOT = root
    b = host_services.host_check(host_id=b.pk)
    assert b.state == Host.State.ACTIVE and b.last_error == "", b.last_error


@real
def test_a_host_outside_the_fleets_swarm_is_degraded(make_host, catalog):
    # The fleet's other host is in a swarm of its own (a record: its engine is not needed).
    elsewhere = host_services.host_save(
        host=Host(
            name="gpu-elsewhere", engine_url="unix:///run/suanli-no-such-engine.sock",
            address="127.0.0.1", zone="zone-a", gpu_model=catalog["a100-80gb"], gpu_count=8,
            state=Host.State.ACTIVE, swarm_state="active", swarm_cluster="another-swarm",
        )
    )  # fmt: skip
    a = make_host("gpu-a-01", engine=0, gpus=2)
    assert a.state == Host.State.DEGRADED
    assert "the engine is in another Docker swarm" in a.last_error, a.last_error
    assert "than the fleet's (another-swarm)" in a.last_error, a.last_error
    assert a.pk not in capacity.Fleet.load().hosts, "out of placement"

    elsewhere.delete()
    a = host_services.host_check(host_id=a.pk)
    assert a.state == Host.State.ACTIVE and a.last_error == "", a.last_error

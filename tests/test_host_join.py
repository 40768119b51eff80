"""An operator adds a host with one command (issue 38): Hosts -> Add makes a join token,
jobs/hosts/scripts/join.sh uses it, the console signs the engine's certificate, registers the host
and checks it; `join.sh leave` drains it and takes it out of the fleet.

The first tests are the endpoints' (the database and the test client: who may make a
token, what a wrong, used, expired or guessed one gets, what the console signs). The last
ones run join.sh itself: against a console on the hosts' network, on a fresh third host
made for the test (its own network and mount namespaces, its own engine), which joins,
takes a cluster, and leaves.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import uuid
from html import unescape
from pathlib import Path

import django_rq
import docker
import docker.tls
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.urls import reverse
from django.utils import timezone
from waiting import until

from jobs import tasks
from jobs.base.text import Text
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.events import lifecycle
from jobs.files.storage import VolumeSpec
from jobs.hosts import joins, pki, proofs
from jobs.hosts import services as host_services
from jobs.models import GpuSlot, Host, HostJoin
from jobs.placement import scheduler
from jobs.runs import dispatch
from tests import third_host as third
from tests.conftest import TEST_IMAGE
from tests.third_host import GATEWAY, RUN, THIRD, in_third, run_on_third

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "jobs" / "hosts" / "scripts" / "join.sh"
API = "/hosts/join/"
HOST_IP = "172.29.0.99"  # where the unit tests' "host" posts from


# -- personas and helpers ------------------------------------------------------------


def _staff(name: str, *perms: str):
    user = get_user_model().objects.create_user(name, password=f"{name}-pass-123", is_staff=True)
    for perm in perms:
        app, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app, codename=codename)
        )
    return user


@pytest.fixture
def hank(db):
    """Staff who may add hosts (and see them), nothing else."""
    return _staff("hank", "jobs.add_host", "jobs.view_host")


@pytest.fixture
def cora(db):
    """Staff who may add hosts and change them (joining a host again changes it)."""
    return _staff("cora", "jobs.add_host", "jobs.change_host", "jobs.view_host")


@pytest.fixture
def vera(db):
    """Staff who may see hosts but not add them."""
    return _staff("vera", "jobs.view_host")


def csr_pem(*, cn="gpu-evil", sans=("evil.example", "10.9.9.9"), key=None) -> str:
    key = key or ec.generate_private_key(ec.SECP256R1())
    names = [
        x509.IPAddress(ipaddress.ip_address(s)) if s[0].isdigit() else x509.DNSName(s) for s in sans
    ]
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    return request.public_bytes(serialization.Encoding.PEM).decode()


def call(client, source=HOST_IP, path=API, **body):
    response = client.post(
        path, json.dumps(body), content_type="application/json", REMOTE_ADDR=source
    )
    return response, (
        json.loads(response.content) if response["Content-Type"] == "application/json" else None
    )


def make_token(user, **fields) -> str:
    fields.setdefault("zone", "zone-join")
    return joins.token_create(by=user, **fields)[1]


def begin(client, token, *, name="gpu-c-01", address=HOST_IP, **extra):
    return call(
        client, source=extra.pop("source", HOST_IP), step="begin", token=token, name=name,
        address=address, csr=extra.pop("csr", None) or csr_pem(), **extra,
    )  # fmt: skip


# -- who may make a token -------------------------------------------------------------


def test_an_operator_with_the_power_makes_a_token_shown_once_and_kept_only_as_a_digest(
    client, hank, catalog
):
    client.force_login(hank)
    page = client.get(reverse("ops_hosts"))
    assert reverse("ops_host_add") in page.content.decode(), "Hosts -> Add"
    response = client.post(
        reverse("ops_host_add"),
        {"zone": "zone-b", "gpu_model": catalog["t4-16gb"].pk, "gpu_count": 2},
    )
    assert response.status_code == 200
    html = response.content.decode()
    join = HostJoin.objects.get()
    command = html.split('data-testid="join-command">')[1].split("<")[0]
    assert command.startswith("curl -fsSL http://testserver/hosts/join.sh | sudo sh -s -- ")
    token = command.rsplit(" ", 1)[1]
    assert f"sudo sh join.sh --console http://testserver {token}" in html, "or copied over"
    assert token.startswith(join.key + ".")
    secret = token.split(".", 1)[1]
    stored = json.dumps(list(HostJoin.objects.values()), default=str)
    assert secret not in stored, "only the secret's digest is kept"
    assert (join.zone, join.gpu_model, join.gpu_count, join.created_by) == (
        "zone-b", catalog["t4-16gb"], 2, hank,
    )  # fmt: skip
    assert timezone.now() + datetime.timedelta(minutes=59) < join.expires_at
    assert join.expires_at <= timezone.now() + datetime.timedelta(minutes=60)
    # The page says how long it lasts and where the waiting token is.
    assert "works once and expires at" in html
    assert "waiting for a host" in client.get(reverse("ops_hosts")).content.decode()
    # Shown once: no page shows it again.
    assert token not in client.get(reverse("ops_host_add")).content.decode()
    assert token not in client.get(reverse("ops_hosts")).content.decode()


def test_staff_without_the_power_and_researchers_cannot_make_tokens(client, vera, alice):
    client.force_login(vera)
    assert client.get(reverse("ops_host_add")).status_code == 403
    assert client.post(reverse("ops_host_add"), {"zone": "zone-a"}).status_code == 403
    assert reverse("ops_host_add") not in client.get(reverse("ops_hosts")).content.decode()
    client.force_login(alice)
    response = client.post(reverse("ops_host_add"), {"zone": "zone-a"})
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    assert not HostJoin.objects.exists()


def test_the_scripts_are_public_and_hold_no_secret(client, settings):
    served = client.get("/hosts/join.sh")
    assert served.status_code == 200
    text = served.content.decode()
    assert text.startswith("#!/bin/sh")
    assert 'SUANLI_CONSOLE="${SUANLI_CONSOLE:-http://testserver}"' in text
    assert (
        text.replace("${SUANLI_CONSOLE:-http://testserver}", "${SUANLI_CONSOLE:-}")
        == SCRIPT.read_text()
    )
    firewall = client.get("/hosts/host-firewall.sh")
    assert firewall.status_code == 200 and b"SUANLI-TENANT-IN" in firewall.content
    # A Host header the operator allowed is all the script is ever told; the setting wins.
    settings.SUANLI_JOIN_URL = "https://console.example.org"
    assert (
        "SUANLI_CONSOLE:-https://console.example.org}"
        in client.get("/hosts/join.sh").content.decode()
    )


# -- what a token holder gets, and what nobody else gets ------------------------------


def test_a_guessed_expired_or_used_token_is_refused_alike_and_nothing_is_made(
    client, hank, django_capture_on_commit_callbacks
):
    used = make_token(hank)
    assert begin(client, used)[0].status_code == 200
    expired = make_token(hank)
    HostJoin.objects.filter(key=expired.split(".")[0]).update(
        expires_at=timezone.now() - datetime.timedelta(seconds=1)
    )
    real = make_token(hank)
    key, secret = real.split(".")
    wrong_secret = f"{key}.{'A' * len(secret)}"
    guessed = f"{uuid.uuid4().hex[:12]}.{secret}"
    answers = set()
    for token in (used, expired, wrong_secret, guessed, "", "x" * 5000, None, 12):
        response, body = begin(client, token, name="gpu-c-02")
        assert response.status_code == 403, token
        answers.add(body["error"])
    assert answers == {joins.REFUSED}, "one answer: it never says whether a token existed"
    assert "expired, was used already, or was never made" in joins.REFUSED
    assert Host.all_objects.count() == 0
    assert HostJoin.objects.filter(key=key, used_at__isnull=True).exists(), "the real one is unused"
    # The host's later steps need the credential the token bought: a token is not one.
    with django_capture_on_commit_callbacks(execute=True):
        response, body = call(client, step="register", credential=real)
    assert (response.status_code, body["error"]) == (403, joins.REFUSED)
    assert Host.all_objects.count() == 0


def test_guessing_tokens_locks_the_address_even_for_a_valid_one(client, hank, settings):
    settings.AXES_FAILURE_LIMIT = 3
    token = make_token(hank)
    for _ in range(2):
        assert (
            begin(client, f"{uuid.uuid4().hex[:12]}.{'B' * 43}", source="172.29.0.77")[
                0
            ].status_code
            == 403
        )
    response, body = begin(client, f"{uuid.uuid4().hex[:12]}.{'B' * 43}", source="172.29.0.77")
    assert response.status_code == 429 and "locked" in body["error"]
    response, body = begin(client, token, source="172.29.0.77", address="172.29.0.77")
    assert response.status_code == 429, "locked before any token is looked at"
    assert begin(client, token)[0].status_code == 200, "another address is not locked"


def test_a_researchers_session_is_no_credential_and_needs_no_csrf_token(client, alice):
    client.force_login(alice)
    for step in ("begin", "register", "status", "leave", "left", "report"):
        response, body = call(client, step=step)
        assert (response.status_code, body["error"]) == (403, joins.REFUSED), step
    response, _ = call(client, path="/hosts/join/image/", image="suanli/busybox:latest")
    assert response.status_code == 403
    # Not JSON, or not an object: refused before anything is looked at.
    assert client.post(API, {"step": "begin"}).status_code == 400
    assert client.post(API, "[1]", content_type="application/json").status_code == 400
    assert client.get(API).status_code == 405


def test_the_console_signs_for_the_requests_address_only_whatever_the_csr_asks(client, hank):
    token = make_token(hank)
    # Another address than the request's: refused with why, and the token is not used.
    response, body = begin(client, token, address="172.29.0.50")
    assert response.status_code == 400
    assert "says its address is 172.29.0.50 but its request comes from 172.29.0.99" in body["error"]
    response, body = begin(client, token, csr="not a csr")
    assert response.status_code == 400 and "not a PEM CSR" in body["error"]
    response, body = begin(client, token, name="GPU_01!")
    assert response.status_code == 400 and "host name" in body["error"]
    response, body = begin(client, token)
    assert response.status_code == 200, body
    cert = x509.load_pem_x509_certificate(body["cert"].encode())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == [HOST_IP]
    assert sans.get_values_for_type(x509.DNSName) == []
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH], "it can open no other engine"
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "gpu-c-01"
    ca = pki.authority()
    assert body["ca"] == ca.cert_pem and "PRIVATE KEY" not in json.dumps(body)
    cert.verify_directly_issued_by(ca.cert)
    assert body["credential"].split(".")[0] == token.split(".")[0] and body["credential"] != token
    assert begin(client, token)[0].status_code == 403, "used once"


def test_behind_nat_the_token_names_the_address(client, hank):
    token = make_token(hank, address="10.20.0.7")
    response, body = begin(client, token, address="10.20.0.8", source="203.0.113.9")
    assert (
        response.status_code == 400 and "this token is for the host at 10.20.0.7" in body["error"]
    )
    response, body = begin(client, token, address="10.20.0.7", source="203.0.113.9")
    assert response.status_code == 200, body


def test_register_makes_the_host_with_the_consoles_own_client_key_and_queues_its_check(
    client, hank, catalog, django_capture_on_commit_callbacks
):
    token = make_token(hank, gpu_model=catalog["a10-24gb"], gpu_count=2, build_host=True)
    credential = begin(client, token)[1]["credential"]
    with django_capture_on_commit_callbacks(execute=True):
        response, body = call(client, step="register", credential=credential)
    assert response.status_code == 200, body
    host = Host.objects.get(name="gpu-c-01")
    assert body == {"name": "gpu-c-01", "state": "checking", "engine": f"tcp://{HOST_IP}:2376"}
    assert (host.engine_url, host.address, host.zone) == (
        f"tcp://{HOST_IP}:2376",
        HOST_IP,
        "zone-join",
    )
    assert (host.gpu_model, host.gpu_count, host.build_host) == (catalog["a10-24gb"], 2, True)
    assert host.slots.count() == 2
    client_cert = x509.load_pem_x509_certificate(host.tls_cert.encode())
    client_cert.verify_directly_issued_by(pki.authority().cert)
    usage = client_cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert host.tls_ca == pki.authority().cert_pem
    queued = django_rq.get_queue("docker").fetch_job(f"host-check-{host.pk}")
    assert queued is not None and queued.func_name == "jobs.tasks.host_check"
    assert queued.args == [host.pk]
    # The Hosts page: checking until the check says more.
    client.force_login(hank)
    html = client.get(reverse("ops_hosts")).content.decode()
    row = html.split('data-host="gpu-c-01"')[1].split("</tr>")[0]
    assert 'data-testid="host-checking"' in row
    # The credential is the host's: from another address it registers nothing.
    response, body = call(client, source="172.29.0.98", step="register", credential=credential)
    assert response.status_code == 400 and "comes from 172.29.0.98" in body["error"]


def test_a_host_that_joins_again_is_updated_and_its_old_credential_ends(
    client, hank, cora, catalog
):
    first = begin(client, make_token(hank))[1]["credential"]
    call(client, step="register", credential=first)
    host = Host.objects.get()
    # Joining it again changes it: a token of an operator who may change hosts.
    second = begin(client, make_token(cora, zone="zone-b"))[1]["credential"]
    response, body = call(client, step="register", credential=second)
    assert response.status_code == 200, body
    again = Host.objects.get()
    assert (again.pk, again.zone) == (host.pk, "zone-b"), "the same host, updated"
    assert call(client, step="status", credential=first)[0].status_code == 403
    assert call(client, step="status", credential=second)[1]["name"] == "gpu-c-01"
    # Another name at the same address would be a second host on one engine: refused.
    response, body = begin(client, make_token(hank), name="gpu-c-02")
    assert response.status_code == 400 and "is host gpu-c-01 already" in body["error"]


def test_an_operator_who_may_only_add_hosts_cannot_take_an_existing_one_over(client, hank, cora):
    # Hank made a token for an address behind NAT while it was free.
    early_nat = make_token(hank, address="10.20.0.7")
    # A host of the fleet, joined with his token; another joined by Cora behind that NAT.
    first = begin(client, make_token(hank))[1]["credential"]
    assert call(client, step="register", credential=first)[0].status_code == 200
    host = Host.objects.get(name="gpu-c-01")
    other = begin(
        client, make_token(cora, address="10.20.0.7"), name="gpu-c-02", address="10.20.0.7",
        source="203.0.113.9",
    )[1]["credential"]  # fmt: skip
    assert (
        call(client, step="register", credential=other, source="203.0.113.9")[0].status_code == 200
    )
    # Hank's new token, run from the host's own address (a tenant's container there shares
    # it) under its name: refused, it would rewrite the host and end its credential.
    response, body = begin(client, make_token(hank, zone="zone-evil"))
    assert response.status_code == 400
    assert "host gpu-c-01 is in the fleet already" in body["error"]
    assert (
        "needs a token made by an operator who may change hosts (jobs.change_host)"
        in (body["error"])
    )
    # From anywhere, with its address as a NAT token's: Hosts -> Add refuses to make one ...
    client.force_login(hank)
    made = HostJoin.objects.count()
    page = client.post(
        reverse("ops_host_add"), {"zone": "zone-evil", "gpu_count": 0, "address": HOST_IP}
    )
    html = unescape(page.content.decode())
    assert page.status_code == 200 and 'data-testid="join-command"' not in html
    assert f"{HOST_IP} is the address of host gpu-c-01: a token for it would join" in html
    assert "That needs the power to change hosts (jobs.change_host)." in html
    assert HostJoin.objects.count() == made
    # ... and the NAT token made while the address was free is refused now it is a host's.
    response, body = begin(
        client, early_nat, name="gpu-c-02", address="10.20.0.7", source="198.51.100.4"
    )
    assert response.status_code == 400 and "host gpu-c-02 is in the fleet already" in body["error"]
    response, body = begin(
        client, early_nat, name="gpu-c-03", address="10.20.0.7", source="198.51.100.4"
    )
    assert response.status_code == 400 and "is host gpu-c-02 already" in body["error"]
    # Nothing changed: the hosts are as they were, and their own credentials still work.
    assert Host.objects.get(pk=host.pk).zone == "zone-join"
    assert call(client, step="status", credential=first)[1]["name"] == "gpu-c-01"
    assert call(client, step="status", credential=other, source="203.0.113.9")[1]["name"] == (
        "gpu-c-02"
    )
    # The power is the maker's when the token is used: taken from Cora, her token is Hank's.
    token = make_token(cora, zone="zone-b")
    cora.user_permissions.remove(Permission.objects.get(codename="change_host"))
    response, body = begin(client, token)
    assert response.status_code == 400 and "(jobs.change_host)" in body["error"]
    assert call(client, step="status", credential=first)[1]["name"] == "gpu-c-01"


def test_a_nat_token_names_no_control_plane_address_unless_its_maker_may_change_hosts(
    client, hank, cora, settings
):
    settings.SUANLI_STORAGE_MASTER = "10.30.0.6:9421"
    client.force_login(hank)
    for address, what in (
        ("10.30.0.6", "the MooseFS master"),
        ("127.0.0.1", "this console's own machine"),
    ):
        page = client.post(
            reverse("ops_host_add"), {"zone": "zone-a", "gpu_count": 0, "address": address}
        )
        html = unescape(page.content.decode())
        assert f"{address} is an address of the control plane ({what}): a host there" in html
        assert 'data-testid="join-command"' not in html
    assert not HostJoin.objects.exists()
    # A token made before the settings named the address is refused when it is used.
    settings.SUANLI_STORAGE_MASTER = ""
    token = make_token(hank, address="10.30.0.6")
    settings.SUANLI_STORAGE_MASTER = "10.30.0.6:9421"
    response, body = begin(client, token, address="10.30.0.6", source="203.0.113.9")
    assert response.status_code == 400
    assert "address 10.30.0.6 is the control plane's (the MooseFS master)" in body["error"]
    assert not Host.all_objects.exists()
    # An operator who may change hosts may (a small fleet whose console's machine is a host).
    token = make_token(cora, address="10.30.0.6")
    response, body = begin(client, token, address="10.30.0.6", source="203.0.113.9")
    assert response.status_code == 200, body


def test_a_host_keeping_stopped_workspaces_joins_nowhere_else_under_its_name_nor_leaves(
    client, cora, catalog, alice, make_cluster
):
    token = make_token(cora, gpu_model=catalog["t4-16gb"], gpu_count=1)
    credential = begin(client, token)[1]["credential"]
    call(client, step="register", credential=credential)
    # (its check would have recorded the test image on its engine: placement needs it)
    Host.objects.update(state=Host.State.ACTIVE, last_checked=timezone.now(), images=[TEST_IMAGE])
    cluster = make_cluster(alice, "kept", model="t4-16gb")
    scheduler.place_pending()
    cluster.refresh_from_db()
    services.cluster_stop(cluster=cluster)
    node = cluster.node_set.get()
    assert node.released_at and node.stopped_at and node.host.name == "gpu-c-01", "kept there"
    # Its name from another address: refused, its workspace's host stays where it is.
    response, body = begin(client, make_token(cora), address="172.29.0.98", source="172.29.0.98")
    assert response.status_code == 400
    assert (
        "host gpu-c-01 is at 172.29.0.99 and keeps clusters (running, or stopped" in (body["error"])
    )
    assert Host.objects.get().address == HOST_IP
    # Nor does it leave the fleet while it keeps them.
    body = call(client, step="leave", credential=credential)[1]
    progress = call(client, step="leave-status", credential=body["credential"])[1]
    assert progress["empty"] == "no" and "kept" in progress["clusters"]
    response, body = call(client, step="left", credential=body["credential"])
    assert response.status_code == 400 and "clusters still run" in body["error"]


def test_joining_again_or_leaving_leaves_no_reasons_of_an_earlier_check(client, hank, cora):
    credential = begin(client, make_token(hank))[1]["credential"]
    call(client, step="register", credential=credential)
    host = Host.objects.get()
    reached = proofs.reach_reasons([proofs.Target("172.29.0.1", 6379, Text("Redis"))])
    lifecycle.host_unhealthy(host=host, state=Host.State.DEGRADED, message=proofs.lines(reached))
    assert "a container reached 172.29.0.1:6379" in Host.objects.get().last_error_shown
    again = begin(client, make_token(cora))[1]["credential"]
    assert call(client, step="register", credential=again)[0].status_code == 200
    assert Host.objects.get().last_error_shown == "", "checking: no reasons yet"
    client.force_login(cora)
    row = client.get(reverse("ops_hosts")).content.decode().split('data-host="gpu-c-01"')[1]
    assert "a container reached" not in row.split("</tr>")[0]


def test_detected_gpus_come_from_nvidia_smi_and_the_catalogs_name_for_them(
    client, hank, cora, catalog
):
    credential = begin(client, make_token(hank))[1]["credential"]
    response, body = call(
        client,
        step="register",
        credential=credential,
        gpu_count="8",
        gpu_name="NVIDIA A100-SXM4-80GB",
    )
    assert response.status_code == 200, body
    assert (Host.objects.get().gpu_model, Host.objects.get().gpu_count) == (catalog["a100-80gb"], 8)
    credential = begin(client, make_token(cora))[1]["credential"]  # joins it again
    response, body = call(
        client, step="register", credential=credential, gpu_count="4", gpu_name="Tesla V100"
    )
    assert response.status_code == 400
    assert "no GPU model of the catalog is called so" in body["error"]


def test_a_failing_step_is_reported_on_the_hosts_page(client, hank):
    token = make_token(hank)
    response, body = call(
        client,
        step="report",
        token=token,
        failed_step="engine",
        error="apt-get install docker.io failed: E: no network",
    )
    assert response.status_code == 200
    client.force_login(hank)
    html = client.get(reverse("ops_hosts")).content.decode()
    status = html.split(f'data-join="{token.split(".")[0]}"')[1].split("</tr>")[0]
    assert "join failed" in status and "Step engine:" in status and "E: no network" in status
    assert begin(client, token)[0].status_code == 200, "reporting does not use the token up"


def test_leave_drains_waits_for_the_clusters_and_removes_the_host(
    client, hank, catalog, alice, make_cluster
):
    token = make_token(hank, gpu_model=catalog["t4-16gb"], gpu_count=1)
    credential = begin(client, token)[1]["credential"]
    call(client, step="register", credential=credential)
    # (its check would have recorded the test image on its engine: placement needs it)
    Host.objects.update(state=Host.State.ACTIVE, last_checked=timezone.now(), images=[TEST_IMAGE])
    cluster = make_cluster(alice, "on-c", model="t4-16gb")
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.node_set.get().host.name == "gpu-c-01"
    response, body = call(client, step="leave", credential=credential)
    assert response.status_code == 200 and body["state"] == "draining"
    assert Host.objects.get().state == Host.State.DRAINING
    progress = call(client, step="leave-status", credential=body["credential"])[1]
    assert progress["empty"] == "no" and progress["nodes"] == "1" and "on-c" in progress["clusters"]
    response, body = call(client, step="left", credential=body["credential"])
    assert response.status_code == 400 and "clusters still run" in body["error"]
    services.cluster_release(cluster=cluster)
    # No engine behind this host to confirm its containers are gone: as if it had.
    GpuSlot.objects.update(node=None)
    assert call(client, step="leave-status", credential=credential)[1]["empty"] == "yes"
    reached = proofs.lines(proofs.reach_reasons([proofs.Target("10.0.0.1", 22, Text("SSH"))]))
    lifecycle.host_unhealthy(host=Host.objects.get(), state=Host.State.DEGRADED, message=reached)
    response, body = call(client, step="left", credential=credential)
    assert response.status_code == 200, body
    assert not Host.objects.exists(), "out of the fleet"
    assert Host.all_objects.get().state == Host.State.LEFT, "kept as its nodes' history"
    shown = Host.all_objects.get().last_error_shown
    assert shown.startswith("left the fleet at ") and "reached" not in shown, shown
    left = host_services.host_check(host_id=Host.all_objects.get().pk)
    assert left.state == Host.State.LEFT, "a check never brings it back"
    assert call(client, step="status", credential=credential)[0].status_code == 403, (
        "credential ended"
    )
    client.force_login(hank)
    assert 'data-host="gpu-c-01"' not in client.get(reverse("ops_hosts")).content.decode()
    # It may join again, under its name: the same row comes back.
    again = begin(client, make_token(hank))[1]["credential"]
    call(client, step="register", credential=again)
    assert Host.objects.get().pk == Host.all_objects.get().pk


def test_a_host_that_never_ran_anything_is_deleted_when_it_leaves(client, hank):
    credential = begin(client, make_token(hank))[1]["credential"]
    call(client, step="register", credential=credential)
    token = make_token(hank)
    response, body = call(client, source="172.29.0.50", step="leave", token=token, name="gpu-c-01")
    assert (
        response.status_code == 400 and "no host named 'gpu-c-01' at 172.29.0.50" in body["error"]
    )
    response, body = call(client, step="leave", token=token, name="gpu-c-01")
    assert response.status_code == 200, body
    assert call(client, step="left", credential=body["credential"])[0].status_code == 200
    assert not Host.all_objects.exists()


def test_an_operator_revokes_a_waiting_token(client, hank, vera):
    token = make_token(hank)
    join = HostJoin.objects.get()
    client.force_login(vera)
    assert client.post(reverse("ops_host_join_revoke", args=[join.pk])).status_code == 403
    client.force_login(hank)
    assert "Revoke" in client.get(reverse("ops_hosts")).content.decode()
    client.post(reverse("ops_host_join_revoke", args=[join.pk]))
    assert begin(client, token)[1]["error"] == joins.REFUSED
    status = client.get(reverse("ops_hosts")).content.decode().split(f'data-join="{join.key}"')[1]
    assert "revoked" in status.split("</tr>")[0]


def test_helper_images_are_for_a_joining_host_only(client, hank):
    credential = begin(client, make_token(hank))[1]["credential"]
    response, body = call(client, path="/hosts/join/image/", credential=credential, image="evil/x")
    assert response.status_code == 400 and "not one of the helper images" in body["error"]
    call(client, step="register", credential=credential)
    response, body = call(
        client, path="/hosts/join/image/", credential=credential, image="suanli/busybox:latest"
    )
    assert response.status_code == 400 and "before it registers" in body["error"]


def _join_sh(live_server, tmp_path, *args, **env) -> subprocess.CompletedProcess:
    """The script copied over (no namespaces: it stops at a step before it changes this
    machine), its files under tmp_path."""
    base = {
        "PATH": os.environ["PATH"],
        "SUANLI_JOIN_ROOT": str(tmp_path / "root"),
        "SUANLI_JOIN_NO_APT": "1",
        "SUANLI_JOIN_NAME": "gpu-c-09",
        "TMPDIR": str(tmp_path),
    }
    return subprocess.run(
        ["sh", str(SCRIPT), "--console", live_server.url, *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_step_that_fails_says_which_and_why_here_and_on_the_hosts_page(
    live_server, client, hank, tmp_path
):
    token = make_token(hank)
    run = _join_sh(live_server, tmp_path, token, SUANLI_JOIN_ADDRESS="10.9.9.9")
    assert run.returncode == 1
    assert (
        "join.sh: step sign failed: the console answered 400: this host says its address is "
        "10.9.9.9 but its request comes from 127.0.0.1" in run.stderr
    ), run.stderr
    client.force_login(hank)
    html = client.get(reverse("ops_hosts")).content.decode()
    status = html.split(f'data-join="{token.split(".")[0]}"')[1].split("</tr>")[0]
    assert "join failed" in status and "Step sign:" in status and "10.9.9.9" in status
    assert "still good for" in status, "the token is not used up: run it again once fixed"
    # No engine on this "host": the step that says so, and the same on the page.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for folder in os.environ["PATH"].split(":"):
        for tool in Path(folder).glob("*") if Path(folder).is_dir() else []:
            if tool.name not in ("dockerd", "docker") and not (bin_dir / tool.name).exists():
                (bin_dir / tool.name).symlink_to(tool)
    run = _join_sh(live_server, tmp_path, token, SUANLI_JOIN_ADDRESS="127.0.0.1", PATH=str(bin_dir))
    assert run.returncode == 1
    assert (
        "join.sh: step engine failed: dockerd is not installed (Debian package docker.io) and "
        "SUANLI_JOIN_NO_APT=1" in run.stderr
    ), run.stderr
    html = client.get(reverse("ops_hosts")).content.decode()
    assert "Step engine:" in html.split(f'data-join="{token.split(".")[0]}"')[1].split("</tr>")[0]
    assert HostJoin.objects.get().used_at is None and not Host.all_objects.exists()
    # And a token that is no good is refused before anything happens to the host.
    run = _join_sh(
        live_server,
        tmp_path,
        f"{uuid.uuid4().hex[:12]}.{'C' * 43}",
        SUANLI_JOIN_ADDRESS="127.0.0.1",
    )
    assert "join.sh: step sign failed: the console answered 403: This join token" in run.stderr
    assert not (tmp_path / "root" / "etc" / "docker" / "suanli" / "cert.pem").exists()


# -- the real thing: a fresh third host joins, takes a cluster and leaves -------------


@pytest.fixture
def third_host():
    """A fresh machine on the hosts' network (tests/third_host.py); gone afterwards."""
    yield third.make()
    third.tear_down()


@pytest.fixture
def console_on_the_hosts_network(transactional_db, settings):
    """The console where hosts reach it: a live server on the hosts' bridge."""
    from pytest_django.live_server_helper import LiveServer

    settings.ALLOWED_HOSTS = [*settings.ALLOWED_HOSTS, GATEWAY]
    server = LiveServer(f"{GATEWAY}:0")
    settings.SUANLI_JOIN_URL = server.url
    yield server
    server.stop()


def _served_certificate(host: Host, folder: Path) -> bytes:
    """The certificate (DER) the host's engine serves now, as the console's client sees it."""
    (folder / "client.pem").write_text(host.tls_cert.strip() + "\n" + host.tls_key.strip() + "\n")
    context = ssl.create_default_context(cadata=host.tls_ca)
    context.check_hostname = False  # the console checks the address (SAN) itself
    context.load_cert_chain(str(folder / "client.pem"))
    with (
        socket.create_connection((host.address, 2376), timeout=10) as raw,
        context.wrap_socket(raw) as tls,
    ):
        return tls.getpeercert(binary_form=True)


def _certificate_on(etc: Path) -> bytes:
    pem = (etc / "docker/suanli/cert.pem").read_bytes()
    return x509.load_pem_x509_certificate(pem).public_bytes(serialization.Encoding.DER)


def test_a_fresh_host_joins_with_the_command_takes_a_cluster_and_leaves(
    client, operator, alice, catalog, make_host, make_cluster, storage_root, settings,
    third_host, console_on_the_hosts_network, settle_until, tmp_path,
):  # fmt: skip
    settings.SUANLI_STORAGE_MOUNT = os.environ["SUANLI_STORAGE_ROOT"]
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2)  # the swarm's manager
    client.force_login(operator)
    page = client.post(
        reverse("ops_host_add"),
        {"zone": "zone-join", "gpu_model": catalog["h100-80gb"].pk, "gpu_count": 2},
    )
    command = page.content.decode().split('data-testid="join-command">')[1].split("<")[0]
    url = console_on_the_hosts_network.url
    assert command.startswith(f"curl -fsSL {url}/hosts/join.sh | sudo sh -s -- ")

    code, out = run_on_third(command, name="join-c")
    assert code == 0, out
    assert "join.sh: joined: join-c is active" in out
    host = Host.objects.get(name="join-c")
    a = Host.objects.get(name="gpu-a-01")
    assert (host.engine_url, host.address, host.state) == (f"tcp://{THIRD}:2376", THIRD, "active")
    assert host.emulated_gpu and host.gpu_model == catalog["h100-80gb"] and host.gpu_count == 2
    assert host.swarm_member and host.swarm_cluster == a.swarm_cluster, "in the fleet's swarm"
    html = client.get(reverse("ops_hosts")).content.decode()
    row = html.split('data-host="join-c"')[1].split("</tr>")[0]
    assert 'badge-active">active' in row
    # Nobody pasted PEM, and the engine opens to the console's key only: not to a client
    # without a certificate, nor to the engine's own (a server certificate).
    etc = RUN / "root" / "etc"
    for who in (None, (str(etc / "docker/suanli/cert.pem"), str(etc / "docker/suanli/key.pem"))):
        tls = docker.tls.TLSConfig(
            ca_cert=str(etc / "docker/suanli/ca.pem"), verify=True, client_cert=who
        )
        with pytest.raises(Exception, match="(?i)certificate|handshake|tls|ssl|reset|aborted"):
            docker.DockerClient(
                base_url=f"tcp://{THIRD}:2376", tls=tls, timeout=5, version="1.41"
            ).info()
    assert (etc / "suanli/host.credential").stat().st_mode & 0o077 == 0
    assert (etc / "docker/suanli/key.pem").stat().st_mode & 0o077 == 0
    # The firewall is in place and comes back after a reboot; the filesystem is in fstab.
    assert (
        subprocess.run(in_third("sh", str(etc / "suanli/host-firewall.sh"), "check")).returncode
        == 0
    )
    assert "host-firewall.sh apply" in (etc / "systemd/system/suanli-firewall.service").read_text()
    assert (
        f"mfsmount {os.environ['SUANLI_STORAGE_ROOT']} fuse mfsmaster="
        in (etc / "fstab").read_text()
    )

    # Again, with a new token: the same host, updated; its engine left running.
    pid = (RUN / "docker.pid").read_text()
    again = client.post(
        reverse("ops_host_add"),
        {"zone": "zone-join", "gpu_model": catalog["h100-80gb"].pk, "gpu_count": 2},
    )
    command = again.content.decode().split('data-testid="join-command">')[1].split("<")[0]
    code, out = run_on_third(command, name="join-c")
    assert code == 0, out
    assert "the engine already listens so: left running" in out
    assert Host.objects.filter(name="join-c").get().pk == host.pk and Host.objects.count() == 2
    assert (RUN / "docker.pid").read_text() == pid
    # cert.pem stays the certificate the running engine serves (dockerd reads it only when
    # it starts), so a renewal is judged on the one in use.
    served = _served_certificate(Host.objects.get(pk=host.pk), tmp_path)
    assert served == _certificate_on(etc), "the file is what the engine serves"
    # Renewed when asked: the engine restarts with a new certificate, and serves it.
    again = client.post(
        reverse("ops_host_add"),
        {"zone": "zone-join", "gpu_model": catalog["h100-80gb"].pk, "gpu_count": 2},
    )
    command = again.content.decode().split('data-testid="join-command">')[1].split("<")[0]
    code, out = run_on_third(f"export SUANLI_JOIN_RENEW=1; {command}", name="join-c")
    assert code == 0, out
    assert "SUANLI_JOIN_RENEW=1: the engine's certificate is renewed" in out
    assert "join.sh: joined: join-c is active" in out
    assert (RUN / "docker.pid").read_text() != pid, "restarted"
    renewed = _served_certificate(Host.objects.get(pk=host.pk), tmp_path)
    assert renewed == _certificate_on(etc) and renewed != served

    # A cluster on it, whose job writes to the researchers' filesystem the console reads.
    cluster = make_cluster(
        alice, "on-c", model="h100-80gb", volumes=(VolumeSpec("work", "/workspace"),),
        release_policy="never",
    )  # fmt: skip
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    assert cluster.node_set.get().host_id == host.pk
    tasks.cluster_network_ensure(cluster.pk)
    job = services.job_submit(
        cluster=cluster, spec=JobSpec(name="note", command="echo from-join-c > /workspace/note-c")
    )
    dispatch.dispatch(cluster.pk)
    job = settle_until(job, timeout=60)
    assert job.state == "succeeded", job.state_reason
    (note,) = storage_root.rglob("note-c")
    assert note.read_text() == "from-join-c\n", "the same files on the host and the console"
    services.cluster_release(cluster=cluster)
    until(lambda: tasks.cluster_network_remove(cluster.pk), timeout=60, what="its GPUs back")

    # Leave: drained, out of the swarm, removed from the fleet.
    code, out = run_on_third(f"curl -fsSL {url}/hosts/join.sh | sh -s -- leave", name="join-c")
    assert code == 0, out
    assert "left the fleet" in out
    assert not Host.objects.filter(name="join-c").exists()
    assert Host.all_objects.get(name="join-c").state == Host.State.LEFT, "its nodes' history"
    assert 'data-host="join-c"' not in client.get(reverse("ops_hosts")).content.decode()
    manager = docker.DockerClient(base_url=a.engine_url, timeout=10)
    assert THIRD not in [(n.attrs.get("Status") or {}).get("Addr") for n in manager.nodes.list()]
    manager.close()
    local = docker.DockerClient(base_url=f"unix://{RUN}/docker.sock", timeout=10)
    assert local.info()["Swarm"]["LocalNodeState"] == "inactive"
    local.close()
    assert "mfsmount" not in (etc / "fstab").read_text()
    assert not (etc / "suanli/host.credential").exists()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((THIRD, 2376), timeout=5).close()  # no TCP listener now

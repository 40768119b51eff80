"""Only the local registry's own name reaches it, and nothing else local is pulled from
(jobs/base/validators.py registry_refusal, jobs/base/addresses.py, jobs/nodes/registry.py pull_public): an
attacker's notebook. Bob, a second researcher, names images whose registry is the
loopback, a private or link-local address, or Suanli's own registry spelled another way;
canaries listen on the loopback of this machine and of each engine's own network
namespace, where an engine that pulled would knock."""

import json
import os
import subprocess
import sys
from pathlib import Path

import docker
import pytest
from browsing import free_port
from django.test import Client
from forms_data import cluster_form
from waiting import until

from console.forms import CUSTOM_IMAGE
from console.models import ApiToken
from jobs.models import Cluster, Image
from jobs.nodes import registry

pytestmark = pytest.mark.django_db

# Records every request line it gets, and answers as a registry would (so that an engine
# that reached it would go on to ask for manifests).
CANARY = r"""
import http.server, sys
log = open(sys.argv[2], "a", buffering=1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        log.write(self.requestline + "\n")
        self.send_response(200)
        self.send_header("Docker-Distribution-API-Version", "registry/2.0")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
    do_HEAD = do_GET
    def log_message(self, *a): pass
class S(http.server.ThreadingHTTPServer):
    allow_reuse_address = True
    def verify_request(self, request, client_address):
        log.write("connection\n")  # TLS or not: any knock counts
        return True
server = S((sys.argv[1], int(sys.argv[3])), H)
open(sys.argv[2] + ".ready", "w").close()
server.serve_forever()
"""


def _netns() -> list[str]:
    found = [n for n in os.environ.get("SUANLI_TEST_ENGINE_NETNS", "").split(",") if n]
    if len(found) < 2:
        pytest.fail("SUANLI_TEST_ENGINE_NETNS is not set: run with the test services")
    return found


@pytest.fixture
def canaries(tmp_path):
    """One port, listened on at 127.0.0.1 of this machine and of each engine's netns."""
    port = free_port()
    logs, procs = [], []
    for where in [None, *_netns()]:
        log = tmp_path / f"canary-{where or 'host'}.log"
        log.touch()
        prefix = ["ip", "netns", "exec", where] if where else []
        procs.append(
            subprocess.Popen(
                [*prefix, sys.executable, "-c", CANARY, "127.0.0.1", str(log), str(port)]
            )
        )
        logs.append(log)
    try:
        until(lambda: all(Path(f"{log}.ready").exists() for log in logs), what="the canaries")
        yield port, logs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _heard(logs: list[Path]) -> str:
    return "".join(log.read_text() for log in logs)


def _spellings(port: int) -> list[str]:
    """The loopback at the canary's port, as resolvers read it."""
    return [
        f"localhost:{port}/x:v1",
        f"localhost.:{port}/x:v1",
        f"suanli.localhost:{port}/x:v1",
        f"127.0.0.1:{port}/x:v1",
        f"127.1:{port}/x:v1",
        f"0x7f.1:{port}/x:v1",
        f"0177.0.0.1:{port}/x:v1",
        f"2130706433:{port}/x:v1",
        f"[::1]:{port}/x:v1",
    ]


def _ours_another_way(settings) -> list[str]:
    """Suanli's own registry (172.29.0.1:5443 in the tests) spelled otherwise."""
    host, _, port = settings.SUANLI_REGISTRY.partition(":")
    a, b, c, d = (int(n) for n in host.split("."))
    number = (a << 24) | (b << 16) | (c << 8) | d
    return [f"{number}:{port}/u1/x:v1", f"{hex(a)}.{hex(b)}.{c}.{d}:{port}/library/x:v1"]


def test_the_canary_hears_an_engine_that_pulls_from_its_loopback(canaries, engine_urls):
    """The control: an engine asked to pull from its loopback does knock on the canary."""
    port, logs = canaries
    client = docker.DockerClient(base_url=engine_urls[0], timeout=30)
    try:
        with pytest.raises(docker.errors.APIError):
            client.images.pull(f"127.0.0.1:{port}/x", tag="v1")
    finally:
        client.close()
    assert "connection" in until(lambda: _heard(logs), what="the engine's request")


def test_no_form_api_or_catalog_entry_names_a_registry_on_the_hosts_networks(
    canaries, bob, priced, operator, settings, engine_urls
):
    port, logs = canaries
    browser = Client()
    browser.force_login(bob)
    _, token = ApiToken.issue(user=bob, name="script")
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    staff = Client()
    staff.force_login(operator)
    others = [
        "10.1.2.3:5000/x:v1",  # private
        "169.254.169.254:80/x:v1",  # the metadata service
        "100.64.0.9:5000/x:v1",  # carrier-grade NAT
        f"{settings.SUANLI_REGISTRY.partition(':')[0]}:{port}/x:v1",  # the registry's host, not its port
    ]
    for ref in [*_spellings(port), *others, *_ours_another_way(settings)]:
        page = browser.post(
            "/clusters/new/", cluster_form(name="loop", image=CUSTOM_IMAGE, custom_image=ref)
        )
        assert page.status_code in (200, 400), ref
        text = page.content.decode()
        assert any(words in text for words in (
            "on the hosts&#x27; own networks", "registry written another way",
            "among your images", "Not a Docker image reference",
        )), (ref, text[-3000:])  # fmt: skip

        status = api.post(
            "/api/v1/clusters",
            json.dumps({"name": "loop", "gpu_model": "a100-80gb", "nodes": 1,
                        "gpus_per_node": 1, "image": ref, "volumes": []}),
            content_type="application/json",
        )  # fmt: skip
        body = status.json()
        assert status.status_code == 400 and "image" in body["fields"], (ref, body)

        added = staff.post(
            "/admin/jobs/image/add/", {"name": f"img-{len(ref)}-{port}", "reference": ref,
                                       "framework": "", "cuda_version": "",
                                       "description": "", "active": "on"},
        )  # fmt: skip
        assert added.status_code == 200, (ref, added.status_code)  # the form again, with why
        assert not Image.objects.filter(reference=ref).exists(), ref
    assert not Cluster.objects.exists()

    # The API's sentence for the loopback, and for the registry's own address otherwise spelled.
    body = api.post(
        "/api/v1/clusters",
        json.dumps({"name": "loop", "gpu_model": "a100-80gb", "nodes": 1, "image": f"localhost:{port}/x:v1"}),
        content_type="application/json",
    ).json()  # fmt: skip
    assert "a loopback address" in str(body["fields"]["image"]), body
    assert "pull images from public registries only" in str(body["fields"]["image"]), body

    # A catalog image stored before the rule (or a name that resolves elsewhere since): the
    # engine is still never asked to pull it.
    client = docker.DockerClient(base_url=engine_urls[0], timeout=30)
    try:
        for ref in _spellings(port)[:-1]:
            with pytest.raises(registry.RegistryError, match="hosts' own networks"):
                registry.pull_public(client, ref)
    finally:
        client.close()
    assert _heard(logs) == "", "nothing knocked on a canary"


def test_the_local_registry_by_its_own_name_and_public_registries_are_untouched(settings):
    from jobs.base import validators

    assert validators.registry_refusal(f"{settings.SUANLI_REGISTRY}/library/x:v1") is None
    assert validators.registry_refusal("pytorch/pytorch:2.4.0") is None
    assert validators.registry_refusal("docker.io/library/busybox") is None
    assert (
        validators.registry_refusal("nvcr.io/nvidia/pytorch:24.01-py3") is None
    )  # not resolved here
    # A registry the operator did not list, public or not resolvable here (the engine's
    # host might resolve it elsewhere), is refused: the researcher chooses no registry.
    for other in ("8.8.8.8:5000/x:v1", "registry.attacker.invalid/x:v1", "ghcr.io.evil/x"):
        assert "not among the registries" in validators.registry_refusal(other), other
    assert validators.registry_refusal("ghcr.io/pytorch/x:v1") is None
    settings.SUANLI_PULL_REGISTRIES = ["registry.example.com:5000"]
    assert validators.registry_refusal("registry.example.com:5000/x:v1") is None
    assert validators.registry_refusal("ghcr.io/pytorch/x:v1")
    settings.SUANLI_PULL_ALLOW_REGISTRIES = ["10.1.2.3:5000"]  # an operator's mirror on the LAN
    assert validators.registry_refusal("10.1.2.3:5000/x:v1") is None
    assert validators.registry_refusal("10.1.2.3:5001/x:v1")

"""Cluster networks never overlap the hosts' own networks (jobs/nodes/network.py overlaps, the
host check in jobs/clusters/services.py): on the real engines, a network whose subnet covers the
host's address, a peer's, or the registry's makes the host degraded (out of placement),
with the network named on the operators' pages, until it is gone."""

import docker
import pytest
from django.test import Client

from jobs.hosts import services as host_services
from jobs.placement import capacity

pytestmark = pytest.mark.django_db


@pytest.fixture
def overlapping(engine_urls):
    """On engine a, a bridge over the hosts' own /24 (172.29.0.0/24 in the tests: a's own
    address, b's and the registry's). With no IPv4 on the bridge (inhibit_ipv4) the
    engine's routes stay as they are, so the test hosts keep reaching each other meanwhile."""
    client = docker.DockerClient(base_url=engine_urls[0], timeout=30)
    made = []

    def make(subnet: str, name="suanli-test-overlap"):
        net = client.networks.create(
            name,
            driver="bridge",
            options={"com.docker.network.bridge.inhibit_ipv4": "true"},
            ipam=docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=subnet)]),
        )
        made.append(net)
        return net

    try:
        yield make
    finally:
        for net in made:
            try:
                net.remove()
            except docker.errors.NotFound:
                pass  # the test removed it itself
        client.close()


def test_a_network_over_the_hosts_addresses_is_a_problem_of_the_host(
    make_host, overlapping, operator, settings
):
    a = make_host("gpu-a-01", engine=0, gpus=2)
    b = make_host("gpu-b-01", engine=1, gpus=2)
    assert "overlaps" not in a.last_error, a.last_error  # the test engines' pools are apart

    net = overlapping(f"{b.address.rpartition('.')[0]}.0/24")
    a = host_services.host_check(host_id=a.pk)
    assert a.state == "degraded"  # the engine would route those addresses into the bridge
    assert a.pk not in capacity.Fleet.load().hosts, "out of placement"
    assert f"network {net.name} ({b.address.rpartition('.')[0]}.0/24) overlaps" in a.last_error
    assert f"its own address {a.address}" in a.last_error, a.last_error
    assert f"host gpu-b-01's address {b.address}" in a.last_error, a.last_error
    registry_host = settings.SUANLI_REGISTRY.partition(":")[0]
    assert f"the registry's address {registry_host}" in a.last_error, a.last_error
    assert "overlaps" not in host_services.host_check(host_id=b.pk).last_error  # b has no such net

    # Shown where operators look: the hosts page and the admin's host list.
    staff = Client()
    staff.force_login(operator)
    assert f"network {net.name}" in staff.get("/ops/hosts/").content.decode()
    assert f"network {net.name}" in staff.get(f"/admin/jobs/host/{a.pk}/change/").content.decode()

    net.remove()
    a = host_services.host_check(host_id=a.pk)
    assert a.state == "active" and "overlaps" not in a.last_error, a.last_error

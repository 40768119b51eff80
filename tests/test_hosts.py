"""Operators register Docker hosts; checks talk to the real engines."""

import django_rq
import pytest
from django.urls import reverse
from pki import pem_pair
from rq import SimpleWorker

from jobs import tasks
from jobs.hosts import services as host_services
from jobs.models import GpuSlot, Host

pytestmark = pytest.mark.django_db


def _admin_add(client, **fields):
    data = {
        "name": "gpu-new",
        "engine_url": "unix:///var/run/docker.sock",
        "address": "127.0.0.1",
        "zone": "zone-a",
        "gpu_model": "",
        "gpu_count": "0",
        "tls_ca": "",
        "tls_cert": "",
        "tls_key": "",
    }
    data.update(fields)
    return client.post(reverse("admin:jobs_host_add"), data)


def test_check_reads_both_real_engines_and_creates_one_slot_per_gpu(make_host):
    a = make_host("gpu-a-01", engine=0, gpus=8)
    b = make_host("gpu-b-01", engine=1, zone="zone-b", model="t4-16gb", gpus=4)
    for host, gpus in ((a, 8), (b, 4)):
        assert host.state == Host.State.ACTIVE, host.last_error
        assert host.docker_version and host.cpu_count >= 1 and host.memory_bytes > 2**20
        assert host.emulated_gpu, "no NVIDIA runtime here: the host must say its GPUs are emulated"
        assert host.last_seen is not None and host.last_error == ""
        assert sorted(GpuSlot.objects.filter(host=host).values_list("index", flat=True)) == list(
            range(gpus)
        )


def test_unreachable_engine_goes_down_with_the_engines_error_and_pages_still_work(
    make_host, client, operator, alice
):
    host = make_host("gpu-gone", engine="unix:///run/suanli-no-such-engine.sock")
    assert host.state == Host.State.DOWN
    assert "No such file or directory" in host.last_error
    client.force_login(operator)
    page = client.get(reverse("ops_hosts"))
    assert page.status_code == 200
    assert "No such file or directory" in page.content.decode()
    client.force_login(alice)
    dash = client.get(reverse("dashboard"))
    assert dash.status_code == 200
    assert dash.context["free_total"] == 0, "a down host offers nothing"


def test_tls_engine_that_does_not_answer_is_down_with_error_text(make_host):
    ca, _ = pem_pair("ca")
    cert, key = pem_pair()
    host = make_host("gpu-tls", engine="tcp://127.0.0.1:1", tls_ca=ca, tls_cert=cert, tls_key=key)
    assert host.state == Host.State.DOWN
    assert host.last_error and "refused" in host.last_error.lower()


def test_host_comes_back_from_down_into_the_state_the_operator_left(make_host, engine_urls):
    host = make_host("gpu-flaky", engine="unix:///run/suanli-no-such-engine.sock")
    host_services.host_set_draining(host=host, draining=True)
    assert Host.objects.get(pk=host.pk).state == Host.State.DOWN
    Host.objects.filter(pk=host.pk).update(engine_url=engine_urls[0])
    assert host_services.host_check(host_id=host.pk).state == Host.State.DRAINING
    host_services.host_set_draining(host=host, draining=False)
    assert host_services.host_check(host_id=host.pk).state == Host.State.ACTIVE


@pytest.mark.parametrize(
    "url, words",
    [
        ("http://10.0.0.1:2376", "Use unix:///var/run/docker.sock"),
        ("unix://var/run/docker.sock", "absolute path"),
        ("unix:///var/run/../run/docker.sock", "Write the socket path plainly"),
        ("tcp://host name:2376", "spaces"),
        ("tcp://gpu-1.example.com", "TLS port"),
        ("tcp://gpu-1.example.com:99999", "1 to 65535"),
        ("tcp://-bad-.example.com:2376", "not a host name"),
        ("tcp://gpu-1:2376/v1.41?x=1", "only host and port"),
        ("", "This field is required"),
    ],
)
def test_malformed_engine_urls_get_a_clear_form_error(client, operator, url, words):
    client.force_login(operator)
    response = _admin_add(client, engine_url=url)
    assert response.status_code == 200
    assert words in response.content.decode()
    assert not Host.objects.exists()


def test_tcp_engine_without_tls_files_names_each_missing_file(client, operator):
    client.force_login(operator)
    body = _admin_add(client, engine_url="tcp://gpu-1.example.com:2376").content.decode()
    for label in ("CA certificate", "client certificate", "client key"):
        assert f"paste the {label} (PEM)" in body
    assert not Host.objects.exists()


def test_wrong_tls_material_is_refused_before_saving(client, operator):
    client.force_login(operator)
    ca, _ = pem_pair("ca")
    cert, _ = pem_pair()
    _, other_key = pem_pair()
    body = _admin_add(
        client,
        engine_url="tcp://gpu-1.example.com:2376",
        tls_ca="not a cert",
        tls_cert=cert,
        tls_key=other_key,
    ).content.decode()
    assert "This is not a PEM certificate" in body
    assert "does not belong to the client certificate" in body
    body = _admin_add(
        client,
        engine_url="tcp://gpu-1.example.com:2376",
        tls_ca=ca,
        tls_cert=cert,
        tls_key="-----BEGIN nonsense",
    ).content.decode()
    assert "not a PEM private key" in body
    assert not Host.objects.exists()


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"gpu_model": "a100-80gb", "gpu_count": "0"}, "A GPU host has 1 to 16 GPUs (got 0)"),
        (
            {"gpu_model": "a100-80gb", "gpu_count": "10000"},
            "A GPU host has 1 to 16 GPUs (got 10000)",
        ),
        ({"gpu_count": "4"}, "A CPU-only host has 0 GPUs"),
        ({"name": "GPU Host #1"}, "lower-case letters, digits and dashes"),
        ({"address": "not an address!"}, "host name or an IP address"),
    ],
)
def test_bad_gpu_counts_and_names_get_clear_messages(client, operator, catalog, fields, words):
    client.force_login(operator)
    if "gpu_model" in fields:
        fields = {**fields, "gpu_model": str(catalog[fields["gpu_model"]].pk)}
    response = _admin_add(client, **fields)
    assert response.status_code == 200
    assert words in response.content.decode()
    assert not Host.objects.exists() and not GpuSlot.objects.exists()


def test_duplicate_host_name_is_refused(client, operator, make_host):
    make_host("gpu-a-01")
    client.force_login(operator)
    response = _admin_add(client, name="gpu-a-01")
    assert "Host with this Name already exists" in response.content.decode()
    assert Host.objects.count() == 1


def test_admin_add_checks_the_engine_and_says_so(client, operator, engine_urls, catalog):
    client.force_login(operator)
    response = _admin_add(
        client,
        name="gpu-b-02",
        engine_url=engine_urls[1],
        gpu_model=str(catalog["h100-80gb"].pk),
        gpu_count="2",
    )
    assert response.status_code == 302
    host = Host.objects.get(name="gpu-b-02")
    assert host.state == Host.State.ACTIVE and host.slots.count() == 2
    page = client.get(response.url)
    body = page.content.decode()
    assert "Host gpu-b-02 is active: Docker" in body
    assert "emulated GPUs" in page.content.decode()


def test_check_now_button_and_gpu_count_change_resync_slots(client, operator, make_host, catalog):
    host = make_host("gpu-a-01", gpus=8)
    client.force_login(operator)
    response = client.post(reverse("admin:jobs_host_check", args=[host.pk]))
    assert response.status_code == 302
    change = reverse("admin:jobs_host_change", args=[host.pk])
    data = {
        "name": host.name,
        "engine_url": host.engine_url,
        "address": host.address,
        "zone": host.zone,
        "gpu_model": str(catalog["a100-80gb"].pk),
        "gpu_count": "4",
        "tls_ca": "",
        "tls_cert": "",
        "tls_key": "",
    }
    assert client.post(change, data).status_code == 302
    assert sorted(host.slots.values_list("index", flat=True)) == [0, 1, 2, 3]


def test_stored_tls_key_is_never_shown_back_and_kept_when_left_empty(client, operator, catalog):
    ca, _ = pem_pair("ca")
    cert, key = pem_pair()
    host = Host(
        name="gpu-remote",
        engine_url="tcp://127.0.0.1:1",
        address="127.0.0.1",
        zone="zone-a",
        tls_ca=ca,
        tls_cert=cert,
        tls_key=key,
    )
    host_services.host_save(host=host)
    client.force_login(operator)
    change = reverse("admin:jobs_host_change", args=[host.pk])
    page = client.get(change).content.decode()
    assert "PRIVATE KEY" not in page
    data = {
        "name": host.name,
        "engine_url": host.engine_url,
        "address": "10.1.2.3",
        "zone": "zone-a",
        "gpu_model": "",
        "gpu_count": "0",
        "tls_ca": ca,
        "tls_cert": cert,
        "tls_key": "",
    }
    assert client.post(change, data).status_code == 302
    host.refresh_from_db()
    assert host.address == "10.1.2.3" and host.tls_key == key


def test_researchers_cannot_reach_operator_pages(client, alice, make_host):
    host = make_host("gpu-a-01")
    client.force_login(alice)
    for url in (reverse("ops_hosts"), reverse("admin:jobs_host_changelist")):
        response = client.get(url)
        assert response.status_code == 302 and "/admin/login/" in response.url
    response = client.post(reverse("ops_host_check", args=[host.pk]))
    assert response.status_code == 302 and "/admin/login/" in response.url


def test_periodic_check_runs_through_real_redis_once_per_host(make_host, engine_urls):
    a = make_host("gpu-a-01", engine=0, check=False)
    b = make_host("gpu-b-01", engine=1, check=False)
    queue = django_rq.get_queue("docker")
    queue.empty()
    assert tasks.hosts_check_all() == 2
    assert tasks.hosts_check_all() == 2  # a second tick while the first is queued adds nothing
    assert queue.count == 2
    SimpleWorker([queue], connection=queue.connection, serializer=queue.serializer).work(burst=True)
    for host in (a, b):
        host.refresh_from_db()
        assert host.state == Host.State.ACTIVE and host.last_checked is not None


def test_cron_enqueues_the_periodic_tasks_in_json_for_the_workers(make_host):
    from console.management.commands.suanli_cron import SuanliCronScheduler

    host = make_host("gpu-a-01", engine=0, check=False)
    scheduler = SuanliCronScheduler()
    scheduler.load_config_from_file("console.cron")
    names = {job.func.__name__ for job in scheduler.enqueue_jobs()}
    assert {"hosts_check_all", "place_pending", "clusters_release_idle"} <= names
    assert scheduler.enqueue_jobs() == [], "nothing is due again at once"
    queue = django_rq.get_queue("default")
    assert queue.serializer.__name__ == "JSONSerializer"
    SimpleWorker(
        [queue, django_rq.get_queue("docker")],
        connection=queue.connection,
        serializer=queue.serializer,
    ).work(burst=True)
    host.refresh_from_db()
    assert host.state == Host.State.ACTIVE, "the cron tick checked the host through the workers"


@pytest.mark.browser
def test_hosts_page_says_which_hosts_can_share_a_multi_node_network(
    page, live_server, make_host, operator
):
    import os

    from playwright.sync_api import expect

    make_host("gpu-a-01", engine=0, gpus=8)
    outside = make_host("gpu-b-01", engine=1, gpus=8)
    Host.objects.filter(pk=outside.pk).update(swarm_state="inactive", swarm_cluster="")
    page.goto(f"{live_server.url}/login/")
    page.fill("#id_username", "olga")
    page.fill("#id_password", "olga-pass-123")
    page.click("button[type=submit]")
    page.wait_for_url(f"{live_server.url}/")
    page.goto(f"{live_server.url}/ops/hosts/")
    member = page.locator("tr[data-host='gpu-a-01'] [data-testid=network-note]")
    expect(member).to_contain_text("Swarm manager: takes multi-node clusters that span hosts")
    expect(page.locator("tr[data-host='gpu-b-01'] [data-testid=network-note]")).to_contain_text(
        "Not a swarm member (inactive): takes clusters whose nodes all fit on this host"
    )
    shots = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
    page.screenshot(path=f"{shots}/ops_hosts_network.png", full_page=True)

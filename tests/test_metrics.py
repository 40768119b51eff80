"""Prometheus metrics for operators (jobs/base/metrics.py, console/metrics.py): the web's
/metrics tells the fleet a test made, read by prometheus_client's own parser; only a
scraper with the token or an allowed address, or an operator holding console.view_metrics,
reads it; each process's own port serves its series and refuses a scraper without the
token; what a forked work horse observes reaches /metrics through Redis."""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import pytest
import requests
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.db import transaction
from django.test import Client
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families
from test_gateway import make_key, start_gateway  # noqa: F401 (the gateway's fixture)
from test_webhooks import Receiver

from billing import tasks as billing_tasks
from billing.catalog import seed_rate_card
from console import metrics as web_metrics
from console.models import ApiToken
from jobs.base import metrics
from jobs.events import webhooks
from jobs.models import Cluster, GpuSlot, Host, ImageBuild, Job, Node, Team, WebhookEndpoint
from jobs.placement import scheduler

TOKEN = "metrics-token-0123456789abcdef0123456789"


@pytest.fixture(autouse=True)
def _fresh(settings):
    settings.SUANLI_METRICS_TOKEN = TOKEN
    settings.SUANLI_METRICS_ALLOW = []
    settings.SUANLI_METRICS_CACHE_S = 0
    web_metrics.forget_cache()
    metrics.forget_outages()
    yield
    web_metrics.forget_cache()
    metrics.forget_outages()


@pytest.fixture
def serving():
    """`metrics.serve` in this process: every server a test started is shut down after it
    (its port freed, its process forgotten)."""
    yield metrics.serve
    for process in list(metrics._servers):
        metrics.stop_serving(process)


def scrape(client: Client | None = None, **headers) -> dict:
    """{name: {labels tuple: value}} of every sample /metrics answers with the token."""
    client = client or Client()
    response = client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}", **headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    return parse(response.content.decode())


def parse(text: str) -> dict:
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def value(series: dict, name: str, **labels) -> float:
    return series[name][tuple(sorted(labels.items()))]


@pytest.fixture
def fleet(make_paper_host, make_cluster, alice, bob, catalog, fund):
    """Two active A100 hosts in two zones, one down, one degraded H100 host; alice runs a
    2-GPU cluster, bob a 1-GPU one that he has stopped (its GPU still held until its
    engine confirms the workspace gone), and bob waits for 2 H100s nobody can give."""
    seed_rate_card(effective_from=timezone.now() - timedelta(hours=1))
    fund(alice, "100")
    fund(bob, "50")
    make_paper_host("gpu-a-01", zone="zone-a", gpus=8)
    make_paper_host("gpu-b-01", zone="zone-b", gpus=4)
    make_paper_host("gpu-b-02", zone="zone-b", gpus=4, state=Host.State.DOWN)
    make_paper_host("h100-a-01", zone="zone-a", model="h100-80gb", gpus=2)
    running = make_cluster(alice, "train", gpus=2, zone="zone-a")
    stopped = make_cluster(bob, "paused", gpus=1, zone="zone-a")
    scheduler.place_pending()
    # The H100 host turns degraded (its canary failed): bob's request for it waits.
    Host.objects.filter(name="h100-a-01").update(state=Host.State.DEGRADED)
    waiting = make_cluster(bob, "big", gpus=2, model="h100-80gb")
    scheduler.place_pending()
    # bob's stop as it stands before the engine confirmed the workspace gone: the node has
    # ended (released_at = stopped_at), its slot is still held.
    now = timezone.now()
    Node.objects.filter(cluster=stopped).update(released_at=now, stopped_at=now)
    Cluster.objects.filter(pk=stopped.pk).update(state=Cluster.State.STOPPED, stopped_at=now)
    Job.objects.create(cluster=running, owner=alice, name="j1", command="true", state="running")
    Job.objects.create(cluster=running, owner=alice, name="j2", command="true", state="queued")
    for c in (running, stopped, waiting):
        c.refresh_from_db()
    return {"running": running, "stopped": stopped, "waiting": waiting}


def test_the_fleet_as_made(fleet, catalog):
    assert fleet["running"].state == "running" and fleet["waiting"].state == "pending"
    a100, h100 = catalog["a100-80gb"].name, catalog["h100-80gb"].name
    s = scrape()
    gpus = s["suanli_gpus"]
    assert value(s, "suanli_gpus", model=a100, zone="zone-a", state="rented") == 2
    assert value(s, "suanli_gpus", model=a100, zone="zone-a", state="stopped_held") == 1
    assert value(s, "suanli_gpus", model=a100, zone="zone-a", state="free") == 5
    assert value(s, "suanli_gpus", model=a100, zone="zone-b", state="free") == 4
    assert value(s, "suanli_gpus", model=a100, zone="zone-b", state="down") == 4
    assert value(s, "suanli_gpus", model=h100, zone="zone-a", state="free") == 2
    assert sum(gpus.values()) == GpuSlot.objects.count() == 18
    assert value(s, "suanli_hosts", state="active") == 2
    assert value(s, "suanli_hosts", state="down") == 1
    assert value(s, "suanli_hosts", state="degraded") == 1
    assert value(s, "suanli_hosts", state="draining") == 0
    assert value(s, "suanli_host_up", host="gpu-b-02", zone="zone-b") == 0
    assert value(s, "suanli_host_up", host="gpu-a-01", zone="zone-a") == 1
    assert value(s, "suanli_host_degraded", host="h100-a-01", zone="zone-a") == 1
    assert value(s, "suanli_host_degraded", host="gpu-a-01", zone="zone-a") == 0
    assert value(s, "suanli_clusters", state="running") == 1
    assert value(s, "suanli_clusters", state="stopped") == 1
    assert value(s, "suanli_clusters", state="pending") == 1
    assert value(s, "suanli_jobs", state="running") == 1
    assert value(s, "suanli_jobs", state="queued") == 1
    assert value(s, "suanli_queue_length", model=h100) == 1
    assert 0 <= value(s, "suanli_queue_oldest_seconds", model=h100) < 600
    # Two placements so far, each observed with its time in the queue.
    assert value(s, "suanli_placements_total") == 2
    assert value(s, "suanli_queue_wait_seconds_count", model=a100) == 2
    assert value(s, "suanli_queue_wait_seconds_bucket", model=a100, le="+Inf") == 2
    # alice's 2 A100s at the starting card's 7.80 per GPU-hour; bob's stopped node is not running.
    assert value(s, "suanli_revenue_cny_per_hour") == pytest.approx(15.6)
    assert value(s, "suanli_balance_cny", kind="researcher") == pytest.approx(150)
    assert value(s, "suanli_balance_cny", kind="team") == 0
    assert value(s, "suanli_builds", state="queued") == 0
    # No label names a person, a cluster or a job.
    labels = {k for series in s.values() for key in series for k, _ in key}
    assert labels <= {"model", "zone", "state", "host", "queue", "process", "shard", "kind", "le"}


def test_a_queued_build_and_a_queued_rq_job_are_counted(db, alice):
    import django_rq

    ImageBuild.objects.create(owner=alice, name="my-torch", tag="v1", dockerfile="FROM x\n")
    django_rq.get_queue("default").enqueue("jobs.tasks.webhooks_sweep")
    s = scrape()
    assert value(s, "suanli_builds", state="queued") == 1
    assert value(s, "suanli_builds", state="running") == 0
    assert value(s, "suanli_rq_queue_depth", queue="default") == 1


def test_a_webhook_delivery_given_up_is_counted(db, alice, settings, work_queue):
    """A receiver answering 500 to the delivery's last attempt: one more failure."""
    settings.SUANLI_WEBHOOK_ALLOW_NETS = ["127.0.0.0/8"]
    settings.SUANLI_WEBHOOK_RETRY_DELAYS = [0]  # one attempt only
    receiver = Receiver()
    receiver.statuses = [500]
    try:
        before = scrape().get("suanli_webhook_delivery_failures_total", {}).get((), 0)
        endpoint = WebhookEndpoint.objects.create(
            owner=alice, url=receiver.url, events=["job.failed"], secret=webhooks.new_secret()
        )
        with transaction.atomic():
            webhooks.emit(owner_id=alice.pk, event_type="job.failed", data={"job": {"id": 1}})
        work_queue("webhooks")
        assert len(receiver.requests) == 1
        assert endpoint.deliveries.get().state == "dead"
        assert scrape()["suanli_webhook_delivery_failures_total"][()] == before + 1
    finally:
        receiver.close()


def test_balances_split_researchers_and_teams(fleet, fund):
    lab = get_user_model().objects.create_user("lab-principal")
    Team.objects.create(principal=lab, name="lab")
    fund(lab, "30")
    s = scrape()
    assert value(s, "suanli_balance_cny", kind="team") == pytest.approx(30)
    assert value(s, "suanli_balance_cny", kind="researcher") == pytest.approx(150)


def test_a_scrape_costs_a_bounded_number_of_queries(
    fleet, make_paper_host, django_assert_max_num_queries
):
    for i in range(10):
        make_paper_host(f"more-{i}", zone=f"zone-{i % 3}", gpus=2)
    client = Client()
    with django_assert_max_num_queries(12):
        scrape(client)


def test_the_scrape_is_kept_a_few_seconds(fleet, settings, django_assert_num_queries):
    settings.SUANLI_METRICS_CACHE_S = 60
    first = scrape()
    with django_assert_num_queries(0):
        again = scrape()
    assert again == first


def test_the_accrual_tick_is_told(fleet):
    billing_tasks.accrue()
    s = scrape()
    assert time.time() - value(s, "suanli_accrual_last_tick_timestamp_seconds") < 600
    assert value(s, "suanli_accrual_tick_seconds") > 0
    assert 0 <= value(s, "suanli_accrual_lag_seconds") < 600


def _grant(user, perm):
    app, _, codename = perm.partition(".")
    user.user_permissions.add(
        Permission.objects.get(content_type__app_label=app, codename=codename)
    )
    return get_user_model().objects.get(pk=user.pk)


def test_only_scrapers_and_operators_with_the_power_read_it(db, alice, settings):
    client = Client()
    # Nobody: asked to authenticate.
    response = client.get("/metrics")
    assert response.status_code == 401 and "Bearer" in response["WWW-Authenticate"]
    # A wrong token, or a researcher's API token: 403.
    assert client.get("/metrics", HTTP_AUTHORIZATION="Bearer nope").status_code == 403
    _, api_token = ApiToken.issue(user=alice, name="laptop")
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Bearer {api_token}").status_code == 403
    assert client.get("/metrics", HTTP_AUTHORIZATION=f"Token {TOKEN}").status_code == 403
    # A researcher's session: 403.
    client.force_login(alice)
    assert client.get("/metrics").status_code == 403
    # Staff status alone grants nothing.
    staff = get_user_model().objects.create_user("sam", password="x", is_staff=True)
    client.force_login(staff)
    assert client.get("/metrics").status_code == 403
    client.force_login(_grant(staff, web_metrics.POWER))
    assert client.get("/metrics").status_code == 200
    client.logout()
    # The token.
    assert Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {TOKEN}").status_code == 200
    # No token set: no bearer opens it (not even an empty one).
    settings.SUANLI_METRICS_TOKEN = ""
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 403
    assert Client().get("/metrics").status_code == 401


def test_an_allowed_address_reads_it_and_a_forwarded_header_does_not(db, settings):
    settings.SUANLI_METRICS_ALLOW = ["10.9.0.0/16"]
    assert Client(REMOTE_ADDR="10.9.3.4").get("/metrics").status_code == 200
    outsider = Client(REMOTE_ADDR="192.0.2.7")
    assert outsider.get("/metrics").status_code == 401
    # Whoever writes X-Forwarded-For is not believed: the peer's address is what counts.
    forged = outsider.get("/metrics", HTTP_X_FORWARDED_FOR="10.9.3.4", HTTP_X_REAL_IP="10.9.3.4")
    assert forged.status_code == 401
    # Not a POST either.
    assert Client(REMOTE_ADDR="10.9.3.4").post("/metrics").status_code == 405


def test_a_non_loopback_bind_without_a_token_is_refused(settings):
    settings.SUANLI_METRICS_BIND = "0.0.0.0"  # noqa: S104
    settings.SUANLI_METRICS_TOKEN = ""
    from django.core.management.base import SystemCheckError

    with pytest.raises(SystemCheckError, match="suanli.E006"):
        call_command("check")
    settings.SUANLI_METRICS_TOKEN = TOKEN
    call_command("check")
    settings.SUANLI_METRICS_TOKEN = "short"
    with pytest.raises(SystemCheckError, match="suanli.E007"):
        call_command("check")
    settings.SUANLI_METRICS_BIND = "127.0.0.1"
    settings.SUANLI_METRICS_TOKEN = ""
    call_command("check")


def test_the_shipped_scrape_needs_its_address_in_allowed_hosts(db, settings):
    """Prometheus scrapes http://127.0.0.1:8000/metrics (deploy/prometheus/prometheus.yml):
    with ALLOWED_HOSTS the console's name alone Django answers 400; with 127.0.0.1 added
    (docs/operator/metrics.md) the scrape reads the series, and other hosts stay refused."""
    headers = {"HTTP_HOST": "127.0.0.1:8000", "HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}
    settings.ALLOWED_HOSTS = ["console.example"]
    assert Client().get("/metrics", **headers).status_code == 400
    settings.ALLOWED_HOSTS = ["console.example", "127.0.0.1"]
    assert Client().get("/metrics", **headers).status_code == 200
    assert Client().get("/metrics", **{**headers, "HTTP_HOST": "evil.example"}).status_code == 400


def test_check_warns_of_a_scrape_refused_and_of_a_loopback_allowed(settings):
    """`manage.py check`: the shipped config scrapes http://127.0.0.1:8000, whose Host
    must be allowed; a loopback address allowed by address would let in every visitor a
    local reverse proxy (not a trusted one) forwards."""
    from django.core.checks import run_checks

    def warned():
        return {m.id for m in run_checks(tags=["security"]) if m.id.startswith("suanli.W00")}

    settings.ALLOWED_HOSTS = ["console.example"]
    assert "suanli.W002" in warned()
    settings.ALLOWED_HOSTS = ["console.example", "127.0.0.1"]
    assert "suanli.W002" not in warned()
    settings.SUANLI_METRICS_TOKEN = ""  # no token: no scrape of the shipped config
    settings.ALLOWED_HOSTS = ["console.example"]
    assert "suanli.W002" not in warned()
    for allowed in (["127.0.0.1"], ["10.0.0.0/8", "::1"], ["0.0.0.0/0"]):
        settings.SUANLI_METRICS_ALLOW = allowed
        assert "suanli.W003" in warned(), allowed
    settings.SUANLI_METRICS_ALLOW = ["10.9.0.0/16", "2001:db8::/32"]
    assert "suanli.W003" not in warned()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = requests.get(url, headers=headers, timeout=5)
    return response.status_code, response.text


def test_a_process_port_serves_its_series_behind_the_token(settings, serving):
    base = _free_port()
    settings.SUANLI_METRICS_PORTS = {"monitor": base}
    settings.SUANLI_METRICS_BIND = "127.0.0.1"
    port = serving("monitor")
    assert port == base
    metrics.MONITOR_TICKS.labels(shard="0").inc()
    status, _ = _get(f"http://127.0.0.1:{port}/metrics")
    assert status == 401
    status, _ = _get(f"http://127.0.0.1:{port}/metrics", token="wrong")
    assert status == 401
    status, body = _get(f"http://127.0.0.1:{port}/metrics", token=TOKEN)
    assert status == 200
    s = parse(body)
    assert value(s, "suanli_process_info", process="monitor") == 1
    assert value(s, "suanli_monitor_ticks_total", shard="0") >= 1
    assert "process_cpu_seconds_total" in s  # prometheus_client's own collectors
    # A second process of a kind on this machine takes the next port, not an error.
    settings.SUANLI_METRICS_PORTS = {"monitor": base, "gateway": base}
    assert serving("gateway") not in (None, base)


def test_a_histogram_observed_in_a_forked_process_is_on_metrics(db):
    before = scrape().get("suanli_job_start_seconds_count", {}).get((), 0)
    pid = os.fork()
    if pid == 0:  # the child: as an RQ work horse, it observes and dies
        try:
            metrics.observe(metrics.JOB_START, 3.0)
            metrics.observe(metrics.JOB_START, 40.0)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    s = scrape()
    assert value(s, "suanli_job_start_seconds_count") == before + 2
    assert value(s, "suanli_job_start_seconds_bucket", le="5.0") >= 1
    assert value(s, "suanli_job_start_seconds_sum") >= 43.0


def test_an_observation_with_redis_away_costs_its_caller_nothing(settings, caplog):
    """Redis away: logged once, and not tried again until the outage's back-off has passed,
    so that no caller (a job's start inside its transaction) waits on it each time."""
    import threading

    tries = []
    away = socket.socket()  # a "Redis" that hangs up at once on whoever connects
    away.bind(("127.0.0.1", 0))
    away.listen(16)

    def hang_up():
        while True:
            try:
                conn, _ = away.accept()
            except OSError:
                return  # closed: the test is over
            tries.append(1)
            conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    settings.REDIS_URL = f"redis://127.0.0.1:{away.getsockname()[1]}/0"
    try:
        with caplog.at_level("WARNING", logger="jobs.base.metrics"):
            metrics.observe(metrics.PLACEMENT_PASS, 0.1)
            first = len(tries)
            metrics.inc(metrics.PLACEMENTS)
            metrics.beat("cron")
    finally:
        away.shutdown(socket.SHUT_RDWR)  # wakes the accept
        away.close()
    assert first >= 1 and len(tries) == first  # the next two waited for nothing
    # Logged once for the outage, not once per observation.
    said = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(said) == 1


def _wait_for(check, timeout=60.0, every=0.3):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except (OSError, requests.RequestException, KeyError, AssertionError):
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError("never came")
        time.sleep(every)


def test_the_cron_process_serves_its_port_and_beats(processes):
    port = _free_port()
    processes.start(
        "cron",
        env={"SUANLI_METRICS_PORTS": f"cron={port}", "SUANLI_METRICS_TOKEN": TOKEN},
    )
    url = f"http://127.0.0.1:{port}/metrics"
    status, body = _wait_for(lambda: _get(url, token=TOKEN))
    assert status == 200
    assert value(parse(body), "suanli_process_info", process="cron") == 1
    assert _get(url)[0] == 401
    # Its beat reaches the web's /metrics through Redis.
    beats = _wait_for(lambda: scrape()["suanli_process_heartbeat_timestamp_seconds"])
    assert time.time() - beats[(("process", "cron"), ("shard", ""))] < 60


def test_a_forked_work_horse_observes_into_metrics(processes):
    """The Procfile's worker forks a horse per job: the placement pass it runs is timed
    there and reaches the web's /metrics; the worker's own port serves its series."""
    from jobs.base.queue import enqueue_unique

    port = _free_port()
    processes.start("worker", env={"SUANLI_METRICS_PORTS": f"worker={port}"})
    before = scrape().get("suanli_placement_pass_seconds_count", {}).get((), 0)
    enqueue_unique("default", "jobs.tasks.place_pending", job_id="place-pending", at_once=True)
    _wait_for(lambda: value(scrape(), "suanli_placement_pass_seconds_count") > before)
    s = scrape()
    assert value(s, "suanli_placement_pass_seconds_bucket", le="+Inf") > before
    status, body = _wait_for(lambda: _get(f"http://127.0.0.1:{port}/metrics", token=TOKEN))
    assert value(parse(body), "suanli_process_info", process="worker") == 1
    # An idle worker beats too (RQ's own heartbeat comes only every few minutes).
    beats = _wait_for(lambda: scrape()["suanli_process_heartbeat_timestamp_seconds"])
    assert time.time() - beats[(("process", "worker"), ("shard", ""))] < 60


@pytest.mark.engine
def test_a_tenant_container_reaches_no_metrics_port(
    processes, running_cluster, settle_until, settings
):
    """Even bound to every address (with a token, as `manage.py check` demands), the
    processes' metrics ports are out of a researcher's container's reach: on the console
    machine's loopback and on its address on the hosts' network alike. Before the probe,
    this machine shows the port is there."""
    from jobs.clusters import services
    from jobs.clusters.services import JobSpec
    from jobs.runs import dispatch

    gateway = [a for a in os.environ.get("SUANLI_TEST_HOSTS_GATEWAY", "").split(",") if a]
    if not gateway:
        pytest.fail("SUANLI_TEST_HOSTS_GATEWAY is not set: run the suite with `make test`")
    port = _free_port()
    processes.start(
        "cron",
        env={
            "SUANLI_METRICS_PORTS": f"cron={port}",
            "SUANLI_METRICS_TOKEN": TOKEN,
            "SUANLI_METRICS_BIND": "0.0.0.0",  # noqa: S104 (the worst an operator may do)
        },
    )
    url = f"http://{gateway[0]}:{port}/metrics"
    assert _wait_for(lambda: _get(url, token=TOKEN))[0] == 200
    assert _get(url)[0] == 401
    cluster = running_cluster(1)
    request = "printf 'GET /metrics HTTP/1.0\\r\\n\\r\\n'"
    probes = "; ".join(
        f"echo PROBE {addr}; {request} | nc -w 2 {addr} {port} 2>&1; true"
        for addr in ("127.0.0.1", gateway[0])
    )
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="probe", command=probes))
    dispatch.dispatch(cluster.pk)
    job = settle_until(job, timeout=90)
    log = job.replicas.get().log
    assert log.count("PROBE") == 2, log
    assert "HTTP/" not in log and "suanli_" not in log, (
        f"a container reached a metrics port:\n{log}"
    )
    # The job's start was observed (submit -> running) on the way.
    assert value(scrape(), "suanli_job_start_seconds_count") >= 1


def test_the_monitor_counts_its_rounds_on_its_port(db, settings, serving):
    """The monitor's rounds and lag per shard, as its port serves them: rounds longer than
    their interval (0 here) show as lag."""
    import asyncio

    from monitoring.monitor import Monitor

    port = _free_port()
    settings.SUANLI_METRICS_PORTS = {"watch": port}  # any process's port serves the registry
    assert serving("watch") == port
    before = metrics.MONITOR_TICKS.labels(shard="0")._value.get()
    monitor = Monitor(publish=False, interval=0)
    try:
        asyncio.run(monitor.run(ticks=3))
    finally:
        monitor.close()
    s = parse(_get(f"http://127.0.0.1:{port}/metrics", token=TOKEN)[1])
    assert value(s, "suanli_monitor_ticks_total", shard="0") == before + 3
    assert value(s, "suanli_monitor_lag_seconds", shard="0") > 0


def test_the_gateway_counts_failed_log_ins_on_its_port(start_gateway, tmp_path, alice):  # noqa: F811
    """A connection that asked to log in and ended without: one failure on the gateway's
    port (the same failure django-axes counts against the address)."""
    port = _free_port()
    gateway = start_gateway(SUANLI_METRICS_PORTS=f"gateway={port}", SUANLI_METRICS_TOKEN=TOKEN)
    url = f"http://127.0.0.1:{port}/metrics"
    s = parse(_wait_for(lambda: _get(url, token=TOKEN))[1])
    assert value(s, "suanli_gateway_auth_failures_total") == 0
    assert value(s, "suanli_gateway_sessions") == 0
    stranger = make_key(tmp_path / "mallory", "id_ed25519")  # a key nobody registered
    assert gateway.ssh(stranger, "alice-c1", "true", timeout=30).returncode != 0
    _wait_for(
        lambda: value(parse(_get(url, token=TOKEN)[1]), "suanli_gateway_auth_failures_total") == 1
    )
    assert _get(url)[0] == 401

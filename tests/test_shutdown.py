"""Scheduled and idle shutdown (定时关机, issue 41): a cluster stopped (files kept) at the time
its owner set, or after N minutes with every GPU under X % by the monitor's samples; never
without samples, never while one GPU works, never by a stale schedule; the timeline says
why. Set at creation or later (form, API, CLI), by its owner only, with clear refusals.

The rules are applied by the cron tick (monitoring/idle.py over jobs/clusters/shutdown.py);
the clock is moved with time_machine, and samples are written as the monitor writes them.
Clusters run on paper hosts (a stop that needs no engine) unless the test says otherwise.
"""

import json
import os
from datetime import UTC, datetime, timedelta
from functools import partial

import docker
import pytest
import time_machine
from click.testing import CliRunner
from django.test import Client
from django.urls import reverse
from django.utils import timezone, translation
from playwright.sync_api import expect

from console import preferences
from console.forms import ClusterForm, check_funds
from console.models import ApiToken
from jobs import tasks
from jobs.base.text import show
from jobs.clusters import services, shutdown
from jobs.clusters.spec import ClusterRequest, Image, Offer, ShutdownRequest
from jobs.models import Cluster, ClusterEvent, Node
from jobs.nodes import workspaces
from jobs.placement import scheduler
from monitoring import idle
from monitoring import tasks as monitoring_tasks
from monitoring.models import Sample
from suanli_cli import cli
from tests.browsing import login
from tests.forms_data import cluster_form

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 12, 6, 14, 0, tzinfo=UTC)  # 22:00 in Beijing


@pytest.fixture
def placed(make_paper_host, make_cluster, alice):
    """A running cluster of `nodes` x `gpus` on paper hosts, placed at T0."""

    def make(name="c1", *, nodes=1, gpus=2, owner=None, **extra):
        if not make_paper_host.__dict__.get("made"):
            make_paper_host("gpu-paper-01", gpus=8)
            make_paper_host.__dict__["made"] = True
        extra.setdefault("release_policy", "never")
        with time_machine.travel(T0, tick=False):
            cluster = make_cluster(owner or alice, name, nodes=nodes, gpus=gpus, **extra)
            scheduler.place_pending()
        cluster.refresh_from_db()
        assert cluster.state == "running", cluster.state_reason
        return cluster

    return make


def _samples(cluster, start, minutes, util, *, node=None, every_s=10):
    """What the monitor writes: a row per node every few seconds, a value per GPU."""
    nodes = Node.objects.filter(cluster=cluster, released_at__isnull=True)
    rows = []
    for n in nodes:
        if node is not None and n.index != node:
            continue
        for s in range(0, minutes * 60, every_s):
            values = util(n.index, s) if callable(util) else util
            rows.append(
                Sample(
                    at=start + timedelta(seconds=s),
                    cluster=cluster,
                    host=n.host,
                    node_index=n.index,
                    gpu_util=values,
                    gpu_mem_mib=[100.0] * len(values),
                    gpu_source="nvml",
                    cpu_pct=3.0,
                    mem_bytes=10**8,
                    net_rx_bps=0.0,
                    net_tx_bps=0.0,
                    disk_read_bps=0.0,
                    disk_write_bps=0.0,
                    read_iops=0.0,
                    write_iops=0.0,
                )  # fmt: skip
            )
    Sample.objects.bulk_create(rows)


def _tick(at):
    with time_machine.travel(at, tick=False):
        return idle.clusters_shutdown()


def _timeline(cluster, language="zh-hans", zone="Asia/Shanghai"):
    with translation.override(language), timezone.override(zone):
        return [
            show(e.text) if e.text else e.message
            for e in ClusterEvent.objects.filter(cluster=cluster)
        ]


def _reason(cluster, language="zh-hans", zone="Asia/Shanghai"):
    cluster.refresh_from_db()
    with translation.override(language), timezone.override(zone):
        return show(cluster.state_reason_text)


# -- the scheduled stop ----------------------------------------------------------------


def test_a_cluster_stops_at_the_time_set_and_the_timeline_says_so(placed):
    cluster = placed(stop_at=T0 + timedelta(hours=1))  # 23:00 in Beijing
    assert _tick(T0 + timedelta(minutes=59)) == {"scheduled": [], "idle": []}
    cluster.refresh_from_db()
    assert cluster.state == "running"
    assert _tick(T0 + timedelta(hours=1, seconds=20))["scheduled"] == [cluster.pk]
    cluster.refresh_from_db()
    assert cluster.state == "stopped" and cluster.stop_at is None  # applied once
    assert cluster.state_reason == "stopped at 15:00 UTC as scheduled"
    assert _reason(cluster, "en", "Asia/Shanghai") == "stopped at 23:00 CST as scheduled"
    assert any(
        line.startswith("stopped at 23:00 CST as scheduled: 2 GPUs returned")
        for line in _timeline(cluster, "en")
    )
    assert Node.objects.filter(cluster=cluster, stopped_at__isnull=False).exists()  # kept
    assert _tick(T0 + timedelta(hours=2)) == {"scheduled": [], "idle": []}


def test_a_stale_schedule_never_stops_a_cluster_started_again_after_it(placed):
    cluster = placed(stop_at=T0 + timedelta(hours=1))
    with time_machine.travel(T0 + timedelta(minutes=10), tick=False):
        services.cluster_stop(cluster=cluster)
    # 23:00 passes while it is stopped; its owner starts it at 23:30.
    with time_machine.travel(T0 + timedelta(minutes=90), tick=False):
        services.cluster_start(cluster=cluster, mode="gpu")
    cluster.refresh_from_db()
    assert cluster.state == "running" and cluster.stop_at is None  # a start clears it
    Cluster.objects.filter(pk=cluster.pk).update(stop_at=T0 + timedelta(hours=1))  # as if not
    assert _tick(T0 + timedelta(minutes=91))["scheduled"] == []
    cluster.refresh_from_db()
    assert cluster.state == "running" and cluster.stop_at is None


# -- the idle stop ---------------------------------------------------------------------


def test_a_cluster_stops_after_n_minutes_with_every_gpu_under_the_threshold(placed):
    cluster = placed(nodes=2, gpus=2, stop_idle_minutes=30, stop_idle_below=5)
    _samples(cluster, T0, 45, [1.0, 4.0])
    assert _tick(T0 + timedelta(minutes=29, seconds=30))["idle"] == []  # not 30 minutes yet
    assert _tick(T0 + timedelta(minutes=30, seconds=5))["idle"] == [cluster.pk]
    cluster.refresh_from_db()
    assert cluster.state == "stopped"
    assert cluster.state_reason == "stopped after 30 minutes under 5 % GPU utilisation"
    assert any(
        line.startswith("stopped after 30 minutes under 5 % GPU utilisation: 4 GPUs returned")
        for line in _timeline(cluster, "en")
    )


def test_the_rolled_up_minutes_count_as_the_monitor_leaves_them(placed):
    cluster = placed(nodes=1, gpus=2, stop_idle_minutes=10, stop_idle_below=20)
    _samples(cluster, T0, 12, [10.0, 15.0])
    with time_machine.travel(T0 + timedelta(minutes=12, seconds=1), tick=False):
        assert monitoring_tasks.rollup() >= 10  # the minutes before now are rollups only
    assert _tick(T0 + timedelta(minutes=12, seconds=2))["idle"] == [cluster.pk]


def test_one_busy_gpu_keeps_the_cluster_running(placed):
    cluster = placed(nodes=2, gpus=2, stop_idle_minutes=30, stop_idle_below=5)
    # node 1's second GPU works for one minute in the middle of the window
    _samples(
        cluster, T0, 45,
        lambda node, s: [0.0, 80.0] if node == 1 and 900 <= s < 960 else [0.0, 0.0],
    )  # fmt: skip
    assert _tick(T0 + timedelta(minutes=40, seconds=5))["idle"] == []
    cluster.refresh_from_db()
    assert cluster.state == "running"
    # 30 quiet minutes after that minute, it stops.
    assert _tick(T0 + timedelta(minutes=46, seconds=5))["idle"] == []  # samples end at 45
    _samples(cluster, T0 + timedelta(minutes=45), 10, [0.0, 0.0])
    assert _tick(T0 + timedelta(minutes=46, seconds=5))["idle"] == [cluster.pk]


def test_without_samples_nothing_is_stopped(placed):
    cluster = placed(nodes=2, gpus=2, stop_idle_minutes=10, stop_idle_below=50)
    assert _tick(T0 + timedelta(hours=3))["idle"] == []  # the monitor never ran
    _samples(cluster, T0, 20, [0.0, 0.0], node=0)  # node 1 never sampled
    assert _tick(T0 + timedelta(minutes=20, seconds=5))["idle"] == []
    _samples(cluster, T0, 20, [0.0, 0.0], node=1)
    Sample.objects.filter(
        cluster=cluster, node_index=1, at__gte=T0 + timedelta(minutes=14),
        at__lt=T0 + timedelta(minutes=15),
    ).delete()  # fmt: skip  # the monitor down for a minute of node 1
    assert _tick(T0 + timedelta(minutes=20, seconds=5))["idle"] == []
    _samples(cluster, T0, 20, [0.0], node=1)  # one GPU of two measured covers nothing
    assert _tick(T0 + timedelta(minutes=20, seconds=5))["idle"] == []
    cluster.refresh_from_db()
    assert cluster.state == "running"
    _samples(cluster, T0 + timedelta(minutes=20), 6, [0.0, 0.0])  # the monitor goes on
    assert _tick(T0 + timedelta(minutes=25, seconds=5))["idle"] == [cluster.pk]  # 15..25


def test_a_cluster_without_gpus_or_restarted_is_not_judged_by_old_samples(placed):
    cluster = placed(nodes=1, gpus=1, stop_idle_minutes=10, stop_idle_below=50)
    _samples(cluster, T0, 60, [0.0])
    with time_machine.travel(T0 + timedelta(minutes=20), tick=False):
        services.cluster_stop(cluster=cluster)
    with time_machine.travel(T0 + timedelta(minutes=25), tick=False):
        services.cluster_start(cluster=cluster, mode="gpu")
    # Samples of the whole hour exist, but it runs again since 25: judged from 35 on.
    assert _tick(T0 + timedelta(minutes=34, seconds=5))["idle"] == []
    assert _tick(T0 + timedelta(minutes=36, seconds=5))["idle"] == [cluster.pk]


def test_shutdown_set_replaces_the_rules(placed):
    cluster = placed()
    with time_machine.travel(T0, tick=False):
        schedule = ShutdownRequest(
            cluster=cluster, stop_at="2026-12-06T15:00:00Z", stop_idle_minutes=30,
            stop_idle_below=5,
        ).validate()  # fmt: skip
    shutdown.shutdown_set(cluster=cluster, schedule=schedule)
    cluster.refresh_from_db()
    assert (cluster.stop_at, cluster.stop_idle_minutes, cluster.stop_idle_below) == (
        T0 + timedelta(hours=1), 30, 5,
    )  # fmt: skip


# -- setting the rules: API, the cluster page, the new-cluster form ----------------------


def _api(user):
    _, token = ApiToken.issue(user=user, name="script")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def call(method, path, body=None):
        response = getattr(client, method.lower())(
            f"/api/v1/{path}", data=json.dumps(body or {}), content_type="application/json"
        )
        return response.status_code, response.json()

    return call


def _rules(cluster):
    cluster.refresh_from_db()
    return (cluster.stop_at, cluster.stop_idle_minutes, cluster.stop_idle_below)


PAST = "2026-12-06T13:00:00Z"
LATER = "2026-12-06T23:00:00+08:00"

# Each bad request, and the words on its fields: the API's and the page's alike.
BAD = [
    ({"stop_at": PAST}, {"stop_at": ["2026-12-06 13:00 UTC has passed: give a time to come."]}),
    ({"stop_at": "tonight"}, {"stop_at": ["Give a date and time, e.g. 2026-12-06 23:00."]}),
    ({"stop_at": "2028-01-01T00:00:00Z"}, {"stop_at": ["Give a time within a year."]}),
    (
        {"stop_idle_minutes": 5, "stop_idle_below": 5},
        {"stop_idle_minutes": ["Give whole minutes from 10 to 1440 (a day)."]},
    ),
    (
        {"stop_idle_minutes": 30, "stop_idle_below": 101},
        {"stop_idle_below": ["Give a GPU utilisation from 1 to 100 percent."]},
    ),
    (
        {"stop_idle_minutes": 30, "stop_idle_below": 0},
        {"stop_idle_below": ["Give a GPU utilisation from 1 to 100 percent."]},
    ),
    (
        {"stop_idle_minutes": 30},
        {"stop_idle_below": ["Give the GPU utilisation too: under how many percent?"]},
    ),
    (
        {"stop_at": PAST, "stop_idle_minutes": 1441, "stop_idle_below": 5},
        {
            "stop_at": ["2026-12-06 13:00 UTC has passed: give a time to come."],
            "stop_idle_minutes": ["Give whole minutes from 10 to 1440 (a day)."],
        },
    ),
]


@pytest.mark.parametrize(("body", "fields"), BAD)
def test_bad_rules_are_refused_on_their_fields_and_nothing_is_saved(placed, alice, body, fields):
    cluster = placed(stop_at=T0 + timedelta(hours=5))
    before = _rules(cluster)
    api = _api(alice)
    with time_machine.travel(T0, tick=False):
        status, answer = api("POST", f"clusters/{cluster.pk}/shutdown", body)
    assert status == 400 and answer["fields"] == fields, answer
    assert _rules(cluster) == before
    # The page's form: the same words on the same fields (the reader's zone: UTC here).
    client = Client()
    client.force_login(alice)
    form = {"stop_at": "", "stop_idle_minutes": "", "stop_idle_below": ""}
    form.update({k: str(v) for k, v in body.items()})
    with time_machine.travel(T0, tick=False):
        response = client.post(reverse("cluster_shutdown", args=[cluster.pk]), form)
    assert response.status_code == 400
    errors = response.context["shutdown_form"].errors
    assert {k: v for k, v in errors.items()} == fields
    assert _rules(cluster) == before


def test_the_owner_sets_and_clears_the_rules_and_another_account_gets_404(placed, alice, bob):
    cluster = placed()
    api = _api(alice)
    with time_machine.travel(T0, tick=False):
        status, answer = api(
            "POST", f"clusters/{cluster.pk}/shutdown",
            {"stop_at": LATER, "stop_idle_minutes": 30, "stop_idle_below": 5},
        )  # fmt: skip
    assert status == 200, answer
    assert answer["stop_at"] == "2026-12-06T15:00:00Z"
    assert (answer["stop_idle_minutes"], answer["stop_idle_below"]) == (30, 5)
    with time_machine.travel(T0, tick=False):
        status, answer = api("POST", f"clusters/{cluster.pk}/shutdown", {"stop_at": None})
    assert status == 200 and answer["stop_at"] is None and answer["stop_idle_minutes"] == 30
    # Another researcher: as if it did not exist, and nothing changes.
    mallory = _api(bob)
    with time_machine.travel(T0, tick=False):
        status, answer = mallory("POST", f"clusters/{cluster.pk}/shutdown", {"stop_at": LATER})
        assert status == 404
        assert mallory("DELETE", f"clusters/{cluster.pk}/shutdown")[0] == 404
        assert mallory("POST", f"clusters/{cluster.pk + 999}/shutdown", {})[0] == 404
    client = Client()
    client.force_login(bob)
    page = {"stop_at": "", "stop_idle_minutes": "10", "stop_idle_below": "99"}
    assert client.post(reverse("cluster_shutdown", args=[cluster.pk]), page).status_code == 404
    assert client.post(reverse("cluster_shutdown_clear", args=[cluster.pk])).status_code == 404
    assert _rules(cluster) == (None, 30, 5)
    status, answer = api("DELETE", f"clusters/{cluster.pk}/shutdown")
    assert status == 200 and _rules(cluster) == (None, None, None)


def test_the_page_takes_a_time_in_the_readers_zone_and_shows_it_back(placed, alice):
    preferences.save(alice, language="en", time_zone="Asia/Shanghai")
    cluster = placed()
    client = Client()
    client.force_login(alice)
    url = reverse("cluster_shutdown", args=[cluster.pk])
    with time_machine.travel(T0, tick=False):
        form = {"stop_at": "2026-12-06T23:00", "stop_idle_minutes": "30", "stop_idle_below": "5"}
        response = client.post(url, form)
        assert response.status_code == 302
        assert _rules(cluster) == (T0 + timedelta(hours=1), 30, 5)  # 23:00 CST is 15:00 UTC
        page = client.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
    assert "Stops at 2026-12-06 23:00 CST (once)." in page
    assert "Stops after 30 min with every GPU under 5 %." in page
    assert 'value="2026-12-06T23:00"' in page  # the form shows it back in the zone
    response = client.post(reverse("cluster_shutdown_clear", args=[cluster.pk]), follow=True)
    assert _rules(cluster) == (None, None, None)
    assert "It stops only when you stop it." in response.content.decode()


def test_rules_given_at_creation_by_the_api_and_the_form_alike(alice, make_paper_host, priced):
    """At the real time: the rate card is in force from now."""
    make_paper_host("gpu-paper-01", gpus=8)
    api = _api(alice)
    new = {
        "name": "nightly", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
        "image": "suanli/busybox:latest", "release_policy": "never",
    }  # fmt: skip
    past = (timezone.now() - timedelta(hours=1)).replace(second=0, microsecond=0)
    status, answer = api(
        "POST", "clusters", {**new, "stop_at": past.isoformat(), "stop_idle_minutes": 9}
    )  # fmt: skip
    assert status == 400
    assert answer["fields"] == {
        "stop_at": [f"{past:%Y-%m-%d %H:%M} UTC has passed: give a time to come."],
        "stop_idle_minutes": ["Give whole minutes from 10 to 1440 (a day)."],
    }
    assert not Cluster.objects.filter(name="nightly").exists()  # nothing half-made
    data = cluster_form(
        stop_at=f"{past:%Y-%m-%dT%H:%M}", stop_idle_minutes="9", stop_idle_below="", workspace="on"
    )
    form = ClusterForm(data, owner=alice)  # the reader's zone: UTC here
    assert not form.is_valid()
    assert form.errors["stop_at"] == answer["fields"]["stop_at"]
    assert form.errors["stop_idle_minutes"] == answer["fields"]["stop_idle_minutes"]
    cpu = ClusterRequest(
        owner=alice, name="cpu-1", resource="cpu:cpu-2c-4g", nodes=1,
        image=Image.objects.get(reference="suanli/busybox:latest"),
        stop_idle_minutes=30, stop_idle_below=5,
    ).check(Offer.of(alice), funds=partial(check_funds, alice))  # fmt: skip
    assert [str(m) for m in cpu.errors["stop_idle_minutes"]] == [
        "This cluster has no GPUs whose utilisation could be watched: schedule a stop at a "
        "time instead."
    ]
    later = past + timedelta(hours=3)
    status, answer = api(
        "POST", "clusters",
        {**new, "stop_at": later.isoformat(), "stop_idle_minutes": 60, "stop_idle_below": 10},
    )  # fmt: skip
    assert status == 201, answer
    assert _rules(Cluster.objects.get(pk=answer["id"])) == (later, 60, 10)


@pytest.mark.django_db(transaction=True)  # the CLI speaks HTTP to a live server
def test_the_command_line_sets_shows_and_clears_the_rules(placed, alice, bob, live_server):
    cluster = placed()
    _, token = ApiToken.issue(user=alice, name="laptop")
    env = {"SUANLI_URL": live_server.url, "SUANLI_TOKEN": token, "TZ": "UTC"}
    runner = CliRunner(env=env)

    def run(*args, code=0):
        result = runner.invoke(cli, ["clusters", "shutdown", str(cluster.pk), *args])
        assert result.exit_code == code, result.output
        return result.output

    said = run("--at", "23:59", "--idle-minutes", "30", "--idle-below", "5")
    assert said.startswith(f"Cluster {cluster.pk} (c1) stops at ")
    assert said.endswith(" 23:59 UTC (once); after 30 min with every GPU under 5 %.\n")
    assert _rules(cluster)[1:] == (30, 5) and cluster.stop_at.strftime("%H:%M") == "23:59"
    refused = run("--idle-minutes", "5", code=1)
    assert "--idle-minutes: Give whole minutes from 10 to 1440 (a day)." in refused
    assert run("--at", "tomorrow", code=2).count("is not a time") == 1
    assert run("--no-at").endswith("stops after 30 min with every GPU under 5 %.\n")
    _, theirs = ApiToken.issue(user=bob, name="bob")
    result = CliRunner(env={**env, "SUANLI_TOKEN": theirs}).invoke(
        cli, ["clusters", "shutdown", str(cluster.pk), "--clear"]
    )
    assert result.exit_code == 1 and "was not found" in result.output
    assert _rules(cluster)[1:] == (30, 5)
    assert run("--clear") == f"Cluster {cluster.pk} (c1) stops only when you stop it.\n"
    assert _rules(cluster) == (None, None, None)


@pytest.mark.browser
def test_the_cluster_page_shows_the_rules_in_both_languages_and_sizes(
    make_paper_host, make_cluster, alice, live_server, browser
):
    """Screenshots (SUANLI_SCREENSHOTS): the rules shown with their clear button, and the
    form open with a refusal, in Chinese and English, at 1366 and 390 px."""
    shots = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
    make_paper_host("gpu-paper-01", gpus=8)
    cluster = make_cluster(alice, "nightly", gpus=2, release_policy="never")
    scheduler.place_pending()
    beijing = timezone.now().astimezone(timezone.get_fixed_timezone(8 * 60))
    at = (beijing + timedelta(days=1)).replace(hour=23, minute=0, second=0, microsecond=0)
    Cluster.objects.filter(pk=cluster.pk).update(
        stop_at=at, stop_idle_minutes=30, stop_idle_below=5
    )
    words = {
        "zh-hans": (
            "将于 {at} CST 关机（一次）。",
            "每块 GPU 的利用率连续 30 分钟低于 5% 时关机。",
        ),
        "en": ("Stops at {at} CST (once).", "Stops after 30 min with every GPU under 5 %."),
    }
    for language, (at_words, idle_words) in words.items():
        preferences.save(alice, language=language, time_zone="Asia/Shanghai")
        for width in (1366, 390):
            context = browser.new_context(
                viewport={"width": width, "height": 900},
                locale="zh-CN" if language == "zh-hans" else "en-GB",  # the date input's
            )
            try:
                page = context.new_page()
                login(page, live_server, "alice", "alice-pass-123")
                page.goto(f"{live_server.url}{reverse('cluster_detail', args=[cluster.pk])}")
                rules = page.get_by_test_id("shutdown-rules")
                expect(rules.get_by_test_id("shutdown-at")).to_have_text(
                    at_words.format(at=f"{at:%Y-%m-%d %H:%M}")
                )
                expect(rules.get_by_test_id("shutdown-idle")).to_have_text(idle_words)
                expect(page.get_by_test_id("shutdown-clear")).to_be_visible()
                page.get_by_test_id("shutdown").scroll_into_view_if_needed()
                page.screenshot(path=f"{shots}/shutdown-{language}-{width}.png")
                page.locator("#cluster-shutdown summary").click()
                page.fill("#id_stop_idle_minutes", "5")
                page.get_by_test_id("shutdown-save").click()
                expect(page.locator("#field-stop_idle_minutes .errorlist")).to_be_visible()
                page.get_by_test_id("shutdown-form").scroll_into_view_if_needed()
                page.screenshot(path=f"{shots}/shutdown-refused-{language}-{width}.png")
                page.goto(f"{live_server.url}{reverse('cluster_new')}")
                fields = page.locator("#shutdown-fields")
                expect(fields.locator("#id_stop_at")).to_have_attribute("type", "datetime-local")
                fields.scroll_into_view_if_needed()
                page.screenshot(path=f"{shots}/shutdown-new-{language}-{width}.png")
            finally:
                context.close()
    cluster.refresh_from_db()
    assert (cluster.stop_idle_minutes, cluster.stop_idle_below) == (30, 5)  # refused: kept


@pytest.mark.engine
def test_a_scheduled_stop_on_the_real_engines_keeps_the_workspaces_files(running_cluster):
    """The stop is cluster_stop's: the workspace stops (not removed) and a file in its own
    filesystem is there when it starts again."""
    at = (timezone.now() + timedelta(hours=2)).replace(microsecond=0)
    cluster = running_cluster(1, gpus=1, stop_at=at)
    tasks.cluster_network_ensure(cluster.pk)
    node = Node.objects.select_related("host").get(cluster=cluster, released_at__isnull=True)
    engine = docker.DockerClient(base_url=node.host.engine_url, timeout=10)
    name = workspaces.container_name(cluster.pk, 0)
    container = engine.containers.get(name)
    user = container.attrs["Config"]["User"]
    assert container.exec_run(["/bin/sh", "-c", "echo kept > /tmp/notes"], user=user)[0] == 0
    with time_machine.travel(at + timedelta(seconds=30)):
        assert idle.clusters_shutdown()["scheduled"] == [cluster.pk]
    cluster.refresh_from_db()
    assert cluster.state == "stopped" and cluster.state_reason.startswith("stopped at ")
    assert tasks.cluster_workspaces_stop(cluster.pk)
    container.reload()
    assert container.status == "exited"
    services.cluster_start(cluster=cluster, mode="gpu")
    scheduler.place_pending()
    tasks.cluster_network_ensure(cluster.pk)
    again = engine.containers.get(name)
    assert again.status == "running"
    assert again.exec_run(["cat", "/tmp/notes"], user=user).output == b"kept\n"
    services.cluster_release(cluster=cluster)
    assert tasks.cluster_network_remove(cluster.pk)
    engine.close()


@pytest.mark.parametrize(
    "fields",
    [
        {"stop_idle_minutes": "5", "stop_idle_below": "5"},
        {"stop_idle_minutes": "30", "stop_idle_below": ""},
        {"stop_idle_minutes": "", "stop_idle_below": "101"},
        {"stop_idle_minutes": "x", "stop_idle_below": "5", "stop_at": "soon"},
    ],
)
def test_the_new_cluster_form_refuses_as_the_api_does(alice, make_paper_host, priced, fields):
    """The form parses its fields and the spec judges the rest; a request as given (the
    API's) is judged by the spec alone: the same words on the same fields."""
    make_paper_host("gpu-paper-01", gpus=8)
    form = ClusterForm(cluster_form(workspace="on", **fields), owner=alice)
    assert not form.is_valid()
    given = ClusterRequest(
        owner=alice, name="train-1", resource="gpu:a100-80gb", nodes="1", gpus_per_node="2",
        image=Image.objects.get(reference="suanli/busybox:latest"), volumes="",
        stop_at=fields.get("stop_at"), stop_idle_minutes=fields["stop_idle_minutes"],
        stop_idle_below=fields["stop_idle_below"],
    ).check(Offer.of(alice), funds=partial(check_funds, alice))  # fmt: skip
    mine = ("stop_at", "stop_idle_minutes", "stop_idle_below")
    said = {
        k: [w for m in v for w in (m.messages if hasattr(m, "messages") else [str(m)])]
        for k, v in given.errors.items()
        if k in mine
    }
    assert said and {k: v for k, v in form.errors.items() if k in mine} == said

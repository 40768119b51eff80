"""What a researcher sees of a job's projection, budget and energy (issue 44): the job page
in English and Chinese (the finish, the cost and its range, how it was worked out; "elapsed /
cost so far" and why, without a total; projected against actual after the run; the energy,
or "no power reading" on an emulated host), its live part, the API's `projection`,
`comparison` and `energy`, `suanli jobs show`, the sweep, pool and billing pages; another
researcher gets 404.

Rows are written here as the progress reader, the runner and the monitor would write them
(paper hosts, no container): the figures themselves are proven in the progress, cost and
energy tests; this file proves what the pages, the API and the command line say of them.
"""

import json
import os
import re
from datetime import timedelta

import pytest
import requests
from browsing import free_port, login
from conftest import TEST_IMAGE
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from test_cli import Cli
from test_sweep_pages import ran
from waiting import until

from billing import projections
from console import pools as console_pools
from console import preferences
from console.models import ApiToken
from jobs.base.text import Text, twin_fields
from jobs.base.validators import total_steps_problem
from jobs.clusters.services import ClusterSpec
from jobs.models import Cluster, Image, Job, JobProgress, Node, Replica, Trial
from jobs.pools import autoscaler, sweeps
from jobs.runs import progress
from monitoring.models import Sample

pytestmark = pytest.mark.django_db

PER_STEP = 0.5  # seconds a step in the rows below
SAMPLE_FIELDS = {
    "gpu_util": [90.0], "gpu_mem_mib": [1000.0], "cpu_pct": 50.0, "mem_bytes": 1000,
    "net_rx_bps": 0.0, "net_tx_bps": 0.0, "disk_read_bps": 0.0, "disk_write_bps": 0.0,
    "read_iops": 0.0, "write_iops": 0.0,
}  # fmt: skip


def _cluster(owner, host, catalog, name="proj"):
    started = timezone.now() - timedelta(hours=1)
    cluster = Cluster.objects.create(
        owner=owner, name=name, gpu_model=catalog["a100-80gb"], nodes=1, gpus_per_node=1,
        image_reference="suanli-test:busybox", state=Cluster.State.RUNNING,
        running_since=started,
    )  # fmt: skip
    Node.objects.create(
        cluster=cluster, index=0, host=host, placed_at=started, started_at=started, gpu_indices=[0]
    )
    return cluster


def _job(cluster, *, steps=1000, total=5000, ran_s=600, state=Job.State.RUNNING, **extra):
    """A job that ran `ran_s` seconds, reporting a step every 5 s (10 steps: 0.5 s a step)
    after a 10-second start, up to `steps`; `total` declared on its lines (None: none)."""
    now = timezone.now()
    started = now - timedelta(seconds=ran_s)
    ended = state in Job.ENDED
    t0 = started.timestamp() + 10
    points = [[t0 + i * 10 * PER_STEP, i * 10] for i in range(steps // 10 + 1)]
    job = Job.objects.create(
        cluster=cluster, owner=cluster.owner, name="train", command="python train.py",
        attempt=1, state=state, started_at=started, finished_at=now if ended else None,
        total_steps=total, **extra,
    )  # fmt: skip
    JobProgress.objects.create(job=job, points=points)
    node = cluster.node_set.get(index=0)
    Replica.objects.create(
        job=job, attempt=1, rank=0, node=node, host=node.host,
        container_name=f"suanli-test-proj-{job.pk}", started_at=started,
        finished_at=now if ended else None,
    )  # fmt: skip
    return job


def _samples(job, *, watts=None, seconds=60, source="nvml"):
    node = job.cluster.node_set.get(index=0)
    at = job.started_at
    Sample.objects.bulk_create(
        Sample(
            at=at + timedelta(seconds=s),
            cluster=job.cluster,
            job=job,
            host=node.host,
            node_index=0,
            gpu_source=source,
            gpu_power_w=[watts] if watts is not None else [],
            **SAMPLE_FIELDS,
        )  # fmt: skip
        for s in range(seconds)
    )


def _page(client, job) -> str:
    return client.get(reverse("job_detail", args=[job.pk])).content.decode()


def _text(html: str, testid: str) -> str:
    found = re.search(rf'data-testid="{testid}"[^>]*>(.*?)</(?:p|dd|section|td)>', html, re.S)
    assert found, testid
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", found[1])).strip()


@pytest.fixture
def running(alice, paper_host, catalog, priced):
    return _job(_cluster(alice, paper_host, catalog))


def test_a_running_jobs_page_gives_its_finish_and_cost_in_english_and_chinese(
    client, alice, running
):
    client.force_login(alice)
    page = _page(client, running)
    words = _text(page, "projection-words")
    assert words.startswith("At the pace of the last")
    assert "s/step" in words and "should finish at" in words and "cost about ¥" in words
    assert "step 1000 of 5000 (20.0 %)" in _text(page, "projection-progress")
    finish = projections.project(running).pace.finish_at
    assert f"should finish at {finish:%Y-%m-%d %H:%M} UTC" in words  # alice's zone: UTC
    assert re.search(r"cost about ¥\d+\.\d\d \(¥\d+\.\d\d to ¥\d+\.\d\d\)", words), words
    assert "(0.50 s/step ± 0 %)" in words
    assert "costs ¥7.8000 an hour" in _text(page, "projection-basis")

    preferences.save(alice, language="zh-hans")
    page = _page(client, running)
    assert "预测" in page  # the panel's title
    words = _text(page, "projection-words")
    assert "按最近" in words and "¥" in words, words
    assert "第 1000 步，共 5000 步" in _text(page, "projection-progress")


def test_a_job_without_a_total_gets_elapsed_and_cost_so_far_with_why(
    client, alice, paper_host, catalog, priced
):
    job = _job(_cluster(alice, paper_host, catalog), total=None)
    client.force_login(alice)
    page = _page(client, job)
    words = _text(page, "projection-words")
    assert words.startswith("Ran 10 min so far, ¥") and "spent; no finish projected" in words
    assert "no total steps declared" in words and "SUANLI_TOTAL_STEPS" in words
    assert 'data-testid="projection-finish"' not in page
    assert "step 1000; no total declared" in _text(page, "projection-progress")
    preferences.save(alice, language="zh-hans")
    words = _text(_page(client, job), "projection-words")
    assert "已运行" in words and "SUANLI_TOTAL_STEPS" in words, words


def test_a_queued_job_says_when_it_will_be_projected(client, alice, paper_host, catalog, priced):
    cluster = _cluster(alice, paper_host, catalog)
    job = Job.objects.create(
        cluster=cluster, owner=alice, name="later", command="python train.py",
        env={"SUANLI_TOTAL_STEPS": "5000"},
    )  # fmt: skip
    client.force_login(alice)
    page = _page(client, job)
    words = _text(page, "projection-words")
    assert words.startswith("Its finish time and cost are projected once it runs")
    assert "Ran" not in words and 'data-testid="projection-progress"' not in page


def test_a_bad_total_says_why_and_projects_nothing(client, alice, paper_host, catalog, priced):
    job = _job(_cluster(alice, paper_host, catalog), total=500)  # below step 1000
    client.force_login(alice)
    page = _page(client, job)
    assert "the declared total of 500 steps is below step 1000" in _text(page, "projection-words")
    assert 'data-testid="projection-finish"' not in page and "should finish" not in page


def test_a_valid_total_too_far_at_its_pace_gives_words_on_the_page_and_the_api(
    client, alice, paper_host, catalog, priced, token_of
):
    """The largest total a line may declare, at 200 s a step: the end lies thousands of
    years away, past any date; the page and the API say so in words (no 500, no date)."""
    job = _job(_cluster(alice, paper_host, catalog), total=progress.MAX_TOTAL_STEPS)
    end = timezone.now().timestamp() - 10
    slow = [[round(end - (20 - i) * 200.0, 3), i] for i in range(21)]
    JobProgress.objects.filter(pk=job.pk).update(points=slow)
    client.force_login(alice)
    response = client.get(reverse("job_detail", args=[job.pk]))
    assert response.status_code == 200
    words = _text(response.content.decode(), "projection-words")
    assert "would be reached in about" in words and "years: check its total of steps" in words
    assert "should finish" not in words
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token_of(alice)}")
    answer = api.get(f"/api/v1/jobs/{job.pk}")
    assert answer.status_code == 200
    p = answer.json()["projection"]
    assert p["finish_at"] is None and p["finish_high"] is None and p["cost"] is None
    assert "years: check its total of steps" in p["why"]


def test_a_bad_total_on_a_line_is_named_with_its_line_and_stops_the_projection(
    client, alice, paper_host, catalog, priced
):
    job = _job(_cluster(alice, paper_host, catalog))
    why = total_steps_problem(float("nan"), text=False)
    note = twin_fields(Job, "progress_note", Text(progress.TOTAL_NOTE, n=7, why=why))
    Job.objects.filter(pk=job.pk).update(**note)
    client.force_login(alice)
    page = _page(client, job)
    assert (
        _text(page, "progress-note")
        == "log line 7: total steps must be a whole number of steps, not nan"
    )
    assert "no finish projected: log line 7:" in _text(page, "projection-words")
    assert 'data-testid="projection-basis"' not in page


def test_the_status_poll_brings_the_panel_along(client, alice, running):
    client.force_login(alice)
    part = client.get(reverse("job_status", args=[running.pk]), HTTP_HX_REQUEST="true")
    html = part.content.decode()
    assert 'id="job-outlook" hx-swap-oob="true"' in html
    assert "step 1000 of 5000" in html
    # New steps read since: the next poll says so.
    kept = progress.points_of(running)
    points = [*kept, [kept[-1][0] + 500 * PER_STEP, 2000]]
    JobProgress.objects.filter(pk=running.pk).update(points=points)
    html = client.get(reverse("job_status", args=[running.pk])).content.decode()
    assert "step 2000 of 5000 (40.0 %)" in html


def test_a_budget_the_projection_passes_warns_on_the_page(
    client, alice, paper_host, catalog, priced
):
    job = _job(_cluster(alice, paper_host, catalog), budget="0.50")
    client.force_login(alice)
    page = _page(client, job)
    line = re.search(r'data-testid="budget-line" data-warning="1">([^<]*)<', page)
    # ¥1.30 spent at a fifth of its steps: the budget is passed already, at 20 %.
    assert line and "stops at its budget" in line[1] and "¥0.50" in line[1], page
    assert "20 % done" in line[1]
    roomy = _job(_cluster(alice, paper_host, catalog, name="roomy"), budget="5000")
    line = _text(_page(client, roomy), "budget-line")
    assert line.startswith("Budget ¥5000.00: ¥") and line.endswith("spent so far.")


def test_an_operator_reading_the_job_sees_its_pace_and_cost_but_not_its_budget(
    client, alice, paper_host, catalog, priced
):
    """As the budget card: what a researcher may spend is theirs, not an operator's who
    holds only the power to read other researchers' job pages."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Permission

    job = _job(_cluster(alice, paper_host, catalog), budget="0.50")
    olga = get_user_model().objects.create_user("olga", password="olga-pass-123", is_staff=True)
    olga.user_permissions.add(Permission.objects.get(codename="view_job_logs"))
    client.force_login(olga)
    page = _page(client, job)
    assert "should finish at" in _text(page, "projection-words")
    assert 'data-testid="budget-line"' not in page and "¥0.50" not in page
    poll = client.get(reverse("job_status", args=[job.pk])).content.decode()
    assert "should finish at" in poll and 'data-testid="budget-line"' not in poll
    client.force_login(alice)  # the owner: the line, and its warning
    assert 'data-testid="budget-line" data-warning="1"' in _page(client, job)


def test_a_finished_job_shows_projected_against_actual(
    client, alice, paper_host, catalog, priced, token_of
):
    # What the projection task kept at a fifth of its steps: its finish 60 s late.
    job = _finished_with_early(_cluster(alice, paper_host, catalog), late_s=60)
    client.force_login(alice)
    page = _page(client, job)
    assert 'data-testid="projection-compared"' in page
    assert _text(page, "finish-off") == "+2.4 %"  # 60 s late over a 2520 s run
    cost_off = _text(page, "cost-off")
    assert re.fullmatch(r"[+-]\d+(\.\d)? %", cost_off), cost_off
    assert "with 20 % of its steps done" in _text(page, "projection-compared-words")
    # Its times carry their zone, as the sentence beside them does.
    assert re.search(r"Projected at \d{4}-\d\d-\d\d \d\d:\d\d [A-Z]{3}", page), "zone"
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token_of(alice)}")
    body = api.get(f"/api/v1/jobs/{job.pk}").json()
    compared = body["comparison"]
    assert round(compared["finish_error"], 4) == round(60 / 2520, 4)
    assert compared["projected_cost"] == "9.9000" and compared["finish"].endswith("Z")
    assert compared["words"].startswith("Projected at 20 % of its steps")
    assert body["projection"]["ended"] and body["projection"]["cost"] is None
    preferences.save(alice, language="zh-hans")
    page = _page(client, job)
    assert "预测值" in page and "实际值" in page


def test_an_ended_job_without_a_projection_says_why_none_is_compared(
    client, alice, paper_host, catalog, priced
):
    job = _job(_cluster(alice, paper_host, catalog), total=None, state=Job.State.SUCCEEDED)
    client.force_login(alice)
    page = _page(client, job)
    assert _text(page, "projection-words").startswith("Ran 10 min, cost about ¥")
    assert "No projection to compare with" in _text(page, "no-comparison")


def test_the_energy_panel_gives_kwh_or_says_there_is_no_power_reading(
    client, alice, paper_host, catalog, priced, settings
):
    settings.SUANLI_GRID_CO2_G_PER_KWH = 581.0
    measured = _job(_cluster(alice, paper_host, catalog))
    _samples(measured, watts=300.0, seconds=60)  # 18 kJ
    emulated = _job(_cluster(alice, paper_host, catalog, name="emulated"))
    _samples(emulated, source="derived")
    client.force_login(alice)
    words = _text(_page(client, measured), "energy-words")
    assert words.startswith("0.005 kWh (18 kJ) of GPU energy over 1 min of power readings")
    assert "CO2 at 581 g/kWh" in words
    words = _text(_page(client, emulated), "energy-words")
    assert words == "No power reading on this host (emulated GPUs)"
    assert "0 kWh" not in _page(client, emulated)
    preferences.save(alice, language="zh-hans")
    words = _text(_page(client, emulated), "energy-words")
    assert "No power" not in words and re.search("[\u4e00-\u9fff]", words), words


@pytest.fixture
def token_of(db):
    def make(user):
        return ApiToken.issue(user=user, name="script")[1]

    return make


def test_the_api_gives_projection_comparison_and_energy(running, alice, token_of):
    _samples(running, source="derived")
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token_of(alice)}")
    body = api.get(f"/api/v1/jobs/{running.pk}").json()
    p = body["projection"]
    assert p["step"] == 1000 and p["total"] == 5000 and p["fraction"] == 0.2
    assert p["why"] is None and p["finish_at"].endswith("Z") and p["currency"] == "CNY"
    assert p["finish_low"] <= p["finish_at"] <= p["finish_high"]
    assert p["cost_low"] <= p["cost"] <= p["cost_high"] and "." in p["cost"]
    assert p["words"].startswith("At the pace of the last")
    assert body["comparison"] is None
    assert body["energy"]["joules"] is None and body["energy"]["source"] == "derived"
    assert body["energy"]["words"] == "No power reading on this host (emulated GPUs)"
    # The list stays light: no projection per row.
    assert "projection" not in api.get("/api/v1/jobs").json()["jobs"][0]


def test_the_api_says_why_with_null_figures_when_it_cannot_project(
    alice, paper_host, catalog, priced, token_of
):
    job = _job(_cluster(alice, paper_host, catalog), total=None)
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token_of(alice)}", HTTP_ACCEPT_LANGUAGE="zh-CN")
    p = api.get(f"/api/v1/jobs/{job.pk}").json()["projection"]
    assert p["finish_at"] is None and p["cost"] is None and p["total"] is None
    assert p["why"].startswith("no total steps declared")  # English, whatever is asked
    assert p["cost_so_far"] is not None and p["elapsed_s"] >= 600


def test_another_researcher_gets_404_for_the_page_the_poll_and_the_api(
    client, bob, running, token_of
):
    client.force_login(bob)
    assert client.get(reverse("job_detail", args=[running.pk])).status_code == 404
    assert client.get(reverse("job_status", args=[running.pk])).status_code == 404
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token_of(bob)}")
    response = api.get(f"/api/v1/jobs/{running.pk}")
    assert response.status_code == 404 and "projection" not in response.content.decode()


def _finished_with_early(cluster, *, late_s=60):
    """A job that ran 5000 steps in 2520 s, its projection at a fifth of them `late_s` late."""
    job = _job(cluster, steps=5000, ran_s=2520)
    finished = job.started_at + timedelta(seconds=2520)
    early = {
        "at": (job.started_at + timedelta(seconds=510)).isoformat(), "fraction": 0.2,
        "currency": "CNY", "finish_at": (finished + timedelta(seconds=late_s)).isoformat(),
        "cost": "9.9000",
    }  # fmt: skip
    Job.objects.filter(pk=job.pk).update(
        state=Job.State.SUCCEEDED, finished_at=finished, projection_early=early
    )
    Replica.objects.filter(job=job).update(finished_at=finished)
    job.refresh_from_db()
    return job


def test_the_billing_page_says_how_good_the_projections_were(
    client, alice, paper_host, catalog, priced
):
    client.force_login(alice)
    words = _text(client.get(reverse("billing")).content.decode(), "accuracy-words")
    assert words.startswith("No finished job of yours has a projection to compare yet")
    _finished_with_early(_cluster(alice, paper_host, catalog), late_s=60)
    _finished_with_early(_cluster(alice, paper_host, catalog, name="two"), late_s=-120)
    page = client.get(reverse("billing")).content.decode()
    assert _text(page, "accuracy-words").startswith("Over your 2 last compared jobs")
    assert _text(page, "accuracy-jobs") == "2"
    assert _text(page, "accuracy-finish") == "3.6 %"  # the median of 2.4 % and 4.8 %
    preferences.save(alice, language="zh-hans")
    page = client.get(reverse("billing")).content.decode()
    assert "预测有多准" in page


@pytest.fixture
def sweep_pool(catalog, priced, alice, storage_root, paper_host):
    shape = ClusterSpec(
        name="", nodes=1, gpu_model=catalog["a100-80gb"], gpus_per_node=1,
        image=Image.objects.get(reference=TEST_IMAGE),
    )  # fmt: skip
    pool = autoscaler.pool_create(owner=alice, spec=autoscaler.PoolSpec(name="p", cluster=shape))
    return console_pools.refresh(pool)


def test_the_pool_page_projects_its_running_jobs_remaining_cost(
    client, alice, paper_host, catalog, sweep_pool
):
    client.force_login(alice)
    page = client.get(reverse("pool_detail", args=[sweep_pool.pk])).content.decode()
    assert _text(page, "pool-projection") == "No job is running in it"
    _job(_cluster(alice, paper_host, catalog), pool=sweep_pool)
    _job(_cluster(alice, paper_host, catalog, name="blind"), total=None, pool=sweep_pool)
    page = client.get(reverse("pool_status", args=[sweep_pool.pk])).content.decode()
    words = _text(page, "pool-projection")
    assert re.match(r"Its running jobs should cost about ¥\d+\.\d\d more \(¥", words), words
    assert words.endswith("running jobs without a projection: 1")


def _filled_sweep(owner, pool):
    """Six trials, four started: two complete at step 40 (400 s), two pruned at steps 10
    and 20 (100 s and 200 s); two not started yet."""
    spec = sweeps.SweepSpec(
        name="lr", command="python train.py", space=sweeps.parse_space("lr: uniform 0 1"),
        metric="val_loss", trials=6, parallel=4, min_steps=5,
    )  # fmt: skip
    sweep = sweeps.sweep_create(owner=owner, pool=pool, spec=spec)
    now = timezone.now()
    for trial, state, curve, seconds in zip(
        sweep.trial_set.order_by("number"),
        ("complete", "complete", "pruned", "pruned"),
        ([[10, 0.9], [40, 0.4]], [[10, 0.8], [40, 0.3]], [[10, 1.2]], [[10, 1.0], [20, 0.9]]),
        (400, 400, 100, 200),
        strict=True,
    ):
        Trial.objects.filter(pk=trial.pk).update(
            state=state, curve=curve, last_step=curve[-1][0], last_value=curve[-1][1]
        )
        Job.objects.filter(pk=trial.job_id).update(
            state=Job.State.SUCCEEDED if state == "complete" else Job.State.CANCELLED,
            started_at=now - timedelta(seconds=seconds), finished_at=now,
        )  # fmt: skip
        ran(trial.job_id, now - timedelta(seconds=seconds), now)  # what billing prices
    return sweep


def test_the_sweep_page_projects_the_trials_left_with_prunings_savings(client, alice, sweep_pool):
    sweep = _filled_sweep(alice, sweep_pool)
    client.force_login(alice)
    page = client.get(reverse("sweep_detail", args=[sweep.pk])).content.decode()
    words = _text(page, "sweep-projection")
    # Half the ended trials were pruned, after 3/8 of the steps on average: 31 % saved.
    assert re.match(r"2 trials left should cost about ¥\d+\.\d\d more", words), words
    assert words.endswith("pruning is expected to save 31 % of that, from the trials so far")


@pytest.fixture
def web_url(processes, running):
    """The web process (as the Procfile runs it) on the test database."""
    port = free_port()
    processes.start("web", env={"PORT": str(port)})
    url = f"http://127.0.0.1:{port}"

    def answers():
        try:
            return requests.get(f"{url}/api/v1/schema", timeout=10).status_code == 200
        except requests.RequestException:
            return False

    until(answers, timeout=20, what="the web process listens")
    return url


def test_suanli_jobs_show_prints_the_projection_budget_and_energy(
    web_url, running, alice, tmp_path
):
    Job.objects.filter(pk=running.pk).update(budget="5000")
    _samples(running, source="derived")
    cli = Cli(tmp_path / "alice")
    cli("login", "--url", web_url + "/", "--token", ApiToken.issue(user=alice, name="cli")[1])
    out = cli("jobs", "show", running.pk).stdout
    lines = {
        line.split(":", 1)[0]: line.split(":", 1)[1].strip()
        for line in out.splitlines()
        if ":" in line
    }
    assert lines["projection"].startswith("At the pace of the last")
    assert lines["progress"] == "step 1000 of 5000 (20.0 %)"
    assert lines["budget"].startswith("Budget ¥5000.00: ¥")
    assert lines["energy"] == "No power reading on this host (emulated GPUs)"
    data = json.loads(cli("jobs", "show", running.pk, "--json").stdout)
    assert data["projection"]["total"] == 5000 and data["energy"]["joules"] is None


SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
PHONE = {"width": 390, "height": 844}
LAPTOP = {"width": 1366, "height": 900}


def _shoot(browser, live_server, path: str, name: str, *, ready: str = "#job-outlook"):
    for size, viewport in (("1366", LAPTOP), ("390", PHONE)):
        context = browser.new_context(viewport=viewport)
        page = context.new_page()
        login(page, live_server, "alice", "alice-pass-123")
        page.goto(f"{live_server.url}{path}")
        page.wait_for_selector(ready)
        wide = page.evaluate("document.documentElement.scrollWidth")
        assert wide <= viewport["width"], (name, size, wide)  # no sideways scrolling
        for cell in page.locator('[data-testid="cost-off"]').all():  # not cut off either
            box = cell.bounding_box()
            assert box["x"] + box["width"] <= viewport["width"], (name, size, box)
        page.screenshot(path=f"{SHOTS}/{name}-{size}.png", full_page=True)
        page.locator(ready).screenshot(path=f"{SHOTS}/{name}-{size}-part.png")
        context.close()


@pytest.mark.browser
def test_the_panel_follows_the_job_live_and_reads_on_a_laptop_and_a_phone(
    browser, live_server, alice, paper_host, catalog, priced, settings, sweep_pool
):
    settings.SUANLI_GRID_CO2_G_PER_KWH = 581.0
    job = _job(_cluster(alice, paper_host, catalog), budget="2.00")
    _samples(job, watts=300.0, seconds=120)
    context = browser.new_context(viewport=LAPTOP)
    page = context.new_page()
    login(page, live_server, "alice", "alice-pass-123")
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    progress = page.locator('[data-testid="projection-progress"]')
    assert "step 1000 of 5000" in progress.inner_text()
    # The reader (jobs.runs.progress) keeps new points: the panel follows without a reload.
    kept = JobProgress.objects.get(pk=job.pk).points
    points = [*kept, [kept[-1][0] + 500 * PER_STEP, 2000]]
    JobProgress.objects.filter(pk=job.pk).update(points=points)
    page.wait_for_function(
        "document.querySelector('[data-testid=projection-progress]').innerText.includes('2000')"
    )
    assert "step 2000 of 5000 (40.0 %)" in progress.inner_text()
    context.close()

    finished = _finished_with_early(_cluster(alice, paper_host, catalog, name="done"))
    no_total = _job(_cluster(alice, paper_host, catalog, name="no-total"), total=None)
    _samples(no_total, source="derived")
    _job(_cluster(alice, paper_host, catalog, name="in-pool"), pool=sweep_pool)
    sweep = _filled_sweep(alice, sweep_pool)
    for language in ("en", "zh-hans"):
        preferences.save(alice, language=language)
        _shoot(browser, live_server, f"/jobs/{job.pk}/", f"job-projection-{language}")
        _shoot(browser, live_server, f"/jobs/{finished.pk}/", f"job-compared-{language}")
        _shoot(browser, live_server, f"/jobs/{no_total.pk}/", f"job-no-total-{language}")
        _shoot(browser, live_server, "/billing/", f"billing-accuracy-{language}",
               ready="#projection-accuracy")  # fmt: skip
        _shoot(browser, live_server, f"/pools/{sweep_pool.pk}/", f"pool-projection-{language}",
               ready="#pool-projection")  # fmt: skip
        _shoot(browser, live_server, f"/sweeps/{sweep.pk}/", f"sweep-projection-{language}",
               ready="#sweep-projection")  # fmt: skip


def test_a_team_member_sees_how_good_the_projections_of_their_own_jobs_were(
    alice, bob, paper_host, catalog, priced, fund
):
    """In a team, each researcher's own: the jobs on the clusters they made (as their
    spending is counted), on the billing page a member sees."""
    from console.acting import SESSION_KEY
    from jobs.teams import services as teams
    from jobs.tenancy.actors import Actor, Role

    team = teams.team_create(person=alice, name="lab")
    invite, _token = teams.invite_create(
        actor=Actor.for_team(alice, team.pk), role=Role.MEMBER, login="bob"
    )
    teams.invite_accept(person=bob, invite=invite)
    mine = _cluster(team.principal, paper_host, catalog, name="bobs")
    Cluster.objects.filter(pk=mine.pk).update(created_by=bob)
    _finished_with_early(mine, late_s=60)
    theirs = _cluster(team.principal, paper_host, catalog, name="alices")
    Cluster.objects.filter(pk=theirs.pk).update(created_by=alice)
    _finished_with_early(theirs, late_s=-120)
    _finished_with_early(Cluster.objects.get(pk=theirs.pk), late_s=-300)
    member = Client()
    member.force_login(bob)
    session = member.session
    session[SESSION_KEY] = team.pk
    session.save()
    page = member.get(reverse("billing"), HTTP_ACCEPT_LANGUAGE="en").content.decode()
    assert _text(page, "accuracy-jobs") == "1"  # his one job, not the lab's three
    assert _text(page, "accuracy-finish") == "2.4 %"  # 60 s late over a 2520 s run

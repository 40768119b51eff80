"""Budget stops, "stop at ¥X" (billing/budgets.py), on real PostgreSQL and the real accrual:
a cluster with a budget is stopped within one accrual period of reaching it, its files kept,
billed to the second it stopped (the ledger exact, nothing charged past the stop); a job is
stopped as a preemption notice stops it (its preemption script, SIGTERM, SIGKILL after the
grace) and ends cancelled with its reason in words, its owner told once; a sweep is
cancelled at its budget and starts no trial that would pass it; bad budgets are refused in
words on the form, the API and the CLI; another researcher can neither read nor change a
budget (404).

The money tests place clusters on the real scheduler on paper hosts (no engine) and drive
the accrual with explicit seconds (time_machine), as tests/test_team_money.py does; one
test runs a real job on the engines and sees its preemption script run before it stops."""

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import time_machine
from django.db.models import Sum
from django.utils import translation
from node_start import ran

from billing import accrual, budgets
from billing.models import Account, LedgerEntry, Meter
from jobs.base.text import show
from jobs.clusters import services as cluster_services
from jobs.clusters.services import JobSpec
from jobs.models import Cluster, Job, JobEvent, Node, Replica, WebhookEndpoint, WebhookEvent
from jobs.placement import scheduler

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 12, 10, 8, 0, 0, tzinfo=UTC)
RATE = "36.00"  # per GPU-hour: 0.01 per GPU-second


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def tick(seconds):
    with time_machine.travel(at(seconds), tick=False):
        return accrual.accrue()


@pytest.fixture
def money(alice, rate_card, fund, settings):
    settings.SUANLI_ACCRUAL_INTERVAL = 10
    settings.SUANLI_STOP_GRACE_S = 10
    settings.SUANLI_PREEMPT_SCRIPT_S = 60
    rate_card({"a100-80gb": RATE}, effective_from=at(-3600))
    fund(alice, "100")
    WebhookEndpoint.objects.create(
        owner=alice, url="https://hooks.example.com/x",
        events=["job.budget_stopped", "job.budget_warning", "cluster.budget_stopped",
                "sweep.budget_stopped", "cluster.stopped"],
        secret="whsec_" + "a" * 32,
    )  # fmt: skip


@pytest.fixture
def placed(make_paper_host, make_cluster, alice):
    """Alice's cluster placed on a paper host and running from second `when`."""

    def make(name="c1", *, when=0, gpus=1, **extra):
        with time_machine.travel(at(when), tick=False):
            if not make_paper_host.__dict__.get("made"):
                make_paper_host(gpus=8)
                make_paper_host.__dict__["made"] = True
            cluster = make_cluster(alice, name, gpus=gpus, **extra)
            scheduler.place_pending()
        ran(cluster)
        cluster.refresh_from_db()
        assert cluster.state == "running", cluster.state_reason
        return cluster

    return make


def _said(event: WebhookEvent) -> dict[str, str]:
    out = {}
    for language in ("en", "zh-hans"):
        with translation.override(language):
            out[language] = show(event.summary)
    return out


def _charged(cluster) -> Decimal:
    return LedgerEntry.objects.filter(cluster=cluster).aggregate(s=Sum("amount"))["s"] or 0


# -- a cluster ------------------------------------------------------------------------------


def test_a_cluster_stops_at_its_budget_files_kept_billed_to_the_second_told_once(
    money, alice, placed
):
    cluster = placed("lab-a", budget=Decimal("1.00"))
    other = placed("lab-b")  # no budget: runs on
    tick(50)
    assert _charged(cluster) == Decimal("-0.50")
    tick(80)  # 0.80 charged, 0.90 by the next tick: under 1.00
    cluster.refresh_from_db()
    assert cluster.state == "running"
    tick(90)  # 0.90 charged, and one accrual period more reaches 1.00: stopped now
    cluster.refresh_from_db()
    assert cluster.state == "stopped" and cluster.stopped_at == at(90)
    assert cluster.budget_stopped_at == at(90)
    with translation.override("en"):
        assert show(cluster.state_reason_text) == "stopped at its budget ¥1.00: ¥0.90 spent"
    kept = Node.objects.get(cluster=cluster)
    assert kept.stopped_at == at(90) and kept.kept_until is None, "its files are kept"
    # The ledger at the edge: every second up to the stop, once; nothing after.
    assert _charged(cluster) == Decimal("-0.90")
    assert LedgerEntry.objects.filter(cluster=cluster).latest("period_to").period_to == at(90)
    for t in (100, 200, 400):
        tick(t)
    assert _charged(cluster) == Decimal("-0.90"), "nothing charged past the stop"
    assert Meter.objects.get(cluster=cluster).charged == Decimal("0.90")
    account = Account.objects.get(user=alice)
    total = LedgerEntry.objects.filter(account=account).aggregate(s=Sum("amount"))["s"]
    assert total == account.balance, "the ledger adds up to the balance"
    assert account.balance == Decimal("100") - Decimal("0.90") - Decimal("4.00")
    other.refresh_from_db()
    assert other.state == "running"
    # Told once, in words, in the reader's language.
    (told,) = WebhookEvent.objects.filter(type="cluster.budget_stopped")
    data = json.loads(told.body)["data"]
    assert data["budget"] == {"budget": "1.00", "spent": "0.90", "currency": "CNY"}
    said = _said(told)
    assert "lab-a stopped at its budget ¥1.00: ¥0.90 spent; its files are kept" in said["en"]
    assert "¥1.00" in said["zh-hans"] and "lab-a" in said["zh-hans"]
    # Starting it again is refused in words until its budget is raised or cleared; a new
    # budget starts the watch again.
    from console.forms import start_refusal

    with translation.override("en"):
        assert start_refusal(cluster, "gpu") == (
            "lab-a was stopped at its budget of ¥1.00 (¥0.90 charged): raise or clear its "
            "budget first, on its page or with suanli clusters budget."
        )
    budgets.set_budget(cluster, Decimal("2.00"))
    cluster.refresh_from_db()
    assert cluster.budget_stopped_at is None and cluster.budget == Decimal("2.00")
    assert start_refusal(cluster, "gpu") == ""


def test_a_cluster_without_workspaces_is_released_at_its_budget(money, alice, placed):
    cluster = placed("batch", budget=Decimal("0.30"), workspace=False)
    tick(20)
    cluster.refresh_from_db()
    assert cluster.state == "released"
    assert _charged(cluster) == Decimal("-0.20")
    tick(300)
    assert _charged(cluster) == Decimal("-0.20")


# -- a job (service level, a paper host) -----------------------------------------------------


def _running(job: Job, started: datetime) -> None:
    """What dispatch leaves: attempt 1 running on the cluster's node from `started`."""
    node = job.cluster.node_set.get()
    Job.objects.filter(pk=job.pk).update(
        state=Job.State.RUNNING, attempt=1, started_at=started, running_since=started
    )
    Replica.objects.create(
        job=job, attempt=1, rank=0, node=node, host=node.host,
        container_name=f"budget-test-{job.pk}-1-0", state=Replica.State.RUNNING,
        started_at=started,
    )  # fmt: skip


# What its stop may still cost is said: the room kept below the budget (a budget smaller
# than that stops a job at its start).
STOPPED_AT_80 = (
    "stopped at its budget ¥1.00: ¥0.80 spent, and up to ¥0.20 more while it stops (20 s)"
)


def test_a_job_stops_at_its_budget_with_its_grace_and_is_told_once(money, alice, placed):
    cluster = placed("lab-a")
    with time_machine.travel(at(0), tick=False):
        job = cluster_services.job_submit(
            cluster=cluster, spec=JobSpec(name="train", command="python train.py",
                                          budget=Decimal("1.00")),
        )  # fmt: skip
    _running(job, at(0))
    tick(70)  # 0.70 spent; with the stop's grace (10 s) and a period (10 s): 0.90
    job.refresh_from_db()
    assert not job.cancel_requested and job.budget_stopped_at is None
    tick(80)  # 0.80 + 0.20 reaches 1.00: stopped now, so it never passes it
    job.refresh_from_db()
    assert job.cancel_requested and job.budget_stopped_at == at(80)
    with translation.override("en"):
        assert show(job.state_reason_text) == STOPPED_AT_80
    line = JobEvent.objects.filter(job=job, kind="budget").get()
    with translation.override("en"):
        assert show(line.text) == f"{STOPPED_AT_80}: SIGTERM, then SIGKILL after 10 s"
    tick(90)
    (told,) = WebhookEvent.objects.filter(type="job.budget_stopped")
    assert json.loads(told.body)["data"]["budget"]["spent"] == "0.80"
    assert "train on cluster lab-a stopped at its budget ¥1.00" in _said(told)["en"]
    # Its end: cancelled with the same words.
    from jobs.runs.settle import settle

    Replica.objects.filter(job=job).update(
        state=Replica.State.EXITED, exit_code=143, finished_at=at(85)
    )
    with time_machine.travel(at(95), tick=False):
        settle(job.pk)
    job.refresh_from_db()
    assert job.state == "cancelled"
    with translation.override("en"):
        assert show(job.state_reason_text) == STOPPED_AT_80


def test_a_job_with_a_preemption_script_keeps_room_for_it_and_runs_it_first(money, alice, placed):
    cluster = placed("lab-a")
    with time_machine.travel(at(0), tick=False):
        job = cluster_services.job_submit(
            cluster=cluster, spec=JobSpec(name="train", command="python train.py",
                                          preemption_script="touch /tmp/save",
                                          budget=Decimal("1.00")),
        )  # fmt: skip
    _running(job, at(0))
    tick(10)  # 0.10 + (60 s script + 10 s grace + 10 s period) 0.80 = 0.90
    job.refresh_from_db()
    assert not job.cancel_requested
    tick(20)
    job.refresh_from_db()
    assert job.cancel_requested and job.preempt_requested_at == at(20)
    line = JobEvent.objects.filter(job=job, kind="budget").get()
    with translation.override("en"):
        assert "running its preemption script (limit 60 s)" in show(line.text)


def test_a_projection_that_passes_the_budget_warns_once(money, alice, placed):
    cluster = placed("lab-a")
    with time_machine.travel(at(0), tick=False):
        job = cluster_services.job_submit(
            cluster=cluster,
            spec=JobSpec(name="train", command="python train.py", budget=Decimal("50")),
        )
    _running(job, at(0))
    job.refresh_from_db()
    projection = {"cost_so_far": "0.3000", "cost": "80.0000", "budget_fraction": 0.62}
    with time_machine.travel(at(30), tick=False):
        assert budgets.check_job(job, projection) == "warned"
        job.refresh_from_db()
        assert budgets.check_job(job, projection) == "ok", "told once"
    (told,) = WebhookEvent.objects.filter(type="job.budget_warning")
    amounts = json.loads(told.body)["data"]["budget"]
    assert (amounts["budget"], amounts["projected_cost"]) == ("50.00", "80.00"), "as the API"
    said = _said(told)
    assert "stops at its budget ¥50.00, about 62 % done" in said["en"]
    assert "62 %" in said["zh-hans"]
    line = JobEvent.objects.get(job=job, kind="budget")
    assert "62 %" in line.message
    budgets.set_budget(job, Decimal("60"))
    job.refresh_from_db()
    assert job.budget_warned_at is None, "a new budget may warn again"
    stale = {**projection, "budget": "50.0000"}  # stored before the budget changed
    with time_machine.travel(at(40), tick=False):
        assert budgets.check_job(job, stale) == "ok", "not judged against the old budget"
        assert budgets.check_job(job, {**stale, "budget": "60.0000"}) == "warned"


# -- the input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("0", "more than 0"),
        ("-5", "more than 0"),
        ("abc", "is not a number"),
        ("NaN", "finite"),
        ("inf", "finite"),
        ("1.234", "at most 2 decimals"),
        ("1e9", "at most 1,000,000"),
        (True, "an amount"),
        ("49,90", "is not a number"),  # a decimal comma is not read as 4990
        ("1e999999999", "at most 1,000,000"),
        ("1e-999999999", "at most 2 decimals"),
    ],
)
def test_a_bad_budget_is_refused_in_words(value, words):
    from django.core.exceptions import ValidationError

    with translation.override("en"), pytest.raises(ValidationError) as err:
        budgets.parse(value)
    assert words in " ".join(err.value.messages)


def test_a_good_budget_is_read_to_the_cent():
    assert budgets.parse("50") == Decimal("50.00")
    assert budgets.parse(49.9) == Decimal("49.90")
    assert budgets.parse("¥1,000.5") == Decimal("1000.50")
    assert budgets.parse("2.500") == Decimal("2.50")
    assert budgets.parse("") is None and budgets.parse(None) is None
    assert budgets.parse("none") is None


# -- a sweep ---------------------------------------------------------------------------------


@pytest.fixture
def pool(money, alice, catalog, make_paper_host, storage_root):
    """Alice's pool of one-GPU clusters on a paper host, one cluster running from second 0."""
    from conftest import TEST_IMAGE

    from console import pools as console_pools
    from jobs.clusters.services import ClusterSpec
    from jobs.models import Image
    from jobs.pools import autoscaler

    with time_machine.travel(at(0), tick=False):
        if not make_paper_host.__dict__.get("made"):
            make_paper_host(gpus=8)
            make_paper_host.__dict__["made"] = True
        shape = ClusterSpec(
            name="", nodes=1, gpu_model=catalog["a100-80gb"], gpus_per_node=1,
            image=Image.objects.get(reference=TEST_IMAGE),
        )  # fmt: skip
        made = autoscaler.pool_create(
            owner=alice, spec=autoscaler.PoolSpec(name="hp", cluster=shape, max_clusters=2)
        )
        return console_pools.refresh(made)


def _sweep(alice, pool, budget, trials=3):
    from jobs.models import Sweep
    from jobs.pools import sweeps

    with time_machine.travel(at(0), tick=False):
        return sweeps.sweep_create(
            owner=alice, pool=pool,
            spec=sweeps.SweepSpec(
                name="quad", command="sleep 600", space=sweeps.parse_space("x: uniform 0 6"),
                metric="loss", trials=trials, parallel=1, pruner=Sweep.Pruner.NONE,
                budget=Decimal(budget),
            ),
        )  # fmt: skip


def _trial_runs(trial, started):
    """Its job placed and running on its (pool's) cluster from `started`."""
    job = trial.job
    with time_machine.travel(at(0), tick=False):
        scheduler.place_pending()
    ran(job.cluster)
    _running(job, started)


def test_a_sweep_is_cancelled_at_its_budget_its_trial_stopped_told_once(money, alice, pool):
    from jobs.models import Trial

    sweep = _sweep(alice, pool, "1.00")
    trial = Trial.objects.get(sweep=sweep)
    _trial_runs(trial, at(0))
    tick(70)  # 0.70 spent, its trial's stop (20 s) 0.20 more: under 1.00
    sweep.refresh_from_db()
    assert sweep.state == "running"
    tick(80)
    sweep.refresh_from_db()
    assert sweep.state == "cancelled" and sweep.budget_stopped_at == at(80)
    with translation.override("en"):
        assert show(sweep.note_text) == "stopped at its budget ¥1.00: ¥0.80 spent"
    job = Job.objects.get(pk=trial.job_id)
    assert job.cancel_requested
    with translation.override("en"):
        assert show(job.state_reason_text) == "stopped at its budget ¥1.00: ¥0.80 spent"
    tick(90)
    (told,) = WebhookEvent.objects.filter(type="sweep.budget_stopped")
    assert "Sweep quad stopped at its budget ¥1.00" in _said(told)["en"]
    assert Trial.objects.filter(sweep=sweep).count() == 1, "no trial after the stop"


def test_no_trial_starts_that_would_pass_the_sweeps_budget(money, alice, pool):
    """Billing judges it on its accrual tick and keeps it on the sweep; the sweep's round
    reads it (jobs never asks billing, nor prices trials inside the sweep's lock)."""
    from billing import projections
    from jobs.models import Sweep, Trial
    from jobs.pools import sweeps

    sweep = _sweep(alice, pool, "1.00")
    first = Trial.objects.get(sweep=sweep)
    _trial_runs(first, at(0))
    # Its first trial ran 60 s (0.60) and completed: a second would bring it to 1.20.
    Job.objects.filter(pk=first.job_id).update(state=Job.State.SUCCEEDED, finished_at=at(60))
    Trial.objects.filter(pk=first.pk).update(state=Trial.State.COMPLETE, last_step=10)
    sweep.refresh_from_db()
    assert sweeps.budget_hold(sweep) is None, "not judged yet"
    # The page, the projection and the budget price it alike: 0.60 spent, a trial 0.60.
    p = projections.sweep_projection(sweep, now=at(61))
    assert (p["spent"], p["trial_cost"]) == (Decimal("0.60"), Decimal("0.60"))
    assert projections.sweep_figures(sweep, now=at(61)).used_cost == Decimal("0.60")
    assert budgets.sweep_spent(sweep)[0] == Decimal("0.60")
    tick(61)
    sweep.refresh_from_db()
    assert sweep.state == Sweep.State.RUNNING, "under its budget: not cancelled"
    with translation.override("en"):
        assert show(sweeps.budget_hold(sweep)) == (
            "the next trial would pass its budget ¥1.00 (spent ¥0.60, a trial costs about ¥0.60)"
        )
    # Judged against another budget, it holds nothing; billing's next judgement neither.
    sweep.budget = Decimal("5")
    assert sweeps.budget_hold(sweep) is None
    assert projections.sweep_hold(sweep, now=at(61)) is None
    sweep.refresh_from_db()
    with time_machine.travel(at(62), tick=False):
        assert sweeps.advance(sweep.pk) == 0
    sweep.refresh_from_db()
    assert sweep.state == Sweep.State.FINISHED and sweep.budget_stopped_at is not None
    assert "would pass its budget" in sweep.note
    assert Trial.objects.filter(sweep=sweep).count() == 1
    # Its owner is told it was the budget, as a budget cancel tells it, with the currency.
    (told,) = WebhookEvent.objects.filter(type="sweep.budget_stopped")
    data = json.loads(told.body)["data"]
    assert data["sweep"]["state"] == "finished"
    assert data["budget"] == {"budget": "1.00", "spent": "0.60", "currency": "CNY"}
    assert _said(told)["en"].startswith(
        "Sweep quad ended at its budget: the next trial would pass its budget ¥1.00 (spent ¥0.60"
    )


# -- the input on the pages, the API and the command line ------------------------------------


def _page(user):
    from django.test import Client

    client = Client()
    client.force_login(user)
    return client


def _api(user):
    from django.test import Client

    from console.models import ApiToken

    _, token = ApiToken.issue(user=user, name="script")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def call(method, path, body=None):
        if method == "GET":
            response = client.get(f"/api/v1/{path}")
        else:
            response = getattr(client, method.lower())(
                f"/api/v1/{path}", data=json.dumps(body or {}), content_type="application/json"
            )
        return response.status_code, response.json()

    return call


def _messages(response) -> list[str]:
    return [str(m) for m in response.context["messages"]] if response.context else []


def test_the_job_form_takes_a_budget_and_refuses_a_bad_one_in_words(money, alice, placed):
    cluster = placed("lab-a")
    page = _page(alice)
    form = {"name": "train", "command": "python train.py", "launcher": "plain",
            "workdir": "/workspace", "checkpoint_dir": "/workspace/checkpoints", "retries": 0,
            "max_preemptions": 5}  # fmt: skip
    with translation.override("en"):
        refused = page.post(f"/clusters/{cluster.pk}/jobs/new/", {**form, "budget": "-5"})
    assert refused.status_code == 200 and not Job.objects.exists()
    assert "A budget must be more than 0" in refused.content.decode()
    refused = page.post(f"/clusters/{cluster.pk}/jobs/new/", {**form, "budget": "12.345"})
    assert "at most 2 decimals" in refused.content.decode()
    made = page.post(f"/clusters/{cluster.pk}/jobs/new/", {**form, "budget": "12.5"})
    assert made.status_code == 302
    job = Job.objects.get()
    assert job.budget == Decimal("12.50")
    # The job's page shows it, and its small form changes or clears it.
    shown = page.get(f"/jobs/{job.pk}/").content.decode()
    assert 'data-testid="budget-form"' in shown and "¥12.50" in shown
    changed = page.post(f"/jobs/{job.pk}/budget/", {"budget": "20"}, follow=True)
    job.refresh_from_db()
    assert job.budget == Decimal("20.00")
    assert any("stops at its budget of ¥20.00" in m for m in _messages(changed))
    refused = page.post(f"/jobs/{job.pk}/budget/", {"budget": "abc"}, follow=True)
    job.refresh_from_db()
    assert job.budget == Decimal("20.00")
    assert any("is not a number" in m for m in _messages(refused))
    page.post(f"/jobs/{job.pk}/budget/", {"budget": ""})
    job.refresh_from_db()
    assert job.budget is None


def test_the_cluster_and_sweep_pages_change_a_budget(money, alice, placed, pool):
    from jobs.models import Sweep

    cluster = placed("lab-a")
    page = _page(alice)
    assert 'data-testid="budget-form"' in page.get(f"/clusters/{cluster.pk}/").content.decode()
    page.post(f"/clusters/{cluster.pk}/budget/", {"budget": "30"})
    cluster.refresh_from_db()
    assert cluster.budget == Decimal("30.00")
    sweep = _sweep(alice, pool, "5")
    assert 'data-testid="budget-form"' in page.get(f"/sweeps/{sweep.pk}/").content.decode()
    refused = page.post(f"/sweeps/{sweep.pk}/budget/", {"budget": "2000000"}, follow=True)
    assert any("at most 1,000,000" in m for m in _messages(refused))
    page.post(f"/sweeps/{sweep.pk}/budget/", {"budget": "7.25"})
    assert Sweep.objects.get(pk=sweep.pk).budget == Decimal("7.25")


def test_another_researcher_can_neither_read_nor_change_a_budget(money, alice, bob, placed, pool):
    cluster = placed("lab-a", budget=Decimal("10"))
    with time_machine.travel(at(0), tick=False):
        job = cluster_services.job_submit(
            cluster=cluster, spec=JobSpec(name="train", command="x", budget=Decimal("5"))
        )
    sweep = _sweep(alice, pool, "5")
    page = _page(bob)
    for path in (f"/jobs/{job.pk}/budget/", f"/clusters/{cluster.pk}/budget/",
                 f"/sweeps/{sweep.pk}/budget/"):  # fmt: skip
        assert page.post(path, {"budget": "1"}).status_code == 404, path
    api = _api(bob)
    for path in (f"jobs/{job.pk}", f"clusters/{cluster.pk}", f"sweeps/{sweep.pk}"):
        assert api("GET", path)[0] == 404, path
        for method in ("PATCH", "POST"):
            assert api(method, f"{path}/budget", {"budget": None})[0] == 404, (method, path)
    job.refresh_from_db()
    cluster.refresh_from_db()
    sweep.refresh_from_db()
    assert (job.budget, cluster.budget, sweep.budget) == (
        Decimal("5"),
        Decimal("10"),
        Decimal("5"),
    ), "nothing changed"


def test_the_api_takes_a_budget_on_create_and_changes_it_and_refuses_a_bad_one(
    money, alice, placed, pool
):
    cluster = placed("lab-a")
    api = _api(alice)
    body = {"cluster": cluster.pk, "name": "train", "command": "python train.py"}
    with translation.override("en"):
        status, refused = api("POST", "jobs", {**body, "budget": "1.234"})
    assert status == 400 and "at most 2 decimals" in refused["fields"]["budget"][0]
    status, refused = api("POST", "jobs", {**body, "budget": 0})
    assert status == 400 and "more than 0" in refused["fields"]["budget"][0]
    status, refused = api("POST", "jobs", {**body, "budget": True})
    assert status == 400 and refused["fields"]["budget"]
    assert not Job.objects.exists()
    status, job = api("POST", "jobs", {**body, "budget": 49.9})
    assert status == 201 and job["budget"] == "49.90" and job["budget_stopped_at"] is None
    status, job = api("PATCH", f"jobs/{job['id']}/budget", {"budget": "60"})
    assert status == 200 and job["budget"] == "60.00"
    status, refused = api("POST", f"jobs/{job['id']}/budget", {"budget": "NaN"})
    assert status == 400 and "finite" in refused["error"]
    status, job = api("POST", f"jobs/{job['id']}/budget", {"budget": None})
    assert status == 200 and job["budget"] is None
    # A cluster: refused on create in words, nothing made; set and cleared later.
    status, refused = api(
        "POST", "clusters",
        {"name": "lab-z", "gpu_model": "a100-80gb", "image": "suanli/busybox:latest",
         "volumes": [], "budget": "ten"},
    )  # fmt: skip
    assert status == 400 and "is not a number" in refused["fields"]["budget"][0]
    assert not Cluster.objects.filter(name="lab-z").exists()
    status, shown = api("PATCH", f"clusters/{cluster.pk}/budget", {"budget": "25.50"})
    assert status == 200 and shown["budget"] == "25.50"
    # A sweep.
    sweep = _sweep(alice, pool, "5")
    status, shown = api("PATCH", f"sweeps/{sweep.pk}/budget", {"budget": "-1"})
    assert status == 400 and "more than 0" in refused_text(shown)
    status, shown = api("PATCH", f"sweeps/{sweep.pk}/budget", {"budget": "8"})
    assert status == 200 and shown["budget"] == "8.00"


def refused_text(answer: dict) -> str:
    return " ".join([answer.get("error", ""), *answer.get("fields", {}).get("budget", [])])


def test_the_command_line_sets_a_budget_and_says_what_is_wrong_with_a_bad_one(
    live_server, money, alice, bob, placed, pool, tmp_path
):
    from test_cli import Cli

    from console.models import ApiToken

    cluster = placed("lab-a")
    with time_machine.travel(at(0), tick=False):
        job = cluster_services.job_submit(cluster=cluster, spec=JobSpec(name="train", command="x"))
    sweep = _sweep(alice, pool, "5")

    def logged_in(user):
        _, token = ApiToken.issue(user=user, name="laptop")
        cli = Cli(tmp_path / user.username)
        cli("login", "--url", live_server.url, "--token", token)
        return cli

    cli = logged_in(alice)
    done = cli("jobs", "budget", job.pk, "--", "-3", ok=False)
    assert done.returncode == 1 and "A budget must be more than 0" in done.stderr
    done = cli("clusters", "budget", cluster.pk, "1.005", ok=False)
    assert done.returncode == 1 and "at most 2 decimals" in done.stderr
    done = cli("jobs", "submit", "--cluster", cluster.pk, "--budget", "lots", "--", "x", ok=False)
    assert done.returncode == 1 and "is not a number" in done.stderr
    assert cli("jobs", "budget", job.pk, "50").stdout.strip() == (
        f"Job {job.pk} (train) stops at 50.00 spent."
    )
    assert cli.json("clusters", "budget", cluster.pk, "12.5")["budget"] == "12.50"
    assert "budget:" in cli("clusters", "show", cluster.pk).stdout
    assert "12.50" in cli("clusters", "show", cluster.pk).stdout
    assert cli.json("sweeps", "budget", sweep.pk, "none")["budget"] is None
    made = json.loads(
        cli("jobs", "submit", "--cluster", cluster.pk, "--budget", "7", "--json", "--", "x").stdout
    )
    assert made["budget"] == "7.00"
    job.refresh_from_db()
    cluster.refresh_from_db()
    assert job.budget == Decimal("50") and cluster.budget == Decimal("12.5")
    # Another researcher: not found, and nothing changed.
    done = logged_in(bob)("jobs", "budget", job.pk, "none", ok=False)
    assert done.returncode == 1 and "not found" in done.stderr.lower()
    job.refresh_from_db()
    assert job.budget == Decimal("50")


# -- a real job on the engines ---------------------------------------------------------------


def test_a_real_job_runs_its_preemption_script_then_stops_at_its_budget(
    running_cluster, alice, rate_card, fund, processes, storage_root, settings
):
    """On the engines, with the Procfile's worker: the accrual's budget watch stops a job
    that prints a line a second; its preemption script runs in the container first (its
    words reach the job's log), then SIGTERM; it ends cancelled, with its reason in words."""
    import time

    from jobs.placement import scheduler as placement
    from jobs.runs import repair

    settings.SUANLI_ACCRUAL_INTERVAL = 1
    settings.SUANLI_PREEMPT_SCRIPT_S = 5
    settings.SUANLI_STOP_GRACE_S = 3
    from django.utils import timezone

    rate_card({"a100-80gb": "3600"}, effective_from=timezone.now() - timedelta(hours=1))
    fund(alice, "1000")
    env = {
        "SUANLI_PREEMPT_SCRIPT_S": "5", "SUANLI_STOP_GRACE_S": "3",
        "SUANLI_STORAGE_ROOT": str(storage_root),
    }  # fmt: skip
    processes.start("worker", "--worker-class", "console.rqworker.SimpleWorker", env=env)
    cluster = running_cluster(1, gpus=1)
    job = cluster_services.job_submit(
        cluster=cluster,
        spec=JobSpec(
            name="priced", command="i=0; while true; do i=$((i+1)); echo step $i; sleep 1; done",
            preemption_script="echo saving at the budget: $SUANLI_PREEMPTION_REASON",
            # 1.00 a GPU-second; 9 s of margin (script 5, grace 3, a period 1): ~5 s run
            budget=Decimal("14"),
        ),
    )  # fmt: skip

    def drive(check, timeout=60, what=""):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            repair.reconcile()
            placement.place_pending()
            accrual.accrue()
            job.refresh_from_db()
            if check():
                return
            time.sleep(0.5)
        raise AssertionError(f"{what}: {job.state} {job.state_reason}")

    drive(lambda: job.budget_stopped_at is not None, what="stopped at its budget")
    assert job.cancel_requested and job.preempt_requested_at is not None
    drive(lambda: job.state == Job.State.CANCELLED, what="ended")
    with translation.override("en"):
        reason = show(job.state_reason_text)
    assert reason.startswith("stopped at its budget ¥14.00: ¥") and " spent, and up to ¥" in reason
    log = "\n".join(r.log for r in job.replicas.all())
    assert "step 1" in log
    assert "saving at the budget: stopped at its budget ¥14.00" in log, log[-500:]
    kinds = list(job.events.values_list("kind", flat=True))
    assert "budget" in kinds and kinds[-1] == "cancelled"
    spent = budgets.job_spent(job)
    assert spent <= Decimal("14"), f"it never passed its budget: {spent}"
    cluster.refresh_from_db()
    assert cluster.state == "running", "its cluster runs on (the budget was the job's)"
    cluster_services.cluster_release(cluster=cluster)


def test_the_budget_forms_in_both_languages_and_sizes(
    money, alice, placed, pool, live_server, browser
):
    """Screenshots (SUANLI_SCREENSHOTS): the job's, cluster's and sweep's budget card, a
    budget set from the job's page and a bad one refused in words, in Chinese and English,
    at 1366 and 390 px."""
    import os

    from browsing import login
    from django.urls import reverse
    from playwright.sync_api import expect

    from console import preferences

    shots = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
    cluster = placed("lab-a", budget=Decimal("120"))
    with time_machine.travel(at(0), tick=False):
        job = cluster_services.job_submit(
            cluster=cluster, spec=JobSpec(name="train", command="python train.py")
        )
    sweep = _sweep(alice, pool, "30")
    for language in ("zh-hans", "en"):
        preferences.save(alice, language=language, time_zone="Asia/Shanghai")
        for width in (1366, 390):
            context = browser.new_context(viewport={"width": width, "height": 900})
            try:
                page = context.new_page()
                login(page, live_server, "alice", "alice-pass-123")
                page.goto(f"{live_server.url}{reverse('job_detail', args=[job.pk])}")
                expect(page.get_by_test_id("budget-none")).to_be_visible()
                page.fill("#budget #id_budget", "-3")
                page.get_by_test_id("budget-save").click()
                expect(page.get_by_test_id("budget-none")).to_be_visible()
                page.get_by_test_id("budget").scroll_into_view_if_needed()
                page.screenshot(path=f"{shots}/budget-job-refused-{language}-{width}.png")
                page.fill("#budget #id_budget", "50")
                page.get_by_test_id("budget-save").click()
                expect(
                    page.get_by_test_id("budget").get_by_test_id("budget-state")
                ).to_contain_text("¥50.00")
                page.get_by_test_id("budget").scroll_into_view_if_needed()
                page.screenshot(path=f"{shots}/budget-job-{language}-{width}.png")
                page.goto(f"{live_server.url}{reverse('cluster_detail', args=[cluster.pk])}")
                expect(
                    page.get_by_test_id("budget").get_by_test_id("budget-state")
                ).to_contain_text("¥120.00")
                page.get_by_test_id("budget").scroll_into_view_if_needed()
                page.screenshot(path=f"{shots}/budget-cluster-{language}-{width}.png")
                page.goto(f"{live_server.url}{reverse('sweep_detail', args=[sweep.pk])}")
                expect(
                    page.get_by_test_id("budget").get_by_test_id("budget-state")
                ).to_contain_text("¥30.00")
                page.get_by_test_id("budget").scroll_into_view_if_needed()
                page.screenshot(path=f"{shots}/budget-sweep-{language}-{width}.png")
                page.goto(f"{live_server.url}{reverse('job_new', args=[cluster.pk])}")
                page.locator("#field-budget").scroll_into_view_if_needed()
                page.screenshot(path=f"{shots}/budget-job-new-{language}-{width}.png")
            finally:
                context.close()
            budgets.set_budget(job, None)
    job.refresh_from_db()
    assert job.budget is None


def test_an_ended_job_cluster_or_sweep_keeps_its_budget_and_the_record_of_its_stop(
    live_server, money, alice, placed, pool, tmp_path
):
    """Its budget no longer applies: a change is refused in words on the page, the API and
    the CLI, and "stopped at its budget" stays on record."""
    from test_cli import Cli

    from console.models import ApiToken
    from jobs.models import Sweep
    from jobs.pools import sweeps

    cluster = placed("lab-a")
    with time_machine.travel(at(0), tick=False):
        job = cluster_services.job_submit(
            cluster=cluster, spec=JobSpec(name="train", command="x", budget=Decimal("1.00"))
        )
    assert budgets.stop_job(job, Decimal("0.80"), now=at(80))  # waiting: cancelled at once
    gone = placed("lab-b", budget=Decimal("3.00"))
    Cluster.objects.filter(pk=gone.pk).update(budget_stopped_at=at(90))
    cluster_services.cluster_release(cluster=gone, reason="by hand")
    sweep = _sweep(alice, pool, "5")
    Sweep.objects.filter(pk=sweep.pk).update(budget_stopped_at=at(95))
    sweeps.sweep_cancel(sweep=Sweep.objects.get(pk=sweep.pk))
    page, api = _page(alice), _api(alice)
    ended = ((f"jobs/{job.pk}", "Job train has ended (cancelled)"),
             (f"clusters/{gone.pk}", "Cluster lab-b is "),
             (f"sweeps/{sweep.pk}", "Sweep quad has ended (cancelled) and does not start again"))  # fmt: skip
    for path, words in ended:
        with translation.override("en"):
            shown = page.get(f"/{path}/").content.decode()
            assert 'data-testid="budget-form"' not in shown, path
            assert "Stopped at its budget" in shown, path
            refused = page.post(f"/{path}/budget/", {"budget": "9"}, follow=True)
            assert any(words in m and "no longer applies" in m for m in _messages(refused)), path
            status, answer = api("PATCH", f"{path}/budget", {"budget": "9"})
            assert status == 409 and words in answer["error"], (path, answer)
            status, answer = api("POST", f"{path}/budget", {"budget": None})
            assert status == 409 and "no longer applies" in answer["error"], path
    # One that ended with no budget has no budget card: nothing to set, nothing it was held to.
    plain = cluster_services.job_submit(
        cluster=placed("lab-c"), spec=JobSpec(name="plain", command="x")
    )
    cluster_services.job_cancel(job=plain, by="alice")
    with translation.override("en"):
        answer = page.get(f"/jobs/{plain.pk}/")
    shown = answer.content.decode()
    assert answer.status_code == 200 and 'data-state="cancelled"' in shown, shown
    assert 'data-testid="budget"' not in shown and "No budget" not in shown
    _, token = ApiToken.issue(user=alice, name="laptop")
    cli = Cli(tmp_path / "alice")
    cli("login", "--url", live_server.url, "--token", token)
    done = cli("jobs", "budget", job.pk, "9", ok=False)
    assert done.returncode == 1 and "Job train has ended" in done.stderr
    done = cli("sweeps", "budget", sweep.pk, "none", ok=False)
    assert done.returncode == 1 and "no longer applies" in done.stderr
    for thing, budget in ((job, "1.00"), (gone, "3.00"), (Sweep.objects.get(pk=sweep.pk), "5")):
        thing.refresh_from_db()
        assert thing.budget == Decimal(budget), thing
        assert thing.budget_stopped_at is not None, f"{thing}: the stop stays on record"


def test_a_preempted_job_stopped_at_its_budget_releases_its_cluster_as_a_cancel_does(
    money, alice, placed, django_capture_on_commit_callbacks
):
    """A job preempted and waiting to run again, its cluster waiting to be placed again:
    stopped at its budget it ends at once, and the cluster (released after its last job)
    is released, as when its owner cancels it, not placed again and charged for nothing."""
    cluster = placed("lab-a", release_policy=Cluster.ReleasePolicy.AFTER_LAST_JOB)
    with time_machine.travel(at(0), tick=False):
        job = cluster_services.job_submit(
            cluster=cluster, spec=JobSpec(name="train", command="x", budget=Decimal("1.00"))
        )
    Job.objects.filter(pk=job.pk).update(state=Job.State.PREEMPTED, attempt=1)
    Cluster.objects.filter(pk=cluster.pk).update(state=Cluster.State.PENDING)
    job.refresh_from_db()
    with django_capture_on_commit_callbacks(execute=True):
        assert budgets.stop_job(job, Decimal("0.90"), now=at(90))
    job.refresh_from_db()
    cluster.refresh_from_db()
    assert job.state == "cancelled" and job.budget_stopped_at == at(90)
    assert cluster.state in ("releasing", "released")
    with translation.override("en"):
        assert show(cluster.state_reason_text) == (
            "released automatically after job train was cancelled"
        )


def test_a_cluster_stopped_at_its_budget_still_pays_for_its_kept_files_as_its_words_say(
    money, alice, placed, rate_card
):
    """With a stopped price on the card, a budget stop ends the GPU charges at the stop, to
    the second; its kept files go on being charged at the stopped price (the words say so,
    and how to stop that: release it), and the ledger stays exact."""
    rate_card({"a100-80gb": RATE}, effective_from=at(-1800), stopped_per_hour=Decimal("3.60"))
    cluster = placed("lab-a", budget=Decimal("1.00"))
    for t in (50, 90):
        tick(t)
    cluster.refresh_from_db()
    assert cluster.state == "stopped" and cluster.budget_stopped_at == at(90)
    with translation.override("en"):
        assert show(cluster.state_reason_text) == (
            "stopped at its budget ¥1.00: ¥0.90 spent; its kept files are still charged ¥3.60 "
            "an hour while it is stopped: release it to stop that"
        )
    (told,) = WebhookEvent.objects.filter(type="cluster.budget_stopped")
    assert "still charged ¥3.60 an hour" in _said(told)["en"]
    assert "¥3.60" in _said(told)["zh-hans"]
    for t in (100, 200, 400):
        tick(t)
    entries = LedgerEntry.objects.filter(cluster=cluster)
    gpu = entries.exclude(memo__icontains="stopped")
    kept = entries.filter(memo__icontains="stopped")
    assert gpu.aggregate(s=Sum("amount"))["s"] == Decimal("-0.90"), "no GPU charge past it"
    assert gpu.latest("period_to").period_to == at(90)
    # 310 s kept at 3.60 an hour (0.001 a second), from the second it stopped.
    assert kept.earliest("period_from").period_from == at(90)
    assert kept.latest("period_to").period_to == at(400)
    assert kept.aggregate(s=Sum("amount"))["s"] == Decimal("-0.31")
    assert _charged(cluster) == Decimal("-1.21")
    account = Account.objects.get(user=alice)
    total = LedgerEntry.objects.filter(account=account).aggregate(s=Sum("amount"))["s"]
    assert total == account.balance, "the ledger adds up to the balance"


def test_a_budget_below_what_a_stop_costs_stops_the_job_at_once_and_says_why(money, alice, placed):
    """Its stop may cost 20 s of its cluster (the grace and one accrual period): ¥0.20 here.
    A budget of ¥0.15 is below that: the job is stopped at its first tick, and the words say
    the room its stop needs, so the early stop is understood."""
    cluster = placed("lab-a")
    with time_machine.travel(at(0), tick=False):
        job = cluster_services.job_submit(
            cluster=cluster,
            spec=JobSpec(name="train", command="python train.py", budget=Decimal("0.15")),
        )
    _running(job, at(0))
    tick(10)
    job.refresh_from_db()
    assert job.cancel_requested and job.budget_stopped_at == at(10)
    with translation.override("en"):
        assert show(job.state_reason_text) == (
            "stopped at its budget ¥0.15: ¥0.10 spent, and up to ¥0.20 more while it stops (20 s)"
        )
    (told,) = WebhookEvent.objects.filter(type="job.budget_stopped")
    assert "up to ¥0.20 more while it stops (20 s)" in _said(told)["en"]


def test_a_member_may_lower_but_not_lift_a_budget_an_admin_set_on_the_admins_cluster(
    money, alice, make_cluster, make_paper_host
):
    """A budget is a spending control: a member who uses an admin's cluster may lower its
    budget (or its jobs'), but clearing or raising it needs who may change the cluster."""
    from django.contrib.auth import get_user_model
    from django.test import Client

    from console.models import ApiToken
    from jobs.models import TeamMember
    from jobs.teams import services as teams
    from jobs.tenancy.actors import Actor

    team = teams.team_create(person=alice, name="lab")
    owner = Actor.for_team(alice, team.pk)
    people = {}
    for login, role in (("ada", TeamMember.Role.ADMIN), ("mo", TeamMember.Role.MEMBER)):
        who = get_user_model().objects.create_user(login, password=f"{login}-pass-123")
        invite, _ = teams.invite_create(actor=owner, role=role, login=login)
        teams.invite_accept(person=who, invite=invite)
        people[login] = who
    make_paper_host(gpus=8)
    cluster = make_cluster(team.principal, "ada-cluster", created_by=people["ada"])
    cluster.members.add(people["mo"])
    budgets.set_budget(cluster, Decimal("10.00"))
    job = cluster_services.job_submit(
        cluster=cluster, spec=JobSpec(name="train", command="x", budget=Decimal("5.00"))
    )

    def api(user, method, path, body):
        _, token = ApiToken.issue(user=user, name="t", team=team)
        client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
        answer = getattr(client, method)(
            f"/api/v1/{path}", json.dumps(body), content_type="application/json"
        )
        return answer.status_code

    mo, ada = people["mo"], people["ada"]
    for path, body in ((f"clusters/{cluster.pk}/budget", {"budget": None}),
                       (f"clusters/{cluster.pk}/budget", {"budget": "11"}),
                       (f"jobs/{job.pk}/budget", {"budget": "1000000"}),
                       (f"jobs/{job.pk}/budget", {"budget": None})):  # fmt: skip
        assert api(mo, "patch", path, body) == 403, (path, body)
    cluster.refresh_from_db()
    job.refresh_from_db()
    assert (cluster.budget, job.budget) == (Decimal("10.00"), Decimal("5.00")), "unchanged"
    assert api(mo, "patch", f"clusters/{cluster.pk}/budget", {"budget": "8"}) == 200
    assert api(mo, "patch", f"jobs/{job.pk}/budget", {"budget": "4"}) == 200
    assert api(ada, "patch", f"clusters/{cluster.pk}/budget", {"budget": None}) == 200
    cluster.refresh_from_db()
    job.refresh_from_db()
    assert (cluster.budget, job.budget) == (None, Decimal("4.00"))


def test_a_cluster_stopped_at_its_budget_runs_again_only_with_a_higher_budget_or_none(
    money, alice, placed
):
    """Setting the same budget again, or a lower one, would only let it spend past it once
    more: refused in words (page and API alike: billing/budgets.py set_budget)."""
    from django.core.exceptions import ValidationError

    from console.forms import start_refusal

    cluster = placed("lab-a", budget=Decimal("1.00"))
    tick(90)
    cluster.refresh_from_db()
    assert cluster.budget_stopped_at == at(90)
    for same_or_lower in ("1.00", "0.50"):
        with translation.override("en"), pytest.raises(ValidationError) as refused:
            budgets.set_budget(cluster, Decimal(same_or_lower))
        assert refused.value.messages == [
            "lab-a was stopped at its budget of ¥1.00: raise the budget above that, or clear "
            "it, to let it run again."
        ]
        cluster.refresh_from_db()
        assert cluster.budget_stopped_at == at(90) and start_refusal(cluster, "gpu")
    status, answer = _api(alice)("PATCH", f"clusters/{cluster.pk}/budget", {"budget": "1"})
    assert status == 400 and "raise the budget above" in answer["error"]
    budgets.set_budget(cluster, Decimal("1.50"))
    cluster.refresh_from_db()
    assert cluster.budget_stopped_at is None and start_refusal(cluster, "gpu") == ""

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
from jobs.models import Job, JobEvent, Node, Replica, WebhookEndpoint, WebhookEvent
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
    assert data["budget"] == {"budget": "1.0000", "spent": "0.9000", "currency": "CNY"}
    said = _said(told)
    assert "lab-a stopped at its budget ¥1.00: ¥0.90 spent; its files are kept" in said["en"]
    assert "¥1.00" in said["zh-hans"] and "lab-a" in said["zh-hans"]
    # A new budget starts the watch again; started again, it stops at the new one.
    budgets.set_budget(cluster, Decimal("2.00"))
    cluster.refresh_from_db()
    assert cluster.budget_stopped_at is None and cluster.budget == Decimal("2.00")


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
        assert show(job.state_reason_text) == "stopped at its budget ¥1.00: ¥0.80 spent"
    line = JobEvent.objects.filter(job=job, kind="budget").get()
    with translation.override("en"):
        assert show(line.text) == (
            "stopped at its budget ¥1.00: ¥0.80 spent: SIGTERM, then SIGKILL after 10 s"
        )
    tick(90)
    (told,) = WebhookEvent.objects.filter(type="job.budget_stopped")
    assert json.loads(told.body)["data"]["budget"]["spent"] == "0.8000"
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
        assert show(job.state_reason_text) == "stopped at its budget ¥1.00: ¥0.80 spent"


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
    said = _said(told)
    assert "stops at its budget ¥50.00, about 62 % done" in said["en"]
    assert "62 %" in said["zh-hans"]
    line = JobEvent.objects.get(job=job, kind="budget")
    assert "62 %" in line.message
    budgets.set_budget(job, Decimal("60"))
    job.refresh_from_db()
    assert job.budget_warned_at is None, "a new budget may warn again"


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

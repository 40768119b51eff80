"""Cost projections (issue 44): a running job's finish time and final cost from its own
progress, priced at its cluster's price on top of what it cost so far, said in words in the
reader's language and zone; the projection made at a fifth of the steps kept once and
compared with the job's end; a researcher's accuracy; a sweep's and a pool's remaining
cost. No container runs here: the job's attempt and its progress points are written as the
dispatcher and the progress reader would (tests/test_progress.py reads real lines)."""

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

import pytest
from conftest import TEST_IMAGE
from django.utils import timezone, translation
from test_progress import TRAIN
from test_sweep_pages import ran

from billing import projections, tasks
from console import pools as console_pools
from jobs.base.text import show
from jobs.clusters import services
from jobs.clusters.services import ClusterSpec, JobSpec
from jobs.models import Image, Job, JobProgress, Replica, Trial
from jobs.placement import scheduler
from jobs.pools import autoscaler, sweeps
from jobs.runs import dispatch, livelogs, progress, repair, settle
from jobs.runs.livelogs import Follower

pytestmark = pytest.mark.django_db

PRICE = Decimal("3.60")  # per GPU-hour: ¥0.001 a second


@pytest.fixture
def lab(alice, paper_host, make_cluster, rate_card, fund):
    """Alice's one-GPU cluster lab-a, running on a paper host at ¥3.60 per GPU-hour."""
    rate_card({"a100-80gb": str(PRICE)}, effective_from=timezone.now() - timedelta(days=1))
    fund(alice, "100")
    cluster = make_cluster(alice, "lab-a", gpus=1)
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    return cluster


def _now() -> datetime:
    return timezone.now().replace(microsecond=0)


def _running(cluster, started: datetime, *, name="train-7", env=None) -> Job:
    """A job submitted to the cluster and running since `started` (`_run`)."""
    job = services.job_submit(
        cluster=cluster, spec=JobSpec(name=name, command="python train.py", env=env or {})
    )
    return _run(job, started)


def _run(job: Job, started: datetime) -> Job:
    """What dispatch leaves: the job running, its attempt 1's container on its cluster's
    node started at `started`."""
    node = job.cluster.node_set.get()
    Job.objects.filter(pk=job.pk).update(
        state=Job.State.RUNNING, attempt=1, started_at=started, running_since=started
    )
    Replica.objects.create(
        job=job, attempt=1, rank=0, node=node, host=node.host,
        container_name=f"projection-test-{job.pk}-1-0", state=Replica.State.RUNNING,
        started_at=started,
    )  # fmt: skip
    job.refresh_from_db()
    return job


# Seconds each 20-step interval took: about 10 s (0.5 s a step), a little uneven.
JITTER = [10.0, 10.4, 9.7, 10.1, 9.9, 10.6, 9.5, 10.2, 10.0, 9.8, 10.3, 9.6]


def _progress(job: Job, first_at: datetime, points: int, *, total: int | None) -> float:
    """What the progress reader keeps of rank 0's SUANLI_METRIC lines: `points` points of 20
    steps each from `first_at` (a slow first step of 30 s), and the total the lines
    declared. Returns the newest point's time (unix seconds)."""
    t = first_at.timestamp()
    kept = [[round(t, 3), 0]]
    t += 30.0  # the first step compiles, loads the data
    kept.append([round(t, 3), 1])
    step = 1
    for i in range(points):
        t += JITTER[i % len(JITTER)]
        step += 20
        kept.append([round(t, 3), step])
    JobProgress.objects.update_or_create(job=job, defaults={"points": kept})
    Job.objects.filter(pk=job.pk).update(total_steps=total)
    job.refresh_from_db()
    return t


def _priced(seconds_us: int) -> Decimal:
    """`seconds_us` microseconds at ¥3.60 an hour for one GPU, to the smallest unit."""
    exact = Decimal(seconds_us) / 1_000_000 * PRICE / 3600
    return exact.quantize(Decimal("0.0001"), rounding=ROUND_HALF_UP)


def _us(delta: timedelta) -> int:
    return delta // timedelta(microseconds=1)


def _said(text, language: str, zone: str = "Asia/Shanghai") -> str:
    with translation.override(language), timezone.override(zone):
        return show(text.as_json())


# -- a job ----------------------------------------------------------------------------------


def test_a_running_job_is_projected_at_its_price_from_its_pace(lab):
    started = _now() - timedelta(seconds=600)
    job = _running(lab, started)
    last = _progress(job, started + timedelta(seconds=5), 50, total=5000)
    now = datetime.fromtimestamp(last, tz=UTC) + timedelta(seconds=2)

    p = projections.project(job, now=now)

    assert p.pace.ok, p.pace.why
    assert p.currency == "CNY" and p.per_hour == Decimal("3.6000")
    # So far: its replica's run from its start to now; then the seconds to its finish.
    assert p.cost_so_far == _priced(_us(now - started))
    assert p.cost == p.cost_so_far + _priced(_us(p.pace.finish_at - now))
    assert p.remaining == p.cost - p.cost_so_far
    # The range brackets it, and is the range of the finish priced the same way.
    assert p.cost_low <= p.cost <= p.cost_high
    assert p.cost_low == p.cost_so_far + _priced(_us(p.pace.finish_low - now))
    assert p.cost_high == p.cost_so_far + _priced(_us(p.pace.finish_high - now))
    assert p.cost_low < p.cost_high
    # About 4,000 steps at about half a second each remain: about ¥2 more.
    assert Decimal("1.8") < p.remaining < Decimal("2.2")
    assert p.budget is None and p.budget_fraction is None and p.budget_words is None


def test_the_projection_reads_in_english_and_chinese_in_the_readers_zone(lab):
    started = _now() - timedelta(seconds=600)
    job = _running(lab, started)
    last = _progress(job, started + timedelta(seconds=5), 50, total=5000)
    now = datetime.fromtimestamp(last, tz=UTC) + timedelta(seconds=2)
    p = projections.project(job, now=now)
    pc = p.pace
    shanghai = pc.finish_at.astimezone(timezone.get_fixed_timezone(480))
    finish = f"{shanghai:%Y-%m-%d %H:%M} CST"
    money = {
        name: f"¥{getattr(p, field).quantize(Decimal('0.01'), rounding=ROUND_HALF_UP)}"
        for name, field in (
            ("cost", "cost"), ("low", "cost_low"), ("high", "cost_high"), ("so_far", "cost_so_far")
        )
    }  # fmt: skip
    per_step = f"{pc.seconds_per_step:.2f}"

    en = _said(p.words, "en")
    assert en.startswith(
        f"At the pace of the last {pc.window_steps} steps ({per_step} s/step ± "
    ), en
    assert f"it should finish at {finish} (" in en
    assert f"and cost about {money['cost']} ({money['low']} to {money['high']})" in en
    assert en.endswith(f"; {money['so_far']} spent so far")
    assert "%" in en and "%%" not in en

    zh = _said(p.words, "zh-hans")
    assert zh.startswith(f"按最近 {pc.window_steps} 步的速度（{per_step} 秒/步 ± "), zh
    assert f"预计 {finish} 完成（" in zh
    assert f"约 {money['cost']}（{money['low']} 至 {money['high']}）" in zh
    assert zh.endswith(f"已花费 {money['so_far']}")

    # The API's English keeps UTC.
    assert f"{pc.finish_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC" in str(p.words)


def test_a_job_without_a_total_says_what_it_ran_and_spent_and_why_no_finish(lab):
    started = _now() - timedelta(seconds=3723)
    job = _running(lab, started)
    _progress(job, started + timedelta(seconds=5), 30, total=None)
    now = started + timedelta(seconds=3723)

    p = projections.project(job, now=now)

    assert not p.pace.ok and p.cost is None and p.cost_low is None and p.cost_high is None
    assert p.cost_so_far == _priced(_us(now - started))
    spent = f"¥{p.cost_so_far.quantize(Decimal('0.01'), rounding=ROUND_HALF_UP)}"
    why = "no total steps declared"
    en = _said(p.words, "en")
    assert en.startswith(f"Ran 1 h 2 min so far, {spent} spent; no finish projected: "), en
    assert why in en
    zh = _said(p.words, "zh-hans")
    assert zh.startswith(f"已运行 1 小时 2 分钟，已花费 {spent}；无法预计完成时间："), zh


def test_a_total_from_the_environment_is_projected_too(lab):
    started = _now() - timedelta(seconds=600)
    job = _running(lab, started, env={"SUANLI_TOTAL_STEPS": "5000"})
    last = _progress(job, started + timedelta(seconds=5), 50, total=None)
    now = datetime.fromtimestamp(last, tz=UTC)
    p = projections.project(job, now=now)
    assert p.pace.ok and p.pace.total == 5000 and p.cost > p.cost_so_far


@pytest.mark.parametrize(
    ("total", "says"),
    [
        (800, "the declared total of 800 steps is below step 1001, already reported"),
        (1001, "step 1001 has reached the declared total of 1001 steps"),
    ],
)
def test_a_total_at_or_below_the_step_gives_words_never_a_number(lab, total, says):
    started = _now() - timedelta(seconds=600)
    job = _running(lab, started)
    _progress(job, started + timedelta(seconds=5), 50, total=total)
    p = projections.project(job, now=started + timedelta(seconds=600))
    assert p.cost is None and p.cost_low is None and p.pace.finish_at is None
    assert p.cost_so_far == _priced(600 * 1_000_000)
    assert _said(p.words, "en") == f"Ran 10 min so far, ¥0.60 spent; no finish projected: {says}"
    assert projections.snapshot(p)["cost"] is None


def test_without_a_price_there_is_no_cost_projection_and_the_words_say_so(lab, rate_card):
    started = _now() - timedelta(seconds=600)
    job = _running(lab, started)
    _progress(job, started + timedelta(seconds=5), 50, total=5000)
    now = started + timedelta(seconds=600)
    # An operator's new card, in force since a minute before, no longer prices the A100.
    rate_card({"h100-80gb": "16.00"}, effective_from=now - timedelta(seconds=60))

    p = projections.project(job, now=now)

    assert p.pace.ok  # the finish is still known...
    assert p.cost is None and p.cost_so_far is None and p.per_hour is None  # ...not its cost
    en = _said(p.words, "en")
    assert "it should finish at" in en
    assert en.endswith("no cost projected: the rate card has no price for its cluster"), en
    assert _said(p.words, "zh-hans").endswith("价目表上没有其集群的价格，无法预计费用")
    snap = projections.snapshot(p)
    assert snap["cost"] is None and snap["cost_so_far"] is None

    # Without a total either: what it ran, no money, and why.
    Job.objects.filter(pk=job.pk).update(total_steps=None)
    job.refresh_from_db()
    p = projections.project(job, now=now)
    assert _said(p.words, "en").startswith(
        "Ran 10 min so far (the rate card has no price for its cluster); no finish projected: "
    )


def test_a_projection_past_its_budget_says_how_far_it_gets(lab):
    started = _now() - timedelta(seconds=600)
    job = _running(lab, started)
    last = _progress(job, started + timedelta(seconds=5), 50, total=5000)
    now = datetime.fromtimestamp(last, tz=UTC)
    p = projections.project(job, now=now)
    # A budget halfway between what it spent and what it will cost.
    budget = ((p.cost_so_far + p.cost) / 2).quantize(Decimal("0.01"))
    Job.objects.filter(pk=job.pk).update(budget=budget)
    job.refresh_from_db()

    p = projections.project(job, now=now)

    assert p.budget == budget
    done = p.pace.fraction
    expected = done + (1 - done) * float((budget - p.cost_so_far) / (p.cost - p.cost_so_far))
    assert p.budget_fraction == pytest.approx(expected)
    assert 0.55 < p.budget_fraction < 0.65
    percent = round(p.budget_fraction * 100)
    shown = f"¥{budget.quantize(Decimal('0.01'))}"
    cost = f"¥{p.cost.quantize(Decimal('0.01'), rounding=ROUND_HALF_UP)}"
    # The budget's own warning (billing.budgets tells it once, in these words).
    assert _said(p.budget_words, "en") == (
        f"At its current pace it stops at its budget {shown}, about {percent} % done "
        f"(projected cost {cost})"
    )
    snap = projections.snapshot(p)
    assert Decimal(snap["budget"]) == budget and snap["budget_fraction"] == p.budget_fraction
    assert snap["budget_message"] == str(p.budget_words)


def test_the_snapshot_is_json_with_exact_amounts_and_times(lab):
    started = _now() - timedelta(seconds=600)
    job = _running(lab, started)
    last = _progress(job, started + timedelta(seconds=5), 50, total=5000)
    now = datetime.fromtimestamp(last, tz=UTC)
    p = projections.project(job, now=now)

    snap = json.loads(json.dumps(projections.snapshot(p)))

    assert Decimal(snap["cost"]) == p.cost and Decimal(snap["cost_so_far"]) == p.cost_so_far
    assert Decimal(snap["cost_low"]) == p.cost_low and Decimal(snap["cost_high"]) == p.cost_high
    assert datetime.fromisoformat(snap["finish_at"]) == p.pace.finish_at
    assert datetime.fromisoformat(snap["at"]) == now
    assert snap["step"] == p.pace.step and snap["total"] == 5000
    assert snap["currency"] == "CNY" and snap["per_hour"] == "3.6000"
    assert snap["message"] == str(p.words)
    with translation.override("zh-hans"):
        assert show(snap["words"]).startswith("按最近")


# -- kept, and compared with the end --------------------------------------------------------


def test_the_early_projection_is_kept_once_and_compared_with_the_end(lab, alice):
    started = _now() - timedelta(seconds=1040)  # its 100th point is about now
    job = _running(lab, started)
    first = started + timedelta(seconds=5)

    _progress(job, first, 20, total=5000)  # 401 of 5000 steps: 8 %
    assert tasks.job_projection(job.pk).startswith("projected")
    job.refresh_from_db()
    assert job.projection_early is None
    assert job.projection_last["step"] == 401 and job.projection_last["cost"]

    _progress(job, first, 55, total=5000)  # 1,101 steps: 22 %
    projections.write(job.pk)
    job.refresh_from_db()
    early = job.projection_early
    assert early["step"] == 1101 and early["fraction"] == pytest.approx(0.2202)
    assert job.projection_last == early

    _progress(job, first, 100, total=5000)  # 2,001 steps: 40 %; the early one stays
    projections.write(job.pk)
    job.refresh_from_db()
    assert job.projection_early == early
    assert job.projection_last["step"] == 2001

    # It ends (its last container's end) 400 s after the early projection's finish.
    finished = datetime.fromisoformat(early["finish_at"]) + timedelta(seconds=400)
    Replica.objects.filter(job=job).update(state=Replica.State.EXITED, finished_at=finished)
    Job.objects.filter(pk=job.pk).update(state=Job.State.SUCCEEDED, finished_at=finished)
    job.refresh_from_db()
    projections.write(job.pk)
    job.refresh_from_db()
    assert job.projection_early == early

    c = projections.compare(job)
    run_s = (finished - started).total_seconds()
    assert c["finish_error"] == pytest.approx(-400 / run_s)
    actual = _priced(_us(finished - started))
    assert c["cost"] == actual and c["projected_cost"] == Decimal(early["cost"])
    assert c["cost_error"] == pytest.approx(float((Decimal(early["cost"]) - actual) / actual))
    assert c["cost_error"] < 0  # it ran longer, and cost more, than projected
    en = _said(c["words"], "en")
    assert en.startswith("Projected at 22 % of its steps: finish ")
    assert (
        f"it finished at {finished.astimezone(timezone.get_fixed_timezone(480)):%Y-%m-%d %H:%M} CST"
        in en
    )
    off = abs(c["finish_error"]) * 100
    shown = f"{off:.0f}" if off >= 10 else f"{off:.1f}"
    assert f"finish time off by -{shown} %" in en, en
    assert _said(c["words"], "zh-hans").startswith("在完成 22 % 的步数时预计：")
    # The comparison is kept with its last projection.
    assert job.projection_last["compared"]["cost"] == str(actual)

    # The ended job's own words: what it ran and cost.
    p = projections.project(job)
    assert p.ended and p.cost is None and p.cost_so_far == actual
    assert _said(p.words, "en").startswith("Ran ")


def test_accuracy_of_a_researcher_is_the_median_of_their_jobs_errors(lab, alice, bob):
    assert projections.accuracy_of(alice)["jobs"] == 0
    assert _said(projections.accuracy_of(alice)["words"], "en").startswith("No finished job")
    errors = []
    for i, late in enumerate((100, -300, 600)):
        started = _now() - timedelta(seconds=600)
        job = _running(lab, started, name=f"train-{i}")
        _progress(job, started + timedelta(seconds=5), 55, total=5000)
        projections.write(job.pk)
        job.refresh_from_db()
        finished = datetime.fromisoformat(job.projection_early["finish_at"]) + timedelta(
            seconds=late
        )
        Replica.objects.filter(job=job).update(state=Replica.State.EXITED, finished_at=finished)
        Job.objects.filter(pk=job.pk).update(state=Job.State.SUCCEEDED, finished_at=finished)
        projections.write(job.pk)
        errors.append(abs(projections.compare(Job.objects.get(pk=job.pk))["finish_error"]))
    # A job cancelled halfway is no measure of its projection.
    started = _now() - timedelta(seconds=600)
    job = _running(lab, started, name="cancelled")
    _progress(job, started + timedelta(seconds=5), 55, total=5000)
    projections.write(job.pk)
    settle.finish(job.pk, Job.State.CANCELLED, "cancelled by alice", exit_code=None)
    assert projections.compare(Job.objects.get(pk=job.pk)) is None

    accuracy = projections.accuracy_of(alice)
    assert accuracy["jobs"] == 3 and accuracy["cost_jobs"] == 3
    assert accuracy["finish_error"] == pytest.approx(sorted(errors)[1])
    assert accuracy["cost_error"] > 0
    en = _said(accuracy["words"], "en")
    assert en.startswith("Over your 3 last compared jobs, projections made at a fifth")
    assert _said(accuracy["words"], "zh-hans").startswith("在您最近 3 个可比较的任务中")
    assert projections.accuracy_of(bob)["jobs"] == 0  # alice's jobs are hers only


# -- a sweep and a pool ---------------------------------------------------------------------


@pytest.fixture
def make_pool(catalog, priced, alice, storage_root, paper_host):
    """A pool of one 1-GPU A100 cluster (at the starting card's ¥7.80 an hour), placed on
    the paper host when a trial is said to have run (`_fill`)."""

    def make(name="train"):
        shape = ClusterSpec(
            name="", nodes=1, gpu_model=catalog["a100-80gb"], gpus_per_node=1,
            image=Image.objects.get(reference=TEST_IMAGE),
        )  # fmt: skip
        pool = autoscaler.pool_create(
            owner=alice, spec=autoscaler.PoolSpec(name=name, cluster=shape)
        )
        return console_pools.refresh(pool)

    return make


def _fill(trial, *, state, steps, seconds):
    """What the trial's reader and its job's end leave: its curve to `steps`, its state,
    its job's run of `seconds`."""
    now = timezone.now()
    curve = [[s, 1.0 / s] for s in range(10, steps + 1, 10)]
    Trial.objects.filter(pk=trial.pk).update(
        state=state, curve=curve, last_step=steps, last_value=curve[-1][1],
        best_value=curve[-1][1],
    )  # fmt: skip
    Job.objects.filter(pk=trial.job_id).update(
        state=Job.State.SUCCEEDED if state == Trial.State.COMPLETE else Job.State.CANCELLED,
        started_at=now - timedelta(seconds=seconds),
        finished_at=now,
    )
    ran(trial.job_id, now - timedelta(seconds=seconds), now)


def _sweep(pool, alice, name):
    spec = sweeps.SweepSpec(
        name=name, command="python train.py", space=sweeps.parse_space("x: uniform 0 1"),
        metric="val_loss", trials=8, parallel=4, min_steps=5,
    )  # fmt: skip
    sweep = sweeps.sweep_create(owner=alice, pool=pool, spec=spec)
    assert sweep.trial_set.count() == 4  # four started, four to come
    return sweep


def test_a_sweep_with_pruned_trials_projects_less_than_one_without(make_pool, alice):
    pruned = _sweep(make_pool("a"), alice, "pruned")
    t0, t1, t2, t3 = pruned.trial_set.order_by("number")
    _fill(t0, state="complete", steps=40, seconds=400)
    _fill(t1, state="complete", steps=40, seconds=400)
    _fill(t2, state="pruned", steps=10, seconds=100)  # a quarter of a full trial
    _fill(t3, state="pruned", steps=20, seconds=200)  # a half
    whole = _sweep(make_pool("b"), alice, "whole")
    for t in whole.trial_set.all():
        _fill(t, state="complete", steps=40, seconds=400)

    a = projections.sweep_projection(pruned)
    b = projections.sweep_projection(whole)

    # A full trial: 400 s at ¥7.80 an hour = ¥0.8667.
    trial = (Decimal("7.80") * 400 / 3600).quantize(Decimal("0.0001"))
    assert a["trial_cost"] == b["trial_cost"] == trial
    assert a["trials_left"] == b["trials_left"] == 4
    # Half the ended trials were pruned, after a quarter and a half of a full run: pruning
    # saves 0.5 x (1 - 0.375) = 31.25 % of a trial.
    assert a["pruned_share"] == 0.5 and a["saving_share"] == pytest.approx(0.3125)
    assert a["remaining"] == (4 * trial * Decimal("0.6875")).quantize(Decimal("0.0001"))
    assert b["saving_share"] == 0 and b["remaining"] == 4 * trial
    assert a["remaining"] < b["remaining"]
    assert a["remaining_low"] <= a["remaining"] <= a["remaining_high"]
    en = _said(a["words"], "en")
    assert en.startswith("4 trials left should cost about ¥2.38 more (")
    assert "pruning is expected to save 31 % of that" in en
    assert _said(a["words"], "zh-hans").startswith("剩余 4 个试验预计还需约 ¥2.38（")


def test_a_running_trial_counts_by_its_own_projection(make_pool, alice, paper_host):
    sweep = _sweep(make_pool(), alice, "running")
    scheduler.place_pending()  # the pool's cluster, on the paper host
    t0, t1, t2, t3 = sweep.trial_set.order_by("number")
    _fill(t0, state="complete", steps=40, seconds=400)
    _fill(t1, state="complete", steps=40, seconds=400)
    _fill(t2, state="pruned", steps=10, seconds=100)
    assert t3.job.cluster.state == "running", t3.job.cluster.state_reason
    started = _now() - timedelta(seconds=600)
    job = _run(Job.objects.select_related("cluster").get(pk=t3.job_id), started)
    _progress(job, started + timedelta(seconds=5), 50, total=5000)
    now = started + timedelta(seconds=600)

    out = projections.sweep_projection(sweep, now=now)

    p = projections.project(Job.objects.get(pk=job.pk), now=now)
    whole = (Decimal("7.80") * 400 / 3600).quantize(Decimal("0.0001"))
    # A third of the ended trials pruned after a quarter of a full run: 25 % saved a trial.
    assert out["saving_share"] == pytest.approx(0.25)
    assert out["running"] == 1 and out["not_started"] == 4 and out["unprojected"] == 0
    trial = (2 * whole + p.cost) / 3
    assert out["trial_cost"] == trial.quantize(Decimal("0.0001"), rounding=ROUND_HALF_UP)
    expected = p.remaining + 4 * trial * Decimal("0.75")
    assert out["remaining"] == expected.quantize(Decimal("0.0001"), rounding=ROUND_HALF_UP)
    assert out["remaining_low"] <= out["remaining"] <= out["remaining_high"]
    assert _said(out["words"], "en").startswith("5 trials left should cost about ")


def test_a_sweep_with_no_trial_ended_yet_says_it_cannot_project(make_pool, alice):
    sweep = _sweep(make_pool(), alice, "fresh")
    out = projections.sweep_projection(sweep)
    # Four running (their jobs wait for a cluster: no progress yet), four to start.
    assert out["remaining"] is None and out["trials_left"] == 8 and out["running"] == 4
    assert out["unprojected"] == 4
    assert _said(out["words"], "en") == (
        "8 trials left; no cost projected yet: no trial has finished or projected its cost yet"
    )


def test_a_pool_sums_its_running_jobs_rests_and_counts_those_without(lab, alice, make_pool):
    pool = make_pool()
    assert _said(projections.pool_projection(pool)["words"], "en") == "No job is running in it"
    started = _now() - timedelta(seconds=600)
    counted = _running(lab, started, name="counted")
    _progress(counted, started + timedelta(seconds=5), 50, total=5000)
    blind = _running(lab, started, name="blind")
    _progress(blind, started + timedelta(seconds=5), 50, total=None)
    Job.objects.filter(pk__in=[counted.pk, blind.pk]).update(pool=pool)
    now = _now()

    out = projections.pool_projection(pool, now=now)

    p = projections.project(Job.objects.get(pk=counted.pk), now=now)
    assert out["running"] == 2 and out["projected"] == 1 and out["unprojected"] == 1
    assert out["remaining"] == p.remaining
    assert out["remaining_low"] <= out["remaining"] <= out["remaining_high"]
    assert _said(out["words"], "en").endswith("running jobs without a projection: 1")


# -- a real job on the engines --------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_real_jobs_projection_at_a_fifth_is_kept_and_compared_with_its_end(
    priced, alice, running_cluster, work_queue
):
    """The live log follower reads the job's lines, the worker runs what it queues (the
    progress reader, then this projection by name): the projection made once a fifth of
    the steps were done is kept, and the job's end is compared with it, within 10 %."""
    follower = Follower(publish=False)
    stop = threading.Event()
    thread = threading.Thread(target=follower.run, kwargs={"until": stop}, daemon=True)
    thread.start()
    try:
        cluster = running_cluster(1)
        job = services.job_submit(cluster=cluster, spec=JobSpec(name="train", command=TRAIN))
        dispatch.dispatch(cluster.pk)
        deadline = time.monotonic() + 120
        while not job.is_ended:
            assert time.monotonic() < deadline, (job.state, progress.points_of(job)[-3:])
            work_queue("default")  # the worker: progress, then billing.tasks.job_projection
            repair.reconcile()  # the watch process's net: the container's end
            time.sleep(0.2)
            job.refresh_from_db()
        time.sleep(livelogs.FLUSH_S * 3)
        work_queue("default")  # the end's full read, then the last projection
        job.refresh_from_db()
    finally:
        stop.set()
        thread.join(10)
    assert job.state == "succeeded", job.state_reason
    early = job.projection_early
    assert early is not None and 0.2 <= early["fraction"] < 0.6, early
    assert Decimal(early["cost_low"]) <= Decimal(early["cost"]) <= Decimal(early["cost_high"])
    assert job.projection_last["ended"] and job.projection_last["compared"]

    c = projections.compare(job)
    spent = projections.project(job).cost_so_far
    print(
        f"early at {early['fraction']:.0%}: finish off by {c['finish_error']:+.1%}, cost "
        f"{c['projected_cost']} projected, {c['cost']} spent ({c['cost_error']:+.1%})"
    )
    assert c["cost"] == spent
    assert abs(c["finish_error"]) <= 0.10
    assert abs(c["cost_error"]) <= 0.10
    assert projections.accuracy_of(alice)["jobs"] == 1

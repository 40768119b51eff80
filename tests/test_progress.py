"""A running job's pace (issue 44, jobs/runs/progress.py): from the steps its rank 0 prints
on SUANLI_METRIC lines, when it will finish, with a range; robust to a slow start and to
checkpoint pauses. A bad total gives words, never a number: on a line, in the job's env at
submit. And a real job on the test engines, read by the live log follower: its finish
projected after a fifth of its steps is within 10 % of its run of when it really ended."""

import json
import os
import random
import re
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError
from django.test import Client
from django.urls import reverse
from django.utils import translation
from test_sweep_pages import form_data, make_pool  # noqa: F401 (a fixture)

from jobs.base import logstore
from jobs.base.text import show
from jobs.base.validators import parse_env
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import Job, JobProgress, Sweep
from jobs.runs import dispatch, livelogs, progress
from jobs.runs.livelogs import Follower

RECORDED = Path(__file__).parent / "data" / "progress_engine_job.json"


def _series(*, steps, per_step, warm=0, warm_s=0.0, every=0, pause=0.0, noise=0.0, seed=1):
    """[seconds, step] points as a job prints them: `warm` slow first steps, a pause of
    `pause` seconds after every `every`-th step, each step's time off by `noise` (relative,
    Gaussian). The clock starts at an arbitrary time."""
    rng = random.Random(seed)  # noqa: S311 (a recorded series, not a secret)
    t = 1_800_000_000.0
    points = [[t, 0]]
    for s in range(1, steps + 1):
        dt = warm_s if s <= warm else per_step * max(1 + rng.gauss(0, noise), 0.05)
        if every and s > warm and s % every == 0:
            dt += pause
        t += dt
        points.append([round(t, 3), s])
    return points


def _job(points, total, state=Job.State.RUNNING, env=None, **fields):
    """An unsaved job with its progress row (its points of its own attempt, or `of`)."""
    of = fields.pop("of", None)
    job = Job(pk=1, state=state, total_steps=total, env=env or {}, **fields)
    job.progress_row = JobProgress(job=job, points=points, attempt=of or job.attempt)
    return job


def _points(job):
    return JobProgress.objects.get(pk=job.pk).points


def _projected_error(points, total, share=0.2):
    """How far the finish projected once `share` of the steps were done is from the
    series' real end, over the series' run time (its first point to its last)."""
    upto = next(i for i, (_t, s) in enumerate(points) if s >= share * total)
    seen = points[: upto + 1]
    now = datetime.fromtimestamp(seen[-1][0], tz=UTC)
    p = progress.pace(_job(seen, total), now=now)
    assert p.ok, p.why
    assert p.finish_low <= p.finish_at <= p.finish_high
    actual = points[-1][0]
    return (p.finish_at.timestamp() - actual) / (actual - points[0][0]), p


SERIES = {
    "steady": dict(steps=2000, per_step=0.4, noise=0.05),
    "slow start": dict(steps=2000, per_step=0.4, warm=20, warm_s=6.0, noise=0.05),
    "first step compiles": dict(steps=1000, per_step=0.25, warm=1, warm_s=90.0, noise=0.03),
    "checkpoint every 50 steps": dict(
        steps=2000, per_step=0.4, warm=10, warm_s=4.0, every=50, pause=12.0, noise=0.05
    ),
    "checkpoint every 100, long pause": dict(
        steps=5000, per_step=0.1, warm=5, warm_s=30.0, every=100, pause=20.0, noise=0.1
    ),
    "noisy": dict(steps=3000, per_step=1.2, warm=3, warm_s=10.0, noise=0.3),
    "noisy with pauses": dict(steps=1000, per_step=0.5, every=25, pause=5.0, noise=0.25),
}


@pytest.mark.parametrize("shape", SERIES, ids=list(SERIES))
def test_the_finish_after_a_fifth_of_the_steps_is_within_10_percent(shape):
    points = _series(**SERIES[shape])
    total = points[-1][1]
    error, p = _projected_error(points, total)
    print(shape, f"{error:+.2%}", f"{p.seconds_per_step:.3f} s/step ±{p.spread:.1%}")
    assert abs(error) <= 0.10, (shape, error)
    assert p.finish_low.timestamp() <= points[-1][0] <= p.finish_high.timestamp()  # in range


def test_pauses_are_counted_not_dropped():
    """A job that checkpoints every 50 steps: the projected finish counts its pauses to
    come; the steady steps alone would finish it far earlier than it does."""
    points = _series(steps=2000, per_step=0.4, every=50, pause=20.0, noise=0.02)
    error, p = _projected_error(points, 2000)
    assert abs(error) <= 0.05
    steady = 0.4 * 2000 / (points[-1][0] - points[0][0]) - 1  # what dropping pauses gives
    assert steady < -0.3
    assert p.seconds_per_step == pytest.approx(0.4 + 20 / 50, rel=0.1)


def test_a_burst_of_stalls_is_not_taken_for_a_period():
    """Three 10 s stalls in a row (a slow disk, once): amortised over the steps so far
    like any pause, never read as a pause every step."""
    points = _series(steps=400, per_step=0.4, noise=0.05)
    for i in range(150, len(points)):
        points[i][0] += 10.0 * min(i - 149, 3)
    p = progress.pace(_job(points, 2000), now=datetime.fromtimestamp(points[-1][0], tz=UTC))
    assert 0.4 < p.seconds_per_step < 0.4 + 30 / 250 * 4 / 3


def test_the_range_holds_the_spread_of_recent_steps():
    even = progress.pace(_job(_series(steps=400, per_step=1.0), 2000))
    noisy = progress.pace(_job(_series(steps=400, per_step=1.0, noise=0.4, seed=3), 2000))
    assert even.spread == pytest.approx(0, abs=1e-9) and even.finish_low == even.finish_high
    assert noisy.spread > 0.01
    assert noisy.finish_low < noisy.finish_at < noisy.finish_high
    assert even.window_steps >= progress.WINDOW_STEPS
    assert even.fraction == pytest.approx(0.2)


def test_a_long_job_keeps_its_recent_points_and_thins_the_old():
    points = _series(steps=10_000, per_step=0.4, every=50, pause=10.0, noise=0.05)
    kept = progress.thinned(points)
    assert len(kept) <= progress.POINTS_MAX
    assert (
        kept[0] == points[0]
        and kept[-progress.POINTS_RECENT :] == points[-progress.POINTS_RECENT :]
    )
    upto = 5000  # the pace from the thinned points, half way, as from all of them
    now = datetime.fromtimestamp(points[upto][0], tz=UTC)
    thin = progress.pace(_job(progress.thinned(points[: upto + 1]), 10_000), now=now)
    full = progress.pace(_job(points[: upto + 1], 10_000), now=now)
    assert thin.seconds_per_step == pytest.approx(full.seconds_per_step, rel=0.02)


def test_a_job_started_again_is_paced_from_its_new_attempt():
    """Preempted at step 300, queued ten minutes, resumed from its checkpoint with a slow
    start: the wait is not a pause of its pace, and its new attempt has its own warm-up."""
    before = _series(steps=300, per_step=0.4, warm=3, warm_s=5.0, noise=0.05)
    restart = before[-1][0] + 600
    after = _series(steps=1700, per_step=0.4, warm=5, warm_s=5.0, noise=0.05, seed=2)
    shift = restart + 20 - after[0][0]  # its first line 20 s after the start
    points = before + [[t + shift, s + 300] for t, s in after[1:]]
    upto = next(i for i, (_t, s) in enumerate(points) if s >= 400)
    now = datetime.fromtimestamp(points[upto][0], tz=UTC)
    again = _job(
        points[: upto + 1], 2000, attempt=2, started_at=datetime.fromtimestamp(restart, UTC)
    )
    p = progress.pace(again, now=now)
    assert p.seconds_per_step == pytest.approx(0.4, rel=0.05)
    error = (p.finish_at.timestamp() - points[-1][0]) / (points[-1][0] - points[0][0])
    assert abs(error) <= 0.10
    early = _job(
        points[: 300 + 12], 2000, attempt=2, started_at=datetime.fromtimestamp(restart, UTC)
    )
    assert progress.pace(early, now=now).seconds_per_step == pytest.approx(0.4, rel=0.1)
    # Taken as one run, the wait would be a pause the rest of the job pays for again.
    once = progress.pace(_job(points[: upto + 1], 2000), now=now)
    assert once.seconds_per_step > 0.8


def test_a_valid_total_too_far_away_gives_words_not_a_date():
    """The largest total a line may declare, at 200 s a step: thousands of years, past
    any date there is. Words that say so, never a number (nor a crash)."""
    points = [[1_800_000_000.0 + i * 200.0, i] for i in range(30)]
    now = datetime.fromtimestamp(points[-1][0], tz=UTC)
    p = progress.pace(_job(points, progress.MAX_TOTAL_STEPS), now=now)
    assert not p.ok and p.finish_at is None and p.finish_low is None and p.finish_high is None
    assert "would be reached in about 13,6" in str(p.why), str(p.why)
    assert "years: check its total of steps" in str(p.why)
    # Within the horizon: a date, as ever.
    assert progress.pace(_job(points, 100_000), now=now).ok


def test_a_few_noisy_intervals_give_a_range_that_brackets_the_end():
    """A job printing every 50 steps of 1000, its intervals ±50 % apart: at step 250 (five
    intervals) the range is wide, never ±0 %, and holds where the series really ends."""
    cycle = [12.9, 13.1, 24.0, 6.2, 19.1]
    t, points = 1_800_000_000.0, [[1_800_000_000.0, 0]]
    for i in range(20):
        t += cycle[i % len(cycle)]
        points.append([round(t, 3), (i + 1) * 50])
    seen = points[:6]
    p = progress.pace(_job(seen, 1000), now=datetime.fromtimestamp(seen[-1][0], tz=UTC))
    assert p.ok and p.spread >= progress.FEW_SPREAD
    assert p.finish_low < p.finish_at < p.finish_high
    assert p.finish_low.timestamp() <= points[-1][0] <= p.finish_high.timestamp()
    # Even regular intervals, so few: a range all the same.
    even = [[1_800_000_000.0 + i * 10.0, i * 50] for i in range(6)]
    p = progress.pace(_job(even, 1000), now=datetime.fromtimestamp(even[-1][0], tz=UTC))
    assert p.spread == pytest.approx(progress.FEW_SPREAD)


def test_a_job_started_again_from_scratch_is_paced_from_its_new_steps():
    """300 steps at 1 s, retried ten minutes later from step 0, now at new step 200: the
    new attempt's points alone (fraction 0.20, not 0.30; the finish 800 s away, not now)."""
    before = [[1_800_000_000.0 + i, i] for i in range(301)]
    restart = before[-1][0] + 600
    after = [[restart + 5 + i, i] for i in range(201)]
    now = datetime.fromtimestamp(after[-1][0], tz=UTC)
    again = _job(after, 1000, attempt=2, started_at=datetime.fromtimestamp(restart, UTC))
    p = progress.pace(again, now=now)
    assert p.fraction == pytest.approx(0.2) and p.step == 200
    assert p.finish_at.timestamp() == pytest.approx(after[-1][0] + 800, rel=1e-6)
    # Started again, nothing from its new attempt yet: words, not the old attempt's pace.
    waiting = _job(before, 1000, attempt=2, started_at=datetime.fromtimestamp(restart, UTC), of=1)
    p = progress.pace(waiting, now=now)
    assert not p.ok and "started again (attempt 2): no step reported by this attempt yet" in str(
        p.why
    )


def test_a_preempted_job_waiting_to_run_again_is_told_so():
    points = _series(steps=50, per_step=1.0)
    p = progress.pace(_job(points, 100, state=Job.State.PREEMPTED))
    assert not p.ok and str(p.why) == "the job was preempted at step 50 and waits to run again"


def test_the_finish_is_never_in_the_past():
    """A job silent for longer than its projected rest (a long pause, a hang): its finish
    is now at the earliest, counted from its newest point."""
    points = _series(steps=100, per_step=1.0)
    late = datetime.fromtimestamp(points[-1][0] + 3600, tz=UTC)
    p = progress.pace(_job(points, 110), now=late)
    assert p.finish_at == late and p.finish_low == late
    on_time = datetime.fromtimestamp(points[-1][0], tz=UTC)
    p = progress.pace(_job(points, 110), now=on_time)
    assert p.finish_at.timestamp() == pytest.approx(points[-1][0] + 10, rel=1e-6)


def test_the_recorded_engine_job():
    """The points a real job on the test engines left (recorded by the engine test below:
    a slow start, a pause every 5 steps, docker's own timestamps)."""
    recorded = json.loads(RECORDED.read_text())
    error, _p = _projected_error(recorded["points"], recorded["total"])
    assert abs(error) <= 0.10, error


@pytest.mark.parametrize(
    "job, words",
    [
        (_job([], 100), "no step reported yet"),
        (_job([[0.0, 0], [1.0, 1]], 100), "too few steps reported yet"),
        (_job(_series(steps=50, per_step=1.0), None), "no total steps declared"),
        (_job(_series(steps=50, per_step=1.0), 50), "step 50 has reached the declared total"),
        (_job(_series(steps=50, per_step=1.0), 20), "total of 20 steps is below step 50"),
        (_job(_series(steps=50, per_step=1.0), 100, Job.State.QUEUED), "not running yet"),
        (_job(_series(steps=50, per_step=1.0), 100, Job.State.SUCCEEDED), "the job has ended"),
    ],
)
def test_no_finish_without_what_it_needs_in_words(job, words):
    p = progress.pace(job)
    assert not p.ok and p.finish_at is None and p.finish_low is None
    assert words in str(p.why)


@pytest.mark.parametrize(
    "value, words",
    [
        ("0", "must be 1 or more, not 0"),
        ("-5", "must be 1 or more, not -5"),
        ("NaN", "must be a whole number of steps, not NaN"),
        ("inf", "must be a whole number of steps, not inf"),
        ("1e4", "must be a whole number of steps, not 1e4"),
        ("2.5", "must be a whole number of steps, not 2.5"),
        ("99999999999", "must be at most 2147483647, not 99999999999"),
        ("many", "must be a whole number of steps, not many"),
        ("", 'must be a whole number of steps, not ""'),
    ],
)
def test_a_bad_total_in_the_env_is_refused_at_submit_in_words(value, words):
    with pytest.raises(
        ValidationError, match=re.escape("SUANLI_TOTAL_STEPS: total steps " + words)
    ):
        parse_env(f"SUANLI_TOTAL_STEPS={value}")
    assert progress.total_steps_problem(value) is not None
    # ...and a job carrying it anyway (an old row) gets the same words, no number.
    p = progress.pace(
        _job(_series(steps=50, per_step=1.0), None, env={"SUANLI_TOTAL_STEPS": value})
    )
    assert not p.ok and words in str(p.why)


def test_a_good_total_in_the_env_is_taken():
    assert parse_env("SUANLI_TOTAL_STEPS=20000\nLR=3e-4") == {
        "SUANLI_TOTAL_STEPS": "20000", "LR": "3e-4",
    }  # fmt: skip
    assert progress.total_steps_problem(" 20000 ") is None
    p = progress.pace(
        _job(_series(steps=50, per_step=1.0), None, env={"SUANLI_TOTAL_STEPS": "100"})
    )
    assert p.ok and p.total == 100 and p.fraction == pytest.approx(0.5)
    with pytest.raises(ValidationError, match="SUANLI_JOB is set by Suanli itself"):
        parse_env("SUANLI_JOB=3")


# -- what observe reads from the kept lines ----------------------------------------------------


def _stamp(seconds: float) -> str:
    whole = int(seconds)
    at = datetime.fromtimestamp(whole, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{at}.{round((seconds - whole) * 1e9):09d}Z"


def _keep(job, lines, *, start=1_800_000_000.0, every=1.0, rank=0):
    """Lines as the live log follower keeps them: "rank<TAB>timestamp text"."""
    texts = [f"{rank}\t{_stamp(start + i * every)} {line}" for i, line in enumerate(lines)]
    logstore.append(
        logstore.connect(), livelogs._key(job.pk), texts, keep=livelogs.LINES_KEPT,
        ttl=600, counter_ttl=600, marks={},
    )  # fmt: skip


@pytest.fixture
def queued_job(make_cluster, alice):
    cluster = make_cluster(alice, "p1")
    return services.job_submit(cluster=cluster, spec=JobSpec(name="train", command="true"))


@pytest.mark.django_db
def test_observe_keeps_rank_0_steps_at_their_line_times(queued_job):
    job = queued_job
    _keep(job, [
        "epoch 1",
        'SUANLI_METRIC {"step": 1, "loss": 2.0, "total_steps": 100}',
        'SUANLI_METRIC {"step": 2, "loss": 1.9}',
        'SUANLI_METRIC {"step": 2, "loss": 1.8}',  # the same step again: the first counts
        'SUANLI_METRIC {"loss": 1.7}',  # no step: a metric only
        "SUANLI_METRIC not json",
        'SUANLI_METRIC {"step": 4}',
    ])  # fmt: skip
    _keep(job, ['SUANLI_METRIC {"step": 50, "total_steps": 1}'], rank=1)  # not rank 0
    assert progress.observe(job.pk) == "3 points"
    job.refresh_from_db()
    t0 = 1_800_000_000.0
    assert _points(job) == [[t0 + 1, 1], [t0 + 2, 2], [t0 + 6, 4]]
    assert job.total_steps == 100 and job.progress_note == ""
    assert progress.observe(job.pk) == "nothing new"
    # Later lines go on from the last one read.
    _keep(job, ['SUANLI_METRIC {"step": 5}'], start=t0 + 10)
    assert progress.observe(job.pk) == "1 points"
    job.refresh_from_db()
    assert _points(job)[-1] == [t0 + 10, 5]


@pytest.mark.django_db
def test_observe_starts_the_points_again_for_a_retry_from_scratch(queued_job):
    """Attempt 1 reached step 300; attempt 2 starts from step 0: its steps are kept (the
    old ones dropped), its pace its own; a full read at its end adds no old line."""
    job = queued_job
    t0 = 1_800_000_000.0
    _keep(job, [f'SUANLI_METRIC {{"step": {i}, "total_steps": 1000}}' for i in range(301)])
    assert progress.observe(job.pk) == "301 points"
    restart = t0 + 900
    Job.objects.filter(pk=job.pk).update(
        attempt=2, state=Job.State.RUNNING, started_at=datetime.fromtimestamp(restart, UTC)
    )
    job.refresh_from_db()
    assert "started again (attempt 2)" in str(progress.pace(job).why)
    _keep(job, [f'SUANLI_METRIC {{"step": {i}}}' for i in range(201)], start=restart + 5)
    assert progress.observe(job.pk) == "201 points"
    job.refresh_from_db()
    kept = _points(job)
    assert kept[0] == [restart + 5, 0] and kept[-1] == [restart + 205, 200] and len(kept) == 201
    now = datetime.fromtimestamp(restart + 205, UTC)
    p = progress.pace(job, now=now)
    assert p.fraction == pytest.approx(0.2)
    assert p.finish_at.timestamp() == pytest.approx(restart + 205 + 800, rel=1e-6)
    progress.observe(job.pk, full=True)  # the job's end: every kept line read again
    assert _points(job) == kept


@pytest.mark.django_db
@pytest.mark.parametrize(
    "total, words",
    [
        ("0", "total steps must be 1 or more, not 0"),
        ("-3", "total steps must be 1 or more, not -3"),
        ("NaN", "total steps must be a whole number of steps, not nan"),
        ("Infinity", "total steps must be a whole number of steps, not inf"),
        ("1e3", "total steps must be a whole number of steps, not 1000.0"),
        ("99.5", "total steps must be a whole number of steps, not 99.5"),
        ("4294967296", "total steps must be at most 2147483647, not 4294967296"),
        ('"20000"', "total steps must be a number, not text (20000)"),
        ("true", "total steps must be a whole number of steps, not True"),
        ("null", "total steps must be a whole number of steps, not None"),
    ],
)
def test_a_bad_total_on_a_line_gives_words_never_a_number(queued_job, total, words):
    job = queued_job
    lines = [f'SUANLI_METRIC {{"step": {i}, "total_steps": 100}}' for i in range(1, 30)]
    lines.append(f'SUANLI_METRIC {{"step": 30, "total_steps": {total}}}')
    _keep(job, lines)
    progress.observe(job.pk)
    Job.objects.filter(pk=job.pk).update(state=Job.State.RUNNING)
    job.refresh_from_db()
    assert _points(job)[-1][1] == 30  # the step is read all the same
    assert job.progress_note == f"log line 30: {words}"
    p = progress.pace(job)
    assert not p.ok and p.finish_at is None and p.finish_high is None
    assert str(p.why) == f"log line 30: {words}"
    # A good total on a later line: the pace again.
    _keep(job, ['SUANLI_METRIC {"step": 31, "total_steps": 120}'], start=1_800_000_030.0)
    progress.observe(job.pk)
    job.refresh_from_db()
    assert job.progress_note == "" and job.total_steps == 120
    assert progress.pace(job).ok


@pytest.mark.django_db
def test_the_words_are_kept_to_be_shown_in_the_readers_language(queued_job):
    _keep(queued_job, [f'SUANLI_METRIC {{"step": {i}, "total_steps": 0}}' for i in (1, 2)])
    progress.observe(queued_job.pk)
    queued_job.refresh_from_db()
    note = queued_job.progress_note_text
    assert note["m"] == progress.TOTAL_NOTE and note["a"]["n"] == 2
    assert note["a"]["why"]["m"] == "total steps must be 1 or more, not %(value)s"
    with translation.override("en"):
        assert show(note) == "log line 2: total steps must be 1 or more, not 0"


@pytest.mark.django_db
def test_the_job_form_and_the_api_refuse_a_bad_total_in_words(make_cluster, alice):
    from console.models import ApiToken

    cluster = make_cluster(alice, "p2")
    client = Client()
    client.force_login(alice)
    form = {
        "name": "train", "command": "echo hi", "launcher": "plain", "workdir": "/workspace",
        "checkpoint_dir": "/workspace/checkpoints", "max_runtime_min": "", "retries": "0",
    }  # fmt: skip
    response = client.post(
        reverse("job_new", args=[cluster.pk]), {**form, "env": "SUANLI_TOTAL_STEPS=0"}
    )
    assert response.status_code == 200
    assert "SUANLI_TOTAL_STEPS: total steps must be 1 or more, not 0" in " ".join(
        response.context["form"].errors["env"]
    )
    _, token = ApiToken.issue(user=alice, name="script")
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
    body = {"cluster": cluster.pk, "name": "train", "command": "echo hi"}
    body["env"] = {"SUANLI_TOTAL_STEPS": "-1"}
    response = api.post("/api/v1/jobs", data=json.dumps(body), content_type="application/json")
    assert response.status_code == 400, response.content
    assert "total steps must be 1 or more, not -1" in json.dumps(response.json())
    assert not Job.objects.exists()
    body["env"] = {"SUANLI_TOTAL_STEPS": "40"}
    response = api.post("/api/v1/jobs", data=json.dumps(body), content_type="application/json")
    assert response.status_code == 201, response.content
    assert Job.objects.get().env == {"SUANLI_TOTAL_STEPS": "40"}


# -- a real job on the engines -----------------------------------------------------------------

STEPS = 100
# Three slow first steps (1.2 s), then 0.2 s a step with a 0.8 s "checkpoint" after every
# 5th: about 38 s. busybox's sh: `sleep` takes fractions.
TRAIN = (
    "i=1; while [ $i -le " + str(STEPS) + " ]; do "
    "if [ $i -le 3 ]; then sleep 1.2; else sleep 0.2; fi; "
    'printf "SUANLI_METRIC {\\"step\\": %d, \\"total_steps\\": ' + str(STEPS) + '}\\n" $i; '
    "if [ $((i % 5)) -eq 0 ]; then sleep 0.8; fi; i=$((i + 1)); done"
)


@pytest.mark.django_db(transaction=True)
def test_a_real_job_finishes_within_10_percent_of_its_projection(
    running_cluster, settle_until, work_queue
):
    follower = Follower(publish=False)
    stop = threading.Event()
    thread = threading.Thread(target=follower.run, kwargs={"until": stop}, daemon=True)
    thread.start()
    try:
        cluster = running_cluster(1)
        job = services.job_submit(cluster=cluster, spec=JobSpec(name="train", command=TRAIN))
        dispatch.dispatch(cluster.pk)
        early = None
        deadline = time.monotonic() + 90
        while early is None:
            assert time.monotonic() < deadline, progress.points_of(job)[-3:]
            work_queue("default")  # the worker: the follower queued jobs.tasks.job_progress
            job.refresh_from_db()
            kept = progress.points_of(job)
            if kept and kept[-1][1] >= STEPS // 5:
                early = progress.pace(job)
            time.sleep(0.2)
        settle_until(job, timeout=90)
        time.sleep(livelogs.FLUSH_S * 3)
        work_queue("default")  # the end's full read (jobs.tasks.job_progress_ended)
        job.refresh_from_db()
    finally:
        stop.set()
        thread.join(10)
    assert job.state == "succeeded", job.state_reason
    assert early.ok, early.why
    assert early.total == STEPS and early.step >= STEPS // 5
    kept = progress.points_of(job)
    assert kept[-1][1] == STEPS  # every step, to the last
    first_at = kept[0][0]
    ran = job.finished_at.timestamp() - first_at
    error = (early.finish_at.timestamp() - job.finished_at.timestamp()) / ran
    print(
        f"step {early.step}: {early.seconds_per_step:.3f} s/step ±{early.spread:.1%}, "
        f"projected {early.finish_at:%H:%M:%S.%f}, ended {job.finished_at:%H:%M:%S.%f}, "
        f"error {error:+.1%} of {ran:.1f} s"
    )
    assert abs(error) <= 0.10
    # ...and what it said at exactly a fifth (its points then, the time then): as good.
    upto = next(i for i, (_t, s) in enumerate(kept) if s >= STEPS // 5)
    then = datetime.fromtimestamp(kept[upto][0], tz=UTC)
    fifth = progress.pace(_job(kept[: upto + 1], STEPS), now=then)
    assert abs(fifth.finish_at.timestamp() - job.finished_at.timestamp()) <= 0.10 * ran
    if os.environ.get("SUANLI_RECORD_PROGRESS"):  # the unit test above replays these points
        RECORDED.write_text(json.dumps({"total": STEPS, "points": kept}) + "\n")


@pytest.mark.django_db
def test_the_sweep_form_refuses_a_bad_total_in_words(make_pool, alice):  # noqa: F811
    client = Client()
    client.force_login(alice)
    pool = make_pool()
    response = client.post("/sweeps/new/", form_data(pool, env="SUANLI_TOTAL_STEPS=1.5"))
    assert response.status_code == 200
    assert "SUANLI_TOTAL_STEPS: total steps must be a whole number of steps, not 1.5" in " ".join(
        response.context["form"].errors["env"]
    )
    response = client.post("/sweeps/new/", form_data(pool, env="SUANLI_TOTAL_STEPS=400"))
    assert response.status_code == 302
    sweep = Sweep.objects.get()
    assert sweep.env == {"SUANLI_TOTAL_STEPS": "400"}
    assert all(t.job.env["SUANLI_TOTAL_STEPS"] == "400" for t in sweep.trial_set.all())

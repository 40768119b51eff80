"""A running job's progress and pace (issue 44): when will it finish?

A job reports its progress by printing

    SUANLI_METRIC {"step": 100, "total_steps": 20000, "loss": 0.41}

lines (the sweeps' marker, jobs/pools/sweeps.py; any other keys are the sweeps' business)
and may state its total in its environment instead (`SUANLI_TOTAL_STEPS=20000`). The live
log follower (livelogs.py) queues `observe` when it keeps such a line; `observe` reads rank
0's new lines, keeps `[unix seconds, step]` points on the job (each at the container's own
timestamp of its line, so a late read does not slow the pace) and queues the cost
projection above us ("billing.tasks.job_projection", by name). `pace` says when the job
will finish, with a range, or in words why it cannot.

The estimator (time only: no money here). From the points, consecutive pairs make
intervals of `ds` steps in `dt` seconds, a rate of `dt / ds` seconds a step.

1. Warm-up: the leading intervals slower than WARM_FACTOR x the typical rate (the median
   over all intervals, weighted by steps) are dropped (a first step that compiles, loads
   data, fills caches). What is left is the history H.
2. Base rate: the median rate of the newest intervals of H (the window: at least
   WINDOW_STEPS steps, WINDOW_SECONDS seconds and WINDOW_INTERVALS intervals, else all of H),
   weighted by steps. A median ignores the odd slow interval, so a checkpoint pause does not
   move it, and it follows a job that speeds up or slows down.
3. Pauses, amortised: H's mean rate less H's median rate is the time the job spends
   beyond its steady pace (checkpoint saves, evaluations, the odd stall) spread over every
   step. It is added to the base rate, so a job that pauses every N steps gets its pauses
   counted in its finish wherever the window falls in the cycle (dropping them would be
   optimistic; counting them only in the window would swing with where the window ends).
   The pauses proper (intervals over PAUSE_FACTOR x the median), three or more of them,
   are counted by their spacing (mean length / mean spacing), not by how many fell in H:
   H cut between two pauses holds one too few. That correction is held within one pause
   more or less than counted (a burst of stalls is not a period).
4. The finish: the newest point's time + remaining steps x (base + pauses). Never in the
   past: a job silent since its newest point (a long pause) finishes no earlier than now.
5. A job started again (a retry, after a preemption; Job.started_at of its attempt):
   the new attempt's points alone once it has more than WINDOW_INTERVALS; until then all,
   without the interval across the restart (queued, not paused) nor the new attempt's
   slow start (by the old attempt's pace).
6. The range: the window is cut into SUB_WINDOWS runs of steps, each as if it were the
   rest of the job. Half the range is the larger of: half the spread of the runs' median
   rates (the steady pace drifting), and half the spread of their mean rates (pauses and
   noise included) shrunk by sqrt(run's steps / steps left), since a long rest averages
   many runs' ups and downs. `spread` is that half over the estimate (0.04 = ±4 %).
   Too few intervals for two runs: half the spread of the intervals' own rates, and at
   least FEW_SPREAD (never a ±0 % range when there is least to go on).
7. A finish past HORIZON_S (5 years; a valid total at a slow pace may lie past any date)
   is no date: `why` says how many years, and to check the total.
8. A newer attempt whose first step is not above the last kept one (a retry from scratch,
   an older checkpoint) starts the points again (JobProgress.attempt); until it reports a
   step, `why` says it started again.

The points live in their own row (jobs.models.JobProgress, one-to-one with the job): job
lists never load them; `points_of(job)` reads them (one query) where a pace is worked out.

What is measured in tests/test_progress.py: recorded series (a slow start, a pause every N
steps, noise) and a real job on the test engines, the finish projected after 20 % of the
steps within 10 % of the job's run time of the actual end.

A bad total (0, negative, NaN, infinite, a fraction, above MAX_TOTAL_STEPS, text, not
above the current step) gives no number: `Pace.why` says why in words, and the same words
refuse SUANLI_TOTAL_STEPS at submit (jobs/base/validators.py parse_env).

Layer: runs; uses runs (livelogs), placement (fleet), models and base (text, queue,
validators)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from datetime import UTC, datetime

import redis
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext_noop

from jobs.base.queue import enqueue_unique
from jobs.base.text import Text, load, twin_fields
from jobs.base.validators import MAX_STEP, MAX_TOTAL_STEPS, TOTAL_STEPS_ENV, total_steps_problem
from jobs.models import Job, JobProgress
from jobs.placement import fleet
from jobs.runs import livelogs

log = logging.getLogger(__name__)

__all__ = [
    "MAX_TOTAL_STEPS", "POINTS_MAX", "TOTAL_STEPS_ENV", "MetricLineError", "Pace", "metric_line",
    "observe", "pace", "rate_of", "total_steps_problem",
]  # fmt: skip

MARKER = "SUANLI_METRIC"
LINE_MAX = 2000  # a metric line longer than this is not read
POINTS_MAX = 2000  # Job.progress: beyond this, every other older point is dropped...
POINTS_RECENT = 500  # ...but for the newest, kept as they came
PROJECTION_TASK = "billing.tasks.job_projection"  # above jobs: queued by name

WARM_FACTOR = 1.5  # a leading interval this much slower than the typical one is warm-up
WINDOW_STEPS = 200  # the pace is from at least this many recent steps...
WINDOW_SECONDS = 120.0  # ...over at least this long...
WINDOW_INTERVALS = 12  # ...and this many intervals (or the whole history, when shorter)
MIN_INTERVALS = 3  # fewer intervals after the warm-up: too few to say
PAUSE_FACTOR = 3.0  # an interval this much slower than the median is a pause
SUB_WINDOWS = 4  # the range: the window's runs, each as if it were the rest of the job
SUB_WINDOW_INTERVALS = 3  # ...each of at least this many intervals (a median of one is noise)
FEW_SPREAD = 0.10  # too few intervals for runs: the range is at least this (±10 %)
HORIZON_S = 5 * 365.25 * 86400  # a finish further away than this (5 years): words, no date

# The notes observe writes on the job (progress_note): a bad total stops the projection
# until a line gives a good one; a bad step only skips its line.
TOTAL_NOTE = gettext_noop("log line %(n)s: %(why)s")
STEP_NOTE = gettext_noop("log line %(n)s: %(why)s (the line's step is skipped)")


# -- the line -----------------------------------------------------------------------------------


class MetricLineError(ValueError):
    pass


def _no_constant(name):
    raise ValueError(name)


def _constant(name):
    return float(name)  # NaN, Infinity, -Infinity: read, for the words that refuse them


def metric_line(text: str, *, constants: bool = False) -> dict | None:
    """The JSON object of a `SUANLI_METRIC {...}` line; None when the line has no marker;
    MetricLineError with a sentence (a msgid) when it is malformed. `constants`: NaN and
    Infinity are read as floats (else the line is not JSON). The one reader of the line:
    sweeps (jobs/pools/sweeps.py parse_metric_line) and progress both use it."""
    at = text.find(MARKER + " ")
    if at < 0:
        return None
    body = text[at + len(MARKER) + 1 :].strip()
    if len(body) > LINE_MAX:
        raise MetricLineError(gettext_noop("the line is too long"))
    try:
        data = json.loads(body, parse_constant=_constant if constants else _no_constant)
    except (ValueError, RecursionError):
        raise MetricLineError(gettext_noop("not a JSON object after SUANLI_METRIC")) from None
    if not isinstance(data, dict):
        raise MetricLineError(gettext_noop("not a JSON object after SUANLI_METRIC"))
    return data


def step_problem(step) -> str | None:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        return gettext_noop('"step" must be a whole number from 0 to 2147483647')
    return None


# -- reading the lines --------------------------------------------------------------------------


@dataclass
class _Read:
    points: list
    seq: int
    total: int | None = None
    note: tuple | None = None  # (msgid, n, why): the newest problem; ("",) clears


def _read(job: Job, lines: list, floor: int, last_step: int, after: float | None) -> _Read:
    read = _Read(points=[], seq=floor)
    for number, payload in lines:
        if number <= floor:
            continue
        read.seq = max(read.seq, number)
        rank, _tab, rest = payload.partition("\t")
        if rank != "0" or MARKER not in rest:
            continue
        ts, text = fleet.split_log_line(rest)
        try:
            data = metric_line(text, constants=True)
        except MetricLineError:
            continue  # the sweep's reader says so on a trial; a job's progress skips it
        if data is None:
            continue
        if "total_steps" in data:
            why = total_steps_problem(data["total_steps"], text=False)
            if why is None:
                read.total, read.note = data["total_steps"], ("",)
            else:
                read.note = (TOTAL_NOTE, number, why)
        if "step" not in data:
            continue
        why = step_problem(data["step"])
        if why is not None:
            if read.note is None or read.note[0] != TOTAL_NOTE:
                read.note = (STEP_NOTE, number, Text(why))
            continue
        at = livelogs.ts_ns(ts)
        if at is None or data["step"] <= last_step:
            continue  # a step already read (or out of order): the first one counts
        if after is not None and at / 1e9 < after:
            continue  # before the newest point kept (or this attempt): an older attempt's
        read.points.append([round(at / 1e9, 3), data["step"]])
        last_step = data["step"]
    return read


def thinned(points: list) -> list:
    """At most POINTS_MAX points: the first, every other one of the older ones, and the
    newest POINTS_RECENT as they were (the pace's window stays step by step)."""
    while len(points) > POINTS_MAX:
        points = points[:1] + points[1:-POINTS_RECENT:2] + points[-POINTS_RECENT:]
    return points


def points_of(job: Job) -> list:
    """The job's progress points ([[unix seconds, step], ...]): one query, its own row."""
    try:
        return job.progress_row.points or []
    except JobProgress.DoesNotExist:
        return []


def _attempt_of(job: Job) -> int:
    """The attempt the job's kept points are from (its own attempt when it has none)."""
    try:
        return job.progress_row.attempt
    except JobProgress.DoesNotExist:
        return job.attempt


def observe(job_id: int, *, full: bool = False) -> str:
    """Read the job's new SUANLI_METRIC lines (rank 0's) into its progress, then queue its
    cost projection. `full`: every kept line, not only those after the last one read (at
    the job's end; a step already kept is skipped either way). A newer attempt that starts
    its steps again (a retry from scratch, a preemption without a checkpoint) starts the
    points again: the pace is its own."""
    with transaction.atomic():
        job = Job.objects.select_for_update(of=("self",)).filter(pk=job_id).first()
        if job is None:
            return "no such job"
        row, _new = JobProgress.objects.get_or_create(job=job, defaults={"attempt": job.attempt})
        lines = livelogs.lines(job)
        points = row.points or []
        again = job.attempt > row.attempt  # a newer attempt than the points'
        top = max((number for number, _payload in lines), default=0)
        floor = 0 if full or top < row.seq else row.seq
        if again:
            # Its steps may start again from 0: read them afresh, its own lines only (all
            # of them at the job's end: those after the attempt started).
            last = -1
            after = job.started_at.timestamp() if full and job.started_at else None
        else:
            last = points[-1][1] if points else -1
            after = points[-1][0] if points else None
        read = _read(job, lines, floor, last, after)
        if not read.points and read.note is None and read.total is None and read.seq <= floor:
            nothing = True
        else:
            nothing = False
            fields = {"seq": max(read.seq, 0)}
            new = read.points
            if again and new:
                fields["attempt"] = job.attempt
                if points and new[0][1] <= points[-1][1]:
                    points = []  # started again from scratch (or an older checkpoint)
            fields["points"] = thinned(points + new)
            JobProgress.objects.filter(pk=job.pk).update(**fields)
            job_fields = {}
            if read.total is not None:
                job_fields["total_steps"] = read.total
            if read.note == ("",):
                if job.progress_note_text and job.progress_note_text.get("m") == TOTAL_NOTE:
                    job_fields.update(twin_fields(Job, "progress_note", ""))
            elif read.note is not None:
                msgid, n, why = read.note
                job_fields.update(twin_fields(Job, "progress_note", Text(msgid, n=n, why=why)))
            if job_fields:
                Job.objects.filter(pk=job_id).update(**job_fields)
    if nothing:
        if full:
            _project(job_id)  # the job's end: its projection's last word all the same
        return "nothing new"
    _project(job_id)
    return f"{len(new)} points"


def _project(job_id: int) -> None:
    """Queue the job's cost projection (billing, above jobs: by name)."""
    try:
        enqueue_unique(
            "default", PROJECTION_TASK, job_id, job_id=f"projection-{job_id}",
            again_if_running=True,
        )  # fmt: skip
    except redis.RedisError as exc:
        log.warning("job %s: projection not queued: %s", job_id, exc)


# -- the pace -----------------------------------------------------------------------------------


@dataclass
class Pace:
    job_id: int
    step: int | None  # newest step reported
    total: int | None  # declared total (Job.total_steps, else SUANLI_TOTAL_STEPS)
    why: Text | None  # set when no finish can be projected: the words
    seconds_per_step: float | None
    spread: float | None  # relative, 0.04 = ±4 %
    window_steps: int  # how many recent steps the pace is from
    last_at: datetime | None  # time of the newest point
    finish_at: datetime | None  # projected end
    finish_low: datetime | None  # earliest of the range
    finish_high: datetime | None
    fraction: float | None  # step / total

    @property
    def ok(self) -> bool:
        return self.finish_at is not None


@dataclass
class Rate:
    """What the points say: seconds a step (base + pauses), the range's slowest and
    fastest, and how many recent steps the base is from."""

    seconds_per_step: float
    low: float  # the range's fastest
    high: float  # its slowest
    window_steps: int
    pauses: float  # seconds a step beyond the steady pace (amortised pauses)


def _median(rates: list[tuple[float, float]]) -> float:
    """Median of (rate, weight) pairs, weighted."""
    ordered = sorted(rates)
    half = sum(w for _r, w in ordered) / 2
    seen = 0.0
    for rate, weight in ordered:
        seen += weight
        if seen >= half:
            return rate
    return ordered[-1][0]


def _intervals(points: list) -> list[tuple[float, int, int, float]]:
    """(seconds, steps, the step it ends at, when it starts) between consecutive points."""
    return [
        (max(t1 - t0, 0.0), s1 - s0, s1, t0)
        for (t0, s0), (t1, s1) in zip(points, points[1:], strict=False)
        if s1 > s0
    ]


def _rates(intervals) -> list[tuple[float, int]]:
    return [(i[0] / i[1], i[1]) for i in intervals]


def _after_warm_up(intervals: list) -> list:
    """The intervals from the first one no slower than WARM_FACTOR x the typical (at
    most half of them are warm-up)."""
    typical = _median(_rates(intervals))
    start = 0
    while start < len(intervals) // 2 and intervals[start][0] > (
        WARM_FACTOR * typical * intervals[start][1]
    ):
        start += 1
    return intervals[start:]


def _pauses(history: list) -> float:
    """Seconds a step the job spends beyond its steady pace (its median), its pauses
    amortised. The time beyond the median over the history's steps, but for the pauses
    proper (intervals over PAUSE_FACTOR x the median): with three or more of them, their
    mean length over their mean spacing, so a history cut between two pauses does not
    count one too few (with two, half of each); within one pause more or less than
    counted."""
    typical = _median(_rates(history))
    seconds = sum(i[0] for i in history)
    steps = sum(i[1] for i in history)
    beyond = max(seconds / steps - typical, 0.0)
    pauses = [
        (dt - ds * typical, end) for dt, ds, end, _at in history if dt > PAUSE_FACTOR * typical * ds
    ]
    if len(pauses) < 2 or pauses[-1][1] <= pauses[0][1]:
        return beyond
    n = len(pauses)
    excess = sum(extra for extra, _end in pauses)
    spaced = excess / n * (n - 1) / (pauses[-1][1] - pauses[0][1])
    counted = excess / steps
    if n == 2:
        spaced = (spaced + counted) / 2
    # A history cut anywhere holds one pause more or less than its share: no more than
    # that (pauses close together, a burst of stalls, are not a period).
    spaced = min(max(spaced, counted * (n - 1) / n), counted * (n + 1) / n)
    return max(beyond - counted + spaced, 0.0)


def _window(history: list) -> list:
    """The newest intervals: at least WINDOW_STEPS steps, WINDOW_SECONDS seconds and
    WINDOW_INTERVALS intervals (or the whole history)."""
    window, steps, seconds = [], 0, 0.0
    for interval in reversed(history):
        window.append(interval)
        steps += interval[1]
        seconds += interval[0]
        if steps >= WINDOW_STEPS and seconds >= WINDOW_SECONDS and len(window) >= WINDOW_INTERVALS:
            break
    window.reverse()
    return window


def _half_range(window: list, per_step: float, left: int | None) -> float:
    """Half the range of the rest's seconds a step. The window's runs, each as if it
    were the rest of the job: their steady paces (medians: the pace drifting), and their
    mean paces, pauses and all, shrunk as the rest is longer than a run (a long rest
    averages its runs' ups and downs: by the square root of how many runs it holds)."""
    size = max(len(window) // SUB_WINDOWS, SUB_WINDOW_INTERVALS)
    runs = [window[i : i + size] for i in range(0, len(window), size)]
    if len(runs) > 1 and len(runs[-1]) < size:
        runs[-2:] = [runs[-2] + runs[-1]]
    if len(runs) < 2:
        # Too few intervals to cut into runs: the spread of the intervals themselves (the
        # rest may be any of them), and never less than FEW_SPREAD: early, a range of 0
        # would claim a certainty there is least ground for.
        rates = [i[0] / i[1] for i in window]
        return max((max(rates) - min(rates)) / 2, FEW_SPREAD * per_step)
    steady = [_median(_rates(run)) for run in runs]
    means = [sum(i[0] for i in run) / sum(i[1] for i in run) for run in runs]
    run_steps = sum(i[1] for i in window) / len(runs)
    shrink = min(1.0, math.sqrt(run_steps / left)) if left else 1.0
    return max((max(steady) - min(steady)) / 2, (max(means) - min(means)) / 2 * shrink)


def _this_attempt(points: list, restarted_at: float | None) -> list:
    """The intervals the pace is from. A job started again (a retry, after a preemption)
    at `restarted_at`: its new attempt's alone once they are enough (a new warm-up, maybe
    another host); until then, all but the one across the restart (queued, not paused)."""
    if restarted_at is None or not points or points[-1][0] < restarted_at:
        return _intervals(points)
    since = [p for p in points if p[0] >= restarted_at]
    if len(since) > WINDOW_INTERVALS:
        return _intervals(since)
    before = _intervals([p for p in points if p[0] < restarted_at])
    again = _intervals(since)
    if before:  # the new attempt's slow start, by the old one's pace
        typical = _median(_rates(before))
        while again and again[0][0] > WARM_FACTOR * typical * again[0][1]:
            again = again[1:]
    return before + again


def rate_of(
    points: list, left: int | None = None, *, restarted_at: float | None = None
) -> Rate | None:
    """The pace of `points` ([seconds, step], steps rising), as the module's docstring says,
    its range for `left` more steps; None when too few are left after the warm-up."""
    intervals = _this_attempt(points, restarted_at)
    if len(intervals) < MIN_INTERVALS:
        return None
    history = _after_warm_up(intervals)
    if len(history) < MIN_INTERVALS:
        return None
    window = _window(history)
    per_step = _median(_rates(window)) + _pauses(history)
    half = _half_range(window, per_step, left)
    return Rate(
        seconds_per_step=per_step,
        low=max(per_step - half, 0.0),
        high=per_step + half,
        window_steps=sum(i[1] for i in window),
        pauses=per_step - _median(_rates(window)),
    )


def declared_total(job: Job) -> tuple[int | None, Text | None]:
    """The job's total and, when there is none to use, why: a line's newest total (a bad
    one stops the projection, in its words), else SUANLI_TOTAL_STEPS in its env."""
    note = job.progress_note_text
    if note and note.get("m") == TOTAL_NOTE:
        return None, load(note)
    if job.total_steps is not None:
        return job.total_steps, None
    raw = (job.env or {}).get(TOTAL_STEPS_ENV)
    if raw is None:
        return None, Text(
            gettext_noop(
                'no total steps declared (a "total_steps" on its SUANLI_METRIC lines, or '
                "SUANLI_TOTAL_STEPS in its environment)"
            )
        )
    why = total_steps_problem(raw)
    if why is not None:
        return None, Text(gettext_noop("SUANLI_TOTAL_STEPS: %(why)s"), why=why)
    return int(raw.strip()), None


def _why_not(
    job: Job, step: int | None, total: int, rate: Rate | None, *, again: bool = False
) -> Text | None:
    """Why a job with a usable total gets no finish, in words; None when it gets one."""
    if step is None:
        return Text(gettext_noop('no step reported yet (SUANLI_METRIC lines with a "step")'))
    if total == step:
        return Text(
            gettext_noop("step %(step)s has reached the declared total of %(total)s steps"),
            step=step, total=total,
        )  # fmt: skip
    if total < step:
        return Text(
            gettext_noop("the declared total of %(total)s steps is below step %(step)s, already reported"),
            step=step, total=total,
        )  # fmt: skip
    if job.state not in Job.ACTIVE:
        if job.is_ended:
            return Text(gettext_noop("the job has ended"))
        if job.state == Job.State.PREEMPTED:
            return Text(
                gettext_noop("the job was preempted at step %(step)s and waits to run again"),
                step=step,
            )
        return Text(gettext_noop("the job is not running yet"))
    if again:
        return Text(
            gettext_noop(
                "started again (attempt %(attempt)s): no step reported by this attempt yet "
                "(step %(step)s before)"
            ),
            attempt=job.attempt, step=step,
        )  # fmt: skip
    if rate is None:
        return Text(
            gettext_noop("too few steps reported yet to measure the pace (step %(step)s)"),
            step=step,
        )
    return None


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def pace(job: Job, *, now: datetime | None = None) -> Pace:
    """When `job` will finish, from its progress; or in `why`, why it cannot be said."""
    now = now or timezone.now()
    points = points_of(job)
    # A newer attempt than its points' has reported no step yet: they are not its pace.
    again = bool(points) and job.attempt > _attempt_of(job)
    step = points[-1][1] if points else None
    last_at = _at(points[-1][0]) if points else None
    total, why = declared_total(job)
    result = Pace(
        job_id=job.pk, step=step, total=total, why=why, seconds_per_step=None, spread=None,
        window_steps=0, last_at=last_at, finish_at=None, finish_low=None, finish_high=None,
        fraction=None,
    )  # fmt: skip
    if total is not None and step is not None:
        result.fraction = min(step / total, 1.0)
    left = total - step if total is not None and step is not None and total > step else None
    restarted_at = job.started_at.timestamp() if job.attempt > 1 and job.started_at else None
    rate = None if again else rate_of(points, left, restarted_at=restarted_at)
    if rate is not None:
        result.seconds_per_step = rate.seconds_per_step
        result.window_steps = rate.window_steps
        result.spread = (
            (rate.high - rate.low) / 2 / rate.seconds_per_step if rate.seconds_per_step else 0.0
        )
    result.why = why or _why_not(job, step, total, rate, again=again)
    if result.why is not None:
        return result
    base = points[-1][0]
    floor = now.timestamp()
    # In seconds first: a valid total at a slow pace may lie past any date there is.
    rest = left * rate.high
    if not math.isfinite(rest) or base + rest - floor > HORIZON_S:
        years = (base + rest - floor) / (365.25 * 86400) if math.isfinite(rest) else math.inf
        result.why = Text(
            gettext_noop(
                "at this pace (%(per_step)s s a step) step %(total)s would be reached in "
                "about %(years)s years: check its total of steps"
            ),
            per_step=f"{rate.seconds_per_step:.3g}", total=total,
            years=f"{years:,.0f}" if math.isfinite(years) else "∞",
        )  # fmt: skip
        return result

    def finish(per_step: float) -> datetime:
        return _at(max(base + left * per_step, floor))

    result.finish_at = finish(rate.seconds_per_step)
    result.finish_low = finish(rate.low)
    result.finish_high = finish(rate.high)
    return result

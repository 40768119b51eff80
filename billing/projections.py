"""What a running job will cost: its pace (jobs.runs.progress: when its steps should reach
the total it declared, with a range) priced at its cluster's price (billing.estimates, the
one price computation), added to what its runs cost so far, and said in words.

- `project(job)`: a job's `Projection` now; `snapshot()` its JSON (Job.projection_last and
  projection_early, the API).
- `write(job_id)` (the task `billing.tasks.job_projection`, queued by name from jobs each
  time its progress is read, and once more at its end): keeps the newest projection, the
  first one made at a fifth of its steps or more (never overwritten: what the job's end is
  compared with), and at the end the comparison (`compare`); then lets the budget judge
  it (billing.budgets.check_job).
- `accuracy_of(user)`: how good a researcher's projections were (the billing page).
- `sweep_projection(sweep)`, `pool_projection(pool)`: what a sweep's trials left and a
  pool's running jobs should still cost.

Money is Decimal end to end: the cost so far is `billing.estimates.cost_of` over the job's
attempts (`jobs.events.webhooks.runs`, as its end event prices them) and the rest is the
same function over the seconds from now to the projected finish (the rate card in force
then, spot discount and all), each rounded once to the smallest unit. Only the pace's
fraction and the shares of a sweep are floats, never an amount.

Reads jobs' tables and jobs.runs.progress / jobs.pools.sweeps; writes only the job's two
projection fields.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.db.models import prefetch_related_objects
from django.utils import timezone
from django.utils.translation import gettext_noop

from billing import budgets, estimates, formatting
from billing.pricing import RateBook, per_hour_of
from jobs.base.text import Duration, Moment, Text, load
from jobs.events.webhooks import runs, runs_of
from jobs.models import Job, Pool, Sweep, Trial
from jobs.pools import sweeps
from jobs.runs.progress import Pace, pace

log = logging.getLogger(__name__)

EARLY_FRACTION = 0.20  # the projection kept to compare with the end: at a fifth of the steps
ACCURACY_JOBS = 200  # a researcher's newest compared jobs that their accuracy is taken over
ZERO = Decimal(0)

# -- the words ------------------------------------------------------------------------------

PROJECTED = gettext_noop(
    "At the pace of the last %(steps)s steps (%(per_step)s s/step ± %(spread)s %%), it "
    "should finish at %(finish)s (%(early)s to %(late)s) and cost about %(cost)s "
    "(%(low)s to %(high)s); %(so_far)s spent so far"
)
PROJECTED_NO_PRICE = gettext_noop(
    "At the pace of the last %(steps)s steps (%(per_step)s s/step ± %(spread)s %%), it "
    "should finish at %(finish)s (%(early)s to %(late)s); no cost projected: the rate card "
    "has no price for its cluster"
)
SO_FAR = gettext_noop("Ran %(elapsed)s so far, %(cost)s spent; no finish projected: %(why)s")
SO_FAR_NO_PRICE = gettext_noop(
    "Ran %(elapsed)s so far (the rate card has no price for its cluster); no finish "
    "projected: %(why)s"
)
ENDED = gettext_noop("Ran %(elapsed)s, cost about %(cost)s")
ENDED_NO_PRICE = gettext_noop("Ran %(elapsed)s (the rate card has no price for its cluster)")
NO_WHY = gettext_noop("its progress gives no finish yet")
COMPARED = gettext_noop(
    "Projected at %(percent)s %% of its steps: finish %(projected_finish)s, cost "
    "%(projected_cost)s; it finished at %(finish)s and cost %(cost)s (finish time off by "
    "%(finish_error)s %%, cost by %(cost_error)s %%)"
)
COMPARED_NO_COST = gettext_noop(
    "Projected at %(percent)s %% of its steps: finish %(projected_finish)s; it finished at "
    "%(finish)s (off by %(finish_error)s %% of its run time)"
)
ACCURACY = gettext_noop(
    "Over your %(jobs)s last compared jobs, projections made at a fifth of the steps were "
    "off by a median %(finish_error)s %% in finish time and %(cost_error)s %% in cost"
)
ACCURACY_NO_COST = gettext_noop(
    "Over your %(jobs)s last compared jobs, projections made at a fifth of the steps were "
    "off by a median %(finish_error)s %% in finish time"
)
ACCURACY_NONE = gettext_noop(
    "No finished job of yours has a projection to compare yet: a job that reports its steps "
    "and its total gets one once a fifth of its steps are done"
)
SWEEP_PROJECTED = gettext_noop(
    "%(trials)s trials left should cost about %(cost)s more (%(low)s to %(high)s): a whole "
    "trial costs about %(trial)s, and pruning is expected to save %(saving)s %% of that, "
    "from the trials so far"
)
SWEEP_NONE = gettext_noop("%(trials)s trials left; no cost projected yet: %(why)s")
SWEEP_NO_TRIAL = gettext_noop("no trial has finished or projected its cost yet")
SWEEP_DONE = gettext_noop("No trial left to run")
POOL_PROJECTED = gettext_noop(
    "Its running jobs should cost about %(cost)s more (%(low)s to %(high)s); running jobs "
    "without a projection: %(none)s"
)
POOL_NONE = gettext_noop("None of its %(running)s running jobs has a projection yet")
POOL_IDLE = gettext_noop("No job is running in it")
# Its waiting jobs have no pace yet: named, not priced.
POOL_QUEUED = gettext_noop("%(said)s; %(queued)s queued jobs not counted")


def _number(value: float) -> str:
    """Seconds per step as a person reads them: 3 significant figures, no exponent."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 0.1:
        return f"{value:.2f}"
    return f"{value:.3g}" if value >= 0.001 else f"{value:.6f}"


def percent(share: float | None) -> str:
    """0.0412 -> "4.1", 0.62 -> "62"."""
    if share is None:
        return "—"
    value = share * 100
    return f"{value:.0f}" if abs(value) >= 10 or value == 0 else f"{value:.1f}"


def signed(share: float) -> str:
    """An error as a signed percentage: "+3.1", "-12"."""
    shown = percent(abs(share))
    return f"-{shown}" if share < 0 and shown not in ("0", "0.0") else f"+{shown}"


def _range_fmt(low: datetime, high: datetime) -> str:
    """The range's ends by the hour when they lie within half a day of each other."""
    return "%H:%M" if high - low < timedelta(hours=12) else ""


# -- a job ----------------------------------------------------------------------------------


@dataclass
class Projection:
    pace: Pace
    currency: str
    cost_so_far: Decimal | None  # billing.estimates over the job's attempts so far
    per_hour: Decimal | None  # its cluster's price per hour now (units x rate)
    cost: Decimal | None  # projected final cost (None: pace not ok, or no price)
    cost_low: Decimal | None
    cost_high: Decimal | None
    budget: Decimal | None  # job.budget
    budget_fraction: float | None  # share of the steps done when the budget is reached
    words: Text
    at: datetime | None = None  # when it was made
    elapsed_s: int = 0  # its attempts' run time so far
    ended: bool = False

    @property
    def remaining(self) -> Decimal | None:
        """What it should still cost."""
        if self.cost is None or self.cost_so_far is None:
            return None
        return self.cost - self.cost_so_far

    @property
    def budget_words(self) -> Text | None:
        """The budget's early warning in its own words (billing.budgets.WARNING: "At its
        current pace it stops at its budget ¥50.00, about 62 % done (projected cost
        ¥80.00)"), when the projection passes its budget; else None."""
        if self.budget_fraction is None or self.budget is None:
            return None
        return Text(
            budgets.WARNING,
            budget=formatting.total_text(self.budget, self.currency),
            done=f"{max(0, min(100, round(self.budget_fraction * 100)))} %",
            cost=formatting.total_text(self.cost, self.currency),
        )


def project(
    job: Job,
    *,
    now: datetime | None = None,
    book: RateBook | None = None,
    spans: list[tuple] | None = None,
) -> Projection:
    """`job`'s projection at `now`: its pace priced at its cluster's price, added to what its
    attempts cost so far; words in any case ("elapsed, cost so far" and why not, when no
    finish can be projected). `spans`: its runs (`webhooks.runs_of`), when the caller read
    many jobs' at once."""
    now = now or timezone.now()
    book = book or RateBook.load()
    p = pace(job, now=now)
    cluster = job.cluster
    spans = runs(job, now=now) if spans is None else spans
    elapsed = sum(((end - start) for start, end in spans), timedelta())
    so_far = estimates.cost_of(cluster, spans, book)
    currency = so_far[1] if so_far else book.currency
    cost_so_far = so_far[0] if so_far else None
    per_hour = _per_hour(cluster, book, now)
    cost = low = high = None
    ended = job.is_ended
    if p.ok and cost_so_far is not None and not ended:
        cost = _with_rest(cost_so_far, cluster, book, now, p.finish_at)
        low = _with_rest(cost_so_far, cluster, book, now, p.finish_low or p.finish_at)
        high = _with_rest(cost_so_far, cluster, book, now, p.finish_high or p.finish_at)
        if cost is not None:
            low = min(x for x in (low, cost) if x is not None)
            high = max(x for x in (high, cost) if x is not None)
        else:
            low = high = None
    projection = Projection(
        pace=p,
        currency=currency,
        cost_so_far=cost_so_far,
        per_hour=per_hour,
        cost=cost,
        cost_low=low,
        cost_high=high,
        budget=job.budget,
        budget_fraction=None,
        words=Text(""),
        at=now,
        elapsed_s=int(elapsed.total_seconds()),
        ended=ended,
    )
    projection.budget_fraction = _budget_fraction(projection)
    projection.words = _words(projection)
    return projection


def _per_hour(cluster, book: RateBook, now: datetime) -> Decimal | None:
    card = book.at(now)
    if card is None:
        return None
    rate = card.rate(
        gpu_model_id=cluster.gpu_model_id,
        instance_type_id=cluster.instance_type_id,
        spot=cluster.spot,
    )
    return None if rate is None else per_hour_of(rate, estimates.units_of(cluster))


def _with_rest(
    so_far: Decimal, cluster, book: RateBook, now: datetime, finish: datetime | None
) -> Decimal | None:
    """What it costs so far plus the seconds from now to `finish` at its cluster's price."""
    if finish is None:
        return None
    if finish <= now:
        return so_far
    rest = estimates.cost_of(cluster, [(now, finish)], book)
    return None if rest is None else so_far + rest[0]


def _budget_fraction(p: Projection) -> float | None:
    """The share of its steps done when its budget is reached, when the projection passes
    the budget: the steps left are spent at an even rate between now and the finish."""
    if p.budget is None or p.cost is None or p.cost <= p.budget:
        return None
    done = p.pace.fraction or 0.0
    rest = p.cost - p.cost_so_far
    if rest <= 0 or p.budget <= p.cost_so_far:
        return min(done, 1.0)
    share = float((p.budget - p.cost_so_far) / rest)
    return min(done + (1.0 - done) * share, 1.0)


def _words(p: Projection) -> Text:
    pc = p.pace
    elapsed = Duration(p.elapsed_s)
    if p.ended:
        if p.cost_so_far is None:
            return Text(ENDED_NO_PRICE, elapsed=elapsed)
        return Text(ENDED, elapsed=elapsed, cost=formatting.total_text(p.cost_so_far, p.currency))
    if not pc.ok:
        why = pc.why if pc.why is not None else Text(NO_WHY)
        if p.cost_so_far is None:
            return Text(SO_FAR_NO_PRICE, elapsed=elapsed, why=why)
        return Text(
            SO_FAR, elapsed=elapsed, cost=formatting.total_text(p.cost_so_far, p.currency), why=why
        )
    early = pc.finish_low or pc.finish_at
    late = pc.finish_high or pc.finish_at
    fmt = _range_fmt(early, late)
    args = {
        "steps": pc.window_steps,
        "per_step": _number(pc.seconds_per_step or 0.0),
        "spread": percent(pc.spread or 0.0),
        "finish": Moment(pc.finish_at),
        "early": Moment(early, fmt),
        "late": Moment(late, fmt),
    }
    if p.cost is None:
        return Text(PROJECTED_NO_PRICE, **args)
    return Text(
        PROJECTED,
        cost=formatting.total_text(p.cost, p.currency),
        low=formatting.total_text(p.cost_low, p.currency),
        high=formatting.total_text(p.cost_high, p.currency),
        so_far=formatting.total_text(p.cost_so_far, p.currency),
        **args,
    )


def _iso(at: datetime | None) -> str | None:
    return at.astimezone(UTC).isoformat() if at else None


def _str(amount: Decimal | None) -> str | None:
    return None if amount is None else str(amount)


def snapshot(p: Projection) -> dict:
    """The projection as JSON (amounts as decimal strings, times as ISO 8601 in UTC, the
    words as the Text's JSON beside their English): what Job.projection_last and
    projection_early keep and the API gives."""
    pc = p.pace
    budget_words = p.budget_words
    return {
        "at": _iso(p.at),
        "step": pc.step,
        "total": pc.total,
        "fraction": pc.fraction,
        "seconds_per_step": pc.seconds_per_step,
        "spread": pc.spread,
        "window_steps": pc.window_steps,
        "last_at": _iso(pc.last_at),
        "finish_at": _iso(pc.finish_at),
        "finish_low": _iso(pc.finish_low),
        "finish_high": _iso(pc.finish_high),
        "why": pc.why.as_json() if isinstance(pc.why, Text) else pc.why,
        "elapsed_s": p.elapsed_s,
        "ended": p.ended,
        "currency": p.currency,
        "cost_so_far": _str(p.cost_so_far),
        "per_hour": _str(p.per_hour),
        "cost": _str(p.cost),
        "cost_low": _str(p.cost_low),
        "cost_high": _str(p.cost_high),
        "budget": _str(p.budget),
        "budget_fraction": p.budget_fraction,
        "budget_words": budget_words.as_json() if budget_words else None,
        "budget_message": str(budget_words) if budget_words else None,
        "words": p.words.as_json(),
        "message": str(p.words),
    }


def write(job_id: int) -> str:
    """Project `job_id` now and keep it: the newest projection every time, the first one at
    a fifth of its steps or more once (a conditional update: never overwritten), and at its
    end the comparison of that one with what happened; then the budget's judge."""
    job = Job.objects.select_related("cluster").filter(pk=job_id).first()
    if job is None:
        return "no such job"
    p = project(job)
    snap = snapshot(p)
    said = "projected" if p.cost is not None or p.pace.ok else "no projection"
    fraction = p.pace.fraction
    if (
        p.pace.ok
        and not p.ended
        and fraction is not None
        and fraction >= EARLY_FRACTION
        and job.projection_early is None
    ):
        if Job.objects.filter(pk=job.pk, projection_early__isnull=True).update(
            projection_early=snap
        ):
            job.projection_early = snap
            said += ", early kept"
    if p.ended:
        compared = _compare(job, p)
        if compared is not None:
            snap["compared"] = _compared_json(compared)
            said += ", compared"
    Job.objects.filter(pk=job.pk).update(projection_last=snap)
    job.projection_last = snap
    _check_budget(job, p)
    return said


def _check_budget(job: Job, p: Projection) -> None:
    budgets.check_job(job, p)


# -- how good it was ------------------------------------------------------------------------


def compare(job: Job) -> dict | None:
    """A succeeded job's projection made at a fifth of its steps (projection_early) against
    what happened: finish times, costs and the errors in % (signed: + is later or dearer
    than it was). The finish time's error is a share of its run time (its first attempt's
    start to its end); None when there is nothing to compare (no early projection, or the
    job did not run to its end)."""
    stored = (job.projection_last or {}).get("compared")
    if stored:
        return _compared_loaded(stored)
    if not job.is_ended:
        return None
    return _compare(job, None)


def _compare(job: Job, p: Projection | None) -> dict | None:
    early = job.projection_early
    if job.state != Job.State.SUCCEEDED or not early or not early.get("finish_at"):
        return None
    spans = runs(job)
    if not spans or job.finished_at is None:
        return None
    started = spans[0][0]
    finished = job.finished_at
    projected_finish = datetime.fromisoformat(early["finish_at"])
    run_s = (finished - started).total_seconds()
    if run_s <= 0:
        return None
    finish_error = (projected_finish - finished).total_seconds() / run_s
    if p is not None:
        actual, currency = p.cost_so_far, p.currency
    else:
        priced = estimates.cost_of(job.cluster, spans)
        actual, currency = priced if priced else (None, early.get("currency") or "")
    projected_cost = Decimal(early["cost"]) if early.get("cost") else None
    cost_error = None
    if projected_cost is not None and actual:
        cost_error = float((projected_cost - actual) / actual)
    return {
        "fraction": early.get("fraction"),
        "projected_at": datetime.fromisoformat(early["at"]) if early.get("at") else None,
        "projected_finish": projected_finish,
        "finish": finished,
        "finish_error": finish_error,
        "currency": currency,
        "projected_cost": projected_cost,
        "cost": actual,
        "cost_error": cost_error,
        "words": _compared_words(
            early.get("fraction"), projected_finish, finished, finish_error,
            projected_cost, actual, cost_error, currency,
        ),
    }  # fmt: skip


def _compared_words(
    fraction, projected_finish, finished, finish_error, projected_cost, actual, cost_error,
    currency,
) -> Text:  # fmt: skip
    args = {
        "percent": percent(fraction),
        "projected_finish": Moment(projected_finish),
        "finish": Moment(finished),
        "finish_error": signed(finish_error),
    }
    if cost_error is None:
        return Text(COMPARED_NO_COST, **args)
    return Text(
        COMPARED,
        projected_cost=formatting.total_text(projected_cost, currency),
        cost=formatting.total_text(actual, currency),
        cost_error=signed(cost_error),
        **args,
    )


def _compared_json(c: dict) -> dict:
    return {
        "fraction": c["fraction"],
        "projected_at": _iso(c["projected_at"]),
        "projected_finish": _iso(c["projected_finish"]),
        "finish": _iso(c["finish"]),
        "finish_error": c["finish_error"],
        "currency": c["currency"],
        "projected_cost": _str(c["projected_cost"]),
        "cost": _str(c["cost"]),
        "cost_error": c["cost_error"],
        "words": c["words"].as_json(),
        "message": str(c["words"]),
    }


def _when(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def _amount(value: str | None) -> Decimal | None:
    return Decimal(value) if value else None


def _compared_loaded(data: dict) -> dict:
    return {
        "fraction": data.get("fraction"),
        "projected_at": _when(data.get("projected_at")),
        "projected_finish": _when(data.get("projected_finish")),
        "finish": _when(data.get("finish")),
        "finish_error": data.get("finish_error"),
        "currency": data.get("currency") or "",
        "projected_cost": _amount(data.get("projected_cost")),
        "cost": _amount(data.get("cost")),
        "cost_error": data.get("cost_error"),
        "words": load(data.get("words")) or data.get("message") or "",
    }


def accuracy_of(user, *, member_id: int | None = None) -> dict:
    """How good `user`'s projections were, for the billing page: over their newest succeeded
    jobs with a projection at a fifth of their steps, the median |error| of the finish time
    (a share of the run time) and of the cost (a share of the cost), as fractions.
    `member_id`: a team's member's own, the jobs on the clusters they made (as a member's
    spending is counted: billing.caps)."""
    # The comparisons stored at each job's end (write()): one indexed read of one column,
    # never a job's progress points. A job whose last write has not come yet (it ended a
    # moment ago, or the worker was away) is compared here: the few such, in one more query.
    rows = list(
        Job.objects.filter(owner=user, state=Job.State.SUCCEEDED, projection_early__isnull=False)
        .filter(**({} if member_id is None else {"cluster__created_by_id": member_id}))
        .order_by("-finished_at", "-id")
        .values_list("pk", "projection_last")[:ACCURACY_JOBS]
    )
    compared = [
        _compared_loaded(last["compared"]) for _pk, last in rows if (last or {}).get("compared")
    ]
    missing = [pk for pk, last in rows if not (last or {}).get("compared")]
    if missing:
        late = Job.objects.filter(pk__in=missing).select_related("cluster")
        compared += [compare(job) for job in late]
    finish, cost = [], []
    for c in compared:
        if c is None:
            continue
        finish.append(abs(c["finish_error"]))
        if c["cost_error"] is not None:
            cost.append(abs(c["cost_error"]))
    out = {
        "jobs": len(finish),
        "finish_error": statistics.median(finish) if finish else None,
        "cost_error": statistics.median(cost) if cost else None,
        "cost_jobs": len(cost),
    }
    if not finish:
        out["words"] = Text(ACCURACY_NONE)
    elif not cost:
        out["words"] = Text(
            ACCURACY_NO_COST, jobs=len(finish), finish_error=percent(out["finish_error"])
        )
    else:
        out["words"] = Text(
            ACCURACY,
            jobs=len(finish),
            finish_error=percent(out["finish_error"]),
            cost_error=percent(out["cost_error"]),
        )
    return out


# -- a sweep and a pool ---------------------------------------------------------------------


def _quantize(value: Decimal) -> Decimal:
    return formatting.amount(value)


@dataclass
class _Running:
    """Running jobs' projections summed: what they should still cost, with its range, the
    whole cost of each (a sweep's trial cost), and those with no projection."""

    currency: str
    rest: Decimal = ZERO
    low: Decimal = ZERO
    high: Decimal = ZERO
    wholes: list[tuple[Decimal, Decimal, Decimal]] = field(default_factory=list)
    unprojected: int = 0
    unprojected_spent: Decimal = ZERO  # what those without a projection spent so far

    @property
    def projected(self) -> int:
        return len(self.wholes)

    def add_of(self, job: Job, **how) -> None:
        """`job`'s projection added; one job whose projection fails is counted as one
        without (and logged): the pool's or sweep's page still shows the others."""
        try:
            p = project(job, **how)
        except Exception:
            log.exception("job %s: no projection", job.pk)
            self.unprojected += 1
            return
        self.add(p)

    def add(self, p: Projection) -> None:
        self.currency = p.currency
        if p.cost is None:
            self.unprojected += 1
            self.unprojected_spent += p.cost_so_far or ZERO
            return
        self.rest += p.cost - p.cost_so_far
        self.low += p.cost_low - p.cost_so_far
        self.high += p.cost_high - p.cost_so_far
        self.wholes.append((p.cost, p.cost_low, p.cost_high))


def sweep_figures(
    sweep: Sweep,
    *,
    now: datetime | None = None,
    curves: bool = True,
    book: RateBook | None = None,
) -> sweeps.SweepFigures:
    """`sweeps.figures` with each trial's cost as billing prices its job's runs so far
    (`estimates.costs_so_far`, every attempt, at the rate cards): what the sweep page, its
    projection, its budget's hold and its budget stop all say. One Replica query."""
    return _priced(sweep, now=now or timezone.now(), curves=curves, book=book)[0]


def _priced(
    sweep: Sweep, *, now: datetime, curves: bool, book: RateBook | None
) -> tuple[sweeps.SweepFigures, dict[int, list[tuple]]]:
    book = book or RateBook.load()
    fig = sweeps.figures(sweep, now=now, curves=curves)
    jobs = [f.trial.job for f in fig.trials if f.trial.job is not None]
    spans = runs_of(jobs, now=now)
    return fig.priced(estimates.costs_so_far(jobs, book=book, now=now, spans=spans)), spans


def _pruning(fig: sweeps.SweepFigures) -> tuple[float, float | None, float]:
    """Pruning's expected saving on a trial, from the trials so far: the share of the ended
    (complete or pruned) trials that were pruned, the mean share of a full trial's steps a
    pruned one ran (sweeps.figures: its steps over the longest complete trial's), and the
    saving, the first x (1 - the second)."""
    states = [f.trial.state for f in fig.trials]
    pruned = states.count(Trial.State.PRUNED)
    ended = pruned + states.count(Trial.State.COMPLETE)
    ran = [
        min(f.seconds / f.full_seconds, 1.0)
        for f in fig.trials
        if f.trial.state == Trial.State.PRUNED and f.full_seconds > 0
    ]
    pruned_share = pruned / ended if ended else 0.0
    ran_share = statistics.fmean(ran) if ran else None
    return pruned_share, ran_share, pruned_share * (1.0 - (1.0 if ran_share is None else ran_share))


def sweep_projection(
    sweep: Sweep, *, now: datetime | None = None, book: RateBook | None = None
) -> dict:
    """What the sweep's trials left should still cost: each running trial its own rest (its
    projection), each trial not started yet a trial's projected cost (the mean of the
    complete trials' costs and the running trials' projected ones) less what pruning is
    expected to save (`_pruning`). The range: the running trials' own ranges, and for each
    trial not started the cheapest and the dearest trial so far."""
    now = now or timezone.now()
    book = book or RateBook.load()
    fig, spans = _priced(sweep, now=now, curves=False, book=book)
    live = [f.trial.job for f in fig.trials if f.trial.state == Trial.State.RUNNING]
    prefetch_related_objects([j for j in live if j is not None], "progress_row")  # one query
    running = _Running(book.currency)
    for f in fig.trials:
        if f.trial.state == Trial.State.RUNNING and f.trial.job is not None:
            job = f.trial.job
            running.add_of(job, now=now, book=book, spans=spans.get(job.pk, []))
    complete = [
        f.cost for f in fig.trials if f.trial.state == Trial.State.COMPLETE and f.cost is not None
    ]
    pruned_share, ran_share, saving = _pruning(fig)
    keep = Decimal(str(round(1.0 - saving, 6)))
    not_started = 0
    if sweep.state == Sweep.State.RUNNING:
        not_started = max(sweep.trials - len(fig.trials), 0)
    left = not_started + running.projected + running.unprojected
    currency = running.currency
    out = {
        "currency": currency, "spent": fig.used_cost, "trials_left": left,
        "not_started": not_started, "running": running.projected + running.unprojected,
        "unprojected": running.unprojected, "pruned_share": pruned_share,
        "ran_share": ran_share, "saving_share": saving, "trial_cost": None,
        "remaining": None, "remaining_low": None, "remaining_high": None,
    }  # fmt: skip
    wholes = [(c, c, c) for c in complete] + running.wholes
    if left == 0:
        out.update(remaining=ZERO, remaining_low=ZERO, remaining_high=ZERO, words=Text(SWEEP_DONE))
        return out
    if not wholes:
        out["words"] = Text(SWEEP_NONE, trials=left, why=Text(SWEEP_NO_TRIAL))
        return out
    trial = statistics.mean(w[0] for w in wholes)  # of Decimals: a Decimal
    fresh = trial * keep  # a trial not started yet, pruning's savings taken off
    # A running trial with no projection yet: a fresh trial less what it spent.
    blind = max(fresh * running.unprojected - running.unprojected_spent, ZERO)
    remaining = running.rest + fresh * not_started + blind
    # Pruning is the largest unknown: at the low end every trial not started is pruned at
    # the mean share of its steps a pruned trial ran (none pruned yet: pruning's expected
    # keep), at the high end none is.
    cut = keep if ran_share is None else Decimal(str(round(ran_share, 6)))
    low = running.low + min(w[1] for w in wholes) * cut * not_started + blind
    high = running.high + max(w[2] for w in wholes) * not_started + blind
    out.update(
        trial_cost=_quantize(trial),
        remaining=_quantize(remaining),
        remaining_low=_quantize(min(low, remaining)),
        remaining_high=_quantize(max(high, remaining)),
    )
    out["words"] = Text(
        SWEEP_PROJECTED,
        trials=left,
        cost=formatting.total_text(out["remaining"], currency),
        low=formatting.total_text(out["remaining_low"], currency),
        high=formatting.total_text(out["remaining_high"], currency),
        trial=formatting.total_text(out["trial_cost"], currency),
        saving=percent(saving),
    )
    return out


HOLD = gettext_noop(
    "the next trial would pass its budget %(budget)s (spent %(spent)s, a trial costs about "
    "%(each)s)"
)


def sweep_hold(
    sweep: Sweep, p: dict | None = None, *, now: datetime | None = None, book=None
) -> Text | None:
    """Why no trial of `sweep` may start now for its budget (None: it may): what its trials
    cost so far (`sweep_figures`), with what its running trials should still cost and the
    next trial's projected cost (less pruning's expected saving), would pass it. `p`: its
    `sweep_projection`, when the caller has it."""
    if sweep.budget is None:
        return None
    p = p or sweep_projection(sweep, now=now, book=book)
    if p.get("trial_cost") is None or p.get("remaining") is None or p.get("spent") is None:
        return None
    keep = Decimal(1) - Decimal(str(p.get("saving_share") or 0))
    each = _quantize(p["trial_cost"] * keep)
    coming = max(p["remaining"] - each * p.get("not_started", 0), ZERO)
    if p["spent"] + coming + each <= sweep.budget:
        return None
    currency = p["currency"]
    return Text(
        HOLD,
        budget=formatting.total_text(sweep.budget, currency),
        spent=formatting.total_text(p["spent"], currency),
        each=formatting.total_text(each, currency),
    )


def write_sweep_hold(sweep: Sweep, *, now: datetime | None = None, book=None) -> Text | None:
    """Judge `sweep_hold` and keep it on the sweep (`Sweep.budget_hold`, with the budget it
    was judged against) for its round (jobs.pools.sweeps.advance) to read: billing's budget
    watch writes it each accrual tick, so the round never asks billing, nor prices trials
    inside its lock."""
    p = sweep_projection(sweep, now=now, book=book) if sweep.budget is not None else None
    hold = sweep_hold(sweep, p, now=now, book=book)
    data = None
    if hold is not None:  # with what its end at the budget tells (sweep.budget_stopped)
        spent = p["spent"]
        data = {
            "budget": str(sweep.budget), "words": hold.as_json(), "currency": p["currency"],
            "spent": None if spent is None else str(formatting.total(spent)),
        }  # fmt: skip
    if data != sweep.budget_hold:
        Sweep.objects.filter(pk=sweep.pk).update(budget_hold=data)
        sweep.budget_hold = data
    return hold


def pool_projection(pool: Pool, *, now: datetime | None = None) -> dict:
    """What the pool's running jobs should still cost (their projections' rests summed,
    with their ranges) and how many running jobs have no projection."""
    now = now or timezone.now()
    book = RateBook.load()
    running = _Running(book.currency)
    jobs = list(
        Job.objects.filter(pool=pool, state__in=Job.ACTIVE).select_related(
            "cluster", "progress_row"
        )
    )
    spans = runs_of(jobs, now=now)  # one query for all of them
    for job in jobs:
        running.add_of(job, now=now, book=book, spans=spans[job.pk])
    queued = Job.objects.filter(pool=pool, state__in=Job.WAITING).count()
    projected, currency = running.projected, running.currency
    out = {
        "currency": currency,
        "running": projected + running.unprojected,
        "projected": projected,
        "unprojected": running.unprojected,
        "remaining": running.rest if projected else None,
        "remaining_low": running.low if projected else None,
        "remaining_high": running.high if projected else None,
    }
    out["queued"] = queued
    if not out["running"]:
        out["words"] = Text(POOL_IDLE)
    elif not projected:
        out["words"] = Text(POOL_NONE, running=out["running"])
    else:
        out["words"] = Text(
            POOL_PROJECTED,
            cost=formatting.total_text(running.rest, currency),
            low=formatting.total_text(running.low, currency),
            high=formatting.total_text(running.high, currency),
            none=running.unprojected,
        )
    if queued:
        out["words"] = Text(POOL_QUEUED, said=out["words"], queued=queued)
    return out

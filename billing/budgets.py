"""Budget stops ("stop at ¥X") for a job, a cluster and a sweep (issue 44).

A researcher gives a job, a cluster or a sweep a budget (`Job.budget`, `Cluster.budget`,
`Sweep.budget`: on its form, in the API's create body, with `--budget` on the CLI, and
later on its page, `PATCH /api/v1/.../budget` or `suanli ... budget ID AMOUNT|none`). The
accrual tick (billing.accrual, after its charges) calls `enforce`, which stops each one
before its spending passes its budget:

* a job, when its cost so far (billing.estimates' estimate over its attempts: its cluster's
  price x its GPUs x the seconds it ran, the estimate its end event says) and what its stop
  still costs (its preemption script's limit, the stop's grace, one accrual period) reach
  its budget: as a preemption notice stops it, its preemption script first, then SIGTERM,
  SIGKILL after the grace (`jobs.clusters.services.job_stop_for`); it ends cancelled with
  "stopped at its budget ¥50.00: ¥49.80 spent", a "budget" line on its timeline and the
  event `job.budget_stopped`. Its projection (billing.projections, which calls
  `check_job` on each update) warns once when it will pass the budget
  (`job.budget_warning`, "at its pace it stops at its budget ¥50.00, about 62 % done");
* a cluster, when what its meter charged (`Meter.charged`) and one accrual period more
  reach its budget: stopped with every file kept (`cluster_stop`; one with no workspaces
  keeps nothing of its own and is released, as billing.accrual's `_stop_clusters_of`
  does) and billed up to the second it stopped in the same tick, so the ledger stays exact;
  the event `cluster.budget_stopped`;
* a sweep, when its trials' cost so far (and what its running trials' stops still cost)
  reach its budget: cancelled, its trials stopped as a job's budget stops it
  (`sweeps.sweep_cancel`); and no trial starts that would pass it (`sweeps.budget_hold`,
  in the sweep's own round). The event `sweep.budget_stopped`.

Told once: `budget_stopped_at` (and a job's `budget_warned_at`) is set by a conditional
update in the transaction of the stop; setting a budget again (`set_budget`) clears them.
"""

from __future__ import annotations

import logging
import re
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from billing import formatting
from billing.estimates import cost_of, costs_so_far
from billing.models import Meter
from billing.pricing import RateBook
from jobs.base.text import Text
from jobs.clusters import services as cluster_services
from jobs.events import webhooks
from jobs.events.timeline import job_event
from jobs.models import Cluster, Job, Sweep, Trial
from jobs.pools import sweeps

log = logging.getLogger(__name__)

MAX_BUDGET = Decimal("1000000")  # a budget above this is a typing slip, not a plan
GROUPED = re.compile(r"\d{1,3}(,\d{3})+(\.\d*)?")  # thousands written with commas

STOPPED = gettext_noop("stopped at its budget %(budget)s: %(spent)s spent")
JOB_STOPPED = gettext_noop(
    "stopped at its budget %(budget)s: %(spent)s spent, and up to %(margin)s more while it "
    "stops (%(seconds)s s)"
)
STOPPED_KEPT = gettext_noop(
    "stopped at its budget %(budget)s: %(spent)s spent; its kept files are still charged "
    "%(kept)s an hour while it is stopped: release it to stop that"
)
WARNING = gettext_noop(
    "At its current pace it stops at its budget %(budget)s, about %(done)s done "
    "(projected cost %(cost)s)"
)
JOB_STOPPED_WORDS = gettext_noop("Job %(job)s on cluster %(cluster)s %(reason)s: %(url)s")
JOB_WARNING_WORDS = gettext_noop("Job %(job)s on cluster %(cluster)s: %(words)s: %(url)s")
CLUSTER_STOPPED_WORDS = gettext_noop("Cluster %(cluster)s %(reason)s; its files are kept: %(url)s")
CLUSTER_KEPT_WORDS = gettext_noop("Cluster %(cluster)s %(reason)s: %(url)s")  # STOPPED_KEPT
CLUSTER_RELEASED_WORDS = gettext_noop(
    "Cluster %(cluster)s %(reason)s; it kept no files of its own and was released: %(url)s"
)
SWEEP_STOPPED_WORDS = gettext_noop(
    "Sweep %(sweep)s %(why)s; its running trials are stopped: %(url)s"
)


# -- the input ---------------------------------------------------------------------------


def parse(value) -> Decimal | None:
    """A budget as a researcher writes it (the forms, the API's JSON, the CLI): None for no
    budget (None, "", "none"); else a Decimal above 0, with at most 2 decimals, at most
    MAX_BUDGET. ValidationError in words otherwise."""
    if value is None or isinstance(value, str) and value.strip().lower() in ("", "none"):
        return None
    if isinstance(value, bool):
        raise ValidationError(_("A budget is an amount, e.g. 50 or 49.90."), code="budget")
    text = str(value).strip()
    for sign in ("¥", "￥", "$"):
        text = text.removeprefix(sign)
    if GROUPED.fullmatch(text):  # "1,000.50"; a comma elsewhere ("49,90") is not read
        text = text.replace(",", "")
    try:
        amount = Decimal(text)
    except (InvalidOperation, ValueError):
        raise ValidationError(
            _("The budget %(value)s is not a number: write an amount such as 50 or 49.90.")
            % {"value": str(value)[:40]},
            code="budget",
        ) from None
    if not amount.is_finite():
        raise ValidationError(
            _("The budget must be a finite amount, such as 50 or 49.90."), code="budget"
        )
    if amount <= 0:
        raise ValidationError(
            _(
                "A budget must be more than 0 (it is what may be spent before the stop); "
                "leave it empty for no budget."
            ),
            code="budget",
        )
    if amount > MAX_BUDGET:
        raise ValidationError(
            _("A budget is at most %(most)s; %(value)s is more than that.")
            % {"most": f"{MAX_BUDGET:,.0f}", "value": str(value)[:40]},
            code="budget",
        )
    if amount.as_tuple().exponent < -2 and amount != amount.quantize(formatting.CENT):
        raise ValidationError(
            _("A budget has at most 2 decimals (cents), e.g. 49.90."), code="budget"
        )
    return amount.quantize(formatting.CENT)


# A budget no longer applies once its subject has ended: changing it would only erase the
# record that the budget stopped it ("Stopped at its budget ..." on its page, in the API).
ENDED = {
    Job: Job.ENDED,
    Cluster: (Cluster.State.RELEASING, Cluster.State.RELEASED, Cluster.State.FAILED),
    Sweep: (Sweep.State.FINISHED, Sweep.State.CANCELLED),
}
ENDED_WORDS = {
    Job: gettext_noop("Job %(name)s has ended (%(state)s); its budget no longer applies."),
    Cluster: gettext_noop("Cluster %(name)s is %(state)s; its budget no longer applies."),
    Sweep: gettext_noop(
        "Sweep %(name)s has ended (%(state)s) and does not start again; its budget no "
        "longer applies."
    ),
}


def change_refusal(subject: Job | Cluster | Sweep) -> str:
    """Why `subject`'s budget may not be changed, in words ("" when it may): it has ended
    (a job succeeded, failed or cancelled; a cluster releasing, released or failed; a sweep
    finished or cancelled)."""
    kind = type(subject)
    if subject.state not in ENDED[kind]:
        return ""
    return _(ENDED_WORDS[kind]) % {"name": subject.name, "state": subject.get_state_display()}


def set_budget(subject: Job | Cluster | Sweep, budget: Decimal | None) -> None:
    """Set (or clear, None) a job's, cluster's or sweep's budget; a new budget starts the
    watch again: its stop (and a job's warning) may be told again. ValidationError in words
    when it has ended (`change_refusal`): its record stays as it is."""
    fields = {"budget": budget, "budget_stopped_at": None}
    if isinstance(subject, Job):
        fields["budget_warned_at"] = None
    kind = type(subject)
    row = kind.objects.filter(pk=subject.pk).values("budget", "budget_stopped_at").first()
    stopped = row and row["budget_stopped_at"] and subject.state not in ENDED[kind]
    if stopped and budget is not None and row["budget"] is not None:
        if budget <= row["budget"]:  # the same or lower: it would only spend past it again
            raise ValidationError(
                _(
                    "%(name)s was stopped at its budget of %(budget)s: raise the budget above "
                    "that, or clear it, to let it run again."
                )
                % {"name": subject.name, "budget": shown(row["budget"])},
                code="budget",
            )
    if not kind.objects.filter(pk=subject.pk).exclude(state__in=ENDED[kind]).update(**fields):
        subject.refresh_from_db()
        raise ValidationError(change_refusal(subject) or _("Invalid input."), code="ended")
    for name, value in fields.items():
        setattr(subject, name, value)


def start_refusal(cluster: Cluster) -> str:
    """Why a cluster its budget stopped may not start again ("" when it may): until its
    budget is raised or cleared (`set_budget` starts the watch again), a start would only
    spend past it."""
    if cluster.budget is None or cluster.budget_stopped_at is None:
        return ""
    charged = Meter.objects.filter(cluster_id=cluster.pk).values_list("charged", flat=True).first()
    return _(
        "%(name)s was stopped at its budget of %(budget)s (%(spent)s charged): raise or clear "
        "its budget first, on its page or with suanli clusters budget."
    ) % {
        "name": cluster.name, "budget": shown(cluster.budget),
        "spent": shown(charged or Decimal(0)),
    }  # fmt: skip


def api_amount(value) -> str | None:
    """An amount in a webhook's data as the API gives it: "1.00" (to the cent); None stays."""
    return None if value is None else str(formatting.total(Decimal(str(value))))


def shown(amount: Decimal | None, currency: str | None = None) -> str:
    """ "¥50.00" (the card's currency)."""
    return formatting.total_text(
        amount, currency if currency is not None else RateBook.load().currency
    )


# -- the watch ---------------------------------------------------------------------------


def margin_s(job: Job | None = None) -> int:
    """The seconds a stop decided now may still be charged: one accrual period (until the
    next look), and for a job its stop's grace and its preemption script's limit."""
    seconds = settings.SUANLI_ACCRUAL_INTERVAL
    if job is not None:
        seconds += settings.SUANLI_STOP_GRACE_S
        if job.preemption_script.strip():
            seconds += settings.SUANLI_PREEMPT_SCRIPT_S
    return seconds


def job_spent(job: Job, book: RateBook | None = None) -> Decimal | None:
    """What a job's attempts cost so far (the estimate of its end event, billing.estimates);
    None: no price."""
    return costs_so_far([job], book=book)[job.pk]


def _ahead(cluster: Cluster, seconds: int, now: datetime, book: RateBook | None = None) -> Decimal:
    """What `cluster`'s GPUs cost for the next `seconds` at today's price (0 without one)."""
    priced = cost_of(cluster, [(now, now + timedelta(seconds=seconds))], book)
    return Decimal(0) if priced is None else priced[0]


def _field(projection, name: str):
    """A Projection's field (billing.projections), or a stored snapshot's (a dict of strings)."""
    if projection is None:
        return None
    if isinstance(projection, dict):
        return projection.get(name)
    return getattr(projection, name, None)


def check_job(
    job: Job, projection=None, *, now: datetime | None = None, book: RateBook | None = None
) -> str:
    """Judge one job against its budget: stop it when its cost so far and its stop's
    margin reach it; else warn once when `projection` (billing.projections.project, or
    the job's stored `projection_last`) says it will pass it. Returns what was done:
    "stopped", "warned", "ok", or why nothing was judged."""
    now = now or timezone.now()
    if job.budget is None:
        return "no budget"
    if job.budget_stopped_at is not None or job.cancel_requested or job.is_ended:
        return "done"
    if job.state not in Job.ACTIVE:
        return "not running"
    if projection is None:
        projection = job.projection_last
    book = book or RateBook.load()
    spent = job_spent(job, book)  # priced now: a stored projection's may be minutes old
    if spent is None:
        return "no price"
    margin = _ahead(job.cluster, margin_s(job), now, book)
    if spent + margin >= job.budget:
        return "stopped" if stop_job(job, spent, now=now, margin=margin) else "done"
    fraction = _field(projection, "budget_fraction")
    if isinstance(projection, dict) and projection.get("budget") is not None:
        if Decimal(str(projection["budget"])) != job.budget:
            fraction = None  # stored against another budget: the next projection judges
    if fraction is not None and job.budget_warned_at is None:
        return "warned" if warn_job(job, float(fraction), _field(projection, "cost"), now) else "ok"
    return "ok"


def stop_job(
    job: Job, spent: Decimal, *, now: datetime | None = None, margin: Decimal | None = None
) -> bool:
    """Stop `job` at its budget, once (`budget_stopped_at`), and tell its owner. Its words
    say what its stop may still cost (`margin`: its cluster's price for `margin_s`), the
    room it kept below the budget: a budget smaller than that stops it at its start."""
    now = now or timezone.now()
    book = RateBook.load()
    currency = book.currency
    if margin is None:
        margin = _ahead(job.cluster, margin_s(job), now, book)
    reason = Text(
        JOB_STOPPED, budget=shown(job.budget, currency), spent=shown(spent, currency),
        margin=shown(margin, currency), seconds=margin_s(job),
    )  # fmt: skip
    with transaction.atomic():
        if not Job.objects.filter(pk=job.pk, budget_stopped_at__isnull=True).update(
            budget_stopped_at=now
        ):
            return False
        if not cluster_services.job_stop_for(job=job, reason=reason):
            return True  # it had ended or was being stopped meanwhile: nothing more to say
        job.refresh_from_db()
        data = webhooks.job_data(job)
        data["budget"] = {
            "budget": api_amount(job.budget), "spent": api_amount(spent), "currency": currency,
        }  # fmt: skip
        webhooks.emit(
            owner_id=job.owner_id,
            event_type="job.budget_stopped",
            data=data,
            summary=Text(
                JOB_STOPPED_WORDS, job=job.name, cluster=job.cluster.name, reason=reason,
                url=data["job"]["url"],
            ),
        )  # fmt: skip
    log.info("job %s stopped at its budget %s (%s spent)", job.pk, job.budget, spent)
    return True


def warn_job(job: Job, fraction: float, cost, now: datetime) -> bool:
    """The early warning, once (`budget_warned_at`): a "budget" line on the job's timeline
    and `job.budget_warning`."""
    currency = RateBook.load().currency
    done = f"{max(0, min(100, round(fraction * 100)))} %"
    projected = shown(Decimal(str(cost)), currency) if cost is not None else "—"
    words = Text(WARNING, budget=shown(job.budget, currency), done=done, cost=projected)
    with transaction.atomic():
        if not Job.objects.filter(
            pk=job.pk, budget_warned_at__isnull=True, budget_stopped_at__isnull=True
        ).update(budget_warned_at=now):
            return False
        job_event(job, "budget", words, at=now)
        data = webhooks.job_data(job)
        data["budget"] = {
            "budget": api_amount(job.budget), "projected_cost": api_amount(cost),
            "fraction_done": round(fraction, 4), "currency": currency,
        }  # fmt: skip
        webhooks.emit(
            owner_id=job.owner_id,
            event_type="job.budget_warning",
            data=data,
            summary=Text(
                JOB_WARNING_WORDS, job=job.name, cluster=job.cluster.name, words=words,
                url=data["job"]["url"],
            ),
        )  # fmt: skip
    return True


def _watched(model):
    return model.objects.filter(budget__isnull=False, budget_stopped_at__isnull=True)


def enforce(now: datetime | None = None) -> dict:
    """Every accrual tick, after its charges: each job, cluster and sweep with a budget not
    yet stopped at it is judged. Returns what was stopped and warned (the tick bills the
    clusters stopped up to the second they stopped). One indexed query a kind when no
    budget is set."""
    now = now or timezone.now()
    out: dict[str, list[int]] = {"jobs": [], "warned": [], "clusters": [], "sweeps": []}
    books: list[RateBook] = []  # the rate cards, read once a tick, and only when needed

    def book() -> RateBook:
        if not books:
            books.append(RateBook.load())
        return books[0]

    jobs = _watched(Job).filter(state__in=Job.ACTIVE, cancel_requested=False)
    for job in jobs.select_related("cluster").order_by("pk"):
        try:
            said = check_job(job, now=now, book=book())
        except Exception:  # one job's trouble must not stop the others' (nor the tick)
            log.exception("budget of job %s not judged", job.pk)
            continue
        if said == "stopped":
            out["jobs"].append(job.pk)
        elif said == "warned":
            out["warned"].append(job.pk)
    clusters = _watched(Cluster).filter(state=Cluster.State.RUNNING)
    for cluster in clusters.order_by("pk"):
        try:
            if check_cluster(cluster, now=now, book=book()):
                out["clusters"].append(cluster.pk)
        except Exception:
            log.exception("budget of cluster %s not judged", cluster.pk)
    for sweep in _watched(Sweep).filter(state=Sweep.State.RUNNING).order_by("pk"):
        try:
            if check_sweep(sweep, now=now, book=book()):
                out["sweeps"].append(sweep.pk)
        except Exception:
            log.exception("budget of sweep %s not judged", sweep.pk)
    return out


def check_cluster(
    cluster: Cluster, *, now: datetime | None = None, book: RateBook | None = None
) -> bool:
    """Stop (or release) a running cluster whose charges and one accrual period more reach
    its budget. True when it was stopped here."""
    now = now or timezone.now()
    charged = Meter.objects.filter(cluster_id=cluster.pk).values_list("charged", flat=True).first()
    if charged is None:
        return False  # not charged yet (no meter): nothing spent
    if charged + _ahead(cluster, margin_s(), now, book) < cluster.budget:
        return False
    return stop_cluster(cluster, charged, now=now)


def stop_cluster(cluster: Cluster, charged: Decimal, *, now: datetime | None = None) -> bool:
    """As billing.accrual stops an exhausted account's: a running cluster with workspaces
    is stopped, every file kept; one for jobs only keeps no file of its own and is
    released. Once (`budget_stopped_at`), with `cluster.budget_stopped`."""
    now = now or timezone.now()
    book = RateBook.load()
    currency = book.currency
    amounts = {"budget": shown(cluster.budget, currency), "spent": shown(charged, currency)}
    card = book.at(now)
    kept = card.stopped * cluster.nodes if card is not None and cluster.workspace else 0
    if kept:  # the card's stopped price: its kept files are not free (billing.accrual)
        reason = Text(STOPPED_KEPT, kept=shown(kept, currency), **amounts)
    else:
        reason = Text(STOPPED, **amounts)
    with transaction.atomic():
        if not Cluster.objects.filter(pk=cluster.pk, budget_stopped_at__isnull=True).update(
            budget_stopped_at=now
        ):
            return False
        if cluster.workspace:
            try:
                cluster_services.cluster_stop(cluster=cluster, reason=reason, limited=False)
            except ValidationError:  # no longer running (its owner stopped it meanwhile)
                transaction.set_rollback(True)
                return False
            words = CLUSTER_KEPT_WORDS if kept else CLUSTER_STOPPED_WORDS
        else:
            cluster_services.cluster_release(cluster=cluster, reason=reason)
            words = CLUSTER_RELEASED_WORDS
        cluster.refresh_from_db()
        data = webhooks.cluster_data(cluster)
        data["budget"] = {
            "budget": api_amount(cluster.budget), "spent": api_amount(charged), "currency": currency,
        }  # fmt: skip
        webhooks.emit(
            owner_id=cluster.owner_id,
            event_type="cluster.budget_stopped",
            data=data,
            summary=Text(words, cluster=cluster.name, reason=reason, url=data["cluster"]["url"]),
        )
    log.info(
        "cluster %s stopped at its budget %s (%s charged)", cluster.pk, cluster.budget, charged
    )
    return True


def sweep_spent(sweep: Sweep, book: RateBook | None = None) -> tuple[Decimal, int]:
    """What a sweep's trials cost so far (each trial's job, priced as a job's end event
    prices it), and how many of them run."""
    trials = list(
        Trial.objects.filter(sweep=sweep, job__isnull=False).select_related("job__cluster")
    )
    costs = costs_so_far([t.job for t in trials], book=book)  # one Replica query
    total = sum((c for c in costs.values() if c is not None), Decimal(0))
    return total, sum(t.state == Trial.State.RUNNING for t in trials)


def check_sweep(sweep: Sweep, *, now: datetime | None = None, book: RateBook | None = None) -> bool:
    """Cancel a running sweep whose trials' cost so far, with what their stops still cost,
    reaches its budget. True when it was cancelled here."""
    now = now or timezone.now()
    book = book or RateBook.load()
    spent, running = sweep_spent(sweep, book)
    ahead = Decimal(0)
    if running:
        one = Trial.objects.filter(sweep=sweep, state=Trial.State.RUNNING, job__isnull=False)
        trial = one.select_related("job__cluster").first()
        if trial is not None:
            ahead = _ahead(trial.job.cluster, margin_s(trial.job), now, book) * running
    if spent + ahead < sweep.budget:
        from billing import projections  # it imports this module

        # Whether its next trial may start: kept on the sweep for its round to read.
        projections.write_sweep_hold(sweep, now=now, book=book)
        return False
    return stop_sweep(sweep, spent, now=now)


def stop_sweep(sweep: Sweep, spent: Decimal, *, now: datetime | None = None) -> bool:
    now = now or timezone.now()
    currency = RateBook.load().currency
    reason = Text(STOPPED, budget=shown(sweep.budget, currency), spent=shown(spent, currency))
    with transaction.atomic():
        if not Sweep.objects.filter(
            Q(state=Sweep.State.RUNNING), pk=sweep.pk, budget_stopped_at__isnull=True
        ).update(budget_stopped_at=now):
            return False
        sweeps.sweep_cancel(sweep=sweep, reason=reason)
        sweeps.tell_budget_stopped(
            sweep, state=Sweep.State.CANCELLED, spent=api_amount(spent), currency=currency,
            words=SWEEP_STOPPED_WORDS, why=reason,
        )  # fmt: skip
    log.info("sweep %s cancelled at its budget %s (%s spent)", sweep.pk, sweep.budget, spent)
    return True

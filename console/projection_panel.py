"""What a researcher is shown of a job's future and its cost: the job page's Projection and
Energy panels (redrawn by the page's status poll), and the `projection`, `comparison` and
`energy` of `GET /api/v1/jobs/{id}` (which `suanli jobs show` prints).

The figures are billing's (billing.projections: the pace from jobs.runs.progress priced at
the cluster's price, the budget, the comparison after the run, a sweep's and a pool's
remaining cost, a researcher's accuracy) and monitoring's (monitoring.energy); this module
only puts them in front of the reader. Pages speak the reader's language (a Text is
rendered when shown); the API speaks English, as the rest of it does.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from django.utils.translation import gettext as _

from billing import formatting, projections
from jobs.base import text
from jobs.models import Job
from monitoring import energy as power


@dataclass
class Panel:
    """The job page's two panels, ready for the template."""

    projection: projections.Projection
    words: str  # the projection's sentence, in the reader's language
    why: str  # why no finish is projected (empty when one is)
    note: str  # what was wrong with a total the job declared (empty when nothing)
    percent: float | None  # share of the steps done, 0-100
    budget_words: str  # the budget line (empty without a budget)
    budget_warning: bool  # the projection passes the budget
    compared: dict | None  # an ended job: projected vs actual, errors as signed "+3.1"
    no_comparison: str  # an ended job without one: why
    energy: power.Energy
    energy_words: str


def said(value) -> str:
    """A Text (or its stored JSON) in the reader's language; anything else as its words."""
    if isinstance(value, text.Text):
        return text.show(value.as_json())
    if isinstance(value, dict):
        return text.show(value)
    return "" if value is None else str(value)


def _english(value) -> str | None:
    """A Text, its stored JSON or plain words as English; None for nothing."""
    if value is None or value == "":
        return None
    if isinstance(value, dict):
        return str(text.load(value))
    return str(value)


def _pct(share: float) -> str:
    """A share as a percentage, as billing's sentences write it: 0.0412 "4.1", 0.62 "62"."""
    return projections.percent(abs(share))


def _signed(share: float | None) -> str:
    """An error (a fraction, signed: + later or dearer) as the page shows it: "+3.1"."""
    return "" if share is None else projections.signed(share)


def budget_line(p: projections.Projection, job: Job) -> tuple[str, bool]:
    """The budget's line in the active language, and whether it warns: the projection
    passes it ("At this pace it stops at its budget of ¥50.00, about 62 % done")."""
    if p.budget is None:
        return "", False
    budget = formatting.total_text(p.budget, p.currency)
    if job.budget_stopped_at:
        return _("Stopped at its budget of %(budget)s.") % {"budget": budget}, False
    warning = p.budget_words
    if warning is not None:
        return said(warning), True
    if p.cost_so_far is None:
        return _("Budget %(budget)s.") % {"budget": budget}, False
    spent = formatting.total_text(p.cost_so_far or Decimal(0), p.currency)
    return _("Budget %(budget)s: %(spent)s spent so far.") % {
        "budget": budget,
        "spent": spent,
    }, False


def _compared(job: Job) -> dict | None:
    c = projections.compare(job)
    if c is None:
        return None
    return {
        **c,
        "finish_off": _signed(c.get("finish_error")),
        "cost_off": _signed(c.get("cost_error")),
        "percent": round((c.get("fraction") or 0) * 100),
        "words": said(c.get("words")),
    }


def _no_comparison(job: Job, compared: dict | None) -> str:
    if not job.is_ended or compared is not None:
        return ""
    if job.state != Job.State.SUCCEEDED:
        return _("Only a job that ran to its end is compared with its projection.")
    return _(
        "No projection to compare with: none was made once a fifth of its steps were done "
        "(it declared no total, or reported too few steps)."
    )


def job_panel(job: Job, *, own: bool = True) -> Panel:
    """`own`: read by the owner's people (the budget's line shown), not by an operator."""
    p = projections.project(job)
    pace = p.pace
    words, warning = budget_line(p, job) if own else ("", False)
    said_now = said(p.words)
    if not job.started_at and not job.is_ended:  # it never ran: nothing "ran so far" yet
        said_now = _(
            "Its finish time and cost are projected once it runs and reports its steps "
            '(SUANLI_METRIC lines with a "step", and a "total_steps" or SUANLI_TOTAL_STEPS).'
        )
    found = power.energy_of(job)
    compared = _compared(job) if job.is_ended else None
    note = text.show(job.progress_note_text) if job.progress_note_text else job.progress_note
    return Panel(
        projection=p,
        words=said_now,
        why=said(pace.why) if pace.why else "",
        note=note or "",
        percent=round(pace.fraction * 100, 1) if pace.fraction is not None else None,
        budget_words=words,
        budget_warning=warning,
        compared=compared,
        no_comparison=_no_comparison(job, compared),
        energy=found,
        energy_words=said(power.energy_words(found)),
    )


# -- the API ---------------------------------------------------------------------------------


def _utc(value):
    """An ISO time as the rest of the API writes it (`...Z`)."""
    return value.replace("+00:00", "Z") if isinstance(value, str) else value


TIMES = ("at", "last_at", "finish_at", "finish_low", "finish_high")


def api_projection(job: Job) -> dict:
    """The live projection as the API gives it: billing's snapshot with its words, why and
    budget line in English; a figure it cannot give is null."""
    p = projections.project(job)
    shown = projections.snapshot(p)
    shown.pop("message", None)
    shown.pop("budget_message", None)
    shown.update({key: _utc(shown.get(key)) for key in TIMES})
    shown["words"] = _english(p.words) or ""
    shown["why"] = _english(p.pace.why)
    shown["budget_words"] = budget_line(p, job)[0] or None  # the API's language: English
    return shown


def api_comparison(job: Job) -> dict | None:
    c = projections.compare(job) if job.is_ended else None
    if c is None:
        return None
    return {
        "fraction": c.get("fraction"),
        "projected_at": c.get("projected_at"),
        "projected_finish": c.get("projected_finish"),
        "finish": c.get("finish"),
        "finish_error": c.get("finish_error"),
        "currency": c.get("currency") or "",
        "projected_cost": c.get("projected_cost"),
        "cost": c.get("cost"),
        "cost_error": c.get("cost_error"),
        "words": _english(c.get("words")) or "",
    }


def api_energy(job: Job) -> dict:
    found = power.energy_of(job)
    return {**found.as_dict(), "words": _english(power.energy_words(found)) or ""}


# -- sweeps, pools, the billing page --------------------------------------------------------


def in_words(figures: dict | None) -> dict | None:
    """A sweep's, a pool's or a researcher's figures from billing.projections with their
    `words` in the reader's language."""
    if figures is None:
        return None
    return {**figures, "words": said(figures.get("words"))}


def sweep_panel(sweep) -> dict | None:
    return in_words(projections.sweep_projection(sweep))


def pool_panel(pool) -> dict | None:
    return in_words(projections.pool_projection(pool))


def accuracy_panel(user, *, member_id: int | None = None) -> dict:
    figures = in_words(projections.accuracy_of(user, member_id=member_id))
    for key in ("finish_error", "cost_error"):
        share = figures.get(key)
        figures[f"{key}_pct"] = _pct(share) if share is not None else None
    return figures

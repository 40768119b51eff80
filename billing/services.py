"""Writes to money: ledger entries (each under its account's row lock, with a unique
idempotency key), accounts, and the low-balance notice. The accrual tick that turns
clusters' held capacity into usage is `billing.accrual`.

Billing observes the jobs app's tables (clusters and their nodes' started/released
seconds, whether a node ran without GPUs, and how long a stopped node's workspace was
kept); the jobs app never calls billing. The one call the other way is the stop for an
exhausted balance, which stops clusters (files kept) through `jobs.clusters.services`
(`billing.accrual.stop_exhausted`).
"""

from __future__ import annotations

import logging
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from billing import formatting, rollups, selectors
from billing.models import WARN_HOURS_MAX, WARN_HOURS_MIN, Account, LedgerEntry
from jobs.base.text import Duration, Text, fit
from jobs.events import webhooks
from jobs.models import Cluster, TeamMember

log = logging.getLogger(__name__)

OPERATOR_KINDS = (
    LedgerEntry.Kind.TOPUP,
    LedgerEntry.Kind.REFUND,
    LedgerEntry.Kind.ADJUSTMENT,
    LedgerEntry.Kind.CREDIT,
)


def floor_s(when: datetime) -> datetime:
    return when.replace(microsecond=0)


def epoch(when: datetime) -> int:
    return int(when.timestamp())


def account_for(user) -> Account:
    account, _created = Account.objects.get_or_create(user=user)
    return account


def accounts_ensure() -> int:
    """An account (balance 0) for every user that has none yet: users made by sign-up, by
    an operator in the admin or by `createsuperuser` can all be topped up at once. Two
    queries; safe to run concurrently (a row made meanwhile is skipped). Returns how many
    users had none (a concurrent call may have made some of them)."""
    missing = get_user_model().objects.filter(account__isnull=True).values_list("pk", flat=True)
    made = Account.objects.bulk_create(
        [Account(user_id=pk) for pk in missing], ignore_conflicts=True
    )
    return len(made)


# -- operator entries ----------------------------------------------------------------------


@transaction.atomic
def post_entry(
    *, account: Account, kind: str, amount: Decimal, key: str, by=None, memo: str = ""
) -> LedgerEntry:
    """Top-up, refund, adjustment or credit. Replaying the same key returns the first
    entry and changes nothing."""
    if kind not in OPERATOR_KINDS:
        raise ValidationError(
            _("%(kind)s entries are written by the accrual, not by hand.") % {"kind": kind}
        )
    amount = Decimal(amount)
    if amount.as_tuple().exponent < -4:
        raise ValidationError(_("Amounts have at most 4 decimal places."))
    if kind in (LedgerEntry.Kind.TOPUP, LedgerEntry.Kind.REFUND, LedgerEntry.Kind.CREDIT) and (
        amount <= 0
    ):
        raise ValidationError(_("A %(kind)s adds money: give a positive amount.") % {"kind": kind})
    if amount == 0:
        raise ValidationError(_("An adjustment of 0 changes nothing."))
    if not memo.strip():
        raise ValidationError(_("Say why (the reason is kept with the entry)."))
    account = Account.objects.select_for_update().get(pk=account.pk)
    existing = LedgerEntry.objects.filter(key=key).first()
    if existing is not None:
        return existing
    account.balance += amount
    entry = LedgerEntry.objects.create(
        account=account,
        kind=kind,
        amount=amount,
        balance_after=account.balance,
        key=key,
        memo=fit(LedgerEntry, "memo", memo),
        created_by=by,
    )
    rollups.add_entry(entry)
    _save_balance(account)
    return entry


def _save_balance(account: Account) -> None:
    """Save a balance changed under its row lock, with the markers money in ends."""
    fields = ["balance"]
    if account.low_notified_at is not None or account.critical_notified_at is not None:
        # Money in that lifts the balance above a threshold ends that warning's spell: the
        # next low is told again (a top-up that leaves it low tells nothing new).
        fields += spells_over(account, selectors.standing(account.user, account=account))
    if account.balance > 0 and account.exhausted_at is not None:
        account.exhausted_at = None
        fields.append("exhausted_at")
    if account.balance > 0 and account.exhausted_notified_at is not None:
        account.exhausted_notified_at = None  # the next exhaustion is told again
        fields.append("exhausted_notified_at")
    account.save(update_fields=fields)


# -- a member's money into a team --------------------------------------------------------------

TRANSFER_MOST = Decimal("1000000.00")  # one transfer: a typo of three zeros is refused
KEY_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-_")


def transfer_key(key: str) -> tuple[str, str]:
    """The two entries' idempotency keys of a transfer whose request carries `key` (the
    form's one-time token, an API client's Idempotency-Key)."""
    if not key or len(key) > 64 or not set(key) <= KEY_CHARS:
        raise ValidationError(_("The form has expired: open the page again."), code="key")
    return f"transfer:{key}:out", f"transfer:{key}:in"


@transaction.atomic
def transfer_to_team(*, person, team, amount, key: str) -> tuple[LedgerEntry, LedgerEntry]:
    """Move `amount` from `person`'s own balance into `team`'s (any member, viewers too:
    giving money acts on nothing of the team's). Two entries, one on each account, under
    both row locks taken in the order of their ids (two transfers the other way round
    cannot deadlock). A retried request with the same `key` moves the money once and
    returns the first pair. Refused in words: not a member, an amount not above 0 or past
    TRANSFER_MOST or finer than a cent, a balance that does not cover it."""
    out_key, in_key = transfer_key(key)
    if not TeamMember.objects.filter(team=team, person=person).exists():
        raise ValidationError(_("You are not in this team."), code="not_member")
    amount = _transfer_amount(amount)
    mine, theirs = account_for(person), account_for(team.principal)
    locked = {
        a.pk: a
        for a in Account.objects.select_for_update()
        .select_related("user")
        .filter(pk__in=[mine.pk, theirs.pk])
        .order_by("pk")
    }
    done = {e.key: e for e in LedgerEntry.objects.filter(key__in=[out_key, in_key])}
    if out_key in done:
        if done[out_key].account_id != mine.pk or done[in_key].account_id != theirs.pk:
            raise ValidationError(_("The form has expired: open the page again."), code="key")
        return done[out_key], done[in_key]
    mine, theirs = locked[mine.pk], locked[theirs.pk]
    if mine.balance < amount:
        raise ValidationError(
            _("Your balance is %(balance)s: it does not cover %(amount)s.")
            % {"balance": formatting.total(mine.balance), "amount": formatting.total(amount)},
            code="short",
        )
    now = timezone.now()
    entries = []
    for account, signed, entry_key, memo in (
        (mine, -amount, out_key, f"→ {team.name}"),
        (theirs, amount, in_key, f"← {person.get_username()}"),
    ):
        account.balance += signed
        entry = LedgerEntry.objects.create(
            account=account, kind=LedgerEntry.Kind.TRANSFER, amount=signed,
            balance_after=account.balance, key=entry_key, memo=fit(LedgerEntry, "memo", memo),
            created_at=now, created_by=person,
        )  # fmt: skip
        rollups.add_entry(entry)
        _save_balance(account)
        entries.append(entry)
    return entries[0], entries[1]


def _transfer_amount(amount) -> Decimal:
    try:
        amount = Decimal(str(amount).strip())
    except (InvalidOperation, ValueError):
        amount = Decimal("NaN")
    if not amount.is_finite() or amount <= 0:
        raise ValidationError(_("Give an amount above 0, such as 100 or 12.50."), code="amount")
    if amount.as_tuple().exponent < -2:
        raise ValidationError(_("Give the amount to the cent at most."), code="amount")
    if amount > TRANSFER_MOST:
        raise ValidationError(
            _("One transfer moves at most %(most)s.") % {"most": f"{TRANSFER_MOST:,}"},
            code="amount",
        )
    return amount


# -- running out -----------------------------------------------------------------------------


def enough_balance(account: Account, per_hour: Decimal) -> bool:
    minutes = settings.SUANLI_MIN_BALANCE_MINUTES
    return account.balance >= per_hour * minutes / 60


def set_low_balance_hours(user, hours) -> Account:
    """The researcher's own low-balance threshold: warn when the balance lasts fewer than
    `hours` at the current burn (0.5 to 168, to the hundredth); None or "" for the
    operator's default. ValidationError (nothing saved) for anything else."""
    if hours in (None, ""):
        chosen = None
    else:
        try:
            chosen = Decimal(str(hours).strip())
        except (InvalidOperation, ValueError):
            chosen = None
            refused = True
        else:
            refused = not chosen.is_finite()
        if refused or not WARN_HOURS_MIN <= chosen <= WARN_HOURS_MAX:
            raise ValidationError(
                {"low_balance_hours": warn_hours_refusal()}, code="warn_hours_range"
            )
        chosen = chosen.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
    with transaction.atomic():
        account = account_for(user)
        Account.objects.filter(pk=account.pk).update(low_balance_hours=chosen)
    account.low_balance_hours = chosen
    return account


def warn_hours_refusal() -> str:
    return _("Give a number of hours from %(least)s to %(most)s (a week), or leave it empty.") % {
        "least": WARN_HOURS_MIN, "most": WARN_HOURS_MAX,
    }  # fmt: skip


def spells_over(account: Account, standing: selectors.Standing) -> list[str]:
    """The warning markers of `account` whose spell `standing` ends (the balance lasts at
    least the threshold again: a top-up, or less burning), cleared in memory; the fields
    to save."""
    fields = []
    if account.low_notified_at is not None and not standing.low:
        account.low_notified_at = None
        fields.append("low_notified_at")
    if account.critical_notified_at is not None and not standing.critical:
        account.critical_notified_at = None
        fields.append("critical_notified_at")
    return fields


# What the warnings say, in the reader's language (the channels render them; the English is
# kept for webhooks). %(left)s is a Duration: "1 h 20 min", "1 小时 20 分钟".
LOW_WORDS = gettext_noop(
    "Your balance %(balance)s lasts about %(left)s at %(burn)s/h; your clusters stop (files "
    "kept) when it runs out. Top up: %(url)s"
)
CRITICAL_WORDS = gettext_noop(
    "Under 30 minutes left: your balance %(balance)s lasts about %(left)s at %(burn)s/h; "
    "your clusters stop (files kept) when it runs out. Top up: %(url)s"
)
USED_UP_WORDS = gettext_noop(
    "Your balance %(balance)s is used up at %(burn)s/h: your clusters are being stopped "
    "(files kept). Top up: %(url)s"
)


def warning_summary(standing: selectors.Standing, *, critical: bool = False) -> Text:
    """The warning in words: "Your balance ¥3.20 lasts about 1 h 20 min at ¥2.4000/h; ..."."""
    url = webhooks.console_link("billing")
    balance = formatting.total_text(standing.balance, standing.currency)
    burn = formatting.text(formatting.amount(standing.burn_per_hour), standing.currency)
    if standing.seconds_left is None or standing.seconds_left <= 0:
        return Text(USED_UP_WORDS, balance=balance, burn=burn, url=url)
    return Text(
        CRITICAL_WORDS if critical else LOW_WORDS,
        balance=balance, left=Duration(standing.seconds_left), burn=burn, url=url,
    )  # fmt: skip


def _warn(account: Account, standing: selectors.Standing, event_type: str, marker: str) -> bool:
    """One warning, once per spell: the marker's conditional UPDATE and the event in one
    transaction (a second tick, or two at once, send nothing new). Whether an event was
    written."""
    with transaction.atomic():
        unset = {f"{marker}__isnull": True}
        if not Account.objects.filter(pk=account.pk, **unset).update(**{marker: timezone.now()}):
            return False
        event = webhooks.emit(
            owner_id=account.user_id,
            event_type=event_type,
            data={
                "balance": str(standing.balance), "currency": standing.currency,
                "burn_per_hour": str(standing.burn_per_hour), "hours_left": (
                    str(round(standing.hours_left, 2)) if standing.hours_left is not None else None
                ),
                "seconds_left": standing.seconds_left,
                "warn_hours": str(standing.warn_hours),
                "url": webhooks.console_link("billing"),
            },
            summary=warning_summary(standing, critical=event_type == "balance.critical"),
        )  # fmt: skip
    return event is not None  # None: no channel of the owner wants it (told all the same)


def notify_low_balances() -> int:
    """The running-low warnings, each once per spell: `balance.low` when the balance lasts
    less than the researcher's threshold (`Account.low_balance_hours`, else
    `SUANLI_LOW_BALANCE_HOURS`) at the current burn, `balance.critical` under 30 minutes.
    Looks at accounts whose clusters burn (running, or stopped with kept workspaces the card
    may price) and at those with a warning told (its spell ends when the balance lasts long
    enough again: the markers are cleared, the next low is told again). An account told
    `balance.exhausted` gets no warning while its balance is at or below 0: that message
    said it all (its clusters were stopped; bought storage may still be charged). Runs every minute
    (console/cron.py): the 30-minute warning comes with 29 minutes or more left. Returns
    how many events were written (a warning no channel wants is marked told, not counted)."""
    sent = 0
    burning = Cluster.objects.filter(
        state__in=[*Cluster.HOLDS_CAPACITY, Cluster.State.STOPPED]
    ).values_list("owner_id", flat=True)
    told = Q(low_notified_at__isnull=False) | Q(critical_notified_at__isnull=False)
    for account in Account.objects.filter(Q(user_id__in=burning) | told).select_related("user"):
        standing = selectors.standing(account.user)
        over = spells_over(account, standing)
        if over:
            Account.objects.filter(pk=account.pk).update(**{f: None for f in over})
        if not standing.burn_per_hour:
            continue  # nothing costs anything: nothing to warn of (balance.exhausted is told)
        if account.exhausted_notified_at is not None and standing.balance <= 0:
            continue  # told balance.exhausted: its clusters are stopped, not "being stopped"
        if standing.low and account.low_notified_at is None:
            sent += _warn(account, standing, "balance.low", "low_notified_at")
        if standing.critical and account.critical_notified_at is None:
            sent += _warn(account, standing, "balance.critical", "critical_notified_at")
    return sent

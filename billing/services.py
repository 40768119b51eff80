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
from decimal import Decimal

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from billing import rollups, selectors
from billing.models import Account, LedgerEntry
from jobs.base.text import fit
from jobs.events import webhooks
from jobs.models import Cluster

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
    fields = ["balance", "low_notified_at"]
    account.low_notified_at = None  # money in: a new low is worth telling again
    if account.balance > 0 and account.exhausted_at is not None:
        account.exhausted_at = None
        fields.append("exhausted_at")
    if account.balance > 0 and account.exhausted_notified_at is not None:
        account.exhausted_notified_at = None  # the next exhaustion is told again
        fields.append("exhausted_notified_at")
    account.save(update_fields=fields)
    return entry


# -- running out -----------------------------------------------------------------------------


def enough_balance(account: Account, per_hour: Decimal) -> bool:
    minutes = settings.SUANLI_MIN_BALANCE_MINUTES
    return account.balance >= per_hour * minutes / 60


def notify_low_balances() -> int:
    """`balance.low` once per low spell: accounts with running clusters (or stopped ones,
    whose kept workspaces burn when the card prices them) and under
    `SUANLI_LOW_BALANCE_HOURS` of balance left at the current burn."""
    sent = 0
    owners = Cluster.objects.filter(
        state__in=[Cluster.State.RUNNING, Cluster.State.STOPPED]
    ).values_list("owner_id", flat=True)
    for account in Account.objects.filter(
        user_id__in=set(owners), low_notified_at__isnull=True
    ).select_related("user"):
        standing = selectors.standing(account.user)
        if not standing.low:
            continue
        with transaction.atomic():
            if not Account.objects.filter(pk=account.pk, low_notified_at__isnull=True).update(
                low_notified_at=timezone.now()
            ):
                continue
            webhooks.emit(
                owner_id=account.user_id,
                event_type="balance.low",
                data={
                    "balance": str(standing.balance), "currency": standing.currency,
                    "burn_per_hour": str(standing.burn_per_hour), "hours_left": (
                        str(round(standing.hours_left, 2)) if standing.hours_left is not None else None
                    ),
                    "url": webhooks._link("billing"),
                },
            )  # fmt: skip
            sent += 1
    return sent

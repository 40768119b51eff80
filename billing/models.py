"""Money (docs/architecture.md, "Money"): a rate card with history, one prepaid account per researcher, an
immutable ledger whose entries each carry a unique idempotency key and the balance after
them, and one meter per cluster that says up to which second it has been billed.

Amounts are Decimal with 4 places (the smallest unit, `UNIT`); nothing here is a float.
"""

from __future__ import annotations

from datetime import UTC
from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist, ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone
from django.utils.translation import gettext_lazy, gettext_noop

from jobs.models import Cluster, GpuModel, InstanceType

UNIT = Decimal("0.0001")
MONEY = {"max_digits": 18, "decimal_places": 4}
# A researcher's low-balance warning: between half an hour and a week of balance left.
WARN_HOURS_MIN = Decimal("0.5")
WARN_HOURS_MAX = Decimal("168")


class RateCard(models.Model):
    """One version of the price list. The version in force at a second is the one with
    the latest `effective_from` at or before it; a change is a new version (the admin's
    "Save as new"), so history stays and every past second keeps its price."""

    effective_from = models.DateTimeField(
        default=timezone.now, unique=True, help_text="Prices apply from this second on."
    )
    currency = models.CharField(max_length=3, default="CNY")
    spot_discount_pct = models.DecimalField(
        max_digits=5, decimal_places=2, default=Decimal("60.00"),
        help_text="Spot clusters pay this much less (percent).",
    )  # fmt: skip
    min_charge_s = models.PositiveIntegerField(
        default=0, help_text="Minimum seconds charged per cluster (0: none)."
    )
    no_gpu_per_hour = models.DecimalField(
        "no-GPU mode, per node-hour", max_digits=12, decimal_places=4, default=Decimal("0.1000"),
        validators=[MinValueValidator(Decimal("0"))],
        help_text="A stopped GPU cluster started without GPUs (its workspaces only).",
    )  # fmt: skip
    stopped_per_hour = models.DecimalField(
        "stopped, per node-hour", max_digits=12, decimal_places=4, default=Decimal("0"),
        validators=[MinValueValidator(Decimal("0"))],
        help_text="A stopped cluster's kept workspaces (their disk). 0: free.",
    )  # fmt: skip
    storage_per_gb_hour = models.DecimalField(
        "storage, per GB-hour", max_digits=12, decimal_places=6, default=Decimal("0.000300"),
        validators=[MinValueValidator(Decimal("0"))],
        help_text="Storage a researcher bought above the free part (SUANLI_STORAGE_FREE_GB), "
        "per GB-hour (1 GB = 1024³ bytes). 0: free.",
    )  # fmt: skip
    note = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )

    class Meta:
        verbose_name = gettext_lazy("rate card")
        verbose_name_plural = gettext_lazy("rate cards")
        ordering = ["-effective_from"]

    def __str__(self) -> str:
        return f"rate card from {self.effective_from:%Y-%m-%d %H:%M:%S} ({self.currency})"

    @property
    def in_force_or_past(self) -> bool:
        return self.pk is not None and self.effective_from <= timezone.now()


class Price(models.Model):
    """One line of a rate card: per GPU-hour of a GPU model, or per instance-hour of a
    CPU-only instance type."""

    card = models.ForeignKey(RateCard, on_delete=models.CASCADE, related_name="prices")
    gpu_model = models.ForeignKey(
        GpuModel, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    instance_type = models.ForeignKey(
        InstanceType, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    per_hour = models.DecimalField(
        max_digits=12, decimal_places=4, help_text="Per GPU-hour, or per instance-hour."
    )

    class Meta:
        verbose_name = gettext_lazy("price")
        verbose_name_plural = gettext_lazy("prices")
        ordering = ["card", "gpu_model", "instance_type"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(gpu_model__isnull=True, instance_type__isnull=False)
                | models.Q(gpu_model__isnull=False, instance_type__isnull=True),
                name="price_one_resource",
            ),
            models.UniqueConstraint(fields=["card", "gpu_model"], name="price_unique_gpu"),
            models.UniqueConstraint(fields=["card", "instance_type"], name="price_unique_cpu"),
            models.CheckConstraint(condition=models.Q(per_hour__gte=0), name="price_not_negative"),
        ]

    def __str__(self) -> str:
        return f"{self.gpu_model or self.instance_type}: {self.per_hour}/h"


class Account(models.Model):
    """A researcher's prepaid balance. It changes only under its row lock, in the same
    transaction as the ledger entry that explains the change."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="account",
        verbose_name=gettext_lazy("user"),
    )  # fmt: skip
    balance = models.DecimalField(gettext_lazy("balance"), default=Decimal("0"), **MONEY)
    low_notified_at = models.DateTimeField(
        gettext_lazy("low balance told at"), null=True, blank=True,
        help_text=gettext_lazy(
            "When balance.low was last sent (cleared when the balance lasts long enough again)."
        ),
    )  # fmt: skip
    exhausted_at = models.DateTimeField(
        gettext_lazy("stopped for balance at"), null=True, blank=True,
        help_text=gettext_lazy("When its clusters were stopped for balance."),
    )  # fmt: skip
    exhausted_notified_at = models.DateTimeField(
        gettext_lazy("exhaustion told at"), null=True, blank=True,
        help_text=gettext_lazy("When balance.exhausted was sent (cleared by a top-up)."),
    )  # fmt: skip
    # The researcher's own "warn me when less than N hours are left" (their settings page,
    # the API's /balance/warning); empty: the operator's SUANLI_LOW_BALANCE_HOURS.
    low_balance_hours = models.DecimalField(
        gettext_lazy("warn below (hours)"), max_digits=5, decimal_places=2,
        null=True, blank=True,
        validators=[MinValueValidator(WARN_HOURS_MIN), MaxValueValidator(WARN_HOURS_MAX)],
        help_text=gettext_lazy(
            "balance.low when the balance lasts fewer hours than this at the current burn; "
            "empty: the operator's default."
        ),
    )  # fmt: skip
    critical_notified_at = models.DateTimeField(
        gettext_lazy("critical balance told at"), null=True, blank=True,
        help_text=gettext_lazy(
            "When balance.critical (under 30 minutes left) was last sent (cleared when the "
            "balance lasts long enough again)."
        ),
    )  # fmt: skip

    class Meta:
        verbose_name = gettext_lazy("account")
        verbose_name_plural = gettext_lazy("accounts")
        constraints = [
            models.CheckConstraint(
                condition=models.Q(low_balance_hours__isnull=True)
                | models.Q(
                    low_balance_hours__gte=WARN_HOURS_MIN, low_balance_hours__lte=WARN_HOURS_MAX
                ),
                name="account_warn_hours_in_range",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.holder} ({self.balance})"

    @property
    def holder(self) -> str:
        """Whose it is, as operators know them: a researcher's login, or a team's name."""
        try:
            return f"{self.user.team.name} (team)"
        except ObjectDoesNotExist:
            return str(self.user)


class LedgerEntry(models.Model):
    """Immutable: a correction is a new entry (refund, adjustment, credit)."""

    class Kind(models.TextChoices):
        TOPUP = "topup", gettext_lazy("top-up")
        USAGE = "usage", gettext_lazy("usage")
        REFUND = "refund", gettext_lazy("refund")
        ADJUSTMENT = "adjustment", gettext_lazy("adjustment")
        CREDIT = "credit", gettext_lazy("credit")
        # Money a team member moved from their own balance into a team (or back out of theirs):
        # two entries, one on each account (billing.services.transfer_to_team).
        TRANSFER = "transfer", gettext_lazy("transfer")

    account = models.ForeignKey(
        Account, on_delete=models.PROTECT, related_name="entries",
        verbose_name=gettext_lazy("account"),
    )  # fmt: skip
    kind = models.CharField(gettext_lazy("kind"), max_length=10, choices=Kind.choices)
    amount = models.DecimalField(
        gettext_lazy("amount"), help_text=gettext_lazy("Signed: usage is negative."), **MONEY
    )
    balance_after = models.DecimalField(gettext_lazy("balance after"), **MONEY)
    key = models.CharField(
        gettext_lazy("idempotency key"), max_length=120, unique=True,
        help_text=gettext_lazy("Idempotency key."),
    )  # fmt: skip
    cluster = models.ForeignKey(
        Cluster, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    period_from = models.DateTimeField(null=True, blank=True)
    period_to = models.DateTimeField(null=True, blank=True)
    units = models.PositiveIntegerField(
        default=0, help_text="GPUs (or CPU-only instances) held during the period."
    )
    rate = models.DecimalField(
        max_digits=16, decimal_places=8, null=True, blank=True,
        help_text="Per unit-hour, after the spot discount.",
    )  # fmt: skip
    gpu_model = models.ForeignKey(
        GpuModel, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    memo = models.CharField(gettext_lazy("reason"), max_length=300, blank=True)
    created_at = models.DateTimeField(gettext_lazy("posted at"), default=timezone.now)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True, related_name="+",
        verbose_name=gettext_lazy("posted by"),
    )  # fmt: skip
    # A team's usage: the person whose budget it counts against (who made the cluster, when
    # it was charged: `Cluster.created_by` may later be handed on, the charge stays theirs).
    # Empty for one researcher's own account and for a team's storage (the team's).
    member = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True,
        related_name="+", verbose_name=gettext_lazy("team member"),
    )  # fmt: skip

    class Meta:
        verbose_name = gettext_lazy("ledger entry")
        verbose_name_plural = gettext_lazy("ledger entries")
        ordering = ["-created_at", "-id"]
        # Operators post top-ups, refunds, adjustments and credits (billing admin, an
        # account's entry form) only with this; viewing accounts does not grant it.
        permissions = [("post_ledgerentry", "Can post top-ups, refunds and adjustments")]
        indexes = [
            # The detail view (an account's entries, newest first), one cluster-hour's
            # pieces, the admin's list of everything newest first.
            models.Index(fields=["account", "-created_at", "-id"], name="ledger_account_at"),
            models.Index(fields=["cluster", "period_from"], name="ledger_cluster_from"),
            models.Index(fields=["-created_at", "-id"], name="ledger_created"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.amount} ({self.key})"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise ValidationError("Ledger entries are immutable: add a correcting entry.")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise ValidationError("Ledger entries are immutable: add a correcting entry.")

    @property
    def seconds(self) -> int | None:
        if self.period_from and self.period_to:
            return int((self.period_to - self.period_from).total_seconds())
        return None


class Meter(models.Model):
    """How far a cluster has been billed. `exact` is the exact cost so far times 3600 (an
    exact Decimal: unit-seconds x rate per hour); `charged` is what the ledger holds for the
    cluster, always `round_half_up(exact / 3600)`."""

    cluster = models.OneToOneField(
        Cluster, on_delete=models.PROTECT, primary_key=True, related_name="meter"
    )
    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="meters")
    billed_until = models.DateTimeField()
    exact = models.DecimalField(max_digits=40, decimal_places=10, default=Decimal("0"))
    charged = models.DecimalField(default=Decimal("0"), **MONEY)
    settled = models.BooleanField(default=False)

    class Meta:
        verbose_name = gettext_lazy("meter")
        verbose_name_plural = gettext_lazy("meters")
        indexes = [
            models.Index(
                fields=["settled"], condition=models.Q(settled=False), name="meter_open_idx"
            )
        ]

    def __str__(self) -> str:
        return f"meter of {self.cluster_id} up to {self.billed_until}"


class StorageMeter(models.Model):
    """How far an account's bought storage has been billed (billing/storage.py), as a
    cluster's `Meter`: `exact` is the exact cost so far times 3600 (GB-seconds x rate per
    GB-hour), `charged` what the ledger holds for it, always `round_half_up(exact / 3600)`.
    It moves in whole UTC hours, up to the last hour that has ended."""

    account = models.OneToOneField(
        Account, on_delete=models.PROTECT, primary_key=True, related_name="storage_meter"
    )
    billed_until = models.DateTimeField()
    exact = models.DecimalField(max_digits=40, decimal_places=10, default=Decimal("0"))
    charged = models.DecimalField(default=Decimal("0"), **MONEY)

    class Meta:
        verbose_name = gettext_lazy("storage meter")
        verbose_name_plural = gettext_lazy("storage meters")

    def __str__(self) -> str:
        return f"storage meter of {self.account_id} up to {self.billed_until}"


# A storage line's resource (bill, daily usage, revenue) and memo; stored in English, shown
# translated.
STORAGE_RESOURCE = gettext_noop("storage (GB)")
STORAGE_MEMO = gettext_noop("storage bought above the free part")


class BillLine(models.Model):
    """The bill as people read it, written in the same transaction as the ledger entries
    it sums (billing.rollups): a usage line is one cluster's pieces whose period began in
    one UTC hour, at one size and rate (the hour's exact seconds, its pieces and their
    sum); every other entry, and a cluster's minimum charge, is a line of its own. Pages,
    statements and charts read these; the pieces are read for one cluster-hour's audit."""

    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="bill_lines")
    kind = models.CharField(max_length=10, choices=LedgerEntry.Kind.choices)
    at = models.DateTimeField(help_text="Usage: the start of its hour; else when it was posted.")
    amount = models.DecimalField(help_text="Signed: usage is negative.", **MONEY)
    cluster = models.ForeignKey(
        Cluster, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    hour = models.DateTimeField(null=True, blank=True, help_text="Usage pieces' UTC hour.")
    units = models.PositiveIntegerField(default=0)
    rate = models.DecimalField(max_digits=16, decimal_places=8, null=True, blank=True)
    gpu_model = models.ForeignKey(
        GpuModel, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    seconds = models.PositiveIntegerField(null=True, blank=True)
    pieces = models.PositiveIntegerField(default=1)
    period_from = models.DateTimeField(null=True, blank=True)
    period_to = models.DateTimeField(null=True, blank=True)
    charged_at = models.DateTimeField(help_text="When its last piece was charged.")
    entry = models.OneToOneField(
        LedgerEntry, on_delete=models.PROTECT, null=True, blank=True, related_name="+",
        help_text="The entry of a line that is one entry (not a usage hour).",
    )  # fmt: skip
    memo = models.CharField(max_length=300, blank=True)
    # Its entries' `member` (a team's usage: whose budget it counts against): an hour line
    # is one member's, so that a month's spending per member sums lines, not pieces.
    member = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True,
        related_name="+",
    )  # fmt: skip

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [
            models.Index(fields=["account", "-at", "-id"], name="billline_account_at"),
            models.Index(fields=["account", "kind", "-at", "-id"], name="billline_kind_at"),
            models.Index(fields=["cluster", "-at", "-id"], name="billline_cluster_at"),
            # A member's spending this month (caps, the team's billing page).
            models.Index(
                fields=["account", "member", "at"],
                condition=models.Q(member__isnull=False),
                name="billline_member_at",
            ),  # fmt: skip
        ]
        constraints = [
            # One line per cluster, hour, size, rate, memo and member (a cluster handed on
            # within an hour has one line for each member; no member is a value here).
            models.UniqueConstraint(
                fields=["cluster", "hour", "units", "rate", "memo", "member"],
                condition=models.Q(hour__isnull=False, cluster__isnull=False),
                nulls_distinct=False,
                name="billline_one_per_hour_member",
            ),
            # A storage line: the account's bought storage in one UTC hour, at one size and rate.
            models.UniqueConstraint(
                fields=["account", "hour", "units", "rate", "memo"],
                condition=models.Q(hour__isnull=False, cluster__isnull=True),
                name="billline_storage_per_hour",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.amount} at {self.at:%Y-%m-%d %H:%M}"

    @property
    def is_usage(self) -> bool:
        return self.kind == LedgerEntry.Kind.USAGE

    @property
    def hour_key(self) -> str:
        """The detail view's `hour` parameter for this line ("2026-12-03T10", UTC)."""
        return self.hour.astimezone(UTC).strftime("%Y-%m-%dT%H") if self.hour else ""

    @property
    def is_storage(self) -> bool:
        """An hour of the storage bought above the free part (no cluster's)."""
        return self.is_usage and self.cluster_id is None and self.hour is not None

    @property
    def resource(self) -> str:
        """The GPU model, or the CPU-only instance type (select_related both), or storage."""
        if self.is_storage:
            return STORAGE_RESOURCE
        if self.gpu_model_id:
            return self.gpu_model.name
        if self.cluster_id and self.cluster.instance_type_id:
            return self.cluster.instance_type.name
        return ""

    # The account's balance right after this line in the bill's order (at, then id): set by
    # billing.selectors (`balances_after` for a page, `with_running_balance` for a
    # statement); None where no one worked it out.
    balance_after: Decimal | None = None

    @property
    def key(self) -> str:
        return self.entry.key if self.entry_id else ""

    @property
    def cluster_name(self) -> str:
        return self.cluster.name if self.cluster_id else ""


class UsageDay(models.Model):
    """Usage per account, UTC day and resource (the GPU model or CPU-only instance type by
    name): the daily chart and the operators' revenue. Written with the bill lines."""

    account = models.ForeignKey(Account, on_delete=models.PROTECT, related_name="usage_days")
    day = models.DateField()
    resource = models.CharField(max_length=100)
    amount = models.DecimalField(help_text="Charged (positive).", **MONEY)
    seconds = models.BigIntegerField(default=0, help_text="Unit-seconds.")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["account", "day", "resource"], name="usageday_unique")
        ]
        indexes = [models.Index(fields=["day"], name="usageday_day")]

    def __str__(self) -> str:
        return f"{self.account_id} {self.day} {self.resource}: {self.amount}"

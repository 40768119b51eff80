"""Storage's money: a researcher's quota (the free part plus what they bought), its changes
from the storage page, and its hourly bill.

What is charged: the storage bought above the free part (SUANLI_STORAGE_FREE_GB), per
GB-hour at the rate card's storage price, for every second it is held, filled or not (as
RunPod bills a network volume's size; AutoDL bills its measured usage above a free 20 GB
once a day). The bought size, not a measured usage, because it is what the filesystem
holds for the researcher and enforces (jobs/files/storage.py turns it into the MooseFS quota of
their root), because it is exact to the second (a sample of usage misses what was written
and deleted between two samples, and the bill could not be checked against anything), and
because the researcher decides it: lower it to pay less, never below what the files take.

The ledger gets one usage entry per account and UTC hour (`storage:<account>:<from>:<to>`,
epoch seconds; a unique key), written once the hour has ended; an hour is split only at the
second the bought size or the price changed in it. As a cluster's meter does, the account's
`StorageMeter` keeps the exact cost so far (GB-seconds x rate, an exact Decimal) and what
the ledger charged, so the entries always add up to the exact cost rounded once. The meter
moves forward only, under its row lock: running an hour again charges nothing.

Reads from jobs: the bought storage (models.StorageGrant) and the tenant's usage
(jobs/files/storage.py); the one write into jobs' tables is a StorageGrant, here, because a
change of the bought size is a money decision (checked against the balance and billed
from its second on). Locks: the owner's quota lock (storage.quota_lock, which every write
of the filesystem's quota takes), then in the accrual's order the storage meter, then the
account.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Min
from django.utils import timezone
from django.utils.translation import gettext as _

from billing import accrual, caps, rollups
from billing import services as money
from billing.models import STORAGE_MEMO, STORAGE_RESOURCE, UNIT, Account, LedgerEntry, StorageMeter
from billing.pricing import RateBook, to_money
from jobs.base.sql import insert_rows, update_rows
from jobs.files import storage
from jobs.models import StorageGrant
from jobs.nodes import runtime

log = logging.getLogger(__name__)

HOUR = timedelta(hours=1)
CENT_GB = Decimal("0.01")
WHOLE = re.compile(r"-?[0-9]{1,30}")  # ASCII digits only: not "１０", "1e3" or "2.5"


# -- what a researcher has -----------------------------------------------------------------


@dataclass(frozen=True)
class StorageSummary:
    """A researcher's storage as the pages show it: usage against the quota, its parts, and
    what the bought part costs."""

    enforced: bool  # the filesystem enforces the quota (MooseFS), or a local folder does not
    free_gb: Decimal
    extra_gb: int
    used: storage.Usage
    currency: str
    per_gb_hour: Decimal | None  # None: no rate card in force
    max_gb: int
    error: str = ""  # the filesystem's words when it could not say the usage
    files_max: int = 0  # files and folders the storage may hold (SUANLI_STORAGE_FILES_MAX)

    @property
    def quota_gb(self) -> Decimal:
        return self.free_gb + self.extra_gb

    @property
    def quota_bytes(self) -> int:
        return storage.gb_bytes(self.quota_gb)

    @property
    def used_gb(self) -> Decimal:
        return (Decimal(self.used.bytes) / storage.GB).quantize(CENT_GB, rounding=ROUND_HALF_UP)

    @property
    def used_pct(self) -> int:
        """Of the quota, 0-100 (the bar's width)."""
        if self.quota_bytes <= 0:
            return 100 if self.used.bytes else 0
        pct = min(100, self.used.bytes * 100 // self.quota_bytes)
        return max(pct, 1) if self.used.bytes else pct  # a file is never "0 %"

    @property
    def over(self) -> bool:
        return self.used.bytes > self.quota_bytes

    @property
    def files_full(self) -> bool:
        """No new file or folder fits (an enforced quota)."""
        return self.enforced and self.used.complete and self.used.files >= self.files_max

    @property
    def min_extra_gb(self) -> int:
        return min_extra_for(self.used.bytes, self.free_gb)

    @property
    def max_extra_gb(self) -> int:
        return max(0, int(Decimal(self.max_gb) - self.free_gb))

    @property
    def per_hour(self) -> Decimal | None:
        """What the bought part costs per hour now."""
        if self.per_gb_hour is None:
            return None
        return (self.per_gb_hour * self.extra_gb).quantize(UNIT, rounding=ROUND_HALF_UP)

    @property
    def per_gb_month(self) -> Decimal | None:
        """One GB for 30 days, for a feel of the price."""
        if self.per_gb_hour is None:
            return None
        return (self.per_gb_hour * 720).quantize(UNIT, rounding=ROUND_HALF_UP)


def min_extra_for(used_bytes: int, free_gb: Decimal) -> int:
    """The fewest whole GB to buy above the free part for a quota that holds `used_bytes`."""
    need = Decimal(used_bytes) / storage.GB - free_gb
    return max(0, math.ceil(need))


def per_gb_hour(book: RateBook | None = None, now: datetime | None = None) -> Decimal | None:
    card = (book or RateBook.load()).at(now or timezone.now())
    return card.storage if card is not None else None


def summary(user, *, book: RateBook | None = None) -> StorageSummary:
    book = book or RateBook.load()
    error = ""
    try:
        used = storage.usage(user.pk)
    except storage.QuotaError as exc:
        used, error = storage.Usage(0, complete=False), exc.messages[0]
    return StorageSummary(
        enforced=storage.enforced(),
        free_gb=storage.free_gb(),
        extra_gb=storage.extra_gb(user.pk),
        used=used,
        currency=book.currency,
        per_gb_hour=per_gb_hour(book),
        max_gb=settings.SUANLI_STORAGE_MAX_GB,
        error=error,
        files_max=storage.files_max(),
    )


@dataclass(frozen=True)
class Held:
    """A researcher's storage on an operator's page."""

    used: storage.Usage
    quota_gb: Decimal
    extra_gb: int

    @property
    def used_gb(self) -> Decimal:
        return (Decimal(self.used.bytes) / storage.GB).quantize(CENT_GB, rounding=ROUND_HALF_UP)


def held_by(user_ids) -> tuple[dict[int, Held], str]:
    """Each researcher's usage and quota, and the filesystem's words when it could not say
    the usage (then every usage reads as unknown)."""
    ids = list(user_ids)
    error = ""
    try:
        used = storage.usages(ids)
    except storage.QuotaError as exc:
        used, error = {pk: storage.Usage(0, complete=False) for pk in ids}, exc.messages[0]
    free = storage.free_gb()
    extra = storage.extra_gbs(ids)
    return {pk: Held(used[pk], free + extra[pk], extra[pk]) for pk in ids}, error


@dataclass(frozen=True)
class Unbounded:
    """Space that files deleted while still open hold, under no quota, above
    SUANLI_STORAGE_SUSTAINED_MAX_GB (an operator's page), and whose open files hold it."""

    gb: Decimal
    files: int
    most_gb: int
    holders: list[tuple[str, int]]  # (researcher, open deleted files), most first


def unbounded() -> tuple[Unbounded | None, str]:
    """The sustained space when it is over the threshold (else None), and the filesystem's
    words when it could not say (MooseFS only)."""
    if not storage.enforced() or not settings.SUANLI_STORAGE_MASTER:
        return None, ""
    try:
        found = storage.orphans()
    except storage.QuotaError as exc:
        return None, exc.messages[0]
    if not found.over:
        return None, ""
    names = dict(
        get_user_model().objects.filter(pk__in=found.by_owner).values_list("pk", "username")
    )
    holders = sorted(
        ((names.get(pk, f"u{pk}"), n) for pk, n in found.by_owner.items()), key=lambda h: -h[1]
    )
    return Unbounded(
        found.sustained_gb, found.sustained_files, settings.SUANLI_STORAGE_SUSTAINED_MAX_GB, holders
    ), ""


# -- changing it ------------------------------------------------------------------------------


@transaction.atomic
def quota_set(*, owner, extra_gb, now: datetime | None = None, by=None) -> StorageGrant | None:
    """Set the GB `owner` buys above the free part, from this second on, and the
    filesystem's quota with it (in this transaction: if the filesystem refuses, nothing is
    bought). Refused with a sentence: not a whole number of GB, below 0, more than
    SUANLI_STORAGE_MAX_GB in all, a quota below what the files take now, or a raise the
    balance cannot pay for SUANLI_MIN_BALANCE_MINUTES, or (`by`: the team member who buys
    it for a team) that would pass their monthly cap (billing.caps). None when it is
    already so."""
    extra = _whole_gb(extra_gb)
    free = storage.free_gb()
    most = settings.SUANLI_STORAGE_MAX_GB
    if free + extra > most:
        raise ValidationError(
            _(
                "At most %(most)s GB in all: with the free %(free)s GB you can buy up to "
                "%(extra)s GB."
            )
            % {"most": most, "free": free, "extra": max(0, int(most - free))},
            code="too_much",
        )
    account = money.account_for(owner)
    now = money.floor_s(now or timezone.now())
    # The owner's quota lock first, held to the commit: a start that writes the filesystem's
    # quota meanwhile (storage.quota_apply) reads the bought size after this change.
    storage.quota_lock(owner.pk)
    meter = StorageMeter.objects.select_for_update().filter(account=account).first()
    account = Account.objects.select_for_update().get(pk=account.pk)
    # Never inside an hour that was billed already: that hour keeps the size it was billed at.
    since = max(now, meter.billed_until) if meter is not None else now
    current = storage.extra_gb(owner.pk, at=since)
    if extra == current:
        return None
    if extra < current:
        used = storage.usage(owner.pk)
        if storage.gb_bytes(free + extra) < used.bytes:
            lowest = min_extra_for(used.bytes, free)
            raise ValidationError(
                _(
                    "Your files take %(used)s GB, more than a quota of %(quota)s GB would hold: "
                    "keep at least %(lowest)s GB above the free %(free)s GB, or delete files "
                    "first."
                )
                % {
                    "used": (Decimal(used.bytes) / storage.GB).quantize(CENT_GB),
                    "quota": free + extra,
                    "lowest": lowest,
                    "free": free,
                },
                code="below_usage",
            )
    else:
        rate = per_gb_hour(now=now) or Decimal(0)
        if not money.enough_balance(account, rate * extra):
            raise ValidationError(
                _(
                    "Your balance does not cover %(minutes)s minutes of %(extra)s GB "
                    "(%(per_hour)s per hour): top up first."
                )
                % {
                    "minutes": settings.SUANLI_MIN_BALANCE_MINUTES,
                    "extra": extra,
                    "per_hour": (rate * extra).quantize(UNIT, rounding=ROUND_HALF_UP),
                },
                code="balance",
            )
        added = rate * (extra - current)
        if by is not None and (why := caps.cap_refusal(principal=owner, person=by, per_hour=added)):
            raise ValidationError(why, code="cap")
    grant, _made = StorageGrant.objects.update_or_create(
        owner=owner, since=since, defaults={"extra_gb": extra}
    )
    # Makes the root where it is missing, and writes its quota (MooseFS) from the row above.
    storage.ensure_folders(
        storage.tenant_root(owner.pk), [], uid=runtime.tenant_uid(owner.pk), quota=True
    )
    return grant


def _whole_gb(value) -> int:
    text = str(value).strip()
    if not WHOLE.fullmatch(text):
        raise ValidationError(
            _("Give a whole number of GB, e.g. 50 (not %(value)s).") % {"value": text[:20]},
            code="not_a_number",
        )
    number = int(text)
    if number < 0:
        raise ValidationError(_("Give 0 or more GB: 0 keeps the free part only."), code="negative")
    return number


# -- the hourly bill --------------------------------------------------------------------------


@dataclass
class StorageReport:
    until: datetime
    accounts: int = 0
    entries: int = 0
    charged: Decimal = Decimal("0")
    exhausted: list[int] = field(default_factory=list)


def hour_floor(when: datetime) -> datetime:
    return rollups.hour_of(when)


def open_meters() -> int:
    """A storage meter for every researcher who ever bought storage and has none yet; it
    starts at the second of their first purchase."""
    fresh = list(
        StorageGrant.objects.filter(owner__account__storage_meter__isnull=True)
        .values("owner_id")
        .annotate(first=Min("since"))
        .order_by()
    )
    if not fresh:
        return 0
    owners = {row["owner_id"] for row in fresh}
    Account.objects.bulk_create([Account(user_id=o) for o in owners], ignore_conflicts=True)
    accounts = dict(Account.objects.filter(user_id__in=owners).values_list("user_id", "pk"))
    StorageMeter.objects.bulk_create(
        [
            StorageMeter(
                account_id=accounts[row["owner_id"]], billed_until=money.floor_s(row["first"])
            )
            for row in fresh
        ],
        ignore_conflicts=True,  # another run made it meanwhile: the same start either way
    )
    return len(fresh)


def accrue(*, now: datetime | None = None, batch: int = 500) -> StorageReport:
    """Charge every account's bought storage up to the last whole UTC hour before `now`.
    Safe to run again, or twice at once: a meter is read under its row lock and moves
    forward only."""
    until = hour_floor(now or timezone.now())
    report = StorageReport(until=until)
    open_meters()
    book = RateBook.load()
    ids = list(
        StorageMeter.objects.filter(billed_until__lt=until)
        .order_by("account_id")
        .values_list("account_id", flat=True)
    )
    for start in range(0, len(ids), batch):
        _accrue_batch(ids[start : start + batch], until, book, report)
    if report.exhausted:
        accrual.stop_exhausted(report.exhausted)
    return report


@dataclass
class _Piece:
    start: datetime
    end: datetime
    gb: int
    rate: Decimal | None


def pieces(
    grants: list[tuple[datetime, int]], *, since: datetime, until: datetime, book: RateBook
) -> list[_Piece]:
    """(since, until] cut at each UTC hour, each change of the bought size (`grants`:
    (second, GB) in order) and each new rate card; neighbours in one hour at one size and
    rate joined. Pieces of 0 GB are left out."""
    points = {since, until}
    hour = hour_floor(since) + HOUR
    while hour < until:
        points.add(hour)
        hour += HOUR
    points.update(t for t, _gb in grants if since < t < until)
    points.update(book.changes_between(since, until))
    ordered = sorted(points)
    out: list[_Piece] = []
    for a, b in zip(ordered, ordered[1:], strict=False):
        gb = 0
        for t, size in grants:
            if t > a:
                break
            gb = size
        card = book.at(a)
        rate = card.storage if card is not None else None
        last = out[-1] if out else None
        if (
            last
            and (last.gb, last.rate, last.end) == (gb, rate, a)
            and hour_floor(a) == hour_floor(last.start)
        ):
            last.end = b
        else:
            out.append(_Piece(a, b, gb, rate))
    return [p for p in out if p.gb]


def _accrue_batch(account_ids: list[int], until: datetime, book: RateBook, report) -> None:
    entries: list[tuple] = []
    rolled: list[rollups.Piece] = []
    with transaction.atomic():
        meters = list(
            StorageMeter.objects.select_for_update()
            .filter(account_id__in=account_ids, billed_until__lt=until)
            .order_by("account_id")
        )
        if not meters:
            return
        accounts = {
            a.pk: a
            for a in Account.objects.select_for_update()
            .filter(pk__in=[m.account_id for m in meters])
            .order_by("pk")
        }
        users = {a.user_id: a.pk for a in accounts.values()}
        grants: dict[int, list[tuple[datetime, int]]] = {}
        for owner_id, since, gb in (
            StorageGrant.objects.filter(owner_id__in=users, since__lt=until)
            .order_by("owner_id", "since")
            .values_list("owner_id", "since", "extra_gb")
        ):
            grants.setdefault(users[owner_id], []).append((since, gb))
        written = timezone.now()
        charged = set()
        for meter in meters:
            account = accounts[meter.account_id]
            for piece in pieces(
                grants.get(account.pk, []), since=meter.billed_until, until=until, book=book
            ):
                if not piece.rate:
                    continue  # no card, or storage free: a bill of zero lines says nothing
                seconds = int((piece.end - piece.start).total_seconds())
                meter.exact += piece.gb * seconds * piece.rate
                total = to_money(meter.exact)
                amount = total - meter.charged
                meter.charged = total
                account.balance -= amount
                charged.add(account.pk)
                key = f"storage:{account.pk}:{money.epoch(piece.start)}:{money.epoch(piece.end)}"
                entries.append(
                    (
                        account.pk, LedgerEntry.Kind.USAGE.value, -amount, account.balance, key,
                        None, piece.start, piece.end, piece.gb, piece.rate, None, STORAGE_MEMO,
                        written, None,  # a team's storage is the team's: no member's budget
                    )
                )  # fmt: skip
                rolled.append(
                    rollups.Piece(
                        account.pk, -amount, None, piece.start, piece.end, piece.gb, piece.rate,
                        None, STORAGE_MEMO, written, STORAGE_RESOURCE,
                    )
                )  # fmt: skip
            meter.billed_until = until
        # A key charged before cannot recur (the meters moved past it in the same
        # transaction); were it to, the unique constraint rolls the whole batch back.
        insert_rows(LedgerEntry, accrual.ENTRY_FIELDS, entries)
        rollups.add_usage(rolled)
        update_rows(
            StorageMeter,
            "account",
            ["billed_until", "exact", "charged"],
            [(m.account_id, m.billed_until, m.exact, m.charged) for m in meters],
        )
        exhausted = []
        for pk in charged:
            account = accounts[pk]
            if account.balance <= 0:
                account.exhausted_at = account.exhausted_at or until
                exhausted.append(pk)
        update_rows(
            Account, "id", ["balance", "exhausted_at"],
            [(pk, accounts[pk].balance, accounts[pk].exhausted_at) for pk in sorted(charged)],
        )  # fmt: skip
    report.accounts += len(meters)
    report.entries += len(entries)
    report.charged += sum((-e[2] for e in entries), Decimal("0"))
    report.exhausted += exhausted

"""Prices and the one rounding rule.

The rule: a cluster's exact cost so far is `sum(units x seconds x rate_per_hour) / 3600`,
kept exactly (as the numerator, a Decimal). What the ledger has charged the cluster is
that exact cost rounded half-up to `UNIT` (0.0001); each new charge is the rounded new
total minus what was charged before. The charges of a cluster therefore always add up to
its exact cost rounded once, however many accrual periods it spans, and whatever the
kinds of time in them (GPU, no-GPU mode, kept while stopped) add up to.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal, localcontext

from billing.models import UNIT, RateCard

HUNDRED = Decimal(100)

# What a node holds during an interval; each kind is priced by a line of its own on the card.
GPU = "gpu"  # its GPUs, or its CPU-only instance: the cluster's price, per unit-hour
NO_GPU = "no-gpu"  # started without GPUs: the card's no-GPU price, per node-hour
STOPPED = "stopped"  # a stopped node's kept workspace: the card's stopped price, per node-hour
KINDS = (GPU, NO_GPU, STOPPED)
# Not a node's: an account's storage bought above the free part, per GB-hour (billing/storage.py).
STORAGE = "storage"


def charged_at(kind: str, balance: Decimal) -> bool:
    """Whether time of `kind` is charged at `balance`: the one rule of the accrual
    (billing/accrual.py) and of the burn a researcher is shown and warned of
    (billing/selectors.py). Kept workspaces are not charged while the balance is at or
    below 0 (kept through the retention period, the ledger at most one period negative);
    storage is charged at any balance; running time is, until its clusters are stopped."""
    return not (kind == STOPPED and balance <= 0)


def kind_of_key(key: str) -> str:
    """The kind of time a usage entry charged, from its idempotency key: GPU time keeps
    the key it always had (`usage:<cluster>:<from>:<to>`), the others end in their kind."""
    if key.startswith(f"{STORAGE}:"):
        return STORAGE  # `storage:<account>:<from>:<to>`
    tail = key.rsplit(":", 1)[-1]
    return tail if tail in (NO_GPU, STOPPED) else GPU


def to_money(exact_x3600: Decimal) -> Decimal:
    """Round an exact cost (times 3600) to the smallest unit, half-up."""
    with localcontext() as ctx:
        ctx.prec = 60  # far more digits than any amount here: the division cannot mis-round
        return (Decimal(exact_x3600) / 3600).quantize(UNIT, rounding=ROUND_HALF_UP)


def per_hour_of(per_unit_hour: Decimal, units: int) -> Decimal:
    return (per_unit_hour * units).quantize(UNIT, rounding=ROUND_HALF_UP)


@dataclass
class Card:
    effective_from: datetime
    currency: str
    spot_discount_pct: Decimal
    min_charge_s: int
    gpu: dict[int, Decimal] = field(default_factory=dict)
    cpu: dict[int, Decimal] = field(default_factory=dict)
    no_gpu: Decimal = Decimal("0")  # per node-hour, never spot-discounted
    stopped: Decimal = Decimal("0")  # per node-hour; 0: kept workspaces are free
    storage: Decimal = Decimal("0")  # per GB-hour bought above the free part; 0: free

    def rate(self, *, gpu_model_id: int | None, instance_type_id: int | None, spot: bool):
        """Per unit-hour after the spot discount, or None when the card has no price."""
        base = self.gpu.get(gpu_model_id) if gpu_model_id else self.cpu.get(instance_type_id)
        if base is None:
            return None
        if spot:
            return base * (HUNDRED - self.spot_discount_pct) / HUNDRED
        return base

    def rate_of(self, kind: str, *, gpu_model_id, instance_type_id, spot: bool):
        """Per unit-hour of this kind of time (a node is the unit of no-GPU and stopped
        time), or None when the card has no price for the cluster's GPUs."""
        if kind == NO_GPU:
            return self.no_gpu
        if kind == STOPPED:
            return self.stopped
        return self.rate(gpu_model_id=gpu_model_id, instance_type_id=instance_type_id, spot=spot)


class RateBook:
    """Every version of the rate card, loaded once: the card in force at any second."""

    def __init__(self, cards: list[Card]):
        self.cards = sorted(cards, key=lambda c: c.effective_from)
        self._starts = [c.effective_from for c in self.cards]

    @classmethod
    def load(cls) -> RateBook:
        cards = []
        for card in RateCard.objects.prefetch_related("prices"):
            c = Card(
                card.effective_from.replace(microsecond=0),
                card.currency,
                card.spot_discount_pct,
                card.min_charge_s,
                no_gpu=card.no_gpu_per_hour,
                stopped=card.stopped_per_hour,
                storage=card.storage_per_gb_hour,
            )
            for price in card.prices.all():
                if price.gpu_model_id:
                    c.gpu[price.gpu_model_id] = price.per_hour
                else:
                    c.cpu[price.instance_type_id] = price.per_hour
            cards.append(c)
        return cls(cards)

    def at(self, when: datetime) -> Card | None:
        i = bisect.bisect_right(self._starts, when)
        return self.cards[i - 1] if i else None

    def changes_between(self, start: datetime, end: datetime) -> list[datetime]:
        """Seconds strictly inside (start, end) at which a new card takes over."""
        return [s for s in self._starts if start < s < end]

    @property
    def currency(self) -> str:
        return self.cards[-1].currency if self.cards else "CNY"


@dataclass(frozen=True)
class Quote:
    """What a cluster of this shape costs per hour now."""

    currency: str
    on_demand: Decimal | None
    spot: Decimal | None
    units: int
    # Per node-hour, whatever the shape: a stopped GPU cluster started without GPUs, and a
    # stopped cluster's kept workspaces (0: free). None without a card in force.
    no_gpu_per_node: Decimal | None = None
    stopped_per_node: Decimal | None = None

    @property
    def priced(self) -> bool:
        return self.on_demand is not None


def quote(book: RateBook, *, gpu_model_id, instance_type_id, units: int, now) -> Quote:
    card = book.at(now)
    if card is None:
        return Quote(book.currency, None, None, units)
    stop = {
        "no_gpu_per_node": per_hour_of(card.no_gpu, 1),
        "stopped_per_node": per_hour_of(card.stopped, 1),
    }
    demand = card.rate(gpu_model_id=gpu_model_id, instance_type_id=instance_type_id, spot=False)
    if demand is None:
        return Quote(card.currency, None, None, units, **stop)
    spot = card.rate(gpu_model_id=gpu_model_id, instance_type_id=instance_type_id, spot=True)
    return Quote(card.currency, per_hour_of(demand, units), per_hour_of(spot, units), units, **stop)

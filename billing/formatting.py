"""How money reads, everywhere it is shown: 4 decimals for amounts and rates, 2 for
balances and totals, always with its currency nearby, never a float.

Sums straight from the database are not fit to show: SQLite hands an aggregate back as a
float turned Decimal ("0.461500000000000"), PostgreSQL with whatever scale the arithmetic
left. Every figure goes through `amount`, `total` or `rate` before a page, a CSV or a
chart sees it."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

from django.utils import timezone

from billing.models import UNIT  # amounts and rates

CENT = Decimal("0.01")  # balances and totals
RATE_EXACT = Decimal("0.00000001")  # the ledger keeps rates to 8 places


def _decimal(value) -> Decimal | None:
    if value is None or value == "":
        return None
    if isinstance(value, float):  # never computed with here; only ever shown
        value = repr(value)
    try:
        return Decimal(value)
    except (InvalidOperation, TypeError, ValueError):
        return None


def amount(value) -> Decimal | None:
    """An amount, to the smallest unit (0.0001), half-up."""
    d = _decimal(value)
    return None if d is None else d.quantize(UNIT, rounding=ROUND_HALF_UP)


def total(value) -> Decimal | None:
    """A balance or a total, to the cent, half-up."""
    d = _decimal(value)
    return None if d is None else d.quantize(CENT, rounding=ROUND_HALF_UP)


def rate(value) -> Decimal | None:
    """A rate per unit-hour: 4 places, more only where the rate really has them (a spot
    discount of 12.5 % on 1.2345 is 1.0801875, and the amounts were charged at that)."""
    d = _decimal(value)
    if d is None:
        return None
    exact = d.quantize(RATE_EXACT, rounding=ROUND_HALF_UP).normalize()
    if exact.as_tuple().exponent >= -4:
        return d.quantize(UNIT, rounding=ROUND_HALF_UP)
    return exact


# Currencies written with their sign, before the figure, in every language ("¥12.50");
# any other reads "12.50 EUR".
SIGNS = {"CNY": "¥", "USD": "$", "GBP": "£", "HKD": "HK$"}


def text(value: Decimal | None, currency: str = "") -> str:
    """`Decimal("-0.4615"), "CNY"` -> "-¥0.4615", `"CHF"` -> "-0.4615 CHF"; a missing value
    reads "—"."""
    if value is None:
        return "—"
    shown = f"{value:f}"
    if shown.startswith("-") and value == 0:
        shown = shown[1:]  # "-0.00" after rounding reads as a charge that is not there
    if not currency:
        return shown
    sign = SIGNS.get(currency)
    if sign is None:
        return f"{shown} {currency}"
    return f"-{sign}{shown[1:]}" if shown.startswith("-") else f"{sign}{shown}"


def total_text(value, currency: str = "") -> str:
    """A balance or a total as every page, sentence and event reads it: "¥38.20"."""
    return text(total(value), currency)


def zone(at=None) -> str:
    """The reader's zone (the active one) at `at` (default now), as the bill's tables and
    the cluster's cost name it: "UTC+08:00", "UTC" (an abbreviation such as "CST" means
    China or Central time, and is English on a Chinese page)."""
    offset = timezone.localtime(at).strftime("%z")
    return "UTC" if offset == "+0000" else f"UTC{offset[:3]}:{offset[3:]}"

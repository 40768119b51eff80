"""`{% load money %}`: `{{ x|amount }}` "0.4615", `{{ x|total:"CNY" }}` "¥12.50" (a sign where the currency has one),
`{{ x|rate }}` "7.8000", `{{ "CNY"|sign }}` "¥". See billing.formatting for the rule."""

from django import template

from billing import formatting

register = template.Library()


@register.filter
def amount(value, currency=""):
    return formatting.text(formatting.amount(value), currency)


@register.filter
def total(value, currency=""):
    return formatting.total_text(value, currency)


@register.filter
def rate(value, currency=""):
    return formatting.text(formatting.rate(value), currency)


@register.filter
def sign(currency):
    """`{{ "CNY"|sign }}` "¥": what a label beside a figure says of its currency."""
    return formatting.SIGNS.get(currency, currency)


@register.filter
def zone(at):
    """`{{ at|zone }}` "UTC+08:00": the reader's zone at that moment, in the bill's words."""
    return formatting.zone(at)

"""`{% load sizes %}`: `{{ n|bytes }}` "340 MB", "1.2 GB" (decimal units, as Docker and
registries count them)."""

from django import template

register = template.Library()

_UNITS = ("kB", "MB", "GB", "TB", "PB")


def human_bytes(value) -> str:
    try:
        size = float(value or 0)
    except (TypeError, ValueError):
        return ""
    if size < 1000:
        return f"{int(size)} B"
    for unit in _UNITS:
        size /= 1000
        text = f"{size:.1f}" if size < 99.95 else f"{size:.0f}"
        if float(text) < 1000 or unit == _UNITS[-1]:  # 999.96 MB is 1 GB, not "1000 MB"
            return f"{text.removesuffix('.0')} {unit}"
    raise AssertionError("unreachable")


register.filter("bytes", human_bytes)

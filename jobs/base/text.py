"""Text composed now and shown later in the reader's language (issue 23).

A timeline event is written in English when it happens, often in a worker with no reader.
`Text(gettext_noop("pulling %(image)s on %(host)s"), image=ref, host=name)` keeps the msgid
and its arguments: `str(t)` is the English (the event's `message`, which the API and webhooks
keep), `t.as_json()` is stored beside it, and `show(data)` renders that JSON later with
`gettext` in the language active then. An argument may itself be a Text (a reason inside a
sentence), a Moment (a time, in the reader's zone) or a Duration (a span, in the reader's
words); anything else is rendered with str() and never translated (Docker's errors, a
container's exit message, names).

Layer: base, the bottom of jobs/; uses no other part (Django's translation only).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal

from django.utils import timezone
from django.utils.translation import gettext, gettext_noop, ngettext


class Text:
    """A msgid (English, `%(name)s` placeholders) and its named arguments."""

    __slots__ = ("msgid", "args")

    def __init__(self, msgid: str, /, **args) -> None:
        self.msgid = msgid
        self.args = args

    def __str__(self) -> str:
        return _render(self.as_json(), translate=False)

    def __repr__(self) -> str:
        return f"Text({self.msgid!r}, {self.args!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Text) and self.as_json() == other.as_json()

    __hash__ = None

    def as_json(self) -> dict:
        return {"m": self.msgid, "a": {name: _json(value) for name, value in self.args.items()}}


class Moment:
    """A time inside a Text, shown in the reader's time zone with its abbreviation
    ("2026-12-05 15:30 CST"); the English `message` keeps UTC ("2026-12-05 07:30 UTC")."""

    __slots__ = ("at", "fmt")

    def __init__(self, at: datetime, fmt: str = "%Y-%m-%d %H:%M") -> None:
        self.at = at
        self.fmt = fmt or "%Y-%m-%d %H:%M"

    def __str__(self) -> str:
        return _moment(self.as_json(), translate=False)

    def as_json(self) -> dict:
        return {"at": self.at.isoformat(), "fmt": self.fmt}


def _moment(data: dict, translate: bool) -> str:
    try:
        at = datetime.fromisoformat(data["at"])
    except (KeyError, TypeError, ValueError):
        return str(data.get("at", ""))
    at = at if at.tzinfo else at.replace(tzinfo=UTC)
    at = timezone.localtime(at) if translate else at.astimezone(UTC)
    return f"{at.strftime(str(data.get('fmt') or '%Y-%m-%d %H:%M'))} {at.tzname()}"


class Duration:
    """A span inside a Text ("1 h 20 min", "45 min", "3 days"), in the reader's language
    ("1 小时 20 分钟"); the English `message` keeps English. `seconds`: a number, a Decimal
    or a timedelta."""

    __slots__ = ("seconds",)

    def __init__(self, seconds) -> None:
        if isinstance(seconds, timedelta):
            seconds = Decimal(str(seconds.total_seconds()))
        self.seconds = max(0, int(Decimal(str(seconds)).to_integral_value(ROUND_HALF_UP)))

    def __str__(self) -> str:
        return duration(self.seconds, translate=False)

    def as_json(self) -> dict:
        return {"seconds": self.seconds}


def _minutes(n: int, translate: bool) -> str:
    return (ngettext("%(n)d min", "%(n)d min", n) if translate else "%(n)d min") % {"n": n}


def _hours(n: int, translate: bool) -> str:
    return (ngettext("%(n)d h", "%(n)d h", n) if translate else "%(n)d h") % {"n": n}


def _days(n: int, translate: bool) -> str:
    english = "%(n)d day" if n == 1 else "%(n)d days"
    return (ngettext("%(n)d day", "%(n)d days", n) if translate else english) % {"n": n}


def duration(seconds, translate: bool = True) -> str:
    """How long `seconds` is, to the nearest minute under a day ("1 h 20 min", "45 min"),
    to the nearest hour from a day on ("1 day 3 h", "3 days"); under half a minute reads
    "under 1 min". In the active language (`translate`), else English. The one duration
    formatter: the balance's banner and the notifications' summaries both use it."""
    minutes = (Duration(seconds).seconds + 30) // 60
    if minutes < 1:
        return gettext("under 1 min") if translate else "under 1 min"
    if minutes < 60:
        return _minutes(minutes, translate)
    if minutes < 24 * 60:
        hours, rest = divmod(minutes, 60)
        words = _hours(hours, translate)
        return f"{words} {_minutes(rest, translate)}" if rest else words
    days, hours = divmod((minutes + 30) // 60, 24)
    words = _days(days, translate)
    return f"{words} {_hours(hours, translate)}" if hours else words


def _json(value):
    if isinstance(value, Text | Moment | Duration):
        return value.as_json()
    if isinstance(value, datetime):
        return Moment(value).as_json()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return str(value)


DEPTH = 200  # Texts inside Texts (a list of N nodes is N deep); far below Python's recursion limit


def _render(data, translate: bool, depth: int = 0) -> str:
    if depth > DEPTH:
        return "…"
    if isinstance(data, dict) and "at" in data and "m" not in data:
        return _moment(data, translate)
    if isinstance(data, dict) and "seconds" in data and "m" not in data:
        return duration(data["seconds"] if isinstance(data["seconds"], int) else 0, translate)
    if isinstance(data, dict) and "m" in data:
        msgid = str(data["m"])
        args = {
            name: _render(value, translate, depth + 1) if isinstance(value, dict) else value
            for name, value in (data.get("a") or {}).items()
        }
        if translate:
            try:
                return gettext(msgid) % args if args else gettext(msgid)
            except (KeyError, ValueError, TypeError):
                pass
        try:
            return msgid % args if args else msgid
        except (KeyError, ValueError, TypeError):
            return msgid
    return str(data)


def show(data) -> str:
    """The stored JSON of a Text, in the active language (English if its translation does
    not format)."""
    return _render(data, translate=True)


def json_of(message, limit: int | None = None) -> dict | None:
    """What an event stores in its `text` field: the JSON of a Text, None for plain words.
    With `limit`, each plain argument (an engine's error, a name) keeps at most that many
    characters: the shown sentence stays about as long as the English beside it."""
    if not isinstance(message, Text):
        return None
    data = message.as_json()
    return data if limit is None else _bounded(data, limit)


def _bounded(data, limit: int, depth: int = 0):
    if depth > DEPTH or not isinstance(data, dict):
        return data
    if "m" not in data:
        return data  # a Moment or a Duration
    args = {
        name: value[:limit] if isinstance(value, str) else _bounded(value, limit, depth + 1)
        for name, value in (data.get("a") or {}).items()
    }
    return {**data, "a": args}


def join(items: list) -> Text | str:
    """Several Texts as one list ("a, b, c" in English): nested pairs, each translated."""
    if not items:
        return ""
    out = items[-1]
    for item in reversed(items[:-1]):
        out = Text(gettext_noop("%(first)s, %(rest)s"), first=item, rest=out)
    return out


def load(data) -> Text | str:
    """The stored JSON of a Text back as a Text (to say again, or inside another sentence);
    anything else as its plain words."""
    if isinstance(data, dict) and "m" in data:
        args = {
            name: load(value) if isinstance(value, dict) else value
            for name, value in (data.get("a") or {}).items()
        }
        return Text(str(data["m"]), **args)
    if isinstance(data, dict) and "at" in data:  # a Moment
        try:
            return Moment(datetime.fromisoformat(data["at"]), str(data.get("fmt") or ""))
        except (TypeError, ValueError):
            return str(data["at"])
    if isinstance(data, dict) and "seconds" in data:  # a Duration
        return Duration(data["seconds"] if isinstance(data["seconds"], int) else 0)
    return "" if data is None else str(data)


# What a text field without a max_length (a TextField) keeps of a message at most.
TEXT_LIMIT = 2000


def limit_of(model, field: str) -> int:
    """The most characters `model`'s `field` keeps: its max_length (a CharField), else
    TEXT_LIMIT. `model`: a model class or instance (this module imports none)."""
    return model._meta.get_field(field).max_length or TEXT_LIMIT


def fit(model, field: str, message) -> str:
    """The English of `message` (a Text or plain words) as `model`'s `field` keeps it: cut
    to the field's length (`limit_of`), never a database error for a long engine error."""
    return ("" if message is None else str(message))[: limit_of(model, field)]


def twin_fields(model, field: str, message) -> dict:
    """A text field and its twin `<field>_text` (the Text's JSON, None for plain words), as
    `model` keeps them: e.g. `twin_fields(Sweep, "note", why)`. An empty message (or None)
    clears both."""
    limit = limit_of(model, field)
    return {field: fit(model, field, message), f"{field}_text": json_of(message, limit)}


def stored_reason(obj) -> Text | str:
    """A Cluster's or Job's state reason as it was written: the Text its twin keeps, else
    its English (older rows, plain words)."""
    data = getattr(obj, "state_reason_text", None)
    return load(data) if data else obj.state_reason


def argument(message, msgid: str, name: str = "reason"):
    """The argument `name` of `message` when it is a Text of `msgid`, else None: the reason
    inside "preempting: %(reason)s", to say again in another sentence."""
    if isinstance(message, Text) and message.msgid == msgid:
        return message.args.get(name)
    return None

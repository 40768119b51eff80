"""Reading settings from the environment, with `NAME_FILE` for secrets (Docker/K8s style)."""

import ipaddress
import os
from pathlib import Path

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def envstr(name: str, default: str) -> str:
    path = os.environ.get(f"{name}_FILE")
    if path:
        return Path(path).read_text().strip()
    return os.environ.get(name, default)


def envbool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def envint(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def envlist(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def trusted_proxies(raw: str, name: str = "SUANLI_TRUSTED_PROXIES") -> list[str]:
    """SUANLI_TRUSTED_PROXIES (or another list `name`): addresses and networks only. A name or
    "*" is refused, not passed to uvicorn, which would take "*" as "believe every client's
    headers"."""
    entries = [item.strip() for item in raw.split(",") if item.strip()]
    for entry in entries:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise ValueError(
                f"{name}: {entry!r} is not an address or network (e.g. 10.0.0.2 or 10.0.0.0/24)"
            ) from None
    return entries

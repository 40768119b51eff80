"""Which addresses are public: the one list of the ranges that none of our servers is sent
to on a tenant's behalf, and the spellings of an IP address that resolvers accept. Webhook
deliveries (netguard) and image pulls (validators: the registry a reference names) both
judge an address here, so that a range refused to one is refused to the other.

The reasons are English (webhook errors and logs) and marked for translation, so that a
form can show them in the researcher's language: `gettext(why)`.

Layer: base, the bottom of jobs/ (validators and netguard use it); uses no other part.
"""

from __future__ import annotations

import ipaddress
import re
import socket

from django.utils.translation import gettext_noop as _noop

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_NUMERIC_LABEL = re.compile(r"(0x[0-9a-f]*|[0-9]+)", re.IGNORECASE)


class NotAnAddress(ValueError):
    """A host that looks like an IP literal but is not a valid one; str() says why."""


# Ranges refused with a specific reason, so the researcher learns why. Anything else that is
# not global is refused too (see _why_not_public); the lists exist for the wording, and for
# the ranges Python 3.11's `is_global` still calls global (fec0::/10, 3fff::/20, ::/96, ...).
_V4_RANGES = [
    ("0.0.0.0/32", _noop("the unspecified address")),
    ("0.0.0.0/8", _noop("in 0.0.0.0/8 ('this network')")),
    ("127.0.0.0/8", _noop("a loopback address")),
    ("10.0.0.0/8", _noop("a private address")),
    ("172.16.0.0/12", _noop("a private address")),
    ("192.168.0.0/16", _noop("a private address")),
    ("100.64.0.0/10", _noop("in the shared address space 100.64.0.0/10 (carrier-grade NAT)")),
    ("169.254.169.254/32", _noop("the cloud metadata address (link-local)")),
    ("169.254.0.0/16", _noop("a link-local address")),
    ("192.0.0.0/24", _noop("an IETF protocol address (192.0.0.0/24)")),
    ("192.0.2.0/24", _noop("a documentation address")),
    ("198.51.100.0/24", _noop("a documentation address")),
    ("203.0.113.0/24", _noop("a documentation address")),
    ("192.88.99.0/24", _noop("a reserved address (old 6to4 relay)")),
    ("198.18.0.0/15", _noop("a benchmarking address")),
    ("224.0.0.0/4", _noop("a multicast address")),
    ("255.255.255.255/32", _noop("the broadcast address")),
    ("240.0.0.0/4", _noop("a reserved address")),
]
_V6_RANGES = [
    ("::/128", _noop("the unspecified address")),
    ("::1/128", _noop("a loopback address")),
    ("::/96", _noop("an IPv4-compatible address (deprecated)")),
    ("64:ff9b:1::/48", _noop("a local-use NAT64 address")),
    ("100::/64", _noop("a discard-only address")),
    ("2001::/23", _noop("an IETF protocol address (2001::/23)")),
    ("2001:db8::/32", _noop("a documentation address")),
    ("3fff::/20", _noop("a documentation address")),
    ("fc00::/7", _noop("a private (unique local) address")),
    ("fe80::/10", _noop("a link-local address")),
    ("fec0::/10", _noop("a site-local address (deprecated)")),
    ("ff00::/8", _noop("a multicast address")),
]
_V4_NETS = [(ipaddress.IPv4Network(net), why) for net, why in _V4_RANGES]
_V6_NETS = [(ipaddress.IPv6Network(net), why) for net, why in _V6_RANGES]
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_V4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def why_not_public(ip: IPAddress) -> str | None:
    """Why `ip` is not an address on the public internet (loopback, private, link-local,
    ...), or None when it is. An IPv4-mapped address is its IPv4 address, and an IPv6 form
    of an IPv4 address (6to4, Teredo, NAT64, IPv4-compatible) is judged by that address."""
    ip = unwrap(ip)
    if isinstance(ip, ipaddress.IPv4Address):
        return _why_not_public(ip)
    for inner in _embedded_ipv4(ip):
        why = _why_not_public(inner)
        if why:
            return _noop("an IPv6 form of %(inner)s, which is %(why)s") % {
                "inner": inner,
                "why": why,
            }
    if ip in _NAT64:
        return None  # the well-known translator prefix: what counts is the IPv4 inside
    return _why_not_public(ip)


def is_local_name(host: str) -> bool:
    """`localhost` and names under `.localhost` (RFC 6761), with or without the final dot:
    the loopback, whatever a resolver here says of them."""
    name = host.lower().rstrip(".")
    return name == "localhost" or name.endswith(".localhost")


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every IPv4 and IPv6 address `host` resolves to here. OSError (socket.gaierror) when
    it resolves to none."""
    addresses: list[IPAddress] = []
    for family, *_, sockaddr in socket.getaddrinfo(
        host, port, socket.AF_UNSPEC, socket.SOCK_STREAM
    ):
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        ip = ipaddress.ip_address(sockaddr[0].partition("%")[0])
        if ip not in addresses:
            addresses.append(ip)
    if not addresses:
        raise socket.gaierror(socket.EAI_NONAME, "no IPv4 or IPv6 address")
    return addresses


def ip_literal(host: str, *, bracketed: bool) -> tuple[IPAddress, bool] | None:
    """The address a host stands for, if it is an IP literal in any spelling that some
    resolver would accept, with whether it is the canonical spelling. None for a name."""
    if bracketed:
        if "%" in host:
            raise NotAnAddress("IPv6 zone identifiers (%...) are not allowed")
        try:
            return ipaddress.IPv6Address(host), True
        except ValueError:
            raise NotAnAddress(f"[{host}] is not a valid IPv6 address") from None
    try:
        return ipaddress.IPv4Address(host), True
    except ValueError:
        pass
    # inet_aton and URL parsers in browsers read "2130706433", "0x7f000001", "0177.0.0.1" and
    # "127.1" as 127.0.0.1. Whatever ends in a number is an IPv4 address (the WHATWG rule), so
    # such hosts are decoded here rather than handed to a resolver that might decode them.
    labels = host.split(".")
    if labels[-1] == "" and len(labels) > 1:
        labels.pop()
    if not _NUMERIC_LABEL.fullmatch(labels[-1]):
        return None
    value = _legacy_ipv4(labels)
    if value is None:
        raise NotAnAddress(f"{host} is not a valid IPv4 address")
    return ipaddress.IPv4Address(value), False


def _legacy_ipv4(labels: list[str]) -> int | None:
    if len(labels) > 4:
        return None
    numbers = []
    for label in labels:
        if not _NUMERIC_LABEL.fullmatch(label):
            return None
        if label[:2].lower() == "0x":
            numbers.append(int(label[2:] or "0", 16))
        elif len(label) > 1 and label.startswith("0"):
            if not set(label) <= set("01234567"):
                return None
            numbers.append(int(label, 8))
        else:
            numbers.append(int(label))
    *leading, last = numbers
    if any(n > 255 for n in leading) or last >= 256 ** (5 - len(numbers)):
        return None
    value = last
    for i, n in enumerate(leading):
        value += n << (8 * (3 - i))
    return value


def unwrap(ip: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address is the IPv4 address itself as far as a socket goes."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    inner = []
    if ip in _V4_COMPATIBLE and int(ip) > 1:  # ::a.b.c.d, but not :: or ::1
        inner.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    if ip in _NAT64:
        inner.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    if ip.sixtofour is not None:
        inner.append(ip.sixtofour)
    if ip.teredo is not None:
        inner.extend(ip.teredo)
    return inner


def _why_not_public(ip: IPAddress) -> str | None:
    nets = _V4_NETS if ip.version == 4 else _V6_NETS
    for net, why in nets:
        if ip in net:
            return why
    if ip.is_loopback:
        return _noop("a loopback address")
    if ip.is_link_local:
        return _noop("a link-local address")
    if ip.is_multicast:
        return _noop("a multicast address")
    if ip.is_private:
        return _noop("a private address")
    if ip.is_reserved:
        return _noop("a reserved address")
    if not ip.is_global:
        return _noop("not a public address")
    return None


def guesser(text: str) -> str:
    """The address that log-in failures are counted against (web, API tokens, SSH alike):
    an IPv4 address as it is (an IPv4-mapped IPv6 one as IPv4), an IPv6 one as the first
    address of its /64, the smallest block one subscriber gets: a client who holds a /64
    gains nothing by moving through it. Text that is no address stays as it is."""
    try:
        ip = ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        return text
    if ip.version == 6 and ip.ipv4_mapped is None:
        return str(ipaddress.IPv6Network(f"{ip}/64", strict=False).network_address)
    return str(ip.ipv4_mapped or ip) if ip.version == 6 else str(ip)

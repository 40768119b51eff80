"""Outbound HTTP for webhook deliveries, guarded against SSRF.

A researcher gives us a URL; we must never let it point our servers at our own network
(loopback, private ranges, the cloud metadata service, ...). So every address the host
resolves to is checked, and the connection is opened to the very address that was checked,
never to the result of a second DNS lookup (DNS rebinding). Redirects are not followed, and
the whole exchange is bounded by one deadline.

Operators may allow named internal receivers: `SUANLI_WEBHOOK_ALLOW_HOSTS` (exact host
names) and `SUANLI_WEBHOOK_ALLOW_NETS` (CIDRs), both empty by default and read at call time.

Layer: netguard, beside engine, under webhooks (which sends through it); uses no other part.
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import re
import socket
import ssl
import time
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_URL_LENGTH = 2000
MAX_BODY_READ = 64 * 1024
EXCERPT_CHARS = 1000
USER_AGENT = "Suanli-Webhooks/1"
_PUBLIC_ONLY = "webhooks go to public addresses only"
# We set these ourselves; a caller's value would either lie about the body or re-aim the
# request at another virtual host on the checked address.
_RESERVED_HEADERS = {"host", "content-length", "connection", "transfer-encoding"}

_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
_NUMERIC_LABEL = re.compile(r"(0x[0-9a-f]*|[0-9]+)", re.IGNORECASE)
_PORT = re.compile(r"[0-9]{1,5}")


class Refused(Exception):
    """The URL may not be used; raised before any connection is made. str() is meant for the
    researcher who typed it."""


class DeliveryFailed(Exception):
    """The URL passed the checks but the delivery did not complete (network, timeout, TLS)."""


@dataclass
class Response:
    status: int
    body_excerpt: str
    latency_ms: int
    headers: dict[str, str] = field(default_factory=dict)


class _ResolveFailed(Exception):
    """DNS gave no answer: a bad URL when checking a form, a retryable failure when posting."""


@dataclass
class _Target:
    scheme: str
    host: str  # as the receiver must see it: lower-case, IDNA, no brackets
    port: int
    path: str
    addresses: list[IPAddress]


# Ranges refused with a specific reason, so the researcher learns why. Anything else that is
# not global is refused too (see _why_not_public); the lists exist for the wording, and for
# the ranges Python 3.11's `is_global` still calls global (fec0::/10, 3fff::/20, ::/96, ...).
_V4_RANGES = [
    ("0.0.0.0/32", "the unspecified address"),
    ("0.0.0.0/8", "in 0.0.0.0/8 ('this network')"),
    ("127.0.0.0/8", "a loopback address"),
    ("10.0.0.0/8", "a private address"),
    ("172.16.0.0/12", "a private address"),
    ("192.168.0.0/16", "a private address"),
    ("100.64.0.0/10", "in the shared address space 100.64.0.0/10 (carrier-grade NAT)"),
    ("169.254.169.254/32", "the cloud metadata address (link-local)"),
    ("169.254.0.0/16", "a link-local address"),
    ("192.0.0.0/24", "an IETF protocol address (192.0.0.0/24)"),
    ("192.0.2.0/24", "a documentation address"),
    ("198.51.100.0/24", "a documentation address"),
    ("203.0.113.0/24", "a documentation address"),
    ("192.88.99.0/24", "a reserved address (old 6to4 relay)"),
    ("198.18.0.0/15", "a benchmarking address"),
    ("224.0.0.0/4", "a multicast address"),
    ("255.255.255.255/32", "the broadcast address"),
    ("240.0.0.0/4", "a reserved address"),
]
_V6_RANGES = [
    ("::/128", "the unspecified address"),
    ("::1/128", "a loopback address"),
    ("::/96", "an IPv4-compatible address (deprecated)"),
    ("64:ff9b:1::/48", "a local-use NAT64 address"),
    ("100::/64", "a discard-only address"),
    ("2001::/23", "an IETF protocol address (2001::/23)"),
    ("2001:db8::/32", "a documentation address"),
    ("3fff::/20", "a documentation address"),
    ("fc00::/7", "a private (unique local) address"),
    ("fe80::/10", "a link-local address"),
    ("fec0::/10", "a site-local address (deprecated)"),
    ("ff00::/8", "a multicast address"),
]
_V4_NETS = [(ipaddress.IPv4Network(net), why) for net, why in _V4_RANGES]
_V6_NETS = [(ipaddress.IPv6Network(net), why) for net, why in _V6_RANGES]
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_V4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def check_url(url: str, *, resolve: bool = True) -> list[IPAddress]:
    """Validate a webhook URL. Returns the addresses a delivery would connect to (all of them
    checked, or, for an allowed host name, as resolved); an empty list when `resolve` is False,
    in which case a host name is only checked for its form (an IP literal is still checked).
    Raises Refused with a message for the researcher."""
    try:
        target = _target(url, resolve=resolve)
    except _ResolveFailed as exc:
        raise Refused(str(exc)) from None
    return target.addresses if resolve else []


def post(url: str, body: bytes, headers: dict[str, str], *, timeout: float = 15.0) -> Response:
    """POST `body` to `url`, connecting only to checked addresses, following no redirect, and
    returning within `timeout` seconds overall (DNS aside: getaddrinfo cannot be bounded).
    Raises Refused before connecting if the URL is not allowed, DeliveryFailed otherwise."""
    if timeout <= 0:
        raise ValueError("timeout must be positive")
    for name in headers:
        if name.lower() in _RESERVED_HEADERS:
            raise ValueError(f"the {name} header is set by netguard itself")
    try:
        target = _target(url, resolve=True)
    except _ResolveFailed as exc:
        raise DeliveryFailed(str(exc)) from None

    sent = {"User-Agent": USER_AGENT, "Content-Type": "application/json"}
    given = {name.lower() for name in headers}
    sent = {k: v for k, v in sent.items() if k.lower() not in given}
    sent.update(headers)
    sent["Connection"] = "close"

    started = time.monotonic()
    deadline = started + timeout
    conn = _PinnedConnection(target, deadline)
    answer = None
    try:
        conn.request("POST", target.path, body=body, headers=sent)
        answer = conn.getresponse()
        data = answer.read(MAX_BODY_READ)
        received: dict[str, str] = {}
        for name, value in answer.getheaders():
            name = name.lower()
            received[name] = f"{received[name]}, {value}" if name in received else value
    except (OSError, http.client.HTTPException) as exc:  # TLS and timeouts are OSErrors too
        raise DeliveryFailed(_describe(exc, timeout)) from exc
    finally:
        if answer is not None:
            answer.close()  # with "Connection: close" it, not conn, holds the socket
        conn.close()
    return Response(
        status=answer.status,
        body_excerpt=data.decode("utf-8", errors="replace")[:EXCERPT_CHARS],
        latency_ms=round((time.monotonic() - started) * 1000),
        headers=received,
    )


def _target(url: str, *, resolve: bool) -> _Target:
    if not isinstance(url, str) or not url:
        raise Refused("a URL is required")
    if len(url) > MAX_URL_LENGTH:
        raise Refused(f"the URL is longer than {MAX_URL_LENGTH} characters")
    if any(ch.isspace() or not ch.isprintable() for ch in url):
        raise Refused("the URL contains a space or a control character")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise Refused(f"not a valid URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise Refused(
            f"the {scheme or 'missing'} scheme is not allowed: use an http:// or https:// URL"
        )
    netloc = parts.netloc
    if not netloc:
        raise Refused("the URL has no host")
    if "@" in netloc:
        raise Refused("user names and passwords in the URL are not allowed (user:pass@)")
    raw_host, port = _split_netloc(netloc, default=443 if scheme == "https" else 80)

    path = quote(parts.path or "/", safe="/%!$&'()*+,;=:@-._~")
    if parts.query:
        path += "?" + quote(parts.query, safe="/%!$&'()*+,;=:@-._~?")

    bracketed = netloc.startswith("[")
    # IDNA first: it maps fullwidth digits and ideographic dots, so "１２７。０。０。１" is
    # caught below as the literal it becomes.
    host = raw_host if bracketed else _ascii_host(raw_host)
    target = _Target(scheme, host, port, path, [])
    allowed_hosts = _allowed_hosts()
    literal = _ip_literal(host, bracketed=bracketed)
    if literal is not None:
        ip, canonical = literal
        if host in allowed_hosts:
            target.addresses = [_unwrap(ip)]
            return target
        why = _why_refused(ip)
        if why:
            plain = _unwrap(ip)
            shown = host if canonical and plain == ip else f"{host} means {plain}, which"
            raise Refused(f"{shown} is {why}: {_PUBLIC_ONLY}")
        if not canonical:
            raise Refused(f"write IPv4 addresses as four decimal numbers ({ip}, not {host})")
        target.addresses = [_unwrap(ip)]
        return target

    _check_host_name(host)
    if not resolve:
        return target
    addresses = _resolve(host, port)
    if host not in allowed_hosts:
        for ip in addresses:
            why = _why_refused(ip)
            if why:
                raise Refused(f"{host} resolves to {ip}, which is {why}: {_PUBLIC_ONLY}")
    target.addresses = [_unwrap(ip) for ip in addresses]
    return target


def _split_netloc(netloc: str, *, default: int) -> tuple[str, int]:
    if netloc.startswith("["):
        end = netloc.find("]")
        if end < 0:
            raise Refused("an IPv6 address in the URL is missing its closing ']'")
        host, rest = netloc[1:end], netloc[end + 1 :]
        if rest and not rest.startswith(":"):
            raise Refused("unexpected characters after the IPv6 address")
        port_text = rest[1:]
    else:
        host, _, port_text = netloc.partition(":")
    if not host:
        raise Refused("the URL has no host")
    if not port_text:
        return host.lower(), default
    if not _PORT.fullmatch(port_text) or not 1 <= int(port_text) <= 65535:
        raise Refused(f"{port_text} is not a valid port (1-65535)")
    return host.lower(), int(port_text)


def _ip_literal(host: str, *, bracketed: bool) -> tuple[IPAddress, bool] | None:
    """The address a host stands for, if it is an IP literal in any spelling that some
    resolver would accept, with whether it is the canonical spelling. None for a name."""
    if bracketed:
        if "%" in host:
            raise Refused("IPv6 zone identifiers (%...) are not allowed")
        try:
            return ipaddress.IPv6Address(host), True
        except ValueError:
            raise Refused(f"[{host}] is not a valid IPv6 address") from None
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
        raise Refused(f"{host} is not a valid IPv4 address")
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


def _ascii_host(host: str) -> str:
    if host.isascii():
        return host
    try:
        return host.encode("idna").decode("ascii").lower()
    except UnicodeError:
        raise Refused(f"{host} is not a valid host name") from None


def _check_host_name(host: str) -> None:
    name = host[:-1] if host.endswith(".") else host
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise Refused(f"{host} is not a valid host name")


def _resolve(host: str, port: int) -> list[IPAddress]:
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise _ResolveFailed(f"could not resolve {host}: {reason}") from None
    addresses: list[IPAddress] = []
    for family, *_, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        ip = ipaddress.ip_address(sockaddr[0].partition("%")[0])
        if ip not in addresses:
            addresses.append(ip)
    if not addresses:
        raise _ResolveFailed(f"could not resolve {host}: no IPv4 or IPv6 address")
    return addresses


def _unwrap(ip: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address is the IPv4 address itself as far as a socket goes."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _why_refused(ip: IPAddress) -> str | None:
    """Why a delivery may not connect to `ip`, or None if it may. An allowed net covers the
    address we connect to; addresses embedded in it must still be public."""
    ip = _unwrap(ip)
    if any(ip.version == net.version and ip in net for net in _allowed_nets()):
        return None
    if isinstance(ip, ipaddress.IPv4Address):
        return _why_not_public(ip)
    for inner in _embedded_ipv4(ip):
        why = _why_not_public(inner)
        if why:
            return f"an IPv6 form of {inner}, which is {why}"
    if ip in _NAT64:
        return None  # the well-known translator prefix: what counts is the IPv4 inside
    return _why_not_public(ip)


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
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_private:
        return "a private address"
    if ip.is_reserved:
        return "a reserved address"
    if not ip.is_global:
        return "not a public address"
    return None


def _allowed_hosts() -> set[str]:
    return {name.strip().lower() for name in _setting_list("SUANLI_WEBHOOK_ALLOW_HOSTS")}


def _allowed_nets() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    nets = []
    for cidr in _setting_list("SUANLI_WEBHOOK_ALLOW_NETS"):
        try:
            nets.append(ipaddress.ip_network(cidr.strip(), strict=False))
        except ValueError as exc:
            raise ImproperlyConfigured(f"SUANLI_WEBHOOK_ALLOW_NETS: {exc}") from None
    return nets


def _setting_list(name: str) -> list[str]:
    value = getattr(settings, name, None) or []
    if isinstance(value, str):
        value = value.split(",")
    return [item for item in value if item.strip()]


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP(S) connection to an address checked beforehand: the host name is used for the
    Host header and for certificate verification, never looked up again."""

    def __init__(self, target: _Target, deadline: float):
        super().__init__(target.host, target.port)
        self.default_port = 443 if target.scheme == "https" else 80
        self._target = target
        self._deadline = deadline

    def connect(self) -> None:
        sock = self._open()
        if self._target.scheme == "https":
            sock.settimeout(_remaining(self._deadline))
            context = ssl.create_default_context()
            try:
                sock = context.wrap_socket(sock, server_hostname=self._target.host)
            except BaseException:
                sock.close()
                raise
        self.sock = _DeadlineSocket(sock, self._deadline)

    def _open(self) -> socket.socket:
        error: OSError | None = None
        for ip in self._target.addresses:
            try:
                return socket.create_connection(
                    (str(ip), self._target.port), timeout=_remaining(self._deadline)
                )
            except OSError as exc:
                error = exc
        assert error is not None
        raise error


class _DeadlineSocket:
    """A connected socket whose every send and receive gets only the time left before the
    deadline, so a receiver that trickles bytes cannot hold a delivery past its timeout."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock = sock
        self._deadline = deadline
        # http.client closes the connection as soon as it has a "Connection: close" reply,
        # then reads the body through the file from makefile(): like socket.socket, close
        # for real only when that file is closed too.
        self._readers = 0
        self._closing = False

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(_remaining(self._deadline))
        self._sock.sendall(data)

    def recv_into(self, buffer, nbytes: int = 0) -> int:
        self._sock.settimeout(_remaining(self._deadline))
        return self._sock.recv_into(buffer, nbytes)

    def makefile(self, mode: str = "rb", *args, **kwargs) -> io.BufferedReader:
        self._readers += 1
        return io.BufferedReader(_DeadlineReader(self))

    def reader_closed(self) -> None:
        self._readers -= 1
        if self._closing and not self._readers:
            self._sock.close()

    def close(self) -> None:
        self._closing = True
        if not self._readers:
            self._sock.close()


class _DeadlineReader(io.RawIOBase):
    def __init__(self, sock: _DeadlineSocket):
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self._sock.recv_into(buffer)

    def close(self) -> None:
        if not self.closed:
            super().close()
            self._sock.reader_closed()


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline reached")
    return left


def _describe(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"timed out after {timeout:g} s"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate verification failed: {exc.verify_message or exc.reason}"
    if isinstance(exc, ssl.SSLError):
        return f"TLS error: {exc.reason or exc}"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "the receiver closed the connection without answering"
    if isinstance(exc, ConnectionResetError):
        return "connection reset by the receiver"
    if isinstance(exc, http.client.HTTPException):
        return f"bad HTTP response: {type(exc).__name__} {exc}".rstrip()
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__

"""Outbound HTTP for webhook deliveries, guarded against SSRF.

A researcher gives us a URL; we must never let it point our servers at our own network
(loopback, private ranges, the cloud metadata service, ...). So every address the host
resolves to is checked, and the connection is opened to the very address that was checked,
never to the result of a second DNS lookup (DNS rebinding). Redirects are not followed, and
the whole exchange is bounded by one deadline.

Operators may allow named internal receivers: `SUANLI_WEBHOOK_ALLOW_HOSTS` (exact host
names) and `SUANLI_WEBHOOK_ALLOW_NETS` (CIDRs), both empty by default and read at call time.

Layer: events, under webhooks (which sends through it); uses only base (addresses).
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

from jobs.base import addresses
from jobs.base.addresses import IPAddress, unwrap

MAX_URL_LENGTH = 2000
MAX_BODY_READ = 64 * 1024
EXCERPT_CHARS = 1000
USER_AGENT = "Suanli-Webhooks/1"
_PUBLIC_ONLY = "webhooks go to public addresses only"
# We set these ourselves; a caller's value would either lie about the body or re-aim the
# request at another virtual host on the checked address.
_RESERVED_HEADERS = {"host", "content-length", "connection", "transfer-encoding"}

_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
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
    try:
        literal = addresses.ip_literal(host, bracketed=bracketed)
    except addresses.NotAnAddress as exc:
        raise Refused(str(exc)) from None
    if literal is not None:
        ip, canonical = literal
        if host in allowed_hosts:
            target.addresses = [unwrap(ip)]
            return target
        why = _why_refused(ip)
        if why:
            plain = unwrap(ip)
            shown = host if canonical and plain == ip else f"{host} means {plain}, which"
            raise Refused(f"{shown} is {why}: {_PUBLIC_ONLY}")
        if not canonical:
            raise Refused(f"write IPv4 addresses as four decimal numbers ({ip}, not {host})")
        target.addresses = [unwrap(ip)]
        return target

    _check_host_name(host)
    if not resolve:
        return target
    found = _resolve(host, port)
    if host not in allowed_hosts:
        for ip in found:
            why = _why_refused(ip)
            if why:
                raise Refused(f"{host} resolves to {ip}, which is {why}: {_PUBLIC_ONLY}")
    target.addresses = [unwrap(ip) for ip in found]
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
        return addresses.resolve(host, port)
    except (OSError, UnicodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise _ResolveFailed(f"could not resolve {host}: {reason}") from None


def _why_refused(ip: IPAddress) -> str | None:
    """Why a delivery may not connect to `ip`, or None if it may. An allowed net covers the
    address we connect to; addresses embedded in it must still be public."""
    plain = unwrap(ip)
    if any(plain.version == net.version and plain in net for net in _allowed_nets()):
        return None
    return addresses.why_not_public(ip)


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

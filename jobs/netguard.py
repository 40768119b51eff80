"""Outbound HTTP for researcher-supplied URLs (webhooks) that cannot be turned against our
own network.

Only http and https; no credentials in the URL; the host is resolved once and every
address checked (loopback, private, link-local incl. cloud metadata, multicast, reserved,
unspecified, shared, documentation and any other non-global range, IPv4 and IPv6, with
IPv4 embedded in IPv6 unwrapped); the connection goes to the checked address (no second
lookup), TLS verified against the name; redirects are never followed. Operators may
allow named hosts (`SUANLI_WEBHOOK_ALLOW_HOSTS`) or networks (`SUANLI_WEBHOOK_ALLOW_NETS`),
off by default.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from django.conf import settings

MAX_URL = 2000
MAX_BODY = 64 * 1024


class Refused(Exception):
    """The URL may not be called; raised before any connection is made."""


class DeliveryFailed(Exception):
    """The checks passed but the request did not complete (refused, reset, timed out, TLS)."""


@dataclass
class Response:
    status: int
    body_excerpt: str
    latency_ms: int
    headers: dict[str, str] = field(default_factory=dict)


def _embedded_v4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if ip.ipv4_mapped:
        return ip.ipv4_mapped
    if ip.sixtofour:
        return ip.sixtofour
    if ip.teredo:
        return ip.teredo[1]
    packed = ip.packed
    if packed[:12] == bytes(12) and int(ip) > 1:  # IPv4-compatible ::a.b.c.d
        return ipaddress.IPv4Address(packed[12:])
    if ipaddress.IPv6Address(int(ip) & ~((1 << 32) - 1)) == ipaddress.IPv6Address("64:ff9b::"):
        return ipaddress.IPv4Address(packed[12:])  # NAT64
    return None


def _why_not(ip) -> str | None:
    """None if a public address, else what it is."""
    if isinstance(ip, ipaddress.IPv6Address):
        inner = _embedded_v4(ip)
        if inner is not None:
            reason = _why_not(inner)
            return f"embeds {inner}, which {reason}" if reason else None
    for attr, what in (
        ("is_loopback", "is a loopback address"),
        ("is_unspecified", "is the unspecified address"),
        ("is_link_local", "is a link-local address"),
        ("is_multicast", "is a multicast address"),
        ("is_private", "is a private address"),
        ("is_reserved", "is a reserved address"),
    ):
        if getattr(ip, attr):
            return what
    if not ip.is_global:
        return "is not a public address"
    return None


def _allowed_nets():
    return [
        ipaddress.ip_network(n.strip(), strict=False)
        for n in settings.SUANLI_WEBHOOK_ALLOW_NETS
        if n.strip()
    ]


def _split(url: str):
    if not isinstance(url, str) or not url or len(url) > MAX_URL:
        raise Refused(f"Give an http(s) URL of at most {MAX_URL} characters.")
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
        raise Refused("The URL holds spaces or control characters.")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise Refused("Only http:// and https:// URLs are allowed.")
    if "@" in parts.netloc:
        raise Refused("Credentials in the URL (user:password@) are not allowed.")
    host = parts.hostname
    if not host:
        raise Refused("The URL has no host.")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise Refused("The URL's port is not a number from 1 to 65535.") from None
    if not 1 <= port <= 65535:
        raise Refused("The URL's port is not a number from 1 to 65535.")
    return parts, host.lower(), port


def check_url(url: str, *, resolve: bool = True) -> list:
    """The addresses the URL may be called on (checked); Refused says why not."""
    parts, host, port = _split(url)
    if not resolve:
        return []
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise Refused(f"{host} does not resolve.") from None
    addresses = []
    for info in infos:
        ip = ipaddress.ip_address(info[4][0].split("%")[0])
        if ip not in addresses:
            addresses.append(ip)
    if not addresses:
        raise Refused(f"{host} does not resolve.")
    if host in {h.strip().lower() for h in settings.SUANLI_WEBHOOK_ALLOW_HOSTS if h.strip()}:
        return addresses
    nets = _allowed_nets()
    for ip in addresses:
        if any(ip.version == n.version and ip in n for n in nets):
            continue
        reason = _why_not(ip)
        if reason:
            shown = host if host == str(ip) else f"{host} ({ip})"
            raise Refused(f"{shown} {reason}: webhooks go to public addresses only.")
    return addresses


class _Pinned(http.client.HTTPConnection):
    def __init__(self, ip, port, host, timeout, tls):
        super().__init__(host, port, timeout=timeout)
        self._ip, self._tls = str(ip), tls

    def connect(self):
        self.sock = socket.create_connection((self._ip, self.port), self.timeout)
        if self._tls:
            context = ssl.create_default_context()
            self.sock = context.wrap_socket(self.sock, server_hostname=self.host)


def post(url: str, body: bytes, headers: dict[str, str], *, timeout: float = 15.0) -> Response:
    """POST once to a checked address; the whole call ends within `timeout` seconds."""
    parts, host, port = _split(url)
    addresses = check_url(url)
    deadline = time.monotonic() + timeout
    ip = addresses[0]
    conn = _Pinned(ip, port, host, timeout, parts.scheme == "https")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    sent = {
        "User-Agent": "Suanli-Webhooks/1",
        "Content-Type": "application/json",
        "Connection": "close",
    }
    sent.update(headers)
    default_port = 443 if parts.scheme == "https" else 80
    sent["Host"] = host if port == default_port else f"{host}:{port}"
    sent["Content-Length"] = str(len(body))
    started = time.monotonic()
    try:
        conn.putrequest("POST", path, skip_host=True, skip_accept_encoding=True)
        for name, value in sent.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        sock = conn.sock  # http.client lets go of it once a "Connection: close" reply is read
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        response = conn.getresponse()
        chunks, size = [], 0
        while size < MAX_BODY:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            sock.settimeout(remaining)
            chunk = (
                response.read1(min(8192, MAX_BODY - size))
                if hasattr(response, "read1")
                else response.read(8192)
            )
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        latency = int((time.monotonic() - started) * 1000)
        return Response(
            status=response.status,
            body_excerpt=b"".join(chunks).decode("utf-8", "replace")[:1000],
            latency_ms=latency,
            headers={k.lower(): v for k, v in response.getheaders()},
        )
    except TimeoutError:
        raise DeliveryFailed(f"timed out after {timeout:g} s") from None
    except ConnectionRefusedError:
        raise DeliveryFailed("connection refused") from None
    except ssl.SSLError as exc:
        raise DeliveryFailed(f"TLS: {exc.reason or exc}") from None
    except (OSError, http.client.HTTPException) as exc:
        raise DeliveryFailed(str(exc) or exc.__class__.__name__) from None
    finally:
        conn.close()

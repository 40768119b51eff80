"""Researcher-supplied webhook URLs never reach our own network: a refused URL is refused
before any connection, and an allowed one is delivered to the very address that was checked,
within the timeout, without following redirects. Real receivers on 127.0.0.1, allowed by
the operator setting where a test needs one."""

import datetime
import ipaddress
import re
import socket
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from jobs.events import netguard


@pytest.fixture
def allow_loopback(settings):
    settings.SUANLI_WEBHOOK_ALLOW_NETS = ["127.0.0.0/8"]


@pytest.fixture
def connections(monkeypatch):
    """Every connection netguard opens. The one patch in this file: it proves an absence."""
    calls = []
    real = socket.create_connection

    def record(address, *args, **kwargs):
        calls.append(address)
        return real(address, *args, **kwargs)

    monkeypatch.setattr(netguard.socket, "create_connection", record)
    return calls


@pytest.fixture
def listener():
    """A loopback socket that would see any connection a refused URL let through."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    yield sock
    sock.close()


def _accepted_nothing(sock) -> bool:
    try:
        sock.accept()[0].close()
    except BlockingIOError:
        return True
    return False


class Receiver:
    """A real HTTP server on 127.0.0.1 that records what it was sent."""

    def __init__(self, answer=(200, {}, b"hello from the receiver"), tls=None):
        self.seen = []
        self.answer = answer
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.seen.append((self.path, self.headers, body))
                status, headers, content = receiver.answer
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if tls:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, host="127.0.0.1", path="/hook", scheme="http"):
        return f"{scheme}://{host}:{self.port}{path}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.close()


@pytest.fixture
def second_receiver():
    server = Receiver()
    yield server
    server.close()


def test_an_allowed_receiver_gets_the_post(allow_loopback, receiver, connections):
    response = netguard.post(
        receiver.url(path="/in?x=1"), b'{"a":1}', {"webhook-id": "msg_1"}, timeout=5
    )

    assert response.status == 200
    assert response.body_excerpt == "hello from the receiver"
    assert response.headers["content-length"] == str(len("hello from the receiver"))
    assert response.latency_ms >= 0
    [(path, headers, body)] = receiver.seen
    assert path == "/in?x=1" and body == b'{"a":1}'
    assert headers["Host"] == f"127.0.0.1:{receiver.port}"
    assert headers["User-Agent"] == "Suanli-Webhooks/1"
    assert headers["Content-Type"] == "application/json"
    assert headers["Connection"] == "close"
    assert headers["webhook-id"] == "msg_1"
    assert connections == [("127.0.0.1", receiver.port)]


def test_a_given_content_type_is_kept_and_framing_headers_are_ours(allow_loopback, receiver):
    netguard.post(receiver.url(), b"x=1", {"Content-Type": "text/plain"}, timeout=5)
    assert receiver.seen[0][1].get_all("Content-Type") == ["text/plain"]
    with pytest.raises(ValueError, match="Host"):
        netguard.post(receiver.url(), b"{}", {"Host": "internal.example"}, timeout=5)


REFUSED = [
    "http://127.0.0.1:{port}/",
    "http://localhost:{port}/",
    "http://10.0.0.1/",
    "http://172.16.0.1/",
    "http://192.168.1.1/",
    "http://169.254.169.254/latest/meta-data/",
    "http://100.64.0.1/",
    "http://0.0.0.0:{port}/",
    "http://[::1]:{port}/",
    "http://[::ffff:127.0.0.1]:{port}/",
    "http://[::ffff:7f00:1]:{port}/",
    "http://[::127.0.0.1]:{port}/",
    "http://[fe80::1]/",
    "http://[fc00::1]/",
    "http://[2002:7f00:1::]/",
    "http://[64:ff9b::7f00:1]/",
    "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/",  # Teredo, client 127.0.0.1
    "http://2130706433:{port}/",
    "http://0x7f000001:{port}/",
    "http://0177.0.0.1:{port}/",
    "http://127.1:{port}/",
    "http://127.0.0.1.:{port}/",
    "http://\uff11\uff12\uff17\u3002\uff10\u3002\uff10\u3002\uff11:{port}/",  # fullwidth
    "http://\uff4c\uff4f\uff43\uff41\uff4c\uff48\uff4f\uff53\uff54:{port}/",
    "http://224.0.0.1/",
    "http://255.255.255.255/",
    "http://198.18.0.1/",
    "http://192.0.2.1/",
    "http://[2001:db8::1]/",
    "http://[fec0::1]/",
    "ftp://example.com/",
    "file:///etc/passwd",
    "gopher://x",
    "http://user:pass@example.com/",
    "http://example.com@127.0.0.1:{port}/",
    "http:///nohost",
    "http://exa mple.com/",
    "http://example.com/\nHost: evil",
    "http://example.com/\ttab",
    "http://example.com:0/",
    "http://example.com:65536/",
    "http://[::1]x/",
    "http://" + "a" * 2000 + ".com/",
]


@pytest.mark.parametrize("url", REFUSED)
def test_refused_before_any_connection(url, listener, connections):
    url = url.format(port=listener.getsockname()[1])
    with pytest.raises(netguard.Refused) as refused:
        netguard.post(url, b"{}", {}, timeout=2)
    with pytest.raises(netguard.Refused):
        netguard.check_url(url)
    assert str(refused.value)  # a sentence the researcher can act on
    assert connections == []
    assert _accepted_nothing(listener)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://127.0.0.1/", "127.0.0.1 is a loopback address: webhooks go to public addresses only"),
        ("http://169.254.169.254/", "169.254.169.254 is the cloud metadata address"),
        ("http://0x7f000001/", "0x7f000001 means 127.0.0.1, which is a loopback address"),
        ("http://[::ffff:7f00:1]/", "::ffff:7f00:1 means 127.0.0.1, which is a loopback address"),
        ("http://[64:ff9b::a00:1]/", "an IPv6 form of 10.0.0.1, which is a private address"),
        ("http://localhost/", "localhost resolves to 127.0.0.1, which is a loopback address"),
        ("http://100.64.0.1/", "shared address space"),
        ("ftp://example.com/", "use an http:// or https:// URL"),
        ("http://u:p@example.com/", "user:pass@"),
    ],
)  # fmt: skip
def test_refusals_say_why(url, message):
    with pytest.raises(netguard.Refused, match=re.escape(message)):
        netguard.check_url(url)


def test_the_allowlist_is_off_by_default(receiver, connections):
    from django.conf import settings

    # The other tests rely on this default too (console/settings.py, from the environment).
    assert settings.SUANLI_WEBHOOK_ALLOW_HOSTS == [] and settings.SUANLI_WEBHOOK_ALLOW_NETS == []
    with pytest.raises(netguard.Refused, match="loopback"):
        netguard.post(receiver.url(), b"{}", {}, timeout=2)
    assert receiver.seen == [] and connections == []


def test_an_allowed_net_covers_the_address_not_what_it_embeds(allow_loopback, receiver):
    # ::ffff:127.0.0.1 is 127.0.0.1 to a socket, so the allowed net covers it ...
    response = netguard.post(receiver.url(host="[::ffff:127.0.0.1]"), b"{}", {}, timeout=5)
    assert response.status == 200
    # ... but a v4 net never matches a v6 address whose low bits look alike, and tunnels to
    # an allowed v4 address stay refused.
    for host in ("[::7f00:1]", "[64:ff9b::7f00:1]", "[2002:7f00:1::]"):
        with pytest.raises(netguard.Refused):
            netguard.check_url(f"http://{host}/")


def test_a_redirect_is_returned_not_followed(allow_loopback, receiver, second_receiver):
    receiver.answer = (302, {"Location": second_receiver.url()}, b"moved")
    response = netguard.post(receiver.url(), b"{}", {}, timeout=5)
    assert response.status == 302
    assert response.headers["location"] == second_receiver.url()
    assert len(receiver.seen) == 1 and second_receiver.seen == []


def test_a_500_is_a_response(allow_loopback, receiver):
    receiver.answer = (500, {}, b"receiver broke")
    response = netguard.post(receiver.url(), b"{}", {}, timeout=5)
    assert response.status == 500 and response.body_excerpt == "receiver broke"


def test_the_excerpt_is_the_first_thousand_characters(allow_loopback, receiver):
    receiver.answer = (200, {}, "é".encode() * 50_000 + b"\xff")
    response = netguard.post(receiver.url(), b"{}", {}, timeout=5)
    assert response.body_excerpt == "é" * 1000


def _raw_receiver(behaviour):
    """A TCP server on 127.0.0.1 that accepts and then does `behaviour(conn)`."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    stop = threading.Event()

    def serve():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                behaviour(conn, stop)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server.getsockname()[1], stop, server


@pytest.fixture
def raw_receiver():
    opened = []

    def start(behaviour):
        port, stop, server = _raw_receiver(behaviour)
        opened.append((stop, server))
        return port

    yield start
    for stop, server in opened:
        stop.set()
        server.close()


def test_a_hanging_receiver_times_out_within_the_limit(allow_loopback, raw_receiver):
    port = raw_receiver(lambda conn, stop: stop.wait(10))
    started = time.monotonic()
    with pytest.raises(netguard.DeliveryFailed, match="timed out after 1.5 s"):
        netguard.post(f"http://127.0.0.1:{port}/", b"{}", {}, timeout=1.5)
    assert time.monotonic() - started < 3


def test_a_trickling_receiver_cannot_hold_the_call_past_the_timeout(allow_loopback, raw_receiver):
    def trickle(conn, stop):
        conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
        until = time.monotonic() + 5  # then give up, so a broken client fails, not hangs
        while not stop.is_set() and time.monotonic() < until:
            try:
                conn.sendall(b"a")
            except OSError:
                return
            stop.wait(0.1)

    port = raw_receiver(trickle)
    started = time.monotonic()
    with pytest.raises(netguard.DeliveryFailed, match="timed out"):
        netguard.post(f"http://127.0.0.1:{port}/", b"{}", {}, timeout=1.5)
    assert time.monotonic() - started < 3


def test_a_closed_port_is_a_failed_delivery(allow_loopback):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(netguard.DeliveryFailed, match="connection refused"):
        netguard.post(f"http://127.0.0.1:{port}/", b"{}", {}, timeout=2)


def test_a_name_that_resolves_to_loopback_is_refused(receiver, connections):
    with pytest.raises(netguard.Refused, match="localhost resolves to 127.0.0.1"):
        netguard.post(receiver.url(host="localhost"), b"{}", {}, timeout=2)
    assert receiver.seen == [] and connections == []


def test_an_allowed_host_name_is_delivered_to_its_address(settings, receiver, connections):
    settings.SUANLI_WEBHOOK_ALLOW_HOSTS = ["LocalHost"]
    response = netguard.post(receiver.url(host="localhost"), b"{}", {}, timeout=5)
    assert response.status == 200
    assert receiver.seen[0][1]["Host"] == f"localhost:{receiver.port}"
    # connected to the address looked up once, not to the name (no second lookup)
    assert connections == [("127.0.0.1", receiver.port)]


def test_public_addresses_pass_without_a_lookup():
    assert netguard.check_url("https://93.184.215.14/hook") == [
        ipaddress.ip_address("93.184.215.14")
    ]
    assert netguard.check_url("http://[2001:4860:4860::8888]:8443/") == [
        ipaddress.ip_address("2001:4860:4860::8888")
    ]
    # NAT64 and 6to4 forms of a public address are public
    assert netguard.check_url("http://[64:ff9b::808:808]/")
    assert netguard.check_url("http://[2002:808:808::1]/")
    # resolve=False checks the form only, and still refuses a private literal
    assert netguard.check_url("https://hooks.example.com/x", resolve=False) == []
    with pytest.raises(netguard.Refused):
        netguard.check_url("http://10.1.2.3/", resolve=False)


@pytest.mark.parametrize("host", ["134744072", "8.8.2056", "0x8.8.8.8", "8.8.8.8."])
def test_other_spellings_of_public_addresses_are_refused(host):
    with pytest.raises(netguard.Refused, match="four decimal numbers"):
        netguard.check_url(f"http://{host}/")


@pytest.mark.parametrize("host", ["1.2.3.999", "0x7g.0.0.1", "example.123", "1.2.3.4.5"])
def test_invalid_numeric_hosts_are_refused(host):
    with pytest.raises(netguard.Refused, match="not a valid IPv4 address"):
        netguard.check_url(f"http://{host}/")


def _certificates(tmp_path):
    """A CA and a certificate it signed for the name "localhost" only."""
    now = datetime.datetime.now(datetime.UTC)

    def build(subject, issuer, key, signing_key, *, ca):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(signing_key.public_key()), False
            )
        )
        if ca:
            builder = builder.add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), True
            )
        else:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost")]), False
            )
        return builder.sign(signing_key, hashes.SHA256())

    ca_key, leaf_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    ca = build("Suanli test CA", "Suanli test CA", ca_key, ca_key, ca=True)
    leaf = build("localhost", "Suanli test CA", leaf_key, ca_key, ca=False)
    ca_file, cert_file, key_file = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        leaf_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ca_file, cert_file, key_file


@pytest.fixture
def tls_receiver(tmp_path, monkeypatch):
    ca_file, cert_file, key_file = _certificates(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    server = Receiver(tls=context)
    yield server, ca_file
    server.close()


def test_tls_is_verified_against_the_name_in_the_url(settings, tls_receiver, monkeypatch):
    server, ca_file = tls_receiver
    settings.SUANLI_WEBHOOK_ALLOW_HOSTS = ["localhost"]
    settings.SUANLI_WEBHOOK_ALLOW_NETS = ["127.0.0.0/8"]

    # Not signed by a CA we trust: no delivery.
    with pytest.raises(netguard.DeliveryFailed, match="TLS certificate verification failed"):
        netguard.post(server.url(host="localhost", scheme="https"), b"{}", {}, timeout=5)

    # Trust the test CA (OpenSSL reads SSL_CERT_FILE when a default context is made).
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    response = netguard.post(server.url(host="localhost", scheme="https"), b"{}", {}, timeout=5)
    assert response.status == 200
    assert server.seen[0][1]["Host"] == f"localhost:{server.port}"

    # The same server by address: the certificate names localhost, not 127.0.0.1.
    with pytest.raises(netguard.DeliveryFailed, match="127.0.0.1"):
        netguard.post(server.url(scheme="https"), b"{}", {}, timeout=5)
    assert len(server.seen) == 1

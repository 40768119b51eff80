"""Researcher-supplied URLs never reach our own network: refused before any connection."""

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from jobs import netguard


@pytest.fixture
def listener():
    """A loopback socket that counts connections: a refused URL must leave it untouched."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    yield sock.getsockname()[1], sock
    sock.close()


def _nobody_connected(sock) -> bool:
    try:
        sock.accept()
    except BlockingIOError:
        return True
    return False


REFUSED = [
    "http://127.0.0.1:{port}/", "http://localhost:{port}/", "http://10.0.0.1/",
    "http://172.16.0.1/", "http://192.168.1.1/", "http://169.254.169.254/latest/meta-data/",
    "http://100.64.0.1/", "http://0.0.0.0:{port}/", "http://[::1]:{port}/",
    "http://[::ffff:127.0.0.1]:{port}/", "http://[::ffff:7f00:1]:{port}/", "http://[fe80::1]/",
    "http://[fc00::1]/", "http://[2002:7f00:1::]/", "http://[64:ff9b::7f00:1]/",
    "http://2130706433:{port}/", "http://0x7f000001:{port}/", "http://0177.0.0.1:{port}/",
    "http://127.1:{port}/", "http://224.0.0.1/", "http://255.255.255.255/",
    "ftp://example.com/", "file:///etc/passwd", "gopher://example.com/",
    "http://user:pass@example.com/", "http:///nohost", "http://exa mple.com/",
    "http://example.com/\nHost: evil", "http://example.com:99999/",
]  # fmt: skip


@pytest.mark.parametrize("url", REFUSED)
def test_refused_without_a_connection(url, listener, settings):
    settings.SUANLI_WEBHOOK_ALLOW_NETS = []
    port, sock = listener
    with pytest.raises(netguard.Refused) as refused:
        netguard.post(url.format(port=port), b"{}", {}, timeout=2)
    assert str(refused.value)  # a sentence a researcher can act on
    assert _nobody_connected(sock)


class _Handler(BaseHTTPRequestHandler):
    seen: list = []
    mode = "ok"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        _Handler.seen.append((dict(self.headers), body, self.path))
        if _Handler.mode == "hang":
            time.sleep(4)
            return
        status = {"ok": 200, "500": 500, "redirect": 302}[_Handler.mode]
        self.send_response(status)
        if status == 302:
            self.send_header("Location", "http://127.0.0.1:9/")
        self.end_headers()
        self.wfile.write(b"hello from the receiver")

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver(settings):
    settings.SUANLI_WEBHOOK_ALLOW_NETS = ["127.0.0.0/8"]
    _Handler.seen, _Handler.mode = [], "ok"
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_allowed_receiver_gets_the_post(receiver):
    response = netguard.post(receiver + "/in?x=1", b'{"a":1}', {"webhook-id": "msg_1"})
    assert response.status == 200 and response.body_excerpt == "hello from the receiver"
    headers, body, path = _Handler.seen[0]
    assert body == b'{"a":1}' and path == "/in?x=1"
    assert headers["webhook-id"] == "msg_1" and headers["User-Agent"] == "Suanli-Webhooks/1"
    assert headers["Host"] == receiver.removeprefix("http://")


def test_the_allowlist_is_off_by_default(receiver, settings):
    settings.SUANLI_WEBHOOK_ALLOW_NETS = []
    with pytest.raises(netguard.Refused, match="loopback"):
        netguard.post(receiver, b"{}", {})
    assert _Handler.seen == []


def test_an_allowed_host_name(receiver, settings):
    settings.SUANLI_WEBHOOK_ALLOW_NETS = []
    settings.SUANLI_WEBHOOK_ALLOW_HOSTS = ["localhost"]
    url = receiver.replace("127.0.0.1", "localhost")
    assert netguard.post(url, b"{}", {}).status == 200


def test_redirects_are_returned_not_followed(receiver):
    _Handler.mode = "redirect"
    assert netguard.post(receiver, b"{}", {}).status == 302
    assert len(_Handler.seen) == 1


def test_a_500_is_a_response(receiver):
    _Handler.mode = "500"
    assert netguard.post(receiver, b"{}", {}).status == 500


def test_a_hanging_receiver_times_out_within_the_limit(receiver):
    _Handler.mode = "hang"
    started = time.monotonic()
    with pytest.raises(netguard.DeliveryFailed, match="timed out"):
        netguard.post(receiver, b"{}", {}, timeout=1.5)
    assert time.monotonic() - started < 3


def test_a_closed_port_is_a_failed_delivery(settings):
    settings.SUANLI_WEBHOOK_ALLOW_NETS = ["127.0.0.0/8"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(netguard.DeliveryFailed, match="refused"):
        netguard.post(f"http://127.0.0.1:{port}/", b"{}", {}, timeout=2)

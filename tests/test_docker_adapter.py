"""The build's engine adapter (jobs/images/engine_build.py) against what it leans on, with no
engine: docker-py at the version pyproject.toml pins, the parts of its APIClient, requests
and urllib3 the adapter uses, and the adapter's own calls through docker-py's unix-socket
transport to a stand-in engine on a socket of this test's (what the build sends, what it
reads as the engine says it, and its cut-off while the engine is still building).

When docker-py moves, this fails first: read its APIClient again (`_post`, `_url`,
`_raise_for_status`, `_stream_helper`, `inspect_container`), then move the pin."""

import importlib.metadata
import json
import re
import shutil
import socket
import socketserver
import tempfile
import threading
import tomllib
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import docker
import pytest
import requests
import urllib3
from waiting import until

from jobs.images import engine_build

ROOT = Path(__file__).resolve().parent.parent
API_VERSION = "1.41"


def test_docker_py_is_the_version_the_adapter_was_written_against():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [d for d in dependencies if re.match(r"docker\s*[=<>~!]", d)]
    assert len(pins) == 1, pins
    pinned = re.fullmatch(r"docker==([\w.]+)", pins[0].split("#")[0].strip())
    assert pinned, f"docker-py must be pinned exactly, not {pins[0]!r}"
    assert importlib.metadata.version("docker") == docker.__version__ == pinned.group(1)


def test_what_the_adapter_uses_is_there():
    api = docker.APIClient(base_url="unix:///run/suanli-no-such-engine.sock", version=API_VERSION)
    try:
        assert isinstance(api, requests.Session)  # post/get with docker-py's transports
        assert api.base_url == "http+docker://localhost"
        assert api.api_version == API_VERSION
        assert api.timeout == docker.constants.DEFAULT_TIMEOUT_SECONDS
    finally:
        api.close()
    assert callable(docker.errors.create_api_error_from_http_exception)
    assert isinstance(urllib3.response.HTTPResponse.connection, property)
    assert urllib3.connection.HTTPConnection("localhost").sock is None  # until it connects
    # And nothing else builds: the build's calls are the adapter's.
    builds = (ROOT / "jobs" / "images" / "builds.py").read_text()
    for private in ("._post(", "._get(", "._url(", "._result(", "._stream_helper(", "._connection"):
        assert private not in builds, private


class _Engine(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: str):
        self.requests: list[dict] = []
        self.client_went = threading.Event()
        super().__init__(path, _EngineHandler)


class _EngineHandler(BaseHTTPRequestHandler):
    """A Docker engine's answers to the adapter's calls, as the engine gives them."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        url = urlsplit(self.path)
        self.server.requests.append(
            {"method": "GET", "path": url.path, "query": parse_qs(url.query)}
        )
        if url.path == f"/v{API_VERSION}/containers/0123456789ab/json":
            self._reply(200, {"Id": "0123456789ab" * 5 + "0123", "SizeRw": 12345})
        else:
            self._reply(404, {"message": "No such container: nosuch"})

    def do_POST(self):
        url = urlsplit(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        query = parse_qs(url.query)
        self.server.requests.append({"method": "POST", "path": url.path, "query": query,
                                     "type": self.headers.get("Content-Type"), "body": body})  # fmt: skip
        if query.get("t") == ["refused:latest"]:
            self._reply(500, {"message": "the engine's own words"})
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for message in (
            {"stream": "Step 1/2 : FROM base\n"},
            {"stream": " ---> Running in 0123456789ab\n"},
        ):
            data = json.dumps(message).encode() + b"\r\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        # Still building: until the client goes (a real engine then cancels the build).
        self.rfile.read(1)
        self.server.client_went.set()
        self.close_connection = True


@pytest.fixture
def stand_in_engine():
    folder = tempfile.mkdtemp(prefix="suanli-engine-", dir="/tmp")  # a short socket path
    server = _Engine(f"{folder}/docker.sock")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    api = docker.APIClient(base_url=f"unix://{folder}/docker.sock", version=API_VERSION, timeout=30)
    yield server, api
    api.close()
    server.shutdown()
    server.server_close()
    shutil.rmtree(folder, ignore_errors=True)


def test_a_build_sends_its_parameters_and_nothing_else_and_is_read_as_it_comes_and_cut_off(
    stand_in_engine,
):
    server, api = stand_in_engine
    params = {"t": "registry.local/u1/x:1", "dockerfile": "Dockerfile.suanli", "rm": True,
              "version": "1", "cpuquota": 150000, "buildargs": json.dumps({"A": "b"})}  # fmt: skip
    started = engine_build.start_build(api, b"the context tar", params, timeout=30)
    got, ended = [], []

    def read():
        try:
            for message in started.messages():
                got.append(message)
        except (
            requests.RequestException,
            urllib3.exceptions.HTTPError,
            OSError,
            ValueError,
        ) as exc:
            ended.append(exc)  # what builds._build takes for a broken stream
        else:
            ended.append(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    until(lambda: len(got) == 2, what="both messages read while the build still runs")
    assert got[1] == {"stream": " ---> Running in 0123456789ab\n"}
    assert not ended, "the stream goes on until the engine or the cut-off ends it"

    # What the cut-off shuts down: the socket under the response, reached without an
    # underscore name (urllib3's HTTPResponse.connection, http.client's sock).
    assert isinstance(started.response.raw.connection.sock, socket.socket)
    started.cut_off()  # from another thread than the reader's, as the time and disk limits do
    reader.join(30)
    assert not reader.is_alive() and len(ended) == 1, "the reader woke"
    assert server.client_went.wait(30), "the engine saw its client go"

    (sent,) = [r for r in server.requests if r["method"] == "POST"]
    assert sent["path"] == f"/v{API_VERSION}/build"
    assert sent["type"] == "application/x-tar" and sent["body"] == b"the context tar"
    assert sent["query"] == {
        "t": ["registry.local/u1/x:1"], "dockerfile": ["Dockerfile.suanli"], "rm": ["True"],
        "version": ["1"], "cpuquota": ["150000"], "buildargs": ['{"A": "b"}'],
    }  # fmt: skip


def test_a_refused_build_and_a_gone_container_raise_as_docker_py_does(stand_in_engine):
    server, api = stand_in_engine
    with pytest.raises(docker.errors.APIError, match="the engine's own words") as refused:
        engine_build.start_build(api, b"", {"t": "refused:latest"}, timeout=30)
    assert refused.value.status_code == 500

    assert engine_build.container_size_rw(api, "0123456789ab") == 12345
    with pytest.raises(docker.errors.NotFound):
        engine_build.container_size_rw(api, "nosuch")
    sizes = [r for r in server.requests if r["method"] == "GET"]
    assert [r["query"] for r in sizes] == [{"size": ["1"]}, {"size": ["1"]}]

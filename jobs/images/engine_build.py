"""The two engine calls of an image build that docker-py's public API cannot make, and
the only place in Suanli that reaches under it (jobs/images/builds.py calls these).

Why not `APIClient.build` (or `images.build`):
- it cannot set what the build must have: `version=1` (the classic builder: BuildKit
  would pull the frontend that a `# syntax=` line or a BUILDKIT_SYNTAX argument names),
  `cpuperiod`/`cpuquota` (its `container_limits` takes memory, memswap, cpushares and
  cpusetcpus only), and nothing else: it adds `q`, `nocache`, `remote` and, unless told
  not to, build arguments from the client's proxy configuration;
- it hands back a generator over the response and keeps the response: a build cannot be
  cut off while it runs (its time limit, its disk limit). The engine cancels a build
  whose client went, and the only way to make a client go while another thread blocks
  reading it is to shut its socket down.
And `inspect_container` cannot ask for a container's size (`size=1`), which is what the
build's disk watch reads of its step containers.

So these go to the engine's HTTP API (documented: docs.docker.com/reference/api/engine)
through the APIClient itself, which is a `requests.Session` with docker-py's transports
mounted (unix socket, TLS): `post`/`get` (requests' public API) on the client's
`base_url` and `api_version`, errors as docker-py makes them
(`docker.errors.create_api_error_from_http_exception`), the build's JSON messages read
line by line as they arrive (requests' `iter_lines`), and the cut-off through urllib3's
`HTTPResponse.connection`. No underscore name of docker-py, requests or urllib3 is used.
(Unlike docker-py's own calls these send no HttpHeaders from a docker config.json: the
control plane has none for its engines.)

What this leans on (tests/test_docker_adapter.py checks each, with no engine): docker-py
pinned to the version it was written against (pyproject.toml), its APIClient a
requests.Session with `base_url` and `api_version`, that error function, and urllib3's
`HTTPResponse.connection` with a `sock`. A docker-py upgrade fails that test first: read
its APIClient (`_post`, `_url`, `_raise_for_status`, `_stream_helper`, `inspect_container`)
again, then move the pin.

Layer: images, the bottom of it; uses docker-py, requests and urllib3 only.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from urllib.parse import quote

import docker
import requests


def _url(api: docker.APIClient, path: str) -> str:
    """What docker-py's `APIClient._url` makes: the client's base URL, its API version."""
    return f"{api.base_url}/v{api.api_version}{path}"


def _raise_for_status(response: requests.Response) -> None:
    """An HTTP error as docker-py raises it (`docker.errors.NotFound`, `APIError`...)."""
    try:
        response.raise_for_status()
    except requests.exceptions.HTTPError as exc:
        raise docker.errors.create_api_error_from_http_exception(exc) from exc


class Build:
    """One build on the engine, started: its messages as they come, and its cut-off."""

    def __init__(self, response: requests.Response):
        self.response = response

    def messages(self) -> Iterator[dict]:
        """The engine's JSON messages (`stream`, `error`/`errorDetail`, `aux`, `status`),
        each as soon as its line arrived. Raises what requests, urllib3 or the socket
        raise when the stream breaks (a cut-off breaks it), ValueError on a message that
        is not JSON."""
        for line in self.response.iter_lines():
            if line.strip():
                yield json.loads(line)

    def cut_off(self) -> None:
        """From any thread: end the build. The engine cancels a build whose client went
        (and kills its step); the thread reading `messages` wakes with an error."""
        connection = getattr(self.response.raw, "connection", None)
        sock = getattr(connection, "sock", None)
        try:
            if sock is None:
                raise OSError("no socket")
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            self.response.close()


def start_build(api: docker.APIClient, context, params: dict, *, timeout: float) -> Build:
    """POST /build with exactly `params` (the caller's: none added) and the context tar
    (a file object or bytes); the engine's messages streamed. Raises docker.errors.APIError
    (and its kinds) when the engine refuses the build."""
    response = api.post(
        _url(api, "/build"),
        data=context,
        params=params,
        headers={"Content-Type": "application/x-tar"},
        stream=True,
        timeout=timeout,
    )
    try:
        _raise_for_status(response)
    except docker.errors.APIError:
        response.close()
        raise
    return Build(response)


def container_size_rw(api: docker.APIClient, container: str) -> int:
    """Bytes in the container's writable layer (`SizeRw` of GET /containers/{id}/json
    with `size=1`). Raises docker.errors.NotFound once the engine has no such container."""
    response = api.get(
        _url(api, f"/containers/{quote(container, safe='')}/json"),
        params={"size": 1},
        timeout=api.timeout,  # as docker-py's own calls: the client's
    )
    _raise_for_status(response)
    return int(response.json().get("SizeRw") or 0)

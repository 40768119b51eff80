"""Talking to Docker engines through the SDK. The only module that builds a client."""

import hashlib
import os
from pathlib import Path

import docker
from django.conf import settings
from docker.tls import TLSConfig

from jobs.models import Host


class EngineError(Exception):
    """The engine could not be reached or refused us; the text is the engine's own."""


def _tls_files(host: Host) -> TLSConfig:
    # The SDK wants files. Write the PEMs from the database once per distinct content,
    # readable by this user only.
    digest = hashlib.sha256((host.tls_ca + host.tls_cert + host.tls_key).encode()).hexdigest()[:16]
    folder = Path(settings.SUANLI_TLS_DIR) / f"host-{host.pk}-{digest}"
    if not folder.exists():
        folder.mkdir(parents=True, mode=0o700, exist_ok=True)
        for name, pem in (
            ("ca.pem", host.tls_ca),
            ("cert.pem", host.tls_cert),
            ("key.pem", host.tls_key),
        ):
            path = folder / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(pem.strip() + "\n")
    return TLSConfig(
        client_cert=(str(folder / "cert.pem"), str(folder / "key.pem")),
        ca_cert=str(folder / "ca.pem"),
        verify=True,
    )


def client_for(host: Host, *, timeout: int | None = None) -> docker.DockerClient:
    timeout = timeout or settings.SUANLI_ENGINE_TIMEOUT
    tls = _tls_files(host) if host.uses_tls else False
    try:
        return docker.DockerClient(
            base_url=host.engine_url, tls=tls, timeout=timeout, version="auto"
        )
    except docker.errors.DockerException as exc:
        raise EngineError(describe(exc)) from exc


def describe(exc: BaseException) -> str:
    """The engine's own error text, without the SDK's noise around it."""
    explanation = getattr(exc, "explanation", None)
    if explanation:
        return str(explanation.decode() if isinstance(explanation, bytes) else explanation).strip()
    text = str(exc).strip() or exc.__class__.__name__
    prefix = "Error while fetching server API version: "
    return text[len(prefix) :] if text.startswith(prefix) else text


def engine_facts(host: Host) -> dict:
    """Ask the engine what it is. Raises EngineError with the engine's text."""
    try:
        client = client_for(host)
        try:
            info = client.info()
            version = client.version()
        finally:
            client.close()
    except EngineError:
        raise
    except Exception as exc:  # requests/urllib3/ssl/OS errors all mean "not reachable"
        raise EngineError(describe(exc)) from exc
    runtimes = info.get("Runtimes") or {}
    swarm = info.get("Swarm") or {}
    return {
        "swarm_state": str(swarm.get("LocalNodeState") or "")[:12],
        # Workers are not told the swarm's ID: its managers name it for every member.
        "swarm_cluster": min(
            (str(m.get("NodeID") or "") for m in swarm.get("RemoteManagers") or []), default=""
        )[:64],
        "swarm_manager": bool(swarm.get("ControlAvailable")),
        "docker_version": str(version.get("Version", ""))[:40],
        "operating_system": str(info.get("OperatingSystem", ""))[:120],
        "cpu_count": info.get("NCPU"),
        "memory_bytes": info.get("MemTotal"),
        "nvidia": "nvidia" in runtimes,
    }


_clients: dict[tuple, docker.DockerClient] = {}


def cached_client(host: Host) -> docker.DockerClient:
    """One client per engine per process: `version="auto"` costs a round trip per client."""
    key = (
        host.pk,
        host.engine_url,
        hashlib.sha256((host.tls_cert + host.tls_key).encode()).hexdigest(),
    )
    client = _clients.get(key)
    if client is None:
        client = _clients[key] = client_for(host, timeout=max(settings.SUANLI_ENGINE_TIMEOUT, 30))
    return client


def forget_client(host: Host) -> None:
    for key in [k for k in _clients if k[0] == host.pk]:
        _clients.pop(key).close()

"""Talking to Docker engines through the SDK. The only module that builds a client.

Layer: nodes, the bottom of it (network, registry, runtime and workspaces use it); uses models
only.
"""

import hashlib
import os
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
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


class _EngineAPI(docker.APIClient):
    """The SDK's client, whose TLS is verified against the engine's CA only: requests lets
    REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE win over a session's own CA (psf/requests#3829),
    which fails every tcp:// engine wherever the environment names a bundle."""

    def merge_environment_settings(self, url, proxies, stream, verify, cert):
        merged = super().merge_environment_settings(url, proxies, stream, verify, cert)
        if isinstance(self.verify, str) and verify is None:
            merged["verify"] = self.verify
        return merged


def client_for(host: Host, *, timeout: int | None = None) -> docker.DockerClient:
    timeout = timeout or settings.SUANLI_ENGINE_TIMEOUT
    tls = _tls_files(host) if host.uses_tls else False
    try:
        client = docker.DockerClient.__new__(docker.DockerClient)  # its __init__ makes .api
        client.api = _EngineAPI(base_url=host.engine_url, tls=tls, timeout=timeout, version="auto")
        return client
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
            # The tags of its images: the host check records the catalog's among them.
            tags = [t for image in client.api.images() for t in image.get("RepoTags") or ()]
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
        "storage_driver": str(info.get("Driver") or "")[:40],
        "backing_fs": dict(pair for pair in info.get("DriverStatus") or [] if len(pair) == 2).get(
            "Backing Filesystem", ""
        ),
        "operating_system": str(info.get("OperatingSystem", ""))[:120],
        "cpu_count": info.get("NCPU"),
        "memory_bytes": info.get("MemTotal"),
        "nvidia": "nvidia" in runtimes,
        "image_tags": tags,
    }


_clients: dict[tuple, docker.DockerClient] = {}
_clients_lock = threading.Lock()  # starts side by side share one client per engine


def cached_client(host: Host) -> docker.DockerClient:
    """One client per engine per process: `version="auto"` costs a round trip per client."""
    key = (
        host.pk,
        host.engine_url,
        hashlib.sha256((host.tls_cert + host.tls_key).encode()).hexdigest(),
    )
    client = _clients.get(key)
    if client is None:
        with _clients_lock:
            client = _clients.get(key)
            if client is None:
                timeout = max(settings.SUANLI_ENGINE_TIMEOUT, 30)
                client = _clients[key] = client_for(host, timeout=timeout)
    return client


def forget_client(host: Host) -> None:
    for key in [k for k in _clients if k[0] == host.pk]:
        _clients.pop(key).close()


CANARY_LABEL = "suanli.canary"


class CanaryFailed(Exception):
    """The engine answers but could not run a container; the text is the engine's own."""


@dataclass(frozen=True)
class CanaryRun:
    """What a canary did: `output` is what it printed (stdout), `note` an operator's note
    when it could not be tried (its image is neither on the engine nor pullable)."""

    output: str = ""
    note: str = ""


def run_canary(host: Host, image: str, *, command=("true",), **options) -> CanaryRun:
    """Prove the engine can start a container: `command` (`true`) in `image`, hardened,
    waited for and removed; `options` are more of the container's (its network, mounts,
    user, limits). Raises EngineError when the engine does not answer, and CanaryFailed with
    the engine's words when it answers but cannot run it or the command fails. The run's
    note says when the canary could not be tried (its image is not on the engine and
    cannot be pulled): that says nothing about the engine."""
    client = client_for(host, timeout=max(settings.SUANLI_ENGINE_TIMEOUT, 30))
    mine = uuid.uuid4().hex[:12]
    try:
        # Canaries of checks cut short (a killed worker) go; a concurrent check's stays.
        for old in client.containers.list(
            ignore_removed=True, all=True, filters={"label": CANARY_LABEL}
        ):
            created = old.attrs.get("Created", "")
            if old.labels.get(CANARY_LABEL) != mine and _age_s(created, time.time()) > 120:
                old.remove(force=True)
        kwargs = {
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "read_only": True,
            "mem_limit": "32m",
            "pids_limit": 16,
            **options,
            "command": list(command),
            "labels": {CANARY_LABEL: mine},
        }
        try:
            container = client.containers.create(image, **kwargs)
        except docker.errors.ImageNotFound:
            try:
                client.images.pull(image)
            except docker.errors.APIError as exc:
                return CanaryRun(
                    note=f"canary not run: {image} is not on the engine and could not be "
                    f"pulled: {describe(exc)}"
                )
            container = client.containers.create(image, **kwargs)
        try:
            container.start()
            outcome = container.wait(timeout=30)
            output = container.logs(stdout=True, stderr=False).decode(errors="replace")
        except docker.errors.NotFound:
            return CanaryRun()  # removed under us (an operator's cleanup): nothing learnt
        finally:
            try:
                container.remove(force=True)
            except docker.errors.NotFound:
                pass
        if outcome.get("StatusCode") != 0:
            raise CanaryFailed(f"the canary ({image}) exited with code {outcome.get('StatusCode')}")
        return CanaryRun(output=output)
    except CanaryFailed:
        raise
    except docker.errors.APIError as exc:
        raise CanaryFailed(describe(exc)) from exc
    except Exception as exc:  # requests/urllib3/OS errors: the engine went away meanwhile
        raise EngineError(describe(exc)) from exc
    finally:
        client.close()


def may_size_root_disk(driver: str, backing_fs: str) -> bool:
    """Whether the engine's storage driver can limit a container's root filesystem
    (`--storage-opt size=`): btrfs and zfs can; overlay2 only on XFS mounted with project
    quotas (pquota), which the engine's info does not say, so `sizes_root_disk` tries."""
    return driver in ("btrfs", "zfs") or (driver == "overlay2" and backing_fs == "xfs")


def sizes_root_disk(host: Host, image: str) -> bool:
    """Whether the engine really makes a container with a root filesystem limit: one is
    made (never started) with `storage_opt` and removed. False when the engine refuses
    the option, or `image` is not there to try with."""
    client = client_for(host, timeout=max(settings.SUANLI_ENGINE_TIMEOUT, 30))
    try:
        container = client.containers.create(
            image, command=["true"], labels={CANARY_LABEL: "size"}, network_mode="none",
            storage_opt={"size": "1G"},
        )  # fmt: skip
        container.remove(force=True)
        return True
    except docker.errors.APIError:  # "--storage-opt is supported only for ..."; no image
        return False
    except Exception as exc:  # requests/urllib3/OS errors: the engine went away meanwhile
        raise EngineError(describe(exc)) from exc
    finally:
        client.close()


def _age_s(created: str, now: float) -> float:
    at = container_time(created)
    return now - at.timestamp() if at else 0.0


# Words of an engine that cannot start containers for reasons of its own (its networks,
# runtime, storage driver), as opposed to the job's (an image that does not exist, a
# command that is not there). Lower case; matched in the engine's error text.
_ENGINE_FAULTS = (
    "could not find bridge",
    "failed to create endpoint",
    "failed to set up container networking",
    "failed to allocate gateway",
    "error creating overlay mount",
    "no space left on device",
    "storage driver",
    "devmapper",
    "unknown or invalid runtime",
    "cannot connect to the docker daemon",
)
# The job's own, although the engine's runtime reports them ("OCI runtime create failed:
# ... exec: "python": executable file not found"): checked first.
_JOB_FAULTS = (
    "executable file not found",
    "no such file or directory",
    "unable to start container process",
    "error mounting",
    "exec:",
    "no such image",
    "pull access denied",
    "manifest",
)


def engine_fault(exc: BaseException) -> bool:
    """Whether a container could not be created or started for a reason of the engine (a
    host problem: the host is degraded and the work moves) rather than of the job."""
    if unreachable(exc):
        return True
    if isinstance(exc, docker.errors.ImageNotFound):
        return False
    text = describe(exc).lower()
    if any(words in text for words in _JOB_FAULTS):
        return False
    return any(words in text for words in _ENGINE_FAULTS)


def unreachable(exc: BaseException) -> bool:
    """The engine did not answer (refused, reset, timed out), as opposed to refusing."""
    return isinstance(exc, EngineError | ConnectionError | OSError) and not isinstance(
        exc, docker.errors.DockerException
    )


def container_time(text: str | None):
    """A container's `State.StartedAt`/`FinishedAt` (RFC 3339, nanoseconds) as an aware
    datetime; None for Docker's zero time or anything unreadable."""
    if not text or text.startswith("0001-"):
        return None
    head, _, tail = text.rstrip("Z").partition(".")
    try:
        at = datetime.fromisoformat(head + (f".{tail[:6]}" if tail else ""))
    except ValueError:
        return None
    return at.replace(tzinfo=UTC) if at.tzinfo is None else at

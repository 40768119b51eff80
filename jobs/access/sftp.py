"""sftp for the SSH gateway (jobs/access/ssh.py), and so OpenSSH's `scp`: per session a
short-lived container on the node's host from `SUANLI_SFTP_IMAGE` (OpenSSH's sftp-server
and its libraries, nothing else; only as the operator made it on that engine, never one
pulled from a registry), as the tenant's uid, with no network, no capability, no log, a
read-only root and only the cluster's volumes mounted where the workspace has them
(runtime.volume_mounts, checked just before the mount). The kernel confines it: a link to
/etc that a job made leads to that container's own /etc, which holds only the tenant's
passwd line. It goes when its attach ends; one left only created by a gateway killed
between create and start is swept by the next sftp session on that engine.

Layer: access, over sessions; uses runtime, engine and models.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tarfile
import time

import docker
from django.conf import settings
from docker.types import LogConfig, Mount

from jobs.access.sessions import ENGINE_ERRORS, Login, Refused, client
from jobs.models import Cluster
from jobs.nodes import runtime, workspaces

log = logging.getLogger("suanli.gateway")

LABEL = workspaces.LABEL_SFTP  # an sftp session's container; value: the login name
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
SFTP_LEFTOVER_S = 60  # an sftp container still only created after this was left behind


def sftp_mounts(cluster: Cluster) -> list[Mount]:
    """The cluster's volumes, checked now, just before the engine mounts them."""
    return runtime.volume_mounts(cluster, cluster.owner_id)


def _etc_archive(uid: int, home: str) -> bytes:
    """The sftp container's whole /etc: the tenant's passwd and group lines (sftp-server
    asks who it runs as), nothing else."""
    files = {
        "passwd": f"tenant:x:{uid}:{uid}:tenant:{home}:/sbin/nologin\n",
        "group": f"tenant:x:{uid}:\n",
    }
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def sftp_image_problem(found: dict) -> str | None:
    """Why the engine's image (`inspect_image`) is not one to run as the sftp container, or
    None. The operator makes it on each engine (.ci/lib.sh imports it); one that came from
    a registry was pulled, maybe at a tenant's request, and is then anyone's to have made."""
    digests = found.get("RepoDigests") or []
    if digests:
        return f"it was pulled from a registry ({', '.join(digests)}), not made on the engine"
    return None


def _sftp_image(api, login: Login) -> str:
    """The id of the engine's SUANLI_SFTP_IMAGE, checked (sftp_image_problem); never
    pulled. The container is made from this id, not the name, so a name retagged
    meanwhile changes nothing."""
    name = settings.SUANLI_SFTP_IMAGE
    not_set_up = (
        f"file transfer is not set up on {login.host.name} (its engine lacks the operator's "
        f"{name}); tell an operator"
    )
    try:
        found = api.inspect_image(name)
    except docker.errors.ImageNotFound:
        raise Refused(not_set_up) from None
    problem = sftp_image_problem(found)
    if problem is not None:
        log.warning("%s: %s on %s is not used for sftp: %s", login.name, name,
                    login.host.name, problem)  # fmt: skip
        raise Refused(not_set_up)
    return found["Id"]


def sftp_sweep(api, login: Login) -> None:
    """Remove the sftp containers of this engine left only created for more than
    SFTP_LEFTOVER_S (a gateway killed between create and start; one that started goes by
    itself when its attach ends)."""
    try:
        found = api.containers(all=True, filters={"label": LABEL, "status": "created"})
    except ENGINE_ERRORS as exc:
        log.info("%s: sftp leftovers on %s not listed: %s", login.name, login.host.name, exc)
        return
    before = time.time() - SFTP_LEFTOVER_S
    for container in found:
        if container.get("Created", before) < before:
            log.info("%s: removing sftp leftover %s on %s", login.name, container["Id"][:12],
                     login.host.name)  # fmt: skip
            with contextlib.suppress(*ENGINE_ERRORS):
                api.remove_container(container["Id"], force=True, v=True)


def sftp_open(login: Login, mounts: list[Mount]) -> tuple[str, object]:
    """sftp-server in a container of its own on the node's host, confined by the kernel:
    the tenant's uid, the cluster's volumes where the workspace has them and nothing else
    of the host's, no network, no capability, no log (its output is the files the tenant
    downloads), a read-only root whose /etc is a fresh volume holding the tenant's passwd
    line. Removed when it ends (stdin closes with the attach, so a gateway that dies
    leaves none running). Returns (id, hijacked socket)."""
    api = client(login).api
    sftp_sweep(api, login)
    image = _sftp_image(api, login)
    uid = runtime.tenant_uid(login.cluster.owner_id)
    home = login.exec_base["workdir"]
    host_config = api.create_host_config(
        mounts=[*mounts, Mount(target="/etc", source=None, type="volume")],
        network_mode="none",
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        read_only=True,
        privileged=False,
        pids_limit=16,
        mem_limit=128 * 2**20,
        memswap_limit=128 * 2**20,
        nano_cpus=10**9,
        auto_remove=True,
        log_config=LogConfig(type=LogConfig.types.NONE),
    )
    try:
        made = api.create_container(
            image,
            [SFTP_SERVER, "-d", home],
            user=f"{uid}:{uid}",
            stdin_open=True,  # and StdinOnce: the attach's end is the container's
            host_config=host_config,
            labels={
                LABEL: login.name,
                runtime.LABEL_CLUSTER: str(login.cluster.pk),
                runtime.LABEL_OWNER: str(login.cluster.owner_id),
            },
        )
    except docker.errors.ImageNotFound:  # removed since it was inspected
        raise Refused(
            f"file transfer is not set up on {login.host.name}; tell an operator"
        ) from None
    container_id = made["Id"]
    try:
        api.put_archive(container_id, "/etc", _etc_archive(uid, home))
        attached = api.attach_socket(
            container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
        )
        api.start(container_id)
    except BaseException:
        sftp_remove(login, container_id)
        raise
    return container_id, attached


def sftp_remove(login: Login, container_id: str) -> None:
    with contextlib.suppress(*ENGINE_ERRORS):
        client(login).api.remove_container(container_id, force=True, v=True)

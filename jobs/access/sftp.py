"""File transfer for the SSH gateway (jobs/access/ssh.py): sftp (and so OpenSSH's `scp`),
and `rsync` and legacy `scp -O` for a workspace whose image lacks them. Per session a
short-lived container on the node's host from `SUANLI_SFTP_IMAGE` (OpenSSH's sftp-server,
rsync and scp with their libraries, nothing else; no shell; only as the operator made it on
that engine, never one pulled from a registry), as the tenant's uid, with no network, no
capability, no log, a read-only root and only the cluster's volumes mounted where the
workspace has them (runtime.volume_mounts, checked just before the mount). The kernel
confines it: a link to /etc that a job made leads to that container's own /etc, which holds
only the tenant's passwd line, and a link to / to its own root (those programs and nothing
of the host's or another tenant's). It runs one program: sftp-server, or `rsync --server`
or `scp -t`/`-f` with the argument shapes their clients send (transfer_command), never a
command of the tenant's. An sftp container goes when its attach ends; an rsync or scp one
once its exit status is read; one left behind by a gateway killed meanwhile is swept by
the next session on that engine.

What a transfer may write is the cluster's writable volumes (in the workspace also its own
/tmp and what the image lets the tenant's uid write); a write elsewhere fails with words
that name those places (not_writable_words; for sftp, WriteWatch reads both ways of the
session for a refused write).

Layer: access, over sessions; uses runtime, engine and models.
"""

from __future__ import annotations

import contextlib
import io
import logging
import posixpath
import shlex
import tarfile
import time
from dataclasses import dataclass

import docker
from django.conf import settings
from django.utils import translation
from django.utils.translation import gettext as _
from docker.types import LogConfig, Mount

from jobs.access.sessions import ENGINE_ERRORS, Login, Refused, client
from jobs.files import pub
from jobs.models import Cluster
from jobs.nodes import runtime, workspaces

log = logging.getLogger("suanli.gateway")

LABEL = workspaces.LABEL_SFTP  # a transfer's container; value: the login name
LABEL_TOOL = "suanli.transfer"  # on the image: the programs it holds; on a container: its one
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
PROGRAMS = {"rsync": "/usr/bin/rsync", "scp": "/usr/bin/scp"}  # in the image, by client name
SFTP_LEFTOVER_S = 60  # an sftp container still only created after this was left behind
EXITED_LEFTOVER_S = 3600  # an rsync/scp one exited and created this long ago: left behind
PER_CLUSTER = 2  # transfer containers running at once for one cluster (each half a core)


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


def _sftp_image(api, login: Login, tool: str = "sftp") -> str:
    """The id of the engine's SUANLI_SFTP_IMAGE, checked (sftp_image_problem), holding
    `tool` (its label LABEL_TOOL, from .ci/lib.sh: an image made before rsync and scp were
    in it runs sftp only); never pulled. The container is made from this id, not the name,
    so a name retagged meanwhile changes nothing."""
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
    held = ((found.get("Config") or {}).get("Labels") or {}).get(LABEL_TOOL, "").split()
    if problem is None and tool != "sftp" and tool not in held:
        problem = f"it holds no {tool} (made before it did: import it again, .ci/lib.sh)"
        not_set_up = (
            f"{tool} is not set up on {login.host.name} for an image without it (its "
            f"engine's {name} is older); tell an operator"
        )
    if problem is not None:
        log.warning("%s: %s on %s is not used for sftp: %s", login.name, name,
                    login.host.name, problem)  # fmt: skip
        raise Refused(not_set_up)
    return found["Id"]


def sftp_sweep(api, login: Login, image: str) -> None:
    """Remove the sftp containers of this engine left only created for more than
    SFTP_LEFTOVER_S (a gateway killed between create and start; one that started goes by
    itself when its attach ends), and the rsync and scp ones exited EXITED_LEFTOVER_S ago.
    Only containers of `image` (the helper image's id): a container inherits its image's
    labels, so a tenant's container of an image labelled as ours is never one."""
    try:
        found = api.containers(all=True, filters={"label": LABEL, "status": "created"})
    except ENGINE_ERRORS as exc:
        log.info("%s: sftp leftovers on %s not listed: %s", login.name, login.host.name, exc)
        return
    try:
        found += api.containers(all=True, filters={"label": LABEL_TOOL, "status": "exited"})
    except ENGINE_ERRORS as exc:
        log.info("%s: transfer leftovers on %s not listed: %s", login.name, login.host.name, exc)
    now = time.time()
    for container in found:
        if container.get("ImageID") != image:
            continue
        exited = container.get("State") == "exited"
        before = now - (EXITED_LEFTOVER_S if exited else SFTP_LEFTOVER_S)
        if container.get("Created", before) < before:
            log.info("%s: removing sftp leftover %s on %s", login.name, container["Id"][:12],
                     login.host.name)  # fmt: skip
            with contextlib.suppress(*ENGINE_ERRORS):
                api.remove_container(container["Id"], force=True, v=True)


def sftp_open(login: Login, mounts: list[Mount]) -> tuple[str, object]:
    """sftp-server in a container of its own on the node's host (helper_open), starting
    in the login's home. Removed when it ends (stdin closes with the attach, so a gateway
    that dies leaves none running). Returns (id, hijacked socket)."""
    home = login.exec_base["workdir"]
    return helper_open(login, mounts, [SFTP_SERVER, "-d", home], tool="sftp")


def helper_open(
    login: Login, mounts: list[Mount], argv: list[str], *, tool: str, language: str | None = None
):
    """`argv` (sftp-server, or an rsync or scp server of transfer_command) in a container
    of its own on the node's host, confined by the kernel: the tenant's uid, the cluster's
    volumes where the workspace has them and nothing else of the host's, no network, no
    capability, no log (its output is the files the tenant downloads), a read-only root
    whose /etc is a fresh volume holding the tenant's passwd line, few processes and
    little memory. An sftp one is removed by the engine when it ends; an rsync or scp one
    once helper_exit_code read its status. Returns (id, hijacked socket)."""
    api = client(login).api
    image = _sftp_image(api, login, tool)
    sftp_sweep(api, login, image)
    uid = runtime.tenant_uid(login.cluster.owner_id)
    home = login.exec_base["workdir"]
    mounted = {m["Target"] for m in mounts}
    host_config = api.create_host_config(
        mounts=[*mounts, Mount(target="/etc", source=None, type="volume")],
        network_mode="none",
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        read_only=True,
        privileged=False,
        pids_limit=16,
        mem_limit=256 * 2**20,
        memswap_limit=256 * 2**20,
        nano_cpus=5 * 10**8,  # outside the cluster's reservation: half a core, PER_CLUSTER
        auto_remove=tool == "sftp",
        log_config=LogConfig(type=LogConfig.types.NONE),
    )
    try:
        made = api.create_container(
            image,
            argv,
            user=f"{uid}:{uid}",
            working_dir=home if home in mounted else "/",
            environment=["HOME=/etc"],  # not the tenant's home: no ~/.popt of hers is read
            stdin_open=True,  # and StdinOnce: the attach's end is the container's
            host_config=host_config,
            labels={
                LABEL: login.name,
                LABEL_TOOL: tool,
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
        if not _among_first(api, login, image, container_id):
            with translation.override(language):
                raise Refused(
                    _("two copies are already running on this cluster; wait for one to finish")
                )
        api.put_archive(container_id, "/etc", _etc_archive(uid, home))
        attached = api.attach_socket(
            container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
        )
        api.start(container_id)
    except BaseException:
        sftp_remove(login, container_id)
        raise
    return container_id, attached


def _created_ns(created: str) -> tuple[str, int]:
    """An engine's `Created` (RFC 3339, nanoseconds with trailing zeros cut) as sortable."""
    head, _dot, rest = created.partition(".")
    digits = "".join(ch for ch in rest if ch.isdigit())
    return head, int((digits + "0" * 9)[:9])


def _among_first(api, login: Login, image: str, container_id: str) -> bool:
    """Whether the container just made is among the cluster's first PER_CLUSTER transfer
    containers on this engine (created or running, of the helper image), by when each was
    made: counted after making it, so two gateways making one at once never both pass."""
    filters = {"label": [LABEL, f"{runtime.LABEL_CLUSTER}={login.cluster.pk}"],
               "status": ["created", "running"]}  # fmt: skip
    made = []
    for found in api.containers(all=True, filters=filters):
        if found.get("ImageID") != image:
            continue
        with contextlib.suppress(*ENGINE_ERRORS):
            made.append((_created_ns(api.inspect_container(found["Id"])["Created"]), found["Id"]))
    return container_id in [ident for _when, ident in sorted(made)[:PER_CLUSTER]]


def helper_exit_code(login: Login, container_id: str) -> int:
    """The exit status of an rsync or scp container that ended, which then goes."""
    api = client(login).api
    try:
        return int(api.wait(container_id, timeout=30).get("StatusCode", 255))
    except (*ENGINE_ERRORS, ValueError):
        return 255
    finally:
        sftp_remove(login, container_id)


def sftp_remove(login: Login, container_id: str) -> None:
    with contextlib.suppress(*ENGINE_ERRORS):
        client(login).api.remove_container(container_id, force=True, v=True)


# -- rsync and legacy scp: what may run in our container, and where a transfer may write ----

# rsync's daemon and its sockets: never over the gateway, and never in our container.
RSYNC_REFUSED = ("--daemon", "--config", "--dparam", "--detach", "--no-detach", "--address",
                 "--port", "--sockopts", "--rsync-path", "--rsh")  # fmt: skip
SCP_OPTIONS = {"-t", "-f", "-r", "-p", "-d", "-v", "-q"}


@dataclass(frozen=True)
class Transfer:
    """A command that is the server side of rsync or legacy scp, as their clients send it."""

    tool: str  # "rsync" | "scp"
    program: str  # as the client named it (`--rsync-path`): looked for in the workspace
    args: list[str]  # after the program: what our container runs after PROGRAMS[tool]
    written: list[str]  # the paths it writes to (rsync's receiver, scp -t), as sent


def transfer_command(command: str) -> Transfer | None:
    """`rsync --server [options] . PATH...` or `scp [-v -r -p -d] -t|-f [--] PATH` as the
    clients send them (a path may be quoted), or None: anything else (another command,
    shell syntax, rsync's daemon mode, `--rsync-path=\"cd x && rsync\"`) is not run in our
    container, only in the workspace as any command is."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    if len(words) < 3 or any(not word or "\0" in word for word in words):
        return None
    program = words[0]
    tool = posixpath.basename(program)
    if tool == "rsync" and words[1] == "--server" and "." in words[2:]:
        dot = words.index(".", 2)
        options, paths = words[2:dot], words[dot + 1 :]
        for option in options:
            if not option.startswith("-") or option.split("=", 1)[0] in RSYNC_REFUSED:
                return None
        # rsync reads options after its paths too (`. --daemon` runs its daemon, reading
        # ./rsyncd.conf); its client sends a name starting with - as ./-x.
        if any(path.startswith("-") for path in paths):
            return None
        receiving = "--sender" not in options
        return Transfer("rsync", program, words[1:], paths if receiving else [])
    if tool == "scp":
        options, paths = words[1:-1], words[-1:]
        if options and options[-1] == "--":
            options = options[:-1]
        directions = [o for o in options if o in ("-t", "-f")]
        if len(directions) != 1 or not set(options) <= SCP_OPTIONS:
            return None
        if len(options) != len(set(options)):
            return None
        if paths[0].startswith("-") and words[-2] != "--":
            return None
        return Transfer("scp", program, words[1:], paths if directions == ["-t"] else [])
    return None


def _probe(login: Login, script: str, *args: str) -> bool:
    """Whether `script` (sh, with `args`) exits 0 in the workspace, as the tenant, from the
    login's home."""
    api = client(login).api
    made = api.exec_create(
        login.container_id,
        ["/bin/sh", "-c", script, "probe", *args],
        user=login.exec_base["user"],
        workdir=login.exec_base["workdir"],
        environment=login.exec_base["environment"],
        stdout=True,
        stderr=True,
        privileged=False,
    )
    api.exec_start(made["Id"])
    return api.exec_inspect(made["Id"]).get("ExitCode") == 0


def workspace_has(login: Login, program: str) -> bool:
    """Whether the workspace's shell finds `program` (an image without a shell: no)."""
    return _probe(login, 'command -v "$1" >/dev/null 2>&1', program)


# `$1`, or the nearest folder above it that exists, is the tenant's to write.
_MAY_WRITE = (
    'p=$1; while [ -n "$p" ] && [ ! -e "$p" ]; do '
    'case "$p" in */*) p=${p%/*} ;; *) p=. ;; esac; done; [ -w "${p:-/}" ]'
)


def workspace_may_write(login: Login, path: str) -> bool:
    """Whether the tenant may write `path` in the workspace (where it is, or where it
    would be made), as its image and volumes allow."""
    return _probe(login, _MAY_WRITE, path)


def writable_places(mounts: list[Mount]) -> list[str]:
    """The mount points a transfer in our container may write: the cluster's volumes that
    are not read-only (never /pub)."""
    return [
        m["Target"] for m in mounts
        if not m.get("ReadOnly") and not pub.covers_pub(m["Target"])
    ]  # fmt: skip


def volume_places(cluster: Cluster) -> list[str]:
    """The mount points of the cluster's volumes that are not read-only (what the
    workspace's tenant may write besides its own /tmp and what its image allows)."""
    return [v.target for v in cluster.volumes.all() if not v.read_only]


def is_inside(path: str, home: str, places: list[str]) -> bool:
    """`path` (relative to `home` where it is not absolute) lies in one of `places`, as
    written (a link inside a volume is the kernel's to follow, within the container)."""
    normal = posixpath.normpath(posixpath.join(home, path))
    if normal.startswith("//"):
        normal = normal[1:]
    return any(normal == place or normal.startswith(place.rstrip("/") + "/") for place in places)


def not_writable_words(
    path: str, places: list[str], *, workspace: bool, language: str | None = None
) -> str:
    """Why `path` could not be written, naming where a transfer writes instead, in
    `language` (the researcher's: admission.language_of). `workspace`: the transfer ran in
    the workspace (its own /tmp too), else in our container."""
    with translation.override(language):
        return _not_writable_words(path, places, workspace=workspace)


def _not_writable_words(path: str, places: list[str], *, workspace: bool) -> str:
    shown = "".join(ch if ch.isprintable() else "?" for ch in path[:200])
    if workspace and not places:
        return _(
            "%(path)s is not writable by you in the workspace: only /tmp (the workspace's "
            "own, gone with it) is yours to write, as this cluster has no volume"
        ) % {"path": shown}
    if workspace:
        return _(
            "%(path)s is not writable by you in the workspace: only your volumes "
            "(%(places)s) and /tmp (the workspace's own, gone with it) are yours to write"
        ) % {"path": shown, "places": ", ".join(places)}
    if not places:
        return _(
            "%(path)s is not writable: this image has no rsync or scp of its own and scp, sftp "
            "and rsync then write only to the cluster's volumes, and this cluster has none; "
            "request one with a volume, or copy through a shell (ssh ... 'cat > /tmp/f' < f)"
        ) % {"path": shown}
    return _(
        "%(path)s is not writable: scp, sftp and rsync write only to your volumes "
        "(%(places)s); everything else is read-only to them"
    ) % {"path": shown, "places": ", ".join(places)}


# -- sftp: which refused write to say in words ----------------------------------------------

_OPEN, _MKDIR, _STATUS, _HANDLE = 3, 14, 101, 102
_WRITES = 0x02 | 0x04 | 0x08 | 0x10  # SSH_FXF_WRITE, APPEND, CREAT, TRUNC
_PENDING = 256  # writes awaiting their answer that a watch remembers


class _Packets:
    """sftp's packets (uint32 length, then the body) from a stream, as it comes: each
    packet's first HEAD bytes go to `on_packet`, the rest (a file's data) is skipped."""

    HEAD = 4 + 1 + 4 + 4 + 4096 + 4  # length, type, id, a path's length, a path, flags
    MAX = 1 << 20

    def __init__(self, on_packet):
        self.on_packet = on_packet
        self.head = bytearray()
        self.length: int | None = None
        self.skip = 0
        self.broken = False

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n and not self.broken:
            if self.skip:
                step = min(self.skip, n - i)
                self.skip -= step
                i += step
                continue
            need = 4 if self.length is None else min(self.length, self.HEAD)
            take = min(need - len(self.head), n - i)
            self.head += data[i : i + take]
            i += take
            if len(self.head) < need:
                continue
            if self.length is None:
                self.length = int.from_bytes(self.head, "big")
                self.head.clear()
                self.broken = not 0 < self.length <= self.MAX
                continue
            body, self.skip = bytes(self.head), self.length - need
            self.head.clear()
            self.length = None
            self.on_packet(body)


def _string(body: bytes, at: int) -> tuple[bytes, int]:
    size = int.from_bytes(body[at : at + 4], "big")
    return body[at + 4 : at + 4 + size], at + 4 + size


class WriteWatch:
    """Both ways of an sftp session, read as they pass: a write (an open to write, a
    mkdir) outside the writable places that sftp-server refused gets words (once a
    session), which the gateway writes to the channel's stderr, which `scp` and `sftp` print."""

    def __init__(self, home: str, places: list[str]):
        self.home, self.places = home, places
        self.language: str | None = None  # the researcher's, once known
        self.pending: dict[int, str] = {}
        self.said: str | None = None
        self.told = False
        self.up = _Packets(self._request)
        self.down = _Packets(self._answer)

    def client_sent(self, data: bytes) -> None:
        self.up.feed(data)

    def server_sent(self, data: bytes) -> str | None:
        """The words to say now (before this data), or None."""
        self.down.feed(data)
        said, self.said = self.said, None
        return said

    def _request(self, body: bytes) -> None:
        if len(body) < 9 or body[0] not in (_OPEN, _MKDIR):
            return
        ident = int.from_bytes(body[1:5], "big")
        path, at = _string(body, 5)
        if body[0] == _OPEN:
            flags = int.from_bytes(body[at : at + 4], "big")
            if len(body) < at + 4 or not flags & _WRITES:
                return
        if len(self.pending) >= _PENDING:
            self.pending.pop(next(iter(self.pending)))
        self.pending[ident] = path.decode("utf-8", "replace")

    def _answer(self, body: bytes) -> None:
        if len(body) < 5 or body[0] not in (_STATUS, _HANDLE):
            return
        path = self.pending.pop(int.from_bytes(body[1:5], "big"), None)
        if path is None or body[0] != _STATUS or self.told:
            return
        if int.from_bytes(body[5:9], "big") != 0 and not is_inside(path, self.home, self.places):
            self.told = True
            self.said = not_writable_words(
                path, self.places, workspace=False, language=self.language
            )

"""The SSH gateway (Procfile `gateway`, `manage.py suanli_gateway`): `ssh`, `scp`/`sftp` and
`ssh -L` into the workspaces of a researcher's running clusters (jobs/nodes/workspaces.py).

`ssh -p 2222 c42-0@console` logs in to node 0 of cluster 42 with a key attached to that
cluster by its owner; nothing else logs in (no password, no other method). What a login
gets, every part through the node's engine, so remote engines and any image work alike:
- a shell (with a PTY, window changes followed) or `ssh host cmd` with its exit status:
  an exec in the workspace as the tenant's uid (workspaces.exec_kwargs);
- sftp, and so OpenSSH's `scp`: per session a short-lived container on the node's host
  from `SUANLI_SFTP_IMAGE` (OpenSSH's sftp-server and its libraries, nothing else; only
  as the operator made it on that engine, never one pulled from a registry), as
  the tenant's uid, with no network, no capability, no log, a read-only root and only the
  cluster's volumes mounted where the workspace has them (runtime.volume_mounts, checked
  just before the mount). The kernel confines it: a link to /etc that a job made leads to
  that container's own /etc, which holds only the tenant's passwd line;
- local forwarding to localhost of the workspace: an exec of a relay (nc, else python3,
  else bash's /dev/tcp) inside it. No remote forwarding, agent or X11 forwarding.

Refusals come in words, as an authentication banner, before the client gives up. The
client's unsigned "would this key do?" query gets the same yes for every well-formed login
name and every key, so it tells nothing (not even by its timing): the key is looked up
only once the client signed with it. A key that is not attached to the named cluster
(another researcher's key, an unknown key, a cluster that does not exist, an account that
is off) then gets the same words, which name nothing but what the client typed. What is
told only to the holder of an attached key's private half: the cluster is not running,
the node does not exist, the workspace is not up, the researcher has
`SUANLI_SSH_MAX_SESSIONS` sessions open already (counted in Redis with an expiry, so that
sessions of every gateway process count and a killed one's expire). A connection may try
AUTH_KEYS keys; the next one ends it, in words.

Guessing is throttled like the web log-in (django-axes, console/auth.py): a connection from
an address that asked to log in and ended without logging in counts as one failed log-in of
that address (one, however many keys its client offered: an agent with five keys before
the right one logs in and counts nothing; a holder of an attached key who is told the
cluster is not running counts nothing either). At AXES_FAILURE_LIMIT failures within the
cool-off (AXES_COOLOFF_TIME) the address is locked: each new connection from it is told so
in words and ended before any key is looked at, the right key too, until the cool-off has
passed since its last failure or an operator deletes its access attempt in the admin. The
failures are axes's own rows in the database, so every gateway process and the web log-in
count the same ones; a refused connection counts nothing (the lock does not grow).

What a connection may spend: a session is a connection, and each sftp container beyond a
connection's first (so a researcher's containers never outnumber their sessions); a
connection (OpenSSH's ControlMaster) may have `SUANLI_SSH_MAX_CHANNELS` channels (shells,
commands, sftp, -L relays) open at once, and the next channel open is refused in words.
Every channel open checks again that the cluster still runs, the node is still live with
the same workspace, the key is still attached and the account is on; when that no longer
holds the channel is refused and the connection ends, and the heartbeat ends the
connections of clusters that stopped running meanwhile. What a client asks of a channel
is bounded too: window sizes (1..1000, one resize in flight, the latest wins) and its
environment (LANG and LC_* only, at most ENV_NAMES names of at most ENV_VALUE bytes).

Every login goes on the cluster's timeline with its key's fingerprint. A connection with
no data either way for `SUANLI_SSH_IDLE_S` is closed. Docker does not end an exec when its
client goes (moby/moby#9098): when a channel closes first, a second exec hangs up
(SIGHUP) the processes that carry that channel's marker in their environment, as the
kernel does for an SSH session whose connection drops (console/terminal.py does the same).
Output is read from the engine only as fast as the client takes it: a channel's window,
and the connection's socket (a client that stops reading while it advertises a huge
window stops every engine read of its connection, rather than have the gateway hold it).

Threads: the engine's hijacked sockets (exec, attach) are blocking, plain or TLS. Each is
bridged to the event loop by two threads of its own (a reader, a writer) that share it
non-blocking under a lock and wait in poll(), so a TLS socket is never used by two threads
at once and nothing spins. Database reads run on a small pool of their own threads
(each call starts with close_old_connections), engine and Redis calls on the loop's
executor: the event loop itself never waits on anything. Engine errors are logged in the
engine's words; a researcher is told what failed, without the engine's addresses. The
process lives through Redis and PostgreSQL restarts: a login meanwhile is refused in
words (the database) or not counted (Redis), and the outage is logged once (jobs.base.outage).

The host key (`SUANLI_SSH_HOST_KEY`, and its .pub beside it) is made by the gateway when
it starts; every other process (the console's pages) only reads it.

Layer: gateway, beside runner and under services; uses workspaces, lifecycle, runtime,
engine, outage and models.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import io
import logging
import os
import secrets
import select
import signal
import socket
import ssl
import struct
import tarfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import asyncssh
import django_rq
import docker
from axes.handlers.proxy import AxesProxyHandler
from axes.helpers import get_cool_off
from django.conf import settings
from django.contrib.auth.signals import user_login_failed
from django.db import close_old_connections
from django.http import HttpRequest
from django.utils.translation import gettext_noop
from docker.types import LogConfig, Mount

from jobs.base import addresses
from jobs.base.outage import DB_DOWN, REDIS_DOWN, Outage, close_db_connections
from jobs.base.text import Text
from jobs.events import lifecycle
from jobs.models import Cluster, Host, Node
from jobs.nodes import engine, runtime, workspaces

log = logging.getLogger("suanli.gateway")

LABEL = "suanli.sftp"  # an sftp session's container; value: the login name
MARKER = "SUANLI_SSH"  # env of every exec of a channel: its own value, for the hang-up
# bash where the image has it (a login shell: the image's profile), else the POSIX shell.
LOGIN_SHELL = ["/bin/sh", "-c", "command -v bash >/dev/null && exec bash -l || exec sh"]
# $1: the channel's marker. Every process that inherited it gets SIGHUP.
HANG_UP = (
    'for p in /proc/[0-9]*; do tr "\\0" "\\n" < "$p/environ" 2>/dev/null'
    ' | grep -qxF "$1" && kill -HUP "${p#/proc/}" 2>/dev/null; done; true'
)
# $1: the port on the workspace's loopback. stdin to it, what it says to stdout.
RELAY = (
    'if command -v nc >/dev/null 2>&1; then exec nc 127.0.0.1 "$1"; fi\n'
    'if command -v python3 >/dev/null 2>&1; then exec python3 -c "$2" "$1"; fi\n'
    "if command -v bash >/dev/null 2>&1; then exec bash -c "
    '\'exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1; cat <&3 & cat >&3; wait\' relay "$1"; fi\n'
    'echo "the image has no nc, python3 or bash to reach port $1" >&2; exit 127'
)
RELAY_PY = (
    "import socket,sys,threading\n"
    "s=socket.create_connection(('127.0.0.1',int(sys.argv[1])))\n"
    "def up():\n"
    "    while b:=sys.stdin.buffer.read1(65536): s.sendall(b)\n"
    "    s.shutdown(socket.SHUT_WR)\n"
    "threading.Thread(target=up,daemon=True).start()\n"
    "while b:=s.recv(65536): sys.stdout.buffer.write(b); sys.stdout.buffer.flush()\n"
)
SFTP_SERVER = "/usr/lib/openssh/sftp-server"
# A TTY exec passes stdin through Docker's detach-key filter (ctrl-p ctrl-q by default):
# a sequence no one types, so that ctrl-p (bash's previous line) stays a keystroke.
DETACH_KEYS = "ctrl-^,ctrl-_,ctrl-^,ctrl-_,ctrl-^"
LOCALHOST = ("localhost", "127.0.0.1")
CHUNK = 65536
HIGH_WATER = 1 << 20  # bytes for the engine not sent yet: stop reading the client
LOW_WATER = 1 << 18
SESSION_TTL_S = 90  # a session's count in Redis lives this long unless refreshed
HEARTBEAT_S = 30
AUTH_KEYS = 6  # keys one connection may try (OpenSSH's MaxAuthTries)
TERM_MAX = 1000  # columns and rows of a terminal
ENV_NAMES = 8  # environment a client may pass (LANG, LC_*): names, and bytes of a value
ENV_VALUE = 256
SFTP_LEFTOVER_S = 60  # an sftp container still only created after this was left behind
NO_HOST_KEY = "none yet: the SSH gateway makes its host key when it first starts"
_ENGINE_ERRORS = (docker.errors.DockerException, engine.EngineError, OSError)


def max_channels() -> int:
    """`SUANLI_SSH_MAX_CHANNELS` (10): channels one connection may have open at once."""
    return max(1, int(settings.SUANLI_SSH_MAX_CHANNELS))


# -- what the console page shows ------------------------------------------------------------


def ssh_port() -> int:
    """The port researchers' `ssh -p` names."""
    return int(settings.SUANLI_SSH_PORT)


def host_key_fingerprint(create: bool = False) -> str:
    """`SHA256:...` of the gateway's host key, as `ssh` shows it on a first login. Only
    reads the key (its .pub where this process may not read the private half); NO_HOST_KEY
    while there is none yet. The gateway itself makes it on start (`create=True`)."""
    if create:
        return _host_key().get_fingerprint("sha256")
    path = Path(settings.SUANLI_SSH_HOST_KEY)
    public = _public_path(path)
    for candidate, read in ((public, asyncssh.read_public_key), (path, asyncssh.read_private_key)):
        try:
            found = candidate.stat()
        except FileNotFoundError:
            continue
        stamp = (str(candidate), found.st_mtime_ns, found.st_size)
        key = _keys.get(stamp)
        if key is None:
            key = _keys[stamp] = read(str(candidate))
        return key.get_fingerprint("sha256")
    return NO_HOST_KEY


_keys: dict[tuple, asyncssh.SSHKey] = {}


def _public_path(path: Path) -> Path:
    return path.with_name(path.name + ".pub")


def _host_key() -> asyncssh.SSHKey:
    """The gateway's own: made when there is none, its .pub written when missing."""
    path = Path(settings.SUANLI_SSH_HOST_KEY)
    try:
        found = path.stat()
    except FileNotFoundError:
        _make_host_key(path)
        found = path.stat()
    if found.st_mode & 0o077 and found.st_uid == os.geteuid():
        log.warning("the SSH host key %s was readable by others: made 0600", path)
        path.chmod(0o600)
    stamp = (str(path), found.st_mtime_ns, found.st_size)
    key = _keys.get(stamp)
    if key is None:
        key = _keys[stamp] = asyncssh.read_private_key(str(path))
    _write_public(path, key)
    return key


def _write_public(path: Path, key: asyncssh.SSHKey) -> None:
    """The .pub beside the key (0644: it is public), so that the console's processes can
    show the fingerprint without reading the private half. Replaced whole when it is not
    this key's."""
    public = _public_path(path)
    text = key.export_public_key()
    with contextlib.suppress(OSError):
        if public.read_bytes() == text:
            return
    temporary = public.with_name(f".{public.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as fh:
            fh.write(text)
        os.replace(temporary, public)
    except OSError as exc:
        log.warning("the SSH host key's %s not written: %s", public, exc)
    finally:
        temporary.unlink(missing_ok=True)


def _make_host_key(path: Path) -> None:
    """An ed25519 key, 0600, written whole under a temporary name and linked into place:
    two processes making it at once end with one key, the first one's."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = asyncssh.generate_private_key("ssh-ed25519", comment="suanli-gateway")
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(key.export_private_key())
        with contextlib.suppress(FileExistsError):
            os.link(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    log.info("made the SSH host key %s (%s)", path, key.get_fingerprint("sha256"))


# -- an engine's hijacked socket, bridged to the event loop ---------------------------------


class _EOF:
    pass


class _CLOSE:
    pass


class EngineStream:
    """One exec's or attach's socket, its two threads, and flow control both ways.

    Output arrives on the loop through `on_output(data, stderr)` (Docker's frames taken
    apart when the stream is multiplexed, i.e. has no TTY), then `on_end()` once. Input
    (`write`, `write_eof`) queues for the writer thread from the start, so nothing typed
    before the engine answered is lost. `hold(reason, True/False)` holds the reader while
    any reason holds (the SSH channel's window is full, the connection's socket is), and
    the reader never has more than HIGH_WATER bytes handed to the loop and not yet taken;
    `on_backlog(True/False)` asks the caller to stop and start reading the client while
    too much input waits for the engine."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        on_output: Callable[[bytes, bool], None],
        on_end: Callable[[], None],
        on_backlog: Callable[[bool], None],
        multiplexed: bool,
    ):
        self._loop = loop
        self._on_output = on_output
        self._on_end = on_end
        self._on_backlog = on_backlog
        self.multiplexed = multiplexed
        self._queue: list = []
        self._queued = threading.Condition()
        self._backlog = 0
        self._held = False
        self._holds: set[str] = set()
        self._may_read = threading.Event()
        self._may_read.set()
        self._handed = 0  # bytes on their way to the loop, not taken yet
        self._taken = threading.Condition()
        self._io = threading.Lock()
        self._sock: socket.socket | None = None
        self._keep = None  # the SDK's object (it holds the HTTP response: TLS dies with it)
        self._writing: threading.Thread | None = None
        self._tls = False
        self._closing = False
        self.ended = False

    # on the loop

    def start(self, hijacked) -> None:
        """Take over the engine's socket (after the upgrade) and start the threads."""
        self._keep = hijacked
        sock = getattr(hijacked, "_sock", hijacked)  # plain ones come in a SocketIO
        self._sock = sock
        self._tls = isinstance(sock, ssl.SSLSocket)
        sock.setblocking(False)
        # What came with the upgrade's headers waits in the HTTP response's buffer, not
        # on the socket (a quick `echo` can): read it from there first.
        response = getattr(hijacked, "_response", None)
        buffered = getattr(getattr(getattr(response, "raw", None), "_fp", None), "fp", None)
        first = b""
        if hasattr(buffered, "read1"):
            with contextlib.suppress(OSError, ValueError):
                first = buffered.read1(CHUNK) or b""
        if self._closing:
            self._shut()
        self._writing = threading.Thread(target=self._writer, daemon=True)
        self._writing.start()
        threading.Thread(target=self._reader, args=(first,), daemon=True).start()

    def write(self, data: bytes) -> None:
        if not data or self._closing:
            return
        with self._queued:
            self._queue.append(bytes(data))
            self._backlog += len(data)
            self._queued.notify()
            hold = self._backlog > HIGH_WATER and not self._held
            if hold:
                self._held = True
        if hold:
            self._on_backlog(True)

    def write_eof(self) -> None:
        with self._queued:
            self._queue.append(_EOF)
            self._queued.notify()

    def hold(self, reason: str, on: bool) -> None:
        if self._closing:
            return
        if on:
            self._holds.add(reason)
            self._may_read.clear()
        else:
            self._holds.discard(reason)
            if not self._holds:
                self._may_read.set()

    def close(self) -> None:
        """Stop both threads and drop the socket (idempotent)."""
        if self._closing:
            return
        self._closing = True
        self._queue_close()
        self._may_read.set()
        with self._taken:
            self._taken.notify_all()
        self._shut()

    def _queue_close(self) -> None:
        with self._queued:
            self._queue.append(_CLOSE)
            self._queued.notify()

    # on the threads

    def _shut(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError, ValueError):
                # Under the TLS layer: wakes both threads from poll() whatever its state.
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)

    def _wait(self, events: int) -> None:
        poller = select.poll()
        poller.register(self._sock, events)
        poller.poll()

    def _recv(self) -> bytes:
        sock = self._sock
        while True:
            if not (self._tls and sock.pending()):
                self._wait(select.POLLIN)
            with self._io:
                try:
                    return sock.recv(CHUNK)
                except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    continue  # TLS needed more than was there; wait again

    def _send_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            with self._io:
                try:
                    view = view[self._sock.send(view) :]
                    continue
                except (BlockingIOError, ssl.SSLWantWriteError):
                    events = select.POLLOUT
                except ssl.SSLWantReadError:
                    events = select.POLLIN
            self._wait(events)

    def _deliver(self, data: bytes, stderr: bool = False) -> None:
        with self._taken:
            while self._handed > HIGH_WATER and not self._closing:
                self._taken.wait()
            self._handed += len(data)
        self._call(self._take, data, stderr)

    def _take(self, data: bytes, stderr: bool) -> None:
        """On the loop: hand the output on, and let the reader hand more."""
        with self._taken:
            self._handed -= len(data)
            self._taken.notify()
        self._on_output(data, stderr)

    def _call(self, fn, *args) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: the process is ending
            self._loop.call_soon_threadsafe(fn, *args)

    def _reader(self, first: bytes) -> None:
        pending = b""
        try:
            data = first or self._recv()
            while data:
                if not self.multiplexed:
                    self._deliver(data)
                else:
                    pending += data
                    # Docker's frames: stream (1 stdout, 2 stderr), 3 zero bytes, size.
                    while len(pending) >= 8:
                        kind, size = pending[0], struct.unpack(">I", pending[4:8])[0]
                        if len(pending) < 8 + size:
                            break
                        if size:
                            self._deliver(pending[8 : 8 + size], kind != 1)
                        pending = pending[8 + size :]
                self._may_read.wait()
                if self._closing:
                    break
                data = self._recv()
        except (OSError, ValueError):
            pass  # closed under us: the channel went, or the engine
        finally:
            self._call(self.close)
            self._queue_close()
            self._shut()
            self._writing.join(timeout=10)  # it fails fast on the shut socket
            with contextlib.suppress(OSError, ValueError):
                self._sock.close()
            self._call(self._ended)

    def _ended(self) -> None:
        self.ended = True
        self._on_end()

    def _writer(self) -> None:
        try:
            while True:
                with self._queued:
                    while not self._queue:
                        self._queued.wait()
                    item = self._queue.pop(0)
                if item is _CLOSE:
                    return
                if item is _EOF:
                    if not self._tls:  # TLS has no half-close: the process keeps its stdin
                        with self._io:
                            self._sock.shutdown(socket.SHUT_WR)
                    continue
                self._send_all(item)
                with self._queued:
                    self._backlog -= len(item)
                    release = self._held and self._backlog < LOW_WATER
                    if release:
                        self._held = False
                if release:
                    self._call(self._on_backlog, False)
        except (OSError, ValueError):
            pass  # the process is gone: its stdin with it


# -- who may log in: the database, on threads of its own -------------------------------------


@dataclass
class Login:
    """What an admitted connection reaches: one node's workspace."""

    name: str
    cluster: Cluster
    index: int
    host: Host
    container_id: str
    fingerprint: str
    key_data: bytes  # the key it proved, checked again on every channel open
    exec_base: dict  # workspaces.exec_kwargs as the tenant, for every exec of the login


class Refused(Exception):
    """A login is refused; the text is the banner, for the researcher."""


_db_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gateway-db")
_database = Outage("PostgreSQL (gateway)", log)
_redis = Outage("Redis (gateway)", log)
_DB_AWAY = (
    "Suanli cannot check this login right now (its database does not answer); "
    "try again in a minute."
)


async def _in_db(fn, *args):
    """`fn(*args)` on a database thread, with that thread's dead or old connection
    replaced first; a database outage becomes a refusal in words."""

    def call():
        close_old_connections()
        try:
            result = fn(*args)
        except DB_DOWN as exc:
            close_db_connections()
            _database.failed(exc)
            raise Refused(_DB_AWAY) from None
        _database.ok()
        return result

    return await asyncio.get_running_loop().run_in_executor(_db_pool, call)


def key_attached(cluster_id: int, fingerprint: str, public_data: bytes) -> bool:
    """The key is one the cluster's owner attached to it (the same key, not only the same
    fingerprint), and the owner's account is on. False for anything else, alike: another
    researcher's key, a key attached to no cluster, a cluster that does not exist, an
    account an operator turned off."""
    cluster = (
        Cluster.objects.filter(pk=cluster_id, owner__is_active=True).only("pk", "owner_id").first()
    )
    if cluster is None:
        return False
    for text in cluster.ssh_keys.filter(
        owner_id=cluster.owner_id, fingerprint=fingerprint
    ).values_list("public_key", flat=True):
        try:
            if asyncssh.import_public_key(text).public_data == public_data:
                return True
        except (asyncssh.KeyImportError, ValueError):
            continue
    return False


def _workspace_node(cluster: Cluster, index: int, name: str) -> Node:
    """The live node `index` of a running cluster with workspaces, whose workspace was made;
    else Refused in the words workspaces.running uses (what the engine says is asked
    apart, off the database's threads: workspace_up)."""
    try:
        node = workspaces.live_node(cluster, index)
    except workspaces.WorkspaceError as exc:
        raise Refused(f"Suanli: {name}: {exc}.") from None
    return node


def admit(name: str, cluster_id: int, index: int, fingerprint: str, key_data: bytes) -> Login:
    """What the database says of a proven holder of an attached key: the node's workspace
    to reach, or Refused saying why not (the cluster's state, a missing node, a workspace
    not made yet). Whether the engine runs it is workspace_up's."""
    cluster = Cluster.objects.filter(pk=cluster_id).first()
    if cluster is None:  # deleted since its key was checked
        raise Refused(f"Suanli: {name}: there is no such cluster.")
    node = _workspace_node(cluster, index, name)
    return Login(
        name=name, cluster=cluster, index=index, host=node.host,
        container_id=node.workspace_container, fingerprint=fingerprint, key_data=key_data,
        exec_base=workspaces.exec_kwargs(cluster, [], tty=False),
    )  # fmt: skip


def workspace_up(login: Login) -> None:
    """The engine runs the login's workspace, or Refused saying so in words (the engine's
    own text, which names its addresses, goes to the log only). Blocking: the executor's."""
    index = login.index
    try:
        found = _client(login).api.inspect_container(login.container_id)
    except docker.errors.NotFound:
        raise Refused(
            f"Suanli: {login.name}: the workspace of node {index} is being made again; "
            "try again shortly."
        ) from None
    except _ENGINE_ERRORS as exc:
        log.warning("%s: the engine of %s did not answer: %s", login.name, login.host.name,
                    engine.describe(exc))  # fmt: skip
        raise Refused(
            f"Suanli: {login.name}: the host of node {index} does not answer; "
            "try again in a minute."
        ) from None
    status = (found.get("State") or {}).get("Status", "unknown")
    if status != "running":
        raise Refused(f"Suanli: {login.name}: the workspace of node {index} is {status}.")


def still_admitted(login: Login) -> str | None:
    """None while a login may open another channel: its cluster runs, its node is live with
    the same workspace, its key is still attached and the account on. Else why not, in
    words for the researcher."""
    name = login.name
    if not key_attached(login.cluster.pk, login.fingerprint, login.key_data):
        return f"Suanli: the key {login.fingerprint} may not log in as {name} any more."
    cluster = Cluster.objects.filter(pk=login.cluster.pk).first()
    if cluster is None:
        return f"Suanli: {name}: there is no such cluster."
    try:
        node = _workspace_node(cluster, login.index, name)
    except Refused as exc:
        return str(exc)
    if node.host_id != login.host.pk or node.workspace_container != login.container_id:
        return (
            f"Suanli: {name}: the workspace of node {login.index} was made again since this "
            "connection logged in; log in again."
        )
    return None


def live_workspaces(cluster_ids: set[int]) -> set[tuple[int, int, int, str]]:
    """(cluster, node index, host, workspace) of the live nodes of those clusters that run
    and whose owner's account is on: what an admitted connection may still reach."""
    return set(
        Node.objects.filter(
            cluster_id__in=cluster_ids, cluster__state=Cluster.State.RUNNING,
            cluster__owner__is_active=True, released_at__isnull=True, lost_at__isnull=True,
        ).values_list("cluster_id", "index", "host_id", "workspace_container")
    )  # fmt: skip


def record_login(login: Login) -> None:
    lifecycle.cluster_event(
        login.cluster,
        "ssh",
        Text(
            gettext_noop("ssh login to node %(index)s with key %(key)s"),
            index=login.index,
            key=login.fingerprint,
        ),
    )


def sftp_mounts(cluster: Cluster) -> list[Mount]:
    """The cluster's volumes, checked now, just before the engine mounts them."""
    return runtime.volume_mounts(cluster, cluster.owner_id)


# -- sessions per researcher, across gateway processes (Redis) -------------------------------


def _sessions_key(owner_id: int) -> str:
    return f"suanli:gateway:sessions:u{owner_id}"


def session_claim(owner_id: int, session_id: str, limit: int) -> bool:
    """Count one more session of the researcher, unless they have `limit` already. Each
    entry expires unless its gateway refreshes it, so a killed process's go on their own.
    While Redis is away logins are let in uncounted (the limit bounds use, it guards
    nothing), and counted once it is back (`sessions_refresh`)."""
    key, now = _sessions_key(owner_id), time.time()
    try:
        with django_rq.get_connection("default").pipeline() as pipe:
            pipe.zremrangebyscore(key, "-inf", now)
            pipe.zadd(key, {session_id: now + SESSION_TTL_S})
            pipe.zcard(key)
            pipe.expire(key, SESSION_TTL_S)
            count = pipe.execute()[2]
            if count > limit:
                pipe.zrem(key, session_id).execute()
                return False
    except REDIS_DOWN as exc:
        _redis.failed(exc)
        return True
    _redis.ok()
    return True


def sessions_refresh(live: dict[str, int]) -> None:
    """Keep the live sessions (id -> researcher) counted for another SESSION_TTL_S."""
    if not live:
        return
    expiry = time.time() + SESSION_TTL_S
    try:
        with django_rq.get_connection("default").pipeline() as pipe:
            for session_id, owner_id in live.items():
                pipe.zadd(_sessions_key(owner_id), {session_id: expiry})
                pipe.expire(_sessions_key(owner_id), SESSION_TTL_S)
            pipe.execute()
    except REDIS_DOWN as exc:
        _redis.failed(exc)
        return
    _redis.ok()


def session_release(owner_id: int, session_id: str) -> None:
    try:
        django_rq.get_connection("default").zrem(_sessions_key(owner_id), session_id)
    except REDIS_DOWN as exc:
        _redis.failed(exc)  # it expires on its own


# -- failed log-ins per address, across gateway processes (django-axes) ----------------------

SSH_PATH = "/ssh/"  # what the admin's Access attempts show as the "path" of an SSH log-in
_LOGIN_CREDENTIALS_MAX = 150  # axes' username column


def axes_request(address: str, client_version: str) -> HttpRequest:
    """An SSH connection as axes reads a web request: the client's address, its version
    string as the user agent (shown in the admin), and SSH_PATH."""
    request = HttpRequest()
    request.META["REMOTE_ADDR"] = address
    request.META["HTTP_USER_AGENT"] = client_version[:255]
    request.path = request.path_info = request.META["PATH_INFO"] = SSH_PATH
    return request


def address_locked(request: HttpRequest) -> bool:
    """Whether the address has AXES_FAILURE_LIMIT failures within the cool-off."""
    return settings.AXES_ENABLED and AxesProxyHandler.is_locked(request, None)


def login_failed(request: HttpRequest, login_name: str) -> bool:
    """Count one failed log-in of the request's address; True when that locked it."""
    credentials = {"username": login_name[:_LOGIN_CREDENTIALS_MAX]}
    user_login_failed.send(sender=__name__, credentials=credentials, request=request)
    return bool(getattr(request, "axes_locked_out", False))


def lockout_words() -> str:
    cool_off = get_cool_off()
    minutes = max(1, -(-int(cool_off.total_seconds()) // 60)) if cool_off else 1
    return (
        "Suanli: too many failed log-ins from your address: SSH log-ins from it are refused "
        f"for now, with any key. Try again in {minutes} minute{'s' if minutes != 1 else ''}, "
        "or ask an operator to unlock your address."
    )


# -- the engine side of a channel (blocking: run on the executor) ----------------------------


def _client(login: Login) -> docker.DockerClient:
    return engine.cached_client(login.host)


def exec_open(login: Login, cmd: list[str], *, tty: bool, env: dict) -> tuple[str, object]:
    """An exec in the workspace as the tenant, started: (its id, the hijacked socket)."""
    api = _client(login).api
    kwargs = {
        **login.exec_base,
        "cmd": cmd,
        "tty": tty,
        "environment": {**login.exec_base["environment"], **env},
    }
    if tty:
        kwargs["detach_keys"] = DETACH_KEYS
    made = api.exec_create(login.container_id, **kwargs)
    return made["Id"], api.exec_start(made["Id"], tty=tty, socket=True)


def exec_exit_code(login: Login, exec_id: str) -> int:
    """The exec's exit status; the engine may take a moment to record it after the
    stream ends."""
    api = _client(login).api
    for _ in range(40):
        found = api.exec_inspect(exec_id)
        if not found.get("Running") and found.get("ExitCode") is not None:
            return int(found["ExitCode"])
        time.sleep(0.05)
    return 255


def exec_hang_up(login: Login, exec_id: str, marker: str) -> None:
    """SIGHUP to what the channel's exec left running (its marker in their environment)."""
    api = _client(login).api
    try:
        if not api.exec_inspect(exec_id).get("Running"):
            return
        made = api.exec_create(
            login.container_id,
            **{**login.exec_base, "cmd": ["/bin/sh", "-c", HANG_UP, "sh", marker], "stdin": False},
        )
        api.exec_start(made["Id"])
    except _ENGINE_ERRORS as exc:
        log.info("%s: exec %s not hung up: %s", login.name, exec_id[:12], exc)


def exec_resize(login: Login, exec_id: str, width: int, height: int) -> None:
    with contextlib.suppress(*_ENGINE_ERRORS):
        _client(login).api.exec_resize(exec_id, height=height, width=width)


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
    except _ENGINE_ERRORS as exc:
        log.info("%s: sftp leftovers on %s not listed: %s", login.name, login.host.name, exc)
        return
    before = time.time() - SFTP_LEFTOVER_S
    for container in found:
        if container.get("Created", before) < before:
            log.info("%s: removing sftp leftover %s on %s", login.name, container["Id"][:12],
                     login.host.name)  # fmt: skip
            with contextlib.suppress(*_ENGINE_ERRORS):
                api.remove_container(container["Id"], force=True, v=True)


def sftp_open(login: Login, mounts: list[Mount]) -> tuple[str, object]:
    """sftp-server in a container of its own on the node's host, confined by the kernel:
    the tenant's uid, the cluster's volumes where the workspace has them and nothing else
    of the host's, no network, no capability, no log (its output is the files the tenant
    downloads), a read-only root whose /etc is a fresh volume holding the tenant's passwd
    line. Removed when it ends (stdin closes with the attach, so a gateway that dies
    leaves none running). Returns (id, hijacked socket)."""
    api = _client(login).api
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
    with contextlib.suppress(*_ENGINE_ERRORS):
        _client(login).api.remove_container(container_id, force=True, v=True)


# -- SSH ------------------------------------------------------------------------------------


def _shown(name: str) -> str:
    """A user name as typed, safe to say back: printable, short."""
    text = "".join(ch if ch.isprintable() else "?" for ch in name[:40])
    return text + ("..." if len(name) > 40 else "")


class Gateway:
    """The listening server: shared state of all connections."""

    def __init__(self):
        self.sessions: dict[str, int] = {}  # session id -> researcher, counted in Redis
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task] = set()  # hang-ups and releases: awaited at exit

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                await asyncio.to_thread(sessions_refresh, dict(self.sessions))
            except Exception:  # the next beat tries again; sessions expire meanwhile
                log.exception("refreshing the session count failed")
            try:
                await self.end_stopped()
            except Refused:
                pass  # the database is away (logged once): the next beat looks again
            except Exception:
                log.exception("checking the connections' clusters failed")

    async def end_stopped(self) -> None:
        """End the connections whose cluster stopped running, whose node went or whose
        workspace was made again (one query for all, then the words for those)."""
        admitted = [c for c in self.connections if c.login is not None and not c.lost]
        if not admitted:
            return
        live = await _in_db(live_workspaces, {c.login.cluster.pk for c in admitted})
        for connection in admitted:
            login = connection.login
            if (login.cluster.pk, login.index, login.host.pk, login.container_id) in live:
                continue
            problem = await _in_db(still_admitted, login)
            if problem is not None:
                connection.end(problem)


class Connection(asyncssh.SSHServer):
    """One client connection: authentication, then its channels."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self.conn: asyncssh.SSHServerConnection | None = None
        self.login: Login | None = None
        self.target: tuple[int, int] | None = None
        self.username = ""
        self.key: asyncssh.SSHKey | None = None
        self.tried: set[bytes] = set()
        self.attempts = 0
        self.cut = False  # too many keys tried: disconnecting
        self.asked = False  # the client asked to log in (counts as a failure unless it did)
        self.proved = False  # it signed with a key attached to the cluster it named
        self.locked = False  # refused for its address's failures: counts nothing more
        self.axes: HttpRequest | None = None
        self.told: set[str] = set()
        self.refusal: str | None = None
        self.session_id = secrets.token_hex(8)
        self.channels: set[Channel] = set()
        self.open_channels = 0  # open or being opened: at most max_channels()
        self.sftp_live = 0  # sftp containers of this connection
        self.sftp_claims: list[str] = []  # their sessions beyond the connection's own
        self.socket_full = False
        self.lost = False
        self.active = 0.0
        self._idle: asyncio.TimerHandle | None = None

    def spawn(self, coro) -> asyncio.Task:
        return self.gateway.spawn(coro)

    def touch(self) -> None:
        self.active = time.monotonic()

    # authentication

    def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
        self.conn = conn
        self.gateway.connections.add(self)
        # The connection checks a key for asyncssh (validate_public_key below) both when
        # the client asks whether a key would do and when it signs with it; only the
        # second proves the client holds the private half. The first gets the same yes
        # for every key; the key is looked up only once the signature checked out.
        checked = conn.validate_public_key

        async def validate(username: str, key_data: bytes, msg: bytes, signature: bytes) -> bool:
            if not self._may_try(key_data):
                return False
            if not await checked(username, key_data, msg, signature):
                return False
            if not msg:
                return True
            key = self.key
            if key is None or key.public_data != key_data:
                return False
            return await self._admit(key)

        conn.validate_public_key = validate
        self._ack_at_once(conn)
        self._follow_socket(conn)

    @staticmethod
    def _ack_at_once(conn: asyncssh.SSHServerConnection) -> None:
        """ACK what arrives at once rather than after Linux's delayed-ACK timer. OpenSSH's
        client leaves Nagle on until a session starts, so it holds each small message while
        its last one is unacknowledged, and the key exchange and the request for
        authentication each waited some 40 ms on our delayed ACK (90 of a login's 120 ms)."""
        sock = conn.get_extra_info("socket")
        if sock is None or not hasattr(socket, "TCP_QUICKACK"):
            return
        received = conn.data_received

        def data_received(*args, **kwargs):
            received(*args, **kwargs)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

        conn.data_received = data_received

    def _follow_socket(self, conn: asyncssh.SSHServerConnection) -> None:
        """Hold every channel's engine reads while the socket's buffer is full. asyncssh
        does nothing then (SSHConnection.pause_writing), and a channel's window is the
        client's to pick: a client that stops reading while it advertises a huge window
        would otherwise have the gateway hold all the output of its commands."""
        paused, resumed = conn.pause_writing, conn.resume_writing

        def pause_writing() -> None:
            paused()
            self.socket_full = True
            for channel in list(self.channels):
                channel.stream.hold("socket", True)

        def resume_writing() -> None:
            resumed()
            self.socket_full = False
            for channel in list(self.channels):
                channel.stream.hold("socket", False)

        conn.pause_writing = pause_writing
        conn.resume_writing = resume_writing

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.gateway.connections.discard(self)
        if self.asked and self.login is None and not (self.proved or self.locked):
            self.spawn(self._count_failure())
        if self._idle is not None:
            self._idle.cancel()
        for channel in list(self.channels):
            channel.hang_up()
        self._release()

    def _release(self) -> None:
        for session_id in [self.session_id, *self.sftp_claims]:
            owner_id = self.gateway.sessions.pop(session_id, None)
            if owner_id is not None:
                self.spawn(asyncio.to_thread(session_release, owner_id, session_id))
        self.sftp_claims.clear()

    def _banner(self, text: str) -> None:
        if text in self.told:
            return
        self.told.add(text)
        log.info("%s: refused: %s", _shown(self.username), text)
        with contextlib.suppress(OSError):
            self.conn.send_auth_banner(text.rstrip("\n") + "\n")

    def end(self, text: str) -> None:
        """End the connection, saying why on every channel and in the disconnect."""
        if self.lost:
            return
        log.info("%s: ended: %s", self.login.name if self.login else "?", text)
        for channel in list(self.channels):
            channel.say(text)
        self.conn.disconnect(asyncssh.DISC_BY_APPLICATION, text)

    async def begin_auth(self, username: str) -> bool:
        self.username = username
        self.asked = True
        self.axes = axes_request(self._peer(), self.conn.get_extra_info("client_version") or "")
        try:
            locked = await _in_db(address_locked, self.axes)
        except Refused as exc:  # the database is away: nothing logs in, nothing is counted
            self.asked = False
            self.refusal = str(exc)
            self._banner(self.refusal)
            return True
        if locked:
            self.locked = True
            self.refusal = lockout_words()
            log.warning("%s: refused, its address is locked out", self._peer())
            self._banner(self.refusal)
            # Once the banner has gone out: no key is looked at, the right one neither.
            asyncio.get_running_loop().call_soon(
                self.conn.disconnect,
                asyncssh.DISC_NO_MORE_AUTH_METHODS_AVAILABLE,
                "too many failed log-ins from your address: closed by the gateway",
            )
            return True
        self.target = workspaces.parse_login(username)
        if self.target is None:
            self._banner(
                f"Suanli: '{_shown(username)}' is not a login here. Log in as c<cluster>-<node>, "
                f"e.g. ssh -p {ssh_port()} c42-0@<host>: each running cluster's page shows "
                "the command for each of its nodes."
            )
        return True

    def public_key_auth_supported(self) -> bool:
        return True

    def _peer(self) -> str:
        """The client's address as log-in failures are counted (an IPv4 client of a
        dual-stack socket as IPv4, an IPv6 one by its /64: addresses.guesser)."""
        return addresses.guesser((self.conn.get_extra_info("peername") or ("",))[0])

    async def _count_failure(self) -> None:
        """A connection that asked to log in and ended without: one failure of its address."""
        try:
            locked = await _in_db(login_failed, self.axes, self.username)
        except Refused:
            return  # the database is away (logged once): nothing logged in meanwhile either
        except Exception:
            log.exception("%s: counting a failed log-in failed", self._peer())
            return
        if locked:
            log.warning(
                "%s: locked out after %s failed log-ins (SSH and web together) within %s",
                self._peer(), settings.AXES_FAILURE_LIMIT, get_cool_off(),
            )  # fmt: skip

    def _may_try(self, key_data: bytes) -> bool:
        """At most AUTH_KEYS keys (a query and a signature each) per connection; the next
        ends it, in words."""
        self.attempts += 1
        self.tried.add(key_data)
        if len(self.tried) <= AUTH_KEYS and self.attempts <= 2 * AUTH_KEYS:
            return True
        if not (self.lost or self.cut):
            self.cut = True
            self._banner(
                f"Suanli: {AUTH_KEYS} keys tried, the most one connection may try. Name the "
                "key attached to the cluster: ssh -i <key> -o IdentitiesOnly=yes ..."
            )
            # Once this attempt's failure has gone out.
            asyncio.get_running_loop().call_soon(
                self.conn.disconnect,
                asyncssh.DISC_NO_MORE_AUTH_METHODS_AVAILABLE,
                f"{AUTH_KEYS} keys tried: closed by the gateway",
            )
        return False

    def validate_public_key(self, username: str, key: asyncssh.SSHKey) -> bool:
        """Any key would do for a well-formed login name: nothing is looked up before the
        client proved it holds the key (Connection.connection_made's `validate`)."""
        self.key = key
        return self.target is not None

    async def _admit(self, key: asyncssh.SSHKey) -> bool:
        """The client signed with `key`: admit it if the key is attached, or say why not."""
        if self.login is not None:
            return True
        if self.refusal is not None:
            return False
        cluster_id, index = self.target
        fingerprint = key.get_fingerprint("sha256")
        name = workspaces.login_name(cluster_id, index)
        try:
            attached = await _in_db(key_attached, cluster_id, fingerprint, key.public_data)
        except Refused as exc:
            self._banner(str(exc))
            return False
        except Exception:
            log.exception("%s: checking key %s failed", _shown(self.username), fingerprint)
            self._banner("Suanli: the gateway could not check your key; try again in a minute.")
            return False
        self.proved = bool(attached)
        if not attached:
            self._banner(
                f"Suanli: the key {fingerprint} may not log in as {_shown(self.username)}. Add "
                "it on the SSH keys page of the console and pick it when you request the "
                "cluster; the cluster's page also has a Terminal for each node."
            )
            return False
        try:
            login = await _in_db(admit, name, cluster_id, index, fingerprint, key.public_data)
            await asyncio.get_running_loop().run_in_executor(None, workspace_up, login)
            owner_id = login.cluster.owner_id
            limit = settings.SUANLI_SSH_MAX_SESSIONS
            claimed = await asyncio.to_thread(session_claim, owner_id, self.session_id, limit)
            if not claimed:
                raise Refused(
                    f"Suanli: you have {limit} SSH sessions open, the most one researcher may "
                    "have at a time. End one (exit, or close its window) and log in again."
                )
            self.gateway.sessions[self.session_id] = owner_id
            if self.lost:  # gone while we looked
                self._release()
                return False
            await _in_db(record_login, login)
        except Refused as exc:
            self._release()
            self.refusal = str(exc)
            self._banner(self.refusal)
            return False
        except Exception:
            log.exception("%s: admitting a login failed", name)
            self._release()
            self.refusal = "Suanli: the gateway could not log you in; try again in a minute."
            self._banner(self.refusal)
            return False
        self.login = login
        log.info("%s: login with %s from %s", login.name, fingerprint,
                 self.conn.get_extra_info("peername"))  # fmt: skip
        return True

    def auth_completed(self) -> None:
        self.touch()
        self._watch_idle()

    def _watch_idle(self) -> None:
        limit = settings.SUANLI_SSH_IDLE_S
        idle = time.monotonic() - self.active
        if idle >= limit:
            log.info("%s: idle for %.0f s, closed", self.login.name if self.login else "?", idle)
            for channel in list(self.channels):
                channel.say(f"Suanli: idle for {limit} s (no input, no output): the session ends.")
            self.conn.disconnect(
                asyncssh.DISC_BY_APPLICATION, f"idle for {limit} s: closed by the gateway"
            )
            return
        self._idle = asyncio.get_running_loop().call_later(
            min(limit - idle, max(limit / 4, 1), 60) + 0.05, self._watch_idle
        )

    # channels

    def session_requested(self):
        self._count_channel()
        return self._open(WorkspaceSession(self))

    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str, orig_port: int):
        if dest_host not in LOCALHOST or not 0 < dest_port < 65536:
            raise asyncssh.ChannelOpenError(
                asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED,
                "Suanli forwards only to localhost of the workspace, e.g. -L 6006:localhost:6006",
            )
        self._count_channel()
        return self._open(PortRelay(self, dest_port))

    def server_requested(self, listen_host: str, listen_port: int) -> bool:
        return False  # no remote forwarding: nothing listens on the gateway for a tenant

    def _count_channel(self) -> None:
        limit = max_channels()
        if self.open_channels >= limit:
            raise asyncssh.ChannelOpenError(
                asyncssh.OPEN_RESOURCE_SHORTAGE,
                f"Suanli: this connection has {limit} channels open (shells, commands, sftp, "
                "forwards), the most one connection may have; close one first",
            )
        self.open_channels += 1

    def channel_closed(self) -> None:
        self.open_channels -= 1

    async def _open(self, channel: Channel) -> Channel:
        """The channel, once the login still holds (still_admitted); else the open is
        refused in words and, when the cluster or workspace is what changed, the
        connection ends."""
        try:
            problem = await _in_db(still_admitted, self.login)
        except Refused as exc:  # the database is away: this channel only
            self.channel_closed()
            raise asyncssh.ChannelOpenError(asyncssh.OPEN_CONNECT_FAILED, str(exc)) from None
        except Exception:
            log.exception("%s: checking a channel's login failed", self.login.name)
            self.channel_closed()
            raise asyncssh.ChannelOpenError(
                asyncssh.OPEN_CONNECT_FAILED,
                "Suanli: the gateway could not check this login; try again in a minute.",
            ) from None
        if problem is not None or self.lost:
            self.channel_closed()
            if problem is not None:
                # After the refusal has gone out (it goes once this task step ends).
                asyncio.get_running_loop().call_soon(self.end, problem)
            raise asyncssh.ChannelOpenError(
                asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED, problem or "the connection closed"
            )
        channel.counted = True
        return channel

    async def sftp_claim(self) -> bool:
        """Count one more sftp container of this connection: the first goes under the
        connection's own session, each more is a session of its own. False when the
        researcher has no session left."""
        self.sftp_live += 1
        if self.sftp_live <= 1:
            return True
        owner_id = self.login.cluster.owner_id
        claim = f"{self.session_id}.sftp.{secrets.token_hex(4)}"
        limit = settings.SUANLI_SSH_MAX_SESSIONS
        if not await asyncio.to_thread(session_claim, owner_id, claim, limit):
            self.sftp_live -= 1
            return False
        self.gateway.sessions[claim] = owner_id
        self.sftp_claims.append(claim)
        if self.lost:
            self._release()
        return True

    def sftp_done(self) -> None:
        self.sftp_live -= 1
        if len(self.sftp_claims) > max(self.sftp_live - 1, 0):
            claim = self.sftp_claims.pop()
            owner_id = self.gateway.sessions.pop(claim, None)
            if owner_id is not None:
                self.spawn(asyncio.to_thread(session_release, owner_id, claim))


class Channel:
    """What a shell, an exec, an sftp session and a relay share: an engine stream between
    the SSH channel and the engine, activity for the idle check, and the hang-up."""

    def __init__(self, connection: Connection):
        self.connection = connection
        self.login = connection.login
        self.chan = None
        self.marker = f"{MARKER}={secrets.token_hex(12)}"
        self.exec_id = ""
        self.container_id = ""
        self.closed = False
        self.counted = False  # among the connection's open channels
        self.sftp_counted = False  # among its sftp containers
        self.stream: EngineStream | None = None

    def connection_made(self, chan) -> None:
        self.chan = chan
        self.connection.channels.add(self)
        self.stream = EngineStream(
            asyncio.get_running_loop(), on_output=self._output, on_end=self._on_end,
            on_backlog=self._backlog, multiplexed=True,
        )  # fmt: skip
        if self.connection.socket_full:
            self.stream.hold("socket", True)

    def _output(self, data: bytes, stderr: bool) -> None:
        if self.closed:
            return
        self.connection.touch()
        if stderr:
            self.chan.write_stderr(data)
        else:
            self.chan.write(data)

    def _backlog(self, full: bool) -> None:
        if self.closed:
            return
        if full:
            self.chan.pause_reading()
        else:
            self.chan.resume_reading()

    def data_received(self, data: bytes, datatype) -> None:
        self.connection.touch()
        self.stream.write(data)

    def eof_received(self) -> bool:
        self.stream.write_eof()
        return True  # the output may go on

    def pause_writing(self) -> None:
        self.stream.hold("window", True)

    def resume_writing(self) -> None:
        self.stream.hold("window", False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.hang_up()
        if self.counted:
            self.counted = False
            self.connection.channel_closed()
        if self.sftp_counted:
            self.sftp_counted = False
            self.connection.sftp_done()

    def say(self, text: str) -> None:
        if not self.closed:
            with contextlib.suppress(OSError):
                self.chan.write_stderr(f"\r\n{text}\r\n".encode())

    def hang_up(self) -> None:
        """The channel went first: drop the stream, end what it started."""
        if self.closed:
            return
        self.closed = True
        self.connection.channels.discard(self)
        ended = self.stream.ended
        self.stream.close()
        if not ended:
            self._end_what_runs()

    def _end_what_runs(self) -> None:
        if self.exec_id:
            self.connection.spawn(
                asyncio.to_thread(exec_hang_up, self.login, self.exec_id, self.marker)
            )
        if self.container_id:
            self.connection.spawn(asyncio.to_thread(sftp_remove, self.login, self.container_id))

    def _started(self, hijacked) -> bool:
        """Bridge the engine's socket; False when the client left while it started."""
        self.stream.start(hijacked)
        if self.closed:
            self.stream.close()
            self._end_what_runs()
            return False
        return True

    def _on_end(self) -> None:
        if not self.closed:
            self.connection.spawn(self._finish())

    async def _finish(self) -> None:
        raise NotImplementedError

    def fail(self, text: str) -> None:
        raise NotImplementedError


def _term_size(width: int, height: int) -> tuple[int, int]:
    """A terminal's size as the client asks it, within 1..TERM_MAX (0: the usual 80x24)."""
    return min(max(width or 80, 1), TERM_MAX), min(max(height or 24, 1), TERM_MAX)


def _env_taken(name: str, value: str) -> bool:
    """LANG and LC_*, with a short value: all of the client's environment an exec gets."""
    if not (name == "LANG" or (name.startswith("LC_") and name[3:].replace("_", "").isalnum())):
        return False
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        return False
    return name.isascii() and len(name) <= 64 and size <= ENV_VALUE and "\0" not in value


class WorkspaceSession(Channel, asyncssh.SSHServerSession):
    """A session channel: a shell, a command, or the sftp subsystem."""

    def __init__(self, connection: Connection):
        super().__init__(connection)
        self.term = ""
        self.size = (80, 24)
        self.resizing = False
        self.kind = ""
        self.command = ""
        self.env: dict[str, str] = {}

    def connection_made(self, chan) -> None:
        super().connection_made(chan)
        # asyncssh keeps every name a client sends (channel._process_env_request): take
        # them here instead, bounded, and keep none of the rest.
        chan._process_env_request = self._env_request

    def _env_request(self, packet) -> bool:
        name, value = packet.get_string(), packet.get_string()
        packet.check_end()
        try:
            name, value = name.decode(), value.decode()
        except UnicodeDecodeError:
            return False
        if not _env_taken(name, value):
            return False
        if name not in self.env and len(self.env) >= ENV_NAMES:
            return False
        self.env[name] = value
        return True

    def pty_requested(self, term_type, term_size, term_modes) -> bool:
        term = term_type or "xterm"
        self.term = term if term.isascii() and term.isprintable() and len(term) <= 64 else "xterm"
        self.size = _term_size(term_size[0], term_size[1])
        return True

    def shell_requested(self) -> bool:
        self.kind = "shell"
        return True

    def exec_requested(self, command: str) -> bool:
        self.kind, self.command = "exec", command
        return True

    def subsystem_requested(self, subsystem: str) -> bool:
        if subsystem != "sftp":
            return False
        self.kind = "sftp"
        self.term = ""  # sftp-server speaks its protocol, never to a terminal
        return True

    def session_started(self) -> None:
        self.stream.multiplexed = not self.term  # a TTY's output comes as one stream
        self.connection.spawn(self._start())

    def terminal_size_changed(self, width, height, pixwidth, pixheight) -> None:
        self.size = _term_size(width, height)
        if self.term and self.exec_id and not self.closed and not self.resizing:
            self.connection.spawn(self._resize())

    async def _resize(self) -> None:
        """Follow the client's size: one resize at a time, then the latest asked meanwhile."""
        self.resizing = True
        sent = None
        try:
            while self.size != sent and not self.closed:
                sent = self.size
                await asyncio.to_thread(exec_resize, self.login, self.exec_id, *sent)
        finally:
            self.resizing = False

    def eof_received(self) -> bool:
        # Through a TTY the engine takes the end of input for the end of the session and
        # drops the output still to come; a terminal ends when its shell exits, as sshd's.
        if not self.term:
            self.stream.write_eof()
        return True

    def break_received(self, msec: int) -> bool:
        return False

    def signal_received(self, signal: str) -> None:
        pass  # the engine has no way to signal an exec

    def _environment(self) -> dict:
        env = {MARKER: self.marker.partition("=")[2]}
        if self.term:
            env["TERM"] = self.term
        passed = {**(self.chan.get_environment() or {}), **self.env}
        taken = [(name, value) for name, value in passed.items() if _env_taken(name, value)]
        env.update(taken[:ENV_NAMES])
        return env

    async def _start(self) -> None:
        limit = settings.SUANLI_SSH_MAX_SESSIONS
        try:
            if self.kind == "sftp":
                if not await self.connection.sftp_claim():
                    self.fail(
                        f"you have {limit} SSH sessions open, the most one researcher may have "
                        "at a time (an sftp session beyond the first of a connection counts "
                        "as one); end one and try again"
                    )
                    return
                self.sftp_counted = True
                if self.closed:  # the client left meanwhile
                    return
                mounts = await _in_db(sftp_mounts, self.login.cluster)
                self.container_id, hijacked = await asyncio.to_thread(sftp_open, self.login, mounts)
            else:
                cmd = LOGIN_SHELL if self.kind == "shell" else ["/bin/sh", "-c", self.command]
                self.exec_id, hijacked = await asyncio.to_thread(
                    exec_open, self.login, cmd, tty=bool(self.term), env=self._environment()
                )
        except Refused as exc:
            self.fail(str(exc))
            return
        except runtime.SpecError as exc:
            self.fail(f"your volumes cannot be mounted: {exc}")
            return
        except _ENGINE_ERRORS as exc:
            log.warning("%s: the engine of %s: %s", self.login.name, self.login.host.name,
                        engine.describe(exc))  # fmt: skip
            self.fail(f"the workspace of node {self.login.index} did not answer; "
                      "try again in a minute")  # fmt: skip
            return
        if self._started(hijacked) and self.term:
            await self._resize()

    def fail(self, text: str) -> None:
        log.info("%s: %s not started: %s", self.login.name, self.kind, text)
        if not self.closed:
            self.say(f"Suanli: {text}.")
            self.closed = True
            self.connection.channels.discard(self)
            self.chan.exit(1)

    async def _finish(self) -> None:
        status = 0
        if self.exec_id:
            try:
                status = await asyncio.to_thread(exec_exit_code, self.login, self.exec_id)
            except _ENGINE_ERRORS:
                status = 255
        if not self.closed:
            self.closed = True
            self.connection.channels.discard(self)
            self.chan.exit(status)


class PortRelay(Channel, asyncssh.SSHTCPSession):
    """A forwarded connection (`ssh -L`): a relay exec inside the workspace to its loopback."""

    def __init__(self, connection: Connection, port: int):
        super().__init__(connection)
        self.port = port
        self.errors = b""

    def _output(self, data: bytes, stderr: bool) -> None:
        if stderr:
            self.errors = (self.errors + data)[-500:]
        else:
            super()._output(data, False)

    def session_started(self) -> None:
        self.connection.spawn(self._start())

    async def _start(self) -> None:
        cmd = ["/bin/sh", "-c", RELAY, "relay", str(self.port), RELAY_PY]
        env = {MARKER: self.marker.partition("=")[2]}
        try:
            self.exec_id, hijacked = await asyncio.to_thread(
                exec_open, self.login, cmd, tty=False, env=env
            )
        except _ENGINE_ERRORS as exc:
            self.fail(engine.describe(exc))
            return
        self._started(hijacked)

    def fail(self, text: str) -> None:
        log.info("%s: forward to port %s: %s", self.login.name, self.port, text)
        if not self.closed:
            self.closed = True
            self.connection.channels.discard(self)
            self.chan.close()

    async def _finish(self) -> None:
        if self.errors:
            # The tenant's words: quoted, never a line of the log of their own.
            log.info("%s: forward to port %s: %r", self.login.name, self.port,
                     self.errors[-200:])  # fmt: skip
        if not self.closed:
            self.closed = True
            self.connection.channels.discard(self)
            self.chan.close()


# -- the process ----------------------------------------------------------------------------


def _check_asyncssh() -> None:
    """Make sure the parts of asyncssh this wraps are the ones it was written against,
    rather than let an upgrade silently skip them: the connection's own key check
    (Connection.connection_made: the proof of the private half), its socket's flow control
    (_follow_socket) and a channel's handler of environment requests (WorkspaceSession)."""
    params = list(inspect.signature(asyncssh.SSHServerConnection.validate_public_key).parameters)
    if params != ["self", "username", "key_data", "msg", "signature"]:
        raise RuntimeError(f"asyncssh {asyncssh.__version__}: unexpected key check {params}")
    for cls, name in (
        (asyncssh.SSHServerConnection, "pause_writing"),
        (asyncssh.SSHServerConnection, "resume_writing"),
        (asyncssh.SSHServerChannel, "_process_env_request"),
    ):
        if not callable(getattr(cls, name, None)):
            raise RuntimeError(f"asyncssh {asyncssh.__version__}: no {cls.__name__}.{name}")


async def serve(*, ready: Callable[[str], None] = print) -> None:
    """Listen until SIGTERM or SIGINT, then close every connection (their channels hang
    up what they started) and return."""
    _check_asyncssh()
    logging.getLogger("asyncssh").setLevel(logging.WARNING)
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=64, thread_name_prefix="gateway"))
    gateway = Gateway()
    key = _host_key()  # made here when there is none yet: the only process that makes it
    server = await asyncssh.listen(
        settings.SUANLI_SSH_BIND, ssh_port(),
        server_factory=functools.partial(Connection, gateway),
        server_host_keys=[key],
        server_version="Suanli",
        encoding=None,
        line_editor=False,
        allow_pty=True,
        agent_forwarding=False,
        x11_forwarding=False,
        allow_scp=False,
        password_auth=False,
        kbdint_auth=False,
        host_based_auth=False,
        gss_auth=False,
        login_timeout=30,
        keepalive_interval=60,
        keepalive_count_max=3,
        reuse_address=True,
    )  # fmt: skip
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    heartbeat = loop.create_task(gateway.heartbeat())
    ready(
        f"gateway: listening on {settings.SUANLI_SSH_BIND}:{ssh_port()} "
        f"(host key {key.get_fingerprint('sha256')})"
    )
    await stop.wait()
    heartbeat.cancel()
    server.close()
    for connection in list(gateway.connections):
        connection.conn.disconnect(asyncssh.DISC_BY_APPLICATION, "the gateway is restarting")
    await asyncio.sleep(0.2)  # connection_lost runs: hang-ups and releases are spawned
    if gateway.tasks:
        await asyncio.wait(set(gateway.tasks), timeout=10)


def run() -> None:
    asyncio.run(serve(ready=lambda line: print(line, flush=True)))

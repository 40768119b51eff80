"""The SSH gateway (Procfile `gateway`, `manage.py suanli_gateway`): `ssh`, `scp`/`sftp` and
`ssh -L` into the workspaces of a researcher's running clusters (jobs/nodes/workspaces.py).
This module is the asyncssh server: authentication, channels and the process. Only the
gateway process imports it (and asyncssh); what the web process shares with it lives in
jobs/access/sessions.py (logins, session counts), streams.py (an exec's stream) and
hostkey.py (the host key's fingerprint).

`ssh -p 2222 c42-0@console` logs in to node 0 of cluster 42 with a key attached to that
cluster by its owner, or on a team's cluster with a member's own key attached to it while
their role may use it (admission.key_attached); nothing else logs in (no password, no
other method). A member removed from the team (or who left) is ended at once: the
gateway follows the Redis channel of revoked memberships (jobs.tenancy.revocations) on a
thread of its own and ends that person's connections to the team's clusters, and the
heartbeat checks every connection's membership too (so a message lost while Redis was
away ends them within HEARTBEAT_S). What a login
gets, every part through the node's engine, so remote engines and any image work alike:
- a shell (with a PTY, window changes followed) or `ssh host cmd` with its exit status:
  an exec in the workspace as the tenant's uid (workspaces.exec_kwargs, streams.exec_open);
- sftp, and so OpenSSH's `scp`: per session a short-lived container on the node's host,
  confined by the kernel (jobs/access/sftp.py);
- `rsync` and `scp -O` (their server side, as their clients send it: sftp.transfer_command):
  the image's own in the workspace when it has one, else ours in such a container (each
  beyond a connection's first counts as a session); a write outside the places they may
  write is refused in words that name those places, in the researcher's language;
- local forwarding to localhost of the workspace: an exec of a relay (nc, else python3,
  else bash's /dev/tcp) inside it. No remote forwarding, agent or X11 forwarding.

Refusals come in words, as an authentication banner, before the client gives up. The
client's unsigned "would this key do?" query gets the same yes for every well-formed login
name and every key, so it tells nothing (not even by its timing): the key is looked up
only once the client signed with it. A key that is not attached to the named cluster
(another researcher's key, an unknown key, a cluster that does not exist, an account that
is off) then gets the same words, which name nothing but what the client typed, in the
language of the key's holder where the console knows it (jobs/access/admission.py). What is
told only to the holder of an attached key's private half: the cluster is not running,
the node does not exist, the workspace is not up, the researcher has
`SUANLI_SSH_MAX_SESSIONS` sessions open already (sessions.session_claim). A connection may
try AUTH_KEYS keys; the next one ends it, in words.

Guessing is throttled like the web log-in (django-axes, jobs/access/admission.py): a
connection from an address that asked to log in and ended without logging in counts as
one failed log-in of that address (one, however many keys its client offered: an agent
with five keys before the right one logs in and counts nothing; a holder of an attached
key who is told the cluster is not running counts nothing either). At AXES_FAILURE_LIMIT
failures within the cool-off (AXES_COOLOFF_TIME) the address is locked: each new
connection from it is told so in words and ended before any key is looked at, the right
key too, until the cool-off has passed since its last failure or an operator deletes its
access attempt in the admin. A refused connection counts nothing (the lock does not grow).

What a connection may spend: a session is a connection, and each sftp container beyond a
connection's first (so a researcher's containers never outnumber their sessions); a
connection (OpenSSH's ControlMaster) may have `SUANLI_SSH_MAX_CHANNELS` channels (shells,
commands, sftp, -L relays) open at once, and the next channel open is refused in words.
Every channel open checks again that the cluster still runs, the node is still live with
the same workspace, the key is still attached and the account is on; when that no longer
holds the channel is refused and the connection ends, and the heartbeat ends the
connections of clusters that stopped running meanwhile, and those whose key was detached. What a client asks of a channel
is bounded too: window sizes (1..1000, one resize in flight, the latest wins) and its
environment (LANG and LC_* only, at most ENV_NAMES names of at most ENV_VALUE bytes).

Every login goes on the cluster's timeline with its key's fingerprint. A connection with
no data either way for `SUANLI_SSH_IDLE_S` is closed. When a channel closes first, what
its exec started is hung up (streams.exec_hang_up); what a killed gateway's channels left
is hung up by the next gateway (leftovers.py: at its start and every heartbeat). Output is read from the engine only as
fast as the client takes it: a channel's window, and the connection's socket (a client
that stops reading while it advertises a huge window stops every engine read of its
connection, rather than have the gateway hold it).

Threads: each channel's engine socket has two threads of its own (streams.EngineStream).
Database reads run on a small pool of their own threads (admission.in_db), engine and
Redis calls on the loop's executor: the event loop itself never waits on anything. Engine
errors are logged in the engine's words; a researcher is told what failed, without the
engine's addresses. The process lives through Redis and PostgreSQL restarts: a login
meanwhile is refused in words (the database) or not counted (Redis), and the outage is
logged once (jobs.base.outage).

The host key (`SUANLI_SSH_HOST_KEY`, and its .pub beside it) is made here when the gateway
starts (host_key); every other process (the console's pages) only reads it (hostkey.py).

Layer: access, the top of it; uses admission, sessions, streams, sftp, hostkey and, below,
workspaces, engine and models.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import asyncssh
import django_rq
from axes.helpers import get_cool_off
from django.conf import settings
from django.http import HttpRequest
from django.utils import translation

from jobs.access import admission, hostkey, leftovers, sessions, sftp, streams
from jobs.base import addresses, metrics
from jobs.base.outage import REDIS_DOWN, Outage
from jobs.nodes import engine, runtime, workspaces
from jobs.tenancy import revocations

log = logging.getLogger("suanli.gateway")

LOCALHOST = ("localhost", "127.0.0.1")
AUTH_KEYS = 6  # keys one connection may try (OpenSSH's MaxAuthTries)
TERM_MAX = 1000  # columns and rows of a terminal
ENV_NAMES = 8  # environment a client may pass (LANG, LC_*): names, and bytes of a value
ENV_VALUE = 256


def max_channels() -> int:
    """`SUANLI_SSH_MAX_CHANNELS` (10): channels one connection may have open at once."""
    return max(1, int(settings.SUANLI_SSH_MAX_CHANNELS))


# -- the host key: made here, read by everyone (hostkey.py) ---------------------------------

_keys: dict[tuple, asyncssh.SSHKey] = {}


def host_key() -> asyncssh.SSHKey:
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
    hostkey.write_public(path, key.export_public_key())
    return key


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


# -- SSH ------------------------------------------------------------------------------------


def _shown(name: str) -> str:
    """A user name as typed, safe to say back: printable, short."""
    text = "".join(ch if ch.isprintable() else "?" for ch in name[:40])
    return text + ("..." if len(name) > 40 else "")


class Gateway:
    """The listening server: shared state of all connections."""

    def __init__(self, slot: str = ""):
        self.sessions: dict[str, int] = {}  # session id -> researcher, counted in Redis
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task] = set()  # hang-ups and releases: awaited at exit
        # This process among the gateways (jobs/access/leftovers.py): its id marks its
        # execs; its slot (machine, address, port) is where a successor will listen.
        self.instance = secrets.token_hex(6)
        self.slot = slot
        self.watched: dict[str, tuple] = {}  # other gateways' beats, for the sweep
        self.loop: asyncio.AbstractEventLoop | None = None  # serve's: revocations come to it

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def heartbeat(self) -> None:
        while True:
            metrics.alive("gateway")
            await asyncio.sleep(sessions.HEARTBEAT_S)
            try:
                await asyncio.to_thread(sessions.sessions_refresh, dict(self.sessions))
            except Exception:  # the next beat tries again; sessions expire meanwhile
                log.exception("refreshing the session count failed")
            try:
                await self.end_stopped()
            except sessions.Refused:
                pass  # the database is away (logged once): the next beat looks again
            except Exception:
                log.exception("checking the connections' clusters failed")
            await self.keep_up()

    def revoked(self, person_id: int, principal_id: int) -> None:
        """A membership was revoked (jobs.tenancy.revocations): end at once every connection
        of that person to a cluster the team owns, in words. Their channels hang up what
        they started (the shells, commands and relays of the execs, the sftp containers),
        as when any connection drops."""
        ended = [
            c for c in self.connections
            if c.login is not None and not c.lost and c.login.person_id == person_id
            and c.login.cluster.owner_id == principal_id
        ]  # fmt: skip
        if ended:
            self.spawn(self._end_revoked(ended))

    async def _end_revoked(self, ended: list[Connection]) -> None:
        try:
            language = await admission.in_db(admission.language_of, ended[0].login.person_id)
        except sessions.Refused:
            language = settings.LANGUAGE_CODE  # the database is away: end them all the same
        for connection in ended:
            with translation.override(language):
                connection.end(admission.revoked_words(connection.login))

    def listen_revocations(self, stop: threading.Event) -> None:
        """Follow the Redis channel of revoked memberships (jobs.tenancy.revocations), on a
        thread of its own, until `stop`: each message ends that person's connections to
        the team's clusters on the loop (revoked). Through a Redis restart it subscribes
        again with back-off, the outage logged once; what was announced meanwhile is ended
        by the heartbeat's check of every connection's membership."""
        loop = self.loop
        down = Outage("Redis (gateway revocations)", log)
        while not stop.is_set():
            try:
                queues = django_rq.get_connection("default")
                pubsub = queues.pubsub(ignore_subscribe_messages=True)
                with contextlib.closing(pubsub):
                    pubsub.subscribe(revocations.channel(queues))
                    down.ok()
                    while not stop.is_set():
                        message = pubsub.get_message(timeout=1.0)
                        body = _revocation(message)
                        if body is not None:
                            try:
                                loop.call_soon_threadsafe(self.revoked, *body)
                            except RuntimeError:  # the loop closed: the gateway is ending
                                return
            except REDIS_DOWN as exc:
                stop.wait(down.failed(exc))
            except Exception:
                log.exception("following revoked memberships failed; again in 10 s")
                stop.wait(10)

    async def keep_up(self) -> None:
        """Say this gateway is alive (with the workspaces its logins reach), and hang up
        what dead gateways left in theirs (jobs/access/leftovers.py)."""
        logins = [c.login for c in self.connections if c.login is not None and not c.lost]
        try:
            if await asyncio.to_thread(leftovers.beat, self.instance, self.slot, logins):
                await admission.in_db(leftovers.sweep, self.instance, self.slot, self.watched)
        except sessions.Refused:
            pass  # the database is away (logged once): the next beat sweeps
        except Exception:
            log.exception("sweeping what dead gateways left failed")

    async def end_stopped(self) -> None:
        """End the connections whose cluster stopped running, whose node went, whose
        workspace was made again or whose key was detached (two queries for all, then the
        words for those)."""
        admitted = [c for c in self.connections if c.login is not None and not c.lost]
        if not admitted:
            return
        ids = {c.login.cluster.pk for c in admitted}
        live = await admission.in_db(admission.live_workspaces, ids)
        attached = await admission.in_db(admission.attached_keys, ids)  # detached: ended
        for connection in admitted:
            login = connection.login
            where = (login.cluster.pk, login.index, login.host.pk, login.container_id)
            if where in live and (login.cluster.pk, login.fingerprint, login.person_id) in attached:
                continue
            problem = await admission.in_db(admission.still_admitted, login)
            if problem is not None:
                connection.end(problem)


class Connection(asyncssh.SSHServer):
    """One client connection: authentication, then its channels."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self.conn: asyncssh.SSHServerConnection | None = None
        self.login: sessions.Login | None = None
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
            metrics.GATEWAY_AUTH_FAILURES.inc()
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
                self.spawn(asyncio.to_thread(sessions.session_release, owner_id, session_id))
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
        self.axes = admission.axes_request(
            self._peer(), self.conn.get_extra_info("client_version") or ""
        )
        try:
            locked = await admission.in_db(admission.address_locked, self.axes)
        except sessions.Refused as exc:  # the database is away: nothing logs in, nothing is counted
            self.asked = False
            self.refusal = str(exc)
            self._banner(self.refusal)
            return True
        if locked:
            self.locked = True
            self.refusal = admission.lockout_words()
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
                f"e.g. ssh -p {sessions.ssh_port()} c42-0@<host>: each running cluster's page shows "
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
            locked = await admission.in_db(admission.login_failed, self.axes, self.username)
        except sessions.Refused:
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
            attached = await admission.in_db(
                admission.key_attached, cluster_id, fingerprint, key.public_data
            )
        except sessions.Refused as exc:  # the database is away, or a team's viewer
            self.proved = isinstance(exc, admission.ReadOnly)
            self._banner(str(exc))
            return False
        except Exception:
            log.exception("%s: checking key %s failed", _shown(self.username), fingerprint)
            self._banner("Suanli: the gateway could not check your key; try again in a minute.")
            return False
        self.proved = attached is not None
        if attached is None:
            try:
                words = await admission.in_db(
                    admission.not_attached_words, cluster_id, fingerprint, key.public_data,
                    _shown(self.username),
                )  # fmt: skip
            except sessions.Refused as exc:
                words = str(exc)
            self._banner(words)
            return False
        try:
            login = await admission.in_db(
                admission.admit, name, cluster_id, index, fingerprint, key.public_data, attached
            )
            await asyncio.get_running_loop().run_in_executor(None, sessions.workspace_up, login)
            owner_id = login.person_id  # the person's count, not the team's (sessions.py)
            limit = settings.SUANLI_SSH_MAX_SESSIONS
            claimed = await asyncio.to_thread(
                sessions.session_claim, owner_id, self.session_id, limit
            )
            if not claimed:
                raise sessions.Refused(
                    f"Suanli: you have {limit} SSH sessions open, the most one researcher may "
                    "have at a time. End one (exit, or close its window) and log in again."
                )
            self.gateway.sessions[self.session_id] = owner_id
            if self.lost:  # gone while we looked
                self._release()
                return False
            # Before any exec: a successor hangs up what runs there should this one die.
            await asyncio.to_thread(leftovers.reached, self.gateway.instance, login)
            await admission.in_db(admission.record_login, login)
        except sessions.Refused as exc:
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
        log.info("%s: login by %s with %s from %s", login.name, login.who, fingerprint,
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
            problem = await admission.in_db(admission.still_admitted, self.login)
        except sessions.Refused as exc:  # the database is away: this channel only
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
        owner_id = self.login.person_id
        claim = f"{self.session_id}.sftp.{secrets.token_hex(4)}"
        limit = settings.SUANLI_SSH_MAX_SESSIONS
        if not await asyncio.to_thread(sessions.session_claim, owner_id, claim, limit):
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
                self.spawn(asyncio.to_thread(sessions.session_release, owner_id, claim))


class Channel:
    """What a shell, an exec, an sftp session and a relay share: an engine stream between
    the SSH channel and the engine, activity for the idle check, and the hang-up."""

    def __init__(self, connection: Connection):
        self.connection = connection
        self.login = connection.login
        self.chan = None
        self.marker = leftovers.marker(connection.gateway.instance, secrets.token_hex(12))
        self.exec_id = ""
        self.container_id = ""
        self.closed = False
        self.counted = False  # among the connection's open channels
        self.sftp_counted = False  # among its sftp containers
        self.stream: streams.EngineStream | None = None

    def connection_made(self, chan) -> None:
        self.chan = chan
        self.connection.channels.add(self)
        self.stream = streams.EngineStream(
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
                asyncio.to_thread(streams.exec_hang_up, self.login, self.exec_id, self.marker)
            )
        if self.container_id:
            self.connection.spawn(
                asyncio.to_thread(sftp.sftp_remove, self.login, self.container_id)
            )

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
        self.watch: sftp.WriteWatch | None = None  # sftp: a refused write, said in words
        self.transfer: sftp.Transfer | None = None  # rsync or scp -O's server side
        self.helper = False  # ... run in our container (the image has no such program)
        self.places: list[str] = []  # where that transfer may write
        self.language: str | None = None  # the researcher's, for the words of a transfer

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
        # From the first byte on (its packets are framed from there); places come in _start.
        self.watch = sftp.WriteWatch(self.login.exec_base["workdir"], [])
        return True

    def data_received(self, data: bytes, datatype) -> None:
        if self.watch is not None:
            self.watch.client_sent(data)
        super().data_received(data, datatype)

    def _output(self, data: bytes, stderr: bool) -> None:
        if self.watch is not None and not stderr and not self.closed:
            said = self.watch.server_sent(data)
            if said:
                self.chan.write_stderr(f"Suanli: {said}.\n".encode())
        super()._output(data, stderr)

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
                await asyncio.to_thread(streams.exec_resize, self.login, self.exec_id, *sent)
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
        env = {streams.MARKER: self.marker.partition("=")[2]}
        if self.term:
            env["TERM"] = self.term
        passed = {**(self.chan.get_environment() or {}), **self.env}
        taken = [(name, value) for name, value in passed.items() if _env_taken(name, value)]
        env.update(taken[:ENV_NAMES])
        return env

    async def _start(self) -> None:
        try:
            transfer = None if self.term else sftp.transfer_command(self.command)
            if self.kind == "exec" and transfer is not None:
                self.transfer = transfer
                self.helper = not await asyncio.to_thread(
                    sftp.workspace_has, self.login, transfer.program
                )
            if self.kind == "sftp" or self.helper:
                hijacked = await self._start_helper()
                if hijacked is None:
                    return
            else:
                if self.transfer is not None and not await self._may_write():
                    return
                cmd = (
                    streams.LOGIN_SHELL if self.kind == "shell" else ["/bin/sh", "-c", self.command]
                )
                self.exec_id, hijacked = await asyncio.to_thread(
                    streams.exec_open, self.login, cmd, tty=bool(self.term), env=self._environment()
                )
        except sessions.Refused as exc:
            self.fail(str(exc))
            return
        except runtime.SpecError as exc:
            self.fail(f"your volumes cannot be mounted: {exc}")
            return
        except sessions.ENGINE_ERRORS as exc:
            log.warning("%s: the engine of %s: %s", self.login.name, self.login.host.name,
                        engine.describe(exc))  # fmt: skip
            self.fail(f"the workspace of node {self.login.index} did not answer; "
                      "try again in a minute")  # fmt: skip
            return
        if self._started(hijacked) and self.term:
            await self._resize()

    async def _start_helper(self):
        """sftp, or rsync/scp for an image without them, in our container
        (sftp.helper_open): counted as a session beyond a connection's first, refused in
        words when it would write outside the cluster's writable volumes. Its hijacked
        socket, or None when it was refused (said) or the client left."""
        if not await self.connection.sftp_claim():
            limit = settings.SUANLI_SSH_MAX_SESSIONS
            self.fail(
                f"you have {limit} SSH sessions open, the most one researcher may have "
                "at a time (an sftp, rsync or scp session beyond the first of a connection "
                "counts as one); end one and try again"
            )
            return None
        self.sftp_counted = True
        if self.closed:  # the client left meanwhile
            return None
        mounts = await admission.in_db(sftp.sftp_mounts, self.login.cluster)
        self.places = sftp.writable_places(mounts)
        self.language = await admission.in_db(admission.language_of, self.login.person_id)
        home = self.login.exec_base["workdir"]
        if self.watch is not None:
            self.watch.places, self.watch.language = self.places, self.language
        if self.transfer is None:
            argv, tool = [sftp.SFTP_SERVER, "-d", home], "sftp"
        else:
            tool = self.transfer.tool
            argv = [sftp.PROGRAMS[tool], *self.transfer.args]
            for path in self.transfer.written:
                if not sftp.is_inside(path, home, self.places):
                    self.fail(
                        sftp.not_writable_words(
                            path, self.places, workspace=False, language=self.language
                        )
                    )
                    return None
        self.container_id, hijacked = await asyncio.to_thread(
            sftp.helper_open, self.login, mounts, argv, tool=tool, language=self.language
        )
        return hijacked

    async def _may_write(self) -> bool:
        """A transfer in the workspace (its image has the program) that would write outside
        the volumes and /tmp: asked of the workspace first, since its image may let the
        tenant write there; refused in words naming those places when it does not (the
        program's own error reaches a client that is gone by the time it exits)."""
        home = self.login.exec_base["workdir"]
        self.places = await admission.in_db(sftp.volume_places, self.login.cluster)
        places = [*self.places, "/tmp"]  # noqa: S108 (the workspace's own)
        for path in self.transfer.written:
            if sftp.is_inside(path, home, places):
                continue
            if not await asyncio.to_thread(sftp.workspace_may_write, self.login, path):
                language = await admission.in_db(admission.language_of, self.login.person_id)
                self.fail(
                    sftp.not_writable_words(path, self.places, workspace=True, language=language)
                )
                return False
        return True

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
                status = await asyncio.to_thread(streams.exec_exit_code, self.login, self.exec_id)
            except sessions.ENGINE_ERRORS:
                status = 255
        elif self.container_id and self.transfer is not None:
            status = await asyncio.to_thread(sftp.helper_exit_code, self.login, self.container_id)
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
        cmd = ["/bin/sh", "-c", streams.RELAY, "relay", str(self.port), streams.RELAY_PY]
        env = {streams.MARKER: self.marker.partition("=")[2]}
        try:
            self.exec_id, hijacked = await asyncio.to_thread(
                streams.exec_open, self.login, cmd, tty=False, env=env
            )
        except sessions.ENGINE_ERRORS as exc:
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


def _revocation(message) -> tuple[int, int] | None:
    """(person, principal) of a revocations message; None for anything else."""
    if not message or message.get("type") != "message":
        return None
    try:
        body = json.loads(message["data"])
        return int(body["person"]), int(body["principal"])
    except (ValueError, TypeError, KeyError):
        log.warning("a revocation message not understood: %r", message.get("data"))
        return None


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
    gateway = Gateway(f"{socket.gethostname()}:{settings.SUANLI_SSH_BIND}:{sessions.ssh_port()}")
    metrics.GATEWAY_SESSIONS.set_function(lambda: len(gateway.connections))
    metrics.serve("gateway")
    key = host_key()  # made here when there is none yet: the only process that makes it
    server = await asyncssh.listen(
        settings.SUANLI_SSH_BIND, sessions.ssh_port(),
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
    gateway.loop = loop
    stop_listening = threading.Event()
    listener = threading.Thread(
        target=gateway.listen_revocations, args=(stop_listening,), name="gateway-revocations",
        daemon=True,
    )  # fmt: skip
    listener.start()
    # Listening on its slot now: a gateway killed there before hangs up here and now.
    gateway.spawn(gateway.keep_up())
    ready(
        f"gateway: listening on {settings.SUANLI_SSH_BIND}:{sessions.ssh_port()} "
        f"(host key {key.get_fingerprint('sha256')})"
    )
    await stop.wait()
    heartbeat.cancel()
    stop_listening.set()
    server.close()
    for connection in list(gateway.connections):
        connection.conn.disconnect(asyncssh.DISC_BY_APPLICATION, "the gateway is restarting")
    await asyncio.sleep(0.2)  # connection_lost runs: hang-ups and releases are spawned
    if gateway.tasks:
        await asyncio.wait(set(gateway.tasks), timeout=10)
    await asyncio.to_thread(leftovers.forget, gateway.instance)  # it hung up its own


def run() -> None:
    asyncio.run(serve(ready=lambda line: print(line, flush=True)))

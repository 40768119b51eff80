"""An exec in a workspace and its stream, shared by the SSH gateway's channels
(jobs/access/ssh.py), the web terminal (console/terminal.py) and the workspace apps' proxy
(console/proxy.py): the commands they run (LOGIN_SHELL, RELAY), starting an exec as the
tenant (exec_open), its size and exit status, its hang-up, and EngineStream, the bridge
between the engine's hijacked socket and the event loop.

Docker does not end an exec when its client goes (moby/moby#9098): when a channel closes
first, a second exec hangs up (SIGHUP) the processes that carry that channel's marker
(MARKER) in their environment and are still in the session its exec began, as the kernel
does for an SSH session whose connection drops (exec_hang_up, HANG_UP): what ignores
SIGHUP (nohup) or started a session of its own (tmux, screen, setsid) lives on.

Threads: the engine's hijacked sockets (exec, attach) are blocking, plain or TLS. Each is
bridged to the event loop by two threads of its own (a reader, a writer) that share it
non-blocking under a lock and wait in poll(), so a TLS socket is never used by two threads
at once and nothing spins. Output is handed to the loop only as fast as the caller takes
it (EngineStream.hold), and input waiting for the engine is bounded (HIGH_WATER).

Imports no asyncssh: the web process imports this.

Layer: access, over sessions; uses engine (through sessions.client).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable

from jobs.access.sessions import ENGINE_ERRORS, Login, client

log = logging.getLogger("suanli.gateway")

MARKER = "SUANLI_SSH"  # env of every exec of a channel: <gateway>-<channel>, for the hang-up
# bash where the image has it (a login shell: the image's profile), else the POSIX shell.
LOGIN_SHELL = ["/bin/sh", "-c", "command -v bash >/dev/null && exec bash -l || exec sh"]
# $1: an extended regular expression of the markers to hang up (matched against each line
# of a process's environment). A process carrying one gets SIGHUP (and SIGCONT when stopped,
# as the kernel sends a stopped job) while it is in the session its exec began: that
# session's leader is an exec's first process (its parent outside the container: ppid 0)
# or has ended. One that started a session of its own (tmux's server and panes, screen,
# setsid) is left alone, as the workspace's own main process is (pid 1's session).
HANG_UP = r"""
stat_of() { s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1; echo "${s##*) }"; }
m=$1
for p in /proc/[0-9]*; do
  n=${p#/proc/}
  case $n in 1|$$) continue ;; esac
  tr "\0" "\n" 2>/dev/null < "$p/environ" | grep -qE "$m" || continue
  st=$(stat_of "$n") || continue
  set -- $st
  state=$1 sid=$4
  [ "$sid" = 1 ] && continue
  if [ -e "/proc/$sid" ]; then
    set -- $(stat_of "$sid")
    [ "${2:-0}" = 0 ] || continue
  fi
  kill -HUP "$n" 2>/dev/null
  [ "$state" = T ] && kill -CONT "$n" 2>/dev/null
done
true
"""
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
# A TTY exec passes stdin through Docker's detach-key filter (ctrl-p ctrl-q by default):
# a sequence no one types, so that ctrl-p (bash's previous line) stays a keystroke.
DETACH_KEYS = "ctrl-^,ctrl-_,ctrl-^,ctrl-_,ctrl-^"
CHUNK = 65536
HIGH_WATER = 1 << 20  # bytes for the engine not sent yet: stop reading the client
LOW_WATER = 1 << 18


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


# -- the engine side of a channel (blocking: run on the executor) ----------------------------


def exec_open(login: Login, cmd: list[str], *, tty: bool, env: dict) -> tuple[str, object]:
    """An exec in the workspace as the tenant, started: (its id, the hijacked socket)."""
    api = client(login).api
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
    api = client(login).api
    for _ in range(40):
        found = api.exec_inspect(exec_id)
        if not found.get("Running") and found.get("ExitCode") is not None:
            return int(found["ExitCode"])
        time.sleep(0.05)
    return 255


def exec_hang_up(login: Login, exec_id: str, marker: str) -> None:
    """SIGHUP to what the channel's exec left running (its marker, `NAME=value`, in their
    environment, in its session: HANG_UP)."""
    api = client(login).api
    try:
        if not api.exec_inspect(exec_id).get("Running"):
            return
        hang_up(api, login.container_id, login.exec_base, f"^{marker}$")
    except ENGINE_ERRORS as exc:
        log.info("%s: exec %s not hung up: %s", login.name, exec_id[:12], exc)


def hang_up(api, container_id: str, exec_base: dict, pattern: str) -> None:
    """Run HANG_UP in the workspace as its tenant (`exec_base`: workspaces.exec_kwargs) for
    the markers `pattern` matches (letters, digits, `_=-` and the regex's own `^$|()`)."""
    made = api.exec_create(
        container_id,
        **{**exec_base, "cmd": ["/bin/sh", "-c", HANG_UP, "sh", pattern], "stdin": False},
    )
    api.exec_start(made["Id"])


def exec_resize(login: Login, exec_id: str, width: int, height: int) -> None:
    with contextlib.suppress(*ENGINE_ERRORS):
        client(login).api.exec_resize(exec_id, height=height, width=width)

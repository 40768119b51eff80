"""What every host check proves from inside the host (issue 38: the console verifies, it
does not trust what a host was told to be).

One canary container, made as a cluster's would be (the tenant uid, no capabilities, no
new privileges, bounded pids and memory, a read-only root) on a user-defined bridge like
a cluster's whose interface the tenant firewall covers (`slcanary`, matched by `slc+` in
jobs/hosts/scripts/host-firewall.sh), tries in parallel to open a TCP connection to

* the host itself: its registered address and the bridge's gateway (the engine, the
  swarm's ports, SSH, a MooseFS chunkserver);
* the control plane: the console's web port, PostgreSQL, Redis, the registry and the
  MooseFS master and chunkserver, at the addresses the settings name (where a setting
  names a loopback address, at the control plane's other addresses);
* the other hosts' engines: their addresses at the engine's and the swarm's ports;

and reads the one file the console wrote just before on the researchers' filesystem
(`SUANLI_STORAGE_ROOT/.suanli/hosts/<host id>`, a random marker, bind-mounted read-only):
the same marker proves the host mounts the same filesystem as the console. Every
connection waits at most a second (busybox `nc -w 1`), all at once: a check costs about a
second more than a bare container start.

Anything reached, a marker that is not the console's or that the console could not write
(its folder replaced by a file or a link, its filesystem full or its master down: the
reach proofs still run, without the marker), an engine outside the fleet's swarm
(when the fleet has more than one host) or an engine network over the hosts' own
addresses (network.overlaps) is a reason; the host check (services.host_check) marks a
host with any reason *degraded*, with the reasons as its last error, which takes it out
of placement.

Layer: hosts, under services and joins; uses nodes (runtime: the tenant uid; network: the
protected addresses, the engine's networks; engine), files (storage), models and base (text,
validators).
"""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import stat
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import docker
from django.conf import settings
from django.utils.translation import gettext_noop
from docker.types import Mount

from jobs.base import validators
from jobs.base.text import Text
from jobs.files import storage
from jobs.models import Host
from jobs.nodes import engine, network, runtime

# The canary's network: a bridge like a cluster's, whose Linux interface the tenant
# firewall covers (slc+). Kept on the engine between checks; never a cluster's (their
# names are slc<digits>), never swept with them (it carries no cluster label).
CANARY_NETWORK = "suanli-canary"
CANARY_BRIDGE = "slcanary"
CANARY_NETWORK_LABEL = "suanli.canary"
MARKER_TARGET = "/suanli/marker"
# The most other hosts one check tries (chosen at random each time): a large fleet is
# covered over a few checks, and one canary's processes stay few.
PEERS_MAX = 32

# The ports of a host that no tenant container may open, on its own address and its
# bridges' gateways.
HOST_PORTS = {
    22: gettext_noop("SSH"),
    2375: gettext_noop("the engine"),
    2376: gettext_noop("the engine"),
    2377: gettext_noop("the swarm's control port"),
    7946: gettext_noop("the swarm's gossip port"),
    9422: gettext_noop("a MooseFS chunkserver"),
}
PEER_PORTS = {
    2375: gettext_noop("the engine"),
    2376: gettext_noop("the engine"),
    2377: gettext_noop("the swarm's control port"),
}

# The canary's script: "$1" is the marker's path (empty: none), then address and port
# pairs. `nc -e true` exits 0 once connected (busybox's nc has no -z); each is tried in
# the background, so all wait their second at once.
SCRIPT = """
if [ -n "$1" ]; then printf 'marker %s\\n' "$(cat "$1" 2>/dev/null)"; fi
shift
while [ $# -ge 2 ]; do
  (nc -w 1 "$1" "$2" -e true >/dev/null 2>&1 && echo "reached $1 $2") &
  shift 2
done
wait
"""


@dataclass(frozen=True)
class Target:
    """An address and port no tenant container may open, and what listens there."""

    address: str
    port: int
    what: Text

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


# -- what must be out of reach ------------------------------------------------------------


def _ips(name: str, *, resolve: bool) -> list[str]:
    """The addresses of a host name or literal that a container could reach: never a
    loopback or unspecified one (those are the container's own)."""
    return [
        str(ip)
        for ip in network.addresses_of(name, resolve=resolve)
        if not (ip.is_loopback or ip.is_unspecified)
    ]


def _port(text: str | int | None, default: int) -> int:
    try:
        port = int(text or default)
    except (TypeError, ValueError):
        return default
    return port if 0 < port < 65536 else default


def control_plane() -> list[tuple[str, int, Text]]:
    """(host name or address, port, what) of the control plane's services from the
    settings: the console's web port, PostgreSQL, Redis, the registry, MooseFS."""
    found: list[tuple[str, int, Text]] = [
        (settings.SUANLI_WEB_BIND, settings.SUANLI_WEB_PORT, Text(gettext_noop("the console")))
    ]
    db = settings.DATABASES["default"]
    if "postgresql" in db.get("ENGINE", ""):
        found.append((str(db.get("HOST") or ""), _port(db.get("PORT"), 5432), Text("PostgreSQL")))
    redis = urlsplit(settings.REDIS_URL)
    if redis.scheme in ("redis", "rediss"):
        try:
            redis_port = redis.port
        except ValueError:
            redis_port = None
        found.append((redis.hostname or "", _port(redis_port, 6379), Text("Redis")))
    if settings.SUANLI_REGISTRY.strip():
        host, port = validators.split_port(settings.SUANLI_REGISTRY.strip().partition("/")[0])
        found.append((host, _port(port, 443), Text(gettext_noop("the registry"))))
    master = storage.master()
    if master:
        host, port = master
        found.append((host, port, Text(gettext_noop("the MooseFS master"))))
        if storage.enforced():
            # MooseFS's layout around the clients' port (9421 by default): the metaloggers'
            # and chunkservers' ports of the master below it, a chunkserver's above.
            for other, what in (
                (port - 2, gettext_noop("the MooseFS master")),
                (port - 1, gettext_noop("the MooseFS master")),
                (port + 1, gettext_noop("a MooseFS chunkserver")),
            ):
                if 0 < other < 65536:
                    found.append((host, other, Text(what)))
    return [(host.strip("[]"), port, what) for host, port, what in found]


def control_plane_addresses() -> dict[str, Text]:
    """The addresses (names resolved, never a loopback one) of the control plane's services,
    each with what listens there first: no host may claim one by a join token's address
    alone (jobs/hosts/joins.py)."""
    found: dict[str, Text] = {}
    for name, _, what in control_plane():
        for ip in _ips(name, resolve=True):
            found.setdefault(ip, what)
    return found


def targets(host: Host, gateways: list[str], *, peers: list[Host] | None = None) -> list[Target]:
    """Every address and port the canary on `host` must not reach; `gateways` are the
    canary's bridge's addresses on the host. The first name given to an address and port
    is the one a reason uses."""
    own = [*_ips(host.address, resolve=True), *gateways]
    services = control_plane()
    at = {name: _ips(name, resolve=True) for name, _, _ in services}
    # Where a service listens on a loopback address (or every address), a container could
    # reach it at the control plane's other addresses, or on a one-machine fleet at the
    # host's own.
    elsewhere = list(dict.fromkeys(ip for ips in at.values() for ip in ips)) or own
    found: list[Target] = []
    for name, port, what in services:
        for ip in at[name] or elsewhere:
            found.append(Target(ip, port, what))
    for ip in own:
        for port, what in _engine_ports(host, HOST_PORTS).items():
            found.append(
                Target(ip, port, Text(gettext_noop("this host: %(service)s"), service=Text(what)))
            )
    for peer in _peers(host) if peers is None else peers:
        for ip in _ips(peer.address, resolve=True):
            for port, what in _engine_ports(peer, PEER_PORTS).items():
                found.append(
                    Target(
                        ip,
                        port,
                        Text(
                            gettext_noop("host %(host)s: %(service)s"),
                            host=peer.name,
                            service=Text(what),
                        ),
                    )
                )
    seen: dict[tuple[str, int], Target] = {}
    for target in found:
        seen.setdefault((target.address, target.port), target)
    return list(seen.values())


def _engine_ports(host: Host, ports: dict[int, str]) -> dict[int, str]:
    """`ports` and the port of the host's engine where it listens on TCP."""
    if host.uses_tls:
        port = urlsplit(host.engine_url).port
        if port and port not in ports:
            return {**ports, port: gettext_noop("the engine")}
    return ports


def _peers(host: Host) -> list[Host]:
    others = list(Host.objects.exclude(pk=host.pk).only("name", "address", "engine_url"))
    return random.sample(others, PEERS_MAX) if len(others) > PEERS_MAX else others


# -- the researchers' filesystem ----------------------------------------------------------


def proves_storage() -> bool:
    """Whether hosts must show the console's filesystem: not on a one-machine fleet."""
    return storage.enforced()


def marker_path(host_id: int) -> Path:
    return Path(settings.SUANLI_STORAGE_ROOT) / ".suanli" / "hosts" / str(host_id)


def write_marker(host_id: int) -> str:
    """A new random marker for the host, written where only the console writes (folders
    0755, the file 0644, made by the console's user: root in production), replaced at
    once so a reader never sees half of it. Returns it."""
    path = marker_path(host_id)
    os.makedirs(path.parent.parent.parent, exist_ok=True)  # the storage root: the operator's
    for folder in (path.parent.parent, path.parent):
        try:
            folder.mkdir(mode=0o755)
        except FileExistsError:
            pass
        info = os.lstat(folder)
        if not stat.S_ISDIR(info.st_mode):  # a link or a file where the console's folder goes
            raise OSError(f"{folder} is not a folder")
        if stat.S_IMODE(info.st_mode) != 0o755:
            os.chmod(folder, 0o755)  # noqa: S103 (readable by all: the canary reads it)
    value = secrets.token_hex(16)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(value + "\n")
        os.chmod(temporary, 0o644)  # whatever the umask
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return value


def read_marker(host_id: int) -> str:
    """The marker as the console sees it now ('' when there is none)."""
    try:
        return marker_path(host_id).read_text().strip()
    except OSError:
        return ""


# -- the canary ---------------------------------------------------------------------------


def canary_network(host: Host) -> list[str]:
    """Make the canary's network on the host's engine if it is not there; its gateways
    (the host's addresses on it). Raises engine.EngineError when the engine does not
    answer, engine.CanaryFailed when it refuses."""
    try:
        client = engine.cached_client(host)
        found = [
            n for n in client.networks.list(names=[CANARY_NETWORK]) if n.name == CANARY_NETWORK
        ]
        if not found:
            try:
                found = [
                    client.networks.create(
                        CANARY_NETWORK,
                        driver=network.BRIDGE,
                        options={
                            "com.docker.network.bridge.name": CANARY_BRIDGE,
                            "com.docker.network.bridge.enable_icc": "false",
                            "com.docker.network.bridge.enable_ip_masquerade": "true",
                            "com.docker.network.driver.mtu": str(network.mtu(network.BRIDGE)),
                        },
                        labels={CANARY_NETWORK_LABEL: "network"},
                        check_duplicate=True,
                    )
                ]
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # made meanwhile by a concurrent check
                    raise
            found = [client.networks.get(CANARY_NETWORK)]
    except docker.errors.APIError as exc:
        raise engine.CanaryFailed(engine.describe(exc)) from exc
    except Exception as exc:  # requests/urllib3/ssl/OS errors: the engine did not answer
        raise engine.EngineError(engine.describe(exc)) from exc
    gateways = []
    for config in (found[0].attrs.get("IPAM") or {}).get("Config") or []:
        gateway = config.get("Gateway") or ""
        if not gateway and config.get("Subnet"):
            try:  # the engine gives a network's first address to its bridge
                gateway = str(next(ipaddress.ip_network(config["Subnet"], strict=False).hosts()))
            except (ValueError, StopIteration):
                continue
        if gateway:
            gateways.append(gateway.partition("/")[0])
    return gateways


@dataclass(frozen=True)
class Seen:
    """What the canary printed: the targets it reached, the marker it read (None: it was
    not asked to read one)."""

    reached: list[Target]
    marker: str | None


def command(found: list[Target], *, marker: bool) -> list[str]:
    pairs = [word for t in found for word in (t.address, str(t.port))]
    return ["sh", "-c", SCRIPT, "canary", MARKER_TARGET if marker else "", *pairs]


def parse(output: str, found: list[Target], *, marker: bool) -> Seen:
    """The canary's lines: `reached ADDRESS PORT` of a target it was asked to try (any
    other is ignored), `marker VALUE` when it was asked to read the marker."""
    words = [(t.address, str(t.port)) for t in found]
    reached: set[int] = set()
    seen_marker = "" if marker else None
    for line in output.splitlines():
        word, _, rest = line.partition(" ")
        if word == "reached":
            address, _, port = rest.strip().partition(" ")
            if (address, port) in words:
                reached.add(words.index((address, port)))
        elif word == "marker" and marker:
            seen_marker = rest.strip()
    return Seen([found[i] for i in sorted(reached)], seen_marker)


BIND_MISSING = "bind source path does not exist"


def run(host: Host) -> tuple[str, list[Text]]:
    """The canary on the host: (a note for operators, the reasons it found). Raises
    engine.EngineError when the engine does not answer, engine.CanaryFailed when it
    cannot start the canary."""
    gateways = canary_network(host)
    found = targets(host, gateways)
    expected = None
    reasons: list[Text] = []
    if proves_storage():
        try:
            expected = write_marker(host.pk)
        except OSError as exc:
            # The console's own mount may be the trouble (full, its master down), or a host
            # replaced the console's folder: either way the host is not proved. The reach
            # proofs still run, without the marker.
            reasons.append(
                Text(
                    gettext_noop("the console could not write its marker: %(why)s"),
                    why=f"{marker_path(host.pk)}: {exc}",
                )
            )
    uid = runtime.tenant_uid(0)  # a tenant's uid that no researcher has (ids start at 1)
    options = {
        "user": f"{uid}:{uid}",
        "network": CANARY_NETWORK,
        "pids_limit": 2 * len(found) + 16,  # a subshell and an nc per target
        "mem_limit": "64m",
    }
    mounts = []
    if expected is not None:
        source = str(marker_path(host.pk))
        mounts = [Mount(target=MARKER_TARGET, source=source, type="bind", read_only=True)]
    try:
        ran = engine.run_canary(
            host, settings.SUANLI_CANARY_IMAGE, mounts=mounts,
            command=command(found, marker=expected is not None), **options,
        )  # fmt: skip
    except engine.CanaryFailed as exc:
        if not (mounts and BIND_MISSING in str(exc)):
            raise
        # The host has no such file: not the console's filesystem. The rest is still proved.
        reasons.append(storage_reason(found=False))
        expected, mounts = None, []
        ran = engine.run_canary(
            host, settings.SUANLI_CANARY_IMAGE, command=command(found, marker=False), **options
        )
    if ran.note:
        return ran.note, reasons
    seen = parse(ran.output, found, marker=expected is not None)
    reasons += reach_reasons(seen.reached)
    if expected is not None and seen.marker not in {expected, read_marker(host.pk)}:
        # Not ours, nor one a concurrent check of the same host wrote meanwhile.
        reasons.insert(0, storage_reason(found=bool(seen.marker)))
    return "", reasons


# -- the reasons --------------------------------------------------------------------------


def lines(items: list[Text | str]) -> Text:
    """Reasons (and notes) one a line, each in the reader's language where it is a Text."""
    items = [item for item in items if item]
    out = items[-1]
    for item in reversed(items[:-1]):
        out = Text(gettext_noop("%(line)s\n%(more)s"), line=item, more=out)
    return out if isinstance(out, Text) else Text(gettext_noop("%(line)s"), line=out)


def reach_reasons(reached: list[Target]) -> list[Text]:
    return [
        Text(gettext_noop("a container reached %(target)s (%(what)s)"), target=str(t), what=t.what)
        for t in reached
    ]


def storage_reason(*, found: bool) -> Text:
    return Text(
        gettext_noop(
            "the researchers' filesystem on this host is not the console's (marker differs): "
            "mount it at %(root)s"
        )
        if found
        else gettext_noop(
            "the researchers' filesystem on this host is not the console's (marker not "
            "found): mount it at %(root)s"
        ),
        root=str(settings.SUANLI_STORAGE_ROOT),
    )


def swarm_reason(state: str, swarm: str, others: list[str]) -> Text | None:
    """Whether an engine in swarm `swarm` (state `state`) is in the fleet's swarm, `others`
    being the swarms of the fleet's other hosts ('' for one not known to be in any). None
    when it is, or when the fleet is this host alone."""
    if not others:
        return None
    if state != "active":
        return Text(
            gettext_noop(
                "the engine is not in the fleet's Docker swarm (its state: %(state)s): join it"
            ),
            state=state or "unknown",
        )
    counts = Counter(s for s in others if s)
    if not swarm or not counts:
        return None  # a worker that names no manager yet; or no other member known
    most = max(counts.values())
    fleet = sorted(s for s, n in counts.items() if n == most)
    if swarm in fleet:
        return None
    return Text(
        gettext_noop(
            "the engine is in another Docker swarm (%(swarm)s) than the fleet's (%(fleet)s): "
            "leave it and join the fleet's"
        ),
        swarm=swarm,
        fleet=fleet[0],
    )


def swarm_reasons(host: Host, facts: dict) -> list[Text]:
    """The swarm proof of a host whose engine said `facts` (engine.engine_facts), against
    the other hosts that answer (a down host's swarm is what it was)."""
    answering = Host.objects.exclude(pk=host.pk).exclude(state=Host.State.DOWN)
    if answering.exists() and not answering.filter(swarm_state="active").exists():
        # No swarm in the fleet yet (its first hosts, joined before anyone ran `docker
        # swarm init`): nothing to be out of. Each host takes clusters whose nodes all fit
        # on it (jobs/nodes/network.py), as join.sh says.
        return []
    others = list(answering.values_list("swarm_cluster", flat=True))
    if not others and Host.objects.exclude(pk=host.pk).exists():
        others = [""]  # only down hosts besides it: still a fleet, whose swarm is unknown
    reason = swarm_reason(facts.get("swarm_state", ""), facts.get("swarm_cluster", ""), others)
    return [reason] if reason else []

"""Cluster networks (docs/architecture.md, "The Docker contract", and docs/threat-model.md).

Every cluster has a network of its own, made when it is placed and removed after it is
released; no tenant container ever uses host networking or an engine's default bridge.

* All live nodes on one host: a bridge on that host, named `suanli-c<id>`, whose Linux
  interface is `slc<id>`. The hosts' tenant firewall (jobs/hosts/scripts/host-firewall.sh) drops
  what comes in from `slc+` for the host itself and for the protected networks.
* Nodes on several hosts: an attachable overlay network `suanli-c<id>-x` of the Docker
  swarm the hosts form, created through a manager's API; each engine attaches its
  containers to it by name. Its containers leave the host through `docker_gwbridge`, which
  the firewall treats the same way.

Docker's own isolation keeps two networks apart, so one cluster never reaches another's
containers, the same researcher's included. The rank-0 container's name on the network is
MASTER_ADDR; eth0 is the cluster network in every replica (NCCL/GLOO_SOCKET_IFNAME).

Reads: hosts and nodes. Talks to: the engines. Called by the runner (before a job starts),
its tasks (after placement, after release) and the reconciler (removal sweep).

Layer: nodes, over engine and under runtime; uses engine, models and base (validators,
addresses).

The host check asks it (`overlaps`) whether any of an engine's networks covers the hosts'
own addresses: the host's, its peers', the registry's, the control plane's.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

import docker
from django.conf import settings

from jobs.base import addresses, validators
from jobs.base.addresses import IPAddress
from jobs.models import Cluster, Host, Node
from jobs.nodes import engine

log = logging.getLogger(__name__)

LABEL = "suanli.cluster"
BRIDGE = "bridge"
OVERLAY = "overlay"
IFNAME = "eth0"  # the network a container is created on is its first interface
VXLAN_OVERHEAD = 50


class NetworkError(Exception):
    """The cluster's network cannot be made (no swarm manager, an engine's refusal).
    `host_id`: the engine that refused or did not answer, when it was one (the cause is
    the engine's own error)."""

    def __init__(self, message: str, *, host_id: int | None = None):
        super().__init__(message)
        self.host_id = host_id


def driver_for(host_ids: Iterable[int]) -> str:
    return BRIDGE if len(set(host_ids)) <= 1 else OVERLAY


def name_for(cluster_id: int, driver: str) -> str:
    return f"suanli-c{cluster_id}" if driver == BRIDGE else f"suanli-c{cluster_id}-x"


def bridge_interface(cluster_id: int) -> str:
    return f"slc{cluster_id}"  # 15 characters at most: a Linux interface name


def mtu(driver: str) -> int:
    base = settings.SUANLI_NETWORK_MTU
    return base - VXLAN_OVERHEAD if driver == OVERLAY else base


def _live_nodes(cluster_id: int) -> list[Node]:
    return list(
        Node.objects.filter(cluster_id=cluster_id, released_at__isnull=True)
        .select_related("host")
        .order_by("index")
    )


# Networks this process made or saw, per cluster: (name, host ids). A job start then
# costs no round trip for them; `forget` after an engine says one is gone.
_known: dict[int, tuple[str, frozenset[int]]] = {}


def forget(cluster_id: int) -> None:
    _known.pop(cluster_id, None)


def ensure(cluster_id: int, nodes: list[Node] | None = None) -> str:
    """Make the cluster's network for its live nodes if it is not there; return its name.
    Idempotent and safe to race: a duplicate create answers 409 and the existing one is used."""
    nodes = _live_nodes(cluster_id) if nodes is None else nodes
    if not nodes:
        raise NetworkError("the cluster has no nodes")
    hosts = {n.host_id: n.host for n in nodes}
    known = _known.get(cluster_id)
    if known is not None and known[1] == frozenset(hosts):
        return known[0]
    name = _ensure(cluster_id, hosts)
    _known[cluster_id] = (name, frozenset(hosts))
    return name


def _ensure(cluster_id: int, hosts: dict[int, Host]) -> str:
    driver = driver_for(hosts)
    name = name_for(cluster_id, driver)
    labels = {LABEL: str(cluster_id)}
    if driver == BRIDGE:
        host = next(iter(hosts.values()))
        options = {
            "com.docker.network.bridge.name": bridge_interface(cluster_id),
            "com.docker.network.bridge.enable_icc": "true",
            "com.docker.network.bridge.enable_ip_masquerade": "true",
            "com.docker.network.driver.mtu": str(mtu(BRIDGE)),
        }
        _create(host, name, labels=labels, driver=BRIDGE, options=options)
        return name
    outside = [h.name for h in hosts.values() if not h.swarm_member]
    swarms = {h.swarm_cluster for h in hosts.values()}
    if outside or len(swarms) != 1:
        raise NetworkError(
            "the nodes are on hosts that are not members of one Docker swarm "
            f"({', '.join(outside) or 'two swarms'}); an overlay network cannot join them"
        )
    manager = _manager(hosts.values(), swarms.pop())
    _create(
        manager,
        name,
        labels=labels,
        driver=OVERLAY,
        attachable=True,
        options={"com.docker.network.driver.mtu": str(mtu(OVERLAY))},
    )
    return name


def _manager(hosts: Iterable[Host], swarm: str) -> Host:
    for host in hosts:
        if host.swarm_manager:
            return host
    manager = (
        Host.objects.filter(swarm_cluster=swarm, swarm_manager=True, swarm_state="active")
        .exclude(state=Host.State.DOWN)
        .order_by("pk")
        .first()
    )
    if manager is None:
        raise NetworkError("no reachable manager of the hosts' swarm to create the network on")
    return manager


def _create(host: Host, name: str, *, labels: dict, driver: str, **kwargs) -> None:
    """One round trip: the engine refuses a second network of the name (409), which is
    then the one to use; no look-up before, and none after (the SDK's model would inspect
    what it just made)."""
    client = engine.cached_client(host)
    try:
        client.api.create_network(
            name, driver=driver, labels=labels, check_duplicate=True, **kwargs
        )
    except docker.errors.APIError as exc:
        if exc.status_code == 409:
            return  # made meanwhile by a racing call
        raise NetworkError(f"{host.name}: {engine.describe(exc)}", host_id=host.pk) from exc
    except (docker.errors.DockerException, OSError) as exc:
        raise NetworkError(f"{host.name}: {engine.describe(exc)}", host_id=host.pk) from exc


def remove(cluster_id: int) -> bool:
    """Remove every network of the cluster from every host that held one of its nodes
    (and the swarm's managers). True when none is left; False when one is still in use
    (its containers are stopping) or an engine did not answer: try again later."""
    host_ids = set(Node.objects.filter(cluster_id=cluster_id).values_list("host_id", flat=True))
    hosts = list(Host.objects.filter(pk__in=host_ids).exclude(state=Host.State.DOWN))
    swarms = {h.swarm_cluster for h in hosts if h.swarm_member}
    hosts += list(
        Host.objects.filter(swarm_cluster__in=swarms, swarm_manager=True).exclude(pk__in=host_ids)
    )
    forget(cluster_id)
    done = True
    for host in hosts:
        try:
            client = engine.cached_client(host)
            networks = client.networks.list(filters={"label": f"{LABEL}={cluster_id}"})
        except (docker.errors.DockerException, engine.EngineError, OSError):
            done = False
            continue
        for net in networks:
            if net.attrs.get("Scope") == "swarm" and not host.swarm_manager:
                continue  # only a manager removes a swarm's network
            done = _remove_one(host, net) and done
    return done


def _remove_one(host: Host, net) -> bool:
    try:
        net.remove()
    except docker.errors.NotFound:
        pass
    except (docker.errors.DockerException, OSError) as exc:
        log.info("network %s on %s not removed yet: %s", net.name, host.name, exc)
        return False
    return True


def sweep(host: Host, client: docker.DockerClient) -> int:
    """Remove the host's cluster networks whose cluster is over (the reconciler's safety
    net behind the removal after release). Returns how many went."""
    try:
        networks = client.networks.list(filters={"label": LABEL})
    except (docker.errors.DockerException, OSError):
        return 0
    ids = {}
    for net in networks:
        try:
            ids[net] = int(net.attrs.get("Labels", {}).get(LABEL, ""))
        except ValueError:
            continue
    live = set(
        Cluster.objects.filter(pk__in=set(ids.values()))
        .exclude(state__in=[Cluster.State.RELEASED, Cluster.State.FAILED])
        .values_list("pk", flat=True)
    )
    removed = 0
    for net, cluster_id in ids.items():
        if net.attrs.get("Scope") == "swarm" and not host.swarm_manager:
            continue  # a worker only sees an overlay while it has containers on it
        if cluster_id not in live and _remove_one(host, net):
            removed += 1
    return removed


# -- the hosts' own networks: no engine network may cover them -------------------------------


def protected_addresses(host: Host) -> list[tuple[str, IPAddress]]:
    """(what, address) of what no engine network may cover: the host's own address, every
    other registered host's, the registry's and the console's database and Redis where
    they are IP literals (loopback ones aside: no engine network takes those). A network
    over one of them would have the engine route that address into a bridge or an overlay:
    a cluster's containers could then stand for the host, a peer or the control plane."""
    found: list[tuple[str, IPAddress]] = []
    for other in Host.objects.only("name", "address").order_by("name"):
        what = "its own address" if other.pk == host.pk else f"host {other.name}'s address"
        found += [(what, ip) for ip in _addresses_of(other.address, resolve=True)]
    registry_host = validators.split_port(settings.SUANLI_REGISTRY.strip().partition("/")[0])[0]
    found += [("the registry's address", ip) for ip in _addresses_of(registry_host, resolve=True)]
    database = str(settings.DATABASES["default"].get("HOST") or "")
    found += [("the database's address", ip) for ip in _addresses_of(database, resolve=False)]
    redis_host = urlsplit(settings.REDIS_URL).hostname or ""
    found += [("Redis's address", ip) for ip in _addresses_of(redis_host, resolve=False)]
    return [(what, ip) for what, ip in found if not ip.is_loopback]


def addresses_of(name: str, *, resolve: bool) -> list[IPAddress]:
    """The addresses of a host name or IP literal (`[v6]` too); with `resolve`, what a name
    resolves to here, looked up once a minute; [] for what names none."""
    return _addresses_of(name, resolve=resolve)


def _addresses_of(name: str, *, resolve: bool) -> list[IPAddress]:
    if not name:
        return []
    try:
        return [ipaddress.ip_address(name.strip("[]"))]
    except ValueError:
        pass
    if not resolve:
        return []
    # Every host check asks for every host's name: one lookup per name a minute, not per
    # check (a fleet of N hosts would otherwise make N x N lookups each round).
    return list(_resolved(name, int(time.monotonic() // 60)))


@functools.lru_cache(maxsize=4096)
def _resolved(name: str, minute: int) -> tuple[IPAddress, ...]:
    try:
        return tuple(addresses.resolve(name, 0))
    except (OSError, UnicodeError):
        return ()  # a name that resolves to nothing here covers nothing we can tell


def overlaps(host: Host) -> list[str]:
    """For operators, one line per engine network (bridge or overlay, ours or not) whose
    subnet covers a protected address (protected_addresses). Raises EngineError."""
    protected = protected_addresses(host)
    lines = []
    try:
        networks = engine.cached_client(host).networks.list()
    except Exception as exc:  # requests/urllib3/ssl/OS errors too: the engine did not answer
        raise engine.EngineError(engine.describe(exc)) from exc
    for net in sorted(networks, key=lambda n: n.name):
        for config in (net.attrs.get("IPAM") or {}).get("Config") or []:
            try:
                subnet = ipaddress.ip_network(config.get("Subnet") or "", strict=False)
            except ValueError:
                continue
            covered = [f"{what} {ip}" for what, ip in protected if ip in subnet]
            if covered:
                lines.append(
                    f"network {net.name} ({subnet}) overlaps the hosts' own networks: it "
                    f"covers {', '.join(dict.fromkeys(covered))}; remove it, and give the "
                    "engine a --default-address-pool off those ranges"
                )
    return lines

"""A host joins the fleet with one command, and leaves it with another (jobs/hosts/scripts/join.sh).

The security model, in full:

- **Who may start a join.** An operator holding `jobs.add_host` makes a join token on
  *Hosts -> Add*. The token (`<key>.<secret>`, 12 + 43 characters from `secrets`) is shown
  once; the console keeps the SHA-256 of its secret only. It is used once, within
  `SUANLI_JOIN_TOKEN_S` (1 h). A token that is unknown, malformed, expired or used gets one
  and the same answer (`Refused`), so an answer never tells whether a token existed; the
  secret is compared in constant time (`hmac.compare_digest`, against a dummy digest where
  there is no row), and each refusal counts against the caller's address like a wrong
  password (django-axes, console/auth.py: `AXES_FAILURE_LIMIT` locks it).
- **What a token buys.** Using it (`begin`) gives the host a credential of its own, made
  here, kept on the host root-only (`/etc/suanli/host.credential`) and here as its SHA-256:
  the rest of the join, its failure reports and a later `leave` use it. A newer join of the
  same host, or its leave, revokes it.
- **Which address.** The host's address must be the one its request comes from (the
  request's REMOTE_ADDR, which uvicorn sets from `SUANLI_TRUSTED_PROXIES` only), or, for a
  host behind NAT, the address the operator wrote on the token. So a token holder cannot
  point the console at a machine that is not theirs. Two hosts never share an address.
- **New hosts only, unless the maker may change hosts.** A join of a name the fleet has
  already would change that host (its zone, GPUs, engine certificate and credential: the
  host's real credential ends), so it needs a token whose maker holds `jobs.change_host`
  as well as `jobs.add_host`, checked when the token is used. Likewise a NAT token's
  address (which skips the source check) may not be a host's of the fleet nor the control
  plane's (the addresses the settings name for the console, PostgreSQL, Redis, the
  registry and MooseFS, jobs/hosts/proofs.py control_plane, and any loopback address) unless
  its maker may change hosts. Otherwise anyone with `jobs.add_host` alone could take an
  existing host over from anywhere, with a certificate the CA signed for its address.
  A host that left the fleet is not in it: joining under its name is a new host.
- **Certificates.** The host makes its engine key and sends a CSR; the console signs it with
  its CA (jobs/hosts/pki.py) for the host's address only (SAN), serverAuth only, whatever the CSR
  asked; the CA key never leaves the console. The console makes its own client key for the
  engine (clientAuth only) and stores it with the Host, encrypted. Nobody pastes PEM.
- **What the host gets.** Its certificate, the CA's, the swarm's manager address and worker
  join token (read from a manager's engine), the researchers' filesystem's master and
  mount path, and the helper images (a `docker save` of the canary and sftp images from a
  host that has them, streamed through the console): nothing else of the console's.
- **Tenants.** A researcher's container cannot reach the join endpoints on a private
  network (the tenant firewall refuses the private ranges, jobs/hosts/scripts/host-firewall.sh);
  where the console is public they reach it like anyone on the internet, with the same
  refusals: the token is the credential, and a tenant never holds one. A tenant's request
  leaves its host through NAT with the host's address, so the address check alone would
  not stop it; the token and the host's credential (root-only on the host) do.

Layer: hosts, over services, proofs and pki; uses them, nodes (engine), events (lifecycle),
files (storage), models and base (queue, validators, text).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
from collections.abc import Iterator
from datetime import timedelta

import docker
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from jobs.base import validators
from jobs.base.queue import enqueue_by_name
from jobs.base.text import Moment, Text, fit, show
from jobs.events import lifecycle
from jobs.files import storage
from jobs.hosts import pki, proofs
from jobs.hosts import services as host_services
from jobs.models import GpuModel, GpuSlot, Host, HostJoin, Node, Replica
from jobs.nodes import engine

log = logging.getLogger(__name__)

REFUSED = (
    "This join token or host credential is not valid: it expired, was used already, or was "
    "never made. Make a new token on the console's Hosts -> Add page."
)
ENGINE_PORT = 2376
SWARM_PORT = 2377
_DUMMY = hashlib.sha256(b"suanli: no such join").hexdigest()
STEPS = (
    "preflight", "engine", "gpus", "tls", "sign", "dockerd", "firewall", "swarm", "storage",
    "images", "register", "check", "leave", "drain", "swarm-leave", "left",
)  # fmt: skip


class Refused(Exception):
    """No valid token or credential: the one answer that says nothing more (REFUSED)."""


class Invalid(Exception):
    """A valid token or credential, and a request the console does not do; says why."""


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _split(text: object) -> tuple[str, str] | None:
    if not isinstance(text, str) or len(text) > 80:
        return None
    key, dot, secret = text.strip().partition(".")
    if not dot or len(key) != 12 or not (20 <= len(secret) <= 64):
        return None
    if not all(c in "0123456789abcdef" for c in key):
        return None
    return key, secret


def _find(text: object, field: str) -> HostJoin | None:
    """The join whose `field` (digest or host_digest) is the SHA-256 of the secret in
    `text`; compared in constant time, a dummy digest standing in for a missing row."""
    parts = _split(text)
    key, secret = parts or ("", "-")
    join = HostJoin.objects.filter(key=key).first() if parts else None
    expected = getattr(join, field, "") or _DUMMY
    same = hmac.compare_digest(_digest(secret), expected)
    return join if (same and join is not None and expected != _DUMMY) else None


def by_token(token: object) -> HostJoin:
    """The unused, unexpired join of `token`; Refused otherwise."""
    join = _find(token, "digest")
    if join is None or join.used_at is not None or join.expires_at <= timezone.now():
        raise Refused(REFUSED)
    return join


def by_credential(credential: object) -> HostJoin:
    join = _find(credential, "host_digest")
    if join is None:
        raise Refused(REFUSED)
    return join


# -- who may change a host ------------------------------------------------------------


def may_change_hosts(user) -> bool:
    """Whether a token `user` made may join a host the fleet has already (that changes
    it), or name a taken address: `jobs.change_host`, held now (an inactive or deleted
    maker holds nothing)."""
    return user is not None and user.is_active and user.has_perm("jobs.change_host")


def address_claim(address: str) -> tuple[Host | None, Text | None]:
    """Who has `address` already: (the host of the fleet at it, None), (None, what of the
    control plane listens there), or (None, None) when it is free."""
    host = Host.objects.filter(address=address).first()
    if host is not None:
        return host, None
    ip = ipaddress.ip_address(address)
    if ip.is_loopback or ip.is_unspecified:
        return None, Text(gettext_noop("this console's own machine"))
    return None, proofs.control_plane_addresses().get(str(ip))


def token_refusal(*, by, address: str | None) -> str:
    """Why `by` may not make a token for a host behind NAT at `address` ('' when they may):
    the address is a host's of the fleet, or the control plane's, and `by` may not change
    hosts. In the reader's language (the Hosts -> Add form)."""
    if not address or may_change_hosts(by):
        return ""
    host, what = address_claim(address)
    if host is not None:
        return _(
            "%(address)s is the address of host %(host)s: a token for it would join that host "
            "again, which changes it. That needs the power to change hosts (jobs.change_host)."
        ) % {"address": address, "host": host.name}
    if what is not None:
        return _(
            "%(address)s is an address of the control plane (%(what)s): a host there needs a "
            "token made by an operator who may change hosts (jobs.change_host)."
        ) % {"address": address, "what": show(what.as_json())}
    return ""


# -- the operator's side -------------------------------------------------------------


def token_create(
    *,
    by,
    zone: str,
    gpu_model: GpuModel | None = None,
    gpu_count: int = 0,
    build_host: bool = False,
    address: str | None = None,
) -> tuple[HostJoin, str]:
    """A join token (shown once: only its digest is kept) and its row. ValidationError
    (on `address`) when `by` may not make one for that address (token_refusal)."""
    address = str(ipaddress.ip_address(address)) if address else None
    why = token_refusal(by=by, address=address)
    if why:
        raise ValidationError({"address": why})
    key, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    join = HostJoin.objects.create(
        key=key,
        digest=_digest(secret),
        created_by=by,
        expires_at=timezone.now() + timedelta(seconds=settings.SUANLI_JOIN_TOKEN_S),
        zone=zone,
        gpu_model=gpu_model,
        gpu_count=gpu_count if gpu_model else 0,
        build_host=build_host,
        address=address or None,
    )
    return join, f"{key}.{secret}"


def token_revoke(*, join: HostJoin) -> bool:
    """An operator takes back a token nobody used yet: it is refused from now on."""
    return bool(
        HostJoin.objects.filter(pk=join.pk, used_at__isnull=True).update(
            expires_at=timezone.now(), step="revoked", updated_at=timezone.now()
        )
    )


def recent(*, hours: int = 24) -> list[HostJoin]:
    """Joins and leaves of the last hours for the Hosts page: waiting tokens, joins under
    way and how each ended; tokens that expired unused go after an hour."""
    now = timezone.now()
    rows = list(
        HostJoin.objects.filter(created_at__gte=now - timedelta(hours=hours))
        .exclude(used_at__isnull=True, expires_at__lt=now - timedelta(hours=1))
        .select_related("host", "gpu_model", "created_by")[:50]
    )
    for join in rows:
        join.expired = join.expires_at <= now
    return rows


# -- the host's side -----------------------------------------------------------------


def _ip(text: object, what: str) -> str:
    try:
        return str(ipaddress.ip_address(str(text or "").strip()))
    except ValueError:
        raise Invalid(f"{what} {str(text)[:60]!r} is not an IP address") from None


def _source_ok(join: HostJoin, address: str, source: str | None) -> None:
    """The host's address is where its request comes from, or the token's (NAT)."""
    if join.address:
        if address != join.address:
            raise Invalid(
                f"this token is for the host at {join.address}, and this host says it is "
                f"{address}: run it there, or make a token for {address}"
            )
        return
    if source is None or address != _ip(source, "the request's address"):
        raise Invalid(
            f"this host says its address is {address} but its request comes from {source}: "
            f"join with SUANLI_JOIN_ADDRESS={source}, or (behind NAT) make a token for the "
            f"address {address} on Hosts -> Add"
        )


def _nat_ok(join: HostJoin, address: str, *, may_change: bool) -> None:
    """A NAT token (its address is not checked against the request's) names no address of
    the control plane unless its maker may change hosts (a host's: _collisions)."""
    if not join.address or may_change:
        return
    _, what = address_claim(address)
    if what is not None:
        raise Invalid(
            f"this token's address {address} is the control plane's ({what}): a host there "
            "needs a token made by an operator who may change hosts (jobs.change_host)"
        )


def _live_nodes(host: Host):
    """The nodes that keep a host: running, or stopped with their workspaces kept on it."""
    return Node.objects.filter(host=host).filter(
        Q(released_at__isnull=True) | Q(stopped_at__isnull=False, kept_until__isnull=True)
    )


def _collisions(name: str, address: str, *, may_change: bool) -> None:
    other = Host.objects.filter(address=address).exclude(name=name).first()
    if other is not None:
        raise Invalid(
            f"the address {address} is host {other.name} already: run `join.sh leave` there "
            f"first, or, to update that host, join with SUANLI_JOIN_NAME={other.name} and a "
            "token made by an operator who may change hosts (jobs.change_host)"
        )
    same = Host.all_objects.filter(name=name).first()
    if same is not None and same.state != Host.State.LEFT and not may_change:
        raise Invalid(
            f"host {name} is in the fleet already, and joining it again changes it (its zone, "
            "GPUs, engine certificate and credential): that needs a token made by an operator "
            "who may change hosts (jobs.change_host); for a new host, pick another name "
            "(SUANLI_JOIN_NAME)"
        )
    if same is not None and same.address != address and _live_nodes(same).exists():
        raise Invalid(
            f"host {name} is at {same.address} and keeps clusters (running, or stopped with "
            "their workspaces kept there): pick another name (SUANLI_JOIN_NAME), or leave the "
            "fleet there first"
        )


def _swarm_offer() -> tuple[str, str]:
    """(manager address:port, worker join token) from the first swarm manager among the
    hosts that answers; ("", "") where none does (the host joins no swarm)."""
    managers = Host.objects.filter(swarm_manager=True, swarm_state="active").exclude(
        state__in=Host.UNHEALTHY
    )
    for host in managers:
        try:
            client = engine.client_for(host)
            try:
                client.swarm.reload()
                token = client.swarm.attrs["JoinTokens"]["Worker"]
                swarm = client.info().get("Swarm") or {}
            finally:
                client.close()
        except Exception as exc:  # a manager that does not answer now: the next one
            log.warning("swarm manager %s gave no join token: %s", host.name, exc)
            continue
        node = swarm.get("NodeID")
        addrs = [
            m.get("Addr") for m in swarm.get("RemoteManagers") or [] if m.get("NodeID") == node
        ]
        return (addrs[0] if addrs and addrs[0] else f"{host.address}:{SWARM_PORT}"), token
    return "", ""


def _storage_offer() -> dict[str, str]:
    found = storage.master() if storage.enforced() else None
    if found is None:
        return {"storage_master": "", "storage_port": "", "storage_path": ""}
    return {
        "storage_master": found[0],
        "storage_port": str(found[1]),
        "storage_path": str(settings.SUANLI_STORAGE_MOUNT or settings.SUANLI_STORAGE_ROOT),
    }


def helper_images() -> list[str]:
    """The images the gateway and the host check need on every host."""
    return list(dict.fromkeys([settings.SUANLI_CANARY_IMAGE, settings.SUANLI_SFTP_IMAGE]))


def join_begin(
    *, token: object, name: object, address: object, source: str | None, csr: object
) -> dict[str, str]:
    """Use the token: check the host's name, address and CSR, sign its engine certificate
    and hand it what it needs to join. The token is used only when all of that is in
    order, so a host that says the wrong thing can try again with the same token."""
    join = by_token(token)
    name = str(name or "").strip().lower()
    try:
        validators.validate_host_name(name)
    except ValidationError as exc:
        raise Invalid(f"the host name {name[:70]!r}: {exc.messages[0]}") from None
    address = _ip(address, "the host's address")
    _source_ok(join, address, source)
    may_change = may_change_hosts(join.created_by)
    _nat_ok(join, address, may_change=may_change)
    try:
        request = pki.read_csr(str(csr or ""))
    except pki.BadRequest as exc:
        raise Invalid(str(exc)) from None
    _collisions(name, address, may_change=may_change)
    manager, swarm_token = _swarm_offer()
    credential = f"{join.key}.{secrets.token_urlsafe(32)}"
    now = timezone.now()
    used = HostJoin.objects.filter(pk=join.pk, used_at__isnull=True, expires_at__gt=now).update(
        used_at=now,
        kind=HostJoin.Kind.JOIN,
        host_name=name,
        host_address=address,
        host_digest=_digest(credential.split(".", 1)[1]),
        step="sign",
        error="",
        updated_at=now,
    )
    if not used:  # another request used it a moment ago
        raise Refused(REFUSED)
    return {
        "credential": credential,
        "name": name,
        "address": address,
        "cert": pki.sign_engine(request, name=name, address=address),
        "ca": pki.authority().cert_pem,
        "engine_port": str(ENGINE_PORT),
        "swarm_manager": manager,
        "swarm_token": swarm_token,
        **_storage_offer(),
        "images": " ".join(helper_images()),
    }


def _gpus(join: HostJoin, *, count: int, name: str) -> tuple[GpuModel | None, int]:
    """The host's GPU model and count: what nvidia-smi found (the token's model, or the
    catalog's model of that name), else the token's emulated GPUs."""
    if count <= 0:
        return join.gpu_model, join.gpu_count if join.gpu_model else 0
    if join.gpu_model is not None:
        return join.gpu_model, count
    # "NVIDIA A100-SXM4-80GB" is the catalog's "A100 80 GB": every word of the catalog's
    # name is in what nvidia-smi says.
    said = name.lower()
    fits = [
        m for m in GpuModel.objects.all()
        if all(word in said for word in m.name.lower().replace("nvidia", "").split())
    ]  # fmt: skip
    if len(fits) == 1:
        return fits[0], count
    raise Invalid(
        f"the host has {count} x {name[:80]}, and no GPU model of the catalog is called so: "
        "add it to the catalog, or pick the model on a new token"
    )


def _int(value: object, what: str, most: int) -> int:
    try:
        number = int(str(value or "0").strip())
    except ValueError:
        raise Invalid(f"{what} {str(value)[:20]!r} is not a number") from None
    if not 0 <= number <= most:
        raise Invalid(f"{what} {number} is not between 0 and {most}")
    return number


def join_register(
    *, credential: object, source: str | None, gpu_count: object = 0, gpu_name: object = ""
) -> Host:
    """The host's engine listens with its certificate: the console makes the Host (or
    updates the one of that name) with its own client certificate, and queues its check."""
    join = by_credential(credential)
    if join.kind != HostJoin.Kind.JOIN:
        raise Invalid("this credential is of a host that is leaving; join with a new token")
    _source_ok(join, join.host_address, source)
    may_change = may_change_hosts(join.created_by)
    _nat_ok(join, join.host_address, may_change=may_change)
    model, count = _gpus(
        join, count=_int(gpu_count, "the GPU count", 64), name=str(gpu_name or "")[:200]
    )
    with transaction.atomic():
        _collisions(join.host_name, join.host_address, may_change=may_change)
        host = Host.all_objects.select_for_update().filter(name=join.host_name).first()
        host = host or Host(name=join.host_name)
        cert, key = pki.console_client(host_name=host.name)
        ip = ipaddress.ip_address(join.host_address)
        where = f"[{ip}]" if ip.version == 6 else str(ip)
        host.engine_url = f"tcp://{where}:{ENGINE_PORT}"
        host.tls_ca, host.tls_cert, host.tls_key = pki.authority().cert_pem, cert, key
        host.address = join.host_address
        host.zone = join.zone
        host.gpu_model, host.gpu_count = model, count
        host.build_host = host.build_host or join.build_host
        if host.state == Host.State.LEFT:
            host.state, host.drain_requested = Host.State.DOWN, False
        host.last_checked = None  # "checking" on the Hosts page until its check says more
        for field, value in lifecycle.host_error_fields("").items():
            setattr(host, field, value)  # the previous check's reasons, both ways, go
        try:
            host_services.host_save(host=host)
        except ValidationError as exc:
            raise Invalid("; ".join(exc.messages)) from None
        now = timezone.now()
        HostJoin.objects.filter(pk=join.pk).update(
            host=host, step="register", error="", updated_at=now
        )
        # One credential per host: the newest join's.
        HostJoin.objects.filter(Q(host=host) | Q(host_name=host.name)).exclude(pk=join.pk).update(
            host_digest=""
        )
    enqueue_by_name("jobs.tasks.host_check", host.pk, job_id=f"host-check-{host.pk}")
    return host


def join_report(*, token: object = None, credential: object = None, step: object, error: object):
    """A step of join.sh failed (or, with an empty error, went on): kept for the Hosts
    page. A token is not used up by reporting with it."""
    join = by_token(token) if token else by_credential(credential)
    step = fit(HostJoin, "step", step or "")
    HostJoin.objects.filter(pk=join.pk).update(
        step=step if step in STEPS else "other",
        error=fit(HostJoin, "error", str(error or "").replace("\x00", "")),
        updated_at=timezone.now(),
    )


def host_status(*, credential: object) -> dict[str, str]:
    """What the console's check made of the host: join.sh waits for it."""
    join = by_credential(credential)
    host = Host.all_objects.filter(pk=join.host_id).first()
    if host is None:
        return {"state": "unregistered", "checked": "no", "error": "", "name": join.host_name}
    return {
        "name": host.name,
        "state": host.state,
        "checked": "yes" if host.last_checked else "no",
        "error": host.last_error,
        "swarm": host.swarm_state,
        "emulated_gpu": "yes" if host.emulated_gpu else "no",
        "gpus": str(host.gpu_count),
    }


# -- leaving -------------------------------------------------------------------------


def leave_begin(
    *, token: object = None, credential: object = None, name: object = "", source: str | None
) -> tuple[HostJoin, str]:
    """Start a host's leave: drained at once (no new placements). With a token (one made
    on Hosts -> Add) the host is found by its name and the request's address; with its own
    credential, it is the host that credential joined. Returns the join that follows the
    leave and the credential to follow it with."""
    if token:
        join = by_token(token)
        name = str(name or "").strip().lower()
        host = Host.objects.filter(name=name).first()
        if host is None or source is None or host.address != _ip(source, "the request's address"):
            raise Invalid(
                f"no host named {name[:63]!r} at {source} in the fleet: run leave on the host "
                "itself, with its name (SUANLI_JOIN_NAME)"
            )
        credential = f"{join.key}.{secrets.token_urlsafe(32)}"
        now = timezone.now()
        used = HostJoin.objects.filter(pk=join.pk, used_at__isnull=True, expires_at__gt=now)
        if not used.update(
            used_at=now, kind=HostJoin.Kind.LEAVE, host=host, host_name=host.name,
            host_address=host.address, host_digest=_digest(credential.split(".", 1)[1]), step="leave",
            error="", updated_at=now,
        ):  # fmt: skip
            raise Refused(REFUSED)
        join.refresh_from_db()
    else:
        join = by_credential(credential)
        host = Host.objects.filter(pk=join.host_id).first()
        if host is None:
            raise Invalid(f"{join.host_name} is not a host of the fleet (it left, or never joined)")
        _source_ok(join, join.host_address, source)
        HostJoin.objects.filter(pk=join.pk).update(
            kind=HostJoin.Kind.LEAVE, step="leave", error="", updated_at=timezone.now()
        )
    host_services.host_set_draining(host=host, draining=True)
    return join, str(credential)


def leave_progress(*, credential: object) -> dict[str, str]:
    """What still keeps the leaving host: its live nodes (running, or stopped with their
    workspaces kept) and GPUs not yet given back."""
    join = by_credential(credential)
    host = Host.objects.filter(pk=join.host_id).first()
    if join.kind != HostJoin.Kind.LEAVE or host is None:
        raise Invalid("this host is not leaving: run `join.sh leave` first")
    live = _live_nodes(host).select_related("cluster")
    clusters = sorted({f"{n.cluster.name} (#{n.cluster_id})" for n in live})
    held = GpuSlot.objects.filter(host=host, node__isnull=False).count()
    return {
        "nodes": str(len(live)),
        "clusters": ", ".join(clusters)[:1000],
        "gpus_held": str(held),
        "empty": "yes" if not live and not held else "no",
    }


def leave_done(*, credential: object, source: str | None) -> str:
    """The host left the swarm: the console takes its node out of the swarm's list and
    the host out of the fleet (deleted when it never ran a node, else kept as state *left*
    for its nodes' history). Its credential ends here. Returns a note for the host."""
    join = by_credential(credential)
    host = Host.objects.filter(pk=join.host_id).first()
    if join.kind != HostJoin.Kind.LEAVE or host is None:
        raise Invalid("this host is not leaving: run `join.sh leave` first")
    _source_ok(join, join.host_address, source)
    if leave_progress(credential=credential)["empty"] != "yes":
        raise Invalid("clusters still run on this host: wait for them to end, then leave again")
    note = _swarm_forget(host)
    now = timezone.now()
    engine.forget_client(host)
    with transaction.atomic():
        host = Host.objects.select_for_update().get(pk=host.pk)
        HostJoin.objects.filter(Q(host=host) | Q(host_name=host.name)).update(host_digest="")
        HostJoin.objects.filter(pk=join.pk).update(step="left", error="", finished_at=now)
        if Node.objects.filter(host=host).exists() or Replica.objects.filter(host=host).exists():
            GpuSlot.objects.filter(host=host).delete()
            left = Text(
                gettext_noop("left the fleet at %(at)s"), at=Moment(now, "%Y-%m-%d %H:%M:%S")
            )
            Host.objects.filter(pk=host.pk).update(
                state=Host.State.LEFT, drain_requested=False, gpu_count=0,
                **lifecycle.host_error_fields(left),
            )  # fmt: skip
        else:
            host.delete()
    return note


def _swarm_forget(host: Host) -> str:
    """Remove the left host's node from the swarm's list (a manager's API): '' when done
    or there was none, else why not."""
    managers = Host.objects.filter(swarm_manager=True, swarm_state="active").exclude(pk=host.pk)
    last = ""
    for manager in managers:
        try:
            client = engine.client_for(manager)
            try:
                for node in client.nodes.list():
                    if (node.attrs.get("Status") or {}).get("Addr") == host.address:
                        node.remove(force=True)
            finally:
                client.close()
            return ""
        except (docker.errors.DockerException, engine.EngineError, OSError) as exc:
            last = engine.describe(exc)
            continue
    return f"its swarm node was not removed from the managers' list: {last}" if managers else ""


def image_export(*, credential: object, image: object) -> Iterator[bytes]:
    """`docker save` of a helper image from a host of the fleet that has it, for the
    joining host to `docker load`. Raises Invalid when no host has it."""
    join = by_credential(credential)
    if join.kind != HostJoin.Kind.JOIN or join.host_id is not None:
        raise Invalid("helper images are for a host while it joins, before it registers")
    if image not in helper_images():
        raise Invalid(f"{str(image)[:100]!r} is not one of the helper images")
    for host in Host.objects.filter(state=Host.State.ACTIVE).exclude(pk=join.host_id):
        try:
            client = engine.client_for(host, timeout=max(settings.SUANLI_ENGINE_TIMEOUT, 60))
        except engine.EngineError:
            continue
        try:
            found = client.images.get(str(image))
        except Exception:  # no such image there, or the engine did not answer: the next
            client.close()
            continue
        return _streamed(client, found.save(named=True))
    raise Invalid(f"no active host has {image}: load it on this host by hand (docker load)")


def _streamed(client, chunks) -> Iterator[bytes]:
    try:
        yield from chunks
    finally:
        client.close()

"""Checks on what operators and researchers type, with messages that say what to write.

Layer: base, the bottom of jobs/. Uses only addresses (which addresses are public) and text
(words kept to be shown later): models (and the migrations) use it, so it must not use them.
"""

import base64
import hashlib
import ipaddress
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed25519, rsa
from django.conf import settings
from django.core.exceptions import ValidationError
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop, ngettext

from jobs.base.addresses import IPAddress, NotAnAddress, ip_literal, is_local_name, resolve, unwrap
from jobs.base.addresses import why_not_public as _why_not_public
from jobs.base.text import Text, show

_HOST_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")
# Docker's reference grammar, simplified: [registry[:port]/]path[:tag][@digest].
_IMAGE_REF = re.compile(
    r"^(?:(?P<registry>[a-zA-Z0-9.-]+(?::[0-9]{1,5})?)/)?"
    r"(?P<path>[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?"
    r"(?:@(?P<digest>sha256:[a-f0-9]{64}))?$"
)
UNIX_HINT = "unix:///var/run/docker.sock"
TCP_HINT = "tcp://gpu-host-1.example.com:2376"


def validate_host_name(value: str) -> None:
    if not _HOST_NAME.match(value or ""):
        raise ValidationError(
            _(
                "Use lower-case letters, digits and dashes (e.g. gpu-a100-01), at most 63 characters."
            )
        )


def _is_hostname(value: str) -> bool:
    if not value or len(value) > 253:
        return False
    return all(_DNS_LABEL.match(label) for label in value.rstrip(".").split("."))


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def validate_address(value: str) -> None:
    if not (_is_ip(value) or _is_hostname(value)):
        raise ValidationError(
            _(
                "Give a host name or an IP address other hosts can reach, e.g. 10.0.0.12 or "
                "gpu-01.lan."
            )
        )


def validate_engine_url(value: str) -> str:
    """Return "unix" or "tcp" for a well-formed engine URL, else raise with what to write."""
    value = (value or "").strip()
    if "\x00" in value or any(ch.isspace() for ch in value):
        raise ValidationError(_("The engine URL may not contain spaces or control characters."))
    if value.startswith("unix://"):
        path = value[len("unix://") :]
        if not path.startswith("/"):
            raise ValidationError(
                _("A unix socket needs an absolute path, e.g. %(hint)s.") % {"hint": UNIX_HINT}
            )
        if "/../" in path + "/" or "/./" in path + "/" or "//" in path:
            raise ValidationError(
                _("Write the socket path plainly, without '..' or '//', e.g. %(hint)s.")
                % {"hint": UNIX_HINT}
            )
        return "unix"
    if value.startswith("tcp://"):
        try:
            parts = urlsplit(value)
            port = parts.port
        except ValueError:
            raise ValidationError(
                _("The port must be a number from 1 to 65535, e.g. %(hint)s.") % {"hint": TCP_HINT}
            ) from None
        if (
            parts.path not in ("", "/")
            or parts.query
            or parts.fragment
            or parts.username
            or parts.password
        ):
            raise ValidationError(_("Give only host and port, e.g. %(hint)s.") % {"hint": TCP_HINT})
        host = parts.hostname or ""
        if not (_is_ip(host) or _is_hostname(host)):
            raise ValidationError(
                _("'%(host)s' is not a host name or IP address; e.g. %(hint)s.")
                % {"host": host or value, "hint": TCP_HINT}
            )
        if port is None or not 1 <= port <= 65535:
            raise ValidationError(
                _("Give the engine's TLS port, usually 2376: %(hint)s.") % {"hint": TCP_HINT}
            )
        return "tcp"
    raise ValidationError(
        _("Use %(unix)s for the local engine or %(tcp)s (with TLS) for a remote one.")
        % {"unix": UNIX_HINT, "tcp": TCP_HINT}
    )


def validate_pem_certificate(value: str) -> None:
    try:
        x509.load_pem_x509_certificates(value.strip().encode())
    except ValueError:
        raise ValidationError(
            _(
                "This is not a PEM certificate: paste the whole file, from "
                "-----BEGIN CERTIFICATE----- to -----END CERTIFICATE-----."
            )
        ) from None


def _private_key(value: str):
    return serialization.load_pem_private_key(value.strip().encode(), password=None)


def validate_pem_private_key(value: str) -> None:
    try:
        _private_key(value)
    except TypeError:
        raise ValidationError(_("This key is encrypted: give the unencrypted PEM key.")) from None
    except ValueError:
        raise ValidationError(
            _(
                "This is not a PEM private key: paste the whole key file, from "
                "-----BEGIN ... PRIVATE KEY-----."
            )
        ) from None


def validate_key_matches_cert(key_pem: str, cert_pem: str) -> None:
    if not key_pem.strip() or not cert_pem.strip():
        return
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.strip().encode())
        key = _private_key(key_pem)
    except (ValueError, TypeError):
        return  # each field reports its own parse error
    fmt = serialization.PublicFormat.SubjectPublicKeyInfo
    enc = serialization.Encoding.DER
    if cert.public_key().public_bytes(enc, fmt) != key.public_key().public_bytes(enc, fmt):
        raise ValidationError(_("This key does not belong to the client certificate above."))


_IMAGE_ID = re.compile(r"(sha256:)?[0-9a-f]{1,64}")


_OWN_IMAGE_NAME = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_OWN_IMAGE_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


def validate_own_image_name(value: str) -> None:
    if len(value or "") > 64 or not _OWN_IMAGE_NAME.match(value or ""):
        raise ValidationError(
            _(
                "Use lower-case letters and digits, with single dots, dashes or underscores "
                "between them (e.g. my-pytorch), at most 64 characters."
            )
        )


def validate_own_image_tag(value: str) -> None:
    if not _OWN_IMAGE_TAG.match(value or ""):
        raise ValidationError(
            _(
                "A tag is letters, digits, dots, dashes and underscores, not starting with a dot "
                "or dash (e.g. v1 or 2024-06-01), at most 64 characters."
            )
        )


# A published dataset's or model's name: its folder under /pub, one simple path component
# (never hidden, never `..`), the same characters as a storage folder's.
_DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def validate_dataset_name(value: str) -> None:
    if not _DATASET_NAME.fullmatch(value or ""):
        raise ValidationError(
            _(
                "'%(name)s' is not a folder name for /pub: use letters, digits, '.', '_' and "
                "'-', starting with a letter or digit, at most 64 characters (e.g. imagenet-1k)."
            )
            % {"name": (value or "")[:80]}
        )


def validate_image_reference(value: str) -> None:
    value = (value or "").strip()
    if len(value) > 255 or not _IMAGE_REF.match(value):
        raise ValidationError(
            _(
                "Not a Docker image reference: write it as name:tag, e.g. "
                "pytorch/pytorch:2.4.0-cuda12.1-cudnn9-runtime."
            )
        )
    reserved = getattr(settings, "SUANLI_SFTP_IMAGE", "")
    if reserved and image_repository(value) == image_repository(reserved):
        raise ValidationError(
            _(
                "%(repository)s is the image of Suanli's own file transfer (sftp), which "
                "clusters may not run, whatever the tag; pick another image."
            )
            % {"repository": image_repository(reserved)}
        )
    if _IMAGE_ID.fullmatch(value.lower()):
        # The engine takes a bare hex string (or sha256:...) as an image ID prefix: it
        # could name any image on the host, another researcher's saved workspace included.
        raise ValidationError(
            _(
                "Name an image by its repository and tag (e.g. pytorch/pytorch:2.4.0), not by "
                "an image ID."
            )
        )
    if image_repository(value).startswith("docker.io/suanli-keep/"):
        # A stopped workspace's saved filesystem (jobs/nodes/workspaces.py, KEEP_REPOSITORY):
        # another researcher's files, never an image a cluster may name.
        raise ValidationError(
            _(
                "suanli-keep/ images are workspaces saved by Suanli, not images clusters may run; "
                "pick another image."
            )
        )
    if names_own_image(value):
        # A researcher's own image (`<registry>/u<id>/...`): only the console's choice of
        # the owner's own images names one (console/forms.py resolves those first), never a
        # typed reference nor the catalog.
        raise ValidationError(
            _(
                "%(repository)s is a researcher's own image in Suanli's registry, usable by its "
                "owner only (who picks it under Your images)."
            )
            % {"repository": image_repository(value)}
        )
    if why := registry_refusal(value):
        raise ValidationError(why)


def validate_custom_image_reference(value: str, *, not_pulled: Iterable[str] = ()) -> None:
    """An image reference a researcher types (the cluster form's custom image, the API):
    `validate_image_reference`, and neither Suanli's own `suanli/` namespace on Docker Hub
    nor a catalog image that hosts never pull (`not_pulled`: their references). Those are
    put on hosts by an operator; typed, the engine would pull whatever Docker Hub has under
    that name, and the pulled tag would pass for the catalog's on that host."""
    validate_image_reference(value)
    repository = image_repository(value)
    if repository.startswith("docker.io/suanli/") or any(
        image_repository(ref) == repository for ref in not_pulled
    ):
        raise ValidationError(
            _(
                "%(repository)s is a name of Suanli's own images (suanli/...), which are never "
                "pulled from a registry: pick it from the image list, or name another image."
            )
            % {"repository": repository}
        )


_DOCKER_HUB = ("docker.io", "index.docker.io", "registry-1.docker.io")
_OWN_NAMESPACE = re.compile(r"u[0-9]+")


def _a_port(text: str) -> bool:
    """ASCII digits: "²".isdigit() is true, and int() refuses it (a 500 on the form)."""
    return text.isascii() and text.isdigit() and len(text) <= 5


def _without_port(registry: str) -> str:
    host, _, port = registry.rpartition(":")
    return host if host and _a_port(port) else registry


def _our_registry() -> str:
    """SUANLI_REGISTRY as references start: `host[:port]` or `host[:port]/project`; ""."""
    return (getattr(settings, "SUANLI_REGISTRY", "") or "").strip().strip("/").lower()


def split_port(registry: str) -> tuple[str, int | None]:
    """(host, port) of a registry's `host[:port]`; port None when it names none."""
    host, _, port = registry.rpartition(":")
    return (host, int(port)) if host and _a_port(port) else (registry, None)


def _registry_addresses(host: str) -> list[IPAddress]:
    """The addresses an engine reaches for a registry's host: an IP literal in any spelling
    a resolver accepts (`127.1`, `0x7f.1`, `2130706433`), the loopback for `localhost` and
    `*.localhost` with or without the final dot, else what the name resolves to here ([]
    when nothing: the engine cannot pull from it either)."""
    if is_local_name(host):
        return [ipaddress.IPv4Address("127.0.0.1"), ipaddress.IPv6Address("::1")]
    try:
        literal = ip_literal(host, bracketed=False)
    except NotAnAddress:
        return []
    if literal is not None:
        return [unwrap(literal[0])]
    try:
        return [unwrap(ip) for ip in resolve(host, 443)]
    except (OSError, UnicodeError):
        return []


def _one_place(a: IPAddress, b: IPAddress) -> bool:
    """Two addresses that reach the same server: equal, or both the loopback (127.0.0.0/8
    and ::1 are all this machine)."""
    return a == b or (a.is_loopback and b.is_loopback)


def _same_server(named: str, ours: str) -> bool:
    """Two registries' `host[:port]` name one server: the same port, and an address in
    common (by address, not by spelling: `localhost:5000` is `127.0.0.1:5000`)."""
    (host, port), (our_host, our_port) = split_port(named), split_port(ours)
    if port != our_port or named == "docker.io":
        return False
    mine = _registry_addresses(our_host)
    return any(_one_place(a, b) for a in _registry_addresses(host) for b in mine)


def _in_registry(value: str) -> list[str] | None:
    """The path components of a reference into Suanli's registry (SUANLI_REGISTRY: host,
    or host/project as on Harbor) under it: on any port of its host as spelled
    (`registry.example.com` and `registry.example.com:443` are one server), or at any
    spelling of its address and port (`localhost:5000` for 127.0.0.1:5000); None for any
    other reference."""
    registry = _our_registry()
    if not registry:
        return None
    host, *prefix = registry.split("/")
    named, *path = image_repository(value).split("/")
    if path[: len(prefix)] != prefix:
        return None
    if _without_port(named) != _without_port(host) and not _same_server(named, host):
        return None
    return path[len(prefix) :]


def registry_refusal(value: str) -> str | None:
    """Why an engine may not pull `value`: its registry is on the loopback, a link-local,
    private or otherwise not public address, or a name that resolves to one (the hosts' own
    networks: their services, the console's, a metadata service), other than Suanli's own
    registry spelled as SUANLI_REGISTRY spells it and the registries an operator names in
    SUANLI_PULL_ALLOW_REGISTRIES (a mirror on the LAN). None when it may."""
    named = image_repository(value).partition("/")[0]
    ours = _our_registry().partition("/")[0]
    allowed = {r.strip().lower() for r in getattr(settings, "SUANLI_PULL_ALLOW_REGISTRIES", [])}
    if named in _DOCKER_HUB or named == ours or named in allowed:
        return None
    host, _port = split_port(named)
    for ip in _registry_addresses(host):
        why = _why_not_public(ip)
        if why is None:
            continue
        if ours and _same_server(named, ours):
            return _(
                "%(registry)s is Suanli's own registry written another way: name its images "
                "as %(ours)s/..., as Your images shows them."
            ) % {"registry": named, "ours": ours}
        return _(
            "%(registry)s is %(why)s (%(address)s), on the hosts' own networks: clusters "
            "pull images from public registries only (and from Suanli's own, under Your "
            "images)."
        ) % {"registry": named, "why": _(why), "address": ip}
    public = [r.strip().lower() for r in getattr(settings, "SUANLI_PULL_REGISTRIES", []) if r]
    if named not in public:
        # A registry the researcher names is a server the engine contacts from the host:
        # its name could resolve elsewhere for the host than here (split or rebinding DNS),
        # its token realm or redirects could point into the hosts' networks. So only the
        # public registries the operator lists.
        return _(
            "%(registry)s is not among the registries clusters pull from: Docker Hub, "
            "%(registries)s, and Suanli's own (Your images). Ask an operator to add it."
        ) % {"registry": named, "registries": ", ".join(public) or "-"}
    return None


def names_registry(value: str) -> bool:
    """The reference names an image of Suanli's registry (see _in_registry)."""
    return _in_registry(value) is not None


def names_own_image(value: str) -> bool:
    """The reference names a researcher's own image: `<registry>/u<digits>/...`."""
    path = _in_registry(value)
    return bool(path) and bool(_OWN_NAMESPACE.fullmatch(path[0]))


def image_repository(value: str) -> str:
    """The repository an image reference names, as the engine resolves it, without tag or
    digest: `suanli/sftp:latest`, `docker.io/suanli/sftp` and `suanli/sftp@sha256:...` are
    all `docker.io/suanli/sftp`; `busybox` is `docker.io/library/busybox`."""
    name = (value or "").strip().partition("@")[0]
    head, _, last = name.rpartition("/")
    last = last.partition(":")[0]  # a tag (a registry's port is in `head`)
    name = f"{head}/{last}" if head else last
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, path = first.lower(), rest
    else:
        registry, path = "docker.io", name
    if registry in _DOCKER_HUB:
        registry = "docker.io"
        if "/" not in path:
            path = f"library/{path}"
    return f"{registry}/{path.lower()}"


def parse_ssh_public_key(text: str) -> dict:
    """Parse an OpenSSH public key line; return its type, bits and SHA256 fingerprint."""
    line = " ".join((text or "").split())
    parts = line.split(" ")
    if len(parts) < 2 or not parts[0]:
        raise ValidationError(
            _(
                "Paste one public key line, e.g. 'ssh-ed25519 AAAAC3Nza... you@laptop' (from "
                "~/.ssh/id_ed25519.pub)."
            )
        )
    try:
        key = serialization.load_ssh_public_key(f"{parts[0]} {parts[1]}".encode())
        blob = base64.b64decode(parts[1], validate=True)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ValidationError(
            _(
                "This is not an OpenSSH public key. Paste the contents of your .pub file "
                "(ssh-ed25519, ecdsa-sha2-nistp256/384/521 or ssh-rsa)."
            )
        ) from None
    if isinstance(key, dsa.DSAPublicKey):
        raise ValidationError(
            _("DSA keys are no longer safe; use an ed25519 key (ssh-keygen -t ed25519).")
        )
    if isinstance(key, rsa.RSAPublicKey):
        bits = key.key_size
        if bits < 2048:
            raise ValidationError(
                _("This RSA key has %(bits)s bits; use at least 2048 (or ssh-keygen -t ed25519).")
                % {"bits": bits}
            )
    elif isinstance(key, ec.EllipticCurvePublicKey):
        bits = key.curve.key_size
    elif isinstance(key, ed25519.Ed25519PublicKey):
        bits = 256
    else:
        raise ValidationError(_("Use an ed25519, ecdsa or rsa (2048+ bits) key."))
    digest = base64.b64encode(hashlib.sha256(blob).digest()).decode().rstrip("=")
    return {
        "key_type": parts[0],
        "bits": bits,
        "fingerprint": f"SHA256:{digest}",
        "public_key": f"{parts[0]} {parts[1]}"
        + (f" {' '.join(parts[2:])}" if len(parts) > 2 else ""),
        "comment": " ".join(parts[2:]),
    }


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
# The platform's own variables (distributed setup, GPUs): a job's env may not set them.
RESERVED_ENV_PREFIXES = ("SUANLI_", "NCCL_", "NVIDIA_")
RESERVED_ENV = frozenset(
    {
        "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "NODE_RANK", "NNODES", "NPROC_PER_NODE",
        "LOCAL_WORLD_SIZE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "HOME", "PATH", "HOSTNAME",
        "LD_PRELOAD", "LD_LIBRARY_PATH",
    }
)  # fmt: skip


# A job's declared total of steps (jobs/runs/progress.py reads it for the pace): on its
# SUANLI_METRIC lines ("total_steps") or in its environment, the one SUANLI_ name it may set.
TOTAL_STEPS_ENV = "SUANLI_TOTAL_STEPS"
MAX_STEP = 2**31 - 1  # a reported step: Optuna keeps a step in a 32-bit column (sweeps)
MAX_TOTAL_STEPS = MAX_STEP


def total_steps_problem(value, *, text: bool = True) -> Text | None:
    """None when `value` is a usable total of steps (a whole number from 1 to
    MAX_TOTAL_STEPS; with `text`, a string of digits too, as SUANLI_TOTAL_STEPS is); else
    why not, in words (a Text: shown in the reader's language)."""
    shown = repr(value)[:40] if not isinstance(value, str) else value[:40]
    if isinstance(value, str):
        if not text:
            return Text(
                gettext_noop("total steps must be a number, not text (%(value)s)"), value=shown
            )
        digits = value.strip()
        if digits.lstrip("-").isascii() and digits.lstrip("-").isdigit() and len(digits) < 40:
            value = int(digits)
        else:
            return Text(
                gettext_noop("total steps must be a whole number of steps, not %(value)s"),
                value=shown or '""',
            )
    if isinstance(value, bool) or not isinstance(value, int | float):
        return Text(
            gettext_noop("total steps must be a whole number of steps, not %(value)s"),
            value=shown,
        )
    if isinstance(value, float):  # 1000.5, NaN, inf; 1e3 and 1000.0 too: write 1000
        return Text(
            gettext_noop("total steps must be a whole number of steps, not %(value)s"),
            value=shown,
        )
    if value < 1:
        return Text(gettext_noop("total steps must be 1 or more, not %(value)s"), value=value)
    if value > MAX_TOTAL_STEPS:
        return Text(
            gettext_noop("total steps must be at most %(most)s, not %(value)s"),
            most=MAX_TOTAL_STEPS, value=shown,
        )  # fmt: skip
    return None


def _assignment_words(what: str, number: int, name: str, most: int) -> tuple[str, str]:
    """The two sentences of parse_assignments that name what its names are: a bad name on
    line `number`, and more than `most` of them."""
    values = {"number": number, "name": name, "most": most}
    if what == "argument":
        bad = _(
            "Line %(number)s: '%(name)s' is not an argument name (letters, digits, _; not "
            "starting with a digit)."
        )
        many = ngettext("At most %(most)s argument.", "At most %(most)s arguments.", most)
    else:
        bad = _(
            "Line %(number)s: '%(name)s' is not a variable name (letters, digits, _; not "
            "starting with a digit)."
        )
        many = ngettext("At most %(most)s variable.", "At most %(most)s variables.", most)
    return bad % values, many % values


def parse_assignments(
    text: str, *, what: str, example: str, refuse=None, most: int = 200
) -> dict[str, str]:
    """KEY=VALUE lines (blank lines and # comments skipped), each name a `what` (variable,
    argument) checked, each given once; `refuse(name, value)` may give a reason to refuse one.
    ValidationError with one sentence per bad line."""
    found: dict[str, str] = {}
    errors: list[str] = []
    for number, raw in enumerate((text or "").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        reason = refuse(name, value.strip()) if refuse and sep and _ENV_NAME.match(name) else ""
        if not sep:
            errors.append(
                _("Line %(number)s: write KEY=VALUE, e.g. %(example)s.")
                % {"number": number, "example": example}
            )
        elif not _ENV_NAME.match(name):
            errors.append(_assignment_words(what, number, name, most)[0])
        elif reason:
            errors.append(_("Line %(number)s: %(reason)s") % {"number": number, "reason": reason})
        elif "\x00" in value or len(value) > 4096:
            errors.append(
                _("Line %(number)s: the value of %(name)s is too long or contains NUL.")
                % {"number": number, "name": name}
            )
        elif name in found:
            errors.append(
                _("Line %(number)s: %(name)s is set twice.") % {"number": number, "name": name}
            )
        else:
            found[name] = value
    if len(found) > most:
        errors.append(_assignment_words(what, 0, "", most)[1])
    if errors:
        raise ValidationError(errors)
    return found


def parse_env(text: str) -> dict[str, str]:
    """KEY=VALUE lines. Names are checked; the platform's own names are refused, but for
    SUANLI_TOTAL_STEPS (the job's total steps, for its projected finish), checked."""

    def reserved(name: str, value: str) -> str:
        if name == TOTAL_STEPS_ENV:
            why = total_steps_problem(value)
            return "" if why is None else f"{name}: {show(why.as_json())}"
        if name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES):
            return _(
                "%(name)s is set by Suanli itself (distributed setup, GPUs); pick another name."
            ) % {"name": name}
        return ""

    return parse_assignments(text, what="variable", example="LR=3e-4", refuse=reserved)

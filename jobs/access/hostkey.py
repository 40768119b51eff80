"""The SSH gateway's host key on disk (`SUANLI_SSH_HOST_KEY`, and its .pub beside it), as the
console's pages show it: `SHA256:...`, what `ssh` shows on a first login. The gateway makes
the key when it starts (jobs/access/ssh.py, host_key); every other process only reads it,
the .pub where it may not read the private half.

Imports no asyncssh (the web process imports this): the fingerprint is SHA-256 over the
key's SSH wire form, as asyncssh's and OpenSSH's, read from the .pub's base64 or, without
a .pub, from the private key through `cryptography`.

Layer: access, the bottom of it; uses nothing of Suanli's.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import logging
import os
import secrets
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from django.conf import settings

log = logging.getLogger("suanli.gateway")

NO_HOST_KEY = "none yet: the SSH gateway makes its host key when it first starts"


def public_path(path: Path) -> Path:
    return path.with_name(path.name + ".pub")


def fingerprint(public_data: bytes) -> str:
    """`SHA256:<base64, unpadded>` of a key's SSH wire form, as `ssh` shows it."""
    digest = base64.b64encode(hashlib.sha256(public_data).digest()).decode("ascii")
    return "SHA256:" + digest.rstrip("=")


def public_data(text: bytes) -> bytes:
    """The SSH wire form of the key in an OpenSSH public key line (`type base64 [comment]`);
    ValueError for anything else."""
    for line in text.decode("ascii", errors="replace").splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) < 2:
            break
        try:
            blob = base64.b64decode(fields[1], validate=True)
        except binascii.Error:
            break
        kind = fields[0].encode()
        if blob[:4] == len(kind).to_bytes(4, "big") and blob[4 : 4 + len(kind)] == kind:
            return blob
        break
    raise ValueError("not an OpenSSH public key")


def _private_public_data(data: bytes) -> bytes:
    """The SSH wire form of the public half of an unencrypted private key (OpenSSH's own
    format or PEM); ValueError for anything else."""
    try:
        if b"OPENSSH PRIVATE KEY" in data:
            key = serialization.load_ssh_private_key(data, password=None)
        else:
            key = serialization.load_pem_private_key(data, password=None)
        line = key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
    except (TypeError, UnsupportedAlgorithm) as exc:
        raise ValueError(f"not a private key Suanli reads: {exc}") from None
    return public_data(line)


_fingerprints: dict[tuple, str] = {}


def host_key_fingerprint() -> str:
    """`SHA256:...` of the gateway's host key, as `ssh` shows it on a first login. Only
    reads the key (its .pub where this process may not read the private half); NO_HOST_KEY
    while there is none yet. OSError or ValueError when it cannot be read."""
    path = Path(settings.SUANLI_SSH_HOST_KEY)
    for candidate, read in ((public_path(path), public_data), (path, _private_public_data)):
        try:
            found = candidate.stat()
        except FileNotFoundError:
            continue
        stamp = (str(candidate), found.st_mtime_ns, found.st_size)
        known = _fingerprints.get(stamp)
        if known is None:
            known = _fingerprints[stamp] = fingerprint(read(candidate.read_bytes()))
        return known
    return NO_HOST_KEY


def write_public(path: Path, text: bytes) -> None:
    """The .pub beside the key (0644: it is public), so that the console's processes can
    show the fingerprint without reading the private half. Replaced whole when it is not
    this key's (`text`, the key's OpenSSH public line)."""
    public = public_path(path)
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

"""Researchers' storage: one root per tenant (a shared filesystem in production), the
folders in it that volumes mount, and the checks that keep a mount inside it.

Layout (docs/architecture.md, "The Docker contract": mounts): `SUANLI_STORAGE_ROOT/u<id>/` belongs to the console (root,
0711) and is never writable by the tenant; in it the console makes the tenant's storage
folders (`workspace`, `datasets`, ... : one simple name each), owned by the tenant's
container uid (0700). A volume mounts exactly one such folder. So every component of a bind
source is one that no tenant can rename or swap for a symbolic link between our check and
the engine's mount; what the tenant can change lies inside the mounted folder, where the
container sees it anyway. A sub-folder (`datasets/imagenet`) is not a bind source: its
parent is the tenant's, who could swap it for a link to `/` while the engine resolves it.
Researchers mount the folder and use the sub-folder inside the container.

The guarantee needs the console to run as root (it owns the tenant roots and hands the
folders to the tenants' uids). Run as another user (a developer's machine), the roots and
folders belong to that user, which no container uid is, so the check still holds; only the
containers cannot write their folders then.

Quotas: each tenant's root holds at most its quota, the free part
(SUANLI_STORAGE_FREE_GB) plus what the researcher bought (models.StorageGrant), and at most
SUANLI_STORAGE_FILES_MAX files and folders. With SUANLI_STORAGE_FS = "moosefs" the
filesystem enforces both: a hard length and a hard inode quota on the root (`mfssetquota -L
-I`), so a write or a new file past them fails in the container with EDQUOT ("Disk quota
exceeded"); usage is the filesystem's count (`mfsdirinfo`). `quota_apply` writes it, reading
the bought size under a per-researcher advisory lock that billing's change of the size holds
too (so a start racing a lowering never leaves the filesystem above the bill): when the root
is made, when the bought size changes, when a cluster is created or started, and every hour
(`upkeep`), never per container. The root's trash time is 0 (files inherit it): a deleted
file frees its room at once instead of waiting, outside every quota, in the trash. A file
deleted while still open ("sustained") is outside every quota until it is closed; `upkeep`
reports the filesystem's sustained space to the operators when it passes
SUANLI_STORAGE_SUSTAINED_MAX_GB. With "local" (`make run`: a folder of one machine) nothing
enforces it and usage is a walk of the folder, stopped after SUANLI_STORAGE_WALK_MAX entries.

Layer: files, under nodes (runtime mounts its folders); uses models (the bought storage) and
base (validators).
"""

import logging
import os
import posixpath
import re
import stat
import subprocess
from dataclasses import dataclass, field
from datetime import datetime
from decimal import Decimal, InvalidOperation
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured, ValidationError
from django.db import connection, transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from jobs.base import validators
from jobs.models import StorageGrant

EXAMPLE = "/workspace/data"
# Container paths a volume may never cover: the image's own system, the kernel's
# interfaces, and anything that would hand the container the engine.
SYSTEM_PATHS = (
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc",
    "/root", "/run", "/sbin", "/sys", "/usr", "/var/run", "/var/lib/docker", "/var/lib",
)  # fmt: skip
# A storage folder's name: one path component the console makes, never hidden, never `..`.
FOLDER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")
ROOT_MODE = 0o711  # the console's; the tenant's uid may pass through to its own folders
FOLDER_MODE = 0o700  # the tenant's
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VolumeSpec:
    source: str
    target: str
    read_only: bool = False

    def __str__(self) -> str:
        return f"{self.source}:{self.target}{':ro' if self.read_only else ''}"


def tenant_root(user_id: int) -> Path:
    return Path(settings.SUANLI_STORAGE_ROOT) / f"u{user_id}"


def validate_target(target: str, *, allow_system: bool = False) -> str:
    if not target:
        raise ValidationError(
            _("Give the path inside the container, e.g. %(example)s.") % {"example": EXAMPLE}
        )
    if "\x00" in target or any(ch.isspace() for ch in target):
        raise ValidationError(_("Container paths may not contain spaces or control characters."))
    if not target.startswith("/"):
        raise ValidationError(
            _(
                "'%(path)s' is relative: container paths must be absolute. Write %(example)s instead."
            )
            % {"path": target, "example": EXAMPLE}
        )
    if ".." in target.split("/"):
        raise ValidationError(
            _("'%(path)s' contains '..': write the absolute path, e.g. %(example)s.")
            % {"path": target, "example": EXAMPLE}
        )
    # normpath keeps two leading slashes (POSIX leaves `//` to the implementation), so
    # `//etc` would pass for a path beside /etc: collapse them first, as the engine does.
    normal = posixpath.normpath("/" + target.lstrip("/"))
    if allow_system:
        return normal  # e.g. a working directory: the path is only read, not mounted
    if normal == "/":
        raise ValidationError(
            _("A volume cannot cover the whole container (/): mount it at %(example)s.")
            % {"example": EXAMPLE}
        )
    for system in SYSTEM_PATHS:
        if normal == system or normal.startswith(system + "/"):
            raise ValidationError(
                _(
                    "'%(path)s' is a system path of the container; mount your data under "
                    "/workspace, e.g. %(example)s."
                )
                % {"path": normal, "example": EXAMPLE}
            )
    return normal


def folder_name(source: str, *, target: str = "", read_only: bool = False) -> str:
    """The storage folder a volume line names, checked as text: one simple name. A
    sub-folder is refused with the line to write instead (`target` makes it exact)."""
    if not source:
        raise ValidationError(_("Give one of your storage folders, e.g. datasets."))
    if "\x00" in source or any(ch.isspace() for ch in source):
        raise ValidationError(_("Storage paths may not contain spaces or control characters."))
    if source.startswith("/"):
        raise ValidationError(
            _("'%(path)s' is absolute: name one of your storage folders instead, e.g. datasets.")
            % {"path": source}
        )
    if ".." in source.split("/"):
        raise ValidationError(
            _("'%(path)s' contains '..': storage paths stay inside your storage.")
            % {"path": source}
        )
    normal = posixpath.normpath(source)
    if normal == ".":
        raise ValidationError(
            _(
                "A volume mounts one of your storage folders (e.g. workspace), not your whole "
                "storage."
            )
        )
    if "/" in normal:
        top, _sep, rest = normal.partition("/")
        where = target or EXAMPLE
        line = f"{top}:{where}{':ro' if read_only else ''}"
        raise ValidationError(
            _(
                "'%(path)s' is a sub-folder: a volume mounts one whole storage folder, so that "
                "nothing on the way can be swapped for a link. Mount %(line)s instead and use "
                "%(inside)s inside the container."
            )
            % {"path": normal, "line": line, "inside": posixpath.join(where, rest)},
            code="sub_folder",
        )
    if not FOLDER_NAME.fullmatch(normal):
        raise ValidationError(
            _(
                "'%(name)s' is not a storage folder name: use letters, digits, '.', '_' and '-' "
                "(at most 64), not starting with '.' or '-'."
            )
            % {"name": normal}
        )
    return normal


def validate_source(root: Path, source: str, *, target: str = "", read_only: bool = False) -> str:
    """A volume's source as the form checks it: a folder name (see `folder_name`) that is
    not already a symbolic link or a file in the tenant's storage. The last word is
    `ensure_folders`, at creation and again at each start."""
    name = folder_name(source, target=target, read_only=read_only)
    try:
        found = os.lstat(root / name)
    except OSError:
        return name  # made when the cluster is created
    if stat.S_ISLNK(found.st_mode):
        raise ValidationError(_link_message(name))
    if not stat.S_ISDIR(found.st_mode):
        raise ValidationError(
            _("'%(name)s' is a file in your storage, not a folder.") % {"name": name}
        )
    return name


def _link_message(name: str) -> str:
    # Only the layout before this one let a tenant plant a link here; the tenant can no
    # longer remove it.
    return _(
        "'%(name)s' in your storage is a symbolic link, not a folder: mount a real folder, "
        "or ask an operator to remove the link."
    ) % {"name": name}


def parse_volumes(text: str, *, root: Path) -> list[VolumeSpec]:
    """One volume per line: `storage-folder:/container/path[:ro]`."""
    specs: list[VolumeSpec] = []
    numbers: list[int] = []  # each spec's line
    errors: list[str] = []
    seen: set[str] = set()
    for number, raw in enumerate((text or "").splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(":")
        read_only = False
        if len(parts) == 3 and parts[2] in ("ro", "rw"):
            read_only = parts[2] == "ro"
            parts = parts[:2]
        if len(parts) != 2:
            errors.append(
                _(
                    "Line %(number)s: write storage-path:container-path[:ro], e.g. "
                    "datasets:%(example)s:ro."
                )
                % {"number": number, "example": EXAMPLE}
            )
            continue
        try:
            target = validate_target(parts[1].strip())
            source = validate_source(root, parts[0].strip(), target=target, read_only=read_only)
        except ValidationError as exc:
            errors.append(
                _("Line %(number)s: %(error)s") % {"number": number, "error": exc.messages[0]}
            )
            continue
        if target in seen:
            errors.append(
                _("Line %(number)s: %(path)s is mounted twice.")
                % {"number": number, "path": target}
            )
            continue
        seen.add(target)
        specs.append(VolumeSpec(source=source, target=target, read_only=read_only))
        numbers.append(number)
    errors += _inside_read_only(specs, numbers)
    if len(specs) > 16:
        errors.append(_("At most %(most)s volumes per cluster.") % {"most": 16})
    if errors:
        raise ValidationError(errors)
    return specs


def _inside_read_only(specs: list[VolumeSpec], numbers: list[int]) -> list[str]:
    """A volume whose path lies inside a read-only one cannot be mounted: the engine must
    make its mount point in a folder it may not write (the container would never start)."""
    errors = []
    for spec, number in zip(specs, numbers, strict=True):
        for outer in specs:
            if outer.read_only and spec.target.startswith(outer.target.rstrip("/") + "/"):
                errors.append(
                    _(
                        "Line %(number)s: %(path)s is inside the read-only volume %(outer)s, "
                        "where its mount point cannot be made: mount it beside it (e.g. "
                        "%(beside)s) or make %(outer)s writable."
                    )
                    % {
                        "number": number,
                        "path": spec.target,
                        "outer": outer.target,
                        "beside": "/" + spec.target.rstrip("/").rsplit("/", 1)[-1],
                    }
                )
                break
    return errors


def _require_console_owned(found: os.stat_result, uid: int | None, base: str = "") -> None:
    """Only the console (root, or the user it runs as) may change this directory: the
    storage root `base`, else the tenant's root."""
    if (
        found.st_uid not in (0, os.geteuid())
        or found.st_uid == uid
        or found.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    ):
        args = {"path": base, "uid": found.st_uid, "mode": f"{stat.S_IMODE(found.st_mode):o}"}
        raise ValidationError(
            _(
                "The storage root %(path)s can be changed by others than the console (owner "
                "uid %(uid)s, mode %(mode)s); ask an operator."
            )
            % args
            if base
            else _(
                "Your storage root can be changed by others than the console (owner uid "
                "%(uid)s, mode %(mode)s); ask an operator."
            )
            % args
        )


def ensure_folders(root: Path, specs, *, uid: int | None = None, quota: bool = False) -> list[str]:
    """Make the tenant's root and its volumes' folders where missing, and check every
    directory on the way to each folder; returns the paths to hand the engine, in order.

    The root becomes the console's (root:root 0711, repairing the layout before, where the
    tenant owned it); as root, a new folder is the tenant's (`uid`, 0700). Refused
    (ValidationError): a sub-folder or any source that is not one folder name, a folder
    that is a symbolic link or a file, a storage root or tenant root that someone other
    than the console could change. Nothing is resolved through a link: the tenant root is
    opened without following one, the folders are looked at with lstat through it. Run at
    creation and again just before each start: what it returns stays true until the
    engine mounts it, because no tenant can write any directory on the way. The root's
    quota (`quota_apply`) is written when the root is made, or with `quota` (a cluster's
    creation or start, a change of the bought size): not for every container."""
    names = []
    for spec in specs:
        try:
            # "" is how the layout before stored `.`: the whole root.
            source = spec.source or "."
            names.append(folder_name(source, target=spec.target, read_only=spec.read_only))
        except ValidationError as exc:
            raise ValidationError(
                _("volume %(volume)s: %(error)s") % {"volume": spec, "error": exc.messages[0]}
            ) from None
    as_root = os.geteuid() == 0
    base = os.path.realpath(root.parent)  # the operator's path: links in it are the operator's
    os.makedirs(base, exist_ok=True)
    base_fd = os.open(base, _DIR)
    try:
        _require_console_owned(os.fstat(base_fd), uid, base)
        try:
            os.mkdir(root.name, ROOT_MODE, dir_fd=base_fd)
            quota = True  # a new root: its quota and trash time before anything is in it
        except FileExistsError:
            pass
        try:
            fd = os.open(root.name, _DIR | os.O_NOFOLLOW, dir_fd=base_fd)
        except OSError:  # ELOOP (a link), ENOTDIR (a file)
            raise ValidationError(
                _("Your storage root is not a folder (a symbolic link?); ask an operator.")
            ) from None
    finally:
        os.close(base_fd)
    try:
        found = os.fstat(fd)
        if as_root and (found.st_uid, found.st_gid) != (0, 0):
            os.fchown(fd, 0, 0)  # the layout before: the tenant owned its root
        if stat.S_IMODE(found.st_mode) != ROOT_MODE and (as_root or found.st_uid == os.geteuid()):
            os.fchmod(fd, ROOT_MODE)
        _require_console_owned(os.fstat(fd), uid)
        owner_id = _owner_of(root)
        if quota and owner_id is not None and enforced():
            quota_apply(owner_id, Path(base) / root.name)
        paths = []
        for spec, name in zip(specs, names, strict=True):
            try:
                os.mkdir(name, FOLDER_MODE if as_root else 0o755, dir_fd=fd)
                if as_root and uid is not None:
                    os.chown(name, uid, uid, dir_fd=fd, follow_symlinks=False)
            except FileExistsError:
                pass
            found = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(found.st_mode):
                raise ValidationError(
                    _("volume %(volume)s: %(error)s")
                    % {"volume": spec, "error": _link_message(name)}
                )
            if not stat.S_ISDIR(found.st_mode):
                raise ValidationError(
                    _("volume %(volume)s: '%(name)s' is a file in your storage, not a folder.")
                    % {"volume": spec, "name": name}
                )
            paths.append(os.path.join(base, root.name, name))
        return paths
    finally:
        os.close(fd)


# Names a training script writes while a checkpoint is not complete yet: never resume from one.
PARTIAL_SUFFIXES = (".tmp", ".partial", ".part", ".incomplete")
# The folder of the jobs' profiler traces, at the top of the checkpoint volume:
# `suanli-profiles/job-<id>/attempt-<n>` (SUANLI_PROFILE_DIR). Never a checkpoint.
PROFILE_FOLDER = "suanli-profiles"
# Without a writable volume the traces stay in the container (and end with it).
PROFILE_FALLBACK = "/tmp/suanli-profiles"  # noqa: S108 (the container's own /tmp)
TRACE_SUFFIXES = (".json", ".json.gz")
TRACE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
MAX_TRACE_FILES = 500
MAX_SCANNED = 5000  # entries of a profile folder looked at, whatever they are


def covering_volume(volumes, container_path: str):
    """The volume whose target holds `container_path` most closely (as the engine resolves
    mounts), or None: then what is written there lives in the container and dies with it."""
    best, best_len = None, -1
    for volume in volumes:
        target = volume.target.rstrip("/")
        if (container_path == target or container_path.startswith(target + "/")) and len(
            target
        ) > best_len:
            best, best_len = volume, len(target)
    return best


def host_path(root: Path, volumes, container_path: str) -> Path | None:
    """Where a container path lives in the tenant's storage (resolved), through the volume
    that covers it most closely; None when no
    volume covers it (it lives in the container and dies with it) or when it resolves
    outside the tenant's storage (a symbolic link)."""
    best = covering_volume(volumes, container_path)
    if best is None:
        return None
    rest = container_path[len(best.target.rstrip("/")) :].lstrip("/")
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, best.source, rest))
    if real != real_root and not real.startswith(real_root + os.sep):
        return None
    return Path(real)


def _open_folder(root: Path, volumes, container_path: str) -> int | None:
    """A descriptor of the tenant's folder behind `container_path`, opened one component at
    a time from the tenant's root without following links, so a link planted after
    `host_path`'s check leads nowhere; None when there is no such real folder."""
    folder = host_path(root, volumes, container_path)
    if folder is None:
        return None
    real_root = os.path.realpath(root)
    parts = [p for p in os.path.relpath(folder, real_root).split(os.sep) if p not in ("", ".")]
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(real_root, flags)
    except OSError:
        return None
    try:
        for part in parts:
            child = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = child
    except OSError:
        os.close(fd)
        return None  # not made yet, or not a real folder
    return fd


def newest_checkpoint(root: Path, volumes, checkpoint_dir: str, *, not_before=None) -> str | None:
    """The container path of the newest checkpoint (file or folder, by modification time)
    directly in the checkpoint directory, or None. Hidden names, partial writes, symbolic
    links, names the database cannot hold, the console's profile folder and entries older
    than `not_before` (another job's, in a shared folder) are skipped. The folder is opened
    one component at a time without following links (`_open_folder`)."""
    oldest = not_before.timestamp() if not_before is not None else None
    best: tuple[float, str] | None = None
    fd = _open_folder(root, volumes, checkpoint_dir)
    if fd is None:
        return None
    try:
        for entry in os.scandir(fd):
            name = entry.name
            if name.startswith(".") or name.endswith(PARTIAL_SUFFIXES) or entry.is_symlink():
                continue
            if name == PROFILE_FOLDER:
                continue
            try:
                name.encode("utf-8")
                mtime = entry.stat(follow_symlinks=False).st_mtime
            except (UnicodeEncodeError, OSError):
                continue
            if oldest is not None and mtime < oldest:
                continue
            if best is None or (mtime, name) > best:
                best = (mtime, name)
    except OSError:
        return None  # not made yet (the first attempt wrote nothing), or not a real folder
    finally:
        os.close(fd)
    if best is None:
        return None
    path = posixpath.join(checkpoint_dir.rstrip("/") or "/", best[1])
    return path if len(path) <= 1024 else None


def profile_base(volumes, checkpoint_dir: str) -> tuple[str, bool]:
    """The folder holding the jobs' SUANLI_PROFILE_DIRs, and whether it is on the tenant's
    storage: on the volume holding the checkpoint directory, else the first writable volume,
    else in the container (lost with it)."""
    volumes = [v for v in volumes if not v.read_only]
    volume = covering_volume(volumes, checkpoint_dir) or (volumes[0] if volumes else None)
    if volume is None:
        return PROFILE_FALLBACK, False
    return posixpath.join(volume.target.rstrip("/") or "/", PROFILE_FOLDER), True


def profile_dir(volumes, checkpoint_dir: str, job_id: int, attempt: int) -> tuple[str, bool]:
    """SUANLI_PROFILE_DIR of a job's attempt (`profile_base`/job-<id>/attempt-<n>)."""
    base, on_storage = profile_base(volumes, checkpoint_dir)
    return posixpath.join(base, f"job-{job_id}", f"attempt-{attempt}"), on_storage


@dataclass(frozen=True)
class TraceFile:
    name: str
    size: int
    mtime: float


def trace_files(root: Path, volumes, container_dir: str) -> list[TraceFile]:
    """The trace files (`*.json`, `*.json.gz`: regular files, not links) directly in a
    profile folder, oldest first, at most MAX_TRACE_FILES among its first MAX_SCANNED
    entries; none when it is not there."""
    fd = _open_folder(root, volumes, container_dir)
    if fd is None:
        return []
    found: list[TraceFile] = []
    try:
        for scanned, entry in enumerate(os.scandir(fd)):
            if scanned >= MAX_SCANNED:
                break  # a folder of millions of entries costs one bounded read, not a scan
            if not TRACE_NAME.fullmatch(entry.name) or not entry.name.endswith(TRACE_SUFFIXES):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                found.append(TraceFile(entry.name, info.st_size, info.st_mtime))
    except OSError:
        return []
    finally:
        os.close(fd)
    found.sort(key=lambda f: (f.mtime, f.name))
    return found[:MAX_TRACE_FILES]


def open_trace(root: Path, volumes, container_dir: str, name: str):
    """A trace file of a profile folder opened for reading (binary), or None: the name is
    one simple component, no component is followed through a link, and what is opened must
    be a regular file (never a fifo that would hang the reader, never a device)."""
    if not TRACE_NAME.fullmatch(name) or not name.endswith(TRACE_SUFFIXES):
        return None
    fd = _open_folder(root, volumes, container_dir)
    if fd is None:
        return None
    try:
        file_fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd
        )
    except OSError:
        return None
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(file_fd).st_mode):
        os.close(file_fd)
        return None
    return os.fdopen(file_fd, "rb")


# -- quotas -------------------------------------------------------------------------------

GB = 2**30  # what `du -h` and `df -h` call a G: the console's GB, bought and shown
_TENANT = re.compile(r"u([0-9]{1,18})")
MFS_TIMEOUT_S = 30


class QuotaError(ValidationError):
    """The filesystem refused to set or read a quota (its words in the message)."""


@dataclass(frozen=True)
class Usage:
    bytes: int
    complete: bool = True  # False: a walk that stopped at SUANLI_STORAGE_WALK_MAX entries
    files: int = 0  # files and folders under the root (what the inode quota counts)


def enforced() -> bool:
    """Whether the filesystem enforces the quotas (MooseFS), or the storage is a folder of
    one machine that nothing limits (`make run`)."""
    return settings.SUANLI_STORAGE_FS == "moosefs"


def free_gb() -> Decimal:
    """The free part of every researcher's quota, in GB (a fraction allowed)."""
    raw = str(settings.SUANLI_STORAGE_FREE_GB).strip()
    try:
        value = Decimal(raw)
    except InvalidOperation:
        value = Decimal(-1)
    if not value.is_finite() or value < 0:
        raise ImproperlyConfigured(f"SUANLI_STORAGE_FREE_GB={raw!r}: give GB, 0 or more")
    return value


def extra_gb(owner_id: int, *, at: datetime | None = None) -> int:
    """The GB bought above the free part in force at `at` (now)."""
    grant = (
        StorageGrant.objects.filter(owner_id=owner_id, since__lte=at or timezone.now())
        .order_by("-since")
        .values_list("extra_gb", flat=True)
        .first()
    )
    return grant or 0


def gb_bytes(gb: Decimal | int) -> int:
    return int(Decimal(gb) * GB)


def quota_bytes(owner_id: int) -> int:
    """The tenant's quota now: the free part plus what they bought."""
    return gb_bytes(free_gb() + extra_gb(owner_id))


def files_max() -> int:
    """How many files and folders one researcher's storage may hold (SUANLI_STORAGE_FILES_MAX):
    the MooseFS master keeps every file's metadata in RAM (about 300 bytes each)."""
    most = settings.SUANLI_STORAGE_FILES_MAX
    if not isinstance(most, int) or most < 1:
        raise ImproperlyConfigured(f"SUANLI_STORAGE_FILES_MAX={most!r}: give 1 or more files")
    return most


# pg_advisory_xact_lock(QUOTA_LOCK, owner): the one lock every quota write of an owner takes
# (`quota_apply`, billing.storage.quota_set), so the filesystem's quota is the bought size
# read by the last writer, never an older one that a slower writer read before a change.
QUOTA_LOCK = 0x5351  # "SQ"


def quota_lock(owner_id: int) -> None:
    """Hold the owner's quota lock until the current transaction ends (PostgreSQL; a
    one-writer SQLite of `make run` needs none)."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [QUOTA_LOCK, owner_id])


def quota_apply(owner_id: int, path: Path | None = None) -> bool:
    """Write the owner's quota on their root (MooseFS): the bought size read under
    `quota_lock`, the files' limit, and trash time 0 where the root has another. False when
    there is nothing to write (a local folder, no root yet)."""
    path = path or tenant_root(owner_id)
    if not enforced() or not os.path.isdir(path):
        return False
    with transaction.atomic():
        quota_lock(owner_id)
        quota_write(path, quota_bytes(owner_id), files_max())
        trash_off(path)
    return True


def _owner_of(root: Path) -> int | None:
    """The researcher whose root this is (`tenant_root`'s `u<id>`), or None."""
    match = _TENANT.fullmatch(root.name)
    return int(match.group(1)) if match else None


def _mfs(*args: str) -> str:
    try:
        done = subprocess.run(
            list(args), capture_output=True, text=True, timeout=MFS_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise QuotaError(
            _("The storage filesystem did not answer (%(error)s); ask an operator.")
            % {"error": exc}
        ) from None
    if done.returncode != 0:
        raise QuotaError(
            _("The storage filesystem refused %(command)s: %(error)s; ask an operator.")
            % {"command": args[0], "error": (done.stderr or done.stdout).strip()[:300]}
        )
    return done.stdout


def quota_write(path: Path, limit: int, files: int) -> None:
    """Hard quotas on the folder `path` (MooseFS): the sum of the files' lengths under it
    can never pass `limit` bytes, nor their number (files and folders) `files`."""
    _mfs("mfssetquota", "-n", "-I", str(int(files)), "-L", str(int(limit)), str(path))


def quota_read(path: Path, what: str = "length") -> int | None:
    """The hard quota on `path`: "length" in bytes, or "inodes" (files and folders); None
    when it has none."""
    for line in _mfs("mfsgetquota", "-n", str(path)).splitlines():
        cells = [c.strip() for c in line.split("|")]
        if cells[0] == what and len(cells) >= 4:
            return int(cells[3]) if cells[3].isdigit() else None
    return None


def trash_time(path: Path) -> int:
    """How long (seconds) a file deleted under `path` would stay in MooseFS's trash."""
    out = _mfs("mfsgettrashtime", "-n", str(path)).rpartition(":")[2].strip()
    if not out.isdigit():
        raise QuotaError(
            _("The storage filesystem answered %(answer)s; ask an operator.")
            % {"answer": out[:100]}
        )
    return int(out)


def trash_off(path: Path) -> None:
    """Trash time 0 on `path` and, the first time, on everything in it (new files inherit
    their folder's): a deleted file frees its room at once. In MooseFS's trash a file is in
    no folder, so no quota counts it, and a write-and-delete loop would fill the
    chunkservers."""
    if trash_time(path) != 0:
        _mfs("mfssettrashtime", "-n", "-r", "0", str(path))


def usage(owner_id: int) -> Usage:
    """What the tenant's storage holds: the filesystem's count of the files' lengths
    (MooseFS), or a walk of the folder that stops after SUANLI_STORAGE_WALK_MAX entries
    (a local folder). Nothing yet: 0."""
    root = tenant_root(owner_id)
    if not os.path.isdir(root):
        return Usage(0)
    if enforced():
        out = _mfs("mfsdirinfo", "-n", "-i", "-l", str(root)).split()
        if len(out) < 2 or not (out[0].isdigit() and out[1].isdigit()):
            raise QuotaError(
                _("The storage filesystem answered %(answer)s; ask an operator.")
                % {"answer": " ".join(out)[:100]}
            )
        return _counted(int(out[0]), int(out[1]))
    return _walk(root, settings.SUANLI_STORAGE_WALK_MAX)


def usages(owner_ids) -> dict[int, Usage]:
    """`usage` of many tenants at once (an operator's page): one `mfsdirinfo` for all."""
    out = {pk: Usage(0) for pk in owner_ids}
    present = {pk: str(tenant_root(pk)) for pk in out if os.path.isdir(tenant_root(pk))}
    if not present:
        return out
    if not enforced():
        return out | {
            pk: _walk(Path(root), settings.SUANLI_STORAGE_WALK_MAX) for pk, root in present.items()
        }
    counted = {}
    for line in _mfs("mfsdirinfo", "-n", "-i", "-l", *present.values()).splitlines():
        inodes, _tab, rest = line.partition("\t")
        length, _tab, path = rest.partition("\t")
        if inodes.isdigit() and length.isdigit():
            counted[path] = _counted(int(inodes), int(length))
    for pk, root in present.items():
        out[pk] = counted[root] if root in counted else Usage(0, complete=False)
    return out


def _counted(inodes: int, length: int) -> Usage:
    # mfsdirinfo counts the root itself; its inode quota counts what is under it.
    return Usage(length, files=max(0, inodes - 1))


def extra_gbs(owner_ids, *, at: datetime | None = None) -> dict[int, int]:
    """`extra_gb` of many researchers at once."""
    out = {pk: 0 for pk in owner_ids}
    seen = set()
    for owner_id, gb in (
        StorageGrant.objects.filter(owner_id__in=list(out), since__lte=at or timezone.now())
        .order_by("owner_id", "-since")
        .values_list("owner_id", "extra_gb")
    ):
        if owner_id not in seen:
            seen.add(owner_id)
            out[owner_id] = gb
    return out


_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_folder_nofollow(root: Path, name: str) -> int:
    """A descriptor of the folder `name` under `root` (both opened without following a
    link); OSError when either is not a folder or is a link."""
    base = os.open(str(root), _FOLDER)
    try:
        return os.open(name, _FOLDER, dir_fd=base)
    finally:
        os.close(base)


def walk_nofollow(top: int):
    """Every entry under the folder open at `top` (a descriptor this takes over), folders
    before what they hold, names in order: yields `(dir_fd, name, path, lstat)` with `path`
    relative to `top`. A link is never followed: folders are entered through descriptors
    opened with O_NOFOLLOW, so a name a tenant swaps for a link while the walk runs cannot
    lead it out. `dir_fd` stays open while the caller handles the entry (open `name` at it,
    never the path). Every descriptor is closed on every way out: the walk's end, an
    OSError, the caller's exception or `close()` (use `contextlib.closing`)."""
    stack = [(top, "")]
    try:
        while stack:
            dir_fd, prefix = stack.pop()
            try:
                for name in sorted(os.listdir(dir_fd)):
                    found = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    path = f"{prefix}{name}"
                    yield dir_fd, name, path, found
                    if stat.S_ISDIR(found.st_mode):
                        stack.append((os.open(name, _FOLDER, dir_fd=dir_fd), path + "/"))
            finally:
                os.close(dir_fd)
    finally:
        for dir_fd, _prefix in stack:
            os.close(dir_fd)


def _walk(root: Path, most: int) -> Usage:
    """The lengths of the regular files under `root`, links not followed, at most `most`
    entries looked at; folders it may not read are skipped."""
    total, seen, stack = 0, 0, [str(root)]
    while stack:
        try:
            entries = os.scandir(stack.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                seen += 1
                if seen > most:
                    return Usage(total, complete=False, files=most)
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
                except OSError:
                    continue
    return Usage(total, files=seen)


# -- what no quota counts, and the hourly upkeep ----------------------------------------------

_ORPHAN = re.compile(r"\./(SUSTAINED|TRASH) \((.*)\)")


@dataclass(frozen=True)
class Orphans:
    """Space in no folder, so under no quota (MooseFS, `mfscli -SIN`): "sustained", files
    deleted while a process still holds them open, and the trash. `by_owner`: how many such
    files each researcher's processes hold open now (`mfscli -SOF`, by the path the file
    had)."""

    sustained_bytes: int
    sustained_files: int
    trash_bytes: int
    by_owner: dict[int, int]

    @property
    def sustained_gb(self) -> Decimal:
        return (Decimal(self.sustained_bytes) / GB).quantize(Decimal("0.01"))

    @property
    def over(self) -> bool:
        return self.sustained_gb > Decimal(str(settings.SUANLI_STORAGE_SUSTAINED_MAX_GB))


MASTER_PORT = 9421  # MooseFS's clients' port, when SUANLI_STORAGE_MASTER names none


def master() -> tuple[str, int] | None:
    """(host, port) of SUANLI_STORAGE_MASTER, the MooseFS master's clients' address (an
    IPv6 literal without its brackets); None when it is not set. The one reading of it: the
    quota tools here, the join's offer (jobs/hosts/joins.py), the host check's targets
    (jobs/hosts/proofs.py)."""
    text = settings.SUANLI_STORAGE_MASTER.strip()
    if not text:
        return None
    host, port = validators.split_port(text)
    return host.strip("[]"), port or MASTER_PORT


def _master() -> list[str]:
    found = master()
    if found is None:
        raise QuotaError(
            _(
                "SUANLI_STORAGE_MASTER is not set (host:port of the MooseFS master); ask an operator."
            )
        )
    return ["mfscli", "-H", found[0], "-P", str(found[1]), "-n", "-p"]


def _storage_prefix() -> str:
    """SUANLI_STORAGE_ROOT as a path inside MooseFS (from the mount point it lies in)."""
    root = os.path.realpath(settings.SUANLI_STORAGE_ROOT)
    mount = root
    while not os.path.ismount(mount) and mount != "/":
        mount = os.path.dirname(mount)
    rel = os.path.relpath(root, mount)
    return "" if rel == "." else rel + "/"


def orphans() -> Orphans:
    """The filesystem's space under no quota, and whose open files hold it (`Orphans`)."""
    info: dict[str, int] = {}
    for line in _mfs(*_master(), "-SIN").splitlines():
        cells = line.split("\t")
        if len(cells) == 3 and cells[0] == "master info:" and cells[2].isdigit():
            info[cells[1]] = int(cells[2])
    if "sustained space" not in info:
        raise QuotaError(
            _("The storage filesystem answered %(answer)s; ask an operator.")
            % {"answer": "mfscli -SIN: no sustained space"}
        )
    prefix, by_owner = _storage_prefix(), {}
    for line in _mfs(*_master(), "-SOF").splitlines():
        found = _ORPHAN.fullmatch(line.rpartition("\t")[2])
        if not found or not found.group(2).startswith(prefix):
            continue
        owner = _owner_of(Path(found.group(2)[len(prefix) :].partition("/")[0]))
        if owner is not None:
            by_owner[owner] = by_owner.get(owner, 0) + 1
    return Orphans(
        sustained_bytes=info["sustained space"],
        sustained_files=info.get("sustained files", 0),
        trash_bytes=info.get("trash space", 0),
        by_owner=by_owner,
    )


@dataclass
class Upkeep:
    applied: int = 0
    failed: list[int] = field(default_factory=list)
    orphans: Orphans | None = None
    error: str = ""


def tenant_ids() -> list[int]:
    """The researchers who have a root."""
    try:
        names = os.listdir(settings.SUANLI_STORAGE_ROOT)
    except OSError:
        return []
    return sorted(o for o in (_owner_of(Path(n)) for n in names) if o is not None)


def upkeep() -> Upkeep:
    """Hourly (MooseFS): every root's quota written again from the bought size
    (`quota_apply`: one mfssetquota each, whatever wrote it before), and the space under no
    quota looked at; over SUANLI_STORAGE_SUSTAINED_MAX_GB, an error for the operators that
    names whose open files hold it."""
    report = Upkeep()
    if not enforced():
        return report
    for owner_id in tenant_ids():
        try:
            report.applied += quota_apply(owner_id)
        except QuotaError as exc:
            report.failed.append(owner_id)
            log.error("storage quota of u%s not written: %s", owner_id, exc.messages[0])
    try:
        report.orphans = orphans()
    except QuotaError as exc:
        report.error = exc.messages[0]
        log.error("storage: sustained space unknown: %s", report.error)
        return report
    found = report.orphans
    if found.over:
        holders = ", ".join(
            f"u{o}: {n}" for o, n in sorted(found.by_owner.items(), key=lambda kv: -kv[1])
        )
        log.error(
            "storage: %s GB (%s files) deleted but still open, under no quota, over "
            "SUANLI_STORAGE_SUSTAINED_MAX_GB=%s; open deleted files by researcher: %s",
            found.sustained_gb, found.sustained_files,
            settings.SUANLI_STORAGE_SUSTAINED_MAX_GB, holders or "none seen",
        )  # fmt: skip
    return report

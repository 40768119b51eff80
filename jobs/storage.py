"""Researchers' storage: one root per tenant per host (a shared filesystem in production),
and the checks that keep a volume inside it."""

import os
import posixpath
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError

EXAMPLE = "/workspace/data"
# Container paths a volume may never cover: the image's own system, the kernel's
# interfaces, and anything that would hand the container the engine.
SYSTEM_PATHS = (
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc",
    "/root", "/run", "/sbin", "/sys", "/usr", "/var/run", "/var/lib/docker", "/var/lib",
)  # fmt: skip


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
        raise ValidationError(f"Give the path inside the container, e.g. {EXAMPLE}.")
    if "\x00" in target or any(ch.isspace() for ch in target):
        raise ValidationError("Container paths may not contain spaces or control characters.")
    if not target.startswith("/"):
        raise ValidationError(
            f"'{target}' is relative: container paths must be absolute. Write {EXAMPLE} instead."
        )
    if ".." in target.split("/"):
        raise ValidationError(f"'{target}' contains '..': write the absolute path, e.g. {EXAMPLE}.")
    normal = posixpath.normpath(target)
    if allow_system:
        return normal  # e.g. a working directory: the path is only read, not mounted
    if normal == "/":
        raise ValidationError(
            f"A volume cannot cover the whole container (/): mount it at {EXAMPLE}."
        )
    for system in SYSTEM_PATHS:
        if normal == system or normal.startswith(system + "/"):
            raise ValidationError(
                f"'{normal}' is a system path of the container; mount your data under /workspace, "
                f"e.g. {EXAMPLE}."
            )
    return normal


def validate_source(root: Path, source: str) -> str:
    """`source` is relative to the tenant's root and must stay inside it, symlinks too."""
    if not source:
        raise ValidationError("Give a folder of your storage, e.g. datasets/imagenet.")
    if "\x00" in source or any(ch.isspace() for ch in source):
        raise ValidationError("Storage paths may not contain spaces or control characters.")
    if source.startswith("/"):
        raise ValidationError(
            f"'{source}' is absolute: storage paths are relative to your storage root, "
            "e.g. datasets/imagenet."
        )
    if ".." in source.split("/"):
        raise ValidationError(f"'{source}' contains '..': storage paths stay inside your storage.")
    normal = posixpath.normpath(source)
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, normal))
    if real != real_root and not real.startswith(real_root + os.sep):
        raise ValidationError(f"'{source}' leads outside your storage (through a symbolic link).")
    return "" if normal == "." else normal


def parse_volumes(text: str, *, root: Path) -> list[VolumeSpec]:
    """One volume per line: `storage/sub/path:/container/path[:ro]`."""
    specs: list[VolumeSpec] = []
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
                f"Line {number}: write storage-path:container-path[:ro], e.g. datasets:{EXAMPLE}:ro."
            )
            continue
        try:
            source = validate_source(root, parts[0].strip())
            target = validate_target(parts[1].strip())
        except ValidationError as exc:
            errors.append(f"Line {number}: {exc.messages[0]}")
            continue
        if target in seen:
            errors.append(f"Line {number}: {target} is mounted twice.")
            continue
        seen.add(target)
        specs.append(VolumeSpec(source=source, target=target, read_only=read_only))
    if len(specs) > 16:
        errors.append("At most 16 volumes per cluster.")
    if errors:
        raise ValidationError(errors)
    return specs


def ensure_folders(root: Path, specs: list[VolumeSpec], *, uid: int | None = None) -> None:
    """Create the volumes' folders; as root, hand them to the tenant's container uid so
    its unprivileged containers can write there. The root is private to that uid (0700).
    A path component that is a symbolic link is refused, never followed: a container can
    have planted it since the form checked the path."""
    root.mkdir(parents=True, exist_ok=True)
    chown = uid is not None and os.geteuid() == 0
    if root.is_symlink():
        raise ValidationError("Your storage root is a symbolic link; ask an operator.")
    if chown:
        os.lchown(root, uid, uid)
    os.chmod(root, 0o700)
    for spec in specs:
        path = root
        for part in [p for p in spec.source.split("/") if p]:
            path = path / part
            if path.is_symlink():
                raise ValidationError(
                    f"'{spec.source}' goes through a symbolic link ({part}); use a real folder."
                )
            if not path.exists():
                path.mkdir()
                if chown:
                    os.lchown(path, uid, uid)
            elif not path.is_dir():
                raise ValidationError(f"'{spec.source}' is a file in your storage, not a folder.")


# Names a training script writes while a checkpoint is not complete yet: never resume from one.
PARTIAL_SUFFIXES = (".tmp", ".partial", ".part", ".incomplete")


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


def newest_checkpoint(root: Path, volumes, checkpoint_dir: str, *, not_before=None) -> str | None:
    """The container path of the newest checkpoint (file or folder, by modification time)
    directly in the checkpoint directory, or None. Hidden names, partial writes, symbolic
    links, names the database cannot hold and entries older than `not_before` (another
    job's, in a shared folder) are skipped. The folder is opened one component at a time
    without following links, so a link planted after the check leads nowhere."""
    folder = host_path(root, volumes, checkpoint_dir)
    if folder is None:
        return None
    real_root = os.path.realpath(root)
    parts = [p for p in os.path.relpath(folder, real_root).split(os.sep) if p not in ("", ".")]
    oldest = not_before.timestamp() if not_before is not None else None
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    best: tuple[float, str] | None = None
    try:
        fd = os.open(real_root, flags)
    except OSError:
        return None
    try:
        for part in parts:
            child = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = child
        for entry in os.scandir(fd):
            name = entry.name
            if name.startswith(".") or name.endswith(PARTIAL_SUFFIXES) or entry.is_symlink():
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

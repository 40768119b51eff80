"""Public datasets and models (issue 38): folders an operator publishes on the researchers'
filesystem, read-only at /pub in every container of the clusters that ask for them (the
cluster form's "Public datasets and models at /pub", the API's and the CLI's `pub`).

Layout, the same on every host (docs/architecture.md, "The Docker contract": mounts):

    SUANLI_STORAGE_ROOT/pub/               the console's (root:root 0755); the bind source
    SUANLI_STORAGE_ROOT/pub/<name>/        a published one: owned by root, readable by all
    SUANLI_STORAGE_ROOT/pub-drafts/<name>/ one not published (yet, or any more): never mounted

An operator fills a draft (`manage.py publish_dataset NAME SRC`, or a copy on the storage
server into the draft folder the admin shows) and publishes it: the console makes every
file root's and readable by all, refuses what is not a folder, a file or a link (a device
node or a fifo has no place in a dataset), measures it, and renames the draft into `pub/`
in one step of the filesystem, so no researcher ever sees a half-copied dataset.
Unpublishing renames it back. The database row (jobs.models.PublicDataset) follows the
folder, never the other way round.

The command copies as root, so what it copies must be what the operator meant
(`open_source`, `copy_tree`): links are copied as links and never followed, every entry
is opened without following a link and checked on what was opened (a folder swapped for a
link mid-copy stops the copy), and a source a researcher could write is refused: one on
the researchers' filesystem, and one with a folder in it or on the way to it that another
user or a group can write. Publishing changes modes through descriptors of the entries it
measured, never by name.

What a container gets: `pub/` itself as one bind mount, read-only. Every directory on the
way to it is the console's and no tenant can write any of them, so nothing can be swapped
for a link between the check here (at each start) and the engine's mount; the storage
root is checked as for the tenants' folders. The engine mounts it with MS_RDONLY, so a
write is EROFS; the container has no capability (cap_drop ALL, no-new-privileges, a
non-root uid), so `mount -o remount,rw /pub` is refused. A volume of the tenant's at or
under /pub is refused wherever /pub is asked for (the form, the service, the start): its
mount point would be made inside the operator's folder.

Layer: files, over storage, under nodes (runtime mounts it); uses storage, models and base
(validators).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from django.utils.translation import gettext as _

from jobs.base import validators
from jobs.files import storage
from jobs.models import PublicDataset

TARGET = "/pub"
LIVE = "pub"
DRAFTS = "pub-drafts"
DIR_MODE = 0o755
FILE_MODE = 0o644
EXEC_MODE = 0o755
_CLOEXEC = os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC


def live_root() -> Path:
    return Path(settings.SUANLI_STORAGE_ROOT) / LIVE


def drafts_root() -> Path:
    return Path(settings.SUANLI_STORAGE_ROOT) / DRAFTS


def folder(dataset: PublicDataset) -> Path:
    """Where its files are now: under pub/ while published, else under pub-drafts/."""
    return (live_root() if dataset.published else drafts_root()) / dataset.name


def covers_pub(target: str) -> bool:
    """Whether a container path is /pub or lies in it, however it is spelled."""
    normal = posixpath.normpath("/" + target.lstrip("/"))
    return normal == TARGET or normal.startswith(TARGET + "/")


def volumes_refusal(volumes: Iterable) -> str | None:
    """Words for the first volume at or under /pub (of a cluster that asks for /pub)."""
    for volume in volumes:
        if covers_pub(volume.target):
            return _(
                "%(path)s lies in /pub, where the public datasets and models are mounted "
                "read-only: mount the volume elsewhere (e.g. %(example)s), or go without /pub."
            ) % {"path": volume.target, "example": storage.EXAMPLE}
    return None


# -- the console's folders ------------------------------------------------------------------


def _console_owned(found: os.stat_result) -> bool:
    return found.st_uid in (0, os.geteuid()) and not found.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _ensure_dir(parent_fd: int, name: str, where: str) -> int:
    """A descriptor of `name` in `parent_fd`, made (0755) where missing and repaired to the
    console's (root:root 0755 as root), never through a symbolic link."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, DIR_MODE, dir_fd=parent_fd)
    try:
        fd = os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError:  # ELOOP (a link), ENOTDIR (a file)
        raise ValidationError(
            _("%(path)s is not a folder (a symbolic link?); ask an operator.") % {"path": where}
        ) from None
    try:
        found = os.fstat(fd)
        if os.geteuid() == 0 and (found.st_uid, found.st_gid) != (0, 0):
            os.fchown(fd, 0, 0)
        if stat.S_IMODE(found.st_mode) != DIR_MODE and found.st_uid in (0, os.geteuid()):
            os.fchmod(fd, DIR_MODE)
        found = os.fstat(fd)
        if not _console_owned(found):
            raise ValidationError(
                _(
                    "%(path)s can be changed by others than the console (owner uid %(uid)s, "
                    "mode %(mode)s); ask an operator."
                )
                % {"path": where, "uid": found.st_uid, "mode": f"{stat.S_IMODE(found.st_mode):o}"}
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_roots() -> tuple[int, int]:
    """Descriptors of pub/ and pub-drafts/, made and checked (the storage root too)."""
    base = os.path.realpath(settings.SUANLI_STORAGE_ROOT)  # the operator's path
    os.makedirs(base, exist_ok=True)
    base_fd = os.open(base, _DIR)
    try:
        if not _console_owned(os.fstat(base_fd)):
            found = os.fstat(base_fd)
            raise ValidationError(
                _(
                    "The storage root %(path)s can be changed by others than the console (owner "
                    "uid %(uid)s, mode %(mode)s); ask an operator."
                )
                % {"path": base, "uid": found.st_uid, "mode": f"{stat.S_IMODE(found.st_mode):o}"}
            )
        live = _ensure_dir(base_fd, LIVE, os.path.join(base, LIVE))
        try:
            drafts = _ensure_dir(base_fd, DRAFTS, os.path.join(base, DRAFTS))
        except BaseException:
            os.close(live)
            raise
        return live, drafts
    finally:
        os.close(base_fd)


def mount_source() -> str:
    """The path the engine binds at /pub, checked now, just before the start (see the
    module's docstring). ValidationError when the storage root or pub/ is not the
    console's alone."""
    live, drafts = _open_roots()
    os.close(live)
    os.close(drafts)
    return os.path.join(os.path.realpath(settings.SUANLI_STORAGE_ROOT), LIVE)


# -- publishing -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Measure:
    size_bytes: int
    file_count: int


def prepare(path: Path) -> Measure:
    """Make a dataset's tree fit for every tenant's uid and measure it: folders 0755, files
    0644 (0755 where executable: set-id bits dropped), root's (as root); symbolic links are
    kept as they are (inside a container they lead into that container). Refused: anything
    else (a device node, a fifo, a socket), with its path. Nothing is followed through a link."""
    as_root = os.geteuid() == 0
    size = files = 0
    for top, dirs, names, top_fd in os.fwalk(path, follow_symlinks=False):
        _fix(top_fd, None, os.fstat(top_fd), as_root, top)
        for name in dirs + names:
            found = os.stat(name, dir_fd=top_fd, follow_symlinks=False)
            if stat.S_ISLNK(found.st_mode):
                if as_root and (found.st_uid, found.st_gid) != (0, 0):
                    os.chown(name, 0, 0, dir_fd=top_fd, follow_symlinks=False)
                continue
            if stat.S_ISREG(found.st_mode):
                _fix(top_fd, name, found, as_root, os.path.join(top, name))
                size += found.st_size
                files += 1
            elif not stat.S_ISDIR(found.st_mode):
                raise ValidationError(_special(os.path.join(top, name)))
    return Measure(size, files)


def _special(path: str) -> str:
    return _(
        "%(path)s is neither a folder, a file nor a symbolic link (a device node, fifo or "
        "socket): remove it, then try again."
    ) % {"path": path}


def _fix(dir_fd: int, name: str | None, found: os.stat_result, as_root: bool, where: str) -> None:
    """Root's and readable by all: the entry `name` of `dir_fd`, or (None) `dir_fd` itself."""
    if stat.S_ISDIR(found.st_mode):
        mode = DIR_MODE
    else:
        mode = EXEC_MODE if found.st_mode & 0o111 else FILE_MODE
    owner = as_root and (found.st_uid, found.st_gid) != (0, 0)
    if not owner and stat.S_IMODE(found.st_mode) == mode:
        return
    if name is None:
        fd = dir_fd
    else:
        # By a descriptor of the very file measured, never by its name: a chmod by name
        # follows a link that was swapped in since (and would open up its target).
        try:
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=dir_fd
            )
        except OSError:  # ELOOP: a link now
            raise ValidationError(_changed(where)) from None
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (found.st_dev, found.st_ino) or stat.S_IFMT(
            now.st_mode
        ) != stat.S_IFMT(found.st_mode):
            raise ValidationError(_changed(where))
        if owner:
            os.fchown(fd, 0, 0)
        if stat.S_IMODE(found.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        if fd != dir_fd:
            os.close(fd)


def _changed(path: str) -> str:
    return _(
        "%(path)s changed while it was being copied or published (replaced by something "
        "else): make sure nobody else writes the folder, then try again."
    ) % {"path": path}


def _real_dir(parent_fd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _exists(parent_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def make_draft(name: str) -> Path:
    """The draft folder of a new dataset `name`, made where missing (an operator may have
    filled it already). Refused: a bad name, a name published without a row, a draft that
    is not a real folder."""
    validators.validate_dataset_name(name)
    live, drafts = _open_roots()
    try:
        if _exists(live, name):
            raise ValidationError(
                _("%(path)s exists already, without a row: move it into %(drafts)s first.")
                % {"path": live_root() / name, "drafts": drafts_root()}
            )
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, DIR_MODE, dir_fd=drafts)
        if not _real_dir(drafts, name):
            raise ValidationError(_("%(path)s is not a folder.") % {"path": drafts_root() / name})
    finally:
        os.close(live)
        os.close(drafts)
    return drafts_root() / name


def dataset_create(
    *, name: str, kind: str = PublicDataset.Kind.DATASET, description: str = ""
) -> PublicDataset:
    """A new unpublished dataset and its (empty, or already filled) draft folder."""
    validators.validate_dataset_name(name)
    if PublicDataset.objects.filter(name=name).exists():
        raise ValidationError(
            _("A public dataset or model named %(name)s exists already.") % {"name": name}
        )
    make_draft(name)
    return PublicDataset.objects.create(name=name, kind=kind, description=description)


def dataset_publish(*, dataset: PublicDataset) -> PublicDataset:
    """Prepare and measure its draft (`prepare`), then move it under pub/ in one rename:
    from then on every cluster that asks for /pub sees it, running ones included."""
    if dataset.published:
        return dataset
    draft = drafts_root() / dataset.name
    live, drafts = _open_roots()
    try:
        if not _real_dir(drafts, dataset.name):
            raise ValidationError(
                _("%(name)s has no folder %(path)s: copy its files there first.")
                % {"name": dataset.name, "path": draft}
            )
        measure = prepare(draft)  # minutes for a large dataset: outside any transaction
        with transaction.atomic():
            row = PublicDataset.objects.select_for_update().get(pk=dataset.pk)
            if row.published:
                return row
            if _exists(live, row.name):
                raise ValidationError(
                    _("%(path)s exists already: move it away before publishing %(name)s.")
                    % {"path": live_root() / row.name, "name": row.name}
                )
            os.rename(row.name, row.name, src_dir_fd=drafts, dst_dir_fd=live)
            try:
                row.published, row.published_at = True, timezone.now()
                row.size_bytes, row.file_count = measure.size_bytes, measure.file_count
                row.save(update_fields=["published", "published_at", "size_bytes", "file_count"])
            except BaseException:
                os.rename(row.name, row.name, src_dir_fd=live, dst_dir_fd=drafts)
                raise
            return row
    finally:
        os.close(live)
        os.close(drafts)


def dataset_unpublish(*, dataset: PublicDataset) -> PublicDataset:
    """Move it back under pub-drafts/: gone from /pub at once, in running clusters too."""
    live, drafts = _open_roots()
    try:
        with transaction.atomic():
            row = PublicDataset.objects.select_for_update().get(pk=dataset.pk)
            if not row.published:
                return row
            if _exists(drafts, row.name):
                raise ValidationError(
                    _("%(path)s exists already: move it away before unpublishing %(name)s.")
                    % {"path": drafts_root() / row.name, "name": row.name}
                )
            if _exists(live, row.name):
                os.rename(row.name, row.name, src_dir_fd=live, dst_dir_fd=drafts)
            try:
                row.published, row.published_at = False, None
                row.save(update_fields=["published", "published_at"])
            except BaseException:
                with contextlib.suppress(OSError):
                    os.rename(row.name, row.name, src_dir_fd=drafts, dst_dir_fd=live)
                raise
            return row
    finally:
        os.close(live)
        os.close(drafts)


def dataset_measure(*, dataset: PublicDataset) -> PublicDataset:
    """Its size and file count again (after an operator changed its files by hand)."""
    path = folder(dataset)
    if not path.is_dir() or path.is_symlink():
        raise ValidationError(_("%(path)s is not a folder.") % {"path": path})
    size = files = 0
    for _top, _dirs, names, top_fd in os.fwalk(path, follow_symlinks=False):
        for name in names:
            found = os.stat(name, dir_fd=top_fd, follow_symlinks=False)
            if stat.S_ISREG(found.st_mode):
                size, files = size + found.st_size, files + 1
    PublicDataset.objects.filter(pk=dataset.pk).update(size_bytes=size, file_count=files)
    dataset.size_bytes, dataset.file_count = size, files
    return dataset


def published():
    """What researchers see listed: the published ones, by name."""
    return PublicDataset.objects.filter(published=True).order_by("name")


# -- copying a local folder in (manage.py publish_dataset) ----------------------------------


@dataclass(frozen=True)
class Progress:
    done_bytes: int
    total_bytes: int
    done_files: int
    total_files: int


def copy_in(
    src: Path, dataset: PublicDataset, *, report: Callable[[Progress], None], every_s: float = 1.0
) -> None:
    """Copy the folder `src` into the dataset's draft folder (which must be empty): see
    `copy_tree` for what is copied and what is refused."""
    if dataset.published:
        raise ValidationError(
            _("%(name)s is published: unpublish it before changing its files.")
            % {"name": dataset.name}
        )
    source = open_source(Path(src))
    try:
        make_draft(dataset.name)
        live, drafts = _open_roots()
        os.close(live)
        try:
            try:
                dest = os.open(dataset.name, _DIR | os.O_NOFOLLOW, dir_fd=drafts)
            except OSError:
                raise ValidationError(
                    _("%(path)s is not a folder.") % {"path": drafts_root() / dataset.name}
                ) from None
        finally:
            os.close(drafts)
        try:
            if os.listdir(dest):
                raise ValidationError(
                    _(
                        "%(path)s is not empty: it was filled before (publish it, or empty "
                        "it first)."
                    )
                    % {"path": drafts_root() / dataset.name}
                )
            try:
                copy_tree(source, dest, where=str(src), report=report, every_s=every_s)
            except BaseException:
                _empty(dest)  # a refused copy leaves no half of it in the draft
                raise
        finally:
            os.close(dest)
    finally:
        os.close(source)


def _empty(dir_fd: int) -> None:
    """Everything in the open folder removed, through descriptors (never following a link)."""
    for name in os.listdir(dir_fd):
        if stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            shutil.rmtree(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)


def _others_can_write(found: os.stat_result) -> bool:
    return found.st_uid not in (0, os.geteuid()) or bool(
        found.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _writable_words(path: str, found: os.stat_result) -> str:
    return _(
        "%(path)s can be changed by others than root (owner uid %(uid)s, mode %(mode)s): "
        "someone could swap what is copied for a link to any file of this machine. Publish "
        "from a folder only root writes (copy it there first)."
    ) % {"path": path, "uid": found.st_uid, "mode": f"{stat.S_IMODE(found.st_mode):o}"}


def open_source(src: Path) -> int:
    """A descriptor of the folder `src` to copy a dataset from, opened from / one folder
    at a time without following a link (the links in `src` as typed are resolved first,
    while nothing is open yet). Refused: a folder on the researchers' filesystem (under
    SUANLI_STORAGE_ROOT, or on its filesystem where that is MooseFS: a tenant may write
    there), and one on a way that others than root can change (a folder on it writable by
    another user, or by a group, unless sticky and the next folder is root's)."""
    real = os.path.realpath(src)
    base = os.path.realpath(settings.SUANLI_STORAGE_ROOT)
    on_storage = _(
        "%(path)s is on the researchers' filesystem (%(root)s), where a researcher may "
        "change it while it is copied: copy it out first, or publish from a folder only "
        "root writes."
    ) % {"path": src, "root": settings.SUANLI_STORAGE_ROOT}
    if real == base or real.startswith(base.rstrip("/") + "/"):
        raise ValidationError(on_storage)
    if not os.path.isdir(real):
        raise ValidationError(_("%(path)s is not a folder.") % {"path": src})
    fd = os.open("/", _DIR)
    try:
        parent = os.fstat(fd)
        walked = "/"
        for part in [p for p in real.split("/") if p]:
            walked = os.path.join(walked, part)
            try:
                nxt = os.open(part, _DIR | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:  # a link or no folder any more: changed since realpath
                raise ValidationError(_changed(walked)) from None
            os.close(fd)
            fd = nxt
            found = os.fstat(fd)
            # Who can write the parent could rename this folder away and put another there.
            sticky = parent.st_mode & stat.S_ISVTX and found.st_uid in (0, os.geteuid())
            if _others_can_write(parent) and not sticky:
                raise ValidationError(_writable_words(os.path.dirname(walked), parent))
            parent = found
        if settings.SUANLI_STORAGE_FS == "moosefs" and os.path.isdir(base):
            if parent.st_dev == os.stat(base).st_dev:
                raise ValidationError(on_storage)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _entries(dir_fd: int) -> list[tuple[str, os.stat_result]]:
    names = sorted(os.listdir(dir_fd))
    return [(name, os.stat(name, dir_fd=dir_fd, follow_symlinks=False)) for name in names]


def _open_dir(dir_fd: int, name: str, where: str) -> int:
    """The folder `name` of `dir_fd`, never through a link, and only one no other user can
    write (checked on what was opened, not on the name)."""
    try:
        fd = os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:  # ELOOP, ENOTDIR: swapped for a link or a file since it was listed
        raise ValidationError(_changed(where)) from None
    found = os.fstat(fd)
    if _others_can_write(found):
        os.close(fd)
        raise ValidationError(_writable_words(where, found))
    return fd


def _measure_source(dir_fd: int, where: str) -> tuple[int, int]:
    """Bytes and files under an open folder (folders checked as `_open_dir` does)."""
    found = os.fstat(dir_fd)
    if _others_can_write(found):
        raise ValidationError(_writable_words(where, found))
    size = files = 0
    for name, entry in _entries(dir_fd):
        path = os.path.join(where, name)
        if stat.S_ISDIR(entry.st_mode):
            fd = _open_dir(dir_fd, name, path)
            try:
                more, count = _measure_source(fd, path)
            finally:
                os.close(fd)
            size, files = size + more, files + count
        elif stat.S_ISREG(entry.st_mode):
            size, files = size + entry.st_size, files + 1
        elif not stat.S_ISLNK(entry.st_mode):
            raise ValidationError(_special(path))
    return size, files


def copy_tree(
    src_fd: int,
    dest_fd: int,
    *,
    where: str,
    report: Callable[[Progress], None],
    every_s: float = 1.0,
) -> None:
    """Copy the open folder `src_fd` into the open (empty) folder `dest_fd`: files with
    their contents, symbolic links as links (never followed: a link to /etc is copied as
    that link, which inside a container leads into the container), folders made anew. All
    by descriptors, each entry opened without following a link and checked on what was
    opened: a folder swapped for a link while the copy runs is refused, never followed;
    a folder another user or a group can write is refused (its entries could be swapped).
    Refused too: device nodes, fifos, sockets. `report` is called at most every `every_s`
    seconds and once at the end. Long because its two steps, a file and a folder, are
    closures sharing the progress counters; each is short."""
    total_bytes, total_files = _measure_source(src_fd, where)
    done = [0, 0]
    last = [0.0]

    def tell(final: bool = False) -> None:
        now = time.monotonic()
        if final or now - last[0] >= every_s:
            last[0] = now
            report(Progress(done[0], total_bytes, done[1], total_files))

    def copy_file(dir_fd: int, out_fd: int, name: str, path: str) -> None:
        try:
            reader = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=dir_fd
            )
        except OSError:
            raise ValidationError(_changed(path)) from None
        try:
            found = os.fstat(reader)
            if not stat.S_ISREG(found.st_mode):
                raise ValidationError(_changed(path))
            writer = os.open(
                name,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC,
                FILE_MODE,
                dir_fd=out_fd,
            )
            try:
                while chunk := os.read(reader, 8 * 2**20):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(writer, view) :]
                    done[0] += len(chunk)
                    tell()
                os.fchmod(writer, stat.S_IMODE(found.st_mode) & 0o777)
                os.utime(writer, ns=(found.st_atime_ns, found.st_mtime_ns))
            finally:
                os.close(writer)
        finally:
            os.close(reader)
        done[1] += 1

    def copy_dir(dir_fd: int, out_fd: int, path: str) -> None:
        for name, entry in _entries(dir_fd):
            at = os.path.join(path, name)
            if stat.S_ISLNK(entry.st_mode):
                os.symlink(os.readlink(name, dir_fd=dir_fd), name, dir_fd=out_fd)
            elif stat.S_ISREG(entry.st_mode):
                copy_file(dir_fd, out_fd, name, at)
            elif stat.S_ISDIR(entry.st_mode):
                sub = _open_dir(dir_fd, name, at)
                try:
                    os.mkdir(name, DIR_MODE, dir_fd=out_fd)
                    out = os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=out_fd)
                    try:
                        copy_dir(sub, out, at)
                    finally:
                        os.close(out)
                finally:
                    os.close(sub)
            else:
                raise ValidationError(_special(at))

    copy_dir(src_fd, dest_fd, where)
    tell(final=True)

"""The one no-follow walk of a tenant's folder (jobs.files.storage.walk_nofollow), used by
builds to read a context folder the researcher writes from inside a container: links are
never followed, and no descriptor is left open whichever way the walk ends."""

import contextlib
import os
import stat

import pytest

from jobs.files import storage


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def tree(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("another tenant's")
    root = tmp_path / "u7"
    (root / "ctx" / "sub").mkdir(parents=True)
    (root / "ctx" / "a.txt").write_text("a")
    (root / "ctx" / "sub" / "b.txt").write_text("bb")
    (root / "ctx" / "out").symlink_to(outside)  # a folder swapped for a link
    (root / "ctx" / "sub" / "c").symlink_to(outside / "secret")
    return root


def test_the_walk_lists_links_as_links_and_never_enters_them(tree):
    top = storage.open_folder_nofollow(tree, "ctx")
    seen = {path: st for _fd, _name, path, st in storage.walk_nofollow(top)}
    assert sorted(seen) == ["a.txt", "out", "sub", "sub/b.txt", "sub/c"]
    assert stat.S_ISLNK(seen["out"].st_mode) and stat.S_ISLNK(seen["sub/c"].st_mode)
    assert not any(p.startswith("out/") for p in seen)  # "secret" never reached


def test_a_link_named_as_the_folder_is_refused(tree):
    with pytest.raises(OSError):
        storage.open_folder_nofollow(tree / "ctx", "out")


def test_no_descriptor_stays_open_after_an_early_end_or_an_error(tree):
    before = _open_fds()
    top = storage.open_folder_nofollow(tree, "ctx")
    with contextlib.closing(storage.walk_nofollow(top)) as entries:
        next(entries)
        next(entries)  # "out"; "sub" not yet entered
    assert _open_fds() == before

    top = storage.open_folder_nofollow(tree, "ctx")
    with pytest.raises(RuntimeError), contextlib.closing(storage.walk_nofollow(top)) as entries:
        for _fd, name, _path, _st in entries:
            if name == "b.txt":  # inside "sub": two folders open
                raise RuntimeError("the caller gave up")
    assert _open_fds() == before

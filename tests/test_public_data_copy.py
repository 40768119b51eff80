"""`publish_dataset NAME SRC` copies as root: what it copies must be what the operator
meant, never a file a researcher pointed it at (jobs/files/pub.py, `open_source`, `copy_tree`,
`prepare`). The attacker here is a researcher who can write the source folder, or a
folder in it, while the copy runs: every link is copied as a link and never followed, a
folder swapped for a link mid-copy is refused, and a source a researcher could write at
all is refused before anything is copied. Filesystem only (no database, no engine)."""

import os
import stat
from pathlib import Path

import pytest
from django.core.exceptions import ValidationError

from jobs.files import pub

SECRET = "-----BEGIN PRIVATE KEY----- the console's CA key"


@pytest.fixture
def secret(tmp_path) -> Path:
    """What the console (root) can read and no researcher may: a CA key, 0600."""
    folder = tmp_path / "etc-suanli"
    folder.mkdir(mode=0o700)
    key = folder / "ca.key"
    key.write_text(SECRET)
    key.chmod(0o600)
    return key


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "weights.bin").write_bytes(os.urandom(3 * 2**20))
    (src / "z").mkdir()
    (src / "z" / "readme.txt").write_text("the last folder copied")
    return src


def _copy(src: Path, dest: Path, **kwargs) -> list:
    dest.mkdir(exist_ok=True)
    said = []
    source = pub.open_source(src)
    out = os.open(dest, os.O_RDONLY | os.O_DIRECTORY)
    try:
        pub.copy_tree(source, out, where=str(src), report=kwargs.pop("report", said.append),
                      every_s=0)  # fmt: skip
    finally:
        os.close(source)
        os.close(out)
    return said


def _everything(folder: Path) -> str:
    """Every file's contents under `folder`, read without following a link."""
    texts = []
    for top, _dirs, names in os.walk(folder):
        for name in names:
            path = Path(top) / name
            if not path.is_symlink():
                texts.append(path.read_bytes().decode(errors="replace"))
    return "\n".join(texts)


def test_links_to_a_secret_file_and_folder_are_copied_as_links_never_their_targets(
    tmp_path, secret, storage_root
):
    src = _source(tmp_path)
    (src / "key").symlink_to(secret)
    (src / "z" / "etc").symlink_to(secret.parent)
    dest = tmp_path / "draft"
    said = _copy(src, dest)

    assert os.readlink(dest / "key") == str(secret), "a link stays that link"
    assert os.readlink(dest / "z" / "etc") == str(secret.parent)
    assert SECRET not in _everything(dest), "the key itself was never copied"
    assert (dest / "z" / "readme.txt").read_text() == "the last folder copied"
    assert said[-1] == pub.Progress(3 * 2**20 + 22, 3 * 2**20 + 22, 2, 2)


def test_a_folder_swapped_for_a_link_mid_copy_is_refused_and_never_followed(
    tmp_path, secret, storage_root
):
    src = _source(tmp_path)
    swapped = []

    def attacker(progress):
        # While a/weights.bin is copied, the researcher puts a link to the console's
        # secrets where the not yet copied folder z was.
        if not swapped:
            (src / "z").rename(tmp_path / "z-moved")
            (src / "z").symlink_to(secret.parent)
            swapped.append(progress)

    dest = tmp_path / "draft"
    with pytest.raises(ValidationError) as caught:
        _copy(src, dest, report=attacker)
    assert swapped, "the swap happened during the copy"
    assert f"{src / 'z'} changed while it was being copied" in caught.value.messages[0]
    assert SECRET not in _everything(dest)
    assert not (dest / "z" / "ca.key").exists()


def test_a_source_on_the_researchers_filesystem_is_refused(tmp_path, storage_root):
    src = Path(storage_root) / "u7" / "imagenet"
    (src / "train").mkdir(parents=True)
    (src / "train" / "a.jpg").write_text("A")
    for path in (src, Path(storage_root)):
        with pytest.raises(ValidationError) as caught:
            pub.open_source(path)
        assert (
            f"{path} is on the researchers' filesystem ({storage_root}), where a researcher "
            "may change it while it is copied: copy it out first, or publish from a folder "
            "only root writes."
        ) in caught.value.messages[0]


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777])
def test_a_folder_a_group_or_everyone_can_write_is_refused_before_anything_is_copied(
    tmp_path, storage_root, mode
):
    src = _source(tmp_path)
    (src / "z").chmod(mode)
    dest = tmp_path / "draft"
    with pytest.raises(ValidationError) as caught:
        _copy(src, dest)
    assert (
        f"{src / 'z'} can be changed by others than root (owner uid {os.geteuid()}, mode "
        f"{mode:o}): someone could swap what is copied"
    ) in caught.value.messages[0]
    assert not any(dest.iterdir()), "refused before the first byte"

    # The source folder itself likewise; and a folder on the way to it, unless it is
    # sticky (as /tmp) and the next folder is root's: then nobody else can swap that one.
    (src / "z").chmod(0o755)
    src.chmod(mode)
    with pytest.raises(ValidationError, match=f"{src} can be changed by others than root"):
        _copy(src, dest)
    src.chmod(0o755)
    outer = tmp_path / "outer"
    outer.mkdir()
    src.rename(outer / "src")
    outer.chmod(mode)
    if mode & stat.S_ISVTX:
        _copy(outer / "src", dest)
        assert (dest / "z" / "readme.txt").exists()
    else:
        with pytest.raises(ValidationError, match=f"{outer} can be changed by others than root"):
            pub.open_source(outer / "src")


def test_publishing_never_changes_the_mode_of_a_file_a_link_was_swapped_in_for(
    tmp_path, secret, storage_root
):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "data.bin").write_text("data")
    (draft / "data.bin").chmod(0o600)
    folder = os.open(draft, os.O_RDONLY | os.O_DIRECTORY)
    try:
        measured = os.stat("data.bin", dir_fd=folder, follow_symlinks=False)
        # Between the measure and the chmod, a link to the key where the file was.
        (draft / "data.bin").unlink()
        (draft / "data.bin").symlink_to(secret)
        with pytest.raises(ValidationError, match="changed while it was being copied"):
            pub._fix(folder, "data.bin", measured, os.geteuid() == 0, str(draft / "data.bin"))
    finally:
        os.close(folder)
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600, "the key stays the console's"

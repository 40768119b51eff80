"""Public datasets and models (jobs/files/pub.py): an operator publishes, researchers see what is
published and ask for it at /pub on the cluster form, the API and the command line. The
mounts themselves, read-only on the real engines: tests/test_public_data_mounts.py.

Olga is the operator (a superuser), Alice a researcher, Vera staff who may only look, and
Pete staff who may change datasets but not publish them."""

import io
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command
from django.test import Client

from console.forms import ClusterForm, PoolForm
from console.models import ApiToken
from jobs.files import pub
from jobs.models import Cluster, Image, PublicDataset

pytestmark = pytest.mark.django_db

AS_ROOT = os.geteuid() == 0
ROOT = Path(__file__).resolve().parent.parent
CHANGELIST = "/admin/jobs/publicdataset/"


def _grant(user, *perms):
    for perm in perms:
        app, _, codename = perm.partition(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app, codename=codename)
        )
    return get_user_model().objects.get(pk=user.pk)


def _draft(name: str, files: dict[str, str], **kwargs) -> PublicDataset:
    dataset = pub.dataset_create(name=name, **kwargs)
    for path, text in files.items():
        target = pub.drafts_root() / name / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return dataset


def _cluster_data(**extra) -> dict:
    return {
        "name": "pubs", "resource": "gpu:a100-80gb", "nodes": "1", "gpus_per_node": "1",
        "image": str(Image.objects.get(reference="suanli/busybox:latest").pk),
        "network": "standard", "volumes": "workspace:/workspace", "release_policy": "never",
        **extra,
    }  # fmt: skip


def _api(user):
    _, token = ApiToken.issue(user=user, name="ci")
    return Client(HTTP_AUTHORIZATION=f"Bearer {token}")


def _post_cluster(client, **body):
    body = {"name": "pubs", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
            "image": "suanli/busybox:latest", "release_policy": "never", **body}  # fmt: skip
    return client.post("/api/v1/clusters", json.dumps(body), content_type="application/json")


# -- publishing -------------------------------------------------------------------------------


def test_a_draft_is_nowhere_under_pub_until_published_then_readable_by_all(storage_root):
    dataset = _draft("imagenet-mini", {"train/a.jpg": "A" * 1000, "val/b.jpg": "B" * 24},
                     kind="dataset", description="1,000 classes, 2 pictures")  # fmt: skip
    tool = pub.drafts_root() / "imagenet-mini" / "run.sh"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o4750)  # set-uid, not readable by others
    (pub.drafts_root() / "imagenet-mini" / "val" / "b.jpg").chmod(0o600)
    assert not (pub.live_root() / "imagenet-mini").exists(), "not under /pub while a draft"

    dataset = pub.dataset_publish(dataset=dataset)
    live = pub.live_root() / "imagenet-mini"
    assert dataset.published and dataset.published_at is not None
    assert (dataset.size_bytes, dataset.file_count) == (1000 + 24 + 10, 3)
    assert not (pub.drafts_root() / "imagenet-mini").exists(), "moved, not copied"
    assert (live / "train" / "a.jpg").read_text() == "A" * 1000
    for path in [live, live / "train", live / "train" / "a.jpg", live / "val" / "b.jpg", live / "run.sh"]:  # fmt: skip
        found = path.lstat()
        want = 0o755 if path.is_dir() or path.name == "run.sh" else 0o644
        assert stat.S_IMODE(found.st_mode) == want, (path, oct(found.st_mode))
        if AS_ROOT:
            assert (found.st_uid, found.st_gid) == (0, 0), path
    root = pub.live_root().lstat()
    assert stat.S_IMODE(root.st_mode) == 0o755 and (not AS_ROOT or root.st_uid == 0)

    # Unpublished: gone from /pub at once, its files kept in the drafts.
    dataset = pub.dataset_unpublish(dataset=dataset)
    assert not dataset.published and not live.exists()
    assert (pub.drafts_root() / "imagenet-mini" / "train" / "a.jpg").exists()


def test_a_device_node_or_fifo_in_a_draft_is_refused_with_its_path(storage_root):
    dataset = _draft("odd", {"ok.txt": "fine"})
    os.mkfifo(pub.drafts_root() / "odd" / "pipe")
    with pytest.raises(ValidationError) as caught:
        pub.dataset_publish(dataset=dataset)
    assert (
        f"{pub.drafts_root() / 'odd' / 'pipe'} is neither a folder, a file nor a symbolic link"
        in (caught.value.messages[0])
    )
    dataset.refresh_from_db()
    assert not dataset.published and not (pub.live_root() / "odd").exists()


@pytest.mark.parametrize(
    "name", ["../etc", ".hidden", "a/b", "", "x" * 65, "-rf", "名字", "with space", "a\x00b"]
)
def test_bad_names_are_refused_with_what_a_name_is(storage_root, name):
    with pytest.raises(ValidationError) as caught:
        pub.dataset_create(name=name)
    assert (
        "is not a folder name for /pub: use letters, digits, '.', '_' and '-'"
        in (caught.value.messages[0])
    )
    assert not PublicDataset.objects.exists()
    assert not pub.drafts_root().exists() or not any(pub.drafts_root().iterdir())


def test_the_command_copies_a_folder_in_with_its_progress_and_publishes_it(storage_root, tmp_path):
    src = tmp_path / "llama"
    (src / "weights").mkdir(parents=True)
    (src / "weights" / "model.safetensors").write_bytes(os.urandom(3 * 2**20))
    (src / "config.json").write_text("{}")
    (src / "latest").symlink_to("weights")
    out = io.StringIO()
    call_command("publish_dataset", "llama-mini", str(src), "--kind", "model",
                 "--description", "a small model", stdout=out)  # fmt: skip
    said = out.getvalue()
    assert "(100 %), 2 of 2 files" in said, said
    assert "Published llama-mini: 3.0\xa0MB in 2 files, read-only at /pub/llama-mini" in said
    dataset = PublicDataset.objects.get(name="llama-mini")
    assert dataset.published and dataset.kind == "model" and dataset.description == "a small model"
    live = pub.live_root() / "llama-mini"
    assert (live / "weights" / "model.safetensors").read_bytes() == (
        src / "weights" / "model.safetensors"
    ).read_bytes()
    assert os.readlink(live / "latest") == "weights", "a link stays a link"

    # Bad names and published ones are refused in words; --unpublish takes it off /pub.
    with pytest.raises(CommandError, match="is not a folder name for /pub"):
        call_command("publish_dataset", "../up", str(src), stdout=io.StringIO())
    with pytest.raises(CommandError, match="llama-mini is published: unpublish it before"):
        call_command("publish_dataset", "llama-mini", str(src), stdout=io.StringIO())
    call_command("publish_dataset", "llama-mini", "--unpublish", stdout=io.StringIO())
    assert not PublicDataset.objects.get(name="llama-mini").published and not live.exists()


# -- who may publish --------------------------------------------------------------------------


def test_a_researcher_cannot_publish_from_any_url_she_guesses(client, alice, storage_root):
    dataset = _draft("secret-draft", {"a.txt": "a"})
    client.force_login(alice)
    for url in [CHANGELIST, f"{CHANGELIST}add/", f"{CHANGELIST}{dataset.pk}/change/"]:
        got = client.get(url)
        assert got.status_code == 302 and got["Location"].startswith("/admin/login/"), url
    got = client.post(CHANGELIST, {"action": "publish", "_selected_action": [dataset.pk]})
    assert got.status_code == 302 and got["Location"].startswith("/admin/login/")
    got = client.post(f"{CHANGELIST}add/", {"name": "mine", "kind": "dataset"})
    assert got.status_code == 302
    for url in ["/ops/public-data/", "/ops/datasets/", "/public-data/publish/", "/pub/"]:
        assert client.post(url, {"name": "secret-draft"}).status_code == 404, url
    dataset.refresh_from_db()
    assert not dataset.published and not (pub.live_root() / "secret-draft").exists()
    assert list(PublicDataset.objects.values_list("name", flat=True)) == ["secret-draft"]


def test_publishing_needs_its_own_permission_beyond_changing(client, storage_root):
    dataset = _draft("needs-power", {"a.txt": "a"})
    pete = get_user_model().objects.create_user("pete", password="pete-pass-123", is_staff=True)
    pete = _grant(pete, "jobs.view_publicdataset", "jobs.change_publicdataset")
    client.force_login(pete)
    page = client.get(CHANGELIST).content.decode()
    assert "needs-power" in page and 'value="publish"' not in page
    got = client.post(CHANGELIST, {"action": "publish", "_selected_action": [dataset.pk]})
    assert got.status_code == 403
    dataset.refresh_from_db()
    assert not dataset.published

    pete = _grant(pete, "jobs.publish_publicdataset")
    client.force_login(pete)
    got = client.post(CHANGELIST, {"action": "publish", "_selected_action": [dataset.pk]})
    assert got.status_code == 302
    dataset.refresh_from_db()
    assert dataset.published and (pub.live_root() / "needs-power" / "a.txt").exists()
    # A published one is not deleted: unpublished first.
    assert client.post(f"{CHANGELIST}{dataset.pk}/delete/", {"post": "yes"}).status_code == 403


def test_the_operator_adds_one_in_the_admin_and_is_shown_where_to_copy_it(
    client, operator, storage_root
):
    client.force_login(operator)
    got = client.post(f"{CHANGELIST}add/", {"name": "coco", "kind": "dataset", "description": "d"})
    assert got.status_code == 302, got.content.decode()[:2000]
    dataset = PublicDataset.objects.get(name="coco")
    draft = pub.drafts_root() / "coco"
    assert draft.is_dir() and not dataset.published
    assert str(draft) in client.get(f"{CHANGELIST}{dataset.pk}/change/").content.decode()
    got = client.post(f"{CHANGELIST}add/", {"name": "../coco", "kind": "dataset"})
    assert "is not a folder name for /pub" in got.content.decode()
    # Publishing an empty draft works (an empty folder); a missing one says what to do.
    draft.rmdir()
    got = client.post(
        CHANGELIST, {"action": "publish", "_selected_action": [dataset.pk]}, follow=True
    )
    assert f"coco has no folder {draft}: copy its files there first." in got.content.decode()


# -- what researchers see ---------------------------------------------------------------------


def test_researchers_see_only_what_is_published(client, alice, storage_root):
    pub.dataset_publish(dataset=_draft("cifar-10", {"data.bin": "x" * 2048},
                                        description="60,000 images"))  # fmt: skip
    _draft("not-yet", {"a": "a"}, description="still copying")
    client.force_login(alice)
    page = client.get("/public-data/").content.decode()
    assert 'data-name="cifar-10"' in page and "/pub/cifar-10" in page
    assert "60,000 images" in page and "2.0\xa0KB" in page
    assert "not-yet" not in page and "still copying" not in page
    assert 'href="/public-data/"' in client.get("/clusters/new/").content.decode(), "the form's"
    assert (
        'href="/public-data/"' in client.get("/storage/").content.decode().split("storage-pub")[1]
    )
    form_page = client.get("/clusters/new/").content.decode()
    (checkbox,) = re.findall(r'<input[^>]*name="pub"[^>]*>', form_page)
    assert " checked" in checkbox, "ticked unless unticked"
    assert "cifar-10" in form_page and "not-yet" not in form_page
    client.logout()
    assert client.get("/public-data/").status_code == 302, "signed-in researchers only"


# -- the form, the API and the command line ----------------------------------------------------


def test_the_form_takes_pub_and_refuses_a_volume_in_it(alice, paper_host, priced, storage_root):
    form = ClusterForm(_cluster_data(pub="on"), owner=alice)
    assert form.is_valid(), form.errors
    assert form.spec().pub is True
    form = ClusterForm(_cluster_data(), owner=alice)  # unticked
    assert form.is_valid(), form.errors
    assert form.spec().pub is False
    assert ClusterForm(owner=alice)["pub"].initial is True, "ticked on a new form"
    for target in ["/pub", "/pub/mine", "//pub/./x/"]:
        form = ClusterForm(_cluster_data(pub="on", volumes=f"workspace:{target}"), owner=alice)
        assert not form.is_valid()
        assert "lies in /pub, where the public datasets and models are mounted read-only" in (
            " ".join(form.errors["volumes"])
        ), target
    form = ClusterForm(_cluster_data(volumes="workspace:/pub"), owner=alice)
    assert form.is_valid(), "without /pub, a volume may be there"
    pool = PoolForm({**_cluster_data(pub="on"), "min_clusters": "0", "max_clusters": "1",
                     "idle_minutes": "5"}, owner=alice)  # fmt: skip
    assert pool.is_valid(), pool.errors
    assert pool.spec().cluster.pub is True


def test_the_api_asks_for_pub_unless_told_not_to(alice, paper_host, priced, storage_root):
    client = _api(alice)
    got = _post_cluster(client, name="default-on")
    assert got.status_code == 201, got.content
    assert got.json()["pub"] is True and Cluster.objects.get(name="default-on").pub
    got = _post_cluster(client, name="off", pub=False)
    assert got.status_code == 201 and got.json()["pub"] is False
    assert not Cluster.objects.get(name="off").pub
    got = _post_cluster(client, name="bad", pub="yes")
    assert got.status_code == 400
    assert got.json()["fields"]["pub"] == ["Give true or false."]
    got = _post_cluster(client, name="over", volumes=["workspace:/pub/x"])
    assert got.status_code == 400
    assert "/pub/x lies in /pub" in " ".join(got.json()["fields"]["volumes"])
    assert not Cluster.objects.filter(name__in=["bad", "over"]).exists()


def test_the_command_line_takes_pub_and_no_pub(
    alice, paper_host, priced, storage_root, live_server, tmp_path
):
    _, token = ApiToken.issue(user=alice, name="laptop")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path),
           "LANG": "C.UTF-8"}  # fmt: skip

    def cli(*args):
        done = subprocess.run([sys.executable, "-m", "suanli_cli", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert "Traceback" not in done.stderr, done.stderr
        return done

    assert cli("login", "--url", live_server.url, "--token", token).returncode == 0
    base = ["clusters", "create", "--gpu", "a100-80gb", "--image", "suanli/busybox:latest",
            "--release-policy", "never", "--json"]  # fmt: skip
    made = json.loads(cli(*base, "with-pub").stdout)
    assert made["pub"] is True
    made = json.loads(cli(*base, "without-pub", "--no-pub").stdout)
    assert made["pub"] is False and not Cluster.objects.get(name="without-pub").pub
    shown = cli("clusters", "show", str(made["id"])).stdout
    assert "pub:" in shown and "no" in shown.split("pub:")[1].splitlines()[0]
    done = cli(*base, "over", "--pub", "--volume", "workspace:/pub")
    assert done.returncode == 1 and "/pub lies in /pub" in json.dumps(json.loads(done.stdout))

"""A newcomer's first day without a trap (issue 40): the catalog and the new-cluster form say
per image where it can run (on hosts, pulled on first use, being prepared, not available)
and refuse what cannot run, on the form and on the API alike, in words; the app tiles name
only an image that can run here; a new cluster is kept (with its workspace) after its jobs
end unless its owner chose otherwise, and the job form warns when a job will release it."""

import io
import json
import os
from pathlib import Path

import pytest
from browsing import login
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse
from playwright.sync_api import expect

from console.models import ApiToken
from jobs import tasks
from jobs.access import webapps
from jobs.clusters import services
from jobs.hosts import services as host_services
from jobs.management.commands.catalog_prepare import percent_of
from jobs.models import Cluster, Host, Image
from jobs.nodes import workspaces
from jobs.placement import catalog as catalog_mod
from jobs.placement import scheduler
from jobs.runs import dispatch
from tests.forms_data import cluster_form

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
JUPYTER = catalog_mod.JUPYTER_IMAGE
BUSYBOX = "suanli/busybox:latest"


def _image(reference: str) -> Image:
    return Image.objects.get(reference=reference)


def _errors(response, field: str) -> list[str]:
    return list(response.context["form"].errors.get(field, []))


# -- the form and the API -------------------------------------------------------------------


@pytest.mark.django_db
def test_the_form_says_where_each_image_runs_and_refuses_one_no_host_has(
    client, alice, make_paper_host, priced
):
    make_paper_host("gpu-paper-01", images=[BUSYBOX])
    make_paper_host("gpu-paper-02", images=[BUSYBOX])
    client.force_login(alice)
    page = client.get(reverse("cluster_new"))
    where = {i.reference: str(w) for i, w in page.context["form"].image_availability}
    assert where == {
        BUSYBOX: "on 2 host(s)",
        JUPYTER: "not available here",
        "pytorch/pytorch:2.4.0-cuda12.1-cudnn9-runtime": (
            "pulled onto a host on first use (progress on the cluster page)"
        ),
    }
    html = page.content.decode()
    assert f'data-testid="image-where-{_image(JUPYTER).pk}" data-state="none"' in html
    assert "not available here" in html
    # Preselected: an image that runs (the list's first, Busybox, here).
    assert page.context["form"].initial["image"] == str(_image(BUSYBOX).pk)

    refused = client.post(reverse("cluster_new"), cluster_form(image=str(_image(JUPYTER).pk)))
    assert refused.status_code == 200
    assert _errors(refused, "image") == [
        "PyTorch 2.13 + JupyterLab (CPU) is not available here: no host has it and it cannot "
        "be pulled. Pick another image, or ask an operator to put it on a host."
    ]
    assert not Cluster.objects.exists()
    made = client.post(reverse("cluster_new"), cluster_form(image=str(_image(BUSYBOX).pk)))
    assert made.status_code == 302 and Cluster.objects.get().image_reference == BUSYBOX


@pytest.mark.django_db
def test_the_api_refuses_it_with_the_same_words_and_keeps_new_clusters_by_default(
    alice, make_paper_host, priced
):
    make_paper_host("gpu-paper-01")
    _id, token = ApiToken.issue(user=alice, name="script")
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def create(**fields):
        body = {"name": "api-1", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
                "volumes": [], **fields}  # fmt: skip
        return api.post("/api/v1/clusters", json.dumps(body), content_type="application/json")

    refused = create(image=JUPYTER)
    assert refused.status_code == 400
    assert refused.json()["fields"]["image"] == [
        "PyTorch 2.13 + JupyterLab (CPU) is not available here: no host has it and it cannot "
        "be pulled. Pick another image, or ask an operator to put it on a host."
    ]
    made = create(image=BUSYBOX)  # no release_policy given
    assert made.status_code == 201, made.json()
    assert made.json()["release_policy"] == "never"
    assert Cluster.objects.get().release_policy == Cluster.ReleasePolicy.NEVER


@pytest.mark.django_db
def test_an_image_being_prepared_shows_how_far_and_is_refused_until_it_is_on_a_host(
    client, alice, make_paper_host, priced
):
    make_paper_host("gpu-paper-01")
    Image.objects.filter(reference=JUPYTER).update(preparing=40)
    client.force_login(alice)
    page = client.get(reverse("cluster_new"))
    where = {i.reference: str(w) for i, w in page.context["form"].image_availability}
    assert where[JUPYTER] == "being prepared: 40%"
    assert "being prepared: 40%" in page.content.decode()
    refused = client.post(reverse("cluster_new"), cluster_form(image=str(_image(JUPYTER).pk)))
    assert "is being prepared on this machine (40%)" in _errors(refused, "image")[0]
    # Built: the host check records it on the host, and the form offers it.
    Image.objects.filter(reference=JUPYTER).update(preparing=None)
    Host.objects.update(images=[BUSYBOX, JUPYTER])
    made = client.post(reverse("cluster_new"), cluster_form(image=str(_image(JUPYTER).pk)))
    assert made.status_code == 302


@pytest.mark.django_db
def test_a_host_that_is_not_active_does_not_count_and_a_registry_image_is_pulled(
    alice, make_paper_host, catalog, settings
):
    settings.SUANLI_REGISTRY = "172.29.0.1:5443"  # the fast tier runs with no registry set
    make_paper_host("gpu-paper-01", images=[JUPYTER], state=Host.State.DOWN)
    ours = Image.objects.create(
        name="Ours", reference="172.29.0.1:5443/library/ours:1", pullable=False
    )
    found = catalog_mod.availability([_image(JUPYTER), ours])
    assert found[_image(JUPYTER).pk].state == "none"
    assert found[ours.pk].state == "pull"  # Suanli's registry: pulled with our credentials


def test_a_build_scripts_lines_give_its_progress():
    assert percent_of("[jupyter-image 3.1s] packing the layer (352M) (80%)") == 80
    assert percent_of("[torch-image 0.1s] downloading torch==2.13.0 (CPU) (25%)") == 25
    assert percent_of("Collecting numpy (from 1.2%)") is None
    assert percent_of("no progress here") is None


@pytest.mark.django_db
def test_a_build_that_fails_leaves_the_image_not_available_and_says_why(catalog):
    """make run's background build (manage.py catalog_prepare): its lines go to the log, and
    when it fails the form says "not available here", not "being prepared" for ever."""
    out = io.StringIO()
    script = "echo '[jupyter-image 0.1s] unpacking (58%)'; echo 'needs root' >&2; exit 3"
    with pytest.raises(CommandError, match="exited with 3: suanli/jupyter:2.13-cpu is not"):
        call_command("catalog_prepare", JUPYTER, "--", "sh", "-c", script, stdout=out)
    assert "unpacking (58%)" in out.getvalue() and "needs root" in out.getvalue()
    image = _image(JUPYTER)
    assert image.preparing is None
    assert str(catalog_mod.availability([image])[image.pk]) == "not available here"


@pytest.mark.django_db
def test_a_build_stopped_by_make_runs_clean_up_is_not_being_prepared_for_ever(catalog):
    """make run's Ctrl-C SIGTERMs the build's process group: the form then says "not
    available here", not "being prepared: 40%" for ever; and what a build killed outright
    left is cleared when make run starts (catalog_prepare --reset)."""
    out = io.StringIO()
    script = "echo '[jupyter-image 0.1s] unpacking (40%)'; kill -TERM $PPID; exit 0"
    with pytest.raises(SystemExit):
        call_command("catalog_prepare", JUPYTER, "--", "sh", "-c", script, stdout=out)
    image = _image(JUPYTER)
    assert image.preparing is None
    assert str(catalog_mod.availability([image])[image.pk]) == "not available here"

    Image.objects.filter(reference=JUPYTER).update(preparing=40)  # killed with SIGKILL
    call_command("catalog_prepare", "--reset", stdout=out)
    assert _image(JUPYTER).preparing is None
    assert "catalog_prepare --reset" in (Path(__file__).parents[1] / ".ci/dev-run.sh").read_text()


# -- the app tiles --------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_app_tiles_name_only_an_image_that_can_run_here(alice, make_paper_host, make_cluster):
    make_paper_host("gpu-paper-01")
    cluster = make_cluster(alice, "tiles", volumes=())
    note = webapps.image_note(cluster, "jupyter")
    # Busybox has no Python: pip is no advice there.
    assert note == (
        "Busybox (local test image) has no JupyterLab. This image has no Python to install it "
        "with: choose an image with Python, and pip install jupyterlab in its workspace."
    )
    assert "JupyterLab (CPU)" not in webapps.image_note(cluster, "tensorboard")
    Host.objects.update(images=[BUSYBOX, JUPYTER])
    assert webapps.image_note(cluster, "jupyter") == (
        "Busybox (local test image) has no JupyterLab. Create a cluster with an image that "
        "has it (PyTorch 2.13 + JupyterLab (CPU))."
    )
    # A Python image without the app: pip install it there.
    python = Image.objects.create(
        name="Python 3.12", reference="python:3.12-slim", framework="Python 3.12"
    )
    Cluster.objects.filter(pk=cluster.pk).update(image=python, image_reference=python.reference)
    cluster.refresh_from_db()
    assert webapps.image_note(cluster, "jupyter") == (
        "Python 3.12 has no JupyterLab. Create a cluster with an image that has it (PyTorch "
        "2.13 + JupyterLab (CPU)), or pip install jupyterlab in the workspace."
    )
    Cluster.objects.filter(pk=cluster.pk).update(image=_image(JUPYTER), image_reference=JUPYTER)
    cluster.refresh_from_db()
    assert webapps.image_note(cluster, "jupyter") == ""
    assert webapps.image_note(cluster, "tensorboard") == ""


# -- files kept by default ------------------------------------------------------------------


@pytest.mark.django_db
def test_the_form_keeps_the_cluster_by_default(client, alice, make_paper_host, priced):
    make_paper_host("gpu-paper-01")
    client.force_login(alice)
    form = client.get(reverse("cluster_new")).context["form"]
    assert form["release_policy"].value() == "never"
    assert [value for value, _label in form.fields["release_policy"].choices][0] == "never"


@pytest.mark.django_db
def test_the_job_form_warns_when_the_job_will_release_the_cluster(
    client, alice, make_paper_host, make_cluster
):
    make_paper_host("gpu-paper-01")
    kept = make_cluster(alice, "kept")
    going = make_cluster(alice, "going", release_policy=Cluster.ReleasePolicy.AFTER_LAST_JOB)
    client.force_login(alice)
    page = client.get(reverse("job_new", args=[going.pk])).content.decode()
    assert 'data-testid="release-warning"' in page
    assert (
        "going is released when its last job ends: when this job ends and no other job waits, "
        "the cluster and its workspace go, with every file outside its volumes."
    ) in page
    assert "It has no volume: every file goes." in page
    page = client.get(reverse("job_new", args=[kept.pk])).content.decode()
    assert 'data-testid="release-warning"' not in page


def test_a_cluster_is_kept_with_its_workspace_after_its_job_ends(
    make_host, make_cluster, alice, settle_until
):
    """The default (no release policy given): a 2-second job ends, the cluster still runs
    and its workspace, with a file written in it, is still there."""
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2, check="reuse")
    cluster = make_cluster(alice, "first-day", volumes=())
    assert cluster.release_policy == Cluster.ReleasePolicy.NEVER
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.RUNNING, cluster.state_reason
    made = tasks.cluster_network_ensure(cluster.pk)  # its network and workspace
    assert made and "workspace" not in made, made
    container = workspaces.running(cluster, 0)
    made = container.exec_run(["sh", "-c", "echo setup > /tmp/mine && cat /tmp/mine"])
    assert made.output.strip() == b"setup"
    job = services.job_submit(cluster=cluster, spec=services.JobSpec(name="t", command="sleep 2"))
    dispatch.dispatch(cluster.pk)
    assert settle_until(job).state == "succeeded", job.state_reason
    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.RUNNING, cluster.state_reason
    again = workspaces.running(cluster, 0).exec_run(["cat", "/tmp/mine"])
    assert again.output.strip() == b"setup", "the workspace's files are kept"
    services.cluster_release(cluster=cluster)


def test_a_host_check_records_the_catalog_images_its_engine_has(make_host):
    host = make_host("gpu-a-01", engine=0, check=True)
    assert host.state == Host.State.ACTIVE, host.last_error
    assert BUSYBOX in host.images
    assert all(Image.objects.filter(reference=ref).exists() for ref in host.images)
    again = host_services.host_check(host_id=host.pk)
    assert again.images == host.images


# -- the pages, in Chinese ------------------------------------------------------------------


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)  # the live server's thread reads the data
def test_the_forms_in_chinese_at_desktop_and_phone_widths(
    browser, live_server, alice, make_paper_host, make_cluster, priced
):
    make_paper_host("gpu-paper-01")
    going = make_cluster(alice, "going", release_policy=Cluster.ReleasePolicy.AFTER_LAST_JOB)
    scheduler.place_pending()  # running on the paper host: its page shows the app tiles
    for width in (1366, 390):
        context = browser.new_context(
            viewport={"width": width, "height": 900}, locale="zh-CN", timezone_id="Asia/Shanghai"
        )
        page = context.new_page()
        login(page, live_server, "alice", "alice-pass-123")
        page.goto(f"{live_server.url}{reverse('cluster_new')}")
        where = page.get_by_test_id(f"image-where-{_image(JUPYTER).pk}")
        expect(where).to_contain_text("此处不可用")
        page.select_option("#id_image", str(_image(JUPYTER).pk))
        page.fill("#id_name", f"zh-{width}")
        page.click(".cluster-form button[type=submit]")
        expect(page.locator(".cluster-form")).to_contain_text("在此处不可用：没有主机有这个镜像")
        page.screenshot(path=f"{SHOTS}/catalog_cluster_new-zh-{width}.png", full_page=True)
        page.goto(f"{live_server.url}{reverse('job_new', args=[going.pk])}")
        expect(page.get_by_test_id("release-warning")).to_be_visible()
        page.screenshot(path=f"{SHOTS}/catalog_job_new-zh-{width}.png", full_page=True)
        page.goto(f"{live_server.url}{reverse('cluster_detail', args=[going.pk])}")
        note = page.get_by_test_id("app-image-note-jupyter-0")
        expect(note).to_have_text(
            "Busybox (local test image) 不含 JupyterLab。此镜像没有可用来安装它的 Python：请选择带 "
            "Python 的镜像，并在其工作区中 pip install jupyterlab。"
        )
        page.get_by_test_id("cluster-apps").screenshot(
            path=f"{SHOTS}/catalog_cluster_apps-zh-{width}.png"
        )
        context.close()

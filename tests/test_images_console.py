"""Own images in the console: the Images page, a build's page and its live socket, the API,
the cluster form's "Your images", pull progress and "Save as image" on the cluster page.
Alice owns; bob is another researcher, to whom none of hers exists. The build worker is
not needed here (tests/test_images_browser.py runs real builds): rows are made directly
where a page only reads them, and builds are queued through the real jobs/images/builds.py."""

import hashlib
import json

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.core.exceptions import ValidationError
from django.test import Client
from django.urls import reverse
from forms_data import cluster_form

from console.asgi import application
from console.models import ApiToken
from jobs.images import builds
from jobs.models import Cluster, Image, ImageBuild, OwnImage
from jobs.nodes import registry
from jobs.placement import scheduler

pytestmark = pytest.mark.django_db

DOCKERFILE = "FROM suanli/busybox:latest\nRUN echo hi > /hi\nENV A=1\nWORKDIR /workspace\n"


def _own(owner, name="my-torch", tag="v1", size=1_200_000_000, **extra) -> OwnImage:
    """An image as a finished build leaves it (the registry is not asked by these pages)."""
    reference = registry.reference(owner.pk, name, tag)
    digest = "sha256:" + hashlib.sha256(reference.encode()).hexdigest()
    return OwnImage.objects.create(
        owner=owner, name=name, tag=tag, reference=reference, digest=digest, size_bytes=size,
        layers=[[digest, size]], **extra,
    )  # fmt: skip


def _build(owner, **fields) -> ImageBuild:
    fields.setdefault("name", "my-torch")
    fields.setdefault("tag", "v1")
    fields.setdefault("dockerfile", DOCKERFILE)
    return ImageBuild.objects.create(owner=owner, **fields)


def _client(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def _api(user):
    _, token = ApiToken.issue(user=user, name="script")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def call(method, path, body=None):
        response = client.generic(
            method, f"/api/v1/{path}", json.dumps(body or {}), content_type="application/json"
        )
        return response.status_code, (response.json() if response.content else None)

    return call


# -- the Images page --------------------------------------------------------------------


@pytest.mark.engine  # the registry's configuration (own images)
def test_the_images_page_lists_ones_own_images_quota_builds_and_users(
    alice, bob, paper_host, make_cluster, priced, django_assert_max_num_queries
):
    torch = _own(alice, source="save", source_note="node 0 of train-1")
    _own(alice, "tools", "latest", size=340_000_000)
    theirs = _own(bob, "secret", "v9")
    cluster = make_cluster(alice, "uses-it", image_reference=torch.reference, own_image=torch)
    done = _build(alice, state="succeeded", image=torch)
    _build(bob, name="secret", tag="v9")

    client = _client(alice)
    # The quota's saved system disks: one query; the person's teams (the switcher): one.
    with django_assert_max_num_queries(16):
        body = client.get(reverse("image_list")).content.decode()
    assert "my-torch:v1" in body and "tools:latest" in body
    assert f'<code class="copyable" data-testid="image-reference">{torch.reference}</code>' in body
    assert "1.2 GB" in body and "340 MB" in body and torch.digest[7:19] in body
    assert "2 of 20 images · 1.5 GB of 50 GB" in body
    assert "saved from a workspace" in body and "node 0 of train-1" in body
    assert f'<a href="{reverse("cluster_detail", args=[cluster.pk])}">uses-it</a>' in body
    assert reverse("image_build", args=[done.pk]) in body
    assert 'class="on">Images</a>' in body  # the nav says where we are
    assert "secret" not in body and theirs.reference not in body
    # The form starts with an example in the seed's style, FROM the catalog's first image.
    first = Image.objects.filter(active=True).first()
    assert f"FROM {first.reference}\n" in body and "WORKDIR /workspace" in body
    assert 'value="latest"' in body  # the tag's default

    other = _client(bob).get(reverse("image_list")).content.decode()
    assert "secret:v9" in other and "my-torch" not in other


def test_without_a_registry_the_page_says_the_operator_configured_none(alice, settings):
    settings.SUANLI_REGISTRY = ""
    client = _client(alice)
    body = client.get(reverse("image_list")).content.decode()
    assert "the operator has not configured an image registry" in body
    assert 'data-testid="build-form"' not in body
    answer = client.post(
        reverse("image_list"), {"name": "x", "tag": "v1", "dockerfile": DOCKERFILE}, follow=True
    )
    assert "the operator has not configured an image registry" in answer.content.decode()
    assert not ImageBuild.objects.exists()


@pytest.mark.engine  # the registry's configuration (own images)
def test_the_build_form_says_what_is_wrong_per_field(alice, catalog, storage_root):
    client = _client(alice)
    url = reverse("image_list")
    form = {"name": "My Torch", "tag": "-v1", "dockerfile": DOCKERFILE, "context": "",
            "build_args": "TORCH=2.4\nnot a line\n1X=2\nTORCH=2.5"}  # fmt: skip
    response = client.post(url, form)
    errors = response.context["form"].errors
    assert "lower-case letters and digits" in errors["name"][0]
    assert "not starting with a dot or dash" in errors["tag"][0]
    assert errors["build_args"] == [
        "Line 2: write KEY=VALUE, e.g. TORCH_VERSION=2.4.0.",
        "Line 3: '1X' is not an argument name (letters, digits, _; not starting with a digit).",
        "Line 4: TORCH is set twice.",
    ]
    # The engine's own checks (jobs/images/builds.build_create) land on their fields too.
    form.update(name="my-torch", tag="v1", build_args="", dockerfile="FROM evil/miner:latest\n")
    errors = client.post(url, form).context["form"].errors
    assert errors["dockerfile"][0].startswith("FROM evil/miner:latest: builds start from")
    form.update(dockerfile=DOCKERFILE, context="no-such-folder")
    errors = client.post(url, form).context["form"].errors
    assert errors["context"] == ["There is no folder 'no-such-folder' in your storage."]
    assert not ImageBuild.objects.exists()

    form.update(context="", build_args="TORCH=2.4\n# a comment\n\nCUDA=12.1")
    response = client.post(url, form)
    build = ImageBuild.objects.get()
    assert response.status_code == 302 and response.url == reverse("image_build", args=[build.pk])
    assert (build.owner, build.name, build.tag, build.state) == (alice, "my-torch", "v1", "queued")
    assert build.build_args == {"TORCH": "2.4", "CUDA": "12.1"} and build.dockerfile == DOCKERFILE


@pytest.mark.engine  # the registry's configuration (own images)
def test_add_of_a_url_is_refused_by_the_form_and_the_api_with_how_to_download(alice, catalog):
    """The engine would fetch it from the build host's own networks (tests/
    test_images_attacks.py has the canaries): the form and the API answer with the
    sentence that says to download in RUN, and nothing is queued."""
    sentence = "Download it in a RUN step instead, e.g. RUN curl -fsSLo /got.txt"
    for dockerfile in (
        "FROM suanli/busybox:latest\nADD http://127.0.0.1:8000/admin/login/ /got.txt\n",
        'FROM suanli/busybox:latest\nadd ["HTTP://172.29.0.1:8000/", "/got.txt"]\n',
        "FROM suanli/busybox:latest\nARG URL\nADD --chown=1:1 $URL /got.txt\n",
    ):
        form = {"name": "fetch", "tag": "v1", "dockerfile": dockerfile, "context": ""}
        response = _client(alice).post(reverse("image_list"), form)
        assert response.status_code == 400
        assert sentence in response.context["form"].errors["dockerfile"][0], dockerfile
        status, body = _api(alice)(
            "POST", "images/builds", {"name": "fetch", "dockerfile": dockerfile}
        )
        assert status == 400 and sentence in body["fields"]["dockerfile"][0], body
    assert not ImageBuild.objects.exists()


@pytest.mark.engine  # the registry's configuration (own images)
def test_the_build_form_needs_csrf(alice, catalog):
    strict = Client(enforce_csrf_checks=True)
    strict.force_login(alice)
    form = {"name": "my-torch", "tag": "v1", "dockerfile": DOCKERFILE}
    assert strict.post(reverse("image_list"), form).status_code == 403
    assert not ImageBuild.objects.exists()
    strict.get(reverse("image_list"))  # the page sets the token's cookie
    token = strict.cookies["csrftoken"].value
    answer = strict.post(reverse("image_list"), {**form, "csrfmiddlewaretoken": token})
    assert answer.status_code == 302 and ImageBuild.objects.filter(owner=alice).count() == 1


def test_an_image_in_use_is_not_deleted_and_anothers_is_not_found(
    alice, bob, paper_host, make_cluster, priced
):
    torch = _own(alice)
    make_cluster(alice, "uses-it", image_reference=torch.reference, own_image=torch)
    client = _client(alice)
    body = client.post(reverse("image_delete", args=[torch.pk]), follow=True).content.decode()
    assert "my-torch:v1 is used by cluster uses-it: release it first." in body
    assert OwnImage.objects.filter(pk=torch.pk).exists()
    assert client.get(reverse("image_delete", args=[torch.pk])).status_code == 405
    assert _client(bob).post(reverse("image_delete", args=[torch.pk])).status_code == 404
    assert OwnImage.objects.filter(pk=torch.pk).exists()


# -- a build's page and its socket ----------------------------------------------------------


def test_a_build_page_shows_state_step_progress_error_and_log_to_its_owner_only(alice, bob):
    failed = _build(
        alice, state="failed", step="Step 2/4 : RUN false",
        error="The command '/bin/sh -c false' returned a non-zero code: 1",
        log="Step 1/4 : FROM suanli/busybox:latest\nStep 2/4 : RUN false\n<b>not markup</b>",
    )  # fmt: skip
    url = reverse("image_build", args=[failed.pk])
    body = _client(alice).get(url).content.decode()
    assert 'data-testid="build-state">failed<' in body
    assert "Step 2/4 : RUN false</p>" in body
    assert "returned a non-zero code: 1" in body
    assert "Step 1/4 : FROM suanli/busybox:latest\nStep 2/4 : RUN false\n&lt;b&gt;" in body
    assert "build_log.js" not in body  # ended: nothing to follow
    assert _client(bob).get(url).status_code == 404
    assert Client().get(url).status_code == 302  # to the log-in page

    torch = _own(alice)
    pushing = _build(alice, state="pushing", done_bytes=340_000_000, total_bytes=1_200_000_000)
    body = _client(alice).get(reverse("image_build", args=[pushing.pk])).content.decode()
    assert "pushed 340 MB of 1.2 GB" in body and "build_log.js" in body
    assert f'data-ws="/ws/images/builds/{pushing.pk}/log/"' in body
    done = _build(alice, state="succeeded", image=torch, total_bytes=1, done_bytes=1)
    body = _client(alice).get(reverse("image_build", args=[done.pk])).content.decode()
    assert f'<code class="copyable">{torch.reference}</code>' in body


def _socket(build, user, query=""):
    socket = WebsocketCommunicator(
        application,
        f"/ws/images/builds/{build.pk}/log/{query}",
        headers=[(b"origin", b"http://localhost")],
    )
    if user is not None:
        socket.scope["user"] = user
    return socket


@pytest.mark.django_db(transaction=True)  # the consumer reads through its own connection
def test_the_build_socket_is_the_owners_and_sends_each_line_once(alice, bob):
    build = _build(alice, state="running", step="Step 2/3 : RUN make", log="one\ntwo")
    group = builds.group_for(build.pk)
    layer = get_channel_layer()

    async def scenario():
        for user, code in ((bob, 4404), (None, 4401)):
            refused, got = await _socket(build, user).connect()
            assert not refused and got == code
        # Nobody but the owner joined the group: a message to it reaches only her socket.
        mine = _socket(build, alice)
        connected, _ = await mine.connect()
        assert connected
        assert await mine.receive_json_from(timeout=5) == {"lines": [[1, "one"], [2, "two"]]}
        state = await mine.receive_json_from(timeout=5)
        assert state["state"] == "running" and state["step"] == "Step 2/3 : RUN make"
        # A batch the worker published around the join: the lines sent already are dropped.
        await layer.group_send(group, {"type": "build.lines", "lines": [[2, "two"], [3, "3"]]})
        assert await mine.receive_json_from(timeout=5) == {"lines": [[3, "3"]]}
        await layer.group_send(group, {"type": "build.lines", "lines": [[3, "3"], [4, "four"]]})
        assert await mine.receive_json_from(timeout=5) == {"lines": [[4, "four"]]}
        later = _socket(build, alice, "?after=1")  # a page that shows line 1 already
        assert (await later.connect())[0]
        assert await later.receive_json_from(timeout=5) == {"lines": [[2, "two"]]}
        assert (await later.receive_json_from(timeout=5))["state"] == "running"
        await later.disconnect()
        end = {
            "type": "build.state", "state": "failed", "step": "Step 3/3 : RUN false",
            "done_bytes": 0, "total_bytes": 0, "error": "RUN false failed", "image": "",
        }  # fmt: skip
        await layer.group_send(group, end)
        message = await mine.receive_json_from(timeout=5)
        assert message["state"] == "failed" and message["error"] == "RUN false failed"
        assert "type" not in message
        # Lines the worker flushes right after its final state still come; then it closes.
        await layer.group_send(group, {"type": "build.lines", "lines": [[5, "ERROR: five"]]})
        assert await mine.receive_json_from(timeout=5) == {"lines": [[5, "ERROR: five"]]}
        assert (await mine.receive_output(timeout=5))["type"] == "websocket.close"

    async_to_sync(scenario)()


# -- the API ----------------------------------------------------------------------------


@pytest.mark.engine  # the registry's configuration (own images)
def test_the_api_lists_builds_follows_and_deletes_ones_own_only(
    alice, bob, paper_host, make_cluster, priced
):
    api, other = _api(alice), _api(bob)
    torch = _own(alice)
    cluster = make_cluster(alice, "uses-it", image_reference=torch.reference, own_image=torch)
    status, body = api("GET", "images")
    assert status == 200 and body["enabled"] is True
    assert body["quota"] == {
        "count": 1, "max_count": 20, "bytes": 1_200_000_000, "max_bytes": 50_000_000_000
    }  # fmt: skip
    (listed,) = body["images"]
    assert listed["reference"] == torch.reference and listed["clusters"] == [cluster.pk]
    assert other("GET", "images")[1]["images"] == []

    status, body = other("DELETE", f"images/{torch.pk}")
    assert status == 404 and body["error"] == "Not found."
    status, body = api("DELETE", f"images/{torch.pk}")
    assert (
        status == 409
        and body["error"] == "my-torch:v1 is used by cluster uses-it: release it first."
    )

    status, body = api("POST", "images/builds", {"name": "Bad", "dockerfile": "RUN true"})
    assert status == 400 and set(body["fields"]) == {"name", "dockerfile"}
    status, body = api("POST", "images/builds", {"name": "x", "dockerfile": DOCKERFILE,
                                                 "build_args": {"A": 1}})  # fmt: skip
    assert status == 400 and body["fields"] == {"build_args": ["Give a string."]}
    status, body = api("POST", "images/builds", {"name": "tools", "dockerfile": DOCKERFILE,
                                                 "build_args": {"A": "1"}})  # fmt: skip
    assert status == 201 and body["state"] == "queued" and body["tag"] == "latest"
    assert body["lines"] == [] and body["image"] is None
    assert body["url"].endswith(reverse("image_build", args=[body["id"]]))
    build = ImageBuild.objects.get(pk=body["id"])
    assert build.owner == alice and build.build_args == {"A": "1"}

    ImageBuild.objects.filter(pk=build.pk).update(state="failed", log="a\nb\nc", error="no")
    status, body = api("GET", f"images/builds/{build.pk}")
    assert [line["text"] for line in body["lines"]] == ["a", "b", "c"]
    status, body = api("GET", f"images/builds/{build.pk}?after=2")
    assert body["lines"] == [{"seq": 3, "text": "c"}] and body["error"] == "no"
    assert other("GET", f"images/builds/{build.pk}")[0] == 404
    assert api("GET", f"images/builds/{build.pk}?after=x")[0] == 400

    # Saving a workspace: another's cluster does not exist; a pending one has none yet.
    status, body = other("POST", f"clusters/{cluster.pk}/nodes/0/save-image", {"name": "x"})
    assert status == 404
    status, body = api("POST", f"clusters/{cluster.pk}/nodes/0/save-image", {"name": "env"})
    assert status == 400 and "running or stopped cluster" in body["error"]


# -- the cluster form: "Your images" ----------------------------------------------------------


@pytest.mark.engine  # the registry's configuration (own images)
def test_the_cluster_form_offers_ones_own_images_and_refuses_anothers(
    alice, bob, paper_host, priced
):
    torch = _own(alice)
    theirs = _own(bob, "secret", "v9")
    client, url = _client(alice), reverse("cluster_new")
    body = client.get(url).content.decode()
    assert '<optgroup label="Your images">' in body
    assert f'<option value="own:{torch.pk}">my-torch:v1</option>' in body
    assert "secret" not in body

    # Chosen from the list.
    response = client.post(url, cluster_form(name="own-pick", image=f"own:{torch.pk}"))
    assert response.status_code == 302, response.context["form"].errors
    picked = Cluster.objects.get(name="own-pick")
    assert (picked.own_image, picked.image_reference, picked.image) == (
        torch,
        torch.reference,
        None,
    )
    # Typed as a custom reference: the same as choosing it.
    response = client.post(
        url, cluster_form(name="own-typed", image="custom", custom_image=torch.reference)
    )
    assert response.status_code == 302, response.context["form"].errors
    assert Cluster.objects.get(name="own-typed").own_image == torch

    # Bob's image, by its reference or by its choice, and a name nobody has: refused.
    for custom in (theirs.reference, registry.reference(alice.pk, "nope", "v1")):
        response = client.post(
            url, cluster_form(name="theirs", image="custom", custom_image=custom)
        )
        assert response.context["form"].errors["custom_image"] == [
            f"No image {custom} among your images."
        ]
    response = client.post(url, cluster_form(name="theirs", image=f"own:{theirs.pk}"))
    assert "Select a valid choice" in response.context["form"].errors["image"][0]
    assert not Cluster.objects.filter(name="theirs").exists()


@pytest.mark.engine  # the registry's configuration (own images)
def test_the_api_maps_an_own_reference_and_refuses_anothers(alice, bob, paper_host, priced):
    torch = _own(alice)
    request = {"name": "from-api", "gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 1,
               "image": torch.reference, "release_policy": "never"}  # fmt: skip
    status, body = _api(bob)("POST", "clusters", request)
    assert status == 400 and body["fields"] == {
        "image": [f"No image {torch.reference} among your images."]
    }
    status, body = _api(alice)("POST", "clusters", request)
    assert status == 201 and body["image"] == torch.reference
    assert Cluster.objects.get(pk=body["id"]).own_image == torch


@pytest.mark.engine  # the registry's configuration (own images)
def test_no_typed_reference_and_no_catalog_image_names_a_researchers_image(alice, settings):
    from jobs.base.validators import validate_image_reference

    ref = f"{settings.SUANLI_REGISTRY}/u{alice.pk}/my-torch:v1"
    for value in (ref, ref.replace(f":{settings.SUANLI_REGISTRY.split(':')[1]}", ""), f"{ref}x"):
        with pytest.raises(ValidationError, match="usable by its owner only"):
            validate_image_reference(value)
    with pytest.raises(ValidationError, match="usable by its owner only"):
        Image(name="stolen", reference=ref).full_clean()
    validate_image_reference(f"{settings.SUANLI_REGISTRY}/library/base:1")  # not a tenant's


# -- the cluster page: pulls and "Save as image" ----------------------------------------------


@pytest.mark.engine  # the registry's configuration (own images)
def test_the_cluster_page_shows_image_pulls_and_saves_a_node_as_an_image(
    alice, bob, paper_host, make_cluster, priced
):
    cluster = make_cluster(alice, "saver", release_policy="never")
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running"
    Cluster.objects.filter(pk=cluster.pk).update(
        image_pulls={
            "gpu-a-01": {"state": "pulling", "done": 340_000_000, "total": 1_200_000_000},
            "gpu-b-01": {"state": "failed", "done": 0, "total": 0, "message": "manifest unknown"},
            "gpu-c-01": {"state": "pulled", "done": 5, "total": 5},
        }
    )
    client = _client(alice)
    status = client.get(reverse("cluster_status", args=[cluster.pk])).content.decode()
    assert "Pulling the image on <strong>gpu-a-01</strong>: 340 MB of 1.2 GB" in status
    assert '<progress max="1200000000" value="340000000">' in status
    assert "Pulling the image on <strong>gpu-b-01</strong> failed: manifest unknown" in status
    assert "gpu-c-01" not in status
    Cluster.objects.filter(pk=cluster.pk).update(image_pulls={"gpu-a-01": {"state": "pulled"}})
    status = client.get(reverse("cluster_status", args=[cluster.pk])).content.decode()
    assert "image-pulls" not in status

    page = client.get(reverse("cluster_detail", args=[cluster.pk])).content.decode()
    save = reverse("node_save_image", args=[cluster.pk, 0])
    assert f'action="{save}"' in page and 'data-testid="save-image-0"' in page
    # The node's workspace is not up (no engine behind this host): said on the cluster page.
    body = client.post(save, {"name": "my-env", "tag": "v1"}, follow=True).content.decode()
    assert "Save as image: Node 0 has no workspace to save." in body
    body = client.post(save, {"name": "My Env", "tag": "v1"}, follow=True).content.decode()
    assert "Save as image: name: Use lower-case letters" in body
    assert _client(bob).post(save, {"name": "my-env", "tag": "v1"}).status_code == 404

    cluster.node_set.update(workspace_container="f" * 64)  # as the workspace start leaves it
    response = client.post(save, {"name": "my-env", "tag": "v1"})
    build = ImageBuild.objects.get()
    assert response.status_code == 302 and response.url == reverse("image_build", args=[build.pk])
    assert (build.kind, build.cluster, build.node_index, build.state) == (
        "save",
        cluster,
        0,
        "queued",
    )
    page = client.get(response.url).content.decode()
    assert "Node 0's workspace of" in page and ">saver</a> saved as an image" in page

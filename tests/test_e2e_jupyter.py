"""`make e2e`: the catalog's notebook image, suanli/jupyter:2.13-cpu (.ci/jupyter-image.sh,
which make e2e runs), in a node's workspace: JupyterLab and TensorBoard run as the tenant's
uid in the hardened container, and a researcher reaches them through the console in
Chromium, each on its own origin (c<id>-n0-jupyter.apps.localhost, console/app_origin.py),
runs a cell and reads its result.
"""

import json
import os
import socket
import textwrap
from types import SimpleNamespace

import pytest
from browsing import free_port
from browsing import login as browser_login
from django.urls import reverse
from playwright.sync_api import expect
from waiting import until

from console import app_origin
from jobs import tasks
from jobs.files import storage
from jobs.files.storage import VolumeSpec
from jobs.models import Image
from jobs.nodes import runtime, workspaces

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

JUPYTER_IMAGE = os.environ.get("SUANLI_JUPYTER_IMAGE", "suanli/jupyter:2.13-cpu")
SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
# A training script's scalars, written the way a PyTorch researcher writes them.
SCALARS = textwrap.dedent(
    """
    from torch.utils.tensorboard import SummaryWriter
    with SummaryWriter("/workspace/runs/demo") as writer:
        for step in range(20):
            writer.add_scalar("loss", 1 / (step + 1), step)
    print("scalars written")
    """
)
# Run inside the workspace (its own loopback): JupyterLab's REST API, then 6*7 in a kernel
# through the server's websocket, then the scalars, then TensorBoard's list of them.
PROBE = textwrap.dedent(
    """
    import json, sys, time, urllib.request, uuid
    import websocket
    jupyter, token, tensorboard = sys.argv[1:4]
    def get(url, data=None):
        headers = {"Authorization": f"token {token}"}
        request = urllib.request.Request(url, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.read()
    def until_up(url):
        for _ in range(600):
            try:
                return get(url)
            except OSError:
                time.sleep(0.2)
        return get(url)
    print("api", json.loads(until_up(f"http://{jupyter}api"))["version"])
    print("lab page", b"JupyterLab" in get(f"http://{jupyter}lab"))
    kernel = json.loads(get(f"http://{jupyter}api/kernels", data=b"{}"))["id"]
    socket = websocket.create_connection(
        f"ws://{jupyter}api/kernels/{kernel}/channels",
        header=[f"Authorization: token {token}"], timeout=120,
    )
    def run(code):
        msg_id = uuid.uuid4().hex
        header = {"msg_id": msg_id, "msg_type": "execute_request", "username": "",
                  "session": uuid.uuid4().hex, "version": "5.3"}
        content = {"code": code, "silent": False}
        socket.send(json.dumps({"header": header, "parent_header": {}, "metadata": {},
                                "channel": "shell", "content": content}))
        seen = []
        while True:
            message = json.loads(socket.recv())
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "execute_result":
                seen.append(content["data"]["text/plain"])
            elif kind == "stream":
                seen.append(content["text"].strip())
            elif kind == "error":
                seen.append(content["ename"] + ": " + content["evalue"])
            elif kind == "status" and content["execution_state"] == "idle":
                return seen
    print("cell", run("6*7"))
    print("cell", run("%run /workspace/scalars.py"))
    for _ in range(300):  # TensorBoard reads its logdir again every few seconds
        tags = json.loads(until_up(f"http://{tensorboard}/data/plugin/scalars/tags"))
        if tags.get("demo"):
            break
        time.sleep(0.2)
    print("tensorboard", sorted(tags.get("demo", {})))
    """
)


@pytest.fixture
def jupyter_cluster(running_cluster, alice):
    """A running 1-node cluster on the notebook image, a storage folder at /workspace (its
    HOME) with the scalars script, and its workspace up."""
    image, _ = Image.objects.get_or_create(  # the catalog's entry, unless the env names another
        reference=JUPYTER_IMAGE, defaults={"name": f"{JUPYTER_IMAGE} (local)"}
    )
    # The whole host (two emulated GPUs): its workspace's share of this machine's two cores
    # is half a core, which a JupyterLab server, a kernel and TensorBoard share.
    cluster = running_cluster(1, gpus=2, volumes=(VolumeSpec(source="work", target="/workspace"),))
    cluster.image_reference = image.reference
    cluster.save(update_fields=["image_reference"])
    made = tasks.cluster_network_ensure(cluster.pk)
    assert made and "workspace" not in made, made
    folder = storage.tenant_root(alice.pk) / "work"
    (folder / "scalars.py").write_text(SCALARS)
    return cluster


def test_a_workspace_on_the_image_serves_jupyterlab_and_tensorboard_as_its_tenant(
    jupyter_cluster, alice
):
    cluster = jupyter_cluster
    workspace = workspaces.running(cluster, 0)
    uid = runtime.tenant_uid(alice.pk)
    as_tenant = {"user": f"{uid}:{uid}", "environment": {"HOME": "/workspace"}}
    token = "a-token-of-the-test"
    # The arguments are the test's own: a shell only for the log's redirection.
    workspace.exec_run(
        [
            "sh",
            "-c",
            "exec jupyter lab --no-browser --ip=127.0.0.1 --port=8888 --ServerApp.root_dir=/workspace"
            f" --ServerApp.base_url=/ --IdentityProvider.token={token}"
            " >/tmp/jupyter.log 2>&1",
        ],
        detach=True,
        **as_tenant,
    )
    workspace.exec_run(
        [
            "sh",
            "-c",
            "exec tensorboard --logdir=/workspace/runs --host=127.0.0.1 --port=6006"
            " >/tmp/tensorboard.log 2>&1",
        ],
        detach=True,
        **as_tenant,
    )
    code, out = workspace.exec_run(
        [
            "python3",
            "-c",
            PROBE,
            "127.0.0.1:8888/",
            token,
            "127.0.0.1:6006",
        ],
        **as_tenant,
    )
    logs = workspace.exec_run(["sh", "-c", "tail -n 30 /tmp/jupyter.log /tmp/tensorboard.log"])
    text = out.decode()
    assert code == 0, (text, logs.output.decode())
    lines = text.splitlines()
    assert "lab page True" in lines, text
    assert "cell ['42']" in lines, text
    assert "cell ['scalars written']" in lines, text
    assert "tensorboard ['loss']" in lines, text
    # Everything it wrote is the tenant's, in the tenant's folder or the container's /tmp.
    found = storage.tenant_root(alice.pk) / "work"
    assert (found / "runs" / "demo").is_dir()
    owners = {p.stat().st_uid for p in found.rglob("*") if p.name != "scalars.py"}
    assert owners == {uid}, owners
    # Kernels' connection files: on the container's own /tmp (the image's JUPYTER_RUNTIME_DIR).
    code, out = workspace.exec_run(["stat", "-c", "%u", "/tmp/jupyter-runtime"])
    assert (code, out.decode().strip()) == (0, str(uid)), out


def _listens(port) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _open(context, page, kind):
    """The app of node 0 from its tile, once the tile says it answers: a tab of its own."""
    expect(page.get_by_test_id(f"app-state-{kind}-0")).to_have_text("answering", timeout=120_000)
    with context.expect_page() as opened:
        page.get_by_test_id(f"open-{kind}-0").click()
    return opened.value


@pytest.mark.browser
def test_jupyterlab_and_tensorboard_of_a_node_through_the_console_in_chromium(
    jupyter_cluster, processes, alice, browser
):
    cluster = jupyter_cluster
    port = free_port()
    processes.start("web", env={"PORT": str(port)})
    url = f"http://127.0.0.1:{port}"
    until(lambda: _listens(port), timeout=20, what="the web process listens")
    page_url = f"{url}{reverse('cluster_detail', args=[cluster.pk])}"
    context = browser.new_context(viewport={"width": 1366, "height": 800})
    try:
        page = context.new_page()
        browser_login(page, SimpleNamespace(url=url), "alice", "alice-pass-123")
        page.goto(page_url)
        page.get_by_test_id("start-jupyter-0").click()
        expect(page.get_by_text("JupyterLab is starting")).to_be_visible()
        lab = _open(context, page, "jupyter")
        lab_origin = f"http://{app_origin.app_host(cluster.pk, 0, 'jupyter')}:{port}/"
        assert lab.url.startswith(lab_origin), lab.url
        card = lab.locator(".jp-LauncherCard[data-category='Notebook']").first
        expect(card).to_be_visible(timeout=120_000)
        card.click()  # a new notebook, on a new kernel
        notebook = lab.locator(".jp-NotebookPanel").first
        expect(lab.get_by_text("Python 3 (ipykernel) | Idle")).to_be_visible(timeout=120_000)
        first = notebook.locator(".jp-Cell .cm-content").first
        first.fill("6*7")
        first.press("Shift+Enter")
        expect(notebook.locator(".jp-OutputArea-output").first).to_have_text("42", timeout=60_000)
        second = notebook.locator(".jp-Cell .cm-content").nth(1)
        second.fill("%run /workspace/scalars.py")  # torch writes TensorBoard's scalars
        second.press("Shift+Enter")
        expect(notebook.locator(".jp-OutputArea-output").nth(1)).to_have_text(
            "scalars written", timeout=120_000
        )
        lab.keyboard.press("Control+s")  # the first save asks for a name
        lab.get_by_role("textbox", name="File name").fill("hello.ipynb")
        lab.get_by_role("button", name="Rename and Save").click()
        saved = storage.tenant_root(alice.pk) / "work" / "hello.ipynb"
        until(saved.exists, timeout=20, what="the notebook is saved in the storage folder")
        cells = json.loads(saved.read_text())["cells"]
        assert "".join(cells[0]["outputs"][0]["data"]["text/plain"]) == "42", cells[0]
        expect(lab.locator(".jp-DirListing-item", has_text="hello.ipynb")).to_be_visible()
        lab.screenshot(path=f"{SHOTS}/jupyterlab.png")

        page.bring_to_front()
        expect(page.get_by_test_id("logdir-0")).to_have_value("/workspace/runs")
        page.get_by_test_id("start-tensorboard-0").click()
        expect(page.get_by_text("TensorBoard is starting reading /workspace/runs")).to_be_visible()
        board = _open(context, page, "tensorboard")
        page.get_by_test_id("cluster-apps").screenshot(path=f"{SHOTS}/cluster_apps.png")
        board_origin = f"http://{app_origin.app_host(cluster.pk, 0, 'tensorboard')}:{port}/"
        assert board.url.startswith(board_origin), board.url
        expect(board).to_have_title("TensorBoard", timeout=60_000)
        expect(board.get_by_text("loss").first).to_be_visible(timeout=60_000)
        board.screenshot(path=f"{SHOTS}/tensorboard.png")
    finally:
        context.close()

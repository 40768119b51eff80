"""A real build, followed as a researcher follows it: the Procfile's web process (ASGI, the
build page's websocket) and its `builder` (the queue "builds"), a build host on a real
engine, the real registry. The build page shows the log line by line while the build runs;
`suanli images build` prints it the same way and exits with the build's outcome."""

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests
from browsing import free_port
from playwright.sync_api import expect
from waiting import until

from console.models import ApiToken
from jobs.images import builds
from jobs.models import ImageBuild, OwnImage

pytestmark = pytest.mark.django_db(transaction=True)

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
ROOT = Path(__file__).resolve().parent.parent


def counting() -> str:
    """Five lines a second apart. The engines outlive a test run and its user ids (u1 is
    alice again next run): a fresh ENV first, so that the engine's build cache cannot
    answer the RUN step without running it."""
    return (
        "FROM suanli/busybox:latest\n"
        f"ENV RUN_ID={uuid.uuid4().hex}\n"
        "RUN for i in 1 2 3 4 5; do echo line-$i; sleep 1; done\n"
        "WORKDIR /workspace\n"
    )


@pytest.fixture
def console(processes, make_host):
    """A build host on engine a, and the web process; the builder starts when a test says."""
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2, build_host=True, check="reuse")
    port = free_port()
    processes.start("web", env={"PORT": str(port)})
    for _ in range(100):  # the web process takes a moment to listen
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    return f"http://127.0.0.1:{port}"


def _log_lines(page) -> list[str]:
    return page.locator("#log").inner_text().splitlines()


@pytest.mark.browser
def test_the_build_page_shows_the_log_line_by_line_while_the_build_runs(
    console, processes, alice, browser
):
    build = builds.build_create(owner=alice, name="counting", tag="v1", dockerfile=counting())
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    try:
        page = context.new_page()
        page.goto(f"{console}/login/")
        page.fill("#id_username", "alice")
        page.fill("#id_password", "alice-pass-123")
        page.click("button[type=submit]")
        page.wait_for_url(f"{console}/")
        page.goto(f"{console}/images/builds/{build.pk}/")
        expect(page.get_by_test_id("build-state")).to_have_text("queued")
        page.evaluate("() => { window.notReloaded = true; }")

        processes.start("builder")  # the page is open, following: now the build runs
        expect(page.locator("#log")).to_contain_text("line-1", timeout=60_000)
        # line-1 is on the page while the build still runs and before line-5 was printed.
        assert "line-5" not in _log_lines(page)
        build.refresh_from_db()
        assert build.state == "running", build.state
        expect(page.get_by_test_id("build-state")).to_have_text("running")
        expect(page.get_by_test_id("build-step")).to_contain_text("RUN for i in 1 2 3 4 5")
        page.screenshot(path=f"{SHOTS}/image_build_running.png", full_page=True)
        expect(page.locator("#log")).to_contain_text("line-3", timeout=10_000)
        assert "line-5" not in _log_lines(page)

        expect(page.get_by_test_id("build-state")).to_have_text("succeeded", timeout=120_000)
        build.refresh_from_db()
        expect(page.get_by_test_id("build-image")).to_contain_text(build.image.reference)
        lines = _log_lines(page)
        for n in range(1, 6):  # each once: none lost, none doubled at a (re)join
            assert lines.count(f"line-{n}") == 1, lines
        assert lines.index("line-1") < lines.index("line-5")
        assert page.evaluate("() => window.notReloaded") is True
        page.screenshot(path=f"{SHOTS}/image_build_succeeded.png", full_page=True)

        # The Images page lists it; the new-cluster form offers it under "Your images".
        page.goto(f"{console}/images/")
        expect(page.locator("#images")).to_contain_text("counting:v1")
        expect(page.get_by_test_id("quota")).to_contain_text("1 of 20 images")
        page.screenshot(path=f"{SHOTS}/images_page.png", full_page=True)
        page.goto(f"{console}/clusters/new/")
        own = page.locator('#id_image optgroup[label="Your images"] option')
        expect(own).to_have_text(["counting:v1"])
    finally:
        context.close()
    phone = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    try:
        page = phone.new_page()
        page.goto(f"{console}/login/")
        page.fill("#id_username", "alice")
        page.fill("#id_password", "alice-pass-123")
        page.click("button[type=submit]")
        page.wait_for_url(f"{console}/")
        for path in ("/images/", f"/images/builds/{build.pk}/"):
            page.goto(f"{console}{path}")
            width = page.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, f"{path} is {width} px wide on a phone"
        page.screenshot(path=f"{SHOTS}/phone_image_build.png", full_page=False)
    finally:
        phone.close()


@pytest.mark.browser
def test_the_cluster_page_shows_pulls_and_saves_a_workspace(
    page, live_server, alice, paper_host, make_cluster, settings
):
    from browsing import login

    from jobs.models import Cluster
    from jobs.placement import scheduler

    # Saving is offered where a registry is set; this test queues the save and reaches none.
    settings.SUANLI_REGISTRY = "registry.invalid:5000"

    cluster = make_cluster(alice, "saver", nodes=2, release_policy="never")
    scheduler.place_pending()
    Cluster.objects.filter(pk=cluster.pk).update(
        image_pulls={
            "gpu-paper-01": {"state": "pulling", "done": 340_000_000, "total": 1_200_000_000},
            "gpu-paper-02": {"state": "failed", "message": "the registry did not answer"},
        }
    )
    cluster.node_set.update(workspace_container="f" * 64)  # as a started workspace leaves it
    login(page, live_server, "alice", "alice-pass-123")
    page.goto(f"{live_server.url}/clusters/{cluster.pk}/")
    pulls = page.get_by_test_id("image-pulls")
    expect(pulls).to_contain_text("Pulling the image on gpu-paper-01: 340 MB of 1.2 GB")
    expect(pulls).to_contain_text("failed: the registry did not answer")
    card = page.get_by_test_id("save-image")
    expect(card.locator("form")).to_have_count(2)
    page.screenshot(path=f"{SHOTS}/cluster_pull_and_save.png", full_page=True)
    card.locator("#save-name-1").fill("my-env")
    card.get_by_test_id("save-image-1").click()
    page.wait_for_url(f"{live_server.url}/images/builds/*/")
    expect(page.get_by_test_id("build-state")).to_have_text("queued")
    expect(page.locator(".lead")).to_contain_text("Node 1's workspace of saver saved as an image")
    build = ImageBuild.objects.get()
    assert (build.kind, build.node_index, build.name, build.tag) == ("save", 1, "my-env", "latest")


class Cli:
    """`suanli` in a fresh process with its own home folder (as tests/test_cli.py)."""

    def __init__(self, home: Path, url: str, token: str):
        self.env = {
            "PATH": os.environ["PATH"], "HOME": str(home), "XDG_CONFIG_HOME": str(home / "cfg"),
            "LANG": "C.UTF-8", "SUANLI_POLL_S": "0.3", "SUANLI_URL": url, "SUANLI_TOKEN": token,
        }  # fmt: skip

    def command(self, *args) -> list[str]:
        return [sys.executable, "-m", "suanli_cli", *map(str, args)]

    def __call__(self, *args, ok=True, timeout=60) -> subprocess.CompletedProcess:
        done = subprocess.run(
            self.command(*args), cwd=ROOT, env=self.env, capture_output=True, text=True,
            timeout=timeout, start_new_session=True,
        )  # fmt: skip
        assert "Traceback" not in done.stderr, done.stderr
        if ok:
            assert done.returncode == 0, (args, done.stdout, done.stderr)
        return done


def test_suanli_images_builds_follows_lists_and_deletes(console, processes, alice, bob, tmp_path):
    processes.start("builder")
    _, token = ApiToken.issue(user=alice, name="laptop")
    cli = Cli(tmp_path / "alice", console, token)
    until(lambda: requests.get(f"{console}/healthz", timeout=2).ok, what="the web process")
    project = tmp_path / "project"
    project.mkdir()
    (project / "Dockerfile").write_text(counting())

    follow = subprocess.Popen(
        cli.command("images", "build", project, "--name", "counting", "--tag", "cli",
                    "--build-arg", "UNUSED=1"),
        cwd=ROOT, env=cli.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen = []
    for line in follow.stdout:  # printed as they come, while the build runs
        seen.append(line.rstrip("\n"))
        if line == "line-1\n":
            assert ImageBuild.objects.get().state == "running"
            break
    rest, err = follow.communicate(timeout=120)
    seen += rest.splitlines()
    assert follow.returncode == 0, err
    assert [s for s in seen if s.startswith("line-")] == [f"line-{n}" for n in range(1, 6)]
    image = OwnImage.objects.get(owner=alice, name="counting", tag="cli")
    assert f"succeeded: {image.reference}" in err

    listed = cli("images", "list").stdout
    assert "counting:cli" in listed and image.reference in listed and "1 of 20 images" in listed
    assert json.loads(cli("--json", "images", "list").stdout)["images"][0]["id"] == image.pk

    # A FROM outside the allowed set is refused before any build, in words.
    (project / "Dockerfile").write_text("FROM evil/miner:latest\n")
    done = cli("images", "build", project, "--name", "miner", ok=False)
    assert done.returncode == 1
    assert "DIR/Dockerfile: FROM evil/miner:latest: builds start from" in done.stderr
    (project / "Dockerfile").write_text("FROM suanli/busybox:latest\nRUN false\n")
    done = cli("images", "build", project, "--name", "fails", ok=False, timeout=120)
    assert done.returncode == 1 and "--- build" in done.stderr and "failed:" in done.stderr
    done = cli("images", "build", project, "--name", "fails", "--json", ok=False, timeout=120)
    last = json.loads(done.stdout.splitlines()[-1])  # one JSON object a line, the error last
    assert (
        done.returncode == 1 and last["error"].startswith("build ") and "failed:" in last["error"]
    )
    queued = cli("images", "build", project, "--name", "later", "--no-follow").stdout
    assert queued.startswith("Build ") and " of later:latest is " in queued

    _, bobs = ApiToken.issue(user=bob, name="bob")
    done = Cli(tmp_path / "bob", console, bobs)("images", "delete", image.pk, ok=False)
    assert done.returncode == 1 and "not found" in done.stderr
    assert cli("images", "delete", image.pk).stdout == f"Image {image.pk} deleted.\n"
    assert not OwnImage.objects.filter(pk=image.pk).exists()

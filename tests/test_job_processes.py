"""Jobs through the real processes of the Procfile: worker, watch, web (ASGI)."""

import os
import signal
import time

import docker
import pytest
from browsing import free_port as _free_port
from channels.testing.websocket import WebsocketCommunicator
from django.urls import reverse

from console.consumers import JobLogConsumer
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import Job
from jobs.runs import dispatch, repair

pytestmark = pytest.mark.django_db(transaction=True)


def _wait(job, states, timeout=40):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job.refresh_from_db()
        if job.state in states:
            return job
        time.sleep(0.3)
    raise AssertionError(f"{job.name} is {job.state} ({job.state_reason})")


def test_the_watch_process_finalises_a_replica_the_moment_it_dies(running_cluster, processes):
    processes.start("watch")
    time.sleep(1.5)
    cluster = running_cluster(1)
    job = services.job_submit(
        cluster=cluster, spec=JobSpec(name="w", command="echo watched; exit 5")
    )
    dispatch.dispatch(cluster.pk)  # no worker here: the watch alone must see the end
    job = _wait(job, Job.ENDED, timeout=20)
    assert job.state == Job.State.FAILED and job.exit_code == 5
    assert "watched" in job.replicas.get().log


def test_kill_9_of_the_worker_mid_job_loses_nothing(running_cluster, processes, engine_urls):
    processes.start("watch")
    worker = processes.start("worker")
    cluster = running_cluster(1)
    job = services.job_submit(
        cluster=cluster, spec=JobSpec(name="crash", command="sleep 4; echo survived")
    )
    _wait(job, [Job.State.RUNNING], timeout=30)
    os.kill(worker.pid, signal.SIGKILL)
    processes.start("worker")
    job = _wait(job, Job.ENDED, timeout=60)
    assert job.state == Job.State.SUCCEEDED and "survived" in job.replicas.get().log
    assert job.replicas.count() == 1, "never two containers for one replica"
    repair.reconcile()
    for url in engine_urls:
        client = docker.DockerClient(base_url=url, timeout=10)
        assert client.containers.list(all=True, filters={"label": f"suanli.job={job.pk}"}) == []


async def _communicate(user, job_id):
    communicator = WebsocketCommunicator(JobLogConsumer.as_asgi(), f"/ws/jobs/{job_id}/log/")
    communicator.scope["user"] = user
    communicator.scope["url_route"] = {"kwargs": {"job_id": job_id}}
    connected, code = await communicator.connect()
    return communicator, connected, code


def test_log_websocket_streams_to_the_owner_and_refuses_others(
    running_cluster, processes, alice, bob, settle_until
):
    from asgiref.sync import async_to_sync

    processes.start("logs")  # the replicas' followers, as the Procfile runs them
    cluster = running_cluster(1)
    job = services.job_submit(
        cluster=cluster,
        spec=JobSpec(name="ws", command="for i in 1 2 3; do echo line $i; sleep 0.5; done"),
    )
    dispatch.dispatch(cluster.pk)

    async def owner():
        communicator, connected, _ = await _communicate(alice, job.pk)
        assert connected
        texts = []
        for _ in range(20):
            message = await communicator.receive_json_from(timeout=5)
            texts += [(line["rank"], line["text"]) for line in message["lines"]]
            if ("0", "line 3") in texts or (0, "line 3") in texts:
                break
        await communicator.disconnect()
        return texts

    async def stranger():
        communicator, connected, code = await _communicate(bob, job.pk)
        return connected, code

    texts = async_to_sync(owner)()
    assert (0, "line 1") in texts and (0, "line 3") in texts
    assert texts.count((0, "line 1")) == 1, "each line once"
    assert async_to_sync(stranger)() == (False, 4404)
    settle_until(job)


@pytest.mark.browser
def test_researcher_submits_a_job_and_watches_its_live_log(
    running_cluster, processes, alice, settings
):
    from playwright.sync_api import expect, sync_playwright

    os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    port = _free_port()
    processes.start("web", env={"PORT": str(port)})
    processes.start("worker")
    processes.start("watch")
    processes.start("logs")
    cluster = running_cluster(2, gpus=2)
    url = f"http://127.0.0.1:{port}"
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=os.environ.get("SUANLI_CHROMIUM", "/usr/bin/chromium"),
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        page = browser.new_page(viewport={"width": 1366, "height": 900})
        for _ in range(50):  # the web process takes a moment to listen
            try:
                page.goto(f"{url}/login/")
                break
            except Exception:
                time.sleep(0.2)
        page.fill("#id_username", "alice")
        page.fill("#id_password", "alice-pass-123")
        page.click("button[type=submit]")
        page.wait_for_url(f"{url}/")
        page.goto(f"{url}{reverse('job_new', args=[cluster.pk])}")
        page.fill("#id_name", "live")
        page.fill(
            # 12 s: still running while the live page's screenshot is taken on a loaded machine
            # (at its end the page redraws itself, which a screenshot must not race)
            "#id_command",
            'for i in 1 2 3 4 5 6; do echo "step $i on rank $RANK"; sleep 2; done',
        )
        page.get_by_role("button", name="Submit job").click()
        log = page.get_by_test_id("log")
        expect(log).to_contain_text("[rank 0] step 1 on rank 0", timeout=60_000)
        expect(log).to_contain_text("[rank 1] step 1 on rank 1")
        expect(page.get_by_test_id("job-state")).to_have_text("running")
        page.screenshot(
            path=os.environ.get("SUANLI_SCREENSHOTS", "/tmp") + "/job_live.png", full_page=True
        )
        expect(page.get_by_test_id("job-state")).to_have_text("succeeded", timeout=60_000)
        # The status poll then redraws the whole page (HX-Refresh): the stored log, with its
        # download link. Wait for that page, or the screenshot races the reload.
        expect(page.get_by_role("link", name="Download", exact=True)).to_be_visible(timeout=60_000)
        page.wait_for_load_state("load")
        expect(page.get_by_test_id("log")).to_contain_text("[rank 1] step 6 on rank 1")
        page.screenshot(
            path=os.environ.get("SUANLI_SCREENSHOTS", "/tmp") + "/job_done.png",
            full_page=True,
            timeout=60_000,
        )
        browser.close()


def test_the_worker_and_cron_stay_quiet_while_all_is_well(make_host, processes):
    """`make run` prints the URL and the logins once; the periodic work must not scroll
    them away (RQ logs every job at INFO)."""
    from jobs.models import Host

    host = make_host("gpu-quiet-01", engine=0, gpus=1, check="reuse")
    checked = host.last_checked
    env = {"SUANLI_HOST_CHECK_INTERVAL": "1", "SUANLI_ACCRUAL_INTERVAL": "1"}
    processes.start("worker", env=env)
    processes.start("cron", env=env)
    deadline = time.monotonic() + 30
    while Host.objects.get(pk=host.pk).last_checked == checked:
        assert time.monotonic() < deadline, "the periodic host check never ran"
        time.sleep(0.3)
    time.sleep(3)  # a few more rounds of every periodic task
    for log in processes.tmp_path.glob("*.log"):
        text = log.read_text()
        assert "Job OK" not in text and "Successfully completed" not in text, text[-2000:]
        lines = [line for line in text.splitlines() if line.strip()]
        assert len(lines) <= 4, f"{log.name}: {len(lines)} lines:\n" + "\n".join(lines[-20:])

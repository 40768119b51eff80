"""Every event a researcher wants to hear of is written once to the outbox, with a summary
in words (read in English and in Chinese) and its facts (issue 41): a job's end with how
long it ran and what it cost, a sweep's best trial, a failed build's reason, a host problem
told to the owner of the cluster on it and to nobody else.

Rolled back: the outbox rows are the point (their delivery on every channel is
tests/test_webhooks.py's). Paper hosts for jobs and hosts (no container runs: the job's
replicas are the rows dispatch writes), the real sweep code with Optuna's storage, a real
build on the build host's engine."""

import json
import os
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from browsing import login
from django.urls import reverse
from django.utils import timezone, translation
from playwright.sync_api import expect
from test_pool_sweep_races import _say, _sweep
from test_pools import hosts, make_pool  # noqa: F401 (fixtures)

from billing.accrual import EXHAUSTED
from console.models import Preferences
from jobs.base.text import Text, show
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.events import webhooks
from jobs.hosts import services as host_services
from jobs.images import builds
from jobs.models import Host, ImageBuild, Job, Replica, Sweep, Trial, WebhookEndpoint, WebhookEvent
from jobs.nodes.workspaces import NEVER_RAN
from jobs.placement import scheduler
from jobs.pools import sweeps
from jobs.runs import dispatch, settle
from tests.conftest import TEST_IMAGE

pytestmark = pytest.mark.django_db

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")


def _endpoint(owner, events=None):
    """An enabled endpoint of `owner` wanting every event type (or `events`)."""
    return WebhookEndpoint.objects.create(
        owner=owner, url="https://hooks.example.com/suanli",
        events=events or [t for t, _ in WebhookEndpoint.EVENTS], secret=webhooks.new_secret(),
    )  # fmt: skip


def _events(owner, event_type) -> list[WebhookEvent]:
    return list(WebhookEvent.objects.filter(owner=owner, type=event_type).order_by("id"))


def _said(event: WebhookEvent) -> dict[str, str]:
    """The event's summary as an English and a Chinese reader see it (in UTC)."""
    out = {}
    for language in ("en", "zh-hans"):
        with translation.override(language), timezone.override("UTC"):
            out[language] = show(event.summary)
    return out


def _data(event: WebhookEvent) -> dict:
    return json.loads(event.body)["data"]


# -- jobs -----------------------------------------------------------------------------------


@pytest.fixture
def lab(alice, paper_host, make_cluster, rate_card, fund):
    """Alice's one-GPU cluster lab-a, running on a paper host at ¥3.60 per GPU-hour."""
    rate_card({"a100-80gb": "3.60"}, effective_from=timezone.now() - timedelta(days=1))
    fund(alice, "100")
    cluster = make_cluster(alice, "lab-a", gpus=1)
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    return cluster


def _ran(job: Job, started: datetime, ended: datetime, code: int) -> None:
    """What dispatch and the container's exit leave: attempt 1 running on the cluster's
    node from `started`, its replica ended at `ended` with `code`."""
    node = job.cluster.node_set.get()
    Job.objects.filter(pk=job.pk).update(
        state=Job.State.RUNNING, attempt=1, started_at=started, running_since=started
    )
    Replica.objects.create(
        job=job, attempt=1, rank=0, node=node, host=node.host,
        container_name=f"notify-test-{job.pk}-1-0", state=Replica.State.EXITED,
        exit_code=code, started_at=started, finished_at=ended,
    )  # fmt: skip


def test_a_job_that_succeeds_says_how_long_it_ran_and_what_it_cost_once(alice, lab):
    _endpoint(alice)
    job = services.job_submit(cluster=lab, spec=JobSpec(name="train-7", command="python t.py"))
    ended = timezone.now() - timedelta(seconds=10)
    started = ended - timedelta(seconds=3720)
    _ran(job, started, ended, 0)
    reason = Text("all replicas exited with code 0")
    settle.finish(job.pk, Job.State.SUCCEEDED, reason, exit_code=0, at=ended)
    settle.finish(job.pk, Job.State.SUCCEEDED, reason, exit_code=0, at=ended)  # a second delivery

    (event,) = _events(alice, "job.succeeded")
    facts = _data(event)["job"]
    url = facts["url"]
    assert url.endswith(f"/jobs/{job.pk}/")
    assert facts["state"] == "succeeded" and facts["exit_code"] == 0
    assert facts["state_reason"] == "all replicas exited with code 0"
    assert facts["duration_s"] == 3720 and facts["duration"] == "1 h 2 min"
    # The cluster's price x its GPU x the run: 3.60 x 1 x 3720 s / 3600 s, an estimate.
    assert facts["cost"] == {
        "amount": "3.7200", "currency": "CNY", "estimated": True, "shown": "¥3.72"
    }  # fmt: skip
    assert facts["started_at"] == started.isoformat() and facts["finished_at"] == ended.isoformat()
    assert _said(event) == {
        "en": f"Job train-7 on cluster lab-a succeeded in 1 h 2 min, cost about ¥3.72: {url}",
        "zh-hans": f"集群 lab-a 上的任务 train-7 已成功，用时 1 小时 2 分钟，费用约 ¥3.72：{url}",
    }


def test_a_job_run_on_an_engine_ends_with_its_run_time_and_cost(
    running_cluster, alice, rate_card, settle_until
):
    """On the real engine: the replica's own start and end (dispatch, the container's exit)
    make the duration and the cost."""
    rate_card({"a100-80gb": "36.00"}, effective_from=timezone.now() - timedelta(days=1))
    _endpoint(alice, ["job.succeeded"])
    cluster = running_cluster(1)
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="nap", command="sleep 2"))
    dispatch.dispatch(cluster.pk)
    job = settle_until(job)
    assert job.state == "succeeded", job.state_reason
    (event,) = _events(alice, "job.succeeded")
    facts = _data(event)["job"]
    replica = job.replicas.get()
    seconds = int((job.finished_at - replica.started_at).total_seconds())
    assert facts["duration_s"] == seconds >= 1
    assert facts["started_at"] == replica.started_at.isoformat()
    amount = Decimal(facts["cost"]["amount"])  # 36.00 per GPU-hour: 0.01 a second
    assert Decimal("0.01") * seconds <= amount <= Decimal("0.01") * (seconds + 1)
    assert facts["cost"]["shown"] == f"¥{amount.quantize(Decimal('0.01'))}"
    said = _said(event)
    assert said["en"].startswith("Job nap on cluster ") and " succeeded in " in said["en"]
    assert said["zh-hans"].startswith("集群 ") and "上的任务 nap 已成功，用时 " in said["zh-hans"]
    assert "费用约 ¥" in said["zh-hans"]
    services.cluster_release(cluster=cluster)


def test_a_failed_job_says_why_and_a_job_cancelled_in_the_queue_cost_nothing(alice, lab):
    _endpoint(alice)
    job = services.job_submit(cluster=lab, spec=JobSpec(name="bad", command="exit 3"))
    waiting = services.job_submit(cluster=lab, spec=JobSpec(name="next", command="true"))
    ended = timezone.now()
    _ran(job, ended - timedelta(seconds=1800), ended, 3)
    why = Text("rank %(rank)s exited with code %(code)s", rank=0, code=3)
    settle.finish(job.pk, Job.State.FAILED, why, exit_code=3, at=ended)
    (failed,) = _events(alice, "job.failed")
    facts = _data(failed)["job"]
    assert facts["exit_code"] == 3 and facts["duration"] == "30 min"
    assert facts["cost"]["amount"] == "1.8000"
    url = facts["url"]
    assert _said(failed) == {
        "en": f"Job bad on cluster lab-a failed after 30 min, cost about ¥1.80: rank 0 exited "
        f"with code 3: {url}",
        "zh-hans": f"集群 lab-a 上的任务 bad 运行 30 分钟后失败，费用约 ¥1.80：进程 0 退出，"
        f"退出码 3：{url}",
    }

    services.job_cancel(job=waiting, by="alice")
    (cancelled,) = _events(alice, "job.cancelled")
    facts = _data(cancelled)["job"]
    assert facts["duration_s"] is None and facts["started_at"] is None
    assert facts["cost"]["amount"] == "0.0000"
    url = facts["url"]
    assert _said(cancelled) == {  # the reason is the verb: "cancelled" is said once
        "en": f"Job next on cluster lab-a ended before it ran: cancelled by alice: {url}",
        "zh-hans": f"集群 lab-a 上的任务 next 未运行即结束：由 alice 取消：{url}",
    }


def test_a_stopped_cluster_says_until_when_its_files_are_kept(alice, lab, settings):
    _endpoint(alice)
    assert lab.release_at is None  # running: nothing to release
    settings.SUANLI_STOPPED_RELEASE_S = 3 * 86400
    services.cluster_stop(cluster=lab, by="alice")
    lab.refresh_from_db()
    (event,) = _events(alice, "cluster.stopped")
    kept = lab.stopped_at + timedelta(days=3)
    assert lab.release_at == kept  # the one reckoning: the event, the API and the pages say it
    data = _data(event)["cluster"]
    assert data["release_at"] == kept.isoformat()
    day = f"{kept.astimezone(UTC):%Y-%m-%d %H:%M} UTC"
    url = data["url"]
    assert _said(event) == {  # the reason is the verb: "stopped" is said once
        "en": f"Cluster lab-a stopped by alice; its files are kept until {day}: {url}",
        "zh-hans": f"集群 lab-a 由 alice 关机；其文件保留至 {day}：{url}",
    }

    services.cluster_start(cluster=lab)
    scheduler.place_pending()
    services.cluster_stop(cluster=lab, reason=Text(EXHAUSTED), limited=False)
    lab.refresh_from_db()
    kept = lab.stopped_at + timedelta(seconds=settings.SUANLI_STOPPED_RELEASE_S)
    day = f"{kept.astimezone(UTC):%Y-%m-%d %H:%M} UTC"
    assert _said(_events(alice, "cluster.stopped")[-1]) == {
        "en": f"Cluster lab-a stopped: balance exhausted; its files are kept until {day}: {url}",
        "zh-hans": f"集群 lab-a 已关机：余额已耗尽；其文件保留至 {day}：{url}",
    }

    services.cluster_release(cluster=lab)
    (released,) = _events(alice, "cluster.released")
    assert _said(released) == {
        "en": f"Cluster lab-a ended: released by its owner: {url}",
        "zh-hans": f"集群 lab-a 已结束：由所有者释放：{url}",
    }


def test_a_cluster_that_never_ran_says_so_once(alice, lab):
    _endpoint(alice)
    never = Text(NEVER_RAN, reason="the image could not be pulled")
    services.cluster_release(cluster=lab, reason=never, failed=True)
    (event,) = _events(alice, "cluster.released")
    url = _data(event)["cluster"]["url"]
    assert _said(event) == {
        "en": "Cluster lab-a ended: could not start (nothing was charged): the image could not "
        f"be pulled: {url}",
        "zh-hans": f"集群 lab-a 已结束：无法启动（未收取任何费用）：the image could not be pulled：{url}",
    }


# -- sweeps ---------------------------------------------------------------------------------


def _trial_ends(trial: Trial, loss: float) -> None:
    """The trial's job prints its metric and succeeds; its end is read (sweeps.job_ended)."""
    _say(trial.job_id, f'SUANLI_METRIC {{"step": 1, "loss": {loss}}}')
    Job.objects.filter(pk=trial.job_id).update(
        state=Job.State.SUCCEEDED, exit_code=0, finished_at=timezone.now()
    )
    sweeps.job_ended(trial.job_id)


def test_a_finished_sweep_tells_its_best_trial_once(make_pool, alice, bob):  # noqa: F811
    _endpoint(alice)
    _endpoint(bob)
    pool = make_pool(min_clusters=0, max_clusters=1)
    sweep = _sweep(alice, pool, trials=2, parallel=1, pruner=Sweep.Pruner.NONE)
    first = Trial.objects.get(sweep=sweep)
    _trial_ends(first, 5.5)
    assert not _events(alice, "sweep.finished")  # one trial still to run
    second = Trial.objects.exclude(pk=first.pk).get(sweep=sweep)
    _trial_ends(second, 0.25)
    sweeps.tick()  # cron's safety net finds nothing to say again
    sweep.refresh_from_db()
    assert sweep.state == Sweep.State.FINISHED

    (event,) = _events(alice, "sweep.finished")
    data = _data(event)
    assert data["sweep"]["url"].endswith(f"/sweeps/{sweep.pk}/")
    best = data["best"]
    assert best["trial"] == second.number and best["value"] == 0.25
    assert best["params"] == second.params and best["url"].endswith(f"/jobs/{second.job_id}/")
    x = second.params["x"]
    url = data["url"]
    assert _said(event) == {
        "en": f"Sweep quad finished: the best of its 2 trials is trial {second.number}, "
        f"loss = 0.25 with x={x}: {url}",
        "zh-hans": f"超参搜索 quad 已结束：2 个试验中最好的是试验 {second.number}，loss = 0.25，"
        f"参数为 x={x}：{url}",
    }
    assert not WebhookEvent.objects.filter(owner=bob).exists()


# -- builds ---------------------------------------------------------------------------------


@pytest.fixture
def build_host(make_host):
    return make_host("gpu-a-01", engine=0, gpus=2, build_host=True, check="reuse")


def test_a_failed_build_tells_its_reason_once(build_host, alice, bob):
    _endpoint(alice)
    _endpoint(bob)
    dockerfile = f"FROM {TEST_IMAGE}\nRUN echo before-the-fall && false\n"
    build = builds.build_create(owner=alice, name="broken", tag="v1", dockerfile=dockerfile)
    assert builds.run(build.pk) == "failed"
    build.refresh_from_db()
    (event,) = _events(alice, "build.finished")
    data = _data(event)["build"]
    assert data["state"] == "failed" and data["image"] == "broken:v1"
    assert data["error"] == build.error and "returned a non-zero code: 1" in data["error"]
    assert data["url"].endswith(f"/images/builds/{build.pk}/")
    said = _said(event)
    assert said["en"] == f"The build of image broken:v1 failed: {build.error}: {data['url']}"
    assert said["zh-hans"] == f"镜像 broken:v1 构建失败：{build.error}：{data['url']}"
    assert builds.sweep_stuck() == 0 and len(_events(alice, "build.finished")) == 1
    assert not WebhookEvent.objects.filter(owner=bob).exists()


def test_a_build_whose_worker_died_is_told_once(alice, settings):
    # A registry named, never reached (the fast tier runs without one): the sweep ends a
    # build row, and its event names the image's reference there.
    settings.SUANLI_REGISTRY = "registry.test:5000"
    _endpoint(alice)
    long_ago = datetime.fromtimestamp(0).astimezone()
    ImageBuild.objects.create(
        owner=alice, name="orphan", tag="v1", dockerfile=f"FROM {TEST_IMAGE}\n",
        state="running", started_at=long_ago,
    )  # fmt: skip
    assert builds.sweep_stuck() == 1
    assert builds.sweep_stuck() == 0
    (event,) = _events(alice, "build.finished")
    assert "worker stopped before it ended" in _said(event)["zh-hans"]


# -- host problems ----------------------------------------------------------------------------


def test_a_host_problem_is_told_to_the_owner_of_the_cluster_on_it_only(
    alice, bob, make_paper_host, make_cluster
):
    _endpoint(alice, ["host.problem"])
    _endpoint(bob, ["host.problem"])
    a = make_paper_host("gpu-paper-01", address="10.77.0.11")
    mine = make_cluster(alice, "lab-a", gpus=8)
    scheduler.place_pending()
    b = make_paper_host("gpu-paper-02", address="10.77.0.12")
    theirs = make_cluster(bob, "bobs-secret-run", gpus=8)
    scheduler.place_pending()
    mine.refresh_from_db()
    theirs.refresh_from_db()
    assert mine.node_set.get().host_id == a.pk and theirs.node_set.get().host_id == b.pk

    host_services.host_unhealthy(host=a, state=Host.State.DOWN, message="connection refused")
    host_services.host_unhealthy(host=a, state=Host.State.DOWN, message="connection refused")
    (event,) = _events(alice, "host.problem")
    data = _data(event)
    assert data["host"] == {"name": "gpu-paper-01", "state": "down"}
    assert data["cluster"]["id"] == mine.pk
    url = data["cluster"]["url"]
    assert _said(event) == {
        "en": "A host problem affects your cluster lab-a: host gpu-paper-01 stopped answering; "
        f"not charged for its nodes from now: {url}",
        "zh-hans": "主机故障影响了您的集群 lab-a：主机 gpu-paper-01 已无响应；其上的节点从现在起"
        f"不再计费：{url}",
    }
    for words in (event.body, str(event.summary)):
        assert "10.77.0.11" not in words and "bobs-secret-run" not in words
    assert not WebhookEvent.objects.filter(owner=bob).exists()

    host_services.host_set_draining(host=b, draining=True)
    host_services.host_set_draining(host=b, draining=True)
    (drained,) = _events(bob, "host.problem")
    assert _data(drained)["host"] == {"name": "gpu-paper-02", "state": "draining"}
    assert "being drained by its operator" in _said(drained)["en"]
    assert "正由运维人员排空" in _said(drained)["zh-hans"]
    assert len(_events(alice, "host.problem")) == 1


# -- where people read them -------------------------------------------------------------------


@pytest.mark.browser
def test_the_delivery_log_reads_a_jobs_end_and_a_host_problem_in_chinese(
    browser, live_server, alice, lab
):
    Preferences.objects.update_or_create(user=alice, defaults={"language": "zh-hans"})
    endpoint = _endpoint(alice, ["job.succeeded", "host.problem"])
    job = services.job_submit(cluster=lab, spec=JobSpec(name="train-7", command="python t.py"))
    ended = timezone.now()
    _ran(job, ended - timedelta(seconds=3720), ended, 0)
    settle.finish(job.pk, Job.State.SUCCEEDED, "all replicas exited with code 0", exit_code=0)
    host = lab.node_set.get().host
    host_services.host_unhealthy(host=host, state=Host.State.DOWN, message="connection refused")
    context = browser.new_context(viewport={"width": 1366, "height": 800})
    page = context.new_page()
    try:
        login(page, live_server, "alice", "alice-pass-123")
        page.goto(f"{live_server.url}{reverse('webhook_detail', args=[endpoint.pk])}")
        words = page.get_by_test_id("summary")
        expect(words.nth(0)).to_contain_text(
            "主机故障影响了您的集群 lab-a：主机 gpu-paper-01 已无响应"
        )
        expect(words.nth(1)).to_contain_text(
            "任务 train-7 已成功，用时 1 小时 2 分钟，费用约 ¥3.72"
        )
        page.screenshot(path=f"{SHOTS}/notify-events-zh-1366.png", full_page=True)
        page.set_viewport_size({"width": 390, "height": 844})
        page.reload()
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the delivery log is {overflow}px wider than a phone"
        page.screenshot(path=f"{SHOTS}/notify-events-zh-390.png", full_page=True)
    finally:
        context.close()

"""Spot preemption on the two real Docker engines: the notice, the researcher's preemption
script, the requeue, the resume from the newest checkpoint on another engine, billing
that stops at the notice, the reclaim policy, the preemption limit and other tenants."""

import time
from datetime import timedelta
from decimal import ROUND_HALF_UP, Decimal

import pytest
from django.db.models.functions import Coalesce
from django.urls import reverse
from django.utils import timezone

from billing import accrual
from billing import services as billing
from billing.models import LedgerEntry
from jobs import tasks
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.files.storage import VolumeSpec
from jobs.hosts import services as host_services
from jobs.models import Cluster, Job, Node, WebhookEndpoint, WebhookEvent
from jobs.placement import scheduler
from jobs.runs import repair, stopping

pytestmark = pytest.mark.django_db

# A training loop that saves a checkpoint each step (written aside, then renamed, as real
# scripts do) and continues from SUANLI_RESUME_FROM when it is set.
COUNTER = r"""
dir="$SUANLI_CHECKPOINT_DIR"; mkdir -p "$dir"; step=0
if [ -n "$SUANLI_RESUME_FROM" ]; then
  step=$(cat "$SUANLI_RESUME_FROM")
  echo "resumed from step $step (restart $SUANLI_RESTART_COUNT, preemptions $SUANLI_PREEMPTIONS)"
fi
while [ $step -lt {steps} ]; do
  step=$((step+1)); echo "step $step"
  echo $step > "$dir/.partial"; mv "$dir/.partial" "$dir/ckpt-$(printf %05d $step)"
  sleep 0.2
done
echo "done at step $step"
"""


def _worker(processes, storage_root, *, script_s=5, grace_s=3):
    """The Procfile worker (with RQ's scheduler: the notice's follow-ups and the SIGKILL
    are delayed jobs), with short preemption limits."""
    env = {
        "SUANLI_SPOT_MIN_RUN_S": "0",
        "SUANLI_RECLAIM_AFTER_S": "0",
        "SUANLI_PREEMPT_SCRIPT_S": str(script_s),
        "SUANLI_PREEMPT_GRACE_S": str(grace_s),
        "SUANLI_STORAGE_ROOT": str(storage_root),
    }
    processes.start("worker", "--worker-class", "console.rqworker.SimpleWorker", env=env)
    time.sleep(0.5)


@pytest.fixture(autouse=True)
def _no_spot_protection(settings):
    """Spot clusters here are preemptible at once, for requests just made (the protections
    have tests of their own)."""
    settings.SUANLI_SPOT_MIN_RUN_S = 0
    settings.SUANLI_RECLAIM_AFTER_S = 0


@pytest.fixture
def short_limits(settings):
    settings.SUANLI_PREEMPT_SCRIPT_S = 5
    settings.SUANLI_PREEMPT_GRACE_S = 3
    return settings


def drive(check, *, timeout=60, what="the condition"):
    """What cron does (reconcile, placement), until `check()` is true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        repair.reconcile()
        scheduler.place_pending()
        value = check()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"not reached within {timeout}s: {what}")


def _state(obj):
    obj.refresh_from_db()
    return obj.state


def _two_zone_hosts(make_host):
    a = make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2, check="reuse")
    b = make_host("gpu-b-01", engine=1, zone="zone-b", gpus=2, check="reuse")
    return a, b


def _spot_cluster(make_cluster, owner, name="spot-1", **extra):
    extra.setdefault("volumes", (VolumeSpec("workspace", "/workspace"),))
    cluster = make_cluster(owner, name, nodes=1, gpus=2, spot=True, **extra)
    # The worker's own placement pass may hold the row (placement skips locked rows), so
    # run passes until it is placed, as cron would, rather than trusting a single one.
    drive(lambda: _state(cluster) == Cluster.State.RUNNING, timeout=30, what="placed")
    return cluster


def _steps_saved(storage_root, owner, folder="workspace/ckpt") -> int:
    path = storage_root / f"u{owner.pk}" / folder
    names = [p.name for p in path.glob("ckpt-*")] if path.exists() else []
    return max((int(n.removeprefix("ckpt-")) for n in names), default=0)


def test_a_preempted_job_resumes_on_the_other_engine_from_its_last_checkpoint_and_the_gap_is_free(
    make_host, make_cluster, alice, storage_root, processes, rate_card, short_limits
):
    rate_card({"a100-80gb": "3.60"}, spot_discount_pct=Decimal("60"))
    billing.post_entry(
        account=billing.account_for(alice), kind="topup", amount=Decimal("100"),
        key="t:1", memo="test money",
    )  # fmt: skip
    _two_zone_hosts(make_host)
    _worker(processes, storage_root)
    spot = _spot_cluster(make_cluster, alice, release_policy="after_last_job")
    first_host = Node.objects.get(cluster=spot).host
    job = services.job_submit(
        cluster=spot,
        spec=JobSpec(
            name="train",
            command=COUNTER.replace("{steps}", "40"),
            checkpoint_dir="/workspace/ckpt",
            preemption_script='echo "notice on rank $RANK: $SUANLI_PREEMPTION_REASON"; '
            'echo seen > "$SUANLI_CHECKPOINT_DIR/../notice-seen"; sleep 2',  # saving takes time
        ),
    )
    drive(lambda: _steps_saved(storage_root, alice) >= 8, what="8 steps saved")

    # An on-demand request that fits only where the spot cluster runs takes it back.
    on_demand = make_cluster(alice, "od-1", nodes=1, gpus=2, zone=first_host.zone, volumes=())
    scheduler.place_pending()  # this pass, or the worker's (it places after a create too)
    assert _state(spot) == Cluster.State.PREEMPTING
    assert spot.state_reason == "preempting: spot capacity reclaimed for an on-demand request"
    notice_at = Node.objects.get(cluster=spot).preempted_at
    assert notice_at is not None

    drive(lambda: _state(job) == Job.State.PREEMPTED or job.attempt > 1, what="job preempted")
    drive(lambda: _state(on_demand) == Cluster.State.RUNNING, what="on-demand placed")
    assert Node.objects.get(cluster=on_demand).host == first_host
    job = drive(
        lambda: _state(job) in (Job.State.SUCCEEDED, Job.State.FAILED) and job,
        timeout=90, what="job finished after its restart",
    )  # fmt: skip
    assert job.state == Job.State.SUCCEEDED, "\n".join(
        f"{e.kind}: {e.message}" for e in job.events.all()
    )
    assert job.attempt == 2 and job.preemptions == 1

    nodes = list(Node.objects.filter(cluster=spot).order_by("placed_at"))
    assert len(nodes) == 2 and nodes[1].host != first_host, "placed again on the other engine"
    first_log = "".join(r.log for r in job.replicas.filter(attempt=1))
    last_log = "".join(r.log for r in job.replicas.filter(attempt=2))
    assert "notice on rank 0: spot capacity reclaimed for an on-demand request\n" in first_log
    assert (storage_root / f"u{alice.pk}" / "workspace" / "notice-seen").exists()
    saved_before = max(
        int(line.rsplit(" ", 1)[1]) for line in first_log.splitlines() if " step " in line
    )
    assert f"resumed from step {saved_before} (restart 1, preemptions 1)" in last_log
    assert f"step {saved_before + 1}\n" in last_log and " step 1\n" not in last_log
    assert "done at step 40" in last_log
    assert job.resume_from == f"/workspace/ckpt/ckpt-{saved_before:05d}"
    kinds = [e.kind for e in job.events.all()]
    assert kinds.index("notice") < kinds.index("preempted") < kinds.index("resuming")
    cluster_kinds = [e.kind for e in spot.events.all()]
    assert cluster_kinds.count("running") == 2 and "preempting" in cluster_kinds

    # Billing: every second the cluster ran (from its workspace's start) before the notice
    # and after it ran again, at the spot rate; none from the notice until it ran again.
    drive(lambda: _state(spot) == Cluster.State.RELEASED, what="spot auto-released")
    services.cluster_release(cluster=on_demand)
    accrual.accrue()
    entries = LedgerEntry.objects.filter(cluster=spot, kind="usage")
    billed = sum(e.units * int((e.period_to - e.period_from).total_seconds()) for e in entries)
    held = 0
    for node in Node.objects.filter(cluster=spot).annotate(
        end=Coalesce("preempted_at", "released_at")
    ):
        end, start = node.end.replace(microsecond=0), node.started_at.replace(microsecond=0)
        held += len(node.gpu_indices) * int((end - start).total_seconds())
    assert billed == held > 0
    gap = (notice_at.replace(microsecond=0), nodes[1].started_at.replace(microsecond=0))
    assert gap[1] - gap[0] >= timedelta(seconds=2), "the notice window (the script's 2 s)"
    assert not [e for e in entries if e.period_from < gap[1] and e.period_to > gap[0]]
    spot_rate = Decimal("3.60") * Decimal("0.40")
    charged = -sum(e.amount for e in entries)
    expected = (Decimal(billed) * spot_rate / 3600).quantize(Decimal("0.0001"), ROUND_HALF_UP)
    assert charged == expected


def _holders(make_cluster, owner, sizes):
    """Spot clusters placed one after another (the last is the youngest)."""
    made = []
    for i, gpus in enumerate(sizes):
        cluster = make_cluster(owner, f"spot-{i + 1}", nodes=1, gpus=gpus, spot=True, volumes=())
        scheduler.place_pending()
        cluster.refresh_from_db()
        assert cluster.state == Cluster.State.RUNNING, cluster.state_reason
        made.append(cluster)
        time.sleep(0.01)
    return made


def test_an_on_demand_request_preempts_only_what_it_needs_youngest_first(
    make_host, make_cluster, alice, bob, settings
):
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=4, check="reuse")
    s1, s2, s3 = _holders(make_cluster, alice, [2, 1, 1])  # the host is full

    one = make_cluster(bob, "od-one", nodes=1, gpus=1, volumes=())
    assert scheduler.place_pending().preempted == [s3.pk], "one GPU: the youngest only"
    assert [_state(c) for c in (s1, s2)] == ["running", "running"]
    # Its GPUs come back once the engine confirms its containers are gone (the task its
    # requeue queues); meanwhile nobody else is preempted for them.
    assert scheduler.place_pending().preempted == []
    assert _state(one) == "pending"
    assert tasks.cluster_nodes_ended(s3.pk)
    scheduler.place_pending()
    assert _state(one) == "running" and _state(s3) == "pending"
    # Different tenants: neither side is told the other's cluster names.
    assert Cluster.objects.get(pk=s3.pk).state_reason.startswith(
        "preempted (spot capacity reclaimed for an on-demand request); waiting for"
    )
    assert "od-one" not in " ".join(e.message for e in s3.events.all())

    # Two GPUs: the youngest (s2, 1 GPU) is not enough with s1 taken too; s1 alone is.
    two = make_cluster(bob, "od-two", nodes=1, gpus=2, volumes=())
    assert scheduler.place_pending().preempted == [s1.pk]
    assert _state(s2) == "running"
    assert tasks.cluster_nodes_ended(s1.pk)
    scheduler.place_pending()
    assert _state(two) == "running"

    # More than all the spot capacity: nothing is taken for nothing.
    huge = make_cluster(bob, "od-huge", nodes=1, gpus=4, volumes=())
    assert scheduler.place_pending().preempted == []
    assert _state(s2) == "running" and _state(huge) == "pending"
    # A spot cluster placed moments ago has its minimum run time first.
    settings.SUANLI_SPOT_MIN_RUN_S = 3600
    services.cluster_release(cluster=huge)
    small = make_cluster(bob, "od-small", nodes=1, gpus=1, volumes=())
    assert scheduler.place_pending().preempted == []
    assert _state(small) == "pending" and _state(s2) == "running"
    settings.SUANLI_SPOT_MIN_RUN_S = 0
    services.cluster_release(cluster=small)
    # A spot request never preempts another spot cluster.
    other_spot = make_cluster(bob, "spot-bob", nodes=1, gpus=1, spot=True, volumes=())
    assert scheduler.place_pending().preempted == []
    assert _state(other_spot) == "pending" and _state(s2) == "running"


def test_throw_away_requests_released_before_placement_preempt_nobody(
    make_host, make_cluster, alice, bob, settings
):
    """bob harasses alice's spot job: on-demand requests that cannot fit, released before
    they are placed. None of them waited long enough to reclaim; one that waits does."""
    settings.SUANLI_RECLAIM_AFTER_S = 60
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=2, check="reuse")
    (spot,) = _holders(make_cluster, alice, [2])
    for i in range(5):
        request = make_cluster(bob, f"throw-away-{i}", nodes=1, gpus=1, volumes=())
        assert scheduler.place_pending().preempted == []
        request.refresh_from_db()
        assert "reclaimed for it after 60 s in line" in request.state_reason
        services.cluster_release(cluster=request)
    assert _state(spot) == "running"
    patient = make_cluster(bob, "patient", nodes=1, gpus=1, volumes=())
    Cluster.objects.filter(pk=patient.pk).update(queued_at=timezone.now() - timedelta(seconds=61))
    assert scheduler.place_pending().preempted == [spot.pk], "a real request still reclaims"


def test_a_hanging_preemption_script_is_cut_at_its_limit_and_the_job_still_preempted(
    make_host, make_cluster, alice, storage_root, processes, settings
):
    settings.SUANLI_PREEMPT_SCRIPT_S = 2
    settings.SUANLI_PREEMPT_GRACE_S = 2
    host, _ = _two_zone_hosts(make_host)
    _worker(processes, storage_root, script_s=2, grace_s=2)
    spot = _spot_cluster(make_cluster, alice, volumes=())
    job = services.job_submit(
        cluster=spot,
        spec=JobSpec(
            name="hangs", command="echo started; exec sleep 600",
            preemption_script="echo saving forever; exec sleep 600",
        ),
    )  # fmt: skip
    drive(lambda: _state(job) == Job.State.RUNNING, what="job running")
    reclaimed = host_services.host_reclaim_spot(host=Node.objects.get(cluster=spot).host, by="olga")
    assert [c.pk for c in reclaimed] == [spot.pk]
    drive(lambda: _state(job) != Job.State.RUNNING, timeout=40, what="job preempted")
    assert job.state in (Job.State.PREEMPTED, Job.State.STARTING, Job.State.RUNNING)
    assert job.preemptions == 1
    messages = " | ".join(e.message for e in job.events.all())
    assert "rank 0: preemption script still running after its 2 s limit" in messages
    replica = job.replicas.get(attempt=1)
    assert replica.state == "exited" and "saving forever" in replica.log
    services.cluster_release(cluster=spot)


def test_the_preemption_limit_fails_the_job_and_other_researchers_see_and_preempt_nothing(
    make_host, make_cluster, alice, bob, operator, client, storage_root, processes, short_limits
):
    from jobs.events.webhooks import new_secret

    for who in (alice, bob):
        WebhookEndpoint.objects.create(
            owner=who, url="https://hooks.example.com/x", events=["job.preempted", "job.failed"],
            secret=new_secret(),
        )  # fmt: skip
    host, _ = _two_zone_hosts(make_host)
    _worker(processes, storage_root)
    spot = _spot_cluster(make_cluster, alice, volumes=())
    job = services.job_submit(
        cluster=spot,
        spec=JobSpec(name="fragile", command="exec sleep 600", max_preemptions=1),
    )
    drive(lambda: _state(job) == Job.State.RUNNING, what="job running")

    # Bob can neither take alice's capacity back nor look at any of it.
    client.force_login(bob)
    here = Node.objects.get(cluster=spot).host
    response = client.post(reverse("ops_host_reclaim", args=[here.pk]))
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    assert _state(spot) == Cluster.State.RUNNING
    for name, arg in (("job_detail", job.pk), ("cluster_detail", spot.pk), ("job_log", job.pk)):
        assert client.get(reverse(name, args=[arg])).status_code == 404

    client.force_login(operator)
    for round_ in (1, 2):
        here = Node.objects.get(cluster=spot, released_at__isnull=True).host
        response = client.post(reverse("ops_host_reclaim", args=[here.pk]), follow=True)
        assert "spot-1" in response.content.decode()
        if round_ == 1:
            drive(lambda: _state(job) == Job.State.RUNNING and job.attempt == 2, timeout=60,
                  what="running again after the first preemption")  # fmt: skip
            assert job.retries == 0, "a preemption is not a failure: no retry was used"
    job = drive(lambda: _state(job) == Job.State.FAILED and job, timeout=40, what="job failed")
    assert job.preemptions == 2
    assert job.state_reason.startswith("preempted 2 times, more than its limit of 1")
    assert WebhookEvent.objects.filter(owner=alice, type="job.preempted").count() == 1
    assert WebhookEvent.objects.filter(owner=alice, type="job.failed").count() == 1
    assert not WebhookEvent.objects.filter(owner=bob).exists()
    services.cluster_release(cluster=spot)


@pytest.mark.browser
def test_operator_reclaims_from_the_hosts_page_and_the_researcher_sees_it_on_the_job_page(
    page, live_server, make_host, make_cluster, alice, operator, storage_root, processes,
    short_limits,
):  # fmt: skip
    import os

    from playwright.sync_api import expect

    shots = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
    host, _ = _two_zone_hosts(make_host)
    _worker(processes, storage_root)
    spot = _spot_cluster(make_cluster, alice)
    job = services.job_submit(
        cluster=spot,
        spec=JobSpec(
            name="train", command=COUNTER.replace("{steps}", "400"),
            checkpoint_dir="/workspace/ckpt", preemption_script="echo checkpoint saved",
        ),
    )  # fmt: skip
    drive(lambda: _steps_saved(storage_root, alice) >= 3, what="3 steps saved")
    spot_host = Node.objects.get(cluster=spot).host

    def login(username, password):
        page.goto(f"{live_server.url}/login/")
        page.fill("#id_username", username)
        page.fill("#id_password", password)
        page.click("button[type=submit]")
        page.wait_for_url(f"{live_server.url}/")

    login("olga", "olga-pass-123")
    page.goto(f"{live_server.url}/ops/hosts/")
    row = page.locator(f"tr[data-host='{spot_host.name}']")
    page.once("dialog", lambda dialog: dialog.accept())  # "Preempt every running spot..."
    row.get_by_role("button", name="Reclaim spot").click()
    expect(page.locator("body")).to_contain_text("spot-1")
    page.screenshot(path=f"{shots}/ops_hosts_reclaim.png", full_page=True)

    drive(lambda: _state(job) == Job.State.RUNNING and job.attempt == 2, what="resumed")
    page.context.clear_cookies()
    login("alice", "alice-pass-123")
    page.goto(f"{live_server.url}/jobs/{job.pk}/")
    expect(page.get_by_test_id("job-state")).to_have_text("running")
    body = page.locator("body")
    expect(body).to_contain_text("Preempted 1 of at most 5 times")
    expect(body).to_contain_text(f"spot capacity on {spot_host.name} reclaimed by olga")
    expect(body).to_contain_text("restart 1 after preemption 1, from /workspace/ckpt/ckpt-")
    page.screenshot(path=f"{shots}/job_preempted.png", full_page=True)
    services.cluster_release(cluster=spot)


def test_the_job_form_takes_a_preemption_script_and_warns_of_checkpoints_off_the_volumes(
    client, alice, make_host, make_cluster
):
    _two_zone_hosts(make_host)
    bare = _spot_cluster(make_cluster, alice, name="bare", volumes=())
    client.force_login(alice)
    page = client.get(reverse("job_new", args=[bare.pk])).content.decode()
    assert 'data-testid="checkpoint-warning"' in page  # nothing would survive a preemption
    assert "/workspace/checkpoints</code> is not under any of this cluster's volumes" in page

    kept = _spot_cluster(make_cluster, alice, name="kept")
    assert (
        'data-testid="checkpoint-warning"'
        not in client.get(reverse("job_new", args=[kept.pk])).content.decode()
    )
    response = client.post(
        reverse("job_new", args=[kept.pk]),
        {
            "name": "train", "command": "python train.py", "launcher": "plain", "env": "",
            "workdir": "/workspace", "checkpoint_dir": "/workspace/ckpt", "retries": "0",
            "preemption_script": "kill -USR1 1\r\nsleep 20", "max_preemptions": "3",
        },
    )  # fmt: skip
    assert response.status_code == 302
    job = Job.objects.get(cluster=kept)
    assert job.preemption_script == "kill -USR1 1\nsleep 20" and job.max_preemptions == 3


def test_the_resume_point_is_the_newest_whole_checkpoint_of_this_job_inside_the_storage(tmp_path):
    import os

    from django.utils import timezone

    from jobs.files.storage import newest_checkpoint

    root = tmp_path / "u1"
    ckpt = root / "workspace" / "ckpt"
    ckpt.mkdir(parents=True)
    volumes = [VolumeSpec("workspace", "/workspace")]
    old = ckpt / "from-an-earlier-job"
    old.write_text("x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    job_created = timezone.now() - timedelta(minutes=5)
    assert newest_checkpoint(root, volumes, "/workspace/ckpt", not_before=job_created) is None
    for i, name in enumerate(["step-1", "step-2"]):
        (ckpt / name).write_text(str(i))
        time.sleep(0.01)
    (ckpt / "step-3.tmp").write_text("half")  # still being written
    (ckpt / ".hidden").write_text("x")
    outside = tmp_path / "secret"
    outside.mkdir()
    os.symlink(outside, ckpt / "zz-link")  # newest of all, but a link
    assert newest_checkpoint(root, volumes, "/workspace/ckpt", not_before=job_created) == (
        "/workspace/ckpt/step-2"
    )
    assert newest_checkpoint(root, volumes, "/data/ckpt") is None  # on no volume
    # The checkpoint folder itself replaced by a link out of the storage: nothing.
    (ckpt.parent / "ckpt2").symlink_to(outside)
    (outside / "stolen-name").write_text("x")
    assert newest_checkpoint(root, volumes, "/workspace/ckpt2") is None


def test_a_cancel_during_the_notice_wins_and_a_failure_before_it_stays_a_failure(
    make_host, make_cluster, alice, storage_root, processes, short_limits
):
    _two_zone_hosts(make_host)
    _worker(processes, storage_root)
    # Cancelled while its preemption script runs: cancelled, not preempted; the cluster's
    # after-last-job policy releases it instead of queueing it again.
    spot = _spot_cluster(
        make_cluster, alice, name="spot-c", volumes=(), release_policy="after_last_job"
    )
    job = services.job_submit(
        cluster=spot,
        spec=JobSpec(name="c", command="exec sleep 600", preemption_script="sleep 30"),
    )
    drive(lambda: _state(job) == Job.State.RUNNING, what="job running")
    host_services.host_reclaim_spot(host=Node.objects.get(cluster=spot).host, by="olga")
    drive(lambda: job.events.filter(kind="notice").exists(), what="notice given")
    services.job_cancel(job=job, by="alice")
    job = drive(lambda: _state(job) == Job.State.CANCELLED and job, timeout=30, what="cancelled")
    assert job.preemptions == 0 and job.state_reason == "cancelled by alice"
    drive(lambda: _state(spot) == Cluster.State.RELEASED, what="released after its last job")

    # A rank failed first and its peer is being stopped when the notice comes: the job
    # fails with that rank's code and the cluster goes back to the queue afterwards.
    two = make_cluster(
        alice, "spot-f", nodes=2, gpus=1, spot=True, volumes=(), release_policy="never"
    )
    drive(lambda: _state(two) == Cluster.State.RUNNING, what="two-node spot cluster placed")
    failing = services.job_submit(
        cluster=two,
        spec=JobSpec(
            name="f", command='if [ "$RANK" = 1 ]; then sleep 1; exit 7; fi; trap "" TERM; sleep 60',
        ),
    )  # fmt: skip
    drive(lambda: "stopping the other replicas" in (_state(failing) and failing.state_reason),
          what="rank 1 failed, rank 0 being stopped")  # fmt: skip
    host_services.host_reclaim_spot(host=Node.objects.filter(cluster=two).first().host, by="olga")
    stopping.kill(failing.pk)  # the SIGKILL of the grace period, now
    failing = drive(lambda: _state(failing) == Job.State.FAILED and failing, what="failed")
    assert failing.exit_code == 7 and failing.preemptions == 0
    assert failing.state_reason == "rank 1 exited with code 7"
    drive(lambda: _state(two) in (Cluster.State.PENDING, Cluster.State.RUNNING), what="requeued")
    assert two.events.filter(kind="preempted").exists()
    services.cluster_release(cluster=two)

"""No page is wider than a phone: every page a researcher or an operator reaches, with
something on it (a running cluster of a long name with a finished job, a pool with a sweep
of four trials, keys, images, the bill), fits a 390 px wide window without sideways
scrolling: wide tables scroll inside their own box, long names wrap, forms stack.
Screenshots in Chinese at 390 px and 1366 px of each."""

import os

import pytest
from browsing import login
from django.urls import NoReverseMatch, reverse

from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import SshKey, Sweep
from jobs.pools import sweeps
from jobs.runs import dispatch

pytestmark = [pytest.mark.browser, pytest.mark.engine, pytest.mark.usefixtures("priced")]

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
PHONE = {"width": 390, "height": 844}
LONG_NAME = "resnet50-imagenet-baseline-lr0.1-bs256-warmup5-cosine-seed42"

RESEARCHER = ["dashboard", "cluster_list", "cluster_new", "cluster_detail", "job_new",
              "job_detail", "pool_list", "pool_new", "pool_detail", "sweep_list", "sweep_new",
              "sweep_detail", "image_list", "public_data", "storage", "ssh_keys", "billing",
              "billing_detail", "cluster_cost", "webhooks", "api_tokens",
              "account_settings"]  # fmt: skip
OPERATOR = ["ops_hosts", "ops_host_add", "ops_fleet", "ops_queue", "ops_billing", "ops_topup"]
ARGS = {"cluster": ("cluster_detail", "job_new", "cluster_cost"), "job": ("job_detail",),
        "pool": ("pool_detail",), "sweep": ("sweep_detail",)}  # fmt: skip


@pytest.fixture
def furnished(running_cluster, settle_until, catalog, alice):
    """alice's running cluster of a long name with a finished job of a long name and a
    pool (of the same shape, no cluster of its own yet) with a sweep of two finished
    trials; a key of a long comment."""
    from jobs.pools import autoscaler

    cluster = running_cluster(name=LONG_NAME)
    job = services.job_submit(
        cluster=cluster, spec=JobSpec(name=LONG_NAME, command="echo " + "x" * 200)
    )
    dispatch.dispatch(cluster.pk)
    settle_until(job)
    spec = services.ClusterSpec(
        name="", nodes=1, gpu_model=cluster.gpu_model, gpus_per_node=1, image=cluster.image
    )
    pool = autoscaler.pool_create(
        owner=alice, spec=autoscaler.PoolSpec(name=LONG_NAME[:40], cluster=spec)
    )
    sweep = sweeps.sweep_create(
        owner=alice,
        pool=pool,
        spec=sweeps.SweepSpec(
            name=LONG_NAME[:60], command="python train.py --a-rather-long-flag=" + "y" * 80,
            space=sweeps.parse_space("learning_rate: log_uniform 1e-4 1e-1\nlayers: int 1 8"),
            metric="validation_loss", trials=2, parallel=2, min_steps=5,
        ),
    )  # fmt: skip
    for n, trial in enumerate(sweep.trial_set.order_by("number")):
        curve = [[10, 0.9 - n / 10], [20, 0.6 - n / 10]]
        type(trial).objects.filter(pk=trial.pk).update(
            state="complete", curve=curve, last_step=20, last_value=curve[-1][1],
            best_value=curve[-1][1],
        )  # fmt: skip
    Sweep.objects.filter(pk=sweep.pk).update(state=Sweep.State.FINISHED)
    SshKey.objects.create(
        owner=alice,
        name=LONG_NAME,
        public_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG5vdC1hLXJlYWwta2V5LWp1c3QtYS13aWR0aC10ZXN0"
        " alice@a-very-long-laptop-hostname.example-university.edu.cn",
        key_type="ssh-ed25519",
        bits=256,
        fingerprint="SHA256:" + "A" * 43,
    )
    return {"cluster": cluster.pk, "job": job.pk, "pool": pool.pk, "sweep": sweep.pk}


def _urls(names, furnished):
    for name in names:
        args = [furnished[k] for k, named in ARGS.items() if name in named]
        try:
            yield name, reverse(name, args=args)
        except NoReverseMatch:  # a page of this list that no longer exists fails here
            raise AssertionError(f"no page {name}") from None


def _walk(browser, url, user, password, names, furnished, who):
    """Each page at 390 px (its scroll width) and a screenshot at 390 and 1366 px, in
    Chinese; returns {page: width} of those wider than the phone."""
    wide = {}
    for width, height in ((390, 844), (1366, 900)):
        context = browser.new_context(
            viewport={"width": width, "height": height},
            locale="zh-CN",
            timezone_id="Asia/Shanghai",
            device_scale_factor=1,
        )
        page = context.new_page()
        try:
            login(page, _Server(url), user, password)
            for name, path in _urls(names, furnished):
                page.goto(url + path)
                page.wait_for_load_state("networkidle")
                if width == 390:
                    scroll = page.evaluate("document.documentElement.scrollWidth")
                    if scroll > 390:
                        wide[name] = scroll
                page.screenshot(path=f"{SHOTS}/width_{who}_{name}_{width}.png", full_page=True)
        finally:
            context.close()
    return wide


class _Server:
    def __init__(self, url):
        self.url = url


def test_no_page_is_wider_than_a_phone(browser, live_server, furnished, operator):
    wide = _walk(browser, live_server.url, "alice", "alice-pass-123", RESEARCHER, furnished, "r")
    wide |= {
        f"ops:{k}": v
        for k, v in _walk(
            browser, live_server.url, "olga", "olga-pass-123", OPERATOR, furnished, "o"
        ).items()
    }
    assert not wide, f"wider than 390 px: {wide}"

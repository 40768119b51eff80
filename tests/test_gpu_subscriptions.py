"""GPU availability subscriptions (订阅GPU通知, jobs/pools/subscriptions.py): "tell me when
2 x A100 80 GB in zone-a are free" fires once, when a released cluster's GPUs come back on a
real engine (not before: not while they are held, nor while the engine still runs its
container), with its event on the outbox; expiry says nothing; "and rent them for me"
creates the cluster within the budget and the balance, and says why not; bad input gets the
same words on the page and the API, nothing saved; another researcher gets 404."""

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from decimal import Decimal

import pytest
from browsing import login
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone, translation
from playwright.sync_api import expect

from billing import services as billing
from console import subscriptions as console_subscriptions
from console.models import ApiToken
from jobs import tasks
from jobs.base.text import show
from jobs.clusters import services
from jobs.models import Cluster, GpuSubscription, WebhookEndpoint, WebhookEvent
from jobs.placement import scheduler
from jobs.pools import subscriptions
from tests.waiting import until

pytestmark = pytest.mark.django_db
SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
TEST_IMAGE = os.environ.get("SUANLI_TEST_IMAGE", "suanli/busybox:latest")


def _wants_gpu_news(user):
    """A channel of the owner's that takes gpu.available (the outbox records an event only
    for an owner who wants it)."""
    return WebhookEndpoint.objects.create(
        owner=user, url="https://hooks.example.com/gpu", events=["gpu.available"],
        secret="whsec_" + "A" * 32,
    )  # fmt: skip


def _subscribe(owner, **fields):
    fields.setdefault("gpu_model", "a100-80gb")
    fields.setdefault("gpus_per_node", 8)
    return subscriptions.subscribe(
        subscriptions.SubscriptionRequest(owner=owner, **fields),
        funds=console_subscriptions.funds_of(owner),
    )


def _events(user):
    return list(WebhookEvent.objects.filter(owner=user, type="gpu.available"))


def _api(user):
    _, token = ApiToken.issue(user=user, name="script")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def call(method, path, body=None):
        url = f"/api/v1/{path}"
        if method == "GET":
            response = client.get(url)
        elif method == "DELETE":
            response = client.delete(url)
        else:
            response = client.post(url, data=json.dumps(body), content_type="application/json")
        return response.status_code, (response.json() if response.content else None)

    return call


@pytest.fixture
def _names_of_our_own():
    """Container names carry the cluster's id; runs beside this one on the same engines
    count their ids from 1 too, so ours start far from theirs."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT setval(pg_get_serial_sequence('jobs_cluster', 'id'), %s)",
            [1_000_000_000 + time.time_ns() // 10**6 % 10**9],
        )


@pytest.mark.usefixtures("_names_of_our_own")
def test_it_fires_once_when_a_released_clusters_gpus_come_back_and_not_before(
    make_host, make_cluster, alice, bob, work_queue
):
    host = make_host("gpu-b-01", engine=1, zone="zone-a", gpus=2, check="reuse")
    cluster = make_cluster(alice, "holder", nodes=1, gpus=2, release_policy="never", volumes=())
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    assert tasks.cluster_network_ensure(cluster.pk)  # its workspace runs on both GPUs
    _wants_gpu_news(bob)
    sub = _subscribe(bob, gpus_per_node=2, zone="zone-a")

    assert console_subscriptions.tick()["fired"] == [], "alice's cluster holds them"
    services.cluster_release(cluster=cluster)
    assert console_subscriptions.tick()["fired"] == [], "held until the engine confirms"
    sub.refresh_from_db()
    assert sub.state == "waiting" and sub.fired_at is None and _events(bob) == []

    # The removal task removes the workspace; the engine confirms; the GPUs come back and
    # a check is queued after the commit: the queue's worker runs it.
    until(lambda: tasks.cluster_network_remove(cluster.pk), what="the workspace removed")
    work_queue("default")
    sub.refresh_from_db()
    assert sub.state == "fired" and sub.fired_at is not None
    (event,) = _events(bob)
    assert show(event.summary) == (
        f"2 × A100 80 GB are free in zone-a now: http://localhost:8000{reverse('cluster_new')}"
    ), event.summary
    body = json.loads(event.body)
    assert body["data"]["subscription_id"] == sub.pk and body["data"]["zone"] == "zone-a"

    # Once: the next ticks (and a check racing this one) say nothing more.
    assert console_subscriptions.tick()["fired"] == []
    assert subscriptions.fire(sub, funds_of=console_subscriptions.funds_of) is False
    assert len(_events(bob)) == 1
    assert host.slots.filter(node__isnull=True).count() == 2


def test_an_expired_subscription_turns_expired_without_a_word(make_paper_host, alice):
    make_paper_host()
    _wants_gpu_news(alice)
    sub = _subscribe(alice, expires_in_hours=1)
    assert sub.expires_at - sub.created_at == timedelta(hours=1)
    # Its hour has passed before a check saw the 8 free A100s: too late.
    GpuSubscription.objects.filter(pk=sub.pk).update(expires_at=timezone.now() - timedelta(1))
    assert console_subscriptions.tick() == {"expired": 1, "fired": []}
    sub.refresh_from_db()
    assert sub.state == "expired" and sub.fired_at is None
    assert _events(alice) == []


def test_a_pending_cluster_in_line_keeps_its_gpus_from_the_news(
    make_paper_host, make_cluster, alice, bob
):
    """Placement's own answer: a cluster waiting for them is served first."""
    make_paper_host()
    make_cluster(alice, "first", nodes=1, gpus=8)  # pending: the placement pass has not run
    _wants_gpu_news(bob)
    _subscribe(bob)
    assert console_subscriptions.tick()["fired"] == []
    scheduler.place_pending()  # alice's cluster takes the host
    assert console_subscriptions.tick()["fired"] == []
    make_paper_host("gpu-paper-02")
    assert len(console_subscriptions.tick()["fired"]) == 1
    (event,) = _events(bob)
    assert show(event.summary).startswith("8 × A100 80 GB are free in any zone now: ")


def test_rent_creates_the_cluster_within_the_budget_and_takes_the_gpus_from_later_news(
    make_paper_host, alice, bob, priced, storage_root
):
    make_paper_host()
    _wants_gpu_news(alice)
    _wants_gpu_news(bob)
    sub = _subscribe(
        alice, zone="zone-a", rent=True, name="llama", image=TEST_IMAGE, budget_per_hour="70"
    )
    later = _subscribe(bob, zone="zone-a")
    assert console_subscriptions.tick()["fired"] == [sub.pk], "bob's 8 are alice's cluster's"
    sub.refresh_from_db()
    cluster = sub.cluster
    assert (
        cluster.name == "llama" and cluster.owner == alice and cluster.shape == ("1 x 8 A100 80 GB")
    )
    assert cluster.zone == "zone-a" and cluster.state == "pending"
    (event,) = _events(alice)
    url = f"http://localhost:8000{reverse('cluster_detail', args=[cluster.pk])}"
    assert show(event.summary) == (
        f"8 × A100 80 GB were free in zone-a: your cluster llama was created for you: {url}"
    )
    assert json.loads(event.body)["data"]["cluster_id"] == cluster.pk
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    later.refresh_from_db()
    assert later.state == "waiting" and _events(bob) == []


def test_rent_over_the_budget_or_the_balance_is_refused_in_words(
    make_paper_host, alice, bob, priced, rate_card, storage_root
):
    make_paper_host()
    # At subscribing: 8 x 7.80 is over 50 an hour.
    with pytest.raises(Exception) as refused:
        _subscribe(alice, rent=True, name="llama", image=TEST_IMAGE, budget_per_hour="50")
    assert refused.value.message_dict == {
        "budget_per_hour": ["These GPUs cost ¥62.4000/h, over your budget of ¥50.0000/h."]
    }
    assert not GpuSubscription.objects.exists()

    # At firing: the price went up past the budget since.
    _wants_gpu_news(alice)
    sub = _subscribe(alice, rent=True, name="llama", image=TEST_IMAGE, budget_per_hour="70")
    rate_card({"a100-80gb": "10.00"})
    assert console_subscriptions.tick()["fired"] == [sub.pk]
    sub.refresh_from_db()
    assert sub.state == "fired" and sub.cluster is None
    assert not Cluster.objects.exists()
    (event,) = _events(alice)
    assert show(event.summary) == (
        "8 × A100 80 GB are free in any zone now, but renting them for you was refused: "
        "These GPUs cost ¥80.0000/h, over your budget of ¥70.0000/h. Rent them yourself: "
        f"http://localhost:8000{reverse('cluster_new')}"
    )
    assert "over your budget" in sub.outcome_shown
    with translation.override("zh-hans"):  # the refusal in the reader's language, not cron's
        said = show(event.summary)
        assert "代你租用被拒绝：这些 GPU 每小时 ¥80.0000，超出了你每小时 ¥70.0000 的预算。" in said
        assert "These GPUs" not in said and "over your budget" not in said, said
        assert "超出了你每小时 ¥70.0000 的预算" in sub.outcome_shown

    # A balance that does not cover the minutes a new cluster needs: refused, said why.
    _wants_gpu_news(bob)
    billing.post_entry(
        account=billing.account_for(bob), kind="adjustment", amount=Decimal("-1000"),
        key="test:empty-bob", memo="test",
    )  # fmt: skip
    poor = _subscribe(bob, rent=True, name="bobs", image=TEST_IMAGE)
    make_paper_host("gpu-paper-02")
    assert console_subscriptions.tick()["fired"] == [poor.pk]
    (event,) = _events(bob)
    assert "renting them for you was refused: This cluster costs ¥80.0000/h" in show(event.summary)
    assert "top up on the billing page" in show(event.summary)
    with translation.override("zh-hans"):
        said = show(event.summary)
        assert "代你租用被拒绝：该集群费用为 ¥80.0000/小时" in said, said
        assert "This cluster costs" not in said and "top up" not in said, said
    assert not Cluster.objects.exists()


BAD = [
    ({"gpu_model": "h900", "gpus_per_node": 8}, "gpu_model",
     "Unknown GPU model h900; choose one of: "),
    ({"gpus_per_node": 0}, "gpus_per_node", "Ensure this value is greater than or equal to 1."),
    ({"gpus_per_node": 17}, "gpus_per_node", "Ensure this value is less than or equal to 16."),
    ({"nodes": 99}, "nodes", "Ensure this value is less than or equal to 16."),
    ({"expires_in_hours": 0}, "expires_in_hours",
     "Ensure this value is greater than or equal to 1."),
    ({"expires_in_hours": 721}, "expires_in_hours",
     "Ensure this value is less than or equal to 720."),
    ({"rent": True, "name": "llama", "image": TEST_IMAGE, "budget_per_hour": "-1"},
     "budget_per_hour", "The budget per hour is an amount of 0 or more, e.g. 30.00."),
    ({"zone": "zone-x"}, "zone", "No A100 80 GB host in zone-x; offered in: zone-a."),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "field", "says"), BAD)
def test_bad_input_gets_the_same_words_on_the_page_and_the_api_and_nothing_is_saved(
    client, make_paper_host, alice, priced, fields, field, says
):
    make_paper_host()
    body = {"gpu_model": "a100-80gb", "nodes": 1, "gpus_per_node": 8, **fields}
    status, answer = _api(alice)("POST", "gpu-subscriptions", body)
    assert status == 400, answer
    assert any(m.startswith(says) for m in answer["fields"][field]), answer
    client.force_login(alice)
    form = {k: ("on" if v is True else v) for k, v in body.items()}
    response = client.post(reverse("gpu_subscriptions"), form)
    assert response.status_code == 400
    page = response.content.decode().replace("&#x27;", "'")
    assert f'id="field-{field}"' in page and says in page, page[page.find("<form") :]
    assert not GpuSubscription.objects.exists()


def test_at_most_so_many_waiting_subscriptions(make_paper_host, alice, settings):
    settings.SUANLI_GPU_SUBSCRIPTIONS_MAX = 3
    make_paper_host()
    for _ in range(3):
        _subscribe(alice)
    with pytest.raises(Exception) as refused:
        _subscribe(alice)
    assert refused.value.messages == [
        "You have 3 waiting GPU subscriptions, the most allowed: cancel one first."
    ]
    subscriptions.cancel(GpuSubscription.objects.first())
    _subscribe(alice)  # a cancelled one no longer counts
    assert GpuSubscription.objects.filter(state="waiting").count() == 3


def test_another_researchers_subscription_is_404_on_the_page_and_the_api(
    client, make_paper_host, alice, bob
):
    make_paper_host()
    sub = _subscribe(alice, gpus_per_node=4)
    client.force_login(bob)
    assert client.post(reverse("gpu_subscription_cancel", args=[sub.pk])).status_code == 404
    assert "4 × A100" not in client.get(reverse("gpu_subscriptions")).content.decode()
    bobs_api = _api(bob)
    assert bobs_api("DELETE", f"gpu-subscriptions/{sub.pk}")[0] == 404
    assert bobs_api("GET", "gpu-subscriptions")[1]["gpu_subscriptions"] == []
    sub.refresh_from_db()
    assert sub.state == "waiting"

    status, listed = _api(alice)("GET", "gpu-subscriptions")
    assert status == 200 and [s["id"] for s in listed["gpu_subscriptions"]] == [sub.pk]
    assert listed["gpu_subscriptions"][0]["gpu_model"] == "a100-80gb"
    assert _api(alice)("DELETE", f"gpu-subscriptions/{sub.pk}")[0] == 204
    sub.refresh_from_db()
    assert sub.state == "cancelled"


def test_the_api_adds_one_as_the_page_does(client, make_paper_host, alice):
    make_paper_host()
    status, made = _api(alice)(
        "POST",
        "gpu-subscriptions",
        {"gpu_model": "a100-80gb", "gpus_per_node": 8, "zone": "zone-a"},
    )
    assert status == 201, made
    assert made["state"] == "waiting" and made["zone"] == "zone-a" and made["rent"] is None
    client.force_login(alice)
    response = client.post(
        reverse("gpu_subscriptions"), {"gpu_model": "a100-80gb", "nodes": "1", "gpus_per_node": "2"}
    )
    assert response.status_code == 302
    assert GpuSubscription.objects.filter(owner=alice).count() == 2


def test_a_subscription_that_would_tell_nobody_is_warned_of_and_its_outcome_says_so(
    client, make_paper_host, alice
):
    """No channel that takes gpu.available (none, one disabled, an e-mail address not
    confirmed): the page and the API say nobody will be told, with the way to Notifications;
    fired, the page says whether anybody was told."""
    make_paper_host(zone="zone-a")
    WebhookEndpoint.objects.create(
        owner=alice, url="https://hooks.example.com/off", events=["gpu.available"],
        secret="whsec_" + "A" * 32, enabled=False,
    )  # fmt: skip
    WebhookEndpoint.objects.create(owner=alice, kind="email", url="carol@elsewhere.test",
                                   events=["gpu.available"])  # fmt: skip
    status, made = _api(alice)(
        "POST", "gpu-subscriptions", {"gpu_model": "a100-80gb", "gpus_per_node": 8}
    )
    assert status == 201, made
    notifications = f"http://localhost:8000{reverse('webhooks')}"
    assert made["warning"] == (
        "None of your notification channels takes “GPUs you asked for are free”: nobody will "
        "be told when this subscription fires. Add a channel or tick the event on "
        f"Notifications: {notifications}"
    )
    client.force_login(alice)
    page = client.get(reverse("gpu_subscriptions")).content.decode()
    assert "nobody will be told when a subscription fires" in page
    assert f'<a href="{reverse("webhooks")}">Add a channel or tick the event' in page

    # It fires anyway (once): the page says nobody was told.
    assert console_subscriptions.tick()["fired"] == [made["id"]]
    assert _events(alice) == []
    page = client.get(reverse("gpu_subscriptions")).content.decode()
    assert "nobody was told: none of your notification channels takes this event" in page

    # With a channel that takes it: no warning, and the next one's outcome says it was told.
    _wants_gpu_news(alice)
    status, made = _api(alice)(
        "POST", "gpu-subscriptions", {"gpu_model": "a100-80gb", "gpus_per_node": 8}
    )
    assert made["warning"] == ""
    assert "nobody will be told" not in client.get(reverse("gpu_subscriptions")).content.decode()
    assert console_subscriptions.tick()["fired"] == [made["id"]]
    assert len(_events(alice)) == 1
    assert (
        "told on your notification channels"
        in client.get(reverse("gpu_subscriptions")).content.decode()
    )


@pytest.mark.browser
@pytest.mark.parametrize("language", ["en", "zh-CN"])
def test_the_page_in_chromium_at_a_laptops_and_a_phones_width(
    browser, live_server, make_paper_host, alice, priced, language
):
    make_paper_host()
    _subscribe(alice, zone="zone-a")
    _subscribe(alice, nodes=2, gpus_per_node=4, rent=True, name="llama", image=TEST_IMAGE,
               budget_per_hour="70")  # fmt: skip
    assert len(console_subscriptions.tick()["fired"]) == 2  # one told, one rented
    context = browser.new_context(viewport={"width": 1366, "height": 800}, locale=language)
    page = context.new_page()
    tag = "zh" if language.startswith("zh") else "en"
    try:
        login(page, live_server, "alice", "alice-pass-123")
        # From the cluster form: the link carries the shape asked for.
        page.goto(f"{live_server.url}{reverse('cluster_new')}")
        expect(page.get_by_test_id("subscribe-hint")).to_be_visible()
        page.screenshot(path=f"{SHOTS}/gpu-subscriptions-{tag}-cluster-form.png")
        page.fill("#id_gpus_per_node", "4")
        page.locator("#id_gpus_per_node").dispatch_event("change")
        page.locator("#subscribe-link").click()
        expect(page.locator("#id_gpus_per_node")).to_have_value("4")
        page.fill("#id_expires_in_hours", "0")
        page.locator("#subscribe button[type=submit]").click()
        expect(page.locator("#field-expires_in_hours .errorlist")).to_be_visible()
        page.fill("#id_expires_in_hours", "48")
        page.locator("#subscribe button[type=submit]").click()
        expect(page.locator("#subscriptions tbody tr")).to_have_count(3)
        expect(page.get_by_text("llama", exact=False).first).to_be_visible()
        # No channel takes gpu.available: the page says so, and the told one's outcome.
        nobody = {
            "zh": ("订阅触发时不会通知任何人", "未通知任何人：你的通知渠道都未接收此事件"),
            "en": (
                "nobody will be told when a subscription fires",
                "nobody was told: none of your notification channels takes this event",
            ),
        }
        expect(page.locator("#unheard")).to_contain_text(nobody[tag][0])
        expect(page.locator("#unheard a")).to_have_attribute("href", reverse("webhooks"))
        expect(page.get_by_test_id("outcome").filter(has_text=nobody[tag][1])).to_have_count(1)
        page.screenshot(path=f"{SHOTS}/gpu-subscriptions-{tag}-laptop.png", full_page=True)
        page.set_viewport_size({"width": 390, "height": 844})
        page.reload()
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the page is {overflow}px wider than a phone"
        page.screenshot(path=f"{SHOTS}/gpu-subscriptions-{tag}-phone.png", full_page=True)
    finally:
        context.close()


def test_the_command_line_lists_adds_and_cancels(
    live_server, make_paper_host, alice, bob, tmp_path
):
    make_paper_host()

    def suanli(user, *args, ok=True):
        _, token = ApiToken.issue(user=user, name=f"cli-{len(args)}")
        done = subprocess.run(
            [sys.executable, "-m", "suanli_cli", *map(str, args)],
            env={"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8",
                 "SUANLI_URL": live_server.url, "SUANLI_TOKEN": token},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert "Traceback" not in done.stderr, done.stderr
        assert (done.returncode == 0) == ok, (args, done.stdout, done.stderr)
        return done

    done = suanli(alice, "subscriptions", "add", "--gpu", "a100-80gb", "--gpus-per-node", 8,
                  "--zone", "zone-a")  # fmt: skip
    assert done.stdout.startswith("Subscription ") and "8 x A100 80 GB in zone-a" in done.stdout
    done = suanli(alice, "subscriptions", "add", "--gpu", "a100-80gb", "--gpus-per-node", 0,
                  "--expires-in-hours", 721, ok=False)  # fmt: skip
    assert "  --gpus-per-node: Ensure this value is greater than or equal to 1." in done.stderr
    assert "  --expires-in-hours: Ensure this value is less than or equal to 720." in done.stderr
    listed = json.loads(suanli(alice, "subscriptions", "list", "--json").stdout)
    (sub,) = listed["gpu_subscriptions"]
    assert sub["state"] == "waiting" and sub["zone"] == "zone-a"
    assert "notify only" in suanli(alice, "subscriptions", "list").stdout
    done = suanli(bob, "subscriptions", "cancel", sub["id"], ok=False)
    assert "was not found (not yours, or no such thing)" in done.stderr
    assert suanli(alice, "subscriptions", "cancel", sub["id"]).stdout == (
        f"Subscription {sub['id']} cancelled.\n"
    )
    assert GpuSubscription.objects.get().state == "cancelled"

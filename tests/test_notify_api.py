"""Notification channels through the token API and `suanli notify` (issue 41): each kind
added with the page's checks and words (a private robot address, a malformed e-mail address,
an unknown event: 400, nothing saved), listed, changed, deleted, tested (a webhook to a real
receiver on loopback; an e-mail address not confirmed yet gets a new link, three an hour),
its delivery log in English; another researcher gets 404 on every route; the channel limit.
And `suanli balance` says the time left as the banner does."""

# ruff: noqa: F811 (the smtp and receiver fixtures, imported, are the tests' arguments)

import json
import os
import subprocess
import sys
from datetime import timedelta
from decimal import Decimal

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from test_notifications import STOPPED, _drain, _speaks, _stopped, smtp  # noqa: F401 (fixture)
from test_webhooks import receiver  # noqa: F401 (fixture)

from console.models import ApiToken
from jobs.events import webhooks
from jobs.models import StorageGrant, WebhookDelivery, WebhookEndpoint, WebhookEvent

pytestmark = pytest.mark.django_db

PUBLIC = "https://93.184.216.34"  # a public address: no DNS needed
ROBOTS = {
    "wecom": f"{PUBLIC}/cgi-bin/webhook/send?key=k",
    "dingtalk": f"{PUBLIC}/robot/send?access_token=t",
    "feishu": f"{PUBLIC}/open-apis/bot/v2/hook/x",
    "slack": f"{PUBLIC}/services/T0/B0/x",
    "discord": f"{PUBLIC}/api/webhooks/1/x",
}
STRANGER = "carol@elsewhere.test"


def _api(user):
    _, token = ApiToken.issue(user=user, name=f"t{ApiToken.objects.count()}")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def call(method, path, body=None):
        response = client.generic(
            method, f"/api/v1/{path}", json.dumps(body or {}), content_type="application/json"
        )
        return response.status_code, (response.json() if response.content else None)

    return call


def _add(api, kind, address, events=("cluster.stopped",), **extra):
    return api(
        "POST", "notification-channels",
        {"kind": kind, "address": address, "events": list(events), **extra},
    )  # fmt: skip


def test_each_kind_is_added_listed_and_a_secret_shown_once(alice, receiver, smtp):
    alice.email = "alice@lab.test"
    alice.save()
    api = _api(alice)
    status, hook = _add(api, "webhook", receiver.url, ["job.failed", "balance.low"])
    assert status == 201 and hook["secret"].startswith("whsec_")
    assert hook["secret"] == WebhookEndpoint.objects.get(pk=hook["id"]).secret
    assert hook["signed"] and hook["confirmed"] and hook["enabled"]
    status, own = _add(api, "email", "Alice@lab.test")
    assert status == 201 and own["confirmed"] and not own["confirmation_sent"]
    status, other = _add(api, "email", STRANGER)
    assert status == 201 and not other["confirmed"] and other["confirmation_sent"]
    assert WebhookEvent.objects.filter(owner=alice, type=webhooks.CONFIRM_EVENT).count() == 1
    for kind, url in ROBOTS.items():
        extra = {"secret": "SECrobot-secret"} if kind == "dingtalk" else {}
        status, robot = _add(api, kind, url, **extra)
        assert status == 201 and robot["kind"] == kind and robot["secret"] is None, robot
        assert robot["signed"] == (kind == "dingtalk")
    status, listed = api("GET", "notification-channels")
    assert status == 200 and listed["count"] == 8
    assert {c["kind"] for c in listed["notification_channels"]} == {
        "webhook", "email", *ROBOTS
    }  # fmt: skip
    text = json.dumps(listed) + json.dumps(api("GET", f"notification-channels/{hook['id']}"))
    assert "whsec_" not in text and "SECrobot-secret" not in text  # shown once; never a robot's


def _page_words(client, alice, kind, url, events=("cluster.stopped",)) -> str:
    client.force_login(alice)
    return client.post(
        reverse("webhooks"), {"kind": kind, "url": url, "events": list(events), "enabled": "on"}
    ).content.decode()


def test_bad_input_is_400_in_the_pages_words_and_nothing_is_saved(client, alice, settings):
    settings.SUANLI_WEBHOOK_ALLOW_HOSTS, settings.SUANLI_WEBHOOK_ALLOW_NETS = [], []
    api = _api(alice)
    refused = [  # (kind, address, events, field, words)
        ("wecom", "https://10.1.2.3/cgi-bin/webhook/send?key=k", ["cluster.stopped"],
         "address", "public addresses only"),
        ("dingtalk", "http://oapi.dingtalk.com/robot/send?access_token=t", ["cluster.stopped"],
         "address", "A DingTalk group robot address is the https:// URL the robot"),
        ("email", "alice-at-lab", ["cluster.stopped"],
         "address", "alice-at-lab is not an e-mail address (it reads like name@example.com)."),
        ("email", "root@localhost", ["cluster.stopped"],
         "address", "root@localhost is not an address on the internet"),
        ("email", "alice@lab.test", ["job.exploded"],
         "events", "Select a valid choice. job.exploded is not one of the available choices."),
        ("sms", "alice@lab.test", ["job.failed"],
         "kind", "Select a valid choice. sms is not one of the available choices."),
        ("email", "alice@lab.test", [], "events", "This field is required."),
    ]  # fmt: skip
    for kind, address, events, field, words in refused:
        status, body = _add(api, kind, address, events)
        assert status == 400 and any(words in w for w in body["fields"][field]), (kind, body)
        page = _page_words(client, alice, kind, address, events)
        assert words.split(" (")[0] in page.replace("&#x27;", "'"), (kind, words)
    status, body = _add(api, "slack", ROBOTS["slack"].replace("93.184.216.34", "127.0.0.1"))
    assert status == 400 and "public addresses only" in body["fields"]["address"][0]
    settings.SUANLI_WEBHOOK_ALLOW_NETS = ["93.184.216.0/24"]
    status, body = _add(api, "slack", ROBOTS["slack"], secret="s")
    assert body["fields"] == {"secret": ["Only DingTalk and Feishu robots take a signing secret."]}
    assert not WebhookEndpoint.objects.exists()


def test_a_channel_is_changed_and_deleted_and_its_kind_stays(alice, smtp):
    alice.email = "alice@lab.test"
    alice.save()
    api = _api(alice)
    _, made = _add(api, "email", alice.email)
    path = f"notification-channels/{made['id']}"
    status, changed = api("PATCH", path, {"events": ["job.failed", "gpu.available"]})
    assert status == 200 and changed["events"] == ["job.failed", "gpu.available"]
    assert changed["address"] == "alice@lab.test" and changed["enabled"]
    status, body = api("PATCH", path, {"kind": "slack"})
    assert status == 400 and "kind is fixed" in body["fields"]["kind"][0]
    status, body = api("PATCH", path, {"address": "not an address", "enabled": False})
    assert status == 400 and "is not an e-mail address" in body["fields"]["address"][0]
    row = WebhookEndpoint.objects.get(pk=made["id"])
    assert row.url == "alice@lab.test" and row.enabled and row.kind == "email"
    status, moved = api("PATCH", path, {"address": STRANGER, "enabled": False})
    assert status == 200 and not moved["confirmed"] and not moved["enabled"]
    assert WebhookEvent.objects.filter(owner=alice, type=webhooks.CONFIRM_EVENT).count() == 1
    assert api("DELETE", path) == (204, None)
    assert not WebhookEndpoint.objects.filter(pk=made["id"]).exists()
    assert api("GET", path)[0] == 404


def test_the_test_button_and_the_delivery_log(alice, receiver, smtp, work_queue):
    api = _api(alice)
    _, hook = _add(api, "webhook", receiver.url)
    path = f"notification-channels/{hook['id']}"
    status, sent = api("POST", f"{path}/test")
    assert status == 202 and sent["sent"] == "test"
    _speaks(alice, "zh-hans")  # the log through the API is English all the same
    _stopped(alice)
    _drain(work_queue)
    assert sorted(json.loads(r["body"])["type"] for r in receiver.requests) == [
        "cluster.stopped", "webhook.test"
    ]  # fmt: skip
    status, log = api("GET", f"{path}/deliveries")
    assert status == 200 and log["count"] == 2
    newest, test = log["deliveries"]
    assert newest["event"] == "cluster.stopped" and newest["state"] == "succeeded"
    assert newest["summary"] == STOPPED % {"name": "lab-a"}
    assert newest["attempts"] == 1 and newest["last_status"] == 200
    assert test["event"] == "webhook.test" and test["event_id"].startswith("msg_")
    # An e-mail address not confirmed yet: a new link instead, three an hour in all.
    _, other = _add(api, "email", STRANGER)
    for _ in range(2):
        status, sent = api("POST", f"notification-channels/{other['id']}/test")
        assert status == 202 and sent["sent"] == "confirmation"
        assert f"{STRANGER} is not confirmed yet: a new confirmation link" in sent["message"]
    status, body = api("POST", f"notification-channels/{other['id']}/test")
    assert status == 429
    assert "3 confirmation links were sent in the last hour: wait a while" in body["error"]
    assert WebhookEvent.objects.filter(owner=alice, type=webhooks.CONFIRM_EVENT).count() == 3


def test_test_messages_are_few_an_hour(alice, receiver):
    api = _api(alice)
    _, hook = _add(api, "webhook", receiver.url)
    for _ in range(webhooks.RESENDS_PER_HOUR):
        assert api("POST", f"notification-channels/{hook['id']}/test")[0] == 202
    status, body = api("POST", f"notification-channels/{hook['id']}/test")
    assert status == 429 and "30 test messages and redeliveries were sent" in body["error"]
    assert WebhookDelivery.objects.filter(endpoint_id=hook["id"]).count() == 30


def test_another_researcher_gets_404_on_every_route(alice, bob, receiver):
    _, hook = _add(_api(alice), "webhook", receiver.url)
    _stopped(alice)
    thief = _api(bob)
    path = f"notification-channels/{hook['id']}"
    for method, route, body in [
        ("GET", path, None), ("PATCH", path, {"address": "https://93.184.216.34/mine"}),
        ("DELETE", path, None), ("POST", f"{path}/test", None),
        ("GET", f"{path}/deliveries", None),
    ]:  # fmt: skip
        status, answer = thief(method, route, body)
        assert status == 404 and answer["error"] == "Not found.", (method, route)
    assert thief("GET", "notification-channels")[1]["count"] == 0
    row = WebhookEndpoint.objects.get(pk=hook["id"])
    assert row.url == receiver.url and row.deliveries.count() == 1


def test_channels_are_limited_per_researcher(alice, bob, settings):
    settings.SUANLI_NOTIFY_CHANNELS_MAX = 2
    api = _api(alice)
    for n in range(2):
        assert _add(api, "slack", f"{ROBOTS['slack']}{n}")[0] == 201
    status, body = _add(api, "slack", ROBOTS["slack"])
    assert status == 400 and body["fields"]["address"] == [
        "You have 2 notification channels, the most allowed: delete one before adding another."
    ]
    assert WebhookEndpoint.objects.filter(owner=alice).count() == 2
    assert _add(_api(bob), "slack", ROBOTS["slack"])[0] == 201


def _suanli(url, user, home):
    _, token = ApiToken.issue(user=user, name=f"cli-{user.pk}")

    def run(*args, ok=True):
        done = subprocess.run(
            [sys.executable, "-m", "suanli_cli", *map(str, args)],
            env={"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8",
                 "SUANLI_URL": url, "SUANLI_TOKEN": token},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert "Traceback" not in done.stderr, done.stderr
        assert (done.returncode == 0) == ok, (args, done.stdout, done.stderr)
        return done

    return run


def test_the_command_line_adds_lists_tests_logs_and_removes(
    live_server, alice, bob, receiver, tmp_path
):
    suanli = _suanli(live_server.url, alice, tmp_path)
    done = suanli("notify", "add", "webhook", receiver.url, "--event", "job.failed",
                  "--event", "balance.low")  # fmt: skip
    hook = WebhookEndpoint.objects.get(owner=alice)
    assert done.stdout.startswith(f"Channel {hook.pk}: webhook {receiver.url}.")
    assert f"Signing secret (shown once, keep it): {hook.secret}" in done.stdout
    assert hook.events == ["job.failed", "balance.low"]
    done = suanli("notify", "add", "email", "alice-at-lab", "--event", "job.failed", ok=False)
    assert "  ADDRESS: alice-at-lab is not an e-mail address" in done.stderr
    done = suanli("notify", "add", "slack", ROBOTS["slack"], "--event", "job.exploded", ok=False)
    assert "  --event: Select a valid choice. job.exploded is not one of" in done.stderr
    assert WebhookEndpoint.objects.count() == 1
    listed = suanli("notify", "list").stdout
    assert receiver.url in listed and "job.failed, balance.low" in listed and " on " in listed
    assert suanli("notify", "test", hook.pk).stdout == "A test event is on its way.\n"
    log = json.loads(suanli("notify", "log", hook.pk, "--json").stdout)
    assert log["count"] == 1 and log["deliveries"][0]["event"] == "webhook.test"
    assert "webhook.test" in suanli("notify", "log", hook.pk).stdout
    thief = _suanli(live_server.url, bob, tmp_path)
    for verb in ("remove", "test", "log"):
        done = thief("notify", verb, hook.pk, ok=False)
        assert "was not found (not yours, or no such thing)" in done.stderr, verb
    assert suanli("notify", "remove", hook.pk).stdout == f"Channel {hook.pk} removed.\n"
    assert not WebhookEndpoint.objects.exists()


def test_the_command_line_says_the_time_left_as_the_banner(
    live_server, alice, rate_card, fund, tmp_path
):
    """Bought storage at 1.00 an hour and 1.3333 left: 80 minutes, "1 h 20 min" (was
    "Hours left: 1.33")."""
    now = timezone.now()
    rate_card({}, effective_from=now - timedelta(hours=1), storage_per_gb_hour=Decimal("1"))
    StorageGrant.objects.create(owner=alice, extra_gb=1, since=now - timedelta(hours=1))
    fund(alice, "1.3333")
    done = _suanli(live_server.url, alice, tmp_path)("balance")
    assert "Time left:  about 1 h 20 min at that rate" in done.stdout, done.stdout
    assert "Hours left" not in done.stdout

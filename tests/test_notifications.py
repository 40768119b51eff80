"""Notifications where researchers are (issue 41): e-mail on a real SMTP server (aiosmtpd on a
free local port) and chat robots on a real HTTPS server with a test CA (allowed by the
operator's allow-list), fed by the webhook outbox: each event arrives once, in the owner's
language, formatted and signed as each robot takes it; an address that is not the account's
own is confirmed first; bad addresses are refused in words with nothing saved; another
researcher reaches nothing of it. The page in Chromium, in Chinese and English."""

import base64
import email
import email.policy
import hashlib
import hmac
import json
import os
import socket
import ssl
import threading
import time
from urllib.parse import parse_qs, urlsplit

import pytest
from aiosmtpd.controller import Controller
from browsing import login
from django.db import transaction
from django.test import Client
from django.urls import reverse
from playwright.sync_api import expect

from console.models import Preferences
from jobs.base.text import Text
from jobs.events import webhooks
from jobs.models import WebhookDelivery, WebhookEndpoint, WebhookEvent
from tests.test_netguard import Receiver, _certificates

pytestmark = pytest.mark.django_db

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
# A sentence the console already speaks in Chinese, as an emitter's summary would be.
STOPPED = "Cluster %(name)s no longer waits; it is stopped."


class Mailbox:
    """What a real SMTP server (aiosmtpd) received: one parsed message per DATA."""

    def __init__(self):
        self.messages = []
        self.lock = threading.Lock()

    async def handle_DATA(self, server, session, envelope):  # noqa: N802 (aiosmtpd's name)
        parsed = email.message_from_bytes(envelope.content, policy=email.policy.default)
        with self.lock:
            self.messages.append((list(envelope.rcpt_tos), parsed))
        return "250 OK"

    def to(self, address):
        return [m for rcpt, m in self.messages if address in rcpt]


@pytest.fixture
def smtp(settings):
    box = Mailbox()
    with socket.socket() as probe:  # a free port (aiosmtpd's readiness check needs a real one)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    controller = Controller(box, hostname="127.0.0.1", port=port)
    controller.start()
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", port
    settings.EMAIL_USE_TLS = settings.EMAIL_USE_SSL = False
    settings.DEFAULT_FROM_EMAIL = "Suanli <noreply@suanli.test>"
    settings.SUANLI_PUBLIC_URL = "https://suanli.test"
    yield box
    controller.stop()


@pytest.fixture
def robots(settings, tmp_path, monkeypatch):
    """One HTTPS server for every robot (its certificate names localhost, signed by a test CA
    that OpenSSL trusts through SSL_CERT_FILE); the operator allows localhost."""
    ca_file, cert_file, key_file = _certificates(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    server = Receiver(
        answer=(200, {"Content-Type": "application/json"}, b'{"errcode":0}'), tls=context
    )
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    settings.SUANLI_WEBHOOK_ALLOW_HOSTS = ["localhost"]
    settings.SUANLI_WEBHOOK_ALLOW_NETS = ["127.0.0.0/8"]
    settings.SUANLI_PUBLIC_URL = "https://suanli.test"
    yield server
    server.close()


def _speaks(user, language):
    Preferences.objects.update_or_create(user=user, defaults={"language": language})


def _stopped(owner, name="lab-a"):
    with transaction.atomic():
        return webhooks.emit(
            owner_id=owner.pk, event_type="cluster.stopped",
            data={"cluster": {"id": 7, "name": name, "url": "https://suanli.test/clusters/7/"}},
            summary=Text(STOPPED, name=name),
        )  # fmt: skip


def _add(client, kind, url, events=("cluster.stopped",), **extra):
    return client.post(
        reverse("webhooks"),
        {"kind": kind, "url": url, "events": list(events), "enabled": "on", **extra},
    )


def _drain(work_queue):
    """Run the queue, then the cron sweep and the queue again: a second pass sends nothing
    already sent."""
    work_queue("webhooks")
    webhooks.sweep()
    work_queue("webhooks")


def test_an_email_arrives_once_in_the_owners_language(client, alice, bob, smtp, work_queue):
    alice.email, bob.email = "alice@lab.test", "bob@lab.test"
    alice.save()
    bob.save()
    _speaks(alice, "zh-hans")
    for user in (alice, bob):
        client.force_login(user)
        response = _add(client, "email", user.email)
        assert response.status_code == 302, response.content.decode()[:2000]
    # Their own addresses: confirmed at once, and nothing but the events is sent.
    assert WebhookEndpoint.objects.filter(kind="email", confirmed_at__isnull=False).count() == 2
    _stopped(alice)
    _stopped(bob, name="lab-b")
    _drain(work_queue)
    (mail,) = smtp.to("alice@lab.test")
    assert "集群关机" in mail["Subject"], mail["Subject"]  # the event's label, in Chinese
    body = mail.get_content()
    assert "集群 lab-a 已停止等待，现已关机。" in body, body
    assert "https://suanli.test/clusters/7/" in body
    (english,) = smtp.to("bob@lab.test")
    assert "cluster stopped" in english["Subject"]
    assert "Cluster lab-b no longer waits; it is stopped." in english.get_content()
    assert english["From"] == "Suanli <noreply@suanli.test>"
    assert set(WebhookDelivery.objects.values_list("state", flat=True)) == {"succeeded"}


def test_another_address_gets_only_its_confirmation_until_opened(client, alice, smtp, work_queue):
    alice.email = "alice@lab.test"
    alice.save()
    client.force_login(alice)
    response = _add(client, "email", "not-an-address")
    assert "is not an e-mail address" in response.content.decode()
    assert not WebhookEndpoint.objects.exists()  # nothing half-saved
    response = _add(client, "email", "carol@elsewhere.test")
    endpoint = WebhookEndpoint.objects.get(owner=alice)
    assert endpoint.confirmed_at is None
    work_queue("webhooks")
    (ask,) = smtp.to("carol@elsewhere.test")
    text = ask.get_content()
    link = next(word for word in text.split() if "/notifications/confirm/" in word)
    assert "A Suanli account on https://suanli.test asked" in text and "alice" not in text
    # Events and test messages do not go there; the test button sends a new link instead.
    assert _stopped(alice) is None
    client.post(reverse("webhook_test", args=[endpoint.pk]))
    work_queue("webhooks")
    assert len(smtp.to("carol@elsewhere.test")) == 2
    new_link = next(
        w for w in smtp.to("carol@elsewhere.test")[1].get_content().split() if "/confirm/" in w
    )
    assert new_link != link
    # The owner reads the log but never the link (she could confirm for carol).
    page = client.get(reverse("webhook_detail", args=[endpoint.pk])).content.decode()
    assert "Waiting for confirmation" in page and urlsplit(new_link).path not in page
    # The old link is dead; the new one asks first (a mail scanner's GET confirms nothing).
    client.logout()
    assert client.get(urlsplit(link).path).status_code == 404
    assert client.get(urlsplit(new_link).path).status_code == 200
    assert WebhookEndpoint.objects.get(pk=endpoint.pk).confirmed_at is None
    done = client.post(urlsplit(new_link).path)
    assert "Confirmed" in done.content.decode()
    assert client.post(urlsplit(new_link).path).status_code == 404  # once
    _stopped(alice)
    work_queue("webhooks")
    mails = smtp.to("carol@elsewhere.test")
    assert len(mails) == 3 and "Cluster lab-a no longer waits" in mails[2].get_content()


def test_a_channel_added_disabled_still_gets_its_confirmation(client, alice, smtp, work_queue):
    """ "Enabled" unticked holds back the events, never the link that confirms the address."""
    client.force_login(alice)
    response = client.post(
        reverse("webhooks"),
        {"kind": "email", "url": "carol@elsewhere.test", "events": ["cluster.stopped"]},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    endpoint = WebhookEndpoint.objects.get(owner=alice)
    assert not endpoint.enabled and endpoint.confirmed_at is None
    _drain(work_queue)
    (ask,) = smtp.to("carol@elsewhere.test")
    link = next(word for word in ask.get_content().split() if "/notifications/confirm/" in word)
    client.logout()
    assert "Confirmed" in client.post(urlsplit(link).path).content.decode()
    assert _stopped(alice) is None  # still disabled: no event goes out
    _drain(work_queue)
    assert len(smtp.to("carol@elsewhere.test")) == 1


def _dingtalk_ok(query, secret):
    timestamp = query["timestamp"][0]
    mac = hmac.new(secret.encode(), f"{timestamp}\n{secret}".encode(), hashlib.sha256).digest()
    return base64.b64encode(mac).decode() == query["sign"][0]


def _feishu_ok(body, secret):
    key = f"{body['timestamp']}\n{secret}".encode()
    return base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode() == body["sign"]


def test_robots_get_their_own_formatted_and_signed_messages(client, alice, robots, work_queue):
    _speaks(alice, "zh-hans")
    client.force_login(alice)
    base = f"https://localhost:{robots.port}"
    ding_secret, feishu_secret = "SEC0123456789abcdef", "feishu-secret-42"
    for kind, path, extra in (
        ("wecom", "/cgi-bin/webhook/send?key=k1", {}),
        ("dingtalk", "/robot/send?access_token=t1", {"secret": ding_secret}),
        ("feishu", "/open-apis/bot/v2/hook/h1", {"secret": feishu_secret}),
        ("slack", "/services/T/B/x", {}),
        ("discord", "/api/webhooks/1/abc", {}),
    ):
        response = _add(client, kind, base + path, **extra)
        assert response.status_code == 302, (kind, response.content.decode()[:3000])
    before = int(time.time())
    _stopped(alice)
    _drain(work_queue)
    seen = {urlsplit(path).path: (path, json.loads(body)) for path, _, body in robots.seen}
    assert len(robots.seen) == 5  # one message per robot, the sweep sent nothing again
    words, link = "集群 lab-a 已停止等待，现已关机。", "https://suanli.test/clusters/7/"

    _, wecom = seen["/cgi-bin/webhook/send"]
    assert wecom["msgtype"] == "markdown"
    assert words in wecom["markdown"]["content"] and f"]({link})" in wecom["markdown"]["content"]

    path, ding = seen["/robot/send"]
    query = parse_qs(urlsplit(path).query)
    assert query["access_token"] == ["t1"] and _dingtalk_ok(query, ding_secret)
    assert abs(int(query["timestamp"][0]) // 1000 - before) < 600  # milliseconds
    assert ding["msgtype"] == "markdown" and "集群关机" in ding["markdown"]["title"]
    assert words in ding["markdown"]["text"]
    tampered = dict(query, sign=[base64.b64encode(b"x" * 32).decode()])
    assert not _dingtalk_ok(tampered, ding_secret)

    _, feishu = seen["/open-apis/bot/v2/hook/h1"]
    assert feishu["msg_type"] == "text" and _feishu_ok(feishu, feishu_secret)
    assert not _feishu_ok(dict(feishu, timestamp=str(int(feishu["timestamp"]) + 1)), feishu_secret)
    assert words in feishu["content"]["text"] and link in feishu["content"]["text"]

    _, slack = seen["/services/T/B/x"]
    assert words in slack["text"] and f"<{link}|" in slack["text"]
    _, discord = seen["/api/webhooks/1/abc"]
    assert words in discord["content"] and discord["allowed_mentions"] == {"parse": []}
    assert set(WebhookDelivery.objects.values_list("state", flat=True)) == {"succeeded"}
    # The delivery log shows each attempt and what happened, in the reader's language.
    ding_channel = WebhookEndpoint.objects.get(kind="dingtalk")
    page = client.get(reverse("webhook_detail", args=[ding_channel.pk])).content.decode()
    assert words in page and "200" in page


def test_a_robot_that_answers_200_with_an_error_is_tried_again(client, alice, robots, work_queue):
    robots.answer = (200, {}, b'{"errcode":310000,"errmsg":"sign not match"}')
    client.force_login(alice)
    _add(client, "dingtalk", f"https://localhost:{robots.port}/robot/send?access_token=t")
    event = _stopped(alice)
    work_queue("webhooks")
    delivery = WebhookDelivery.objects.get(event=event)
    assert delivery.state == "pending" and delivery.attempts == 1
    assert "310000 sign not match" in delivery.tries.get().error
    # An event written without a summary (older emitters) still reads as words.
    robots.answer = (200, {}, b'{"errcode":0,"errmsg":"ok"}')
    with transaction.atomic():
        old = webhooks.emit(
            owner_id=alice.pk, event_type="job.failed", data={"job": {"name": "train-7"}}
        )
    WebhookEndpoint.objects.update(events=["job.failed"])
    assert old is None  # the channel did not want job.failed when it was written
    with transaction.atomic():
        old = webhooks.emit(
            owner_id=alice.pk, event_type="job.failed", data={"job": {"name": "train-7"}}
        )
    work_queue("webhooks")
    body = json.loads(robots.seen[-1][2])
    assert "job failed: train-7" in body["markdown"]["text"]


def test_bad_robot_addresses_are_refused_in_words_and_nothing_is_saved(client, alice, settings):
    settings.SUANLI_WEBHOOK_ALLOW_HOSTS, settings.SUANLI_WEBHOOK_ALLOW_NETS = [], []
    client.force_login(alice)
    for kind, url, words in (
        ("wecom", "https://10.1.2.3/cgi-bin/webhook/send?key=k", "public addresses only"),
        ("feishu", "https://127.0.0.1/open-apis/bot/v2/hook/x", "public addresses only"),
        ("slack", "https://169.254.169.254/latest/", "public addresses only"),
        ("dingtalk", "http://oapi.dingtalk.com/robot/send?access_token=t", "https://"),
        ("discord", "ftp://discord.com/api/webhooks/1/x", "https://"),
    ):
        page = _add(client, kind, url).content.decode()
        assert words in page, (kind, url)
    page = _add(client, "wecom", "https://93.184.216.34/x", secret="s").content.decode()
    assert "Only DingTalk and Feishu robots take a signing secret." in page
    assert not WebhookEndpoint.objects.exists()


def test_another_researcher_gets_404_for_anothers_channels_and_deliveries(
    client, alice, bob, smtp, work_queue
):
    alice.email = "alice@lab.test"
    alice.save()
    client.force_login(alice)
    _add(client, "email", "carol@elsewhere.test")
    endpoint = WebhookEndpoint.objects.get(owner=alice)
    work_queue("webhooks")
    delivery = WebhookDelivery.objects.get(endpoint=endpoint)
    client = Client()  # bob's own browser (alice's flash message stays in hers)
    client.force_login(bob)
    assert client.get(reverse("webhook_detail", args=[endpoint.pk])).status_code == 404
    for name, arg in (
        ("webhook_test", endpoint.pk), ("webhook_rotate", endpoint.pk),
        ("webhook_delete", endpoint.pk), ("webhook_redeliver", delivery.pk),
    ):  # fmt: skip
        assert client.post(reverse(name, args=[arg])).status_code == 404, name
    page = client.get(reverse("webhooks")).content.decode()
    assert "carol@elsewhere.test" not in page
    guess = reverse("notify_confirm", args=[endpoint.pk, "guessed-token"])
    assert client.post(guess).status_code == 404
    assert WebhookEndpoint.objects.get(pk=endpoint.pk).confirmed_at is None
    assert len(smtp.messages) == 1  # the confirmation alone


@pytest.mark.browser
@pytest.mark.parametrize("language", ["zh-hans", "en"])
def test_the_notifications_page_in_chromium(browser, live_server, alice, language, settings):
    settings.SUANLI_WEBHOOK_ALLOW_NETS = ["93.184.216.0/24"]
    _speaks(alice, language)
    alice.email = "alice@lab.test"
    alice.save()
    WebhookEndpoint.objects.create(
        owner=alice, kind="email", url="alice@lab.test", events=["cluster.stopped"],
        secret="", confirmed_at=webhooks.timezone.now(),
    )  # fmt: skip
    robot = WebhookEndpoint.objects.create(
        owner=alice, kind="dingtalk", events=["cluster.stopped", "balance.low"], secret="SECx",
        url="https://oapi.dingtalk.com/robot/send?access_token=0123456789abcdef0123456789",
    )  # fmt: skip
    event = _stopped(alice)
    delivery = WebhookDelivery.objects.get(event=event, endpoint=robot)
    delivery.tries.create(status_code=200, latency_ms=84, response_excerpt='{"errcode":0}')
    WebhookDelivery.objects.filter(pk=delivery.pk).update(state="succeeded", attempts=1)
    assert WebhookEvent.objects.count() == 1
    context = browser.new_context(viewport={"width": 1366, "height": 800})
    page = context.new_page()
    tag = "zh" if language.startswith("zh") else "en"
    try:
        login(page, live_server, "alice", "alice-pass-123")
        for name, args in (("webhooks", []), ("webhook_detail", [robot.pk])):
            page.set_viewport_size({"width": 1366, "height": 800})
            page.goto(f"{live_server.url}{reverse(name, args=args)}")
            if name == "webhook_detail":
                summary = page.get_by_test_id("summary").first
                expect(summary).to_contain_text(
                    "集群 lab-a 已停止等待" if tag == "zh" else "Cluster lab-a no longer waits"
                )
            else:
                expect(page.locator("#id_kind")).to_be_visible()
            page.screenshot(path=f"{SHOTS}/notify-{name}-{tag}-1366.png", full_page=True)
            page.set_viewport_size({"width": 390, "height": 844})
            page.reload()
            overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, f"{name} is {overflow}px wider than a phone"
            page.screenshot(path=f"{SHOTS}/notify-{name}-{tag}-390.png", full_page=True)
        carol = WebhookEndpoint.objects.create(
            owner=alice, kind="email", url="carol@elsewhere.test", events=["balance.low"],
            secret="", confirm_token="a-token-only-carol-reads",
        )  # fmt: skip
        link = reverse("notify_confirm", args=[carol.pk, "a-token-only-carol-reads"])
        for width in (1366, 390):
            page.set_viewport_size({"width": width, "height": 700})
            page.goto(f"{live_server.url}{link}")
            expect(page.get_by_test_id("notify-confirm")).to_contain_text("carol@elsewhere.test")
            page.screenshot(path=f"{SHOTS}/notify-confirm-{tag}-{width}.png", full_page=True)
    finally:
        context.close()


def test_confirmation_links_are_few_an_hour(client, alice, smtp, work_queue):
    """Nobody mails a stranger links in a loop: three links an hour, then words instead."""
    client.force_login(alice)
    _add(client, "email", "carol@elsewhere.test")
    endpoint = WebhookEndpoint.objects.get(owner=alice)
    for _ in range(3):
        client.post(reverse("webhook_test", args=[endpoint.pk]))
    page = client.get(reverse("webhook_detail", args=[endpoint.pk])).content.decode()
    assert "3 confirmation links were sent in the last hour" in page
    page = _add(client, "email", "dave@elsewhere.test").content.decode()
    assert "3 confirmation links were sent in the last hour" in page
    assert WebhookEndpoint.objects.filter(owner=alice).count() == 1  # nothing half-saved
    work_queue("webhooks")
    assert len(smtp.to("carol@elsewhere.test")) == 3 and not smtp.to("dave@elsewhere.test")

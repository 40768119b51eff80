"""What a researcher cannot do with notification channels (issue 41's attack review): mail a
stranger confirmation links past the hourly limit by redelivering one, resend test messages
and redeliveries in a loop, fill the table with channels, have our mail server write to
localhost or an IP address, or put words of her choosing (her username) into the
confirmation e-mail a stranger reads. On a real SMTP server (aiosmtpd)."""

# ruff: noqa: F811 (the smtp fixture of test_notifications.py, imported, is the tests' argument)

import os

from browsing import login
from django.urls import reverse
from playwright.sync_api import expect
from test_notifications import _add, _drain, _speaks, _stopped, smtp  # noqa: F401 (fixture)

from jobs.events import webhooks
from jobs.models import WebhookDelivery, WebhookEndpoint

STRANGER = "carol@elsewhere.test"
SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")


def _messages(response) -> str:
    return " ".join(str(m) for m in response.context["messages"])


def test_a_confirmation_link_is_never_redelivered(client, alice, smtp, work_queue):
    """The attack: one confirmation asked for, then its delivery redelivered in a loop; each
    redelivery mailed the stranger again, past the three links an hour."""
    client.force_login(alice)
    _add(client, "email", STRANGER)
    _drain(work_queue)
    assert len(smtp.to(STRANGER)) == 1
    (delivery,) = WebhookDelivery.objects.filter(endpoint__owner=alice)
    for _ in range(10):
        response = client.post(reverse("webhook_redeliver", args=[delivery.pk]), follow=True)
    assert 'A confirmation link is not sent again: "Send test message" sends a new' in (
        _messages(response)
    )
    _drain(work_queue)
    assert len(smtp.to(STRANGER)) == 1
    assert WebhookDelivery.objects.filter(endpoint__owner=alice).count() == 1
    page = client.get(reverse("webhook_detail", args=[delivery.endpoint_id])).content.decode()
    assert reverse("webhook_redeliver", args=[delivery.pk]) not in page  # no button for it
    # Defence in depth: a second delivery row of a confirmation (however made) sends nothing.
    again = WebhookDelivery.objects.create(event=delivery.event, endpoint=delivery.endpoint)
    assert webhooks.deliver(again.pk) == "sent once"
    assert len(smtp.to(STRANGER)) == 1


def test_test_messages_and_redeliveries_are_few_an_hour(client, alice, bob, smtp, work_queue):
    alice.email = "alice@lab.test"
    alice.save()
    client.force_login(alice)
    _add(client, "email", alice.email)  # her own: confirmed at once
    endpoint = WebhookEndpoint.objects.get(owner=alice)
    event = _stopped(alice)
    first = WebhookDelivery.objects.get(event=event)
    for _ in range(webhooks.RESENDS_PER_HOUR // 2):
        client.post(reverse("webhook_test", args=[endpoint.pk]))
        client.post(reverse("webhook_redeliver", args=[first.pk]))
    sent = WebhookDelivery.objects.filter(endpoint=endpoint).count()
    assert sent == 1 + webhooks.RESENDS_PER_HOUR
    words = "30 test messages and redeliveries were sent in the last hour: wait a while"
    response = client.post(reverse("webhook_test", args=[endpoint.pk]), follow=True)
    assert words in _messages(response)
    response = client.post(reverse("webhook_redeliver", args=[first.pk]), follow=True)
    assert words in _messages(response)
    assert WebhookDelivery.objects.filter(endpoint=endpoint).count() == sent
    # New events still go out: the limit is on what she resends.
    _stopped(alice, name="lab-b")
    assert WebhookDelivery.objects.filter(endpoint=endpoint).count() == sent + 1
    # Another researcher's limit is her own.
    bob.email = "bob@lab.test"
    bob.save()
    client.force_login(bob)
    _add(client, "email", bob.email)
    theirs = WebhookEndpoint.objects.get(owner=bob)
    response = client.post(reverse("webhook_test", args=[theirs.pk]), follow=True)
    assert "A test event is on its way" in _messages(response)


def test_channels_are_limited_per_researcher(client, alice, bob, settings):
    settings.SUANLI_NOTIFY_CHANNELS_MAX = 2
    alice.email, bob.email = "alice@lab.test", "bob@lab.test"
    alice.save()
    bob.save()
    client.force_login(alice)
    for _ in range(2):
        assert _add(client, "email", alice.email).status_code == 302
    page = _add(client, "email", alice.email).content.decode()
    assert "You have 2 notification channels, the most allowed: delete one" in page
    assert WebhookEndpoint.objects.filter(owner=alice).count() == 2
    client.force_login(bob)
    assert _add(client, "email", bob.email).status_code == 302


def test_mail_to_localhost_or_an_ip_address_is_refused_in_words(client, alice, smtp):
    client.force_login(alice)
    for address in ("root@localhost", "a@[10.0.0.1]", "a@x.localhost"):
        page = _add(client, "email", address).content.decode()
        assert "is not an address on the internet" in page, address
    assert "is not an e-mail address" in _add(client, "email", "a@intranet").content.decode()
    assert not WebhookEndpoint.objects.exists()
    assert _add(client, "email", STRANGER).status_code == 302


def test_the_confirmation_email_does_not_carry_the_username(
    client, django_user_model, smtp, work_queue
):
    """A username is the asker's to choose; "www.evil-login.com" would read as a link."""
    mallory = django_user_model.objects.create_user("www.evil-login.com", password="m-pass-123")
    client.force_login(mallory)
    _add(client, "email", STRANGER)
    _drain(work_queue)
    (ask,) = smtp.to(STRANGER)
    text = ask.get_content()
    assert "evil-login" not in text and "evil-login" not in ask["Subject"]
    assert "A Suanli account on https://suanli.test asked to send its notifications" in text
    assert "no notifications are sent to this address unless the link is opened" in text


def test_the_refusals_in_chromium(browser, live_server, alice, settings):
    """The channel page of an unconfirmed address has no Redeliver for its confirmation; the
    test button past the hourly limit and a channel past the most say why, in Chinese."""
    settings.SUANLI_NOTIFY_CHANNELS_MAX = 2
    _speaks(alice, "zh-hans")
    carol = WebhookEndpoint.objects.create(
        owner=alice, kind="email", url=STRANGER, events=["balance.low"], secret=""
    )
    webhooks.ask_confirmation(carol)
    robot = WebhookEndpoint.objects.create(
        owner=alice, kind="dingtalk", events=["cluster.stopped"], secret="",
        url="https://oapi.dingtalk.com/robot/send?access_token=0123456789abcdef0123456789",
    )  # fmt: skip
    for _ in range(webhooks.RESENDS_PER_HOUR):
        webhooks.send_test(robot)
    context = browser.new_context(viewport={"width": 1366, "height": 800})
    page = context.new_page()
    try:
        login(page, live_server, "alice", "alice-pass-123")
        for width in (1366, 390):
            page.set_viewport_size({"width": width, "height": 800})
            page.goto(f"{live_server.url}{reverse('webhook_detail', args=[carol.pk])}")
            expect(page.locator("#deliveries tbody tr")).to_have_count(1)
            expect(page.locator("#deliveries button")).to_have_count(0)
            page.screenshot(path=f"{SHOTS}/limits-confirm-zh-{width}.png", full_page=True)
            page.goto(f"{live_server.url}{reverse('webhook_detail', args=[robot.pk])}")
            page.get_by_role("button", name="发送测试消息").click()
            expect(page.locator("ul.messages")).to_contain_text(f"{webhooks.RESENDS_PER_HOUR}")
            page.screenshot(path=f"{SHOTS}/limits-test-zh-{width}.png", full_page=True)
            page.goto(f"{live_server.url}{reverse('webhooks')}")
            page.locator("#id_kind").select_option("email")
            page.locator("#id_url").fill("dave@elsewhere.test")
            page.locator("input[name=events]").first.check()
            page.locator("form.stack button[type=submit]").click()
            expect(page.locator("#field-url .errorlist")).to_contain_text("2")
            page.screenshot(path=f"{SHOTS}/limits-channels-zh-{width}.png", full_page=True)
            overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0
        assert WebhookEndpoint.objects.filter(owner=alice).count() == 2
        assert WebhookDelivery.objects.filter(endpoint=robot).count() == webhooks.RESENDS_PER_HOUR
    finally:
        context.close()

"""Warnings in time (issue 41): `balance.low` under each researcher's own threshold (default
2 h) at the current burn, `balance.critical` under 30 minutes, each once per spell, a spell
ended by money that lifts the balance above it; the banner says how long the balance lasts
in hours and minutes in the reader's language, never "none", and says the clusters are
stopped (files kept) when it is used up; the threshold is set on the settings page and
through the API, and refused out of range with nothing saved."""

import json
import os
import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
import time_machine
from browsing import login
from django.conf import settings
from django.test import Client
from django.urls import reverse
from django.utils import timezone, translation
from node_start import ran
from test_i18n_browser import _reads_chinese

from billing import accrual, selectors
from billing import services as billing
from billing import storage as bought
from billing.catalog import seed_rate_card
from billing.models import Account, LedgerEntry
from console import preferences
from console.models import ApiToken, Preferences
from jobs.base.text import Duration, Text, duration, load, show
from jobs.events import webhooks
from jobs.models import Node, StorageGrant, WebhookEndpoint, WebhookEvent
from jobs.placement import scheduler

pytestmark = pytest.mark.django_db

BURN = {"a100-80gb": "3.60"}  # one A100 at 3.60 an hour
TOP_UP = "http://testserver/billing/"


@pytest.fixture
def priced(rate_card):
    return rate_card(BURN, effective_from=timezone.now() - timedelta(hours=1))


def _listening(*owners):
    """A channel of each owner that wants both warnings (the outbox writes an event only
    for an owner with one)."""
    for owner in owners:
        WebhookEndpoint.objects.create(
            owner=owner, url="https://hooks.example.com/suanli",
            events=["balance.low", "balance.critical"], secret=webhooks.new_secret(),
        )  # fmt: skip


def _events(owner, event_type):
    return list(WebhookEvent.objects.filter(owner=owner, type=event_type).order_by("pk"))


def _take_off(user, amount):
    return billing.post_entry(
        account=billing.account_for(user), kind="adjustment", amount=Decimal(f"-{amount}"),
        key=f"test-take-off:{uuid.uuid4()}", memo="test adjustment",
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _public_url(settings):
    settings.SUANLI_PUBLIC_URL = "http://testserver"


def test_each_researcher_is_warned_under_their_own_threshold_once(
    running_cluster, alice, bob, priced, fund
):
    _listening(alice, bob)
    fund(alice, "6.00")  # 1 h 40 min at 3.60 an hour
    fund(bob, "6.00")
    running_cluster(1, owner=alice, name="alices")
    running_cluster(1, owner=bob, name="bobs")
    billing.set_low_balance_hours(alice, "1")  # alice: only under an hour
    assert billing.notify_low_balances() == 1  # bob, under the default 2 h
    assert not _events(alice, "balance.low") and len(_events(bob, "balance.low")) == 1
    billing.set_low_balance_hours(alice, "3")  # alice: under 3 hours
    assert billing.notify_low_balances() == 1
    assert billing.notify_low_balances() == 0  # a second tick sends nothing new
    (low,) = _events(alice, "balance.low")
    assert str(load(low.summary)) == (
        "Your balance ¥6.00 lasts about 1 h 40 min at ¥3.6000/h; your clusters stop (files "
        f"kept) when it runs out. Top up: {TOP_UP}"
    )
    body = json.loads(low.body)["data"]
    assert body["warn_hours"] == "3.00" and body["seconds_left"] == 6000
    assert body["url"] == TOP_UP
    with translation.override("zh-hans"):
        assert "还可用约 1 小时 40 分钟" in show(low.summary)
    assert not _events(alice, "balance.critical") and not _events(bob, "balance.critical")


def test_the_thirty_minute_warning_once_and_money_in_ends_the_spell(
    running_cluster, alice, priced, fund
):
    _listening(alice)
    fund(alice, "1.50")  # 25 min
    running_cluster(1)
    assert billing.notify_low_balances() == 2  # low (never told yet) and critical
    assert billing.notify_low_balances() == 0
    (critical,) = _events(alice, "balance.critical")
    assert str(load(critical.summary)) == (
        "Under 30 minutes left: your balance ¥1.50 lasts about 25 min at ¥3.6000/h; your "
        f"clusters stop (files kept) when it runs out. Top up: {TOP_UP}"
    )
    with translation.override("zh-hans"):
        assert "还可用约 25 分钟" in show(critical.summary)
    # 2.50 lasts 41 min: over 30 minutes (critical's spell ends), still under 2 h (low's
    # goes on): nothing new is told.
    fund(alice, "1.00")
    account = Account.objects.get(user=alice)
    assert account.critical_notified_at is None and account.low_notified_at is not None
    assert billing.notify_low_balances() == 0
    _take_off(alice, "1.00")  # 25 min again: a new critical spell
    assert billing.notify_low_balances() == 1
    assert len(_events(alice, "balance.critical")) == 2 and len(_events(alice, "balance.low")) == 1
    fund(alice, "100")  # 28 h: both spells end at the top-up
    account.refresh_from_db()
    assert account.low_notified_at is None and account.critical_notified_at is None
    assert billing.notify_low_balances() == 0


def _banner(client, language):
    page = client.get(reverse("dashboard"), HTTP_ACCEPT_LANGUAGE=language).content.decode()
    start = page.find('data-testid="balance-banner"')
    return "" if start < 0 else page[start : page.index("</div>", start)]


def test_the_banner_says_hours_and_minutes_in_the_readers_language(
    client, running_cluster, alice, priced, fund
):
    running_cluster(1)
    billing.set_low_balance_hours(alice, "168")  # warned up to a week ahead
    client.force_login(alice)
    fund(alice, "4.80")
    english, chinese = _banner(client, "en"), _banner(client, "zh-CN")
    assert (
        "Low balance: ¥4.80 lasts about 1 h 20 min at ¥3.6000/h; your clusters stop (files "
        "kept) when it runs out." in " ".join(english.split())
    )
    assert "还可用约 1 小时 20 分钟" in chinese and "余额不足" in chinese
    _take_off(alice, "2.10")  # 2.70: 45 min
    assert "lasts about 45 min at" in _banner(client, "en")
    assert "还可用约 45 分钟" in _banner(client, "zh-CN")
    fund(alice, "256.50")  # 259.20: 3 days
    assert "lasts about 3 days at" in _banner(client, "en")
    assert "还可用约 3 天；" in _banner(client, "zh-CN")
    for words in (_banner(client, "en"), _banner(client, "zh-CN")):
        assert "none" not in words and reverse("billing") in words
    billing.set_low_balance_hours(alice, "")  # the default 2 h: 3 days is not low
    assert _banner(client, "en") == ""


def test_a_used_up_balance_says_the_clusters_are_stopped_and_links_to_top_up(
    client, alice, bob, catalog, make_host, make_cluster, fund
):
    seed_rate_card(effective_from=timezone.now() - timedelta(hours=1))
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=8, check="reuse")
    fund(alice, "0.01")
    cluster = make_cluster(alice, "c1", gpus=2)
    scheduler.place_pending()
    ran(cluster)
    accrual.accrue(now=timezone.now() + timedelta(seconds=30))  # used up: stopped for it
    assert Account.objects.get(user=alice).exhausted_at is not None
    _listening(alice)
    assert billing.notify_low_balances() == 0  # nothing burns now: balance.exhausted tells it
    client.force_login(alice)
    english = " ".join(_banner(client, "en").split())
    assert "Your balance is used up (-¥0.12)" in english
    assert "your clusters are stopped (files kept). Top up to start them again." in english
    assert "lasts about" not in english and reverse("billing") in english
    assert "集群已关机（文件保留）" in _banner(client, "zh-CN")
    # Nothing burns and money is left: no banner at all, no "lasts about".
    fund(bob, "5")
    client.force_login(bob)
    assert _banner(client, "en") == ""


@pytest.mark.parametrize("extra_gb", [0, 10], ids=["kept-workspaces", "and-storage"])
def test_after_exhaustion_with_priced_kept_workspaces_no_warning_says_being_stopped(
    client, make_paper_host, make_cluster, rate_card, fund, alice, extra_gb
):
    """The card prices kept workspaces (and storage bought above the free part): at a
    balance at or below 0 the kept time is not charged, so the burn shown leaves it out
    (storage is still charged); the account told `balance.exhausted` gets no balance.low or
    balance.critical after it ("used up ...: your clusters are being stopped" would be
    wrong: they were stopped), however many ticks follow; the banner says they are stopped."""
    make_paper_host()
    rate_card(
        {"a100-80gb": "36.00"}, effective_from=timezone.now() - timedelta(hours=1),
        stopped_per_hour=Decimal("0.36"), storage_per_gb_hour=Decimal("0.01"),
    )  # fmt: skip
    if extra_gb:
        StorageGrant.objects.create(
            owner=alice, since=timezone.now() - timedelta(minutes=30), extra_gb=extra_gb
        )
    WebhookEndpoint.objects.create(
        owner=alice, url="https://hooks.example.com/suanli", secret=webhooks.new_secret(),
        events=["balance.low", "balance.critical", "balance.exhausted"],
    )  # fmt: skip
    fund(alice, "0.60")  # 60 GPU-seconds
    cluster = make_cluster(alice, "train-llm", nodes=1, gpus=1)
    scheduler.place_pending()
    Node.objects.filter(cluster=cluster).update(started_at=timezone.now() - timedelta(seconds=60))
    accrual.accrue()  # used up between two warning ticks: stopped, files kept
    cluster.refresh_from_db()
    assert cluster.state == "stopped" and cluster.state_reason == accrual.EXHAUSTED
    account = Account.objects.get(user=alice)
    assert account.balance <= 0 and account.exhausted_notified_at is not None
    # What burns now is what the accrual charges at this balance: the storage, not the
    # kept workspace's 0.36 an hour.
    assert selectors.standing(alice).burn_per_hour == Decimal("0.01") * extra_gb
    assert billing.notify_low_balances() == 0
    later = timezone.now()
    for hours in (1, 2, 5):
        with time_machine.travel(later + timedelta(hours=hours), tick=False):
            accrual.accrue()
            bought.accrue()
            assert billing.notify_low_balances() == 0
    assert len(_events(alice, "balance.exhausted")) == 1
    assert not _events(alice, "balance.low") and not _events(alice, "balance.critical")
    kept = LedgerEntry.objects.filter(account__user=alice, key__endswith=":stopped")
    assert not kept.filter(period_from__gte=cluster.stopped_at).exists(), "not charged past 0"
    client.force_login(alice)
    english = " ".join(_banner(client, "en").split())
    assert "your clusters are stopped (files kept). Top up to start them again." in english
    assert "lasts about" not in english and "being stopped" not in english
    assert "集群已关机（文件保留）" in _banner(client, "zh-CN")
    # Money in: the kept workspace is charged again, and shown in the burn.
    fund(alice, "100")
    assert Account.objects.get(user=alice).exhausted_notified_at is None
    burn = selectors.standing(alice).burn_per_hour
    assert burn == Decimal("0.36") + Decimal("0.01") * extra_gb


def test_a_duration_reads_in_the_readers_language_and_survives_storage():
    """One formatter: the banner's and the summaries' words."""
    cases = {
        20: ("under 1 min", "不到 1 分钟"), 45 * 60: ("45 min", "45 分钟"),
        80 * 60: ("1 h 20 min", "1 小时 20 分钟"), 3600: ("1 h", "1 小时"),
        27 * 3600 + 20 * 60: ("1 day 3 h", "1 天 3 小时"), 3 * 86400: ("3 days", "3 天"),
    }  # fmt: skip
    for seconds, (english, chinese) in cases.items():
        stored = Text("lasts about %(left)s", left=Duration(seconds)).as_json()
        assert str(load(stored)) == f"lasts about {english}" == show(stored)
        assert duration(timedelta(seconds=seconds), translate=False) == english
        with translation.override("zh-hans"):
            assert duration(seconds) == chinese and show(stored).endswith(chinese)
    assert show({"m": "%(left)s", "a": {"left": {"seconds": "x"}}}) == "under 1 min"


BAD_HOURS = ("0.1", "0.49", "169", "200", "-2", "abc", "NaN", "1e400", "Infinity")


@pytest.mark.parametrize("hours", BAD_HOURS)
def test_a_threshold_out_of_range_is_refused_and_nothing_is_saved(client, alice, hours):
    client.force_login(alice)
    response = client.post(
        reverse("account_settings"),
        {"language": "zh-hans", "time_zone": "Asia/Tokyo", "low_balance_hours": hours},
        HTTP_ACCEPT_LANGUAGE="en",
    )
    assert response.status_code == 200
    assert "Give a number of hours from 0.5 to 168 (a week), or leave it empty." in (
        response.content.decode()
    )
    assert not Preferences.objects.filter(user=alice).exists()  # not the language either
    assert not Account.objects.filter(user=alice, low_balance_hours__isnull=False).exists()


def test_the_threshold_is_set_on_the_settings_page_and_through_the_api(client, alice, bob):
    client.force_login(alice)
    response = client.post(
        reverse("account_settings"),
        {"language": "", "time_zone": "", "low_balance_hours": "3.5"},
    )
    assert response.status_code == 302
    assert Account.objects.get(user=alice).low_balance_hours == Decimal("3.50")
    page = client.get(reverse("account_settings"), HTTP_ACCEPT_LANGUAGE="zh-CN").content.decode()
    assert 'value="3.50"' in page and "余额可用时长低于此值时提醒我" in page
    client.post(reverse("account_settings"), {"language": "", "time_zone": ""})
    assert Account.objects.get(user=alice).low_balance_hours is None  # empty: the default
    assert preferences.of(alice).language == ""

    _, token = ApiToken.issue(user=alice, name="script")
    api = Client(HTTP_AUTHORIZATION=f"Bearer {token}")

    def put(body):
        return api.put(
            "/api/v1/balance/warning", data=json.dumps(body), content_type="application/json"
        )

    refused = put({"hours": 0.2})
    assert refused.status_code == 400
    assert refused.json()["fields"]["hours"] == [
        "Give a number of hours from 0.5 to 168 (a week), or leave it empty."
    ]
    assert put({"hours": "many"}).status_code in (400, 422)
    assert Account.objects.get(user=alice).low_balance_hours is None
    answer = put({"hours": 6})
    assert answer.status_code == 200
    assert answer.json() == {
        "hours": "6.00", "default_hours": "2", "in_force_hours": "6.00", "critical_minutes": 30,
    }  # fmt: skip
    # Another researcher's token reads and sets their own threshold only.
    _, other = ApiToken.issue(user=bob, name="script")
    theirs = Client(HTTP_AUTHORIZATION=f"Bearer {other}").get("/api/v1/balance/warning").json()
    assert theirs["hours"] is None and theirs["in_force_hours"] == "2"
    assert Account.objects.get(user=alice).low_balance_hours == Decimal("6.00")
    assert settings.SUANLI_LOW_BALANCE_HOURS == 2


SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)  # the live server's thread reads committed rows
def test_screenshots_of_the_banner_and_the_threshold(
    browser, live_server, running_cluster, alice, priced, fund
):
    running_cluster(1)
    fund(alice, "4.80")  # 1 h 20 min
    for language, locale in (("zh-hans", "zh-CN"), ("en", "en-US")):
        for width in (1366, 390):
            context = browser.new_context(viewport={"width": width, "height": 800}, locale=locale)
            page = context.new_page()
            login(page, live_server, "alice", "alice-pass-123")
            banner = page.get_by_test_id("balance-banner")
            words = banner.inner_text()
            assert ("约 1 小时 20 分钟" if language == "zh-hans" else "about 1 h 20 min") in words
            page.screenshot(path=os.path.join(SHOTS, f"warn-banner-{language}-{width}.png"))
            if language == "zh-hans":
                _reads_chinese(page)
            page.goto(f"{live_server.url}{reverse('account_settings')}")
            page.fill("#id_low_balance_hours", "200")
            # The browser's own check (max=168) aside: the server's answer is the shot.
            page.evaluate("document.querySelector('[data-testid=settings-form]').noValidate = true")
            page.click("[data-testid=settings-form] button[type=submit]")
            error = page.locator("#field-low_balance_hours .errorlist")
            assert ("0.5" in error.inner_text()) and ("168" in error.inner_text())
            page.screenshot(
                path=os.path.join(SHOTS, f"warn-settings-{language}-{width}.png"), full_page=True
            )
            overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
            assert overflow <= 0, f"{width}: {overflow}px wider than the window"
            if language == "zh-hans":
                _reads_chinese(page)
            context.close()
    _take_off(alice, "3.60")  # 1.20: 20 minutes, the red banner
    context = browser.new_context(viewport={"width": 390, "height": 800}, locale="zh-CN")
    page = context.new_page()
    login(page, live_server, "alice", "alice-pass-123")
    assert "还可用约 20 分钟" in page.get_by_test_id("balance-banner").inner_text()
    page.screenshot(path=os.path.join(SHOTS, "warn-banner-critical-zh-hans-390.png"))
    context.close()


@pytest.mark.browser
@pytest.mark.django_db(transaction=True)  # the live server's thread reads committed rows
def test_screenshots_of_the_banner_after_exhaustion_with_priced_kept_workspaces(
    browser, live_server, make_paper_host, make_cluster, rate_card, fund, alice
):
    make_paper_host()
    rate_card(
        {"a100-80gb": "36.00"}, effective_from=timezone.now() - timedelta(hours=1),
        stopped_per_hour=Decimal("0.36"),
    )  # fmt: skip
    fund(alice, "0.60")
    cluster = make_cluster(alice, "train-llm", nodes=1, gpus=1)
    scheduler.place_pending()
    Node.objects.filter(cluster=cluster).update(started_at=timezone.now() - timedelta(seconds=60))
    accrual.accrue()
    assert Account.objects.get(user=alice).exhausted_notified_at is not None
    for width in (1366, 390):
        context = browser.new_context(viewport={"width": width, "height": 800}, locale="zh-CN")
        page = context.new_page()
        login(page, live_server, "alice", "alice-pass-123")
        words = page.get_by_test_id("balance-banner").inner_text()
        assert "集群已关机（文件保留）" in words and "还可用" not in words, words
        page.screenshot(path=os.path.join(SHOTS, f"warn-banner-exhausted-zh-hans-{width}.png"))
        _reads_chinese(page)
        context.close()

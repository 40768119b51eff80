"""The operator's top-up is a console page (issue 40), not the raw Django admin: find an
account by name or e-mail, see its balance and newest lines, post a top-up, refund or
adjustment with its reason, in the reader's language. Only staff holding
`billing.post_ledgerentry` may; the form's one-time key makes a double submit post once.
"""

import os
import re
from decimal import Decimal

import pytest
from browsing import login as _login
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.urls import reverse
from playwright.sync_api import expect

from billing import services as billing
from billing.models import Account, LedgerEntry
from console import preferences

pytestmark = pytest.mark.django_db

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
URL = "/ops/billing/topup/"


def _grant(user, *perms):
    for perm in perms:
        app, _, codename = perm.partition(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app, codename=codename)
        )


@pytest.fixture
def cashier(db):
    """Staff with the one power the page needs, and nothing else."""
    user = get_user_model().objects.create_user(
        "cashier", password="cashier-pass-123", is_staff=True
    )
    _grant(user, "billing.post_ledgerentry")
    return user


@pytest.fixture
def researcher(db):
    user = get_user_model().objects.create_user(
        "wanglei", email="wang.lei@lab.example.cn", password="wanglei-pass-123",
        first_name="磊", last_name="王",
    )  # fmt: skip
    billing.account_for(user)
    return user


def _token(body: str) -> str:
    return re.search(r'name="token" value="([0-9a-f]{32})"', body).group(1)


def test_the_page_is_where_the_operator_finds_an_account_by_e_mail(
    client, cashier, researcher, bob
):
    assert reverse("ops_topup") == URL
    client.force_login(cashier)
    home = client.get(reverse("dashboard")).content.decode()
    assert f'href="{URL}"' in home  # linked from the operator's nav
    page = client.get(URL, {"q": "LAB.example"}).content.decode()
    assert page.count('data-testid="found-account"') == 1
    assert "wanglei" in page and "wang.lei@lab.example.cn" in page and "bob" not in page
    assert client.get(URL, {"q": "王"}).content.decode().count('data-testid="found-account"') == 1
    nobody = client.get(URL, {"q": "nobody-has-this"}).content.decode()
    assert 'data-testid="found-none"' in nobody


def test_a_top_up_posts_once_however_often_the_form_is_sent(client, cashier, researcher):
    client.force_login(cashier)
    account = Account.objects.get(user=researcher)
    body = client.get(URL, {"account": account.pk}).content.decode()
    assert 'data-testid="topup-balance">0.00<' in body
    form = {
        "account": account.pk, "token": _token(body), "kind": "topup", "amount": "150.50",
        "memo": "发票 2026-117",
    }  # fmt: skip
    first = client.post(URL, form)
    assert first.status_code == 302 and first["Location"] == f"{URL}?account={account.pk}"
    again = client.post(URL, form, follow=True)  # the same form sent twice
    assert again.status_code == 200
    assert "already sent" in again.content.decode()
    account.refresh_from_db()
    assert account.balance == Decimal("150.50")
    entries = LedgerEntry.objects.filter(account=account)
    assert entries.count() == 1
    entry = entries.get()
    assert (entry.kind, entry.amount, entry.memo, entry.created_by) == (
        "topup",
        Decimal("150.50"),
        "发票 2026-117",
        cashier,
    )
    page = client.get(URL, {"account": account.pk}).content.decode()
    assert 'data-testid="topup-balance">150.50<' in page
    assert 'data-testid="topup-line-amount">150.5000<' in page
    assert 'data-testid="topup-line-balance">150.5000<' in page
    # A fresh form (a new key) posts a negative adjustment; the researcher's bill has both.
    form = {
        "account": account.pk, "token": _token(page), "kind": "adjustment", "amount": "-0.50",
        "memo": "多收的存储费",
    }  # fmt: skip
    assert client.post(URL, form).status_code == 302
    account.refresh_from_db()
    assert account.balance == Decimal("150.00")
    client.force_login(researcher)
    bill = client.get(reverse("billing")).content.decode()
    assert "多收的存储费" in bill and 'data-testid="bill-balance">150.0000<' in bill


@pytest.mark.parametrize(
    ("kind", "amount", "memo", "error"),
    [
        ("topup", "-5", "x", "give a positive amount"),
        ("refund", "0", "x", "give a positive amount"),
        ("adjustment", "0", "x", "An adjustment of 0 changes nothing."),
        ("topup", "12.345", "x", "to the cent"),
        ("topup", "1000000.01", "x", "at most 1,000,000.00"),
        ("topup", "abc", "x", "such as 100 or 12.50"),
        ("topup", "5", "   ", "Say why"),
        ("usage", "5", "x", "Select a valid choice"),
    ],
)
def test_a_wrong_amount_is_refused_with_a_clear_error(
    client, cashier, researcher, kind, amount, memo, error
):
    client.force_login(cashier)
    account = Account.objects.get(user=researcher)
    token = _token(client.get(URL, {"account": account.pk}).content.decode())
    response = client.post(
        URL, {"account": account.pk, "token": token, "kind": kind, "amount": amount, "memo": memo}
    )
    assert response.status_code == 400
    assert error in response.content.decode()
    assert not LedgerEntry.objects.filter(account=account).exists()


def test_the_errors_read_in_chinese(client, cashier, researcher):
    preferences.save(cashier, language="zh-hans")
    client.force_login(cashier)
    account = Account.objects.get(user=researcher)
    body = client.get(URL, {"account": account.pk}).content.decode()
    assert "充值" in body
    response = client.post(
        URL, {"account": account.pk, "token": _token(body), "kind": "topup", "amount": "-5",
              "memo": "x"},
    )  # fmt: skip
    assert response.status_code == 400
    assert "give a positive amount" not in response.content.decode()


def test_staff_without_the_permission_get_403_and_researchers_too(client, researcher, alice, bob):
    viewer = get_user_model().objects.create_user(
        "viewer", password="viewer-pass-123", is_staff=True
    )
    _grant(viewer, "billing.view_account", "billing.view_ledgerentry")
    account = Account.objects.get(user=researcher)
    token = "0" * 32
    post = {"account": account.pk, "token": token, "kind": "topup", "amount": "1000", "memo": "x"}
    for user in (viewer, alice):
        client.force_login(user)
        assert client.get(URL).status_code == 403
        assert client.get(URL, {"q": "wang"}).status_code == 403
        assert client.post(URL, post).status_code == 403
        assert 'data-testid="nav-topup"' not in client.get(reverse("dashboard")).content.decode()
    # A researcher given the permission by mistake is still not staff: still 403.
    _grant(bob, "billing.post_ledgerentry")
    client.force_login(bob)
    assert client.post(URL, post).status_code == 403
    account.refresh_from_db()
    assert account.balance == 0 and not LedgerEntry.objects.filter(account=account).exists()
    client.logout()
    assert client.get(URL).status_code == 302  # to the log-in


@pytest.mark.browser
def test_the_top_up_page_in_chinese_at_desk_and_phone_widths(
    browser, live_server, cashier, researcher
):
    preferences.save(cashier, language="zh-hans", time_zone="Asia/Shanghai")
    billing.post_entry(
        account=billing.account_for(researcher), kind="topup", amount=Decimal("200"),
        key="shot:1", memo="首次充值", by=cashier,
    )  # fmt: skip
    for width, height in ((1366, 900), (390, 844)):
        context = browser.new_context(
            viewport={"width": width, "height": height}, locale="zh-CN",
            timezone_id="Asia/Shanghai",
        )  # fmt: skip
        page = context.new_page()
        _login(page, live_server, "cashier", "cashier-pass-123")
        page.goto(f"{live_server.url}{URL}")
        page.get_by_test_id("topup-search").fill("wang.lei@")
        page.get_by_test_id("topup-search").press("Enter")
        page.get_by_test_id("choose-account").click()
        expect(page.get_by_test_id("topup-balance")).to_have_text(
            "200.00" if width == 1366 else "288.80"
        )
        if width == 1366:
            page.select_option("#id_kind", "topup")
            page.fill("#id_amount", "88.80")
            page.fill("#id_memo", "发票 2026-118")
            page.get_by_test_id("topup-post").click()
            expect(page.get_by_test_id("topup-balance")).to_have_text("288.80")
            expect(page.locator(".messages")).to_contain_text("288.80")
        else:
            page.fill("#id_amount", "-3")
            page.get_by_test_id("topup-post").click()
            expect(page.locator(".errorlist").first).to_be_visible()
        wide = page.evaluate("document.documentElement.scrollWidth")
        assert wide <= width, wide
        page.screenshot(path=f"{SHOTS}/ops_topup_zh_{width}.png", full_page=True)
        context.close()
    assert LedgerEntry.objects.filter(account__user=researcher).count() == 2


def test_the_admin_reads_in_chinese_where_django_allows(client, operator, researcher):
    """The admin stays for everything else, in the reader's language: its titles, the
    apps' and models' names and the account and ledger fields."""
    preferences.save(operator, language="zh-hans")
    client.force_login(operator)
    index = client.get("/admin/").content.decode()
    assert "Suanli 运维" in index and "机群、目录与账户" in index
    assert "Fleet, catalogs" not in index and "Engine: hosts" not in index
    assert ">费用<" in index or "费用</a>" in index
    billing.post_entry(
        account=billing.account_for(researcher), kind="topup", amount=Decimal("5"),
        key="admin:1", memo="首次充值", by=operator,
    )  # fmt: skip
    ledger = client.get("/admin/billing/ledgerentry/").content.decode()
    assert "记入后余额" in ledger and "Balance after" not in ledger
    accounts = client.get("/admin/billing/account/").content.decode()
    assert "余额" in accounts and "Exhausted at" not in accounts

"""Every user has a billing account: a researcher who just signed up can be topped up by an
operator in the admin at once, and sees the money."""

import os
from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model
from playwright.sync_api import expect

from billing import services as billing
from billing.models import Account

pytestmark = [pytest.mark.django_db]

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")


def test_users_made_any_way_get_an_account(client, operator):
    get_user_model().objects.create_user("made-in-a-shell", password="x-pass-123456")
    assert billing.accounts_ensure() == 2  # that user's and the operator's
    assert billing.accounts_ensure() == 0
    client.force_login(operator)
    get_user_model().objects.create_user("made-in-the-admin", password="x-pass-123456")
    page = client.get("/admin/billing/account/").content.decode()
    assert "made-in-the-admin" in page
    assert Account.objects.filter(user__username="made-in-the-admin", balance=0).exists()


@pytest.mark.browser
def test_a_new_researcher_signs_up_and_an_operator_tops_them_up(
    browser, page, live_server, operator
):
    page.goto(f"{live_server.url}/signup/")
    page.fill("#id_username", "newton")
    page.fill("#id_password1", "apple-falls-1687")
    page.fill("#id_password2", "apple-falls-1687")
    page.click("button[type=submit]")
    page.wait_for_url(f"{live_server.url}/")
    assert Account.objects.get(user__username="newton").balance == 0

    ops = browser.new_context(viewport={"width": 1366, "height": 800}).new_page()
    ops.goto(f"{live_server.url}/admin/login/")
    ops.fill("#id_username", "olga")
    ops.fill("#id_password", "olga-pass-123")
    ops.click("input[type=submit]")
    ops.goto(f"{live_server.url}/admin/billing/account/")
    ops.get_by_role("link", name="newton").click()
    form = ops.locator("#entry-form")
    expect(form).to_be_visible()
    # A reason is required, and the message says so in the form's own word.
    form.locator("#id_amount").fill("50")
    form.locator("#id_memo").fill("   ")  # passes the browser's own check, not the form's
    form.locator("input[type=submit]").click()
    message = ops.locator(".messagelist")
    expect(message).to_contain_text("Reason: This field is required.")
    expect(message).not_to_contain_text("Memo")
    form = ops.locator("#entry-form")
    form.locator("#id_amount").fill("50")
    form.locator("#id_memo").fill("welcome credit, invoice 2026-118")
    ops.screenshot(path=f"{SHOTS}/admin_topup_form.png", full_page=True)
    # The whole form is in view at 1366 px: nothing of it is clipped.
    box = form.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 1366, box
    assert ops.evaluate("document.documentElement.scrollWidth") <= 1366
    form.locator("input[type=submit]").click()
    expect(ops.locator(".messagelist")).to_contain_text("balance now 50")
    ops.context.close()

    assert Account.objects.get(user__username="newton").balance == Decimal("50")
    page.goto(f"{live_server.url}/billing/")
    expect(page.get_by_test_id("balance")).to_contain_text("50")
    page.screenshot(path=f"{SHOTS}/new_researcher_billing.png", full_page=True)

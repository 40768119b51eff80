"""The operator's top-up page (console/views_billing.py ops_topup) answers an odd account
number in the query or the form with "no such account", never a server error: digits that
Python calls digits but int() does not read (superscripts, other scripts' digits)."""

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission

pytestmark = pytest.mark.django_db

URL = "/ops/billing/topup/"


@pytest.fixture
def cashier(db):
    user = get_user_model().objects.create_user(
        "cashier", password="cashier-pass-123", is_staff=True
    )
    user.user_permissions.add(
        Permission.objects.get(content_type__app_label="billing", codename="post_ledgerentry")
    )
    return user


def test_an_account_number_of_odd_digits_is_no_such_account(client, cashier):
    client.force_login(cashier)
    for raw in ("²", "¹²", "٣", "１", "-1", "1.0", "x", "9" * 30):
        assert client.get(URL, {"account": raw}).status_code == 404, raw
        posted = client.post(URL, {"account": raw, "kind": "topup", "amount": "5", "memo": "x"})
        assert posted.status_code == 404, raw

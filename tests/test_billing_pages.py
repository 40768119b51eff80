"""What researchers and operators see of money, through the real pages."""

import csv
import io
import json
from datetime import timedelta
from decimal import Decimal

import pytest
from django.urls import reverse
from django.utils import timezone
from forms_data import cluster_form
from node_start import ran

from billing import accrual
from billing import services as billing
from billing.catalog import seed_rate_card
from billing.models import Account, LedgerEntry, RateCard
from jobs.models import Cluster
from jobs.placement import scheduler

pytestmark = pytest.mark.django_db


def _form(**fields):
    return cluster_form(**fields)


@pytest.fixture
def card(catalog):
    return seed_rate_card(effective_from=timezone.now() - timedelta(hours=1))


@pytest.fixture
def fleet(make_host):
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=8, check="reuse")


def test_the_form_shows_prices_and_balance(client, alice, card, fleet, fund):
    fund(alice, "12.5")
    client.force_login(alice)
    response = client.get(reverse("cluster_new"))
    assert 'data-testid="form-balance">12.50<' in response.content.decode()  # a balance: 2 places
    prices = json.loads(response.context["prices_json"])["prices"]
    assert prices["gpu:a100-80gb"] == ["7.8000", "3.9000"]  # per GPU-hour: on-demand, spot


def test_a_cluster_needs_ten_minutes_of_balance(client, alice, card, fleet, fund):
    client.force_login(alice)
    # 2 x A100 80 GB = 15.60 /h: ten minutes is 2.60
    fund(alice, "2.5")
    response = client.post(reverse("cluster_new"), _form())
    assert response.status_code == 200
    errors = " ".join(response.context["form"].non_field_errors())
    assert "¥15.6000/h" in errors and "¥2.6000" in errors and "¥2.5000" in errors
    assert reverse("billing") in response.content.decode()
    assert not Cluster.objects.exists()
    # Spot costs half: 7.80 /h needs 1.30, which 2.50 covers.
    response = client.post(reverse("cluster_new"), _form(spot="on"))
    assert response.status_code == 302
    assert Cluster.objects.get().spot


def test_a_model_without_a_price_cannot_be_rented(client, alice, catalog, fleet, fund, rate_card):
    rate_card({"h100-80gb": "16"}, effective_from=timezone.now() - timedelta(minutes=1))
    fund(alice, "100")
    client.force_login(alice)
    response = client.post(reverse("cluster_new"), _form())
    assert "has no price on the rate card" in " ".join(response.context["form"].errors["resource"])


def _running(alice, make_cluster, name="c1", gpus=2):
    cluster = make_cluster(alice, name, gpus=gpus)
    scheduler.place_pending()
    ran(cluster)  # its workspace started as it was placed (billing starts there)
    cluster.refresh_from_db()
    return cluster


def test_billing_page_ledger_costs_and_statement(client, alice, card, fleet, fund, make_cluster):
    fund(alice, "100")
    cluster = _running(alice, make_cluster)
    start = cluster.node_set.get().placed_at.replace(microsecond=0)
    accrual.accrue(now=start + timedelta(seconds=60))
    client.force_login(alice)
    page = client.get(reverse("billing")).content.decode()
    # 60 s x 2 GPUs x 7.80 / 3600 = 0.2600
    assert 'data-testid="balance">99.74<' in page
    assert 'data-testid="burn">15.6000<' in page
    assert 'data-testid="bill-seconds">60<' in page and "A100 80 GB" in page
    assert (
        'data-testid="cluster-cost">0.2600<' in page
        and 'data-testid="bill-amount">-0.2600<' in page
    )
    usage_only = client.get(reverse("billing"), {"kind": "usage"}).context["page"].object_list
    assert [e.kind for e in usage_only] == ["usage"]
    now = timezone.now()
    response = client.get(reverse("billing_statement", args=[now.year, now.month]))
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.getvalue().decode("utf-8-sig"))))
    usage = [r for r in rows if r["kind"] == "usage"]
    assert usage[0]["amount"] == "-0.2600" and usage[0]["seconds"] == "60"
    assert usage[0]["units"] == "2" and usage[0]["rate per unit-hour"] == "7.8000"
    assert usage[0]["cluster"] == cluster.name
    detail = client.get(reverse("billing_statement_detail", args=[now.year, now.month]))
    rows = list(csv.DictReader(io.StringIO(detail.getvalue().decode("utf-8-sig"))))
    assert sum(Decimal(r["amount"]) for r in rows) == Decimal(rows[-1]["balance after"])


def test_another_tenant_sees_none_of_it(client, alice, bob, card, fleet, fund, make_cluster):
    fund(alice, "100")
    cluster = _running(alice, make_cluster, name="alices-secret-run")
    accrual.accrue(now=timezone.now() + timedelta(seconds=30))
    client.force_login(bob)
    assert client.get(reverse("billing"), {"cluster": cluster.pk}).status_code == 404
    page = client.get(reverse("billing")).content.decode()
    assert cluster.name not in page and "No ledger entries" in page
    now = timezone.now()
    body = (
        client.get(reverse("billing_statement", args=[now.year, now.month]))
        .getvalue()
        .decode("utf-8-sig")
    )
    assert cluster.name not in body and len(body.strip().splitlines()) == 1
    assert client.get(reverse("ops_billing")).status_code == 302  # operators only


def test_low_balance_warning_on_every_page(client, alice, card, fleet, fund, make_cluster):
    fund(alice, "10")  # 15.60 /h: about 38 minutes
    _running(alice, make_cluster)
    client.force_login(alice)
    for name in ("dashboard", "cluster_list", "ssh_keys"):
        body = client.get(reverse(name)).content.decode()
        assert "Low balance" in body and "38 min" in body, name


def test_operator_tops_up_once_per_form_and_sees_revenue(client, operator, alice, card):
    account = billing.account_for(alice)
    client.force_login(operator)
    change = client.get(reverse("admin:billing_account_change", args=[account.pk]))
    token = change.context["entry_form"].initial["token"]
    url = reverse("admin:billing_account_entry", args=[account.pk])
    data = {"kind": "topup", "amount": "50", "memo": "invoice 2026-117", "token": token}
    client.post(url, data)
    client.post(url, data)  # a double submit
    account.refresh_from_db()
    assert account.balance == Decimal("50")
    entry = LedgerEntry.objects.get(account=account)
    assert entry.created_by == operator and entry.memo == "invoice 2026-117"
    client.post(url, {**data, "memo": "", "token": "other"})
    assert LedgerEntry.objects.count() == 1, "no entry without a reason"
    page = client.get(reverse("ops_billing")).content.decode()
    assert "alice" in page and 'data-testid="account-balance">50.00<' in page


def test_a_rate_card_in_force_is_history(client, operator, card):
    client.force_login(operator)
    url = reverse("admin:billing_ratecard_change", args=[card.pk])
    page = client.get(url)
    assert page.status_code == 200 and not page.context["has_change_permission"]
    assert client.post(reverse("admin:billing_ratecard_delete", args=[card.pk]), {"post": "yes"})
    assert RateCard.objects.filter(pk=card.pk).exists()


def test_exhausted_accounts_are_marked_for_operators(alice, card, fleet, fund, make_cluster):
    fund(alice, "0.01")
    cluster = _running(alice, make_cluster)
    accrual.accrue(now=timezone.now() + timedelta(seconds=30))
    cluster.refresh_from_db()
    assert cluster.state == Cluster.State.STOPPED  # its files kept (issue 41)
    assert cluster.state_reason == "stopped: balance exhausted"
    assert Account.objects.get(user=alice).exhausted_at is not None
    assert cluster.events.filter(kind="stopped").exists()

"""The storage page as a researcher reads it: what her files take against her quota (a
bar), the free part, what she bought and its price per GB-hour; a form that buys more or
gives some back and says in a sentence what is wrong with what she typed; the cluster
form's line under the volumes. On MooseFS (the test fleet) usage is the filesystem's
count and buying writes the quota of her root; a local folder says that nothing enforces
it. In Chromium, in Chinese and English, at a laptop's and a phone's width."""

import os
from decimal import Decimal

import pytest
from browsing import login
from django.urls import reverse
from playwright.sync_api import expect

from jobs.files import storage
from jobs.files.storage import VolumeSpec
from jobs.models import StorageGrant

pytestmark = pytest.mark.django_db

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")
FREE = "0.05"  # GB: 51.2 MiB


@pytest.fixture
def files(settings, rate_card, fund, alice, storage_root):
    """Alice's storage with 20 MiB in it, the storage price on the card, and money."""
    settings.SUANLI_STORAGE_FREE_GB = FREE
    rate_card({}, storage_per_gb_hour=Decimal("0.0003"))
    fund(alice, "10")
    (folder,) = storage.ensure_folders(
        storage.tenant_root(alice.pk), [VolumeSpec("datasets", "/data")]
    )
    with open(os.path.join(folder, "part-0"), "wb") as f:
        f.write(b"\0" * (20 * 2**20))
    return folder


def _page(client) -> str:
    response = client.get(reverse("storage"))
    assert response.status_code == 200
    return response.content.decode()


@pytest.mark.engine  # MooseFS: what enforces her quota
def test_the_page_shows_what_her_files_take_of_her_quota_and_what_it_costs(client, alice, files):
    client.force_login(alice)
    body = _page(client)
    assert 'data-testid="storage-used">0.02 GB<' in body  # 20 MiB
    assert 'data-testid="storage-quota">0.05 GB<' in body
    assert "(39&nbsp;%)" in body and 'style="width:39%"' in body
    assert 'data-testid="storage-free">0.05 GB<' in body
    assert 'data-testid="storage-bought">0 GB<' in body
    assert 'data-testid="storage-price">0.0003<' in body
    assert "whether or not your files fill it" in body
    assert 'data-testid="storage-local"' not in body, "MooseFS enforces it"
    # Buying raises the filesystem's quota of her root at once.
    response = client.post(reverse("storage"), {"extra_gb": "3"}, follow=True)
    body = response.content.decode()
    assert "Your quota is now 3.05 GB" in body
    assert 'data-testid="storage-bought">3 GB<' in body
    assert 'data-testid="storage-per-hour">0.0009<' in body
    assert storage.quota_read(storage.tenant_root(alice.pk)) == storage.gb_bytes(Decimal("3.05"))
    # The cluster form says the same under the volumes.
    form = client.get(reverse("cluster_new")).content.decode()
    assert "Your storage: 0.02 GB of 3.05 GB used." in form


def test_a_local_folder_says_that_nothing_enforces_its_quota(client, alice, files, settings):
    settings.SUANLI_STORAGE_FS = "local"
    client.force_login(alice)
    body = _page(client).replace("&#x27;", "'")
    assert (
        "This console's storage is a local folder on one machine; quotas are not enforced." in body
    )
    assert 'data-testid="storage-used">0.02 GB<' in body, "measured by a walk"
    settings.SUANLI_STORAGE_WALK_MAX = 1  # a folder and a file: the walk stops after one
    assert 'data-testid="storage-used">at least 0.00 GB<' in _page(client)
    assert "(A local folder: not enforced.)" in client.get(reverse("cluster_new")).content.decode()


@pytest.mark.parametrize(
    ("typed", "says"),
    [
        ("-5", "Give 0 or more GB: 0 keeps the free part only."),
        ("--5", "Give a whole number of GB, e.g. 50 (not --5)."),
        ("lots", "Give a whole number of GB, e.g. 50 (not lots)."),
        ("2.5", "Give a whole number of GB, e.g. 50 (not 2.5)."),
        ("1e3", "Give a whole number of GB, e.g. 50 (not 1e3)."),
        ("\uff11\uff10", "Give a whole number of GB"),  # full-width digits
        ("", "This field is required."),
        ("99999999999999", "At most 10240 GB in all"),
        ("20000", "At most 10240 GB in all: with the free 0.05 GB you can buy up to 10239 GB."),
    ],
)
def test_bad_input_is_refused_with_a_sentence(client, alice, files, typed, says):
    client.force_login(alice)
    response = client.post(reverse("storage"), {"extra_gb": typed})
    assert response.status_code == 200
    assert says in response.content.decode().replace("&#x27;", "'")
    assert not StorageGrant.objects.exists()


def test_below_what_her_files_take_or_beyond_her_balance_is_refused(client, alice, bob, files):
    client.force_login(alice)
    client.post(reverse("storage"), {"extra_gb": "1"})
    client.post(reverse("storage"), {"extra_gb": "0"})
    assert storage.extra_gb(alice.pk) == 0, "20 MiB fit in the free 0.05 GB: back to it is fine"
    client.post(reverse("storage"), {"extra_gb": "2"})
    with open(os.path.join(files, "part-1"), "wb") as f:
        f.write(b"\0" * (40 * 2**20))  # 60 MiB in all, past the free part
    response = client.post(reverse("storage"), {"extra_gb": "0"})
    assert (
        "Your files take 0.06 GB, more than a quota of 0.05 GB would hold: keep at least 1 GB "
        "above the free 0.05 GB, or delete files first." in response.content.decode()
    )
    assert storage.extra_gb(alice.pk) == 2
    # Bob has no money: he may not buy, he may always keep the free part.
    client.force_login(bob)
    response = client.post(reverse("storage"), {"extra_gb": "100"})
    assert "Your balance does not cover 10 minutes of 100 GB (0.0300 per hour): top up first." in (
        response.content.decode()
    )
    assert storage.extra_gb(bob.pk) == 0


@pytest.mark.browser
@pytest.mark.parametrize("language", ["en", "zh-CN"])
def test_the_page_in_chromium_at_a_laptops_and_a_phones_width(
    browser, live_server, alice, files, language
):
    context = browser.new_context(viewport={"width": 1366, "height": 800}, locale=language)
    page = context.new_page()
    try:
        login(page, live_server, "alice", "alice-pass-123")
        page.goto(f"{live_server.url}{reverse('storage')}")
        expect(page.get_by_test_id("storage-used")).to_have_text("0.02 GB")
        bar = page.locator('[role="progressbar"] > span')
        assert 500 < page.locator('[role="progressbar"]').bounding_box()["width"]
        assert bar.bounding_box()["width"] > 0
        page.fill("#id_extra_gb", "4")
        page.locator('[data-testid="storage-form"] button[type=submit]').click()
        expect(page.get_by_test_id("storage-bought")).to_have_text("4 GB")
        tag = "zh" if language.startswith("zh") else "en"
        page.screenshot(path=f"{SHOTS}/storage-{tag}-laptop.png", full_page=True)
        page.set_viewport_size({"width": 390, "height": 844})
        page.reload()
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the page is {overflow}px wider than a phone"
        page.screenshot(path=f"{SHOTS}/storage-{tag}-phone.png", full_page=True)
        page.goto(f"{live_server.url}{reverse('cluster_new')}")
        expect(page.get_by_test_id("storage-line")).to_be_visible()
        page.screenshot(path=f"{SHOTS}/storage-{tag}-cluster-form-phone.png", full_page=True)
    finally:
        context.close()


def test_operators_see_each_researchers_usage_and_quota(client, operator, alice, bob, files):
    from billing import services
    from billing import storage as bought

    bought.quota_set(owner=alice, extra_gb=2)
    services.account_for(bob)
    client.force_login(operator)
    body = client.get(reverse("ops_billing")).content.decode()
    rows = body.split('data-testid="account-storage">')[1:]
    assert len(rows) >= 2
    assert any(r.startswith("0.02 / 2.05 GB") and "2 GB bought" in r[:200] for r in rows), rows
    assert any(r.startswith("0.00 / 0.05 GB<") for r in rows), "bob: nothing yet, the free part"
    client.force_login(alice)
    assert client.get(reverse("ops_billing")).status_code in (302, 403, 404)  # not hers to see

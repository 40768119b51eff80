"""Through Debian's Chromium, as a person would."""

import os

import pytest
from browsing import login as _login
from playwright.sync_api import expect

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("priced"),
]


def test_researcher_sees_the_fleets_free_gpus(page, live_server, alice, make_host):
    make_host("gpu-a-01", engine=0, zone="zone-a", model="a100-80gb", gpus=8, check="reuse")
    make_host("gpu-b-01", engine=1, zone="zone-b", model="t4-16gb", gpus=4, check="reuse")
    _login(page, live_server, "alice", "alice-pass-123")
    expect(page.get_by_test_id("free-gpus")).to_have_text("12")
    table = page.locator("#availability")
    expect(table).to_contain_text("A100 80 GB")
    expect(table).to_contain_text("zone-b")
    page.screenshot(
        path=os.environ.get("SUANLI_SCREENSHOTS", "/tmp") + "/dashboard.png", full_page=True
    )


def test_operator_adds_a_host_in_the_admin_and_sees_it_healthy(
    page, live_server, operator, catalog, engine_urls
):
    _login(page, live_server, "olga", "olga-pass-123")
    page.goto(f"{live_server.url}/admin/jobs/host/add/")
    page.fill("#id_name", "gpu-b-07")
    page.fill("#id_engine_url", engine_urls[1])
    page.fill("#id_address", "127.0.0.1")
    page.fill("#id_zone", "zone-b")
    page.select_option("#id_gpu_model", label="H100 80 GB")
    page.fill("#id_gpu_count", "4")
    page.click("input[name=_save]")
    expect(page.locator(".messagelist")).to_contain_text("Host gpu-b-07 is active: Docker")
    page.goto(f"{live_server.url}/ops/hosts/")
    row = page.locator("tr[data-host=gpu-b-07]")
    expect(row).to_contain_text("active")
    expect(row).to_contain_text("4 x H100 80 GB")
    expect(row).to_contain_text("emulated GPUs")
    page.screenshot(
        path=os.environ.get("SUANLI_SCREENSHOTS", "/tmp") + "/ops_hosts.png", full_page=True
    )


def test_researcher_creates_a_two_node_cluster_with_a_volume(
    page, live_server, alice, make_host, storage_root, rq_worker
):
    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=8, check="reuse")
    make_host("gpu-b-01", engine=1, zone="zone-a", gpus=8, check="reuse")
    _login(page, live_server, "alice", "alice-pass-123")
    page.goto(f"{live_server.url}/clusters/new/")
    page.fill("#id_name", "ddp-run")
    page.select_option("#id_resource", "gpu:a100-80gb")
    page.fill("#id_nodes", "2")
    page.fill("#id_gpus_per_node", "8")
    page.fill("#id_volumes", "datasets:./data")
    page.get_by_role("button", name="Create cluster").click()
    error = page.locator("#field-volumes .errorlist")
    expect(error).to_contain_text(
        "'./data' is relative: container paths must be absolute. Write /workspace/data instead."
    )
    page.screenshot(
        path=os.environ.get("SUANLI_SCREENSHOTS", "/tmp") + "/cluster_form_error.png",
        full_page=True,
    )
    page.fill("#id_volumes", "datasets:/workspace/data")
    page.get_by_role("button", name="Create cluster").click()
    # The worker places it; the page follows on its own (htmx polling).
    expect(page.get_by_test_id("cluster-state")).to_have_text("running", timeout=20_000)
    nodes = page.locator("#nodes")
    expect(nodes).to_contain_text("gpu-a-01")
    expect(nodes).to_contain_text("gpu-b-01")
    expect(nodes).to_contain_text("GPU 0, 1, 2, 3, 4, 5, 6, 7")
    expect(page.locator("body")).to_contain_text("/workspace/data")
    page.screenshot(
        path=os.environ.get("SUANLI_SCREENSHOTS", "/tmp") + "/cluster_running.png", full_page=True
    )


def test_researcher_sees_the_price_the_cost_grow_and_downloads_the_statement(
    page, live_server, alice, make_host, storage_root, rq_worker
):
    import csv
    import io
    import time
    from decimal import Decimal

    from billing import accrual

    make_host("gpu-a-01", engine=0, zone="zone-a", gpus=8, check="reuse")
    _login(page, live_server, "alice", "alice-pass-123")
    page.goto(f"{live_server.url}/clusters/new/")
    page.fill("#id_name", "priced-run")
    page.select_option("#id_resource", "gpu:a100-80gb")
    page.fill("#id_nodes", "1")
    page.fill("#id_gpus_per_node", "4")
    # 4 x A100 80 GB at 7.80 per GPU-hour; spot at half.
    expect(page.get_by_test_id("price-on-demand")).to_have_text("31.2000")
    expect(page.get_by_test_id("price-spot")).to_have_text("15.6000")
    page.fill("#id_gpus_per_node", "2")
    expect(page.get_by_test_id("price-on-demand")).to_have_text("15.6000")
    expect(page.get_by_test_id("form-balance")).to_have_text("1000.00")
    page.screenshot(
        path=os.environ.get("SUANLI_SCREENSHOTS", "/tmp") + "/cluster_form_price.png",
        full_page=True,
    )
    page.get_by_role("button", name="Create cluster").click()
    expect(page.get_by_test_id("cluster-state")).to_have_text("running", timeout=20_000)

    accrual.accrue()  # what the cron's accrual tick does
    page.goto(f"{live_server.url}/billing/")
    first = Decimal(page.get_by_test_id("cluster-cost").inner_text())
    expect(page.get_by_test_id("burn")).to_have_text("15.6000")
    time.sleep(2.2)
    accrual.accrue()
    page.reload()
    second = Decimal(page.get_by_test_id("cluster-cost").inner_text())
    assert second > first, (first, second)
    balance = (Decimal("1000") - second).quantize(Decimal("0.01"), rounding="ROUND_HALF_UP")
    assert Decimal(page.get_by_test_id("balance").inner_text()) == balance
    expect(page.locator("#ledger")).to_contain_text("priced-run")
    expect(page.locator("#daily-chart .main-svg").first).to_be_visible()
    page.screenshot(
        path=os.environ.get("SUANLI_SCREENSHOTS", "/tmp") + "/billing.png", full_page=True
    )
    with page.expect_download() as info:
        page.get_by_test_id("statement").first.click()
    download = info.value
    assert download.suggested_filename.startswith("suanli-statement-")
    rows = list(csv.DictReader(io.StringIO(open(download.path(), encoding="utf-8").read())))
    usage = [r for r in rows if r["kind"] == "usage"]
    assert usage and all(r["cluster"] == "priced-run" and r["units"] == "2" for r in usage)
    assert -sum(Decimal(r["amount"]) for r in usage) == second

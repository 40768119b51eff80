"""Operators' Fleet page and the console on a phone, through Chromium."""

import os
from datetime import UTC, datetime, timedelta

import pytest
from browsing import login as _login
from playwright.sync_api import expect

from jobs.hosts import services as host_services
from jobs.models import Host
from jobs.placement import scheduler
from monitoring.models import Sample

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("priced"),
]

SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")


def _paper_host(catalog, name, gpus):
    """An emulated-GPU host with no engine behind it: the page reads only the database."""
    return host_services.host_save(
        host=Host(
            name=name, engine_url="unix:///run/suanli-no-such-engine.sock", address="127.0.0.1",
            zone="zone-a", gpu_model=catalog["a100-80gb"], gpu_count=gpus,
            state=Host.State.ACTIVE, emulated_gpu=True,
        )
    )  # fmt: skip


def test_the_fleet_heatmap_has_a_valued_cell_per_gpu(
    page, live_server, operator, alice, catalog, make_cluster
):
    _paper_host(catalog, "gpu-a-01", 8)
    _paper_host(catalog, "gpu-a-02", 4)
    busy = make_cluster(alice, "busy", nodes=1, gpus=2)
    make_cluster(alice, "quiet", nodes=1, gpus=2)
    scheduler.place_pending()
    node = busy.node_set.get()
    # A reading for the busy cluster's node (a running job's); the quiet one has none.
    Sample.objects.create(
        at=datetime.now(UTC) + timedelta(seconds=30), cluster=busy, host=node.host,
        node_index=0, gpu_util=[37.0, 81.0], gpu_mem_mib=[1, 1], cpu_pct=50.0,
        mem_bytes=0, net_rx_bps=0.0, net_tx_bps=0.0, disk_read_bps=0.0,
        disk_write_bps=0.0, read_iops=0.0, write_iops=0.0,
    )  # fmt: skip
    _login(page, live_server, "olga", "olga-pass-123")
    page.goto(f"{live_server.url}/ops/fleet/")
    page.wait_for_function("document.getElementById('heatmap').data !== undefined")
    trace = page.evaluate(
        "(() => { const t = document.getElementById('heatmap').data[0];"
        " return {z: t.z, y: t.y, text: t.text}; })()"
    )
    rows = dict(zip(trace["y"], trace["z"], strict=True))
    assert set(rows) == {"gpu-a-01 (emulated)", "gpu-a-02 (emulated)"}
    cells = [v for name, row in rows.items() for v in row[: 8 if "01" in name else 4]]
    assert len(cells) == 12 and None not in cells, rows  # one cell per GPU, each a value
    assert sorted(cells).count(-20) == 8  # free
    assert sorted(cells).count(-10) == 2  # held, no reading (emulated, no job running)
    assert 37.0 in cells and 81.0 in cells
    texts = [t for row in trace["text"] for t in row]
    assert texts.count("free") == 8 and texts.count("held") == 2 and "37 %" in texts
    # As the Hosts page counts them: held slots (both clusters sit on the 4-GPU host).
    expect(page.locator('#fleet-hosts [data-k="busy"]')).to_have_text(["0 / 8", "4 / 4"])
    expect(page.get_by_test_id("idle-rented")).to_contain_text("of 4 rented GPUs idle")
    page.screenshot(path=f"{SHOTS}/ops_fleet.png", full_page=True)


@pytest.mark.parametrize("who", ["alice", "olga"])
def test_a_phone_never_scrolls_sideways(browser, live_server, alice, operator, catalog, who):
    _paper_host(catalog, "gpu-a-01", 8)
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    page = context.new_page()
    _login(page, live_server, who, f"{who}-pass-123")
    for path in ["/", "/clusters/", "/clusters/new/", "/billing/", "/api/tokens/"] + (
        ["/ops/hosts/", "/ops/fleet/", "/ops/queue/"] if who == "olga" else []
    ):
        page.goto(f"{live_server.url}{path}")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"{path} is {width} px wide"
        if path == "/":
            page.screenshot(path=f"{SHOTS}/phone_{who}_dashboard.png", full_page=True)
    context.close()

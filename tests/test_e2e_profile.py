"""`make e2e`: torch.profiler in a real 2-rank gloo DDP job across the two engines, as a
researcher writes it, and its Profile section in Chromium.

Rank 1 sleeps in its Dataset's __getitem__ (data loading); rank 0 then waits for it in
every all-reduce. The job writes its traces with `tensorboard_trace_handler(
os.environ["SUANLI_PROFILE_DIR"])` and prints `prof.key_averages().table()`.
"""

import os
import textwrap

import pytest
from browsing import login
from playwright.sync_api import expect

from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.files.storage import VolumeSpec
from jobs.models import Image, Job
from jobs.runs import dispatch
from monitoring.models import TraceSummary

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

TORCH_IMAGE = os.environ.get("SUANLI_TORCH_IMAGE", "suanli/torch:2.13-cpu")
SHOTS = os.environ.get("SUANLI_SCREENSHOTS", "/tmp")

TRAIN = textwrap.dedent(
    """
    import os, time, torch, torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 48
        def __getitem__(self, i):
            if rank == 1:
                time.sleep(0.005)  # slow data loading on rank 1 only
            return torch.randn(32), torch.randn(1)

    loader = torch.utils.data.DataLoader(Data(), batch_size=8)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with profile(activities=[ProfilerActivity.CPU],
                 schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
                 on_trace_ready=tensorboard_trace_handler(os.environ["SUANLI_PROFILE_DIR"])) as prof:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            prof.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), flush=True)
    dist.destroy_process_group()
    """
)


def test_a_profiled_ddp_job_names_its_slowest_rank_and_why(
    running_cluster, storage_root, alice, settle_until, work_queue, live_server, browser
):
    Image.objects.get_or_create(
        name="PyTorch 2.13 CPU (local)", defaults={"reference": TORCH_IMAGE}
    )
    code = storage_root / f"u{alice.pk}" / "code"
    code.mkdir(parents=True, exist_ok=True)
    (code / "train.py").write_text(TRAIN)
    cluster = running_cluster(
        2,
        gpus=2,  # a host's two GPUs: one node on each engine
        volumes=(
            VolumeSpec(source="code", target="/code", read_only=True),
            VolumeSpec(source="out", target="/workspace"),
        ),
    )
    cluster.image_reference = TORCH_IMAGE
    cluster.save(update_fields=["image_reference"])
    job = services.job_submit(
        cluster=cluster,
        spec=JobSpec(name="profiled", command="python3 /code/train.py"),
    )
    dispatch.dispatch(cluster.pk)
    job = settle_until(job, timeout=180)
    assert job.state == Job.State.SUCCEEDED, (
        job.state_reason,
        [r.log[-800:] for r in job.replicas.all()],
    )
    assert {r.host.name for r in job.replicas.all()} == {"gpu-a-01", "gpu-b-01"}
    work_queue("profiles")  # the summaries, queued when the job ended
    summaries = list(TraceSummary.objects.filter(job=job).order_by("rank"))
    assert [s.rank for s in summaries] == [0, 1], [(s.name, s.error) for s in summaries]
    assert all(s.summary and not s.error for s in summaries)
    one = summaries[1].summary
    assert one["split"]["dataloader"] > 0.5 * one["window_us"], one["split"]

    context = browser.new_context(viewport={"width": 1366, "height": 900})
    page = context.new_page()
    try:
        login(page, live_server, "alice", "alice-pass-123")
        page.goto(f"{live_server.url}/jobs/{job.pk}/")
        section = page.get_by_test_id("profile")
        expect(section.get_by_test_id("profile-files").locator("tbody tr")).to_have_count(2)
        expect(section.get_by_test_id("profile-slowest")).to_contain_text("Slowest rank: 1")
        expect(section.get_by_test_id("profile-slowest")).to_contain_text("data loading")
        expect(page.get_by_test_id("profile-advice").first).to_contain_text("rank 1")
        expect(section.locator("#profile-split-chart .main-svg").first).to_be_visible()
        tables = page.get_by_test_id("key-averages")
        expect(tables).to_have_count(2)
        # As printed (sorted by self CPU time); then by the number of calls, both ways.
        first = tables.first
        header = first.locator("th")
        names = [header.nth(i).inner_text().strip() for i in range(header.count())]
        self_cpu = names.index("Self CPU")
        printed = _column(first, self_cpu)
        assert printed == sorted(printed, reverse=True), printed
        calls = names.index("# of Calls")
        header.nth(calls).locator("button").click()
        expect(header.nth(calls)).to_have_attribute("aria-sort", "descending")
        counted = _column(first, calls)
        assert counted == sorted(counted, reverse=True) and counted[0] > counted[-1], counted
        header.nth(calls).locator("button").click()
        expect(header.nth(calls)).to_have_attribute("aria-sort", "ascending")
        assert _column(first, calls) == sorted(counted)
        section.scroll_into_view_if_needed()
        page.screenshot(path=f"{SHOTS}/profile_ddp.png", full_page=True)
    finally:
        context.close()


def _column(table, index: int) -> list[float]:
    cells = table.locator(f"tbody tr td:nth-child({index + 1})")
    return [float(cells.nth(i).get_attribute("data-value")) for i in range(cells.count())]

"""A job's GPU energy: power read from NVML and from a dcgm-exporter by the monitor on a
real job, summed from its samples (and, once they are pruned, its minute rollups), the
carbon at the operator's grid intensity, and no reading (never 0) on an emulated host."""

import asyncio
import sys
import threading
import types
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import django_rq
import pytest
from django.utils import timezone

from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import Host, Job, Node
from jobs.runs import dispatch, stopping
from monitoring import collector, dcgm, energy, tasks
from monitoring.models import Rollup, Sample
from monitoring.monitor import Monitor

pytestmark = pytest.mark.django_db

DATA = Path(__file__).parent / "data"
MIB = 1024 * 1024


# ------------------------------------------------------------------ recorded readings


def _nvml_rows() -> list[dict[int, tuple[float, float, float | None]]]:
    """tests/data/nvml-h100x2.csv: per second, GPU index -> (util %, MiB, watts or None)."""
    seconds: dict[str, dict] = {}
    for line in (DATA / "nvml-h100x2.csv").read_text().splitlines():
        if line.startswith(("#", "timestamp")) or not line.strip():
            continue
        at, index, util, mem, power = (f.strip() for f in line.split(","))
        watts = None if power == "[N/A]" else float(power)
        seconds.setdefault(at, {})[int(index)] = (float(util), float(mem), watts)
    return list(seconds.values())


class NVMLError(Exception):
    pass


def _recorded_nvml() -> types.ModuleType:
    """A stand-in for nvidia-ml-py that replays the recording: each nvmlInit (one a
    monitor tick) moves to the next second; power in milliwatts, as NVML gives it; a
    reading the recording lacks raises NVMLError as NVML does."""
    rows = _nvml_rows()
    module = types.ModuleType("pynvml")
    module.NVMLError = NVMLError
    state = {"tick": -1}

    def row() -> dict:
        return rows[state["tick"] % len(rows)]

    def init():
        state["tick"] += 1

    def handle(index):
        if index not in row():
            raise NVMLError("Invalid Argument")
        return index

    def power(index):
        watts = row()[index][2]
        if watts is None:
            raise NVMLError("Not Supported")
        return int(round(watts * 1000))

    module.nvmlInit = init
    module.nvmlDeviceGetHandleByIndex = handle
    module.nvmlDeviceGetUtilizationRates = lambda i: types.SimpleNamespace(gpu=int(row()[i][0]))
    module.nvmlDeviceGetMemoryInfo = lambda i: types.SimpleNamespace(used=int(row()[i][1] * MIB))
    module.nvmlDeviceGetPowerUsage = power
    module.state = state
    return module


def test_nvml_power_is_read_in_watts_and_a_failed_read_is_none_not_0(monkeypatch):
    recorded = _recorded_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", recorded)
    rows = _nvml_rows()
    util, mem, watts = collector.nvml_gpus([0, 1], power=True)
    assert util == [97.0, 95.0] and mem == [71532.0, 71490.0]
    assert watts == [612.5, 598.1]  # 612450 mW -> 612.45 W, to a tenth
    collector.nvml_gpus([0, 1], power=True)
    # The third second: GPU 1's power could not be read. No reading, never 0 watts; its
    # utilisation and memory still are.
    util, mem, watts = collector.nvml_gpus([0, 1], power=True)
    assert watts == [302.0, None] and util == [41.0, 39.0] and rows[2][1][2] is None
    # Callers that ask for no power get the two lists as before.
    assert collector.nvml_gpus([1]) == ([97.0], [71502.0])


def test_the_dcgm_parser_reads_the_power_draw_in_watts():
    gpus = dcgm.parse((DATA / "dcgm-exporter-a100x2.prom").read_text())
    assert gpus[0].power_w == 312.482 and gpus[1].power_w == 287.119
    text = (
        'DCGM_FI_DEV_GPU_UTIL{gpu="0"} 50\n'
        'DCGM_FI_DEV_POWER_USAGE{gpu="0"} NaN\n'
        'DCGM_FI_DEV_GPU_UTIL{gpu="1"} 50\n'
        'DCGM_FI_DEV_POWER_USAGE{gpu="1"} -5\n'
    )
    assert [g.power_w for g in dcgm.parse(text).values()] == [None, None]  # no reading


# ------------------------------------------------------------------ from the rows


@pytest.fixture
def ended_job(make_paper_host, make_cluster, alice):
    host = make_paper_host("gpu-paper-01", gpus=8)
    cluster = make_cluster(alice, "power", gpus=2)
    job = Job.objects.create(
        cluster=cluster, owner=alice, name="train", command="true", state="succeeded"
    )
    job.host = host
    return job


def _row(model, job, at, node=0, power=(), source="nvml", **extra):
    return model(
        at=at, cluster=job.cluster, job=job, host=job.host, node_index=node,
        gpu_util=[90.0, 90.0], gpu_mem_mib=[1000.0, 1000.0], gpu_power_w=list(power),
        gpu_source=source, cpu_pct=100.0, mem_bytes=1, net_rx_bps=0.0, net_tx_bps=0.0,
        disk_read_bps=0.0, disk_write_bps=0.0, read_iops=0.0, write_iops=0.0, **extra,
    )  # fmt: skip


T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)


def _energy(job):
    """What a page shows: the job read afresh, as each request reads it."""
    return energy.energy_of(Job.objects.select_related("cluster").get(pk=job.pk))


def _both_ways(job) -> bool:
    """The sums made in PostgreSQL are the rows' own (what other databases read)."""
    edge = energy._edge(None)
    return energy._measure_rows(job.pk, edge)[:2] == pytest.approx(
        energy._measure_sql(job.pk, edge, energy._width(job.pk))[:2]
    )


def test_energy_sums_the_samples_watts_and_seconds(ended_job, settings):
    settings.SUANLI_GRID_CO2_G_PER_KWH = None
    job = ended_job
    Sample.objects.bulk_create(
        [_row(Sample, job, T0 + timedelta(seconds=s), power=[300.0, 250.0]) for s in range(100)]
        # One GPU's power unread for 10 s: its watts are missing, not 0.
        + [_row(Sample, job, T0 + timedelta(seconds=100 + s), power=[300.0, None]) for s in range(10)]
        # 10 s without any reading: no energy, no seconds read.
        + [_row(Sample, job, T0 + timedelta(seconds=110 + s), power=[]) for s in range(10)]
        # A second node of the job.
        + [_row(Sample, job, T0 + timedelta(seconds=s), node=1, power=[100.0, 100.0]) for s in range(60)]
    )  # fmt: skip
    found = _energy(job)
    assert found.joules == pytest.approx(100 * 550 + 10 * 300 + 60 * 200)  # 70,000 J
    assert found.kwh == pytest.approx(70_000 / 3_600_000)
    assert found.seconds_read == 170 and found.source == "nvml"
    assert found.co2_g is None  # no grid intensity set: no carbon figure
    words = str(energy.energy_words(found))
    assert words.startswith("0.0194 kWh (70 kJ) of GPU energy over 3 min of power readings")
    assert "no carbon estimate: the operator has set no grid intensity" in words
    # The rows read one by one (other databases) give the same sums.
    assert _both_ways(job)


def test_pruned_minutes_count_from_their_rollups_once(ended_job, settings):
    settings.SUANLI_GRID_CO2_G_PER_KWH = 581
    settings.SUANLI_METRICS_RAW_HOURS = 24
    job = ended_job
    watts = [[610.0, 590.0], [305.0, None], [120.0, 118.0]]  # a busy, a half-read, a quiet phase
    Sample.objects.bulk_create(
        [
            _row(Sample, job, T0 + timedelta(seconds=s), power=watts[s // 60])
            for s in range(180)
            if s != 150  # a second the monitor missed: no reading for it
        ]
    )
    before = _energy(job)
    expected = 60 * 1200 + 60 * 305 + 59 * 238
    assert before.joules == pytest.approx(expected) and before.seconds_read == 179
    # The minutes roll up (their mean draw per GPU, only of readings), then the seconds go.
    assert tasks.rollup(now=T0 + timedelta(minutes=5)) == 3
    assert [r.gpu_power_w for r in Rollup.objects.order_by("at")] == watts
    raw, _ = tasks.prune(now=T0 + timedelta(hours=24, seconds=90))
    assert raw == 90  # the first minute and a half: the second minute is half pruned
    after = _energy(job)
    # The same energy from the rollups of the pruned minutes and the samples left (the
    # half-pruned minute from its rollup, not twice, not half).
    assert after.joules == pytest.approx(before.joules)
    assert after.seconds_read == 179
    assert _both_ways(job)
    # Carbon at the operator's grid intensity, said with it.
    assert after.co2_g == pytest.approx(expected / 3_600_000 * 581)
    assert str(energy.energy_words(after)).endswith(", about 16.8 g CO2 at 581 g/kWh")
    # Its total is kept at its end; once every row is gone the page still has it.
    assert tasks.job_energy(job.pk) == pytest.approx(expected)
    Sample.objects.all().delete()
    Rollup.objects.all().delete()
    job.refresh_from_db()
    kept = _energy(job)
    assert kept.joules == pytest.approx(expected) and kept.source == "stored"
    assert kept.seconds_read is None
    assert str(energy.energy_words(kept)).startswith("0.029 kWh (104 kJ) of GPU energy, about")
    # Running it again with nothing left never lowers what was kept.
    assert tasks.job_energy(job.pk) == pytest.approx(expected)


def test_a_recent_minute_the_job_shared_with_its_workspace_counts_its_own_seconds(ended_job):
    # The job started half way through a minute its node's workspace had begun: that
    # minute's rollup (named for the job, as its last second was) holds 60 seconds, the
    # job's samples 30. Its samples are all there (a recent minute): they count, not the
    # workspace's half minute before it.
    job = ended_job
    start = timezone.now().replace(second=0, microsecond=0) - timedelta(minutes=10)
    Sample.objects.bulk_create(
        [_row(Sample, job, start + timedelta(seconds=30 + s), power=[500.0]) for s in range(90)]
    )
    Rollup.objects.bulk_create(
        [
            _row(Rollup, job, start, power=[350.0], samples=60),
            _row(Rollup, job, start + timedelta(minutes=1), power=[500.0], samples=60),
        ]
    )
    found = _energy(job)
    assert found.joules == pytest.approx(90 * 500) and found.seconds_read == 90
    assert _both_ways(job)


def test_a_job_without_any_power_reading_has_no_energy_not_zero(ended_job):
    job = ended_job
    assert _energy(job).joules is None
    said = str(energy.energy_words(_energy(job)))
    assert said == "No power reading yet: no samples of this job"
    Sample.objects.bulk_create(
        [_row(Sample, job, T0 + timedelta(seconds=s), source="derived") for s in range(5)]
    )
    found = _energy(job)
    assert found.joules is None and found.kwh is None and found.co2_g is None
    assert found.source == "derived"
    assert str(energy.energy_words(found)) == "No power reading on this host (emulated GPUs)"
    assert tasks.job_energy(job.pk) is None
    job.refresh_from_db()
    assert job.energy_j is None


def test_the_grid_intensity_setting_is_checked():
    """An operator's typo stops the console at its start, in words, not a wrong figure."""
    import os
    import subprocess

    def check(value):
        return subprocess.run(
            [sys.executable, "-c", "import console.settings as s; print(s.SUANLI_GRID_CO2_G_PER_KWH)"],
            env={**os.environ, "SUANLI_GRID_CO2_G_PER_KWH": value, "DEBUG": "1"},
            capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
        )  # fmt: skip

    assert check("570.3").stdout.strip() == "570.3"
    assert check("").stdout.strip() == "None"
    for bad in ("0", "nan", "lots", "1e9"):
        refused = check(bad)
        assert refused.returncode != 0 and "SUANLI_GRID_CO2_G_PER_KWH" in refused.stderr, bad


# ------------------------------------------------------------------ the monitor, for real


class _Exporter:
    """A dcgm-exporter on this machine: serves the recorded scrape at /metrics."""

    def __init__(self):
        body = (DATA / "dcgm-exporter-a100x2.prom").read_bytes()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                self.send_response(200 if self.path == "/metrics" else 404)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _submit(cluster, command, name="j"):
    job = services.job_submit(cluster=cluster, spec=JobSpec(name=name, command=command))
    dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    assert job.state == "running", job.state_reason
    return job


def _monitor(ticks: int) -> None:
    monitor = Monitor(publish=False)
    try:
        asyncio.run(monitor.run(ticks=ticks))
    finally:
        monitor.close()


def _end(job, settle_until, work_queue):
    """Cancel it as its owner would; the runner ends it and queues its energy by name."""
    django_rq.get_queue("default").empty()
    services.job_cancel(job=job, by="alice")
    stopping.stop(job.pk)
    settle_until(job, states=("cancelled",))
    queued = django_rq.get_queue("default").fetch_job(f"energy-{job.pk}")
    assert queued is not None and queued.func_name == "monitoring.tasks.job_energy"
    work_queue("default")
    job.refresh_from_db()
    return job


@pytest.mark.django_db(transaction=True)  # the monitor reads through its executor's connections
def test_the_monitor_reads_power_from_dcgm_and_nvml_and_the_job_keeps_its_energy(
    running_cluster, settle_until, work_queue, monkeypatch, settings
):
    settings.SUANLI_GRID_CO2_G_PER_KWH = 570.3
    cluster = running_cluster(2, gpus=2, workspace=False)  # one node on each engine, full
    job = _submit(cluster, "sleep 300", "train")
    nodes = {n.index: n for n in Node.objects.filter(cluster=cluster).select_related("host")}
    # The first node's host has an operator's dcgm-exporter (a real HTTP server here); the
    # second's is an NVIDIA host with the monitor on it: NVML (the recording replayed).
    exporter = _Exporter()
    Host.objects.filter(pk=nodes[0].host_id).update(dcgm_url=exporter.url)
    Host.objects.filter(pk=nodes[1].host_id).update(emulated_gpu=False)
    monkeypatch.setitem(sys.modules, "pynvml", _recorded_nvml())
    try:
        _monitor(6)
    finally:
        exporter.close()
    scrape = dcgm.parse((DATA / "dcgm-exporter-a100x2.prom").read_text())
    from_dcgm = list(Sample.objects.filter(job=job, node_index=0))
    assert len(from_dcgm) >= 3
    for sample in from_dcgm:
        assert sample.gpu_source == "dcgm"
        assert sample.gpu_power_w == [scrape[i].power_w for i in nodes[0].gpu_indices]
    recorded = {
        i: {row[i][2] for row in _nvml_rows()} for i in nodes[1].gpu_indices
    }  # every power the recording holds for the node's GPUs
    from_nvml = list(Sample.objects.filter(job=job, node_index=1))
    assert len(from_nvml) >= 3
    for sample in from_nvml:
        assert sample.gpu_source == "nvml"
        # Each GPU's watts as recorded to a tenth; None (not 0) where its read failed.
        assert sample.gpu_power_w == [] or all(
            (w is None and None in recorded[i])
            or round(w, 1) in {round(x, 1) for x in recorded[i] if x is not None}
            for i, w in zip(nodes[1].gpu_indices, sample.gpu_power_w, strict=True)
        ), sample.gpu_power_w
    assert sum(1 for s in from_nvml if s.gpu_power_w) >= 3
    joules = sum(sum(w for w in s.gpu_power_w if w is not None) for s in from_dcgm + from_nvml)
    found = _energy(job)
    assert found.joules == pytest.approx(joules) and found.source == "dcgm+nvml"
    assert found.co2_g == pytest.approx(joules / 3_600_000 * 570.3)
    assert str(energy.energy_words(found)).endswith(" at 570.3 g/kWh")
    # At its end the runner queues monitoring.tasks.job_energy by name: the job keeps it.
    job = _end(job, settle_until, work_queue)
    assert job.energy_j == pytest.approx(joules)
    assert _energy(job).joules == pytest.approx(joules)


@pytest.mark.django_db(transaction=True)  # the monitor reads through its executor's connections
def test_an_emulated_hosts_job_says_it_has_no_power_reading(
    running_cluster, settle_until, work_queue
):
    cluster = running_cluster(1, workspace=False)  # the test engines: emulated GPUs
    job = _submit(cluster, "while :; do :; done", "busy")
    _monitor(4)
    samples = list(Sample.objects.filter(job=job))
    assert samples and all(s.gpu_source == "derived" and s.gpu_power_w == [] for s in samples)
    assert max(s.gpu_util[0] for s in samples) > 50  # its GPU use is derived; its power is not
    found = _energy(job)
    assert found.joules is None and found.source == "derived"
    assert str(energy.energy_words(found)) == "No power reading on this host (emulated GPUs)"
    job = _end(job, settle_until, work_queue)
    assert job.energy_j is None  # kept as no reading, not 0

"""The plain-words diagnosis of monitoring samples, on synthetic series: no database."""

import random
from datetime import UTC, datetime, timedelta

from monitoring.diagnosis import Point, diagnose

T0 = datetime(2025, 3, 4, 10, 0, 0, tzinfo=UTC)
MB = 1e6


def points(
    gpu: list[float],
    *,
    node: int = 0,
    gpus: int = 4,
    net: list[float] | float = 0.0,
    iops: list[float] | float = 0.0,
    start: datetime = T0,
) -> list[Point]:
    """One Point per second; every GPU of the node at the given utilisation."""
    nets = net if isinstance(net, list) else [net] * len(gpu)
    iopss = iops if isinstance(iops, list) else [iops] * len(gpu)
    return [
        Point(
            at=start + timedelta(seconds=i),
            node=node,
            gpu_util=(u,) * gpus,
            cpu_pct=400.0,
            net_rx_bps=n / 2,
            net_tx_bps=n / 2,
            read_iops=io,
            write_iops=0.0,
            disk_read_bps=0.0,
            disk_write_bps=0.0,
        )
        for i, (u, n, io) in enumerate(zip(gpu, nets, iopss, strict=True))
    ]


def seeded(seed: int) -> random.Random:
    # Seeded so every run sees the same series; nothing here needs unpredictability.
    return random.Random(seed)  # noqa: S311


def noisy(level: float, seconds: int, rng: random.Random, spread: float = 3.0) -> list[float]:
    return [min(100.0, max(0.0, level + rng.uniform(-spread, spread))) for _ in range(seconds)]


def alternating(
    busy_s: int, dip_s: int, total_s: int, *, seed: int = 1, jitter_every: int = 0
) -> tuple[list[float], list[bool]]:
    """Busy phases at ~95 % and dips at ~5 %; every `jitter_every`-th busy phase runs one
    second long. Returns the utilisation and, per second, whether it is in a dip."""
    rng = seeded(seed)
    gpu: list[float] = []
    in_dip: list[bool] = []
    cycle = 0
    while len(gpu) < total_s:
        cycle += 1
        busy = busy_s + (1 if jitter_every and cycle % jitter_every == 0 else 0)
        gpu += noisy(95, busy, rng)
        gpu += noisy(5, dip_s, rng)
        in_dip += [False] * busy + [True] * dip_s
    return gpu[:total_s], in_dip[:total_s]


def kinds(findings) -> list[str]:
    return [f.kind for f in findings]


def test_empty_input_says_nothing():
    assert diagnose([], cpu_cores=8) == []


def test_too_short_a_run_says_nothing():
    assert diagnose(points([5.0] * 15), cpu_cores=8) == []


def test_cpu_only_job_says_nothing():
    assert diagnose(points([0.0] * 120, gpus=0), cpu_cores=8) == []


def test_healthy_job_has_no_findings():
    rng = seeded(7)
    assert diagnose(points(noisy(95, 600, rng), iops=300.0), cpu_cores=8) == []


def test_busy_gpus_with_flat_iops_is_no_iops_ceiling():
    rng = seeded(7)
    assert diagnose(points(noisy(95, 300, rng), iops=4800.0), cpu_cores=8) == []


def test_mostly_idle_gpus_give_an_idle_warning_with_the_share_and_range():
    rng = seeded(3)
    gpu = noisy(20, 180, rng) + noisy(95, 120, rng)

    [finding] = diagnose(points(gpu), cpu_cores=8)

    assert finding.kind == "idle"
    assert finding.severity == "warning"
    assert "idle 60 % of the time (below 70 % utilisation)" in finding.text
    assert "between 10:00:00 and 10:04:59 UTC" in finding.text
    assert (finding.start, finding.end) == (T0, T0 + timedelta(seconds=299))


def test_three_busy_two_dip_seconds_is_a_dataloader_bottleneck_every_five_seconds():
    gpu, in_dip = alternating(3, 2, 120, jitter_every=7)
    # The series ends inside a dip; that one has no busy phase after it, so is not counted.
    last_dip_end = max(i for i in range(119) if in_dip[i] and not in_dip[i + 1])
    assert last_dip_end == 117

    [finding] = diagnose(points(gpu), cpu_cores=8)

    assert finding.kind == "dataloader"
    assert abs(finding.period_s - 5.0) <= 0.5
    assert "every ~5 s (dips of ~2 s)" in finding.text
    assert "num_workers toward 2 x CPU cores = 16" in finding.text
    assert "between 10:00:03 and 10:01:57 UTC" in finding.text
    assert (finding.start, finding.end) == (T0 + timedelta(seconds=3), T0 + timedelta(seconds=117))


def test_dataloader_dips_survive_missing_samples():
    gpu, _ = alternating(3, 2, 180, seed=5, jitter_every=4)
    series = points(gpu)
    for lost in (17, 61, 62, 140):
        series[lost] = None
    findings = diagnose([p for p in series if p], cpu_cores=4)

    assert kinds(findings) == ["dataloader"]
    assert abs(findings[0].period_s - 5.0) <= 0.5
    assert "2 x CPU cores = 8" in findings[0].text


def test_random_flicker_below_the_threshold_is_not_periodic():
    # Each second busy or not by a coin weighted 70/30: many dips, but no cycle.
    rng = seeded(11)
    gpu = [95.0 if rng.random() < 0.7 else 5.0 for _ in range(600)]
    assert "dataloader" not in kinds(diagnose(points(gpu), cpu_cores=8))


def test_a_single_long_dip_is_not_a_dataloader_bottleneck():
    rng = seeded(2)
    gpu = noisy(95, 100, rng) + noisy(5, 40, rng) + noisy(95, 100, rng)
    assert diagnose(points(gpu), cpu_cores=8) == []


def test_same_dips_with_network_traffic_are_communication_not_dataloader():
    gpu, in_dip = alternating(3, 2, 120, jitter_every=7)
    net = [120 * MB if dip else 2 * MB for dip in in_dip]

    findings = diagnose(points(gpu, net=net), cpu_cores=8)

    assert kinds(findings) == ["communication"]
    assert "network traffic during the gaps (~120 MB/s" in findings[0].text
    assert "communication-bound" in findings[0].text


def test_long_gaps_after_compute_bursts_with_network_are_communication_bound():
    gpu, in_dip = alternating(8, 4, 240, seed=9)
    net = [120 * MB if dip else 0.5 * MB for dip in in_dip]

    findings = diagnose(points(gpu, net=net), cpu_cores=8)

    assert kinds(findings) == ["communication"]
    [finding] = findings
    assert finding.severity == "warning"
    assert "~120 MB/s" in finding.text
    assert "compress gradients (fp16)" in finding.text
    assert finding.start == T0 + timedelta(seconds=8)


def test_iops_pinned_at_a_ceiling_while_gpus_wait():
    rng = seeded(4)
    iops = [4800 * rng.uniform(0.985, 1.01) for _ in range(120)]

    findings = diagnose(points(noisy(30, 120, rng), iops=iops), cpu_cores=8)

    # The ceiling carries the advice; the idleness it causes comes after as context.
    assert kinds(findings) == ["iops_ceiling", "idle"]
    ceiling, idle = findings
    assert ceiling.severity == "warning" and idle.severity == "info"
    assert "Storage IOPS held at ~4,800 (a ceiling)" in ceiling.text
    assert "practice: 5,000 IOPS" in ceiling.text
    assert "between 10:00:00 and 10:01:59 UTC" in ceiling.text


def test_low_flat_iops_is_no_ceiling():
    rng = seeded(4)
    findings = diagnose(points(noisy(30, 120, rng), iops=50.0), cpu_cores=8)
    assert kinds(findings) == ["idle"]


def test_two_nodes_aggregate_over_all_gpus_and_sum_iops():
    # Per node mean would be (90 + 60) / 2 = 75, above the threshold; over all eight GPUs
    # it is (2 * 90 + 6 * 60) / 8 = 67.5, below it.
    busy = points([90.0] * 120, node=0, gpus=2, iops=2400.0)
    waiting = points([60.0] * 120, node=1, gpus=6, iops=2400.0)
    series = [p for pair in zip(busy, waiting, strict=True) for p in pair]

    findings = diagnose(series, cpu_cores=8)

    assert kinds(findings) == ["iops_ceiling", "idle"]
    assert "~4,800" in findings[0].text
    assert "idle 100 % of the time" in findings[1].text


def test_a_resent_sample_is_not_counted_twice():
    series = points([30.0] * 60, iops=2400.0)
    findings = diagnose(series + series, cpu_cores=8)
    assert "Storage IOPS held at ~2,400" in findings[0].text

"""Plain-words diagnosis of a job's per-second monitoring samples.

Pure Python on purpose (Django's gettext aside: a finding reads in the language active
when it is made): the job page, an API or a test can call it on any list of samples
without a database, and every rule and threshold can be read in this one file. A caller
that has already summed the nodes up per second (the job page, in SQL) hands those seconds
to `diagnose_seconds` instead.
"""

import itertools
import math
from bisect import bisect_left, bisect_right
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from statistics import median
from typing import NamedTuple

from django.utils import timezone
from django.utils.translation import gettext as _
from django.utils.translation import ngettext

MIN_GPU_SECONDS = 20  # under this a pattern cannot be told from noise
MAX_GAP_S = 10  # samples further apart start a new stretch (agent restart, lost node)
_MAX_GAP = timedelta(seconds=MAX_GAP_S)
IDLE_SHARE = 0.5
MIN_DIPS = 3
MIN_DIP_COST = 0.10  # dips costing less GPU time than this where they occur are not worth a word
MIN_PERIOD_S = 2.0
REGULAR_MAD = 0.25  # spread of dip spacings allowed, as a share of the period ...
REGULAR_MAD_FLOOR_S = 1.0  # ... but never under 1 s, so 1-second sampling jitter passes
# Memoryless on/off flicker can have tidy-looking spacings too; a real cycle also makes the
# utilisation correlate with itself one period later (flicker: ~0, jittered cycles: > 0.7).
REGULAR_AUTOCORR = 0.4
NET_RATIO = 3.0
NET_FLOOR_BPS = 1e6
IOPS_FLOOR = 100.0
IOPS_BAND = 0.95
IOPS_HOLD_S = 5  # the ceiling is the highest level held this long, so a burst is not it
IOPS_MIN_STRETCH_S = 30


@dataclass(frozen=True)
class Point:
    at: datetime
    node: int
    gpu_util: tuple[float, ...]
    cpu_pct: float
    net_rx_bps: float
    net_tx_bps: float
    read_iops: float
    write_iops: float
    disk_read_bps: float
    disk_write_bps: float


@dataclass(frozen=True)
class Finding:
    kind: str  # "idle", "dataloader", "communication", "iops_ceiling"
    title: str
    text: str
    start: datetime
    end: datetime
    severity: str  # "warning" or "info"
    period_s: float | None = None


class Seconds(NamedTuple):
    """The job's seconds, in time order, one per second, as columns: tens of thousands of
    seconds are plain numbers in four lists (which the cyclic garbage collector does not
    walk), not an object each."""

    at: list[int]  # microseconds since the epoch, UTC
    gpu: list[float | None]  # mean over every GPU of every node; None when no node reported one
    net_bps: list[float]  # every node's receive + transmit
    iops: list[float]  # every node's reads + writes
    naive: bool = False  # the samples' times had no zone: the findings' times have none either

    def time(self, us: int) -> datetime:
        """`at`'s microseconds as the datetime a finding shows."""
        if self.naive:
            return _NAIVE_EPOCH + timedelta(microseconds=us)
        return _EPOCH + timedelta(microseconds=us)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_NAIVE_EPOCH = datetime(1970, 1, 1)  # noqa: DTZ001 (naive samples: naive findings)
_MAX_GAP_US = MAX_GAP_S * 1_000_000
_US = timedelta(microseconds=1)

Run = tuple[int, int]  # seconds [start, stop) by index into the columns


def diagnose(
    points: Iterable[Point],
    *,
    cpu_cores: int,
    gpu_threshold: float = 70.0,
    iops_reference: float = 5000.0,
) -> list[Finding]:
    """Findings about a job's run, warnings first, each in time order."""
    return diagnose_seconds(
        _per_second(points),
        cpu_cores=cpu_cores,
        gpu_threshold=gpu_threshold,
        iops_reference=iops_reference,
    )


def diagnose_seconds(
    seconds: Seconds,
    *,
    cpu_cores: int,
    gpu_threshold: float = 70.0,
    iops_reference: float = 5000.0,
) -> list[Finding]:
    """`diagnose`, from the job's seconds (`Seconds`: in time order, one per second)."""
    if None in seconds.gpu:
        kept = [i for i, u in enumerate(seconds.gpu) if u is not None]
        seconds = Seconds(
            *([column[i] for i in kept] for column in seconds[:4]), naive=seconds.naive
        )
    if len(seconds.at) < MIN_GPU_SECONDS:
        return []
    stretches = _stretches(seconds.at)
    causes = [
        f
        for f in (
            _dips_finding(seconds, stretches, gpu_threshold, cpu_cores),
            _iops_finding(seconds, stretches, gpu_threshold, iops_reference),
        )
        if f is not None
    ]
    # When a cause explains the idle time, it carries the advice; idleness is then context.
    idle = _idle_finding(seconds, gpu_threshold, "info" if causes else "warning")
    findings = causes + ([idle] if idle else [])
    return sorted(findings, key=lambda f: (f.severity != "warning", f.start))


def verdict(series: list[dict], *, step_s: int = 0, period_s: int = 1) -> str:
    """What the job page says when no finding was made, from the samples its charts show
    (`monitoring.selectors.as_series`; `step_s` > 0: decimated, `period_s` 60: minute
    rows): a run with fewer than MIN_GPU_SECONDS seconds of GPU samples is too short to
    judge (never "the GPUs were kept busy"), a run without GPU samples has no GPU to judge."""
    if step_s:
        return _("No bottleneck found in this run's samples: the GPUs were kept busy.")
    seconds = period_s * len({s["t"] for s in series if s.get("gpu")})
    if not seconds:
        return _("No GPU samples in this run: there is no GPU use to judge.")
    if seconds < MIN_GPU_SECONDS:
        return _(
            "Too short to judge: %(seconds)s s of samples (the diagnosis needs at least "
            "%(least)s s)."
        ) % {"seconds": seconds, "least": MIN_GPU_SECONDS}
    return _("No bottleneck found in this run's samples: the GPUs were kept busy.")


def _per_second(points: Iterable[Point]) -> Seconds:
    latest: dict[tuple[datetime, int], Point] = {}
    naive = False
    for p in points:
        if p.at.tzinfo:
            at = p.at.astimezone(UTC)
        else:
            at, naive = p.at, True
        latest[(at, p.node)] = p  # a re-sent sample must not count twice
    by_at: dict[datetime, list[Point]] = {}
    for (at, _node), p in latest.items():
        by_at.setdefault(at, []).append(p)
    seconds = Seconds([], [], [], [], naive=naive)
    for at in sorted(by_at):
        group = by_at[at]
        # Over GPUs, not nodes: a node with 8 GPUs weighs four times one with 2.
        utils = [u for p in group for u in p.gpu_util]
        seconds.at.append((at - (_NAIVE_EPOCH if at.tzinfo is None else _EPOCH)) // _US)
        seconds.gpu.append(sum(utils) / len(utils) if utils else None)
        seconds.net_bps.append(sum(p.net_rx_bps + p.net_tx_bps for p in group))
        seconds.iops.append(sum(p.read_iops + p.write_iops for p in group))
    return seconds


def _idle_finding(seconds: Seconds, threshold: float, severity: str) -> Finding | None:
    below = sum(1 for u in seconds.gpu if u < threshold)
    share = below / len(seconds.gpu)
    if share <= IDLE_SHARE:
        return None
    start, end = seconds.time(seconds.at[0]), seconds.time(seconds.at[-1])
    return Finding(
        kind="idle",
        title=_("GPUs idle"),
        text=_(
            "The GPUs were idle %(share)s %% of the time (below %(threshold)s %% "
            "utilisation) between %(start)s and %(end)s %(zone)s: the job pays for GPUs it leaves "
            "waiting. Look for a slow input pipeline, small batches or a CPU-bound step, "
            "or ask for fewer GPUs."
        )
        % {"share": round(share * 100), "threshold": f"{threshold:g}", **_between(start, end)},
        start=start,
        end=end,
        severity=severity,
    )


def _dips_finding(
    seconds: Seconds, stretches: list[Run], threshold: float, cpu_cores: int
) -> Finding | None:
    """Dips between busy phases: communication when they carry network traffic, data
    loading when they are merely regular. One pattern gets one finding, never both."""
    at, gpu, net = seconds.at, seconds.gpu, seconds.net_bps
    dips, spacings = _dips(seconds, stretches, threshold)
    if len(dips) < MIN_DIPS:
        return None
    first, last = at[dips[0][0]], at[dips[-1][1] - 1]
    # The seconds from the first dip's start to the last one's end (`at` is sorted).
    lo, hi = bisect_left(at, first), bisect_right(at, last)
    if sum(b - a for a, b in dips) / (hi - lo) < MIN_DIP_COST:
        return None
    start, end = seconds.time(first), seconds.time(last)
    period = median(spacings) if spacings else None
    dip_s = median(_span_s(at, d) for d in dips)
    dip_net = median(net[i] for a, b in dips for i in range(a, b))
    busy_net = median(v for u, v in zip(gpu, net, strict=True) if u >= threshold)
    if dip_net >= NET_FLOOR_BPS and dip_net >= NET_RATIO * busy_net:
        return Finding(
            kind="communication",
            title=_("Communication-bound"),
            text=ngettext(
                "The GPUs had %(count)d long idle gap (~%(gap)s s) after bursts of compute "
                "between %(start)s and %(end)s %(zone)s, with network traffic during the gap "
                "(~%(gap_mb_s)s MB/s, against ~%(busy_mb_s)s MB/s while computing): "
                "communication-bound: increase the batch size or compress gradients (fp16).",
                "The GPUs had %(count)d long idle gaps (~%(gap)s s each) after bursts of "
                "compute between %(start)s and %(end)s %(zone)s, with network traffic during the "
                "gaps (~%(gap_mb_s)s MB/s, against ~%(busy_mb_s)s MB/s while computing): "
                "communication-bound: increase the batch size or compress gradients (fp16).",
                len(dips),
            )
            % {
                "count": len(dips),
                "gap": _seconds(dip_s),
                "gap_mb_s": _mb_s(dip_net),
                "busy_mb_s": _mb_s(busy_net),
                **_between(start, end),
            },
            start=start,
            end=end,
            severity="warning",
            period_s=period,
        )
    if period is None or period < MIN_PERIOD_S or len(spacings) < MIN_DIPS - 1:
        return None
    spread = median(abs(x - period) for x in spacings)
    if spread > max(REGULAR_MAD * period, REGULAR_MAD_FLOOR_S):
        return None
    by_at = dict(zip(at[lo:hi], gpu[lo:hi], strict=True))
    lags = range(max(1, round(period) - 1), round(period) + 2)  # +-1 s for jitter, 4.5 s periods
    if max(_autocorrelation(by_at, lag) for lag in lags) < REGULAR_AUTOCORR:
        return None
    return Finding(
        kind="dataloader",
        title=_("Data-loading bottleneck"),
        text=_(
            "Periodic dips in GPU utilisation every ~%(period)s s (dips of ~%(dip)s s) "
            "between %(start)s and %(end)s %(zone)s: a data-loading bottleneck: raise DataLoader "
            "num_workers toward 2 x CPU cores = %(workers)s, or move the data to faster "
            "storage."
        )
        % {
            "period": _seconds(period),
            "dip": _seconds(dip_s),
            "workers": 2 * cpu_cores,
            **_between(start, end),
        },
        start=start,
        end=end,
        severity="warning",
        period_s=period,
    )


def _dips(
    seconds: Seconds, stretches: list[Run], threshold: float
) -> tuple[list[Run], list[float]]:
    """Runs below the threshold with a busy run on each side, and the spacings between
    consecutive dip starts. Spacings never span a gap in the samples."""
    at, gpu = seconds.at, seconds.gpu
    dips: list[Run] = []
    spacings: list[float] = []
    for lo, hi in stretches:
        # Where busy turns idle or back: the runs' bounds.
        cuts = [i for i in range(lo + 1, hi) if (gpu[i] >= threshold) != (gpu[i - 1] >= threshold)]
        bounds = [lo, *cuts, hi]
        runs = list(itertools.pairwise(bounds))
        # A low run at either end is start-up or shutdown, not a dip.
        inner = [run for run in runs[1:-1] if gpu[run[0]] < threshold]
        spacings += [(at[b[0]] - at[a[0]]) / 1_000_000 for a, b in itertools.pairwise(inner)]
        dips += inner
    return dips, spacings


def _autocorrelation(by_at: dict[int, float], lag: int) -> float:
    """Pearson correlation of utilisation with itself `lag` seconds later; by timestamp,
    so missing samples drop pairs instead of shifting the series."""
    step = lag * 1_000_000
    pairs = [(u, by_at[at + step]) for at, u in by_at.items() if at + step in by_at]
    if len(pairs) < 2:
        return 0.0
    mean_x = sum(x for x, _ in pairs) / len(pairs)
    mean_y = sum(y for _, y in pairs) / len(pairs)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in pairs)
    var_x = sum((x - mean_x) ** 2 for x, _ in pairs)
    var_y = sum((y - mean_y) ** 2 for _, y in pairs)
    return cov / math.sqrt(var_x * var_y) if var_x and var_y else 0.0


def _iops_finding(
    seconds: Seconds, stretches: list[Run], threshold: float, reference: float
) -> Finding | None:
    at, gpu, iops = seconds.at, seconds.gpu, seconds.iops
    hold = min(IOPS_HOLD_S, len(iops))
    # The lowest of each `hold` seconds in a row (zip: the windows, without a slice each).
    ceiling = max(map(min, zip(*(iops[k:] for k in range(hold)), strict=False)))
    if ceiling < IOPS_FLOOR:
        return None
    run_s = _span_s(at, (0, len(at)))
    band = IOPS_BAND * ceiling
    pinned: list[Run] = []
    for lo, hi in stretches:
        i = lo
        while i < hi:
            if iops[i] >= band:
                j = i + 1
                while j < hi and iops[j] >= band:
                    j += 1
                pinned.append((i, j))
                i = j
            i += 1
    candidates = [
        p
        for p in pinned
        if (_span_s(at, p) >= IOPS_MIN_STRETCH_S or _span_s(at, p) >= 0.5 * run_s)
        # Mean, not every second: a loader stalled on storage still shows busy bursts.
        and sum(gpu[p[0] : p[1]]) / (p[1] - p[0]) < threshold
    ]
    if not candidates:
        return None
    stretch = max(candidates, key=lambda p: _span_s(at, p))
    start, end = seconds.time(at[stretch[0]]), seconds.time(at[stretch[1] - 1])
    return Finding(
        kind="iops_ceiling",
        title=_("Storage IOPS at a ceiling"),
        text=_(
            "Storage IOPS held at ~%(ceiling)s (a ceiling) between %(start)s and %(end)s %(zone)s "
            "while the GPUs waited: the volume is the bottleneck (practice: %(reference)s "
            "IOPS for a training data volume) — use faster storage or larger files / "
            "sequential reads."
        )
        % {"ceiling": _about(ceiling), "reference": f"{reference:,.0f}", **_between(start, end)},
        start=start,
        end=end,
        severity="warning",
    )


def _stretches(at: list[int]) -> list[Run]:
    """Split at gaps longer than MAX_GAP_S; shorter gaps are bridged."""
    cuts = [i for i in range(1, len(at)) if at[i] - at[i - 1] > _MAX_GAP_US]
    return list(itertools.pairwise([0, *cuts, len(at)])) if at else []


def _span_s(at: list[int], run: Run) -> float:
    return (at[run[1] - 1] - at[run[0]]) / 1_000_000 + 1


def _between(start: datetime, end: datetime) -> dict[str, str]:
    """The `start`, `end` and `zone` of a finding's sentence ("between %(start)s and %(end)s
    %(zone)s"), in the reader's time zone: times of day, or dates and times when the range
    spans days."""
    start, end = (
        timezone.localtime(t if t.tzinfo else t.replace(tzinfo=UTC)) for t in (start, end)
    )
    fmt = "%H:%M:%S" if start.date() == end.date() else "%Y-%m-%d %H:%M:%S"
    return {"start": start.strftime(fmt), "end": end.strftime(fmt), "zone": start.tzname()}


def _seconds(value: float) -> str:
    rounded = round(value, 1)
    return f"{rounded:,.0f}" if rounded == int(rounded) else f"{rounded:,.1f}"


def _mb_s(bps: float) -> str:
    return _about(bps / 1e6)


def _about(value: float) -> str:
    """Two significant figures with thousands separators: 4,812 -> "4,800"."""
    if value == 0:
        return "0"
    decimals = 1 - math.floor(math.log10(abs(value)))
    rounded = round(value, decimals)
    return f"{rounded:,.{decimals}f}" if decimals > 0 else f"{round(rounded):,}"

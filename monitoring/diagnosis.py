"""Plain-words diagnosis of a job's per-second monitoring samples.

Pure Python on purpose (Django's gettext aside: a finding reads in the language active
when it is made): the job page, an API or a test can call it on any list of samples
without a database, and every rule and threshold can be read in this one file. A caller
that has already summed the nodes up per second (the job page, in SQL) hands those seconds
to `diagnose_seconds` instead.
"""

import itertools
import math
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


class Second(NamedTuple):
    """One second of the whole job (a tuple: tens of thousands are made at once)."""

    at: datetime
    gpu: float | None  # mean over every GPU of every node; None when no node reported one
    net_bps: float  # every node's receive + transmit
    iops: float  # every node's reads + writes


_Second = Second


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
    seconds: Iterable[Second],
    *,
    cpu_cores: int,
    gpu_threshold: float = 70.0,
    iops_reference: float = 5000.0,
) -> list[Finding]:
    """`diagnose`, from the job's seconds (in time order, one per second)."""
    seconds = [s for s in seconds if s.gpu is not None]
    if len(seconds) < MIN_GPU_SECONDS:
        return []
    causes = [
        f
        for f in (
            _dips_finding(seconds, gpu_threshold, cpu_cores),
            _iops_finding(seconds, gpu_threshold, iops_reference),
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


def _per_second(points: Iterable[Point]) -> list[_Second]:
    latest: dict[tuple[datetime, int], Point] = {}
    for p in points:
        at = p.at.astimezone(UTC) if p.at.tzinfo else p.at
        latest[(at, p.node)] = p  # a re-sent sample must not count twice
    by_at: dict[datetime, list[Point]] = {}
    for (at, _node), p in latest.items():
        by_at.setdefault(at, []).append(p)
    seconds = []
    for at in sorted(by_at):
        group = by_at[at]
        # Over GPUs, not nodes: a node with 8 GPUs weighs four times one with 2.
        utils = [u for p in group for u in p.gpu_util]
        seconds.append(
            _Second(
                at=at,
                gpu=sum(utils) / len(utils) if utils else None,
                net_bps=sum(p.net_rx_bps + p.net_tx_bps for p in group),
                iops=sum(p.read_iops + p.write_iops for p in group),
            )
        )
    return seconds


def _idle_finding(seconds: list[_Second], threshold: float, severity: str) -> Finding | None:
    below = sum(1 for s in seconds if s.gpu < threshold)
    share = below / len(seconds)
    if share <= IDLE_SHARE:
        return None
    start, end = seconds[0].at, seconds[-1].at
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


def _dips_finding(seconds: list[_Second], threshold: float, cpu_cores: int) -> Finding | None:
    """Dips between busy phases: communication when they carry network traffic, data
    loading when they are merely regular. One pattern gets one finding, never both."""
    dips, spacings = _dips(seconds, threshold)
    if len(dips) < MIN_DIPS:
        return None
    start, end = dips[0][0].at, dips[-1][-1].at
    covered = sum(1 for s in seconds if start <= s.at <= end)
    if sum(len(d) for d in dips) / covered < MIN_DIP_COST:
        return None
    period = median(spacings) if spacings else None
    dip_s = median(_span_s(d) for d in dips)
    dip_net = median(s.net_bps for d in dips for s in d)
    busy_net = median(s.net_bps for s in seconds if s.gpu >= threshold)
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
    window = [s for s in seconds if start <= s.at <= end]
    lags = range(max(1, round(period) - 1), round(period) + 2)  # +-1 s for jitter, 4.5 s periods
    if max(_autocorrelation(window, lag) for lag in lags) < REGULAR_AUTOCORR:
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


def _dips(seconds: list[_Second], threshold: float) -> tuple[list[list[_Second]], list[float]]:
    """Runs below the threshold with a busy run on each side, and the spacings between
    consecutive dip starts. Spacings never span a gap in the samples."""
    dips: list[list[_Second]] = []
    spacings: list[float] = []
    for stretch in _stretches(seconds):
        runs: list[tuple[bool, list[_Second]]] = []
        for s in stretch:
            busy = s.gpu >= threshold
            if runs and runs[-1][0] == busy:
                runs[-1][1].append(s)
            else:
                runs.append((busy, [s]))
        # A low run at either end is start-up or shutdown, not a dip.
        inner = [run for busy, run in runs[1:-1] if not busy]
        spacings += [(b[0].at - a[0].at).total_seconds() for a, b in itertools.pairwise(inner)]
        dips += inner
    return dips, spacings


def _autocorrelation(seconds: list[_Second], lag: int) -> float:
    """Pearson correlation of utilisation with itself `lag` seconds later; by timestamp,
    so missing samples drop pairs instead of shifting the series."""
    by_at = {s.at: s.gpu for s in seconds}
    step = timedelta(seconds=lag)
    pairs = [(u, by_at[at + step]) for at, u in by_at.items() if at + step in by_at]
    if len(pairs) < 2:
        return 0.0
    mean_x = sum(x for x, _ in pairs) / len(pairs)
    mean_y = sum(y for _, y in pairs) / len(pairs)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in pairs)
    var_x = sum((x - mean_x) ** 2 for x, _ in pairs)
    var_y = sum((y - mean_y) ** 2 for _, y in pairs)
    return cov / math.sqrt(var_x * var_y) if var_x and var_y else 0.0


def _iops_finding(seconds: list[_Second], threshold: float, reference: float) -> Finding | None:
    hold = min(IOPS_HOLD_S, len(seconds))
    iops = [s.iops for s in seconds]
    # The lowest of each `hold` seconds in a row (zip: the windows, without a slice each).
    ceiling = max(map(min, zip(*(iops[k:] for k in range(hold)), strict=False)))
    if ceiling < IOPS_FLOOR:
        return None
    run_s = _span_s(seconds)
    pinned: list[list[_Second]] = []
    for stretch in _stretches(seconds):
        previous_pinned = False
        for s in stretch:
            now_pinned = s.iops >= IOPS_BAND * ceiling
            if now_pinned and previous_pinned:
                pinned[-1].append(s)
            elif now_pinned:
                pinned.append([s])
            previous_pinned = now_pinned
    candidates = [
        p
        for p in pinned
        if (_span_s(p) >= IOPS_MIN_STRETCH_S or _span_s(p) >= 0.5 * run_s)
        # Mean, not every second: a loader stalled on storage still shows busy bursts.
        and sum(s.gpu for s in p) / len(p) < threshold
    ]
    if not candidates:
        return None
    stretch = max(candidates, key=_span_s)
    start, end = stretch[0].at, stretch[-1].at
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


def _stretches(seconds: list[_Second]) -> list[list[_Second]]:
    """Split at gaps longer than MAX_GAP_S; shorter gaps are bridged."""
    stretches: list[list[_Second]] = []
    for s in seconds:
        if stretches and s.at - stretches[-1][-1].at <= _MAX_GAP:
            stretches[-1].append(s)
        else:
            stretches.append([s])
    return stretches


def _span_s(run: list[_Second]) -> float:
    return (run[-1].at - run[0].at).total_seconds() + 1


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

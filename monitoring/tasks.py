"""RQ cron: roll finished minutes of samples up into one row per node per minute, and prune
what is older than its retention (raw: SUANLI_METRICS_RAW_HOURS, rollups:
SUANLI_METRICS_ROLLUP_DAYS)."""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Max, Min
from django.utils import timezone

from monitoring import energy, profiles
from monitoring.models import Rollup, Sample

log = logging.getLogger(__name__)

MINUTE = timedelta(minutes=1)
AVERAGED = (
    "cpu_pct", "mem_bytes", "net_rx_bps", "net_tx_bps", "disk_read_bps", "disk_write_bps",
    "read_iops", "write_iops",
)  # fmt: skip


def _minute(when: datetime) -> datetime:
    return when.replace(second=0, microsecond=0)


def _mean_lists(lists: list[list[float]]) -> list[float]:
    width = max((len(x) for x in lists), default=0)
    return [
        round(
            sum(x[i] for x in lists if i < len(x)) / max(1, sum(1 for x in lists if i < len(x))), 1
        )
        for i in range(width)
    ]


def _mean_readings(lists: list[list[float | None]]) -> list[float | None]:
    """Per GPU, the mean of the seconds that had a reading (None and a missing place are
    none: never 0); [] when no second had any (an emulated host's power)."""
    width = max((len(x) for x in lists), default=0)
    out: list[float | None] = []
    for i in range(width):
        read = [x[i] for x in lists if i < len(x) and x[i] is not None]
        out.append(round(sum(read) / len(read), 1) if read else None)
    return out if any(w is not None for w in out) else []


def rollup(now: datetime | None = None, *, max_minutes: int = 60) -> int:
    """Roll up the finished minutes after the newest rollup (at most `max_minutes` a run).
    Safe to repeat: a minute already rolled up is skipped by the unique constraint."""
    now = now or timezone.now()
    end = _minute(now)  # minutes before this one are finished
    newest = Rollup.objects.aggregate(m=Max("at"))["m"]
    start = newest + MINUTE if newest else Sample.objects.aggregate(m=Min("at"))["m"]
    if start is None:
        return 0
    start = _minute(start)
    stop = min(end, start + max_minutes * MINUTE)
    if stop <= start:
        return 0
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for row in Sample.objects.filter(at__gte=start, at__lt=stop).values(
        "at", "cluster_id", "job_id", "host_id", "node_index", "gpu_util", "gpu_mem_mib",
        "gpu_power_w", "gpu_source", *AVERAGED,
    ).iterator(chunk_size=5000):  # fmt: skip
        groups[(_minute(row["at"]), row["cluster_id"], row["node_index"])].append(row)
    rollups = []
    for (minute, cluster_id, node_index), rows in groups.items():
        n = len(rows)
        means = {f: sum(r[f] for r in rows) / n for f in AVERAGED}
        means["mem_bytes"] = int(means["mem_bytes"])
        rollups.append(
            Rollup(
                at=minute, cluster_id=cluster_id, node_index=node_index, samples=n,
                job_id=rows[-1]["job_id"], host_id=rows[-1]["host_id"],
                gpu_source=rows[-1]["gpu_source"],
                gpu_util=_mean_lists([r["gpu_util"] for r in rows]),
                gpu_mem_mib=_mean_lists([r["gpu_mem_mib"] for r in rows]),
                gpu_power_w=_mean_readings([r["gpu_power_w"] or [] for r in rows]),
                **means,
            )
        )  # fmt: skip
    Rollup.objects.bulk_create(rollups, ignore_conflicts=True, batch_size=2000)
    return len(rollups)


def prune(now: datetime | None = None) -> tuple[int, int]:
    now = now or timezone.now()
    raw, _ = Sample.objects.filter(
        at__lt=now - timedelta(hours=settings.SUANLI_METRICS_RAW_HOURS)
    ).delete()
    minutes, _ = Rollup.objects.filter(
        at__lt=now - timedelta(days=settings.SUANLI_METRICS_ROLLUP_DAYS)
    ).delete()
    return raw, minutes


def rollup_and_prune() -> dict:
    made = rollup()
    raw, minutes = prune()
    if made or raw or minutes:
        log.info("metrics: %d rollups made, %d samples and %d rollups pruned", made, raw, minutes)
    return {"rollups": made, "samples_pruned": raw, "rollups_pruned": minutes}


def profiles_summarise(job_id: int) -> dict:
    """Summarise a job's new or rewritten profiler traces (queued at the job's end and by
    its page when it lists a file without a summary)."""
    return profiles.summarise_job(job_id)


def job_energy(job_id: int) -> float | None:
    """Keep an ended job's GPU energy (joules, None: no power reading) on the job: queued
    by name at its end (jobs.runs.settle.finish)."""
    return energy.store(job_id)

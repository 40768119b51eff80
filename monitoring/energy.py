"""A job's GPU energy from the power its GPUs drew, and the carbon that stands for.

Each sample (`Sample`, one a monitor tick: `SUANLI_MONITOR_INTERVAL`, 1 s) holds its node's
GPUs' power draw in watts (NVML's `nvmlDeviceGetPowerUsage` or dcgm-exporter's
`DCGM_FI_DEV_POWER_USAGE`); its energy is their sum times the tick. Where a minute's samples
were pruned (after `SUANLI_METRICS_RAW_HOURS`), that minute's rollup stands in: the mean
draw of its seconds with a reading times its seconds. A minute is counted once per node:
from its samples, or from its rollup where that holds more seconds and the minute is at
the pruning's edge (a minute pruned part way). A rollup holds all its node's seconds (a
workspace's before the job started too), so a recent minute the job had part of is read
from the job's own samples.

No reading is never 0: an emulated-GPU host (`gpu_source` "derived") and a GPU whose power
could not be read store none, and a job none of whose samples had power has no energy
(`joules` None), said in words (`energy_words`). The carbon estimate is the energy times
the grid intensity the operator set (`SUANLI_GRID_CO2_G_PER_KWH`); with none set there is no
estimate, never a guessed one.

At a job's end `monitoring.tasks.job_energy` (queued by name by jobs.runs.settle.finish)
stores the total as `Job.energy_j`, which stands when its samples and rollups are gone.
Sums are made in PostgreSQL (a long job's samples are never read row by row); other
databases (`make run`'s SQLite) read the rows.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.core.cache import caches
from django.db import connection
from django.db.models import Q
from django.utils import timezone
from django.utils.translation import gettext_noop

from jobs.base.text import Duration, Text
from jobs.models import Job
from monitoring import selectors
from monitoring.models import Rollup, Sample

JOULES_PER_KWH = 3_600_000.0
DERIVED = "derived"  # an emulated-GPU host's samples: no power reading
STORED = "stored"  # only the total kept at the job's end is left
CPU_ONLY = "cpu"  # a cluster without GPUs: no GPU energy to read
LIVE_S = 20  # a running job's energy is at most this old


@dataclass(frozen=True)
class Energy:
    """A job's GPU energy. `joules` None: no power reading (see `source`), never 0."""

    joules: float | None
    kwh: float | None
    co2_g: float | None  # None: no reading, or no grid intensity set (`g_per_kwh` None)
    seconds_read: int | None  # seconds of power readings it is from (None: the stored total)
    source: str  # "nvml", "dcgm", "dcgm+nvml"; "derived", "cpu", "" (no samples); "stored"
    g_per_kwh: float | None = None  # the grid intensity the carbon is at

    def as_dict(self) -> dict:
        """JSON-safe, for the API (English words come from `energy_words`)."""
        return {
            "joules": self.joules,
            "kwh": self.kwh,
            "co2_g": self.co2_g,
            "seconds_read": self.seconds_read,
            "source": self.source,
            "grid_g_per_kwh": self.g_per_kwh,
        }


def grid_intensity() -> float | None:
    """The operator's grid intensity in g CO2/kWh, None when not set."""
    value = getattr(settings, "SUANLI_GRID_CO2_G_PER_KWH", None)
    try:
        value = float(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None
    return value if value is not None and math.isfinite(value) and value > 0 else None


def of_joules(joules: float | None, *, seconds: int | None, source: str) -> Energy:
    grid = grid_intensity()
    if joules is None:
        return Energy(None, None, None, seconds, source, grid)
    kwh = joules / JOULES_PER_KWH
    return Energy(joules, kwh, kwh * grid if grid is not None else None, seconds, source, grid)


def energy_of(job: Job) -> Energy:
    """The job's GPU energy from its samples and rollups; for an ended job whose rows were
    pruned, its stored total (`Job.energy_j`)."""
    joules, seconds, read_sources, all_sources = _measured(job)
    stored = job.energy_j
    if stored is not None and job.is_ended and (joules is None or joules < stored * 0.999):
        return of_joules(stored, seconds=None, source=STORED)
    if joules is not None:
        return of_joules(joules, seconds=seconds, source="+".join(sorted(read_sources)))
    if DERIVED in all_sources:
        source = DERIVED
    elif all_sources:
        source = "+".join(sorted(all_sources))
    else:
        source = ""
    if not job.cluster.gpus_per_node:
        source = CPU_ONLY
    return of_joules(None, seconds=0, source=source)


def _measured(job: Job) -> tuple[float | None, int, set[str], set[str]]:
    """`measure`, kept per process: a finished job's until its samples change (the charts'
    key), a running job's for LIVE_S (its page polls; a day of 4 nodes' samples takes
    ~0.7 s to sum)."""
    if job.is_ended:
        return selectors._kept("energy", job, lambda: measure(job.pk))
    key = f"energy:{job.pk}:{job.attempt}:{job.state}"
    cache = caches["charts"]
    found = cache.get(key)
    if found is None:
        found = measure(job.pk)
        cache.set(key, found, LIVE_S)
    return found


def _width(job_id: int) -> int:
    """How many GPUs a node of the job's cluster has (a row's power list is that long)."""
    gpus = Job.objects.filter(pk=job_id).values_list("cluster__gpus_per_node", flat=True).first()
    return min(max(gpus or 0, 1), 64)


def _edge(now: datetime | None) -> datetime:
    """Minutes before this may have lost samples to pruning (which runs each minute)."""
    now = now or timezone.now()
    return now - timedelta(hours=settings.SUANLI_METRICS_RAW_HOURS) + timedelta(minutes=2)


def measure(
    job_id: int, *, now: datetime | None = None
) -> tuple[float | None, int, set[str], set[str]]:
    """(joules or None, seconds with a power reading, the sources of those readings, the
    sources of all the job's rows)."""
    tick = max(1, int(getattr(settings, "SUANLI_MONITOR_INTERVAL", 1) or 1))
    if connection.vendor == "postgresql":
        width = _width(job_id)
        watt_ticks, reads, read_sources, all_sources = _measure_sql(job_id, _edge(now), width)
    else:
        watt_ticks, reads, read_sources, all_sources = _measure_rows(job_id, _edge(now))
    if not reads:
        return None, 0, set(), all_sources
    return watt_ticks * tick, reads * tick, read_sources, all_sources


def _power_sql(column: str, width: int) -> str:
    """The sum of a row's GPU watts over its first `width` places (the node's GPUs); NULL
    when none has a reading (an empty list, nulls). Each place read by `->>` (a JSON null
    or a missing place is NULL): no set-returning function a row."""
    places = [f"({column}->>{i})::float8" for i in range(width)]
    read = " OR ".join(f"{place} IS NOT NULL" for place in places)
    total = " + ".join(f"coalesce({place}, 0)" for place in places)
    return f"CASE WHEN jsonb_typeof({column}) = 'array' AND ({read}) THEN {total} END"


def _measure_sql(job_id: int, edge: datetime, width: int) -> tuple[float, int, set[str], set[str]]:
    samples, rollups = Sample._meta.db_table, Rollup._meta.db_table
    query = f"""
        WITH s AS (
            SELECT node_index, date_trunc('minute', at) AS m, count(*) AS n,
                   count(p) AS reads, sum(p) AS watts,
                   array_agg(DISTINCT gpu_source) AS sources,
                   array_agg(DISTINCT gpu_source) FILTER (WHERE p IS NOT NULL) AS read_sources
            FROM (SELECT node_index, at, gpu_source, {_power_sql("gpu_power_w", width)} AS p
                  FROM {samples} WHERE job_id = %s) AS x
            GROUP BY node_index, date_trunc('minute', at)
        ), r AS (
            SELECT node_index, at AS m, samples AS n, gpu_source,
                   {_power_sql("gpu_power_w", width)} AS p
            FROM {rollups} WHERE job_id = %s
        ), chosen AS (
            SELECT s.n IS NOT NULL AND (r.n IS NULL OR s.n >= r.n OR s.m >= %s) AS raw,
                   s.reads, s.watts, s.sources, s.read_sources, r.n AS rn, r.p AS rp,
                   r.gpu_source AS rsource
            FROM s FULL OUTER JOIN r ON s.node_index = r.node_index AND s.m = r.m
        )
        SELECT
            coalesce(sum(CASE WHEN raw THEN watts ELSE rp * rn END), 0),
            coalesce(sum(CASE WHEN raw THEN reads WHEN rp IS NOT NULL THEN rn ELSE 0 END), 0),
            array_agg(DISTINCT rsource) FILTER (WHERE NOT raw),
            array_agg(DISTINCT rsource) FILTER (WHERE NOT raw AND rp IS NOT NULL),
            (SELECT array_agg(DISTINCT x) FROM chosen AS c, unnest(c.sources) AS x WHERE c.raw),
            (SELECT array_agg(DISTINCT x) FROM chosen AS c, unnest(c.read_sources) AS x
             WHERE c.raw)
        FROM chosen
    """  # noqa: S608 (table names from the models; the job's id bound)
    with connection.cursor() as cursor:
        cursor.execute(query, [job_id, job_id, edge])
        watts, reads, r_all, r_read, s_all, s_read = cursor.fetchone()
    all_sources = set(r_all or ()) | set(s_all or ())
    read_sources = set(r_read or ()) | set(s_read or ())
    return float(watts or 0.0), int(reads or 0), read_sources, all_sources


def _row_power(value) -> float | None:
    if not isinstance(value, list):
        return None
    read = [float(w) for w in value if isinstance(w, int | float) and not isinstance(w, bool)]
    return sum(read) if read else None


def _measure_rows(job_id: int, edge: datetime) -> tuple[float, int, set[str], set[str]]:
    """The same sums from the rows themselves (databases other than PostgreSQL)."""
    raw: dict[tuple[int, datetime], list] = defaultdict(lambda: [0, 0, 0.0, set(), set()])
    for node, at, power, source in Sample.objects.filter(job_id=job_id).values_list(
        "node_index", "at", "gpu_power_w", "gpu_source"
    ):
        minute = raw[(node, at.replace(second=0, microsecond=0))]
        watts = _row_power(power)
        minute[0] += 1
        minute[3].add(source)
        if watts is not None:
            minute[1] += 1
            minute[2] += watts
            minute[4].add(source)
    rolled = {
        (node, at): (n, _row_power(power), source)
        for node, at, n, power, source in Rollup.objects.filter(job_id=job_id).values_list(
            "node_index", "at", "samples", "gpu_power_w", "gpu_source"
        )
    }
    watt_ticks, reads, read_sources, all_sources = 0.0, 0, set(), set()
    for key in raw.keys() | rolled.keys():
        minute, rollup = raw.get(key), rolled.get(key)
        if minute is not None and (rollup is None or minute[0] >= rollup[0] or key[1] >= edge):
            reads += minute[1]
            watt_ticks += minute[2]
            all_sources |= minute[3]
            read_sources |= minute[4]
            continue
        n, watts, source = rollup
        all_sources.add(source)
        if watts is not None:
            reads += n
            watt_ticks += watts * n
            read_sources.add(source)
    return watt_ticks, reads, read_sources, all_sources


def store(job_id: int) -> float | None:
    """`monitoring.tasks.job_energy`: the job's energy from its rows, kept on the job
    (None when it had no power reading). Repeatable: a later run counts what came since,
    and never lowers a total kept before (its rows may have been pruned since)."""
    joules, _, _, _ = measure(job_id)
    if joules is not None:
        Job.objects.filter(pk=job_id).filter(
            Q(energy_j__isnull=True) | Q(energy_j__lt=joules)
        ).update(energy_j=joules)
    return Job.objects.values_list("energy_j", flat=True).filter(pk=job_id).first()


# ------------------------------------------------------------------------------- words


def significant(value: float, digits: int = 3) -> str:
    """`value` to `digits` significant figures without an exponent ("1.23", "0.0042",
    "4,430"); whole numbers from 10 ** digits on."""
    if value == 0:
        return "0"
    places = digits - 1 - math.floor(math.log10(abs(value)))
    if places <= 0:
        return f"{round(value, places):,.0f}"
    text = f"{value:.{places}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def joules_words(joules: float) -> str:
    """Joules in the nearest SI prefix: "950 J", "15.2 kJ", "4.43 MJ", "1.2 GJ"."""
    for factor, unit in ((1e12, "TJ"), (1e9, "GJ"), (1e6, "MJ"), (1e3, "kJ")):
        if joules >= factor:
            return f"{significant(joules / factor)} {unit}"
    return f"{significant(joules)} J"


def kwh_words(kwh: float) -> str:
    return f"{significant(kwh)} kWh"


def co2_words(grams: float) -> str:
    """ "715 g", "1.23 kg", "4.5 t"."""
    if grams >= 1e6:
        return f"{significant(grams / 1e6)} t"
    if grams >= 1e3:
        return f"{significant(grams / 1e3)} kg"
    return f"{significant(grams)} g"


def energy_words(energy: Energy) -> Text:
    """The sentence for the job page and the API (English by `str`, the reader's language
    by `jobs.base.text.show`)."""
    if energy.joules is None:
        if energy.source == DERIVED:
            return Text(gettext_noop("No power reading on this host (emulated GPUs)"))
        if energy.source == CPU_ONLY:
            return Text(gettext_noop("No GPUs: no GPU energy to read"))
        if energy.source:
            return Text(gettext_noop("No power reading: its hosts' GPUs gave none"))
        return Text(gettext_noop("No power reading yet: no samples of this job"))
    amount = {"kwh": kwh_words(energy.kwh), "joules": joules_words(energy.joules)}
    if energy.seconds_read is None:
        said = Text(gettext_noop("%(kwh)s (%(joules)s) of GPU energy"), **amount)
    else:
        said = Text(
            gettext_noop("%(kwh)s (%(joules)s) of GPU energy over %(span)s of power readings"),
            span=Duration(energy.seconds_read),
            **amount,
        )
    if energy.co2_g is None:
        return Text(
            gettext_noop("%(energy)s; no carbon estimate: the operator has set no grid intensity"),
            energy=said,
        )
    return Text(
        gettext_noop("%(energy)s, about %(co2)s CO2 at %(grid)s g/kWh"),
        energy=said,
        co2=co2_words(energy.co2_g),
        grid=significant(energy.g_per_kwh, 4),
    )

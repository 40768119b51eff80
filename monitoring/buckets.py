"""Many samples summed up in PostgreSQL, so that a long job's page reads a few thousand
rows instead of every second of every node. For a 4-GPU job's 20,000 samples on this
machine (`bench/pages.py`, page "job_first_view"): `min_max` over its 16 series took
150-300 ms as a window over each bucket, about half that as a GROUP BY joined back to
its rows; `per_second` about 70 ms; the page 650 KB, most of it the 2,000 points a series
that the charts embed. `survey`: what `min_max` needs to know first, in one scan.

`min_max`: each node's samples cut into time buckets, each bucket's lowest and highest
value of every series (per GPU for the GPU lists) with the time it occurred, returned as
the two rows `selectors.decimate` would make. `per_second`: the figures the diagnosis
reads, per second over all nodes. Both take a queryset of `Sample` or `Rollup` (its
WHERE clause, bound parameters and all, becomes a subquery) and are PostgreSQL only:
callers fall back to reading rows on other databases. Column names come from the
code here, never from input.
"""

from __future__ import annotations

from datetime import UTC, datetime

from django.core.exceptions import EmptyResultSet
from django.db import connection
from django.db.models import QuerySet

from monitoring.diagnosis import Seconds

SCALARS = (
    "cpu_pct", "mem_bytes", "net_rx_bps", "net_tx_bps", "disk_read_bps", "disk_write_bps",
    "read_iops", "write_iops",
)  # fmt: skip
PER_GPU = ("gpu_util", "gpu_mem_mib")
EPOCH = "date_part('epoch', q.at)"  # float8 seconds (extract(): numeric, far slower)


def _inner(queryset: QuerySet) -> tuple[str, tuple]:
    columns = ("id", "at", "job_id", "node_index", *PER_GPU, *SCALARS)
    return queryset.order_by().values(*columns).query.sql_with_params()


def min_max(
    queryset: QuerySet, *, first: datetime, width: int, gpus: list[int] | None = None
) -> list[dict]:
    """Buckets of `width` seconds from `first`: per node and bucket two rows (one when the
    bucket holds one sample) at its first and last sample's time, holding each series'
    minimum and maximum in the order they occurred. In time order. `gpus`: the longest
    list of each PER_GPU column (`survey`), when the caller has read it."""
    inner, params = _inner(queryset)
    with connection.cursor() as cursor:
        if gpus is None:
            cursor.execute(
                f"SELECT {', '.join(f'max({_length(c)})' for c in PER_GPU)} FROM ({inner}) q",  # noqa: S608 (names from this module; values bound)
                params,
            )
            gpus = [n or 0 for n in cursor.fetchone()]
        series = [(c, f"q.{c}::float8") for c in SCALARS] + [
            ((c, i), f"(q.{c}->>{i})::float8") for c, n in zip(PER_GPU, gpus, strict=True)
            for i in range(n)
        ]  # fmt: skip
        values = ", ".join(f"{expr} AS v{k}" for k, (_, expr) in enumerate(series))
        bounds = ", ".join(f"min(v{k}) AS lo{k}, max(v{k}) AS hi{k}" for k in range(len(series)))
        # Each bucket's lowest and highest (a plain GROUP BY), then the first time each was
        # reached (the rows joined to their bucket's): a window over the bucket instead
        # sorts every row and took twice as long, and min(ARRAY[value, time]) builds two
        # arrays a row and series, four times as long. The time is date_part's float8
        # (extract() is numeric, slow to compute with).
        picks = ", ".join(
            f"min(g.lo{k}), min(s.t) FILTER (WHERE s.v{k} = g.lo{k}), "
            f"min(g.hi{k}), min(s.t) FILTER (WHERE s.v{k} = g.hi{k})"
            for k in range(len(series))
        )
        cursor.execute(
            "WITH s AS MATERIALIZED (SELECT q.node_index, q.job_id, "  # noqa: S608 (as above)
            f"{EPOCH} AS t, floor(({EPOCH} - %s) / %s)::bigint AS b, {values} "
            f"FROM ({inner}) q), g AS (SELECT node_index, b, {bounds} FROM s "
            "GROUP BY node_index, b) "
            f"SELECT s.node_index, min(s.t), max(s.t), count(*), min(s.job_id), {picks} "
            "FROM s JOIN g ON g.node_index = s.node_index AND g.b = s.b "
            "GROUP BY s.node_index, s.b",
            (first.timestamp(), width, *params),
        )
        buckets = cursor.fetchall()
    rows = []
    for node, t_first, t_last, count, job_id, *picked in buckets:
        early = {"at": _at(t_first), "job_id": job_id, "node_index": node}
        late = {"at": _at(t_last), "job_id": job_id, "node_index": node}
        for column, n in zip(PER_GPU, gpus, strict=True):
            early[column], late[column] = [None] * n, [None] * n
        for k, (name, _) in enumerate(series):
            low, low_at, high, high_at = picked[4 * k : 4 * k + 4]
            pair = (low, high) if low is None or low_at <= high_at else (high, low)
            if isinstance(name, tuple):
                early[name[0]][name[1]], late[name[0]][name[1]] = pair
            else:
                early[name], late[name] = pair
        early["mem_bytes"], late["mem_bytes"] = int(early["mem_bytes"]), int(late["mem_bytes"])
        for column in PER_GPU:
            # Tuples of numbers: the garbage collector stops tracking them (2,000 rows a chart).
            early[column], late[column] = tuple(early[column]), tuple(late[column])
        if count == 1:
            rows.append(early)  # its minimum is its maximum
        else:
            rows += [early, late]
    rows.sort(key=lambda r: (r["at"], r["node_index"]))
    return rows


def survey(queryset: QuerySet) -> tuple[list[dict], list[int]]:
    """Per node its samples' count and first and last time (`node_index`, `n`, `first`,
    `last`), and the longest list of each PER_GPU column (`min_max`'s `gpus`): one scan."""
    try:
        inner, params = _inner(queryset)
    except EmptyResultSet:  # `.none()`: a job that has not started
        return [], [0] * len(PER_GPU)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT q.node_index, count(*), min(q.at), max(q.at), "  # noqa: S608 (as above)
            f"{', '.join(f'max({_length(c)})' for c in PER_GPU)} FROM ({inner}) q "
            "GROUP BY q.node_index",
            params,
        )
        found = cursor.fetchall()
    nodes = [{"node_index": r[0], "n": r[1], "first": r[2], "last": r[3]} for r in found]
    gpus = [max((r[4 + k] or 0 for r in found), default=0) for k in range(len(PER_GPU))]
    return nodes, gpus


def _length(column: str) -> str:
    return f"jsonb_array_length(CASE WHEN jsonb_typeof(q.{column}) = 'array' THEN q.{column} ELSE '[]'::jsonb END)"


def per_second(queryset: QuerySet) -> Seconds:
    """What `diagnosis.diagnose` reads of each second, summed over the nodes in the
    database: the mean over every GPU of every node, the nodes' network and IOPS totals,
    in time order, as columns (the times in microseconds since the epoch: no datetime a
    second). A sample stored twice (same second and node) counts once, as `diagnose`
    counts it."""
    inner, params = _inner(queryset)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT max({_length('gpu_util')}) FROM ({inner}) q", params)  # noqa: S608 (names from this module; values bound)
        gpus = cursor.fetchone()[0] or 0
        gpu_sum = " + ".join(
            [f"coalesce((q.gpu_util->>{i})::float8, 0)" for i in range(gpus)] or ["0"]
        )
        # Each (second, node)'s figures made before the sort that keeps its last sample:
        # the sort moves 5 numbers a row, not the whole row.
        cursor.execute(
            f"SELECT ({EPOCH} * 1000000)::int8, sum(q.gpu) / nullif(sum(q.gpus), 0), "  # noqa: S608 (as above)
            "sum(q.net), sum(q.iops) "
            f"FROM (SELECT DISTINCT ON (q.at, q.node_index) q.at, {gpu_sum} AS gpu, "
            f"{_length('gpu_util')} AS gpus, q.net_rx_bps + q.net_tx_bps AS net, "
            f"q.read_iops + q.write_iops AS iops FROM ({inner}) q "
            "ORDER BY q.at, q.node_index, q.id DESC) q GROUP BY q.at ORDER BY q.at",
            params,
        )
        seconds = cursor.fetchall()
    # One list a column (zip(*rows) would make an iterator a row).
    return Seconds(*([row[k] for row in seconds] for k in range(4)))


def _at(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)

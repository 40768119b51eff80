"""Many samples summed up in PostgreSQL, so that a long job's page reads a few thousand
rows instead of every second of every node. For a 4-GPU job's 20,000 samples on this
machine (`bench/pages.py`, page "job"): `min_max` over its 16 series takes 150-200 ms and
`per_second` about 70 ms; the whole page about 0.5 s and 650 KB, most of it the 2,000
points a series that the charts embed.

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

from django.db import connection
from django.db.models import QuerySet

from monitoring.diagnosis import Second

SCALARS = (
    "cpu_pct", "mem_bytes", "net_rx_bps", "net_tx_bps", "disk_read_bps", "disk_write_bps",
    "read_iops", "write_iops",
)  # fmt: skip
PER_GPU = ("gpu_util", "gpu_mem_mib")


def _inner(queryset: QuerySet) -> tuple[str, tuple]:
    columns = ("id", "at", "job_id", "node_index", *PER_GPU, *SCALARS)
    return queryset.order_by().values(*columns).query.sql_with_params()


def min_max(queryset: QuerySet, *, first: datetime, width: int) -> list[dict]:
    """Buckets of `width` seconds from `first`: per node and bucket two rows (one when the
    bucket holds one sample) at its first and last sample's time, holding each series'
    minimum and maximum in the order they occurred. In time order."""
    inner, params = _inner(queryset)
    with connection.cursor() as cursor:
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
        extremes = ", ".join(
            f"min(v{k}) OVER p AS lo{k}, max(v{k}) OVER p AS hi{k}" for k in range(len(series))
        )
        # Plain min/max per bucket (a window over the node's bucket), then the first time
        # each was reached: min(ARRAY[value, time]) says the same but builds 2 arrays a row
        # and series, 4 times slower.
        picks = ", ".join(
            f"min(lo{k}), min(t) FILTER (WHERE v{k} = lo{k}), "
            f"min(hi{k}), min(t) FILTER (WHERE v{k} = hi{k})"
            for k in range(len(series))
        )
        cursor.execute(
            "WITH s AS (SELECT q.node_index, q.job_id, "  # noqa: S608 (as above)
            "extract(epoch FROM q.at)::float8 AS t, "
            f"floor((extract(epoch FROM q.at) - %s) / %s)::bigint AS b, {values} "
            f"FROM ({inner}) q), w AS (SELECT s.*, {extremes} FROM s "
            "WINDOW p AS (PARTITION BY s.node_index, s.b)) "
            f"SELECT node_index, min(t), max(t), count(*), min(job_id), {picks} "
            "FROM w GROUP BY node_index, b",
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
        if count == 1:
            rows.append(early)  # its minimum is its maximum
        else:
            rows += [early, late]
    rows.sort(key=lambda r: (r["at"], r["node_index"]))
    return rows


def _length(column: str) -> str:
    return f"jsonb_array_length(CASE WHEN jsonb_typeof(q.{column}) = 'array' THEN q.{column} ELSE '[]'::jsonb END)"


def per_second(queryset: QuerySet) -> list[Second]:
    """What `diagnosis.diagnose` reads of each second, summed over the nodes in the
    database: the mean over every GPU of every node, the nodes' network and IOPS totals,
    in time order. A sample stored twice (same second and node) counts once, as
    `diagnose` counts it."""
    inner, params = _inner(queryset)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT max({_length('gpu_util')}) FROM ({inner}) q", params)  # noqa: S608 (names from this module; values bound)
        gpus = cursor.fetchone()[0] or 0
        gpu_sum = " + ".join(
            [f"coalesce((q.gpu_util->>{i})::float8, 0)" for i in range(gpus)] or ["0"]
        )
        cursor.execute(
            f"SELECT extract(epoch FROM q.at)::float8, sum({gpu_sum}) / "  # noqa: S608 (as above)
            f"nullif(sum({_length('gpu_util')}), 0), sum(q.net_rx_bps + q.net_tx_bps), "
            "sum(q.read_iops + q.write_iops) FROM (SELECT DISTINCT ON (q.at, q.node_index) "
            f"q.* FROM ({inner}) q ORDER BY q.at, q.node_index, q.id DESC) q "
            "GROUP BY q.at ORDER BY q.at",
            params,
        )
        seconds = cursor.fetchall()
    return [Second(_at(t), gpu, net, iops) for t, gpu, net, iops in seconds]


def _at(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)

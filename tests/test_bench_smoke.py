"""Every bench case runs once at a tiny size (`BENCH_SMOKE=1`, seconds each), the way
`make bench` runs it (`bash bench/run.sh bench/<case>.py`: the suite's services, a
database and a Redis database of the benches' own), and prints its JSON lines with the
figures it names: a bench that a later change broke fails here, not at the next
measurement. The figures themselves are not judged (a tiny run measures nothing), only
what a case must have done for its figure to mean anything (reclaim preempted and the
next pass placed; the burst started every job)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
import redis
from django.conf import settings

ROOT = Path(__file__).resolve().parent.parent

# The Redis database of the benches run here (the numbers are listed once, in .ci/test.sh's
# fast_env: 0 and 1 the suite, 2 and 3 `make test-fast`, 15 `make bench`).
REDIS_DB = 14

# bench file -> the cases it prints ("bench" of a line) -> (lines, the keys each has).
CASES: dict[str, dict[str, tuple[int, set[str]]]] = {
    "bench/placement.py": {
        "placement": (1, {"hosts", "requests", "placed", "placements_per_s", "pgbench_tps",
                          "ratio", "median_ms_per_placement", "p95_ms_per_placement"}),
        "placement_teams": (1, {"hosts", "requests", "teams", "placements_per_s_no_teams",
                                "placements_per_s_teams", "ratio"}),
    },
    "bench/job_start.py": {
        "job_start": (2, {"nodes", "median_s", "p95_s", "bare_docker_run_median_s", "ratio",
                          "bare_same_network_median_s", "ratio_same_network"}),
        "cluster_network": (2, {"driver", "setup_median_s", "setup_p95_s",
                                "bare_bridge_create_median_s", "ratio", "workspaces_median_s"}),
    },
    "bench/jobs_burst.py": {
        "jobs_burst": (1, {"jobs", "workers", "started", "submit_s", "all_started_s",
                           "jobs_per_s", "bare_docker_run_s", "bare_jobs_per_s", "ratio"}),
    },
    "bench/accrual.py": {
        "accrual": (1, {"clusters", "tick_s", "bulk_insert_s", "ratio", "copy_s",
                        "ratio_to_copy", "entries"}),
    },
    "bench/reclaim.py": {
        "reclaim": (2, {"request", "preempted", "hosts_touched", "placed_next_pass", "pass_s",
                        "empty_fleet_pass_s", "ratio"}),
    },
    "bench/monitor.py": {
        "monitor": (2, {"path", "containers", "samples_per_s", "ticks_per_s",
                        "cpu_core_share", "rows_inserted"}),
        "monitor_fanout": (1, {"clients", "connected", "samples", "delay_p50_ms",
                               "delay_p95_ms"}),
    },
    "bench/pages.py": {
        "pages": (None, {"repeat"}),  # a line per page, and the seed's
        "first_visit": (3, {"page", "bytes", "plotly_bytes", "dcl_ms", "load_ms", "before_bytes",
                            "before_plotly_bytes", "before_dcl_ms", "bytes_ratio"}),
    },
    "bench/gateway.py": {
        "gateway_first_byte": (1, {"runs", "ssh_median_s", "docker_exec_median_s", "ratio"}),
        "gateway_sessions": (1, {"sessions", "commands", "missed", "gateway_cpu_cores",
                                 "rtt_median_s", "rtt_p95_s"}),
    },
    "bench/stop_start.py": {
        "cluster_stop_start": (2, {"op", "median_s", "p95_s", "ratio"}),
    },
    "bench/images.py": {
        "image_build_push": (1, {"image_bytes", "median_s", "docker_build_push_median_s",
                                 "ratio"}),
        "image_pull": (1, {"bytes", "docker_bytes", "median_s", "docker_pull_median_s",
                           "ratio"}),
    },
    "bench/log_fanout.py": {
        "log_fanout": (2, {"path", "viewers", "engine_calls_per_s", "lines_per_viewer_per_s",
                           "delay_p50_s", "duplicates", "gaps"}),
    },
    "bench/profile.py": {
        "profile_summary": (3, {"mode", "file_mb", "events", "events_per_s", "seconds",
                                "peak_rss_mb"}),
    },
    "bench/pools.py": {
        "pool_round": (1, {"pools", "round_s", "per_pool_ms", "queries", "share_of_interval"}),
    },
    "bench/storage.py": {
        "storage": (3, {"case", "moosefs_s", "local_disk_s", "moosefs_vs_local"}),
    },
    "bench/join.py": {
        "join": (1, {"case", "join_s", "bare_engine_start_s", "join_vs_bare"}),
    },
}  # fmt: skip


def _benches() -> list[str]:
    """What `make bench` runs (bench/run.sh's own list)."""
    listed = subprocess.run(
        ["bash", "bench/run.sh", "--list"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return listed.stdout.split()


@pytest.fixture(scope="module")
def bench_env():
    """The environment `make bench` gives a bench, on a database of the benches' own made
    fresh for this module (run.sh makes and migrates it) and dropped after, and a Redis
    database of their own, emptied before and after."""
    test_db = settings.DATABASES["default"].get("TEST", {}).get("NAME") or (
        "test_" + settings.DATABASES["default"]["NAME"]
    )
    name = f"{test_db}_bench"
    services_db = os.environ["DATABASE_URL"]

    def drop():
        with psycopg.connect(services_db, autocommit=True) as db:
            db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    queues = redis.Redis.from_url(os.environ["REDIS_URL"].rsplit("/", 1)[0] + f"/{REDIS_DB}")
    drop()
    queues.flushdb()
    env = {
        **os.environ,
        "BENCH_SMOKE": "1",
        "BENCH_DATABASE": name,
        "BENCH_REDIS_DB": str(REDIS_DB),
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    yield env
    queues.flushdb()
    drop()


def test_every_bench_has_its_cases_here():
    """A bench added to `make bench` is smoke-tested too (its cases named above)."""
    assert sorted(_benches()) == sorted(CASES)


# Needs the two engines, the registry and MooseFS, and starts processes of its own.
@pytest.mark.engine
@pytest.mark.procs
@pytest.mark.parametrize("bench", sorted(CASES))
def test_bench_runs_and_prints_its_figures(bench, bench_env):
    run = subprocess.run(
        ["bash", "bench/run.sh", bench],
        cwd=ROOT,
        env=bench_env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    said = f"--- stdout\n{run.stdout[-4000:]}\n--- stderr\n{run.stderr[-4000:]}"
    assert run.returncode == 0, said
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    for case, (count, keys) in CASES[bench].items():
        printed = [line for line in lines if line.get("bench") == case]
        assert printed, f"{bench} printed no {case} line\n{said}"
        if count is not None:
            assert len(printed) == count, said
        for line in printed:
            assert keys <= line.keys() or line.get("case") == "seed", (case, keys - line.keys())
    if bench == "bench/placement.py":  # pgbench's scratch database is dropped after
        with psycopg.connect(os.environ["DATABASE_URL"]) as db:
            scratch = f"{bench_env['BENCH_DATABASE']}_pgbench"
            assert not db.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", [scratch]
            ).fetchone()
    # What the figure is of happened.
    for line in lines:
        if line["bench"] == "reclaim":
            assert line["preempted"] > 0 and line["placed_next_pass"] is True, line
        if line["bench"] == "jobs_burst":
            assert line["started"] == line["jobs"], line

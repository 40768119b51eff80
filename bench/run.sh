#!/usr/bin/env bash
# `make bench`: each bench prints one JSON line per case.
#
#   bash bench/run.sh                      # every bench, at its full size
#   bash bench/run.sh bench/reclaim.py     # one (or several) of them
#   BENCH_SMOKE=1 bash bench/run.sh        # every case once at a tiny size (seconds each)
#
# Runs on the test services (.ci/services.sh): those of the caller's environment when it
# names them (`source .run/test/env.sh` of a checkout whose services run), else this
# checkout's when they answer, else it starts them and stops them after. Its data goes to
# a database of its own (BENCH_DATABASE, default suanli_bench, made and migrated here) and
# a Redis database of its own (BENCH_REDIS_DB, default 15, emptied before each bench), so
# that it disturbs neither the suite's data nor a developer's.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"

BENCHES=(
    bench/placement.py bench/job_start.py bench/jobs_burst.py bench/accrual.py bench/reclaim.py
    bench/monitor.py bench/pages.py bench/gateway.py bench/stop_start.py bench/images.py
    bench/log_fanout.py bench/profile.py bench/pools.py bench/storage.py bench/join.py
)
if [ "${1:-}" = --list ]; then
    printf '%s\n' "${BENCHES[@]}"
    exit 0
fi
[ "$#" -gt 0 ] && BENCHES=("$@")

if [ "${BENCH_SMOKE:-0}" = 1 ]; then
    # Every case once, at a size that takes seconds: that it still runs and prints its
    # figures (tests/test_bench_smoke.py), not a measurement. A size set by the caller wins.
    smoke() { [ -n "${!1:-}" ] || export "$1=$2"; }
    smoke BENCH_REQUESTS 60;   smoke BENCH_HOSTS 20;  smoke BENCH_TEAMS_HOSTS 20  # placement
    smoke BENCH_PGBENCH_S 1;   smoke BENCH_PGBENCH_SCALE 1                   # placement
    smoke BENCH_RUNS 2                                   # job_start, gateway, stop_start
    smoke BENCH_JOBS 4;        smoke BENCH_WORKERS 1                         # jobs_burst
    smoke BENCH_CLUSTERS 40;   smoke BENCH_USERS 8;   smoke BENCH_REPEATS 1  # accrual
    smoke BENCH_RECLAIM_HOSTS 8                                              # reclaim
    smoke BENCH_CONTAINERS 4;  smoke BENCH_TICKS 2;   smoke BENCH_CLIENTS 3  # monitor
    smoke BENCH_FANOUT_S 2;    smoke BENCH_NODES_PER_CLUSTER 2;  smoke BENCH_BASELINE_CALLS 3
    smoke BENCH_LEDGER 2000;   smoke BENCH_SAMPLES 200;  smoke BENCH_REPEAT 1  # pages
    smoke BENCH_FIRST_VISITS 1                                               # pages
    smoke BENCH_SESSIONS 2;    smoke BENCH_SECONDS 1                         # gateway
    smoke BENCH_IMAGE_RUNS 1;  smoke BENCH_PULL_MB 1                         # images
    smoke BENCH_VIEWERS 3;     smoke BENCH_WINDOW_S 1                        # log_fanout
    smoke BENCH_TRACE_EVENTS 2000                                            # profile
    smoke BENCH_POOLS 2                                                      # pools
    smoke BENCH_STORAGE_MIB 4; smoke BENCH_STORAGE_FILES 50                  # storage
fi

# The services answer when PostgreSQL, Redis and every engine do.
answering() {
    [ -n "${DATABASE_URL:-}" ] && [ -n "${REDIS_URL:-}" ] && [ -n "${SUANLI_TEST_ENGINES:-}" ] || return 1
    python - <<'EOF' 2>/dev/null
import os, docker, psycopg, redis
psycopg.connect(os.environ["DATABASE_URL"], connect_timeout=3).close()
redis.Redis.from_url(os.environ["REDIS_URL"], socket_timeout=3).ping()
for url in filter(None, os.environ["SUANLI_TEST_ENGINES"].split(",")):
    docker.DockerClient(base_url=url, timeout=5).ping()
EOF
}

started=0
cleanup() { if [ "$started" = 1 ]; then bash .ci/services.sh stop >&2 || true; fi; }
trap cleanup EXIT
if [ -n "${SUANLI_TEST_ENGINES:-}" ]; then
    answering || { echo "bench: the services of this environment do not answer" >&2; exit 1; }
elif [ -f .run/test/env.sh ] && (source .run/test/env.sh && answering); then
    source .run/test/env.sh
else
    started=1 # a half-finished start is cleaned up too
    env_out="$(bash .ci/services.sh start)"
    eval "$env_out"
fi

export DEBUG=0 SUANLI_HTTPS=0 SECRET_KEY=bench-only ALLOWED_HOSTS=localhost,testserver
# bench/pages renders pages in-process (django.test.Client: host "testserver") without
# collectstatic, so no static manifest (its first visits collect and serve their own).
BENCH_DATABASE="${BENCH_DATABASE:-suanli_bench}"
[[ "$BENCH_DATABASE" =~ ^[a-z_][a-z0-9_]*$ ]] || { echo "bench: BENCH_DATABASE=$BENCH_DATABASE" >&2; exit 2; }
SERVICES_DATABASE_URL="$DATABASE_URL"
export DATABASE_URL="${DATABASE_URL%/*}/$BENCH_DATABASE" LOG_LEVEL=WARNING SUANLI_STATIC_MANIFEST=0
export REDIS_URL="${REDIS_URL%/*}/${BENCH_REDIS_DB:-15}"
python - "$SERVICES_DATABASE_URL" "$BENCH_DATABASE" <<'EOF'
import sys, psycopg
with psycopg.connect(sys.argv[1], autocommit=True) as db:
    if not db.execute("SELECT 1 FROM pg_database WHERE datname = %s", [sys.argv[2]]).fetchone():
        db.execute(f'CREATE DATABASE "{sys.argv[2]}"')
EOF
python manage.py migrate --no-input -v0
for bench in "${BENCHES[@]}"; do
    # Each bench starts with empty queues (what an earlier one queued and no worker ran
    # would otherwise be run by the next one's worker, against rows that are gone).
    python -c 'import os, redis; redis.Redis.from_url(os.environ["REDIS_URL"]).flushdb()'
    python "$bench"
done

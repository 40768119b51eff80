#!/usr/bin/env bash
# `make bench`: each bench prints one JSON line per case. Runs on the PostgreSQL that the
# test services start, in a database of its own.
set -euo pipefail
cd "$(dirname "$0")/.."
started=1
cleanup() { if [ "$started" = 1 ]; then bash .ci/services.sh stop >&2 || true; fi; }
trap cleanup EXIT
env_out="$(bash .ci/services.sh start)"
eval "$env_out"
export PATH="$PWD/.venv/bin:$PATH" DEBUG=0 SUANLI_HTTPS=0 SECRET_KEY=bench-only ALLOWED_HOSTS=localhost,testserver
# bench/pages renders pages in-process (django.test.Client: host "testserver") without
# collectstatic, so no static manifest.
export DATABASE_URL="${DATABASE_URL%/*}/suanli_bench" LOG_LEVEL=WARNING SUANLI_STATIC_MANIFEST=0
PGPASSWORD=suanli psql -h 127.0.0.1 -U suanli -d suanli -tAc "SELECT 1 FROM pg_database WHERE datname='suanli_bench'" | grep -q 1 \
  || PGPASSWORD=suanli psql -h 127.0.0.1 -U suanli -d suanli -qc "CREATE DATABASE suanli_bench"
python manage.py migrate --no-input -v0
for bench in bench/placement.py bench/job_start.py bench/jobs_burst.py bench/accrual.py bench/reclaim.py bench/monitor.py bench/pages.py bench/gateway.py bench/stop_start.py bench/images.py bench/log_fanout.py bench/profile.py bench/pools.py bench/storage.py bench/join.py; do
  python "$bench"
done

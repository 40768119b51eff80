#!/usr/bin/env bash
# The suite, in tiers (tests/conftest.py marks each test with what it needs).
#
#   bash .ci/test.sh              `make test`: the full services, lint, the whole suite (CI):
#                                 the engine tests beside the rest (SUANLI_TEST_SPLIT=0: one pytest)
#   bash .ci/test.sh ARGS...      the full services, lint, `pytest ARGS...` (`make e2e`: -m e2e)
#   TIER=fast bash .ci/test.sh    `make test-fast`: PostgreSQL and Redis only, lint, the tests
#                                 that need no engine, process or browser (two processes, one a
#                                 core); ARGS narrow it (one process)
#   eval "$(bash .ci/test.sh env [fast])"
#                                 the suite's settings for this shell (services not started):
#                                 then `pytest -m db tests/test_x.py -k name` runs as `make` does
#
# Services: what this run started is stopped at its end; what was running is left running.
set -euo pipefail
cd "$(dirname "$0")/.."

TIER="${TIER:-all}"
FAST='not engine and not procs and not browser and not e2e and not alone'
# The full services' settings the fast tier must not see: without them an engine test that
# is not marked as one fails in `make test-fast` instead of quietly using the engines.
NOT_FAST=(SUANLI_TEST_ENGINES SUANLI_TEST_ENGINE_ADDRS SUANLI_TEST_ENGINE_NETNS
    SUANLI_TEST_ENGINE_MNTNS SUANLI_TEST_HOSTS_GATEWAY SUANLI_STORAGE_ROOT SUANLI_STORAGE_FS
    SUANLI_STORAGE_MASTER SUANLI_REGISTRY SUANLI_REGISTRY_USERNAME SUANLI_REGISTRY_PASSWORD
    SUANLI_REGISTRY_CA)

# Production-like settings, but plain HTTP for the live test server.
suite_env() {
    export PATH="$PWD/.venv/bin:$PATH"
    export DEBUG=0 SUANLI_HTTPS=0 SUANLI_STATIC_MANIFEST=0
    export SECRET_KEY="test-only-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    export ALLOWED_HOSTS="localhost,127.0.0.1,testserver" # SUANLI_STORAGE_ROOT: the services' (MooseFS)
    export SUANLI_SCREENSHOTS="$PWD/.run/test/screenshots" SUANLI_TLS_DIR="$PWD/.run/test/tls"
}

# fast_env: `make test-fast`'s own test databases, Redis database numbers and TLS folders
# (its CA), none of them a full run's, so that it runs beside one (`make test`) on the same
# servers. Redis numbers: 0 the suite's engine tests (then its `alone` ones), 1 its fast
# tier, 4 its processes and browser tests with no engine, 2 and 3 `make test-fast`'s two
# processes, 14 the bench smoke tier (tests/test_bench_smoke.py), 15 `make bench`.
fast_env() {
    unset "${NOT_FAST[@]}"
    export SUANLI_TEST_DATABASE=test_suanli_dev_fast REDIS_URL="${REDIS_URL%/*}/2"
    export SUANLI_TLS_DIR="$PWD/.run/test/tls-dev-fast"
}

if [ "${1:-}" = env ]; then
    if [ "${2:-}" = fast ]; then bash .ci/services.sh env db; else bash .ci/services.sh env; fi
    suite_env
    printf 'export PATH=%q DEBUG=0 SUANLI_HTTPS=0 SUANLI_STATIC_MANIFEST=0 SECRET_KEY=%q\n' "$PATH" "$SECRET_KEY"
    printf 'export ALLOWED_HOSTS=%q SUANLI_SCREENSHOTS=%q SUANLI_TLS_DIR=%q\n' \
        "$ALLOWED_HOSTS" "$SUANLI_SCREENSHOTS" "$SUANLI_TLS_DIR"
    if [ "${2:-}" = fast ]; then
        printf 'unset %s\n' "${NOT_FAST[*]}"
        printf 'export SUANLI_TEST_DATABASE=test_suanli_dev_fast REDIS_URL="${REDIS_URL%%/*}/2"\n'
        printf 'export SUANLI_TLS_DIR=%q\n' "$PWD/.run/test/tls-dev-fast"
    fi
    exit 0
fi

stop="" # what to stop at the end: "full" (all of them, as `make test` always did), "db", or nothing
cleanup() {
    case "$stop" in
    full) bash .ci/services.sh stop >&2 || true ;;
    db) bash .ci/services.sh stop db >&2 || true ;;
    esac
}
trap cleanup EXIT
if [ "$TIER" = fast ]; then
    # PostgreSQL and Redis: reused when they answer (the full set may be running), else
    # started now and stopped at the end.
    bash .ci/services.sh status db 2>/dev/null || stop=db
    env_out="$(bash .ci/services.sh start db)"
else
    stop=full # a half-finished start is cleaned up too
    env_out="$(bash .ci/services.sh start)"
fi
eval "$env_out"
suite_env
mkdir -p "$SUANLI_SCREENSHOTS" staticfiles

if [ "${E2E:-0}" = 1 ]; then
    IFS=, read -ra engines <<<"$SUANLI_TEST_ENGINES"
    bash .ci/torch-image.sh "${engines[@]}"
    bash .ci/jupyter-image.sh "${engines[@]}"
fi

echo "== messages: locale/*.po -> .mo"
python manage.py compilemessages --ignore='.*' --ignore=node_modules -v0

echo "== lint: ruff check, ruff format --check, import-linter layers"
if [ "$TIER" = fast ]; then
    # A developer's first run: the tests run even when the lint fails; both decide the exit.
    lint=0
    ruff check . || lint=$?
    ruff format --check . || lint=$?
    lint-imports || lint=$?
    fast_env
    tests=0
    if [ $# -gt 0 ] || [ "${SUANLI_TEST_SPLIT:-1}" = 0 ]; then
        echo "== the fast tier ($FAST) on $DATABASE_URL and Redis, no engines"
        python -m pytest -m "$FAST" --durations=15 "$@" || tests=$?
    else
        # Two processes, one a core: the test files taken in turn, each half on a test database,
        # Redis number and TLS folder of its own; the second one's output follows the first's.
        mapfile -t files < <(ls tests/test_*.py)
        half_a=() half_b=()
        for i in "${!files[@]}"; do
            if ((i % 2)); then half_b+=("${files[$i]}"); else half_a+=("${files[$i]}"); fi
        done
        log_b=.run/test/fast-tier-b.log
        echo "== the fast tier ($FAST) on $DATABASE_URL and Redis, no engines: two processes (log: $log_b)"
        (
            export SUANLI_TEST_DATABASE=test_suanli_dev_fast_b REDIS_URL="${REDIS_URL%/*}/3"
            export SUANLI_TLS_DIR="$PWD/.run/test/tls-dev-fast-b"
            exec python -m pytest -p no:cacheprovider -m "$FAST" --durations=10 "${half_b[@]}"
        ) >"$log_b" 2>&1 &
        pid_b=$!
        python -m pytest -m "$FAST" --durations=10 "${half_a[@]}" || tests=$?
        tests_b=0
        wait "$pid_b" || tests_b=$?
        echo "== the fast tier's other half (it ran beside the above):"
        cat "$log_b"
        if [ "$tests" = 0 ]; then tests="$tests_b"; fi
    fi
    if [ "$lint" != 0 ]; then echo "== the lint failed (above)"; fi
    if [ "$tests" != 0 ]; then exit "$tests"; fi
    exit "$lint"
fi
ruff check .
ruff format --check .
lint-imports

if [ $# -gt 0 ] || [ "${SUANLI_TEST_SPLIT:-1}" = 0 ]; then
    echo "== tests on $DATABASE_URL, engines $SUANLI_TEST_ENGINES"
    python -m pytest --durations=30 "$@"
    exit
fi

# The whole suite in two processes at once: the engine tests (mostly waiting on the
# engines, which only one process may drive) beside the fast tier (CPU-bound) and then the
# tests that need Procfile processes or Chromium but no engine, MooseFS or registry, each on
# a test database, Redis number and TLS folder of its own. Then the tests that stop PostgreSQL and Redis
# under everyone (marked `alone`), by themselves. Every test runs exactly once: the -m
# expressions split `not e2e`.
ENGINE='engine and not e2e and not alone'
BESIDE='(procs or browser) and not engine and not e2e and not alone'
ALONE='alone and not e2e'
side_log=.run/test/fast-tier.log
echo "== tests on $DATABASE_URL, engines $SUANLI_TEST_ENGINES: the engine tests beside the fast tier, then the processes and browser tests with no engine (log: $side_log)"
(
    side=0
    (
        unset "${NOT_FAST[@]}" # as `make test-fast` runs it: a test needing them must say so
        export SUANLI_TEST_DATABASE=test_suanli_fast REDIS_URL="${REDIS_URL%/*}/1"
        export SUANLI_TLS_DIR="$PWD/.run/test/tls-fast"
        exec python -m pytest -p no:cacheprovider -m "$FAST" --durations=30
    ) || side=$?
    echo "== the processes and browser tests with no engine ($BESIDE)"
    (
        # No engine, MooseFS or registry either: an engine test's faults (an engine killed,
        # MooseFS remounted) are not theirs, and a test needing them must say so.
        unset "${NOT_FAST[@]}"
        export SUANLI_TEST_DATABASE=test_suanli_beside REDIS_URL="${REDIS_URL%/*}/4"
        export SUANLI_TLS_DIR="$PWD/.run/test/tls-beside"
        exec python -m pytest -p no:cacheprovider -m "$BESIDE" --durations=15
    ) || side=$?
    exit "$side"
) >"$side_log" 2>&1 &
side_pid=$!
rc=0
python -m pytest -m "$ENGINE" --durations=30 || rc=$?
fast_rc=0
wait "$side_pid" || fast_rc=$?
echo "== the fast tier, then the processes and browser tests with no engine (they ran beside the above):"
cat "$side_log"
echo "== the tests marked alone ($ALONE): they stop PostgreSQL and Redis under everyone"
python -m pytest -m "$ALONE" --durations=5 || rc=$?
for r in "$rc" "$fast_rc"; do if [ "$r" != 0 ]; then exit "$r"; fi; done

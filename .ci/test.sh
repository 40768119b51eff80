#!/usr/bin/env bash
# `make test`: start the real parts, run lint, layering and the suite, stop what we started.
set -euo pipefail
cd "$(dirname "$0")/.."

started=0
cleanup() { if [ "$started" = 1 ]; then bash .ci/services.sh stop >&2 || true; fi; }
trap cleanup EXIT
started=1  # a half-finished start is cleaned up too
env_out="$(bash .ci/services.sh start)"
eval "$env_out"

export PATH="$PWD/.venv/bin:$PATH"
# Production-like settings, but plain HTTP for the live test server.
export DEBUG=0 SUANLI_HTTPS=0 SUANLI_STATIC_MANIFEST=0 SECRET_KEY="test-only-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
export ALLOWED_HOSTS="localhost,127.0.0.1,testserver"  # SUANLI_STORAGE_ROOT: the env above (MooseFS)
export SUANLI_SCREENSHOTS="$PWD/.run/test/screenshots" SUANLI_TLS_DIR="$PWD/.run/test/tls"
mkdir -p "$SUANLI_SCREENSHOTS" staticfiles

if [ "${E2E:-0}" = 1 ]; then
    IFS=, read -ra engines <<<"$SUANLI_TEST_ENGINES"
    bash .ci/torch-image.sh "${engines[@]}"
    bash .ci/jupyter-image.sh "${engines[@]}"
fi

echo "== messages: locale/*.po -> .mo"
python manage.py compilemessages --ignore='.*' --ignore=node_modules -v0

echo "== lint: ruff check, ruff format --check, import-linter layers"
ruff check .
ruff format --check .
lint-imports

echo "== tests on $DATABASE_URL, engines $SUANLI_TEST_ENGINES"
python -m pytest "$@"

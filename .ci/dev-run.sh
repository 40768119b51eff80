#!/usr/bin/env bash
# `make run`: the whole console on an embedded default (SQLite, a local Redis, the local
# Docker engine as an emulated-GPU host). Ctrl-C stops everything it started.
set -euo pipefail
cd "$(dirname "$0")/.."

prepare_pid=""
cleanup() {
    if [ -n "$prepare_pid" ]; then kill -- "-$prepare_pid" 2>/dev/null || true; fi
    bash .ci/dev-services.sh stop >&2 || true
}
trap cleanup EXIT
env_out="$(bash .ci/dev-services.sh start)"  # a failed start stops here (set -e)
eval "$env_out"

export PATH="$PWD/.venv/bin:$PATH"
# DEBUG off, as in production: an error is a plain page, never Django's debug page with
# settings on it (DEBUG=1 make run opts in). Plain HTTP on the loopback. Static files as in
# production: collected under hashed names with their .gz and .br, cached for good by the
# browser (an edited static file is collected again and shows after the next `make run`;
# SUANLI_STATIC_MANIFEST=0 SUANLI_STATIC_FINDERS=1 make run serves the source tree instead).
export DEBUG="${DEBUG:-0}" PORT="${PORT:-8000}" SUANLI_HTTPS="${SUANLI_HTTPS:-0}"
export ALLOWED_HOSTS="${ALLOWED_HOSTS:-localhost,127.0.0.1,[::1]}"
# The workspace apps, each on an origin of its own: c<cluster>-n<node>-<kind>.apps.localhost
# (browsers resolve *.localhost to the loopback by themselves); their pages link back to
# the console at SITE_URL.
export SUANLI_APPS_DOMAIN="${SUANLI_APPS_DOMAIN:-apps.localhost}" SITE_URL="${SITE_URL:-http://127.0.0.1:${PORT}}"
export SUANLI_STATIC_MANIFEST="${SUANLI_STATIC_MANIFEST:-1}" SUANLI_STATIC_FINDERS="${SUANLI_STATIC_FINDERS:-0}"
manifest="${SUANLI_STATIC_ROOT:-staticfiles}/staticfiles.json"  # collected again after a change
if [ "$SUANLI_STATIC_MANIFEST" != 0 ] && { [ ! -f "$manifest" ] ||
    [ -n "$(find static .venv/.installed-* -newer "$manifest" -print -quit)" ]; }; then
    echo "Collecting the static files (hashed, gzip and brotli; half a minute after each change)" >&2
    python manage.py collectstatic --no-input -v0
fi
python manage.py compilemessages --ignore='.*' --ignore=node_modules -v0  # locale/*.po -> .mo (gettext)
python manage.py migrate --no-input -v0
python manage.py seed_demo --local-engine "$SUANLI_LOCAL_ENGINE" | tee .run/dev/logins.txt
python manage.py catalog_prepare --reset -v0 >/dev/null  # a build killed last time is not "being prepared"
# The catalog's PyTorch + JupyterLab image for the local engine, built in the background from
# what .ci/jupyter-image.sh does (minutes the first time: it needs root and Debian's and PyPI's
# mirrors); the new-cluster form shows its progress, then where it runs, or "not available
# here" when it could not be built (the log says why). SUANLI_JUPYTER_IMAGE_BUILD=0 skips it.
jupyter_note="not built (SUANLI_JUPYTER_IMAGE_BUILD=0)"
if [ "${SUANLI_JUPYTER_IMAGE_BUILD:-1}" != 0 ]; then
    setsid python manage.py catalog_prepare suanli/jupyter:2.13-cpu -- \
        bash .ci/jupyter-image.sh "$SUANLI_LOCAL_ENGINE" >.run/dev/jupyter-image.log 2>&1 &
    prepare_pid=$!
    jupyter_note="being built in the background: .run/dev/jupyter-image.log"
fi
cat <<MSG

  Suanli is starting on  http://127.0.0.1:${PORT}/
  Admin (operator):      http://127.0.0.1:${PORT}/admin/
  SSH gateway:           ssh -p ${SUANLI_SSH_PORT:-2222} c<cluster>-<node>@127.0.0.1 (add a key, attach it to a cluster)
  API docs:              http://127.0.0.1:${PORT}/api/v1/docs
  Metrics (Prometheus):  http://127.0.0.1:${PORT}/metrics (signed in as the operator above); each process's on 127.0.0.1:9810-9880 (docs/operator/metrics.md)
  Workspace apps:        http://c<cluster>-n<node>-<kind>.${SUANLI_APPS_DOMAIN}:${PORT}/ (open them from a cluster's tiles)
  JupyterLab image:      ${jupyter_note}
  Errors are plain pages (DEBUG off, as in production); DEBUG=1 make run shows Django's.
  Ctrl-C stops every Procfile process and the services started for it.

MSG
honcho start -f Procfile -p "$PORT"

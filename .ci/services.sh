#!/usr/bin/env bash
# Backing services for the TEST suite.
#
#   eval "$(.ci/services.sh start)"   # start (idempotent), export the env
#   .ci/services.sh env               # print the env without starting anything
#   .ci/services.sh stop [--clean]    # stop what start started; --clean also
#                                     # deletes the run dir (image cache too)
#
# start brings up:
#   - PostgreSQL (system cluster; role+db suanli/suanli, password auth on
#     127.0.0.1). Stopped by `stop` only if `start` was the one to start it.
#   - redis on 127.0.0.1:${SUANLI_TEST_REDIS_PORT:-6399}, no persistence.
#   - two independent Docker engines "a" and "b", each with its own socket,
#     data root, exec root and bridge (suanli-a 172.29.1.1/24, suanli-b
#     172.29.2.1/24), both with the image suanli/busybox:latest.
# and prints `export` lines on stdout (also saved to $RUN_DIR/env.sh).
# Everything else goes to stderr.
#
# Needs root (dockerd, bridges, pg_ctlcluster).
set -euo pipefail

LOG_TAG=services
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# Default under the repo root (not $PWD) so running from a subdirectory still
# uses the one .run/ that .gitignore covers; RUN_DIR overrides.
RUN_DIR="${RUN_DIR:-$REPO_ROOT/.run/test}"
mkdir -p "$RUN_DIR"
RUN_DIR="$(cd "$RUN_DIR" && pwd)" # absolute: it ends up in socket URLs

REDIS_PORT="${SUANLI_TEST_REDIS_PORT:-6399}"
REDIS_DIR="$RUN_DIR/redis"
PG_CLUSTER=main
PG_MARKER="$RUN_DIR/postgres.started-by-us"
BUSYBOX_TAR="$RUN_DIR/busybox-rootfs.tar"

ENGINES=(a b)
declare -A BRIDGE_ADDR=([a]=172.29.1.1/24 [b]=172.29.2.1/24)
# Pools for user-defined networks (`docker network create`). Without them both
# engines would hand out the same 172.18.0.0/16... and create two host bridges
# with overlapping routes.
declare -A ADDR_POOL=([a]=172.29.64.0/18 [b]=172.29.128.0/18)

engine_dir() { printf '%s/docker-%s' "$RUN_DIR" "$1"; }
engine_sock() { printf '%s/docker-%s.sock' "$RUN_DIR" "$1"; }
engine_host() { printf 'unix://%s' "$(engine_sock "$1")"; }
engine_bridge() { printf 'suanli-%s' "$1"; }

# ------------------------------------------------------------ postgres ----

pg_version() {
    local v
    v="$(find /usr/lib/postgresql -mindepth 1 -maxdepth 1 -type d -printf '%f\n' 2>/dev/null |
        grep -E '^[0-9]+$' | sort -n | while read -r d; do
            [[ -x "/usr/lib/postgresql/$d/bin/postgres" ]] && echo "$d"
        done | tail -n 1)"
    [[ -n "$v" ]] || return 1
    printf '%s\n' "$v"
}

# pg_field VERSION FIELD: a column of `pg_lsclusters` for our cluster
# (3=port 4=status); empty when the cluster does not exist.
pg_field() {
    pg_lsclusters -h 2>/dev/null | awk -v v="$1" -v c="$PG_CLUSTER" -v f="$2" '$1 == v && $2 == c { print $f }'
}

pg_port() {
    local v port=""
    if command -v pg_lsclusters >/dev/null && v="$(pg_version)"; then
        port="$(pg_field "$v" 3)"
    fi
    printf '%s\n' "${port:-5432}"
}

# psql as the postgres superuser over the local socket (peer auth). cd / so
# psql does not complain that it cannot read the caller's cwd.
pg_super() {
    (cd / && runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 -p "$PG_PORT" "$@")
}

start_postgres() {
    local v status
    v="$(pg_version)" || die "no PostgreSQL server under /usr/lib/postgresql (run .ci/install.sh postgresql)"
    if [[ -z "$(pg_field "$v" 3)" ]]; then
        log "creating PostgreSQL $v cluster '$PG_CLUSTER'"
        pg_createcluster "$v" "$PG_CLUSTER" >&2
    fi
    PG_PORT="$(pg_field "$v" 3)"
    status="$(pg_field "$v" 4)"
    if [[ "$status" != online* ]]; then
        log "starting PostgreSQL $v/$PG_CLUSTER on port $PG_PORT"
        pg_ctlcluster "$v" "$PG_CLUSTER" start >&2
        printf '%s %s\n' "$v" "$PG_CLUSTER" >"$PG_MARKER"
    else
        log "PostgreSQL $v/$PG_CLUSTER already running on port $PG_PORT"
    fi
    wait_until 30 "pg_isready on port $PG_PORT" pg_isready -q -h 127.0.0.1 -p "$PG_PORT" ||
        die "PostgreSQL not ready; see /var/log/postgresql/postgresql-$v-$PG_CLUSTER.log"

    # Role: create, or re-assert attributes/password in case it drifted.
    # CREATEDB because Django's test runner creates test_suanli itself.
    pg_super -d postgres <<'SQL'
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'suanli') THEN
        CREATE ROLE suanli LOGIN CREATEDB PASSWORD 'suanli';
    ELSE
        ALTER ROLE suanli LOGIN CREATEDB PASSWORD 'suanli';
    END IF;
END
$$;
SQL
    # CREATE DATABASE cannot run inside DO/transactions, hence the lookup.
    if [[ "$(pg_super -d postgres -Atc "SELECT 1 FROM pg_database WHERE datname = 'suanli'")" != 1 ]]; then
        log "creating database suanli"
        pg_super -d postgres -c 'CREATE DATABASE suanli OWNER suanli'
    fi
    # The app connects over TCP with a password; Debian's pg_hba.conf allows
    # scram-sha-256 for host 127.0.0.1/32, check it really does.
    if ! PGPASSWORD=suanli PGCONNECT_TIMEOUT=5 psql -X -q -h 127.0.0.1 -p "$PG_PORT" -U suanli -d suanli \
        -c 'select 1' >/dev/null 2>"$RUN_DIR/psql-check.err"; then
        cat "$RUN_DIR/psql-check.err" >&2
        die "password login as suanli@127.0.0.1:$PG_PORT failed; check 'host all all 127.0.0.1/32 scram-sha-256' in $(pg_super -d postgres -Atc 'show hba_file')"
    fi
    rm -f "$RUN_DIR/psql-check.err"
    log "PostgreSQL OK: suanli@127.0.0.1:$PG_PORT/suanli"
}

stop_postgres() {
    local v c
    if [[ ! -f "$PG_MARKER" ]]; then
        log "PostgreSQL was not started by us; leaving it alone"
        return 0
    fi
    read -r v c <"$PG_MARKER"
    if [[ "$(pg_field "$v" 4)" == online* ]]; then
        log "stopping PostgreSQL $v/$c"
        pg_ctlcluster "$v" "$c" stop -m fast >&2
    fi
    rm -f "$PG_MARKER"
}

# -------------------------------------------------------------- docker ----

ensure_bridge() {
    local br="$1" addr="$2"
    if ! ip link show "$br" >/dev/null 2>&1; then
        ip link add "$br" type bridge
    fi
    if ! ip -4 addr show dev "$br" | grep -qF "inet $addr "; then
        ip addr add "$addr" dev "$br"
    fi
    ip link set "$br" up
}

start_engine() {
    local e="$1" dir host sock
    dir="$(engine_dir "$e")"
    host="$(engine_host "$e")"
    sock="$(engine_sock "$e")"
    if docker_up "$host"; then
        log "engine $e already running ($host)"
        return 0
    fi
    # Unix socket paths are limited to 108 bytes; containerd's lives deepest.
    local deepest="$dir/exec/containerd/containerd.sock.ttrpc"
    ((${#deepest} < 104)) || die "RUN_DIR path too long for unix sockets ($deepest); set RUN_DIR to something shorter, e.g. /tmp/suanli-test"
    # A dockerd from an earlier run may still be shutting down or starting.
    if pid_from_file "$dir/docker.pid" >/dev/null; then
        log "engine $e: dockerd already starting, waiting"
        if wait_until 60 "engine $e" docker_up "$host"; then return 0; fi
        stop_dockerd "$dir/docker.pid" "$dir/exec" 20
    fi
    # Leftovers of a crashed engine (a stale socket makes dockerd refuse).
    stop_dockerd "$dir/docker.pid" "$dir/exec" 10
    rm -f "$sock"
    mkdir -p "$dir/data" "$dir/exec"
    # Forget the network state of the previous run (images stay cached).
    # Observed with docker.io 20.10: a dockerd restarting on a data root whose
    # store still holds the previous "bridge" network, after `stop` deleted
    # and we recreated suanli-X, deletes ANOTHER bridge while clearing that
    # stale network -- here it deleted the system docker0 under a running
    # dev dockerd. Without the store it starts clean and touches nothing.
    # `stop` removed all containers, so nothing refers to these networks.
    rm -f "$dir/data/network/files/local-kv.db"
    # Own bridge per engine, created before dockerd: with --bridge NAME dockerd
    # uses an existing bridge as is. (`--bridge none` would be worse: dockerd
    # then deletes any docker0, i.e. the bridge of another engine.)
    ensure_bridge "$(engine_bridge "$e")" "${BRIDGE_ADDR[$e]}"
    # Empty config file: a system /etc/docker/daemon.json (hosts, data-root...)
    # must not leak into the test engines.
    [[ -f "$dir/daemon.json" ]] || echo '{}' >"$dir/daemon.json"
    log "starting engine $e ($host)"
    start_dockerd "$host" "$dir" "$dir/dockerd.log" "$dir/docker.pid" \
        --config-file "$dir/daemon.json" \
        --host "$host" \
        --data-root "$dir/data" \
        --exec-root "$dir/exec" \
        --bridge "$(engine_bridge "$e")" \
        --default-address-pool "base=${ADDR_POOL[$e]},size=24"
}

remove_containers() {
    local e="$1" host ids
    host="$(engine_host "$e")"
    docker_up "$host" || return 0
    mapfile -t ids < <("$DOCKER_CLI" -H "$host" ps -aq)
    if ((${#ids[@]})); then
        log "engine $e: removing ${#ids[@]} container(s)"
        "$DOCKER_CLI" -H "$host" rm -f "${ids[@]}" >/dev/null || warn "engine $e: some containers could not be removed"
    fi
}

stop_engine() {
    local e="$1" dir br
    dir="$(engine_dir "$e")"
    br="$(engine_bridge "$e")"
    remove_containers "$e"
    stop_dockerd "$dir/docker.pid" "$dir/exec" 20
    rm -f "$(engine_sock "$e")"
    # dockerd leaves exec/netns/default (an nsfs bind mount) behind even on a
    # clean exit; unmount it so a plain `rm -rf .run` works later.
    unmount_under "$dir"
    if ip link show "$br" >/dev/null 2>&1; then
        ip link del "$br"
    fi
}

# unmount_under DIR: dockerd leaves its netns/default mount behind, and a
# SIGKILLed dockerd/containerd can also leave overlay and shm mounts; all of
# them make `rm -rf` fail with EBUSY. Only call once dockerd is gone.
unmount_under() {
    local dir="$1" m
    awk -v d="$dir/" 'index($2, d) == 1 { print $2 }' /proc/mounts | sort -r | while read -r m; do
        umount -l "$m" 2>/dev/null || warn "could not unmount $m"
    done
}

# ---------------------------------------------------------------- main ----

print_env() {
    local engines="" e
    for e in "${ENGINES[@]}"; do engines+="${engines:+,}$(engine_host "$e")"; done
    write_env "$RUN_DIR/env.sh" \
        "DATABASE_URL=postgres://suanli:suanli@127.0.0.1:${PG_PORT:-$(pg_port)}/suanli" \
        "REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0" \
        "SUANLI_TEST_ENGINES=$engines" \
        "SUANLI_TEST_IMAGE=$SUANLI_IMAGE"
}

cmd_start() {
    is_root || die "services.sh start needs root (dockerd, bridges, pg_ctlcluster)"
    local e
    # No-op (dpkg-query only) when everything is already installed.
    "$CI_DIR/install.sh" postgresql redis-server docker.io busybox-static iproute2 iptables
    # PostgreSQL takes ~2 s to start and shares nothing with the rest: run it
    # alongside. The engines start one after the other on purpose: a starting
    # dockerd flushes and recreates the shared DOCKER iptables chains, which
    # would race with the other engine doing the same.
    start_postgres &
    local pg_job=$! jobs=() j rc=0
    start_redis "$REDIS_PORT" "$REDIS_DIR" --save '' --appendonly no
    for e in "${ENGINES[@]}"; do start_engine "$e"; done
    build_busybox_rootfs "$BUSYBOX_TAR" # once, before the engines use it
    for e in "${ENGINES[@]}"; do
        ensure_busybox_image "$(engine_host "$e")" "$BUSYBOX_TAR" &
        jobs+=($!)
    done
    for j in "${jobs[@]}" "$pg_job"; do wait "$j" || rc=1; done
    ((rc == 0)) || die "some service failed to start (see messages above)"
    log "all test services up"
    print_env
}

cmd_stop() {
    local clean="${1:-}" e
    is_root || die "services.sh stop needs root"
    # Engines in parallel: each dockerd takes a few seconds to shut down.
    local pids=() p rc=0
    for e in "${ENGINES[@]}"; do
        stop_engine "$e" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    ((rc == 0)) || die "stopping an engine failed"
    stop_redis "$REDIS_PORT" "$REDIS_DIR"
    stop_postgres
    if [[ "$clean" == --clean ]]; then
        log "removing $RUN_DIR"
        unmount_under "$RUN_DIR"
        rm -rf "$RUN_DIR"
    fi
    log "test services stopped"
}

# All state changes are serialized: two concurrent `start`s (e.g. parallel make
# targets) must not race each other creating bridges or dockerds. Re-exec under
# `flock -o` rather than `exec 9>lock; flock 9`: with -o the lock fd is NOT
# inherited by this script, so the daemons it starts (postgres, redis, dockerd)
# do not keep holding the lock after we exit.
if [[ "${_SUANLI_SERVICES_LOCK:-}" != "$RUN_DIR" ]]; then
    export _SUANLI_SERVICES_LOCK="$RUN_DIR"
    exec flock -o "$RUN_DIR/.lock" "${BASH:-bash}" "$0" "$@"
fi

case "${1:-}" in
start) cmd_start ;;
stop) cmd_stop "${2:-}" ;;
env) print_env ;;
*)
    echo "usage: $0 start | stop [--clean] | env" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# Backing services for the TEST suite.
#
#   eval "$(.ci/services.sh start)"   # start (idempotent), export the env
#   .ci/services.sh env               # print the env without starting anything
#   .ci/services.sh stop [--clean]    # stop what start started; --clean also
#                                     # deletes the run dir (image cache too)
#   .ci/services.sh restart-engine b  # bring back an engine a test killed
#   eval "$(.ci/services.sh start db)"  # PostgreSQL and Redis only (`make test-fast`)
#   .ci/services.sh status db         # exit 0 when both answer
#   .ci/services.sh stop db           # stop them, unless the full set is running
#
# start brings up:
#   - PostgreSQL (system cluster; role+db suanli/suanli, password auth on
#     127.0.0.1). Stopped by `stop` only if `start` was the one to start it.
#   - redis on 127.0.0.1:${SUANLI_TEST_REDIS_PORT:-6399}, no persistence, with a
#     password generated once into $RUN_DIR/redis.pass (and the key of the secrets
#     at rest into $RUN_DIR/secrets.key).
#   - two Docker engines "a" and "b", each a host of its own: its own network
#     namespace (suanli-test-a/b) joined to this machine by a veth pair on the
#     bridge suanli-hosts (172.29.0.1/24; engines 172.29.0.11 and .12), its own
#     socket, data root and exec root, its data root on btrfs in a sparse loop file
#     (docker-E/data.btrfs, the storage driver btrfs, quotas on: root filesystem sizes
#     are enforced), the tenant firewall and host set-up
#     (jobs/hosts/scripts/host-firewall.sh), the image suanli/busybox:latest and the SSH
#     gateway's suanli/sftp:latest (OpenSSH's sftp-server, rsync and scp alone). The two
#     form a swarm (a manages) that carries the clusters' overlay networks.
#   - the researchers' distributed filesystem: MooseFS (Debian's packages), a master and one
#     chunkserver on 172.29.0.1 (ports 19419-19422), fresh each start, mounted by this
#     machine (the console, with the right to set quotas) at $RUN_DIR/storage.
#   - each engine's host is a machine of its own for files too: a persistent mount namespace
#     ($RUN_DIR/mntns/E) in which a tmpfs (the host's own disk) covers $RUN_DIR/storage and
#     MooseFS is mounted over it, so a bind source there is the same file on every host and
#     nothing is shared by accident. `remount-storage E` mounts it again after a test took
#     it away.
#   - the image registry (docker-registry) on 172.29.0.1:5443 with TLS from a CA made
#     here and a password (.ci/lib.sh start_registry); the engines trust its CA.
#     Nothing outside those namespaces and suanli-hosts is touched: this machine's
#     docker0 and any other engine stay as they are.
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
SFTP_TAR="$RUN_DIR/sftp-rootfs.tar"

ENGINES=(a b)
HOSTS_BRIDGE=suanli-hosts
HOSTS_GATEWAY=172.29.0.1
declare -A ENGINE_IP=([a]=172.29.0.11 [b]=172.29.0.12)
# Pools for user-defined networks (`docker network create`) and the swarm's overlays:
# distinct, so that no two networks of the test hosts overlap.
declare -A ADDR_POOL=([a]=172.29.64.0/18 [b]=172.29.128.0/18)
SWARM_POOL=172.29.192.0/18
# The private image registry (researchers' own images) on the hosts' network, where every
# engine reaches it; tenant containers do not (the firewall refuses private ranges).
REGISTRY_DIR="$RUN_DIR/registry"
REGISTRY_PORT="${SUANLI_TEST_REGISTRY_PORT:-5443}"
# MooseFS: its state (fresh every start: the suite's files are its own), the console's mount
# (SUANLI_STORAGE_ROOT) and the ports (metaloggers, chunkservers, clients, chunkserver).
MFS_DIR="$RUN_DIR/moosefs"
STORAGE_MNT="$RUN_DIR/storage"
MFS_PORT_BASE="${SUANLI_TEST_MFS_PORT:-19419}"
MFS_CLIENT_PORT=$((MFS_PORT_BASE + 2))
MNTNS_DIR="$RUN_DIR/mntns"

engine_dir() { printf '%s/docker-%s' "$RUN_DIR" "$1"; }
engine_sock() { printf '%s/docker-%s.sock' "$RUN_DIR" "$1"; }
engine_host() { printf 'unix://%s' "$(engine_sock "$1")"; }
engine_netns() { printf 'suanli-test-%s' "$1"; }
engine_veth() { printf 'slh-%s' "$1"; }
engine_mntns() { printf '%s/%s' "$MNTNS_DIR" "$1"; }
# The sparse file that holds an engine's btrfs data root (kept between runs: the image
# cache), and its size: blocks are taken only as images and containers write them.
engine_disk() { printf '%s/data.btrfs' "$(engine_dir "$1")"; }
ENGINE_DISK_SIZE="${SUANLI_TEST_ENGINE_DISK:-32G}"
FIREWALL="$REPO_ROOT/jobs/hosts/scripts/host-firewall.sh"
REDIS_PASS_FILE="$RUN_DIR/redis.pass"
SECRETS_KEY_FILE="$RUN_DIR/secrets.key"

redis_password() { secret_file "$REDIS_PASS_FILE" hex; }

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

# ensure_hosts_lan: the bridge that joins the test hosts and this machine (their
# "data-centre network"): swarm control (2377), gossip (7946) and VXLAN (4789) cross it.
ensure_hosts_lan() {
    if ! ip link show "$HOSTS_BRIDGE" >/dev/null 2>&1; then
        ip link add "$HOSTS_BRIDGE" type bridge
    fi
    if ! ip -4 addr show dev "$HOSTS_BRIDGE" | grep -qF "inet $HOSTS_GATEWAY/"; then
        ip addr add "$HOSTS_GATEWAY/24" dev "$HOSTS_BRIDGE"
    fi
    ip link set "$HOSTS_BRIDGE" up
    # With br_netfilter, frames between two ports of the bridge pass FORWARD, whose
    # policy a local dockerd sets to DROP.
    iptables -C FORWARD -i "$HOSTS_BRIDGE" -o "$HOSTS_BRIDGE" -j ACCEPT 2>/dev/null ||
        iptables -I FORWARD 1 -i "$HOSTS_BRIDGE" -o "$HOSTS_BRIDGE" -j ACCEPT
}

remove_hosts_lan() {
    iptables -D FORWARD -i "$HOSTS_BRIDGE" -o "$HOSTS_BRIDGE" -j ACCEPT 2>/dev/null || true
    if ip link show "$HOSTS_BRIDGE" >/dev/null 2>&1; then
        ip link del "$HOSTS_BRIDGE"
    fi
}

# ensure_netns ENGINE: the engine's own network namespace, with lo and an eth0 on the
# hosts' bridge, so the engine is a host with an address of its own.
ensure_netns() {
    local e="$1" ns veth
    ns="$(engine_netns "$e")"
    veth="$(engine_veth "$e")"
    [[ -e "/var/run/netns/$ns" ]] || ip netns add "$ns"
    if ! ip link show "$veth" >/dev/null 2>&1; then
        ip -n "$ns" link del eth0 2>/dev/null || true
        ip link add "$veth" type veth peer name eth0 netns "$ns"
    fi
    ip link set "$veth" master "$HOSTS_BRIDGE" up
    ip -n "$ns" link set lo up
    if ! ip -n "$ns" -4 addr show dev eth0 | grep -qF "inet ${ENGINE_IP[$e]}/"; then
        ip -n "$ns" addr add "${ENGINE_IP[$e]}/24" dev eth0
    fi
    ip -n "$ns" link set eth0 up
    ip -n "$ns" route replace default via "$HOSTS_GATEWAY"
}

start_engine() {
    local e="$1" dir host sock
    dir="$(engine_dir "$e")"
    host="$(engine_host "$e")"
    sock="$(engine_sock "$e")"
    ensure_netns "$e"
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
    # The data root on btrfs (a loop file), so that the engine enforces each container's
    # root filesystem size (`--storage-opt size=`, jobs/nodes/runtime.py) like a production host.
    mount_btrfs_root "$(engine_disk "$e")" "$dir/data" "$ENGINE_DISK_SIZE"
    mkdir -p "$dir/exec"
    # The host's own mount namespace (made after the data root is mounted: a copy of it),
    # with the researchers' filesystem.
    ensure_mount_ns "$(engine_mntns "$e")"
    host_storage "$e"
    # Forget the network and swarm state of the previous run (images stay cached):
    # every run starts from a clean network store and forms a fresh swarm. Not when a
    # test brings back an engine it killed (restart-engine): that one keeps its state.
    if [[ -z "${KEEP_ENGINE_STATE:-}" ]]; then
        rm -f "$dir/data/network/files/local-kv.db"
        rm -rf "$dir/data/swarm"
    fi
    # Empty config file: a system /etc/docker/daemon.json (hosts, data-root...)
    # must not leak into the test engines.
    [[ -f "$dir/daemon.json" ]] || echo '{}' >"$dir/daemon.json"
    log "starting engine $e ($host, ${ENGINE_IP[$e]} in netns $(engine_netns "$e"))"
    # Inside its own namespace the engine's docker0 is its own: it touches no other.
    DOCKERD_NETNS="$(engine_netns "$e")" DOCKERD_MNTNS="$(engine_mntns "$e")" start_dockerd "$host" "$dir" "$dir/dockerd.log" "$dir/docker.pid" \
        --config-file "$dir/daemon.json" \
        --host "$host" \
        --data-root "$dir/data" \
        --storage-driver btrfs \
        --exec-root "$dir/exec" \
        --default-address-pool "base=${ADDR_POOL[$e]},size=24"
    ip netns exec "$(engine_netns "$e")" sh "$FIREWALL" apply
}

swarm_state() { "$DOCKER_CLI" -H "$(engine_host "$1")" info --format '{{.Swarm.LocalNodeState}}' 2>/dev/null; }

# form_swarm: engine a initialises a swarm and engine b joins it (both fresh each run).
form_swarm() {
    local a="${ENGINES[0]}" b="${ENGINES[1]}" token
    if [[ "$(swarm_state "$a")" != active ]]; then
        log "engine $a: swarm init on ${ENGINE_IP[$a]}"
        "$DOCKER_CLI" -H "$(engine_host "$a")" swarm init --advertise-addr "${ENGINE_IP[$a]}" \
            --listen-addr "${ENGINE_IP[$a]}:2377" --default-addr-pool "$SWARM_POOL" >/dev/null
    fi
    if [[ "$(swarm_state "$b")" != active ]]; then
        token="$("$DOCKER_CLI" -H "$(engine_host "$a")" swarm join-token -q worker)"
        log "engine $b: swarm join ${ENGINE_IP[$a]}:2377"
        "$DOCKER_CLI" -H "$(engine_host "$b")" swarm join --token "$token" \
            --advertise-addr "${ENGINE_IP[$b]}" --listen-addr "${ENGINE_IP[$b]}:2377" \
            "${ENGINE_IP[$a]}:2377" >/dev/null
    fi
    log "swarm: $a manager, $b worker"
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
    local e="$1" dir ns
    dir="$(engine_dir "$e")"
    ns="$(engine_netns "$e")"
    remove_containers "$e"
    docker_up "$(engine_host "$e")" && "$DOCKER_CLI" -H "$(engine_host "$e")" swarm leave --force >/dev/null 2>&1 || true
    stop_dockerd "$dir/docker.pid" "$dir/exec" 20
    rm -f "$(engine_sock "$e")"
    drop_mount_ns "$(engine_mntns "$e")" "$STORAGE_MNT"
    unmount_btrfs_root "$(engine_disk "$e")" "$dir/data"
    # dockerd leaves exec/netns/default (an nsfs bind mount) behind even on a
    # clean exit; unmount it so a plain `rm -rf .run` works later.
    unmount_under "$dir"
    # The namespace takes its eth0, bridges and rules with it; the veth pair goes too.
    if [[ -e "/var/run/netns/$ns" ]]; then
        ip netns del "$ns"
    fi
    if ip link show "$(engine_veth "$e")" >/dev/null 2>&1; then
        ip link del "$(engine_veth "$e")"
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

# ------------------------------------------------------------- storage ----

start_storage() {
    if ! mfs_running; then
        # Fresh every start: the suite's files are its own, and the chunks' blocks go.
        unmount_storage_here
        rm -rf "$MFS_DIR"
    fi
    mfs_write_config "$MFS_DIR" "$HOSTS_GATEWAY" "$MFS_PORT_BASE" "$HOSTS_GATEWAY" "${HOSTS_GATEWAY%.*}.0/24"
    start_moosefs "$MFS_DIR"
    mount_moosefs "$STORAGE_MNT" "$HOSTS_GATEWAY" "$MFS_CLIENT_PORT"
    # One chunkserver: one copy of each chunk; deleted files go at once (no trash to count).
    mfssetgoal -r 1 "$STORAGE_MNT" >/dev/null
    mfssettrashtime -r 0 "$STORAGE_MNT" >/dev/null
    chmod 0755 "$STORAGE_MNT" # the console's: it makes each researcher's root in it
    log "MooseFS up ($HOSTS_GATEWAY:$MFS_CLIENT_PORT), mounted at $STORAGE_MNT"
}

mfs_running() { [[ -f "$MFS_DIR/mfsmaster.cfg" ]] && mfsmaster -c "$MFS_DIR/mfsmaster.cfg" test >/dev/null 2>&1; }

unmount_storage_here() {
    while mountpoint -q "$STORAGE_MNT" 2>/dev/null; do umount -l "$STORAGE_MNT" || break; done
}

stop_storage() {
    unmount_storage_here
    stop_moosefs "$MFS_DIR"
    if mountpoint -q "$MNTNS_DIR" 2>/dev/null; then umount -l "$MNTNS_DIR" || true; fi
}

# host_storage E: in engine E's mount namespace, the host's own disk (a tmpfs) at the
# storage path and MooseFS over it; a no-op when it is there.
host_storage() {
    local e="$1" ns
    ns="$(engine_mntns "$e")"
    local in=("--mount=$ns" "--net=/var/run/netns/$(engine_netns "$e")")
    if ! nsenter "${in[@]}" awk -v m="$STORAGE_MNT" '$2 == m && $1 == "suanli-host-disk" { f = 1 } END { exit !f }' /proc/self/mounts; then
        # What the namespace copied from this one (the console's mount) is not the host's.
        nsenter "${in[@]}" sh -c 'while mountpoint -q "$1"; do umount -l "$1" || exit 1; done
            mkdir -p "$1" && mount -t tmpfs -o size=256m,mode=0755 suanli-host-disk "$1"' _ "$STORAGE_MNT" ||
            die "engine $e: could not give the host its own disk at $STORAGE_MNT"
    fi
    mount_moosefs "$STORAGE_MNT" "$HOSTS_GATEWAY" "$MFS_CLIENT_PORT" "${in[@]}"
}

# ---------------------------------------------------------------- main ----

print_env() {
    local engines="" e
    secret_file "$SECRETS_KEY_FILE" fernet >/dev/null
    for e in "${ENGINES[@]}"; do engines+="${engines:+,}$(engine_host "$e")"; done
    write_env "$RUN_DIR/env.sh" \
        "DATABASE_URL=postgres://suanli:suanli@127.0.0.1:${PG_PORT:-$(pg_port)}/suanli" \
        "REDIS_URL=redis://:$(redis_password)@127.0.0.1:$REDIS_PORT/0" \
        "SUANLI_TEST_ENGINES=$engines" \
        "SUANLI_TEST_ENGINE_ADDRS=${ENGINE_IP[a]},${ENGINE_IP[b]}" \
        "SUANLI_TEST_ENGINE_NETNS=$(engine_netns a),$(engine_netns b)" \
        "SUANLI_TEST_ENGINE_MNTNS=$(engine_mntns a),$(engine_mntns b)" \
        "SUANLI_STORAGE_ROOT=$STORAGE_MNT" \
        "SUANLI_STORAGE_FS=moosefs" \
        "SUANLI_STORAGE_MASTER=$HOSTS_GATEWAY:$MFS_CLIENT_PORT" \
        "SUANLI_TEST_HOSTS_GATEWAY=$HOSTS_GATEWAY" \
        "SUANLI_TEST_IMAGE=$SUANLI_IMAGE" \
        "SUANLI_SECRETS_KEY_FILE=$SECRETS_KEY_FILE" \
        "SUANLI_REGISTRY=$HOSTS_GATEWAY:$REGISTRY_PORT" \
        "SUANLI_REGISTRY_USERNAME=suanli" \
        "SUANLI_REGISTRY_PASSWORD=$(secret_file "$REGISTRY_DIR/registry.pass" hex)" \
        "SUANLI_REGISTRY_CA=$REGISTRY_DIR/ca.crt"
}

cmd_start() {
    is_root || die "services.sh start needs root (dockerd, bridges, pg_ctlcluster)"
    local e
    # No-op (dpkg-query only) when everything is already installed.
    "$CI_DIR/install.sh" postgresql redis-server docker.io busybox-static iproute2 iptables \
        openssh-client openssh-sftp-server rsync docker-registry apache2-utils curl openssl btrfs-progs \
        moosefs-master moosefs-chunkserver moosefs-client moosefs-cli
    # PostgreSQL takes ~2 s to start and shares nothing with the rest: run it
    # alongside. The engines start one after the other on purpose: a starting
    # dockerd flushes and recreates the shared DOCKER iptables chains, which
    # would race with the other engine doing the same.
    start_postgres &
    local pg_job=$! jobs=() j rc=0
    REDIS_PASSWORD="$(redis_password)"
    export REDIS_PASSWORD
    start_redis "$REDIS_PORT" "$REDIS_DIR" --save '' --appendonly no --requirepass "$REDIS_PASSWORD"
    ensure_hosts_lan
    start_registry "$REGISTRY_DIR" "$HOSTS_GATEWAY" "$REGISTRY_PORT"
    start_storage
    for e in "${ENGINES[@]}"; do start_engine "$e"; done
    form_swarm
    build_busybox_rootfs "$BUSYBOX_TAR" # once, before the engines use it
    build_sftp_rootfs "$SFTP_TAR"       # the SSH gateway's sftp sessions (jobs/access/sftp.py)
    for e in "${ENGINES[@]}"; do
        ensure_busybox_image "$(engine_host "$e")" "$BUSYBOX_TAR" &
        jobs+=($!)
        ensure_sftp_image "$(engine_host "$e")" "$SFTP_TAR" &
        jobs+=($!)
    done
    for j in "${jobs[@]}" "$pg_job"; do wait "$j" || rc=1; done
    ((rc == 0)) || die "some service failed to start (see messages above)"
    log "all test services up"
    print_env
}

# ---------------------------------------------------------- db only ----
# The fast tier (`make test-fast`) needs PostgreSQL and Redis, nothing else: the same ones
# (same port, password and role) as the full set, so either reuses what the other started.

print_env_db() {
    secret_file "$SECRETS_KEY_FILE" fernet >/dev/null
    write_env "$RUN_DIR/env-db.sh" \
        "DATABASE_URL=postgres://suanli:suanli@127.0.0.1:${PG_PORT:-$(pg_port)}/suanli" \
        "REDIS_URL=redis://:$(redis_password)@127.0.0.1:$REDIS_PORT/0" \
        "SUANLI_SECRETS_KEY_FILE=$SECRETS_KEY_FILE"
}

cmd_start_db() {
    is_root || die "services.sh start db needs root (pg_ctlcluster)"
    "$CI_DIR/install.sh" postgresql redis-server
    REDIS_PASSWORD="$(redis_password)"
    export REDIS_PASSWORD
    start_postgres
    start_redis "$REDIS_PORT" "$REDIS_DIR" --save '' --appendonly no --requirepass "$REDIS_PASSWORD"
    log "PostgreSQL and Redis up (no engines, registry or MooseFS)"
    print_env_db
}

db_up() {
    local v
    v="$(pg_version 2>/dev/null)" || return 1
    [[ "$(pg_field "$v" 4)" == online* ]] &&
        pg_isready -q -h 127.0.0.1 -p "$(pg_field "$v" 3)" &&
        REDIS_PASSWORD="$(redis_password)" redis_up "$REDIS_PORT"
}

# stop db: Redis, and PostgreSQL where a `start` of ours started it; nothing while any engine
# of the full set answers (a `make test` or `make services-up` is using them).
cmd_stop_db() {
    is_root || die "services.sh stop db needs root"
    local e
    for e in "${ENGINES[@]}"; do
        if docker_up "$(engine_host "$e")"; then
            log "the full set of services is running: PostgreSQL and Redis stay for it"
            return 0
        fi
    done
    REDIS_PASSWORD="$(redis_password)" stop_redis "$REDIS_PORT" "$REDIS_DIR"
    stop_postgres
    log "PostgreSQL and Redis stopped"
}

# restart-engine E: start engine E again after a test killed it (kill -9 of its dockerd),
# with its network store and swarm membership as they were; a no-op when it runs.
cmd_restart_engine() {
    is_root || die "services.sh restart-engine needs root"
    local e="${1:-}"
    [[ " ${ENGINES[*]} " == *" $e "* ]] || die "restart-engine: no engine '$e' (${ENGINES[*]})"
    KEEP_ENGINE_STATE=1 start_engine "$e"
}

# remount-storage E: the researchers' filesystem on engine E's host again, after a test
# unmounted it there (a host whose filesystem went away).
cmd_remount_storage() {
    is_root || die "services.sh remount-storage needs root"
    local e="${1:-}"
    [[ " ${ENGINES[*]} " == *" $e "* ]] || die "remount-storage: no engine '$e' (${ENGINES[*]})"
    host_storage "$e"
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
    stop_registry "$REGISTRY_DIR" "$HOSTS_GATEWAY" "$REGISTRY_PORT"
    stop_storage
    remove_hosts_lan
    REDIS_PASSWORD="$(redis_password)" stop_redis "$REDIS_PORT" "$REDIS_DIR"
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

case "${1:-} ${2:-}" in
"start db") cmd_start_db ;;
"stop db") cmd_stop_db ;;
"status db") db_up ;;
"env db") print_env_db ;;
start*) cmd_start ;;
stop*) cmd_stop "${2:-}" ;;
restart-engine*) cmd_restart_engine "${2:-}" ;;
remount-storage*) cmd_remount_storage "${2:-}" ;;
env*) print_env ;;
*)
    echo "usage: $0 start [db] | stop [db|--clean] | status db | restart-engine a|b | remount-storage a|b | env [db]" >&2
    exit 2
    ;;
esac

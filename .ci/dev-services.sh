#!/usr/bin/env bash
# Backing services for the interactive dev console (`make run`).
#
#   eval "$(.ci/dev-services.sh)"     # same as `start`
#   .ci/dev-services.sh start         # ensure redis + local docker, print env
#   .ci/dev-services.sh env           # print the env without starting
#   .ci/dev-services.sh stop          # stop only what `start` started
#
# - Redis: REDIS_URL from the environment is used as is. Otherwise a
#   project-local redis on 127.0.0.1:${SUANLI_DEV_REDIS_PORT:-6389} with its
#   data in .run/dev/redis (default RDB snapshots, so dev state survives) and a
#   password generated once into .run/dev/redis.pass.
# - The tenant firewall (jobs/hosts/scripts/host-firewall.sh) on this machine, as root:
#   containers on Suanli's cluster networks (bridges slc<id>) reach neither this
#   machine's services nor the private networks; and kernel.pid_max is raised (never lowered) for
#   the containers' pids limits; nothing else is changed. The engine
#   is NOT made a swarm member: one engine needs no overlay network.
# - A key for secrets at rest, generated once into .run/dev/secrets.key, and Django's
#   SECRET_KEY into .run/dev/secret_key (make run runs with DEBUG off, as production).
# - Docker: the machine's engine at /var/run/docker.sock. If it does not answer
#   and we are root, start the system dockerd in the background (log and
#   pidfile in .run/dev/) and remember that we did.
# - The engine gets the image suanli/busybox:latest when it lacks it, and the SSH
#   gateway's suanli/sftp:latest (OpenSSH's sftp-server, rsync and scp alone).
# - The image registry (docker-registry) on 127.0.0.1:5444 with TLS from a CA made once in
#   .run/dev/registry and a password; the engine trusts the CA (as root only).
# Prints `export` lines on stdout (also written to .run/dev/env.sh); progress
# goes to stderr.
set -euo pipefail

LOG_TAG=dev-services
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

DEV_DIR="${DEV_RUN_DIR:-$REPO_ROOT/.run/dev}"
REDIS_PORT="${SUANLI_DEV_REDIS_PORT:-6389}"
REDIS_DIR="$DEV_DIR/redis"
LOCAL_ENGINE=unix:///var/run/docker.sock
DOCKERD_PID="$DEV_DIR/dockerd.pid"
DOCKERD_MARKER="$DEV_DIR/dockerd.started-by-us"
# exec-root of a default dockerd: its managed containerd runs from here.
SYSTEM_EXEC_ROOT=/var/run/docker

REGISTRY_DIR="$DEV_DIR/registry"
REGISTRY_PORT="${SUANLI_DEV_REGISTRY_PORT:-5444}"
REDIS_PASS_FILE="$DEV_DIR/redis.pass"
SECRETS_KEY_FILE="$DEV_DIR/secrets.key"
SECRET_KEY_FILE="$DEV_DIR/secret_key"  # Django's SECRET_KEY: make run runs with DEBUG off
FIREWALL="$REPO_ROOT/jobs/hosts/scripts/host-firewall.sh"

redis_password() { secret_file "$REDIS_PASS_FILE" hex; }

redis_url() {
    printf '%s\n' "${REDIS_URL:-redis://:$(redis_password)@127.0.0.1:$REDIS_PORT/0}"
}

# The MTU of the default route's interface: cluster networks must not exceed it.
host_mtu() {
    local dev
    dev="$(ip -o route show default 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") print $(i + 1)}' | head -n 1)"
    cat "/sys/class/net/${dev:-lo}/mtu" 2>/dev/null || echo 1500
}

print_env() {
    secret_file "$SECRETS_KEY_FILE" fernet >/dev/null
    secret_file "$SECRET_KEY_FILE" fernet >/dev/null
    local registry=()
    if [[ -s "$REGISTRY_DIR/ca.crt" && -s "$REGISTRY_DIR/registry.pass" ]]; then
        registry=("SUANLI_REGISTRY=127.0.0.1:$REGISTRY_PORT" "SUANLI_REGISTRY_USERNAME=suanli"
            "SUANLI_REGISTRY_PASSWORD=$(cat "$REGISTRY_DIR/registry.pass")"
            "SUANLI_REGISTRY_CA=$REGISTRY_DIR/ca.crt")
    fi
    write_env "$DEV_DIR/env.sh" "${registry[@]}" \
        "REDIS_URL=$(redis_url)" \
        "SUANLI_LOCAL_ENGINE=$LOCAL_ENGINE" \
        "SUANLI_SECRETS_KEY_FILE=$SECRETS_KEY_FILE" \
        "SECRET_KEY_FILE=$SECRET_KEY_FILE" \
        "SUANLI_NETWORK_MTU=$(host_mtu)"
}

apply_firewall() {
    if is_root && command -v iptables >/dev/null; then
        sh "$FIREWALL" apply && log "tenant firewall applied (jobs/hosts/scripts/host-firewall.sh)"
    else
        warn "not root: the tenant firewall is not applied; run 'sudo sh $FIREWALL apply' so that containers cannot reach this machine's services"
    fi
}

ensure_packages() {
    local needed=(docker.io busybox-static iptables openssh-sftp-server rsync docker-registry apache2-utils
        curl openssl gettext)
    [[ -n "${REDIS_URL:-}" ]] || needed+=(redis-server)
    # As root this installs what is missing; otherwise it lists what is
    # missing with the apt-get command to run, and fails.
    "$CI_DIR/install.sh" "${needed[@]}" ||
        die "missing packages (see above); install them, then rerun"
}

ensure_docker() {
    if docker_up "$LOCAL_ENGINE"; then
        log "using the running Docker engine at $LOCAL_ENGINE"
        return 0
    fi
    if ! is_root; then
        die "no Docker engine answers at $LOCAL_ENGINE. Start it (e.g. 'sudo systemctl start docker' or 'sudo $0') and make sure you can use it ('sudo usermod -aG docker $USER', then log in again)"
    fi
    if [[ -f "$DOCKERD_MARKER" ]]; then
        # Ours from an earlier start, now dead or hung: clean up after it
        # (its containerd may be left over) before starting a new one.
        stop_dockerd "$DOCKERD_PID" "$SYSTEM_EXEC_ROOT" 30
    fi
    log "no Docker engine at $LOCAL_ENGINE; starting the system dockerd"
    # Default dockerd (socket /var/run/docker.sock, data /var/lib/docker);
    # only the pidfile and log are ours, so `stop` knows what to stop.
    # Its cluster networks come from a pool off this machine's networks and the test
    # services' 172.29.0.0/16 (Docker's default, 172.17-31/16, may take either).
    local pool
    pool="$(address_pool)"
    log "engine address pool: $pool (/24 per network)"
    start_dockerd "$LOCAL_ENGINE" "$DEV_DIR" "$DEV_DIR/dockerd.log" "$DOCKERD_PID" \
        --default-address-pool "base=$pool,size=24"
    date -Is >"$DOCKERD_MARKER"
}

# address_pool: the first of a few private /16s that overlaps no route of this machine (its
# LAN, VPNs, other bridges) and not 172.29.0.0/16, the test services' hosts and engines.
address_pool() {
    ip -o route show table all 2>/dev/null | awk '{print $1 == "local" || $1 == "broadcast" ? $2 : $1}' |
        python3 -c '
import ipaddress, sys
taken = [ipaddress.ip_network("172.29.0.0/16")]
for word in sys.stdin.read().split():
    try:
        taken.append(ipaddress.ip_network(word, strict=False))
    except ValueError:
        pass  # "default", "unreachable", ...
for base in ("10.210.0.0/16", "10.211.0.0/16", "10.212.0.0/16", "172.30.0.0/16", "192.168.240.0/20"):
    net = ipaddress.ip_network(base)
    if not any(net.version == t.version and net.overlaps(t) for t in taken):
        print(base)
        break
else:
    sys.exit("no free private /16 for the networks of the engine: set --default-address-pool")
'
}

cmd_start() {
    mkdir -p "$DEV_DIR"
    ensure_packages
    if [[ -n "${REDIS_URL:-}" ]]; then
        log "using REDIS_URL from the environment ($REDIS_URL)"
    else
        REDIS_PASSWORD="$(redis_password)"
        export REDIS_PASSWORD
        start_redis "$REDIS_PORT" "$REDIS_DIR" --requirepass "$REDIS_PASSWORD"
    fi
    ensure_docker
    apply_firewall
    if is_root; then
        start_registry "$REGISTRY_DIR" 127.0.0.1 "$REGISTRY_PORT"
    else
        warn "not root: the image registry is not started (the engine's trust in its CA needs /etc/docker/certs.d); Images will say so"
    fi
    ensure_busybox_image "$LOCAL_ENGINE" "$DEV_DIR/busybox-rootfs.tar"
    ensure_sftp_image "$LOCAL_ENGINE" "$DEV_DIR/sftp-rootfs.tar"
    log "dev services up"
    print_env
}

cmd_stop() {
    stop_registry "$REGISTRY_DIR" 127.0.0.1 "$REGISTRY_PORT"
    # Pidfile-based: a redis we did not start has no pidfile in our dir.
    REDIS_PASSWORD="$(redis_password)" stop_redis "$REDIS_PORT" "$REDIS_DIR"
    if [[ -f "$DOCKERD_MARKER" ]]; then
        # dockerd stops its containers on shutdown (15 s each at most).
        stop_dockerd "$DOCKERD_PID" "$SYSTEM_EXEC_ROOT" 30
        rm -f "$DOCKERD_MARKER"
    else
        log "dockerd was not started by us; leaving it alone"
    fi
    log "dev services stopped"
}

# Serialize concurrent invocations. `flock -o` keeps the lock fd out of this
# script, so daemons started below do not inherit (and hold) the lock.
mkdir -p "$DEV_DIR"
if [[ "${_SUANLI_DEV_LOCK:-}" != "$DEV_DIR" ]]; then
    export _SUANLI_DEV_LOCK="$DEV_DIR"
    exec flock -o "$DEV_DIR/.lock" "${BASH:-bash}" "$0" "$@"
fi

case "${1:-start}" in
start) cmd_start ;;
stop) cmd_stop ;;
env) print_env ;;
*)
    echo "usage: $0 [start] | stop | env" >&2
    exit 2
    ;;
esac

#!/bin/sh
# Join this machine to a Suanli fleet as a (GPU) host, or take it out again.
#
#   curl -fsSL https://CONSOLE/hosts/join.sh | sudo sh -s -- TOKEN
#   sudo sh join.sh [--console https://CONSOLE] TOKEN     # the same script, copied over
#   sudo sh join.sh leave [TOKEN]                          # drain, leave the swarm, removed
#
# TOKEN comes from the console's Hosts -> Add page: it works once, for an hour. Run as root
# on a Debian host. The steps, each of which says why when it fails (here, and on the
# console's Hosts page):
#   preflight  root, curl, openssl; the console answers
#   engine     Docker's engine is there, or Debian's docker.io is installed (apt)
#   gpus       NVIDIA GPUs (nvidia-smi) and, once the engine runs, its nvidia runtime
#   tls        the engine's key (never leaves this host) and a signing request
#   sign       the console checks the token, this host's name and address, and signs
#   dockerd    the engine listens on tcp://ADDRESS:2376 with --tlsverify (the console's CA)
#   firewall   the tenant firewall (host-firewall.sh), applied and kept across reboots
#   swarm      the fleet's Docker swarm, joined with the token the console handed over
#   storage    the researchers' filesystem (MooseFS) mounted at its path, and in fstab
#   images     the helper images (canary, sftp) loaded from the console
#   register   the console adds the host (or updates the one of this name) and checks it
#   check      waits for that check: checking -> active
# Running it again with a new token is harmless: what is in place is kept or updated (a
# running engine keeps running, with its certificate, unless that ends within 30 days or
# SUANLI_JOIN_RENEW=1 is set: then the engine restarts with a new one).
#
# leave: the console drains the host (no new clusters) and this waits until nothing runs
# on it; then the host leaves the swarm, unmounts the researchers' filesystem, its engine
# stops listening on TCP, and the console removes it. It uses the host's own credential
# (kept at /etc/suanli/host.credential by the join) or a new token.
#
# Environment (all optional; the defaults are a real host's):
#   SUANLI_CONSOLE        the console's URL (the copy the console serves knows it)
#   SUANLI_JOIN_NAME      the host's name in the fleet (default: its short host name)
#   SUANLI_JOIN_ADDRESS   its address on the hosts' network (default: the source address of
#                         its route to the console, which must be what the console sees)
#   SUANLI_JOIN_ROOT      where its files go instead of / (etc/suanli, etc/docker/suanli,
#                         etc/systemd/system, etc/fstab): for tests
#   SUANLI_JOIN_DOCKERD   a command that (re)starts dockerd with the arguments in
#                         $SUANLI_DOCKERD_ARGS (default: a systemd drop-in for docker.service
#                         and `systemctl restart docker`); run by sh, detached by itself
#   SUANLI_JOIN_SOCKET    the engine's local socket (default /var/run/docker.sock)
#   SUANLI_JOIN_NO_APT=1  never install a package: say which one is missing instead
#   SUANLI_JOIN_WAIT      seconds to wait for the console's check, or in leave for the
#                         host's clusters to end (default 300)
#   SUANLI_JOIN_CURL      more curl options, e.g. "--cacert /path/ca.pem" for a console
#                         whose certificate a private CA signed
#   SUANLI_JOIN_RENEW=1   a join again renews the engine's certificate and restarts the
#                         engine (its containers stop: drain first). Without it, a join
#                         again leaves a running engine and its certificate as they are,
#                         unless that certificate ends within 30 days
set -eu

# The console's URL: the console writes its own here when it serves this script.
SUANLI_CONSOLE="${SUANLI_CONSOLE:-}"

ROOT="${SUANLI_JOIN_ROOT:-}"
ROOT="${ROOT%/}"
ETC="$ROOT/etc/suanli"
TLS="$ROOT/etc/docker/suanli"
CREDENTIAL="$ETC/host.credential"
SOCKET="${SUANLI_JOIN_SOCKET:-/var/run/docker.sock}"
WAIT="${SUANLI_JOIN_WAIT:-300}"
ENGINE_PORT=2376
RENEW_DAYS=30
STEP=preflight
TOKEN=""
CMD=join
WORK=""

say() { printf 'join.sh: %s\n' "$*" >&2; }

# fail WHY: print which step failed and why, tell the console (best effort), stop.
fail() {
    say "step $STEP failed: $*"
    if [ -n "$SUANLI_CONSOLE" ] && command -v curl >/dev/null 2>&1; then
        if [ -s "$CREDENTIAL.new" ]; then
            report credential "$(cat "$CREDENTIAL.new")" "$*"
        elif [ -s "$CREDENTIAL" ] && { [ "$CMD" = leave ] || [ "$STEP" = check ]; }; then
            report credential "$(cat "$CREDENTIAL")" "$*"
        elif [ -n "$TOKEN" ]; then
            report token "$TOKEN" "$*"
        fi
    fi
    exit 1
}

report() { # report token|credential SECRET WHY
    json "$1" "$2" step report failed_step "$STEP" error "$3" |
        post "$WORK/report.json" >/dev/null 2>&1 || true
}

step() {
    STEP="$1"
    shift
    say "[$STEP] $*"
}

cleanup() { [ -n "$WORK" ] && rm -rf "$WORK"; }

# -- JSON, both ways, without jq or Python -------------------------------------------

# jstr: stdin as the inside of a JSON string.
jstr() {
    tr -d '\000-\010\013-\037' | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' -e 's/\t/\\t/g' |
        awk 'BEGIN { ORS = "" } { if (NR > 1) printf "\\n"; printf "%s", $0 }'
}

# json KEY VALUE ...: one JSON object of strings.
json() {
    printf '{'
    sep=""
    while [ $# -ge 2 ]; do
        printf '%s"%s": "%s"' "$sep" "$1" "$(printf '%s' "$2" | jstr)"
        sep=", "
        shift 2
    done
    printf '}\n'
}

# jget KEY FILE: a string of the console's answer (a flat object, one key a line).
jget() {
    sed -n "s/^\"$1\": \"\\(.*\\)\",\\{0,1\\}\$/\\1/p" "$2" | head -n 1 |
        sed -e 's/\\\\/\x01/g' -e 's/\\"/"/g' -e 's/\\t/\t/g' -e 's/\\n/\n/g' -e 's/\x01/\\/g' |
        sed -e 's/\\u00\([0-9a-fA-F][0-9a-fA-F]\)/?/g'
}

# post OUT [PATH]: POST stdin (JSON) to the console; the answer in OUT, the HTTP status
# on stdout ("000" when the console did not answer).
post() {
    # shellcheck disable=SC2086 # SUANLI_JOIN_CURL is words on purpose
    curl -sS ${SUANLI_JOIN_CURL:-} --max-time 600 -o "$1" -w '%{http_code}' \
        -H 'Content-Type: application/json' --data-binary @- \
        "$SUANLI_CONSOLE${2:-/hosts/join/}" 2>"$1.err" || true
}

# ask OUT KEY VALUE ...: POST a JSON object; fail with the console's own words unless 200.
ask() {
    out="$1"
    shift
    code="$(json "$@" | post "$out")"
    case "$code" in
    200) return 0 ;;
    000) fail "the console at $SUANLI_CONSOLE did not answer: $(cat "$out.err" 2>/dev/null)" ;;
    *) fail "the console answered $code: $(jget error "$out" || true)" ;;
    esac
}

docker_() { docker -H "unix://$SOCKET" "$@"; }

need_package() { # need_package COMMAND PACKAGE
    command -v "$1" >/dev/null 2>&1 && return 0
    if [ "${SUANLI_JOIN_NO_APT:-}" = 1 ]; then
        fail "$1 is not installed (Debian package $2) and SUANLI_JOIN_NO_APT=1"
    fi
    command -v apt-get >/dev/null 2>&1 || fail "$1 is not installed and there is no apt-get: install $2"
    say "installing $2 (apt)"
    DEBIAN_FRONTEND=noninteractive apt-get update -q >"$WORK/apt.log" 2>&1 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$2" >>"$WORK/apt.log" 2>&1 ||
        fail "apt-get install $2 failed: $(tail -n 3 "$WORK/apt.log" | tr '\n' ' ')"
    command -v "$1" >/dev/null 2>&1 || fail "$2 is installed but $1 is still missing"
}

# -- the steps -----------------------------------------------------------------------

preflight() {
    step preflight "checking this host and the console"
    [ "$(id -u)" = 0 ] || fail "run it as root (sudo sh join.sh ...)"
    rm -f "$CREDENTIAL.new" # an earlier join's that did not finish: this one reports alone
    command -v curl >/dev/null 2>&1 || fail "curl is not installed (apt-get install curl)"
    [ -n "$SUANLI_CONSOLE" ] || fail "which console? run it with --console https://CONSOLE, or set SUANLI_CONSOLE"
    case "$SUANLI_CONSOLE" in http://* | https://*) ;; *) fail "the console's URL must start with https:// (or http://)" ;; esac
    SUANLI_CONSOLE="${SUANLI_CONSOLE%/}"
    # shellcheck disable=SC2086
    curl -fsS ${SUANLI_JOIN_CURL:-} --max-time 30 -o "$WORK/firewall.sh" \
        "$SUANLI_CONSOLE/hosts/host-firewall.sh" 2>"$WORK/curl.err" ||
        fail "the console at $SUANLI_CONSOLE did not answer: $(cat "$WORK/curl.err")"
    NAME="${SUANLI_JOIN_NAME:-$(hostname -s 2>/dev/null || hostname)}"
    NAME="$(printf '%s' "$NAME" | tr 'A-Z' 'a-z')"
    ADDRESS="${SUANLI_JOIN_ADDRESS:-}"
    if [ -z "$ADDRESS" ]; then
        where="${SUANLI_CONSOLE#*://}"
        where="${where%%/*}"
        case "$where" in \[*) where="${where#[}"; where="${where%%]*}" ;; *) where="${where%:*}" ;; esac
        ip_of="$(getent ahosts "$where" 2>/dev/null | awk '{ print $1; exit }')"
        ADDRESS="$(ip route get "${ip_of:-$where}" 2>/dev/null | sed -n 's/.* src \([^ ]*\).*/\1/p' | head -n 1)"
        case "$ADDRESS" in
        "" | 127.* | ::1) fail "could not tell this host's address on the hosts' network from its route to the console: set SUANLI_JOIN_ADDRESS" ;;
        esac
    fi
    say "this host: $NAME at $ADDRESS; console $SUANLI_CONSOLE"
}

engine() {
    step engine "checking Docker's engine"
    need_package dockerd docker.io
    need_package docker docker.io
}

gpus() {
    step gpus "looking for NVIDIA GPUs"
    GPU_COUNT=0
    GPU_NAME=""
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=name --format=csv,noheader >"$WORK/gpus" 2>"$WORK/gpus.err" ||
            fail "nvidia-smi is there but does not answer (is the driver loaded?): $(head -c 300 "$WORK/gpus.err")"
        GPU_COUNT="$(grep -c . "$WORK/gpus" || true)"
        GPU_NAME="$(head -n 1 "$WORK/gpus")"
        say "$GPU_COUNT x $GPU_NAME"
    else
        say "no nvidia-smi: no NVIDIA GPUs (the token's GPUs, if any, are emulated)"
    fi
}

tls() {
    step tls "making the engine's key and signing request"
    need_package openssl openssl
    mkdir -p "$TLS" "$ETC"
    chmod 0700 "$TLS" "$ETC"
    # The engine's key is kept across joins (a join again need not restart the engine).
    if [ -s "$TLS/key.pem" ] && openssl pkey -in "$TLS/key.pem" -noout 2>/dev/null; then
        cp "$TLS/key.pem" "$WORK/key.pem"
    else
        (umask 077 && openssl ecparam -name prime256v1 -genkey -noout -out "$WORK/key.pem" 2>"$WORK/openssl.err") ||
            fail "openssl could not make a key: $(cat "$WORK/openssl.err")"
    fi
    openssl req -new -key "$WORK/key.pem" -subj "/CN=$NAME" -out "$WORK/csr.pem" 2>"$WORK/openssl.err" ||
        fail "openssl could not make a signing request: $(cat "$WORK/openssl.err")"
}

sign() {
    step sign "asking the console to sign it"
    ask "$WORK/begin.json" step begin token "$TOKEN" name "$NAME" address "$ADDRESS" \
        csr "$(cat "$WORK/csr.pem")"
    (umask 077 && jget credential "$WORK/begin.json" >"$CREDENTIAL.new")
    jget cert "$WORK/begin.json" >"$WORK/cert.pem"
    jget ca "$WORK/begin.json" >"$WORK/ca.pem"
    openssl x509 -in "$WORK/cert.pem" -noout 2>/dev/null || fail "the console's answer holds no certificate"
    SWARM_MANAGER="$(jget swarm_manager "$WORK/begin.json")"
    SWARM_TOKEN="$(jget swarm_token "$WORK/begin.json")"
    STORAGE_MASTER="$(jget storage_master "$WORK/begin.json")"
    STORAGE_PORT="$(jget storage_port "$WORK/begin.json")"
    STORAGE_PATH="$(jget storage_path "$WORK/begin.json")"
    IMAGES="$(jget images "$WORK/begin.json")"
    say "signed for $ADDRESS"
}

dockerd_args() { # the engine's arguments: TCP with TLS (unless "local"), its socket
    if [ "${1:-}" = local ]; then
        printf '%s' "-H unix://$SOCKET"
        return
    fi
    printf '%s' "-H unix://$SOCKET -H tcp://$ADDRESS:$ENGINE_PORT --tlsverify --tlscacert=$TLS/ca.pem --tlscert=$TLS/cert.pem --tlskey=$TLS/key.pem"
}

# restart_dockerd [local]: start the engine again with its arguments, wait for its socket.
restart_dockerd() {
    SUANLI_DOCKERD_ARGS="$(dockerd_args "${1:-}")"
    export SUANLI_DOCKERD_ARGS
    if [ -n "${SUANLI_JOIN_DOCKERD:-}" ]; then
        sh -c "$SUANLI_JOIN_DOCKERD" >"$WORK/dockerd.out" 2>&1 ||
            fail "SUANLI_JOIN_DOCKERD failed: $(tail -n 5 "$WORK/dockerd.out" | tr '\n' ' ')"
    elif [ -d /run/systemd/system ]; then
        dropin="$ROOT/etc/systemd/system/docker.service.d"
        mkdir -p "$dropin"
        if [ "${1:-}" = local ]; then
            rm -f "$dropin/suanli.conf"
        else
            # Debian's unit, plus the TCP socket with TLS: fd:// (docker.socket holds the
            # local socket) and $DOCKER_OPTS (/etc/default/docker) as Debian starts it.
            cat >"$dropin/suanli.conf" <<EOF
# Written by Suanli's join.sh: the engine listens for the console with TLS.
[Service]
ExecStart=
ExecStart=$(command -v dockerd) -H fd:// \$DOCKER_OPTS -H tcp://$ADDRESS:$ENGINE_PORT --tlsverify --tlscacert=$TLS/ca.pem --tlscert=$TLS/cert.pem --tlskey=$TLS/key.pem
EOF
        fi
        systemctl daemon-reload && systemctl enable docker >/dev/null 2>&1 &&
            systemctl restart docker 2>"$WORK/systemctl.err" ||
            fail "systemctl restart docker failed: $(cat "$WORK/systemctl.err"; journalctl -u docker -n 5 --no-pager 2>/dev/null)"
    else
        fail "no systemd here to restart dockerd with: set SUANLI_JOIN_DOCKERD to a command that does (the arguments are in \$SUANLI_DOCKERD_ARGS)"
    fi
    i=0
    until docker_ info >/dev/null 2>&1; do
        i=$((i + 1))
        [ "$i" -le 120 ] || fail "the engine did not answer on $SOCKET within 60 s after its restart"
        sleep 0.5
    done
}

configure_dockerd() {
    step dockerd "the engine listens on tcp://$ADDRESS:$ENGINE_PORT with TLS"
    conf="$ROOT/etc/docker/daemon.json"
    if [ -f "$conf" ] && grep -Eq '"(hosts|tls|tlsverify|tlscacert|tlscert|tlskey)"' "$conf"; then
        fail "$conf sets hosts or TLS options, which join.sh sets as the engine's flags: remove them from it"
    fi
    # A running engine with the same key, CA and arguments is left running (a join again
    # must not stop the containers on it), and so is the certificate it loaded when it
    # started (dockerd reads it only then): cert.pem stays what the engine serves. The new
    # one replaces it, and the engine restarts (stopping its containers), when the old one
    # ends within $RENEW_DAYS days, or with SUANLI_JOIN_RENEW=1.
    same=no
    if cmp -s "$WORK/key.pem" "$TLS/key.pem" && cmp -s "$WORK/ca.pem" "$TLS/ca.pem" &&
        [ "$(cat "$ETC/dockerd.args" 2>/dev/null || true)" = "$(dockerd_args)" ] &&
        docker_ info >/dev/null 2>&1; then
        if [ "${SUANLI_JOIN_RENEW:-}" = 1 ]; then
            say "SUANLI_JOIN_RENEW=1: the engine's certificate is renewed; the engine restarts (its containers stop)"
        elif ! openssl x509 -in "$TLS/cert.pem" -noout -checkend $((RENEW_DAYS * 86400)) >/dev/null 2>&1; then
            say "the engine's certificate ends within $RENEW_DAYS days (or is unreadable): renewed; the engine restarts (its containers stop)"
        else
            same=yes
        fi
    fi
    if [ "$same" = yes ]; then
        # Only the certificate the running engine loaded: the new one is its twin.
        cp "$TLS/cert.pem" "$WORK/cert.pem" || fail "could not read $TLS/cert.pem"
    fi
    # The certificate and key in place before the engine that uses them starts again.
    cp "$WORK/ca.pem" "$TLS/ca.pem.new" && cp "$WORK/cert.pem" "$TLS/cert.pem.new" &&
        cp "$WORK/key.pem" "$TLS/key.pem.new" || fail "could not write $TLS"
    chmod 0600 "$TLS/key.pem.new"
    for f in ca cert key; do mv -f "$TLS/$f.pem.new" "$TLS/$f.pem"; done
    if [ "$same" = yes ]; then
        say "the engine already listens so: left running, with its certificate ($(openssl x509 -in "$TLS/cert.pem" -noout -enddate 2>/dev/null | sed 's/^notAfter=/valid until /')); SUANLI_JOIN_RENEW=1 renews it now"
    else
        restart_dockerd
        dockerd_args >"$ETC/dockerd.args"
    fi
    if [ "$GPU_COUNT" -gt 0 ]; then
        docker_ info --format '{{json .Runtimes}}' | grep -q '"nvidia"' ||
            fail "$GPU_COUNT GPUs but the engine has no nvidia runtime: install nvidia-container-toolkit, run nvidia-ctk runtime configure --runtime=docker, then join again"
    fi
}

firewall() {
    step firewall "the tenant firewall"
    cp "$WORK/firewall.sh" "$ETC/host-firewall.sh"
    chmod 0755 "$ETC/host-firewall.sh"
    sh "$ETC/host-firewall.sh" apply >"$WORK/firewall.out" 2>&1 ||
        fail "host-firewall.sh apply failed: $(tail -n 5 "$WORK/firewall.out" | tr '\n' ' ')"
    sh "$ETC/host-firewall.sh" check >/dev/null 2>&1 || fail "the firewall's rules are not in place after apply"
    unit="$ROOT/etc/systemd/system/suanli-firewall.service"
    mkdir -p "$(dirname "$unit")"
    cat >"$unit" <<EOF
# Written by Suanli's join.sh: the tenant firewall, again after every start of the engine.
[Unit]
Description=Suanli tenant firewall
After=docker.service
PartOf=docker.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh $ETC/host-firewall.sh apply

[Install]
WantedBy=docker.service
EOF
    if [ -d /run/systemd/system ] && [ -z "$ROOT" ]; then
        systemctl daemon-reload && systemctl enable suanli-firewall.service >/dev/null 2>&1 ||
            fail "systemctl enable suanli-firewall.service failed"
    else
        say "no systemd here: $unit is written; apply $ETC/host-firewall.sh after each engine start yourself"
    fi
}

swarm() {
    step swarm "the fleet's Docker swarm"
    if [ -z "$SWARM_MANAGER" ]; then
        say "the fleet has no swarm manager that answers: this host takes clusters whose nodes all fit on it"
        return 0
    fi
    state="$(docker_ info --format '{{.Swarm.LocalNodeState}}' 2>/dev/null || true)"
    if [ "$state" = active ]; then
        managers="$(docker_ info --format '{{range .Swarm.RemoteManagers}}{{.Addr}} {{end}}')"
        case " $managers " in
        *" $SWARM_MANAGER "*) say "already in the fleet's swarm"; return 0 ;;
        esac
        fail "the engine is in another swarm (managers: $managers): run docker swarm leave, then join again"
    fi
    docker_ swarm join --token "$SWARM_TOKEN" --advertise-addr "$ADDRESS" \
        --listen-addr "$ADDRESS:2377" "$SWARM_MANAGER" >"$WORK/swarm.out" 2>&1 ||
        fail "docker swarm join $SWARM_MANAGER failed: $(tr '\n' ' ' <"$WORK/swarm.out")"
}

mounted_at() { awk -v m="$1" '$2 == m && $3 ~ /^fuse/ { f = 1 } END { exit !f }' /proc/self/mounts; }

storage() {
    step storage "the researchers' filesystem"
    if [ -z "$STORAGE_MASTER" ]; then
        say "the console keeps researchers' files on its own machine: nothing to mount"
        return 0
    fi
    need_package mfsmount moosefs-client
    if mounted_at "$STORAGE_PATH"; then
        say "MooseFS is mounted at $STORAGE_PATH already"
    else
        mkdir -p "$STORAGE_PATH"
        mfsmount "$STORAGE_PATH" -H "$STORAGE_MASTER" -P "$STORAGE_PORT" -o mfsioretries=5 \
            >"$WORK/mfs.out" 2>&1 || fail "mfsmount $STORAGE_MASTER:$STORAGE_PORT on $STORAGE_PATH failed: $(tr '\n' ' ' <"$WORK/mfs.out")"
        mounted_at "$STORAGE_PATH" || fail "mfsmount answered, yet nothing is mounted at $STORAGE_PATH"
    fi
    fstab="$ROOT/etc/fstab"
    mkdir -p "$(dirname "$fstab")"
    touch "$fstab"
    awk -v m="$STORAGE_PATH" '!($1 == "mfsmount" && $2 == m)' "$fstab" >"$fstab.new"
    printf 'mfsmount %s fuse mfsmaster=%s,mfsport=%s,mfsioretries=5,_netdev,nofail 0 0\n' \
        "$STORAGE_PATH" "$STORAGE_MASTER" "$STORAGE_PORT" >>"$fstab.new"
    mv -f "$fstab.new" "$fstab"
}

images() {
    step images "the helper images"
    for image in $IMAGES; do
        if docker_ image inspect "$image" >/dev/null 2>&1; then
            say "$image is here"
            continue
        fi
        code="$(json credential "$(cat "$CREDENTIAL.new")" image "$image" |
            post "$WORK/image.tar" /hosts/join/image/)"
        [ "$code" = 200 ] || fail "the console gave no $image ($code): $(jget error "$WORK/image.tar" || true)"
        docker_ load -i "$WORK/image.tar" >"$WORK/load.out" 2>&1 ||
            fail "docker load of $image failed: $(tr '\n' ' ' <"$WORK/load.out")"
        rm -f "$WORK/image.tar"
        say "$image loaded"
    done
}

register() {
    step register "registering the host"
    ask "$WORK/register.json" step register credential "$(cat "$CREDENTIAL.new")" \
        gpu_count "$GPU_COUNT" gpu_name "$GPU_NAME"
    mv -f "$CREDENTIAL.new" "$CREDENTIAL"
    say "registered as $(jget name "$WORK/register.json") ($(jget engine "$WORK/register.json"))"
}

check() {
    step check "waiting for the console's check"
    i=0
    while :; do
        ask "$WORK/status.json" step status credential "$(cat "$CREDENTIAL")"
        if [ "$(jget checked "$WORK/status.json")" = yes ]; then
            state="$(jget state "$WORK/status.json")"
            case "$state" in
            active | draining)
                say "joined: $NAME is $state"
                return 0
                ;;
            esac
            say "registered, but the console's check found it $state: $(jget error "$WORK/status.json")"
            say "fix that and use Check now on the Hosts page (or run join.sh again with a new token)"
            exit 1
        fi
        i=$((i + 2))
        if [ "$i" -ge "$WAIT" ]; then
            say "registered; the console has not checked it within ${WAIT}s (are its workers running?): see the Hosts page"
            exit 0
        fi
        sleep 2
    done
}

# -- leave ---------------------------------------------------------------------------

leave() {
    step leave "asking the console to drain this host"
    preflight_leave
    if [ -n "$TOKEN" ]; then
        ask "$WORK/leave.json" step leave token "$TOKEN" name "$NAME"
    elif [ -s "$CREDENTIAL" ]; then
        ask "$WORK/leave.json" step leave credential "$(cat "$CREDENTIAL")"
    else
        fail "no $CREDENTIAL here (did this host join?): run leave with a token from Hosts -> Add"
    fi
    (umask 077 && jget credential "$WORK/leave.json" >"$CREDENTIAL")
    step drain "waiting for the host's clusters to end (up to ${WAIT}s)"
    i=0
    while :; do
        ask "$WORK/progress.json" step leave-status credential "$(cat "$CREDENTIAL")"
        [ "$(jget empty "$WORK/progress.json")" = yes ] && break
        i=$((i + 5))
        if [ "$i" -ge "$WAIT" ]; then
            fail "$(jget nodes "$WORK/progress.json") nodes still run here ($(jget clusters "$WORK/progress.json")): the host is drained and takes no new clusters; run leave again once they ended"
        fi
        sleep 5
    done
    step swarm-leave "leaving the swarm"
    if [ "$(docker_ info --format '{{.Swarm.LocalNodeState}}' 2>/dev/null || true)" = active ]; then
        [ "$(docker_ info --format '{{.Swarm.ControlAvailable}}')" != true ] ||
            fail "this host is a swarm manager: promote another host and demote this one (docker node demote) first"
        docker_ swarm leave >"$WORK/swarm.out" 2>&1 || fail "docker swarm leave failed: $(tr '\n' ' ' <"$WORK/swarm.out")"
    fi
    step left "the console removes the host"
    ask "$WORK/left.json" step left credential "$(cat "$CREDENTIAL")"
    note="$(jget note "$WORK/left.json")"
    [ -z "$note" ] || say "$note"
    rm -f "$CREDENTIAL"
    # Nothing of the fleet's stays: its filesystem, and the engine's TCP listener.
    if [ -n "$STORAGE_PATH" ] && mounted_at "$STORAGE_PATH"; then
        umount "$STORAGE_PATH" 2>/dev/null || umount -l "$STORAGE_PATH" || say "could not unmount $STORAGE_PATH"
    fi
    if [ -f "$ROOT/etc/fstab" ]; then
        awk '$1 != "mfsmount"' "$ROOT/etc/fstab" >"$ROOT/etc/fstab.new" && mv -f "$ROOT/etc/fstab.new" "$ROOT/etc/fstab"
    fi
    restart_dockerd local
    dockerd_args local >"$ETC/dockerd.args"
    say "left the fleet: the engine listens on its local socket only"
}

preflight_leave() {
    [ "$(id -u)" = 0 ] || fail "run it as root (sudo sh join.sh leave)"
    [ -n "$SUANLI_CONSOLE" ] || fail "which console? run it with --console https://CONSOLE, or set SUANLI_CONSOLE"
    SUANLI_CONSOLE="${SUANLI_CONSOLE%/}"
    NAME="${SUANLI_JOIN_NAME:-$(hostname -s 2>/dev/null || hostname)}"
    NAME="$(printf '%s' "$NAME" | tr 'A-Z' 'a-z')"
    ADDRESS=""
    STORAGE_PATH="$(awk '$1 == "mfsmount" { print $2; exit }' "$ROOT/etc/fstab" 2>/dev/null || true)"
}

# -- main ----------------------------------------------------------------------------

while [ $# -gt 0 ]; do
    case "$1" in
    --console) [ $# -ge 2 ] || { say "--console needs a URL"; exit 2; }; SUANLI_CONSOLE="$2"; shift 2 ;;
    --console=*) SUANLI_CONSOLE="${1#--console=}"; shift ;;
    join | leave) CMD="$1"; shift ;;
    -h | --help) sed -n '2,/^set -eu/p' "$0" 2>/dev/null | sed 's/^# \{0,1\}//' >&2; exit 0 ;;
    -*) say "unknown option $1 (see the top of the script)"; exit 2 ;;
    *) TOKEN="$1"; shift ;;
    esac
done
WORK="$(mktemp -d "${TMPDIR:-/tmp}/suanli-join.XXXXXX")"
trap cleanup EXIT

if [ "$CMD" = leave ]; then
    leave
    exit 0
fi
[ -n "$TOKEN" ] || { say "usage: join.sh [--console URL] TOKEN | join.sh leave [TOKEN] (the token: console, Hosts -> Add)"; exit 2; }
preflight
engine
gpus
tls
sign
configure_dockerd
firewall
swarm
storage
images
register
check

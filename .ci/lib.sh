# shellcheck shell=bash
# Shared helpers for .ci/services.sh (test suite) and .ci/dev-services.sh
# (`make run`). Sourced, never executed: it only defines functions and a few
# constants, so sourcing it has no side effects.
#
# Convention used by every helper: progress goes to stderr, so that callers can
# keep stdout clean for `export` lines (`eval "$(.ci/services.sh start)"`).

CI_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck disable=SC2034  # used by the scripts that source this file
REPO_ROOT="$(cd "$CI_DIR/.." && pwd)"

SUANLI_IMAGE="${SUANLI_IMAGE:-suanli/busybox:latest}"
# The static busybox from busybox-static. /bin/busybox is also what the
# dynamically linked `busybox` package installs, so we verify it is static
# before copying it into a rootfs that has no libc.
BUSYBOX_BIN="${BUSYBOX_BIN:-/bin/busybox}"
# Any docker client works: /usr/local/bin/docker or docker.io's /usr/bin/docker.
# API version negotiation takes care of client/daemon version differences.
DOCKER_CLI="${DOCKER_CLI:-docker}"

# Microseconds since the epoch without forking (bash >= 5).
_usec() { local t="${EPOCHREALTIME/./}"; printf '%s' "${t:-$(date +%s%6N)}"; }
_CI_T0="$(_usec)"
# Log lines carry the time since the script started, so slow steps show up
# in CI logs without extra tooling.
_elapsed() { local d=$((($(_usec) - _CI_T0) / 100000)); printf '%d.%ds' $((d / 10)) $((d % 10)); }
log() { printf '[%s %s] %s\n' "${LOG_TAG:-ci}" "$(_elapsed)" "$*" >&2; }
warn() { printf '[%s %s] WARNING: %s\n' "${LOG_TAG:-ci}" "$(_elapsed)" "$*" >&2; }
die() { printf '[%s] ERROR: %s\n' "${LOG_TAG:-ci}" "$*" >&2; exit 1; }

is_root() { [[ "$(id -u)" -eq 0 ]]; }

# wait_until SECONDS DESCRIPTION CMD...: poll CMD every 0.25 s until it
# succeeds. Returns 1 (does not exit) on timeout so callers can print context
# such as a log tail before dying.
wait_until() {
    local timeout="$1" what="$2"
    shift 2
    local deadline=$((SECONDS + timeout))
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            warn "timed out after ${timeout}s waiting for $what"
            return 1
        fi
        sleep 0.25
    done
}

# proc_alive PID: running and not a zombie. Zombies count as dead: where PID 1
# does not reap orphans (some sandboxes/VMs) an exited daemon stays a zombie
# forever and `kill -0` alone would still report it alive.
proc_alive() {
    local stat state
    kill -0 "$1" 2>/dev/null || return 1
    stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
    # Field 3, after "(comm)" which may itself contain spaces.
    state="${stat##*) }"
    state="${state%% *}"
    [[ -n "$state" && "$state" != Z ]]
}

# pid_from_file FILE: print the pid in FILE if that process is alive.
pid_from_file() {
    local f="$1" pid
    [[ -s "$f" ]] || return 1
    pid="$(tr -dc '0-9' <"$f")"
    [[ -n "$pid" ]] && proc_alive "$pid" || return 1
    printf '%s\n' "$pid"
}

# pids_with_arg STRING: pids of processes whose command line contains STRING.
# Used to find the containerd (and shims) a given dockerd spawned: they carry
# that engine's private exec-root path in their arguments, so matching on the
# path only ever hits processes belonging to that engine.
pids_with_arg() {
    local f
    # One grep over all cmdlines (NUL-separated, hence -a) instead of a fork
    # per process; processes that exit meanwhile are silently skipped.
    while IFS= read -r f; do
        f="${f#/proc/}"
        f="${f%/cmdline}"
        [[ "$f" != "$$" && "$f" != "$BASHPID" ]] && printf '%s\n' "$f"
    done < <(grep -alF -- "$1" /proc/[0-9]*/cmdline 2>/dev/null || true)
}

# kill_and_wait SECONDS PID...: SIGTERM, wait, then SIGKILL what is left.
kill_and_wait() {
    local timeout="$1"
    shift
    local pids=("$@") alive p deadline=$((SECONDS + timeout))
    ((${#pids[@]})) || return 0
    kill -TERM "${pids[@]}" 2>/dev/null || true
    while :; do
        alive=()
        for p in "${pids[@]}"; do proc_alive "$p" && alive+=("$p"); done
        ((${#alive[@]})) || return 0
        if ((SECONDS >= deadline)); then
            warn "pid(s) ${alive[*]} ignored SIGTERM for ${timeout}s; sending SIGKILL"
            kill -KILL "${alive[@]}" 2>/dev/null || true
            sleep 0.5
            return 0
        fi
        sleep 0.25
    done
}

# write_env FILE NAME=VALUE...: print `export` lines on stdout and also save
# them to FILE so other shells / Make can `source` them later.
write_env() {
    local file="$1" kv out=""
    shift
    local name value
    for kv in "$@"; do
        name="${kv%%=*}" value="${kv#*=}"
        # Plain values stay unquoted (friendlier for dotenv readers and
        # `include` in make); anything else is single-quoted for the shell.
        if [[ ! "$value" =~ ^[A-Za-z0-9_./:@,=+%-]*$ ]]; then
            value="'${value//\'/\'\\\'\'}'"
        fi
        out+="export $name=$value"$'\n'
    done
    mkdir -p "$(dirname "$file")"
    printf '%s' "$out" >"$file.tmp" && mv -f "$file.tmp" "$file"
    printf '%s' "$out"
}

# ------------------------------------------------------------- secrets ----

# secret_file FILE hex|fernet: print FILE's secret, generating it once (mode 0600): 24
# random bytes as hex (a Redis password), or a Fernet key (32 random bytes, URL-safe
# base64) for the secrets the console keeps at rest.
secret_file() {
    local file="$1" kind="$2"
    if [[ ! -s "$file" ]]; then
        mkdir -p "$(dirname "$file")"
        if [[ "$kind" == fernet ]]; then
            (umask 077 && head -c 32 /dev/urandom | base64 | tr '+/' '-_' >"$file")
        else
            (umask 077 && head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$file")
        fi
    fi
    cat "$file"
}

# ---------------------------------------------------------------- redis ----

# redis_up PORT: true when something answers PING on 127.0.0.1:PORT (with the
# password in REDIS_PASSWORD, when the caller set one).
redis_up() { [[ "$(REDISCLI_AUTH="${REDIS_PASSWORD:-}" redis-cli --no-auth-warning -h 127.0.0.1 -p "$1" ping 2>/dev/null)" == "PONG" ]]; }

# start_redis PORT DIR EXTRA_ARGS...: daemonized redis with its dir, pidfile
# and log inside DIR. No-op when a redis already answers on PORT.
start_redis() {
    local port="$1" dir="$2"
    shift 2
    if redis_up "$port"; then
        log "redis already answering on 127.0.0.1:$port"
        return 0
    fi
    command -v redis-server >/dev/null || die "redis-server not installed (run .ci/install.sh redis-server)"
    mkdir -p "$dir"
    log "starting redis on 127.0.0.1:$port (dir $dir)"
    redis-server --port "$port" --bind 127.0.0.1 --daemonize yes \
        --dir "$dir" --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" "$@" \
        || die "redis-server failed to start; see $dir/redis.log"
    if ! wait_until 20 "redis PONG on port $port" redis_up "$port"; then
        tail -n 20 "$dir/redis.log" >&2 || true
        die "redis did not come up"
    fi
}

# stop_redis PORT DIR: stop the redis whose pidfile is in DIR (i.e. only one we
# started). Never touches a redis that merely happens to use the same port.
stop_redis() {
    local port="$1" dir="$2" pid
    if ! pid="$(pid_from_file "$dir/redis.pid")"; then
        log "redis (port $port): not running from $dir, nothing to stop"
        rm -f "$dir/redis.pid"
        return 0
    fi
    log "stopping redis pid $pid (port $port)"
    REDISCLI_AUTH="${REDIS_PASSWORD:-}" redis-cli --no-auth-warning -h 127.0.0.1 -p "$port" shutdown nosave >/dev/null 2>&1 || true
    kill_and_wait 10 "$pid"
    rm -f "$dir/redis.pid"
}

# --------------------------------------------------------------- docker ----

# docker_up HOST: true when the engine at HOST (unix://...) answers.
docker_up() { "$DOCKER_CLI" -H "$1" info >/dev/null 2>&1; }

# start_dockerd HOST STATE_DIR LOG PIDFILE ARGS...: start dockerd in the
# background, detached (setsid + nohup) so it outlives this script, and wait
# up to 60 s for HOST to answer. If it dies and the log blames iptables (common
# in containers/VMs without netfilter), retry once with --iptables=false and
# leave a marker file STATE_DIR/iptables-disabled so the reason is visible.
start_dockerd() {
    local host="$1" state="$2" logf="$3" pidfile="$4"
    shift 4
    local args=("$@") attempt pid
    command -v dockerd >/dev/null || die "dockerd not installed (run .ci/install.sh docker.io)"
    mkdir -p "$state" "$(dirname "$logf")"
    rm -f "$state/iptables-disabled"
    for attempt in normal no-iptables; do
        if [[ "$attempt" == no-iptables ]]; then
            args+=(--iptables=false)
            echo "dockerd failed with iptables enabled; restarted with --iptables=false" >"$state/iptables-disabled"
            warn "dockerd for $host failed because of iptables; retrying with --iptables=false"
        fi
        printf '\n===== %s starting dockerd %s\n' "$(date -Is)" "${args[*]}" >>"$logf"
        # stdin from /dev/null and its own session: no SIGHUP/SIGINT from our
        # terminal or from make reaches it after we exit.
        # DOCKERD_NETNS: run it in that network namespace (a test host of its own).
        # nsenter, not `ip netns exec`: the latter remounts /sys and dockerd then fails
        # with "Devices cgroup isn't mounted".
        # DOCKERD_MNTNS: and in that mount namespace (a file made by ensure_mount_ns), where
        # the host's own mounts (its researchers' filesystem) are.
        local prefix=()
        if [[ -n "${DOCKERD_NETNS:-}${DOCKERD_MNTNS:-}" ]]; then
            prefix=(nsenter)
            [[ -n "${DOCKERD_NETNS:-}" ]] && prefix+=("--net=/var/run/netns/$DOCKERD_NETNS")
            [[ -n "${DOCKERD_MNTNS:-}" ]] && prefix+=("--mount=$DOCKERD_MNTNS")
        fi
        setsid nohup "${prefix[@]}" dockerd --pidfile "$pidfile" "${args[@]}" </dev/null >>"$logf" 2>&1 &
        pid=$!
        local deadline=$((SECONDS + 60))
        while ! docker_up "$host"; do
            if ! proc_alive "$pid"; then
                break
            fi
            if ((SECONDS >= deadline)); then
                warn "dockerd (pid $pid) did not answer on $host within 60s; last log lines:"
                tail -n 30 "$logf" >&2 || true
                kill_and_wait 10 "$pid"
                exit 1
            fi
            sleep 0.5
        done
        if docker_up "$host"; then
            if [[ "$attempt" == normal ]]; then
                log "dockerd up on $host (pid $pid)"
            else
                log "dockerd up on $host (pid $pid, iptables DISABLED, see $state/iptables-disabled)"
            fi
            return 0
        fi
        # Process exited. Only an iptables problem is worth a second try.
        if [[ "$attempt" == normal ]] &&
            tail -n 40 "$logf" | grep -qiE 'iptables|nf_tables|netfilter|xtables'; then
            continue
        fi
        warn "dockerd exited before answering on $host; last log lines:"
        tail -n 30 "$logf" >&2 || true
        exit 1
    done
}

# mount_btrfs_root IMAGE DIR SIZE: DIR becomes a btrfs filesystem on the sparse file
# IMAGE (SIZE, e.g. 40G; blocks are taken only as they are written), mounted through a
# loop device, with quotas on: the engine's btrfs storage driver then enforces
# `--storage-opt size=` (a container's root filesystem limit, jobs/nodes/runtime.py). The file
# stays between runs, so the engine's image cache does too. A no-op when DIR is mounted.
# A DIR left from an earlier overlay2 engine is emptied first (its images come back
# from the tars in a second).
mount_btrfs_root() {
    local image="$1" dir="$2" size="$3"
    command -v mkfs.btrfs >/dev/null || die "mkfs.btrfs not installed (run .ci/install.sh btrfs-progs)"
    if mountpoint -q "$dir"; then
        return 0
    fi
    grep -qw btrfs /proc/filesystems || modprobe btrfs 2>/dev/null || grep -qw btrfs /proc/filesystems ||
        die "this kernel has no btrfs (the test engines' data roots are btrfs on a loop file)"
    [[ -e /dev/loop-control ]] || die "no loop devices here (/dev/loop-control): the test engines' data roots are btrfs on a loop file"
    if [[ ! -s "$image" ]]; then
        log "making a btrfs filesystem of $size on $image (sparse)"
        mkdir -p "$(dirname "$image")"
        truncate -s "$size" "$image"
        mkfs.btrfs -q "$image" >&2 || die "mkfs.btrfs $image failed"
    fi
    if [[ -d "$dir" ]] && [[ -n "$(ls -A "$dir" 2>/dev/null)" ]]; then
        log "removing the old data root $dir (not btrfs)"
        rm -rf "$dir"
    fi
    mkdir -p "$dir"
    # -o loop: the loop device is made here and freed by the kernel at unmount (autoclear).
    mount -t btrfs -o loop "$image" "$dir" || die "could not mount $image on $dir"
    btrfs quota enable "$dir" >&2 || die "btrfs quota enable $dir failed"
}

# unmount_btrfs_root IMAGE DIR: unmount DIR (once its engine is gone) and detach any loop
# device still backed by IMAGE; the file stays (the image cache).
unmount_btrfs_root() {
    local image="$1" dir="$2" loop
    if mountpoint -q "$dir"; then
        umount "$dir" 2>/dev/null || umount -l "$dir" || warn "could not unmount $dir"
    fi
    [[ -e "$image" ]] || return 0
    losetup -j "$image" -O NAME -n 2>/dev/null | while read -r loop; do
        losetup -d "$loop" 2>/dev/null || true
    done || true
}

# stop_dockerd PIDFILE EXEC_ROOT TIMEOUT: SIGTERM the dockerd from PIDFILE,
# SIGKILL after TIMEOUT s, then make sure the containerd (and any shims) it
# spawned under EXEC_ROOT are gone too: a SIGKILLed dockerd leaves them behind.
stop_dockerd() {
    local pidfile="$1" exec_root="$2" timeout="${3:-20}" pid leftovers
    if pid="$(pid_from_file "$pidfile")"; then
        log "stopping dockerd pid $pid"
        kill_and_wait "$timeout" "$pid"
    fi
    rm -f "$pidfile"
    if [[ -n "$exec_root" ]]; then
        mapfile -t leftovers < <(pids_with_arg "$exec_root/containerd")
        if ((${#leftovers[@]})); then
            log "stopping leftover containerd/shim pid(s) ${leftovers[*]}"
            kill_and_wait 10 "${leftovers[@]}"
        fi
        # The next dockerd trusts this pidfile: if the pid in it still
        # "exists" (e.g. an unreaped zombie, or a recycled pid) it waits for a
        # containerd that never answers, then fails with "timeout waiting for
        # containerd to start". Nothing runs from this exec root now.
        rm -f "$exec_root/containerd/containerd.pid"
    fi
}

# ------------------------------------------------------- busybox image ----

# build_busybox_rootfs TARBALL: a minimal root filesystem made of the static
# busybox and one symlink per applet, enough for `sh`, `echo`, `sleep`, `nc`,
# `wget`, `dd`, `env`... Rebuilt only when missing or older than the busybox
# binary. Written atomically so an interrupted build never leaves a half tar.
build_busybox_rootfs() {
    local tarball="$1" root applet n=0
    # A tar made before its root was 0755 (see below) is made again.
    if [[ -s "$tarball" && "$tarball" -nt "$BUSYBOX_BIN" ]] &&
        tar -tvf "$tarball" --no-recursion ./ 2>/dev/null | grep -q '^drwxr-xr-x'; then
        return 0
    fi
    [[ -x "$BUSYBOX_BIN" ]] || die "$BUSYBOX_BIN missing (run .ci/install.sh busybox-static)"
    # ldd exits non-zero for static binaries ("not a dynamic executable"); a
    # dynamic busybox would fail inside the image with "no such file" for libc.
    if ldd "$BUSYBOX_BIN" >/dev/null 2>&1; then
        die "$BUSYBOX_BIN is dynamically linked; install busybox-static instead of busybox"
    fi
    "$BUSYBOX_BIN" --list >/dev/null 2>&1 || die "$BUSYBOX_BIN --list failed"

    log "building busybox rootfs $tarball"
    mkdir -p "$(dirname "$tarball")"
    # Leftovers of an interrupted earlier build.
    rm -rf "$(dirname "$tarball")"/.rootfs.*
    root="$(mktemp -d "$(dirname "$tarball")/.rootfs.XXXXXX")"
    # mktemp's 0700 would be the image's "/" (the btrfs driver keeps it; overlay2 does
    # not): the tenant's uid could then run nothing.
    chmod 0755 "$root"
    mkdir -p "$root"/{bin,etc,root,tmp,usr/bin,proc,sys,dev}
    chmod 1777 "$root/tmp"
    chmod 700 "$root/root"
    install -m 0755 "$BUSYBOX_BIN" "$root/bin/busybox"
    while IFS= read -r applet; do
        # `busybox --list` includes "busybox" itself; linking it would replace
        # the binary with a self-referencing symlink.
        [[ -z "$applet" || "$applet" == busybox || "$applet" == */* ]] && continue
        ln -sf busybox "$root/bin/$applet"
        n=$((n + 1))
    done < <("$BUSYBOX_BIN" --list)
    # Scripts with `#!/usr/bin/env sh` shebangs.
    ln -sf ../../bin/busybox "$root/usr/bin/env"
    cat >"$root/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
    cat >"$root/etc/group" <<'EOF'
root:x:0:
nogroup:x:65534:
EOF
    tar --numeric-owner --owner=0 --group=0 -C "$root" -cf "$tarball.tmp" . \
        && mv -f "$tarball.tmp" "$tarball"
    rm -rf "$root"
    log "rootfs has busybox + $n applet links"
}

# ensure_busybox_image HOST TARBALL: `docker import` the rootfs as
# $SUANLI_IMAGE unless the engine already has it (data roots are kept between
# runs, so this is normally a cache hit), then smoke-test it.
ensure_busybox_image() {
    local host="$1" tarball="$2" out
    if ! "$DOCKER_CLI" -H "$host" image inspect "$SUANLI_IMAGE" >/dev/null 2>&1; then
        build_busybox_rootfs "$tarball"
        log "importing $SUANLI_IMAGE into $host"
        "$DOCKER_CLI" -H "$host" import --change 'CMD ["/bin/sh"]' "$tarball" "$SUANLI_IMAGE" >/dev/null
    fi
    out="$("$DOCKER_CLI" -H "$host" run --rm "$SUANLI_IMAGE" echo ok 2>&1)" ||
        die "smoke test '$DOCKER_CLI -H $host run --rm $SUANLI_IMAGE echo ok' failed: $out"
    [[ "$out" == ok ]] || die "unexpected smoke-test output on $host: $out"
    log "$SUANLI_IMAGE runs on $host"
}

# --------------------------------------------------------- sftp image ----

SFTP_IMAGE="${SUANLI_SFTP_IMAGE:-suanli/sftp:latest}"
SFTP_SERVER_BIN="${SFTP_SERVER_BIN:-/usr/lib/openssh/sftp-server}"
RSYNC_BIN="${RSYNC_BIN:-/usr/bin/rsync}"
SCP_BIN="${SCP_BIN:-/usr/bin/scp}"
# What the image holds, as its label suanli.transfer says (jobs/access/sftp.py reads it: an
# engine whose image predates rsync is told to an operator, not run). Change it when the
# image's contents change: ensure_sftp_image imports again where the label differs.
SFTP_TOOLS="sftp-server rsync scp"

# build_sftp_rootfs TARBALL: the smallest root filesystem that runs OpenSSH's
# sftp-server (Debian's openssh-sftp-server), rsync (`rsync --server`) and scp (`scp -t`/`-f`,
# the legacy protocol of `scp -O`) for a workspace whose image has none: the binaries, the shared libraries ldd names, and an empty
# /etc (the gateway adds the tenant's passwd line per session, jobs/access/sftp.py). No
# shell, no /tmp: nothing in it is the tenant's to write, and nothing in it runs but the
# one program the gateway names. Rebuilt when missing, older than a binary or without rsync and scp.
build_sftp_rootfs() {
    local tarball="$1" root lib bin
    if [[ -s "$tarball" && "$tarball" -nt "$SFTP_SERVER_BIN" && "$tarball" -nt "$RSYNC_BIN" ]] &&
        tar -tf "$tarball" ./usr/bin/rsync ./usr/bin/scp >/dev/null 2>&1; then
        return 0
    fi
    [[ -x "$SFTP_SERVER_BIN" ]] || die "$SFTP_SERVER_BIN missing (run .ci/install.sh openssh-sftp-server)"
    [[ -x "$RSYNC_BIN" ]] || die "$RSYNC_BIN missing (run .ci/install.sh rsync)"
    [[ -x "$SCP_BIN" ]] || die "$SCP_BIN missing (run .ci/install.sh openssh-client)"
    log "building sftp rootfs $tarball"
    mkdir -p "$(dirname "$tarball")"
    rm -rf "$(dirname "$tarball")"/.sftp-rootfs.*
    root="$(mktemp -d "$(dirname "$tarball")/.sftp-rootfs.XXXXXX")"
    chmod 0755 "$root"
    mkdir -p "$root"/{etc,proc,sys,dev,usr/lib/openssh,usr/bin}
    install -m 0755 "$SFTP_SERVER_BIN" "$root/usr/lib/openssh/sftp-server"
    install -m 0755 "$RSYNC_BIN" "$root/usr/bin/rsync"
    install -m 0755 "$SCP_BIN" "$root/usr/bin/scp"
    # `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)` and the loader's own line.
    for bin in "$SFTP_SERVER_BIN" "$RSYNC_BIN" "$SCP_BIN"; do
        while IFS= read -r lib; do
            [[ -n "$lib" ]] || continue
            mkdir -p "$root$(dirname "$lib")"
            cp -L "$lib" "$root$lib"
        done < <(ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}')
    done
    tar --numeric-owner --owner=0 --group=0 -C "$root" -cf "$tarball.tmp" . \
        && mv -f "$tarball.tmp" "$tarball"
    rm -rf "$root"
}

# ensure_sftp_image HOST TARBALL: `docker import` the rootfs as $SFTP_IMAGE
# unless the engine has it with today's contents (its label suanli.transfer), then check
# that sftp-server starts (it answers an empty input by exiting; "No user found" means it
# ran but has no passwd line, which the gateway supplies) and that rsync runs.
ensure_sftp_image() {
    local host="$1" tarball="$2" out tools
    tools="$("$DOCKER_CLI" -H "$host" image inspect -f '{{index .Config.Labels "suanli.transfer"}}' \
        "$SFTP_IMAGE" 2>/dev/null)" || tools=""
    if [[ "$tools" != "$SFTP_TOOLS" ]]; then
        build_sftp_rootfs "$tarball"
        log "importing $SFTP_IMAGE into $host${tools:+ (it held: $tools)}"
        "$DOCKER_CLI" -H "$host" import --change 'CMD ["/usr/lib/openssh/sftp-server"]' \
            --change "LABEL suanli.transfer=\"$SFTP_TOOLS\"" "$tarball" "$SFTP_IMAGE" >/dev/null
    fi
    out="$("$DOCKER_CLI" -H "$host" run --rm --network none --user 4242:4242 "$SFTP_IMAGE" 2>&1 </dev/null)" || true
    [[ "$out" == *"No user found for uid 4242"* ]] ||
        die "$SFTP_IMAGE does not run sftp-server on $host: $out"
    out="$("$DOCKER_CLI" -H "$host" run --rm --network none --user 4242:4242 --read-only \
        "$SFTP_IMAGE" /usr/bin/rsync --version 2>&1 </dev/null)" || true
    [[ "$out" == "rsync "*"version"* ]] || die "$SFTP_IMAGE does not run rsync on $host: $out"
    log "$SFTP_IMAGE runs on $host"
}

# ------------------------------------------------------------- registry ----

# The private image registry (Debian's docker-registry: the CNCF distribution registry)
# that researchers' own images live in (jobs/nodes/registry.py, jobs/images/builds.py).

registry_up() { # registry_up DIR ADDR PORT: /v2/ answers with TLS and the password
    curl -fsS --max-time 3 --cacert "$1/ca.crt" -u "suanli:$(cat "$1/registry.pass" 2>/dev/null)" \
        "https://$2:$3/v2/" >/dev/null 2>&1
}

# start_registry DIR ADDR PORT: the registry on ADDR:PORT, TLS from a CA made once in DIR
# (ca.crt), the user "suanli" with a password made once (DIR/registry.pass, bcrypt in
# DIR/htpasswd), its blobs in DIR/data, deletes enabled. The engines of this machine
# trust the CA for that address (/etc/docker/certs.d/ADDR:PORT/ca.crt, read at each pull
# and push: no engine restart). A no-op when it already answers.
start_registry() {
    local dir="$1" addr="$2" port="$3" pass
    command -v docker-registry >/dev/null || die "docker-registry not installed (run .ci/install.sh docker-registry)"
    mkdir -p "$dir/data"
    if [[ ! -s "$dir/ca.crt" || ! -s "$dir/server.crt" ]] ||
        ! openssl x509 -in "$dir/server.crt" -noout -ext subjectAltName 2>/dev/null | grep -qF "IP Address:$addr"; then
        log "registry: making a CA and a certificate for $addr"
        (umask 077 && openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj "/CN=Suanli registry CA" \
            -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null)
        (umask 077 && openssl req -newkey rsa:2048 -nodes -subj "/CN=$addr" \
            -keyout "$dir/server.key" -out "$dir/server.csr" 2>/dev/null)
        printf 'subjectAltName=IP:%s,DNS:localhost\nextendedKeyUsage=serverAuth\n' "$addr" >"$dir/server.ext"
        openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
            -days 3650 -extfile "$dir/server.ext" -out "$dir/server.crt" 2>/dev/null
        rm -f "$dir/server.csr" "$dir/server.ext"
    fi
    pass="$(secret_file "$dir/registry.pass" hex)"
    (umask 077 && htpasswd -Bin suanli <<<"$pass" >"$dir/htpasswd" 2>/dev/null) ||
        die "htpasswd failed (run .ci/install.sh apache2-utils)"
    cat >"$dir/config.yml" <<YAML
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $dir/data
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: $addr:$port
  tls:
    certificate: $dir/server.crt
    key: $dir/server.key
  headers:
    X-Content-Type-Options: [nosniff]
auth:
  htpasswd:
    realm: suanli
    path: $dir/htpasswd
YAML
    install -D -m 0644 "$dir/ca.crt" "/etc/docker/certs.d/$addr:$port/ca.crt"
    if registry_up "$dir" "$addr" "$port"; then
        log "registry already answering on $addr:$port"
        return 0
    fi
    if pid_from_file "$dir/registry.pid" >/dev/null; then kill_and_wait 5 "$(pid_from_file "$dir/registry.pid")"; fi
    log "starting the image registry on https://$addr:$port (data $dir/data)"
    setsid nohup docker-registry serve "$dir/config.yml" >"$dir/registry.log" 2>&1 </dev/null &
    echo $! >"$dir/registry.pid"
    if ! wait_until 20 "registry on $addr:$port" registry_up "$dir" "$addr" "$port"; then
        tail -n 20 "$dir/registry.log" >&2 || true
        die "the registry did not come up"
    fi
}

# stop_registry DIR ADDR PORT: stop the registry started from DIR and take back the
# engines' trust in it.
stop_registry() {
    local dir="$1" addr="$2" port="$3" pid
    if pid="$(pid_from_file "$dir/registry.pid")"; then
        log "stopping the image registry (pid $pid)"
        kill_and_wait 10 "$pid"
    fi
    rm -f "$dir/registry.pid"
    rm -rf "/etc/docker/certs.d/$addr:$port"
    rmdir /etc/docker/certs.d 2>/dev/null || true
}

# ------------------------------------------------------------- moosefs ----
# The researchers' distributed filesystem of the test fleet: MooseFS (Debian's packages), a
# master and one chunkserver on the hosts' network, mounted by the console and by every host.

# mfs_write_config DIR LISTEN_IP PORT_BASE ADMIN_IP HOSTS_NET: the master's and the
# chunkserver's configuration under DIR. Ports: PORT_BASE (metaloggers), +1 (chunkservers),
# +2 (clients), +3 (the chunkserver's own). Only ADMIN_IP (the console) may set quotas; the
# hosts' network may mount; nothing else may.
mfs_write_config() {
    local dir="$1" ip="$2" base="$3" admin="$4" net="$5"
    mkdir -p "$dir/master" "$dir/chunks"
    cat >"$dir/mfsmaster.cfg" <<CFG
WORKING_USER = root
WORKING_GROUP = root
SYSLOG_IDENT = suanli-mfsmaster
DATA_PATH = $dir/master
EXPORTS_FILENAME = $dir/mfsexports.cfg
MATOML_LISTEN_HOST = $ip
MATOML_LISTEN_PORT = $base
MATOCS_LISTEN_HOST = $ip
MATOCS_LISTEN_PORT = $((base + 1))
MATOCL_LISTEN_HOST = $ip
MATOCL_LISTEN_PORT = $((base + 2))
LOCK_MEMORY = 0
CFG
    cat >"$dir/mfsexports.cfg" <<CFG
$admin / rw,alldirs,maproot=0,admin
$net / rw,alldirs,maproot=0
CFG
    cat >"$dir/mfschunkserver.cfg" <<CFG
WORKING_USER = root
WORKING_GROUP = root
SYSLOG_IDENT = suanli-mfschunkserver
DATA_PATH = $dir/chunks
HDD_CONF_FILENAME = $dir/mfshdd.cfg
MASTER_HOST = $ip
MASTER_PORT = $((base + 1))
CSSERV_LISTEN_HOST = $ip
CSSERV_LISTEN_PORT = $((base + 3))
HDD_TEST_FREQ = 0
CFG
    mkdir -p "$dir/chunks/hdd"
    echo "$dir/chunks/hdd" >"$dir/mfshdd.cfg"
    [[ -s "$dir/master/metadata.mfs" || -s "$dir/master/metadata.mfs.back" ]] ||
        echo "MFSM NEW" >"$dir/master/metadata.mfs"
}

# start_moosefs DIR: the master and the chunkserver of DIR's configuration (idempotent).
start_moosefs() {
    local dir="$1"
    command -v mfsmaster >/dev/null || die "mfsmaster not installed (run .ci/install.sh moosefs-master moosefs-chunkserver moosefs-client)"
    if ! mfsmaster -c "$dir/mfsmaster.cfg" test >/dev/null 2>&1; then
        log "starting the MooseFS master ($dir)"
        mfsmaster -a -c "$dir/mfsmaster.cfg" start >"$dir/master.log" 2>&1 ||
            { tail -n 20 "$dir/master.log" >&2; die "the MooseFS master did not start"; }
    fi
    if ! mfschunkserver -c "$dir/mfschunkserver.cfg" test >/dev/null 2>&1; then
        log "starting the MooseFS chunkserver"
        mfschunkserver -c "$dir/mfschunkserver.cfg" start >"$dir/chunkserver.log" 2>&1 ||
            { tail -n 20 "$dir/chunkserver.log" >&2; die "the MooseFS chunkserver did not start"; }
    fi
}

stop_moosefs() {
    local dir="$1"
    [[ -f "$dir/mfsmaster.cfg" ]] || return 0
    mfschunkserver -c "$dir/mfschunkserver.cfg" stop >/dev/null 2>&1 || true
    mfsmaster -c "$dir/mfsmaster.cfg" stop >/dev/null 2>&1 || true
}

# mount_moosefs MNT MASTER_IP PORT [NSENTER ARGS...]: MooseFS at MNT (in the namespaces
# NSENTER ARGS name, or here), unless it is mounted there already. Waits until the master
# has a chunkserver, so the first write does not fail.
mount_moosefs() {
    local mnt="$1" ip="$2" port="$3"
    shift 3
    local in=()
    (($#)) && in=(nsenter "$@")
    if "${in[@]}" awk -v m="$mnt" '$2 == m && $3 == "fuse" { found = 1 } END { exit !found }' /proc/self/mounts 2>/dev/null; then
        # A mount whose client died with an earlier master (ENOTCONN) is dropped, not kept.
        "${in[@]}" stat -f "$mnt" >/dev/null 2>&1 && return 0
        log "dropping a dead MooseFS mount at $mnt${in[*]:+ (in ${in[*]})}"
        "${in[@]}" umount -l "$mnt" || true
    fi
    "${in[@]}" mkdir -p "$mnt"
    local tries
    for tries in 1 2 3 4 5 6 7 8 9 10; do
        if "${in[@]}" mfsmount "$mnt" -H "$ip" -P "$port" -o mfsioretries=5 >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.5
    done
    die "could not mount MooseFS ($ip:$port) on $mnt${in[*]:+ (in ${in[*]})}"
}

# ensure_mount_ns FILE: a persistent mount namespace bound to FILE (its folder a private
# mount so the binding does not propagate), a copy of this one when made.
ensure_mount_ns() {
    local file="$1" dir
    dir="$(dirname "$file")"
    mkdir -p "$dir"
    if ! mountpoint -q "$dir"; then
        mount --bind "$dir" "$dir"
        mount --make-private "$dir"
    fi
    if [[ -e "$file" ]] && nsenter "--mount=$file" true 2>/dev/null; then
        return 0
    fi
    touch "$file"
    unshare "--mount=$file" --propagation private true || die "could not make the mount namespace $file"
}

# drop_mount_ns FILE PATH...: unmount everything at each PATH inside the namespace of FILE,
# then the namespace itself.
drop_mount_ns() {
    local file="$1"
    shift
    local m
    if [[ -e "$file" ]] && nsenter "--mount=$file" true 2>/dev/null; then
        for m in "$@"; do
            nsenter "--mount=$file" sh -c 'while mountpoint -q "$1" 2>/dev/null || grep -q " $1 " /proc/self/mounts; do umount -l "$1" || break; done' _ "$m" 2>/dev/null || true
        done
        umount "$file" 2>/dev/null || umount -l "$file" 2>/dev/null || true
    fi
    rm -f "$file"
}

#!/bin/sh
# The tenant firewall of a Suanli Docker host (docs/threat-model.md).
# Run as root on every host, after dockerd has started, and again after a reboot:
#
#   sh host-firewall.sh apply [PROTECTED_CIDR ...]
#   sh host-firewall.sh remove
#   sh host-firewall.sh check      # exit 0 when the rules are in place
#
# Tenant containers live on Suanli's cluster networks: per-cluster bridges named slc<id>
# and overlay networks, whose containers leave the host through docker_gwbridge. From
# those interfaces this refuses
#   - everything addressed to the host itself (INPUT): its loopback-bound and public
#     services, the engine, Redis, PostgreSQL, the console, whatever listens there;
#   - everything forwarded to the protected networks (DOCKER-USER): the hosts' and the
#     control plane's networks, cloud metadata. Default: the private, shared and
#     link-local IPv4 ranges. Name your own when your hosts use public addresses.
# Traffic inside one cluster (its bridge, or its overlay's VXLAN) and to the outside world
# through NAT is left alone; Docker's own isolation keeps clusters apart.
# `apply` also raises the host's kernel.pid_max (raise_pid_max), so that the containers
# one host takes cannot use up its pids.
set -eu

IN=SUANLI-TENANT-IN
FWD=SUANLI-TENANT-FWD
TENANT_IFS="slc+ docker_gwbridge" # never docker0: Suanli puts no tenant there
DEFAULT_PROTECTED="10.0.0.0/8 172.16.0.0/12 192.168.0.0/16 100.64.0.0/10 169.254.0.0/16"

# refuse CHAIN MATCH...: refused at once, not dropped: a TCP reset, an ICMP "port
# unreachable" for the rest. Every protected address answers alike (nothing is learnt of
# what listens), and a connect fails in a millisecond instead of hanging until its timeout
# (a researcher's script; each host check's canary, jobs/hosts/proofs.py).
refuse() {
    chain="$1"
    shift
    iptables -A "$chain" "$@" -p tcp -j REJECT --reject-with tcp-reset
    iptables -A "$chain" "$@" -j REJECT --reject-with icmp-port-unreachable
}

hook() { # hook CHAIN TARGET: jump from CHAIN to TARGET once, at the top
    iptables -C "$1" -j "$2" 2>/dev/null || iptables -I "$1" 1 -j "$2"
}

apply() {
    protected="${*:-$DEFAULT_PROTECTED}"
    iptables -N "$IN" 2>/dev/null || iptables -F "$IN"
    iptables -N "$FWD" 2>/dev/null || iptables -F "$FWD"
    iptables -N DOCKER-USER 2>/dev/null || true # dockerd keeps a chain that exists
    for i in $TENANT_IFS; do
        refuse "$IN" -i "$i"
    done
    # One cluster's bridge to itself (bridged frames pass here with br_netfilter).
    iptables -A "$FWD" -i slc+ -o slc+ -j RETURN
    for i in $TENANT_IFS; do
        for net in $protected; do
            refuse "$FWD" -i "$i" -d "$net"
        done
    done
    hook INPUT "$IN"
    hook DOCKER-USER "$FWD"
    hook FORWARD DOCKER-USER
    raise_pid_max
}

# The host's pid_max: each container may hold SUANLI_PIDS_LIMIT (4096) processes, and the
# kernel's default of 32768 pids is taken by 8 such containers; 4194304 (the most a 64-bit
# kernel allows) holds 1024 of them. Raised, never lowered.
PID_MAX=4194304
raise_pid_max() {
    now="$(cat /proc/sys/kernel/pid_max)"
    if [ "$now" -lt "$PID_MAX" ]; then
        # pid_max is the machine's, not a network namespace's; where /proc/sys is read-only
        # (a container) say so and go on: the firewall is the point of `apply`.
        echo "$PID_MAX" 2>/dev/null >/proc/sys/kernel/pid_max ||
            echo "host-firewall: kernel.pid_max stays $now (not writable here): raise it to $PID_MAX on the host" >&2
    fi
}

remove() {
    iptables -D INPUT -j "$IN" 2>/dev/null || true
    iptables -D DOCKER-USER -j "$FWD" 2>/dev/null || true
    iptables -F "$IN" 2>/dev/null || true
    iptables -X "$IN" 2>/dev/null || true
    iptables -F "$FWD" 2>/dev/null || true
    iptables -X "$FWD" 2>/dev/null || true
}

check() {
    iptables -C INPUT -j "$IN" 2>/dev/null && iptables -C DOCKER-USER -j "$FWD" 2>/dev/null
}

cmd="${1:-}"
[ $# -gt 0 ] && shift
case "$cmd" in
apply) apply "$@" ;;
remove) remove ;;
check) check ;;
*)
    echo "usage: $0 apply [PROTECTED_CIDR ...] | remove | check" >&2
    exit 2
    ;;
esac

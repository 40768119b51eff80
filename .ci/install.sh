#!/usr/bin/env bash
# Install the Debian packages the test suite / dev console need.
#
#   .ci/install.sh                          # everything (CI)
#   .ci/install.sh redis-server docker.io   # just what `make run` needs
#
# As root with apt-get: installs whatever is missing (one `apt-get update`,
# one `apt-get install`, no recommends). Otherwise: lists what is missing and
# the command to run, and exits 1 only if something is missing.
# Fast no-op when everything is present (dpkg-query only, no network).
set -euo pipefail

LOG_TAG=install
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ALL_PACKAGES=(postgresql redis-server docker.io busybox-static chromium iproute2 iptables
    openssh-client openssh-sftp-server rsync docker-registry apache2-utils curl openssl gettext
    fonts-wqy-microhei btrfs-progs moosefs-master moosefs-chunkserver moosefs-client
    moosefs-cli prometheus)
# prometheus: tests/test_prometheus.py runs its `promtool` on deploy/prometheus/ and starts a
# `prometheus` of its own (own config, data folder and free port). Where systemd runs, the
# package's postinst also starts Debian's own prometheus.service on :9090 scraping only
# itself; the suite never uses or stops it (and does not disable it: not ours to change).
if (($#)); then
    wanted=("$@")
else
    wanted=("${ALL_PACKAGES[@]}")
fi

# pkg_installed NAME: dpkg says "installed" for NAME (a glob is allowed).
pkg_installed() {
    dpkg-query -W -f='${db:Status-Status}\n' "$1" 2>/dev/null | grep -qx installed
}

# satisfied PACKAGE: the package, or an equivalent that provides the same
# commands, is installed. Equivalents avoid pointless installs / conflicts:
#  - postgresql is a metapackage; any postgresql-NN server is enough.
#  - docker-ce (Docker's own repo) conflicts with docker.io but ships dockerd.
satisfied() {
    case "$1" in
    postgresql) pkg_installed postgresql || pkg_installed 'postgresql-[0-9]*' ;;
    docker.io) pkg_installed docker.io || pkg_installed docker-ce ;;
    *) pkg_installed "$1" ;;
    esac
}

# chromium_ok: headless chromium can render a page. Installed without
# recommends it has no sandbox helper and few fonts, hence --no-sandbox (also
# needed as root) and a throwaway profile so $HOME need not be writable.
chromium_ok() {
    local profile out rc=0
    profile="$(mktemp -d)"
    out="$(timeout 60 chromium --headless --no-sandbox --disable-gpu \
        --user-data-dir="$profile" --dump-dom about:blank 2>/dev/null)" || rc=$?
    rm -rf "$profile"
    ((rc == 0)) && [[ "$out" == *"<html"* ]]
}

missing=()
for p in "${wanted[@]}"; do
    satisfied "$p" || missing+=("$p")
done

if ((${#missing[@]})); then
    if is_root && command -v apt-get >/dev/null; then
        log "installing: ${missing[*]}"
        # Unattended: no debconf questions, no conffile prompts, no
        # needrestart restarting services (e.g. a running postgres) behind our
        # back; wait for an apt lock held by e.g. unattended-upgrades.
        export DEBIAN_FRONTEND=noninteractive NEEDRESTART_SUSPEND=1
        apt_opts=(-o DPkg::Lock::Timeout=300)
        apt-get "${apt_opts[@]}" update -qq >&2
        apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends \
            -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
            "${missing[@]}" >&2
    else
        log "missing packages: ${missing[*]}"
        log "install them with:"
        log "  sudo apt-get update && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${missing[*]}"
        exit 1
    fi
else
    log "all present: ${wanted[*]}"
fi

# Verify chromium only when it was asked for (costs ~1-2 s).
for p in "${wanted[@]}"; do
    if [[ "$p" == chromium ]]; then
        chromium_ok || die "chromium is installed but 'chromium --headless --no-sandbox --disable-gpu --dump-dom about:blank' fails"
        log "chromium headless OK"
    fi
done

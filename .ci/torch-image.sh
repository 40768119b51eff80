#!/usr/bin/env bash
# Build suanli/torch:2.13-cpu (Debian bookworm minbase + python3, bash and rsync + PyTorch
# 2.13.0 CPU) and import it into the given engines (default: the two test engines). No
# registry is reachable: the rootfs comes from debootstrap and Debian's mirror, torch from
# the wheel pip finds for torch==2.13.0. The tarball is cached under .run/images, with the
# recipe it was made from beside it: a changed recipe (PACKAGES) builds it again. An engine
# whose image was imported from another tarball (its label suanli.tarball) gets it again.
set -euo pipefail
LOG_TAG=torch-image
# shellcheck source=.ci/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

IMAGE="${SUANLI_TORCH_IMAGE:-suanli/torch:2.13-cpu}"
CACHE="$REPO_ROOT/.run/images"
TARBALL="$CACHE/torch-2.13-cpu.tar"
RECIPE_FILE="$CACHE/torch-2.13-cpu.recipe"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# rsync: `rsync -e ssh` through the gateway runs the workspace's own rsync --server; bash:
# what researchers' scripts and VS Code's remote server expect.
PACKAGES=python3,ca-certificates,bash,rsync
RECIPE="bookworm minbase $PACKAGES torch==2.13.0"
ENGINES=("$@")
if [ ${#ENGINES[@]} -eq 0 ]; then
    ENGINES=("unix://$REPO_ROOT/.run/test/docker-a.sock" "unix://$REPO_ROOT/.run/test/docker-b.sock")
fi
mkdir -p "$CACHE"

if [[ ! -s "$TARBALL" || "$(cat "$RECIPE_FILE" 2>/dev/null)" != "$RECIPE" ]]; then
    is_root || die "building the image needs root (debootstrap, chroot)"
    command -v debootstrap >/dev/null || bash .ci/install.sh debootstrap
    root="$CACHE/torch-rootfs"
    rm -rf "$root" "$CACHE/wheels"
    log "debootstrap bookworm (minbase + $PACKAGES) from $MIRROR (2%)"
    debootstrap --variant=minbase --include="$PACKAGES" bookworm "$root" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
        || { tail -20 "$CACHE/debootstrap.log" >&2; die "debootstrap failed"; }
    log "downloading torch==2.13.0 (CPU) and its dependencies (25%)"
    "$REPO_ROOT/.venv/bin/pip" download --quiet torch==2.13.0 -d "$CACHE/wheels" 2>&1 | grep -v '^WARNING: Location' >&2 || true
    wheel=$(ls "$CACHE"/wheels/torch-2.13.0*.whl)
    size=$(stat -c %s "$wheel")
    [ "$size" -lt 400000000 ] || die "$wheel is $((size / 1000000)) MB: that is a CUDA build, not the CPU wheel"
    log "installing $(basename "$wheel") into the rootfs (35%)"
    "$REPO_ROOT/.venv/bin/pip" install --quiet --no-index --find-links "$CACHE/wheels" --no-compile \
        --target "$root/usr/local/lib/python3.11/dist-packages" torch==2.13.0 2>&1 | grep -v '^WARNING: Location' >&2 || true
    chroot "$root" python3 -c "import torch; assert torch.__version__.startswith('2.13.0')" \
        || die "torch does not import in the rootfs"
    # pip --target leaves console scripts out of PATH; torchrun is what jobs call.
    printf '#!/bin/sh\nexec python3 -m torch.distributed.run "$@"\n' >"$root/usr/local/bin/torchrun"
    chmod 755 "$root/usr/local/bin/torchrun"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc "$root"/usr/share/man
    chmod 1777 "$root/tmp"
    log "packing the rootfs (42%)"
    tar -C "$root" -cf "$TARBALL.part" . && mv "$TARBALL.part" "$TARBALL"
    printf '%s\n' "$RECIPE" >"$RECIPE_FILE"
    rm -rf "$root" "$CACHE/wheels"
fi
tarball_sum=$(sha256sum "$TARBALL" | cut -c1-16)

for engine in "${ENGINES[@]}"; do
    made=$("$DOCKER_CLI" -H "$engine" image inspect --format '{{index .Config.Labels "suanli.tarball"}}' "$IMAGE" 2>/dev/null) || made=""
    if [ "$made" = "$tarball_sum" ]; then
        log "$IMAGE is on $engine already"
        continue
    fi
    log "importing $IMAGE into $engine (48%)"
    old=$("$DOCKER_CLI" -H "$engine" image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null) || old=""
    "$DOCKER_CLI" -H "$engine" import --change 'CMD ["python3"]' --change 'ENV HOME=/tmp' \
        --change "LABEL suanli.tarball=$tarball_sum" "$TARBALL" "$IMAGE" >/dev/null
    # The one it replaced, unless a container (or the jupyter image on it) still uses it.
    if [ -n "$old" ]; then "$DOCKER_CLI" -H "$engine" rmi "$old" >/dev/null 2>&1 || true; fi
    "$DOCKER_CLI" -H "$engine" run --rm --user 12345:12345 "$IMAGE" sh -c \
        'python3 -c "import torch, torch.distributed as d; assert d.is_available()" && rsync --version >/dev/null && bash -c true' \
        || die "$IMAGE does not run torch, rsync and bash on $engine"
done
log "$IMAGE ready on ${#ENGINES[@]} engine(s) (55%)"

#!/usr/bin/env bash
# Build suanli/jupyter:2.13-cpu: suanli/torch:2.13-cpu plus JupyterLab 4 and TensorBoard, the
# catalog's notebook image, and import it into the given engines (default: the two test
# engines). The torch image comes first (.ci/torch-image.sh builds and imports it where it
# is missing); this one is a second layer on top of it, so an engine keeps torch once.
#
# The layer: the torch rootfs is unpacked, pip (the venv's own, run by the rootfs's
# python3 in a chroot) installs the pinned wheels from a wheel dir that the venv's pip
# downloaded for the rootfs's Python. Run there, pip sees what the torch image already has
# (jinja2, setuptools...) and installs only the rest, with real console scripts
# (`jupyter`, `jupyter-lab`, `tensorboard`) in /usr/local/bin; `--root` puts exactly
# that into a staging dir, which is the cached tarball .run/images/jupyter-2.13-cpu-layer.tar.
# It is rebuilt when missing or older than the torch tarball (delete it after changing the
# pins). An engine gets it by `docker cp` into a container of the torch image and
# `docker commit`, and gets it again when its torch image or the tarball changed.
# Its steps' lines (and torch-image.sh's) carry "(NN%)": `make run` builds it in the
# background through `manage.py catalog_prepare`, which shows that progress on the form.
set -euo pipefail
LOG_TAG=jupyter-image
# shellcheck source=.ci/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$REPO_ROOT"

BASE="${SUANLI_TORCH_IMAGE:-suanli/torch:2.13-cpu}"
IMAGE="${SUANLI_JUPYTER_IMAGE:-suanli/jupyter:2.13-cpu}"
JUPYTERLAB_VERSION=4.6.6
TENSORBOARD_VERSION=2.21.0
CACHE="$REPO_ROOT/.run/images"
BASE_TARBALL="$CACHE/torch-2.13-cpu.tar"
TARBALL="$CACHE/jupyter-2.13-cpu-layer.tar"
PIP="$REPO_ROOT/.venv/bin/pip"
ENGINES=("$@")
if [ ${#ENGINES[@]} -eq 0 ]; then
    ENGINES=("unix://$REPO_ROOT/.run/test/docker-a.sock" "unix://$REPO_ROOT/.run/test/docker-b.sock")
fi
# Any uid runs it: HOME=/tmp comes from the torch image; kernels' connection files stay on
# the container's own /tmp even when a workspace's HOME is a volume on shared storage.
CHANGES=(--change 'ENV JUPYTER_RUNTIME_DIR=/tmp/jupyter-runtime' --change 'CMD ["python3"]')
umask 022

bash .ci/torch-image.sh "${ENGINES[@]}"

if [[ ! -s "$TARBALL" || "$BASE_TARBALL" -nt "$TARBALL" ]]; then
    is_root || die "building the image needs root (chroot)"
    root="$CACHE/jupyter-rootfs"
    build="$root/tmp/build"
    rm -rf "$root"
    mkdir -p "$root"
    log "unpacking $(basename "$BASE_TARBALL") (58%)"
    tar -C "$root" -xf "$BASE_TARBALL"
    python_version=$(chroot "$root" python3 -c 'import platform; print(platform.python_version())')
    log "downloading jupyterlab==$JUPYTERLAB_VERSION, tensorboard==$TENSORBOARD_VERSION for Python $python_version (62%)"
    # --python-version: wheels for the rootfs's Python, not the venv's (a dependency's
    # newest release may need a later 3.11.x than bookworm has).
    "$PIP" download --quiet --only-binary=:all: --python-version "$python_version" -d "$build/wheels" \
        "jupyterlab==$JUPYTERLAB_VERSION" "tensorboard==$TENSORBOARD_VERSION" 2>&1 | grep -v '^WARNING: Location' >&2 || true
    ls "$build"/wheels/jupyterlab-"$JUPYTERLAB_VERSION"-*.whl >/dev/null 2>&1 || die "pip download failed"
    cp -r "$("$REPO_ROOT/.venv/bin/python" -c 'import os, pip; print(os.path.dirname(pip.__file__))')" "$build/pip"
    log "installing them over the torch rootfs (70%)"
    chroot "$root" env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root PYTHONPATH=/tmp/build \
        python3 -m pip install --quiet --no-index --find-links /tmp/build/wheels --root /tmp/build/layer \
        --break-system-packages --root-user-action=ignore --disable-pip-version-check --no-warn-script-location \
        "jupyterlab==$JUPYTERLAB_VERSION" "tensorboard==$TENSORBOARD_VERSION" \
        || die "pip install in the rootfs failed"
    layer="$build/layer"
    for script in jupyter jupyter-lab tensorboard; do
        [ -x "$layer/usr/local/bin/$script" ] || die "pip left out /usr/local/bin/$script"
    done
    # A console's researchers get no prompt to fetch Jupyter's news, nor a check for updates
    # (an operator curates the image; its hosts may not reach the internet).
    mkdir -p "$layer/usr/local/share/jupyter/lab/settings"
    cat >"$layer/usr/local/share/jupyter/lab/settings/overrides.json" <<'JSON'
{"@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": false}}
JSON
    # numpy's test suites and man pages; the .pyc files stay: a tenant's uid cannot write
    # them into /usr/local, so without them every server and kernel compiles its imports.
    rm -rf "$layer"/usr/local/share/man "$layer"/usr/local/lib/python3.11/dist-packages/numpy/*/tests
    log "packing the layer ($(du -sh "$layer" | cut -f1)) (80%)"
    tar --numeric-owner --owner=0 --group=0 -C "$layer" -cf "$TARBALL.part" . && mv "$TARBALL.part" "$TARBALL"
    rm -rf "$root"
fi

# An engine's image is current when it stands on the engine's torch image and was made from
# this tarball (the label, set at the commit).
made_from() {
    "$DOCKER_CLI" -H "$1" image inspect \
        --format '{{index .RootFS.Layers 0}} {{index .Config.Labels "suanli.layer"}}' "$2" 2>/dev/null
}
layer_sum=$(sha256sum "$TARBALL" | cut -c1-16)

container=""
cleanup() { if [ -n "$container" ]; then "$DOCKER_CLI" -H "$engine" rm -f "$container" >/dev/null 2>&1 || true; fi; }
trap cleanup EXIT
for engine in "${ENGINES[@]}"; do
    base_layer=$("$DOCKER_CLI" -H "$engine" image inspect --format '{{index .RootFS.Layers 0}}' "$BASE") \
        || die "$BASE is not on $engine"
    if [ "$(made_from "$engine" "$IMAGE")" = "$base_layer $layer_sum" ]; then
        log "$IMAGE is on $engine already"
    else
        log "adding the layer to $BASE on $engine (90%)"
        old=$("$DOCKER_CLI" -H "$engine" image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null) || old=""
        container="suanli-jupyter-build-$$"
        "$DOCKER_CLI" -H "$engine" create --name "$container" --network none "$BASE" true >/dev/null
        "$DOCKER_CLI" -H "$engine" cp - "$container:/" <"$TARBALL"
        "$DOCKER_CLI" -H "$engine" commit "${CHANGES[@]}" --change "LABEL suanli.layer=$layer_sum" \
            --message "JupyterLab $JUPYTERLAB_VERSION and TensorBoard $TENSORBOARD_VERSION on $BASE" \
            "$container" "$IMAGE" >/dev/null
        "$DOCKER_CLI" -H "$engine" rm "$container" >/dev/null
        container=""
        # The one it replaced, unless a container still uses it.
        if [ -n "$old" ]; then "$DOCKER_CLI" -H "$engine" rmi "$old" >/dev/null 2>&1 || true; fi
    fi
    # As a workspace runs it: a tenant's uid that has no passwd line, nothing of root's.
    out=$("$DOCKER_CLI" -H "$engine" run --rm --user 12345:12345 --network none --cap-drop ALL \
        --security-opt no-new-privileges "$IMAGE" sh -c 'jupyter lab --version && tensorboard --version' 2>&1) \
        || die "$IMAGE does not run jupyter lab and tensorboard on $engine: $out"
    [[ "$out" == *"$JUPYTERLAB_VERSION"* && "$out" == *"$TENSORBOARD_VERSION"* ]] \
        || die "unexpected versions from $IMAGE on $engine: $out"
done
log "$IMAGE ready on ${#ENGINES[@]} engine(s) (99%)"

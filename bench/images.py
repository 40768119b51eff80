"""bench/images: researchers' own images against the bare engine, in the same run.

`image_build_push`: a small image (the seed's style: `FROM` the catalog's busybox, a `RUN`
writing a file, `ENV`, `WORKDIR /workspace`) built and pushed through the console (the
build's row made as the Images page makes it, then the task body a "builds" worker runs,
called here directly: no RQ hop) on the build host, beside `docker build` + `docker push`
of the same Dockerfile on the same engine to the same registry repository. Each run's
Dockerfile writes a text of its own, so neither side meets the build cache or a layer the
registry already has (but the base, which both find there after a warm-up each).

`image_pull`: an image of the registry (busybox plus BENCH_PULL_MB of random bytes, a
different one each run) pulled onto the other engine through the placement path
(`registry.ensure`, what a workspace or a replica calls before its container is made:
progress kept on the cluster) beside a bare `docker pull` of an image of the same size. The
engine is made fresh before each run (the image removed). The pool of images lives in the
registry under `bench/pull` and is built (on engine a) and pushed only where missing, so
that runs of `make bench` do not pile up blobs in the registry.

Both alternate which side goes first; medians (and p95) over BENCH_IMAGE_RUNS runs.
"""

import io
import json
import os
import statistics
import sys
import tarfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402

django.setup()

import django_rq  # noqa: E402
import docker  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402

from bench.common import register_host  # noqa: E402
from jobs import tasks  # noqa: E402
from jobs.clusters import services
from jobs.images import builds  # noqa: E402
from jobs.models import Cluster, GpuModel, Host, Image, ImageBuild, OwnImage  # noqa: E402
from jobs.nodes import registry
from jobs.placement.catalog import seed_catalog  # noqa: E402

RUNS = int(os.environ.get("BENCH_IMAGE_RUNS", 7))
PULL_MB = int(os.environ.get("BENCH_PULL_MB", 20))
ENGINES = [u for u in os.environ["SUANLI_TEST_ENGINES"].split(",") if u]
BASE = os.environ.get("SUANLI_TEST_IMAGE", "suanli/busybox:latest")
POOL = "bench/pull"  # the pull images' repository in the registry (no researcher's)


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))]


def drain(stream, what):
    for event in stream:
        if "error" in event:
            raise RuntimeError(f"{what}: {event['error']}")


def creds() -> dict:
    """What `docker login` would give the bare side: the registry's user and password."""
    user, password = settings.SUANLI_REGISTRY_USERNAME, settings.SUANLI_REGISTRY_PASSWORD
    return {"username": user, "password": password}


def tar_of(dockerfile: str) -> io.BytesIO:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        data = dockerfile.encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size, info.mtime = len(data), int(time.time())
        tar.addfile(info, io.BytesIO(data))
    out.seek(0)
    return out


def bare_build_push(client, dockerfile: str, ref: str) -> None:
    """`docker build -t ref .` and `docker push ref` with the registry's credentials."""
    drain(
        client.api.build(fileobj=tar_of(dockerfile), custom_context=True, tag=ref, rm=True, decode=True),
        f"building {ref}",
    )  # fmt: skip
    repo, tag = ref.rsplit(":", 1)
    drain(client.api.push(repo, tag=tag, stream=True, decode=True, auth_config=creds()), ref)


def forget(client, ref: str) -> None:
    try:
        client.images.remove(ref, force=True)
    except docker.errors.ImageNotFound:
        pass


def seed_style(text: str) -> str:
    return (
        f"FROM {BASE}\n"
        f'RUN mkdir -p /opt/bench && echo "{text}" > /opt/bench/file\n'
        "ENV GREETING=hello-from-env\n"
        "WORKDIR /workspace\n"
    )


def build_push(owner, host_a: Host) -> dict:
    client = docker.DockerClient(base_url=ENGINES[0], timeout=300)
    name = "bench-build"
    repo = registry.repository(owner.pk, name)
    bare_tags, ours, bare = [], [], []
    run = uuid.uuid4().hex[:8]

    def console(i: int, timed: list) -> None:
        t0 = time.perf_counter()
        build = builds.build_create(
            owner=owner, name=name, tag=f"c{run}-{i}", dockerfile=seed_style(uuid.uuid4().hex)
        )
        got = builds.run(build.pk)
        elapsed = time.perf_counter() - t0
        build.refresh_from_db()
        assert build.state == ImageBuild.State.SUCCEEDED, build.error
        assert build.host_id == host_a.pk and got.endswith(f"/{repo}:c{run}-{i}"), got
        timed.append(elapsed)
        job = django_rq.get_queue("builds").fetch_job(f"image-build-{build.pk}")
        if job is not None:  # queued on commit; this process ran it already
            job.delete()

    def docker_side(i: int, timed: list) -> None:
        tag = f"d{run}-{i}"
        ref = f"{registry.host()}/{repo}:{tag}"
        t0 = time.perf_counter()
        bare_build_push(client, seed_style(uuid.uuid4().hex), ref)
        elapsed = time.perf_counter() - t0
        bare_tags.append(tag)
        timed.append(elapsed)

    try:
        console(0, [])  # warm-ups: the base layer in the repository, the build network made
        docker_side(0, [])
        for i in range(1, RUNS + 1):
            sides = [(console, ours), (docker_side, bare)]
            for side, timed in sides if i % 2 else sides[::-1]:
                side(i, timed)
        sizes = [o.size_bytes for o in OwnImage.objects.filter(owner=owner, name=name)]
    finally:
        for own in OwnImage.objects.filter(owner=owner, name=name):
            forget(client, own.reference)
            builds.delete(owner=owner, image=own)
        for tag in bare_tags:
            forget(client, f"{registry.host()}/{repo}:{tag}")
            registry.delete(repo, tag)
        client.close()
    return {
        "bench": "image_build_push", "runs": RUNS, "image_bytes": int(statistics.median(sizes)),
        "median_s": round(statistics.median(ours), 3), "p95_s": round(pct(ours, 0.95), 3),
        "docker_build_push_median_s": round(statistics.median(bare), 3),
        "docker_build_push_p95_s": round(pct(bare, 0.95), 3),
        "ratio": round(statistics.median(ours) / statistics.median(bare), 2),
    }  # fmt: skip


def pull_pool(count: int) -> list[tuple[str, str, int, int]]:
    """(reference, digest, bytes of its layers, bytes of its own layer) of `count` distinct
    images of about PULL_MB MB each in
    the registry: those missing built on engine a and pushed (then untagged there)."""
    client = docker.DockerClient(base_url=ENGINES[0], timeout=300)
    pool = []
    try:
        for i in range(count):
            tag = f"{PULL_MB}mb-{i}"
            ref = f"{registry.host()}/{POOL}:{tag}"
            try:
                digest, man = registry.manifest(POOL, tag)
            except registry.RegistryError as exc:
                if " 404 " not in str(exc):
                    raise
                dockerfile = (
                    f"FROM {BASE}\n"
                    f"RUN head -c {PULL_MB * 1000 * 1000} /dev/urandom > /blob"
                    f" && echo {uuid.uuid4().hex} > /id\n"
                )
                bare_build_push(client, dockerfile, ref)
                forget(client, ref)
                digest, man = registry.manifest(POOL, tag)
            layers = registry.layers_of(man)[1:]  # [0]: the config
            pool.append((ref, digest, sum(n for _, n in layers), layers[-1][1]))
    finally:
        client.close()
    return pool


def pull(owner, host_b: Host) -> dict:
    seed = Image.objects.get(reference=BASE)
    spec = services.ClusterSpec(
        name="bench-pull", nodes=1, gpu_model=GpuModel.objects.get(slug="a100-80gb"),
        gpus_per_node=1, image=seed, release_policy="never",
    )  # fmt: skip
    pool = pull_pool(2 * RUNS + 2)
    cluster = services.cluster_create(owner=owner, spec=spec)  # where the progress goes
    client = docker.DockerClient(base_url=host_b.engine_url, timeout=300)
    ours, bare, our_bytes, bare_bytes = [], [], [], []

    def placement(image, timed, sizes) -> None:
        ref, digest, size, own = image
        t0 = time.perf_counter()
        assert registry.ensure(host_b, ref, cluster_id=cluster.pk, digest=digest)
        elapsed = time.perf_counter() - t0
        assert registry.has_current(client, ref, digest), ref
        got = Cluster.objects.get(pk=cluster.pk).image_pulls[host_b.name]
        assert got["state"] == "pulled" and got["done"] == got["total"] == size, got
        timed.append(elapsed)
        sizes.append(own)

    def docker_pull(image, timed, sizes) -> None:
        ref, digest, _, own = image
        repo, tag = ref.rsplit(":", 1)
        t0 = time.perf_counter()
        drain(client.api.pull(repo, tag=tag, stream=True, decode=True, auth_config=creds()), ref)
        elapsed = time.perf_counter() - t0
        assert registry.has_current(client, ref, digest), ref
        timed.append(elapsed)
        sizes.append(own)

    try:
        for image in pool:
            forget(client, image[0])
        # Warm-ups: engine b learns which registry blob is the base layer it has.
        for side, image in ((placement, pool[-2]), (docker_pull, pool[-1])):
            side(image, [], [])
            forget(client, image[0])
        for i in range(RUNS):
            sides = [(placement, ours, our_bytes), (docker_pull, bare, bare_bytes)]
            for n, (side, timed, sizes) in enumerate(sides if i % 2 == 0 else sides[::-1]):
                image = pool[2 * i + n]
                side(image, timed, sizes)
                forget(client, image[0])
    finally:
        for image in pool:
            forget(client, image[0])
        client.close()
        services.cluster_release(cluster=cluster)
        tasks.cluster_network_remove(cluster.pk)  # what a worker does after a release
    return {
        "bench": "image_pull", "runs": RUNS,
        # Downloaded per run: the image's own layer (engine b has the base's already).
        "bytes": int(statistics.median(our_bytes)), "docker_bytes": int(statistics.median(bare_bytes)),
        "image_bytes": pool[0][2],
        "median_s": round(statistics.median(ours), 3), "p95_s": round(pct(ours, 0.95), 3),
        "docker_pull_median_s": round(statistics.median(bare), 3),
        "docker_pull_p95_s": round(pct(bare, 0.95), 3),
        "ratio": round(statistics.median(ours) / statistics.median(bare), 2),
    }  # fmt: skip


def main():
    assert registry.enabled(), "SUANLI_REGISTRY is not set: run under .ci/services.sh's env"
    assert len(ENGINES) >= 2, "two test engines"
    seed_catalog()
    register_host("bench-0", ENGINES[0], gpus=8)
    register_host("bench-1", ENGINES[1], gpus=8)
    host_a, host_b = Host.objects.get(name="bench-0"), Host.objects.get(name="bench-1")
    assert host_a.state == host_b.state == Host.State.ACTIVE, (host_a.last_error, host_b.last_error)
    was_build_host = list(Host.objects.filter(build_host=True).values_list("pk", flat=True))
    Host.objects.update(build_host=False)
    Host.objects.filter(pk=host_a.pk).update(build_host=True)
    owner, _ = get_user_model().objects.get_or_create(username="bench-images")
    for old in owner.clusters.exclude(state__in=["released", "failed"]):  # an interrupted run
        services.cluster_release(cluster=old)
        tasks.cluster_network_remove(old.pk)
    for own in OwnImage.objects.filter(owner=owner):
        builds.delete(owner=owner, image=own)
    try:
        print(json.dumps(build_push(owner, host_a)), flush=True)
        print(json.dumps(pull(owner, host_b)), flush=True)
    finally:
        Host.objects.update(build_host=False)
        Host.objects.filter(pk__in=was_build_host).update(build_host=True)


if __name__ == "__main__":
    main()

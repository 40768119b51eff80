"""Own images on the real registry (docker-registry with TLS and a password, started by
.ci/services.sh) and both engines: a Dockerfile built on the build host with a live log,
pushed, pulled with progress onto the engine that never saw it; failures in words; the
allowed FROM set; saves of workspaces; deletes; the time limit (jobs/images/builds.py)."""

import asyncio
import threading
import time
import uuid
from datetime import datetime

import docker
import pytest
from asgiref.sync import async_to_sync
from channels.layers import channel_layers
from django.core.exceptions import ValidationError
from django.db import connection

from jobs import tasks
from jobs.clusters import services
from jobs.clusters.services import ClusterSpec, JobSpec
from jobs.hosts import services as host_services
from jobs.images import builds
from jobs.models import Cluster, ImageBuild, Node, OwnImage
from jobs.nodes import registry, workspaces
from jobs.placement import scheduler
from jobs.runs import dispatch
from tests.conftest import TEST_IMAGE

pytestmark = pytest.mark.django_db

RUN_ID = uuid.uuid4().hex[:12]  # engines keep build caches across runs of the suite
SEED_STYLE = f"""\
FROM {TEST_IMAGE}
RUN echo this-run-{RUN_ID}
# installs nothing from the network: the file and the environment are the proof
RUN mkdir -p /opt/seed && echo "baked at build time" > /opt/seed/hello.txt && echo step-two-said-hi
ENV GREETING=hello-from-env
WORKDIR /workspace
RUN echo "cwd is $(pwd)"
"""


@pytest.fixture
def hosts(make_host):
    a = make_host("gpu-a-01", engine=0, gpus=2, build_host=True, check="reuse")
    b = make_host("gpu-b-01", engine=1, gpus=2, check="reuse")
    return a, b


def _engine(host) -> docker.DockerClient:
    return docker.DockerClient(base_url=host.engine_url, timeout=30)


def _forget(host, ref: str) -> None:
    client = _engine(host)
    try:
        client.images.remove(ref, force=True)
    except docker.errors.ImageNotFound:
        pass
    client.close()


def _cluster_on(owner, image: OwnImage, host_to_avoid, name="from-own") -> Cluster:
    """A one-node cluster of `image` placed on the other host (the avoided one drained)."""
    host_services.host_set_draining(host=host_to_avoid, draining=True)
    from jobs.models import GpuModel

    cluster = services.cluster_create(
        owner=owner,
        spec=ClusterSpec(
            name=name,
            nodes=1,
            gpu_model=GpuModel.objects.get(slug="a100-80gb"),
            gpus_per_node=1,
            image_reference=image.reference,
            own_image=image,
            release_policy="never",
        ),
    )
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    host_services.host_set_draining(host=host_to_avoid, draining=False)
    return cluster


async def _receive(layer, channel):
    return await asyncio.wait_for(layer.receive(channel), timeout=60)


def _run_job(cluster, command, settle_until):
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="j", command=command))
    dispatch.dispatch(cluster.pk)
    job = settle_until(job, timeout=60)
    return job, "".join(r.log for r in job.replicas.all())


@pytest.mark.django_db(transaction=True)  # the build runs on a thread, its own connection
def test_a_seed_style_dockerfile_builds_live_is_pushed_and_pulled_where_a_cluster_lands(
    hosts, alice, settle_until
):
    a, b = hosts
    build = builds.build_create(owner=alice, name="seed", tag="v1", dockerfile=SEED_STYLE)
    assert build.state == "queued"
    # The build page's websocket listens on the build's group: a channel of our own here.
    layer = channel_layers.make_backend("default")  # the page's own, not the worker's
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(builds.group_for(build.pk), channel)

    # The worker's task, in a thread, while the page's side reads the group.
    result = []
    worker = threading.Thread(
        target=lambda: (result.append(builds.run(build.pk)), connection.close())
    )
    worker.start()
    seen, states, batches = [], [], 0
    while True:
        message = async_to_sync(_receive)(layer, channel)
        if message["type"] == "build.lines":
            batches += 1
            seen += message["lines"]
        else:
            states.append(message)
            if message["state"] in ("succeeded", "failed"):
                break
    worker.join(60)
    assert result[0].endswith("/seed:v1"), ImageBuild.objects.get(pk=build.pk).error
    build.refresh_from_db()
    assert build.state == "succeeded", build.error
    assert build.host == a and build.image is not None
    image = build.image
    assert image.reference == f"{registry.host()}/u{alice.pk}/seed:v1"
    assert image.digest.startswith("sha256:") and image.size_bytes > 0

    # The live log: every line once, numbered without a gap, in more than one message,
    # with the step being run announced as a state.
    assert [seq for seq, _ in seen] == list(range(1, len(seen) + 1))
    text = "\n".join(line for _, line in seen)
    assert "Step 3/6 : RUN mkdir -p /opt/seed" in text and "step-two-said-hi" in text
    assert "cwd is /workspace" in text and f"Pushed {image.reference}" in text
    assert batches >= 2
    assert any(s["step"].startswith("Step 4/6 : ENV") for s in states)
    assert builds.log_lines(build) == [tuple(x) for x in seen]
    build.refresh_from_db()
    assert "step-two-said-hi" in build.log  # kept on the row once finished

    # In the registry, as the console reads it.
    digest, manifest = registry.manifest(f"u{alice.pk}/seed", "v1")
    assert digest == image.digest and len(manifest["layers"]) == len(image.layers)
    # The quota counts its layers at their size on a host's disk, uncompressed.
    assert sum(n for _, n in image.layers) == image.size_bytes

    # Engine b never saw it: a cluster placed there pulls it first, with progress.
    _forget(b, image.reference)
    cluster = _cluster_on(alice, image, a)
    assert Node.objects.get(cluster=cluster).host == b
    tasks.cluster_network_ensure(cluster.pk)  # the workspace: the pull happens here
    cluster.refresh_from_db()
    pull = cluster.image_pulls["gpu-b-01"]
    assert pull["state"] == "pulled" and pull["total"] > 0 and pull["done"] == pull["total"]
    kinds = list(cluster.events.values_list("kind", flat=True))
    assert "pulling" in kinds and "pulled" in kinds
    assert registry.has_current(_engine(b), image.reference, image.digest)

    job, log = _run_job(
        cluster, "cat /opt/seed/hello.txt; echo GREETING=$GREETING; echo PWD=$(pwd)", settle_until
    )
    assert job.state == "succeeded", job.state_reason
    assert "baked at build time" in log and "GREETING=hello-from-env" in log
    services.cluster_release(cluster=cluster)


def test_run_false_fails_with_its_output_and_leaves_no_image(hosts, alice):
    dockerfile = f"FROM {TEST_IMAGE}\nRUN echo before-the-fall && false\nRUN echo never\n"
    build = builds.build_create(owner=alice, name="broken", tag="v1", dockerfile=dockerfile)
    assert builds.run(build.pk) == "failed"
    build.refresh_from_db()
    assert build.state == "failed" and build.image is None
    assert build.error.startswith("Step 2/3 : RUN echo before-the-fall && false failed:")
    assert "returned a non-zero code: 1" in build.error
    assert "before-the-fall" in build.log and "never" not in build.log.replace("echo never", "")
    assert not OwnImage.objects.filter(owner=alice).exists()
    with pytest.raises(registry.RegistryError, match="404"):
        registry.manifest(f"u{alice.pk}/broken", "v1")


@pytest.mark.engine  # the registry's configuration (own images)
def test_from_outside_the_allowed_set_is_refused_before_building(alice, bob, catalog, settings):
    cases = {
        "FROM docker.io/library/ubuntu:24.04\nRUN true\n": "none of them",
        "ARG BASE=busybox\nFROM $BASE\n": "not a build argument",
        f"FROM {TEST_IMAGE} AS a\nCOPY --from=evil/image:1 /x /x\n": "evil/image:1",
        "RUN echo no-from\n": "starts with FROM",
        # another researcher's image, even when its name is known
        f"FROM {registry.reference(alice.pk, 'seed', 'v1')}\n": "none of them",
        # a line continued: the engine joins the next line on without a space, so this is
        # `FROM <catalog image>-evil`, a tag the catalog does not have (of Suanli's own
        # namespace: refused as a name never pulled)
        f"FROM {TEST_IMAGE}\\\n-evil\nRUN true\n": "Suanli's own images",
        f"FROM {TEST_IMAGE}\nCOPY --from={TEST_IMAGE}\\\n-evil /x /x\n": "Suanli's own images",
    }
    for dockerfile, words in cases.items():
        with pytest.raises(ValidationError) as got:
            builds.build_create(owner=bob, name="x", tag="v1", dockerfile=dockerfile)
        assert words in " ".join(got.value.message_dict["dockerfile"]), dockerfile
    assert not ImageBuild.objects.exists(), "nothing queued, nothing built"
    # Stages are not images; an allowed reference from the settings is.
    builds.check_bases(bob.pk, f"FROM {TEST_IMAGE} AS base\nFROM base\nCOPY --from=0 /a /b\n")
    settings.SUANLI_BUILD_FROM_ALLOWED = ["docker.io/library/ubuntu:*"]
    builds.check_bases(bob.pk, "FROM ubuntu:24.04\n")
    # Suanli's own names are the catalog's exact images (any spelling) or refused, as on
    # the cluster form, even where the settings allow all of Docker Hub: another tag, or
    # another image of the namespace, would be whoever owns the name there.
    builds.check_bases(bob.pk, f"FROM docker.io/{TEST_IMAGE}\n")
    settings.SUANLI_BUILD_FROM_ALLOWED = ["docker.io/*"]
    for other in ("suanli/busybox:evil", "docker.io/suanli/anything:1"):
        with pytest.raises(ValidationError) as got:
            builds.check_bases(bob.pk, f"FROM {TEST_IMAGE} AS a\nCOPY --from={other} /x /x\n")
        assert "Suanli's own images" in " ".join(got.value.messages), other
    settings.SUANLI_BUILD_FROM_ALLOWED = ["docker.io/library/ubuntu:*"]
    with pytest.raises(ValidationError):
        builds.check_bases(bob.pk, "FROM debian:12\n")
    # Bad names, tags, folders and arguments are refused by field.
    with pytest.raises(ValidationError) as got:
        builds.build_create(
            owner=bob,
            name="Bad Name",
            tag="-x",
            dockerfile=f"FROM {TEST_IMAGE}\n",
            context="../etc",
            build_args={"1bad": "x"},
        )
    assert set(got.value.message_dict) == {"name", "tag", "context", "build_args"}
    # A build argument the engine reads itself (BUILDKIT_SYNTAX names a frontend image
    # BuildKit would pull) is refused.
    with pytest.raises(ValidationError) as got:
        builds.build_create(
            owner=bob, name="x", tag="v1", dockerfile=f"FROM {TEST_IMAGE}\n",
            build_args={"BUILDKIT_SYNTAX": "127.0.0.1:5000/frontend:1"},
        )  # fmt: skip
    assert "BUILDKIT_" in got.value.message_dict["build_args"][0]


def test_a_file_written_in_a_workspace_is_in_the_image_saved_from_it(
    hosts, make_cluster, alice, settle_until
):
    a, b = hosts
    cluster = make_cluster(alice, "ws", nodes=1, gpus=1, release_policy="never", volumes=())
    scheduler.place_pending()
    cluster.refresh_from_db()
    tasks.cluster_network_ensure(cluster.pk)
    node = Node.objects.get(cluster=cluster, released_at__isnull=True)
    container = _engine(node.host).containers.get(workspaces.container_name(cluster.pk, 0))
    code, _ = container.exec_run(
        ["/bin/sh", "-c", "echo made-in-the-workspace > /tmp/mine.txt"],
        user=container.attrs["Config"]["User"],
    )
    assert code == 0
    build = builds.save_create(owner=alice, cluster=cluster, node_index=0, name="saved", tag="v1")
    with pytest.raises(ValidationError, match="being saved already"):
        builds.save_create(owner=alice, cluster=cluster, node_index=0, name="saved", tag="v2")
    assert builds.run(build.pk).endswith("/saved:v1"), ImageBuild.objects.get(pk=build.pk).error
    build.refresh_from_db()
    image = build.image
    assert image.source == "save" and "node 0" in image.source_note
    assert build.host == node.host

    # The image has the original image's settings, not the workspace's (its cluster's GPU
    # indices, the platform's variables and labels are not baked in).
    other = b if node.host == a else a
    _forget(other, image.reference)
    services.cluster_release(cluster=cluster)
    fresh = _cluster_on(alice, image, node.host, name="from-save")
    tasks.cluster_network_ensure(fresh.pk)
    pulled = _engine(other).images.get(image.reference).attrs["Config"]
    original = _engine(other).images.get(TEST_IMAGE).attrs["Config"]
    assert pulled.get("Env") == original.get("Env")
    assert not any(k.startswith("suanli.") for k in (pulled.get("Labels") or {}))
    job, log = _run_job(fresh, "cat /tmp/mine.txt", settle_until)
    assert "made-in-the-workspace" in log, log
    services.cluster_release(cluster=fresh)


def test_delete_is_refused_while_used_and_then_removes_it_from_the_registry(hosts, alice):
    a, b = hosts
    build = builds.build_create(
        owner=alice, name="doomed", tag="v1", dockerfile=f"FROM {TEST_IMAGE}\nRUN echo x > /x\n"
    )
    builds.run(build.pk)
    image = OwnImage.objects.get(owner=alice, name="doomed")
    cluster = _cluster_on(alice, image, b, name="user")
    with pytest.raises(ValidationError, match="used by cluster user"):
        builds.delete(owner=alice, image=image)
    services.cluster_release(cluster=cluster)
    builds.delete(owner=alice, image=image)
    assert not OwnImage.objects.filter(pk=image.pk).exists()
    with pytest.raises(registry.RegistryError, match="404"):
        registry.manifest(f"u{alice.pk}/doomed", "v1")
    assert builds.quota(alice).count == 0


def test_a_build_over_its_time_limit_is_stopped_with_a_message(hosts, alice, settings):
    a, _ = hosts
    settings.SUANLI_BUILD_TIMEOUT_S = 3
    dockerfile = f"FROM {TEST_IMAGE}\nRUN echo started-sleeping && sleep 60\n"
    build = builds.build_create(owner=alice, name="slow", tag="v1", dockerfile=dockerfile)
    assert builds.run(build.pk) == "failed"
    build.refresh_from_db()
    assert build.error.startswith("stopped: the build ran over its time limit of 3 s")
    assert "started-sleeping" in build.log
    client = _engine(a)
    import time

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # the engine kills and removes the step's container
        left = [c for c in client.containers.list(all=True) if "sleep 60" in str(c.attrs["Args"])]
        if not left:
            break
        time.sleep(0.5)
    assert not left
    assert not OwnImage.objects.exists()


def test_a_build_step_reaches_neither_the_host_nor_the_registry(hosts, alice):
    """A RUN step is the researcher's code on the build host: the build network keeps it
    off the host's services and the private networks (the registry among them)."""
    reg_host, _, reg_port = registry.host().partition(":")
    dockerfile = (
        f"FROM {TEST_IMAGE}\n"
        f"RUN echo {RUN_ID} && (nc -w 2 {reg_host} {reg_port} </dev/null && echo REACHED-REGISTRY || echo no-registry); "
        f"(nc -w 2 {hosts[0].address} 2377 </dev/null && echo REACHED-HOST || echo no-host); "
        "cat /proc/self/status | grep CapEff\n"
    )
    build = builds.build_create(owner=alice, name="probe", tag="v1", dockerfile=dockerfile)
    builds.run(build.pk)
    build.refresh_from_db()
    said = build.log.splitlines()
    assert "no-registry" in said and "no-host" in said, build.log
    assert "REACHED-REGISTRY" not in said and "REACHED-HOST" not in said


def test_one_researchers_build_cache_is_never_anothers(hosts, alice, bob):
    """A cache hit on another tenant's step would tell what they built (and hand over
    their layer): the engine reuses only the researcher's own images' steps."""
    dockerfile = f"FROM {TEST_IMAGE}\nRUN echo secret-step-{uuid.uuid4().hex}\nRUN echo two\n"
    first = builds.build_create(owner=alice, name="mine", tag="v1", dockerfile=dockerfile)
    builds.run(first.pk)
    again = builds.build_create(owner=alice, name="mine", tag="v2", dockerfile=dockerfile)
    builds.run(again.pk)
    theirs = builds.build_create(owner=bob, name="guess", tag="v1", dockerfile=dockerfile)
    builds.run(theirs.pk)
    logs = {b.pk: b.log for b in ImageBuild.objects.all()}
    assert all(ImageBuild.objects.filter(state="succeeded").count() == 3 for _ in [0])
    assert "Using cache" not in logs[first.pk]
    assert "Using cache" in logs[again.pk], "one's own cache is used"
    assert "Using cache" not in logs[theirs.pk], logs[theirs.pk]


@pytest.mark.engine  # the registry's configuration (own images)
def test_a_researcher_has_at_most_two_builds_at_a_time_and_crlf_is_a_line_end(alice, bob, catalog):
    """No one fills the build hosts' queue for everyone else (SUANLI_BUILDS_PER_RESEARCHER);
    a browser's CRLF line ends are plain line ends, while a lone CR, another space or a
    parser directive is refused (the engine's parser would read them otherwise)."""
    crlf = f"FROM {TEST_IMAGE}\r\nRUN echo one\r\n"
    for n in range(2):
        builds.build_create(owner=alice, name=f"q{n}", tag="v1", dockerfile=crlf)
    with pytest.raises(ValidationError, match="2 builds queued or running"):
        builds.build_create(owner=alice, name="q2", tag="v1", dockerfile=crlf)
    builds.build_create(owner=bob, name="q0", tag="v1", dockerfile=crlf)  # bob's own two
    assert ImageBuild.objects.get(owner=alice, name="q0").dockerfile == crlf.replace("\r", "")
    for bad, words in {
        f"FROM {TEST_IMAGE}\rFROM x\n": "U+000D",
        f"FROM {TEST_IMAGE}\nRUN echo \\\u00a0\n": "U+00A0",
        f"# escape=`\nFROM {TEST_IMAGE}\n": "parser directives",
        f"FROM {TEST_IMAGE}\nONBUILD RUN id\n": "ONBUILD",
    }.items():
        with pytest.raises(ValidationError) as got:
            builds.build_create(owner=bob, name="bad", tag="v1", dockerfile=bad)
        assert words in " ".join(got.value.messages), bad


def _left_on(client: docker.DockerClient, marker: str, since: float) -> list[str]:
    """The images (tagged or dangling) on an engine made since `since` by a build whose
    steps name `marker`: what a build left behind. Other builds may run on the test
    engines meanwhile, so the engine's images are told apart by their history."""
    found = []
    for image in client.images.list(all=True):
        created = datetime.fromisoformat(image.attrs["Created"].replace("Z", "+00:00"))
        if created.timestamp() < since - 5:
            continue
        try:
            history = client.api.history(image.id)
        except docker.errors.NotFound:
            continue
        if any(marker in (h.get("CreatedBy") or "") for h in history):
            found.append(image.id[7:19])
    return found


def test_a_build_writing_past_its_limit_is_stopped_while_it_runs(hosts, alice, settings):
    """SUANLI_BUILD_MAX_BYTES bounds what a build writes on its host: a step writing past
    it is cut off while it runs (not when it ends: this one would sleep a minute more),
    its container and the step images before it are gone from the build host."""
    a, _ = hosts
    settings.SUANLI_BUILD_MAX_BYTES = 50_000_000
    settings.SUANLI_BUILD_POLL_S = 0.5
    marker = f"{RUN_ID}-limit"
    dockerfile = (
        f"FROM {TEST_IMAGE}\nRUN echo {marker} > /first\n"
        f"RUN echo {marker} && head -c 200000000 /dev/zero > /big && sleep 60 && "
        "echo slept-$((6*7))\n"
    )
    since = time.time()
    build = builds.build_create(owner=alice, name="toobig", tag="v1", dockerfile=dockerfile)
    assert builds.run(build.pk) == "failed"
    build.refresh_from_db()
    assert build.error.startswith("stopped: the build wrote"), build.error
    assert "more than its limit of 50 MB (SUANLI_BUILD_MAX_BYTES), at Step 3/3" in build.error
    assert "slept-42" not in build.log and "Removed the build's local copies" in build.log
    client = _engine(a)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # the engine kills and removes the step's container
        left = [c.id for c in client.containers.list(all=True) if marker in str(c.attrs["Args"])]
        if not left:
            break
        time.sleep(0.5)
    assert not left, "the step's container stays"
    assert not _left_on(client, marker, since), "the build's step images stay"
    assert not OwnImage.objects.exists()

    # The step's own output may look like the engine's (a new step, a cached one): it
    # hides nothing of what the step writes.
    decoy = f"{marker}-decoy"
    dockerfile = (
        f"FROM {TEST_IMAGE}\nRUN echo {decoy} > /first\n"
        f"RUN echo ' ---> Using cache'; echo 'Step 9/9 : ENV {decoy}=1'; echo ' ---> Running in "
        f"{'0' * 64}'; head -c 200000000 /dev/zero > /big && sleep 60 && echo slept-$((6*7))\n"
    )
    build = builds.build_create(owner=alice, name="decoy", tag="v1", dockerfile=dockerfile)
    assert builds.run(build.pk) == "failed"
    build.refresh_from_db()
    assert build.error.startswith("stopped: the build wrote"), build.error
    assert "slept-42" not in build.log
    assert not _left_on(client, decoy, since), "the build's step images stay"


def test_a_1_gb_build_is_counted_at_its_size_and_no_engine_keeps_a_copy(
    hosts, alice, settings, work_queue
):
    """A layer of 1 GB of zeros is about 1 MB in the registry and 1 GB on every host that
    pulls it: the quota counts it at 1 GB, before the next image is pushed. The build host
    keeps no copy once it is pushed, and a deleted image goes from every engine that has
    it (the build host and the host that pulled it)."""
    a, b = hosts
    marker = f"{RUN_ID}-big"
    since = time.time()
    build = builds.build_create(
        owner=alice, name="big", tag="v1",
        dockerfile=f"FROM {TEST_IMAGE}\nRUN echo {marker} && head -c 1000000000 /dev/zero > /z\n",
    )  # fmt: skip
    assert builds.run(build.pk).endswith("/big:v1"), ImageBuild.objects.get(pk=build.pk).error
    image = OwnImage.objects.get(owner=alice, name="big")
    assert image.size_bytes >= 1_000_000_000, image.size_bytes
    assert builds.quota(alice).bytes >= 1_000_000_000
    _digest, manifest = registry.manifest(f"u{alice.pk}/big", "v1")
    stored = sum(n for _, n in registry.layers_of(manifest))
    assert stored < 100_000_000, f"zeros compress: {stored} bytes in the registry"
    ca, cb = _engine(a), _engine(b)
    assert not _left_on(ca, marker, since), "the build host kept the pushed image"

    # Counted before the push: 5 MB more would pass the quota (1 GB + busybox + 3 MB).
    settings.SUANLI_IMAGE_QUOTA_GB = (builds.quota(alice).bytes + 3_000_000) / 1e9
    small = builds.build_create(
        owner=alice, name="small", tag="v1",
        dockerfile=f"FROM {TEST_IMAGE}\nRUN echo {marker} && head -c 5000000 /dev/urandom > /s\n",
    )  # fmt: skip
    assert builds.run(small.pk) == "failed"
    small.refresh_from_db()
    assert "so it was not pushed" in small.error, small.error
    with pytest.raises(registry.RegistryError, match="404"):
        registry.manifest(f"u{alice.pk}/small", "v1")
    assert not _left_on(ca, marker, since), "the refused image stays on the build host"

    # Another host pulls it (a cluster there); a delete takes it off both engines.
    registry.pull(cb, image.reference)
    assert registry.has_current(cb, image.reference)
    builds.delete(owner=alice, image=image)
    work_queue("builds")
    assert not registry.has_current(cb, image.reference), "the host that pulled it keeps it"
    assert not registry.has_current(ca, image.reference)
    assert not _left_on(ca, marker, since) and not _left_on(cb, marker, since)


def test_a_build_naming_more_steps_than_it_has_is_stopped(hosts, alice):
    """A step that prints thousands of made-up step images would push the engine's real
    ones out of what the disk limit can follow: past what any Dockerfile makes, it stops."""
    marker = f"{RUN_ID}-flood"
    dockerfile = (
        f"FROM {TEST_IMAGE}\nRUN echo {marker}; i=0; while [ $i -lt 5000 ]; do i=$((i+1)); "
        'echo " ---> $(printf %064x $i)"; done; sleep 60; echo slept-$((6*7))\n'
    )
    build = builds.build_create(owner=alice, name="flood", tag="v1", dockerfile=dockerfile)
    assert builds.run(build.pk) == "failed"
    build.refresh_from_db()
    assert build.error.startswith("stopped: the build's output named more than"), build.error
    assert "slept-42" not in build.log


def test_a_build_whose_worker_died_leaves_no_tag_on_its_host(hosts, alice, work_queue):
    """The sweep ends a build whose worker died; the image the build tagged on its host
    (before a push that never came) goes too."""
    a, _ = hosts
    build = builds.build_create(
        owner=alice, name="orphan", tag="v1", dockerfile=f"FROM {TEST_IMAGE}\n"
    )
    reference = registry.reference(alice.pk, "orphan", "v1")
    client = _engine(a)
    client.images.get(TEST_IMAGE).tag(reference)  # what the build had made when it died
    long_ago = datetime.fromtimestamp(0).astimezone()
    ImageBuild.objects.filter(pk=build.pk).update(state="running", host=a, started_at=long_ago)
    assert builds.sweep_stuck() == 1
    work_queue("builds")
    build.refresh_from_db()
    assert build.state == "failed" and "worker stopped" in build.error
    assert not registry.has_current(client, reference), "the dead build's tag stays"
    assert registry.has_current(client, TEST_IMAGE)

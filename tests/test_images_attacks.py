"""Attacks on own images by another researcher (docs/threat-model.md):
bob knows the name of alice's image and writes Dockerfiles, context folders and build
output meant to reach it, hang the build worker or flood Redis. Real engines, the real
registry, the real worker code (jobs/images/builds.py)."""

import os
import subprocess
import sys
import threading
import time
import types
import uuid

import pytest
from django.core.exceptions import ValidationError

from jobs.images import builds
from jobs.models import ImageBuild, OwnImage
from jobs.nodes import registry
from tests.conftest import TEST_IMAGE

pytestmark = pytest.mark.django_db

RUN_ID = uuid.uuid4().hex[:12]


@pytest.fixture
def build_host(make_host):
    return make_host("gpu-a-01", engine=0, gpus=2, build_host=True, check="reuse")


def _alices_secret_image(alice) -> tuple[str, str]:
    """Alice's image with a secret file, built (and so left tagged) on the build host."""
    secret = f"ALICE-SECRET-{uuid.uuid4().hex}"
    build = builds.build_create(
        owner=alice,
        name="private",
        tag="v1",
        dockerfile=f"FROM {TEST_IMAGE}\nRUN echo {secret} > /secret.txt\n",
    )
    assert builds.run(build.pk).endswith("/private:v1"), ImageBuild.objects.get(pk=build.pk).error
    return registry.reference(alice.pk, "private", "v1"), secret


def _bob_builds(bob, name, dockerfile) -> tuple[str, str]:
    """('refused', reason) or (build state, build log) of bob's build of `dockerfile`."""
    try:
        build = builds.build_create(owner=bob, name=name, tag="v1", dockerfile=dockerfile)
    except ValidationError as exc:
        return "refused", " ".join(exc.messages)
    builds.run(build.pk)
    build.refresh_from_db()
    return build.state, build.log


def test_no_spelling_of_a_dockerfile_builds_from_anothers_image(build_host, alice, bob):
    """The engine's Dockerfile parser, not ours, decides what FROM / COPY --from name: a
    tab after the instruction, a non-ASCII space after a line's backslash, or an escape
    directive make ours miss an instruction that the engine runs, and alice's image is on
    the build host (every build leaves its image tagged there)."""
    ref, secret = _alices_secret_image(alice)
    base = TEST_IMAGE
    tricks = {
        "tab-after-FROM": f"FROM {base}\nFROM\t{ref}\nRUN cat /secret.txt # {RUN_ID}\n",
        "tab-after-COPY": (
            f"FROM {base}\nCOPY\t--from={ref} /secret.txt /s\nRUN cat /s # {RUN_ID}\n"
        ),
        "nbsp-after-backslash": (
            f"FROM {base}\nRUN echo hi \\\u00a0\nFROM {ref}\nRUN cat /secret.txt # {RUN_ID}\n"
        ),
        "escape-directive": (
            f"# escape=`\nFROM {base}\nRUN echo hi \\\nFROM {ref}\nRUN cat /secret.txt # {RUN_ID}\n"
        ),
    }
    leaked = {}
    for i, (trick, dockerfile) in enumerate(tricks.items()):
        dockerfile = dockerfile.replace(RUN_ID, f"{RUN_ID}-{i}")  # no step cached from another
        state, said = _bob_builds(bob, f"trick{i}", dockerfile)
        if secret in said:
            leaked[trick] = state
    assert not leaked, f"bob read alice's image through {leaked} (build state per trick)"


def test_an_onbuild_trigger_of_ones_own_image_does_not_reach_anothers(build_host, alice, bob):
    """ONBUILD COPY --from=<alice's image> in bob's first image is not checked; the
    classic builder runs the trigger when bob's second build starts FROM his own image."""
    ref, secret = _alices_secret_image(alice)
    first, _ = _bob_builds(
        bob, "trap", f"FROM {TEST_IMAGE}\nONBUILD COPY --from={ref} /secret.txt /s\n"
    )
    second, said = _bob_builds(
        bob,
        "sprung",
        f"FROM {registry.reference(bob.pk, 'trap', 'v1')}\nRUN cat /s # {RUN_ID}\n",
    )
    assert secret not in said, f"bob read alice's image through ONBUILD ({first}, {second})"


@pytest.mark.django_db(transaction=True)  # the context is read on a thread, its own connection
def test_a_fifo_swapped_into_the_context_does_not_hang_the_build_worker(
    bob, storage_root, monkeypatch
):
    """The researcher writes the context folder from a container while it is tarred: a
    regular file renamed over by a FIFO between the worker's stat and its open blocks
    open() until a writer comes (the build's time limit has not started yet). The rename
    is made to land in that window (os.stat wrapped), as a tenant looping `mv` would."""
    folder = storage_root / f"u{bob.pk}" / "ctx"
    folder.mkdir(parents=True)
    target = folder / "data.bin"
    target.write_text("x")
    real_stat = os.stat
    swapped = []

    def stat_then_swap(path, *args, **kwargs):
        got = real_stat(path, *args, **kwargs)
        if path == "data.bin" and not swapped:
            swapped.append(1)
            os.mkfifo(folder / ".swap")
            os.rename(folder / ".swap", target)  # what the tenant's container does
        return got

    monkeypatch.setattr(os, "stat", stat_then_swap)
    build = types.SimpleNamespace(owner_id=bob.pk, context="ctx", dockerfile=f"FROM {TEST_IMAGE}\n")
    done = []
    worker = threading.Thread(target=lambda: done.append(builds._context_tar(build)), daemon=True)
    worker.start()
    worker.join(10)
    monkeypatch.undo()
    hung = not done
    while worker.is_alive():  # let the stuck open() go: a writer on the FIFO
        try:
            os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        worker.join(0.2)
    assert swapped
    assert not hung, "the build worker hung in open() on a FIFO of the context folder"


def test_a_flooding_build_keeps_a_bounded_log_in_redis(build_host, bob, settings):
    """20,000 lines of 4,000 characters (80 MB): the Redis list kept for the build page
    stays within a few times SUANLI_BUILD_LOG_BYTES, not the whole flood for an hour."""
    dockerfile = (
        f"FROM {TEST_IMAGE}\n"
        f'RUN echo {RUN_ID}; yes "$(head -c 3999 /dev/zero | tr "\\0" a)" | head -n 20000\n'
    )
    build = builds.build_create(owner=bob, name="flood", tag="v1", dockerfile=dockerfile)
    started = time.monotonic()
    builds.run(build.pk)
    key = builds._log_key(build.pk)
    kept = builds._redis().memory_usage(key) or 0
    ttl = builds._redis().ttl(key)
    assert kept <= 4 * settings.SUANLI_BUILD_LOG_BYTES, (
        f"one build keeps {kept / 1e6:.0f} MB in Redis for {ttl} s "
        f"(built in {time.monotonic() - started:.0f} s)"
    )


def test_a_replaced_image_leaves_no_unaccounted_manifest_in_the_registry(build_host, bob):
    """Pushing the same name:tag again replaces the row the quota counts; the old manifest
    (and its layers) must not stay in the registry, or the quota holds nothing back."""
    digests = []
    for n in range(2):
        state, said = _bob_builds(
            bob, "again", f"FROM {TEST_IMAGE}\nRUN head -c 200000 /dev/urandom > /blob{n}\n"
        )
        assert state == "succeeded", said
        digests.append(OwnImage.objects.get(owner=bob, name="again").digest)
    assert digests[0] != digests[1]
    image = OwnImage.objects.get(owner=bob, name="again")
    builds.delete(owner=bob, image=image)
    repo = registry.repository(bob.pk, "again")
    still = []
    for digest in digests:
        try:
            registry.manifest(repo, digest)
            still.append(digest[:19])
        except registry.RegistryError:
            pass
    assert not still, f"manifests left in the registry, counted by no quota: {still}"


# -- ADD <url>: the engine fetching on a build's behalf ----------------------------------

CANARY = r"""
import http.server, sys
class Canary(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with open(sys.argv[3], "a") as seen:
            seen.write(self.path + "\n")
        self.send_response(200); self.end_headers(); self.wfile.write(b"CANARY-BODY\n")
    do_HEAD = do_GET
    def log_message(self, *args): pass
http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), Canary).serve_forever()
"""


def _env_list(name):
    value = [v for v in os.environ.get(name, "").split(",") if v]
    if not value:
        pytest.fail(f"{name} is not set: run the suite with `make test` (.ci/services.sh)")
    return value


@pytest.fixture
def canaries(tmp_path):
    """Two HTTP canaries the build engine (engine a) could fetch from: one on its own
    loopback (inside its network namespace, where dockerd runs) and one on the hosts'
    address it reaches. Each writes every path asked for to its file; before the attack,
    the engine's namespace fetches `/alive` from both, so a canary that hears nothing
    later proves the check, not a dead canary."""
    netns = _env_list("SUANLI_TEST_ENGINE_NETNS")[0]
    gateway = _env_list("SUANLI_TEST_HOSTS_GATEWAY")[0]
    port = 18300 + os.getpid() % 500
    seen = {"loopback": tmp_path / "loopback.txt", "gateway": tmp_path / "gateway.txt"}
    for path in seen.values():
        path.write_text("")
    procs = [
        subprocess.Popen(
            ["nsenter", f"--net=/var/run/netns/{netns}", sys.executable, "-c", CANARY,
             "127.0.0.1", str(port), str(seen["loopback"])]
        ),
        subprocess.Popen([sys.executable, "-c", CANARY, gateway, str(port), str(seen["gateway"])]),
    ]  # fmt: skip
    urls = {"loopback": f"127.0.0.1:{port}", "gateway": f"{gateway}:{port}"}
    try:
        deadline = time.monotonic() + 15
        for name, addr in urls.items():
            while True:  # from inside the engine's namespace, as dockerd would ask
                got = subprocess.run(
                    ["nsenter", f"--net=/var/run/netns/{netns}", sys.executable, "-c",
                     "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], "
                     "timeout=3).read().decode())", f"http://{addr}/alive"],
                    capture_output=True, text=True, timeout=10,
                )  # fmt: skip
                if "CANARY-BODY" in got.stdout:
                    break
                assert time.monotonic() < deadline, f"the {name} canary is not up: {got.stderr}"
                time.sleep(0.2)
        yield {"urls": urls, "heard": lambda: {k: p.read_text().split() for k, p in seen.items()}}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_no_spelling_of_add_makes_the_engine_fetch_from_the_hosts_networks(
    build_host, bob, canaries
):
    """The classic builder downloads `ADD <url>` inside dockerd: in the build host's own
    network namespace, not on the firewalled build network, so the console's admin page on
    the host's loopback came into the image. Every spelling is refused at build_create
    with the sentence saying how to download in RUN; a build forced past build_create (its
    row written directly) is refused again by the worker, and no canary hears a request."""
    lo, gw = canaries["urls"]["loopback"], canaries["urls"]["gateway"]
    spellings = {
        "plain": f"ADD http://{lo}/plain /got.txt",
        "lower-case": f"add http://{gw}/lower /got.txt",
        "upper-case scheme": f"ADD HTTP://{lo}/upper /got.txt",
        "json": f'ADD ["http://{gw}/json", "/got.txt"]',
        "json, escaped": f'ADD ["\\u0068ttp://{lo}/json-escaped", "/got.txt"]',
        # Not JSON as a whole (text after the array): the engine splits at spaces instead.
        "json, then a word": 'ADD ["x"] http:${E}//' + gw + "/after-json /got/",
        "--chown first": f"ADD --chown=1000:1000 http://{lo}/chown /got.txt",
        "--checksum first": f"ADD --checksum=sha256:{'0' * 64} http://{gw}/checksum /got.txt",
        "quoted flag": f'ADD "--chown=1 2" http://{lo}/quoted-flag /got.txt',
        "continued": f"ADD http:/\\\n/{lo}/continued /got.txt",
        "continued after a comment": f"ADD ht\\\n# a comment\ntp://{gw}/comment /got.txt",
        "quotes in the word": f'ADD h"tt"p://{lo}/quotes /got.txt',
        "backslash in the word": f"ADD http:/\\/{lo}/backslash /got.txt",
        "ftp": f"ADD ftp://{gw}/ftp /got.txt",
        "git remote": f"ADD git@{gw.split(':')[0]}:repo.git /src",
        "git scheme": f"ADD git://{gw}/repo.git /src",
        "variable": "ARG URL\nADD $URL /got.txt",
        "braced variable": "ARG A=http\nADD ${A}://" + lo + "/braced /got.txt",
        "ENV variable": f"ENV U=http://{lo}/env\nADD $U /got.txt",
        "onbuild": f"ONBUILD ADD http://{lo}/onbuild /got.txt",
        "second stage": f"FROM {TEST_IMAGE} AS two\nADD http://{gw}/second /got.txt",
    }
    args = {"URL": f"http://{lo}/variable"}
    let_through = {}
    for i, (spelling, lines) in enumerate(spellings.items()):
        dockerfile = f"FROM {TEST_IMAGE}\n{lines}\nRUN echo {RUN_ID}-{i}\n"
        try:
            builds.build_create(
                owner=bob, name=f"fetch{i}", tag="v1", dockerfile=dockerfile, build_args=args
            )
            let_through[spelling] = "queued"
        except ValidationError as exc:
            said = " ".join(exc.messages)
            if "RUN curl -fsSLo /got.txt" not in said:
                let_through[spelling] = said
    assert not let_through, f"not refused with the sentence: {let_through}"
    assert not ImageBuild.objects.exists()
    # A parser directive is refused before ADD is read (the engine's parser would read
    # the lines otherwise).
    with pytest.raises(ValidationError, match="parser directives"):
        builds.build_create(
            owner=bob, name="escape", tag="v1",
            dockerfile=f"# escape=`\nFROM {TEST_IMAGE}\nADD http:/`\n/{lo}/escape /got.txt\n",
        )  # fmt: skip

    # Forced through: the worker gets rows build_create never saw.
    forced = {
        "variable": ("ARG URL\nADD $URL /got.txt", {"URL": f"http://{lo}/forced-variable"}),
        "braced": ("ARG A\nADD ${A}://" + gw + "/forced-braced /got.txt", {"A": "http"}),
        "plain": (f"ADD http://{lo}/forced-plain /got.txt", {}),
    }
    states = {}
    for i, (spelling, (lines, build_args)) in enumerate(forced.items()):
        build = ImageBuild.objects.create(
            owner=bob, name=f"forced{i}", tag="v1", build_args=build_args,
            dockerfile=f"FROM {TEST_IMAGE}\n{lines}\nRUN cat /got.txt # {RUN_ID}-{i}\n",
        )  # fmt: skip
        builds.run(build.pk)
        build.refresh_from_db()
        states[spelling] = (build.state, "CANARY-BODY" in build.log)
    heard = {k: [p for p in v if p != "/alive"] for k, v in canaries["heard"]().items()}
    assert heard == {"loopback": [], "gateway": []}, f"the engine fetched {heard} ({states})"
    assert all(state == ("failed", False) for state in states.values()), states
    assert not OwnImage.objects.filter(owner=bob).exists()

"""bench/join: join-to-active seconds of a fresh host, beside a bare start of the same
host's engine in the same run.

The fresh host is a machine of namespaces on the test fleet's bridge (tests/third_host.py,
as tests/test_host_join.py makes it): nothing set up but what this machine has installed.
"Join" is `curl -fsSL CONSOLE/hosts/join.sh | sudo sh -s -- TOKEN` run there until it
prints that the host is active: the engine's key and signed certificate, the engine
restarted with TLS, the tenant firewall, the swarm, the researchers' filesystem, the helper
images streamed from another host, the registration and the first host check (run by this
process as an idle worker would, from the `docker` queue). "Bare" is the same engine
started on the same host (its data root fresh) until it answers, with none of that.
Then the host leaves and everything of it goes.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402

django.setup()

import docker  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.test import override_settings  # noqa: E402
from pytest_django.live_server_helper import LiveServer  # noqa: E402

from bench.common import register_host  # noqa: E402
from jobs.hosts import joins  # noqa: E402
from jobs.hosts import services as host_services
from jobs.models import Host  # noqa: E402
from jobs.placement.catalog import seed_catalog  # noqa: E402
from tests import third_host as third  # noqa: E402

ENGINE = [u for u in os.environ["SUANLI_TEST_ENGINES"].split(",") if u][0]


def bare_engine_start(run: Path) -> float:
    """The host's engine started as join.sh starts it, until it answers; then stopped."""
    started = time.perf_counter()
    subprocess.run(
        third.in_third("sh", str(run / "dockerd.sh"), str(run)),
        env={**os.environ, "SUANLI_DOCKERD_ARGS": f"--host unix://{run}/docker.sock"},
        check=True,
    )
    while True:
        try:
            client = docker.DockerClient(base_url=f"unix://{run}/docker.sock", timeout=5)
            client.ping()
            break
        except Exception:  # not up yet
            if time.perf_counter() - started > 120:
                sys.exit("bench/join: the bare engine did not answer in 120 s")
            time.sleep(0.05)
    took = time.perf_counter() - started
    client.close()
    pid = int((run / "docker.pid").read_text())
    os.kill(pid, 15)
    while (
        Path(f"/proc/{pid}").exists()
        and "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    ):
        time.sleep(0.1)
    (run / "docker.pid").unlink(missing_ok=True)  # dockerd removes it as it ends
    subprocess.run(third.in_third("sh", "-c", f'rm -rf "{run}/data/"*'), check=False)
    return took


def main() -> None:
    seed_catalog()
    Host.all_objects.filter(name="bench-join").delete()
    register_host("bench-0", ENGINE, gpus=8)  # the swarm's manager, with the helper images
    host_services.host_check(host_id=Host.objects.get(name="bench-0").pk)
    operator, _ = get_user_model().objects.get_or_create(username="bench-join-operator")
    run = third.make()
    server = LiveServer(f"{third.GATEWAY}:0")
    try:
        with override_settings(
            ALLOWED_HOSTS=["*"],
            SUANLI_JOIN_URL=server.url,
            SUANLI_STORAGE_MOUNT=os.environ["SUANLI_STORAGE_ROOT"],
        ):
            bare = bare_engine_start(run)
            _, token = joins.token_create(by=operator, zone="zone-a")
            started = time.perf_counter()
            code, out = third.run_on_third(
                f"curl -fsSL {server.url}/hosts/join.sh | sudo sh -s -- {token}",
                name="bench-join",
                echo=False,
            )
            took = time.perf_counter() - started
            if code != 0 or "is active" not in out:
                sys.exit(f"bench/join: the join failed ({code}):\n{out}")
            code, out = third.run_on_third(
                f"curl -fsSL {server.url}/hosts/join.sh | sh -s -- leave",
                name="bench-join",
                echo=False,
            )
            if code != 0:
                sys.exit(f"bench/join: the leave failed ({code}):\n{out}")
    finally:
        server.stop()
        third.tear_down()
    print(
        json.dumps(
            {
                "bench": "join",
                "case": "join_to_active",
                "join_s": round(took, 2),
                "bare_engine_start_s": round(bare, 2),
                "join_vs_bare": round(took / bare, 1),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()

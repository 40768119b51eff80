"""bench/gateway: the SSH gateway (jobs/access/ssh.py) as the Procfile runs it, against a 1-node
cluster's workspace on a test engine, beside `docker exec` on the same engine in
the same run.

Cases, one JSON line each:
- first_byte: seconds from starting `ssh -p PORT cN-0@127.0.0.1 'echo ready'` (the real
  OpenSSH client: TCP, key exchange, public-key authentication, the gateway's checks, the
  engine's exec) to the first byte of the command's output, beside the same command by
  `docker -H ENGINE exec -u UID CONTAINER sh -c 'echo ready'` (the CLI's own start, the
  engine's exec). RUNS of each, alternately, after one warm-up of each; ratio of medians.
- sessions: SESSIONS concurrent `ssh cN-0@... sh` sessions, each typing one command a
  second for SECONDS seconds (and reading its answer); the gateway process's CPU over
  that span (utime + stime from /proc, in cores) and each command's round trip.
"""

import json
import os
import selectors
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402

django.setup()

from django.contrib.auth import get_user_model  # noqa: E402

from bench.common import register_host  # noqa: E402
from jobs import tasks  # noqa: E402
from jobs.clusters import services
from jobs.models import GpuModel, Image, SshKey  # noqa: E402
from jobs.nodes import runtime, workspaces
from jobs.placement import scheduler
from jobs.placement.catalog import seed_catalog  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RUNS = int(os.environ.get("BENCH_RUNS", 15))
SESSIONS = int(os.environ.get("BENCH_SESSIONS", 50))
SECONDS = int(os.environ.get("BENCH_SECONDS", 10))
ENGINE = [u for u in os.environ["SUANLI_TEST_ENGINES"].split(",") if u][0]
IMAGE = os.environ.get("SUANLI_TEST_IMAGE", "suanli/busybox:latest")
TICK = os.sysconf("SC_CLK_TCK")


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup(folder: Path):
    seed_catalog()
    register_host("bench-gw", ENGINE, gpus=8)
    owner, _ = get_user_model().objects.get_or_create(username="bench-gateway")
    for cluster in owner.clusters.exclude(state="released"):  # an earlier, interrupted run
        services.cluster_release(cluster=cluster)
        tasks.cluster_network_remove(cluster.pk)
    key = folder / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    SshKey.objects.filter(owner=owner).delete()
    public_key = (folder / "id_ed25519.pub").read_text()
    row = services.ssh_key_add(owner=owner, name="bench", public_key=public_key)
    spec = services.ClusterSpec(
        name="bench-gateway", nodes=1, gpu_model=GpuModel.objects.get(slug="a100-80gb"),
        gpus_per_node=1, image=Image.objects.get(reference=IMAGE), release_policy="never",
        ssh_keys=(row,),
    )  # fmt: skip
    cluster = services.cluster_create(owner=owner, spec=spec)
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    return cluster, running_workspace(cluster), key


def running_workspace(cluster, timeout_s: float = 60):
    """Node 0's workspace once it runs: the placement's task starts it (and, as the
    reconciler does, again while it is not up yet); what it last said when it never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        said = tasks.cluster_network_ensure(cluster.pk)
        try:
            return workspaces.running(cluster, 0)
        except workspaces.WorkspaceError as exc:
            if time.monotonic() > deadline:
                raise SystemExit(f"bench/gateway: no workspace: {exc} ({said})") from None
        time.sleep(0.5)


def start_gateway(folder: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {
        **os.environ,
        "SUANLI_SSH_PORT": str(port),
        "SUANLI_SSH_HOST_KEY": str(folder / "host_key"),
        "SUANLI_SSH_MAX_SESSIONS": str(SESSIONS + 10),
        "LOG_LEVEL": "WARNING",
    }
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "suanli_gateway"], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=open(folder / "gateway.log", "w"),  # noqa: SIM115
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                if s.recv(8).startswith(b"SSH-"):
                    return proc, port
        except OSError:
            time.sleep(0.1)
    raise SystemExit((folder / "gateway.log").read_text())


def ssh_argv(key: Path, port: int, login: str, *cmd) -> list[str]:
    return [
        "ssh", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
        "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes", "-o", "LogLevel=ERROR",
        "-i", str(key), "-p", str(port), f"{login}@127.0.0.1", *cmd,
    ]  # fmt: skip


def first_byte(argv: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    first = proc.stdout.read(1)
    took = time.perf_counter() - t0
    proc.stdout.read()
    assert proc.wait() == 0 and first == b"r", (argv, first)
    return took


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def sessions(argv: list[str], gateway_pid: int) -> dict:
    procs = [
        subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        for _ in range(SESSIONS)
    ]
    selector = selectors.DefaultSelector()
    for i, p in enumerate(procs):
        os.set_blocking(p.stdout.fileno(), False)
        selector.register(p.stdout, selectors.EVENT_READ, i)
    buffers = [b""] * SESSIONS

    def answered(sent: dict, until: float, rtts: list):
        while sent and time.monotonic() < until:
            for key, _ in selector.select(timeout=max(0.0, until - time.monotonic())):
                i = key.data
                buffers[i] += key.fileobj.read() or b""
                if i in sent and buffers[i].endswith(b"\n"):
                    rtts.append(time.perf_counter() - sent.pop(i))
                    buffers[i] = b""
        return not sent

    # Every session up and answering before the measured span.
    warm = {i: time.perf_counter() for i in range(SESSIONS)}
    for p in procs:
        p.stdin.write(b"echo up\n")
    assert answered(warm, time.monotonic() + 60, []), f"{len(warm)} sessions did not come up"
    rtts: list[float] = []
    missed = 0
    t0, c0 = time.monotonic(), cpu_s(gateway_pid)
    for tick in range(SECONDS):
        sent = {}
        for i, p in enumerate(procs):
            sent[i] = time.perf_counter()
            p.stdin.write(b"date +%s.%N\n")
        answered(sent, t0 + tick + 1, rtts)
        missed += len(sent)
        time.sleep(max(0.0, t0 + tick + 1 - time.monotonic()))
    wall, cpu = time.monotonic() - t0, cpu_s(gateway_pid) - c0
    for p in procs:
        p.stdin.close()
    for p in procs:
        p.wait(timeout=30)
    return {
        "sessions": SESSIONS, "seconds": SECONDS, "commands": SESSIONS * SECONDS,
        "missed": missed, "gateway_cpu_cores": round(cpu / wall, 3),
        "rtt_median_s": round(statistics.median(rtts), 4), "rtt_p95_s": round(pct(rtts, 0.95), 4),
    }  # fmt: skip


def main():
    folder = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    cluster, container, key = setup(folder)
    gateway, port = start_gateway(folder)
    try:
        login = workspaces.login_name(cluster.pk, 0)
        engine_url = cluster.node_set.select_related("host").get(index=0).host.engine_url
        uid = runtime.tenant_uid(cluster.owner_id)
        through_ssh = ssh_argv(key, port, login, "echo ready")
        through_docker = [
            "docker", "-H", engine_url, "exec", "-u", f"{uid}:{uid}", container.id,
            "sh", "-c", "echo ready",
        ]  # fmt: skip
        first_byte(through_ssh), first_byte(through_docker)  # warm-up
        ssh_times, docker_times = [], []
        for _ in range(RUNS):
            ssh_times.append(first_byte(through_ssh))
            docker_times.append(first_byte(through_docker))
        print(json.dumps({
            "bench": "gateway_first_byte", "runs": RUNS,
            "ssh_median_s": round(statistics.median(ssh_times), 3),
            "ssh_p95_s": round(pct(ssh_times, 0.95), 3),
            "docker_exec_median_s": round(statistics.median(docker_times), 3),
            "docker_exec_p95_s": round(pct(docker_times, 0.95), 3),
            "ratio": round(statistics.median(ssh_times) / statistics.median(docker_times), 2),
        }), flush=True)  # fmt: skip
        figures = sessions(ssh_argv(key, port, login, "sh"), gateway.pid)
        print(json.dumps({"bench": "gateway_sessions", **figures}), flush=True)
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
        services.cluster_release(cluster=cluster)
        tasks.cluster_network_remove(cluster.pk)
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()

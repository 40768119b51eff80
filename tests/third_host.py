"""A fresh third machine for the test fleet (tests/test_host_join.py, bench/join.py): its
own network namespace on the hosts' bridge (172.29.0.13) and mount namespace (its own disk at
the storage path, an empty tmpfs for its engine's data), nothing installed but what this
machine has; join.sh starts its engine. `tear_down` leaves nothing of it behind and never
touches engines a and b (but the swarm manager's list, where its node may still be)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import django_rq
import docker

ROOT = Path(__file__).resolve().parent.parent
NETNS = "suanli-test-join"
VETH = "slh-join"
THIRD = "172.29.0.13"
GATEWAY = os.environ.get("SUANLI_TEST_HOSTS_GATEWAY", "172.29.0.1")
RUN = ROOT / ".run" / "test" / "join-c"  # short: containerd's sockets live under it


def sh(script: str, *args: str, check: bool = True, timeout: int = 60) -> str:
    run = subprocess.run(
        ["sh", "-c", script, "_", *args], capture_output=True, text=True, timeout=timeout
    )
    if check and run.returncode:
        raise AssertionError(f"{script!r} failed ({run.returncode}): {run.stdout}{run.stderr}")
    return run.stdout


def in_third(*cmd: str) -> list[str]:
    return ["nsenter", f"--mount={RUN}/ns/mnt", f"--net=/var/run/netns/{NETNS}", *cmd]


# The test host's engine, (re)started by join.sh with its arguments ($SUANLI_DOCKERD_ARGS):
# a data root on a tmpfs of its own, an address pool off the hosts' networks.
DOCKERD = """#!/bin/sh
D="$1"
if [ -s "$D/docker.pid" ]; then
    pid="$(cat "$D/docker.pid")"
    kill "$pid" 2>/dev/null || true
    i=0
    while [ -d "/proc/$pid" ] && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null; do
        i=$((i + 1)); [ "$i" -lt 150 ] || { kill -9 "$pid"; break; }; sleep 0.2
    done
fi
setsid dockerd --pidfile "$D/docker.pid" --config-file "$D/daemon.json" --data-root "$D/data" \\
    --exec-root "$D/exec" --default-address-pool base=172.29.32.0/19,size=24 \\
    $SUANLI_DOCKERD_ARGS </dev/null >>"$D/dockerd.log" 2>&1 &
"""


def _third_hosts_processes() -> set[int]:
    """Processes of the third host: in its mount namespace, or run from its folder."""
    try:
        ns = os.stat(RUN / "ns" / "mnt").st_ino if (RUN / "ns" / "mnt").exists() else None
    except OSError:
        ns = None
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            inside = ns is not None and os.stat(f"/proc/{entry}/ns/mnt").st_ino == ns
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if inside or str(RUN).encode() in cmdline:
            found.add(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def tear_down() -> None:
    """Everything the third host was, gone; engines a and b untouched (but the swarm
    manager's list, where the third host's node may still be)."""
    pids = _third_hosts_processes()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
    sh(
        """umount "$1/ns/mnt" 2>/dev/null || umount -l "$1/ns/mnt" 2>/dev/null
        awk -v d="$1" 'index($2, d "/") == 1 || $2 == d { print $2 }' /proc/mounts |
            sort -r | while read -r m; do umount -l "$m" 2>/dev/null; done; true""",
        str(RUN),
        check=False,
    )
    sh(f"ip netns del {NETNS} 2>/dev/null; ip link del {VETH} 2>/dev/null; true", check=False)
    engines = [u for u in os.environ.get("SUANLI_TEST_ENGINES", "").split(",") if u]
    if engines:
        manager = docker.DockerClient(base_url=engines[0], timeout=10)
        try:
            for node in manager.nodes.list():
                if (node.attrs.get("Status") or {}).get("Addr") == THIRD:
                    node.remove(force=True)
        except docker.errors.APIError:
            pass
        finally:
            manager.close()
    shutil.rmtree(RUN, ignore_errors=True)


def make() -> Path:
    """A fresh machine on the hosts' network: its own network namespace (172.29.0.13 on
    the bridge suanli-hosts) and mount namespace (its own disk at the storage path, an
    empty tmpfs for its engine's data), nothing installed but what this machine has. No
    engine runs there until join.sh starts one."""
    tear_down()  # what a run cut short left
    storage = os.environ["SUANLI_STORAGE_ROOT"]
    for sub in ("ns", "root", "data", "exec", "tmp", "bin"):
        (RUN / sub).mkdir(parents=True, exist_ok=True)
    (RUN / "daemon.json").write_text("{}")
    (RUN / "dockerd.sh").write_text(DOCKERD)
    (RUN / "bin" / "sudo").write_text('#!/bin/sh\nexec "$@"\n')  # root already
    (RUN / "bin" / "sudo").chmod(0o755)
    sh(
        f"""set -e
        ip netns add {NETNS}
        ip link add {VETH} type veth peer name eth0 netns {NETNS}
        ip link set {VETH} master suanli-hosts up
        ip -n {NETNS} link set lo up
        ip -n {NETNS} addr add {THIRD}/24 dev eth0
        ip -n {NETNS} link set eth0 up
        ip -n {NETNS} route replace default via {GATEWAY}
        mount --bind "$1/ns" "$1/ns" && mount --make-private "$1/ns"
        touch "$1/ns/mnt"
        unshare --mount="$1/ns/mnt" --propagation private true
        nsenter --mount="$1/ns/mnt" sh -c '
            # Not this machine'"'"'s mounts: its own disk at the storage path, no other
            # host'"'"'s namespaces, an empty data root for its engine.
            while mountpoint -q "$2"; do umount -l "$2"; done
            mount -t tmpfs -o size=64m,mode=0755 suanli-host-disk "$2"
            for m in "$(dirname "$1")/mntns" /var/run/netns/suanli-test-a /var/run/netns/suanli-test-b; do
                mountpoint -q "$m" && umount -l "$m" || true
            done
            mount -t tmpfs -o size=2g suanli-engine-data "$1/data"' _ "$1" "$2"
        """,
        str(RUN),
        storage,
    )
    return RUN


def run_queued() -> None:
    """What the console queued (the host check), run here as its worker would. Not an RQ
    worker a few times a second: each one's pub/sub thread may hold it up for a minute."""
    queue = django_rq.get_queue("docker")
    for job_id in queue.job_ids:
        job = queue.fetch_job(job_id)
        if job is not None and queue.remove(job):
            job.perform()


def run_on_third(
    command: str, *, name: str, timeout: float = 240, echo: bool = True
) -> tuple[int, str]:
    """`command` as root on the third host, the console's queued work done meanwhile (as
    its workers would: the host check)."""
    env = {
        "PATH": f"{RUN}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "SUANLI_JOIN_ROOT": f"{RUN}/root",
        "SUANLI_JOIN_DOCKERD": f"sh {RUN}/dockerd.sh {RUN}",
        "SUANLI_JOIN_SOCKET": f"{RUN}/docker.sock",
        "SUANLI_JOIN_NO_APT": "1",
        "SUANLI_JOIN_NAME": name,
        "SUANLI_JOIN_WAIT": "120",
        "TMPDIR": f"{RUN}/tmp",
    }
    out = open(RUN / f"out-{uuid.uuid4().hex[:6]}.log", "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        in_third("sh", "-c", command), env=env, stdout=out, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        run_queued()
        if time.monotonic() > deadline:
            proc.kill()
            break
        time.sleep(0.5)
    proc.wait()
    out.seek(0)
    text = out.read()
    out.close()
    if echo:
        print(text)
    return proc.returncode, text

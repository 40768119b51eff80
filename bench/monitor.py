"""bench/monitor: the `monitor` process at 1 Hz over BENCH_CONTAINERS (200) real running
containers on one local test engine (BENCH_ENGINES, 1: spread over the first that many
engines), by both of its paths, and the live-metrics websocket fan-out to BENCH_CLIENTS
(100) real clients watching one cluster.

Set-up (not timed): N containers of the test image, started in parallel threads, spread
over the engines used (`sh -c 'while :; do sleep 1; done'`; every 10th runs a light busy
loop so some samples have CPU), labelled `suanli.bench=monitor`. If the engines cannot hold N,
as many as started are used and `containers` < `containers_wanted` says so. Their rows
are bulk-created the way the monitor reads them: one host row per engine
(`bench.common.register_host`), clusters of BENCH_NODES_PER_CLUSTER (8) one-GPU nodes
spread over both hosts, one running job a cluster, one running replica a node holding the
container's real id.

Case `monitor`, once a path, one JSON line each (`path`): `kernel`, then `engine`. One
`monitoring.monitor.Monitor(publish=True, kernel=...)` in this process: `kernel` reads the
containers' cgroup and network-namespace counters itself in one pass a tick (the engine
asked once per container for its pid; kernel_containers says how many were read so),
`engine` asks the engine for each one-shot stats. Each is driven by its own `run()` loop: 3 warm-up ticks (connections, the first reading of each container,
which gives no rate), then BENCH_TICKS (20) timed ticks. Timed from the start of the first
timed tick to the end of `run()` (its last pause included, so wall ~ ticks x interval):
- samples_per_s: samples the ticks stored / wall seconds; ticks_per_s likewise (below 1:
  the engines paced the ticks, see below; tick_p50_ms / tick_p95_ms say how long a tick
  took);
- cpu_core_share: `time.process_time()` of this whole process (the event loop, the
  monitor's database and I/O threads, psycopg, the Redis publish) / wall seconds, also
  from `resource.getrusage` (rusage_core_share); cpu_us_per_sample = CPU / samples;
- rows_inserted: `monitoring.models.Sample` rows this path's run really added to the table
  (all 23 ticks), beside rows_reported, what the ticks said they stored.
A one-shot answer waits for the engine's next collection pass, and dockerd (20.10) starts
a pass 1 s after the previous one ended, walking every subscribed container in turn: with
~100 containers an engine on this machine, a pass takes 0.4-0.8 s, so one tick takes
1.4-1.8 s, whatever the monitor's own CPU.
Baseline in the same run (on the `engine` line): the Docker SDK's `client.api.stats(id, stream=False,
one_shot=True)`, the call the monitor replaces, for a subset of the containers
(BENCH_BASELINE_CALLS, 40), from 20 threads at once (each one-shot answer waits for the
engine's next ~1 s collection, so one thread serially makes one reading a second: serial
SDK calls cannot do 1 Hz over 200 containers at all). Its CPU per call (process time /
calls, a warm untimed round first) x N is sdk_core_share_at_1hz: the reads alone, without
parsing into samples, the database or the publish; cpu_per_sample_ratio_to_sdk =
cpu_us_per_sample / sdk_cpu_us_per_call (per reading, so the tick rate does not enter).

Case `monitor_fanout`: the web server as the Procfile runs it (its `web:` line, uvicorn
`console.asgi:application`, on a free port, DEBUG=0 SUANLI_HTTPS=0), BENCH_CLIENTS real
websocket clients (`websockets`) of the cluster's owner (a logged-in session cookie) on
`/ws/clusters/<id>/metrics/` of one cluster, and the monitor as the Procfile runs it (its
`monitor:` line, `manage.py suanli_monitor`, a process of its own) over all N
containers. Once the first message arrives, each client records for BENCH_FANOUT_S (15 s),
for each sample of each message, delay = its receive time (`time.time()`) - the sample's
`ts` (the engine's own read time of that container's stats). So the delay includes the
engine's collection (its answer comes after its read), the tick waiting for every other
container's answer, the monitor's database write (it stores before it publishes), the
Redis channel layer and the web process's send: all of it from reading to screen.
Reports p50, p95, max of the delays in ms, messages per client and the median gap
between two messages of a client (one message a tick), clients connected, and the CPU
share of the web and monitor processes over the window (from /proc).

Cleans up (even on failure): its containers, its subprocesses, its rows (clusters, nodes,
jobs, replicas, samples, hosts, the user and the session).
"""

import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402

django.setup()

import docker  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402
from django.contrib.sessions.models import Session  # noqa: E402
from django.db import close_old_connections  # noqa: E402
from django.test import Client  # noqa: E402
from django.utils import timezone  # noqa: E402
from websockets.asyncio.client import connect  # noqa: E402

from bench.common import register_host  # noqa: E402
from jobs.models import Cluster, GpuModel, Host, Job, Node, Replica  # noqa: E402
from jobs.placement.catalog import seed_catalog  # noqa: E402
from monitoring.models import Sample  # noqa: E402
from monitoring.monitor import Monitor  # noqa: E402

CONTAINERS = int(os.environ.get("BENCH_CONTAINERS", 200))
TICKS = int(os.environ.get("BENCH_TICKS", 20))
WARMUP = 3
CLIENTS = int(os.environ.get("BENCH_CLIENTS", 100))
FANOUT_S = float(os.environ.get("BENCH_FANOUT_S", 15))
NODES_PER_CLUSTER = int(os.environ.get("BENCH_NODES_PER_CLUSTER", 8))
BASELINE_CALLS = int(os.environ.get("BENCH_BASELINE_CALLS", 40))
BASELINE_THREADS = 20
ALL_ENGINES = [u for u in os.environ["SUANLI_TEST_ENGINES"].split(",") if u]
ENGINES = ALL_ENGINES[: max(1, int(os.environ.get("BENCH_ENGINES", 1)))]
IMAGE = os.environ.get("SUANLI_TEST_IMAGE", "suanli/busybox:latest")
PREFIX = "bench-mon"
LABEL = {"suanli.bench": "monitor"}
IDLE = "while :; do sleep 1; done"
BUSY = "while :; do i=0; while [ $i -lt 200 ]; do i=$((i+1)); done; sleep 1; done"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))] if values else None


def ms(seconds):
    return None if seconds is None else round(seconds * 1000, 1)


def procfile(kind: str) -> str:
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.startswith(f"{kind}:"):
            return line.split(":", 1)[1].strip()
    raise SystemExit(f"no {kind} in the Procfile")


def engine_client(url: str) -> docker.DockerClient:
    return docker.DockerClient(base_url=url, timeout=60, max_pool_size=BASELINE_THREADS)


# ------------------------------------------------------------------ set-up and clean-up


def start_containers() -> tuple[list[tuple[int, int, str]], int, str]:
    """[(i, engine index, container id)] of those that started, failures, first error."""
    local = threading.local()

    def start(i: int):
        e = i % len(ENGINES)
        clients = getattr(local, "clients", None)
        if clients is None:
            clients = local.clients = [engine_client(u) for u in ENGINES]
        command = BUSY if i % 10 == 9 else IDLE
        c = clients[e].containers.run(
            IMAGE, ["sh", "-c", command], detach=True, name=f"{PREFIX}-{i}", labels=LABEL
        )
        return i, e, c.id

    started, failed, error = [], 0, ""
    with ThreadPoolExecutor(max_workers=8) as pool:
        for future in [pool.submit(start, i) for i in range(CONTAINERS)]:
            try:
                started.append(future.result())
            except Exception as exc:  # the engines are full: use what started
                failed += 1
                error = error or f"{exc.__class__.__name__}: {str(exc)[:200]}"
    started.sort()
    return started, failed, error


def remove_containers() -> None:
    def remove(url: str) -> None:
        client = engine_client(url)
        label = ",".join(f"{k}={v}" for k, v in LABEL.items())
        found = client.containers.list(all=True, filters={"label": label})
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(lambda c: c.remove(force=True), found))

    with ThreadPoolExecutor(max_workers=len(ALL_ENGINES)) as pool:
        list(pool.map(remove, ALL_ENGINES))


def delete_rows() -> None:
    close_old_connections()
    owner = get_user_model().objects.filter(username=PREFIX).first()
    if owner is not None:
        Sample.objects.filter(cluster__owner=owner).delete()
        Replica.objects.filter(job__owner=owner).delete()
        Job.objects.filter(owner=owner).delete()
        Node.objects.filter(cluster__owner=owner).delete()
        Cluster.objects.filter(owner=owner).delete()
        owner.delete()
    Host.objects.filter(name__startswith=f"{PREFIX}-").delete()


def make_rows(started: list[tuple[int, int, str]]):
    """Hosts, clusters, nodes, jobs and replicas for the started containers; the clusters."""
    seed_catalog()
    model = GpuModel.objects.get(slug="a100-80gb")
    for e, url in enumerate(ENGINES):
        register_host(f"{PREFIX}-{e}", url, gpus=8)
    hosts = [Host.objects.get(name=f"{PREFIX}-{e}") for e in range(len(ENGINES))]
    owner = get_user_model().objects.create(username=PREFIX)
    now = timezone.now()
    groups = [started[k : k + NODES_PER_CLUSTER] for k in range(0, len(started), NODES_PER_CLUSTER)]
    clusters = Cluster.objects.bulk_create(
        [
            Cluster(
                owner=owner, name=f"{PREFIX}-{k}", gpu_model=model, nodes=len(group),
                gpus_per_node=1, image_reference=IMAGE, state=Cluster.State.RUNNING,
                release_policy=Cluster.ReleasePolicy.NEVER, running_since=now,
            )
            for k, group in enumerate(groups)
        ]
    )  # fmt: skip
    nodes = Node.objects.bulk_create(
        [
            Node(cluster=cluster, index=j, host=hosts[e], gpu_indices=[(i // len(ENGINES)) % 8])
            for cluster, group in zip(clusters, groups, strict=True)
            for j, (i, e, _) in enumerate(group)
        ]
    )
    jobs = Job.objects.bulk_create(
        [
            Job(
                cluster=cluster, owner=owner, name="bench", command=IDLE, attempt=1,
                state=Job.State.RUNNING, started_at=now, running_since=now,
            )
            for cluster in clusters
        ]
    )  # fmt: skip
    job_of = {job.cluster_id: job for job in jobs}
    Replica.objects.bulk_create(
        [
            Replica(
                job=job_of[node.cluster_id], attempt=1, rank=node.index, node=node,
                host=node.host, container_name=f"{PREFIX}-{i}", container_id=cid,
                state=Replica.State.RUNNING, started_at=now,
            )
            for node, (i, _, cid) in zip(nodes, started, strict=True)
        ]
    )  # fmt: skip
    return owner, clusters


# ---------------------------------------------------------------------------- case 1


async def ingest(*, kernel: bool) -> dict:
    monitor = Monitor(publish=True, kernel=kernel)
    reports, marks = [], {}
    real_tick = monitor.tick

    async def tick():
        if len(reports) == WARMUP:
            marks["t0"] = time.perf_counter()
            marks["cpu0"] = time.process_time()
            marks["ru0"] = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        report = await real_tick()
        reports.append((report, time.perf_counter() - t))
        return report

    monitor.tick = tick  # run() calls self.tick(): its own loop and pacing, timed here
    try:
        await monitor.run(ticks=WARMUP + TICKS)
        wall = time.perf_counter() - marks["t0"]
        cpu = time.process_time() - marks["cpu0"]
        ru1, ru0 = resource.getrusage(resource.RUSAGE_SELF), marks["ru0"]
    finally:
        monitor.close()
    rusage = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    timed = reports[WARMUP:]
    samples = sum(r.samples for r, _ in timed)
    durations = [d for _, d in timed]
    return {
        "ticks": len(timed),
        "targets": max(r.targets for r, _ in timed),
        "samples": samples,
        "wall_s": round(wall, 2),
        "samples_per_s": round(samples / wall, 1),
        "ticks_per_s": round(len(timed) / wall, 2),
        "cpu_s": round(cpu, 3),
        "cpu_core_share": round(cpu / wall, 3),
        "rusage_core_share": round(rusage / wall, 3),
        "cpu_us_per_sample": round(cpu / samples * 1e6, 1) if samples else None,
        "tick_p50_ms": ms(statistics.median(durations)),
        "tick_p95_ms": ms(pct(durations, 0.95)),
        "rows_reported": sum(r.samples for r, _ in reports),
        "kernel_containers": len(monitor.pids),
        "engines_down": sorted({name for r, _ in reports for name in r.engines_down}),
    }


def sdk_baseline(started: list[tuple[int, int, str]]) -> dict:
    clients = [engine_client(u) for u in ENGINES]
    step = max(1, len(started) // BASELINE_CALLS)
    subset = started[::step][:BASELINE_CALLS]

    def read(item):
        _, e, cid = item
        return clients[e].api.stats(cid, stream=False, one_shot=True)

    with ThreadPoolExecutor(max_workers=BASELINE_THREADS) as pool:
        list(pool.map(read, subset))  # warm: connections open, threads started
        t0, cpu0 = time.perf_counter(), time.process_time()
        list(pool.map(read, subset))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    per_call = cpu / len(subset)
    return {
        "sdk_calls": len(subset),
        "sdk_threads": BASELINE_THREADS,
        "sdk_wall_s": round(wall, 2),
        "sdk_cpu_us_per_call": round(per_call * 1e6, 1),
        "sdk_core_share_at_1hz": round(per_call * len(started), 3),
    }


# ---------------------------------------------------------------------------- case 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def spawn(line: str, env: dict, log) -> subprocess.Popen:
    return subprocess.Popen(
        ["/bin/sh", "-c", f"exec {line}"], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
    )  # fmt: skip


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"web server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("web server did not listen")


async def watch(port: int, cluster_id: int, cookie: str, monitor_start, probe, dead) -> dict:
    """Open the clients, start the monitor, record a window. probe(): CPU s by process;
    dead(): what exited early, or None."""
    url = f"ws://127.0.0.1:{port}/ws/clusters/{cluster_id}/metrics/"
    state = {"recording": False, "first": asyncio.Event()}
    delays, counts, errors, no_ts, gaps = [], [], [], [0], []
    gate = asyncio.Semaphore(20)

    async def open_one():
        async with gate:
            try:
                return await connect(
                    url, origin=f"http://localhost:{port}", open_timeout=60,
                    additional_headers={"Cookie": f"{settings.SESSION_COOKIE_NAME}={cookie}"},
                )  # fmt: skip
            except Exception as exc:
                errors.append(f"{exc.__class__.__name__}: {str(exc)[:200]}")
                return None

    async def follow(ws, slot: int):
        last = None
        try:
            async for message in ws:
                now = time.time()
                state["first"].set()
                if not state["recording"]:
                    continue
                counts[slot] += 1
                if last is not None:
                    gaps.append(now - last)  # one message a monitor tick
                last = now
                for sample in json.loads(message)["samples"]:
                    ts = sample.get("ts")
                    if ts is None:  # an older monitor: whole seconds only
                        no_ts[0] += 1
                        ts = sample["t"]
                    delays.append(now - ts)
        except Exception as exc:  # the connection dropped mid-window
            errors.append(f"{exc.__class__.__name__}: {str(exc)[:200]}")

    sockets = [ws for ws in await asyncio.gather(*(open_one() for _ in range(CLIENTS))) if ws]
    counts.extend([0] * len(sockets))
    tasks = [asyncio.create_task(follow(ws, k)) for k, ws in enumerate(sockets)]
    out = {"connected": len(sockets)}
    try:
        if sockets:
            monitor_start()
            deadline = time.monotonic() + 60
            while not state["first"].is_set():
                gone = dead()
                if gone or time.monotonic() > deadline:
                    errors.append(gone or "no message within 60 s of the monitor's start")
                    return {
                        **out,
                        "delays": [],
                        "counts": counts,
                        "errors": errors,
                        "no_ts": 0,
                        "gaps": [],
                    }
                try:
                    await asyncio.wait_for(state["first"].wait(), 0.5)
                except TimeoutError:
                    pass
            state["recording"] = True
            t0, cpu0 = time.monotonic(), probe()
            await asyncio.sleep(FANOUT_S)
            state["recording"] = False
            out["window_s"] = window = time.monotonic() - t0
            out["cpu"] = {k: (v - cpu0[k]) / window for k, v in probe().items()}
    finally:
        await asyncio.gather(*(ws.close() for ws in sockets), return_exceptions=True)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    out.update(delays=delays, counts=counts, errors=errors, no_ts=no_ts[0], gaps=gaps)
    return out


def fanout(owner, cluster: Cluster, containers: int) -> dict:
    client = Client()
    client.force_login(owner)
    cookie = client.cookies[settings.SESSION_COOKIE_NAME].value
    port = free_port()
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "DEBUG": "0", "SUANLI_HTTPS": "0", "ALLOWED_HOSTS": "localhost,127.0.0.1",
        "SECRET_KEY": settings.SECRET_KEY, "LOG_LEVEL": "WARNING",
        "SUANLI_BIND": "127.0.0.1", "PORT": str(port),
    }  # fmt: skip
    procs, logs = {}, {"web": tempfile.TemporaryFile(), "monitor": tempfile.TemporaryFile()}
    try:
        try:
            procs["web"] = spawn(procfile("web"), env, logs["web"])
            wait_port(port, procs["web"])

            def monitor_start():
                procs["monitor"] = spawn(procfile("monitor"), env, logs["monitor"])

            def probe():
                return {name: proc_cpu_s(proc.pid) for name, proc in procs.items()}

            def dead():
                for name, proc in procs.items():
                    if proc.poll() is not None:
                        return f"the {name} process exited with {proc.returncode}"
                return None

            got = asyncio.run(watch(port, cluster.pk, cookie, monitor_start, probe, dead))
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            Session.objects.filter(session_key=cookie).delete()
        tails = {}
        for name, log in logs.items():
            log.seek(0)
            tails[name] = [
                line[:300] for line in log.read().decode("utf-8", "replace").splitlines()[-2:]
            ]
    finally:
        for log in logs.values():
            log.close()
    window, cpu = got.get("window_s"), got.get("cpu", {})
    delays, counts = got["delays"], got["counts"]
    out = {
        "clients": CLIENTS,
        "connected": got["connected"],
        "containers": containers,
        "cluster_nodes": cluster.nodes,
        "window_s": round(window, 2) if window else None,
        "samples": len(delays),
        "messages_per_client_median": statistics.median(counts) if counts else 0,
        "messages_per_client_min": min(counts) if counts else 0,
        "message_gap_p50_ms": ms(pct(got["gaps"], 0.5)),
        "delay_p50_ms": ms(pct(delays, 0.5)),
        "delay_p95_ms": ms(pct(delays, 0.95)),
        "delay_max_ms": ms(max(delays)) if delays else None,
        "web_cpu_core_share": round(cpu["web"], 3) if "web" in cpu else None,
        "monitor_cpu_core_share": round(cpu["monitor"], 3) if "monitor" in cpu else None,
        "samples_without_ts": got["no_ts"],
        "errors": len(got["errors"]),
        "first_error": got["errors"][0] if got["errors"] else None,
    }
    if out["errors"] or not delays:  # what the web server and the monitor said last
        out["log_tails"] = tails
    return out


# ------------------------------------------------------------------------------ main


def main():
    delete_rows()  # an earlier, interrupted run
    remove_containers()
    try:
        t0 = time.perf_counter()
        started, failed, error = start_containers()
        if not started:
            raise SystemExit(f"no container started: {error}")
        owner, clusters = make_rows(started)
        setup_s = time.perf_counter() - t0
        base = {"containers": len(started), "containers_wanted": CONTAINERS}
        if failed:
            base.update(containers_failed=failed, start_error=error)
        base["engines"] = len(ENGINES)
        for path in ("kernel", "engine"):
            close_old_connections()
            rows0 = Sample.objects.filter(cluster__owner=owner).count()
            result = asyncio.run(ingest(kernel=path == "kernel"))
            close_old_connections()
            result["rows_inserted"] = Sample.objects.filter(cluster__owner=owner).count() - rows0
            if path == "engine":
                result.update(sdk_baseline(started))
                if result["cpu_us_per_sample"]:
                    result["cpu_per_sample_ratio_to_sdk"] = round(
                        result["cpu_us_per_sample"] / result["sdk_cpu_us_per_call"], 2
                    )
            result["setup_s"] = round(setup_s, 1)
            print(json.dumps({"bench": "monitor", "path": path, **base, **result}), flush=True)
        print(json.dumps({"bench": "monitor_fanout", **fanout(owner, clusters[0], len(started))}), flush=True)  # fmt: skip
    finally:
        remove_containers()
        delete_rows()


if __name__ == "__main__":
    main()

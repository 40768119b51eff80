"""bench/log_fanout: 100 websocket viewers of one 4-replica job's live log (each replica
prints ten lines a second), through the `logs` follower (one stream per running replica,
fanned out through the job's Channels group) beside the polling path (each socket asks
the engine for each replica's new lines once a second), in the same run.

Printed per path: the engine calls a second while the viewers watch (counted at the
Docker SDK's HTTP layer of this process, where both the sockets and the follower run; the
viewers' first second, when each socket connects, is left out), the log streams opened,
and the delay from the engine's timestamp of a line to a viewer receiving it (p50, p95).
The sockets are the real consumers on the real channel layer (Redis), driven through
channels' WebsocketCommunicator in this process."""

import asyncio
import collections
import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "console.settings")

import django  # noqa: E402

django.setup()

import docker.api.client  # noqa: E402
from channels.testing.websocket import WebsocketCommunicator  # noqa: E402
from django.contrib.auth import get_user_model  # noqa: E402

from bench.common import register_host  # noqa: E402
from console.consumers import JobLogConsumer, JobLogPollingConsumer  # noqa: E402
from jobs import tasks  # noqa: E402
from jobs.clusters import services
from jobs.models import GpuModel, Image, Job  # noqa: E402
from jobs.placement import scheduler
from jobs.placement.catalog import seed_catalog  # noqa: E402
from jobs.runs import dispatch, exits, livelogs, stopping

VIEWERS = int(os.environ.get("BENCH_VIEWERS", 100))
WINDOW_S = float(os.environ.get("BENCH_WINDOW_S", 10))
ENGINES = [u for u in os.environ["SUANLI_TEST_ENGINES"].split(",") if u]
IMAGE = os.environ.get("SUANLI_TEST_IMAGE", "suanli/busybox:latest")
PRINT = 'i=0; while :; do i=$((i+1)); echo "r$RANK $i"; sleep 0.1; done'

CALLS: collections.Counter = collections.Counter()
_send = docker.api.client.APIClient.send


def _counted(self, request, **kwargs):
    CALLS["logs" if "/logs" in request.url else "other"] += 1
    return _send(self, request, **kwargs)


docker.api.client.APIClient.send = _counted


def pct(values, p):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))] if values else None


def setup():
    seed_catalog()
    for i, url in enumerate(ENGINES):
        register_host(f"bench-{i}", url, gpus=8)
    owner, _ = get_user_model().objects.get_or_create(username="bench-logs")
    # What an earlier, interrupted run left running.
    for job in Job.objects.filter(cluster__owner=owner, replicas__state="running").distinct():
        end_job(job)
    for cluster in owner.clusters.exclude(state="released"):
        services.cluster_release(cluster=cluster)
        tasks.cluster_network_remove(cluster.pk)  # what a worker does after a release
    spec = services.ClusterSpec(
        name="bench-logs", nodes=4, gpu_model=GpuModel.objects.get(slug="a100-80gb"),
        gpus_per_node=4 if len(ENGINES) > 1 else 2, image=Image.objects.get(reference=IMAGE),
        release_policy="never",
    )  # fmt: skip
    cluster = services.cluster_create(owner=owner, spec=spec)
    scheduler.place_pending()
    cluster.refresh_from_db()
    assert cluster.state == "running", cluster.state_reason
    tasks.cluster_network_ensure(cluster.pk)
    return owner, cluster


def start_job(cluster, name):
    job = services.job_submit(cluster=cluster, spec=services.JobSpec(name=name, command=PRINT))
    dispatch.dispatch(cluster.pk)
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING, job.state_reason
    return job


def end_job(job):
    services.job_cancel(job=job, by="bench")
    stopping.kill(job.pk)
    for replica in job.replicas.all():
        exits.replica_exited(replica.pk)


async def watch(consumer, owner, job_id, since: float, until: float, out: dict):
    communicator = WebsocketCommunicator(consumer.as_asgi(), f"/ws/jobs/{job_id}/log/")
    communicator.scope["user"] = owner
    communicator.scope["url_route"] = {"kwargs": {"job_id": job_id}}
    connected, _ = await communicator.connect(timeout=30)
    assert connected
    seqs = []
    while time.time() < until:
        try:
            message = await communicator.receive_json_from(timeout=max(0.1, until - time.time()))
        except TimeoutError:
            break
        now = time.time()
        for line in message["lines"]:
            at = livelogs.ts_ns(line["ts"])
            if at is not None and at / 1e9 >= since:
                out["delays"].append(now - at / 1e9)
                out["lines"] += 1
            if "seq" in line:
                seqs.append(line["seq"])
    # A receive that timed out has already stopped the socket (channels' testing).
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await communicator.disconnect()
    out["dupes"] += len(seqs) - len(set(seqs))
    out["gaps"] += (max(seqs) - min(seqs) + 1 - len(set(seqs))) if seqs else 0


def case(path, owner, cluster):
    job = start_job(cluster, f"fanout-{path}")
    stop = threading.Event()
    follower = None
    if path == "followers":
        follower = livelogs.Follower()
        threading.Thread(target=follower.run, kwargs={"until": stop}, daemon=True).start()
    consumer = JobLogConsumer if path == "followers" else JobLogPollingConsumer
    time.sleep(1)
    out = {"delays": [], "lines": 0, "dupes": 0, "gaps": 0}

    async def viewers():
        start = time.time() + 3  # every socket connects before the window opens
        until = start + WINDOW_S
        tasks_ = [
            asyncio.create_task(watch(consumer, owner, job.pk, start, until, out))
            for _ in range(VIEWERS)
        ]
        await asyncio.sleep(max(0, start - time.time()))
        before = dict(CALLS)
        await asyncio.sleep(max(0, until - time.time()))
        after = dict(CALLS)
        await asyncio.gather(*tasks_)
        return before, after

    before, after = asyncio.run(viewers())
    stop.set()
    end_job(job)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("logs", "other")}
    print(json.dumps({
        "bench": "log_fanout", "path": path, "viewers": VIEWERS, "replicas": 4,
        "window_s": WINDOW_S,
        "engine_calls_per_s": round((delta["logs"] + delta["other"]) / WINDOW_S, 2),
        "engine_log_calls_per_s": round(delta["logs"] / WINDOW_S, 2),
        "streams_opened": follower.streams_opened if follower else None,
        "lines_per_viewer_per_s": round(out["lines"] / VIEWERS / WINDOW_S, 1),
        "delay_p50_s": round(pct(out["delays"], 0.5) or 0, 3),
        "delay_p95_s": round(pct(out["delays"], 0.95) or 0, 3),
        "duplicates": out["dupes"], "gaps": out["gaps"],
    }), flush=True)  # fmt: skip


def main():
    owner, cluster = setup()
    try:
        case("polling", owner, cluster)
        case("followers", owner, cluster)
    finally:
        services.cluster_release(cluster=cluster)
        tasks.cluster_network_remove(cluster.pk)  # what a worker does after a release


if __name__ == "__main__":
    main()

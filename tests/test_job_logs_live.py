"""Live job logs through one follower per running replica (the Procfile's `logs` process,
jobs/runs/livelogs.py), fanned out to every viewer through the job's Channels group: a viewer
that joins late gets the kept lines, then the stream, each line once and in order; two
viewers cost the engine what one does."""

import threading
import time

import docker
import pytest
from asgiref.sync import async_to_sync
from channels.testing.websocket import WebsocketCommunicator
from prometheus_client import REGISTRY

from console.consumers import JobLogConsumer
from jobs.clusters import services
from jobs.clusters.services import JobSpec
from jobs.models import Replica
from jobs.runs import dispatch
from jobs.runs.livelogs import Follower

pytestmark = pytest.mark.django_db(transaction=True)

COUNT_40 = 'for i in $(seq 1 40); do echo "line $i"; sleep 0.1; done'


async def _viewer(user, job_id, *, after=0):
    communicator = WebsocketCommunicator(
        JobLogConsumer.as_asgi(), f"/ws/jobs/{job_id}/log/?after={after}"
    )
    communicator.scope["user"] = user
    communicator.scope["url_route"] = {"kwargs": {"job_id": job_id}}
    connected, _ = await communicator.connect()
    assert connected
    return communicator


async def _read_until(communicator, last_text: str, *, timeout=30):
    """Every line the socket sends, (seq, rank, text), until `last_text`."""
    got = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        message = await communicator.receive_json_from(timeout=10)
        assert "state" in message
        got += [(line["seq"], line["rank"], line["text"]) for line in message["lines"]]
        ends = [i for i, (_, _, text) in enumerate(got) if text == last_text]
        if ends:
            return got[: ends[0] + 1]
    raise AssertionError(f"{last_text!r} never came: {got[-5:]}")


def _printed(job, at_least: int) -> None:
    """Wait on the replica's own engine until it has printed `at_least` lines (the
    scheduler may place the cluster on either test engine)."""
    replica = Replica.objects.select_related("host").get(job=job)
    client = docker.DockerClient(base_url=replica.host.engine_url, timeout=10)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            out = client.containers.get(replica.container_name).logs()
            if len(out.splitlines()) >= at_least:
                return
        except docker.errors.NotFound:
            pass
        time.sleep(0.1)
    raise AssertionError(f"the replica never printed {at_least} lines")


def test_a_late_viewer_sees_every_line_once_in_order(
    running_cluster, processes, alice, settle_until
):
    processes.start("logs")
    cluster = running_cluster(1)
    job = services.job_submit(cluster=cluster, spec=JobSpec(name="late", command=COUNT_40))
    dispatch.dispatch(cluster.pk)
    _printed(job, 12)  # joins while the job is still printing

    async def late():
        communicator = await _viewer(alice, job.pk)
        got = await _read_until(communicator, "line 40")
        await communicator.disconnect()
        return got

    got = async_to_sync(late)()
    assert [text for _, _, text in got] == [f"line {i}" for i in range(1, 41)]
    assert {rank for _, rank, _ in got} == {0}
    seqs = [seq for seq, _, _ in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)

    # A page that already shows up to line 25 (a reconnect) gets the rest, once.
    async def again():
        communicator = await _viewer(alice, job.pk, after=seqs[24])
        got = await _read_until(communicator, "line 40")
        await communicator.disconnect()
        return got

    assert [text for _, _, text in async_to_sync(again)()] == [f"line {i}" for i in range(26, 41)]
    settle_until(job)


def test_two_viewers_cost_one_stream_per_replica(running_cluster, alice, settle_until):
    follower = Follower()
    stop = threading.Event()
    thread = threading.Thread(target=follower.run, kwargs={"until": stop}, daemon=True)
    thread.start()
    try:
        cluster = running_cluster(2)
        job = services.job_submit(
            cluster=cluster,
            spec=JobSpec(
                name="two",
                command='for i in $(seq 1 30); do echo "r$RANK $i"; sleep 0.2; done',
            ),
        )
        dispatch.dispatch(cluster.pk)

        async def two():
            first = await _viewer(alice, job.pk)
            second = await _viewer(alice, job.pk)
            a = await _read_until(first, "r0 10")
            b = await _read_until(second, "r0 10")
            opened = follower.streams_opened
            readers = [t.name for t in threading.enumerate() if t.name.startswith("log-follow-")]
            # What the logs process's metrics port serves (suanli_log_followers).
            followers = REGISTRY.get_sample_value("suanli_log_followers")
            await first.disconnect()
            await second.disconnect()
            return a, b, opened, readers, followers

        a, b, opened, readers, followers = async_to_sync(two)()
        assert opened == 2, "one stream per replica, not per viewer"
        assert len(readers) == 2, readers
        assert followers == 2
        assert a == b, "both viewers, the same lines"
        for rank in (0, 1):
            assert [t for _, r, t in a if r == rank][:5] == [f"r{rank} {i}" for i in range(1, 6)]
        settle_until(job)
    finally:
        stop.set()
        thread.join(10)


def test_a_line_without_end_is_cut_and_another_researcher_sees_nothing(
    running_cluster, alice, bob, settle_until
):
    """`yes | tr -d '\\n'` in a job must not grow the follower without bound: the line is
    kept cut (4 KB), the rest of it dropped, and the next line comes as usual. Bob, who
    guesses the job's number, is refused before he joins its group."""
    follower = Follower()
    stop = threading.Event()
    thread = threading.Thread(target=follower.run, kwargs={"until": stop}, daemon=True)
    thread.start()
    try:
        cluster = running_cluster(1)
        job = services.job_submit(
            cluster=cluster,
            spec=JobSpec(
                name="endless",
                command="sleep 1; head -c 300000 /dev/zero | tr '\\0' x; echo; echo after",
            ),
        )
        dispatch.dispatch(cluster.pk)

        async def watch():
            communicator = await _viewer(alice, job.pk)
            got = await _read_until(communicator, "after")
            await communicator.disconnect()
            intruder = WebsocketCommunicator(JobLogConsumer.as_asgi(), f"/ws/jobs/{job.pk}/log/")
            intruder.scope["user"] = bob
            intruder.scope["url_route"] = {"kwargs": {"job_id": job.pk}}
            connected, code = await intruder.connect()
            return got, connected, code

        got, connected, code = async_to_sync(watch)()
        texts = [text for _, _, text in got]
        assert texts[-1] == "after"
        cut = [t for t in texts if t.startswith("xxxx")]
        assert len(cut) == 1 and cut[0].endswith(" …") and len(cut[0].encode()) < 4200
        assert not connected and code == 4404
        settle_until(job)
    finally:
        stop.set()
        thread.join(10)

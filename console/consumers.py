"""Live job logs over a websocket, all replicas, rank-labelled: pushed by the `logs`
process (jobs/runs/livelogs.py, one stream per running replica) through the job's group, or,
with `SUANLI_LOG_FOLLOWERS` off, polled from the engine once a second per socket; live
metrics of a cluster, pushed by the monitor through the channel layer (Redis); and the
live log of an image build, pushed by the build worker (jobs/images/builds.py) the same way.

A PostgreSQL restart closes no socket (they wait it out); a Redis restart costs a socket
fed through the channel layer no traceback: it is closed with 1012 (restart) and the page
reconnects with backoff (static/js/metrics.js; the job page's log after the last line it
shows). The polling log socket reads only the database and the engine.

Each socket acts for whom its page does (the session's acting-for choice: a team member
sees a team's job, chart or build as their role lets them, console/revoked.scope_actor),
and a member removed from the team (or who left) has every such socket closed at once
with 4403 (console/revoked.Watch)."""

import asyncio
import contextlib
import logging
import re
from datetime import datetime

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.http import Http404

from console import revoked
from jobs.base.outage import DB_DOWN, REDIS_DOWN, Outage
from jobs.images import builds
from jobs.models import ImageBuild, Job, Replica
from jobs.placement import fleet
from jobs.runs import exits, livelogs
from monitoring.monitor import group_for

log = logging.getLogger("suanli.web")
BUILD_END_GRACE_S = 1.5


def _ts_seconds(ts: str) -> float | None:
    try:
        head, _, frac = ts.rstrip("Z").partition(".")
        return datetime.fromisoformat(head + "+00:00").timestamp() + float(f"0.{frac or 0}")
    except ValueError:
        return None


class JobLogPollingConsumer(AsyncJsonWebsocketConsumer):
    """The path without the `logs` process (`SUANLI_LOG_FOLLOWERS` off): each socket asks
    the engine for each running replica's new lines once a second."""

    # Reads the database only: no channel layer, so that a Redis outage leaves it open.
    channel_layer_alias = None

    watch = None

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return
        try:
            actor = await database_sync_to_async(revoked.scope_actor)(self.scope)
            self.job = await database_sync_to_async(fleet.job_for_user)(
                actor, int(self.scope["url_route"]["kwargs"]["job_id"])
            )
        except Http404:
            await self.close(code=4404)  # another tenant's job: as if it did not exist
            return
        await self.accept()
        self.watch = revoked.Watch(actor, self.job.owner_id, self._revoked).start()
        self.sent: dict[int, tuple[float | None, set[str]]] = {}
        self.task = asyncio.create_task(self.follow())

    async def _revoked(self) -> None:
        await self.close(code=revoked.CLOSE_CODE)

    async def disconnect(self, code):
        task = getattr(self, "task", None)
        if task:
            task.cancel()
        if self.watch is not None:
            await self.watch.stop()

    def _tick(self) -> tuple[str, list[dict]]:
        job = Job.objects.get(pk=self.job.pk)
        out = []
        for replica in Replica.objects.filter(job=job, attempt=job.attempt).select_related("host"):
            since, seen = self.sent.get(replica.pk, (None, set()))
            if replica.state in (Replica.State.EXITED, Replica.State.LOST):
                raw = fleet.stored_log_lines(replica.log)
            elif replica.state == Replica.State.RUNNING:
                raw = exits.live_log_since(replica, since)
            else:
                raw = []
            newest, boundary = since, set(seen)
            for line in raw:
                ts, text = fleet.split_log_line(line)
                at = _ts_seconds(ts)
                if line in seen or (since is not None and at is not None and at < since):
                    continue
                out.append({"ts": ts, "rank": replica.rank, "text": text})
                if at is not None and (newest is None or at > newest):
                    newest, boundary = at, {line}
                elif at == newest:
                    boundary.add(line)
            self.sent[replica.pk] = (newest, boundary)
        out.sort(key=lambda item: (item["ts"], item["rank"]))
        return job.state, out

    async def follow(self):
        database = Outage(f"PostgreSQL (log of job {self.job.pk})", log)
        while True:
            # Not thread-sensitive: a slow engine's log call must not hold up every other
            # socket's (and view's) database work on the one shared sync thread.
            try:
                state, lines = await database_sync_to_async(self._tick, thread_sensitive=False)()
            except DB_DOWN as exc:  # the socket stays; the lines come when it is back
                await asyncio.sleep(database.failed(exc))
                continue
            database.ok()
            await self.send_json({"state": state, "lines": lines})
            if state in Job.ENDED:
                await self.close()
                return
            await asyncio.sleep(1)


class _GroupSocket:
    """A socket fed through the channel layer, for the owner of one object: `_owned` finds
    it for the socket's actor before anything is joined (no one logged in: 4401; another
    researcher's: 4404, as if it did not exist) and watches the actor's membership of the
    team that owns it (4403 once it is revoked). When Redis is unreachable the socket is
    closed with 1012 (restart), and the page reconnects with backoff; no traceback."""

    what = "socket"
    watch = None

    async def _owned(self, lookup, key: str):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=4401)
            return None
        try:
            actor = await database_sync_to_async(revoked.scope_actor)(self.scope)
            found = await database_sync_to_async(lookup)(
                actor, int(self.scope["url_route"]["kwargs"][key])
            )
        except Http404:
            await self.close(code=4404)
            return None
        self.watch = revoked.Watch(actor, found.owner_id, self._revoked)
        return found

    async def _revoked(self) -> None:
        self.closed = True
        await self.close(code=revoked.CLOSE_CODE)

    async def _unwatch(self) -> None:
        if self.watch is not None:
            await self.watch.stop()

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        except REDIS_DOWN as exc:
            log.warning("%s: the channel layer is unreachable (%s); closing it", self.what, exc)
            with contextlib.suppress(Exception):  # already closed by the client
                await send({"type": "websocket.close", "code": 1012})


class ClusterMetricsConsumer(_GroupSocket, AsyncJsonWebsocketConsumer):
    """Live samples of one cluster's nodes: one message per monitor tick, pushed by the
    monitor to the cluster's group. Authorised here, before joining the group."""

    group = None
    what = "metrics socket"

    async def connect(self):
        cluster = await self._owned(fleet.cluster_charts_for_user, "cluster_id")
        if cluster is None:
            return
        self.group = group_for(cluster.pk)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        self.watch.start()

    async def disconnect(self, code):
        await self._unwatch()
        if self.group:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def metrics_batch(self, event):
        await self.send_json({"samples": event["samples"]})


class _NumberedLines:
    """A log whose lines are numbered and kept (the last ones, in Redis) as they are sent
    to the socket's group. After the join the kept lines are sent (after `?after=<seq>`,
    the last line the page already shows), then the group's messages: a line numbered at
    or below the last one sent is dropped, so the lines that both the store and the group
    hold at the join are sent once, and a batch that skips numbers (a message the channel
    layer lost, or a batch of another writer that came first) is completed from the store
    first. `_kept()` reads the store (sync); `_send_fresh()` sends new lines."""

    last = 0
    closed = False

    def _after(self) -> int:
        query = dict(
            part.partition("=")[::2]
            for part in self.scope.get("query_string", b"").decode("latin-1").split("&")
        )
        after = query.get("after", "")
        return int(after) if re.fullmatch(r"[0-9]{1,11}", after) else 0

    def _kept(self) -> list[tuple[int, str]]:
        raise NotImplementedError

    async def _send_fresh(self, fresh: list[tuple[int, str]]) -> None:
        raise NotImplementedError

    async def _send_lines(self, lines) -> None:
        fresh = [(seq, text) for seq, text in lines if seq > self.last]
        if fresh and not self.closed:
            self.last = fresh[-1][0]
            await self._send_fresh(fresh)

    async def _numbered(self, event) -> None:
        lines = [(int(seq), text) for seq, text in event.get("lines") or []]
        if lines and lines[0][0] > self.last + 1:  # a gap: fill it from the store
            stored = await database_sync_to_async(self._kept, thread_sensitive=False)()
            await self._send_lines([line for line in stored if line[0] < lines[0][0]])
        await self._send_lines(lines)


class JobLogConsumer(_NumberedLines, _GroupSocket, AsyncJsonWebsocketConsumer):
    """A job's live log, for its owner or whoever holds `jobs.view_job_logs` (others,
    staff or not: 4404). The lines come from the `logs` process through the job's group
    (jobs/runs/livelogs.py), numbered; see
    `_NumberedLines` for the join. The job's state is read once a second and sent when it
    changes; once it has ended, the last lines come for a moment, then the close.

    Sent: `{"state": ..., "lines": [{"seq", "rank", "ts", "text"}, ...]}`."""

    group = None
    watching = None
    state = None
    what = "job log socket"

    async def connect(self):
        job = await self._owned(fleet.job_for_user, "job_id")
        if job is None:
            return
        self.job_id = job.pk
        self.last = self._after()
        self.group = livelogs.group_for(job.pk)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        self.watch.start()
        # What was sent before the join is kept; what comes after it queues on this
        # channel and is handled once connect() returns.
        self.state = job.state
        await self.send_json({"state": self.state, "lines": []})
        await self._send_lines(await database_sync_to_async(self._kept, thread_sensitive=False)())
        self.watching = asyncio.create_task(self._watch())

    def _kept(self) -> list[tuple[int, str]]:
        return livelogs.lines(Job.objects.get(pk=self.job_id))

    async def _send_fresh(self, fresh) -> None:
        await self.send_json(
            {
                "state": self.state,
                "lines": [{"seq": seq, **livelogs.split(text)} for seq, text in fresh],
            }
        )

    def _state(self) -> str:
        return Job.objects.filter(pk=self.job_id).values_list("state", flat=True).get()

    async def _watch(self) -> None:
        database = Outage(f"PostgreSQL (log of job {self.job_id})", log)
        while self.state not in Job.ENDED:
            await asyncio.sleep(1)
            try:
                state = await database_sync_to_async(self._state, thread_sensitive=False)()
            except DB_DOWN as exc:
                await asyncio.sleep(database.failed(exc))
                continue
            except Job.DoesNotExist:  # deleted (by an operator): nothing more will come
                self.closed = True
                await self.close()
                return
            database.ok()
            if state != self.state:
                self.state = state
                await self.send_json({"state": state, "lines": []})
        await asyncio.sleep(BUILD_END_GRACE_S)  # the last lines the follower still sends
        await self._send_lines(await database_sync_to_async(self._kept, thread_sensitive=False)())
        self.closed = True
        await self.close()

    async def disconnect(self, code):
        if self.watching:
            self.watching.cancel()
        await self._unwatch()
        if self.group:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def job_lines(self, event):
        await self._numbered(event)


def job_log_app():
    """The job log route: the group-fed socket, or the polling one (chosen per connection
    by `SUANLI_LOG_FOLLOWERS`)."""
    fed, polling = JobLogConsumer.as_asgi(), JobLogPollingConsumer.as_asgi()

    async def app(scope, receive, send):
        chosen = fed if settings.SUANLI_LOG_FOLLOWERS else polling
        return await chosen(scope, receive, send)

    return app


class BuildLogConsumer(_NumberedLines, _GroupSocket, AsyncJsonWebsocketConsumer):
    """An image build's log and state, live, for its owner only (others: 4404, as if it did
    not exist). Authorised, then joined to the build's group, then the stored lines sent,
    then the group's messages (`_NumberedLines`).

    Sent: `{"lines": [[seq, text], ...]}` and `{"state": ..., "step": ..., "done_bytes":
    ..., "total_bytes": ..., "error": ..., "image": ...}`; closed after a final state."""

    group = None
    closing = None

    what = "build log socket"

    async def connect(self):
        build = await self._owned(fleet.build_for_user, "build_id")
        if build is None:
            return
        self.build_id = build.pk
        self.last = self._after()
        self.group = builds.group_for(build.pk)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        self.watch.start()
        # What was published before the join is in the store; what comes after it queues
        # on this channel and is handled once connect() returns.
        build, lines = await database_sync_to_async(self._stored)()
        await self._send_lines(lines)
        await self.send_json(fleet.build_progress(build))
        if build.state not in ImageBuild.ACTIVE:
            self._close_soon()

    def _stored(self) -> tuple[ImageBuild, list[tuple[int, str]]]:
        build = ImageBuild.objects.select_related("image").get(pk=self.build_id)
        return build, builds.log_lines(build)

    def _kept(self) -> list[tuple[int, str]]:
        return self._stored()[1]

    async def _send_fresh(self, fresh) -> None:
        await self.send_json({"lines": [[seq, text] for seq, text in fresh]})

    async def disconnect(self, code):
        if self.closing:
            self.closing.cancel()
        await self._unwatch()
        if self.group:
            await self.channel_layer.group_discard(self.group, self.channel_name)

    def _close_soon(self) -> None:
        """After the final state: the lines the worker still flushes come for a moment,
        then the store's last ones, then the close."""
        if self.closing is None:
            self.closing = asyncio.create_task(self._close_after_end())

    async def _close_after_end(self) -> None:
        await asyncio.sleep(BUILD_END_GRACE_S)
        await self._send_lines(await database_sync_to_async(self._kept, thread_sensitive=False)())
        self.closed = True
        await self.close()

    async def build_lines(self, event):
        await self._numbered(event)

    async def build_state(self, event):
        if self.closed:
            return
        await self.send_json({k: v for k, v in event.items() if k != "type"})
        if event.get("state") not in ImageBuild.ACTIVE:
            self._close_soon()

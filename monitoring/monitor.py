"""The `monitor` process: every second, one reading of each running replica on this
shard's hosts -> one sample per replica, inserted in bulk and sent to its cluster's
Channels group as one message per cluster per tick.

A reading is the engine's one-shot stats, or, for a host whose engine runs on this
machine (unix://) with SUANLI_MONITOR_KERNEL, the kernel's own counters of the container
(cgroup files, its network namespace's interfaces), all of them in one pass: the engine
is asked for a container's main process once, when it appears, and again only when that
process is gone (the engine-stats path then tells a restart from an exit). A container
whose kernel reading fails in any other way stays on the engine-stats path.

It survives an engine going away (its replicas are skipped, the engine retried each
tick, one log line per outage) and a container vanishing mid-sample (dropped). It also
outlives a PostgreSQL or Redis restart: while the database is away the last known
replicas are sampled and published but not stored; while Redis is away they are stored
but not published; either is logged once and retried with backoff.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime

from channels.layers import get_channel_layer
from django.conf import settings
from django.db import close_old_connections, connection, models

from jobs.base import metrics
from jobs.base.outage import DB_DOWN, REDIS_DOWN, Outage
from jobs.base.sql import insert_rows
from jobs.models import Cluster, Host, Node, Replica
from jobs.nodes import engine
from monitoring import collector, dcgm, rootdisk
from monitoring.engine_stats import EngineDown, EngineStats, Gone
from monitoring.models import Sample

log = logging.getLogger("suanli.monitor")

SAMPLE_FIELDS = (
    "at", "cluster", "job", "host", "node_index", "gpu_util", "gpu_mem_mib", "gpu_power_w",
    "gpu_source", "cpu_pct", "mem_bytes", "net_rx_bps", "net_tx_bps", "disk_read_bps", "disk_write_bps",
    "read_iops", "write_iops",
)  # fmt: skip


def group_for(cluster_id: int) -> str:
    return f"metrics.cluster.{cluster_id}"


@dataclass(frozen=True)
class Target:
    container_id: str
    job_id: int | None  # None: the node's workspace
    cluster_id: int
    node_index: int
    host_id: int
    gpu_indices: tuple[int, ...]
    gpu_mem_mib: int


@dataclass
class HostInfo:
    pk: int
    name: str
    engine_url: str
    tls: tuple[str, str, str] | None
    emulated: bool
    dcgm_url: str
    local: bool


@dataclass
class TickReport:
    targets: int = 0
    samples: int = 0
    engines_down: list[str] = field(default_factory=list)
    cpu_s: float = 0.0


def load_targets(shard: tuple[int, int]) -> tuple[list[Target], dict[int, HostInfo]]:
    close_old_connections()
    index, count = shard
    rows = (
        Replica.objects.filter(state=Replica.State.RUNNING)
        .exclude(container_id="")
        .values_list(
            "container_id", "job_id", "job__cluster_id", "node__index", "host_id",
            "node__gpu_indices", "job__cluster__gpu_model__memory_gb",
        )
    )  # fmt: skip
    # The nodes' workspaces too: interactive work shows on the charts like a job's.
    rows = list(rows) + list(
        Node.objects.filter(
            released_at__isnull=True, lost_at__isnull=True, cluster__state=Cluster.State.RUNNING
        )
        .exclude(workspace_container="")
        .values_list(
            "workspace_container", models.Value(None, output_field=models.IntegerField()),
            "cluster_id", "index", "host_id", "gpu_indices", "cluster__gpu_model__memory_gb",
        )
    )  # fmt: skip
    targets = [
        Target(cid, job, cluster, node, host, tuple(indices or ()), (memory or 0) * 1024)
        for cid, job, cluster, node, host, indices, memory in rows
        if host % count == index
    ]
    hosts = {}
    for host in Host.objects.filter(pk__in={t.host_id for t in targets}):
        tls = None
        if host.uses_tls:
            files = engine._tls_files(host)
            tls = (files.ca_cert, *files.cert)
        hosts[host.pk] = HostInfo(
            host.pk, host.name, host.engine_url, tls, host.emulated_gpu,
            host.dcgm_url if host.dcgm_url.startswith(("http://", "https://")) else "",
            host.engine_url.startswith("unix://"),
        )  # fmt: skip
    return targets, hosts


def write_samples(rows: list[tuple]) -> None:
    close_old_connections()
    insert_rows(Sample, SAMPLE_FIELDS, rows)


def read_kernel(items: list[tuple[str, int, bool]]) -> list:
    """One pass over (container id, pid, own network) -> Counters, None (gone) or the
    exception its reading raised, in order."""
    out = []
    for container_id, pid, own_net in items:
        try:
            out.append(collector.kernel_counters(container_id, pid, own_net=own_net))
        except Exception as exc:  # noqa: BLE001 (that container falls back to the engine)
            out.append(exc)
    return out


def fetch_dcgm(url: str) -> dict[int, dcgm.GpuReading]:
    # The operator's own exporter (a URL set in the admin, http(s) only); no redirects.
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    with opener.open(url, timeout=0.8) as response:  # noqa: S310 (scheme checked)
        return dcgm.parse(response.read(2_000_000).decode("utf-8", "replace"))


class Monitor:
    def __init__(
        self, *, shard: tuple[int, int] = (0, 1), interval: float = 1.0, publish=True,
        kernel: bool | None = None,
    ):  # fmt: skip
        self.shard = shard
        self.kernel = settings.SUANLI_MONITOR_KERNEL if kernel is None else kernel
        self.pids: dict[str, tuple[int, bool]] = {}  # container -> (main pid, own network)
        self.kernel_failed: set[str] = set()  # containers left on the engine-stats path
        self.interval = interval
        self.publish = publish
        self.engines: dict[tuple[int, str], EngineStats] = {}
        self.previous: dict[str, collector.Counters] = {}
        self.down: set[int] = set()
        self.db = ThreadPoolExecutor(max_workers=1, thread_name_prefix="monitor-db")
        self.io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="monitor-io")
        # The system disks of hosts that do not enforce them (monitoring.rootdisk): a slow
        # round (the engine walks every layer) on a thread of its own, never in a tick.
        self.disk = ThreadPoolExecutor(max_workers=1, thread_name_prefix="monitor-disk")
        self.disk_round = None
        self.disk_checked = 0.0
        self.targets: list[Target] = []
        self.hosts: dict[int, HostInfo] = {}
        self.layer = get_channel_layer() if publish else None
        self.refreshed = 0.0
        self.database = Outage("PostgreSQL (monitor)", log)
        self.redis = Outage("Redis (monitor)", log)
        self.retry_at = {"database": 0.0, "redis": 0.0}

    def _away(self, service: str, now: float) -> bool:
        """Whether `service` is in an outage and not yet due for its next try."""
        return getattr(self, service).down and now < self.retry_at[service]

    def _failed(self, service: str, exc: BaseException) -> None:
        self.retry_at[service] = time.monotonic() + getattr(self, service).failed(exc)

    def _engine(self, host: HostInfo) -> EngineStats:
        key = (host.pk, host.engine_url)
        if key not in self.engines:
            self.engines[key] = EngineStats(host.engine_url, tls=host.tls)
        return self.engines[key]

    async def _db(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.db, fn, *args)

    async def _reading(self, target: Target):
        host = self.hosts[target.host_id]
        stats = await self._engine(host).stats(target.container_id)
        if host.local and not (stats.get("blkio_stats") or {}).get("io_serviced_recursive"):
            # cgroup and /proc reads: quick, but files; off the event loop
            return await asyncio.get_running_loop().run_in_executor(
                self.io,
                lambda: collector.counters(stats, container_id=target.container_id, local=True),
            )
        return collector.counters(stats, container_id=target.container_id, local=False)

    async def _readings(self, targets: list[Target]) -> list:
        """One result per target, in order: Counters, None, or the exception."""
        local = [
            t
            for t in targets
            if self.kernel
            and self.hosts[t.host_id].local
            and t.container_id not in self.kernel_failed
        ]
        local_ids = {t.container_id for t in local}
        # The engine-stats path first: its answers take the longest.
        elsewhere = [t for t in targets if t.container_id not in local_ids]
        engine_results = asyncio.gather(
            *(self._reading(t) for t in elsewhere), return_exceptions=True
        )
        results: dict[str, object] = {}
        try:
            new = [t for t in local if t.container_id not in self.pids]
            new_ids = {t.container_id for t in new}
            if new:
                await asyncio.gather(*(self._learn_pid(t) for t in new), return_exceptions=True)
            kernel = [t for t in local if t.container_id in self.pids]
            if kernel:
                items = [(t.container_id, *self.pids[t.container_id]) for t in kernel]
                read = await asyncio.get_running_loop().run_in_executor(self.io, read_kernel, items)
                for target, result in zip(kernel, read, strict=True):
                    if isinstance(result, collector.Counters):
                        results[target.container_id] = result
                        continue
                    self.pids.pop(target.container_id, None)  # gone, or another process now
                    if result is None and target.container_id in new_ids:
                        # Just learned and already unreadable: the engine's pids are not
                        # this machine's (another pid namespace), or it ended at once.
                        self.kernel_failed.add(target.container_id)
                    elif isinstance(result, BaseException):
                        log.warning(
                            "kernel reading of %s: %r; it stays on the engine's stats",
                            target.container_id[:12], result,
                        )  # fmt: skip
                        self.kernel_failed.add(target.container_id)
            # No pid (not running, or the engine did not say), or its process is gone: the
            # engine's stats decide (a restart, an exit, the engine away).
            rest = [t for t in local if t.container_id not in results]
            fallback = await asyncio.gather(
                *(self._reading(t) for t in rest), return_exceptions=True
            )
            results.update((t.container_id, r) for t, r in zip(rest, fallback, strict=True))
        finally:
            for target, result in zip(elsewhere, await engine_results, strict=True):
                results[target.container_id] = result
        return [results[t.container_id] for t in targets]

    async def _learn_pid(self, target: Target) -> None:
        info = await self._engine(self.hosts[target.host_id]).inspect(target.container_id)
        state = info.get("State") or {}
        pid = state.get("Pid") or 0
        if state.get("Running") and isinstance(pid, int) and pid > 0:
            mode = (info.get("HostConfig") or {}).get("NetworkMode") or ""
            own_net = mode not in ("host", "none") and not mode.startswith("container:")
            self.pids[target.container_id] = (pid, own_net)

    async def tick(self) -> TickReport:
        """One second: the targets read again (every 2 s), each replica and workspace
        sampled, one row per node (its replica's and workspace's use added up) published
        to the live charts, then stored."""
        report = TickReport()
        cpu0 = time.process_time()
        now = time.monotonic()
        await self._refresh_targets(now)
        targets = self.targets
        report.targets = len(targets)
        self._measure_disks(now)
        gpu_by_host = await self._gpu_sources()
        results = await self._readings(targets)
        failed_hosts: set[int] = set()
        nodes = self._per_node(targets, results, failed_hosts)
        rows, by_cluster = self._rows(nodes, gpu_by_host)
        self._note_engines(failed_hosts, report)
        # Publish first: a live chart need not wait for the insert.
        await self._publish(by_cluster, now)
        await self._store(rows, now)
        report.samples = len(rows)
        report.cpu_s = time.process_time() - cpu0
        return report

    async def _refresh_targets(self, now: float) -> None:
        """The replicas and workspaces to sample, read again every 2 s (the database
        allowing); what is known of those gone is forgotten."""
        if (now - self.refreshed < 2 and self.targets) or self._away("database", now):
            return
        try:
            self.targets, self.hosts = await self._db(load_targets, self.shard)
        except DB_DOWN as exc:  # go on with the replicas known before
            self._failed("database", exc)
        else:
            self.database.ok()
            self.refreshed = now
            live = {t.container_id for t in self.targets}
            self.previous = {k: v for k, v in self.previous.items() if k in live}
            self.pids = {k: v for k, v in self.pids.items() if k in live}
            self.kernel_failed &= live

    def _per_node(
        self, targets: list[Target], results: list, failed_hosts: set[int]
    ) -> dict[tuple[int, int], tuple[Target, float, dict]]:
        """Each reading made a rate against the one before, one per node: a job's replica
        and the node's workspace share the node (and its GPUs), so their use adds up; the
        row names the job. The hosts whose engine did not answer join `failed_hosts`."""
        nodes: dict[tuple[int, int], tuple[Target, float, dict]] = {}
        for target, result in zip(targets, results, strict=True):
            if isinstance(result, Gone):
                self.previous.pop(target.container_id, None)
                continue
            if isinstance(result, EngineDown):
                failed_hosts.add(target.host_id)
                continue
            if isinstance(result, BaseException):
                log.warning("sample of %s: %r", target.container_id[:12], result)
                continue
            if result is None:
                continue
            prev = self.previous.get(target.container_id)
            self.previous[target.container_id] = result
            rate = collector.rates(prev, result) if prev else None
            if rate is None:
                continue
            key = (target.cluster_id, target.node_index)
            if key in nodes:
                other, read_at, summed = nodes[key]
                rate = {k: v + summed.get(k, 0) for k, v in rate.items()}
                target = target if target.job_id is not None else other
                result_at = max(read_at, result.read_at)
            else:
                result_at = result.read_at
            nodes[key] = (target, result_at, rate)
        return nodes

    def _rows(self, nodes: dict, gpu_by_host: dict) -> tuple[list[tuple], dict[int, list]]:
        """The rows to store and, per cluster, the samples for its live charts."""
        rows, by_cluster = [], {}
        for target, read_at, rate in nodes.values():
            host = self.hosts[target.host_id]
            util, mem, power, source = self._gpus(target, host, rate, gpu_by_host.get(host.pk))
            at = datetime.fromtimestamp(int(read_at), tz=UTC)
            rows.append(
                (
                    at, target.cluster_id, target.job_id, target.host_id, target.node_index,
                    util, mem, power, source, rate["cpu_pct"], rate["mem_bytes"], rate["net_rx_bps"],
                    rate["net_tx_bps"], rate["disk_read_bps"], rate["disk_write_bps"],
                    rate["read_iops"], rate["write_iops"],
                )
            )  # fmt: skip
            by_cluster.setdefault(target.cluster_id, []).append(
                {"t": int(read_at), "ts": round(read_at, 3), "node": target.node_index, "job": target.job_id,
                 "gpu": util, "gmem": mem, **{k: round(v, 1) for k, v in rate.items()}}
            )  # fmt: skip
        return rows, by_cluster

    async def _publish(self, by_cluster: dict[int, list], now: float) -> None:
        if self.layer is None or not by_cluster or self._away("redis", now):
            return
        try:
            for cluster_id, samples in by_cluster.items():
                await self.layer.group_send(
                    group_for(cluster_id), {"type": "metrics.batch", "samples": samples}
                )
        except REDIS_DOWN as exc:
            self._failed("redis", exc)
        else:
            self.redis.ok()

    async def _store(self, rows: list[tuple], now: float) -> None:
        if not rows or self._away("database", now):
            return
        try:
            await self._db(write_samples, rows)
        except DB_DOWN as exc:  # the database away for a moment: these seconds are lost
            self._failed("database", exc)
        except Exception:
            log.exception("storing %d samples", len(rows))
        else:
            self.database.ok()

    def _measure_disks(self, now: float) -> None:
        busy = self.disk_round is not None and not self.disk_round.done()
        if busy or not self.targets or now - self.disk_checked < settings.SUANLI_ROOT_DISK_CHECK_S:
            return
        self.disk_checked = now
        self.disk_round = self.disk.submit(
            rootdisk.check_hosts_logged, {t.host_id for t in self.targets}
        )

    def _gpus(self, target: Target, host: HostInfo, rate: dict, readings):
        """The node's GPUs: utilisation, MiB and watts (None for a GPU without a power
        reading; [] when none of them has one: an emulated host always) and the source."""
        if readings:
            source, values = readings
            util = [values.get(i, (0.0, 0.0, None))[0] for i in target.gpu_indices]
            mem = [values.get(i, (0.0, 0.0, None))[1] for i in target.gpu_indices]
            power = [values.get(i, (0.0, 0.0, None))[2] for i in target.gpu_indices]
            return util, mem, power if any(w is not None for w in power) else [], source
        util, mem = collector.derived_gpus(
            rate["cpu_pct"], rate["mem_bytes"], gpus=len(target.gpu_indices),
            gpu_mem_mib=target.gpu_mem_mib,
        )  # fmt: skip
        return util, mem, [], "derived"  # no power reading: never a made-up 0

    async def _gpu_sources(
        self,
    ) -> dict[int, tuple[str, dict[int, tuple[float, float, float | None]]]]:
        """host -> (source, GPU index -> (util, MiB, watts or None)) for hosts with real GPU
        readings."""
        out = {}
        loop = asyncio.get_running_loop()
        for host in self.hosts.values():
            if host.dcgm_url:
                try:
                    got = await loop.run_in_executor(self.io, fetch_dcgm, host.dcgm_url)
                    out[host.pk] = (
                        "dcgm",
                        {
                            i: (r.util or 0.0, r.fb_used_mib or 0.0, r.power_w)
                            for i, r in got.items()
                        },
                    )
                except (OSError, ValueError) as exc:
                    log.warning("dcgm-exporter of %s: %s", host.name, exc)
            elif not host.emulated and host.local:
                indices = sorted(
                    {i for t in self.targets if t.host_id == host.pk for i in t.gpu_indices}
                )
                got = await loop.run_in_executor(
                    self.io, functools.partial(collector.nvml_gpus, indices, power=True)
                )
                if got is not None:
                    out[host.pk] = (
                        "nvml",
                        {i: (u, m, w) for i, u, m, w in zip(indices, *got, strict=True)},
                    )
        return out

    def _note_engines(self, failed: set[int], report: TickReport) -> None:
        for host_id in failed - self.down:
            log.warning(
                "engine of %s is not answering: its replicas are skipped", self.hosts[host_id].name
            )
        for host_id in self.down - failed:
            if host_id in self.hosts:
                log.info("engine of %s answers again", self.hosts[host_id].name)
        for host_id in failed:
            # Drop pooled connections: the next tick dials afresh.
            host = self.hosts[host_id]
            self.engines.pop((host.pk, host.engine_url), EngineStats("unix:///")).close()
        self.down = failed
        report.engines_down = [self.hosts[h].name for h in failed]

    async def run(self, stop: asyncio.Event | None = None, ticks: int | None = None) -> None:
        stop = stop or asyncio.Event()
        done = 0
        try:
            while not stop.is_set() and (ticks is None or done < ticks):
                started = time.monotonic()
                try:
                    await self.tick()
                except Exception:  # never die: the next tick starts clean
                    log.exception("monitor tick")
                    await asyncio.sleep(1)
                done += 1
                metrics.monitor_tick(str(self.shard[0]), time.monotonic() - started, self.interval)
                # The engine holds one-shot answers to its own ~1 s tick, so a tick mostly
                # paces itself; never go faster than the interval.
                rest = self.interval - (time.monotonic() - started)
                if rest > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), rest)
                    except TimeoutError:
                        pass
        finally:
            for engine in self.engines.values():
                engine.close()  # on this loop, while it runs
            self.engines.clear()

    def close(self) -> None:
        self.db.submit(lambda: connection.close()).result()  # the database thread's own connection
        self.db.shutdown(wait=True)
        self.disk.submit(lambda: connection.close()).result()  # after its round, if one runs
        self.disk.shutdown(wait=True)
        self.io.shutdown(wait=False)

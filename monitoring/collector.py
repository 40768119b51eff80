"""From two consecutive stats readings of one container to one sample.

Counters are cumulative (CPU ns, network bytes, disk bytes and operations); a sample is
their rates over the time between the readings (the engine's own `read` times). Disk
operations come from the engine's blkio where the kernel gives them, else from the
container cgroup's `io.stat` (cgroup v2), else from per-process I/O accounting
(`/proc/<pid>/io` of the cgroup's processes: storage bytes and read/write calls). The
last two need the engine on this machine (a unix:// engine).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

log = logging.getLogger("suanli.monitor")

MIB = 1024 * 1024
CGROUP = Path("/sys/fs/cgroup")
PROC = Path("/proc")


@dataclass
class Counters:
    read_at: float  # engine's clock, seconds since the epoch
    cpu_ns: int
    mem_bytes: int
    rx: int | None  # None: no network namespace of its own (host networking)
    tx: int | None
    rd_bytes: int
    wr_bytes: int
    rd_ops: int
    wr_ops: int


def _read_time(text: str) -> float | None:
    if not text or text.startswith("0001-"):
        return None  # a container that is not running reads as the zero time
    head, _, frac = text.rstrip("Z").partition(".")
    try:
        return datetime.fromisoformat(head).replace(tzinfo=UTC).timestamp() + float(
            f"0.{frac[:9] or 0}"
        )
    except ValueError:
        return None


def _blkio(entries: list | None) -> tuple[int, int] | None:
    if not entries:
        return None
    read = sum(e.get("value", 0) for e in entries if str(e.get("op", "")).lower() == "read")
    write = sum(e.get("value", 0) for e in entries if str(e.get("op", "")).lower() == "write")
    return read, write


def _cgroup_dirs(container_id: str, controller: str) -> list[Path]:
    return [
        CGROUP / "system.slice" / f"docker-{container_id}.scope",  # v2, systemd driver
        CGROUP / "docker" / container_id,  # v2, cgroupfs driver
        CGROUP / controller / "docker" / container_id,  # v1, cgroupfs driver
        CGROUP / controller / "system.slice" / f"docker-{container_id}.scope",  # v1, systemd
    ]


def _io_stat(container_id: str) -> tuple[int, int, int, int] | None:
    for folder in _cgroup_dirs(container_id, "unified")[:2]:
        try:
            text = (folder / "io.stat").read_text()
        except OSError:
            continue
        totals = {"rbytes": 0, "wbytes": 0, "rios": 0, "wios": 0}
        for line in text.splitlines():
            for field in line.split()[1:]:
                key, _, value = field.partition("=")
                if key in totals:
                    totals[key] += int(value)
        if any(totals.values()):
            return totals["rbytes"], totals["wbytes"], totals["rios"], totals["wios"]
    return None


def _proc_io(container_id: str) -> tuple[int, int, int, int] | None:
    for folder in _cgroup_dirs(container_id, "pids"):
        try:
            pids = (folder / "cgroup.procs").read_text().split()
        except OSError:
            continue
        rb = wb = rc = wc = 0
        for pid in pids:
            try:
                fields = dict(
                    line.split(": ", 1) for line in (PROC / pid / "io").read_text().splitlines()
                )
            except (OSError, ValueError):
                continue  # exited between the two reads
            rb += int(fields.get("read_bytes", 0))
            wb += int(fields.get("write_bytes", 0))
            rc += int(fields.get("syscr", 0))
            wc += int(fields.get("syscw", 0))
        return rb, wb, rc, wc
    return None


def counters(stats: dict, *, container_id: str, local: bool) -> Counters | None:
    """Cumulative counters from one engine reading, or None for a container not running."""
    read_at = _read_time(stats.get("read", ""))
    cpu = stats.get("cpu_stats", {}).get("cpu_usage", {}).get("total_usage")
    if read_at is None or cpu is None:
        return None
    memory = stats.get("memory_stats", {})
    inner = memory.get("stats", {})
    cache = inner.get("total_inactive_file", inner.get("inactive_file", 0))
    networks = stats.get("networks")
    rx = sum(n.get("rx_bytes", 0) for n in networks.values()) if networks else None
    tx = sum(n.get("tx_bytes", 0) for n in networks.values()) if networks else None
    blkio = stats.get("blkio_stats", {}) or {}
    volume = _blkio(blkio.get("io_service_bytes_recursive"))
    ops = _blkio(blkio.get("io_serviced_recursive"))
    if ops is None and local:
        local_io = _io_stat(container_id) or _proc_io(container_id)
        if local_io is not None:
            volume, ops = local_io[:2], local_io[2:]
    volume = volume or (0, 0)
    ops = ops or (0, 0)
    return Counters(
        read_at=read_at, cpu_ns=int(cpu), mem_bytes=max(0, int(memory.get("usage", 0)) - cache),
        rx=rx, tx=tx, rd_bytes=volume[0], wr_bytes=volume[1], rd_ops=ops[0], wr_ops=ops[1],
    )  # fmt: skip


def _rate(new: int | None, old: int | None, dt: float) -> float:
    if new is None or old is None:
        return 0.0
    return max(0.0, (new - old) / dt)  # a counter that went back (a restart) is not negative


def rates(prev: Counters, cur: Counters) -> dict | None:
    dt = cur.read_at - prev.read_at
    if not 0.2 <= dt <= 10:
        return None  # the same reading twice, or a gap too long to call a rate
    return {
        "cpu_pct": _rate(cur.cpu_ns, prev.cpu_ns, dt) / 1e9 * 100,
        "mem_bytes": cur.mem_bytes,
        "net_rx_bps": _rate(cur.rx, prev.rx, dt),
        "net_tx_bps": _rate(cur.tx, prev.tx, dt),
        "disk_read_bps": _rate(cur.rd_bytes, prev.rd_bytes, dt),
        "disk_write_bps": _rate(cur.wr_bytes, prev.wr_bytes, dt),
        "read_iops": _rate(cur.rd_ops, prev.rd_ops, dt),
        "write_iops": _rate(cur.wr_ops, prev.wr_ops, dt),
    }


def derived_gpus(cpu_pct: float, mem_bytes: int, *, gpus: int, gpu_mem_mib: int):
    """Emulated-GPU hosts: each GPU is as busy as one core of the replica's real CPU use
    (a process feeding a GPU keeps a core busy; a stalled loader leaves it idle), the
    first GPU first. The replica's memory is spread over its GPUs, capped at the model's."""
    util = [round(min(100.0, max(0.0, cpu_pct - 100.0 * i)), 1) for i in range(gpus)]
    each = min(gpu_mem_mib, mem_bytes / MIB / max(gpus, 1))
    return util, [round(each, 1)] * gpus


def nvml_gpus(indices: list[int]) -> tuple[list[float], list[float]] | None:
    """NVIDIA hosts with the monitor on the machine itself: NVML's readings."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        util, mem = [], []
        for index in indices:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            util.append(float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
            mem.append(round(pynvml.nvmlDeviceGetMemoryInfo(handle).used / MIB, 1))
        return util, mem
    except pynvml.NVMLError as exc:
        log.warning("NVML: %s", exc)
        return None

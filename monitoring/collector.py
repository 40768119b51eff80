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
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from pathlib import Path

log = logging.getLogger("suanli.monitor")

MIB = 1024 * 1024
CGROUP = Path("/sys/fs/cgroup")
PROC = Path("/proc")


@dataclass
class Counters:
    read_at: float  # engine's clock (or this machine's, from the kernel), epoch seconds
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


def _io_stat_totals(text: str) -> tuple[int, int, int, int]:
    totals = {"rbytes": 0, "wbytes": 0, "rios": 0, "wios": 0}
    for line in text.splitlines():
        for field in line.split()[1:]:
            key, _, value = field.partition("=")
            if key in totals:
                totals[key] += int(value)
    return totals["rbytes"], totals["wbytes"], totals["rios"], totals["wios"]


def _io_stat(container_id: str) -> tuple[int, int, int, int] | None:
    for folder in _cgroup_dirs(container_id, "unified")[:2]:
        try:
            text = (folder / "io.stat").read_text()
        except OSError:
            continue
        totals = _io_stat_totals(text)
        if any(totals):
            return totals
    return None


def _pids_io(pids: list[str]) -> tuple[int, int, int, int]:
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


def _proc_io(container_id: str) -> tuple[int, int, int, int] | None:
    for folder in _cgroup_dirs(container_id, "pids"):
        try:
            pids = (folder / "cgroup.procs").read_text().split()
        except OSError:
            continue
        return _pids_io(pids)
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


# ---------------------------------------------------------------- from the kernel itself
# For an engine on this machine: the files the engine itself reads for its stats (cgroup v1
# and v2), read directly, one pass over all containers a second (cAdvisor's way).


@cache
def _unified_root() -> Path:
    """Where the cgroup v2 hierarchy is: /sys/fs/cgroup itself, or .../unified (hybrid)."""
    return CGROUP if (CGROUP / "cgroup.controllers").exists() else CGROUP / "unified"


@cache
def _v1_root(controller: str) -> Path:
    """A v1 controller's mount: /sys/fs/cgroup/<controller>, or a joint one (cpu,cpuacct)."""
    folder = CGROUP / controller
    if folder.is_dir():
        return folder
    for entry in CGROUP.iterdir():
        if controller in entry.name.split(","):
            return entry
    return folder


def _v2() -> bool:
    return _unified_root() == CGROUP


def _cgroup_paths(pid: int) -> dict[str, str]:
    """controller -> the process's cgroup path ("" names the v2 hierarchy)."""
    out = {}
    for line in (PROC / str(pid) / "cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            out[name] = path
    return out


def _folder(container_id: str, pid: int, paths: dict[str, str], controller: str) -> Path | None:
    """The container's folder for `controller` ("" for v2): the path the process is in
    when it names the container, else the engine's usual places (another cgroup namespace)
    holding the process."""
    path = paths.get(controller)
    if path is not None and container_id in path:
        root = _unified_root() if controller == "" else _v1_root(controller)
        return root / path.lstrip("/")
    if controller == "":
        guesses = _cgroup_dirs(container_id, "")[:2] if _v2() else []
        guesses.append(_unified_root() / "docker" / container_id)
    else:
        guesses = [_v1_root(controller) / "docker" / container_id]
        guesses.append(_v1_root(controller) / "system.slice" / f"docker-{container_id}.scope")
    for folder in guesses:
        try:
            if str(pid) in (folder / "cgroup.procs").read_text().split():
                return folder
        except OSError:
            continue
    return None


def _keyed(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _v1_blkio(folder: Path) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(bytes, operations) read and written, as the engine reads v1's blkio: the CFQ/BFQ
    files where they have devices, else the throttle ones; None when none has a device."""
    for kind in ("", "throttle."):
        totals = []
        for name in ("io_service_bytes_recursive", "io_serviced_recursive"):
            try:
                text = (folder / f"blkio.{kind}{name}").read_text()
            except OSError:
                text = ""
            read = write = 0
            lines = 0
            for line in text.splitlines():
                fields = line.split()
                if len(fields) != 3:
                    continue  # "Total N"
                lines += 1
                if fields[1].lower() == "read":
                    read += int(fields[2])
                elif fields[1].lower() == "write":
                    write += int(fields[2])
            totals.append((read, write) if lines else None)
        if totals[1] is not None:
            return totals[0] or (0, 0), totals[1]
    return None


def _net_dev(pid: int) -> tuple[int, int]:
    """rx, tx bytes over the interfaces of the process's network namespace but `lo`."""
    rx = tx = 0
    for line in (PROC / str(pid) / "net" / "dev").read_text().splitlines()[2:]:
        name, _, values = line.partition(":")
        if name.strip() == "lo":
            continue
        fields = values.split()
        rx += int(fields[0])
        tx += int(fields[8])
    return rx, tx


def kernel_counters(container_id: str, pid: int, *, own_net: bool = True) -> Counters | None:
    """Cumulative counters of a container whose engine runs on this machine, from its
    main process `pid` (the engine's State.Pid), with the engine-stats path's meaning:
    CPU ns, memory in use less the inactive page cache, disk bytes and operations,
    network bytes of its own namespace (None with `own_net` False: the host's or another
    container's). None when the process or its cgroup is gone."""
    read_at = time.time()
    try:
        paths = _cgroup_paths(pid)
    except (OSError, ValueError):
        return None  # the process is gone
    try:
        if _v2():
            folder = _folder(container_id, pid, paths, "")
            if folder is None:
                return None
            cpu = _keyed((folder / "cpu.stat").read_text())["usage_usec"] * 1000
            usage = int((folder / "memory.current").read_text())
            cache_bytes = _keyed((folder / "memory.stat").read_text()).get("inactive_file", 0)
            try:
                io_text = (folder / "io.stat").read_text()
            except OSError:
                io_text = ""
            if io_text.strip():
                local_io = _io_stat_totals(io_text)
            else:
                local_io = _pids_io((folder / "cgroup.procs").read_text().split())
            volume, ops = local_io[:2], local_io[2:]
        else:
            cpu_folder = _folder(container_id, pid, paths, "cpuacct")
            mem_folder = _folder(container_id, pid, paths, "memory")
            if cpu_folder is None or mem_folder is None:
                return None
            cpu = int((cpu_folder / "cpuacct.usage").read_text())
            usage = int((mem_folder / "memory.usage_in_bytes").read_text())
            cache_bytes = _keyed((mem_folder / "memory.stat").read_text()).get(
                "total_inactive_file", 0
            )
            blkio_folder = _folder(container_id, pid, paths, "blkio")
            blkio = _v1_blkio(blkio_folder) if blkio_folder is not None else None
            if blkio is not None:
                volume, ops = blkio
            else:
                local_io = _io_stat(container_id) or _pids_io(
                    (cpu_folder / "cgroup.procs").read_text().split()
                )
                volume, ops = local_io[:2], local_io[2:]
        rx, tx = _net_dev(pid) if own_net else (None, None)
    except (FileNotFoundError, ProcessLookupError):
        return None  # it ended between the reads: its cgroup went with it
    return Counters(
        read_at=read_at, cpu_ns=int(cpu), mem_bytes=max(0, usage - cache_bytes), rx=rx, tx=tx,
        rd_bytes=volume[0], wr_bytes=volume[1], rd_ops=ops[0], wr_ops=ops[1],
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


def nvml_gpus(indices: list[int], *, power: bool = False):
    """NVIDIA hosts with the monitor on the machine itself: NVML's readings, per GPU of
    `indices`: (utilisation %, MiB used), and with `power` a third list, the board's power
    draw in watts (nvmlDeviceGetPowerUsage's milliwatts / 1000), None for a GPU whose power
    could not be read (a board without the sensor, a transient error): no reading, never 0.
    None when NVML is not there or fails as a whole."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        util, mem, watts = [], [], []
        for index in indices:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            util.append(float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
            mem.append(round(pynvml.nvmlDeviceGetMemoryInfo(handle).used / MIB, 1))
            if power:
                watts.append(_nvml_power(pynvml, handle, index))
        return (util, mem, watts) if power else (util, mem)
    except pynvml.NVMLError as exc:
        log.warning("NVML: %s", exc)
        return None


def _nvml_power(pynvml, handle, index: int) -> float | None:
    try:
        milliwatts = pynvml.nvmlDeviceGetPowerUsage(handle)
    except pynvml.NVMLError as exc:
        log.debug("NVML power of GPU %s: %s", index, exc)
        return None
    try:
        watts = float(milliwatts) / 1000
    except (TypeError, ValueError):
        return None
    return round(watts, 1) if 0 <= watts < 100_000 else None  # NaN or absurd: no reading

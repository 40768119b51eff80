"""dcgm-exporter's Prometheus text format: the GPU readings an operator's exporter gives.

Reads `DCGM_FI_DEV_GPU_UTIL` (percent), `DCGM_FI_DEV_FB_USED` (MiB) and
`DCGM_FI_DEV_POWER_USAGE` (watts; absent from a scrape: no power reading) per GPU, keyed by
the `gpu` label (the device index, the same index a node's `gpu_indices` hold), with the
`UUID` label kept for the record. Comments, other metrics, timestamps and malformed lines
are skipped; label values may hold escaped quotes, backslashes and commas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

UTIL = "DCGM_FI_DEV_GPU_UTIL"
FB_USED = "DCGM_FI_DEV_FB_USED"
POWER = "DCGM_FI_DEV_POWER_USAGE"
FIELDS = (UTIL, FB_USED, POWER)

_LINE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass
class GpuReading:
    index: int
    uuid: str = ""
    util: float | None = None
    fb_used_mib: float | None = None
    power_w: float | None = None


def _labels(text: str) -> dict[str, str]:
    out = {}
    for match in _LABEL.finditer(text or ""):
        value = match.group(2)
        out[match.group(1)] = value.replace(r"\"", '"').replace(r"\n", "\n").replace("\\\\", "\\")
    return out


def parse(text: str) -> dict[int, GpuReading]:
    """GPU index -> its utilisation, framebuffer use and power draw, from one scrape."""
    gpus: dict[int, GpuReading] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if not match or match.group("name") not in FIELDS:
            continue
        labels = _labels(match.group("labels") or "")
        try:
            index = int(labels["gpu"])
            value = float(match.group("value"))
        except (KeyError, ValueError):
            continue
        if value != value or value in (float("inf"), float("-inf")):
            continue  # NaN: the exporter had no reading this time
        reading = gpus.setdefault(index, GpuReading(index=index))
        reading.uuid = labels.get("UUID", reading.uuid)
        if match.group("name") == UTIL:
            reading.util = value
        elif match.group("name") == FB_USED:
            reading.fb_used_mib = value
        elif 0 <= value < 100_000:  # a negative or absurd draw is no reading
            reading.power_w = value
    return gpus

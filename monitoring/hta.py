"""GPU summary of one rank's PyTorch profiler trace, by Holistic Trace Analysis (HTA).

This module owns the GPU side of a profile summary: how the GPU time of the profiled
window splits into computation, communication, memory copies and idle gaps, how much of
the communication hid behind computation, and which kernels took the most time. It speaks
the console's summary schema (`summarise_gpu`) and turns every failure of HTA into one
`HtaError` with a plain English sentence.

It runs only in the worker (the task that summarises a profile imports it; no web process
does), so HTA and pandas are imported at the top. The caller hands it a private copy of one
rank's trace in a folder of its own, never the tenant's folder: HTA opens whatever paths
it is given and loads the whole file into memory.

HTA parses in this process: it starts a multiprocessing pool only for two ranks or more,
and it is given exactly one file here, so it works under an RQ SimpleWorker.
"""

import logging
import math
import warnings
from pathlib import Path
from typing import Any

import hta.common.trace
import pandas as pd
from hta.trace_analysis import TraceAnalysis

logger = logging.getLogger(__name__)

# HTA logs every parse at WARNING (and some failures at ERROR) to its own "hta" logger;
# failures reach the caller as HtaError instead, so only HTA's critical lines get through.
logging.getLogger("hta").setLevel(logging.CRITICAL)

_transform_correlation_to_index = hta.common.trace.transform_correlation_to_index


def _transform_correlation_wide(df: pd.DataFrame, symbol_table: Any) -> pd.DataFrame:
    """HTA 0.5.0 downcasts `correlation` (int8 when the ids are small), then writes row
    indexes into a column copied from it; pandas 3 refuses the lossy write, so a trace with
    small correlation ids but more events than the type holds fails. Widen it first."""
    if "correlation" in df.columns:
        df["correlation"] = df["correlation"].astype("int64")
    return _transform_correlation_to_index(df, symbol_table)


hta.common.trace.transform_correlation_to_index = _transform_correlation_wide  # parse_trace_file's

TOP_KERNELS = 15
TRACE_SUFFIXES = (".json", ".json.gz")
HTA_RANK = 0  # the key HTA files our single trace under; the real rank is in its metadata
COMPUTATION, COMMUNICATION, MEMORY = "COMPUTATION", "COMMUNICATION", "MEMORY"
KERNEL_TYPES = (COMPUTATION, COMMUNICATION, MEMORY)


class HtaError(Exception):
    """HTA could not read or summarise a trace; the message says why in plain English."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def summarise_gpu(folder: Path) -> dict[str, Any]:
    """Summarise the GPU side of the one trace file in `folder` (see the module docstring).

    Times are in microseconds. `split` attributes every instant of the window (first kernel
    start to last kernel end) to one part: computation first, then communication not
    hidden behind computation, then memory copies, then idle; so the parts add up to the
    window. `kernel_types` is the plain kernel time per type, overlaps counted in full.
    """
    path = _trace_file(folder)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numpy/pandas runtime warnings from HTA
            return _summarise(path)
    except HtaError:
        raise
    except Exception as exc:  # HTA fails in many ways on odd traces: report them all
        logger.info("HTA could not summarise %s: %r", path.name, exc)
        raise HtaError(_failure_sentence(exc)) from exc


def _trace_file(folder: Path) -> Path:
    """The single regular trace file in `folder`, or HtaError."""
    try:
        files = sorted(p for p in folder.iterdir() if p.name.endswith(TRACE_SUFFIXES))
    except OSError as exc:
        raise HtaError("The trace folder could not be read.") from exc
    if len(files) != 1:
        raise HtaError(f"Expected one trace file (.json or .json.gz), found {len(files)}.")
    path = files[0]
    if path.is_symlink() or not path.is_file():
        raise HtaError("The trace is not a regular file.")
    if path.stat().st_size == 0:
        raise HtaError("The trace file is empty.")
    return path


def _failure_sentence(exc: Exception) -> str:
    if isinstance(exc, ValueError) and type(exc).__name__ == "JSONDecodeError":
        return "The trace file is not valid JSON (it may be cut short or damaged)."
    if isinstance(exc, (EOFError, OSError)):
        return "The trace file could not be read or decompressed."
    return "HTA could not analyse the trace: it does not look like a PyTorch profiler trace."


def _summarise(path: Path) -> dict[str, Any]:
    analysis = TraceAnalysis(
        trace_files={HTA_RANK: str(path)},
        trace_dir=str(path.parent),
        include_last_profiler_step=True,  # the whole profiled window, not all but the last step
    )
    kernels = _kernels(analysis)
    if kernels.empty:
        raise HtaError("The trace has no GPU kernels to analyse.")
    type_time, per_kernel = analysis.get_gpu_kernel_breakdown(
        visualize=False, num_kernels=1_000_000, duration_ratio=1.0, include_memory_kernels=True
    )
    temporal = _row(analysis.get_temporal_breakdown(visualize=False))
    return {
        "source": "hta",
        "rank": _rank(analysis),
        "split": _split(type_time, temporal),
        "overlap_pct": _overlap_pct(analysis),
        "top": _top(kernels),
        "kernel_types": _kernel_types(per_kernel),
    }


def _row(frame: pd.DataFrame) -> dict[str, Any]:
    """HTA's one-row-per-rank frame, for our single rank."""
    rows = frame[frame["rank"].eq(HTA_RANK)].to_dict("records")
    if not rows:
        raise HtaError("HTA found nothing to analyse in the trace.")
    return rows[0]


def _rank(analysis: TraceAnalysis) -> int | None:
    info = analysis.t.meta_data.get(HTA_RANK, {}).get("distributedInfo")
    rank = info.get("rank") if isinstance(info, dict) else None
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def _kernels(analysis: TraceAnalysis) -> pd.DataFrame:
    """GPU events (kernels, memcpy, memset) with their names decoded: HTA's own selection."""
    frame = analysis.t.get_trace(HTA_RANK)
    kernels = frame.loc[frame["stream"].ne(-1), ["name", "dur"]].copy()
    symbols = analysis.t.symbol_table.get_sym_table()
    kernels["name"] = kernels["name"].map(lambda i: symbols[i])
    return kernels


def _split(type_time: pd.DataFrame, temporal: dict[str, Any]) -> dict[str, float]:
    """Window split from HTA's disjoint kernel-type intervals (e.g. "COMPUTATION overlapping
    COMMUNICATION") and its idle time. Time when only kernels HTA types as OTHER ran (sync
    kernels and the like) counts as compute, so the parts still add up to the window."""
    compute = communication = memcpy = 0.0
    for label, us in zip(type_time["kernel_type"], type_time["sum"], strict=True):
        if COMPUTATION in label:
            compute += float(us)
        elif COMMUNICATION in label:
            communication += float(us)
        elif MEMORY in label:
            memcpy += float(us)
    window, idle = float(temporal["kernel_time(us)"]), float(temporal["idle_time(us)"])
    compute += max(window - idle - compute - communication - memcpy, 0.0)
    return {
        "compute": compute,
        "communication": communication,
        "memcpy": memcpy,
        "dataloader": 0.0,
        "idle": idle,
    }


def _overlap_pct(analysis: TraceAnalysis) -> float | None:
    """Share of communication time hidden behind computation; None without communication."""
    pct = float(_row(analysis.get_comm_comp_overlap(visualize=False))["comp_comm_overlap_pctg"])
    return None if math.isnan(pct) else pct


def _top(kernels: pd.DataFrame) -> list[dict[str, Any]]:
    grouped = kernels.groupby("name")["dur"].agg(["sum", "count"]).reset_index()
    grouped = grouped.sort_values(["sum", "name"], ascending=[False, True]).head(TOP_KERNELS)
    return [
        {
            "name": str(name),
            "kind": "kernel",
            "self_us": float(total),
            "calls": int(calls),
            "total_us": float(total),
        }
        for name, total, calls in zip(
            grouped["name"], grouped["sum"], grouped["count"], strict=True
        )
    ]


def _kernel_types(per_kernel: pd.DataFrame) -> dict[str, float]:
    sums = per_kernel.groupby("kernel_type")["sum (us)"].sum()
    return {kind: float(sums.get(kind, 0.0)) for kind in KERNEL_TYPES}

"""HTA's GPU summary of a profiler trace, on small synthetic traces shaped like PyTorch's.

The GPU timeline of `gpu_trace` (microseconds from the first kernel):

    stream 7   gemm [0, 300)   idle 50   gemm [350, 650)        idle 100   memcpy [950, 1000)
    stream 20                                nccl [550, 850)

compute 600, communication 300 of which 100 hides behind the second gemm (33.33 %),
memcpy 50, idle 150: a 1000 us window.
"""

import gzip
import json
from pathlib import Path
from typing import Any

import hta.common.trace
import pytest

from monitoring.hta import HtaError, summarise_gpu

T0 = 1_700_000_000_000  # the profiler's clock, in microseconds
GPU_T0 = T0 + 100  # the first kernel starts here
HOST = 4242
GEMM = "void gemm_kernel<float, 128, 128>(float const*, float const*, float*, int)"
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
MEMCPY = "Memcpy HtoD (Pageable -> Device)"


def event(name: str, cat: str, ts: int, dur: int, pid: int, tid: int, **args: Any) -> dict:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": pid,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "args": args,
    }


def host(name: str, cat: str, at: int, dur: int, ext: int, **args: Any) -> dict:
    return event(name, cat, T0 + at, dur, HOST, HOST, **{"External id": ext}, **args)


def on_gpu(name: str, cat: str, at: int, dur: int, stream: int, corr: int, ext: int) -> dict:
    args = {"device": 0, "context": 1, "stream": stream, "correlation": corr, "External id": ext}
    return event(name, cat, GPU_T0 + at, dur, 0, stream, **args)


def launch(op: str, runtime: str, at: int, corr: int, ext: int) -> list[dict]:
    """A CPU op and the CUDA runtime call inside it that queues GPU work `corr`."""
    return [
        host(op, "cpu_op", at, 40, ext),
        host(runtime, "cuda_runtime", at + 10, 5, ext, correlation=corr),
    ]


def gpu_trace(rank: int | None = 1, nccl: bool = True) -> dict:
    """Two profiler steps; the kernels of both (see the module docstring)."""
    events = [
        host("ProfilerStep#1", "user_annotation", 0, 500, 1),
        *launch("aten::mm", "cudaLaunchKernel", 10, 1, 2),
        *launch("aten::mm", "cudaLaunchKernel", 60, 2, 3),
        host("ProfilerStep#2", "user_annotation", 500, 500, 4),
        *launch("aten::copy_", "cudaMemcpyAsync", 600, 4, 6),
        on_gpu(GEMM, "kernel", 0, 300, 7, 1, 2),
        on_gpu(GEMM, "kernel", 350, 300, 7, 2, 3),
        on_gpu(MEMCPY, "gpu_memcpy", 950, 50, 7, 4, 6),
    ]
    if nccl:
        events += launch("record_param_comms", "cudaLaunchKernel", 510, 3, 5)
        events.append(on_gpu(NCCL, "kernel", 550, 300, 20, 3, 5))
    trace: dict[str, Any] = {
        "schemaVersion": 1,
        "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "computeMajor": 9}],
        "traceEvents": events,
        "traceName": "rank.pt.trace.json",
    }
    if rank is not None:
        trace["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": 2}
    return trace


def write(folder: Path, trace: dict, name: str = "host_1.1700000000.pt.trace.json") -> Path:
    folder.mkdir(exist_ok=True)
    text = json.dumps(trace, indent=2)  # the profiler writes it indented, like this
    if name.endswith(".gz"):
        (folder / name).write_bytes(gzip.compress(text.encode()))
    else:
        (folder / name).write_text(text)
    return folder


def test_split_overlap_and_top_kernels(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    summary = summarise_gpu(write(tmp_path / "one", gpu_trace(rank=1)))

    assert summary["source"] == "hta"
    assert summary["rank"] == 1
    split = summary["split"]
    assert split == pytest.approx(
        {
            "compute": 600.0,
            "communication": 200.0,
            "memcpy": 50.0,
            "dataloader": 0.0,
            "idle": 150.0,
        },
        abs=1.0,
    )
    assert sum(split.values()) == pytest.approx(1000.0, abs=1.0)
    assert summary["overlap_pct"] == pytest.approx(33.33, abs=0.1)
    assert summary["kernel_types"] == pytest.approx(
        {"COMPUTATION": 600.0, "COMMUNICATION": 300.0, "MEMORY": 50.0}, abs=1.0
    )
    assert [(k["name"], k["calls"]) for k in summary["top"]] == [
        (GEMM, 2),
        (NCCL, 1),
        (MEMCPY, 1),
    ]
    assert [k["total_us"] for k in summary["top"]] == pytest.approx([600.0, 300.0, 50.0], abs=1.0)
    assert all(k["kind"] == "kernel" and k["self_us"] == k["total_us"] for k in summary["top"])
    json.dumps(summary)  # plain Python numbers, ready to store
    assert capfd.readouterr().out == ""  # HTA's chatter stays out of the worker's output


def test_gzipped_trace_reads_the_same(tmp_path: Path) -> None:
    plain = summarise_gpu(write(tmp_path / "plain", gpu_trace()))
    packed = summarise_gpu(write(tmp_path / "gz", gpu_trace(), "r.pt.trace.json.gz"))
    assert packed == plain


def test_top_keeps_fifteen_largest_first(tmp_path: Path) -> None:
    trace = gpu_trace()
    for i in range(20):  # short kernels of their own names, after the memcpy
        trace["traceEvents"] += launch("aten::add", "cudaLaunchKernel", 700 + 10 * i, 100 + i, 50)
        trace["traceEvents"].append(
            on_gpu(f"void add_{i:02}", "kernel", 1000 + 10 * i, 1 + i, 7, 100 + i, 50)
        )

    top = summarise_gpu(write(tmp_path / "many", trace))["top"]

    assert len(top) == 15
    totals = [k["total_us"] for k in top]
    assert totals == sorted(totals, reverse=True)
    assert [k["name"] for k in top[3:6]] == ["void add_19", "void add_18", "void add_17"]


def test_small_correlation_ids_with_many_events(tmp_path: Path) -> None:
    """HTA stores correlation ids in the smallest integer type (int8 here) and then writes
    event indexes (over 127 here) into a copy of that column: monitoring.hta widens it."""
    trace = gpu_trace()
    trace["traceEvents"] += [host("aten::view", "cpu_op", 700 + i, 1, 60) for i in range(200)]
    assert summarise_gpu(write(tmp_path / "busy", trace))["split"]["compute"] == pytest.approx(600)


def test_no_communication_no_overlap_and_no_rank(tmp_path: Path) -> None:
    summary = summarise_gpu(write(tmp_path / "solo", gpu_trace(rank=None, nccl=False)))

    assert summary["rank"] is None
    assert summary["overlap_pct"] is None
    assert summary["split"] == pytest.approx(
        {"compute": 600.0, "communication": 0.0, "memcpy": 50.0, "dataloader": 0.0, "idle": 350.0},
        abs=1.0,
    )


def test_parses_in_this_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank: no multiprocessing pool, so it runs under an RQ SimpleWorker."""

    def no_pool(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("HTA started a process pool")

    monkeypatch.setattr(hta.common.trace.mp, "get_context", no_pool)
    monkeypatch.setattr(hta.common.trace.mp, "Pool", no_pool)
    assert summarise_gpu(write(tmp_path / "one", gpu_trace()))["rank"] == 1


def damaged(kind: str) -> bytes:
    text = json.dumps(gpu_trace(), indent=2)
    return {
        "not json": b"this is not a trace\n",
        "truncated": text[: len(text) // 2].encode(),
        "empty": b"",
        "a list": b"[1, 2, 3]",
        "no events": json.dumps({"schemaVersion": 1}).encode(),
        "cpu only": json.dumps(
            dict(gpu_trace(), traceEvents=gpu_trace()["traceEvents"][:5])
        ).encode(),
    }[kind]


@pytest.mark.parametrize(
    "kind", ["not json", "truncated", "empty", "a list", "no events", "cpu only"]
)
def test_unreadable_trace_raises_hta_error(tmp_path: Path, kind: str) -> None:
    (tmp_path / "r.pt.trace.json").write_bytes(damaged(kind))
    with pytest.raises(HtaError) as caught:
        summarise_gpu(tmp_path)
    assert caught.value.message.endswith(".")
    assert str(caught.value) == caught.value.message


def test_not_json_and_truncated_say_so(tmp_path: Path) -> None:
    for kind in ("not json", "truncated"):
        (tmp_path / "r.pt.trace.json").write_bytes(damaged(kind))
        with pytest.raises(HtaError, match="not valid JSON"):
            summarise_gpu(tmp_path)


def test_damaged_gzip_raises_hta_error(tmp_path: Path) -> None:
    (tmp_path / "r.pt.trace.json.gz").write_bytes(b"not gzip at all")
    with pytest.raises(HtaError, match="could not be read or decompressed"):
        summarise_gpu(tmp_path)


def test_folder_must_hold_exactly_one_trace(tmp_path: Path) -> None:
    with pytest.raises(HtaError, match="found 0"):
        summarise_gpu(tmp_path)
    write(tmp_path, gpu_trace(rank=0), "a.pt.trace.json")
    write(tmp_path, gpu_trace(rank=1), "b.pt.trace.json")
    with pytest.raises(HtaError, match="found 2"):
        summarise_gpu(tmp_path)
    with pytest.raises(HtaError):
        summarise_gpu(tmp_path / "missing")


def test_symlinked_trace_is_refused(tmp_path: Path) -> None:
    write(tmp_path / "real", gpu_trace())
    (tmp_path / "link").mkdir()
    target = next((tmp_path / "real").iterdir())
    (tmp_path / "link" / "r.pt.trace.json").symlink_to(target)
    with pytest.raises(HtaError, match="not a regular file"):
        summarise_gpu(tmp_path / "link")

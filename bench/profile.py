"""bench/profile: the worker's summary of one large profiler trace, read whole and read by
streaming (monitoring/traces.py), beside the floor of reading it whole at all.

A CPU trace shaped like torch.profiler's (ProfilerStep spans on the main thread, a
DataLoader annotation, nested aten operators, gloo's all-reduce on its own thread) with
BENCH_TRACE_EVENTS (1,000,000) events is written to a temporary file (not timed). Each
mode runs in a fresh Python process of its own, so its peak memory (ru_maxrss) is its own:

- `json_load`: `json.load` of the file and nothing else: the floor of any reader that
  holds the document (the comparison);
- `whole`: `traces.summarise` with the file under the streaming size (json.loads, then
  the events into compact arrays);
- `streamed`: `traces.summarise` over the streaming size (one event at a time).

One JSON line per mode: seconds, events per second, peak_rss_mb, and for the summaries
their rank/steps/top operator so the line shows they read the same trace.
"""

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EVENTS = int(os.environ.get("BENCH_TRACE_EVENTS", "1000000"))
PER_STEP = 1000


def write_trace(path: Path, events: int) -> int:
    """The trace, written as the profiler writes it (indented lines); its size in bytes."""
    t0 = 5_608_258_569_889.0
    with open(path, "w") as out:
        out.write('{\n  "schemaVersion": 1,\n  "distributedInfo": {"backend": "gloo", '
                  '"rank": 1, "world_size": 2},\n  "traceEvents": [\n')  # fmt: skip
        written, step, first = 0, 0, True
        while written < events:
            at = t0 + step * 100_000.0
            batch = [
                _op(f"ProfilerStep#{step}", at, 100_000.0, "user_annotation"),
                _op(
                    "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
                    at,
                    40_000.0,
                    "user_annotation",
                ),  # fmt: skip
                _op("gloo:all_reduce", at + 80_000.0, 15_000.0, "user_annotation", tid=16),
            ]
            for i in range((PER_STEP - 3) // 2):
                start = at + 40_000.0 + i * 80.0
                batch += [_op("aten::linear", start, 70.0), _op("aten::addmm", start + 5, 50.0)]
            for event in batch:
                out.write(("" if first else ",\n") + "    " + json.dumps(event))
                first = False
            written += len(batch)
            step += 1
        out.write('\n  ],\n  "traceName": "bench.pt.trace.json"\n}\n')
    return path.stat().st_size


def _op(name, ts, dur, cat="cpu_op", tid=11):
    return {"ph": "X", "cat": cat, "name": name, "pid": 11, "tid": tid, "ts": ts, "dur": dur,
            "args": {"External id": 1, "Record function id": 0}}  # fmt: skip


def child(mode: str, path: str) -> None:
    import django  # noqa: PLC0415 (the child sets Django up; the parent only writes files)

    django.setup()
    from monitoring import traces  # noqa: PLC0415 (after setup)

    size = os.path.getsize(path)
    started = time.perf_counter()
    out: dict = {}
    with open(path, "rb") as raw:
        if mode == "json_load":
            doc = json.load(raw)
            out["events"] = len(doc["traceEvents"])
        else:
            summary = traces.summarise(
                raw, size=size, stream_over=size + 1 if mode == "whole" else 0,
                max_bytes=8 * 2**30,
            )  # fmt: skip
            out.update(
                events=summary["events"], streamed=summary["streamed"], rank=summary["rank"],
                steps=len(summary["steps"]), top=summary["top"][0]["name"],
                dataloader_share=round(summary["split"]["dataloader"] / summary["window_us"], 3),
            )  # fmt: skip
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": round(seconds, 2), "peak_rss_mb": round(peak), **out}))


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "bench.pt.trace.json"
        size = write_trace(path, EVENTS)
        for mode in ("json_load", "whole", "streamed"):
            run = subprocess.run(
                [sys.executable, __file__, "--child", mode, str(path)],
                capture_output=True, text=True, check=True,
                env={**os.environ, "DJANGO_SETTINGS_MODULE": "console.settings"},
            )  # fmt: skip
            result = json.loads(run.stdout.strip().splitlines()[-1])
            events = result.get("events", 0)
            line = {
                "bench": "profile_summary",
                "mode": mode,
                "file_mb": round(size / 2**20, 1),
                "events_per_s": round(events / result["seconds"]) if result["seconds"] else None,
                **result,
            }
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
    else:
        main()

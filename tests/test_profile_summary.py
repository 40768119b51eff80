"""The console's own summary of a CPU profiler trace (monitoring/traces.py), on traces the
tests write with known operator times.

`known_trace`, microseconds, main thread (the one with the ProfilerStep spans) and gloo's:

    step 1 [0, 1000):    DataLoader [0, 200)  linear [200, 500) > addmm [250, 450)
                         copy_ [500, 600)  c10d::allreduce_ [600, 620)  ...idle to 1000
                         gloo:all_reduce [550, 900) on its own thread
    step 2 [1000, 2000): DataLoader [1000, 1100)  mm [1100, 1700)  ...idle to 2000
                         gloo:all_reduce [1600, 1800) on its own thread

data loading 300, computation 900, memory copies 100, communication not hidden 400
([600, 900) and [1700, 1800)), idle 300; communication 550 in all, of which 150 is hidden
behind other work: 50 behind the copy, 100 behind mm (27.3 %).
"""

import gzip
import io
import json

import pytest

from monitoring import traces

T0 = 5_608_258_569_889.0  # the profiler's clock (microseconds), as real traces have it
KNOWN_SPLIT = {"dataloader": 300.0, "compute": 900.0, "memcpy": 100.0, "communication": 400.0,
               "idle": 300.0}  # fmt: skip
DATALOADER = "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__"


def op(name, at, dur, *, cat="cpu_op", tid=11):
    return {"ph": "X", "cat": cat, "name": name, "pid": 11, "tid": tid, "ts": T0 + at,
            "dur": dur, "args": {"External id": 1}}  # fmt: skip


def known_events():
    return [
        {"ph": "M", "name": "process_name", "pid": 11, "tid": 0, "args": {"name": "python"}},
        op("ProfilerStep#1", 0, 1000, cat="user_annotation"),
        op(DATALOADER, 0, 200, cat="user_annotation"),
        op("aten::linear", 200, 300),
        op("aten::addmm", 250, 200),
        op("aten::copy_", 500, 100),
        op("c10d::allreduce_", 600, 20),
        op("gloo:all_reduce", 550, 350, cat="user_annotation", tid=16),
        op("ProfilerStep#2", 1000, 1000, cat="user_annotation"),
        op(DATALOADER, 1000, 100, cat="user_annotation"),
        op("aten::mm", 1100, 600),
        op("gloo:all_reduce", 1600, 200, cat="user_annotation", tid=16),
        # What the summary leaves aside: flows, instant events, the profiler's own span.
        {"ph": "s", "cat": "fwdbwd", "id": 1, "pid": 11, "tid": 11, "ts": T0 + 10},
        {"ph": "i", "cat": "cpu_instant_event", "name": "x", "pid": 11, "tid": 11, "ts": T0},
        {"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
         "tid": "PyTorch Profiler", "ts": T0, "dur": 5000},
    ]  # fmt: skip


def known_trace(**extra) -> dict:
    return {
        "schemaVersion": 1,
        "distributedInfo": {"backend": "gloo", "rank": 1, "world_size": 2},
        "traceEvents": known_events(),
        "traceName": "x.pt.trace.json",
        **extra,
    }


def summarise(data: bytes, **options) -> dict:
    return traces.summarise(io.BytesIO(data), size=len(data), **options)


def check_known(summary: dict) -> None:
    assert summary["rank"] == 1 and summary["world_size"] == 2 and summary["backend"] == "gloo"
    assert summary["steps"] == [1, 2]
    assert summary["step_us"] == [1000.0, 1000.0]
    assert summary["split"] == KNOWN_SPLIT
    assert summary["window_us"] == 2000.0
    assert summary["communication_us"] == 550.0
    assert summary["overlap_pct"] == 27.3
    assert summary["gpu"] is False
    top = [(t["name"], t["self_us"], t["calls"]) for t in summary["top"]]
    assert top == [
        ("aten::mm", 600.0, 1),
        ("gloo:all_reduce", 550.0, 2),
        (DATALOADER, 300.0, 2),
        ("aten::addmm", 200.0, 1),
        ("aten::copy_", 100.0, 1),
        ("aten::linear", 100.0, 1),
        ("c10d::allreduce_", 20.0, 1),
    ]
    linear = next(t for t in summary["top"] if t["name"] == "aten::linear")
    assert linear["total_us"] == 300.0  # its own 100 and its child's 200


def test_a_known_trace_gives_its_split_overlap_and_top_operators():
    summary = summarise(json.dumps(known_trace()).encode())
    check_known(summary)
    assert summary["streamed"] is False


def test_streaming_reads_the_same_whatever_the_order_of_the_fields():
    # distributedInfo after the events, as well as before; a gzipped copy; a bare array.
    doc = known_trace()
    info = doc.pop("distributedInfo")
    late = json.dumps({**doc, "distributedInfo": info}, indent=1).encode()
    summary = summarise(late, stream_over=0)
    assert summary["streamed"] is True
    check_known(summary)
    check_known(summarise(gzip.compress(late), gzipped=True))
    bare = summarise(json.dumps(known_events()).encode(), stream_over=0)
    assert bare["rank"] is None and bare["split"] == KNOWN_SPLIT


def test_events_split_across_read_chunks_are_read_whole(monkeypatch):
    monkeypatch.setattr(traces, "CHUNK_CHARS", 7)  # every event spans many reads
    check_known(summarise(json.dumps(known_trace()).encode(), stream_over=0))


def test_without_profiler_steps_the_window_is_the_main_threads_span():
    events = [e for e in known_events() if not str(e.get("name", "")).startswith("Profiler")]
    summary = summarise(json.dumps({"traceEvents": events}).encode())
    assert summary["steps"] == []
    assert summary["window_us"] == 1700.0  # the DataLoader at 0 to mm's end at 1700
    assert summary["split"]["idle"] == 100.0  # [1800, 2000) is outside: gloo ends at 1800
    assert sum(summary["split"].values()) == summary["window_us"]


@pytest.mark.parametrize("stream_over", [1 << 30, 0], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"this is not a trace", "not valid JSON"),
        (b'{"traceEvents": [{"ph": "X",, "dur": 1}]}', "not valid JSON"),
        (b'{"schemaVersion": 1}', "no traceEvents"),
        (b'{"traceEvents": []}', "no operator events"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"traceEvents": [{"ph": "X"}]} trailing', None),
    ],
    ids=["text", "syntax", "no-events-key", "empty", "binary", "trailing"],
)
def test_a_malformed_trace_gets_a_sentence_not_an_exception(data, words, stream_over):
    with pytest.raises(traces.TraceError) as caught:
        summarise(data, stream_over=stream_over)
    message = str(caught.value)
    assert message.endswith(".") or message.endswith("?")
    if words:
        assert words in message


@pytest.mark.parametrize("stream_over", [1 << 30, 0], ids=["whole", "streamed"])
@pytest.mark.parametrize("cut", [0.5, 0.97, 0.2])
def test_a_truncated_trace_says_it_ends_early(cut, stream_over):
    data = json.dumps(known_trace(), indent=1).encode()
    short = data[: int(len(data) * cut)]
    with pytest.raises(traces.TraceError) as caught:
        summarise(short, stream_over=stream_over)
    assert "ends early" in str(caught.value), str(caught.value)
    assert f"{len(short):,} bytes" in str(caught.value)


def test_a_truncated_gzip_says_so():
    data = gzip.compress(json.dumps(known_trace()).encode())
    with pytest.raises(traces.TraceError) as caught:
        summarise(data[: len(data) // 2], gzipped=True)
    assert "could not be read" in str(caught.value) or "ends early" in str(caught.value)


def test_a_trace_over_the_size_limit_is_refused_while_streaming():
    data = json.dumps(known_trace()).encode()
    with pytest.raises(traces.TraceError) as caught:
        summarise(data, stream_over=0, max_bytes=len(data) // 3)
    assert "larger than" in str(caught.value)


def test_a_gzip_bomb_stops_at_the_limit_not_at_the_end():
    # 200 MB of spaces inside the event list compress to a few hundred KB.
    bomb = gzip.compress(b'{"traceEvents": [' + b" " * 200_000_000 + b"]}", compresslevel=9)
    with pytest.raises(traces.TraceError) as caught:
        summarise(bomb, gzipped=True, max_bytes=10_000_000)
    assert "larger than 10,000,000 bytes" in str(caught.value)


def test_odd_events_are_skipped_not_fatal():
    events = known_events() + [
        {"ph": "X", "cat": "cpu_op", "name": "neg", "ts": T0, "dur": -5, "pid": 11, "tid": 11},
        {"ph": "X", "cat": "cpu_op", "name": 7, "ts": T0, "dur": 5, "pid": 11, "tid": 11},
        {"ph": "X", "cat": "cpu_op", "name": "s", "ts": "now", "dur": 5, "pid": 11, "tid": 11},
        "not an event",
        None,
        [1, 2],
    ]
    check_known(summarise(json.dumps({**known_trace(), "traceEvents": events}).encode()))


# -- what an attacker's trace tries on the worker ---------------------------------------


@pytest.mark.parametrize("stream_over", [1 << 30, 0], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b'{"traceEvents": [{"ph": "X", "dur": Infinity}]}', "Infinity"),
        (b'{"traceEvents": [{"ph": "X", "dur": NaN}]}', "NaN"),
        (b'{"traceEvents": [{"ph": "X", "ts": 1' + b"9" * 5000 + b"}]}", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "too deeply"),
    ],
    ids=["infinity", "nan", "huge-int", "deep"],
)
def test_values_json_should_not_hold_get_a_sentence(data, words, stream_over):
    with pytest.raises(traces.TraceError) as caught:
        summarise(data, stream_over=stream_over)
    assert words in str(caught.value)


def test_a_rank_out_of_range_is_unknown_not_an_error():
    huge = known_trace(distributedInfo={"rank": 2**40, "world_size": True})
    summary = summarise(json.dumps(huge).encode())
    assert summary["rank"] is None and summary["world_size"] is None


def test_too_many_events_too_many_names_or_too_long_stop_with_a_sentence(monkeypatch):
    data = json.dumps(known_trace()).encode()
    with pytest.raises(traces.TraceError) as caught:
        summarise(data, max_events=5)
    assert "more than 5 events" in str(caught.value)
    monkeypatch.setattr(traces, "CHECK_EVERY", 1)
    with pytest.raises(traces.TraceError) as caught:
        summarise(data, stream_over=0, deadline=0.0)  # a deadline long past
    assert "took too long" in str(caught.value)
    monkeypatch.setattr(traces, "MAX_NAMES", 3)
    names = {t["name"] for t in summarise(data)["top"]}
    assert traces.OTHER_NAMES in names and len(names) <= 4


def test_a_value_longer_than_a_chunk_is_read_in_a_few_passes(monkeypatch):
    """A long string inside an event is read by doubling reads, not once per chunk."""
    monkeypatch.setattr(traces, "CHUNK_CHARS", 1024)
    reads = []
    real = traces._Stream.more

    def counted(self, at_least=traces.CHUNK_CHARS):
        reads.append(at_least)
        return real(self, at_least)

    monkeypatch.setattr(traces._Stream, "more", counted)
    events = known_events()
    events[3] = {**events[3], "args": {"note": "x" * 500_000}}
    check_known(summarise(json.dumps({**known_trace(), "traceEvents": events}).encode(),
                          stream_over=0))  # fmt: skip
    assert len(reads) < 60, len(reads)  # 500 KB in 1 KB chunks would be ~500 reads


def test_tensor_broadcasts_are_not_collectives():
    events = known_events() + [op("aten::broadcast_tensors", 1750, 40)]
    summary = summarise(json.dumps({**known_trace(), "traceEvents": events}).encode())
    assert summary["communication_us"] == 550.0  # unchanged: an aten op is computation


def test_on_a_gpu_trace_kernels_come_before_the_hosts_data_loading():
    """The host in the DataLoader while a kernel runs costs the GPU's step nothing."""
    kernel = {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": T0 + 0,
              "dur": 1000, "args": {"stream": 7}}  # fmt: skip
    events = [
        op("ProfilerStep#1", 0, 2000, cat="user_annotation"),
        op(DATALOADER, 500, 1000, cat="user_annotation"),
        kernel,
    ]
    summary = summarise(json.dumps({"traceEvents": events}).encode())
    assert summary["gpu"] is True
    assert summary["split"]["compute"] == 1000.0 and summary["split"]["dataloader"] == 500.0
    assert summary["split"]["idle"] == 500.0


def test_a_copy_inside_a_wrapping_operator_is_a_copy():
    events = [
        op("ProfilerStep#1", 0, 1000, cat="user_annotation"),
        op("DistributedDataParallel.forward", 0, 1000, cat="user_annotation"),
        op("aten::copy_", 100, 200),
    ]
    summary = summarise(json.dumps({"traceEvents": events}).encode())
    assert summary["split"]["memcpy"] == 200.0 and summary["split"]["compute"] == 800.0

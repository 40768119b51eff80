"""The console's own summary of one PyTorch profiler trace (a Chrome trace JSON, as
`torch.profiler.tensorboard_trace_handler` writes it, plain or gzipped).

Pure Python, no database: the worker's task (`monitoring.tasks.profiles_summarise`) hands
it an open file and keeps what it returns; tests hand it files they write. What it reads:

- the profiled window: the `ProfilerStep#N` spans (or, without them, the span of the main
  thread's events); the main thread is the one holding those spans;
- the window's time, split with no overlap into data loading (the DataLoader's
  `__next__`), memory copies (`aten::copy_`, `Memcpy`/`Memset`), computation (the main
  thread's operators; GPU kernels on a GPU trace, which then come first), communication
  not hidden behind any of these (collectives on any thread: `gloo:all_reduce`, NCCL
  kernels, `c10d::`) and idle, in that order of precedence: a collective that runs while
  the main thread works is overlapped, not waited for;
- the share of communication overlapped by computation;
- the operators (and kernels) with the most self time (their own time less their
  children's), as `key_averages()` counts it.

A file up to `stream_over` bytes is read with `json.loads`; a larger one is read by
streaming: its events one at a time, never the whole document in memory (`_stream`).
Either way the events are kept as compact arrays, not dicts. A file that is not a trace,
or ends early, raises `TraceError` with a sentence for the page.

The GPU breakdown of a trace with kernels may be refined by Holistic Trace Analysis
(`monitoring.hta`, in the worker), which reads the file on its own.
"""

from __future__ import annotations

import codecs
import gzip
import json
import math
import re
import time
from array import array
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO

from django.utils.translation import gettext_noop

CATEGORIES = ("dataloader", "compute", "memcpy", "communication", "idle")  # see _split's order
TOP = 50  # kept per file; the page shows the first 15 of a rank's files summed up
MAX_EVENTS = 5_000_000  # the default of `summarise(max_events=...)`
MAX_NAMES = 50_000  # distinct operator names kept; the rest are counted as one
OTHER_NAMES = "(other names)"
MAX_VALUE_CHARS = 2**20  # one event (or other top-level value) larger than this: malformed
CHUNK_CHARS = 2**20
NEAR_END = 1024
CHECK_EVERY = 65_536  # events between two looks at the clock
STEP = re.compile(r"ProfilerStep#(\d{1,9})$")
COMMUNICATION = re.compile(
    r"^(gloo|nccl|mpi|ucc|c10d)\b|all_?reduce|all_?gather|reduce_?scatter|broadcast|"
    r"all_?to_?all|barrier|record_param_comms|^nccl|ncclKernel|ncclDevKernel",
    re.IGNORECASE,
)
DATALOADER = re.compile(r"DataLoader", re.IGNORECASE)
MEMCPY_NAMES = {"aten::copy_", "aten::_to_copy", "aten::to", "aten::contiguous", "aten::clone"}
MEMCPY = re.compile(r"^(Memcpy|Memset|cudaMemcpy)", re.IGNORECASE)
# Which events are operators of the timeline (the rest: flows, runtime calls, metadata).
HOST = {"cpu_op", "user_annotation", "python_function"}
DEVICE = {"kernel", "gpu_memcpy", "gpu_memset"}

# Kinds an operator can have in the timeline (its class); kept per event as one byte.
K_OTHER, K_STEP, K_DATA, K_COMPUTE, K_MEMCPY, K_COMM, K_PYTHON = range(7)


class TraceError(Exception):
    """A trace that cannot be summarised; `message` (English, a msgid) and its arguments
    are what the page says."""

    def __init__(self, message: str, **args):
        super().__init__(message % args if args else message)
        self.message = message
        self.args_ = args


@dataclass
class _Thread:
    ts: array = field(default_factory=lambda: array("d"))
    dur: array = field(default_factory=lambda: array("d"))
    name: array = field(default_factory=lambda: array("l"))
    kind: array = field(default_factory=lambda: array("b"))
    device: bool = False


class _Collector:
    """Takes the trace's events one at a time and keeps what the summary needs, within
    `max_events` and before `deadline` (time.monotonic())."""

    def __init__(self, *, max_events: int = MAX_EVENTS, deadline: float | None = None) -> None:
        self.threads: dict[tuple, _Thread] = defaultdict(_Thread)
        self.names: dict[str, int] = {}
        # The profiler's steps: (thread, step number, start, duration). Their events go in
        # the threads under one name ("ProfilerStep*", as key_averages counts them).
        self.steps: list[tuple[tuple, int, float, float]] = []
        self.events = 0
        self.kernels = 0
        self.max_events = max_events
        self.deadline = deadline

    def _name(self, name: str) -> int:
        index = self.names.get(name)
        if index is None:
            if len(self.names) >= MAX_NAMES:
                name = OTHER_NAMES
                index = self.names.get(name)
                if index is not None:
                    return index
            index = self.names[name] = len(self.names)
        return index

    def _count(self) -> None:
        self.events += 1
        if self.events > self.max_events:
            raise TraceError(
                gettext_noop("The trace has more than %(count)s events: profile fewer steps."),
                count=f"{self.max_events:,}",
            )
        if self.deadline is not None and self.events % CHECK_EVERY == 0:
            check_deadline(self.deadline)

    def add(self, event) -> None:
        if not isinstance(event, dict) or event.get("ph") != "X":
            return
        cat = event.get("cat")
        device = cat in DEVICE
        if cat not in HOST and not device:
            return
        ts, dur, name = event.get("ts"), event.get("dur"), event.get("name")
        if not _number(ts) or not _number(dur) or dur < 0 or not isinstance(name, str):
            return
        self._count()
        kernels = device and cat == "kernel"
        self.kernels += kernels
        key = (str(event.get("pid")), str(event.get("tid")))
        thread = self.threads[key]
        thread.device = thread.device or device
        kind = _kind(name, cat)
        if kind == K_STEP:
            self.steps.append((key, int(STEP.match(name).group(1)), float(ts), float(dur)))
            name = "ProfilerStep*"
        thread.ts.append(float(ts))
        thread.dur.append(float(dur))
        thread.name.append(self._name(name[:500]))
        thread.kind.append(kind)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_deadline(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TraceError(
            gettext_noop(
                "The trace took too long to summarise (over the worker's limit per file): "
                "profile fewer steps."
            )
        )


def _kind(name: str, cat: str) -> int:
    if cat == "python_function":
        return K_PYTHON  # a with_stack=True frame: computation, but not an operator
    if cat == "user_annotation" and STEP.match(name):
        return K_STEP
    if COMMUNICATION.search(name) and not name.startswith("aten::"):  # aten::broadcast_to
        return K_COMM
    if cat in ("gpu_memcpy", "gpu_memset") or name in MEMCPY_NAMES or MEMCPY.match(name):
        return K_MEMCPY
    if cat == "user_annotation" and DATALOADER.search(name):
        return K_DATA
    if name.startswith("enumerate(DataLoader)"):
        return K_DATA
    return K_COMPUTE


# -- reading ---------------------------------------------------------------------------------


def _text(raw: IO[bytes], gzipped: bool) -> IO[bytes]:
    return gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw


def read(
    raw: IO[bytes],
    *,
    size: int,
    gzipped: bool,
    stream_over: int,
    max_bytes: int,
    max_events: int = MAX_EVENTS,
    deadline: float | None = None,
) -> tuple[dict, _Collector, bool]:
    """The trace's top-level fields but its events, its events collected, and whether it was
    streamed. Raises TraceError (malformed, truncated, too large, too deep, too slow)."""
    collector = _Collector(max_events=max_events, deadline=deadline)
    streamed = gzipped or size > stream_over
    try:
        if streamed:
            meta = _stream(_text(raw, gzipped), collector.add, max_bytes=max_bytes)
        else:
            meta = _whole(raw.read(), collector.add)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise TraceError(
            gettext_noop("The trace could not be read: %(error)s"), error=str(exc)[:200]
        ) from None
    except RecursionError:
        raise TraceError(gettext_noop("The trace nests its values too deeply.")) from None
    except ValueError as exc:  # an integer too long to convert (Python's digit limit)
        raise TraceError(
            gettext_noop("The trace is not valid JSON (%(error)s at character %(at)s)."),
            error=str(exc)[:120],
            at="?",
        ) from None
    return meta, collector, streamed


def _constant(name: str):
    """NaN and Infinity are not JSON; a trace that has them is refused."""
    raise TraceError(
        gettext_noop("The trace is not valid JSON (%(error)s at character %(at)s)."),
        error=name,
        at="?",
    )


def _whole(data: bytes, add: Callable) -> dict:
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_constant)
    except UnicodeDecodeError:
        raise TraceError(gettext_noop("The trace is not UTF-8 text: is it a trace file?")) from None
    except json.JSONDecodeError as exc:
        if _cut_short(exc, len(exc.doc)):
            raise _truncated(len(data)) from None
        raise _malformed(exc) from None
    if isinstance(doc, list):
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(gettext_noop("The file is JSON but not a trace: it has no traceEvents."))
    for event in doc.pop("traceEvents"):
        add(event)
    return doc


def _cut_short(exc: json.JSONDecodeError, end: int) -> bool:
    """Whether a decoding error is the text running out (a file cut while written)."""
    return exc.pos >= end or exc.msg.startswith("Unterminated string")


def _truncated(at: int) -> TraceError:
    return TraceError(
        gettext_noop(
            "The trace ends early (after %(size)s bytes): it was cut while being written, e.g. "
            "the job stopped before the profiler finished. Profile again and let it end."
        ),
        size=f"{at:,}",
    )


def _malformed(exc: json.JSONDecodeError) -> TraceError:
    return TraceError(
        gettext_noop("The trace is not valid JSON (%(error)s at character %(at)s)."),
        error=exc.msg,
        at=f"{exc.pos:,}",
    )


class _Stream:
    """A text buffer over a binary file, read a chunk at a time, with `json`'s own decoder
    taking one value at a time off its front."""

    def __init__(self, raw: IO[bytes], max_bytes: int) -> None:
        self.raw = raw
        self.decode = codecs.getincrementaldecoder("utf-8")()
        self.buf = ""
        self.pos = 0
        self.read_bytes = 0
        self.max_bytes = max_bytes
        self.eof = False
        self.decoder = json.JSONDecoder(parse_constant=_constant)

    def more(self, at_least: int = CHUNK_CHARS) -> bool:
        if self.eof:
            return False
        data = self.raw.read(max(CHUNK_CHARS, at_least))
        self.read_bytes += len(data)
        if self.read_bytes > self.max_bytes:
            raise TraceError(
                gettext_noop("The trace is larger than %(size)s bytes: profile fewer steps."),
                size=f"{self.max_bytes:,}",
            )
        try:
            text = self.decode.decode(data, final=not data)
        except UnicodeDecodeError:
            raise TraceError(
                gettext_noop("The trace is not UTF-8 text: is it a trace file?")
            ) from None
        if not data:
            self.eof = True
        self.buf = self.buf[self.pos :] + text
        self.pos = 0
        return True

    def peek(self) -> str:
        """The next character that is not white space ('' at the end)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""

    def expect(self, chars: str) -> str:
        found = self.peek()
        if not found:
            raise _truncated(self.read_bytes)
        if found not in chars:
            raise TraceError(
                gettext_noop("The trace is not valid JSON (%(error)s at character %(at)s)."),
                error=f"expecting one of {chars!r}",
                at=f"{self.read_bytes - len(self.buf) + self.pos:,}",
            )
        self.pos += 1
        return found

    def value(self):
        self.peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as exc:
                # Before the end of the file, an error near the end of the buffer may be a
                # value cut by the chunk (a number: "1700000." fails at its dot).
                near = 0 if self.eof else NEAR_END
                cut = _cut_short(exc, len(self.buf) - near)
                if cut and len(self.buf) - self.pos > MAX_VALUE_CHARS:
                    raise TraceError(
                        gettext_noop("The trace holds a value over %(size)s characters long."),
                        size=f"{MAX_VALUE_CHARS:,}",
                    ) from None
                # Read as much again as the value has so far, so that a long value is
                # scanned a few times, not once per chunk.
                if cut and self.more(len(self.buf) - self.pos):
                    continue
                if cut:
                    raise _truncated(self.read_bytes) from None
                raise _malformed(exc) from None
            # A number at the very end of the buffer may go on in the next chunk.
            if end == len(self.buf) and not self.eof and self.more(len(self.buf) - self.pos):
                continue
            self.pos = end
            return value


def _stream(raw: IO[bytes], add: Callable, *, max_bytes: int) -> dict:
    """Read a trace without holding it: the top-level object's fields one by one, the
    `traceEvents` array one event at a time (a bare array of events is read the same)."""
    stream = _Stream(raw, max_bytes)
    first = stream.expect("{[")
    meta: dict = {}
    if first == "[":
        _stream_array(stream, add)
    else:
        if stream.peek() == "}":
            stream.pos += 1
        else:
            while True:
                key = stream.value()
                if not isinstance(key, str):
                    raise TraceError(gettext_noop("The file is JSON but not a trace."))
                stream.expect(":")
                if key == "traceEvents" and stream.peek() == "[":
                    stream.pos += 1
                    _stream_array(stream, add)
                    meta["traceEvents"] = True
                else:
                    meta[key] = stream.value()
                if stream.expect(",}") == "}":
                    break
        if not meta.pop("traceEvents", False):
            raise TraceError(
                gettext_noop("The file is JSON but not a trace: it has no traceEvents.")
            )
    if stream.peek():
        raise TraceError(gettext_noop("The trace has text after its end."))
    return meta


def _stream_array(stream: _Stream, add: Callable) -> None:
    if stream.peek() == "]":
        stream.pos += 1
        return
    while True:
        add(stream.value())
        if stream.expect(",]") == "]":
            return


# -- summing up ----------------------------------------------------------------------------


def summarise(
    raw: IO[bytes],
    *,
    size: int,
    gzipped: bool = False,
    stream_over: int = 64 * 2**20,
    max_bytes: int = 4 * 2**30,
    max_events: int = MAX_EVENTS,
    deadline: float | None = None,
) -> dict:
    """One trace's summary (JSON-ready): rank and world size, steps, the window's split
    (microseconds, summed over the profiled steps), communication and its overlap with
    computation, the top operators by self time, whether it has GPU kernels."""
    meta, collector, streamed = read(
        raw, size=size, gzipped=gzipped, stream_over=stream_over, max_bytes=max_bytes,
        max_events=max_events, deadline=deadline,
    )  # fmt: skip
    if not collector.events:
        raise TraceError(
            gettext_noop("The trace has no operator events: was the profiler's schedule active?")
        )
    info = meta.get("distributedInfo") if isinstance(meta.get("distributedInfo"), dict) else {}
    names = list(collector.names)
    main = _main_thread(collector)
    steps = sorted(
        ((n, ts, d) for key, n, ts, d in collector.steps if key == main), key=lambda s: s[1]
    )
    window = [(ts, ts + d) for _, ts, d in steps] or [_span(collector.threads[main])]
    if deadline is not None:
        check_deadline(deadline)
    split, overlap, comm = _split(collector, main, window)
    if deadline is not None:
        check_deadline(deadline)
    total = sum(split.values())
    return {
        "source": "suanli",
        "rank": _int(info.get("rank")),
        "world_size": _int(info.get("world_size")),
        "backend": str(info.get("backend", ""))[:20],
        "steps": [n for n, _, _ in steps],
        "step_us": [round(d, 1) for _, _, d in steps],
        "window_us": round(total, 1),
        "split": {k: round(v, 1) for k, v in split.items()},
        "communication_us": round(comm, 1),
        "overlap_pct": round(100 * overlap / comm, 1) if comm else None,
        "top": _top(collector, names),
        "gpu": collector.kernels > 0,
        "events": collector.events,
        "streamed": streamed,
    }


def _int(value) -> int | None:
    """A rank or world size: a small non-negative integer, else unknown."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31
    return value if ok else None


def _main_thread(collector: _Collector) -> tuple:
    """The host thread that holds the profiler's steps, else the busiest host thread."""
    best, best_time = None, -1.0
    for key, thread in collector.threads.items():
        if thread.device:
            continue
        if K_STEP in thread.kind:
            return key
        busy = sum(thread.dur)
        if busy > best_time:
            best, best_time = key, busy
    if best is None:  # only device events
        return next(iter(collector.threads))
    return best


def _span(thread: _Thread) -> tuple[float, float]:
    return min(thread.ts), max(t + d for t, d in zip(thread.ts, thread.dur, strict=True))


def _split(
    collector: _Collector, main: tuple, window: list[tuple[float, float]]
) -> tuple[dict[str, float], float, float]:
    """The window's time per category (precedence: CATEGORIES, computation first on a GPU
    trace), the communication time hidden behind other work (so communication less it is
    the split's "communication"), and all communication time inside the window. Each
    category's events are merged into disjoint intervals first (nested and back-to-back
    operators become one): the boundaries sorted are the merged ones, not two per event."""
    gpu = collector.kernels > 0
    starts = [array("d") for _ in range(4)]
    ends = [array("d") for _ in range(4)]
    for key, thread in collector.threads.items():
        on_main = key == main
        for ts, dur, kind in zip(thread.ts, thread.dur, thread.kind, strict=True):
            slot = _slot(kind, on_main=on_main, device=thread.device, gpu=gpu)
            if slot is not None and dur > 0:
                starts[slot].append(ts)
                ends[slot].append(ts + dur)
    merged = [_merge(starts[i], ends[i]) for i in range(4)]
    merged.append(_merge(array("d", (w[0] for w in window)), array("d", (w[1] for w in window))))
    del starts, ends
    # Boundaries of the merged intervals: (time, +1/-1, slot); slot 4 = the window.
    points = sorted(
        ((at, delta, slot) for slot, spans in enumerate(merged) for start, end in spans
         for at, delta in ((start, 1), (end, -1))),
        key=lambda p: (p[0], p[1]),
    )  # fmt: skip
    # On a GPU trace the kernels come first: the host loading data while the GPU computes
    # costs the step nothing.
    # On a CPU trace a copy inside a wrapping operator (a record_function, DDP's forward)
    # is the copy's time, not the wrapper's: memory copies before computation.
    order = (1, 0, 2, 3) if gpu else (0, 2, 1, 3)
    active = [0, 0, 0, 0, 0]
    split = dict.fromkeys(CATEGORIES, 0.0)
    overlap = comm = 0.0
    last = None
    for at, delta, slot in points:
        if last is not None and at > last and active[4] > 0:
            length = at - last
            first = next((i for i in order if active[i] > 0), 4)
            split[CATEGORIES[first]] += length
            if active[3] > 0:
                comm += length
                if active[0] or active[1] or active[2]:
                    overlap += length  # hidden behind other work: not waited for
        active[slot] += delta
        last = at
    return split, overlap, comm


def _merge(starts: array, ends: array) -> list[tuple[float, float]]:
    """Intervals merged into disjoint ones, in time order."""
    merged: list[tuple[float, float]] = []
    cur_start = cur_end = None
    for i in sorted(range(len(starts)), key=starts.__getitem__):
        start, end = starts[i], ends[i]
        if cur_end is not None and start <= cur_end:
            cur_end = max(cur_end, end)
            continue
        if cur_end is not None:
            merged.append((cur_start, cur_end))
        cur_start, cur_end = start, end
    if cur_end is not None:
        merged.append((cur_start, cur_end))
    return merged


def _slot(kind: int, *, on_main: bool, device: bool, gpu: bool) -> int | None:
    """Which category an event fills (0 data loading .. 3 communication), if any: on a GPU
    trace the device's kernels are the computation; on a CPU trace, the main thread's
    operators. Collectives count on any thread (gloo runs them on its own)."""
    if kind == K_COMM:
        return 3
    if kind == K_DATA:
        return 0 if on_main else None
    if gpu:
        if not device:
            return None
        return 2 if kind == K_MEMCPY else 1
    if not on_main or kind == K_STEP:
        return None
    return 2 if kind == K_MEMCPY else 1


def _top(collector: _Collector, names: list[str]) -> list[dict]:
    """The operators and kernels with the most self time (time less their children's on
    the same thread), with their calls and total time, largest first."""
    self_us: dict[int, float] = defaultdict(float)
    total_us: dict[int, float] = defaultdict(float)
    calls: dict[int, int] = defaultdict(int)
    kinds: dict[int, bool] = {}
    for thread in collector.threads.values():
        for index, own in _self_times(thread):
            if thread.kind[index] == K_PYTHON:
                continue  # key_averages leaves Python frames out too
            name = thread.name[index]
            self_us[name] += own
            total_us[name] += thread.dur[index]
            calls[name] += 1
            kinds[name] = thread.device
    ranked = sorted(self_us, key=lambda n: (-self_us[n], names[n]))[:TOP]
    return [
        {
            "name": names[n][:200],
            "kind": "kernel" if kinds[n] else "op",
            "self_us": round(self_us[n], 1),
            "total_us": round(total_us[n], 1),
            "calls": calls[n],
        }
        for n in ranked
    ]


def _self_times(thread: _Thread) -> Iterator[tuple[int, float]]:
    """(event index, self time) of every event of a thread but the profiler's steps."""
    # By start, the longer first among equal starts (a parent before its child): two
    # stable sorts with one float key each, not a tuple per event.
    order = sorted(range(len(thread.ts)), key=thread.dur.__getitem__, reverse=True)
    order.sort(key=thread.ts.__getitem__)
    own = array("d", bytes(8 * len(thread.ts)))
    stack: list[int] = []  # open events, each inside the one before
    for i in order:
        start, end = thread.ts[i], thread.ts[i] + thread.dur[i]
        while stack and thread.ts[stack[-1]] + thread.dur[stack[-1]] <= start:
            stack.pop()
        own[i] = thread.dur[i]
        if stack and end <= thread.ts[stack[-1]] + thread.dur[stack[-1]] + 1e-3:
            own[stack[-1]] -= thread.dur[i]
        stack.append(i)
    for i in range(len(own)):
        if thread.kind[i] != K_STEP:
            yield i, max(own[i], 0.0)

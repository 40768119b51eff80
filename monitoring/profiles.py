"""A job's profiler traces: where they are (SUANLI_PROFILE_DIR of each attempt, on the
tenant's storage), their summaries (made once per file by the worker and kept in
`TraceSummary`), what they say across ranks (the slowest rank and why) and the words and
charts of the job page's Profile section.

The files are the tenant's: they are listed and opened only through `jobs.files.storage`, one
path component at a time without following links (a researcher who swaps a trace for a
link to another tenant's folder or to /etc gets nothing). Summaries are made by
`summarise_job`, run by the worker (`monitoring.tasks.profiles_summarise`), never in a
web request; the page lists the folder (a directory read) and shows what is kept.

Layer: monitoring (beside billing), over jobs; the job page (console) reads it.
"""

from __future__ import annotations

import gzip
import logging
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import plotly.graph_objects as go
from django.conf import settings
from django.db import transaction
from django.utils.translation import gettext as _
from django.utils.translation import gettext_noop

from jobs.base.queue import enqueue_unique
from jobs.base.text import Text, show, twin_fields
from jobs.files import storage
from jobs.models import Job
from monitoring import traces
from monitoring.models import TraceSummary
from monitoring.selectors import cores_per_node

log = logging.getLogger(__name__)

TASK = "monitoring.tasks.profiles_summarise"
# Kept while a file is being summarised: what stays if the worker dies on it (out of
# memory, out of time), so it is not tried again until the file changes.
UNFINISHED = gettext_noop(
    "The summary of this trace did not finish (the worker ran out of time or memory on it): "
    "profile fewer steps."
)
QUEUE = "profiles"  # its own worker (Procfile `profiles`): memory capped, apart from the rest
BUDGET_S = 120  # one run's work; what is left is queued again
SHARE = 0.20  # a part of the step worth a word
SHOWN = 15  # operators shown per rank (each file keeps traces.TOP)
IDLE_SHARE = 0.30  # a GPU idle this much of a step is worth a word
STRAGGLER = 1.25  # the slowest rank's own work against the others' median
# `tensorboard_trace_handler` names a file `<host name>_<pid>.<time>.pt.trace.json`; our
# containers' host names are `suanli-j<job>-a<attempt>-r<replica>`.
REPLICA_IN_NAME = re.compile(r"^suanli-j\d+-a\d+-r(\d{1,6})_")
COLORS = {
    "compute": "#2563eb",
    "communication": "#dc2626",
    "memcpy": "#9333ea",
    "dataloader": "#f59e0b",
    "idle": "#9ca3af",
}


def labels() -> dict[str, str]:
    """The parts of a step, in `traces.CATEGORIES` order, in the reader's language."""
    return {
        "dataloader": _("data loading"),
        "compute": _("computation"),
        "memcpy": _("memory copies"),
        "communication": _("communication (waiting)"),
        "idle": _("idle"),
    }


# -- where the traces are ------------------------------------------------------------------


def volumes_of(job: Job) -> list:
    """The job's cluster's volumes (read once by a caller that lists and opens files)."""
    return list(job.cluster.volumes.all())


def folders(job: Job, volumes: list) -> list[tuple[int, str, bool]]:
    """(attempt, SUANLI_PROFILE_DIR, whether it is on the tenant's storage) of each attempt
    so far, the newest first."""
    return [
        (attempt, *storage.profile_dir(volumes, job.checkpoint_dir, job.pk, attempt))
        for attempt in range(job.attempt, 0, -1)
    ]


def listing(job: Job, volumes: list | None = None) -> list[tuple[int, storage.TraceFile]]:
    """Every trace file of every attempt, as (attempt, file): a directory read each."""
    volumes = volumes_of(job) if volumes is None else volumes
    root = storage.tenant_root(job.owner_id)
    found = []
    for attempt, folder, on_storage in folders(job, volumes):
        if on_storage:
            found += [(attempt, f) for f in storage.trace_files(root, volumes, folder)]
    return found


def open_file(job: Job, attempt: int, name: str, volumes: list | None = None):
    """A trace file of the job opened for reading, or None (see `storage.open_trace`)."""
    if not 1 <= attempt <= job.attempt:
        return None
    volumes = volumes_of(job) if volumes is None else volumes
    folder, on_storage = storage.profile_dir(volumes, job.checkpoint_dir, job.pk, attempt)
    if not on_storage:
        return None
    return storage.open_trace(storage.tenant_root(job.owner_id), volumes, folder, name)


def rank_from_name(name: str) -> int | None:
    match = REPLICA_IN_NAME.match(name)
    return int(match.group(1)) if match else None


# -- summarising (the worker) --------------------------------------------------------------


def summarise_job(job_id: int, *, budget_s: float = BUDGET_S) -> dict:
    """Summarise the job's trace files that have no summary of their current size and time
    (new, or rewritten), and forget those whose file is gone. Queues itself again when its
    time is up with files left."""
    job = Job.objects.select_related("cluster").filter(pk=job_id).first()
    if job is None:
        return {"summarised": 0}
    volumes = volumes_of(job)
    files = listing(job, volumes)
    kept = {(s.attempt, s.name): s for s in TraceSummary.objects.filter(job=job)}
    present = {(attempt, f.name) for attempt, f in files}
    gone = [s.pk for key, s in kept.items() if key not in present]
    TraceSummary.objects.filter(pk__in=gone).delete()
    started = time.monotonic()
    done = 0
    for attempt, file in files:
        summary = kept.get((attempt, file.name))
        if summary is not None and (summary.size, summary.mtime) == (file.size, file.mtime):
            continue
        if time.monotonic() - started > budget_s:
            queue(job.pk)
            break
        _summarise_file(job, attempt, file, volumes)
        done += 1
    return {"summarised": done, "removed": len(gone)}


def _summarise_file(job: Job, attempt: int, file: storage.TraceFile, volumes: list) -> TraceSummary:
    """Summarise one file and keep the result, whatever the file holds: a summary, or the
    sentence saying why there is none (so a bad file is not tried again until it changes,
    and never keeps the job's other files from their summaries)."""
    started = time.monotonic()
    summary, error = None, None
    _keep(job, attempt, file, None, traces.TraceError(UNFINISHED), 0.0)
    try:
        summary = _summary(
            job, attempt, file, volumes, deadline=started + settings.SUANLI_PROFILE_FILE_SECONDS
        )
    except traces.TraceError as exc:
        error = exc
    except MemoryError:
        error = traces.TraceError(
            gettext_noop(
                "The trace needs more memory to summarise than the worker allows: profile "
                "fewer steps."
            )
        )
    except Exception as exc:  # a tenant's file: nothing in it may stop the task
        log.warning("job %s: trace %s not summarised: %r", job.pk, file.name, exc)
        error = traces.TraceError(
            gettext_noop("The trace could not be summarised (%(error)s)."),
            error=type(exc).__name__,
        )
    return _keep(job, attempt, file, summary, error, time.monotonic() - started)


def _keep(job, attempt, file, summary, error, seconds: float) -> TraceSummary:
    rank = summary.get("rank") if summary else None
    if rank is None:
        rank = rank_from_name(file.name)
    message = Text(error.message, **error.args_) if error else None
    row, _created = TraceSummary.objects.update_or_create(
        job=job,
        attempt=attempt,
        name=file.name,
        defaults={
            "size": file.size,
            "mtime": file.mtime,
            "rank": rank,
            "summary": summary,
            **twin_fields(TraceSummary, "error", message),
            "seconds": round(seconds, 3),
        },
    )
    return row


def _summary(
    job: Job, attempt: int, file: storage.TraceFile, volumes: list, *, deadline: float
) -> dict:
    handle = open_file(job, attempt, file.name, volumes)
    if handle is None:
        raise traces.TraceError(gettext_noop("The trace could not be opened."))
    with handle:
        summary = traces.summarise(
            handle,
            size=file.size,
            gzipped=file.name.endswith(".gz"),
            stream_over=settings.SUANLI_PROFILE_STREAM_BYTES,
            max_bytes=settings.SUANLI_PROFILE_MAX_BYTES,
            max_events=settings.SUANLI_PROFILE_MAX_EVENTS,
            deadline=deadline,
        )
    return _with_hta(job, attempt, file, volumes, summary) if summary["gpu"] else summary


def _with_hta(
    job: Job, attempt: int, file: storage.TraceFile, volumes: list, summary: dict
) -> dict:
    """A GPU trace's breakdown from Holistic Trace Analysis, read from a private copy (HTA
    opens paths itself: never hand it the tenant's folder), unzipped while copied so that
    its size as JSON, what HTA loads, is what is capped. Ours stays where HTA fails."""
    from monitoring import hta  # noqa: PLC0415 (pandas and HTA: loaded by the worker only)

    handle = open_file(job, attempt, file.name, volumes)
    if handle is None:
        return summary
    name = file.name.removesuffix(".gz")
    with tempfile.TemporaryDirectory(prefix="suanli-hta-") as private, handle:
        source = gzip.GzipFile(fileobj=handle) if file.name.endswith(".gz") else handle
        if not _copy_capped(source, Path(private) / name, settings.SUANLI_PROFILE_HTA_MAX_BYTES):
            return {**summary, "hta_error": "larger than SUANLI_PROFILE_HTA_MAX_BYTES as JSON"}
        try:
            found = hta.summarise_gpu(Path(private))
        except hta.HtaError as exc:
            return {**summary, "hta_error": str(exc)[:300]}
    merged = {**summary, **{k: v for k, v in found.items() if v is not None}, "source": "hta"}
    # HTA's window runs from the first kernel to the last, ours over the profiler's steps:
    # its parts, scaled to our window, keep the per-step figures in one unit.
    total = sum(merged["split"].values())
    scale = summary["window_us"] / total if total > 0 and summary["window_us"] > 0 else 1.0
    split = {k: v * scale for k, v in merged["split"].items()}
    # HTA reads kernels only: a GPU left idle while the host is in the DataLoader's
    # __next__ is data loading (ours, from the host's spans), not idle time.
    loading = min(summary["split"].get("dataloader", 0.0), split.get("idle", 0.0))
    split["idle"] = split.get("idle", 0.0) - loading
    split["dataloader"] = loading
    merged["split"] = split
    return merged


def _copy_capped(source, target: Path, limit: int) -> bool:
    """Copy at most `limit` bytes; False (and nothing usable) when there is more."""
    copied = 0
    with open(target, "wb") as out:
        while chunk := source.read(2**20):
            copied += len(chunk)
            if copied > limit:
                return False
            out.write(chunk)
    return True


def queue(job_id: int) -> None:
    transaction.on_commit(
        lambda: enqueue_unique(
            QUEUE, TASK, job_id, job_id=f"profiles-{job_id}", again_if_running=True
        )
    )


# -- the page -----------------------------------------------------------------------------


@dataclass
class FileRow:
    attempt: int
    name: str
    size: int
    mtime: float
    rank: int | None
    summary: dict | None
    error: str
    pending: bool

    @property
    def steps(self) -> str:
        steps = (self.summary or {}).get("steps") or []
        if not steps:
            return ""
        return str(steps[0]) if len(steps) == 1 else f"{steps[0]}–{steps[-1]}"


@dataclass
class Rank:
    rank: int | None
    steps: int
    split: dict[str, float]  # microseconds per step
    step_us: float
    overlap_pct: float | None
    top: list[dict]
    source: str
    gpu: bool = False

    def share(self, part: str) -> float:
        return self.split[part] / self.step_us if self.step_us else 0.0

    @property
    def step_ms(self) -> float:
        return self.step_us / 1000

    @property
    def busy_us(self) -> float:
        """The rank's own work per step: what the others wait for when it is slowest."""
        return self.step_us - self.split["idle"] - self.split["communication"]

    @property
    def cause(self) -> str | None:
        """The main part of the rank's own work; None without any."""
        part = max(("dataloader", "compute", "memcpy"), key=lambda k: self.split[k])
        return part if self.split[part] > 0 else None

    @property
    def parts(self) -> list[tuple[str, float, float]]:
        """(part, ms per step, percent of the step) in `traces.CATEGORIES` order."""
        return [(k, self.split[k] / 1000, 100 * self.share(k)) for k in traces.CATEGORIES]


@dataclass(frozen=True)
class Advice:
    title: str
    text: str
    severity: str = "warning"


@dataclass
class Profile:
    """A job's profile as it stands: its files (each with its summary's state), the ranks
    of the newest attempt with summaries, and the slowest of them."""

    folders: list[tuple[int, str, bool]]
    files: list[FileRow]
    ranks: list[Rank]
    slowest: Rank | None

    @property
    def pending(self) -> bool:
        return any(f.pending for f in self.files)


def profile_of(job: Job) -> Profile:
    """The job's profile (a read of its folders and its kept summaries); queues the worker
    for files without a current summary."""
    kept = {(s.attempt, s.name): s for s in TraceSummary.objects.filter(job=job)}
    rows = []
    volumes = volumes_of(job)
    for attempt, file in listing(job, volumes):
        summary = kept.get((attempt, file.name))
        fresh = summary is not None and (summary.size, summary.mtime) == (file.size, file.mtime)
        rows.append(
            FileRow(
                attempt=attempt,
                name=file.name,
                size=file.size,
                mtime=file.mtime,
                rank=summary.rank if summary else rank_from_name(file.name),
                summary=summary.summary if fresh else None,
                error=_error(summary) if fresh else "",
                pending=not fresh,
            )
        )
    rows.sort(key=lambda r: (-r.attempt, r.rank if r.rank is not None else 1 << 30, r.name))
    if any(r.pending for r in rows):
        queue(job.pk)
    ranks = ranks_of(rows)
    return Profile(
        folders=folders(job, volumes), files=rows, ranks=ranks, slowest=slowest_rank(ranks)
    )


def section(job: Job) -> dict:
    """What the job page's Profile section shows: the profile, its labels and charts."""
    profile = profile_of(job)
    names = labels()
    slowest, ranks = profile.slowest, profile.ranks
    return {
        "profile_folders": profile.folders,
        "profile_files": profile.files,
        "profile_pending": profile.pending,
        "profile_ranks": ranks,
        "profile_slowest": slowest,
        "profile_slowest_cause": names[slowest.cause] if slowest else "",
        "profile_slowest_name": _rank_name(slowest) if slowest else "",
        "profile_attempt": max((f.attempt for f in profile.files if f.summary), default=None),
        "profile_labels": names,
        "profile_split_chart": split_chart(ranks) if ranks else None,
        "profile_top_chart": top_chart(ranks) if ranks else None,
    }


def diagnosis(job: Job, ranks: list[Rank] | None = None) -> list[Advice]:
    """The profile's part of the job's diagnosis in words, from the kept summaries alone
    (no folder read) unless `ranks` are given: what the job page's "What slowed this job
    down" says first."""
    if ranks is not None:
        return advice(ranks, slowest_rank(ranks), workers=_workers(job)) if ranks else []
    rows = [
        FileRow(attempt=s.attempt, name=s.name, size=s.size, mtime=s.mtime, rank=s.rank,
                summary=s.summary, error="", pending=False)
        for s in TraceSummary.objects.filter(job=job, summary__isnull=False)
    ]  # fmt: skip
    ranks = ranks_of(rows)
    return advice(ranks, slowest_rank(ranks), workers=_workers(job)) if ranks else []


def _error(summary: TraceSummary) -> str:
    return show(summary.error_text) if summary.error_text else summary.error


def _workers(job: Job) -> int:
    """DataLoader workers worth having per process: 2 x the node's cores over the node's
    training processes (one per GPU under torchrun, else one)."""
    cluster = job.cluster
    processes = max(1, cluster.gpus_per_node) if job.launcher == Job.Launcher.TORCHRUN else 1
    return max(1, 2 * cores_per_node(cluster) // processes)


def ranks_of(rows: list[FileRow]) -> list[Rank]:
    """Each rank of the newest attempt that has summaries, its files summed up."""
    done = [r for r in rows if r.summary]
    if not done:
        return []
    attempt = max(r.attempt for r in done)
    by_rank: dict[int | None, list[dict]] = {}
    for row in done:
        if row.attempt == attempt:
            by_rank.setdefault(row.rank, []).append(row.summary)
    ranks = [_rank(rank, summaries) for rank, summaries in by_rank.items()]
    ranks = [r for r in ranks if r.step_us > 0]
    return sorted(ranks, key=lambda r: (r.rank is None, r.rank or 0))


def _rank(rank: int | None, summaries: list[dict]) -> Rank:
    # Files with profiler steps make the per-step figures; one without (no schedule) counts
    # as one step only when the rank has nothing else.
    summaries = [s for s in summaries if s.get("steps")] or summaries
    steps = sum(max(1, len(s.get("steps") or [])) for s in summaries)
    split = {k: sum(s["split"].get(k, 0.0) for s in summaries) / steps for k in traces.CATEGORIES}
    comm = sum(s.get("communication_us") or 0.0 for s in summaries)
    overlapped = sum(
        (s.get("communication_us") or 0.0) * (s.get("overlap_pct") or 0.0) / 100 for s in summaries
    )
    top: dict[str, dict] = {}
    for s in summaries:
        for op in s.get("top") or []:
            entry = top.setdefault(
                op["name"], {"name": op["name"], "kind": op.get("kind", "op"), "self_us": 0.0,
                             "total_us": 0.0, "calls": 0}
            )  # fmt: skip
            entry["self_us"] += op["self_us"] / steps
            entry["total_us"] += op["total_us"] / steps
            entry["calls"] += op["calls"]
    return Rank(
        rank=rank,
        steps=steps,
        split=split,
        step_us=sum(split.values()),
        overlap_pct=round(100 * overlapped / comm, 1) if comm else None,
        top=[
            {**op, "self_ms": op["self_us"] / 1000, "total_ms": op["total_us"] / 1000}
            for op in sorted(top.values(), key=lambda o: -o["self_us"])[:SHOWN]
        ],
        source="hta" if any(s.get("source") == "hta" for s in summaries) else "suanli",
        gpu=any(s.get("gpu") for s in summaries),
    )


def slowest_rank(ranks: list[Rank]) -> Rank | None:
    """The rank that does clearly the most work of its own per step (STRAGGLER times the
    others' median: they wait for it in their collectives); None with fewer than two ranks
    or when they are balanced."""
    if len(ranks) < 2:
        return None
    slowest = max(ranks, key=lambda r: r.busy_us)
    others = median(r.busy_us for r in ranks if r is not slowest)
    return slowest if slowest.cause and slowest.busy_us > STRAGGLER * others else None


def _ms(us: float) -> str:
    return f"{us / 1000:.1f}"


def _pct(share: float) -> str:
    return f"{100 * share:.0f}"


def advice(ranks: list[Rank], slowest: Rank | None, *, workers: int) -> list[Advice]:
    """The diagnosis in words from the profile: a straggler and its cause, data loading,
    exposed communication, memory copies, an idle GPU."""
    found: list[Advice] = []
    others = [r for r in ranks if r is not slowest]
    straggler = (
        slowest is not None
        and median(r.share("communication") + r.share("idle") for r in others) >= SHARE
    )
    if straggler:
        found.append(_straggler(slowest, others, workers))
    for rank in ranks:
        if straggler and rank is slowest:
            continue
        if rank.share("dataloader") >= SHARE:
            found.append(_dataloader(rank, workers))
            break
    if not straggler:
        worst = max(ranks, key=lambda r: r.share("communication"), default=None)
        if worst is not None and worst.share("communication") >= SHARE:
            found.append(_communication(worst))
    for rank in ranks:
        if rank.share("memcpy") >= SHARE:
            found.append(_memcpy(rank))
            break
    idle = max((r for r in ranks if r.gpu), key=lambda r: r.share("idle"), default=None)
    if idle is not None and idle.share("idle") >= IDLE_SHARE:
        found.append(
            Advice(
                title=_("Idle GPU"),
                text=_(
                    "the GPU of rank %(rank)s is idle %(pct)s %% of each step: the host does not "
                    "keep it busy. Look at the host's top operators in the trace (data loading, "
                    "the optimizer step, synchronisations such as .item()); larger batches or "
                    "CUDA graphs help when launches dominate."
                )
                % {"rank": _rank_name(idle), "pct": _pct(idle.share("idle"))},
            )
        )
    return found


def _dataloader_tip(workers: int) -> str:
    return _(
        "raise the DataLoader's num_workers towards %(workers)s (2 x the node's cores over its "
        "processes), with pin_memory=True and persistent_workers=True"
    ) % {"workers": workers}


def _straggler(rank: Rank, others: list[Rank], workers: int) -> Advice:
    wait = median(r.share("communication") + r.share("idle") for r in others)
    args = {
        "rank": _rank_name(rank),
        "pct": _pct(rank.share(rank.cause)),
        "ms": _ms(rank.split[rank.cause]),
        "step": _ms(rank.step_us),
        "wait": _pct(wait),
    }
    if rank.cause == "dataloader":
        text = _(
            "the DataLoader's __next__ takes %(pct)s %% of rank %(rank)s's step (%(ms)s ms of "
            "%(step)s ms); the other ranks spend %(wait)s %% of theirs waiting for it in the "
            "all-reduce: %(tip)s."
        ) % {**args, "tip": _dataloader_tip(workers)}
    elif rank.cause == "memcpy":
        text = (
            _(
                "memory copies take %(pct)s %% of rank %(rank)s's step (%(ms)s ms of %(step)s ms); "
                "the other ranks spend %(wait)s %% of theirs waiting for it: pin host memory "
                "(pin_memory=True) and copy with non_blocking=True."
            )
            % args
        )
    else:
        text = (
            _(
                "rank %(rank)s computes for %(pct)s %% of its step (%(ms)s ms of %(step)s ms) while "
                "the other ranks spend %(wait)s %% of theirs waiting for it: give every rank the "
                "same work (a DistributedSampler, equal batches) or look at its node."
            )
            % args
        )
    return Advice(
        title=_("Rank %(rank)s holds the others back") % {"rank": _rank_name(rank)}, text=text
    )


def _dataloader(rank: Rank, workers: int) -> Advice:
    return Advice(
        title=_("Data loading"),
        text=_("the DataLoader's __next__ takes %(pct)s %% of rank %(rank)s's step: %(tip)s.")
        % {
            "pct": _pct(rank.share("dataloader")),
            "rank": _rank_name(rank),
            "tip": _dataloader_tip(workers),
        },
    )


def _communication(rank: Rank) -> Advice:
    args = {"rank": _rank_name(rank), "pct": _pct(rank.share("communication"))}
    if rank.overlap_pct is None:
        text = _("rank %(rank)s spends %(pct)s %% of each step waiting for the all-reduce.") % args
    else:
        text = _(
            "rank %(rank)s spends %(pct)s %% of each step waiting for the all-reduce; "
            "communication overlaps computation %(overlap)s %%"
        ) % {**args, "overlap": f"{rank.overlap_pct:.0f}"}
    tip = _(
        "try larger gradient buckets (DDP's bucket_cap_mb) or FP16 gradient compression (the "
        "DDP fp16 compress hook)"
    )
    return Advice(title=_("Communication"), text=f"{text}: {tip}.")


def _memcpy(rank: Rank) -> Advice:
    return Advice(
        title=_("Memory copies"),
        text=_(
            "memory copies take %(pct)s %% of rank %(rank)s's step: pin host memory "
            "(pin_memory=True) and copy with non_blocking=True."
        )
        % {"pct": _pct(rank.share("memcpy")), "rank": _rank_name(rank)},
    )


def _rank_name(rank: Rank) -> str:
    return "?" if rank.rank is None else str(rank.rank)


# -- charts ---------------------------------------------------------------------------------

LAYOUT = {
    "margin": {"l": 60, "r": 10, "t": 30, "b": 40},
    "height": 260,
    "legend": {"orientation": "h", "y": -0.25},
    "paper_bgcolor": "rgba(0,0,0,0)",
    "plot_bgcolor": "rgba(0,0,0,0)",
}


def split_chart(ranks: list[Rank]) -> str:
    """One bar per rank: its step split into the five parts (ms per step)."""
    names = labels()
    y = [_("rank %(rank)s") % {"rank": _rank_name(r)} for r in ranks]
    fig = go.Figure(
        data=[
            go.Bar(
                name=names[part],
                y=y,
                x=[round(r.split[part] / 1000, 3) for r in ranks],
                orientation="h",
                marker_color=COLORS[part],
                hovertemplate="%{x:.1f} ms<extra>" + names[part] + "</extra>",
            )
            for part in traces.CATEGORIES
        ]
    )
    fig.update_layout(
        **{**LAYOUT, "legend": {**LAYOUT["legend"], "traceorder": "normal"}},
        barmode="stack",
        title={"text": _("Each step, per rank (ms)"), "font": {"size": 13}},
        yaxis={"autorange": "reversed"},
    )
    return fig.to_json()


def top_chart(ranks: list[Rank], count: int = 10) -> str:
    """The operators with the most self time over all ranks, one bar per rank (ms/step)."""
    totals: dict[str, float] = {}
    for rank in ranks:
        for op in rank.top:
            totals[op["name"]] = totals.get(op["name"], 0.0) + op["self_us"]
    names = sorted(totals, key=lambda n: -totals[n])[:count]
    fig = go.Figure(
        data=[
            go.Bar(
                name=_("rank %(rank)s") % {"rank": _rank_name(rank)},
                y=[_plain(n if len(n) <= 48 else n[:47] + "…") for n in names],
                x=[round(_self(rank, n) / 1000, 3) for n in names],
                orientation="h",
                hovertext=[_plain(n) for n in names],
                hovertemplate="%{hovertext}: %{x:.2f} ms<extra>%{fullData.name}</extra>",
            )
            for rank in ranks
        ]
    )
    fig.update_layout(
        **{**LAYOUT, "height": 120 + 26 * len(names), "margin": {**LAYOUT["margin"], "l": 300}},
        barmode="group",
        title={"text": _("Self time per step, top operators (ms)"), "font": {"size": 13}},
        yaxis={"autorange": "reversed"},
    )
    return fig.to_json()


def _self(rank: Rank, name: str) -> float:
    return next((op["self_us"] for op in rank.top if op["name"] == name), 0.0)


def _plain(name: str) -> str:
    """An operator's name as text in a Plotly label: Plotly reads a few HTML tags there
    (links among them), and a name is whatever the tenant's program called it."""
    return name.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")

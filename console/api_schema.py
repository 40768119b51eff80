"""The shapes of /api/v1/: one schema per resource and per request body (django-ninja's
Pydantic schemas). The OpenAPI document at /api/v1/schema is generated from them.

They check types and shapes only: a string is a string, a count a whole number, `env` an
object or lines. The rules (names, ranges, images, zones, the balance) are the forms' and
services', the same ones the pages use.
"""

from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Literal

from django.urls import reverse
from ninja import Field, Schema
from pydantic import BeforeValidator, PlainSerializer, WithJsonSchema
from pydantic_core import PydanticCustomError

from billing import formatting
from console import projection_panel
from console.logins import ssh_logins
from jobs.events import webhooks
from jobs.models import (
    Cluster,
    GpuSubscription,
    ImageBuild,
    Job,
    OwnImage,
    Pool,
    Sweep,
    Trial,
    WebhookDelivery,
    WebhookEndpoint,
)
from jobs.placement import fleet
from jobs.pools import subscriptions

MAX_ID = 2_147_483_647  # the database's integer keys


def iso(value: datetime | None) -> str | None:
    """UTC as `...Z`, to the microsecond."""
    return value.isoformat().replace("+00:00", "Z") if value else None


Stamp = Annotated[
    datetime,
    PlainSerializer(iso, return_type=str),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]
# Money leaves as its exact decimal digits, never a float.
Money = Annotated[
    Decimal,
    PlainSerializer(str, return_type=str),
    WithJsonSchema({"type": "string", "format": "decimal", "example": "12.5000"}),
]
# A budget as a request gives it ("50", "49.90", 50, or null for none), read by
# billing/budgets.py `parse`, whose words refuse a bad one (the forms' words).
BudgetIn = Annotated[Any, WithJsonSchema({"type": ["string", "number", "null"], "example": "50"})]
BUDGET_WORDS = (
    'stop at this much spent ("stop at ¥X"): an amount above 0 with at most 2 decimals, at '
    "most 1000000; null or left out: no budget"
)
BUDGET_OUT = "stop at this much spent (to the cent); null: no budget"
# A budget leaves to the cent (it is set to the cent), the same however it was read.
BudgetOut = Annotated[
    Decimal,
    PlainSerializer(lambda d: f"{d:.2f}", return_type=str),
    WithJsonSchema({"type": "string", "format": "decimal", "example": "50.00"}),
]
BUDGET_STOPPED = "when its budget stopped it; null: not stopped by it"


class BudgetBody(Schema):
    """A budget set (or cleared with null): the watch starts again."""

    budget: BudgetIn = Field(description=BUDGET_WORDS)


def _whole(value):
    """JSON's whole numbers, or their digits as a string; never true/false or 2.5."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise PydanticCustomError("whole_number", "Give a whole number.")
    return value


Whole = Annotated[int, BeforeValidator(_whole)]
Id = Annotated[int, Field(ge=1, le=MAX_ID), BeforeValidator(_whole)]
NodeIndex = Annotated[int, Field(ge=0, le=999), BeforeValidator(_whole)]


def _env_shape(value):
    if value is not None and not isinstance(value, dict | list | str):
        raise PydanticCustomError(
            "env_shape", "Give an object of names to values, or NAME=value lines."
        )
    return value


def _lines_shape(value):
    if value is not None and not isinstance(value, list | str):
        raise PydanticCustomError("lines_shape", "Give a list of strings.")
    return value


def _choices(choices) -> type:
    return Literal.__getitem__(tuple(value for value, _ in choices))


def _default_of(model, field: str) -> str:
    """The model's default for a new row: the API's default is the model's, never a copy."""
    return model._meta.get_field(field).default


def _one_of(choices, default: str | None = None, words: dict[str, str] | None = None) -> str:
    """`a (default), b or c` from the enum itself, so a description never names a value the
    API does not take (nor a default the model does not have)."""
    values = [value for value, _ in choices]
    if default in values:
        values.remove(default)
        values.insert(0, default)
    said = []
    for value in values:
        notes = ["default"] if value == default else []
        notes += [words[value]] if words and value in words else []
        said.append(f"{value} ({': '.join(notes)})" if notes else value)
    return ", ".join(said[:-1]) + f" or {said[-1]}" if len(said) > 1 else said[0]


RELEASE_POLICY_DEFAULT = _default_of(Cluster, "release_policy")
_RELEASE_WORDS = {
    Cluster.ReleasePolicy.NEVER: "the cluster and its files stay until you stop or release it",
    Cluster.ReleasePolicy.AFTER_LAST_JOB: "released with its workspace when its last job ends",
    Cluster.ReleasePolicy.IDLE: "released after idle_minutes without a job",
}


class Error(Schema):
    error: str = Field(description="What went wrong, in words.")
    fields: dict[str, list[str]] = Field(
        description="Per request field (as the API names it), what is wrong with it."
    )


class SshLogin(Schema):
    node: int = Field(description="the node's index")
    user: str = Field(description="the SSH user name of the node's workspace, e.g. c42-0")
    host: str = Field(description="the SSH gateway's host name")
    port: int = Field(description="the SSH gateway's port")
    command: str = Field(description="the whole command, e.g. ssh -p 2222 c42-0@host")
    host_key_fingerprint: str = Field(description="the gateway's host key, SHA256:...")


def _in_line(cluster: Cluster, context):
    """The pending cluster as the queue has it (position, why), the queue read once per
    request however many clusters an answer lists; None unless pending."""
    if cluster.state != Cluster.State.PENDING:
        return None
    request = context["request"]
    line = getattr(request, "_suanli_queue", None)
    if line is None:
        line = request._suanli_queue = {c.pk: c for c in fleet.queue()}
    return line.get(cluster.pk)


class ClusterOut(Schema):
    id: int
    name: str
    state: _choices(Cluster.State.choices)
    state_reason: str
    gpu_model: str | None = Field(description="the GPU model's slug; null on CPU-only types")
    instance_type: str | None = Field(description="the CPU-only type's name")
    nodes: int
    gpus_per_node: int
    image: str = Field(description="the image reference the nodes run")
    network: _choices(Cluster.Network.choices)
    zone: str
    spot: bool
    release_policy: _choices(Cluster.ReleasePolicy.choices)
    workspace: bool = Field(description="each node has a workspace to log in to")
    pub: bool = Field(description="the public datasets and models are read-only at /pub")
    created_at: Stamp
    running_since: Stamp | None
    released_at: Stamp | None
    no_gpu: bool = Field(description="running without GPUs (no-GPU mode): no jobs")
    stopped_at: Stamp | None = Field(
        description="when it was stopped; set while stopped or waiting to start again"
    )
    stop_at: Stamp | None = Field(
        description="scheduled stop (files kept): once, at this time; null when none"
    )
    stop_idle_minutes: int | None = Field(
        description="idle stop: after this many minutes with every GPU under stop_idle_below %"
    )
    stop_idle_below: int | None = Field(description="idle stop: the GPU utilisation, percent")
    budget: BudgetOut | None = Field(description=BUDGET_OUT)
    budget_stopped_at: Stamp | None = Field(description=BUDGET_STOPPED)
    release_at: Stamp | None = Field(
        description="when a stopped cluster is released with its workspaces unless started"
    )
    url: str = Field(description="the cluster's page in the console")
    ssh: list[SshLogin] = Field(
        description="how to log in to each node's workspace: empty unless the cluster runs "
        "with workspaces"
    )
    queue_position: int | None = Field(
        description="its place in the placement queue while pending (1: next; fair share "
        "between accounts orders it); null otherwise"
    )
    queue_why: str = Field(
        description="why it stands there, in words (e.g. waiting for its team's GPU limit); "
        "empty unless pending"
    )

    @staticmethod
    def resolve_queue_position(obj, context) -> int | None:
        standing = _in_line(obj, context)
        return standing.position if standing is not None else None

    @staticmethod
    def resolve_queue_why(obj, context) -> str:
        standing = _in_line(obj, context)
        return str(standing.why) if standing is not None else ""

    @staticmethod
    def resolve_gpu_model(obj) -> str | None:
        return obj.gpu_model.slug if obj.gpu_model_id else None

    @staticmethod
    def resolve_instance_type(obj) -> str | None:
        return obj.instance_type.name if obj.instance_type_id else None

    @staticmethod
    def resolve_image(obj) -> str:
        return obj.image_reference

    @staticmethod
    def resolve_release_at(obj) -> datetime | None:
        return obj.release_at

    @staticmethod
    def resolve_url(obj, context) -> str:
        return context["request"].build_absolute_uri(reverse("cluster_detail", args=[obj.pk]))

    @staticmethod
    def resolve_ssh(obj, context) -> list[dict]:
        return [login.as_dict() for login in ssh_logins(obj, context["request"])]


class SshKeyOut(Schema):
    id: int
    name: str
    key_type: str = Field(description="e.g. ssh-ed25519, ecdsa-sha2-nistp256, ssh-rsa")
    bits: int
    fingerprint: str = Field(description="SHA256:... as ssh-keygen -l shows it")
    public_key: str = Field(description="the key as one authorized_keys line")
    is_default: bool = Field(
        description="attached to every new cluster whose request names no ssh_keys (the "
        "console's form ticks it)"
    )
    created_at: Stamp


class NewSshKey(Schema):
    public_key: str = Field(
        min_length=1,
        max_length=16384,
        description="the contents of your .pub file: ed25519, ecdsa, or rsa with at least "
        "2048 bits",
    )
    name: str | None = Field(None, max_length=80, description="defaults to the key's comment")
    is_default: bool | None = Field(
        None, strict=True, description="attach it to every new cluster (default false)"
    )


class SshKeyChange(Schema):
    is_default: bool = Field(strict=True, description="attach it to every new cluster")


class AttachKey(Schema):
    key: Id = Field(description="the id of one of your SSH keys")


class ClusterKeysOut(Schema):
    cluster: int = Field(description="the cluster's id")
    ssh_keys: list[SshKeyOut] = Field(
        description="the keys attached to it: each may log in from its next login on"
    )


# A time as a request gives it: text, read by the console's own field (the form's words).
StampIn = Annotated[str, WithJsonSchema({"type": "string", "format": "date-time"})]
SHUTDOWN_WORDS = {
    "stop_at": "scheduled stop (files kept), once: an ISO 8601 time to come, e.g. "
    "2026-12-06T23:00:00+08:00 (without an offset: UTC)",
    "stop_idle_minutes": "idle stop: after this many minutes (10 to 1440) with every GPU under "
    "stop_idle_below percent, by the monitor's samples (none: no stop)",
    "stop_idle_below": "idle stop: the GPU utilisation, percent (1 to 100)",
}


class NewCluster(Schema):
    name: str = Field(description="lower-case letters, digits and dashes")
    gpu_model: str | None = Field(None, description="a GPU model's slug, e.g. a100-80gb")
    instance_type: str | None = Field(None, description="a CPU-only type (instead of gpu_model)")
    nodes: Whole | None = None
    gpus_per_node: Whole | None = None
    image: str | None = Field(None, description="a catalog image's reference, or any other")
    network: _choices(Cluster.Network.choices) = Field(
        _default_of(Cluster, "network"),
        description=_one_of(Cluster.Network.choices, _default_of(Cluster, "network")),
    )
    zone: str | None = Field(None, description="empty: any zone")
    spot: bool | None = Field(None, strict=True, description="a cheaper, preemptible cluster")
    volumes: Annotated[list[str] | str | None, BeforeValidator(_lines_shape)] = Field(
        None, description="storage-folder:/container/path[:ro], one per item"
    )
    release_policy: _choices(Cluster.ReleasePolicy.choices) = Field(
        RELEASE_POLICY_DEFAULT,
        description="when the console releases the cluster on its own: "
        + _one_of(Cluster.ReleasePolicy.choices, RELEASE_POLICY_DEFAULT, _RELEASE_WORDS),
    )
    idle_minutes: Whole | None = Field(
        None, description=f"with release_policy {Cluster.ReleasePolicy.IDLE}"
    )
    ssh_keys: list[Whole] | None = Field(
        None,
        description="ids of your SSH keys to attach; left out: your default keys "
        "(is_default), [] for none. Keys can be attached and detached later too",
    )
    workspace: bool | None = Field(
        None, strict=True, description="a workspace on each node to log in to (default true)"
    )
    pub: bool | None = Field(
        None,
        strict=True,
        description="the public datasets and models read-only at /pub (default true)",
    )
    stop_at: StampIn | None = Field(None, description=SHUTDOWN_WORDS["stop_at"])
    stop_idle_minutes: Whole | None = Field(None, description=SHUTDOWN_WORDS["stop_idle_minutes"])
    stop_idle_below: Whole | None = Field(None, description=SHUTDOWN_WORDS["stop_idle_below"])
    budget: BudgetIn = Field(None, description=BUDGET_WORDS)


class Shutdown(Schema):
    """A cluster's shutdown rules: a field given replaces its rule, null clears it, one left
    out stays as it is."""

    stop_at: StampIn | None = Field(None, description=SHUTDOWN_WORDS["stop_at"])
    stop_idle_minutes: Whole | None = Field(None, description=SHUTDOWN_WORDS["stop_idle_minutes"])
    stop_idle_below: Whole | None = Field(None, description=SHUTDOWN_WORDS["stop_idle_below"])


class Start(Schema):
    mode: Literal["gpu", "wait", "no_gpu"] = Field(
        "gpu",
        description="gpu (default): with its GPUs now (409 when they are taken); wait: in line for "
        "them on the hosts that keep its workspaces; no_gpu: at once without GPUs",
    )


class Resize(Schema):
    nodes: Whole | None = Field(None, description="the cluster's new node count")


class JobOut(Schema):
    id: int
    name: str
    cluster: int
    state: _choices(Job.State.choices)
    state_reason: str
    exit_code: int | None
    attempt: int
    launcher: _choices(Job.Launcher.choices)
    command: str
    created_at: Stamp
    started_at: Stamp | None
    finished_at: Stamp | None
    preemption_script: str
    max_preemptions: int
    preemptions: int = Field(description="times a spot preemption stopped it so far")
    budget: BudgetOut | None = Field(description=BUDGET_OUT)
    budget_stopped_at: Stamp | None = Field(description=BUDGET_STOPPED)
    resume_from: str | None = Field(
        description="the checkpoint the current attempt started from (its SUANLI_RESUME_FROM)"
    )
    url: str = Field(description="the job's page in the console")

    @staticmethod
    def resolve_cluster(obj) -> int:
        return obj.cluster_id

    @staticmethod
    def resolve_resume_from(obj) -> str | None:
        return obj.resume_from or None

    @staticmethod
    def resolve_url(obj, context) -> str:
        return context["request"].build_absolute_uri(reverse("job_detail", args=[obj.pk]))


TimeText = Annotated[str, WithJsonSchema({"type": "string", "format": "date-time"})]
MoneyText = Annotated[str, WithJsonSchema({"type": "string", "format": "decimal"})]


class ProjectionOut(Schema):
    """A job's finish time and final cost projected from its own progress (its rank 0's
    SUANLI_METRIC lines: `step`, and `total_steps` or SUANLI_TOTAL_STEPS). A figure it
    cannot project is null, and `why` says why."""

    at: TimeText | None = Field(description="when it was made (now)")
    step: int | None = Field(description="the newest step reported")
    total: int | None = Field(description="the total steps it declared")
    fraction: float | None = Field(description="step / total")
    seconds_per_step: float | None = Field(description="the pace, pauses counted")
    spread: float | None = Field(description="the pace's spread, relative (0.04: ±4 %)")
    window_steps: int = Field(description="how many recent steps the pace is from")
    last_at: TimeText | None = Field(description="when the newest step was reported")
    finish_at: TimeText | None
    finish_low: TimeText | None = Field(description="the earliest finish of the range")
    finish_high: TimeText | None = Field(description="the latest finish of the range")
    why: str | None = Field(description="why no finish is projected; null when one is")
    elapsed_s: int = Field(description="seconds its attempts ran so far")
    ended: bool
    currency: str
    cost_so_far: MoneyText | None = Field(description="null: the rate card has no price")
    per_hour: MoneyText | None = Field(description="its cluster's price per hour now")
    cost: MoneyText | None = Field(description="the projected final cost")
    cost_low: MoneyText | None
    cost_high: MoneyText | None
    budget: MoneyText | None = Field(description="the job's budget (stop at)")
    budget_fraction: float | None = Field(
        description="when the projection passes the budget: the share of its steps done "
        "when the budget stops it"
    )
    budget_words: str | None = Field(
        description="the budget in words: what is spent of it, or its early warning when the "
        "projection passes it"
    )
    words: str = Field(description="the whole projection in a sentence, as the page says it")


class ComparisonOut(Schema):
    """An ended job: the projection made once a fifth of its steps were done against what
    happened. Errors are signed fractions: + is later or dearer than projected."""

    fraction: float | None = Field(description="the share of its steps done when projected")
    projected_at: Stamp | None
    projected_finish: Stamp | None
    finish: Stamp | None
    finish_error: float | None = Field(description="a share of its run time")
    currency: str
    projected_cost: Money | None
    cost: Money | None
    cost_error: float | None = Field(description="a share of its cost")
    words: str


class EnergyOut(Schema):
    """Its GPUs' energy from the hosts' power readings (NVML, DCGM)."""

    joules: float | None = Field(
        description="null: no power reading (an emulated host, no GPUs, no samples yet), never 0"
    )
    kwh: float | None
    co2_g: float | None = Field(
        description="an estimate of its carbon at the operator's grid intensity; null where "
        "none is set or nothing was read"
    )
    seconds_read: int | None = Field(
        description="the seconds of power readings it is from (null: the total kept at its end)"
    )
    source: str = Field(description="nvml, dcgm; derived (emulated GPUs), cpu, stored, or empty")
    grid_g_per_kwh: float | None = Field(description="the grid intensity the carbon is at")
    words: str = Field(description="the same in a sentence, as the job page says it")


class JobDetailOut(JobOut):
    """A job with what is projected of it and what it used."""

    projection: ProjectionOut
    comparison: ComparisonOut | None = Field(
        description="a succeeded job with a projection made at a fifth of its steps: that "
        "projection against the actual finish and cost; null otherwise"
    )
    energy: EnergyOut

    @staticmethod
    def resolve_projection(obj) -> dict:
        return projection_panel.api_projection(obj)

    @staticmethod
    def resolve_comparison(obj) -> dict | None:
        return projection_panel.api_comparison(obj)

    @staticmethod
    def resolve_energy(obj) -> dict:
        return projection_panel.api_energy(obj)


class JobBody(Schema):
    """A job as submitted: to a cluster (NewJob) or to a pool."""

    name: str = Field(description="e.g. train")
    command: str = Field(description="run with /bin/sh -c in every replica")
    launcher: _choices(Job.Launcher.choices) = Field(
        _default_of(Job, "launcher"),
        description=_one_of(Job.Launcher.choices, _default_of(Job, "launcher")),
    )
    env: Annotated[
        dict[str, str | int | float] | list[str] | str | None, BeforeValidator(_env_shape)
    ] = Field(None, description='{"NAME": "value"} or ["NAME=value", ...]')
    workdir: str | None = Field(None, description="default /workspace")
    checkpoint_dir: str | None = Field(None, description="default /workspace/checkpoints")
    max_runtime_min: Whole | None = None
    retries: Whole | None = None
    preemption_script: str | None = Field(
        None,
        description="spot clusters: run in each replica with /bin/sh -c when a preemption "
        "notice arrives (e.g. save a checkpoint)",
    )
    max_preemptions: Whole | None = Field(
        None, description="preemptions the job survives (default 5); one more fails it"
    )
    budget: BudgetIn = Field(None, description=BUDGET_WORDS)


class NewJob(JobBody):
    cluster: Id = Field(description="the id of one of your running clusters")


class LogLine(Schema):
    ts: Annotated[str, WithJsonSchema({"type": "string", "format": "date-time"})] = Field(
        description="the engine's RFC 3339 timestamp of the line (to the nanosecond)"
    )
    rank: int
    text: str


class Log(Schema):
    job: int
    state: _choices(Job.State.choices)
    attempt: int = Field(description="the attempt these lines are of")
    exit_code: int | None
    complete: bool = Field(description="the job has ended and this is its last attempt's log")
    lines: list[LogLine]
    cursor: str = Field(description="pass as ?since= for the lines after these")


class TraceFileOut(Schema):
    attempt: int
    name: str
    rank: int | None = Field(description="from the trace's distributedInfo (or its file name)")
    size: int = Field(description="bytes")
    steps: list[int] = Field(description="the ProfilerStep numbers it covers")
    state: Literal["summarised", "pending", "error"]
    error: str | None = Field(description="why it could not be summarised")
    source: Literal["suanli", "hta"] | None = Field(
        description="who summarised it: the console (CPU operators) or Holistic Trace Analysis"
    )
    download: str = Field(description="the file itself (same authentication)")


class OperatorOut(Schema):
    name: str
    kind: Literal["op", "kernel"]
    self_ms: float = Field(description="per step")
    total_ms: float = Field(description="per step")
    calls: int


class RankOut(Schema):
    rank: int | None
    steps: int
    step_ms: float
    split_ms: dict[str, float] = Field(
        description="per step: dataloader, compute, memcpy, communication (not hidden by "
        "computation), idle; they add up to step_ms"
    )
    overlap_pct: float | None = Field(description="the share of communication hidden by compute")
    top: list[OperatorOut]


class SlowestOut(Schema):
    rank: int | None
    cause: Literal["dataloader", "compute", "memcpy"]


class AdviceOut(Schema):
    title: str
    text: str


class ProfileOut(Schema):
    job: int
    pending: bool = Field(description="files waiting for their summary: ask again shortly")
    folders: list[dict] = Field(description="SUANLI_PROFILE_DIR of each attempt")
    files: list[TraceFileOut]
    ranks: list[RankOut] = Field(description="the newest attempt with summaries")
    slowest: SlowestOut | None = Field(description="the rank the others wait for (2+ ranks)")
    advice: list[AdviceOut]


MEMBER_WORDS = (
    "a team's usage: the login of the member whose budget it counts against (who made the "
    "cluster); empty for one researcher's own account, the team's storage and every entry "
    "not usage"
)


def _login_of(user) -> str:
    return user.username if user is not None else ""


class Entry(Schema):
    kind: str
    amount: Money = Field(description="signed, in the balance's currency: usage is negative")
    balance_after: Money
    cluster: int | None
    member: str = Field(description=MEMBER_WORDS)
    period_from: Stamp | None
    period_to: Stamp | None
    units: int | None
    rate: Money | None
    memo: str
    created_at: Stamp

    @staticmethod
    def resolve_cluster(obj) -> int | None:
        return obj.cluster_id

    @staticmethod
    def resolve_member(obj) -> str:
        return _login_of(obj.member)


class Balance(Schema):
    currency: str
    balance: Money
    burn_per_hour: Money = Field(description="what your running clusters cost an hour")
    hours_left: Money | None = Field(description="at that rate; null when nothing runs")
    seconds_left: int | None = Field(description="the same in seconds; null when nothing runs")
    time_left: str | None = Field(
        description='the same in words, as the pages\' banner says it ("1 h 20 min"); null '
        "when nothing runs"
    )
    entries: list[Entry] = Field(description="the newest 50 ledger entries")


class BalanceWarning(Schema):
    hours: Decimal | None = Field(
        description="warn when the balance lasts fewer hours than this at the current burn "
        "(0.5 to 168); null: the operator's default",
        examples=["3"],
    )


class BalanceWarningOut(Schema):
    hours: Money | None = Field(description="your own threshold; null: the default")
    default_hours: Money = Field(description="the operator's default threshold")
    in_force_hours: Money = Field(description="the threshold that applies to you now")
    critical_minutes: int = Field(description="balance.critical comes under this many minutes")


# billing's LedgerEntry.Kind
BILL_KINDS = ("topup", "usage", "refund", "adjustment", "credit", "transfer")


class BillFilter(Schema):
    month: str | None = Field(
        None,
        pattern=r"^\d{4}-\d{2}$",
        description="`2026-12` (a UTC month); this month if left out",
    )
    kind: Literal[BILL_KINDS] | None = Field(None, description="only lines of this kind")  # type: ignore[valid-type]
    cluster: Id | None = Field(None, description="only this cluster's lines")
    page: int = Field(1, ge=1, le=100_000)


class PiecesFilter(Schema):
    page: int = Field(1, ge=1, le=100_000)


class BillLineOut(Schema):
    """One line of the bill: a usage line is one cluster's pieces whose period began in one
    UTC hour, at one size and rate; every other entry (a top-up, refund, adjustment,
    credit, a minimum charge) is a line of its own."""

    id: int
    kind: Literal[BILL_KINDS]  # type: ignore[valid-type]
    at: Stamp = Field(
        description="its place in time: usage, when its first piece began; any other "
        "entry, when it was posted"
    )
    amount: Money = Field(description="signed, in the bill's currency: usage is negative")
    balance_after: Money = Field(
        description="the account's balance after this line, in the bill's order (`at`, "
        "then `id`): the newest line's is the balance now"
    )
    cluster: int | None
    cluster_name: str
    member: str = Field(description=MEMBER_WORDS)
    resource: str = Field(description="the GPU model, the CPU-only instance type, or storage")
    hour: Stamp | None = Field(description="usage: the UTC hour its pieces began in")
    period_from: Stamp | None
    period_to: Stamp | None
    seconds: int | None = Field(description="usage: the seconds its pieces cover")
    units: int = Field(description="GPUs (or nodes, or GB of storage) held")
    rate: Money | None = Field(description="per unit-hour, after any spot discount")
    pieces: int = Field(description="how many ledger entries it sums (GET its /pieces)")
    memo: str

    @staticmethod
    def resolve_cluster(obj) -> int | None:
        return obj.cluster_id

    @staticmethod
    def resolve_rate(obj) -> Decimal | None:
        return formatting.rate(obj.rate)  # "3.6920", not the ledger's "3.69200000"

    @staticmethod
    def resolve_member(obj) -> str:
        return _login_of(obj.member)


class BillOut(Schema):
    currency: str
    month: str = Field(description="`2026-12`")
    lines: list[BillLineOut] = Field(description="newest first, 50 a page")
    page: int
    pages: int
    count: int


class PiecesOut(Schema):
    currency: str
    line: BillLineOut
    pieces: list[Entry] = Field(description="the ledger entries it sums, newest first, 50 a page")
    page: int
    pages: int
    count: int


# -- own images -------------------------------------------------------------------------------


class ImageOut(Schema):
    id: int
    name: str
    tag: str
    reference: str = Field(description="what a cluster runs: <registry>/u<you>/<name>:<tag>")
    digest: str = Field(description="the manifest's digest in the registry")
    size_bytes: int = Field(
        description="its size on a host's disk (its layers uncompressed), as the quota counts it"
    )
    source: _choices(OwnImage.Source.choices)
    source_note: str
    created_at: Stamp
    clusters: list[int] = Field(description="the ids of your clusters (not released) using it")

    @staticmethod
    def resolve_clusters(obj) -> list[int]:
        return [c.pk for c in getattr(obj, "using", [])]


class QuotaOut(Schema):
    count: int = Field(description="your images")
    max_count: int
    bytes: int = Field(description="their distinct layers in the registry, compressed")
    max_bytes: int


class ImagesOut(Schema):
    images: list[ImageOut]
    quota: QuotaOut
    enabled: bool = Field(description="false: the operator has configured no image registry")


class NewBuild(Schema):
    name: str = Field(description="lower-case letters and digits, e.g. my-torch")
    tag: str | None = Field(None, description="default latest")
    dockerfile: str = Field(
        description="its text: FROM a catalog image, one of yours, or one the operator allows"
    )
    context: str | None = Field(
        None, description="one of your storage folders, sent as the build context (optional)"
    )
    build_args: dict[str, str] | None = Field(None, description='{"NAME": "value"}: ARG values')


class SaveImage(Schema):
    name: str | None = Field(None, description="lower-case letters and digits, e.g. my-env")
    tag: str | None = Field(None, description="default latest")


class BuildLine(Schema):
    seq: int = Field(description="the line's number in the build's log, from 1")
    text: str


class BuildOut(Schema):
    id: int
    kind: _choices(ImageBuild.Kind.choices)
    name: str
    tag: str
    state: _choices(ImageBuild.State.choices)
    step: str = Field(description="the step being run, e.g. Step 2/5 : RUN ...")
    done_bytes: int = Field(description="pushed (or committed) so far")
    total_bytes: int
    error: str = Field(description="why it failed, in words")
    image: str | None = Field(description="the pushed image's reference, once it succeeded")
    cluster: int | None = Field(description="a saved workspace's cluster")
    node_index: int | None
    created_at: Stamp
    started_at: Stamp | None
    finished_at: Stamp | None
    url: str = Field(description="the build's page in the console (its live log)")
    lines: list[BuildLine] = Field(
        description="its log lines after ?after= (all of them without it); none in the "
        "answer to a new build"
    )

    @staticmethod
    def resolve_image(obj) -> str | None:
        return obj.image.reference if obj.image_id and obj.image else None

    @staticmethod
    def resolve_cluster(obj) -> int | None:
        return obj.cluster_id

    @staticmethod
    def resolve_url(obj, context) -> str:
        return context["request"].build_absolute_uri(reverse("image_build", args=[obj.pk]))

    @staticmethod
    def resolve_lines(obj) -> list[dict]:
        return [{"seq": seq, "text": text} for seq, text in getattr(obj, "lines", [])]


# -- pools (issue 26) -------------------------------------------------------------------


class NewPool(Schema):
    name: str = Field(description="lower-case letters, digits and dashes")
    gpu_model: str | None = Field(None, description="a GPU model's slug, e.g. a100-80gb")
    instance_type: str | None = Field(None, description="a CPU-only type (instead of gpu_model)")
    nodes: Whole | None = Field(None, description="nodes of each cluster")
    gpus_per_node: Whole | None = None
    image: str | None = Field(None, description="a catalog image's reference, or any other")
    network: _choices(Cluster.Network.choices) = Field(
        _default_of(Cluster, "network"),
        description=_one_of(Cluster.Network.choices, _default_of(Cluster, "network")),
    )
    zone: str | None = Field(None, description="empty: any zone")
    spot: bool | None = Field(None, strict=True, description="cheaper, preemptible clusters")
    volumes: Annotated[list[str] | str | None, BeforeValidator(_lines_shape)] = Field(
        None, description="storage-folder:/container/path[:ro], one per item"
    )
    pub: bool | None = Field(
        None,
        strict=True,
        description="the public datasets and models read-only at /pub (default true)",
    )
    min_clusters: Whole | None = Field(None, description="kept even when idle (default 0)")
    max_clusters: Whole | None = Field(
        None, description="added while jobs wait, up to this many (default 1)"
    )
    idle_minutes: Whole | None = Field(
        None, description="a cluster idle this many minutes is released (default 10)"
    )
    budget_per_hour: Decimal | None = Field(
        None, description="no more clusters at once than this pays for an hour"
    )
    budget_total: Decimal | None = Field(
        None, description="once spent, no cluster is added and idle ones are released"
    )


class PoolEventOut(Schema):
    at: Stamp
    kind: str = Field(description="created, grow, held (more wanted, held back), shrink, closed")
    message: str = Field(description="the decision and why, in English")
    figures: dict = Field(description="the figures it was decided on")


class PoolOut(Schema):
    id: int
    name: str
    state: _choices(Pool.State.choices)
    gpu_model: str | None = Field(description="the GPU model's slug; null on CPU-only types")
    instance_type: str | None = Field(description="the CPU-only type's name")
    nodes: int
    gpus_per_node: int
    image: str = Field(description="the image reference the clusters run")
    network: _choices(Cluster.Network.choices)
    zone: str
    spot: bool
    volumes: list[str] = Field(description="storage-folder:/container/path[:ro]")
    pub: bool = Field(description="the public datasets and models are read-only at /pub")
    min_clusters: int
    max_clusters: int
    idle_minutes: int
    budget_per_hour: Money | None
    budget_total: Money | None
    rate_per_hour: Money | None = Field(description="one cluster's price an hour now")
    spent: Money = Field(description="what the pool's clusters have been charged so far")
    clusters_live: int = Field(description="clusters pending or running now")
    jobs_waiting: int
    jobs_running: int
    created_at: Stamp
    closed_at: Stamp | None
    url: str = Field(description="the pool's page in the console")

    @staticmethod
    def resolve_gpu_model(obj) -> str | None:
        return obj.gpu_model.slug if obj.gpu_model_id else None

    @staticmethod
    def resolve_instance_type(obj) -> str | None:
        return obj.instance_type.name if obj.instance_type_id else None

    @staticmethod
    def resolve_image(obj) -> str:
        return obj.image_reference

    @staticmethod
    def resolve_volumes(obj) -> list[str]:
        return [
            f"{v['source']}:{v['target']}{':ro' if v.get('read_only') else ''}" for v in obj.volumes
        ]

    @staticmethod
    def resolve_clusters_live(obj) -> int:
        return obj.live

    @staticmethod
    def resolve_jobs_waiting(obj) -> int:
        return obj.waiting

    @staticmethod
    def resolve_jobs_running(obj) -> int:
        return obj.running

    @staticmethod
    def resolve_url(obj, context) -> str:
        return context["request"].build_absolute_uri(reverse("pool_detail", args=[obj.pk]))


class PoolDetailOut(PoolOut):
    figures: dict[str, int] = Field(
        description="now: waiting, running, clusters, starting, ready, free, finishing"
    )
    clusters: list[ClusterOut] = Field(description="its live clusters")
    waiting: list[JobOut] = Field(description="its waiting jobs, first to run first")
    running: list[JobOut]
    events: list[PoolEventOut] = Field(description="the newest 50 lines of its timeline")

    @staticmethod
    def resolve_clusters(obj) -> list:
        return obj.live_clusters

    @staticmethod
    def resolve_waiting(obj) -> list:
        return obj.waiting_jobs

    @staticmethod
    def resolve_running(obj) -> list:
        return obj.running_jobs

    @staticmethod
    def resolve_events(obj) -> list:
        return obj.last_events

    @staticmethod
    def resolve_figures(obj) -> dict:
        return obj.figures_now


# -- sweeps (issue 26) ------------------------------------------------------------------


class NewSweep(Schema):
    name: str | None = None
    pool: Id = Field(description="the id of one of your active pools")
    command: str = Field(description="run with /bin/sh -c, once per trial")
    env: Annotated[
        dict[str, str | int | float] | list[str] | str | None, BeforeValidator(_env_shape)
    ] = Field(None, description='{"NAME": "value"} or ["NAME=value", ...], for every trial')
    workdir: str | None = Field(None, description="default /workspace")
    space: list[dict] | str = Field(
        description='[{"name": "lr", "type": "log_uniform", "low": 1e-5, "high": 0.1}, '
        '{"name": "opt", "type": "categorical", "choices": ["adam", "sgd"]}] (types: uniform, '
        "log_uniform, int, categorical), or the form's lines ('lr: log_uniform 1e-5 1e-1')",
    )
    metric: str = Field(
        description='the name the trials print: SUANLI_METRIC {"step": 100, "val_loss": 0.41}'
    )
    direction: _choices(Sweep.Direction.choices) = Field(
        Sweep.Direction.MINIMIZE,
        description=_one_of(Sweep.Direction.choices, Sweep.Direction.MINIMIZE),
    )
    trials: Whole | None = Field(None, description="how many trials in all (default 20)")
    parallel: Whole | None = Field(None, description="trials at a time (default 1)")
    pruner: _choices(Sweep.Pruner.choices) = Field(
        _default_of(Sweep, "pruner"),
        description=_one_of(Sweep.Pruner.choices, _default_of(Sweep, "pruner")),
    )
    min_steps: Whole | None = Field(None, description="steps before a trial may be pruned")
    budget: BudgetIn = Field(None, description=BUDGET_WORDS)


class SweepOut(Schema):
    id: int
    name: str
    pool: int
    state: _choices(Sweep.State.choices)
    metric: str
    direction: _choices(Sweep.Direction.choices)
    trials: int
    trials_done: int = Field(description="trials that have ended (complete, pruned or failed)")
    best_value: float | None = Field(description="the best complete trial's last value")
    created_at: Stamp
    finished_at: Stamp | None
    budget: BudgetOut | None = Field(description=BUDGET_OUT)
    budget_stopped_at: Stamp | None = Field(description=BUDGET_STOPPED)
    url: str = Field(description="the sweep's page in the console")

    @staticmethod
    def resolve_pool(obj) -> int:
        return obj.pool_id

    @staticmethod
    def resolve_best_value(obj) -> float | None:
        # Annotated by the API's query (console/api.py `_sweeps_of`).
        return obj.best_min if obj.direction == Sweep.Direction.MINIMIZE else obj.best_max

    @staticmethod
    def resolve_url(obj, context) -> str:
        return context["request"].build_absolute_uri(reverse("sweep_detail", args=[obj.pk]))


class TrialOut(Schema):
    number: int
    state: _choices(Trial.State.choices)
    params: dict
    job: int | None
    last_step: int | None
    last_value: float | None
    best_value: float | None
    points: int = Field(description="how many (step, value) points its curve holds")
    seconds: float
    cost: Money | None
    note: str


class SavingsOut(Schema):
    unit: Literal["GPU", "node"]
    units: int = Field(description="GPUs (or nodes) per trial")
    full_steps: int | None = Field(
        description="the last step of the longest complete trial (None: none complete yet)"
    )
    pruned: int
    used_unit_seconds: float
    full_unit_seconds: float = Field(description="had every pruned trial run to full_steps")
    saved_unit_seconds: float
    saved_share: float = Field(description="0 to 1")
    used_cost: Money | None
    saved_cost: Money | None
    currency: str


class SweepDetailOut(SweepOut):
    command: str
    env: dict
    workdir: str
    space: list[dict]
    parallel: int
    pruner: _choices(Sweep.Pruner.choices)
    min_steps: int
    best_trial: int | None = Field(description="the best complete trial's number")
    trial_list: list[TrialOut] = Field(description="every trial so far, by number")
    savings: SavingsOut


class GpuSubscriptionOut(Schema):
    id: int
    gpu_model: str = Field(description="the GPU model's slug")
    gpu_model_name: str
    nodes: int
    gpus_per_node: int
    zone: str = Field(description='"" for any zone')
    state: _choices(GpuSubscription.State.choices)
    created_at: Stamp
    expires_at: Stamp
    fired_at: Stamp | None
    rent: dict | None = Field(
        description="the cluster to rent when it fires (name, image, spot, ssh_keys); null: "
        "notify only"
    )
    budget_per_hour: Money | None = Field(description="the most the cluster may cost an hour")
    cluster: int | None = Field(description="the cluster rented when it fired")
    outcome: str = Field(description="what happened when it fired, in words")
    warning: str = Field(
        description="a waiting one whose firing would reach nobody: why, with the link to "
        'Notifications (no channel enabled and confirmed takes gpu.available); "" otherwise'
    )

    @staticmethod
    def resolve_warning(obj):
        return subscriptions.unheard(obj)

    @staticmethod
    def resolve_gpu_model(obj):
        return obj.gpu_model.slug

    @staticmethod
    def resolve_gpu_model_name(obj):
        return obj.gpu_model.name

    @staticmethod
    def resolve_cluster(obj):
        return obj.cluster_id

    @staticmethod
    def resolve_outcome(obj):
        return obj.outcome_shown


class NewGpuSubscription(Schema):
    gpu_model: str = Field(description="a GPU model's slug, e.g. a100-80gb")
    nodes: Whole | None = Field(None, description="nodes (default 1)")
    gpus_per_node: Whole
    zone: str | None = Field(None, description="a zone; left out: any zone")
    expires_in_hours: Whole | None = Field(None, description="1 to 720 (30 days); default 24")
    rent: bool | None = Field(
        None, strict=True, description="create the cluster when it fires (default false)"
    )
    name: str | None = Field(None, description="the cluster's name, to rent")
    image: str | None = Field(None, description="the cluster's image reference, to rent")
    spot: bool | None = Field(None, strict=True)
    ssh_keys: list[Whole] | None = Field(
        None, description="ids of your SSH keys; left out: your default keys"
    )
    budget_per_hour: str | None = Field(
        None,
        description='to rent: the most it may cost an hour, e.g. "30.00" (no limit if left out)',
    )


# -- notification channels (the page "Notifications") ---------------------------------------

_CHANNEL_KINDS = WebhookEndpoint.Kind.choices
_EVENT_TYPES = ", ".join(value for value, _label in WebhookEndpoint.EVENTS)


class NotificationChannelOut(Schema):
    id: int
    kind: _choices(_CHANNEL_KINDS)
    address: str = Field(description="the https URL of a webhook or robot; an e-mail address")
    events: list[str] = Field(description=f"the events it takes, of: {_EVENT_TYPES}")
    enabled: bool
    confirmed: bool = Field(
        description="false for an e-mail address other than your account's until the link "
        "e-mailed to it is opened: it gets nothing else until then"
    )
    signed: bool = Field(description="signed: a webhook always; a robot given a secret")
    failing_since: Stamp | None = Field(description="deliveries have failed since then")
    disabled_reason: str = Field(description='why it was turned off for failing; "" if not')
    last_success_at: Stamp | None
    created_at: Stamp

    @staticmethod
    def resolve_address(obj):
        return obj.url

    @staticmethod
    def resolve_confirmed(obj):
        return obj.kind != WebhookEndpoint.Kind.EMAIL or obj.confirmed_at is not None

    @staticmethod
    def resolve_signed(obj):
        return bool(obj.secret)


class NewNotificationChannelOut(NotificationChannelOut):
    secret: str | None = Field(
        description="a webhook's signing secret (whsec_...), shown this once; null for the "
        "other kinds"
    )
    confirmation_sent: bool = Field(
        description="a confirmation link was e-mailed to the address (an e-mail address "
        "other than your account's)"
    )

    @staticmethod
    def resolve_secret(obj):
        return getattr(obj, "secret_once", None)  # never a robot's own secret

    @staticmethod
    def resolve_confirmation_sent(obj):
        return getattr(obj, "confirmation_sent", False)


class NewNotificationChannel(Schema):
    kind: str | None = Field(
        None,
        description="webhook (default), email, wecom, dingtalk, feishu, slack or discord; "
        "fixed once made",
    )
    address: str = Field(
        description="a webhook or robot: its https URL on a public address; e-mail: the "
        "address (one other than your account's gets a confirmation link first)"
    )
    events: list[str] = Field(description=f"at least one of: {_EVENT_TYPES}")
    enabled: bool | None = Field(None, strict=True, description="default true")
    secret: str | None = Field(
        None, description="a DingTalk or Feishu robot's signing secret (SEC...); none: unsigned"
    )


class NotificationChannelChange(Schema):
    kind: str | None = Field(None, description="fixed: only its own kind may be given")
    address: str | None = Field(
        None, description="a new address (an e-mail address is confirmed again)"
    )
    events: list[str] | None = None
    enabled: bool | None = Field(
        None, strict=True, description="true again clears a channel turned off for failing"
    )
    secret: str | None = Field(
        None, description="a DingTalk or Feishu robot's new signing secret; left out: unchanged"
    )


class ChannelTestOut(Schema):
    sent: Literal["test", "confirmation"] = Field(
        description="test: a webhook.test event is on its way (see its deliveries); "
        "confirmation: the e-mail address is not confirmed yet, a new link is on its way"
    )
    message: str


class DeliveryOut(Schema):
    id: int
    event: str = Field(description="the event's type, e.g. job.failed, webhook.test")
    event_id: str = Field(description="the webhook-id header of every attempt")
    summary: str = Field(description="what happened, in words (English)")
    state: _choices(WebhookDelivery.State.choices)
    attempts: int
    last_status: int | None = Field(description="the last attempt's HTTP status")
    created_at: Stamp
    next_attempt_at: Stamp | None = Field(description="when it is tried again, if pending")

    @staticmethod
    def resolve_event(obj):
        return obj.event.type

    @staticmethod
    def resolve_event_id(obj):
        return obj.event.uid

    @staticmethod
    def resolve_summary(obj):
        return webhooks.words(obj.event)

    @staticmethod
    def resolve_next_attempt_at(obj):
        return obj.next_attempt_at if obj.state == WebhookDelivery.State.PENDING else None

"""The engine's state: the fleet (hosts and their GPU slots) and the catalogs it offers.

Layer: models (beside migrations), under every package of jobs/ but base, which is all it uses.
"""

from datetime import datetime, timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, URLValidator
from django.db import models
from django.utils import timezone
from django.utils.translation import gettext, gettext_lazy, gettext_noop

from jobs.base import validators
from jobs.base.crypto import EncryptedTextField
from jobs.base.text import Text
from jobs.base.text import show as show_text

# The platform's own environment variables; defined beside the check that refuses them.
from jobs.base.validators import RESERVED_ENV as RESERVED_ENV
from jobs.base.validators import RESERVED_ENV_PREFIXES as RESERVED_ENV_PREFIXES

MAX_GPUS_PER_HOST = 16
MONEY = {"max_digits": 20, "decimal_places": 4}


class GpuModel(models.Model):
    """A GPU model the operator offers (T4 16 GB, A100 80 GB, ...)."""

    name = models.CharField(
        max_length=64, unique=True, help_text="As researchers see it, e.g. A100 80 GB."
    )
    slug = models.SlugField(max_length=64, unique=True)
    memory_gb = models.PositiveSmallIntegerField(validators=[MinValueValidator(1)])
    bf16 = models.BooleanField("BF16", default=False, help_text="Supports bfloat16 training.")
    nvlink = models.BooleanField(
        "NVLink", default=False, help_text="GPUs of one host are linked by NVLink."
    )
    root_disk_gb = models.PositiveSmallIntegerField(
        "system disk (GB)",
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(4096)],
        help_text="Each node's own root filesystem (files outside its volumes, the image's "
        "included). Blank: SUANLI_ROOT_DISK_GB.",
    )

    class Meta:
        verbose_name = gettext_lazy("gpu model")
        verbose_name_plural = gettext_lazy("gpu models")
        ordering = ["memory_gb", "name"]

    def __str__(self) -> str:
        return self.name


class InstanceType(models.Model):
    """A CPU-only instance, for debugging code before paying for GPUs."""

    name = models.CharField(max_length=64, unique=True, help_text="e.g. cpu-4c-16g")
    vcpus = models.PositiveSmallIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(512)]
    )
    memory_gb = models.PositiveSmallIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(4096)]
    )
    description = models.CharField(max_length=200, blank=True)
    root_disk_gb = models.PositiveSmallIntegerField(
        "system disk (GB)",
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(4096)],
        help_text="Each node's own root filesystem (files outside its volumes, the image's "
        "included). Blank: SUANLI_ROOT_DISK_GB.",
    )

    class Meta:
        verbose_name = gettext_lazy("instance type")
        verbose_name_plural = gettext_lazy("instance types")
        ordering = ["vcpus", "memory_gb"]

    def __str__(self) -> str:
        return f"{self.name} ({self.vcpus} vCPU, {self.memory_gb} GB)"


def root_disk_gb(kind: GpuModel | InstanceType | None) -> int:
    """The system disk, in GB, of a node of this GPU model or instance type."""
    return (kind.root_disk_gb if kind else None) or settings.SUANLI_ROOT_DISK_GB


class Image(models.Model):
    """A curated container image researchers pick from."""

    name = models.CharField(max_length=80, unique=True)
    reference = models.CharField(
        max_length=255,
        validators=[validators.validate_image_reference],
        help_text="Docker reference, e.g. pytorch/pytorch:2.4.0-cuda12.1-cudnn9-runtime",
    )
    framework = models.CharField(max_length=80, blank=True, help_text="e.g. PyTorch 2.4")
    cuda_version = models.CharField("CUDA version", max_length=20, blank=True)
    description = models.TextField(blank=True)
    active = models.BooleanField(default=True, help_text="Offered on the cluster form.")
    pullable = models.BooleanField(
        default=True,
        help_text="Hosts pull it from its registry when they lack it. Off for an image built "
        "on the hosts themselves: it is offered only where a host has it.",
    )
    apps = models.CharField(
        max_length=80,
        blank=True,
        help_text="The workspace apps it carries, by name: jupyter, tensorboard (space between). "
        "The cluster page's tiles name the images that have them.",
    )
    # Percent done while this machine builds it for its own engine (`make run`,
    # jobs/management/commands/catalog_prepare.py); None otherwise.
    preparing = models.PositiveSmallIntegerField(null=True, blank=True, editable=False)

    class Meta:
        verbose_name = gettext_lazy("image")
        verbose_name_plural = gettext_lazy("images")
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class InFleet(models.Manager):
    """Hosts that have not left the fleet (Host.State.LEFT)."""

    def get_queryset(self):
        return super().get_queryset().exclude(state="left")


class Host(models.Model):
    """A Docker engine the operator registered.

    `state` is what placement reads: *active* hosts take new work, *draining* hosts keep
    what runs on them, *degraded* hosts answer but could not start a container (the
    check's canary, or a job's start, failed for a reason of the engine), *down* hosts did
    not answer their last check. It is derived from the last check and the operator's
    drain flag, so a host that comes back returns to the state the operator left it in.
    Clusters leave degraded hosts at once and down ones after `SUANLI_HOST_DOWN_MOVE_S`.
    """

    class State(models.TextChoices):
        ACTIVE = "active", gettext_lazy("active")
        DRAINING = "draining", gettext_lazy("draining")
        DEGRADED = "degraded", gettext_lazy("degraded")
        DOWN = "down", gettext_lazy("down")
        # Left the fleet (`join.sh leave`): kept only as the history of the nodes it ran.
        LEFT = "left", gettext_lazy("left")

    UNHEALTHY = (State.DEGRADED, State.DOWN)

    name = models.CharField(max_length=63, unique=True, validators=[validators.validate_host_name])
    engine_url = models.CharField(
        max_length=255,
        help_text="unix:///var/run/docker.sock for a local engine, or tcp://HOST:2376 with TLS.",
    )
    # Stored encrypted (jobs/base/crypto.py): the key is what opens the engine; the certificates
    # say which engines and CA it trusts.
    tls_ca = EncryptedTextField(
        "TLS CA certificate", blank=True, help_text="PEM. Required for tcp://."
    )
    tls_cert = EncryptedTextField(
        "TLS client certificate", blank=True, help_text="PEM. Required for tcp://."
    )
    tls_key = EncryptedTextField(
        "TLS client key", blank=True, help_text="PEM, unencrypted. Required for tcp://."
    )
    address = models.CharField(
        max_length=253,
        validators=[validators.validate_address],
        help_text="The host's address on the hosts' network (its swarm address).",
    )
    zone = models.SlugField(max_length=40, help_text="e.g. zone-a")
    gpu_model = models.ForeignKey(
        GpuModel,
        on_delete=models.PROTECT,
        null=True,
        blank=True,
        related_name="hosts",
        help_text="Leave empty for a CPU-only host.",
    )
    gpu_count = models.PositiveSmallIntegerField("GPUs", default=0)
    rdma = models.BooleanField("RDMA capable", default=False)

    state = models.CharField(max_length=10, choices=State.choices, default=State.DOWN)
    drain_requested = models.BooleanField(default=False)
    emulated_gpu = models.BooleanField(
        "emulated GPUs",
        default=True,
        help_text="No NVIDIA runtime on the engine: GPUs are bookkeeping only.",
    )
    dcgm_url = models.URLField(
        "dcgm-exporter URL",
        blank=True,
        validators=[URLValidator(schemes=["http", "https"])],
        help_text="Optional: the host's dcgm-exporter metrics endpoint (http(s)://host:9400/metrics). "
        "GPU samples then come from it instead of NVML.",
    )
    build_host = models.BooleanField(
        "build host",
        default=False,
        help_text="Builds researchers' images (Images page) and saves workspaces as images, "
        "under the build limits of the settings.",
    )
    docker_version = models.CharField(max_length=40, blank=True)
    # The catalog images (their references) the engine had at its last check: the cluster
    # form says where each can run without asking any engine (jobs/placement/catalog.py).
    images = models.JSONField(default=list, blank=True, editable=False)
    storage_driver = models.CharField(max_length=40, blank=True)
    root_disk_enforced = models.BooleanField(
        "system disk enforced",
        default=False,
        help_text="The last check found the engine's storage driver limits a container's "
        "root filesystem (btrfs, zfs, overlay2 on XFS with pquota); otherwise the monitor "
        "measures it.",
    )
    operating_system = models.CharField(max_length=120, blank=True)
    cpu_count = models.PositiveIntegerField(null=True, blank=True)
    memory_bytes = models.BigIntegerField(null=True, blank=True)
    last_checked = models.DateTimeField(null=True, blank=True)
    last_seen = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    # The last check's failed proofs (jobs/hosts/proofs.py) as a jobs.base.text Text's JSON, shown in
    # the reader's language (last_error keeps them in English); None for the engine's words.
    last_error_text = models.JSONField(null=True, blank=True, editable=False)
    # The engine's Docker swarm, as the last check saw it. Multi-node clusters that span
    # hosts ride an overlay network of the swarm, so only its members may share one.
    swarm_state = models.CharField(
        max_length=12, blank=True, help_text="The engine's swarm state (active = a member)."
    )
    swarm_cluster = models.CharField(
        "swarm",
        max_length=64,
        blank=True,
        help_text="Members of one swarm share this (a manager's node ID).",
    )
    swarm_manager = models.BooleanField(default=False)
    unhealthy_since = models.DateTimeField(
        null=True, blank=True, help_text="When it was first seen down or degraded, this time."
    )
    # The last time the console lost the engine (its events stream broke, a check got no
    # answer) and when it answered again: a container that ended in that window was ended
    # by the engine (a restart SIGTERMs or kills them), not by the job.
    outage_from = models.DateTimeField(null=True, blank=True)
    outage_to = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    # The fleet: every part of the console reads hosts through `objects`, which never
    # shows a host that left; the admin, unique checks and a host joining again see all.
    all_objects = models.Manager()
    objects = InFleet()

    class Meta:
        verbose_name = gettext_lazy("host")
        verbose_name_plural = gettext_lazy("hosts")
        ordering = ["zone", "name"]
        default_manager_name = "all_objects"
        # Operators' powers over running work, each granted on its own (admin and /ops/).
        permissions = [
            ("drain_host", "Can drain and undrain hosts"),
            ("reclaim_spot", "Can reclaim a host's spot capacity (preempts its spot clusters)"),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def uses_tls(self) -> bool:
        return self.engine_url.startswith("tcp://")

    def gpu_share(self, gpus: int) -> tuple[float, int | None]:
        """(CPUs, memory bytes or None when unknown) that `gpus` of this host's GPUs bring:
        their share of its cores and memory, at least one core per GPU where the host has
        them (an emulated host may list more GPUs than it has cores)."""
        gpus = max(gpus, 1)
        share = gpus / max(self.gpu_count or gpus, gpus)
        cores = self.cpu_count or 0
        cpus = max(cores * share, min(gpus, cores)) if cores else float(gpus)
        memory = int(self.memory_bytes * share) if self.memory_bytes else None
        return round(cpus, 2), memory

    @property
    def swarm_member(self) -> bool:
        return self.swarm_state == "active" and bool(self.swarm_cluster)

    @property
    def network_note(self) -> str:
        """What the host's swarm state means for placement, in an operator's words."""
        if self.swarm_member:
            if self.swarm_manager:
                return gettext("swarm manager: takes multi-node clusters that span hosts")
            return gettext("swarm worker: takes multi-node clusters that span hosts")
        return gettext(
            "not a swarm member (%(state)s): takes clusters whose nodes all fit on this host; "
            "join it to the fleet's swarm for multi-node clusters across hosts"
        ) % {"state": self.swarm_state or "unknown"}

    @property
    def last_error_shown(self) -> str:
        """The last check's problem in the reader's language where it was our words."""
        return show_text(self.last_error_text) if self.last_error_text else self.last_error

    @property
    def health_note(self) -> str:
        """What an unhealthy host means for the work on it, in an operator's words."""
        if self.state == self.State.DEGRADED:
            return gettext("out of placement; its clusters move to other hosts as their jobs end")
        if self.state == self.State.DOWN:
            return gettext(
                "out of placement; its nodes are not charged and move to other hosts after "
                "%(seconds)s s down"
            ) % {"seconds": settings.SUANLI_HOST_DOWN_MOVE_S}
        return ""

    @property
    def memory_gb(self) -> float | None:
        return None if self.memory_bytes is None else round(self.memory_bytes / 2**30, 1)

    def clean(self) -> None:
        errors: dict[str, list[str]] = {}

        def add(field: str, message: str) -> None:
            errors.setdefault(field, []).append(message)

        try:
            kind = validators.validate_engine_url(self.engine_url)
        except ValidationError as exc:
            add("engine_url", exc.messages[0])
            kind = None
        if kind == "tcp":
            for field, label in (
                ("tls_ca", "CA certificate"),
                ("tls_cert", "client certificate"),
                ("tls_key", "client key"),
            ):
                if not getattr(self, field).strip():
                    add(field, f"A tcp:// engine needs TLS: paste the {label} (PEM).")
        elif kind == "unix" and any(
            getattr(self, f).strip() for f in ("tls_ca", "tls_cert", "tls_key")
        ):
            add(
                "engine_url",
                "TLS material is only used with tcp:// engines; clear it for a unix:// socket.",
            )
        if not errors.get("tls_ca") and self.tls_ca.strip():
            _collect(add, "tls_ca", validators.validate_pem_certificate, self.tls_ca)
        if not errors.get("tls_cert") and self.tls_cert.strip():
            _collect(add, "tls_cert", validators.validate_pem_certificate, self.tls_cert)
        if not errors.get("tls_key") and self.tls_key.strip():
            _collect(add, "tls_key", validators.validate_pem_private_key, self.tls_key)
        if kind == "tcp" and not errors.keys() & {"tls_cert", "tls_key"}:
            _collect(
                add, "tls_key", validators.validate_key_matches_cert, self.tls_key, self.tls_cert
            )

        if self.gpu_model_id is None:
            if self.gpu_count:
                add("gpu_count", "A CPU-only host has 0 GPUs: pick a GPU model, or set GPUs to 0.")
        elif not 1 <= (self.gpu_count or 0) <= MAX_GPUS_PER_HOST:
            add(
                "gpu_count",
                f"A GPU host has 1 to {MAX_GPUS_PER_HOST} GPUs (got {self.gpu_count}). "
                "Leave the GPU model empty for a CPU-only host.",
            )
        if self.rdma and self.gpu_model_id is None:
            add(
                "rdma",
                "RDMA is for multi-node GPU training: a CPU-only host cannot be RDMA capable.",
            )
        if errors:
            raise ValidationError(errors)


def _collect(add, field, check, *args) -> None:
    try:
        check(*args)
    except ValidationError as exc:
        add(field, exc.messages[0])


class HostJoin(models.Model):
    """A join token an operator made on *Hosts -> Add*, and the join (or leave) it started.

    The token is `<key>.<secret>`: `key` finds the row, the secret is kept only as its
    SHA-256 and compared in constant time (jobs/hosts/joins.py). It is used once, before
    `expires_at`. Using it gives the host a credential of its own (`host_digest`, the
    SHA-256 of a secret that only the host keeps, root-only) for the rest of the join, its
    reports and a later `join.sh leave`; a newer join of the same host revokes it.
    """

    class Kind(models.TextChoices):
        JOIN = "join", gettext_lazy("join")
        LEAVE = "leave", gettext_lazy("leave")

    key = models.CharField(max_length=16, unique=True)
    digest = models.CharField(max_length=64)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    # What the operator chose for the host when making the token.
    zone = models.SlugField(max_length=40)
    gpu_model = models.ForeignKey(
        GpuModel, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    gpu_count = models.PositiveSmallIntegerField(default=0)
    build_host = models.BooleanField(default=False)
    address = models.GenericIPAddressField(null=True, blank=True)
    # What happened with it.
    kind = models.CharField(max_length=5, choices=Kind.choices, default=Kind.JOIN)
    used_at = models.DateTimeField(null=True, blank=True)
    host_name = models.CharField(max_length=63, blank=True)
    host_address = models.GenericIPAddressField(null=True, blank=True)
    host_digest = models.CharField(max_length=64, blank=True)
    host = models.ForeignKey(
        Host, on_delete=models.SET_NULL, null=True, blank=True, related_name="joins"
    )
    step = models.CharField(max_length=20, blank=True)
    error = models.TextField(blank=True)
    updated_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = gettext_lazy("host join")
        verbose_name_plural = gettext_lazy("host joins")
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.host_name or self.key} ({self.kind})"


class GpuSlot(models.Model):
    """One GPU of one host. A slot is held by at most one node: `node` is that node. A node
    that ended (its `released_at` set) keeps its slots until the host's engine confirms
    nothing of it runs on those GPUs (jobs.nodes.workspaces.free_gpus): placement takes only
    slots whose `node` is empty, so no tenant gets a GPU the last one may still use."""

    # No index of its own: the unique (host, index) one serves it, and placement rewrites
    # slot rows in bulk (each index of the table is written again for every row).
    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="slots", db_index=False)
    index = models.PositiveSmallIntegerField()
    node = models.ForeignKey(
        "Node", on_delete=models.SET_NULL, null=True, blank=True, related_name="slots"
    )

    class Meta:
        verbose_name = gettext_lazy("gpu slot")
        verbose_name_plural = gettext_lazy("gpu slots")
        ordering = ["host", "index"]
        constraints = [
            models.UniqueConstraint(fields=["host", "index"], name="gpu_slot_unique_index")
        ]
        indexes = [models.Index(fields=["host", "node"], name="gpu_slot_free_idx")]

    def __str__(self) -> str:
        return f"{self.host.name}/gpu{self.index}"


class SshKey(models.Model):
    """A researcher's public key. The SSH gateway lets it log in to the clusters it is
    attached to (Cluster.ssh_keys, read at each login: attached or detached any time)."""

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="ssh_keys"
    )
    name = models.CharField(max_length=80)
    public_key = models.TextField()
    key_type = models.CharField(max_length=40)
    bits = models.PositiveIntegerField()
    fingerprint = models.CharField(max_length=80)
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    # Ticked for every new cluster its owner requests (the form pre-ticks it; the API
    # attaches the defaults when a request names no keys).
    is_default = models.BooleanField(default=False)

    class Meta:
        verbose_name = gettext_lazy("ssh key")
        verbose_name_plural = gettext_lazy("ssh keys")
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "fingerprint"], name="ssh_key_unique_per_owner"
            )
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.fingerprint})"


class Team(models.Model):
    """A lab's account (课题组): the clusters, images, storage, pools and balance it owns are
    owned by its `principal`, a user row that nobody logs in as (no usable password), so that
    every owner-keyed rule (uid, storage folder, ledger, placement) holds for a team as for
    one researcher. People act for it through their TeamMember row (jobs/tenancy)."""

    principal = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="team",
        verbose_name=gettext_lazy("account"),
    )  # fmt: skip
    name = models.CharField(gettext_lazy("name"), max_length=80)
    created_at = models.DateTimeField(gettext_lazy("created"), default=timezone.now)
    # The operator's: the team's weight in fair share between waiting requests (a team with
    # share 2 is owed twice the GPU-hours of one with share 1), and the most GPUs it may hold
    # at once (empty: no limit of its own).
    share = models.PositiveSmallIntegerField(
        gettext_lazy("fair share"), default=1,
        validators=[MinValueValidator(1), MaxValueValidator(1000)],
        help_text=gettext_lazy("Weight between teams when the fleet is full (1-1000)."),
    )  # fmt: skip
    gpu_limit = models.PositiveIntegerField(
        gettext_lazy("GPU limit"), null=True, blank=True,
        help_text=gettext_lazy("The most GPUs the team may hold at once; empty: no limit."),
    )  # fmt: skip

    class Meta:
        verbose_name = gettext_lazy("team")
        verbose_name_plural = gettext_lazy("teams")
        permissions = [("manage_teams", "Set teams' fair share and GPU limits")]

    def __str__(self) -> str:
        return self.name


class TeamMember(models.Model):
    """One person's place in a team: their role, and the owner's caps on what they spend."""

    class Role(models.TextChoices):
        # Ordered from the most to the least; RANK below compares them.
        OWNER = "owner", gettext_lazy("owner")
        ADMIN = "admin", gettext_lazy("admin")
        MEMBER = "member", gettext_lazy("member")
        VIEWER = "viewer", gettext_lazy("viewer")

    RANK = {Role.VIEWER: 0, Role.MEMBER: 1, Role.ADMIN: 2, Role.OWNER: 3}

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    person = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="team_memberships"
    )
    role = models.CharField(gettext_lazy("role"), max_length=10, choices=Role.choices)
    # Set by the owner; empty: no cap of the person's own (the team's balance still bounds it).
    monthly_cap = models.DecimalField(
        gettext_lazy("monthly budget"), max_digits=14, decimal_places=2, null=True, blank=True,
        validators=[MinValueValidator(0)],
    )  # fmt: skip
    gpu_cap = models.PositiveIntegerField(gettext_lazy("GPU cap"), null=True, blank=True)
    joined_at = models.DateTimeField(default=timezone.now)
    # When the person's clusters were stopped for reaching their monthly cap (cleared when
    # the cap is raised or a new month starts), so that it is done and told once.
    capped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = gettext_lazy("team member")
        verbose_name_plural = gettext_lazy("team members")
        constraints = [
            models.UniqueConstraint(fields=["team", "person"], name="team_member_once"),
            models.UniqueConstraint(
                fields=["team"], condition=models.Q(role="owner"), name="team_one_owner"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.person} in {self.team} ({self.role})"

    def at_least(self, role: str) -> bool:
        return self.RANK[self.role] >= self.RANK[role]


class TeamInvite(models.Model):
    """An invitation: by link (anyone holding the token) or to one login (`login` set: only
    that person may accept). Only the token's SHA-256 is stored; it is shown once."""

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="invites")
    role = models.CharField(max_length=10, choices=TeamMember.Role.choices)
    login = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, null=True, blank=True,
        related_name="team_invites",
    )  # fmt: skip
    digest = models.CharField(max_length=64, unique=True, null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
        related_name="+",
    )  # fmt: skip
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = gettext_lazy("team invitation")
        verbose_name_plural = gettext_lazy("team invitations")

    def __str__(self) -> str:
        return f"{self.team}: {self.role} ({self.login or 'by link'})"

    @property
    def open(self) -> bool:
        return (
            self.accepted_at is None and self.revoked_at is None
            and self.expires_at > timezone.now()
        )  # fmt: skip


class Cluster(models.Model):
    """What a researcher rents: `nodes x gpus_per_node` of one GPU model (or CPU-only
    nodes of one instance type), gang-placed on the hosts."""

    class State(models.TextChoices):
        PENDING = "pending", gettext_lazy("pending")
        RUNNING = "running", gettext_lazy("running")
        RELEASING = "releasing", gettext_lazy("releasing")
        RELEASED = "released", gettext_lazy("released")
        FAILED = "failed", gettext_lazy("failed")
        # A spot cluster whose capacity is being taken back: its replicas have the notice
        # and run their preemption script; it holds its GPUs until they are gone but is not
        # charged from the notice on. Then it goes back to pending on its own.
        PREEMPTING = "preempting", gettext_lazy("preempting")
        # Stopped by its owner (关机): no GPUs held, no job runs, not charged for GPUs; its
        # workspaces are stopped but kept on their hosts (their files stay) until it is
        # started again on those hosts, or released (by hand, or after
        # SUANLI_STOPPED_RELEASE_DAYS).
        STOPPED = "stopped", gettext_lazy("stopped")

    class Network(models.TextChoices):
        STANDARD = "standard", gettext_lazy("standard")
        RDMA = "rdma", gettext_lazy("high-performance (RDMA)")

    class ReleasePolicy(models.TextChoices):
        AFTER_LAST_JOB = "after_last_job", gettext_lazy("when the last job ends")
        IDLE = "idle", gettext_lazy("after N idle minutes")
        NEVER = "never", gettext_lazy("never (release by hand)")

    HOLDS_CAPACITY = (State.RUNNING, State.RELEASING)

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="clusters"
    )
    # The person who made it (the owner, or a member acting for the owner's team); its
    # spending counts against their cap. `members`: the team's people added to it (who see
    # and log in to it as a team member; admins and the owner see every team cluster).
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
        related_name="+",
    )  # fmt: skip
    members = models.ManyToManyField(
        settings.AUTH_USER_MODEL, blank=True, related_name="team_clusters"
    )
    name = models.CharField(max_length=63)
    gpu_model = models.ForeignKey(
        GpuModel, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    instance_type = models.ForeignKey(
        InstanceType, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    nodes = models.PositiveSmallIntegerField()
    gpus_per_node = models.PositiveSmallIntegerField(default=0)
    image = models.ForeignKey(
        Image, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    image_reference = models.CharField(max_length=255)
    network = models.CharField(max_length=10, choices=Network.choices, default=Network.STANDARD)
    zone = models.CharField(max_length=40, blank=True, help_text="Empty: any zone.")
    spot = models.BooleanField(default=False)
    # Asked for on the form: SUANLI_STORAGE_ROOT/pub read-only at /pub in every container of
    # its nodes (jobs/files/pub.py). False on clusters made before it existed.
    pub = models.BooleanField(gettext_lazy("public datasets at /pub"), default=False)
    ssh_keys = models.ManyToManyField(SshKey, blank=True, related_name="clusters")
    workspace = models.BooleanField(
        default=True,
        help_text="Keep a workspace container on each node from placement to release, to "
        "log in to (ssh, scp/sftp, the web terminal). Off: jobs only (pure batch).",
    )
    release_policy = models.CharField(
        max_length=20, choices=ReleasePolicy.choices, default=ReleasePolicy.NEVER
    )
    idle_minutes = models.PositiveIntegerField(null=True, blank=True)
    # Scheduled and idle shutdown (定时关机, jobs/clusters/shutdown.py): stopped (files kept) at
    # `stop_at`, once (cleared when applied or when found stale), and/or after
    # `stop_idle_minutes` with every GPU under `stop_idle_below` percent (both or neither).
    stop_at = models.DateTimeField(null=True, blank=True)
    stop_idle_minutes = models.PositiveSmallIntegerField(null=True, blank=True)
    stop_idle_below = models.PositiveSmallIntegerField(null=True, blank=True)
    no_gpu = models.BooleanField(
        "no-GPU mode",
        default=False,
        help_text="Running without GPUs (started so from stopped): its workspaces only, a "
        "small CPU and memory share, billed per node-hour at the no-GPU price; no jobs.",
    )

    state = models.CharField(max_length=10, choices=State.choices, default=State.PENDING)
    state_reason = models.CharField(max_length=300, blank=True)
    # The reason as a jobs.base.text.Text (msgid and arguments), shown in the reader's language;
    # `state_reason` keeps the English (API, webhooks). None for plain words, older rows.
    state_reason_text = models.JSONField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now)
    queued_at = models.DateTimeField(default=timezone.now, help_text="Place in the queue (FIFO).")
    running_since = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)
    last_active_at = models.DateTimeField(default=timezone.now, help_text="For the idle policy.")
    stopped_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When it was stopped (its workspaces kept); cleared when it runs again. A "
        "pending cluster with this set waits for the hosts that keep its workspaces.",
    )
    # "Stop at ¥X" (billing/budgets.py): stopped (files kept) when its charges reach it.
    budget = models.DecimalField(
        null=True,
        blank=True,
        help_text="Stop at this much spent (its own charges), with the normal stop's grace; none: no budget.",
        **MONEY,
    )
    budget_stopped_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When its budget stopped it (told once; cleared by a new budget).",
    )
    release_warned_at = models.DateTimeField(
        null=True, blank=True, help_text="When the release-soon warning of this stop went out."
    )
    own_image = models.ForeignKey(
        "OwnImage", on_delete=models.SET_NULL, null=True, blank=True, related_name="clusters"
    )
    # Pulls of its image onto its hosts (jobs/images/builds.py): {host name: {"state": pulling |
    # pulled | failed, "done": bytes, "total": bytes, "message": words}}.
    image_pulls = models.JSONField(default=dict, blank=True)
    # One of a pool's clusters (jobs/pools/autoscaler.py): added and released by the pool, not by hand.
    pool = models.ForeignKey(
        "Pool", on_delete=models.PROTECT, null=True, blank=True, related_name="clusters"
    )

    class Meta:
        verbose_name = gettext_lazy("cluster")
        verbose_name_plural = gettext_lazy("clusters")
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["state", "queued_at"], name="cluster_queue_idx"),
            # The clusters page: a researcher's live clusters, then their history a page at a
            # time, newest first. Ended = released or failed (no name for it inside Meta).
            models.Index(
                fields=["owner", "-created_at"],
                condition=~models.Q(state__in=["released", "failed"]),
                name="cluster_owner_live_idx",
            ),
            models.Index(
                fields=["owner", "-created_at", "-id"],
                condition=models.Q(state__in=["released", "failed"]),
                name="cluster_owner_history_idx",
            ),
            # Every cluster of a researcher, newest first: the billing page's cluster filter.
            models.Index(fields=["owner", "-created_at", "-id"], name="cluster_owner_recent_idx"),
            # The accrual tick's budget look (billing/budgets.py): the few with one to judge.
            models.Index(
                fields=["id"],
                condition=models.Q(budget__isnull=False, budget_stopped_at__isnull=True),
                name="cluster_budget_idx",
            ),
        ]
        permissions = [
            ("preempt_cluster", "Can preempt researchers' spot clusters"),
            ("release_cluster", "Can release researchers' clusters"),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def is_cpu_only(self) -> bool:
        return self.instance_type_id is not None

    @property
    def root_disk_gb(self) -> int:
        """Each node's system disk: its GPU model's or instance type's, else the default."""
        return root_disk_gb(self.instance_type if self.is_cpu_only else self.gpu_model)

    @property
    def resource_label(self) -> str:
        return str(self.instance_type.name) if self.is_cpu_only else str(self.gpu_model)

    @property
    def shape(self) -> str:
        if self.is_cpu_only:
            return f"{self.nodes} x {self.instance_type.name}"
        return f"{self.nodes} x {self.gpus_per_node} {self.gpu_model}"

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def is_active(self) -> bool:
        return self.state in (self.State.PENDING, self.State.RUNNING, self.State.PREEMPTING)

    @staticmethod
    def kept_stopped() -> timedelta:
        """How long a stopped cluster keeps its workspaces before it is released
        (SUANLI_STOPPED_RELEASE_S): the one place that reads the setting."""
        return timedelta(seconds=settings.SUANLI_STOPPED_RELEASE_S)

    @property
    def release_at(self) -> datetime | None:
        """When this stopped cluster (or one waiting in line to start again) is released
        with its workspaces unless started; None when it is not stopped."""
        return None if self.stopped_at is None else self.stopped_at + self.kept_stopped()


class TimelineEvent(models.Model):
    """One line of a timeline: when, what kind, and why in words."""

    at = models.DateTimeField(default=timezone.now)
    kind = models.CharField(max_length=20)
    # The message as a jobs.base.text.Text (msgid and arguments), shown in the reader's language;
    # `message` keeps the English for the API and webhooks. Empty on older events.
    text = models.JSONField(null=True, blank=True, editable=False)

    class Meta:
        abstract = True
        ordering = ["at", "id"]

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


class ClusterEvent(TimelineEvent):
    """The cluster's timeline: each state it entered, resizes, and why."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="events")
    message = models.CharField(max_length=300, blank=True)

    class Meta(TimelineEvent.Meta):
        verbose_name = gettext_lazy("cluster event")
        verbose_name_plural = gettext_lazy("cluster events")


class Node(models.Model):
    """One member of a cluster, on one host. A node released by a resize or a release keeps
    its row (with `released_at`) so the timeline can say where it ran."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="node_set")
    index = models.PositiveSmallIntegerField()
    host = models.ForeignKey(Host, on_delete=models.PROTECT, related_name="nodes")
    gpu_indices = models.JSONField(default=list, help_text="Indices of the host's GPUs it holds.")
    vcpus = models.PositiveSmallIntegerField(default=0, help_text="CPU-only nodes: reserved vCPUs.")
    placed_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When it first ran: its workspace started (in a cluster without "
        "workspaces, its first job replica). Billing starts here; a node that never ran is "
        "never charged.",
    )
    preempted_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When a preemption notice went out: billing stops here, although the node "
        "holds its GPUs until its containers are gone (then released_at).",
    )
    lost_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When its host was seen down: billing stops here; the node is placed again "
        "(a new row) when the host is back or the node moves to another host.",
    )
    released_at = models.DateTimeField(null=True, blank=True)
    workspace_container = models.CharField(
        max_length=80, blank=True, help_text="The engine's id of the node's workspace container."
    )
    no_gpu = models.BooleanField(
        "no-GPU mode", default=False, help_text="Holds no GPUs: billed per node-hour at the "
        "rate card's no-GPU price.",
    )  # fmt: skip
    stopped_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="It ended with a stop of its cluster (= released_at): its workspace is kept "
        "on its host, stopped, until `kept_until`.",
    )
    kept_until = models.DateTimeField(
        null=True,
        blank=True,
        help_text="When its stopped workspace stopped being kept (the cluster started again "
        "or was released). Empty while kept.",
    )
    saved_image = models.CharField(
        max_length=400,
        blank=True,
        help_text="Its workspace's root filesystem in the registry (reference@digest): on a "
        "kept node, pushed after the stop (empty until then), so the cluster can start on "
        "another host; on a node started elsewhere, the save its workspace is made from.",
    )
    saved_layers = models.JSONField(
        default=list,
        blank=True,
        help_text="[[layer, bytes], ...] of its save that its cluster's image does not have, "
        "at their size on a host's disk: what the save counts against its owner's image quota.",
    )

    class Meta:
        verbose_name = gettext_lazy("node")
        verbose_name_plural = gettext_lazy("nodes")
        ordering = ["cluster", "index"]
        constraints = [
            models.UniqueConstraint(
                fields=["cluster", "index"],
                condition=models.Q(released_at__isnull=True),
                name="node_unique_live_index",
            )
        ]
        # Fair share reads the nodes live or ended in its window every pass (placement's
        # fairshare.recent_usage): not the whole history.
        indexes = [models.Index(fields=["released_at"], name="node_released_idx")]

    def __str__(self) -> str:
        return f"{self.cluster.name}/node{self.index}"


class PublicDataset(models.Model):
    """A dataset or model an operator publishes (jobs/files/pub.py): one folder of the fleet's
    filesystem, read-only at /pub/<name> in the containers of every cluster that asks for
    /pub. Its files are under SUANLI_STORAGE_ROOT/pub/<name> while published, under
    SUANLI_STORAGE_ROOT/pub-drafts/<name> (never mounted) while not."""

    class Kind(models.TextChoices):
        DATASET = "dataset", gettext_lazy("dataset")
        MODEL = "model", gettext_lazy("model")

    name = models.CharField(
        gettext_lazy("name"),
        max_length=64,
        unique=True,
        validators=[validators.validate_dataset_name],
        help_text=gettext_lazy("Its folder: /pub/<name> in the containers, e.g. imagenet-1k."),
    )
    kind = models.CharField(
        gettext_lazy("kind"), max_length=10, choices=Kind.choices, default=Kind.DATASET
    )
    description = models.TextField(gettext_lazy("description"), max_length=2000, blank=True)
    # Measured by the console when it is published (or on the operator's request), not
    # on every page view: a walk of a large dataset takes minutes.
    size_bytes = models.BigIntegerField(gettext_lazy("size"), null=True, blank=True)
    file_count = models.BigIntegerField(gettext_lazy("files"), null=True, blank=True)
    published = models.BooleanField(gettext_lazy("published"), default=False)
    published_at = models.DateTimeField(gettext_lazy("published at"), null=True, blank=True)
    created_at = models.DateTimeField(
        gettext_lazy("created at"), default=timezone.now, editable=False
    )

    class Meta:
        verbose_name = gettext_lazy("public dataset or model")
        verbose_name_plural = gettext_lazy("public datasets and models")
        ordering = ["name"]
        permissions = [
            ("publish_publicdataset", "Can publish and unpublish public datasets and models"),
        ]

    def __str__(self) -> str:
        return self.name


class Volume(models.Model):
    """A sub-path of the owner's storage root, mounted at an absolute container path."""

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="volumes")
    source = models.CharField(max_length=255, help_text="Relative to the owner's storage root.")
    target = models.CharField(max_length=255)
    read_only = models.BooleanField(default=False)

    class Meta:
        ordering = ["target"]

    def __str__(self) -> str:
        return f"{self.source}:{self.target}{':ro' if self.read_only else ''}"


class WorkspaceApp(models.Model):
    """A web app running in a node's workspace that the console proxies to its owner:
    JupyterLab, TensorBoard, or a port of the researcher's own service. One of each kind per
    node; gone when the workspace stops (rows are removed by a stop or a release)."""

    class Kind(models.TextChoices):
        JUPYTER = "jupyter", gettext_lazy("JupyterLab")
        TENSORBOARD = "tensorboard", gettext_lazy("TensorBoard")
        SERVICE = "service", gettext_lazy("service port")

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="apps")
    node_index = models.PositiveSmallIntegerField()
    kind = models.CharField(max_length=12, choices=Kind.choices)
    port = models.PositiveIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(65535)],
        help_text="The port it listens on inside the workspace.",
    )
    token = EncryptedTextField(blank=True, help_text="Its own token (JupyterLab).")
    logdir = models.CharField(max_length=255, blank=True, help_text="TensorBoard's --logdir.")
    started_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["cluster", "node_index", "kind"]
        constraints = [
            models.UniqueConstraint(
                fields=["cluster", "node_index", "kind"], name="workspace_app_one_per_kind"
            )
        ]

    def __str__(self) -> str:
        return f"{self.cluster_id}/node{self.node_index} {self.kind}:{self.port}"


class Job(models.Model):
    """A training run on a cluster. A cluster runs its jobs one at a time, FIFO."""

    class State(models.TextChoices):
        QUEUED = "queued", gettext_lazy("queued")
        STARTING = "starting", gettext_lazy("starting")
        RUNNING = "running", gettext_lazy("running")
        SUCCEEDED = "succeeded", gettext_lazy("succeeded")
        FAILED = "failed", gettext_lazy("failed")
        CANCELLED = "cancelled", gettext_lazy("cancelled")
        # Taken off its spot cluster by a preemption; starts again (resuming from its newest
        # checkpoint) when the cluster is placed again. Not an end.
        PREEMPTED = "preempted", gettext_lazy("preempted")

    class Launcher(models.TextChoices):
        PLAIN = "plain", gettext_lazy("plain (the command runs once per node)")
        TORCHRUN = "torchrun", gettext_lazy("torchrun (one process per GPU)")

    ACTIVE = (State.STARTING, State.RUNNING)
    WAITING = (State.QUEUED, State.PREEMPTED)  # what dispatch starts, oldest first
    ENDED = (State.SUCCEEDED, State.FAILED, State.CANCELLED)

    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="jobs")
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="jobs"
    )
    name = models.CharField(max_length=100)
    command = models.TextField()
    launcher = models.CharField(max_length=10, choices=Launcher.choices, default=Launcher.PLAIN)
    env = models.JSONField(default=dict, blank=True)
    workdir = models.CharField(max_length=255, default="/workspace")
    checkpoint_dir = models.CharField(max_length=255, default="/workspace/checkpoints")
    max_runtime_s = models.PositiveIntegerField(null=True, blank=True)
    retries = models.PositiveSmallIntegerField(default=0)
    attempt = models.PositiveSmallIntegerField(
        default=0, help_text="Starts so far (retries and restarts after preemptions add one)."
    )
    preemption_script = models.TextField(
        blank=True,
        help_text="Run in each replica (/bin/sh -c) when a preemption notice arrives, "
        "e.g. to save a checkpoint.",
    )
    host_restarts = models.PositiveSmallIntegerField(
        default=0, help_text="Attempts ended by a host's failure: they do not count as retries."
    )
    max_preemptions = models.PositiveSmallIntegerField(
        default=5, help_text="Preemptions it survives; one more fails it. Apart from retries."
    )
    preemptions = models.PositiveSmallIntegerField(default=0)
    preempt_requested_at = models.DateTimeField(
        null=True, blank=True, help_text="When this attempt's replicas got a preemption notice."
    )
    resume_from = models.CharField(
        max_length=1024,
        blank=True,
        help_text="SUANLI_RESUME_FROM of the current attempt: its newest checkpoint at start.",
    )

    state = models.CharField(max_length=10, choices=State.choices, default=State.QUEUED)
    state_reason = models.CharField(max_length=500, blank=True)
    # The reason as a jobs.base.text.Text (msgid and arguments), shown in the reader's language;
    # `state_reason` keeps the English (API, webhooks). None for plain words, older rows.
    state_reason_text = models.JSONField(null=True, blank=True, editable=False)
    exit_code = models.IntegerField(null=True, blank=True)
    cancel_requested = models.BooleanField(default=False)
    stop_requested_at = models.DateTimeField(
        null=True, blank=True, help_text="When its replicas got SIGTERM (for the SIGKILL net)."
    )
    master_port = models.PositiveIntegerField(
        null=True, blank=True, help_text="Chosen per attempt, unique among active jobs."
    )
    created_at = models.DateTimeField(default=timezone.now)
    queued_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    running_since = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Submitted to a pool: it runs on whichever of the pool's clusters is free first
    # (jobs.runs.dispatch moves it there while it waits).
    pool = models.ForeignKey(
        "Pool", on_delete=models.PROTECT, null=True, blank=True, related_name="jobs"
    )
    # "Stop at ¥X" (billing/budgets.py): stopped (its grace, its preemption script) when
    # its cost so far, with the stop's grace to come, reaches it.
    budget = models.DecimalField(
        null=True,
        blank=True,
        help_text="Stop at this much spent (its own charges), with the normal stop's grace; none: no budget.",
        **MONEY,
    )
    budget_stopped_at = models.DateTimeField(null=True, blank=True)
    budget_warned_at = models.DateTimeField(
        null=True, blank=True, help_text="When its projection first said the budget stops it."
    )
    # Progress (jobs/runs/progress.py): the total it declared (a line's total_steps, or
    # SUANLI_TOTAL_STEPS); what was wrong with a total, in words. Its points are in a row of
    # their own (JobProgress: read only where one job's pace is worked out).
    total_steps = models.BigIntegerField(null=True, blank=True, editable=False)
    progress_note = models.CharField(max_length=500, blank=True, editable=False)
    progress_note_text = models.JSONField(null=True, blank=True, editable=False)
    # The projection made once a fifth of its steps were done (kept to compare with the end),
    # and the newest one (for lists, the API and the budget's early warning).
    projection_early = models.JSONField(null=True, blank=True, editable=False)
    projection_last = models.JSONField(null=True, blank=True, editable=False)
    # Its GPUs' energy in joules from the power samples (monitoring/energy.py), written at
    # its end; None: no power reading (emulated hosts) or not ended.
    energy_j = models.FloatField(null=True, blank=True, editable=False)

    class Meta:
        verbose_name = gettext_lazy("job")
        verbose_name_plural = gettext_lazy("jobs")
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["cluster", "state", "queued_at"], name="job_cluster_queue_idx"),
            # The admin's job list, newest first, all of them or one owner's.
            models.Index(fields=["-created_at", "-id"], name="job_recent_idx"),
            models.Index(fields=["owner", "-created_at", "-id"], name="job_owner_recent_idx"),
            # The accrual tick's budget look (billing/budgets.py): the few with one to judge.
            models.Index(
                fields=["id"],
                condition=models.Q(budget__isnull=False, budget_stopped_at__isnull=True),
                name="job_budget_idx",
            ),
            # A researcher's projections against their ends, newest first (the billing page's
            # "how good the projections were": billing/projections.py accuracy_of).
            models.Index(
                fields=["owner", "-finished_at", "-id"],
                condition=models.Q(state="succeeded", projection_early__isnull=False),
                name="job_compared_idx",
            ),
        ]
        # Operators' powers over other researchers' work (the owner holds them over their
        # own): checked by jobs.placement.fleet.job_for_user on pages, API and websockets alike.
        permissions = [
            ("view_job_logs", "Can read other researchers' job pages, logs and charts"),
            ("cancel_job", "Can cancel other researchers' jobs"),
            ("manage_queues", "Can see and change the task queues (django-rq's pages)"),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def is_ended(self) -> bool:
        return self.state in self.ENDED


class JobProgress(models.Model):
    """A job's progress points (jobs/runs/progress.py), out of the Job row: up to
    POINTS_MAX of them, read only where one job's pace is worked out (never by a list)."""

    job = models.OneToOneField(
        Job, on_delete=models.CASCADE, primary_key=True, related_name="progress_row"
    )
    # The steps its rank 0 reported on SUANLI_METRIC lines, [[unix seconds, step], ...] in
    # order (thinned past a cap), of its attempt `attempt` (a retry from step 0 starts them
    # again); the last log line read.
    points = models.JSONField(default=list, blank=True)
    seq = models.BigIntegerField(default=0)
    attempt = models.PositiveSmallIntegerField(default=1)

    class Meta:
        verbose_name = gettext_lazy("job progress")
        verbose_name_plural = gettext_lazy("job progress")

    def __str__(self) -> str:
        return f"progress of job {self.job_id}"


class JobEvent(TimelineEvent):
    """The job's timeline: states, image pulls, retries, who cancelled."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    message = models.CharField(max_length=500, blank=True)

    class Meta(TimelineEvent.Meta):
        verbose_name = gettext_lazy("job event")
        verbose_name_plural = gettext_lazy("job events")


class Replica(models.Model):
    """One container of one attempt of a job, on one node (rank = node index)."""

    class State(models.TextChoices):
        CREATING = "creating", gettext_lazy("creating")
        RUNNING = "running", gettext_lazy("running")
        EXITED = "exited", gettext_lazy("exited")
        LOST = "lost", gettext_lazy("lost")

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="replicas")
    attempt = models.PositiveSmallIntegerField(default=1)
    rank = models.PositiveSmallIntegerField()
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="replicas")
    host = models.ForeignKey(Host, on_delete=models.PROTECT, related_name="replicas")
    container_name = models.CharField(max_length=128, unique=True)
    container_id = models.CharField(max_length=80, blank=True)
    preempt_exec_id = models.CharField(
        max_length=80, blank=True, help_text="The engine's exec of the preemption script."
    )
    state = models.CharField(max_length=10, choices=State.choices, default=State.CREATING)
    exit_code = models.IntegerField(null=True, blank=True)
    host_fault = models.BooleanField(
        default=False,
        help_text="Ended by its host (the engine died, restarted or could not start it), "
        "not by the job: the attempt runs again without using a retry.",
    )
    log = models.TextField(
        blank=True, help_text="Stored when the container ends (tail, timestamped)."
    )
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "attempt", "rank"]
        constraints = [
            models.UniqueConstraint(fields=["job", "attempt", "rank"], name="replica_unique_rank")
        ]

    def __str__(self) -> str:
        return self.container_name


# -- work queued after a commit (jobs/events/outbox.py) ------------------------------------


class OutboxTask(models.Model):
    """An RQ task to queue once the transaction that wrote this row commits: sent then and
    deleted; one that Redis did not take (it was away, the process was killed before the
    send) is sent by the next flush (cron, every few seconds), so follow-up work never waits
    for the reconciler's safety net."""

    queue = models.CharField(max_length=32)
    func = models.CharField(max_length=200)
    args = models.JSONField(default=list)
    job_id = models.CharField(max_length=200)
    again_if_running = models.BooleanField(default=False)
    options = models.JSONField(default=dict)
    created_at = models.DateTimeField(default=timezone.now)

    def __str__(self) -> str:
        return f"{self.func} {self.job_id}"


# -- webhooks: the outbox (written in the transaction of the change it reports) -----------


class WebhookEndpoint(models.Model):
    """One notification channel of a researcher: a webhook (events POSTed, signed per Standard
    Webhooks), an e-mail address, or a chat robot (WeCom, DingTalk, Feishu, Slack, Discord).
    `url` is the address for an e-mail channel; `secret` the robot's signing secret (blank:
    unsigned). An e-mail address other than the account's own gets nothing but its confirmation
    until `confirmed_at` is set (jobs/events/webhooks.py)."""

    class Kind(models.TextChoices):
        WEBHOOK = "webhook", gettext_lazy("Webhook (signed JSON)")
        EMAIL = "email", gettext_lazy("E-mail")
        WECOM = "wecom", gettext_lazy("WeCom group robot")
        DINGTALK = "dingtalk", gettext_lazy("DingTalk group robot")
        FEISHU = "feishu", gettext_lazy("Feishu group robot")
        SLACK = "slack", gettext_lazy("Slack incoming webhook")
        DISCORD = "discord", gettext_lazy("Discord webhook")

    EVENTS = [
        ("job.queued", gettext_lazy("job queued")),
        ("job.started", gettext_lazy("job started")),
        ("job.succeeded", gettext_lazy("job succeeded")),
        ("job.failed", gettext_lazy("job failed")),
        ("job.cancelled", gettext_lazy("job cancelled")),
        ("job.preempted", gettext_lazy("job preempted")),
        ("job.budget_warning", gettext_lazy("job will reach its budget at its pace")),
        ("job.budget_stopped", gettext_lazy("job stopped at its budget")),
        ("cluster.running", gettext_lazy("cluster running")),
        ("cluster.stopped", gettext_lazy("cluster stopped")),
        ("cluster.release_soon", gettext_lazy("stopped cluster released in a day")),
        ("cluster.released", gettext_lazy("cluster released")),
        ("cluster.budget_stopped", gettext_lazy("cluster stopped at its budget")),
        ("balance.low", gettext_lazy("balance low")),
        ("balance.critical", gettext_lazy("balance lasts under 30 minutes")),
        ("balance.exhausted", gettext_lazy("balance ran out: clusters stopped")),
        ("team.member_capped", gettext_lazy("a team member reached their monthly budget")),
        ("sweep.finished", gettext_lazy("sweep finished")),
        ("sweep.budget_stopped", gettext_lazy("sweep cancelled at its budget")),
        ("build.finished", gettext_lazy("image build finished")),
        ("host.problem", gettext_lazy("a host problem affects your cluster")),
        ("gpu.available", gettext_lazy("GPUs you asked for are free")),
    ]

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="webhook_endpoints"
    )
    kind = models.CharField(max_length=10, choices=Kind.choices, default=Kind.WEBHOOK)
    url = models.CharField(max_length=2000)
    events = models.JSONField(default=list)
    enabled = models.BooleanField(default=True)
    # Stored encrypted (jobs/base/crypto.py); the signer reads them in plain.
    secret = EncryptedTextField(help_text="whsec_...; shown to its owner once.")
    confirmed_at = models.DateTimeField(null=True, blank=True)
    confirm_token = EncryptedTextField(blank=True)
    previous_secret = EncryptedTextField(blank=True)
    previous_valid_until = models.DateTimeField(null=True, blank=True)
    failing_since = models.DateTimeField(null=True, blank=True)
    last_success_at = models.DateTimeField(null=True, blank=True)
    disabled_reason = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.url


class WebhookEvent(models.Model):
    """One event for one researcher; `uid` is the `webhook-id` of every delivery and retry."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    uid = models.CharField(max_length=40, unique=True)
    type = models.CharField(max_length=40)
    body = models.TextField(help_text="The exact JSON body sent (the same on every attempt).")
    # What happened, in words: a jobs.base.text.Text's as_json(), shown in the reader's
    # language by the channels that speak to people (e-mail, chat robots, the delivery log).
    summary = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.type} {self.uid}"


class WebhookDelivery(models.Model):
    class State(models.TextChoices):
        PENDING = "pending", gettext_lazy("pending")
        SUCCEEDED = "succeeded", gettext_lazy("delivered")
        DEAD = "dead", gettext_lazy("gave up")

    event = models.ForeignKey(WebhookEvent, on_delete=models.CASCADE, related_name="deliveries")
    endpoint = models.ForeignKey(
        WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries"
    )
    state = models.CharField(max_length=10, choices=State.choices, default=State.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField(default=timezone.now)
    last_status = models.PositiveSmallIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(
                fields=["next_attempt_at"],
                condition=models.Q(state="pending"),
                name="delivery_due_idx",
            )
        ]

    def __str__(self) -> str:
        return f"{self.event} -> {self.endpoint_id} ({self.state})"


class WebhookAttempt(models.Model):
    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="tries")
    at = models.DateTimeField(default=timezone.now)
    status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    latency_ms = models.PositiveIntegerField(default=0)
    response_excerpt = models.CharField(max_length=1000, blank=True)
    error = models.CharField(max_length=300, blank=True)

    class Meta:
        ordering = ["-at", "-id"]

    def __str__(self) -> str:
        return f"{self.delivery_id} at {self.at}: {self.status_code or self.error}"


class OwnImage(models.Model):
    """A researcher's own image in the registry (SUANLI_REGISTRY), at
    `<registry>/u<owner id>/<name>:<tag>`: built from a Dockerfile or saved from a workspace.
    Usable by its owner only (jobs/base/validators.py refuses the registry's other names)."""

    class Source(models.TextChoices):
        BUILD = "build", gettext_lazy("built from a Dockerfile")
        SAVE = "save", gettext_lazy("saved from a workspace")

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="own_images"
    )
    name = models.CharField(max_length=64, validators=[validators.validate_own_image_name])
    tag = models.CharField(max_length=64, validators=[validators.validate_own_image_tag])
    reference = models.CharField(max_length=255, unique=True)
    digest = models.CharField(max_length=80, help_text="The manifest's digest in the registry.")
    size_bytes = models.BigIntegerField(
        default=0,
        help_text="Its layers uncompressed, as on a host's disk (what counts against the quota).",
    )
    # [[digest, bytes], ...]: the quota counts each distinct layer of a researcher once.
    layers = models.JSONField(default=list, blank=True)
    source = models.CharField(max_length=8, choices=Source.choices, default=Source.BUILD)
    source_note = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        verbose_name = gettext_lazy("own image")
        verbose_name_plural = gettext_lazy("own images")
        ordering = ["name", "tag"]
        constraints = [
            models.UniqueConstraint(fields=["owner", "name", "tag"], name="own_image_unique")
        ]

    def __str__(self) -> str:
        return f"{self.name}:{self.tag}"


class ImageBuild(models.Model):
    """One build of an own image (a Dockerfile, or a workspace saved), on a build host,
    from the queue "builds". Its log is streamed live (jobs/images/builds.py) and its end kept."""

    class Kind(models.TextChoices):
        BUILD = "build", gettext_lazy("build")
        SAVE = "save", gettext_lazy("save of a workspace")

    class State(models.TextChoices):
        QUEUED = "queued", gettext_lazy("queued")
        RUNNING = "running", gettext_lazy("running")
        PUSHING = "pushing", gettext_lazy("pushing")
        SUCCEEDED = "succeeded", gettext_lazy("succeeded")
        FAILED = "failed", gettext_lazy("failed")

    ACTIVE = (State.QUEUED, State.RUNNING, State.PUSHING)

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="image_builds"
    )
    kind = models.CharField(max_length=8, choices=Kind.choices, default=Kind.BUILD)
    name = models.CharField(max_length=64, validators=[validators.validate_own_image_name])
    tag = models.CharField(max_length=64, validators=[validators.validate_own_image_tag])
    dockerfile = models.TextField(blank=True)
    context = models.CharField(
        max_length=255, blank=True, help_text="A folder of the researcher's storage, or empty."
    )
    build_args = models.JSONField(default=dict, blank=True)
    cluster = models.ForeignKey(
        Cluster, on_delete=models.SET_NULL, null=True, blank=True, related_name="image_saves"
    )
    node_index = models.PositiveSmallIntegerField(null=True, blank=True)
    host = models.ForeignKey(
        Host, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    state = models.CharField(max_length=10, choices=State.choices, default=State.QUEUED)
    step = models.CharField(max_length=300, blank=True, help_text="The step being run.")
    done_bytes = models.BigIntegerField(default=0)  # pushed (or committed) so far
    total_bytes = models.BigIntegerField(default=0)
    log = models.TextField(blank=True, help_text="Its end, once finished (SUANLI_BUILD_LOG_BYTES).")
    error = models.TextField(blank=True)
    image = models.ForeignKey(
        OwnImage, on_delete=models.SET_NULL, null=True, blank=True, related_name="builds"
    )
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = gettext_lazy("image build")
        verbose_name_plural = gettext_lazy("image builds")
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["owner", "-created_at"], name="build_owner_idx")]

    def __str__(self) -> str:
        return f"build {self.pk} of {self.name}:{self.tag}"

    @property
    def is_active(self) -> bool:
        return self.state in self.ACTIVE


class Pool(models.Model):
    """A queue and a set of identical clusters that the console adds while jobs wait (up to
    `max_clusters`, within the budget) and releases when idle (down to `min_clusters`)."""

    class State(models.TextChoices):
        ACTIVE = "active", gettext_lazy("active")
        CLOSED = "closed", gettext_lazy("closed")

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="pools"
    )
    # The person who made it; its clusters are theirs (created_by) for caps and spending.
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
        related_name="+",
    )  # fmt: skip
    name = models.CharField(max_length=63)
    # The shape of every cluster, as on the cluster form.
    gpu_model = models.ForeignKey(
        GpuModel, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    instance_type = models.ForeignKey(
        InstanceType, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    nodes = models.PositiveSmallIntegerField(default=1)
    gpus_per_node = models.PositiveSmallIntegerField(default=0)
    image = models.ForeignKey(
        Image, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    own_image = models.ForeignKey(
        "OwnImage", on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    image_reference = models.CharField(max_length=255)
    network = models.CharField(
        max_length=10, choices=Cluster.Network.choices, default=Cluster.Network.STANDARD
    )
    zone = models.CharField(max_length=40, blank=True)
    spot = models.BooleanField(default=False)
    volumes = models.JSONField(default=list, blank=True)  # [{source, target, read_only}]
    pub = models.BooleanField(gettext_lazy("public datasets at /pub"), default=False)
    min_clusters = models.PositiveSmallIntegerField(default=0)
    max_clusters = models.PositiveSmallIntegerField(default=1)
    idle_minutes = models.PositiveIntegerField(default=10)
    budget_per_hour = models.DecimalField(null=True, blank=True, **MONEY)
    budget_total = models.DecimalField(null=True, blank=True, **MONEY)
    # Written by the console from billing on each round (level-triggered): one cluster's
    # price per hour now (None: not on the rate card) and what the pool's clusters have
    # been charged so far.
    rate_per_hour = models.DecimalField(null=True, blank=True, **MONEY)
    spent = models.DecimalField(default=0, **MONEY)
    balance = models.DecimalField(null=True, blank=True, **MONEY)  # the owner's, likewise
    # A team pool's: the GPUs its maker's GPU cap leaves (cap less what their clusters hold,
    # this pool's included), likewise; None: no cap. The autoscaler adds no cluster past it.
    gpu_room = models.PositiveIntegerField(null=True, blank=True)
    state = models.CharField(max_length=10, choices=State.choices, default=State.ACTIVE)
    created_at = models.DateTimeField(default=timezone.now)
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = gettext_lazy("pool")
        verbose_name_plural = gettext_lazy("pools")
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["owner", "name"],
                condition=models.Q(state="active"),
                name="pool_active_name_unique",
            )
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def is_cpu_only(self) -> bool:
        return self.instance_type_id is not None

    @property
    def shape(self) -> str:
        if self.is_cpu_only:
            return f"{self.nodes} x {self.instance_type}"
        return f"{self.nodes} x {self.gpus_per_node} {self.gpu_model}"

    @property
    def total_gpus(self) -> int:
        return 0 if self.is_cpu_only else self.nodes * self.gpus_per_node


class PoolEvent(TimelineEvent):
    """The pool's timeline: each decision to add or release a cluster, with its reason and
    the figures it used."""

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="events")
    message = models.CharField(max_length=500, blank=True)
    figures = models.JSONField(default=dict, blank=True)

    class Meta(TimelineEvent.Meta):
        verbose_name = gettext_lazy("pool event")
        verbose_name_plural = gettext_lazy("pool events")


class PoolSample(models.Model):
    """The pool's queue against its clusters at one moment (the pool page's chart)."""

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField(default=timezone.now)
    waiting = models.PositiveIntegerField(default=0)
    running = models.PositiveIntegerField(default=0)
    clusters = models.PositiveIntegerField(default=0)
    ready = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["pool", "at"], name="poolsample_pool_at_idx")]

    def __str__(self) -> str:
        return f"{self.pool_id} at {self.at}: {self.waiting} waiting, {self.clusters} clusters"


class Sweep(models.Model):
    """Trials of one command on a pool, searched by Optuna (ask and tell), the bad ones
    stopped early by its pruner (jobs/pools/sweeps.py)."""

    class State(models.TextChoices):
        RUNNING = "running", gettext_lazy("running")
        FINISHED = "finished", gettext_lazy("finished")
        CANCELLED = "cancelled", gettext_lazy("cancelled")

    class Direction(models.TextChoices):
        MINIMIZE = "minimize", gettext_lazy("minimise")
        MAXIMIZE = "maximize", gettext_lazy("maximise")

    class Pruner(models.TextChoices):
        ASHA = "asha", gettext_lazy("asynchronous successive halving (ASHA)")
        MEDIAN = "median", gettext_lazy("median rule")
        NONE = "none", gettext_lazy("none: every trial runs to its end")

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="sweeps"
    )
    # The person who started it (a team's member: they may cancel it; admins any).
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
        related_name="+",
    )  # fmt: skip
    pool = models.ForeignKey(Pool, on_delete=models.PROTECT, related_name="sweeps")
    name = models.CharField(max_length=100)
    command = models.TextField()
    env = models.JSONField(default=dict, blank=True)
    workdir = models.CharField(max_length=255, default="/workspace")
    # [{"name": "lr", "type": "log_uniform", "low": 1e-5, "high": 1e-1}, ...]
    space = models.JSONField(default=list)
    metric = models.CharField(max_length=64)
    direction = models.CharField(max_length=8, choices=Direction.choices)
    trials = models.PositiveSmallIntegerField()
    parallel = models.PositiveSmallIntegerField(default=1)
    pruner = models.CharField(max_length=8, choices=Pruner.choices, default=Pruner.ASHA)
    min_steps = models.PositiveIntegerField(
        default=1, help_text="Steps every trial runs before the pruner may stop it."
    )
    budget = models.DecimalField(
        null=True,
        blank=True,
        help_text="Stop at this much spent (its own charges), with the normal stop's grace; none: no budget.",
        **MONEY,
    )
    budget_stopped_at = models.DateTimeField(null=True, blank=True)
    # Billing's judgement (billing.budgets.enforce, each accrual tick): why the next trial
    # would pass the budget (a Text's JSON), None: it may start. `sweeps.advance` reads it.
    budget_hold = models.JSONField(null=True, blank=True, editable=False)
    study_name = models.CharField(max_length=80, unique=True)
    state = models.CharField(max_length=10, choices=State.choices, default=State.RUNNING)
    # Why no trial starts now (the pool may not add a cluster...), as for Trial.note.
    note = models.CharField(max_length=500, blank=True)
    note_text = models.JSONField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = gettext_lazy("sweep")
        verbose_name_plural = gettext_lazy("sweeps")
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.name


class Trial(models.Model):
    """One trial of a sweep: its parameters, its job, the metric it reported."""

    class State(models.TextChoices):
        RUNNING = "running", gettext_lazy("running")
        COMPLETE = "complete", gettext_lazy("complete")
        PRUNED = "pruned", gettext_lazy("pruned")
        FAILED = "failed", gettext_lazy("failed")
        CANCELLED = "cancelled", gettext_lazy("cancelled")  # with its sweep

    sweep = models.ForeignKey(Sweep, on_delete=models.CASCADE, related_name="trial_set")
    number = models.PositiveIntegerField()  # Optuna's trial number
    optuna_id = models.PositiveIntegerField()
    job = models.OneToOneField(
        Job, on_delete=models.SET_NULL, null=True, blank=True, related_name="trial"
    )
    params = models.JSONField(default=dict)
    state = models.CharField(max_length=10, choices=State.choices, default=State.RUNNING)
    # [[step, value], ...] in the order reported (capped: jobs/pools/sweeps.py).
    curve = models.JSONField(default=list, blank=True)
    last_step = models.BigIntegerField(null=True, blank=True)
    last_value = models.FloatField(null=True, blank=True)
    best_value = models.FloatField(null=True, blank=True)
    log_seq = models.BigIntegerField(default=0)  # the last log line read
    # What went wrong, in English, and as a jobs.base.text.Text shown in the reader's language.
    note = models.CharField(max_length=500, blank=True)
    note_text = models.JSONField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["number"]
        constraints = [
            models.UniqueConstraint(fields=["sweep", "number"], name="trial_sweep_number_unique")
        ]

    def __str__(self) -> str:
        return f"{self.sweep} #{self.number}"


class StorageGrant(models.Model):
    """Storage a researcher bought above the free part (SUANLI_STORAGE_FREE_GB), from a
    second on: one row per change, never edited once billed, so that every past second
    keeps the size it was billed at (billing/storage.py). The latest row at or before a
    second is in force then; none: only the free part. The filesystem's quota on the
    tenant's root is the free part plus the size in force (jobs/files/storage.py)."""

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="storage_grants"
    )
    extra_gb = models.PositiveIntegerField(
        gettext_lazy("bought GB"),
        help_text=gettext_lazy("GB above the free part (1 GB = 1024³ bytes)."),
    )
    since = models.DateTimeField(gettext_lazy("from"))
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        verbose_name = gettext_lazy("bought storage")
        verbose_name_plural = gettext_lazy("bought storage")
        ordering = ["owner", "-since"]
        constraints = [
            models.UniqueConstraint(fields=["owner", "since"], name="storagegrant_one_per_second")
        ]

    def __str__(self) -> str:
        return f"{self.owner_id}: +{self.extra_gb} GB from {self.since:%Y-%m-%d %H:%M:%S}"


class GpuSubscription(models.Model):
    """ "Tell me when N x <model> (in <zone>) are free" (订阅GPU通知), optionally "and rent
    them for me": a researcher's wish, checked against placement's own answer each cron tick
    and after GPUs come back (jobs/pools/subscriptions.py). It fires once (a conditional
    UPDATE of `state` and `fired_at` in the transaction of its event), or expires unnoticed."""

    class State(models.TextChoices):
        WAITING = "waiting", gettext_lazy("waiting")
        FIRED = "fired", gettext_lazy("fired")
        EXPIRED = "expired", gettext_lazy("expired")
        CANCELLED = "cancelled", gettext_lazy("cancelled")

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="gpu_subscriptions"
    )
    # The person who asked (a team's member: when it fires it rents as them, within their
    # caps, and only while they are still a member or above; see jobs/pools/subscriptions).
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
        related_name="+",
    )  # fmt: skip
    gpu_model = models.ForeignKey(GpuModel, on_delete=models.PROTECT, related_name="+")
    nodes = models.PositiveSmallIntegerField(default=1)
    gpus_per_node = models.PositiveSmallIntegerField()
    zone = models.CharField(max_length=40, blank=True, help_text="Empty: any zone.")
    state = models.CharField(max_length=10, choices=State.choices, default=State.WAITING)
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    fired_at = models.DateTimeField(null=True, blank=True)
    # "And rent them for me": the cluster request's fields as the API takes them (name,
    # image reference, ssh_keys, ...; checked again by jobs/clusters/spec.py when it fires),
    # and the most its price per hour may be. None: notify only.
    rent = models.JSONField(null=True, blank=True)
    budget_per_hour = models.DecimalField(null=True, blank=True, **MONEY)
    cluster = models.ForeignKey(
        Cluster, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    # What happened when it fired (a jobs.base.text.Text's as_json(): the cluster made, or
    # why renting was refused); empty otherwise.
    outcome = models.JSONField(default=dict, blank=True)

    class Meta:
        verbose_name = gettext_lazy("GPU subscription")
        verbose_name_plural = gettext_lazy("GPU subscriptions")
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["state", "expires_at"], name="gpusub_waiting_idx")]

    def __str__(self) -> str:
        return f"{self.nodes} x {self.gpus_per_node} {self.gpu_model_id} ({self.state})"

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def outcome_shown(self) -> str:
        return show_text(self.outcome) if self.outcome else ""

    @classmethod
    def cancel_waiting_of(cls, person, principal) -> int:
        """Cancel the waiting subscriptions `person` made for `principal` (a team they
        leave or are removed from: none of them may rent for the team any more), saying
        why on each; how many. A conditional UPDATE: one that fires at the same moment
        either fired first or is cancelled."""
        why = Text(
            gettext_noop("cancelled: %(person)s is no longer a member of the team"),
            person=person.get_username(),
        )
        return cls.objects.filter(
            owner=principal, created_by=person, state=cls.State.WAITING
        ).update(state=cls.State.CANCELLED, outcome=why.as_json())

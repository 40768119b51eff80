"""The engine's state: the fleet (hosts and their GPU slots) and the catalogs it offers."""

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone

from jobs import validators

MAX_GPUS_PER_HOST = 16


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

    class Meta:
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

    class Meta:
        ordering = ["vcpus", "memory_gb"]

    def __str__(self) -> str:
        return f"{self.name} ({self.vcpus} vCPU, {self.memory_gb} GB)"


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

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Host(models.Model):
    """A Docker engine the operator registered.

    `state` is what placement reads: *active* hosts take new work, *draining* hosts keep
    what runs on them, *down* hosts did not answer their last check. It is derived from
    the last check and the operator's drain flag, so a host that comes back from down
    returns to the state the operator left it in.
    """

    class State(models.TextChoices):
        ACTIVE = "active", "active"
        DRAINING = "draining", "draining"
        DOWN = "down", "down"

    name = models.CharField(max_length=63, unique=True, validators=[validators.validate_host_name])
    engine_url = models.CharField(
        max_length=255,
        help_text="unix:///var/run/docker.sock for a local engine, or tcp://HOST:2376 with TLS.",
    )
    tls_ca = models.TextField(
        "TLS CA certificate", blank=True, help_text="PEM. Required for tcp://."
    )
    tls_cert = models.TextField(
        "TLS client certificate", blank=True, help_text="PEM. Required for tcp://."
    )
    tls_key = models.TextField(
        "TLS client key", blank=True, help_text="PEM, unencrypted. Required for tcp://."
    )
    address = models.CharField(
        max_length=253,
        validators=[validators.validate_address],
        help_text="Where other hosts reach this one (jobs use it as MASTER_ADDR).",
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
    docker_version = models.CharField(max_length=40, blank=True)
    operating_system = models.CharField(max_length=120, blank=True)
    cpu_count = models.PositiveIntegerField(null=True, blank=True)
    memory_bytes = models.BigIntegerField(null=True, blank=True)
    last_checked = models.DateTimeField(null=True, blank=True)
    last_seen = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["zone", "name"]

    def __str__(self) -> str:
        return self.name

    @property
    def uses_tls(self) -> bool:
        return self.engine_url.startswith("tcp://")

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


class GpuSlot(models.Model):
    """One GPU of one host. A slot is held by at most one node (issue: clusters)."""

    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="slots")
    index = models.PositiveSmallIntegerField()

    class Meta:
        ordering = ["host", "index"]
        constraints = [
            models.UniqueConstraint(fields=["host", "index"], name="gpu_slot_unique_index")
        ]

    def __str__(self) -> str:
        return f"{self.host.name}/gpu{self.index}"

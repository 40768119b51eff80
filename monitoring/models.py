"""Samples of what a cluster's replicas use, one row per node per second, and their
minute rollups. Metrics are measurements, not money: floats are right here."""

from django.db import models

from jobs.models import Cluster, Host, Job


class Metrics(models.Model):
    """What one node of a cluster used over one period (a second, or a minute)."""

    at = models.DateTimeField(help_text="Start of the period (UTC, whole seconds).")
    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="+")
    job = models.ForeignKey(Job, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="+")
    node_index = models.PositiveSmallIntegerField()
    gpu_util = models.JSONField(default=list, help_text="Per GPU of the node, percent.")
    gpu_mem_mib = models.JSONField(default=list, help_text="Per GPU of the node, MiB used.")
    gpu_power_w = models.JSONField(
        default=list, blank=True, help_text="Per GPU of the node, watts; empty: no power reading."
    )
    gpu_source = models.CharField(
        max_length=8, help_text="nvml, dcgm, or derived (emulated-GPU host: from real CPU use)."
    )
    cpu_pct = models.FloatField(help_text="Percent of one core.")
    mem_bytes = models.BigIntegerField()
    net_rx_bps = models.FloatField()
    net_tx_bps = models.FloatField()
    disk_read_bps = models.FloatField()
    disk_write_bps = models.FloatField()
    read_iops = models.FloatField()
    write_iops = models.FloatField()

    class Meta:
        abstract = True


class Sample(Metrics):
    """One second. Kept for `SUANLI_METRICS_RAW_HOURS` (24), then only the rollups remain."""

    class Meta:
        indexes = [
            models.Index(fields=["cluster", "at"], name="sample_cluster_at"),
            models.Index(fields=["job", "at"], name="sample_job_at"),
            models.Index(fields=["at"], name="sample_at"),
        ]

    def __str__(self) -> str:
        return f"cluster {self.cluster_id} node {self.node_index} at {self.at:%H:%M:%S}"


class Rollup(Metrics):
    """One minute: the means of its seconds (`samples` of them)."""

    samples = models.PositiveSmallIntegerField()

    class Meta:
        indexes = [
            models.Index(fields=["cluster", "at"], name="rollup_cluster_at"),
            models.Index(fields=["job", "at"], name="rollup_job_at"),
            models.Index(fields=["at"], name="rollup_at"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["cluster", "node_index", "at"], name="rollup_unique_minute"
            )
        ]

    def __str__(self) -> str:
        return f"cluster {self.cluster_id} node {self.node_index} minute {self.at:%H:%M}"


class TraceSummary(models.Model):
    """One profiler trace of a job's attempt (a file in its SUANLI_PROFILE_DIR), summarised
    once by the worker (`monitoring.tasks.profiles_summarise`) and kept: made again only
    when the file's size or time changes. `summary` is `monitoring.traces.summarise`'s
    dict (or HTA's, for a trace with GPU kernels); `error` says why there is none."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="trace_summaries")
    attempt = models.PositiveSmallIntegerField()
    name = models.CharField(max_length=255)
    size = models.BigIntegerField()
    mtime = models.FloatField(help_text="The file's modification time (Unix seconds).")
    rank = models.IntegerField(null=True, blank=True)
    summary = models.JSONField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True, help_text="English.")
    # The error as a jobs.base.text.Text, shown in the reader's language.
    error_text = models.JSONField(null=True, blank=True, editable=False)
    seconds = models.FloatField(default=0.0, help_text="How long the summary took.")
    made_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["job", "attempt", "name"], name="trace_summary_file"),
        ]
        ordering = ["attempt", "rank", "name"]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.attempt} {self.name}"

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

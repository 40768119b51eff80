"""The token JSON API under /api/v1/ (console/api.py)."""

from django.urls import path, re_path

from console import api

urlpatterns = [
    path("schema", api.schema, name="api_schema"),
    path("clusters", api.clusters, name="api_clusters"),
    path("clusters/<int:cluster_id>", api.cluster, name="api_cluster"),
    path("clusters/<int:cluster_id>/release", api.cluster_release, name="api_cluster_release"),
    path("clusters/<int:cluster_id>/resize", api.cluster_resize, name="api_cluster_resize"),
    path("jobs", api.jobs, name="api_jobs"),
    path("jobs/<int:job_id>", api.job, name="api_job"),
    path("jobs/<int:job_id>/cancel", api.job_cancel, name="api_job_cancel"),
    path("jobs/<int:job_id>/log", api.job_log, name="api_job_log"),
    path("balance", api.balance, name="api_balance"),
    re_path(r"^.*$", api.not_found),  # a JSON 404, not the HTML page, for scripts
]

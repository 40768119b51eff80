"""Websocket routes. Each consumer authorises in connect() before it sends anything."""

from django.urls import path

from console import consumers, terminal

websocket_urlpatterns = [
    path("ws/jobs/<int:job_id>/log/", consumers.JobLogConsumer.as_asgi()),
    path("ws/clusters/<int:cluster_id>/metrics/", consumers.ClusterMetricsConsumer.as_asgi()),
    path(
        "ws/clusters/<int:cluster_id>/nodes/<int:index>/terminal/",
        terminal.TerminalConsumer.as_asgi(),
    ),
]

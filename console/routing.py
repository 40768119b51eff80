"""Websocket routes. Each consumer authorises in connect() before it sends anything."""

from django.urls import path

from console import consumers, terminal

websocket_urlpatterns = [
    path("ws/jobs/<int:job_id>/log/", consumers.job_log_app()),
    path("ws/clusters/<int:cluster_id>/metrics/", consumers.ClusterMetricsConsumer.as_asgi()),
    path("ws/images/builds/<int:build_id>/log/", consumers.BuildLogConsumer.as_asgi()),
    path(
        "ws/clusters/<int:cluster_id>/nodes/<int:index>/terminal/",
        terminal.TerminalConsumer.as_asgi(),
    ),
    # The workspace apps' own websockets are on their own origins (console/asgi.py).
]

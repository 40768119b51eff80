"""Websocket routes. Each consumer authorises in connect() before it sends anything."""

from django.urls import path, re_path

from console import consumers, proxy, terminal

websocket_urlpatterns = [
    path("ws/jobs/<int:job_id>/log/", consumers.job_log_app()),
    path("ws/clusters/<int:cluster_id>/metrics/", consumers.ClusterMetricsConsumer.as_asgi()),
    path("ws/images/builds/<int:build_id>/log/", consumers.BuildLogConsumer.as_asgi()),
    path(
        "ws/clusters/<int:cluster_id>/nodes/<int:index>/terminal/",
        terminal.TerminalConsumer.as_asgi(),
    ),
    # The workspace apps' own websockets (JupyterLab's kernels and terminals), proxied.
    re_path(
        r"^clusters/[1-9][0-9]{0,17}/nodes/[0-9]{1,3}/(?:jupyter|tensorboard|service)/",
        proxy.AppSocket.as_asgi(),
    ),
]

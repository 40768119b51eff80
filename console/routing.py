"""Websocket routes. Each consumer authorises in connect() (live logs and charts come
with the jobs and monitoring issues)."""

websocket_urlpatterns: list = []

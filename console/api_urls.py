"""The token JSON API under /api/v1/ (console/api.py)."""

urlpatterns: list = []
